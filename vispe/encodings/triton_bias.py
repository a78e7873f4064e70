"""Attention with a lattice logit term in fused Triton kernels (flash-attention style): the term is read per tile from
its small table and never exists as a ``(B, H, L, L)`` tensor, forward or backward.

The term is ``table[b, h, i, bucket(i, j)]`` with ``bucket(i, j) = lut[codes[i] - codes[j] + center]`` (``fill`` when
either token is a prefix token, whose code is negative; without ``lut`` the offset id itself): the form of every
lattice bias (ALiBi-2D, FIRE, ... read a per-head table ``(H, C)`` at the offset) and of iRPE's contextual term (its
projection ``z = s q r`` ``(B, H, L, buckets)`` read at the query's row). This is the form
:class:`~vispe.encodings.attention.IndexedBias` states through its ``gather`` rule; ``attention_backend='triton'``
runs such a term here.

Why: on a GPU a compiled model otherwise hands SDPA the dense term, which only PyTorch's memory-efficient kernel
differentiates. For iRPE (ViT-S/16, batch 128, bf16, H200) that kernel's forward and backward took 6.8 ms a step
over timm's APE model (16 ms), besides the term's gathers and their gradients. Here the forward is one kernel (the
online softmax of flash attention) and the backward three (``rowsum(dO * O)``, then keys' and queries' gradients,
which rebuild the probabilities from the saved log-sum-exp). For a table per row with at most
:data:`MAX_GRAD_COLUMNS` columns the term's gradient is ``dterm[b, h, i, c]``, the sum of dS over the row's pairs
whose bucket is ``c``: by default the queries' kernel stores dS and one batched matmul with the one-hot buckets sums
it (:data:`ROW_GRAD`); any other table gets dS per pair summed over the batch by atomic adds, then one ``index_add``
onto the table's columns.

The operators are ``torch.ops.vispe.term_attention`` / ``torch.ops.vispe.term_attention_backward``, ``triton_op`` s
with autograd that a compiled model traces into (:mod:`~vispe.encodings.triton_support`): its graph launches the
kernels itself, and the backward's position-only tensors (every pair's bucket, their one-hot) are computed once for
all layers. They run CUDA tensors, and CPU tensors in Triton's interpreter when ``TRITON_INTERPRET=1`` was set before
Triton's import (slow; for tests).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .triton_support import launch, triton_unavailable

__all__ = ["MAX_GRAD_COLUMNS", "term_attention", "triton_bias_unavailable"]

#: the most columns of a table per row (iRPE's ``z``: 50 buckets by default) whose gradient is summed per row
#: (:data:`ROW_GRAD`); a wider one, and a table shared by the rows (lattice biases: one column per offset), gets it per pair
MAX_GRAD_COLUMNS = 128
#: how a table-per-row's gradient is summed: in the queries' kernel, ``'one_hot'`` (each tile's dS against every column,
#: in registers: ~2 C operations per pair) or ``'atomic'`` (one atomic add per pair into the row's columns); or
#: ``'matmul'``: the kernel stores dS query-major and one batched matmul with the one-hot buckets sums it on tensor
#: cores (buckets shared by the batch; else ``'one_hot'``). Estimated for iRPE at ViT-S/16, batch 128, on an H200:
#: one-hot ~130 us a layer of CUDA-core work, the stored dS ~30 us of traffic; the GPU probe times all three
ROW_GRAD = "matmul"
#: per kernel, its tile (query rows, keys; the row sums of ``delta`` read no keys) and warps; the queries' backward
#: with one-hot sums takes 16 rows: it holds rows x keys x columns values per step. Untimed choices (the GPU probe,
#: results/speed/gpu-term-attention-*.py, times alternatives)
LAUNCH = {"forward": (64, 64, 4), "dkdv": (32, 64, 4), "dq": (64, 32, 4), "dq_one_hot": (16, 32, 4), "delta": (64, 0, 4)}


def triton_bias_unavailable(device: torch.device | str | None = None) -> str | None:
    """Why the fused term kernels cannot run on ``device`` (``None``: they can); without a device, only whether Triton
    imports."""
    return triton_unavailable("the fused attention-term kernels", device)


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << max(n - 1, 0).bit_length())


def _bhn(t: torch.Tensor) -> list[int]:
    """(batch, head, token) strides of a ``(B, H, L, ...)`` tensor; 0 along a size-1 dimension."""
    return [0 if t.shape[i] == 1 else t.stride(i) for i in range(3)]


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _term_args(table: torch.Tensor, codes_q: torch.Tensor, codes_k: torch.Tensor, lut: torch.Tensor | None) -> list[Any]:
    """The term's pointers as the kernels take them (after the q/k/v ones); without a lookup table a stand-in pointer."""
    return [table, codes_q, codes_k, codes_q if lut is None else lut]


def _term_strides(table: torch.Tensor, codes_q: torch.Tensor, codes_k: torch.Tensor) -> list[int]:
    return [*_bhn(table), 0 if codes_q.shape[0] == 1 else codes_q.stride(0), 0 if codes_k.shape[0] == 1 else codes_k.stride(0)]


def _kernels(device: torch.device) -> Any:
    """The kernels' module, once the device is known to run them."""
    why = triton_bias_unavailable(device)
    if why is not None:
        raise RuntimeError(why)
    from . import _triton_bias_kernel

    return _triton_bias_kernel


def _dot_precision() -> str:
    """How the kernels multiply float32 tiles: as PyTorch's CUDA matmuls do (TF32 only where PyTorch allows it)."""
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _attention_layout(like: torch.Tensor) -> torch.Tensor:
    """An empty tensor shaped as ``like`` ``(B, H, L, dh)``, stored token-major (as q/k/v sliced from timm's fused
    projection are), so the head merge after attention is a view."""
    return torch.empty_permuted(like.shape, (0, 2, 1, 3), dtype=like.dtype, device=like.device)


@torch.library.triton_op("vispe::term_attention", mutates_args=())
def _term_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, codes_q: torch.Tensor,
                       codes_k: torch.Tensor, lut: torch.Tensor | None, center: int, fill: int, scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = _rows(q), _rows(k), _rows(v)
    bsz, heads, tokens, dh = q.shape
    out = _attention_layout(q)
    lse = torch.empty((bsz, heads, tokens), dtype=torch.float32, device=q.device)
    bm, bn, warps = LAUNCH["forward"]
    launch(_kernels(q.device).term_attention_forward_kernel, (-(-tokens // bm), bsz * heads),
           q, k, v, out, lse, *_term_args(table, codes_q, codes_k, lut),
           *_bhn(q), *_bhn(k), *_bhn(v), *_bhn(out), *_term_strides(table, codes_q, codes_k),
           heads, tokens, dh, center, fill, scale,
           HAS_LUT=lut is not None, DOT_PRECISION=_dot_precision(), BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=_pow2(dh),
           num_warps=warps)
    return out, lse


def _pair_buckets(codes_q: torch.Tensor, codes_k: torch.Tensor, lut: torch.Tensor | None, center: int, fill: int) -> torch.Tensor:
    """Every pair's bucket ``(B|1, L, L)``, as the kernels compute it per tile."""
    pair = codes_q[:, :, None] - codes_k[:, None, :] + center
    pair = torch.where((codes_q[:, :, None] >= 0) & (codes_k[:, None, :] >= 0), pair, fill)
    return pair if lut is None else lut[pair]


def _term_grad_mode(table: torch.Tensor, tokens: int, shared_buckets: bool) -> int:
    """How the queries' kernel returns the term's gradient (its ``TERM_GRAD``), for a table per row with few columns
    as :data:`ROW_GRAD` says: summed per query row in the kernel (1: one-hot sums, 2: atomic adds), or dS per pair,
    query-major, then one batched product with the one-hot buckets here (4: buckets shared by the batch only); for
    any other table dS per pair (3), turned into table columns here."""
    if table.shape[2] == tokens and tokens > 1 and table.shape[-1] <= MAX_GRAD_COLUMNS:
        if ROW_GRAD == "matmul" and shared_buckets:
            return 4
        return 2 if ROW_GRAD == "atomic" else 1
    return 3


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _row_grad_by_matmul(ds_rows: torch.Tensor, bucket: torch.Tensor, table: torch.Tensor, bsz: int, heads: int) -> torch.Tensor:
    """The per-row table's gradient from dS stored query-major ``(L, B * H, Lp)`` (``Lp >= L``: rows padded for aligned
    products) and the buckets ``(1, L, L)``: for each query row, its dS against the one-hot of its buckets, all rows
    in one batched matmul ``(L, B*H, Lp) @ (L, Lp, Cp)``. Exact: each pair has one bucket. In dS's dtype (the
    table's), as a ``(B, H, L, C)`` view: the caller's cast to the table's dtype is the one copy."""
    tokens, _, padded = ds_rows.shape
    columns = table.shape[-1]
    # built without writing into tensors (a compiled graph would copy them): compare, then pad the keys
    one_hot = bucket[0].unsqueeze(-1) == torch.arange(_round_up(columns, 8), device=bucket.device)
    one_hot = F.pad(one_hot.to(ds_rows.dtype), (0, 0, 0, padded - tokens))  # (L, Lp, Cp)
    dz = torch.bmm(ds_rows, one_hot)[..., :columns]  # (L, B*H, C); the kernel zeroed dS's padding
    return dz.view(tokens, bsz, heads, columns).permute(1, 2, 0, 3)


@torch.library.triton_op("vispe::term_attention_backward", mutates_args=())
def _term_attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                                lse: torch.Tensor, table: torch.Tensor, codes_q: torch.Tensor, codes_k: torch.Tensor,
                                lut: torch.Tensor | None, center: int, fill: int, scale: float, term_grad: bool
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v, dout = _rows(q), _rows(k), _rows(v), _rows(dout)
    bsz, heads, tokens, dh = q.shape
    columns = table.shape[-1]
    out = _rows(out)
    delta = torch.empty((bsz, heads, tokens), dtype=torch.float32, device=q.device)  # rowsum(dO * O)
    dq, dk, dv = _attention_layout(q), _attention_layout(k), _attention_layout(v)
    shared_buckets = codes_q.shape[0] == 1 and codes_k.shape[0] == 1
    mode = _term_grad_mode(table, tokens, shared_buckets) if term_grad else 0
    # per pair: one (L, L) map per sample where the buckets or the table differ per sample, else summed over the batch
    pair_batch = mode == 3 and (not shared_buckets or table.shape[0] > 1)
    if mode in (1, 2):
        dterm = (torch.empty if mode == 1 else torch.zeros)((bsz, heads, tokens, columns), dtype=torch.float32, device=q.device)
    elif mode == 3:
        dterm = torch.zeros((bsz if pair_batch else 1, heads, tokens, tokens), dtype=torch.float32, device=q.device)
    elif mode == 4:  # dS in the table's dtype (as the dense path's term gradient), rows padded to 16 bytes (which the
        # kernel's key tiles, at least 16 wide for tl.dot, reach and zero)
        dterm = torch.empty((tokens, bsz * heads, _round_up(tokens, 8)), dtype=table.dtype, device=q.device)
    else:
        dterm = q.new_empty(0, dtype=torch.float32)
    term = [*_term_args(table, codes_q, codes_k, lut)]
    term_strides = _term_strides(table, codes_q, codes_k)
    block_d = _pow2(dh)
    kernels = _kernels(q.device)
    bm = LAUNCH["delta"][0]
    launch(kernels.term_attention_delta_kernel, (-(-tokens // bm), bsz * heads),
           out, dout, delta, *_bhn(out), *_bhn(dout), heads, tokens, dh,
           BLOCK_M=bm, BLOCK_D=block_d, num_warps=LAUNCH["delta"][2])
    bm, bn, warps = LAUNCH["dkdv"]
    launch(kernels.term_attention_dkdv_kernel, (-(-tokens // bn), bsz * heads),
           q, k, v, dout, lse, delta, dk, dv, *term,
           *_bhn(q), *_bhn(k), *_bhn(v), *_bhn(dout), *_bhn(dk), *_bhn(dv), *term_strides,
           heads, tokens, dh, center, fill, scale,
           HAS_LUT=lut is not None, DOT_PRECISION=_dot_precision(), BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d,
           num_warps=warps)
    bm, bn, warps = LAUNCH["dq_one_hot" if mode == 1 else "dq"]
    launch(kernels.term_attention_dq_kernel, (-(-tokens // bm), bsz * heads),
           q, k, v, dout, lse, delta, dq, dterm, *term,
           *_bhn(q), *_bhn(k), *_bhn(v), *_bhn(dout), *_bhn(dq), *term_strides,
           heads, tokens, dh, dterm.shape[-1] if mode == 4 else columns, center, fill, scale,
           HAS_LUT=lut is not None, DOT_PRECISION=_dot_precision(), TERM_GRAD=mode, PAIR_BATCH=pair_batch,
           BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d, BLOCK_C=_pow2(columns, 1) if mode == 1 else 1, num_warps=warps)
    if mode == 3:
        dterm = _pair_grad_to_table(dterm, table, _pair_buckets(codes_q, codes_k, lut, center, fill))
    elif mode == 4:
        dterm = _row_grad_by_matmul(dterm, _pair_buckets(codes_q, codes_k, lut, center, fill), table, bsz, heads)
    return dq, dk, dv, dterm.sum_to_size(table.shape) if mode in (1, 2, 4) else dterm


def _pair_grad_to_table(dpair: torch.Tensor, table: torch.Tensor, bucket: torch.Tensor) -> torch.Tensor:
    """The table's gradient (float32, ``table``'s shape) from the pairs' ``dpair`` ``(B|1, H, L, L)`` and buckets
    ``(B|1, L, L)``: each pair's gradient onto its bucket's column (a table per row: in that row)."""
    tb, heads, tl_, columns = table.shape
    pb, _, tokens, _ = dpair.shape
    bucket = bucket.expand(pb, tokens, tokens)
    if tl_ == 1:  # a table shared by the rows: one index_add over every pair of each head
        ids = bucket + (torch.arange(pb, device=bucket.device)[:, None, None] * columns if tb > 1 else 0)
        out = dpair.new_zeros(heads, tb * columns).index_add_(1, ids.reshape(-1), dpair.transpose(0, 1).reshape(heads, -1))
        return out.view(heads, tb, 1, columns).transpose(0, 1)
    out = dpair.new_zeros(max(tb, pb), heads, tokens, columns)
    return out.scatter_add_(-1, bucket[:, None].expand_as(dpair), dpair).sum_to_size(table.shape)


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, torch.Tensor]) -> None:
    q, k, v, table, codes_q, codes_k, lut, center, fill, scale = inputs
    ctx.center, ctx.fill, ctx.scale, ctx.has_lut = center, fill, scale, lut is not None
    ctx.table_shape, ctx.table_dtype = table.shape, table.dtype
    ctx.save_for_backward(q, k, v, output[0], output[1], table, codes_q, codes_k, *((lut,) if lut is not None else ()))


def _backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None):
    q, k, v, out, lse, table, codes_q, codes_k, *lut = ctx.saved_tensors
    term_grad = ctx.needs_input_grad[3]
    dq, dk, dv, dterm = _term_attention_backward_op(dout, q, k, v, out, lse, table, codes_q, codes_k,
                                                    lut[0] if ctx.has_lut else None, ctx.center, ctx.fill, ctx.scale,
                                                    term_grad)
    dtable = dterm.to(ctx.table_dtype) if term_grad else None
    return dq, dk, dv, dtable, None, None, None, None, None, None


_term_attention_op.register_autograd(_backward, setup_context=_setup)


def term_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, codes_q: torch.Tensor,
                   codes_k: torch.Tensor, center: int, fill: int, lut: torch.Tensor | None = None,
                   scale: float | None = None) -> torch.Tensor:
    """``softmax(q k^T s + term) v`` for q, k, v ``(B, H, L, dh)`` (one head count, one length), the term being
    ``table[b, h, i, bucket(i, j)]``: ``table`` is per head ``(H, C)`` or ``(B|1, H, L|1, C)``; ``codes_q`` /
    ``codes_k`` ``(B|1, L)`` are the tokens' lattice codes (negative: a prefix token); ``bucket = lut[codes_q[i] -
    codes_k[j] + center]`` (``fill`` for a pair with a prefix token; without ``lut`` the offset id). Gradients reach q,
    k, v and the table. Computed in float32, output in q's dtype."""
    if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"term_attention takes q, k, v (B, H, L, dh) of one shape; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    bsz, heads, tokens, _ = q.shape
    if table.ndim == 2:
        table = table[None, :, None]  # (1, H, 1, C): shared by the batch and the rows
    if table.ndim != 4 or table.shape[1] != heads or table.shape[0] not in (1, bsz) or table.shape[2] not in (1, tokens):
        raise ValueError(f"term_attention's table must be (H, C) or (B|1, H, L|1, C) for B={bsz}, H={heads}, L={tokens}; "
                         f"got {tuple(table.shape)}")
    for name, c in (("codes_q", codes_q), ("codes_k", codes_k)):
        if c.ndim != 2 or c.shape[0] not in (1, bsz) or c.shape[1] != tokens:
            raise ValueError(f"term_attention's {name} must be (B|1, L) for B={bsz}, L={tokens}; got {tuple(c.shape)}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    # int32 codes and buckets: the kernels gather them per pair, half the bytes of int64
    out, _ = _term_attention_op(q, k, v, _rows(table), codes_q.int().contiguous(), codes_k.int().contiguous(),
                                None if lut is None else lut.int().contiguous(), int(center), int(fill), scale)
    return out
