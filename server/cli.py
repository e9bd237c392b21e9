"""`edgepfl serve`: run the aggregation server, and enroll devices (`edgepfl serve tokens add NAME`).

Only typer and the standard library are imported here; the web stack loads when the server starts.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Annotated

import typer

from edgepfl.boundary import ErrorBoundary

serve_app = typer.Typer(cls=ErrorBoundary,
    help="Run the aggregation server (base tensors only) or manage device tokens.",
    add_completion=False,
    pretty_exceptions_enable=False,
)
tokens_app = typer.Typer(cls=ErrorBoundary, help="Issue and list per-device bearer tokens.", add_completion=False)
serve_app.add_typer(tokens_app, name="tokens")


@serve_app.callback(invoke_without_command=True)
def serve(
    ctx: typer.Context,
    bundle: Annotated[Path | None, typer.Option(help="bundle folder written by `edgepfl export`")] = None,
    state: Annotated[Path | None, typer.Option(help="state folder (SQLite + blobs); reuse it to resume")] = None,
    strategy: Annotated[str, typer.Option(help="fedper | fedavg | median | trimmed-mean | pfedla")] = "fedper",
    rounds: Annotated[int, typer.Option(help="rounds to aggregate, then tell devices 'done'")] = 100,
    min_clients: Annotated[
        int, typer.Option(help="devices needed to open a round and to close it at its deadline")
    ] = 2,
    fraction: Annotated[float, typer.Option(help="fraction of available devices sampled per round")] = 1.0,
    round_timeout: Annotated[float, typer.Option(help="seconds from a round's opening to its deadline")] = 600.0,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8080,
    tls_cert: Annotated[Path | None, typer.Option(help="TLS certificate (PEM); with --tls-key serves HTTPS")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="TLS private key (PEM)")] = None,
    max_upload_mb: Annotated[float, typer.Option(help="largest accepted upload body")] = 64.0,
    max_samples: Annotated[int, typer.Option(help="largest sample count an upload may claim")] = 10_000_000,
    clip_multiple: Annotated[
        float, typer.Option(help="clip each update's delta to this many times the round's median delta norm; 0: off")
    ] = 3.0,
    weight_multiple: Annotated[
        float, typer.Option(help="cap each claimed sample count at this many times the round's median; 0: off")
    ] = 2.0,
    seed: Annotated[int, typer.Option(help="seed of device sampling")] = 0,
    share_bn_stats: Annotated[
        bool, typer.Option("--share-bn-stats", help="average base-block BatchNorm statistics too (default: they stay)")
    ] = False,
    init: Annotated[
        Path | None, typer.Option(help="initial tensors (default: BUNDLE/portable/initial.safetensors)")
    ] = None,
    epochs: Annotated[int, typer.Option(help="local epochs per round")] = 1,
    batch_size: Annotated[int, typer.Option(help="local batch size")] = 32,
    lr: Annotated[float, typer.Option(help="local learning rate")] = 0.01,
    client_update: Annotated[
        str, typer.Option(help="what a device trains each round: fedsim | fedalt | local")
    ] = "fedsim",
    finetune_epochs: Annotated[int, typer.Option(help="personal fine-tuning epochs (base frozen) per round")] = 0,
    personal_epochs: Annotated[int, typer.Option(help="fedalt: personal-phase epochs")] = 1,
    trim_fraction: Annotated[float, typer.Option(help="trimmed-mean: fraction cut from each end")] = 0.1,
    pfedla_clients: Annotated[int, typer.Option(help="pfedla: number of clients N the hypernetworks mix")] = 0,
    hn_lr: Annotated[float, typer.Option(help="pfedla: hypernetwork learning rate")] = 5e-3,
    retain_top_k: Annotated[
        int, typer.Option(help="heurpfedla: tensors (largest self-weight) each device keeps instead of exchanging")
    ] = 1,
    poll_interval: Annotated[float, typer.Option(help="retry_after told to waiting devices (seconds)")] = 5.0,
    available_for: Annotated[float, typer.Option(help="a device is available this long after it polls (s)")] = 60.0,
    upload_slots: Annotated[int, typer.Option(help="uploads checked at once (bounds memory)")] = 4,
    public_status: Annotated[
        bool, typer.Option("--public-status", help="/, /plot.png, /v1/status need no token")
    ] = False,
    history: Annotated[
        int, typer.Option(help="closed rounds whose global model is kept for new participants; 0 keeps all")
    ] = 0,
    enroll_secret_file: Annotated[
        Path | None,
        typer.Option(
            help="file holding a shared secret (16+ characters) with which devices enroll via POST /v1/enroll"
        ),
    ] = None,
    enroll_max_failures: Annotated[
        int, typer.Option(help="wrong enrollment secrets from one address before it gets 429 (see --enroll-window)")
    ] = 10,
    enroll_window: Annotated[
        int, typer.Option(help="seconds over which --enroll-max-failures are counted (a sliding window)")
    ] = 600,
    read_timeout: Annotated[
        float, typer.Option(help="seconds for a request's headers, and a body's grace before --min-upload-rate")
    ] = 20.0,
    min_upload_rate: Annotated[
        float, typer.Option(help="KiB/s a request body must average after --read-timeout, or it is refused (408)")
    ] = 8.0,
    forwarded_allow_ips: Annotated[
        str, typer.Option(help="reverse proxies (IPs or networks, comma-separated) whose X-Forwarded-For is believed")
    ] = "",
    log_level: Annotated[str, typer.Option(help="debug | info | warning")] = "info",
    no_web: Annotated[
        bool, typer.Option("--no-web", help="serve no browser device page (/device/) and no join link (/join)")
    ] = False,
    old_algorithm: Annotated[str | None, typer.Option("--algorithm", hidden=True)] = None,
    old_clients: Annotated[int | None, typer.Option("--clients", hidden=True)] = None,
    old_share_buffers: Annotated[bool, typer.Option("--share-buffers", hidden=True)] = False,
) -> None:
    """Run the aggregation server: rounds over base tensors only, durable in --state."""
    if ctx.invoked_subcommand is not None:
        return
    from edgepfl.errors import UsageError

    # the old names meant something else in `edgepfl simulate`: still taken, with one line naming the new one
    if old_algorithm is not None:
        typer.echo("note: serve --algorithm is now --client-update", err=True)
        client_update = old_algorithm
    if old_clients is not None:
        typer.echo("note: serve --clients is now --pfedla-clients", err=True)
        pfedla_clients = old_clients
    if old_share_buffers:
        typer.echo("note: --share-buffers is now --share-bn-stats", err=True)
        share_bn_stats = True
    if bundle is None or state is None:
        raise UsageError("serve needs --bundle and --state", "edgepfl serve --bundle DIR --state DIR")
    from edgepfl.protocol import RoundSettings
    from edgepfl.server.config import ServerConfig, StrategyOptions, read_enroll_secret

    settings = RoundSettings(
        algorithm=client_update,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        finetune_epochs=finetune_epochs,
        personal_epochs=personal_epochs,
        share_buffers=share_bn_stats,
    )
    config = ServerConfig(
        bundle=bundle,
        state=state,
        strategy=strategy,
        rounds=rounds,
        min_clients=min_clients,
        fraction=fraction,
        round_timeout=round_timeout,
        max_upload_mb=max_upload_mb,
        max_samples=max_samples,
        clip_multiple=clip_multiple,
        weight_multiple=weight_multiple,
        seed=seed,
        share_buffers=share_bn_stats,
        init=init,
        poll_interval=poll_interval,
        available_for=available_for,
        upload_slots=upload_slots,
        public_status=public_status,
        history=history,
        enroll_secret=read_enroll_secret(enroll_secret_file) if enroll_secret_file is not None else None,
        enroll_max_failures=enroll_max_failures,
        enroll_window=enroll_window,
        strategy_options=StrategyOptions(
            settings=settings,
            trim_fraction=trim_fraction,
            clients=pfedla_clients,
            hn_lr=hn_lr,
            seed=seed,
            retain_top_k=retain_top_k,
        ),
        web=not no_web,
    )
    config.check()
    if (tls_cert is None) != (tls_key is None):
        raise UsageError("--tls-cert and --tls-key go together", "pass both, or neither for plain HTTP")
    for path in (tls_cert, tls_key):
        if path is not None and not path.is_file():
            raise UsageError(f"{path} does not exist", "pass a PEM file")
    if not 0 <= port <= 65535:
        raise UsageError(f"--port {port} is not a port", "use 1..65535")
    try:
        from edgepfl.server.app import create_app
        from edgepfl.server.engine import create_engine
        from edgepfl.server.transport import HttpLimits, parse_proxies, run_server
    except ImportError as exc:
        raise UsageError(
            f"serve needs the web stack ({exc.name} is missing)", "pip install 'edgepfl[server]'"
        ) from None
    limits = HttpLimits(read_timeout, min_upload_rate, parse_proxies(forwarded_allow_ips))
    limits.check()
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = create_engine(config)
    scheme = "https" if tls_cert else "http"
    enrollment = ", enrollment open" if config.enroll_secret is not None else ""
    typer.echo(
        f"edgepfl serve: {config.strategy}, {config.rounds} rounds, state {config.state}, "
        f"{scheme}://{host}:{port}{enrollment}"
    )
    tls = (tls_cert, tls_key) if tls_cert and tls_key else None
    run_server(create_app(engine, limits), host, port, limits, log_level, tls)
    engine.store.close()


@tokens_app.command("add")
def tokens_add(
    name: Annotated[str, typer.Argument(help="device name (letters, digits, . _ -)")],
    state: Annotated[Path, typer.Option(help="the server's state folder")],
    replace: Annotated[bool, typer.Option("--replace", help="issue a new token for an enrolled device")] = False,
) -> None:
    """Enroll a device and print its bearer token once (only a hash of it is stored)."""
    from edgepfl.server.store import Store, check_device_name, issue_token

    check_device_name(name)  # before Store(): a refused name leaves no state folder behind
    store = Store(state)
    try:
        token = issue_token(store, name, time.time(), replace=replace)
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
