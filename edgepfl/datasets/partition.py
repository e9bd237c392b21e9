"""Seeded client partitions of a dataset, each split into the client's own train, validation and test.

Index space: every partition indexes the dataset's train and test samples pooled ("train+test"):
i < len(labels_train) is train sample i, i >= len(labels_train) is test sample i - len(labels_train).
The generated schemes pool both splits, deal the samples to clients, then split each client's samples
into train/val/test stratified by its own label distribution (PersFL: 60/20/20 of each client's data),
so every client is evaluated on data from its own distribution.

How each paper's definition is read (C = classes present, N = clients):

- `iid`: a seeded shuffle of all samples dealt into N near-equal parts.
- `classes:K` (FedPer; PersFL DS-1): classes are laid out in a seeded random order and dealt in a cycle,
  client c getting the K consecutive classes at positions cK .. cK+K-1 (mod C); so each client holds
  exactly min(K, C) distinct classes and every class is held by floor or ceil(NK/C) clients. A class's
  samples are split evenly (sizes differ by at most one) among the clients that hold it.
- `dirichlet:ALPHA` (PersFL DS-2, alpha = 0.9 there): for every class, proportions over the N clients
  are drawn from Dir(ALPHA, ..., ALPHA) and the class's samples are cut by them (the per-class label-
  Dirichlet of NIID-Bench). Draws repeat until every client holds at least MIN_CLIENT_SAMPLES samples.
- `ds3` (PersFL DS-3): client weights w_c ~ LogNormal(mu=0, sigma=2), the first draw of
  numpy.random.default_rng(seed); classes dealt two per client as in `classes:2`; each holder of a class
  first gets MIN_CLASS_SAMPLES of it and the rest of the class is shared in proportion to the holders'
  weights (largest remainder). All samples are used, so client sizes follow the log-normal weights
  wherever class supply allows.
- `dominant:D[:SHARE]` (pFedLA non-IID setting 2): every client holds every class; D classes (dealt as in
  `classes:D`) are dominant and take SHARE of the client's samples (default 0.8), split evenly among
  them, the other classes share the remaining 1 - SHARE evenly. All clients have the same size, the
  largest the per-class supply allows.
- `file:PATH.json`: an explicit split made elsewhere, used as is (no re-split):
  {"index_space": "train+test" | "train", "clients": [{"train_indices": [...], "test_indices": [...],
  "val_indices": [...]}], "allow_overlap": false}; `val_indices` and `allow_overlap` are optional.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgepfl.errors import DataError, UsageError

SCHEMES = ("iid", "classes:K", "dirichlet:ALPHA", "ds3", "dominant:D[:SHARE]", "file:PATH.json")
DEFAULT_SPLIT = (0.6, 0.2, 0.2)
DEFAULT_DOMINANT_SHARE = 0.8
DS3_SIGMA = 2.0
MIN_CLIENT_SAMPLES = 10
MIN_CLASS_SAMPLES = 5
DIRICHLET_ATTEMPTS = 1000
INDEX_SPACES = ("train+test", "train")
MAX_CLASS_COLUMNS = 200  # more classes (a vocabulary's words) make a table nobody reads: it shows the totals


@dataclass(frozen=True, eq=False)
class ClientSplit:
    """One client's samples as int64 indices into the train+test index space."""

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray

    @property
    def indices(self) -> np.ndarray:
        """All of the client's samples: train, then val, then test."""
        return np.concatenate([self.train, self.val, self.test])

    @property
    def size(self) -> int:
        """Number of samples the client holds."""
        return len(self.train) + len(self.val) + len(self.test)


def make_partition(
    spec: str,
    labels_train: np.ndarray,
    labels_test: np.ndarray,
    num_clients: int | None,
    seed: int,
    split: Sequence[float] = DEFAULT_SPLIT,
) -> list[ClientSplit]:
    """Partition train+test samples among clients by `spec` (see the module docstring); seeded, deterministic."""
    labels_train = np.asarray(labels_train, dtype=np.int64)
    labels_test = np.asarray(labels_test, dtype=np.int64)
    scheme, _, argument = spec.partition(":")
    if scheme == "file":
        if not argument:
            raise UsageError("--partition file: needs a path", "write --partition file:PATH.json")
        return read_partition_file(argument, len(labels_train), len(labels_test), num_clients)
    labels = np.concatenate([labels_train, labels_test])
    fractions = check_split(split)
    if num_clients is None:
        raise UsageError(f"--partition {spec} needs a number of clients", "add --clients N")
    if num_clients < 1:
        raise UsageError(f"--clients {num_clients} must be at least 1", "use --clients 10 or so")
    if num_clients * MIN_CLIENT_SAMPLES > len(labels):
        raise DataError(
            f"{len(labels)} samples cannot give {num_clients} clients {MIN_CLIENT_SAMPLES} samples each",
            "use fewer --clients",
        )
    rng = np.random.default_rng(seed)
    groups = _deal(scheme, argument, spec, labels, num_clients, rng)
    split_rng = np.random.default_rng([seed, 1])
    return [_split_client(np.asarray(group, dtype=np.int64), labels, fractions, split_rng) for group in groups]


def check_split(split: Sequence[float]) -> tuple[float, float, float]:
    """Validate train/val/test fractions: three non-negative numbers summing to 1, train and test > 0."""
    values = tuple(float(v) for v in split)
    if len(values) != 3 or any(not math.isfinite(v) or v < 0 for v in values) or abs(sum(values) - 1) > 1e-6:
        raise UsageError(f"split {values} is not three fractions summing to 1", "use e.g. --split 0.6,0.2,0.2")
    if values[0] == 0 or values[2] == 0:
        raise UsageError(f"split {values} leaves no train or no test data", "give train and test a positive share")
    return values  # type: ignore[return-value]


def parse_split(text: str) -> tuple[float, float, float]:
    """`0.6,0.2,0.2` -> (0.6, 0.2, 0.2), validated."""
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"--split {text!r} is not a comma list of numbers", "use e.g. --split 0.6,0.2,0.2") from None
    return check_split(values)


def read_partition_file(
    path: str | os.PathLike, num_train: int, num_test: int, num_clients: int | None = None
) -> list[ClientSplit]:
    """Read and validate an explicit partition (format in the module docstring); one-line DataError on any fault."""
    path = Path(path)
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise DataError(f"cannot read partition file {path} ({exc.strerror})", "check the path after file:") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        where = f", line {exc.lineno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise DataError(f"partition file {path} is not valid JSON{where}", "write it with json.dump") from None
    if not isinstance(document, dict) or not isinstance(document.get("clients"), list) or not document["clients"]:
        raise DataError(f'partition file {path} has no non-empty "clients" list', 'write {"clients": [...]}')
    space = document.get("index_space")
    if space not in INDEX_SPACES:
        raise DataError(
            f"partition file {path} has index_space {space!r}", 'set "index_space" to "train+test" or "train"'
        )
    limit = num_train + num_test if space == "train+test" else num_train
    allow_overlap = document.get("allow_overlap", False)
    if not isinstance(allow_overlap, bool):
        raise DataError(f"partition file {path}: allow_overlap must be true or false", "write a JSON boolean")
    clients = document["clients"]
    if num_clients is not None and num_clients != len(clients):
        raise DataError(
            f"partition file {path} has {len(clients)} clients but --clients is {num_clients}",
            f"drop --clients or pass --clients {len(clients)}",
        )
    parts = []
    for number, client in enumerate(clients):
        if not isinstance(client, dict):
            raise DataError(f"partition file {path}: client {number} is not an object", "see the file: format")
        unknown = sorted(set(client) - {"train_indices", "val_indices", "test_indices"})
        if unknown:
            raise DataError(
                f"partition file {path}: client {number} has unknown key {unknown[0]!r}",
                "use train_indices, val_indices, test_indices",
            )
        arrays = {}
        for key in ("train_indices", "val_indices", "test_indices"):
            if key not in client and key != "val_indices":
                raise DataError(f"partition file {path}: client {number} lacks {key}", f"add {key}: [...]")
            arrays[key] = _index_array(client.get(key, []), path, number, key, limit, space)
        if not len(arrays["train_indices"]):
            raise DataError(f"partition file {path}: client {number} has no train_indices", "give every client data")
        parts.append(ClientSplit(arrays["train_indices"], arrays["val_indices"], arrays["test_indices"]))
    if not allow_overlap:
        _check_disjoint(parts, path)
    return parts


def write_partition_file(path: str | os.PathLike, parts: Sequence[ClientSplit]) -> None:
    """Write a partition in the file: format (index_space train+test), readable by another tool."""
    from edgepfl.atomic import write_text_atomic

    document = {
        "index_space": "train+test",
        "clients": [
            {
                "train_indices": part.train.tolist(),
                "val_indices": part.val.tolist(),
                "test_indices": part.test.tolist(),
            }
            for part in parts
        ],
    }
    write_text_atomic(Path(path), json.dumps(document, separators=(",", ":")) + "\n")


def class_counts(parts: Sequence[ClientSplit], labels: np.ndarray, which: str = "all") -> np.ndarray:
    """Client x class target counts (int64) of `which` split: all, train, val or test (a sample's targets, one label
    or a next-word sequence's, each counted)."""
    labels = np.asarray(labels, dtype=np.int64)
    num_classes = int(labels.max()) + 1 if len(labels) else 0
    counts = np.zeros((len(parts), num_classes), dtype=np.int64)
    for row, part in enumerate(parts):
        indices = part.indices if which == "all" else getattr(part, which)
        counts[row] = np.bincount(labels[indices].reshape(-1), minlength=num_classes)
    return counts


def partition_table(parts: Sequence[ClientSplit], labels: np.ndarray, title: str = "", names: Sequence[str] = ()):
    """A rich Table: one row per client with its count per class (up to MAX_CLASS_COLUMNS classes) and its
    train/val/test totals."""
    from rich.table import Table

    counts = class_counts(parts, labels)
    counts = counts if counts.shape[1] <= MAX_CLASS_COLUMNS else counts[:, :0]  # a next-word task: totals only
    table = Table(title=title or None)
    table.add_column("client", justify="right")
    for klass in range(counts.shape[1]):
        table.add_column(str(klass), justify="right")
    for column in ("train", "val", "test", "total"):
        table.add_column(column, justify="right", style="bold")
    for row, part in enumerate(parts):
        cells = [str(c) if c else "." for c in counts[row]]
        sizes = (str(len(part.train)), str(len(part.val)), str(len(part.test)), str(part.size))
        table.add_row(names[row] if names else str(row), *cells, *sizes)
    totals = counts.sum(axis=0)
    table.add_row(
        "all",
        *[str(c) for c in totals],
        str(sum(len(p.train) for p in parts)),
        str(sum(len(p.val) for p in parts)),
        str(sum(len(p.test) for p in parts)),
        str(sum(p.size for p in parts)),
        style="dim",
    )
    return table


def _deal(
    scheme: str, argument: str, spec: str, labels: np.ndarray, num_clients: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Client sample groups for a generated scheme (before the per-client train/val/test split)."""
    if scheme == "iid" and not argument:
        return np.array_split(rng.permutation(len(labels)), num_clients)
    if scheme == "classes":
        k = _int_argument(argument, spec, "classes:K, e.g. classes:2")
        return _deal_classes(labels, num_clients, k, rng)
    if scheme == "dirichlet":
        alpha = _float_argument(argument, spec, "dirichlet:ALPHA, e.g. dirichlet:0.9")
        return _deal_dirichlet(labels, num_clients, alpha, rng)
    if scheme == "ds3" and not argument:
        return _deal_ds3(labels, num_clients, rng)
    if scheme == "dominant":
        count_text, _, share_text = argument.partition(":")
        count = _int_argument(count_text, spec, "dominant:D or dominant:D:SHARE, e.g. dominant:2")
        share = _float_argument(share_text, spec, "dominant:2:0.8") if share_text else DEFAULT_DOMINANT_SHARE
        if not 0 < share <= 1:
            raise UsageError(f"--partition {spec}: SHARE must be in (0, 1]", "use e.g. dominant:2:0.8")
        return _deal_dominant(labels, num_clients, count, share, rng)
    raise UsageError(f"unknown partition {spec!r}", f"choose one of: {', '.join(SCHEMES)}")


def _assign_classes(classes: np.ndarray, num_clients: int, k: int, rng: np.random.Generator) -> list[np.ndarray]:
    """K consecutive classes per client along a seeded random class order, cycling."""
    if not 1 <= k <= len(classes):
        raise UsageError(f"K={k} classes per client is outside 1..{len(classes)}", f"choose K up to {len(classes)}")
    order = rng.permutation(classes)
    return [order[(c * k + np.arange(k)) % len(classes)] for c in range(num_clients)]


def _deal_classes(labels: np.ndarray, num_clients: int, k: int, rng: np.random.Generator) -> list[np.ndarray]:
    classes = np.unique(labels)
    held = _assign_classes(classes, num_clients, k, rng)
    groups: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for klass in classes:
        holders = [c for c in range(num_clients) if klass in held[c]]
        if not holders:
            continue
        members = rng.permutation(np.flatnonzero(labels == klass))
        for holder, chunk in zip(holders, np.array_split(members, len(holders))):
            groups[holder].append(chunk)
    return [np.concatenate(g) if g else np.empty(0, np.int64) for g in groups]


def _deal_dirichlet(labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    if not alpha > 0 or not math.isfinite(alpha):
        raise UsageError(f"dirichlet alpha {alpha} must be positive", "use e.g. dirichlet:0.9")
    classes = np.unique(labels)
    members = [np.flatnonzero(labels == klass) for klass in classes]
    for _ in range(DIRICHLET_ATTEMPTS):
        groups: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for indices in members:
            proportions = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(proportions)[:-1] * len(indices)).astype(np.int64)
            for client, chunk in enumerate(np.split(rng.permutation(indices), cuts)):
                groups[client].append(chunk)
        dealt = [np.concatenate(g) for g in groups]
        if min(len(d) for d in dealt) >= MIN_CLIENT_SAMPLES:
            return dealt
    raise DataError(
        f"dirichlet:{alpha} left a client with fewer than {MIN_CLIENT_SAMPLES} samples in {DIRICHLET_ATTEMPTS} draws",
        "raise ALPHA or use fewer --clients",
    )


def _deal_ds3(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    weights = rng.lognormal(mean=0.0, sigma=DS3_SIGMA, size=num_clients)
    classes = np.unique(labels)
    held = _assign_classes(classes, num_clients, min(2, len(classes)), rng)
    groups: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for klass in classes:
        holders = np.array([c for c in range(num_clients) if klass in held[c]], dtype=np.int64)
        if not len(holders):
            continue
        members = rng.permutation(np.flatnonzero(labels == klass))
        floor = min(MIN_CLASS_SAMPLES, len(members) // len(holders))
        shares = _largest_remainder(weights[holders], len(members) - floor * len(holders)) + floor
        for holder, chunk in zip(holders, np.split(members, np.cumsum(shares)[:-1])):
            groups[holder].append(chunk)
    return [np.concatenate(g) if g else np.empty(0, np.int64) for g in groups]


def _deal_dominant(
    labels: np.ndarray, num_clients: int, count: int, share: float, rng: np.random.Generator
) -> list[np.ndarray]:
    classes = np.unique(labels)
    if count >= len(classes) and share < 1:
        raise UsageError(f"dominant:{count} leaves no other classes of {len(classes)}", f"use D < {len(classes)}")
    dominant = _assign_classes(classes, num_clients, count, rng)
    others = len(classes) - count
    fractions = np.zeros((num_clients, len(classes)))
    for client, held in enumerate(dominant):
        positions = np.searchsorted(classes, held)
        fractions[client] = (1 - share) / others if others else 0.0
        fractions[client, positions] = share / count
    pools = [rng.permutation(np.flatnonzero(labels == klass)) for klass in classes]
    supply = np.array([len(pool) for pool in pools])
    demand = fractions.sum(axis=0)
    # rounding each client's counts can ask one sample more per class than its exact share: keep that slack
    size = int(np.min((supply[demand > 0] - num_clients) / demand[demand > 0]))
    if size < MIN_CLIENT_SAMPLES:
        raise DataError(
            f"dominant:{count} leaves clients fewer than {MIN_CLIENT_SAMPLES} samples", "use fewer --clients"
        )
    cursor = np.zeros(len(classes), dtype=np.int64)
    groups = []
    for client in range(num_clients):
        wanted = _largest_remainder(fractions[client], size)
        groups.append(np.concatenate([pools[k][cursor[k] : cursor[k] + wanted[k]] for k in range(len(classes))]))
        cursor += wanted
    return groups


def _largest_remainder(weights: np.ndarray, total: int) -> np.ndarray:
    """Non-negative integers summing to `total`, proportional to `weights` (Hamilton's method)."""
    exact = np.asarray(weights, dtype=np.float64) / np.sum(weights) * total
    counts = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[: total - int(counts.sum())]] += 1
    return counts


def _split_client(indices: np.ndarray, labels: np.ndarray, fractions: tuple, rng: np.random.Generator) -> ClientSplit:
    """Stratified train/val/test cut of one client's samples; totals are exact, each class within one sample.

    Each class's samples are shuffled and given quantile keys (rank + 0.5) / n_class; sorting all the
    client's samples by key and cutting at round(n * train) and round(n * (train + val)) gives every
    split the client's own label distribution.
    """
    if len(indices) == 0:
        return ClientSplit(indices, indices, indices)
    keys = np.empty(len(indices))
    shuffled = rng.permutation(indices)
    client_labels = labels[shuffled]
    for klass in np.unique(client_labels):
        where = np.flatnonzero(client_labels == klass)
        keys[where] = (np.arange(len(where)) + 0.5) / len(where)
    ordered = shuffled[np.argsort(keys, kind="stable")]
    n_train = int(round(len(indices) * fractions[0]))
    n_val = int(round(len(indices) * (fractions[0] + fractions[1]))) - n_train
    n_train = max(n_train, 1)
    train, val, test = np.split(ordered, [n_train, n_train + max(n_val, 0)])
    return ClientSplit(np.sort(train), np.sort(val), np.sort(test))


def _index_array(values, path: Path, client: int, key: str, limit: int, space: str) -> np.ndarray:
    if not isinstance(values, list):
        raise DataError(f"partition file {path}: client {client} {key} is not a list", "write a JSON list of integers")
    if not values:
        return np.empty(0, dtype=np.int64)
    array = np.asarray(values) if all(type(v) is int for v in values) else None
    if array is None or array.dtype.kind not in "iu":
        bad = next((v for v in values if type(v) is not int), values[0])
        raise DataError(f"partition file {path}: client {client} {key} holds {bad!r}", "list integer sample indices")
    array = array.astype(np.int64)
    outside = np.flatnonzero((array < 0) | (array >= limit))
    if len(outside):
        position = int(outside[0])
        raise DataError(
            f"partition file {path}: client {client} {key}[{position}] = {array[position]} is outside "
            f"0..{limit - 1} of index_space {space}",
            "fix the index or the index_space",
        )
    return array


def _check_disjoint(parts: list[ClientSplit], path: Path) -> None:
    owners = [(c, key) for c, part in enumerate(parts) for key in ("train", "val", "test")]
    arrays = [getattr(parts[c], key) for c, key in owners]
    everything = np.concatenate(arrays)
    values, counts = np.unique(everything, return_counts=True)
    if np.all(counts == 1):
        return
    sample = int(values[np.argmax(counts > 1)])
    places = [f"client {c} {key}_indices" for (c, key), array in zip(owners, arrays) if sample in array]
    where = " and ".join(places[:2]) if len(places) > 1 else f"{places[0]} twice"
    raise DataError(
        f"partition file {path}: sample {sample} is in {where}",
        'remove the duplicate, or set "allow_overlap": true if the split is meant to share samples',
    )


def _int_argument(text: str, spec: str, form: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"--partition {spec!r} needs an integer after the colon", f"write {form}") from None


def _float_argument(text: str, spec: str, form: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise UsageError(f"--partition {spec!r} needs a number after the colon", f"write {form}") from None
