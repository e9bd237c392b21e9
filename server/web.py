"""The browser device's routes: the page and its modules, the wasm runtime, the bundle's portable files, the join link.

Everything under `/device/` is served from an allow-list fixed when the app starts (no path from a request
reaches the file system; `contract.json`, what the page must agree on with the Python device, is made then
too), with cross-origin isolation (COOP/COEP, so onnxruntime-web may use threads) and a
Content-Security-Policy that lets the page talk to this origin only. The join link carries an enrollment
secret in its URL fragment, which browsers never send to a server; `/join` shows it (and its QR code) only
to someone who types the shared secret into the browser's password prompt, and makes links that expire
(server/joinlinks.py) on request.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import hashlib
import importlib.util
import json
import logging
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from urllib.parse import parse_qs

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

from edgepfl.errors import UsageError
from edgepfl.manifest import MANIFEST_NAME
from edgepfl.options import validated
from edgepfl.server.api.auth import device
from edgepfl.server.engine import RoundEngine
from edgepfl.server.errors import ApiError, Refused
from edgepfl.server.headers import DEVICE_FEATURES
from edgepfl.server.joinlinks import DEVICE_PATH, JoinLinkOptions, join_url
from edgepfl.server.page import JOIN_PAGE_POLICY, JOIN_PATH, DeviceNote, render_join_page

log = logging.getLogger("edgepfl.server.web")

# the wasm-only ES build of onnxruntime-web and the one wasm/worker pair it loads; its WebGPU build and the
# (asyncify) wasm pair that one loads, for a page with a WebGPU adapter (src/backend.js); fflate (reads .npz)
VENDOR_FILES = {
    "ort.wasm.min.mjs": "onnxruntime-web/dist/ort.wasm.min.mjs",
    "ort-wasm-simd-threaded.mjs": "onnxruntime-web/dist/ort-wasm-simd-threaded.mjs",
    "ort-wasm-simd-threaded.wasm": "onnxruntime-web/dist/ort-wasm-simd-threaded.wasm",
    "ort.webgpu.min.mjs": "onnxruntime-web/dist/ort.webgpu.min.mjs",
    "ort-wasm-simd-threaded.asyncify.mjs": "onnxruntime-web/dist/ort-wasm-simd-threaded.asyncify.mjs",
    "ort-wasm-simd-threaded.asyncify.wasm": "onnxruntime-web/dist/ort-wasm-simd-threaded.asyncify.wasm",
    "fflate.mjs": "fflate/esm/browser.js",
}
PAGE_SUFFIXES = (".html", ".js", ".css")
INFERENCE_MODEL = "model.onnx"  # the bundle's inference graph: the page writes the device's model file from it
# the headless browser that tests/test_web_browser.py and bench/web.py drive the page in (Debian's chromium)
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = (
    "--no-sandbox",  # CI runs as root, where chromium's sandbox refuses to start
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)
# the same with a WebGPU adapter (SwiftShader, a software GPU, where the machine has no GPU): for a page on 127.0.0.1
CHROMIUM_WEBGPU_ARGS = tuple(arg for arg in CHROMIUM_ARGS if arg != "--disable-gpu") + ("--enable-unsafe-webgpu",)
# the phone they emulate (Playwright context options): a Pixel-sized touch screen, with its CPU slowed this many
# times next to this machine's (DevTools' Emulation.setCPUThrottlingRate)
PHONE_CONTEXT = {
    "viewport": {"width": 390, "height": 844},
    "device_scale_factor": 2,
    "is_mobile": True,
    "has_touch": True,
    "user_agent": "Mozilla/5.0 (Linux; Android 14; Pixel 8) AppleWebKit/537.36 (KHTML, like Gecko) "
    "Chrome/131.0.0.0 Mobile Safari/537.36",
}
PHONE_CPU_SLOWDOWN = 4
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self' 'wasm-unsafe-eval'; connect-src 'self'; img-src 'self' blob: data:; "
    "style-src 'self'; worker-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
DEVICE_HEADERS = {
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Embedder-Policy": "require-corp",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "Permissions-Policy": DEVICE_FEATURES,  # the motion sensors, for the page's own origin only
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidated with the ETag: an upgraded server is picked up at once
}
JOIN_HEADERS = {
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": JOIN_PAGE_POLICY,
}
SHARED_LINK_NOTE = (
    "This link holds the enrollment secret of the whole fleet and never expires: show it only to the people "
    "whose phones should take part; a link made above expires, and can be revoked."
)
_FORM_BYTES = 1024
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".wasm": "application/wasm",
    ".json": "application/json",
}
_COMPRESSED_MIN = 1024  # bytes: smaller files are sent as they are


def web_folder() -> Path:
    """The browser device's folder (`device_runtime/web`), found without importing the device runtime."""
    spec = importlib.util.find_spec("edgepfl.device_runtime")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))) / "web"


@dataclass(frozen=True)
class WebRuntime:
    """The files the device page needs from this machine, and which of them are missing."""

    folder: Path
    missing: tuple[str, ...] = ()

    @property
    def ready(self) -> bool:
        """Whether every file of the page and its runtime is present."""
        return not self.missing

    def problem(self) -> str:
        """One line saying why the page is off and how to turn it on (empty when ready)."""
        if self.ready:
            return ""
        return (
            f"the device page is off: {self.missing[0]} is missing"
            f"{f' (and {len(self.missing) - 1} more)' if len(self.missing) > 1 else ''}; "
            f"fix: npm ci --prefix {self.folder} (or pass --no-web to serve without the page)"
        )


def find_web_runtime(folder: Path | None = None) -> WebRuntime:
    """Check that the page's modules and the allow-listed vendor files exist under `folder`."""
    folder = folder or web_folder()
    wanted = [folder / "src" / "index.html", *(folder / "node_modules" / path for path in VENDOR_FILES.values())]
    return WebRuntime(folder, tuple(str(path) for path in wanted if not path.is_file()))


@dataclass
class StaticFile:
    """One allow-listed file: read once (or made in memory), its ETag, and a gzip copy made on first demand."""

    path: Path
    media_type: str
    made: bytes | None = field(default=None, repr=False)  # the content of a file made when the app starts
    _gzip: bytes | None = field(default=None, repr=False)

    @cached_property
    def content(self) -> bytes:
        """The file's bytes (read once: the runtime does not change while the server runs)."""
        return self.made if self.made is not None else self.path.read_bytes()

    @cached_property
    def etag(self) -> str:
        """A strong ETag: the sha256 of the content."""
        return f'"{hashlib.sha256(self.content).hexdigest()}"'

    def gzipped(self) -> bytes:
        """The content gzip-compressed (kept: the 14 MB wasm compresses to about 4 MB once)."""
        if self._gzip is None:
            self._gzip = gzip.compress(self.content, compresslevel=6, mtime=0)
        return self._gzip

    def response(self, request: Request, headers: dict[str, str]) -> Response:
        """200 with the (possibly gzipped) content, or 304 when the browser holds this version."""
        headers = {**headers, "ETag": self.etag, "Vary": "Accept-Encoding"}
        if request.headers.get("if-none-match") == self.etag:
            return Response(status_code=304, headers=headers)
        body = self.content
        if len(body) >= _COMPRESSED_MIN and "gzip" in request.headers.get("accept-encoding", ""):
            body, headers["Content-Encoding"] = self.gzipped(), "gzip"
        return Response(body, media_type=self.media_type, headers=headers)


def page_files(runtime: WebRuntime) -> dict[str, StaticFile]:
    """The page's own modules by URL name (src/*.html|js|css) and its contract.json, fixed when the server starts.

    The contract (device_runtime/contract.py) is what the page must agree on with the Python device: settings'
    defaults and bounds, the algorithms' phases, refusal codes, timing; made once here, served like a module.
    """
    from edgepfl.device_runtime.contract import CONTRACT_NAME, device_contract

    source = runtime.folder / "src"
    files = {
        path.name: StaticFile(path, MEDIA_TYPES[path.suffix])
        for path in sorted(source.iterdir())
        if path.is_file() and path.suffix in PAGE_SUFFIXES
    }
    contract = json.dumps(device_contract(), indent=1).encode()
    files[CONTRACT_NAME] = StaticFile(source / CONTRACT_NAME, MEDIA_TYPES[".json"], made=contract)
    return files


def vendor_files(runtime: WebRuntime) -> dict[str, StaticFile]:
    """The allow-listed runtime files by URL name."""
    modules = runtime.folder / "node_modules"
    return {name: StaticFile(modules / path, MEDIA_TYPES[Path(name).suffix]) for name, path in VENDOR_FILES.items()}


def bundle_files(engine: RoundEngine) -> dict[str, StaticFile]:
    """manifest.json, the portable engine's files (graphs, frozen variants, initial tensors), the inference
    graph `model.onnx` (the page bakes the device's tensors into it for "save the model") and the files its kind of
    sample needs (a text bundle's vocabulary: the page tokenizes a person's text with it), nothing else."""
    required, optional = engine.manifest.portable_files()
    folder = engine.config.bundle
    files = {MANIFEST_NAME: StaticFile(folder / MANIFEST_NAME, MEDIA_TYPES[".json"])}
    names = [*required, *optional, *([INFERENCE_MODEL] if (folder / INFERENCE_MODEL).is_file() else [])]
    names += engine.manifest.kind.bundle_files
    files.update({name: StaticFile(folder / name, "application/octet-stream") for name in names})
    return files


def web_router(engine: RoundEngine) -> tuple[APIRouter, DeviceNote]:
    """The routes of `/device/...` (page, runtime, bundle files) and `/join`, and what the status page says of them.

    The bundle's files need a device's token. A missing runtime is said once, in the log; the routes then
    answer 503 with the same fix, and the server runs on for the Python devices.
    """
    runtime = find_web_runtime()
    if not runtime.ready:
        log.warning("%s", runtime.problem())
    pages = page_files(runtime) if runtime.ready else {}
    vendor = vendor_files(runtime) if runtime.ready else {}
    bundle = bundle_files(engine)
    router = APIRouter()

    def check_ready() -> None:
        if not runtime.ready:
            problem, _, fix = runtime.problem().partition("; fix: ")
            raise ApiError(503, "device_page_off", problem, fix)

    def not_found(what: str) -> ApiError:
        return ApiError(404, "not_found", f"{what} is not a file of the device page", f"open {DEVICE_PATH}")

    @router.get("/device", include_in_schema=False)
    def device_redirect() -> RedirectResponse:
        return RedirectResponse(DEVICE_PATH, status_code=308)  # a browser keeps the #fragment across it

    @router.get(DEVICE_PATH, include_in_schema=False)
    def device_page(request: Request) -> Response:
        check_ready()
        return pages["index.html"].response(request, DEVICE_HEADERS)

    @router.get(DEVICE_PATH + "vendor/{name}", include_in_schema=False)
    def device_vendor(name: str, request: Request) -> Response:
        check_ready()
        if name not in vendor:
            raise not_found(f"vendor/{name}")
        return vendor[name].response(request, DEVICE_HEADERS)

    @router.get(DEVICE_PATH + "bundle/{path:path}", dependencies=[Depends(device)], include_in_schema=False)
    def device_bundle(path: str, request: Request) -> Response:
        if path not in bundle:
            raise not_found(f"bundle/{path}")
        return bundle[path].response(request, DEVICE_HEADERS)

    @router.get(DEVICE_PATH + "{name}", include_in_schema=False)
    def device_module(name: str, request: Request) -> Response:
        check_ready()
        if name not in pages:
            raise not_found(name)
        return pages[name].response(request, DEVICE_HEADERS)

    def operator(request: Request) -> bool:
        """Whether the request's Basic password is the shared secret (False: ask for it); 403 or 429 refusals."""
        check_ready()
        if engine.config.enroll_secret is None:
            raise ApiError(
                403,
                "enrollment_closed",
                "this server has no shared enrollment secret (it was started without --enroll-secret-file), "
                "so /join cannot tell its operator",
                "make a join link with `edgepfl serve join-link --state STATE` on the server, or restart with "
                f"--enroll-secret-file; a phone can also open {DEVICE_PATH}#token=TOKEN with a token from "
                "`edgepfl serve tokens add NAME`",
            )
        secret = _basic_password(request.headers.get("authorization"))
        if secret is None:  # the browser's first try carries no credentials: ask, without counting a failure
            return False
        address = request.client.host if request.client else "unknown"
        try:
            engine.enrollment.check_enroll_secret(secret, address, join_links=False)
        except Refused as error:
            if error.error != "unauthorized":
                raise
            return False
        return True

    @router.get(JOIN_PATH, response_class=HTMLResponse, include_in_schema=False)
    def join(request: Request) -> Response:
        """The shared join link and its QR code, for whoever types the shared secret as the password."""
        if not operator(request):
            return _password_prompt()
        assert engine.config.enroll_secret is not None
        url = join_url(str(request.base_url), engine.config.enroll_secret)
        return HTMLResponse(render_join_page(url, SHARED_LINK_NOTE, shared=True), headers=JOIN_HEADERS)

    @router.post(JOIN_PATH, response_class=HTMLResponse, include_in_schema=False)
    async def make_join_link(request: Request) -> Response:
        """A new join link that expires (the form of the join page), for the same password."""
        if not await run_in_threadpool(operator, request):
            return _password_prompt()
        form = parse_qs((await _small_body(request)).decode("utf-8", "replace"))
        fields = {"expires": form.get("expires", ["1h"])[0], "max_devices": form.get("max_devices", [""])[0] or None}
        try:
            options = validated(JoinLinkOptions, fields)
        except UsageError as error:
            raise ApiError(422, "invalid_request", error.problem, error.fix) from None
        link, secret = await run_in_threadpool(engine.enrollment.join_links.make, options, engine.clock())
        note = (
            f"This is join link {link.link_id}: it {link.terms()}. Show it only to the people whose phones should "
            f"take part; `edgepfl serve join-link revoke {link.link_id} --state STATE` ends it early."
        )
        page = render_join_page(join_url(str(request.base_url), secret), note)
        return HTMLResponse(page, headers=JOIN_HEADERS)

    if not runtime.ready:
        return router, DeviceNote(runtime.problem())
    if engine.config.enroll_secret is None:
        return router, DeviceNote(
            "Phones join with a link from `edgepfl serve join-link --state STATE`, or open "
            f"{DEVICE_PATH}#token=TOKEN with a token from `edgepfl serve tokens add NAME`.",
            page=True,
        )
    return router, DeviceNote(
        f"Phones join with a join link: open {JOIN_PATH} and type the enrollment secret as the password.", True, True
    )


def _basic_password(authorization: str | None) -> str | None:
    """The password of an `Authorization: Basic` header (the user name is ignored), or None."""
    scheme, _, encoded = (authorization or "").partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return decoded.partition(":")[2] or None


async def _small_body(request: Request) -> bytes:
    """The body of the join page's form (a few fields): 413 past _FORM_BYTES."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > _FORM_BYTES:
            raise ApiError(413, "too_large", f"the form is over {_FORM_BYTES} bytes", "send the join page's form")
    return body


def _password_prompt() -> Response:
    return Response(
        "the join link is shown to whoever knows the enrollment secret: type it as the password (any user name)\n",
        status_code=401,
        media_type="text/plain; charset=utf-8",
        headers={**JOIN_HEADERS, "WWW-Authenticate": 'Basic realm="edgepfl join: password = enrollment secret"'},
    )
