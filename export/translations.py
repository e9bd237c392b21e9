"""The custom ops of the step graphs as ONNX, one node each: the exporter's translation table.

Each op (masked.py's BatchNorm parts, activations.positive, decompositions.plain_convolution, crossentropy's label
ops) is one or two nodes here
where PyTorch's tracing of its body would be several: one dispatch on WebGPU, one kernel on every engine."""

from __future__ import annotations

from edgepfl.export import crossentropy, decompositions, masked
from edgepfl.export.activations import POSITIVE_SLOPE, positive


def translation_table() -> dict:
    """torch.onnx.export's custom_translation_table: each custom op's overload -> its ONNX function."""
    return {
        masked.weighted_rows._opoverload: _weighted_rows,
        masked.normalize._opoverload: _normalize,
        masked.pixel_squares._opoverload: _pixel_squares,
        positive._opoverload: _positive,
        decompositions.plain_convolution._opoverload: _plain_convolution,
        crossentropy.label_logits._opoverload: _label_logits,
        crossentropy.add_at_labels._opoverload: _add_at_labels,
    }


def _weighted_rows(row, rows):  # noqa: ANN001, ANN202
    """masked.weighted_rows as ONNX: one MatMul of the (N,) vector and the (N, C) matrix."""
    from onnxscript import opset20

    return opset20.MatMul(row, rows)


def _plain_convolution(x, kernel, padding: list[int], dilation: list[int], groups: int):  # noqa: ANN001, ANN202
    """decompositions.plain_convolution as ONNX: one Conv."""
    from onnxscript import opset20

    return opset20.Conv(x, kernel, pads=[*padding, *padding], dilations=dilation, group=groups)


def _positive(x):  # noqa: ANN001, ANN202
    """activations.positive as ONNX: one HardSigmoid, max(0, min(1, x · 2^127))."""
    from onnxscript import opset20

    return opset20.HardSigmoid(x, alpha=POSITIVE_SLOPE, beta=0.0)


def _pixel_squares(values):  # noqa: ANN001, ANN202
    """masked.pixel_squares as ONNX: one ReduceSumSquare over the map axes."""
    from onnxscript import opset20

    return opset20.ReduceSumSquare(values, [2, 3], keepdims=0)


def _normalize(x, scale, bias, mean, var, eps: float):  # noqa: ANN001, ANN202
    """masked.normalize as ONNX: one inference-mode BatchNormalization node."""
    from onnxscript import opset20

    return opset20.BatchNormalization(x, scale, bias, mean, var, epsilon=eps, training_mode=0)


def _label_logits(logits, labels):  # noqa: ANN001, ANN202
    """crossentropy.label_logits as ONNX: one GatherElements on the int32 labels."""
    from onnxscript import opset20

    return opset20.GatherElements(logits, labels, axis=1)


def _add_at_labels(values, labels, amounts):  # noqa: ANN001, ANN202
    """crossentropy.add_at_labels as ONNX: each label's value plus its amount, written back by one ScatterElements
    (no `reduction`, which not every back end's kernel takes)."""
    from onnxscript import opset20

    updates = opset20.Add(opset20.GatherElements(values, labels, axis=1), amounts)
    return opset20.ScatterElements(values, labels, updates, axis=1)
