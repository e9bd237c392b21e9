"""Images per second of a portable step graph with its frozen tensors as graph inputs vs baked in as initializers.

A personal-only step passes the base through unchanged (an Identity from input to output). Baked into the graph
as initializers, the base's convolutions become constant-weight ones, which onnxruntime runs with faster kernels
(bench/depthwise.py, conv-const). This measures what that would give one step graph of a bundle: both sessions
are built from the same file, checked to agree, then alternated. Not what the engine does today (issue 15).
Prints JSON.
Usage: python bench/frozen_base.py BUNDLE [--step personal] [--repeats 30] [--threads 2]
  BUNDLE: a bundle with portable graphs, e.g. from
    edgepfl export torchvision:mobilenet_v2 --input-shape 3,96,96 --num-classes 10 --kp 2 --engines portable --out B
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from engines import host
from onnx import numpy_helper
from safetensors.numpy import load_file


def frozen_inputs(graph: onnx.GraphProto, inputs: list[str], outputs: list[str]) -> list[str]:
    """The state inputs a step passes through unchanged (its output is an Identity of the input)."""
    producer = {output: node for node in graph.node for output in node.output}
    return [
        name
        for name, output in zip(inputs, outputs)
        if output in producer and producer[output].op_type == "Identity" and producer[output].input[0] == name
    ]


def session(model: str | bytes, threads: int) -> tuple[ort.InferenceSession, float]:
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    started = time.perf_counter()
    built = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    return built, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--step", default="personal")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    manifest = json.loads((args.bundle / "manifest.json").read_text())
    entry = manifest["engines"]["portable"]
    step = entry["steps"][args.step]
    state = list(entry["params"]) + list(entry["buffers"])
    tensors = load_file(args.bundle / entry["initial"])
    by_input = dict(zip(step["inputs"], state))  # graph input name -> state tensor name
    model = onnx.load(args.bundle / step["model"])
    frozen = frozen_inputs(model.graph, step["inputs"][: len(state)], step["outputs"][1:])
    kept = [spec for spec in model.graph.input if spec.name not in frozen]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    model.graph.initializer.extend(numpy_helper.from_array(tensors[by_input[name]], name) for name in frozen)
    plain, plain_build = session(str(args.bundle / step["model"]), args.threads)
    baked, baked_build = session(model.SerializeToString(), args.threads)

    rng = np.random.default_rng(0)
    batch = entry["batch_size"]
    x = rng.standard_normal((batch, *manifest["input"]["shape"])).astype(np.float32)
    y = (np.arange(batch) % manifest["num_classes"]).astype(np.int64)
    x_name, y_name, w_name, lr_name = step["inputs"][len(state) : len(state) + 4]
    feeds = {name: tensors[by_input[name]] for name in step["inputs"][: len(state)]}
    feeds |= {x_name: x, y_name: y, w_name: np.ones(batch, np.float32), lr_name: np.array(0.01, np.float32)}
    baked_feeds = {name: value for name, value in feeds.items() if name not in frozen}
    difference = max(float(np.abs(a - b).max()) for a, b in zip(plain.run(None, feeds), baked.run(None, baked_feeds)))
    seconds: dict[str, list[float]] = {"inputs": [], "initializers": []}
    runs = (("inputs", plain, feeds), ("initializers", baked, baked_feeds))
    for repeat in range(args.repeats + 3):
        for label, runner, given in runs if repeat % 2 else runs[::-1]:  # alternated, each first half the time
            started = time.perf_counter()
            runner.run(None, given)
            if repeat >= 3:
                seconds[label].append(time.perf_counter() - started)
    result = {
        "host": host(),
        "bundle": str(args.bundle),
        "step": args.step,
        "threads": args.threads,
        "frozen_inputs": len(frozen),
        "state_tensors": len(state),
        "max_abs_difference": difference,
        "session_build_s": {"inputs": round(plain_build, 3), "initializers": round(baked_build, 3)},
        "images_per_s": {label: round(batch / float(np.median(values)), 1) for label, values in seconds.items()},
    }
    result["speedup"] = round(result["images_per_s"]["initializers"] / result["images_per_s"]["inputs"], 3)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
