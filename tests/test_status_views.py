"""Who sees which device names (issue 41): every GET route of the app, asked anonymously (--public-status), with
each device's token and with the operator's token, while a round waits for named devices. Only the operator's
view names them; the routes are read from the app itself, so a view added later is checked too."""

from __future__ import annotations

import base64
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from server_helpers import app_routes, enroll, make_bundle, upload_body
from test_secagg_rounds import bundle as secure_bundle

from edgepfl.secagg import ClientSession, to_json
from edgepfl.server.app import create_app
from edgepfl.server.config import ServerConfig
from edgepfl.server.engine import RoundEngine, create_engine
from edgepfl.server.page import fleet_section, render_page
from edgepfl.server.secure.steps import steps_of
from edgepfl.server.store import DB_NAME, Store
from edgepfl.server.tokens import issue_operator_token
from edgepfl.wire import decode_tensors

NAMES = ("alice-phone-7f3", "bob-tablet-9c1", "carol-laptop-2e8", "dave-watch-41a")
SECRET = "enroll-secret-for-the-views-test"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def served(tmp_path: Path, secure: bool = False, **changes) -> tuple[RoundEngine, dict[str, str], str, Clock]:
    """An engine (fake clock) with the four named devices enrolled, their tokens and the operator's token."""
    folder = tmp_path / "bundle"
    secure_bundle(folder) if secure else make_bundle(folder)
    (tmp_path / "secret").write_text(SECRET)
    fields = dict(
        bundle=folder,
        state=tmp_path / "state",
        min_clients=3,
        round_timeout=100,
        public_status=True,
        enroll_secret_file=tmp_path / "secret",
        clip_multiple=0,
        weight_multiple=0,
    )
    if secure:
        fields["secure"] = {
            "secure_aggregation": True,
            "secagg_clip": 1.0,
            "secagg_max_weight": 50,
            "secagg_step_timeout": 60.0,
        }
    config = ServerConfig(**{**fields, **changes})
    tokens = enroll(config.state, *NAMES)
    store = Store(config.state)
    operator = issue_operator_token(store)
    store.close()
    clock = Clock()
    engine = create_engine(config, clock)
    for name in NAMES:
        engine.task(name)
    clock.now += engine.config.poll_interval
    return engine, tokens, operator, clock


def get_routes(app) -> list[str]:
    """Every GET path of the app, its parameters filled in (a new parameter fails here: fill it in below)."""
    values = {"round_id": "1", "name": "index.html", "path": "manifest.json"}
    paths = []
    for route in app_routes(app):
        if "GET" in (route.methods or ()):
            assert set(route.param_convertors) <= set(values), f"fill in {route.path}'s parameters"
            paths.append(route.path_format.format(**{key: values[key] for key in route.param_convertors}))
    return paths


def bodies(http: TestClient, paths: list[str], authorization: str | None) -> dict[str, str]:
    headers = {"Authorization": authorization} if authorization else {}
    return {path: http.get(path, headers=headers, follow_redirects=False).text for path in paths}


def check_views(engine: RoundEngine, tokens: dict[str, str], operator: str, waited_for: list[str]) -> None:
    """No GET route names a device to anyone but the operator (a device sees its own name, in its secure task), and
    the operator's status and page name those the round waits for."""
    app = create_app(engine)
    http = TestClient(app)
    paths = get_routes(app)
    assert {"/", "/v1/status", "/v1/task", "/v1/history", "/openapi.json"} <= set(paths)
    basic = "Basic " + base64.b64encode(f"operator:{SECRET}".encode()).decode()
    viewers = {"anonymous": None, "join page's password": basic}
    viewers.update({name: f"Bearer {token}" for name, token in tokens.items()})
    for viewer, authorization in viewers.items():
        for path, body in bodies(http, paths, authorization).items():
            leaked = [name for name in NAMES if name in body and name != viewer]  # its own name a device knows
            assert not leaked, f"GET {path} shows {leaked} to {viewer}"
    seen = bodies(http, ["/", "/v1/status"], f"Bearer {operator}")
    assert waited_for and all(name in body for body in seen.values() for name in waited_for)


def test_only_the_operator_sees_who_a_sync_round_waits_for(tmp_path: Path) -> None:
    engine, tokens, operator, _ = served(tmp_path, web=False)
    record = engine.current_round()
    assert record is not None and sorted(record.sampled) == sorted(NAMES)
    first, refuser, *waiting = record.sampled
    base = decode_tensors(engine.base_for(first, record.round_id)[0])
    engine.accept_update(first, record.round_id, upload_body(base, engine.manifest))
    engine.accept_refusal(refuser, record.round_id, "NaN in the base")
    open_round = engine.status()["open_round"]
    assert (open_round["waiting_for"], open_round["refused_base"]) == (3, 1) and "missing" not in open_round
    line = fleet_section(engine.status(), record.deadline - 60)
    assert "waiting for 3 devices" in line and "1 refused its base" in line
    check_views(engine, tokens, operator, [refuser, *waiting])


def test_only_the_operator_sees_fedbuff_devices(tmp_path: Path) -> None:
    engine, tokens, operator, _ = served(tmp_path, web=False, fleet_rounds={"aggregation": "fedbuff", "buffer_size": 3})
    for name in NAMES[:2]:
        task = engine.task(name)
        base = decode_tensors(engine.base_for(name, task.round_id)[0])
        engine.accept_update(name, task.round_id, upload_body(base, engine.manifest))
    assert engine.status()["fedbuff"]["devices_by_staleness"] == {0: 2}
    assert "2 at staleness 0" in render_page(engine.status())
    check_views(engine, tokens, operator, list(NAMES[:2]))


@pytest.mark.parametrize("step", ["keys", "shares", "inputs"])
def test_only_the_operator_sees_who_a_secure_step_waits_for_with_the_device_page_on(tmp_path: Path, step: str) -> None:
    """At each step the devices fetch the round's key book, their inboxes: these name the devices by their ids in
    the protocol (keyed hashes), never by their enrolled names."""
    engine, tokens, operator, _ = served(tmp_path, secure=True)
    record = engine.current_round()
    assert record is not None
    sessions = {}
    for name in NAMES if step != "keys" else NAMES[:1]:
        task = engine.task(name).secure_aggregation
        sessions[name] = ClientSession.start(task.device, task.context)
        assert task.device not in NAMES and task.device == steps_of(engine).rounds.alias(name)
        steps_of(engine).message(name, record.round_id, "advert", to_json(sessions[name].advert()).encode())
    engine.tick()
    for name in NAMES[:3] if step == "shares" else NAMES if step == "inputs" else ():
        shares = sessions[name].receive_book(steps_of(engine).book(name, record.round_id))
        steps_of(engine).message(name, record.round_id, "shares", to_json(shares).encode())
    engine.tick()
    assert engine.status()["open_round"]["secure_step"] == step
    assert any("/secagg/" in path for path in get_routes(create_app(engine)))
    waited_for = {"keys": NAMES[1:], "shares": NAMES[3:], "inputs": NAMES}[step]
    check_views(engine, tokens, operator, list(waited_for))


@pytest.mark.parametrize("credential", ["none", "device"])
def test_the_status_without_public_status_still_needs_a_token(tmp_path: Path, credential: str) -> None:
    engine, tokens, operator, _ = served(tmp_path, web=False, public_status=False)
    http = TestClient(create_app(engine))
    headers = {"Authorization": f"Bearer {tokens[NAMES[0]]}"} if credential == "device" else {}
    reply = http.get("/v1/status", headers=headers)
    assert reply.status_code == (200 if credential == "device" else 401)
    named = http.get("/v1/status", headers={"Authorization": f"Bearer {operator}"}).json()["open_round"]
    assert sorted(named["missing"]) == sorted(NAMES)


def test_a_secure_round_shows_the_deadline_of_its_current_step(tmp_path: Path) -> None:
    engine, _, _, clock = served(tmp_path, secure=True, web=False, round_timeout=3600)
    record = engine.current_round()
    assert record is not None
    assert engine.status()["open_round"]["gives_up_at"] == record.deadline  # the keys step ends at the deadline
    for name in NAMES:
        task = engine.task(name)
        session = ClientSession.start(task.secure_aggregation.device, task.secure_aggregation.context)
        steps_of(engine).message(name, record.round_id, "advert", to_json(session.advert()).encode())
    clock.now += 5
    engine.tick()
    open_round = engine.status()["open_round"]
    assert open_round["secure_step"] == "shares"
    # the round's hour-long deadline no longer applies: the shares step ends 60 s after the keys step closed
    assert open_round["gives_up_at"] == clock.now + 60 < record.deadline
    when = time.strftime("%H:%M:%S", time.localtime(clock.now + 60))
    assert f"this step ends at {when} (in 50 s)" in fleet_section(engine.status(), clock.now + 10)


def test_serve_tokens_operator_prints_a_new_token_that_replaces_the_last(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from edgepfl.cli import app
    from edgepfl.server.tokens import is_operator_token

    state = tmp_path / "state"
    first, second = (CliRunner().invoke(app, ["serve", "tokens", "operator", "--state", str(state)]) for _ in "ab")
    assert first.exit_code == 0 and second.exit_code == 0 and len(second.stdout.strip()) >= 40
    store = Store(state)
    try:
        assert is_operator_token(store, second.stdout.strip()) and not is_operator_token(store, first.stdout.strip())
        stored = b"".join(path.read_bytes() for path in state.iterdir() if path.is_file())
        assert (state / DB_NAME).is_file() and second.stdout.strip().encode() not in stored  # only its sha256
    finally:
        store.close()
