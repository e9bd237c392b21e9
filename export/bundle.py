"""`edgepfl export`: a zoo model split at K_P, written as a bundle that devices and the server read."""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

import edgepfl
from edgepfl.atomic import sha256_file
from edgepfl.errors import EdgePFLError, UsageError
from edgepfl.export import inference, ort_training, prepare, source
from edgepfl.export.blocks import BlockList, check_blocks, find_blocks
from edgepfl.export.masked import StepShape
from edgepfl.export.models import ModelSpec, build_model, default_spec, validate_spec
from edgepfl.export.options import ExportOptions
from edgepfl.export.personal import apply_spec
from edgepfl.kinds import InputSpec, SampleKind, parse_kind
from edgepfl.manifest import Manifest, class_names_problem
from edgepfl.personal import PersonalSpec, as_spec


@dataclass
class ExportTarget:
    """A model ready to export: the module, its blocks and what the manifest records about it."""

    module: nn.Module
    input_shape: tuple[int, ...]
    num_classes: int
    blocks: BlockList
    normalization: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())
    description: dict = field(default_factory=dict)
    input_dtype: str = "float32"  # int64: token ids (a text model)
    kind: SampleKind | None = None  # what a sample is beyond the input (edgepfl/kinds/: a vocabulary, channels); images
    files: dict[str, bytes] = field(default_factory=dict)  # written into the bundle as they are (vocab.json)


def export_bundle(
    model: nn.Module | ModelSpec,
    kp: int | str | PersonalSpec,
    out: str | Path,
    options: ExportOptions = ExportOptions(),
    progress: Callable[[str], None] = lambda _: None,
    *,
    input_shape: Sequence[int] | None = None,
    blocks: BlockList | None = None,
    normalization: tuple[Sequence[float], Sequence[float]] = ((), ()),
    description: dict | None = None,
    notice: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> Manifest:
    """Split `model` by `kp` (an int: the last K blocks personal; or a `--personal` spec, edgepfl/personal.py) and
    write the bundle into `out`; returns its manifest.

    `model` is any nn.Module (its weights are exported as they are; `input_shape` is (C, H, W) of one
    sample; `blocks` as (name, [submodule names]) from the input end, else found by `find_blocks`), or
    a zoo ModelSpec (built with `options.seed`). `notice` gets the one-line remarks (dropout off, an
    engine that cannot be built).
    """
    target = (
        zoo_target(model, options.seed)
        if isinstance(model, ModelSpec)
        else module_target(model, input_shape, blocks, normalization, description)
    )
    return export_target(target, kp, out, options, progress, notice)


def export_target(
    target: ExportTarget,
    kp: int | str | PersonalSpec,
    out: str | Path,
    options: ExportOptions = ExportOptions(),
    progress: Callable[[str], None] = lambda _: None,
    notice: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> Manifest:
    """Write the bundle of a checked target (see `export_bundle`) into `out`, atomically."""
    spec, explicit = as_spec(kp)
    validate_export(spec.output, out, options, len(target.blocks), target.description.get("name", "model"))
    validate_class_names(options, target.num_classes)
    out = Path(out)
    # build next to the target and swap at the end, so a failed export never destroys a bundle
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        manifest = _write_bundle(target, spec, explicit, staging, options, progress, notice)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def zoo_target(spec: ModelSpec, seed: int) -> ExportTarget:
    """A zoo model built from its spec under `seed`; the manifest records the spec verbatim."""
    validate_spec(spec)
    torch.manual_seed(seed)
    model = build_model(spec).eval()
    return ExportTarget(
        model, spec.input_shape, spec.num_classes, model.block_modules, spec.normalization, spec.to_dict()
    )


def module_target(
    module: nn.Module,
    input_shape: Sequence[int] | None,
    blocks: BlockList | None = None,
    normalization: tuple[Sequence[float], Sequence[float]] = ((), ()),
    description: dict | None = None,
) -> ExportTarget:
    """Check any nn.Module for export: input shape, blocks (every tensor in exactly one), BatchNorm, logits."""
    if not isinstance(module, nn.Module):
        raise UsageError(f"export_bundle got a {type(module).__name__}", "pass an nn.Module or a zoo ModelSpec")
    if input_shape is None:
        input_shape = getattr(module, source.INPUT_SHAPE_ATTR, None)
    if input_shape is None:
        raise UsageError(
            f"{(description or {}).get('name', type(module).__name__)} does not say its input shape",
            "pass --input-shape C,H,W (input_shape= in Python)",
        )
    input_shape = tuple(int(d) for d in input_shape)
    if len(input_shape) != 3 or min(input_shape) < 1:
        raise UsageError(f"input shape {input_shape} is not (C, H, W)", "pass e.g. --input-shape 3,32,32")
    origin = "given"
    if blocks is None:
        blocks, origin = find_blocks(module)
    blocks = [(str(name), list(members)) for name, members in blocks]
    check_blocks(module, blocks)
    prepare.check_batchnorm(module)
    mean, std = (tuple(float(v) for v in part) for part in normalization)
    if len(mean) != len(std) or (mean and len(mean) != input_shape[0]):
        raise UsageError(
            f"normalization {normalization} does not fit {input_shape[0]} channels", "one mean/std per channel"
        )
    num_classes = source.output_classes(module, input_shape)
    description = {"name": type(module).__name__, **(description or {})}
    description.update(
        {
            "class": f"{type(module).__module__}.{type(module).__qualname__}",
            "input_shape": list(input_shape),
            "num_classes": num_classes,
            "blocks_from": origin,
            "random_layers_off": prepare.random_layers(module),
        }
    )
    return ExportTarget(module, input_shape, num_classes, blocks, (mean, std), description)


def simulation_target(
    model: str,
    sample_shape: Sequence[int],
    num_classes: int,
    seed: int,
    width: float = 0.25,
    norm: str | None = None,
) -> ExportTarget:
    """The simulator's model for a dataset: a zoo name with its knobs, or a MODEL string given the dataset's
    input shape and a fresh head of `num_classes`."""
    parsed = source.parse_model(model)
    if parsed.is_zoo:
        base = default_spec(model)
        spec = ModelSpec(
            name=model,
            width=width if model == "mobilenet" else base.width,
            input_size=int(sample_shape[1]),
            in_channels=int(sample_shape[0]),
            num_classes=num_classes,
            norm=norm or base.norm,
        )
        return zoo_target(spec, seed)
    loaded = source.build_from_string(parsed, tuple(int(d) for d in sample_shape), None, num_classes, seed)
    return module_target(loaded.module, loaded.input_shape, None, loaded.normalization, loaded.description)


def validate_export(kp: int, out: str | Path, options: ExportOptions, num_blocks: int, name: str = "model") -> None:
    """One-line errors for a bad K_P or output folder, before any work (ExportOptions checked the rest)."""
    if not 0 <= kp <= num_blocks:
        raise UsageError(
            f"--kp {kp} is outside 0..{num_blocks} for {name}",
            f"choose 0 (FedAvg, all base) to {num_blocks} (all personal)",
        )
    target = Path(out)
    if target.exists() and not target.is_dir():
        raise UsageError(f"output {target} exists and is not a folder", "choose another --out")
    if target.is_dir() and any(target.iterdir()) and not options.force:
        raise UsageError(f"output folder {target} is not empty", "choose an empty --out or add --force")


def validate_class_names(options: ExportOptions, num_classes: int) -> None:
    """One line when the export names the classes but not exactly one name per class of the model."""
    problem = class_names_problem(options.class_names, num_classes)
    if problem:
        raise UsageError(f"--class-names: {problem}", f"give {num_classes} names, in class order")


def sample_kind(target: ExportTarget) -> SampleKind:
    """The kind the target's manifest names, with the target's input, checked as a device reading it checks it."""
    mean, std = target.normalization
    spec = InputSpec(shape=target.input_shape, dtype=target.input_dtype, mean=tuple(mean), std=tuple(std))
    return parse_kind(target.kind.entry() if target.kind is not None else None, spec, target.num_classes)


def _write_bundle(
    target: ExportTarget,
    spec: PersonalSpec,
    explicit: bool,
    folder: Path,
    options: ExportOptions,
    progress: Callable[[str], None],
    notice: Callable[[str], None],
) -> Manifest:
    name, shape = target.description.get("name", "model"), target.input_shape
    model, tensors, kp = apply_spec(target.module, target.blocks, shape, spec, explicit, options.seed, name)
    mean, std = target.normalization
    manifest = Manifest(
        model=target.description,
        kind=sample_kind(target),
        num_classes=target.num_classes,
        kp=kp,
        blocks=tuple(name for name, _ in target.blocks),
        tensors=tensors,
        edgepfl_version=edgepfl.__version__,
        class_names=options.class_names,
        personal=str(spec),
    )
    for name, payload in target.files.items():
        (folder / name).write_bytes(payload)
    shape = StepShape(target.input_shape, target.num_classes, target.input_dtype, manifest.kind.target_shape)
    random_off = prepare.random_layers(model)
    if random_off:
        notice(
            f"note: {len(random_off)} Dropout/StochasticDepth layer(s) run as in evaluation mode in on-device "
            f"training (e.g. {random_off[0]}); the manifest lists them under model.random_layers_off"
        )
    trainer = prepare.without_random_layers(model)
    engines: dict = {}
    progress("inference model")
    inference.export_inference(model, shape, folder / "model.onnx")
    wanted = list(options.engines)
    if "portable" in wanted:
        prepare.check_portable_ops(trainer, target.input_shape, shape.zeros(0).dtype)  # fail fast, before ORT
    if "ort-training" in wanted:
        progress("ort-training artifacts")
        try:
            engines["ort-training"] = _export_ort_training(trainer, shape, manifest, folder / "ort-training", options)
        except OrtUnsupported as exc:
            if "portable" not in wanted:
                raise UsageError(str(exc), "export with --engines portable") from None
            shutil.rmtree(folder / "ort-training", ignore_errors=True)
            notice(f"note: no ort-training artifacts: {exc}; writing the portable engine only")
    if "portable" in wanted:
        progress("portable step graphs")
        from edgepfl.export import portable

        try:
            engines["portable"] = portable.export_portable(
                trainer,
                manifest,
                folder / "portable",
                options.portable_batch,
                distill=options.distill,
                frozen_variants=options.frozen_variants,
            )
        except EdgePFLError:
            raise
        except Exception as exc:  # a tracer or exporter failure: one line instead of a half-written graph
            raise UsageError(
                f"the portable step graph could not be exported ({type(exc).__name__}: {_first_line(exc)})",
                "export with --engines ort-training, or report the model to the edgepfl developers",
            ) from None
        for line in _webgpu_notes(engines["portable"]):
            notice(line)
    files = {
        str(path.relative_to(folder)).replace("\\", "/"): sha256_file(path)
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }
    final = Manifest(**{**manifest.__dict__, "engines": engines, "files": files})
    final.check()
    final.save(folder)
    return final


class OrtUnsupported(Exception):
    """onnxruntime-training 1.19.2 cannot build artifacts for this model (the message says why)."""


def _export_ort_training(
    model: nn.Module, shape: StepShape, manifest: Manifest, folder: Path, options: ExportOptions
) -> dict:
    momenta = prepare.batchnorm_momenta(model)
    if len(momenta) > 1:
        raise OrtUnsupported(
            f"ort-training needs one BatchNorm momentum and this model's layers use {len(momenta)} ({momenta[:3]})"
        )
    model = prepare.primitive_group_norm(model)
    folder.mkdir(parents=True, exist_ok=True)
    sequence = bool(shape.target_shape)  # a target at every position: the graph computes its own loss
    forward = folder / "forward_training.onnx"
    if sequence:
        proto = ort_training.export_sequence_onnx(model, forward, shape)
    else:
        proto = ort_training.export_training_onnx(model, forward, shape)
    stats = ort_training.bn_stat_outputs(proto, ort_training.batchnorm_spatial_sizes(model, shape))
    trainable_sets = manifest.trainable_sets()
    loss_output = ort_training.LOSS if sequence else None
    sets = {}
    for set_name, trainable in trainable_sets.items():
        try:
            ort_training.build_training_set(
                proto, folder / set_name, trainable, options.optimizer, stats, loss_output=loss_output
            )
        except RuntimeError as exc:
            raise OrtUnsupported(
                f"onnxruntime-training 1.19.2 cannot build artifacts for this model ({_ort_reason(exc)})"
            ) from None
        sets[set_name] = {
            "training_model": f"ort-training/{set_name}/training_model.onnx",
            "eval_model": f"ort-training/{set_name}/eval_model.onnx",
            "optimizer_model": f"ort-training/{set_name}/optimizer_model.onnx",
            "checkpoint": f"ort-training/{set_name}/checkpoint",
        }
    (folder / "forward_training.onnx").unlink()
    distill = (
        ort_training.build_distill_sets(model, trainable_sets, folder, options.optimizer, shape)
        if options.distill and not sequence  # PersFL's teacher gives one row of logits a sample
        else {}
    )
    return {
        "optimizer": options.optimizer,
        "loss": "cross_entropy",
        "sets": sets,
        "bn_stats": stats,
        "distill": distill,
        "bn_momentum": momenta[0] if momenta else 0.1,
        "input_name": "input",
    }


def _webgpu_notes(entry: dict) -> list[str]:
    """One note per reason a browser's GPU cannot run portable graphs whole (export/webgpu.py), naming the graphs."""
    graphs = {**{f"step_{name}": step for name, step in entry["steps"].items()}, "eval": entry["eval"]}
    by_reason: dict[str, list[str]] = {}
    for name, graph in graphs.items():
        if graph.get("webgpu_problems"):
            by_reason.setdefault(graph["webgpu_problems"][0], []).append(name)
    return [
        f"note: browsers run {', '.join(names)} on WebAssembly, not the GPU: {why}" for why, names in by_reason.items()
    ]


def _ort_reason(exc: BaseException) -> str:
    text = str(exc)
    marker = "The gradient builder has not been registered:"
    if marker in text:
        return "no gradient for " + text.split(marker, 1)[1].strip().splitlines()[0]
    return _first_line(exc)


def _first_line(exc: BaseException) -> str:
    missing = re.search(r"No ONNX function found for <OpOverload\(op='([\w.]+)'", str(exc))
    if missing:
        return f"the ONNX exporter has no function for {missing.group(1)}"
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1][:200] if lines else type(exc).__name__
