#!/usr/bin/env bash
# The gate: the linters and every main-stage test not marked `slow` (tests/stages.py), about ten minutes on two cores;
# run it before each commit. The full run (scripts/full-run.sh, what CI runs) adds the slow tests and the portable,
# device and browser stages. Marked slow: a test over ~15 s on a full run, and every test that starts `serve`, a
# browser or a torchvision export (docs/testing.md).
#
# Usage: scripts/gate.sh [pytest arguments]   (in a checkout with `.venv` made as the README says)
set -euo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
BUNDLES="$(mktemp -d)"
trap 'rm -rf "$BUNDLES"' EXIT
.venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/python scripts/lint_imports.py
EDGEPFL_STAGE=main EDGEPFL_TEST_BUNDLES="${EDGEPFL_TEST_BUNDLES:-$BUNDLES}" \
    .venv/bin/python -m pytest -q -n 2 --dist loadfile -m "not slow and not arm and not browser" --durations=10 "$@"
echo "the gate passed in $((SECONDS - START)) s"
