"""The page as a keyboard and a motion recorder that learn, in a real chromium against `edgepfl serve` (issue 52).

The real input paths: Playwright types with its keyboard and taps the chips; the phone's motion comes from
Chromium's sensor emulation over the DevTools protocol (Emulation.setSensorOverrideReadings), which feeds
`devicemotion` as a phone's sensors do. Each test records every request and checks that no body, and nothing the
server stores, holds a byte of what was typed or recorded.
"""

from __future__ import annotations

import csv
import json
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import test_web_browser
from server_helpers import LiveServer
from test_web_browser import PHONE, SECRET, said, wait

from edgepfl.data import load_device_data
from edgepfl.device_runtime.contract import device_contract
from edgepfl.manifest import load_manifest
from edgepfl.server.store import Store
from edgepfl.server.web import CHROMIUM_ARGS

pytestmark = pytest.mark.browser
chromium = test_web_browser.chromium  # the fixture: Debian's chromium, installed where it may be

TEXT_CORPUS = "to be or not to be\nthat is the question\nwhether tis nobler in the mind to suffer\n"
TYPED = ["zorblax is here.", "привет zorblax."]  # typed after the first sentence, whose chip word the model picks
OPTIONS = ("--min-clients", "1", "--rounds", "1", "--poll-interval", "0.3", "--lr", "0.05", "--batch-size", "8")


def hold_tasks(context) -> list:
    """Hold the page's task requests (no round begins) until `release_tasks`; returns the held routes."""
    held: list = []
    context.route("**/v1/task", lambda route: held.append(route))
    return held


def release_tasks(context, held: list) -> None:
    context.unroute("**/v1/task")
    for route in held:
        try:
            route.continue_()
        except Exception:  # let through when the route went, or of a page since reloaded
            pass


@contextmanager
def served_phone(chromium, bundle: Path, tmp_path: Path, epochs: int, permissions: tuple[str, ...] = ()):
    """`edgepfl serve` of `bundle` (one device, one round of `epochs`) and a phone's browser context in chromium,
    every request body it sends recorded: (the server, the context, the bodies, the server's state folder)."""
    from playwright.sync_api import sync_playwright

    (tmp_path / "secret").write_text(SECRET)
    options = (*OPTIONS, "--epochs", str(epochs), "--enroll-secret-file", str(tmp_path / "secret"))
    state = tmp_path / "server"
    with LiveServer(bundle, state, *options) as server, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(chromium), args=list(CHROMIUM_ARGS))
        try:
            phone = browser.new_context(**PHONE, accept_downloads=True)
            if permissions:
                phone.grant_permissions(list(permissions), origin=server.url)
            bodies: list[bytes] = []
            phone.on("request", lambda request: bodies.append(request.post_data_buffer or b""))
            yield server, phone, bodies, state
        finally:
            browser.close()


def check_nothing_leaves(bodies: list[bytes], state: Path, secrets: list[bytes]) -> None:
    """No request body and no blob the server stores holds any of `secrets` (only base tensors travel)."""
    store = Store(state)
    try:
        blobs = [store.blobs.read(u.blob_sha) for r in store.rounds() for u in store.updates(r.round_id)]
    finally:
        store.close()
    assert blobs, "the round's upload is stored"
    for secret in secrets:
        assert not any(secret in body for body in bodies + blobs), secret[:40]


def test_a_keyboard_that_learns_keeps_what_is_typed_on_the_phone(chromium, tmp_path: Path) -> None:
    """Typing in the writing box: chips from the device's model (the untrained one's are Python's), a tap writes one,
    finished sentences stay through a reload, a word typed twice is suggested, another script gets one line; the
    .txt is the second way in; the round trains on what the phone holds (Save my data, read by Python, gives its
    sample count); nothing typed leaves the phone; the store keeps its cap and says so; Forget erases it all."""
    from edgepfl.device_runtime.predict import next_words, open_device_model
    from edgepfl.export.bundle import ExportOptions, export_target
    from edgepfl.export.sequence_options import SequenceOptions
    from edgepfl.export.textmodels import sequence_target

    (tmp_path / "corpus.txt").write_text(TEXT_CORPUS, encoding="utf-8")
    sequence = SequenceOptions(vocab=tmp_path / "corpus.txt", seq_len=4, layers=1)
    target = sequence_target("transformer", sequence, seed=0, width=0.25)
    export = ExportOptions(engines=("portable",), force=True, portable_batch=8, frozen_variants=False)
    bundle = tmp_path / "bundle"
    export_target(target, 1, bundle, export, notice=lambda _: None)
    model = open_device_model(bundle, tmp_path / "untrained", "portable")
    first = [word for _, word, _ in next_words(model.engine, "", 3)]
    (tmp_path / "notes.txt").write_text(TEXT_CORPUS * 4, encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (tmp_path / "many.txt").write_text("".join(f"line {i} of many\n" for i in range(2001)), encoding="utf-8")
    with served_phone(chromium, bundle, tmp_path, epochs=1) as (server, phone, bodies, state):
        held = hold_tasks(phone)
        page = phone.new_page()
        page.goto(f"{server.url}/device/#enroll={SECRET}")
        wait(page, "body[data-stage=examples]")
        assert page.is_visible("#keyboard") and page.is_visible("#recording") and not page.is_visible("#examples")
        wait(page, "#chips[data-typed='']")  # the words a sentence starts with, by the untrained model
        assert json.loads(page.get_attribute("#chips", "data-words")) == first

        page.click("#writing")
        page.keyboard.type("to be ")
        wait(page, "#chips[data-typed='to be ']")
        words = json.loads(page.get_attribute("#chips", "data-words"))
        tapped = next(i for i, word in enumerate(words) if word.isalpha())
        page.click(f"#chips li:nth-child({tapped + 1}) button")  # a tap writes the word and a space
        assert page.input_value("#writing") == f"to be {words[tapped]} "
        page.keyboard.type("or not. ")  # a full stop and a space finish the sentence
        sentences = [f"to be {words[tapped]} or not."]
        for sentence in TYPED:
            page.keyboard.type(sentence)
            page.keyboard.press("Enter")  # Enter sends it; the box empties
            sentences.append(sentence)
            wait(page, f"#recording-held[data-records='{len(sentences)}']")
        assert page.input_value("#writing") == ""
        # "привет" is in a script the vocabulary has no word in: one line, and the sentence is kept
        assert "no words written in Cyrillic script" in page.text_content("#problem-text"), said(page)
        page.keyboard.type("zo")  # zorblax, typed twice, is the person's own word now
        wait(page, "#chips[data-typed='zo']")
        assert "zorblax" in json.loads(page.get_attribute("#chips", "data-learned"))
        page.keyboard.press("Control+A")
        page.keyboard.press("Backspace")

        page.reload()  # what was typed survives a reload, with the keyboard's measure
        wait(page, "#recording-held[data-records='3']")
        assert page.text_content("#typed-measure") == "Suggestions typed 1 of the 10 words you wrote here."
        assert page.text_content("#recording-held").startswith("3 sentences on this phone")
        assert "never sent" in page.text_content("#recording-held")
        page.set_input_files("#recording-file", str(tmp_path / "latin1.txt"))
        wait(page, "#problem:not([hidden])")
        assert page.text_content("#problem-text") == "The file latin1.txt is not UTF-8 text", said(page)
        page.set_input_files("#recording-file", str(tmp_path / "notes.txt"))  # the second way in
        wait(page, "#recording-held[data-records='15']")
        with page.expect_download() as saving:
            page.click("#save-data")
        saved = tmp_path / "my-text.txt"
        saving.value.save_as(saved)
        assert saved.read_text(encoding="utf-8").splitlines() == sentences + TEXT_CORPUS.splitlines() * 4
        contract = device_contract()["device"]
        python = load_device_data(
            saved, load_manifest(bundle), contract["val_fraction"], contract["split_seed"], bundle
        )

        release_tasks(phone, held)  # the round trains on what the phone holds
        wait(page, "body[data-stage=done]")
        assert page.get_attribute("#history tr[data-round='1']", "data-upload") == "delivered", said(page)
        store = Store(state)
        try:
            (upload,) = store.updates(1)
            assert upload.num_samples == python.num_train
        finally:
            store.close()
        typed = [s.encode("utf-8") for s in sentences] + [b"zorblax", "привет".encode()]
        check_nothing_leaves(bodies, state, typed)

        page.set_input_files("#recording-file", str(tmp_path / "many.txt"))  # more than the phone keeps
        wait(page, "#recording-held[data-records='2000']")
        assert "The oldest 16 sentences went: this phone keeps the newest 2000." in page.text_content("#status")
        page.once("dialog", lambda dialog: dialog.accept())
        page.click("#recording-forget")
        wait(page, "#recording-held[data-records='0']")
        page.reload()
        wait(page, "#recording-held[data-records='0']")
        assert page.text_content("#typed-measure") == ""


ACTIVITIES = ("still", "shake")
# what the phone's sensors read in each: acceleration with gravity (m/s², which Chromium coarsens to 0.1) and rotation
# (rad/s, which it gives as deg/s coarsened to 0.1), on the phone's x, y, z axes
MOTION = {"still": ((0.0, 9.8, 0.0), (0.0, 0.0, 0.0)), "shake": ((4.0, 2.0, 9.0), (0.1, 0.2, 0.3))}
WINDOWS_EACH = 12


def feel(devtools, activity: str) -> None:
    """The phone's sensors read `activity`'s motion from now on (Chromium's emulation repeats it at 60 Hz)."""
    acceleration, rotation = MOTION[activity]
    for sensor, xyz in (("accelerometer", acceleration), ("gyroscope", rotation), ("linear-acceleration", (0, 0, 0))):
        reading = {"xyz": dict(zip("xyz", xyz))}
        devtools.send("Emulation.setSensorOverrideReadings", {"type": sensor, "reading": reading})


def sensors(devtools, enabled: bool, *types: str) -> None:
    for sensor in types or ("accelerometer", "gyroscope", "linear-acceleration"):
        devtools.send("Emulation.setSensorOverrideEnabled", {"enabled": enabled, "type": sensor})


def record(page, devtools, label: int, windows: int) -> None:
    """Record `windows` windows of activity `label`: pick it, tap Record (the page asks for the sensors, which
    Chromium then samples at 60 Hz), wait for them, tap Stop."""
    page.select_option("#activity", str(label))
    page.click("#record")
    deadline = time.monotonic() + 30
    while (
        devtools.send("Emulation.getOverriddenSensorInformation", {"type": "accelerometer"})[
            "requestedSamplingFrequency"
        ]
        <= 0
    ):
        assert time.monotonic() < deadline, "the page never asked for the accelerometer"
        time.sleep(0.05)
    wait_windows(page, label, windows)
    page.click("#record")


def wait_windows(page, label: int, windows: int, timeout: float = 60) -> None:
    """Wait until the page holds `windows` windows of activity `label` (polled: the page's CSP allows no eval)."""
    deadline = time.monotonic() + timeout
    while int(page.get_attribute(f"#activities li[data-label='{label}']", "data-count")) < windows:
        assert time.monotonic() < deadline, f"never {windows} windows of activity {label}: {said(page)}"
        time.sleep(0.1)


def test_a_motion_recorder_learns_two_activities_and_names_the_one_live(chromium, tmp_path: Path) -> None:
    """Recording through Chromium's sensor emulation: two activities of distinct motion, windows of the bundle's
    length in its units (g, rad/s: acceleration / 9.80665; Chromium's rotation axes pinned), a too-short recording
    and a sensor that stops each get one line and lose nothing; Save my data reads back in Python; a round trains on
    the windows and the live Try it names the activity the phone is in; no reading leaves the phone."""
    from edgepfl.datasets.har import HAR_CHANNELS
    from edgepfl.export.bundle import ExportOptions, export_target
    from edgepfl.export.textmodels import sensor_target

    target = sensor_target("har-cnn", HAR_CHANNELS, seed=0, window=16, rate_hz=50, num_classes=len(ACTIVITIES))
    export = ExportOptions(
        engines=("portable",), force=True, portable_batch=8, frozen_variants=False, class_names=ACTIVITIES
    )
    bundle = tmp_path / "bundle"
    export_target(target, 1, bundle, export, notice=lambda _: None)
    manifest = load_manifest(bundle)
    sensing = ("accelerometer", "gyroscope")
    with served_phone(chromium, bundle, tmp_path, epochs=10, permissions=sensing) as (server, phone, bodies, state):
        held = hold_tasks(phone)
        page = phone.new_page()
        devtools = phone.new_cdp_session(page)
        sensors(devtools, True)
        page.goto(f"{server.url}/device/#enroll={SECRET}")
        wait(page, "body[data-stage=examples]")
        assert page.is_visible("#recorder") and page.is_visible("#recording")
        assert page.locator("#activity option").all_inner_texts() == list(ACTIVITIES)

        page.click("#record")  # tapped and stopped at once: shorter than a window, nothing kept, one line
        page.click("#record")
        assert "shorter than one window (0.3 s): nothing was kept" in page.text_content("#recorder-line")
        for label, activity in enumerate(ACTIVITIES):
            feel(devtools, activity)
            record(page, devtools, label, WINDOWS_EACH)
            assert page.text_content("#recorder-line").startswith("Kept "), page.text_content("#recorder-line")
            if not label:  # an activity with no windows beside one with some: said so
                assert "none yet: the model cannot learn it" in page.text_content("#activities li[data-label='1']")
        assert page.get_attribute("body", "data-motion") == "event"  # DeviceMotionEvent, as on a phone
        # the accelerometer stops sending mid-recording: one line, and the windows cut so far stay
        feel(devtools, "still")
        page.select_option("#activity", "0")
        page.click("#record")
        wait_windows(page, 0, WINDOWS_EACH + 1)
        sensors(devtools, False, "accelerometer")
        wait(page, "#problem:not([hidden])")
        assert page.text_content("#problem-text") == "The phone's accelerometer stopped sending readings for 1.5 s"
        held_windows = int(page.get_attribute("#recording-held", "data-records"))
        assert held_windows > 2 * WINDOWS_EACH and page.text_content("#record") == "Record"
        sensors(devtools, True, "accelerometer")

        with page.expect_download() as saving:
            page.click("#save-data")
        saved = tmp_path / "my-recordings.csv"
        saving.value.save_as(saved)
        x, y, channels = manifest.kind.read_csv(saved, manifest.class_labels)  # Python's reader: windows, labels
        assert channels == list(HAR_CHANNELS) and len(y) == held_windows and x.shape == (held_windows, 6, 16)
        still, shake = x[y == 0], x[y == 1]
        in_g = {name: np.float32(np.asarray(MOTION[name][0]) * (1 / 9.80665))[:, None] for name in ACTIVITIES}
        assert len(shake) >= WINDOWS_EACH and np.all(still[:, :3] == in_g["still"]) and np.all(still[:, 3:] == 0)
        assert np.all(shake[:, :3] == in_g["shake"])
        # Chromium's rotation axes: the gyroscope's x, y, z (rad/s) come back as gyro-x, -y, -z, coarsened to 0.1°/s
        assert np.allclose(shake[:, 3:], np.float32([[0.1], [0.2], [0.3]]), rtol=0, atol=0.002), shake[0, 3:, 0]

        release_tasks(phone, held)  # a round trains on the windows held
        wait(page, "body[data-stage=done]")
        assert page.get_attribute("#history tr[data-round='1']", "data-upload") == "delivered", said(page)
        # it trained in the page's own worker (remote.js), off the thread the readings come to
        assert [w.url.rsplit("/", 1)[1] for w in page.workers].count("runtime_worker.js") == 1
        page.click("#watch")  # live: the activity of the last window, while the phone moves
        for label, activity in reversed(list(enumerate(ACTIVITIES))):
            feel(devtools, activity)
            wait(page, f"#live-activity[data-label='{label}']", timeout=30_000)
        with saved.open(newline="") as stream:
            rows = list(csv.reader(stream))
        first = x[0].astype(np.float32)
        secrets = [saved.read_bytes()[:200], first.tobytes(), ",".join(rows[1][2:]).encode()]
        check_nothing_leaves(bodies, state, secrets)
