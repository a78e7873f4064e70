"""Absolute baselines: no PE, learned APE (timm's), fixed 2D sin-cos."""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn as nn
from timm.layers import build_sincos2d_pos_embed, resample_abs_pos_embed, trunc_normal_

from .._checks import Choice, Real, check_choice
from .base import PositionalEncoding, TokenEncoding, register_encoding
from .coordinates import CoordinateAugmentation, random_lattice_indices
from .grid import PositionGrid
from .resolution import ResolutionContract, table_under_policy
from .spec import EXTRAPOLATION_MODES

__all__ = ["NoPE", "LearnedAbsolute", "FixedTableEncoding", "SinCos2d", "EXTRAPOLATION_MODES"]  # EXTRAPOLATION_MODES: from .spec


@register_encoding("none", groups=("scaling",))
class NoPE(PositionalEncoding):
    """No positional information at all (the lower bound of every comparison)."""

    kind = "none"
    prefix_policy = "nothing is added anywhere"


#: how the learned table starts: timm's truncated normal (std ``init_std``), or the 2D sin-cos table
LEARNED_INITS: tuple[str, ...] = ("trunc_normal", "sincos2d")


@register_encoding("learned", groups=("scaling",))
class LearnedAbsolute(TokenEncoding):
    """timm's learned absolute position embedding, resampled for new grids.

    The table has timm's layout ``(1, S + N, D)`` (``embed_prefix=True``, timm's default) or
    ``(1, N, D)`` (``embed_prefix=False``, timm's ``no_embed_class``), timm's init
    (truncated normal, std 0.02) and timm's resampler (bicubic, antialiased), so a timm ViT
    checkpoint's ``pos_embed`` drops in unchanged. ``init='sincos2d'`` starts the lattice rows from the
    fixed 2D sin-cos table (prefix rows zero) instead; ``init_std`` sets the truncated-normal std.
    """

    grid_ndims = (2,)
    prefix_policy = "prefix tokens get their own learned rows (embed_prefix=True) or nothing (embed_prefix=False)"

    #: option rules, checked before __init__ (vispe._checks; see PositionalEncoding.option_checks)
    option_checks = {
        "interpolation": Choice(("nearest", "nearest-exact", "bilinear", "bicubic", "area")),
        "init": Choice(LEARNED_INITS),
        "init_std": Real(0, 1e3),
    }

    def __init__(
        self,
        dim: int,
        grid_size: Sequence[int],
        num_prefix_tokens: int = 1,
        embed_prefix: bool = True,
        interpolation: str = "bicubic",
        antialias: bool = True,
        init: str = "trunc_normal",
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        check_choice("init", init, LEARNED_INITS)
        if init_std < 0:
            raise ValueError(f"init_std must be >= 0, got {init_std!r}")
        self.grid_size = tuple(int(g) for g in grid_size)
        self.embed_prefix = embed_prefix
        self.num_prefix_rows = num_prefix_tokens if embed_prefix else 0
        self.interpolation = interpolation
        self.antialias = antialias
        rows = self.num_prefix_rows + math.prod(self.grid_size)
        self.pos_embed = nn.Parameter(torch.zeros(1, rows, dim))
        if init == "sincos2d":
            # the fixed 2D sin-cos table as a starting point (prefix rows zero): a table that already has
            # the lattice's geometry, as a pretrained one does, instead of unstructured noise
            if dim % 4:
                raise ValueError(f"init='sincos2d' needs an embedding dim divisible by 4, got dim={dim}")
            with torch.no_grad():
                self.pos_embed[0, self.num_prefix_rows :] = build_sincos2d_pos_embed(list(self.grid_size), dim=dim)
        elif init_std > 0:
            trunc_normal_(self.pos_embed, std=init_std)

    def resample(self, table: torch.Tensor, old: tuple[int, ...], new: tuple[int, ...]) -> torch.Tensor:
        return resample_abs_pos_embed(
            table, new_size=list(new), old_size=list(old), num_prefix_tokens=self.num_prefix_rows,
            interpolation=self.interpolation, antialias=self.antialias,
        )

    def table_for(self, grid: PositionGrid) -> torch.Tensor:
        self.check_grid(grid)
        if grid.shape == self.grid_size:
            return self.pos_embed
        # while no gradient flows into the table, resample once per (grid, table version), not per call
        p = self.pos_embed
        key = ("resample", grid.shape, p.device, p.dtype)
        return self.cached(key, lambda: self.resample(p, self.grid_size, grid.shape), uses_parameters=True)

    def embed_tokens(self, x, grid, state=None, image=None):
        if self.embed_prefix and grid.num_prefix_tokens != self.num_prefix_rows:
            raise ValueError(
                f"learned table has {self.num_prefix_rows} prefix rows but the sequence has {grid.num_prefix_tokens} prefix tokens"
            )
        pe = self.table_for(grid)
        if self.embed_prefix or grid.num_prefix_tokens == 0:
            return x + pe
        # zero rows for the prefix tokens: one add over the sequence instead of slice + add + cat
        s = grid.num_prefix_tokens
        return x + torch.cat([pe.new_zeros(1, s, pe.shape[-1]), pe], dim=1)

    @torch.no_grad()
    def set_grid_size(self, grid_size: Sequence[int]) -> None:
        new = tuple(int(g) for g in grid_size)
        if new != self.grid_size:
            self.pos_embed = nn.Parameter(
                self.resample(self.pos_embed.data, self.grid_size, new), requires_grad=self.pos_embed.requires_grad
            )
            self.grid_size = new
            self.clear_cache()

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed"}

    def load_timm_pos_embed(self, pos_embed: torch.Tensor) -> dict[str, torch.Tensor]:
        if pos_embed.shape[-1] != self.pos_embed.shape[-1]:
            raise ValueError(f"checkpoint pos_embed width {pos_embed.shape[-1]} does not match the model width {self.pos_embed.shape[-1]}")
        n = pos_embed.shape[1] - self.num_prefix_rows
        side = math.isqrt(max(n, 0))
        if n <= 0 or side * side != n:
            raise ValueError(
                f"checkpoint pos_embed has {pos_embed.shape[1]} rows, which is not {self.num_prefix_rows} prefix rows plus a square grid; "
                f"set embed_prefix to match the checkpoint (timm no_embed_class models have no prefix rows)"
            )
        if (side, side) == self.grid_size:
            return {"pos_embed": pos_embed}
        return {"pos_embed": self.resample(pos_embed.float(), (side, side), self.grid_size).to(pos_embed.dtype)}


class FixedTableEncoding(TokenEncoding):
    """A parameter-free table added to the tokens (sin-cos in 2D and 3D), cached per grid.

    Subclasses implement :meth:`build_table` (``(1, N, D)`` for the lattice). The table is built once per
    (grid, device) -- outside ``inference_mode``, so a table first built while validating still works
    in training -- and added with one add over the whole sequence (zero rows for the prefix tokens)
    instead of slice + add + concatenate.
    """

    prefix_policy = "prefix tokens get nothing added"
    cache_size = 16  # lattice and sequence tables per grid

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def build_table(self, grid: PositionGrid, device: torch.device | None) -> torch.Tensor:
        """The lattice table ``(1, N, D)`` of ``grid`` (float32)."""
        raise NotImplementedError

    def table_for(self, grid: PositionGrid, device: torch.device | None) -> torch.Tensor:
        """``(1, N, D)``: the lattice table of ``grid`` (cached)."""
        self.check_grid(grid)
        return self.cached(("lattice", grid.shape, str(device)), lambda: self.build_table(grid, device))

    def sequence_table(self, grid: PositionGrid, device: torch.device | None, dtype: torch.dtype) -> torch.Tensor:
        """``(1, S + N, D)``: zero rows for the prefix tokens, then the lattice table, in ``dtype`` (cached)."""

        def build() -> torch.Tensor:
            lattice = self.table_for(grid, device)
            return torch.cat([lattice.new_zeros(1, grid.num_prefix_tokens, self.dim), lattice], dim=1).to(dtype)

        return self.cached(("seq", grid.shape, grid.num_prefix_tokens, str(device), dtype), build)

    def embed_tokens(self, x, grid, state=None, image=None):
        return x + self.sequence_table(grid, x.device, x.dtype)

def sincos2d_from_indices(idx: torch.Tensor, dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """timm's 2D sin-cos table (``build_sincos2d_pos_embed``: rows then columns, sin block then cos block) at
    arbitrary ``(N, 2)`` (row, column) indices: ``(N, dim)`` float32."""
    pos_dim = dim // 4
    bands = 1.0 / temperature ** (torch.arange(pos_dim, device=idx.device, dtype=torch.float32) / pos_dim)
    pos2 = idx.float()[:, :, None] * bands  # (N, 2, pos_dim)
    return torch.stack([torch.sin(pos2), torch.cos(pos2)], dim=1).flatten(1)


@register_encoding("sincos2d")
class SinCos2d(CoordinateAugmentation, FixedTableEncoding):
    """Fixed 2D sin-cos table (timm's ``build_sincos2d_pos_embed``: rows then columns, sin then cos).

    ``extrapolation='extend'`` (default) evaluates the formula at the new integer indices;
    ``'resample'`` (alias ``'interpolate'``) resamples the training-grid table (bicubic, antialiased: timm's APE
    resampler, :func:`~vispe.encodings.resolution.resample_table`).
    ``random_positions=r > 1`` (RPE-2D, training only): each forward evaluates the formula at ordered random
    row / column indices drawn from a grid ``r`` times the training one (:func:`random_lattice_indices`).
    """

    grid_ndims = (2,)

    #: option rules, checked before __init__ (vispe._checks; see PositionalEncoding.option_checks)
    option_checks = {"temperature": Real(1)}
    resolution = ResolutionContract(("extend", "resample"), default="extend")
    coordinate_options = ("random_positions",)

    def __init__(
        self,
        dim: int,
        grid_size: Sequence[int] = (14, 14),
        temperature: float = 10000.0,
        extrapolation: str | None = None,
        random_positions: float = 1.0,
    ) -> None:
        super().__init__(dim)
        if dim % 4:
            raise ValueError(f"sincos2d needs an embedding dim divisible by 4, got dim={dim}")
        self.grid_size = tuple(int(g) for g in grid_size)
        self.temperature = temperature
        self.extrapolation = extrapolation
        self.set_coordinate_augmentation(random_positions=random_positions)

    def embed_tokens(self, x, grid, state=None, image=None):
        if not (self.training and self.random_positions > 1):
            return super().embed_tokens(x, grid, state, image)
        self.check_grid(grid)
        idx = random_lattice_indices(grid.shape, self.random_position_pools(grid.shape, self.grid_size), x.device)
        return self.add_to_tokens(x, sincos2d_from_indices(idx, self.dim, self.temperature)[None], grid)

    def build_table(self, grid: PositionGrid, device: torch.device | None) -> torch.Tensor:
        def build(shape: tuple[int, ...]) -> torch.Tensor:
            return build_sincos2d_pos_embed(list(shape), dim=self.dim, temperature=self.temperature, device=device)

        return table_under_policy(self.resolution_policy, grid.shape, self.grid_size, build)[None]
