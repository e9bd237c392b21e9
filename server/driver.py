"""What the round engine's in-process drivers use besides its calls (`engine.py`'s `RoundEngine`): the manual clock,
a device's plan, the global base of a state folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edgepfl.errors import StateError
from edgepfl.protocol import RoundSettings
from edgepfl.wire import decode_tensors

if TYPE_CHECKING:
    from edgepfl.server.store import Store


class ManualClock:
    """An in-process run's clock: it moves only when the driver moves it."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class DevicePlan:
    """What one sampled device is told in a round: its settings, its base and the bytes that carried it."""

    settings: RoundSettings
    base: dict[str, np.ndarray]
    nbytes: int


def global_base_of(store: Store) -> dict[str, np.ndarray]:
    """The global base a server state folder holds now."""
    sha = store.get_meta("global_base_sha")
    if sha is None:
        raise StateError(f"{store.folder} holds no global base", "use a new --out")
    return decode_tensors(store.blobs.read(sha))


def read_global_base(state: Path) -> dict[str, np.ndarray]:
    """The global base of the server state folder `state` ({} when there is no such folder)."""
    from edgepfl.server.store import Store

    if not Path(state).is_dir():
        return {}
    store = Store(state)
    try:
        return global_base_of(store)
    finally:
        store.close()
