"""The round engine of `edgepfl serve`, driven in-process: what `edgepfl simulate` aggregates through.

Simulated clients are enrolled devices of a real `RoundEngine` over `OUT/server` (the same SQLite store and
blobs as a served run), driven through the engine's in-process API (`edgepfl.server.driver`): sampling,
planning, acceptance checks, aggregation and durable state are the served ones, minus HTTP.

The Flower strategy (`edgepfl/flower/strategy.py`) drives the same engine the same way; its devices are
Flower nodes, and a round whose replies do not all arrive or pass closes at its deadline.

The `local` algorithm aggregates nothing, so it has no engine: `LocalRounds` samples with the same rule.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgepfl.errors import StateError
from edgepfl.protocol import RoundOptions
from edgepfl.wire import save_tensors

if TYPE_CHECKING:
    from edgepfl.server.driver import DevicePlan
    from edgepfl.server.engine import RoundEngine

SERVER_DIR = "server"  # the engine's state folder inside the run folder
INITIAL_FILE = "initial.safetensors"  # the simulation engine's initial tensors: the engine's round-1 base
HISTORY = 2  # closed rounds whose tensors the engine keeps: a resumed run needs only the last one


class LocalRounds:
    """`local`: no engine, nothing aggregated; each round samples with the served rule and hands out the settings."""

    strategy = None
    stopped = None
    secure = None  # no round mode, so no secure rounds

    def __init__(self, options: RoundOptions, seed: int, fraction: float, min_clients: int):
        self.settings = options.settings()
        self.seed, self.fraction, self.min_clients = seed, fraction, min_clients

    def open_round(self, round_id: int, names: list[str]) -> dict[str, DevicePlan]:
        """The sampled clients, each told the round's settings (and given no base)."""
        from edgepfl.server.driver import DevicePlan
        from edgepfl.server.sampling import sample_devices

        sampled = sample_devices(self.seed, round_id, names, self.fraction, self.min_clients)
        return {name: DevicePlan(self.settings, {}, 0) for name in sampled}

    def accept_update(self, name: str, round_id: int, payload: bytes) -> None:
        """Nothing is uploaded in a local run."""
        raise StateError("a local run uploads nothing", "this is a bug: report it")

    def accept_refusal(self, name: str, round_id: int, reason: str) -> None:
        """No server to tell: a local client just keeps its model."""

    def close_round(self, round_id: int, at_deadline: bool = False) -> dict[str, np.ndarray]:
        """Nothing to aggregate."""
        return {}

    def global_base(self) -> dict[str, np.ndarray]:
        """There is no global base."""
        return {}

    def round(self, round_id: int) -> None:
        """A local run keeps no rounds."""
        return None

    def evaluation_base(self, name: str, global_base: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """A client keeps everything it trained."""
        return global_base

    def closed_rounds(self) -> int:
        """Nothing is ever aggregated."""
        return 0

    def epsilon(self, round_id: int) -> float | None:
        """No DP."""
        return None

    def tick(self) -> None:
        """Nothing to close."""

    def close(self) -> None:
        """Nothing to release."""


def open_server(
    out: Path, names: list[str], initial: Mapping[str, np.ndarray], server: Mapping[str, Any], *, fresh: bool
) -> RoundEngine | LocalRounds:
    """The run's engine over OUT/server (made on a fresh run), every client enrolled as a device.

    `server`: the engine's `ServerConfig` fields, as a run's config holds them (`ServerConfig.shared_fields`);
    its `strategy` is a strategy's options model (None: `local`, no engine), whose fixed cohort (pfedla's number
    of clients) is the run's. `bundle` defaults to OUT/bundle; the state folder, initial tensors and history
    are the simulation's own.
    """
    chosen = server["strategy"]
    if chosen is None:
        return LocalRounds(server["round"], server["seed"], server["fraction"], server["min_clients"])
    import shutil

    from edgepfl.server.config import ServerConfig
    from edgepfl.server.driver import ManualClock
    from edgepfl.server.engine import create_engine
    from edgepfl.server.modes import MODES, mode_name
    from edgepfl.server.strategies import cohort_of, strategy_options

    folder = out / SERVER_DIR
    if fresh:
        shutil.rmtree(folder, ignore_errors=True)
        save_tensors(out / INITIAL_FILE, dict(initial))
    elif not folder.is_dir():
        raise StateError(
            f"{out} was made by an older edgepfl simulate (it has no {SERVER_DIR}/ round engine state)",
            "rerun into a new --out",
        )
    name = str(chosen.name)
    strategy = strategy_options(name, **{**chosen.model_dump(exclude={"name"}), **cohort_of(name, len(names))})
    # every client answers (no --fleet here): the round's mode says how many updates close a round
    mode = MODES[mode_name(ServerConfig.model_construct(**server))]
    quorum = mode.quorum(len(names), server["fraction"], server["min_clients"])
    config = ServerConfig(
        **{
            **server,
            "bundle": server.get("bundle") or out / "bundle",
            "state": folder,
            "strategy": strategy,
            "min_clients": quorum,
            "init": out / INITIAL_FILE,
            "history": HISTORY,
            "web": False,
        }
    )
    engine = create_engine(config, ManualClock())
    engine.enroll_devices(names)
    engine.noise_seed = config.seed  # a simulation is reproducible: DP noise is drawn from --seed (serve: OS entropy)
    engine.mode.seeded(config.seed)  # ... and its mode's (a secure round's graph randomness)
    return engine


def final_global_base(out: str | Path) -> dict[str, np.ndarray]:
    """The global base a simulated run folder ends with (its engine's), or {} for `local`."""
    from edgepfl.server.driver import read_global_base

    return read_global_base(Path(out) / SERVER_DIR)
