"""One local epoch on the device (1,000 images, batch 32): wall time and peak RSS per model and engine; bytes per round;
and the device's model as `device export-model` writes it, fp32 and int8: file size, CPU latency, accuracy.

Each measurement runs in a fresh process with torch blocked, as on a device, so its peak RSS is its own.
Bytes per round are the safetensors bodies a FedPer device receives and sends (base only) against a
full-model FedAvg client (base and personal), HTTP headers not counted.
The exported models (MobileNet x0.25, the issue's target: int8 at most 0.3x the size within a point of fp32's
accuracy) come from a device that trained locally on CIFAR-10 images (--export-images, --export-epochs; 20 %
held out, where both models' accuracy is measured); latency is plain onnxruntime on one thread, median of 200
runs at batch 1 and of 20 at batch 32. CIFAR-10 is read from --data-root (torchvision's layout).
Prints JSON on stdout and a table on stderr, and writes bench/out/device.png.
Usage: python bench/device.py [--quick] [--data-root DIR]   (--quick: mobilenet x0.25 only)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "out"
IMAGES, BATCH, KP = 1000, 32, 2
EXPORT_LR = 0.05
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
log = train_phase(engine, data, Phase("epoch", "full", 1, 0.01), batch, seed=0)
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


EXPORT_MEASURE = """
import json, sys, time
sys.modules['torch'] = None
import numpy as np
import onnxruntime
from edgepfl.data import make_local_data
from edgepfl.device_runtime.algorithms import Phase, evaluate, train_phase
from edgepfl.device_runtime.engine import open_engine
from edgepfl.device_runtime.model_export import export_device_model
from edgepfl.device_runtime.predict import open_device_model
from edgepfl.device_runtime.state import StateFolder
bundle, images, state, out, epochs, lr = sys.argv[1:7]
engine = open_engine(bundle, 'portable')
with np.load(images) as archive:
    data = make_local_data(archive['x'], archive['y'], engine.manifest, 0.2, 0)
started = time.perf_counter()
log = train_phase(engine, data, Phase('local', 'full', int(epochs), float(lr)), 32, seed=0)
folder = StateFolder(state, engine.manifest, engine.name)
folder.commit(engine.get_tensors(), {'local_training': True})
folder.close()
training = {'images': data.num_train, 'epochs': int(epochs), 'lr': float(lr), 'steps': log.steps,
            'seconds': round(time.perf_counter() - started, 1), 'engine_val_accuracy': evaluate(engine, data).accuracy}
model = open_device_model(bundle, state, 'portable')
rows = {}
for quantize in ('none', 'int8'):
    exported = export_device_model(model, out + '/' + quantize + '.onnx', quantize, data, calibration_samples=512)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = 1, 1
    session = onnxruntime.InferenceSession(str(exported.path), options, providers=['CPUExecutionProvider'])
    latency = {}
    for batch, runs in ((1, 200), (32, 20)):
        x = np.ascontiguousarray(next(data.val_batches(batch))[0])
        for _ in range(5):
            session.run(['probabilities'], {'input': x})
        times = []
        for _ in range(runs):
            tick = time.perf_counter()
            session.run(['probabilities'], {'input': x})
            times.append(time.perf_counter() - tick)
        latency[f'batch{batch}_ms'] = round(1000 * float(np.median(times)), 3)
    rows['fp32' if quantize == 'none' else 'int8'] = {
        'bytes': exported.bytes, 'val_accuracy': exported.val_accuracy, **latency,
    }
rows['val_samples'] = data.num_val
rows['int8_size_ratio'] = round(rows['int8']['bytes'] / rows['fp32']['bytes'], 4)
rows['int8_accuracy_points'] = round(100 * (rows['int8']['val_accuracy'] - rows['fp32']['val_accuracy']), 2)
print(json.dumps({'training': training, **rows}))
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


def measure_exported(bundle: Path, data_root: Path, images: int, epochs: int, folder: Path) -> dict:
    """The device's model after local training on CIFAR-10 images, exported fp32 and int8 (in a fresh process)."""
    from edgepfl.datasets.images import load_dataset

    dataset = load_dataset("cifar10", data_root)
    order = np.random.default_rng(0).permutation(dataset.num_train)[:images]
    npz = folder / "cifar10-device.npz"
    np.savez(npz, x=dataset.x_train[order], y=dataset.y_train[order])
    out = folder / "exported"
    out.mkdir(exist_ok=True)
    command = [sys.executable, "-c", EXPORT_MEASURE, str(bundle), str(npz), str(folder / "state"), str(out)]
    done = subprocess.run([*command, str(epochs), str(EXPORT_LR)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"measuring the exported models failed: {done.stderr.strip()[-800:]}")
    return {"data": dataset.description, **json.loads(done.stdout.strip().splitlines()[-1])}


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
    parser.add_argument("--data-root", type=Path, default=Path("/work/shared/data"), help="folder holding CIFAR-10")
    parser.add_argument("--export-images", type=int, default=10_000, help="CIFAR-10 images the device holds")
    parser.add_argument("--export-epochs", type=int, default=4, help="local epochs before the export")
    options = parser.parse_args()
    widths = (0.25,) if options.quick else (0.25, 1.0)
    rows, traffic, exported = [], {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for width in widths:
            bundle = export(width, Path(tmp))
            model = f"mobilenet x{width}"
            traffic[model] = round_bytes(bundle)
            for engine in ENGINES:
                rows.append({"model": model, "engine": engine, **run_measure(bundle, engine)})
            if width == 0.25:
                exported = {
                    model: measure_exported(
                        bundle, options.data_root, options.export_images, options.export_epochs, Path(tmp)
                    )
                }
    result = {"images": IMAGES, "batch": BATCH, "epochs": rows, "bytes_per_round": traffic, "exported": exported}
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
    for model, row in exported.items():
        print(
            f"{model} exported after {row['training']['epochs']} epochs on {row['training']['images']} images: "
            f"fp32 {row['fp32']['bytes']:,} B, {100 * row['fp32']['val_accuracy']:.1f} %, "
            f"{row['fp32']['batch1_ms']:.2f} ms | int8 {row['int8']['bytes']:,} B ({row['int8_size_ratio']:.2f}x), "
            f"{100 * row['int8']['val_accuracy']:.1f} % ({row['int8_accuracy_points']:+.1f} points), "
            f"{row['int8']['batch1_ms']:.2f} ms (batch 1, one thread)",
            file=sys.stderr,
        )
    plot(rows, OUT / "device.png")


if __name__ == "__main__":
    main()
