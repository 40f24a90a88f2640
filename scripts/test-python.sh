#!/usr/bin/env bash
# Python binding tests: builds the kvstream wheel (scripts/build-wheel.sh), installs it into a
# fresh venv (target/pyvenv) with pytest, and runs crates/kvstream-py/python/tests. Works on a fresh machine
# with Rust, Python >= 3.9 and network access to PyPI; without torch or a GPU the GPU tests are
# skipped. Fails (non-zero) if the build or any test fails.
# Extra arguments go to pytest, e.g. `bash scripts/test-python.sh -k gpu -v`.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
PYTHON="$PYTHON" bash scripts/build-wheel.sh

rm -rf target/pyvenv
# KVSTREAM_PY_SYSTEM_SITE=1 lets the test venv see the base interpreter's packages (torch on a
# GPU machine, to run test_gpu.py); by default it is isolated and the GPU tests are skipped.
VENV_FLAGS=()
[ "${KVSTREAM_PY_SYSTEM_SITE:-0}" = 1 ] && VENV_FLAGS+=(--system-site-packages)
"$PYTHON" -m venv "${VENV_FLAGS[@]}" target/pyvenv
target/pyvenv/bin/python -m pip install --quiet --disable-pip-version-check pytest target/wheels/kvstream-*.whl

# Run from outside the source tree so that the installed package (with _native) is imported,
# not crates/kvstream-py/python/kvstream.
TESTS="$PWD/crates/kvstream-py/python/tests"
cd target && pyvenv/bin/python -m pytest "$TESTS" -q -p no:cacheprovider --rootdir "$TESTS" "$@"
