"""A Flower strategy that runs any edgepfl strategy through `edgepfl serve`'s round engine, over Flower's Grid.

Flower's `Strategy.start` is the round loop; each of its hooks hands the work to the one `RoundEngine`
(driven in-process through its driver API, `edgepfl.server.driver`, as `edgepfl simulate` drives it):

- `configure_train`: every device polls, the engine opens and plans its next round (the edgepfl strategy's
  `configure_round`: one shared base, or one per device as pFedLA's), and each sampled device's node gets
  a message with its base and settings;
- `aggregate_train`: each reply becomes the bytes of an HTTP upload and goes through `accept_update` (layout
  hash, names, shapes, dtypes, finite values, sample counts, personal tensors refused); the engine then
  bounds and aggregates the accepted updates with the edgepfl strategy and stores the round. A round
  whose replies did not all arrive or pass closes at its deadline, like a served one.

The global base Flower passes to the hooks is not used: the engine's state folder holds the one global base.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from logging import ERROR, INFO, WARNING

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from edgepfl.errors import EdgePFLError, StateError
from edgepfl.flower.messages import metric, tensors_record, train_content, upload_payload
from edgepfl.flower.secure import secure_round
from edgepfl.protocol import EvalMetrics
from edgepfl.server.engine import RoundEngine
from edgepfl.server.errors import Refused
from edgepfl.server.secure.steps import steps_of


class EdgePFLStrategy(Strategy):
    """Flower's round loop over edgepfl's round engine: plan with the edgepfl strategy, accept as `serve`, aggregate."""

    def __init__(self, engine: RoundEngine, devices: Mapping[int, str]):
        self.engine = engine
        self.devices = dict(devices)  # Flower node id -> edgepfl device name
        self.nodes = {name: node for node, name in self.devices.items()}
        self.refusals: list[tuple[int, str, str]] = []  # (round, device or node, why) of every refused reply
        self.round_id = 0  # the engine's round being trained (an abandoned round makes it run ahead of Flower's)
        self._started = 0.0  # when the round's planning began (its `seconds` metric: messages, training, aggregation)
        self.grid: Grid | None = None  # the Grid of the round's train messages (a secure round sends more on it)

    def summary(self) -> None:
        """Log what runs the rounds."""
        log(INFO, "\t├── edgepfl strategy %s over edgepfl's round engine", self.engine.strategy.name)
        log(INFO, "\t└── devices: %s", ", ".join(sorted(self.nodes)))

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Open the engine's next round; a train message to each sampled device with its planned base and settings."""
        self._started = time.perf_counter()
        self.grid = grid
        self.round_id = self.engine.next_round_id()  # the engine opens the next round as it closes one, if devices wait
        plans = self.engine.open_round(self.round_id, sorted(self.nodes))
        if plans is None:  # only a DP budget stops the engine early, and the Flower app does not turn DP on
            raise StateError(f"the round engine stopped before round {self.round_id}", "see the server log")
        layout, steps = self.engine.manifest.base_layout_hash, steps_of(self.engine)
        return [
            Message(
                train_content(
                    self.round_id,
                    plan.settings,
                    plan.base,
                    layout,
                    steps.task(name, self.round_id) if steps is not None else None,
                ),
                dst_node_id=self.nodes[name],
                message_type=MessageType.TRAIN,
                group_id=str(self.round_id),
            )
            for name, plan in plans.items()
        ]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Accept each reply as `edgepfl serve` accepts an upload, then close the round in the engine."""
        round_id = self.round_id
        accepted: list[Message] = []
        if steps_of(self.engine) is not None:  # the replies carry key adverts; the updates stay on the nodes
            accepted = secure_round(self, round_id, replies)
            replies = []
        for reply in replies:
            device = self.devices.get(reply.metadata.src_node_id)
            try:
                self.accept(round_id, device, reply)
            except EdgePFLError as error:
                who = device or f"node {reply.metadata.src_node_id}"
                self.refusals.append((round_id, who, str(error)))
                log(WARNING, "round %d: the reply of %s is refused: %s", round_id, who, error)
                continue
            accepted.append(reply)
        record = self.engine.round(round_id)
        missing = record is not None and len(accepted) < len(record.sampled)
        try:
            global_base = self.engine.close_round(round_id, at_deadline=missing)
        except StateError as error:  # abandoned: fewer than min_clients accepted replies
            log(ERROR, "round %d: %s; the next round starts from the same base", round_id, error.problem)
            return None, None
        metrics = _round_metrics(accepted, len(self.refusals))
        metrics["seconds"] = time.perf_counter() - self._started
        return tensors_record(global_base), metrics

    def accept(self, round_id: int, device: str | None, reply: Message) -> None:
        """Check one reply exactly as an HTTP upload (the engine's `accept_update`) and store it; Refused if not."""
        if device is None:
            raise Refused("unknown_node", "the reply comes from a node this run never enrolled", "restart the run")
        if reply.has_error():
            raise Refused("device_failed", f"the device could not train: {reply.error.reason}", "see the node's log")
        if reply.metadata.group_id != str(round_id):
            raise Refused("round_closed", f"the reply is for round {reply.metadata.group_id!r}", "reply to this round")
        payload = upload_payload(reply)
        cap = self.engine.config.max_upload_bytes
        if len(payload) > cap:
            raise Refused(
                "too_large",
                f"the update is {len(payload)} bytes, more than the {cap} the server takes",
                f"raise max-upload-mb (now {self.engine.config.max_upload_mb:g})",
            )
        self.engine.accept_update(device, round_id, payload)
        self.accept_metrics(round_id, device, reply)

    def accept_metrics(self, round_id: int, device: str, reply: Message) -> None:
        """Store a reply's evaluation metrics as a device's POST /metrics; advisory: a refusal only warns."""
        accuracy, samples = metric(reply, "val-accuracy"), metric(reply, "val-samples")
        if accuracy is not None and samples:
            evaluation = EvalMetrics(accuracy, int(samples), metric(reply, "val-loss"))
            try:
                self.engine.accept_metrics(device, round_id, evaluation)
            except EdgePFLError as error:
                log(WARNING, "round %d: metrics of %s not stored: %s", round_id, device, error)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """No separate evaluation round: each device evaluates its personalized model as it trains, and replies so."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Nothing to aggregate (see configure_evaluate)."""
        return None


def _round_metrics(accepted: list[Message], refused: int) -> MetricRecord:
    """The round's sample-weighted train loss and held-out accuracy over the accepted replies."""
    metrics: dict[str, float | int] = {"accepted": len(accepted), "refused-so-far": refused}
    for key, weight in (("train-loss", "num-examples"), ("val-accuracy", "val-samples")):
        pairs = [(metric(r, key), metric(r, weight)) for r in accepted]
        pairs = [(value, count) for value, count in pairs if value is not None and count]
        total = sum(count for _, count in pairs)
        if total:
            metrics[key] = sum(value * count for value, count in pairs) / total
    return MetricRecord(metrics)
