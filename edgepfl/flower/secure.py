"""A secure round over Flower's Grid: the train replies carry the nodes' key adverts (their updates stay on the
nodes), then one query message per node and step (`query.edgepfl_secagg`) carries the engine's key book, share
inbox and unmask request, and its reply the node's shares, masked vector and reveal, each through the engine's
secure steps (server/secure/steps.py), as an HTTP device's message. A step the nodes that answered complete closes
at once; one a node did not answer closes at its time (`end_step`), and the round goes on without it if the
threshold allows.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import WARNING
from typing import TYPE_CHECKING

from flwr.app import Message
from flwr.common import log

from edgepfl.errors import EdgePFLError
from edgepfl.flower.messages import SECAGG_QUERY, secure_content, secure_step_of
from edgepfl.secagg import to_json
from edgepfl.server.errors import Refused
from edgepfl.server.secure.steps import SecureSteps, end_step, steps_of

if TYPE_CHECKING:
    from edgepfl.flower.strategy import EdgePFLStrategy

STEPS = (("book", "shares"), ("inbox", "masked"), ("unmask", "reveal"))  # what the engine sends, what comes back


def secure_round(strategy: EdgePFLStrategy, round_id: int, replies: Iterable[Message]) -> list[Message]:
    """Take the train replies' adverts, then the round's steps with the nodes; the train replies accepted."""
    engine, steps = strategy.engine, _steps(strategy)
    accepted = []
    for reply in replies:
        device = strategy.devices.get(reply.metadata.src_node_id)
        if _take(strategy, round_id, device, reply, "advert"):
            strategy.accept_metrics(round_id, device, reply)
            accepted.append(reply)
    end_step(engine, round_id)
    for step, kind in STEPS:
        messages = []
        for device in sorted(strategy.nodes):
            try:
                data = {"book": steps.book, "inbox": steps.inbox, "unmask": steps.request}[step](device, round_id)
            except Refused:  # not (or no longer) in the round: it dropped out at an earlier step
                continue
            if data is None:  # the round failed or closed meanwhile
                break
            content = secure_content(step, to_json(data), round_id=round_id)
            messages.append(
                Message(content, dst_node_id=strategy.nodes[device], message_type=SECAGG_QUERY, group_id=str(round_id))
            )
        if not messages or engine.round(round_id).state != "open":
            break
        for reply in strategy.grid.send_and_receive(messages, timeout=engine.config.round_timeout):
            _take(strategy, round_id, strategy.devices.get(reply.metadata.src_node_id), reply, kind)
        end_step(engine, round_id)
    return accepted


def _take(strategy: EdgePFLStrategy, round_id: int, device: str | None, reply: Message, kind: str) -> bool:
    """Hand one reply's message to the engine; a refusal is logged and kept with the strategy's refusals."""
    try:
        if device is None:
            raise Refused("unknown_node", "the reply comes from a node this run never enrolled", "restart the run")
        if reply.has_error():
            raise Refused("device_failed", f"the device could not answer: {reply.error.reason}", "see the node's log")
        got, body, _ = secure_step_of(reply)
        if got != kind:
            raise Refused("bad_secagg", f"the reply holds a {got} message, the step asks for {kind}", "reply in order")
        _steps(strategy).message(device, round_id, kind, body.encode() if isinstance(body, str) else body)
    except EdgePFLError as error:
        who = device or f"node {reply.metadata.src_node_id}"
        strategy.refusals.append((round_id, who, str(error)))
        log(WARNING, "round %d: the %s of %s is refused: %s", round_id, kind, who, error)
        return False
    return True


def _steps(strategy: EdgePFLStrategy) -> SecureSteps:
    steps = steps_of(strategy.engine)
    assert steps is not None, "secure_round runs for a secure engine only"
    return steps
