"""The portable graphs' cross-entropy and correct count, written with ops that every onnxruntime back end runs.

PyTorch's own cross-entropy exports as LogSoftmax with int64 label gathers (GatherElements, and ScatterElements
in its backward). onnxruntime-web's WebGPU execution provider has no LogSoftmax kernel and no int64 kernels
(its int64 support is an option that onnxruntime-web 1.30 does not pass), so each of those nodes would run on
the CPU and every step would copy tensors between the GPU and the CPU. Here the labels are int32 and
the loss is a max-shifted log-sum-exp and a one-hot product; the correct count takes the first largest
logit, as argmax does, through float ops. The numbers are PyTorch's to float rounding (tests/test_portable.py
checks the traced step against PyTorch in float64).
"""

from __future__ import annotations

import torch

LABEL_DTYPE = torch.int32  # the step and eval graphs' `y`; the manifest says "label_dtype": "int32"


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over dim 1 as PyTorch computes it (shifted by the row's max), without a LogSoftmax node.

    The shift is a constant to the gradient (it cancels in the log-sum-exp), so it is taken without one: the
    step graph gets no ReduceMax backward."""
    with torch.no_grad():
        shift = logits.amax(dim=1, keepdim=True)
    shifted = logits - shift
    return shifted - shifted.exp().sum(dim=1, keepdim=True).log()


def one_hot(y: torch.Tensor, classes: int, dtype: torch.dtype) -> torch.Tensor:
    """(n, classes) rows with a 1 at each label: an Equal against the class indices, no OneHot or Scatter node."""
    return (y.unsqueeze(1) == torch.arange(classes, dtype=y.dtype)).to(dtype)


def cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-sample cross-entropy of (n, classes) logits against integer labels y (n,)."""
    return -(one_hot(y, logits.shape[1], logits.dtype) * log_softmax(logits)).sum(dim=1)


def weighted_cross_entropy(logits: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum(w · cross-entropy) / sum(w): the mean over the targets with w = 1 (w = 0 marks padding). A sequence's
    logits (n, positions, classes) count as n · positions rows, its y and w (n, positions) as as many targets."""
    logits, y, w = by_target(logits, y, w)
    return (cross_entropy(logits, y) * w).sum() / w.sum()


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
