"""The bundle's `model.onnx`: the plain inference graph, its initializers named as the manifest's tensors.

`edgepfl device export-model` bakes a device's tensors into this graph by name, so every tensor must keep its
name: BatchNorm stays a node (onnxruntime folds it into the convolution when it loads the model), and the
trace runs on distinct stand-in values, because the exporter merges initializers of equal value (fresh
BatchNorm layers are all ones and zeros). The real values are written back by name and the graph is checked
against the module's eval logits; a model whose trace depends on its values falls back to the folded export.
A model taught a target at every position (a next-word model, right-padded token ids) gets a last step that reads
its logits at each row's last real position (not <pad> = 0), so that the graph answers what follows the input.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch import nn

from edgepfl.export.masked import StepShape

INFERENCE_OPSET = 17


def export_inference(model: nn.Module, input_shape: Sequence[int] | StepShape, path: Path) -> bool:
    """Write `model.onnx`; True when its initializers name every state tensor (False: the folded fallback).
    `input_shape` is one float sample's shape, or a StepShape (which also gives the input's dtype)."""
    shape = _step_shape(input_shape)
    model.eval()
    real = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            for tensor in model.state_dict().values():  # the state_dict's tensors share the module's storage
                if tensor.is_floating_point():
                    tensor.copy_(torch.rand(tensor.shape, generator=generator) + 0.5)  # > 0: a valid running_var
        _export(model, shape, path, torch.onnx.TrainingMode.PRESERVE)
    finally:
        model.load_state_dict(real)
    proto = onnx.load(str(path))
    named = {init.name for init in proto.graph.initializer}
    for init in proto.graph.initializer:
        if init.name in real:
            init.CopyFrom(numpy_helper.from_array(real[init.name].cpu().numpy(), init.name))
    wanted = {name for name, tensor in real.items() if tensor.is_floating_point() and tensor.numel()}
    if wanted <= named and _same_logits(model, proto, shape):
        onnx.save(_last_position(proto, shape), str(path))
        return True
    _export(model, shape, path, torch.onnx.TrainingMode.EVAL)
    onnx.save(_last_position(onnx.load(str(path)), shape), str(path))
    return False


def _last_position(proto: onnx.ModelProto, shape: StepShape) -> onnx.ModelProto:
    """For a model with a target at every position: `logits` (batch, classes) read at each row's last input id that
    is not <pad> (0; the first position for a row of padding only), from the model's (batch, positions, classes), as
    edgepfl.text.last_positions reads it; other models as they are."""
    if not shape.target_shape:
        return proto
    graph, steps = proto.graph, shape.input_shape[0]
    every = "logits_every_position"
    for node in graph.node:
        node.output[:] = [every if name == "logits" else name for name in node.output]
    const = onnx.helper.make_tensor
    graph.initializer.extend(
        [
            const("last_position_zero", onnx.TensorProto.INT64, [], [0]),
            const("last_position_steps", onnx.TensorProto.INT64, [steps], list(range(steps))),
            const("last_position_axis1", onnx.TensorProto.INT64, [1], [1]),
            const("last_position_axis2", onnx.TensorProto.INT64, [1], [2]),
            const("last_position_shape", onnx.TensorProto.INT64, [3], [1, 1, shape.num_classes]),
        ]
    )
    make = onnx.helper.make_node
    graph.node.extend(
        [
            make("Equal", ["input", "last_position_zero"], ["last_position_pad"]),
            make("Not", ["last_position_pad"], ["last_position_real"]),
            make("Cast", ["last_position_real"], ["last_position_flags"], to=onnx.TensorProto.INT64),
            make("Mul", ["last_position_flags", "last_position_steps"], ["last_position_real_steps"]),
            make("ReduceMax", ["last_position_real_steps"], ["last_position_index"], axes=[1], keepdims=1),
            make("Unsqueeze", ["last_position_index", "last_position_axis2"], ["last_position_index3"]),
            make("Expand", ["last_position_index3", "last_position_shape"], ["last_position_gather"]),
            make("GatherElements", [every, "last_position_gather"], ["last_position_rows"], axis=1),
            make("Squeeze", ["last_position_rows", "last_position_axis1"], ["logits"]),
        ]
    )
    for info in [info for info in graph.value_info if info.name == "logits"]:
        graph.value_info.remove(info)
    del graph.output[:]
    graph.output.append(
        onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["batch", shape.num_classes])
    )
    onnx.checker.check_model(proto)
    return proto


def _step_shape(input_shape: Sequence[int] | StepShape) -> StepShape:
    return input_shape if isinstance(input_shape, StepShape) else StepShape(tuple(input_shape), 1)


def _export(
    model: nn.Module, input_shape: Sequence[int] | StepShape, path: Path, mode: torch.onnx.TrainingMode
) -> None:
    shape = _step_shape(input_shape)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(constant folding|training).*")
        torch.onnx.export(
            model,
            (shape.zeros(1),),
            str(path),
            input_names=["input"],
            output_names=["logits"],
            dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
            opset_version=INFERENCE_OPSET,
            do_constant_folding=mode != torch.onnx.TrainingMode.PRESERVE,
            training=mode,
            dynamo=False,
        )


def _same_logits(model: nn.Module, proto: onnx.ModelProto, shape: StepShape) -> bool:
    """Whether the graph computes the module's eval logits on two seeded inputs."""
    import onnxruntime

    x = shape.random(2, torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x).cpu().numpy()
    session = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {"input": x.numpy()})[0]
    return bool(np.allclose(got, want, rtol=1e-3, atol=1e-4))
