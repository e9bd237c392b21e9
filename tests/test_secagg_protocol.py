"""Secure aggregation rounds (edgepfl.secagg): exact sums, dropouts at every step, durable state, refusals."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgepfl.errors import EdgePFLError, SecAggError
from edgepfl.secagg import (
    ClientSession,
    MaskedInput,
    SecAggConfig,
    ServerSession,
    ShareBundle,
    UnmaskRequest,
    UnmaskShares,
    VectorLayout,
    from_json,
    to_json,
)
from edgepfl.secagg.config import padded_size
from edgepfl.secagg.quantize import step_size
from edgepfl.secagg.ring import pack
from tests.secagg_helpers import SHAPES, Round, sample_delta, seeded_bytes

PLUS = SecAggConfig(clip_norm=1.0, neighbours=4)  # SecAgg+: 4 neighbours each
CLASSIC = SecAggConfig(clip_norm=1.0, neighbours="all")
PLUS6 = SecAggConfig(clip_norm=1.0, neighbours=6)  # groups of 7 with threshold 4: any 3 devices may drop


@pytest.mark.parametrize("n, config", [(12, PLUS), (7, CLASSIC)])
def test_the_secure_sum_is_exactly_the_plain_sum_of_the_quantized_vectors(n, config):
    game = Round(n, config)
    result = game.run()
    assert game.server.book.plan.classic == (config is CLASSIC)
    assert np.array_equal(result, game.plain_sum(game.clients))
    summed = game.server.aggregate(VectorLayout.of(SHAPES))
    assert summed.total_weight == sum(game.weights.values())


def test_the_unmasked_sum_decodes_to_the_weighted_mean_of_the_deltas():
    game = Round(9, SecAggConfig(clip_norm=1.0, neighbours="all", max_weight=200))
    game.run()
    book = game.server.book
    mean = game.server.aggregate(VectorLayout.of(SHAPES)).weighted_mean()
    weights = [game.weights[d] for d in game.clients]
    exact = {name: sum(w * sample_delta(i)[name] for i, w in enumerate(weights)) / sum(weights) for name in SHAPES}
    error = np.sqrt(sum(np.sum((mean[name] - exact[name]) ** 2) for name in SHAPES))
    # stochastic rounding: each device's error per rotated slot has variance <= step^2 / 4, independent; the
    # inverse rotation keeps norms, and the mean scales the sum by max_weight / sum(w)
    rms = np.sqrt(9 * padded_size(book.base_size)) * step_size(book) / 2 * 200 / sum(weights)
    assert error <= 3 * rms < 0.25 * np.sqrt(sum(np.sum(exact[name] ** 2) for name in SHAPES))


@pytest.mark.parametrize("step", ["shares", "upload", "reveal"])
def test_classic_secagg_survives_n_minus_t_dropouts_at_every_step(step):
    game = Round(7, CLASSIC)
    plan_t = 4  # ceil(0.5 * 7)
    dropped = ["phone-001", "phone-004", "phone-006"]  # n - t = 3
    result = game.run(**{f"skip_{step}": dropped})
    uploaded = [d for d in game.clients if step == "reveal" or d not in dropped]
    assert game.server.book.plan.threshold == plan_t
    assert np.array_equal(result, game.plain_sum(uploaded))


def test_dropouts_at_all_three_steps_at_once_still_give_the_survivors_sum():
    game = Round(12, PLUS6)
    result = game.run(skip_shares=["phone-002"], skip_upload=["phone-007"], skip_reveal=["phone-010"])
    assert "phone-007" in game.server.request.dropped and "phone-010" in game.server.request.survivors
    assert np.array_equal(result, game.plain_sum(game.server.request.survivors))


@pytest.mark.parametrize("step", ["shares", "upload", "reveal"])
def test_more_than_n_minus_t_dropouts_fail_the_round_in_one_line(step):
    game = Round(7, CLASSIC)
    with pytest.raises(SecAggError) as caught:
        game.run(**{f"skip_{step}": ["phone-000", "phone-001", "phone-002", "phone-003"]})
    assert "n - t" in str(caught.value) and "\n" not in str(caught.value)
    assert game.server.phase == "failed"
    with pytest.raises(SecAggError, match="n - t"):  # and the failure is durable
        ServerSession.from_json(game.server.to_json()).finish()


def test_a_state_restored_from_json_after_every_step_continues_to_the_same_sum():
    plain, restored = Round(12, PLUS6), Round(12, PLUS6, roundtrip=True)
    drops = {"skip_shares": ["phone-005"], "skip_upload": ["phone-003"], "skip_reveal": ["phone-008"]}
    assert np.array_equal(plain.run(**drops), restored.run(**drops))


def test_a_server_killed_mid_round_resumes_and_counts_a_resent_upload_once():
    game = Round(6, CLASSIC)
    book = game.advertise()
    game.share(book, ())
    inboxes = game.server.close_shares()
    saved = game.server.to_json()
    vector = np.zeros(book.vector_length, np.uint32)
    upload = game.clients["phone-000"].receive_inbox(inboxes["phone-000"], vector)
    assert game.server.receive_masked(upload) is True
    saved_after = game.server.to_json()
    # kill -9 before the state was saved: the device's resend is new to the restored server
    assert ServerSession.from_json(saved).receive_masked(upload) is True
    # kill -9 after: the resend is recognised and changes nothing
    resumed = ServerSession.from_json(saved_after)
    assert resumed.receive_masked(upload) is False
    assert resumed.to_json() == saved_after


def test_a_device_repeats_each_answer_for_the_same_message_and_refuses_a_different_one():
    game = Round(5, CLASSIC)
    book = game.advertise()
    client = game.clients["phone-000"]
    bundle = client.receive_book(book, seeded_bytes(1))
    assert client.receive_book(book, seeded_bytes(99)) == bundle  # resent after a crash: the same ciphertexts
    for i, (device, other) in enumerate(game.clients.items()):
        game.server.receive_shares(bundle if device == "phone-000" else other.receive_book(book, seeded_bytes(i)))
    inbox = game.server.close_shares()["phone-000"]
    vector = np.arange(book.vector_length, dtype=np.uint32)
    masked = client.receive_inbox(inbox, vector)
    assert client.receive_inbox(inbox, vector) == masked
    saved = client.to_json()
    with pytest.raises(SecAggError, match="already uploaded a different masked vector"):
        client.receive_inbox(inbox, vector + 1)
    assert client.to_json() == saved


def test_a_device_never_reveals_both_shares_of_one_peer():
    game = Round(5, CLASSIC)
    book = game.advertise()
    game.share(book, ())
    inboxes = game.server.close_shares()
    client = game.clients["phone-000"]
    client.receive_inbox(inboxes["phone-000"], np.zeros(book.vector_length, np.uint32))
    everyone = tuple(sorted(game.clients))
    saved = client.to_json()
    with pytest.raises(SecAggError, match="asks for both shares of device 'phone-001'"):
        client.receive_unmask(UnmaskRequest(everyone, ("phone-001",)))
    assert client.to_json() == saved
    first = client.receive_unmask(UnmaskRequest(everyone, ()))
    assert set(first.seed_shares) == set(everyone) and not first.key_shares
    with pytest.raises(SecAggError, match="again with other survivors"):  # now claim phone-001 dropped
        client.receive_unmask(UnmaskRequest(tuple(d for d in everyone if d != "phone-001"), ("phone-001",)))
    assert client.receive_unmask(UnmaskRequest(everyone, ())) == first


def test_the_server_refuses_bad_messages_and_keeps_what_it_holds():
    game = Round(5, CLASSIC)
    book = game.advertise()
    bundles = {d: c.receive_book(book, seeded_bytes(i)) for i, (d, c) in enumerate(game.clients.items())}
    server = game.server
    server.receive_shares(bundles["phone-000"])
    saved = server.to_json()
    short = ShareBundle("phone-001", {**bundles["phone-001"].sealed, "phone-000": b"\0" * 10})
    too_few = ShareBundle("phone-001", dict(list(bundles["phone-001"].sealed.items())[:2]))
    conflicting = ShareBundle("phone-000", {**bundles["phone-000"].sealed, "phone-001": bytes(94)})
    for bad, problem in [
        (short, "not one 94-byte message"),
        (too_few, "not one 94-byte message"),
        (ShareBundle("stranger", {}), "not in this round's key book"),
        (conflicting, "already sent other shares"),
    ]:
        with pytest.raises(SecAggError, match=problem):
            server.receive_shares(bad)
        assert server.to_json() == saved
    assert server.receive_shares(bundles["phone-000"]) is False  # an exact repeat: nothing changes
    for bundle in bundles.values():
        server.receive_shares(bundle)
    inboxes = server.close_shares()
    length = book.vector_length
    upload = game.clients["phone-002"].receive_inbox(inboxes["phone-002"], np.zeros(length, np.uint32))
    server.receive_masked(upload)
    saved = server.to_json()
    bits = book.plan.bits
    for bad, problem in [
        (MaskedInput("phone-003", upload.masked[:-1]), "expected"),
        (MaskedInput("phone-003", pack(np.zeros(length + 1, np.uint32), bits)), "expected"),
        (MaskedInput("phone-002", pack(np.ones(length, np.uint32), bits)), "different masked vector"),
    ]:
        with pytest.raises(SecAggError, match=problem):
            server.receive_masked(bad)
        assert server.to_json() == saved
    for device in ("phone-000", "phone-001", "phone-003", "phone-004"):
        server.receive_masked(game.clients[device].receive_inbox(inboxes[device], np.zeros(length, np.uint32)))
    request = server.close_inputs()
    reveal = game.clients["phone-000"].receive_unmask(request)
    saved = server.to_json()
    both = UnmaskShares("phone-000", reveal.seed_shares, {"phone-001": reveal.seed_shares["phone-001"]})
    missing = UnmaskShares("phone-000", dict(list(reveal.seed_shares.items())[1:]), {})
    outside = UnmaskShares("phone-000", {**reveal.seed_shares, "phone-001": (1 << 263).to_bytes(33, "big")}, {})
    for bad, problem in [
        (both, "both shares of 'phone-001'"),
        (missing, "other devices than the request asks"),
        (outside, "outside the field"),
    ]:
        with pytest.raises(SecAggError, match=problem):
            server.receive_unmask(bad)
        assert server.to_json() == saved


def test_a_tampered_or_misrouted_share_is_refused_by_the_device():
    game = Round(5, CLASSIC)
    book = game.advertise()
    game.share(book, ())
    inboxes = game.server.close_shares()
    inbox = inboxes["phone-000"]
    sealed = dict(inbox.sealed)
    flipped = bytearray(sealed["phone-001"])
    flipped[20] ^= 1
    vector = np.zeros(book.vector_length, np.uint32)
    client = game.clients["phone-000"]
    saved = client.to_json()
    for bad, problem in [
        ({**sealed, "phone-001": bytes(flipped)}, "does not decrypt"),
        ({**sealed, "phone-001": sealed["phone-002"]}, "does not decrypt"),
    ]:
        with pytest.raises(SecAggError, match=problem):
            client.receive_inbox(type(inbox)("phone-000", bad), vector)
        assert client.to_json() == saved
    with pytest.raises(SecAggError, match="share inbox of 'phone-001'"):
        client.receive_inbox(inboxes["phone-001"], vector)
    with pytest.raises(SecAggError, match="ring vector is not"):
        client.receive_inbox(inbox, np.zeros(book.vector_length - 1, np.uint32))


def test_a_device_refuses_a_key_book_that_weakens_the_threshold_or_drops_its_keys():
    game = Round(6, CLASSIC)
    book = game.advertise()
    client = game.clients["phone-000"]
    lowered = type(book)(
        book.context,
        book.config,
        book.randomness,
        book.adverts,
        type(book.plan)(**{**vars(book.plan), "threshold": 2, "min_survivors": 2}),
        book.base_size,
    )
    with pytest.raises(SecAggError, match="does not follow from its settings"):
        client.receive_book(lowered)
    other = game.clients["phone-001"].advert()
    swapped = tuple(
        a if a.device != "phone-000" else type(a)("phone-000", other.mask_key, other.cipher_key) for a in book.adverts
    )
    with pytest.raises(SecAggError):
        client.receive_book(type(book)(book.context, book.config, book.randomness, swapped, book.plan, book.base_size))
    with pytest.raises(SecAggError, match="is for round"):
        client.receive_book(
            type(book)("run-x/round-9", book.config, book.randomness, book.adverts, book.plan, book.base_size)
        )
    assert client.phase == "advertised"


def test_messages_and_states_refuse_malformed_json_in_one_line():
    for text in [
        "{",
        '{"type": "KeyAdvert", "device": "a", "cipher_key": "!!", "mask_key": ""}',
        '{"type": "UnmaskRequest", "survivors": "x", "dropped": []}',
        '{"type": "Nope"}',
    ]:
        with pytest.raises(SecAggError):
            from_json(text)
    advert = ClientSession.start("phone-000", "r/1", seeded_bytes(0)).advert()
    with pytest.raises(SecAggError, match="is not ShareBundle"):
        from_json(to_json(advert), ShareBundle)
    for load in (ClientSession.from_json, ServerSession.from_json):
        with pytest.raises(SecAggError, match="cannot be read"):
            load('{"type": "ClientSession", "version": 2}')
    assert issubclass(SecAggError, EdgePFLError)
    framed = MaskedInput("phone-000", b"\1\2\3")
    assert MaskedInput.from_bytes(framed.to_bytes()) == framed
    with pytest.raises(SecAggError, match="frame is malformed"):
        MaskedInput.from_bytes(b"EPSA1\0\0\1\0{}")


def test_too_few_devices_or_a_too_small_ring_is_refused():
    server = ServerSession.start("r/1", PLUS, 10)
    for i in range(2):
        server.receive_advert(ClientSession.start(f"d{i}", "r/1", seeded_bytes(i)).advert())
    with pytest.raises(SecAggError, match="at least 3"):
        server.close_keys()
    with pytest.raises(SecAggError, match="cannot sum 200 devices"):
        from edgepfl.secagg import make_plan

        make_plan(200, SecAggConfig(clip_norm=1.0, bits=8))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(n=st.integers(3, 9), k=st.sampled_from([2, 4, "all"]), data=st.data())
def test_any_dropout_pattern_the_thresholds_allow_gives_the_survivors_exact_sum(n, k, data):
    game = Round(n, SecAggConfig(clip_norm=1.0, neighbours=k))
    book = game.advertise()
    devices = list(game.clients)
    skip_shares = data.draw(st.sets(st.sampled_from(devices), max_size=n - book.plan.min_survivors))
    rest = [d for d in devices if d not in skip_shares]
    skip_upload = data.draw(st.sets(st.sampled_from(rest), max_size=len(rest) - book.plan.min_survivors))
    try:
        game.share(book, skip_shares)
        game.upload(book, skip_shares | skip_upload)
        request = game.server.close_inputs()
        for device in request.survivors:
            game.server.receive_unmask(game.clients[device].receive_unmask(request))
        result = game.server.finish()
    except SecAggError as exc:  # SecAgg+: a group short of its threshold fails cleanly, never wrongly
        assert not book.plan.classic and "more devices dropped than the threshold allows" in str(exc)
        return
    assert np.array_equal(result, game.plain_sum(request.survivors))
