"""Fixtures for the page's engine on a text bundle (text_engine.test.mjs): a tiny next-word transformer whose
model input is int64 token ids and whose targets are the next token at every position, its feeds and the Python
portable engine's tensors and (last-position) logits after a full step;
for the page's data and "Try it" (text_page.test.mjs) a person's text, the Python device's samples and split of
it (edgepfl.data.load_device_data through the next-word kind), the tensors after a step on its first training
samples, and the next words `device predict --text` suggests for some phrases.

Called by make_fixtures.py into FIXTURES/text; runnable alone: python make_text_fixtures.py OUT.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from edgepfl.data import load_device_data
from edgepfl.device_runtime.portable_engine import PortableEngine
from edgepfl.device_runtime.predict import next_words, open_device_model
from edgepfl.export.bundle import ExportOptions, export_target
from edgepfl.export.sequence_options import SequenceOptions
from edgepfl.export.textmodels import sequence_target
from edgepfl.manifest import load_manifest

LR = 0.1
PORTABLE_BATCH = 8  # the one-phrase predict graph comes with a batch of 8 or more (export/portable.py PREDICT_SHARE)
CORPUS = "to be or not to be\nthat is the question\nwhether tis nobler in the mind to suffer\n"
# a person's own text: a byte-order mark, CRLF and blank lines, words the vocabulary lacks (<oov> targets, not
# counted by the held-out accuracy), punctuation and a curly apostrophe
NOTES = (
    "\ufeffTo be, or not to be?\r\n\r\nThat is the question:\nwhether \u2019tis nobler in the mind\n\n"
    "to sleep, perchance to dream\u2014ay, there\u2019s the rub\n"
)
VAL_FRACTION = 0.3
PHRASES = ["", "to be or", "That is the", "whether 'tis nobler in", "perchance to dream"]


def main(out: Path) -> None:
    """Write the text bundle and the Python engine's results into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "corpus.txt"
    corpus.write_text(CORPUS, encoding="utf-8")
    options = SequenceOptions(vocab=corpus, seq_len=4, layers=1)
    target = sequence_target("transformer", options, seed=0, width=0.25)
    export_options = ExportOptions(
        engines=("portable",), force=True, portable_batch=PORTABLE_BATCH, frozen_variants=False
    )
    export_target(target, 1, out / "bundle", export_options, notice=lambda _: None)
    manifest = load_manifest(out / "bundle")
    rng = np.random.default_rng(0)
    feeds = {
        "x": rng.integers(0, manifest.num_classes, (3, 4)).astype(np.int64),  # a short batch: padded and masked
        "y": rng.integers(0, manifest.num_classes, (3, 4)).astype(np.int64),  # the next token at every position
    }
    feeds["y"][::2, -1] = 0  # a line ended before the sequence: <pad> targets, which the loss leaves out
    save_file(feeds, out / "feeds.safetensors")
    engine = PortableEngine(out / "bundle", manifest)
    results = {"lr": LR, "loss": engine.train_step(feeds["x"], feeds["y"], LR, "full")}
    save_file(engine.get_tensors(), out / "after.safetensors")
    results["logits"] = engine.logits(feeds["x"]).ravel().tolist()
    results["notes"] = write_notes(out, manifest)
    (out / "expected.json").write_text(json.dumps(results))


def write_notes(out: Path, manifest) -> dict:
    """A person's text (notes.txt), the Python device's samples and split of it, the tensors after a full step on
    its first training samples (after-notes.safetensors) and `device predict --text`'s words for PHRASES."""
    notes = out / "notes.txt"
    notes.write_bytes(NOTES.encode("utf-8"))
    data = load_device_data(notes, manifest, VAL_FRACTION, seed=0, bundle=out / "bundle")
    engine = PortableEngine(out / "bundle", manifest)
    first = data.train_index[:PORTABLE_BATCH]
    loss = engine.train_step(data.images[first], data.labels[first], LR, "full")
    save_file(engine.get_tensors(), out / "after-notes.safetensors")
    model = open_device_model(out / "bundle", out / "no-state", "portable")
    suggestions = {phrase: [list(word) for word in next_words(model.engine, phrase, 3)] for phrase in PHRASES}
    return {
        "val_fraction": VAL_FRACTION,
        "x": data.images.tolist(),
        "y": data.labels.tolist(),
        "train": data.train_index.tolist(),
        "held_out": data.val_index.tolist(),
        "step": {"count": len(first), "loss": loss},
        "suggestions": suggestions,
    }


if __name__ == "__main__":
    main(Path(sys.argv[1]))
