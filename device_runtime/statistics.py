"""BatchNorm running statistics re-estimated when a device receives a base (issue 18).

A device's running statistics were accumulated under the base it trained; laid under a new base they
describe activations that no longer occur, and the held model scores near chance (FedPer on MobileNet,
bench/results/NOTES-issue18.md §2). So whenever a shared part arrives, the device recomputes them on its
own training data: one pass of training-mode forwards, no weight changes, nothing sent anywhere.

The estimate is the cumulative average over the pass (as `torch.optim.swa_utils.update_bn`): every
batch's mean and unbiased variance, weighted by its sample count. The engines only expose momentum
updates, so each batch starts from zero statistics and its own values are read back divided by the
layer's momentum. Batches are the training split in stored order (no shuffling: the estimate does not
depend on the round), full batches only where there is at least one.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from edgepfl.data import LocalData
from edgepfl.device_runtime.engine import Engine
from edgepfl.protocol import RoundSettings


def recompute_statistics(engine: Engine, data: LocalData, batch_size: int) -> int:
    """Replace every BatchNorm running statistic by its estimate under the current weights; returns the samples used.

    Weights are left bit-identical; a model without BatchNorm, or a device with fewer than 2 training samples,
    is untouched.
    """
    momenta = engine.statistics_momenta()
    if not momenta or data.num_train < 2:  # one sample has no variance on a 1x1 map: the statistics stay
        return 0
    weights = engine.get_tensors(engine.manifest.trainable("full"))
    zeros = {name: np.zeros(engine.manifest.tensor(name).shape, dtype=np.float32) for name in momenta}
    sums = {name: np.zeros(zero.shape, dtype=np.float64) for name, zero in zeros.items()}
    count = 0
    for x, y in data.train_batches_in_order(batch_size, full_only=data.num_train >= batch_size):
        engine.set_tensors(zeros)
        engine.statistics_step(x, y)
        for name, value in engine.get_tensors(momenta).items():
            sums[name] += value.astype(np.float64) * (len(x) / momenta[name])
        count += len(x)
    engine.set_tensors(weights)
    engine.set_tensors({name: (total / count).astype(np.float32) for name, total in sums.items()})
    return count


def receive(engine: Engine, tensors: Mapping[str, np.ndarray], data: LocalData, settings: RoundSettings) -> None:
    """Lay a received shared part over the device's own tensors, then re-estimate its BatchNorm statistics.

    The statistics are recomputed when the round's settings ask (`recompute_bn`, the default) and something
    arrived; the model the engine then holds is the device's *held* model (evaluation.py).
    """
    engine.set_tensors(tensors)
    if tensors and settings.recompute_bn:
        recompute_statistics(engine, data, settings.batch_size)
