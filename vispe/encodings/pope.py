"""PoPE: polar-coordinate position embedding (Gopalakrishnan, Csordás, Schmidhuber & Mozer, arXiv 2509.10534), on
image ``(h, w)`` and video ``(t, h, w)`` lattices as lucidrains' ``AxialPoPE`` (PoPE-pytorch) lays it out.

RoPE rotates a query/key pair whose own angle carries content, so content and position mix in the logit's phase.
PoPE keeps content in magnitudes only: each of the ``d`` head channels becomes one complex number, magnitude
``softplus(x_c)``, phase the position angle ``phi_c(n)`` (for keys plus a learned phase bias ``delta_c``), so
``q . k = sum_c softplus(q_c) softplus(k_c) cos(phi_c(m) - phi_c(n) - delta_c)`` -- the phase depends on the offset
only. q and k are ``2d`` wide after the map (v keeps ``d``); the softmax scale stays ``d^-1/2`` (the head's width,
as the reference's attention uses).

Here PoPE is RoPE-Axial on ``d`` pairs instead of ``d/2`` (each channel's complex number rotates by the axial
angle of its pair), fed the magnitude-only vectors ``(softplus(x_c), 0)``: the angles, the tables (cached per grid)
and the rotation are :class:`~vispe.encodings.rope_vit.RopeAxial`'s and :func:`~vispe.encodings.rotary.apply_rotary`'s.
Frequencies per axis chunk ``theta^(-k/n)`` (``k < n``, ``n`` the chunk's channel count, ``theta`` 10000), chunks in
lucidrains' position order: the last grid axis (``x``) first, then ``y`` (then ``t``). The key bias has one phase per
layer, head and channel, zero at init (``bias_init='uniform'``: U(-2 pi, 0)), clamped to ``[-2 pi, 0]`` in the
forward as released (with a gradient at the clamp's ends, where the released ``torch.clamp`` gives none: see
:meth:`PoPE.key_phase`). Prefix tokens (cls, registers) get phase 0 (no position); their q/k still become magnitudes
and their keys still get the bias.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._checks import Choice, Int, Ints, Real
from .base import register_encoding
from .grid import PositionGrid
from .rope_vit import RopeAxial
from .rotary import RotaryState, apply_rotary, rotary_table

__all__ = ["PoPE", "polar_magnitudes", "POPE_BIAS_INITS"]

POPE_BIAS_INITS = ("zeros", "uniform")


def polar_magnitudes(x: torch.Tensor) -> torch.Tensor:
    """``(..., d)`` -> ``(..., 2d)`` float32: channel ``c`` becomes the pair ``(softplus(x_c), 0)`` (interleaved), the
    complex number of magnitude ``softplus(x_c)`` and phase 0 that the rotation then turns by position."""
    mag = F.softplus(x.float())
    return torch.stack([mag, torch.zeros_like(mag)], dim=-1).flatten(-2)


@register_encoding("pope")
class PoPE(RopeAxial):
    """PoPE on 2D or 3D lattices (the number of axes of the model's ``grid_size``).

    Args:
        head_dim: the head's width ``d`` (any ``d >= ndim``): ``d`` frequencies, q/k become ``2d`` wide.
        depth, num_heads: the key phase bias is ``(depth, num_heads, d)``.
        theta: the frequency base (10000, the paper's and the reference's).
        sections: channels per axis chunk, in ``chunk_axes`` order (default ``d // ndim`` each, the remainder to the
            first chunk).
        chunk_axes: grid axis of each chunk (default: the last axis first, lucidrains' ``AxialPoPE`` order).
        bias_init: ``'zeros'`` (reference default) or ``'uniform'`` (U(-2 pi, 0), the reference's option).
        extrapolation: as :class:`~vispe.encodings.rope_vit.RopeAxial`: ``'extend'`` (the paper's: new integer
            indices, relative phases unchanged), ``'interpolate'``, ``'ntk'``, ``'yarn'``.
    """

    grid_ndims = (2, 3)
    # NoPE layers only: PoPE maps every channel to a magnitude (no channel passes through, so no partial rotary),
    # and its learned key phase makes theta an initialisation, not a per-layer base
    layer_schedules = ("nope_layers",)
    prefix_policy = "prefix tokens get phase 0 (no position); their q/k still become softplus magnitudes, keys get the bias"
    option_checks = {"head_dim": Int(1), "theta": Real(1), "sections": Ints(0, optional=True),
                     "bias_init": Choice(POPE_BIAS_INITS)}

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        depth: int,
        grid_size: Sequence[int] = (14, 14),
        theta: float = 10000.0,
        sections: Sequence[int] | None = None,
        chunk_axes: Sequence[int] | None = None,
        bias_init: str = "zeros",
        extrapolation: str | None = None,
    ) -> None:
        name = self.registry_name
        ndim = len(tuple(grid_size))
        if head_dim < ndim:
            raise ValueError(f"{name} needs at least one channel per grid axis: head_dim >= {ndim}, got head_dim={head_dim}")
        if sections is None:
            per_axis = head_dim // ndim
            sections = (head_dim - (ndim - 1) * per_axis,) + (per_axis,) * (ndim - 1)
        elif len(tuple(sections)) != ndim or sum(sections) != head_dim:
            raise ValueError(f"{name}: sections must be {ndim} channel counts (one per grid axis) summing to head_dim={head_dim}, "
                             f"got sections={tuple(sections)!r}")
        if chunk_axes is None:
            chunk_axes = tuple(reversed(range(ndim)))
        # RoPE-Axial on d pairs: each channel is one complex number
        super().__init__(2 * head_dim, grid_size, theta, extrapolation, tuple(sections), chunk_axes)
        self.channels = head_dim
        self.bias_init = bias_init
        self.bias = nn.Parameter(torch.zeros(depth, num_heads, head_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.bias_init == "uniform":
                self.bias.uniform_(-2 * math.pi, 0.0)
            else:
                self.bias.zero_()

    def prepare(self, grid: PositionGrid, device: torch.device | None = None) -> RotaryState:
        # the position table uses no parameter (the bias is applied per layer), so it is cached while training too
        self.check_grid(grid)
        key = ("rotary", grid.shape, grid.num_prefix_tokens, str(device))
        return self.cached(key, lambda: self.build_state(grid, device))

    def key_phase(self, layer: int) -> torch.Tensor:
        """``exp(i delta)`` of a layer, ``(H, 1, d)`` complex64, the bias clamped to ``[-2 pi, 0]`` as released.

        The clamp passes the gradient on its ends: ``torch.clamp``'s is zero there (torch 2.14), so the released
        zero-initialised bias gets no gradient and never moves; the forward is the same."""
        b = self.bias[layer]
        b = torch.where(b > 0.0, torch.zeros_like(b), b)
        b = torch.where(b < -2 * math.pi, torch.full_like(b, -2 * math.pi), b)
        return rotary_table(b)[:, None, :]

    def rotate_qk(self, q: torch.Tensor, k: torch.Tensor, state: Any, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        table = state.for_layer(layer)
        if q.shape[-1] != self.channels:
            raise ValueError(f"{self.registry_name} was built for head_dim={self.channels}, got q/k with {q.shape[-1]} channels")
        qr = apply_rotary(polar_magnitudes(q), table, self.layout).to(q.dtype)
        kr = apply_rotary(polar_magnitudes(k), table * self.key_phase(layer), self.layout).to(k.dtype)
        return qr, kr

    def attend(self, q, k, v, *, layer=0, state=None, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        # the logits are sums over the head's d channels: keep d^-1/2, not the 2d-wide q/k's default
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        # rotated q/k are 2d wide, v d wide: vispe's sdpa keeps them on the fused kernel (see sdpa)
        return super().attend(q, k, v, layer=layer, state=state, attn_mask=attn_mask, dropout_p=dropout_p,
                              is_causal=is_causal, scale=scale)

    def no_weight_decay(self) -> set[str]:
        return {"bias"}
