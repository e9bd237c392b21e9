#!/usr/bin/env bash
# The device runtime's tests where a device stands: edgepfl installed without the export extra, no torch.
#
# 1. With the development environment's Python (torch + exporter), export the bundles the device tests use.
# 2. Create VENV (default .venv-device) with `pip install -e '.[server]'` (the device's dependencies, and
#    the server the end-to-end tests talk to; no torch), and run the device tests there against that bundle.
#
# Usage: scripts/device-env.sh            (EXPORT_PYTHON defaults to .venv/bin/python, VENV to .venv-device)
set -euo pipefail
cd "$(dirname "$0")/.."
EXPORT_PYTHON="${EXPORT_PYTHON:-.venv/bin/python}"
VENV="${VENV:-.venv-device}"
BUNDLES="$(mktemp -d)"
trap 'rm -rf "$BUNDLES"' EXIT

"$EXPORT_PYTHON" - "$BUNDLES" <<'PY'
import sys

sys.path[:0] = ["tests"]
from conftest import bundle_folder, export_test_bundle
from test_device_runtime import BN_BUNDLE, DEVICE_BUNDLE

for bundle in (DEVICE_BUNDLE, BN_BUNDLE):
    export_test_bundle(bundle_folder(sys.argv[1], **bundle), **bundle)
PY

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q -e '.[server]' pytest
"$VENV/bin/python" - <<'PY'
import importlib.util

assert importlib.util.find_spec("torch") is None, "torch must not be installed in the device environment"
import onnxruntime

print("device environment: onnxruntime", onnxruntime.__version__, "without torch")
PY
EDGEPFL_TEST_BUNDLES="$BUNDLES" "$VENV/bin/python" -m pytest -q -p no:cacheprovider -rs \
    tests/test_device_runtime.py tests/test_device_e2e.py
