"""Client algorithms of one round (fedsim, fedalt, local) over any `Engine`; the simulator calls the same code.

A round is a list of phases, each a trainable set (`full`, `personal`, `base`) and a number of epochs:
personal fine-tuning with the base frozen comes first when the settings ask for it (FedPer A.3),
then the algorithm's own phases. Which tensors are personal is the manifest's business, never ours.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from edgepfl.data import LocalData, num_batches
from edgepfl.device_runtime.engine import Engine
from edgepfl.device_runtime.evaluation import evaluate, score  # noqa: F401 (evaluate: re-exported)
from edgepfl.errors import EdgePFLError, UsageError
from edgepfl.manifest import Manifest, TensorSpec
from edgepfl.protocol import RoundSettings, UploadMeta
from edgepfl.wire import nonfinite_names

if TYPE_CHECKING:  # options.py imports persfl, which imports this module
    from edgepfl.device_runtime.options import TrainOptions

# progress(phase, steps done, steps in the round, loss of the last step)
Progress = Callable[[str, int, int, float], None]

# a mean cross-entropy above this many times ln(classes) (uniform guessing) means training blew up: a sane
# model never gets there, while the absurd magnitudes of a poisoned base or a huge lr do (finite or not)
DIVERGED_LOSS_FACTOR = 100.0


class TrainingDiverged(EdgePFLError):
    """A received base or a training result the device must not keep (NaN, Inf or an exploding loss)."""


@dataclass(frozen=True)
class Phase:
    """Epochs of one trainable set inside a round, at its learning rate."""

    name: str  # finetune | joint | personal | base
    trainable: str  # engine set: full | personal | base
    epochs: int
    lr: float


@dataclass(frozen=True)
class PhasePlan:
    """A phase as an algorithm declares it: its name, the set it trains, the settings field giving its epochs."""

    name: str
    trainable: str
    epochs_setting: str  # a RoundSettings field
    lr_setting: str = "lr"  # the RoundSettings field of its learning rate; where that is None, the shared `lr`

    def phase(self, settings: RoundSettings) -> Phase:
        """The phase these settings make of it."""
        lr = getattr(settings, self.lr_setting)
        return Phase(
            self.name, self.trainable, getattr(settings, self.epochs_setting), settings.lr if lr is None else lr
        )


# personal fine-tuning with the base frozen, before any algorithm's own phases (FedPer A.3)
FINETUNE = PhasePlan("finetune", "personal", "finetune_epochs")


class ClientAlgorithm:
    """What a device does with a round's settings; `name` is the CLI, protocol and result-file word."""

    name: str
    uploads: bool = True  # whether the round ends with the base sent to the server
    plan: tuple[PhasePlan, ...]  # the algorithm's phases, in order (fine-tuning is added by the round)

    def phases(self, settings: RoundSettings) -> list[Phase]:
        """The algorithm's phases for these settings."""
        return [step.phase(settings) for step in self.plan]


class FedSim(ClientAlgorithm):
    """FedPer's local update (Algorithm 1): base and personal trained jointly; K_P=0 is FedAvg's client."""

    name = "fedsim"
    plan = (PhasePlan("joint", "full", "epochs"),)


class FedAlt(ClientAlgorithm):
    """Pillutla et al.: personal first with the base frozen, then the base with the personal part frozen."""

    name = "fedalt"
    plan = (PhasePlan("personal", "personal", "personal_epochs", "personal_lr"), PhasePlan("base", "base", "epochs"))


class Local(ClientAlgorithm):
    """Personal training only; nothing leaves the device."""

    name = "local"
    uploads = False
    plan = (PhasePlan("personal", "personal", "epochs"),)


CLIENT_ALGORITHMS: dict[str, ClientAlgorithm] = {algo.name: algo for algo in (FedSim(), FedAlt(), Local())}


def client_algorithm(name: str) -> ClientAlgorithm:
    """The algorithm registered under a protocol name."""
    if name not in CLIENT_ALGORITHMS:
        raise UsageError(f"unknown client algorithm {name!r}", f"choose one of: {', '.join(CLIENT_ALGORITHMS)}")
    return CLIENT_ALGORITHMS[name]


def round_phases(settings: RoundSettings, available_sets: tuple[str, ...]) -> list[Phase]:
    """Fine-tuning then the algorithm's phases, without empty phases or sets the bundle lacks.

    K_P=0 has no personal set (fine-tuning and FedAlt's first phase vanish); a bundle without base
    tensors has no base set. `local` on a bundle without personal tensors has nothing to train: refused.
    """
    algorithm = client_algorithm(settings.algorithm)
    planned = [FINETUNE.phase(settings), *algorithm.phases(settings)]
    phases = [p for p in planned if p.epochs > 0 and p.trainable in available_sets]
    if algorithm.name == "local" and "personal" not in available_sets:
        raise UsageError(
            "the local algorithm trains personal tensors, and this bundle has none (kp=0)",
            "export with --kp 1 or more (or a --personal spec)",
        )
    return phases


def upload_specs(manifest: Manifest, settings: RoundSettings) -> list[TensorSpec]:
    """The tensors that travel between device and server this round: the shared ones but those kept on the device."""
    return settings.travelling(manifest.shared(settings.share_buffers))


def upload_tensors(engine: Engine, settings: RoundSettings) -> dict[str, np.ndarray]:
    """Current values of `upload_specs`: what a device uploads and what it receives."""
    return engine.get_tensors([spec.name for spec in upload_specs(engine.manifest, settings)])


@dataclass(frozen=True)
class PhaseLog:
    """How one phase went."""

    name: str
    trainable: str
    epochs: int
    steps: int
    mean_loss: float


@dataclass(frozen=True)
class ClientResult:
    """Outcome of one client round: the numbers an upload quotes and the device keeps."""

    round_id: int
    algorithm: str
    num_samples: int  # training samples
    train_loss: float  # mean batch loss over the round's last phase
    val_loss: float  # held-out loss after training (NaN without held-out data)
    val_accuracy: float
    val_samples: int
    start_val_loss: float  # held-out loss of the received base with this device's personal part
    start_val_accuracy: float
    uploads: bool
    seconds: float
    phases: tuple[PhaseLog, ...] = field(default_factory=tuple)

    def upload_meta(self, base_layout_hash: str) -> UploadMeta:
        """The metadata that travels with this round's upload."""
        return UploadMeta(
            base_layout_hash=base_layout_hash,
            num_samples=self.num_samples,
            train_loss=self.train_loss,
            val_accuracy=self.val_accuracy,
            val_loss=self.val_loss,
            start_val_accuracy=self.start_val_accuracy,
        )

    def to_json(self) -> dict[str, Any]:
        """JSON form (NaN written as null)."""
        data = asdict(self)
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in data.items()}


def run_client_round(
    engine: Engine,
    settings: RoundSettings,
    data: LocalData,
    seed: int,
    round_id: int,
    progress: Progress | None = None,
) -> ClientResult:
    """One client round on an engine that already holds the round's base: train, then evaluate on held-out data."""
    started = time.perf_counter()
    algorithm = client_algorithm(settings.algorithm)
    phases = round_phases(settings, engine.available_sets())
    before = score(engine, data)  # the held model of the device's previous round (evaluation.py)
    total = sum(p.epochs for p in phases) * num_batches(data.num_train, settings.batch_size)
    logs: list[PhaseLog] = []
    done = 0

    def step_done(phase_name: str, loss: float) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(phase_name, done, total, loss)

    epoch = 0
    for phase in phases:
        logs.append(train_phase(engine, data, phase, settings.batch_size, round_seed(seed, round_id), epoch, step_done))
        epoch += phase.epochs
    after = score(engine, data)  # the trained model
    return ClientResult(
        round_id=round_id,
        algorithm=algorithm.name,
        num_samples=data.num_train,
        train_loss=logs[-1].mean_loss if logs else math.nan,
        val_loss=after.loss if after.count else math.nan,
        val_accuracy=after.accuracy if after.count else math.nan,
        val_samples=after.count,
        start_val_loss=before.loss if before.count else math.nan,
        start_val_accuracy=before.accuracy if before.count else math.nan,
        uploads=algorithm.uploads,
        seconds=time.perf_counter() - started,
        phases=tuple(logs),
    )


def train_phase(
    engine: Engine,
    data: LocalData,
    phase: Phase,
    batch_size: int,
    seed: int,
    first_epoch: int = 0,
    on_step: Callable[[str, float], None] | None = None,
) -> PhaseLog:
    """`phase.epochs` epochs of SGD at `phase.lr` on one trainable set; epochs are numbered from `first_epoch` for
    shuffling."""
    engine.check_set(phase.trainable)
    losses: list[float] = []
    for epoch in range(first_epoch, first_epoch + phase.epochs):
        for x, y in data.train_batches(batch_size, seed, epoch):
            losses.append(engine.train_step(x, y, phase.lr, trainable=phase.trainable))
            if on_step is not None:
                on_step(phase.name, losses[-1])
    return PhaseLog(phase.name, phase.trainable, phase.epochs, len(losses), _mean(losses))


def divergence(losses: Iterable[float], tensors: Mapping[str, np.ndarray], num_classes: int) -> str | None:
    """Why a training result must not be kept (`loss NaN`, `loss 3.4e+33`, `NaN or Inf in 'w'`), or None."""
    limit = DIVERGED_LOSS_FACTOR * max(math.log(num_classes), 1.0)
    for loss in losses:
        if not math.isfinite(loss) or loss > limit:
            return "loss NaN" if math.isnan(loss) else f"loss {loss:.3g}"
    bad = nonfinite_names(tensors)
    return f"NaN or Inf in {bad[0]!r}" if bad else None


def train_locally(
    engine: Engine,
    data: LocalData,
    options: TrainOptions,
    seed: int,
    kept: str,
    on_step: Callable[[str, float], None] | None = None,
) -> dict[str, Any]:
    """`device train`: one phase of local training scored on the held-out data before and after; its record.

    TrainingDiverged (the device keeps `kept`, its saved state) when a loss explodes or a tensor is NaN/Inf; the
    engine then holds the diverged tensors, which the caller does not commit.
    """
    trainable, lr = options.trainable, options.lr
    before = evaluate(engine, data)
    log = train_phase(
        engine, data, Phase(trainable, trainable, options.epochs, lr), options.batch_size, seed, on_step=on_step
    )
    after = evaluate(engine, data)
    losses = ([log.mean_loss] if log.steps else []) + ([after.loss] if after.count else [])
    why = divergence(losses, engine.get_tensors(), engine.manifest.num_classes)
    if why is not None:
        raise TrainingDiverged(f"training diverged ({why}): kept {kept}", f"lower --lr, e.g. --lr {lr / 10:g}")
    return {
        "local_training": True,
        "trainable": trainable,
        "epochs": options.epochs,
        "lr": lr,
        "batch_size": options.batch_size,
        "steps": log.steps,
        "train_loss": log.mean_loss,
        "num_samples": data.num_train,
        "start_val_accuracy": before.accuracy if before.count else None,
        "val_accuracy": after.accuracy if after.count else None,
        "val_loss": after.loss if after.count else None,
        "val_samples": after.count,
        "engine": engine.name,
    }


def round_losses(result: ClientResult) -> list[float]:
    """The losses a round measured: each phase's mean training loss and the held-out loss after training."""
    measured = [log.mean_loss for log in result.phases if log.steps]
    return measured + ([result.val_loss] if result.val_samples else [])


def round_seed(seed: int, round_id: int) -> int:
    """The shuffling seed of one round: distinct per (device seed, round), identical on every engine."""
    return int(np.random.SeedSequence([seed, round_id]).generate_state(1)[0])


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else math.nan
