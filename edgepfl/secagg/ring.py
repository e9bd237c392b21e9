"""The secure sum's ring Z/2^b: b-bit elements held in uint32, their wire packing, and AES-CTR mask vectors.

Wire layout of a vector (`pack`): element i occupies bits [i*b, (i+1)*b) of the payload, least significant bit
first, where bit j of the payload is bit (j mod 8) of byte j // 8; the unused high bits of the last byte are 0.

Mask generator (`mask_vector`): AES-256 in counter mode, the 32-byte seed as the key, the initial counter block
16 zero bytes incremented as one 128-bit big-endian integer (WebCrypto AES-CTR with `length: 128`), the
keystream read as little-endian uint32 words, one word per element, of which the low b bits are kept.
Because 2^b divides 2^32 the elements are uniform in the ring. device_runtime/web/src/secagg.js does the same.
"""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from edgepfl.errors import SecAggError

MIN_BITS, MAX_BITS = 8, 32
SEED_BYTES = 32


def check_bits(bits: int) -> int:
    """The ring width if it is an int in [8, 32]; else one SecAggError line."""
    if not isinstance(bits, int) or isinstance(bits, bool) or not MIN_BITS <= bits <= MAX_BITS:
        raise SecAggError(f"ring width {bits!r} bits is not supported", f"use {MIN_BITS} to {MAX_BITS} bits")
    return bits


def modulus_mask(bits: int) -> np.uint32:
    """2^b - 1 as a uint32: `values & modulus_mask(b)` reduces uint32 arithmetic mod 2^b."""
    return np.uint32((1 << check_bits(bits)) - 1)


def mask_vector(seed: bytes, length: int, bits: int = 32) -> np.ndarray:
    """`length` pseudorandom ring elements (uint32, < 2^bits) expanded from a 32-byte seed (module docstring)."""
    if len(seed) != SEED_BYTES:
        raise SecAggError(f"a mask seed has {len(seed)} bytes, not {SEED_BYTES}", "derive seeds with HKDF-SHA256")
    encryptor = Cipher(algorithms.AES(bytes(seed)), modes.CTR(bytes(16))).encryptor()
    stream = encryptor.update(bytes(4 * length)) + encryptor.finalize()
    return np.frombuffer(stream, dtype="<u4").astype(np.uint32) & modulus_mask(bits)


def packed_size(length: int, bits: int) -> int:
    """Bytes of `length` packed b-bit elements."""
    return (length * check_bits(bits) + 7) // 8


def pack(values: np.ndarray, bits: int) -> bytes:
    """Ring elements (< 2^bits) -> the packed wire bytes (module docstring)."""
    values = np.asarray(values, dtype=np.uint32).reshape(-1)
    if check_bits(bits) in (8, 16, 32):
        return values.astype({8: "<u1", 16: "<u2", 32: "<u4"}[bits]).tobytes()
    groups = np.zeros(-(-len(values) // 8) * 8, dtype=np.uint64)
    groups[: len(values)] = values
    groups = groups.reshape(-1, 8)
    rows = np.zeros((len(groups), bits), dtype=np.uint8)  # 8 elements of b bits fill b bytes exactly
    for j, first_byte, shift, count in _layout(bits):
        word = groups[:, j] << np.uint64(shift)
        for k in range(count):
            rows[:, first_byte + k] |= ((word >> np.uint64(8 * k)) & np.uint64(0xFF)).astype(np.uint8)
    return rows.tobytes()[: packed_size(len(values), bits)]


def unpack(payload: bytes, length: int, bits: int, what: str = "vector") -> np.ndarray:
    """Packed wire bytes -> `length` ring elements (uint32); a wrong size or stray padding bits is a SecAggError."""
    expected = packed_size(length, bits)
    if len(payload) != expected:
        raise SecAggError(
            f"{what} has {len(payload)} bytes, expected {expected} ({length} elements of {bits} bits)",
            f"send the masked vector of the round's {length} elements, packed as edgepfl.secagg.ring",
        )
    if bits in (8, 16, 32):
        return np.frombuffer(payload, dtype={8: "<u1", 16: "<u2", 32: "<u4"}[bits]).astype(np.uint32)
    if length * bits % 8 and payload[-1] >> (length * bits % 8):
        raise SecAggError(f"{what} has padding bits set after its last element", "pack with zero padding bits")
    rows = np.zeros(-(-length // 8) * bits, dtype=np.uint8)
    rows[: len(payload)] = np.frombuffer(payload, dtype=np.uint8)
    rows = rows.reshape(-1, bits)
    out = np.zeros((len(rows), 8), dtype=np.uint64)
    for j, first_byte, shift, count in _layout(bits):
        word = np.zeros(len(rows), dtype=np.uint64)
        for k in range(count):
            word |= rows[:, first_byte + k].astype(np.uint64) << np.uint64(8 * k)
        out[:, j] = (word >> np.uint64(shift)) & np.uint64((1 << bits) - 1)
    return out.reshape(-1)[:length].astype(np.uint32)


def _layout(bits: int) -> list[tuple[int, int, int, int]]:
    """For each of 8 elements in a group of b bytes: (element, first byte, bit shift in it, bytes it touches)."""
    return [(j, j * bits // 8, j * bits % 8, -(-(bits + j * bits % 8) // 8)) for j in range(8)]


def to_signed(values: np.ndarray, bits: int) -> np.ndarray:
    """Ring elements read as two's complement b-bit integers (int64): [2^(b-1), 2^b) maps to negatives."""
    values = np.asarray(values, dtype=np.int64)
    return np.where(values >= 1 << (bits - 1), values - (1 << bits), values)


def from_signed(values: np.ndarray, bits: int) -> np.ndarray:
    """Integers -> ring elements mod 2^b (uint32)."""
    return (np.asarray(values, dtype=np.int64) & ((1 << check_bits(bits)) - 1)).astype(np.uint32)
