"""Multimodal (LLM-side) rotary encodings: one recipe for every scheme.

Each token carries ``K`` coordinates (built by :mod:`vispe.positions`) and each rotation pair ``i``
reads one of them through a pair->axis map ``a(i)`` with frequency ``f_i``:

    phi[b, (h,) n, i] = pos[a(i), b, n] * f_i            (0 where a(i) = -1: a NoPE pair/head)

so q.k depends only on per-axis coordinate differences. Angles are float32 with autocast off and
are turned into a complex table by :func:`vispe.encodings.rotary.rotary_table`; q and k are rotated
only by :func:`vispe.encodings.rotary.apply_rotary`, in the ``'half'`` layout (pair ``i`` = channels
``(i, i + P)``, as in Qwen/HF LLMs; the ViT side of vispe uses ``'interleaved'``, pair ``i`` =
channels ``(2i, 2i+1)``; ``layout='interleaved'`` is accepted here too, but weights trained in one
layout do not transfer to the other).

==================  ===  ===============================================================
name                 K   pair->axis map and frequencies (``P = head_dim / 2``)
==================  ===  ===============================================================
``rope_1d``          1   every pair reads the 1D position, ``f_i = theta^(-2i/d)``
``mrope``            3   chunks ``[0,s_t) -> t, [s_t, s_t+s_h) -> h, rest -> w`` (``mrope_section``,
                         default 2:3:3, e.g. ``[16, 24, 24]`` for ``d = 128``)
``mrope_interleave`` 3   round-robin t,h,w over ``3*s_h`` pairs, the tail reads t (default 24:20:20)
``mhrope``           3   per head: ``mrope_section`` counts heads ``[H_t, H_h, H_w]``; each head uses
                         the full ladder on its axis; heads past the sum are NoPE
``vrope``            4   ``a(i) = i mod 4``
``videorope``        3   fast pairs alternate h (even) / w (odd); the slowest ``temporal_pairs``
                         (default ``P/4``, 16 of 64 for ``d = 128``) read t (low-frequency temporal)
``hope``             3   ``videorope``'s map, its temporal pairs at **zero frequency**
``v2pe``             1   as ``rope_1d`` (the scheme lives in the positions)
``qwen3vl``          3   ``mrope_interleave``'s map (Qwen3-VL's ``apply_interleaved_mrope`` is the
                         same round robin; default 24:20:20)
==================  ===  ===============================================================

VideoRoPE (Wei et al., ICML 2025, arXiv 2502.05173): the map follows the released code (pair ``2j`` ->
h, ``2j+1`` -> w below ``P - temporal_pairs``, the rest -> t), the paper's split of 48 / 48 / 32 channels
(x, y, t) for ``d = 128``. The unified Multimodal-RoPEs repository differs slightly (pair 0 also reads t,
h takes the odd pairs, w the even ones); vispe keeps VideoRoPE's own. Qwen3-VL's checkpoints use
``theta = 5e6``; vispe's default base stays ``10000`` like every scheme here (pass ``theta`` to match).

Use: ``enc = create_encoding('mrope', EncodingContext(...))``; ``table = enc.table_from_positions(pos)``
with ``pos`` of shape ``(K, B, L)`` gives a complex table ``(B, 1 or H, L, P)``; ``enc.rotate(q, table)``
rotates ``q``/``k`` of shape ``(B, H, L, d)``. The usual lattice hook ``angles(grid)`` also works: a
``(t, h, w)`` grid is read as one visual block, so these encodings can sit in a ViT too.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..positions import Text, Visual, build_positions, get_scheme
from .._checks import Choice, Int, Ints, Real
from .base import register_encoding
from .grid import PositionGrid
from .rotary import ROTARY_LAYOUTS, LayerThetaState, RotaryEncoding, apply_rotary, rotary_table

__all__ = [
    "KeyTable",
    "V2PE",
    "HoPE",
    "MHRope",
    "MRope",
    "MRopeInterleave",
    "MultimodalRotary",
    "Qwen3VLRope",
    "Rope1d",
    "VRope",
    "VideoRoPE",
]



@dataclass(frozen=True)
class KeyTable:
    """A decoder's rotation state for ``attend``: the table ``(B, 1|H, Lk, P)`` of all its keys (cached keys first,
    then this step's tokens). The queries are the last ``Lq`` of those keys, so they take the table's last rows."""

    table: torch.Tensor


def _check_layout(layout: str) -> None:
    if layout not in ROTARY_LAYOUTS:
        raise ValueError(f"unknown rotary layout {layout!r}; choose one of {ROTARY_LAYOUTS}")


def _check_head_dim(name: str, head_dim: int) -> int:
    if head_dim % 2 or head_dim < 2:
        raise ValueError(f"{name} rotates channel pairs and needs an even head_dim >= 2, got head_dim={head_dim}")
    return head_dim // 2


class MultimodalRotary(RotaryEncoding):
    """Base class: pair->axis map (``(P,)`` or per-head ``(H, P)``, ``-1`` = NoPE) and per-pair frequencies."""

    kind = "rotary"
    grid_ndims = (1, 2, 3)
    prefix_policy: ClassVar[str] = "lattice use only: prefix tokens are not rotated (identity rotation)"

    @property
    def num_coords(self) -> int:
        """Coordinates per token, from the scheme record (:data:`vispe.positions.SCHEMES`)."""
        return get_scheme(self.registry_name).num_coords

    #: option rules, checked before __init__ (vispe._checks; see PositionalEncoding.option_checks)
    option_checks = {
        "head_dim": Int(2, multiple_of=2),
        "theta": Real(1),  # the base of the ladder theta^(-2i/d); below 1 it grows (and overflows near 0)
        "layout": Choice(ROTARY_LAYOUTS),
        "mrope_section": Ints(0, length=3, optional=True),
        "temporal_pairs": Int(0, optional=True),
    }

    def __init__(self, head_dim: int, theta: float = 10000.0, layout: str = "half") -> None:
        super().__init__()
        self.num_pairs = _check_head_dim(self.registry_name or type(self).__name__, head_dim)
        if not theta > 0:
            raise ValueError(f"theta (rotary base) must be > 0, got {theta!r}")
        _check_layout(layout)
        self.head_dim = head_dim
        self.theta = float(theta)
        self.layout = layout

    # -- allocation ------------------------------------------------------------------------
    def inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The base ladder ``theta^(-2i/d)``, float32 ``(P,)`` (pair 0 is the fastest)."""
        i = torch.arange(self.num_pairs, device=device, dtype=torch.float64)
        return (self.theta ** (-2.0 * i / self.head_dim)).to(torch.float32)

    def axis_map(self) -> torch.Tensor:
        """int64 ``(P,)`` or ``(H, P)``: the coordinate each pair reads (``-1``: none)."""
        return torch.zeros(self.num_pairs, dtype=torch.int64)

    def pair_frequencies(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Frequency of each pair, float32 ``(P,)`` (HoPE zeroes its temporal pairs)."""
        return self.inv_freq(device)

    # -- angles ---------------------------------------------------------------------------
    def check_positions(self, pos: torch.Tensor) -> torch.Tensor:
        if not isinstance(pos, torch.Tensor):
            raise TypeError(f"positions must be a tensor of shape (K, B, L) or (K, L), got {type(pos).__name__}")
        if pos.ndim == 2:
            pos = pos[:, None]
        if pos.ndim != 3 or pos.shape[0] != self.num_coords:
            raise ValueError(
                f"{self.registry_name!r} takes positions of shape ({self.num_coords}, B, L) (K={self.num_coords} coordinates "
                f"per token), got {tuple(pos.shape)}; build them with vispe.positions.build_positions({self.registry_name!r}, ...)"
            )
        return pos

    def angles_from_positions(self, pos: torch.Tensor) -> torch.Tensor:
        """float32 angles ``(B, 1, L, P)`` (shared map) or ``(B, H, L, P)`` (per-head map) from ``pos (K, B, L)``."""
        pos = self.check_positions(pos)
        dev = pos.device
        dev_type = dev.type
        # float64 positions are those float32 cannot hold exactly (vispe.positions): their angles are formed in
        # float64, so distinct positions keep distinct rotations and relative angles stay exact far out
        wide = pos.dtype == torch.float64
        with torch.autocast(device_type=dev_type, enabled=False):
            p = pos.to(torch.float64 if wide else torch.float32)
            amap = self.axis_map().to(dev)
            freq = self.pair_frequencies(dev).to(p.dtype)
            none = amap < 0
            idx = amap.clamp(min=0)
            if amap.ndim == 1:
                sel = p[idx].permute(1, 2, 0)  # (B, L, P): the coordinate each pair reads
                ang = (sel * freq).masked_fill(none, 0.0)[:, None]
                sel = sel[:, None]
            else:
                sel = p[idx].permute(2, 0, 3, 1)  # (B, H, L, P)
                ang = (sel * freq).masked_fill(none[None, :, None, :], 0.0)
            if wide:
                # up to 2^16 the float64 product rounds to the float32 path's angle bit for bit; past it (where
                # float32 angles are off by >= 2^-7 rad per unit frequency) angles are reduced mod 2*pi in float64
                far = sel.abs() > 2.0**16
                ang = torch.where(far, torch.remainder(ang, 2 * math.pi), ang).to(torch.float32)
        return ang

    def table_from_positions(self, pos: torch.Tensor) -> torch.Tensor | LayerThetaState:
        """Complex64 rotation table ``(B, 1|H, L, P)`` for multimodal positions ``(K, B, L)`` (under ``layer_theta``:
        one table per base, which :meth:`rotate_qk` picks by layer)."""
        per_theta = self._modules.get("layer_theta_encodings")
        if per_theta is not None:
            return LayerThetaState(tuple(e.table_from_positions(pos) for e in per_theta), self.layer_schedule.theta_index)
        with torch.autocast(device_type=pos.device.type, enabled=False):
            return rotary_table(self.angles_from_positions(pos))

    def rotate(self, x: torch.Tensor, table: Any, layer: int = 0) -> torch.Tensor:  # type: ignore[override]
        """Rotate ``q`` or ``k`` (``(B, H, L, d)``) with a table from :meth:`table_from_positions`, a
        :class:`KeyTable` (its last ``L`` rows) or a lattice state."""
        if isinstance(table, KeyTable):
            table = table.table[..., table.table.shape[-2] - x.shape[-2]:, :]
        elif hasattr(table, "for_layer"):
            table = table.for_layer(layer)
        return apply_rotary(x, table, self.layout)

    # -- positions helpers -----------------------------------------------------------------
    def build_positions(self, segments: Sequence[Any], **scheme_kwargs: Any):
        """``vispe.positions.build_positions`` with this encoding's scheme name."""
        return build_positions(self.registry_name, segments, **scheme_kwargs)

    # -- lattice use (a grid is read as one visual block) ----------------------------------
    def angles(self, grid: PositionGrid, device: torch.device | None) -> torch.Tensor:
        pos = _lattice_positions(self.registry_name, *grid.shape)
        ang = self.angles_from_positions(pos.to(device))[0]  # (1|H, N, P)
        return ang[0] if ang.shape[0] == 1 and self.axis_map().ndim == 1 else ang

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, layout={self.layout!r}, K={self.num_coords}"


def _section_axes(section: Sequence[int]) -> torch.Tensor:
    """``[0] * section[0] + [1] * section[1] + [2] * section[2]`` as int64 (built from Python ints: a compiled graph
    cannot size a ``repeat_interleave`` by a tensor)."""
    return torch.tensor([axis for axis, n in enumerate(section) for _ in range(n)], dtype=torch.int64)


@torch.compiler.assume_constant_result
def _lattice_positions(scheme: str, *shape: int) -> torch.Tensor:
    """A lattice read as one visual block (a 1D grid as text): the scheme's position ids ``(K, 1, L)``. A pure function
    of the scheme and the grid's sizes, so a compiled model takes it as a constant instead of tracing the builders
    (whose next-free-position bookkeeping reads tensor values)."""
    seg = Text(shape[0]) if len(shape) == 1 else Visual(*(((1,) + shape) if len(shape) == 2 else shape))
    pos, _ = build_positions(scheme, [seg])
    return pos


def _default_sections(P: int, ratio: Sequence[int]) -> list[int]:
    tot = sum(ratio)
    s_h = (P * ratio[1]) // tot
    s_w = (P * ratio[2]) // tot
    return [P - s_h - s_w, s_h, s_w]


def _check_section(name: str, section: Sequence[int], total: int, what: str) -> list[int]:
    section = list(section)
    if len(section) != 3 or any(not isinstance(s, int) or s < 0 for s in section) or sum(section) != total:
        raise ValueError(f"{name}: mrope_section must be three non-negative ints (t, h, w) summing to {total} {what}, got {section}")
    return section


@register_encoding("rope_1d", benchmark=False)
class Rope1d(MultimodalRotary):
    """Plain 1D RoPE over all pairs (the text LLM baseline; visual tokens get consecutive indices)."""



@register_encoding("v2pe", benchmark=False)
class V2PE(MultimodalRotary):
    """V2PE (Ge et al. 2024): 1D RoPE; visual tokens advance by ``delta`` in :mod:`vispe.positions`."""



@register_encoding("mrope", benchmark=False)
class MRope(MultimodalRotary):
    """M-RoPE (Qwen2-VL): contiguous t / h / w pair chunks given by ``mrope_section`` (pairs)."""


    def __init__(self, head_dim: int, mrope_section: Sequence[int] | None = None, theta: float = 10000.0, layout: str = "half") -> None:
        super().__init__(head_dim, theta, layout)
        P = self.num_pairs
        if mrope_section is None:
            mrope_section = _default_sections(P, (2, 3, 3))
        self.mrope_section = _check_section("mrope", mrope_section, P, "pairs (head_dim / 2)")

    def axis_map(self) -> torch.Tensor:
        return _section_axes(self.mrope_section)


@register_encoding("mrope_interleave", benchmark=False)
class MRopeInterleave(MultimodalRotary):
    """MRoPE-Interleave (Huang et al. 2025): pairs cycle t, h, w (``mrope_section`` counts pairs, default 24:20:20)."""


    def __init__(self, head_dim: int, mrope_section: Sequence[int] | None = None, theta: float = 10000.0, layout: str = "half") -> None:
        super().__init__(head_dim, theta, layout)
        P = self.num_pairs
        name = self.registry_name or type(self).__name__
        if mrope_section is None:
            mrope_section = _default_sections(P, (24, 20, 20))
        sec = _check_section(name, mrope_section, P, "pairs (head_dim / 2)")
        if 3 * sec[1] - 2 >= P or 3 * sec[2] - 1 >= P:
            raise ValueError(
                f"{name}: mrope_section={sec} does not fit round-robin into {P} pairs (needs 3*s_h-2 < P and 3*s_w-1 < P)"
            )
        self.mrope_section = sec

    def axis_map(self) -> torch.Tensor:
        a = torch.zeros(self.num_pairs, dtype=torch.int64)
        _, s_h, s_w = self.mrope_section
        a[1 : 3 * s_h : 3] = 1
        a[2 : 3 * s_w : 3] = 2
        return a


@register_encoding("qwen3vl", benchmark=False)
class Qwen3VLRope(MRopeInterleave):
    """Qwen3-VL (Qwen team 2025): MRoPE-Interleave's frequency map (``mrope_section`` default 24:20:20);
    its positions (per-patch ``(1, H, W)`` blocks after timestamp text) live in :mod:`vispe.positions`."""


@register_encoding("mhrope", benchmark=False)
class MHRope(MultimodalRotary):
    """Multi-Head RoPE (Huang et al. 2025): whole heads read one axis over the full ladder.

    ``mrope_section = [H_t, H_h, H_w]`` counts heads (default 2:3:3 of ``num_heads``, e.g. ``[2, 3, 3]``
    for 8 heads, at least one head per axis; with 1 or 2 heads ``[1, 0, 0]`` / ``[1, 1, 0]``, as every axis
    cannot have a head); heads beyond the sum are NoPE.
    """


    def __init__(
        self, head_dim: int, num_heads: int, mrope_section: Sequence[int] | None = None, theta: float = 10000.0, layout: str = "half"
    ) -> None:
        super().__init__(head_dim, theta, layout)
        if mrope_section is None:
            if num_heads < 3:  # too few heads for every axis: t first, then h (text order lives on any axis)
                mrope_section = [1, num_heads - 1, 0]
            else:
                mrope_section = _default_sections(num_heads, (2, 3, 3))
                if min(mrope_section) == 0:
                    mrope_section = [num_heads - 2 * (num_heads // 3), num_heads // 3, num_heads // 3]
        sec = list(mrope_section)
        if len(sec) != 3 or any(not isinstance(s, int) or s < 0 for s in sec) or sum(sec) > num_heads:
            raise ValueError(f"mhrope: mrope_section must be three non-negative head counts summing to <= num_heads={num_heads}, got {sec}")
        self.mrope_section = sec
        self.num_heads = num_heads

    def axis_map(self) -> torch.Tensor:
        heads = torch.full((self.num_heads,), -1, dtype=torch.int64)
        heads[: sum(self.mrope_section)] = _section_axes(self.mrope_section)
        return heads[:, None].expand(self.num_heads, self.num_pairs).clone()


@register_encoding("vrope", benchmark=False)
class VRope(MultimodalRotary):
    """VRoPE (Liu et al. 2025): four diagonal coordinates read cyclically, ``a(i) = i mod 4``."""


    def axis_map(self) -> torch.Tensor:
        return torch.arange(self.num_pairs) % 4


@register_encoding("videorope", paper="2502.05173", benchmark=False)
class VideoRoPE(MultimodalRotary):
    """VideoRoPE (Wei et al., ICML 2025): low-frequency temporal allocation. h / w alternate on the fast pairs
    (h even, w odd) and the slowest ``temporal_pairs`` (default ``P // 4``, 16 of 64 for ``d = 128``) read t.
    Positions: the diagonal layout with temporal spacing ``delta`` (:mod:`vispe.positions`).
    """


    def __init__(self, head_dim: int, temporal_pairs: int | None = None, theta: float = 10000.0, layout: str = "half") -> None:
        super().__init__(head_dim, theta, layout)
        P = self.num_pairs
        tp = P // 4 if temporal_pairs is None else temporal_pairs
        if not isinstance(tp, int) or isinstance(tp, bool) or not 0 <= tp < P:
            name = self.registry_name or type(self).__name__
            raise ValueError(f"{name}: temporal_pairs must be an int in [0, {P}) (P = head_dim/2), got {temporal_pairs!r}")
        self.temporal_pairs = tp

    def axis_map(self) -> torch.Tensor:
        P, tp = self.num_pairs, self.temporal_pairs
        a = torch.arange(P) % 2 + 1  # even -> h (1), odd -> w (2)
        a[P - tp :] = 0  # the slowest pairs read t
        return a


@register_encoding("hope", benchmark=False)
class HoPE(VideoRoPE):
    """HoPE (Li et al. 2025): VideoRoPE's map with its ``temporal_pairs`` (default ``P // 4``) at zero frequency.
    Positions: VideoRoPE layout with ``gamma``.
    """


    def pair_frequencies(self, device=None) -> torch.Tensor:
        f = self.inv_freq(device).clone()
        if self.temporal_pairs:
            f[self.num_pairs - self.temporal_pairs :] = 0.0  # the temporal pairs at zero frequency (NoPE), text included
        return f
