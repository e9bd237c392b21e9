"""The browser device's secure aggregation (device_runtime/web/src/secagg.js) in a real headless chromium.

The page (http://127.0.0.1, a secure context: WebCrypto's X25519, HKDF, AES-GCM and AES-CTR are there) replays
the Python device of make_secagg_fixtures.py's round and must send the same bytes, and quantizes the same delta
to the same integers: what secagg.test.mjs checks under Node, checked in the browser the page runs in. Then the
device page itself takes a served secure round with two Python devices (`edgepfl serve --secure-aggregation`).
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from edgepfl.server.web import CHROMIUM, CHROMIUM_ARGS

pytestmark = pytest.mark.browser
REPO = Path(__file__).resolve().parents[1]
REPLAY = """async () => {
  const m = await import('/src/secagg.js');
  const f = await (await fetch('/secagg.json')).json();
  const { round, quantize } = f;
  const queue = round.random.map((c) => m.unb64(c, 'recorded'));
  const random = (count) => queue.shift();
  const client = await m.ClientSession.start(round.device, round.context, random);
  const book = m.messageFromJson(round.book, 'KeyBook');
  const bundle = await client.receiveBook(book, random);
  const inbox = m.messageFromJson(round.inbox, 'ShareInbox');
  const masked = await client.receiveInbox(inbox, Uint32Array.from(quantize.stochastic));
  const reveal = client.receiveUnmask(m.messageFromJson(round.request, 'UnmaskRequest'));
  const tensor = (t) => ({ shape: t.shape, data: Float32Array.from(t.data) });
  const delta = Object.fromEntries(Object.entries(quantize.delta).map(([k, t]) => [k, tensor(t)]));
  const vector = await m.quantizeDelta(delta, quantize.weight, book, m.uniformRandom(quantize.entropy));
  return {
    advert: m.messageToJson('KeyAdvert', client.advert()), bundle: m.messageToJson('ShareBundle', bundle),
    masked: m.messageToJson('MaskedInput', masked), reveal: m.messageToJson('UnmaskShares', reveal),
    state: client.toJSON(), stochastic: Array.from(vector), userAgent: navigator.userAgent,
  };
}"""


def test_chromium_replays_the_python_device_byte_for_byte(tmp_path):
    pytest.importorskip("playwright.sync_api", reason="pip install playwright (the test extra)")
    if not CHROMIUM.is_file():
        pytest.skip(f"no browser at {CHROMIUM}")
    from playwright.sync_api import sync_playwright

    sys.path.insert(0, str(REPO / "device_runtime" / "web" / "test"))
    import make_secagg_fixtures

    make_secagg_fixtures.main(tmp_path)
    shutil.copytree(REPO / "device_runtime" / "web" / "src", tmp_path / "src")
    (tmp_path / "index.html").write_text("<!doctype html><title>secagg</title>")
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Quiet, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=list(CHROMIUM_ARGS))
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{server.server_port}/index.html")
            found = page.evaluate(REPLAY)
            browser.close()
    finally:
        server.shutdown()
    expected = json.loads((tmp_path / "secagg.json").read_text())
    assert "Chrome" in found["userAgent"]
    for key in ("advert", "bundle", "masked", "reveal", "state"):
        assert json.loads(found[key]) == json.loads(expected["round"][key]), key
    assert found["stochastic"] == expected["quantize"]["stochastic"]


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        """No access log on stderr."""


def test_the_device_page_masks_its_update_in_a_served_secure_round(bundle_factory, tmp_path):
    """`edgepfl serve --secure-aggregation` with two Python devices and the device page in chromium: the page masks
    its update through the round's steps, never uploads it, and the round unmasks the three devices' sum."""
    pytest.importorskip("playwright.sync_api", reason="pip install playwright (the test extra)")
    if not CHROMIUM.is_file():
        pytest.skip(f"no browser at {CHROMIUM}")
    import subprocess

    import httpx
    from playwright.sync_api import sync_playwright
    from server_helpers import LiveServer, enroll
    from test_device_runtime import BN_BUNDLE
    from test_web_browser import open_page, wait, write_npz

    bundle = bundle_factory(**BN_BUNDLE)
    state = tmp_path / "server"
    tokens = enroll(state, "py-a", "py-b", "web-phone")
    options = (
        "--min-clients",
        "3",
        "--rounds",
        "1",
        "--poll-interval",
        "0.3",
        "--lr",
        "0.05",
        "--batch-size",
        "16",
        "--round-timeout",
        "300",
        "--secure-aggregation",
        "--secagg-clip",
        "5",
        "--secagg-max-weight",
        "100",
    )
    devices = []
    with LiveServer(bundle, state, *options) as server:
        for i, name in enumerate(("py-a", "py-b")):
            command = [
                sys.executable,
                "-m",
                "edgepfl.cli",
                "device",
                "run",
                "--bundle",
                str(bundle),
                "--data",
                str(write_npz(tmp_path / f"{name}.npz", 48, seed=i)),
                "--server",
                server.url,
                "--token",
                tokens[name],
                "--state",
                str(tmp_path / name),
                "--poll-interval",
                "0.2",
                "--json",
            ]
            devices.append(subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO))
        try:
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=list(CHROMIUM_ARGS))
                try:
                    phone = browser.new_context()
                    requests: list = []
                    phone.on("request", lambda request: requests.append((request.method, urlsplit(request.url).path)))
                    page = open_page(phone)
                    page.goto(f"{server.url}/device/#token={tokens['web-phone']}")
                    wait(page, "body[data-stage=examples]")
                    page.set_input_files("#npz", str(write_npz(tmp_path / "phone.npz", 48, seed=7)))
                    wait(page, "body[data-stage=done]")
                finally:
                    browser.close()
            for process in devices:
                _, err = process.communicate(timeout=120)
                assert process.returncode == 0, err.decode()[-2000:]
            status = httpx.get(f"{server.url}/v1/status", headers={"Authorization": f"Bearer {tokens['py-a']}"}).json()
        finally:
            for process in devices:
                if process.poll() is None:
                    process.kill()
                    process.wait()
    row = status["rounds"][0]
    assert row["state"] == "closed" and row["uploads"] == 0
    assert (row["secure_aggregation"]["masked"], row["secure_aggregation"]["dropped"]) == (3, 0)
    posts = [path.rsplit("/", 1)[-1] for method, path in requests if method == "POST" and "/rounds/" in path]
    assert [post for post in posts if post != "metrics"] == ["advert", "shares", "masked", "reveal"]
