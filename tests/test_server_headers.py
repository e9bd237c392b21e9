"""The operator's side of the server: security headers on every reply, no API docs from a CDN, the status page
(readable on a phone, "Add a device"), and the lines `edgepfl serve` prints at start."""

from __future__ import annotations

import base64
import hashlib
import re
import socket
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from server_helpers import LiveServer, enroll, make_bundle
from test_server_engine import Clock, _open, _update
from test_web_server import SECRET, app_client, basic, runtime_needed

from edgepfl.protocol import EvalMetrics
from edgepfl.server import announce, page, web
from edgepfl.server.app import create_app
from edgepfl.server.config import ServerConfig
from edgepfl.server.engine import RoundEngine, create_engine
from edgepfl.server.headers import API_POLICY, DEVICE_FEATURES, HSTS, NO_FEATURES
from edgepfl.server.page import DeviceNote, render_page

pytestmark = pytest.mark.filterwarnings("ignore:Using `httpx`")  # starlette asks for httpx2, not ours


def assert_secured(
    reply: httpx.Response, policy: str | None = API_POLICY, https: bool = False, features: str = NO_FEATURES
) -> None:
    """The headers every reply carries (and its CSP, when `policy` is given; its Permissions-Policy)."""
    assert reply.headers["x-content-type-options"] == "nosniff", reply.request.url
    assert reply.headers["referrer-policy"] == "no-referrer", reply.request.url
    assert ("strict-transport-security" in reply.headers) is https, reply.request.url
    # the motion sensors are the device page's alone (server/headers.py)
    assert reply.headers["permissions-policy"] == features, reply.request.url
    if https:
        assert reply.headers["strict-transport-security"] == HSTS
    if policy is not None:
        assert reply.headers["content-security-policy"] == policy, reply.request.url


def style_hash(html: str) -> str:
    """The CSP source of a page's one inline <style>."""
    styles = re.findall(r"<style>(.*?)</style>", html, re.S)
    assert len(styles) == 1
    return "'sha256-" + base64.b64encode(hashlib.sha256(styles[0].encode()).digest()).decode() + "'"


def rounds_engine(tmp_path: Path, same_eval: bool = True, **config: object) -> tuple[RoundEngine, dict[str, str]]:
    """An engine with two closed rounds of two devices (their posted accuracy equal to the uploaded one, or not)."""
    manifest = make_bundle(tmp_path / "bundle")
    tokens = enroll(tmp_path / "state", "d0", "d1")
    options = {"bundle": tmp_path / "bundle", "state": tmp_path / "state", "min_clients": 2, **config}
    clock = Clock()
    engine = create_engine(ServerConfig(**options), clock)
    for round_id in (1, 2):
        _open(engine, clock, "d0", "d1")
        for device in ("d0", "d1"):
            _update(engine, device, round_id, 0.1, 10, manifest)
        engine.tick()
        for device in ("d0", "d1"):  # the uploads said val_accuracy 0.8
            engine.accept_metrics(device, round_id, EvalMetrics(0.8 if same_eval else 0.6, 10, 0.3))
    return engine, tokens


# ---- headers


def test_every_api_reply_carries_the_security_headers_errors_included(tmp_path: Path, monkeypatch) -> None:
    engine, tokens = rounds_engine(tmp_path, max_upload_mb=0.001)
    auth = {"Authorization": f"Bearer {tokens['d0']}"}
    http = TestClient(create_app(engine), raise_server_exceptions=False)
    replies = {
        200: http.get("/v1/status", headers=auth),
        401: http.get("/v1/task"),
        404: http.get("/no/such/route"),
        405: http.delete("/v1/task", headers=auth),
        413: http.post("/v1/rounds/2/update", content=b"x" * 2048, headers=auth),
        422: http.get("/v1/rounds/0/base", headers=auth),
    }
    monkeypatch.setattr(engine, "history", lambda: 1 / 0)  # a bug: the outermost error handler answers 500
    replies[500] = http.get("/v1/history", headers=auth)
    for status, reply in replies.items():
        assert reply.status_code == status, (status, reply.text)
        assert_secured(reply)
    assert_secured(http.get("/plot.png", headers=auth))
    assert_secured(http.get("/openapi.json"))

    over_tls = TestClient(create_app(engine), base_url="https://testserver", raise_server_exceptions=False)
    for reply in (
        over_tls.get("/v1/status", headers=auth),
        over_tls.get("/v1/task"),
        over_tls.get("/v1/history", headers=auth),
    ):
        assert_secured(reply, https=True)


def test_api_docs_are_off_and_the_spec_is_served(tmp_path: Path) -> None:
    http, _ = app_client(tmp_path, public_status=True)
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        assert http.get(path).status_code == 404, path
    spec = http.get("/openapi.json")
    assert spec.status_code == 200 and "/v1/enroll" in spec.json()["paths"]
    assert "cdn" not in http.get("/").text.lower()


def test_the_status_page_allows_its_own_style_and_nothing_else(tmp_path: Path) -> None:
    http, tokens = app_client(tmp_path)
    reply = http.get("/", headers={"Authorization": f"Bearer {tokens['phone']}"})
    assert reply.status_code == 200
    policy = reply.headers["content-security-policy"]
    assert policy == page.STATUS_PAGE_POLICY and "script-src" not in policy and "unsafe" not in policy
    assert f"style-src {style_hash(reply.text)};" in policy and "img-src data:;" in policy
    assert "<script" not in reply.text and " style=" not in reply.text
    assert_secured(reply, policy=None)
    refused = http.get("/")  # a browser sends no token: the fix says how to open the page
    assert refused.status_code == 401 and "--public-status" in refused.json()["fix"]
    assert_secured(refused)


@runtime_needed
def test_the_device_and_join_pages_keep_their_own_policies(tmp_path: Path) -> None:
    http, _ = app_client(tmp_path)
    device = http.get("/device/")
    assert_secured(device, web.CONTENT_SECURITY_POLICY, features=DEVICE_FEATURES)
    assert device.headers["cross-origin-embedder-policy"] == "require-corp"
    assert_secured(http.get("/device/vendor/nothing.mjs"), API_POLICY)  # a 404 of the device routes
    prompt = http.get("/join")
    assert prompt.status_code == 401 and prompt.headers["cache-control"] == "no-store"
    assert_secured(prompt, page.JOIN_PAGE_POLICY)
    joined = http.get("/join", headers=basic(SECRET))
    assert_secured(joined, page.JOIN_PAGE_POLICY)
    assert f"style-src {style_hash(joined.text)};" in joined.headers["content-security-policy"]
    assert "form-action 'self'" in joined.headers["content-security-policy"] and "<script" not in joined.text
    over_tls = TestClient(http.app, base_url="https://testserver")
    assert_secured(over_tls.get("/device/"), web.CONTENT_SECURITY_POLICY, https=True, features=DEVICE_FEATURES)


@pytest.mark.slow
def test_uvicorns_own_400_and_a_tls_server_carry_the_headers(tmp_path: Path) -> None:
    make_bundle(tmp_path / "bundle")
    with LiveServer(tmp_path / "bundle", tmp_path / "state") as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as raw:
            raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nBad Header Without Colon\r\n\r\n")
            reply = b""
            while chunk := raw.recv(4096):
                reply += chunk
        head = reply.split(b"\r\n\r\n", 1)[0].decode().lower()
        assert head.startswith("http/1.1 400"), head
        assert "x-content-type-options: nosniff" in head and "referrer-policy: no-referrer" in head
        assert f"content-security-policy: {API_POLICY}" in head and "strict-transport-security" not in head


# ---- the status page


def test_the_status_page_links_to_join_only_when_a_shared_secret_opens_it(tmp_path: Path) -> None:
    def status_page(folder: Path, **config: object) -> str:
        http, _ = app_client(folder, public_status=True, **config)
        return http.get("/").text

    with_secret = status_page(tmp_path / "secret")
    assert ('<a class="add" href="/join">Add a device</a>' in with_secret) is web.find_web_runtime().ready
    assert 'name="viewport"' in with_secret
    for folder, config in (("none", {"enroll_secret": None}), ("off", {"web": False})):
        assert "Add a device" not in status_page(tmp_path / folder, **config)
    assert "serve join-link" in status_page(tmp_path / "links", enroll_secret=None) or not web.find_web_runtime().ready


@pytest.mark.parametrize("same_eval", [True, False], ids=["personalized-equals-trained", "they-differ"])
def test_the_table_shows_each_column_once_and_only_columns_with_numbers(tmp_path: Path, same_eval: bool) -> None:
    engine, _ = rounds_engine(tmp_path, same_eval)
    status = engine.status()
    headers = re.findall(r"<th>(.*?)</th>", render_page(status))
    assert len(headers) == len(set(headers))
    merged = "val acc after training = personalized acc (mean)"
    assert (merged in headers) is same_eval
    assert ("personalized acc (mean)" in headers) is not same_eval
    assert "ε" not in headers and "note" not in headers  # no DP, no notes: nothing to show
    assert {"round", "state", "uploads / sampled", "train loss", "closed"} <= set(headers)
    rows = re.findall(r"<tr>(.*?)</tr>", render_page(status))[1:]
    assert len(rows) == 3 and all(row.count("<td>") == len(headers) for row in rows)  # round 3 is open


def test_the_plot_draws_equal_curves_once_and_its_legend_beside_the_axes(tmp_path: Path, monkeypatch) -> None:
    engine, _ = rounds_engine(tmp_path)
    drawn: list[tuple] = []
    monkeypatch.setattr(page, "_plot_png", lambda series: drawn.append(series) or b"")
    page.render_plot(engine.status())
    labels = [label for label, points in drawn[0] if points]
    assert labels == ["after training, at upload = personalized, after round"]

    monkeypatch.undo()  # the real _plot_png, with a spy on where the legend goes
    from matplotlib.figure import Figure

    legends: list[dict] = []
    real_legend = Figure.legend
    monkeypatch.setattr(Figure, "legend", lambda self, *a, **k: legends.append(k) or real_legend(self, *a, **k))
    page._plot_png.cache_clear()
    assert page.render_plot(engine.status()).startswith(b"\x89PNG")
    assert len(legends) == 1 and legends[0]["loc"].startswith("outside"), legends  # below the axes, off the curves


# ---- what `edgepfl serve` prints at start


def test_startup_lines_name_the_status_page_and_join_as_phones_reach_them(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(announce, "machine_addresses", lambda ipv6=False: ["192.168.1.5", "10.0.0.2"])
    urls = announce.base_urls("0.0.0.0", 8443, tls=True)
    assert urls == ["https://192.168.1.5:8443", "https://10.0.0.2:8443"]
    assert announce.base_urls("127.0.0.1", 8080, tls=False) == ["http://127.0.0.1:8080"]
    monkeypatch.setattr(announce, "machine_addresses", lambda ipv6=False: ["fd00::5"])
    assert announce.base_urls("::", 8080, tls=False) == ["http://[fd00::5]:8080"]

    state = tmp_path / "state"
    joined = announce.startup_lines(urls, False, DeviceNote("", add_device=True, page=True), state)
    assert joined == [
        "status page: https://192.168.1.5:8443/ or https://10.0.0.2:8443/ "
        "(needs a token: pass --public-status to open it in a browser)",
        "add a device: https://192.168.1.5:8443/join or https://10.0.0.2:8443/join "
        "(type the enrollment secret as the password for the QR code)",
    ]
    links = announce.startup_lines(urls[:1], True, DeviceNote("", page=True), state)
    assert links[0].endswith("(public: --public-status)") and f"serve join-link --state {state}`" in links[1]
    assert "tokens add NAME" in announce.startup_lines(urls, True, DeviceNote(""), state)[1]


def test_machine_addresses_are_reachable_ones() -> None:
    import ipaddress

    for address in announce.machine_addresses(ipv6=True):
        ip = ipaddress.ip_address(address.split("%")[0])
        assert not (ip.is_loopback or ip.is_link_local or ip.is_unspecified), address


@pytest.mark.slow
def test_serve_prints_where_the_status_page_and_join_are(tmp_path: Path) -> None:
    make_bundle(tmp_path / "bundle")
    (tmp_path / "secret").write_text(SECRET)
    with LiveServer(
        tmp_path / "bundle", tmp_path / "state", "--enroll-secret-file", str(tmp_path / "secret")
    ) as server:
        pass
    lines = server.log.read_text().splitlines()
    assert f"status page: {server.url}/ (needs a token: pass --public-status to open it in a browser)" in lines
    if web.find_web_runtime().ready:
        assert any(line.startswith(f"add a device: {server.url}/join (") for line in lines), lines
    assert SECRET not in server.log.read_text()
