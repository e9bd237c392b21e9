"""The one place where an `EdgePFLError` becomes what a person sees: one line naming the problem and the fix."""

from __future__ import annotations

from typing import Any

import click
import typer
from typer.core import TyperGroup

from edgepfl.errors import EdgePFLError


def fail(error: EdgePFLError) -> None:
    """Print one line naming the problem and the fix, then exit with code 2."""
    typer.echo(f"error: {error}", err=True)
    raise typer.Exit(code=2)


class ErrorBoundary(TyperGroup):
    """A command group whose commands (and its own callback) end in `fail` when they raise an EdgePFLError."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except EdgePFLError as error:
            fail(error)
