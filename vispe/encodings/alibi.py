"""ALiBi on patch lattices (``alibi_2d`` for ``(h, w)`` images, ``alibi_3d`` for ``(t, h, w)`` videos).

ALiBi (Press, Smith & Lewis, "Train Short, Test Long: Attention with Linear Biases Enables Input Length
Extrapolation", ICLR 2022, arXiv 2108.12409) adds ``-m_h * distance(query, key)`` to the attention logits of
head ``h``, with fixed geometric slopes ``m_h = 2^(-8h/H)``, ``h = 1..H`` (for ``H`` not a power of two: the
slopes of the largest power of two ``P < H``, then every other slope of ``2P``; :func:`alibi_slopes`). It has
no parameters. On a lattice the distance is taken between lattice positions in patch (tubelet) units:

* ``distance='euclidean'`` (default): ``sqrt(sum_a d_a^2)``, the 2D-ALiBi of CROMA (Fuller, Millard & Green,
  NeurIPS 2023, arXiv 2311.00566), the published 2D variant we could check;
* ``distance='manhattan'``: ``sum_a |d_a|``.

On ``(t, h, w)`` grids a tubelet step counts as one unit, like a patch step. On a grid other than the training
one, ``extrapolation='extend'`` (default, the paper's train-short-test-long behaviour) uses the new grid's own
offsets; ``'rescale'`` (alias ``'interpolate'``) rescales offsets per axis by ``train / size`` so the grid spans the
training one.

Prefix tokens (cls, registers) get zero bias to and from every token: they sit at distance 0 from every patch.

How the term is built (shared with FIRE): :mod:`vispe.encodings.lattice_bias`.
"""
from __future__ import annotations

import math
from typing import ClassVar, Sequence

import torch
import torch.nn.functional as F

from .._checks import Choice, check_choice
from .base import register_encoding
from .coordinates import policy_axis_scale
from .grid import PositionGrid
from .lattice_bias import LatticeOffsetBias, pair_distance
from .resolution import ResolutionContract

__all__ = ["ALIBI_DISTANCES", "Alibi2d", "Alibi3d", "alibi_slopes"]

ALIBI_DISTANCES = ("euclidean", "manhattan")


# ---------------------------------------------------------------------------------------------
# ALiBi
# ---------------------------------------------------------------------------------------------
def alibi_slopes(num_heads: int) -> list[float]:
    """ALiBi's head slopes (Press et al.): ``2^(-8h/H)``, ``h = 1..H``, for ``H`` a power of two; otherwise the
    slopes of the largest power of two ``P < H`` followed by the odd-``h`` slopes of ``2P``
    (``2^(-4h/P)``, ``h = 1, 3, 5, ...``) until there are ``H``."""
    if not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
    p = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = [2.0 ** (-8.0 * h / p) for h in range(1, p + 1)]
    slopes += [2.0 ** (-4.0 * h / p) for h in range(1, 2 * (num_heads - p), 2)]
    return slopes


class _Alibi(LatticeOffsetBias):
    """ALiBi on a lattice: ``-m_h * distance`` (see the module docstring).

    Args:
        num_heads: attention heads (one slope each).
        grid_size: training lattice (used by ``extrapolation='rescale'``).
        distance: ``'euclidean'`` (default) or ``'manhattan'``, in lattice steps.
        extrapolation: ``'extend'`` (default) or ``'rescale'`` (alias ``'interpolate'``).
    """

    prefix_policy = "zero bias to and from prefix tokens (cls/registers): they sit at distance 0 from every patch"
    distances: ClassVar[tuple[str, ...]] = ALIBI_DISTANCES

    #: option rules, checked before __init__ (vispe._checks; see PositionalEncoding.option_checks)
    option_checks = {"distance": Choice(ALIBI_DISTANCES)}
    resolution = ResolutionContract(("extend", "rescale"), default="extend")

    def __init__(
        self, num_heads: int, grid_size: Sequence[int], distance: str = "euclidean", extrapolation: str | None = None
    ) -> None:
        super().__init__()
        check_choice("distance", distance, self.distances)
        self.slopes = tuple(alibi_slopes(num_heads))
        self.num_heads = num_heads
        self.grid_size = self._training_grid(grid_size)
        self.distance = distance
        self.extrapolation = extrapolation

    def tables(self, grid: PositionGrid, offsets: torch.Tensor) -> torch.Tensor:
        scale = policy_axis_scale(self.resolution_policy, grid.shape, self.grid_size)
        if scale is not None:
            offsets = offsets * torch.tensor(scale, device=offsets.device)
        dist = pair_distance(offsets, self.distance)[:, 0]  # (U,)
        slopes = torch.tensor(self.slopes, dtype=torch.float32, device=offsets.device)
        return F.pad(-slopes[:, None] * dist[None, :], (0, 1))[None]  # (1, H, U + 1)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, distance={self.distance!r}, extrapolation={self.extrapolation!r}, "
            f"grid_size={self.grid_size}"
        )


@register_encoding("alibi_2d", defaults={"grid_size": (14, 14)}, paper="2108.12409")
class Alibi2d(_Alibi):
    """ALiBi on ``(h, w)`` image lattices (2D-ALiBi); defaults: Euclidean distance, ``extrapolation='extend'``."""

    grid_ndims = (2,)


@register_encoding("alibi_3d", defaults={"grid_size": (8, 14, 14)}, paper="2108.12409")
class Alibi3d(_Alibi):
    """ALiBi on ``(t, h, w)`` video lattices; a tubelet step counts one unit, like a patch step. On a single
    temporal position it is ``alibi_2d``."""

    grid_ndims = (3,)
