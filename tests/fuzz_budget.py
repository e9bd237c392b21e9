"""How many examples a fuzz test runs: a fixed, derandomized count in CI, scaled and seeded by scripts/fuzz.sh.

EDGEPFL_FUZZ_SCALE multiplies every count (CI: unset, 1); EDGEPFL_FUZZ_SEED draws the examples from that seed
instead of Hypothesis' derandomized stream; EDGEPFL_FUZZ_REPORT is a JSON-lines file each fuzz test appends
what it ran to (the long run's report). device_runtime/web/test/fuzzing.mjs reads the same three for the page.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from hypothesis import HealthCheck, Phase, settings

SCALE = float(os.environ.get("EDGEPFL_FUZZ_SCALE") or 1)
SEED = os.environ.get("EDGEPFL_FUZZ_SEED")
REPORT = os.environ.get("EDGEPFL_FUZZ_REPORT")


def examples(count: int) -> int:
    """`count` scaled (at least 1)."""
    return max(1, round(count * SCALE))


def fuzz_settings(count: int, steps: int | None = None, shrink: bool = True) -> settings:
    """Hypothesis settings for `count` examples (and `steps` rule calls per example of a state machine); `shrink`
    False for a live server, where shrinking replays a failure for minutes against state that moved on."""
    return settings(
        max_examples=examples(count),
        **({} if shrink else {"phases": [Phase.explicit, Phase.reuse, Phase.generate]}),
        deadline=None,
        derandomize=SEED is None,
        database=None,
        suppress_health_check=list(HealthCheck),
        **({"stateful_step_count": steps} if steps else {}),
    )


def seeded(test: Callable) -> Callable:
    """Draw a test's examples from EDGEPFL_FUZZ_SEED when set (else the derandomized stream)."""
    from hypothesis import seed

    return seed(int(SEED))(test) if SEED is not None else test


@contextmanager
def reported(name: str, counter: dict[str, int] | None = None) -> Iterator[dict[str, int]]:
    """Time a fuzz run and append {suite, property, examples, steps, seconds, seed} to EDGEPFL_FUZZ_REPORT;
    the caller counts into the yielded dict ("examples", "steps")."""
    counts = counter if counter is not None else {"examples": 0, "steps": 0}
    start = time.monotonic()
    yield counts
    if REPORT:
        line: dict[str, Any] = {"suite": "python", "property": name, **counts}
        line.update(seconds=round(time.monotonic() - start, 1), seed=SEED or "derandomized")
        with open(REPORT, "a", encoding="utf-8") as report:
            report.write(json.dumps(line) + "\n")
