"""Here: pack one CIFAR-10 batch file for a device machine, whose upload limit (64 MiB a call) the raw batches exceed.

The pixels become one lossless WebP mosaic (100 x 100 images of 32 x 32), the pickle's other bytes a skeleton, and
unpack.py rebuilds the file byte for byte (checked against its sha256 there).
Usage: python bench/gpu/pack.py SOURCE_DIR NAME DEST_DIR   (SOURCE_DIR: ../shared/data/cifar-10-batches-py)
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import sys
from pathlib import Path

import numpy as np
from PIL import Image


def main() -> None:
    source, name, dest = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    raw = (source / name).read_bytes()
    pixels = np.asarray(pickle.loads(raw, encoding="bytes")[b"data"], dtype=np.uint8)
    data = pixels.tobytes()
    offset = raw.find(data[:4096])
    assert raw[offset : offset + len(data)] == data, "the pixels are not one run of the file's bytes"
    mosaic = pixels.reshape(100, 100, 3, 32, 32).transpose(0, 3, 1, 4, 2).reshape(3200, 3200, 3)
    buffer = io.BytesIO()
    Image.fromarray(mosaic).save(buffer, format="WEBP", lossless=True, quality=100, method=6)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")), mosaic), "not lossless"
    dest.mkdir(parents=True, exist_ok=True)
    (dest / f"{name}.webp").write_bytes(buffer.getvalue())
    (dest / f"{name}.skel").write_bytes(raw[:offset] + raw[offset + len(data) :])
    (dest / f"{name}.json").write_text(json.dumps({"offset": offset, "sha256": hashlib.sha256(raw).hexdigest()}))
    print(name, round(len(buffer.getvalue()) / len(data), 3))


if __name__ == "__main__":
    main()
