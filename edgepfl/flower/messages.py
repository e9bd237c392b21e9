"""What travels in Flower messages between the edgepfl strategy and the edgepfl ClientApp, and how it is read.

A train message carries the round's base tensors under their manifest names (ArrayRecord `base`) and
the round (ConfigRecord `round`: its id, its RoundSettings as JSON, the bundle's base layout hash).
A reply carries the trained base tensors (ArrayRecord `base`), the upload metadata an HTTP upload
quotes in its safetensors header (ConfigRecord `upload`) and the device's metrics (MetricRecord
`metrics`). The server turns a reply back into the bytes of an HTTP upload, so `edgepfl serve`'s
acceptance checks it unchanged.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from edgepfl.device_runtime.algorithms import ClientResult
from edgepfl.errors import WireError
from edgepfl.protocol import RoundSettings, SecureTask
from edgepfl.wire import decode_metadata, decode_tensors, encode_tensors

BASE = "base"
ROUND = "round"
UPLOAD = "upload"
METRICS = "metrics"
DEVICE = "device"
DEVICE_QUERY = "query.edgepfl_device"  # the handshake: which edgepfl device a node is, and its bundle
SECAGG = "secagg"
SECAGG_QUERY = "query.edgepfl_secagg"  # a secure round's step: the server's message, the node's answer


def tensors_record(tensors: Mapping[str, np.ndarray]) -> ArrayRecord:
    """Tensors as an ArrayRecord, under their manifest names."""
    return ArrayRecord({name: Array(np.ascontiguousarray(value)) for name, value in tensors.items()})


def tensors_of(content: RecordDict, what: str) -> dict[str, np.ndarray]:
    """The tensors of a message's ArrayRecord `base`; WireError when it is missing or an array cannot be read."""
    record = content.get(BASE)
    if not isinstance(record, ArrayRecord):
        raise WireError(f"{what} has no ArrayRecord {BASE!r}", "send the base tensors under their manifest names")
    tensors = {}
    for name, array in record.items():
        try:
            tensors[name] = array.numpy()
        except Exception as exc:  # noqa: BLE001 (whatever the bytes are, the refusal is one line)
            raise WireError(
                f"{what}: array {name!r} cannot be read as a NumPy array ({type(exc).__name__})",
                "send NumPy arrays (Array.from_numpy_ndarray)",
            ) from None
    return tensors


def train_content(
    round_id: int,
    settings: RoundSettings,
    base: Mapping[str, np.ndarray],
    layout: str,
    secure: SecureTask | None = None,
) -> RecordDict:
    """A train message's content: the base a device gets and the round it trains (a secure round: the device's id
    and the round's context, which its keys are bound to)."""
    plan: dict[str, int | str] = {
        "round": round_id,
        "settings": json.dumps(settings.to_json()),
        "base_layout_hash": layout,
    }
    if secure is not None:
        plan.update({"secure-device": secure.device, "secure-context": secure.context})
    return RecordDict({BASE: tensors_record(base), ROUND: ConfigRecord(plan)})


def secure_of(content: RecordDict) -> SecureTask | None:
    """A train message's secure round (None: a plain one)."""
    record = content.get(ROUND)
    device = record.get("secure-device") if isinstance(record, ConfigRecord) else None
    context = record.get("secure-context") if isinstance(record, ConfigRecord) else None
    if device is None and context is None:
        return None
    if not isinstance(device, str) or not isinstance(context, str):
        raise WireError("the train message's secure-device or secure-context is malformed", "run a matching ServerApp")
    return SecureTask("flower", device, context)


def secure_content(kind: str, body: bytes | str, result: ClientResult | None = None, round_id: int = 0) -> RecordDict:
    """A secure step's message: its kind (advert, shares, masked, reveal; or the server's book, inbox, unmask) and
    body, with the device's metrics when it answers a train message."""
    step = {"kind": kind, "message": body, "round": round_id}
    content = RecordDict({SECAGG: ConfigRecord(step)})
    if result is not None:  # never the sample count: in a secure round it is summed securely, with the deltas
        content[METRICS] = MetricRecord({k: v for k, v in metrics_record(result).items() if k != "num-examples"})
    return content


def secure_step_of(message: Message) -> tuple[str, bytes | str, int]:
    """A secure step's kind, body and round; WireError when the message holds none."""
    record = message.content.get(SECAGG)
    kind = record.get("kind") if isinstance(record, ConfigRecord) else None
    body = record.get("message") if isinstance(record, ConfigRecord) else None
    round_id = record.get("round") if isinstance(record, ConfigRecord) else None
    if not isinstance(kind, str) or not isinstance(body, bytes | str) or type(round_id) is not int:
        raise WireError(
            f"the message has no ConfigRecord {SECAGG!r} of kind, message and round",
            "use edgepfl's ServerApp and ClientApp",
        )
    return kind, body, round_id


def round_of(content: RecordDict) -> tuple[int, RoundSettings, str]:
    """A train message's round id, settings and base layout hash; WireError naming what is wrong."""
    record = content.get(ROUND)
    if not isinstance(record, ConfigRecord):
        raise WireError(f"the train message has no ConfigRecord {ROUND!r}", "run a matching edgepfl ServerApp")
    round_id, settings, layout = record.get("round"), record.get("settings"), record.get("base_layout_hash")
    if type(round_id) is not int or round_id < 1 or not isinstance(settings, str) or not isinstance(layout, str):
        raise WireError(
            "the train message's round, settings or base_layout_hash is missing", "run a matching edgepfl ServerApp"
        )
    try:
        parsed = json.loads(settings)
    except json.JSONDecodeError:
        raise WireError("the train message's settings are not JSON", "run a matching edgepfl ServerApp") from None
    return round_id, RoundSettings.from_json(parsed), layout


def reply_content(payload: bytes, result: ClientResult) -> RecordDict:
    """A train reply's content: the upload body's tensors (the trained base, or its encoded delta and scales) and
    its whole header metadata (UploadMeta, and the encoding), and the device's metrics (finite ones)."""
    return RecordDict(
        {
            BASE: tensors_record(decode_tensors(payload)),
            UPLOAD: ConfigRecord(decode_metadata(payload)),
            METRICS: metrics_record(result),
        }
    )


def metrics_record(result: ClientResult) -> MetricRecord:
    """A device's round metrics (the finite ones)."""
    metrics = {
        "num-examples": result.num_samples,
        "train-loss": result.train_loss,
        "val-loss": result.val_loss,
        "val-accuracy": result.val_accuracy,
        "start-val-accuracy": result.start_val_accuracy,
        "val-samples": result.val_samples,
    }
    return MetricRecord({key: value for key, value in metrics.items() if math.isfinite(value)})


def upload_payload(reply: Message) -> bytes:
    """The bytes of the HTTP upload a reply stands for: its base tensors, its upload metadata in the header."""
    tensors = tensors_of(reply.content, "the reply")
    record = reply.content.get(UPLOAD)
    if not isinstance(record, ConfigRecord):
        raise WireError(f"the reply has no ConfigRecord {UPLOAD!r}", "reply with the edgepfl ClientApp")
    metadata = {str(key): str(value) for key, value in record.items()}
    try:
        return encode_tensors(tensors, metadata=metadata)
    except (TypeError, ValueError) as exc:  # e.g. an object array, which safetensors cannot hold
        raise WireError(f"the reply's tensors cannot be encoded ({exc})", "send numeric NumPy arrays") from None


def metric(reply: Message, key: str) -> float | None:
    """One number of a reply's MetricRecord `metrics`, or None when absent or not a finite number."""
    record = reply.content.get(METRICS)
    value = record.get(key) if isinstance(record, MetricRecord) else None
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None
