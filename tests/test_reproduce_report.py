"""bench/reproduce.py --report: runs that stopped at different rounds are compared within their series; bench/paired.py
holds each run against FedAvg client by client.

The k series (k4: FedAvg, FedPer, Local) and the kp series (kp1..kp4: FedPer with K_P 1..4) share the partition
classes:4; a short FedAvg run of the k series must not cut the K_P comparison to its round.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import numpy as np  # noqa: E402
import paired  # noqa: E402
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


def _scored(test: list[list[float | None]], val: list[list[float]] | None = None, trained=None, names=None, seed=0):
    """A run of `seed` whose round r scored test[r] (per client) held, val[r] on validation and trained[r] after
    training."""
    rounds = [
        SimpleNamespace(
            test_accuracy={"per_client": t},
            val_accuracy={"per_client": (val or test)[r]},
            trained_test_accuracy={"per_client": trained[r]} if trained else None,
        )
        for r, t in enumerate(test)
    ]
    config = SimpleNamespace(seed=seed)
    return SimpleNamespace(persfl=None, rounds=rounds, info={"client_names": names or ["a", "b"]}, config=config)


def test_last_rounds_average_each_clients_scores_and_skip_the_rounds_it_has_none():
    run = _scored([[0.0, 0.0]] + [[0.2, 0.4]] * 9 + [[0.4, 0.4]], trained=[[0.5, None]] * 10 + [[None, None]])
    assert np.allclose(paired.last_rounds(run), [0.22, 0.4])  # round 1 is left out: 11 rounds
    assert np.allclose(paired.last_rounds(run, "trained_test_accuracy"), [0.5, np.nan], equal_nan=True)


def test_own_pick_is_each_clients_test_score_at_its_earliest_best_validation_round():
    run = _scored([[0.1, 0.5], [0.2, 0.6], [0.3, 0.7]], val=[[0.9, 0.1], [0.9, 0.2], [0.8, 0.2]])
    assert np.allclose(paired.own_pick(run), [0.1, 0.6])  # client a: round 1 (tie with 2), client b: round 2


def test_paired_difference_averages_the_seeds_per_client_and_bounds_the_mean():
    base = [np.array([0.1, 0.2, 0.3, 0.4]), np.array([0.2, 0.2, 0.2, 0.2])]
    method = [base[0] + [0.1, 0.2, -0.1, 0.0], base[1] + [0.1, 0.0, -0.1, 0.2]]
    result = paired.paired(method, base)
    assert np.isclose(result["mean"], 0.05) and result["above"] == 3 and result["below"] == 1 and result["clients"] == 4
    assert np.allclose(result["seeds"], [0.05, 0.05]) and np.allclose(result["per_client"], [0.1, 0.1, -0.1, 0.1])
    assert -0.1 - 1e-9 <= result["low"] < result["mean"] < result["high"] <= 0.1 + 1e-9
    assert (paired.paired(method, base)["low"], paired.paired(method, base)["high"]) == (result["low"], result["high"])


def test_paired_table_holds_each_run_and_fine_tuning_against_fedavg_on_the_same_clients():
    rounds = paired.LAST_ROUNDS
    fedavg = _scored([[0.1, 0.2]] * rounds, trained=[[0.05, 0.1]] * rounds)
    seed1 = _scored([[0.9, 0.9]] * rounds, trained=[[0.9, 0.9]] * rounds, seed=1)  # a seed no other run has
    groups = {
        "t/none/fedavg": [fedavg, seed1],
        "t/input/fedalt": [_scored([[0.2, 0.3]] * rounds)],
        "t/output/fedalt": [_scored([[0.2, 0.3, 0.4]] * rounds, names=["a", "b", "c"])],  # other clients: no row
        "t/none/short": [_scored([[0.2, 0.3]] * (rounds - 1))],  # fewer rounds than the mean needs: no row
    }
    lines = paired.table("t", list(groups), groups, finetuned="fedavg+ft")
    rows = {line.split(" | ")[0][2:]: line for line in lines if line.startswith("| t/")}
    assert set(rows) == {"t/none/fedavg", "t/none/fedavg+ft", "t/input/fedalt"}
    assert "+10.0 [+10.0, +10.0] (seeds +10.0), 2 above and 0 below of 2" in rows["t/input/fedalt"]
    assert "+10.0 [+10.0, +10.0] (seeds +10.0), 2 above" in rows["t/input/fedalt"]  # on seed 0, the one both have
    assert rows["t/none/fedavg+ft"].endswith("| - | - |") and "(seeds -7.5 / +0.0)" in rows["t/none/fedavg+ft"]
    assert paired.table("t", ["t/input/fedalt"], groups) == []  # no FedAvg run: nothing to hold against
