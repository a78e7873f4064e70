"""FIRE on patch lattices: ``fire`` for ``(h, w)`` images, ``fire_3d`` for ``(t, h, w)`` videos.

FIRE (Li, You, Guruganesh, Ainslie, Ontanon, Zaheer, Sanghai, Yang, Kumar & Bhojanapalli, "Functional
Interpolation for Relative Positions Improves Long Context Transformers", ICLR 2024, arXiv 2310.04418) biases
the logit of query ``i`` and key ``j`` of a causal LM by ``f_theta(psi(i - j) / psi(max(L, i)))``, with
``psi(x) = log(c x + 1)``, learned ``c > 0`` and threshold ``L``, and ``f_theta`` a small MLP (one input,
32 hidden units, ReLU, one output per head). Dividing by ``psi`` of the query position ("progressive
interpolation") maps every distance a query can see into ``[0, 1]`` at any length; ``L`` stops short
prefixes from being stretched.

On a lattice every query sees the whole grid, so the normaliser is the grid's extent ``E`` (the largest
distance between two of its patches) instead of the query position; it stays one number per grid, so the bias
depends only on the offset (translation invariant)::

    b_h(p, q) = f_theta(psi(d(p, q)) / psi(max(L, E)))_h,    psi(x) = log(|c| x + 1)

The threshold ``L`` starts at the training grid's extent: at the training grid the inputs span exactly
``[0, 1]``, a larger grid is mapped back onto ``[0, 1]`` (progressive interpolation), a smaller one keeps the
training scale (as FIRE's threshold does for short LM prefixes). The 2026 ViT extrapolation study reports FIRE
at 4.57x the training resolution; its abstract does not fix the 2D normaliser, so this is our reading.

Options and defaults:

* ``distance='euclidean'`` (default): ``d`` the Euclidean lattice distance, one MLP input as in the paper
  (and the 2D-ALiBi distance, which FIRE's function class contains); ``'manhattan'``; ``'axial'``: one
  signed input per axis, ``sign(d_a) psi_a(|d_a|) / psi_a(max(L_a, s_a - 1))`` in ``[-1, 1]``, with its own
  ``c`` and ``L`` per axis, so the bias can tell up from down and rows from columns.
* ``mlp_width=32``, ``init_c=0.1`` (the paper's released values); ``init_threshold=None``: the training
  grid's extent (the paper's ``L = 512`` tokens is a token count; in patch units the training extent plays
  that role). ``L`` is learned as a multiplier (init 1) of that value, as in the paper's code.
* One FIRE (``c``, ``L``, MLP) per block, as the paper's main model; ``share_layers=True`` shares one
  across blocks (the paper's layerwise-sharing variant, cheaper).
* Prefix tokens (cls, registers): zero bias to and from them; the MLP's output level sets how much patches
  weigh against them.

The MLP runs over the ``prod(2 s_a - 1)`` distinct offsets of the grid only (at least float32, autocast off), and the
per-pair term is a gather of that table (:class:`~vispe.encodings.alibi.LatticeOffsetBias`). ``c`` and the
threshold are not weight-decayed (decay would flatten ``psi`` and drop the threshold to 0). Design notes:
``docs/design/attention-bias-2d.md``.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._checks import Choice, Int, Real, check_choice
from .lattice_bias import LatticeOffsetBias, pair_distance
from .base import register_encoding
from .grid import PositionGrid

__all__ = ["FIRE_DISTANCES", "Fire", "Fire3d", "fire_inputs", "lattice_extent"]

FIRE_DISTANCES = ("euclidean", "manhattan", "axial")
_EPS = 1e-6  # keeps the ratio finite on a one-token grid (psi(0) = 0), as the paper's code does


def lattice_extent(shape: Sequence[int], distance: str) -> torch.Tensor:
    """The largest distance between two patches of a lattice of sizes ``shape``: float32 ``(1,)``
    (``(ndim,)`` per-axis ``s_a - 1`` for ``'axial'``)."""
    return pair_distance(torch.tensor([[s - 1 for s in shape]], dtype=torch.float32), distance)[0]


def fire_inputs(
    offsets: torch.Tensor, shape: Sequence[int], c: torch.Tensor, threshold: torch.Tensor, distance: str
) -> torch.Tensor:
    """FIRE's MLP inputs for the offsets ``(U, ndim)`` of a lattice of sizes ``shape``.

    ``psi(d) / psi(max(L, E))`` with ``psi(x) = log(|c| x + 1)``; ``c`` and ``threshold`` (``L``) are
    ``(..., n_in)``, the result ``(..., U, n_in)``: in ``[0, 1]`` (``[-1, 1]``, signed per axis, for ``'axial'``).
    """
    r = pair_distance(offsets, distance)  # (U, n_in)
    extent = lattice_extent(shape, distance).to(device=offsets.device, dtype=offsets.dtype)
    c = c.abs()[..., None, :]
    scale = torch.log1p(c * torch.maximum(threshold.abs(), extent)[..., None, :]) + _EPS
    x = torch.log1p(c * r) / scale
    return x * torch.sign(offsets) if distance == "axial" else x


class _Fire(LatticeOffsetBias):
    """FIRE on a lattice (see the module docstring for the maths and the choices).

    Args:
        num_heads, depth: from the model (one MLP output per head; one FIRE per block unless shared).
        grid_size: training lattice (the threshold's initial value is its extent).
        distance: ``'euclidean'`` (default), ``'manhattan'`` or ``'axial'``.
        mlp_width: hidden units of ``f_theta`` (default 32).
        init_c: initial ``c`` of ``psi`` (default 0.1).
        init_threshold: initial ``L`` in lattice steps (default: the training grid's extent).
        share_layers: one FIRE for every block instead of one per block (default False).
    """

    prefix_policy = "zero bias to and from prefix tokens (cls/registers); the MLP's output level weighs patches against them"

    #: option rules, checked before __init__ (vispe._checks; see PositionalEncoding.option_checks)
    option_checks = {
        "distance": Choice(FIRE_DISTANCES),
        "mlp_width": Int(1),
        "init_c": Real(0, 1e6, low_open=True),
        "init_threshold": Real(0, 1e6, low_open=True, optional=True),
    }

    def __init__(
        self,
        num_heads: int,
        depth: int,
        grid_size: Sequence[int],
        distance: str = "euclidean",
        mlp_width: int = 32,
        init_c: float = 0.1,
        init_threshold: float | None = None,
        share_layers: bool = False,
    ) -> None:
        super().__init__()
        check_choice("distance", distance, FIRE_DISTANCES)
        for name, value in (("num_heads", num_heads), ("depth", depth), ("mlp_width", mlp_width)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"FIRE: {name} must be a positive int, got {value!r}")
        if not init_c > 0:
            raise ValueError(f"FIRE: init_c (the log transform's c) must be > 0, got {init_c!r}")
        if init_threshold is not None and not init_threshold > 0:
            raise ValueError(
                f"FIRE: init_threshold (L, in lattice steps) must be > 0 or None (the training grid's extent), "
                f"got {init_threshold!r}"
            )
        self.grid_size = self._training_grid(grid_size)
        self.distance = distance
        self.num_heads, self.mlp_width, self.share_layers = num_heads, mlp_width, bool(share_layers)
        n_in = len(self.grid_size) if distance == "axial" else 1
        self.num_inputs = n_in
        self.num_tables = 1 if share_layers else depth
        m = self.num_tables
        if init_threshold is None:
            start = lattice_extent(self.grid_size, distance).clamp(min=1.0)  # a 1-patch axis still gets a positive L
        else:
            start = torch.full((n_in,), float(init_threshold))
        self.register_buffer("threshold_init", start)
        self.c = nn.Parameter(torch.full((m, n_in), float(init_c)))
        self.threshold_scale = nn.Parameter(torch.ones(m, n_in))
        self.fc1_weight = nn.Parameter(torch.empty(m, mlp_width, n_in))
        self.fc1_bias = nn.Parameter(torch.empty(m, mlp_width))
        self.fc2_weight = nn.Parameter(torch.empty(m, num_heads, mlp_width))
        self.fc2_bias = nn.Parameter(torch.empty(m, num_heads))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``f_theta``'s layers as ``nn.Linear`` initialises them (uniform in ``+-1/sqrt(fan_in)``)."""
        for weight, bias in ((self.fc1_weight, self.fc1_bias), (self.fc2_weight, self.fc2_bias)):
            bound = 1.0 / math.sqrt(weight.shape[-1])
            nn.init.uniform_(weight, -bound, bound)
            nn.init.uniform_(bias, -bound, bound)

    @property
    def threshold(self) -> torch.Tensor:
        """The learned threshold ``L`` per table and input, ``(M, n_in)``, in lattice steps."""
        return (self.threshold_scale * self.threshold_init).abs()

    def table_index(self, layer: int) -> int:
        return 0 if self.share_layers else layer

    def tables(self, grid: PositionGrid, offsets: torch.Tensor) -> torch.Tensor:
        # at least float32 and autocast off: bf16 would blur nearby normalised distances on large grids
        dt = torch.promote_types(self.c.dtype, torch.float32)
        w1, b1, w2, b2 = (p.to(dt) for p in (self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias))
        with torch.autocast(offsets.device.type, enabled=False):
            x = fire_inputs(offsets.to(dt), grid.shape, self.c.to(dt), self.threshold.to(dt), self.distance)  # (M, U, n_in)
            hidden = torch.relu(torch.einsum("mun,mwn->muw", x, w1) + b1[:, None, :])
            out = torch.einsum("muw,mhw->mhu", hidden, w2) + b2[:, :, None]
        return F.pad(out, (0, 1))  # (M, H, U + 1): the zero column is read by prefix pairs

    def no_weight_decay(self) -> set[str]:
        return {"c", "threshold_scale"}

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, distance={self.distance!r}, mlp_width={self.mlp_width}, "
            f"tables={self.num_tables}{' (shared)' if self.share_layers else ''}, grid_size={self.grid_size}"
        )


@register_encoding("fire", defaults={"grid_size": (14, 14)}, paper="2310.04418")
class Fire(_Fire):
    """FIRE on ``(h, w)`` image lattices (see the module docstring)."""

    grid_ndims = (2,)


@register_encoding("fire_3d", defaults={"grid_size": (8, 14, 14)}, paper="2310.04418")
class Fire3d(_Fire):
    """FIRE on ``(t, h, w)`` video lattices; a tubelet step counts one unit, like a patch step."""

    grid_ndims = (3,)
