"""Options as typed models: a pydantic field holds an option's default, bounds, choices and help, once.

A part owns its options model (the round settings in `edgepfl.protocol`, DP in `edgepfl.privacy`, a strategy's in
its file, the device's in `device_runtime/options.py`); a command's model *contains* the models of the parts it
drives. Every leaf field of that tree is one flag (`edgepfl.commands` makes them) and one flat key of a config
file or results.json (`nest` and `flatten` move between the flat keys and the tree), so a leaf's name is unique in
its tree. `validated` turns pydantic's errors into one UsageError line naming the flag (or the file's key).

A field's flag is `--` and its name with dashes, unless its `json_schema_extra` names another (`FLAG`).
"""

from __future__ import annotations

import functools
import math
import types
import typing
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic.fields import FieldInfo

from edgepfl.errors import UsageError

FLAG = "flag"  # json_schema_extra key: the field's CLI flag when it is not --NAME-WITH-DASHES
RENAMED = "renamed"  # json_schema_extra key: old flags still taken, each with a note naming the new one
ARGUMENT = "argument"  # json_schema_extra key: the field is a positional argument, not a --flag
HIDDEN = "hidden"  # json_schema_extra key (on a field or a group): set by the program, never by a flag or file key
# json_schema_extra key of a sub-model (or union) field: {"exclude": [its leaves left to the program],
# "prefix": "distill_" (its leaves' flat names and flags get it)}
GROUP = "group"
OPTIONS = ConfigDict(frozen=True, extra="forbid")  # the model_config of every options model

M = TypeVar("M", bound=BaseModel)  # an options model, as `unless_given` returns it


@dataclass(frozen=True)
class Leaf:
    """One leaf field of an options tree: one flag and one flat key."""

    name: str  # the flat key (the field's name)
    path: tuple[str, ...]  # where its value lives in the nested values, e.g. ("round", "epochs")
    model: type[BaseModel]  # the model that declares the field
    info: FieldInfo
    default: Any  # the default this tree gives it (a containing model may give its own)
    panel: str  # the --help panel: the declaring model's first docstring line
    variants: tuple[str, ...] = ()  # in a discriminated union: the variants that have it (empty: always)
    union: tuple[str, ...] = ()  # in a discriminated union: the path of the union field
    tag: str | None = None  # a union's own leaf (the variant's name): the discriminator field of its variants

    @property
    def flag(self) -> str:
        """The leaf's CLI flag (without a --no- part)."""
        return flag_of(self.name, self.info).split("/")[0]


def comma_separated(value: Any) -> Any:
    """A before-validator's split of "0.1,0.5" into ("0.1", "0.5"); any other value is left to the field's type."""
    return tuple(item.strip() for item in value.split(",") if item.strip()) if isinstance(value, str) else value


def extra_of(info: FieldInfo) -> dict[str, Any]:
    """A field's json_schema_extra as a dict."""
    extra = info.json_schema_extra
    return extra if isinstance(extra, dict) else {}


def flag_name(model: type[BaseModel], name: str) -> str:
    """The CLI flag of `model`'s field `name`."""
    return flag_of(name, model.model_fields[name])


def flag_of(name: str, info: FieldInfo) -> str:
    """The CLI flag of a field called `name`."""
    extra = extra_of(info)
    return str(extra[FLAG]) if FLAG in extra else "--" + name.replace("_", "-")


def field_help(info: FieldInfo) -> str:
    """A field's description, followed by its choices or bounds."""
    text = info.description or ""
    choices = choices_of(info)
    if choices:
        return f"{text} ({' | '.join(choices)})"
    bounds = [
        f"{symbol} {_number(getattr(item, attribute))}"
        for item in info.metadata
        for attribute, symbol in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"))
        if getattr(item, attribute, None) is not None
    ]
    return f"{text} [{', '.join(bounds)}]" if bounds else text


def bounds_of(info: FieldInfo) -> dict[str, float]:
    """A field's numeric bounds as {"ge"|"gt"|"le"|"lt": value}."""
    return {
        attribute: getattr(item, attribute)
        for item in info.metadata
        for attribute in ("ge", "gt", "le", "lt")
        if getattr(item, attribute, None) is not None
    }


def choices_of(info: FieldInfo) -> tuple[str, ...]:
    """The values a `Literal[...]` field (optional, or a tuple of them) allows; () for any other field."""
    annotation = optional_inner(info.annotation)
    if typing.get_origin(annotation) is tuple:  # tuple[Literal[...], ...]: each item is one of the choices
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) is typing.Literal:
        return tuple(str(choice) for choice in typing.get_args(annotation))
    return ()


def unless_given(options: M, defaults: Mapping[str, Any]) -> M:
    """`options` with each of `defaults` (field -> value) in place of a field the user did not give: a bundle's own
    defaults (a next-word model's batch size, learning rate and epochs) before the options' generic ones."""
    missing = {key: value for key, value in defaults.items() if key not in options.model_fields_set}
    missing = {key: value for key, value in missing.items() if key in type(options).model_fields}
    return options.model_copy(update=missing) if missing else options


class Composed(BaseModel):
    """An options model that holds other parts' models; it also takes its leaves' flat keys (see `nest`)."""

    model_config = OPTIONS

    @model_validator(mode="before")
    @classmethod
    def _flat_keys(cls, data: Any) -> Any:
        return nest(cls, data) if isinstance(data, dict) else data


def leaves(model: type[BaseModel], default: BaseModel | None = None) -> list[Leaf]:
    """Every leaf of `model`'s tree, in field order, with the defaults the tree gives them."""
    if default is None:
        return list(_tree(model))
    return _checked_leaves(model, default)


@functools.cache
def _tree(model: type[BaseModel]) -> tuple[Leaf, ...]:
    return tuple(_checked_leaves(model, None))


def _checked_leaves(model: type[BaseModel], default: BaseModel | None) -> list[Leaf]:
    found = list(_leaves(model, default, (), ""))
    seen: dict[str, Leaf] = {}
    for leaf in found:  # one flag, one flat key: a name twice in a tree is a bug of the tree (exclude or prefix)
        other = seen.setdefault(leaf.name, leaf)
        if other is not leaf:
            raise TypeError(f"{model.__name__}: option {leaf.name!r} is in {other.path} and {leaf.path}")
    return found


def _leaves(model: type[BaseModel], default: BaseModel | None, path: tuple, prefix: str) -> Iterator[Leaf]:
    panel = _panel(model)
    for name, info in model.model_fields.items():
        extra = extra_of(info)
        if extra.get(HIDDEN):
            continue
        value = getattr(default, name) if default is not None else _default(info)
        group = extra.get(GROUP, {})
        exclude, inner = set(group.get("exclude", ())), prefix + group.get("prefix", "")
        sub = submodel(info)
        if sub is not None:
            for leaf in _leaves(sub, value, (*path, name), inner):
                if leaf.name.removeprefix(inner) not in exclude:
                    yield leaf
            continue
        members = union_members(info)
        if members:
            for leaf in _union_leaves(name, info, members, value, (*path, name)):
                if leaf.name not in exclude:
                    yield leaf
            continue
        yield Leaf(prefix + name, (*path, name), model, info, value, panel)


def _union_leaves(
    name: str, info: FieldInfo, members: dict[str, type[BaseModel]], default: BaseModel | None, path: tuple
) -> Iterator[Leaf]:
    """A discriminated union: its tag (one flag whose choices are the variants), then each variant's own leaves."""
    tag = str(info.discriminator)
    chosen = getattr(default, tag, None)
    first = next(iter(members.values()))
    tag_info = FieldInfo(
        annotation=typing.Literal[tuple(members)],  # type: ignore[misc]
        default=chosen,
        description=info.description,
        json_schema_extra=info.json_schema_extra,
    )
    panel = f"{name.capitalize()} ({flag_of(name, info)}) and its options"
    yield Leaf(name, path, first, tag_info, chosen, panel, (), path, tag)
    owners: dict[str, list[str]] = {}
    for variant, member in members.items():
        for field_name in member.model_fields:
            if field_name != tag:
                owners.setdefault(field_name, []).append(variant)
    for field_name, variant_names in owners.items():
        variant_names.sort(key=lambda variant: len(members[variant].model_fields))  # the declaring one first
        member = members[variant_names[0]]
        value = getattr(default, field_name) if chosen in variant_names else None
        field_info = member.model_fields[field_name]
        if value is None:
            value = _default(field_info)
        owned_by = tuple(variant_names)
        yield Leaf(field_name, (*path, field_name), member, field_info, value, panel, owned_by, path)


def _default(info: FieldInfo) -> Any:
    """A field's default (None for a required field, and for a leaf whose default a factory makes when the model is
    validated: ExportOptions.engines asks which onnxruntime is installed, which no --help should import)."""
    if info.is_required():
        return None
    if info.default_factory is not None and not union_members(info):  # a group's leaves then give their own
        return None
    return info.get_default(call_default_factory=True)


def _panel(model: type[BaseModel]) -> str:
    """The --help panel of a model's flags: its title (`titled`), else its docstring's first line."""
    return model.model_config.get("title") or (model.__doc__ or model.__name__).strip().splitlines()[0]


def titled(title: str) -> ConfigDict:
    """The model_config of an options model whose flags show under `title` in --help."""
    return ConfigDict(**OPTIONS, title=title)


def submodel(info: FieldInfo) -> type[BaseModel] | None:
    """The options model a field holds (a group of leaves), or None."""
    annotation = optional_inner(info.annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def union_members(info: FieldInfo) -> dict[str, type[BaseModel]]:
    """A discriminated union field's variants by tag value ({} for any other field)."""
    if info.discriminator is None:
        return {}
    members = {}
    for member in typing.get_args(optional_inner(info.annotation)):
        tag_field = member.model_fields[str(info.discriminator)]
        for value in typing.get_args(tag_field.annotation):
            members[str(value)] = member
    return members


def nest(model: type[BaseModel], flat: Mapping[str, Any]) -> dict[str, Any]:
    """Flat keys placed where `model`'s tree holds them; keys it does not know stay at the top (and are refused).

    A key of a union variant other than the chosen one is a UsageError naming the variants that take it.
    """
    by_name = {leaf.name: leaf for leaf in leaves(model)}
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        leaf = by_name.get(key)
        if leaf is None:  # a group given whole (a dict or a model), or a key the model refuses
            if isinstance(value, dict) and isinstance(nested.get(key), dict):
                nested[key] = {**value, **nested[key]}
            else:
                nested.setdefault(key, value)
            continue
        if leaf.tag is not None and isinstance(value, str):  # the union's own leaf: its chosen variant
            _place(nested, (*leaf.path, "__tag__"), value)
            continue
        _place(nested, leaf.path, value)
    for leaf in by_name.values():
        if leaf.tag is not None:
            _settle_union(nested, leaf, by_name)
    return nested


def _settle_union(nested: dict[str, Any], tag: Leaf, by_name: Mapping[str, Leaf]) -> None:
    """Give the union its tag (the chosen variant, or its default) and refuse a key no chosen variant has."""
    holder = nested
    for part in tag.path[:-1]:
        holder = holder.get(part, {})
        if not isinstance(holder, dict):
            return
    values = holder.get(tag.path[-1])
    if not isinstance(values, dict):
        return
    chosen = values.pop("__tag__", values.get(str(tag.tag), tag.default))
    choices = choices_of(tag.info)
    if chosen not in choices:
        raise UsageError(f"{tag.flag} {chosen!r} is unknown", f"use one of: {', '.join(choices)}")
    for key in list(values):
        leaf = by_name.get(key)
        if leaf is not None and leaf.variants and chosen not in leaf.variants:
            strategies = ", ".join(leaf.variants)
            raise UsageError(
                f"{leaf.flag} applies to {tag.flag} {strategies}, not {chosen}",
                f"drop {leaf.flag}, or choose {tag.flag} {leaf.variants[0]}",
            )
    values[str(tag.tag)] = chosen


def _place(nested: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    holder = nested
    for part in path[:-1]:
        inner = holder.get(part)
        if isinstance(inner, BaseModel):  # a group given whole, and one of its leaves flat: the leaf wins
            inner = inner.model_dump()
        holder[part] = inner if isinstance(inner, dict) else {}
        holder = holder[part]
    if isinstance(value, dict) and isinstance(holder.get(path[-1]), dict):
        holder[path[-1]] = {**value, **holder[path[-1]]}
    else:
        holder[path[-1]] = value


def flatten(options: BaseModel) -> dict[str, Any]:
    """`options` as flat key -> value (JSON-ready), the inverse of `nest`."""
    dumped = options.model_dump(mode="json")
    flat = {}
    for leaf in leaves(type(options), options):
        value: Any = dumped
        for part in leaf.path:
            value = value.get(part) if isinstance(value, dict) else None
        if leaf.tag is not None:
            value = value.get(leaf.tag) if isinstance(value, dict) else value
        elif leaf.variants and value is None:
            continue  # a key of a variant not chosen
        flat[leaf.name] = value
    return flat


def validated(
    model: type[BaseModel], values: Mapping[str, Any], origin: str = "options", flags: Iterable[str] = ()
) -> Any:
    """`model` made from flat `values`; the first problem becomes one UsageError naming its flag (or key) and a fix.

    `origin` names where the values came from: "options" for a command line, else e.g. a config file's path;
    keys in `flags` came from the command line whatever the origin.
    """
    try:
        return model.model_validate(nest(model, values))
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        leaf = _leaf_at(model, error["loc"])
        from_flag = leaf is not None and leaf.name in set(flags)
        raise _usage_error(model, leaf, error, "options" if from_flag else origin) from None


def _leaf_at(model: type[BaseModel], location: tuple) -> Leaf | None:
    """The leaf a pydantic error location points at (through groups and a union's tag), or None."""
    names = [part for part in location if isinstance(part, str)]
    by_path = {leaf.path: leaf for leaf in leaves(model)}
    for end in range(len(names), 0, -1):
        parts = tuple(names[:end])
        for path, leaf in by_path.items():
            if _same_path(path, parts):
                return leaf
    return None


def _same_path(path: tuple[str, ...], parts: tuple[str, ...]) -> bool:
    """Whether an error location's names (a union adds its tag value after the union) reach `path`."""
    if parts == path:
        return True
    return len(parts) == len(path) + 1 and parts[: len(path) - 1] == path[:-1] and parts[-1] == path[-1]


def _usage_error(model: type[BaseModel], leaf: Leaf | None, error: Mapping[str, Any], origin: str) -> UsageError:
    message = str(error["msg"]).removeprefix("Value error, ")
    message = message[:1].lower() + message[1:]
    if leaf is None:
        field = next((part for part in reversed(error["loc"]) if isinstance(part, str)), "")
        if error["type"] == "extra_forbidden":
            what = "unknown option" if origin == "options" else f"{origin} has unknown key"
            known = sorted(leaf.name for leaf in leaves(model))
            return UsageError(f"{what} {field!r}", f"use one of: {', '.join(known)}")
        return UsageError(message if origin == "options" else f"{origin}: {message}", "see --help")
    given = error.get("input")
    name = leaf.flag if origin == "options" else f"{origin}: {leaf.name}"
    example = _example(leaf)
    if error["type"] == "missing":
        fix = f"pass e.g. {leaf.flag} {example}" if origin == "options" else f"add e.g. {leaf.name}: {example}"
        return UsageError(f"{name} is required", fix)
    shown = "" if isinstance(given, Mapping) else f" {given!r}"
    choices = choices_of(leaf.info)
    if choices:
        return UsageError(f"{name}{shown} is unknown", f"use one of: {', '.join(choices)}")
    fix = f"pass e.g. {name} {example}" if origin == "options" else f"use e.g. {leaf.name}: {example}"
    return UsageError(f"{name}{shown}: {message}", fix)


def _example(leaf: Leaf) -> str:
    examples = leaf.info.examples or []
    if examples:
        return str(examples[0])
    return str(leaf.default) if leaf.default is not None else leaf.name.upper()


def optional_inner(annotation: Any) -> Any:
    """X for `X | None` (and Optional[X]); the annotation itself otherwise."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(args) == 1:
            return args[0]
    if typing.get_origin(annotation) is typing.Annotated:
        return optional_inner(typing.get_args(annotation)[0])
    return annotation


def shown_default(default: Any) -> str | bool:
    """How --help shows a default (False: not at all)."""
    if default is None or isinstance(default, bool):
        return False
    if isinstance(default, tuple | list):
        return ",".join(_number(value) for value in default)
    return _number(default) if isinstance(default, float) else str(default)


def _number(value: Any) -> str:
    if isinstance(value, float) and math.isfinite(value) and value == int(value) and abs(value) < 1e15:
        return str(int(value)) if abs(value) >= 1 or value == 0 else repr(value)
    return repr(value) if isinstance(value, float) else str(value)
