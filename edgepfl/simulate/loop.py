"""The simulation loop: many clients and the served round engine in one process, through the shared code.

Every client round is `device_runtime.algorithms.run_client_round` on an `Engine`, exactly as on a
device; every round is sampled, planned, checked, aggregated and stored by `edgepfl serve`'s own
`RoundEngine` (see `simulate/rounds.py`), called in-process instead of over HTTP. One engine is shared
by all clients: a client's tensors (personal part and BatchNorm statistics) are swapped in before its
round and kept after it, like a device's saved state.

After each round every client is scored by the one protocol of `device_runtime.evaluation`: *held*, its
own tensors with the shared part it receives after the round (the new global base, or its pFedLA mix,
read without changing the strategy), on its test split (and on its validation split, which picks the
"best" round: never the test split), and *trained*, each sampled client right after its local training.
The clients' tensors are written once a round's uploads are in, before the close, so an interrupted run
resumes where it was.

PersFL (`--algorithm persfl`): stage 1 is FedAvg where every sampled client first scores the received
global model on its validation split and keeps the lowest-loss one as its teacher, through the device's
own `persfl.consider_global_model` and `TeacherStore` (one store per client under `teachers/`). After
the last round, stage 2 runs `persfl.distill` for every client (train / validation / test splits).
A resumed run keeps the teachers on disk (a rerun of an interrupted round offers the same global model
again, so the choice does not change); a run that starts from round 1 drops any teachers left there.
Stage 2 is recomputed whenever a run ends, from the kept teachers (students are not saved as state).
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from edgepfl.data import LocalData, check_samples, metric_description, scored
from edgepfl.device_runtime.engine import Engine
from edgepfl.device_runtime.evaluation import PROTOCOL, score
from edgepfl.device_runtime.persfl import TeacherStore, distill
from edgepfl.encoding import drop_residuals_after
from edgepfl.errors import DataError, StateError
from edgepfl.manifest import Manifest
from edgepfl.protocol import RoundSettings
from edgepfl.server.secure.steps import steps_of
from edgepfl.simulate.bundle import dataset_facts, ensure_bundle, open_sim_engine
from edgepfl.simulate.client_state import load_state, save_state
from edgepfl.simulate.config import PartitionOptions, SimulateConfig
from edgepfl.simulate.fleet import Fleet, FleetSpec
from edgepfl.simulate.fleet_loop import FleetRun

if TYPE_CHECKING:
    from edgepfl.server.engine import RoundEngine
from edgepfl.simulate.results import Results, RoundRecord, accuracy_summary, load_results, write_results
from edgepfl.simulate.rounds import LocalRounds, open_server
from edgepfl.simulate.secure import secure_steps
from edgepfl.simulate.workers import ClientData, RayWorkers, Sequential

STATE_FILE = "state.safetensors"  # every client's tensors (the server's state is the engine's, in OUT/server)
BUNDLE_DIR = "bundle"
TEACHERS_DIR = "teachers"  # persfl: one device-style state folder per client holding its TeacherStore
RESIDUALS_DIR = "residuals"  # --upload-encoding: one folder of error-feedback residuals per client
# per-round progress: (round, clients done, clients this round)
RoundProgress = Callable[[int, int, int], None]


@dataclass
class Client(ClientData):
    """One simulated device: its data splits (train: train and validation; test: its test samples as the held-out
    positions) and its kept tensors."""

    tensors: dict[str, np.ndarray]


def round_settings(config: SimulateConfig) -> RoundSettings:
    """The settings the strategy hands every sampled client."""
    return config.round_options().settings(config.secure.device_clip(config.privacy.clip_norm))


def run_simulation(
    config: SimulateConfig,
    progress: RoundProgress | None = None,
    status: Callable[[str], None] = lambda _: None,
) -> Results:
    """Run (or resume) an experiment into `config.out`; returns the results also written there."""
    out = Path(config.out)
    previous = load_results(out) if (out / "results.json").is_file() else None
    if previous is not None and config.on_a_clock and len(previous.rounds) < config.rounds:
        status("a fleet run does not resume: starting it again")
        previous = None  # its clock and events are not saved: the run starts again from round 1
    if previous is not None:
        differ = previous.config.same_experiment(config)
        if differ:
            raise StateError(
                f"{out} holds a run with a different {', '.join(differ[:3])}",
                "pass the same options to resume it, or choose another --out",
            )
    status("loading data")
    dataset, parts = load_partition(config.data, config.seed)
    status("exporting the model")
    facts = dataset_facts(dataset)
    manifest = ensure_bundle(config, out / BUNDLE_DIR, dataset.sample_shape, dataset.num_classes, facts)
    engine = open_sim_engine(config.engine, out / BUNDLE_DIR, manifest, config.threads, config.device)
    settings = round_settings(config)
    initial = engine.get_tensors()
    clients = []
    for number, part in enumerate(parts):
        if not len(part.test):
            raise DataError(f"client {number} has no test samples", "use a --split with a test share, e.g. 0.6,0.2,0.2")
        if config.plan.persfl and len(part.val) < 1:
            raise DataError(
                f"client {number} has no validation samples, on which persfl chooses its teacher",
                "use a --split with a validation share, e.g. 0.6,0.2,0.2",
            )
        clients.append(_make_client(number, part, dataset, manifest, config.seed, initial, out / RESIDUALS_DIR))
    names = [client.name for client in clients]
    resumable = previous is not None and (out / STATE_FILE).is_file()
    saved = load_state(out / STATE_FILE, clients) if resumable else None
    done, pending = saved if saved is not None else (0, None)
    for client in clients:  # residuals of a round whose client state was not saved are encoded again on resume
        drop_residuals_after(client.residuals, done)
    server = open_server(out, names, initial, config.server_options(), fresh=saved is None)
    workers = None
    try:
        if server.strategy is not None:
            server.strategy.check_manifest(manifest)
        records = [r for r in previous.rounds if r.round <= done] if previous is not None else []
        if server.closed_rounds() == done - 1:  # interrupted after the round's uploads, before its close
            server.tick()
        if server.strategy is not None and server.closed_rounds() != done:  # local keeps no server state
            raise StateError(f"{out} has client state for round {done} but its server is elsewhere", "use a new --out")
        if len(records) == done - 1 and pending is not None:  # interrupted before the round was evaluated
            records.append(_evaluate(engine, clients, server, server.global_base(), done, pending, settings))
        if len(records) != done:
            raise StateError(f"{out} has state for round {done} but results for {len(records)}", "use a new --out")
        stores = _teacher_stores(out / TEACHERS_DIR, clients, manifest, fresh=done == 0) if config.plan.persfl else None
        results = Results(config=config, rounds=records, info=_run_info(config, dataset, manifest, engine, parts))
        if records:  # resumed: the restored strategy's weights, also when no round is left to run
            results.alpha = _mixing_weights(server)
        write_results(out, results)
        teachers = out / TEACHERS_DIR if stores is not None else None
        workers = open_workers(config, out / BUNDLE_DIR, manifest, engine, clients, teachers)
        if config.on_a_clock:
            if len(records) < config.rounds:
                _run_fleet(config, server, engine, clients, workers, results, settings, progress)
        else:
            for round_id in range(done + 1, config.rounds + 1):
                record = _round(config, round_id, server, workers, engine, clients, settings, progress)
                if record is None:  # --dp-target-epsilon: one more round would exceed the budget
                    results.stopped = server.stopped
                    write_results(out, results)
                    status(results.stopped or "stopped")
                    break
                records.append(record)
                results.alpha = _mixing_weights(server)
                write_results(out, results)
    finally:
        if workers is not None:
            workers.close()
        server.close()
    if stores is not None:  # opened again: with --workers the teachers were chosen in the workers
        stores = _teacher_stores(out / TEACHERS_DIR, clients, manifest, fresh=False)
        results.persfl = run_distillation(config, engine, clients, stores, status)
        write_results(out, results)
    return results


def _round(
    config: SimulateConfig,
    round_id: int,
    server,
    workers,
    engine: Engine,
    clients: list[Client],
    settings,
    progress: RoundProgress | None,
) -> RoundRecord | None:
    """One round: every client polls, the sampled ones train (in `workers`) and upload, the round closes and every
    client is scored; None when the engine stops the run instead."""
    started = time.perf_counter()
    global_base = server.global_base()
    plans = server.open_round(round_id, [client.name for client in clients])
    if plans is None:
        return None
    by_name = {client.name: client for client in clients}
    losses, start_val_loss = [], {}
    trained_acc = {}  # evaluation.py's *trained* score of every sampled client
    traffic = {"bytes_up": 0, "bytes_down": 0, "bytes_kept": 0}
    current = {name: by_name[name].tensors for name in plans}
    uploaded = 0
    masked: dict[str, bytes] = {}  # a secure round's saved upload bodies, masked by their clients below
    for done_count, (name, outcome) in enumerate(workers.run(round_id, plans, current)):
        plan = plans[name]
        by_name[name].tensors = outcome.tensors
        traffic["bytes_down"] += plan.nbytes
        # a tensor kept on the client is neither sent nor uploaded (HeurpFedLA)
        traffic["bytes_kept"] += 2 * sum(global_base[key].nbytes for key in plan.settings.kept_on_device)
        if outcome.start_val_loss is not None:
            start_val_loss[name] = outcome.start_val_loss
        trained_acc[name] = outcome.trained_accuracy
        if not math.isnan(outcome.train_loss):
            losses.append(outcome.train_loss)
        if outcome.refused is not None:  # a device refuses a round's base or its diverged result, and says so
            server.accept_refusal(name, round_id, outcome.refused)
        if outcome.payload is not None and _open(server, round_id) and steps_of(server) is not None:
            masked[name] = outcome.payload
            uploaded += 1
        elif outcome.payload is not None and _open(server, round_id):  # through the served acceptance checks
            traffic["bytes_up"] += len(outcome.payload)
            server.accept_update(name, round_id, outcome.payload)
            uploaded += 1
        if progress is not None:
            progress(round_id, done_count + 1, len(plans))
    if masked and _open(server, round_id):  # the clients that trained mask their updates (simulate/secure.py)
        sent, received = secure_steps(server, round_id, masked, {name: by_name[name].seed for name in masked})
        traffic["bytes_up"] += sent
        traffic["bytes_down"] += received
    pending = {
        **traffic,
        "train_loss": float(np.mean(losses)) if losses else None,
        "sampled": len(plans),
        "seconds": time.perf_counter() - started,
        "start_val_loss": start_val_loss if config.plan.persfl else None,
        "trained_test_accuracy": accuracy_summary([trained_acc.get(c.name, math.nan) for c in clients]),
    }
    save_state(Path(config.out) / STATE_FILE, round_id, clients, pending)  # before the close: a resume finishes it
    record = server.round(round_id)
    if record is not None and record.state == "abandoned":  # a majority refused its base: the server rolled back
        raise StateError(
            f"round {round_id} was abandoned: {record.note}; a simulated run does not go on after a rollback",
            "lower --lr (the clients' training diverged), or check the data",
        )
    # a client that refused the round uploads nothing: the round closes at its deadline, as a served one would
    global_base = server.close_round(round_id, at_deadline=uploaded < len(plans))
    return _evaluate(engine, clients, server, global_base, round_id, pending, settings)


def _secure_summary(server: RoundEngine | LocalRounds, round_id: int) -> dict[str, Any] | None:
    """A secure round's counts for results.json (None: the round was not secure)."""
    steps = steps_of(server)
    return steps.summary(round_id) if steps is not None else None


def _open(server, round_id: int) -> bool:
    """Whether a round still takes uploads (a rollback abandons it; `local` has no rounds to close)."""
    record = server.round(round_id)
    return record is None or record.state == "open"


def _run_fleet(
    config: SimulateConfig,
    server,
    engine: Engine,
    clients: list[Client],
    workers,
    results: Results,
    settings,
    progress: RoundProgress | None,
) -> None:
    """The rounds on the fleet's virtual clock (fleet_loop.py); a record per closed round (fedbuff: step)."""
    out = Path(config.out)
    spec = FleetSpec.parse(config.fleet) if config.fleet else FleetSpec()
    fleet = Fleet(spec, [client.name for client in clients], config.seed)

    def evaluate(global_base, round_id: int, pending: dict, now: float) -> RoundRecord:
        record = _evaluate(engine, clients, server, global_base, round_id, pending, settings)
        return replace(record, virtual_time=now)

    def on_record(record: RoundRecord) -> None:
        results.rounds.append(record)
        write_results(out, results)

    FleetRun(server, engine, clients, workers, fleet, config.rounds, evaluate, on_record, progress).run()


def _evaluate(
    engine: Engine,
    clients: list[Client],
    server: RoundEngine | LocalRounds,
    global_base: dict[str, np.ndarray],
    round_id: int,
    pending: dict[str, Any],
    settings: RoundSettings,
) -> RoundRecord:
    """A round's record: every client's *held* score (evaluation.py), its own tensors with what it receives."""
    test_acc, val_acc = [], []
    for client in clients:
        received = server.evaluation_base(client.name, global_base)
        test_acc.append(score(engine, client.test, client.tensors, received, client.train, settings).accuracy)
        val_result = score(engine, client.train)
        val_acc.append(val_result.accuracy if val_result.count else math.nan)
    return RoundRecord(
        round=round_id,
        test_accuracy=accuracy_summary(test_acc),
        val_accuracy=accuracy_summary(val_acc),
        epsilon=server.epsilon(round_id),
        secure_aggregation=_secure_summary(server, round_id),
        **pending,
    )


def run_distillation(
    config: SimulateConfig,
    engine: Engine,
    clients: list[Client],
    stores: dict[str, TeacherStore],
    status: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """PersFL stage 2 for every client: `persfl.distill` from its kept teacher; the results.json `persfl` section.

    A client's `teacher_round` r is the global model it received at the start of round r (1: the initial model).
    """
    distill_config = config.distill_config()
    per_client = []
    for number, client in enumerate(clients):
        status(f"persfl distillation, client {number + 1}/{len(clients)}")
        store = stores[client.name]
        if store.record is None:  # with --fraction < 1 a client may never have received a global model
            per_client.append({"client": client.name, "teacher_round": None, "skipped": "never sampled: no teacher"})
            continue
        teacher = store.load()
        train, val = _arrays(client.train, client.train.train_index), _arrays(client.train, client.train.val_index)
        outcome = distill(engine, teacher, train, val, _arrays(client.test, client.test.val_index), distill_config)
        per_client.append(
            {
                "client": client.name,
                "teacher_round": store.record.round_id,
                "teacher_val_loss": store.record.val_loss,
                "lambda": outcome.student["lambda"],
                "T": outcome.student["T"],
                "teacher": outcome.teacher,
                "student": {k: v for k, v in outcome.student.items() if k not in ("lambda", "T")},
                "grid": outcome.grid,
            }
        )
    grid = {"lambdas": list(distill_config.lambdas), "temperatures": list(distill_config.temperatures)}
    section: dict[str, Any] = {"distill": {**asdict(distill_config), **grid}}
    for role in ("teacher", "student"):
        section[role] = {
            f"{split}_accuracy": accuracy_summary([e[role][f"{split}_accuracy"] for e in per_client if role in e])
            for split in ("val", "test")
        }
    section["clients"] = per_client
    return section


def _arrays(data: LocalData, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Normalised model inputs and labels of some of a client's samples."""
    return data.kind.normalize(data.images[index]), data.labels[index]


def _teacher_stores(folder: Path, clients: list[Client], manifest: Manifest, fresh: bool) -> dict[str, TeacherStore]:
    """One TeacherStore per client; a fresh run first drops teachers an interrupted first round may have left."""
    if fresh and folder.is_dir():
        shutil.rmtree(folder)
    return {client.name: TeacherStore(folder / client.name, manifest) for client in clients}


def open_workers(
    config: SimulateConfig, bundle: Path, manifest: Manifest, engine: Engine, clients: list[Client], teachers
) -> Sequential | RayWorkers:
    """Where the clients train: the driver's engine (`--workers 1`) or Ray actors with an engine each."""
    if config.workers == 1 and config.ray_address is None:
        return Sequential(engine, manifest, clients, teachers)
    opener = partial(open_sim_engine, config.engine, bundle, manifest, config.threads, config.device)
    data = [ClientData(c.name, c.train, c.test, c.seed, c.residuals) for c in clients]
    return RayWorkers(
        opener, manifest, data, teachers, config.workers, config.ray_address, config.client_cpus, config.client_gpus
    )


def load_partition(data: PartitionOptions, seed: int) -> tuple[Any, list[Any]]:
    """The run's dataset and its per-client parts (`--dataset`, `--partition`, `--clients`, `--split`, `--seed`)."""
    from edgepfl.datasets import load_partition as load

    return load(data, seed)


def client_data(data: PartitionOptions, seed: int, manifest: Manifest, number: int) -> tuple[str, LocalData, int]:
    """Client `number`'s name, training data and seed exactly as `run_simulation` makes them (a Flower node's)."""
    dataset, parts = load_partition(data, seed)
    if not 0 <= number < len(parts):
        raise DataError(
            f"client {number} does not exist: the partition {data.partition!r} makes {len(parts)} clients",
            f"use a client number (partition-id) in 0..{len(parts) - 1}",
        )
    client = _make_client(number, parts[number], dataset, manifest, seed, {}, Path(RESIDUALS_DIR))
    return client.name, client.train, client.seed


def _make_client(number: int, part, dataset, manifest: Manifest, seed: int, initial: dict, residuals: Path) -> Client:
    """A client's LocalData: train+val for training (val held out), test as a second held-out view."""
    order = np.concatenate([part.train, part.val, part.test])
    images, labels = check_samples(dataset.images(order), dataset.targets(order), manifest, what=f"client {number}")
    n_train, n_val = len(part.train), len(part.val)
    train_index = np.arange(n_train)
    val_index = scored(np.arange(n_train, n_train + n_val), labels, manifest)
    test_index = scored(np.arange(n_train + n_val, len(order)), labels, manifest)
    train = LocalData(images, labels, train_index, val_index, manifest.kind)
    test = LocalData(images, labels, train_index, test_index, manifest.kind)
    client_seed = int(np.random.SeedSequence([seed, number]).generate_state(1)[0])
    name = f"client-{number:03d}"
    return Client(name, train, test, client_seed, residuals / name, {k: v.copy() for k, v in initial.items()})


def _mixing_weights(server) -> dict[str, list[list[float]]] | None:
    """pFedLA's mixing weights as its hypernetworks now give them (the paper's Fig. 6); None for other strategies."""
    if not hasattr(server.strategy, "alpha_matrix"):
        return None
    return {name: server.strategy.alpha_matrix(name).round(6).tolist() for name in server.strategy.mixed}


def _run_info(config: SimulateConfig, dataset, manifest: Manifest, engine: Engine, parts) -> dict[str, Any]:
    return {
        "dataset": dataset.description,
        "dataset_verified": dataset.verified,
        "clients": len(parts),
        "client_sizes": [int(p.size) for p in parts],
        **({"client_names": list(dataset.client_names)} if getattr(dataset, "client_names", ()) else {}),
        "kp": manifest.kp,
        "personal": str(manifest.personal_spec),
        "blocks": len(manifest.blocks),
        "engine": engine.name,
        "client_algorithm": config.plan.client,
        "strategy": config.plan.strategy,
        "evaluation": PROTOCOL,
        "metric": metric_description(manifest),
    }
