"""Which available devices a round samples: one seeded rule for `serve` and `simulate`."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence


def sample_devices(seed: int, round_id: int, names: Sequence[str], fraction: float, min_clients: int) -> list[str]:
    """max(min_clients, ceil(fraction * n)) of the n available (capped at n), seeded by (seed, round); sorted.

    Seeded by the round id, not by the order devices showed up, so a restarted server samples alike.
    """
    available = sorted(names)
    wanted = max(min_clients, math.ceil(fraction * len(available)))
    return sorted(random.Random(f"{seed}/{round_id}").sample(available, min(wanted, len(available))))
