"""Removes what the exporter leaves in a step graph that computes nothing: Constant nodes (made initializers), a
Reshape or Expand to the shape its input already has, and a Reshape of a Reshape. Each is one more node (a dispatch
on WebGPU, a copy on every engine); onnxscript's optimizer keeps them where the shapes are known only after shape
inference.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.numpy_helper

SHAPE_OPS = ("Reshape", "Expand")


def drop_shape_copies(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The graph with no-op Reshape/Expand nodes bypassed and Reshape chains collapsed; outputs keep their names."""
    graph = proto.graph
    shapes = _static_shapes(proto)
    producer = {output: node for node in graph.node for output in node.output}
    outputs = {spec.name for spec in graph.output}
    constants = {tensor.name: tensor for tensor in graph.initializer}
    renamed: dict[str, str] = {}  # a removed node's output -> the value that replaces it
    kept = []
    for node in graph.node:
        node.input[:] = [renamed.get(name, name) for name in node.input]
        if node.op_type in SHAPE_OPS and node.output[0] not in outputs:
            source, result = node.input[0], node.output[0]
            if shapes.get(source) is not None and shapes.get(source) == shapes.get(result):
                renamed[result] = source
                continue
            before = producer.get(source)
            if node.op_type == "Reshape" and before is not None and before.op_type == "Reshape":
                if _copies_no_dimension(node, constants):
                    # a Reshape to given sizes does not depend on how its input was shaped
                    node.input[0] = before.input[0]
        kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    stale = [value for value in graph.value_info if value.name in renamed]
    for value in stale:
        graph.value_info.remove(value)
    used = {name for node in graph.node for name in node.input} | outputs
    # a collapsed chain's first Reshape may now feed nothing
    while True:
        dead = [n for n in graph.node if n.op_type in SHAPE_OPS and not any(o in used for o in n.output)]
        if not dead:
            break
        dead_ids = {id(n) for n in dead}
        alive = [n for n in graph.node if id(n) not in dead_ids]
        del graph.node[:]
        graph.node.extend(alive)
        used = {name for node in graph.node for name in node.input} | outputs
    unused = [tensor for tensor in graph.initializer if tensor.name not in used]  # the removed nodes' sizes
    for tensor in unused:
        graph.initializer.remove(tensor)
    return proto


def constants_as_initializers(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The graph with each Constant node's value held as an initializer of the same name (a graph output's
    Constant, or one of an unusual form, stays a node)."""
    graph = proto.graph
    outputs = {spec.name for spec in graph.output}
    kept = []
    for node in graph.node:
        value = _constant_value(node) if node.output[0] not in outputs else None
        if value is None:
            kept.append(node)
        else:
            value.name = node.output[0]
            graph.initializer.append(value)
    del graph.node[:]
    graph.node.extend(kept)
    return proto


def _constant_value(node: onnx.NodeProto) -> onnx.TensorProto | None:
    """A Constant node's value as a tensor (None: another node, or a sparse or string value)."""
    if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.attribute) != 1:
        return None
    attribute = node.attribute[0]
    if attribute.name == "value":
        value = onnx.TensorProto()
        value.CopyFrom(attribute.t)
        return value
    arrays = {
        "value_float": lambda: np.array(attribute.f, np.float32),
        "value_floats": lambda: np.array(attribute.floats, np.float32),
        "value_int": lambda: np.array(attribute.i, np.int64),
        "value_ints": lambda: np.array(attribute.ints, np.int64),
    }
    array = arrays.get(attribute.name)
    return None if array is None else onnx.numpy_helper.from_array(array())


def _copies_no_dimension(reshape: onnx.NodeProto, constants: dict[str, onnx.TensorProto]) -> bool:
    """Whether a Reshape's target sizes are a constant without 0 (a 0 copies the input's dimension)."""
    target = constants.get(reshape.input[1])
    return target is not None and 0 not in onnx.numpy_helper.to_array(target).tolist()


def _static_shapes(proto: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Every value's shape where shape inference gives all its dimensions as numbers."""
    inferred = onnx.shape_inference.infer_shapes(proto)
    shapes = {}
    graph = inferred.graph
    for value in list(graph.input) + list(graph.value_info) + list(graph.output):
        dims = value.type.tensor_type.shape.dim
        if value.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            shapes[value.name] = tuple(d.dim_value for d in dims)
    for tensor in graph.initializer:
        shapes[tensor.name] = tuple(tensor.dims)
    return shapes
