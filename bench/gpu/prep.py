"""Here: export fedper-paper's bundles (seed 0) and keep what the torch engine reads (manifest.json and the
initial tensors) under OUT/LABEL/ and OUT/initial-seed0.safetensors, for seeds.py on the device machine.
Only the runs whose label (after "fedper-paper/") starts with one of the PREFIXes (default k4/); every run
must start from the same weights.
Usage: python bench/gpu/prep.py DATA_ROOT OUT [PREFIX ...]
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reproduce import plan  # noqa: E402

from edgepfl.simulate.bundle import ensure_bundle, initial_file  # noqa: E402
from edgepfl.simulate.config import SimulateConfig  # noqa: E402


def main() -> None:
    data_root, out = sys.argv[1], Path(sys.argv[2])
    prefixes = tuple(sys.argv[3:]) or ("k4/",)
    base = SimulateConfig(data_root=data_root, clients=10, rounds=100, engine="torch", seed=0)
    scratch = Path(tempfile.mkdtemp())
    for label, config in plan("fedper-paper", base):
        if not label.split("/", 1)[1].startswith(prefixes):
            continue
        folder = scratch / label / "seed0" / "bundle"
        manifest = ensure_bundle(config, folder, (3, 32, 32), 10)
        dest = out / label.replace("/", "_")
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(folder / "manifest.json", dest / "manifest.json")
        digest = hashlib.sha256(initial_file(folder).read_bytes()).hexdigest()
        print(label, manifest.kp, digest[:16], flush=True)
        kept = out / "initial-seed0.safetensors"
        if not kept.is_file():
            shutil.copy(initial_file(folder), kept)
        assert hashlib.sha256(kept.read_bytes()).hexdigest() == digest, "the runs start from different weights"


if __name__ == "__main__":
    main()
