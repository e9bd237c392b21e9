"""The operator's secure-aggregation settings and the per-round plan made of them: n, neighbours k, thresholds.

Each device's secrets are Shamir-shared within its *group*: itself and its k neighbours in the round's graph
(k = n - 1, every other device, is classic SecAgg; smaller k is SecAgg+, Bell et al. CCS 2020). A group's
threshold is t = max(2, ceil(threshold * (k + 1))); a round needs at least max(t, ceil(threshold * n))
masked uploads. Classic SecAgg therefore finishes whenever at most n - t devices drop, at any step after the
keys are advertised.

`neighbours="auto"` picks the smallest even k for which, with `dropout * n` devices dropping at random and
`collusion * n` devices colluding with the server at random (defaults: half of classic SecAgg's margins,
(1 - threshold) / 2 and threshold / 2), a union bound over the n groups gives:
- correctness: P(some group has fewer than t members left) <= 2^-20;
- privacy: P(some honest device has t colluding group members) <= 2^-40, and P(some run of k/2 consecutive
  devices of the graph's ring all dropped or colluding, which is what it takes to split the honest
  survivors into parts the server could sum separately) <= 2^-40.
When no k < n - 1 does, the round runs classic SecAgg.

The ring Z/2^b: by default b = 1 + bit_length(127 n) (at least 8), so each device's values keep int8's
resolution (q >= 127 levels each side of 0, edgepfl.secagg.quantize) and n of them cannot wrap the ring; a
smaller `bits` trades that resolution for upload bytes (b bits per value).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from edgepfl.errors import SecAggError
from edgepfl.secagg.ring import MIN_BITS, check_bits

MIN_DEVICES = 3
INT8_LEVELS = 127
ROTATION_BLOCK = 1024
CORRECTNESS_BITS = 20
PRIVACY_BITS = 40


@dataclass(frozen=True)
class SecAggConfig:
    """Secure aggregation's settings; every device of a round gets them in the key book."""

    clip_norm: float  # L2 norm each device clips its delta to before quantizing (DP's clip or a SecAgg clip)
    threshold: float = 0.5  # share threshold and minimum of masked uploads, as a fraction of group / cohort
    neighbours: int | str = "auto"  # "auto" (SecAgg+), "all" (classic SecAgg) or an even k
    dropout: float | None = None  # auto k: random dropout fraction to withstand; None: (1 - threshold) / 2
    collusion: float | None = None  # auto k: colluding fraction to withstand; None: threshold / 2
    bits: int | None = None  # ring Z/2^bits, the masked upload's bits per value; None: int8 resolution (below)
    max_weight: int = 1000  # sample counts are capped here (the weight's digits in the ring hold up to this)
    coordinate_sigmas: float = 4.0  # after rotation each value is clipped at this many C / sqrt(d)
    weight_scale: float | None = None  # W: a device adds clip(w / W * delta, C); None: W = max_weight

    @property
    def scale_weight(self) -> float:
        """W, the weight a device's delta is divided by before it is clipped to C and quantized."""
        return float(self.max_weight) if self.weight_scale is None else self.weight_scale

    def __post_init__(self) -> None:
        checks = [
            (math.isfinite(self.clip_norm) and self.clip_norm > 0, "the clip norm must be above 0", "pass e.g. 1.0"),
            (0 < self.threshold <= 1, "the threshold must be in (0, 1]", "pass a fraction, e.g. 0.5"),
            (
                self.neighbours in ("auto", "all")
                or (isinstance(self.neighbours, int) and self.neighbours >= 2 and self.neighbours % 2 == 0),
                f"neighbours {self.neighbours!r} is not auto, all or an even number >= 2",
                "pass auto, all or e.g. 20",
            ),
            (self.dropout is None or 0 <= self.dropout < 1, "the dropout fraction must be in [0, 1)", "pass e.g. 0.2"),
            (
                self.collusion is None or 0 <= self.collusion < 1,
                "the collusion fraction must be in [0, 1)",
                "pass e.g. 0.1",
            ),
            (
                isinstance(self.max_weight, int) and 1 <= self.max_weight < 1 << 31,
                "max_weight must be an int >= 1",
                "pass about the largest sample count of a device, e.g. 1000",
            ),
            (
                math.isfinite(self.coordinate_sigmas) and self.coordinate_sigmas > 0,
                "coordinate_sigmas must be above 0",
                "pass e.g. 4",
            ),
            (
                self.weight_scale is None
                or (
                    isinstance(self.weight_scale, int | float)
                    and math.isfinite(self.weight_scale)
                    and self.weight_scale > 0
                ),
                "weight_scale must be above 0",
                "pass about a device's mean sample count, or None",
            ),
        ]
        for ok, problem, fix in checks:
            if not ok:
                raise SecAggError(f"secure aggregation: {problem}", fix)
        if self.bits is not None:
            check_bits(self.bits)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SecAggConfig:
        """Read what `to_dict` wrote; anything else is a SecAggError (in one line: a field it does not know is named
        as Python writes the string, so a sender's newline or control character is never printed as it is)."""
        if not isinstance(data, dict):
            raise SecAggError("secure aggregation settings are not an object", "send SecAggConfig fields")
        unknown = sorted(repr(key) for key in set(data) - {f.name for f in fields(cls)})
        if unknown:
            named = ", ".join(unknown)
            raise SecAggError(
                f"secure aggregation settings have fields SecAggConfig does not know: {named[:200]}",
                "send SecAggConfig fields only",
            )
        try:
            return cls(**data)
        except (TypeError, OverflowError) as exc:  # OverflowError: an integer too large for a float
            reason = " ".join(str(exc).split())
            problem = f"secure aggregation settings cannot be read ({reason})"
            raise SecAggError(problem, "send SecAggConfig fields") from None


@dataclass(frozen=True)
class Plan:
    """One round's numbers: n devices, k neighbours each, group threshold t, the uploads it needs at least."""

    devices: int
    neighbours: int
    threshold: int
    min_survivors: int
    bits: int  # the ring's width for this n

    @property
    def classic(self) -> bool:
        """Every device is every other's neighbour (Bonawitz et al. 2017)."""
        return self.neighbours == self.devices - 1


def make_plan(devices: int, config: SecAggConfig) -> Plan:
    """The plan for `devices` advertised key pairs (module docstring); fewer than 3 devices is a SecAggError."""
    if devices < MIN_DEVICES:
        raise SecAggError(
            f"only {devices} devices advertised keys; secure aggregation needs at least {MIN_DEVICES}",
            "sample more devices for the round or wait for more to join",
        )
    if config.neighbours == "all":
        k = devices - 1
    elif config.neighbours == "auto":
        k = auto_neighbours(devices, config)
    else:
        k = min(int(config.neighbours), devices - 1)
    return plan_for(devices, k, config)


def plan_for(devices: int, neighbours: int, config: SecAggConfig) -> Plan:
    """The plan of a round of `devices` with `neighbours` each (k >= n - 2 becomes classic, k = n - 1)."""
    k = devices - 1 if neighbours >= devices - 2 else neighbours
    t = max(2, math.ceil(config.threshold * (k + 1)))
    bits = ring_bits(devices) if config.bits is None else config.bits
    levels(devices, bits)  # refuses a ring too small for n devices
    return Plan(devices, k, t, max(t, math.ceil(config.threshold * devices)), bits)


def ring_bits(devices: int) -> int:
    """The default ring width: every device keeps int8's resolution, q >= 127 levels each side of 0."""
    return max(MIN_BITS, 1 + (INT8_LEVELS * devices).bit_length())


def levels(devices: int, bits: int) -> int:
    """q: each value quantizes to an integer in [-q, q], so that n of them cannot wrap the ring."""
    q = ((1 << (bits - 1)) - 1) // devices
    if q < 1:
        raise SecAggError(
            f"a ring of {bits} bits cannot sum {devices} devices", f"use at least {(2 * devices + 1).bit_length()} bits"
        )
    return q


def weight_digits(devices: int, bits: int, max_weight: int) -> tuple[int, int]:
    """(base, count): a weight travels as `count` digits in `base`, so that n of them cannot wrap the ring."""
    base = ((1 << bits) - 1) // devices + 1
    count = 1
    while base**count <= max_weight:
        count += 1
    return base, count


def rotation_block(size: int) -> int:
    """The Walsh-Hadamard block for d values: 1024, or the next power of two >= d when d is smaller."""
    return min(ROTATION_BLOCK, 1 << max(size - 1, 0).bit_length())


def padded_size(size: int) -> int:
    """d': d values rounded up to whole rotation blocks (padding costs under one block)."""
    return -(-size // rotation_block(size)) * rotation_block(size)


def ring_length(size: int, plan: Plan, config: SecAggConfig) -> int:
    """Elements of a masked vector for d values: d' slots and the weight's digits."""
    return padded_size(size) + weight_digits(plan.devices, plan.bits, config.max_weight)[1]


def check_plan(plan: Plan, config: SecAggConfig) -> None:
    """A device's check of the server's plan: the thresholds follow from n, k and the threshold fraction."""
    k_ok = plan.neighbours == plan.devices - 1 or (plan.neighbours % 2 == 0 and 2 <= plan.neighbours < plan.devices - 2)
    if config.neighbours == "all" and plan.neighbours != plan.devices - 1:
        k_ok = False
    if not k_ok or plan != plan_for(plan.devices, plan.neighbours, config):
        raise SecAggError(
            f"the server's plan {plan} does not follow from its settings (threshold "
            f"{config.threshold}, neighbours {config.neighbours})",
            "the server must send a consistent key book",
        )


def auto_neighbours(devices: int, config: SecAggConfig) -> int:
    """The smallest even k meeting the bounds of the module docstring, or n - 1 (classic) when none does."""
    n = devices
    dropped = math.floor(n * ((1 - config.threshold) / 2 if config.dropout is None else config.dropout))
    colluding = math.floor(n * (config.threshold / 2 if config.collusion is None else config.collusion))
    removed = min(n, dropped + colluding)
    for k in range(2, n - 2, 2):
        t = max(2, math.ceil(config.threshold * (k + 1)))
        short = _log_hypergeom_cdf(n, n - dropped, k + 1, t - 1)  # fewer than t of the group left
        collude = _log_hypergeom_sf(n - 1, colluding, k, t)  # t or more colluding neighbours
        cut = _log_all_chosen(n, removed, k // 2)  # k/2 given devices all removed
        if math.log(n) + short <= -CORRECTNESS_BITS * math.log(2) and math.log(n) + max(
            collude, cut
        ) <= -PRIVACY_BITS * math.log(2):
            return k
    return n - 1


def _log_comb(n: int, k: int) -> float:
    return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) if 0 <= k <= n else -math.inf


def _log_sum(logs: list[float]) -> float:
    top = max(logs, default=-math.inf)
    return top if top == -math.inf else top + math.log(sum(math.exp(x - top) for x in logs))


def _log_hypergeom_cdf(population: int, marked: int, draws: int, at_most: int) -> float:
    """log P(X <= at_most), X the marked count among `draws` drawn without replacement."""
    total = _log_comb(population, draws)
    return _log_sum(
        [
            _log_comb(marked, x) + _log_comb(population - marked, draws - x) - total
            for x in range(0, min(at_most, draws) + 1)
        ]
    )


def _log_hypergeom_sf(population: int, marked: int, draws: int, at_least: int) -> float:
    """log P(X >= at_least)."""
    total = _log_comb(population, draws)
    return _log_sum(
        [
            _log_comb(marked, x) + _log_comb(population - marked, draws - x) - total
            for x in range(at_least, min(marked, draws) + 1)
        ]
    )


def _log_all_chosen(population: int, chosen: int, run: int) -> float:
    """log P(`run` given members all among `chosen` drawn at random)."""
    return _log_comb(population - run, chosen - run) - _log_comb(population, chosen) if chosen >= run else -math.inf


FIRST_CLIP = 10.0  # round 1's clip when neither DP nor --secagg-clip sets it and nothing is measured yet
FIRST_WEIGHT_SCALE = 1000.0  # round 1's weight scale W when nothing is measured yet
CLIP_MARGIN = 4.0  # a measured clip: this many times the norm of the previous round's mean delta
# sample counts are capped here when the weight scale is measured (DP: every device weighs 1): the most two weight
# digits carry at every n's default bits (min over n of B^2 - 1), so the masked vector is no longer than with 1000
WEIGHT_CAP = 65024


@dataclass(frozen=True)
class Measured:
    """Which of a round's settings follow the previous round's public sum, not a flag: the clip, the weight scale."""

    clip: bool
    weight: bool

    def next_config(
        self, config: SecAggConfig, mean_delta_norm: float, total_weight: int, devices: int
    ) -> SecAggConfig:
        """The next round's settings from this round's unmasked sum: C = CLIP_MARGIN |mean delta|, W = mean weight.

        Both are functions of the sum every device's key book already reveals to the server, so nothing of one
        device is learnt; a zero or non-finite measure keeps the round's value."""
        clip, scale = config.clip_norm, config.weight_scale
        if self.clip and math.isfinite(mean_delta_norm) and mean_delta_norm > 0:
            clip = CLIP_MARGIN * mean_delta_norm
        if self.weight and devices > 0 and total_weight > 0:
            scale = total_weight / devices
        return SecAggConfig(**{**config.to_dict(), "clip_norm": clip, "weight_scale": scale})
