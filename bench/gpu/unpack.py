"""On the device machine: rebuild cifar-10-batches-py from pack.py's files, each checked against its sha256.
Usage: python bench/gpu/unpack.py FOLDER [FOLDER ...] OUT_DIR
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image

Image.MAX_IMAGE_PIXELS = None  # one 3200 x 3200 mosaic per batch


def main() -> None:
    *folders, out = map(Path, sys.argv[1:])
    out.mkdir(parents=True, exist_ok=True)
    for folder in folders:
        for meta in sorted(folder.glob("*.json")):
            name, info = meta.name[: -len(".json")], json.loads(meta.read_text())
            mosaic = np.asarray(Image.open(folder / f"{name}.webp").convert("RGB"))
            data = mosaic.reshape(100, 32, 100, 32, 3).transpose(0, 2, 4, 1, 3).reshape(10000, 3072).tobytes()
            skeleton, offset = (folder / f"{name}.skel").read_bytes(), info["offset"]
            raw = skeleton[:offset] + data + skeleton[offset:]
            assert hashlib.sha256(raw).hexdigest() == info["sha256"], name
            (out / name).write_bytes(raw)
            print("rebuilt", name)
        for extra in folder.glob("batches.meta"):
            (out / extra.name).write_bytes(extra.read_bytes())


if __name__ == "__main__":
    main()
