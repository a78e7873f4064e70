"""LieRE (Ostmeier, Axelrod, Moseley, Chaudhari, Langlotz, "LieRE: Lie Rotational Positional Encodings",
ICML 2025, arXiv:2406.10322; code: github.com/StanfordMIMI/LieRE): rotary encoding with learned, dense,
non-commuting skew-symmetric generators.

A token at coordinate ``x in R^N`` rotates its query and key by ``R(x) = exp(sum_i x_i A_i)``, where every
``A_i`` is a learned skew-symmetric matrix, block-diagonal with ``m = head_dim / b`` dense ``b x b`` blocks
(``b = head_dim``: one fully dense rotation; the paper's "variable sparsity"; ``b = 2`` with the blocks'
angles as frequencies is RoPE-Mixed). Unlike ComRoPE nothing makes the ``A_i`` commute, so ``R(x)^T R(y)``
is in general not a function of ``y - x``: LieRE encodes relative *and* absolute position. ComRoPE is
the special case of commuting generators (``tests/test_liere.py`` checks ComRoPE-AP / -LD = LieRE with
their generators). Registered as ``liere`` (2D grids) and ``liere_3d`` (video ``(t, h, w)`` grids).

Defaults follow the released code (``models/rope_vit.py``, ``lightning_conf/*.yaml``, the run scripts):

* ``block_size=None`` -> ``head_dim`` (fully dense; the scripts use ``generator_dim=64`` with 64-wide heads);
  any divisor ``b >= 2`` of ``head_dim`` gives the paper's block-sparse variants (the block size is a
  hyperparameter the paper varies; ``b = 8``, ComRoPE's setting, is an order of magnitude cheaper than dense
  at ``head_dim = 64``).
* ``per_layer=True``, ``per_head=True``: one generator set per (layer, head), as every released config
  sets (``rotary_embedding_per_layer/per_head: True``; the dataclass default is ``False``, offered here
  as options).
* Initialisation: the strictly upper-triangular entries of each block ``~ U(0, init_range)``,
  ``init_range = 2 pi`` (the code draws ``U(0, 2 pi)`` like RoPE-Mixed's angles; its ``- 0.5`` shift cancels
  in ``U - U^T``). Only those ``b (b - 1) / 2`` entries are stored (the code keeps a full ``b x b`` tensor of
  which it reads the upper triangle). ``zero_init=True`` starts at the identity (plain attention).
* Coordinates, ``coords='liere'`` (the released code): axis ``a`` of an ``n``-token grid takes
  ``linspace(0, n / n_train, n)`` (``n_train`` from the training grid ``grid_size``; so ``[0, 1]`` corner to
  corner on the training grid, a longer range on a larger one), and prefix tokens get the identity
  (coordinate 0). ``coords='centers'`` uses vispe's ComRoPE convention instead: patch centres
  ``(i + 0.5) / n`` in (0, 1) per axis (``PositionGrid.centers``), prefix tokens at the centre
  ``(0.5, ...)`` rotated like a patch -- the convention of the ComRoPE comparison.
* Generators are not weight-decayed (the released code trains with plain Adam, no decay; decay would pull
  every rotation towards the identity).

Where the code differs: it rotates only the first ``b * floor(head_dim / b)`` channels when ``b`` does not
divide ``head_dim``; here ``b`` must divide ``head_dim`` (clear error otherwise).

Computation. :meth:`LieREBase.prepare` builds every layer's per-token block rotations once per forward:
one batched ``torch.linalg.matrix_exp`` over ``depth' x H' x (1 + N) x m`` blocks of ``b x b``
(``depth' = depth`` if ``per_layer`` else 1, ``H'`` likewise; ``1 +``: the prefix tokens share one rotation),
in float32 with autocast off, cached per grid while no gradient needs it. Non-commuting generators have no
shortcut (ComRoPE's per-axis line tables need ``exp(sum) = prod exp``), so this per-token exponential is
LieRE's inherent cost: ``O(depth' H' N m b^3)`` times the Pade degree plus the squarings (which grow with
``log ||x . A||``), and its backward (an ``eigh`` per block and the adjoint Frechet derivative in that eigenbasis,
:class:`_ExpOfGeneratorSum`; PyTorch's own exponentiates ``2b x 2b`` blocks) about twice that. The table holds
``depth' H' (S + N) head_dim b`` floats: ViT-S/16 at 224 (12 layers, 6 heads, 197 tokens) ~222 MiB dense
(``b = 64``), ~28 MiB with ``b = 8``; building it took ~14 s dense / ~1.1 s with ``b = 8`` (+ ~72 s / ~4 s
backward) on one CPU thread -- per forward, not per sample. The backward rebuilds the generator sums instead
of keeping them (:class:`_ExpOfGeneratorSum`). Rotations are applied blockwise (:func:`rotate_blocks`: one
batched ``b x b`` product per (head, token, block), the batch of q and k folded into the matrix columns),
never as a dense ``head_dim x head_dim`` matmul when ``b < head_dim``; that product saves only the unrotated
q/k and the rotations for its backward. Design notes: ``docs/design/liere.md``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch
import torch.nn as nn

from .._checks import Choice, Int, Ints, Real, check_choice
from .base import autocast_off_in_backward, register_encoding
from .grid import PositionGrid
from .block_rotation import rotate_blocks
from .rotary import RotaryEncoding

__all__ = [
    "LIERE_COORDS",
    "LieREBase",
    "LieRE",
    "LieRE3d",
    "LieREState",
    "liere_coordinates",
    "skew_from_entries",
    "entries_from_skew",
    "rotations_from_generators",
    "rotate_blocks",
]

#: Coordinate conventions: the released code's (``'liere'``) and vispe's ComRoPE one (``'centers'``).
LIERE_COORDS = ("liere", "centers")


# ---------------------------------------------------------------------------------------------
# generators and rotations
# ---------------------------------------------------------------------------------------------


def _upper_indices(b: int, device: torch.device | str | None = None) -> torch.Tensor:
    return torch.triu_indices(b, b, offset=1, device=device)


def skew_from_entries(entries: torch.Tensor, block_size: int) -> torch.Tensor:
    """Skew-symmetric blocks ``(..., b, b)`` from their strictly upper-triangular entries ``(..., b(b-1)/2)``
    (row-major order of ``torch.triu_indices(b, b, 1)``)."""
    b = block_size
    if entries.shape[-1] != b * (b - 1) // 2:
        raise ValueError(f"{entries.shape[-1]} entries do not fill the upper triangle of a {b}x{b} block (needs {b * (b - 1) // 2})")
    rows, cols = _upper_indices(b, entries.device)
    upper = entries.new_zeros(*entries.shape[:-1], b, b)
    upper[..., rows, cols] = entries
    return upper - upper.transpose(-1, -2)


def entries_from_skew(skew: torch.Tensor) -> torch.Tensor:
    """The strictly upper-triangular entries ``(..., b(b-1)/2)`` of skew-symmetric blocks ``(..., b, b)``."""
    b = skew.shape[-1]
    if skew.shape[-2] != b or not torch.allclose(skew, -skew.transpose(-1, -2), atol=1e-6):
        raise ValueError(f"generators must be skew-symmetric square blocks (..., b, b), got shape {tuple(skew.shape)}")
    rows, cols = _upper_indices(b, skew.device)
    return skew[..., rows, cols]


def _generator_sum(coords: torch.Tensor, generators: torch.Tensor) -> torch.Tensor:
    """``sum_i x_i A_i`` per token: ``(L, N)`` x ``(N, *lead, m, b, b)`` -> contiguous ``(*lead, L, m, b, b)``."""
    gen = torch.tensordot(coords, generators.movedim(0, -4), dims=([1], [-4]))  # (L, *lead, m, b, b)
    return gen.movedim(0, -4).contiguous()


def _matrix_exp(x: torch.Tensor) -> torch.Tensor:
    """``torch.linalg.matrix_exp`` over one flat batch axis: inductor (torch 2.15) may hand a fallback op a permuted
    layout of a many-axis batch, on which matrix_exp's internal ``view`` fails; a 3D batch has no such layout."""
    b = x.shape[-1]
    return torch.linalg.matrix_exp(x.reshape(-1, b, b)).view(x.shape)


#: blocks per ``eigh`` call in the backward (see :func:`_skew_eig`)
EIGH_CHUNK = 16384


def _skew_eig(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``m = U diag(-i lam) U^H`` for real skew-symmetric blocks ``m`` ``(..., b, b)``: the eigen-decomposition of the
    Hermitian ``i m`` (``lam`` real ``(..., b)``, ``U`` unitary, complex). Over one flat batch axis: inductor
    (torch 2.15) may hand a fallback op a permuted layout of a many-axis batch (see :func:`_matrix_exp`)."""
    b = m.shape[-1]
    flat = m.reshape(-1, b, b)
    herm = torch.complex(torch.zeros_like(flat), flat)
    if flat.shape[0] > EIGH_CHUNK and not torch.compiler.is_compiling():
        # cuSOLVER's batched eigh fails on very large batches (an internal error at ~1e5 blocks, a 242 GiB
        # workspace request at ~4.5e5 on an H100): solve fixed-size chunks instead
        parts = [torch.linalg.eigh(c) for c in herm.split(EIGH_CHUNK)]
        lam, u = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    else:
        lam, u = torch.linalg.eigh(herm)
    return lam.view(*m.shape[:-1]), u.view(*m.shape[:-2], b, b)


class _ExpOfGeneratorSum(torch.autograd.Function):
    """``matrix_exp(sum_i x_i A_i)`` that keeps only ``coords`` and the generators for backward.

    The backward rebuilds the generator sums ``M`` (a cheap contraction) instead of keeping them, and takes the
    adjoint Frechet derivative of exp in ``M``'s eigenbasis (Daleckii-Krein): ``M`` is real skew-symmetric, so
    ``M = U diag(d) U^H`` with ``d = -i lam`` (:func:`_skew_eig`, one small ``eigh`` per block) and the gradient
    is ``U (conj(Phi) o (U^H G U)) U^H`` with ``Phi_jk = (e^{d_j} - e^{d_k}) / (d_j - d_k)``, written as
    ``exp(-i (lam_j + lam_k) / 2) sinc((lam_j - lam_k) / 2)`` -- finite and exact for equal eigenvalues too (zero
    generators, odd block sizes). It equals PyTorch's ``matrix_exp`` backward (the upper-right block of
    ``exp([[M^T, G], [0, M^T]])``) at about half the cost: that exponentiates ``2b x 2b`` blocks with the
    squarings of ``||M||``, where ``eigh`` does not grow with the norm. (An ``eigh`` forward as well measured no
    faster than ``matrix_exp``'s ``b x b`` forward; keeping ``U`` for the backward would hold a complex
    rotation-table-sized tensor through the step.)
    """

    @staticmethod
    def forward(ctx, coords: torch.Tensor, generators: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(coords, generators)
        return _matrix_exp(_generator_sum(coords, generators))

    @staticmethod
    @autocast_off_in_backward
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        coords, generators = ctx.saved_tensors
        if not ctx.needs_input_grad[1]:
            return None, None
        lam, u = _skew_eig(_generator_sum(coords, generators))
        gap = lam.unsqueeze(-1) - lam.unsqueeze(-2)
        mean = (lam.unsqueeze(-1) + lam.unsqueeze(-2)) / 2
        phi_conj = torch.polar(torch.sinc(gap / (2 * math.pi)), mean)  # conj(Phi): sinc(x) = sin(pi x) / (pi x)
        grad_u = u.mH @ grad.to(u.dtype) @ u
        grad_sum = (u @ (phi_conj * grad_u) @ u.mH).real  # (*lead, L, m, b, b)
        # d/dA_i of sum_l x_li A_i: contract the token axis with the coordinates
        grad_gen = torch.tensordot(coords, grad_sum.movedim(-4, 0), dims=([0], [0]))  # (N, *lead, m, b, b)
        return None, grad_gen


def rotations_from_generators(coords: torch.Tensor, generators: torch.Tensor) -> torch.Tensor:
    """``R(x) = exp(sum_i x_i A_i)`` per token and block, in ONE batched ``matrix_exp``.

    Args:
        coords: token coordinates ``(L, N)``.
        generators: skew-symmetric block generators ``(N, ..., m, b, b)`` (leading dims e.g. ``(depth', H')``).

    Returns:
        block rotations ``(..., L, m, b, b)`` in float32 (float64 for float64 generators), autocast off.
    """
    if coords.ndim != 2 or coords.shape[-1] != generators.shape[0]:
        raise ValueError(f"coords {tuple(coords.shape)} must be (L, N) with N = {generators.shape[0]} axes (one generator each)")
    dtype = torch.promote_types(generators.dtype, torch.float32)
    with torch.autocast(device_type=generators.device.type, enabled=False):
        g = generators.to(dtype)
        return _ExpOfGeneratorSum.apply(coords.to(device=g.device, dtype=dtype), g)


def liere_coordinates(
    grid: PositionGrid,
    convention: str = "liere",
    train_grid: Sequence[int] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Lattice coordinates ``(num_patches, ndim)`` (row-major, axes in ``grid.shape`` order).

    ``'liere'`` (released code): axis ``a`` of size ``n`` takes ``linspace(0, n / n_train, n)``, with ``n_train``
    the training grid's size on that axis (``train_grid``; the grid itself when ``None``). ``'centers'``:
    ``(i + 0.5) / n`` (``PositionGrid.centers``, vispe's ComRoPE convention).
    """
    check_choice("coords", convention, LIERE_COORDS)
    if convention == "centers":
        return grid.centers(device)
    train = tuple(grid.shape) if train_grid is None else tuple(int(t) for t in train_grid)
    if len(train) != grid.ndim:
        raise ValueError(f"training grid {train} has {len(train)} axes but the grid {grid.shape} has {grid.ndim}")
    axes = [torch.linspace(0.0, n / t, n, device=device, dtype=torch.float32) for n, t in zip(grid.shape, train)]
    mesh = torch.meshgrid(*axes, indexing="ij")
    return torch.stack([m.reshape(-1) for m in mesh], dim=-1)


# ---------------------------------------------------------------------------------------------
# the encoding
# ---------------------------------------------------------------------------------------------


@dataclass
class LieREState:
    """Per-forward rotations ``(depth', H', S + N, m, b, b)`` (float32) for every layer; ``token_index``
    ``(B, n)``: after patch dropout, each sample's present rows of the full sequence."""

    rotations: torch.Tensor
    per_layer: bool
    token_index: Optional[torch.Tensor] = None

    def for_layer(self, layer: int) -> torch.Tensor:
        """One layer's rotations ``(H', S + N, m, b, b)``."""
        return self.rotations[layer if self.per_layer else 0]


class LieREBase(RotaryEncoding):
    """LieRE on ``num_axes``-D grids. A rotary encoding whose rotations are dense ``b x b`` blocks rather
    than per-pair phases: it keeps the rotary family's attention path and overrides :meth:`rotate_qk`."""

    pairwise_phases = False
    layer_schedules = ("nope_layers", "rotary_fraction")  # learned generators: no rotary base to set per layer
    prefix_policy = (
        "coords='liere': prefix tokens get the identity rotation (released code); coords='centers': they sit at "
        "the grid centre (0.5, ...) and are rotated like patches (ComRoPE's convention)"
    )
    grid_ndims = (2,)

    @property
    def num_axes(self) -> int:
        """Grid axes the generators span: those of the grids the variant takes (its ``grid_ndims``)."""
        return self.grid_ndims[0]

    #: option rules, checked before __init__ (vispe._checks; see PositionalEncoding.option_checks)
    option_checks = {
        "grid_size": Ints(1, optional=True),
        "block_size": Int(2, optional=True),
        "coords": Choice(LIERE_COORDS),
        "init_range": Real(0, 1e3),  # generator entries ~ U(0, init_range); far larger ones overflow the exponential
    }

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        depth: int,
        grid_size: Sequence[int] | None = None,
        block_size: int | None = None,
        per_layer: bool = True,
        per_head: bool = True,
        coords: str = "liere",
        init_range: float = 2 * math.pi,
        zero_init: bool = False,
    ) -> None:
        super().__init__()
        name = self.registry_name or type(self).__name__
        b = head_dim if block_size is None else block_size
        divisors = [d for d in range(2, head_dim + 1) if head_dim % d == 0]
        if not divisors:
            raise ValueError(f"{name}: head_dim={head_dim} has no block size >= 2 (blocks rotate at least 2 channels)")
        if b not in divisors or isinstance(b, bool):
            raise ValueError(
                f"{name}: block_size={block_size!r} is not valid for head_dim={head_dim}; choose one of {divisors} "
                f"(a divisor >= 2 of head_dim) or None (= {head_dim}, one dense rotation)"
            )
        check_choice(f"{name}: coords", coords, LIERE_COORDS)
        if not (isinstance(init_range, (int, float)) and math.isfinite(init_range) and init_range >= 0):
            raise ValueError(f"{name}: init_range must be a finite number >= 0 (entries ~ U(0, init_range)), got {init_range!r}")
        if grid_size is not None and len(tuple(grid_size)) != self.num_axes:
            raise ValueError(f"{name}: grid_size={tuple(grid_size)} must have {self.num_axes} axes")
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.depth = depth
        self.grid_size = None if grid_size is None else tuple(int(g) for g in grid_size)
        self.block_size = b
        self.num_blocks = head_dim // b
        self.per_layer = bool(per_layer)
        self.per_head = bool(per_head)
        self.coords = coords
        self.init_range = float(init_range)
        self.zero_init = bool(zero_init)
        layers, heads = (depth if self.per_layer else 1), (num_heads if self.per_head else 1)
        # per (axis, layer', head', block): the strictly upper triangle of a skew-symmetric b x b generator
        self.generator_entries = nn.Parameter(torch.empty(self.num_axes, layers, heads, self.num_blocks, b * (b - 1) // 2))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.zero_init:
            nn.init.zeros_(self.generator_entries)
        else:
            nn.init.uniform_(self.generator_entries, 0.0, self.init_range)

    # -- generators --------------------------------------------------------------------------
    def axis_generators(self) -> torch.Tensor:
        """The skew-symmetric generators ``A_i`` in block form ``(N, depth', H', m, b, b)``."""
        return skew_from_entries(self.generator_entries, self.block_size)

    @torch.no_grad()
    def set_generators(self, generators: torch.Tensor) -> None:
        """Load skew-symmetric block generators ``(N, depth', H', m, b, b)`` (broadcast to this encoding's
        ``(N, depth', H')``), e.g. another encoding's :meth:`axis_generators`."""
        want = tuple(self.generator_entries.shape[:-1]) + (self.block_size, self.block_size)
        try:
            gens = generators.to(self.generator_entries).expand(want)
        except RuntimeError:
            raise ValueError(f"generators of shape {tuple(generators.shape)} do not fit {want} (N, depth', H', m, b, b)") from None
        self.generator_entries.copy_(entries_from_skew(gens))

    # -- coordinates and rotations -------------------------------------------------------------
    def token_coordinates(self, grid: PositionGrid, device: torch.device | str | None = None) -> torch.Tensor:
        """``(S + N, ndim)``: the prefix tokens' coordinate (0 for ``'liere'``: the identity; the centre 0.5 for
        ``'centers'``), then the lattice's."""
        lattice = liere_coordinates(grid, self.coords, self.grid_size, device)
        s = grid.num_prefix_tokens
        if not s:
            return lattice
        prefix = lattice.new_full((s, grid.ndim), 0.0 if self.coords == "liere" else 0.5)
        return torch.cat([prefix, lattice])

    def rotations(self, grid: PositionGrid, device: torch.device | str | None = None) -> torch.Tensor:
        """Block rotations of every layer and token, ``(depth', H', S + N, m, b, b)``, float32."""
        self.check_grid(grid)
        dev = self.generator_entries.device if device is None else torch.device(device)
        coords = liere_coordinates(grid, self.coords, self.grid_size, dev)
        s = grid.num_prefix_tokens
        if s:  # the prefix tokens share one coordinate: exponentiate it once, with the lattice
            coords = torch.cat([coords.new_full((1, grid.ndim), 0.0 if self.coords == "liere" else 0.5), coords])
        with torch.autocast(device_type=dev.type, enabled=False):
            rot = rotations_from_generators(coords, self.axis_generators().to(dev))
        if s > 1:
            rot = torch.cat([rot[..., :1, :, :, :].expand(*rot.shape[:-4], s, *rot.shape[-3:]), rot[..., 1:, :, :, :]], dim=-4)
        return rot

    # -- the rotary hooks ----------------------------------------------------------------------
    def prepare(self, grid: PositionGrid, device: torch.device | None = None) -> LieREState:
        self.check_grid(grid)
        key = ("liere", grid.shape, grid.num_prefix_tokens, str(device), self.grid_size)
        return self.cached(key, lambda: LieREState(self.rotations(grid, device), self.per_layer), uses_parameters=True)

    def keep_tokens(self, state: LieREState, grid: PositionGrid) -> LieREState:
        return replace(state, token_index=grid.sequence_index())

    def rotate_qk(self, q: torch.Tensor, k: torch.Tensor, state: LieREState, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        rot = state.for_layer(layer)  # (H', S + N, m, b, b)
        if state.token_index is None:
            if rot.shape[1] != q.shape[-2]:
                raise ValueError(
                    f"LieRE rotations cover {rot.shape[1]} tokens but attention got {q.shape[-2]} "
                    f"(patch dropout must narrow the state through keep_tokens)"
                )
            return rotate_blocks(q, k, rot)
        idx = state.token_index
        if idx.shape != (q.shape[0], q.shape[-2]):
            raise ValueError(f"LieRE keeps {tuple(idx.shape)} (batch, tokens) after patch dropout but attention got q {tuple(q.shape)}")
        # each sample keeps other tokens: gather its rows, (H', B, n, ...) -> (B, H', n, ...)
        return rotate_blocks(q, k, rot[:, idx].movedim(1, 0), per_sample=True)

    def no_weight_decay(self) -> set[str]:
        return {"generator_entries"}

    def extra_repr(self) -> str:
        return (
            f"block_size={self.block_size}, num_blocks={self.num_blocks}, per_layer={self.per_layer}, "
            f"per_head={self.per_head}, coords={self.coords!r}, init_range={self.init_range:.4g}, zero_init={self.zero_init}"
        )


@register_encoding("liere", paper="2406.10322", benchmark_options={"block_size": 8})
class LieRE(LieREBase):
    """LieRE on 2D image grids ``(h, w)``."""

    grid_ndims = (2,)


@register_encoding("liere_3d", paper="2406.10322", benchmark_options={"block_size": 8})
class LieRE3d(LieREBase):
    """LieRE on video grids ``(t, h, w)``."""

    grid_ndims = (3,)
