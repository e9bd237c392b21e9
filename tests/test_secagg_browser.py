"""The browser device's secure aggregation (device_runtime/web/src/secagg.js) in a real headless chromium.

The page (http://127.0.0.1, a secure context: WebCrypto's X25519, HKDF, AES-GCM and AES-CTR are there) replays
the Python device of make_secagg_fixtures.py's round and must send the same bytes, and quantizes the same delta
to the same integers: what secagg.test.mjs checks under Node, checked in the browser the page runs in.
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

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
