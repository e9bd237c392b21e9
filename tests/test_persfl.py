"""PersFL on the device: teacher selection (stage 1) and the distillation grid search (stage 2)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from edgepfl.data import LocalData, iterate_batches
from edgepfl.device_runtime.engine import open_engine
from edgepfl.device_runtime.persfl import (
    TEACHER_FOLDER,
    TEACHER_NAME,
    DistillConfig,
    TeacherStore,
    consider_global_model,
    distill,
    local_splits,
)
from edgepfl.device_runtime.state import StateFolder
from edgepfl.errors import StateError, UsageError
from edgepfl.kinds import ImageKind, InputSpec
from tests.conftest import REPO

DEMO = REPO / "edgepfl" / "simulate" / "data" / "mnist-demo.npz"


@pytest.fixture(scope="module")
def engine(bundle_factory):
    return open_engine(bundle_factory("mlp", 0, engines=("portable",), distill=True), "portable", threads=2)


@pytest.fixture(scope="module")
def digits(engine):
    data = np.load(DEMO)
    return engine.manifest.kind.normalize(data["x_train"]), data["y_train"].astype(np.int64)


def local_data(x, y, train, val) -> LocalData:
    """A device's data over (x, y) with the given train and held-out positions (x already normalised)."""
    spec = InputSpec(shape=tuple(x.shape[1:]))  # no mean/std: x is used as it is
    return LocalData(x, y, np.asarray(train), np.asarray(val), ImageKind(input=spec))


def train_epoch(engine, x, y, lr: float, epoch: int) -> None:
    for index in iterate_batches(len(y), engine.batch_size, seed=0, epoch=epoch):
        engine.train_step(x[index], y[index], lr=lr)


@pytest.mark.slow
def test_teacher_is_the_round_with_the_lowest_validation_loss(engine, digits, tmp_path):
    x, y = digits
    train = (x[:600], y[:600])
    device_data = local_data(x, y, np.arange(600), np.arange(2000, 2300))
    val = (x[2000:2300], y[2000:2300])
    initial = engine.get_tensors()
    # candidate global models whose order is not their quality: a little trained, well trained, spoiled, untrained
    train_epoch(engine, *train, lr=0.01, epoch=0)
    little = engine.get_tensors()
    for epoch in range(3):
        train_epoch(engine, *train, lr=0.05, epoch=epoch)
    good = engine.get_tensors()
    rng = np.random.default_rng(0)
    spoiled = {n: v + rng.normal(0, 0.2, v.shape).astype(np.float32) for n, v in good.items()}
    rounds = {1: little, 2: good, 3: spoiled, 4: initial}
    losses = {}
    for round_id, tensors in rounds.items():
        engine.set_tensors(tensors)
        losses[round_id] = engine.eval_batch(*val).loss
    best_round = min(losses, key=losses.get)
    assert best_round == 2 and len(set(losses.values())) == 4

    store = TeacherStore(tmp_path, engine.manifest)
    kept = [consider_global_model(engine, store, r, t, device_data)[0] for r, t in rounds.items()]
    assert kept == [True, True, False, False]
    assert store.record.round_id == best_round
    assert store.record.val_loss == pytest.approx(losses[best_round], rel=1e-6)
    # the last round's global model stays loaded for local training
    assert all(np.array_equal(engine.get_tensors()[n], initial[n]) for n in initial)

    reopened = TeacherStore(tmp_path, engine.manifest)  # from disk: what a restarted device sees
    assert reopened.record == store.record
    teacher = reopened.load()
    assert all(np.array_equal(teacher[n], good[n]) for n in good)
    files = sorted(p.name for p in (tmp_path / TEACHER_FOLDER).iterdir())
    assert files == sorted([TEACHER_NAME, "teacher-r2.safetensors"])  # the replaced round-1 file is gone
    # the device's own state commits (which clean up loose tensor files) leave the teacher alone
    device_state = StateFolder(tmp_path, engine.manifest, engine.name)
    device_state.commit(engine.get_tensors(), {"round": 4}, round_id=4)
    device_state.close()
    assert TeacherStore(tmp_path, engine.manifest).load().keys() == good.keys()


def test_damaged_or_foreign_teacher_state_is_refused(engine, tmp_path):
    from edgepfl.device_runtime.engine import EvalResult

    store = TeacherStore(tmp_path, engine.manifest)
    with pytest.raises(StateError, match="holds no PersFL teacher"):
        store.load()
    store.offer(1, engine.get_tensors(), EvalResult(loss_sum=2.0, correct=1, count=2))
    assert not store.offer(2, engine.get_tensors(), EvalResult(loss_sum=float("nan"), correct=1, count=2))
    (tmp_path / TEACHER_FOLDER / store.record.file).write_bytes(b"garbage")
    with pytest.raises(StateError, match="missing or damaged"):
        store.load()
    document = json.loads((tmp_path / TEACHER_FOLDER / TEACHER_NAME).read_text())
    document["base_layout_hash"] = "0" * 64
    (tmp_path / TEACHER_FOLDER / TEACHER_NAME).write_text(json.dumps(document))
    with pytest.raises(StateError, match="another bundle"):
        TeacherStore(tmp_path, engine.manifest)


def test_distill_config_refuses_bad_grids():
    with pytest.raises(UsageError, match="lambdas"):
        DistillConfig(lambdas=(0.5, 1.5))
    with pytest.raises(UsageError, match="temperatures"):
        DistillConfig(temperatures=(0.0,))
    with pytest.raises(UsageError, match="variant"):
        DistillConfig(variant="xx")


def split_client(x, y, classes, rng):
    """One non-IID client: the samples of `classes`, 60% train and 40% held out (validation and test halves)."""
    index = rng.permutation(np.flatnonzero(np.isin(y, classes)))
    cut = int(len(index) * 0.6)
    return local_data(x, y, np.sort(index[:cut]), np.sort(index[cut:]))


@pytest.mark.parametrize("variant", ["kd", "gd"])
def test_stage_two_improves_validation_accuracy_over_the_teacher(engine, digits, tmp_path, variant):
    x, y = digits
    rng = np.random.default_rng(0)
    clients = [split_client(x, y, [2 * c, 2 * c + 1, (2 * c + 2) % 10], rng) for c in range(4)]
    stores = [TeacherStore(tmp_path / f"device-{c}", engine.manifest) for c in range(4)]
    engine.set_tensors(load_initial(engine))
    global_model = engine.get_tensors()
    for round_id in range(1, 4):  # stage 1: FedAvg (K_P = 0), teacher chosen before each local training
        updates, weights = [], []
        for client, store in zip(clients, stores):
            consider_global_model(engine, store, round_id, global_model, client)
            train, _, _ = local_splits(client, seed=0)
            train_epoch(engine, *train, lr=0.05, epoch=round_id)
            updates.append(engine.get_tensors())
            weights.append(client.num_train)
        global_model = {n: np.average([u[n] for u in updates], axis=0, weights=weights) for n in global_model}
        global_model = {n: v.astype(np.float32) for n, v in global_model.items()}

    config = DistillConfig(lambdas=(0.1, 0.5, 0.9), temperatures=(1.0, 4.0), epochs=2, variant=variant)
    for client, store in zip(clients, stores):
        train, val, test = local_splits(client, seed=0)
        result = distill(engine, store.load(), train, val, test, config)
        assert result.student["val_accuracy"] > result.teacher["val_accuracy"]
        assert result.student["val_accuracy"] == max(p["val_accuracy"] for p in result.grid)
        assert len(result.grid) == 6 and 0 <= result.student["test_accuracy"] <= 1
        assert engine.eval_batch(*val).accuracy == result.student["val_accuracy"]  # the student stays loaded


def load_initial(engine):
    from edgepfl.wire import load_tensors

    return load_tensors(engine.bundle_dir / engine.manifest.engines["portable"]["initial"])


def test_a_newcomer_scores_the_kept_global_models_and_skips_released_and_poisoned_ones(engine, digits, tmp_path):
    """`device teacher`'s loop (runner.teacher_from_history): what it skips is said, what it scores is returned."""
    from edgepfl.device_runtime.client import HistoryEntry, ServerRefused
    from edgepfl.device_runtime.runner import teacher_from_history

    x, y = digits
    device_data = local_data(x, y, np.arange(300), np.arange(2000, 2200))
    shared = engine.tensors_by_role("base")
    poisoned = {name: np.full_like(value, np.nan) for name, value in shared.items()}

    class History:
        """A server whose history lists a released round, a poisoned model and a sane one."""

        def __init__(self, rounds: dict[int, dict | None]):
            self.rounds = rounds

        def history(self) -> list[HistoryEntry]:
            return [HistoryEntry(round_id, "", "") for round_id in self.rounds]

        def global_model(self, entry: HistoryEntry) -> dict:
            if self.rounds[entry.round_id] is None:
                raise ServerRefused("released", "", 410, "released")
            return self.rounds[entry.round_id]

    said: list[str] = []
    store = TeacherStore(tmp_path / "a", engine.manifest)
    losses = teacher_from_history(History({1: None, 2: poisoned, 3: shared}), engine, store, device_data, said.append)
    assert list(losses) == ["3"] and store.record is not None and store.record.round_id == 4
    assert said[0] == "round 1 was released meanwhile; skipped"
    assert said[1].startswith("the global model of round 2 holds NaN or Inf") and said[1].endswith("; skipped")
    assert said[2].startswith("global model of round 3: held-out loss ") and said[2].endswith("(kept as teacher)")
    with pytest.raises(StateError, match="no global model could be scored"):
        teacher_from_history(
            History({1: None}), engine, TeacherStore(tmp_path / "b", engine.manifest), device_data, said.append
        )
    with pytest.raises(StateError, match="the server keeps no global model yet"):
        teacher_from_history(
            History({}), engine, TeacherStore(tmp_path / "c", engine.manifest), device_data, said.append
        )
