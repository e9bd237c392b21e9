"""Sensor windows: fixed windows of named motion channels over time, from an .npz or a CSV of readings.

An .npz holds `x` (N, C, T) readings, `y` (N,) labels and `channels` (C names); a CSV (docs/device.md) has a header
`window,label,<channel>,...`, then one row per reading, T consecutive rows per window. The channels must be the
bundle's, by name and in its order. Windows are normalised per channel with the manifest's mean and std.

The manifest also names each channel's unit and the step between windows' starts, so that whoever records a phone's
motion for the model (the browser device's recorder, an operator's own app) converts and cuts it as its training data
was: a channel named acc-x|y|z is the accelerometer's axis (with gravity), gyro-x|y|z the gyroscope's; `from_motion`
turns readings in SI units (m/s², rad/s) into the model's channels and units, the page's src/resample.js the same way
(a fixture pins both).
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from edgepfl.errors import DataError, UsageError
from edgepfl.kinds.base import NPZ, DeviceSamples, InputSpec, KindWords, SampleKind, read_npz, require, standardized
from edgepfl.text import read_text

CSV_COLUMNS = ("window", "label")  # the columns before the channels in a sensor CSV
STANDARD_GRAVITY = 9.80665  # m/s² per g
# each unit's value of one SI unit of a sensor's reading (m/s² of acceleration, rad/s of rotation)
UNITS = {
    "acc": {"g": 1 / STANDARD_GRAVITY, "m/s^2": 1.0, "m/s2": 1.0, "m/s²": 1.0},
    "gyro": {"rad/s": 1.0, "deg/s": 180 / math.pi},
}
HAPT_UNITS = {"acc": "g", "gyro": "rad/s"}  # UCI HAPT's, and a channel's when its bundle names none
MOTION_CHANNEL = re.compile(r"(acc|accel|accelerometer|gyro|gyroscope)[-_. ]?([xyz])", re.IGNORECASE)


@dataclass(frozen=True, kw_only=True)
class SensorKind(SampleKind):
    """An activity model's samples: windows of `window` readings of each named channel, sampled at `rate_hz`."""

    name: ClassVar[str] = "sensor"
    words: ClassVar[KindWords] = KindWords("window", "windows", "an .npz or .csv of windows")
    described: ClassVar[str] = "sensor windows"
    model_file: ClassVar[dict[str, str]] = {
        "input_layout": "CT",
        "resize": "none",
        "normalization": "x = (value - mean[c]) / std[c] per channel, channels x time",
    }

    channels: tuple[str, ...] = ()
    window: int = 0
    rate_hz: float = 0.0
    units: tuple[str, ...] = ()  # each channel's unit ("g", "rad/s"); bundles before it: HAPT's by channel name
    step: int = 0  # readings from one window's start to the next's; bundles before it: half a window, HAPT's

    @classmethod
    def of(
        cls,
        channels: Sequence[str],
        window: int,
        rate_hz: float,
        mean=(),
        std=(),
        units: Sequence[str] | None = None,
        step: int | None = None,
    ) -> SensorKind:
        """The kind of windows of `window` readings of `channels` at `rate_hz`, normalised with `mean` and `std`, in
        `units` (default: HAPT's for motion channels, '' for others), cut every `step` readings (default: half a
        window, HAPT's overlap)."""
        spec = InputSpec(shape=(len(channels), window), dtype="float32", mean=tuple(mean), std=tuple(std))
        units = tuple(units) if units is not None else tuple(default_unit(name) for name in channels)
        if len(units) != len(channels):
            raise UsageError(f"{len(units)} units for {len(channels)} channels", "name one unit a channel")
        return cls(
            input=spec,
            channels=tuple(channels),
            window=window,
            rate_hz=rate_hz,
            units=units,
            step=step or max(window // 2, 1),
        )

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any], input_spec: InputSpec, num_classes: int) -> SensorKind:
        """A sensor bundle's kind: its channels in input order, the window's length and the sampling rate."""
        kind = cls(
            input=input_spec,
            channels=tuple(str(name) for name in entry["channels"]),
            window=int(entry.get("window") or input_spec.shape[-1]),
            rate_hz=float(entry.get("rate_hz") or 0.0),
            units=tuple(str(unit) for unit in entry.get("units") or ()),
            step=int(entry.get("step") or 0),
        )
        shape = (len(kind.channels), kind.window)
        require(input_spec.shape == shape, f"a sensor model over {shape} windows takes input {input_spec.shape}")
        require(not kind.units or len(kind.units) == len(kind.channels), "the sensor entry names one unit a channel")
        return kind

    def entry(self) -> dict[str, Any]:
        """What a sensor bundle's manifest says of its windows (units and step where it names them)."""
        entry: dict[str, Any] = {
            "kind": self.name,
            "channels": list(self.channels),
            "window": self.window,
            "rate_hz": self.rate_hz,
        }
        if self.units:
            entry["units"] = list(self.units)
        if self.step:
            entry["step"] = self.step
        return entry

    def from_motion(self, acceleration: np.ndarray, rotation: np.ndarray) -> np.ndarray:
        """The model's channels (C, N) float32 in its units, of N readings of a phone's accelerometer with gravity
        (m/s², device axes x, y, z) and gyroscope (rad/s); a channel no motion sensor gives is one DataError."""
        readings = {"acc": np.asarray(acceleration, np.float64), "gyro": np.asarray(rotation, np.float64)}
        rows = []
        for i, name in enumerate(self.channels):
            match = MOTION_CHANNEL.fullmatch(name.strip())
            if not match:
                raise DataError(f"the channel {name!r} is not a phone's motion", "record it some other way")
            stream = "acc" if match[1].lower().startswith("acc") else "gyro"
            unit = self.units[i] if self.units else HAPT_UNITS[stream]
            if unit not in UNITS[stream]:
                raise DataError(f"{name!r} is in {unit}, which edgepfl cannot convert to", "record it some other way")
            rows.append(readings[stream][:, "xyz".index(match[2].lower())] * UNITS[stream][unit])
        return np.asarray(rows, dtype=np.float32)

    def check_inputs(self, x: np.ndarray, what: str = "x") -> np.ndarray:
        """(N, C, T) finite readings of exactly the model's channels and window."""
        windows = np.asarray(x)
        channels, steps = self.input.shape
        if windows.ndim == 3 and windows.shape[1] != channels:
            raise DataError(
                f"{what} has {windows.shape[1]} channel(s) per window, the model takes {channels}",
                "record the channels the bundle names (manifest.json: sample.channels)",
            )
        if windows.ndim == 3 and windows.shape[2] != steps:
            raise DataError(
                f"{what} windows are {windows.shape[2]} samples long, the model takes {steps}",
                f"cut the recordings into windows of {steps} samples",
            )
        if windows.ndim != 3:
            raise DataError(
                f"{what} has shape {tuple(windows.shape)}, expected (N, {channels}, {steps})", "save x as (N, C, T)"
            )
        check_readings(windows, what)
        return windows

    def normalize(self, x: np.ndarray) -> np.ndarray:
        """float32 (x - mean) / std per channel."""
        return standardized(x, self.input)

    def read(self, path: Path, bundle: Path, class_labels: Sequence[str]) -> DeviceSamples:
        """Windows from an .npz or a CSV, their channels checked against the bundle's."""
        if not path.is_file():
            raise DataError(f"data path {path} is not a file", f"pass {self.words.data}")
        if path.suffix.lower() == ".csv":
            x, y, channels = self.read_csv(path, class_labels)
        elif path.suffix.lower() == NPZ:
            x, y, names = read_npz(path, ("x", "y", "channels"))
            channels = [str(name) for name in np.asarray(names).reshape(-1)]
        else:
            raise DataError(f"{path} is neither .npz nor .csv", "save the windows as .npz (x, y, channels) or CSV")
        self.check_channels(channels, str(path))
        return DeviceSamples(x, y)

    def check_channels(self, channels: list[str], source: str) -> None:
        """Refuse, in one line, channels other than the bundle's (by name, in its order)."""
        expected = list(self.channels)
        if channels == expected:
            return
        missing = [name for name in expected if name not in channels]
        extra = [name for name in channels if name not in expected]
        if missing or extra:
            problem = f"lacks channel {missing[0]!r}" if missing else f"has channel {extra[0]!r}, which the model lacks"
            raise DataError(
                f"{source} {problem} (the model reads {', '.join(expected)})", "record the bundle's channels"
            )
        raise DataError(
            f"{source} has the model's channels in another order ({', '.join(channels)})",
            f"order them as the bundle does: {', '.join(expected)}",
        )

    def read_csv(self, path: Path, class_labels: Sequence[str]) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """Windows (N, C, T) float32, labels (N,) and channel names of a sensor CSV (docs/device.md)."""
        rows = list(csv.reader(io.StringIO(read_text(path))))
        if not rows or [cell.strip() for cell in rows[0][:2]] != list(CSV_COLUMNS):
            raise DataError(
                f"{path} does not start with the header window,label,<channel>,...", "write the header row first"
            )
        channels = [cell.strip() for cell in rows[0][2:]]
        self.check_channels(channels, str(path))
        classes = {name: index for index, name in enumerate(class_labels)}
        windows: dict[str, list[list[str]]] = {}
        for number, row in enumerate(rows[1:], start=2):
            if not any(cell.strip() for cell in row):
                continue
            if len(row) != len(rows[0]):
                raise DataError(
                    f"{path} line {number} has {len(row)} cells, the header {len(rows[0])}", "fill every cell"
                )
            windows.setdefault(row[0].strip(), []).append(row)
        if not windows:
            raise DataError(f"{path} holds no readings", "add one row per reading under the header")
        x, y = [], []
        for window, readings in windows.items():
            if len(readings) != self.window:
                raise DataError(
                    f"{path}: window {window} has {len(readings)} readings, the model takes {self.window}",
                    f"cut the recording into windows of {self.window} readings",
                )
            labels = {row[1].strip() for row in readings}
            if len(labels) != 1:
                raise DataError(f"{path}: window {window} has more than one label", "give each window one label")
            label = labels.pop()
            if label not in classes and not label.isdigit():
                raise DataError(f"{path}: window {window} has label {label!r}", f"use one of: {', '.join(classes)}")
            try:
                values = np.array([[float(cell) for cell in row[2:]] for row in readings], dtype=np.float32)
            except ValueError:
                raise DataError(
                    f"{path}: window {window} has a reading that is not a number", "write numbers"
                ) from None
            x.append(values.T)
            y.append(classes.get(label, int(label) if label.isdigit() else -1))
        return np.stack(x), np.asarray(y, dtype=np.int64), channels


def default_unit(channel: str) -> str:
    """HAPT's unit of a motion channel (g for acc-*, rad/s for gyro-*), '' for a channel of another sensor."""
    match = MOTION_CHANNEL.fullmatch(channel.strip())
    return "" if not match else HAPT_UNITS["acc" if match[1].lower().startswith("acc") else "gyro"]


def check_readings(x: np.ndarray, what: str = "x") -> None:
    """Finite real sensor readings; NaN, Inf or non-numbers are refused with the fix."""
    if x.dtype.kind not in "iuf":
        raise DataError(f"{what} has dtype {x.dtype}, sensor readings are numbers", "save the readings as float32")
    if x.dtype.kind == "f" and x.size and not np.isfinite(x).all():
        window = int(np.flatnonzero(~np.isfinite(x).reshape(len(x), -1).all(axis=1))[0])
        raise DataError(
            f"{what} window {window} holds NaN or Inf readings",
            "drop or fill the gaps in the recording (e.g. interpolate) before cutting windows",
        )
