"""The portable graphs' cross-entropy and correct count, written with ops that every onnxruntime back end runs.

PyTorch's own cross-entropy exports as LogSoftmax with int64 label gathers (GatherElements, and ScatterElements
in its backward). onnxruntime-web's WebGPU execution provider has no LogSoftmax kernel and no int64 kernels
(its int64 support is an option that onnxruntime-web 1.30 does not pass), so each of those nodes would run on
the CPU and every step would copy tensors between the GPU and the CPU. Here the labels are int32, the loss is a
max-shifted log-sum-exp less the label's logit (a GatherElements on the int32 labels) and its backward is written
out (one ScatterElements puts the one-hot's −1 at each label); the correct count takes the first largest logit, as
argmax does, through float ops. The numbers are PyTorch's to float rounding (tests/test_portable.py checks the
traced step against PyTorch in float64).
"""

from __future__ import annotations

import torch

LABEL_DTYPE = torch.int32  # the step and eval graphs' `y`; the manifest says "label_dtype": "int32"


def weighted_cross_entropy(logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum(w · cross-entropy) / sum(w): the mean over the targets with w = 1 (w = 0 marks padding). A sequence's
    logits (n, positions, classes) count as n · positions rows, its y and w (n, positions) as as many targets."""
    return _WeightedCrossEntropy.apply(*by_target(logits, y, w))


class _WeightedCrossEntropy(torch.autograd.Function):
    """The weighted cross-entropy with its backward written out: (softmax − one-hot) · w / sum(w) · seed.

    Autograd's backward of a one-hot product materialises each row sum's gradient over all (rows, classes) logits
    (two Expand nodes), builds a float one-hot (an Equal and a Cast) and takes several more passes over that tensor:
    with a next-word model's 10,000 classes and 640 targets a step, a fifth of the transformer's step on
    onnxruntime (Where, which would skip the Cast, runs ~10x slower there). Here the label's logit is gathered
    (`label_logits`, one GatherElements), and the backward is one product over the logits and the one-hot's −1 put
    at each label (`add_at_labels`, one ScatterElements): the passes over the logits are PyTorch's own."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        labels = y.unsqueeze(1)
        shifted = logits - logits.amax(dim=1, keepdim=True)  # log_softmax as PyTorch computes it
        exp = shifted.exp()
        total = exp.sum(dim=1, keepdim=True)
        weight = (w / w.sum()).unsqueeze(1)
        ctx.save_for_backward(exp, total, labels, weight)
        return ((total.log() - label_logits(shifted, labels)) * weight).sum()

    @staticmethod
    def backward(ctx, seed: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        exp, total, labels, weight = ctx.saved_tensors
        scale = weight * seed
        return add_at_labels(exp * (scale / total), labels, -scale), None, None


def _label_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(rows, 1): each row's logit at its int32 label (rows, 1). An op of its own: torch.gather takes int64
    indices only, and ONNX's GatherElements (export/translations.py) takes the int32 ones WebGPU needs."""
    return logits.gather(1, labels.long())


def _add_at_labels(values: torch.Tensor, labels: torch.Tensor, amounts: torch.Tensor) -> torch.Tensor:
    """values with each row's (rows, 1) amount added at its int32 label (rows, 1): one ScatterElements."""
    return values.scatter_add(1, labels.long(), amounts)


label_logits = torch.library.custom_op("edgepfl::label_logits", _label_logits, mutates_args=())
add_at_labels = torch.library.custom_op("edgepfl::add_at_labels", _add_at_labels, mutates_args=())


@label_logits.register_fake
def _(logits, labels):  # noqa: ANN001, ANN202
    return logits.new_empty(labels.shape)


@add_at_labels.register_fake
def _(values, labels, amounts):  # noqa: ANN001, ANN202
    return torch.empty_like(values)


def by_target(logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(rows, classes) logits and (rows,) y and w: one row per target (a sequence's positions flattened)."""
    if logits.dim() == 2:
        return logits, y, w
    return logits.reshape(-1, logits.shape[-1]), y.reshape(-1), w.reshape(-1)


def correct_count(logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """How many targets with w > 0 are the first largest logit of their row (argmax's choice), as a float32
    scalar: the index of the first maximum is the smallest class index whose logit equals the row's max."""
    logits, y, w = by_target(logits, y, w)
    classes = logits.shape[1]
    index = torch.arange(classes, dtype=logits.dtype)
    is_max = logits == logits.amax(dim=1, keepdim=True)
    first = torch.where(is_max, index, torch.full_like(index, classes)).amin(dim=1)
    hits = (first == y.to(logits.dtype)) & (w > 0)
    return hits.to(torch.float32).sum()
