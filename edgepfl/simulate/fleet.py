"""A simulated fleet on a virtual clock (`edgepfl simulate --fleet SPEC`): devices that differ in speed, go off
and on, and drop out of rounds.

SPEC is comma-separated `key:value` parts, e.g. `dropout:0.3,speed:lognormal:1.0,online:exp:600/120,seed:0`:

- `dropout:P` - a device asked to train (sampled in a sync round, or starting a task under fedbuff) drops out with
  probability P before it uploads: a closed tab, a locked screen, a train in a tunnel.
- `speed:const` (every device 1.0) or `speed:lognormal:SIGMA` - each device's speed factor, drawn once:
  exp(N(0, SIGMA^2)), median 1; a device's training time is its factor times its work.
- `online:always` or `online:exp:ON/OFF` - each device alternates online and offline periods, exponential with
  means ON and OFF virtual seconds (it starts online with probability ON / (ON + OFF)); a device offline when a
  round samples or a task would start is not available, and one that goes offline while training drops out.
- `sample-time:S` - virtual seconds one training sample takes at speed 1.0 (default 0.01: a phone at 100
  images a second); a round's work is the samples it trains (`epochs x train samples`, plus fine-tuning).
- `seed:N` - the fleet's own seed (default: the run's --seed).

Everything is drawn from the fleet's seed, per device and per task, never from the order of events, so the same
seed and the same event order give the same run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from edgepfl.errors import UsageError

SPEC_EXAMPLE = "dropout:0.3,speed:lognormal:1.0,online:exp:600/120,seed:0"


@dataclass(frozen=True)
class FleetSpec:
    """A parsed --fleet SPEC."""

    dropout: float = 0.0
    speed_sigma: float = 0.0  # 0: every device at speed 1.0
    online: tuple[float, float] | None = None  # mean online and offline seconds; None: always online
    sample_time: float = 0.01
    seed: int | None = None

    @classmethod
    def parse(cls, text: str) -> FleetSpec:
        """Parse SPEC; one UsageError line naming the part that is wrong."""
        values: dict = {}
        for part in (piece.strip() for piece in text.split(",")):
            if not part:
                continue
            key, _, rest = part.partition(":")
            try:
                values.update(_part(key, rest))
            except (ValueError, IndexError):
                raise UsageError(
                    f"--fleet part {part!r} is not understood", f"write e.g. --fleet {SPEC_EXAMPLE}"
                ) from None
        return cls(**values)

    def label(self) -> str:
        """SPEC in its one spelling (results.json records it)."""
        parts = [f"dropout:{self.dropout:g}"]
        parts.append(f"speed:lognormal:{self.speed_sigma:g}" if self.speed_sigma else "speed:const")
        parts.append(f"online:exp:{self.online[0]:g}/{self.online[1]:g}" if self.online else "online:always")
        parts.append(f"sample-time:{self.sample_time:g}")
        if self.seed is not None:
            parts.append(f"seed:{self.seed}")
        return ",".join(parts)


def _part(key: str, rest: str) -> dict:
    if key == "dropout":
        value = float(rest)
        if not 0.0 <= value < 1.0:
            raise ValueError
        return {"dropout": value}
    if key == "speed":
        kind, _, sigma = rest.partition(":")
        if kind == "const" and not sigma:
            return {"speed_sigma": 0.0}
        if kind == "lognormal" and float(sigma) >= 0 and math.isfinite(float(sigma)):
            return {"speed_sigma": float(sigma)}
        raise ValueError
    if key == "online":
        if rest == "always":
            return {"online": None}
        kind, _, means = rest.partition(":")
        on, off = (float(value) for value in means.split("/"))
        if kind != "exp" or not (on > 0 and off > 0 and math.isfinite(on) and math.isfinite(off)):
            raise ValueError
        return {"online": (on, off)}
    if key == "sample-time":
        value = float(rest)
        if not (value > 0 and math.isfinite(value)):
            raise ValueError
        return {"sample_time": value}
    if key == "seed":
        value = int(rest)
        if value < 0:
            raise ValueError
        return {"seed": value}
    raise ValueError


@dataclass
class Availability:
    """One device's alternating online and offline periods, drawn lazily from its own RNG."""

    online_mean: float
    offline_mean: float
    rng: np.random.Generator
    _changes: list[float] = field(default_factory=list)  # times at which the state flips, ascending
    _starts_online: bool = True

    def __post_init__(self) -> None:
        self._starts_online = bool(self.rng.random() < self.online_mean / (self.online_mean + self.offline_mean))
        self._changes = []

    def online_at(self, time: float) -> bool:
        """Whether the device is online at virtual time `time`."""
        self._extend(time)
        flips = int(np.searchsorted(self._changes, time, side="right"))
        return self._starts_online == (flips % 2 == 0)

    def online_through(self, start: float, end: float) -> bool:
        """Whether the device stays online from `start` to `end`."""
        if not self.online_at(start):
            return False
        self._extend(end)
        first = int(np.searchsorted(self._changes, start, side="right"))
        return first >= len(self._changes) or self._changes[first] > end

    def next_online(self, time: float) -> float:
        """The first time at or after `time` the device is online."""
        if self.online_at(time):  # which also draws the periods past `time`
            return time
        return self._changes[int(np.searchsorted(self._changes, time, side="right"))]  # offline: the next flip

    def _extend(self, time: float) -> None:
        while not self._changes or self._changes[-1] <= time:
            online = self._starts_online == (len(self._changes) % 2 == 0)
            mean = self.online_mean if online else self.offline_mean
            last = self._changes[-1] if self._changes else 0.0
            self._changes.append(last + float(self.rng.exponential(mean)))


class Fleet:
    """The simulated devices' speeds, availability and dropouts, all drawn from the fleet's seed."""

    def __init__(self, spec: FleetSpec, names: list[str], seed: int):
        self.spec = spec
        self.seed = spec.seed if spec.seed is not None else seed
        self.names = list(names)
        self.speed = {}
        self._availability: dict[str, Availability] = {}
        for number, name in enumerate(self.names):
            rng = np.random.default_rng([self.seed, number, 1])
            self.speed[name] = float(np.exp(rng.normal(0.0, spec.speed_sigma))) if spec.speed_sigma else 1.0
            if spec.online is not None:
                online, offline = spec.online
                availability_rng = np.random.default_rng([self.seed, number, 2])
                self._availability[name] = Availability(online, offline, availability_rng)
        self._index = {name: number for number, name in enumerate(self.names)}

    def online(self, name: str, time: float) -> bool:
        """Whether a device is online at `time`."""
        availability = self._availability.get(name)
        return availability is None or availability.online_at(time)

    def next_online(self, name: str, time: float) -> float:
        """When a device is next online (now, if it is)."""
        availability = self._availability.get(name)
        return time if availability is None else availability.next_online(time)

    def training_time(self, name: str, samples: int) -> float:
        """Virtual seconds a device takes to train on `samples` samples."""
        return self.speed[name] * samples * self.spec.sample_time

    def completes(self, name: str, task: int, start: float, end: float) -> bool:
        """Whether a device's task `task` (a round id, or its n-th fedbuff task) started at `start` ends with an
        upload at `end`: it neither drops out (the spec's probability, drawn per device and task) nor goes
        offline in between."""
        rng = np.random.default_rng([self.seed, self._index[name], 3, task])
        if rng.random() < self.spec.dropout:
            return False
        availability = self._availability.get(name)
        return availability is None or availability.online_through(start, end)
