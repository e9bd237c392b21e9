"""The model a portable step is traced from: a copy whose BatchNorm layers count only the samples with weight > 0
(`MaskedModel`), called functionally with the step's tensors, and the shape the step graphs are traced for."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from edgepfl.export.smallmaps import SMALL_MAP

BN_MOMENTUM = 0.1


class MaskedBatchNorm2d(nn.Module):
    """BatchNorm2d whose training-mode statistics count only the samples with weight > 0.

    Same tensor names as nn.BatchNorm2d (weight, bias, running_mean, running_var; no
    num_batches_tracked: momentum is fixed). Written with primitive ops so that the ONNX exporter
    cannot turn it into an inference-mode BatchNormalization node.
    """

    def __init__(self, source: nn.BatchNorm2d, mask_slot: _MaskSlot):
        super().__init__()
        self.mask_slot = mask_slot
        self.eps = source.eps
        self.momentum = BN_MOMENTUM if source.momentum is None else source.momentum
        self.weight = nn.Parameter(source.weight.detach().clone())
        self.bias = nn.Parameter(source.bias.detach().clone())
        self.register_buffer("running_mean", source.running_mean.detach().clone())
        self.register_buffer("running_var", source.running_var.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            scale = self.weight * torch.rsqrt(self.running_var + self.eps)
            return x * _per_channel(scale, x) + _per_channel(self.bias - self.running_mean * scale, x)
        mask = self.mask_slot.value
        count = mask.sum() * (x.shape[2] * x.shape[3])
        y, mean, var = masked_batch_norm(x, self.weight, self.bias, mask, count, self.eps)
        with torch.no_grad():
            unbiased = var * count / (count - 1)
            self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean)
            self.running_var.mul_(1 - self.momentum).add_(self.momentum * unbiased)
        return y


def _batch_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor, count: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training-mode BatchNorm over the samples the 0/1 `mask` keeps: (output, batch mean, biased batch variance).

    An op of its own so that its backward is `masked_batch_norm_backward`, written out: autograd's backward of
    the forward's primitive ops is several times as many graph nodes (each one dispatch on WebGPU). The
    exporter's decomposition table (export/decompositions.py) traces both as the primitive ops below.
    """
    mean = _channel_sums(mask, x) / count
    centred = x - _per_channel(mean, x)
    var = _channel_sums(mask, centred * centred) / count
    y = centred * _per_channel(weight * torch.rsqrt(var + eps), x) + _per_channel(bias, x)
    return y, mean, var


def _batch_norm_backward(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    mask: torch.Tensor,
    count: torch.Tensor,
    mean: torch.Tensor,
    var: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (input, weight, bias) of `masked_batch_norm` given its output's gradient."""
    # the statistics depend on the counted samples only (mask); grad_y is zero on the others (their outputs
    # reach no loss), so its batch sums need no mask of their own
    centred = x - _per_channel(mean, x)
    rstd = torch.rsqrt(var + eps)
    grad_bias = _channel_sums(mask, grad_y)
    grad_weight = _channel_sums(mask, grad_y * centred) * rstd
    scale = weight * rstd
    shift = _per_channel(scale * grad_bias / count, x) + centred * _per_channel(scale * grad_weight * rstd / count, x)
    grad_x = grad_y * _per_channel(scale, x) - mask.view(-1, 1, 1, 1) * shift
    return grad_x, grad_weight, grad_bias


masked_batch_norm = torch.library.custom_op("edgepfl::masked_batch_norm", _batch_norm_forward, mutates_args=())
masked_batch_norm_backward = torch.library.custom_op(
    "edgepfl::masked_batch_norm_backward", _batch_norm_backward, mutates_args=()
)


def batch_norm_decompositions() -> dict:
    """The masked BatchNorm ops as the primitive ops they are traced as (the exporter's decomposition table)."""
    return {
        masked_batch_norm._opoverload: _batch_norm_forward,
        masked_batch_norm_backward._opoverload: _batch_norm_backward,
    }


@masked_batch_norm.register_fake
def _(x, weight, bias, mask, count, eps):  # noqa: ANN001, ANN202
    channel = weight.new_empty(weight.shape)
    return x.new_empty(x.shape), channel, channel.clone()


@masked_batch_norm_backward.register_fake
def _(grad_y, x, weight, mask, count, mean, var, eps):  # noqa: ANN001, ANN202
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


def _save_for_backward(ctx, inputs, output) -> None:  # noqa: ANN001
    x, weight, _, mask, count, eps = inputs
    _, mean, var = output
    ctx.save_for_backward(x, weight, mask, count, mean, var)
    ctx.eps = eps


def _backward(ctx, grad_y, _grad_mean, _grad_var):  # noqa: ANN001, ANN202
    x, weight, mask, count, mean, var = ctx.saved_tensors
    grad_x, grad_weight, grad_bias = masked_batch_norm_backward(grad_y, x, weight, mask, count, mean, var, ctx.eps)
    return grad_x, grad_weight, grad_bias, None, None, None


masked_batch_norm.register_autograd(_backward, setup_context=_save_for_backward)


def _channel_sums(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per-channel sums of (N, C, H, W) `values` over the samples the 0/1 `mask` keeps and all pixels.

    As a (1, N) @ (N, C*H*W) product: onnxruntime broadcasts an (N, 1, 1, 1) mask over an activation, and
    reduces over the leading axis, in slow elementwise loops.
    """
    n, channels = values.shape[:2]
    return (mask.view(1, n) @ values.reshape(n, -1)).reshape(channels, -1).sum(1)


def _per_channel(values: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A per-channel vector shaped to broadcast over activations `x` (N, C, H, W).

    On small maps it is spread to (1, C, H, W) first: onnxruntime broadcasts a (1, C, 1, 1) operand
    over a few pixels per channel in a slow loop, and over a whole (C, H, W) sample fast.
    """
    column = values.view(1, -1, 1, 1)
    return column.expand(1, -1, *x.shape[2:]) if x.shape[2] * x.shape[3] <= SMALL_MAP else column


class _MaskSlot:
    """Carries the current batch's sample mask to every MaskedBatchNorm2d of one model copy."""

    value: torch.Tensor | None = None


@dataclass(frozen=True)
class StepShape:
    """What the step graphs are traced for: one sample's input shape and the number of classes."""

    input_shape: tuple[int, ...]
    num_classes: int


class MaskedModel:
    """A copy of a model whose BatchNorm layers count only real samples; called functionally.

    `spec` gives the input shape and class count (a zoo model's own spec when left out).
    """

    def __init__(self, model: nn.Module, spec: StepShape | None = None):
        self.spec = model.spec if spec is None else spec
        self.module = copy.deepcopy(model)
        self.slot = _MaskSlot()
        for parent in list(self.module.modules()):
            for child_name, child in list(parent.named_children()):
                if isinstance(child, nn.BatchNorm2d):
                    setattr(parent, child_name, MaskedBatchNorm2d(child, self.slot))

    @property
    def momentum(self) -> float | dict[str, float]:
        """The BatchNorm momentum; where layers differ, each running statistic's by name (devices re-estimating
        statistics read it, statistics.py); the default where there is no BatchNorm."""
        layers = {name: m.momentum for name, m in self.module.named_modules() if isinstance(m, MaskedBatchNorm2d)}
        momenta = set(layers.values())
        if len(momenta) > 1:
            return {f"{name}.{stat}": m for name, m in layers.items() for stat in ("running_mean", "running_var")}
        return momenta.pop() if momenta else BN_MOMENTUM

    def __call__(self, state: dict[str, torch.Tensor], x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Logits of `x` with the model's tensors taken from `state`; samples with w = 0 do not count."""
        self.slot.value = (w > 0).to(x.dtype)
        try:
            return torch.func.functional_call(self.module, state, (x,))
        finally:
            self.slot.value = None

    def train(self, mode: bool = True) -> None:
        """Training mode (batch statistics) or inference mode (running statistics)."""
        self.module.train(mode)
