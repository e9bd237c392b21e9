"""Join links that expire, enroll a few devices or one, and can be revoked: made by `edgepfl serve join-link` or the
/join page, kept as hashes in the server's SQLite, counted atomically, and seen by a running server at once."""

from __future__ import annotations

import re
import sqlite3
import threading
from contextlib import closing
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from server_helpers import LiveServer, make_bundle
from test_enroll import enrolled, refusal, state_bytes
from test_server_engine import Clock
from test_web_server import SECRET, app_client, basic, runtime_needed
from typer.testing import CliRunner

from edgepfl.cli import app as cli_app
from edgepfl.server.app import create_app
from edgepfl.server.config import ServerConfig
from edgepfl.server.engine import create_engine
from edgepfl.server.joinlinks import JoinLinkClosed, JoinLinkOptions, JoinLinks, parse_duration
from edgepfl.server.store import DB_NAME, Store
from edgepfl.server.tokens import hash_token

pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx`")  # starlette asks for httpx2, not ours
HOUR = 3600.0
KEY = "enroll-key-of-the-phone-0123456789"


def link_app(
    tmp_path: Path, shared: str | None = None, clock: Clock | None = None
) -> tuple[TestClient, JoinLinks, Clock]:
    """An in-process app on a settable clock (enrollment needs no round loop), and its join links; called again
    on the same folder, a restarted server."""
    make_bundle(tmp_path / "bundle")
    options = {"bundle": tmp_path / "bundle", "state": tmp_path / "state", "enroll_secret": shared}
    clock = clock or Clock()
    engine = create_engine(ServerConfig(**options), clock)
    return TestClient(create_app(engine), client=("203.0.113.7", 50000)), engine.enrollment.join_links, clock


def make(links: JoinLinks, clock: Clock, **options: object) -> str:
    """A new link's secret."""
    return links.make(JoinLinkOptions(**options), clock())[1]


def post(http: TestClient, name: str, secret: str | None, key: str | None = None) -> httpx.Response:
    body = {"device": name, **({"key": key} if key else {})}
    headers = {"Authorization": f"Bearer {secret}"} if secret is not None else {}
    return http.post("/v1/enroll", json=body, headers=headers)


def serve_cli(*args: str) -> object:
    return CliRunner().invoke(cli_app, ["serve", "join-link", *args])


def test_durations_and_caps_are_checked_in_one_line() -> None:
    assert [parse_duration(text) for text in ("90", "30m", "1h", "1.5h", "2d", "1w", "never")] == [
        90,
        1800,
        HOUR,
        1.5 * HOUR,
        48 * HOUR,
        7 * 24 * HOUR,
        None,
    ]
    for text in ("", "0h", "-1h", "1x", "1 hour", "nan"):
        with pytest.raises(ValueError):
            parse_duration(text)
    assert JoinLinkOptions(single_use=True).cap == 1 and JoinLinkOptions(max_devices=20).cap == 20
    assert JoinLinkOptions().seconds == 24 * HOUR  # a link expires unless it is told `never`


def test_a_link_enrolls_until_it_expires_then_says_to_ask_for_a_new_one(tmp_path: Path) -> None:
    http, links, clock = link_app(tmp_path)
    assert refusal(post(http, "phone-0", "anything-0123456789"), 403, "enrollment_closed")  # no secret, no link yet
    secret = make(links, clock, expires="1h")
    http, links, _ = link_app(tmp_path, clock=clock)  # a restart keeps the link and when it expires
    clock.now += HOUR - 1
    assert post(http, "phone-1", secret).status_code == 200
    clock.now += 1
    body = refusal(post(http, "phone-2", secret), 410, "join_link_expired")
    assert "ask the operator for a new join link" in body["fix"] and secret not in body["detail"] + body["fix"]
    for attempt in range(30):  # a known link is no guess: it never locks the address out
        refusal(post(http, f"phone-{attempt + 3}", secret), 410, "join_link_expired")
    assert len(http.app.state.engine.enrollment.limiter) == 0
    refusal(post(http, "intruder", "wrong-secret-0123456789"), 401, "unauthorized")  # links exist: 401, not 403
    assert enrolled(tmp_path / "state") == ["phone-1"]


def test_a_capped_link_enrolls_its_devices_and_a_single_use_link_one(tmp_path: Path) -> None:
    http, links, clock = link_app(tmp_path, shared="shared-secret-of-the-fleet-0123456789")
    capped = make(links, clock, max_devices=2, expires="never")
    assert [post(http, f"phone-{i}", capped).status_code for i in range(2)] == [200, 200]
    body = refusal(post(http, "phone-2", capped), 410, "join_link_used_up")
    assert "2 devices it was made for" in body["detail"]
    once = make(links, clock, single_use=True)
    refusal(post(http, "phone-0", once), 409, "already_enrolled")  # a refused name takes no place
    assert post(http, "phone-3", once).status_code == 200
    assert "single-use" in refusal(post(http, "phone-4", once), 410, "join_link_used_up")["detail"]
    assert post(http, "phone-5", "shared-secret-of-the-fleet-0123456789").status_code == 200  # the fleet secret too
    assert [link.used for link in links.all()] == [2, 1]
    assert enrolled(tmp_path / "state") == ["phone-0", "phone-1", "phone-3", "phone-5"]
    assert capped.encode() not in state_bytes(tmp_path / "state") and once.encode() not in state_bytes(
        tmp_path / "state"
    )


def test_a_retry_after_a_lost_reply_gets_its_token_from_a_used_up_link_and_takes_no_place(tmp_path: Path) -> None:
    http, links, clock = link_app(tmp_path)
    once = make(links, clock, single_use=True, expires="1h")
    first = post(http, "web-1", once, KEY)
    assert first.status_code == 200
    again = post(http, "web-1", once, KEY)  # the first reply was lost: the same name and key
    assert again.status_code == 200 and again.json()["token"] != first.json()["token"]
    clock.now += 2 * HOUR
    assert post(http, "web-1", once, KEY).status_code == 200  # even once the link expired
    refusal(post(http, "web-1", once, f"{KEY}x"), 410, "join_link_expired")  # another key is another device
    assert links.all()[0].used == 1
    links.revoke(links.all()[0].link_id, clock())
    refusal(post(http, "web-1", once, KEY), 410, "join_link_revoked")  # revoked: nothing more at all


def enroll_racing(store: Store, link_id: int, name: str, start: threading.Barrier, outcomes: list[str]) -> None:
    """Enroll `name` through the link once every racer is ready; note whether it got a place."""
    start.wait()
    try:
        JoinLinks(store).enroll(link_id, name, hash_token(f"token-of-{name}"), 2.0, None)
        outcomes.append("enrolled")
    except JoinLinkClosed:
        outcomes.append("closed")


def test_two_phones_racing_for_the_last_place_one_gets_it(tmp_path: Path) -> None:
    stores = [Store(tmp_path / "state") for _ in range(2)]  # two connections, as two processes would have
    try:
        for race in range(10):
            link, _ = JoinLinks(stores[0]).make(JoinLinkOptions(single_use=True), 1.0)
            start, outcomes = threading.Barrier(2), []
            threads = [
                threading.Thread(target=enroll_racing, args=(store, link.link_id, f"p{race}-{i}", start, outcomes))
                for i, store in enumerate(stores)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert sorted(outcomes) == ["closed", "enrolled"], race
            assert JoinLinks(stores[1]).all()[-1].used == 1
        assert stores[0].count_devices() == 10
    finally:
        for store in stores:
            store.close()


def test_the_cli_makes_lists_and_revokes_links_on_a_servers_state(tmp_path: Path) -> None:
    state = tmp_path / "state"
    missing = serve_cli("--state", str(state))
    assert missing.exit_code == 2 and missing.output.count("\n") == 1 and "holds no server state" in missing.output
    Store(state).close()
    unknown = serve_cli("--state", str(state))
    assert unknown.exit_code == 2 and "pass --base-url" in unknown.output
    for bad in (["--expires", "soon"], ["--single-use", "--max-devices", "3"], ["--base-url", "host:8080"]):
        refused = serve_cli("--state", str(state), "--base-url", "https://h:8443", *bad)
        assert refused.exit_code == 2 and refused.output.startswith("error: "), (bad, refused.output)
        assert refused.output.count("\n") == 1, refused.output
    made = serve_cli("--state", str(state), "--base-url", "https://h:8443/", "--expires", "1h", "--max-devices", "20")
    assert made.exit_code == 0, made.output
    link = made.output.splitlines()[0]
    match = re.fullmatch(r"https://h:8443/device/#enroll=([A-Za-z0-9_-]{43})", link)
    assert match, link
    assert "join link 1: expires " in made.output and "at most 20 devices" in made.output
    assert "█" not in made.output  # no QR code into a pipe unless asked
    shown = serve_cli("--state", str(state), "--base-url", "https://h:8443", "--single-use", "--qr")
    assert shown.exit_code == 0 and "█" in shown.output and "one device" in shown.output
    assert match[1].encode() not in state_bytes(state)

    listed = serve_cli("list", "--state", str(state))
    assert listed.exit_code == 0 and len(listed.output.splitlines()) == 2
    assert (
        listed.output.startswith("1\topen (for 60 min)\texpires ") and "at most 20 devices\t0 enrolled" in listed.output
    )
    revoked = serve_cli("revoke", "1", "--state", str(state))
    assert revoked.exit_code == 0 and revoked.output.startswith("1\trevoked ")
    absent = serve_cli("revoke", "7", "--state", str(state))
    assert absent.exit_code == 2 and "there is no join link 7" in absent.output


@pytest.mark.slow
def test_a_running_server_sees_new_links_and_counts_them_across_a_restart(tmp_path: Path) -> None:
    make_bundle(tmp_path / "bundle")
    state = tmp_path / "state"
    server = LiveServer(tmp_path / "bundle", state).start()  # no --enroll-secret-file: links only
    try:
        made = serve_cli("--state", str(state), "--max-devices", "2")  # the base URL `serve` announced
        assert made.exit_code == 0, made.output
        link = made.output.splitlines()[0]
        assert link.startswith(f"{server.url}/device/#enroll=")
        secret = link.split("#enroll=")[1]
        enroll = lambda name: httpx.post(  # noqa: E731
            f"{server.url}/v1/enroll", json={"device": name}, headers={"Authorization": f"Bearer {secret}"}
        )
        assert enroll("phone-1").status_code == 200  # no restart needed
        server.kill()  # kill -9
        server.start()
        assert enroll("phone-2").status_code == 200
        refusal(enroll("phone-3"), 410, "join_link_used_up")
        server.stop()
        server.start()
        refusal(enroll("phone-3"), 410, "join_link_used_up")
    finally:
        server.stop()
    assert enrolled(state) == ["phone-1", "phone-2"]
    assert secret not in server.log.read_text()
    with closing(sqlite3.connect(state / DB_NAME)) as db:
        assert db.execute("SELECT used, max_devices FROM join_links").fetchall() == [(2, 2)]


@runtime_needed
def test_the_join_page_makes_a_link_that_expires(tmp_path: Path) -> None:
    http, _ = app_client(tmp_path, public_status=True)
    form = {"expires": "30m", "max_devices": "3"}
    assert http.post("/join", data=form).status_code == 401  # the same password as the join page
    assert http.post("/join", data=form, headers=basic("wrong secret")).status_code == 401
    page = http.post("/join", data=form, headers=basic(SECRET))
    assert page.status_code == 200 and page.headers["cache-control"] == "no-store"
    link = re.search(r'id="join-link" href="([^"]+)"', page.text)[1]
    assert link.startswith("http://testserver/device/#enroll=") and SECRET not in link
    assert "at most 3 devices" in page.text and "join-link revoke 1" in page.text and "<svg" in page.text
    secret = link.split("#enroll=")[1]
    enrolled_reply = http.post("/v1/enroll", json={"device": "phone-1"}, headers={"Authorization": f"Bearer {secret}"})
    assert enrolled_reply.status_code == 200
    for bad in ({"expires": "soon"}, {"expires": "1h", "max_devices": "0"}):
        refused = http.post("/join", data=bad, headers=basic(SECRET))
        assert refused.status_code == 422 and refused.json()["fix"], refused.text
    huge = http.post("/join", content=b"expires=" + b"1" * 4096, headers=basic(SECRET))
    assert huge.status_code == 413
    shared = http.get("/join", headers=basic(SECRET))
    assert 'method="post" action="/join"' in shared.text and "never expires" in shared.text


def test_every_refusal_code_of_enrollment_has_one_http_status() -> None:
    import edgepfl.server.enrollment as enrollment
    import edgepfl.server.joinlinks as joinlinks
    from edgepfl.server.http_errors import STATUS

    for module in (enrollment, joinlinks):
        raised = set(re.findall(r'Refused\(\s*"([a-z_]+)"', Path(module.__file__).read_text()))
        assert raised and raised <= set(STATUS), sorted(raised - set(STATUS))


def test_the_join_page_leads_with_a_link_for_one_device_that_expires() -> None:
    from edgepfl.server.page import render_join_page
    from edgepfl.server.web import SHARED_LINK_NOTE

    page = render_join_page("http://x/device/#enroll=fleet-secret", SHARED_LINK_NOTE, shared=True)
    # first the form (one device, an hour), then the fleet-wide link that never expires, folded away
    assert page.index('<form method="post"') < page.index("<details>") < page.index('id="join-link"')
    assert "<summary>The fleet-wide link (never expires)</summary>" in page
    assert 'name="max_devices" type="number" min="1" size="4" value="1"' in page and 'value="1h"' in page
    made = render_join_page("http://x/device/#enroll=one-link", "This is join link 1")
    assert made.index('id="join-link"') < made.index('<form method="post"') and "<details>" not in made
