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
        tensors = [torch.cat(run, dim) if len(run) > 1 else run[0] for run in _runs(tensors)]
    return torch.cat(tensors, dim) if len(tensors) > 1 else tensors[0]


def split(flat: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """flat.split(sizes) along dim 0 through Split nodes of at most MAX_FANOUT outputs each: `cat`'s tree read
    backwards (runs of MAX_FANOUT grouped level by level), ceil((n − 1) / (MAX_FANOUT − 1)) nodes or one more."""
    tree: list = list(sizes)
    while len(tree) > MAX_FANOUT:
        tree = [run if len(run) > 1 else run[0] for run in _runs(tree)]
    return _split_along(flat, tree)


def nodes(count: int) -> int:
    """How many nodes `cat` of `count` tensors takes (`split` into as many takes at most one more)."""
    total = 0
    while count > MAX_FANOUT:
        runs = _runs(list(range(count)))
        total += sum(len(run) > 1 for run in runs)
        count = len(runs)
    return total + (count > 1)


def _runs(items: list) -> list[list]:
    """Consecutive runs of at most MAX_FANOUT items: one tree level of `cat` and `split`."""
    return [items[i : i + MAX_FANOUT] for i in range(0, len(items), MAX_FANOUT)]


def _size(node: int | list) -> int:
    return node if isinstance(node, int) else sum(_size(child) for child in node)


def _split_along(flat: torch.Tensor, tree: list) -> list[torch.Tensor]:
    parts = flat.split([_size(child) for child in tree]) if len(tree) > 1 else [flat]
    return [
        piece
        for part, child in zip(parts, tree)
        for piece in ([part] if isinstance(child, int) else _split_along(part, child))
    ]
