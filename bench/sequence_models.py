"""The next-word transformer's training step on the portable engine against torch eager, and every zoo model's peak
memory while a device trains it.

Speed: FedAlt's StackOverflow transformer (4 layers, d 256, 4 heads, feed-forward 1024, sequence 20, a vocabulary
of 10,000 words + 4 specials from a synthetic corpus), batch 32, both at 2 threads: the full step (every tensor
trains) and the personal step of `--kp 1` (the output layer trains, the base is frozen; the `--personal adapters`
step is another engineer's and is not measured here). samples/s is the median of the timed steps; the ratio is
portable ÷ torch eager (targets: >= 1.0 full, >= 1.5 for the personal-only step).

Memory: one local epoch of `device train`'s loop (open the bundle with the portable engine, train full steps of
batch 32 over 256 seeded samples) in a fresh process with torch blocked, as on a device; the peak RSS is that
process's VmHWM. Every zoo model: MobileNet x0.25 and x1.0, cnn, mlp, resnet34, transformer, lstm, har-cnn
(default sizes; bundles exported with the portable engine and no frozen variants, kp 0 but for the transformer's
kp 1).

Prints JSON on stdout and writes bench/figures/sequence_models.png.
Usage: python bench/sequence_models.py [--quick] [--out FILE.json]  (--quick: 3 warm-up and 10 timed steps, no
resnet34 in the memory table)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

FIGURES = Path(__file__).resolve().parent / "figures"
BATCH, THREADS, SAMPLES = 32, 2, 256
VOCAB_WORDS = 10_000

MEASURE = """
import json, sys
sys.modules['torch'] = None
import numpy as np
from edgepfl.device_runtime.engine import open_engine
bundle, samples, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
engine = open_engine(bundle, 'portable', threads=2)
manifest = engine.manifest
rng = np.random.default_rng(0)
shape = (samples, *manifest.input.shape)
if manifest.input.dtype == 'int64':
    x = rng.integers(0, manifest.num_classes, shape)
else:
    x = rng.normal(size=shape).astype(np.float32)
y = rng.integers(0, manifest.num_classes, samples)
for start in range(0, samples, batch):
    engine.train_step(x[start:start + batch], y[start:start + batch], 0.01, 'full')
status = open('/proc/self/status').read().split('VmHWM:')[1]
print(json.dumps({'peak_rss_mib': round(float(status.split()[0]) / 1024, 1)}))
"""


def corpus(folder: Path) -> Path:
    """A synthetic corpus with VOCAB_WORDS distinct words, so the vocabulary is the default's size."""
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(VOCAB_WORDS)]
    lines = [" ".join(words[i : i + 20]) for i in range(0, VOCAB_WORDS, 20)]
    lines += [" ".join(rng.choice(words, 20)) for _ in range(200)]
    path = folder / "corpus.txt"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def export(name: str, folder: Path, text_corpus: Path, kp: int, **knobs) -> Path:
    """A zoo model's bundle (portable engine, no frozen variants)."""
    from edgepfl.export.bundle import ExportOptions, export_target, zoo_target
    from edgepfl.export.models import ModelSpec, default_spec
    from edgepfl.export.sequence_options import SEQUENCE_MODELS, TEXT_MODELS, SequenceOptions
    from edgepfl.export.textmodels import sequence_target

    options = ExportOptions(engines=("portable",), force=True, frozen_variants=False)
    if name in SEQUENCE_MODELS:
        sequence = SequenceOptions(vocab=text_corpus) if name in TEXT_MODELS else SequenceOptions()
        target = sequence_target(name, sequence, 0)
    else:
        target = zoo_target(ModelSpec(**{**default_spec(name).to_dict(), **knobs}), 0)
    label = name + "".join(f"-{k}{v}" for k, v in knobs.items())
    out = folder / label
    export_target(target, kp, out, options, notice=lambda _: None)
    return out


def step_speed(bundle: Path, warmup: int, steps: int) -> dict:
    """samples/s (median step) of the full and the personal step, portable and torch eager, at THREADS threads."""
    from edgepfl.device_runtime.engine import open_engine
    from edgepfl.simulate.torch_engine import TorchEngine

    portable = open_engine(bundle, "portable", threads=THREADS)
    manifest = portable.manifest
    torch_engine = TorchEngine(bundle, manifest, portable.get_tensors(), threads=THREADS)
    rng = np.random.default_rng(0)
    x = rng.integers(0, manifest.num_classes, (BATCH, *manifest.input.shape))
    y = rng.integers(0, manifest.num_classes, BATCH)
    result: dict = {}
    for trainable in ("full", "personal"):
        row = {}
        for engine in (portable, torch_engine):
            for _ in range(warmup):
                engine.train_step(x, y, 0.0, trainable)
            times = []
            for _ in range(steps):
                tick = time.perf_counter()
                engine.train_step(x, y, 0.0, trainable)
                times.append(time.perf_counter() - tick)
            row[engine.name] = round(BATCH / statistics.median(times), 1)
        row["portable_over_torch"] = round(row["portable"] / row["torch"], 2)
        result[trainable] = row
    return result


def peak_rss(bundle: Path) -> float:
    """Peak RSS (MiB) of a device's training loop on the bundle, in a fresh process without torch."""
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(bundle), str(SAMPLES), str(BATCH)], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"measuring {bundle.name} failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_rss_mib"]


def plot(result: dict) -> Path:
    """Step speeds and peak memory side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps = result["transformer_step"]
    labels = list(steps)
    for offset, engine in ((-0.2, "portable"), (0.2, "torch")):
        left.bar([i + offset for i in range(len(labels))], [steps[s][engine] for s in labels], 0.4, label=engine)
    left.set_xticks(range(len(labels)), [f"{s} step" for s in labels])
    left.set_ylabel(f"samples/s (batch {BATCH}, {THREADS} threads)")
    left.set_title("FedAlt transformer: portable vs torch eager")
    left.legend()
    memory = result["device_train_peak_rss_mib"]
    right.barh(list(memory), list(memory.values()), color="tab:orange")
    right.set_xlabel("peak RSS of a device's training loop (MiB)")
    fig.tight_layout()
    FIGURES.mkdir(exist_ok=True)
    path = FIGURES / "sequence_models.png"
    fig.savefig(path, dpi=120)
    return path


def main() -> None:
    """Run the benchmark and print its JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, no resnet34")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(THREADS)
    warmup, steps = (3, 10) if args.quick else (5, 30)
    models = [("transformer", {}), ("har-cnn", {}), ("mobilenet", {"width": 0.25}), ("mlp", {}), ("cnn", {})]
    models += [("lstm", {}), ("mobilenet", {"width": 1.0})] + ([] if args.quick else [("resnet34", {})])
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        text_corpus = corpus(folder)
        bundles = {}
        for name, knobs in models:
            started = time.perf_counter()
            kp = 1 if name == "transformer" else 0  # kp 0: the full step alone, which the memory run trains
            bundles[name + "".join(f" x{v}" for v in knobs.values())] = export(name, folder, text_corpus, kp, **knobs)
            print(f"exported {name} {knobs} in {time.perf_counter() - started:.0f} s", file=sys.stderr)
            if name == "transformer":  # measured first: the step speeds are the benchmark's main result
                speed = step_speed(bundles["transformer"], warmup, steps)
                print(json.dumps({"transformer_step": speed}), file=sys.stderr)
        result = {
            "transformer": "FedAlt StackOverflow: 4 layers, d 256, 4 heads, ff 1024, seq 20, vocab 10004",
            "batch": BATCH,
            "threads": THREADS,
            "timed_steps": steps,
            "personal_step": "kp 1: the output layer (final norm + vocabulary projection) trains, the base is frozen",
            "transformer_step": speed,
            "device_train_peak_rss_mib": {label: peak_rss(bundle) for label, bundle in bundles.items()},
            "memory_run": f"portable engine, full steps of batch {BATCH} over {SAMPLES} samples, torch blocked",
        }
    result["figure"] = str(plot(result).relative_to(FIGURES.parent.parent))
    document = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(document + "\n")
    print(document)


if __name__ == "__main__":
    main()
