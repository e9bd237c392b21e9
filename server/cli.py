"""`edgepfl serve`: run the aggregation server, and enroll devices (`edgepfl serve tokens add NAME`).

The flags are made from the typed configuration (server/config.py); the web stack loads when the server starts.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Annotated

import typer

from edgepfl.boundary import ErrorBoundary
from edgepfl.commands import command
from edgepfl.server.config import ServeCommand
from edgepfl.server.joinlink_cli import join_link_app

serve_app = typer.Typer(
    cls=ErrorBoundary,
    help="Run the aggregation server (base tensors only) or manage device tokens.",
    add_completion=False,
    pretty_exceptions_enable=False,
)
tokens_app = typer.Typer(cls=ErrorBoundary, help="Issue and list per-device bearer tokens.", add_completion=False)
serve_app.add_typer(tokens_app, name="tokens")
serve_app.add_typer(join_link_app, name="join-link")


@serve_app.callback(invoke_without_command=True)
@command(ServeCommand, context=True)
def serve(ctx: typer.Context, options: ServeCommand) -> None:
    """Run the aggregation server: rounds over base tensors only, durable in --state."""
    from edgepfl.errors import UsageError

    try:
        from edgepfl.server.announce import announce
        from edgepfl.server.app import create_app
        from edgepfl.server.engine import create_engine
        from edgepfl.server.transport import run_server
    except ImportError as exc:
        raise UsageError(
            f"serve needs the web stack ({exc.name} is missing)", "pip install 'edgepfl[server]'"
        ) from None
    config, listen, limits = options.server, options.listen, options.limits
    logging.basicConfig(level=listen.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = create_engine(config)
    scheme = "https" if listen.tls else "http"
    enrollment = ", enrollment open" if config.enroll_secret is not None else ""
    settings = config.settings
    if settings.uploads_delta or settings.download_encoding != "fp32":
        enrollment += f", uploads {settings.upload_encoding} deltas, downloads {settings.download_encoding}"
    if engine.dp is not None:
        epsilon = engine.ledger.epsilon() if engine.ledger is not None else 0.0
        enrollment += f", DP sigma {engine.dp.noise_multiplier:g} clip {engine.dp.clip_norm:g} (epsilon {epsilon:.4g})"
    typer.echo(
        f"edgepfl serve: {config.strategy_name}, {config.rounds} rounds, state {config.state}, "
        f"{scheme}://{listen.host}:{listen.port}{enrollment}"
    )
    for warning in config.fleet_warnings(engine.store.count_devices()):  # said again on the status page
        typer.echo(f"warning: {warning}", err=True)
    app = create_app(engine, limits)
    announce(engine.store, listen, config.public_status, app.state.device_note)
    run_server(app, listen.host, listen.port, limits, listen.log_level, listen.tls)
    engine.close()


@tokens_app.command("add")
def tokens_add(
    name: Annotated[str, typer.Argument(help="device name (letters, digits, . _ -)")],
    state: Annotated[Path, typer.Option(help="the server's state folder")],
    replace: Annotated[bool, typer.Option("--replace", help="issue a new token for an enrolled device")] = False,
) -> None:
    """Enroll a device and print its bearer token once (only a hash of it is stored)."""
    from edgepfl.server.store import Store
    from edgepfl.server.tokens import check_device_name, issue_token

    check_device_name(name)  # before Store(): a refused name leaves no state folder behind
    store = Store(state)
    try:
        token = issue_token(store, name, time.time(), replace=replace)
    finally:
        store.close()
    typer.echo(token)


@tokens_app.command("operator")
def tokens_operator(state: Annotated[Path, typer.Option(help="the server's state folder")]) -> None:
    """Print a new operator token once (the previous one stops working): with it /v1/status and / name devices."""
    from edgepfl.server.store import Store
    from edgepfl.server.tokens import issue_operator_token

    store = Store(state)
    try:
        token = issue_operator_token(store)
    finally:
        store.close()
    typer.echo(token)


@tokens_app.command("list")
def tokens_list(state: Annotated[Path, typer.Option(help="the server's state folder")]) -> None:
    """List enrolled devices (names and enrollment time; tokens are never shown again)."""
    from edgepfl.server.store import Store

    store = Store(state)
    devices = store.devices()
    store.close()
    for device in devices:
        typer.echo(f"{device.name}\t{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(device.created))}")
