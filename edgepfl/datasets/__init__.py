"""The datasets a simulation deals to its clients, each named once here: image datasets read from a local folder
(`images.py`, dealt by a generated partition, `partition.py`) and the datasets that come with their own clients
(`natural.py`: `shakespeare` and `textdir:FOLDER` by `textdata.py`, `har` by `har.py`).

`load_partition` is the one place that turns `--dataset`/`--partition` into a dataset and its clients' parts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgepfl.datasets.images import Dataset, load_dataset
from edgepfl.datasets.natural import NaturalDataset, natural_parts, only_clients
from edgepfl.datasets.partition import ClientSplit, make_partition
from edgepfl.errors import UsageError

NATURAL = "natural"  # the partition a dataset with its own clients supplies
DEFAULT_CLIENTS = 10  # clients a generated partition deals an image dataset to, unless told


@dataclass(frozen=True)
class NaturalSource:
    """A dataset with its own clients: how `--dataset` names it (a name, or a prefix before a folder) and its reader
    (given the rest of the name and the PartitionOptions)."""

    name: str  # "har", or "textdir:" for textdir:FOLDER
    shown: str  # how help and errors write it
    read: Callable[[str, Any], NaturalDataset]

    def names(self, dataset: str) -> bool:
        """Whether `--dataset dataset` is this one."""
        return dataset.startswith(self.name) if self.name.endswith(":") else dataset == self.name


def _shakespeare(_rest: str, data: Any) -> NaturalDataset:
    from edgepfl.datasets.textdata import load_shakespeare

    return load_shakespeare(vocab_size=data.vocab_size, seq_len=data.seq_len, min_words=data.min_words)


def _text_folder(rest: str, data: Any) -> NaturalDataset:
    from edgepfl.datasets.textdata import load_text_folder

    options = {"vocab_size": data.vocab_size, "seq_len": data.seq_len, "min_words": data.min_words}
    return load_text_folder(Path(rest).expanduser(), **options)


def _har(_rest: str, _data: Any) -> NaturalDataset:
    from edgepfl.datasets.har import load_har

    return load_har()


NATURAL_SOURCES = (
    NaturalSource("shakespeare", "shakespeare", _shakespeare),
    NaturalSource("textdir:", "textdir:FOLDER", _text_folder),
    NaturalSource("har", "har", _har),
)
NATURAL_DATASETS = tuple(source.shown for source in NATURAL_SOURCES)


def natural_source(dataset: str) -> NaturalSource | None:
    """The dataset with its own clients that `--dataset dataset` names, or None."""
    return next((source for source in NATURAL_SOURCES if source.names(dataset)), None)


def is_natural(dataset: str) -> bool:
    """Whether `--dataset dataset` comes with its own clients."""
    return natural_source(dataset) is not None


def load_partition(data: Any, seed: int) -> tuple[Dataset, list[ClientSplit]]:
    """The dataset and its clients' parts that `--dataset`, `--partition`, `--clients`, `--split` and `--seed` name
    (`data` is a PartitionOptions): a dataset with its own clients takes only its natural partition."""
    source = natural_source(data.dataset)
    if source is not None:
        if data.partition != NATURAL:
            raise UsageError(
                f"--dataset {data.dataset} comes with its own clients; --partition {data.partition} would deal their "
                "samples to made-up clients",
                "drop --partition (natural, one client per role, file or subject, is the default)",
            )
        dataset = source.read(data.dataset.removeprefix(source.name), data)
        if data.clients is not None:  # the clients with most training samples, for a run that fits a budget
            sizes = [-len(train) for train in dataset.client_train]
            dataset = only_clients(dataset, sorted(np.argsort(sizes, kind="stable")[: data.clients]))
        return dataset, natural_parts(dataset, data.split)
    if data.partition == NATURAL:
        raise UsageError(
            f"--dataset {data.dataset} has no clients of its own to partition by",
            f"use --dataset {', '.join(NATURAL_DATASETS)}, or another --partition",
        )
    dataset = load_dataset(data.dataset, data.data_root, download=data.download, checksums=data.checksums)
    clients = None if data.partition.startswith("file:") else data.clients or DEFAULT_CLIENTS
    return dataset, make_partition(data.partition, dataset.y_train, dataset.y_test, clients, seed, data.split)
