"""`edgepfl serve join-link`: make a join link that expires or enrolls a few devices only, list links, revoke one.

Works on the state folder of a running server too: the server reads the links from its SQLite at each enrollment.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

import typer

from edgepfl.boundary import ErrorBoundary
from edgepfl.commands import command
from edgepfl.errors import UsageError
from edgepfl.server.joinlinks import BASE_URL_KEY, JoinLinkCommand

join_link_app = typer.Typer(
    cls=ErrorBoundary,
    help="Make a join link that expires (default 24h) or enrolls a few devices only; list or revoke links.",
    add_completion=False,
)
StateOption = Annotated[Path, typer.Option(help="the server's state folder")]


@join_link_app.callback(invoke_without_command=True)
@command(JoinLinkCommand, context=True, required=("state",))
def join_link(ctx: typer.Context, options: JoinLinkCommand) -> None:
    """Print a new join link (its secret in the URL fragment) and its QR code; only a hash of it is stored."""
    from edgepfl.server.joinlinks import JoinLinks, join_url

    state, base_url, qr = options.state, options.base_url, options.qr
    assert state is not None, "the command requires --state"

    store = _open(state)
    try:
        base = _base_url(base_url if base_url is not None else store.get_meta(BASE_URL_KEY), state)
        link, secret = JoinLinks(store).make(options.link, time.time())
    finally:
        store.close()
    url = join_url(base, secret)
    typer.echo(url)
    if qr if qr is not None else sys.stdout.isatty():
        import segno

        segno.make(url, error="m").terminal(out=sys.stdout, compact=True, border=2)
    typer.echo(
        f"join link {link.link_id}: {link.terms()}; end it sooner with "
        f"`edgepfl serve join-link revoke {link.link_id} --state {state}`",
        err=True,
    )


@join_link_app.command("list")
def join_link_list(state: StateOption) -> None:
    """List join links: id, state, what each was made to do, devices enrolled (secrets are never shown again)."""
    from edgepfl.server.joinlinks import JoinLinks

    store = _open(state)
    try:
        links = JoinLinks(store).all()
    finally:
        store.close()
    now = time.time()
    for link in links:
        typer.echo(link.describe(now))


@join_link_app.command("revoke")
def join_link_revoke(
    link_id: Annotated[int, typer.Argument(help="the link's id (see `list`)")], state: StateOption
) -> None:
    """End a join link now: phones that open it are told to ask for a new one (devices it enrolled stay)."""
    from edgepfl.server.joinlinks import JoinLinks

    store = _open(state)
    try:
        link = JoinLinks(store).revoke(link_id, time.time())
    finally:
        store.close()
    typer.echo(link.describe(time.time()))


def _open(state: Path):  # noqa: ANN202 - Store, imported lazily with the rest of the server
    """The server state in `state`, which must exist already (a new link belongs to a server)."""
    from edgepfl.server.store import DB_NAME, Store

    if not (state / DB_NAME).is_file():
        raise UsageError(
            f"{state} holds no server state", "pass the --state folder of `edgepfl serve` (start it once first)"
        )
    return Store(state)


def _base_url(url: str | None, state: Path) -> str:
    """The link's base: a http(s) URL with a host, and nothing after its path."""
    if url is None:
        raise UsageError(
            f"no --base-url, and the server of {state} has not announced its address yet",
            "pass --base-url https://HOST:PORT, the address phones reach the server at",
        )
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise UsageError(f"--base-url {url!r} is not a server address", "pass e.g. --base-url https://HOST:8080")
    return url.rstrip("/")
