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

Computation: per grid, each token's ``3 x 3`` rotations become five per-channel coefficient rows
(:func:`shift_coefficients`), so the rotation of ``x`` is five products of ``x`` with shifted copies of itself, run
over each head's rows flattened into one contiguous array (the paper's fast implementation applies the two Euler
rotations one after the other as per-pair phases; on interleaved triplets those are stride-3 views). The backward is
the same with the transposed rotations; nothing of ``x`` is kept. Compiled graphs take the ``3 x 3`` products in
plain ops instead, which inductor fuses with their backward. Tables in float32, cached per grid, narrowed per sample
by patch dropout like every rotary table; :meth:`SphericalRope.rotations` gives the rotations as matrices.
(One layer's q at 1,025 tokens, batch 2, one CPU thread: 2.3 ms forward, 5.0 ms forward + backward; 4-6 ms and
12-14 ms as two pairwise rotary passes.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from .._checks import Int, Real
from .attention import autocast_off_in_backward
from .base import register_encoding
from .grid import PositionGrid
from .resolution import ResolutionContract
from .rotary import LayerThetaState, RotaryEncoding

__all__ = [
    "SphericalRope", "SphericalRopeState", "euler_rotations", "shift_coefficients", "spherical_coordinates",
    "triplet_frequencies",
]


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


def shift_coefficients(rot: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """Per-channel coefficients ``(5, ..., width)`` of triplet rotations ``rot`` ``(..., T, 3, 3)`` on rows of ``width``
    channels (default ``3 T``; the channels past the triplets pass unchanged): the rotated channel ``m`` is
    ``sum_k C[k, ..., m] x[m + k - 2]``, i.e. ``C[k]`` holds ``rot[i, i + k - 2]`` for channel ``i`` of a triplet (zero
    past the triplet's ends). Applying the rotations is then five products of ``x`` with shifted copies of itself."""
    t = rot.shape[-3]
    padded = torch.nn.functional.pad(rot, (2, 2))  # (..., T, 3, 7): column j + 2 holds rot[:, j]
    coef = torch.stack([torch.diagonal(padded, offset=k, dim1=-2, dim2=-1).flatten(-2) for k in range(5)])
    extra = (width if width is not None else 3 * t) - 3 * t
    if extra:
        coef = torch.nn.functional.pad(coef, (0, extra))
        coef[2, ..., 3 * t:] = 1.0
    return coef


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


def _apply_shifted(x: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """The rotations with :func:`shift_coefficients` ``coef`` ``(5, ..., L, D)`` on ``x`` ``(..., L, D)`` (eager), in
    float32, ``x``'s dtype out. Each row's shifted reads stay in its own triplets (the coefficients are zero past
    them), so the products run over ``x`` flattened to ``(..., L * D)``: contiguous and vectorised on CPU (on the
    interleaved channels, stride-3 views, they ran ~4x slower; row by row, each is a loop of 64)."""
    xf = x.float().contiguous()
    lead, flat = xf.shape[:-2], xf.shape[-2] * xf.shape[-1]
    xv = xf.view(*lead, flat)
    cv = coef.reshape(*coef.shape[:-2], flat)
    shifts = ((0, -2), (1, -1), (3, 1), (4, 2))  # (coefficient row, channel shift)
    out = torch.mul(cv[2], xv)
    for k, d in shifts:
        if d > 0:
            out[..., : flat - d].addcmul_(cv[k][..., : flat - d], xv[..., d:])
        else:
            out[..., -d:].addcmul_(cv[k][..., -d:], xv[..., : flat + d])
    return out.view(xf.shape).to(x.dtype)


class _TripletRotation(torch.autograd.Function):
    """Spherical RoPE's per-triplet rotations ``Roll(w p_y) Yaw(w p_x)`` applied by :func:`_apply_shifted`, whose
    backward is the transposed rotations on the gradient (they are orthogonal, their angles fixed per grid): nothing of
    ``x`` is kept. (Through the rotary pairwise path twice, with stacks and slices in between, each with its own
    backward, a ViT-S/16 step at 1,024 tokens ran 1.2x timm's APE model on one CPU thread.)"""

    @staticmethod
    def forward(ctx, x: torch.Tensor, coef: torch.Tensor, coef_t: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(coef_t)
        return _apply_shifted(x, coef)

    @staticmethod
    @autocast_off_in_backward
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (coef_t,) = ctx.saved_tensors
        return _apply_shifted(grad, coef_t), None, None


@dataclass
class SphericalRopeState:
    """Per grid: the rotations ``(S + N, T, 3, 3)`` and the :func:`shift_coefficients` of them and of their transposes
    ``(2, 5, S + N, head_dim)`` (after patch dropout ``(B, 1, n, T, 3, 3)`` and ``(2, 5, B, 1, n, head_dim)``);
    prefix rows the identity's."""

    rotations: torch.Tensor
    coefficients: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.coefficients.shape[-2]


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
            rot = self.rotations(grid, device)  # float32, from the float32 angles
            coef = torch.stack([shift_coefficients(rot, self.head_dim), shift_coefficients(rot.transpose(-1, -2), self.head_dim)])
            return SphericalRopeState(rot, coef)

    def keep_tokens(self, state: SphericalRopeState | LayerThetaState, grid: PositionGrid) -> SphericalRopeState | LayerThetaState:
        if isinstance(state, LayerThetaState):
            return super().keep_tokens(state, grid)
        index = grid.sequence_index()  # (B, n)
        rot = state.rotations.index_select(0, index.reshape(-1)).unflatten(0, index.shape)  # (B, n, T, 3, 3)
        coef = state.coefficients.index_select(-2, index.reshape(-1)).unflatten(-2, index.shape)  # (2, 5, B, n, D)
        return SphericalRopeState(rot.unsqueeze(1), coef.unsqueeze(-3))  # broadcast over the heads

    def rotate(self, x: torch.Tensor, state: SphericalRopeState, layer: int = 0) -> torch.Tensor:
        """Rotate ``x`` ``(B, H, L, head_dim)``: the yaw on each triplet's channels (0, 1), then the roll on (1, 2); the
        ``head_dim mod 3`` channels after the triplets pass unrotated."""
        if state.num_tokens != x.shape[-2]:
            raise ValueError(f"{self.registry_name} rotations cover {state.num_tokens} tokens but attention got "
                             f"{x.shape[-2]} (patch dropout must narrow the state through keep_tokens)")
        if torch.compiler.is_compiling():
            # the 3 x 3 products in plain ops, which inductor fuses with their backward (the eager path's written-out
            # shifts and hand-written backward compiled to 1.16x timm's compiled APE ViT at 224 px, these to 1.03x)
            rot = state.rotations
            n = 3 * rot.shape[-3]
            xf = x.float()
            turned = (rot * xf[..., :n].unflatten(-1, (-1, 3)).unsqueeze(-2)).sum(-1).flatten(-2)
            out = turned if n == x.shape[-1] else torch.cat([turned, xf[..., n:]], dim=-1)
            return out.to(x.dtype)
        coef = state.coefficients
        return _TripletRotation.apply(x, coef[0], coef[1])

    def extra_repr(self) -> str:
        return f"triplets={self.triplets}, theta={self.theta:g}, extrapolation={self.extrapolation!r}"
