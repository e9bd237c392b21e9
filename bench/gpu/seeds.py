"""On the device machine: place prep.py's bundles under RUNS/LABEL/seedN/ for seeds 0 and 1.

Seed 1's initial tensors are built there by the same seeded code; they are used only if that machine's torch
rebuilds seed 0's bit for bit as the carried file (exported here).
Usage: python bench/gpu/seeds.py BUNDLES RUNS
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np

from edgepfl.export.bundle import simulation_target
from edgepfl.wire import load_tensors, save_tensors


def initial(seed: int, names) -> dict:
    module = simulation_target("mobilenet", (3, 32, 32), 10, seed, 1.0, None).module
    state = {name: value.detach().numpy() for name, value in module.state_dict().items()}
    return {name: state[name] for name in names}


def main() -> None:
    source, runs = Path(sys.argv[1]), Path(sys.argv[2])
    carried = load_tensors(source / "initial-seed0.safetensors")
    rebuilt = initial(0, carried)
    same = all(np.array_equal(rebuilt[name], carried[name]) for name in carried)
    print("seed 0 init rebuilt here equals the carried one:", same, flush=True)
    seeds = {0: carried, **({1: initial(1, carried)} if same else {})}
    for label_dir in sorted(path for path in source.iterdir() if path.is_dir()):
        label = label_dir.name.replace("_", "/")
        for seed, tensors in seeds.items():
            bundle = runs / label / f"seed{seed}" / "bundle"
            bundle.mkdir(parents=True, exist_ok=True)
            shutil.copy(label_dir / "manifest.json", bundle / "manifest.json")
            save_tensors(bundle.parent / "bundle-initial.safetensors", tensors)
    print("seeds", sorted(seeds))


if __name__ == "__main__":
    main()
