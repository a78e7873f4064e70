"""nD-RoPE: RoPE with ``n``-dimensional wave vectors on a regular simplex (Li et al., ICML 2026, arXiv 2606.12146,
"nD-RoPE: A Generalized RoPE for n-Dimensional Position Embedding"). No released code was found (2026-11-26); this
module follows the paper's stated design and its tests check the paper's stated properties.

Pair ``p`` turns by ``omega_p . x`` with ``x`` the token's lattice index (all axes at once, no per-axis split): the
wave vectors are the ``n + 1`` unit vertices of a regular simplex centred at the origin, repeated at ``S`` scales
``theta^(-s/S)`` (``s < S``, ``S = P // (n + 1)``, pairs in scale-major order). The simplex makes every direction
alike: any permutation of its vertices is an orthogonal map of the lattice space, and it permutes the wave vectors of
each scale, so the content-free kernel ``mean_p cos(omega_p . d)`` is the same for ``d`` and its image; the
vertices' second moment is ``(n + 1)/n * I`` (an isotropic second-order response, non-degenerate coverage).
Angles are linear in the position, so attention depends on offsets only.

vispe's choices where the paper's text gives no number: the simplex's orientation (the Helmert basis of the
sum-zero hyperplane, :func:`simplex_vertices`: in 2D one vertex points along ``-x``, the column axis, the
others at +-120 degrees from it), ``theta = 100`` (RoPE-Axial's
2D base: 1 radian per patch at the top scale), and the ``P - S (n + 1)`` pairs left over unrotated (zero frequency).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from .._checks import Real
from .base import register_encoding
from .grid import PositionGrid
from .rope_vit import _LatticeRotary
from .resolution import ResolutionContract

__all__ = ["NdRope", "simplex_vertices", "simplex_wave_vectors"]


def simplex_vertices(n: int) -> torch.Tensor:
    """The ``n + 1`` unit vertices ``(n + 1, n)`` float64 of a regular simplex centred at the origin: the standard basis
    of ``R^(n+1)`` expressed in the Helmert basis of its sum-zero hyperplane (row ``k``: ``k`` ones, then ``-k``, over
    ``sqrt(k (k + 1))``), normalised. Pairwise dot products are ``-1/n``."""
    helmert = torch.zeros(n, n + 1, dtype=torch.float64, device="cpu")
    for k in range(1, n + 1):
        helmert[k - 1, :k] = 1.0
        helmert[k - 1, k] = -float(k)
        helmert[k - 1] /= math.sqrt(k * (k + 1))
    return torch.nn.functional.normalize(helmert.T, dim=-1)


def simplex_wave_vectors(pairs: int, n: int, theta: float) -> torch.Tensor:
    """``(pairs, n)`` float32: the simplex's vertices at scales ``theta^(-s/S)``, scale-major; leftover pairs zero."""
    verts = simplex_vertices(n)
    scales = pairs // (n + 1)
    mags = theta ** (-torch.arange(scales, dtype=torch.float64, device="cpu") / max(scales, 1))
    waves = (mags[:, None, None] * verts[None]).reshape(scales * (n + 1), n)
    pad = torch.zeros(pairs - waves.shape[0], n, dtype=torch.float64, device="cpu")
    return torch.cat([waves, pad]).float()


@register_encoding("nd_rope")
class NdRope(_LatticeRotary):
    """nD-RoPE on lattices of any number of axes (the model's ``grid_size``: images, videos).

    Args:
        theta: the scale ladder's base (100): scales ``theta^(-s/S)``, the top one 1 radian per lattice step.
        extrapolation: ``'extend'`` (new integer indices, the same relative phases) or ``'interpolate'`` (indices
            rescaled into the training grid's range).
    """

    grid_ndims = (2, 3)
    resolution = ResolutionContract(("extend", "rescale"), default="extend")
    option_checks = {"theta": Real(1, low_open=True)}

    def __init__(
        self,
        head_dim: int,
        grid_size: Sequence[int] = (14, 14),
        theta: float = 100.0,
        extrapolation: str | None = None,
    ) -> None:
        name = self.registry_name
        super().__init__(name, head_dim, grid_size, extrapolation, None)
        n = len(self.grid_size)
        if head_dim // 2 < n + 1:
            raise ValueError(f"{name} needs one pair per simplex vertex ({n + 1} on {n} axes): head_dim >= {2 * (n + 1)}, "
                             f"got head_dim={head_dim}")
        self.theta = float(theta)
        # derived from the options (not a buffer: nothing to save or load); moved with the angles, cached per grid
        self.freqs = simplex_wave_vectors(head_dim // 2, n, self.theta)

    def angles(self, grid: PositionGrid, device) -> torch.Tensor:
        idx = self.lattice_indices(grid, device)  # (N, ndim)
        return idx @ self.freqs.to(idx.device).T  # (N, P)
