"""Fixtures for the page's engine on a text bundle (text_engine.test.mjs): a tiny next-word transformer whose
model input is int64 token ids, its feeds and the Python portable engine's tensors and logits after a full step.

Called by make_fixtures.py into FIXTURES/text; runnable alone: python make_text_fixtures.py OUT.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from edgepfl.device_runtime.portable_engine import PortableEngine
from edgepfl.export.bundle import ExportOptions, export_target
from edgepfl.export.sequence_options import SequenceOptions
from edgepfl.export.textmodels import sequence_target
from edgepfl.manifest import load_manifest

LR = 0.1
CORPUS = "to be or not to be\nthat is the question\nwhether tis nobler in the mind to suffer\n"


def main(out: Path) -> None:
    """Write the text bundle and the Python engine's results into `out`."""
    import torch

    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "corpus.txt"
    corpus.write_text(CORPUS, encoding="utf-8")
    torch.set_num_threads(2)
    options = SequenceOptions(vocab=corpus, seq_len=4, layers=1)
    target = sequence_target("transformer", options, seed=0, width=0.25)
    export_options = ExportOptions(engines=("portable",), force=True, portable_batch=4, frozen_variants=False)
    export_target(target, 1, out / "bundle", export_options, notice=lambda _: None)
    manifest = load_manifest(out / "bundle")
    rng = np.random.default_rng(0)
    feeds = {
        "x": rng.integers(0, manifest.num_classes, (3, 4)).astype(np.int64),  # a short batch: padded and masked
        "y": rng.integers(0, manifest.num_classes, 3).astype(np.int64),
    }
    save_file(feeds, out / "feeds.safetensors")
    engine = PortableEngine(out / "bundle", manifest)
    results = {"lr": LR, "loss": engine.train_step(feeds["x"], feeds["y"], LR, "full")}
    save_file(engine.get_tensors(), out / "after.safetensors")
    results["logits"] = engine.logits(feeds["x"]).ravel().tolist()
    (out / "expected.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
