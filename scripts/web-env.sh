#!/usr/bin/env bash
# The browser device's tests (device_runtime/web): JavaScript unit tests under Node against fixtures that the
# Python device writes, then (appended below) the real-browser tests.
#
# 1. `npm ci` in device_runtime/web: onnxruntime-web, fflate, and pngjs, typescript and biome (tests only) at the
#    lockfile's exact versions and integrity hashes (npm registry only; node >= 20 and npm must be installed).
#    `biome ci` then lints and checks the formatting of src/, test/ and types/ (biome.json: 120 columns, the
#    Python's line length), and `tsc` the types of every module of the page (tsconfig.json: JSDoc types, strict).
# 2. PYTHON (default .venv/bin/python, with the export extra) writes the fixtures into a temporary folder:
#    the device contract (contract.json) and Python's verdict on sample round settings, a tiny BatchNorm cnn
#    bundle, the Python portable engine's tensors after steps and a round, files written by Python's
#    safetensors, PNGs and the Python loader's arrays of them.
# 3. `node --test` runs device_runtime/web/test/*.test.mjs against them (EDGEPFL_WEB_FIXTURES).
#
# Usage: scripts/web-env.sh [npm|chromium|test]  (no argument: all three in turn; scripts/full-run.sh runs `npm`
#        before the main tests, which serve the page's runtime, and `chromium` beside them)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
PYTHON="${PYTHON:-.venv/bin/python}"
case "$PYTHON" in /*) ;; *) PYTHON="$ROOT/$PYTHON" ;; esac

# Debian's chromium for the real-browser tests (tests/test_web_browser.py and the others marked `browser`) is
# installed when it is missing and we are root (they skip, saying so, only where no browser can be installed).
STEP="${1:-all}"
if [ "$STEP" = all ] || [ "$STEP" = chromium ]; then
    if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    fi
fi
if [ "$STEP" = all ] || [ "$STEP" = npm ]; then
    (cd device_runtime/web && npm ci --no-audit --no-fund --loglevel=error)
fi
[ "$STEP" = all ] || [ "$STEP" = test ] || exit 0
WEB_TMP="$(mktemp -d)"
trap 'rm -rf "$WEB_TMP"' EXIT

(cd device_runtime/web && node_modules/.bin/biome ci --error-on-warnings . && node_modules/.bin/tsc -p .)

export EDGEPFL_WEB_FIXTURES="$WEB_TMP/fixtures"
export EDGEPFL_WEB_PYTHON="$PYTHON"
"$PYTHON" device_runtime/web/test/make_fixtures.py "$EDGEPFL_WEB_FIXTURES"
(cd device_runtime/web && node --test test/*.test.mjs)

# 4. The real-browser tests (tests/stages.py's browser stage): a phone-sized headless chromium against `edgepfl serve`
#    and Python devices, driven by Playwright's Python package (the test extra). Screenshots of each stage go to a
#    scratch folder; EDGEPFL_WEB_SCREENSHOTS=1 writes them into docs/img/web-*.png instead (to refresh the ones
#    docs/web-device.md shows).
EDGEPFL_STAGE=browser "$PYTHON" -m pytest -q -m browser -rs $("$PYTHON" tests/stages.py browser)
