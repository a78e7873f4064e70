"""The position encodings of shipping vision towers: each a learned table **and** a RoPE, as one composed encoding.

Presets (registered names, :class:`~vispe.encodings.composed.ComposedEncoding` subclasses built from the parts below):

* ``qwen3vl_vision`` -- Qwen3-VL's ViT (transformers ``Qwen3VLVisionModel``): a learned ``48 x 48`` table resampled
  bilinearly (``align_corners=True``: the table's corners on the grid's corner patches) to each image's grid and
  added to the patch tokens, plus 2D RoPE over ``(h, w)`` (``P/2`` pairs each, ``theta = 10000``, Qwen's
  ``rotate_half`` pair layout). On videos the same table and rotation act on every frame (time is not encoded in
  the tower).
* ``glm4v_vision`` -- GLM-4V's ViT (``Glm4vVisionModel``): a learned table (the training grid's size) sampled
  bicubically at each patch's centre (``align_corners=False``, border padding), plus the same 2D RoPE as Qwen3-VL.
* ``gemma4_vision`` -- Gemma 4's vision tower (``Gemma4VisionModel``): separate learned column (``x``) and row
  (``y``) tables summed, plus 2D RoPE with ``theta = 100``, ``x`` pairs first. Gemma rotates each axis's half of
  the head with its own ``rotate_half``; vispe rotates the whole head in the ``half`` layout. The two are the same
  rotation up to a fixed permutation of the q/k channels (:func:`gemma4_channel_order`), i.e. a reordering of the
  q/k projection rows when loading Gemma weights.
* ``eva02at`` -- EVA02-AT (Wang et al., 2025) on ``(t, h, w)`` video lattices: learned spatial and temporal tables
  added to the tokens, plus the paper's joint spatial-temporal RoPE: a 2D RoPE over ``(h, w)`` (``P/2`` pairs
  each, ``theta = 10000``) whose angles are added to a temporal RoPE over **all** pairs. The paper's repository
  holds no code; this follows the paper (the temporal base is not stated there: ``temporal_theta=10000``).

Parts (also registered, usable in any composition): ``learned_resampled`` (a fixed-size learned table resampled to
each grid), ``learned_xy`` (summed per-axis tables), ``learned_st`` (spatial + temporal tables), ``rope_st_joint``
(EVA02-AT's joint rotary).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import resample_abs_pos_embed, trunc_normal_

from .._checks import check_choice
from .base import TokenEncoding, register_encoding
from .composed import ComposedEncoding
from .grid import PositionGrid
from .resolution import ResolutionContract
from .rope_vit import RopeAxial, RopeAxial3d

__all__ = ["ResampledTable", "AxisTables", "SpaceTimeTables", "JointSpaceTimeRope", "Qwen3VLVision", "Glm4vVision",
           "Gemma4Vision", "Eva02AT", "gemma4_channel_order", "tower_rope"]

RESAMPLE_MODES = ("bilinear", "bicubic")


def _positive_int(owner: str, option: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {option} must be a positive int, got {value!r}")
    return value


def _table_shape(owner: str, table_size: int | None, grid_size: Sequence[int]) -> tuple[int, int]:
    if table_size is None:
        return int(grid_size[-2]), int(grid_size[-1])
    side = _positive_int(owner, "table_size", table_size)
    return side, side


def _positive(owner: str, option: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{owner}: {option} must be a positive number, got {value!r}")
    return float(value)


def _sample_axis(n: int, align_corners: bool, device) -> torch.Tensor:
    """Normalised ``[-1, 1]`` sampling coordinates of ``n`` patches along one axis (``grid_sample``'s convention)."""
    if align_corners:  # first and last patch on the table's first and last row
        return torch.linspace(-1.0, 1.0, n, device=device) if n > 1 else torch.full((1,), -1.0, device=device)
    return (torch.arange(n, device=device, dtype=torch.float32) + 0.5) / n * 2 - 1  # patch centres


@register_encoding("learned_resampled", benchmark=False)
class ResampledTable(TokenEncoding):
    """A learned table (``table_size`` x ``table_size``; default: the training grid's shape) resampled to each image's
    grid and added to the patch tokens: sampled at every patch with ``mode`` interpolation (``align_corners=True``: the table's corner rows
    on the corner patches; ``False``: at the patch centres), border padding. On ``(t, h, w)`` grids every frame gets
    the same spatial table. Prefix tokens get nothing. ``pos_embed`` ``(1, rows * cols, D)`` is row-major, as a
    transformers ``nn.Embedding`` table of the towers is."""

    grid_ndims = (2, 3)
    prefix_policy = "prefix tokens get nothing added"

    def __init__(
        self,
        dim: int,
        grid_size: Sequence[int],
        table_size: int | None = None,
        mode: str = "bilinear",
        align_corners: bool = True,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        name = self.registry_name
        check_choice("mode", mode, RESAMPLE_MODES)
        if not isinstance(align_corners, bool):
            raise ValueError(f"{name}: align_corners must be True or False, got {align_corners!r}")
        if isinstance(init_std, bool) or not isinstance(init_std, (int, float)) or init_std < 0:
            raise ValueError(f"{name}: init_std must be >= 0, got {init_std!r}")
        self.table_size = _table_shape(name, table_size, grid_size)
        self.mode, self.align_corners = mode, align_corners
        self.pos_embed = nn.Parameter(torch.zeros(1, math.prod(self.table_size), dim))
        if init_std > 0:
            trunc_normal_(self.pos_embed, std=init_std)

    def sample(self, rows: int, cols: int, device=None) -> torch.Tensor:
        """The table resampled to a ``rows x cols`` grid: ``(rows * cols, D)`` float32, row-major."""
        table = self.pos_embed.float().reshape(*self.table_size, -1).permute(2, 0, 1)[None]  # (1, D, R, C)
        ys = _sample_axis(rows, self.align_corners, table.device)
        xs = _sample_axis(cols, self.align_corners, table.device)
        where = torch.stack(torch.meshgrid(xs, ys, indexing="xy"), dim=-1)[None]  # (1, rows, cols, (x, y))
        out = F.grid_sample(table, where, mode=self.mode, padding_mode="border", align_corners=self.align_corners)
        return out[0].flatten(1).t()

    def lattice(self, grid: PositionGrid, device=None) -> torch.Tensor:
        """``(N, D)`` for the lattice tokens of ``grid`` (cached while no gradient must reach the table)."""
        self.check_grid(grid)
        rows, cols = grid.shape[-2:]
        frames = math.prod(grid.shape[:-2])
        plane = self.cached(("sample", rows, cols), lambda: self.sample(rows, cols), uses_parameters=True)
        return plane.repeat(frames, 1) if frames > 1 else plane

    def embed_tokens(self, x, grid, state=None, image=None):
        return self.add_to_tokens(x, self.lattice(grid)[None], grid)

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed"}

    def load_timm_pos_embed(self, pos_embed: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """A timm ``pos_embed`` (with or without prefix rows) resampled (bicubic) onto this table's size."""
        if pos_embed.shape[-1] != self.pos_embed.shape[-1]:
            raise ValueError(f"checkpoint pos_embed width {pos_embed.shape[-1]} does not match the model width {self.pos_embed.shape[-1]}")
        rows = pos_embed.shape[1]
        for prefix in range(0, min(rows, 9)):  # timm models carry 0, 1 (cls) or a few register rows
            side = math.isqrt(rows - prefix)
            if side * side == rows - prefix and side > 0:
                lattice = pos_embed[:, prefix:].float()
                table = resample_abs_pos_embed(lattice, list(self.table_size), [side, side], num_prefix_tokens=0)
                return {"pos_embed": table.to(pos_embed.dtype)}
        return None


@register_encoding("learned_xy", benchmark=False)
class AxisTables(TokenEncoding):
    """Separate learned column (``x``) and row (``y``) tables, ``table_size`` rows each, looked up at each patch's
    integer column and row and summed (Gemma 4's vision tower). ``pos_embed`` ``(2, table_size, D)``: row 0 the
    ``x`` table, row 1 the ``y`` table. A grid wider or taller than ``table_size`` is refused (positions past the
    table have no rows). Default ``table_size``: ``max(64, 4 x`` the longest training side``)``."""

    grid_ndims = (2,)
    prefix_policy = "prefix tokens get nothing added"

    def __init__(self, dim: int, grid_size: Sequence[int], table_size: int | None = None, init_std: float = 0.02) -> None:
        super().__init__()
        name = self.registry_name
        if table_size is None:
            table_size = max(64, 4 * max(int(g) for g in grid_size))
        self.table_size = _positive_int(name, "table_size", table_size)
        if isinstance(init_std, bool) or not isinstance(init_std, (int, float)) or init_std < 0:
            raise ValueError(f"{name}: init_std must be >= 0, got {init_std!r}")
        self.pos_embed = nn.Parameter(torch.zeros(2, self.table_size, dim))
        if init_std > 0:
            trunc_normal_(self.pos_embed, std=init_std)

    def lattice(self, grid: PositionGrid) -> torch.Tensor:
        self.check_grid(grid)
        rows, cols = grid.shape
        if max(rows, cols) > self.table_size:
            raise ValueError(f"{self.registry_name}: grid {rows}x{cols} is larger than the {self.table_size}-row axis tables; "
                             f"build with table_size >= {max(rows, cols)}")
        x_part, y_part = self.pos_embed[0, :cols], self.pos_embed[1, :rows]
        return (y_part[:, None, :] + x_part[None, :, :]).flatten(0, 1)

    def embed_tokens(self, x, grid, state=None, image=None):
        return self.add_to_tokens(x, self.lattice(grid)[None], grid)

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed"}


@register_encoding("learned_st", benchmark=False)
class SpaceTimeTables(TokenEncoding):
    """Learned spatial ``(h, w)`` and temporal ``(t)`` tables added to every ``(t, h, w)`` token (spatial row of its
    patch plus temporal row of its frame; EVA02-AT's input embeddings). Other grids: the spatial table resampled
    bicubically (timm's resampler), the temporal one linearly. Prefix tokens get nothing."""

    grid_ndims = (3,)
    prefix_policy = "prefix tokens get nothing added"

    def __init__(self, dim: int, grid_size: Sequence[int], init_std: float = 0.02) -> None:
        super().__init__()
        gs = tuple(int(g) for g in grid_size)
        if len(gs) != 3 or min(gs) < 1:
            raise ValueError(f"{self.registry_name} needs a (t, h, w) training grid of positive sizes, got grid_size={grid_size!r}")
        if isinstance(init_std, bool) or not isinstance(init_std, (int, float)) or init_std < 0:
            raise ValueError(f"{self.registry_name}: init_std must be >= 0, got {init_std!r}")
        self.grid_size = gs
        self.pos_embed = nn.Parameter(torch.zeros(1, gs[1] * gs[2], dim))
        self.temporal_embed = nn.Parameter(torch.zeros(1, gs[0], dim))
        if init_std > 0:
            trunc_normal_(self.pos_embed, std=init_std)
            trunc_normal_(self.temporal_embed, std=init_std)

    def lattice(self, grid: PositionGrid) -> torch.Tensor:
        self.check_grid(grid)
        t, h, w = grid.shape
        spatial = self.pos_embed
        if (h, w) != self.grid_size[1:]:
            spatial = resample_abs_pos_embed(spatial, [h, w], list(self.grid_size[1:]), num_prefix_tokens=0)
        temporal = self.temporal_embed
        if t != self.grid_size[0]:
            temporal = F.interpolate(temporal.transpose(1, 2), size=t, mode="linear", align_corners=False).transpose(1, 2)
        return (temporal[0][:, None, :] + spatial[0][None, :, :]).flatten(0, 1)

    def embed_tokens(self, x, grid, state=None, image=None):
        return self.add_to_tokens(x, self.lattice(grid)[None], grid)

    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "temporal_embed"}

    def load_timm_pos_embed(self, pos_embed: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """An image model's ``pos_embed`` becomes the spatial table (the temporal one stays as initialised)."""
        rows, (h, w) = pos_embed.shape[1], self.grid_size[1:]
        for prefix in range(0, min(rows, 9)):
            side = math.isqrt(rows - prefix)
            if side * side == rows - prefix and side > 0:
                table = resample_abs_pos_embed(pos_embed[:, prefix:].float(), [h, w], [side, side], num_prefix_tokens=0)
                return {"pos_embed": table.to(pos_embed.dtype)}
        return None


@register_encoding("rope_st_joint", benchmark=False)
class JointSpaceTimeRope(RopeAxial3d):
    """EVA02-AT's joint spatial-temporal RoPE on ``(t, h, w)``: pair ``j`` rotates by
    ``phi_s,j(h, w) + t * temporal_theta^(-j/P)`` -- a 2D axial RoPE over ``(h, w)`` (``P/2`` pairs each,
    ``theta^(-k/(P/2))``) plus a 1D temporal RoPE over all ``P`` pairs. ``extrapolation`` as in
    :class:`~vispe.encodings.rope_vit.RopeAxial` (default ``'rescale'``: EVA-02 rescales positions to its
    pre-training grid)."""

    resolution = ResolutionContract(RopeAxial3d.resolution.policies, default="rescale")

    def __init__(
        self,
        head_dim: int,
        grid_size: Sequence[int] = (8, 14, 14),
        theta: float = 10000.0,
        temporal_theta: float = 10000.0,
        extrapolation: str | None = None,
    ) -> None:
        if head_dim % 4:
            raise ValueError(f"{self.registry_name} splits the pairs between h and w and needs head_dim divisible by 4, got {head_dim}")
        P = head_dim // 2
        super().__init__(head_dim, grid_size, sections=(0, P // 2, P // 2), theta=_positive(self.registry_name, "theta", theta),
                         extrapolation=extrapolation)
        self.temporal_theta = _positive(self.registry_name, "temporal_theta", temporal_theta)

    def angles(self, grid, device):
        idx = self.lattice_indices(grid, device)
        spatial = torch.cat([idx[:, a, None] * self.scaled_frequencies(self.bands(self.sections[a], device), a, grid)
                             for a in self.chunk_axes], dim=-1)  # (N, P), the empty t chunk contributes nothing
        P = spatial.shape[-1]
        ladder = 1.0 / self.temporal_theta ** (torch.arange(P, device=device, dtype=torch.float32) / P)
        return spatial + idx[:, 0, None] * self.scaled_frequencies(ladder, 0, grid)


def tower_rope(head_dim: int, grid_size: Sequence[int], theta: float, x_first: bool, owner: str,
               extrapolation: str | None = None) -> RopeAxial:
    """The towers' 2D RoPE: ``P/2`` pairs over rows and ``P/2`` over columns (``theta^(-k/(P/2))``; columns first when
    ``x_first``), integer positions, the ``half`` pair layout, ``extrapolation`` as in
    :class:`~vispe.encodings.rope_vit.RopeAxial`. On ``(t, h, w)`` grids frames are not rotated."""
    if head_dim % 4:
        raise ValueError(f"{owner}: 2D RoPE gives half the pairs to each axis and needs head_dim divisible by 4, got {head_dim}")
    theta = _positive(owner, "theta", theta)
    half = head_dim // 4
    if len(grid_size) == 3:
        rope: RopeAxial = RopeAxial3d(head_dim, grid_size, sections=(0, half, half), theta=theta,
                                      chunk_axes=(0, 2, 1) if x_first else (0, 1, 2), extrapolation=extrapolation)
    else:
        rope = RopeAxial(head_dim, grid_size, theta=theta, sections=(half, half), chunk_axes=(1, 0) if x_first else (0, 1),
                         extrapolation=extrapolation)
    rope.layout = "half"  # Qwen / GLM / Gemma rotate_half pairs (i, i + P)
    return rope


def gemma4_channel_order(head_dim: int) -> torch.Tensor:
    """Where Gemma 4's q/k channel ``g`` sits in vispe's ``gemma4_vision`` rotation: ``vispe[..., order] = gemma``.

    Gemma splits the head into an ``x`` half and a ``y`` half and pairs ``(i, i + dh/4)`` inside each; vispe pairs
    ``(j, j + dh/2)`` over the whole head, ``x`` pairs first. Rotating Gemma's q and k equals reordering their
    channels by this index, rotating with vispe, and reordering back (and attention logits are unchanged by a
    common reordering of q and k)."""
    P, Q = head_dim // 2, head_dim // 4
    g = torch.arange(head_dim)
    block, i = g // P, g % P  # axis block (0: x, 1: y), channel inside it
    return block * Q + (i % Q) + (i // Q) * P


class _TowerPreset(ComposedEncoding):
    """A preset: its parts are built from the host's context and the preset's own options."""

    resolution = RopeAxial.resolution  # the towers' 2D RoPE part (tower_rope) holds the policy: their extrapolation option
    contract = "rotary"  # a table plus RoPE: the attention side rotates q/k


@register_encoding("qwen3vl_vision", benchmark=False)
class Qwen3VLVision(_TowerPreset):
    """Qwen3-VL's vision-tower position encoding: ``learned_resampled`` (``table_size`` x ``table_size``, bilinear,
    ``align_corners=True``) + 2D RoPE (rows then columns, ``theta``, ``half`` layout). Images and videos."""

    grid_ndims = (2, 3)

    def __init__(self, dim: int, head_dim: int, grid_size: Sequence[int], table_size: int = 48, theta: float = 10000.0,
                 extrapolation: str | None = None) -> None:
        table = ResampledTable(dim, grid_size, table_size=_positive_int("qwen3vl_vision", "table_size", table_size),
                               mode="bilinear", align_corners=True)
        super().__init__([table, tower_rope(head_dim, grid_size, theta, x_first=False, owner="qwen3vl_vision",
                                            extrapolation=extrapolation)])


@register_encoding("glm4v_vision", benchmark=False)
class Glm4vVision(_TowerPreset):
    """GLM-4V's vision-tower position encoding: ``learned_resampled`` (``table_size``, default the training grid;
    bicubic at the patch centres, ``align_corners=False``) + 2D RoPE (rows then columns, ``theta``, ``half`` layout)."""

    grid_ndims = (2, 3)

    def __init__(self, dim: int, head_dim: int, grid_size: Sequence[int], table_size: int | None = None, theta: float = 10000.0,
                 extrapolation: str | None = None) -> None:
        if table_size is not None:
            _positive_int("glm4v_vision", "table_size", table_size)
        table = ResampledTable(dim, grid_size, table_size=table_size, mode="bicubic", align_corners=False)
        super().__init__([table, tower_rope(head_dim, grid_size, theta, x_first=False, owner="glm4v_vision",
                                            extrapolation=extrapolation)])


@register_encoding("gemma4_vision", benchmark=False)
class Gemma4Vision(_TowerPreset):
    """Gemma 4's vision-tower position encoding: ``learned_xy`` (summed column and row tables, ``table_size`` rows;
    transformers' default is 10240) + 2D RoPE (columns then rows, ``theta = 100``, ``half`` layout; Gemma's own
    per-axis layout is a channel reordering of it, :func:`gemma4_channel_order`)."""

    grid_ndims = (2,)

    def __init__(self, dim: int, head_dim: int, grid_size: Sequence[int], table_size: int | None = None, theta: float = 100.0,
                 extrapolation: str | None = None) -> None:
        table = AxisTables(dim, grid_size, table_size=table_size)
        super().__init__([table, tower_rope(head_dim, grid_size, theta, x_first=True, owner="gemma4_vision",
                                            extrapolation=extrapolation)])


@register_encoding("eva02at", benchmark=False)
class Eva02AT(_TowerPreset):
    """EVA02-AT: ``learned_st`` (spatial + temporal tables) + ``rope_st_joint`` (2D spatial RoPE plus temporal RoPE
    over all pairs). Videos (``(t, h, w)`` grids)."""

    grid_ndims = (3,)
    resolution = JointSpaceTimeRope.resolution  # its extrapolation option is the rotary part's

    def __init__(
        self,
        dim: int,
        head_dim: int,
        grid_size: Sequence[int],
        theta: float = 10000.0,
        temporal_theta: float = 10000.0,
        extrapolation: str | None = None,
    ) -> None:
        if len(tuple(grid_size)) != 3:
            raise ValueError(f"eva02at encodes (t, h, w) video lattices, got grid_size={tuple(grid_size)}; use a video model")
        super().__init__([SpaceTimeTables(dim, grid_size),
                          JointSpaceTimeRope(head_dim, grid_size, theta=theta, temporal_theta=temporal_theta, extrapolation=extrapolation)])
