"""What the training engines get of a model: random layers off, BatchNorm they can train, supported ops.

Randomness in training mode: Dropout and StochasticDepth layers run as in evaluation mode (identity)
in every on-device training step, in both engines and in the simulator's torch engine. The manifest
lists them (`model.random_layers_off`) and the export prints one line saying so. A random operation
that is not such a layer (e.g. F.dropout called in forward) ends the export with one line.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from edgepfl.errors import UsageError
from edgepfl.export.personal import carry_personal
from edgepfl.export.smallmaps import is_depthwise

_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_RANDOM_OPS = {
    "bernoulli",
    "bernoulli_",
    "native_dropout",
    "rand",
    "rand_like",
    "randn",
    "randn_like",
    "randint",
    "randint_like",
    "randperm",
    "normal",
    "normal_",
    "uniform",
    "uniform_",
    "exponential_",
    "multinomial",
    "dropout",
    "feature_dropout",
    "alpha_dropout",
    "feature_alpha_dropout",
}
# ATen ops (as a forward pass dispatches them) whose gradients the portable step exporter writes as
# standard ONNX; the six tested torchvision families and the zoo use a subset of these
SUPPORTED_OPS = {
    # layout and indexing
    "view",
    "_unsafe_view",
    "reshape",
    "t",
    "transpose",
    "permute",
    "expand",
    "clone",
    "contiguous",
    "squeeze",
    "unsqueeze",
    "flatten",
    "cat",
    "stack",
    "split",
    "split_with_sizes",
    "chunk",
    "alias",
    "detach",
    "lift_fresh",
    "_to_copy",
    "copy",
    "copy_",
    "empty",
    "empty_like",
    "zeros",
    "ones",
    "zeros_like",
    "ones_like",
    "full",
    "full_like",
    "fill",
    "fill_",
    "scalar_tensor",
    "arange",
    "pad",
    "constant_pad_nd",
    "channel_shuffle",
    "pixel_shuffle",
    "select",
    "slice",
    "embedding",
    # arithmetic and activations
    "add",
    "add_",
    "sub",
    "sub_",
    "mul",
    "mul_",
    "div",
    "div_",
    "neg",
    "rsub",
    "pow",
    "sqrt",
    "rsqrt",
    "exp",
    "log",
    "abs",
    "reciprocal",
    "square",
    "maximum",
    "minimum",
    "where",
    "relu",
    "relu_",
    "relu6",
    "hardtanh",
    "hardtanh_",
    "clamp",
    "clamp_",
    "clamp_min",
    "clamp_min_",
    "clamp_max",
    "clamp_max_",
    "hardswish",
    "hardswish_",
    "hardsigmoid",
    "hardsigmoid_",
    "silu",
    "silu_",
    "sigmoid",
    "sigmoid_",
    "tanh",
    "tanh_",
    "gelu",
    "elu",
    "leaky_relu",
    "leaky_relu_",
    "softplus",
    "mish",
    "log_softmax",
    "_log_softmax",
    "softmax",
    "_softmax",
    "gt",
    "lt",
    "ge",
    "le",
    "eq",
    "ne",
    "logical_and",
    "logical_or",
    "logical_not",
    # reductions, pooling, linear layers
    "sum",
    "mean",
    "amax",
    "amin",
    "max",
    "min",
    "var",
    "var_mean",
    "std",
    "addmm",
    "mm",
    "bmm",
    "matmul",
    "linear",
    "baddbmm",
    "convolution",
    "max_pool2d_with_indices",
    # normalisation layers
    "native_batch_norm",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit_functional",
    "native_group_norm",
    "native_layer_norm",
}


def random_layers(module: nn.Module) -> list[str]:
    """Submodule names of the Dropout and StochasticDepth layers that are random in training mode."""
    return [name for name, child in module.named_modules() if _is_random(child)]


def without_random_layers(module: nn.Module) -> nn.Module:
    """A copy with every Dropout/StochasticDepth layer replaced by nn.Identity (what on-device training runs)."""
    return _replaced(module, lambda child: nn.Identity() if _is_random(child) else None)


def primitive_group_norm(module: nn.Module) -> nn.Module:
    """A copy whose affine nn.GroupNorm layers are the zoo's GroupNorm of primitive ops (same tensors): ONNX
    Runtime has no gradient for the InstanceNormalization that nn.GroupNorm exports to."""
    from edgepfl.export.models import GroupNorm

    def swap(child: nn.Module) -> nn.Module | None:
        if type(child) is not nn.GroupNorm or not child.affine:
            return None
        replacement = GroupNorm(child.num_groups, child.num_channels, child.eps)
        replacement.load_state_dict({"weight": child.weight, "bias": child.bias})  # not an inserted adapter's
        return replacement

    return _replaced(module, swap)


def check_batchnorm(module: nn.Module) -> None:
    """BatchNorm as both engines train it: 2-D, affine, running statistics with a fixed momentum; else one line."""
    for name, child in module.named_modules():
        if not isinstance(child, nn.modules.batchnorm._BatchNorm):
            continue
        problem = None
        if not isinstance(child, nn.BatchNorm2d):
            problem = f"is a {type(child).__name__}; the engines train BatchNorm2d only"
        elif not (child.affine and child.track_running_stats):
            problem = "has no affine parameters or no running statistics"
        elif child.momentum is None:
            problem = "uses a cumulative average (momentum=None)"
        if problem:
            raise UsageError(f"BatchNorm layer {name} {problem}", "use nn.BatchNorm2d(C) with a momentum, e.g. 0.1")


def batchnorm_momenta(module: nn.Module) -> list[float]:
    """The distinct BatchNorm momenta of the model, sorted (ORT's variance correction needs exactly one)."""
    return sorted({float(m.momentum) for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)})


def check_portable_ops(module: nn.Module, input_shape: Sequence[int], dtype: torch.dtype = torch.float32) -> None:
    """One training-mode forward on zeros (of `dtype`: int64 for token ids): the first op or convolution the
    portable step cannot differentiate ends the export with one line naming it and the module that runs it."""
    module = copy.deepcopy(module).train()  # a training-mode forward moves BatchNorm statistics
    path: list[str] = []
    names = {id(m): n for n, m in module.named_modules()}

    def enter(child: nn.Module, _inputs) -> None:
        path.append(names[id(child)] or "(model)")

    def leave(_child: nn.Module, _inputs, _output) -> None:
        path.pop()

    for child in module.modules():
        child.register_forward_pre_hook(enter)
        child.register_forward_hook(leave)
    with torch.no_grad(), _OpCheck(path):
        module(torch.zeros(2, *input_shape, dtype=dtype))


class _OpCheck(TorchDispatchMode):
    def __init__(self, path: list[str]):
        super().__init__()
        self.path = path

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        where = self.path[-1] if self.path else "(model)"
        if name in _RANDOM_OPS:
            raise UsageError(
                f"{where} calls the random operation aten.{name} in training mode, which the engines cannot export",
                "use an nn.Dropout module (it runs as in evaluation mode on the device) or remove it",
            )
        if name not in SUPPORTED_OPS:
            raise UsageError(
                f"the portable exporter cannot differentiate aten.{name} (in module {where})",
                "rewrite that layer with supported operations, or export with --engines ort-training",
            )
        if name == "convolution":
            _check_convolution(args, where)
        return func(*args, **(kwargs or {}))


def _check_convolution(args: Sequence, where: str) -> None:
    x, weight = args[0], args[1]
    dilation, transposed, groups = args[5], args[6], args[8]
    problem = None
    if x.dim() != 4:
        problem = f"a {x.dim() - 2}-D convolution"
    elif transposed:
        problem = "a transposed convolution"
    elif any(d != 1 for d in dilation):
        problem = "a dilated convolution"
    elif groups != 1 and not is_depthwise(x, weight, groups):
        problem = f"a grouped convolution ({groups} groups, neither dense nor depthwise)"
    if problem:
        raise UsageError(
            f"the portable exporter cannot differentiate {problem} (aten.convolution in module {where})",
            "use dense or depthwise 2-D convolutions, or export with --engines ort-training",
        )


def _is_random(child: nn.Module) -> bool:
    if isinstance(child, _DROPOUTS):
        return child.p > 0
    try:
        from torchvision.ops import StochasticDepth
    except ImportError:
        return False
    return isinstance(child, StochasticDepth) and child.p > 0


def _replaced(module: nn.Module, swap) -> nn.Module:
    copied = copy.deepcopy(module)
    for parent in list(copied.modules()):
        for name, child in list(parent.named_children()):
            replacement = swap(child)
            if replacement is not None:
                carry_personal(child, replacement)
                setattr(parent, name, replacement)
    return copied
