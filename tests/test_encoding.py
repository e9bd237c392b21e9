"""Delta encodings: round-trip error within each stated bound, refusals, error feedback, crash-safe residuals."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from edgepfl.encoding import (
    SCALE_SUFFIX,
    Encoding,
    decode_delta,
    decode_payload,
    drop_residual,
    encode_base,
    encode_delta,
    encode_round_upload,
    encode_with_feedback,
    residual_before,
)
from edgepfl.errors import DataError, StateError, UsageError, WireError
from edgepfl.manifest import TensorSpec
from edgepfl.privacy import delta_norm
from edgepfl.wire import check_tensors, decode_tensors

INT8_LABELS = ["int8", "int8-block7", "int8-sr", "int8-block7-sr"]
values = arrays(
    np.float32,
    st.integers(1, 40),
    elements=st.floats(-1e4, 1e4, width=32, allow_subnormal=False).filter(lambda x: x == 0 or abs(x) > 1e-30),
)


def _delta(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "conv.weight": rng.normal(0, 0.02, (4, 3, 3, 3)).astype(np.float32),
        "conv.bias": rng.normal(0, 0.5, (4,)).astype(np.float32),
        "fc.weight": rng.standard_cauchy((5, 9)).astype(np.float32),
    }


def _int8_bound(value: np.ndarray, scale: np.ndarray, encoding: Encoding) -> np.ndarray:
    block = encoding.block_size or value.size
    per_value = np.repeat(scale.astype(np.float64), block)[: value.size]
    step = per_value if encoding.stochastic else per_value / 2
    return step + np.abs(value.reshape(-1)).astype(np.float64) * 2.0**-23


@settings(max_examples=60, deadline=None)
@given(value=values, label=st.sampled_from(INT8_LABELS), seed=st.integers(0, 2**16))
def test_int8_round_trip_within_stated_bound(value, label, seed):
    encoding = Encoding.parse(label)
    encoded = encode_delta({"w": value}, encoding, np.random.default_rng(seed))
    decoded = decode_delta(encoded.tensors, encoded.metadata, encoding)["w"]
    error = np.abs(decoded.astype(np.float64) - value.astype(np.float64)).reshape(-1)
    bound = _int8_bound(value, encoded.tensors["w" + SCALE_SUFFIX], encoding)
    assert (error <= bound).all()
    # the scale is max|x|/127 of each block, so the bound is the one the docstring states
    block = encoding.block_size or value.size
    peaks = [np.abs(value.reshape(-1)[i : i + block]).max() for i in range(0, value.size, block)]
    np.testing.assert_allclose(encoded.tensors["w" + SCALE_SUFFIX], np.array(peaks) / 127, rtol=1e-6)


@settings(max_examples=60, deadline=None)
@given(value=values)
def test_fp16_and_fp32_round_trip_within_stated_bound(value):
    for label, relative in (("fp32", 0.0), ("fp16", 2.0**-11)):
        encoding = Encoding.parse(label)
        encoded = encode_delta({"w": value}, encoding)
        decoded = decode_delta(encoded.tensors, encoded.metadata, encoding)["w"]
        assert decoded.dtype == np.float32
        bound = np.maximum(relative * np.abs(value), 2.0**-25 if relative else 0.0)
        assert (np.abs(decoded.astype(np.float64) - value) <= bound).all()


def test_stochastic_rounding_is_unbiased_and_seeded():
    value = np.linspace(-1, 1, 50, dtype=np.float32)
    encoding = Encoding.parse("int8-sr")
    draws = [
        decode_payload(encode_delta({"w": value}, encoding, np.random.default_rng(s)).to_bytes(), encoding)["w"]
        for s in range(400)
    ]
    scale = 1 / 127
    # the mean of 400 draws, each off by < scale with mean 0, is within 4 standard errors of the value
    assert np.abs(np.mean(draws, axis=0) - value).max() < 4 * scale / np.sqrt(400) * 0.5 + 1e-6
    again = encode_delta({"w": value}, encoding, np.random.default_rng(3)).to_bytes()
    assert again == encode_delta({"w": value}, encoding, np.random.default_rng(3)).to_bytes()


def test_bytes_shrink_as_the_encoding_says():
    delta = {"w": np.ones((64, 64), np.float32)}
    labels = ("fp32", "fp16", "int8", "int8-block64")
    sizes = {label: encode_delta(delta, Encoding.parse(label)).nbytes for label in labels}
    assert sizes == {"fp32": 16384, "fp16": 8192, "int8": 4096 + 4, "int8-block64": 4096 + 64 * 4}


def test_decoding_refuses_other_encodings_and_malformed_scales():
    delta = _delta()
    int8 = Encoding.parse("int8-block7")
    encoded = encode_delta(delta, int8)
    with pytest.raises(WireError, match="asked for 'fp16'"):
        decode_delta(encoded.tensors, encoded.metadata, Encoding.parse("fp16"))
    with pytest.raises(WireError, match="asked for 'int8'"):
        decode_delta(encoded.tensors, encoded.metadata, Encoding.parse("int8"))
    with pytest.raises(WireError, match="does not name its encoding"):
        decode_delta(encoded.tensors, {}, int8)
    tensors = dict(encoded.tensors)
    del tensors["conv.bias" + SCALE_SUFFIX]
    with pytest.raises(WireError, match="lacks the int8 scale of 'conv.bias'"):
        decode_delta(tensors, encoded.metadata, int8)
    with pytest.raises(WireError, match="scale for unknown tensor 'ghost'"):
        decode_delta({**encoded.tensors, "ghost" + SCALE_SUFFIX: np.ones(1, np.float32)}, encoded.metadata, int8)
    for bad in (np.array([np.nan, 1], np.float32), np.ones(3, np.float32), np.ones(2, np.float64)):
        with pytest.raises(WireError, match="scale of 'fc.weight'"):
            decode_delta({**encoded.tensors, "fc.weight" + SCALE_SUFFIX: bad}, encoded.metadata, int8)
    with pytest.raises(WireError, match="dtype float32, expected int8"):
        decode_delta({**encoded.tensors, "conv.bias": delta["conv.bias"]}, encoded.metadata, int8)
    fp16 = encode_delta(delta, Encoding.parse("fp16"))
    with pytest.raises(WireError, match="carries scale tensors"):
        decode_delta({**fp16.tensors, "x" + SCALE_SUFFIX: np.ones(1, np.float32)}, fp16.metadata, Encoding("fp16"))
    with pytest.raises(WireError, match="dtype float32, expected float16"):
        decode_delta({**fp16.tensors, "conv.bias": delta["conv.bias"]}, fp16.metadata, Encoding("fp16"))


def test_labels_parse_and_refuse():
    for label in ("fp32", "fp16", "int8", "int8-block256", "int8-sr", "int8-block256-sr"):
        assert Encoding.parse(label).label == label
    for label in ("int4", "fp16-sr", "int8-block0", "int8-blockx", ""):
        with pytest.raises(UsageError):
            Encoding.parse(label)
    with pytest.raises(UsageError, match="needs a random generator"):
        encode_delta(_delta(), Encoding.parse("int8-sr"))


def test_fp16_refuses_values_it_cannot_hold_and_base_download_is_flagged():
    with pytest.raises(DataError, match="beyond fp16's range"):
        encode_delta({"w": np.array([7e4], np.float32)}, Encoding("fp16"))
    base = _delta()
    encoded = encode_base(base, Encoding("fp16"))
    assert encoded.metadata == {"encoding": "fp16"}
    payload = encoded.to_bytes({"round": "3"})
    decoded = decode_payload(payload, Encoding("fp16"), "base")
    for name, value in base.items():
        assert decoded[name].dtype == np.float32
        assert np.all(np.abs(decoded[name] - value) <= np.maximum(2.0**-11 * np.abs(value), 2.0**-25))
    with pytest.raises(WireError, match="base is encoded as 'fp16'"):
        decode_payload(payload, Encoding("fp32"), "base")
    with pytest.raises(UsageError, match="cannot be int8"):
        encode_base(base, Encoding("int8"))


@pytest.mark.parametrize("label", ["fp16", "int8", "int8-block5-sr"])
def test_error_feedback_sends_the_sum_of_true_deltas_less_the_final_residual(label):
    encoding = Encoding.parse(label)
    rng = np.random.default_rng(7)
    residual = None
    true_sum = {name: np.zeros_like(value, np.float64) for name, value in _delta().items()}
    sent_sum = {name: np.zeros_like(value, np.float64) for name, value in _delta().items()}
    for round_id in range(20):
        delta = _delta(round_id)
        encoded, residual = encode_with_feedback(delta, residual, encoding, rng)
        sent = decode_payload(encoded.to_bytes(), encoding)
        for name in delta:
            true_sum[name] += delta[name]
            sent_sum[name] += sent[name]
    for name in true_sum:
        np.testing.assert_allclose(sent_sum[name], true_sum[name] - residual[name], rtol=0, atol=1e-4)
    # the gap does not pile up over rounds: it stays within the last round's stated error bound
    for name in residual:
        if encoding.name == "int8":
            assert np.abs(residual[name]).max() <= encoded.tensors[name + SCALE_SUFFIX].max() * (1 + 1e-6)
        else:
            assert np.abs(residual[name]).max() <= 2.0**-11 * np.abs(sent[name]).max() * 1.01


@pytest.mark.parametrize("label", ["fp32", "fp16", "int8", "int8-block4-sr"])
def test_clipped_feedback_decodes_within_the_clip_norm(label):
    encoding = Encoding.parse(label)
    delta = {name: value * 100 for name, value in _delta(1).items()}
    encoded, residual = encode_with_feedback(delta, None, encoding, np.random.default_rng(0), clip_norm=1.0)
    decoded = decode_payload(encoded.to_bytes(), encoding)
    assert delta_norm(decoded) <= 1.0
    assert delta_norm(decoded) > 0.9  # clipped to C, not shrunk far below it
    assert delta_norm(residual) < 0.2  # what clipping removed is dropped, only encoding error is kept


def test_a_round_encoded_twice_after_a_kill_gives_the_same_bytes_and_adds_the_residual_once(tmp_path):
    encoding = Encoding.parse("int8-block5-sr")
    first = encode_round_upload(tmp_path, 1, _delta(1), encoding, seed=11).to_bytes()
    after_one = residual_before(tmp_path, 2)
    # round 2: trained, encoded, residual saved ... killed before the upload; the restart encodes round 2 again
    sent_before_kill = encode_round_upload(tmp_path, 2, _delta(2), encoding, seed=11).to_bytes()
    saved_before_kill = residual_before(tmp_path, 3)
    sent_after_restart = encode_round_upload(tmp_path, 2, _delta(2), encoding, seed=11).to_bytes()
    assert sent_after_restart == sent_before_kill
    saved = residual_before(tmp_path, 3)
    expected = encode_with_feedback(_delta(2), after_one, encoding, np.random.default_rng([11, 2]))[1]
    for name in expected:
        np.testing.assert_array_equal(saved[name], expected[name])
        np.testing.assert_array_equal(saved[name], saved_before_kill[name])
    assert first != sent_before_kill
    # a refused upload's residual is dropped: round 3 starts from round 1's again
    drop_residual(tmp_path, 2)
    for name, value in residual_before(tmp_path, 3).items():
        np.testing.assert_array_equal(value, after_one[name])
    # files older than the one a refused round would fall back to are pruned
    encode_round_upload(tmp_path, 3, _delta(3), encoding, seed=11)
    encode_round_upload(tmp_path, 4, _delta(4), encoding, seed=11)
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == ["residual-00000003.safetensors", "residual-00000004.safetensors"]


def test_payload_keeps_other_metadata_and_decodes_to_plain_float32():
    encoded = encode_delta(_delta(), Encoding.parse("int8"))
    payload = encoded.to_bytes({"num_samples": "12"})
    assert set(decode_tensors(payload)) == set(_delta()) | {name + SCALE_SUFFIX for name in _delta()}
    decoded = decode_payload(payload, Encoding.parse("int8"))
    assert set(decoded) == set(_delta()) and all(v.dtype == np.float32 for v in decoded.values())


def test_encoding_and_privacy_import_without_torch_or_dp_accounting():
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['dp_accounting'] = None; "
        "import edgepfl.encoding, edgepfl.privacy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("label", ["fp32", "fp16", "int8-block5"])
def test_decoded_uploads_pass_the_servers_manifest_checks(label):
    encoding = Encoding.parse(label)
    specs = [TensorSpec(name, tuple(value.shape), "float32", "base", 0) for name, value in _delta().items()]
    decoded = decode_payload(encode_delta(_delta(), encoding).to_bytes(), encoding)
    check_tensors(decoded, specs)
    wrong_shape = {**_delta(), "conv.bias": np.zeros(5, np.float32)}
    with pytest.raises(WireError, match="'conv.bias' has shape"):
        check_tensors(decode_payload(encode_delta(wrong_shape, encoding).to_bytes(), encoding), specs)


def test_a_residual_from_another_layout_is_refused():
    residual = {"conv.weight": np.zeros(3, np.float32)}
    with pytest.raises(StateError, match="residual does not match"):
        encode_with_feedback(_delta(), residual, Encoding("fp16"))


@settings(max_examples=60, deadline=None)
@given(a=values, b=values, clip=st.floats(1e-3, 1e3), label=st.sampled_from(["fp32", "fp16", *INT8_LABELS]))
def test_every_clipped_upload_decodes_within_the_clip_norm(a, b, clip, label):
    encoding = Encoding.parse(label)
    encoded, _ = encode_with_feedback({"a": a, "b": b}, None, encoding, np.random.default_rng(0), clip_norm=clip)
    assert delta_norm(decode_payload(encoded.to_bytes(), encoding)) <= clip


def test_the_same_tensors_and_metadata_are_always_the_same_bytes():
    """safetensors writes metadata in a hash map's order: edgepfl sorts it, so a re-encoded retry is identical."""
    from edgepfl.wire import decode_metadata, encode_tensors

    tensors = {"b": np.arange(3, dtype=np.float32), "a": np.ones(2, np.int8)}
    metadata = {f"key{i}": f"välue {i}" for i in range(12)}
    payloads = {encode_tensors(tensors, dict(reversed(list(metadata.items())))) for _ in range(20)}
    payloads |= {encode_tensors(tensors, metadata) for _ in range(20)}
    assert len(payloads) == 1
    (payload,) = payloads
    assert decode_metadata(payload) == metadata and list(decode_metadata(payload)) == sorted(metadata)
    assert int.from_bytes(payload[:8], "little") % 8 == 0  # the header keeps the library's 8-byte alignment
