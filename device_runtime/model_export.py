"""`edgepfl device export-model`: the device's current model as one plain ONNX inference model (fp32 or int8).

The graph comes from the bundle, with the device's tensors (current base, personal part, BatchNorm statistics)
baked in as initializers: `model.onnx` where its initializers carry the manifest's names (bundles of this
version, and older ones without folded BatchNorm), else the ort-training eval graph (named graph inputs, any
batch). The portable eval graph is no inference graph: its reshapes hold the step graphs' fixed batch size.
The result takes `input` (n, C, H, W) float32 (a text bundle's: (n, seq_len) int64 token ids; a sensor bundle's:
(n, C, T) float32) and gives `logits` and `probabilities`; its metadata_props say how to pre-process an input.
int8 is onnxruntime's static QDQ quantization calibrated on the device's own training inputs. Needs the `onnx`
package (pip install 'edgepfl[deploy]').
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import edgepfl
from edgepfl.atomic import write_bytes_atomic
from edgepfl.data import LocalData
from edgepfl.device_runtime.model_metadata import (
    CHECK_TOLERANCE,
    GRAPH_NAME,
    INPUT,
    LOGITS,
    PROBABILITIES,
    PRODUCER,
    doc_string,
    metadata_props,
)
from edgepfl.device_runtime.predict import DeviceModel
from edgepfl.device_runtime.quantization import quantize_int8
from edgepfl.errors import BundleError, UsageError
from edgepfl.manifest import Manifest


@dataclass(frozen=True)
class ExportedModel:
    """What `export_device_model` wrote and what it checked."""

    path: Path
    bytes: int
    source_graph: str
    quantize: str
    fp32_bytes: int
    max_difference: float  # largest |probability| difference of the fp32 graph against the engine
    calibration_samples: int = 0
    val_accuracy_fp32: float | None = None
    val_accuracy: float | None = None  # of the written model (int8 where quantized)
    val_samples: int = 0


def export_device_model(
    model: DeviceModel,
    out: Path,
    quantize: str = "none",
    data: LocalData | None = None,
    calibration_samples: int = 512,
) -> ExportedModel:
    """Write the device's current model to `out` as a plain inference model, checked against its engine.

    int8 needs `data`: its training part calibrates the activation ranges, its held-out part measures both
    models' accuracy."""
    manifest = model.engine.manifest
    out = Path(out)
    if out.is_dir():
        raise UsageError(f"--out {out} is a folder", "pass the path of the .onnx file to write")
    if quantize not in ("none", "int8"):
        raise UsageError(f"unknown quantization {quantize!r}", "use none or int8")
    if quantize == "int8" and (data is None or not data.num_train):
        raise UsageError("int8 quantization is calibrated on the device's training data", "pass --data as for train")
    proto, source, image_input, logits = inference_graph(model.engine.bundle_dir, manifest)
    fp32 = bake(proto, image_input, logits, model.engine.get_tensors(), manifest)
    set_metadata(fp32, model, "none")
    probe = _probe_inputs(manifest, data)
    difference = compare_with_engine(fp32, model, probe)
    written, calibrated = fp32, 0
    if quantize == "int8":
        assert data is not None
        calibration = _training_inputs(data, calibration_samples)
        written, calibrated = quantize_int8(fp32, calibration, PROBABILITIES), len(calibration)
        set_metadata(written, model, f"int8: static QDQ, per-channel weights, calibrated on {calibrated} images")
    payload = written.SerializeToString()
    try:
        write_bytes_atomic(out, payload)
    except OSError as exc:
        raise UsageError(f"cannot write {out} ({exc.strerror or exc})", "choose another --out") from None
    accuracy: dict[str, Any] = {}
    if data is not None and data.num_val:
        accuracy = {
            "val_accuracy_fp32": held_out_accuracy(fp32, data),
            "val_accuracy": held_out_accuracy(written, data),
            "val_samples": data.num_val,
        }
    return ExportedModel(out, len(payload), source, quantize, fp32.ByteSize(), difference, calibrated, **accuracy)


def inference_graph(bundle_dir: Path, manifest: Manifest) -> tuple[Any, str, str, str]:
    """(graph, its path in the bundle, image input, logits output) of the bundle graph that names every tensor."""
    onnx = _import_onnx()
    names = {spec.name for spec in manifest.tensors}
    path = bundle_dir / "model.onnx"
    if path.is_file():
        proto = onnx.load(str(path))
        if names <= {init.name for init in proto.graph.initializer}:
            return proto, "model.onnx", proto.graph.input[0].name, proto.graph.output[0].name
    entry = manifest.engines.get("ort-training") or {}
    sets = entry.get("sets") or {}
    if sets:
        relative = sets["full" if "full" in sets else next(iter(sets))]["eval_model"]
        proto = onnx.load(str(bundle_dir / relative))
        if names <= {item.name for item in proto.graph.input}:
            return proto, relative, entry.get("input_name", INPUT), LOGITS
    raise BundleError(
        "the bundle has no inference graph that names its tensors (its model.onnx has BatchNorm folded into the "
        "convolutions, an older export, and it has no ort-training eval graph)",
        "re-export the bundle with this edgepfl version; the state folder stays usable (same base layout)",
    )


def bake(proto: Any, image_input: str, logits: str, tensors: Mapping[str, np.ndarray], manifest: Manifest) -> Any:
    """A copy of `proto` computing `logits` and `probabilities` from `input` alone, `tensors` as initializers."""
    onnx = _import_onnx()
    from onnx import helper, numpy_helper

    model = onnx.ModelProto()
    model.CopyFrom(proto)
    graph = model.graph
    _rename(graph, {image_input: INPUT, logits: LOGITS})
    graph.node.append(helper.make_node("Softmax", [LOGITS], [PROBABILITIES], name="probabilities", axis=1))
    _prune(graph, [LOGITS, PROBABILITIES])
    kept = [init for init in graph.initializer if init.name not in tensors]
    used = {name for node in graph.node for name in node.input}
    baked = [numpy_helper.from_array(np.ascontiguousarray(tensors[name]), name) for name in tensors if name in used]
    del graph.initializer[:]
    graph.initializer.extend(init for init in kept + baked if init.name in used)
    image = next(item for item in graph.input if item.name == INPUT)
    del graph.input[:]
    graph.input.append(image)
    dims = image.type.tensor_type.shape.dim
    del dims[:]
    for size in ("batch", *manifest.input.shape):
        dims.add().CopyFrom(_dim(size))
    logits_info = next(item for item in graph.output if item.name == LOGITS)
    del graph.output[:]
    classes = ["batch", manifest.num_classes]
    graph.output.extend([logits_info, helper.make_tensor_value_info(PROBABILITIES, onnx.TensorProto.FLOAT, classes)])
    produced = {name for node in graph.node for name in node.output}
    kept_info = [info for info in graph.value_info if info.name in produced]
    del graph.value_info[:]
    graph.value_info.extend(kept_info)
    graph.name = GRAPH_NAME
    onnx.checker.check_model(model)
    return model


def set_metadata(model: Any, device: DeviceModel, quantization: str) -> None:
    """The model's metadata_props: how to pre-process an image, the classes, and which device model this is."""
    props = metadata_props(device.engine.manifest, device.trained, device.last_completed_round, quantization)
    del model.metadata_props[:]
    for key, value in props.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    model.producer_name, model.producer_version = PRODUCER, edgepfl.__version__
    model.doc_string = doc_string(props, device.description)


def compare_with_engine(model: Any, device: DeviceModel, x: np.ndarray) -> float:
    """The largest probability difference between the graph (plain onnxruntime) and the device's engine."""
    got = _session(model).run([PROBABILITIES], {INPUT: x})[0]
    want = device.engine.predict(x)
    difference = float(np.abs(got - want).max())
    if not difference <= CHECK_TOLERANCE:
        raise BundleError(
            f"the exported model's probabilities differ from the device engine's by {difference:.3g}",
            "re-export the bundle with this edgepfl version, or report it to the edgepfl developers",
        )
    return difference


def held_out_accuracy(model: Any, data: LocalData) -> float:
    """Top-1 accuracy of a graph on the held-out samples (a next-word model's graph answers at each sample's last
    real position: its target there, where the metric counts it)."""
    session = _session(model)
    correct, count = 0.0, 0.0
    for x, y in data.val_batches(256):
        weights = data.kind.target_weights(y, scoring=True)
        # the target (and its weight) the graph's logits answer: the kind reads them where it reads the logits
        target = data.kind.prediction_logits(y[..., None], x)[:, 0]
        weight = data.kind.prediction_logits(weights[..., None], x)[:, 0]
        correct += float(((session.run([LOGITS], {INPUT: x})[0].argmax(axis=1) == target) * weight).sum())
        count += float(weight.sum())
    return correct / max(count, 1.0)


def _probe_inputs(manifest: Manifest, data: LocalData | None, count: int = 8) -> np.ndarray:
    """Inputs on which the baked graph must match the engine: the device's own images where given, else noise."""
    if data is not None and data.num_train:
        return _training_inputs(data, count)
    rng, shape = np.random.default_rng(0), (count, *manifest.input.shape)
    if manifest.input.dtype.startswith("int"):  # token ids of the vocabulary
        return rng.integers(0, manifest.num_classes, shape).astype(np.dtype(manifest.input.dtype))
    return rng.normal(size=shape).astype(np.float32)


def _training_inputs(data: LocalData, count: int) -> np.ndarray:
    """Up to `count` normalised training inputs, in stored order."""
    batches = []
    for x, _ in data.train_batches_in_order(256):
        batches.append(x)
        if sum(len(b) for b in batches) >= count:
            break
    return np.concatenate(batches)[:count]


def _session(model: Any) -> Any:
    import onnxruntime

    return onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _rename(graph: Any, names: Mapping[str, str]) -> None:
    """Rename tensors everywhere in the graph (its inputs, outputs and node connections)."""
    for node in graph.node:
        node.input[:] = [names.get(name, name) for name in node.input]
        node.output[:] = [names.get(name, name) for name in node.output]
    for item in (*graph.input, *graph.output, *graph.value_info):
        item.name = names.get(item.name, item.name)


def _prune(graph: Any, outputs: list[str]) -> None:
    """Keep only the nodes the outputs depend on, in their order."""
    needed = set(outputs)
    kept = []
    for node in reversed(graph.node):
        if needed & set(node.output):
            kept.append(node)
            needed |= set(node.input)
    del graph.node[:]
    graph.node.extend(reversed(kept))


def _dim(size: int | str) -> Any:
    from onnx import TensorShapeProto

    dim = TensorShapeProto.Dimension()
    if isinstance(size, str):
        dim.dim_param = size
    else:
        dim.dim_value = size
    return dim


def _import_onnx() -> Any:
    try:
        import onnx
    except ImportError:
        raise UsageError("export-model needs the onnx package", "pip install 'edgepfl[deploy]'") from None
    return onnx
