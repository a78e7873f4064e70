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

Computation. :meth:`LieREBase.prepare` builds every layer's per-token block rotations once per forward
(``depth' x H' x (1 + N) x m`` blocks of ``b x b``, ``depth' = depth`` if ``per_layer`` else 1, ``H'`` likewise;
``1 +``: the prefix tokens share one rotation), float32 with autocast off, cached per grid while no gradient needs
it (eval). Non-commuting generators have no per-axis factorisation (ComRoPE's line tables need
``exp(sum) = prod exp``), but the generator sum is linear in the coordinates, so the Taylor polynomial of
``exp(M_t / 2^s_t)`` is a polynomial in the token's coordinates with token-independent matrix coefficients (the
generators' word sums): one dense GEMM for every token, then ``s_t`` squarings per token
(:func:`_lattice_exp`; ``s_t`` from the token's norm bound, tokens sorted by it). The backward differentiates exactly
those steps from the saved scaled exponentials, and both run as one opaque op under ``torch.compile``
(``vispe::liere_rotations``). Accuracy is that of ``torch.linalg.matrix_exp`` at the same precision
(``tests/test_liere.py``). Rotations are applied blockwise (:func:`rotate_blocks`: one batched ``b x b`` product
per (head, token, block), the batch of q and k folded into the matrix columns), never as a dense
``head_dim x head_dim`` matmul when ``b < head_dim``; that product saves only the unrotated q/k and the rotations
for its backward. Cost and its floor: ``docs/speed.md``; design notes: ``docs/design/liere.md``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch
import torch.nn as nn

from .._checks import Choice, Int, Ints, Real, check_choice
from .base import register_encoding
from .grid import PositionGrid
from .block_rotation import rotate_blocks
from .native import small_bmm
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


# The exponential of a generator sum, exactly, without a per-token matrix_exp. Every token's sum
# M(x) = sum_i x_i A_i is linear in its coordinates, so the Taylor polynomial of exp(M) is a polynomial in x whose
# matrix coefficients do not depend on the token:
#     (sum_i x_i A_i)^k = sum_{|a| = k} x^a W_a,    W_a = the sum of every word with a_i letters A_i,
# built level by level (W_a = sum_i W_{a - e_i} A_i: one tall product per axis and level, shared by all tokens).
# The per-token polynomial is then ONE dense GEMM, coefficients (L, T) @ words (T, blocks*b*b), at the token's own
# scale 2^-s_t, and s_t squarings per token undo it: R = exp(M / 2^s_t)^(2^s_t). The squarings are the only
# per-token b x b products left. The backward differentiates exactly these steps (squarings, GEMM, word recursion)
# from the one saved table of scaled exponentials, rebuilding the (token-independent) word sums.


@functools.cache
def _monomials(num_axes: int, degree: int) -> tuple[tuple[tuple[tuple[int, ...], ...], ...], tuple[tuple[torch.Tensor, ...], ...]]:
    """Exponent tuples of every level ``k = 0..degree`` and, per level ``k >= 1`` and axis ``i``, the position in
    level ``k`` of each level ``k - 1`` exponent plus ``e_i`` (CPU index tensors)."""
    levels = [((0,) * num_axes,)]
    ups: list[tuple[torch.Tensor, ...]] = [()]
    for _ in range(degree):
        prev = levels[-1]
        step = [[tuple(a + (j == i) for j, a in enumerate(al)) for al in prev] for i in range(num_axes)]
        cur = tuple(sorted({al for row in step for al in row}, reverse=True))
        pos = {al: n for n, al in enumerate(cur)}
        levels.append(cur)
        ups.append(tuple(torch.tensor([pos[al] for al in row]) for row in step))
    return tuple(levels), tuple(ups)


#: truncation error target of the Taylor polynomial (per unit norm): below half an ulp of the working precision
_TAYLOR_TOL = {torch.float32: 2.0**-26, torch.float64: 2.0**-55}
#: largest Taylor degree per precision: at radius theta the terms grow to ~e^theta before cancelling, so the
#: degree (which sets theta) is capped where that loses about a digit, as scaling-and-squaring exponentials do
_MAX_DEGREE = {torch.float32: 18, torch.float64: 30}
#: CPU cost of one multiply-add in the dense coefficient GEMM relative to one in a batch of tiny ``b x b`` products
#: (measured ~1/15 on one thread: the tiny products are bound by per-matrix overhead)
_GEMM_COST = 1.0 / 15


@functools.cache
def _taylor_radius(degree: int, dtype: torch.dtype) -> float:
    """The largest ``theta`` at which the degree-``degree`` Taylor remainder of exp, ``sum_{k > d} theta^k / k!``,
    stays below :data:`_TAYLOR_TOL` (bisection on the bound ``theta^(d+1) / (d+1)! / (1 - theta / (d+2))``)."""
    tol, lo, hi = _TAYLOR_TOL[dtype], 0.0, float(degree + 2)
    for _ in range(60):
        mid = (lo + hi) / 2
        bound = math.exp((degree + 1) * math.log(mid) - math.lgamma(degree + 2)) / (1 - mid / (degree + 2))
        lo, hi = (mid, hi) if bound <= tol else (lo, mid)
    return lo


@dataclass
class _ExpPlan:
    """How :func:`_lattice_exp` computes one table (:func:`_exp_plan`)."""

    degree: int
    #: per token (in ``order``), its squarings, descending
    squarings: list[int]
    #: tokens sorted by squarings, most first
    order: torch.Tensor
    #: the generators' scale ``scale / 2^max(squarings)`` and each sorted token's coordinates ``(L, N)`` at its own scale
    gen_scale: float
    coords: torch.Tensor


def _exp_plan(coords: torch.Tensor, generators: torch.Tensor) -> _ExpPlan:
    """The degree and each token's squarings for :func:`_lattice_exp`.

    A token's ``||M||_2 <= ||M||_F / sqrt 2`` (a real skew-symmetric block's eigenvalues come in pairs ``+-i w``), with
    ``||M||_F^2 = x^T Gram x`` per block; ``s_t`` squarings bring it within the degree's Taylor radius. The degree
    minimises the work model: ``T(d)`` GEMM columns against ``sum_t s_t(d)`` per-token ``b x b`` products (forward,
    recomputation and backward counted) and the word recursion, among the degrees that need no more squarings than
    the highest (each squaring doubles the rounding error already in the table)."""
    n, b, num_tokens = generators.shape[0], generators.shape[-1], coords.shape[0]
    flat = generators.flatten(1, -3)
    gram = torch.einsum("igab,jgab->gij", flat, flat)  # (blocks, N, N)
    frob2 = torch.einsum("li,gij,lj->lg", coords, gram.to(coords.dtype), coords).amax(1) if num_tokens else coords.new_zeros(0)
    rho = (frob2.clamp_min(0) / 2).sqrt().double().cpu()  # one transfer: the plan is made on the host
    scale = float(coords.abs().max()) if num_tokens else 1.0
    if not (bool(torch.isfinite(rho).all()) and math.isfinite(scale)):
        raise ValueError("LieRE: the generator sums are not finite; the generators or coordinates overflowed")
    scale = scale or 1.0
    dtype = generators.dtype
    top = _MAX_DEGREE[dtype]

    def squarings(degree: int) -> torch.Tensor:
        return torch.ceil(torch.log2(rho / _taylor_radius(degree, dtype))).clamp_min(0).nan_to_num(0.0)

    fewest = int(squarings(top).max()) if num_tokens else 0
    best = None
    for degree in range(2, top + 1):
        s = squarings(degree)
        if num_tokens and int(s.max()) > fewest:
            continue
        levels, _ = _monomials(n, degree)
        terms = sum(len(lv) for lv in levels)
        words = n * sum(len(lv) for lv in levels[:-1])
        cost = 3 * _GEMM_COST * terms * num_tokens * b * b + 4 * float(s.sum()) * b**3 + 4 * words * b**3
        if best is None or cost < best[0]:
            best = (cost, degree, s)
    _, degree, s = best
    s_sorted, order = torch.sort(s, descending=True, stable=True)
    steps = s_sorted.long().tolist()
    top_s = steps[0] if steps else 0
    # token t at scale 2^-s_t with the generators at scale / 2^top_s: x_t * 2^(top_s - s_t) / scale
    per_token = torch.exp2(top_s - s_sorted).to(device=coords.device, dtype=coords.dtype) / scale
    order = order.to(coords.device)
    return _ExpPlan(degree, steps, order, scale / 2**top_s, coords.index_select(0, order) * per_token[:, None])


def _word_sums(gens: torch.Tensor, degree: int) -> list[torch.Tensor]:
    """Per level ``k``, the word sums ``W_a`` (``|a| = k``) of generators ``gens`` ``(N, P, b, b)``: ``(P, n_k, b, b)``."""
    n, p, b = gens.shape[0], gens.shape[1], gens.shape[-1]
    levels, ups = _monomials(n, degree)
    out = [torch.eye(b, dtype=gens.dtype, device=gens.device).expand(p, 1, b, b)]
    for k in range(1, degree + 1):
        prev = out[-1].reshape(p, -1, b)
        cur = gens.new_zeros(p, len(levels[k]), b, b)
        for i in range(n):
            # every word of level k - 1 times A_i on the right: one (n_{k-1} b x b) @ (b x b) product per block
            cur.index_add_(1, ups[k][i].to(gens.device), small_bmm(prev, gens[i]).view(p, -1, b, b))
        out.append(cur)
    return out


def _word_sums_backward(gens: torch.Tensor, levels: list[torch.Tensor], grads: list[torch.Tensor], degree: int) -> torch.Tensor:
    """Gradient of :func:`_word_sums` w.r.t. ``gens`` given each level's gradient ``grads`` (same shapes as ``levels``)."""
    n, p, b = gens.shape[0], gens.shape[1], gens.shape[-1]
    _, ups = _monomials(n, degree)
    g_gens = torch.zeros_like(gens)
    g_cur = grads[degree]
    for k in range(degree, 0, -1):
        prev = levels[k - 1].reshape(p, -1, b)
        g_prev = grads[k - 1].clone(memory_format=torch.contiguous_format) if k > 1 else None  # level 0 is the identity: nothing to pass on
        for i in range(n):
            g_y = g_cur.index_select(1, ups[k][i].to(gens.device)).reshape(p, -1, b)
            small_bmm(prev.transpose(1, 2), g_y, out=g_gens[i], accumulate=True)  # sum over the words of W^T dY
            if g_prev is not None:
                small_bmm(g_y, gens[i].transpose(1, 2), out=g_prev.view(p, -1, b), accumulate=True)
        g_cur = g_prev
    return g_gens


def _monomial_coefficients(coords: torch.Tensor, degree: int) -> torch.Tensor:
    """``x^a / |a|!`` per token and exponent, levels in order: ``(L, T)``."""
    levels, _ = _monomials(coords.shape[1], degree)
    exps = torch.tensor([al for lv in levels for al in lv], device=coords.device)  # (T, N)
    fact = torch.tensor([float(math.factorial(k)) for k, lv in enumerate(levels) for _ in lv], dtype=coords.dtype,
                        device=coords.device)
    # x_i^0 .. x_i^degree by cumulative products (a power with a tensor exponent is far slower), gathered per exponent
    powers = torch.cat([torch.ones_like(coords[:, None, :]), coords[:, None, :].expand(-1, degree, -1).cumprod(1)], dim=1)
    coef = powers.gather(1, exps[None].expand(coords.shape[0], -1, -1)).prod(-1)  # (L, T)
    return coef / fact


def _exp_words(coords: torch.Tensor, generators: torch.Tensor) -> tuple[_ExpPlan, torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """The plan, scaled generators ``(N, P, b, b)`` (``P`` = blocks), their word sums per level and the coefficients
    ``(L, T)`` of the sorted tokens: what forward and backward both need."""
    plan = _exp_plan(coords, generators)
    n, b = generators.shape[0], generators.shape[-1]
    gens = generators.reshape(n, -1, b, b) * plan.gen_scale
    return plan, gens, _word_sums(gens, plan.degree), _monomial_coefficients(plan.coords, plan.degree)


def _steps(squarings: list[int]) -> list[int]:
    """Per squaring ``j``, how many (sorted) tokens take it: those with ``s_t > j``."""
    top = squarings[0] if squarings else 0
    return [sum(1 for s in squarings if s > j) for j in range(top)]


def _lattice_exp(coords: torch.Tensor, generators: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``exp(sum_i x_i A_i)`` per token and block: ``(L, N)``, ``(N, *lead, m, b, b)`` -> ``(*lead, L, m, b, b)``; and
    the scaled exponentials ``exp(M_t / 2^s_t)`` of the sorted tokens ``(L, P, b, b)``, which the backward starts from."""
    with torch.autocast(device_type=coords.device.type, enabled=False):
        plan, gens, levels, coef = _exp_words(coords, generators)
        b, p, num_tokens = gens.shape[-1], gens.shape[1], coords.shape[0]
        words = gens.new_empty(coef.shape[1], p, b, b)  # (T, P, b, b): token-independent columns of the GEMM
        for lv, dst in zip(levels, words.split([lv.shape[1] for lv in levels])):
            dst.copy_(lv.transpose(0, 1))
        scaled = (coef @ words.view(coef.shape[1], -1)).view(num_tokens, p, b, b)
        lead, m = generators.shape[1:-3], generators.shape[-3]
        out = scaled.new_empty(*lead, num_tokens, m, b, b)
        by_token = out.view(-1, num_tokens, m, b, b).transpose(0, 1)  # (L, lead, m, b, b) view of the output
        # sorted rows [n_j, n_{j-1}) take j squarings: write each range once it has them
        steps, cur, done = _steps(plan.squarings), scaled, num_tokens
        for j in range(len(steps) + 1):
            count = steps[j] if j < len(steps) else 0
            by_token.index_copy_(0, plan.order[count:done], cur[count:done].view(-1, *by_token.shape[1:]))
            if count:
                head = cur[:count].reshape(-1, b, b)
                cur, done = small_bmm(head, head).view(count, p, b, b), count
        return out, scaled


def _lattice_exp_backward(coords: torch.Tensor, generators: torch.Tensor, scaled: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`_lattice_exp` w.r.t. the generators, from its ``scaled`` exponentials: the squarings' adjoints,
    then the GEMM's and the word recursion's."""
    with torch.autocast(device_type=coords.device.type, enabled=False):
        plan, gens, levels, coef = _exp_words(coords, generators)
        num_tokens, p, b = scaled.shape[0], scaled.shape[1], scaled.shape[-1]
        g = grad.to(scaled.dtype).reshape(-1, num_tokens, generators.shape[-3], b, b)
        final = g.transpose(0, 1).index_select(0, plan.order).reshape(num_tokens, p, b, b)  # sorted, token-major
        # R = E^(2^s) = E_{s-1} E_{s-1}, E_{j+1} = E_j E_j: the adjoint of each squaring, dE_j = dR E_j^T + E_j^T dR, is a
        # linear map in E_j's powers, which commute, so the maps can be applied in forward order: no chain is kept
        # rows [n_j, n_{j-1}) are done after the adjoints of their j squarings; each step writes only the rows still
        # going (a new, shorter tensor), and a finished range is copied once into `final` for ONE GEMM at the end
        steps = _steps(plan.squarings)
        e, g_cur, done = scaled, final, num_tokens
        for j, count in enumerate(steps):
            if g_cur is not final:
                final[count:done] = g_cur[count:done]
            ej = e[:count].reshape(-1, b, b)
            et = ej.transpose(1, 2)
            gj = g_cur[:count].reshape(-1, b, b)
            g_cur, done = small_bmm(gj, et).view(count, p, b, b), count
            small_bmm(et, gj, out=g_cur.view(-1, b, b), accumulate=True)
            if j + 1 < len(steps):
                nxt = e[: steps[j + 1]].reshape(-1, b, b)
                e = small_bmm(nxt, nxt).view(steps[j + 1], p, b, b)
        if g_cur is not final:
            final[:done] = g_cur
        g_words = coef.transpose(0, 1) @ final.view(num_tokens, -1)  # (T, P*b*b)
        g_words = g_words.view(-1, p, b, b).transpose(0, 1)  # (P, T, b, b), a view
        g_levels = list(g_words.split([lv.shape[1] for lv in levels], dim=1))
        g_gens = _word_sums_backward(gens, levels, g_levels, plan.degree) * plan.gen_scale
        return g_gens.view(generators.shape)


@torch.library.custom_op("vispe::liere_rotations", mutates_args=())
def _liere_rotations(coords: torch.Tensor, generators: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # an opaque op to torch.compile: the plan (degree, squarings) depends on the generators' norms
    return _lattice_exp(coords, generators)


@_liere_rotations.register_fake
def _(coords: torch.Tensor, generators: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    *_, m, b, _ = generators.shape
    out = generators.new_empty(*generators.shape[1:-3], coords.shape[0], m, b, b)
    return out, generators.new_empty(coords.shape[0], out.numel() // (coords.shape[0] * b * b), b, b)


@torch.library.custom_op("vispe::liere_rotations_backward", mutates_args=())
def _liere_rotations_backward(coords: torch.Tensor, generators: torch.Tensor, scaled: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return _lattice_exp_backward(coords, generators, scaled, grad)


@_liere_rotations_backward.register_fake
def _(coords: torch.Tensor, generators: torch.Tensor, scaled: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(generators)


def _liere_rotations_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs, output[1])
    ctx.mark_non_differentiable(output[1])


def _liere_rotations_grad(ctx, grad: torch.Tensor, _grad_scaled: torch.Tensor | None):
    coords, generators, scaled = ctx.saved_tensors
    return None, _liere_rotations_backward(coords, generators, scaled, grad.contiguous())


_liere_rotations.register_autograd(_liere_rotations_grad, setup_context=_liere_rotations_setup)


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
        return _liere_rotations(coords.to(device=g.device, dtype=dtype).contiguous(), g.contiguous())[0]


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

    def __post_init__(self) -> None:
        # one view per layer from ONE unbind: its backward stacks the layers' gradients once, where indexing would
        # zero-fill and add a whole table per layer
        self._layers = self.rotations.unbind(0)

    def for_layer(self, layer: int) -> torch.Tensor:
        """One layer's rotations ``(H', S + N, m, b, b)``."""
        return self._layers[layer if self.per_layer else 0]


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
