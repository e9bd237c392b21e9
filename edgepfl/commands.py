"""Typer commands made from options models: each leaf field is one flag, and a command body is "validate, call".

    @app.command()
    @command(ServeCommand)
    def serve(options: ServeCommand) -> None: ...

The flags (their defaults, help, --help panels, hidden old names) come from `edgepfl.options.leaves`; only the
flags given on the command line (or by their environment variable) are passed on, so the model's default (or a
config file's value) applies to the others; the values are nested into the model and validated, and a bad one
is one UsageError line naming its flag.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import typer

from edgepfl.errors import UsageError
from edgepfl.options import (
    ARGUMENT,
    RENAMED,
    Leaf,
    extra_of,
    field_help,
    flag_of,
    leaves,
    optional_inner,
    shown_default,
    validated,
)

ConfigReader = Callable[[Path], Mapping[str, Any]]  # a --config file -> its flat keys
_KEYWORD = inspect.Parameter.KEYWORD_ONLY


def command(
    model: type[Any],
    *,
    config_file: ConfigReader | None = None,
    required: tuple[str, ...] = (),
    context: bool = False,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Make `body(options)` (or `body(ctx, options)` with `context`) a Typer command whose flags are `model`'s leaves.

    `config_file`: the command also takes `--config FILE`, read by this function, whose keys the flags override.
    `required`: flat keys the command needs although the model has a default for them (library callers may
    leave them out). With `context`, a group callback invoked for a subcommand returns at once.
    """
    tree = leaves(model)

    def decorate(body: Callable[..., Any]) -> Callable[..., Any]:
        parameters = [inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)]
        if config_file is not None:
            option = typer.Option(None, "--config", help="JSON or TOML file of these options (flags override it)")
            parameters.append(inspect.Parameter("config_file", _KEYWORD, default=option, annotation=Path | None))
        parameters += [_parameter(leaf) for leaf in tree]
        renamed = [(leaf, old) for leaf in tree for old in extra_of(leaf.info).get(RENAMED, ())]
        for number, (leaf, old) in enumerate(renamed):
            option = typer.Option(None, old, hidden=True)
            cli_type = _cli_type(leaf)
            parameters.append(inspect.Parameter(f"renamed_{number}", _KEYWORD, default=option, annotation=cli_type))

        @functools.wraps(body)
        def invoke(ctx: typer.Context, **values: Any) -> Any:
            if context and ctx.invoked_subcommand is not None:
                return None
            given = {leaf.name: values[leaf.name] for leaf in tree if _given(ctx, leaf.name)}
            for number, (leaf, old) in enumerate(renamed):
                if _given(ctx, f"renamed_{number}"):
                    typer.echo(f"note: {old} is now {leaf.flag}", err=True)
                    given.setdefault(leaf.name, values[f"renamed_{number}"])
            path = values.get("config_file")
            from_file = dict(config_file(path)) if config_file is not None and path is not None else {}
            for name in required:
                if name not in given and name not in from_file:
                    leaf = next(leaf for leaf in tree if leaf.name == name)
                    raise UsageError(f"{leaf.flag} is required", f"pass e.g. {leaf.flag} {_example(leaf)}")
            origin = str(path) if from_file else "options"
            options = validated(model, {**from_file, **given}, origin, flags=given)
            return body(ctx, options) if context else body(options)

        invoke.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        invoke.__annotations__ = {}
        del invoke.__wrapped__  # Typer reads the signature above, not the body's
        return invoke

    return decorate


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether a parameter's value came from the command line or its environment variable, not its default.

    Compared by name: newer Typer releases bring their own copy of click, whose `ParameterSource` is another enum.
    """
    source = ctx.get_parameter_source(name)
    return source is not None and source.name != "DEFAULT"


def _parameter(leaf: Leaf) -> inspect.Parameter:
    """The Typer parameter of one leaf: an option (or an argument) with the tree's default."""
    extra = extra_of(leaf.info)
    text = field_help(leaf.info)
    if extra.get(ARGUMENT):
        required = leaf.info.is_required()
        argument = typer.Argument(... if required else leaf.default, help=text, show_default=False)
        return inspect.Parameter(leaf.name, _KEYWORD, default=argument, annotation=_cli_type(leaf))
    declaration = flag_of(leaf.name, leaf.info)
    if optional_inner(leaf.info.annotation) is bool and "/" not in declaration:
        declaration = f"{declaration}/--no-{declaration.removeprefix('--')}"
    option = typer.Option(
        _typer_default(leaf),
        *declaration.split(" "),
        help=text,
        show_default=shown_default(leaf.default) is not False,
        rich_help_panel=leaf.panel,
        envvar=extra.get("envvar"),
    )
    return inspect.Parameter(leaf.name, _KEYWORD, default=option, annotation=_cli_type(leaf))


def _typer_default(leaf: Leaf) -> Any:
    """A leaf's default as its flag shows and parses it: a comma list as text, a path or number as it is."""
    shown = shown_default(leaf.default)
    if isinstance(leaf.default, tuple | list):
        return shown if shown is not False else None
    return leaf.default


def _cli_type(leaf: Leaf) -> Any:
    """The type Typer parses a leaf's flag as: its scalar type; a choice, comma list or anything else as text."""
    annotation = optional_inner(leaf.info.annotation)
    if typing.get_origin(annotation) is list:
        return list[typing.get_args(annotation)[0]]
    if annotation in (bool, int, float, Path):
        return annotation | None
    return str | None


def _example(leaf: Leaf) -> str:
    examples = leaf.info.examples or []
    return str(examples[0]) if examples else leaf.name.upper()
