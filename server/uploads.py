"""What an upload must be before it is stored: its metadata, its tensors, and what a strategy may send a device.

An upload's bytes are parsed once, into an `Upload`; the round engine then checks it in a straight line
(`RoundEngine.accept_update`): metadata, names, then the base it stands for against the round's tensors.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from edgepfl.encoding import Encoding, EncodingMismatch, decode_delta
from edgepfl.errors import WireError
from edgepfl.manifest import Manifest, TensorSpec
from edgepfl.privacy import check_delta_norm
from edgepfl.protocol import RoundSettings, UploadMeta
from edgepfl.server.errors import Refused
from edgepfl.server.strategy import cast_like
from edgepfl.wire import check_tensors, decode_body, header_metadata, read_header


@dataclass(frozen=True)
class Upload:
    """One upload's bytes parsed once: its checked metadata and its tensors as sent (a delta upload's encoded)."""

    payload: bytes
    sha256: str
    meta: UploadMeta
    metadata: dict[str, str]
    tensors: dict[str, np.ndarray]

    @classmethod
    def parse(cls, payload: bytes, manifest: Manifest, max_samples: int, shared: set[str]) -> Upload:
        """Parse and check an upload: well-formed, sane metadata of this bundle, no personal or unshared tensor.

        The header is parsed and its metadata checked before the tensors are read.
        """
        try:
            metadata = header_metadata(read_header(payload))
        except WireError as error:
            raise Refused("malformed", error.problem, error.fix) from None
        meta = read_upload_meta(metadata, manifest, max_samples)
        try:
            tensors = decode_body(payload)
        except WireError as error:
            raise Refused("malformed", error.problem, error.fix) from None
        check_upload_names(tensors, manifest, shared)
        return cls(payload, hashlib.sha256(payload).hexdigest(), meta, metadata, tensors)

    def stands_for(
        self, settings: RoundSettings, base: Mapping[str, np.ndarray], specs: list[TensorSpec]
    ) -> dict[str, np.ndarray]:
        """The base tensors this upload stands for, checked against the round's travelling tensors (`specs`): the
        tensors as sent, or (a delta upload) the base the device was sent plus the delta decoded as the round asked."""
        tensors: Mapping[str, np.ndarray] = self.tensors
        if settings.uploads_delta:
            tensors = add_delta(base, read_upload_delta(self.tensors, self.metadata, settings, specs), specs)
        try:
            check_tensors(tensors, specs, what="upload")
        except WireError as error:
            raise Refused("bad_tensors", error.problem, error.fix) from None
        return dict(tensors)


def read_upload_meta(metadata: Mapping[str, str], manifest: Manifest, max_samples: int) -> UploadMeta:
    """An upload's metadata, checked: a sane sample count, this bundle's layout, finite losses."""
    try:
        meta = UploadMeta.from_metadata(dict(metadata), max_samples=max_samples)
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


def check_upload_names(base_tensors: Mapping[str, Any], manifest: Manifest, shared: set[str]) -> None:
    """An upload's tensors: never a personal tensor, BatchNorm statistics only if they are shared."""
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
