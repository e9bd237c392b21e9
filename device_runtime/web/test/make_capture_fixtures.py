"""The fixtures of the page's keyboard and motion recorder (test/capture.test.mjs), written by the Python rules they
must equal: the person's dictionary and the words offered (edgepfl/kinds/userwords.py), and a phone's motion readings
converted to a sensor bundle's channels and units (edgepfl/kinds/sensor.py from_motion).

Usage: python make_capture_fixtures.py OUT_DIR  (make_fixtures.py calls it; writes OUT_DIR/capture.json)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from edgepfl.kinds import SensorKind
from edgepfl.kinds.userwords import learn_dictionary, suggestions
from edgepfl.text import SPECIALS, Vocabulary

WORDS = [*SPECIALS, "to", "be", "or", "not", ",", "bees", "the", "zoë"]
# sentences in the order a person finished them: names and slang typed once, twice, three times; words of the
# vocabulary (never learned) and punctuation; case, NFKC and curly apostrophes as tokenize writes them
SENTENCES = [
    "Zorblax to be, or not.",
    "ZORBLAX and Ünïcode ﬁne",
    "don\u2019t zorblax me, don't",
    "alpha beta gamma",
    "gamma delta alpha epsilon",
    "beta! Beta? zeta",
    "the bees, the bees",
]
CAPS = (1000, 4, 1)
PREFIXES = ("", "z", "b", "don'", "q")


def main(out: Path) -> None:
    """Write capture.json into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    vocabulary = Vocabulary(tuple(WORDS))
    dictionaries = []
    for cap in CAPS:
        for end in range(1, len(SENTENCES) + 1):
            learned = learn_dictionary(SENTENCES[:end], vocabulary, cap)
            dictionaries.append({"cap": cap, "sentences": end, "entries": learned.entries(), "words": learned.words()})
    rng = np.random.default_rng(52)
    learned = learn_dictionary(SENTENCES, vocabulary).words()
    offers = []
    for case in range(12):
        probabilities = rng.dirichlet(np.ones(len(WORDS))).astype(np.float32)
        if case % 3 == 0:
            probabilities[[1, 5, 6]] = probabilities[5]  # ties: <oov>'s probability equals two words'
        for prefix in PREFIXES:
            offered = suggestions(probabilities, vocabulary.words, learned, prefix, 3)
            offers.append({"probabilities": probabilities.tolist(), "prefix": prefix, "offered": offered})
    document = {
        "words": WORDS,
        "sentences": SENTENCES,
        "dictionaries": dictionaries,
        "learned": learned,
        "offers": offers,
        "motion": motion_cases(rng),
    }
    (out / "capture.json").write_text(json.dumps(document, ensure_ascii=False, indent=1))


def motion_cases(rng: np.random.Generator) -> list[dict]:
    """Readings of a phone's accelerometer (m/s²) and gyroscope (rad/s) on its x, y, z axes, and the windows two
    sensor bundles make of them: HAPT's channels and units, and a bundle of its own order and units."""
    steps = 8
    acceleration = rng.normal([0.0, 9.8, 0.0], 3.0, (steps, 3))
    rotation = rng.normal(0.0, 1.0, (steps, 3))
    kinds = [
        SensorKind.of(("acc-x", "acc-y", "acc-z", "gyro-x", "gyro-y", "gyro-z"), steps, 50.0),
        SensorKind.of(("gyro_z", "Accel-X", "gyroscope y"), steps, 25.0, units=("deg/s", "m/s^2", "rad/s")),
    ]
    return [
        {
            "entry": kind.entry(),
            "acceleration": acceleration.tolist(),
            "rotation": rotation.tolist(),
            "channels": kind.from_motion(acceleration, rotation).tolist(),
        }
        for kind in kinds
    ]


if __name__ == "__main__":
    main(Path(sys.argv[1]))
