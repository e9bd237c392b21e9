"""Shamir secret sharing of 32-byte secrets (mask seeds, X25519 private keys) over the prime field GF(2^256 + 297).

2^256 + 297 is the smallest prime above 2^256 (tests/test_secagg_primitives.py checks it), so every 32-byte
secret, read as a big-endian integer, is a field element. A share is the polynomial's value at the holder's
index (1..n, its position in the round's sorted device list), written as 33 big-endian bytes. The t - 1
random coefficients are read from 32 random bytes each: uniform on [0, 2^256), which is statistically
indistinguishable (distance < 2^-247) from uniform on the field. secagg.js splits the same way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

from edgepfl.errors import SecAggError

PRIME = (1 << 256) + 297
SECRET_BYTES = 32
SHARE_BYTES = 33


def split(
    secret: bytes, holders: Sequence[int], threshold: int, random_bytes: Callable[[int], bytes]
) -> dict[int, bytes]:
    """Shares of `secret` for each holder index; any `threshold` of them give it back, fewer tell nothing."""
    if len(secret) != SECRET_BYTES:
        raise SecAggError(f"a shared secret has {len(secret)} bytes, not {SECRET_BYTES}", "share 32-byte secrets")
    if not 1 <= threshold <= len(holders) or len(set(holders)) != len(holders) or min(holders) < 1:
        raise SecAggError(
            f"cannot share among holders {list(holders)[:8]} with threshold {threshold}",
            "use distinct indices from 1 and a threshold of at most their number",
        )
    coefficients = [int.from_bytes(secret, "big")]
    coefficients += [int.from_bytes(random_bytes(SECRET_BYTES), "big") for _ in range(threshold - 1)]
    return {x: _evaluate(coefficients, x).to_bytes(SHARE_BYTES, "big") for x in holders}


def reconstruct(shares: Mapping[int, bytes], threshold: int, what: str = "a secret") -> bytes:
    """The secret from at least `threshold` shares {holder index: share}.

    With more shares than the threshold, a second set of `threshold` shares must give the same secret, so an
    inconsistent share is caught (one line naming `what`) rather than silently giving a wrong secret.
    """
    if len(shares) < threshold:
        raise SecAggError(
            f"{what} has {len(shares)} shares, {threshold} are needed",
            "more devices must reveal their shares (too many dropped)",
        )
    values = {x: read_share(share, what) for x, share in shares.items()}
    holders = sorted(values)
    secret = _interpolate_zero(values, tuple(holders[:threshold]))
    if len(holders) > threshold and _interpolate_zero(values, tuple(holders[-threshold:])) != secret:
        raise SecAggError(f"the shares of {what} are inconsistent", "a device revealed a wrong share; fail the round")
    if secret >= 1 << (8 * SECRET_BYTES):
        raise SecAggError(f"the shares of {what} do not give a 32-byte secret", "a device revealed a wrong share")
    return secret.to_bytes(SECRET_BYTES, "big")


def read_share(share: bytes, what: str = "a share") -> int:
    """A share's field element; a share of the wrong length or outside the field is a SecAggError."""
    if not isinstance(share, bytes | bytearray) or len(share) != SHARE_BYTES:
        raise SecAggError(f"a share of {what} is not {SHARE_BYTES} bytes", "send shares as edgepfl.secagg.shamir does")
    value = int.from_bytes(share, "big")
    if value >= PRIME:
        raise SecAggError(f"a share of {what} lies outside the field", "send shares reduced modulo 2^256 + 297")
    return value


def _evaluate(coefficients: list[int], x: int) -> int:
    value = 0
    for coefficient in reversed(coefficients):  # Horner
        value = (value * x + coefficient) % PRIME
    return value


def _interpolate_zero(values: Mapping[int, int], holders: tuple[int, ...]) -> int:
    return sum(values[x] * weight for x, weight in zip(holders, _lagrange_at_zero(holders))) % PRIME


@functools.lru_cache(maxsize=1024)
def _lagrange_at_zero(holders: tuple[int, ...]) -> tuple[int, ...]:
    """Lagrange weights at x = 0 for these holder indices; cached: one round reuses a few holder sets many times."""
    numerators, denominators = [], []
    for x in holders:
        numerator, denominator = 1, 1
        for other in holders:
            if other != x:
                numerator = numerator * other % PRIME
                denominator = denominator * (other - x) % PRIME
        numerators.append(numerator)
        denominators.append(denominator)
    return tuple(n * inverse % PRIME for n, inverse in zip(numerators, _batch_inverse(denominators)))


def _batch_inverse(values: list[int]) -> list[int]:
    """Inverses mod PRIME of non-zero values with one exponentiation (Montgomery's trick)."""
    prefix = [1]
    for value in values:
        prefix.append(prefix[-1] * value % PRIME)
    inverse = pow(prefix[-1], -1, PRIME)
    out = [0] * len(values)
    for i in range(len(values) - 1, -1, -1):
        out[i] = prefix[i] * inverse % PRIME
        inverse = inverse * values[i] % PRIME
    return out
