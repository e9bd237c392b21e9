"""The round modes' registry: a mode is one module here (secure aggregation's: its package, `server/secure/`) plus one
line in `MODES` (docs/architecture.md).

`mode_name` reads which mode a server's configuration runs: secure aggregation wraps the synchronous rounds,
`--aggregation` chooses between those and FedBuff's steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgepfl.server.modes.base import Close, DeviceCalls, RoundMode
from edgepfl.server.modes.fedbuff import FedBuffMode
from edgepfl.server.modes.sync import SyncMode
from edgepfl.server.secure.mode import SecureMode

if TYPE_CHECKING:
    from edgepfl.server.config import ServerConfig
    from edgepfl.server.engine import RoundEngine

MODES: dict[str, type[RoundMode]] = {mode.name: mode for mode in (SyncMode, FedBuffMode, SecureMode)}

__all__ = ["MODES", "Close", "DeviceCalls", "RoundMode", "make_mode", "mode_name"]


def mode_name(config: ServerConfig) -> str:
    """The registered mode a configuration runs."""
    return SecureMode.name if config.secure.secure_aggregation else config.fleet_rounds.aggregation


def make_mode(engine: RoundEngine, calls: DeviceCalls) -> RoundMode:
    """The mode `engine`'s configuration runs, made for it (`calls`: what the core lends the mode's device calls)."""
    return MODES[mode_name(engine.config)](engine, calls)
