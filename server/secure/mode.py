"""Secure rounds (`--secure-aggregation`): synchronous rounds whose devices take SecAgg+'s steps instead of uploading.

A secure round opens, samples and plans as a synchronous round does (`server/modes/sync.py`); its devices then
advertise keys, share, send masked vectors and reveal (`rounds.py` steps each round's session from the tick;
`steps.py` takes the messages, over HTTP through `routes.py`). The round closes when its session can unmask the sum
(it is abandoned when the session fails: too many devices dropped), and the strategy, wrapped by
`strategy.SecureStrategy`, aggregates that sum. The server takes no plain upload in this mode."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from edgepfl.protocol import Task
from edgepfl.server.errors import Refused
from edgepfl.server.modes.base import Close, DeviceCalls
from edgepfl.server.modes.sync import SyncClose, SyncMode
from edgepfl.server.records import RoundRecord
from edgepfl.server.sampling import sample_size
from edgepfl.server.secure.rounds import SecureRounds
from edgepfl.server.secure.steps import SecureSteps
from edgepfl.server.secure.strategy import SecureStrategy

if TYPE_CHECKING:
    from fastapi import APIRouter

    from edgepfl.server.config import HttpLimits
    from edgepfl.server.store import Store


class SecureClose(SyncClose):
    """A secure round's close: its updates are in the unmasked sum, not stored one by one."""

    def __init__(self, mode: SecureMode, record: RoundRecord):
        super().__init__(mode, record)
        self.steps = mode.steps

    def accepted(self) -> int:
        """The devices whose masked vectors the sum holds."""
        return (self.steps.summary(self.record.round_id) or {}).get("masked", 0)


class SecureMode(SyncMode):
    """The synchronous mode with SecAgg+'s steps in place of the upload (module docstring)."""

    name = "secure"
    section = "secure_aggregation"

    def __init__(self, engine: Any, calls: DeviceCalls):
        super().__init__(engine, calls)
        config = engine.config
        secagg = config.secure.config(config.privacy.clip_norm)
        assert secagg is not None, "the registry picks this mode with --secure-aggregation"
        self.secure = SecureRounds(
            secagg,
            config.secure.secagg_step_timeout,
            engine.store,
            engine.specs,
            measured=config.secure.measured(config.privacy.clip_norm),
        )
        self.steps = SecureSteps(calls, self.secure)  # the devices' messages (routes.py, the in-process drivers)

    @classmethod
    def quorum(cls, clients: int, fraction: float, min_clients: int) -> int:
        """Every sampled client takes the protocol's steps: the cohort is the quorum, and is sampled alike."""
        return sample_size(clients, fraction, min_clients)

    def bind(self) -> None:
        """Secure aggregation wraps the strategy (and DP's wrapper): it aggregates the unmasked sum."""
        self.engine.strategy = SecureStrategy(self.engine.strategy, self.secure)

    @classmethod
    def foreign(cls, store: Store, current: RoundRecord | None, active: bool) -> str | None:
        """An open round started with secure aggregation on and resumed with it off (or the reverse): its devices
        were told another protocol. Ended rounds' sessions are forgotten either way."""
        secure = SecureRounds.is_secure(store, current.round_id) if current is not None else False
        SecureRounds.forget_ended(store, current.round_id if current is not None and secure else None)
        if current is None or secure == active:
            return None
        return (
            f"it opened {'with' if secure else 'without'} --secure-aggregation and the server restarted "
            f"{'without' if secure else 'with'} it"
        )

    def opened(self, record: RoundRecord) -> None:
        """The round's session starts."""
        self.secure.opened(record)

    def takes(self, current: RoundRecord) -> bool:
        """Train tasks go out while the round takes its keys."""
        return self.secure.takes_keys(current.round_id)

    def task(self, device: str, current: RoundRecord, now: float) -> Task | None:
        """A synchronous round's task, with where the device takes the round's steps (its alias, the context)."""
        task = super().task(device, current, now)
        if task is None or task.round_id is None:
            return task
        return dataclasses.replace(task, secure_aggregation=self.steps.task(device, task.round_id))

    def check_upload(self, device: str, round_id: int) -> None:
        """No plain update: the devices mask theirs."""
        raise Refused(
            "secure_round",
            f"round {round_id} is aggregated securely: the server takes no plain update",
            "update the device: it masks its update through the round's secure_aggregation steps",
        )

    def tick(self, current: RoundRecord, now: float) -> Close | None:
        """The protocol's steps decide (secure.py): close when the sum can be unmasked, abandon when it failed."""
        engine = self.engine
        given = engine.store.assigned_devices(current.round_id)
        refused = [device for device, _ in engine.store.refusals(current.round_id)]
        verdict = self.secure.tick(current, now, given, refused, engine.config.min_clients)
        if verdict is not None and verdict[0] == "close":
            return SecureClose(self, current)
        if verdict is not None:
            engine.lifecycle.abandon(current, now, str(verdict[1]))
        return None

    def status(self, rounds: list[RoundRecord], names: bool) -> dict[str, Any]:
        """Secure aggregation's settings; each secure round's row says what happened in it."""
        config = self.secure.round_config()  # the clip and weight scale the next round opens with (measured)
        secure = {
            "protocol": "SecAgg+ (classic SecAgg when every device is every other's neighbour), double masking",
            "clip_norm": config.clip_norm,
            "threshold": config.threshold,
            "neighbours": config.neighbours,
            "bits": config.bits if config.bits is not None else "auto",
            "max_weight": config.max_weight,
            "weight_scale": config.scale_weight,
            "measured": [name for name in ("clip", "weight") if getattr(self.secure.measured, name)],
            "step_timeout": self.secure.step_timeout,
        }
        return {self.section: secure}

    def annotate(self, rows: list[dict[str, Any]]) -> None:
        """A secure round's row: its step and how many devices were masked, dropped and recovered."""
        summaries = self.secure.summaries()
        for row in rows:
            if row["round"] in summaries:
                row["secure_aggregation"] = summaries[row["round"]]

    def waiting(
        self, record: RoundRecord, given: Sequence[str], refused: Sequence[str]
    ) -> tuple[str | None, list[str], float]:
        """A round that holds a session waits for a step's messages, until the step's deadline."""
        if not self.secure.holds(record.round_id):
            return super().waiting(record, given, refused)
        step, missing = self.secure.waiting_for(record.round_id, given, sorted(refused))
        return step, missing, self.secure.step_deadline(record)

    def router(self, limits: HttpLimits) -> APIRouter:
        """The secure steps' routes (`routes.py`)."""
        from edgepfl.server.secure.routes import secure_router

        return secure_router(self.steps, self.engine.config, limits)

    def seeded(self, seed: int) -> None:
        """The secure rounds' graph randomness, from an in-process run's --seed."""
        self.secure.seeded(seed)
