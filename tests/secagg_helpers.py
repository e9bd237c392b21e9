"""Helpers for the secure-aggregation tests: seeded randomness and an in-process round with dropouts."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import numpy as np

from edgepfl.secagg import ClientSession, KeyBook, SecAggConfig, ServerSession, VectorLayout, quantize_delta
from edgepfl.secagg.messages import from_json, to_json

SHAPES = {"conv.weight": (4, 3, 3), "conv.bias": (4,), "fc.weight": (3, 7)}
CONTEXT = "run-test/round-3"


def seeded_bytes(seed: int) -> Callable[[int], bytes]:
    """A deterministic stand-in for secrets.token_bytes."""
    generator = np.random.default_rng(seed)
    return lambda count: generator.bytes(count)


def device_ids(n: int) -> list[str]:
    return [f"phone-{i:03d}" for i in range(n)]


def sample_delta(seed: int, scale: float = 0.05, shapes: dict | None = None) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: (rng.normal(size=shape) * scale).astype(np.float32) for name, shape in (shapes or SHAPES).items()}


@dataclass
class Round:
    """One round driven in-process: every message goes through JSON, sessions optionally through JSON too."""

    n: int
    config: SecAggConfig
    roundtrip: bool = False  # save and restore every session after every step
    shapes: dict = field(default_factory=lambda: dict(SHAPES))
    server: ServerSession = field(init=False)
    clients: dict[str, ClientSession] = field(init=False)
    vectors: dict[str, np.ndarray] = field(default_factory=dict)
    weights: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        layout = VectorLayout.of(self.shapes)
        self.server = ServerSession.start(CONTEXT, self.config, layout.size, randomness=bytes(range(32)))
        self.clients = {d: ClientSession.start(d, CONTEXT, seeded_bytes(i)) for i, d in enumerate(device_ids(self.n))}

    def run(
        self, skip_shares: Collection[str] = (), skip_upload: Collection[str] = (), skip_reveal: Collection[str] = ()
    ) -> np.ndarray:
        """All four steps; devices in a skip set drop out at that step (and stay out)."""
        book = self.advertise()
        self.share(book, skip_shares)
        self.upload(book, set(skip_shares) | set(skip_upload))
        request = self.server.close_inputs()
        self.checkpoint()
        for device in request.survivors:
            if device not in skip_reveal:
                reply = self.clients[device].receive_unmask(_wire(request))
                self.server.receive_unmask(_wire(reply))
                self.checkpoint()
        return self.server.finish()

    def advertise(self) -> KeyBook:
        for device in self.clients:
            self.server.receive_advert(_wire(self.clients[device].advert()))
        book = self.server.close_keys()
        self.checkpoint()
        return _wire(book)

    def share(self, book: KeyBook, skip: Collection[str]) -> None:
        for i, device in enumerate(list(self.clients)):  # checkpoints replace the sessions: look each up anew
            bundle = self.clients[device].receive_book(book, seeded_bytes(1000 + i))
            self.checkpoint()
            if device not in skip:
                self.server.receive_shares(_wire(bundle))
                self.checkpoint()

    def upload(self, book: KeyBook, skip: Collection[str]) -> None:
        inboxes = self.server.close_shares()
        self.checkpoint()
        for i, (device, inbox) in enumerate(inboxes.items()):
            if device in skip:
                continue
            self.weights[device] = 1 + 37 * i % 200
            self.vectors[device] = quantize_delta(
                sample_delta(i, shapes=self.shapes), self.weights[device], book, np.random.default_rng([7, i])
            )
            self.server.receive_masked(_wire(self.clients[device].receive_inbox(_wire(inbox), self.vectors[device])))
            self.checkpoint()

    def plain_sum(self, devices: Collection[str]) -> np.ndarray:
        """The sum of these devices' quantized vectors, mod 2^b: what the secure sum must equal."""
        total = sum(self.vectors[d].astype(np.int64) for d in devices)
        return (total % (1 << self.server.book.plan.bits)).astype(np.uint32)

    def checkpoint(self) -> None:
        if self.roundtrip:
            self.server = ServerSession.from_json(self.server.to_json())
            self.clients = {d: ClientSession.from_json(c.to_json()) for d, c in self.clients.items()}


def _wire(message):
    """A message as the other side gets it: through its JSON."""
    return from_json(to_json(message), type(message))
