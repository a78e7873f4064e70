"""ComRoPE's lattice line tables: per grid axis, the rotations of every lattice line (patch centres
``(i + 0.5) / size``, plus the centre for prefix tokens), the training-time moves of those lines, and the per-forward
state that indexes them (:class:`ComRopeState`). The generators commute, so a token's rotation is the product of its
lines' rotations.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ..coordinates import random_axis_indices, random_scale_shift
from ..grid import PositionGrid
from .kernels import _gathered_product, block_matmul

__all__ = ["lattice_line_rotations", "line_offsets", "line_jitter", "comrope_coordinates", "ComRopeState"]


def _odd_powers(half_step: torch.Tensor, count: int) -> torch.Tensor:
    """``A^1 .. A^count`` of ``A = half_step`` ``(..., b, b)`` by doubling: ``(..., count, b, b)``."""
    pows = half_step.unsqueeze(-3)
    cur = half_step  # A^k with k = pows.shape[-3]
    while pows.shape[-3] < count:
        pows = torch.cat([pows, block_matmul(pows, cur.unsqueeze(-3))], dim=-3)
        cur = block_matmul(cur, cur)
    return pows[..., :count, :, :]


def lattice_line_rotations(gen: torch.Tensor, size: int, jitter: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    """``exp(v G)`` for the ``size`` patch-centre values ``v_i = scale (i + 0.5) / size`` of one axis (each
    optionally moved by ``jitter[i]``), plus the centre ``v = 0.5`` appended last.

    Centres are odd multiples of ``1 / (2 size)`` and the centre is ``size`` of them, so one
    ``matrix_exp(G / (2 size))`` per block and a few batched products give the whole axis
    (exact up to float32 rounding): ``(..., size + 1, b, b)`` for generators ``gen`` ``(..., b, b)``.
    ``scale != 1`` (ComRoPE-3D's released time axis, ``(t + 0.5) / n_spatial``) evaluates the lines with
    ``scale G`` and the centre row by its own ``matrix_exp(G / 2)``.
    """
    if scale != 1.0:
        lines = lattice_line_rotations(gen * scale, size, jitter)[..., :-1, :, :]
        with torch.autocast(device_type=gen.device.type, enabled=False):
            centre = torch.linalg.matrix_exp((0.5 * gen.float()).contiguous())
        return torch.cat([lines, centre.unsqueeze(-3)], dim=-3)
    with torch.autocast(device_type=gen.device.type, enabled=False):
        gen = gen.float()
        half = torch.linalg.matrix_exp((gen / (2 * size)).contiguous())
        pows = _odd_powers(half, 2 * size)  # A^1 .. A^(2 size)
        lines = pows[..., 0::2, :, :]  # A^(2i + 1): the patch centres
        if jitter is not None:
            eps = torch.linalg.matrix_exp((jitter.float()[:, None, None] * gen.unsqueeze(-3)).contiguous())
            lines = block_matmul(lines, eps)
        return torch.cat([lines, pows[..., size - 1 : size, :, :]], dim=-3)


def line_offsets(
    grid: PositionGrid,
    device: torch.device | str | None = None,
    sigma: float = 0.0,
    coord_shift: float = 0.0,
    coord_jitter: float = 1.0,
    coord_rescale: float = 1.0,
    random_positions: float = 1.0,
) -> list[torch.Tensor]:
    """Training-time moves of ComRoPE's normalised line coordinates ``(i + 0.5) / n``, one draw per forward
    (shared by the batch), as per-line offsets in normalised units (what :func:`lattice_line_rotations` and
    :func:`comrope_coordinates` take), applied in this order:

    - ``random_positions = r`` (RPE-2D): each axis's ``n`` lines sit at an ordered random subset of the
      ``ceil(r n)`` centres of a lattice ``r`` times finer over the same extent -- the positions a grid ``r``
      times larger is evaluated at, since ComRoPE normalises every grid to ``(0, 1)``;
    - ``sigma``: the paper's per-line perturbation (:func:`line_jitter`);
    - ``coord_rescale`` / ``coord_jitter``: about the grid centre ``0.5``, every axis scaled by one factor
      log-uniform in ``[1/coord_rescale, coord_rescale]`` times its own in ``[1/coord_jitter, coord_jitter]``;
    - ``coord_shift``: each axis shifted by a uniform ``[-coord_shift, coord_shift]`` patches.

    Coordinates stay one per line and the generators commute, so rotations still factor per axis and attention
    depends on (moved) offsets only.
    """
    base = [(torch.arange(n, device=device, dtype=torch.float32) + 0.5) / n for n in grid.shape]
    coords = list(base)
    if random_positions > 1:
        pools = [max(n, math.ceil(random_positions * n)) for n in grid.shape]
        coords = [(c + 0.5) / m for c, m in zip(random_axis_indices(grid.shape, pools, device), pools)]
    if sigma > 0:
        coords = [c + j for c, j in zip(coords, line_jitter(grid, sigma, device))]
    if coord_rescale > 1 or coord_jitter > 1 or coord_shift > 0:
        scale, shift = random_scale_shift(len(grid.shape), coord_shift, coord_jitter, coord_rescale)
        scale, shift = scale.to(base[0].device), shift.to(base[0].device)
        # indexed as tensors, not read out with .tolist(): a compiled graph keeps the draw inside (no graph break)
        coords = [(c - 0.5) * scale[a] + 0.5 + shift[a] / n for a, (c, n) in enumerate(zip(coords, grid.shape))]
    return [c - b for c, b in zip(coords, base)]


def line_jitter(grid: PositionGrid, sigma: float, device: torch.device | str | None = None) -> list[torch.Tensor]:
    """Training-time perturbation: one offset per lattice line of every axis, in normalised units.

    Each line moves by ``N(0, (0.5 sigma)^2)`` patches clamped to +-0.5 patch (it stays inside its
    patch), as in the released code -- but per line and per forward (shared by the batch) rather than
    per patch and sample, so rotations stay one lattice product and batch-independent.
    """
    return [(torch.randn(n, device=device) * (0.5 * sigma)).clamp(-0.5, 0.5) / n for n in grid.shape]


def comrope_coordinates(
    grid: PositionGrid, device: torch.device | str | None, jitter: Sequence[torch.Tensor] | None = None
) -> torch.Tensor:
    """Normalised coordinates ``(S + N, ndim)``: prefix tokens at ``0.5``, patches at their centres
    ``(i + 0.5) / size`` (plus the per-line ``jitter`` of :func:`line_jitter`, if given)."""
    coords = grid.centers(device)
    if jitter is not None:
        idx = grid.indices(device).long()
        coords = coords + torch.stack([j.to(coords.device)[idx[:, a]] for a, j in enumerate(jitter)], dim=-1)
    if grid.num_prefix_tokens:
        coords = torch.cat([coords.new_full((grid.num_prefix_tokens, grid.ndim), 0.5), coords], dim=0)
    return coords


def _token_line_index(grid: PositionGrid, device: torch.device | str | None) -> list[torch.Tensor]:
    """Per axis, each token's row in :func:`lattice_line_rotations` (prefix tokens -> the centre row)."""
    idx = grid.indices(device).long()
    out = []
    for a, n in enumerate(grid.shape):
        pre = torch.full((grid.num_prefix_tokens,), n, dtype=torch.long, device=idx.device)
        out.append(torch.cat([pre, idx[:, a]]))
    return out


@dataclass
class ComRopeState:
    """Per-forward rotations in compact form: per layer, one or more factor line tables
    ``(H, m*K_a, b, b)``, and for every factor and (token, block) its row, ``flat_index`` ``(A, L*m)``;
    a token's block rotation is ``prod_a tables[layer][a][:, flat_index[a, n*m + j]]``. AP has one
    factor (each block follows one axis; ``K`` = that axis' lines + centre); LD has one per grid axis
    (``R(x) = prod_a exp(x_a G_a)``), so every table holds only ``O(lines * blocks * b^2)`` and the
    per-token products are formed inside attention and recomputed in the backward.
    """

    tables: tuple[tuple[torch.Tensor, ...], ...]
    flat_index: torch.Tensor
    num_blocks: int
    #: after patch dropout: each sample's present tokens, rows ``(B, n)`` of the full sequence
    token_index: Optional[torch.Tensor] = None

    @classmethod
    def build(cls, tables: Sequence[torch.Tensor], index: torch.Tensor) -> "ComRopeState":
        """``tables``: per factor ``(depth, H, m, K_a, b, b)``; ``index`` ``(A, L, m)`` rows into each ``K_a``."""
        m = tables[0].shape[2]
        offsets = torch.arange(m, device=index.device)
        flat = torch.stack([(index[a] + offsets * t.shape[3]).reshape(-1) for a, t in enumerate(tables)])
        per_factor = [t.reshape(t.shape[0], t.shape[1], -1, *t.shape[-2:]).contiguous().unbind(0) for t in tables]
        return cls(tuple(zip(*per_factor)), flat, m)

    def for_layer(self, layer: int) -> torch.Tensor:
        """Dense per-token block rotations ``(H, L, m, b, b)`` of one layer (for analysis and tests)."""
        tables = self.tables[layer]
        heads, b = tables[0].shape[0], tables[0].shape[-1]
        return _gathered_product(tables, self.flat_index)[1][-1].reshape(heads, -1, self.num_blocks, b, b)
