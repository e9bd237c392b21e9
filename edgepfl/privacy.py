"""User-level differential privacy (DP-FedAvg, McMahan et al. 2018): clip, check, noise, estimate, account.

The mechanism, per round: every sampled device clips its base delta to L2 norm C (`clip_delta`); the server
refuses a larger one (`check_delta_norm`), sums the deltas unweighted, adds Gaussian noise of standard
deviation sigma*C to the sum and divides by a fixed denominator (`dp_aggregate`, `fixed_denominator`).
The accountant (`PrivacyLedger`, on Google's `dp-accounting`, extra `edgepfl[privacy]`) turns the rounds
done into epsilon at the operator's delta for the sampling actually used.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, Field, model_validator

from edgepfl.capabilities import either, needs_of, strategies_where
from edgepfl.errors import StateError, UsageError, WireError
from edgepfl.options import titled

SAMPLINGS = ("poisson", "fixed")
NORM_TOLERANCE = 1e-6  # relative: two machines may sum the same float32 squares in a different order


class PrivacyOptions(BaseModel):
    """User-level DP-FedAvg (McMahan et al. 2018): clip on the device, Gaussian noise on the server's sum."""

    model_config = titled("Differential privacy")

    dp_noise_multiplier: Annotated[
        float | None,
        Field(gt=0.0, allow_inf_nan=False, description="DP: noise sigma, in units of the clip norm; turns DP on"),
    ] = None
    dp_clip: Annotated[
        float | None,
        Field(gt=0.0, allow_inf_nan=False, description="DP: L2 norm C each device clips its base delta to"),
    ] = None
    dp_delta: Annotated[
        float, Field(gt=0.0, lt=1.0, description="DP: the delta epsilon is reported at (below 1/devices)")
    ] = 1e-5
    dp_target_epsilon: Annotated[
        float | None,
        Field(gt=0.0, allow_inf_nan=False, description="DP: stop before a round would take epsilon above this"),
    ] = None

    @model_validator(mode="after")
    def _together(self) -> PrivacyOptions:
        if (self.dp_noise_multiplier is None) != (self.dp_clip is None):
            raise UsageError(
                "--dp-noise-multiplier and --dp-clip go together",
                "pass both to turn differential privacy on, e.g. --dp-noise-multiplier 1.0 --dp-clip 1.0",
            )
        if self.dp_target_epsilon is not None and not self.enabled:
            raise UsageError("--dp-target-epsilon needs DP on", "pass --dp-noise-multiplier and --dp-clip too")
        return self

    @property
    def enabled(self) -> bool:
        """Whether DP-FedAvg is on."""
        return self.dp_noise_multiplier is not None

    @property
    def clip_norm(self) -> float | None:
        """The L2 norm devices clip their delta to (None: DP off)."""
        return self.dp_clip if self.enabled else None

    def dp_config(self) -> DPConfig | None:
        """The privacy module's settings (None: DP off)."""
        if self.dp_noise_multiplier is None or self.dp_clip is None:
            return None
        return DPConfig(self.dp_noise_multiplier, self.dp_clip, self.dp_delta, self.dp_target_epsilon)


@dataclass(frozen=True)
class DPConfig:
    """The operator's DP settings: --dp-noise-multiplier, --dp-clip, --dp-delta, --dp-target-epsilon."""

    noise_multiplier: float
    clip_norm: float
    delta: float = 1e-5
    target_epsilon: float | None = None

    def new_ledger(self, strategy: str, sampling: str) -> PrivacyLedger:
        """Check these settings against the strategy and sampler (UsageError, one line) and start a budget."""
        check_dp_strategy(strategy)
        if not self.clip_norm > 0:
            raise UsageError("--dp-clip must be above 0", "pass the L2 norm each delta is clipped to, e.g. 1.0")
        if self.target_epsilon is not None and not self.target_epsilon > 0:
            raise UsageError("--dp-target-epsilon must be above 0", "pass e.g. 8, or leave it out")
        return PrivacyLedger(self.noise_multiplier, self.delta, sampling)


def check_dp_strategy(strategy: str, flag: str = "--strategy") -> None:
    """Refuse, in one line that says why, a strategy DP-FedAvg's noise does not cover (`flag`: the option that chose
    it, e.g. simulate's --algorithm); what it covers follows from the strategy's needs (edgepfl.capabilities)."""
    reason = needs_of(strategy).dp_refusal(strategy)
    if reason is None:
        return
    covered = either(strategies_where(lambda needs: needs.dp_refusal("") is None))
    raise UsageError(
        f"differential privacy cannot run with {flag} {strategy}: {reason}",
        f"use {flag} {covered} with DP, or drop the --dp-* options",
    )


NORM_CHUNK = 1 << 16  # elements per pass of delta_norm: its scratch stays in cache, O(chunk) not O(tensor)


def delta_norm(delta: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray] | None = None) -> float:
    """Global L2 norm of a delta over its float tensors, in name order: of `delta` itself, or of `delta - base` (an
    upload against the base it was trained on) without making the difference tensor.

    Computed in chunks through one small float64 scratch buffer (differences and squares in float64, exact for
    float32 inputs to ~1e-12), each chunk's sum by einsum: memory O(chunk) per concurrent upload, where a whole-tensor
    float64 difference held three copies of the largest tensor (~100 MiB at four upload slots for MobileNet x1.0).
    Not np.dot: dot goes to multithreaded OpenBLAS, whose spinning threads made concurrent uploads 5-80x slower on a
    small machine (bench/server.py --quick).
    """
    total = 0.0
    scratch = np.empty(NORM_CHUNK, dtype=np.float64)
    for name in sorted(delta):
        array = np.asarray(delta[name])
        if array.dtype.kind != "f":
            continue
        values = array.reshape(-1)
        sent = np.asarray(base[name]).reshape(-1) if base is not None else None
        for start in range(0, values.size, NORM_CHUNK):
            stop = min(start + NORM_CHUNK, values.size)
            part = scratch[: stop - start]
            if sent is None:
                part[:] = values[start:stop]
            else:
                np.subtract(values[start:stop], sent[start:stop], out=part)
            total += float(np.einsum("i,i->", part, part))
    return math.sqrt(total)


def clip_delta(delta: Mapping[str, np.ndarray], clip_norm: float) -> dict[str, np.ndarray]:
    """Scale a delta to global L2 norm <= clip_norm (unchanged when already inside); float32 out."""
    norm = delta_norm(delta)
    # the margin absorbs the float32 rounding of each scaled value (relative 2**-24)
    factor = 1.0 if norm <= clip_norm else clip_norm / norm * (1 - 2.0**-20)
    return {name: (np.asarray(value, dtype=np.float64) * factor).astype(np.float32) for name, value in delta.items()}


def check_delta_norm(delta: Mapping[str, np.ndarray], clip_norm: float, what: str = "upload") -> float:
    """Return a received delta's norm; one WireError line when it exceeds clip_norm (tiny relative tolerance)."""
    norm = delta_norm(delta)
    if not norm <= clip_norm * (1 + NORM_TOLERANCE):
        raise WireError(
            f"{what} delta has L2 norm {norm:.6g}, above the clip norm {clip_norm:g}",
            f"clip the base delta to {clip_norm:g} on the device before encoding it",
        )
    return norm


def fixed_denominator(
    sampling: str, population: int, sample_size: int | None = None, sampling_probability: float | None = None
) -> float:
    """The estimator's denominator: q*N expected devices under Poisson sampling, the sample size m under fixed.

    Fixed, not the number that actually uploaded: dividing by a count that depends on who took part would
    leak through the denominator, and the noise is calibrated to a sum over a known divisor.
    """
    if sampling == "poisson":
        if sampling_probability is None or not 0 < sampling_probability <= 1:
            raise UsageError("Poisson sampling needs a probability in (0, 1]", "pass the per-device sampling rate")
        return sampling_probability * population
    if sampling == "fixed":
        if sample_size is None or not 0 < sample_size <= population:
            raise UsageError("fixed-size sampling needs 0 < m <= N", "pass the number of devices sampled per round")
        return float(sample_size)
    raise UsageError(f"unknown sampling {sampling!r}", f"use one of: {', '.join(SAMPLINGS)}")


def gaussian_noise_like(
    shapes: Mapping[str, tuple[int, ...]], std: float, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """Independent N(0, std^2) noise for each tensor shape, drawn in name order (float64)."""
    return {name: rng.normal(0.0, std, size=shapes[name]) for name in sorted(shapes)}


def dp_aggregate(
    deltas: Iterable[Mapping[str, np.ndarray]],
    clip_norm: float,
    noise_multiplier: float,
    denominator: float,
    rng: np.random.Generator,
) -> dict[str, np.ndarray]:
    """(sum of clipped deltas + N(0, (sigma*C)^2)) / denominator, reading one delta at a time; float32 out.

    Each delta is checked (`check_delta_norm`) and clipped again, so the sum's sensitivity is exactly C even
    within the check's tolerance. `rng` must be seeded from a secret (never the sampling seed): whoever knows
    the noise can subtract it. Every delta must have the same tensors; an empty round is refused.
    """
    total: dict[str, np.ndarray] | None = None
    for delta in deltas:
        check_delta_norm(delta, clip_norm)
        clipped = clip_delta(delta, clip_norm)
        if total is None:
            total = {name: value.astype(np.float64) for name, value in clipped.items()}
        elif set(clipped) != set(total):
            raise WireError("the deltas of one round name different tensors", "upload every shared tensor")
        else:
            for name, value in clipped.items():
                total[name] += value
    if total is None:
        raise UsageError("a DP round needs at least one delta", "close the round only when an upload arrived")
    return noised_mean(total, noise_multiplier * clip_norm, denominator, rng)


def noised_mean(
    total: Mapping[str, np.ndarray], noise_std: float, denominator: float, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """(sum + N(0, noise_std^2)) / denominator per tensor, float32 out: the Gaussian mechanism on a sum (DP-FedAvg's,
    or secure aggregation's unmasked sum, server/secure/strategy.py)."""
    noise = gaussian_noise_like({name: np.shape(value) for name, value in total.items()}, noise_std, rng)
    return {name: ((total[name] + noise[name]) / denominator).astype(np.float32) for name in total}


@dataclass(frozen=True)
class PrivacyLedger:
    """The accountant's state: sigma, delta, sampling, and the rounds done; JSON-serialisable, persist per round.

    `history` is run-length: [[rounds, q]] for Poisson, [[rounds, N, m]] for fixed-size, so a population that
    changes between rounds is accounted exactly. Events (dp-accounting):
    - poisson: PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), add-or-remove-one neighbours (sum sensitivity C).
    - fixed: SampledWithoutReplacementDpEvent(N, m, GaussianDpEvent(sigma / 2)), replace-one neighbours: replacing
      one device's clipped delta moves the sum by up to 2C, so the noise is sigma/2 times that sensitivity.
    Accounting is RDP (dp-accounting's RdpAccountant, default orders): it covers both events and answers in
    milliseconds; dp-accounting's PLD accountant has no sampling-without-replacement event.
    """

    noise_multiplier: float
    delta: float
    sampling: str = "poisson"
    history: tuple[tuple[float, ...], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        checks = [
            (self.noise_multiplier > 0, "--dp-noise-multiplier must be above 0", "pass e.g. 1.0"),
            (0 < self.delta < 1, "--dp-delta must be in (0, 1)", "pass less than 1/number of devices, e.g. 1e-5"),
            (self.sampling in SAMPLINGS, f"unknown sampling {self.sampling!r}", f"use {' or '.join(SAMPLINGS)}"),
        ]
        for ok, problem, fix in checks:
            if not ok:
                raise UsageError(problem, fix)

    @property
    def rounds(self) -> int:
        """Rounds accounted so far."""
        return int(sum(run[0] for run in self.history))

    def record_round(
        self, population: int, sample_size: int | None = None, sampling_probability: float | None = None
    ) -> PrivacyLedger:
        """A new ledger with one more round of this sampling (N devices; m sampled, or probability q)."""
        fixed_denominator(self.sampling, population, sample_size, sampling_probability)  # validates the numbers
        key = (float(sampling_probability),) if self.sampling == "poisson" else (float(population), float(sample_size))
        history = list(self.history)
        if history and tuple(history[-1][1:]) == key:
            history[-1] = (history[-1][0] + 1, *key)
        else:
            history.append((1.0, *key))
        return replace(self, history=tuple(history))

    def dp_event(self, extra_rounds: int = 0) -> Any:
        """The dp-accounting event of every round done (plus `extra_rounds` more like the last one)."""
        dp_event = _dp_accounting().dp_event
        runs = [list(run) for run in self.history]
        if extra_rounds and runs:
            runs.append([extra_rounds, *runs[-1][1:]])
        events = []
        for count, *sampling in runs:
            if self.sampling == "poisson":
                event = dp_event.PoissonSampledDpEvent(sampling[0], dp_event.GaussianDpEvent(self.noise_multiplier))
            else:
                event = dp_event.SampledWithoutReplacementDpEvent(
                    int(sampling[0]), int(sampling[1]), dp_event.GaussianDpEvent(self.noise_multiplier / 2)
                )
            events.append(dp_event.SelfComposedDpEvent(event, int(count)))
        return dp_event.ComposedDpEvent(events)

    def epsilon(self, extra_rounds: int = 0) -> float:
        """Epsilon at this ledger's delta after the rounds done (0.0 before any round)."""
        if not self.history:
            return 0.0
        lib = _dp_accounting()
        relation = lib.NeighboringRelation.REPLACE_ONE if self.sampling == "fixed" else None
        accountant = lib.rdp.RdpAccountant(neighboring_relation=relation or lib.NeighboringRelation.ADD_OR_REMOVE_ONE)
        absl = logging.getLogger("absl")
        level = absl.level
        absl.setLevel(logging.ERROR)  # fractional orders that do not converge are skipped with a warning each
        try:
            accountant.compose(self.dp_event(extra_rounds))
            return float(accountant.get_epsilon(self.delta))
        finally:
            absl.setLevel(level)

    def rounds_left(
        self,
        target_epsilon: float,
        population: int,
        sample_size: int | None = None,
        sampling_probability: float | None = None,
        limit: int = 100_000,
    ) -> int:
        """How many more rounds of this sampling (N; m or q) keep epsilon <= target (capped at `limit`).

        The server's stop rule before opening a round is `rounds_left(target, ..., limit=1) == 1`.
        """
        if target_epsilon <= 0:
            raise UsageError("--dp-target-epsilon must be above 0", "pass e.g. 8")
        following = self.record_round(population, sample_size, sampling_probability)

        @functools.cache  # each answer is one RDP evaluation (~0.1-0.5 s)
        def fits(rounds: int) -> bool:
            spent = self.epsilon() if rounds == 0 else following.epsilon(rounds - 1)
            return spent <= target_epsilon

        if not fits(0):
            return 0
        good, bad = 0, 1  # epsilon grows with the rounds: find a count that does not fit, then bisect
        while bad <= limit and fits(bad):
            good, bad = bad, bad * 2
        if bad > limit:
            if fits(limit):
                return limit
            bad = limit
        while bad - good > 1:
            middle = (good + bad) // 2
            good, bad = (middle, bad) if fits(middle) else (good, middle)
        return good

    def to_json(self) -> str:
        """JSON text to store with the round."""
        return json.dumps(
            {
                "noise_multiplier": self.noise_multiplier,
                "delta": self.delta,
                "sampling": self.sampling,
                "history": [list(run) for run in self.history],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> PrivacyLedger:
        """Read what `to_json` wrote; anything else is a StateError."""
        try:
            data = json.loads(text)
            history = tuple(tuple(float(x) for x in run) for run in data["history"])
            return cls(float(data["noise_multiplier"]), float(data["delta"]), str(data["sampling"]), history)
        except (KeyError, TypeError, ValueError) as exc:
            raise StateError(
                f"the saved privacy ledger cannot be read ({exc})", "restore the server's state folder from a backup"
            ) from None


def _dp_accounting() -> Any:
    try:
        import dp_accounting
    except ImportError:
        raise UsageError(
            "privacy accounting needs the dp-accounting package", "pip install 'edgepfl[privacy]'"
        ) from None
    return dp_accounting
