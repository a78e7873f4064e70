"""Absolute baselines: no PE, learned APE (timm's), fixed 2D sin-cos."""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
from timm.layers import build_sincos2d_pos_embed, resample_abs_pos_embed, trunc_normal_

from .base import PositionalEncoding, TokenEncoding, register_encoding
from .grid import PositionGrid

__all__ = ["NoPE", "LearnedAbsolute", "FixedTableEncoding", "SinCos2d", "EXTRAPOLATION_MODES"]

#: How an absolute table reaches a grid it was not built for.
#: 'extend' evaluates the formula at the new integer indices; 'interpolate' resamples the
#: training-grid table to the new grid (positions keep their relative place in the image).
EXTRAPOLATION_MODES = ("extend", "interpolate")


def _check_choice(name: str, value: Any, choices: Sequence[Any]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {list(choices)}")


@register_encoding("none")
class NoPE(PositionalEncoding):
    """No positional information at all (the lower bound of every comparison)."""

    kind = "none"
    prefix_policy = "nothing is added anywhere"


@register_encoding("learned")
class LearnedAbsolute(TokenEncoding):
    """timm's learned absolute position embedding, resampled for new grids.

    The table has timm's layout ``(1, S + N, D)`` (``embed_prefix=True``, timm's default) or
    ``(1, N, D)`` (``embed_prefix=False``, timm's ``no_embed_class``), timm's init
    (truncated normal, std 0.02) and timm's resampler (bicubic, antialiased), so a timm ViT
    checkpoint's ``pos_embed`` drops in unchanged.
    """

    grid_ndims = (2,)
    prefix_policy = "prefix tokens get their own learned rows (embed_prefix=True) or nothing (embed_prefix=False)"

    def __init__(
        self,
        dim: int,
        grid_size: Sequence[int],
        num_prefix_tokens: int = 1,
        embed_prefix: bool = True,
        interpolation: str = "bicubic",
        antialias: bool = True,
    ) -> None:
        super().__init__()
        self.grid_size = tuple(int(g) for g in grid_size)
        self.embed_prefix = embed_prefix
        self.num_prefix_rows = num_prefix_tokens if embed_prefix else 0
        self.interpolation = interpolation
        self.antialias = antialias
        rows = self.num_prefix_rows + math.prod(self.grid_size)
        self.pos_embed = nn.Parameter(torch.zeros(1, rows, dim))
        trunc_normal_(self.pos_embed, std=0.02)
        self._resample_cache: OrderedDict[Any, torch.Tensor] = OrderedDict()

    def resample(self, table: torch.Tensor, old: tuple[int, ...], new: tuple[int, ...]) -> torch.Tensor:
        return resample_abs_pos_embed(
            table, new_size=list(new), old_size=list(old), num_prefix_tokens=self.num_prefix_rows,
            interpolation=self.interpolation, antialias=self.antialias,
        )

    def table_for(self, grid: PositionGrid) -> torch.Tensor:
        self.check_grid(grid)
        if grid.shape == self.grid_size:
            return self.pos_embed
        if torch.is_grad_enabled() and self.pos_embed.requires_grad:
            return self.resample(self.pos_embed, self.grid_size, grid.shape)
        # no gradient flows into the table: resample once per (grid, table version), not per call
        p = self.pos_embed
        key = (grid.shape, p.data_ptr(), p._version, p.device, p.dtype)
        table = self._resample_cache.get(key)
        if table is None:
            with torch.inference_mode(False), torch.no_grad():  # a plain tensor, reusable when training resumes
                table = self.resample(p, self.grid_size, grid.shape)
            self._resample_cache[key] = table
            while len(self._resample_cache) > 8:
                self._resample_cache.popitem(last=False)
        else:
            self._resample_cache.move_to_end(key)
        return table

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

    def _apply(self, fn, *args, **kwargs):  # device/dtype moves invalidate resampled tables
        self._resample_cache.clear()
        return super()._apply(fn, *args, **kwargs)

    @torch.no_grad()
    def set_grid_size(self, grid_size: Sequence[int]) -> None:
        new = tuple(int(g) for g in grid_size)
        if new != self.grid_size:
            self.pos_embed = nn.Parameter(
                self.resample(self.pos_embed.data, self.grid_size, new), requires_grad=self.pos_embed.requires_grad
            )
            self.grid_size = new
            self._resample_cache.clear()

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
    cache_size = 16

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self._cache: dict[Any, torch.Tensor] = {}

    def build_table(self, grid: PositionGrid, device: torch.device | None) -> torch.Tensor:
        """The lattice table ``(1, N, D)`` of ``grid`` (float32)."""
        raise NotImplementedError

    def _cached(self, key: Any, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        table = self._cache.get(key)
        if table is None:
            with torch.inference_mode(False), torch.no_grad():  # cached: a plain tensor, usable later in training
                table = build()
            if len(self._cache) > self.cache_size:
                self._cache.clear()
            self._cache[key] = table
        return table

    def table_for(self, grid: PositionGrid, device: torch.device | None) -> torch.Tensor:
        """``(1, N, D)``: the lattice table of ``grid`` (cached)."""
        self.check_grid(grid)
        return self._cached((grid.shape, str(device)), lambda: self.build_table(grid, device))

    def sequence_table(self, grid: PositionGrid, device: torch.device | None, dtype: torch.dtype) -> torch.Tensor:
        """``(1, S + N, D)``: zero rows for the prefix tokens, then the lattice table, in ``dtype`` (cached)."""

        def build() -> torch.Tensor:
            lattice = self.table_for(grid, device)
            return torch.cat([lattice.new_zeros(1, grid.num_prefix_tokens, self.dim), lattice], dim=1).to(dtype)

        return self._cached(("seq", grid.shape, grid.num_prefix_tokens, str(device), dtype), build)

    def embed_tokens(self, x, grid, state=None, image=None):
        return x + self.sequence_table(grid, x.device, x.dtype)

    def set_grid_size(self, grid_size: Sequence[int]) -> None:
        self.grid_size = tuple(int(g) for g in grid_size)
        self._cache.clear()


@register_encoding("sincos2d")
class SinCos2d(FixedTableEncoding):
    """Fixed 2D sin-cos table (timm's ``build_sincos2d_pos_embed``: rows then columns, sin then cos).

    ``extrapolation='extend'`` evaluates the formula at the new integer indices;
    ``'interpolate'`` resamples the training-grid table bicubically, as timm does for APE.
    """

    grid_ndims = (2,)

    def __init__(
        self,
        dim: int,
        grid_size: Sequence[int] = (14, 14),
        temperature: float = 10000.0,
        extrapolation: str = "extend",
    ) -> None:
        super().__init__(dim)
        if dim % 4:
            raise ValueError(f"sincos2d needs an embedding dim divisible by 4, got dim={dim}")
        _check_choice("extrapolation", extrapolation, EXTRAPOLATION_MODES)
        self.grid_size = tuple(int(g) for g in grid_size)
        self.temperature = temperature
        self.extrapolation = extrapolation

    def build_table(self, grid: PositionGrid, device: torch.device | None) -> torch.Tensor:
        if self.extrapolation == "extend" or grid.shape == self.grid_size:
            table = build_sincos2d_pos_embed(list(grid.shape), dim=self.dim, temperature=self.temperature, device=device)
        else:
            base = build_sincos2d_pos_embed(list(self.grid_size), dim=self.dim, temperature=self.temperature, device=device)
            table = resample_abs_pos_embed(base[None], list(grid.shape), list(self.grid_size), num_prefix_tokens=0)[0]
        return table[None]
