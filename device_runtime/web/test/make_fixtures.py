"""Fixtures for the browser device's Node tests, written by the Python device's own code.

Usage: python device_runtime/web/test/make_fixtures.py OUT_DIR  (needs the export extra: torch, Pillow)

Writes a tiny BatchNorm cnn bundle (portable graphs), feeds and the Python portable engine's tensors after
full and personal steps and after one fedalt round, files written by Python's `safetensors`, and PNGs with
the Python loader's arrays of them. Both engines build a step's frozen variant (export/frozen.py) after the
same number of plain steps, so the later personal steps and the round's run on variants on both sides. The Node
tests (test/*.test.mjs) compare the JavaScript side to these.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))  # tests.conftest holds the one bundle-export helper the test suite uses

import make_secagg_fixtures  # noqa: E402  (beside this file)
from safetensors.numpy import save_file  # noqa: E402

from edgepfl.data import make_local_data, normalize  # noqa: E402
from edgepfl.device_runtime.algorithms import run_client_round  # noqa: E402
from edgepfl.device_runtime.data import read_image_folder, resize_image  # noqa: E402
from edgepfl.device_runtime.portable_engine import PortableEngine  # noqa: E402
from edgepfl.device_runtime.statistics import recompute_statistics  # noqa: E402
from edgepfl.manifest import InputSpec, load_manifest  # noqa: E402
from edgepfl.protocol import RoundSettings, UploadMeta  # noqa: E402
from edgepfl.wire import encode_tensors  # noqa: E402
from tests.conftest import export_test_bundle  # noqa: E402

LR = 0.05
ROUND = {"algorithm": "fedalt", "epochs": 1, "personal_epochs": 1, "finetune_epochs": 1, "batch_size": 8, "lr": LR}


def main(out: Path) -> None:
    """Write every fixture into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    bundle = export_test_bundle(out / "bundle", "cnn", 1, ("portable",), 0, input_size=28, norm="batch")
    manifest = load_manifest(bundle)
    batch = manifest.engines["portable"]["batch_size"]
    rng = np.random.default_rng(0)
    shape = tuple(manifest.input.shape)
    feeds = {
        "x1": rng.normal(size=(batch - 3, *shape)).astype(np.float32),  # a short batch: padded and masked
        "y1": rng.integers(0, manifest.num_classes, batch - 3),
        "x2": rng.normal(size=(batch, *shape)).astype(np.float32),
        "y2": rng.integers(0, manifest.num_classes, batch),
        "xe": rng.normal(size=(batch + 7, *shape)).astype(np.float32),  # two eval chunks
        "ye": rng.integers(0, manifest.num_classes, batch + 7),
    }
    save_file(feeds, out / "feeds.safetensors")
    results: dict = {"lr": LR, "round_settings": ROUND}

    engine = PortableEngine(bundle, manifest)
    results["eval_initial"] = vars(engine.eval_batch(feeds["xe"], feeds["ye"]))
    results["full_losses"] = [
        engine.train_step(feeds["x1"], feeds["y1"], LR, "full"),
        engine.train_step(feeds["x2"], feeds["y2"], LR, "full"),
    ]
    save_file(engine.get_tensors(), out / "full_after.safetensors")
    results["eval_after_full"] = vars(engine.eval_batch(feeds["xe"], feeds["ye"]))

    engine = PortableEngine(bundle, manifest)
    results["personal_loss"] = engine.train_step(feeds["x1"], feeds["y1"], LR, "personal")
    save_file(engine.get_tensors(), out / "personal_after.safetensors")
    # steps 2 and 3 on the same base: the third runs the frozen variant, and so does the fourth
    results["personal_more_losses"] = [
        engine.train_step(feeds[f"x{i}"], feeds[f"y{i}"], LR, "personal") for i in (2, 1, 2)
    ]
    save_file(engine.get_tensors(), out / "personal_baked_after.safetensors")

    write_round(out, bundle, manifest, results)
    write_safetensors(out, results)
    write_images(out, manifest, results)
    (out / "expected.json").write_text(json.dumps(results, indent=1))
    make_secagg_fixtures.main(out)


def write_round(out: Path, bundle: Path, manifest, results: dict) -> None:
    """One fedalt round (fine-tuning, personal, base phases) by the Python device on seeded uint8 images."""
    rng = np.random.default_rng(1)
    channels, height, width = manifest.input.shape
    images = rng.integers(0, 256, (26, height, width, channels), dtype=np.uint8)
    labels = rng.integers(0, manifest.num_classes, 26)
    data = make_local_data(images, labels, manifest, 0.25, seed=3)
    x_train = normalize(images[data.train_index], manifest.input)
    save_file(
        {"x_train": x_train, "y_train": labels[data.train_index], "images": images, "labels": labels},
        out / "round_data.safetensors",
    )
    engine = PortableEngine(bundle, manifest)
    result = run_client_round(engine, RoundSettings(**ROUND), data, seed=3, round_id=2)
    save_file(engine.get_tensors(), out / "round_after.safetensors")
    recompute_statistics(engine, data, ROUND["batch_size"])  # what a device does when the next base arrives
    save_file(engine.get_tensors(), out / "recomputed.safetensors")
    results["round"] = {
        "seed": 3,
        "round_id": 2,
        "val_fraction": 0.25,
        "train_index": data.train_index.tolist(),
        "val_index": data.val_index.tolist(),
        "train_loss": result.train_loss,
        "phases": [{"name": p.name, "steps": p.steps, "mean_loss": p.mean_loss} for p in result.phases],
    }


def write_safetensors(out: Path, results: dict) -> None:
    """A file of every common dtype written by Python's safetensors, and an upload as the Python device encodes it."""
    rng = np.random.default_rng(2)
    tensors = {
        "w.f32": rng.normal(size=(3, 4)).astype(np.float32),
        "h.f16": rng.normal(size=(5,)).astype(np.float16),
        "i.i64": np.array([-(2**40), 0, 7], dtype=np.int64),
        "j.i32": np.array([[-5, 6]], dtype=np.int32),
        "u.u8": np.arange(7, dtype=np.uint8),
        "scalar": np.array(1.5, dtype=np.float32),
        "empty": np.zeros((0, 3), dtype=np.float32),
    }
    save_file(tensors, out / "python_written.safetensors", metadata={"who": "python", "n": "7"})
    results["python_written"] = {
        name: {"dtype": str(v.dtype), "shape": list(v.shape), "values": v.astype(np.float64).ravel().tolist()}
        for name, v in tensors.items()
    }
    upload = {"b.weight": rng.normal(size=(2, 3)).astype(np.float32), "a.bias": np.arange(3, dtype=np.float32)}
    meta = UploadMeta(base_layout_hash="ab" * 32, num_samples=12, train_loss=0.5, val_accuracy=0.25, val_loss=1.25)
    (out / "python_upload.safetensors").write_bytes(encode_tensors(upload, meta.to_metadata()))


def write_images(out: Path, manifest, results: dict) -> None:
    """PNGs larger and smaller than the model input, and the Python loader's pixels and model input of them."""
    from PIL import Image

    rng = np.random.default_rng(4)
    folder = out / "images" / "cat"
    folder.mkdir(parents=True, exist_ok=True)
    sizes = {"a_large.png": (45, 37), "b_small.png": (11, 9)}  # (width, height)
    for name, (w, h) in sizes.items():
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / name)
    pixels, _ = read_image_folder(out / "images", manifest)
    grey_spec = InputSpec(shape=(1, 20, 20), mean=(0.5,), std=(0.25,))
    grey = np.stack(
        [resize_image(np.asarray(Image.open(folder / name).convert("L"))[..., None], 20, 20) for name in sorted(sizes)]
    )
    save_file(
        {
            "rgb_pixels": np.ascontiguousarray(pixels.transpose(0, 3, 1, 2)),
            "rgb_input": normalize(pixels, manifest.input),
            "grey_pixels": np.ascontiguousarray(grey.transpose(0, 3, 1, 2)),
            "grey_input": normalize(grey, grey_spec),
        },
        out / "images_expected.safetensors",
    )
    results["images"] = {"files": [f"images/cat/{name}" for name in sorted(sizes)], "grey_spec": vars(grey_spec)}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_fixtures.py OUT_DIR")
    main(Path(sys.argv[1]))
