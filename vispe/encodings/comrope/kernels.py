"""ComRoPE's block-rotation kernels: per-token ``b x b`` block rotations built (``matrix_exp``) and applied to q and k,
including the line-table path whose rotations are products of gathered factors (:class:`_GatheredBlockRotation`,
a hand-written backward that saves no per-token rotations) and the contiguous batched matmul (:class:`_BlockMatmul`).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..base import autocast_off_in_backward
from ..block_rotation import rotate_blocks

__all__ = ["block_rotations", "rotation_from_generators", "block_matmul", "apply_block_rotation", "rotate_pair",
           "rotate_pair_gathered", "rotate_pair_selected"]


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
