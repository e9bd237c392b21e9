"""The round engine in-process with a fake clock: sampling, deadlines, restarts, bindings, plug-in strategies."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
from server_helpers import enroll, initial_tensors, make_bundle, upload_body, weighted_mean

from edgepfl.errors import BundleError, StateError, UsageError, WireError
from edgepfl.protocol import EvalMetrics, RoundSettings, Task, UploadMeta
from edgepfl.server.config import ServerConfig
from edgepfl.server.engine import RoundEngine, create_engine
from edgepfl.server.errors import Refused
from edgepfl.server.http_errors import status_of
from edgepfl.server.page import render_page
from edgepfl.server.store import Store
from edgepfl.server.strategies import strategy_options
from edgepfl.server.strategies.fedavg import FedAvg
from edgepfl.wire import decode_tensors, encode_tensors


class Clock:
    """A settable clock."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def setup(tmp_path: Path):
    manifest = make_bundle(tmp_path / "bundle")
    config = ServerConfig(bundle=tmp_path / "bundle", state=tmp_path / "state", min_clients=2, round_timeout=100)
    enroll(config.state, *[f"d{i}" for i in range(6)])
    return manifest, config, Clock()


def _open(engine: RoundEngine, clock: Clock, *names: str) -> None:
    """Devices poll; one poll interval later the round opens (not every enrolled device showed up)."""
    for name in names:
        engine.task(name)
    clock.now += engine.config.poll_interval
    for name in names:
        engine.task(name)


def _update(engine: RoundEngine, device: str, round_id: int, shift: float, num_samples: int, manifest) -> dict:
    base, _ = engine.base_for(device, round_id)
    new = {name: value + shift for name, value in decode_tensors(base).items()}
    engine.accept_update(device, round_id, upload_body(new, manifest, num_samples=num_samples))
    return new


def test_round_opens_when_enough_devices_poll_and_samples_deterministically(setup) -> None:
    manifest, config, clock = setup
    config = config.model_copy(update=dict(min_clients=2, fraction=0.5, seed=7))
    engine = create_engine(config, clock)
    assert engine.task("d0").action == "wait"
    for name in ("d1", "d2", "d3", "d4"):
        assert engine.task(name).action == "wait"  # quorum, but d5 may still show up within a poll interval
    assert engine.store.open_round() is None
    clock.now += config.poll_interval
    engine.tick()
    record = engine.store.open_round()
    assert record is not None and record.round_id == 1 and len(record.sampled) == 3  # ceil(0.5 * 5)
    # the same seed and the same available devices sample the same devices
    again = create_engine(config.model_copy(update=dict(state=config.state.parent / "other")), clock)
    enroll(again.config.state, *[f"d{i}" for i in range(6)])
    _open(again, clock, "d0", "d1", "d2", "d3", "d4")
    assert again.store.open_round().sampled == record.sampled
    tasks = {name: engine.task(name) for name in ("d0", "d1", "d2", "d3", "d4")}
    trainers = sorted(name for name, task in tasks.items() if task.action == "train")
    assert trainers == list(record.sampled)
    task = tasks[trainers[0]]
    assert Task.from_json(task.to_json()) == task
    assert task.base_url == "/v1/rounds/1/base" and task.deadline == record.opened + 100


def test_full_round_aggregates_once_and_chains_the_base(setup) -> None:
    manifest, config, clock = setup
    engine = create_engine(config.model_copy(update=dict(rounds=2)), clock)
    _open(engine, clock, "d0", "d1")
    uploads = [(_update(engine, "d0", 1, 1.0, 10, manifest), 10), (_update(engine, "d1", 1, 3.0, 30, manifest), 30)]
    engine.tick()
    record = engine.store.round(1)
    assert record.state == "closed"
    result = decode_tensors(engine.result_of(1)[0])
    for name, value in weighted_mean(uploads).items():
        np.testing.assert_allclose(result[name], value, rtol=1e-6)
    assert engine.store.round(2) is None  # quorum seen: the next round opens one poll interval later
    clock.now += config.poll_interval
    engine.tick()
    assert engine.store.round(2).base_sha == record.result_sha  # round 2 opened from round 1's result
    engine.tick()
    assert engine.store.count_closed() == 1


def test_deadline_closes_with_enough_uploads_and_refuses_stragglers(setup) -> None:
    manifest, config, clock = setup
    engine = create_engine(config, clock)
    _open(engine, clock, "d0", "d1", "d2")
    _update(engine, "d0", 1, 1.0, 5, manifest)
    _update(engine, "d1", 1, 2.0, 5, manifest)
    clock.now += 101
    with pytest.raises(Refused) as late:
        engine.check_upload_allowed("d2", 1)
    assert status_of(late.value) == 409 and late.value.error == "deadline_passed"
    engine.tick()
    assert engine.store.round(1).state == "closed"
    with pytest.raises(Refused) as closed:
        engine.check_upload_allowed("d2", 1)
    assert closed.value.error == "deadline_passed"  # a straggler is told why, even after the close


def test_too_few_uploads_abandon_the_round_and_keep_the_base(setup) -> None:
    manifest, config, clock = setup
    engine = create_engine(config, clock)
    _open(engine, clock, "d0", "d1")
    first_base = engine.store.round(1).base_sha
    _update(engine, "d0", 1, 1.0, 5, manifest)
    clock.now += 101
    engine.tick()
    assert engine.store.round(1).state == "abandoned"
    assert engine.store.count_closed() == 0
    _open(engine, clock, "d0", "d1")
    assert engine.store.round(2).base_sha == first_base


def test_restart_mid_round_keeps_uploads_and_crash_before_commit_does_not_aggregate_twice(setup) -> None:
    manifest, config, clock = setup
    engine = create_engine(config, clock)
    _open(engine, clock, "d0", "d1")
    first = _update(engine, "d0", 1, 1.0, 10, manifest)
    engine = create_engine(config, clock)  # as after kill -9: nothing in memory survives
    assert engine.task("d0").action == "wait"  # already uploaded
    assert engine.task("d1").action == "train"
    second = _update(engine, "d1", 1, 2.0, 30, manifest)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # the process dies between aggregation and the closing transaction

    engine.store.finish_round = crash
    with pytest.raises(KeyboardInterrupt):
        engine.tick()
    engine = create_engine(config, clock)
    assert engine.store.round(1).state == "open"
    engine.tick()
    assert [r.state for r in engine.store.rounds()] == ["closed"]
    result = decode_tensors(engine.result_of(1)[0])
    np.testing.assert_allclose(
        result["mid.weight"], weighted_mean([(first, 10), (second, 30)])["mid.weight"], rtol=1e-6
    )


def test_state_is_bound_to_bundle_and_strategy(setup, tmp_path: Path) -> None:
    _, config, clock = setup
    create_engine(config, clock).store.close()
    with pytest.raises(StateError, match="different strategy"):
        create_engine(config.model_copy(update=dict(strategy=strategy_options("median"))), clock)
    with pytest.raises(StateError, match="shared layout"):
        create_engine(sharing_bn_stats(config), clock)
    other = tmp_path / "other-bundle"
    make_bundle(other, kp=0)
    with pytest.raises(UsageError, match="kp=1"):
        fedavg = config.model_copy(update=dict(bundle=tmp_path / "bundle", strategy=strategy_options("fedavg")))
        create_engine(fedavg, clock)
    with pytest.raises(StateError, match="bundle base layout"):
        create_engine(config.model_copy(update=dict(bundle=other)), clock)


def test_initial_base_comes_from_the_bundle_or_init(tmp_path: Path) -> None:
    manifest = make_bundle(tmp_path / "bundle", with_initial=False)
    config = ServerConfig(bundle=tmp_path / "bundle", state=tmp_path / "state")
    with pytest.raises(BundleError, match="--init"):
        create_engine(config)
    init = tmp_path / "init.safetensors"
    from edgepfl.wire import save_tensors

    tensors = initial_tensors(manifest, seed=3)
    save_tensors(init, tensors)
    engine = create_engine(config.model_copy(update=dict(init=init)))
    stored = decode_tensors(engine.store.blobs.read(engine.store.get_meta("initial_base_sha")))
    assert sorted(stored) == sorted(manifest.names("base"))  # personal tensors in the file are not kept
    np.testing.assert_array_equal(stored["stem.weight"], tensors["stem.weight"])


def test_bn_statistics_travel_only_when_shared(setup) -> None:
    manifest, config, clock = setup
    engine = create_engine(sharing_bn_stats(config), clock)
    _open(engine, clock, "d0", "d1")
    base = decode_tensors(engine.base_for("d0", 1)[0])
    assert {"stem_bn.running_mean", "stem_bn.running_var"} <= set(base)
    assert "head_bn.running_mean" not in base  # personal-block statistics never travel
    _update(engine, "d0", 1, 1.0, 1, manifest)
    _update(engine, "d1", 1, 3.0, 1, manifest)
    engine.tick()
    result = decode_tensors(engine.result_of(1)[0])
    np.testing.assert_allclose(result["stem_bn.running_var"], base["stem_bn.running_var"] + 2.0, rtol=1e-6)


class OffsetPerDevice(FedAvg):
    """A plug-in strategy with per-device payloads (as pFedLA will have): base + the device's index."""

    name = "offset"

    def configure_round(
        self, round_id: int, sampled: Sequence[str], global_base: Mapping[str, np.ndarray]
    ) -> dict[str, tuple[RoundSettings, Mapping[str, np.ndarray]]]:
        plans = {}
        for device in sampled:
            offset = float(device.removeprefix("d"))
            shifted = {k: v + offset for k, v in global_base.items()}
            plans[device] = RoundSettings(epochs=2, extra={"offset": offset}), shifted
        return plans


def test_a_new_strategy_plugs_in_without_touching_the_engine(setup) -> None:
    manifest, config, clock = setup
    store = Store(config.state)
    strategy = OffsetPerDevice(manifest.by_role("base"), strategy_options("fedavg"), config.settings)
    engine = RoundEngine(config, manifest, store, strategy, clock)
    engine.bind_state()
    _open(engine, clock, "d1", "d3")
    task = engine.task("d3")
    assert task.settings.extra == {"offset": 3.0} and task.settings.epochs == 2
    d1 = decode_tensors(engine.base_for("d1", 1)[0])
    d3 = decode_tensors(engine.base_for("d3", 1)[0])
    np.testing.assert_allclose(d3["mid.weight"] - d1["mid.weight"], 2.0, rtol=1e-5)
    with pytest.raises(Refused, match="not sampled"):
        engine.base_for("d0", 1)


def test_corrupt_blob_is_excluded_not_aggregated(setup) -> None:
    manifest, config, clock = setup
    engine = create_engine(config.model_copy(update=dict(min_clients=2)), clock)
    _open(engine, clock, "d0", "d1", "d2")
    for i, name in enumerate(("d0", "d1", "d2")):
        _update(engine, name, 1, float(i), 1, manifest)
    victim = engine.store.update(1, "d2")
    engine.store.blobs.path(victim.blob_sha).write_bytes(b"bit rot")
    engine.tick()
    assert engine.store.round(1).state == "closed"
    assert engine.store.update(1, "d2").status == "corrupt"


def test_blob_tensors_are_checked_then_read_one_at_a_time(tmp_path: Path) -> None:
    store = Store(tmp_path / "state")
    try:
        tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(4, dtype=np.int64)}
        lazy = store.blobs.tensors(store.blobs.put(encode_tensors(tensors)))
        assert sorted(lazy) == ["a", "b"] and len(lazy) == 2
        for name, value in tensors.items():
            np.testing.assert_array_equal(lazy[name], value)
            assert lazy[name].dtype == value.dtype
        with pytest.raises(StateError, match="not valid safetensors"):  # named by its sha256, but not tensors
            store.blobs.tensors(store.blobs.put(b"not safetensors at all"))
        with pytest.raises(StateError, match="cannot be read"):
            store.blobs.tensors("0" * 64)
        rotten = store.blobs.put(encode_tensors(tensors))
        store.blobs.path(rotten).write_bytes(encode_tensors({"a": tensors["a"] + 1, "b": tensors["b"]}))
        with pytest.raises(StateError, match="does not match its sha256"):
            store.blobs.tensors(rotten)
    finally:
        store.close()


def test_metrics_and_status_page(setup) -> None:
    manifest, config, clock = setup
    engine = create_engine(config, clock)
    _open(engine, clock, "d0", "d1")
    _update(engine, "d0", 1, 1.0, 1, manifest)
    _update(engine, "d1", 1, 1.0, 1, manifest)
    engine.tick()
    assert engine.accept_metrics("d0", 1, EvalMetrics(0.75, 20, 0.4))["duplicate"] is False
    assert engine.accept_metrics("d0", 1, EvalMetrics(0.75, 20, 0.4))["duplicate"] is True
    with pytest.raises(Refused) as conflict:
        engine.accept_metrics("d0", 1, EvalMetrics(0.5, 20, 0.4))
    assert status_of(conflict.value) == 409
    with pytest.raises(Refused) as bad:
        engine.accept_metrics("d1", 1, EvalMetrics(1.5, 20))
    assert status_of(bad.value) == 422
    status = engine.status()
    assert status["rounds"][0]["eval_accuracy"]["mean"] == 0.75
    page = render_page(status)
    assert "data:image/png;base64," in page and "http" not in page.split("<body>")[1]
    assert status["class_names"] == [] and "classes:" not in page  # a bundle without class names
    assert status["personal"] == "output:1" and "personal <b>output:1</b>" in page  # the bundle's personal spec
    assert "classes: cat, dog &amp; co<" in render_page({**status, "class_names": ["cat", "dog & co"]})


@pytest.mark.filterwarnings("ignore:Using `httpx`")  # starlette asks for httpx2, not a dependency of ours
def test_an_unexpected_failure_is_one_json_500_and_the_app_keeps_serving(setup, monkeypatch) -> None:
    from fastapi.testclient import TestClient

    from edgepfl.server.app import create_app

    _, config, clock = setup
    engine = create_engine(config, clock)
    token = enroll(config.state, "probe")["probe"]

    def broken(device: str) -> Task:
        raise RuntimeError("a bug with a secret path /srv/x")

    monkeypatch.setattr(engine, "task", broken)
    with TestClient(create_app(engine), raise_server_exceptions=False) as client:
        headers = {"Authorization": f"Bearer {token}"}
        reply = client.get("/v1/task", headers=headers)
        assert reply.status_code == 500 and reply.json()["error"] == "server_error"
        assert "secret" not in reply.text and "Traceback" not in reply.text
        assert client.get("/v1/status", headers=headers).status_code == 200


def test_one_device_claiming_10m_samples_of_1e30_cannot_replace_the_base(setup) -> None:
    """Its delta is clipped to 3x the round's median delta norm and its weight capped at 2x the median count."""
    manifest, config, clock = setup
    engine = create_engine(config.model_copy(update=dict(min_clients=4)), clock)
    _open(engine, clock, "d0", "d1", "d2", "d3")
    base = decode_tensors(engine.base_for("d0", 1)[0])
    for name in ("d0", "d1", "d2"):
        _update(engine, name, 1, 0.01, 100, manifest)
    hostile = {name: np.full_like(value, 1e30) for name, value in base.items()}
    engine.accept_update("d3", 1, upload_body(hostile, manifest, num_samples=10_000_000))
    engine.tick()
    result = decode_tensors(engine.result_of(1)[0])
    for name, value in result.items():
        moved = np.abs(value.astype(np.float64) - base[name])
        # honest: +0.01 with weight 3 x 100; hostile: at most 3x their delta norm, with weight 200 of 500
        assert np.all(np.isfinite(value)) and moved.max() <= 0.6 * 0.01 + 0.4 * 3 * 0.01 + 1e-6, name


def test_the_bounds_clip_and_cap_one_outlier_exactly_and_can_be_turned_off(setup) -> None:
    manifest, config, clock = setup
    for multiples in ((3.0, 2.0), (0.0, 0.0)):
        state = config.state.parent / f"state-{multiples[0]}"
        enroll(state, "d0", "d1", "d2")
        changed = config.model_copy(update=dict(state=state, clip_multiple=multiples[0], weight_multiple=multiples[1]))
        engine = create_engine(changed.model_copy(update=dict(min_clients=3)), clock)
        _open(engine, clock, "d0", "d1", "d2")
        base = decode_tensors(engine.base_for("d0", 1)[0])
        _update(engine, "d0", 1, 1.0, 10, manifest)
        _update(engine, "d1", 1, 2.0, 10, manifest)
        _update(engine, "d2", 1, 100.0, 10_000, manifest)
        engine.tick()
        result = decode_tensors(engine.result_of(1)[0])
        if multiples == (0.0, 0.0):  # the plain weighted mean
            expected_shift = (10 * 1.0 + 10 * 2.0 + 10_000 * 100.0) / 10_020
        else:  # d2: clipped to 3 x the median delta (2.0) and weighted 2 x the median count (10)
            expected_shift = (10 * 1.0 + 10 * 2.0 + 20 * 6.0) / 40
        np.testing.assert_allclose(result["mid.weight"] - base["mid.weight"], expected_shift, rtol=1e-4)
        engine.store.close()


def test_every_refusal_code_the_server_raises_has_one_http_status() -> None:
    """The server names refusals by code only; server/http_errors.py's table gives each its status."""
    import re

    import edgepfl.server.engine as engine_module
    from edgepfl.server.http_errors import STATUS

    folder = Path(engine_module.__file__).parent
    source = "".join(path.read_text() for path in sorted(folder.glob("*.py")))
    raised = set(re.findall(r'Refused\(\s*"([a-z_]+)"', source))
    assert raised and raised <= set(STATUS), sorted(raised - set(STATUS))


OLD_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE devices (name TEXT PRIMARY KEY, token_hash TEXT NOT NULL UNIQUE, created REAL NOT NULL);
CREATE TABLE rounds (
    round_id INTEGER PRIMARY KEY, state TEXT NOT NULL, base_sha TEXT NOT NULL,
    opened REAL NOT NULL, deadline REAL NOT NULL, closed REAL, sampled TEXT NOT NULL,
    result_sha TEXT, aggregate_seconds REAL, note TEXT);
"""  # a state folder from before enrollment keys and before `PRAGMA user_version`


def test_a_state_folder_of_the_old_schema_is_migrated_and_keeps_everything(tmp_path: Path) -> None:
    import sqlite3

    from edgepfl.server.store import DB_NAME, MIGRATIONS
    from edgepfl.server.tokens import hash_token

    folder = tmp_path / "old-state"
    folder.mkdir()
    db = sqlite3.connect(folder / DB_NAME)
    db.executescript(OLD_SCHEMA)
    db.execute("INSERT INTO devices VALUES ('phone', ?, 1.0)", (hash_token("secret-token"),))
    db.execute("INSERT INTO meta VALUES ('global_base_sha', 'abc')")
    db.execute("INSERT INTO rounds VALUES (1, 'closed', 'abc', 1.0, 2.0, 3.0, '[\"phone\"]', 'def', 0.5, NULL)")
    db.commit()
    db.close()
    store = Store(folder)
    assert store.device_for_token(hash_token("secret-token")) == "phone"
    assert store.get_meta("global_base_sha") == "abc"
    assert store.round(1).sampled == ("phone",) and store.round(1).result_sha == "def"
    store.add_device("tablet", hash_token("t2"), 2.0, enroll_key_hash=hash_token("k" * 16))  # the added column
    assert store._query("PRAGMA user_version")[0][0] == len(MIGRATIONS)
    store.close()
    assert Store(folder).device_for_token(hash_token("t2")) == "tablet"  # opening again migrates nothing twice


def test_a_state_folder_of_a_newer_schema_is_refused(tmp_path: Path) -> None:
    import sqlite3

    from edgepfl.server.store import DB_NAME, MIGRATIONS

    Store(tmp_path / "state").close()
    db = sqlite3.connect(tmp_path / "state" / DB_NAME)
    db.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    db.commit()
    db.close()
    with pytest.raises(StateError, match="newer edgepfl"):
        Store(tmp_path / "state")


def test_the_manifest_names_the_trainable_sets(tmp_path: Path) -> None:
    from edgepfl.errors import BundleError

    personal = make_bundle(tmp_path / "kp1", kp=1)
    assert personal.trainable_sets() == {
        "full": ["stem.weight", "stem.bias", "mid.weight", "head.weight", "head.bias"],
        "personal": ["head.weight", "head.bias"],
        "base": ["stem.weight", "stem.bias", "mid.weight"],
    }
    assert sorted(make_bundle(tmp_path / "kp0", kp=0).trainable_sets()) == ["base", "full"]  # no personal set
    with pytest.raises(BundleError, match="unknown trainable set"):
        personal.trainable("head")


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (["--algorithm", "fedalt"], "--client-update"),
        (["--strategy", "pfedla", "--clients", "3"], "--pfedla-clients"),
        (["--share-buffers"], "--share-bn-stats"),
    ],
)
def test_old_serve_flag_names_still_work_and_name_the_new_one(old, new) -> None:
    from typer.testing import CliRunner

    from edgepfl.cli import app

    result = CliRunner().invoke(app, ["serve", *old])  # no --bundle: refused after the note
    assert result.exit_code == 2
    assert f"is now {new}" in result.output and "error: --bundle is required" in result.output


def sharing_bn_stats(config: ServerConfig) -> ServerConfig:
    """`config` with --share-bn-stats: base-block BatchNorm statistics travel."""
    return config.model_copy(update=dict(round=config.round.model_copy(update=dict(share_buffers=True))))


def test_status_reports_the_held_and_the_trained_accuracy_and_done_carries_the_settings(setup) -> None:
    """Issue 18's protocol on the server: each upload quotes the held model's accuracy as its round began
    (`start_val_accuracy`) beside the trained one; the final task tells devices how to take the final base."""
    manifest, config, clock = setup
    engine = create_engine(config.model_copy(update=dict(rounds=1)), clock)
    _open(engine, clock, "d0", "d1")
    for device, start in (("d0", 0.25), ("d1", 0.75)):
        base, _ = engine.base_for(device, 1)
        engine.accept_update(device, 1, upload_body(decode_tensors(base), manifest, start_val_accuracy=start))
    engine.tick()
    row = engine.status()["rounds"][0]
    assert row["start_val_accuracy"] == {"mean": 0.5, "min": 0.25, "max": 0.75, "count": 2}
    assert row["val_accuracy"]["mean"] == pytest.approx(0.8)
    assert "held acc at round start" in render_page(engine.status())
    done = engine.task("d0")
    assert done.action == "done" and done.settings is not None and done.settings.recompute_bn is True
    assert Task.from_json(done.to_json()) == done
    with pytest.raises(WireError, match="start_val_accuracy is outside"):
        UploadMeta.from_metadata({"base_layout_hash": "x", "num_samples": "3", "start_val_accuracy": "1.5"})
