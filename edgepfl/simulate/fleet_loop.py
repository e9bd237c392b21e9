"""The rounds of a simulated fleet on a virtual clock (`edgepfl simulate --fleet SPEC`, or over-selection, or fedbuff).

The engine's clock is the fleet's virtual clock, and it follows the served engine's own rules: a device's training
takes its speed factor times its work (`fleet.py`), its upload reaches the engine at the moment it finishes, and
the engine decides. A synchronous round opens once enough devices are online, samples among them (with
over-selection: more than its target), and ends at the upload that completes it, or at its deadline when dropouts
left it short (closed with at least min_clients uploads, else abandoned). Under fedbuff there is no round: every
online device polls, takes a task on the current base, trains and uploads when it finishes; the engine makes a
step every buffer-size uploads (a stale upload is refused) and the device polls again at once.

A record is written for every closed round (every fedbuff step) with its `virtual_time`: the virtual clock, in
seconds, when it ended. A fleet run does not resume an interrupted run: rerun it into a new --out.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from edgepfl.device_runtime.algorithms import round_phases
from edgepfl.errors import StateError
from edgepfl.server.errors import Refused
from edgepfl.simulate.fleet import Fleet
from edgepfl.simulate.results import RoundRecord, accuracy_summary

if TYPE_CHECKING:
    from edgepfl.device_runtime.engine import Engine
    from edgepfl.server.driver import DevicePlan
    from edgepfl.server.engine import RoundEngine
    from edgepfl.simulate.loop import Client
    from edgepfl.simulate.workers import Outcome, RayWorkers, Sequential

# evaluate(global base, round id, pending numbers, virtual time) -> the round's record
Evaluate = Callable[[dict[str, np.ndarray], int, dict[str, Any], float], RoundRecord]


@dataclass
class FleetRun:
    """What the fleet's rounds drive: the served engine on the virtual clock, the clients and their workers."""

    server: RoundEngine
    engine: Engine  # the clients' training engine (its trainable sets give a round's work)
    clients: list[Client]
    workers: Sequential | RayWorkers
    fleet: Fleet
    rounds: int
    evaluate: Evaluate
    on_record: Callable[[RoundRecord], None]
    progress: Callable[[int, int, int], None] | None = None
    _traffic: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.by_name = {client.name: client for client in self.clients}
        self._reset()

    def run(self) -> None:
        """Run rounds (fedbuff: steps) until `rounds` are closed, on the virtual clock."""
        if self.server.mode.barrier:  # the engine's round mode says how its rounds close
            self._synchronous()
        else:
            self._buffered()

    # synchronous rounds, with over-selection

    def _synchronous(self) -> None:
        now = self.server.clock.now
        while self.server.closed_rounds() < self.rounds:
            online = self._online(now)
            round_id = self.server.next_round_id()
            started = time.perf_counter()
            plans = self.server.open_round(round_id, online, now=now)
            if plans is None:
                return  # the engine stopped the run (--dp-target-epsilon)
            record = self.server.round(round_id)
            assert record is not None
            finishing = {}
            for name, plan in plans.items():
                end = record.opened + self.fleet.training_time(name, self._work(name, plan))
                if self.fleet.completes(name, round_id, record.opened, end):
                    finishing[name] = end
            trained = self.workers.run(round_id, {n: plans[n] for n in finishing}, self._tensors(finishing))
            outcomes = dict(trained)
            for done, name in enumerate(sorted(finishing, key=lambda n: (finishing[n], n)), start=1):
                self._until(round_id, finishing[name])
                self._arrive(name, round_id, plans[name], outcomes[name])
                self.server.tick()
                if self.progress is not None:
                    self.progress(self.server.closed_rounds() + 1, done, len(plans))
            record = self.server.round(round_id)
            assert record is not None
            if record.state == "open":  # dropouts left it short: it ends at its deadline
                self.server.clock.now = max(self.server.clock.now, record.deadline)
                self.server.tick()
                record = self.server.round(round_id)
                assert record is not None
            now = record.closed if record.closed is not None else self.server.clock.now
            if record.state == "closed":
                self._record(round_id, len(plans), started, now)

    def _until(self, round_id: int, end: float) -> None:
        """Move the clock to an upload at `end`: while the round is open, and never past its deadline, where it
        ends first (as a served engine's tick ends it). A later upload meets the ended round at that moment: the
        clock stays there, so that no round opened meanwhile is ticked past its own deadline."""
        record = self.server.round(round_id)
        assert record is not None
        if record.state != "open":
            return
        if end >= record.deadline:
            self.server.clock.now = max(self.server.clock.now, record.deadline)
            self.server.tick()
            return
        self.server.clock.now = end

    def _online(self, now: float) -> list[str]:
        """The devices online at `now`; the virtual clock moves on to when enough of them are."""
        needed = min(self.server.config.min_clients, len(self.clients))
        while True:
            online = [client.name for client in self.clients if self.fleet.online(client.name, now)]
            if len(online) >= needed:
                self.server.clock.now = now
                return online
            now = min(self.fleet.next_online(c.name, now) for c in self.clients if c.name not in online) + 1e-6

    # fedbuff

    def _buffered(self) -> None:
        order = itertools.count()
        events: list[tuple[float, int, str, str, Any]] = []
        tasks = dict.fromkeys(self.by_name, 0)
        wait = self.server.config.poll_interval
        for client in self.clients:
            heapq.heappush(events, (self.fleet.next_online(client.name, 0.0), next(order), "poll", client.name, None))
        started = time.perf_counter()
        while events and self.server.closed_rounds() < self.rounds:
            now, _, kind, name, payload = heapq.heappop(events)
            self.server.clock.now = now
            if kind == "poll":
                polled = self.server.poll(name)
                if polled is None:  # told to wait: it polls again after the server's retry_after
                    heapq.heappush(events, (now + wait, next(order), "poll", name, None))
                    continue
                version, plan = polled
                tasks[name] += 1
                end = now + self.fleet.training_time(name, self._work(name, plan))
                if not self.fleet.completes(name, tasks[name], now, end):  # dropped out: back when online again
                    heapq.heappush(events, (self.fleet.next_online(name, end), next(order), "poll", name, None))
                    continue
                ((_, outcome),) = self.workers.run(version, {name: plan}, self._tensors([name]))
                heapq.heappush(events, (end, next(order), "upload", name, (version, plan, outcome)))
                continue
            version, plan, outcome = payload
            closed = self.server.closed_rounds()
            self._arrive(name, version, plan, outcome)
            self.server.tick()
            if self.server.closed_rounds() > closed:
                step = self.server.next_round_id() - 1
                self._record(step, self._traffic["uploads"], started, now)
                started = time.perf_counter()
                if self.progress is not None:
                    self.progress(self.server.closed_rounds(), 1, 1)
            heapq.heappush(events, (now, next(order), "poll", name, None))
        if self.server.closed_rounds() < self.rounds:
            raise StateError("the simulated fleet ran out of devices before the last step", "use a larger fleet")

    # shared

    def _arrive(self, name: str, round_id: int, plan: DevicePlan, outcome: Outcome) -> None:
        """A device's trained round reaches the engine: its tensors are kept, its upload offered (a refusal is
        what a device meets: it keeps its model and moves on), a refused base reported."""
        self.by_name[name].tensors = outcome.tensors
        traffic = self._traffic
        traffic["bytes_down"] += plan.nbytes
        traffic["trained"][name] = outcome.trained_accuracy
        if not math.isnan(outcome.train_loss):
            traffic["losses"].append(outcome.train_loss)
        if outcome.refused is not None:
            self.server.accept_refusal(name, round_id, outcome.refused)
        if outcome.payload is None:
            return
        traffic["bytes_up"] += len(outcome.payload)
        try:
            self.server.accept_update(name, round_id, outcome.payload)
            traffic["uploads"] += 1
        except Refused as refused:
            if refused.error not in ("round_closed", "deadline_passed", "too_stale"):
                raise
            traffic["refused"] += 1

    def _record(self, round_id: int, sampled: int, started: float, now: float) -> None:
        traffic = self._traffic
        pending = {
            "train_loss": float(np.mean(traffic["losses"])) if traffic["losses"] else None,
            "sampled": sampled,
            "bytes_up": traffic["bytes_up"],
            "bytes_down": traffic["bytes_down"],
            "seconds": time.perf_counter() - started,
            "trained_test_accuracy": accuracy_summary([traffic["trained"].get(c.name, math.nan) for c in self.clients]),
            "late_uploads": traffic["refused"],
        }
        self.on_record(self.evaluate(self.server.global_base(), round_id, pending, now))
        self._reset()

    def _reset(self) -> None:
        self._traffic = {"bytes_up": 0, "bytes_down": 0, "losses": [], "trained": {}, "uploads": 0, "refused": 0}

    def _work(self, name: str, plan: DevicePlan) -> int:
        """The samples a device trains in a round: its training samples times the round's epochs."""
        epochs = sum(phase.epochs for phase in round_phases(plan.settings, self.engine.available_sets()))
        return epochs * self.by_name[name].train.num_train

    def _tensors(self, names: Any) -> dict[str, dict[str, np.ndarray]]:
        return {name: self.by_name[name].tensors for name in names}
