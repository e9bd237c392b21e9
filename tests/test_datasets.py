"""Datasets from a local folder: .npz files, mnist.npz, CIFAR folders checked against md5 lists, never downloaded."""

from __future__ import annotations

import hashlib
import json
import pickle

import numpy as np
import pytest
from conftest import SHARED

from edgepfl.datasets.images import load_dataset, load_npz, read_checksums
from edgepfl.errors import DataError, UsageError


def write_npz(path, n_train=30, n_test=10, shape=(28, 28), classes=10, **overrides):
    rng = np.random.default_rng(0)
    arrays = {
        "x_train": rng.integers(0, 256, (n_train, *shape), dtype=np.uint8),
        "y_train": np.arange(n_train) % classes,
        "x_test": rng.integers(0, 256, (n_test, *shape), dtype=np.uint8),
        "y_test": np.arange(n_test) % classes,
    }
    arrays.update(overrides)
    np.savez(path, **{k: v for k, v in arrays.items() if v is not None})
    return arrays


def test_npz_dataset_and_train_test_index_space(tmp_path):
    arrays = write_npz(tmp_path / "digits.npz")
    data = load_dataset("digits.npz", tmp_path)
    assert (data.num_train, data.num_samples, data.num_classes) == (30, 40, 10)
    assert data.sample_shape == (1, 28, 28)
    assert np.array_equal(data.images([1, 31]), np.stack([arrays["x_train"][1], arrays["x_test"][1]]))
    assert data.targets([29, 30]).tolist() == [29 % 10, 0]
    assert data.labels.dtype == np.int64 and len(data.labels) == 40
    assert "not checked" in data.verified


def test_npz_colour_nchw_is_stored_nhwc(tmp_path):
    write_npz(tmp_path / "c.npz", shape=(3, 32, 32))
    data = load_npz(tmp_path / "c.npz")
    assert data.x_train.shape == (30, 32, 32, 3) and data.sample_shape == (3, 32, 32)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"y_test": None}, "lacks y_test"),
        ({"y_train": np.arange(29) % 10}, "30 images but y_train 29 labels"),
        ({"x_train": np.full((30, 28, 28), 300, dtype=np.int32)}, "uint8 pixels"),
        ({"y_train": -np.ones(30, dtype=np.int64)}, "negative labels"),
        ({"x_test": np.zeros((10, 27, 27), dtype=np.uint8)}, "differ from test images"),
    ],
)
def test_bad_npz_is_one_clear_error(tmp_path, overrides, message):
    write_npz(tmp_path / "bad.npz", **overrides)
    with pytest.raises(DataError, match=message) as caught:
        load_npz(tmp_path / "bad.npz")
    assert "\n" not in str(caught.value)


def test_missing_and_unknown_datasets(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_dataset("nothing.npz", tmp_path)
    with pytest.raises(UsageError, match="unknown dataset"):
        load_dataset("imagenet", tmp_path)
    with pytest.raises(UsageError, match="unknown EMNIST split"):
        load_dataset("emnist-words", tmp_path)
    with pytest.raises(UsageError, match="--checksums applies"):
        load_dataset("mnist", tmp_path, checksums={"a": "0" * 32})
    pytest.importorskip("torchvision")
    with pytest.raises(DataError, match="not found") as caught:
        load_dataset("fashion-mnist", tmp_path)
    assert "--download" in str(caught.value)
    assert not any(tmp_path.iterdir()), "nothing is downloaded without --download"


def test_mnist_npz_in_the_root_is_preferred(tmp_path):
    write_npz(tmp_path / "mnist.npz")
    data = load_dataset("mnist", tmp_path)
    assert data.name == "mnist" and data.num_classes == 10
    write_npz(tmp_path / "mnist.npz", shape=(32, 32, 3))
    with pytest.raises(DataError, match="is not MNIST"):
        load_dataset("mnist", tmp_path)


@pytest.mark.skipif(not (SHARED / "data" / "mnist.npz").is_file(), reason="shared/data/mnist.npz not present")
def test_shared_mnist_loads_exactly():
    data = load_dataset("mnist", SHARED / "data")
    assert (data.num_train, len(data.y_test)) == (60000, 10000)
    assert np.bincount(data.y_test).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def write_tiny_cifar(root, per_batch=4):
    """A CIFAR-10 folder in torchvision's layout with a few images per batch (md5s of course differ)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8), "labels": list(range(per_batch))}
        (folder / name).write_bytes(pickle.dumps(batch, protocol=2))
    meta = {"label_names": [f"class{i}" for i in range(10)]}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta, protocol=2))
    return {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in folder.iterdir()}


def test_cifar_copy_refused_by_md5_then_accepted_with_a_checksum_list(tmp_path):
    pytest.importorskip("torchvision")
    md5 = write_tiny_cifar(tmp_path)
    with pytest.raises(DataError, match="matches neither") as caught:
        load_dataset("cifar10", tmp_path)
    assert "--checksums" in str(caught.value)
    listing = tmp_path / "md5.json"
    listing.write_text(json.dumps({"md5": md5, "description": "tiny test copy"}))
    data = load_dataset("cifar10", tmp_path, checksums=listing)
    assert (data.num_train, len(data.y_test), data.num_classes) == (20, 4, 10)
    assert data.x_train.shape == (20, 32, 32, 3)
    assert data.description == "tiny test copy" and "md5.json" in data.verified
    csv_listing = tmp_path / "md5.csv"
    csv_listing.write_text("file,md5\n" + "".join(f"{name},{value}\n" for name, value in md5.items()))
    assert load_dataset("cifar10", tmp_path, checksums=csv_listing).num_train == 20


def test_cifar_missing_folder_says_where(tmp_path):
    pytest.importorskip("torchvision")
    with pytest.raises(DataError, match="cifar-10-batches-py"):
        load_dataset("cifar10", tmp_path)


def test_checksum_list_forms(tmp_path):
    md5 = "0123456789abcdef0123456789abcdef"
    sums = tmp_path / "sums.txt"
    sums.write_text(f"{md5}  data_batch_1\n")
    assert read_checksums(sums).md5 == {"data_batch_1": md5}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"md5": {"data_batch_1": "short"}}))
    with pytest.raises(DataError, match="md5 hex"):
        read_checksums(bad)


@pytest.mark.skipif(
    not (SHARED / "data" / "cifar-10-batches-py").is_dir(), reason="shared/data CIFAR-10 copy not present"
)
def test_shared_cifar10_matches_the_shipped_approximate_list():
    pytest.importorskip("torchvision")
    data = load_dataset("cifar10", SHARED / "data")
    assert (data.num_train, len(data.y_test)) == (50000, 10000)
    assert "approximate" in data.description and "cifar10-jpeg-approx.json" in data.verified
