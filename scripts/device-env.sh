#!/usr/bin/env bash
# The device runtime's tests where a device stands: edgepfl installed without the export extra, no torch.
#
# 1. With the development environment's Python (torch + exporter), export the bundles the device tests use.
# 2. Create VENV (default .venv-device) with `pip install -e '.[server]'` (the device's dependencies, and
#    the server the end-to-end tests talk to; no torch), and run the device tests there against that bundle.
#
# Usage: scripts/device-env.sh [install]  (EXPORT_PYTHON defaults to .venv/bin/python, VENV to .venv-device;
#        `install` only makes the environment; EDGEPFL_TEST_BUNDLES, when set, is the run's shared bundle folder)
set -euo pipefail
cd "$(dirname "$0")/.."
EXPORT_PYTHON="${EXPORT_PYTHON:-.venv/bin/python}"
VENV="${VENV:-.venv-device}"

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q -e '.[server]' pytest
[ "${1:-}" = install ] && exit 0

if [ -z "${EDGEPFL_TEST_BUNDLES:-}" ]; then
    EDGEPFL_TEST_BUNDLES="$(mktemp -d)"
    trap 'rm -rf "$EDGEPFL_TEST_BUNDLES"' EXIT
fi
export EDGEPFL_TEST_BUNDLES
"$EXPORT_PYTHON" - <<'PY'
import os
import sys

sys.path[:0] = ["tests"]
from conftest import bundle_key, export_shared_bundle
from test_device_runtime import BN_BUNDLE, DEVICE_BUNDLE

for bundle in (DEVICE_BUNDLE, BN_BUNDLE):
    export_shared_bundle(os.environ["EDGEPFL_TEST_BUNDLES"], bundle_key(**bundle))
PY
"$VENV/bin/python" - <<'PY'
import importlib.util

assert importlib.util.find_spec("torch") is None, "torch must not be installed in the device environment"
import onnxruntime

print("device environment: onnxruntime", onnxruntime.__version__, "without torch")
PY
EDGEPFL_STAGE=device "$VENV/bin/python" -m pytest -q -p no:cacheprovider -rs $(python3 tests/stages.py device)
