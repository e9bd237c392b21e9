"""Enrollment with a shared secret: `POST /v1/enroll` on a real server, and `edgepfl device enroll` end to end."""

from __future__ import annotations

import json
import sqlite3
import stat
import subprocess
import sys
from contextlib import closing
from pathlib import Path

import httpx
import pytest
from conftest import REPO
from fastapi.testclient import TestClient
from server_helpers import LiveServer, enroll, make_bundle
from test_device_e2e import device_command, finish, run_args
from test_device_runtime import DEVICE_BUNDLE, save_npz
from test_server_engine import Clock
from typer.testing import CliRunner

from edgepfl.cli import app as cli_app
from edgepfl.device_runtime.client import ServerRefused
from edgepfl.server.app import create_app
from edgepfl.server.config import ServerConfig
from edgepfl.server.engine import create_engine
from edgepfl.server.ratelimit import FailureLimiter
from edgepfl.server.store import DB_NAME, Store
from edgepfl.server.tokens import hash_token

SECRET = "shared-secret-of-the-fleet-0123456789"
BAD_NAMES = ("", "-dash-first", "a" * 65, "with space", "slash/name", "ünïcode", "a\nb")


def write_secret(folder: Path, secret: str = SECRET) -> Path:
    path = folder / "enroll.secret"
    path.write_text(f"  {secret}\n")  # surrounding whitespace is not part of the secret
    return path


def post_enroll(server: LiveServer, name: object, secret: str | bytes | None = SECRET) -> httpx.Response:
    value = b"Bearer " + secret if isinstance(secret, bytes) else f"Bearer {secret}"
    headers = {"Authorization": value} if secret is not None else {}
    return httpx.post(f"{server.url}/v1/enroll", json={"device": name}, headers=headers, timeout=30)


def task_status(server: LiveServer, token: str) -> int:
    return httpx.get(f"{server.url}/v1/task", headers={"Authorization": f"Bearer {token}"}, timeout=30).status_code


def enrolled(state: Path) -> list[str]:
    store = Store(state)
    try:
        return [device.name for device in store.devices()]
    finally:
        store.close()


def state_bytes(state: Path) -> bytes:
    return b"".join(path.read_bytes() for path in sorted(state.rglob("*")) if path.is_file())


def refusal(reply: httpx.Response, status: int, error: str) -> dict:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert set(body) == {"error", "detail", "fix"} and body["error"] == error and body["detail"], body
    return body


@pytest.mark.slow
def test_enroll_with_the_shared_secret_and_every_refusal(tmp_path: Path) -> None:
    make_bundle(tmp_path / "bundle")
    state = tmp_path / "state"
    operator_tokens = enroll(state, "operator-made")
    server = LiveServer(tmp_path / "bundle", state, "--enroll-secret-file", str(write_secret(tmp_path))).start()
    try:
        reply = post_enroll(server, "phone-1")
        assert reply.status_code == 200, reply.text
        issued = reply.json()
        assert issued["device"] == "phone-1" and len(issued["token"]) >= 40
        assert task_status(server, issued["token"]) == 200

        before = enrolled(state)
        assert before == ["operator-made", "phone-1"]
        for secret in ("wrong-secret-of-the-fleet-0123456789", SECRET[:-1], f"{SECRET}x", "ü".encode() * 20, None):
            body = refusal(post_enroll(server, "intruder", secret), 401, "unauthorized")
            assert SECRET not in body["detail"] + body["fix"]
        no_scheme = httpx.post(
            f"{server.url}/v1/enroll", json={"device": "intruder"}, headers={"Authorization": SECRET}, timeout=30
        )
        refusal(no_scheme, 401, "unauthorized")
        refusal(post_enroll(server, "operator-made", issued["token"]), 401, "unauthorized")  # a token is no secret

        refusal(post_enroll(server, "phone-1"), 409, "already_enrolled")
        duplicate = refusal(post_enroll(server, "operator-made"), 409, "already_enrolled")
        assert "--replace" in duplicate["fix"]
        assert (
            task_status(server, issued["token"]) == 200 and task_status(server, operator_tokens["operator-made"]) == 200
        )

        for name in BAD_NAMES:
            refusal(post_enroll(server, name), 422, "invalid_device_name")
        for body in (b"not json", b"[]", b'{"name": "x"}', b'{"device": 7}', b""):
            reply = httpx.post(
                f"{server.url}/v1/enroll", content=body, headers={"Authorization": f"Bearer {SECRET}"}, timeout=30
            )
            refusal(reply, 422, "invalid_request")
        assert enrolled(state) == before  # nothing a refused request sent was stored

        spec = httpx.get(f"{server.url}/openapi.json", timeout=30).json()["paths"]["/v1/enroll"]["post"]
        assert {"200", "401", "403", "409", "422"} <= set(spec["responses"])
        assert spec["requestBody"]["content"]["application/json"]["schema"]["required"] == ["device"]
    finally:
        server.stop()
    assert issued["token"].encode() not in state_bytes(state)  # only its hash is stored
    assert SECRET.encode() not in state_bytes(state)
    assert SECRET not in server.log.read_text()


def test_limiter_blocks_after_max_failures_until_the_oldest_leaves_the_window() -> None:
    clock = Clock()
    limiter = FailureLimiter(3, 600, clock)
    for seconds in (0, 100, 200):
        assert limiter.retry_after("10.0.0.1") is None
        clock.now = 1_000_000.0 + seconds
        limiter.record_failure("10.0.0.1")
    clock.now += 0.5
    assert limiter.retry_after("10.0.0.1") == 400  # the failure at +0 s leaves at +600 s (399.5 s, rounded up)
    assert limiter.retry_after("10.0.0.2") is None  # addresses are counted apart
    clock.now = 1_000_000.0 + 599
    assert limiter.retry_after("10.0.0.1") == 1
    clock.now = 1_000_000.0 + 600
    assert limiter.retry_after("10.0.0.1") is None  # the window slid past the first failure
    limiter.record_failure("10.0.0.1")  # two left in the window and this one: blocked again
    assert limiter.retry_after("10.0.0.1") == 100  # until the failure at +100 s leaves
    clock.now = 1_000_000.0 + 1400
    assert limiter.retry_after("10.0.0.1") is None and len(limiter) == 0  # stale addresses are forgotten


def test_limiter_tracks_at_most_max_addresses_and_evicts_the_oldest() -> None:
    clock = Clock()
    limiter = FailureLimiter(2, 60, clock, max_addresses=2)
    for address in ("a", "b"):
        limiter.record_failure(address)
        limiter.record_failure(address)
        clock.now += 1
    assert limiter.retry_after("a") == 58 and limiter.retry_after("b") == 59
    limiter.record_failure("c")  # the table is full: "a", whose newest failure is oldest, leaves
    assert len(limiter) == 2 and limiter.retry_after("a") is None and limiter.retry_after("b") == 59
    assert limiter.retry_after("c") is None and limiter.retry_after("d") is None  # no shared count
    for host in range(1, 1000):  # many addresses cannot grow the table
        clock.now += 0.01
        limiter.record_failure(f"10.0.{host // 256}.{host % 256}")
    assert len(limiter) == 2 and limiter.retry_after("e") is None
    clock.now += 61
    assert limiter.retry_after("c") is None and len(limiter) == 0  # stale ones are forgotten


def test_behind_one_nat_wrong_secrets_are_429_and_the_right_one_still_enrolls(tmp_path: Path) -> None:
    """Phones behind one NAT share an address: its wrong secrets lock out only wrong secrets."""
    make_bundle(tmp_path / "bundle")
    state = tmp_path / "state"
    config = ServerConfig(bundle=tmp_path / "bundle", state=state, enroll_secret=SECRET)
    assert config.enroll_max_failures == 10
    app = create_app(create_engine(config))  # no lifespan: enrollment needs no round loop
    nat = TestClient(app, client=("203.0.113.7", 50000))
    neighbour = TestClient(app, client=("198.51.100.9", 50000))

    def post(http: TestClient, name: str, secret: str | None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {secret}"} if secret is not None else {}
        return http.post("/v1/enroll", json={"device": name}, headers=headers)

    for attempt in range(10):
        secret = None if attempt == 5 else f"wrong-secret-{attempt}-0123456789"  # a missing secret counts too
        refusal(post(nat, "intruder", secret), 401, "unauthorized")
    assert post(nat, "phone-1", SECRET).status_code == 200  # the right secret passes the locked-out address
    for phone in ("phone-2", "phone-3"):
        blocked = post(nat, "intruder", "wrong-secret-of-the-fleet-0123456789")  # the 11th wrong one, the 12th
        body = refusal(blocked, 429, "too_many_attempts")
        assert 1 <= int(blocked.headers["retry-after"]) <= config.enroll_window
        assert f"wait {blocked.headers['retry-after']} s" in body["fix"] and SECRET not in body["detail"] + body["fix"]
        assert post(nat, phone, SECRET).status_code == 200
    refusal(post(neighbour, "intruder", "wrong-secret-of-the-fleet-0123456789"), 401, "unauthorized")  # apart
    assert enrolled(state) == ["phone-1", "phone-2", "phone-3"]
    spec = nat.get("/openapi.json").json()["paths"]["/v1/enroll"]["post"]["responses"]
    assert {"410", "429"} <= set(spec)


@pytest.mark.parametrize("option", ["--enroll-max-failures", "--enroll-window"])
def test_serve_refuses_a_non_positive_enroll_limit_in_one_line(tmp_path: Path, option: str) -> None:
    args = ["serve", "--bundle", str(tmp_path / "bundle"), "--state", str(tmp_path / "state"), option, "0"]
    refused = CliRunner().invoke(cli_app, args)
    assert refused.exit_code == 2 and refused.output.count("\n") == 1, refused.output
    assert refused.output.startswith(f"error: {option}"), refused.output


@pytest.mark.slow
def test_enrollment_is_closed_without_a_secret_file(tmp_path: Path) -> None:
    make_bundle(tmp_path / "bundle")
    with LiveServer(tmp_path / "bundle", tmp_path / "state") as server:
        for secret in (SECRET, None):
            body = refusal(post_enroll(server, "phone-1", secret), 403, "enrollment_closed")
            assert "tokens add" in body["fix"]
    assert enrolled(tmp_path / "state") == []


@pytest.mark.parametrize("secret", [None, "short-secret"])
def test_serve_refuses_a_missing_or_short_secret_file_in_one_line(tmp_path: Path, secret: str | None) -> None:
    make_bundle(tmp_path / "bundle")
    secret_file = write_secret(tmp_path, secret) if secret is not None else tmp_path / "missing.secret"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "edgepfl.cli",
            "serve",
            "--bundle",
            str(tmp_path / "bundle"),
            "--state",
            str(tmp_path / "state"),
            "--enroll-secret-file",
            str(secret_file),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("error: --enroll-secret-file") and str(secret_file) in done.stderr
    assert secret is None or secret not in done.stderr


def test_device_run_takes_exactly_one_of_token_and_token_file(tmp_path: Path) -> None:
    from edgepfl.device_runtime.cli import device_app

    runner = CliRunner()
    common = ["run", "--bundle", str(tmp_path), "--data", str(tmp_path), "--state", str(tmp_path / "s")]
    common += ["--server", "http://127.0.0.1:9"]
    token_file = tmp_path / "device.token"
    token_file.write_text("a-token\n")
    for extra, expected in (
        ([], "no device token"),
        (["--token", "a-token", "--token-file", str(token_file)], "both --token"),
        (["--token-file", str(tmp_path / "missing.token")], "cannot be read"),
    ):
        result = runner.invoke(device_app, [*common, *extra], env={"EDGEPFL_TOKEN": ""})
        assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
        assert result.output.startswith("error: ") and expected in result.output, result.output


@pytest.mark.slow
def test_device_enroll_writes_a_private_token_file_that_device_run_uses(bundle_factory, tmp_path: Path) -> None:
    bundle = bundle_factory(**DEVICE_BUNDLE)
    secret_file = write_secret(tmp_path)
    state = tmp_path / "server"
    options = ("--enroll-secret-file", str(secret_file), "--rounds", "1", "--min-clients", "1")
    server = LiveServer(bundle, state, *options, "--poll-interval", "0.2", "--batch-size", "16").start()
    token_file = tmp_path / "phone-1.token"

    def device_enroll(name: str, *extra: str | Path) -> subprocess.CompletedProcess:
        args = ["device", "enroll", "--server", server.url, "--name", name, *extra]
        return subprocess.run(device_command(*args), capture_output=True, text=True, timeout=120, cwd=REPO)

    try:
        done = device_enroll("phone-1", "--secret-file", secret_file, "--token-file", token_file)
        assert done.returncode == 0 and done.stdout == "", done.stderr[-3000:]
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 40 and token not in done.stderr
        assert done.stderr.count("\n") == 1 and done.stderr.startswith(f"enrolled as phone-1 at {server.url}; ")

        again = device_enroll("phone-2", "--secret-file", secret_file, "--token-file", token_file)
        assert again.returncode == 2 and again.stderr.count("\n") == 1 and "exists already" in again.stderr
        assert token_file.read_text().strip() == token and enrolled(state) == ["phone-1"]  # refused before asking

        wrong = tmp_path / "wrong.secret"
        wrong.write_text("not-the-secret-of-this-fleet")
        refused = device_enroll("phone-2", "--secret-file", wrong)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert refused.stderr.startswith("error: server refused POST /v1/enroll (401 unauthorized)")
        taken = device_enroll("phone-1", "--secret-file", secret_file)
        assert taken.returncode == 2 and "409 already_enrolled" in taken.stderr and "--replace" in taken.stderr
        printed = device_enroll("phone-2", "--secret-file", secret_file)
        assert printed.returncode == 0 and len(printed.stdout.strip()) >= 40, printed.stderr[-3000:]
        assert printed.stdout.count("\n") == 1 and "enrolled as phone-2" in printed.stderr  # stdout: the token alone

        data = save_npz(tmp_path / "d.npz", (0, 1), 60)
        args = run_args(bundle, data, server, token, tmp_path / "device")
        args[args.index("--token") : args.index("--token") + 2] = ["--token-file", str(token_file)]
        result = finish(
            subprocess.Popen(device_command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        )
    finally:
        server.stop()
    assert result["finished"] and result["rounds_trained"] == 1, result
    assert token.encode() not in state_bytes(state)


# a retried enrollment: the same name with the same key gets a new token


KEY = "enroll-key-of-phone-1-0123456789"


def in_process_app(tmp_path: Path, state: Path | None = None) -> tuple[TestClient, Path]:
    make_bundle(tmp_path / "bundle")
    state = state or tmp_path / "state"
    config = ServerConfig(bundle=tmp_path / "bundle", state=state, enroll_secret=SECRET, min_clients=100)
    return TestClient(create_app(create_engine(config))), state  # no lifespan: enrollment needs no round loop


def post_with_key(http: TestClient, name: str, key: object = None) -> httpx.Response:
    body = {"device": name} if key is None else {"device": name, "key": key}
    return http.post("/v1/enroll", json=body, headers={"Authorization": f"Bearer {SECRET}"})


def authenticates(http: TestClient, token: str) -> bool:
    return http.get("/v1/task", headers={"Authorization": f"Bearer {token}"}).status_code == 200


def enroll_key_hashes(state: Path) -> dict[str, str | None]:
    with closing(sqlite3.connect(state / DB_NAME)) as db:
        return dict(db.execute("SELECT name, enroll_key_hash FROM devices").fetchall())


def test_the_same_key_gets_a_new_token_and_the_old_one_stops_working(tmp_path: Path) -> None:
    http, state = in_process_app(tmp_path)
    first = post_with_key(http, "phone-1", KEY)
    assert first.status_code == 200, first.text
    assert authenticates(http, first.json()["token"])
    again = post_with_key(http, "phone-1", KEY)  # the first reply was "lost"
    assert again.status_code == 200 and again.json()["device"] == "phone-1", again.text
    assert again.json()["token"] != first.json()["token"]
    assert not authenticates(http, first.json()["token"]) and authenticates(http, again.json()["token"])
    assert enrolled(state) == ["phone-1"]
    assert enroll_key_hashes(state) == {"phone-1": hash_token(KEY)}  # the key is stored as its hash only
    assert KEY.encode() not in state_bytes(state)


def test_another_key_no_key_or_an_operator_token_is_still_409(tmp_path: Path) -> None:
    http, state = in_process_app(tmp_path)
    operator_token = enroll(state, "operator-made")["operator-made"]
    token = post_with_key(http, "phone-1", KEY).json()["token"]
    for key in (f"{KEY}x", KEY[:-1], None):
        refusal(post_with_key(http, "phone-1", key), 409, "already_enrolled")
    refusal(post_with_key(http, "operator-made", KEY), 409, "already_enrolled")  # it has no key to match
    assert authenticates(http, token) and authenticates(http, operator_token)  # the stored tokens are unchanged

    replaced = CliRunner().invoke(cli_app, ["serve", "tokens", "add", "phone-1", "--state", str(state), "--replace"])
    assert replaced.exit_code == 0, replaced.output
    assert enroll_key_hashes(state)["phone-1"] is None  # the operator's token supersedes the key
    refusal(post_with_key(http, "phone-1", KEY), 409, "already_enrolled")
    assert authenticates(http, replaced.output.strip()) and not authenticates(http, token)


def test_an_invalid_key_is_422_and_stores_nothing(tmp_path: Path) -> None:
    http, state = in_process_app(tmp_path)
    for key in ("too-short", "k" * 201, "a key with spaces 0123456789", "ü" * 20):
        body = refusal(post_with_key(http, "phone-1", key), 422, "invalid_enroll_key")
        assert "16-200 printable ASCII" in body["detail"]
    for key in (7, ["a-list-is-no-key-0123456789"], {"k": 1}):
        refusal(post_with_key(http, "phone-1", key), 422, "invalid_request")
    lone_surrogate = b'{"device": "phone-1", "key": "\\ud800-0123456789abcdef"}'
    reply = http.post("/v1/enroll", content=lone_surrogate, headers={"Authorization": f"Bearer {SECRET}"})
    refusal(reply, 422, "invalid_enroll_key")
    assert enrolled(state) == []
    spec = http.get("/openapi.json").json()["paths"]["/v1/enroll"]["post"]
    assert "key" in spec["requestBody"]["content"]["application/json"]["schema"]["properties"]


def test_a_state_folder_without_the_key_column_gains_it_and_keeps_its_devices(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    with closing(sqlite3.connect(state / DB_NAME)) as db, db:
        db.execute(
            "CREATE TABLE devices (name TEXT PRIMARY KEY, token_hash TEXT NOT NULL UNIQUE, created REAL NOT NULL)"
        )
        db.execute("INSERT INTO devices VALUES ('old-phone', ?, 1.0)", (hash_token("token-of-the-old-phone"),))
    http, _ = in_process_app(tmp_path, state)
    assert authenticates(http, "token-of-the-old-phone")
    assert enroll_key_hashes(state) == {"old-phone": None}
    refusal(post_with_key(http, "old-phone", KEY), 409, "already_enrolled")
    assert post_with_key(http, "phone-1", KEY).status_code == 200
    assert post_with_key(http, "phone-1", KEY).status_code == 200
    Store(state).close()  # opening it again adds nothing twice
    assert enrolled(state) == ["old-phone", "phone-1"]


def forward(http: TestClient, request: httpx.Request) -> httpx.Response:
    """A device client's enroll POST, answered by the in-process server (for an httpx.MockTransport)."""
    headers = {"Authorization": request.headers["authorization"], "Content-Type": "application/json"}
    reply = http.post(request.url.path, content=request.content, headers=headers)
    return httpx.Response(reply.status_code, content=reply.content, headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("attempts", [3, 1], ids=["retried-in-process", "run-again"])
def test_device_enroll_gets_its_token_after_the_first_reply_is_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, attempts: int
) -> None:
    from edgepfl.device_runtime import client as client_module
    from edgepfl.device_runtime.cli import device_app

    http, state = in_process_app(tmp_path)
    sent: list[dict] = []

    def lose_the_first_reply(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        reply = forward(http, request)
        if len(sent) == 1:  # the server enrolled the device, then the connection broke
            raise httpx.ReadError("connection reset by peer", request=request)
        return reply

    real_client = client_module.ServerClient

    def lossy_client(server_url: str, token: str | None, timeout: float = 60.0) -> client_module.ServerClient:
        retry = client_module.RetryPolicy(attempts=attempts, first_delay=0.0)
        transport = httpx.MockTransport(lose_the_first_reply)
        return real_client(server_url, token, retry, timeout, transport=transport, sleep=lambda _: None)

    monkeypatch.setattr(client_module, "ServerClient", lossy_client)
    token_file, key_file = tmp_path / "device.token", tmp_path / "device.token.enroll-key"
    args = [
        "enroll",
        "--server",
        "http://device.test",
        "--name",
        "phone-1",
        "--secret-file",
        str(write_secret(tmp_path)),
    ]
    args += ["--token-file", str(token_file)]
    runner = CliRunner()
    if attempts == 1:
        lost = runner.invoke(device_app, args)
        assert lost.exit_code == 2 and lost.output.startswith("error: POST /v1/enroll failed 1 times"), lost.output
        assert not token_file.exists() and stat.S_IMODE(key_file.stat().st_mode) == 0o600
        assert key_file.read_text().strip() == sent[0]["key"]
    done = runner.invoke(device_app, args)
    assert done.exit_code == 0 and done.stdout == "", done.output
    # it says who it enrolled as and where the token is, in one line on stderr (never the token)
    said = f"enrolled as phone-1 at http://device.test; its token is in {token_file} (private: keep it so)\n"
    assert done.stderr == said
    assert len(sent) == 2 and sent[0]["key"] == sent[1]["key"] and len(sent[0]["key"]) >= 40
    assert not key_file.exists() and stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert authenticates(http, token_file.read_text().strip()) and enrolled(state) == ["phone-1"]


def test_a_client_that_sends_no_key_is_409_on_a_second_enrollment_as_before(tmp_path: Path) -> None:
    from edgepfl.device_runtime.client import ServerClient

    http, _ = in_process_app(tmp_path)
    sent: list[dict] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return forward(http, request)

    client = ServerClient("http://device.test", None, transport=httpx.MockTransport(answer), sleep=pytest.fail)
    try:
        old_style = client.enroll("phone-1", SECRET)  # an old client sends no key: behaviour as before
        with pytest.raises(ServerRefused) as refused:
            client.enroll("phone-1", SECRET)
    finally:
        client.close()
    assert sent == [{"device": "phone-1"}] * 2 and refused.value.status == 409
    assert authenticates(http, old_style)
