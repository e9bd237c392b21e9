"""What one device can move: its update's delta is clipped and its claimed sample count capped, per round.

A device's upload is only believed relative to the round: its *delta* (upload minus the base it was sent,
float tensors only, as one vector) is scaled down to at most `clip_multiple` times the median delta norm of
the round's accepted updates, and the sample count it claims is capped at `weight_multiple` times the
round's median claimed count. Both medians come from the round itself, so the bounds follow the model's
scale and the data's size without tuning, and hold while honest devices are most of a round's uploads:
one device claiming 10M samples with values of 1e30 moves the base no further, and weighs no more, than a
few honest devices together. An update within both bounds reaches the strategy bit for bit unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import numpy as np

from edgepfl.server.strategy import AcceptedUpdate


@dataclass(frozen=True)
class UpdateBounds:
    """The two per-round bounds (0 turns one off)."""

    clip_multiple: float = 3.0  # a delta norm above this many times the round's median is scaled down to it
    weight_multiple: float = 2.0  # a claimed sample count above this many times the round's median is capped


def bounded(
    updates: Iterable[AcceptedUpdate],
    bases: Mapping[str, Mapping[str, np.ndarray]],
    norms: Mapping[str, float],
    counts: Mapping[str, int],
    bounds: UpdateBounds,
) -> Iterator[AcceptedUpdate]:
    """Each update with its delta clipped and its sample count capped by the round's medians.

    `bases`, `norms` and `counts` are by device: the base it was sent, its delta norm, its claimed count.
    """
    max_norm = bounds.clip_multiple * _median(norms.values()) if norms and bounds.clip_multiple else None
    cap = bounds.weight_multiple * _median(counts.values()) if counts and bounds.weight_multiple else None
    for update in updates:
        num_samples = update.num_samples
        if cap is not None and num_samples > cap:
            num_samples = max(1, int(cap))
        tensors = update.base_tensors
        norm = norms.get(update.device, 0.0)
        if max_norm is not None and norm > max_norm:
            tensors = _scaled(tensors, bases[update.device], max_norm / norm)
        if num_samples != update.num_samples or tensors is not update.base_tensors:
            update = AcceptedUpdate(update.device, num_samples, tensors, update.train_loss, update.val_accuracy)
        yield update


def _median(values: Iterable[float]) -> float:
    return float(np.median(np.asarray(list(values), dtype=np.float64)))


def _scaled(upload: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray], scale: float) -> dict[str, np.ndarray]:
    """base + scale * (upload - base) for float tensors, in each tensor's dtype; other tensors as uploaded."""
    result = {}
    for name, value in upload.items():
        array = np.asarray(value)
        if array.dtype.kind != "f":
            result[name] = array
            continue
        start = np.asarray(base[name], dtype=np.float64)
        result[name] = (start + scale * (array.astype(np.float64) - start)).astype(array.dtype)
    return result
