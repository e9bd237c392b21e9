"""FedBuff under hostile timing (issue 55), on the engine with a settable clock: uploads claiming a future version,
uploads trained on a version a rollback rejected, the same task twice, an upload from a device the round never
had, a device polling a thousand times a second, and time jumping. Each hostile request is refused with its code
and counted nowhere (the store is as it was), an accepted upload is stored exactly once, a full buffer always
makes its step at the next tick, and the status a device sees names no device.
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
from fuzz_budget import examples, fuzz_settings, reported, seeded
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test
from server_helpers import enroll, make_bundle, upload_body

from edgepfl.server.config import ServerConfig
from edgepfl.server.engine import RoundEngine, create_engine
from edgepfl.server.errors import Refused
from edgepfl.wire import decode_tensors

CASES = 40  # sequences in CI (each up to STEPS calls; an engine per sequence)
STEPS = 40
DEVICES = ("dev-amber", "dev-birch", "dev-cedar", "dev-dune", "dev-elm")
BUFFER = 2
TALLY: Counter[str] = Counter()


class Clock:
    """A settable clock."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def fedbuff_engine(root: Path, clock: Clock, max_staleness: int = 1) -> RoundEngine:
    """A FedBuff engine of buffer BUFFER over a tiny bundle, the DEVICES enrolled."""
    make_bundle(root / "bundle")
    config = ServerConfig(
        bundle=root / "bundle",
        state=root / "state",
        min_clients=2,
        round_timeout=100,
        rounds=10_000,
        clip_multiple=0,
        weight_multiple=0,
        web=False,
        fleet_rounds={"aggregation": "fedbuff", "buffer_size": BUFFER, "max_staleness": max_staleness},
    )
    enroll(config.state, *DEVICES)
    return create_engine(config, clock)


class HostileFedBuff(RuleBasedStateMachine):
    """One FedBuff engine (module docstring)."""

    @initialize(max_staleness=st.integers(0, 2))
    def start(self, max_staleness: int) -> None:
        self.folder = tempfile.TemporaryDirectory()
        self.clock = Clock()
        self.engine = fedbuff_engine(Path(self.folder.name), self.clock, max_staleness)
        self.tasks: dict[str, int] = {}  # device -> the version its last train task named
        self.accepted: dict[tuple[int, str], str] = {}  # (version, device) -> sha of the upload taken

    def teardown(self) -> None:
        if hasattr(self, "engine"):
            self.engine.store.close()
            self.folder.cleanup()

    def stored(self) -> tuple:
        """What a refused request must leave as it was: every round's state and uploads, the global base."""
        store = self.engine.store
        rounds = tuple(
            (
                r.round_id,
                r.state,
                r.base_sha,
                r.result_sha,
                tuple(sorted((u.device, u.blob_sha) for u in store.updates(r.round_id))),
            )
            for r in store.rounds()
        )
        return rounds, store.get_meta("global_base_sha"), tuple(store.rejected_bases())

    def refused(self, call, *codes: str) -> None:
        """`call()` must be refused with one of `codes` and change nothing stored."""
        before = self.stored()
        try:
            receipt = call()
        except Refused as refusal:
            assert refusal.error in codes, f"refused {refusal.error}, expected {codes}: {refusal.problem}"
            assert self.stored() == before, f"a refused request ({refusal.error}) changed what is stored"
            TALLY[f"refused {refusal.error}"] += 1
            return
        raise AssertionError(f"taken, expected a refusal {codes}: {receipt}")

    def body(self, device: str, version: int, shift: float, samples: int = 10) -> bytes:
        base, _ = self.engine.base_for(device, version)
        tensors = {name: value + np.float32(shift) for name, value in decode_tensors(base).items()}
        return upload_body(tensors, self.engine.manifest, num_samples=samples)

    # honest devices

    @rule(devices=st.lists(st.sampled_from(DEVICES), min_size=1, max_size=3, unique=True))
    def poll(self, devices: list[str]) -> None:
        for device in devices:
            task = self.engine.task(device)
            if task.action == "train":
                self.tasks[device] = task.round_id

    @rule(
        devices=st.lists(st.sampled_from(DEVICES), min_size=1, max_size=3, unique=True),
        shift=st.sampled_from([-0.5, 0.25, 1.0]),
        samples=st.integers(1, 50),
    )
    def train_and_upload(self, devices: list[str], shift: float, samples: int) -> None:
        """Devices that poll (unless they hold a task from before: a stale one) and upload."""
        for device in devices:
            if device not in self.tasks:
                self.poll([device])
            self.upload(device, shift, samples)

    def upload(self, device: str, shift: float, samples: int) -> None:
        version = self.tasks.pop(device, None)
        if version is None:
            return
        body = self.body(device, version, shift, samples)
        before = self.stored()
        try:
            receipt = self.engine.accept_update(device, version, body)
        except Refused as refusal:  # honest, but late: its version went too stale or a rollback rejected it
            assert refusal.error in ("too_stale", "round_closed"), refusal.problem
            assert self.stored() == before
            TALLY[f"honest but {refusal.error}"] += 1
            return
        assert not receipt["duplicate"] and (version, device) not in self.accepted, "an upload was counted twice"
        self.accepted[(version, device)] = receipt["sha256"]
        TALLY["uploads taken"] += 1

    @rule(seconds=st.sampled_from([0.001, 1.0, 99.0, 101.0, 10_000.0]))
    def time_passes(self, seconds: float) -> None:
        self.clock.now += seconds
        full = len(self.engine.store.buffered_updates()) >= BUFFER
        version = self.engine.store.last_round_id()
        self.engine.tick()
        if full:
            assert self.engine.store.last_round_id() > version, "a full buffer did not make its step"
            TALLY["server steps"] += 1

    @rule(how_many=st.integers(1, len(DEVICES)))
    def refuse_base(self, how_many: int) -> None:
        """Devices say the current base is broken: enough of them roll the version back."""
        version = self.engine.store.last_round_id()
        given = sorted(self.engine.store.assigned_devices(version)) if version else []
        for device in given[:how_many]:
            if self.engine.accept_refusal(device, version, "training diverged")["rolled_back"]:
                TALLY["rollbacks"] += 1
                break

    # hostile timing

    @rule(device=st.sampled_from(DEVICES), ahead=st.integers(1, 3))
    def future_version(self, device: str, ahead: int) -> None:
        version = self.engine.store.last_round_id() + ahead
        body = upload_body({}, self.engine.manifest)
        self.refused(lambda: self.engine.accept_update(device, version, body), "no_such_round")

    @rule(device=st.sampled_from(DEVICES))
    def same_task_twice(self, device: str) -> None:
        mine = [key for key in self.accepted if key[1] == device]
        if not mine:
            return
        version = mine[-1][0]
        if self.engine.round(version) is None or not self.engine.store.update(version, device):
            return  # its upload was dropped with a rejected base
        try:
            other = self.body(device, version, 3.0, 7)
        except Refused:
            return  # the version's base is no longer kept
        self.refused(
            lambda: self.engine.accept_update(device, version, other), "duplicate_update", "too_stale", "round_closed"
        )

    @rule(device=st.sampled_from(DEVICES))
    def before_the_rollback(self, device: str) -> None:
        """An upload trained on a version whose base a rollback rejected."""
        abandoned = [r.round_id for r in self.engine.store.rounds() if r.state == "abandoned"]
        if not abandoned:
            return
        body = upload_body({}, self.engine.manifest)
        self.refused(
            lambda: self.engine.accept_update(device, abandoned[-1], body), "round_closed", "not_sampled", "too_stale"
        )

    @rule()
    def a_device_the_round_never_had(self) -> None:
        version = self.engine.store.last_round_id()
        if version:
            body = upload_body({}, self.engine.manifest)
            self.refused(lambda: self.engine.accept_update("dev-removed", version, body), "not_sampled")

    @rule(device=st.sampled_from(DEVICES))
    def poll_storm(self, device: str) -> None:
        """A thousand polls in one second: one task, the same each time; nothing else moves."""
        before = self.stored()
        tasks = set()
        for _ in range(1000):
            self.clock.now += 0.001
            task = self.engine.task(device)
            tasks.add((task.action, task.round_id))
        assert len(tasks) == 1 or self.stored() != before, f"a storm of polls got {len(tasks)} different tasks"
        assert [r[:4] for r in self.stored()[0]] == [r[:4] for r in before[0]] or not before[0]

    # what holds after every step

    @invariant()
    def counted_once(self) -> None:
        if not hasattr(self, "engine"):
            return
        stored = Counter()
        for record in self.engine.store.rounds():
            for update in self.engine.store.updates(record.round_id):
                stored[(record.round_id, update.device)] += 1
                if record.state != "abandoned":
                    assert self.accepted.get((record.round_id, update.device)) == update.blob_sha
        assert all(count == 1 for count in stored.values()), "an upload is stored twice"

    @invariant()
    def no_device_named(self) -> None:
        if hasattr(self, "engine"):
            status = json.dumps(self.engine.status(names=False))
            assert not [d for d in DEVICES if d in status], "the status a device sees names a device"


def test_fedbuff_under_hostile_timing() -> None:
    TALLY.clear()
    with reported("fedbuff hostile timing", {"examples": examples(CASES), "steps": STEPS}) as counts:
        run_state_machine_as_test(seeded(HostileFedBuff), settings=fuzz_settings(CASES, STEPS))
        counts.update(sorted(TALLY.items()))
    assert TALLY["server steps"] and TALLY["rollbacks"] and TALLY["refused no_such_round"], (
        f"the fuzz reached too little: {TALLY}"
    )


def test_regression_an_upload_a_rollback_dropped_is_refused_not_taken_again(tmp_path: Path) -> None:
    """Found by the long run: a device's upload on a version whose base was then rejected is dropped; sending it
    again was answered 'accepted, duplicate' (and other bytes reached the body's checks) instead of round_closed."""
    engine = fedbuff_engine(tmp_path, Clock())
    amber, birch, cedar = DEVICES[:3]
    for device in (amber, birch):
        engine.task(device)
        engine.accept_update(device, 1, _body(engine, device, 1, 0.5))
    engine.tick()  # step 1: version 2 opens on a base that can be rolled back
    assert engine.task(cedar).round_id == 2
    body = _body(engine, cedar, 2, 0.25)
    engine.accept_update(cedar, 2, body)
    assert engine.accept_refusal(cedar, 2, "training diverged")["rolled_back"]
    assert engine.round(2).state == "abandoned"
    for again in (body, upload_body({}, engine.manifest)):
        try:
            engine.accept_update(cedar, 2, again)
        except Refused as refusal:
            assert refusal.error == "round_closed", refusal.problem
        else:
            raise AssertionError("an upload the rollback dropped was taken again")
    engine.store.close()


def _body(engine: RoundEngine, device: str, version: int, shift: float) -> bytes:
    base, _ = engine.base_for(device, version)
    tensors = {name: value + np.float32(shift) for name, value in decode_tensors(base).items()}
    return upload_body(tensors, engine.manifest)
