"""Inputs shared by the attention-bias path tests (tests/test_attention_paths.py, tests/test_alibi_fire.py)."""
from __future__ import annotations

import torch

from vispe.encodings import PositionGrid


def attention_inputs(grid: PositionGrid, dropout: bool, kept: int) -> tuple[PositionGrid, tuple[torch.Tensor, ...]]:
    """``grid`` (with patch dropout: 2 samples keeping ``kept`` random patches each) and float64 ``q, k, v`` and an
    output weight ``w``, ``(2, 2, L, 8)`` for the grid's token count, from fixed seeds."""
    if dropout:
        g = torch.Generator().manual_seed(1)
        grid = grid.with_keep(torch.stack([torch.randperm(grid.num_patches, generator=g)[:kept] for _ in range(2)]))
    n = grid.seq_len if grid.keep is None else grid.num_prefix_tokens + grid.keep.shape[1]
    g = torch.Generator().manual_seed(2)
    return grid, tuple(torch.randn(2, 2, n, 8, generator=g, dtype=torch.float64) for _ in range(4))
