"""A device's own text and sensor data (`device train/run --data`), the token and sensor sample checks, and FedAlt's
next-word metric mask with the 10th percentile in simulate's results."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import run_without_torch

from edgepfl.data import check_samples, load_device_data, make_local_data, metric_description, scored
from edgepfl.errors import BundleError, DataError
from edgepfl.kinds import NextWordKind, SensorKind
from edgepfl.manifest import Manifest
from edgepfl.simulate.results import accuracy_summary
from edgepfl.text import EOS_ID, OOV_ID, PAD_ID, Vocabulary, write_vocabulary

CHANNELS = ("acc-x", "acc-y", "acc-z")
WINDOW = 8
NOTES = "\n".join(["see you at the station tomorrow", "the train is late again", "see you at home"] * 3) + "\n"


def _text_bundle(tmp_path, seq_len: int = 4):
    vocabulary = Vocabulary.from_texts([NOTES], size=8)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    write_vocabulary(bundle, vocabulary)
    manifest = Manifest(
        model={},
        kind=NextWordKind.from_vocabulary(vocabulary, seq_len),
        num_classes=len(vocabulary),
        kp=0,
        blocks=(),
        tensors=(),
    )
    return bundle, manifest, vocabulary


def _sensor_manifest() -> Manifest:
    return Manifest(
        model={},
        kind=SensorKind.of(CHANNELS, WINDOW, 50, mean=(0, 1, 2), std=(1, 2, 4)),
        num_classes=2,
        kp=0,
        blocks=(),
        tensors=(),
        class_names=("still", "moving"),
    )


def test_a_text_file_trains_in_time_order_and_scores_only_words_that_count(tmp_path):
    bundle, manifest, vocabulary = _text_bundle(tmp_path)
    notes = tmp_path / "notes.txt"
    notes.write_text(NOTES, encoding="utf-8")
    data = load_device_data(notes, manifest, 0.25, seed=0, bundle=bundle)
    assert data.images.shape[1:] == (4,) and data.images.dtype == np.int64
    assert data.train_index.max() < data.val_index.min()  # the held-out part is the end of the text
    assert OOV_ID in data.labels[data.train_index[-len(data.val_index) :]] or OOV_ID in data.labels
    # each held-out sequence has a target the accuracy counts; its <pad> and <oov> positions weigh 0
    held = data.labels[data.val_index]
    assert (~np.isin(held, (PAD_ID, OOV_ID))).any(axis=1).all()
    weights = manifest.kind.target_weights(held, scoring=True)
    assert not weights[np.isin(held, (PAD_ID, OOV_ID))].any() and weights[~np.isin(held, (PAD_ID, OOV_ID))].all()
    assert EOS_ID in held
    x, y = next(data.train_batches(4, seed=0, epoch=0))
    assert x.dtype == np.int64 and x.shape == (4, 4) and y.dtype == np.int64 and y.shape == (4, 4)


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"caf\xe9\n", "is not UTF-8 text"),
        (b"", "holds no words"),
        (b"hello there\n", "only 2 word"),
    ],
)
def test_a_bad_text_file_gets_one_line(tmp_path, content, problem):
    bundle, manifest, _ = _text_bundle(tmp_path)
    notes = tmp_path / "notes.txt"
    notes.write_bytes(content)
    with pytest.raises(DataError, match=problem) as error:
        load_device_data(notes, manifest, 0.25, seed=0, bundle=bundle)
    assert "\n" not in str(error.value)


def test_a_vocabulary_that_is_not_the_bundles_is_refused(tmp_path):
    bundle, manifest, _ = _text_bundle(tmp_path)
    notes = tmp_path / "notes.txt"
    notes.write_text(NOTES, encoding="utf-8")
    write_vocabulary(bundle, Vocabulary.from_texts(["other words entirely"], size=8))
    with pytest.raises(BundleError, match="not the vocabulary this bundle was exported with"):
        load_device_data(notes, manifest, 0.25, seed=0, bundle=bundle)
    with pytest.raises(DataError, match="not a .txt file"):
        load_device_data(tmp_path / "bundle" / "vocab.json", manifest, 0.25, seed=0, bundle=bundle)


def _windows(count: int, seed: int = 0, channels: int = len(CHANNELS)) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(count, channels, WINDOW)).astype(np.float32)


def _with_nan(window: int) -> np.ndarray:
    x = _windows(3)
    x[window, 1, 4] = np.nan
    return x


def _set_cell(text: str, line: int, cell: int, value: str) -> str:
    lines = text.splitlines()
    cells = lines[line].split(",")
    cells[cell] = value
    lines[line] = ",".join(cells)
    return "\n".join(lines) + "\n"


def test_sensor_windows_from_npz_are_normalised_per_channel(tmp_path):
    manifest = _sensor_manifest()
    path = tmp_path / "walk.npz"
    x = _windows(10)
    np.savez(path, x=x, y=np.arange(10) % 2, channels=np.array(CHANNELS))
    data = load_device_data(path, manifest, 0.2, seed=0)
    assert data.num_train == 8 and data.num_val == 2
    batch = manifest.kind.normalize(x[:2])
    np.testing.assert_allclose(batch[:, 2], (x[:2, 2] - 2) / 4, rtol=1e-6)


def _csv(windows: np.ndarray, labels, channels=CHANNELS) -> str:
    lines = ["window,label," + ",".join(channels)]
    for number, (window, label) in enumerate(zip(windows, labels)):
        lines += [f"{number},{label}," + ",".join(f"{v:.6f}" for v in window[:, t]) for t in range(window.shape[1])]
    return "\n".join(lines) + "\n"


def test_a_sensor_csv_is_one_row_per_reading_with_named_channels_and_labels(tmp_path):
    manifest = _sensor_manifest()
    x = _windows(4, seed=1)
    path = tmp_path / "walk.csv"
    path.write_text(_csv(x, ["still", "moving", "1", "still"]), encoding="utf-8")
    data = load_device_data(path, manifest, 0.0, seed=0)
    np.testing.assert_allclose(data.images, x, atol=1e-6)
    assert data.labels.tolist() == [0, 1, 1, 0]


@pytest.mark.parametrize(
    ("arrays", "problem"),
    [
        ({"x": _windows(3)[:, :2], "y": [0, 1, 0], "channels": CHANNELS[:2]}, "lacks channel 'acc-z'"),
        ({"x": _windows(3), "y": [0, 1, 0], "channels": ("acc-x", "acc-z", "acc-y")}, "in another order"),
        ({"x": _windows(3, 0, 4), "y": [0, 1, 0], "channels": (*CHANNELS, "mag-z")}, "has channel 'mag-z'"),
        ({"x": _windows(3)[:, :, :5], "y": [0, 1, 0], "channels": CHANNELS}, "5 samples long, the model takes 8"),
        ({"x": _with_nan(1), "y": [0, 1, 0], "channels": CHANNELS}, "window 1 holds NaN"),
        ({"x": _windows(3), "y": [0, 1, 0]}, "has no array 'channels'"),
    ],
)
def test_bad_sensor_windows_get_one_line(tmp_path, arrays, problem):
    path = tmp_path / "bad.npz"
    np.savez(path, **{k: np.asarray(v) for k, v in arrays.items()})
    with pytest.raises(DataError, match=problem) as error:
        load_device_data(path, _sensor_manifest(), 0.2, seed=0)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda text: text.replace("window,label", "label,window"), "does not start with the header"),
        (lambda text: "\n".join(text.splitlines()[:-1]) + "\n", "window 1 has 7 readings, the model takes 8"),
        (lambda text: text.replace("1,moving", "1,running", 1), "window 1 has more than one label"),
        (lambda text: text.replace("moving", "running"), "label 'running'"),
        (lambda text: text.replace("acc-y", "gyro-y", 1), "lacks channel 'acc-y'"),
        (lambda text: _set_cell(text, 3, 2, "x"), "not a number"),
        (lambda text: _set_cell(text, 3, 2, "nan"), "window 0 holds NaN"),
    ],
)
def test_a_bad_sensor_csv_gets_one_line(tmp_path, edit, problem):
    path = tmp_path / "bad.csv"
    path.write_text(edit(_csv(_windows(2, seed=2), ["still", "moving"])), encoding="utf-8")
    with pytest.raises(DataError, match=problem):
        load_device_data(path, _sensor_manifest(), 0.0, seed=0)


def test_token_windows_are_checked_against_the_vocabulary(tmp_path):
    _, manifest, _ = _text_bundle(tmp_path)
    with pytest.raises(DataError, match="outside 0..11"):
        check_samples(np.full((2, 4), 12), np.zeros(2, int), manifest)
    with pytest.raises(DataError, match="windows of 4 token ids"):
        check_samples(np.zeros((2, 5), int), np.zeros(2, int), manifest)
    with pytest.raises(DataError, match="token ids are integers"):
        check_samples(np.zeros((2, 4)), np.zeros(2, int), manifest)


def test_the_metric_mask_comes_from_the_manifest(tmp_path):
    _, text_manifest, _ = _text_bundle(tmp_path)
    labels = np.array([PAD_ID, OOV_ID, EOS_ID, 5, OOV_ID, 6])
    assert scored(np.arange(6), labels, _sensor_manifest()).tolist() == list(range(6))  # no metric_ignores
    assert "<pad>, <oov> not counted" in metric_description(text_manifest)
    # a next-word sample (a target at every position) is held out when one of its targets counts
    sequences = np.array([[PAD_ID] * 4, [OOV_ID, PAD_ID, PAD_ID, PAD_ID], [5, EOS_ID, PAD_ID, PAD_ID]] * 2)
    assert scored(np.arange(6), sequences, text_manifest).tolist() == [2, 5]
    data = make_local_data(np.full((6, 4), 4, np.int64), sequences, text_manifest, 0.5, seed=0)
    assert set(data.val_index) <= {2, 5}


def test_accuracy_summary_reports_the_10th_percentile():
    summary = accuracy_summary([0.1 * k for k in range(11)] + [float("nan")])
    assert summary["p10"] == pytest.approx(0.1)
    assert summary["per_client"][-1] is None
    assert accuracy_summary([float("nan")])["p10"] is None


def test_a_device_reads_its_text_and_sensor_data_without_torch():
    code = """
import sys
import edgepfl.data, edgepfl.kinds, edgepfl.text
print("torch loaded:", "torch" in sys.modules and sys.modules["torch"] is not None)
"""
    result = run_without_torch(code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "torch loaded: False" in result.stdout
