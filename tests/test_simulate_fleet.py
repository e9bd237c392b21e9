"""edgepfl simulate --fleet: the virtual clock of synchronous rounds that end at their deadline."""

from __future__ import annotations

import pytest
from test_simulate import tiny_config, tiny_npz  # noqa: F401 - tiny_npz is a fixture

pytest.importorskip("torch")

from edgepfl.simulate.fleet import Fleet, FleetSpec  # noqa: E402
from edgepfl.simulate.loop import run_simulation  # noqa: E402

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
