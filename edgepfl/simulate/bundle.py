"""A simulated run's bundle: exported once in a child process, its initial tensors, and the engine that trains on it.

The bundle lives in the run folder (`OUT/bundle`) and is reused on resume. `edgepfl simulate`, Flower's
ServerApp and the demo read its initial tensors through `initial_tensors`.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

import edgepfl
from edgepfl import errors
from edgepfl.datasets import NATURAL_DATASETS
from edgepfl.device_runtime.engine import Engine
from edgepfl.errors import EdgePFLError, StateError, UsageError
from edgepfl.export.sequence_options import MODEL_KINDS, SENSOR_MODELS, TEXT_MODELS, kind_read_by
from edgepfl.kinds import KINDS, ImageKind, InputSpec, parse_kind
from edgepfl.manifest import Manifest, load_manifest
from edgepfl.personal import as_spec, personal_choice
from edgepfl.simulate.config import SimulateConfig
from edgepfl.text import Vocabulary
from edgepfl.wire import save_tensors


def ensure_bundle(
    config: SimulateConfig,
    folder: Path,
    sample_shape: tuple[int, ...],
    num_classes: int,
    facts: dict[str, Any] | None = None,
) -> Manifest:
    """Export the run's bundle once (reused on resume); its input and classes follow the dataset, and a text or
    sensor dataset's `facts` (`dataset_facts`: its sample entry, vocabulary, sensor mean/std, class names) go into it.

    The export runs in a child Python: tracing the model and the ONNX libraries take ~300 MB that would
    otherwise stay resident in the driver for the whole run (bench/simulate.py, MNIST mlp). Its one-line
    errors come back as they were raised.
    """
    facts = facts or {}
    check_model_kind(config.model, str((facts.get("sample") or {}).get("kind") or ImageKind.name))
    job = {
        "config": config.model_dump(mode="json"),
        "folder": str(folder),
        "sample_shape": list(sample_shape),
        "num_classes": num_classes,
        "facts": facts,
    }
    # the child imports the edgepfl this process runs, not one in its working folder (`python -c` puts the
    # folder first on sys.path: from a source checkout, that is a tree without the installed package layout)
    home = str(Path(edgepfl.__file__).resolve().parent.parent)
    code = f"import sys; sys.path.insert(0, {home!r}); from edgepfl.simulate.bundle import export_job; export_job()"
    child = subprocess.run([sys.executable, "-c", code], input=json.dumps(job), capture_output=True, text=True)
    if child.returncode != 0:
        lines = child.stdout.strip().splitlines()
        try:
            refusal = json.loads(lines[-1]) if lines else {}
        except ValueError:
            refusal = {}
        if "problem" in refusal:
            kind = getattr(errors, refusal.get("error", ""), None)
            if not (isinstance(kind, type) and issubclass(kind, EdgePFLError)):
                kind = EdgePFLError
            raise kind(refusal["problem"], refusal.get("fix", ""))
        detail = (child.stderr.strip().splitlines() or ["no output"])[-1]
        raise EdgePFLError(f"exporting the model failed: {detail}", "report it to the edgepfl developers")
    return load_manifest(folder)


def dataset_facts(dataset: Any) -> dict[str, Any]:
    """What the bundle must carry of a dataset with its own clients (edgepfl.datasets.natural.NaturalDataset), as
    JSON: its kind's sample entry and input normalisation, a text dataset's vocabulary, its class names; {} for an
    image dataset (its input and classes come from its sample shape)."""
    kind = getattr(dataset, "kind", None)
    if kind is None:
        return {}
    vocabulary = dataset.vocabulary
    return {
        "sample": kind.entry(),
        "vocabulary": vocabulary.to_json().decode() if vocabulary is not None else None,
        "mean": list(kind.input.mean),
        "std": list(kind.input.std),
        "class_names": list(dataset.class_names),
    }


def check_model_kind(model: str, kind: str) -> None:
    """Refuse, in one line, a model that cannot read the dataset's samples (`kind`: their kind's name)."""
    reads = kind_read_by(model)
    if reads.name == kind:
        return
    readers = [name for name, read in MODEL_KINDS.items() if read.name == kind]
    what = KINDS[kind].described
    if readers:
        raise UsageError(
            f"--model {model} cannot read this dataset's {what}", f"use --model {' or --model '.join(readers)}"
        )
    raise UsageError(
        f"--model {model} reads {reads.described}, not this dataset's {what}",
        f"use an image model (mobilenet, cnn, mlp, resnet34), or --dataset {', '.join(NATURAL_DATASETS)}",
    )


def export_job() -> None:
    """The child side of ensure_bundle: the job as JSON on stdin; an EdgePFLError as one JSON line, exit 2."""
    job = json.loads(sys.stdin.read())
    folder = Path(job["folder"])
    try:
        config = SimulateConfig.model_validate(job["config"])
        _export_run_bundle(config, folder, tuple(job["sample_shape"]), job["num_classes"], job.get("facts") or {})
        if not (folder / "portable").is_dir() and not initial_file(folder).is_file():  # kept from an earlier run
            from edgepfl.device_runtime.engine import open_engine

            save_tensors(initial_file(folder), open_engine(folder, "ort-training").get_tensors())
    except EdgePFLError as error:
        print(json.dumps({"error": type(error).__name__, "problem": error.problem, "fix": error.fix}))
        sys.exit(2)


def _run_target(config: SimulateConfig, sample_shape: tuple[int, ...], num_classes: int, facts: dict[str, Any]):
    """The run's model (an ExportTarget): a text or sensor model made for the dataset's facts, else the image one."""
    if config.model in TEXT_MODELS:
        from edgepfl.export.textmodels import text_target

        vocabulary = Vocabulary.from_json(str(facts["vocabulary"]).encode())
        return text_target(config.model, vocabulary, config.seed, config.width, seq_len=int(sample_shape[0]))
    if config.model in SENSOR_MODELS:
        from edgepfl.export.textmodels import sensor_target

        kind = parse_kind(
            facts["sample"],
            InputSpec(tuple(sample_shape), mean=tuple(facts["mean"]), std=tuple(facts["std"])),
            num_classes,
        )
        target = sensor_target(
            config.model, kind.channels, config.seed, config.width, kind.window, kind.rate_hz, num_classes, config.norm
        )
        if facts.get("mean"):  # the training part's per-channel statistics, as the devices normalise with them
            target = dataclasses.replace(target, normalization=(tuple(facts["mean"]), tuple(facts["std"])))
        return target
    from edgepfl.export.bundle import simulation_target

    return simulation_target(config.model, sample_shape, num_classes, config.seed, config.width, config.norm)


def _export_run_bundle(
    config: SimulateConfig, folder: Path, sample_shape: tuple[int, ...], num_classes: int, facts: dict[str, Any]
) -> Manifest:
    target = _run_target(config, sample_shape, num_classes, facts)
    if config.plan.persfl and target.kind is not None:
        from edgepfl.device_runtime.persfl import check_distillable

        check_distillable(target.kind)
    given = personal_choice(config.kp, config.personal)
    kp = {"zero": 0, "all": len(target.blocks), "given": given}[config.plan.kp]
    if (folder / "manifest.json").is_file():
        manifest = load_manifest(folder)
        from edgepfl.export.bundle import sample_kind

        same_task = manifest.kind == sample_kind(target)  # a text run over another vocabulary needs another bundle
        if manifest.model == target.description and manifest.personal_spec == as_spec(kp)[0] and same_task:
            return manifest
        raise StateError(f"{folder} holds a different model, personal part or vocabulary", "use a new --out")
    from edgepfl.device_runtime.engine import training_build_installed
    from edgepfl.export.bundle import ExportOptions, export_target

    if config.engine == "portable" or not training_build_installed():
        engines: tuple[str, ...] = ("portable",)
    else:
        engines = ("ort-training",)  # fast to export; the torch engine takes its initial tensors from it
    batch, distill = config.round.batch_size, config.plan.persfl
    options = ExportOptions(
        engines=engines,
        seed=config.seed,
        force=True,
        portable_batch=batch,
        distill=distill,
        class_names=tuple(facts.get("class_names") or ()),
    )
    return export_target(target, kp, folder, options)


def open_sim_engine(
    name: str, bundle: Path, manifest: Manifest, threads: int | None = None, device: str = "cpu"
) -> Engine:
    """torch (eager, reads the bundle's initial tensors; on `device`), portable or ort-training (the device engines)."""
    from edgepfl.device_runtime.engine import open_engine

    if name != "torch":
        return open_engine(bundle, name, threads=threads)
    from edgepfl.simulate.torch_engine import TorchEngine

    return TorchEngine(bundle, manifest, initial_tensors(bundle), threads=threads, device=device)


def initial_tensors(bundle: Path) -> dict[str, np.ndarray]:
    """The bundle's initial tensors: portable/initial.safetensors, else the ORT training checkpoint's (read by the
    export job into `initial_file`, so that the driver opens no ORT session for them)."""
    from edgepfl.wire import load_tensors

    for path in (Path(bundle) / "portable" / "initial.safetensors", initial_file(bundle)):
        if path.is_file():
            return load_tensors(path)
    from edgepfl.device_runtime.engine import open_engine

    return open_engine(bundle, "ort-training").get_tensors()


def initial_file(bundle: Path) -> Path:
    """Where the export job keeps a bundle's initial tensors when it has no portable engine."""
    return Path(bundle).parent / f"{Path(bundle).name}-initial.safetensors"
