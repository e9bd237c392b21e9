"""A device's own words beside a next-word model's vocabulary, and the words it offers after a phrase.

The rule is AOSP LatinIME's user-history dictionary, kept exactly as the page's keyboard keeps it
(device_runtime/web/src/suggest.js; a fixture written from this module pins both): a word outside the vocabulary
(a name, slang) typed LEARN_AT times is learned; at most DICTIONARY_CAP words are kept (learned or on their way),
the least recently typed dropped. The words offered after a phrase are the vocabulary's by the model's probability
(no special token), with the learned words in <oov>'s place, each at <oov>'s probability (the model's belief that
the next word is one it does not know), those that start with the word being typed; ties: the lower id (a learned
word's is <oov>'s), then the more recently typed.

The Python device learns its dictionary from the text it trains on (`device train/run --data notes.txt`, a line a
sentence, in order), as the page learns it from the sentences it keeps, and keeps it in its state folder
(DICTIONARY_NAME), which `device predict --text` reads. It is never uploaded.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from edgepfl.atomic import write_text_atomic
from edgepfl.errors import DataError
from edgepfl.text import OOV_ID, SPECIALS, Vocabulary, is_word, tokenize

LEARN_AT = 2  # LatinIME: a word typed twice is the person's own word
DICTIONARY_CAP = 1000  # words kept (learned or on their way), the least recently typed dropped
DICTIONARY_NAME = "user-dictionary.json"  # in a device's state folder
DICTIONARY_FORMAT = "edgepfl-user-dictionary/1"


class UserDictionary:
    """The person's own words outside the vocabulary: each with how often it was typed, least recently typed first."""

    def __init__(self, vocabulary: Vocabulary, cap: int = DICTIONARY_CAP):
        self.vocabulary = vocabulary
        self.cap = cap
        self.counts: dict[str, int] = {}  # word -> times typed, in the order last typed (a dict keeps insertion order)

    def learn(self, tokens: Iterable[str]) -> None:
        """Count the words of one finished sentence (its tokens, in order) that the vocabulary lacks."""
        for token in tokens:
            if not is_word(token) or token in self.vocabulary:
                continue
            count = self.counts.pop(token, 0) + 1  # typed now: the most recent
            self.counts[token] = count
            if len(self.counts) > self.cap:
                del self.counts[next(iter(self.counts))]

    def words(self) -> list[str]:
        """The learned words (typed LEARN_AT times or more), the most recently typed first."""
        return [word for word, count in reversed(self.counts.items()) if count >= LEARN_AT]

    def entries(self) -> list[list]:
        """[word, count] pairs, least recently typed first (the file's and the fixture's form)."""
        return [[word, count] for word, count in self.counts.items()]


def learn_dictionary(lines: Iterable[str], vocabulary: Vocabulary, cap: int = DICTIONARY_CAP) -> UserDictionary:
    """The dictionary learned from sentences in the order they were finished (a .txt's lines, the page's store)."""
    dictionary = UserDictionary(vocabulary, cap)
    for line in lines:
        dictionary.learn(tokenize(line))
    return dictionary


def suggestions(
    probabilities: np.ndarray, words: Sequence[str], learned: Sequence[str], prefix: str, k: int
) -> list[tuple[int, str, float]]:
    """The `k` words to offer as (id, word, probability): the vocabulary's `words` by the model's probability (no
    special token) and the `learned` words (most recently typed first) at <oov>'s, those starting with `prefix`."""
    model = [(index, word, 0) for index, word in enumerate(words) if index >= len(SPECIALS)]
    own = [(OOV_ID, word, order) for order, word in enumerate(learned)]
    candidates = [(index, word, order) for index, word, order in model + own if word.startswith(prefix)]
    candidates.sort(key=lambda c: (-probabilities[c[0]], c[0], c[2]))
    return [(index, word, float(probabilities[index])) for index, word, _ in candidates[:k]]


def save_dictionary(folder: Path, dictionary: UserDictionary) -> None:
    """Keep the dictionary in a device's state folder (written whole or not at all)."""
    document = {"format": DICTIONARY_FORMAT, "entries": dictionary.entries()}
    write_text_atomic(folder / DICTIONARY_NAME, json.dumps(document, ensure_ascii=False, indent=1) + "\n")


def load_dictionary(folder: Path, vocabulary: Vocabulary) -> UserDictionary:
    """The dictionary a device's state folder keeps (none kept: an empty one); a damaged file is one DataError."""
    path = folder / DICTIONARY_NAME
    dictionary = UserDictionary(vocabulary)
    if not path.is_file():
        return dictionary
    fix = f"delete {path}: the next `device train` or `device run` learns it again from the text"
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        raise DataError(f"{path} is not a user dictionary edgepfl wrote", fix) from None
    entries = document.get("entries") if isinstance(document, dict) else None
    good = document.get("format") == DICTIONARY_FORMAT if isinstance(document, dict) else False
    if not good or not isinstance(entries, list) or not all(_entry(entry) for entry in entries):
        raise DataError(f"{path} is not a user dictionary edgepfl wrote", fix)
    dictionary.counts = {word: count for word, count in entries}
    return dictionary


def _entry(entry: object) -> bool:
    """A [word, count] pair as save_dictionary writes it."""
    return (
        isinstance(entry, list)
        and len(entry) == 2
        and isinstance(entry[0], str)
        and type(entry[1]) is int
        and entry[1] >= 1
    )
