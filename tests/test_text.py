"""The word-level tokenizer, the vocabulary file and next-word samples (edgepfl/text.py)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from edgepfl.errors import BundleError, DataError, UsageError
from edgepfl.kinds import NextWordKind
from edgepfl.text import (
    BOS_ID,
    EOS_ID,
    OOV_ID,
    PAD_ID,
    SPECIALS,
    Vocabulary,
    counted,
    last_positions,
    load_vocabulary,
    next_word_samples,
    phrase_context,
    read_text,
    tokenize,
    write_vocabulary,
)


def test_tokenize_lowercases_splits_punctuation_and_keeps_inner_apostrophes():
    assert tokenize("O'er the Hills, don\u2019t STOP!  ok?") == "o'er the hills , don't stop ! ok ?".split()
    assert tokenize("snake_case 3.5 caf\u00e9 \u00c9T\u00c9") == "snake _ case 3 . 5 caf\u00e9 \u00e9t\u00e9".split()
    assert tokenize("a\x1fb\tc\n") == ["a", "b", "c"]
    assert tokenize("'tis") == ["'", "tis"]


def test_vocabulary_takes_the_most_frequent_words_with_ties_in_alphabetical_order():
    vocabulary = Vocabulary.from_texts(["b a b c", "c b d"], size=2)
    assert vocabulary.words == (*SPECIALS, "b", "c")
    assert vocabulary.encode(["b", "zzz", "c"]).tolist() == [4, OOV_ID, 5]
    assert Vocabulary.from_json(vocabulary.to_json()) == vocabulary


def test_vocabulary_refuses_an_empty_corpus_and_a_size_of_nothing():
    with pytest.raises(DataError, match="no word"):
        Vocabulary.from_texts([" ,,, "[:0], "   "])
    with pytest.raises(UsageError, match="cannot hold"):
        Vocabulary.from_texts(["a"], size=0)


def test_next_word_samples_are_a_lines_sequences_with_the_next_token_at_every_position():
    vocabulary = Vocabulary.from_texts(["a b c"], size=10)
    a, b, c = vocabulary.encode(["a", "b", "c"]).tolist()
    x, y = next_word_samples(["a b", "", "c"], vocabulary, seq_len=2)
    # "a b" is <bos> a b <eos>: three targets, two rows; the second starts where the first's targets ended
    assert x.tolist() == [[BOS_ID, a], [b, EOS_ID], [BOS_ID, c]]  # <eos> is read where the target is <pad>
    assert y.tolist() == [[a, b], [EOS_ID, PAD_ID], [c, EOS_ID]]
    assert x.dtype == np.int64 and y.dtype == np.int64
    x, y = next_word_samples(["a b c"], vocabulary, seq_len=4)  # a line that fits: one row, <pad> after <eos>
    assert x.tolist() == [[BOS_ID, a, b, c]] and y.tolist() == [[a, b, c, EOS_ID]]
    targets = [t for row in next_word_samples(["a b c a b c a"], vocabulary, 3)[1] for t in row if t != PAD_ID]
    assert targets == [a, b, c, a, b, c, a, EOS_ID]  # every token a target exactly once
    assert last_positions(np.array([[BOS_ID, a, PAD_ID], [a, b, c], [PAD_ID] * 3])).tolist() == [1, 2, 0]
    assert counted(np.array([PAD_ID, OOV_ID, EOS_ID, a])).tolist() == [False, False, True, True]


def test_a_bundle_vocabulary_is_checked_against_its_manifest(tmp_path):
    vocabulary = Vocabulary.from_texts(["to be or not to be"], size=100)
    write_vocabulary(tmp_path, vocabulary)
    entry = NextWordKind.from_vocabulary(vocabulary, seq_len=20).entry()
    assert load_vocabulary(tmp_path, entry) == vocabulary
    other = Vocabulary.from_texts(["something else"], size=100)
    write_vocabulary(tmp_path, other)
    with pytest.raises(BundleError, match="not the vocabulary this bundle was exported with"):
        load_vocabulary(tmp_path, entry)
    (tmp_path / "vocab.json").unlink()
    with pytest.raises(BundleError, match="has no vocab.json"):
        load_vocabulary(tmp_path, entry)


def test_a_text_file_that_is_not_utf8_is_refused_in_one_line(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_bytes(b"caf\xe9 au lait")
    with pytest.raises(DataError, match=r"not UTF-8 text \(byte 0xe9 at offset 3\)"):
        read_text(path)
    path.write_bytes("\ufeffhello".encode())
    assert read_text(path) == "hello"


def test_a_typed_phrase_reads_bos_and_its_words_and_counts_skip_specials():
    vocabulary = Vocabulary.from_counts(Counter({"hello": 3, "<eos>": 9, "world": 1, "unused": 0}), size=5)
    assert vocabulary.words == ("<pad>", "<oov>", "<bos>", "<eos>", "hello", "world")
    assert phrase_context("Hello there", vocabulary, 4).tolist() == [BOS_ID, 4, OOV_ID, PAD_ID]  # right-padded
    assert phrase_context("", vocabulary, 2).tolist() == [BOS_ID, PAD_ID]
    assert phrase_context("hello hello hello", vocabulary, 2).tolist() == [4, 4]  # the last ids that fit
    assert counted(np.array([0, 1, 2, 3, 4]), ignored=[1]).tolist() == [True, False, True, True, True]
