#!/usr/bin/env bash
# Python binding tests: builds the kvstream wheel (scripts/build-wheel.sh), installs it into a
# fresh venv (target/pyvenv) with pytest and torch (CPU-side tests of the custom ops), and runs
# crates/kvstream-py/python/tests. Works on a fresh machine with Rust, Python >= 3.9 and network
# access to PyPI; without a GPU the GPU tests are skipped. Fails (non-zero) if the build or any test fails.
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
PIP=(target/pyvenv/bin/python -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" pytest target/wheels/kvstream-*.whl
# torch for the CPU tests of the torch custom ops (tests/test_ops.py: schemas, fake tensors,
# torch.compile tracing): the CPU wheel from PyTorch's index, else PyPI's. A torch the venv
# already sees (KVSTREAM_PY_SYSTEM_SITE=1 on a GPU machine) is kept; KVSTREAM_PY_TORCH=0 skips
# the install (those tests are then skipped).
if [ "${KVSTREAM_PY_TORCH:-1}" = 1 ] && ! target/pyvenv/bin/python -c "import torch" 2>/dev/null; then
    start=$SECONDS
    "${PIP[@]}" --retries 0 --timeout 20 --index-url https://download.pytorch.org/whl/cpu \
        torch numpy 2>/dev/null || "${PIP[@]}" torch numpy
    echo "torch $(target/pyvenv/bin/python -c 'import torch; print(torch.__version__)' 2>/dev/null) installed in $((SECONDS - start)) s"
fi
# transformers for the CPU tests of its attention backend (tests/test_transformers.py): the
# registration, tiny random models built with attn_implementation="kvstream", the mapping of
# windows, softcap and sinks (skipped, like the torch tests, where KVSTREAM_PY_TORCH=0).
if [ "${KVSTREAM_PY_TORCH:-1}" = 1 ] && ! target/pyvenv/bin/python -c "import transformers" 2>/dev/null; then
    "${PIP[@]}" "transformers>=5.17,<6"
fi

# Run from outside the source tree so that the installed package (with _native) is imported,
# not crates/kvstream-py/python/kvstream.
TESTS="$PWD/crates/kvstream-py/python/tests"
cd target && pyvenv/bin/python -m pytest "$TESTS" -q -p no:cacheprovider --rootdir "$TESTS" "$@"
