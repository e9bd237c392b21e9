"""The life of a round: when it opens, when it closes (aggregated) or is abandoned, and what is stored when.

One engine per state folder and per process. Rounds follow one life:

- A round opens when no round is open and at least `min_clients` devices have polled `/v1/task`
  within `available_for` seconds, and either every enrolled device is among them or one
  `poll_interval` has passed since `min_clients` were first available (so every live device has had
  a chance to show up, and round 1 is not just the first `min_clients` to poll). It samples
  max(min_clients, ceil(fraction * available)) of them (capped at the number available) with an
  RNG seeded by (seed, round id), so a restart samples alike.
- It closes when every sampled device has uploaded, or at its deadline if at least `min_clients`
  uploads were accepted: the strategy aggregates the accepted updates and the result becomes the
  global base. Closing is one SQLite transaction, so a round is aggregated once or not at all.
- At its deadline with fewer than `min_clients` uploads, the round is *abandoned*: nothing is
  aggregated, its uploads are kept on disk but never used, and the next round (a new id) starts
  from the same global base.
- After `rounds` closed rounds every device is told "done" and given the final base.

With over-selection (`--over-select F`, `fleet.py`) a round samples ceil(target x (1 + F)) devices and closes
as soon as its target's uploads are accepted. With `--aggregation fedbuff` there is no barrier: one round is
open at any time (the current base version), any device that polls takes a task on it, and every
`--buffer-size` accepted uploads (or, at the round's deadline, at least `min_clients` of them) close it in one
server step that opens the next version in the same transaction.

With `--secure-aggregation` (`secure.py`) a round's devices take the protocol's steps instead of uploading, and
the round closes when its session can unmask the sum (it is abandoned when the session fails: too many devices
dropped); the strategy then aggregates that sum (`secure_strategy.py`).

A round's base that a majority of its devices refuse (NaN or Inf, or training that diverges from it; devices
report it, `POST /v1/rounds/{r}/refusal`) is rejected: the round is abandoned at once and the global base rolls
back to the last base not rejected, so a poisoned aggregate cannot stall the fleet (docs/server.md).

A strategy that learns more than the global base (pFedLA's hypernetworks) hands it over as
`state_bytes()`; it is saved as a blob in the transaction that opens or closes a round, loaded at
start, and reloaded whenever an opening or a close fails, so a restart or a retried close never
applies a round twice.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import TYPE_CHECKING

from edgepfl.errors import EdgePFLError
from edgepfl.server.errors import Refused
from edgepfl.server.records import Assignment, RoundRecord, UpdateRecord
from edgepfl.server.sampling import sample_devices, sample_size
from edgepfl.server.uploads import check_plan
from edgepfl.wire import check_tensors, decode_tensors, encode_tensors

if TYPE_CHECKING:
    from edgepfl.server.engine import RoundEngine

log = logging.getLogger("edgepfl.server")


class RoundLifecycle:
    """Opening, closing and abandoning rounds (a mixin of `RoundEngine`, whose state it uses)."""

    def tick(self: RoundEngine) -> None:
        """Close a round that is complete or past its deadline (fedbuff: step when the buffer is full), then open
        the next one if devices wait."""
        with self._lock:
            now = self.clock()
            current = self.store.open_round()
            to_close, buffered = None, None
            if current is not None and self._closing is None:
                if self.config.fleet_rounds.asynchronous:
                    buffered = self.store.buffered_updates()
                    full = len(buffered) >= self.config.fleet_rounds.buffer_size
                    if full or (now >= current.deadline and len(buffered) >= self.config.min_clients):
                        to_close = current
                elif self.secure is not None:  # the protocol's steps decide (secure.py)
                    given = self.store.assigned_devices(current.round_id)
                    refused = [device for device, _ in self.store.refusals(current.round_id)]
                    verdict = self.secure.tick(current, now, given, refused, self.config.min_clients)
                    if verdict is not None and verdict[0] == "close":
                        to_close = current
                    elif verdict is not None:
                        self._abandon(current, now, str(verdict[1]))
                else:
                    accepted = len(self.store.updates(current.round_id))
                    if accepted >= current.needed or now >= current.deadline:
                        if accepted >= self.config.min_clients:
                            to_close = current
                        else:
                            self._abandon(current, now, f"{accepted} of {current.needed} uploads by the deadline")
                if to_close is not None:
                    self._closing = to_close.round_id
        if to_close is not None:
            self._close(to_close, buffered)
        with self._lock:
            if self._closing is None and not self._done() and self.store.open_round() is None:
                self._maybe_open(self.clock())

    def run(self: RoundEngine, stop: threading.Event, interval: float = 0.25) -> None:
        """Tick until `stop` is set; woken early by each accepted upload. Never dies on an error."""
        while not stop.is_set():
            self._wake.wait(interval)
            self._wake.clear()
            try:
                self.tick()
            except Exception:  # the loop must outlive any one round's failure; the round stays open
                log.exception("round engine tick failed; retrying")
                with self._lock:
                    self._closing = None
                stop.wait(1.0)

    def _close(self: RoundEngine, record: RoundRecord, buffered: list[UpdateRecord] | None = None) -> None:
        """Aggregate a round (fedbuff: its step over the `buffered` uploads) and commit it, or abandon it."""
        started = time.perf_counter()
        try:
            global_base = decode_tensors(self.store.blobs.read(record.base_sha))
            if buffered is None:
                updates = self.uploads.for_strategy(record, self.strategy)
            else:
                updates = self.uploads.step(buffered, record.round_id, global_base, self.config.fleet_rounds)
            new_base = self.strategy.aggregate(record.round_id, updates, global_base)
            check_tensors(new_base, self.specs, what=f"aggregate of round {record.round_id}")
            closing = self.strategy.closing(record)
        except OSError:
            with self._lock:
                self._load_strategy_state()  # the round stays open and is aggregated again from the saved state
                self._closing = None
            raise
        except (EdgePFLError, ValueError) as error:
            log.error("round %d cannot be aggregated: %s", record.round_id, error)
            with self._lock:
                self._load_strategy_state()
                self._abandon(record, self.clock(), f"aggregation failed: {error}")
                self._closing = None
            return
        try:
            sha = self.store.blobs.put(encode_tensors(new_base))
            strategy_state = self.strategy.state_bytes()
            state_sha = self.store.blobs.put(strategy_state) if strategy_state is not None else None
            seconds = time.perf_counter() - started
            with self._lock:
                now = self.clock()
                applied = [(u.round_id, u.device, record.round_id - u.round_id) for u in buffered or ()]
                self.store.finish_round(
                    record.round_id,
                    "closed",
                    now,
                    global_base_sha=sha,
                    result_sha=sha,
                    aggregate_seconds=seconds,
                    strategy_state_sha=state_sha,
                    epsilon=closing.get("epsilon"),
                    meta=closing.get("meta"),
                    applied=applied,
                    next_round=self._next_version(record.round_id + 1, sha, now) if self._steps_on(buffered) else None,
                )
        except BaseException:
            with self._lock:
                self._load_strategy_state()
                self._closing = None
            raise
        with self._lock:
            self._closing = None
            self.uploads.closed(record.round_id, [(u.round_id, u.device) for u in buffered] if buffered else None)
            self.downloads.clear()
            self.retention.apply()  # after the commit: a failed release leaves the round closed and the blobs kept
        epsilon = closing.get("epsilon")
        spent = f"; epsilon {epsilon:.4g} at delta {self.dp.delta:g}" if epsilon is not None and self.dp else ""
        accepted = len(buffered) if buffered is not None else len(self.store.updates(record.round_id))
        if self.secure is not None:  # a secure round's updates are in its unmasked sum, not stored one by one
            accepted = (self.secure_summary(record.round_id) or {}).get("masked", 0)
        log.info("round %d closed: %d update(s) aggregated in %.3f s%s", record.round_id, accepted, seconds, spent)

    def _load_strategy_state(self: RoundEngine) -> None:
        """Bring the strategy back to its last saved state (a strategy that keeps none is left as is)."""
        sha = self.store.get_meta("strategy_state_sha")
        if sha is not None:
            self.strategy.load_state(self.store.blobs.read(sha))
        elif self.strategy.state_bytes() is not None:  # nothing saved yet: back to a fresh strategy
            self.strategy = self.strategy.fresh()

    def _abandon(self: RoundEngine, record: RoundRecord, now: float, why: str) -> None:
        global_base = self.store.get_meta("global_base_sha") or record.base_sha
        self.store.finish_round(record.round_id, "abandoned", now, global_base_sha=global_base, note=why)
        log.warning("round %d abandoned: %s; the next round starts from the same base", record.round_id, why)

    def _reject_base(self: RoundEngine, record: RoundRecord, refused: int) -> None:
        """A majority of the round's devices refused its base: abandon the round, roll the global base back to the
        last base not rejected (fedbuff: the next version starts from it, uploads trained on this one dropped)."""
        rejected = self.store.rejected_bases() | {record.base_sha}
        chain = [r.base_sha for r in reversed(self.store.rounds()) if r.state == "closed"]
        initial = self.store.get_meta("initial_base_sha")
        fallback = next((sha for sha in [*chain, initial] if sha not in rejected), initial)
        assert fallback is not None, "bind_state() stores the initial base"
        now = self.clock()
        note = f"its base was refused by {refused} device(s): rolled back to base {fallback[:12]}"
        asynchronous = self.config.fleet_rounds.asynchronous
        if asynchronous:
            self.store.drop_updates([record.round_id])
        next_round = self._next_version(record.round_id + 1, fallback, now) if asynchronous else None
        self.store.finish_round(
            record.round_id, "abandoned", now, global_base_sha=fallback, note=note, next_round=next_round,
            rejected=record.base_sha,
        )  # fmt: skip
        self.downloads.clear()
        log.warning("round %d abandoned: %s", record.round_id, note)

    def _steps_on(self: RoundEngine, buffered: list[UpdateRecord] | None) -> bool:
        """Whether a close is a fedbuff step after which another version opens (not the run's last step)."""
        return buffered is not None and self.store.count_closed() + 1 < self.config.rounds

    def _next_version(self: RoundEngine, round_id: int, base_sha: str, now: float) -> RoundRecord:
        """Fedbuff's next round: the base version every device that polls takes a task on."""
        target = self.config.fleet_rounds.buffer_size
        return RoundRecord(round_id, "open", base_sha, now, now + self.config.round_timeout, (), target=target)

    def _maybe_open(self: RoundEngine, now: float) -> RoundRecord | None:
        recent = sorted(d for d, seen in self._seen.items() if now - seen <= self.config.available_for)
        available = self.strategy.admissible(recent)
        if self.config.fleet_rounds.asynchronous:  # the first version opens as soon as one device polls
            if not available or self.store.last_round_id() > 0:
                return None
            base_sha = self.store.get_meta("global_base_sha")
            assert base_sha is not None, "bind_state() stores the initial base"
            record = self._next_version(1, base_sha, now)
            self.store.create_round(record, [])
            log.info("fedbuff: base version 1 opened")
            return record
        if len(available) < self.config.min_clients:
            self._quorum_since = None
            return None
        if self._quorum_since is None:
            self._quorum_since = now
        everyone = len(available) >= self.store.count_devices()
        if not everyone and now - self._quorum_since < self.config.poll_interval:
            return None
        self._quorum_since = None
        round_id = self.store.last_round_id() + 1
        fraction, min_clients = self.config.fraction, self.config.min_clients
        target = sample_size(len(available), fraction, min_clients)
        over_select = self.config.fleet_rounds.over_select
        sampled = sample_devices(self.config.seed, round_id, available, fraction, min_clients, over_select)
        if self.budget is not None:
            self.stopped = self.budget.stop_before(round_id, len(available), len(sampled))
            if self.stopped is not None:
                log.warning("%s", self.stopped)
                return None
        base_sha = self.store.get_meta("global_base_sha")
        assert base_sha is not None, "bind_state() stores the initial base"
        try:
            assignments = self._plan_round(round_id, sampled, base_sha)
            # planning may change the strategy (e.g. a device's first sight): saved with the round's opening
            strategy_state = self.strategy.state_bytes()
            state_sha = self.store.blobs.put(strategy_state) if strategy_state is not None else None
        except EdgePFLError as error:  # the strategy refuses this round
            self._load_strategy_state()
            log.error("round %d not opened: %s", round_id, error)
            raise Refused("round_not_opened", error.problem, error.fix) from None
        except BaseException:
            self._load_strategy_state()
            raise
        deadline = now + self.config.round_timeout
        record = RoundRecord(
            round_id, "open", base_sha, now, deadline, tuple(sampled), population=len(available), target=target
        )
        try:
            self.store.create_round(record, assignments, strategy_state_sha=state_sha)
        except BaseException:
            self._load_strategy_state()
            raise
        if self.secure is not None:
            self.secure.opened(record)
        log.info(
            "round %d opened: %d of %d available device(s) sampled, %d upload(s) close it",
            round_id, len(sampled), len(available), target,
        )  # fmt: skip
        return record

    def take_task(self: RoundEngine, device: str, record: RoundRecord) -> Assignment:
        """Fedbuff: the device takes a task on the open version (its assignment, made once per device and version)."""
        assignment = self.store.assignment(record.round_id, device)
        if assignment is None:  # fedbuff's strategies (fedavg, fedper) send every device the global base
            settings = self.strategy.settings(record.round_id)
            assignment = Assignment(
                record.round_id, device, record.base_sha, json.dumps(settings.to_json(), sort_keys=True)
            )
            self.store.add_assignment(assignment)
        return assignment

    def _plan_round(self: RoundEngine, round_id: int, sampled: list[str], base_sha: str) -> list[Assignment]:
        """Ask the strategy for every sampled device's settings and base; each distinct base is stored once."""
        global_base = decode_tensors(self.store.blobs.read(base_sha))
        plans = self.strategy.configure_round(round_id, sampled, global_base)
        stored: dict[int, str] = {id(global_base): base_sha}  # the shared base is already a blob
        assignments = []
        for device in sampled:
            settings, payload = plans[device]
            if id(payload) not in stored:
                check_plan(self.strategy.name, self.specs, device, settings, payload)
                stored[id(payload)] = self.store.blobs.put(encode_tensors(payload))
            assignments.append(
                Assignment(round_id, device, stored[id(payload)], json.dumps(settings.to_json(), sort_keys=True))
            )
        return assignments

    def _done(self: RoundEngine) -> bool:
        return self.stopped is not None or self.store.count_closed() >= self.config.rounds

