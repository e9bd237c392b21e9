"""Next-word text: token-id sequences over the bundle's vocabulary (edgepfl/text.py), from a person's UTF-8 text.

A device's `.txt` file is a line an utterance, tokenized with the bundle's vocab.json (checked against the
manifest's sha256). A sample is a line's `seq_len` tokens and the next token at each position (`targets:
every-position`); the samples stay in time order: the last part is held out, so no held-out context was trained on,
and only targets FedAlt's accuracy counts are scored (not <pad>, not <oov>). Bundles exported when a sample had
one label are refused in one line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from edgepfl import text
from edgepfl.errors import BundleError, DataError
from edgepfl.kinds.base import DeviceSamples, InputSpec, KindWords, SampleKind, require
from edgepfl.kinds.userwords import learn_dictionary, load_dictionary, save_dictionary, suggestions

MIN_DEVICE_WORDS = 10  # fewer words make too few samples to train on and to hold some out


@dataclass(frozen=True, kw_only=True)
class NextWordKind(SampleKind):
    """A next-word model's samples: `seq_len` token ids and the next token after each; the classes are the
    vocabulary's words."""

    name: ClassVar[str] = "next-word"
    words: ClassVar[KindWords] = KindWords("word", "words", "a UTF-8 .txt file")
    described: ClassVar[str] = "next-word text"
    held_out_last: ClassVar[bool] = True
    model_file: ClassVar[dict[str, str]] = {
        "input_layout": "tokens",
        "resize": "none",
        "normalization": "none: token ids of the bundle's vocab.json (edgepfl.text: tokenize, <bos> then the words, "
        "the last seq_len ids right-padded with <pad> = 0); the output is the next word after the last real id",
    }

    vocab: str = text.VOCAB_NAME  # the vocabulary's file in the bundle
    vocab_sha256: str = ""
    vocab_size: int = 0  # words, the four specials included
    seq_len: int = text.DEFAULT_SEQ_LEN
    ignored: tuple[int, ...] = text.METRIC_IGNORED

    @classmethod
    def from_vocabulary(cls, vocabulary: text.Vocabulary, seq_len: int) -> NextWordKind:
        """The kind of a model over `vocabulary` reading `seq_len` tokens."""
        spec = InputSpec(shape=(seq_len,), dtype="int64")
        return cls(input=spec, vocab_sha256=vocabulary.sha256, vocab_size=len(vocabulary), seq_len=seq_len)

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any], input_spec: InputSpec, num_classes: int) -> NextWordKind:
        """A text bundle's kind: its vocabulary file, sha256 and size, its window and the targets not scored; a
        bundle exported when a sample had one label (no `targets: every-position`) is refused."""
        if entry.get("targets") != text.EVERY_POSITION:
            raise BundleError(
                "this text bundle was exported when a next-word sample had one label; models now learn every "
                "position's next word",
                "re-export it with this edgepfl version (edgepfl export transformer --vocab corpus.txt ...)",
            )
        kind = cls(
            input=input_spec,
            vocab=str(entry.get("vocab") or text.VOCAB_NAME),
            vocab_sha256=str(entry["vocab_sha256"]),
            vocab_size=int(entry["vocab_size"]),
            seq_len=int(entry["seq_len"]),
            ignored=tuple(int(i) for i in entry.get("metric_ignores", text.METRIC_IGNORED)),
        )
        require(
            input_spec.shape == (kind.seq_len,),
            f"a next-word model reads {kind.seq_len} tokens, not {input_spec.shape}",
        )
        require(input_spec.dtype == "int64", f"token ids are int64, not {input_spec.dtype}")
        require(
            kind.vocab_size == num_classes,
            f"vocab.json holds {kind.vocab_size} words, the model predicts {num_classes}",
        )
        return kind

    def entry(self) -> dict[str, Any]:
        """What a text bundle's manifest says of its vocabulary and samples."""
        return {
            "kind": self.name,
            "vocab": self.vocab,
            "vocab_sha256": self.vocab_sha256,
            "vocab_size": self.vocab_size,
            "seq_len": self.seq_len,
            "targets": text.EVERY_POSITION,
            # what an engine reads without knowing the kind (the page's engine.js): one sample's targets, the
            # targets its loss leaves out and those its metric leaves out
            "target_shape": list(self.target_shape),
            "loss_ignores": list(self.loss_ignores),
            "metric_ignores": list(self.ignored),
        }

    @property
    def metric_ignores(self) -> tuple[int, ...]:
        """<pad> and <oov> targets do not count (FedAlt's next-word accuracy)."""
        return self.ignored

    @property
    def training_defaults(self) -> dict[str, Any]:
        """The next-word models' measured batch size, learning rate and epochs (edgepfl.text.TRAINING_DEFAULTS)."""
        return dict(text.TRAINING_DEFAULTS)

    @property
    def loss_ignores(self) -> tuple[int, ...]:
        """<pad> targets (after a line's <eos>) do not train."""
        return text.LOSS_IGNORED

    @property
    def target_shape(self) -> tuple[int, ...]:
        """The next token at each of the `seq_len` positions."""
        return (self.seq_len,)

    def prediction_logits(self, logits: np.ndarray, x: np.ndarray) -> np.ndarray:
        """(n, seq_len, words) logits read at each row's last real position (the inputs are right-padded)."""
        if logits.ndim == 2:  # already read there (an exported model file's graph does it)
            return logits
        return logits[np.arange(len(logits)), text.last_positions(x)]

    @property
    def bundle_files(self) -> tuple[str, ...]:
        """vocab.json: a device tokenizes its text with it."""
        return (self.vocab,)

    def vocabulary(self, bundle: Path) -> text.Vocabulary:
        """The bundle's vocab.json, refused when it is missing or is not the one the manifest names (read once per
        bundle folder)."""
        held = self.__dict__.get("_vocabulary")
        if held is not None and held[0] == bundle:
            return held[1]
        vocabulary = text.load_vocabulary(bundle, {"vocab": self.vocab, "vocab_sha256": self.vocab_sha256})
        if len(vocabulary) != self.vocab_size:
            raise BundleError(
                f"vocab.json holds {len(vocabulary)} words and the model predicts {self.vocab_size}",
                "copy vocab.json from the same export as manifest.json",
            )
        object.__setattr__(self, "_vocabulary", (bundle, vocabulary))
        return vocabulary

    def labels(self, bundle: Path, class_labels: Sequence[str]) -> Sequence[str]:
        """The vocabulary's words: a next-word model's classes."""
        return self.vocabulary(bundle).words

    def check_inputs(self, x: np.ndarray, what: str = "x") -> np.ndarray:
        """(N, seq_len) integer token ids of the vocabulary."""
        windows = np.asarray(x)
        if windows.ndim != 2 or windows.shape[1] != self.seq_len:
            raise DataError(
                f"{what} has shape {tuple(windows.shape)}, the model reads windows of {self.seq_len} token ids",
                "make the windows with edgepfl.text.next_word_samples, or pass the text file itself",
            )
        check_token_ids(windows, self.vocab_size, what)
        return windows

    def normalize(self, x: np.ndarray) -> np.ndarray:
        """Token ids as int64, as they are."""
        return np.ascontiguousarray(x, dtype=np.int64)

    def read(self, path: Path, bundle: Path, class_labels: Sequence[str]) -> DeviceSamples:
        """A UTF-8 .txt file's next-word samples, a line an utterance, tokenized with the bundle's vocabulary."""
        if not path.is_file():
            raise DataError(f"data path {path} is not a file", f"pass {self.words.data}")
        if path.suffix.lower() != ".txt":
            raise DataError(f"{path} is not a .txt file; a text bundle trains on UTF-8 text", "pass a .txt file")
        vocabulary = self.vocabulary(bundle)
        lines = text.read_text(path).splitlines()
        text.check_text(lines, str(path), MIN_DEVICE_WORDS)
        return DeviceSamples(*text.next_word_samples(lines, vocabulary, self.seq_len))

    def phrase_input(self, phrase: str, bundle: Path, num_classes: int) -> np.ndarray:
        """<bos> and the phrase's words, windowed as the model reads them (a batch of one, right-padded)."""
        return text.phrase_context(phrase, self.vocabulary(bundle), self.seq_len)[None]

    def offered(
        self, probabilities: np.ndarray, bundle: Path, state: Path | None, k: int
    ) -> list[tuple[int, str, float]]:
        """The `k` words a keyboard offers after a phrase: the model's (no special token) and, in <oov>'s place,
        the person's own words the device's state folder keeps (edgepfl/kinds/userwords.py)."""
        vocabulary = self.vocabulary(bundle)
        learned = load_dictionary(state, vocabulary).words() if state is not None else []
        return suggestions(probabilities, vocabulary.words, learned, "", k)

    def remember(self, path: Path, bundle: Path, state: Path) -> None:
        """The person's own words, learned from the text the device trains on (a line a sentence, in order), kept
        in its state folder for `device predict --text`; never uploaded."""
        lines = text.read_text(path).splitlines()
        save_dictionary(state, learn_dictionary(lines, self.vocabulary(bundle)))


def check_token_ids(x: np.ndarray, vocab_size: int, what: str = "x") -> None:
    """Integer token ids of the bundle's vocabulary; anything else is refused with the fix."""
    if x.dtype.kind not in "iu":
        raise DataError(f"{what} has dtype {x.dtype}, token ids are integers", "tokenize with the bundle's vocab.json")
    if x.size and (x.min() < 0 or x.max() >= vocab_size):
        raise DataError(
            f"{what} holds token ids outside 0..{vocab_size - 1} of the bundle's vocabulary",
            "tokenize with the bundle's vocab.json",
        )
