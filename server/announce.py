"""What `edgepfl serve` prints when it starts: where its status page and `/join` are, as phones reach them."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from pathlib import Path

import typer

from edgepfl.server.config import Listen
from edgepfl.server.joinlinks import BASE_URL_KEY
from edgepfl.server.page import JOIN_PATH, DeviceNote
from edgepfl.server.store import Store

WILDCARD_HOSTS = ("0.0.0.0", "::", "")
_PROBE = ("192.0.2.1", 9)  # TEST-NET-1: connecting a UDP socket there picks the default route and sends nothing


def announce(store: Store, listen: Listen, public_status: bool, note: DeviceNote) -> None:
    """Print where the status page and /join are, and keep the first address as the default base of a join link."""
    urls = base_urls(listen.host, listen.port, listen.tls is not None)
    for line in startup_lines(urls, public_status, note, store.folder):
        typer.echo(line)
    store.set_meta({BASE_URL_KEY: urls[0]})


def machine_addresses(ipv6: bool = False) -> list[str]:
    """This machine's addresses that other machines may reach (no loopback, no link-local), best first."""
    found: list[str] = []
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(_PROBE)
        found.append(probe.getsockname()[0])
    families = (socket.AF_INET, socket.AF_INET6) if ipv6 else (socket.AF_INET,)
    for family in families:
        with contextlib.suppress(OSError):
            found += [str(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None, family)]
    usable = []
    for address in dict.fromkeys(found):
        ip = ipaddress.ip_address(address.split("%")[0])
        if not (ip.is_loopback or ip.is_link_local or ip.is_unspecified):
            usable.append(address)
    return usable


def base_urls(host: str, port: int, tls: bool) -> list[str]:
    """The server's base URLs: the machine's addresses when it listens on all of them, else `host` itself."""
    hosts = (machine_addresses(ipv6=host == "::") or ["127.0.0.1"]) if host in WILDCARD_HOSTS else [host]
    scheme = "https" if tls else "http"
    return [f"{scheme}://{f'[{name}]' if ':' in name else name}:{port}" for name in hosts]


def startup_lines(urls: list[str], public_status: bool, note: DeviceNote, state: Path) -> list[str]:
    """Where the status page is (and whether it needs a token), and how a device is added."""
    pages = " or ".join(f"{url}/" for url in urls)
    access = (
        "public: --public-status" if public_status else "needs a token: pass --public-status to open it in a browser"
    )
    lines = [f"status page: {pages} ({access})"]
    if note.add_device:
        joins = " or ".join(f"{url}{JOIN_PATH}" for url in urls)
        lines.append(f"add a device: {joins} (type the enrollment secret as the password for the QR code)")
    elif note.page:
        lines.append(f"add a device: `edgepfl serve join-link --state {state}` prints a join link and its QR code")
    else:  # the log or --no-web said why
        lines.append(f"add a device: `edgepfl serve tokens add NAME --state {state}` (no browser device page)")
    return lines
