"""One local epoch on the device (1,000 images, batch 32): wall time and peak RSS per model and engine; bytes per round.

Each measurement runs in a fresh process with torch blocked, as on a device, so its peak RSS is its own.
Bytes per round are the safetensors bodies a FedPer device receives and sends (base only) against a
full-model FedAvg client (base and personal), HTTP headers not counted.
Prints JSON on stdout and a table on stderr, and writes bench/out/device.png.
Usage: python bench/device.py [--quick]   (--quick: mobilenet x0.25 only)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().parent / "out"
IMAGES, BATCH, KP = 1000, 32, 2
ENGINES = ("ort-training", "portable")

MEASURE = """
import json, sys, time
sys.modules['torch'] = None
import numpy as np
from edgepfl.data import make_local_data
from edgepfl.device_runtime.algorithms import Phase, train_phase
from edgepfl.device_runtime.engine import open_engine
bundle, engine_name, images, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
engine = open_engine(bundle, engine_name)
manifest = engine.manifest
channels, height, width = manifest.input.shape
rng = np.random.default_rng(0)
x = rng.integers(0, 256, (images, height, width, channels), dtype=np.uint8)
y = rng.integers(0, manifest.num_classes, images)
data = make_local_data(x, y, manifest, 0.0, 0)
started = time.perf_counter()
log = train_phase(engine, data, Phase("epoch", "full", 1), 0.01, batch, seed=0)
seconds = time.perf_counter() - started
peak_kib = None
try:  # VmHWM is this process's own high-water mark (ru_maxrss would include the parent's at fork)
    status = open("/proc/self/status").read().split("VmHWM:")[1]
    peak_kib = float(status.split()[0])
except (OSError, IndexError):
    import resource
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024 if sys.platform == "darwin" else 1)
print(json.dumps({"epoch_seconds": seconds, "steps": log.steps, "peak_rss_mib": round(peak_kib / 1024, 1)}))
"""


def export(width: float, folder: Path) -> Path:
    """A mobilenet bundle with both engines' artifacts."""
    from edgepfl.export.bundle import ExportOptions, export_bundle
    from edgepfl.export.models import ModelSpec

    out = folder / f"mobilenet-x{width}"
    export_bundle(ModelSpec(name="mobilenet", width=width), KP, out, ExportOptions(engines=ENGINES, force=True))
    return out


def round_bytes(bundle: Path) -> dict:
    """Bytes of one round's bodies: FedPer (base down and up) vs a FedAvg client (whole model down and up)."""
    from edgepfl.device_runtime.engine import open_engine
    from edgepfl.protocol import UploadMeta
    from edgepfl.wire import encode_tensors

    engine = open_engine(bundle, "portable")
    manifest = engine.manifest
    meta = UploadMeta(manifest.base_layout_hash, IMAGES).to_metadata()
    base = engine.tensors_by_role("base")
    full = {**base, **engine.tensors_by_role("personal")}
    fedper = {"received": len(encode_tensors(base)), "sent": len(encode_tensors(base, meta))}
    fedavg = {"received": len(encode_tensors(full)), "sent": len(encode_tensors(full, meta))}
    return {"kp": manifest.kp, "fedper": fedper, "fedavg_full_model": fedavg}


def run_measure(bundle: Path, engine: str) -> dict:
    """Epoch time and peak RSS measured inside a fresh process."""
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(bundle), engine, str(IMAGES), str(BATCH)], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"measuring {engine} on {bundle.name} failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def plot(rows: list[dict], path: Path) -> None:
    """Epoch seconds and peak RSS per model and engine, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model']}\n{r['engine']}" for r in rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(labels, [r["epoch_seconds"] for r in rows])
    left.set_ylabel(f"seconds per epoch ({IMAGES} images, batch {BATCH})")
    right.bar(labels, [r["peak_rss_mib"] for r in rows], color="tab:orange")
    right.set_ylabel("peak RSS (MiB)")
    for axis in (left, right):
        axis.tick_params(axis="x", labelsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="mobilenet x0.25 only")
    options = parser.parse_args()
    widths = (0.25,) if options.quick else (0.25, 1.0)
    rows, traffic = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for width in widths:
            bundle = export(width, Path(tmp))
            model = f"mobilenet x{width}"
            traffic[model] = round_bytes(bundle)
            for engine in ENGINES:
                rows.append({"model": model, "engine": engine, **run_measure(bundle, engine)})
    result = {"images": IMAGES, "batch": BATCH, "epochs": rows, "bytes_per_round": traffic}
    print(json.dumps(result, indent=2))
    print(f"{'model':16} {'engine':14} {'s/epoch':>8} {'peak MiB':>9}", file=sys.stderr)
    for row in rows:
        print(
            f"{row['model']:16} {row['engine']:14} {row['epoch_seconds']:8.2f} {row['peak_rss_mib']:9.1f}",
            file=sys.stderr,
        )
    for model, sizes in traffic.items():
        fedper, fedavg = sizes["fedper"], sizes["fedavg_full_model"]
        print(
            f"{model} kp={sizes['kp']}: FedPer {fedper['received'] + fedper['sent']:,} B/round, "
            f"FedAvg {fedavg['received'] + fedavg['sent']:,} B/round",
            file=sys.stderr,
        )
    plot(rows, OUT / "device.png")


if __name__ == "__main__":
    main()
