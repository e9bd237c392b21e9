"""edgepfl simulate --fleet: sync rounds that end at their deadline, fedbuff steps that take stale uploads."""

from __future__ import annotations

import pytest
from test_simulate import tiny_config, tiny_npz  # noqa: F401 - tiny_npz is a fixture

pytest.importorskip("torch")

from edgepfl.server.store import Store  # noqa: E402
from edgepfl.simulate.fleet import Fleet, FleetSpec  # noqa: E402
from edgepfl.simulate.loop import run_simulation  # noqa: E402
from edgepfl.simulate.rounds import SERVER_DIR  # noqa: E402

FLEET = "dropout:0,speed:lognormal:2.0,sample-time:0.01,seed:1"
TIMEOUT = 2.0  # virtual seconds: a client trains its ~120 samples in 1.2 s at speed 1.0


def test_a_round_with_a_late_upload_ends_at_its_deadline(tiny_npz, tmp_path):  # noqa: F811
    names = [f"client-{i:03d}" for i in range(4)]
    speeds = Fleet(FleetSpec.parse(FLEET), names, seed=0).speed
    assert min(speeds.values()) < 1.0 and max(speeds.values()) > 2.0, speeds  # one finishes in time, one late
    config = tiny_config(tiny_npz, tmp_path / "run", rounds=3, fleet=FLEET, round_timeout=TIMEOUT)
    results = run_simulation(config)
    assert [record.round for record in results.rounds] == [1, 2, 3]  # none opened and abandoned behind the clock
    # every round waits for a late client, so it ends at its deadline, not when the late upload arrives
    assert [record.virtual_time for record in results.rounds] == pytest.approx([TIMEOUT, 2 * TIMEOUT, 3 * TIMEOUT])
    assert all(record.late_uploads for record in results.rounds)


def test_fedbuff_on_the_fleet_takes_uploads_many_steps_stale(tiny_npz, tmp_path):  # noqa: F811
    fleet_rounds = {"aggregation": "fedbuff", "buffer_size": 1, "max_staleness": 10}
    config = tiny_config(tiny_npz, tmp_path / "run", rounds=12, fleet=FLEET, round_timeout=60.0, **fleet_rounds)
    results = run_simulation(config)
    assert [record.round for record in results.rounds] == list(range(1, 13))
    times = [record.virtual_time for record in results.rounds]
    assert times == sorted(times) and times[0] > 0
    assert all(record.sampled == 1 for record in results.rounds)  # one accepted upload a step
    store = Store(tmp_path / "run" / SERVER_DIR)
    updates = [update for record in store.rounds() for update in store.updates(record.round_id)]
    store.close()
    # the simulator keeps 2 rounds of history, yet a base after the initial one was trained on 3+ steps back
    assert any(update.round_id > 1 and update.staleness >= 3 for update in updates)
