"""Keys of one round: X25519 pairs, HKDF-SHA256 with round-bound info strings, AES-GCM for shares in transit.

Every derived key is HKDF-SHA256(ikm, salt = SHA-256("edgepfl-secagg-v1"), info = `info(purpose, context,
*parties)`, 32 bytes), where `info` joins "edgepfl-secagg-v1" and each part as 2-byte big-endian length +
UTF-8 bytes. Purposes: "share" (sender, recipient: one AES-GCM key per direction), "mask" (the two devices in
index order: the pairwise mask seed), "graph", "rotation-permutation", "rotation-signs". A share message is
AES-256-GCM with a random 12-byte nonce before the ciphertext and the info string as associated data.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from edgepfl.errors import SecAggError

VERSION = "edgepfl-secagg-v1"
KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
SALT = hashlib.sha256(VERSION.encode()).digest()


def new_private_key(random_bytes: Callable[[int], bytes]) -> bytes:
    """32 random bytes: an X25519 private key (clamped when used, as RFC 7748 says)."""
    return bytes(random_bytes(KEY_BYTES))


def public_key(private_key: bytes) -> bytes:
    """The raw 32-byte X25519 public key of a raw private key."""
    key = X25519PrivateKey.from_private_bytes(private_key).public_key()
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def agree(private_key: bytes, peer_public_key: bytes, peer: str) -> bytes:
    """X25519 shared secret with a peer; a malformed or low-order public key is one SecAggError line."""
    if len(peer_public_key) != KEY_BYTES:
        raise SecAggError(
            f"device {peer!r} advertised a public key of {len(peer_public_key)} bytes, not 32",
            "advertise raw X25519 public keys",
        )
    try:
        peer_key = X25519PublicKey.from_public_bytes(peer_public_key)
        return X25519PrivateKey.from_private_bytes(private_key).exchange(peer_key)
    except ValueError:
        raise SecAggError(
            f"device {peer!r} advertised a low-order X25519 public key", "advertise a key made by X25519 key generation"
        ) from None


def info(purpose: str, context: str, *parties: str) -> bytes:
    """The HKDF info (and AES-GCM associated data) binding a key to its purpose, the round and the devices."""
    parts = [VERSION, purpose, context, *parties]
    return b"".join(len(part.encode()).to_bytes(2, "big") + part.encode() for part in parts)


def derive(secret: bytes, purpose: str, context: str, *parties: str) -> bytes:
    """HKDF-SHA256 of `secret` to a 32-byte key bound to purpose, round context and devices."""
    return HKDF(hashes.SHA256(), KEY_BYTES, SALT, info(purpose, context, *parties)).derive(secret)


def encrypt(key: bytes, plaintext: bytes, associated: bytes, random_bytes: Callable[[int], bytes]) -> bytes:
    """AES-256-GCM: random nonce || ciphertext || tag."""
    nonce = bytes(random_bytes(NONCE_BYTES))
    return nonce + AESGCM(key).encrypt(nonce, plaintext, associated)


def decrypt(key: bytes, sealed: bytes, associated: bytes, what: str) -> bytes:
    """Open what `encrypt` sealed; a forged, truncated or misrouted message is one SecAggError line."""
    try:
        return AESGCM(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], associated)
    except (InvalidTag, ValueError):
        raise SecAggError(
            f"{what} does not decrypt (wrong key, sender, recipient or round, or altered in transit)",
            "the server must route each device's shares unchanged",
        ) from None
