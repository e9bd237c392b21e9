"""Which nodes of a portable graph onnxruntime-web's WebGPU back end is known not to run, and why.

A browser trains a graph on the GPU only when onnxruntime-web places every node of it there (the engine
opens WebGPU sessions with CPU fallback disabled: a step that copied tensors between the GPU and the CPU at
every node boundary would be slower than WebAssembly). What is checked here was measured on onnxruntime-web
1.30 (tests/test_web_browser.py asserts the placement of the zoo's graphs): its WebGPU kernels take no int64
or float64 tensors (int64 support is an execution-provider option that onnxruntime-web does not pass), and
some ops have no WebGPU kernel at all. The exporter writes what it finds into the manifest (`webgpu_problems`
of each graph), so that the browser can say why a graph runs on WebAssembly; an empty list means no known
problem, and the browser still lets onnxruntime-web decide.
"""

from __future__ import annotations

import onnx

# ops without a WebGPU kernel in onnxruntime-web 1.30, measured (SoftmaxCrossEntropyLoss expands to a LogSoftmax;
# ScatterElements, ScatterND, GatherElements and an expanded NegativeLogLikelihoodLoss do run there, on int32 indices;
# BatchNormalization runs there in inference mode only)
NO_KERNEL = frozenset({"LogSoftmax", "OneHot", "SoftmaxCrossEntropyLoss"})
# tensor types that no WebGPU kernel takes
NO_KERNEL_TYPES = {onnx.TensorProto.INT64: "int64", onnx.TensorProto.DOUBLE: "float64"}
# inputs that a WebGPU kernel reads on the CPU side (shapes, axes, pads): int64 is their type, and fine
SHAPE_INPUTS = {
    "Reshape": {1},
    "Expand": {1},
    "Slice": {1, 2, 3, 4},
    "Unsqueeze": {1},
    "Squeeze": {1},
    "Pad": {1, 3},
    "ConstantOfShape": {0},
    "Tile": {1},
    "Split": {1},
    "Resize": {1, 2, 3},
    "CumSum": {1},
    **{op: {1} for op in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceSumSquare")},
}
MAX_LISTED = 5  # problems listed per graph; the count of the rest follows


def webgpu_problems(proto: onnx.ModelProto) -> list[str]:
    """One line per node the WebGPU back end would leave to the CPU ('node NAME (OP): why'), at most MAX_LISTED
    and then how many more; also a graph input without a fixed shape. Empty when none is known."""
    graph = onnx.shape_inference.infer_shapes(proto, strict_mode=False).graph
    types = {value.name: value.type.tensor_type.elem_type for value in [*graph.input, *graph.value_info, *graph.output]}
    types.update({tensor.name: tensor.data_type for tensor in graph.initializer})
    problems = [
        f"input {value.name} has no fixed shape"
        for value in graph.input
        if not all(dim.HasField("dim_value") for dim in value.type.tensor_type.shape.dim)
    ]
    for node in graph.node:
        if node.op_type == "Constant":  # folded when the session is built
            continue
        why = _why(node, types)
        if why:
            problems.append(f"node {node.name or node.output[0]} ({node.op_type}): {why}")
    if len(problems) > MAX_LISTED:
        problems = [*problems[:MAX_LISTED], f"and {len(problems) - MAX_LISTED} more"]
    return problems


def _why(node: onnx.NodeProto, types: dict[str, int]) -> str:
    if node.domain not in ("", "ai.onnx"):
        return f"domain {node.domain} has no WebGPU kernels"
    if node.op_type in NO_KERNEL:
        return "no WebGPU kernel"
    if node.op_type == "BatchNormalization" and any(a.name == "training_mode" and a.i for a in node.attribute):
        return "training-mode BatchNormalization has no WebGPU kernel (inference mode has)"
    shape_inputs = SHAPE_INPUTS.get(node.op_type, set())
    values = [name for i, name in enumerate(node.input) if name and i not in shape_inputs]
    for name in [*values, *(name for name in node.output if name)]:
        if types.get(name) in NO_KERNEL_TYPES:
            return f"{name} is {NO_KERNEL_TYPES[types[name]]}, which no WebGPU kernel takes"
    return ""
