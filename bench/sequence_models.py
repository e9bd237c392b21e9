"""The next-word transformer's training steps on the portable engine against torch eager, what its personal parts
cost on the network, and every zoo model's peak memory while `edgepfl device train` trains it.

Tokens (issue 53): a next-word sample is a line's `seq_len` tokens with the next token at every position, so a step
of BATCH samples trains BATCH x seq_len targets; before issue 53 a sample was the `seq_len` tokens before ONE word,
and a step trained BATCH targets. tokens/s counts the targets a step trains per second, per engine (portable,
ort-training where installed, torch eager). "before" is measured on torch eager only, with the same weights: the
model's trunk and its output layer at the last position, the loss on one target a sample (the old forward); an
epoch over the same text costs seq_len times fewer samples now, and `epoch_speedup` is after ÷ before in tokens/s.

Speed: FedAlt's StackOverflow transformer (4 layers, d 256, 4 heads, feed-forward 1024, sequence 20, a vocabulary
of 10,000 words + 4 specials from a synthetic corpus), batch 32, both at 2 threads: the full step (every tensor
trains), the personal-only step of `--personal output:1` (the output layer trains, the base is frozen) and of
`--personal adapters:16` (the adapters and the norms train, the original network is frozen). samples/s is the
median of the timed steps, the engines timed in turns of two steps each (a drifting host slows them alike); the
ratio is portable ÷ torch eager (issue 38's targets: >= 1.0 full, >= 1.5 for the
adapters-only step, whose portable samples/s should be >= 3x the full step's).

Network: for `output:1` and `adapters:16`, the bytes of one round's upload (the base tensors, fp32, as the wire
encodes them; a round's download of the base is the same tensors) and of the first download (the bundle's files
for the portable engine, which the device fetches once, plus that first base).

Memory: the real `edgepfl device train --engine portable --epochs 1 --batch-size 32` command, a subprocess, on
tiny generated data of the bundle's kind (256 images, a text of about 256 words, or 256 sensor windows); its peak
RSS is the command's ru_maxrss (RUSAGE_CHILDREN of a small launcher). Every zoo model: MobileNet x0.25 and x1.0,
cnn, mlp, resnet34, transformer, lstm, har-cnn (default sizes; bundles exported with the portable engine, kp 0
and no frozen variants, but for the transformer: the speed bundle of output:1).

The speed bundles have frozen variants: from its third step on the same base a device runs a personal step's
variant with the frozen tensors baked in (export/frozen.py), which is `portable` in the personal rows;
`portable_plain` is the same step's plain graph.

Prints JSON on stdout and writes bench/figures/sequence_models.png.
Usage: python bench/sequence_models.py [--quick] [--out FILE.json]  (--quick: 2 warm-up and 6 timed steps, no
resnet34 in the memory table)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engines import host  # noqa: E402

FIGURES = Path(__file__).resolve().parent / "figures"
BATCH, THREADS, SAMPLES = 32, 2, 256
ROUND_STEPS = 2  # timed steps of one engine before the next engine's turn
VOCAB_WORDS = 10_000
OUTPUT, ADAPTERS = "output:1", "adapters:16"  # the personal parts compared
# a small launcher runs the command: a child forked from this process (torch loaded) would count this process's
# pages in its ru_maxrss, which exec does not reset; the launcher's are a few MiB
RUSAGE = (
    "import resource, subprocess, sys; code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode; "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)"
)


def corpus(folder: Path) -> Path:
    """A synthetic corpus with VOCAB_WORDS distinct words, so the vocabulary is the default's size."""
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(VOCAB_WORDS)]
    lines = [" ".join(words[i : i + 20]) for i in range(0, VOCAB_WORDS, 20)]
    lines += [" ".join(rng.choice(words, 20)) for _ in range(200)]
    path = folder / "corpus.txt"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def export(
    name: str,
    folder: Path,
    text_corpus: Path,
    kp: int | str,
    engines: tuple[str, ...] = ("portable",),
    frozen_variants: bool = False,
    **knobs,
) -> Path:
    """A zoo model's bundle; `kp`: --kp K or a --personal spec."""
    from edgepfl.export.bundle import ExportOptions, export_target, zoo_target
    from edgepfl.export.models import ModelSpec, default_spec
    from edgepfl.export.sequence_options import SEQUENCE_MODELS, TEXT_MODELS, SequenceOptions
    from edgepfl.export.textmodels import sequence_target

    options = ExportOptions(engines=engines, force=True, frozen_variants=frozen_variants)
    if name in SEQUENCE_MODELS:
        sequence = SequenceOptions(vocab=text_corpus) if name in TEXT_MODELS else SequenceOptions()
        target = sequence_target(name, sequence, 0)
    else:
        target = zoo_target(ModelSpec(**{**default_spec(name).to_dict(), **knobs}), 0)
    label = name + "".join(f"-{k}{v}" for k, v in knobs.items()) + f"-{kp}".replace(":", "")
    out = folder / label
    export_target(target, kp, out, options, notice=lambda _: None)
    return out


def step_speed(bundles: dict[str, Path], warmup: int, steps: int) -> dict:
    """samples/s (median step) of the full step (the first bundle's) and each bundle's personal-only step, portable
    and torch eager, at THREADS threads; `bundles`: {personal spec: bundle}."""
    result: dict = {}
    for number, (personal, bundle) in enumerate(bundles.items()):
        for trainable in ("full", "personal") if number == 0 else ("personal",):
            label = "full" if trainable == "full" else f"personal {personal}"
            result[label] = _timed(bundle, trainable, warmup, steps)
            print(json.dumps({label: result[label]}), file=sys.stderr)
    return result


def _timed(bundle: Path, trainable: str, warmup: int, steps: int) -> dict:
    from edgepfl.device_runtime.engine import open_engine, training_build_installed
    from edgepfl.device_runtime.portable_engine import BAKE_AFTER_STEPS, PortableEngine
    from edgepfl.simulate.torch_engine import TorchEngine

    portable = open_engine(bundle, "portable", threads=THREADS)  # a personal step's frozen variant, as devices run
    manifest = portable.manifest
    torch_engine = TorchEngine(bundle, manifest, portable.get_tensors(), threads=THREADS)
    x, y = step_batch(manifest)
    per_sample = int(np.prod(manifest.kind.target_shape))
    engines = {"portable": portable}
    if trainable != "full":  # the plain graph beside it: what the step costs before its variant is built
        engines["portable_plain"] = PortableEngine(bundle, manifest, threads=THREADS, bake_frozen=False)
    if "ort-training" in manifest.engines and training_build_installed():
        engines["ort-training"] = open_engine(bundle, "ort-training", threads=THREADS)
    engines["torch"] = torch_engine
    trains = {label: lambda engine=engine: engine.train_step(x, y, 0.0, trainable) for label, engine in engines.items()}
    if trainable == "full":
        trains["torch_before"] = _last_position_step(torch_engine, x, y)
    # a personal step's variant is built at the step after BAKE_AFTER_STEPS: untimed
    seconds = _median_steps(trains, max(warmup, BAKE_AFTER_STEPS + 1), steps)
    row: dict = {}
    for label in engines:
        row[label] = round(BATCH / seconds[label], 1)
        row[f"{label}_tokens_per_s"] = round(BATCH * per_sample / seconds[label], 1)
    row["portable_over_torch"] = round(row["portable"] / row["torch"], 2)
    if trainable == "full":
        row["torch_before_tokens_per_s"] = round(BATCH / seconds["torch_before"], 1)  # one target a sample
        row["torch_epoch_speedup"] = round(row["torch_tokens_per_s"] / row["torch_before_tokens_per_s"], 2)
    else:
        row["portable_plain_over_torch"] = round(row["portable_plain"] / row["torch"], 2)
    return row


def step_batch(manifest) -> tuple[np.ndarray, np.ndarray]:
    """A seeded batch of BATCH sequences and their targets, no <pad> among them: every target trains."""
    rng = np.random.default_rng(0)
    x = rng.integers(4, manifest.num_classes, (BATCH, *manifest.input.shape))
    return x, rng.integers(4, manifest.num_classes, (BATCH, *manifest.kind.target_shape))


def _median_steps(steps_by_name: dict, warmup: int, steps: int) -> dict[str, float]:
    """The median seconds of `steps` calls of each step after `warmup` untimed ones, the steps taken in turns of
    ROUND_STEPS each, so that a host whose speed drifts (other work, clock changes) slows every engine alike."""
    for step in steps_by_name.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps_by_name}
    while len(next(iter(times.values()))) < steps:
        for name, step in steps_by_name.items():
            for _ in range(ROUND_STEPS):
                tick = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - tick)
    return {name: statistics.median(values) for name, values in times.items()}


def _last_position_step(engine, x: np.ndarray, y: np.ndarray):
    """The step before issue 53 on the torch engine's model: the output layer at the last position only and the
    cross-entropy of one target a sample (the old CausalTransformer.forward), SGD at lr 0 on every tensor."""
    import torch

    model = engine.model
    ids, labels = torch.from_numpy(x), torch.from_numpy(y[:, -1])

    def step() -> None:
        model.train()
        for param in model.parameters():
            param.requires_grad_(True)
            param.grad = None
        h = model.embedding(ids)
        for layer in model.layers:
            h = layer(h)
        torch.nn.functional.cross_entropy(model.output(model.norm(h[:, -1])), labels).backward()
        with torch.no_grad():
            for param in model.parameters():
                param.sub_(0.0 * param.grad)

    return step


def network_bytes(bundles: dict[str, Path]) -> dict:
    """Per personal spec: one round's upload of the base (fp32 wire bytes) and the first download (bundle + base)."""
    from edgepfl.device_runtime.engine import open_engine
    from edgepfl.wire import encode_tensors

    result = {}
    for personal, bundle in bundles.items():
        engine = open_engine(bundle, "portable", threads=1)
        manifest = engine.manifest
        base = engine.get_tensors(manifest.names("base"))
        upload = len(encode_tensors(base))
        # the files a portable device fetches: not the ort-training artifacts the speed bundles also hold
        kept = [path for path in bundle.rglob("*") if path.is_file() and "ort-training" not in path.parts]
        files = sum(path.stat().st_size for path in kept)
        result[personal] = {
            "base_tensors": len(base),
            "personal_tensors": len(manifest.names("personal")),
            "personal_parameters": int(sum(np.prod(t.shape) for t in manifest.by_role("personal"))),
            "upload_bytes_per_round": upload,
            "bundle_bytes": files,
            "first_download_bytes": files + upload,
        }
    return result


def device_train_peak_rss(bundle: Path, scratch: Path) -> float:
    """Peak RSS (MiB) of `edgepfl device train` on tiny data of the bundle's kind: the child's ru_maxrss."""
    data = tiny_data(bundle, scratch)
    state = scratch / f"state-{bundle.name}"
    shutil.rmtree(state, ignore_errors=True)
    command = [str(Path(sys.executable).with_name("edgepfl")), "device", "train", "--bundle", str(bundle)]
    command += ["--data", str(data), "--state", str(state), "--engine", "portable", "--epochs", "1"]
    command += ["--batch-size", str(BATCH), "--threads", str(THREADS), "--json"]
    done = subprocess.run([sys.executable, "-c", RUSAGE, *command], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"device train on {bundle.name} failed: {done.stderr.strip()[-500:]}")
    return round(int(done.stdout.strip().splitlines()[-1]) / 1024, 1)  # Linux: KiB


def tiny_data(bundle: Path, scratch: Path) -> Path:
    """SAMPLES seeded samples of the bundle's kind, in the format `device train --data` reads."""
    from edgepfl import text
    from edgepfl.manifest import load_manifest

    manifest = load_manifest(bundle)
    rng = np.random.default_rng(0)
    labels = rng.integers(0, manifest.num_classes, SAMPLES)
    kind = manifest.kind
    if kind.name == "next-word":
        words = kind.vocabulary(bundle).words[len(text.SPECIALS) :]
        path = scratch / f"{bundle.name}.txt"
        lines = [" ".join(rng.choice(words, 16)) for _ in range(SAMPLES)]  # a sample a line
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return path
    path = scratch / f"{bundle.name}.npz"
    if kind.name == "sensor":
        x = rng.normal(size=(SAMPLES, *manifest.input.shape)).astype(np.float32)
        np.savez(path, x=x, y=labels, channels=np.asarray(kind.channels))
    else:  # images: uint8 NHWC
        side, channels = manifest.model["input_size"], manifest.model["in_channels"]
        np.savez(path, x=rng.integers(0, 256, (SAMPLES, side, side, channels), dtype=np.uint8), y=labels)
    return path


def targets(speed: dict) -> dict:
    """Issue 38's speed targets, each with the measured value and whether it was met."""
    full, adapters = speed["full"], speed[f"personal {ADAPTERS}"]
    measured = {
        "full step portable/torch >= 1.0": (full["portable_over_torch"], 1.0),
        "adapters-only step portable/torch >= 1.5": (adapters["portable_over_torch"], 1.5),
        "adapters-only step >= 3x the full step's samples/s (portable)": (
            round(adapters["portable"] / full["portable"], 2),
            3.0,
        ),
    }
    return {name: {"measured": value, "met": value >= bound} for name, (value, bound) in measured.items()}


def plot(result: dict) -> Path:
    """Step speeds, the network bytes of each personal part, and peak memory side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.5))
    steps = result["transformer_step"]
    labels = list(steps)
    names = ("portable", "portable_plain", "ort-training", "torch")
    names = [name for name in names if any(f"{name}_tokens_per_s" in row for row in steps.values())]
    width = 0.8 / (len(names) + 1)
    bars = [(name, f"{name}_tokens_per_s") for name in names] + [("torch, before", "torch_before_tokens_per_s")]
    for number, (name, key) in enumerate(bars):
        offset = (number - len(names) / 2) * width
        values = [steps[s].get(key, 0) for s in labels]
        left.bar([i + offset for i in range(len(labels))], values, width, label=name)
    left.set_xticks(range(len(labels)), [f"{s} step" for s in labels], fontsize=8)
    left.set_ylabel(f"tokens trained/s (batch {BATCH}, {THREADS} threads)")
    left.set_title("FedAlt transformer: portable vs torch eager")
    left.legend()
    network = result["transformer_network_bytes"]
    specs = list(network)
    for offset, key in ((-0.2, "upload_bytes_per_round"), (0.2, "first_download_bytes")):
        values = [network[spec][key] / 2**20 for spec in specs]
        middle.bar([i + offset for i in range(len(specs))], values, 0.4, label=key.replace("_", " "))
    middle.set_xticks(range(len(specs)), [f"--personal {spec}" for spec in specs])
    middle.set_ylabel("MiB")
    middle.set_title("transformer: what travels")
    middle.legend(fontsize=8)
    memory = result["device_train_peak_rss_mib"]
    right.barh(list(memory), list(memory.values()), color="tab:orange")
    right.set_xlabel("peak RSS of `edgepfl device train` (MiB)")
    fig.tight_layout()
    FIGURES.mkdir(exist_ok=True)
    path = FIGURES / "sequence_models.png"
    fig.savefig(path, dpi=120)
    return path


def main() -> None:
    """Run the benchmark and print its JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, no resnet34")
    parser.add_argument("--text-only", action="store_true", help="the memory table for the transformer only")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(THREADS)
    warmup, steps = (2, 6) if args.quick else (5, 30)
    models = [("har-cnn", {}), ("mobilenet", {"width": 0.25}), ("mlp", {}), ("cnn", {}), ("lstm", {})]
    models += [("mobilenet", {"width": 1.0})] + ([] if args.quick else [("resnet34", {})])
    models = [] if args.text_only else models
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        text_corpus = corpus(folder)
        from edgepfl.ortbuild import training_build_installed

        engines = ("portable", "ort-training") if training_build_installed() else ("portable",)
        personal = {
            spec: export("transformer", folder, text_corpus, spec, engines, frozen_variants=True)
            for spec in (OUTPUT, ADAPTERS)
        }
        speed = step_speed(personal, warmup, steps)  # first: the step speeds are the benchmark's main result
        bundles = {"transformer": personal[OUTPUT]}
        for name, knobs in models:
            started = time.perf_counter()
            # kp 0: the full step alone, which device train runs
            bundles[name + "".join(f" x{v}" for v in knobs.values())] = export(name, folder, text_corpus, 0, **knobs)
            print(f"exported {name} {knobs} in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        result = {
            "transformer": "FedAlt StackOverflow: 4 layers, d 256, 4 heads, ff 1024, seq 20, vocab 10004",
            "host": host(),
            "batch": BATCH,
            "threads": THREADS,
            "timed_steps": steps,
            "personal_steps": {
                OUTPUT: "the output layer (final norm + vocabulary projection) trains, the base is frozen",
                ADAPTERS: "the adapters (bottleneck 16) and the layers' norms train, the original network is frozen",
            },
            "transformer_step": speed,
            "targets": targets(speed),
            "transformer_network_bytes": network_bytes(personal),
            "device_train_peak_rss_mib": {
                label: device_train_peak_rss(bundle, folder) for label, bundle in bundles.items()
            },
            "memory_run": f"`edgepfl device train --engine portable --epochs 1 --batch-size {BATCH} --threads "
            f"{THREADS}` on about {SAMPLES} generated samples of the bundle's kind; its ru_maxrss",
        }
    result["figure"] = str(plot(result).relative_to(FIGURES.parent.parent))
    document = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(document + "\n")
    print(document)


if __name__ == "__main__":
    main()
