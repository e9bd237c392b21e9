"""The output layer at the last position only: what the one-sample predict graph of a model taught a target at every
position (a next-word model) computes, since a keyboard asks it only what follows the words typed.

The eval graph applies the output layer (for a 4,275-word vocabulary most of the model's products) at every one of
the sequence's positions and a prediction reads one of them. Here the output layer is the deepest module whose
result the model returns as it is (CausalTransformer's and WordLSTM's `output`; a LoRA-wrapped layer's wrapper),
and a forward pre-hook hands it only the hidden state at each row's last input id that is not <pad>
(edgepfl.text.last_positions), picked by a one-hot product: a MatMul, which every back end runs (GatherElements
keeps a graph off WebGPU). A graph is kept only when it gives the eval graph's logits at those positions
(`same_last_logits`); an output layer that mixes positions keeps the eval graph's form.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import onnx
import torch
from torch import nn

from edgepfl.export.masked import MaskedModel
from edgepfl.text import PAD_ID

ToOnnx = Callable[[Callable[..., tuple[torch.Tensor, ...]], list[torch.Tensor], list[str], list[str]], onnx.ModelProto]


def last_position_graph(
    step_model: MaskedModel,
    full: onnx.ModelProto,
    inputs: dict[str, torch.Tensor],
    state: list[str],
    output: str,
    to_onnx: ToOnnx,
) -> onnx.ModelProto:
    """The graph that gives `output` (1, classes) at the last real position only, from the tensors `state` names
    and x (the first `len(state)` + 1 of `inputs`, which feed `full`, the eval graph at batch 1, by name); `full`
    itself for a model with one target a sample, without an output layer to apply alone, or when the graph would
    not give `full`'s logits at that position."""
    names = list(inputs)
    tensors = list(inputs.values())
    layer = output_layer(step_model, dict(zip(state, tensors))) if step_model.spec.target_shape else None
    if layer is None:
        return full

    def predict(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = flat[-1]
        with at_last_position(layer, x):
            logits = step_model(dict(zip(state, flat[:-1])), x, torch.ones(x.shape))
        return (logits.squeeze(1),)

    step_model.train(False)
    last = to_onnx(predict, tensors[: len(state) + 1], names[: len(state) + 1], [output])
    return last if same_last_logits(full, last, inputs, names[len(state)], step_model.spec.num_classes) else full


def output_layer(step_model: MaskedModel, state: dict[str, torch.Tensor]) -> nn.Module | None:
    """The deepest module whose output the model returns unchanged, when that module reads a (batch, positions,
    features) float input; None when there is none (the model works on its logits after its last layer)."""
    seen: list[tuple[nn.Module, object, object]] = []

    def record(module: nn.Module, args: tuple, output: object) -> None:
        seen.append((module, args[0] if args else None, output))

    spec = step_model.spec
    x = spec.zeros(1)
    hooks = [m.register_forward_hook(record) for m in step_model.module.modules() if m is not step_model.module]
    try:
        with torch.no_grad():
            logits = step_model(state, x, torch.ones(1, *spec.target_shape))
    finally:
        for hook in hooks:
            hook.remove()
    for module, read, output in seen:  # in the order the calls end: the deepest first
        if output is logits:
            ok = isinstance(read, torch.Tensor) and read.is_floating_point() and read.shape[:2] == x.shape[:2]
            return module if ok and read.dim() == 3 else None
    return None


@contextmanager
def at_last_position(layer: nn.Module, x: torch.Tensor) -> Iterator[None]:
    """While held, `layer` reads only each row's hidden state at its last real position (batch, 1, features)."""
    steps = x.shape[1]
    positions = torch.arange(steps)
    last = ((x != PAD_ID).to(torch.int64) * positions).amax(dim=1, keepdim=True)  # 0 for a row of padding only

    def pick(_module: nn.Module, args: tuple) -> tuple:
        hidden = args[0]
        one_hot = (positions.unsqueeze(0) == last).to(hidden.dtype).unsqueeze(1)  # (batch, 1, positions)
        return (one_hot @ hidden, *args[1:])

    handle = layer.register_forward_pre_hook(pick)
    try:
        yield
    finally:
        handle.remove()


def same_last_logits(
    full: onnx.ModelProto, last: onnx.ModelProto, inputs: dict[str, torch.Tensor], x: str, words: int
) -> bool:
    """Whether `last` gives `full`'s logits read at the last real position, for one seeded phrase (input `x`) of
    each length from none to all its positions, of ids below `words`, the other inputs as `inputs` (by name; `last`
    takes those it names)."""
    import onnxruntime

    sessions = [
        onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        for proto in (full, last)
    ]
    feeds = {name: tensor.numpy() for name, tensor in inputs.items()}
    names = {i.name for i in last.graph.input}
    rng = np.random.default_rng(0)
    for length in range(feeds[x].shape[1] + 1):
        feeds[x] = np.zeros_like(feeds[x])
        feeds[x][0, :length] = rng.integers(PAD_ID + 1, words, size=length)
        every = sessions[0].run(None, feeds)[0]
        got = sessions[1].run(None, {k: v for k, v in feeds.items() if k in names})[0]
        want = every[0, max(length - 1, 0)]
        if got.shape != (1, every.shape[-1]) or not np.allclose(got[0], want, rtol=1e-4, atol=1e-5):
            return False
    return True
