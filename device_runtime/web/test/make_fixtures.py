"""Fixtures for the browser device's Node tests, written by the Python device's own code.

Usage: python device_runtime/web/test/make_fixtures.py OUT_DIR  (needs the export extra: torch, Pillow)

Writes the device contract (contract.json, as the server serves it), round settings with the Python device's
verdict on each, a tiny BatchNorm cnn bundle (portable graphs), feeds and the Python portable engine's tensors after
full and personal steps and after one fedalt round, the round's model as `device export-model` writes it (fp32 and
int8), files written by Python's `safetensors`, PNGs with the Python loader's arrays of them, and image folders
with the Python loader's labels or refusals. Both engines build a step's frozen variant (export/frozen.py) after
the same number of plain steps, so the later personal steps and the round's run on variants on both sides. The
Node tests (test/*.test.mjs) compare the JavaScript side to these.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))  # tests.conftest holds the one bundle-export helper the test suite uses
sys.path.insert(1, str(ROOT / "tests"))  # and imports tests/stages.py beside it, as pytest's sys.path has it

import make_capture_fixtures  # noqa: E402  (beside this file)
import make_secagg_fixtures  # noqa: E402  (beside this file)
import make_text_fixtures  # noqa: E402  (beside this file)
from safetensors.numpy import save_file  # noqa: E402

from edgepfl.data import make_local_data  # noqa: E402
from edgepfl.device_runtime.algorithms import run_client_round  # noqa: E402
from edgepfl.device_runtime.contract import CONTRACT_NAME, device_contract  # noqa: E402
from edgepfl.device_runtime.model_export import export_device_model  # noqa: E402
from edgepfl.device_runtime.portable_engine import PortableEngine  # noqa: E402
from edgepfl.device_runtime.predict import DeviceModel  # noqa: E402
from edgepfl.device_runtime.statistics import recompute_statistics  # noqa: E402
from edgepfl.errors import DataError, WireError  # noqa: E402
from edgepfl.kinds import ImageKind, InputSpec, NextWordKind, SensorKind  # noqa: E402
from edgepfl.kinds.pictures import read_image_folder, resize_image  # noqa: E402
from edgepfl.manifest import Manifest, load_manifest  # noqa: E402
from edgepfl.protocol import RoundSettings, UploadMeta  # noqa: E402
from edgepfl.text import Vocabulary, phrase_context, tokenize, write_vocabulary  # noqa: E402
from edgepfl.wire import encode_tensors  # noqa: E402
from tests.conftest import export_test_bundle  # noqa: E402

LR = 0.05
# round settings (each over the defaults) the page must accept or refuse exactly as RoundSettings.from_json does
SETTINGS_CASES = [
    {},
    *({"epochs": v} for v in (1000, 10**6, -1, 1.5, "2", None, True)),
    *({"batch_size": v} for v in (0, 1 << 20, (1 << 20) + 1)),
    *({"personal_epochs": v} for v in (0, 1001)),
    {"finetune_epochs": 3},
    *({"algorithm": v} for v in ("local", "fedprox", None)),
    *({"lr": v} for v in (0, -1, "x", 1e-9, 1, None)),
    *({"clip_norm": v} for v in (None, 0, 1.5, "x")),
    *({"share_buffers": v} for v in (True, "yes", 1)),
    {"recompute_bn": None},
    *({"kept_on_device": v} for v in (["conv.weight"], "conv.weight", [1])),
    *({"extra": v} for v in ({"alpha": 1}, [], None)),
    *({"upload_encoding": v} for v in ("int8-block256-sr", "fp16-block8", "int4", None)),
    *({"download_encoding": v} for v in ("fp16", "int8")),
    {"momentum": 0.9},  # a key this version does not know is ignored
]
ROUND = {"algorithm": "fedalt", "epochs": 1, "personal_epochs": 1, "finetune_epochs": 1, "batch_size": 8, "lr": LR}


def main(out: Path) -> None:
    """Write every fixture into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / CONTRACT_NAME).write_text(json.dumps(device_contract(), indent=1))
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
    results: dict = {"lr": LR, "round_settings": ROUND, "settings_cases": [settings_verdict(c) for c in SETTINGS_CASES]}

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
    write_folders(out, manifest, results)
    write_text(out, results)
    write_sensor(out, results)
    (out / "expected.json").write_text(json.dumps(results, indent=1))
    make_secagg_fixtures.main(out)
    make_text_fixtures.main(out / "text")
    make_capture_fixtures.main(out)


# strings whose tokens the page (src/text.js) must give exactly as Python: punctuation, apostrophes, Unicode, NFKC,
# control characters, emoji
TEXT_CASES = [
    "",
    "   \t ",
    "Hello, world! How are you?",
    "Don't stop: o'er the hills, 'tis rock'n'roll -- dogs' toys ''quoted''",
    "Don\u2019t \u2018single\u2019 \u201cdouble\u201d",
    "well-known e-mail at 3.14 or 1,000 (x) [y] {z} <a> @b #c $d %e ^f &g *h",
    "snake_case_name __init__ _x_",
    "caf\u00e9 cafe\u0301 Stra\u00dfe \u0130stanbul \u039f\u0394\u039f\u03a3 \u0928\u092e\u0938\u094d\u0924\u0947",
    "\u4f60\u597d\u4e16\u754c \u0645\u0631\u062d\u0628\u0627 \u05e9\u05dc\u05d5\u05dd",
    "\uff21\uff22\uff23 \ufb01ne \u2460 \u00bd x\u00b2 \u210c \u3000wide\u3000space \u2126",
    "bell\x07tab\tnull\x00nel\x85del\x7f zero\u200bwidth bom\ufeffhere nbsp\u00a0ogham\u1680line\u2028end",
    "\U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467 \U0001f1eb\U0001f1f7 1\ufe0f\u20e3 \u2764\ufe0f!!",
    "UPPER lower MiXeD \u00c9COLE",
    "a'b' 'c ' d'' e''f",
]
TEXT_SEQ_LEN = 6


def write_text(out: Path, results: dict) -> None:
    """A vocabulary (text/vocab.json) and Python's tokens, ids and next-word windows of TEXT_CASES."""
    vocabulary = Vocabulary.from_texts(TEXT_CASES[2:8], size=40)
    folder = out / "text"
    folder.mkdir(exist_ok=True)
    write_vocabulary(folder, vocabulary)
    results["text"] = {
        "task": NextWordKind.from_vocabulary(vocabulary, TEXT_SEQ_LEN).entry(),
        "cases": [
            {
                "text": text,
                "tokens": tokenize(text),
                "ids": vocabulary.encode(tokenize(text)).tolist(),
                "context": phrase_context(text, vocabulary, TEXT_SEQ_LEN).tolist(),
            }
            for text in TEXT_CASES
        ],
    }


# a sensor CSV the page (src/sensors.js) must read as the sensor kind (edgepfl/kinds/sensor.py) does: CRLF, a blank
# row, quoted cells, labels by name and by index, windows not in order of their names, exponents, signs and spaces
SENSOR_CSV = (
    "window , label,acc-x,acc-y,gyro-z\r\n"
    "b,moving,0.5,-1.25e-1, 3\r\n"
    'b,moving,1e2,+2,"4.75"\r\n'
    "\r\n"
    "a,0,.5,0,-0\r\n"
    "a,0,7,8,9.000001\r\n"
    'c,"moving",1,2,3\r\n'
    "c,moving,-4,5.,6\r\n"
)


def write_sensor(out: Path, results: dict) -> None:
    """A sensor bundle's manifest (no model: the page reads its windows only), SENSOR_CSV, and Python's windows,
    normalised, and labels of it."""
    channels = ("acc-x", "acc-y", "gyro-z")
    manifest = Manifest(
        model={},
        kind=SensorKind.of(channels, 2, 50, mean=(0.5, 1, 2), std=(1, 2, 4)),
        num_classes=2,
        kp=0,
        blocks=(),
        tensors=(),
        class_names=("still", "moving"),
    )
    (out / "sensor.csv").write_text(SENSOR_CSV, encoding="utf-8", newline="")
    x, y, _ = manifest.kind.read_csv(out / "sensor.csv", manifest.class_labels)
    results["sensor"] = {
        "manifest": manifest.to_json(),
        "x": manifest.kind.normalize(x).ravel().tolist(),
        "y": y.tolist(),
    }


def settings_verdict(settings: dict) -> dict:
    """Round settings and what the Python device says of them: null when it takes them, else the problem."""
    try:
        RoundSettings.from_json(settings)
    except WireError as error:
        return {"settings": settings, "problem": error.problem}
    return {"settings": settings, "problem": None}


def write_round(out: Path, bundle: Path, manifest, results: dict) -> None:
    """One fedalt round (fine-tuning, personal, base phases) by the Python device on seeded uint8 images."""
    rng = np.random.default_rng(1)
    channels, height, width = manifest.input.shape
    images = rng.integers(0, 256, (26, height, width, channels), dtype=np.uint8)
    labels = rng.integers(0, manifest.num_classes, 26)
    data = make_local_data(images, labels, manifest, 0.25, seed=3)
    x_train = manifest.kind.normalize(images[data.train_index])
    save_file(
        {"x_train": x_train, "y_train": labels[data.train_index], "images": images, "labels": labels},
        out / "round_data.safetensors",
    )
    engine = PortableEngine(bundle, manifest)
    result = run_client_round(engine, RoundSettings(**ROUND), data, seed=3, round_id=2)
    save_file(engine.get_tensors(), out / "round_after.safetensors")
    recompute_statistics(engine, data, ROUND["batch_size"])  # what a device does when the next base arrives
    save_file(engine.get_tensors(), out / "recomputed.safetensors")
    write_exported_models(out, DeviceModel(engine, out, 2, trained=True), data, results)
    results["round"] = {
        "seed": 3,
        "round_id": 2,
        "val_fraction": 0.25,
        "train_index": data.train_index.tolist(),
        "val_index": data.val_index.tolist(),
        "train_loss": result.train_loss,
        "phases": [{"name": p.name, "steps": p.steps, "mean_loss": p.mean_loss} for p in result.phases],
    }


def write_exported_models(out: Path, model: DeviceModel, data, results: dict) -> None:
    """`device export-model` of the device after the round, fp32 and int8, and their probabilities in plain
    onnxruntime on the eval feeds: onnxruntime-web must load both files and give the same."""
    import onnxruntime
    from safetensors.numpy import load_file

    xe = load_file(out / "feeds.safetensors")["xe"]
    probabilities = {}
    for quantize in ("none", "int8"):
        path = out / f"exported_{quantize}.onnx"
        export_device_model(model, path, quantize, data)
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        probabilities[quantize] = session.run(["probabilities"], {"input": xe})[0]
    probabilities["engine"] = model.engine.predict(xe)
    save_file(probabilities, out / "exported_expected.safetensors")
    # the page writes the fp32 file itself: the same bytes for the same tensors, given Python's description
    results["exported"] = {
        "description": model.description,
        "trained": model.trained,
        "last_completed_round": model.last_completed_round,
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
    folder = out / "images" / "0"
    folder.mkdir(parents=True, exist_ok=True)
    sizes = {"a_large.png": (45, 37), "b_small.png": (11, 9)}  # (width, height)
    for name, (w, h) in sizes.items():
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / name)
    pixels, _ = read_image_folder(out / "images", manifest.input.shape, manifest.class_labels)
    grey_spec = InputSpec(shape=(1, 20, 20), mean=(0.5,), std=(0.25,))
    grey = np.stack(
        [resize_image(np.asarray(Image.open(folder / name).convert("L"))[..., None], 20, 20) for name in sorted(sizes)]
    )
    save_file(
        {
            "rgb_pixels": np.ascontiguousarray(pixels.transpose(0, 3, 1, 2)),
            "rgb_input": manifest.kind.normalize(pixels),
            "grey_pixels": np.ascontiguousarray(grey.transpose(0, 3, 1, 2)),
            "grey_input": ImageKind(input=grey_spec).normalize(grey),
        },
        out / "images_expected.safetensors",
    )
    results["images"] = {"files": [f"images/0/{name}" for name in sorted(sizes)], "grey_spec": vars(grey_spec)}
    write_photo_predictions(out, manifest, results)


def write_photo_predictions(out: Path, manifest, results: dict) -> None:
    """`device predict`'s probabilities for the PNGs with the round's model (after its statistics were recomputed):
    the page's "Try it" reads the same files and must give the same numbers."""
    from safetensors.numpy import load_file

    from edgepfl.device_runtime.predict import predict_inputs

    engine = PortableEngine(out / "bundle", manifest)
    engine.set_tensors(load_file(out / "recomputed.safetensors"))
    files = [out / name for name in results["images"]["files"]]
    names, probabilities = predict_inputs(files, engine)
    assert names == [str(f) for f in files]
    save_file({"probabilities": probabilities}, out / "photos_predicted.safetensors")


def write_folders(out: Path, manifest, results: dict) -> None:
    """Image folders, each read by the Python loader: its labels and pixels, or its one-line refusal.

    The Node test hands the same files to the page's readFolder (as the browser lists them: files only, paths
    from the chosen folder's name) and must get the same labels and pixels, or the same line.
    """
    tensors, cases = {}, []
    for case, (shape, names, tree) in FOLDER_CASES.items():
        classes = len(names) if names else 10
        spec = replace(manifest, kind=ImageKind(input=InputSpec(shape=shape)), num_classes=classes, class_names=names)
        root = out / "folders" / case / ("café" if case == "unicode" else "photos")
        for relative, content in tree.items():
            path = root / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content if isinstance(content, bytes) else _png(*content))
        entry: dict = {"case": case, "shape": list(shape), "class_names": list(names), "num_classes": spec.num_classes}
        entry["files"] = sorted(str(p.relative_to(out)) for p in root.rglob("*") if p.is_file())
        try:
            pixels, labels = read_image_folder(root, shape, spec.class_labels)
        except DataError as refused:
            entry["refused"] = {"problem": refused.problem, "fix": refused.fix}
        else:
            entry["labels"] = labels.tolist()
            tensors[case] = np.ascontiguousarray(pixels.transpose(0, 3, 1, 2))
        cases.append(entry)
    save_file(tensors, out / "folders_expected.safetensors")
    results["folders"] = cases


def _png(mode: str, width: int, height: int, seed: int) -> bytes:
    """A PNG of random pixels in a Pillow mode (L, LA, RGB, RGBA, P, 1)."""
    import io

    from PIL import Image

    rng = np.random.default_rng(seed)
    rgb = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    image = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=16) if mode == "P" else rgb.convert(mode)
    if mode in ("LA", "RGBA"):
        image.putalpha(255)  # opaque: the browser's canvas keeps colours exact only where alpha is 255
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


NAMES = ("cat", "dog", "bird")
GREY, COLOUR = (1, 12, 12), (3, 12, 12)
# case: (model input shape, class names, {path inside the folder: (PNG mode, width, height, seed) or bytes})
FOLDER_CASES = {
    # the trial's folder: classes named 3, 5 and 7 of a 10-class model are classes 3, 5 and 7, not 0, 1 and 2
    "numbers": (GREY, (), {"3/a.png": ("L", 9, 14, 1), "5/b.png": ("L", 16, 16, 2), "7/c.png": ("L", 12, 12, 3)}),
    "names": (
        COLOUR,
        NAMES,
        {"bird/1.png": ("RGB", 20, 10, 4), "cat/2.png": ("RGB", 7, 7, 5), "cat/3.png": ("RGB", 30, 3, 6)},
    ),
    # hidden entries and other files are ignored; grey, palette, bilevel and grey+alpha images become colour
    "ignored": (
        COLOUR,
        (),
        {
            "0/a.png": ("L", 13, 11, 7),
            "0/b.png": ("P", 10, 10, 8),
            "0/notes.txt": b"not an image",
            "1/c.png": ("1", 8, 8, 9),
            "1/d.png": ("LA", 15, 9, 10),
            "readme.md": b"# photos",
            ".git/x.png": ("RGB", 4, 4, 11),
            "1/.hidden.png": ("RGB", 4, 4, 12),
            ".DS_Store": b"\0",
        },
    ),
    # colour images for a grey model: Pillow's 'L' formula
    "colour_to_grey": (
        GREY,
        (),
        {"2/a.png": ("RGB", 14, 14, 13), "2/b.png": ("RGBA", 9, 9, 14), "0/c.png": ("P", 6, 6, 15)},
    ),
    "unicode": (GREY, ("café", "thé"), {"cafe\u0301/a.png": ("L", 12, 12, 16)}),  # a macOS (NFD) folder name
    "unknown_folder": (GREY, (), {"0/a.png": ("L", 12, 12, 17), "cats/b.png": ("L", 12, 12, 18)}),
    "numbers_with_names": (GREY, NAMES, {"0/a.png": ("L", 12, 12, 19)}),
    "index_out_of_range": (GREY, (), {"10/a.png": ("L", 12, 12, 20)}),
    "no_images_in_class": (GREY, NAMES, {"cat/a.png": ("L", 12, 12, 21), "dog/a.heic": b"heic", "dog/b.txt": b"x"}),
    "image_outside": (GREY, (), {"0/a.png": ("L", 12, 12, 22), "stray.jpg": ("L", 12, 12, 23)}),
    "image_nested": (GREY, (), {"0/a.png": ("L", 12, 12, 24), "0/2024/b.png": ("L", 12, 12, 25)}),
    "no_images": (GREY, (), {"readme.md": b"# nothing yet"}),
    "four_channels": ((4, 12, 12), (), {"0/a.png": ("RGBA", 12, 12, 26)}),
    "unreadable": (GREY, (), {"0/a.png": ("L", 12, 12, 27), "0/b.png": b"not a png"}),
}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_fixtures.py OUT_DIR")
    main(Path(sys.argv[1]))
