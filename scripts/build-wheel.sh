#!/usr/bin/env bash
# Builds the kvstream wheel into target/wheels (an abi3 wheel for Python >= 3.9, manylinux2014:
# zig links against an old glibc, so it installs on any x86-64 Linux without a manylinux
# container). Works on a fresh machine with Rust, Python >= 3.9 and network access to PyPI (for
# maturin and zig, installed once into target/pytools). Install it with
#   pip install target/wheels/kvstream-*.whl && python -c "import kvstream; kvstream.self_test()"
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
TOOLS=target/pytools   # maturin and zig live here, apart from any test venv
if [ ! -x "$TOOLS/bin/maturin" ] || ! "$TOOLS/bin/python" -c "import ziglang" 2>/dev/null; then
    echo "installing maturin and zig into $TOOLS ..."
    "$PYTHON" -m venv "$TOOLS"
    "$TOOLS/bin/python" -m pip install --quiet --disable-pip-version-check "maturin==1.*" "ziglang==0.13.*"
fi

rm -rf target/wheels
PATH="$PWD/$TOOLS/bin:$PATH" "$TOOLS/bin/maturin" build --release -m crates/kvstream-py/Cargo.toml \
    -o target/wheels --zig --compatibility manylinux2014 --interpreter "$TOOLS/bin/python"
ls target/wheels/kvstream-*.whl
