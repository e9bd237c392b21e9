"""Which parameters stay on the device: the `--personal` spec, its grammar, canonical string and role rule.

A spec is a comma list of items, their union personal (FedAlt/FedSim's partial personalization, Pillutla et
al. 2022): `output:K` (the last K blocks; `--kp K` is its shorthand; `output` alone is `output:1`), `input` (the
first block: a text model's token embeddings, an image model's stem), `adapters:DIM` (a bottleneck adapter inserted
into each block but the output layer, with the blocks' norm parameters), `lora:RANK` (low-rank updates B·A on the
Linear and 1×1-Conv weights) and `names:GLOB` (any parameters by name, fnmatch). Simulate, serve and the devices read
it without torch; export/personal.py inserts the adapters and LoRA factors into a torch module.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from edgepfl.errors import BundleError, UsageError

ITEMS = ("output:K", "input", "adapters:DIM", "lora:RANK", "names:GLOB")
SPEC_HELP = (
    "comma list of output:K (output: output:1), input, adapters:DIM, lora:RANK, names:GLOB (e.g. adapters:16 or "
    "input,output)"
)
# the names export/personal.py gives what it inserts: an adapter is a child module, LoRA's factors are parameters
ADAPTER_CHILD = "adapter"
LORA_A, LORA_B = "lora_A", "lora_B"


@dataclass(frozen=True)
class PersonalSpec:
    """A parsed `--personal` spec; `str()` is its canonical form (items in ITEMS order), as the manifest records."""

    output: int = 0  # the last `output` blocks
    input: bool = False
    adapters: int = 0  # the adapters' bottleneck width; 0 = none
    lora: int = 0  # LoRA's rank; 0 = none
    names: tuple[str, ...] = ()  # fnmatch patterns over parameter names

    def __str__(self) -> str:
        items = [f"output:{self.output}"] if self.output or self.is_empty else []
        items += ["input"] if self.input else []
        items += [f"adapters:{self.adapters}"] if self.adapters else []
        items += [f"lora:{self.lora}"] if self.lora else []
        items += [f"names:{pattern}" for pattern in self.names]
        return ",".join(items)

    @property
    def is_empty(self) -> bool:
        """True when nothing is personal (FedAvg's `--kp 0`)."""
        return not (self.output or self.input or self.adapters or self.lora or self.names)

    @property
    def is_suffix(self) -> bool:
        """True when the personal set is the last K blocks only (what `--kp K` says, and every bundle before specs)."""
        return not (self.input or self.adapters or self.lora or self.names)

    @property
    def inserts(self) -> bool:
        """True when export adds tensors to the model (adapters or LoRA factors)."""
        return bool(self.adapters or self.lora)

    def is_personal(self, name: str, block: int, num_blocks: int, norm_params: Collection[str] = ()) -> bool:
        """The role rule: is the parameter `name` of block `block` personal? `norm_params` names the norm layers'
        parameters (personal with adapters); what export inserted is recognised by its name."""
        if self.output and block >= num_blocks - self.output:
            return True
        if self.input and block == 0:
            return True
        inserted = is_adapter_tensor(name) if self.adapters else False
        inserted = inserted or (bool(self.lora) and name.rsplit(".", 1)[-1] in (LORA_A, LORA_B))
        if inserted or (bool(self.adapters) and name in norm_params):
            return True
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.names)


def is_adapter_tensor(name: str) -> bool:
    """True for a tensor of an inserted adapter (its names run through the `adapter` child)."""
    return f".{ADAPTER_CHILD}." in f".{name}"


def parse_spec(text: str, flag: str = "--personal") -> PersonalSpec:
    """A spec from its comma list; one UsageError line naming the bad item (unknown, malformed or repeated)."""
    fields: dict = {}
    patterns: list[str] = []
    items = [item.strip() for item in str(text).split(",")]
    if not text.strip() or any(not item for item in items):
        raise UsageError(f"{flag} {text!r} has an empty item", f"write {SPEC_HELP}")
    for item in items:
        kind, colon, value = item.partition(":")
        if kind == "names" and colon and value:
            patterns.append(value)
            continue
        if kind == "input" and not colon:
            key, number = "input", True
        elif kind == "output" and not colon:  # the output layer alone, as `input` is the input layer
            key, number = "output", 1
        elif kind in ("output", "adapters", "lora") and colon:
            number = _count(value, item, flag, minimum=0 if kind == "output" else 1)
            key = kind
        else:
            raise UsageError(f"{flag} item {item!r} is not one of {', '.join(ITEMS)}", f"write {SPEC_HELP}")
        if key in fields:
            raise UsageError(f"{flag} {text!r} names {key} twice", f"give {key} once ({SPEC_HELP})")
        fields[key] = number
    if len(set(patterns)) != len(patterns):
        raise UsageError(f"{flag} {text!r} repeats a names: pattern", "give each pattern once")
    return PersonalSpec(**fields, names=tuple(patterns))


def as_spec(personal: int | str | PersonalSpec) -> tuple[PersonalSpec, bool]:
    """(spec, explicit) from what export was given: `--kp K` (an int: output:K, where 0 and all blocks are FedAvg's
    and Local's), a `--personal` string or a parsed spec (explicit: matching no or every parameter is refused)."""
    if isinstance(personal, PersonalSpec):
        return personal, True
    if isinstance(personal, str):
        return parse_spec(personal), True
    return PersonalSpec(output=int(personal)), False


def personal_choice(kp: int | None, personal: str | None, default_kp: int = 2) -> int | str:
    """`--kp K` or `--personal SPEC` (a string, as export takes it), refused in one line when both are given."""
    if kp is not None and personal is not None:
        raise UsageError(
            f"both --kp {kp} and --personal {personal} are given", f"pass one: --kp {kp} is --personal output:{kp}"
        )
    return personal if personal is not None else (default_kp if kp is None else kp)


def bundle_spec(text: str, kp: int) -> PersonalSpec:
    """A manifest's spec: its `personal` string, or `output:kp` for a bundle exported before specs existed."""
    if not text:
        return PersonalSpec(output=kp)
    try:
        return parse_spec(text, "manifest personal")
    except UsageError as exc:  # a bundle from a newer edgepfl, or edited by hand
        raise BundleError(str(exc.args[0]), "re-export the bundle with this edgepfl version") from None


def trailing_personal_blocks(roles: Sequence[tuple[int, bool]], num_blocks: int) -> int:
    """K such that every parameter of the last K blocks is personal, from (block, is personal) pairs: the `kp` a
    manifest records for any spec (a suffix spec's own K; 0 when the output layer is base)."""
    kp = 0
    for block in range(num_blocks - 1, -1, -1):
        flags = [personal for owner, personal in roles if owner == block]
        if not flags or not all(flags):
            break
        kp += 1
    return kp


def _count(value: str, item: str, flag: str, minimum: int) -> int:
    if not value.isdigit() or int(value) < minimum:
        raise UsageError(f"{flag} item {item!r} needs a whole number >= {minimum}", f"e.g. {item.split(':')[0]}:2")
    return int(value)
