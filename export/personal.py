"""A personal spec on a torch module: adapters and LoRA factors inserted, and the tensors' roles from the spec.

An adapter (down-projection, ReLU, up-projection, residual) follows each block's output but the output layer's:
a child `adapter` of the block's last submodule, applied by a forward hook (a plain nn.Sequential runs it as its
last layer), so no original tensor changes its name. Its projection axis is the channel axis 1 of a (N, C, H, W) or
(N, C, T) output and the last axis of a (N, D) one; a model overrides it with `adapter_axis(block_index) -> int`.
LoRA adds B·A to each nn.Linear and 1×1 nn.Conv2d weight as parameters `lora_A`, `lora_B` of that layer. Both
start as the identity (the up-projection and B are zero), so the exported model computes what the original did.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from edgepfl.errors import UsageError
from edgepfl.export.blocks import BlockList, state_tensors
from edgepfl.manifest import TensorSpec
from edgepfl.personal import ADAPTER_CHILD, LORA_A, LORA_B, SPEC_HELP, PersonalSpec, trailing_personal_blocks

AXIS_HOOK = "adapter_axis"
NORM_LAYERS = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm, nn.modules.instancenorm._InstanceNorm)


class Adapter(nn.Module):
    """x + up(relu(down(x))) along one axis: Linear over the last axis, or 1×1 convolutions over channels."""

    def __init__(self, channels: int, dim: int, kind: str):
        super().__init__()
        layer = {"linear": nn.Linear, "conv1d": _conv(nn.Conv1d), "conv2d": _conv(nn.Conv2d)}[kind]
        self.down = layer(channels, dim)
        self.up = layer(dim, channels)
        nn.init.zeros_(self.up.weight)  # the adapter starts as the identity: the exported model equals the original
        nn.init.zeros_(self.up.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.up(F.relu(self.down(x)))


def apply_spec(
    module: nn.Module,
    blocks: BlockList,
    input_shape: Sequence[int],
    spec: PersonalSpec,
    explicit: bool,
    seed: int,
    model_name: str,
) -> tuple[nn.Module, tuple[TensorSpec, ...], int]:
    """(the module to export, in eval mode; every tensor's role; the manifest's kp) for a spec. An `explicit`
    spec (`--personal`, not `--kp`) that makes no parameter or every one personal is refused in one line."""
    module = personalized(module, blocks, input_shape, spec, seed).eval()
    tensors = tensor_roles(module, blocks, spec)
    if explicit:
        check_personal_set(spec, tensors, model_name)
    roles = [(t.block, t.role == "personal") for t in tensors if t.role != "buffer"]
    return module, tensors, spec.output if spec.is_suffix else trailing_personal_blocks(roles, len(blocks))


def personalized(module: nn.Module, blocks: BlockList, input_shape: Sequence[int], spec: PersonalSpec, seed: int):
    """A copy of `module` with the spec's adapters and LoRA factors inserted (seeded), or `module` when it has none."""
    if not spec.inserts:
        return module
    module = copy.deepcopy(module)
    torch.manual_seed(seed)
    if spec.lora:
        layers = [name for name, layer in module.named_modules() if _lora_layer(layer)]
        if not layers:
            raise UsageError(f"--personal lora:{spec.lora}: the model has no Linear or 1x1 Conv2d", "use another item")
        for name in layers:
            insert_lora(module, name, spec.lora)
    if spec.adapters:
        for path, channels, kind in adapter_sites(module, blocks, input_shape):
            insert_adapter(module, path, channels, spec.adapters, kind)
    return module


def tensor_roles(module: nn.Module, blocks: BlockList, spec: PersonalSpec) -> tuple[TensorSpec, ...]:
    """Every parameter as base or personal by the spec, every buffer (but num_batches_tracked) as a buffer."""
    params, buffers = state_tensors(module, blocks)
    norms = {
        f"{name}.{tensor}" if name else tensor
        for name, layer in module.named_modules()
        if isinstance(layer, NORM_LAYERS)
        for tensor, _ in layer.named_parameters(recurse=False)
    }
    specs = [
        TensorSpec(
            name, shape, dtype, "personal" if spec.is_personal(name, block, len(blocks), norms) else "base", block
        )
        for name, shape, dtype, block in params
    ]
    return tuple(specs + [TensorSpec(name, shape, dtype, "buffer", block) for name, shape, dtype, block in buffers])


def check_personal_set(spec: PersonalSpec, tensors: Sequence[TensorSpec], model_name: str) -> None:
    """One line when a `--personal` spec makes no parameter personal, or every one (nothing would be shared)."""
    roles = [t.role for t in tensors if t.role != "buffer"]
    if "personal" not in roles:
        raise UsageError(
            f"--personal {spec} matches no parameter of {model_name}",
            "name its parameters (`edgepfl export MODEL --show-blocks` lists the blocks), or choose other items",
        )
    if "base" not in roles:
        raise UsageError(
            f"--personal {spec} makes every parameter of {model_name} personal: nothing is shared",
            "leave some parameters base (a smaller output:K, fewer names:), or simulate --algorithm local",
        )


def rebuild_personal(module: nn.Module, tensors: Sequence[TensorSpec]) -> nn.Module:
    """`module` (rebuilt from a manifest) with what the bundle's tensor names say export inserted; the torch engine's
    model. LoRA first, as export inserts it, so neither tensor order nor names differ."""
    for spec in tensors:
        path, _, leaf = spec.name.rpartition(".")
        if leaf == LORA_A:
            insert_lora(module, path, int(spec.shape[0]))
    suffix = f".{ADAPTER_CHILD}.down.weight"
    for spec in tensors:
        name, shape = spec.name, spec.shape
        if name.endswith(suffix):
            kind = {2: "linear", 3: "conv1d", 4: "conv2d"}[len(shape)]
            insert_adapter(module, name.removesuffix(suffix), int(shape[1]), int(shape[0]), kind)
    return module


def carry_personal(old: nn.Module, new: nn.Module) -> None:
    """Move an inserted adapter and its hook from a layer to the layer an export pass replaces it with."""
    adapter = old._modules.get(ADAPTER_CHILD)
    if adapter is not None:
        new.add_module(ADAPTER_CHILD, adapter)
    for hook in old._forward_hooks.values():
        if hook is _personal_hook:
            new.register_forward_hook(_personal_hook)


def insert_lora(module: nn.Module, path: str, rank: int) -> None:
    """Give the Linear or 1×1 Conv2d at `path` LoRA factors A (Kaiming-uniform) and B (zero)."""
    layer = module.get_submodule(path)
    fan_in, fan_out = (
        (layer.in_features, layer.out_features)
        if isinstance(layer, nn.Linear)
        else (layer.in_channels, layer.out_channels)
    )
    spatial = () if isinstance(layer, nn.Linear) else (1, 1)
    lora_a = nn.Parameter(torch.empty(rank, fan_in, *spatial))
    nn.init.kaiming_uniform_(lora_a, a=math.sqrt(5))
    layer.register_parameter(LORA_A, lora_a)
    layer.register_parameter(LORA_B, nn.Parameter(torch.zeros(fan_out, rank, *spatial)))
    _hook_once(layer)


def insert_adapter(module: nn.Module, path: str, channels: int, dim: int, kind: str) -> None:
    """An adapter of bottleneck `dim` after the submodule at `path`, whose output has `channels` on its axis."""
    layer = module.get_submodule(path)
    if ADAPTER_CHILD in layer._modules:
        raise UsageError(f"{path} already has a submodule named {ADAPTER_CHILD!r}", "rename it to use adapters")
    layer.add_module(ADAPTER_CHILD, Adapter(channels, dim, kind))
    if not _runs_children(layer):
        _hook_once(layer)


def adapter_sites(module: nn.Module, blocks: BlockList, input_shape: Sequence[int]) -> list[tuple[str, int, str]]:
    """(submodule path, channels, adapter kind) after each block but the last, from one probing forward pass."""
    sites = [(index, name, _last_submodule(module, name, members)) for index, (name, members) in enumerate(blocks)]
    sites = sites[:-1]  # the output layer's logits are the model's answer, not a representation to adapt
    if not sites:
        raise UsageError("--personal adapters: the model has one block only", "use output:K or names:GLOB")
    shapes: dict[str, object] = {}
    handles = [
        module.get_submodule(path).register_forward_hook(lambda _m, _i, out, path=path: shapes.setdefault(path, out))
        for _, _, path in sites
    ]
    embedded = any(isinstance(layer, nn.Embedding) for layer in module.modules())
    probe = torch.zeros((2, *input_shape), dtype=torch.long if embedded else torch.float32)  # token ids or pixels
    was_training = module.training
    try:
        with torch.no_grad():
            module.eval()(probe)
    finally:
        module.train(was_training)
        for handle in handles:
            handle.remove()
    axis_of = getattr(module, AXIS_HOOK, None)
    found = []
    for index, block, path in sites:
        output = shapes.get(path)
        if not isinstance(output, torch.Tensor):
            raise UsageError(
                f"--personal adapters: block {block!r} ({path}) gives no tensor in forward",
                f"declare blocks whose last submodule returns one tensor, or use {SPEC_HELP}",
            )
        rank = output.dim()
        axis = int(axis_of(index)) if callable(axis_of) else (1 if rank in (3, 4) else rank - 1)
        axis = axis % rank if rank else axis
        if axis == rank - 1 and rank >= 2:
            kind = "linear"
        elif axis == 1 and rank in (3, 4):
            kind = {3: "conv1d", 4: "conv2d"}[rank]
        else:
            raise UsageError(
                f"--personal adapters: block {block!r} outputs shape {tuple(output.shape)}, axis {axis}",
                "project the channel axis 1 of 3-D/4-D outputs or the last axis (the model's adapter_axis)",
            )
        found.append((path, int(output.shape[axis]), kind))
    return found


def _last_submodule(module: nn.Module, block: str, members: Sequence[str]) -> str:
    modules = dict(module.named_modules())
    named = [member for member in members if member in modules]
    if not named:
        raise UsageError(f"--personal adapters: block {block!r} names no submodule", "list submodules in its block")
    return named[-1]


def _lora_layer(layer: nn.Module) -> bool:
    if isinstance(layer, nn.Linear):
        return True
    return isinstance(layer, nn.Conv2d) and layer.kernel_size == (1, 1) and layer.groups == 1


def _runs_children(layer: nn.Module) -> bool:
    """A plain nn.Sequential calls every child in order, the adapter last: no hook needed."""
    return isinstance(layer, nn.Sequential) and type(layer).forward is nn.Sequential.forward


def _hook_once(layer: nn.Module) -> None:
    if _personal_hook not in layer._forward_hooks.values():
        layer.register_forward_hook(_personal_hook)


def _personal_hook(layer: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    """The inserted parts' forward: the LoRA update on the layer's input, then the adapter on its output.
    A module-level function (no closure), so copies of the model hook their own tensors."""
    lora_a = layer._parameters.get(LORA_A)
    if lora_a is not None:
        x, lora_b = inputs[0], layer._parameters[LORA_B]
        if isinstance(layer, nn.Linear):
            output = output + F.linear(F.linear(x, lora_a), lora_b)
        else:
            low = F.conv2d(x, lora_a, None, layer.stride, layer.padding, layer.dilation)
            output = output + F.conv2d(low, lora_b)
    adapter = layer._modules.get(ADAPTER_CHILD)
    if adapter is not None and not _runs_children(layer):
        output = adapter(output)
    return output


def _conv(kind):
    return lambda cin, cout: kind(cin, cout, 1)
