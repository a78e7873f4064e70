"""A fused rotary kernel (Triton) for the step from a fused qkv projection to attention's inputs.

Without it, a rotary layer runs three passes a compiled graph cannot merge: the rotation of q and k in the forward,
their rotation back in the backward, and the copy that stacks the q, k and v gradients into the projection's gradient
(autograd's ``unbind`` backward). On an H200 (compiled ViT-S/16, batch 128, bf16) the three cost each rotary
encoding 2.2 ms a step over timm's APE model's 16 ms, several times their bandwidth floor. Here one kernel reads the
projection's output ``(B, N, 3, H, dh)`` once and writes q and k rotated and v copied, in attention's layout; in the
backward one kernel reads the three gradients and writes the projection's gradient, q and k rotated back. Attention
keeps its three inputs as it keeps timm's (the projection's output is not kept besides), so memory is timm's.

The rotation is :func:`~vispe.encodings.rotary.apply_rotary`'s (float32 maths, both pair layouts); the table is the
real view ``(cos, sin)`` of a unit-modulus table (``rotary_table``), broadcast over batch and heads. Its gradient
(learned frequencies) is computed from the rotated outputs, which attention keeps anyway: with ``|table| = 1`` the
unrotated input is the output rotated back.

The operators are ``torch.ops.vispe.rotary_qkv`` and ``torch.ops.vispe.rotary_qkv_backward``, ``triton_op`` s that a
compiled model traces into (:mod:`~vispe.encodings.triton_support`). They run CUDA tensors in the compiled kernel,
and CPU tensors in Triton's interpreter when ``TRITON_INTERPRET=1`` was set before Triton's import (slow; for tests).
Encodings choose this path with ``rotary_backend='triton'`` (:class:`~vispe.encodings.rotary.RotaryEncoding`).
"""
from __future__ import annotations

from typing import Any

import torch

from .triton_support import interpreter_enabled, launch, triton_unavailable

__all__ = ["interpreter_enabled", "rotary_qkv", "triton_rotary_unavailable"]


def triton_rotary_unavailable(device: torch.device | str | None = None) -> str | None:
    """Why the fused kernel cannot run on ``device`` (``None``: it can); without a device, only whether Triton imports."""
    return triton_unavailable("the fused rotary kernel", device)


def _bhn_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, head, token) strides of a ``(B, H, N, ...)`` tensor; 0 along a broadcast (size-1) dimension."""
    return tuple(0 if t.shape[i] == 1 else t.stride(i) for i in range(3))  # type: ignore[return-value]


def _launch(ins: tuple[torch.Tensor, ...], outs: tuple[torch.Tensor, ...] | torch.Tensor, table: torch.Tensor, sign: int,
            interleaved: bool) -> None:
    """Run the kernel: ``ins`` are three ``(B, H, N, dh)`` views with contiguous channels; ``outs`` three such tensors,
    or one ``(B, N, 3, H, dh)`` tensor whose slots take q, k and v (the projection's gradient); ``table`` is
    ``(B|1, H|1, N, P, 2)`` with contiguous ``(P, 2)``."""
    bsz, heads, tokens, dh = ins[0].shape
    pairs = dh // 2
    why = triton_rotary_unavailable(ins[0].device)
    if why is not None:
        raise RuntimeError(why)
    from ._triton_rotary_kernel import rotate_qkv_kernel

    block_p = 1 << max(pairs - 1, 0).bit_length()
    block_n = max(1, min(64, 4096 // (2 * block_p)))
    grid = (bsz * heads, -(-tokens // block_n))
    stacked = isinstance(outs, torch.Tensor)
    if stacked:  # one written tensor: slot 0's view gives the strides, the slot stride the rest
        slot0 = outs[:, :, 0].transpose(1, 2)
        out_args = (outs, outs.new_empty(0), outs.new_empty(0))  # k_out, v_out: not written
        out_strides = [*_bhn_strides(slot0)] * 3 + [outs.stride(2)]
    else:
        out_args = outs
        out_strides = [s for t in outs for s in _bhn_strides(t)] + [0]
    strides = [s for t in ins for s in _bhn_strides(t)] + out_strides + [*_bhn_strides(table)]
    launch(rotate_qkv_kernel, grid, *ins, *out_args, table, *strides, heads, tokens, pairs,
           SIGN=sign, INTERLEAVED=interleaved, STACKED_OUT=stacked, BLOCK_N=block_n, BLOCK_P=block_p)


def _table5(table: torch.Tensor, tokens: int) -> torch.Tensor:
    """A real table ``(..., N, P, 2)`` with leading ``()``, ``(H,)`` or ``(B, H|1)`` as ``(B|1, H|1, N, P, 2)``, its
    ``(P, 2)`` block contiguous."""
    t = table
    while t.ndim < 5:
        t = t.unsqueeze(0)
    if t.shape[-3] != tokens:
        raise ValueError(f"rotary table has {t.shape[-3]} token rows, the sequence has {tokens} tokens")
    if t.stride(-1) != 1 or t.stride(-2) != 2:
        t = t.contiguous()
    return t


def _attention_layout(shape: tuple[int, ...], like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An empty ``(B, H, N, dh)`` tensor stored token-major (as q/k/v sliced from timm's fused projection are), so
    attention's output is token-major too and the head merge after it a view."""
    return torch.empty_permuted(shape, (0, 2, 1, 3), dtype=dtype, device=like.device)


@torch.library.triton_op("vispe::rotary_qkv", mutates_args=())
def _rotary_qkv_op(qkv: torch.Tensor, table: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    bsz, tokens, _, heads, dh = qkv.shape
    src = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    ins = tuple(src[:, :, i].transpose(1, 2) for i in range(3))
    outs = tuple(_attention_layout((bsz, heads, tokens, dh), qkv, qkv.dtype) for _ in range(3))
    _launch(ins, outs, _table5(table, tokens), 1, interleaved)
    return outs  # type: ignore[return-value]


@torch.library.triton_op("vispe::rotary_qkv_backward", mutates_args=())
def _rotary_qkv_backward_op(grad_q: torch.Tensor, grad_k: torch.Tensor, grad_v: torch.Tensor, table: torch.Tensor,
                            interleaved: bool) -> torch.Tensor:
    bsz, heads, tokens, dh = grad_q.shape
    grads = tuple(g if g.stride(-1) == 1 else g.contiguous() for g in (grad_q, grad_k, grad_v))
    out = torch.empty((bsz, tokens, 3, heads, dh), dtype=grad_q.dtype, device=grad_q.device)
    # written whole by one kernel: three views of it written separately would each be copied in a compiled graph
    _launch(grads, out, _table5(table, tokens), -1, interleaved)
    return out


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
    qkv, table, interleaved = inputs
    ctx.interleaved = interleaved
    ctx.qkv_dtype = qkv.dtype
    ctx.table_shape = table.shape
    # the rotated q and k (attention keeps them too) give the table's gradient; kept only when it needs one
    ctx.save_for_backward(table, *(output[:2] if ctx.needs_input_grad[1] else ()))


def _backward(ctx: Any, grad_q: torch.Tensor | None, grad_k: torch.Tensor | None, grad_v: torch.Tensor | None):
    table, *rotated = ctx.saved_tensors
    present = next(g for g in (grad_q, grad_k, grad_v) if g is not None)
    grads = [torch.zeros_like(present) if g is None else g for g in (grad_q, grad_k, grad_v)]
    grad_qkv = _rotary_qkv_backward_op(*grads, table, ctx.interleaved).to(ctx.qkv_dtype) if ctx.needs_input_grad[0] else None
    grad_table = None
    if ctx.needs_input_grad[1]:
        grad_table = sum(_table_grad(y, g, table, ctx.interleaved) for y, g in zip(rotated, grads[:2]))
        grad_table = grad_table.sum_to_size(ctx.table_shape)
    return grad_qkv, grad_table, None


def _pairs(x: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The two channels of every pair of ``(..., dh)`` as float32 ``(..., P)`` each."""
    x = x.float()
    if interleaved:
        x2 = x.unflatten(-1, (-1, 2))
        return x2[..., 0], x2[..., 1]
    a, b = x.chunk(2, dim=-1)
    return a, b


def _table_grad(rotated: torch.Tensor, grad: torch.Tensor, table: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """d loss / d (cos, sin) ``(B, H, N, P, 2)`` from one rotated output ``y = R x`` and its gradient ``g``: with
    ``x = R^T y`` (``|table| = 1``), ``d/dcos = g_a x_a + g_b x_b`` and ``d/dsin = g_b x_a - g_a x_b``. (This module
    does not import :mod:`vispe.encodings.rotary`, which imports it: the rotation back is written out.)"""
    ya, yb = _pairs(rotated, interleaved)
    ga, gb = _pairs(grad, interleaved)
    t = table.float()
    c, s = t[..., 0], t[..., 1]
    xa, xb = ya * c + yb * s, yb * c - ya * s
    return torch.stack([ga * xa + gb * xb, gb * xa - ga * xb], dim=-1)


_rotary_qkv_op.register_autograd(_backward, setup_context=_setup)


def rotary_qkv(qkv: torch.Tensor, table: torch.Tensor, layout: str = "interleaved") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k rotated and v, each ``(B, H, N, dh)`` (stored token-major), from a fused projection's output
    ``(B, N, 3, H, dh)``, in one kernel; the backward is one kernel too. ``table`` is the real view ``(..., N, P, 2)``
    of a unit-modulus rotary table (``view_as_real(rotary_table(angles))``), leading dimensions ``()``, ``(H,)`` or
    ``(B, 1|H)``. Equal to ``apply_rotary`` on q and k (float32 maths, outputs in ``qkv``'s dtype)."""
    if layout not in ("interleaved", "half"):
        raise ValueError(f"unknown rotary layout {layout!r}; choose one of ('interleaved', 'half')")
    if qkv.ndim != 5 or qkv.shape[2] != 3:
        raise ValueError(f"rotary_qkv takes a fused projection's output (B, N, 3, H, dh), got shape {tuple(qkv.shape)}")
    if table.shape[-1] != 2 or 2 * table.shape[-2] != qkv.shape[-1]:
        raise ValueError(f"rotary table {tuple(table.shape)} does not fit head dimension {qkv.shape[-1]} (needs (..., N, {qkv.shape[-1] // 2}, 2))")
    return _rotary_qkv_op(qkv, table.float(), layout == "interleaved")
