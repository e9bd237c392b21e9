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
        # masked sums over samples as (1, N) @ (N, C*H*W) products: onnxruntime broadcasts an (N, 1, 1, 1)
        # mask over an activation, and expands an (N, C) gradient back to one, in slow elementwise loops
        n, channels = x.shape[:2]
        sample_row = mask.view(1, n)
        count = mask.sum() * (x.shape[2] * x.shape[3])
        mean = (sample_row @ x.reshape(n, -1)).reshape(channels, -1).sum(1) / count
        centred = x - _per_channel(mean, x)
        var = (sample_row @ (centred * centred).reshape(n, -1)).reshape(channels, -1).sum(1) / count
        scale = self.weight * torch.rsqrt(var + self.eps)
        with torch.no_grad():
            unbiased = var * count / (count - 1)
            self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean)
            self.running_var.mul_(1 - self.momentum).add_(self.momentum * unbiased)
        return centred * _per_channel(scale, x) + _per_channel(self.bias, x)


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
    """What the step graphs are traced for: one sample's input shape, the number of classes, the input's dtype."""

    input_shape: tuple[int, ...]
    num_classes: int
    input_dtype: str = "float32"  # int64 for token ids (a text bundle)

    @classmethod
    def of(cls, model: nn.Module) -> StepShape:
        """A zoo model's own shape, from its spec (an image spec has no dtype: float32)."""
        spec = model.spec
        return cls(tuple(spec.input_shape), spec.num_classes, getattr(spec, "input_dtype", "float32"))

    def zeros(self, count: int) -> torch.Tensor:
        """`count` all-zero samples of the input's shape and dtype (what the exporters trace with)."""
        return torch.zeros(count, *self.input_shape, dtype=getattr(torch, self.input_dtype))

    def random(self, count: int, generator: torch.Generator) -> torch.Tensor:
        """`count` seeded samples: normal values, or ids below the class count (a next-word model's vocabulary)."""
        if self.input_dtype.startswith("int"):
            dtype = getattr(torch, self.input_dtype)
            return torch.randint(0, self.num_classes, (count, *self.input_shape), generator=generator, dtype=dtype)
        return torch.randn(count, *self.input_shape, generator=generator)


class MaskedModel:
    """A copy of a model whose BatchNorm layers count only real samples; called functionally.

    `spec` gives the input shape and class count (a zoo model's own spec when left out).
    """

    def __init__(self, model: nn.Module, spec: StepShape | None = None):
        self.spec = StepShape.of(model) if spec is None else spec
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
        self.slot.value = (w > 0).to(x.dtype if x.is_floating_point() else w.dtype)  # token ids: w's dtype
        try:
            return torch.func.functional_call(self.module, state, (x,))
        finally:
            self.slot.value = None

    def train(self, mode: bool = True) -> None:
        """Training mode (batch statistics) or inference mode (running statistics)."""
        self.module.train(mode)
