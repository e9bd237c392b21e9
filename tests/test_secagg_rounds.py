"""Secure rounds in the round engine (issue 34), in-process with a fake clock: the exact sum, the plain path's base
within the quantization step, dropouts at every step, what the server stores, malformed messages, restarts, DP,
and the options' refusals."""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest
from server_helpers import enroll, upload_body

from edgepfl.errors import UsageError
from edgepfl.kinds import ImageKind, InputSpec
from edgepfl.manifest import Manifest, TensorSpec
from edgepfl.options import validated
from edgepfl.privacy import clip_delta, delta_norm, noised_mean
from edgepfl.secagg import ClientSession, KeyBook, ServerSession, dequantize_sum, from_json, quantize_delta, to_json
from edgepfl.secagg.config import CLIP_MARGIN, levels, padded_size
from edgepfl.secagg.options import UNBOUNDED_CLIP
from edgepfl.secagg.ring import pack, unpack
from edgepfl.server.config import ServerConfig
from edgepfl.server.engine import RoundEngine, create_engine
from edgepfl.server.errors import Refused
from edgepfl.server.page import render_page
from edgepfl.server.secure.steps import steps_of
from edgepfl.server.secure.store import SecureStore
from edgepfl.server.uploads import add_delta
from edgepfl.wire import decode_tensors, save_tensors

CLIP, MAX_WEIGHT, TIMEOUT = 1.0, 50, 100.0
NAMES = [f"d{i}" for i in range(5)]


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def bundle(folder: Path, width: int = 8) -> Manifest:
    """A two-block model: a (width x 16) base and a small personal head (kp=1)."""
    tensors = (
        TensorSpec("stem.weight", (width, 16), "float32", "base", 0),
        TensorSpec("stem.bias", (width,), "float32", "base", 0),
        TensorSpec("head.weight", (2, width), "float32", "personal", 1),
    )
    manifest = Manifest(
        model={"name": "tiny"},
        kind=ImageKind(input=InputSpec(shape=(16,))),
        num_classes=2,
        kp=1,
        blocks=("stem", "head"),
        tensors=tensors,
    )
    manifest.save(folder)
    rng = np.random.default_rng(0)
    save_tensors(
        folder / "portable" / "initial.safetensors",
        {t.name: rng.normal(0, 0.1, t.shape).astype(np.float32) for t in tensors},
    )
    return manifest


def secure_config(tmp_path: Path, width: int = 8, **changes) -> ServerConfig:
    bundle(tmp_path / "bundle", width)
    secure = {
        "secure_aggregation": True,
        "secagg_clip": CLIP,
        "secagg_max_weight": MAX_WEIGHT,
        "secagg_step_timeout": 10.0,
        **changes.pop("secure", {}),
    }
    values = dict(
        bundle=tmp_path / "bundle",
        state=tmp_path / "state",
        min_clients=3,
        round_timeout=TIMEOUT,
        secure=secure,
        **changes,
    )
    config = ServerConfig(**values)
    enroll(config.state, *NAMES)
    return config


class Devices:
    """The devices of one secure round, speaking to the engine's calls; each quantizes a seeded delta."""

    def __init__(self, engine: RoundEngine, clock: Clock, scale: float = 0.1):
        self.engine, self.clock = engine, clock
        for name in NAMES:
            engine.task(name)
        clock.now += engine.config.poll_interval
        tasks = {name: engine.task(name) for name in NAMES}
        self.round_id = tasks[NAMES[0]].round_id
        assert all(task.action == "train" and task.secure_aggregation is not None for task in tasks.values())
        self.base = decode_tensors(engine.base_for(NAMES[0], self.round_id)[0])
        self.sessions = {
            n: ClientSession.start(tasks[n].secure_aggregation.device, tasks[n].secure_aggregation.context)
            for n in NAMES
        }
        rng = np.random.default_rng(1)
        self.deltas = {
            n: {k: (rng.normal(0, scale, v.shape)).astype(np.float32) for k, v in self.base.items()} for n in NAMES
        }
        self.weights = {n: 20 + 7 * i for i, n in enumerate(NAMES)}
        self.vectors: dict[str, np.ndarray] = {}

    def send(self, name: str, kind: str, body: bytes) -> dict:
        return steps_of(self.engine).message(name, self.round_id, kind, body)

    def advertise(self, names: Iterable[str] = NAMES) -> None:
        for name in names:
            assert self.send(name, "advert", to_json(self.sessions[name].advert()).encode())["duplicate"] is False
        self.engine.tick()

    def share(self, names: Iterable[str]) -> None:
        for name in names:
            book = from_json(to_json(steps_of(self.engine).book(name, self.round_id)), KeyBook)
            self.send(name, "shares", to_json(self.sessions[name].receive_book(book)).encode())
        self.engine.tick()

    def vector(self, name: str) -> np.ndarray:
        """The device's ring vector: the body it keeps is its delta clipped to the round's clip (round.py)."""
        book = self.sessions[name].book
        kept = clip_delta(self.deltas[name], book.config.clip_norm)
        return quantize_delta(kept, self.weights[name], book, np.random.default_rng(2))

    def upload(self, names: Iterable[str]) -> None:
        for name in names:
            inbox = steps_of(self.engine).inbox(name, self.round_id)
            self.vectors[name] = self.vector(name)
            self.send(name, "masked", self.sessions[name].receive_inbox(inbox, self.vectors[name]).to_bytes())
        self.engine.tick()

    def reveal(self, names: Iterable[str]) -> None:
        for name in names:
            request = steps_of(self.engine).request(name, self.round_id)
            self.send(name, "reveal", to_json(self.sessions[name].receive_unmask(request)).encode())
        self.engine.tick()

    def late(self) -> None:
        """The step's time runs out: the engine closes it without the devices that did not answer."""
        self.clock.now += self.engine.config.secure.secagg_step_timeout + 1
        self.engine.tick()

    def expected_base(self, survivors: Iterable[str]) -> dict[str, np.ndarray]:
        """The base plus the weighted mean of exactly what the survivors quantized."""
        book = self.sessions[NAMES[0]].book
        total = sum(self.vectors[name].astype(np.int64) for name in survivors) % (1 << book.plan.bits)
        from edgepfl.secagg import VectorLayout

        layout = VectorLayout.of({name: value.shape for name, value in self.base.items()})
        mean = dequantize_sum(total.astype(np.uint32), layout, book).weighted_mean()
        return add_delta(self.base, mean, [spec for spec in self.engine.specs])


def run_round(engine, clock, drop: dict[str, Iterable[str]] | None = None) -> Devices:
    """One secure round; `drop` names the devices that vanish after each step (advert, shares, masked)."""
    drop = {step: set(names) for step, names in (drop or {}).items()}
    devices = Devices(engine, clock)
    devices.advertise()
    out: set[str] = set()
    for step, take in (("advert", devices.share), ("shares", devices.upload), ("masked", devices.reveal)):
        if engine.store.round(devices.round_id).state != "open":
            break
        out |= drop.get(step, set())
        take([n for n in NAMES if n not in out])
        if drop.get(step):
            devices.late()
    return devices


def test_the_secure_sum_is_the_plain_sum_exactly_and_the_base_the_plain_paths_within_the_step(tmp_path, monkeypatch):
    unmasked = []
    finish = ServerSession.finish
    monkeypatch.setattr(ServerSession, "finish", lambda session: unmasked.append(finish(session)) or unmasked[-1])
    clock = Clock()
    engine = create_engine(secure_config(tmp_path), clock)
    devices = run_round(engine, clock)
    record = engine.store.round(devices.round_id)
    assert record.state == "closed"
    book = devices.sessions[NAMES[0]].book
    plain_sum = sum(devices.vectors[name].astype(np.int64) for name in NAMES) % (1 << book.plan.bits)
    np.testing.assert_array_equal(unmasked[-1], plain_sum)  # exact integers
    expected = devices.expected_base(NAMES)
    got = engine.global_base()
    for name in expected:  # the global base is what the exact sum decodes to
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    # the plain path (fp32 uploads of the same clipped deltas, weighted by the same sample counts, no bounds)
    plain_config = ServerConfig(
        bundle=tmp_path / "bundle",
        state=tmp_path / "plain",
        min_clients=3,
        round_timeout=TIMEOUT,
        clip_multiple=0,
        weight_multiple=0,
    )
    enroll(plain_config.state, *NAMES)
    plain = create_engine(plain_config, Clock())
    for name in NAMES:
        plain.task(name)
    plain.clock.now += plain.config.poll_interval
    for name in NAMES:
        assert plain.task(name).action == "train"
        clipped = clip_delta(devices.deltas[name], CLIP)
        update = {k: devices.base[k] + clipped[k] for k in devices.base}
        plain.accept_update(name, 1, upload_body(update, engine.manifest, num_samples=devices.weights[name]))
    plain.tick()
    plain_base = plain.global_base()
    size = padded_size(sum(v.size for v in devices.base.values()))
    step = 4 * CLIP / math.sqrt(size) / levels(book.plan.devices, book.plan.bits)
    bound = len(NAMES) * step * math.sqrt(size) * MAX_WEIGHT / sum(devices.weights.values())
    error = math.sqrt(sum(float(np.sum((got[n].astype(np.float64) - plain_base[n]) ** 2)) for n in got))
    moved = math.sqrt(sum(float(np.sum((plain_base[n].astype(np.float64) - devices.base[n]) ** 2)) for n in got))
    assert error <= bound < moved, (error, bound, moved)
    summary = engine.status()["rounds"][0]["secure_aggregation"]
    assert (summary["phase"], summary["masked"], summary["dropped"], summary["recovered"]) == ("done", 5, 0, 0)
    assert engine.status()["rounds"][0]["uploads"] == 0
    page = render_page(engine.status())  # the status page says so too
    assert "secure aggregation: <b>the server sees only each round's sum</b>" in page and "<td>5 / 0 / 0</td>" in page


@pytest.mark.parametrize(
    ("step", "recovered"),
    [("advert", 0), ("shares", 2), ("masked", 0)],
    ids=["after-keys", "after-shares", "after-masked"],
)
def test_up_to_n_minus_t_devices_dropping_after_a_step_leave_the_survivors_sum(tmp_path, step, recovered):
    clock = Clock()
    engine = create_engine(secure_config(tmp_path), clock)
    dropped = ["d1", "d3"]  # n = 5, t = 3 (classic at this n): n - t = 2 may drop
    devices = run_round(engine, clock, {step: dropped})
    assert engine.store.round(devices.round_id).state == "closed"
    survivors = NAMES if step == "masked" else [n for n in NAMES if n not in dropped]
    expected, got = devices.expected_base(survivors), engine.global_base()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    summary = engine.status()["rounds"][0]["secure_aggregation"]
    assert (summary["masked"], summary["dropped"], summary["recovered"]) == (
        len(survivors),
        5 - len(survivors),
        recovered,
    )


def test_the_status_of_an_open_secure_round_names_who_its_step_waits_for(tmp_path):
    clock = Clock()
    engine = create_engine(secure_config(tmp_path), clock)
    devices = Devices(engine, clock)

    def waiting() -> tuple[str, list[str]]:
        open_round = engine.status(names=True)["open_round"]
        return open_round["secure_step"], open_round["missing"]

    assert waiting() == ("keys", sorted(NAMES))
    devices.advertise(NAMES[:3])  # the keys step waits for every device given the round, up to its deadline
    assert waiting() == ("keys", sorted(NAMES[3:]))
    devices.advertise(NAMES[3:])
    assert waiting() == ("shares", sorted(NAMES))
    devices.share(NAMES[1:])
    assert waiting() == ("shares", [NAMES[0]])
    page = render_page(engine.status(names=True))
    assert f"secure aggregation, passing on the devices' encrypted shares · waiting for {NAMES[0]}" in page
    assert "passing on the devices' encrypted shares · waiting for 1 device ·" in render_page(engine.status())
    devices.share(NAMES[:1])
    devices.upload(NAMES[:4])
    assert waiting() == ("inputs", [NAMES[4]])
    devices.upload(NAMES[4:])
    devices.reveal(NAMES[:2])
    assert waiting() == ("unmask", sorted(NAMES[2:]))
    devices.reveal(NAMES[2:])
    assert engine.store.round(devices.round_id).state == "closed"


@pytest.mark.parametrize("step", ["advert", "shares", "masked"])
def test_more_than_n_minus_t_dropping_fail_the_round_in_one_line_and_the_next_starts(tmp_path, step):
    clock = Clock()
    engine = create_engine(secure_config(tmp_path), clock)
    devices = run_round(engine, clock, {step: ["d0", "d2", "d4"]})
    record = engine.store.round(devices.round_id)
    assert record.state == "abandoned" and record.note.startswith("secure aggregation failed: ")
    assert "\n" not in record.note and "threshold" in record.note
    np.testing.assert_array_equal(engine.global_base()["stem.weight"], devices.base["stem.weight"])
    with pytest.raises(Refused) as gone:  # the round is over for its devices
        steps_of(engine).request("d1", devices.round_id)
    assert gone.value.error == "round_closed"
    following = Devices(engine, clock)  # the next round opens and runs
    assert following.round_id == devices.round_id + 1
    following.advertise()
    following.share(NAMES)
    following.upload(NAMES)
    following.reveal(NAMES)
    assert engine.store.round(following.round_id).state == "closed"


def test_the_server_stores_no_quantized_update_and_a_masked_upload_looks_uniform(tmp_path):
    clock = Clock()
    engine = create_engine(secure_config(tmp_path, width=256), clock)  # 4,352 values
    devices = Devices(engine, clock)
    devices.advertise()
    devices.share(NAMES)
    devices.upload(NAMES[:3])  # two masked uploads are in the log, not yet in a snapshot
    logged = SecureStore(engine.store).messages(devices.round_id)
    masked = [body for kind, body in logged if kind == "masked"]
    assert len(masked) == 3
    bits = devices.sessions[NAMES[0]].book.plan.bits
    values = unpack(masked[0][-len(pack(devices.vectors[NAMES[0]], bits)) :], len(devices.vectors[NAMES[0]]), bits)
    assert _uniform(values, bits) and not _uniform(devices.vectors[NAMES[0]], bits)
    _assert_nothing_stored(tmp_path / "state", devices)
    devices.upload(NAMES[3:])
    devices.reveal(NAMES)
    assert engine.store.round(devices.round_id).state == "closed"
    Devices(engine, clock)  # the next round opens: the ended round's snapshot and log go
    _assert_nothing_stored(tmp_path / "state", devices)
    assert SecureStore(engine.store).row(devices.round_id).snapshot is None


def _uniform(values: np.ndarray, bits: int) -> bool:
    """A chi-square test (64 bins) that the values are uniform in [0, 2^bits), at the 0.1 % level."""
    counts = np.bincount((values.astype(np.int64) * 64) >> bits, minlength=64)
    expected = len(values) / 64
    statistic = float(np.sum((counts - expected) ** 2 / expected))
    return statistic < 103.4  # chi-square, 63 degrees of freedom, p = 0.001


def _assert_nothing_stored(state: Path, devices: Devices) -> None:
    """No window of any device's quantized vector (packed or as base64) or of its delta is in the state folder."""
    stored = b"".join(path.read_bytes() for path in sorted(state.rglob("*")) if path.is_file())
    bits = devices.sessions[NAMES[0]].book.plan.bits
    for name, vector in devices.vectors.items():
        packed = pack(vector, bits)
        floats = b"".join(devices.deltas[name][k].tobytes() for k in sorted(devices.deltas[name]))
        windows = [packed[i : i + 24] for i in range(0, len(packed) - 24, len(packed) // 7)]
        windows += [floats[i : i + 24] for i in range(0, len(floats) - 24, len(floats) // 7)]
        windows.append(base64.b64encode(packed[:48]))
        assert not any(window in stored for window in windows), name


def test_malformed_messages_are_refused_and_nothing_is_lost(tmp_path):
    clock = Clock()
    engine = create_engine(secure_config(tmp_path), clock)
    devices = Devices(engine, clock)
    devices.advertise()
    d0 = devices.sessions["d0"].device  # its id in the protocol: a keyed hash of "d0"
    assert d0 != "d0" and d0 == steps_of(engine).task("d0", devices.round_id).device
    reveal = {"type": "UnmaskShares", "device": d0, "seed_shares": {}, "key_shares": {}}
    with pytest.raises(Refused) as early:  # a reveal at the shares step: wait
        devices.send("d0", "reveal", json.dumps(reveal).encode())
    assert early.value.error == "too_early"
    book = from_json(to_json(steps_of(engine).book("d0", devices.round_id)), KeyBook)
    bundle = json.loads(to_json(devices.sessions["d0"].receive_book(book)))
    cut = dict(bundle, sealed={peer: sealed[:-8] for peer, sealed in bundle["sealed"].items()})
    for body, error in [
        (json.dumps(cut).encode(), "bad_secagg"),  # shares of the wrong length
        (b"{not json", "bad_secagg"),
        (json.dumps(dict(bundle, device=devices.sessions["d1"].device)).encode(), "wrong_device"),  # another's
        (json.dumps(dict(bundle, device="d0")).encode(), "wrong_device"),  # its enrolled name is not its id
    ]:
        with pytest.raises(Refused) as refused:
            devices.send("d0", "shares", body)
        assert refused.value.error == error and "\n" not in refused.value.problem
    with pytest.raises(Refused) as plain:
        engine.check_upload_allowed("d0", devices.round_id)  # a plain upload: refused before its body is read
    assert plain.value.error == "secure_round"
    devices.share(NAMES)
    assert devices.send("d0", "shares", json.dumps(bundle).encode())["duplicate"] is True  # a re-sent message
    inbox = steps_of(engine).inbox("d2", devices.round_id)
    good = devices.sessions["d2"].receive_inbox(inbox, devices.vector("d2")).to_bytes()
    with pytest.raises(Refused) as short:  # a masked vector of the wrong length
        devices.send("d2", "masked", good[:-3])
    assert short.value.error == "bad_secagg" and devices.sessions["d2"].device in short.value.problem
    devices.upload(NAMES)
    devices.reveal(NAMES)
    assert engine.store.round(devices.round_id).state == "closed"
    expected, got = devices.expected_base(NAMES), engine.global_base()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def test_a_restarted_server_replays_its_log_and_counts_a_resent_upload_once(tmp_path):
    clock = Clock()
    config = secure_config(tmp_path)
    engine = create_engine(config, clock)
    devices = Devices(engine, clock)
    devices.advertise()
    devices.share(NAMES)
    devices.upload(NAMES[:3])
    engine.close()  # the process dies: what is committed is all that is left
    engine = devices.engine = create_engine(config, clock)
    name = NAMES[0]
    inbox = steps_of(engine).inbox(name, devices.round_id)
    again = devices.sessions[name].receive_inbox(inbox, devices.vectors[name]).to_bytes()
    assert devices.send(name, "masked", again)["duplicate"] is True
    devices.upload(NAMES[3:])
    devices.reveal(NAMES)
    assert engine.store.round(devices.round_id).state == "closed"
    expected, got = devices.expected_base(NAMES), engine.global_base()
    for tensor in expected:
        np.testing.assert_array_equal(got[tensor], expected[tensor], err_msg=tensor)


def test_a_round_open_when_secure_aggregation_is_switched_off_is_abandoned(tmp_path):
    clock = Clock()
    config = secure_config(tmp_path)
    engine = create_engine(config, clock)
    devices = Devices(engine, clock)
    engine.close()
    plain = create_engine(
        config.model_copy(
            update={"secure": config.secure.model_copy(update={"secure_aggregation": False, "secagg_clip": None})}
        ),
        clock,
    )
    record = plain.store.round(devices.round_id)
    assert record.state == "abandoned" and "--secure-aggregation" in record.note


def test_central_dp_noises_the_unmasked_sum(tmp_path):
    pytest.importorskip("dp_accounting")
    clock = Clock()
    config = secure_config(
        tmp_path,
        secure={"secagg_clip": None, "secagg_max_weight": None},
        privacy={"dp_noise_multiplier": 0.5, "dp_clip": CLIP},
    )
    engine = create_engine(config, clock)
    engine.noise_seed = 7
    assert steps_of(engine).rounds.config.max_weight == 1  # under DP every device weighs the same
    devices = run_round(engine, clock)
    record = engine.store.round(devices.round_id)
    assert record.state == "closed" and record.epsilon is not None and record.epsilon > 0
    book = devices.sessions[NAMES[0]].book
    total = sum(devices.vectors[name].astype(np.int64) for name in NAMES) % (1 << book.plan.bits)
    from edgepfl.secagg import VectorLayout

    layout = VectorLayout.of({name: value.shape for name, value in devices.base.items()})
    summed = dequantize_sum(total.astype(np.uint32), layout, book)
    assert summed.total_weight == len(NAMES)
    sensitivity = CLIP * (1 + 4.0 / levels(book.plan.devices, book.plan.bits))
    noised = noised_mean(
        summed.scaled_sum, 0.5 * sensitivity, len(record.sampled), np.random.default_rng([7, devices.round_id])
    )
    expected, got = add_delta(devices.base, noised, list(engine.specs)), engine.global_base()
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"strategy": "median"}, "secure aggregation cannot run with --strategy median: the median needs"),
        ({"strategy": "pfedla"}, "secure aggregation cannot run with --strategy pfedla"),
        ({"aggregation": "fedbuff"}, "cannot run with --aggregation fedbuff"),
        ({"upload_encoding": "int8"}, "--upload-encoding int8 does not apply to secure aggregation"),
        ({"min_clients": 2}, "needs at least 3 devices a round"),
        (
            {"secagg_clip": None, "dp_noise_multiplier": 1.0, "dp_clip": 1.0, "secagg_max_weight": 100},
            "--secagg-max-weight does not apply with DP",
        ),
        ({"secure_aggregation": False}, "--secagg-clip needs secure aggregation on"),
        ({"dp_noise_multiplier": 1.0, "dp_clip": 1.0}, "--secagg-clip and --dp-clip both set"),
        ({"secagg_neighbours": "3"}, "--secagg-neighbours '3': not auto, all or an even number"),
        ({"secagg_bits": 40}, "--secagg-bits"),
    ],
)
def test_what_secure_aggregation_cannot_run_with_is_one_line(tmp_path, changes, message):
    values = {
        "bundle": tmp_path,
        "state": tmp_path / "state",
        "min_clients": 3,
        "secure_aggregation": True,
        "secagg_clip": 1.0,
        **changes,
    }
    with pytest.raises(UsageError) as refused:
        validated(ServerConfig, {key: value for key, value in values.items() if value is not None})
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_with_no_clip_flag_the_next_round_clips_at_what_this_round_measured(tmp_path):
    # issue 42: 4 times the norm of the round's mean delta, weighted by its mean sample count; the page says so
    clock = Clock()
    engine = create_engine(secure_config(tmp_path, secure={"secagg_clip": None, "secagg_max_weight": None}), clock)
    assert engine.config.settings.clip_norm == UNBOUNDED_CLIP  # the device keeps its whole delta
    devices = run_round(engine, clock)
    assert engine.store.round(devices.round_id).state == "closed"
    global_base = engine.global_base()
    mean = {name: global_base[name].astype(np.float64) - devices.base[name] for name in devices.base}
    upcoming = steps_of(engine).rounds.round_config()
    assert upcoming.clip_norm == pytest.approx(CLIP_MARGIN * delta_norm(mean), rel=1e-4)
    assert upcoming.weight_scale == sum(devices.weights.values()) / len(NAMES)
    status = engine.status()["secure_aggregation"]
    assert status["clip_norm"] == upcoming.clip_norm and status["measured"] == ["clip", "weight"]
    assert "measured" in render_page(engine.status())
