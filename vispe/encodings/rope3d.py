"""3D rotary encodings for video ViTs over a ``(t, h, w)`` tubelet lattice.

* ``rope_axial_3d`` -- the head's ``P = head_dim/2`` pairs are split into t / h / w chunks
  (``sections``, default: h and w get ``P // 3`` each, t the rest); each chunk has its own ladder
  ``theta^(-k / P_axis)`` over its sub-dimension (no parameters). With ``sections=(0, P/2, P/2)``
  and ``theta=100`` a single frame gets the same per-axis ladders as 2D ``rope_axial``.
* ``rope_mixed_3d`` -- RoPE-Mixed (Heo et al.) with a third learned frequency per pair:
  ``phi = t * f_t + y * f_y + x * f_x`` per layer and head. ``f_x, f_y`` use the 2D init (timm's
  ``init_random_2d_freqs``, base 10); ``f_t`` starts from a 1D ladder ``temporal_theta^(-j/P)``
  over all pairs (``temporal_init='ladder'``, EVA02-AT-style joint space-time RoPE at init) or from
  zero (``'zero'``: an image model at init). All frequencies train and are excluded from weight decay.

Both use the ``'interleaved'`` pair layout (pair ``i`` = channels ``(2i, 2i+1)``) like the 2D ViT
encodings, rotate q/k through :func:`vispe.encodings.rotary.apply_rotary`, and leave prefix tokens
unrotated. timm's axial classes hard-wire two axes (``RotaryEmbeddingCat(64).get_embed([4,14,14])``
returns ``dim*3/2`` channels), hence the explicit 3-axis split here.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from timm.layers.pos_embed_sincos import init_random_2d_freqs
from torch import nn

from .._checks import check_choice
from .spec import EXTRAPOLATION_MODES
from .base import register_encoding
from .grid import PositionGrid
from .rotary import RotaryEncoding

__all__ = ["RopeAxial3d", "RopeMixed3d", "grid_thw"]


def grid_thw(grid: PositionGrid, device, train_grid: Sequence[int] | None = None) -> torch.Tensor:
    """Integer ``(t, h, w)`` indices ``(N, 3)`` float32; with ``train_grid`` rescaled into its index range."""
    return grid.indices(device, rescale_to=train_grid)


def _check_sections(sections: Sequence[int], P: int) -> tuple[int, int, int]:
    sec = tuple(sections)
    if len(sec) != 3 or any(not isinstance(s, int) or s < 0 for s in sec) or sum(sec) != P:
        raise ValueError(f"rope_axial_3d: sections must be three non-negative pair counts (t, h, w) summing to P = head_dim/2 = {P}, got {sections!r}")
    return sec  # type: ignore[return-value]


@register_encoding("rope_axial_3d")
class RopeAxial3d(RotaryEncoding):
    """Axial 3D RoPE: pair chunks ``[t | h | w]``, each axis with its own ladder ``theta^(-k/P_axis)``."""

    grid_ndims = (3,)

    def __init__(
        self,
        head_dim: int,
        grid_size: Sequence[int] = (8, 14, 14),
        sections: Sequence[int] | None = None,
        theta: float = 100.0,
        extrapolation: str = "extend",
    ) -> None:
        super().__init__()
        if head_dim % 2 or head_dim < 6:
            raise ValueError(f"rope_axial_3d needs an even head_dim >= 6 (at least one pair per axis), got head_dim={head_dim}")
        check_choice("extrapolation", extrapolation, EXTRAPOLATION_MODES)
        P = head_dim // 2
        if sections is None:
            s = P // 3
            sections = (P - 2 * s, s, s)
        self.sections = _check_sections(sections, P)
        self.head_dim = head_dim
        self.theta = float(theta)
        self.grid_size = tuple(int(g) for g in grid_size)
        self.extrapolation = extrapolation

    def bands(self, n: int, device) -> torch.Tensor:
        k = torch.arange(n, device=device, dtype=torch.float32)
        return self.theta ** (-k / max(n, 1))

    def angles(self, grid, device):
        train = self.grid_size if self.extrapolation == "interpolate" else None
        idx = grid_thw(grid, device, train)
        parts = [idx[:, a : a + 1] * self.bands(n, device) for a, n in enumerate(self.sections)]
        return torch.cat(parts, dim=-1)  # (N, P)


@register_encoding("rope_mixed_3d")
class RopeMixed3d(RotaryEncoding):
    """RoPE-Mixed in 3D: learned ``(f_t, f_y, f_x)`` per layer, head and pair; ``freqs`` shape ``(3, depth, H, P)``."""

    grid_ndims = (3,)
    per_layer = True

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        depth: int,
        grid_size: Sequence[int] = (8, 14, 14),
        theta: float = 10.0,
        temporal_theta: float = 100.0,
        temporal_init: str = "ladder",
        extrapolation: str = "extend",
    ) -> None:
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"rope_mixed_3d needs head_dim divisible by 4 (RoPE-Mixed init), got head_dim={head_dim}")
        check_choice("temporal_init", temporal_init, ("ladder", "zero"))
        check_choice("extrapolation", extrapolation, EXTRAPOLATION_MODES)
        self.grid_size = tuple(int(g) for g in grid_size)
        self.extrapolation = extrapolation
        P = head_dim // 2
        fxy = init_random_2d_freqs(head_dim, depth, num_heads, temperature=theta, rotate=True)  # (2, depth, H, P)
        if temporal_init == "ladder":
            ft = temporal_theta ** (-torch.arange(P, dtype=torch.float32) / P)
            ft = ft.expand(depth, num_heads, P).clone()
        else:
            ft = torch.zeros(depth, num_heads, P)
        # order (t, y, x) so freqs[a] multiplies grid index column a
        self.freqs = nn.Parameter(torch.stack([ft, fxy[1], fxy[0]]))

    def angles(self, grid, device):
        train = self.grid_size if self.extrapolation == "interpolate" else None
        idx = grid_thw(grid, device, train)  # (N, 3)
        f = self.freqs.float()  # (3, depth, H, P)
        return sum(idx[:, a, None] * f[a][..., None, :] for a in range(3))  # (depth, H, N, P)

    def no_weight_decay(self) -> set[str]:
        return {"freqs"}
