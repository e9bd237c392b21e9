"""The round engine of `edgepfl serve`, driven by in-process devices: what `edgepfl simulate` aggregates through.

Simulated clients are enrolled devices of a real `RoundEngine` over `OUT/server` (the same SQLite store and
blobs as a served run), on a clock that moves one second per round. Each round every client polls
`task()` (so, as in a served run where every enrolled device polls, the round opens once all of them are
available), the engine samples and plans it, each sampled client fetches its base with `base_for()`, trains,
and hands `accept_update()` the bytes a device would upload; `tick()` then closes the round. Sampling,
planning, acceptance checks, aggregation and durable state are therefore the served ones, minus HTTP.

The Flower strategy (`edgepfl/flower/strategy.py`) drives the same engine the same way; its devices are
Flower nodes, and a round whose replies do not all arrive or pass closes at its deadline (`close_round`).

The `local` algorithm aggregates nothing, so it has no engine: it samples with the same rule and trains.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgepfl.encoding import decode_download
from edgepfl.errors import StateError
from edgepfl.protocol import RoundSettings
from edgepfl.wire import decode_tensors, save_tensors

if TYPE_CHECKING:
    from edgepfl.server.config import PrivacyOptions
    from edgepfl.server.engine import RoundEngine
    from edgepfl.server.store import Store
    from edgepfl.server.strategy import Strategy

SERVER_DIR = "server"  # the engine's state folder inside the run folder
INITIAL_FILE = "initial.safetensors"  # the simulation engine's initial tensors: the engine's round-1 base
HISTORY = 2  # closed rounds whose tensors the engine keeps: a resumed run needs only the last one


class SimClock:
    """The engine's clock: constant within a round, one second further at each round's start."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class Assignment:
    """What one sampled client is told in a round: its settings, its base and the bytes that carried it."""

    settings: RoundSettings
    base: dict[str, np.ndarray]
    nbytes: int


class InProcessServer:
    """`edgepfl serve`'s engine for one simulated run (None engine: `local`, nothing is aggregated)."""

    def __init__(
        self, engine: RoundEngine | None, settings: RoundSettings, seed: int, fraction: float, min_clients: int
    ):
        self.engine = engine
        self.settings = settings
        self.seed, self.fraction, self.min_clients = seed, fraction, min_clients
        self.clock: SimClock = engine.clock if engine is not None else SimClock()

    @property
    def strategy(self) -> Strategy | None:
        """The engine's strategy (None for `local`)."""
        return self.engine.strategy if self.engine is not None else None

    def open_round(self, round_id: int, names: list[str]) -> dict[str, Assignment] | None:
        """Every client polls; the round opens; each sampled client gets its settings and base (in sampled order).

        None when the engine stops the run instead (--dp-target-epsilon: one more round would exceed it).
        """
        self.clock.now = max(float(round_id), self.clock.now + 1.0)  # one second a round, never back past a deadline
        if self.engine is None:
            from edgepfl.server.sampling import sample_devices

            sampled = sample_devices(self.seed, round_id, names, self.fraction, self.min_clients)
            return {name: Assignment(self.settings, {}, 0) for name in sampled}
        for name in names:  # availability: the last poll finds every enrolled device available and opens the round
            self.engine.task(name)
        current = self.engine.store.open_round()
        if current is None and self.engine.stopped is not None:
            return None
        if current is None or current.round_id != round_id:
            found = "none" if current is None else str(current.round_id)
            raise StateError(
                f"the simulated server opened round {found} where round {round_id} was due",
                "the run folder's server state does not match its results: use a new --out",
            )
        if self.engine.store.updates(round_id, status=None):  # left by an interrupted run: every client trains again
            self.engine.withdraw_uploads(round_id)  # and a GPU's (or any nondeterministic) training sends new bytes
        plans = {}
        for name in current.sampled:
            payload, _ = self.engine.base_for(name, round_id)
            settings = self.engine.settings_for(name, round_id)
            plans[name] = Assignment(settings, decode_download(payload, settings.download_encoding), len(payload))
        return plans

    @property
    def stopped(self) -> str | None:
        """Why the engine ended the run before --rounds (the DP budget), or None."""
        return self.engine.stopped if self.engine is not None else None

    def epsilon(self, round_id: int) -> float | None:
        """DP: the epsilon spent through a closed round (None without DP)."""
        record = self.engine.store.round(round_id) if self.engine is not None else None
        return record.epsilon if record is not None else None

    def upload(self, name: str, round_id: int, payload: bytes) -> None:
        """Hand the engine a client's update bytes, as `POST /v1/rounds/N/update` would."""
        if self.engine is not None:
            self.engine.accept_update(name, round_id, payload)

    def close_round(self, round_id: int, at_deadline: bool = False) -> dict[str, np.ndarray]:
        """Aggregate the round (every sampled client has uploaded, or it is `at_deadline`); returns the new global base.

        At its deadline the round closes with the uploads accepted so far if they are at least `min_clients`,
        and is abandoned (StateError here) otherwise, exactly as a served round.
        """
        if self.engine is None:
            return {}
        record = self.engine.store.round(round_id)
        if at_deadline and record is not None:
            self.clock.now = max(self.clock.now, record.deadline)
        self.engine.tick()
        record = self.engine.store.round(round_id)
        if record is None or record.state != "closed":
            state = "missing" if record is None else f"{record.state} ({record.note})"
            raise StateError(f"simulated round {round_id} did not close: {state}", "see the log above; use a new --out")
        return self.global_base()

    def global_base(self) -> dict[str, np.ndarray]:
        """The engine's current global base (the last closed round's result, or the initial base)."""
        if self.engine is None:
            return {}
        return global_base_of(self.engine.store)

    def evaluation_base(self, name: str, global_base: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """The base a client is evaluated with after a round (the strategy's view; it changes nothing)."""
        if self.engine is None:
            return global_base
        return self.engine.strategy.evaluation_base(name, global_base)

    def closed_rounds(self) -> int:
        """How many rounds the engine has closed."""
        return self.engine.store.count_closed() if self.engine is not None else 0

    def tick(self) -> None:
        """Close a round whose uploads all arrived before an interruption."""
        if self.engine is not None:
            self.engine.tick()

    def close(self) -> None:
        """Close the engine's store."""
        if self.engine is not None:
            self.engine.store.close()


def open_server(
    out: Path,
    strategy: str | None,
    names: list[str],
    settings: RoundSettings,
    initial: Mapping[str, np.ndarray],
    *,
    rounds: int,
    seed: int,
    fraction: float,
    min_clients: int,
    fresh: bool,
    knobs: Mapping[str, Any] | None = None,
    bundle: Path | None = None,
    round_timeout: float | None = None,
    privacy: PrivacyOptions | None = None,
) -> InProcessServer:
    """The run's engine over OUT/server (made on a fresh run), every client enrolled as a device.

    `knobs`: the strategy's own options (e.g. hn_lr, retain_top_k, trim_fraction); `bundle` defaults to
    OUT/bundle; `round_timeout` (seconds to a round's deadline) to `edgepfl serve`'s.
    """
    if strategy is None:
        return InProcessServer(None, settings, seed, fraction, min_clients)
    import shutil

    from edgepfl.server.config import PrivacyOptions, ServerConfig, StrategyOptions
    from edgepfl.server.engine import create_engine
    from edgepfl.server.store import Store
    from edgepfl.server.tokens import issue_token

    folder = out / SERVER_DIR
    if fresh:
        shutil.rmtree(folder, ignore_errors=True)
        save_tensors(out / INITIAL_FILE, dict(initial))
    elif not folder.is_dir():
        raise StateError(
            f"{out} was made by an older edgepfl simulate (it has no {SERVER_DIR}/ round engine state)",
            "rerun into a new --out",
        )
    options = StrategyOptions(settings=settings, clients=len(names), seed=seed, **(knobs or {}))
    timeout = {} if round_timeout is None else {"round_timeout": round_timeout}
    config = ServerConfig(
        bundle=bundle or out / "bundle",
        state=folder,
        strategy=strategy,
        rounds=rounds,
        min_clients=min(min_clients, len(names)),
        fraction=fraction,
        seed=seed,
        init=out / INITIAL_FILE,
        history=HISTORY,
        strategy_options=options,
        **timeout,
        privacy=privacy or PrivacyOptions(),
        web=False,
    )
    clock = SimClock()
    store = Store(folder)
    try:
        enrolled = {device.name for device in store.devices()}
        for name in names:
            if name not in enrolled:  # a simulated device never presents its token: the engine is called directly
                issue_token(store, name, clock())
    finally:
        store.close()
    engine = create_engine(config, clock)
    engine.noise_seed = seed  # a simulation is reproducible: its DP noise is drawn from --seed (serve: OS entropy)
    return InProcessServer(engine, settings, seed, fraction, min_clients)


def global_base_of(store: Store) -> dict[str, np.ndarray]:
    """The global base a server state folder holds now."""
    sha = store.get_meta("global_base_sha")
    if sha is None:
        raise StateError(f"{store.folder} holds no global base", "use a new --out")
    return decode_tensors(store.read_blob(sha))


def final_global_base(out: str | Path) -> dict[str, np.ndarray]:
    """The global base a simulated run folder ends with (its engine's), or {} for `local`."""
    from edgepfl.server.store import Store

    folder = Path(out) / SERVER_DIR
    if not folder.is_dir():
        return {}
    store = Store(folder)
    try:
        return global_base_of(store)
    finally:
        store.close()

