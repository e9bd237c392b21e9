"""The server side of the browser device: headers, allow-lists, the missing runtime, --no-web, the join link."""

from __future__ import annotations

import base64
import json
import logging
import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest
import segno
from fastapi.testclient import TestClient
from server_helpers import LiveServer, enroll, make_bundle

from edgepfl.kinds import InputSpec, NextWordKind
from edgepfl.manifest import Manifest, load_manifest
from edgepfl.server import web
from edgepfl.server.app import create_app
from edgepfl.server.config import ServerConfig
from edgepfl.server.engine import create_engine

SECRET = "join-secret-0123456789abcdef/+?&#"  # characters a URL fragment must escape
PORTABLE = {
    "steps": {
        "full": {"model": "portable/step_full.onnx"},
        "personal": {
            "model": "portable/step_personal.onnx",
            "frozen": {"model": "portable/step_personal_frozen.onnx", "data_location": "frozen.bin"},
        },
    },
    "eval": {"model": "portable/eval.onnx"},
    "initial": "portable/initial.safetensors",
}
runtime_needed = pytest.mark.skipif(
    not web.find_web_runtime().ready, reason="the device page's runtime is missing: npm ci --prefix device_runtime/web"
)


def portable_bundle(folder: Path) -> Manifest:
    """The tiny server bundle with an `engines.portable` entry, its files, and two files it does not list."""
    manifest = make_bundle(folder)
    graphs = ("step_full.onnx", "step_personal.onnx", "step_personal_frozen.onnx", "eval.onnx", "distill_kd_full.onnx")
    for name in graphs:
        (folder / "portable" / name).write_bytes(f"graph {name}".encode())
    (folder / "model.onnx").write_bytes(b"inference model")
    manifest = Manifest(**{**vars(manifest), "engines": {"portable": PORTABLE}})
    manifest.save(folder)
    return load_manifest(folder)


def app_client(tmp_path: Path, **config: object) -> tuple[TestClient, dict[str, str]]:
    """An in-process app (no round loop) on the portable bundle, and a device token."""
    portable_bundle(tmp_path / "bundle")
    tokens = enroll(tmp_path / "state", "phone")
    options = {"bundle": tmp_path / "bundle", "state": tmp_path / "state", "enroll_secret": SECRET, **config}
    return TestClient(create_app(create_engine(ServerConfig(**options)))), tokens


def basic(password: str, user: str = "operator") -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text_in: dict[str, str] = {}
        self._open: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._open = tag

    def handle_data(self, data: str) -> None:
        if self._open in ("script", "style") and data.strip():
            self.text_in[self._open] = data


@runtime_needed
def test_device_page_is_isolated_and_locked_to_its_origin(tmp_path: Path) -> None:
    http, _ = app_client(tmp_path)
    reply = http.get("/device/")
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/html")
    assert reply.headers["cross-origin-opener-policy"] == "same-origin"
    assert reply.headers["cross-origin-embedder-policy"] == "require-corp"
    assert reply.headers["cross-origin-resource-policy"] == "same-origin"
    assert reply.headers["x-content-type-options"] == "nosniff"
    assert reply.headers["referrer-policy"] == "no-referrer"
    # the motion sensors for the page itself only (a sensor bundle records the phone's motion), nothing else's
    features = dict(part.strip().split("=", 1) for part in reply.headers["permissions-policy"].split(","))
    assert features["accelerometer"] == features["gyroscope"] == "(self)"
    assert {name: allowed for name, allowed in features.items() if allowed != "()"} == {
        "accelerometer": "(self)",
        "gyroscope": "(self)",
    }
    policy = dict(part.strip().split(" ", 1) for part in reply.headers["content-security-policy"].split(";"))
    assert policy["default-src"] == "'self'" and policy["connect-src"] == "'self'"
    assert (
        policy["script-src"] == "'self' 'wasm-unsafe-eval'"
        and "unsafe-inline" not in reply.headers["content-security-policy"]
    )
    assert policy["img-src"] == "'self' blob: data:"
    page = _Tags()
    page.feed(reply.text)
    assert page.text_in == {}, "inline script or style"
    assert all("style" not in attrs and not any(k.startswith("on") for k in attrs) for _, attrs in page.tags)
    scripts = [attrs for tag, attrs in page.tags if tag == "script"]
    assert scripts and all(attrs.get("src") and "//" not in attrs["src"] for attrs in scripts)
    assert http.get("/device", follow_redirects=False).headers["location"] == "/device/"
    module = http.get("/device/app.js")
    assert module.status_code == 200 and module.headers["content-type"].startswith("text/javascript")
    assert module.headers["content-security-policy"] == web.CONTENT_SECURITY_POLICY


@runtime_needed
def test_the_device_contract_is_served_like_the_page_s_modules(tmp_path: Path) -> None:
    from edgepfl.device_runtime.contract import device_contract

    http, _ = app_client(tmp_path)
    reply = http.get("/device/contract.json")
    assert reply.status_code == 200 and reply.headers["content-type"] == "application/json"
    assert reply.json() == json.loads(json.dumps(device_contract()))
    page = http.get("/device/app.js")
    for header in ("cross-origin-embedder-policy", "content-security-policy", "cache-control", "referrer-policy"):
        assert reply.headers[header] == page.headers[header], header
    assert http.get("/device/contract.json", headers={"If-None-Match": reply.headers["etag"]}).status_code == 304


@runtime_needed
def test_only_allow_listed_runtime_files_are_served(tmp_path: Path) -> None:
    http, _ = app_client(tmp_path)
    for name in web.VENDOR_FILES:
        reply = http.get(f"/device/vendor/{name}", headers={"Accept-Encoding": "identity"})
        assert reply.status_code == 200, name
        expected = "application/wasm" if name.endswith(".wasm") else "text/javascript; charset=utf-8"
        assert reply.headers["content-type"] == expected
        assert reply.headers["cross-origin-embedder-policy"] == "require-corp"
    wasm = http.get("/device/vendor/ort-wasm-simd-threaded.wasm", headers={"Accept-Encoding": "gzip"})
    assert wasm.headers["content-encoding"] == "gzip" and wasm.content[:4] == b"\0asm"  # httpx un-gzips
    again = http.get("/device/vendor/ort-wasm-simd-threaded.wasm", headers={"If-None-Match": wasm.headers["etag"]})
    assert again.status_code == 304 and again.content == b""
    for path in (
        "/device/vendor/ort.all.min.mjs",  # the 28 MB JSEP/WebGPU build is not on the list
        "/device/vendor/ort.wasm.min.mjs.map",
        "/device/vendor/..%2Fpackage.json",
        "/device/vendor/%2e%2e/%2e%2e/package.json",
        "/device/package.json",
        "/device/..%2F..%2Fpyproject.toml",
        "/device/README.md",
    ):
        reply = http.get(path)
        assert reply.status_code == 404, path
        assert reply.json()["error"] == "not_found" and "fix" in reply.json()


def test_bundle_files_are_the_portable_ones_and_need_a_token(tmp_path: Path) -> None:
    http, tokens = app_client(tmp_path)
    auth = {"Authorization": f"Bearer {tokens['phone']}"}
    assert http.get("/device/bundle/manifest.json").status_code == 401
    manifest = http.get("/device/bundle/manifest.json", headers=auth)
    assert manifest.status_code == 200 and manifest.json()["engines"]["portable"] == PORTABLE
    listed = [f"portable/{name}.onnx" for name in ("step_full", "step_personal", "step_personal_frozen", "eval")]
    for name in [*listed, "portable/initial.safetensors", "model.onnx"]:  # model.onnx: the page's model file
        assert http.get(f"/device/bundle/{name}").status_code == 401, name
        reply = http.get(f"/device/bundle/{name}", headers=auth)
        assert reply.status_code == 200 and reply.content == (tmp_path / "bundle" / name).read_bytes(), name
        assert reply.headers["cross-origin-resource-policy"] == "same-origin"
    unlisted = ("portable/distill_kd_full.onnx", "portable/%2E%2E/manifest.json", "%2E%2E/state/x.db", "model.onnx_")
    for name in unlisted:
        assert http.get(f"/device/bundle/{name}", headers=auth).status_code == 404, name


def test_a_bundle_without_model_onnx_serves_the_rest(tmp_path: Path) -> None:
    portable_bundle(tmp_path / "bundle")
    (tmp_path / "bundle" / "model.onnx").unlink()
    tokens = enroll(tmp_path / "state", "phone")
    config = ServerConfig(bundle=tmp_path / "bundle", state=tmp_path / "state")
    http = TestClient(create_app(create_engine(config)))
    auth = {"Authorization": f"Bearer {tokens['phone']}"}
    assert http.get("/device/bundle/model.onnx", headers=auth).status_code == 404
    assert http.get("/device/bundle/portable/eval.onnx", headers=auth).status_code == 200


def test_a_text_bundle_serves_its_vocabulary_to_the_page(tmp_path: Path) -> None:
    manifest = portable_bundle(tmp_path / "bundle")
    (tmp_path / "bundle" / "vocab.json").write_bytes(b'{"format": "edgepfl-vocab/1"}')
    kind = NextWordKind(input=InputSpec(shape=(4,), dtype="int64"), vocab_size=manifest.num_classes, seq_len=4)
    Manifest(**{**vars(manifest), "kind": kind}).save(tmp_path / "bundle")
    tokens = enroll(tmp_path / "state", "phone")
    http = TestClient(create_app(create_engine(ServerConfig(bundle=tmp_path / "bundle", state=tmp_path / "state"))))
    assert http.get("/device/bundle/vocab.json").status_code == 401
    reply = http.get("/device/bundle/vocab.json", headers={"Authorization": f"Bearer {tokens['phone']}"})
    assert reply.status_code == 200 and reply.content == (tmp_path / "bundle" / "vocab.json").read_bytes()


def test_a_missing_runtime_turns_the_page_off_with_one_line_naming_the_fix(tmp_path, monkeypatch, caplog) -> None:
    folder = tmp_path / "web"
    (folder / "src").mkdir(parents=True)
    (folder / "src" / "index.html").write_text("<!doctype html>")
    monkeypatch.setattr(web, "web_folder", lambda: folder)
    with caplog.at_level(logging.WARNING, logger="edgepfl.server.web"):
        http, tokens = app_client(tmp_path, public_status=True)
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 1 and f"npm ci --prefix {folder}" in lines[0] and "--no-web" in lines[0]
    assert "\n" not in lines[0]
    for path in ("/device/", "/device/app.js", "/device/vendor/ort.wasm.min.mjs", "/join"):
        reply = http.get(path)
        assert reply.status_code == 503, path
        assert reply.json()["error"] == "device_page_off" and reply.json()["fix"].startswith("npm ci --prefix")
    assert f"npm ci --prefix {folder}" in http.get("/").text
    assert http.get("/v1/task", headers={"Authorization": f"Bearer {tokens['phone']}"}).status_code == 200


@runtime_needed
def test_join_link_is_shown_only_to_whoever_knows_the_secret(tmp_path: Path) -> None:
    http, tokens = app_client(tmp_path, public_status=True, enroll_max_failures=3)
    status = http.get("/").text
    assert "/join" in status and SECRET not in status and quote(SECRET, safe="") not in status
    for _ in range(5):  # a browser asks without credentials first: a prompt, not a failed guess
        prompt = http.get("/join")
        assert prompt.status_code == 401 and prompt.headers["www-authenticate"].startswith("Basic ")
        assert SECRET not in prompt.text
    assert http.get("/join", headers={"Authorization": f"Bearer {tokens['phone']}"}).status_code == 401
    reply = http.get("/join", headers=basic(SECRET))
    assert reply.status_code == 200 and reply.headers["cache-control"] == "no-store"
    link = f"http://testserver/device/#enroll={quote(SECRET, safe='')}"
    assert web.join_url("http://testserver/", SECRET) == link
    assert link.split("#")[0] == "http://testserver/device/" and "?" not in link
    assert f'href="{link}"' in reply.text
    assert segno.make(link, error="m").svg_inline(scale=6, border=2, title="join link") in reply.text
    for _ in range(3):
        assert http.get("/join", headers=basic("wrong secret")).status_code == 401
    blocked = http.get("/join", headers=basic("wrong secret"))  # wrong guesses count, as for POST /v1/enroll
    assert blocked.status_code == 429 and "Retry-After" in blocked.headers
    assert http.get("/join", headers=basic(SECRET)).status_code == 200  # the right secret still passes


@runtime_needed
def test_join_without_self_enrollment_names_the_token_link(tmp_path: Path) -> None:
    http, _ = app_client(tmp_path, enroll_secret=None, public_status=True)
    reply = http.get("/join", headers=basic("anything"))
    assert reply.status_code == 403 and "#token=" in reply.json()["fix"]
    assert "/device/#token=TOKEN" in http.get("/").text


def test_no_web_serves_neither_page_nor_join_link(tmp_path: Path) -> None:
    http, _ = app_client(tmp_path, web=False, public_status=True)
    for path in ("/device/", "/device/vendor/ort.wasm.min.mjs", "/device/bundle/manifest.json", "/join"):
        assert http.get(path).status_code == 404, path
    assert "device page is off (--no-web)" in http.get("/").text


# `edgepfl serve` with the runtime looked for in an empty folder (argv[1]), as after `pip install` without npm
SERVE_WITHOUT_RUNTIME = """
import pathlib, sys
folder = pathlib.Path(sys.argv.pop(1))
from edgepfl.server import web
web.web_folder = lambda: folder
sys.argv[0] = 'edgepfl'
from edgepfl.cli import app
app()
"""


@pytest.mark.slow
def test_serve_without_runtime_says_so_once_and_serves_the_python_devices(tmp_path: Path) -> None:
    portable_bundle(tmp_path / "bundle")
    tokens = enroll(tmp_path / "state", "a")
    server = LiveServer(tmp_path / "bundle", tmp_path / "state")
    empty = str(tmp_path / "empty")
    # `serve --bundle ... --port P` as LiveServer writes it when it starts (it picks the port then)
    server.command = lambda: [sys.executable, "-c", SERVE_WITHOUT_RUNTIME, empty, *LiveServer.command(server)[3:]]
    with server:
        assert httpx.get(f"{server.url}/device/").status_code == 503
        task = httpx.get(f"{server.url}/v1/task", headers={"Authorization": f"Bearer {tokens['a']}"})
        assert task.status_code == 200
    lines = [line for line in server.log.read_text().splitlines() if "device page is off" in line]
    assert len(lines) == 1 and re.search(r"fix: npm ci --prefix \S+empty \(or pass --no-web", lines[0]), lines


@pytest.mark.slow
def test_serve_no_web_flag(tmp_path: Path) -> None:
    portable_bundle(tmp_path / "bundle")
    with LiveServer(tmp_path / "bundle", tmp_path / "state", "--no-web", "--public-status") as server:
        assert httpx.get(f"{server.url}/device/").status_code == 404
        assert "--no-web" in httpx.get(f"{server.url}/").text
    assert "device page is off" not in server.log.read_text()
