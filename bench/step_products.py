"""How much of the next-word transformer's training step is matrix products on the portable engine and on torch
eager, and what that leaves for issue 53's targets (portable ÷ torch >= 1.0 for the full step, >= 1.5 for the
adapters-only step).

The steps are bench/sequence_models.py's (its export and its timing, imported from it): FedAlt's StackOverflow
transformer (4 layers, d 256, feed-forward 1024, seq_len 20, vocabulary 10,004), batch 32, THREADS threads; the full
step, and the personal-only steps of `output:1` and `adapters:16` as a device runs them (their frozen variants).
For each step:

- `step_ms`: the median step with no profiler on, both engines timed in turns (sequence_models._median_steps);
- `products_ms` and `products_gflop`: what each engine's own profiler puts in matrix products over PROFILED steps
  after the warm-up, per step: onnxruntime's node kernel times of Gemm, MatMul, FusedMatMul and FusedGemm (the
  FLOPs from each node's input and output shapes), torch's self CPU time of aten::mm, addmm, bmm and baddbmm (its
  FLOP counter). A profiler slows small nodes, so `rest_ms` (step − products) is read from the unprofiled step;
- `ceiling`: torch's step ÷ the portable step's products. Portable ÷ torch cannot pass it while onnxruntime runs
  the products as it does: it is the ratio a portable step whose every other node cost nothing would reach.

Prints JSON, writes it to --out (default docs/measurements/step-products-<date>.json) and
bench/figures/step_products.png.

Usage: python bench/step_products.py [--out FILE] [--steps N]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sequence_models as sequence  # noqa: E402  (the same bundles and timing as the speed table)
from engines import host  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ORT_PRODUCTS = frozenset({"Gemm", "MatMul", "FusedMatMul", "FusedGemm"})
TORCH_PRODUCTS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"})
PROFILED = 10  # profiled steps, after the warm-up
TARGETS = {"full": 1.0, f"personal {sequence.ADAPTERS}": 1.5}


def ort_products(trace: list[dict], skip_runs: int) -> tuple[float, float, int]:
    """(ms, GFLOP) a run spends in matrix products, from one onnxruntime session's profile, and the runs counted:
    the node events inside each `model_run` after the first `skip_runs`."""
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in trace if e.get("name") == "model_run")[skip_runs:]
    if not runs:
        raise SystemExit("the profile holds no step after the warm-up")
    micros, flops = 0.0, 0.0
    for event in trace:
        args = event.get("args", {})
        kernel = event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time")
        if not kernel or args.get("op_name") not in ORT_PRODUCTS:
            continue
        if not any(begin <= event["ts"] <= end for begin, end in runs):
            continue
        micros += event["dur"]
        flops += _node_flops(args)
    return micros / 1e3 / len(runs), flops / 1e9 / len(runs), len(runs)


def _node_flops(args: dict) -> float:
    """2·M·N·K of a product node from its profiled shapes: 2·|A|·N, A being M×K (or a batch of them, as here)."""
    first = np.prod(next(iter(args["input_type_shape"][0].values())))
    output = next(iter(args["output_type_shape"][0].values()))
    return 2.0 * first * output[-1]


def profiled_portable(bundle: Path, trainable: str, x, y, warmup: int, folder: Path) -> dict:
    """The portable step under onnxruntime's profiler: its products per step (the session the device runs last)."""
    import onnxruntime as ort

    from edgepfl.device_runtime.engine import open_engine

    engine = open_engine(bundle, "portable", threads=sequence.THREADS)
    plain_options = engine._options
    made: list[ort.SessionOptions] = []

    def profiling_options() -> ort.SessionOptions:
        options = plain_options()
        options.enable_profiling = True
        options.profile_file_prefix = str(folder / f"{trainable}-{len(made)}")
        made.append(options)
        return options

    engine._options = profiling_options  # every session the engine opens from here on profiles
    for _ in range(warmup + PROFILED):
        engine.train_step(x, y, 0.0, trainable)
    session = _last_session(engine)
    trace = json.loads(Path(session.end_profiling()).read_text())
    runs = sum(1 for event in trace if event.get("name") == "model_run")
    ms, gflop, counted = ort_products(trace, max(0, runs - PROFILED))
    return {"products_ms": round(ms, 2), "products_gflop": round(gflop, 2), "profiled_steps": counted}


def _last_session(engine):
    """The session of the step the engine ran last: the frozen variant where it built one, else the plain graph."""
    baked = [built[0] for built in engine._baked.values()]
    return baked[-1] if baked else next(iter(engine._sessions.values()))


def profiled_torch(engine, trainable: str, x, y) -> dict:
    """The torch eager step under torch's profiler, on an engine already warmed up: its products (self CPU time
    and FLOPs) per step."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, record_shapes=True, with_flops=True) as profile:
        for _ in range(PROFILED):
            engine.train_step(x, y, 0.0, trainable)
    micros, flops = 0.0, 0.0
    for row in profile.key_averages():
        if row.key in TORCH_PRODUCTS:
            micros += row.self_cpu_time_total
            flops += row.flops
    return {"products_ms": round(micros / 1e3 / PROFILED, 2), "products_gflop": round(flops / 1e9 / PROFILED, 2)}


def step_row(bundle: Path, trainable: str, warmup: int, steps: int, folder: Path) -> dict:
    """One step's times and products on both engines, and the ceiling they leave portable ÷ torch."""
    from edgepfl.device_runtime.engine import open_engine
    from edgepfl.simulate.torch_engine import TorchEngine

    portable = open_engine(bundle, "portable", threads=sequence.THREADS)
    manifest = portable.manifest
    torch_engine = TorchEngine(bundle, manifest, portable.get_tensors(), threads=sequence.THREADS)
    x, y = sequence.step_batch(manifest)
    trains = {
        "portable": lambda: portable.train_step(x, y, 0.0, trainable),
        "torch": lambda: torch_engine.train_step(x, y, 0.0, trainable),
    }
    seconds = sequence._median_steps(trains, warmup, steps)
    engines = {
        "portable": profiled_portable(bundle, trainable, x, y, warmup, folder),
        "torch": profiled_torch(torch_engine, trainable, x, y),  # warmed up by the timing (lr 0: unchanged)
    }
    for name, engine in engines.items():
        engine["step_ms"] = round(seconds[name] * 1e3, 2)
        engine["rest_ms"] = round(engine["step_ms"] - engine["products_ms"], 2)
        engine["products_share"] = round(engine["products_ms"] / engine["step_ms"], 3)
        engine["products_gflop_per_s"] = round(engine["products_gflop"] / engine["products_ms"] * 1e3, 1)
    ported, torched = engines["portable"], engines["torch"]
    return {
        **engines,
        "portable_over_torch": round(torched["step_ms"] / ported["step_ms"], 2),
        "ceiling": round(torched["step_ms"] / ported["products_ms"], 2),
    }


def plot(result: dict, path: Path) -> None:
    """Each step's products and the rest, per engine, stacked; the ceiling over each pair."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["steps"]
    fig, axes = plt.subplots(figsize=(8, 4.5))
    for number, row in enumerate(rows.values()):
        for offset, name in ((-0.2, "portable"), (0.2, "torch")):
            engine = row[name]
            colour = "tab:blue" if name == "portable" else "tab:red"
            axes.bar(number + offset, engine["products_ms"], 0.38, color=colour)
            axes.bar(number + offset, engine["rest_ms"], 0.38, bottom=engine["products_ms"], color="lightgray")
            axes.text(number + offset, 1, name, rotation=90, ha="center", va="bottom", color="white", fontsize=8)
        top = max(row["portable"]["step_ms"], row["torch"]["step_ms"])
        axes.text(number, top * 1.02, f"ceiling {row['ceiling']}", ha="center", fontsize=8)
    axes.set_xticks(range(len(rows)), [f"{label} step" for label in rows], fontsize=8)
    axes.set_ylabel(f"ms a step (batch {sequence.BATCH}, {sequence.THREADS} threads); colour: matrix products")
    axes.set_title("Transformer step: matrix products (colour) and the rest (grey)")
    fig.tight_layout()
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    """Run the benchmark and print its JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where the JSON goes (default docs/measurements/…)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps of each engine (default 30)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(sequence.THREADS)
    from edgepfl.device_runtime.portable_engine import BAKE_AFTER_STEPS

    warmup = BAKE_AFTER_STEPS + 3  # the frozen variants are built by then
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        text_corpus = sequence.corpus(folder)
        bundles = {
            spec: sequence.export("transformer", folder, text_corpus, spec, frozen_variants=True)
            for spec in (sequence.OUTPUT, sequence.ADAPTERS)
        }
        steps: dict = {"full": step_row(bundles[sequence.OUTPUT], "full", warmup, args.steps, folder)}
        print(json.dumps({"full": steps["full"]}), file=sys.stderr)
        for spec, bundle in bundles.items():
            steps[f"personal {spec}"] = step_row(bundle, "personal", warmup, args.steps, folder)
            print(json.dumps({spec: steps[f"personal {spec}"]}), file=sys.stderr)
    result = {
        "transformer": "FedAlt StackOverflow: 4 layers, d 256, 4 heads, ff 1024, seq 20, vocab 10004",
        "batch": sequence.BATCH,
        "threads": sequence.THREADS,
        "timed_steps": args.steps,
        "profiled_steps": PROFILED,
        "date": datetime.date.today().isoformat(),
        "host": host(),  # the ratio follows the host's BLAS: torch's MKL and onnxruntime's MLAS differ by CPU
        "steps": steps,
        "targets": {
            label: {"target": target, **{key: steps[label][key] for key in ("portable_over_torch", "ceiling")}}
            for label, target in TARGETS.items()
        },
    }
    figure = ROOT / "bench" / "figures" / "step_products.png"
    plot(result, figure)
    result["figure"] = str(figure.relative_to(ROOT))
    out = args.out or ROOT / "docs" / "measurements" / f"step-products-{result['date']}.json"
    document = json.dumps(result, indent=1)
    out.write_text(document + "\n")
    print(document)


if __name__ == "__main__":
    main()
