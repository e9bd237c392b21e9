"""Hostile sequences against a real `edgepfl serve` over HTTP (issue 55): a Hypothesis state machine of enrolled
devices that poll, fetch, upload honestly, upload twice or in parallel, claim a future or a closed round, come
with a forged token and poll a hundred times in a burst, in sync, over-selection and FedBuff modes.

After every step: a refused request changes nothing stored (every round's uploads, bytes, base and state, as the
operator's /v1/status shows them); an accepted upload is counted exactly once; a closed round's result is the
sample-weighted mean of the uploads it names (sync modes; FedBuff's steps are checked by their counts); no
response to a device names another device; no reply is a 5xx.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter

import httpx
import numpy as np
import pytest
from fuzz_budget import examples, fuzz_settings, reported, seeded
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test
from server_helpers import LiveServer, enroll, make_bundle, upload_body, weighted_mean

from edgepfl.wire import decode_tensors

CASES = 4  # sequences per mode in CI (each up to STEPS requests; one server per mode lives through all of them)
STEPS = 20
DEVICES = ("dev-amber", "dev-birch", "dev-cedar", "dev-dune")  # no name is part of another
MODES = {
    "sync": ("--min-clients", "2"),
    "over-selection": ("--min-clients", "2", "--over-select", "0.5"),
    "fedbuff": ("--min-clients", "2", "--aggregation", "fedbuff", "--buffer-size", "2", "--max-staleness", "1"),
}
TALLY: Counter[str] = Counter()
FAILURES: list[str] = []  # the first failure, kept: Hypothesis cannot replay a sequence against a server that moved on


def recorded(step):
    """A rule or invariant whose first exception is kept (with its line) before Hypothesis sees it."""

    @functools.wraps(step)
    def run(*args, **kwargs):
        try:
            return step(*args, **kwargs)
        except Exception as error:
            where = traceback.extract_tb(error.__traceback__)[-1]
            FAILURES.append(f"{step.__name__}: {type(error).__name__}: {error} ({where.filename}:{where.lineno})")
            raise

    return run


def check(condition: object, problem: str) -> None:
    """assert, remembering the problem for the test's own message."""
    if not condition:
        FAILURES.append(problem)
        raise AssertionError(problem)


@pytest.fixture(scope="module", params=sorted(MODES))
def served(request, tmp_path_factory):
    """A live server in one mode with four enrolled devices, and the operator's token."""
    root = tmp_path_factory.mktemp(f"serve-{request.param}")
    manifest = make_bundle(root / "bundle")
    tokens = enroll(root / "state", *DEVICES)
    operator = subprocess.run(
        [sys.executable, "-m", "edgepfl.cli", "serve", "tokens", "operator", "--state", str(root / "state")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()[-1]
    options = ("--rounds", "100000", "--round-timeout", "3600", "--poll-interval", "1", *MODES[request.param])
    options += ("--clip-multiple", "0", "--weight-multiple", "0")  # the plain weighted mean: no per-device bounds
    with LiveServer(root / "bundle", root / "state", *options, "--no-web") as server:
        yield request.param, server.url, tokens, operator, manifest


class ServedFleet(RuleBasedStateMachine):
    """Devices against the live server (module docstring); the server outlives each sequence."""

    mode: str
    url: str
    tokens: dict[str, str]
    operator: str
    manifest: object
    accepted: dict[tuple[int, str], tuple[bytes, int]]  # every upload the server took: (round, device) -> body
    checked: set[int]

    def __init__(self) -> None:
        super().__init__()
        cls = type(self)
        self.http = {
            d: httpx.Client(base_url=cls.url, headers={"Authorization": f"Bearer {t}"}, timeout=30)
            for d, t in cls.tokens.items()
        }
        self.tasks: dict[str, dict] = {}
        self.rng = np.random.default_rng(len(cls.accepted))

    def teardown(self) -> None:
        for client in self.http.values():
            client.close()

    # what the operator sees: the stored state

    def stored(self) -> dict[int, tuple]:
        """Every round's (state, uploads, upload bytes, base, result), once the tick has settled."""
        previous = None
        for _ in range(100):
            reply = httpx.get(f"{self.url}/v1/status", headers={"Authorization": f"Bearer {self.operator}"})
            check(reply.status_code == 200, reply.text)
            rows = reply.json()["rounds"]
            now = {
                r["round"]: (r["state"], r["uploads"], r["upload_bytes"], r["base_sha256"], r["result_sha256"])
                for r in rows
            }
            if now == previous:
                return now
            previous = now
            time.sleep(0.02)
        return previous

    def send(self, device: str, method: str, path: str, body: bytes | None = None) -> httpx.Response:
        """One request of a device: never a 5xx, a refusal is {error, detail, fix}, no other device named."""
        headers = {"Content-Type": "application/octet-stream"} if body is not None else {}
        reply = self.http[device].request(method, path, content=body, headers=headers)
        check(reply.status_code < 500, f"{method} {path}: {reply.status_code} {reply.text}")
        if reply.status_code >= 400 and reply.headers.get("content-type", "").startswith("application/json"):
            check(set(reply.json()) == {"error", "detail", "fix"}, reply.text)
        if reply.headers.get("content-type", "").startswith("application/json"):
            others = [d for d in DEVICES if d != device and d in reply.text]
            check(not others, f"{path} told {device} about {others}")
        TALLY[f"{method} {path.split('/')[-1]} {reply.status_code}"] += 1
        return reply

    def upload(self, device: str, round_id: int, body: bytes) -> httpx.Response:
        """An upload; accepted, it must be new to the server exactly when the test has not seen it taken."""
        reply = self.send(device, "POST", f"/v1/rounds/{round_id}/update", body)
        if reply.status_code == 200:
            receipt = reply.json()
            key = (round_id, device)
            check(receipt["duplicate"] == (key in self.accepted), f"upload {key} counted twice or lost: {receipt}")
            if key in self.accepted:
                check(self.accepted[key][0] == body, "a different body was taken as a duplicate")
            self.accepted[key] = (body, int(decode_meta_samples(body)))
        return reply

    def body(self, device: str, round_id: int, samples: int) -> bytes | None:
        reply = self.send(device, "GET", f"/v1/rounds/{round_id}/base")
        if reply.status_code != 200:
            return None
        base = decode_tensors(reply.content)
        moved = {
            name: value + self.rng.normal(0, 0.01, value.shape).astype(value.dtype) for name, value in base.items()
        }
        return upload_body(moved, self.manifest, num_samples=samples)

    # honest devices

    @rule(device=st.sampled_from(DEVICES))
    @recorded
    def poll(self, device: str) -> None:
        reply = self.send(device, "GET", "/v1/task")
        assert reply.status_code == 200
        self.tasks[device] = reply.json()

    @initialize()
    @recorded
    def everyone_polls(self) -> None:
        """Every sequence starts with each device asking for a task (a round opens at its quorum)."""
        for device in DEVICES:
            self.poll(device)

    @rule(device=st.sampled_from(DEVICES), samples=st.integers(5, 20))
    @recorded
    def train_and_upload(self, device: str, samples: int) -> None:
        """The device trains on the task it holds (an older one: maybe stale), or polls for one first."""
        if device not in self.tasks:
            self.poll(device)
        task = self.tasks.pop(device, None)
        if not task or task.get("action") != "train":
            return
        body = self.body(device, task["round"], samples)
        if body is not None:
            self.upload(device, task["round"], body)

    # hostile sequences: each refused, and nothing stored changes

    @rule(device=st.sampled_from(DEVICES), how=st.sampled_from(["again", "other bytes", "future", "closed", "zero"]))
    @recorded
    def hostile_upload(self, device: str, how: str) -> None:
        """The same task twice (the same bytes: a duplicate; other bytes: refused), a round that does not exist
        yet, a round that closed, round 0."""
        mine = sorted(key for key in self.accepted if key[1] == device)
        before = self.stored()
        last = max(before, default=0)
        if how in ("again", "other bytes") and mine:
            round_id = mine[-1][0]
            body, samples = self.accepted[mine[-1]]
            if how == "other bytes":  # another sample count than the taken one's (parallel_uploads' may be 21)
                body = upload_body(decode_tensors(body), self.manifest, num_samples=samples + 1)
        elif how == "future":
            round_id, body = last + 1 + int(self.rng.integers(0, 3)), upload_body({}, self.manifest)
        elif how == "closed":
            closed = [r for r, row in before.items() if row[0] != "open"]
            if not closed:
                return
            round_id = closed[0]
            body = self.body(device, round_id, 5) or upload_body({}, self.manifest)
        else:
            round_id, body = 0, upload_body({}, self.manifest)
        reply = self.upload(device, round_id, body)
        if how != "again":
            check(reply.status_code >= 400, f"a hostile upload ({how}) was taken: {reply.text}")
            check(unchanged(before, self.stored()), f"a refused upload ({how}) changed what is stored")

    @rule(device=st.sampled_from(DEVICES), samples=st.integers(5, 20))
    @recorded
    def parallel_uploads(self, device: str, samples: int) -> None:
        """Two different uploads of one device's task at once: at most one is taken."""
        task = self.tasks.pop(device, None)
        if not task or task.get("action") != "train":
            return
        first = self.body(device, task["round"], samples)
        if first is None:
            return
        second = upload_body(decode_tensors(first), self.manifest, num_samples=samples + 1)
        replies: list[tuple[bytes, httpx.Response]] = []
        threads = [
            threading.Thread(target=lambda b=b: replies.append((b, self._raw_upload(device, task["round"], b))))
            for b in (first, second)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        taken = [body for body, r in replies if r.status_code == 200 and not r.json()["duplicate"]]
        check(len(taken) <= 1, "two different uploads of one task were both taken")
        if taken:
            self.accepted[(task["round"], device)] = (taken[0], int(decode_meta_samples(taken[0])))
        TALLY["parallel uploads, one taken" if taken else "parallel uploads, none taken"] += 1

    def _raw_upload(self, device: str, round_id: int, body: bytes) -> httpx.Response:
        reply = self.http[device].post(
            f"/v1/rounds/{round_id}/update", content=body, headers={"Content-Type": "application/octet-stream"}
        )
        check(reply.status_code < 500, reply.text)
        return reply

    @rule(device=st.sampled_from(DEVICES))
    @recorded
    def poll_storm(self, device: str) -> None:
        """A device polling a hundred times as fast as it can: every reply a task or a 429, nothing stored moves
        beyond what its polls may open."""
        before = self.stored()
        for _ in range(100):
            reply = self.send(device, "GET", "/v1/task")
            check(reply.status_code in (200, 429), reply.text)
        after = self.stored()
        check(unchanged(before, after), "a poll storm changed stored uploads")

    @rule()
    @recorded
    def forged_token(self) -> None:
        before = self.stored()
        reply = httpx.post(
            f"{self.url}/v1/rounds/1/update",
            content=upload_body({}, self.manifest),
            headers={"Authorization": "Bearer forged-or-removed", "Content-Type": "application/octet-stream"},
        )
        check(reply.status_code == 401, reply.text)
        check(unchanged(before, self.stored()), "a forged token's upload changed what is stored")

    # what holds after every step

    @invariant()
    @recorded
    def counted_once_and_means_exact(self) -> None:
        stored = self.stored()
        mine = Counter(round_id for round_id, _ in self.accepted)
        for round_id, (state, uploads, *_rest) in stored.items():
            assert uploads == mine[round_id], (
                f"round {round_id} holds {uploads} uploads, the devices had {mine[round_id]} taken"
            )
            if state == "closed" and round_id not in self.checked and self.mode != "fedbuff":
                self._check_mean(round_id)
                self.checked.add(round_id)

    def _check_mean(self, round_id: int) -> None:
        reply = self.send(DEVICES[0], "GET", f"/v1/rounds/{round_id}/result")
        check(reply.status_code == 200, reply.text)
        result = decode_tensors(reply.content)
        named = [(decode_tensors(body), samples) for (r, _), (body, samples) in self.accepted.items() if r == round_id]
        expected = weighted_mean(named)
        for name, value in expected.items():
            np.testing.assert_allclose(result[name], value, rtol=1e-5, atol=1e-6, err_msg=f"round {round_id} {name}")
        TALLY["rounds whose mean was checked"] += 1


def unchanged(before: dict[int, tuple], after: dict[int, tuple]) -> bool:
    """Whether every round stored before still holds the same uploads, bytes and base (the tick may open a round
    or close one that reached its target meanwhile: that is not the refused request's doing)."""
    return all(r in after and after[r][1:4] == row[1:4] for r, row in before.items())


def decode_meta_samples(body: bytes) -> int:
    """The num_samples an upload body declares."""
    import json

    size = int.from_bytes(body[:8], "little")
    return int(json.loads(body[8 : 8 + size])["__metadata__"]["num_samples"])


@pytest.mark.slow
def test_a_served_fleet_under_hostile_sequences(served) -> None:
    mode, url, tokens, operator, manifest = served
    fleet = type(f"ServedFleet_{mode}", (ServedFleet,), {})
    fleet.mode, fleet.url, fleet.tokens, fleet.operator, fleet.manifest = mode, url, tokens, operator, manifest
    fleet.accepted, fleet.checked = {}, set()
    TALLY.clear()
    FAILURES.clear()
    with reported(f"served fleet ({mode})", {"examples": examples(CASES), "steps": STEPS}) as counts:
        try:
            run_state_machine_as_test(seeded(fleet), settings=fuzz_settings(CASES, STEPS, shrink=False))
        except Exception:
            if FAILURES:
                raise AssertionError(f"first failure: {FAILURES[0]}") from None
            raise
        counts.update(sorted(TALLY.items()))
    assert fleet.accepted, f"no upload was ever taken: {TALLY}"
