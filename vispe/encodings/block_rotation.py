"""Per-token block rotations applied to q and k: the one blockwise application path of the rotary family's
non-pairwise members (LieRE's per-token rotations, ComRoPE's dense and per-sample rotations).

A token's rotation is block-diagonal with ``m`` blocks of ``b x b``; it is applied as one batched
``(b x b) @ (b x C)`` product per (head, token, block), q and k of the whole batch folded into the columns,
never as a dense ``head_dim x head_dim`` matrix.
"""
from __future__ import annotations

import math

import torch

from .attention import autocast_off_in_backward
from .native import small_bmm

__all__ = ["rotate_blocks"]


# ---------------------------------------------------------------------------------------------
# blockwise application
# ---------------------------------------------------------------------------------------------
# q and k are viewed as x[n2, B, H, L, m, b] (n2 = 2: q and k). The rotation's batch ("rows") is
# (B if per sample) (H unless shared by the heads) L m; every other dim of x becomes a matrix column, so
# one bmm (R, b, b) @ (R, b, C) rotates q and k of the whole batch.


def _layout(per_sample: bool, heads_shared: bool) -> tuple[list[int], list[int]]:
    rows = ([1] if per_sample else []) + ([] if heads_shared else [2]) + [3, 4]
    cols = [0] + ([] if per_sample else [1]) + ([2] if heads_shared else [])
    return rows, cols


#: ATen's CPU ``bmm`` multiplies matrices with ``rows * inner * cols < 400`` in a plain loop, several times slower per
#: product than its BLAS path (measured: ``(8 x 8) @ (8 x 4)`` takes twice the time of ``(8 x 8) @ (8 x 8)``)
_CPU_SMALL_BMM = 400


def _padded_width(b: int, cols: int, device: torch.device) -> int:
    """The column count to multiply ``cols`` columns with: padded (with zeros) past the CPU small-bmm loop where
    that at most doubles the work (``b = 6``: 8 -> 12 columns); 8 x 8 blocks with 4-7 columns (a batch of 2) are
    padded to 8, the width of the native small-product kernel (:func:`~vispe.encodings.native.small_bmm`)."""
    if device.type != "cpu":
        return cols
    if b == 8 and 4 <= cols < 8:
        return 8
    if b * b * cols >= _CPU_SMALL_BMM:
        return cols
    want = -(-_CPU_SMALL_BMM // (b * b))
    return want if want <= 2 * cols else cols


def _to_columns(q: torch.Tensor, k: torch.Tensor, b: int, dtype: torch.dtype, per_sample: bool, heads_shared: bool) -> torch.Tensor:
    """``q, k`` ``(B, H, L, m*b)`` -> ``(R, b, C')`` in ``dtype`` (one copy, with the cast); columns past the
    ``C`` of q and k (:func:`_padded_width`) are zero."""
    bsz, heads, length, dh = q.shape
    rows, cols = _layout(per_sample, heads_shared)
    perm = rows + [5] + cols  # dims of x[n2, B, H, L, m, b]
    sizes = (2, bsz, heads, length, dh // b, b)
    r = math.prod([sizes[d] for d in rows])  # a list: torch.compile cannot trace a generator here
    c = math.prod([sizes[d] for d in cols])
    width = _padded_width(b, c, q.device)
    # zero the padded buffer whole (one contiguous fill; the pad columns alone are a strided one)
    full = (torch.zeros if width > c else torch.empty)(r, b, width, dtype=dtype, device=q.device)
    out = full[..., :c].view([sizes[d] for d in perm])
    at = len(rows) + 1  # n2 is the first column dim
    sub = [d - 1 for d in perm if d != 0]  # dims of one of q, k viewed as (B, H, L, m, b)
    out.select(at, 0).copy_(q.reshape(bsz, heads, length, dh // b, b).permute(sub))
    out.select(at, 1).copy_(k.reshape(bsz, heads, length, dh // b, b).permute(sub))
    return full


def _from_columns(
    out: torch.Tensor, like: torch.Tensor, dtype: torch.dtype, per_sample: bool, heads_shared: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`_to_columns` (padding dropped): two ``(B, H, L, dh)`` tensors in ``dtype`` with unit channel stride.

    Memory order ``(B, L, 2, H, dh)``, the token-major order of timm's qkv projection, so SDPA's output comes
    back token-major too and the head merge stays a view.
    """
    bsz, heads, length, dh = like.shape
    b = out.shape[-2]
    rows, cols = _layout(per_sample, heads_shared)
    perm = rows + [5] + cols
    sizes = (2, bsz, heads, length, dh // b, b)
    out = out[..., : math.prod([sizes[d] for d in cols])]  # without the zero padding
    src = out.view([sizes[d] for d in perm]).permute([perm.index(d) for d in (1, 3, 0, 2, 4, 5)])
    res = torch.empty(bsz, length, 2, heads, dh // b, b, dtype=dtype, device=like.device)
    res.copy_(src)
    res = res.view(bsz, length, 2, heads, dh)
    return res[:, :, 0].transpose(1, 2), res[:, :, 1].transpose(1, 2)


class _BlockRotation(torch.autograd.Function):
    """``x' = R x`` per (row, block) for q and k in one ``bmm``; saves only ``rot`` and the unrotated q, k
    (views of the qkv projection that attention keeps alive anyway), not a float32 copy of them."""

    @staticmethod
    def forward(ctx, rot: torch.Tensor, q: torch.Tensor, k: torch.Tensor, per_sample: bool, heads_shared: bool):  # type: ignore[override]
        b = rot.shape[-1]
        dt = torch.promote_types(torch.promote_types(q.dtype, rot.dtype), torch.float32)
        cols = _to_columns(q, k, b, dt, per_sample, heads_shared)
        out = small_bmm(rot.to(dt), cols)
        ctx.save_for_backward(rot, q, k)
        ctx.layout = (per_sample, heads_shared)
        return _from_columns(out, q, q.dtype, per_sample, heads_shared)

    @staticmethod
    @autocast_off_in_backward
    def backward(ctx, grad_q: torch.Tensor, grad_k: torch.Tensor):  # type: ignore[override]
        rot, q, k = ctx.saved_tensors
        per_sample, heads_shared = ctx.layout
        b = rot.shape[-1]
        dt = torch.promote_types(torch.promote_types(q.dtype, rot.dtype), torch.float32)
        grad_q = torch.zeros_like(q) if grad_q is None else grad_q
        grad_k = torch.zeros_like(k) if grad_k is None else grad_k
        g = _to_columns(grad_q, grad_k, b, dt, per_sample, heads_shared)
        rot_f = rot.to(dt)
        g_rot = g_q = g_k = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            g_q, g_k = _from_columns(small_bmm(rot_f.transpose(1, 2), g), q, q.dtype, per_sample, heads_shared)
        if ctx.needs_input_grad[0]:
            cols = _to_columns(q, k, b, dt, per_sample, heads_shared)
            g_rot = small_bmm(g, cols.transpose(1, 2)).to(rot.dtype)
        return g_rot, g_q, g_k, None, None


def rotate_blocks(q: torch.Tensor, k: torch.Tensor, rot: torch.Tensor, per_sample: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q, k`` ``(B, H, L, m*b)`` blockwise: channels ``[j b, (j+1) b)`` of token ``n`` by ``rot[..., n, j]``.

    ``rot``: ``(H or 1, L, m, b, b)`` shared by the batch, or with ``per_sample=True`` ``(B, H or 1, L, m, b, b)``
    (e.g. each sample's tokens after patch dropout). Maths in float32 (float64 for float64 inputs) with
    autocast off; outputs in q's dtype, unit channel stride.
    """
    bsz, heads, length, dh = q.shape
    lead = rot.shape[:-4]
    want = (bsz,) if per_sample else ()
    if k.shape != q.shape or len(lead) != len(want) + 1 or tuple(lead[:-1]) != want or lead[-1] not in (1, heads):
        raise ValueError(
            f"rotations of shape {tuple(rot.shape)} do not fit q/k {tuple(q.shape)} / {tuple(k.shape)} "
            f"(expected {'(B, ' if per_sample else '('}H or 1, L, m, b, b))"
        )
    m, b = rot.shape[-3], rot.shape[-1]
    if rot.shape[-4] != length or m * b != dh:
        raise ValueError(f"rotations cover {rot.shape[-4]} tokens x {m} blocks of {b} but q/k have {length} tokens x {dh} channels")
    heads_shared = lead[-1] == 1 and heads > 1  # one rotation for all heads: the heads become columns too
    flat = rot.reshape(-1, b, b)
    with torch.autocast(device_type=q.device.type, enabled=False):
        return _BlockRotation.apply(flat, q, k, per_sample, heads_shared)
