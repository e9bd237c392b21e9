"""The device runtime in one process: phases of each client algorithm, data checks, the state folder, network faults."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pytest
from typer.testing import CliRunner

from edgepfl.data import LocalData, iterate_batches, load_device_data, make_local_data, split_train_val
from edgepfl.device_runtime.algorithms import Phase, round_phases, run_client_round, train_phase
from edgepfl.device_runtime.cli import device_app
from edgepfl.device_runtime.client import RetryPolicy, RoundGone, ServerClient, ServerRefused, ServerUnreachable
from edgepfl.device_runtime.engine import open_engine
from edgepfl.device_runtime.options import DeviceOptions
from edgepfl.device_runtime.runner import DeviceEvents, run_device
from edgepfl.device_runtime.state import StateFolder
from edgepfl.errors import BundleError, DataError, StateError, UsageError
from edgepfl.kinds import ImageKind, InputSpec
from edgepfl.kinds.pictures import read_image_folder
from edgepfl.manifest import Manifest, load_manifest
from edgepfl.protocol import RoundSettings, Task, UploadMeta
from edgepfl.wire import decode_metadata, decode_tensors, encode_tensors

ENGINES = ("ort-training", "portable")
NUM_CLASSES = 4
SIDE = 8  # the tiny mlp takes 8x8 grey images
# the one bundle the device tests use; scripts/device-env.sh exports it for the environment without torch
DEVICE_BUNDLE = {"name": "mlp", "kp": 1, "engines": ENGINES, "seed": 0, "input_size": SIDE, "num_classes": NUM_CLASSES}


# a BatchNorm model for the phase tests: the cnn (its smallest input, 28x28) on grey images like the mlp's
BN_BUNDLE = {**DEVICE_BUNDLE, "name": "cnn", "input_size": 28, "in_channels": 1, "norm": "batch"}


@pytest.fixture(scope="session")
def bn_bundle(bundle_factory) -> Path:
    """The tiny cnn with BatchNorm (kp=1: the classifier is personal) with both engines' artifacts."""
    return bundle_factory(**BN_BUNDLE)


@pytest.fixture(scope="session")
def mlp_bundle(bundle_factory) -> Path:
    """A tiny mlp (hidden block = base, classifier = personal) with both engines' artifacts."""
    return bundle_factory(**DEVICE_BUNDLE)


def class_images(
    labels: np.ndarray, seed: int = 0, noise: float = 40.0, channels: int = 1, side: int = SIDE
) -> np.ndarray:
    """uint8 NHWC images: one fixed random prototype per class plus seeded noise, so a small model can learn them."""
    prototypes = np.random.default_rng(1234).integers(0, 256, (NUM_CLASSES, side, side, channels))
    rng = np.random.default_rng(seed)
    images = prototypes[labels] + rng.normal(0.0, noise, (len(labels), side, side, channels))
    return np.clip(images, 0, 255).astype(np.uint8)


def save_npz(path: Path, classes: tuple[int, ...], count: int, seed: int = 0) -> Path:
    """An .npz of `count` images drawn from `classes`."""
    labels = np.random.default_rng(seed).choice(np.asarray(classes), count)
    np.savez(path, x=class_images(labels, seed), y=labels)
    return path


def local_data(manifest: Manifest, count: int = 96, seed: int = 0) -> LocalData:
    labels = np.arange(count) % NUM_CLASSES
    images = class_images(labels, seed, side=manifest.model["input_size"])
    return make_local_data(images, labels, manifest, 0.25, seed)


def changed(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> set[str]:
    return {name for name in before if not np.array_equal(before[name], after[name])}


# client algorithms: which tensors each phase moves


@pytest.mark.parametrize("engine_name", ENGINES)
def test_fedalt_freezes_base_then_personal(mlp_bundle, engine_name):
    engine = open_engine(mlp_bundle, engine_name)
    manifest = engine.manifest
    base, personal = set(manifest.names("base")), set(manifest.names("personal"))
    snapshots: dict[str, list[dict[str, np.ndarray]]] = {}

    def progress(phase: str, done: int, total: int, loss: float) -> None:
        snapshots.setdefault(phase, []).append(engine.get_tensors())

    start = engine.get_tensors()
    settings = RoundSettings(algorithm="fedalt", epochs=1, personal_epochs=1, batch_size=16, lr=0.1)
    result = run_client_round(engine, settings, local_data(manifest), seed=0, round_id=1, progress=progress)
    assert [p.name for p in result.phases] == ["personal", "base"] and result.uploads
    end_of_personal = snapshots["personal"][-1]
    assert changed(start, end_of_personal) == personal  # first phase: base bit-identical
    assert changed(end_of_personal, snapshots["base"][-1]) == base  # second phase: personal bit-identical
    assert all(changed(start, snap) <= personal for snap in snapshots["personal"])


@pytest.mark.parametrize("engine_name", ENGINES)
def test_fedalt_phases_on_a_batchnorm_model(bn_bundle, engine_name):
    """Parameters follow the phases; BatchNorm statistics move in both (training-mode forward passes, as in torch)."""
    engine = open_engine(bn_bundle, engine_name)
    manifest = engine.manifest
    base, personal = set(manifest.names("base")), set(manifest.names("personal"))
    stats = {name for name in manifest.names("buffer") if not name.endswith("num_batches_tracked")}
    assert stats, "the cnn with norm=batch has BatchNorm running statistics"
    snapshots: dict[str, list[dict[str, np.ndarray]]] = {}

    def progress(phase: str, done: int, total: int, loss: float) -> None:
        snapshots.setdefault(phase, []).append(engine.get_tensors())

    start = engine.get_tensors()
    settings = RoundSettings(algorithm="fedalt", epochs=1, personal_epochs=1, batch_size=16, lr=0.1)
    run_client_round(engine, settings, local_data(manifest), seed=0, round_id=1, progress=progress)
    end_of_personal, end = snapshots["personal"][-1], snapshots["base"][-1]
    assert changed(start, end_of_personal) & (base | personal) == personal  # base parameters bit-identical
    moved = changed(end_of_personal, end) & (base | personal)
    assert moved <= base  # personal parameters bit-identical
    # a convolution bias followed by BatchNorm has zero gradient (the normalisation removes it): only weights move
    assert {name for name in base if name.endswith("weight")} <= moved
    assert stats <= changed(start, end_of_personal) and stats <= changed(end_of_personal, end)


def test_both_engines_agree_on_a_batchnorm_round(bn_bundle):
    manifest = load_manifest(bn_bundle)
    settings = RoundSettings(algorithm="fedsim", finetune_epochs=1, batch_size=16, lr=0.1)
    tensors = []
    for name in ENGINES:
        engine = open_engine(bn_bundle, name)
        run_client_round(engine, settings, local_data(manifest), seed=3, round_id=2)
        tensors.append(engine.get_tensors())
    for name in tensors[0]:
        np.testing.assert_allclose(tensors[0][name], tensors[1][name], rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("engine_name", ENGINES)
def test_fedsim_moves_everything_and_finetuning_freezes_base(mlp_bundle, engine_name):
    engine = open_engine(mlp_bundle, engine_name)
    manifest = engine.manifest
    snapshots: dict[str, list[dict[str, np.ndarray]]] = {}
    start = engine.get_tensors()
    settings = RoundSettings(algorithm="fedsim", epochs=1, finetune_epochs=1, batch_size=16, lr=0.1)
    result = run_client_round(
        engine,
        settings,
        local_data(manifest),
        seed=0,
        round_id=1,
        progress=lambda phase, *_: snapshots.setdefault(phase, []).append(engine.get_tensors()),
    )
    assert [p.name for p in result.phases] == ["finetune", "joint"]
    assert changed(start, snapshots["finetune"][-1]) == set(manifest.names("personal"))
    assert changed(snapshots["finetune"][-1], snapshots["joint"][-1]) == set(manifest.names("base")) | set(
        manifest.names("personal")
    )
    assert result.phases[0].steps == result.phases[1].steps == 5  # 72 training samples, batch 16


@pytest.mark.parametrize("engine_name", ENGINES)
def test_local_trains_personal_only_and_never_uploads(mlp_bundle, engine_name):
    engine = open_engine(mlp_bundle, engine_name)
    start = engine.get_tensors()
    result = run_client_round(
        engine, RoundSettings(algorithm="local", epochs=2, batch_size=16), local_data(engine.manifest), 0, 1
    )
    assert not result.uploads and [p.steps for p in result.phases] == [10]
    assert changed(start, engine.get_tensors()) == set(engine.manifest.names("personal"))


def test_phases_drop_what_the_bundle_lacks():
    fedalt = RoundSettings(algorithm="fedalt", finetune_epochs=2, personal_epochs=1, epochs=3)
    assert [(p.name, p.trainable, p.epochs) for p in round_phases(fedalt, ("full", "personal", "base"))] == [
        ("finetune", "personal", 2),
        ("personal", "personal", 1),
        ("base", "base", 3),
    ]
    # kp=0 (FedAvg): no personal set, so no fine-tuning and no personal phase
    assert [p.name for p in round_phases(fedalt, ("full", "base"))] == ["base"]
    assert [p.trainable for p in round_phases(RoundSettings(finetune_epochs=1), ("full", "base"))] == ["full"]
    with pytest.raises(UsageError, match="local algorithm"):
        round_phases(RoundSettings(algorithm="local"), ("full", "base"))
    with pytest.raises(UsageError, match="unknown client algorithm"):  # settings made without their model's check
        round_phases(RoundSettings.model_construct(algorithm="fedprox"), ("full",))


def test_both_engines_agree_on_a_seeded_round(mlp_bundle):
    manifest = load_manifest(mlp_bundle)
    data = local_data(manifest)
    settings = RoundSettings(algorithm="fedalt", finetune_epochs=1, batch_size=16, lr=0.1)
    results, tensors = [], []
    for name in ENGINES:
        engine = open_engine(mlp_bundle, name)
        results.append(run_client_round(engine, settings, data, seed=3, round_id=2))
        tensors.append(engine.get_tensors())
    for name in tensors[0]:
        np.testing.assert_allclose(tensors[0][name], tensors[1][name], rtol=0, atol=1e-5, err_msg=name)
    assert results[0].val_accuracy == results[1].val_accuracy
    assert results[0].train_loss == pytest.approx(results[1].train_loss, rel=1e-5)


# data on the device


def test_split_and_shuffling_are_seeded():
    train, val = split_train_val(50, 0.2, seed=7)
    again = split_train_val(50, 0.2, seed=7)
    assert np.array_equal(train, again[0]) and np.array_equal(val, again[1])
    assert len(val) == 10 and sorted(np.concatenate([train, val]).tolist()) == list(range(50))
    assert not np.array_equal(val, split_train_val(50, 0.2, seed=8)[1])
    epoch0 = np.concatenate(list(iterate_batches(37, 8, seed=1, epoch=0)))
    assert sorted(epoch0.tolist()) == list(range(37))
    assert np.array_equal(epoch0, np.concatenate(list(iterate_batches(37, 8, seed=1, epoch=0))))
    assert not np.array_equal(epoch0, np.concatenate(list(iterate_batches(37, 8, seed=1, epoch=1))))
    assert not np.array_equal(epoch0, np.concatenate(list(iterate_batches(37, 8, seed=2, epoch=0))))
    assert [len(b) for b in iterate_batches(37, 8, 1, 0)] == [8, 8, 8, 8, 5]


def test_npz_layouts_and_dtypes_normalise_alike(mlp_bundle, tmp_path):
    manifest = load_manifest(mlp_bundle)
    labels = np.arange(20) % NUM_CLASSES
    nhwc = class_images(labels)
    np.savez(tmp_path / "nhwc.npz", x=nhwc, y=labels)
    np.savez(tmp_path / "nchw.npz", x=nhwc.transpose(0, 3, 1, 2).astype(np.float32) / 255, y=labels.astype(np.uint8))
    first = load_device_data(tmp_path / "nhwc.npz", manifest, 0.2, seed=0)
    second = load_device_data(tmp_path / "nchw.npz", manifest, 0.2, seed=0)
    assert first.images.dtype == np.uint8 and first.num_train == 16 and first.num_val == 4
    (x1, y1), (x2, y2) = next(first.train_batches(8, 0, 0)), next(second.train_batches(8, 0, 0))
    assert x1.shape == (8, 1, SIDE, SIDE) and x1.dtype == np.float32
    np.testing.assert_allclose(x1, x2, atol=1e-5)
    assert np.array_equal(y1, y2)
    mean, std = manifest.input.mean[0], manifest.input.std[0]
    raw = nhwc[first.train_index[next(iterate_batches(16, 8, 0, 0))[0]], :, :, 0]
    np.testing.assert_allclose(x1[0, 0], (raw / 255 - mean) / std, atol=1e-5)


def test_image_folder_classes_by_name_not_position(mlp_bundle, tmp_path):
    """Folders 1 and 3 are classes 1 and 3 (the page once made them 0 and 1); the page agrees (folder.test.mjs)."""
    from PIL import Image

    labels = np.array([1, 1, 3, 3, 3])
    for index, (label, pixels) in enumerate(zip(labels, class_images(labels))):
        folder = tmp_path / "images" / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels[:, :, 0], mode="L").save(folder / f"{index}.png")
    (tmp_path / "images" / "1" / "notes.txt").write_text("not an image: ignored")
    data = load_device_data(tmp_path / "images", load_manifest(mlp_bundle), 0.0, seed=0)
    assert data.labels.tolist() == [1, 1, 3, 3, 3] and np.array_equal(data.images[:, 0], class_images(labels)[..., 0])
    named = replace(load_manifest(mlp_bundle), class_names=("cat", "dog", "bird", "fish"))
    with pytest.raises(DataError, match="folder images/1 is not named as a class") as refused:
        read_image_folder(tmp_path / "images", named.input.shape, named.class_labels)
    assert refused.value.fix == "name each class folder exactly as its class: cat, dog, bird, fish"
    (tmp_path / "images" / "1").rename(tmp_path / "images" / "dog")
    (tmp_path / "images" / "3").rename(tmp_path / "images" / "fish")
    assert read_image_folder(tmp_path / "images", named.input.shape, named.class_labels)[1].tolist() == [1, 1, 3, 3, 3]


def test_grey_and_colour_images_are_converted_as_pillow_does(mlp_bundle, tmp_path):
    from PIL import Image

    colour = np.random.default_rng(0).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
    _write_png(tmp_path / "images" / "0" / "a.png", SIDE, "RGB", colour)
    grey = load_manifest(mlp_bundle)
    pixels, _ = read_image_folder(tmp_path / "images", grey.input.shape, grey.class_labels)  # a grey model
    assert np.array_equal(pixels[0, :, :, 0], np.asarray(Image.fromarray(colour).convert("L")))
    rgb = replace(load_manifest(mlp_bundle), kind=ImageKind(input=InputSpec(shape=(3, SIDE, SIDE))))
    _write_png(tmp_path / "grey" / "2" / "a.png", SIDE, "L", colour[:, :, 0])
    pixels, _ = read_image_folder(tmp_path / "grey", rgb.input.shape, rgb.class_labels)
    assert np.array_equal(pixels[0], np.repeat(colour[:, :, :1], 3, axis=2))


def _write_png(path: Path, size: int, mode: str, pixels: np.ndarray | None = None) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    (Image.new(mode, (size, size)) if pixels is None else Image.fromarray(pixels)).save(path)


def _unknown_class_folder(folder: Path) -> None:
    _write_png(folder / "0" / "1.png", SIDE, "L")
    _write_png(folder / "cat" / "1.png", SIDE, "L")


def _class_folder_without_images(folder: Path) -> None:
    _write_png(folder / "0" / "1.png", SIDE, "L")
    (folder / "1").mkdir()
    (folder / "1" / "photo.heic").write_bytes(b"not one of the image types")


def _label_out_of_range(folder: Path) -> None:
    labels = np.array([0, 1, NUM_CLASSES])
    np.savez(folder / "data.npz", x=class_images(labels % NUM_CLASSES), y=labels)


def _npz_channels(folder: Path) -> None:
    labels = np.array([0, 1, 2])
    np.savez(folder / "data.npz", x=class_images(labels, channels=3), y=labels)


def _npz_size(folder: Path) -> None:
    np.savez(folder / "data.npz", x=np.zeros((3, 10, 10, 1), np.uint8), y=np.array([0, 1, 2]))


@pytest.mark.parametrize(
    "make_data, message",
    [
        (_unknown_class_folder, "folder data/cat is not named as a class of this model"),
        (_class_folder_without_images, "class folder data/1 holds no images"),
        (_label_out_of_range, f"= {NUM_CLASSES} is not a class of this model (0..{NUM_CLASSES - 1})"),
        (_npz_channels, "has 3 channel(s) per image, the model takes 1"),
        (_npz_size, f"images are 10x10, the model takes {SIDE}x{SIDE}"),
    ],
)
def test_data_mismatch_is_one_line_before_training(mlp_bundle, tmp_path, make_data, message):
    folder = tmp_path / "data"
    folder.mkdir()
    make_data(folder)
    path = folder / "data.npz" if (folder / "data.npz").exists() else folder
    with pytest.raises(DataError) as caught:
        load_device_data(path, load_manifest(mlp_bundle), 0.2, 0)
    assert message in caught.value.problem and caught.value.fix
    state = tmp_path / "state"
    result = CliRunner().invoke(
        device_app, ["train", "--bundle", str(mlp_bundle), "--data", str(path), "--state", str(state)]
    )
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
    assert "Traceback" not in result.output and not (state / "state.json").exists()  # nothing trained or saved


# the state folder


def test_state_commit_is_atomic_and_restores(mlp_bundle, tmp_path):
    manifest = load_manifest(mlp_bundle)
    engine = open_engine(mlp_bundle, "portable")
    state = StateFolder(tmp_path / "state", manifest, engine.name)
    assert state.load_tensors() is None
    (tmp_path / "state" / ".tensors-000009.safetensors.tmp").write_bytes(b"half")  # a crash's leftover
    payload = encode_tensors(engine.tensors_by_role("base"))
    state.commit(engine.get_tensors(), {"round": 3, "val_accuracy": math.nan}, round_id=3, upload_payload=payload)
    assert state.pending_payload() == payload
    state.settle_upload(3, delivered=True)
    state.close()
    reopened = StateFolder(tmp_path / "state", manifest, engine.name)
    saved = json.loads((tmp_path / "state" / "state.json").read_text())
    assert saved["last_completed_round"] == 3 and saved["last_uploaded_round"] == 3
    assert saved["pending_upload"] is None and saved["history"][-1]["upload"] == "delivered"
    assert saved["history"][-1]["val_accuracy"] is None  # NaN is written as null
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == [".lock", "state.json", saved["tensors_file"]]
    restored = reopened.load_tensors()
    assert restored is not None and not changed(engine.get_tensors(), restored)
    with pytest.raises(StateError, match="another edgepfl device process"):
        StateFolder(tmp_path / "state", manifest, engine.name)
    reopened.close()


def test_state_of_another_layout_is_refused(mlp_bundle, tmp_path):
    manifest = load_manifest(mlp_bundle)
    state_dir = tmp_path / "state"
    StateFolder(state_dir, manifest, "portable").close()
    assert not (state_dir / "state.json").exists()  # a fresh folder holds nothing until the first commit
    state = StateFolder(state_dir, manifest, "portable")
    state.commit(open_engine(mlp_bundle, "portable").get_tensors(), {"note": "first"})
    state.close()
    saved = json.loads((state_dir / "state.json").read_text())
    (state_dir / "state.json").write_text(json.dumps({**saved, "base_layout_hash": "f" * 64}))
    with pytest.raises(StateError, match="belongs to a bundle with base_layout_hash ffffffffffff"):
        StateFolder(state_dir, manifest, "portable")
    result = CliRunner().invoke(
        device_app,
        [
            "eval",
            "--bundle",
            str(mlp_bundle),
            "--data",
            str(save_npz(tmp_path / "d.npz", (0, 1), 20)),
            "--state",
            str(state_dir),
        ],
    )
    assert result.exit_code == 2 and result.output.count("\n") == 1
    assert "pass the bundle this state was made with, or a new --state folder" in result.output


# network faults, against a scripted server (httpx.MockTransport)


class ScriptedServer:
    """The /v1 protocol for one device: rounds 1..rounds, then done; `faults` are answered first, per path."""

    def __init__(self, manifest: Manifest, base: dict[str, np.ndarray], rounds: int = 2):
        self.manifest, self.base, self.rounds = manifest, base, rounds
        self.round_id = 1
        self.faults: dict[str, list] = {}
        self.calls: list[tuple[str, str]] = []
        self.uploads: list[tuple[int, bytes]] = []
        self.metrics: list[tuple[int, dict]] = []

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.calls.append((request.method, path))
        pending = self.faults.get(path)
        if pending:
            fault = pending.pop(0)
            if isinstance(fault, Exception):
                raise fault
            return fault
        done = self.round_id > self.rounds
        if path == "/v1/task":
            task = Task(
                "done" if done else "train",
                self.manifest.base_layout_hash,
                round_id=self.rounds if done else self.round_id,
                settings=None if done else RoundSettings(batch_size=16, lr=0.1),
                base_url=f"/v1/rounds/{self.rounds if done else self.round_id}/base",
            )
            return httpx.Response(200, json=task.to_json())
        if path.endswith("/base"):
            return httpx.Response(200, content=encode_tensors(self.base))
        if path.endswith("/update"):
            round_id = int(path.split("/")[3])
            self.uploads.append((round_id, request.content))
            self.round_id += 1
            return httpx.Response(200, json={"accepted": True})
        if path.endswith("/metrics"):
            self.metrics.append((int(path.split("/")[3]), json.loads(request.content)))
            return httpx.Response(200, json={"accepted": True})
        return httpx.Response(404, json={"error": "not_found", "detail": path, "fix": ""})


def refusal(status: int, error: str, fix: str) -> httpx.Response:
    return httpx.Response(status, json={"error": error, "detail": f"the server says {error}", "fix": fix})


def test_connection_errors_and_5xx_are_retried_with_backoff():
    sleeps: list[float] = []
    calls = []

    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) <= 2:
            raise httpx.ConnectError("connection refused", request=request)
        if len(calls) == 3:
            return httpx.Response(503, json={"error": "server_error", "detail": "busy", "fix": ""})
        if len(calls) == 4:
            return httpx.Response(502, text="bad gateway", headers={"Retry-After": "7"})
        return httpx.Response(200, json=Task("wait", "h", retry_after=1.0).to_json())

    retried: list[str] = []
    client = ServerClient(
        "http://device.test",
        "t",
        RetryPolicy(attempts=6, first_delay=0.5),
        transport=httpx.MockTransport(handle),
        sleep=sleeps.append,
        on_retry=retried.append,
    )
    assert client.task().action == "wait" and len(calls) == 5
    assert len(sleeps) == 4 and len(retried) == 4
    for attempt, delay in enumerate(sleeps[:3]):  # exponential, with jitter in [1/2, 1] of the nominal delay
        assert 0.5 * 2**attempt * 0.5 <= delay <= 0.5 * 2**attempt
    assert sleeps[3] == 7.0  # the server's Retry-After wins
    assert "ConnectError" in retried[0] and "HTTP 503" in retried[2]
    assert all(call.headers["authorization"] == "Bearer t" for call in calls)


def test_unreachable_server_gives_up_with_one_line():
    sleeps: list[float] = []

    def handle(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectTimeout("timed out", request=request)

    client = ServerClient(
        "http://device.test", "t", RetryPolicy(attempts=3), transport=httpx.MockTransport(handle), sleep=sleeps.append
    )
    with pytest.raises(ServerUnreachable) as caught:
        client.task()
    assert len(sleeps) == 2 and "failed 3 times (last: ConnectTimeout: timed out)" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_4xx_is_reported_once_with_the_servers_fix():
    calls = []

    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return refusal(401, "bad_token", "ask the operator for a token: edgepfl serve tokens add NAME")

    client = ServerClient("http://device.test", "t", transport=httpx.MockTransport(handle), sleep=pytest.fail)
    with pytest.raises(ServerRefused) as caught:
        client.task()
    assert len(calls) == 1 and caught.value.status == 401 and caught.value.error == "bad_token"
    assert not isinstance(caught.value, RoundGone)
    assert str(caught.value).endswith("(ask the operator for a token: edgepfl serve tokens add NAME)")


def _open_device(mlp_bundle: Path, tmp_path: Path, server_rounds: int = 2):
    engine = open_engine(mlp_bundle, "portable")
    data = local_data(engine.manifest)
    state = StateFolder(tmp_path / "state", engine.manifest, engine.name)
    server = ScriptedServer(engine.manifest, engine.tensors_by_role("base"), rounds=server_rounds)
    return engine, data, state, server


def test_round_closed_while_training_is_dropped_and_the_device_rejoins(mlp_bundle, tmp_path):
    engine, data, state, server = _open_device(mlp_bundle, tmp_path)
    initial_personal = engine.tensors_by_role("personal")

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/rounds/1/update":
            server.calls.append(("POST", request.url.path))
            server.round_id = 2  # the server moved on while this device trained round 1
            return refusal(409, "round_closed", "poll /v1/task for the current round")
        return server.handle(request)

    client = ServerClient("http://device.test", "t", transport=httpx.MockTransport(handle), sleep=pytest.fail)
    messages: list[str] = []

    class Recorder(DeviceEvents):
        def message(self, text: str) -> None:
            messages.append(text)

    summary = run_device(engine, data, state, client, DeviceOptions(poll_interval=0.01), Recorder(), sleep=pytest.fail)
    assert summary.rounds_trained == 2 and summary.finished
    assert [round_id for round_id, _ in server.uploads] == [2]  # round 1's update was refused once, not resent
    assert server.calls.count(("POST", "/v1/rounds/1/update")) == 1
    assert any("round 1 closed before its update arrived (round_closed)" in m for m in messages)
    history = state.state.history
    assert [(h.get("round"), h.get("upload")) for h in history if not h.get("final")] == [
        (1, "dropped"),
        (2, "delivered"),
    ]
    assert state.state.pending_upload is None and state.state.last_uploaded_round == 2
    assert [round_id for round_id, _ in server.metrics] == [2]
    assert changed(initial_personal, engine.tensors_by_role("personal"))  # the personal part kept training


def test_uploads_carry_only_the_base_the_layout_hash_and_the_sample_count(mlp_bundle, tmp_path):
    engine, data, state, server = _open_device(mlp_bundle, tmp_path, server_rounds=1)
    client = ServerClient("http://device.test", "t", transport=server.transport(), sleep=pytest.fail)
    summary = run_device(engine, data, state, client, DeviceOptions(), sleep=pytest.fail)
    assert summary.finished and summary.rounds_trained == 1 and summary.final_accuracy is not None
    ((round_id, body),) = server.uploads
    assert sorted(decode_tensors(body)) == sorted(engine.manifest.names("base"))
    meta = UploadMeta.from_metadata(decode_metadata(body))
    assert meta.base_layout_hash == engine.manifest.base_layout_hash and meta.num_samples == data.num_train == 72
    assert 0.0 <= meta.val_accuracy <= 1.0 and math.isfinite(meta.train_loss)
    assert summary.bytes_sent >= len(body)


def test_a_server_with_another_layout_is_refused(mlp_bundle, tmp_path):
    engine, data, state, server = _open_device(mlp_bundle, tmp_path)
    server.manifest = type("Other", (), {"base_layout_hash": "0" * 64})()
    client = ServerClient("http://device.test", "t", transport=server.transport(), sleep=pytest.fail)
    with pytest.raises(BundleError, match="the server trains a base with layout 000000000000"):
        run_device(engine, data, state, client, DeviceOptions())
    assert state.state.last_completed_round is None and not server.uploads


def test_train_phase_refuses_a_set_the_bundle_lacks(mlp_bundle):
    engine = open_engine(mlp_bundle, "portable")
    manifest = engine.manifest
    data = local_data(manifest)
    with pytest.raises(UsageError, match="no 'head' trainable set"):
        train_phase(engine, data, Phase("x", "head", 1, 0.1), 16, 0)
