"""The round mode interface: what the engine core (server/engine.py, lifecycle.py) asks of the mode it runs.

The core owns the store, the strategy, the upload path and the clock; a mode decides when a round opens, which
device trains in it, whether an upload may still enter it, when it closes (and over which uploads) and what the
status says of it. Each mode is one module of `server/modes/` (or, for secure aggregation, its package `server/secure/`)
and one line of its registry (`MODES`); nothing outside a mode's module tests which mode runs. A mode that takes
device calls of its own (its routes, the in-process drivers' steps) reaches the core through `DeviceCalls` alone.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from edgepfl.protocol import Task
from edgepfl.server.records import RoundRecord
from edgepfl.server.strategy import AcceptedUpdate

if TYPE_CHECKING:
    from fastapi import APIRouter

    from edgepfl.server.config import HttpLimits
    from edgepfl.server.engine import RoundEngine
    from edgepfl.server.store import Store


@dataclass(frozen=True)
class DeviceCalls:
    """What the engine core hands a mode for the device calls the mode takes itself (its routes, the in-process
    drivers' steps), and no more: the core's lock, the tick's wake-up, a round's record (404 for none) and the check
    that a device was sampled in a round (403 `not_sampled`, with the fix it is given)."""

    lock: threading.RLock
    wake: threading.Event
    round_or_404: Callable[[int], RoundRecord]
    check_sampled: Callable[[str, int, str], None]


class Close(ABC):
    """One close a mode's tick decided: which uploads the strategy aggregates, and what the commit carries."""

    def __init__(self, record: RoundRecord):
        self.record = record

    @abstractmethod
    def updates(self, global_base: Mapping[str, np.ndarray]) -> Iterator[AcceptedUpdate]:
        """The accepted updates the strategy aggregates, as it reads them."""

    def applied(self) -> list[tuple[int, str, int]]:
        """The (round, device, staleness) uploads this close applies from other rounds' buffer (none by default)."""
        return []

    def next_round(self, base_sha: str, now: float) -> RoundRecord | None:
        """The round the close opens in its own transaction (None: the next round opens when devices wait)."""
        return None

    @abstractmethod
    def done(self) -> None:
        """After the commit: forget what the closed round's uploads needed."""

    @abstractmethod
    def accepted(self) -> int:
        """How many updates the close aggregated (the log's count)."""


class RoundMode(ABC):
    """How one engine's rounds run (module docstring); made once per engine, after its strategy."""

    name: ClassVar[str]
    # a round closes for all its devices at once (they wait for one another); False: steps with no barrier
    barrier: ClassVar[bool] = True
    section: ClassVar[str | None] = None  # the key of the mode's section in /v1/status (None: it has none)

    def __init__(self, engine: RoundEngine, calls: DeviceCalls):
        self.engine = engine
        self.calls = calls

    def bind(self) -> None:
        """At start, once the strategy is bound (DP wrapped): wrap it further if the mode aggregates otherwise."""
        return None

    @classmethod
    def quorum(cls, clients: int, fraction: float, min_clients: int) -> int:
        """How many updates close a simulated round of `clients` devices that all answer (simulate, no clock)."""
        return min(min_clients, clients)

    @classmethod
    def foreign(cls, store: Store, current: RoundRecord | None, active: bool) -> str | None:
        """Why an open round found at start cannot go on (it opened under this mode and the server restarted without
        it, or the reverse; `active`: this mode runs now), or None. Called for every registered mode."""
        return None

    def retained(self, history: int) -> int:
        """The closed rounds whose tensors `--history N` keeps (0 keeps every round)."""
        return history

    @abstractmethod
    def open(self, now: float, available: list[str]) -> RoundRecord | None:
        """Open the next round if the `available` devices allow it (the core holds its lock); its record, or None."""

    @abstractmethod
    def task(self, device: str, current: RoundRecord, now: float) -> Task | None:
        """The train task a polling device gets in the open round `current`, or None (it waits)."""

    def check_upload(self, device: str, round_id: int) -> None:
        """Refuse an upload whatever its round (before its body is read); by default any may come."""
        return None

    @abstractmethod
    def check_open(self, record: RoundRecord) -> None:
        """Refuse an upload of a sampled device that its round `record` no longer takes."""

    @abstractmethod
    def receipt(self, round_id: int) -> dict[str, Any]:
        """What an accepted upload's receipt adds: the round's (or buffer's) fill."""

    @abstractmethod
    def tick(self, current: RoundRecord, now: float) -> Close | None:
        """Decide on the open round (the core holds its lock): a close, or None (it goes on, or was abandoned)."""

    def rejected(self, record: RoundRecord, fallback: str, now: float) -> RoundRecord | None:
        """A majority refused `record`'s base: the round that opens with the rollback's commit (None: none)."""
        return None

    def status(self, rounds: list[RoundRecord], names: bool) -> dict[str, Any]:
        """What /v1/status says of the mode: `{section: its JSON}` (none by default); the status view merges it over
        every registered mode's section as None."""
        return {}

    def annotate(self, rows: list[dict[str, Any]]) -> None:
        """Add the mode's columns to the status rows of every round (none by default)."""
        return None

    def waiting(
        self, record: RoundRecord, given: Sequence[str], refused: Sequence[str]
    ) -> tuple[str | None, list[str], float]:
        """The open round's step (None: uploads), the devices of `given` it waits for, and when it gives up."""
        uploaded = {update.device for update in self.engine.store.updates(record.round_id)}
        return None, [device for device in given if device not in uploaded], record.deadline

    def router(self, limits: HttpLimits) -> APIRouter | None:
        """HTTP routes of the mode's own, which the app includes (none by default)."""
        return None

    def seeded(self, seed: int) -> None:
        """An in-process run seeds the mode's own randomness too (none by default)."""
        return None
