"""DP-FedAvg (user level) on the server, as a wrapper around the strategy: the DP settings bound to a state folder,
the epsilon spent, and the noised mean of a round's clipped deltas. The mechanism and the accountant are
edgepfl/privacy.py's.

As Flower composes `DifferentialPrivacyServerSideFixedClipping` around a strategy, `PrivateStrategy` wraps
fedavg or fedper: the inner strategy plans the rounds, the wrapper aggregates (unweighted, without the median
bounds of bounds.py: a bound that depends on the others' deltas is not covered by the noise) and says what a
closed round commits besides its base (the epsilon spent and the ledger), so the round engine has no DP branch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgepfl.errors import StateError
from edgepfl.privacy import DPConfig, PrivacyLedger, dp_aggregate, fixed_denominator, noised_mean
from edgepfl.server.records import RoundRecord
from edgepfl.server.store import Store
from edgepfl.server.strategy import AcceptedUpdate, BaseTensors, Strategy, WrappingStrategy
from edgepfl.server.uploads import add_delta

if TYPE_CHECKING:
    from edgepfl.secagg.quantize import SecureSum

SAMPLING = "fixed"  # server/sampling.py samples a fixed number of the available devices, without replacement
LEDGER = "privacy_ledger"  # the meta key of the ledger, committed with every closed round


class PrivacyBudget:
    """What a DP run has spent: its ledger, read from the state folder, where each closed round commits it."""

    def __init__(self, dp: DPConfig, store: Store):
        self.dp = dp
        self.store = store

    @classmethod
    def bind(cls, dp: DPConfig | None, store: Store, strategy: str, state: Path) -> PrivacyBudget | None:
        """Continue the state folder's budget with the same DP settings, or start one; refuse a change (StateError)."""
        saved = store.get_meta(LEDGER)
        if dp is None:
            if saved is not None:
                raise StateError(
                    f"the state folder {state} ran with differential privacy, and rounds without it would void its "
                    "guarantee",
                    "restart with the same --dp-* options, or use a new --state folder",
                )
            return None
        ledger = dp.new_ledger(strategy, SAMPLING)
        ledger.dp_event()  # refuses now, in one line, when dp-accounting is not installed
        if saved is None:
            store.set_meta({LEDGER: ledger.to_json(), "dp_clip": repr(dp.clip_norm)})
            return cls(dp, store)
        stored = PrivacyLedger.from_json(saved)
        if (stored.noise_multiplier, stored.delta, stored.sampling) != (dp.noise_multiplier, dp.delta, SAMPLING):
            raise StateError(
                f"the state folder {state} spent its privacy budget with --dp-noise-multiplier "
                f"{stored.noise_multiplier:g} --dp-delta {stored.delta:g}",
                "restart with those values, or use a new --state folder",
            )
        clip = store.get_meta("dp_clip")
        if clip is not None and float(clip) != dp.clip_norm:
            raise StateError(
                f"the state folder {state} clipped deltas to --dp-clip {clip}",
                "restart with that --dp-clip, or use a new --state folder",
            )
        return cls(dp, store)

    @property
    def ledger(self) -> PrivacyLedger:
        """The budget spent through the last closed round."""
        saved = self.store.get_meta(LEDGER)
        assert saved is not None, "bind() stores the ledger"
        return PrivacyLedger.from_json(saved)

    def stop_before(self, round_id: int, population: int, sample_size: int) -> str | None:
        """Why the run stops before `round_id` (one more round would pass --dp-target-epsilon), or None."""
        target = self.dp.target_epsilon
        if target is None or self.ledger.rounds_left(target, population, sample_size, limit=1) == 1:
            return None
        return (
            f"stopped before round {round_id}: it would take epsilon above --dp-target-epsilon {target:g} "
            f"(spent {self.ledger.epsilon():.4g} at delta {self.dp.delta:g})"
        )

    def status(self, epsilon: float) -> dict[str, Any]:
        """The settings and the budget spent, as /v1/status shows them."""
        return {
            "mechanism": "DP-FedAvg, user level: deltas clipped on the device, Gaussian noise on the sum",
            "sampling": "fixed-size, without replacement (replace-one neighbours)",
            "noise_multiplier": self.dp.noise_multiplier,
            "clip_norm": self.dp.clip_norm,
            "delta": self.dp.delta,
            "target_epsilon": self.dp.target_epsilon,
            "epsilon": epsilon,
            "rounds_accounted": self.ledger.rounds,
        }


class PrivateStrategy(WrappingStrategy):
    """DP-FedAvg around a sum strategy: base + (sum of clipped deltas + N(0, (sigma*C)^2)) / m, m the sample size.

    Every delta is within the clip norm C, checked at acceptance and again in the mechanism. The noise comes
    from OS entropy unless `noise_seed` is given (a simulation is reproducible).
    """

    reads_deltas = True
    bounded = False

    def __init__(
        self,
        inner: Strategy,
        budget: PrivacyBudget,
        round_of: Callable[[int], RoundRecord],
        noise_seed: Callable[[], int | None],
    ):
        super().__init__(inner)
        self.budget = budget
        self.round_of = round_of  # the round engine's records: each round's population and sample size
        self.noise_seed = noise_seed

    def aggregate(
        self, round_id: int, updates: Iterable[AcceptedUpdate], global_base: Mapping[str, np.ndarray]
    ) -> BaseTensors:
        """The noised mean of the round's decoded deltas (each update's `delta`), added to the global base."""
        denominator, rng = self._mechanism(round_id)
        deltas = (update.delta for update in updates if update.delta is not None)
        average = dp_aggregate(deltas, self.budget.dp.clip_norm, self.budget.dp.noise_multiplier, denominator, rng)
        return add_delta(global_base, average, self.specs)

    def mean_of_sum(self, round_id: int, total: SecureSum, sensitivity: Callable[[], float]) -> dict[str, np.ndarray]:
        """The noised mean of a sum whose one device moves it by at most `sensitivity()` (secure aggregation's
        unmasked sum of clipped, quantized deltas): (sum + N(0, (sigma * sensitivity)^2)) / m."""
        denominator, rng = self._mechanism(round_id)
        return noised_mean(total.scaled_sum, self.budget.dp.noise_multiplier * sensitivity(), denominator, rng)

    def _mechanism(self, round_id: int) -> tuple[float, np.random.Generator]:
        """The round's fixed denominator m and its noise generator."""
        record = self.round_of(round_id)
        population, sample_size = record.population or len(record.sampled), len(record.sampled)
        seed = self.noise_seed()
        return fixed_denominator(SAMPLING, population, sample_size), np.random.default_rng(
            None if seed is None else [seed, round_id]
        )

    def closing(self, record: RoundRecord) -> dict[str, Any]:
        """The epsilon spent through this round and the ledger, committed with it."""
        ledger = self.budget.ledger.record_round(record.population or len(record.sampled), len(record.sampled))
        return {"epsilon": ledger.epsilon(), "meta": {LEDGER: ledger.to_json()}}

    def fresh(self) -> Strategy:
        """This wrapper around a fresh inner strategy."""
        return PrivateStrategy(self.inner.fresh(), self.budget, self.round_of, self.noise_seed)
