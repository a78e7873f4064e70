"""Inputs shared by the attention-bias path tests (tests/test_attention_paths.py, tests/test_alibi_fire.py,
tests/test_native_kernels.py)."""
from __future__ import annotations

import torch

from vispe.encodings import EncodingContext, PositionGrid, create_encoding, get_encoding_class


def attention_inputs(grid: PositionGrid, dropout: bool, kept: int) -> tuple[PositionGrid, tuple[torch.Tensor, ...]]:
    """``grid`` (with patch dropout: 2 samples keeping ``kept`` random patches each) and float64 ``q, k, v`` and an
    output weight ``w``, ``(2, 2, L, 8)`` for the grid's token count, from fixed seeds."""
    if dropout:
        g = torch.Generator().manual_seed(1)
        grid = grid.with_keep(torch.stack([torch.randperm(grid.num_patches, generator=g)[:kept] for _ in range(2)]))
    n = grid.seq_len if grid.keep is None else grid.num_prefix_tokens + grid.keep.shape[1]
    g = torch.Generator().manual_seed(2)
    return grid, tuple(torch.randn(2, 2, n, 8, generator=g, dtype=torch.float64) for _ in range(4))


def bias_grid_shape(name: str) -> tuple[int, ...]:
    """A small grid of the encoding's dimensionality: ``(3, 4)`` for 2D encodings, ``(2, 2, 3)`` for 3D ones."""
    return (3, 4) if 2 in get_encoding_class(name).grid_ndims else (2, 2, 3)


def bias_encoding(name: str, options: dict, prefix: int, shape: tuple[int, ...] | None = None) -> torch.nn.Module:
    """The encoding in float64 training mode on ``shape`` (default :func:`bias_grid_shape`; 2 heads, 2 blocks), its
    parameters moved off their initial values (zero-initialised tables would hide a wrong gather)."""
    shape = shape or bias_grid_shape(name)
    ctx = EncodingContext(dim=16, num_heads=2, depth=2, grid_size=shape, num_prefix_tokens=prefix)
    enc = create_encoding(name, ctx, **options).double().train()
    torch.manual_seed(3)
    with torch.no_grad():
        for p in enc.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return enc
