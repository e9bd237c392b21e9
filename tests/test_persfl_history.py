"""PersFL new participants: the server keeps closed rounds' global models (--history N); a newcomer picks a teacher."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import REPO
from fastapi.testclient import TestClient
from server_helpers import LiveServer, enroll, make_bundle, upload_body
from test_device_e2e import device_command, run_args
from test_device_runtime import DEVICE_BUNDLE, class_images, save_npz
from test_persfl_e2e import device

from edgepfl.server.app import create_app
from edgepfl.server.config import ServerConfig
from edgepfl.server.engine import RoundEngine, create_engine
from edgepfl.server.errors import Refused
from edgepfl.server.http_errors import status_of
from edgepfl.wire import decode_tensors

ROUNDS = 5
HISTORY = 2


class Clock:
    """A settable clock."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _run_rounds(engine: RoundEngine, clock: Clock, manifest, count: int) -> None:
    """`count` rounds with d0 and d1, each uploading its base shifted by a different amount."""
    for _ in range(count):
        for name in ("d0", "d1"):
            engine.task(name)
        clock.now += engine.config.poll_interval
        for name in ("d0", "d1"):
            engine.task(name)
        round_id = engine.store.open_round().round_id
        for shift, name in ((1.0, "d0"), (3.0, "d1")):
            base = decode_tensors(engine.base_for(name, round_id)[0])
            body = upload_body({k: v + shift * round_id for k, v in base.items()}, manifest, num_samples=10)
            engine.accept_update(name, round_id, body)
        engine.tick()
        assert engine.store.round(round_id).state == "closed"


def _blob_files(engine: RoundEngine) -> set[str]:
    return {path.name.removesuffix(".safetensors") for path in engine.store.blob_dir.glob("*/*")}


def _needed_blobs(engine: RoundEngine) -> set[str]:
    """What the retained rounds and the server's meta name, computed from the records (not from the store's SQL)."""
    released = engine.store.released_through()
    needed = {engine.store.get_meta(key) for key in ("initial_base_sha", "global_base_sha")}
    for record in engine.store.rounds():
        if record.round_id > released:
            needed |= {record.base_sha} | ({record.result_sha} if record.result_sha else set())
            needed |= {update.blob_sha for update in engine.store.updates(record.round_id, status=None)}
    return needed


@pytest.fixture
def setup(tmp_path: Path):
    manifest = make_bundle(tmp_path / "bundle")
    config = ServerConfig(
        bundle=tmp_path / "bundle", state=tmp_path / "state", min_clients=2, rounds=ROUNDS, history=HISTORY
    )
    tokens = enroll(config.state, "d0", "d1")
    return manifest, config, tokens, Clock()


def test_retention_keeps_exactly_the_last_rounds_and_survives_a_restart(setup) -> None:
    manifest, config, _, clock = setup
    engine = create_engine(config, clock)
    _run_rounds(engine, clock, manifest, ROUNDS)
    results = {r.round_id: r.result_sha for r in engine.store.rounds()}
    assert [row["round"] for row in engine.history()["rounds"]] == [4, 5]
    assert engine.store.released_through() == 3
    for round_id in (1, 2, 3):
        with pytest.raises(Refused) as refused:
            engine.result_of(round_id)
        assert status_of(refused.value) == 410 and refused.value.error == "released"
        assert "--history" in refused.value.fix
        with pytest.raises(Refused):
            engine.base_for("d0", round_id)
    kept = {r: engine.result_of(r) for r in (4, 5)}
    assert all(hashlib.sha256(payload).hexdigest() == sha == results[r] for r, (payload, sha) in kept.items())
    # released blobs are gone, every retained one is still on disk
    assert _blob_files(engine) == _needed_blobs(engine)
    history = engine.history()
    engine.store.close()

    again = create_engine(config, clock)
    assert again.history() == history
    assert {r: again.result_of(r) for r in (4, 5)} == kept
    assert again.store.blobs.remove_unreferenced(again.store.referenced_blobs()) == 0
    assert _blob_files(again) == _needed_blobs(again)
    # a smaller retention at the next start releases more; a larger one cannot bring released rounds back
    again.store.close()
    smaller = create_engine(config.model_copy(update=dict(history=1)), clock)
    assert [row["round"] for row in smaller.history()["rounds"]] == [5]
    assert _blob_files(smaller) == _needed_blobs(smaller)
    smaller.store.close()
    everything = create_engine(config.model_copy(update=dict(history=0)), clock)
    assert [row["round"] for row in everything.history()["rounds"]] == [5]
    assert everything.result_of(5) == kept[5]


def test_a_crash_between_release_and_deletion_is_cleaned_at_start(setup) -> None:
    manifest, config, _, clock = setup
    engine = create_engine(config.model_copy(update=dict(history=0)), clock)
    _run_rounds(engine, clock, manifest, 3)
    before = _blob_files(engine)
    with engine.store.transaction() as db:  # the release committed, the process died before unlinking
        db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('history_released_through', '2')")
        db.execute("UPDATE rounds SET result_sha = NULL WHERE round_id <= 2")
    engine.store.close()
    again = create_engine(config.model_copy(update=dict(history=1)), clock)
    assert _blob_files(again) == _needed_blobs(again) < before
    assert [row["round"] for row in again.history()["rounds"]] == [3]
    assert hashlib.sha256(again.result_of(3)[0]).hexdigest() == again.store.round(3).result_sha


def test_history_endpoint_needs_a_token_and_released_rounds_are_410(setup) -> None:
    manifest, config, tokens, clock = setup
    engine = create_engine(config, clock)
    _run_rounds(engine, clock, manifest, 3)
    http = TestClient(create_app(engine))  # no lifespan: the test drives the engine
    for path in ("/v1/history", "/v1/rounds/2/result"):
        refused = http.get(path)
        assert refused.status_code == 401 and set(refused.json()) == {"error", "detail", "fix"}
    auth = {"Authorization": f"Bearer {tokens['d0']}"}
    history = http.get("/v1/history", headers=auth).json()
    assert history["retention"] == HISTORY and history["released_through"] == 1
    assert [(row["round"], row["url"]) for row in history["rounds"]] == [
        (2, "/v1/rounds/2/result"),
        (3, "/v1/rounds/3/result"),
    ]
    for row in history["rounds"]:
        reply = http.get(row["url"], headers=auth)
        assert reply.status_code == 200 and hashlib.sha256(reply.content).hexdigest() == row["sha256"]
        assert reply.headers["etag"] == f'"{row["sha256"]}"'
    gone = http.get("/v1/rounds/1/result", headers=auth)
    assert gone.status_code == 410 and gone.json()["error"] == "released" and "--history" in gone.json()["fix"]
    assert http.get("/v1/rounds/1/base", headers=auth).status_code == 410
    spec = http.get("/openapi.json").json()["paths"]
    assert "get" in spec["/v1/history"] and "410" in spec["/v1/rounds/{round_id}/result"]["get"]["responses"]


def test_negative_history_is_refused(tmp_path) -> None:
    make_bundle(tmp_path / "bundle")
    process = subprocess.run(
        [
            sys.executable,
            "-m",
            "edgepfl.cli",
            "serve",
            "--bundle",
            str(tmp_path / "bundle"),
            "--state",
            str(tmp_path / "state"),
            "--history",
            "-1",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    lines = [line for line in process.stderr.splitlines() if line.strip()]
    assert process.returncode != 0 and len(lines) == 1 and "--history" in lines[0], process.stderr


@pytest.fixture(scope="module")
def bundle(bundle_factory) -> Path:
    return bundle_factory(**{**DEVICE_BUNDLE, "kp": 0, "engines": ("portable",), "distill": True})


@pytest.mark.slow
def test_a_new_device_picks_the_global_model_with_the_lowest_held_out_loss(bundle, tmp_path) -> None:
    from edgepfl.data import load_device_data
    from edgepfl.device_runtime.algorithms import evaluate
    from edgepfl.device_runtime.engine import open_engine

    rounds = 3
    tokens = enroll(tmp_path / "server", "a", "b", "newcomer")
    server = LiveServer(
        bundle,
        tmp_path / "server",
        "--min-clients",
        "2",
        "--rounds",
        str(rounds),
        "--poll-interval",
        "0.2",
        "--lr",
        "0.1",
        "--batch-size",
        "16",
        "--round-timeout",
        "120",
    ).start()
    data = {name: save_npz(tmp_path / f"{name}.npz", (2 * i, 2 * i + 1), 120, seed=i) for i, name in enumerate("ab")}
    # the newcomer labels a's and b's images differently: the more rounds, the worse the global model fits it,
    # so the lowest held-out loss is not the last round's (a device that kept the latest model would fail here)
    shown = np.random.default_rng(5).choice(np.arange(4), 120)
    np.savez(tmp_path / "newcomer.npz", x=class_images(shown, 5), y=(shown + 1) % 4)
    data["newcomer"] = tmp_path / "newcomer.npz"
    try:
        processes = [
            subprocess.Popen(
                device_command(
                    *run_args(bundle, data[name], server, tokens[name], tmp_path / name, "--engine", "portable")
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=REPO,
            )
            for name in "ab"
        ]
        for process in processes:
            _, err = process.communicate(timeout=120)
            assert process.returncode == 0, err[-3000:]
        auth = {"Authorization": f"Bearer {tokens['newcomer']}"}
        assert httpx.get(f"{server.url}/v1/history").status_code == 401
        history = httpx.get(f"{server.url}/v1/history", headers=auth).json()["rounds"]
        assert [row["round"] for row in history] == list(range(1, rounds + 1))
        global_models = {
            row["round"]: decode_tensors(httpx.get(server.url + row["url"], headers=auth).content) for row in history
        }
        state = tmp_path / "newcomer"
        chosen = device(
            "device",
            "teacher",
            "--bundle",
            bundle,
            "--data",
            data["newcomer"],
            "--state",
            state,
            "--server",
            server.url,
            "--token",
            tokens["newcomer"],
            "--engine",
            "portable",
            "--json",
        )
    finally:
        server.stop()

    # the losses, computed here in-process with the same split (--val-fraction 0.2, --seed 0)
    engine = open_engine(bundle, "portable")
    local = load_device_data(data["newcomer"], engine.manifest, 0.2, 0)
    losses = {}
    for round_id, tensors in global_models.items():
        engine.set_tensors(tensors)
        losses[round_id] = evaluate(engine, local).loss
    assert len({round(loss, 6) for loss in losses.values()}) == rounds, losses  # the choice is not a tie
    best = min(losses, key=losses.get)
    assert best != rounds, losses  # see the newcomer's data: the choice must not be "the latest"
    assert chosen["teacher_global_round"] == best and chosen["teacher_round"] == best + 1, (chosen, losses)
    assert chosen["rounds_scored"] == rounds
    assert {int(r): v for r, v in chosen["val_losses"].items()} == pytest.approx(losses, rel=1e-5)
    assert chosen["teacher_val_loss"] == pytest.approx(losses[best], rel=1e-5)
    teacher = json.loads((state / "persfl" / "teacher.json").read_text())["teacher"]
    kept = decode_tensors((state / "persfl" / teacher["file"]).read_bytes())
    assert all(np.array_equal(kept[name], global_models[best][name]) for name in global_models[best])

    result = device(
        "device",
        "distill",
        "--bundle",
        bundle,
        "--data",
        data["newcomer"],
        "--state",
        state,
        "--lambdas",
        "0.5",
        "--temperatures",
        "2",
        "--epochs",
        "1",
        "--json",
    )
    assert result["teacher_round"] == best + 1 and result["engine"] == "portable"


def test_client_checks_each_global_model_against_the_history_sha256() -> None:
    from edgepfl.device_runtime.client import HistoryEntry, RetryPolicy, ServerClient, ServerRefused, ServerUnreachable
    from edgepfl.wire import encode_tensors

    good = encode_tensors({"w": np.arange(3, dtype=np.float32)})
    entry = HistoryEntry(2, hashlib.sha256(good).hexdigest(), "/v1/rounds/2/result")
    replies = [good[:-1] + b"x", good]  # one damaged body, then the right one

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/history":
            return httpx.Response(200, json={"rounds": [{"round": 2, "sha256": entry.sha256, "url": entry.url}]})
        if request.url.path == "/v1/rounds/1/result":
            return httpx.Response(410, json={"error": "released", "detail": "round 1 released", "fix": "see history"})
        return httpx.Response(200, content=replies.pop(0) if replies else good[:-1] + b"x")

    notes: list[str] = []
    client = ServerClient(
        "http://device.test", "t", RetryPolicy(attempts=2), transport=httpx.MockTransport(handle), on_retry=notes.append
    )
    assert client.history() == [entry]
    assert np.array_equal(client.global_model(entry)["w"], np.arange(3, dtype=np.float32))
    assert len(notes) == 1 and "sha256" in notes[0]
    with pytest.raises(ServerUnreachable):
        client.global_model(entry)  # damaged every time
    with pytest.raises(ServerRefused) as refused:
        client.global_model(HistoryEntry(1, entry.sha256, "/v1/rounds/1/result"))
    assert refused.value.status == 410 and refused.value.error == "released"
