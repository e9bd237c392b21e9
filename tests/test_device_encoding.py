"""The device's encoded delta uploads: error feedback kept in its state folder survives kills, never counted twice."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from test_device_runtime import ScriptedServer, local_data, mlp_bundle  # noqa: F401 (mlp_bundle: a fixture)

from edgepfl.device_runtime import round as device_round
from edgepfl.device_runtime.client import ServerClient
from edgepfl.device_runtime.engine import open_engine
from edgepfl.device_runtime.runner import DeviceOptions, run_device
from edgepfl.device_runtime.state import StateFolder
from edgepfl.encoding import Encoding, decode_payload, residual_before
from edgepfl.privacy import delta_norm
from edgepfl.protocol import RoundSettings, Task, UploadMeta
from edgepfl.wire import decode_metadata, encode_tensors


class Killed(BaseException):
    """The process dies here (kill -9): nothing after it runs, not even an `except Exception`."""


class EncodingServer(ScriptedServer):
    """A ScriptedServer whose rounds ask for `settings` (an upload encoding, a clip norm, a download encoding)."""

    def __init__(self, *args, settings: RoundSettings, **kwargs):
        super().__init__(*args, **kwargs)
        self.settings = settings
        self.kill_upload_of: int | None = None  # the device dies while sending this round's upload

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/task" and self.round_id <= self.rounds:
            task = Task(
                "train",
                self.manifest.base_layout_hash,
                self.round_id,
                self.settings,
                f"/v1/rounds/{self.round_id}/base",
            )
            return httpx.Response(200, json=task.to_json())
        if path.endswith("/base") and self.round_id <= self.rounds and self.settings.download_encoding == "fp16":
            payload = encode_tensors({k: v.astype(np.float16) for k, v in self.base.items()}, {"encoding": "fp16"})
            return httpx.Response(200, content=payload)
        if path == f"/v1/rounds/{self.kill_upload_of}/update":
            self.kill_upload_of = None
            raise Killed()
        return super().handle(request)


def device(mlp_bundle, folder, server):  # noqa: F811
    engine = open_engine(mlp_bundle, "portable")
    state = StateFolder(folder, engine.manifest, engine.name)
    client = ServerClient("http://device.test", "t", transport=server.transport(), sleep=pytest.fail)
    return engine, state, client


def test_a_kill_between_training_and_upload_neither_loses_nor_doubles_the_residual(mlp_bundle, tmp_path, monkeypatch):  # noqa: F811
    engine = open_engine(mlp_bundle, "portable")
    settings = RoundSettings(batch_size=16, lr=0.1, upload_encoding="int8-block64-sr")
    server = EncodingServer(engine.manifest, engine.tensors_by_role("base"), rounds=5, settings=settings)
    data = local_data(engine.manifest)
    encoded = []  # (round, trained - received) of every encoding the device made, committed or not
    honest_body = device_round.upload_body

    def recording(trained, received, round_settings, meta, residuals, round_id, seed):
        encoded.append((round_id, {name: trained[name] - received[name] for name in trained}))
        return honest_body(trained, received, round_settings, meta, residuals, round_id, seed)

    monkeypatch.setattr(device_round, "upload_body", recording)
    honest_commit = StateFolder.commit

    def killed_in_commit(self, tensors, record, round_id=None, upload_payload=None):
        if round_id == 2:  # round 2 is encoded (its residual saved), then the device dies before the commit
            monkeypatch.setattr(device_round, "drop_residual", lambda *args: None)  # kill -9 runs no handler
            raise Killed()
        return honest_commit(self, tensors, record, round_id, upload_payload)

    monkeypatch.setattr(StateFolder, "commit", killed_in_commit)
    folder = tmp_path / "state"
    _, state, client = device(mlp_bundle, folder, server)
    with pytest.raises(Killed):
        run_device(engine, data, state, client, DeviceOptions(seed=3), sleep=pytest.fail)
    assert [r for r, _ in server.uploads] == [1] and (state.residuals / "residual-00000002.safetensors").is_file()
    state.close()
    monkeypatch.undo()
    monkeypatch.setattr(device_round, "upload_body", recording)
    encoded.pop()  # round 2's first encoding was never committed: it is trained and encoded again

    server.kill_upload_of = 3  # round 3 is committed with its upload pending, then the device dies sending it
    engine, state, client = device(mlp_bundle, folder, server)
    assert not (state.residuals / "residual-00000002.safetensors").exists()  # dropped at start: never committed
    with pytest.raises(Killed):
        run_device(engine, data, state, client, DeviceOptions(seed=3), sleep=pytest.fail)
    assert state.state.pending_upload is not None and state.state.pending_upload.round_id == 3
    state.close()

    engine, state, client = device(mlp_bundle, folder, server)
    summary = run_device(engine, data, state, client, DeviceOptions(seed=3), sleep=pytest.fail)
    assert summary.finished
    assert [r for r, _ in server.uploads] == [1, 2, 3, 4, 5]  # each round uploaded once
    assert [r for r, _ in encoded] == [1, 2, 3, 4, 5]  # round 3 was sent from the saved body, not encoded again
    encoding = Encoding.parse(settings.upload_encoding)
    sent = [decode_payload(body, encoding) for _, body in server.uploads]
    assert all(decode_metadata(body)["encoding"] == "int8-block64-sr" for _, body in server.uploads)
    UploadMeta.from_metadata(decode_metadata(server.uploads[0][1]))
    final_residual = residual_before(state.residuals, 6)
    for name in sent[0]:
        true_sum = sum(delta[name].astype(np.float64) for _, delta in encoded)
        sent_sum = sum(upload[name].astype(np.float64) for upload in sent)
        # error feedback: what was sent over the rounds is what was trained, less the residual still owed
        np.testing.assert_allclose(sent_sum + final_residual[name], true_sum, rtol=1e-5, atol=1e-5)
        assert np.abs(final_residual[name]).max() <= np.abs(true_sum).max() / 10  # and what is owed is small
    fp32_bytes = sum(value.nbytes for value in engine.tensors_by_role("base").values())
    assert all(len(body) < 0.3 * fp32_bytes for _, body in server.uploads)


def test_the_device_clips_its_delta_to_the_rounds_clip_norm_and_decodes_an_fp16_base(mlp_bundle, tmp_path):  # noqa: F811
    engine = open_engine(mlp_bundle, "portable")
    settings = RoundSettings(batch_size=16, lr=0.5, clip_norm=0.05, download_encoding="fp16")
    server = EncodingServer(engine.manifest, engine.tensors_by_role("base"), rounds=2, settings=settings)
    engine, state, client = device(mlp_bundle, tmp_path / "state", server)
    summary = run_device(engine, local_data(engine.manifest), state, client, DeviceOptions(), sleep=pytest.fail)
    assert summary.finished and len(server.uploads) == 2
    for _, body in server.uploads:
        delta = decode_payload(body, Encoding.parse("fp32"))  # DP without an encoding: an fp32 delta
        assert delta_norm(delta) <= 0.05 * (1 + 1e-6)
        assert delta_norm(delta) > 0.05 * 0.99  # lr 0.5 moves the base much further: clipped, not merely small
