"""ComRoPE (Yu et al., CVPR 2025): rotary encoding with trainable, pairwise-commuting angle matrices.

Each token at coordinate ``x`` rotates q and k by ``R(x) = exp(sum_i x_i A_i)`` with commuting,
block-diagonal skew-symmetric generators: AP (axis partition) and LD (linearly dependent) variants,
2D and 3D. A member of the rotary family (:class:`~vispe.encodings.rotary.RotaryEncoding`) that rotates
by blocks through :meth:`ComRopeBase.rotate_qk`. How the rotations are built, applied and recomputed,
coordinates, and choices against the released code: ``docs/design/comrope.md``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar, Optional, Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .._checks import Bool, Choice, Int, Real, check_choice
from .base import autocast_off_in_backward, register_encoding
from .block_rotation import rotate_blocks
from .rotary import RotaryEncoding, RotaryState, apply_rotary, rotary_table
from .coordinates import CoordinateAugmentation, random_axis_indices, random_scale_shift
from .grid import PositionGrid

__all__ = [
    "ComRopeBase",
    "ComRopeAP",
    "ComRopeLD",
    "ComRopeLD3d",
    "ComRopeState",
    "ComRopeSpectralState",
    "ROTATION_METHODS",
    "spectral_decomposition",
    "rotate_pair_spectral",
    "block_rotations",
    "apply_block_rotation",
    "rotate_pair",
    "rotate_pair_gathered",
    "rotation_from_generators",
    "comrope_coordinates",
]


def _skew(p: torch.Tensor) -> torch.Tensor:
    return p - p.transpose(-1, -2)


def block_rotations(coef: torch.Tensor, skew: torch.Tensor) -> torch.Tensor:
    """``matrix_exp(coef[..., n, j] * skew[..., j, :, :])`` in float32 with autocast off.

    Args:
        coef: per-token scalars ``(..., L, m)``.
        skew: skew-symmetric blocks ``(..., m, b, b)`` (leading dims broadcast against ``coef``'s).

    Returns:
        rotations ``(..., L, m, b, b)``.
    """
    dev_type = coef.device.type
    with torch.autocast(device_type=dev_type, enabled=False):
        gen = (coef.float()[..., None, None] * skew.float().unsqueeze(-4)).contiguous()
        return torch.linalg.matrix_exp(gen)


def rotation_from_generators(coords: torch.Tensor, generators: torch.Tensor) -> torch.Tensor:
    """General ``R(x) = exp(sum_i x_i A_i)`` for block-diagonal generators (no commutation assumed).

    Args:
        coords: ``(L, N)`` token coordinates.
        generators: ``(N, ..., m, b, b)`` per-axis block generators.

    Returns:
        ``(..., L, m, b, b)`` block rotations (float32). Used to check the theory (e.g. a free,
        non-commuting LieRE-style set loses shift invariance) and by tests.
    """
    with torch.autocast(device_type=coords.device.type, enabled=False):
        g = generators.float()
        n_axes = g.shape[0]
        if coords.shape[-1] != n_axes:
            raise ValueError(f"coords have {coords.shape[-1]} axes but there are {n_axes} generators")
        # (N, ..., 1, m, b, b) * (L, 1, 1, 1) summed over N -> (..., L, m, b, b)
        lead = g.shape[1:-3]
        c = coords.float().reshape(coords.shape[0], n_axes, *([1] * len(lead)))
        c = c.permute(1, *range(2, 2 + len(lead)), 0)  # (N, *1, L)
        m = (c[..., None, None, None] * g.unsqueeze(-4)).sum(0)
        return torch.linalg.matrix_exp(m.contiguous())


class _BlockMatmul(torch.autograd.Function):
    """``torch.bmm`` whose backward also runs on contiguous operands.

    Autograd's own ``bmm`` backward multiplies by transposed views, which on CPU falls back to one
    copy per small matrix (thousands of 8x8 matrices here); transposing once up front avoids that.
    """

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(a, b)
        return torch.bmm(a, b)

    @staticmethod
    @autocast_off_in_backward
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        a, b = ctx.saved_tensors
        grad = grad.contiguous()
        ga = torch.bmm(grad, b.transpose(1, 2).contiguous()) if ctx.needs_input_grad[0] else None
        gb = torch.bmm(a.transpose(1, 2).contiguous(), grad) if ctx.needs_input_grad[1] else None
        return ga, gb


def block_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` over broadcast leading dims for many small matrices, float32, autocast off."""
    lead = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    p, q, r = a.shape[-2], a.shape[-1], b.shape[-1]
    with torch.autocast(device_type=a.device.type, enabled=False):
        a2 = a.float().expand(*lead, p, q).reshape(-1, p, q).contiguous()
        b2 = b.float().expand(*lead, q, r).reshape(-1, q, r).contiguous()
        return _BlockMatmul.apply(a2, b2).reshape(*lead, p, r)


def apply_block_rotation(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(B, H, L, m*b)`` by block rotations ``rot`` ``(H or 1, L, m, b, b)``.

    Channels ``[j*b, (j+1)*b)`` form block ``j``. The batch is folded into the matrix columns so the
    work is one batched ``(b x b) @ (b x B)`` product per (head, token, block) -- never a dense
    ``head_dim x head_dim`` matrix; math in float32, output with unit channel stride in ``x``'s dtype (SDPA's fused
    CPU/GPU kernels need a unit last-dim stride).
    """
    return rotate_pair(x, None, rot)[0]


def _pair_columns(q: torch.Tensor, k: torch.Tensor | None, m: int, b: int) -> torch.Tensor:
    """``(n, B, H, L, m*b)`` -> ``(H, L, m, b, n*B)``: the batch (of q and k) as matrix columns, float32."""
    bsz, heads, length, dh = q.shape
    if m * b != dh:
        raise ValueError(f"rotation has {m} blocks of size {b} but the head dimension is {dh}")
    xs = q.float()[None] if k is None else torch.stack([q.float(), k.float()])
    n = xs.shape[0]
    return xs.reshape(n, bsz, heads, length, m, b).permute(2, 3, 4, 5, 0, 1).reshape(heads, length, m, b, n * bsz)


def _split_columns(
    out: torch.Tensor, like: torch.Tensor, pair: bool, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Inverse of :func:`_pair_columns`: contiguous ``(B, H, L, m*b)`` tensors (in ``dtype`` or ``like``'s)."""
    bsz, heads, length, dh = like.shape
    n = 2 if pair else 1
    m, b = out.shape[2], out.shape[3]
    # memory order (B, L, n, H, dh), returned as (B, H, L, dh) views: the token-major order of timm's
    # qkv projection, so SDPA's output comes back token-major too and the head merge before the
    # output projection stays a view instead of a copy that autograd would keep
    res = torch.empty(bsz, length, n, heads, dh, dtype=dtype or like.dtype, device=like.device)
    res.view(bsz, length, n, heads, m, b).copy_(out.reshape(heads, length, m, b, n, bsz).permute(5, 1, 4, 0, 2, 3))
    return res[:, :, 0].transpose(1, 2), (res[:, :, 1].transpose(1, 2) if pair else None)


def rotate_pair(q: torch.Tensor, k: torch.Tensor | None, rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate ``q`` and ``k`` (same shape) by per-token block rotations ``rot`` ``(H or 1, L, m, b, b)``
    in ONE batched product (the shared blockwise path :func:`~vispe.encodings.block_rotation.rotate_blocks`)."""
    if k is None:
        return rotate_blocks(q, q, rot)[0], None
    return rotate_blocks(q, k, rot)


class _GatheredBlockRotation(torch.autograd.Function):
    """Rotate q and k by per-token rotations that are products of gathered line-table factors:
    ``out[h, n, j] = F_0[h, idx_0[n, j]] @ ... @ F_{A-1}[h, idx_{A-1}[n, j]] @ x[h, n, j]`` for both,
    in one product.

    The factors come from small per-(head, block) line tables (one per factor: LD keeps one table per
    grid axis, since ``R(x) = prod_a exp(x_a G_a)``; AP needs one). Their products are formed for
    this layer only (:func:`_combined_table`), gathered per token, and formed and gathered again in
    the backward; only the factor tables and the *unrotated* q/k are saved (views of the qkv
    projection, which SDPA keeps alive through ``v`` anyway), so the rotation adds no saved
    activations beyond its outputs. The combined table's gradient is a scatter-add, taken back to
    the factor tables through the matmuls that formed it.
    """

    @staticmethod
    def forward(ctx, flat_idx: torch.Tensor, q: torch.Tensor, k: torch.Tensor, *tables: torch.Tensor):  # type: ignore[override]
        b = tables[0].shape[-1]
        m = flat_idx.shape[-1] // q.shape[-2]
        cols = _pair_columns(q, k, m, b)  # (H, L, m, b, 2B) float32
        table, idx = _combined_table(tables, flat_idx, m)  # this layer only; freed after the product
        rot = _gather_rows(table, idx)
        out = torch.bmm(rot, cols.reshape(-1, b, cols.shape[-1])).reshape(cols.shape)
        ctx.save_for_backward(flat_idx, q, k, *tables)
        return _split_columns(out, q, True, torch.float32)

    @staticmethod
    @autocast_off_in_backward
    def backward(ctx, grad_q: torch.Tensor, grad_k: torch.Tensor):  # type: ignore[override]
        flat_idx, q, k, *tables = ctx.saved_tensors
        b = tables[0].shape[-1]
        m = flat_idx.shape[-1] // q.shape[-2]
        g = _pair_columns(grad_q, grad_k, m, b)
        c = g.shape[-1]
        g2 = g.reshape(-1, b, c)
        want_tables = any(ctx.needs_input_grad[3:])
        # recompute this layer's combined table (with a graph back to the factor tables when needed)
        leaves = [t.detach().requires_grad_(want_tables) for t in tables]
        with torch.enable_grad():
            table, idx = _combined_table(leaves, flat_idx, m)
        rot = _gather_rows(table.detach(), idx)
        g_q = g_k = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            # (bmm on a transposed view of these small matrices is faster on CPU than copying them first)
            g_cols = torch.bmm(rot.transpose(1, 2), g2).reshape(g.shape)
            g_q, g_k = _split_columns(g_cols, q, True)
            g_k = g_k.to(k.dtype)
        g_tables: tuple[torch.Tensor | None, ...] = (None,) * len(tables)
        if want_tables:
            cols = _pair_columns(q, k, m, b)
            g_rot = torch.bmm(g2, cols.reshape(-1, b, c).transpose(1, 2))  # dL/dR per (h, n, j)
            g_table = torch.zeros_like(table).index_add_(1, idx, g_rot.reshape(table.shape[0], -1, b, b))
            if len(tables) == 1:
                g_tables = (g_table,)
            else:  # through the (few, large) matmuls that formed the combined table
                g_tables = torch.autograd.grad(table, leaves, g_table)
        return (None, g_q, g_k, *g_tables)


def _combined_table(
    tables: Sequence[torch.Tensor], flat_idx: torch.Tensor, m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One table ``(H, m*K, b, b)`` holding every product ``F_0[r_0] ... F_{A-1}[r_{A-1}]`` of the factor
    tables' rows (``K = prod K_a``), and each (token, block)'s row in it ``(L*m,)``.

    For every (head, block) the product with the next factor is ONE ``(K b x b) @ (b x K_a b)`` matmul
    -- far cheaper on CPU than per-token ``b x b`` products. Built per layer inside attention (and
    again in its backward), so only one layer's combined table exists at a time."""
    if len(tables) == 1:
        return tables[0], flat_idx.reshape(-1)
    idx2 = flat_idx.reshape(len(tables), -1)
    block = torch.arange(idx2.shape[-1], device=idx2.device) % m
    heads, b = tables[0].shape[0], tables[0].shape[-1]
    acc = tables[0].reshape(heads, m, -1, b, b)
    row = idx2[0] - block * acc.shape[2]
    for t, flat in zip(tables[1:], idx2[1:]):
        k, n = acc.shape[2], t.shape[1] // m
        left = acc.reshape(heads, m, k * b, b)
        right = t.reshape(heads, m, n, b, b).permute(0, 1, 3, 2, 4).reshape(heads, m, b, n * b)
        acc = torch.matmul(left, right).reshape(heads, m, k, b, n, b).permute(0, 1, 2, 4, 3, 5).reshape(heads, m, k * n, b, b)
        row = row * n + (flat - block * n)
    return acc.reshape(heads, -1, b, b), row + block * acc.shape[2]


def _gather_rows(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` of a line table ``(H, R, b, b)`` as ``(H * len(idx), b, b)``."""
    return table.index_select(1, idx).reshape(-1, table.shape[-2], table.shape[-1])


def _gathered_product(tables: Sequence[torch.Tensor], flat_idx: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The gathered factors ``[F_0, ..., F_{A-1}]`` and their running products ``[F_0, F_0 F_1, ..., R]``,
    each ``(H*L*m, b, b)``."""
    idx2 = flat_idx.reshape(len(tables), -1)
    factors = [_gather_rows(t, idx) for t, idx in zip(tables, idx2)]
    prods = [factors[0]]
    for f in factors[1:]:
        prods.append(torch.bmm(prods[-1], f))
    return factors, prods


def rotate_pair_gathered(
    q: torch.Tensor, k: torch.Tensor, tables: torch.Tensor | Sequence[torch.Tensor], flat_idx: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotate_pair` with each token's block rotation the product of factors gathered from line
    tables: ``tables`` is one ``(H, R_a, b, b)`` tensor or a sequence of them (one per factor),
    ``flat_idx`` ``(L*m,)`` or ``(A, L*m)`` the rows per (token, block) (see :class:`ComRopeState`);
    outputs token-major with unit channel stride, in q's dtype."""
    if isinstance(tables, torch.Tensor):
        tables = (tables,)
    flat_idx = flat_idx.reshape(len(tables), -1)
    b = tables[0].shape[-1]
    m = flat_idx.shape[-1] // q.shape[-2]
    if m * b != q.shape[-1]:
        raise ValueError(f"rotation has {m} blocks of size {b} but the head dimension is {q.shape[-1]}")
    with torch.autocast(device_type=q.device.type, enabled=False):
        tables = tuple(t.float().contiguous() for t in tables)
        if torch.compiler.is_compiling():
            # the same maths in plain differentiable ops: the compiler chooses what to keep for backward itself
            # (the hand-written backward's autograd.grad call cannot be traced)
            table, idx = _combined_table(tables, flat_idx, m)
            cols = _pair_columns(q, k, m, b)
            out = torch.bmm(_gather_rows(table, idx), cols.reshape(-1, b, cols.shape[-1])).reshape(cols.shape)
            q2, k2 = _split_columns(out, q, True, torch.float32)
        else:
            q2, k2 = _GatheredBlockRotation.apply(flat_idx, q, k, *tables)
    return q2.to(q.dtype), k2.to(k.dtype)


def rotate_pair_selected(
    q: torch.Tensor, k: torch.Tensor, rotations: torch.Tensor, token_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q, k`` ``(B, H, n, m*b)`` by per-token block rotations ``(H, L, m, b, b)`` taken at each
    sample's rows ``token_index`` ``(B, n)`` (the tokens patch dropout kept); float32 maths, q's dtype out."""
    return rotate_blocks(q, k, rotations[:, token_index].movedim(1, 0), per_sample=True)


# ---------------------------------------------------------------------------------------------
# Spectral path: every ComRoPE rotation is a fixed basis change plus per-pair phases
# ---------------------------------------------------------------------------------------------

#: How ComRoPE rotates q and k: ``'auto'`` takes the spectral path whenever the generators allow it
#: (even block size, eigenvalues apart), else the block products; ``'blocks'`` always multiplies by the
#: per-token ``b x b`` block rotations.
ROTATION_METHODS = ("auto", "blocks")
#: Smallest gap between the eigenvalues of ``i S`` (and so the smallest ``2 omega``) for the spectral
#: path: its gradient divides by these gaps (float32 noise / gap stays below ~1e-4 relative).
SPECTRAL_MIN_GAP = 1e-5


def spectral_decomposition(skew: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Real normal form ``S = Q J Q^T`` of skew-symmetric blocks ``skew`` ``(..., b, b)``, ``b`` even.

    ``J`` is block-diagonal with 2x2 blocks ``[[0, -w_k], [w_k, 0]]``, so ``exp(c S) = Q rot(c w) Q^T``.
    Computed from the Hermitian ``i S`` in float64 (``eigh``; its eigenvalues are ``+-w_k``): for the
    eigenvector ``u_k`` of ``+w_k`` the columns ``2k, 2k+1`` of ``Q`` are ``sqrt(2) Re u_k`` and
    ``sqrt(2) Im u_k``. Differentiable (the loss must not depend on the eigenvectors' phases, which
    holds for attention logits: both q and k are expressed in the same basis).

    Returns:
        ``(Q (..., b, b) float32, w (..., b/2) float32 >= 0, eigenvalues (..., b) float64 ascending)``.
    """
    b = skew.shape[-1]
    with torch.autocast(device_type=skew.device.type, enabled=False):
        evals, evecs = torch.linalg.eigh(1j * skew.double().to(torch.complex128))
        top = evecs[..., b // 2 :]
        basis = torch.stack([top.real, top.imag], dim=-1).flatten(-2) * math.sqrt(2.0)
        return basis.float(), evals[..., b // 2 :].float(), evals


class _SpectralRotation(torch.autograd.Function):
    """``q, k -> phase(q @ W), phase(k @ W)``: a block-diagonal orthogonal basis change ``W`` ``(H, dh, dh)``
    shared by every token, then per-pair phases from a rotary table (``view_as_real`` form ``(..., L, P, 2)``).

    Every product runs per head over all ``B * L`` tokens at once (``(H, B*L, dh) @ (H, dh, dh)``; q and k are
    token-major views of the qkv projection, so ``(H, B*L, dh)`` is a view too). Saves only q, k (which
    attention keeps alive through ``v`` anyway), ``W`` and the table; ``q @ W`` is recomputed in the backward
    instead of being stored per layer.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, basis: torch.Tensor, table_ri: torch.Tensor):  # type: ignore[override]
        ctx.save_for_backward(q, k, basis, table_ri)
        bsz, heads, length, dh = q.shape
        table = _heads_first(torch.view_as_complex(table_ri))  # (H, B or 1, L, P)
        # written token-major (memory (B, L, 2, H, dh), like timm's qkv): SDPA then returns its output
        # token-major and the head merge before the output projection stays a view, not a kept copy
        res = torch.empty(bsz, length, 2, heads, dh, dtype=torch.float32, device=q.device)
        outs = (res[:, :, 0].transpose(1, 2), res[:, :, 1].transpose(1, 2))
        for x, out in zip((q, k), outs):
            y = _by_head(x, basis)  # (H, B, L, dh)
            out_h = out.transpose(0, 1)
            if torch.compiler.is_compiling():
                out_h.copy_(torch.view_as_real(_complex_pairs(y) * table).flatten(-2))
            else:
                torch.mul(_complex_pairs(y), table, out=_complex_pairs(out_h))
        return outs

    @staticmethod
    @autocast_off_in_backward
    def backward(ctx, grad_q: torch.Tensor, grad_k: torch.Tensor):  # type: ignore[override]
        q, k, basis, table_ri = ctx.saved_tensors
        table_c = torch.view_as_complex(table_ri)
        table = _heads_first(table_c)
        need_x = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        g_basis = torch.zeros_like(basis) if ctx.needs_input_grad[2] else None
        g_table = torch.zeros_like(table) if ctx.needs_input_grad[3] else None
        grads = []
        for x, g in ((q, grad_q), (k, grad_k)):
            g_c = _complex_pairs(g.float().transpose(0, 1))  # (H, B, L, P)
            g_y = torch.view_as_real(g_c * table.conj()).flatten(-2).contiguous()  # rotate back by -phase
            flat_g = g_y.flatten(1, 2)  # (H, B*L, dh)
            if need_x:
                grads.append(torch.bmm(flat_g, basis.transpose(-1, -2)).view_as(g_y).transpose(0, 1))
            else:
                grads.append(None)
            if g_basis is not None:
                g_basis += torch.bmm(_tokens_by_head(x).transpose(-1, -2), flat_g)
            if g_table is not None:
                y = _by_head(x, basis)
                g_table += (g_c * _complex_pairs(y).conj()).sum_to_size(table.shape)
        if g_table is not None:
            g_table = torch.view_as_real(_heads_first(g_table, back=table_c.ndim)).contiguous()
        return grads[0], grads[1], g_basis, g_table


def _heads_first(table: torch.Tensor, back: int | None = None) -> torch.Tensor:
    """A rotary table ``(H, L, P)`` / ``(B, H, L, P)`` as ``(H, 1|B, L, P)`` (``back``: the inverse, to that rank)."""
    if back is None:
        return table.unsqueeze(1) if table.ndim == 3 else table.transpose(0, 1)
    return table.squeeze(1) if back == 3 else table.transpose(0, 1)


def _tokens_by_head(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, L, dh)`` -> ``(H, B*L, dh)`` (a view for token-major q/k)."""
    return x.transpose(0, 1).reshape(x.shape[1], -1, x.shape[-1])


def _by_head(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``x @ basis`` per head for all tokens of the batch: ``(B, H, L, dh)``, ``(H, dh, dh)`` -> ``(H, B, L, dh)``."""
    return torch.bmm(_tokens_by_head(x), basis).view(x.shape[1], x.shape[0], x.shape[2], x.shape[3])


def _complex_pairs(x: torch.Tensor) -> torch.Tensor:
    """Interleaved channel pairs ``(..., 2P)`` as a complex view ``(..., P)``."""
    return torch.view_as_complex(x.unflatten(-1, (-1, 2)))


def rotate_pair_spectral(
    q: torch.Tensor, k: torch.Tensor, basis: torch.Tensor, table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q, k`` ``(B, H, L, dh)`` as ComRoPE does, in the generators' eigenbasis: ``basis`` ``(H, dh, dh)``
    (block-diagonal, orthogonal; ``x @ basis`` takes each block to its normal-form coordinates) and the
    complex phase ``table`` ``(..., L, dh/2)`` (interleaved pairs). The logits ``q' k'^T`` equal those of the
    block rotations ``Q rot Q^T`` (the trailing ``Q`` cancels between q and k); float32 maths, q's dtype out."""
    with torch.autocast(device_type=q.device.type, enabled=False):
        q2, k2 = _SpectralRotation.apply(q.float(), k.float(), basis.float(), torch.view_as_real(table))
    return q2.to(q.dtype), k2.to(k.dtype)


@dataclass
class ComRopeSpectralState:
    """Per-forward ComRoPE state on the spectral path: per layer a block-diagonal basis ``(depth, H, dh, dh)``
    and the per-pair phases as a per-layer :class:`~vispe.encodings.rotary.RotaryState` (``(depth, H, L, P)``)."""

    basis: torch.Tensor
    rotary: RotaryState
    num_blocks: int
    #: the host folded the basis into its q/k projection (:meth:`ComRopeBase.fold_qk_basis`): only the phases remain
    basis_folded: bool = False

    def for_layer(self, layer: int) -> torch.Tensor:
        """Dense per-token block rotations ``(H, L, m, b, b)`` of one layer, ``Q rot(phase) Q^T`` (analysis, tests)."""
        heads, dh = self.basis.shape[1], self.basis.shape[-1]
        m = self.num_blocks
        b = dh // m
        # the diagonal blocks of the basis are the Q_j themselves (x @ Q_j = (Q_j^T x)^T)
        q_mat = self.basis[layer].reshape(heads, m, b, m, b).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2)  # (H, m, b, b)
        phase = self.rotary.for_layer(layer)  # (H, L, P) complex
        c, s = phase.real.unflatten(-1, (m, b // 2)), phase.imag.unflatten(-1, (m, b // 2))  # (H, L, m, b/2)
        rot = torch.zeros(*c.shape[:-1], b, b, dtype=c.dtype, device=c.device)
        idx = torch.arange(b // 2, device=c.device)
        rot[..., 2 * idx, 2 * idx] = c
        rot[..., 2 * idx + 1, 2 * idx + 1] = c
        rot[..., 2 * idx + 1, 2 * idx] = s
        rot[..., 2 * idx, 2 * idx + 1] = -s
        return q_mat[:, None] @ rot @ q_mat[:, None].transpose(-1, -2)


def _odd_powers(half_step: torch.Tensor, count: int) -> torch.Tensor:
    """``A^1 .. A^count`` of ``A = half_step`` ``(..., b, b)`` by doubling: ``(..., count, b, b)``."""
    pows = half_step.unsqueeze(-3)
    cur = half_step  # A^k with k = pows.shape[-3]
    while pows.shape[-3] < count:
        pows = torch.cat([pows, block_matmul(pows, cur.unsqueeze(-3))], dim=-3)
        cur = block_matmul(cur, cur)
    return pows[..., :count, :, :]


def lattice_line_rotations(gen: torch.Tensor, size: int, jitter: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    """``exp(v G)`` for the ``size`` patch-centre values ``v_i = scale (i + 0.5) / size`` of one axis (each
    optionally moved by ``jitter[i]``), plus the centre ``v = 0.5`` appended last.

    Centres are odd multiples of ``1 / (2 size)`` and the centre is ``size`` of them, so one
    ``matrix_exp(G / (2 size))`` per block and a few batched products give the whole axis
    (exact up to float32 rounding): ``(..., size + 1, b, b)`` for generators ``gen`` ``(..., b, b)``.
    ``scale != 1`` (ComRoPE-3D's released time axis, ``(t + 0.5) / n_spatial``) evaluates the lines with
    ``scale G`` and the centre row by its own ``matrix_exp(G / 2)``.
    """
    if scale != 1.0:
        lines = lattice_line_rotations(gen * scale, size, jitter)[..., :-1, :, :]
        with torch.autocast(device_type=gen.device.type, enabled=False):
            centre = torch.linalg.matrix_exp((0.5 * gen.float()).contiguous())
        return torch.cat([lines, centre.unsqueeze(-3)], dim=-3)
    with torch.autocast(device_type=gen.device.type, enabled=False):
        gen = gen.float()
        half = torch.linalg.matrix_exp((gen / (2 * size)).contiguous())
        pows = _odd_powers(half, 2 * size)  # A^1 .. A^(2 size)
        lines = pows[..., 0::2, :, :]  # A^(2i + 1): the patch centres
        if jitter is not None:
            eps = torch.linalg.matrix_exp((jitter.float()[:, None, None] * gen.unsqueeze(-3)).contiguous())
            lines = block_matmul(lines, eps)
        return torch.cat([lines, pows[..., size - 1 : size, :, :]], dim=-3)


def line_offsets(
    grid: PositionGrid,
    device: torch.device | str | None = None,
    sigma: float = 0.0,
    coord_shift: float = 0.0,
    coord_jitter: float = 1.0,
    coord_rescale: float = 1.0,
    random_positions: float = 1.0,
) -> list[torch.Tensor]:
    """Training-time moves of ComRoPE's normalised line coordinates ``(i + 0.5) / n``, one draw per forward
    (shared by the batch), as per-line offsets in normalised units (what :func:`lattice_line_rotations` and
    :func:`comrope_coordinates` take), applied in this order:

    - ``random_positions = r`` (RPE-2D): each axis's ``n`` lines sit at an ordered random subset of the
      ``ceil(r n)`` centres of a lattice ``r`` times finer over the same extent -- the positions a grid ``r``
      times larger is evaluated at, since ComRoPE normalises every grid to ``(0, 1)``;
    - ``sigma``: the paper's per-line perturbation (:func:`line_jitter`);
    - ``coord_rescale`` / ``coord_jitter``: about the grid centre ``0.5``, every axis scaled by one factor
      log-uniform in ``[1/coord_rescale, coord_rescale]`` times its own in ``[1/coord_jitter, coord_jitter]``;
    - ``coord_shift``: each axis shifted by a uniform ``[-coord_shift, coord_shift]`` patches.

    Coordinates stay one per line and the generators commute, so rotations still factor per axis and attention
    depends on (moved) offsets only.
    """
    base = [(torch.arange(n, device=device, dtype=torch.float32) + 0.5) / n for n in grid.shape]
    coords = list(base)
    if random_positions > 1:
        pools = [max(n, math.ceil(random_positions * n)) for n in grid.shape]
        coords = [(c + 0.5) / m for c, m in zip(random_axis_indices(grid.shape, pools, device), pools)]
    if sigma > 0:
        coords = [c + j for c, j in zip(coords, line_jitter(grid, sigma, device))]
    if coord_rescale > 1 or coord_jitter > 1 or coord_shift > 0:
        scale, shift = random_scale_shift(len(grid.shape), coord_shift, coord_jitter, coord_rescale)
        coords = [(c - 0.5) * f + 0.5 + d / n for c, f, d, n in zip(coords, scale.tolist(), shift.tolist(), grid.shape)]
    return [c - b for c, b in zip(coords, base)]


def line_jitter(grid: PositionGrid, sigma: float, device: torch.device | str | None = None) -> list[torch.Tensor]:
    """Training-time perturbation: one offset per lattice line of every axis, in normalised units.

    Each line moves by ``N(0, (0.5 sigma)^2)`` patches clamped to +-0.5 patch (it stays inside its
    patch), as in the released code -- but per line and per forward (shared by the batch) rather than
    per patch and sample, so rotations stay one lattice product and batch-independent.
    """
    return [(torch.randn(n, device=device) * (0.5 * sigma)).clamp(-0.5, 0.5) / n for n in grid.shape]


def comrope_coordinates(
    grid: PositionGrid, device: torch.device | str | None, jitter: Sequence[torch.Tensor] | None = None
) -> torch.Tensor:
    """Normalised coordinates ``(S + N, ndim)``: prefix tokens at ``0.5``, patches at their centres
    ``(i + 0.5) / size`` (plus the per-line ``jitter`` of :func:`line_jitter`, if given)."""
    coords = grid.centers(device)
    if jitter is not None:
        idx = grid.indices(device).long()
        coords = coords + torch.stack([j.to(coords.device)[idx[:, a]] for a, j in enumerate(jitter)], dim=-1)
    if grid.num_prefix_tokens:
        coords = torch.cat([coords.new_full((grid.num_prefix_tokens, grid.ndim), 0.5), coords], dim=0)
    return coords


def _token_line_index(grid: PositionGrid, device: torch.device | str | None) -> list[torch.Tensor]:
    """Per axis, each token's row in :func:`lattice_line_rotations` (prefix tokens -> the centre row)."""
    idx = grid.indices(device).long()
    out = []
    for a, n in enumerate(grid.shape):
        pre = torch.full((grid.num_prefix_tokens,), n, dtype=torch.long, device=idx.device)
        out.append(torch.cat([pre, idx[:, a]]))
    return out


@dataclass
class ComRopeState:
    """Per-forward rotations in compact form: per layer, one or more factor line tables
    ``(H, m*K_a, b, b)``, and for every factor and (token, block) its row, ``flat_index`` ``(A, L*m)``;
    a token's block rotation is ``prod_a tables[layer][a][:, flat_index[a, n*m + j]]``. AP has one
    factor (each block follows one axis; ``K`` = that axis' lines + centre); LD has one per grid axis
    (``R(x) = prod_a exp(x_a G_a)``), so every table holds only ``O(lines * blocks * b^2)`` and the
    per-token products are formed inside attention and recomputed in the backward.
    """

    tables: tuple[tuple[torch.Tensor, ...], ...]
    flat_index: torch.Tensor
    num_blocks: int
    #: after patch dropout: each sample's present tokens, rows ``(B, n)`` of the full sequence
    token_index: Optional[torch.Tensor] = None

    @classmethod
    def build(cls, tables: Sequence[torch.Tensor], index: torch.Tensor) -> "ComRopeState":
        """``tables``: per factor ``(depth, H, m, K_a, b, b)``; ``index`` ``(A, L, m)`` rows into each ``K_a``."""
        m = tables[0].shape[2]
        offsets = torch.arange(m, device=index.device)
        flat = torch.stack([(index[a] + offsets * t.shape[3]).reshape(-1) for a, t in enumerate(tables)])
        per_factor = [t.reshape(t.shape[0], t.shape[1], -1, *t.shape[-2:]).contiguous().unbind(0) for t in tables]
        return cls(tuple(zip(*per_factor)), flat, m)

    def for_layer(self, layer: int) -> torch.Tensor:
        """Dense per-token block rotations ``(H, L, m, b, b)`` of one layer (for analysis and tests)."""
        tables = self.tables[layer]
        heads, b = tables[0].shape[0], tables[0].shape[-1]
        return _gathered_product(tables, self.flat_index)[1][-1].reshape(heads, -1, self.num_blocks, b, b)


class ComRopeBase(CoordinateAugmentation, RotaryEncoding):
    """Shared machinery of the ComRoPE variants; subclasses define :meth:`coefficients`.

    A rotary encoding whose per-token rotations are commuting ``b x b`` block rotations rather than
    per-pair phases: it keeps the rotary family's attention path and overrides :meth:`rotate_qk`.
    """

    pairwise_phases = False
    prefix_policy = "prefix tokens (cls, registers) sit at the grid centre (0.5, ...) and are rotated like patches"
    num_axes: ClassVar[int] = 2

    #: option rules, checked before __init__ (vispe._checks; see PositionalEncoding.option_checks)
    option_checks = {
        "block_size": Int(2),
        "init_std": Real(0, 1e3),  # larger generators no longer give finite rotations
        "zero_init": Bool(),
        "sigma": Real(0, 1e3),
        "rotation": Choice(ROTATION_METHODS),
    }  # the coordinate options' rules: vispe.encodings.coordinates (coordinate_options)

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        depth: int,
        block_size: int = 8,
        init_std: float = 1.0,
        zero_init: bool = False,
        sigma: float = 0.0,
        rotation: str = "auto",
        coord_shift: float = 0.0,
        coord_jitter: float = 1.0,
        coord_rescale: float = 1.0,
        random_positions: float = 1.0,
    ) -> None:
        super().__init__()
        check_choice("rotation", rotation, ROTATION_METHODS)
        self.set_coordinate_augmentation(coord_shift, coord_jitter, coord_rescale, random_positions)
        if not isinstance(block_size, int) or block_size < 2:
            raise ValueError(f"block_size must be an integer >= 2, got {block_size!r}")
        if head_dim % block_size:
            raise ValueError(
                f"{self.registry_name or type(self).__name__}: block_size={block_size} does not divide head_dim={head_dim}; "
                f"choose a block size among the divisors of {head_dim} (default 8)"
            )
        if sigma < 0:
            raise ValueError(f"sigma (position perturbation) must be >= 0, got {sigma}")
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.depth = depth
        self.block_size = block_size
        self.num_blocks = head_dim // block_size
        self.sigma = float(sigma)
        self.rotation = rotation
        self.init_std = init_std
        self.zero_init = zero_init
        b, m = block_size, self.num_blocks
        # raw (unconstrained) matrices P; the generator block is P - P^T
        self.base = nn.Parameter(torch.empty(depth, num_heads, m, b, b))

    def reset_parameters(self) -> None:
        if self.zero_init:
            nn.init.zeros_(self.base)
        else:
            nn.init.normal_(self.base, std=self.init_std)

    # -- to implement ----------------------------------------------------------------------
    def coefficients(self, coords: torch.Tensor) -> torch.Tensor:
        """Per-token block scalars ``(depth, H or 1, L, m)`` from coordinates ``(L, N)``."""
        raise NotImplementedError

    def axis_generators(self) -> torch.Tensor:
        """The per-axis generators ``A_i`` in block form ``(N, depth, H, m, b, b)`` (for analysis/tests)."""
        raise NotImplementedError

    # -- shared ------------------------------------------------------------------------------
    def skew_blocks(self) -> torch.Tensor:
        return _skew(self.base.float())

    def axis_line_generators(self) -> list[torch.Tensor]:
        """Per axis, the block generators that multiply that axis' coordinate (see subclasses)."""
        raise NotImplementedError

    def combine(self, tables: list[torch.Tensor], lines: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Per-axis line tables + each token's line per axis -> factor tables ``[(depth, H, m, K_a, b, b)]``
        and rows ``index (A, L, m)`` (see :class:`ComRopeState`)."""
        raise NotImplementedError

    def line_tables(self, grid: PositionGrid, device: torch.device | None) -> tuple[list[torch.Tensor], torch.Tensor]:
        """``(tables [(depth, H, m, K_a, b, b)], index (A, L, m))``: factor line tables and each
        (token, block)'s row in each; a block rotation is the product of its factors.
        ``R(x) = prod_a exp(x_a G_a)`` (the generators commute), each axis from
        :func:`lattice_line_rotations`."""
        dev = device if device is not None else self.base.device
        jitter = self.line_offsets(grid, dev)
        scales = self.axis_scales(grid)
        with torch.autocast(device_type=torch.device(dev).type, enabled=False):
            gens = self.axis_line_generators()
            if torch.is_grad_enabled() and any(g.requires_grad for g in gens):
                # the doubling products' saved operands would sit in memory through the whole
                # backward (~10-20 MiB for ViT-S); recomputing them at its end costs a few ms
                tables = [
                    checkpoint(lattice_line_rotations, gen, grid.shape[a], None if jitter is None else jitter[a],
                               scales[a], use_reentrant=False)
                    for a, gen in enumerate(gens)
                ]
            else:
                tables = [lattice_line_rotations(gen, grid.shape[a], None if jitter is None else jitter[a], scales[a])
                          for a, gen in enumerate(gens)]
            # per axis: (depth, H, m_a, n_a + 1, b, b), the last row is the centre (prefix tokens)
            return self.combine(tables, _token_line_index(grid, dev))

    def rotations(self, grid: PositionGrid, device: torch.device | None) -> torch.Tensor:
        """Dense block rotations for every layer and token: ``(depth, H, L, m, b, b)``, float32.

        Equals :meth:`reference_rotations` (one ``matrix_exp`` per token) up to float32 rounding.
        """
        state = ComRopeState.build(*self.line_tables(grid, device))
        return torch.stack([state.for_layer(i) for i in range(self.depth)])

    def axis_scales(self, grid: PositionGrid) -> tuple[float, ...]:
        """Per axis, the factor on the lattice coordinates ``(i + 0.5) / size``; default 1 (each axis in (0, 1))."""
        return (1.0,) * grid.ndim

    def coordinates(self, grid: PositionGrid, device: torch.device | str | None,
                    jitter: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """Each token's coordinates ``(S + N, ndim)``: :func:`comrope_coordinates` times :meth:`axis_scales`
        on the lattice rows (prefix tokens stay at the centre ``0.5``)."""
        coords = comrope_coordinates(grid, device, jitter)
        scales = self.axis_scales(grid)
        if any(f != 1.0 for f in scales):
            factor = torch.tensor(scales, device=coords.device, dtype=coords.dtype)
            s = grid.num_prefix_tokens
            coords = torch.cat([coords[:s], coords[s:] * factor], dim=0)
        return coords

    def reference_rotations(self, grid: PositionGrid, device: torch.device | None = None,
                            jitter: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """Direct ``matrix_exp`` of every token's block generator (slow; for tests and analysis)."""
        coords = self.coordinates(grid, device if device is not None else self.base.device, jitter)
        with torch.autocast(device_type=coords.device.type, enabled=False):
            return block_rotations(self.coefficients(coords), self.skew_blocks())

    @property
    def augments_coordinates(self) -> bool:
        """A training-time move of the coordinates is on (and the module is in training mode): the shared
        coordinate options or the paper's per-line ``sigma``."""
        return super().augments_coordinates or (self.training and self.sigma > 0)

    def line_offsets(self, grid: PositionGrid, device: torch.device | str | None) -> list[torch.Tensor] | None:
        """This forward's per-line coordinate offsets (:func:`line_offsets`), or ``None`` when nothing moves."""
        if not self.augments_coordinates:
            return None
        return line_offsets(grid, device, self.sigma, self.coord_shift, self.coord_jitter, self.coord_rescale,
                            self.random_positions)

    def cacheable(self) -> bool:
        if self.augments_coordinates:  # drawn anew every forward
            return False
        return not (torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()))

    def spectral_state(self, grid: PositionGrid, device: torch.device | None) -> ComRopeSpectralState | None:
        """The rotations in the generators' eigenbasis, or ``None`` where that path does not apply
        (``rotation='blocks'``, an odd block size, or eigenvalues closer than :data:`SPECTRAL_MIN_GAP`,
        e.g. ``zero_init``'s zero generators).

        Each block generator is ``c S_j`` (AP: ``c`` the block's axis coordinate; LD: ``c = sum_i theta_ij x_i``)
        with one skew-symmetric ``S_j = Q_j J_j Q_j^T`` per (layer, head, block), so the token's block
        rotation is ``Q_j rot(c w_j) Q_j^T``: a basis change shared by all tokens and a per-pair phase. The
        outer ``Q_j`` cancels in ``q'^T k'``, so attention sees exactly ComRoPE's logits from one dense
        ``(dh x dh)`` product per head and RoPE's elementwise rotation, instead of per-token ``b x b`` products.
        """
        if self.rotation != "auto" or self.block_size % 2 or torch.compiler.is_compiling():
            # compiled: the eigenvalue-gap test below is a data-dependent branch a graph cannot take, so a compiled
            # model always uses the line-table path (exact for any generators; the spectral one is a speed-up)
            return None
        dev = device if device is not None else self.base.device
        with torch.autocast(device_type=torch.device(dev).type, enabled=False):
            blocks, omega, evals = spectral_decomposition(self.skew_blocks())  # (depth, H, m, b, b), (depth, H, m, b/2)
            if bool(evals.detach().diff(dim=-1).min() <= SPECTRAL_MIN_GAP):
                return None
            coef = self.coefficients(self.coordinates(grid, dev, self.line_offsets(grid, dev)))  # (depth, H or 1, L, m)
            angles = (coef[..., None] * omega[:, :, None]).flatten(-2)  # (depth, H, L, m * b/2)
            m = self.num_blocks
            eye = torch.eye(m, device=blocks.device, dtype=blocks.dtype)
            basis = (blocks.unsqueeze(-2) * eye[:, None, :, None]).flatten(-4, -3).flatten(-2)  # block-diagonal (depth, H, dh, dh)
            return ComRopeSpectralState(basis, RotaryState(rotary_table(angles), per_layer=True), m)

    def build_state(self, grid: PositionGrid, device: torch.device | None) -> ComRopeState | ComRopeSpectralState:  # type: ignore[override]
        state = self.spectral_state(grid, device)
        return state if state is not None else ComRopeState.build(*self.line_tables(grid, device))

    def prepare(self, grid: PositionGrid, device: torch.device | None = None) -> ComRopeState | ComRopeSpectralState:
        self.check_grid(grid)
        key = ("comrope", grid.shape, grid.num_prefix_tokens, str(device))
        return self.cached(key, lambda: self.build_state(grid, device), uses_parameters=True)

    def keep_tokens(self, state: ComRopeState | ComRopeSpectralState, grid: PositionGrid) -> ComRopeState | ComRopeSpectralState:
        if isinstance(state, ComRopeSpectralState):
            return replace(state, rotary=state.rotary.select(grid.sequence_index()))
        return replace(state, token_index=grid.sequence_index())

    def fold_qk_basis(self, state: ComRopeState | ComRopeSpectralState,
                      layer: int = 0) -> tuple[torch.Tensor | None, ComRopeState | ComRopeSpectralState]:
        # spectral path: the basis change is linear and shared by every token, so a host may fold it into the
        # q/k projection weights; what is left is RoPE's per-pair phases
        if isinstance(state, ComRopeSpectralState) and not state.basis_folded:
            return state.basis[layer], replace(state, basis_folded=True)
        return None, state

    def rotate_qk(self, q: torch.Tensor, k: torch.Tensor, state: ComRopeState | ComRopeSpectralState,
                  layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(state, ComRopeSpectralState):
            table = state.rotary.for_layer(layer)
            if table.shape[-2] != q.shape[-2]:
                raise ValueError(
                    f"ComRoPE rotations cover {table.shape[-2]} tokens but attention got {q.shape[-2]} "
                    f"(patch dropout must narrow the state through keep_tokens)"
                )
            if state.basis_folded:  # q and k arrive in the eigenbasis: the phases alone
                return apply_rotary(q, table), apply_rotary(k, table)
            return rotate_pair_spectral(q, k, state.basis[layer], table)
        n_tok = state.flat_index.shape[-1] // state.num_blocks if state.token_index is None else state.token_index.shape[1]
        if n_tok != q.shape[-2]:
            raise ValueError(
                f"ComRoPE rotations cover {n_tok} tokens but attention got {q.shape[-2]} "
                f"(patch dropout must narrow the state through keep_tokens)"
            )
        if state.token_index is not None:
            # patch dropout: each sample keeps other tokens, so the batch-shared gathered kernel does not
            # apply; rotate by the dense per-token rotations, selected per sample (plain autograd)
            return rotate_pair_selected(q, k, state.for_layer(layer), state.token_index)
        return rotate_pair_gathered(q, k, state.tables[layer], state.flat_index)

    def no_weight_decay(self) -> set[str]:
        return set()  # the released code decays the generators with everything else

    def extra_repr(self) -> str:
        aug = self.coordinate_repr()
        return (f"block_size={self.block_size}, num_blocks={self.num_blocks}, sigma={self.sigma}, zero_init={self.zero_init}, "
                f"rotation={self.rotation!r}{aug}")


class ComRopeAPBase(ComRopeBase):
    """Axis partition: block ``j`` rotates with the coordinate of axis ``j mod N``."""

    def __init__(self, head_dim: int, num_heads: int, depth: int, block_size: int = 8, init_std: float = 1.0,
                 zero_init: bool = False, sigma: float = 0.0, rotation: str = "auto", coord_shift: float = 0.0,
                 coord_jitter: float = 1.0, coord_rescale: float = 1.0, random_positions: float = 1.0) -> None:
        super().__init__(head_dim, num_heads, depth, block_size, init_std, zero_init, sigma, rotation, coord_shift, coord_jitter,
                         coord_rescale, random_positions)
        if self.num_blocks % self.num_axes:
            raise ValueError(
                f"{self.registry_name or type(self).__name__}: head_dim/block_size = {self.num_blocks} blocks cannot be split "
                f"evenly over {self.num_axes} axes; choose block_size so that head_dim/block_size is a multiple of {self.num_axes}"
            )
        self.register_buffer("axis_of_block", torch.arange(self.num_blocks) % self.num_axes, persistent=False)
        self.reset_parameters()

    def coefficients(self, coords: torch.Tensor) -> torch.Tensor:
        c = coords.float()[:, self.axis_of_block.to(coords.device)]  # (L, m)
        return c.expand(self.depth, 1, *c.shape)

    def axis_line_generators(self) -> list[torch.Tensor]:
        s = self.skew_blocks()  # block j = k * N + a belongs to axis a
        return [s[:, :, a :: self.num_axes] for a in range(self.num_axes)]

    def combine(self, tables, lines):
        # each block has one axis: pad the axes' line tables to one length and interleave the blocks back
        k = max(t.shape[-3] for t in tables)
        padded = [torch.cat([t, t[..., -1:, :, :].expand(*t.shape[:-3], k - t.shape[-3], *t.shape[-2:])], dim=-3)
                  if t.shape[-3] < k else t for t in tables]
        table = torch.stack(padded, dim=-4).flatten(-5, -4)  # (depth, H, m/N, N, K, b, b) -> (depth, H, m, K, b, b)
        index = torch.stack(lines, dim=-1).repeat(1, self.num_blocks // self.num_axes)  # block j -> axis j mod N
        return [table], index[None]

    def axis_generators(self) -> torch.Tensor:
        s = self.skew_blocks()  # (depth, H, m, b, b)
        onehot = (self.axis_of_block[None, :] == torch.arange(self.num_axes, device=s.device)[:, None]).float()
        return onehot[:, None, None, :, None, None] * s[None]


class ComRopeLDBase(ComRopeBase):
    """Linearly dependent: block ``j`` of axis ``i`` is ``theta_ij (P_j - P_j^T)``."""

    def __init__(self, head_dim: int, num_heads: int, depth: int, block_size: int = 8, init_std: float = 1.0,
                 zero_init: bool = False, sigma: float = 0.0, shared_scalars: bool = False, rotation: str = "auto",
                 coord_shift: float = 0.0, coord_jitter: float = 1.0, coord_rescale: float = 1.0,
                 random_positions: float = 1.0) -> None:
        super().__init__(head_dim, num_heads, depth, block_size, init_std, zero_init, sigma, rotation, coord_shift, coord_jitter,
                         coord_rescale, random_positions)
        self.shared_scalars = shared_scalars
        heads = 1 if shared_scalars else num_heads
        self.scalars = nn.Parameter(torch.empty(depth, heads, self.num_axes, self.num_blocks))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "scalars"):
            nn.init.normal_(self.scalars, std=1.0)

    def coefficients(self, coords: torch.Tensor) -> torch.Tensor:
        # (L, N) x (depth, H', N, m) -> (depth, H', L, m)
        return torch.einsum("ln,dhnm->dhlm", coords.float(), self.scalars.float())

    def axis_line_generators(self) -> list[torch.Tensor]:
        s = self.skew_blocks()  # (depth, H, m, b, b)
        th = self.scalars.float()  # (depth, H', N, m)
        return [th[:, :, a, :, None, None] * s for a in range(self.num_axes)]

    def combine(self, tables, lines):
        # one factor per axis: the per-token product of the axes' factors is formed inside attention
        # (and recomputed in its backward), never stored for all lattice combinations and layers
        index = torch.stack([idx[:, None].expand(-1, self.num_blocks) for idx in lines])
        return list(tables), index

    def axis_generators(self) -> torch.Tensor:
        s = self.skew_blocks()  # (depth, H, m, b, b)
        th = self.scalars.float().expand(self.depth, self.num_heads, self.num_axes, self.num_blocks)
        return th.permute(2, 0, 1, 3)[..., None, None] * s[None]


@register_encoding("comrope_ap")
class ComRopeAP(ComRopeAPBase):
    """ComRoPE-AP on 2D grids (block ``j`` -> row axis if ``j`` is even, column axis if odd)."""

    grid_ndims = (2,)
    num_axes = 2


@register_encoding("comrope_ld")
class ComRopeLD(ComRopeLDBase):
    """ComRoPE-LD on 2D grids."""

    grid_ndims = (2,)
    num_axes = 2


#: ComRoPE-3D time coordinate: released ``(t + 0.5) / n_spatial`` or vispe's ``(t + 0.5) / T``
COMROPE_TIME_SCALES: tuple[str, ...] = ("spatial", "frames")


@register_encoding("comrope_ld_3d")
class ComRopeLD3d(ComRopeLDBase):
    """ComRoPE-LD on video grids ``(t, h, w)``.

    Height and width are normalised to (0, 1) (``(i + 0.5) / size``). Time follows the released code by
    default, ``time_scale='spatial'``: frame ``t`` at ``(t + 0.5) / n_spatial`` (Longin-Yu/ComRoPE,
    ``model.py``, ``CustomVITConfig.get_positions``, the ``num_axes == 3`` branch: the ``(frame, row, col)``
    indices are all divided by ``num_patches_on_single_axis``), so one frame step is one spatial patch step
    and more frames reach further, like RoPE's time axis; ``n_spatial`` is the larger of ``h`` and ``w`` on
    non-square grids (the released code has square images only). ``time_scale='frames'``
    (vispe before issue 27): ``(t + 0.5) / T``, every clip's time spans (0, 1) whatever its length --
    frame-count changes then compress or stretch time instead of extending it. Prefix tokens sit at 0.5 on
    every axis, as released (``cls_position``).
    """

    option_checks = {"time_scale": Choice(COMROPE_TIME_SCALES)}

    grid_ndims = (3,)
    num_axes = 3

    def __init__(self, head_dim: int, num_heads: int, depth: int, block_size: int = 8, init_std: float = 1.0,
                 zero_init: bool = False, sigma: float = 0.0, shared_scalars: bool = False, rotation: str = "auto",
                 coord_shift: float = 0.0, coord_jitter: float = 1.0, coord_rescale: float = 1.0,
                 random_positions: float = 1.0, time_scale: str = "spatial") -> None:
        check_choice("time_scale", time_scale, COMROPE_TIME_SCALES)
        super().__init__(head_dim, num_heads, depth, block_size, init_std, zero_init, sigma, shared_scalars, rotation,
                         coord_shift, coord_jitter, coord_rescale, random_positions)
        self.time_scale = time_scale

    def axis_scales(self, grid: PositionGrid) -> tuple[float, ...]:
        if self.time_scale == "frames":
            return (1.0,) * grid.ndim
        t, h, w = grid.shape
        return (t / max(h, w), 1.0, 1.0)
