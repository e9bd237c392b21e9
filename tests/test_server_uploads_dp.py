"""Compressed delta uploads and DP-FedAvg through the round engine: decoding, refusals, noise, the privacy budget."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from server_helpers import enroll, make_bundle, upload_body

from edgepfl.encoding import Encoding, EncodingMismatch, decode_download, encode_delta
from edgepfl.errors import StateError, UsageError
from edgepfl.privacy import PrivacyOptions, clip_delta, delta_norm
from edgepfl.protocol import RoundOptions, UploadMeta
from edgepfl.server import budget as budget_module
from edgepfl.server.config import ServerConfig
from edgepfl.server.engine import RoundEngine, create_engine
from edgepfl.server.errors import Refused
from edgepfl.server.http_errors import status_of
from edgepfl.server.page import render_page
from edgepfl.server.strategies import strategy_options
from edgepfl.wire import decode_metadata, decode_tensors

DEVICES = ("d0", "d1", "d2", "d3")


class Clock:
    """A settable clock."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def server_config(tmp_path: Path, privacy: PrivacyOptions | None = None, **changes) -> ServerConfig:
    """A served run over the tiny bundle with these round options (upload_encoding=...) and DP settings."""
    round_fields = {k: changes.pop(k) for k in list(changes) if k in RoundOptions.model_fields}
    strategy = strategy_options(changes.pop("strategy", "fedper"))
    fields = dict(min_clients=2, round_timeout=100, rounds=5, web=False, clip_multiple=0, weight_multiple=0)
    return ServerConfig(
        bundle=tmp_path / "bundle",
        state=tmp_path / "state",
        strategy=strategy,
        round=RoundOptions(**round_fields),
        privacy=privacy or PrivacyOptions(),
        **{**fields, **changes},
    )


@pytest.fixture
def manifest(tmp_path: Path):
    made = make_bundle(tmp_path / "bundle")
    enroll(tmp_path / "state", *DEVICES)
    return made


def open_round(engine: RoundEngine, clock: Clock, names=DEVICES) -> int:
    """The devices poll; one poll interval later the round opens (at once when every enrolled device polled)."""
    for name in names:
        engine.task(name)
    clock.now += engine.config.poll_interval
    for name in names:
        engine.task(name)
    record = engine.store.open_round()
    assert record is not None
    return record.round_id


def delta_body(delta: dict[str, np.ndarray], encoding: str, manifest, num_samples: int = 10) -> bytes:
    """A device's delta upload, encoded as `encoding`, with its UploadMeta."""
    meta = UploadMeta(manifest.base_layout_hash, num_samples, train_loss=0.5, val_accuracy=0.8)
    return encode_delta(delta, Encoding.parse(encoding), np.random.default_rng(0)).to_bytes(meta.to_metadata())


def base_of(engine: RoundEngine, device: str, round_id: int) -> dict[str, np.ndarray]:
    payload, _ = engine.base_for(device, round_id)
    return decode_download(payload, engine.settings_for(device, round_id).download_encoding)


def random_delta(base: dict[str, np.ndarray], scale: float, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.normal(0, scale, value.shape).astype(np.float32) for name, value in base.items()}


def test_int8_delta_uploads_are_decoded_checked_and_added_to_the_base(tmp_path, manifest) -> None:
    clock = Clock()
    engine = create_engine(server_config(tmp_path, upload_encoding="int8-block4"), clock)
    round_id = open_round(engine, clock, DEVICES[:2])
    assert engine.task("d0").settings.upload_encoding == "int8-block4"
    base = base_of(engine, "d0", round_id)
    deltas = {name: random_delta(base, 0.05, seed) for seed, name in enumerate(DEVICES[:2])}
    sizes = {}
    for name, delta in deltas.items():
        body = delta_body(delta, "int8-block4", manifest)
        sizes[name] = len(body)
        assert engine.accept_update(name, round_id, body)["accepted"]
    engine.tick()
    result = decode_tensors(engine.result_of(round_id)[0])
    for name, value in base.items():
        expected = value + (deltas["d0"][name] + deltas["d1"][name]) / 2
        peak = max(np.abs(deltas[d][name]).max() for d in deltas)
        np.testing.assert_allclose(result[name], expected, atol=peak / 127)  # int8: |error| <= scale/2 per value
    status = engine.status()
    assert status["upload_encoding"] == "int8-block4" and status["rounds"][0]["upload_bytes"] == sum(sizes.values())


@pytest.mark.parametrize(
    ("encoding", "body"),
    [
        ("fp16", "whole fp32 base, no encoding named"),
        ("int8", "fp16 delta"),
        ("int8-block4", "int8 per-tensor delta"),
        ("fp16", "int8 delta"),
    ],
)
def test_an_upload_in_another_encoding_is_refused_422_and_nothing_is_stored(tmp_path, manifest, encoding, body):
    clock = Clock()
    engine = create_engine(server_config(tmp_path, upload_encoding=encoding), clock)
    round_id = open_round(engine, clock, DEVICES[:2])
    base = base_of(engine, "d0", round_id)
    delta = random_delta(base, 0.01, 0)
    payload = {
        "whole fp32 base, no encoding named": lambda: upload_body(base, manifest),
        "fp16 delta": lambda: delta_body(delta, "fp16", manifest),
        "int8 per-tensor delta": lambda: delta_body(delta, "int8", manifest),
        "int8 delta": lambda: delta_body(delta, "int8", manifest),
    }[body]()
    with pytest.raises(Refused) as refused:
        engine.accept_update("d0", round_id, payload)
    assert refused.value.error == "wrong_encoding" and status_of(refused.value) == 422
    assert encoding in refused.value.problem and "\n" not in str(refused.value)
    assert engine.store.update(round_id, "d0") is None


def test_a_decoded_delta_that_fails_the_checks_is_refused(tmp_path, manifest) -> None:
    clock = Clock()
    engine = create_engine(server_config(tmp_path, upload_encoding="int8"), clock)
    round_id = open_round(engine, clock, DEVICES[:2])
    base = base_of(engine, "d0", round_id)
    meta = UploadMeta(manifest.base_layout_hash, 10).to_metadata()
    encoded = encode_delta(random_delta(base, 0.01, 0), Encoding.parse("int8"))
    nan_scale = {**encoded.tensors, "stem.weight.__scale__": np.array([np.nan], np.float32)}
    missing = {k: v for k, v in encoded.tensors.items() if not k.startswith("mid.weight")}
    for tensors, words in ((nan_scale, "NaN"), (missing, "lacks")):
        payload = type(encoded)(tensors, encoded.metadata).to_bytes(meta)
        with pytest.raises(Refused) as refused:
            engine.accept_update("d0", round_id, payload)
        assert refused.value.error == "bad_tensors" and words in refused.value.problem
    assert engine.store.update(round_id, "d0") is None


def test_fp16_download_says_so_and_decodes_only_as_fp16(tmp_path, manifest) -> None:
    clock = Clock()
    engine = create_engine(server_config(tmp_path, download_encoding="fp16", upload_encoding="fp16"), clock)
    round_id = open_round(engine, clock, DEVICES[:2])
    payload, sha = engine.base_for("d0", round_id)
    assert decode_metadata(payload)["encoding"] == "fp16"
    assert all(value.dtype == np.float16 for value in decode_tensors(payload).values())
    stored = decode_tensors(engine.store.blobs.read(engine.store.round(round_id).base_sha))
    received = decode_download(payload, "fp16")
    for name, value in stored.items():
        assert received[name].dtype == np.float32
        np.testing.assert_allclose(received[name], value, rtol=2**-11, atol=2**-25)
    with pytest.raises(EncodingMismatch):
        decode_download(engine.store.blobs.read(engine.store.round(round_id).base_sha), "fp16")
    assert engine.base_for("d1", round_id) == (payload, sha)  # encoded once per base


def test_nonsensical_combinations_are_refused_in_one_line(tmp_path, manifest) -> None:
    dp = PrivacyOptions(dp_noise_multiplier=1.0, dp_clip=1.0)
    for strategy in ("median", "trimmed-mean", "pfedla", "heurpfedla"):
        with pytest.raises(UsageError) as refused:
            server_config(tmp_path, privacy=dp, strategy=strategy)
        assert f"--strategy {strategy}" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(UsageError, match="go together"):
        PrivacyOptions(dp_noise_multiplier=1.0)
    # the browser device speaks the encodings and the clip: the page is served with them
    assert server_config(tmp_path, upload_encoding="int8-sr", download_encoding="fp16", privacy=dp, web=True).web
    with pytest.raises(UsageError, match="heurpfedla changes which tensors travel"):
        server_config(tmp_path, upload_encoding="int8", strategy="heurpfedla")
    with pytest.raises(UsageError, match="share-bn-stats"):
        server_config(tmp_path, download_encoding="fp16", share_buffers=True)
    with pytest.raises(ValueError, match="unknown encoding"):
        RoundOptions(upload_encoding="int4")


# DP-FedAvg

SIGMA, CLIP = 0.8, 0.5


def dp_engine(tmp_path: Path, clock: Clock, **privacy) -> RoundEngine:
    options = PrivacyOptions(dp_noise_multiplier=SIGMA, dp_clip=CLIP, **privacy)
    return create_engine(server_config(tmp_path, privacy=options, fraction=0.5), clock)


def dp_round(engine: RoundEngine, clock: Clock, manifest, seed: int = 0) -> tuple[int, list[dict]]:
    """Open a round (2 of the 4 devices sampled), every sampled device uploads a clipped fp32 delta, close it."""
    clock.now += 1
    round_id = open_round(engine, clock)
    sampled = engine.store.round(round_id).sampled
    deltas = []
    for number, name in enumerate(sampled):
        assert engine.task(name).settings.clip_norm == CLIP
        delta = clip_delta(random_delta(base_of(engine, name, round_id), 1.0, seed + number), CLIP)
        engine.accept_update(name, round_id, delta_body(delta, "fp32", manifest))
        deltas.append(delta)
    engine.tick()
    assert engine.store.round(round_id).state == "closed"
    return round_id, deltas


def accountant_epsilon(rounds: int, population: int = 4, sampled: int = 2, delta: float = 1e-5) -> float:
    """dp-accounting's own answer for k rounds of fixed-size sampling m of N with the Gaussian mechanism."""
    import dp_accounting

    event = dp_accounting.SampledWithoutReplacementDpEvent(
        population,
        sampled,
        dp_accounting.GaussianDpEvent(SIGMA / 2),  # replace-one: sensitivity 2C, noise sigma*C
    )
    accountant = dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, rounds))
    return accountant.get_epsilon(delta)


def test_dp_refuses_a_delta_over_the_clip_norm(tmp_path, manifest) -> None:
    pytest.importorskip("dp_accounting")
    clock = Clock()
    engine = dp_engine(tmp_path, clock)
    round_id = open_round(engine, clock)
    name = engine.store.round(round_id).sampled[0]
    delta = random_delta(base_of(engine, name, round_id), 1.0, 0)
    assert delta_norm(delta) > CLIP
    with pytest.raises(Refused) as refused:
        engine.accept_update(name, round_id, delta_body(delta, "fp32", manifest))
    assert refused.value.error == "over_clip_norm" and status_of(refused.value) == 422
    assert "clip" in refused.value.fix and engine.store.update(round_id, name) is None
    with pytest.raises(Refused) as whole:  # a whole base is refused too: the round asked for a delta
        engine.accept_update(name, round_id, upload_body(base_of(engine, name, round_id), manifest))
    assert whole.value.error == "wrong_encoding"


def test_dp_aggregate_is_the_noised_unweighted_sum_over_the_sample_size(tmp_path, manifest, monkeypatch) -> None:
    pytest.importorskip("dp_accounting")
    aggregated = []
    honest = budget_module.dp_aggregate

    def recording(deltas, *args):
        def seen():
            for delta in deltas:
                aggregated.append(delta)
                yield delta

        return honest(seen(), *args)

    monkeypatch.setattr(budget_module, "dp_aggregate", recording)
    clock = Clock()
    engine = dp_engine(tmp_path, clock)
    engine.noise_seed = 11
    before = decode_tensors(engine.store.blobs.read(engine.store.get_meta("global_base_sha")))
    round_id, deltas = dp_round(engine, clock, manifest)
    assert len(aggregated) == 2 and all(delta_norm(delta) <= CLIP * (1 + 1e-6) for delta in aggregated)
    result = decode_tensors(engine.result_of(round_id)[0])
    noise = np.random.default_rng([11, round_id])
    for name in sorted(before):  # privacy.gaussian_noise_like draws in name order
        drawn = noise.normal(0.0, SIGMA * CLIP, size=before[name].shape)
        expected = before[name] + (deltas[0][name] + deltas[1][name] + drawn) / 2  # fixed denominator m = 2
        np.testing.assert_allclose(result[name], expected, rtol=1e-6, atol=1e-6)


def test_dp_noise_has_the_stated_standard_deviation(tmp_path, manifest) -> None:
    pytest.importorskip("dp_accounting")
    clock = Clock()
    engine = dp_engine(tmp_path, clock)
    engine.noise_seed = 3
    before = decode_tensors(engine.store.blobs.read(engine.store.get_meta("global_base_sha")))
    residuals = []
    for number in range(5):
        round_id, deltas = dp_round(engine, clock, manifest, seed=10 * number)
        result = decode_tensors(engine.result_of(round_id)[0])
        for name, value in before.items():
            noise_sum = 2 * (result[name].astype(np.float64) - value) - deltas[0][name] - deltas[1][name]
            residuals.append(noise_sum.ravel())
        before = result
    noise = np.concatenate(residuals)
    # 5 rounds x 32 values: the sample std of N(0, (sigma*C)^2) lies within 20% of sigma*C far beyond 3 sigma
    assert abs(noise.std() / (SIGMA * CLIP) - 1) < 0.2 and abs(noise.mean()) < 4 * SIGMA * CLIP / math.sqrt(noise.size)


def test_epsilon_matches_dp_accounting_and_survives_a_restart(tmp_path, manifest) -> None:
    pytest.importorskip("dp_accounting")
    clock = Clock()
    engine = dp_engine(tmp_path, clock)
    for rounds in (1, 2):
        round_id, _ = dp_round(engine, clock, manifest)
        assert engine.store.round(round_id).epsilon == pytest.approx(accountant_epsilon(rounds), rel=1e-9)
    status = engine.status()
    assert status["privacy"]["epsilon"] == pytest.approx(accountant_epsilon(2), rel=1e-9)
    closed = [row["epsilon"] for row in status["rounds"] if row["state"] == "closed"]
    assert closed == [engine.store.round(r).epsilon for r in (1, 2)]
    assert "ε = " in render_page(status)
    # a restart (the store is not closed: as after kill -9) continues the same budget
    again = dp_engine(tmp_path, clock)
    assert again.ledger.rounds == 2 and again.status()["privacy"]["epsilon"] == status["privacy"]["epsilon"]
    round_id, _ = dp_round(again, clock, manifest)
    assert round_id == 3 and again.store.round(3).epsilon == pytest.approx(accountant_epsilon(3), rel=1e-9)
    with pytest.raises(StateError, match="--dp-noise-multiplier 0.8"):
        create_engine(server_config(tmp_path, privacy=PrivacyOptions(dp_noise_multiplier=2.0, dp_clip=CLIP)), clock)
    with pytest.raises(StateError, match="--dp-clip 0.5"):
        create_engine(server_config(tmp_path, privacy=PrivacyOptions(dp_noise_multiplier=SIGMA, dp_clip=1.0)), clock)
    with pytest.raises(StateError, match="void its guarantee"):
        create_engine(server_config(tmp_path), clock)


def test_target_epsilon_stops_the_run_before_the_budget_is_exceeded(tmp_path, manifest) -> None:
    pytest.importorskip("dp_accounting")
    target = (accountant_epsilon(2) + accountant_epsilon(3)) / 2
    clock = Clock()
    engine = dp_engine(tmp_path, clock, dp_target_epsilon=target)
    dp_round(engine, clock, manifest)
    dp_round(engine, clock, manifest)
    clock.now += 1
    for name in DEVICES:
        assert engine.task(name).action == "done"
    assert engine.store.round(3) is None and engine.store.count_closed() == 2
    status = engine.status()
    assert status["state"] == "done" and "--dp-target-epsilon" in status["stopped"]
    assert status["privacy"]["epsilon"] <= target
    again = dp_engine(tmp_path, clock, dp_target_epsilon=target)  # a restart stops again, before opening round 3
    for name in DEVICES:
        again.task(name)
    assert again.store.round(3) is None and again.stopped is not None


@pytest.mark.slow
def test_epsilon_survives_a_kill_9_of_the_served_process(tmp_path, manifest) -> None:
    """A real `edgepfl serve` with DP: round 1's epsilon is on /v1/status; after kill -9 the budget continues."""
    pytest.importorskip("dp_accounting")
    from server_helpers import DeviceClient, LiveServer, wait_status

    tokens = enroll(tmp_path / "state", "e0", "e1")  # with d0..d3: 6 devices, the two that poll are sampled
    options = (
        "--min-clients",
        "2",
        "--poll-interval",
        "0.2",
        "--rounds",
        "3",
        "--dp-noise-multiplier",
        str(SIGMA),
        "--dp-clip",
        str(CLIP),
        "--clip-multiple",
        "0",
    )

    def served_round(server: LiveServer) -> dict:
        devices = {name: DeviceClient(server.url, token) for name, token in tokens.items()}
        for device in devices.values():
            device.task()
        for number, device in enumerate(devices.values()):
            task = device.wait_for_train()
            assert task["settings"]["clip_norm"] == CLIP
            delta = clip_delta(random_delta(device.base(task["round"]), 1.0, number), CLIP)
            assert device.upload(task["round"], delta_body(delta, "fp32", manifest)).status_code == 200
        return wait_status(server.url, tokens["e0"], lambda s: s["rounds"] and s["rounds"][-1]["state"] == "closed")

    server = LiveServer(tmp_path / "bundle", tmp_path / "state", *options).start()
    try:
        first = served_round(server)
    finally:
        server.kill()  # kill -9
    epsilon = accountant_epsilon(1, population=2, sampled=2)
    assert first["privacy"]["epsilon"] == pytest.approx(epsilon, rel=1e-9)
    server = LiveServer(tmp_path / "bundle", tmp_path / "state", *options).start()
    try:
        status = wait_status(server.url, tokens["e0"], lambda s: True)
        assert status["privacy"]["epsilon"] == first["privacy"]["epsilon"]
        assert status["privacy"]["rounds_accounted"] == 1
        second = served_round(server)
    finally:
        server.kill()
    assert second["privacy"]["epsilon"] == pytest.approx(accountant_epsilon(2, population=2, sampled=2), rel=1e-9)
    assert [row["epsilon"] for row in second["rounds"]] == [first["privacy"]["epsilon"], second["privacy"]["epsilon"]]
