"""A simulated secure round: the clients that trained take the protocol's steps against the in-process round
engine, in lockstep (every client's advert, then the engine's tick closes the step; the shares; the masked
vectors; the reveals), with a device's own pieces: a `ClientSession` and `device_runtime.secure_round.ring_vector`
on the upload body the device round saved, which never reaches the engine. Every message goes through the
engine's secure steps (`server/secure/steps.py`), the ones the HTTP routes call, so it is checked as a served one.

Seeded: the clients' keys, shares and self masks come from their seed and the round, and the engine's graph
randomness and run id from --seed (`SecureRounds.seeded`), so a simulated run is reproducible (a simulation is not
a deployment; `edgepfl serve` draws them from the OS).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np

from edgepfl.device_runtime.secure_round import ring_vector
from edgepfl.secagg import ClientSession, to_json
from edgepfl.server.secure.steps import steps_of

if TYPE_CHECKING:
    from edgepfl.server.engine import RoundEngine


def secure_steps(
    server: RoundEngine, round_id: int, uploads: Mapping[str, bytes], seeds: Mapping[str, int]
) -> tuple[int, int]:
    """Every client of `uploads` (its saved upload body) takes the round's steps; (bytes up, bytes down) in all."""
    sent, received = 0, 0
    steps = steps_of(server)
    assert steps is not None, "a secure run's engine runs secure rounds"

    def send(name: str, kind: str, body: bytes) -> None:
        nonlocal sent
        sent += len(body)
        steps.message(name, round_id, kind, body)

    sessions: dict[str, ClientSession] = {}
    for name in uploads:
        task = steps.task(name, round_id)
        assert task is not None, "a secure run's rounds are secure"
        sessions[name] = ClientSession.start(task.device, task.context, _seeded(seeds[name], round_id, 0))
        send(name, "advert", to_json(sessions[name].advert()).encode())
    server.tick()
    for name, session in sessions.items():
        book = steps.book(name, round_id)
        assert book is not None, "every client advertised: the keys step is closed"
        received += len(to_json(book))
        send(name, "shares", to_json(session.receive_book(book, _seeded(seeds[name], round_id, 1))).encode())
    server.tick()
    for name, session in sessions.items():
        inbox = steps.inbox(name, round_id)
        assert inbox is not None, "every client shared: the shares step is closed"
        received += len(to_json(inbox))
        vector = ring_vector(uploads[name], session.book, seeds[name], round_id)
        send(name, "masked", session.receive_inbox(inbox, vector).to_bytes())
    server.tick()
    for name, session in sessions.items():
        request = steps.request(name, round_id)
        assert request is not None, "every client uploaded: the inputs step is closed"
        received += len(to_json(request))
        send(name, "reveal", to_json(session.receive_unmask(request)).encode())
    return sent, received


def _seeded(seed: int, round_id: int, stream: int) -> Callable[[int], bytes]:
    """A stand-in for secrets.token_bytes drawn from (seed, round, stream)."""
    generator = np.random.default_rng([seed, round_id, stream])
    return lambda count: generator.bytes(count)
