"""Convolutions on small feature maps as whole-batch matrix products, for the portable step graphs.

onnxruntime's CPU Conv (and ConvTranspose) multiplies the kernel by one image's columns at a time.
On a map of a few pixels each product is nearly a matrix-vector product, and the kernel is read
from memory once per sample: ResNet-18's 512x512x3x3 kernels on a 1x1 map cost ~6 ms per Conv at
batch 32, 30x their arithmetic. The forms here make each convolution, and each of its gradients,
one product over the whole batch, which onnxruntime runs as a single GEMM.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

SMALL_MAP = 64  # feature maps of at most this many pixels get the small-map forms
# Ungrouped convolutions switch later: onnxruntime's per-image product is as fast from 6x6 output maps on
# for a 3x3 kernel and from 4x4 on for a 1x1 kernel (interleaved timings of forward and both gradients,
# batch 32, 2 threads: 3x3 on 4x4 maps 7.0 ms as columns vs 11.4 ms as Conv, on 6x6 46.0 vs 45.2, on 8x8
# 8.6 vs 7.7; a 1x1 kernel's forward on a 1x1 map 0.28 vs 0.83 ms, on 2x2 0.82 vs 0.92, on 4x4 0.54 vs 0.29)
SMALL_DENSE_MAP = 16
SMALL_POINTWISE_MAP = 4
NUMPY_DTYPES = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64}


def tap(padded: torch.Tensor, i: int, j: int, stride: Sequence[int], out_h: int, out_w: int) -> torch.Tensor:
    """The input values that kernel tap (i, j) multiplies, one per output position."""
    return padded[
        :, :, i : i + stride[0] * (out_h - 1) + 1 : stride[0], j : j + stride[1] * (out_w - 1) + 1 : stride[1]
    ]


def is_depthwise(x: torch.Tensor, weight: torch.Tensor, groups: int) -> bool:
    """A depthwise convolution: one filter per input channel, each reading its channel alone."""
    return groups == x.shape[1] == weight.shape[0] and weight.shape[1] == 1


def is_small_depthwise(x: torch.Tensor, weight: torch.Tensor, groups: int, dilation: Sequence[int]) -> bool:
    """A depthwise convolution (one filter per channel) whose input map has at most SMALL_MAP pixels."""
    return (
        x.dim() == 4
        and is_depthwise(x, weight, groups)
        and all(d == 1 for d in dilation)
        and x.shape[2] * x.shape[3] <= SMALL_MAP
    )


def is_small_dense(
    x: torch.Tensor,
    weight: torch.Tensor,
    stride: Sequence[int],
    padding: Sequence[int],
    groups: int,
    dilation: Sequence[int],
) -> bool:
    """An ungrouped 2-D convolution on an output map small enough for the whole-batch columns (see above)."""
    if x.dim() != 4 or groups != 1 or any(d != 1 for d in dilation):
        return False
    out_h, out_w = output_size(x.shape[2:], weight.shape[2:], stride, padding)
    pointwise = weight.shape[2] == weight.shape[3] == 1
    return out_h * out_w <= (SMALL_POINTWISE_MAP if pointwise else SMALL_DENSE_MAP)


class DenseColumns:
    """An ungrouped convolution as products with the batch's columns, one (cin*taps, n*out pixels) matrix.

    forward = K @ C, input gradient = col2im(K^T @ G), weight gradient = G @ C^T, where K is the kernel
    as a (cout, cin*taps) matrix, C the columns and G the output gradient as a (cout, n*out pixels)
    matrix. The columns and col2im are products with one constant 0/1 matrix (which input pixel each
    tap of each output pixel reads): onnxruntime's Pad and Slice on these small maps cost more than
    the products. Kernel taps that read only padding (8 of a 3x3 kernel's 9 on a 1x1 map) are left
    out of K and C; their weight gradient is zero.
    """

    def __init__(
        self,
        x_shape: Sequence[int],
        weight_shape: Sequence[int],
        stride: Sequence[int],
        padding: Sequence[int],
        dtype: torch.dtype = torch.float32,
    ):
        self.n, self.cin, in_h, in_w = (int(d) for d in x_shape)
        self.cout, _, kh, kw = (int(d) for d in weight_shape)
        self.in_hw, self.kernel_shape = (in_h, in_w), (kh, kw)
        reads = tap_reads((kh, kw), (in_h, in_w), stride, padding)  # (kh, kw, in_h, in_w, out_h, out_w)
        self.out_hw = reads.shape[4:]
        self.in_pixels, self.out_pixels = in_h * in_w, self.out_hw[0] * self.out_hw[1]
        reads = reads.reshape(kh * kw, self.in_pixels, self.out_pixels)
        kept = [t for t in range(kh * kw) if reads[t].any()]
        self.taps = len(kept)
        # (in pixels, kept taps * out pixels): column (tap, p) has a 1 at the input pixel that tap reads for p
        matrix = reads[kept].transpose(1, 0, 2).reshape(self.in_pixels, -1)
        identity = matrix.shape[0] == matrix.shape[1] and np.array_equal(matrix, np.eye(len(matrix)))
        self.reads = None if identity else constant(matrix, dtype)  # None: a 1x1 kernel, stride 1
        # (kernel taps, kept taps): picks the kept taps out of a flattened kernel; None when all are kept
        self.pick = None if self.taps == kh * kw else constant(np.eye(kh * kw)[:, kept], dtype)

    def columns(self, x: torch.Tensor) -> torch.Tensor:
        """(cin * taps, n * out pixels): the inputs each kept kernel tap multiplies, for the whole batch."""
        per_tap = x.reshape(self.n * self.cin, self.in_pixels)
        if self.reads is not None:
            per_tap = per_tap @ self.reads
        per_tap = per_tap.reshape(self.n, self.cin * self.taps, self.out_pixels)
        return per_tap.transpose(0, 1).reshape(self.cin * self.taps, self.n * self.out_pixels)

    def kernel(self, weight: torch.Tensor) -> torch.Tensor:
        """(cout, cin * taps): the kept taps of the kernel."""
        if self.pick is not None:
            weight = weight.reshape(self.cout * self.cin, -1) @ self.pick
        return weight.reshape(self.cout, self.cin * self.taps)

    def grad_rows(self, grad_out: torch.Tensor) -> torch.Tensor:
        """(cout, n * out pixels): the output gradient with the batch beside the pixels."""
        return grad_out.reshape(self.n, self.cout, self.out_pixels).transpose(0, 1).reshape(self.cout, -1)

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        y = self.kernel(weight) @ self.columns(x)
        return y.reshape(self.cout, self.n, *self.out_hw).transpose(0, 1)

    def grad_weight(self, grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        grad = self.grad_rows(grad_out) @ self.columns(x).transpose(0, 1)
        if self.pick is not None:
            grad = grad.reshape(self.cout * self.cin, self.taps) @ self.pick.transpose(0, 1)
        return grad.reshape(self.cout, self.cin, *self.kernel_shape)

    def grad_input(self, grad_out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """col2im of K^T @ G: each tap's gradient summed into the input pixel it read."""
        grad_columns = self.kernel(weight).transpose(0, 1) @ self.grad_rows(grad_out)  # (cin*taps, n*out pixels)
        per_sample = grad_columns.reshape(self.cin, self.taps, self.n, self.out_pixels).transpose(1, 2)
        per_sample = per_sample.reshape(self.cin * self.n, self.taps * self.out_pixels)
        grad = per_sample if self.reads is None else per_sample @ self.reads.transpose(0, 1)  # (cin*n, in pixels)
        return grad.reshape(self.cin, self.n, *self.in_hw).transpose(0, 1)


def constant(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A constant 0/1 matrix in `dtype`, converted before it becomes a tensor: made from float64 values, a
    float32 tensor is traced as a float64 constant and a Cast, which onnxruntime-web's WebGPU build can
    neither fold nor run."""
    return torch.from_numpy(np.ascontiguousarray(values, dtype=NUMPY_DTYPES[dtype]))


def output_size(
    in_hw: Sequence[int], kernel: Sequence[int], stride: Sequence[int], padding: Sequence[int]
) -> tuple[int, int]:
    """(out_h, out_w) of an undilated convolution."""
    return tuple((size + 2 * pad - k) // step + 1 for size, k, step, pad in zip(in_hw, kernel, stride, padding))


def tap_reads(kernel: Sequence[int], in_hw: Sequence[int], stride: Sequence[int], padding: Sequence[int]) -> np.ndarray:
    """(kh, kw, in_h, in_w, out_h, out_w), 1 where kernel tap (i, j) of output pixel (oy, ox) reads input pixel
    (iy, ix); a tap over padding reads nothing."""
    kh, kw = kernel
    in_h, in_w = in_hw
    out_h, out_w = output_size(in_hw, kernel, stride, padding)
    reads = np.zeros((kh, kw, in_h, in_w, out_h, out_w), dtype=np.float64)
    for i in range(kh):
        for j in range(kw):
            for oy in range(out_h):
                for ox in range(out_w):
                    iy, ix = oy * stride[0] + i - padding[0], ox * stride[1] + j - padding[1]
                    if 0 <= iy < in_h and 0 <= ix < in_w:
                        reads[i, j, iy, ix, oy, ox] = 1.0
    return reads


class DepthwiseMaps:
    """A depthwise convolution on a small map as one (in pixels x out pixels) matrix per channel.

    onnxruntime runs a depthwise Conv as one tiny product per sample and channel (8,192 of them on a
    2x2 map with 256 channels), and the kernel-tap weight gradient as 9 slices, products and sums.
    Here each channel's kernel becomes a matrix M_c = sum_k w_c[k] * S_k, where the constant 0/1
    S_k says which input pixel tap k of each output pixel reads (padding is where S_k has no 1), so
    forward, input gradient and weight gradient are each one batched matrix product over channels.
    """

    def __init__(self, x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int]):
        self.n, self.channels, in_h, in_w = x.shape
        self.kernel_shape = tuple(weight.shape[2:])
        reads = tap_reads(self.kernel_shape, (in_h, in_w), stride, padding)
        self.out_h, self.out_w = reads.shape[4:]
        self.in_hw = (in_h, in_w)
        self.in_pixels, self.out_pixels = in_h * in_w, self.out_h * self.out_w
        self.taps = constant(reads.reshape(-1, self.in_pixels * self.out_pixels), x.dtype)

    def matrices(self, weight: torch.Tensor) -> torch.Tensor:
        """(channels, in pixels, out pixels): each channel's convolution as a matrix."""
        flat = weight.reshape(self.channels, -1) @ self.taps
        return flat.reshape(self.channels, self.in_pixels, self.out_pixels)

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(self.n, self.channels, self.in_pixels).transpose(0, 1)
        y = torch.bmm(rows, self.matrices(weight))
        return y.transpose(0, 1).reshape(self.n, self.channels, self.out_h, self.out_w)

    def grad_input(self, grad_out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = grad_out.reshape(self.n, self.channels, self.out_pixels).transpose(0, 1)
        grad = torch.bmm(rows, self.matrices(weight).transpose(1, 2))
        return grad.transpose(0, 1).reshape(self.n, self.channels, *self.in_hw)

    def grad_weight(self, grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(self.n, self.channels, self.in_pixels).permute(1, 2, 0)
        grad_rows = grad_out.reshape(self.n, self.channels, self.out_pixels).transpose(0, 1)
        per_pixel = torch.bmm(rows, grad_rows).reshape(self.channels, -1)
        return (per_pixel @ self.taps.transpose(0, 1)).reshape(self.channels, 1, *self.kernel_shape)
