"""What an upload must be before it is stored: its metadata, its tensors, and what a strategy may send a device."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from edgepfl.encoding import Encoding, EncodingMismatch, decode_delta
from edgepfl.errors import WireError
from edgepfl.manifest import Manifest, TensorSpec
from edgepfl.privacy import check_delta_norm
from edgepfl.protocol import RoundSettings, UploadMeta
from edgepfl.server.errors import Refused
from edgepfl.server.strategy import cast_like
from edgepfl.wire import check_tensors, decode_metadata, decode_tensors


def read_upload_meta(payload: bytes, manifest: Manifest, max_samples: int) -> UploadMeta:
    """An upload's metadata, checked: well-formed, a sane sample count, this bundle's layout, finite losses."""
    try:
        metadata = decode_metadata(payload)
    except WireError as error:
        raise Refused("malformed", error.problem, error.fix) from None
    try:
        meta = UploadMeta.from_metadata(metadata, max_samples=max_samples)
    except WireError as error:
        raise Refused("bad_metadata", error.problem, error.fix) from None
    if meta.base_layout_hash != manifest.base_layout_hash:
        raise Refused(
            "layout_mismatch",
            f"upload quotes base_layout_hash {meta.base_layout_hash[:16]!r}, the server's bundle has "
            f"{manifest.base_layout_hash[:16]!r}",
            "train from the bundle this server was started with",
        )
    for key in ("train_loss", "val_loss"):
        if math.isinf(getattr(meta, key)):
            raise Refused("bad_metadata", f"upload {key} is infinite", "send a finite loss, or omit it")
    return meta


def read_upload_tensors(payload: bytes, manifest: Manifest, shared: set[str]) -> dict[str, Any]:
    """An upload's tensors: never a personal tensor, BatchNorm statistics only if they are shared."""
    try:
        base_tensors = decode_tensors(payload)
    except WireError as error:
        raise Refused("malformed", error.problem, error.fix) from None
    personal = sorted(set(base_tensors) & set(manifest.names("personal")))
    if personal:
        raise Refused(
            "personal_tensors",
            f"upload contains personal tensor(s) {', '.join(personal[:3])}",
            "personal tensors never leave the device: send the base tensors only",
        )
    buffers = sorted((set(base_tensors) - shared) & set(manifest.names("buffer")))
    if buffers:
        raise Refused(
            "buffers_not_shared",
            f"upload contains BatchNorm statistics {', '.join(buffers[:3])}",
            "this server keeps BatchNorm statistics on the devices (no --share-bn-stats): send the base only",
        )
    return base_tensors


def read_upload_delta(
    tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str], settings: RoundSettings, specs: list[TensorSpec]
) -> dict[str, np.ndarray]:
    """A delta upload decoded as the round asked: every tensor present, float32, finite, within the DP clip norm.

    An encoding other than the round's is `wrong_encoding`, a norm above the round's clip norm `over_clip_norm`.
    """
    try:
        delta = decode_delta(tensors, metadata, Encoding.parse(settings.upload_encoding))
    except EncodingMismatch as error:
        raise Refused("wrong_encoding", error.problem, error.fix) from None
    except WireError as error:
        raise Refused("bad_tensors", error.problem, error.fix) from None
    try:
        check_tensors(delta, [replace(spec, dtype="float32") for spec in specs], what="upload delta")
    except WireError as error:
        raise Refused("bad_tensors", error.problem, error.fix) from None
    if settings.clip_norm is not None:
        try:
            check_delta_norm(delta, settings.clip_norm)
        except WireError as error:
            raise Refused("over_clip_norm", error.problem, error.fix) from None
    return delta


def add_delta(
    base: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray], specs: list[TensorSpec]
) -> dict[str, np.ndarray]:
    """base + delta in float64, back in each tensor's manifest dtype: the base a delta upload stands for."""
    return cast_like({spec.name: np.asarray(base[spec.name], np.float64) + delta[spec.name] for spec in specs}, specs)


def check_plan(
    strategy: str, specs: list[TensorSpec], device: str, settings: RoundSettings, payload: Mapping[str, np.ndarray]
) -> None:
    """A strategy's per-device base: exactly the shared tensors it does not tell the device to keep."""
    unknown = sorted(set(settings.kept_on_device) - {spec.name for spec in specs})
    if unknown:
        raise WireError(
            f"{strategy} tells {device} to keep {unknown[0]!r}, which is not a shared tensor",
            "keep only tensors of the bundle's base",
        )
    check_tensors(payload, settings.travelling(specs), what=f"{strategy} payload for {device}")


def finite_or_none(value: float) -> float | None:
    """The value, or None when it is NaN or infinite (stored metrics are finite or absent)."""
    return value if math.isfinite(value) else None
