"""What every kind of sample shares: the model's input, the interface a kind implements, and a device's samples."""

from __future__ import annotations

import zipfile
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from edgepfl.errors import BundleError, DataError, UsageError

NPZ = ".npz"


@dataclass(frozen=True)
class InputSpec:
    """One sample as the model takes it (per sample, channels first) and the per-channel mean and std it is
    normalised with."""

    shape: tuple[int, ...]
    dtype: str = "float32"
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The manifest's `input` entry."""
        return {"shape": list(self.shape), "dtype": self.dtype, "mean": list(self.mean), "std": list(self.std)}

    @classmethod
    def from_json(cls, entry: Mapping[str, Any]) -> InputSpec:
        """Read the manifest's `input` entry (its `layout`, which older exports wrote, says no more than the kind)."""
        return cls(
            shape=tuple(int(d) for d in entry["shape"]),
            dtype=str(entry["dtype"]),
            mean=tuple(float(v) for v in entry["mean"]),
            std=tuple(float(v) for v in entry["std"]),
        )


@dataclass(frozen=True)
class KindWords:
    """How a person is told about a kind's samples: one and many of them, and what a device's data is."""

    one: str  # "image", "word", "window"
    many: str
    data: str  # what `device train --data` takes, as a fix names it


@dataclass(frozen=True, eq=False)
class DeviceSamples:
    """A device's own samples as its files hold them (inputs `x`, labels `y`), before the train/held-out split."""

    x: np.ndarray
    y: np.ndarray


@dataclass(frozen=True, kw_only=True)
class SampleKind(ABC):
    """One kind of sample a bundle's model reads: parsed from the manifest's `sample` entry, it owns how a device's
    files are read, how samples are checked and normalised, how a held-out part is chosen, and the words for it."""

    name: ClassVar[str]  # the manifest's `sample.kind`
    words: ClassVar[KindWords]
    described: ClassVar[str]  # what the samples are, in a sentence ("images", "next-word text")
    held_out_last: ClassVar[bool] = False  # the held-out part is the end of the data in time order, not a seeded draw
    model_file: ClassVar[dict[str, str]] = {}  # what a model file says of its input instead of the image keys

    input: InputSpec

    @classmethod
    @abstractmethod
    def from_entry(cls, entry: Mapping[str, Any], input_spec: InputSpec, num_classes: int) -> SampleKind:
        """The kind an entry describes, checked against the model's input and classes; BundleError otherwise."""

    def entry(self) -> dict[str, Any]:
        """The manifest's `sample` entry: the kind's name and what it says of its samples."""
        return {"kind": self.name}

    @property
    def metric_ignores(self) -> tuple[int, ...]:
        """Target classes accuracy does not count (FedAlt's next-word accuracy leaves out <pad> and <oov>)."""
        return ()

    @property
    def training_defaults(self) -> dict[str, Any]:
        """Round settings (batch_size, lr, epochs) this kind's models train with when none is given (none: the
        settings' own defaults)."""
        return {}

    @property
    def loss_ignores(self) -> tuple[int, ...]:
        """Target classes the training loss leaves out (a next-word sequence's <pad> after its <eos>)."""
        return ()

    @property
    def target_shape(self) -> tuple[int, ...]:
        """One sample's targets: () for one label, (seq_len,) for a next token at every position."""
        return ()

    def target_weights(self, y: np.ndarray, scoring: bool = False) -> np.ndarray:
        """float32, y's shape: 1 for each target the loss counts (`scoring`: the metric counts), 0 for the rest;
        every engine's loss is sum(w·cross-entropy) / sum(w) over a batch's targets."""
        ignored = self.metric_ignores if scoring else self.loss_ignores
        return (~np.isin(y, np.asarray(ignored, dtype=np.int64))).astype(np.float32)

    def prediction_logits(self, logits: np.ndarray, x: np.ndarray) -> np.ndarray:
        """The (n, classes) logits a prediction reads of the model's output for inputs `x` (a next-word model's
        output has a position axis: its last real position)."""
        return logits

    @property
    def bundle_files(self) -> tuple[str, ...]:
        """The bundle's files a device needs to read its samples (a text bundle's vocabulary)."""
        return ()

    def labels(self, bundle: Path, class_labels: Sequence[str]) -> Sequence[str]:
        """What a person is shown for each class: the bundle's class labels (a next-word model's are its words)."""
        return class_labels

    @abstractmethod
    def check_inputs(self, x: np.ndarray, what: str = "x") -> np.ndarray:
        """The samples in the model's layout (without copying where they already are), every value checked;
        DataError otherwise."""

    @abstractmethod
    def normalize(self, x: np.ndarray) -> np.ndarray:
        """Checked samples as the model reads them (float32 normalised, or int64 ids)."""

    @abstractmethod
    def read(self, path: Path, bundle: Path, class_labels: Sequence[str]) -> DeviceSamples:
        """A device's own data at `path` (`device train --data`), read with the bundle's files at `bundle`."""

    def input_files(self, path: Path) -> list[Path]:
        """The files `device predict` reads one input each from (an .npz's inputs are read by the caller); a kind
        that reads no other file refuses every path."""
        raise DataError(f"{path} is not an .npz of {self.described}", f"pass .npz files with the {self.described} as x")

    def read_input_file(self, path: Path) -> np.ndarray:
        """One of `input_files` as a batch of one sample, as stored (not normalised)."""
        raise DataError(f"{path} is not an .npz of {self.described}", f"pass .npz files with the {self.described} as x")

    def phrase_input(self, phrase: str, bundle: Path, num_classes: int) -> np.ndarray:
        """The model input that asks for what follows a typed phrase (`device predict --text`)."""
        raise UsageError(f"--text needs a next-word bundle, and this one reads {self.described}", "pass input files")

    def offered(
        self, probabilities: np.ndarray, bundle: Path, state: Path | None, k: int
    ) -> list[tuple[int, str, float]]:
        """The `k` (id, word, probability) a phrase's `probabilities` offer a person (`device predict --text`)."""
        raise UsageError(f"--text needs a next-word bundle, and this one reads {self.described}", "pass input files")

    def remember(self, path: Path, bundle: Path, state: Path) -> None:  # noqa: B027 (most kinds keep nothing)
        """Keep in a device's state folder what it learns of its own data beside the samples (a text bundle: the
        person's own words); most kinds keep nothing."""


def require(condition: bool, problem: str) -> None:
    """A manifest's sample entry that does not fit its model is refused in one line."""
    if not condition:
        raise BundleError(f"manifest.json: {problem}", "re-export the bundle with this edgepfl version")


def read_npz(path: Path, keys: tuple[str, ...] = ("x", "y")) -> tuple[np.ndarray, ...]:
    """The arrays `keys` (samples `x` and labels `y`) of an .npz file (no pickled objects)."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            missing = [key for key in keys if key not in archive.files]
            if missing:
                raise DataError(
                    f"{path} has no array {missing[0]!r} (it holds {', '.join(archive.files) or 'nothing'})",
                    "save the images as `x` and the labels as `y`: np.savez(path, x=images, y=labels)",
                )
            return tuple(archive[key] for key in keys)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:  # numpy raises EOFError on an empty file
        raise DataError(
            f"{path} is not a readable .npz file ({exc or type(exc).__name__})", "pass an .npz written by numpy.savez"
        ) from None


def standardized(x: np.ndarray, input_spec: InputSpec, scale: float | None = None) -> np.ndarray:
    """float32 x (times `scale`), then (x - mean) / std per channel (axis 1) where the input names a mean: the page
    repeats these float32 operations in this order."""
    scaled = x.astype(np.float32)
    if scale is not None:
        scaled *= np.float32(scale)
    if input_spec.mean:
        per_channel = (1, -1) + (1,) * (x.ndim - 2)
        scaled -= np.asarray(input_spec.mean, dtype=np.float32).reshape(per_channel)
        scaled /= np.asarray(input_spec.std, dtype=np.float32).reshape(per_channel)
    return np.ascontiguousarray(scaled)
