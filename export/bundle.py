"""`edgepfl export`: a zoo model split at K_P, written as a bundle that devices and the server read."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

import edgepfl
from edgepfl.atomic import sha256_file
from edgepfl.errors import UsageError
from edgepfl.export import ort_training
from edgepfl.export.models import BlockModel, ModelSpec, build_model
from edgepfl.manifest import InputSpec, Manifest, split_roles
from edgepfl.ortbuild import training_build_installed

ENGINES = ("ort-training", "portable")
INFERENCE_OPSET = 17


def default_engines() -> tuple[str, ...]:
    """Both engines where the training build is installed (it generates ORT artifacts), else portable only."""
    return ENGINES if training_build_installed() else ("portable",)


@dataclass(frozen=True)
class ExportOptions:
    """How to export: which engines, which optimizer for ORT training, the init seed, PersFL's distillation graphs."""

    engines: tuple[str, ...] = field(default_factory=default_engines)
    optimizer: str = "sgd"
    seed: int = 0
    force: bool = False
    portable_batch: int = 32
    distill: bool = False  # PersFL stage-2 graphs for both engines (about doubles export time and size)


def export_bundle(
    spec: ModelSpec,
    kp: int,
    out: str | Path,
    options: ExportOptions = ExportOptions(),
    progress: Callable[[str], None] = lambda _: None,
) -> Manifest:
    """Build the model, split it at `kp` and write the bundle into `out`; returns its manifest."""
    validate_export(kp, out, options, spec)
    torch.manual_seed(options.seed)
    model = build_model(spec)
    model.eval()
    out = Path(out)
    # build next to the target and swap at the end, so a failed export never destroys a bundle
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        manifest = _write_bundle(model, kp, staging, options, progress)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def validate_export(kp: int, out: str | Path, options: ExportOptions, spec: ModelSpec) -> None:
    """One-line errors for a bad K_P, engine, optimizer or output folder, before any work."""
    num_blocks = len(build_model(spec).block_modules)
    if not 0 <= kp <= num_blocks:
        raise UsageError(
            f"--kp {kp} is outside 0..{num_blocks} for {spec.name}",
            f"choose 0 (FedAvg, all base) to {num_blocks} (all personal)",
        )
    unknown = [e for e in options.engines if e not in ENGINES]
    if unknown or not options.engines:
        raise UsageError(f"unknown engine(s) {unknown or '(none)'}", f"choose from: {', '.join(ENGINES)}")
    if options.optimizer not in ort_training.OPTIMIZERS:
        raise UsageError(
            f"unknown optimizer {options.optimizer!r}", f"choose one of: {', '.join(ort_training.OPTIMIZERS)}"
        )
    target = Path(out)
    if target.exists() and not target.is_dir():
        raise UsageError(f"output {target} exists and is not a folder", "choose another --out")
    if target.is_dir() and any(target.iterdir()) and not options.force:
        raise UsageError(f"output folder {target} is not empty", "choose an empty --out or add --force")


def _write_bundle(
    model: BlockModel, kp: int, folder: Path, options: ExportOptions, progress: Callable[[str], None]
) -> Manifest:
    spec = model.spec
    params, buffers = model.state_tensors()
    tensors = split_roles(params, buffers, len(model.block_modules), kp)
    mean, std = spec.normalization
    manifest = Manifest(
        model=spec.to_dict(),
        input=InputSpec(shape=spec.input_shape, mean=mean, std=std),
        num_classes=spec.num_classes,
        kp=kp,
        blocks=tuple(model.block_names()),
        tensors=tensors,
        edgepfl_version=edgepfl.__version__,
    )
    engines: dict = {}
    progress("inference model")
    _export_inference(model, folder / "model.onnx")
    if "ort-training" in options.engines:
        progress("ort-training artifacts")
        engines["ort-training"] = _export_ort_training(model, manifest, folder / "ort-training", options)
    if "portable" in options.engines:
        progress("portable step graphs")
        from edgepfl.export import portable

        engines["portable"] = portable.export_portable(
            model, manifest, folder / "portable", options.portable_batch, distill=options.distill
        )
    files = {
        str(path.relative_to(folder)).replace("\\", "/"): sha256_file(path)
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }
    final = Manifest(**{**manifest.__dict__, "engines": engines, "files": files})
    final.check()
    final.save(folder)
    return final


def _export_inference(model: BlockModel, path: Path) -> None:
    model.eval()
    torch.onnx.export(
        model,
        (torch.zeros(1, *model.spec.input_shape),),
        str(path),
        input_names=["input"],
        output_names=["logits"],
        dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
        opset_version=INFERENCE_OPSET,
        dynamo=False,
    )


def _export_ort_training(model: BlockModel, manifest: Manifest, folder: Path, options: ExportOptions) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    proto = ort_training.export_training_onnx(model, folder / "forward_training.onnx")
    stats = ort_training.bn_stat_outputs(proto)
    trainable_sets = manifest.trainable_sets()
    sets = {}
    for set_name, trainable in trainable_sets.items():
        ort_training.build_training_set(proto, folder / set_name, trainable, options.optimizer, stats)
        sets[set_name] = {
            "training_model": f"ort-training/{set_name}/training_model.onnx",
            "eval_model": f"ort-training/{set_name}/eval_model.onnx",
            "optimizer_model": f"ort-training/{set_name}/optimizer_model.onnx",
            "checkpoint": f"ort-training/{set_name}/checkpoint",
        }
    (folder / "forward_training.onnx").unlink()
    distill = (
        ort_training.build_distill_sets(model, trainable_sets, folder, options.optimizer) if options.distill else {}
    )
    return {
        "optimizer": options.optimizer,
        "loss": "cross_entropy",
        "sets": sets,
        "bn_stats": stats,
        "distill": distill,
        "bn_momentum": 0.1,
        "input_name": "input",
    }


def summarize(manifest: Manifest) -> dict:
    """Numbers per role for the export table and bench/export.py."""
    rows = {}
    for role in ("base", "personal", "buffer"):
        specs = manifest.by_role(role)
        rows[role] = {
            "tensors": len(specs),
            "parameters": sum(s.nbytes // 4 if s.dtype == "float32" else 0 for s in specs),
            "bytes": sum(s.nbytes for s in specs),
            "blocks": sorted({s.block for s in specs}),
        }
    return rows


def print_summary(manifest: Manifest, out: Path, console=None) -> None:
    """The rich table printed after an export: blocks, parameters and bytes per role, upload size."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    rows = summarize(manifest)
    first_personal = manifest.personal_block_start
    table = Table(title=f"{manifest.model['name']} split at kp={manifest.kp} -> {out}")
    for column in ("role", "blocks", "tensors", "parameters", "bytes"):
        table.add_column(column, justify="left" if column in ("role", "blocks") else "right")
    for role, row in rows.items():
        blocks = _block_range(manifest.blocks, row["blocks"])
        table.add_row(role, blocks, str(row["tensors"]), f"{row['parameters']:,}", _human(row["bytes"]))
    console.print(table)
    console.print(
        f"blocks: {len(manifest.blocks)} ({', '.join(manifest.blocks[:first_personal][-2:])} | "
        f"personal: {', '.join(manifest.blocks[first_personal:]) or 'none'})"
    )
    full = rows["base"]["bytes"] + rows["personal"]["bytes"]
    console.print(
        f"one round uploads {_human(rows['base']['bytes'])} of base tensors "
        f"(FedAvg would send {_human(full)}); base_layout_hash {manifest.base_layout_hash[:16]}…"
    )
    console.print(f"engines: {', '.join(manifest.engines) or 'none'}; files: {len(manifest.files)}")


def _block_range(names: Sequence[str], indices: list[int]) -> str:
    if not indices:
        return "-"
    if len(indices) == 1:
        return names[indices[0]]
    return f"{names[indices[0]]}..{names[indices[-1]]}"


def _human(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return str(count)
