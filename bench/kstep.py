"""Several SGD steps per session.run (issue 39, item 2): does a K-step graph pay?

Chains K copies of a bundle's portable step graph into one graph (`chain`): step k+1 reads step k's new
parameters and statistics, the K batches come stacked (K·N samples, one Split each for x, y and w), lr is shared,
the initializers are stored once. Times it with onnxruntime's CPU provider against the one-step graph run K
times, in interleaved rounds, and checks that both give the same tensors. The node count grows K-fold: on
WebGPU, where each node is one dispatch, a K-step graph dispatches as much per SGD step as the one-step graph
(onnxruntime-web's WebGPU provider has no Loop), so all it can save there is session.run's own cost per step.
With --wasm, the same graphs also run on onnxruntime-web's WebAssembly build from Node, one thread (bench/kstep.mjs;
needs `npm ci` in device_runtime/web), as the page's wasm engine runs them.
Prints JSON on stdout, a table on stderr, and writes bench/figures/kstep-{set}.png.
Usage: python bench/kstep.py --bundle DIR [--set full] [--k 1,2,4] [--rounds 5] [--steps 8] [--threads 2] [--wasm]
  (DIR: a bundle with portable graphs, e.g. `edgepfl export mobilenet --width 0.25 --kp 2 --engines portable`)
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
import onnx
import onnxruntime as ort
from engines import host
from onnx import helper
from safetensors.numpy import load_file, save_file

from edgepfl.export.portable import (
    BUFFER_PREFIX,
    NEW_BUFFER_PREFIX,
    NEW_PARAM_PREFIX,
    PARAM_PREFIX,
    SAMPLE_INPUTS,
    STEP_OUTPUT_LOSS,
)

HERE = Path(__file__).resolve().parent
FIGURES = HERE / "figures"  # kstep-{set}.png
CARRIED = {NEW_PARAM_PREFIX: PARAM_PREFIX, NEW_BUFFER_PREFIX: BUFFER_PREFIX}  # a step's output -> the next's input


def carried_input(output: str) -> str | None:
    """The input of the next step that `output` feeds (a new parameter or statistic), or None (the loss)."""
    for prefix, to in CARRIED.items():
        if output.startswith(prefix):
            return to + output[len(prefix) :]
    return None


def carried(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A step's new tensors under the names of the next step's inputs."""
    return {carried_input(name): value for name, value in outputs.items() if carried_input(name) is not None}


def batch_of(step: onnx.ModelProto) -> int:
    """The samples of one batch: the step's x's leading dimension."""
    return next(i for i in step.graph.input if i.name == "x").type.tensor_type.shape.dim[0].dim_value


def chain(step: onnx.ModelProto, k: int) -> onnx.ModelProto:
    """K copies of `step` as one graph: inputs as `step`'s with x, y and w K times as long; outputs the last
    step's tensors under their own names and each step's loss (loss0 ... loss{K-1})."""
    graph = step.graph
    initializers = {t.name for t in graph.initializer}
    produced = {name for node in graph.node for name in node.output}
    outputs = {o.name: o for o in graph.output}
    if not set(outputs) <= produced:
        passed = sorted(set(outputs) - produced)[:3]
        raise SystemExit(
            f"error: outputs {passed} are the step's inputs passed through (a bundle exported before steps left"
            " them out): export the bundle again"
        )
    batch = batch_of(step)

    def named(s: int, name: str) -> str:
        if name in outputs and carried_input(name) is None:
            return f"{name}{s}"  # the loss of step s
        return name if name in outputs and s == k - 1 else f"s{s}/{name}"

    nodes, inputs, splits = [], [], []
    for i in graph.input:
        stacked = onnx.ValueInfoProto()
        stacked.CopyFrom(i)
        if i.name in SAMPLE_INPUTS:
            stacked.type.tensor_type.shape.dim[0].dim_value = batch * k
            splits.append(helper.make_tensor(f"{i.name}:split", onnx.TensorProto.INT64, [k], [batch] * k))
            nodes.append(helper.make_node("Split", [i.name, f"{i.name}:split"], [f"s{s}/{i.name}" for s in range(k)]))
        inputs.append(stacked)
    current = {i.name: i.name for i in graph.input if i.name not in SAMPLE_INPUTS}  # a tensor input -> its value now
    losses = []
    for s in range(k):
        values = {**current, **{name: f"s{s}/{name}" for name in SAMPLE_INPUTS}}
        for node in graph.node:
            copy = onnx.NodeProto()
            copy.CopyFrom(node)
            copy.name = f"s{s}/{node.name}"
            copy.input[:] = [n if not n or n in initializers else values.get(n) or named(s, n) for n in node.input]
            copy.output[:] = [named(s, n) for n in node.output]
            nodes.append(copy)
        for name, out in outputs.items():
            fed = carried_input(name)
            if fed is not None:
                current[fed] = named(s, name)
            else:
                loss = onnx.ValueInfoProto()
                loss.CopyFrom(out)
                loss.name = named(s, name)
                losses.append(loss)
    new = [out for name, out in outputs.items() if carried_input(name) is not None]
    chained = helper.make_graph(nodes, f"{graph.name}_x{k}", inputs, losses + new, [*graph.initializer, *splits])
    return helper.make_model(chained, opset_imports=step.opset_import, ir_version=step.ir_version)


def first_feeds(bundle: Path, step: onnx.ModelProto, k: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The K-step graph's inputs: the bundle's initial tensors, K seeded batches stacked, lr."""
    initial = load_file(bundle / "portable" / "initial.safetensors")
    classes = json.loads((bundle / "manifest.json").read_text())["num_classes"]
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in step.graph.input:
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
        if i.name == "x" and np.issubdtype(dtype, np.integer):  # token ids
            feeds["x"] = rng.integers(0, classes, [shape[0] * k, *shape[1:]]).astype(dtype)
        elif i.name == "x":
            feeds["x"] = rng.standard_normal([shape[0] * k, *shape[1:]]).astype(dtype)
        elif i.name == "y":
            feeds["y"] = rng.integers(0, classes, [shape[0] * k, *shape[1:]]).astype(dtype)
        elif i.name == "w":
            feeds["w"] = np.ones(shape[0] * k, dtype)
        elif i.name == "lr":
            feeds["lr"] = np.array(0.01, dtype)
        else:
            feeds[i.name] = initial[i.name.split(":", 1)[1]]
    return feeds


def session(model: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    """A CPU session as the portable engine opens one (device_runtime/portable_engine.py)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def run_steps(sess: ort.InferenceSession, feeds: dict[str, np.ndarray], runs: int) -> tuple[dict, float]:
    """`runs` runs, each fed the tensors the one before it returned (as an engine does); (last outputs, seconds)."""
    names = [o.name for o in sess.get_outputs()]
    feeds = dict(feeds)
    start = time.perf_counter()
    for _ in range(runs):
        out = dict(zip(names, sess.run(None, feeds)))
        feeds.update(carried(out))
    return out, time.perf_counter() - start


def batches(stacked: dict[str, np.ndarray], batch: int, first: int, count: int) -> dict[str, np.ndarray]:
    """Batches first .. first + count - 1 of the stacked x, y and w."""
    return {n: stacked[n][first * batch : (first + count) * batch] for n in SAMPLE_INPUTS}


def one_step_runs(
    one: ort.InferenceSession, stacked: dict[str, np.ndarray], batch: int, k: int
) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """The one-step graph run on each of the first `k` batches of `stacked` in turn: (the tensors the last run
    left, under the inputs' names; each run's loss)."""
    state, losses = dict(stacked), []
    for s in range(k):
        out, _ = run_steps(one, {**state, **batches(stacked, batch, s, 1)}, 1)
        state.update(carried(out))
        losses.append(out[STEP_OUTPUT_LOSS])
    return state, losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--set", default="full", help="the step: full or personal")
    parser.add_argument("--k", default="1,2,4", help="steps per run, a comma list (1: the bundle's own graph)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="SGD steps timed per K in a round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--wasm", action="store_true", help="also time the graphs on wasm from Node, one thread")
    args = parser.parse_args()
    manifest = json.loads((args.bundle / "manifest.json").read_text())
    entry = manifest["engines"]["portable"]["steps"].get(args.set)
    if entry is None:
        raise SystemExit(f"error: the bundle has no {args.set} step: use full or personal")
    graph = entry["model"]  # the plain graph: a frozen variant reads its frozen tensors from the engine
    step = onnx.load(args.bundle / graph)
    ks = sorted({1, *(int(k) for k in args.k.split(","))})  # K = 1: the bundle's own graph, the baseline
    models = {k: step if k == 1 else chain(step, k) for k in ks}
    sessions = {k: session(model, args.threads) for k, model in models.items()}
    batch = batch_of(step)
    stacked = first_feeds(args.bundle, step, max(ks))
    feeds = {k: {**stacked, **batches(stacked, batch, 0, k)} for k in ks}  # each K's run: its first K batches
    # the same K SGD steps either way: one K-step run against K one-step runs on the same batches
    agreement = {}
    for k in ks:
        chained, _ = run_steps(sessions[k], feeds[k], 1)
        reference, _ = one_step_runs(sessions[1], stacked, batch, k)
        agreement[k] = max(float(np.abs(value - reference[name]).max()) for name, value in carried(chained).items())
    seconds = {k: [] for k in ks}
    for _ in range(args.rounds):
        for k in ks:  # interleaved: host noise falls on every K alike
            runs = max(1, args.steps // k)
            run_steps(sessions[k], feeds[k], 1)  # warm-up
            _, took = run_steps(sessions[k], feeds[k], runs)
            seconds[k].append(took / (runs * k))  # per SGD step
    wasm = time_on_wasm(models, feeds, args) if args.wasm else {}
    rows = []
    for k in ks:
        row = {"k": k, "nodes": len(models[k].graph.node), "max_diff_vs_one_step_runs": agreement[k]}
        row["native"] = throughput(seconds[k], batch)
        if wasm:
            row["wasm"] = throughput(wasm[str(k)], batch)
        rows.append(row)
    for row in rows:
        for engine in ("native", "wasm"):
            if engine in row:
                row[engine]["vs_k1"] = row[engine]["samples_per_s"] / rows[0][engine]["samples_per_s"]
        speeds = ", ".join(
            f"{e} {row[e]['samples_per_s']:.1f} samples/s ({row[e]['vs_k1']:.2f}x)"
            for e in ("native", "wasm")
            if e in row
        )
        print(
            f"K={row['k']}: {row['nodes']} nodes, {speeds}, max |diff| {row['max_diff_vs_one_step_runs']:.1e}",
            file=sys.stderr,
        )
    result = {
        "host": host(),
        "bundle": str(args.bundle),
        "graph": graph,
        "batch": batch,
        "threads": args.threads,
        "rounds": args.rounds,
        "rows": rows,
    }
    plot(rows, args.set)
    print(json.dumps(result, indent=1))


def throughput(seconds: list[float], batch: int) -> dict:
    """Median samples/s over the rounds' seconds per SGD step, with the quartiles."""
    q = statistics.quantiles(seconds, n=4) if len(seconds) > 1 else seconds * 3
    return {"samples_per_s": batch / statistics.median(seconds), "quartiles": [batch / q[2], batch / q[0]]}


def time_on_wasm(models: dict[int, onnx.ModelProto], feeds: dict[int, dict], args: argparse.Namespace) -> dict:
    """{K: seconds per SGD step, a round} on onnxruntime-web's wasm from Node (bench/kstep.mjs)."""
    with tempfile.TemporaryDirectory() as folder:
        for k, model in models.items():
            onnx.save(model, f"{folder}/k{k}.onnx")
            save_file(feeds[k], f"{folder}/k{k}.safetensors")
        outputs = [o.name for o in models[1].graph.output]  # which output feeds which input, for the Node runs
        Path(f"{folder}/carried.json").write_text(
            json.dumps({n: carried_input(n) for n in outputs if carried_input(n)})
        )
        command = ["node", str(HERE / "kstep.mjs"), "--dir", folder, "--rounds", str(args.rounds)]
        done = subprocess.run([*command, "--steps", str(args.steps)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"error: the wasm run failed: {done.stderr.strip()[-400:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["seconds"]


def plot(rows: list[dict], which: str) -> None:
    """Samples/s relative to K = 1, per engine, with the quartiles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = [e for e in ("native", "wasm") if e in rows[0]]
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    width = 0.8 / len(engines)
    for j, engine in enumerate(engines):
        base = rows[0][engine]["samples_per_s"]
        xs = [i + j * width for i in range(len(rows))]
        mids = [r[engine]["samples_per_s"] / base for r in rows]
        lows = [m - r[engine]["quartiles"][0] / base for m, r in zip(mids, rows)]
        highs = [r[engine]["quartiles"][1] / base - m for m, r in zip(mids, rows)]
        ax.bar(xs, mids, width, yerr=[lows, highs], label=engine, capsize=3)
    ax.axhline(1, color="k", lw=0.8)
    ax.set_xticks([i + width * (len(engines) - 1) / 2 for i in range(len(rows))], [str(r["k"]) for r in rows])
    ax.set_xlabel("SGD steps per session.run (K)")
    ax.set_ylabel("samples/s ÷ K = 1")
    ax.set_title(f"the {which} step chained K times")
    ax.legend()
    fig.tight_layout()
    FIGURES.mkdir(parents=True, exist_ok=True)
    fig.savefig(FIGURES / f"kstep-{which}.png", dpi=120)


if __name__ == "__main__":
    main()
