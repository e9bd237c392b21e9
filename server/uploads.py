"""What an upload must be before it is stored: its metadata, its tensors, and what a strategy may send a device."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from edgepfl.errors import WireError
from edgepfl.manifest import Manifest, TensorSpec
from edgepfl.protocol import RoundSettings, UploadMeta
from edgepfl.server.errors import Refused
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
