"""Learnable Fourier features (Li et al., NeurIPS 2021) as a ViT position encoding.

Algorithm 1 of the paper, for positions ``X`` of shape ``(N, G, M)`` (``G`` groups of ``M``
coordinates):

    F  = |F|^-1/2 * [cos(X W_r^T) || sin(X W_r^T)]        W_r: (|F|/2, M), init N(0, gamma^-2)
    Y  = GELU(F W1 + b1) W2 + b2                          shared by all groups, outputs D/G
    PE = concat over groups                               (N, D)

The PE is added to the lattice tokens before the blocks. Positions are **normalised patch
centres** ``(i + 0.5) / size`` per axis (in (0, 1)), so a new resolution is a denser sampling of the
same coordinate square -- new inputs to the same function, never an index error. ``gamma`` is a
length scale in those units (default 0.1 = a tenth of the image side; the paper's value is per task,
and public re-implementations disagree, see the reference notes). Grouping for grids:
``groups=1`` encodes the joint coordinate (``M = ndim``, the paper's ViT setting);
``groups=ndim`` encodes each axis separately (``M = 1``) with the same ``W_r``/MLP and concatenates
(a separable variant). Prefix tokens get their own learned vectors (zeros init), as in public ViT
re-implementations (Algorithm 1 does not cover them). ``W_r`` is exempt from weight decay (decay
would slowly shrink the frequencies; the paper does not say).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn as nn

from .._checks import Choice, Int, Real, check_choice
from .base import TokenEncoding, register_encoding
from .grid import PositionGrid

__all__ = ["LearnableFourierFeatures", "LearnableFourierPE", "LFF_FREQ_INITS"]

#: how ``W_r`` starts: ``'paper'`` -- Li et al. 2021, Algorithm 1, ``W_r ~ N(0, gamma^-2)``: variance gamma^-2, std
#: 1/gamma, so that F(x).F(y) ~ 0.5 exp(-|x - y|^2 / (2 gamma^2)) and gamma is the kernel's length scale;
#: ``'lightglue'`` -- the widely copied implementation (cvg/LightGlue ``lightglue/lightglue.py``,
#: ``LearnableFourierPositionalEncoding``, also in kornia and transformers' LightGlue) draws std gamma^-2, i.e. reads
#: the paper's second argument as a standard deviation (length scale gamma^2; identical at its gamma = 1).
LFF_FREQ_INITS: tuple[str, ...] = ("paper", "lightglue")


class LearnableFourierFeatures(nn.Module):
    """The paper's Algorithm 1: ``(N, G, M)`` coordinates -> ``(N, D)`` encodings."""

    def __init__(self, coord_dim: int, out_dim: int, fourier_dim: int = 768, hidden_dim: int = 32, groups: int = 1,
                 gamma: float = 0.1, freq_init: str = "paper") -> None:
        super().__init__()
        if fourier_dim % 2:
            raise ValueError(f"lff fourier_dim |F| must be even (cos and sin halves), got {fourier_dim}")
        if out_dim % groups:
            raise ValueError(f"lff: embedding dim {out_dim} is not divisible by groups={groups}")
        if gamma <= 0:
            raise ValueError(f"lff gamma must be > 0, got {gamma}")
        self.coord_dim, self.groups, self.fourier_dim = coord_dim, groups, fourier_dim
        check_choice("freq_init", freq_init, LFF_FREQ_INITS)
        # paper: W_r ~ N(0, gamma^-2), i.e. std 1/gamma; 'lightglue': std gamma^-2 (see LFF_FREQ_INITS)
        self.freq_std = 1.0 / gamma if freq_init == "paper" else gamma**-2
        self.freqs = nn.Parameter(torch.empty(fourier_dim // 2, coord_dim))
        self.reset_parameters()  # before the MLP is built: the same random draws, in the same order, as ever
        self.mlp = nn.Sequential(nn.Linear(fourier_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, out_dim // groups))

    def reset_parameters(self) -> None:
        """``W_r``'s init (the MLP's layers reset themselves)."""
        with torch.no_grad():
            self.freqs.copy_(torch.randn(self.freqs.shape) * self.freq_std)

    def fourier(self, coords: torch.Tensor) -> torch.Tensor:
        """``|F|^-1/2 [cos(X W_r^T) || sin(X W_r^T)]`` in float32: ``(..., G, M)`` -> ``(..., G, |F|)``."""
        if coords.shape[-2:] != (self.groups, self.coord_dim):
            raise ValueError(f"expected coordinates (..., {self.groups}, {self.coord_dim}), got {tuple(coords.shape)}")
        with torch.autocast(device_type=coords.device.type, enabled=False):
            proj = coords.float() @ self.freqs.float().t()
            return torch.cat([proj.cos(), proj.sin()], dim=-1) / math.sqrt(self.fourier_dim)

    def forward(self, coords: torch.Tensor) -> torch.Tensor:
        # the features are float32 whatever the model's dtype; the MLP runs in its weights' dtype (a pure-bf16 model)
        return self.mlp(self.fourier(coords).to(self.mlp[0].weight.dtype)).flatten(-2)


@register_encoding("lff", benchmark=(2,))
class LearnableFourierPE(TokenEncoding):
    """Learnable Fourier features of the normalised patch centres, added once before the blocks.

    Args:
        fourier_dim: ``|F|`` (cos+sin width), default 768.
        hidden_dim: ``|H|`` of the MLP, default 32.
        groups: 1 (joint coordinate, default) or the grid's number of axes (one group per axis).
        gamma: length scale of the init ``W_r ~ N(0, gamma^-2)`` in normalised units, default 0.1.
        freq_init: ``'paper'`` (default: std ``1/gamma``) or ``'lightglue'`` (std ``gamma^-2``); see ``LFF_FREQ_INITS``.
        prefix_embed: learned vectors (zeros init) for the prefix tokens, default True.
    """

    grid_ndims = (2, 3)
    prefix_policy = "prefix tokens get their own learned vectors (zeros init), or nothing with prefix_embed=False"

    #: option rules, checked before __init__ (vispe._checks; see PositionalEncoding.option_checks)
    option_checks = {"fourier_dim": Int(2, multiple_of=2), "hidden_dim": Int(1), "groups": Int(1), "gamma": Real(1e-6),
                     "freq_init": Choice(LFF_FREQ_INITS)}  # W_r ~ N(0, gamma^-2): gamma near 0 overflows

    def __init__(
        self,
        dim: int,
        grid_size: Sequence[int],
        num_prefix_tokens: int = 1,
        fourier_dim: int = 768,
        hidden_dim: int = 32,
        groups: int = 1,
        gamma: float = 0.1,
        prefix_embed: bool = True,
        freq_init: str = "paper",
    ) -> None:
        super().__init__()
        ndim = len(tuple(grid_size))
        if groups not in (1, ndim):
            raise ValueError(f"lff groups={groups} is not valid for a {ndim}-D grid; choose 1 (joint) or {ndim} (per axis)")
        self.ndim = ndim
        self.groups = groups
        self.features = LearnableFourierFeatures(ndim // groups, dim, fourier_dim, hidden_dim, groups, gamma, freq_init)
        self.prefix_embed = nn.Parameter(torch.zeros(1, num_prefix_tokens, dim)) if prefix_embed and num_prefix_tokens else None

    def table_for(self, grid: PositionGrid, device: torch.device | None) -> torch.Tensor:
        self.check_grid(grid)
        if grid.ndim != self.ndim:
            raise ValueError(f"lff was built for {self.ndim}-D grids, got {grid.shape}")
        coords = grid.centers(device).reshape(grid.num_patches, self.groups, self.ndim // self.groups)
        return self.features(coords)  # (N, D)

    def embed_tokens(self, x, grid, state=None, image=None):
        return self.add_to_tokens(x, self.table_for(grid, x.device)[None], grid, self.prefix_embed)

    def no_weight_decay(self) -> set[str]:
        names = {"features.freqs"}
        if self.prefix_embed is not None:
            names.add("prefix_embed")
        return names
