"""What a sample is: one SampleKind per kind of sample (image, next-word text, sensor windows), registered in KINDS.

A bundle's manifest names its kind in its `sample` entry (`{"kind": "next-word", ...}`), parsed once into the
kind's object when the manifest is read. Each kind owns how a device's files are read, how its samples are checked
and normalised, which part is held out, what a prediction shows and the words a person reads; nothing outside
`edgepfl/kinds/` asks which kind it has (tests/test_architecture.py checks). A new kind is a module here and a line
in KINDS (docs/architecture.md walks through one), and its twin in the page's `device_runtime/web/src/kinds.js`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from edgepfl.errors import BundleError
from edgepfl.kinds.base import DeviceSamples, InputSpec, KindWords, SampleKind, read_npz
from edgepfl.kinds.image import ImageKind
from edgepfl.kinds.nextword import NextWordKind
from edgepfl.kinds.sensor import SensorKind

KINDS: dict[str, type[SampleKind]] = {kind.name: kind for kind in (ImageKind, NextWordKind, SensorKind)}

__all__ = [
    "KINDS",
    "DeviceSamples",
    "ImageKind",
    "InputSpec",
    "KindWords",
    "NextWordKind",
    "SampleKind",
    "SensorKind",
    "parse_kind",
    "read_npz",
]


def parse_kind(entry: Mapping[str, Any] | None, input_spec: InputSpec, num_classes: int) -> SampleKind:
    """The kind a manifest's `sample` entry names (an older bundle's `task` entry, or none: images), checked
    against the model's input and classes; one BundleError otherwise."""
    name = str((entry or {}).get("kind") or ImageKind.name)
    kind = KINDS.get(name)
    if kind is None:
        raise BundleError(
            f"the bundle's model reads samples of kind {name!r}, which this edgepfl does not know",
            f"update edgepfl (it reads {', '.join(KINDS)})",
        )
    try:
        return kind.from_entry(entry or {}, input_spec, num_classes)
    except (KeyError, TypeError, ValueError) as exc:
        raise BundleError(
            f"manifest.json's {name} sample entry is malformed ({exc!r})", "re-export the bundle"
        ) from None
