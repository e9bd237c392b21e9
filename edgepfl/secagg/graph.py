"""The round's neighbour graph: a Harary graph H(n, k) over a public random order of the sorted devices.

The graph seed is HKDF-SHA256 (keys.derive, purpose "graph") of SHA-256 over the server's 32 random bytes and
every advertised key in device order, so no device list or key changes without changing the graph. The ring
order sorts devices by SHA-256(seed || device id); each device's neighbours are the k/2 devices before and the
k/2 after it on that ring (k = n - 1: every other device). Shamir share indices are positions in the sorted
device list, from 1. secagg.js builds the same graph.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from edgepfl.secagg.keys import derive


def graph_seed(context: str, randomness: bytes, adverts: Sequence[tuple[str, bytes, bytes]]) -> bytes:
    """The 32-byte public seed of the round's graph and rotation: (device, cipher key, mask key) in device order."""
    digest = hashlib.sha256(randomness)
    for device, cipher_key, mask_key in adverts:
        name = device.encode()
        digest.update(len(name).to_bytes(2, "big") + name + cipher_key + mask_key)
    return derive(digest.digest(), "graph", context)


def ring_order(devices: Sequence[str], seed: bytes) -> list[str]:
    """Devices in the graph's ring order."""
    return sorted(devices, key=lambda device: (hashlib.sha256(seed + device.encode()).digest(), device))


def neighbour_map(devices: Sequence[str], seed: bytes, neighbours: int) -> dict[str, tuple[str, ...]]:
    """Each device's neighbours (sorted), k/2 on either side on the ring; k >= n - 1 joins every pair."""
    n = len(devices)
    if neighbours >= n - 1:
        return {device: tuple(sorted(other for other in devices if other != device)) for device in devices}
    order = ring_order(devices, seed)
    half = neighbours // 2
    return {
        device: tuple(sorted(order[(position + step) % n] for step in range(-half, half + 1) if step))
        for position, device in enumerate(order)
    }
