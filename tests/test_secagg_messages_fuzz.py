"""The SecAgg+ messages and saved sessions under hostile bytes (issue 55): any text decodes to a valid message of
the kind asked for or is refused with one SecAggError line; never another exception, whatever the JSON holds
(deep nesting, huge numbers, a list where a name goes, wrong lengths, foreign fields).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from fuzz_budget import examples, fuzz_settings, reported, seeded
from hypothesis import given
from hypothesis import strategies as st
from secagg_helpers import seeded_bytes

from edgepfl.secagg import ClientSession, SecAggConfig, SecAggError, ServerSession
from edgepfl.secagg.messages import MESSAGES, MaskedInput, from_json, to_json

CASES = 200

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**400), 10**400)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | st.sampled_from(["AAAA", "phone-0", "", " ", "=", "all", "auto"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
TEXT_ONLY = ["1e999", "-1e999", "NaN", "Infinity", "[" * 100_000, '{"a":' * 100_000, "\udcff", '"\\ud800"']


def _valid_messages() -> dict[str, str]:
    """One valid message of every kind, as JSON text."""
    config = SecAggConfig(clip_norm=1.0, neighbours="all", max_weight=10)
    server = ServerSession.start("run/round-1", config, 5, randomness=bytes(32))
    clients = {d: ClientSession.start(d, "run/round-1", seeded_bytes(i)) for i, d in enumerate(["a", "b", "c"])}
    texts = {}
    for client in clients.values():
        texts["KeyAdvert"] = to_json(client.advert())
        server.receive_advert(client.advert())
    book = server.close_keys()
    texts["KeyBook"] = to_json(book)
    for client in clients.values():
        bundle = client.receive_book(book, seeded_bytes(7))
        texts["ShareBundle"] = to_json(bundle)
        server.receive_shares(bundle)
    for device, inbox in server.close_shares().items():
        texts["ShareInbox"] = to_json(inbox)
        masked = clients[device].receive_inbox(inbox, np.zeros(book.vector_length, np.uint32))
        texts["MaskedInput"] = to_json(masked)
        server.receive_masked(masked)
    request = server.close_inputs()
    texts["UnmaskRequest"] = to_json(request)
    texts["UnmaskShares"] = to_json(clients["a"].receive_unmask(request))
    texts["ServerSession"] = server.to_json()
    texts["ClientSession"] = clients["a"].to_json()
    return texts


VALID = _valid_messages()


@st.composite
def hostile_texts(draw) -> str:
    """A valid message of some kind with a field (at any depth) replaced, dropped or added, or any JSON text."""
    how = draw(st.sampled_from(["replace", "drop", "add", "any", "text"]))
    if how == "text":
        return draw(st.sampled_from(TEXT_ONLY))
    if how == "any":
        return json.dumps(draw(JSON))
    data = json.loads(VALID[draw(st.sampled_from(sorted(VALID)))])
    node = data
    while True:  # walk down to a random container
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            break
        key = draw(st.sampled_from(keys))
        if isinstance(node[key], dict | list) and node[key] and draw(st.booleans()):
            node = node[key]
            continue
        if how == "replace":
            node[key] = draw(JSON)
        elif how == "drop" and isinstance(node, dict):
            del node[key]
        elif isinstance(node, dict):
            node[draw(st.text(max_size=8))] = draw(JSON)
        break
    return json.dumps(data)


def _decodes_or_refuses(decode, text) -> None:
    try:
        decode(text)
    except SecAggError as error:
        assert error.problem and error.fix and "\n" not in error.problem


@pytest.mark.parametrize("kind", [None, *MESSAGES.values()], ids=lambda k: getattr(k, "__name__", "any"))
def test_a_hostile_message_decodes_or_is_refused(kind) -> None:
    with reported(f"secagg messages ({getattr(kind, '__name__', 'any kind')})", {"examples": examples(CASES)}):

        @seeded
        @fuzz_settings(CASES)
        @given(text=hostile_texts())
        def run(text: str) -> None:
            _decodes_or_refuses(lambda t: from_json(t, kind), text)

        run()


def test_a_hostile_saved_session_is_refused() -> None:
    with reported("secagg saved sessions", {"examples": examples(CASES)}):

        @seeded
        @fuzz_settings(CASES)
        @given(text=hostile_texts())
        def run(text: str) -> None:
            _decodes_or_refuses(ServerSession.from_json, text)
            _decodes_or_refuses(ClientSession.from_json, text)

        run()


def test_a_hostile_masked_frame_is_refused() -> None:
    frame = MaskedInput("a", b"\x01\x02\x03").to_bytes()
    with reported("secagg masked frames", {"examples": examples(CASES)}):

        @seeded
        @fuzz_settings(CASES)
        @given(cut=st.integers(0, len(frame)), flips=st.lists(st.tuples(st.integers(0, 64), st.integers(0, 255))))
        def run(cut: int, flips: list[tuple[int, int]]) -> None:
            body = bytearray(frame[:cut])
            for at, value in flips:
                if at < len(body):
                    body[at] = value
            _decodes_or_refuses(MaskedInput.from_bytes, bytes(body))

        run()


@pytest.mark.parametrize(
    "text",
    [
        '{"type": []}',  # an unhashable type name
        "[" * 100_000,  # nesting past Python's recursion limit
        VALID["KeyBook"].replace('"devices": 3', '"devices": 1e999'),  # a plan number json reads as infinity
        VALID["KeyBook"].replace('"clip_norm": 1.0', '"clip_norm": ' + "9" * 400),  # an int too large for a float
        VALID["KeyBook"].replace('"devices": 3', '"devices": "3"'),  # a number as text
        VALID["KeyBook"].replace('"base_size": 5', '"base_size": true'),  # a boolean as a size
        # a config field named by a newline, which Python's TypeError printed as it is (the hour-long run of
        # 2026-12-05, seed 2089167203): two lines of error
        VALID["KeyBook"].replace('"clip_norm": 1.0', '"\\n": 1, "clip_norm": 1.0'),
    ],
    ids=["unhashable-type", "deep-nesting", "infinite-plan", "huge-clip", "text-number", "bool-size", "newline-field"],
)
def test_regression_hostile_messages_found_by_the_fuzz(text: str) -> None:
    with pytest.raises(SecAggError) as refused:
        from_json(text)
    assert refused.value.problem and refused.value.fix and "\n" not in refused.value.problem
