"""Synchronous rounds, with over-selection: a round samples its devices, takes their uploads until its target or its
deadline, then closes (aggregated) or is abandoned.

- A round opens when no round is open and at least `min_clients` devices have polled `/v1/task` within
  `available_for` seconds, and either every enrolled device is among them or one `poll_interval` has passed
  since `min_clients` were first available (so every live device has had a chance to show up, and round 1 is not
  just the first `min_clients` to poll). It samples max(min_clients, ceil(fraction * available)) of them (capped
  at the number available; with `--over-select F`, ceil(target x (1 + F)), `fleet.py`) with an RNG seeded by
  (seed, round id), so a restart samples alike.
- It closes when its target's uploads are accepted, or at its deadline if at least `min_clients` uploads were
  accepted: the strategy aggregates them and the result becomes the global base.
- At its deadline with fewer than `min_clients` uploads, the round is *abandoned*: nothing is aggregated, its
  uploads are kept on disk but never used, and the next round (a new id) starts from the same global base.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from edgepfl.protocol import Task
from edgepfl.server.errors import Refused
from edgepfl.server.modes.base import Close, DeviceCalls, RoundMode
from edgepfl.server.records import RoundRecord
from edgepfl.server.sampling import sample_devices, sample_size
from edgepfl.server.strategy import AcceptedUpdate

log = logging.getLogger("edgepfl.server")


class SyncClose(Close):
    """A synchronous round's close: the strategy reads the round's accepted uploads."""

    def __init__(self, mode: SyncMode, record: RoundRecord):
        super().__init__(record)
        self.engine = mode.engine

    def updates(self, global_base: Mapping[str, np.ndarray]) -> Iterator[AcceptedUpdate]:
        """The round's uploads as the strategy reads them (bounded base tensors, or deltas)."""
        return self.engine.uploads.for_strategy(self.record, self.engine.strategy)

    def done(self) -> None:
        """The round's delta norms and cached bases are no longer needed."""
        self.engine.uploads.closed(self.record.round_id)

    def accepted(self) -> int:
        """The round's accepted uploads."""
        return len(self.engine.store.updates(self.record.round_id))


class SyncMode(RoundMode):
    """Rounds with a barrier: sampled devices, a target, a deadline (module docstring)."""

    name = "sync"

    def __init__(self, engine: Any, calls: DeviceCalls):
        super().__init__(engine, calls)
        self._quorum_since: float | None = None  # when min_clients devices were first available for the next round

    def open(self, now: float, available: list[str]) -> RoundRecord | None:
        """Sample and plan the next round once a quorum is available (and every device had its chance)."""
        engine, config = self.engine, self.engine.config
        if len(available) < config.min_clients:
            self._quorum_since = None
            return None
        if self._quorum_since is None:
            self._quorum_since = now
        everyone = len(available) >= engine.store.count_devices()
        if not everyone and now - self._quorum_since < config.poll_interval:
            return None
        self._quorum_since = None
        round_id = engine.store.last_round_id() + 1
        target = sample_size(len(available), config.fraction, config.min_clients)
        over_select = config.fleet_rounds.over_select
        sampled = sample_devices(config.seed, round_id, available, config.fraction, config.min_clients, over_select)
        if engine.budget is not None:
            engine.stopped = engine.budget.stop_before(round_id, len(available), len(sampled))
            if engine.stopped is not None:
                log.warning("%s", engine.stopped)
                return None
        record = engine.lifecycle.open_planned(round_id, sampled, now, population=len(available), target=target)
        self.opened(record)
        log.info(
            "round %d opened: %d of %d available device(s) sampled, %d upload(s) close it",
            round_id,
            len(sampled),
            len(available),
            target,
        )
        return record

    def opened(self, record: RoundRecord) -> None:
        """A round was opened and committed (nothing more by default)."""

    def task(self, device: str, current: RoundRecord, now: float) -> Task | None:
        """A sampled device that has not uploaded trains until the deadline."""
        engine = self.engine
        if current.round_id == engine.closing or now >= current.deadline:
            return None
        assignment = engine.store.assignment(current.round_id, device)
        if assignment is None or engine.store.update(current.round_id, device) is not None:
            return None
        if not self.takes(current):
            return None
        return engine.train_task(current, assignment, deadline=current.deadline)

    def takes(self, current: RoundRecord) -> bool:
        """Whether the open round hands out train tasks now (always, for uploads)."""
        return True

    def check_open(self, record: RoundRecord) -> None:
        """An upload enters an open round before its deadline only."""
        if self.engine.clock() >= record.deadline:
            raise Refused(
                "deadline_passed",
                f"round {record.round_id} stopped taking uploads at its deadline",
                "poll /v1/task for the next round; this update was not stored",
            )
        if record.state != "open" or record.round_id == self.engine.closing:
            state = "closing" if record.state == "open" else record.state
            raise Refused("round_closed", f"round {record.round_id} is {state}", "poll /v1/task for the current round")

    def receipt(self, round_id: int) -> dict[str, Any]:
        """The round's uploads so far, its sample and its target."""
        record = self.engine.round_or_404(round_id)
        return {
            "uploads": len(self.engine.store.updates(round_id)),
            "sampled": len(record.sampled),
            "target": record.needed,
        }

    def tick(self, current: RoundRecord, now: float) -> Close | None:
        """Close at the target's uploads or at the deadline with a quorum; abandon at the deadline without one."""
        accepted = len(self.engine.store.updates(current.round_id))
        if accepted >= current.needed or now >= current.deadline:
            if accepted >= self.engine.config.min_clients:
                return SyncClose(self, current)
            self.engine.lifecycle.abandon(current, now, f"{accepted} of {current.needed} uploads by the deadline")
        return None
