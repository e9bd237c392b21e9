"""The model a portable step is traced from: a copy whose BatchNorm layers count only the samples with weight > 0
(`MaskedModel`), called functionally with the step's tensors, and the shape the step graphs are traced for."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from edgepfl.export import fanout
from edgepfl.export.personal import carry_personal

BN_MOMENTUM = 0.1


class MaskedBatchNorm2d(nn.Module):
    """BatchNorm2d whose training-mode statistics count only the samples with weight > 0.

    Same tensor names as nn.BatchNorm2d (weight, bias, running_mean, running_var; no
    num_batches_tracked: momentum is fixed). The batch statistics are primitive ops (ONNX's training-mode
    BatchNormalization has no WebGPU kernel and no sample mask); normalizing by them, or in inference mode by the
    running statistics, is one inference-mode BatchNormalization node (`normalize`).
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
            return normalize(x, self.weight, self.bias, self.running_mean, self.running_var, self.eps)
        mask = self.mask_slot.value
        count = mask.sum() * (x.shape[2] * x.shape[3])
        y, mean, var = masked_batch_norm(x, self.weight, self.bias, mask, count, self.eps)
        # the biased variance: the flat update makes every layer's unbiased at once
        self.mask_slot.statistics.append((self, mean, var, x.shape[2] * x.shape[3]))
        return y


def _batch_norm_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, mask: torch.Tensor, count: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Training-mode BatchNorm over the samples the 0/1 `mask` keeps: (output, batch mean, biased batch variance),
    the statistics shaped (C,).

    An op of its own so that its backward is `masked_batch_norm_backward`, written out: autograd's backward of
    the forward's primitive ops is several times as many graph nodes (each one dispatch on WebGPU). The
    exporter's decomposition table (export/decompositions.py) traces both as the ops below: the statistics
    from per-map sums and a product over the batch axis (onnxruntime reduces over the leading axis, and
    broadcasts an (N, 1, 1, 1) weight over an activation, in slow elementwise loops), the centring and the
    output by one `normalize` each.
    """
    share = mask / count
    mean = weighted_rows(share, x.sum((2, 3)))
    ones, zeros = torch.ones_like(weight), torch.zeros_like(weight)  # constants of the graph
    var = weighted_rows(share, pixel_squares(normalize(x, ones, zeros, mean, ones, 0.0)))  # of x − mean
    return normalize(x, weight, bias, mean, var, eps), mean, var


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
    """The gradients (input, weight, bias) of `masked_batch_norm` given its output's gradient.

    With x̂ = (x − mean) / std and M = count: grad_x = weight / std · (grad_y − mask / M · (x̂ · grad_weight +
    grad_bias)), every per-channel product and shift one `normalize`, so no per-channel vector is reshaped
    or broadcast; mask / M is the forward's share, one (N, 1, 1, 1) column per map size.
    """
    # the statistics depend on the counted samples only (mask); grad_y is zero on the others (their outputs
    # reach no loss), so its batch sums need no mask: one ReduceSum each, where the forward needs two
    ones, zeros = torch.ones_like(weight), torch.zeros_like(weight)  # constants of the graph
    normalized = normalize(x, ones, zeros, mean, var, eps)
    grad_bias = grad_y.sum((0, 2, 3))
    grad_weight = (grad_y * normalized).sum((0, 2, 3))
    shift = normalize(normalized, grad_weight, grad_bias, zeros, ones, 0.0)
    # weight / std times the difference: the forward's own division by sqrt(var + eps)
    share = (mask / count).view(-1, 1, 1, 1)
    grad_x = normalize(grad_y - share * shift, weight, zeros, zeros, var, eps)
    return grad_x, grad_weight, grad_bias


def _normalize(
    x: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, eps: float
) -> torch.Tensor:
    """(x − mean) / sqrt(var + eps) · scale + bias, each per channel of (N, C, H, W) `x`.

    An op of its own so that it is exported as one inference-mode BatchNormalization node
    (export/translations.py), which every engine runs (WebGPU included) and which neither reshapes nor broadcasts its
    (C,) operands. With mean 0, var 1 and eps 0 it is a per-channel product and shift.
    """
    column = (1, -1, 1, 1)
    std = torch.sqrt(var + eps)
    return (x - mean.view(column)) / std.view(column) * scale.view(column) + bias.view(column)


def _pixel_squares(values: torch.Tensor) -> torch.Tensor:
    """(N, C) sums of the squares of (N, C, H, W) `values` over each map's pixels: an op of its own so that it
    is exported as one ReduceSumSquare node (export/translations.py), not a product and a sum."""
    return (values * values).sum((2, 3))


def _weighted_rows(row: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """(N,) @ (N, C): an op of its own so that it is exported as one MatMul of the vector
    (export/translations.py), a (C,) result like the parameters it is a gradient of; PyTorch's tracing turns a vector
    times a matrix into a (1, N) @ (N, C) product and a Reshape, one more node a batch sum."""
    return row @ rows


weighted_rows = torch.library.custom_op("edgepfl::weighted_rows", _weighted_rows, mutates_args=())
pixel_squares = torch.library.custom_op("edgepfl::pixel_squares", _pixel_squares, mutates_args=())
normalize = torch.library.custom_op("edgepfl::normalize", _normalize, mutates_args=())
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


@weighted_rows.register_fake
def _(row, rows):  # noqa: ANN001, ANN202
    return rows.new_empty(rows.shape[1])


@pixel_squares.register_fake
def _(values):  # noqa: ANN001, ANN202
    return values.new_empty(values.shape[:2])


@normalize.register_fake
def _(x, scale, bias, mean, var, eps):  # noqa: ANN001, ANN202
    return x.new_empty(x.shape)


@masked_batch_norm.register_fake
def _(x, weight, bias, mask, count, eps):  # noqa: ANN001, ANN202
    statistic = weight.new_empty(weight.shape[0])
    return x.new_empty(x.shape), statistic, statistic.clone()


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


class _MaskSlot:
    """Carries the current batch's sample mask to every MaskedBatchNorm2d of one model copy, and their batch
    statistics (layer, mean, biased variance, pixels per map) back, for one update of all running statistics."""

    value: torch.Tensor | None = None

    def __init__(self) -> None:
        self.statistics: list[tuple[MaskedBatchNorm2d, torch.Tensor, torch.Tensor, int]] = []


@dataclass(frozen=True)
class StepShape:
    """What the step graphs are traced for: one sample's input shape, the number of classes, the input's dtype and
    one sample's targets (a next-word sequence: one per position)."""

    input_shape: tuple[int, ...]
    num_classes: int
    input_dtype: str = "float32"  # int64 for token ids (a text bundle)
    target_shape: tuple[int, ...] = ()  # (seq_len,) for a next-word model

    @classmethod
    def of(cls, model: nn.Module) -> StepShape:
        """A zoo model's own shape, from its spec (an image spec has no dtype: float32)."""
        spec = model.spec
        targets = tuple(getattr(spec, "target_shape", ()))
        return cls(tuple(spec.input_shape), spec.num_classes, getattr(spec, "input_dtype", "float32"), targets)

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
                    masked = MaskedBatchNorm2d(child, self.slot)
                    carry_personal(child, masked)
                    setattr(parent, child_name, masked)
        self._layer_names = {id(m): name for name, m in self.module.named_modules() if isinstance(m, MaskedBatchNorm2d)}

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
            # the layers hold the state's tensors only during the call; the running statistics are updated
            # in place in them, as nn.BatchNorm2d does
            logits = torch.func.functional_call(self.module, state, (x,))
            _update_running_statistics(self.slot.statistics, self._layer_names, state, self.slot.value)
            return logits
        finally:
            self.slot.value = None
            self.slot.statistics = []

    def train(self, mode: bool = True) -> None:
        """Training mode (batch statistics) or inference mode (running statistics)."""
        self.module.train(mode)


def _update_running_statistics(
    statistics: list[tuple[MaskedBatchNorm2d, torch.Tensor, torch.Tensor, int]],
    layer_names: dict[int, str],
    state: dict[str, torch.Tensor],
    mask: torch.Tensor,
) -> None:
    """running <- (1 - momentum)·running + momentum·batch statistic, every layer's mean and variance at once: one
    flat update instead of a few graph nodes per tensor (each a dispatch on WebGPU). The means come first, then
    the variances, each made unbiased (count / (count - 1), count: the counted samples times the layer's pixels)
    by one product for all layers."""
    if not statistics:
        return
    names = [layer_names[id(layer)] for layer, _, _, _ in statistics]
    running = [state[f"{name}.running_mean"] for name in names] + [state[f"{name}.running_var"] for name in names]
    means = fanout.cat([mean for _, mean, _, _ in statistics])
    variances = fanout.cat([var for _, _, var, _ in statistics])
    sizes = [layer.running_var.numel() for layer, _, _, _ in statistics]
    pixels = torch.cat([torch.full((size,), float(p)) for size, (_, _, _, p) in zip(sizes, statistics)])  # constant
    count = mask.sum() * pixels.to(variances.dtype)
    batch = torch.cat([means, variances * (count / (count - 1))])
    momenta = {layer.momentum for layer, _, _, _ in statistics}
    if len(momenta) == 1:
        momentum = momenta.pop()
    else:  # one per element, a constant of the graph
        per_layer = [torch.full((size,), layer.momentum) for size, (layer, _, _, _) in zip(sizes, statistics)]
        momentum = torch.cat(per_layer * 2).to(batch.dtype)  # a constant: folded at export
    with torch.no_grad():
        updated = fanout.cat(running) * (1 - momentum) + momentum * batch
        for tensor, piece in zip(running, fanout.split(updated, [t.numel() for t in running])):
            tensor.copy_(piece)
