"""Spherical RoPE (van de Geijn, Lüddecke, Turishcheva, Ecker, "A Circular Argument: Does RoPE need to be Equivariant
for Vision?", NeurIPS 2025, arXiv 2511.08368): RoPE on 3-vectors rotated by two Euler angles, one per image axis,
whose generators do not commute.

Each head's channels are cut into triplets (``T = head_dim // 3``); triplet ``t`` of the token at ``(p_x, p_y)`` is
turned first about the axis of ``p_x`` (a yaw, in the plane of the triplet's channels 0 and 1) by ``w_t p_x``, then
about the axis of ``p_y`` (a roll, in the plane of channels 1 and 2) by ``w_t p_y``:
``R(p) = Roll(w p_y) Yaw(w p_x)``. The two generators share a channel, so they do not commute and ``R(p_i)^T R(p_j)
= Yaw(-w x_i) Roll(w (y_j - y_i)) Yaw(w x_j)`` is not a function of ``p_j - p_i``: the logits are invariant to a shift
along ``y`` (the rotation applied last), and to a shift along ``x`` only between tokens of one row. That loss of
shift-equivariance is what the paper studies (RoPE-Mixed is the commuting case).

From the paper: triplets, the yaw / roll Euler rotations applied ``p_x`` first then ``p_y``, fixed (unlearned)
frequencies ``w_d = 1 / 100^(2d/D)``, patch positions spread evenly over ``[-pi, pi]`` per axis on the training
grid (top-left corner ``-pi``, bottom-right ``pi``) and, on a larger grid, the range grown by the size ratio at the
same patch step (``extrapolation='extend'``), the class token (every prefix token here) not rotated. The authors'
code was not found (2026-11-26); the method's equations are not legible in the text we could retrieve, so the rest
is vispe's reading: which channels of a triplet each rotation turns, ``D`` in ``w_d`` read as the number of
triplets ``T`` (``d < T``), the same frequency for both axes of a triplet, and the ``head_dim mod 3`` channels left
after the triplets passing unrotated (the paper sizes heads to a multiple of 3, e.g. 63). ``extrapolation=
'interpolate'`` (``rescale``) keeps every grid on ``[-pi, pi]``.

Computation: as the paper's fast implementation, the two Euler rotations are applied one after the other as per-pair
phases, each through the rotary family's pairwise path (:func:`~vispe.encodings.rotary.apply_rotary`): the yaw on the
pairs (channel 0, channel 1) of the triplets, then the roll on the pairs (channel 1, channel 2) of the result. Two
complex tables per grid (float32 angles), cached, narrowed per sample by patch dropout like every rotary table;
:meth:`SphericalRope.rotations` gives the same rotations as ``3 x 3`` matrices. (Per layer's q/k forward + backward
at ViT-S/16 224 px, batch 2, one CPU thread: 4.5-5.8 ms this way, 8.7 ms as ``3 x 3`` block products through
:func:`~vispe.encodings.block_rotation.rotate_blocks`, 1.0 ms for ``rope_axial``.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from .._checks import Int, Real
from .base import register_encoding
from .grid import PositionGrid
from .resolution import ResolutionContract
from .rotary import LayerThetaState, RotaryEncoding, RotaryState, apply_rotary, rotary_table

__all__ = ["SphericalRope", "SphericalRopeState", "euler_rotations", "spherical_coordinates", "triplet_frequencies"]


def euler_rotations(yaw: torch.Tensor, roll: torch.Tensor) -> torch.Tensor:
    """``Roll(roll) @ Yaw(yaw)`` ``(..., 3, 3)`` for angle tensors of one shape: the yaw turns channels 0 and 1, the
    roll channels 1 and 2 (written out: the product of the two elementary rotations)."""
    cy, sy, cr, sr = torch.cos(yaw), torch.sin(yaw), torch.cos(roll), torch.sin(roll)
    zero = torch.zeros_like(yaw)
    rows = [
        torch.stack([cy, -sy, zero], -1),
        torch.stack([cr * sy, cr * cy, -sr], -1),
        torch.stack([sr * sy, sr * cy, cr], -1),
    ]
    return torch.stack(rows, -2)


def triplet_frequencies(triplets: int, theta: float) -> torch.Tensor:
    """``(triplets,)`` float32: ``theta^(-2t/T)`` for ``t < T`` (the paper's ``1 / 100^(2d/D)``, ``D`` = triplets)."""
    exp = 2.0 * torch.arange(triplets, dtype=torch.float64, device="cpu") / max(triplets, 1)
    return (float(theta) ** -exp).float()


def spherical_coordinates(grid: PositionGrid, train_grid: Sequence[int], policy: str | None,
                          device: torch.device | str | None = None) -> torch.Tensor:
    """``(N, 2)`` float32 ``(p_y, p_x)`` of the lattice (row-major): each axis centred on the grid's middle at a step
    of ``2 pi / (n_train - 1)`` (``extend``: the training grid spans ``[-pi, pi]``, a larger one further) or
    ``2 pi / (n - 1)`` (``rescale``: every grid spans ``[-pi, pi]``)."""
    idx = grid.indices(device)
    size = idx.new_tensor([float(n) for n in grid.shape])
    span = size if policy == "rescale" else idx.new_tensor([float(n) for n in train_grid])
    step = 2.0 * math.pi / (span - 1.0).clamp_min(1.0)
    return (idx - (size - 1.0) / 2.0) * step


@dataclass
class SphericalRopeState:
    """Per-forward complex tables ``(S + N, T)`` (``(B, 1, n, T)`` after patch dropout) of the yaw and roll angles;
    prefix rows angle 0 (the identity)."""

    yaw: RotaryState
    roll: RotaryState


@register_encoding("spherical_rope", paper="2511.08368")
class SphericalRope(RotaryEncoding):
    """Spherical RoPE on 2D image grids ``(h, w)``: per triplet of each head a yaw by ``p_x`` then a roll by ``p_y``.

    Args:
        theta: the frequency ladder's base (100, the paper's): triplet ``t`` turns ``theta^(-2t/T)`` radians per unit
            of position.
        extrapolation: ``'extend'`` (the paper's: a larger grid keeps the training grid's patch step, so its
            positions reach past ``[-pi, pi]``) or ``'interpolate'`` (every grid spread over ``[-pi, pi]``).
    """

    pairwise_phases = False
    grid_ndims = (2,)
    resolution = ResolutionContract(("extend", "rescale"), default="extend")
    option_checks = {"head_dim": Int(3), "theta": Real(1, low_open=True)}

    def __init__(
        self,
        head_dim: int,
        grid_size: Sequence[int] = (14, 14),
        theta: float = 100.0,
        extrapolation: str | None = None,
    ) -> None:
        super().__init__()
        name = self.registry_name  # head_dim >= 3 (whole triplets) is option_checks' rule, checked before __init__
        self.extrapolation = extrapolation
        gs = tuple(int(g) for g in grid_size)
        if len(gs) != 2 or min(gs) < 1:
            raise ValueError(f"{name} takes 2D image grids: grid_size must be two positive sizes (h, w), got {grid_size!r}")
        self.head_dim, self.grid_size, self.theta = head_dim, gs, float(theta)
        self.triplets = head_dim // 3
        # derived from the options (not a buffer: nothing to save or load); the rotations are cached per grid
        self.freqs = triplet_frequencies(self.triplets, self.theta)

    def euler_angles(self, grid: PositionGrid, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(yaw, roll)`` angles ``(N, T)`` of the patches: ``w p_x`` and ``w p_y``."""
        self.check_grid(grid)
        pos = spherical_coordinates(grid, self.grid_size, self.resolution_policy, device)  # (N, 2): (p_y, p_x)
        w = self.freqs.to(pos.device)
        return pos[:, 1, None] * w, pos[:, 0, None] * w

    def rotations(self, grid: PositionGrid, device: torch.device | str | None = None) -> torch.Tensor:
        """``(S + N, T, 3, 3)`` float32 rotations: the identity for the prefix tokens, ``Roll(w p_y) Yaw(w p_x)``
        for the patches (what :meth:`rotate_qk` applies, as matrices)."""
        rot = euler_rotations(*self.euler_angles(grid, device))  # (N, T, 3, 3)
        s = grid.num_prefix_tokens
        if s:
            rot = torch.cat([torch.eye(3, device=rot.device, dtype=rot.dtype).expand(s, self.triplets, 3, 3), rot])
        return rot

    # -- the rotary hooks ----------------------------------------------------------------------
    def build_state(self, grid: PositionGrid, device: torch.device | None) -> SphericalRopeState:  # type: ignore[override]
        dev_type = torch.device(device).type if device is not None else "cpu"
        with torch.autocast(device_type=dev_type, enabled=False):
            tables = []
            for ang in self.euler_angles(grid, device):
                pre = ang.new_zeros(grid.num_prefix_tokens, ang.shape[-1])  # prefix tokens: angle 0, the identity
                tables.append(RotaryState(rotary_table(torch.cat([pre, ang]))))
        return SphericalRopeState(*tables)

    def keep_tokens(self, state: SphericalRopeState | LayerThetaState, grid: PositionGrid) -> SphericalRopeState | LayerThetaState:
        if isinstance(state, LayerThetaState):
            return super().keep_tokens(state, grid)
        index = grid.sequence_index()
        return SphericalRopeState(state.yaw.select(index), state.roll.select(index))

    def rotate(self, x: torch.Tensor, state: SphericalRopeState, layer: int = 0) -> torch.Tensor:
        """Rotate ``x`` ``(B, H, L, head_dim)``: the yaw on each triplet's channels (0, 1), then the roll on (1, 2); the
        ``head_dim mod 3`` channels after the triplets pass unrotated."""
        t = self.triplets
        trip = x[..., : 3 * t].float().unflatten(-1, (t, 3))  # float32 between the two rotations, x's dtype out
        if state.yaw.table.shape[-2] != x.shape[-2]:
            raise ValueError(f"{self.registry_name} rotations cover {state.yaw.table.shape[-2]} tokens but attention got "
                             f"{x.shape[-2]} (patch dropout must narrow the state through keep_tokens)")
        a = apply_rotary(trip[..., :2].flatten(-2), state.yaw.table).unflatten(-1, (t, 2))
        b = apply_rotary(torch.stack([a[..., 1], trip[..., 2]], -1).flatten(-2), state.roll.table).unflatten(-1, (t, 2))
        out = torch.stack([a[..., 0], b[..., 0], b[..., 1]], -1).flatten(-2).to(x.dtype)
        return out if 3 * t == x.shape[-1] else torch.cat([out, x[..., 3 * t:]], dim=-1)

    def extra_repr(self) -> str:
        return f"triplets={self.triplets}, theta={self.theta:g}, extrapolation={self.extrapolation!r}"
