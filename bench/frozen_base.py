"""Images per second of the portable engine's personal-only (or base-only) step with and without its frozen variant.

A personal-only step passes the base through unchanged. The exporter writes a variant of the step graph in which
those tensors are initializers (export/frozen.py); the portable engine builds it after two plain steps on the
same frozen tensors (here: after one, to time the build), handing onnxruntime their
values, so the base's convolutions get onnxruntime's constant-weight kernels (bench/depthwise.py, conv-const).
This times what that gives: two engines on one bundle, one with the variants (`bake_frozen=True`, the default)
and one without, fed the same batches, checked to agree, alternated. The variant's first build is timed on its
own (it happens once per received base). Prints JSON.
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
from engines import host

from edgepfl.device_runtime.portable_engine import PortableEngine
from edgepfl.errors import BundleError
from edgepfl.manifest import load_manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--step", default="personal", choices=["personal", "base"])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    manifest = load_manifest(args.bundle)
    engines = {
        "inputs": PortableEngine(args.bundle, manifest, threads=args.threads, bake_frozen=False),
        "initializers": PortableEngine(args.bundle, manifest, threads=args.threads),
    }
    engines["initializers"].bake_after = 1  # build on the second step, to time the build (by default the third)
    step = engines["initializers"].entry["steps"][args.step]
    if "frozen" not in step or not engines["initializers"].bake_frozen:
        raise BundleError(f"{args.bundle}'s {args.step} step has no frozen variant", "re-export with this edgepfl")
    rng = np.random.default_rng(0)
    batch = engines["inputs"].batch_size
    x = rng.standard_normal((batch, *manifest.input.shape)).astype(np.float32)
    y = (np.arange(batch) % manifest.num_classes).astype(np.int64)

    def step_of(label: str) -> float:
        started = time.perf_counter()
        engines[label].train_step(x, y, lr=0.01, trainable=args.step)
        return time.perf_counter() - started

    first = {label: [step_of(label), step_of(label)] for label in engines}  # the variant is built in the second
    before = {label: engine.get_tensors() for label, engine in engines.items()}
    difference = max(float(np.abs(before["inputs"][n] - before["initializers"][n]).max()) for n in before["inputs"])
    seconds: dict[str, list[float]] = {label: [] for label in engines}
    for repeat in range(args.repeats + 3):
        for label in list(engines) if repeat % 2 else list(engines)[::-1]:  # alternated, each first half the time
            elapsed = step_of(label)
            if repeat >= 3:
                seconds[label].append(elapsed)
    result = {
        "host": host(),
        "bundle": str(args.bundle),
        "step": args.step,
        "threads": args.threads,
        "frozen_inputs": len(step["frozen"]["initializers"]),
        "state_tensors": len(engines["inputs"].entry["params"]) + len(engines["inputs"].entry["buffers"]),
        "max_abs_difference_after_two_steps": difference,
        "second_step_s": {label: round(values[1], 3) for label, values in first.items()},
        "images_per_s": {label: round(batch / float(np.median(values)), 1) for label, values in seconds.items()},
    }
    # the variant's build: its engine's second step less what one of its steps takes once built
    built_step = float(np.median(seconds["initializers"]))
    result["variant_build_s"] = round(result["second_step_s"]["initializers"] - built_step, 3)
    result["speedup"] = round(result["images_per_s"]["initializers"] / result["images_per_s"]["inputs"], 3)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
