"""Word-level text for next-word models: the one tokenizer, the vocabulary a bundle carries, and samples.

A sample is `seq_len + 1` token ids of one line (a speech, a message: <bos>, its words, <eos>), right-padded with
<pad>: the model reads the first `seq_len` and is taught the next token at every position at once (the causal
language model's loss, as FedAlt and keyboards train), <pad> targets left out. A line longer than a sample is cut
into several, each starting where the last one's targets ended, so every token is a target exactly once; a sample
never crosses a line. A prediction reads the last real position of a right-padded phrase. The page tokenizes and
cuts with the same rules (device_runtime/web/src/text.js, pinned by a fixture that this module writes).
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgepfl.errors import BundleError, DataError, UsageError

PAD, OOV, BOS, EOS = "<pad>", "<oov>", "<bos>", "<eos>"
SPECIALS = (PAD, OOV, BOS, EOS)
PAD_ID, OOV_ID, BOS_ID, EOS_ID = range(len(SPECIALS))
METRIC_IGNORED = (PAD_ID, OOV_ID)  # FedAlt's accuracy: out-of-vocabulary and pad targets do not count
LOSS_IGNORED = (PAD_ID,)  # the loss leaves out the padding after a line's <eos>
EVERY_POSITION = "every-position"  # a text bundle's `sample.targets`: the model is taught each position's next token
# the round settings a next-word model trains with when none is given (simulate, device train, a served bundle's
# rounds and so the page): measured on Shakespeare's roles, docs/text-models.md says how
TRAINING_DEFAULTS = {"batch_size": 16, "lr": 0.5, "epochs": 1}
VOCAB_NAME = "vocab.json"
VOCAB_FORMAT = "edgepfl-vocab/1"
DEFAULT_VOCAB_SIZE = 10_000  # FedAlt's StackOverflow vocabulary (plus the four specials)
DEFAULT_SEQ_LEN = 20

# a word is a run of letters and digits, joined by inner apostrophes (o'er, don't); any other visible character
# is a token of its own. The page's regular expression is /[\p{L}\p{N}]+(?:'[\p{L}\p{N}]+)*|[^\s\p{L}\p{N}]/gu
_WORD = r"[^\W_]+(?:'[^\W_]+)*"
_TOKEN = re.compile(rf"{_WORD}|_|[^\w\s]")
_WORD_TOKEN = re.compile(_WORD)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # control characters separate tokens, as whitespace does


def is_word(token: str) -> bool:
    """Whether a token of `tokenize` is a word (letters and digits, inner apostrophes), not punctuation."""
    return _WORD_TOKEN.fullmatch(token) is not None


def tokenize(text: str) -> list[str]:
    """The words and punctuation of `text`: NFKC-normalised, lower-cased, curly apostrophes made straight."""
    text = _CONTROL.sub(" ", unicodedata.normalize("NFKC", text).lower().replace("\u2019", "'"))
    return _TOKEN.findall(text)


@dataclass(frozen=True)
class Vocabulary:
    """The words a model knows, by id: the four specials first, then the corpus's words by frequency."""

    words: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.words[: len(SPECIALS)] != SPECIALS:
            raise BundleError("a vocabulary must start with " + ", ".join(SPECIALS), "write it with edgepfl export")
        if len(set(self.words)) != len(self.words):
            raise BundleError("the vocabulary lists a word twice", "write it again with edgepfl export --vocab")

    @classmethod
    def from_texts(cls, texts: Iterable[str], size: int = DEFAULT_VOCAB_SIZE) -> Vocabulary:
        """The `size` most frequent words of `texts` (ties in alphabetical order, so the same corpus gives the
        same ids everywhere)."""
        counts: Counter[str] = Counter()
        for text in texts:
            counts.update(tokenize(text))
        return cls.from_counts(counts, size)

    @classmethod
    def from_counts(cls, counts: Counter[str], size: int = DEFAULT_VOCAB_SIZE) -> Vocabulary:
        """The `size` most frequent of counted tokens (a dataset counts only its training part's); ties in
        alphabetical order."""
        if size < 1:
            raise UsageError(f"a vocabulary of {size} words cannot hold any word", "use --vocab-size 10000")
        counts = Counter({token: n for token, n in counts.items() if token not in SPECIALS and n > 0})
        if not counts:
            raise DataError("the vocabulary's corpus holds no word", "name a UTF-8 text file with the words to learn")
        ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:size]
        return cls(SPECIALS + tuple(word for word, _ in ranked))

    @classmethod
    def from_json(cls, raw: bytes, source: str = VOCAB_NAME) -> Vocabulary:
        """Read the bytes `to_json` wrote."""
        try:
            document = json.loads(raw.decode("utf-8"))
            words = document["words"]
            if document.get("format") != VOCAB_FORMAT or not all(isinstance(word, str) for word in words):
                raise ValueError(document.get("format"))
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise BundleError(f"{source} is not an edgepfl vocabulary", "export the bundle again") from exc
        return cls(tuple(words))

    def to_json(self) -> bytes:
        """The canonical bytes of vocab.json (what the manifest's sha256 is of)."""
        document = {"format": VOCAB_FORMAT, "specials": list(SPECIALS), "words": list(self.words)}
        return (json.dumps(document, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")

    @property
    def sha256(self) -> str:
        """Hex digest of `to_json()`: a device checks its vocabulary against the manifest with it."""
        return hashlib.sha256(self.to_json()).hexdigest()

    def __len__(self) -> int:
        return len(self.words)

    def __contains__(self, word: object) -> bool:
        return word in self._index

    def encode(self, tokens: Sequence[str]) -> np.ndarray:
        """Token ids (int64), <oov> for a word the vocabulary lacks."""
        index = self._index
        return np.array([index.get(token, OOV_ID) for token in tokens], dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> list[str]:
        """Words of ids."""
        return [self.words[int(i)] for i in ids]

    @property
    def _index(self) -> dict[str, int]:
        cached = self.__dict__.get("_index_cache")
        if cached is None:
            cached = {word: i for i, word in enumerate(self.words)}
            object.__setattr__(self, "_index_cache", cached)
        return cached


def read_text(path: str | Path) -> str:
    """A UTF-8 text file's contents, refused in one line when it is not UTF-8."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}", "check the path") from exc
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})",
            "save it as UTF-8 (most editors: Save As… → encoding UTF-8)",
        ) from exc


def word_count(lines: Sequence[str]) -> int:
    """Tokens (words and punctuation) in the lines."""
    return sum(len(tokenize(line)) for line in lines)


def check_text(lines: Sequence[str], source: str, min_words: int) -> None:
    """Refuse, in one line, a text too small to train and test on."""
    words = word_count(lines)
    if words < min_words:
        what = "no words" if not words else f"only {words} word(s)"
        raise DataError(f"{source} holds {what}; it needs at least {min_words}", "add text (a line per utterance)")


def line_ids(line: str, vocabulary: Vocabulary) -> np.ndarray:
    """One line as <bos> words <eos>."""
    return np.concatenate([[BOS_ID], vocabulary.encode(tokenize(line)), [EOS_ID]]).astype(np.int64)


def context(ids: Sequence[int], seq_len: int) -> np.ndarray:
    """The last `seq_len` ids, right-padded with <pad>: what the model reads to predict the token after the last
    one (at `last_positions`)."""
    window = np.full(seq_len, PAD_ID, dtype=np.int64)
    tail = np.asarray(ids, dtype=np.int64)[-seq_len:] if seq_len else np.zeros(0, np.int64)
    window[: len(tail)] = tail
    return window


def phrase_context(phrase: str, vocabulary: Vocabulary, seq_len: int) -> np.ndarray:
    """What the model reads to suggest the word after `phrase`, a line typed so far: <bos> and its words, as
    `context` windows them (device_runtime/web/src/text.js `phraseContext` is the same)."""
    return context(np.concatenate([[BOS_ID], vocabulary.encode(tokenize(phrase))]), seq_len)


def last_positions(x: np.ndarray) -> np.ndarray:
    """Each right-padded row's last real position (not <pad>), where the model's next-token prediction is read;
    0 for a row of padding only."""
    real = np.asarray(x) != PAD_ID
    length = real.shape[-1]
    return np.where(real.any(axis=-1), length - 1 - np.argmax(real[..., ::-1], axis=-1), 0)


def next_word_samples(lines: Iterable[str], vocabulary: Vocabulary, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Every non-empty line's sequences: x int64 (N, seq_len) the tokens read, y int64 (N, seq_len) the next token
    at each position (<pad> after the line's <eos>). A line of more than `seq_len` targets makes several rows."""
    if seq_len < 1:
        raise UsageError(f"a sequence of {seq_len} tokens reads no word", f"use {DEFAULT_SEQ_LEN}")
    rows = []
    for line in lines:
        if not tokenize(line):
            continue
        ids = line_ids(line, vocabulary)
        for start in range(0, len(ids) - 1, seq_len):
            row = np.full(seq_len + 1, PAD_ID, dtype=np.int64)
            piece = ids[start : start + seq_len + 1]
            row[: len(piece)] = piece
            rows.append(row)
    if not rows:
        return np.zeros((0, seq_len), np.int64), np.zeros((0, seq_len), np.int64)
    sequences = np.stack(rows)
    return np.ascontiguousarray(sequences[:, :-1]), np.ascontiguousarray(sequences[:, 1:])


def counted(labels: np.ndarray, ignored: Sequence[int] = METRIC_IGNORED) -> np.ndarray:
    """Which targets count towards next-word accuracy: not <pad>, not <oov> (FedAlt's metric; a text bundle's kind
    names them, edgepfl.data.scored reads it)."""
    return ~np.isin(labels, np.asarray(ignored, dtype=np.int64))


def write_vocabulary(folder: str | Path, vocabulary: Vocabulary) -> Path:
    """Write vocab.json into a bundle folder."""
    path = Path(folder) / VOCAB_NAME
    path.write_bytes(vocabulary.to_json())
    return path


def load_vocabulary(folder: str | Path, entry: dict) -> Vocabulary:
    """A bundle's vocab.json, refused when it is missing or is not the one its manifest names."""
    path = Path(folder) / entry.get("vocab", VOCAB_NAME)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise BundleError(f"the text bundle has no {path.name}", "copy the whole bundle folder again") from exc
    if hashlib.sha256(raw).hexdigest() != entry.get("vocab_sha256"):
        raise BundleError(
            f"{path.name} is not the vocabulary this bundle was exported with (sha256 differs from the manifest)",
            "copy vocab.json from the same export as manifest.json",
        )
    return Vocabulary.from_json(raw, path.name)
