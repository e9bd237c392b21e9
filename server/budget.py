"""The server's privacy budget (DP-FedAvg, user level): the DP settings bound to a state folder, the epsilon spent,
and the noised mean of a round's clipped deltas. The mechanism and the accountant are edgepfl/privacy.py's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edgepfl.errors import StateError
from edgepfl.manifest import TensorSpec
from edgepfl.privacy import DPConfig, PrivacyLedger, dp_aggregate, fixed_denominator
from edgepfl.server.store import Store
from edgepfl.server.uploads import add_delta

SAMPLING = "fixed"  # server/sampling.py samples a fixed number of the available devices, without replacement


class PrivacyBudget:
    """What a DP run has spent (its ledger, committed with every closed round) and how it aggregates."""

    def __init__(self, dp: DPConfig, ledger: PrivacyLedger):
        self.dp = dp
        self.ledger = ledger

    @classmethod
    def bind(cls, dp: DPConfig | None, store: Store, strategy: str, state: Path) -> PrivacyBudget | None:
        """Continue the state folder's budget with the same DP settings, or start one; refuse a change (StateError)."""
        saved = store.get_meta("privacy_ledger")
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
            store.set_meta({"privacy_ledger": ledger.to_json(), "dp_clip": repr(dp.clip_norm)})
            return cls(dp, ledger)
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
        return cls(dp, stored)

    def aggregate(
        self,
        round_id: int,
        deltas: Iterable[Mapping[str, np.ndarray]],
        global_base: Mapping[str, np.ndarray],
        specs: Sequence[TensorSpec],
        population: int,
        sample_size: int,
        noise_seed: int | None = None,
    ) -> tuple[dict[str, np.ndarray], PrivacyLedger]:
        """base + (sum of clipped deltas + N(0, (sigma*C)^2)) / m, m the round's sample size; and the ledger after it.

        Unweighted, and without the median bounds of bounds.py (a bound that depends on the others' deltas is not
        covered by the noise): every delta is within the clip norm C, checked at acceptance and again here. The
        noise comes from OS entropy unless `noise_seed` is given (a simulation is reproducible).
        """
        denominator = fixed_denominator(SAMPLING, population, sample_size)
        rng = np.random.default_rng(None if noise_seed is None else [noise_seed, round_id])
        average = dp_aggregate(deltas, self.dp.clip_norm, self.dp.noise_multiplier, denominator, rng)
        return add_delta(global_base, average, specs), self.ledger.record_round(population, sample_size)

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
