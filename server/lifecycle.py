"""The life of a round: when it opens, when it closes (aggregated) or is abandoned, and what is stored when.

One engine per state folder and per process. A round opens (its devices sampled and planned), takes uploads,
and closes: the strategy aggregates what the round's mode hands it and the result becomes the global base, in one
SQLite transaction, so a round is aggregated once or not at all. A round that cannot close (too few uploads by its
deadline, a failed aggregation or secure session) is *abandoned*: nothing is aggregated, and the next round (a new
id) starts from the same global base. After `rounds` closed rounds every device is told "done" and given the final
base.

When a round opens, which device trains in it, which upload it still takes and when it closes are its mode's
(`server/modes/`: synchronous rounds with over-selection, FedBuff's steps, secure rounds); this file does what
every mode shares: the tick that asks the mode, the close's one transaction, abandoning, the rollback.

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
from edgepfl.server.modes import MODES, Close
from edgepfl.server.records import Assignment, RoundRecord
from edgepfl.server.uploads import check_plan
from edgepfl.wire import check_tensors, decode_tensors, encode_tensors

if TYPE_CHECKING:
    from edgepfl.server.engine import RoundEngine

log = logging.getLogger("edgepfl.server")


class Lifecycle:
    """Opening, closing and abandoning rounds for one engine (its store, strategy, clock and mode)."""

    def __init__(self, engine: RoundEngine):
        self.engine = engine

    def tick(self) -> None:
        """Close the open round if its mode says so (complete, past its deadline, a full buffer), then open the next
        one if devices wait."""
        with self.engine.lock:
            now = self.engine.clock()
            current = self.engine.store.open_round()
            close = None
            if current is not None and self.engine.closing is None:
                close = self.engine.mode.tick(current, now)
                if close is not None:
                    self.engine.closing = current.round_id
        if close is not None:
            self.close(close)
        with self.engine.lock:
            if self.engine.closing is None and not self.done() and self.engine.store.open_round() is None:
                self.maybe_open(self.engine.clock())

    def run(self, stop: threading.Event, interval: float = 0.25) -> None:
        """Tick until `stop` is set; woken early by each accepted upload. Never dies on an error."""
        while not stop.is_set():
            self.engine.wake.wait(interval)
            self.engine.wake.clear()
            try:
                self.tick()
            except Exception:  # the loop must outlive any one round's failure; the round stays open
                log.exception("round engine tick failed; retrying")
                with self.engine.lock:
                    self.engine.closing = None
                stop.wait(1.0)

    def close(self, close: Close) -> None:
        """Aggregate the round the mode closes (over the uploads `close` names) and commit it, or abandon it."""
        record = close.record
        started = time.perf_counter()
        try:
            global_base = decode_tensors(self.engine.store.blobs.read(record.base_sha))
            new_base = self.engine.strategy.aggregate(record.round_id, close.updates(global_base), global_base)
            check_tensors(new_base, self.engine.specs, what=f"aggregate of round {record.round_id}")
            closing = self.engine.strategy.closing(record)
        except OSError:
            with self.engine.lock:
                self.load_strategy_state()  # the round stays open and is aggregated again from the saved state
                self.engine.closing = None
            raise
        except (EdgePFLError, ValueError) as error:
            log.error("round %d cannot be aggregated: %s", record.round_id, error)
            with self.engine.lock:
                self.load_strategy_state()
                self.abandon(record, self.engine.clock(), f"aggregation failed: {error}")
                self.engine.closing = None
            return
        try:
            sha = self.engine.store.blobs.put(encode_tensors(new_base))
            strategy_state = self.engine.strategy.state_bytes()
            state_sha = self.engine.store.blobs.put(strategy_state) if strategy_state is not None else None
            seconds = time.perf_counter() - started
            with self.engine.lock:
                now = self.engine.clock()
                self.engine.store.finish_round(
                    record.round_id,
                    "closed",
                    now,
                    global_base_sha=sha,
                    result_sha=sha,
                    aggregate_seconds=seconds,
                    strategy_state_sha=state_sha,
                    epsilon=closing.get("epsilon"),
                    meta=closing.get("meta"),
                    applied=close.applied(),
                    next_round=close.next_round(sha, now),
                )
        except BaseException:
            with self.engine.lock:
                self.load_strategy_state()
                self.engine.closing = None
            raise
        with self.engine.lock:
            self.engine.closing = None
            close.done()
            self.engine.downloads.clear()
            self.engine.retention.apply()  # after the commit: a failed release leaves the round closed, blobs kept
        epsilon, dp = closing.get("epsilon"), self.engine.dp
        spent = f"; epsilon {epsilon:.4g} at delta {dp.delta:g}" if epsilon is not None and dp else ""
        accepted = close.accepted()
        log.info("round %d closed: %d update(s) aggregated in %.3f s%s", record.round_id, accepted, seconds, spent)

    def load_strategy_state(self) -> None:
        """Bring the strategy back to its last saved state (a strategy that keeps none is left as is)."""
        sha = self.engine.store.get_meta("strategy_state_sha")
        if sha is not None:
            self.engine.strategy.load_state(self.engine.store.blobs.read(sha))
        elif self.engine.strategy.state_bytes() is not None:  # nothing saved yet: back to a fresh strategy
            self.engine.strategy = self.engine.strategy.fresh()

    def abandon(self, record: RoundRecord, now: float, why: str) -> None:
        """Abandon a round: nothing is aggregated, and the next round starts from the same global base."""
        global_base = self.engine.store.get_meta("global_base_sha") or record.base_sha
        self.engine.store.finish_round(record.round_id, "abandoned", now, global_base_sha=global_base, note=why)
        log.warning("round %d abandoned: %s; the next round starts from the same base", record.round_id, why)

    def abandon_foreign(self) -> None:
        """At start: abandon an open round that a mode other than this server's opened (every mode says)."""
        current = self.engine.store.open_round()
        for kind in MODES.values():
            why = kind.foreign(self.engine.store, current, isinstance(self.engine.mode, kind))
            if why is not None and current is not None:
                self.abandon(current, self.engine.clock(), why)
                current = None

    def reject_base(self, record: RoundRecord, refused: int) -> None:
        """A majority of the round's devices refused its base: abandon the round, roll the global base back to the
        last base not rejected (the mode may open the next round from it, e.g. fedbuff's next version)."""
        rejected = self.engine.store.rejected_bases() | {record.base_sha}
        chain = [r.base_sha for r in reversed(self.engine.store.rounds()) if r.state == "closed"]
        initial = self.engine.store.get_meta("initial_base_sha")
        fallback = next((sha for sha in [*chain, initial] if sha not in rejected), initial)
        assert fallback is not None, "bind_state() stores the initial base"
        now = self.engine.clock()
        note = f"its base was refused by {refused} device(s): rolled back to base {fallback[:12]}"
        next_round = self.engine.mode.rejected(record, fallback, now)
        self.engine.store.finish_round(
            record.round_id,
            "abandoned",
            now,
            global_base_sha=fallback,
            note=note,
            next_round=next_round,
            rejected=record.base_sha,
        )
        self.engine.downloads.clear()
        log.warning("round %d abandoned: %s", record.round_id, note)

    def maybe_open(self, now: float) -> RoundRecord | None:
        """Open the next round if the mode finds the available devices enough."""
        recent = sorted(d for d, seen in self.engine.seen.items() if now - seen <= self.engine.config.available_for)
        return self.engine.mode.open(now, self.engine.strategy.admissible(recent))

    def open_planned(self, round_id: int, sampled: list[str], now: float, population: int, target: int) -> RoundRecord:
        """Plan round `round_id` for the `sampled` devices and commit its opening with the strategy's state."""
        base_sha = self.engine.store.get_meta("global_base_sha")
        assert base_sha is not None, "bind_state() stores the initial base"
        try:
            assignments = self.plan_round(round_id, sampled, base_sha)
            # planning may change the strategy (e.g. a device's first sight): saved with the round's opening
            strategy_state = self.engine.strategy.state_bytes()
            state_sha = self.engine.store.blobs.put(strategy_state) if strategy_state is not None else None
        except EdgePFLError as error:  # the strategy refuses this round
            self.load_strategy_state()
            log.error("round %d not opened: %s", round_id, error)
            raise Refused("round_not_opened", error.problem, error.fix) from None
        except BaseException:
            self.load_strategy_state()
            raise
        deadline = now + self.engine.config.round_timeout
        record = RoundRecord(
            round_id, "open", base_sha, now, deadline, tuple(sampled), population=population, target=target
        )
        try:
            self.engine.store.create_round(record, assignments, strategy_state_sha=state_sha)
        except BaseException:
            self.load_strategy_state()
            raise
        return record

    def plan_round(self, round_id: int, sampled: list[str], base_sha: str) -> list[Assignment]:
        """Ask the strategy for every sampled device's settings and base; each distinct base is stored once."""
        global_base = decode_tensors(self.engine.store.blobs.read(base_sha))
        plans = self.engine.strategy.configure_round(round_id, sampled, global_base)
        stored: dict[int, str] = {id(global_base): base_sha}  # the shared base is already a blob
        assignments = []
        for device in sampled:
            settings, payload = plans[device]
            if id(payload) not in stored:
                check_plan(self.engine.strategy.name, self.engine.specs, device, settings, payload)
                stored[id(payload)] = self.engine.store.blobs.put(encode_tensors(payload))
            assignments.append(
                Assignment(round_id, device, stored[id(payload)], json.dumps(settings.to_json(), sort_keys=True))
            )
        return assignments

    def done(self) -> bool:
        """Whether the run is over: stopped (the DP budget), or --rounds rounds closed."""
        return self.engine.stopped is not None or self.engine.store.count_closed() >= self.engine.config.rounds
