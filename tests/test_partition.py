"""Each partition scheme's defining property, seeded; the file: format and its validation errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgepfl.datasets.partition import (
    MIN_CLASS_SAMPLES,
    class_counts,
    make_partition,
    parse_split,
    read_partition_file,
    write_partition_file,
)
from edgepfl.errors import DataError, UsageError

NUM_CLASSES = 10


def balanced_labels(per_class_train: int = 120, per_class_test: int = 20, seed: int = 0):
    """Shuffled labels with the same count per class, like MNIST or CIFAR in miniature."""
    rng = np.random.default_rng(seed)
    train = rng.permutation(np.repeat(np.arange(NUM_CLASSES), per_class_train))
    test = rng.permutation(np.repeat(np.arange(NUM_CLASSES), per_class_test))
    return train, test


def assert_disjoint_cover(parts, total: int, complete: bool = True) -> None:
    everything = np.concatenate([p.indices for p in parts])
    assert len(np.unique(everything)) == len(everything), "a sample is in two clients"
    assert everything.min() >= 0 and everything.max() < total
    if complete:
        assert len(everything) == total


@pytest.mark.parametrize("spec", ["iid", "classes:4", "dirichlet:0.9", "ds3", "dominant:2"])
def test_every_scheme_is_seeded_and_disjoint(spec):
    train, test = balanced_labels()
    first = make_partition(spec, train, test, 10, seed=3)
    again = make_partition(spec, train, test, 10, seed=3)
    other = make_partition(spec, train, test, 10, seed=4)
    assert all(np.array_equal(a.indices, b.indices) for a, b in zip(first, again))
    assert any(not np.array_equal(a.indices, b.indices) for a, b in zip(first, other))
    assert_disjoint_cover(first, len(train) + len(test), complete=spec != "dominant:2")


def test_iid_clients_are_near_equal_and_hold_every_class():
    train, test = balanced_labels()
    parts = make_partition("iid", train, test, 8, seed=0)
    sizes = [p.size for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert (class_counts(parts, np.concatenate([train, test])) > 0).all()


@pytest.mark.parametrize("k", [1, 2, 4, 10])
def test_classes_k_gives_each_client_k_classes_split_evenly(k):
    train, test = balanced_labels()
    labels = np.concatenate([train, test])
    parts = make_partition(f"classes:{k}", train, test, 10, seed=1)
    counts = class_counts(parts, labels)
    assert ((counts > 0).sum(axis=1) == k).all()
    for klass in range(NUM_CLASSES):
        holders = counts[:, klass][counts[:, klass] > 0]
        assert holders.sum() == (labels == klass).sum()
        assert holders.max() - holders.min() <= 1, "a class's samples are split evenly among its holders"


def test_dirichlet_small_alpha_is_more_skewed_than_large():
    train, test = balanced_labels(per_class_train=300)
    labels = np.concatenate([train, test])

    def mean_dominant_share(alpha):
        counts = class_counts(make_partition(f"dirichlet:{alpha}", train, test, 10, seed=0), labels)
        return float(np.mean(counts.max(axis=1) / counts.sum(axis=1)))

    assert mean_dominant_share(0.1) > mean_dominant_share(0.9) > mean_dominant_share(100.0)
    assert mean_dominant_share(100.0) < 0.2  # near-uniform over 10 classes


def test_ds3_two_classes_per_client_and_lognormal_sizes():
    train, test = balanced_labels(per_class_train=500)
    labels = np.concatenate([train, test])
    parts = make_partition("ds3", train, test, 10, seed=5)
    counts = class_counts(parts, labels)
    assert ((counts > 0).sum(axis=1) == 2).all()
    assert (counts[counts > 0] >= MIN_CLASS_SAMPLES).all()
    sizes = np.array([p.size for p in parts])
    assert sizes.max() / sizes.min() > 5, "sigma=2 log-normal weights give very unequal clients"
    # within each class, the holders' shares beyond the floor follow the seeded log-normal weights
    weights = np.random.default_rng(5).lognormal(0.0, 2.0, size=10)
    for klass in range(NUM_CLASSES):
        holders = np.flatnonzero(counts[:, klass])
        extra = counts[holders, klass] - MIN_CLASS_SAMPLES
        expected = weights[holders] / weights[holders].sum() * extra.sum()
        assert np.abs(extra - expected).max() < 1.0


def test_dominant_two_classes_take_the_share_and_all_classes_present():
    train, test = balanced_labels(per_class_train=200)
    labels = np.concatenate([train, test])
    parts = make_partition("dominant:2", train, test, 5, seed=2)
    counts = class_counts(parts, labels)
    assert (counts > 0).all(), "every client holds every class"
    sizes = counts.sum(axis=1)
    assert len(set(sizes.tolist())) == 1
    top_two = np.sort(counts, axis=1)[:, -2:].sum(axis=1)
    assert np.allclose(top_two / sizes, 0.8, atol=0.02)


def test_each_client_split_is_stratified_with_exact_fractions():
    train, test = balanced_labels()
    labels = np.concatenate([train, test])
    parts = make_partition("classes:2", train, test, 10, seed=0, split=(0.6, 0.2, 0.2))
    for part in parts:
        assert len(part.train) == round(part.size * 0.6)
        assert len(part.train) + len(part.val) == round(part.size * 0.8)
        for klass in np.unique(labels[part.indices]):
            total = (labels[part.indices] == klass).sum()
            assert abs((labels[part.test] == klass).sum() - 0.2 * total) <= 1


def test_bad_specs_and_splits_are_one_line_errors():
    train, test = balanced_labels()
    with pytest.raises(UsageError, match="unknown partition"):
        make_partition("shards:2", train, test, 10, seed=0)
    with pytest.raises(UsageError, match="integer"):
        make_partition("classes:two", train, test, 10, seed=0)
    with pytest.raises(UsageError, match="outside 1..10"):
        make_partition("classes:11", train, test, 10, seed=0)
    with pytest.raises(UsageError, match="positive"):
        make_partition("dirichlet:0", train, test, 10, seed=0)
    with pytest.raises(UsageError, match="summing to 1"):
        parse_split("0.5,0.2,0.2")
    with pytest.raises(DataError, match="fewer --clients"):
        make_partition("iid", train, test, 1000, seed=0)


def test_partition_file_round_trip(tmp_path):
    train, test = balanced_labels()
    parts = make_partition("classes:3", train, test, 4, seed=0)
    path = tmp_path / "split.json"
    write_partition_file(path, parts)
    back = make_partition(f"file:{path}", train, test, None, seed=99)
    for a, b in zip(parts, back):
        assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val) and np.array_equal(a.test, b.test)


def test_partition_file_train_index_space_and_optional_val(tmp_path):
    path = tmp_path / "split.json"
    path.write_text(json.dumps({"index_space": "train", "clients": [{"train_indices": [0, 1], "test_indices": [2]}]}))
    (part,) = read_partition_file(path, num_train=3, num_test=5)
    assert part.train.tolist() == [0, 1] and part.val.tolist() == [] and part.test.tolist() == [2]


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"index_space": "train+test", "clients": []}, "non-empty"),
        ({"index_space": "all", "clients": [{"train_indices": [0], "test_indices": [1]}]}, "index_space 'all'"),
        ({"index_space": "train", "clients": [{"train_indices": [0], "test_indices": [10]}]}, r"outside 0\.\.9"),
        ({"index_space": "train+test", "clients": [{"train_indices": [0], "test_indices": [19]}]}, "19"),
        ({"index_space": "train+test", "clients": [{"train_indices": [-1], "test_indices": [1]}]}, "outside"),
        ({"index_space": "train", "clients": [{"train_indices": [0, 1.5], "test_indices": [2]}]}, "1.5"),
        ({"index_space": "train", "clients": [{"train_indices": [0]}]}, "lacks test_indices"),
        ({"index_space": "train", "clients": [{"train_indices": [0], "test_indices": [1], "x": []}]}, "unknown key"),
        (
            {"index_space": "train", "clients": [{"train_indices": [0, 1], "test_indices": [2]}] * 2},
            "sample 0 is in client 0 train_indices and client 1 train_indices",
        ),
        ({"index_space": "train", "clients": [{"train_indices": [0], "test_indices": [0]}]}, "sample 0"),
    ],
)
def test_partition_file_validation(tmp_path, document, message):
    path = tmp_path / "split.json"
    path.write_text(json.dumps(document))
    with pytest.raises(DataError, match=message) as caught:
        read_partition_file(path, num_train=10, num_test=9)
    assert "\n" not in str(caught.value)


def test_partition_file_overlap_allowed_when_declared(tmp_path):
    path = tmp_path / "split.json"
    client = {"train_indices": [0, 1], "test_indices": [2]}
    path.write_text(json.dumps({"index_space": "train", "allow_overlap": True, "clients": [client, client]}))
    assert len(read_partition_file(path, num_train=3, num_test=0)) == 2


def test_partition_file_errors_for_unreadable_files(tmp_path):
    with pytest.raises(DataError, match="cannot read"):
        read_partition_file(tmp_path / "missing.json", 10, 0)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        read_partition_file(bad, 10, 0)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"index_space": "train", "clients": [{"train_indices": [0], "test_indices": [1]}]}))
    with pytest.raises(DataError, match="--clients is 3"):
        read_partition_file(good, 10, 0, num_clients=3)
