"""Routing metadata of the grouped GEMMs, built on the device with PyTorch ops and no host sync.

The ``T·K`` (token, slot) pairs ``p = t·K + k`` are sorted by expert (stably: within an expert, token order), so an
expert's pairs are one run of sorted rows ``[expert_start[e], expert_start[e+1])``. A row tile is ``block_m``
consecutive rows of one expert; tile ``i`` of the grid finds its expert by a binary search over the running tile
counts. The number of tiles is data-dependent, but bounded without reading the data:
``Σ_e ceil(c_e / b) <= T·K / b + (experts with a token) <= ceil(T·K / b) + min(E, T·K)``, so every launch uses
that bound as its grid and the programs past the last tile return at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton


@dataclass
class Routing:
    """``pair_of_row[r]``: the pair of sorted row r; ``expert_start [E + 1]``: each expert's first row; the tile map
    ``tile_expert`` / ``tile_start`` / ``tile_end`` (``[n_tiles]``; expert E marks a tile past the last); all int32."""
    pair_of_row: torch.Tensor
    expert_start: torch.Tensor
    tile_expert: torch.Tensor
    tile_start: torch.Tensor
    tile_end: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.pair_of_row, self.expert_start, self.tile_expert, self.tile_start, self.tile_end)


def max_tiles(n_pairs: int, n_experts: int, block_m: int) -> int:
    """The grid bound of the row-tile kernels (module docstring)."""
    return triton.cdiv(n_pairs, block_m) + min(n_experts, n_pairs)


def route(expert_of_pair: torch.Tensor, n_experts: int, block_m: int) -> Routing:
    """Routing metadata of ``expert_of_pair [T·K]`` (the flattened ``top_k_index``)."""
    device = expert_of_pair.device
    expert_of_pair = expert_of_pair.long()
    counts = torch.zeros(n_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, expert_of_pair, torch.ones_like(expert_of_pair))  # (bincount would sync for its size)
    pair_of_row = torch.argsort(expert_of_pair, stable=True)
    expert_start = torch.zeros(n_experts + 1, dtype=torch.int64, device=device)
    expert_start[1:] = counts.cumsum(0)
    tiles = (counts + block_m - 1) // block_m
    tiles_through = tiles.cumsum(0)  # tiles of experts 0..e
    tile = torch.arange(max_tiles(expert_of_pair.numel(), n_experts, block_m), device=device)
    # the expert of each tile: how many experts' tiles end at or before it (E: a tile past the last)
    tile_expert = torch.searchsorted(tiles_through, tile, right=True)
    e = tile_expert.clamp(max=n_experts - 1)
    tile_start = expert_start[e] + (tile - (tiles_through[e] - tiles[e])) * block_m
    tile_end = torch.minimum(tile_start + block_m, expert_start[e + 1])
    as32 = lambda t: t.to(torch.int32)  # noqa: E731
    return Routing(as32(pair_of_row), as32(expert_start), as32(tile_expert), as32(tile_start), as32(tile_end))
