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
from edgepfl.options import field_help, flag, validated
from edgepfl.server.config import (
    HttpLimits,
    Listen,
    PrivacyOptions,
    RoundOptions,
    ServerConfig,
    StrategyOptions,
    read_enroll_secret,
)

serve_app = typer.Typer(
    cls=ErrorBoundary,
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
    strategy: str = flag(ServerConfig, "strategy"),
    rounds: int = flag(ServerConfig, "rounds"),
    min_clients: int = flag(ServerConfig, "min_clients"),
    fraction: float = flag(ServerConfig, "fraction"),
    round_timeout: float = flag(ServerConfig, "round_timeout"),
    host: str = flag(Listen, "host"),
    port: int = flag(Listen, "port"),
    tls_cert: Path | None = flag(Listen, "tls_cert"),
    tls_key: Path | None = flag(Listen, "tls_key"),
    max_upload_mb: float = flag(ServerConfig, "max_upload_mb"),
    max_samples: int = flag(ServerConfig, "max_samples"),
    clip_multiple: float = flag(ServerConfig, "clip_multiple"),
    weight_multiple: float = flag(ServerConfig, "weight_multiple"),
    seed: int = flag(ServerConfig, "seed"),
    share_bn_stats: bool = flag(RoundOptions, "share_buffers"),
    recompute_bn: bool = flag(RoundOptions, "recompute_bn", "--recompute-bn/--no-recompute-bn"),
    init: Path | None = flag(ServerConfig, "init"),
    epochs: int = flag(RoundOptions, "epochs"),
    batch_size: int = flag(RoundOptions, "batch_size"),
    lr: float = flag(RoundOptions, "lr"),
    client_update: str = flag(RoundOptions, "algorithm"),
    finetune_epochs: int = flag(RoundOptions, "finetune_epochs"),
    personal_epochs: int = flag(RoundOptions, "personal_epochs"),
    upload_encoding: str = flag(RoundOptions, "upload_encoding"),
    download_encoding: str = flag(RoundOptions, "download_encoding"),
    dp_noise_multiplier: float | None = flag(PrivacyOptions, "dp_noise_multiplier"),
    dp_clip: float | None = flag(PrivacyOptions, "dp_clip"),
    dp_delta: float = flag(PrivacyOptions, "dp_delta"),
    dp_target_epsilon: float | None = flag(PrivacyOptions, "dp_target_epsilon"),
    trim_fraction: float = flag(StrategyOptions, "trim_fraction"),
    pfedla_clients: int = flag(StrategyOptions, "clients"),
    hn_lr: float = flag(StrategyOptions, "hn_lr"),
    retain_top_k: int = flag(StrategyOptions, "retain_top_k"),
    poll_interval: float = flag(ServerConfig, "poll_interval"),
    available_for: float = flag(ServerConfig, "available_for"),
    upload_slots: int = flag(ServerConfig, "upload_slots"),
    public_status: bool = flag(ServerConfig, "public_status"),
    history: int = flag(ServerConfig, "history"),
    enroll_secret_file: Annotated[
        Path | None,
        typer.Option(
            help="file holding a shared secret (16+ characters) with which devices enroll via POST /v1/enroll"
        ),
    ] = None,
    enroll_max_failures: int = flag(ServerConfig, "enroll_max_failures"),
    enroll_window: int = flag(ServerConfig, "enroll_window"),
    read_timeout: float = flag(HttpLimits, "read_timeout"),
    min_upload_rate: float = flag(HttpLimits, "min_upload_rate"),
    forwarded_allow_ips: str = typer.Option("", help=field_help(HttpLimits.model_fields["forwarded_allow_ips"])),
    log_level: str = flag(Listen, "log_level"),
    web: bool = flag(ServerConfig, "web"),
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
    round_options = validated(
        RoundOptions,
        {
            "algorithm": client_update,
            "epochs": epochs,
            "batch_size": batch_size,
            "lr": lr,
            "finetune_epochs": finetune_epochs,
            "personal_epochs": personal_epochs,
            "share_buffers": share_bn_stats,
            "recompute_bn": recompute_bn,
            "upload_encoding": upload_encoding,
            "download_encoding": download_encoding,
        },
    )
    privacy = validated(
        PrivacyOptions,
        {
            "dp_noise_multiplier": dp_noise_multiplier,
            "dp_clip": dp_clip,
            "dp_delta": dp_delta,
            "dp_target_epsilon": dp_target_epsilon,
        },
    )
    strategy_options = validated(
        StrategyOptions,
        {
            "settings": round_options.settings(privacy),
            "trim_fraction": trim_fraction,
            "clients": pfedla_clients,
            "hn_lr": hn_lr,
            "seed": seed,
            "retain_top_k": retain_top_k,
        },
    )
    config = validated(
        ServerConfig,
        {
            "bundle": bundle,
            "state": state,
            "strategy": strategy,
            "rounds": rounds,
            "min_clients": min_clients,
            "fraction": fraction,
            "round_timeout": round_timeout,
            "max_upload_mb": max_upload_mb,
            "max_samples": max_samples,
            "clip_multiple": clip_multiple,
            "weight_multiple": weight_multiple,
            "seed": seed,
            "init": init,
            "poll_interval": poll_interval,
            "available_for": available_for,
            "upload_slots": upload_slots,
            "public_status": public_status,
            "history": history,
            "enroll_secret": read_enroll_secret(enroll_secret_file) if enroll_secret_file is not None else None,
            "enroll_max_failures": enroll_max_failures,
            "enroll_window": enroll_window,
            "strategy_options": strategy_options,
            "privacy": privacy,
            "web": web,
        },
    )
    limits = validated(
        HttpLimits,
        {"read_timeout": read_timeout, "min_upload_rate": min_upload_rate, "forwarded_allow_ips": forwarded_allow_ips},
    )
    listen = validated(
        Listen, {"host": host, "port": port, "tls_cert": tls_cert, "tls_key": tls_key, "log_level": log_level}
    )
    try:
        from edgepfl.server.app import create_app
        from edgepfl.server.engine import create_engine
        from edgepfl.server.transport import run_server
    except ImportError as exc:
        raise UsageError(
            f"serve needs the web stack ({exc.name} is missing)", "pip install 'edgepfl[server]'"
        ) from None
    logging.basicConfig(level=listen.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = create_engine(config)
    scheme = "https" if listen.tls else "http"
    enrollment = ", enrollment open" if config.enroll_secret is not None else ""
    settings = strategy_options.settings
    if settings.uploads_delta or settings.download_encoding != "fp32":
        enrollment += f", uploads {settings.upload_encoding} deltas, downloads {settings.download_encoding}"
    if engine.dp is not None:
        epsilon = engine.ledger.epsilon() if engine.ledger is not None else 0.0
        enrollment += f", DP sigma {engine.dp.noise_multiplier:g} clip {engine.dp.clip_norm:g} (epsilon {epsilon:.4g})"
    typer.echo(
        f"edgepfl serve: {config.strategy}, {config.rounds} rounds, state {config.state}, "
        f"{scheme}://{listen.host}:{listen.port}{enrollment}"
    )
    run_server(create_app(engine, limits), listen.host, listen.port, limits, listen.log_level, listen.tls)
    engine.store.close()


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


@tokens_app.command("list")
def tokens_list(state: Annotated[Path, typer.Option(help="the server's state folder")]) -> None:
    """List enrolled devices (names and enrollment time; tokens are never shown again)."""
    from edgepfl.server.store import Store

    store = Store(state)
    devices = store.devices()
    store.close()
    for device in devices:
        typer.echo(f"{device.name}\t{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(device.created))}")
