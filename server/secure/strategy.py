"""Secure aggregation as a wrapper around the strategy: the inner strategy plans the rounds, the wrapper aggregates
the round's unmasked sum (`rounds.py`) instead of its uploads, so the round engine has no secure branch in its
close.

- fedavg, fedper: base + sum(clip(w_i / W * delta_i, C)) * W / sum(w_i), the sample-weighted mean of the clipped
  deltas (W and C measured from the previous round's sum unless flags fix them; the weights are summed securely too).
- with DP-FedAvg around them (`budget.PrivateStrategy`): every device weighs 1 (the server tells the devices
  max_weight 1), so the sum is sum(clip(delta_i)); the server adds N(0, (sigma * S)^2) to it, S = C (1 + s / q)
  the most one device's clipped, rounded contribution can move it, and divides by the round's sample size m.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from edgepfl.server.secure.rounds import SecureRounds
from edgepfl.server.strategy import AcceptedUpdate, BaseTensors, Strategy, WrappingStrategy
from edgepfl.server.uploads import add_delta


class SecureStrategy(WrappingStrategy):
    """The inner strategy's plans; the secure sum's mean (or DP's noised mean) as the next global base."""

    reads_deltas = True  # a secure round stores no uploads: the engine hands over none
    bounded = False  # the server cannot bound what it does not see; the ring bounds each device (docs)

    def __init__(self, inner: Strategy, secure: SecureRounds):
        super().__init__(inner)
        self.secure = secure

    def aggregate(
        self, round_id: int, updates: Iterable[AcceptedUpdate], global_base: Mapping[str, np.ndarray]
    ) -> BaseTensors:
        """The global base plus the round's securely summed mean delta."""
        total = self.secure.sum_of(round_id)
        average = self.inner.mean_of_sum(round_id, total, lambda: self.secure.sensitivity(round_id))
        return add_delta(global_base, average, self.specs)

    def fresh(self) -> Strategy:
        """This wrapper around a fresh inner strategy."""
        return SecureStrategy(self.inner.fresh(), self.secure)
