"""RoPE-Axial and RoPE-Mixed (Heo et al., ECCV 2024, "Rotary Position Embedding for Vision Transformer").

Both rotate adjacent channel pairs ``(2k, 2k+1)`` of each head by angles built from integer
patch indices ``t_x`` (column) and ``t_y`` (row); the cls/register tokens are not rotated.
timm's Eva models ``vit_*_patch16_rope_224`` / ``..._rope_mixed_224`` implement the same maths
and serve as the test oracle.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
from timm.layers.pos_embed_sincos import init_random_2d_freqs

from .._checks import check_choice
from .spec import EXTRAPOLATION_MODES
from .base import register_encoding
from .grid import PositionGrid
from .rotary import RotaryEncoding

__all__ = ["RopeAxial", "RopeMixed", "grid_xy"]


def _check_head_dim(name: str, head_dim: int, multiple: int = 4) -> None:
    if head_dim % multiple:
        raise ValueError(
            f"{name} splits each head into {multiple // 2} axes x pairs and needs head_dim divisible by {multiple}; "
            f"got head_dim={head_dim} (embed_dim / num_heads). Choose num_heads so that embed_dim/num_heads is a multiple of {multiple}."
        )


def grid_xy(grid: PositionGrid, device, train_grid: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Column (``t_x``) and row (``t_y``) indices of a 2D grid, float32, row-major token order.

    With ``train_grid`` the indices are rescaled so the new grid spans the training grid's index
    range ('interpolate' policy) instead of extending past it.
    """
    idx = grid.indices(device, rescale_to=train_grid)
    return idx[:, 1], idx[:, 0]


@register_encoding("rope_axial")
class RopeAxial(RotaryEncoding):
    """RoPE-Axial: pairs ``0..dh/4-1`` rotate by ``t_x * theta_j``, the next ``dh/4`` by ``t_y * theta_j``,
    ``theta_j = theta^(-4j/dh)`` with ``theta = 100``. No parameters.

    ``extrapolation='extend'`` (paper) uses the new grid's integer indices; ``'interpolate'``
    rescales them into the training grid's range.
    """

    grid_ndims = (2,)

    def __init__(self, head_dim: int, grid_size: Sequence[int] = (14, 14), theta: float = 100.0, extrapolation: str = "extend") -> None:
        super().__init__()
        _check_head_dim("rope_axial", head_dim)
        check_choice("extrapolation", extrapolation, EXTRAPOLATION_MODES)
        self.head_dim = head_dim
        self.theta = theta
        self.grid_size = tuple(int(g) for g in grid_size)
        self.extrapolation = extrapolation

    def bands(self, device) -> torch.Tensor:
        nb = self.head_dim // 4
        exp = torch.arange(0, nb, 1, dtype=torch.int64, device=device).to(torch.float32) / nb
        return 1.0 / (self.theta**exp)

    def angles(self, grid, device):
        train = self.grid_size if self.extrapolation == "interpolate" else None
        t_x, t_y = grid_xy(grid, device, train)
        b = self.bands(device)
        return torch.cat([t_x[:, None] * b, t_y[:, None] * b], dim=-1)  # (N, dh/2)


@register_encoding("rope_mixed")
class RopeMixed(RotaryEncoding):
    """RoPE-Mixed: learned per-layer, per-head 2D frequencies ``(f_x, f_y)`` for every pair,
    angle ``f_x t_x + f_y t_y``; init magnitudes ``theta^(-4j/dh)`` with ``theta = 10`` and a random
    direction per head (timm/naver init). ``freqs`` is excluded from weight decay.
    """

    grid_ndims = (2,)
    per_layer = True

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        depth: int,
        grid_size: Sequence[int] = (14, 14),
        theta: float = 10.0,
        extrapolation: str = "extend",
    ) -> None:
        super().__init__()
        _check_head_dim("rope_mixed", head_dim)
        check_choice("extrapolation", extrapolation, EXTRAPOLATION_MODES)
        self.grid_size = tuple(int(g) for g in grid_size)
        self.extrapolation = extrapolation
        self.freqs = nn.Parameter(init_random_2d_freqs(head_dim, depth, num_heads, temperature=theta, rotate=True))

    def angles(self, grid, device):
        train = self.grid_size if self.extrapolation == "interpolate" else None
        t_x, t_y = grid_xy(grid, device, train)
        f = self.freqs.float()
        # (depth, H, N, P) as an outer product by broadcasting (keeps float32 under autocast)
        return t_x[:, None] * f[0][..., None, :] + t_y[:, None] * f[1][..., None, :]

    def no_weight_decay(self) -> set[str]:
        return {"freqs"}

    def load_timm_rope_freqs(self, freqs: torch.Tensor) -> dict[str, torch.Tensor]:
        # timm's Eva RoPE-Mixed stores the same (2, depth, heads, dh/4) frequencies in the same pair order
        return {"freqs": freqs}
