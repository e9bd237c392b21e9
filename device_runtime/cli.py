"""`edgepfl device enroll | run | train | teacher | distill | eval` (and model_cli: predict | export-model)."""

from __future__ import annotations

import contextlib
import json
import math
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from edgepfl.boundary import ErrorBoundary
from edgepfl.commands import command
from edgepfl.device_runtime.options import (
    DeviceFiles,
    DistillCommand,
    EnrollCommand,
    EvalCommand,
    LocalOptions,
    RunCommand,
    ServerAccess,
    StatusCommand,
    TeacherCommand,
    TrainCommand,
)
from edgepfl.options import unless_given

if TYPE_CHECKING:
    from edgepfl.data import LocalData
    from edgepfl.device_runtime.engine import Engine
    from edgepfl.device_runtime.state import StateFolder

device_app = typer.Typer(
    cls=ErrorBoundary,
    help="Train on this device: take part in server rounds, train locally, evaluate. Never needs torch.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


@device_app.callback()
def _device() -> None:
    """Train on this device: take part in server rounds, train locally, evaluate. Never needs torch."""
    from edgepfl.ortbuild import onnxruntime_without_torch

    onnxruntime_without_torch()  # before any command imports onnxruntime: its training build would load torch


@device_app.command()
@command(EnrollCommand)
def enroll(options: EnrollCommand) -> None:
    """Enroll this device with the server's shared secret and print its token once (or write it to --token-file).

    A random enrollment key goes with the request; with --token-file it is kept in TOKEN_FILE.enroll-key
    until the token is written, so running the same command again after a lost reply gets a new token.
    """
    from edgepfl.credentials import read_secret_file, refuse_existing, write_secret_file

    server, name, secret_file, token_file = options.server, options.name, options.secret_file, options.token_file
    if token_file is not None:
        refuse_existing(token_file, "--token-file")  # before the name is spent on the server
    secret = read_secret_file(secret_file, "--secret-file")
    key_file = _enroll_key_file(token_file) if token_file is not None else None
    key = _enroll_key(key_file)
    from edgepfl.device_runtime.client import ServerClient

    client = ServerClient(server, None, timeout=options.connection.timeout)
    try:
        token = client.enroll(name, secret, key)
    finally:
        client.close()
    if token_file is not None and key_file is not None:
        write_secret_file(token_file, token, "--token-file")
        with contextlib.suppress(OSError):  # a key left behind only re-enrolls this name with the secret
            key_file.unlink(missing_ok=True)
        typer.echo(f"enrolled as {name} at {server}; its token is in {token_file} (private: keep it so)", err=True)
        return
    if token_file is None:  # the token alone on stdout, for a script; what happened on stderr
        typer.echo(
            f"enrolled as {name} at {server}; its token follows, shown once (--token-file keeps it in a file)", err=True
        )
        typer.echo(token)


@device_app.command()
@command(RunCommand)
def run(options: RunCommand) -> None:
    """Take part in rounds until the server says the run is over: base in, base out, personal part kept."""
    device_token = _device_token(options.access)
    from edgepfl.device_runtime.client import RetryPolicy, ServerClient
    from edgepfl.device_runtime.progress import RichEvents
    from edgepfl.device_runtime.runner import run_device
    from edgepfl.device_runtime.waiting import WaitLog

    device_engine, local_data, device_state = _open(options.files, options.local)
    connection, as_json = options.connection, options.output.as_json
    device = options.device.model_copy(update={"seed": options.local.seed})
    with RichEvents(quiet=as_json) as events:
        waits = WaitLog(device_state.folder, events.waiting)
        client = ServerClient(
            options.access.server,
            device_token,
            RetryPolicy(attempts=connection.retries),
            timeout=connection.timeout,
            on_retry=lambda failure: waits.waiting("the server", failure),
        )
        try:
            summary = run_device(device_engine, local_data, device_state, client, device, events, waits=waits)
        finally:
            client.close()
    _print_result(
        {
            "rounds_trained": summary.rounds_trained,
            "finished": summary.finished,
            "final_accuracy": summary.final_accuracy,
            "last_completed_round": device_state.state.last_completed_round,
            "bytes_sent": summary.bytes_sent,
            "bytes_received": summary.bytes_received,
            "engine": device_engine.name,
            "state": str(options.files.state),
        },
        as_json,
        "device run",
    )


@device_app.command()
@command(TrainCommand)
def train(command_options: TrainCommand) -> None:
    """Train locally without a server (e.g. personal fine-tuning) and save the result in --state."""
    options, as_json = command_options.train, command_options.output.as_json
    from edgepfl.device_runtime.algorithms import train_locally
    from edgepfl.device_runtime.progress import RichEvents

    device_engine, local_data, device_state = _open(command_options.files, command_options.local)
    options = unless_given(options, device_engine.manifest.kind.training_defaults)  # a next-word model's own
    device_engine.check_set(options.trainable)
    with RichEvents(quiet=as_json) as events:
        events.start_bar(f"train {options.trainable}", options.epochs * -(-local_data.num_train // options.batch_size))
        record = train_locally(
            device_engine,
            local_data,
            options,
            command_options.local.seed,
            device_state.kept,
            on_step=lambda phase, loss: events.step(phase, 0, 0, loss),
        )
    device_state.commit(device_engine.get_tensors(), record)
    _print_result(record, as_json, "device train")


@device_app.command()
@command(TeacherCommand)
def teacher(options: TeacherCommand) -> None:
    """PersFL for a new participant: score every global model the server keeps; keep the best as the teacher.

    Each round's global model (`GET /v1/history`) is scored on the held-out data exactly as in
    `device run --persfl-teacher`, and the one with the lowest loss is kept in --state for `device distill`.
    """
    connection, as_json = options.connection, options.output.as_json
    device_token = _device_token(options.access)
    from edgepfl.device_runtime.client import RetryPolicy, ServerClient
    from edgepfl.device_runtime.persfl import TeacherStore
    from edgepfl.device_runtime.progress import RichEvents
    from edgepfl.device_runtime.runner import teacher_from_history

    device_engine, local_data, _ = _open(options.files, options.local)
    store = TeacherStore(options.files.state, device_engine.manifest)
    with RichEvents(quiet=as_json) as events:
        client = ServerClient(
            options.access.server,
            device_token,
            RetryPolicy(attempts=connection.retries),
            timeout=connection.timeout,
            on_retry=events.message,
        )
        try:
            losses = teacher_from_history(client, device_engine, store, local_data, events.message)
        finally:
            client.close()
    assert store.record is not None  # teacher_from_history kept one, or refused
    _print_result(
        {
            "teacher_round": store.record.round_id,
            "teacher_global_round": store.record.round_id - 1,
            "teacher_val_loss": store.record.val_loss,
            "teacher_val_accuracy": store.record.val_accuracy,
            "rounds_scored": len(losses),
            "val_losses": json.dumps(losses) if not as_json else losses,
            "engine": device_engine.name,
        },
        as_json,
        "device teacher",
    )


@device_app.command()
@command(DistillCommand)
def distill(options: DistillCommand) -> None:
    """PersFL stage 2: distil a student from the kept teacher over a (λ, T) grid; pick by validation accuracy.

    The held-out data is cut in halves: validation (choosing λ and T) and test (the reported accuracy).
    The chosen student is saved in --state as this device's model.
    """
    from edgepfl.device_runtime.persfl import TeacherStore, distill_batch_size, distill_steps, local_splits
    from edgepfl.device_runtime.persfl import distill as run_distill
    from edgepfl.device_runtime.progress import RichEvents

    seed, as_json = options.local.seed, options.output.as_json
    config = options.distill.config(seed)
    variant, trainable = config.variant, config.trainable
    device_engine, local_data, device_state = _open(options.files, options.local)
    device_engine.check_set(trainable)
    store = TeacherStore(options.files.state, device_engine.manifest)
    teacher = store.load()
    train_split, val_split, test_split = local_splits(local_data, seed)
    steps = distill_steps(len(train_split[1]), distill_batch_size(device_engine, config), config)
    with RichEvents(quiet=as_json) as events:
        events.start_bar(f"distill {variant}", steps)
        result = run_distill(
            device_engine,
            teacher,
            train_split,
            val_split,
            test_split,
            config,
            on_step=lambda loss: events.step("distill", 0, 0, loss),
        )
    record = {
        "persfl_distill": True,
        "variant": variant,
        "teacher_round": store.record.round_id,
        **{f"teacher_{k}": v for k, v in result.teacher.items()},
        **{f"student_{k}": v for k, v in result.student.items()},
        "val_samples": len(val_split[1]),
        "test_samples": len(test_split[1]),
        "engine": device_engine.name,
    }
    device_state.commit(device_engine.get_tensors(), {**record, "grid": result.grid})
    _print_result(record, as_json, "device distill")


@device_app.command("eval")
@command(EvalCommand)
def evaluate_command(options: EvalCommand) -> None:
    """Accuracy and loss of this device's personalized model on its held-out data."""
    from edgepfl.device_runtime.algorithms import evaluate
    from edgepfl.errors import StateError

    device_engine, local_data, device_state = _open(options.files, options.local)
    if device_state.state.tensors_file is None:
        raise StateError(
            f"{options.files.state} holds no trained model yet", "run `edgepfl device run` or `device train` first"
        )
    result = evaluate(device_engine, local_data)
    if not result.count:
        raise StateError("no held-out samples to evaluate", "pass --val-fraction above 0 and more data")
    _print_result(
        {
            "accuracy": result.accuracy,
            "loss": result.loss,
            "val_samples": result.count,
            "last_completed_round": device_state.state.last_completed_round,
            "engine": device_engine.name,
        },
        options.output.as_json,
        "device eval",
    )


@device_app.command()
@command(StatusCommand)
def status(options: StatusCommand) -> None:
    """What a device's state folder says now: its rounds, an update not yet delivered, and what it waits for and why.

    Reads without the folder's lock or a bundle, so it works while `edgepfl device run` holds the folder.
    """
    import time

    from edgepfl.device_runtime.state import read_state
    from edgepfl.device_runtime.waiting import read_wait
    from edgepfl.errors import StateError

    folder = options.state
    state, wait = read_state(folder), read_wait(folder)  # a device that never trained has a wait and no state.json
    if state is None and wait is None:
        raise StateError(f"{folder} holds no device state", "pass the --state folder of `edgepfl device run`")
    pending = state.pending_upload if state is not None else None
    history = state.history if state is not None else ()
    last = next((entry for entry in reversed(history) if entry.get("val_accuracy") is not None), {})
    _print_result(
        {
            "last_completed_round": state.last_completed_round if state is not None else None,
            "last_uploaded_round": state.last_uploaded_round if state is not None else None,
            "pending_upload_round": None if pending is None else pending.round_id,
            "pending_upload_deadline": None if pending is None else pending.deadline,
            "waiting_for": None if wait is None else wait.what,
            "waiting_why": None if wait is None else wait.why,
            "waiting_seconds": None if wait is None else round(time.time() - wait.since, 1),
            "val_accuracy": last.get("val_accuracy"),
            "engine": state.engine if state is not None else None,
            "state": str(folder),
        },
        options.output.as_json,
        "device status",
    )


def _open(files: DeviceFiles, local: LocalOptions) -> tuple[Engine, LocalData, StateFolder]:
    """Bundle, data and state, all checked before any training: an engine holding the saved tensors."""
    from edgepfl.data import load_device_data
    from edgepfl.device_runtime.engine import open_engine
    from edgepfl.device_runtime.runner import restore
    from edgepfl.device_runtime.state import StateFolder

    device_engine = open_engine(files.bundle, local.engine, threads=local.threads)
    local_data = load_device_data(
        files.data, device_engine.manifest, local.val_fraction, local.seed, device_engine.bundle_dir
    )
    device_state = StateFolder(files.state, device_engine.manifest, device_engine.name)
    restore(device_engine, device_state)
    # what the device learns of its data beside the samples (a text bundle: the person's own words), kept with it
    device_engine.manifest.kind.remember(Path(files.data), device_engine.bundle_dir, device_state.folder)
    return device_engine, local_data, device_state


def _device_token(access: ServerAccess) -> str:
    """The device token from exactly one of --token (or EDGEPFL_TOKEN) and --token-file."""
    from edgepfl.credentials import read_secret_file
    from edgepfl.errors import UsageError

    token, token_file = access.token, access.token_file
    if token_file is None and token is None:
        raise UsageError("no device token", "pass --token-file FILE (from `edgepfl device enroll`) or --token TOKEN")
    if token_file is not None and token is not None:
        raise UsageError("both --token (or EDGEPFL_TOKEN) and --token-file are given", "pass only one of them")
    return token if token_file is None else read_secret_file(token_file, "--token-file")


def _enroll_key_file(token_file: Path) -> Path:
    """Where `device enroll --token-file` keeps its enrollment key until the token is written."""
    return token_file.with_name(f"{token_file.name}.enroll-key")


def _enroll_key(key_file: Path | None) -> str:
    """This device's enrollment key: the one an earlier run left in `key_file` (its reply was lost), or a new
    random one, written to `key_file` (0600, atomically) before it is ever sent."""
    from edgepfl.credentials import read_secret_file, replace_secret_file

    if key_file is not None and key_file.exists():
        return read_secret_file(key_file, "enrollment key file")
    key = secrets.token_urlsafe(32)
    if key_file is not None:
        replace_secret_file(key_file, key, "enrollment key file")
    return key


def _print_result(result: dict[str, Any], as_json: bool, title: str) -> None:
    """JSON for machines (--json), a two-column table for people."""
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in result.items()}
    if as_json:
        typer.echo(json.dumps(clean))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=False)
    for key, value in clean.items():
        table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
    Console().print(table)


from edgepfl.device_runtime import model_cli  # noqa: E402,F401  registers `predict` and `export-model`
