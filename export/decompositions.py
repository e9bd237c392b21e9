"""The decompositions the portable exporter traces with: PyTorch's core ATen table, plus forms of the ops
whose default decomposition onnxruntime runs slowly or ONNX cannot express (a convolution's backward, ReLU's
and the hard activations' backward, a sum over the batch axis, small-map convolutions as matrix products),
and a max pool without int64 indices (onnxruntime-web's WebGPU back end has no int64 kernels).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from edgepfl.errors import UsageError
from edgepfl.export import activations, masked
from edgepfl.export.smallmaps import DenseColumns, DepthwiseMaps, is_depthwise, is_small_dense, is_small_depthwise

aten = torch.ops.aten


def trace(
    fn: Callable[..., tuple[torch.Tensor, ...]], inputs: Sequence[torch.Tensor], tracing_mode: str = "fake"
) -> torch.fx.GraphModule:
    """The functional ATen graph that gets exported: core decompositions plus our convolution backward.

    With tracing_mode="real" and float64 inputs the result runs in float64, which checks the
    decompositions themselves against PyTorch's autograd without float32 rounding in the way.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, tracing_mode=tracing_mode, decomposition_table=decomposition_table())(*inputs)


def decomposition_table() -> dict:
    """The ATen decomposition table `trace` hands to make_fx."""
    from torch._decomp import core_aten_decompositions

    table = dict(core_aten_decompositions())
    table[aten.convolution.default] = _convolution
    table[aten.convolution_backward.default] = _convolution_backward
    table[aten.threshold_backward.default] = _threshold_backward
    table[aten.sum.dim_IntList] = _sum
    table[aten.hardswish_backward.default] = activations.hardswish_backward
    table[aten.hardsigmoid_backward.default] = activations.hardsigmoid_backward
    table[aten.hardtanh_backward.default] = activations.hardtanh_backward
    table[aten.empty_like.default] = activations.empty_like
    table[aten.slice_copy.Tensor] = activations.slice_copy
    table[aten.select_copy.int] = activations.select_copy
    table[aten.split_copy.Tensor] = activations.split_copy
    table[aten.split_with_sizes_copy.default] = activations.split_with_sizes_copy
    # traced as their primitive ops, each with its written-out backward (export/masked.py)
    table.update(masked.batch_norm_decompositions())  # each traced with its written-out backward
    for op, tiled in (
        (aten.max_pool2d_with_indices.default, _max_pool),
        (aten.max_pool2d_with_indices_backward.default, _max_pool_backward),
    ):
        table[op] = _unless_not_implemented(tiled, table.get(op))
    return table


def _unless_not_implemented(first, then):
    """`first`, or `then` (a default decomposition, or none) where `first` returns NotImplemented."""

    def decomposition(*args, **kwargs):
        result = first(*args, **kwargs)
        if result is NotImplemented and then is not None:
            return then(*args, **kwargs)
        return result

    return decomposition


def _pool_windows(x: torch.Tensor, kernel: Sequence[int], stride: Sequence[int], padding, dilation, ceil_mode):
    """(n, c, out_h, out_w, kh*kw) windows of a max pool whose windows tile the map exactly (stride = kernel,
    no padding, no dilation), the taps of each in row-major order; None for any other pool."""
    kh, kw = kernel
    stride = list(stride) or [kh, kw]
    if x.dim() != 4 or stride != [kh, kw] or any(padding) or any(d != 1 for d in dilation or [1]):
        return None
    n, c, h, w = x.shape
    if h % kh or w % kw:  # ceil_mode changes nothing then
        return None
    tiles = x.reshape(n, c, h // kh, kh, w // kw, kw).permute(0, 1, 2, 4, 3, 5)
    return tiles.reshape(n, c, h // kh, w // kw, kh * kw)


def _max_pool(x, kernel, stride=(), padding=(0, 0), dilation=(1, 1), ceil_mode=False):
    """aten.max_pool2d_with_indices of a tiling pool as a ReduceMax over each window; the indices it must
    return are zeros that nothing reads (the backward below finds each window's maximum again)."""
    windows = _pool_windows(x, kernel, stride, padding, dilation, ceil_mode)
    if windows is None:
        return NotImplemented
    values = windows.amax(dim=4)
    return values, torch.zeros(values.shape, dtype=torch.int64)


def _max_pool_backward(grad_out, x, kernel, stride, padding, dilation, ceil_mode, indices):
    """Each window's gradient to its first largest input (PyTorch's choice among equal ones), through float ops."""
    windows = _pool_windows(x, kernel, stride, padding, dilation, ceil_mode)
    if windows is None:
        return NotImplemented
    taps = windows.shape[4]
    order = torch.arange(taps, dtype=x.dtype)
    is_max = windows == windows.amax(dim=4, keepdim=True)
    first = torch.where(is_max, order, torch.full_like(order, taps)).amin(dim=4, keepdim=True)
    grad = (order == first).to(x.dtype) * grad_out.unsqueeze(4)
    n, c, out_h, out_w = grad_out.shape
    kh, kw = kernel
    grad = grad.reshape(n, c, out_h, out_w, kh, kw).permute(0, 1, 2, 4, 3, 5)
    return grad.reshape(x.shape)


def _threshold_backward(grad_out: torch.Tensor, x: torch.Tensor, threshold: float) -> torch.Tensor:
    """ReLU's backward as a product with a 0/1 mask (one node: activations.positive): onnxruntime's Where with a
    scalar branch is a slow loop."""
    if threshold == 0:
        return grad_out * activations.positive(x)
    return grad_out * (x > threshold).to(grad_out.dtype)


def _sum(
    x: torch.Tensor, dims: Sequence[int] | None, keepdim: bool = False, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """aten.sum over the batch axis alone (autograd's gradient of an operand broadcast over the batch) as a
    (1, N) @ (N, rest) product: onnxruntime's ReduceSum over the leading axis is 10-40x slower."""
    if dtype is not None or not x.dtype.is_floating_point or x.dim() < 2 or not dims:
        return NotImplemented
    if sorted(d % x.dim() for d in dims) != [0]:
        return NotImplemented
    n = x.shape[0]
    total = torch.ones(1, n, dtype=x.dtype) @ x.reshape(n, -1)
    return total.reshape(1, *x.shape[1:]) if keepdim else total.reshape(x.shape[1:])


def _convolution(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
) -> torch.Tensor:
    """aten.convolution: convolutions on small maps as whole-batch matrix products, everything else unchanged."""
    if transposed:
        return NotImplemented
    if is_small_depthwise(x, weight, groups, dilation):
        y = DepthwiseMaps(x, weight, stride, padding).forward(x, weight)
    elif is_small_dense(x, weight, stride, padding, groups, dilation):
        y = DenseColumns(x.shape, weight.shape, stride, padding, x.dtype).forward(x, weight)
    else:
        return NotImplemented
    return y if bias is None else y + bias.reshape(1, -1, 1, 1)


def _convolution_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias_sizes: Sequence[int] | None,
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    transposed: bool,
    output_padding: Sequence[int],
    groups: int,
    output_mask: Sequence[bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """aten.convolution_backward of a 2-D convolution, written with forward ops ONNX has."""
    if transposed or x.dim() != 4 or any(d != 1 for d in dilation):
        raise UsageError(
            "the portable step supports 2-D, non-transposed, non-dilated convolutions only",
            "use a zoo model or export with --engines ort-training",
        )
    if is_small_depthwise(x, weight, groups, dilation):
        maps = DepthwiseMaps(x, weight, stride, padding)
        grad_input = maps.grad_input(grad_out, weight) if output_mask[0] else None
        grad_weight = maps.grad_weight(grad_out, x) if output_mask[1] else None
    elif is_small_dense(x, weight, stride, padding, groups, dilation):
        columns = DenseColumns(x.shape, weight.shape, stride, padding, x.dtype)
        grad_input = columns.grad_input(grad_out, weight) if output_mask[0] else None
        grad_weight = columns.grad_weight(grad_out, x) if output_mask[1] else None
    else:
        grad_input = _conv_grad_input(grad_out, x, weight, stride, padding, groups) if output_mask[0] else None
        grad_weight = _conv_grad_weight(grad_out, x, weight, stride, padding, groups) if output_mask[1] else None
    grad_bias = grad_out.sum((0, 2, 3)) if output_mask[2] else None
    return grad_input, grad_weight, grad_bias


def _conv_grad_input(grad_out, x, weight, stride, padding, groups) -> torch.Tensor:
    cout, cin_group, kh, kw = weight.shape
    if list(stride) == [1, 1]:
        # a stride-1 convolution's input gradient is a plain convolution with the flipped, transposed kernel
        if groups == 1:
            flipped = weight.transpose(0, 1)
        elif is_depthwise(x, weight, groups):  # each group's (1, 1) block is its own transpose
            flipped = weight
        else:
            flipped = weight.reshape(groups, cout // groups, cin_group, kh, kw).transpose(1, 2)
            flipped = flipped.reshape(groups * cin_group, cout // groups, kh, kw)
        if kh > 1 or kw > 1:  # flipping a 1x1 kernel changes nothing but would still cost a copy
            flipped = flipped.flip((2, 3))
        pad = [kh - 1 - padding[0], kw - 1 - padding[1]]
        return aten.convolution(grad_out, flipped, None, [1, 1], pad, [1, 1], False, [0, 0], groups)
    out_h, out_w = grad_out.shape[2:]
    extra = [
        x.shape[2] - ((out_h - 1) * stride[0] - 2 * padding[0] + kh),
        x.shape[3] - ((out_w - 1) * stride[1] - 2 * padding[1] + kw),
    ]
    return aten.convolution(grad_out, weight, None, list(stride), list(padding), [1, 1], True, extra, groups)


def _conv_grad_weight(grad_out, x, weight, stride, padding, groups) -> torch.Tensor:
    cout, cin_group, kh, kw = weight.shape
    n, cin = x.shape[:2]
    out_h, out_w = grad_out.shape[2:]
    kernel = grad_out.transpose(0, 1)  # (cout, n, out_h, out_w)
    if is_depthwise(x, weight, groups):
        # depthwise: the weight gradient is itself a grouped convolution of the input (the batch as each
        # group's channels) with the output gradient as kernel, spaced by the stride; onnxruntime's Conv
        # gathers the taps several times faster than one strided Slice per tap (MobileNetV2 at 96 px)
        rows = x.transpose(0, 1).reshape(1, cin * n, *x.shape[2:])
        grad = plain_convolution(rows, kernel, list(padding), list(stride), cin)
        return grad[:, :, :kh, :kw].reshape(cout, 1, kh, kw)
    if groups != 1:
        raise UsageError(
            "the portable step supports dense and depthwise convolutions only",
            "use a zoo model or export with --engines ort-training",
        )
    if cout * cin * kh * kw > out_h * out_w * (cout + cin * kh * kw):
        # the kernel outgrows the activations: one matrix product over all samples beats n products summed,
        # whose (n, cout, cin) intermediate outgrows the inputs it would save transposing
        return DenseColumns(x.shape, weight.shape, stride, padding, x.dtype).grad_weight(grad_out, x)
    if kh == kw == 1 and list(stride) == [1, 1] and list(padding) == [0, 0]:
        # a 1x1 kernel: one product per sample, summed (a convolution would be a matrix-vector product per channel)
        grad_rows = grad_out.reshape(n, cout, out_h * out_w)
        patches = x.reshape(n, cin, out_h * out_w)
        return torch.bmm(grad_rows, patches.transpose(1, 2)).sum(0).reshape(cout, cin, kh, kw)
    # as for depthwise, a convolution of the input (its channels as the batch, the samples as channels) with the
    # output gradient as kernel, spaced by the stride: 4 nodes, where a Slice per tap and their product were 20
    grad = plain_convolution(x.transpose(0, 1), kernel, list(padding), list(stride), 1)
    return grad[:, :, :kh, :kw].transpose(0, 1)


def _plain_convolution(
    x: torch.Tensor, kernel: torch.Tensor, padding: list[int], dilation: list[int], groups: int
) -> torch.Tensor:
    """A stride-1 convolution exported as one Conv node as it is (export/translations.py): an op of
    its own so that `_convolution` leaves it alone. A weight gradient's convolution has a small output (the
    kernel's size) but a kernel as large as the map, which as column products would need a constant of
    (map pixels) × (map pixels · taps) elements (38 MB for MobileNet's stem)."""
    return F.conv2d(x, kernel, None, 1, padding, dilation, groups)


plain_convolution = torch.library.custom_op("edgepfl::plain_convolution", _plain_convolution, mutates_args=())


@plain_convolution.register_fake
def _(x, kernel, padding, dilation, groups):  # noqa: ANN001, ANN202
    size = [x.shape[2 + i] + 2 * padding[i] - dilation[i] * (kernel.shape[2 + i] - 1) for i in range(2)]
    return x.new_empty(x.shape[0], kernel.shape[0], *size)
