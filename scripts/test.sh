#!/usr/bin/env bash
# The test command of the README. Works on a fresh machine with Rust and Python 3:
# installs NVRTC 13.0 (the nvidia-cuda-nvrtc wheel) into the git-ignored .nvrtc/ folder if it
# is not there yet, puts it on the library path, and runs every test of the workspace. Every
# kernel variant is compiled to sm_90a by the tests, so a missing NVRTC or a kernel that does
# not compile fails the run. GPU tests are marked ignored; on an H100/H200 run them with
#   cargo test -p kvstream --release --test gpu -- --ignored --test-threads=1
set -euo pipefail
cd "$(dirname "$0")/.."

NVRTC_VERSION=13.0.88
NVRTC_LIB="$PWD/.nvrtc/nvidia/cu13/lib"
if [ ! -f "$NVRTC_LIB/libnvrtc.so.13" ]; then
    echo "installing NVRTC $NVRTC_VERSION into .nvrtc/ ..."
    python3 -m pip install --quiet --disable-pip-version-check --no-deps --target .nvrtc \
        "nvidia-cuda-nvrtc==$NVRTC_VERSION"
fi
export LD_LIBRARY_PATH="$NVRTC_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

cargo test --workspace --release "$@"
