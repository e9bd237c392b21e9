"""A step graph's *frozen* variant: the tensors the step passes through unchanged become initializers.

A personal-only step passes the base through (its new value is an Identity of its input), and a base-only
step the personal part. As graph inputs, those tensors are not constant to onnxruntime, so a convolution on a
frozen weight runs the generic kernel. The variant declares them as initializers instead, with their data
*external* and absent from the bundle: the portable engine hands their current values to onnxruntime when it
builds the session (`SessionOptions.add_external_initializers`), and onnxruntime then pre-packs the constant
weights (its blocked NCHWc kernels on x86). The variant has no outputs for them: they do not change.

On an AVX2 host mobilenet_v2's 96 px personal-only step ran 1.3-1.5x faster this way (`bench/frozen_base.py`,
`bench/engines.py`; docs/own-model.md). The graph holds no weights, so a bundle grows by the graph's
structure alone; a tool that loads it with its external data (`onnx.load` by default) finds no data file:
load it with `load_external_data=False`.
"""

from __future__ import annotations

import onnx

# where the variant says its frozen tensors' bytes are: never written; the engine supplies them in memory. The
# offsets are those of the frozen tensors laid end to end in the variant's order, so a runtime that takes one
# external-data buffer (onnxruntime-web's `externalData` option) can be handed their concatenation.
FROZEN_LOCATION = "frozen-tensors-supplied-by-the-engine.bin"


def frozen_inputs(graph: onnx.GraphProto, inputs: list[str], outputs: list[str]) -> list[str]:
    """The state inputs a step passes through unchanged: the output paired with each is an Identity of it."""
    producer = {output: node for node in graph.node for output in node.output}
    return [
        name
        for name, output in zip(inputs, outputs)
        if output in producer and producer[output].op_type == "Identity" and producer[output].input[0] == name
    ]


def frozen_variant(proto: onnx.ModelProto, state_count: int) -> tuple[onnx.ModelProto | None, list[str]]:
    """(the variant, its frozen input names) of a step graph whose first `state_count` inputs are the state
    and whose outputs are the loss followed by the new state in the same order; (None, []) if none is frozen."""
    graph = proto.graph
    inputs = [spec.name for spec in graph.input[:state_count]]
    outputs = [spec.name for spec in graph.output[1 : state_count + 1]]
    frozen = frozen_inputs(graph, inputs, outputs)
    if not frozen:
        return None, []
    variant = onnx.ModelProto()
    variant.CopyFrom(proto)
    frozen_set = set(frozen)
    dropped = {output for name, output in zip(inputs, outputs) if name in frozen_set}
    specs = {spec.name: spec for spec in graph.input}
    consumed = {name for node in graph.node for name in node.input}
    _retain(
        variant.graph.node,
        lambda node: not (node.op_type == "Identity" and node.output[0] in dropped and node.output[0] not in consumed),
    )
    _retain(variant.graph.output, lambda spec: spec.name not in dropped)
    _retain(variant.graph.input, lambda spec: spec.name not in frozen_set)
    offset = 0
    for name in frozen:
        tensor_type = specs[name].type.tensor_type
        if not all(dim.HasField("dim_value") for dim in tensor_type.shape.dim):
            raise ValueError(f"state input {name} has no fixed shape")  # the exporter's graphs always do
        shape = [dim.dim_value for dim in tensor_type.shape.dim]
        initializer = onnx.TensorProto(name=name, data_type=tensor_type.elem_type, dims=shape)
        initializer.data_location = onnx.TensorProto.EXTERNAL
        size = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type).itemsize
        for dim in shape:
            size *= dim
        for key, value in (("location", FROZEN_LOCATION), ("offset", str(offset)), ("length", str(size))):
            entry = initializer.external_data.add()
            entry.key, entry.value = key, value
        variant.graph.initializer.append(initializer)
        offset += size
    return variant, frozen


def _retain(field, keep) -> None:
    """Keep the items of a repeated protobuf field for which `keep` is true, in order."""
    kept = [item for item in field if keep(item)]
    del field[:]
    field.extend(kept)
