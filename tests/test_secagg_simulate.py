"""`edgepfl simulate --secure-aggregation` (issue 34): the simulated clients mask their updates through the served
round engine's secure calls; the run is reproducible and learns as the plain run does."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")

from test_simulate import tiny_config, tiny_npz  # noqa: E402, F401 - the fixture

from edgepfl.errors import UsageError  # noqa: E402
from edgepfl.secagg.config import FIRST_CLIP, FIRST_WEIGHT_SCALE  # noqa: E402
from edgepfl.server.secure.rounds import NEXT_KEY  # noqa: E402
from edgepfl.server.store import Store  # noqa: E402
from edgepfl.simulate.loop import run_simulation  # noqa: E402
from edgepfl.simulate.rounds import SERVER_DIR, final_global_base  # noqa: E402

SECURE = {"secure_aggregation": True, "secagg_clip": 5.0, "secagg_max_weight": 200}  # --min-clients 1: 4 a round


@pytest.mark.slow
def test_a_secure_simulation_is_reproducible_and_learns_as_the_plain_one(tiny_npz, tmp_path):  # noqa: F811
    runs = {}
    for name, changes in (("secure", SECURE), ("again", SECURE), ("plain", {"min_clients": 3})):
        config = tiny_config(tiny_npz, tmp_path / name, algorithm="fedavg", **changes)
        runs[name] = run_simulation(config)
    secure, again = final_global_base(tmp_path / "secure"), final_global_base(tmp_path / "again")
    for tensor in secure:  # seeded keys, graph and rounding: the same run gives the same model
        np.testing.assert_array_equal(secure[tensor], again[tensor], err_msg=tensor)
    rounds = json.loads((tmp_path / "secure" / "results.json").read_text())["rounds"]
    for row in rounds:
        summary = row["secure_aggregation"]
        assert (summary["phase"], summary["masked"], summary["dropped"], summary["classic"]) == ("done", 4, 0, True)
        assert row["bytes_up"] > 0 and row["bytes_down"] > 0
    assert json.loads((tmp_path / "plain" / "results.json").read_text())["rounds"][0]["secure_aggregation"] is None
    plain_accuracy = runs["plain"].rounds[-1].test_accuracy["mean"]
    assert runs["secure"].rounds[-1].test_accuracy["mean"] >= plain_accuracy - 0.05
    store = Store(tmp_path / "secure" / SERVER_DIR)
    try:
        assert store.updates(1) == [] and store.read("SELECT COUNT(*) FROM secure_messages")[0][0] == 0
    finally:
        store.close()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"algorithm": "pfedla"}, "secure aggregation cannot run with --algorithm pfedla"),
        ({"algorithm": "local"}, "--algorithm local uploads nothing"),
        ({"fleet": "dropout:0.1"}, "does not run secure rounds"),
        (
            {"clients": 2},
            "secure aggregation needs at least 3 devices a round, and each round has 2 of the 2 clients "
            r"\(--clients 2, --fraction 1\)",
        ),
        ({"fraction": 0.5, "min_clients": 1}, "each round has 2 of the 4 clients"),
    ],
)
def test_what_a_secure_simulation_cannot_run_with_is_one_line(tiny_npz, tmp_path, changes, message):  # noqa: F811
    with pytest.raises(UsageError, match=message):
        tiny_config(tiny_npz, tmp_path, **{**SECURE, **changes})


def test_simulate_checks_the_clients_each_round_has_not_min_clients(tmp_path):
    """`edgepfl simulate --clients 8 --secure-aggregation`: --min-clients is 1, and every round has
    8 clients."""
    from edgepfl.simulate.config import SimulateConfig

    config = SimulateConfig(out=str(tmp_path), clients=8, secure_aggregation=True)
    assert config.min_clients == 1 and config.cohort()[0] == 8
    with pytest.raises(UsageError) as refused:
        SimulateConfig(out=str(tmp_path), clients=2, secure_aggregation=True)
    assert "\n" not in str(refused.value) and "raise --clients or --fraction" in refused.value.fix


@pytest.mark.slow
def test_a_secure_simulation_with_defaults_only_matches_the_plain_one(tiny_npz, tmp_path):  # noqa: F811
    # issue 42: no clip or weight flag; each round's clip and weight scale are measured from the previous sum
    runs = {
        name: run_simulation(tiny_config(tiny_npz, tmp_path / name, algorithm="fedper", **changes))
        for name, changes in (("secure", {"secure_aggregation": True, "min_clients": 3}), ("plain", {"min_clients": 3}))
    }
    secure, plain = (runs[name].rounds[-1].test_accuracy["per_client"] for name in ("secure", "plain"))
    # each client tests on a few dozen samples here: the runs may differ by 1/32 (the stochastic rounding's seed
    # follows the device's protocol id), not by more
    assert max(abs(s - p) for s, p in zip(secure, plain)) <= 1 / 32 + 1e-9
    store = Store(tmp_path / "secure" / SERVER_DIR)
    try:
        measured = json.loads(store.get_meta(NEXT_KEY))
    finally:
        store.close()
    assert measured["clip_norm"] != FIRST_CLIP and measured["weight_scale"] != FIRST_WEIGHT_SCALE
