"""FedPer (Arivazhagan et al., Algorithm 2): FedAvg over the base layers; personal layers never leave devices."""

from __future__ import annotations

from edgepfl.server.strategies.fedavg import FedAvg


class FedPer(FedAvg):
    """Sample-weighted mean of the base tensors only; the bundle's kp personal blocks stay on the devices."""

    name = "fedper"
    personalized = True
