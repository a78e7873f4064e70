"""Attention kernels shared by the encodings: SDPA with additive biases and causal masks, an attention whose
additive logit term is rebuilt in backward instead of kept, and recompute-instead-of-save for rotated q/k.

Nothing here knows about positions; the contracts in :mod:`vispe.encodings.base` call these.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

__all__ = ["sdpa", "merge_attn_mask", "fold_causal_mask", "autocast_off_in_backward", "sdpa_with_bias", "save_as_recomputed"]


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """SDPA that also accepts an additive bias together with ``is_causal``."""
    if attn_mask is not None and is_causal:
        attn_mask, is_causal = fold_causal_mask(q, k, attn_mask), False
    if attn_mask is not None and attn_mask.dtype != torch.bool and attn_mask.dtype != q.dtype:
        attn_mask = attn_mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)


def merge_attn_mask(attn_mask: torch.Tensor | None, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Combine a caller's mask (bool: True = attend, or float: additive) with an additive logit term."""
    if bias is None:
        return attn_mask
    bias = bias.to(dtype)
    if attn_mask is None:
        return bias
    if attn_mask.dtype == torch.bool:
        return bias.masked_fill(~attn_mask, float("-inf"))
    return attn_mask + bias


def fold_causal_mask(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
    """``attn_mask`` (bool: True = attend, or additive float, or ``None``) with the causal mask folded in
    (bottom-right aligned when there are fewer queries than keys: the queries are the last positions, as when
    decoding with a cache)."""
    lq, lk = q.shape[-2], k.shape[-2]
    causal = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    if attn_mask is None:
        return causal
    if attn_mask.dtype == torch.bool:
        return attn_mask & causal
    return attn_mask.masked_fill(~causal, float("-inf"))


def autocast_off_in_backward(backward: Callable[..., Any]) -> Callable[..., Any]:
    """Run a custom autograd ``backward`` with autocast off.

    A backward called inside an autocast block (``loss.backward()`` under ``torch.autocast``) would
    otherwise run its matmuls in bf16/fp16 and mix dtypes with the float32 tensors it saved.
    """

    @functools.wraps(backward)
    def wrapped(ctx: Any, *grads: Any) -> Any:
        device = next((g.device.type for g in grads if isinstance(g, torch.Tensor)), "cpu")
        with torch.autocast(device_type=device, enabled=False):
            return backward(ctx, *grads)

    return wrapped


class _RecomputedBiasAttention(torch.autograd.Function):
    """``softmax(q k^T s + bias_fn(*inputs) [+ mask]) v`` that keeps no ``(B, H, L, L)`` tensor for backward.

    Autograd through SDPA with a bias that needs a gradient falls back to the math kernel and keeps
    the bias, the logits and the probabilities of every layer until backward. Here the forward runs
    the fused kernel (no grad) and saves only ``q, k, v``, the output and the small bias inputs; the
    backward rebuilds the probabilities of this one layer (a flash-attention style recompute),
    forms ``dS`` and pushes it through ``bias_fn`` to the inputs.
    """

    @staticmethod
    def forward(ctx, bias_fn, scale, attn_mask, q, k, v, *inputs):  # type: ignore[override]
        with torch.no_grad():
            mask = merge_attn_mask(attn_mask, bias_fn(*inputs), q.dtype)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        ctx.bias_fn, ctx.scale = bias_fn, scale
        ctx.save_for_backward(q, k, v, out, attn_mask, *inputs)
        return out

    @staticmethod
    @autocast_off_in_backward
    @once_differentiable  # in-place recompute: a double backward raises instead of returning wrong values
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, attn_mask, *inputs = ctx.saved_tensors
        s = ctx.scale
        want = ctx.needs_input_grad[6:]
        dt = torch.promote_types(q.dtype, torch.float32)  # bf16/fp16 inputs: recompute in float32
        qf, kf, vf, dof = q.to(dt), k.to(dt), v.to(dt), dout.to(dt)
        # probabilities of this layer, in place in one (B, H, L, L) buffer
        p = torch.matmul(qf, kf.transpose(-1, -2)).mul_(s)
        with torch.no_grad():
            p.add_(ctx.bias_fn(*inputs))
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                p.masked_fill_(~attn_mask, float("-inf"))
            else:
                p.add_(attn_mask)
        p.sub_(p.amax(-1, keepdim=True)).exp_()
        p.div_(p.sum(-1, keepdim=True))
        if attn_mask is not None:
            p.nan_to_num_(0.0)  # fully masked rows: SDPA returns zeros there
        dv = torch.matmul(p.transpose(-1, -2), dof)
        dp = torch.matmul(dof, vf.transpose(-1, -2))
        ds = p.mul_(dp.sub_((dof * out.to(dt)).sum(-1, keepdim=True)))  # dS = P * (dP - rowsum(dO * O))
        del dp
        dq = torch.matmul(ds, kf).mul_(s)
        dk = torch.matmul(ds.transpose(-1, -2), qf).mul_(s)
        grads = [None] * len(inputs)
        needs = [i for i, w in enumerate(want) if w]
        if needs:
            with torch.enable_grad():  # dS through bias_fn (a gather's backward is a scatter-add)
                leaves = [t.detach().requires_grad_(w) for t, w in zip(inputs, want)]
                bias = ctx.bias_fn(*leaves)
            got = torch.autograd.grad(bias, [leaves[i] for i in needs], ds.sum_to_size(bias.shape).to(bias.dtype), allow_unused=True)
            for i, g in zip(needs, got):
                grads[i] = g
        return (None, None, None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *grads)


def sdpa_with_bias(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias_fn: Callable[..., torch.Tensor],
    bias_inputs: Sequence[torch.Tensor],
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """SDPA with the additive logit term ``bias_fn(*bias_inputs)`` (broadcastable to ``(B, H, L, L)``).

    Use it when the term is a cheap function (a gather, an index) of small tensors: while training,
    the ``(B, H, L, L)`` term is rebuilt in backward instead of being kept per layer, and the
    forward stays on SDPA's fused kernel. Gradients are the same as autograd's through
    ``sdpa(q, k, v, bias_fn(*bias_inputs))``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *bias_inputs))
    if not training or dropout_p > 0.0 or q.shape[:-2] != k.shape[:-2] or torch.compiler.is_compiling():
        return sdpa(q, k, v, merge_attn_mask(attn_mask, bias_fn(*bias_inputs), q.dtype), dropout_p, is_causal, scale)
    if is_causal:
        attn_mask = fold_causal_mask(q, k, attn_mask)
    return _RecomputedBiasAttention.apply(bias_fn, scale, attn_mask, q, k, v, *bias_inputs)


class _Rebuilt:
    """Stands in for saved tensors that ``rebuild()`` re-creates (once, on first use in backward)."""

    __slots__ = ("rebuild", "values")

    def __init__(self, rebuild: Callable[[], Sequence[torch.Tensor]]) -> None:
        self.rebuild = rebuild
        self.values: Sequence[torch.Tensor] | None = None

    def get(self, i: int) -> torch.Tensor:
        if self.values is None:
            # under the backward's grad mode: a plain backward rebuilds without a graph, one with
            # create_graph=True rebuilds with it, so higher-order gradients stay correct
            self.values = tuple(self.rebuild())
        return self.values[i]


def _tensor_key(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


@contextmanager
def save_as_recomputed(tensors: Sequence[torch.Tensor], rebuild: Callable[[], Sequence[torch.Tensor]]) -> Iterator[None]:
    """While active, autograd keeps ``tensors`` for backward as a recipe instead of as memory.

    ``rebuild()`` must return the same values as ``tensors`` (in order) from inputs that are kept
    alive anyway, deterministically. Rotary encodings use it around SDPA: the rotated q/k it
    saves cost ``2 x B x H x L x dh`` per layer, while the unrotated q/k are views of the qkv
    projection that ``v`` keeps alive -- so the backward re-rotates them (a cheap elementwise
    pass) instead. No-op under ``torch.compile`` (the compiler picks what to recompute itself).
    """
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        yield
        return
    holder = _Rebuilt(rebuild)
    # identify the tensors by address and layout, never by reference: autograd keeps the pack hook
    # alive as long as what it packed, and a reference here would keep the very memory we free
    keys = {_tensor_key(t): i for i, t in enumerate(tensors)}

    def pack(t: torch.Tensor) -> Any:
        i = keys.get(_tensor_key(t))
        return t if i is None else (holder, i)

    def unpack(x: Any) -> torch.Tensor:
        if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], _Rebuilt):
            return x[0].get(x[1])
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
