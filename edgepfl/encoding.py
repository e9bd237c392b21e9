"""Compressed tensor encodings for the wire: base deltas up (fp32, fp16, int8) and the base down (fp32, fp16).

An encoded payload is plain safetensors: the value tensors keep their manifest names, int8 adds one float32
scale tensor `NAME.__scale__` per value tensor, and the header metadata says which encoding was used
(`encoding`, e.g. `int8-block256`). The receiver decodes with the encoding *it asked for* and refuses any
other, so an encoding is never applied silently; the decoded float32 tensors then pass the same checks as
any upload (`edgepfl.wire.check_tensors`: names, shapes, dtypes, finite values).

Error feedback (`encode_with_feedback`) keeps what an encoding lost and adds it to the next round's delta;
`encode_round_upload` persists that residual per round so that re-encoding a round after a crash gives the
same bytes and never adds the residual twice.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgepfl.errors import DataError, StateError, UsageError, WireError
from edgepfl.privacy import clip_delta, delta_norm
from edgepfl.wire import decode_metadata, decode_tensors, encode_tensors, load_tensors, save_tensors

ENCODING_NAMES = ("fp32", "fp16", "int8")
METADATA_KEY = "encoding"  # the safetensors header key naming the encoding of the payload
SCALE_SUFFIX = ".__scale__"
FP16_MAX = float(np.finfo(np.float16).max)  # 65504
_LABEL = re.compile(r"^(fp32|fp16|int8)(?:-block([1-9][0-9]*))?(-sr)?$")


class EncodingMismatch(WireError):
    """A payload that does not name its encoding, or names another than the one asked for."""


@dataclass(frozen=True)
class Encoding:
    """How tensors travel: `fp32`, `fp16`, or `int8` with a per-tensor or per-block scale.

    Error bounds, per value x of a float32 tensor (checked by tests/test_encoding.py):
    - fp32: exact.
    - fp16: |x - decoded| <= 2**-11 * |x| for |x| >= 2**-14 (normal range), <= 2**-25 below it;
      |x| > 65504 cannot be encoded (DataError, never an Inf on the wire).
    - int8: with s = max|x| / 127 over the value's block (the whole tensor when block_size is 0),
      |x - decoded| <= s/2 with round-to-nearest, < s with stochastic rounding (which is unbiased:
      E[decoded] = x), each plus one float32 rounding of the decoded value (relative 2**-24).
    """

    name: str = "fp32"
    block_size: int = 0  # int8: 0 = one scale per tensor, k = one scale per k consecutive values (C order)
    stochastic: bool = False  # int8: unbiased stochastic rounding; needs a seeded numpy Generator

    def __post_init__(self) -> None:
        if self.name not in ENCODING_NAMES:
            raise UsageError(f"unknown encoding {self.name!r}", f"use one of: {', '.join(ENCODING_NAMES)}")
        if self.block_size < 0 or (self.name != "int8" and (self.block_size or self.stochastic)):
            raise UsageError(
                f"encoding {self.name} takes no block size or stochastic rounding",
                "use e.g. int8, int8-block256 or int8-block256-sr",
            )

    @property
    def label(self) -> str:
        """The CLI and wire spelling: fp32, fp16, int8, int8-block256, int8-sr, int8-block256-sr."""
        block = f"-block{self.block_size}" if self.block_size else ""
        return f"{self.name}{block}{'-sr' if self.stochastic else ''}"

    @classmethod
    def parse(cls, label: str) -> Encoding:
        """Read a label as `label` writes it; a malformed one is a UsageError."""
        match = _LABEL.match(label.strip())
        if match is None:
            raise UsageError(
                f"unknown encoding {label!r}", "use fp32, fp16, int8, int8-block<N> or add -sr for stochastic int8"
            )
        return cls(match.group(1), int(match.group(2) or 0), match.group(3) is not None)


@dataclass(frozen=True)
class Encoded:
    """Encoded tensors plus the header metadata that names their encoding; `to_bytes` gives the payload."""

    tensors: dict[str, np.ndarray]
    metadata: dict[str, str]

    def to_bytes(self, extra_metadata: Mapping[str, str] | None = None) -> bytes:
        """Safetensors bytes; `extra_metadata` (e.g. UploadMeta.to_metadata()) joins the encoding key."""
        return encode_tensors(self.tensors, {**(extra_metadata or {}), **self.metadata})

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (without the safetensors header)."""
        return sum(int(value.nbytes) for value in self.tensors.values())


def encode_delta(
    delta: Mapping[str, np.ndarray], encoding: Encoding, rng: np.random.Generator | None = None
) -> Encoded:
    """Encode float tensors (a base delta) as `encoding` says; stochastic int8 draws from `rng`."""
    if encoding.stochastic and rng is None:
        raise UsageError("stochastic rounding needs a random generator", "pass rng=np.random.default_rng(seed)")
    tensors: dict[str, np.ndarray] = {}
    for name in sorted(delta):  # sorted: stochastic draws do not depend on the mapping's order
        if name.endswith(SCALE_SUFFIX):
            raise UsageError(f"tensor name {name!r} ends in {SCALE_SUFFIX}", "rename the tensor in the model")
        value = np.asarray(delta[name], dtype=np.float32)
        if encoding.name == "fp32":
            tensors[name] = value
        elif encoding.name == "fp16":
            if value.size and float(np.max(np.abs(value))) > FP16_MAX:
                raise DataError(
                    f"tensor {name!r} has a value beyond fp16's range (±{FP16_MAX:g})",
                    "lower the learning rate, or use the fp32 or int8 encoding",
                )
            tensors[name] = value.astype(np.float16)
        else:
            tensors[name], tensors[name + SCALE_SUFFIX] = _quantize_int8(value, encoding, rng)
    return Encoded(tensors, {METADATA_KEY: encoding.label})


def decode_delta(
    tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str], expected: Encoding, what: str = "upload"
) -> dict[str, np.ndarray]:
    """Decode to float32 tensors, refusing any encoding but `expected`, stray or missing scales, bad dtypes."""
    sent = metadata.get(METADATA_KEY)
    if sent is None:
        raise EncodingMismatch(
            f"{what} does not name its encoding, and this round asked for {expected.label!r}",
            f"encode with {expected.label} as the round settings say (header metadata {METADATA_KEY}={expected.label})",
        )
    if sent != expected.label:
        raise EncodingMismatch(
            f"{what} is encoded as {sent!r}, but this round asked for {expected.label!r}",
            f"encode with {expected.label} as the round settings say",
        )
    scales = {name[: -len(SCALE_SUFFIX)] for name in tensors if name.endswith(SCALE_SUFFIX)}
    values = [name for name in tensors if not name.endswith(SCALE_SUFFIX)]
    if expected.name != "int8" and scales:
        raise WireError(f"{what} in {expected.label} carries scale tensors", "send scale tensors with int8 only")
    if expected.name == "int8":
        _check_scale_names(scales, set(values), what)
    wire_dtype = {"fp32": np.float32, "fp16": np.float16, "int8": np.int8}[expected.name]
    decoded: dict[str, np.ndarray] = {}
    for name in values:
        value = tensors[name]
        if value.dtype != wire_dtype:
            raise WireError(
                f"{what} tensor {name!r} has dtype {value.dtype}, expected {np.dtype(wire_dtype)} for {expected.label}",
                f"encode with {expected.label}",
            )
        if expected.name == "int8":
            decoded[name] = _dequantize_int8(name, value, tensors[name + SCALE_SUFFIX], expected, what)
        else:
            decoded[name] = value.astype(np.float32)
    return decoded


def decode_payload(payload: bytes, expected: Encoding, what: str = "upload") -> dict[str, np.ndarray]:
    """Safetensors bytes -> decoded float32 tensors (`decode_delta` on the parsed tensors and metadata)."""
    return decode_delta(decode_tensors(payload), decode_metadata(payload), expected, what)


def encode_base(base: Mapping[str, np.ndarray], encoding: Encoding) -> Encoded:
    """Encode a whole base for download: fp32 (exact) or fp16 (bound as in `Encoding`); the metadata names it."""
    if encoding.name == "int8":
        raise UsageError("the base download cannot be int8", "use --download-encoding fp32 or fp16")
    return encode_delta(base, encoding)


def encode_download(payload: bytes, label: str) -> bytes:
    """A base blob (fp32 safetensors bytes) as the round says it travels: unchanged for fp32, else re-encoded."""
    if label == "fp32":
        return payload
    return encode_base(decode_tensors(payload), Encoding.parse(label)).to_bytes()


def decode_download(payload: bytes, label: str, what: str = "the round's base") -> dict[str, np.ndarray]:
    """Received base bytes -> float32 tensors: plain safetensors for fp32, else decoded as `label` (only)."""
    if label == "fp32":
        return decode_tensors(payload)
    return decode_payload(payload, Encoding.parse(label), what)


def encode_with_feedback(
    delta: Mapping[str, np.ndarray],
    residual: Mapping[str, np.ndarray] | None,
    encoding: Encoding,
    rng: np.random.Generator | None = None,
    clip_norm: float | None = None,
) -> tuple[Encoded, dict[str, np.ndarray]]:
    """Encode delta + residual; return it and the new residual (delta + residual, clipped) - decoded.

    With `clip_norm` C (DP), the sum is clipped to L2 norm C and the *decoded* payload is guaranteed norm <= C:
    what clipping removes is dropped (it would otherwise grow without bound), only what the encoding lost is
    carried. Over rounds, without clipping: sum(decoded sent) = sum(deltas) - final residual.
    """
    total = {name: np.asarray(value, dtype=np.float32) for name, value in delta.items()}
    if residual is not None:
        if set(residual) != set(total) or any(residual[n].shape != total[n].shape for n in total):
            raise StateError("the saved residual does not match this delta's tensors", "delete the residual folder")
        total = {name: (value + residual[name]).astype(np.float32) for name, value in total.items()}
    if clip_norm is not None:
        total = clip_delta(total, clip_norm)
    encoded = encode_delta(total, encoding, rng)
    decoded = decode_delta(encoded.tensors, encoded.metadata, encoding, "own encoding")
    for _ in range(4):  # one shrink suffices for normal values; fp16 subnormals may need another
        if clip_norm is None or delta_norm(decoded) <= clip_norm:
            break
        encoded = _shrink(encoded, encoding, clip_norm / delta_norm(decoded))
        decoded = decode_delta(encoded.tensors, encoded.metadata, encoding, "own encoding")
    else:
        raise DataError(f"the encoded delta stays above the clip norm {clip_norm:g}", "use the fp32 encoding")
    return encoded, {name: total[name] - decoded[name] for name in total}


def encode_round_upload(
    folder: str | os.PathLike,
    round_id: int,
    delta: Mapping[str, np.ndarray],
    encoding: Encoding,
    seed: int,
    clip_norm: float | None = None,
) -> Encoded:
    """The device's upload step: encode with the residual of the last earlier round, save this round's residual.

    Crash-safe by construction: the input residual is always the newest one saved for a round < `round_id`
    and stochastic rounding draws from a generator seeded by (seed, round_id), so encoding round r again
    after a kill gives the same bytes and rewrites the same residual file; the residual is never added twice.
    Call `drop_residual(folder, round_id)` when the server refused the upload, so its residual is not used.
    """
    rng = np.random.default_rng([seed, round_id])
    encoded, new_residual = encode_with_feedback(delta, residual_before(folder, round_id), encoding, rng, clip_norm)
    save_tensors(_residual_path(folder, round_id), new_residual)
    kept = _latest_before(folder, round_id)  # still needed if this round's upload is refused
    for older in _residual_rounds(folder):
        if kept is not None and older < kept:
            _residual_path(folder, older).unlink(missing_ok=True)
    return encoded


def residual_before(folder: str | os.PathLike, round_id: int) -> dict[str, np.ndarray] | None:
    """The residual saved by the newest round before `round_id` (None when there is none)."""
    latest = _latest_before(folder, round_id)
    return None if latest is None else load_tensors(_residual_path(folder, latest))


def drop_residual(folder: str | os.PathLike, round_id: int) -> None:
    """Forget the residual of a round whose upload was refused (the next round uses the one before it)."""
    _residual_path(folder, round_id).unlink(missing_ok=True)


def drop_residuals_after(folder: str | os.PathLike, round_id: int | None) -> None:
    """Forget residuals of rounds after `round_id` (the last one committed): their uploads were never saved.

    A device killed between encoding round r and committing it trains round r again (or a later round) from its
    last committed state: r's residual must not feed it, so it is dropped at start.
    """
    for later in _residual_rounds(folder):
        if round_id is None or later > round_id:
            _residual_path(folder, later).unlink(missing_ok=True)


def _quantize_int8(
    value: np.ndarray, encoding: Encoding, rng: np.random.Generator | None
) -> tuple[np.ndarray, np.ndarray]:
    flat = value.reshape(-1).astype(np.float64)
    block = encoding.block_size or max(flat.size, 1)
    blocks = -(-flat.size // block)
    padded = np.zeros(blocks * block)
    padded[: flat.size] = flat
    peaks = np.abs(padded.reshape(blocks, block)).max(axis=1) if flat.size else np.zeros(1)
    # quantize with the float32 scale the receiver will read, so the bound holds for what is decoded
    scale = (peaks / 127.0).astype(np.float32)
    per_value = np.repeat(scale.astype(np.float64), block)[: flat.size]
    ratio = np.divide(flat, per_value, out=np.zeros_like(flat), where=per_value > 0)
    if encoding.stochastic:
        assert rng is not None  # encode_delta checked it
        rounded = np.floor(ratio + rng.random(flat.size))
    else:
        rounded = np.rint(ratio)
    quantized = np.clip(rounded, -127, 127).astype(np.int8).reshape(value.shape)
    return quantized, scale


def _dequantize_int8(name: str, value: np.ndarray, scale: np.ndarray, encoding: Encoding, what: str) -> np.ndarray:
    block = encoding.block_size or max(value.size, 1)
    blocks = max(-(-value.size // block), 1)
    if scale.dtype != np.float32 or scale.shape != (blocks,):
        raise WireError(
            f"{what} scale of {name!r} is {scale.dtype}{list(scale.shape)}, expected float32[{blocks}]",
            f"encode with {encoding.label}",
        )
    if not (np.isfinite(scale).all() and (scale >= 0).all()):
        raise WireError(f"{what} scale of {name!r} is negative, NaN or Inf", "send finite non-negative scales")
    per_value = np.repeat(scale, block)[: value.size].reshape(value.shape)
    return value.astype(np.float32) * per_value


def _check_scale_names(scales: set[str], values: set[str], what: str) -> None:
    missing, stray = sorted(values - scales), sorted(scales - values)
    if missing:
        raise WireError(f"{what} lacks the int8 scale of {missing[0]!r}", f"send {missing[0]}{SCALE_SUFFIX}")
    if stray:
        raise WireError(f"{what} has a scale for unknown tensor {stray[0]!r}", "send one scale per int8 tensor")


def _shrink(encoded: Encoded, encoding: Encoding, factor: float) -> Encoded:
    """Scale an encoded payload so its decoded norm falls under the clip norm (rounding pushed it over)."""
    # margins cover one rounding of each decoded value: fp16 2**-11, float32 2**-24 (twice for int8)
    factor *= 1 - 2.0**-9 if encoding.name == "fp16" else 1 - 2.0**-20
    tensors = {}
    for name, value in encoded.tensors.items():
        if encoding.name == "int8":
            tensors[name] = (value * np.float32(factor)).astype(np.float32) if name.endswith(SCALE_SUFFIX) else value
        else:
            tensors[name] = (value.astype(np.float32) * np.float32(factor)).astype(value.dtype)
    return Encoded(tensors, dict(encoded.metadata))


def _residual_path(folder: str | os.PathLike, round_id: int) -> Path:
    return Path(folder) / f"residual-{round_id:08d}.safetensors"


def _residual_rounds(folder: str | os.PathLike) -> list[int]:
    found = Path(folder).glob("residual-*.safetensors") if Path(folder).is_dir() else []
    return sorted(int(path.stem.split("-")[1]) for path in found if path.stem.split("-")[1].isdigit())


def _latest_before(folder: str | os.PathLike, round_id: int) -> int | None:
    earlier = [r for r in _residual_rounds(folder) if r < round_id]
    return earlier[-1] if earlier else None
