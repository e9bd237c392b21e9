"""Which available devices a round samples: one seeded rule for `serve` and `simulate`."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence


def sample_size(available: int, fraction: float, min_clients: int) -> int:
    """A round's target: max(min_clients, ceil(fraction * n)) of the n available, capped at n."""
    return min(max(min_clients, math.ceil(fraction * available)), available)


def sample_devices(
    seed: int, round_id: int, names: Sequence[str], fraction: float, min_clients: int, over_select: float = 0.0
) -> list[str]:
    """The round's target (`sample_size`) of the available devices, or ceil(target * (1 + over_select)) of them
    with over-selection (capped at n), seeded by (seed, round); sorted.

    Seeded by the round id, not by the order devices showed up, so a restarted server samples alike.
    """
    available = sorted(names)
    target = sample_size(len(available), fraction, min_clients)
    count = min(math.ceil(target * (1.0 + over_select) - 1e-9), len(available))
    return sorted(random.Random(f"{seed}/{round_id}").sample(available, count))
