"""Removes what the exporter leaves in a step graph that computes nothing: Constant nodes (made initializers), a
Reshape or Expand to the shape its input already has, a Reshape of a Reshape, a Transpose of a Transpose, a
Transpose that moves only axes of size 1 (a Reshape), and a matrix transposed for a product (Gemm transposes
its operands itself; the exporter transposes every Linear layer's weight before its Gemm). Each is one more node
(a dispatch on WebGPU, a copy on every engine); onnxscript's optimizer keeps them where the shapes are known only
after shape inference.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.numpy_helper

SHAPE_OPS = ("Reshape", "Expand")
FOLDED_OPS = (*SHAPE_OPS, "Transpose")  # what a collapsed chain or a Gemm's operand can leave unused


def drop_shape_copies(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The graph with no-op Reshape/Expand/Transpose nodes bypassed, Reshape and Transpose chains collapsed, a
    Transpose of only size-1 axes made a Reshape and a 2-D product's transposed operand read by a Gemm; outputs keep
    their names and the results their values."""
    graph = proto.graph
    shapes = _static_shapes(proto)
    producer = {output: node for node in graph.node for output in node.output}
    outputs = {spec.name for spec in graph.output}
    constants = {tensor.name: tensor for tensor in graph.initializer}
    renamed: dict[str, str] = {}  # a removed node's output -> the value that replaces it
    kept = []
    for node in graph.node:
        node.input[:] = [renamed.get(name, name) for name in node.input]
        if node.op_type == "Transpose":
            _collapse_transposes(node, producer)
            perm = _permutation(node)  # empty where left out: the axes reversed, not the identity
            if node.output[0] not in outputs and perm and perm == sorted(perm):
                renamed[node.output[0]] = node.input[0]
                continue
            _as_reshape_if_order_kept(node, shapes, constants, graph)
        if node.op_type in ("MatMul", "Gemm"):
            _read_transposed_operands(node, producer, shapes)
        if node.op_type in SHAPE_OPS and node.output[0] not in outputs:
            before = producer.get(node.input[0])
            if node.op_type == "Reshape" and before is not None and before.op_type == "Reshape":
                if _copies_no_dimension(node, constants):
                    # a Reshape to given sizes does not depend on how its input was shaped
                    node.input[0] = before.input[0]
            source, result = node.input[0], node.output[0]
            if shapes.get(source) is not None and shapes.get(source) == shapes.get(result):
                renamed[result] = source
                continue
        kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    stale = [value for value in graph.value_info if value.name in renamed]
    for value in stale:
        graph.value_info.remove(value)
    used = {name for node in graph.node for name in node.input} | outputs
    # a collapsed chain's first node, or a transposed operand's Transpose, may now feed nothing
    while True:
        dead = [n for n in graph.node if n.op_type in FOLDED_OPS and not any(o in used for o in n.output)]
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


def _permutation(transpose: onnx.NodeProto) -> list[int]:
    """A Transpose's perm (an empty list where left out: the axes reversed, which no exported graph uses)."""
    return next((list(a.ints) for a in transpose.attribute if a.name == "perm"), [])


def _collapse_transposes(node: onnx.NodeProto, producer: dict[str, onnx.NodeProto]) -> None:
    """A Transpose of a Transpose as one Transpose of the first one's input (their permutations composed)."""
    before = producer.get(node.input[0])
    if before is None or before.op_type != "Transpose" or not _permutation(before) or not _permutation(node):
        return
    first, then = _permutation(before), _permutation(node)
    node.input[0] = before.input[0]
    del node.attribute[:]
    node.attribute.append(onnx.helper.make_attribute("perm", [first[axis] for axis in then]))


def _as_reshape_if_order_kept(
    node: onnx.NodeProto, shapes: dict, constants: dict[str, onnx.TensorProto], graph: onnx.GraphProto
) -> None:
    """A Transpose that moves only axes of size 1 (the elements keep their order) as a Reshape to its shape,
    which the Reshape rules then collapse into its neighbours."""
    shape, perm = shapes.get(node.input[0]), _permutation(node)
    if shape is None or not perm or node.output[0] not in shapes:
        return
    moved = [axis for axis in perm if shape[axis] != 1]
    if moved != sorted(moved):
        return
    target = onnx.numpy_helper.from_array(np.array(shapes[node.output[0]], np.int64), f"{node.output[0]}__shape")
    graph.initializer.append(target)
    constants[target.name] = target
    node.op_type = "Reshape"
    del node.attribute[:]
    node.input.append(target.name)


def _read_transposed_operands(node: onnx.NodeProto, producer: dict[str, onnx.NodeProto], shapes: dict) -> None:
    """A product of 2-D matrices (a MatMul or a Gemm) of which an operand is a Transpose's output as a Gemm of its
    input, that operand's transA/transB flipped."""
    if node.op_type == "MatMul" and any(len(shapes.get(name, ())) != 2 for name in node.input):
        return
    flags = {a.name: a.i for a in node.attribute if a.name in ("transA", "transB")}
    folded = False
    for position, flag in enumerate(("transA", "transB")):
        before = producer.get(node.input[position])
        if before is not None and before.op_type == "Transpose" and _permutation(before) == [1, 0]:
            node.input[position] = before.input[0]
            flags[flag] = 1 - flags.get(flag, 0)
            folded = True
    if folded:
        node.op_type = "Gemm"
        kept = [a for a in node.attribute if a.name not in flags]
        del node.attribute[:]
        node.attribute.extend([*kept, *(onnx.helper.make_attribute(name, value) for name, value in flags.items())])


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
