"""FedBuff's rounds (Nguyen et al., AISTATS 2022): no barrier, one server step per `--buffer-size` uploads.

One round is open at any time: the current base version. Any device that polls takes a task on it (its
assignment is made at its first poll, `take_task`); every `--buffer-size` accepted uploads (or, at the version's
deadline, at least `min_clients` of them) close it in one server step that opens the next version in the same
transaction. An upload trained on a base more than `--max-staleness` steps old is refused `too_stale`; a step
weights each buffered upload by its staleness (`fleet.rebased`, through `round_uploads.RoundUploads.step`). A
rejected base drops the uploads trained on it and the next version starts from the rollback.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from edgepfl.protocol import Task
from edgepfl.server.errors import Refused
from edgepfl.server.modes.base import Close, RoundMode
from edgepfl.server.records import Assignment, RoundRecord, UpdateRecord
from edgepfl.server.strategy import AcceptedUpdate

log = logging.getLogger("edgepfl.server")


class Step(Close):
    """One FedBuff step over the buffered uploads (of several base versions)."""

    def __init__(self, mode: FedBuffMode, record: RoundRecord, buffered: list[UpdateRecord]):
        super().__init__(record)
        self.mode, self.engine, self.buffered = mode, mode.engine, buffered

    def updates(self, global_base: Mapping[str, np.ndarray]) -> Iterator[AcceptedUpdate]:
        """Each buffered upload rebased on the current base with its staleness weight."""
        fleet = self.engine.config.fleet_rounds
        return self.engine.uploads.step(self.buffered, self.record.round_id, global_base, fleet)

    def applied(self) -> list[tuple[int, str, int]]:
        """The buffered uploads and their staleness."""
        return [(u.round_id, u.device, self.record.round_id - u.round_id) for u in self.buffered]

    def next_round(self, base_sha: str, now: float) -> RoundRecord | None:
        """The next base version, unless this was the run's last step."""
        if self.engine.store.count_closed() + 1 >= self.engine.config.rounds:
            return None
        return self.mode.version(self.record.round_id + 1, base_sha, now)

    def done(self) -> None:
        """The applied uploads' delta norms and the cached bases are no longer needed."""
        self.engine.uploads.closed(self.record.round_id, [(u.round_id, u.device) for u in self.buffered])

    def accepted(self) -> int:
        """The buffered uploads the step applied."""
        return len(self.buffered)


class FedBuffMode(RoundMode):
    """Asynchronous buffered steps (module docstring)."""

    name = "fedbuff"
    section = "fedbuff"
    barrier = False  # each buffer of uploads is a step; no device waits for another

    def retained(self, history: int) -> int:
        """At least max_staleness + 1 rounds: an upload is decoded and bounded against the version it trained on."""
        return max(history, self.engine.config.fleet_rounds.max_staleness + 1) if history else history

    def open(self, now: float, available: list[str]) -> RoundRecord | None:
        """The first version opens as soon as one device polls (later versions open with each step)."""
        store = self.engine.store
        if not available or store.last_round_id() > 0:
            return None
        base_sha = store.get_meta("global_base_sha")
        assert base_sha is not None, "bind_state() stores the initial base"
        record = self.version(1, base_sha, now)
        store.create_round(record, [])
        log.info("fedbuff: base version 1 opened")
        return record

    def version(self, round_id: int, base_sha: str, now: float) -> RoundRecord:
        """A base version: the round every device that polls takes a task on."""
        config = self.engine.config
        target = config.fleet_rounds.buffer_size
        return RoundRecord(round_id, "open", base_sha, now, now + config.round_timeout, (), target=target)

    def task(self, device: str, current: RoundRecord, now: float) -> Task | None:
        """No barrier: a device without an upload on the current version trains on it."""
        if self.engine.store.update(current.round_id, device) is not None:
            return None
        return self.engine.train_task(current, self.take_task(device, current), deadline=None)

    def take_task(self, device: str, record: RoundRecord) -> Assignment:
        """The device's assignment on the open version (made once per device and version)."""
        store = self.engine.store
        assignment = store.assignment(record.round_id, device)
        if assignment is None:  # fedbuff's strategies (fedavg, fedper) send every device the global base
            settings = self.engine.strategy.settings(record.round_id)
            assignment = Assignment(
                record.round_id, device, record.base_sha, json.dumps(settings.to_json(), sort_keys=True)
            )
            store.add_assignment(assignment)
        return assignment

    def check_open(self, record: RoundRecord) -> None:
        """An upload trained on version `record` is refused when that base was rejected, or when more than
        --max-staleness steps were made since (no deadline)."""
        if record.state == "abandoned":
            raise Refused("round_closed", f"round {record.round_id}'s base was rejected", "poll /v1/task")
        current = self.engine.store.last_round_id()
        staleness, limit = current - record.round_id, self.engine.config.fleet_rounds.max_staleness
        if staleness > limit:
            raise Refused(
                "too_stale",
                f"the update was trained on base version {record.round_id}, {staleness} steps old (the server takes "
                f"at most {limit})",
                "poll /v1/task and train on the current base; this update was not stored",
            )

    def receipt(self, round_id: int) -> dict[str, Any]:
        """The buffer's fill."""
        return {
            "buffered": len(self.engine.store.buffered_updates()),
            "buffer_size": self.engine.config.fleet_rounds.buffer_size,
        }

    def tick(self, current: RoundRecord, now: float) -> Close | None:
        """Step when the buffer is full, or at the version's deadline with at least min_clients uploads."""
        buffered = self.engine.store.buffered_updates()
        full = len(buffered) >= self.engine.config.fleet_rounds.buffer_size
        if full or (now >= current.deadline and len(buffered) >= self.engine.config.min_clients):
            return Step(self, current, buffered)
        return None

    def rejected(self, record: RoundRecord, fallback: str, now: float) -> RoundRecord | None:
        """The uploads trained on the rejected version are dropped; the next version starts from the rollback."""
        self.engine.store.drop_updates([record.round_id])
        return self.version(record.round_id + 1, fallback, now)

    def status(self, rounds: list[RoundRecord], names: bool) -> dict[str, Any]:
        """The current base version, the buffer's fill, how many devices last uploaded at each staleness, and
        (`names`) each device's last upload."""
        store, fleet = self.engine.store, self.engine.config.fleet_rounds
        current = next((record.round_id for record in rounds if record.state == "open"), store.last_round_id())
        last = {}
        for update in store.last_updates():
            staleness = update.staleness if update.applied_in is not None else current - update.round_id
            last[update.device] = {"round": update.round_id, "staleness": staleness, "applied": update.applied_in}
        by_staleness: dict[int, int] = {}
        for upload in last.values():
            by_staleness[upload["staleness"]] = by_staleness.get(upload["staleness"], 0) + 1
        fedbuff = {
            "base_version": current,
            "buffered": len(store.buffered_updates()),
            "buffer_size": fleet.buffer_size,
            "max_staleness": fleet.max_staleness,
            "staleness_weight": fleet.staleness_weight,
            "server_lr": fleet.server_lr,
            "devices_by_staleness": dict(sorted(by_staleness.items())),
            **({"devices": last} if names else {}),
        }
        return {self.section: fedbuff}
