"""The round engine: its core (`core.py`) with the calls the in-process drivers make instead of HTTP.

`edgepfl simulate` and the Flower strategy drive the engine in-process. Devices are enrolled names that never present
a token; the engine's clock is a `ManualClock` (driver.py) that moves one second at each round's opening (and to the
deadline when a round is closed at it). Each round every device polls `task()` (so, as in a served run where every
enrolled device polls, the round opens once all of them are available), the engine samples and plans it,
`open_round` hands each sampled device its settings and base (the bytes `base_for()` serves), the driver gives
`accept_update()` the bytes a device would upload, and `close_round()` ticks the round closed. Sampling, planning,
acceptance checks, aggregation and durable state are therefore the served ones, minus HTTP. Nobody outside the
server package reads the engine's store.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import numpy as np

from edgepfl.encoding import decode_download
from edgepfl.errors import StateError
from edgepfl.manifest import load_manifest
from edgepfl.options import unless_given
from edgepfl.server.config import ServerConfig
from edgepfl.server.core import EngineCore
from edgepfl.server.driver import DevicePlan, ManualClock, global_base_of
from edgepfl.server.records import RoundRecord
from edgepfl.server.store import Store
from edgepfl.server.strategies import make_strategy


def create_engine(config: ServerConfig, clock: Callable[[], float] = time.time) -> RoundEngine:
    """Load the bundle's manifest, open (or create) the state folder and bind the two together."""
    manifest = load_manifest(config.bundle)
    # round settings the operator did not give: the bundle's kind's (a next-word model's measured defaults)
    config = config.model_copy(update={"round": unless_given(config.round, manifest.kind.training_defaults)})
    store = Store(config.state)
    specs = manifest.shared(config.share_buffers)
    strategy = make_strategy(config.strategy, specs, config.settings, config.seed)
    strategy.check_manifest(manifest)
    engine = RoundEngine(config, manifest, store, strategy, clock)
    engine.bind_state()
    return engine


class RoundEngine(EngineCore):
    """The engine core and the API of its in-process drivers (module docstring)."""

    def open_round(self, round_id: int, devices: list[str], now: float | None = None) -> dict[str, DevicePlan] | None:
        """`devices` poll (at virtual time `now`, else one second after the last round); round `round_id` opens;
        each sampled device's plan (in sampled order). When not every enrolled device polls, they poll again one
        --poll-interval later, as served devices do, and the round opens then.

        None when the engine stops the run instead (--dp-target-epsilon: one more round would exceed it).
        Uploads an interrupted run left in the round are withdrawn: every sampled device trains again.
        """
        if isinstance(self.clock, ManualClock):  # one second a round, never back past a deadline
            self.clock.now = now if now is not None else max(float(round_id), self.clock.now + 1.0)
        for device in devices:
            self.task(device)
        if self.store.open_round() is None and self.stopped is None and isinstance(self.clock, ManualClock):
            self.clock.now += self.config.poll_interval
            for device in devices:
                self.task(device)
        current = self.store.open_round()
        if current is None and self.stopped is not None:
            return None
        if current is None or current.round_id != round_id:
            found = "none" if current is None else str(current.round_id)
            raise StateError(
                f"the in-process server opened round {found} where round {round_id} was due",
                "the run folder's server state does not match its results: use a new --out",
            )
        if self.store.updates(round_id, status=None):  # a GPU's (or any nondeterministic) training sends new bytes
            self.withdraw_uploads(round_id)
        plans = {}
        for device in current.sampled:
            payload, _ = self.base_for(device, round_id)
            settings = self.settings_for(device, round_id)
            plans[device] = DevicePlan(settings, decode_download(payload, settings.download_encoding), len(payload))
        return plans

    def poll(self, device: str) -> tuple[int, DevicePlan] | None:
        """One device polls (fedbuff: a free device takes a task on the current base): its round and plan, or None
        when it is told to wait or that the run is over."""
        task = self.task(device)
        if task.action != "train" or task.round_id is None:
            return None
        payload, _ = self.base_for(device, task.round_id)
        settings = self.settings_for(device, task.round_id)
        return task.round_id, DevicePlan(settings, decode_download(payload, settings.download_encoding), len(payload))

    def close_round(self, round_id: int, at_deadline: bool = False) -> dict[str, np.ndarray]:
        """Aggregate the round (every sampled device has uploaded, or it is `at_deadline`); the new global base.

        At its deadline the round closes with the uploads accepted so far if they are at least `min_clients`,
        and is abandoned (StateError here) otherwise, exactly as a served round.
        """
        record = self.store.round(round_id)
        if at_deadline and record is not None and isinstance(self.clock, ManualClock):
            self.clock.now = max(self.clock.now, record.deadline)
        self.tick()
        record = self.store.round(round_id)
        if record is None or record.state != "closed":
            state = "missing" if record is None else f"{record.state} ({record.note})"
            raise StateError(f"round {round_id} did not close: {state}", "see the log above; use a new --out")
        return self.global_base()

    def withdraw_uploads(self, round_id: int) -> int:
        """Forget an open round's uploads, so that its devices upload again; returns how many were forgotten.

        For in-process drivers only (no HTTP route): a simulated run resumed after an interruption trains the
        round again, and a GPU's training does not repeat its bytes, which the one-upload-per-round rule refuses.
        """
        with self.lock:
            self.uploads.forget(round_id)
            return self.store.withdraw_updates(round_id)

    def global_base(self) -> dict[str, np.ndarray]:
        """The current global base (the last closed round's result, or the initial base)."""
        return global_base_of(self.store)

    def evaluation_base(self, device: str, global_base: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """The base a device is evaluated with after a round (the strategy's view; it changes nothing)."""
        return self.strategy.evaluation_base(device, global_base)

    def round(self, round_id: int) -> RoundRecord | None:
        """One round's record, or None."""
        return self.store.round(round_id)

    def current_round(self) -> RoundRecord | None:
        """The open round, if any."""
        return self.store.open_round()

    def next_round_id(self) -> int:
        """The id the next round to open gets, or the open round's."""
        current = self.store.open_round()
        return current.round_id if current is not None else self.store.last_round_id() + 1

    def closed_rounds(self) -> int:
        """How many rounds were aggregated."""
        return self.store.count_closed()

    def epsilon(self, round_id: int) -> float | None:
        """DP: the epsilon spent through a closed round (None without DP)."""
        record = self.store.round(round_id)
        return record.epsilon if record is not None else None

    def enroll_devices(self, names: list[str]) -> None:
        """Enroll in-process devices (they never present a token) that are not enrolled yet."""
        from edgepfl.server.tokens import issue_token

        enrolled = {device.name for device in self.store.devices()}
        for name in names:
            if name not in enrolled:
                issue_token(self.store, name, self.clock())
