"""Issue 32 in the round engine: over-selection with a quorum, FedBuff's buffered steps, and a rejected base rolled
back; the simulated fleet's spec and clock."""

from __future__ import annotations

import html
import math
import time
from pathlib import Path

import numpy as np
import pytest
from server_helpers import enroll, make_bundle, upload_body
from test_server_uploads_dp import delta_body

from edgepfl.errors import UsageError
from edgepfl.options import validated
from edgepfl.server.config import ServerConfig
from edgepfl.server.engine import RoundEngine, create_engine
from edgepfl.server.errors import Refused
from edgepfl.server.fleet import staleness_exponent
from edgepfl.server.page import fleet_section, render_page
from edgepfl.server.strategies import strategy_options
from edgepfl.simulate.fleet import Fleet, FleetSpec
from edgepfl.wire import decode_tensors

DEVICES = [f"d{i}" for i in range(6)]


class Clock:
    """A settable clock."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def engine_for(tmp_path: Path, **changes) -> tuple[RoundEngine, Clock]:
    make_bundle(tmp_path / "bundle")
    fields = dict(min_clients=2, round_timeout=100, rounds=5, clip_multiple=0, weight_multiple=0, web=False)
    config = ServerConfig(bundle=tmp_path / "bundle", state=tmp_path / "state", **{**fields, **changes})
    enroll(config.state, *DEVICES)
    clock = Clock()
    return create_engine(config, clock), clock


def shifted(engine: RoundEngine, device: str, round_id: int, shift: float, samples: int = 10) -> bytes:
    base, _ = engine.base_for(device, round_id)
    tensors = {name: value + np.float32(shift) for name, value in decode_tensors(base).items()}
    return upload_body(tensors, engine.manifest, num_samples=samples)


# over-selection


def test_over_selection_samples_more_and_closes_at_the_target(tmp_path: Path) -> None:
    engine, clock = engine_for(tmp_path, fraction=0.5, **{"over_select": 0.5})
    for device in DEVICES:
        engine.task(device)
    record = engine.current_round()
    assert record is not None and record.needed == 3 and len(record.sampled) == 5  # ceil(3 x 1.5)
    first, second, third, late = record.sampled[:4]
    for device in (first, second):
        engine.accept_update(device, 1, shifted(engine, device, 1, 1.0))
        engine.tick()
    assert engine.round(1).state == "open", "two of three: not yet"
    engine.accept_update(third, 1, shifted(engine, third, 1, 1.0))
    engine.tick()
    assert engine.round(1).state == "closed" and clock.now < engine.round(1).deadline, "closed without waiting"
    with pytest.raises(Refused) as refused:
        engine.accept_update(late, 1, shifted(engine, late, 1, 1.0))
    assert refused.value.error == "round_closed"
    assert engine.status()["rounds"][0]["target"] == 3


def test_the_status_names_who_is_missing_and_when_the_round_gives_up(tmp_path: Path) -> None:
    engine, _ = engine_for(tmp_path)
    for device in DEVICES:
        engine.task(device)
    record = engine.current_round()
    engine.accept_update(record.sampled[0], 1, shifted(engine, record.sampled[0], 1, 1.0))
    status = engine.status(names=True)["open_round"]
    assert status["missing"] == list(record.sampled[1:]) and status["gives_up_at"] == record.deadline
    # the status page says it in words: who the round waits for (the operator's view), and when it gives up
    line = fleet_section(engine.status(names=True), record.deadline - 240)
    when = time.strftime("%H:%M:%S", time.localtime(record.deadline))
    assert f"1 of the {record.needed} uploads it needs" in line and f"gives up at {when} (in 4 min)" in line
    assert "waiting for " + ", ".join(record.sampled[1:]) in line
    assert "gave up at" in fleet_section(engine.status(), record.deadline + 1)
    assert f"waiting for {len(record.sampled) - 1} devices ·" in fleet_section(engine.status(), record.deadline - 240)


# FedBuff


def fedbuff(tmp_path: Path, **fleet) -> tuple[RoundEngine, Clock]:
    options = {"aggregation": "fedbuff", "buffer_size": 2, "max_staleness": 1, "server_lr": 0.5, **fleet}
    return engine_for(tmp_path, **options)


def test_fedbuff_steps_every_k_uploads_weighting_each_by_its_staleness(tmp_path: Path) -> None:
    engine, _ = fedbuff(tmp_path, staleness_weight="poly:1")
    start = engine.global_base()
    tasks = {device: engine.task(device) for device in ("d0", "d1", "d2")}
    assert {task.round_id for task in tasks.values()} == {1} and all(t.deadline is None for t in tasks.values())
    engine.accept_update("d2", 1, shifted(engine, "d2", 1, 4.0, samples=30))  # stays in the buffer: 1 step stale
    engine.accept_update("d0", 1, shifted(engine, "d0", 1, 2.0, samples=10))
    engine.tick()
    step_one = engine.global_base()
    # x + eta * sum n w(s) delta / sum n: both fresh (s = 0), eta 0.5
    expected = {name: start[name] + 0.5 * (30 * 4.0 + 10 * 2.0) / 40 for name in start}
    for name in start:
        np.testing.assert_allclose(step_one[name], expected[name], rtol=1e-6)
    assert engine.task("d0").round_id == 2, "a free device trains on the new base at once"
    engine.accept_update("d1", 1, shifted(engine, "d1", 1, 8.0, samples=10))  # trained on version 1: 1 stale
    engine.accept_update("d0", 2, shifted(engine, "d0", 2, 1.0, samples=10))
    engine.tick()
    step_two = engine.global_base()
    # d1's delta (8 on base 1) weighs (1 + 1)^-1; d0's (1 on base 2) is fresh
    expected = {name: step_one[name] + 0.5 * (10 * 8.0 / 2 + 10 * 1.0) / 20 for name in start}
    for name in start:
        np.testing.assert_allclose(step_two[name], expected[name], rtol=1e-6)
    status = engine.status(names=True)["fedbuff"]
    assert status["base_version"] == 3 and status["buffered"] == 0
    assert status["devices"]["d1"] == {"round": 1, "staleness": 1, "applied": 2}
    page = render_page(engine.status(names=True))
    assert "FedBuff: base version <b>3</b> · buffer 0 / 2 uploads" in page
    assert "<tr><td>d1</td><td>1</td><td>1</td><td>2</td></tr>" in page


def test_fedbuff_takes_encoded_deltas_against_the_version_each_trained_on(tmp_path: Path) -> None:
    engine, _ = fedbuff(tmp_path, upload_encoding="fp16", staleness_weight="const", server_lr=1.0)
    for device in ("d0", "d1", "d2"):
        engine.task(device)
    start = engine.global_base()

    def delta_upload(device: str, version: int, shift: float) -> bytes:
        base = decode_tensors(engine.base_for(device, version)[0])
        return delta_body({name: np.full_like(value, shift) for name, value in base.items()}, "fp16", engine.manifest)

    engine.accept_update("d0", 1, delta_upload("d0", 1, 0.5))
    engine.accept_update("d2", 1, delta_upload("d2", 1, 0.5))
    engine.tick()
    step_one = engine.global_base()
    for name, value in start.items():
        np.testing.assert_allclose(step_one[name], value + 0.5, rtol=1e-6)
    engine.task("d0")
    engine.accept_update("d1", 1, delta_upload("d1", 1, 1.0))  # one version stale: a delta against version 1
    engine.accept_update("d0", 2, delta_upload("d0", 2, 3.0))
    engine.tick()
    for name, value in step_one.items():  # const weights: the mean of the two deltas, on the current base
        np.testing.assert_allclose(engine.global_base()[name], value + 2.0, rtol=1e-6)


def test_fedbuff_keeps_the_bases_a_stale_upload_may_still_quote_whatever_the_history(tmp_path: Path) -> None:
    engine, _ = fedbuff(tmp_path, buffer_size=1, max_staleness=3, history=1)
    engine.task("d0")
    engine.accept_update("d0", 1, shifted(engine, "d0", 1, 1.0))
    engine.tick()
    assert engine.task("d1").round_id == 2  # trains on version 2, the first base that is not the initial one
    late = shifted(engine, "d1", 2, 1.0)
    for version in (2, 3, 4):
        engine.task("d0")
        engine.accept_update("d0", version, shifted(engine, "d0", version, 1.0))
        engine.tick()
    assert engine.accept_update("d1", 2, late)["accepted"]  # 3 steps old: its base is still there


def test_fedbuff_refuses_an_upload_trained_on_a_base_too_many_steps_old(tmp_path: Path) -> None:
    engine, _ = fedbuff(tmp_path, buffer_size=1, max_staleness=1)
    engine.task("d0")
    engine.task("d1")
    late = shifted(engine, "d1", 1, 1.0)
    for version in (1, 2):
        engine.accept_update("d0", version, shifted(engine, "d0", version, 1.0))
        engine.tick()
        engine.task("d0")
    with pytest.raises(Refused) as refused:  # version 1 is two steps old now
        engine.accept_update("d1", 1, late)
    assert refused.value.error == "too_stale" and "2 steps old" in refused.value.problem


def test_the_buffer_survives_a_restart_and_nothing_is_applied_twice(tmp_path: Path) -> None:
    engine, clock = fedbuff(tmp_path, buffer_size=3)
    for device in ("d0", "d1", "d2"):
        engine.task(device)
    for device in ("d0", "d1"):
        engine.accept_update(device, 1, shifted(engine, device, 1, 1.0))
    engine.close()  # a kill between uploads: the buffer is in the database
    again = create_engine(engine.config, clock)
    assert len(again.store.buffered_updates()) == 2
    again.accept_update("d2", 1, shifted(again, "d2", 1, 1.0))
    again.tick()
    applied = again.store.updates(1)
    assert [u.applied_in for u in applied] == [1, 1, 1] and not again.store.buffered_updates()
    again.tick()
    assert again.closed_rounds() == 1


def test_fedbuff_refuses_what_cannot_take_steps(tmp_path: Path) -> None:
    make_bundle(tmp_path / "bundle")
    base = {"bundle": tmp_path / "bundle", "state": tmp_path / "s", "aggregation": "fedbuff"}
    for strategy in ("median", "trimmed-mean", "pfedla", "heurpfedla"):
        with pytest.raises(UsageError, match=f"cannot run --strategy {strategy}"):
            clients = {"pfedla_clients": 3} if "pfedla" in strategy else {}
            validated(ServerConfig, {**base, "strategy": strategy, **clients})
    with pytest.raises(UsageError, match="fedbuff's steps"):
        validated(ServerConfig, {**base, "dp_noise_multiplier": 1.0, "dp_clip": 1.0})
    with pytest.raises(UsageError, match="--staleness-weight 'poly:x'"):
        validated(ServerConfig, {**base, "staleness_weight": "poly:x"})
    assert staleness_exponent("const") == 0.0 and staleness_exponent("poly:0.5") == 0.5


# a base the devices refuse


def test_a_base_most_devices_refuse_is_rolled_back(tmp_path: Path) -> None:
    engine, clock = engine_for(tmp_path, min_clients=2)
    for device in DEVICES:
        engine.task(device)
    record = engine.current_round()
    for device in record.sampled:
        engine.accept_update(device, 1, shifted(engine, device, 1, 1e3))  # a poisoned round: every delta huge
    engine.tick()
    poisoned = engine.store.get_meta("global_base_sha")
    clock.now += 1
    for device in DEVICES:
        engine.task(device)
    two = engine.current_round()
    assert two.base_sha == poisoned
    first, *rest = two.sampled
    receipt = engine.accept_refusal(first, 2, "NaN or Inf in 'stem.weight'")
    assert not receipt["rolled_back"] and engine.round(2).state == "open", "one refusal rolls nothing back"
    with pytest.raises(Refused):
        engine.accept_refusal("nobody", 2, "not given the round")
    for device in rest[: math.ceil(len(two.sampled) / 2) - 1]:
        receipt = engine.accept_refusal(device, 2, "training diverged")
    assert receipt["rolled_back"] and engine.round(2).state == "abandoned"
    assert engine.store.get_meta("global_base_sha") == engine.round(1).base_sha, "back to the base before round 1"
    assert poisoned in engine.store.rejected_bases()
    for device in DEVICES:
        engine.task(device)
    assert engine.current_round().base_sha == engine.round(1).base_sha, "the next round starts from it"


def test_the_initial_base_is_never_rolled_back(tmp_path: Path) -> None:
    engine, _ = engine_for(tmp_path)
    for device in DEVICES:
        engine.task(device)
    for device in engine.current_round().sampled:
        engine.accept_refusal(device, 1, "training diverged")
    assert engine.round(1).state == "open"


def test_one_strategy_engine_serves_fedavg_and_fedper_under_fedbuff(tmp_path: Path) -> None:
    make_bundle(tmp_path / "bundle", kp=0)
    config = ServerConfig(
        bundle=tmp_path / "bundle",
        state=tmp_path / "state",
        strategy=strategy_options("fedavg"),
        fleet_rounds={"aggregation": "fedbuff", "buffer_size": 1},
        web=False,
    )
    enroll(config.state, "d0")
    engine = create_engine(config, Clock())
    engine.task("d0")
    engine.accept_update("d0", 1, shifted(engine, "d0", 1, 1.0))
    engine.tick()
    assert engine.closed_rounds() == 1


# the simulated fleet


def test_a_fleet_spec_is_parsed_or_refused_in_one_line() -> None:
    spec = FleetSpec.parse("dropout:0.3,speed:lognormal:1.0,online:exp:600/120,seed:4,sample-time:0.02")
    assert (spec.dropout, spec.speed_sigma, spec.online, spec.seed, spec.sample_time) == (0.3, 1.0, (600, 120), 4, 0.02)
    assert FleetSpec.parse(spec.label()) == spec
    for bad in ("dropout:1.5", "speed:gamma:2", "online:exp:600", "colour:red", "seed:-1"):
        with pytest.raises(UsageError, match=f"--fleet part '{bad}' is not understood"):
            FleetSpec.parse(bad)


def test_a_fleet_is_the_same_for_the_same_seed_and_devices_come_and_go() -> None:
    spec = FleetSpec.parse("dropout:0.3,speed:lognormal:1.0,online:exp:600/120")
    names = [f"client-{i:03d}" for i in range(50)]
    one, two = Fleet(spec, names, seed=7), Fleet(spec, names, seed=7)
    assert one.speed == two.speed and len(set(one.speed.values())) == 50
    drops = [one.completes(name, 1, 0.0, 0.0) for name in names]
    assert drops == [two.completes(name, 1, 0.0, 0.0) for name in names]
    assert 0.5 < sum(drops) / len(drops) < 0.9  # about 70 % complete
    online = [sum(one.online(name, t) for name in names) for t in range(0, 20_000, 500)]
    assert 0.7 < np.mean(online) / 50 < 0.95  # 600 / (600 + 120) = 0.83 online on average
    for name in names:
        back = one.next_online(name, 1000.0)
        assert back >= 1000.0 and one.online(name, back)
    assert not Fleet(spec, names, seed=8).speed == one.speed


# fleet settings that cannot work: one line each, with the fix, at start and on the status page

CANNOT_WORK = {
    "over-select with every device the target": (
        dict(over_select=0.5),
        {},
        "--over-select 0.5 samples no extra device: with --fraction 1 a round's target is every available device, "
        "so a device that vanishes holds the round for its whole --round-timeout (100 s); fix: lower --fraction",
    ),
    "over-select with --min-clients the whole fleet": (
        dict(over_select=0.5),
        dict(fraction=0.5, min_clients=6),
        "--over-select 0.5 samples no extra device: a round's target is all 6 enrolled devices (--fraction 0.5, "
        "--min-clients 6), so a device that vanishes holds the round",
    ),
    "a fedbuff buffer larger than the fleet": (
        dict(aggregation="fedbuff", buffer_size=8),
        {},
        "--buffer-size 8 is more than the 6 enrolled devices, and a device uploads once per base version, so every "
        "FedBuff step waits for its whole --round-timeout (100 s); fix: --buffer-size 6 or less",
    ),
}


@pytest.mark.parametrize("case", CANNOT_WORK)
def test_a_fleet_setting_that_cannot_work_is_said_in_one_line_with_its_fix(tmp_path: Path, case: str) -> None:
    fleet, changes, line = CANNOT_WORK[case]
    engine, _ = engine_for(tmp_path, fleet_rounds=fleet, **changes)
    warnings = engine.status()["fleet_warnings"]
    assert len(warnings) == 1 and warnings[0].startswith(line) and "fix: " in warnings[0] and "\n" not in warnings[0]
    assert html.escape(warnings[0]) in render_page(engine.status())


@pytest.mark.parametrize(
    "fleet, changes",
    [(dict(over_select=0.5), dict(fraction=0.6)), (dict(aggregation="fedbuff", buffer_size=6), {}), ({}, {})],
)
def test_fleet_settings_that_work_are_not_warned_of(tmp_path: Path, fleet: dict, changes: dict) -> None:
    engine, _ = engine_for(tmp_path, fleet_rounds=fleet, **changes)
    assert engine.status()["fleet_warnings"] == []


def test_serve_says_at_start_that_over_select_cannot_over_select(tmp_path: Path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from edgepfl.cli import app
    from edgepfl.server import transport

    monkeypatch.setattr(transport, "run_server", lambda *args, **kwargs: None)  # start, print, stop at once
    make_bundle(tmp_path / "bundle")
    args = ["serve", "--bundle", str(tmp_path / "bundle"), "--state", str(tmp_path / "state"), "--no-web"]
    result = CliRunner().invoke(app, [*args, "--over-select", "0.3"])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if "--over-select" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: --over-select 0.3 samples no extra device")
    assert "fix: lower --fraction" in warnings[0]
    quiet = CliRunner().invoke(app, [*args, "--over-select", "0.3", "--fraction", "0.6"])
    assert quiet.exit_code == 0 and "--over-select" not in quiet.stderr
