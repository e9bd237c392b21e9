"""ONNX Runtime on-device training artifacts, with the BatchNorm recipe of docs/engines.md applied."""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import helper, numpy_helper

from edgepfl.export.masked import StepShape
from edgepfl.export.portable import DISTILL_SETS, DISTILL_VARIANTS

ORT_MAX_IR = 10  # onnxruntime(-training) 1.19 loads IR <= 10
ORT_OPSET = 17
TRAINING_SETS = ("full", "personal", "base")
LOGITS = "logits"
LOSS = "loss"  # the output a loss wrapper's graph (distillation, every position) trains on
DISTILL_INPUTS = ("input", "labels", "teacher_logits", "T", "lambda")
SEQUENCE_INPUTS = ("input", "labels", "weights")
WRAPPED_PREFIX = "model."  # a loss wrapper's name for the model's tensors


def export_training_onnx(model: torch.nn.Module, path: Path, shape: StepShape | None = None) -> onnx.ModelProto:
    """Training-mode ONNX export that leaves the model and the exported initializers untouched.

    Tracing runs one train-mode forward pass, which moves BatchNorm running statistics in the
    module and in the written initializers; both are restored from a copy taken before.
    `shape` gives the input shape (a zoo model's own spec when left out).
    """
    before = copy.deepcopy(model.state_dict())
    example = _traced_shape(model, shape).zeros(2)
    model.train()
    with warnings.catch_warnings():
        # num_batches_tracked is not model state here (momentum is fixed), its increment may go
        warnings.filterwarnings("ignore", message=".*num_batches_tracked.*")
        _export_train_mode(model, example, path)
    model.load_state_dict(before)
    proto = onnx.load(str(path))
    for init in proto.graph.initializer:
        if init.name in before:
            init.CopyFrom(numpy_helper.from_array(before[init.name].detach().cpu().numpy(), init.name))
    ort_differentiable(proto)
    onnx.save(proto, str(path))
    return proto


def _traced_shape(model: torch.nn.Module, shape: StepShape | None) -> StepShape:
    """The shape to trace: the one given, else a zoo model's own spec's (float images)."""
    return StepShape.of(model) if shape is None else shape


def _export_train_mode(model: torch.nn.Module, example: torch.Tensor, path: Path) -> None:
    torch.onnx.export(
        model,
        (example,),
        str(path),
        input_names=["input"],
        output_names=[LOGITS],
        dynamic_axes={"input": {0: "batch"}, LOGITS: {0: "batch"}},
        opset_version=ORT_OPSET,
        do_constant_folding=False,
        training=torch.onnx.TrainingMode.TRAINING,
        dynamo=False,
    )


def ort_differentiable(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Rewrites so that ORT 1.19 can build the gradient graph, same values.

    HardSwish and HardSigmoid (no gradient builder) become Mul/Add/Clip: HardSigmoid(x) = Clip(alpha·x + beta,
    0, 1) with the node's alpha and beta, HardSwish(x) = x · HardSigmoid(x) with 1/6 and 1/2 (the ONNX
    definitions). LayerNormalization gets its optional Mean and InvStdDev outputs, which its gradient reads.
    """
    graph = proto.graph
    nodes = []

    def constant(value: float) -> str:
        # a Constant node, not an initializer: generate_artifacts would make an initializer a frozen parameter
        name = f"edgepfl_hard_const_{len(nodes)}"
        nodes.append(
            helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(value, np.float32)))
        )
        return name

    for index, node in enumerate(graph.node):
        if node.op_type == "LayerNormalization":
            node.output.extend(f"edgepfl_ln_{index}_{kind}" for kind in ("mean", "inv_std")[len(node.output) - 1 :])
        if node.op_type not in ("HardSwish", "HardSigmoid"):
            nodes.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        alpha = attrs.get("alpha", 0.2) if node.op_type == "HardSigmoid" else 1 / 6
        beta = attrs.get("beta", 0.5) if node.op_type == "HardSigmoid" else 0.5
        x, tag = node.input[0], f"edgepfl_hard_{index}"
        gate = node.output[0] if node.op_type == "HardSigmoid" else f"{tag}_gate"
        nodes += [
            helper.make_node("Mul", [x, constant(alpha)], [f"{tag}_scaled"], name=f"{tag}_mul"),
            helper.make_node("Add", [f"{tag}_scaled", constant(beta)], [f"{tag}_shifted"], name=f"{tag}_add"),
            helper.make_node("Clip", [f"{tag}_shifted", constant(0.0), constant(1.0)], [gate], name=f"{tag}_clip"),
        ]
        if node.op_type == "HardSwish":
            nodes.append(helper.make_node("Mul", [x, gate], [node.output[0]], name=f"{tag}_out"))
    del graph.node[:]
    graph.node.extend(nodes)
    return proto


def batchnorm_spatial_sizes(model: torch.nn.Module, shape: StepShape) -> dict[str, int]:
    """The number of positions (H·W) each BatchNorm normalises per sample, by its running_mean's name.

    Measured with one eval-mode forward pass of the PyTorch model (which moves no statistic): ONNX shape
    inference cannot always tell, e.g. behind ShuffleNet's channel shuffle, whose Reshape takes a computed shape.
    """
    sizes: dict[str, int] = {}
    hooks = [
        module.register_forward_hook(
            lambda _, inputs, __, name=name: sizes.__setitem__(f"{name}.running_mean", inputs[0][0, 0].numel())
        )
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
    ]
    training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(shape.zeros(1))
    finally:
        model.train(training)
        for hook in hooks:
            hook.remove()
    return sizes


def bn_stat_outputs(proto: onnx.ModelProto, spatial: dict[str, int]) -> list[dict]:
    """Training-mode BatchNorm nodes: which graph value carries each updated running statistic.

    Returns [{"output", "buffer", "kind", "reduce"}]; `reduce` is the N-free H*W of the normalised input
    (`spatial`, from `batchnorm_spatial_sizes`), used to turn ORT's population variance into PyTorch's
    unbiased update.
    """
    stats = []
    for node in proto.graph.node:
        if node.op_type != "BatchNormalization" or len(node.output) < 3:
            continue
        mode = [helper.get_attribute_value(a) for a in node.attribute if a.name == "training_mode"]
        if not mode or mode[0] != 1:
            continue
        if node.input[3] not in spatial:
            raise ValueError(f"BatchNorm statistic {node.input[3]} is not a BatchNorm module's running_mean")
        reduce = spatial[node.input[3]]
        stats.append({"output": node.output[1], "buffer": node.input[3], "kind": "mean", "reduce": reduce})
        stats.append({"output": node.output[2], "buffer": node.input[4], "kind": "var", "reduce": reduce})
    return stats


def export_distill_onnx(
    model: torch.nn.Module, variant: str, path: Path, shape: StepShape | None = None
) -> onnx.ModelProto:
    """Training-mode ONNX export of (input, labels, teacher_logits, T, lambda) -> (loss, logits) for PersFL.

    The loss is `edgepfl.export.portable.distillation_loss`, the same function the portable graphs trace.
    """
    batch = 2
    shape = _traced_shape(model, shape)
    example = (
        shape.zeros(batch),
        torch.zeros(batch, dtype=torch.int64),
        torch.zeros(batch, shape.num_classes),
        torch.tensor(2.0),
        torch.tensor(0.5),
    )
    batched = ("input", "labels", "teacher_logits")
    return _export_with_loss(_DistillForward(model, variant), example, DISTILL_INPUTS, batched, path)


def export_sequence_onnx(model: torch.nn.Module, path: Path, shape: StepShape) -> onnx.ModelProto:
    """Training-mode ONNX export of (input, labels, weights) -> (loss, logits) for a model taught a target at every
    position (a next-word model): the loss is sum(w·ce)/sum(w) over its targets, as the torch engine and the
    portable graphs compute it (ORT's own cross-entropy takes one label a sample)."""
    batch = 2
    example = (
        shape.zeros(batch),
        torch.zeros(batch, *shape.target_shape, dtype=torch.int64),
        torch.ones(batch, *shape.target_shape),
    )
    return _export_with_loss(_SequenceForward(model), example, SEQUENCE_INPUTS, SEQUENCE_INPUTS, path)


def _export_with_loss(
    wrapper: torch.nn.Module,
    example: tuple[torch.Tensor, ...],
    input_names: tuple[str, ...],
    batched: tuple[str, ...],
    path: Path,
) -> onnx.ModelProto:
    """Export `wrapper` (its `model` followed by a loss) in training mode as (inputs) -> (loss, logits).

    Tensor names are the model's own (the wrapper's `model.` prefix is removed); the model is left untouched."""
    model = wrapper.model
    before = copy.deepcopy(model.state_dict())
    wrapper.train()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*num_batches_tracked.*")
        torch.onnx.export(
            wrapper,
            example,
            str(path),
            input_names=list(input_names),
            output_names=[LOSS, LOGITS],
            dynamic_axes={**{name: {0: "batch"} for name in batched}, LOGITS: {0: "batch"}},
            opset_version=ORT_OPSET,
            do_constant_folding=False,
            training=torch.onnx.TrainingMode.TRAINING,
            dynamo=False,
        )
    model.load_state_dict(before)
    proto = onnx.load(str(path))
    prefix = WRAPPED_PREFIX
    renamed = {init.name: init.name[len(prefix) :] for init in proto.graph.initializer if init.name.startswith(prefix)}
    for init in proto.graph.initializer:
        init.name = renamed.get(init.name, init.name)
        if init.name in before:
            init.CopyFrom(numpy_helper.from_array(before[init.name].detach().cpu().numpy(), init.name))
    for index, node in enumerate(proto.graph.node):
        node.input[:] = [renamed.get(name, name) for name in node.input]
        if node.op_type == "SoftmaxCrossEntropyLoss" and len(node.output) == 1:
            # ORT's gradient of this op reads its optional log_prob output, which the exporter may leave out
            node.output.append(f"distill_log_prob_{index}")
    ort_differentiable(proto)
    onnx.save(proto, str(path))
    return proto


def build_distill_sets(
    model: torch.nn.Module,
    trainable_sets: dict[str, list[str]],
    folder: Path,
    optimizer: str,
    shape: StepShape | None = None,
) -> dict:
    """ORT training artifacts of the distillation loss, per variant and set; returns the manifest entry."""
    entry: dict = {}
    for variant in DISTILL_VARIANTS:
        forward = folder / f"forward_distill_{variant}.onnx"
        proto = export_distill_onnx(model, variant, forward, shape)
        stats = bn_stat_outputs(proto, batchnorm_spatial_sizes(model, _traced_shape(model, shape)))
        sets = {}
        for set_name in DISTILL_SETS:
            trainable = trainable_sets.get(set_name)
            if not trainable:
                continue
            out = f"distill_{variant}_{set_name}"
            build_training_set(proto, folder / out, trainable, optimizer, stats, loss_output=LOSS)
            sets[set_name] = {
                "training_model": f"{folder.name}/{out}/training_model.onnx",
                "eval_model": f"{folder.name}/{out}/eval_model.onnx",
                "optimizer_model": f"{folder.name}/{out}/optimizer_model.onnx",
                "checkpoint": f"{folder.name}/{out}/checkpoint",
            }
        forward.unlink()
        entry[variant] = {"sets": sets, "bn_stats": stats, "inputs": list(DISTILL_INPUTS)}
    return entry


class _SequenceForward(torch.nn.Module):
    """The model followed by the weighted cross-entropy over every target, as one module for the exporter."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x, labels, weights):
        logits = self.model(x)
        per_target = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        return (per_target * weights.reshape(-1)).sum() / weights.sum(), logits


class _DistillForward(torch.nn.Module):
    """The model followed by PersFL's distillation loss, as one module for the exporter."""

    def __init__(self, model: torch.nn.Module, variant: str):
        super().__init__()
        self.model = model
        self.variant = variant

    def forward(self, x, labels, teacher_logits, temperature, lam):
        from edgepfl.export.portable import distillation_loss

        logits = self.model(x)
        weights = torch.ones_like(labels, dtype=logits.dtype)
        return distillation_loss(logits, teacher_logits, labels, weights, temperature, lam, self.variant), logits


def build_training_set(
    proto: onnx.ModelProto,
    out_dir: Path,
    trainable: list[str],
    optimizer: str,
    stats: list[dict],
    loss_output: str | None = None,
) -> list[str]:
    """generate_artifacts for one trainable set, then the eval-graph and IR fixes; returns file names.

    Without `loss_output` ORT adds cross-entropy on the logits; with it, that graph output is the loss.
    """
    from onnxruntime.training import artifacts

    out_dir.mkdir(parents=True, exist_ok=True)
    frozen = [init.name for init in proto.graph.initializer if init.name not in set(trainable)]
    optim = {"sgd": artifacts.OptimType.SGD, "adamw": artifacts.OptimType.AdamW}[optimizer]
    with _quiet_native_stderr():
        artifacts.generate_artifacts(
            copy.deepcopy(proto),
            requires_grad=list(trainable),
            frozen_params=frozen,
            loss=artifacts.LossType.CrossEntropyLoss if loss_output is None else None,
            loss_input_names=None if loss_output is None else [loss_output],
            optimizer=optim,
            artifact_directory=str(out_dir),
            additional_output_names=[LOGITS, *(s["output"] for s in stats)],
        )
    _fix_eval_model(out_dir / "eval_model.onnx")
    for name in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
        path = out_dir / name
        model = onnx.load(str(path))
        if model.ir_version > ORT_MAX_IR:
            model.ir_version = ORT_MAX_IR
            onnx.save(model, str(path))
    return sorted(os.listdir(out_dir))


@contextlib.contextmanager
def _quiet_native_stderr():
    """The gradient builder logs every graph transformer at INFO straight to fd 2, ignoring
    set_default_logger_severity; errors still surface as Python exceptions."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _fix_eval_model(path: Path) -> None:
    """ORT sets training_mode=0 on BatchNorm in the eval graph but keeps 3 outputs, which it then
    refuses to load (microsoft/onnxruntime#19370): keep output 0, pass the statistics through."""
    model = onnx.load(str(path))
    graph = model.graph
    graph_outputs = {o.name for o in graph.output}
    nodes = []
    for node in graph.node:
        nodes.append(node)
        if node.op_type != "BatchNormalization" or len(node.output) == 1:
            continue
        mode = [helper.get_attribute_value(a) for a in node.attribute if a.name == "training_mode"]
        if mode and mode[0] == 1:
            continue
        dropped = list(node.output[1:])
        del node.output[1:]
        for out_name, source in zip(dropped, (node.input[3], node.input[4])):
            if out_name in graph_outputs:
                nodes.append(helper.make_node("Identity", [source], [out_name], name=f"{node.name}_pass_{out_name}"))
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
