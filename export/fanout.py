"""Concat and split with few tensors a node: a WebGPU shader binds one storage buffer per tensor it reads or writes,
and WebGPU guarantees only 8 a shader stage (SwiftShader gives 10; many phones the 8), so one Concat of a whole
model's parameters cannot run there. A flat update concatenates and splits through a tree of nodes instead."""

from __future__ import annotations

from collections.abc import Sequence

import torch

WEBGPU_STORAGE_BUFFERS = 8  # the WebGPU default of maxStorageBuffersPerShaderStage, which every adapter meets
MAX_FANOUT = WEBGPU_STORAGE_BUFFERS - 1  # a node's tensors on one side, its one tensor on the other


def cat(tensors: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """torch.cat through Concat nodes of at most MAX_FANOUT inputs each."""
    tensors = list(tensors)
    while len(tensors) > MAX_FANOUT:
        tensors = [
            torch.cat(tensors[i : i + MAX_FANOUT], dim) if len(tensors[i : i + MAX_FANOUT]) > 1 else tensors[i]
            for i in range(0, len(tensors), MAX_FANOUT)
        ]
    return torch.cat(tensors, dim) if len(tensors) > 1 else tensors[0]


def split(flat: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """flat.split(sizes) along dim 0 through Split nodes of at most MAX_FANOUT outputs each."""
    sizes = list(sizes)
    if len(sizes) <= MAX_FANOUT:
        return list(flat.split(sizes)) if len(sizes) > 1 else [flat]
    per_group = -(-len(sizes) // MAX_FANOUT)
    groups = [sizes[i : i + per_group] for i in range(0, len(sizes), per_group)]
    parts = flat.split([sum(group) for group in groups])
    return [piece for part, group in zip(parts, groups) for piece in split(part, group)]
