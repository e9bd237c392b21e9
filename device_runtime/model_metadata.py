"""What an exported model file says of itself: its metadata_props, names and doc string, in one place.

`edgepfl device export-model` (model_export.py) writes them with the onnx package; the browser page writes the
same file in JavaScript (device_runtime/web/src/modelfile.js) from `model_file_contract()`, which the device
contract carries, so no text or key order is copied by hand into the page.
"""

from __future__ import annotations

import json
from typing import Any

import edgepfl
from edgepfl.kinds import KINDS
from edgepfl.manifest import Manifest

INPUT, LOGITS, PROBABILITIES = "input", "logits", "probabilities"
GRAPH_NAME = "edgepfl_inference"
PRODUCER = "edgepfl"
CHECK_TOLERANCE = 1e-4  # the baked graph against the engine: probabilities may differ by float rounding only
RESIZE_RULE = (
    "decode (grey models: Pillow 'L' = (19595 R + 38470 G + 7471 B + 32768) >> 16; colour: RGB), then resize "
    "straight to H x W (aspect ratio not kept) with a separable triangle filter, pixel centres aligned, widened "
    "by the scale factor when shrinking (Pillow's BILINEAR with antialiasing), in float64, rounded half up to "
    "uint8 (edgepfl.kinds.pictures.resize_image; the browser page's preprocess.js is identical)"
)
NORMALIZATION = {"standardized": "x = (pixel / 255 - mean[c]) / std[c]", "scaled": "x = pixel / 255"}
OUTPUTS = "logits (batch, classes); probabilities = softmax(logits)"
# every key in file order; None: the value depends on the model or the device (metadata_props fills it)
METADATA_KEYS: tuple[tuple[str, str | None], ...] = (
    ("edgepfl_version", edgepfl.__version__),
    ("model", None),
    ("input_name", INPUT),
    ("input_layout", "NCHW"),
    ("input_shape", None),
    ("input_dtype", "float32"),
    ("resize", RESIZE_RULE),
    ("normalization", None),
    ("mean", None),
    ("std", None),
    ("outputs", OUTPUTS),
    ("num_classes", None),
    ("class_names", None),
    ("base_layout_hash", None),
    ("trained", None),
    ("last_completed_round", None),
    ("quantization", None),
)
DOC_STRING = (
    "{model} ({description}); input {input_shape} {input_layout} {input_dtype}, pre-processing in metadata_props "
    "(resize, normalization, mean, std); outputs {outputs}"
)


def metadata_props(
    manifest: Manifest, trained: bool, last_completed_round: int | None, quantization: str
) -> dict[str, str]:
    """The model file's metadata_props, in METADATA_KEYS order."""
    spec = manifest.input
    values = {
        "model": str(manifest.model.get("name", "")),
        "input_shape": json.dumps(["batch", *spec.shape]),
        "normalization": NORMALIZATION["standardized" if spec.mean else "scaled"],
        "mean": json.dumps(list(spec.mean)),
        "std": json.dumps(list(spec.std)),
        "num_classes": str(manifest.num_classes),
        "class_names": json.dumps(list(manifest.class_labels)),
        "base_layout_hash": manifest.base_layout_hash,
        "trained": "true" if trained else "false",
        "last_completed_round": "" if last_completed_round is None else str(last_completed_round),
        "quantization": quantization,
    }
    props = {key: values[key] if fixed is None else fixed for key, fixed in METADATA_KEYS}
    if manifest.kind.model_file:  # what the file says of its input instead of the image keys (edgepfl/kinds/)
        props.update(input_dtype=spec.dtype, **manifest.kind.model_file)
    return props


def doc_string(props: dict[str, str], description: str) -> str:
    """The model's doc string: the model, which device model it is, its input and outputs."""
    return DOC_STRING.format(**props, description=description)


def model_file_contract() -> dict[str, Any]:
    """What the page needs to write the file `device export-model` writes (fp32): names, texts, key order."""
    return {
        "producer_name": PRODUCER,
        "producer_version": edgepfl.__version__,
        "graph_name": GRAPH_NAME,
        "names": {"input": INPUT, "logits": LOGITS, "probabilities": PROBABILITIES},
        "metadata": [[key, fixed] for key, fixed in METADATA_KEYS],
        "normalization": NORMALIZATION,
        "doc_string": DOC_STRING,
        "input_kinds": {name: kind.model_file for name, kind in KINDS.items() if kind.model_file},
        "check_tolerance": CHECK_TOLERANCE,
    }
