"""The edgepfl ServerApp: enrol the connected nodes as devices, then Flower's round loop over edgepfl's round engine.

Before round 1 it waits for `nodes` SuperNodes and asks each which device it is (`query.edgepfl_device`):
a node whose bundle has another base layout, or whose name another node already took, is left out with
one line in the log. The devices are enrolled in a fresh round engine over OUT/server (the state folder
of `edgepfl serve`), and `EdgePFLStrategy.start` runs the rounds.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from logging import ERROR, INFO, WARNING
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Result

from edgepfl.errors import EdgePFLError, UsageError
from edgepfl.flower.config import ServerRunConfig, server_config
from edgepfl.flower.messages import DEVICE, DEVICE_QUERY, tensors_record
from edgepfl.flower.strategy import EdgePFLStrategy
from edgepfl.manifest import Manifest, load_manifest
from edgepfl.server.config import ServerConfig

NODE_POLL = 1.0  # seconds between looks at the connected nodes while waiting for `nodes`


def make_server_app(overrides: Mapping[str, Any] | None = None) -> ServerApp:
    """The edgepfl ServerApp; `overrides` are run-config keys over the run's own (run_simulation passes none)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        """Run the federation; an edgepfl error ends it with its one line in the log."""
        try:
            run_federation(grid, server_config({**context.run_config, **(overrides or {})}))
        except EdgePFLError as error:
            log(ERROR, "edgepfl: %s", error)

    return app


app = make_server_app()  # `serverapp = "edgepfl.flower.server_app:app"`


def run_federation(grid: Grid, config: ServerRunConfig) -> Result:
    """Enrol the nodes, then run `config.rounds` rounds through edgepfl's round engine; Flower's result."""
    from edgepfl.simulate.bundle import initial_tensors
    from edgepfl.simulate.rounds import open_server

    manifest = load_manifest(config.bundle)
    devices = enrol_nodes(grid, manifest, config.nodes, config.timeout)
    if len(devices) < config.min_clients:
        raise UsageError(
            f"{len(devices)} node(s) enrolled as devices, fewer than min-clients {config.min_clients}",
            "start more SuperNodes with this bundle, or lower min-clients",
        )
    config.out.mkdir(parents=True, exist_ok=True)
    fields = {**ServerConfig.shared_fields(config), "round_timeout": config.timeout}
    server = open_server(config.out, sorted(devices.values()), initial_tensors(config.bundle), fields, fresh=True)
    try:
        strategy = EdgePFLStrategy(server, devices)
        initial = tensors_record(server.global_base())
        return strategy.start(grid, initial, num_rounds=config.rounds, timeout=config.timeout)
    finally:
        server.close()


def enrol_nodes(grid: Grid, manifest: Manifest, nodes: int, timeout: float) -> dict[int, str]:
    """Wait up to `timeout` s for `nodes` nodes; the node id -> device name of each that answers with this bundle."""
    deadline = time.monotonic() + timeout
    node_ids = sorted(grid.get_node_ids())
    while len(node_ids) < nodes:
        if time.monotonic() >= deadline:
            raise UsageError(
                f"{len(node_ids)} of {nodes} SuperNodes connected within {timeout:g} s",
                "start the SuperNodes (flower-supernode ... --superlink HOST:9092), or lower nodes in the run config",
            )
        time.sleep(NODE_POLL)
        node_ids = sorted(grid.get_node_ids())
    queries = [Message(RecordDict(), dst_node_id=node, message_type=DEVICE_QUERY) for node in node_ids]
    devices: dict[int, str] = {}
    answered = set()
    for reply in grid.send_and_receive(queries, timeout=timeout):
        node = reply.metadata.src_node_id
        answered.add(node)
        try:
            devices[node] = _device_of(reply, manifest, set(devices.values()))
        except EdgePFLError as error:
            log(WARNING, "node %d is left out: %s", node, error)
    for node in sorted(set(node_ids) - answered):
        log(WARNING, "node %d is left out: it did not answer within %g s (is its ClientApp edgepfl's?)", node, timeout)
    log(INFO, "edgepfl: %d device(s) enrolled: %s", len(devices), ", ".join(sorted(devices.values())))
    return devices


def _device_of(reply: Message, manifest: Manifest, taken: set[str]) -> str:
    """The device name a handshake reply gives, checked: no error, this bundle's layout, a name not yet taken."""
    if reply.has_error():
        raise UsageError(f"it could not say which device it is: {reply.error.reason}", "see the node's log")
    record = reply.content.get(DEVICE)
    name = record.get("name") if isinstance(record, ConfigRecord) else None
    layout = record.get("base_layout_hash") if isinstance(record, ConfigRecord) else None
    if not isinstance(name, str) or not isinstance(layout, str):
        raise UsageError("it does not run the edgepfl ClientApp", "use clientapp = edgepfl.flower.client_app:app")
    if layout != manifest.base_layout_hash:
        raise UsageError(
            f"its bundle has base layout {layout[:12]}…, the server's {manifest.base_layout_hash[:12]}…",
            "give every node the server's bundle",
        )
    if name in taken:
        raise UsageError(f"another node is already device {name!r}", "give each node its own device-name/partition-id")
    return name
