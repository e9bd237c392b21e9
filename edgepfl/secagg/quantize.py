"""A base delta as a vector of ring elements whose exact sum over devices gives back the weighted sum.

Device side (`quantize_delta`): scale the delta by w / W (w: the sample count capped at max_weight; W the round's
weight scale, by default the previous round's mean weight, config.weight_scale) and clip that contribution to L2
norm C (privacy.clip_delta of the delta at C W / w: the same float64 expression in secagg.js), flatten in name order
and pad with zeros to d' slots (a multiple of the rotation block), then rotate: permute the slots, flip their signs
and apply an orthonormal Walsh-Hadamard transform per block (permutation and signs from the round's public seed). A
rotated vector of norm <= C has values of about C / sqrt(d') each; each is clipped at c = coordinate_sigmas * C /
sqrt(d'), divided by the step c / q and rounded (stochastically: unbiased; or to nearest) to an integer in [-q, q],
with q = floor((2^(b-1) - 1) / n). The weight w follows as digits in base B = floor((2^b - 1) / n) + 1.

Nothing can wrap the ring: n devices sum to at most n q < 2^(b-1) in absolute value per slot, and to at most
n (B - 1) < 2^b per weight digit. Server side (`dequantize_sum`) undoes it on the sum: signed slots times the
step, the inverse rotation, and the weight digits -> sum(clip(w_i / W * delta_i)) and sum(w_i), exactly the
sum of what each device quantized. All arithmetic is float64 in a fixed order, so secagg.js quantizes bit for
bit alike (same seeds and uniform draws: numpy's Generator.random, encoding.js uniformRandom).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from edgepfl.errors import SecAggError
from edgepfl.privacy import clip_delta
from edgepfl.secagg.config import levels, padded_size, rotation_block, weight_digits
from edgepfl.secagg.keys import derive
from edgepfl.secagg.messages import KeyBook
from edgepfl.secagg.ring import from_signed, mask_vector, to_signed


@dataclass(frozen=True)
class VectorLayout:
    """The shared tensors' names and shapes in name order: where each value sits in the flat vector."""

    tensors: tuple[tuple[str, tuple[int, ...]], ...]

    @classmethod
    def of(cls, shapes: Mapping[str, Sequence[int]]) -> VectorLayout:
        """The layout of {name: shape}."""
        return cls(tuple((name, tuple(int(d) for d in shapes[name])) for name in sorted(shapes)))

    @property
    def size(self) -> int:
        """d: values in all tensors."""
        return sum(math.prod(shape) for _, shape in self.tensors)


def step_size(book: KeyBook) -> float:
    """The value of one quantization level: c / q with c = coordinate_sigmas * C / sqrt(d')."""
    config, plan = book.config, book.plan
    bound = config.coordinate_sigmas * config.clip_norm / math.sqrt(padded_size(book.base_size))
    return bound / levels(plan.devices, plan.bits)


def quantize_delta(
    delta: Mapping[str, np.ndarray], weight: int, book: KeyBook, rng: np.random.Generator | None = None
) -> np.ndarray:
    """A device's ring vector (uint32) of its delta and weight; `rng` rounds stochastically, None to nearest."""
    config, plan = book.config, book.plan
    layout = VectorLayout.of({name: np.shape(value) for name, value in delta.items()})
    if layout.size != book.base_size:
        raise SecAggError(
            f"the delta has {layout.size} values, the round sums {book.base_size}",
            "send every shared tensor of the round's base",
        )
    if not isinstance(weight, int | np.integer) or weight < 0:
        raise SecAggError(f"weight {weight!r} is not a non-negative integer", "pass the device's sample count")
    if not all(np.isfinite(value).all() for value in delta.values()):
        raise SecAggError("the delta has NaN or Inf values", "lower the learning rate; the device sits this round out")
    weight = min(int(weight), config.max_weight)
    scale = weight / config.scale_weight
    # the contribution (w / W) delta is what must fit the ring: clip it to C (a weight-0 device adds nothing)
    clipped = clip_delta(delta, config.clip_norm / scale if scale > 0 else config.clip_norm)
    padded = padded_size(layout.size)
    slots = np.zeros(padded)
    slots[: layout.size] = np.concatenate([clipped[name].reshape(-1).astype(np.float64) for name, _ in layout.tensors])
    rotated = rotate(slots * scale, rotation_block(layout.size), book.seed)
    q = levels(plan.devices, plan.bits)
    ratio = rotated / step_size(book)
    rounded = np.rint(ratio) if rng is None else np.floor(ratio + rng.random(padded))
    base, count = weight_digits(plan.devices, plan.bits, config.max_weight)
    digits = [(weight // base**i) % base for i in range(count)]
    return np.concatenate(
        [from_signed(np.clip(rounded, -q, q).astype(np.int64), plan.bits), np.array(digits, dtype=np.uint32)]
    )


@dataclass(frozen=True)
class SecureSum:
    """What the server learns: sum(clip(w_i / W * delta_i)) per tensor, and sum(w_i) (W: the weight scale)."""

    scaled_sum: dict[str, np.ndarray]
    total_weight: int
    weight_scale: float

    def weighted_mean(self) -> dict[str, np.ndarray]:
        """sum(w_i delta_i) / sum(w_i) (FedAvg / FedPer's base), float32; refused when the weights sum to 0."""
        if self.total_weight <= 0:
            raise SecAggError("the devices' weights sum to 0", "devices must send their sample counts (>= 1)")
        factor = self.weight_scale / self.total_weight
        return {name: (value.astype(np.float64) * factor).astype(np.float32) for name, value in self.scaled_sum.items()}


def dequantize_sum(ring_sum: np.ndarray, layout: VectorLayout, book: KeyBook) -> SecureSum:
    """The exact integer sum of the devices' ring vectors -> the weighted delta sum and the weight sum."""
    config, plan = book.config, book.plan
    if len(ring_sum) != book.vector_length or layout.size != book.base_size:
        raise SecAggError(
            f"the sum has {len(ring_sum)} elements for {layout.size} values, the round's key book "
            f"{book.vector_length} for {book.base_size}",
            "unmask with the round's key book",
        )
    padded = padded_size(layout.size)
    slots = to_signed(ring_sum[:padded], plan.bits) * step_size(book)
    flat = unrotate(slots, rotation_block(layout.size), book.seed)
    scaled, offset = {}, 0
    for name, shape in layout.tensors:
        size = math.prod(shape)
        scaled[name] = flat[offset : offset + size].reshape(shape).astype(np.float32)
        offset += size
    base, _ = weight_digits(plan.devices, plan.bits, config.max_weight)
    total = sum(int(digit) * base**i for i, digit in enumerate(ring_sum[padded:]))
    return SecureSum(scaled, total, config.scale_weight)


def rotate(slots: np.ndarray, block: int, seed: bytes) -> np.ndarray:
    """Permute, flip signs, Walsh-Hadamard per block (orthonormal): the seeded rotation of the slots."""
    permutation, signs = _rotation(len(slots), seed)
    return _hadamard(slots[permutation] * signs, block)


def unrotate(rotated: np.ndarray, block: int, seed: bytes) -> np.ndarray:
    """The inverse of `rotate` (the orthonormal Hadamard transform is its own inverse)."""
    permutation, signs = _rotation(len(rotated), seed)
    slots = np.empty(len(rotated))
    slots[permutation] = _hadamard(np.asarray(rotated, dtype=np.float64), block) * signs
    return slots


def _rotation(length: int, seed: bytes) -> tuple[np.ndarray, np.ndarray]:
    """The slot permutation (a stable sort of keyed random words) and the +-1 signs, from the public seed."""
    index_bits = max(1, (length - 1).bit_length())
    key_bits = min(32, 53 - index_bits)  # key * 2^index_bits + index stays exact in a float64 (secagg.js)
    words = mask_vector(derive(seed, "rotation-permutation", ""), length).astype(np.uint64)
    composite = ((words >> np.uint64(32 - key_bits)) << np.uint64(index_bits)) | np.arange(length, dtype=np.uint64)
    permutation = (np.sort(composite) & np.uint64((1 << index_bits) - 1)).astype(np.int64)
    signs = 1.0 - 2.0 * (mask_vector(derive(seed, "rotation-signs", ""), length) & 1)
    return permutation, signs


def _hadamard(values: np.ndarray, block: int) -> np.ndarray:
    """Orthonormal fast Walsh-Hadamard transform of each block (butterflies (a + b, a - b) in secagg.js's order)."""
    out = np.array(values, dtype=np.float64).reshape(-1, block)
    half = 1
    while half < block:
        pairs = out.reshape(out.shape[0], block // (2 * half), 2, half)
        first, second = pairs[:, :, 0, :].copy(), pairs[:, :, 1, :].copy()
        pairs[:, :, 0, :] = first + second
        pairs[:, :, 1, :] = first - second
        half *= 2
    return (out / math.sqrt(block)).reshape(-1)
