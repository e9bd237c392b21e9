"""Where a round's clients train: in the driver one after another (`--workers 1`), or in Ray actors.

A client's round is one function, `train_client`, whichever runs it: the device's own round
(`device_runtime.round.train_round`: PersFL's teacher offer, local training, a diverged result refused, the
encoded upload), committed to the client's memory, then the *trained* score.
With `--workers N` (or `--ray-address`) each of N Ray actors opens its own engine once, with the run's
`--threads`, and holds every client's data (put in Ray's object store once a run); a round's jobs go to
whichever actor is free, and the outcomes come back in plan order, so the driver uploads them to the round
engine in exactly the order of a `--workers 1` run: the results are bit-identical.

The driver keeps every client's tensors (a job carries them out and back), so a resumed run does not depend
on which actor trained whom. PersFL's teacher stores are folders under the run's `--out`: the actors read and
write them there, so on a multi-machine Ray cluster `--out` must be on storage every node sees.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgepfl.data import LocalData
from edgepfl.device_runtime.engine import Engine
from edgepfl.device_runtime.evaluation import score
from edgepfl.device_runtime.options import DeviceOptions
from edgepfl.device_runtime.round import RoundRefused, train_round
from edgepfl.device_runtime.runner import DeviceEvents
from edgepfl.errors import StateError, UsageError
from edgepfl.manifest import Manifest
from edgepfl.server.driver import DevicePlan as Assignment


@dataclass
class ClientData:
    """What a worker needs of a client besides its tensors: its splits, its seed and its residuals folder."""

    name: str
    train: LocalData
    test: LocalData
    seed: int
    residuals: Path  # error-feedback residuals of its encoded uploads (under the run's --out, like a device's state)


@dataclass
class Outcome:
    """One client's round, as the driver applies it."""

    tensors: dict[str, np.ndarray]
    train_loss: float
    trained_accuracy: float
    payload: bytes | None  # the encoded upload; None when the client's algorithm uploads nothing
    start_val_loss: float | None  # persfl: the received global model's validation loss
    refused: str | None = None  # why the client refused the round (its base, or training diverged from it)


@dataclass
class ClientState:
    """Where a simulated client's round is committed: its tensors in memory (the driver keeps them), its residuals
    and PersFL's teacher in folders under the run's --out, as a device keeps them in its state folder."""

    folder: Path  # the teacher lives in FOLDER/persfl
    residuals: Path
    tensors: dict[str, np.ndarray] | None = None

    @property
    def kept(self) -> str:
        """What a refused round leaves in place."""
        return "the model it held"

    def commit(
        self, tensors: dict[str, Any], record: dict[str, Any], round_id: int | None = None, upload_payload=None
    ) -> None:
        """Keep the trained tensors (the upload's bytes travel back in the Outcome)."""
        self.tensors = tensors


def train_client(
    engine: Engine,
    manifest: Manifest,
    client: ClientData,
    tensors: dict[str, np.ndarray],
    plan: Assignment,
    round_id: int,
    teachers: Path | None,
) -> Outcome:
    """One client's round on `engine`, exactly as a device runs it (teachers: persfl's store folder, or None).

    A round the device refuses (a diverged result) leaves the client's model as it was and uploads nothing.
    """
    engine.set_tensors(tensors)
    state = ClientState(teachers / client.name if teachers is not None else client.residuals, client.residuals)
    options = DeviceOptions(seed=client.seed, persfl_teacher=teachers is not None)
    try:
        outcome = train_round(engine, client.train, state, round_id, plan.settings, plan.base, options, DeviceEvents())
    except RoundRefused as refused:  # the teacher offer (PersFL) was made before training diverged
        accuracy = score(engine, client.test).accuracy
        return Outcome(engine.get_tensors(), math.nan, accuracy, None, refused.teacher_loss, refused.problem)
    assert state.tensors is not None, "a committed round keeps its tensors"
    trained_accuracy = score(engine, client.test).accuracy
    return Outcome(state.tensors, outcome.result.train_loss, trained_accuracy, outcome.payload, outcome.teacher_loss)


class Sequential:
    """`--workers 1`: every client on the driver's own engine, one after another."""

    def __init__(self, engine: Engine, manifest: Manifest, clients: list[ClientData], teachers: Path | None):
        self.engine, self.manifest, self.teachers = engine, manifest, teachers
        self.clients = {client.name: client for client in clients}

    def run(
        self, round_id: int, plans: dict[str, Assignment], tensors: dict[str, dict[str, np.ndarray]]
    ) -> Iterator[tuple[str, Outcome]]:
        """Each sampled client's outcome, in plan order."""
        for name, plan in plans.items():
            yield (
                name,
                train_client(
                    self.engine, self.manifest, self.clients[name], tensors[name], plan, round_id, self.teachers
                ),
            )

    def close(self) -> None:
        """Nothing to release: the engine belongs to the driver."""


class _Actor:
    """A Ray actor: its own engine, opened once, and every client's data."""

    def __init__(self, open_engine: Callable[[], Engine], manifest: Manifest, clients: list[ClientData], teachers):
        self.engine = open_engine()
        self.manifest, self.teachers = manifest, teachers
        self.clients = {client.name: client for client in clients}

    def train(self, name: str, tensors: dict, plan: Assignment, round_id: int) -> Outcome:
        return train_client(self.engine, self.manifest, self.clients[name], tensors, plan, round_id, self.teachers)

    def peak_rss(self) -> int:
        """This worker process's peak resident memory in bytes (bench/simulate.py reads it)."""
        return peak_rss()


class RayWorkers:
    """`--workers N` / `--ray-address`: N Ray actors, each with its own engine, fed a round's jobs as they free up."""

    def __init__(
        self,
        open_engine: Callable[[], Engine],
        manifest: Manifest,
        clients: list[ClientData],
        teachers: Path | None,
        workers: int,
        address: str | None,
        cpus: float,
        gpus: float,
    ):
        ray = import_ray()
        self._started = not ray.is_initialized()
        if self._started:
            try:
                if address:
                    ray.init(address=address, log_to_driver=False, logging_level="ERROR")
                else:
                    ray.init(
                        num_cpus=math.ceil(workers * cpus),
                        include_dashboard=False,
                        log_to_driver=False,
                        logging_level="ERROR",
                    )
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise UsageError(
                    f"cannot start or reach Ray{f' at {address}' if address else ''} ({exc})",
                    "check --ray-address (ray status on the head node prints it), or leave it out for a local Ray",
                ) from None
        available = ray.cluster_resources()
        if gpus > 0 and available.get("GPU", 0) < gpus:
            self.close()
            raise UsageError(
                f"--client-gpus {gpus:g} asks for GPUs and the Ray cluster has {available.get('GPU', 0):g}",
                "leave --client-gpus out, or join a cluster with GPUs (--ray-address)",
            )
        shared = ray.put(clients)  # once a run: the actors read the arrays from the object store
        actor = ray.remote(num_cpus=cpus, num_gpus=gpus)(_Actor)
        self.actors = [actor.remote(open_engine, manifest, shared, teachers) for _ in range(workers)]
        self._ray = ray
        try:  # engines open and data arrive before the first round: its time is the round's, not the start-up's
            ray.get([actor.peak_rss.remote() for actor in self.actors])
        except ray.exceptions.RayError as exc:
            self.close()
            raise StateError(
                f"a Ray worker could not start ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})",
                "check that every Ray node has edgepfl installed (pip install 'edgepfl[ray]') and sees --out",
            ) from None

    def run(
        self, round_id: int, plans: dict[str, Assignment], tensors: dict[str, dict[str, np.ndarray]]
    ) -> Iterator[tuple[str, Outcome]]:
        """Each sampled client's outcome, in plan order (jobs go to whichever actor is free)."""
        from ray.util import ActorPool

        pool = ActorPool(self.actors)
        names = list(plans)
        outcomes = pool.map(lambda actor, name: actor.train.remote(name, tensors[name], plans[name], round_id), names)
        try:
            yield from zip(names, outcomes)
        except self._ray.exceptions.RayError as exc:
            raise StateError(
                f"a Ray worker failed in round {round_id} ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})",
                "run the same command again: the run resumes at this round",
            ) from None

    def peak_rss(self) -> list[int]:
        """Every worker's peak resident memory in bytes."""
        return self._ray.get([actor.peak_rss.remote() for actor in self.actors])

    def close(self) -> None:
        """Stop the actors, and Ray itself when this run started it."""
        for actor in getattr(self, "actors", []):
            self._ray.kill(actor)
        self.actors = []
        if self._started:
            import_ray().shutdown()


def import_ray() -> Any:
    """The `ray` module, or one line saying how to install it."""
    try:
        import ray
    except ImportError:
        raise UsageError("--workers > 1 and --ray-address need Ray", "pip install 'edgepfl[ray]'") from None
    return ray


def peak_rss() -> int:
    """This process's peak resident memory in bytes (Linux and macOS report it in different units)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
