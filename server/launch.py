"""Start `edgepfl serve` as a subprocess on loopback, wait until it answers, stop it.

The one implementation behind `edgepfl demo` (`edgepfl.simulate.demo`), the server benchmark
(`bench/server.py`) and the live-server tests (`tests/server_helpers.py`, `LiveServer`).
Only the standard library and httpx: importing it starts no torch, FastAPI or uvicorn.
"""

from __future__ import annotations

import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from edgepfl.errors import EdgePFLError

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port free right now on loopback."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def last_line(log: Path) -> str:
    """The last non-blank line of a log (at most 300 characters), or "(no output)"."""
    try:
        text = log.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        text = ""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


class LocalServer:
    """`edgepfl serve --host 127.0.0.1` in a subprocess; its output is appended to `log`.

    `options` follow `--bundle`, `--state`, `--host`, `--port` and `--log-level warning` on the command
    line (so they may override the log level). `port=None` takes a free port at each `start()`.
    As a context manager it starts on entry and stops on exit.
    """

    def __init__(
        self,
        bundle: Path,
        state: Path,
        *options: str,
        log: Path,
        tls: tuple[Path, Path] | None = None,
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        name: str = "the server",
    ):
        self.bundle, self.state, self.options, self.tls = bundle, state, options, tls
        self.log, self.env, self.name = log, env, name
        self.fixed_port = port
        self.port = port or 0
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """Base URL of the running server."""
        return f"{'https' if self.tls else 'http'}://{HOST}:{self.port}"

    @property
    def verify(self) -> ssl.SSLContext | bool:
        """How a client verifies this server: the self-signed certificate, if TLS."""
        return ssl.create_default_context(cafile=str(self.tls[0])) if self.tls else True

    def command(self) -> list[str]:
        """The `edgepfl serve` command line."""
        command = [sys.executable, "-m", "edgepfl.cli", "serve", "--bundle", str(self.bundle)]
        command += ["--state", str(self.state), "--host", HOST, "--port", str(self.port)]
        command += ["--log-level", "warning", *self.options]
        if self.tls:
            command += ["--tls-cert", str(self.tls[0]), "--tls-key", str(self.tls[1])]
        return command

    def start(self, timeout: float = 30.0) -> LocalServer:
        """Start the server and wait until it answers; `EdgePFLError` naming the log if it exits or stays silent."""
        import httpx

        self.port = self.fixed_port or free_port()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:  # the child keeps its own descriptor
            env = dict(self.env) if self.env is not None else None
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env)
        verify = self.verify
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                self.process = None
                raise EdgePFLError(f"{self.name} exited with code {code}: {last_line(self.log)}", f"see {self.log}")
            try:
                httpx.get(f"{self.url}/openapi.json", timeout=1.0, verify=verify, trust_env=False)
                return self
            except httpx.TransportError:
                time.sleep(0.05)
        self.kill()
        raise EdgePFLError(
            f"{self.name} did not answer on port {self.port} within {timeout:.0f}s: {last_line(self.log)}",
            f"see {self.log}",
        )

    def kill(self) -> None:
        """kill -9, as a crash would."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)
        self.process = None

    def stop(self, grace: float = 10.0) -> None:
        """Graceful shutdown (SIGTERM), kill -9 if it hangs for `grace` seconds."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.kill()
        self.process = None

    def __enter__(self) -> LocalServer:
        return self if self.process is not None else self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
