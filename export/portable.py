"""The portable engine's artifacts: a whole SGD training step as a graph of default-domain ONNX ops.

Each step graph maps `param:<name>…, buffer:<name>…, x, y, w, lr` to `loss, new_param:<name>…, new_buffer:<name>…`,
with no output for a tensor the step passes through unchanged (the manifest entry's `updates` names the tensor each
output after the loss updates). `w` is a per-target weight (a next-word model's y and w have a position axis, and
its logits one more): the loss is sum(w·ce)/sum(w) over the batch's targets, and training-mode
BatchNorm computes its batch statistics over the samples with w > 0 only, so a last partial batch padded with w = 0
trains exactly like PyTorch on its real samples. Plain onnxruntime (any current release, ARM included) runs these
graphs; no training build is needed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import onnx
import onnx_ir.passes.common
import onnxscript
import onnxscript.optimizer
import torch
import torch.nn.functional as F
from torch import nn

from edgepfl.errors import UsageError
from edgepfl.export import fanout
from edgepfl.export.crossentropy import LABEL_DTYPE, correct_count, weighted_cross_entropy
from edgepfl.export.decompositions import trace
from edgepfl.export.frozen import FROZEN_LOCATION, frozen_variant
from edgepfl.export.lastposition import last_position_graph
from edgepfl.export.masked import MaskedModel, StepShape
from edgepfl.export.shapecopies import constants_as_initializers, drop_shape_copies
from edgepfl.export.translations import translation_table
from edgepfl.export.webgpu import webgpu_problems
from edgepfl.manifest import Manifest
from edgepfl.wire import save_tensors

PORTABLE_OPSET = 20
PORTABLE_IR = 10  # onnxruntime 1.19 loads IR <= 10
DEFAULT_BATCH = 32
# the predict graph takes up to batch // PREDICT_SHARE inputs one by one (manifest `predict.up_to`), the eval graph
# more: for MobileNet one sample costs about a seventh of a padded batch of 32
PREDICT_SHARE = 8
PARAM_PREFIX = "param:"
BUFFER_PREFIX = "buffer:"
NEW_PARAM_PREFIX = "new_param:"
NEW_BUFFER_PREFIX = "new_buffer:"
SAMPLE_INPUTS = ("x", "y", "w")
DISTILL_INPUTS = ("teacher_logits", "T", "lambda")
DISTILL_VARIANTS = ("kd", "gd")  # PersFL (Hinton KD) and PersFL-GD (generalized distillation)
DISTILL_SETS = ("full", "personal")  # stage 2 trains the whole student; personal-only for K_P > 0
STEP_OUTPUT_LOSS = "loss"
EVAL_OUTPUTS = ("logits", "loss", "correct")


def export_portable(
    model: nn.Module,
    manifest: Manifest,
    folder: Path,
    batch_size: int = DEFAULT_BATCH,
    distill: bool = True,
    frozen_variants: bool = True,
) -> dict:
    """Write step, distillation (optional) and eval graphs and the initial tensors; returns the manifest entry.
    With `frozen_variants` each step that passes tensors through also gets its frozen variant (export/frozen.py)."""
    if batch_size < 1:
        raise UsageError(f"portable batch size {batch_size} must be positive", "use 32, or at least 1")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    prefix = folder.name
    shape = StepShape(
        tuple(manifest.input.shape), manifest.num_classes, manifest.input.dtype, manifest.kind.target_shape
    )
    step_model = MaskedModel(model, shape)
    distill = distill and not shape.target_shape  # PersFL's teacher gives one row of logits a sample
    trainable = set(manifest.trainable("full"))
    params = [name for name, _ in model.named_parameters() if name in trainable]
    buffers = [name for name, _ in model.named_buffers() if name in set(manifest.names("buffer"))]
    state = _state(model, params, buffers)
    # the manifest's sets, each in the model's parameter order (the step graph's input order)
    trainable_sets = {name: [n for n in params if n in set(names)] for name, names in manifest.trainable_sets().items()}
    steps = {}
    for set_name, trainable in trainable_sets.items():  # K_P=0 has no personal set, K_P=max no base set
        proto = export_step(step_model, params, buffers, trainable, batch_size)
        onnx.save(proto, str(folder / f"step_{set_name}.onnx"))
        steps[set_name] = {**_graph_entry(f"{prefix}/step_{set_name}.onnx", proto), "trainable": trainable}
        # the tensors the step passes through (no output updates them) as initializers the engine supplies
        updated = set(steps[set_name].get("updates", ()))
        frozen = [name for name, n in zip(_state_names(params, buffers), params + buffers) if n not in updated]
        variant = frozen_variant(proto, frozen) if frozen_variants else None
        if variant is not None:  # export/frozen.py
            onnx.save(variant, str(folder / f"step_{set_name}_frozen.onnx"))
            steps[set_name]["frozen"] = {
                **_graph_entry(f"{prefix}/step_{set_name}_frozen.onnx", variant),
                "initializers": frozen,
                "data_location": FROZEN_LOCATION,  # where the variant says their bytes are, laid end to end
            }
    distill_steps: dict = {}
    for variant in DISTILL_VARIANTS if distill else ():
        for set_name in DISTILL_SETS:
            trainable = trainable_sets.get(set_name)
            if not trainable:
                continue
            proto = export_distill_step(step_model, params, buffers, trainable, batch_size, variant)
            onnx.save(proto, str(folder / f"distill_{variant}_{set_name}.onnx"))
            distill_steps.setdefault(variant, {})[set_name] = {
                **_graph_io(f"{prefix}/distill_{variant}_{set_name}.onnx", proto),
                "trainable": trainable,
            }
    eval_proto = export_eval(step_model, params, buffers, batch_size)
    onnx.save(eval_proto, str(folder / "eval.onnx"))
    # one sample at a time, for predicting a photo or two: the eval graph would compute a whole padded batch
    one_by_one = batch_size // PREDICT_SHARE
    predict: dict = {}
    if one_by_one:
        predict_proto = export_predict(step_model, params, buffers)
        onnx.save(predict_proto, str(folder / "predict.onnx"))
        predict = {
            "predict": {**_graph_entry(f"{prefix}/predict.onnx", predict_proto), "batch_size": 1, "up_to": one_by_one}
        }
    save_tensors(folder / "initial.safetensors", {n: t.detach().cpu().numpy() for n, t in state.items()})
    return {
        "batch_size": batch_size,
        "opset": PORTABLE_OPSET,
        "ir_version": PORTABLE_IR,
        "loss": "cross_entropy",
        "label_dtype": str(LABEL_DTYPE).removeprefix("torch."),
        "optimizer": "sgd",
        "bn_momentum": step_model.momentum,
        "params": params,
        "buffers": buffers,
        "steps": steps,
        "distill": distill_steps,
        "eval": _graph_entry(f"{prefix}/eval.onnx", eval_proto),
        **predict,
        "initial": f"{prefix}/initial.safetensors",
    }


def _graph_io(model: str, proto: onnx.ModelProto) -> dict:
    """A graph's file and its input and output names, as the manifest gives them to the engines; for a step graph
    also `updates`, the state tensor each output after the loss updates (a tensor it passes through has none)."""
    inputs, outputs = [i.name for i in proto.graph.input], [o.name for o in proto.graph.output]
    updates = [_state_of(name) for name in outputs[1:] if name.startswith((NEW_PARAM_PREFIX, NEW_BUFFER_PREFIX))]
    return {"model": model, "inputs": inputs, "outputs": outputs, **({"updates": updates} if updates else {})}


def _state_of(output: str) -> str:
    """The state tensor a step graph's `new_param:`/`new_buffer:` output is the new value of."""
    prefix = NEW_PARAM_PREFIX if output.startswith(NEW_PARAM_PREFIX) else NEW_BUFFER_PREFIX
    return output.removeprefix(prefix)


def _graph_entry(model: str, proto: onnx.ModelProto) -> dict:
    """The manifest entry of a graph the page may run: `_graph_io` and what keeps it off WebGPU."""
    return {**_graph_io(model, proto), "webgpu_problems": webgpu_problems(proto)}


def sgd_step(
    model: MaskedModel,
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    trainable: Sequence[str],
    x: torch.Tensor,
    y: torch.Tensor,
    w: torch.Tensor,
    lr: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One SGD step of a masked-BatchNorm model: (loss, new params, new buffers); frozen params pass through."""
    return _sgd_on(lambda logits: weighted_cross_entropy(logits, y, w), model, params, buffers, trainable, x, w, lr)


def _sgd_on(
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    model: MaskedModel,
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    trainable: Sequence[str],
    x: torch.Tensor,
    w: torch.Tensor,
    lr: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One SGD step on the loss `loss_of(logits)`: (loss, new params, new buffers).

    Plain autograd rather than torch.func: the masked BatchNorm op's written-out backward (export/masked.py)
    is a custom op, which torch.func's transforms do not take."""
    train = {n: params[n].detach().requires_grad_(True) for n in trainable}
    new_buffers = {n: b.clone() for n, b in buffers.items()}
    with torch.enable_grad():
        loss = loss_of(model({**params, **train, **new_buffers}, x, w))
        # the backward seeded with lr instead of 1 gives lr * gradient for every tensor (each product in the
        # backward is linear in its seed), so each update is one Sub of two same-shaped tensors: no product by lr
        # per tensor (onnxruntime broadcasts a scalar over a (C, C', 1, 1) tensor ~50x slower than over a vector),
        # and none of the Reshape, Concat and Split nodes a flat update needs (each a dispatch on WebGPU)
        steps = torch.autograd.grad(loss, list(train.values()), grad_outputs=lr.to(loss.dtype))
    return loss.detach(), {**params, **_updated(params, dict(zip(train, steps)))}, new_buffers


def _updated(params: dict[str, torch.Tensor], steps: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """param − step for each trained tensor, one Sub each; the vectors (BatchNorm's weights and biases, a layer's
    bias) through one Sub of their concatenations where its Concat and Split trees take fewer nodes than a Sub
    each (MobileNet's 55 vectors: 31 nodes). The values are the same to the bit either way."""
    vectors = [n for n, step in steps.items() if step.dim() == 1]
    if 3 * fanout.nodes(len(vectors)) + 2 >= len(vectors):  # two cats, the Sub, a split of at most one more
        vectors = []
    updated = {n: params[n] - step for n, step in steps.items() if n not in vectors}
    if vectors:
        flat = fanout.cat([params[n] for n in vectors]) - fanout.cat([steps[n] for n in vectors])
        updated.update(zip(vectors, fanout.split(flat, [steps[n].numel() for n in vectors])))
    return updated


def export_step(
    step_model: MaskedModel, params: list[str], buffers: list[str], trainable: list[str], batch_size: int
) -> onnx.ModelProto:
    """Trace `sgd_step` for one trainable set and export it as a default-domain ONNX graph."""
    step_model.train()
    inputs = _example_inputs(step_model, params, buffers, batch_size) + [torch.tensor(0.01)]
    input_names = _state_names(params, buffers) + [*SAMPLE_INPUTS, "lr"]
    output_names = (
        [STEP_OUTPUT_LOSS] + [NEW_PARAM_PREFIX + n for n in params] + [NEW_BUFFER_PREFIX + n for n in buffers]
    )
    return _to_onnx(step_function(step_model, params, buffers, trainable), inputs, input_names, output_names)


def step_function(
    step_model: MaskedModel, params: list[str], buffers: list[str], trainable: list[str]
) -> Callable[..., tuple[torch.Tensor, ...]]:
    """`sgd_step` over flat tensors in graph order: (params…, buffers…, x, y, w, lr) -> (loss, params…, buffers…)."""

    def step(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        param_values = dict(zip(params, flat[: len(params)]))
        buffer_values = dict(zip(buffers, flat[len(params) : len(params) + len(buffers)]))
        x, y, w, lr = flat[len(params) + len(buffers) :]
        loss, new_params, new_buffers = sgd_step(step_model, param_values, buffer_values, trainable, x, y, w, lr)
        return (loss, *(new_params[n] for n in params), *(new_buffers[n] for n in buffers))

    return step


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    y: torch.Tensor,
    w: torch.Tensor,
    temperature: torch.Tensor,
    lam: torch.Tensor,
    variant: str = "kd",
) -> torch.Tensor:
    """PersFL's stage-2 loss, averaged over the samples with weight w (w = 0 marks padding).

    kd (PersFL, Hinton et al.): (1-λ)·CE(y, softmax(s)) + λ·T²·KL(softmax(t/T) ‖ softmax(s/T)).
    gd (PersFL-GD, the paper's Eq. 7, generalized distillation of Lopez-Paz et al.): the student's soft
    predictions softmax(s/T) are fitted to the teacher's soft labels softmax(t/T) by cross-entropy,
    (1-λ)·CE(y, softmax(s)) + λ·CE(softmax(t/T), softmax(s/T)), with no T² factor. Our reading: the
    soft-label cross-entropy equals the KL term plus the teacher's entropy (constant in the student),
    so gd's gradient is kd's with the distillation term scaled by 1/T²; at T = 1 the two steps agree.
    """
    if variant not in DISTILL_VARIANTS:
        raise UsageError(f"unknown distillation variant {variant!r}", f"choose one of: {', '.join(DISTILL_VARIANTS)}")
    hard = F.cross_entropy(student_logits, y.long(), reduction="none")
    log_student = F.log_softmax(student_logits / temperature, dim=1)
    log_teacher = F.log_softmax(teacher_logits / temperature, dim=1)
    teacher = log_teacher.exp()
    if variant == "kd":
        soft = (teacher * (log_teacher - log_student)).sum(1) * (temperature * temperature)
    else:
        soft = -(teacher * log_student).sum(1)
    per_sample = (1 - lam) * hard + lam * soft
    return (per_sample * w).sum() / w.sum()


def distill_sgd_step(
    model: MaskedModel,
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    trainable: Sequence[str],
    batch: tuple[torch.Tensor, ...],
    variant: str = "kd",
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One SGD step on the distillation loss; `batch` is (x, y, w, teacher_logits, T, λ, lr)."""
    x, y, w, teacher_logits, temperature, lam, lr = batch

    def loss_of(logits: torch.Tensor) -> torch.Tensor:
        return distillation_loss(logits, teacher_logits, y, w, temperature, lam, variant)

    return _sgd_on(loss_of, model, params, buffers, trainable, x, w, lr)


def distill_step_function(
    step_model: MaskedModel, params: list[str], buffers: list[str], trainable: list[str], variant: str = "kd"
) -> Callable[..., tuple[torch.Tensor, ...]]:
    """`distill_sgd_step` over flat tensors: (params…, buffers…, x, y, w, teacher_logits, T, λ, lr) -> (loss, …)."""

    def step(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        param_values = dict(zip(params, flat[: len(params)]))
        buffer_values = dict(zip(buffers, flat[len(params) : len(params) + len(buffers)]))
        batch = flat[len(params) + len(buffers) :]
        loss, new_params, new_buffers = distill_sgd_step(
            step_model, param_values, buffer_values, trainable, batch, variant
        )
        return (loss, *(new_params[n] for n in params), *(new_buffers[n] for n in buffers))

    return step


def export_distill_step(
    step_model: MaskedModel,
    params: list[str],
    buffers: list[str],
    trainable: list[str],
    batch_size: int,
    variant: str = "kd",
) -> onnx.ModelProto:
    """Trace `distill_sgd_step` for one trainable set and variant as a default-domain ONNX graph."""
    step_model.train()
    inputs = _example_inputs(step_model, params, buffers, batch_size) + [
        torch.zeros(batch_size, step_model.spec.num_classes),
        torch.tensor(2.0),
        torch.tensor(0.5),
        torch.tensor(0.01),
    ]
    input_names = _state_names(params, buffers) + [*SAMPLE_INPUTS, *DISTILL_INPUTS, "lr"]
    output_names = (
        [STEP_OUTPUT_LOSS] + [NEW_PARAM_PREFIX + n for n in params] + [NEW_BUFFER_PREFIX + n for n in buffers]
    )
    fn = distill_step_function(step_model, params, buffers, trainable, variant)
    return _to_onnx(fn, inputs, input_names, output_names)


def export_eval(step_model: MaskedModel, params: list[str], buffers: list[str], batch_size: int) -> onnx.ModelProto:
    """Trace the inference-mode forward with loss and correct count as a default-domain ONNX graph."""

    def evaluate(*flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        state = dict(zip(params + buffers, flat[: len(params) + len(buffers)]))
        x, y, w = flat[len(params) + len(buffers) :]
        logits = step_model(state, x, w)
        return logits, weighted_cross_entropy(logits, y, w), correct_count(logits, y, w)

    step_model.train(False)
    inputs = _example_inputs(step_model, params, buffers, batch_size)
    input_names = _state_names(params, buffers) + list(SAMPLE_INPUTS)
    return _to_onnx(evaluate, inputs, input_names, list(EVAL_OUTPUTS))


def export_predict(step_model: MaskedModel, params: list[str], buffers: list[str]) -> onnx.ModelProto:
    """The one-sample predict graph: the eval graph at batch 1, or for a next-word model its logits at the last real
    position only (export/lastposition.py); the engines read a prediction from either form."""
    names = _state_names(params, buffers) + list(SAMPLE_INPUTS)
    inputs = dict(zip(names, _example_inputs(step_model, params, buffers, 1)))
    full = export_eval(step_model, params, buffers, 1)
    return last_position_graph(step_model, full, inputs, params + buffers, EVAL_OUTPUTS[0], _to_onnx)


def default_domain_violations(proto: onnx.ModelProto) -> list[str]:
    """Nodes and opset imports outside the default ONNX domain (empty when the graph is portable)."""
    bad = [
        f"node {n.name or n.op_type} in domain {n.domain}" for n in proto.graph.node if n.domain not in ("", "ai.onnx")
    ]
    bad += [f"opset import {o.domain}" for o in proto.opset_import if o.domain not in ("", "ai.onnx")]
    bad += [f"function {f.domain}.{f.name}" for f in proto.functions]
    return bad


def _state(model: nn.Module, params: list[str], buffers: list[str]) -> dict[str, torch.Tensor]:
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    return {n: tensors[n].detach().clone() for n in params + buffers}


def _state_names(params: list[str], buffers: list[str]) -> list[str]:
    return [PARAM_PREFIX + n for n in params] + [BUFFER_PREFIX + n for n in buffers]


def _example_inputs(step_model: MaskedModel, params: list[str], buffers: list[str], batch_size: int) -> list:
    state = _state(step_model.module, params, buffers)
    spec = step_model.spec
    return [
        *(state[n] for n in params + buffers),
        spec.zeros(batch_size),
        torch.zeros(batch_size, *spec.target_shape, dtype=LABEL_DTYPE),
        torch.ones(batch_size, *spec.target_shape),
    ]


def _to_onnx(
    fn: Callable[..., tuple[torch.Tensor, ...]],
    inputs: list[torch.Tensor],
    input_names: list[str],
    output_names: list[str],
) -> onnx.ModelProto:
    """`trace` -> torch.export -> ONNX, names applied."""
    graph_module = trace(fn, inputs)
    program = torch.export.export(graph_module, tuple(inputs), strict=False)
    # the exporter's full optimizer takes most of the export time; constant folding and CSE give
    # onnxruntime (which runs its own graph optimizations) what it needs
    onnx_program = torch.onnx.export(
        program,
        dynamo=True,
        opset_version=PORTABLE_OPSET,
        optimize=False,
        verbose=False,
        custom_translation_table=translation_table(),
    )
    ir_model = onnx_program.model
    onnxscript.optimizer.fold_constants_ir(ir_model)
    # one copy of each identical constant (e.g. DepthwiseMaps' tap matrices, made again for every layer
    # of the same map size and again for its backward), so that CSE also merges the products they feed
    onnx_ir.passes.common.DeduplicateInitializersPass(size_limit=1 << 20)(ir_model)
    onnxscript.ir.passes.common.RemoveUnusedNodesPass()(ir_model)
    onnxscript.ir.passes.common.CommonSubexpressionEliminationPass()(ir_model)
    proto = _rename(onnxscript.ir.serde.serialize_model(ir_model), input_names, output_names)
    proto = drop_shape_copies(constants_as_initializers(proto))
    proto.ir_version = min(proto.ir_version, PORTABLE_IR)
    onnx.checker.check_model(proto, full_check=True)
    return proto


def _rename(proto: onnx.ModelProto, input_names: list[str], output_names: list[str]) -> onnx.ModelProto:
    """Give graph inputs and outputs our names. An output that is a graph input (a tensor the step passes through)
    is left out rather than copied by an Identity node, a dispatch on a GPU: the engines keep that tensor as it is.
    An output that repeats an earlier one gets an Identity."""
    graph = proto.graph
    if len(graph.input) != len(input_names) or len(graph.output) != len(output_names):
        raise UsageError(
            f"traced graph has {len(graph.input)} inputs/{len(graph.output)} outputs, "
            f"expected {len(input_names)}/{len(output_names)}",
            "report this model to the edgepfl developers",
        )
    mapping = {value.name: name for value, name in zip(graph.input, input_names)}
    graph_inputs = set(mapping)
    renamed_outputs = set()
    for value, name in zip(list(graph.output), output_names):
        if value.name in graph_inputs:
            graph.output.remove(value)
        elif value.name in renamed_outputs:
            graph.node.append(onnx.helper.make_node("Identity", [value.name], [name], name=f"pass_{name}"))
            value.name = name
        else:
            mapping[value.name] = name
            renamed_outputs.add(value.name)
    for value in list(graph.input) + list(graph.output) + list(graph.value_info):
        value.name = mapping.get(value.name, value.name)
    for node in graph.node:
        node.input[:] = [mapping.get(s, s) for s in node.input]
        node.output[:] = [mapping.get(s, s) for s in node.output]
    return proto
