"""The small interface both on-device training engines implement, and how a bundle picks one."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgepfl.errors import BundleError, DataError, UsageError
from edgepfl.manifest import Manifest, load_manifest
from edgepfl.ortbuild import training_build_installed

ENGINE_NAMES = ("ort-training", "portable")


@dataclass(frozen=True)
class EvalResult:
    """Summed loss and correct count over the evaluated samples."""

    loss_sum: float
    correct: int
    count: int

    @property
    def loss(self) -> float:
        """Mean cross-entropy per sample."""
        return self.loss_sum / max(self.count, 1)

    @property
    def accuracy(self) -> float:
        """Fraction of samples classified correctly."""
        return self.correct / max(self.count, 1)


class Engine(ABC):
    """Runs a bundle's training and evaluation graphs on numpy batches.

    Tensors are addressed by their manifest names; `trainable` picks which set a step updates:
    "full" (base and personal), "personal" (base frozen) or "base" (personal frozen).
    """

    name: str

    def __init__(self, bundle_dir: str | os.PathLike, manifest: Manifest):
        self.bundle_dir = Path(bundle_dir)
        self.manifest = manifest

    @abstractmethod
    def get_tensors(self, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """Copies of the named tensors (all params and buffers when `names` is None)."""

    @abstractmethod
    def set_tensors(self, tensors: Mapping[str, np.ndarray]) -> None:
        """Overwrite the named tensors (e.g. a new base from the server, saved personal state)."""

    @abstractmethod
    def train_step(self, x: np.ndarray, y: np.ndarray, lr: float, trainable: str = "full") -> float:
        """One SGD step on a batch; returns the batch's mean loss before the update."""

    @abstractmethod
    def eval_batch(self, x: np.ndarray, y: np.ndarray) -> EvalResult:
        """Loss and correct count of the current model on a batch (inference mode)."""

    @abstractmethod
    def distill_step(self, step: DistillStep) -> float:
        """One SGD step on PersFL's distillation loss (variant kd or gd); returns the batch's loss before it."""

    @abstractmethod
    def logits(self, x: np.ndarray) -> np.ndarray:
        """The current model's inference-mode logits, (n, classes) float32, for inputs of any count."""

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Class probabilities (n, classes) float32 of the current model on model input `x` (normalised as
        its kind normalises it): the softmax of `logits`, in inference mode."""
        return softmax(self.logits(x))

    def statistics_momenta(self) -> dict[str, float]:
        """Each BatchNorm running statistic's momentum, by tensor name (empty for a model without BatchNorm)."""
        names = self.manifest.batchnorm_statistics()
        momentum = self.manifest.engines.get(self.name, {}).get("bn_momentum", 0.1)
        if isinstance(momentum, dict):  # layers with different momenta (portable graphs only)
            return {name: float(momentum[name]) for name in names}
        if isinstance(momentum, list):
            raise BundleError(
                "the bundle lists its BatchNorm momenta without their layers (an older export)",
                "re-export the bundle with this edgepfl version",
            )
        return dict.fromkeys(names, float(momentum))

    def statistics_step(self, x: np.ndarray, y: np.ndarray) -> None:
        """A training-mode forward pass that moves the BatchNorm running statistics and no weight.

        This default runs a step with learning rate 0 on `statistics_set`; the caller restores the weights anyway
        (0 times a non-finite gradient is not 0). Engines with a cheaper forward override it.
        """
        self.train_step(x, y, 0.0, trainable=self.statistics_set())

    def statistics_set(self) -> str:
        """The cheapest trainable set whose step runs the whole forward: personal where there is one."""
        sets = self.available_sets()
        return "personal" if "personal" in sets else sets[0]

    def tensors_by_role(self, role: str) -> dict[str, np.ndarray]:
        """Copies of every tensor of one manifest role: base, personal or buffer."""
        return self.get_tensors(self.manifest.names(role))

    def available_sets(self) -> tuple[str, ...]:
        """Trainable sets this bundle has (K_P=0 has no personal set, K_P=max no base set)."""
        return tuple(self.manifest.trainable_sets())

    def check_set(self, trainable: str) -> None:
        """A clear error for a set the bundle cannot train."""
        if trainable not in self.available_sets():
            raise UsageError(
                f"this bundle (personal {self.manifest.personal_spec}) has no {trainable!r} trainable set",
                f"choose one of: {', '.join(self.available_sets())}",
            )


def model_input(manifest: Manifest, x: np.ndarray) -> np.ndarray:
    """A batch as the model's graphs take it: the manifest's input dtype (float32 images and sensor windows, int64
    token ids), contiguous."""
    return np.ascontiguousarray(x, dtype=np.dtype(manifest.input.dtype))


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax of (n, classes) logits, computed in float64 and returned as float32."""
    shifted = np.asarray(logits, dtype=np.float64)
    shifted = shifted - shifted.max(axis=1, keepdims=True)
    exponentials = np.exp(shifted)
    return (exponentials / exponentials.sum(axis=1, keepdims=True)).astype(np.float32)


def check_distill_set(
    engine: str, sets_by_variant: Mapping[str, Collection[str]], variant: str, trainable: str, fix: str
) -> None:
    """A clear error when the bundle has no distillation step of `variant` for the `trainable` set (both engines)."""
    if variant not in sets_by_variant or trainable not in sets_by_variant[variant]:
        available = [f"{v}/{s}" for v, sets in sets_by_variant.items() for s in sets]
        raise BundleError(
            f"the bundle has no {engine} {variant!r} distillation step for the {trainable!r} set",
            f"{fix} (it has: {', '.join(available) or 'none'})",
        )


@dataclass(frozen=True, eq=False)
class DistillStep:
    """One step of PersFL's distillation (stage 2): a batch, the teacher's logits for it, the SGD step size, the
    temperature T and weight λ of the loss, its variant (kd or gd) and the trainable set."""

    x: np.ndarray
    y: np.ndarray
    teacher_logits: np.ndarray
    lr: float
    temperature: float
    lam: float
    variant: str = "kd"
    trainable: str = "full"

    def checked(self, manifest: Manifest) -> DistillStep:
        """The step, its loss settings and teacher logits checked against the model; one-line errors otherwise."""
        if not self.temperature > 0:
            raise UsageError(f"distillation temperature {self.temperature} must be positive", "use T >= 1, e.g. 2")
        if not 0 <= self.lam <= 1:
            raise UsageError(f"distillation weight lambda {self.lam} must lie in [0, 1]", "use e.g. 0.5")
        teacher = np.asarray(self.teacher_logits)
        if teacher.shape != (len(self.y), manifest.num_classes):
            raise DataError(
                f"teacher logits have shape {tuple(teacher.shape)} for {len(self.y)} samples",
                f"pass one row of {manifest.num_classes} logits per sample",
            )
        return self


def open_engine(bundle_dir: str | os.PathLike, engine: str = "auto", threads: int | None = None) -> Engine:
    """Load a bundle with the requested engine; `auto` prefers ort-training where it is installed."""
    manifest = load_manifest(bundle_dir, verify_files=True)
    if engine not in ("auto", *ENGINE_NAMES):
        raise UsageError(f"unknown engine {engine!r}", f"choose auto or one of: {', '.join(ENGINE_NAMES)}")
    if engine == "auto":
        if training_build_installed() and "ort-training" in manifest.engines:
            engine = "ort-training"
        elif "portable" in manifest.engines:
            engine = "portable"
        else:
            engine = "ort-training"
    if engine not in manifest.engines:
        raise BundleError(
            f"the bundle has no {engine} artifacts", f"re-export with --engines {engine} or pick another --engine"
        )
    if engine == "ort-training":
        if not training_build_installed():
            raise UsageError(
                "the ort-training engine needs onnxruntime-training-cpu, but plain onnxruntime is installed",
                "use --engine portable",
            )
        from edgepfl.device_runtime.ort_engine import OrtTrainingEngine

        return OrtTrainingEngine(bundle_dir, manifest, threads=threads)
    from edgepfl.device_runtime.portable_engine import PortableEngine

    return PortableEngine(bundle_dir, manifest, threads=threads)
