"""Options as typed models: a pydantic field holds an option's default, bounds, choices and help, once.

A command's Typer options are made from the fields (`flag`), and its values become the model through
`validated`, which turns pydantic's errors into one UsageError line naming the flag and a value that works.
A field's flag is `--` and its name with dashes, unless its `json_schema_extra` names another (`FLAG`).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Iterable, Mapping
from typing import Any

import typer
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.fields import FieldInfo

from edgepfl.errors import UsageError
from edgepfl.protocol import SETTINGS_LIMITS, RoundSettings

FLAG = "flag"  # json_schema_extra key: the field's CLI flag when it is not --NAME-WITH-DASHES
UNSET: Any = None  # a flag left out: the model's default (or a config file's value) applies
OPTIONS = ConfigDict(frozen=True, extra="forbid")  # the model_config of every options model


def flag(
    model: type[BaseModel],
    name: str,
    *declarations: str,
    unset_default: bool = False,
    hidden: bool = False,
) -> Any:
    """A Typer option for `model`'s field `name`: its default, its help with choices and bounds.

    With `unset_default` the option's own default is None, so that a config file's value can apply when the
    flag is left out; the help still shows the model's default. A bool field is an on/off switch `--NAME`.
    """
    info = model.model_fields[name]
    declared = declarations or (flag_name(model, name),)
    default = info.get_default(call_default_factory=True)
    text = field_help(info)
    if unset_default:
        return typer.Option(UNSET, *declared, help=text, show_default=_shown(default), hidden=hidden)
    return typer.Option(default, *declared, help=text, show_default=default is not None, hidden=hidden)


def comma_separated(value: Any) -> Any:
    """A before-validator's split of "0.1,0.5" into ("0.1", "0.5"); any other value is left to the field's type."""
    return tuple(item.strip() for item in value.split(",") if item.strip()) if isinstance(value, str) else value


def settings_field(name: str, default: Any = dataclasses.MISSING, flag: str | None = None) -> Any:
    """A field for RoundSettings' `name`: its help, the bounds a device accepts, and its default unless given."""
    spec = next(item for item in dataclasses.fields(RoundSettings) if item.name == name)
    bounds: dict[str, Any] = {}
    if name in SETTINGS_LIMITS:
        bounds = dict(zip(("ge", "le"), SETTINGS_LIMITS[name]))
    elif spec.type in ("float", float):
        bounds = {"gt": 0.0, "allow_inf_nan": False}
    return Field(
        spec.default if default is dataclasses.MISSING else default,
        description=spec.metadata["help"],
        json_schema_extra={FLAG: flag} if flag else None,
        **bounds,
    )


def flag_name(model: type[BaseModel], name: str) -> str:
    """The CLI flag of `model`'s field `name`."""
    extra = model.model_fields[name].json_schema_extra
    if isinstance(extra, dict) and FLAG in extra:
        return str(extra[FLAG])
    return "--" + name.replace("_", "-")


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


def choices_of(info: FieldInfo) -> tuple[str, ...]:
    """The values a `Literal[...]` field (optional, or a tuple of them) allows; () for any other field."""
    annotation = info.annotation
    if typing.get_origin(annotation) is typing.Union:  # X | None
        annotation = next(arg for arg in typing.get_args(annotation) if arg is not type(None))
    if typing.get_origin(annotation) is tuple:  # tuple[Literal[...], ...]: each item is one of the choices
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) is typing.Literal:
        return tuple(str(choice) for choice in typing.get_args(annotation))
    return ()


def validated(
    model: type[BaseModel], values: Mapping[str, Any], origin: str = "options", flags: Iterable[str] = ()
) -> Any:
    """`model` made from `values`; the first problem becomes one UsageError naming its flag (or key) and a fix.

    `origin` names where the values came from: "options" for a command line, else e.g. a config file's path;
    keys in `flags` came from the command line whatever the origin.
    """
    try:
        return model.model_validate(dict(values))
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        field = next((part for part in error["loc"] if isinstance(part, str)), "")
        raise _usage_error(model, error, "options" if field in set(flags) else origin) from None


def _usage_error(model: type[BaseModel], error: Mapping[str, Any], origin: str) -> UsageError:
    location = [part for part in error["loc"] if isinstance(part, str)]
    field = location[0] if location else ""
    message = str(error["msg"]).removeprefix("Value error, ")
    message = message[:1].lower() + message[1:]
    if field not in model.model_fields:
        if error["type"] == "extra_forbidden":
            what = "unknown option" if origin == "options" else f"{origin} has unknown key"
            return UsageError(f"{what} {field!r}", f"use one of: {', '.join(sorted(model.model_fields))}")
        return UsageError(message if origin == "options" else f"{origin}: {message}", "see --help")
    info = model.model_fields[field]
    given = error.get("input")
    name = flag_name(model, field) if origin == "options" else f"{origin}: {field}"
    example = _example(info)
    shown = "" if isinstance(given, Mapping) else f" {given!r}"
    choices = choices_of(info)
    if choices:
        return UsageError(f"{name}{shown} is unknown", f"use one of: {', '.join(choices)}")
    fix = f"pass e.g. {name} {example}" if origin == "options" else f"use e.g. {field}: {example}"
    return UsageError(f"{name}{shown}: {message}", fix)


def _example(info: FieldInfo) -> str:
    examples = info.examples or []
    if examples:
        return str(examples[0])
    default = info.get_default(call_default_factory=True)
    return str(default) if default is not None else "VALUE"


def _shown(default: Any) -> str | bool:
    if default is None or isinstance(default, bool):
        return False
    if isinstance(default, tuple | list):
        return ",".join(_number(value) for value in default)
    return _number(default) if isinstance(default, float) else str(default)


def _number(value: Any) -> str:
    if isinstance(value, float) and math.isfinite(value) and value == int(value) and abs(value) < 1e15:
        return str(int(value)) if abs(value) >= 1 or value == 0 else repr(value)
    return repr(value) if isinstance(value, float) else str(value)
