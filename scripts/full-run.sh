#!/usr/bin/env bash
# The full run, what `.ci/run` and the README's test command run once edgepfl is installed: the linters, then every
# test exactly once in the stage that owns it (tests/stages.py): `main` here, then `portable`, `device` and the
# browser's (scripts/portable-env.sh, device-env.sh, web-env.sh). Each stage prints its time and pytest its 25
# slowest tests. The later stages' environments install while the main tests run, and the bundles the tests export
# go into one folder shared by pytest's workers and every stage (EDGEPFL_TEST_BUNDLES), so each is exported once.
#
# Usage: scripts/full-run.sh       (in a checkout with `.venv` made as the README says; scripts/gate.sh is the
#                                   ten-minute subset)
set -euo pipefail
cd "$(dirname "$0")/.."
RUN="$(mktemp -d)"
trap 'rm -rf "$RUN"' EXIT
export EDGEPFL_TEST_BUNDLES="$RUN/bundles"
mkdir "$EDGEPFL_TEST_BUNDLES"
START=$SECONDS

timed() { # timed NAME COMMAND...: one stage, and how long it took
    local name="$1" begun=$SECONDS
    shift
    "$@"
    printf 'stage %-8s %5d s   (the run so far: %d s)\n' "$name" $((SECONDS - begun)) $((SECONDS - START))
}

side_by_side() { # side_by_side NAME COMMAND...: start an install in the background, its output in a log
    "${@:2}" >"$RUN/$1.log" 2>&1 &
    echo $! >"$RUN/$1.pid"
}

joined() { # joined NAME: wait for a background install; its log when it failed
    wait "$(cat "$RUN/$1.pid")" || {
        cat "$RUN/$1.log"
        echo "the $1 install failed (its log is above)" >&2
        return 1
    }
}

timed lint bash -c '.venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/python scripts/lint_imports.py'
timed npm bash scripts/web-env.sh npm
side_by_side chromium bash scripts/web-env.sh chromium
side_by_side portable bash scripts/portable-env.sh install
side_by_side device bash scripts/device-env.sh install
timed main env EDGEPFL_STAGE=main .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=25
joined portable
timed portable bash scripts/portable-env.sh
joined device
timed device bash scripts/device-env.sh
joined chromium
timed web bash scripts/web-env.sh test
echo "the full run passed in $((SECONDS - START)) s"
