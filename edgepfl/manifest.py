"""The bundle manifest: the one place that says which tensor is base, personal or buffer."""

from __future__ import annotations

import hashlib
import json
import os
import unicodedata
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edgepfl.atomic import sha256_file, write_text_atomic
from edgepfl.errors import BundleError
from edgepfl.kinds import InputSpec, SampleKind, parse_kind
from edgepfl.personal import PersonalSpec, bundle_spec, trailing_personal_blocks

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
ROLES = ("base", "personal", "buffer")


TRAINABLE_SETS = ("full", "personal", "base")  # what a training step may update: all, head only, base only


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor of the model: its shape, dtype, role and the block it belongs to."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: str
    block: int

    @property
    def nbytes(self) -> int:
        """Size in bytes of the tensor's data."""
        count = 1
        for dim in self.shape:
            count *= dim
        return count * _DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Manifest:
    """Everything a device, the server or the simulator needs to know about one exported bundle."""

    model: dict[str, Any]
    kind: SampleKind  # what a sample is: its input, and how it is read, checked and shown (edgepfl/kinds/)
    num_classes: int
    kp: int
    blocks: tuple[str, ...]
    tensors: tuple[TensorSpec, ...]
    engines: dict[str, Any] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    edgepfl_version: str = ""
    class_names: tuple[str, ...] = ()  # one per class when the export named them, else empty
    personal: str = ""  # the --personal spec's canonical string; bundles before specs have none: output:kp

    def __post_init__(self) -> None:
        if not self.personal:  # one form for a bundle of any age, so manifests compare equal
            object.__setattr__(self, "personal", f"output:{self.kp}")

    @property
    def input(self) -> InputSpec:
        """One sample as the model takes it, and how it is normalised."""
        return self.kind.input

    @property
    def personal_spec(self) -> PersonalSpec:
        """Which parameters are personal, as exported (edgepfl/personal.py); `output:kp` for older bundles."""
        return bundle_spec(self.personal, self.kp)

    @property
    def class_labels(self) -> tuple[str, ...]:
        """What people see for each class, and what an image folder's class folders are named: the class
        names, or "0".."num_classes-1" when the bundle has none."""
        return self.class_names or tuple(str(index) for index in range(self.num_classes))

    @property
    def personal_block_start(self) -> int:
        """Index of the first block whose parameters are all personal (to the classifier); with a spec other than
        `output:K` personal tensors may sit before it too: ask the roles."""
        return len(self.blocks) - self.kp

    @property
    def base_layout_hash(self) -> str:
        """sha256 over the sorted base tensor names, shapes and dtypes; every upload quotes it."""
        return layout_hash(self.by_role("base"))

    def by_role(self, role: str) -> list[TensorSpec]:
        """Tensors of one role, in model order."""
        return [t for t in self.tensors if t.role == role]

    def names(self, role: str) -> list[str]:
        """Names of the tensors of one role, in model order."""
        return [t.name for t in self.by_role(role)]

    def trainable_sets(self) -> dict[str, list[str]]:
        """The non-empty trainable sets, by name: full (base + personal), personal (base frozen), base.

        K_P=0 has no personal set and K_P=max no base set; every engine and exporter asks this one place.
        """
        sets = {name: self.trainable(name) for name in TRAINABLE_SETS}
        return {name: names for name, names in sets.items() if names}

    def trainable(self, set_name: str) -> list[str]:
        """The tensor names one trainable set trains (an unknown set name is a BundleError)."""
        if set_name not in TRAINABLE_SETS:
            raise BundleError(f"unknown trainable set {set_name!r}", f"choose one of: {', '.join(TRAINABLE_SETS)}")
        roles = {"full": ("base", "personal"), "personal": ("personal",), "base": ("base",)}[set_name]
        return [name for role in roles for name in self.names(role)]

    def base_buffers(self) -> list[TensorSpec]:
        """Buffers (BatchNorm running statistics) of base layers: shareable if a strategy wants. A buffer goes with
        its layer's parameters (a BatchNorm whose weight is personal keeps its statistics), else with its block."""
        layer_personal: dict[str, bool] = {}
        for t in self.tensors:
            if t.role != "buffer":
                layer = t.name.rpartition(".")[0]
                layer_personal[layer] = layer_personal.get(layer, False) or t.role == "personal"
        blocks = {t.block for t in self.by_role("personal")}

        def is_base(buffer: TensorSpec) -> bool:
            layer = buffer.name.rpartition(".")[0]
            return not layer_personal[layer] if layer in layer_personal else buffer.block not in blocks

        return [t for t in self.by_role("buffer") if is_base(t)]

    def shared(self, share_buffers: bool) -> list[TensorSpec]:
        """The tensors that travel between devices and server: the base, plus base BatchNorm stats if shared."""
        return self.by_role("base") + (self.base_buffers() if share_buffers else [])

    def batchnorm_statistics(self) -> list[str]:
        """Names of the BatchNorm running statistics (running_mean and running_var buffers), in model order."""
        return [t.name for t in self.by_role("buffer") if t.name.endswith((".running_mean", ".running_var"))]

    def portable_files(self) -> tuple[list[str], list[str]]:
        """(the files the portable engine needs, the optional ones): its initial tensors, eval, predict (bundles
        exported since it exists) and step graphs; then the steps' frozen variants (export/frozen.py), which an
        engine uses where it has them."""
        entry = self.engines.get("portable") or {}
        steps = list((entry.get("steps") or {}).values())
        required = [entry["initial"]] if "initial" in entry else []
        required += [entry[graph]["model"] for graph in ("eval", "predict") if graph in entry]
        required += [step["model"] for step in steps]
        return required, [step["frozen"]["model"] for step in steps if "frozen" in step]

    def tensor(self, name: str) -> TensorSpec:
        """The spec of one tensor by name."""
        for spec in self.tensors:
            if spec.name == name:
                return spec
        raise BundleError(f"tensor {name!r} is not in the manifest", "use a name listed in manifest.json")

    def to_json(self) -> dict[str, Any]:
        """The manifest as written to manifest.json."""
        return {
            "schema_version": self.schema_version,
            "edgepfl_version": self.edgepfl_version,
            "model": self.model,
            "input": self.kind.input.to_json(),
            "num_classes": self.num_classes,
            "kp": self.kp,
            "blocks": [{"index": i, "name": name} for i, name in enumerate(self.blocks)],
            "tensors": [asdict(t) for t in self.tensors],
            "base_layout_hash": self.base_layout_hash,
            "engines": self.engines,
            "files": self.files,
            "class_names": list(self.class_names),
            "sample": self.kind.entry(),
            "personal": str(self.personal_spec),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        """Parse and check a manifest.json document."""
        try:
            version = int(data["schema_version"])
            if version != SCHEMA_VERSION:
                raise BundleError(
                    f"manifest schema version {version} is not supported (this edgepfl reads {SCHEMA_VERSION})",
                    "re-export the bundle with this edgepfl version",
                )
            tensors = tuple(
                TensorSpec(t["name"], tuple(int(d) for d in t["shape"]), t["dtype"], t["role"], int(t["block"]))
                for t in data["tensors"]
            )
            num_classes = int(data["num_classes"])
            # `sample` names the kind; bundles exported before it have `task` (none for images)
            sample = data["sample"] if "sample" in data else data.get("task")
            manifest = cls(
                model=dict(data["model"]),
                kind=parse_kind(sample, InputSpec.from_json(data["input"]), num_classes),
                num_classes=num_classes,
                kp=int(data["kp"]),
                blocks=tuple(b["name"] for b in sorted(data["blocks"], key=lambda b: b["index"])),
                tensors=tensors,
                engines=dict(data.get("engines", {})),
                files=dict(data.get("files", {})),
                schema_version=version,
                edgepfl_version=str(data.get("edgepfl_version", "")),
                class_names=tuple(data.get("class_names") or ()),  # bundles of older exports have none
                personal=str(data.get("personal") or ""),  # nor a personal spec: theirs is output:kp
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise BundleError(f"manifest.json is malformed ({exc!r})", "re-export the bundle") from None
        manifest.check()
        stated = data.get("base_layout_hash")
        if stated != manifest.base_layout_hash:
            raise BundleError("manifest.json base_layout_hash does not match its tensor list", "re-export the bundle")
        return manifest

    def check(self) -> None:
        """Internal consistency: roles, blocks and kp agree."""
        if not 0 <= self.kp <= len(self.blocks):
            raise BundleError(f"kp={self.kp} is outside 0..{len(self.blocks)}", "re-export the bundle")
        problem = class_names_problem(self.class_names, self.num_classes)
        if problem:
            raise BundleError(f"manifest.json: {problem}", "re-export the bundle with valid --class-names")
        personal = self.personal_spec
        seen: set[str] = set()
        for spec in self.tensors:
            if spec.name in seen:
                raise BundleError(f"tensor {spec.name!r} is listed twice", "re-export the bundle")
            seen.add(spec.name)
            if spec.role not in ROLES:
                raise BundleError(f"tensor {spec.name!r} has unknown role {spec.role!r}", "re-export the bundle")
            if spec.dtype not in _DTYPE_BYTES:
                raise BundleError(f"tensor {spec.name!r} has unknown dtype {spec.dtype!r}", "re-export the bundle")
            if not 0 <= spec.block < len(self.blocks):
                raise BundleError(f"tensor {spec.name!r} has block {spec.block} out of range", "re-export the bundle")
            if spec.role != "buffer" and personal.is_suffix:
                expected = "personal" if spec.block >= self.personal_block_start else "base"
                if spec.role != expected:
                    raise BundleError(
                        f"tensor {spec.name!r} in block {spec.block} is {spec.role}, kp={self.kp} makes it {expected}",
                        "re-export the bundle",
                    )
        if not personal.is_suffix:
            roles = [(t.block, t.role == "personal") for t in self.tensors if t.role != "buffer"]
            if self.kp != trailing_personal_blocks(roles, len(self.blocks)):
                raise BundleError(
                    f"kp={self.kp} does not match the personal tensors of {personal}", "re-export the bundle"
                )

    def save(self, bundle_dir: str | os.PathLike) -> None:
        """Write manifest.json atomically into the bundle folder."""
        write_text_atomic(Path(bundle_dir) / MANIFEST_NAME, json.dumps(self.to_json(), indent=2) + "\n")


def split_roles(
    params: list[tuple[str, tuple[int, ...], str, int]],
    buffers: list[tuple[str, tuple[int, ...], str, int]],
    num_blocks: int,
    kp: int,
) -> tuple[TensorSpec, ...]:
    """Assign roles from blocks: the last `kp` blocks are personal, the rest base; buffers stay buffers."""
    first_personal = num_blocks - kp
    specs = [
        TensorSpec(name, tuple(shape), dtype, "personal" if block >= first_personal else "base", block)
        for name, shape, dtype, block in params
    ]
    specs += [TensorSpec(name, tuple(shape), dtype, "buffer", block) for name, shape, dtype, block in buffers]
    return tuple(specs)


def class_names_problem(names: Sequence[object], num_classes: int | None = None) -> str | None:
    """What is wrong with a list of class names, or None: exactly `num_classes` (when given) non-empty, printable,
    unique names, each usable as an image folder's name (no slash, no leading dot or surrounding space)."""
    if num_classes is not None and names and len(names) != num_classes:
        return f"{len(names)} class names for a model of {num_classes} classes"
    seen: dict[str, int] = {}
    for index, name in enumerate(names):
        if not isinstance(name, str) or not name:
            return f"class name {index} is empty" if name == "" else f"class name {index} is not text: {name!r}"
        if not name.isprintable() or name != name.strip():
            return f"class name {name!r} has spaces around it or characters that cannot be shown"
        if "/" in name or "\\" in name or name.startswith("."):
            return f"class name {name!r} cannot name an image folder (a slash, or a leading dot)"
        folded = unicodedata.normalize("NFC", name).casefold()  # folders on macOS and Windows ignore case
        if folded in seen:
            return f"class names {names[seen[folded]]!r} and {name!r} are the same name (or differ only in case)"
        seen[folded] = index
    return None


def layout_hash(specs: list[TensorSpec]) -> str:
    """sha256 of the sorted (name, shape, dtype) triples."""
    canonical = json.dumps(sorted([s.name, list(s.shape), s.dtype] for s in specs), separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def load_manifest(bundle_dir: str | os.PathLike, verify_files: bool = False) -> Manifest:
    """Read a bundle's manifest.json; optionally check every listed file's sha256."""
    folder = Path(bundle_dir)
    path = folder / MANIFEST_NAME
    if not path.is_file():
        raise BundleError(
            f"{folder} is not an edgepfl bundle (no {MANIFEST_NAME})",
            "pass the folder written by `edgepfl export`",
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BundleError(f"{path} cannot be read ({exc})", "re-export the bundle") from None
    manifest = Manifest.from_json(data)
    if verify_files:
        verify_bundle_files(folder, manifest)
    return manifest


def verify_bundle_files(bundle_dir: str | os.PathLike, manifest: Manifest) -> None:
    """Check that every file the manifest lists exists and has its recorded sha256."""
    folder = Path(bundle_dir)
    for rel, digest in manifest.files.items():
        path = folder / rel
        if not path.is_file():
            raise BundleError(f"bundle file {rel} is missing", "re-export or re-copy the whole bundle")
        if sha256_file(path) != digest:
            raise BundleError(f"bundle file {rel} does not match its sha256", "re-export or re-copy the whole bundle")


_DTYPE_BYTES = {"float32": 4, "float64": 8, "float16": 2, "int64": 8, "int32": 4, "uint8": 1, "bool": 1}
