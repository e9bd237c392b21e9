"""Schemathesis' state machine over a real `edgepfl serve` (issue 55): the server's own /openapi.json with OpenAPI
links added, so that generated sequences chain task -> base -> upload -> result/metrics/refusal -> status with the
round each reply names carried to the next request, as enrolled devices (a token per case). Every reply: no 5xx, a
refusal is {error, detail, fix}, and a reply to a device names no other device.
"""

from __future__ import annotations

import zlib
from typing import Any

import httpx
import pytest
import schemathesis
from fuzz_budget import examples, fuzz_settings, reported, seeded
from server_helpers import LiveServer, enroll, make_bundle

CASES = 25  # sequences in CI (each up to STEPS requests)
STEPS = 12
DEVICES = ("dev-amber", "dev-birch", "dev-cedar")


ROUND = "/v1/rounds/{round_id}/"


def with_links(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec with the links a device follows: a task's round to its base, upload, refusal, metrics and result;
    an upload's round to its result and metrics; any reply to the status and the next task."""
    paths = spec["paths"]
    op = {path: next(iter(ops.values()))["operationId"] for path, ops in paths.items()}
    round_of = {"round_id": "$response.body#/round"}

    def link(source: str, target: str, parameters: dict[str, str] | None = None) -> None:
        reply = next(iter(paths[source].values()))["responses"].setdefault("200", {"description": "OK"})
        reply.setdefault("links", {})[f"To_{op[target]}"] = {"operationId": op[target], "parameters": parameters or {}}

    for name in ("base", "result", "update", "refusal", "metrics"):
        link("/v1/task", ROUND + name, round_of)
    for name in ("result", "metrics"):
        link(ROUND + "update", ROUND + name, round_of)
    link(ROUND + "update", "/v1/status")
    link("/v1/status", "/v1/task")
    link(ROUND + "base", "/v1/task")
    return spec


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    root = tmp_path_factory.mktemp("links")
    make_bundle(root / "bundle")
    tokens = enroll(root / "state", *DEVICES)
    options = ("--min-clients", "2", "--rounds", "1000", "--round-timeout", "3600", "--no-web")
    with LiveServer(root / "bundle", root / "state", *options) as server:
        yield server.url, tokens


@pytest.mark.slow
def test_schemathesis_sequences_over_the_links(live) -> None:
    url, tokens = live
    for device in DEVICES:  # every device polls once, so round 1 opens and the links reach past 404
        httpx.get(f"{url}/v1/task", headers={"Authorization": f"Bearer {tokens[device]}"})
    spec = with_links(httpx.get(f"{url}/openapi.json").json())
    schema = schemathesis.openapi.from_dict(spec)
    schema.config.update(base_url=url)
    seen: dict[str, int] = {"requests": 0}
    by_token = {token: device for device, token in tokens.items()}

    class Fleet(schema.as_state_machine()):  # type: ignore[misc]
        def get_call_kwargs(self, case: Any) -> dict[str, Any]:
            device = DEVICES[zlib.crc32(repr(case.path_parameters).encode()) % len(DEVICES)]
            case.headers = {**(case.headers or {}), "Authorization": f"Bearer {tokens[device]}"}
            return {}

        def validate_response(self, response: Any, case: Any, **kwargs: Any) -> None:  # noqa: ARG002
            seen["requests"] += 1
            reached = f"{case.method} {case.path.removeprefix('/v1/rounds/{round_id}')} {response.status_code}"
            seen[reached] = seen.get(reached, 0) + 1
            assert response.status_code < 500, f"{case.method} {case.formatted_path}: {response.status_code}"
            kind = response.headers.get("content-type", [""])
            kind = kind[0] if isinstance(kind, list) else kind
            if kind.startswith("application/json"):
                text = response.text
                if response.status_code >= 400:
                    assert set(response.json()) == {"error", "detail", "fix"}, text
                device = by_token.get((case.headers or {}).get("Authorization", "").removeprefix("Bearer "))
                others = [d for d in DEVICES if d != device and d in text]
                assert not others, f"{case.path} told {device} about {others}"

    with reported("schemathesis links (live serve)", {"examples": examples(CASES), "steps": STEPS}) as counts:
        seeded(Fleet).run(settings=fuzz_settings(CASES, STEPS, shrink=False))
        counts.update(sorted(seen.items()))
    assert seen["requests"] > CASES
