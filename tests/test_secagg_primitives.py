"""The pieces under secure aggregation: the field, Shamir, the ring and its masks, keys, graph, plan, quantizer."""

from __future__ import annotations

import math

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from hypothesis import given, settings
from hypothesis import strategies as st

from edgepfl.errors import SecAggError
from edgepfl.secagg import SecAggConfig, keys, make_plan, quantize_delta, shamir
from edgepfl.secagg import config as plans
from edgepfl.secagg.graph import neighbour_map
from edgepfl.secagg.quantize import VectorLayout, dequantize_sum, rotate, unrotate
from edgepfl.secagg.ring import mask_vector, pack, to_signed, unpack
from tests.secagg_helpers import SHAPES, Round, device_ids, sample_delta, seeded_bytes

# chi-square, 255 degrees of freedom: a uniform byte histogram exceeds this with probability 0.001
CHI2_255_AT_0_001 = 330.5


def _probably_prime(n: int) -> bool:
    """Miller-Rabin with the first 40 primes as bases (a composite passes with probability < 4^-40)."""
    bases = [p for p in range(2, 180) if all(p % q for q in range(2, p))][:40]
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = pow(x, 2, n)
            if x == n - 1:
                break
        else:
            return False
    return True


def test_the_field_is_the_smallest_prime_above_2_to_the_256():
    assert _probably_prime(shamir.PRIME)
    assert not any(_probably_prime(n) for n in range((1 << 256) + 1, shamir.PRIME, 2))  # a witness is a proof


@settings(max_examples=40, deadline=None, derandomize=True)
@given(secret=st.binary(min_size=32, max_size=32), n=st.integers(2, 12), data=st.data())
def test_any_threshold_shares_give_the_secret_and_fewer_are_refused(secret, n, data):
    t = data.draw(st.integers(1, n))
    shares = shamir.split(secret, range(1, n + 1), t, seeded_bytes(n))
    chosen = data.draw(st.lists(st.sampled_from(range(1, n + 1)), min_size=t, max_size=n, unique=True))
    assert shamir.reconstruct({x: shares[x] for x in chosen}, t) == secret
    if t > 1:
        with pytest.raises(SecAggError, match=f"has {t - 1} shares, {t} are needed"):
            shamir.reconstruct({x: shares[x] for x in chosen[: t - 1]}, t)


def test_an_inconsistent_or_malformed_share_is_caught():
    shares = shamir.split(bytes(32), range(1, 6), 3, seeded_bytes(1))
    shares[4] = ((int.from_bytes(shares[4], "big") + 1) % shamir.PRIME).to_bytes(33, "big")
    with pytest.raises(SecAggError, match="inconsistent"):
        shamir.reconstruct(shares, 3, "phone-004's seed")
    for bad in (b"\0" * 32, shamir.PRIME.to_bytes(33, "big")):
        with pytest.raises(SecAggError):
            shamir.read_share(bad)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(bits=st.integers(8, 32), length=st.integers(0, 70), seed=st.integers(0, 2**32 - 1))
def test_packing_round_trips_for_every_ring_width(bits, length, seed):
    values = np.random.default_rng(seed).integers(0, 1 << bits, length, dtype=np.uint64).astype(np.uint32)
    payload = pack(values, bits)
    assert len(payload) == (length * bits + 7) // 8
    assert np.array_equal(unpack(payload, length, bits), values)


def test_packing_is_little_endian_bit_order_and_refuses_stray_bits():
    assert pack(np.array([1, 2**11 - 1], np.uint32), 12) == bytes([0x01, 0xF0, 0x7F])
    with pytest.raises(SecAggError, match="padding bits"):
        unpack(bytes([0, 0, 0, 0, 0x10]), 3, 12)
    with pytest.raises(SecAggError, match="expected 3"):
        unpack(bytes(4), 2, 12)
    assert list(to_signed(np.array([0, 2047, 2048, 4095]), 12)) == [0, 2047, -2048, -1]


def test_the_mask_is_aes_256_ctr_from_a_zero_counter_read_as_little_endian_words():
    seed = bytes(range(32))
    encryptor = Cipher(algorithms.AES(seed), modes.ECB()).encryptor()  # the counter blocks, by hand
    stream = b"".join(encryptor.update(i.to_bytes(16, "big")) for i in range(3))
    words = [int.from_bytes(stream[4 * i : 4 * i + 4], "little") for i in range(10)]
    assert list(mask_vector(seed, 10)) == words
    assert list(mask_vector(seed, 10, 12)) == [w & 0xFFF for w in words]


def test_a_masked_vector_looks_uniform_and_a_plain_one_does_not():
    # 16 bits: the packed bytes are the elements' bytes; 32768 values: a histogram of 65 kB per vector
    game = Round(4, SecAggConfig(clip_norm=1.0, bits=16), shapes={"w": (1 << 15,)})
    game.run()
    device = "phone-002"
    upload = game.clients[device].receive_inbox(game.server.inbox(device), game.vectors[device]).masked

    def chi2(payload: bytes) -> float:
        counts = np.bincount(np.frombuffer(payload, np.uint8), minlength=256)
        expected = len(payload) / 256
        return float(((counts - expected) ** 2 / expected).sum())

    assert chi2(upload) < CHI2_255_AT_0_001 < chi2(pack(game.vectors[device], 16))


def test_key_agreement_is_symmetric_and_bound_to_its_purpose_and_devices():
    a, b = keys.new_private_key(seeded_bytes(1)), keys.new_private_key(seeded_bytes(2))
    shared = keys.agree(a, keys.public_key(b), "b")
    assert shared == keys.agree(b, keys.public_key(a), "a")
    one_way = keys.derive(shared, "share", "r/1", "a", "b")
    assert one_way != keys.derive(shared, "share", "r/1", "b", "a") != keys.derive(shared, "share", "r/2", "a", "b")
    sealed = keys.encrypt(one_way, b"shares", keys.info("share", "r/1", "a", "b"), seeded_bytes(3))
    assert keys.decrypt(one_way, sealed, keys.info("share", "r/1", "a", "b"), "x") == b"shares"
    with pytest.raises(SecAggError, match="does not decrypt"):
        keys.decrypt(one_way, sealed, keys.info("share", "r/1", "b", "a"), "x")
    with pytest.raises(SecAggError, match="low-order"):
        keys.agree(a, bytes(32), "evil")


@pytest.mark.parametrize("n, k", [(12, 4), (9, 6), (7, 6), (30, 10)])
def test_the_graph_is_k_regular_symmetric_and_seeded(n, k):
    devices = device_ids(n)
    graph = neighbour_map(devices, bytes(32), k)
    degree = min(k, n - 1)
    assert all(len(graph[d]) == degree and d not in graph[d] for d in devices)
    assert all(d in graph[peer] for d in devices for peer in graph[d])
    assert graph == neighbour_map(list(reversed(devices)), bytes(32), k)
    if degree < n - 1:
        assert graph != neighbour_map(devices, bytes(31) + b"\1", k)


def test_auto_neighbours_is_the_smallest_k_meeting_the_bounds():
    config = SecAggConfig(clip_norm=1.0)
    for n, classic in [(10, True), (50, True), (200, False), (1000, False)]:
        plan = make_plan(n, config)
        assert plan.classic == classic and plan.threshold == max(2, math.ceil(0.5 * (plan.neighbours + 1)))
        assert plan.min_survivors == max(plan.threshold, n // 2 + n % 2)
        if not classic:
            assert plans.auto_neighbours(n, config) == plan.neighbours
            smaller = SecAggConfig(clip_norm=1.0, neighbours=plan.neighbours - 2)
            assert make_plan(n, smaller).neighbours == plan.neighbours - 2
            assert plan.neighbours % 2 == 0 and plan.neighbours < n - 2
            # a lighter adversary needs fewer neighbours
            assert plans.auto_neighbours(n, SecAggConfig(clip_norm=1.0, dropout=0.05, collusion=0.05)) < plan.neighbours


def test_the_plan_bounds_hold_at_auto_k_and_fail_below_it():
    config, n = SecAggConfig(clip_norm=1.0), 200
    k = plans.auto_neighbours(n, config)

    def bounds(k: int) -> bool:
        t = max(2, math.ceil(0.5 * (k + 1)))
        short = plans._log_hypergeom_cdf(n, n - 50, k + 1, t - 1)
        collude = plans._log_hypergeom_sf(n - 1, 50, k, t)
        cut = plans._log_all_chosen(n, 100, k // 2)
        return math.log(n) + short <= -20 * math.log(2) and math.log(n) + max(collude, cut) <= -40 * math.log(2)

    assert bounds(k) and not bounds(k - 2)


def test_default_ring_width_keeps_int8_resolution_and_nothing_wraps():
    for n in (3, 10, 200, 5000):
        plan = make_plan(n, SecAggConfig(clip_norm=1.0, neighbours="all"))
        q = plans.levels(n, plan.bits)
        assert q >= 127 and n * q < 1 << (plan.bits - 1)
        base, count = plans.weight_digits(n, plan.bits, 1000)
        assert n * (base - 1) < 1 << plan.bits and base**count > 1000


def test_rotation_is_orthonormal_and_undone():
    x = np.random.default_rng(0).normal(size=4096)
    rotated = rotate(x, 1024, bytes(32))
    assert np.isclose(np.linalg.norm(rotated), np.linalg.norm(x))
    assert np.allclose(unrotate(rotated, 1024, bytes(32)), x)
    spike = np.zeros(4096)
    spike[7] = 1.0  # one large value is spread over a whole block
    assert np.abs(rotate(spike, 1024, bytes(32))).max() == pytest.approx(1 / 32)


def test_extreme_deltas_cannot_wrap_the_ring_and_weights_are_capped():
    game = Round(4, SecAggConfig(clip_norm=0.5, neighbours="all", max_weight=50))
    book = game.advertise()
    layout = VectorLayout.of(SHAPES)
    spike = {name: np.full(shape, 1e3, np.float32) for name, shape in SHAPES.items()}  # clipped to norm C
    vectors = [quantize_delta(spike, 10**6, book, None) for _ in range(4)]  # all devices at the same extreme
    total = sum(v.astype(np.int64) for v in vectors) % (1 << book.plan.bits)
    result = dequantize_sum(total.astype(np.uint32), layout, book)
    assert result.total_weight == 4 * 50
    mean = result.weighted_mean()
    norm = math.sqrt(sum(float(np.sum(mean[name].astype(np.float64) ** 2)) for name in SHAPES))
    assert norm == pytest.approx(0.5, rel=0.05)  # the clipped direction comes back, no wrap-around
    assert np.all(mean["fc.weight"] > 0)


def test_the_quantizer_refuses_a_delta_it_cannot_sum():
    book = Round(3, SecAggConfig(clip_norm=1.0)).advertise()
    with pytest.raises(SecAggError, match="NaN or Inf"):
        quantize_delta({**sample_delta(0), "fc.weight": np.full((3, 7), np.nan, np.float32)}, 1, book)
    with pytest.raises(SecAggError, match="the round sums"):
        quantize_delta({"fc.weight": np.zeros((3, 7), np.float32)}, 1, book)
    with pytest.raises(SecAggError, match="non-negative integer"):
        quantize_delta(sample_delta(0), -1, book)
