"""bench/reproduce.py --report: runs that stopped at different rounds are compared within their series.

The k series (k4: FedAvg, FedPer, Local) and the kp series (kp1..kp4: FedPer with K_P 1..4) share the partition
classes:4; a short FedAvg run of the k series must not cut the K_P comparison to its round.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from reproduce import _at_common_round, _natural, _series  # noqa: E402


def _run(seed: int, accuracies: list[float], partition: str = "classes:4") -> SimpleNamespace:
    rounds = [SimpleNamespace(test_accuracy={"per_client": [value, value]}) for value in accuracies]
    config = SimpleNamespace(data=SimpleNamespace(partition=partition), seed=seed)
    return SimpleNamespace(persfl=None, config=config, rounds=rounds)


def test_series_and_natural_order():
    assert _series("fedper-paper/kp3/fedper") == "kp"
    assert _series("fedper-paper/k10/fedavg") == "k"
    assert sorted(["s/k10/a", "s/kp1/a", "s/k4/a"], key=_natural) == ["s/k4/a", "s/k10/a", "s/kp1/a"]


def test_common_round_is_taken_per_series_and_seed():
    groups = {
        "s/k4/fedavg": [_run(0, [0.1, 0.2, 0.3]), _run(1, [0.1])],  # seed 1 stopped after round 1
        "s/k4/fedper": [_run(0, [0.4, 0.5, 0.6, 0.7]), _run(1, [0.4, 0.5])],
        "s/kp1/fedper": [_run(0, [0.2, 0.3]), _run(1, [0.3, 0.4])],
        "s/kp2/fedper": [_run(0, [0.4, 0.5, 0.6, 0.7]), _run(1, [0.4, 0.5])],
    }
    lines = _at_common_round(groups, list(groups))
    text = "\n".join(lines)
    assert "The runs (k4) stopped" in text and "(seed 0: round 3, seed 1: round 1)" in text
    assert "- s/k4/fedper: 60.0 / 40.0" in lines
    assert "The runs (kp1, kp2) stopped" in text and "(seed 0: round 2, seed 1: round 2)" in text
    assert "- s/kp2/fedper: 50.0 / 50.0" in lines  # not cut to seed 1's round 1 by the k series
