#!/usr/bin/env bash
# The test command of the README. Works on a fresh machine with Rust and Python 3 (and PyPI):
# installs NVRTC 13.0 (the nvidia-cuda-nvrtc wheel) into the git-ignored .nvrtc/ folder if it
# is not there yet, puts it on the library path, runs every Rust test of the workspace, then
# builds the Python wheel and runs the Python tests (scripts/test-python.sh). Every kernel
# variant is compiled to sm_90a by the tests, so a missing NVRTC or a kernel that does not
# compile fails the run. GPU tests are marked ignored (Rust) or skipped without a GPU (Python);
# on an H100/H200 run them with
#   cargo test -p kvstream --release --test gpu -- --ignored --test-threads=1
#   KVSTREAM_PY_SYSTEM_SITE=1 bash scripts/test-python.sh
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

# cuobjdump + nvdisasm read the SASS of the compiled kernels (crates/kvstream/tests/common/sass.rs, run by tests/nvrtc.rs).
SASS_TOOLS_VERSION=13.5.37
SASS_BIN="$PWD/.nvrtc/sass-tools/nvidia/cu13/bin"
if [ ! -x "$SASS_BIN/cuobjdump" ] || [ ! -x "$SASS_BIN/nvdisasm" ]; then
    echo "installing cuobjdump and nvdisasm $SASS_TOOLS_VERSION into .nvrtc/sass-tools/ ..."
    python3 -m pip install --quiet --disable-pip-version-check --no-deps --target .nvrtc/sass-tools \
        "nvidia-cuda-cuobjdump==$SASS_TOOLS_VERSION" "nvidia-cuda-nvdisasm==$SASS_TOOLS_VERSION"
    chmod +x "$SASS_BIN"/*
fi
export PATH="$SASS_BIN:$PATH"

cargo test --workspace --release
bash scripts/test-python.sh
