"""What the page's keyboard and motion recorder share with the Python device (issue 52): the person's own words
(LatinIME's rule: typed twice is learned, capped, the least recently typed dropped) and the words offered with them,
the dictionary a Python device keeps in its state folder for `device predict --text`, and a sensor bundle's channel
units and window step, with the conversion of a phone's motion readings to its channels."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from edgepfl.errors import BundleError, DataError, UsageError
from edgepfl.kinds import InputSpec, NextWordKind, SensorKind
from edgepfl.kinds.sensor import STANDARD_GRAVITY
from edgepfl.kinds.userwords import (
    DICTIONARY_NAME,
    LEARN_AT,
    UserDictionary,
    learn_dictionary,
    load_dictionary,
    save_dictionary,
    suggestions,
)
from edgepfl.text import SPECIALS, Vocabulary, tokenize, write_vocabulary

VOCABULARY = Vocabulary((*SPECIALS, "to", "be", "or", "not", ",", "bees", "the"))


def test_a_word_outside_the_vocabulary_typed_twice_is_learned() -> None:
    assert LEARN_AT == 2
    dictionary = UserDictionary(VOCABULARY)
    dictionary.learn(tokenize("Zoë to be, zorblax!"))
    assert dictionary.words() == [] and dictionary.entries() == [["zoë", 1], ["zorblax", 1]]
    dictionary.learn(tokenize("ZOË again"))
    assert dictionary.words() == ["zoë"]
    dictionary.learn(tokenize("zorblax's zorblax"))
    assert dictionary.words() == ["zorblax", "zoë"]  # the most recently typed first
    assert [word for word, _ in dictionary.entries()] == ["zoë", "again", "zorblax's", "zorblax"]


def test_the_dictionary_keeps_its_cap_dropping_the_least_recently_typed_word() -> None:
    dictionary = learn_dictionary(["alpha beta", "gamma alpha", "delta"], VOCABULARY, cap=3)
    assert dictionary.entries() == [["gamma", 1], ["alpha", 2], ["delta", 1]]
    assert dictionary.words() == ["alpha"]


def test_the_words_offered_put_learned_words_in_oovs_place() -> None:
    #                               pad  oov  bos  eos  to    be   or   not   ,     bees  the
    probabilities = np.float32([0.5, 0.2, 0.4, 0.3, 0.05, 0.1, 0.2, 0.01, 0.15, 0.01, 0.02])

    def words(learned, prefix=""):
        return [
            (i, word, round(p, 4)) for i, word, p in suggestions(probabilities, VOCABULARY.words, learned, prefix, 3)
        ]

    assert words([]) == [(6, "or", 0.2), (8, ",", 0.15), (5, "be", 0.1)]  # no special token, however likely
    assert words(["zorblax", "zoë"]) == [(1, "zorblax", 0.2), (1, "zoë", 0.2), (6, "or", 0.2)]
    assert words(["zorblax", "bee"], "b") == [(1, "bee", 0.2), (5, "be", 0.1), (9, "bees", 0.01)]
    assert words([], "q") == []


def test_a_device_keeps_its_dictionary_in_its_state_folder_and_predict_offers_it(tmp_path) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    write_vocabulary(bundle, VOCABULARY)
    kind = NextWordKind.from_vocabulary(VOCABULARY, 4)
    notes = tmp_path / "notes.txt"
    notes.write_text("to be zorblax\nor not, Zorblax!\nthe bees and zeta\n", encoding="utf-8")
    state = tmp_path / "state"
    state.mkdir()
    kind.remember(notes, bundle, state)  # what `device train/run --data notes.txt` does after reading the text
    document = json.loads((state / DICTIONARY_NAME).read_text(encoding="utf-8"))
    assert document["entries"] == [["zorblax", 2], ["and", 1], ["zeta", 1]]
    assert load_dictionary(state, VOCABULARY).words() == ["zorblax"]
    probabilities = np.float32([0.0, 0.5, 0.0, 0.1, 0.1, 0.1, 0.05, 0.05, 0.04, 0.03, 0.03])
    assert kind.offered(probabilities, bundle, state, 2) == [(1, "zorblax", 0.5), (4, "to", np.float32(0.1))]
    assert [word for _, word, _ in kind.offered(probabilities, bundle, None, 2)] == ["to", "be"]
    save_dictionary(state, learn_dictionary([], VOCABULARY))
    assert load_dictionary(state, VOCABULARY).entries() == []
    for damaged in ("{", '{"format": "edgepfl-user-dictionary/1", "entries": [["x", 0]]}', "[]"):
        (state / DICTIONARY_NAME).write_text(damaged, encoding="utf-8")
        with pytest.raises(DataError, match="is not a user dictionary") as refused:
            load_dictionary(state, VOCABULARY)
        assert "learns it again" in refused.value.fix


HAPT = ("acc-x", "acc-y", "acc-z", "gyro-x", "gyro-y", "gyro-z")


def test_a_sensor_bundle_names_each_channels_unit_and_its_window_step() -> None:
    kind = SensorKind.of(HAPT, 128, 50.0)
    entry = kind.entry()
    assert entry["units"] == ["g", "g", "g", "rad/s", "rad/s", "rad/s"] and entry["step"] == 64
    again = SensorKind.from_entry(entry, kind.input, 6)
    assert (again.units, again.step) == (kind.units, kind.step)
    older = SensorKind.from_entry({"kind": "sensor", "channels": list(HAPT), "window": 128}, kind.input, 6)
    assert (older.units, older.step) == ((), 0)  # a recorder then takes HAPT's units and half a window
    assert SensorKind.of(("ecg", "acc-z"), 16, 50.0).units == ("", "g")
    with pytest.raises(UsageError, match="2 units for 1 channels"):
        SensorKind.of(("acc-x",), 16, 50.0, units=("g", "g"))
    with pytest.raises(BundleError, match="one unit a channel"):
        SensorKind.from_entry({**entry, "units": ["g"]}, kind.input, 6)


def test_a_phones_motion_converts_to_the_bundles_channels_in_its_units() -> None:
    acceleration = np.array([[0.0, 9.80665, 0.0], [1.0, -2.0, 3.0]])  # m/s², the device's x, y, z
    rotation = np.array([[0.1, 0.2, 0.3], [math.pi, 0.0, -1.0]])  # rad/s
    hapt = SensorKind.of(HAPT, 2, 50.0).from_motion(acceleration, rotation)
    assert hapt.dtype == np.float32 and hapt.shape == (6, 2)
    np.testing.assert_array_equal(hapt[:3], np.float32(acceleration.T * (1 / STANDARD_GRAVITY)))
    assert hapt[1, 0] == np.float32(1.0)
    np.testing.assert_array_equal(hapt[3:], np.float32(rotation.T))
    own = SensorKind.of(("gyro_x", "Accel-Z"), 2, 50.0, units=("deg/s", "m/s^2"))
    np.testing.assert_array_equal(
        own.from_motion(acceleration, rotation), np.float32([[0.1 * 180 / math.pi, 180.0], [0.0, 3.0]])
    )
    with pytest.raises(DataError, match="'ecg' is not a phone's motion"):
        SensorKind.of(("ecg",), 2, 50.0).from_motion(acceleration, rotation)
    with pytest.raises(DataError, match="furlongs"):
        SensorKind.of(("acc-x",), 2, 50.0, units=("furlongs",)).from_motion(acceleration, rotation)
    assert InputSpec(shape=(2, 2)).shape == own.input.shape
