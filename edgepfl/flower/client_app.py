"""The edgepfl device runtime as a Flower ClientApp: no torch on the node, either engine (ort-training or portable).

A node is one edgepfl device. It answers the server's handshake (`query.edgepfl_device`) with its name and
its bundle's base layout hash, and each train message with one round of the device runtime
(`round.train_round`: the received base checked and set, the round's algorithm, divergence refused, the
state committed): base tensors come in and go out under their manifest names; personal tensors (and
unshared BatchNorm statistics) stay in the device's durable state folder, which outlives the ClientApp.
Round settings come from the message's ConfigRecord. A problem on the node becomes an error reply
holding its one line (and the same line in the node's log), never a traceback.

Where a node's data comes from: `data=FOLDER` in its node config (the device's own samples, as `edgepfl
device run --data`), or `partition-id=N` (client N of the run's dataset partition, exactly as `edgepfl
simulate` makes it; Flower's simulation engine sets partition-id on each virtual node).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from logging import ERROR
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import log
from flwr.common.constant import ErrorCode

from edgepfl.data import LocalData
from edgepfl.device_runtime import secure_round
from edgepfl.device_runtime.algorithms import client_algorithm
from edgepfl.device_runtime.engine import Engine
from edgepfl.device_runtime.options import DeviceOptions
from edgepfl.device_runtime.round import train_round
from edgepfl.device_runtime.runner import DeviceEvents, restore
from edgepfl.device_runtime.state import StateFolder
from edgepfl.errors import BundleError, EdgePFLError, StateError, UsageError
from edgepfl.flower.config import node_config
from edgepfl.flower.messages import (
    DEVICE,
    reply_content,
    round_of,
    secure_content,
    secure_of,
    secure_step_of,
    tensors_of,
)
from edgepfl.manifest import Manifest


@dataclass
class Device:
    """One node's device: its engine (opened once per process) and bundle's initial tensors, data, seed and state."""

    name: str
    engine: Engine
    initial: dict[str, np.ndarray]
    data: LocalData
    seed: int
    state: Path
    persfl_teacher: bool = False  # PersFL stage 1 on the node: its teacher history in the state folder

    @property
    def manifest(self) -> Manifest:
        """The bundle's manifest."""
        return self.engine.manifest


def make_client_app(defaults: Mapping[str, Any] | None = None) -> ClientApp:
    """The edgepfl device as a ClientApp; `defaults` stand in for run-config keys the run does not set."""
    app = ClientApp()

    def device_of(context: Context) -> Device:
        return open_device(json.dumps({**(defaults or {}), **context.run_config}), json.dumps(context.node_config))

    @app.query("edgepfl_device")
    def handshake(message: Message, context: Context) -> Message:
        """Which device this node is, and the layout of its bundle's base."""

        def answer() -> RecordDict:
            device = device_of(context)
            identity = {"name": device.name, "base_layout_hash": device.manifest.base_layout_hash}
            return RecordDict({DEVICE: ConfigRecord(identity)})

        return _reply(message, answer)

    @app.train()
    def train(message: Message, context: Context) -> Message:
        """One round of the device runtime on the received base."""
        return _reply(message, lambda: train_device(device_of(context), message))

    @app.query("edgepfl_secagg")
    def secure_step(message: Message, context: Context) -> Message:
        """A secure round's step: the device answers the server's book, inbox or unmask request."""
        return _reply(message, lambda: secure_answer(device_of(context), message))

    return app


app = make_client_app()  # `clientapp = "edgepfl.flower.client_app:app"`


def train_device(device: Device, message: Message) -> RecordDict:
    """Train one round as the device runtime does; the reply's content (trained base, upload metadata, metrics)."""
    round_id, settings, layout = round_of(message.content)
    if layout != device.manifest.base_layout_hash:
        raise BundleError(
            f"the server trains a base with layout {layout[:12]}…, this node's bundle has "
            f"{device.manifest.base_layout_hash[:12]}…",
            "give the node the bundle the server was started with",
        )
    if not client_algorithm(settings.algorithm).uploads:
        raise UsageError(
            f"the {settings.algorithm} algorithm uploads nothing, so a Flower round would get no reply",
            "set algorithm to fedsim or fedalt in the run config (local needs no server)",
        )
    base = tensors_of(message.content, f"the base of round {round_id}")
    secure = secure_of(message.content)
    state = StateFolder(device.state, device.manifest, device.engine.name)
    try:
        last = state.state.last_completed_round
        if last is not None and round_id <= last:
            raise StateError(
                f"round {round_id} is already trained on this device (last trained: round {last})",
                "a round is never trained twice: the server goes on with the next one",
            )
        if not restore(device.engine, state):
            device.engine.set_tensors(device.initial)  # the engine is shared by the nodes of this process
        if state.state.pending_upload is not None:  # a round whose reply never left: it is over
            state.settle_upload(state.state.pending_upload.round_id, delivered=False)
        options = DeviceOptions(seed=device.seed, persfl_teacher=device.persfl_teacher)
        if secure is not None:  # the update stays on the node, masked in the steps to come (secure_answer)
            secure_round.begin(state.folder, secure, round_id)
        outcome = train_round(device.engine, device.data, state, round_id, settings, base, options, DeviceEvents())
        assert outcome.payload is not None, "an algorithm that uploads gives an upload body"
        if secure is not None:
            return secure_content("advert", secure_round.advert(state.folder, round_id), outcome.result)
        state.settle_upload(round_id, delivered=True)  # handed to Flower, which carries it from here
    finally:
        state.close()
    return reply_content(outcome.payload, outcome.result)


def secure_answer(device: Device, message: Message) -> RecordDict:
    """The node's answer to a secure step of the round whose update it holds (device_runtime/secure_round.py)."""
    step, text, round_id = secure_step_of(message)
    state = StateFolder(device.state, device.manifest, device.engine.name)
    try:
        pending = state.state.pending_upload
        payload = state.pending_payload()
        if (
            pending is None
            or payload is None
            or pending.round_id != round_id
            or not secure_round.holds(state.folder, round_id)
        ):
            raise StateError(f"this device holds no secure round {round_id}", "it rejoins the next round")
        text = text.decode() if isinstance(text, bytes) else text
        kind, body = secure_round.answer(state.folder, round_id, step, text, payload, device.seed)
        if kind == "reveal":  # its last message: the update is in the sum, or never will be
            state.settle_upload(round_id, delivered=True)
            secure_round.forget(state.folder, round_id)
    finally:
        state.close()
    return secure_content(kind, body, round_id=round_id)


@lru_cache(maxsize=1024)  # every node a process serves (a simulation's actor serves many)
def open_device(run_config: str, node_config_json: str) -> Device:
    """The device a node is (run and node config as JSON, the cache key): its engine is opened once per process."""
    config, partition = node_config(json.loads(run_config), json.loads(node_config_json))
    local = config.local
    engine, initial = _open_engine(str(config.bundle), local.engine, local.threads)
    if config.data is not None:
        from edgepfl.data import load_device_data

        if config.device_name is None:
            raise UsageError("a node with its own data needs a name", "set --node-config 'device-name=NAME data=...'")
        data = load_device_data(config.data, engine.manifest, local.val_fraction, local.seed, engine.bundle_dir)
        seed, name = local.seed, config.device_name
    elif partition is not None and config.partition_id is not None:
        from edgepfl.simulate.loop import client_data

        name, data, seed = client_data(partition, local.seed, engine.manifest, config.partition_id)
        name = config.device_name or name
    else:
        raise UsageError(
            "this node has no data",
            "set --node-config 'device-name=NAME data=FOLDER', or partition-id=N with a dataset in the run config",
        )
    from edgepfl.server.tokens import check_device_name

    check_device_name(name)
    state = config.state or config.state_root / name
    return Device(name, engine, initial, data, seed, state, config.persfl_teacher)


@lru_cache(maxsize=4)
def _open_engine(bundle: str, name: str, threads: int | None) -> tuple[Engine, dict[str, np.ndarray]]:
    """One engine per bundle and process, whichever node of the process trains on it, and its initial tensors."""
    from edgepfl.device_runtime.engine import open_engine

    engine = open_engine(bundle, name, threads=threads)
    return engine, engine.get_tensors()


def _reply(message: Message, answer: Callable[[], RecordDict]) -> Message:
    """The reply holding `answer()`, or an error reply holding its one line (logged on the node too)."""
    try:
        return Message(answer(), reply_to=message)
    except EdgePFLError as error:
        log(ERROR, "edgepfl device: %s", error)
        return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, str(error)), reply_to=message)
