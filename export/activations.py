"""Backward passes of the mobile activations written with 0/1 masks, and ops the ONNX exporter lacks.

The core decompositions of hardswish/hardsigmoid backward (and of empty_like, which SiLU's own
autograd formula calls) allocate with aten.empty_permuted, which the ONNX exporter cannot translate;
these give PyTorch's values with ops ONNX has (and products with masks, which onnxruntime runs
faster than Where with a scalar branch).
"""

from __future__ import annotations

import torch


def hardswish_backward(grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """d/dx x·relu6(x+3)/6: 0 up to -3, x/3 + 1/2 strictly inside (-3, 3), 1 from 3 on (PyTorch's boundaries)."""
    middle = ((x > -3) & (x < 3)).to(grad_out.dtype)
    above = (x >= 3).to(grad_out.dtype)
    return grad_out * (middle * (x / 3 + 0.5) + above)


def hardtanh_backward(grad_out: torch.Tensor, x: torch.Tensor, min_val: float, max_val: float) -> torch.Tensor:
    """d/dx clamp(x, min, max) (ReLU6 in the MobileNets): 1 strictly inside (min, max), else 0 (PyTorch's
    boundaries); the core decomposition's Where with a scalar branch cost MobileNetV2 at 96 px 13% of its step."""
    return grad_out * ((x > min_val) & (x < max_val)).to(grad_out.dtype)


def hardsigmoid_backward(grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """d/dx relu6(x+3)/6: 1/6 strictly inside (-3, 3), else 0 (PyTorch's boundaries)."""
    return grad_out * (((x > -3) & (x < 3)).to(grad_out.dtype) / 6)


POSITIVE_SLOPE = 2.0**127  # times any normal float32 above 0 (from 2^-126 on) gives at least 2


def _positive(x: torch.Tensor) -> torch.Tensor:
    """A 0/1 mask of x > 0 (ReLU's backward), as clamp(x · 2^127, 0, 1): an op of its own so that it is exported as
    one HardSigmoid node (alpha 2^127, beta 0, export/translations.py), where a comparison and a
    cast are two (and Where runs ~10x slower on onnxruntime's CPU). It differs from x > 0 only where x is
    subnormal (0 < x < 2^-127): there it is x · 2^127, below 1."""
    return torch.clamp(x * POSITIVE_SLOPE, 0, 1)


positive = torch.library.custom_op("edgepfl::positive", _positive, mutates_args=())


@positive.register_fake
def _(x):  # noqa: ANN001, ANN202
    return torch.empty_like(x)


def empty_like(x: torch.Tensor, dtype: torch.dtype | None = None, **_: object) -> torch.Tensor:
    """A zero-filled stand-in for aten.empty_like, which SiLU's autograd formula allocates and then fills."""
    return torch.zeros(x.shape, dtype=dtype or x.dtype)


def split_copy(x: torch.Tensor, split_size: int, dim: int = 0) -> list[torch.Tensor]:
    """aten.split_copy (functionalization's form of chunk/split, e.g. ShuffleNet's stride-1 blocks) as slices and
    copies: the ONNX exporter has no function for split_copy."""
    return [piece.clone() for piece in torch.ops.aten.split.Tensor(x, split_size, dim)]


def split_with_sizes_copy(x: torch.Tensor, split_sizes: list[int], dim: int = 0) -> list[torch.Tensor]:
    """aten.split_with_sizes_copy (split with a list of sizes) as slices and copies, as `split_copy`."""
    return [piece.clone() for piece in torch.ops.aten.split_with_sizes.default(x, split_sizes, dim)]


def slice_copy(
    x: torch.Tensor, dim: int = 0, start: int | None = None, end: int | None = None, step: int = 1
) -> torch.Tensor:
    """aten.slice_copy (functionalization's form of a slice: chunk/split, e.g. ShuffleNet's branches) as a
    slice and a copy: the ONNX exporter has no function for slice_copy."""
    return torch.ops.aten.slice.Tensor(x, dim, start, end, step).clone()


def select_copy(x: torch.Tensor, dim: int, index: int) -> torch.Tensor:
    """aten.select_copy (functionalization's form of x[:, i], e.g. a language model's last position) as a
    slice, a squeeze and a copy: the ONNX exporter has no function for select_copy."""
    index = index + x.shape[dim] if index < 0 else index
    return torch.ops.aten.slice.Tensor(x, dim, index, index + 1, 1).squeeze(dim).clone()
