"""The simulation loop: many clients and one server strategy in one process, through the shared code.

Every client round is `device_runtime.algorithms.run_client_round` on an `Engine`, exactly as on a
device; every aggregation is the server's `Strategy.aggregate` on `AcceptedUpdate`s, exactly as in
`edgepfl serve`. One engine is shared by all clients: a client's tensors (personal part and BatchNorm
statistics) are swapped in before its round and kept after it, like a device's saved state.

After each round every client is evaluated on its own test split with the round's new global base
and its own personal part (and on its validation split, which picks the "best" round: never the test
split). State is written after each round, so an interrupted run resumes from its last completed round.

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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgepfl.atomic import write_bytes_atomic
from edgepfl.data import LocalData, check_labels, normalize, to_model_layout
from edgepfl.device_runtime.algorithms import evaluate, run_client_round, upload_tensors
from edgepfl.device_runtime.engine import Engine
from edgepfl.device_runtime.persfl import TeacherStore, consider_global_model, distill
from edgepfl.errors import DataError, StateError
from edgepfl.manifest import Manifest, load_manifest
from edgepfl.protocol import RoundSettings
from edgepfl.simulate.config import SimulateConfig
from edgepfl.simulate.results import Results, RoundRecord, accuracy_summary, load_results, write_results
from edgepfl.wire import decode_metadata, decode_tensors, encode_tensors

STATE_FILE = "state.safetensors"
STRATEGY_STATE = "strategy/state"  # what the server strategy learnt (pFedLA's hypernetworks), as raw bytes
BUNDLE_DIR = "bundle"
TEACHERS_DIR = "teachers"  # persfl: one device-style state folder per client holding its TeacherStore
# per-round progress: (round, clients done, clients this round)
RoundProgress = Callable[[int, int, int], None]


@dataclass
class Client:
    """One simulated device: its data splits and its kept tensors."""

    name: str
    train: LocalData  # train_index: training samples; val_index: validation samples
    test: LocalData  # val_index: its test samples (evaluate() reads the held-out positions)
    seed: int
    tensors: dict[str, np.ndarray]


def round_settings(config: SimulateConfig) -> RoundSettings:
    """The settings the strategy hands every sampled client."""
    plan = config.plan
    return RoundSettings(
        algorithm=plan.client,
        epochs=config.epochs,
        batch_size=config.batch_size,
        lr=config.lr,
        finetune_epochs=config.finetune_epochs if plan.finetune else 0,
        personal_epochs=config.personal_epochs,
        share_buffers=config.share_buffers,
    )


def run_simulation(
    config: SimulateConfig,
    progress: RoundProgress | None = None,
    status: Callable[[str], None] = lambda _: None,
) -> Results:
    """Run (or resume) an experiment into `config.out`; returns the results also written there."""
    config.check()
    out = Path(config.out)
    previous = load_results(out) if (out / "results.json").is_file() else None
    if previous is not None:
        differ = previous.config.same_experiment(config)
        if differ:
            raise StateError(
                f"{out} holds a run with a different {', '.join(differ[:3])}",
                "pass the same options to resume it, or choose another --out",
            )
    status("loading data")
    from edgepfl.datasets import load_dataset
    from edgepfl.partition import make_partition

    dataset = load_dataset(config.dataset, config.data_root, download=config.download, checksums=config.checksums)
    clients_wanted = None if config.partition.startswith("file:") else config.clients
    parts = make_partition(config.partition, dataset.y_train, dataset.y_test, clients_wanted, config.seed, config.split)
    status("exporting the model")
    manifest = ensure_bundle(config, out / BUNDLE_DIR, dataset.sample_shape, dataset.num_classes)
    engine = open_sim_engine(config.engine, out / BUNDLE_DIR, manifest, config.threads)
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
        clients.append(_make_client(number, part, dataset, manifest, config.seed, initial))
    strategy = None
    if config.plan.strategy is not None:
        from edgepfl.server.config import StrategyOptions
        from edgepfl.server.strategies import make_strategy

        options = StrategyOptions(
            settings=settings,
            clients=len(clients),
            hn_lr=config.hn_lr,
            seed=config.seed,
            retain_top_k=config.retain_top_k,
        )
        strategy = make_strategy(config.plan.strategy, manifest.shared(settings.share_buffers), options)
        strategy.check_manifest(manifest)
    global_base = upload_tensors(engine, settings)
    records: list[RoundRecord] = []
    start = 1
    if previous is not None and (out / STATE_FILE).is_file():
        done, global_base = _load_state(out / STATE_FILE, clients, global_base, strategy)
        records = [r for r in previous.rounds if r.round <= done]
        if len(records) != done:
            raise StateError(f"{out} has state for round {done} but results for {len(records)}", "use a new --out")
        start = done + 1
    stores = _teacher_stores(out / TEACHERS_DIR, clients, manifest, fresh=start == 1) if config.plan.persfl else None
    results = Results(config=config, rounds=records, info=_run_info(config, dataset, manifest, engine, parts))
    write_results(out, results)
    names = [client.name for client in clients]
    by_name = {client.name: client for client in clients}
    for round_id in range(start, config.rounds + 1):
        started = time.perf_counter()
        from edgepfl.server.engine import sample_devices

        sampled = sample_devices(config.seed, round_id, names, config.fraction, config.min_clients)
        updates, losses, bytes_up, bytes_down, bytes_kept = [], [], 0, 0, 0
        start_val_loss: dict[str, float] = {}
        base_bytes = len(encode_tensors(global_base)) if global_base else 0
        for done_count, name in enumerate(sampled):
            client = by_name[name]
            engine.set_tensors(client.tensors)
            device_base, device_settings = global_base, settings
            if strategy is not None and strategy.needs_per_device_payload:  # e.g. pFedLA: each client its own base
                device_settings, device_base = strategy.configure_device(round_id, name, global_base)
                # a tensor kept on the client is neither sent nor uploaded (HeurpFedLA)
                kept = device_settings.kept_on_device
                bytes_kept += 2 * sum(global_base[key].nbytes for key in kept)
                bytes_down += len(encode_tensors(device_base))
            else:
                bytes_down += base_bytes
            if stores is not None:  # persfl stage 1: the device's own teacher choice, before local training
                _, scores = consider_global_model(engine, stores[name], round_id, device_base, client.train)
                start_val_loss[name] = scores.loss
            engine.set_tensors(device_base)
            result = run_client_round(engine, device_settings, client.train, client.seed, round_id)
            client.tensors = engine.get_tensors()
            if not math.isnan(result.train_loss):
                losses.append(result.train_loss)
            if result.uploads and strategy is not None:
                from edgepfl.server.strategy import AcceptedUpdate

                upload = upload_tensors(engine, device_settings)
                bytes_up += len(encode_tensors(upload))
                updates.append(AcceptedUpdate(name, result.num_samples, upload, result.train_loss, result.val_accuracy))
            if progress is not None:
                progress(round_id, done_count + 1, len(sampled))
        if strategy is not None and updates:
            global_base = strategy.aggregate(round_id, iter(updates), global_base)
        test_acc, val_acc = [], []
        for client in clients:
            engine.set_tensors(client.tensors)
            engine.set_tensors(_evaluated_base(strategy, round_id, client.name, global_base))
            test_acc.append(evaluate(engine, client.test).accuracy)
            val_result = evaluate(engine, client.train)
            val_acc.append(val_result.accuracy if val_result.count else math.nan)
        records.append(
            RoundRecord(
                round=round_id,
                test_accuracy=accuracy_summary(test_acc),
                val_accuracy=accuracy_summary(val_acc),
                train_loss=float(np.mean(losses)) if losses else None,
                sampled=len(sampled),
                bytes_up=bytes_up,
                bytes_down=bytes_down,
                seconds=time.perf_counter() - started,
                bytes_kept=bytes_kept,
                start_val_loss=start_val_loss if stores is not None else None,
            )
        )
        if hasattr(strategy, "alpha_matrix"):  # pfedla: what the hypernetworks learnt (the paper's Fig. 6)
            results.alpha = {name: strategy.alpha_matrix(name).round(6).tolist() for name in strategy.mixed}
        write_results(out, results)
        _save_state(out / STATE_FILE, round_id, clients, global_base, strategy)
    if stores is not None:
        results.persfl = run_distillation(config, engine, clients, stores, status)
        write_results(out, results)
    return results


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
    return normalize(data.images[index], data.input_spec), data.labels[index]


def _teacher_stores(folder: Path, clients: list[Client], manifest: Manifest, fresh: bool) -> dict[str, TeacherStore]:
    """One TeacherStore per client; a fresh run first drops teachers an interrupted first round may have left."""
    if fresh and folder.is_dir():
        shutil.rmtree(folder)
    return {client.name: TeacherStore(folder / client.name, manifest) for client in clients}


def _evaluated_base(strategy, round_id: int, name: str, global_base: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The base a client is evaluated with after a round: the global one, or the one it would get next round."""
    if strategy is None or not strategy.needs_per_device_payload:
        return global_base
    return dict(strategy.configure_device(round_id + 1, name, global_base)[1])


def ensure_bundle(
    config: SimulateConfig, folder: Path, sample_shape: tuple[int, int, int], num_classes: int
) -> Manifest:
    """Export the run's bundle once (reused on resume); its input and classes follow the dataset."""
    from edgepfl.export.bundle import simulation_target

    target = simulation_target(config.model, sample_shape, num_classes, config.seed, config.width, config.norm)
    kp = {"zero": 0, "all": len(target.blocks), "given": config.kp}[config.plan.kp]
    if (folder / "manifest.json").is_file():
        manifest = load_manifest(folder)
        if manifest.model == target.description and manifest.kp == kp:
            return manifest
        raise StateError(f"{folder} holds a different model or kp", "use a new --out")
    from edgepfl.device_runtime.engine import training_build_installed
    from edgepfl.export.bundle import ExportOptions, export_target

    if config.engine == "portable" or not training_build_installed():
        engines: tuple[str, ...] = ("portable",)
    else:
        engines = ("ort-training",)  # fast to export; the torch engine takes its initial tensors from it
    options = ExportOptions(
        engines=engines, seed=config.seed, force=True, portable_batch=config.batch_size, distill=config.plan.persfl
    )
    return export_target(target, kp, folder, options)


def open_sim_engine(name: str, bundle: Path, manifest: Manifest, threads: int | None = None) -> Engine:
    """torch (eager, reads the bundle's initial tensors), portable or ort-training (the device engines)."""
    from edgepfl.device_runtime.engine import open_engine

    if name != "torch":
        return open_engine(bundle, name, threads=threads)
    from edgepfl.simulate.torch_engine import TorchEngine

    return TorchEngine(bundle, manifest, initial_tensors(bundle), threads=threads)


def initial_tensors(bundle: Path) -> dict[str, np.ndarray]:
    """The bundle's initial tensors: portable/initial.safetensors, else the ORT training checkpoint's."""
    from edgepfl.wire import load_tensors

    path = Path(bundle) / "portable" / "initial.safetensors"
    if path.is_file():
        return load_tensors(path)
    from edgepfl.device_runtime.engine import open_engine

    return open_engine(bundle, "ort-training").get_tensors()


def _make_client(number: int, part, dataset, manifest: Manifest, seed: int, initial: dict) -> Client:
    """A client's LocalData: train+val for training (val held out), test as a second held-out view."""
    order = np.concatenate([part.train, part.val, part.test])
    images = to_model_layout(dataset.images(order), manifest.input, what=f"client {number} images")
    labels = check_labels(dataset.targets(order), manifest.num_classes, len(order), what=f"client {number} labels")
    n_train, n_val = len(part.train), len(part.val)
    train_index = np.arange(n_train)
    val_index = np.arange(n_train, n_train + n_val)
    test_index = np.arange(n_train + n_val, len(order))
    train = LocalData(images, labels, train_index, val_index, manifest.input)
    test = LocalData(images, labels, train_index, test_index, manifest.input)
    client_seed = int(np.random.SeedSequence([seed, number]).generate_state(1)[0])
    return Client(f"client-{number:03d}", train, test, client_seed, {k: v.copy() for k, v in initial.items()})


def _save_state(
    path: Path, round_id: int, clients: list[Client], global_base: dict[str, np.ndarray], strategy=None
) -> None:
    tensors = {f"global/{name}": value for name, value in global_base.items()}
    for client in clients:
        tensors.update({f"{client.name}/{name}": value for name, value in client.tensors.items()})
    strategy_state = strategy.state_bytes() if strategy is not None else None
    if strategy_state is not None:  # in the same file, so clients and strategy are saved atomically together
        tensors[STRATEGY_STATE] = np.frombuffer(strategy_state, dtype=np.uint8)
    write_bytes_atomic(path, encode_tensors(tensors, metadata={"round": str(round_id)}))


def _load_state(
    path: Path, clients: list[Client], global_base: dict, strategy=None
) -> tuple[int, dict[str, np.ndarray]]:
    payload = path.read_bytes()
    try:
        done = int(decode_metadata(payload)["round"])
    except (KeyError, ValueError):
        raise StateError(f"{path} does not say which round it holds", "delete the run folder and start again") from None
    tensors = decode_tensors(payload)
    try:
        base = {name: tensors[f"global/{name}"] for name in global_base}
        for client in clients:
            client.tensors = {name: tensors[f"{client.name}/{name}"] for name in client.tensors}
    except KeyError as missing:
        raise StateError(f"{path} lacks tensor {missing}", "resume with the same options or use a new --out") from None
    if STRATEGY_STATE in tensors and strategy is not None:
        strategy.load_state(tensors[STRATEGY_STATE].tobytes())
    return done, base


def _run_info(config: SimulateConfig, dataset, manifest: Manifest, engine: Engine, parts) -> dict[str, Any]:
    return {
        "dataset": dataset.description,
        "dataset_verified": dataset.verified,
        "clients": len(parts),
        "client_sizes": [int(p.size) for p in parts],
        "kp": manifest.kp,
        "blocks": len(manifest.blocks),
        "engine": engine.name,
        "client_algorithm": config.plan.client,
        "strategy": config.plan.strategy,
        "evaluation": "after each round's aggregation: global base + each client's personal part, on its test split",
    }
