"""A step graph's *frozen* variant: the tensors the step passes through unchanged become initializers.

A personal-only step passes the base through (the step graph has no output for it), and a base-only step the
personal part. As graph inputs, those tensors are not constant to onnxruntime, so a convolution on a
frozen weight runs the generic kernel. The variant declares them as initializers instead, with their data
*external* and absent from the bundle: the portable engine hands their current values to onnxruntime when it
builds the session (`SessionOptions.add_external_initializers`), and onnxruntime then pre-packs the constant
weights (its blocked NCHWc kernels on x86). Its outputs are the plain graph's.

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


def frozen_variant(proto: onnx.ModelProto, frozen: list[str]) -> onnx.ModelProto | None:
    """The variant of a step graph that passes the state inputs `frozen` through (it has no output for them); None
    when it passes none through."""
    if not frozen:
        return None
    graph = proto.graph
    variant = onnx.ModelProto()
    variant.CopyFrom(proto)
    frozen_set = set(frozen)
    specs = {spec.name: spec for spec in graph.input}
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
    return variant


def _retain(field, keep) -> None:
    """Keep the items of a repeated protobuf field for which `keep` is true, in order."""
    kept = [item for item in field if keep(item)]
    del field[:]
    field.extend(kept)
