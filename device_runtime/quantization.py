"""int8 for `device export-model`: onnxruntime's static QDQ quantization, then the file made compact.

Weights are int8 per output channel (MobileNet's depthwise filters differ too much for one scale per layer),
activations int8 per tensor with MinMax ranges over the calibration images; the softmax stays float.
BatchNorm is folded into the convolutions first (onnxruntime's basic optimisations, without its sharing of
equal constants: a fresh model's equal biases would share one quantisation scale). Then the file loses
what only costs bytes: copies of equal initializers (the weights' all-zero zero points, one per layer),
the long tensor names, the node names and the shape annotations. The compacted graph must compute exactly what
onnxruntime's own output computes. An int32 bias that would overflow is refused (onnxruntime 1.19 casts it
unchecked; later versions adjust the weight scale instead).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from edgepfl.errors import BundleError, DataError

CALIBRATION_BATCH = 32


def quantize_int8(fp32: Any, calibration: np.ndarray, keep_float: str) -> Any:
    """`fp32` quantized to int8 (QDQ), activation ranges from the `calibration` inputs; node `keep_float` stays."""
    import onnx
    import onnxruntime
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    input_name = fp32.graph.input[0].name

    class Batches(CalibrationDataReader):
        def __init__(self) -> None:
            self.starts = iter(range(0, len(calibration), CALIBRATION_BATCH))

        def get_next(self) -> dict[str, np.ndarray] | None:
            start = next(self.starts, None)
            return None if start is None else {input_name: calibration[start : start + CALIBRATION_BATCH]}

    with tempfile.TemporaryDirectory(prefix="edgepfl-int8-") as folder:
        paths = {name: str(Path(folder, f"{name}.onnx")) for name in ("fp32", "folded", "prepared", "int8")}
        onnx.save(fp32, paths["fp32"])
        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.optimized_model_filepath = paths["folded"]
        onnxruntime.InferenceSession(
            paths["fp32"], options, providers=["CPUExecutionProvider"], disabled_optimizers=["ConstantSharing"]
        )
        quant_pre_process(paths["folded"], paths["prepared"], skip_optimization=True, skip_symbolic_shape=True)
        try:
            # onnxruntime 1.19 casts bias / (input scale x weight scale) to int32 without a check: an overflow
            # (a bias far larger than those scales, e.g. an untrained model's) would give a wrong bias silently
            with np.errstate(invalid="raise"):
                quantize_static(
                    paths["prepared"],
                    paths["int8"],
                    Batches(),
                    quant_format=QuantFormat.QDQ,
                    per_channel=True,
                    # 7-bit weights: x86 CPUs without VNNI (AVX2 only) multiply u8 x s8 pairs into int16 sums
                    # that saturate at the full 8-bit range (onnxruntime's quantization docs): on an AVX2-only
                    # EPYC the full range cost tests/test_device_predict's cnn 7 points against fp32
                    reduce_range=True,
                    activation_type=QuantType.QInt8,
                    weight_type=QuantType.QInt8,
                    nodes_to_exclude=[keep_float],
                )
        except FloatingPointError:
            raise DataError(
                "int8 quantization would overflow a layer's int32 bias (large against its input's and weights' "
                f"scales; onnxruntime {onnxruntime.__version__} does not adjust them)",
                "export a trained model, calibrate on more varied images (--data, --calibration-samples), "
                "or export fp32",
            ) from None
        except Exception as exc:  # onnxruntime's quantizer has no error type of its own: one line, not its traceback
            lines = [line for line in str(exc).splitlines() if line.strip()]
            raise BundleError(
                f"onnxruntime could not quantize this model ({type(exc).__name__}: {lines[-1][:200] if lines else ''})",
                "export fp32 (without --quantize), or report the model to the edgepfl developers",
            ) from None
        quantized = onnx.load(paths["int8"])
    compact = compacted(quantized)
    probe = calibration[:CALIBRATION_BATCH]
    if not all(np.array_equal(a, b) for a, b in zip(_run(quantized, probe), _run(compact, probe))):
        raise BundleError(
            "the compacted int8 model computes other values than onnxruntime's quantized one",
            "report it to the edgepfl developers; export without --quantize meanwhile",
        )
    return compact


def compacted(model: Any) -> Any:
    """A copy of a QDQ model without what only costs bytes; it computes the same values."""
    import onnx
    from onnx import numpy_helper

    result = onnx.ModelProto()
    result.CopyFrom(model)
    graph = result.graph
    first: dict[tuple, str] = {}  # equal initializers (above all the weights' zero points) are stored once
    same = {}
    for init in graph.initializer:
        key = (init.data_type, tuple(init.dims), numpy_helper.to_array(init).tobytes())
        same[init.name] = first.setdefault(key, init.name)
    for node in graph.node:
        node.input[:] = [same.get(name, name) for name in node.input]
    used = {name for node in graph.node for name in node.input}
    outer = {item.name for item in (*graph.input, *graph.output)}
    names: dict[str, str] = {}

    def short(value: str) -> str:
        return value if value in outer or not value else names.setdefault(value, _short(len(names)))

    for node in graph.node:
        node.name = ""
        node.input[:] = [short(value) for value in node.input]
        node.output[:] = [short(value) for value in node.output]
    inits = [init for init in graph.initializer if init.name in used]
    for init in inits:
        init.name = names[init.name]
    del graph.initializer[:]
    graph.initializer.extend(inits)
    del graph.value_info[:]
    # onnxruntime's optimizer imports every domain it knows; a runtime that knows fewer should not have to care
    used = {node.domain for node in graph.node} | {""}
    domains = [item for item in result.opset_import if item.domain in used]
    del result.opset_import[:]
    result.opset_import.extend(domains)
    onnx.checker.check_model(result)
    return result


def _short(index: int) -> str:
    """A short unique tensor name: base 36."""
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    text = ""
    while True:
        index, digit = divmod(index, 36)
        text = digits[digit] + text
        if not index:
            return "t" + text


def _run(model: Any, x: np.ndarray) -> list[np.ndarray]:
    import onnxruntime

    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {model.graph.input[0].name: x})
