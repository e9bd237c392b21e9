"""The one evaluation protocol of every method (issue 18): which model a round's accuracy is the accuracy of.

*held* (the headline number): the model the device holds and uses after round t — its own tensors as the
round left them (personal part) with the shared part it receives after the round laid over them: the new
global base (FedAvg, FedPer, FedAlt), its own next mix θ̄ᵢ (pFedLA; HeurpFedLA without the tensors it
keeps), nothing (local training); then, as the device does on receiving a base, its BatchNorm running
statistics re-estimated on its own training data under that base (statistics.py; `recompute_bn`, on by
default). On a device it is the held-out score of the received base before training starts
(`start_val_*` of round t+1) and the final score of `edgepfl device run`.

*trained* (reported beside it): the same device's model right after round t's local training, before
anything is received; a device that did not train in round t has none.

Both are `score(...)`; the simulator calls it for every client after every round, the device inside
`run_client_round`. No torch here: the device imports this module.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from edgepfl.data import LocalData
from edgepfl.device_runtime.engine import Engine, EvalResult
from edgepfl.device_runtime.statistics import receive
from edgepfl.protocol import RoundSettings

EVAL_BATCH_SIZE = 256
PROTOCOL = (
    "held: each client's model after the round (its own personal part as the round left it, with the shared "
    "part it receives after the round: the new global base, or its own pFedLA mix; BatchNorm statistics "
    "re-estimated on its training data under that base unless --no-recompute-bn); "
    "trained: the sampled client's model right after the round's local training"
)


def score(
    engine: Engine,
    data: LocalData,
    own: Mapping[str, np.ndarray] | None = None,
    received: Mapping[str, np.ndarray] | None = None,
    train: LocalData | None = None,
    settings: RoundSettings | None = None,
) -> EvalResult:
    """Held-out loss and accuracy on `data` of a device's model: `own` tensors (None: the engine's), then what it
    `received` (statistics.receive: re-estimated BatchNorm statistics on its `train` data when `settings` ask).

    held: own = the device's tensors after the round, received = the shared part it gets after the round;
    trained: own = the tensors right after local training (or None while the engine still holds them), no received.
    The engine is left holding the scored model.
    """
    if own is not None:
        engine.set_tensors(own)
    if received:
        if train is None or settings is None:
            raise ValueError("a held score needs the device's training data and the round's settings")
        receive(engine, received, train, settings)
    return evaluate(engine, data)


def evaluate(engine: Engine, data: LocalData, batch_size: int = EVAL_BATCH_SIZE) -> EvalResult:
    """Loss and accuracy of the engine's current (personalized) model on the held-out data."""
    loss_sum, correct, count = 0.0, 0, 0
    for x, y in data.val_batches(batch_size):
        result = engine.eval_batch(x, y)
        loss_sum, correct, count = loss_sum + result.loss_sum, correct + result.correct, count + result.count
    return EvalResult(loss_sum=loss_sum, correct=correct, count=count)
