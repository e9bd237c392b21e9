"""pFedLA (Ma et al.): one hypernetwork per client learns how much of every other client each tensor takes.

For client i the server holds an embedding eᵢ (dim 100) and a hypernetwork (3 × Linear 100 + ReLU, then
one head per shared tensor with N outputs); αᵢˡ = ReLU(headˡ)/sum (a zero sum falls back to i's own
one-hot). A sampled client gets θ̄ᵢˡ = Σⱼ αᵢˡʲ θⱼˡ over every client's latest tensors; after training it
uploads θᵢ, the server stores it and moves eᵢ and the hypernetwork by SGD along the vector-Jacobian
product of θ̄ᵢ with −Δθᵢ = θ̄ᵢ − θᵢ. Only the shared tensors are mixed, so with kp > 0 the personal
blocks never leave the device. The slots of the N clients are given to devices in order of first sight.

torch is imported lazily: only this strategy needs it, and only on the server.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, Field

from edgepfl.errors import StateError, UsageError
from edgepfl.manifest import TensorSpec
from edgepfl.options import RENAMED, titled
from edgepfl.protocol import RoundSettings
from edgepfl.server.strategy import AcceptedUpdate, BaseTensors, RoundPlan, Strategy, cast_like
from edgepfl.wire import decode_metadata, decode_tensors, encode_tensors

EMBEDDING_DIM = 100
HIDDEN_DIM = 100
STATE_FORMAT = "pfedla/1"


class HypernetworkOptions(BaseModel):
    """pFedLA's hypernetworks (pfedla, heurpfedla)"""

    model_config = titled("pFedLA")

    hn_lr: Annotated[
        float, Field(gt=0.0, allow_inf_nan=False, description="pfedla, heurpfedla: hypernetwork learning rate")
    ] = 5e-3


class PFedLAOptions(HypernetworkOptions):
    """pfedla's (and heurpfedla's) own options."""

    pfedla_clients: Annotated[
        int,
        Field(
            ge=0,
            description="pfedla: number of clients N the hypernetworks mix (0: not set)",
            json_schema_extra={RENAMED: ("--clients",)},
            examples=[10],
        ),
    ] = 0


class PFedLA(Strategy):
    """Layer-wise aggregation by per-client hypernetworks; every sampled device gets its own base."""

    name = "pfedla"
    Options = PFedLAOptions
    cohort_option = "pfedla_clients"  # its hypernetworks mix a fixed number of client places
    streaming = False  # keeps every client's latest tensors: O(clients x model)

    def __init__(self, specs: list[TensorSpec], options: PFedLAOptions, settings: RoundSettings, seed: int = 0):
        super().__init__(specs, options, settings, seed)
        if options.pfedla_clients < 1:
            raise UsageError("pfedla needs the number of clients its hypernetworks mix", "pass --pfedla-clients N")
        try:
            import torch  # noqa: F401 (refused at start, not at the first round)
        except ImportError:
            raise UsageError(f"strategy {self.name} needs torch on the server", "pip install torch") from None
        self.num_clients = options.pfedla_clients
        self.mixed = [spec.name for spec in specs if np.dtype(spec.dtype).kind == "f"]
        if not self.mixed:  # every block personal: the hypernetworks would mix nothing (issue 18's --kp 2 on mlp)
            raise UsageError(
                f"{self.name} mixes the shared tensors, and this model shares none (every block is personal)",
                "use a smaller --kp, e.g. --kp 0 for the paper's pFedLA",
            )
        self.slots: dict[str, int] = {}  # device -> slot, in order of first sight
        self.client_tensors: list[dict[str, np.ndarray]] | None = None  # per slot, float64; set from round 1's base
        self.hypernets: dict[int, Any] = {}  # slot -> HyperNetwork, made when the slot is first used

    # the hooks the engine calls

    def configure_round(
        self, round_id: int, sampled: Sequence[str], global_base: Mapping[str, np.ndarray]
    ) -> dict[str, RoundPlan]:
        """θ̄ᵢ for each sampled device, mixed tensor by tensor; a newcomer takes the next slot in `sampled` order."""
        self._ensure_started(global_base)
        settings = self.settings(round_id)
        return {device: (settings, self.personalized_base(self.slot_of(device))) for device in sampled}

    def evaluation_base(self, device: str, global_base: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
        """θ̄ᵢ of a device that holds a slot; the global base (the clients' mean) for one never sampled."""
        if device not in self.slots or self.client_tensors is None:
            return global_base
        return self.personalized_base(self.slots[device])

    def personalized_base(self, slot: int) -> BaseTensors:
        """θ̄ᵢ of client `slot`, cast to the manifest dtypes (reads the hypernetworks, changes nothing)."""
        return cast_like(self._mix(slot, self.mixing_weights(slot)), self.specs)

    def aggregate(
        self, round_id: int, updates: Iterable[AcceptedUpdate], global_base: Mapping[str, np.ndarray]
    ) -> BaseTensors:
        """Update each sampled client's hypernetwork, store its new tensors; returns the clients' mean (for status)."""
        self._ensure_started(global_base)
        received: list[tuple[int, dict[str, np.ndarray]]] = []
        for update in updates:
            slot = self.slot_of(update.device)
            # a tensor the device kept back (HeurpFedLA) is not uploaded: the server's copy stays as it was
            trained = {
                name: np.asarray(update.base_tensors[name], dtype=np.float64)
                for name in self.names
                if name in update.base_tensors
            }
            # θ̄ᵢ is recomputed, not stored: the hypernetworks and tensors are unchanged since the round opened
            mixed = self._mix(slot, self.mixing_weights(slot))
            direction = {name: mixed[name] - trained[name] for name in self.mixed if name in trained}  # −Δθᵢ
            self.hypernetwork_step(slot, direction)
            received.append((slot, trained))
        if not received:
            raise ValueError(f"round {round_id} has no updates to aggregate")
        for slot, trained in received:  # after all steps: every θ̄ᵢ above saw the tensors the devices were sent
            self.client_tensors[slot].update(trained)
        mean = {name: np.mean([tensors[name] for tensors in self.client_tensors], axis=0) for name in self.names}
        return cast_like(mean, self.specs)

    # the method

    @property
    def names(self) -> list[str]:
        """Every shared tensor's name."""
        return [spec.name for spec in self.specs]

    def slot_of(self, device: str) -> int:
        """The device's slot among the N clients; a new device takes the next free one."""
        if device not in self.slots:
            self.check_device(device)
            self.slots[device] = len(self.slots)
        return self.slots[device]

    def admissible(self, devices: Sequence[str]) -> list[str]:
        """The devices that hold a slot, and as many newcomers as there are free slots (in the given order)."""
        free = self.num_clients - len(self.slots)
        newcomers = [d for d in devices if d not in self.slots][: max(free, 0)]
        return [d for d in devices if d in self.slots or d in newcomers]

    def check_device(self, device: str) -> None:
        """A device without a slot can never take part once all N slots belong to other devices."""
        if device not in self.slots and len(self.slots) >= self.num_clients:
            raise UsageError(
                f"this server's {self.name} mixes {self.num_clients} clients and all {self.num_clients} places "
                f"belong to other devices, so device {device!r} cannot join",
                "run this device against a server with a new --state and --pfedla-clients counting every device",
            )

    def hypernetwork(self, slot: int, keep: bool = True) -> Any:
        """Client `slot`'s embedding and hypernetwork (seeded by the options' seed and the slot).

        A slot's network is kept (and saved) from its first step; before that, reading its weights
        (keep=False) builds the same seeded network without changing the strategy's state.
        """
        if slot in self.hypernets:
            return self.hypernets[slot]
        net = make_hypernetwork(self.mixed, self.num_clients, self.seed * 100_003 + slot)
        if keep:
            self.hypernets[slot] = net
        return net

    def mixing_weights(self, slot: int) -> dict[str, np.ndarray]:
        """αᵢˡ for every mixed tensor l: N non-negative weights summing to one."""
        import torch

        with torch.no_grad():
            alphas = self.hypernetwork(slot, keep=False)(slot)
        return {name: alpha.double().numpy() for name, alpha in alphas.items()}

    def alpha_matrix(self, tensor_name: str) -> np.ndarray:
        """(N, N) mixing weights of one tensor: row i is αᵢ over the N clients (the paper's Fig. 6 heat map)."""
        if tensor_name not in self.mixed:
            raise UsageError(f"{tensor_name!r} is not a mixed tensor", f"use one of: {', '.join(self.mixed[:5])}")
        return np.stack([self.mixing_weights(slot)[tensor_name] for slot in range(self.num_clients)])

    def hypernetwork_step(self, slot: int, direction: Mapping[str, np.ndarray]) -> None:
        """One SGD step of client `slot`'s embedding and hypernetwork along Jᵀ·direction, J = ∂θ̄ᵢ/∂φᵢ.

        θ̄ᵢˡ is linear in αᵢˡ, so the vector-Jacobian product through the mix is ⟨θⱼˡ, vˡ⟩ for each j; autograd
        takes it from there through the normalisation and the network.
        """
        import torch

        net = self.hypernetwork(slot)
        net.zero_grad()
        with torch.enable_grad():  # callers (the simulator's engine) may have turned autograd off
            alphas = net(slot)
            surrogate = torch.zeros((), dtype=torch.float64)
            for name, vector in direction.items():
                flat = vector.ravel()
                pulls = torch.tensor([float(tensors[name].ravel() @ flat) for tensors in self.client_tensors])
                surrogate = surrogate + (alphas[name].double() * pulls).sum()
            if not surrogate.requires_grad:  # every head fell back to the one-hot: nothing depends on φ
                return
            surrogate.backward()
        with torch.no_grad():
            for parameter in net.parameters():
                if parameter.grad is not None:
                    parameter -= self.options.hn_lr * parameter.grad

    def _mix(self, slot: int, alphas: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        mixed = {}
        for name in self.names:
            if name in alphas:
                mixed[name] = sum(weight * tensors[name] for weight, tensors in zip(alphas[name], self.client_tensors))
            else:  # integer buffers (BatchNorm batch counters) are not mixed: the client keeps its own
                mixed[name] = self.client_tensors[slot][name]
        return mixed

    def _ensure_started(self, global_base: Mapping[str, np.ndarray]) -> None:
        if self.client_tensors is None:  # every client starts from round 1's base, as in the paper
            start = {name: np.asarray(global_base[name], dtype=np.float64) for name in self.names}
            self.client_tensors = [{k: v.copy() for k, v in start.items()} for _ in range(self.num_clients)]

    # durable state

    def state_bytes(self) -> bytes | None:
        """Slots, every client's latest tensors and every hypernetwork, as safetensors bytes."""
        if self.client_tensors is None:
            return None
        tensors: dict[str, np.ndarray] = {}
        for slot, client in enumerate(self.client_tensors):
            tensors.update({f"client/{slot}/{name}": value for name, value in client.items()})
        for slot, net in self.hypernets.items():
            tensors.update({f"net/{slot}/{key}": value.detach().numpy() for key, value in net.state_dict().items()})
        nets = sorted(self.hypernets)
        header = {"format": STATE_FORMAT, "clients": self.num_clients, "slots": self.slots, "nets": nets}
        return encode_tensors(tensors, metadata={"pfedla": json.dumps(header, sort_keys=True)})

    def load_state(self, payload: bytes) -> None:
        """Restore what state_bytes() wrote."""
        import torch

        header = json.loads(decode_metadata(payload).get("pfedla", "{}"))
        if header.get("format") != STATE_FORMAT or header.get("clients") != self.num_clients:
            raise StateError(
                f"the saved pfedla state is for {header.get('clients')} clients in format {header.get('format')!r}",
                f"restart with --pfedla-clients {header.get('clients')}, or use a new --state folder",
            )
        tensors = decode_tensors(payload)
        self.slots = {device: int(slot) for device, slot in header["slots"].items()}
        self.client_tensors = [
            {name: tensors[f"client/{slot}/{name}"].astype(np.float64) for name in self.names}
            for slot in range(self.num_clients)
        ]
        self.hypernets = {}
        for slot in header["nets"]:
            net = self.hypernetwork(slot)
            prefix = f"net/{slot}/"
            saved = {key.removeprefix(prefix): value for key, value in tensors.items() if key.startswith(prefix)}
            net.load_state_dict({key: torch.from_numpy(value) for key, value in saved.items()})


def make_hypernetwork(tensor_names: list[str], num_clients: int, seed: int) -> Any:
    """A client's embedding (dim 100) → 3 × (Linear 100 + ReLU) → one Linear(100, N) head per tensor; α > 0 at start."""
    import torch
    from torch import nn

    class HyperNetwork(nn.Module):
        """forward(slot) gives {tensor name: αˡ}, each N weights that sum to one."""

        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Parameter(torch.randn(EMBEDDING_DIM))
            layers: list[nn.Module] = []
            for width in (EMBEDDING_DIM, HIDDEN_DIM, HIDDEN_DIM):
                layers += [nn.Linear(width, HIDDEN_DIM), nn.ReLU()]
            self.body = nn.Sequential(*layers)
            # heads are indexed by position: tensor names contain dots, which module names may not
            self.heads = nn.ModuleList(nn.Linear(HIDDEN_DIM, num_clients) for _ in tensor_names)
            for head in self.heads:
                # non-negative weights and zero bias on non-negative features: every αˡʲ starts positive (near
                # uniform). PyTorch's default init gave about half the outputs ≤ 0, and ReLU has no gradient
                # there, so a client whose own weight started at 0 never regained it (issue 18; FL-bench's
                # pFedLA initialises its heads this way)
                nn.init.uniform_(head.weight, 0.0, 1.0)
                nn.init.zeros_(head.bias)

        def forward(self, slot: int) -> dict[str, torch.Tensor]:
            feature = self.body(self.embedding)
            return {name: normalise(torch.relu(head(feature)), slot) for name, head in zip(tensor_names, self.heads)}

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return HyperNetwork()


def normalise(weights: Any, slot: int) -> Any:
    """Non-negative weights divided by their sum; a zero sum gives the client's own one-hot."""
    import torch

    total = weights.sum()
    if float(total.detach()) <= 0.0:
        return torch.nn.functional.one_hot(torch.tensor(slot), weights.numel()).to(weights.dtype)
    return weights / total
