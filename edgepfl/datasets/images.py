"""Image classification datasets read from a local folder, never downloaded unless asked.

torchvision's own dataset classes do the reading (imported lazily, so this module imports without
torch); `mnist` prefers a `mnist.npz` in the folder, and any `.npz` with `x_train, y_train, x_test,
y_test` works as a dataset. CIFAR folders are checked against md5 lists: torchvision's own, one the
user supplies (`--checksums FILE`), or a known alternative copy shipped in `edgepfl/checksums/`
(e.g. the approximate JPEG-decoded CIFAR-10 of shared/data). The list that matched is recorded in
`Dataset.description` and `Dataset.verified`, so results never pass an approximate copy off as the
original. Turning images into model input is their kind's (`edgepfl.kinds.image.ImageKind.normalize`).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from edgepfl.errors import DataError, UsageError

DATASET_NAMES = ("mnist", "fashion-mnist", "emnist", "cifar10", "cifar100")
EMNIST_SPLITS = ("balanced", "byclass", "bymerge", "letters", "digits", "mnist")
NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")

_LABELS = {
    "mnist": "MNIST",
    "fashion-mnist": "Fashion-MNIST",
    "emnist": "EMNIST",
    "cifar10": "CIFAR-10",
    "cifar100": "CIFAR-100",
}
_FIX_MISSING = "pass --data-root DIR for the folder that holds it, or add --download"


@dataclass(frozen=True, eq=False)
class Dataset:
    """Train and test images (uint8, NHW grey or NHWC colour) with int64 labels.

    Samples are addressed in the "train+test" index space: i < num_train is train sample i,
    i >= num_train is test sample i - num_train (the index space of `edgepfl.partition`).
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    description: str = ""
    verified: str = ""

    @property
    def num_train(self) -> int:
        """Number of samples in the dataset's own train split."""
        return len(self.y_train)

    @property
    def num_samples(self) -> int:
        """Number of samples in the train+test index space."""
        return len(self.y_train) + len(self.y_test)

    @property
    def labels(self) -> np.ndarray:
        """Labels over the train+test index space."""
        return np.concatenate([self.y_train, self.y_test])

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        """One image as the model sees it, channels first: (C, H, W)."""
        shape = self.x_train.shape[1:]
        return (1, *shape) if len(shape) == 2 else (shape[2], shape[0], shape[1])

    def images(self, indices: np.ndarray | Sequence[int]) -> np.ndarray:
        """Samples (uint8 images) at indices of the train+test space, in the order given."""
        indices = np.asarray(indices, dtype=np.int64)
        out = np.empty((len(indices), *self.x_train.shape[1:]), dtype=self.x_train.dtype)
        from_train = indices < self.num_train
        out[from_train] = self.x_train[indices[from_train]]
        out[~from_train] = self.x_test[indices[~from_train] - self.num_train]
        return out

    def targets(self, indices: np.ndarray | Sequence[int]) -> np.ndarray:
        """int64 labels at indices of the train+test space, in the order given (a next-word sample's: one a
        position)."""
        indices = np.asarray(indices, dtype=np.int64)
        from_train = indices < self.num_train
        out = np.empty((len(indices), *self.y_train.shape[1:]), dtype=np.int64)
        out[from_train] = self.y_train[indices[from_train]]
        out[~from_train] = self.y_test[indices[~from_train] - self.num_train]
        return out


@dataclass(frozen=True)
class ChecksumList:
    """md5s of a dataset folder's files; files it does not name must match torchvision's originals."""

    md5: dict[str, str]
    description: str = ""
    origin: str = ""
    dataset: str = ""
    note: str = field(default="", compare=False)


def load_dataset(
    name: str,
    root: str | os.PathLike,
    download: bool = False,
    checksums: str | os.PathLike | Mapping[str, str] | None = None,
) -> Dataset:
    """Load a named dataset (or a `.npz` path) from `root`; downloads only when `download` is True."""
    root = Path(root).expanduser()
    if name.endswith(".npz"):
        path = Path(name).expanduser()
        if not path.is_file() and not path.is_absolute() and (root / path).is_file():
            path = root / path
        return load_npz(path)
    family, variant = ("emnist", name.removeprefix("emnist-")) if name.startswith("emnist-") else (name, "")
    if family not in DATASET_NAMES:
        raise UsageError(
            f"unknown dataset {name!r}", f"choose one of: {', '.join(DATASET_NAMES)}, or a path ending in .npz"
        )
    if checksums is not None and family not in ("cifar10", "cifar100"):
        raise UsageError(f"--checksums applies to cifar10 and cifar100, not {name}", "drop --checksums")
    if family == "mnist" and (root / "mnist.npz").is_file():
        dataset = load_npz(root / "mnist.npz", name="mnist", description="MNIST (mnist.npz)")
        if dataset.sample_shape != (1, 28, 28) or dataset.num_classes > 10:
            raise DataError(
                f"{root / 'mnist.npz'} is not MNIST ({dataset.sample_shape} images, {dataset.num_classes} classes)",
                "remove it or point --data-root elsewhere",
            )
        return Dataset(**{**dataset.__dict__, "num_classes": 10})
    if family in ("cifar10", "cifar100"):
        return _load_cifar(family, root, download, checksums)
    if family == "emnist":
        split = variant or "balanced"
        if split not in EMNIST_SPLITS:
            raise UsageError(
                f"unknown EMNIST split {split!r}", f"use emnist-<split>, one of: {', '.join(EMNIST_SPLITS)}"
            )
        return _load_mnist_family(family, root, download, split)
    return _load_mnist_family(family, root, download, "")


def load_npz(path: str | os.PathLike, name: str | None = None, description: str | None = None) -> Dataset:
    """A dataset from an .npz holding x_train, y_train, x_test, y_test (uint8 images, integer labels)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"dataset file {path} does not exist", "check the path given to --dataset")
    try:
        with np.load(path, allow_pickle=False) as archive:
            missing = [key for key in NPZ_KEYS if key not in archive.files]
            if missing:
                raise DataError(
                    f"{path} lacks {', '.join(missing)}", f"save the arrays {', '.join(NPZ_KEYS)} with np.savez"
                )
            arrays = {key: archive[key] for key in NPZ_KEYS}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise DataError(
            f"{path} is not a readable .npz ({exc})", "write it with np.savez or np.savez_compressed"
        ) from None
    x_train, x_test = _pixels(arrays["x_train"], path, "x_train"), _pixels(arrays["x_test"], path, "x_test")
    y_train, y_test = _labels(arrays["y_train"], path, "y_train"), _labels(arrays["y_test"], path, "y_test")
    for images, labels, split in ((x_train, y_train, "train"), (x_test, y_test, "test")):
        if len(images) != len(labels):
            raise DataError(
                f"{path}: x_{split} has {len(images)} images but y_{split} {len(labels)} labels",
                "save one label per image",
            )
    if x_train.shape[1:] != x_test.shape[1:]:
        raise DataError(
            f"{path}: train images {x_train.shape[1:]} differ from test images {x_test.shape[1:]}",
            "use one image shape",
        )
    if len(y_train) == 0:
        raise DataError(f"{path} has no training samples", "save a non-empty x_train")
    num_classes = int(max(y_train.max(), y_test.max() if len(y_test) else 0)) + 1
    stem = name or path.stem
    return Dataset(
        name=stem,
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        num_classes=num_classes,
        description=description or f"{path.name} ({num_classes} classes)",
        verified="not checked (npz)",
    )


def read_checksums(source: str | os.PathLike | Mapping[str, str], dataset: str = "") -> ChecksumList:
    """An md5 list from a JSON file ({"md5": {file: md5}} or {file: md5}), a CSV/md5sum file, or a dict."""
    if isinstance(source, Mapping):
        return _checksum_list(dict(source), "supplied checksums", dataset)
    path = Path(source)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(
            f"cannot read checksum list {path} ({exc})", "pass a JSON or CSV file of file,md5 lines"
        ) from None
    if text.lstrip().startswith("{"):
        try:
            document = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"checksum list {path} is not valid JSON ({exc.msg}, line {exc.lineno})", "fix the file"
            ) from None
        return _checksum_list(document, path.name, dataset)
    rows: dict[str, str] = {}
    for row in csv.reader(io.StringIO(text)):
        cells = [cell.strip() for cell in row if cell.strip()]
        if len(cells) == 1 and len(cells[0].split()) == 2:  # md5sum output: "<md5>  <file>"
            md5, filename = cells[0].split()
            cells = [filename.lstrip("*"), md5]
        if not cells or cells[0].startswith("#") or cells[0].lower() in ("file", "filename", "name"):
            continue
        if len(cells) != 2:
            raise DataError(
                f"checksum list {path} has a line {row!r} that is not `file,md5`", "write one file,md5 per line"
            )
        rows[Path(cells[0]).name] = cells[1]
    return _checksum_list(rows, path.name, dataset)


def known_checksums(dataset: str) -> list[ChecksumList]:
    """Alternative copies of a dataset that edgepfl knows (files in edgepfl/checksums/), by name."""
    folder = resources.files("edgepfl").joinpath("checksums")
    lists = []
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".json"):
            listed = _checksum_list(json.loads(entry.read_text(encoding="utf-8")), entry.name, "")
            if listed.dataset == dataset:
                lists.append(listed)
    return lists


def _checksum_list(document: dict, origin: str, dataset: str) -> ChecksumList:
    md5 = document.get("md5", document) if isinstance(document, dict) else None
    if (
        not isinstance(md5, dict)
        or not md5
        or not all(isinstance(k, str) and isinstance(v, str) and len(v) == 32 for k, v in md5.items())
    ):
        raise DataError(
            f"checksum list {origin} is not a map of file names to md5 hex strings", "see edgepfl/checksums/*.json"
        )
    return ChecksumList(
        md5={name: value.lower() for name, value in md5.items()},
        description=str(document.get("description", "")) if "md5" in document else "",
        origin=origin,
        dataset=str(document.get("dataset", dataset)) if "md5" in document else dataset,
        note=str(document.get("note", "")) if "md5" in document else "",
    )


def _pixels(array: np.ndarray, path: Path, key: str) -> np.ndarray:
    if array.ndim not in (3, 4):
        raise DataError(f"{path}: {key} has shape {array.shape}", "save images as N,H,W (grey) or N,H,W,C")
    if array.dtype != np.uint8:
        if array.dtype.kind not in "iu" or (array.size and (array.min() < 0 or array.max() > 255)):
            raise DataError(
                f"{path}: {key} is {array.dtype}, edgepfl expects uint8 pixels 0..255",
                "save np.round(x * 255).astype(np.uint8) for images in [0, 1]",
            )
        array = array.astype(np.uint8)
    if array.ndim == 4 and array.shape[1] in (1, 3) and array.shape[3] not in (1, 3):
        array = array.transpose(0, 2, 3, 1)  # NCHW -> NHWC
    if array.ndim == 4 and array.shape[3] == 1:
        array = array[..., 0]
    return np.ascontiguousarray(array)


def _labels(array: np.ndarray, path: Path, key: str) -> np.ndarray:
    array = array.reshape(-1) if array.ndim == 2 and 1 in array.shape else array
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise DataError(f"{path}: {key} is {array.dtype} {array.shape}", "save labels as a 1-D integer array")
    if array.size and array.min() < 0:
        raise DataError(f"{path}: {key} has negative labels", "number the classes 0..C-1")
    return array.astype(np.int64)


def _torchvision_datasets():
    try:
        from torchvision import datasets
    except ImportError:
        raise DataError(
            "reading this dataset needs torchvision, which is not installed", "pip install 'edgepfl[export]'"
        ) from None
    return datasets


def _load_mnist_family(family: str, root: Path, download: bool, split: str) -> Dataset:
    datasets = _torchvision_datasets()
    cls = {"mnist": datasets.MNIST, "fashion-mnist": datasets.FashionMNIST, "emnist": datasets.EMNIST}[family]
    label = _LABELS[family] + (f" ({split})" if split else "")
    folder = root / cls.__name__ / "raw"
    extra = {"split": split} if split else {}
    try:
        train = cls(str(root), train=True, download=download, **extra)
        test = cls(str(root), train=False, download=download, **extra)
    except (RuntimeError, OSError) as exc:
        expected = f"{root / 'mnist.npz'} or {folder}/" if family == "mnist" else f"{folder}/"
        if download:
            raise DataError(
                f"{label} could not be downloaded to {folder} ({exc})", "check the network, or put the files there"
            ) from None
        raise DataError(f"{label} not found: expected {expected}", _FIX_MISSING) from None
    x_train, x_test = train.data.numpy(), test.data.numpy()
    if family == "emnist":  # the EMNIST files store each image transposed; keep them upright
        x_train, x_test = x_train.transpose(0, 2, 1), x_test.transpose(0, 2, 1)
    return Dataset(
        name=family if not split or split == "balanced" else f"emnist-{split}",
        x_train=np.ascontiguousarray(x_train, dtype=np.uint8),
        y_train=train.targets.numpy().astype(np.int64),
        x_test=np.ascontiguousarray(x_test, dtype=np.uint8),
        y_test=test.targets.numpy().astype(np.int64),
        num_classes=len(train.classes),
        description=label,
        verified="torchvision (files present, no md5 list)",
    )


def _load_cifar(
    family: str, root: Path, download: bool, checksums: str | os.PathLike | Mapping[str, str] | None
) -> Dataset:
    datasets = _torchvision_datasets()
    base = datasets.CIFAR10 if family == "cifar10" else datasets.CIFAR100
    label = _LABELS[family]
    original = ChecksumList(
        md5=_torchvision_md5s(base), description=label, origin="torchvision's md5 list", dataset=family
    )
    candidates = [original]
    if checksums is not None:
        candidates.append(read_checksums(checksums, family))
    candidates += known_checksums(family)
    folder = root / base.base_folder
    actual = {name: _md5(folder / name) for name in original.md5} if folder.is_dir() else {}
    matched = _match_checksums(actual, original, candidates) if actual else None
    if matched is None and not download:
        if not folder.is_dir():
            raise DataError(f"{label} not found: expected {folder}/", _FIX_MISSING)
        raise DataError(_mismatch(folder, actual, original, candidates), _fix_mismatch(family))
    listed = _listed_class(base, (matched or original).md5)
    try:
        train = listed(str(root), train=True, download=matched is None)
        test = listed(str(root), train=False, download=False)
    except (RuntimeError, OSError) as exc:
        raise DataError(f"{label} could not be read or downloaded in {folder} ({exc})", _fix_mismatch(family)) from None
    matched = matched or original
    description = matched.description or f"{label} (a copy matching {matched.origin})"
    return Dataset(
        name=family,
        x_train=np.ascontiguousarray(train.data, dtype=np.uint8),
        y_train=np.asarray(train.targets, dtype=np.int64),
        x_test=np.ascontiguousarray(test.data, dtype=np.uint8),
        y_test=np.asarray(test.targets, dtype=np.int64),
        num_classes=len(train.classes),
        description=description,
        verified=f"md5 of {len(original.md5)} files match {matched.origin}",
    )


def _torchvision_md5s(base) -> dict[str, str]:
    files = {name: md5 for name, md5 in base.train_list + base.test_list}
    files[base.meta["filename"]] = base.meta["md5"]
    return files


def _listed_class(base, md5: Mapping[str, str]):
    """torchvision's own CIFAR class with its md5 list replaced: the same reader, the same integrity check."""
    return type(
        f"Listed{base.__name__}",
        (base,),
        {
            "train_list": [[name, md5.get(name, value)] for name, value in base.train_list],
            "test_list": [[name, md5.get(name, value)] for name, value in base.test_list],
            "meta": {**base.meta, "md5": md5.get(base.meta["filename"], base.meta["md5"])},
        },
    )


def _match_checksums(
    actual: Mapping[str, str | None], original: ChecksumList, candidates: list[ChecksumList]
) -> ChecksumList | None:
    for candidate in candidates:
        expected = {**original.md5, **{k: v for k, v in candidate.md5.items() if k in original.md5}}
        if all(actual[name] == expected[name] for name in original.md5):
            return candidate
    return None


def _mismatch(
    folder: Path, actual: Mapping[str, str | None], original: ChecksumList, candidates: list[ChecksumList]
) -> str:
    problems = []
    for name, md5 in original.md5.items():
        if actual[name] is None:
            problems.append(f"{name} is missing")
        elif all(actual[name] != candidate.md5.get(name, md5) for candidate in candidates):
            problems.append(f"{name} has md5 {actual[name]}")
    lists = " nor ".join(candidate.origin for candidate in candidates)
    return f"{folder} matches neither {lists} ({'; '.join(problems[:2]) or 'files from different copies'})"


def _fix_mismatch(family: str) -> str:
    archive = "cifar-10-python.tar.gz" if family == "cifar10" else "cifar-100-python.tar.gz"
    return f"re-extract {archive} there, pass --checksums FILE listing this copy's md5s, or add --download"


def _md5(path: Path) -> str | None:
    if not path.is_file():
        return None
    digest = hashlib.md5(usedforsecurity=False)
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
