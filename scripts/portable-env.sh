#!/usr/bin/env bash
# The portable engine's tests in a device-like environment: plain onnxruntime (no training build), no torch.
#
# 1. With the development environment's Python (torch + exporter), export the cnn test bundle and PyTorch's
#    results on fixed batches into a case folder.
# 2. Create VENV (default .venv-portable) with plain onnxruntime and the device's small dependencies,
#    install edgepfl without dependencies, and run the torch-free portable tests against that case.
#
# Usage: scripts/portable-env.sh [install]  (EXPORT_PYTHON defaults to .venv/bin/python, VENV to .venv-portable;
#        `install` only makes the environment, which scripts/full-run.sh does while the main tests run)
set -euo pipefail
cd "$(dirname "$0")/.."
EXPORT_PYTHON="${EXPORT_PYTHON:-.venv/bin/python}"
VENV="${VENV:-.venv-portable}"

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q onnxruntime numpy safetensors typer rich httpx pillow pytest filelock
"$VENV/bin/python" -m pip install -q --no-deps -e .
[ "${1:-}" = install ] && exit 0

CASE="$(mktemp -d)"
trap 'rm -rf "$CASE"' EXIT
"$EXPORT_PYTHON" tests/test_portable.py make-case "$CASE" >/dev/null
"$VENV/bin/python" - <<'PY'
import importlib.util
import onnxruntime
assert importlib.util.find_spec("torch") is None, "torch must not be installed in the portable environment"
assert not hasattr(onnxruntime.capi._pybind_state, "Module"), "this is the training build, not plain onnxruntime"
print("plain onnxruntime", onnxruntime.__version__)
PY
# The tests that take the case run against it (a missing case fails, never skips); the file's other tests need
# torch and run in the main stage (tests/stages.py).
EDGEPFL_STAGE=portable EDGEPFL_PORTABLE_CASE="$CASE" "$VENV/bin/python" -m pytest -q -p no:cacheprovider -rs \
    $(python3 tests/stages.py portable)
