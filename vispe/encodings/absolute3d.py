"""Absolute 3D token encodings for video ViTs over a ``(t, h, w)`` lattice.

* ``sincos3d`` -- a fixed sin-cos table: the width ``D`` is split into t / h / w parts
  (``D/2`` frequency bands shared out as h, w: ``(D/2)//3`` each, t the rest); each axis has
  ``[sin | cos]`` channels with frequencies ``temperature^(-k/n_axis)`` (timm's 2D convention per
  axis). ``extrapolation='extend'`` (default) evaluates the formula at the new integer indices,
  ``'rescale'`` (alias ``'interpolate'``) at indices rescaled into the training grid's range.
* ``learned_3d`` -- a learned ``(t, h, w)`` table (truncated normal, std 0.02), resampled
  trilinearly for other grids (``align_corners=False``, like timm's 2D resampler). Optional prefix
  rows (``embed_prefix=True``) give cls/register tokens their own learned rows.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from timm.layers import trunc_normal_
from torch import nn

from .._checks import Real
from .absolute import FixedTableEncoding
from .base import TokenEncoding, register_encoding
from .coordinates import policy_indices
from .grid import PositionGrid
from .resolution import ResolutionContract, resample_table

__all__ = ["Learned3d", "SinCos3d", "sincos3d_table"]


def _split_bands(dim: int) -> tuple[int, int, int]:
    half = dim // 2
    s = half // 3
    return half - 2 * s, s, s


def sincos3d_table(idx: torch.Tensor, dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """``(N, dim)`` sin-cos table for float ``(t, h, w)`` indices ``idx`` of shape ``(N, 3)``."""
    if dim % 2 or dim < 6:
        raise ValueError(f"sincos3d needs an even embedding dim >= 6, got dim={dim}")
    parts = []
    for a, n in enumerate(_split_bands(dim)):
        if n == 0:
            continue
        omega = temperature ** (-torch.arange(n, device=idx.device, dtype=torch.float32) / n)
        ang = idx[:, a : a + 1].float() * omega
        parts += [torch.sin(ang), torch.cos(ang)]
    return torch.cat(parts, dim=-1)


@register_encoding("sincos3d")
class SinCos3d(FixedTableEncoding):
    """Fixed 3D sin-cos table added to the lattice tokens (t, h, w parts of the width)."""

    grid_ndims = (3,)

    #: option rules, checked before __init__ (vispe._checks; see PositionalEncoding.option_checks)
    option_checks = {"temperature": Real(1)}
    resolution = ResolutionContract(("extend", "rescale"), default="extend")

    def __init__(self, dim: int, grid_size: Sequence[int] = (8, 14, 14), temperature: float = 10000.0, extrapolation: str | None = None) -> None:
        super().__init__(dim)
        if dim % 2 or dim < 6:
            raise ValueError(f"sincos3d needs an even embedding dim >= 6, got dim={dim}")
        self.grid_size = tuple(int(g) for g in grid_size)
        self.temperature = temperature
        self.extrapolation = extrapolation

    def build_table(self, grid: PositionGrid, device: torch.device | None) -> torch.Tensor:
        return sincos3d_table(policy_indices(grid, self.resolution_policy, self.grid_size, device), self.dim, self.temperature)[None]


@register_encoding("learned_3d")
class Learned3d(TokenEncoding):
    """Learned ``(t, h, w)`` absolute table, trilinearly resampled to other frame counts / resolutions."""

    grid_ndims = (3,)
    prefix_policy = "prefix tokens get their own learned rows (embed_prefix=True) or nothing (embed_prefix=False)"

    def __init__(self, dim: int, grid_size: Sequence[int] = (8, 14, 14), num_prefix_tokens: int = 1, embed_prefix: bool = True) -> None:
        super().__init__()
        gs = tuple(int(g) for g in grid_size)
        if len(gs) != 3 or min(gs) < 1:
            raise ValueError(f"learned_3d needs a (t, h, w) training grid of positive sizes, got grid_size={grid_size!r}")
        self.grid_size = gs
        self.embed_prefix = embed_prefix
        self.num_prefix_rows = num_prefix_tokens if embed_prefix else 0
        self.pos_embed = nn.Parameter(torch.zeros(1, gs[0], gs[1], gs[2], dim))
        trunc_normal_(self.pos_embed, std=0.02)
        self.prefix_embed = nn.Parameter(torch.zeros(1, self.num_prefix_rows, dim)) if self.num_prefix_rows else None
        if self.prefix_embed is not None:
            trunc_normal_(self.prefix_embed, std=0.02)

    @staticmethod
    def resample(table: torch.Tensor, new: Sequence[int]) -> torch.Tensor:
        """``(1, t, h, w, D) -> (1, t', h', w', D)`` trilinear (float32 math; :func:`resample_table`)."""
        old = tuple(table.shape[1:4])
        if old == tuple(new):
            return table
        return resample_table(table.flatten(0, 3), old, new, kernel="trilinear").reshape(1, *new, table.shape[-1])

    def embed_tokens(self, x, grid, state=None, image=None):
        self.check_grid(grid)
        s = grid.num_prefix_tokens
        if self.embed_prefix and s != self.num_prefix_rows:
            raise ValueError(f"learned_3d has {self.num_prefix_rows} prefix rows but the sequence has {s} prefix tokens")
        return self.add_to_tokens(x, self.resample(self.pos_embed, grid.shape).flatten(1, 3), grid, self.prefix_embed)

    @torch.no_grad()
    def set_grid_size(self, grid_size: Sequence[int]) -> None:
        new = tuple(int(g) for g in grid_size)
        if new != self.grid_size:
            self.pos_embed = nn.Parameter(self.resample(self.pos_embed.data, new), requires_grad=self.pos_embed.requires_grad)
            self.grid_size = new

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "prefix_embed"} if self.prefix_embed is not None else {"pos_embed"}
