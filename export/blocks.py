"""Blocks of any nn.Module: declared by the model, known for torchvision's families, or its top-level children.

K_P counts blocks from the classifier end, so every parameter and buffer must fall in exactly one block.
The protocol a model may implement (checked before anything else):

    def edgepfl_blocks(self) -> list[tuple[str, list[str]]]:
        # ordered from the input to the classifier: (block name, [submodule or tensor names])
        return [("stem", ["conv", "bn"]), ("body", ["layers"]), ("head", ["fc"])]
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from edgepfl.errors import UsageError
from edgepfl.manifest import _DTYPE_BYTES, TensorSpec

BlockList = list[tuple[str, list[str]]]
PROTOCOL = "edgepfl_blocks"


def find_blocks(module: nn.Module) -> tuple[BlockList, str]:
    """(blocks, where they came from): the model's own `edgepfl_blocks()`, a torchvision family, or its children."""
    declared = getattr(module, PROTOCOL, None)
    if callable(declared):
        return _normalise(declared(), f"{type(module).__name__}.{PROTOCOL}()"), "declared by the model"
    known = _torchvision_blocks(module)
    if known is not None:
        return known, f"torchvision {type(module).__name__} structure"
    children = [(name, [name]) for name, child in module.named_children() if _has_tensors(child)]
    return children, "top-level children"


def check_blocks(module: nn.Module, blocks: BlockList) -> None:
    """Every parameter and buffer in exactly one block; one line naming the first orphan or double otherwise."""
    if not blocks:
        raise UsageError("the model has no blocks (no submodule holds a tensor)", f"declare {PROTOCOL}()")
    names = [name for name, _ in blocks]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise UsageError(f"block name {repeated[0]!r} is used twice", "give every block its own name")
    tensors = dict(module.named_parameters())
    tensors.update(dict(module.named_buffers()))
    for block, prefixes in blocks:
        for prefix in prefixes:
            if prefix not in tensors and not any(t.startswith(prefix + ".") for t in tensors):
                raise UsageError(
                    f"block {block!r} names {prefix!r}, which is no submodule or tensor of the model holding a tensor",
                    "list submodule names as in model.named_modules()",
                )
    for tensor in tensors:
        owners = [block for block, prefixes in blocks if any(_owns(p, tensor) for p in prefixes)]
        if not owners:
            raise UsageError(
                f"tensor {tensor!r} belongs to no block",
                f"add its module to a block in {PROTOCOL}() (or pass blocks=...)",
            )
        if len(owners) > 1:
            raise UsageError(
                f"tensor {tensor!r} is in two blocks ({owners[0]!r} and {owners[1]!r})",
                "list each submodule in one block only",
            )


def block_of(blocks: Sequence[tuple[str, Sequence[str]]], tensor_name: str) -> int:
    """Index of the block that owns a parameter or buffer name."""
    for index, (_, prefixes) in enumerate(blocks):
        if any(_owns(p, tensor_name) for p in prefixes):
            return index
    raise UsageError(f"tensor {tensor_name!r} belongs to no block", f"add its module to a block in {PROTOCOL}()")


def state_tensors(module: nn.Module, blocks: Sequence[tuple[str, Sequence[str]]]) -> tuple[list[tuple], list[tuple]]:
    """(params, buffers) as (name, shape, dtype, block); num_batches_tracked is not model state here."""
    params = [(n, tuple(p.shape), _dtype(p), block_of(blocks, n)) for n, p in module.named_parameters()]
    buffers = [
        (n, tuple(b.shape), _dtype(b), block_of(blocks, n))
        for n, b in module.named_buffers()
        if not n.endswith("num_batches_tracked")
    ]
    return params, buffers


def block_rows(module: nn.Module, blocks: BlockList) -> list[dict]:
    """Per block, input end first: parameters, bytes, the K_P whose personal part starts here, and its upload."""
    params, _ = state_tensors(module, blocks)
    sizes = [0] * len(blocks)
    counts = [0] * len(blocks)
    for name, shape, dtype, block in params:
        spec = TensorSpec(name, shape, dtype, "base", block)
        counts[block] += spec.nbytes // _DTYPE_BYTES[dtype]
        sizes[block] += spec.nbytes
    rows = []
    for index, (name, _) in enumerate(blocks):
        rows.append(
            {
                "index": index,
                "block": name,
                "parameters": counts[index],
                "bytes": sizes[index],
                "kp": len(blocks) - index,  # a cut before this block: it and every later block stay personal
                "upload_bytes": sum(sizes[:index]),  # base parameters sent each round with that K_P
            }
        )
    return rows


def _owns(prefix: str, tensor_name: str) -> bool:
    return tensor_name == prefix or tensor_name.startswith(prefix + ".")


def _normalise(declared, origin: str) -> BlockList:
    try:
        blocks = [(str(name), [str(m) for m in members]) for name, members in declared]
    except (TypeError, ValueError):
        raise UsageError(
            f"{origin} must return (block name, [submodule names]) pairs", "see docs/own-model.md"
        ) from None
    if any(isinstance(members, str) for _, members in declared):
        raise UsageError(f"{origin}: submodule names must be a list, not one string", 'write ("head", ["fc"])')
    return blocks


def _has_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def _torchvision_blocks(module: nn.Module) -> BlockList | None:
    """One block per stem, per residual (or inverted-residual) unit, per final conv and per classifier."""
    try:
        from torchvision import models
    except ImportError:
        return None
    if isinstance(module, (models.MobileNetV2, models.MobileNetV3, models.EfficientNet)):
        features = [(f"features.{i}", [f"features.{i}"]) for i in range(len(module.features))]
        return features + [("classifier", ["classifier"])]
    if isinstance(module, models.ResNet):
        units = [
            (f"{stage}.{i}", [f"{stage}.{i}"])
            for stage in ("layer1", "layer2", "layer3", "layer4")
            for i in range(len(getattr(module, stage)))
        ]
        return [("stem", ["conv1", "bn1"]), *units, ("fc", ["fc"])]
    if isinstance(module, models.ShuffleNetV2):
        units = [
            (f"{stage}.{i}", [f"{stage}.{i}"])
            for stage in ("stage2", "stage3", "stage4")
            for i in range(len(getattr(module, stage)))
        ]
        return [("conv1", ["conv1"]), *units, ("conv5", ["conv5"]), ("fc", ["fc"])]
    return None


def _dtype(tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")
