"""PersFL on the device: keep the best global model as the optimal teacher, then distil a personal student.

Stage 1 (during FedAvg, K_P = 0): every round, before local training, the device evaluates the
received global model on its validation split and keeps the one with the lowest validation loss so
far as its teacher (`TeacherStore`, inside the device's state folder). Stage 2 (local, no server):
the student starts from the teacher and trains on the distillation loss for every (λ, T) of a grid;
the student with the best validation accuracy is kept and its test accuracy reported (`distill`).
Both engines have `distill_step` and `logits`, for the full set and (K_P > 0) the personal set.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgepfl.atomic import sha256_file, write_bytes_atomic, write_text_atomic
from edgepfl.data import LocalData, iterate_batches
from edgepfl.device_runtime.algorithms import evaluate
from edgepfl.device_runtime.engine import DistillStep, Engine, EvalResult
from edgepfl.errors import DataError, StateError, UsageError
from edgepfl.kinds import SampleKind
from edgepfl.manifest import Manifest
from edgepfl.wire import WireError, check_tensors, decode_tensors, encode_tensors

TEACHER_FOLDER = "persfl"  # inside the device state folder; StateFolder removes loose tensor files it does not name
TEACHER_NAME = "teacher.json"
TEACHER_SCHEMA = 1
DEFAULT_LAMBDAS = (0.1, 0.3, 0.5, 0.7, 0.9)
DEFAULT_TEMPERATURES = (1.0, 2.0, 4.0, 8.0)
VARIANTS = ("kd", "gd")
DEFAULT_BATCH = 32  # PersFL (Hinton KD) and PersFL-GD (the paper's Eq. 7)


@dataclass(frozen=True)
class TeacherRecord:
    """The kept teacher: the round it came from, its validation scores and its tensors file."""

    round_id: int
    val_loss: float
    val_accuracy: float
    file: str  # name inside the state folder
    sha256: str


class TeacherStore:
    """The optimal teacher in a device state folder's `persfl/`; `teacher.json` is the single commit point.

    The tensors are written first under a new name, atomically, and only then does an atomic rewrite
    of the json name them; the previous teacher's file is removed afterwards. A crash at any moment
    leaves the previous teacher or the new one.
    """

    def __init__(self, state_dir: str | os.PathLike, manifest: Manifest):
        self.folder = Path(state_dir) / TEACHER_FOLDER
        self.manifest = manifest
        self._record = self._read()

    @property
    def record(self) -> TeacherRecord | None:
        """The kept teacher's record, or None before the first offer."""
        return self._record

    def offer(self, round_id: int, tensors: Mapping[str, np.ndarray], result: EvalResult) -> bool:
        """Keep `tensors` as the teacher when their validation loss is lower than the kept one's; True if kept."""
        if not math.isfinite(result.loss):
            return False
        if self._record is not None and result.loss >= self._record.val_loss:
            return False
        check_tensors(tensors, [self.manifest.tensor(n) for n in tensors], "teacher")
        name = f"teacher-r{round_id}.safetensors"
        write_bytes_atomic(self.folder / name, encode_tensors(tensors, {"round_id": str(round_id)}))
        record = TeacherRecord(
            round_id, float(result.loss), float(result.accuracy), name, sha256_file(self.folder / name)
        )
        document = {
            "schema_version": TEACHER_SCHEMA,
            "base_layout_hash": self.manifest.base_layout_hash,
            "teacher": asdict(record),
        }
        write_text_atomic(self.folder / TEACHER_NAME, json.dumps(document, indent=1))
        previous, self._record = self._record, record
        if previous is not None and previous.file != name:
            (self.folder / previous.file).unlink(missing_ok=True)
        return True

    def load(self) -> dict[str, np.ndarray]:
        """The kept teacher's tensors, checked against their sha256 and the manifest."""
        if self._record is None:
            raise StateError(
                f"{self.folder} holds no PersFL teacher",
                "take part in PersFL rounds first (stage 1 keeps the teacher), or pass the right --state",
            )
        path = self.folder / self._record.file
        if not path.is_file() or sha256_file(path) != self._record.sha256:
            raise StateError(f"the teacher file {path} is missing or damaged", "rerun stage 1 with this --state")
        try:
            tensors = decode_tensors(path.read_bytes())
        except WireError as error:
            raise StateError(f"the teacher file {path} cannot be read: {error.problem}", "rerun stage 1") from None
        check_tensors(tensors, [self.manifest.tensor(n) for n in tensors], str(path))
        return tensors

    def _read(self) -> TeacherRecord | None:
        path = self.folder / TEACHER_NAME
        if not path.is_file():
            return None
        try:
            document = json.loads(path.read_text())
            if document.get("schema_version") != TEACHER_SCHEMA:
                raise ValueError(f"schema {document.get('schema_version')}")
            record = TeacherRecord(**document["teacher"])
        except (ValueError, KeyError, TypeError) as error:
            raise StateError(f"{path} cannot be read ({error})", "remove it to choose the teacher anew") from None
        if document.get("base_layout_hash") != self.manifest.base_layout_hash:
            raise StateError(f"{path} belongs to another bundle", "use a fresh --state for this bundle")
        return record


def consider_global_model(
    engine: Engine,
    store: TeacherStore,
    round_id: int,
    global_tensors: Mapping[str, np.ndarray],
    data: LocalData,
) -> tuple[bool, EvalResult]:
    """Stage 1, before local training: load the received global model, score it on validation, offer it.

    Leaves the global model loaded in `engine` (local training starts from it); returns (kept, scores).
    The score is the round's own held-out evaluation (`algorithms.evaluate`), the round's start_val_loss.
    """
    engine.set_tensors(global_tensors)
    result = evaluate(engine, data)
    if not result.count:
        raise DataError("PersFL chooses its teacher on held-out data, and there is none", "pass --val-fraction > 0")
    kept = store.offer(round_id, engine.get_tensors(), result)
    return kept, result


def local_splits(data: LocalData, seed: int) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """Stage 2's (train, validation, test) arrays: the device's train split, its held-out split cut in halves."""
    if data.num_val < 2:
        raise DataError(
            f"stage 2 needs at least 2 held-out samples (validation and test), the data has {data.num_val}",
            "pass a larger --val-fraction or more data",
        )
    order = np.random.default_rng([seed, 7]).permutation(data.val_index)
    half = len(order) // 2
    parts = (data.train_index, np.sort(order[:half]), np.sort(order[half:]))
    return tuple((data.kind.normalize(data.images[i]), data.labels[i]) for i in parts)


@dataclass(frozen=True)
class DistillConfig:
    """Stage 2's settings: the (λ, T) grid, local epochs, SGD step size, batch, variant, trainable set."""

    lambdas: Sequence[float] = DEFAULT_LAMBDAS
    temperatures: Sequence[float] = DEFAULT_TEMPERATURES
    epochs: int = 5
    lr: float = 0.05
    batch_size: int | None = None  # None: the portable graphs' batch (32 for ort-training)
    variant: str = "kd"
    trainable: str = "full"
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.lambdas or any(not 0 <= lam <= 1 for lam in self.lambdas):
            raise UsageError(f"lambdas {list(self.lambdas)} must be values in [0, 1]", "use e.g. 0.1,0.3,0.5,0.7,0.9")
        if not self.temperatures or any(not t > 0 for t in self.temperatures):
            raise UsageError(f"temperatures {list(self.temperatures)} must be positive", "use e.g. 1,2,4,8")
        if self.variant not in VARIANTS:
            raise UsageError(f"unknown distillation variant {self.variant!r}", f"choose one of: {', '.join(VARIANTS)}")
        if self.epochs < 1 or not self.lr > 0:
            raise UsageError(f"epochs {self.epochs} and lr {self.lr} must be positive", "use e.g. --epochs 5 --lr 0.05")


@dataclass
class DistillResult:
    """Teacher and chosen student scores, and every grid point's validation scores."""

    teacher: dict[str, float]
    student: dict[str, float]
    grid: list[dict[str, float]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """JSON form (for results files and the CLI)."""
        return {"teacher": self.teacher, "student": self.student, "grid": self.grid}


def check_distillable(kind: SampleKind) -> None:
    """PersFL's teacher gives one row of logits a sample; a model taught a target at every position (a next-word
    model) is refused in one line."""
    if kind.target_shape:
        raise UsageError(
            f"PersFL distils one label a sample, and a {kind.described} model learns a target at every position",
            "train it with fedavg, fedalt, fedsim or local",
        )


def distill(
    engine: Engine,
    teacher_tensors: Mapping[str, np.ndarray],
    train: tuple[np.ndarray, np.ndarray],
    val: tuple[np.ndarray, np.ndarray],
    test: tuple[np.ndarray, np.ndarray] | None,
    config: DistillConfig,
    on_step: Callable[[float], None] | None = None,
) -> DistillResult:
    """Stage 2: for each (λ, T) train a student from the teacher; keep the best by validation accuracy.

    Ties go to the lower validation loss, then to the earlier grid point. The chosen student is
    left loaded in `engine`; its test accuracy is reported (and the teacher's, for comparison).
    `on_step(loss)` is called after every SGD step (for progress bars); `distill_steps` counts them.
    """
    check_distillable(engine.manifest.kind)
    if not (hasattr(engine, "distill_step") and hasattr(engine, "logits")):
        raise UsageError(f"the {engine.name} engine has no distillation step", "use --engine portable or ort-training")
    train_x, train_y = train
    batch_size = distill_batch_size(engine, config)
    engine.set_tensors(teacher_tensors)
    teacher_logits = engine.logits(train_x)
    teacher_scores = _scores(engine, val, test)
    best: tuple[tuple[float, float], dict[str, np.ndarray], dict[str, float]] | None = None
    grid = []
    for lam in config.lambdas:
        for temperature in config.temperatures:
            engine.set_tensors(teacher_tensors)
            for epoch in range(config.epochs):
                for index in iterate_batches(len(train_y), batch_size, config.seed, epoch):
                    step = DistillStep(
                        train_x[index],
                        train_y[index],
                        teacher_logits[index],
                        lr=config.lr,
                        temperature=float(temperature),
                        lam=float(lam),
                        variant=config.variant,
                        trainable=config.trainable,
                    )
                    loss = engine.distill_step(step)
                    if on_step is not None:
                        on_step(loss)
            scores = engine.eval_batch(*val)
            point = {"lambda": float(lam), "T": float(temperature), "val_accuracy": scores.accuracy}
            point["val_loss"] = scores.loss
            grid.append(point)
            key = (scores.accuracy, -scores.loss)
            if best is None or key > best[0]:
                best = (key, engine.get_tensors(), point)
    _, student_tensors, point = best
    engine.set_tensors(student_tensors)
    student = {"lambda": point["lambda"], "T": point["T"], **_scores(engine, val, test)}
    return DistillResult(teacher=teacher_scores, student=student, grid=grid)


def distill_batch_size(engine: Engine, config: DistillConfig) -> int:
    """The batch stage 2 trains with: the configured one, else the engine's graph batch, else 32."""
    return config.batch_size or getattr(engine, "batch_size", DEFAULT_BATCH)


def distill_steps(num_train: int, batch_size: int, config: DistillConfig) -> int:
    """How many SGD steps `distill` takes."""
    return len(config.lambdas) * len(config.temperatures) * config.epochs * -(-num_train // batch_size)


def _scores(engine: Engine, val: tuple[np.ndarray, np.ndarray], test: tuple | None) -> dict[str, float]:
    scores = engine.eval_batch(*val)
    out = {"val_accuracy": scores.accuracy, "val_loss": scores.loss}
    if test is not None:
        test_scores = engine.eval_batch(*test)
        out.update(test_accuracy=test_scores.accuracy, test_loss=test_scores.loss)
    return out
