"""Images per second of one training step: torch eager vs ort-training vs portable (plain onnxruntime graphs).

The zoo MobileNet-v1 x0.25 and x1.0 at 32x32x3, and torchvision's mobilenet_v3_small, mobilenet_v2 and
resnet18 (10-class head) at 32x32 and 96x96; batch 32, 2 threads; full steps and personal-only steps (K_P=2).
Each engine runs in its own process (ORT's spinning threads and torch's OpenMP threads slow each other
when they share one); the median of the timed steps after warm-up is reported.
Prints JSON on stdout and a table on stderr, and writes bench/out/engines.png.
The JSON names the host (CPU model, vector extensions, library versions): torch's convolution backward
runs several times slower on an AVX2-only host than on an AVX-512 one, so ratios to torch compare only within
one host.
Usage: python bench/engines.py [--steps 15] [--warmup 3] [--rounds 1] [--models LIST] [--bundles DIR] [--engines LIST]
  --models: comma list of mobilenet-xW (zoo) and torchvision:NAME@SIZE, e.g. mobilenet-x0.25,torchvision:resnet18@32
  --engines: comma list of torch, ort-training, portable (default all), e.g. portable alone to time another
    version's bundles (an A/B of the exporter: its graphs in --bundles, today's runtime)
  --ab DIR: bundles another edgepfl version exported (its own `bench/engines.py --bundles DIR`); their portable
    graphs are timed as engine `portable-ab`, in the same rounds as the others: an A/B of two exporters that
    host noise between runs does not bias (with --rounds 5 or more; the rows give the quartiles)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "out"
ENGINES = ("torch", "ort-training", "portable")
AB = "portable-ab"  # --ab: another exporter version's portable graphs
SETS = ("full", "personal")
BATCH = 32
THREADS = 2
KP = 2
CLASSES = 10


MODELS = "mobilenet-x0.25,mobilenet-x1.0," + ",".join(
    f"torchvision:{name}@{size}" for size in (32, 96) for name in ("mobilenet_v3_small", "mobilenet_v2", "resnet18")
)


def export_bundles(models: list[str], folder: Path) -> dict[str, Path]:
    """One bundle per model with both engines' artifacts (reused when `folder` already has it)."""
    from edgepfl.export import source
    from edgepfl.export.bundle import ExportOptions, export_bundle
    from edgepfl.export.models import ModelSpec

    options = ExportOptions(engines=("ort-training", "portable"), portable_batch=BATCH, force=True)
    bundles = {}
    for label in models:
        target = folder / bundle_name(label)
        if not (target / "manifest.json").is_file():
            print(f"exporting {label} ...", file=sys.stderr)
            if label.startswith("mobilenet-x"):
                export_bundle(
                    ModelSpec(name="mobilenet", width=float(label[len("mobilenet-x") :])), KP, target, options
                )
            else:
                name, _, size = label.partition("@")
                shape = (3, int(size or 32), int(size or 32))
                loaded = source.build_from_string(source.parse_model(name), shape, None, CLASSES)
                export_bundle(loaded.module, KP, target, options, input_shape=shape, description=loaded.description)
        bundles[label] = target
    return bundles


def time_steps(
    engine: str, bundle: Path, trainable: str, steps: int, warmup: int, threads: int = THREADS
) -> list[float]:
    """Seconds per training step of one engine on `threads` threads (runs in the worker process)."""
    from edgepfl.manifest import load_manifest

    manifest = load_manifest(bundle)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, *manifest.input.shape)).astype(np.float32)
    y = rng.integers(0, manifest.num_classes, BATCH).astype(np.int64)
    if engine == "torch":
        step = _torch_step(bundle, manifest, trainable, x, y, threads)
    else:
        step = _onnx_step(engine, bundle, x, y, threads)
    seconds = []
    for index in range(warmup + steps):
        start = time.perf_counter()
        step(trainable)
        if index >= warmup:
            seconds.append(time.perf_counter() - start)
    return seconds


def _onnx_step(engine: str, bundle: Path, x: np.ndarray, y: np.ndarray, threads: int):
    from edgepfl.device_runtime.engine import open_engine

    runtime = open_engine(bundle, engine, threads=threads)
    return lambda trainable: runtime.train_step(x, y, lr=0.01, trainable=trainable)


def bundle_name(label: str) -> str:
    """The folder of a model's bundle under --bundles (and --ab)."""
    return label.replace(":", "-").replace("@", "-")


def _torch_step(bundle: Path, manifest, trainable: str, x: np.ndarray, y: np.ndarray, threads: int):
    import torch

    from edgepfl.export.source import rebuild_module
    from edgepfl.wire import load_tensors

    torch.set_num_threads(threads)
    model = rebuild_module(manifest.model).train()
    initial = load_tensors(bundle / manifest.engines["portable"]["initial"])
    model.load_state_dict({n: torch.from_numpy(v) for n, v in initial.items()}, strict=False)
    personal = set(manifest.names("personal"))
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(trainable == "full" or name in personal)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    inputs, labels = torch.from_numpy(x), torch.from_numpy(y)

    def step(_: str) -> None:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()

    return step


def run_worker(
    engine: str, bundle: Path, trainable: str, steps: int, warmup: int, threads: int = THREADS
) -> list[float] | str:
    """Time one engine in a fresh process: its step times, or the worker's last error line."""
    command = [sys.executable, __file__, "--worker", engine, str(bundle), trainable, str(steps), str(warmup)]
    command += ["--worker-threads", str(threads)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        return (result.stderr.strip().splitlines() or ["failed"])[-1]
    return json.loads(result.stdout.strip().splitlines()[-1])


def host() -> dict:
    """The machine the numbers belong to: CPU model, widest vector extension, cores and library versions."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    cpu, flags, generation = platform.processor() or platform.machine(), set(), {}
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                cpu = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
            elif key.strip() in ("cpu family", "model"):  # "AMD EPYC" alone does not say which generation
                generation.setdefault(key.strip(), value.strip())
    libraries = {}
    for package in ("torch", "onnxruntime", "onnxruntime-training-cpu"):
        try:
            libraries[package] = version(package)
        except PackageNotFoundError:
            continue
    return {
        "cpu": cpu,
        **({"cpu_family_model": f"{generation['cpu family']}/{generation['model']}"} if len(generation) == 2 else {}),
        "vector": "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else platform.machine(),
        "cores": os.cpu_count(),
        **libraries,
    }


def summarize(seconds: list[float], rounds: int) -> dict:
    """The row's numbers: median over every timed step of every round, and the quartiles (a slow step is a
    low images/s, so the 75th percentile of the step time gives the lower quartile of images/s)."""
    median = statistics.median(seconds)
    low, _, high = statistics.quantiles(seconds, n=4) if len(seconds) > 1 else (median, median, median)
    return {
        "median_step_s": round(median, 5),
        "images_per_s": round(BATCH / median, 1),
        "images_per_s_quartiles": [round(BATCH / high, 1), round(BATCH / low, 1)],
        "steps": len(seconds),
        "rounds": rounds,
    }


def plot(rows: list[dict], path: Path) -> None:
    """A grouped bar chart: images/s per engine for each model and trainable set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["model"], r["trainable"]) for r in rows})
    fig, ax = plt.subplots(figsize=(max(8, len(groups) * 0.9), 4))
    engines = [e for e in (*ENGINES, AB) if any(r["engine"] == e for r in rows)]
    bar = 0.8 / len(engines)
    for offset, engine in enumerate(engines):
        found = [
            next((r for r in rows if (r["model"], r["trainable"], r["engine"]) == (*g, engine)), {}) for g in groups
        ]
        values = [r.get("images_per_s", 0) for r in found]
        quartiles = [r.get("images_per_s_quartiles", [v, v]) for r, v in zip(found, values)]
        spread = [[v - q[0] for v, q in zip(values, quartiles)], [q[1] - v for v, q in zip(values, quartiles)]]
        ax.bar([i + offset * bar for i in range(len(groups))], values, bar, yerr=spread, capsize=2, label=engine)
    middle = (len(engines) - 1) * bar / 2
    names = [f"{m.removeprefix('torchvision:')}\n{t}" for m, t in groups]
    ax.set_xticks([i + middle for i in range(len(groups))], names, fontsize=6)
    ax.set_ylabel("images / s (batch 32, 2 threads)")
    ax.set_title("training step, batch 32")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1, help="fresh processes per engine, interleaved (noisy hosts)")
    parser.add_argument("--models", default=MODELS)
    parser.add_argument("--bundles", type=Path, help="folder to keep the exported bundles in (reused)")
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma list of the engines to time")
    parser.add_argument("--ab", type=Path, help="another version's bundles: their portable graphs as `portable-ab`")
    parser.add_argument(
        "--worker", nargs=5, metavar=("ENGINE", "BUNDLE", "SET", "STEPS", "WARMUP"), help=argparse.SUPPRESS
    )
    parser.add_argument("--worker-threads", type=int, default=THREADS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        engine, bundle, trainable, steps, warmup = args.worker
        print(json.dumps(time_steps(engine, Path(bundle), trainable, int(steps), int(warmup), args.worker_threads)))
        return
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if unknown := sorted(set(engines) - set(ENGINES)):
        parser.error(f"--engines {','.join(unknown)}: not an engine (choose from {', '.join(ENGINES)})")
    with tempfile.TemporaryDirectory() as scratch:
        bundles = export_bundles(models, args.bundles or Path(scratch))
        if args.ab is not None:
            missing = [m for m in models if not (args.ab / bundle_name(m) / "manifest.json").is_file()]
            if missing:
                parser.error(f"--ab {args.ab} has no bundle of {', '.join(missing)}: export them with that version")
            engines.append(AB)
        cases = [(m, t, e) for m in models for t in SETS for e in engines]
        times: dict[tuple, list[float]] = {case: [] for case in cases}
        errors: dict[tuple, str] = {}
        # rounds interleave the engines, so that load from other processes falls on all of them alike
        for _ in range(args.rounds):
            for model, trainable, engine in cases:
                if engine == AB:
                    seconds = run_worker("portable", args.ab / bundle_name(model), trainable, args.steps, args.warmup)
                else:
                    seconds = run_worker(engine, bundles[model], trainable, args.steps, args.warmup)
                if isinstance(seconds, str):
                    errors[(model, trainable, engine)] = seconds
                else:
                    times[(model, trainable, engine)] += seconds
                print(f"{model} {trainable} {engine}: {seconds if isinstance(seconds, str) else 'ok'}", file=sys.stderr)
        rows = []
        for model, trainable, engine in cases:
            row = {"model": model, "trainable": trainable, "engine": engine}
            if times[(model, trainable, engine)]:
                row.update(summarize(times[(model, trainable, engine)], args.rounds))
            else:
                row["error"] = errors.get((model, trainable, engine), "no steps timed")
            rows.append(row)
    ratios, versus_ab = {}, {}
    for model in models:
        for trainable in SETS:
            speed = {
                r["engine"]: r.get("images_per_s") for r in rows if (r["model"], r["trainable"]) == (model, trainable)
            }
            if speed.get("torch") and speed.get("portable"):
                ratios[f"{model} {trainable}"] = round(speed["portable"] / speed["torch"], 2)
            if speed.get(AB) and speed.get("portable"):
                versus_ab[f"{model} {trainable}"] = round(speed["portable"] / speed[AB], 2)
    plot(rows, OUT / "engines.png")
    result = {
        "host": host(),
        "batch": BATCH,
        "threads": THREADS,
        "kp": KP,
        "rows": rows,
        "portable_vs_torch": ratios,
        **({"ab_bundles": str(args.ab), "portable_vs_ab": versus_ab} if args.ab is not None else {}),
        "targets": {"full": 0.8, "personal": 1.0, "mobilenet-x1.0 full": 1.0},
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
