"""The one rotary application path shared by every pair-wise rotary encoding in vispe.

A rotary encoding assigns each token ``n`` and each rotation pair ``i`` an angle ``phi[n, i]``
(float32, computed with autocast off). Pairs are stored in one of two layouts:

* ``'interleaved'`` -- pair ``i`` is channels ``(2i, 2i+1)``: RoPE-ViT, EVA-02, timm's
  ``apply_rot_embed_cat`` (the ViT side of vispe uses this).
* ``'half'`` -- pair ``i`` is channels ``(i, i + P)``: the Qwen/HF LLM family (``rotate_half``).

Both layouts compute ``x' = x * cos(phi) + rot(x) * sin(phi)`` for each pair; the table is a
complex tensor ``exp(i*phi)`` so the rotation is a single complex multiply in float32, and the
result is cast back to the input dtype. Prefix tokens that must not rotate get ``phi = 0``,
i.e. an exact identity (``(a + ib)(1 + 0i)`` is bit-exact), so q/k never need slicing or
concatenation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .base import PositionalEncoding, save_as_recomputed, sdpa
from .grid import PositionGrid

__all__ = ["apply_rotary", "rotary_table", "RotaryEncoding", "RotaryState", "ROTARY_LAYOUTS"]

ROTARY_LAYOUTS = ("interleaved", "half")


def rotary_table(angles: torch.Tensor) -> torch.Tensor:
    """``exp(i * angles)`` as complex64, computed in float32 regardless of autocast."""
    angles = angles.float()
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary(x: torch.Tensor, table: torch.Tensor, layout: str = "interleaved") -> torch.Tensor:
    """Rotate the last dimension of ``x`` (``(..., L, 2P)``) by a complex ``table`` (``(..., L, P)``).

    The table broadcasts against ``x``'s leading dimensions (batch, heads). Math runs in float32;
    the output has ``x``'s dtype.
    """
    d = x.shape[-1]
    p = table.shape[-1]
    if d != 2 * p:
        raise ValueError(f"rotary table has {p} pairs but the head dimension is {d} (needs {2 * p})")
    xf = x.float()
    if torch.compiler.is_compiling():
        # inductor generates no code for complex ops: the same rotation on real tensors fuses into one kernel
        return _apply_rotary_real(xf, torch.view_as_real(table), layout).type_as(x)
    if layout == "interleaved":
        xc = torch.view_as_complex(xf.reshape(*xf.shape[:-1], p, 2))
        out = torch.view_as_real(xc * table).flatten(-2)
    elif layout == "half":
        xc = torch.complex(xf[..., :p], xf[..., p:])
        r = xc * table
        # written in x's memory order (token-major for q/k sliced from a fused qkv), as the interleaved
        # layout's elementwise product is: SDPA's output then stays token-major and the head merge a view
        out = torch.empty_permuted((*r.shape[:-1], d), _memory_order(r), dtype=torch.float32, device=r.device)
        out[..., :p] = r.real
        out[..., p:] = r.imag
    else:
        raise ValueError(f"unknown rotary layout {layout!r}; choose one of {ROTARY_LAYOUTS}")
    return out.type_as(x)


def _memory_order(t: torch.Tensor) -> tuple[int, ...]:
    """The dimensions of ``t`` from outermost to innermost in memory (the last dimension last)."""
    lead = sorted(range(t.ndim - 1), key=lambda i: -t.stride(i) if t.shape[i] > 1 else 0)
    return (*lead, t.ndim - 1)


def _apply_rotary_real(xf: torch.Tensor, table_ri: torch.Tensor, layout: str) -> torch.Tensor:
    """``apply_rotary`` on real tensors: ``xf`` float32 ``(..., L, 2P)``, ``table_ri`` = ``view_as_real(table)`` ``(..., L, P, 2)``."""
    p = table_ri.shape[-2]
    c, s = table_ri[..., 0], table_ri[..., 1]
    if layout == "interleaved":
        x2 = xf.unflatten(-1, (p, 2))
        a, b = x2[..., 0], x2[..., 1]
        return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
    if layout == "half":
        a, b = xf[..., :p], xf[..., p:]
        return torch.cat([a * c - b * s, a * s + b * c], dim=-1)
    raise ValueError(f"unknown rotary layout {layout!r}; choose one of {ROTARY_LAYOUTS}")


@dataclass
class RotaryState:
    """Per-forward rotary tables: ``table`` is ``(L, P)``, ``(H, L, P)`` or ``(depth, H, L, P)``."""

    table: torch.Tensor
    per_layer: bool = False

    def for_layer(self, layer: int) -> torch.Tensor:
        return self.table[layer] if self.per_layer else self.table

    def select(self, index: torch.Tensor) -> "RotaryState":
        """Per-sample token rows ``index`` ``(B, n)``: tables become ``(B, 1|H, n, P)`` (``(depth, B, H, n, P)``)."""
        bsz, n = index.shape
        t = self.table.index_select(-2, index.reshape(-1)).unflatten(-2, (bsz, n))  # (..., B, n, P)
        if self.per_layer:
            t = t.movedim(-3, 1)
        elif t.ndim == 3:
            t = t.unsqueeze(1)
        else:
            t = t.movedim(-3, 0)
        return RotaryState(t, per_layer=self.per_layer)


class RotaryEncoding(PositionalEncoding):
    """Base for encodings that rotate q and k by per-pair angles.

    Subclasses implement :meth:`angles` (and optionally :meth:`prefix_angles`). This class
    builds the complex table once per forward for all layers, caches it per (grid, device)
    when no gradient flows through it, and rotates q and k before SDPA.
    """

    kind = "rotary"
    contract = "rotary"
    prefix_policy: ClassVar[str] = "prefix tokens are not rotated (identity rotation)"
    #: The rotation is a phase per channel pair given by :meth:`angles` (False: general block rotations).
    pairwise_phases: ClassVar[bool] = True
    #: Angle tables carry a leading ``depth`` dimension (one table per layer).
    per_layer: bool = False
    layout: str = "interleaved"

    # -- to implement --------------------------------------------------------------------
    def angles(self, grid: PositionGrid, device: torch.device | None) -> torch.Tensor:
        """float32 angles ``(..., N, P)`` for the lattice tokens, leading dims ``()``, ``(H,)`` or ``(depth, H)``."""
        raise NotImplementedError

    def prefix_angles(self, grid: PositionGrid, device: torch.device | None) -> torch.Tensor | None:
        """Angles for prefix tokens (``(..., S, P)``), or ``None`` for the identity (no rotation)."""
        return None

    # -- shared machinery ----------------------------------------------------------------
    def build_state(self, grid: PositionGrid, device: torch.device | None) -> RotaryState:
        dev_type = torch.device(device).type if device is not None else "cpu"
        with torch.autocast(device_type=dev_type, enabled=False):
            ang = self.angles(grid, device).float()
            s = grid.num_prefix_tokens
            if s:
                pre = self.prefix_angles(grid, device)
                if pre is None:
                    pre = ang.new_zeros(*ang.shape[:-2], s, ang.shape[-1])
                else:
                    pre = pre.float().expand(*ang.shape[:-2], s, ang.shape[-1])
                ang = torch.cat([pre, ang], dim=-2)
            table = rotary_table(ang)
        return RotaryState(table, per_layer=self.per_layer)

    def prepare(self, grid: PositionGrid, device: torch.device | None = None) -> RotaryState:
        self.check_grid(grid)
        key = ("rotary", grid.shape, grid.num_prefix_tokens, str(device))
        return self.cached(key, lambda: self.build_state(grid, device), uses_parameters=True)

    def keep_tokens(self, state: RotaryState, grid: PositionGrid) -> RotaryState:
        return state.select(grid.sequence_index())

    def rotate(self, x: torch.Tensor, state: RotaryState, layer: int = 0) -> torch.Tensor:
        return apply_rotary(x, state.for_layer(layer), self.layout)

    def rotate_qk(self, q: torch.Tensor, k: torch.Tensor, state: Any, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate one layer's q and k (one call, so a family that rotates the pair jointly, as ComRoPE's
        block rotations do, overrides this and nothing else of the attention path)."""
        return self.rotate(q, state, layer), self.rotate(k, state, layer)

    def attend(self, q, k, v, *, layer=0, state=None, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        if state is None:
            return sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale)
        q0, k0 = q, k
        q, k = self.rotate_qk(q0, k0, state, layer)
        # SDPA would keep the rotated q/k for backward; re-rotating the unrotated ones is cheaper than the memory
        with save_as_recomputed((q, k), lambda: self.rotate_qk(q0, k0, state, layer)):
            return sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale)
