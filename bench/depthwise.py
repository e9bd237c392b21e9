"""Milliseconds of one depthwise 3x3 convolution, forward and input gradient: onnxruntime's forms against torch.

Issue 15's unmet rows (mobilenet_v2 at 96 px, the zoo MobileNet x1.0 full step) spend their time in depthwise
convolutions on 16x16 to 48x48 maps, where the portable graphs run onnxruntime's Conv (and, for a stride-2
input gradient, ConvTranspose). This times the standard-ONNX forms a step graph could use instead, at batch
32 and 2 threads, on the shapes of those layers:
  conv        Conv(group=C) with the weight as a graph input: what the step graphs run
  conv-const  the same with the weight as an initializer: onnxruntime then picks its blocked (NCHWc) kernel,
              which a trained weight cannot use (it changes every step); the bound of what the layout gives
  taps        Pad, then per kernel tap a strided Slice times the tap's weights, summed (elementwise ops only)
  stacked     the batch stacked into one tall image per channel (one product per channel, not per sample)
  torch       torch eager (the reference issue 15 compares with)
Input gradient: `conv` is what the exporter emits (the flipped kernel's convolution at stride 1, grouped
ConvTranspose at stride 2); `taps` the zero-dilated gradient convolved tap by tap with the flipped kernel.
Every form is checked against torch before it is timed. Prints JSON and writes bench/out/depthwise.png.
Usage: python bench/depthwise.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
import torch.nn.functional as F
from engines import host

OUT = Path(__file__).resolve().parent / "out"
BATCH, THREADS = 32, 2
# (channels, map side, stride) of the depthwise layers in the rows issue 15 still misses
SHAPES = [(32, 32, 1), (64, 32, 2), (128, 16, 1), (128, 16, 2), (96, 48, 1), (144, 48, 2), (192, 24, 1), (384, 12, 1)]


def taps(x: torch.Tensor, weight: torch.Tensor, stride: int) -> torch.Tensor:
    """A depthwise 3x3 convolution (padding 1) as nine strided slices times their tap's weights."""
    padded = F.pad(x, (1, 1, 1, 1))
    out_h, out_w = ((side - 1) // stride + 1 for side in x.shape[2:])
    total = 0
    for i in range(3):
        for j in range(3):
            window = padded[:, :, i : i + stride * (out_h - 1) + 1 : stride, j : j + stride * (out_w - 1) + 1 : stride]
            total = total + window * weight[:, :, i, j].reshape(1, -1, 1, 1)
    return total


def stacked(x: torch.Tensor, weight: torch.Tensor, stride: int) -> torch.Tensor:
    """The batch as one tall image per channel (each sample padded by a row above and below)."""
    n, channels, height, width = x.shape
    tall = F.pad(x, (0, 0, 1, 1)).transpose(0, 1).reshape(1, channels, n * (height + 2), width)
    y = F.conv2d(tall, weight, None, stride, (0, 1), 1, channels)
    rows = (height + 2) // stride
    y = F.pad(y, (0, 0, 0, n * rows - y.shape[2]))
    return y.reshape(channels, n, rows, -1)[:, :, : (height - 1) // stride + 1].transpose(0, 1)


def dilated(grad: torch.Tensor, stride: int, side: int) -> torch.Tensor:
    """The output gradient spread onto the input grid (zeros between), so a stride-1 convolution can take it."""
    if stride == 1:
        return grad
    n, channels, height, width = grad.shape
    spread = F.pad(grad.reshape(n, channels, height, 1, width, 1), (0, stride - 1, 0, 0, 0, stride - 1))
    return spread.reshape(n, channels, height * stride, width * stride)[:, :, :side, :side]


class Form(torch.nn.Module):
    def __init__(self, function, stride: int, weight: torch.Tensor | None = None):
        super().__init__()
        self.function, self.stride = function, stride
        self.weight = None if weight is None else torch.nn.Parameter(weight)

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        return self.function(x, self.weight if weight is None else weight, self.stride)


def conv(x, weight, stride):
    return F.conv2d(x, weight, None, stride, 1, 1, x.shape[1])


def grad_conv(grad, weight, stride):
    """The exporter's input gradient: flipped kernel at stride 1, grouped ConvTranspose at stride 2."""
    if stride == 1:
        return F.conv2d(grad, weight.flip((2, 3)), None, 1, 1, 1, grad.shape[1])
    return F.conv_transpose2d(grad, weight, None, stride, 1, stride - 1, grad.shape[1])


def session(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> ort.InferenceSession:
    buffer = io.BytesIO()
    torch.onnx.export(module, inputs, buffer, opset_version=17, dynamo=False)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = THREADS, 1
    return ort.InferenceSession(buffer.getvalue(), options, providers=["CPUExecutionProvider"])


def median_ms(run, repeats: int) -> float:
    for _ in range(3):
        run()
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
    return round(1000 * float(np.median(seconds)), 3)


def measure(channels: int, side: int, stride: int, repeats: int) -> dict:
    """Each form's milliseconds for one layer, forward and input gradient (each checked against torch first)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, channels, side, side, generator=generator)
    weight = torch.randn(channels, 1, 3, 3, generator=generator)
    out = conv(x, weight, stride)
    grad = torch.randn(out.shape, generator=generator)
    grad_input = torch.nn.grad.conv2d_input(x.shape, weight, grad, stride, 1, 1, channels)
    forms = {
        "forward": {
            "conv": (Form(conv, stride), (x, weight)),
            "conv-const": (Form(conv, stride, weight), (x,)),
            "taps": (Form(taps, stride), (x, weight)),
            "stacked": (Form(stacked, stride), (x, weight)),
        },
        "input gradient": {
            "conv": (Form(grad_conv, stride), (grad, weight)),
            "taps": (Form(lambda g, w, s: taps(dilated(g, s, side), w.flip((2, 3)), 1), stride), (grad, weight)),
        },
    }
    expected = {"forward": out, "input gradient": grad_input}
    row = {"channels": channels, "side": side, "stride": stride}
    for part, candidates in forms.items():
        for name, (module, inputs) in candidates.items():
            runner = session(module, inputs)
            feeds = {spec.name: tensor.numpy() for spec, tensor in zip(runner.get_inputs(), inputs)}
            got = runner.run(None, feeds)[0]
            if not np.allclose(got, expected[part].numpy(), atol=1e-3, rtol=1e-4):
                raise SystemExit(f"{part} form {name} differs from torch at {row}")
            row[f"{part}: {name}"] = median_ms(partial(runner.run, None, feeds), repeats)
    with torch.no_grad():
        row["forward: torch"] = median_ms(lambda: conv(x, weight, stride), repeats)
    row["input gradient: torch"] = median_ms(
        lambda: torch.nn.grad.conv2d_input(x.shape, weight, grad, stride, 1, 1, channels), repeats
    )
    return row


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [key for key in rows[0] if ":" in key]
    figure, axis = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / len(keys)
    for k, key in enumerate(keys):
        axis.bar([i + k * width for i in range(len(rows))], [row[key] for row in rows], width, label=key)
    axis.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
    axis.set_xticklabels([f"C{r['channels']} {r['side']}px s{r['stride']}" for r in rows])
    axis.set_ylabel(f"ms per call (batch {BATCH}, {THREADS} threads)")
    axis.set_yscale("log")
    axis.set_title("depthwise 3x3: onnxruntime's forms vs torch")
    axis.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    rows = []
    for channels, side, stride in SHAPES:
        rows.append(measure(channels, side, stride, args.repeats))
        print(json.dumps(rows[-1]), file=sys.stderr)
    plot(rows, OUT / "depthwise.png")
    print(json.dumps({"host": host(), "batch": BATCH, "threads": THREADS, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
