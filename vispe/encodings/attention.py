"""Attention kernels shared by the encodings: SDPA with additive biases and causal masks, an attention whose
additive logit term is rebuilt in backward instead of kept, and recompute-instead-of-save for rotated q/k.

Attention biases are described by index (:class:`IndexedBias`: ``bias[b, h, i, j]`` from index tensors and small
tables) and run on one of :data:`ATTENTION_BACKENDS` by :func:`attend_indexed_bias`: the dense ``attn_mask`` (the
oracle), query blocks with the term rebuilt per block in forward and backward (memory O(L * block)), or
FlexAttention with the term as ``score_mod`` (CUDA; CPU inference only). Under ``torch.compile`` a CPU training step
on the blocked path (float32/64, no caller mask, not causal, no dropout) calls the eager path's fused blocks and
recompute backward as the custom ops ``vispe::indexed_bias_attention`` / ``vispe::indexed_bias_attention_backward``,
opaque to inductor, for terms built from functions registered with :func:`bias_function`; every other compiled path
is plain traceable ops (the blocked one as activation-checkpointed blocks). In float32 on a CPU, a term with a
``gather`` rule runs that forward and backward in native tiles (:mod:`vispe.encodings.native`), eager and compiled.

Nothing here knows about positions; the contracts in :mod:`vispe.encodings.base` call these.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

__all__ = [
    "sdpa",
    "split_qkv",
    "merge_attn_mask",
    "fold_causal_mask",
    "autocast_off_in_backward",
    "sdpa_with_bias",
    "save_as_recomputed",
    "ATTENTION_BACKENDS",
    "IndexedBias",
    "OffsetIds",
    "attend_indexed_bias",
    "bias_function",
    "resolve_attention_backend",
]


def split_qkv(qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v ``(B, H, L, dh)`` as views of a fused projection's output ``(B, L, 3, H, dh)`` (timm's split)."""
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    return q, k, v


def sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """SDPA that also accepts an additive bias together with ``is_causal``, and q/k wider than v (PoPE's 2d-wide
    magnitude-and-phase q/k): v gets zero channels up to their width, because PyTorch's fused kernels (flash, on CPU
    and CUDA) take equal widths only and SDPA's fallback keeps the ``(L, L)`` probabilities for backward; the output's
    extra channels are zeros and are dropped."""
    if attn_mask is not None and is_causal:
        attn_mask, is_causal = fold_causal_mask(q, k, attn_mask), False
    if attn_mask is not None and attn_mask.dtype != torch.bool and attn_mask.dtype != q.dtype:
        attn_mask = attn_mask.to(q.dtype)
    width = v.shape[-1]
    if q.shape[-1] > width and q.shape[-1] == k.shape[-1]:
        out = F.scaled_dot_product_attention(q, k, F.pad(v, (0, q.shape[-1] - width)), attn_mask=attn_mask,
                                             dropout_p=dropout_p, is_causal=is_causal, scale=scale)
        return out[..., :width]
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


def _masked_softmax_(p: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis of the logits ``p``, in place, after a boolean (keep) or additive ``mask``; fully
    masked rows become zeros, as SDPA returns there. The backward passes recompute attention probabilities with it."""
    if mask is not None:
        if mask.dtype == torch.bool:
            p.masked_fill_(~mask, float("-inf"))
        else:
            p.add_(mask)
    p.sub_(p.amax(-1, keepdim=True)).exp_()
    p.div_(p.sum(-1, keepdim=True))
    if mask is not None:
        p.nan_to_num_(0.0)
    return p


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
        _masked_softmax_(p, attn_mask)
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


# ---------------------------------------------------------------------------------------------
# Additive terms given by index: attention without a (B, H, L, L) tensor
# ---------------------------------------------------------------------------------------------
#: How :func:`attend_indexed_bias` evaluates an :class:`IndexedBias`: ``'auto'`` picks per call (below);
#: ``'dense'`` materialises the term and hands it to SDPA as ``attn_mask`` (the oracle); ``'blocked'`` runs
#: queries in blocks, builds the term per block and rebuilds it in backward (memory O(L * block));
#: ``'flex'`` is PyTorch's FlexAttention with the term as its ``score_mod`` (CUDA; CPU inference only); ``'triton'``
#: runs a lattice term (one part of a ``gather`` rule, read at the query's row) in fused flash-attention kernels that
#: read it per tile (:mod:`vispe.encodings.triton_bias`; CUDA, or CPU in Triton's interpreter; opt-in).
ATTENTION_BACKENDS = ("auto", "dense", "blocked", "flex", "triton")
#: Elements of one block's ``(B, H, rows, L)`` term for ``'blocked'`` (and the size under which ``'auto'`` stays
#: dense): 2^19 floats = 2 MiB, so the few block-sized temporaries of the backward stay within a few percent of a
#: ViT-S training step's activations at 1,024 tokens (and near the CPU's cache).
BLOCK_ELEMENTS = 1 << 19
#: Elements of one block's term where a block runs on PyTorch's fused CPU flash-attention kernels (forward, and the
#: backward when no gradient reaches the term): 31 MiB of float32, one block for a 6-head term up to ~1,150 tokens.
#: Their cost per call is high (they set up ``dK`` / ``dV`` accumulators of the whole key length), so fewer, larger
#: blocks are faster; the block is transient (built, used, freed; never kept for backward), and a ViT-S training
#: step's peak at 1,024 tokens lies elsewhere. Kept under 32 MiB, glibc's ceiling for reusing freed heap memory: a
#: larger block is mapped afresh on every call and its pages faulted in (~0.4 ms per MiB on the benchmark's CPU,
#: +13 ms per block of iRPE's per-sample term at 1,024 tokens). The recompute backward, whose temporaries are
#: several ``(B, H, rows, Lk)`` tensors, keeps :data:`BLOCK_ELEMENTS`.
FUSED_BLOCK_ELEMENTS = 31 << 18
#: :data:`FUSED_BLOCK_ELEMENTS` inside a compiled training step (the custom ops): there the block's term is allocated on
#: top of the tensors inductor keeps for backward, at the step's peak, so blocks are half as large (16 MiB): ALiBi-2D's
#: compiled peak at 1,025 tokens falls from 1.11x to 1.07x timm's, at no time cost the CPU benchmark resolves.
COMPILED_FUSED_BLOCK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class IndexedBias:
    """An additive logit term described by index, never as a ``(B, H, Lq, Lk)`` tensor:
    ``bias[b, h, i, j] = fn(b, h, i, j, *prepare(*inputs))``.

    ``fn`` takes int64 index tensors that broadcast against each other -- ``(B|1, 1, 1, 1)``, ``(1, H, 1, 1)``,
    ``(1, 1, rows, 1)``, ``(1, 1, 1, Lk)`` for a block of query rows, or 0-d tensors inside FlexAttention's
    ``score_mod`` -- so one definition serves every path. ``inputs`` are what the term is made of (small tables,
    per-token position codes, or q itself for a content-dependent term); ``prepare`` turns them into the tensors
    ``fn`` reads (e.g. a ``(B, H, L, buckets)`` projection of q); the blocked path keeps only ``inputs`` and
    re-runs ``prepare`` in backward. ``per_sample``: ``fn`` reads ``b`` (per-sample tables, e.g. after patch
    dropout); otherwise it is called with ``b = 0`` and the term broadcasts over the batch.
    """

    fn: Callable[..., torch.Tensor]
    inputs: tuple[torch.Tensor, ...]
    prepare: Callable[..., Sequence[torch.Tensor]] | None = None
    per_sample: bool = False
    #: FlexAttention ``kernel_options`` for this term (e.g. smaller tiles for a ``score_mod`` that reads several
    #: tables: the default tiles can need more shared memory than the GPU has); merged over ``FLEX_KERNEL_OPTIONS``
    flex_kernel_options: dict[str, Any] | None = None
    #: optional ``accumulate_grad(ds, start, stop, tensors, grads)``: adds the gradient of the block term of query rows
    #: ``start:stop`` (``ds``: the logits' gradient ``(B, H, rows, Lk)``) in place to ``grads`` (zeros, one per
    #: ``prepare`` output; ``None`` where none is wanted), without autograd. The blocked backward calls it per block
    #: instead of differentiating ``fn``, whose gradient is a new full-size tensor per block (e.g. iRPE's
    #: ``(B, H, L, buckets)`` projection, zero-filled and summed once per block)
    accumulate_grad: Callable[..., None] | None = None
    #: optional ``gather(start, stop, length, tensors)``: the term of query rows ``start:stop`` against ``length``
    #: keys as parts the native kernels read (:mod:`vispe.encodings.native`): a list of ``(n, ids, key_rows)``, each
    #: adding ``tensors[n]`` -- a per-head table ``(H, C)`` or per-token vectors ``(B, H, L, C)`` read at the query's
    #: row (the key's for ``key_rows``) -- at column ``ids``: an int ``(B|1, rows, length)`` tensor, or the lattice
    #: offsets of :class:`OffsetIds`. The parts must sum to ``fn``; float32 CPU training then runs natively
    gather: Callable[..., list[tuple[int, Any, bool]]] | None = None

    def tensors(self, inputs: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
        inputs = self.inputs if inputs is None else inputs
        return tuple(inputs) if self.prepare is None else tuple(self.prepare(*inputs))

    def rows(self, tensors: Sequence[torch.Tensor], batch: int, heads: int, start: int, stop: int, length: int,
             device: torch.device) -> torch.Tensor:
        """The term of query rows ``start:stop`` against all ``length`` keys, ``(B|1, H|1, stop - start, length)``."""
        b = torch.arange(batch if self.per_sample else 1, device=device).view(-1, 1, 1, 1)
        h = torch.arange(heads, device=device).view(1, -1, 1, 1)
        i = torch.arange(start, stop, device=device).view(1, 1, -1, 1)
        j = torch.arange(length, device=device).view(1, 1, 1, -1)
        return self.fn(b, h, i, j, *tensors)

    def dense(self, batch: int, heads: int, lq: int, lk: int, device: torch.device) -> torch.Tensor:
        """The whole term (the oracle path): ``(B|1, H|1, Lq, Lk)``."""
        return self.rows(self.tensors(), batch, heads, 0, lq, lk, device)


def _mask_rows(attn_mask: torch.Tensor | None, is_causal: bool, lq: int, lk: int, start: int, stop: int,
               device: torch.device) -> torch.Tensor | None:
    """The caller's mask (bool: True = attend, or additive float, broadcastable to ``(B, H, Lq, Lk)``) for query rows
    ``start:stop``, with the causal mask (bottom-right aligned, as :func:`fold_causal_mask`) folded in."""
    if attn_mask is not None and attn_mask.dim() >= 2 and attn_mask.shape[-2] == lq and lq > 1:
        attn_mask = attn_mask[..., start:stop, :]
    if not is_causal:
        return attn_mask
    i = torch.arange(start, stop, device=device)[:, None]
    causal = torch.arange(lk, device=device)[None, :] <= i + (lk - lq)
    if attn_mask is None:
        return causal
    if attn_mask.dtype == torch.bool:
        return attn_mask & causal
    return attn_mask.masked_fill(~causal, float("-inf"))


def _row_blocks(q: torch.Tensor, k: torch.Tensor, per_sample: bool, block_rows: int | None,
                elements: int = BLOCK_ELEMENTS) -> int:
    if block_rows is not None:
        return max(1, int(block_rows))
    per_row = (q.shape[0] if per_sample else 1) * q.shape[1] * k.shape[-2]
    return max(16, elements // max(per_row, 1))


def _cpu_flash_blocks(q: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool) -> bool:
    """Whether the blocked path can run on PyTorch's fused CPU flash-attention kernels directly (forward with the
    block's log-sum-exp, and the fused backward): CPU, float32/float64, no caller mask and not causal (the ViT case;
    the rest keeps the generic recompute, which handles fully masked rows)."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64) and attn_mask is None and not is_causal


#: query rows of one (sample, head) per tile of the native backward: its logits and their gradient stay in cache
NATIVE_TILE_ROWS = 64
#: the most index entries (int32) one block of the native backward builds per term part (4 MiB)
NATIVE_INDEX_ELEMENTS = 1 << 20
#: fewest keys for which the native kernels replace PyTorch's fused flash kernels (forward, and the backward of a term
#: without a gradient): one layer on this project's CPU (ViT-S/16 heads, batch 2, one thread) measured native
#: everywhere 4-15 % faster per forward + backward at 442 and 577 keys (ALiBi, FIRE, iRPE), mixed at 325 (FIRE 5 %
#: slower, ALiBi 7 % faster) and its forward 5-10 % slower at 197, where per-tile calls weigh most. A term's gradient
#: always takes them: its alternative, a recompute in PyTorch ops, made the layer 12-37 % slower from 197 to 1,025 keys
NATIVE_MIN_KEYS = 384


def _native_kernels(spec: IndexedBias, q: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool) -> Any:
    """The native term kernels (:mod:`vispe.encodings.native`) when this block path can take them: a term with a
    ``gather`` rule, float32 CPU tensors, no caller mask, not causal; else ``None`` (PyTorch ops)."""
    if spec.gather is None or q.device.type != "cpu" or q.dtype != torch.float32 or attn_mask is not None or is_causal:
        return None
    from .native import indexed_term_kernels

    return indexed_term_kernels()


@dataclass(frozen=True)
class OffsetIds:
    """Pair ids of a lattice term for the native kernels: ``codes_q[b, r] - codes_k[b, j] + center``, or ``fill`` when
    either code is negative (a prefix token), then ``lut[id]`` if a lookup table is given (e.g. iRPE's bucket of each
    offset). Keys with consecutive codes have consecutive offset ids, which the kernels use (no index array).
    ``codes_q``: int ``(B|1, rows)`` of the block's queries; ``codes_k``: ``(B|1, L)``; ``lut``: int ``(fill + 1,)``.
    ``span``: the offsets along the lattice's last axis (``2 s - 1``) when the offset ids are row-major in them: the
    kernels then read each distinct row of ``lut`` once per query row (0: not known)."""

    codes_q: torch.Tensor
    codes_k: torch.Tensor
    center: int
    fill: int
    lut: torch.Tensor | None = None
    span: int = 0


def _part_strides(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(batch, head, row) strides of a part's table -- ``(H, C)`` or ``(B, H, L, C)`` -- or ``None`` if the kernels cannot
    read it (not float32, or a strided last axis)."""
    if t.dtype != torch.float32 or t.stride(-1) != 1 or t.dim() not in (2, 4):
        return None
    if t.dim() == 2:
        return 0, t.stride(0), 0
    return (t.stride(0) if t.shape[0] > 1 else 0), t.stride(1), t.stride(2)


def _native_parts(spec: IndexedBias, tensors: Sequence[torch.Tensor], start: int, stop: int, length: int,
                  grads: Sequence[torch.Tensor | None] | None = None) -> tuple | None:
    """The block's parts as the kernels take them -- tables, gradients, ids, query codes, key codes, lookup tables, 10
    ints per part -- or ``None`` if one cannot be read natively."""
    none = torch.empty(0, dtype=torch.int32)
    xs, gs, idxs, cqs, cks, luts, ints = [], [], [], [], [], [], []
    for n, index, key_rows in spec.gather(start, stop, length, tensors):
        x, g = tensors[n], None if grads is None else grads[n]
        xst, gst = _part_strides(x), (0, 0, 0) if g is None else _part_strides(g)
        if xst is None or gst is None:
            return None
        if isinstance(index, OffsetIds):
            if key_rows:
                return None
            idxs.append(none)
            cqs.append(index.codes_q.to(torch.int32).contiguous())
            cks.append(index.codes_k.to(torch.int32).contiguous())
            luts.append(none if index.lut is None else index.lut.to(torch.int32).contiguous())
            center, fill, span = index.center, index.fill, index.span
        else:
            idxs.append(index.to(torch.int32).contiguous())
            cqs.append(none)
            cks.append(none)
            luts.append(none)
            center, fill, span = 0, 0, 0
        xs.append(x)
        gs.append(x.new_empty(0) if g is None else g)
        ints += [*xst, *gst, int(bool(key_rows)), int(center), int(fill), int(span)]
    return xs, gs, idxs, cqs, cks, luts, ints


def _term_block(spec: IndexedBias, kernels: Any, tensors: Sequence[torch.Tensor], bsz: int, heads: int, start: int, stop: int,
                length: int, device: torch.device) -> torch.Tensor:
    """The term of query rows ``start:stop``: natively when ``kernels`` are given and can read it, else by ``fn``."""
    parts = _native_parts(spec, tensors, start, stop, length) if kernels is not None else None
    if parts is None:
        return spec.rows(tensors, bsz, heads, start, stop, length, device)
    xs, _, *index = parts
    out = torch.empty(bsz if spec.per_sample else 1, heads, stop - start, length, device=device)
    kernels.gather_term(out, xs, *index, start)
    return out


def _native_rows(spec: IndexedBias, bsz: int, length: int) -> int:
    """Query rows per block of the native paths: the block's ids fit :data:`NATIVE_INDEX_ELEMENTS`, whole tiles."""
    per_row = length * (bsz if spec.per_sample else 1)
    return max(NATIVE_TILE_ROWS, NATIVE_INDEX_ELEMENTS // per_row // NATIVE_TILE_ROWS * NATIVE_TILE_ROWS)


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``(B, H, rows, D)`` as the native kernels read it, in place where its rows are contiguous (a view of the
    qkv projection), else a contiguous copy (e.g. an expanded gradient)."""
    if t.stride(-1) == 1 and (t.shape[-2] == 1 or t.stride(-2) >= t.shape[-1]):
        return t
    return t.contiguous()


def _native_forward(spec, kernels, s, q, k, v, inputs) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The forward with the native kernels (float32 CPU, no caller mask): the output and each row's log-sum-exp,
    computed in tiles of :data:`NATIVE_TILE_ROWS` rows of one (sample, head) with the term added in cache; ``None``
    when a part cannot be read natively. q, k and v are read where they lie (views of the qkv projection); the output
    is laid out ``(B, L, H, Dv)`` in memory, so the attention layer's merge of the heads is a view."""
    bsz, heads, lq, _ = q.shape
    lk = k.shape[-2]
    with torch.no_grad():
        tensors = spec.tensors(inputs)
        out = q.new_empty(bsz, lq, heads, v.shape[-1]).transpose(1, 2)
        lse = q.new_empty(bsz, heads, lq)
        qkv = [_row_major(t) for t in (q, k, v)]
        rows = _native_rows(spec, bsz, lk)
        for start in range(0, lq, rows):
            stop = min(lq, start + rows)
            parts = _native_parts(spec, tensors, start, stop, lk)
            if parts is None:
                return None
            xs, _, *index = parts
            kernels.term_attention_forward(*qkv, xs, *index, out, lse, start, stop - start, NATIVE_TILE_ROWS, s)
    return out, lse


def _blocked_forward(spec: IndexedBias, scale: float, rows: tuple[int, int], attn_mask, is_causal: bool, q, k, v,
                     inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The blocked forward (no grad): the output and, on the fused CPU flash kernels (:func:`_cpu_flash_blocks`), each
    row's log-sum-exp (else ``None``). ``rows``: block rows of the generic and of the fused kernels."""
    bsz, heads, lq, _ = q.shape
    lk = k.shape[-2]
    fused = _cpu_flash_blocks(q, attn_mask, is_causal)
    kernels = _native_kernels(spec, q, attn_mask, is_causal)
    if kernels is not None and lk >= NATIVE_MIN_KEYS:
        native = _native_forward(spec, kernels, scale, q, k, v, inputs)
        if native is not None:
            return native
    step = rows[1] if fused else rows[0]
    outs, lses = [], []
    with torch.no_grad():
        tensors = spec.tensors(inputs)
        for start in range(0, lq, step):
            stop = min(lq, start + step)
            mask = merge_attn_mask(_mask_rows(attn_mask, is_causal, lq, lk, start, stop, q.device),
                                   _term_block(spec, kernels, tensors, bsz, heads, start, stop, lk, q.device), q.dtype)
            if fused:
                out_b, lse_b = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    q[:, :, start:stop], k, v, 0.0, False, attn_mask=mask, scale=scale)
                lses.append(lse_b)
            else:
                out_b = F.scaled_dot_product_attention(q[:, :, start:stop], k, v, attn_mask=mask, scale=scale)
            outs.append(out_b)
            del mask  # one block's term alive at a time
        out = torch.cat(outs, dim=-2) if len(outs) > 1 else outs[0]
        lse = (torch.cat(lses, dim=-1) if len(lses) > 1 else lses[0]) if fused else None
    return out, lse


def _blocked_backward(spec: IndexedBias, s: float, rows: tuple[int, int], attn_mask, is_causal: bool, q, k, v, out,
                      lse, dout, inputs: Sequence[torch.Tensor], want: Sequence[bool]):
    """The blocked backward: ``(dq, dk, dv, [gradient of each input or None])``; ``want`` says which inputs need one."""
    bsz, heads, lq, _ = q.shape
    lk = k.shape[-2]
    leaves = [t.detach().requires_grad_(w and t.is_floating_point()) for t, w in zip(inputs, want)]
    any_grad = any(t.requires_grad for t in leaves)
    with torch.enable_grad():
        derived = spec.tensors(leaves)
    # the term's own leaves: gradients per block land here, then go back through prepare once
    d_leaves = [t.detach().requires_grad_(t.requires_grad) for t in derived]
    kernels = _native_kernels(spec, q, attn_mask, is_causal)
    if lse is not None and kernels is not None and (any_grad or lk >= NATIVE_MIN_KEYS):
        native = _native_backward(spec, kernels, s, q, k, v, out, lse, dout, leaves, derived, d_leaves)
        if native is not None:
            return native
    if lse is not None and not any_grad:
        return (*_fused_blocks_backward(spec, kernels, s, rows[1], q, k, v, out, lse, dout.contiguous(), d_leaves),
                [None] * len(inputs))
    d_grads: list[torch.Tensor | None] = [None] * len(derived)
    direct = any_grad and spec.accumulate_grad is not None  # the term's gradient by its own rule, no autograd
    if direct:
        d_grads = [torch.zeros_like(t, memory_format=torch.contiguous_format) if t.requires_grad else None for t in derived]
    dt = torch.promote_types(q.dtype, torch.float32)  # bf16/fp16 inputs: recompute in float32
    # contiguous once: q, k, v are views of the qkv projection, and a per-block matmul against a strided k^T
    # would copy it in every block
    dh = q.shape[-1]
    qs = (q.to(dt) * s).contiguous()
    ks, kt = k.to(dt) * s, k.to(dt).transpose(-1, -2).contiguous()
    vt = v.to(dt).transpose(-1, -2).contiguous()
    dof = dout.to(dt).contiguous()
    delta = (dof * out.to(dt)).sum(-1, keepdim=True)  # rowsum(dO * O)
    if lse is not None:
        # one extra column folds the row constants into the matmuls: [q s, -lse] [k, 1]^T = q k^T s - lse and
        # [dO, -delta] [v, 1]^T = dP - delta, two passes over each block fewer
        qs = torch.cat([qs, -lse.to(dt).unsqueeze(-1)], -1)
        kt = torch.cat([kt, kt.new_ones(*kt.shape[:-2], 1, lk)], -2)
        dof = torch.cat([dof, -delta], -1)
        vt = torch.cat([vt, vt.new_ones(*vt.shape[:-2], 1, lk)], -2)
    dq = torch.empty(q.shape, dtype=dt, device=q.device)
    dk = torch.zeros(k.shape, dtype=dt, device=k.device)
    dv = torch.zeros(v.shape, dtype=dt, device=v.device)
    for start in range(0, lq, rows[0]):
        stop = min(lq, start + rows[0])
        with torch.set_grad_enabled(not direct):
            bias = spec.rows(d_leaves, bsz, heads, start, stop, lk, q.device)
        # no autograd for the arithmetic: inside the custom op of a compiled graph grad mode is on
        with torch.no_grad():
            q_b, do_b = qs[:, :, start:stop], dof[:, :, start:stop]
            if _own_block(bias, (bsz, heads, stop - start, lk), dt, d_leaves):
                p = bias  # a per-sample term's fresh block: the logits accumulate into it, one temporary fewer
                _add_matmul_(p, q_b, kt)
            else:
                p = torch.matmul(q_b, kt)
                p.add_(bias.detach())
            if lse is not None:  # P = exp(logits - lse): the forward's normaliser, no max/sum passes
                p.exp_()
            else:
                _masked_softmax_(p, _mask_rows(attn_mask, is_causal, lq, lk, start, stop, q.device))
            _add_matmul_(dv, p.transpose(-1, -2), do_b[..., :dh])
            dp = torch.matmul(do_b, vt)
            ds = p.mul_(dp if lse is not None else dp.sub_(delta[:, :, start:stop]))  # dS = P * (dP - delta)
            del dp
            dq[:, :, start:stop] = torch.matmul(ds, ks)
            _add_matmul_(dk, ds.transpose(-1, -2), q_b[..., :dh])  # q_b carries s
            if direct:
                spec.accumulate_grad(ds, start, stop, d_leaves, d_grads)
            elif any_grad and bias.requires_grad:
                _accumulate_term_grads(bias, ds, d_leaves, d_grads)
    grads = _term_input_grads(leaves, derived, d_grads, len(inputs))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), grads


class _BlockedBiasAttention(torch.autograd.Function):
    """``softmax(q k^T s + bias + mask) v`` one block of query rows at a time, the block's term built from the
    :class:`IndexedBias` in forward (SDPA's fused kernel, no grad) and again in backward: nothing of size
    ``Lq x Lk`` is kept, the largest temporary is one block's ``(B, H, rows, Lk)``. The backward is the
    flash-attention one (probabilities recomputed, ``dS = P * (dP - rowsum(dO * O))``); the term's gradient goes
    back to its inputs through ``fn`` and ``prepare``.

    On CPU without a caller's mask (:func:`_cpu_flash_blocks`) the forward keeps each row's log-sum-exp, so the
    backward recomputes ``P = exp(q k^T s + bias - lse)`` in three passes instead of a softmax's six; when no
    gradient reaches the term (ALiBi: no parameters) each block's backward is PyTorch's fused CPU flash-attention
    backward with the rebuilt block term as its mask. Compiled graphs run the same forward and backward as the
    custom ops ``vispe::indexed_bias_attention`` and ``vispe::indexed_bias_attention_backward``."""

    @staticmethod
    def forward(ctx, spec, scale, rows, attn_mask, is_causal, q, k, v, *inputs):  # type: ignore[override]
        out, lse = _blocked_forward(spec, scale, rows, attn_mask, is_causal, q, k, v, inputs)
        ctx.spec, ctx.scale, ctx.rows, ctx.is_causal = spec, scale, rows, is_causal
        ctx.save_for_backward(q, k, v, out, lse, attn_mask, *inputs)
        return out

    @staticmethod
    @autocast_off_in_backward
    @once_differentiable
    def backward(ctx, dout):  # type: ignore[override]
        q, k, v, out, lse, attn_mask, *inputs = ctx.saved_tensors
        dq, dk, dv, grads = _blocked_backward(ctx.spec, ctx.scale, ctx.rows, attn_mask, ctx.is_causal, q, k, v, out, lse,
                                              dout, inputs, ctx.needs_input_grad[8:])
        return (None, None, None, None, None, dq, dk, dv, *grads)


def _own_block(bias: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, leaves: Sequence[torch.Tensor]) -> bool:
    """Whether the backward may overwrite a block's term: a full ``(B, H, rows, Lk)`` contiguous block of the
    recompute dtype, outside autograd, sharing memory with none of the term's inputs (``fn`` built it afresh)."""
    if bias.requires_grad or tuple(bias.shape) != shape or bias.dtype != dtype or not bias.is_contiguous():
        return False
    ptr = bias.untyped_storage().data_ptr()
    return all(t.untyped_storage().data_ptr() != ptr for t in leaves)


def _add_matmul_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` in place for ``(B, H, m, k) @ (B, H, k, n)`` into a contiguous ``(B, H, m, n)``: one batched
    GEMM that accumulates into ``acc`` (no block-sized product, no extra pass to add it)."""
    acc.view(-1, *acc.shape[-2:]).baddbmm_(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))


def _fused_blocks_backward(spec, kernels, s, rows, q, k, v, out, lse, dout, d_leaves):
    """The blocked backward when no gradient reaches the term: per block, PyTorch's fused CPU flash-attention
    backward with the rebuilt block term as its mask (``dK``, ``dV`` summed over blocks)."""
    bsz, heads, lq, _ = q.shape
    lk = k.shape[-2]
    dq = q.new_empty(q.shape)
    dk = k.new_zeros(k.shape)
    dv = v.new_zeros(v.shape)
    for start in range(0, lq, rows):
        stop = min(lq, start + rows)
        mask = _term_block(spec, kernels, d_leaves, bsz, heads, start, stop, lk, q.device).to(q.dtype)
        dq_b, dk_b, dv_b = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout[:, :, start:stop], q[:, :, start:stop], k, v, out[:, :, start:stop], lse[:, :, start:stop],
            0.0, False, attn_mask=mask, scale=s)
        dq[:, :, start:stop] = dq_b
        dk += dk_b
        dv += dv_b
        del mask, dq_b, dk_b, dv_b  # one block's term alive at a time
    return dq, dk, dv


def _native_backward(spec, kernels, s, q, k, v, out, lse, dout, leaves, derived, d_leaves):
    """The recompute backward with the native kernels (float32 CPU, no caller mask): blocks of query rows whose ids fit
    :data:`NATIVE_INDEX_ELEMENTS`, each run by ``term_attention_backward`` in tiles of :data:`NATIVE_TILE_ROWS` rows of
    one (sample, head), the term gathered, exponentiated and its gradient added back while the tile is in cache.
    ``None`` when a part cannot be read natively (the caller then takes PyTorch ops)."""
    bsz, heads, lq, _ = q.shape
    lk = k.shape[-2]
    d_grads = [torch.zeros_like(t, memory_format=torch.contiguous_format) if t.requires_grad else None for t in derived]
    dq = torch.empty(q.shape, dtype=q.dtype)
    dk = torch.zeros(k.shape, dtype=k.dtype)
    dv = torch.zeros(v.shape, dtype=v.dtype)
    lse = lse.contiguous()
    q, k, v, out, dout = (_row_major(t) for t in (q, k, v, out, dout))
    rows = _native_rows(spec, bsz, lk)
    with torch.no_grad():
        for start in range(0, lq, rows):
            stop = min(lq, start + rows)
            parts = _native_parts(spec, d_leaves, start, stop, lk, d_grads)
            if parts is None:
                return None
            # q, k, v, out and dout read where they lie (no copies); dq written at the block's rows
            kernels.term_attention_backward(q, k, v, out, dout, lse, *parts, dq, dk, dv, start, stop - start,
                                            NATIVE_TILE_ROWS, s)
    return dq, dk, dv, _term_input_grads(leaves, derived, d_grads, len(leaves))


def _accumulate_term_grads(bias: torch.Tensor, ds: torch.Tensor, d_leaves: list[torch.Tensor],
                           d_grads: list[torch.Tensor | None]) -> None:
    """``dS`` of one block through the block's term to the term's leaves (a gather's backward is one index_add)."""
    need = [t for t in d_leaves if t.requires_grad]
    got = torch.autograd.grad(bias, need, ds.sum_to_size(bias.shape).to(bias.dtype), allow_unused=True)
    it = iter(got)
    for n, t in enumerate(d_leaves):
        if t.requires_grad:
            g = next(it)
            if g is not None:
                prev = d_grads[n]
                # in place where the first block's gradient owns its memory: a full-size sum per block, no new tensor
                d_grads[n] = g if prev is None else prev.add_(g) if prev.is_contiguous() else prev + g


def _term_input_grads(leaves: list[torch.Tensor], derived: Sequence[torch.Tensor], d_grads: list[torch.Tensor | None],
                      n_inputs: int) -> list[torch.Tensor | None]:
    """The term's leaf gradients back through ``prepare`` to the :class:`IndexedBias` inputs, once per backward."""
    grads: list[torch.Tensor | None] = [None] * n_inputs
    need = [n for n, t in enumerate(leaves) if t.requires_grad]
    if need:
        outs = [d for d, g in zip(derived, d_grads) if g is not None and d.requires_grad]
        gs = [g for d, g in zip(derived, d_grads) if g is not None and d.requires_grad]
        if outs:
            got = torch.autograd.grad(outs, [leaves[n] for n in need], gs, allow_unused=True)
            for n, g in zip(need, got):
                grads[n] = g
    return grads


def _blocked_traceable(q, k, v, spec: IndexedBias, attn_mask, dropout_p, is_causal, scale, rows) -> torch.Tensor:
    """The blocked path in plain ops for ``torch.compile`` and for dropout: each block under activation checkpointing
    (its term and probabilities rebuilt in backward), so the same O(L * block) memory without a hand-written backward."""
    from torch.utils.checkpoint import checkpoint

    bsz, heads, lq, _ = q.shape
    lk = k.shape[-2]
    tensors = spec.tensors()

    def block(qb, k_, v_, start, stop, *ts):
        mask = merge_attn_mask(_mask_rows(attn_mask, is_causal, lq, lk, start, stop, q.device),
                               spec.rows(ts, bsz, heads, start, stop, lk, q.device), q.dtype)
        return sdpa(qb, k_, v_, mask, dropout_p, False, scale)

    grad = torch.is_grad_enabled()
    outs = []
    for start in range(0, lq, rows):
        stop = min(lq, start + rows)
        args = (q[:, :, start:stop], k, v, start, stop, *tensors)
        outs.append(checkpoint(block, *args, use_reentrant=False) if grad else block(*args))
    return torch.cat(outs, dim=-2) if len(outs) > 1 else outs[0]


# ---------------------------------------------------------------------------------------------
# The blocked fused path as custom ops, so compiled graphs call it as one opaque kernel
# ---------------------------------------------------------------------------------------------
#: the functions an :class:`IndexedBias` may name to run as a custom op in compiled graphs, by name
_BIAS_FUNCTIONS: dict[str, Callable[..., Any]] = {}


def bias_function(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a module-level ``fn`` or ``prepare`` of an :class:`IndexedBias` under a stable ``name``.

    A compiled training graph runs a term built from registered functions (themselves or ``functools.partial`` of them
    with literal keywords: ints, floats, strings, tuples) as the custom op ``vispe::indexed_bias_attention``, which
    finds them again by name; a term with any other callable keeps the traceable blocked path."""

    def register(func: Callable[..., Any]) -> Callable[..., Any]:
        if _BIAS_FUNCTIONS.get(name, func) is not func:
            raise ValueError(f"bias function name {name!r} is already registered for {_BIAS_FUNCTIONS[name]!r}")
        _BIAS_FUNCTIONS[name] = func
        func._vispe_bias_function = name  # type: ignore[attr-defined]
        return func

    return register


def _is_literal(x: Any) -> bool:
    # SymInt / SymFloat (dynamic shapes) are no literals: such a term keeps the traceable path
    if isinstance(x, tuple):
        return all(_is_literal(y) for y in x)
    return x is None or isinstance(x, (bool, int, float, str))


def _callable_key(f: Callable[..., Any] | None) -> tuple | None:
    """``(name, keywords)`` of a registered function or of a keyword-only partial of one; ``None`` if it is neither."""
    if f is None:
        return ("", ())
    func, keywords = (f.func, f.keywords) if isinstance(f, functools.partial) and not f.args else (f, {})
    name = getattr(func, "_vispe_bias_function", None)
    if name is None:
        return None
    items = tuple(sorted(keywords.items()))
    return (name, items) if _is_literal(items) else None


def _op_key(spec: IndexedBias) -> str | None:
    """The term's callables and options as a string the custom op can take (and rebuild them from), stable across
    calls so a compiled graph is not recompiled per step; ``None`` when they cannot be named (lambdas, closures)."""
    fn, prepare = _callable_key(spec.fn), _callable_key(spec.prepare)
    if fn is None or prepare is None or not fn[0]:
        return None
    # an unnamed gradient rule is dropped: the op's backward then takes the term's gradient by autograd (same values)
    grad = _callable_key(spec.accumulate_grad) or ("", ())
    gather = _callable_key(spec.gather) or ("", ())  # likewise an unnamed gather: PyTorch ops
    return repr((fn, prepare, bool(spec.per_sample), grad, gather))


@functools.cache
def _callables_of(key: str) -> tuple[Callable[..., Any], Callable[..., Any] | None, bool, Callable[..., Any] | None,
                                     Callable[..., Any] | None]:
    import ast

    fn, prepare, per_sample, grad, gather = ast.literal_eval(key)

    def build(name: str, items: tuple) -> Callable[..., Any] | None:
        if not name:
            return None
        return functools.partial(_BIAS_FUNCTIONS[name], **dict(items)) if items else _BIAS_FUNCTIONS[name]

    return build(*fn), build(*prepare), per_sample, build(*grad), build(*gather)


def _spec_of(key: str, inputs: Sequence[torch.Tensor]) -> IndexedBias:
    fn, prepare, per_sample, grad, gather = _callables_of(key)
    return IndexedBias(fn, tuple(inputs), prepare, per_sample=per_sample, accumulate_grad=grad, gather=gather)


@torch.library.custom_op("vispe::indexed_bias_attention", mutates_args=())
def _indexed_bias_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: list[torch.Tensor], key: str,
                               scale: float, rows: int, fused_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocked forward on the fused CPU flash kernels: the output and each row's log-sum-exp."""
    out, lse = _blocked_forward(_spec_of(key, inputs), scale, (rows, fused_rows), None, False, q, k, v, inputs)
    return out.contiguous(), lse.contiguous()


@_indexed_bias_attention_op.register_fake
def _(q, k, v, inputs, key, scale, rows, fused_rows):
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[:-1])


@contextmanager
def _autograd_inside_op() -> Iterator[None]:
    """Autograd back on inside a custom op's kernel: the dispatcher runs kernels below autograd (and compiled graphs
    below ADInplaceOrView too), but the term's gradient is ``dS`` pushed through ``fn`` and ``prepare`` by autograd."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther,
                torch._C.DispatchKey.AutogradNestedTensor, torch._C.DispatchKey.ADInplaceOrView):
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield


@torch.library.custom_op("vispe::indexed_bias_attention_backward", mutates_args=())
def _indexed_bias_attention_backward_op(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    inputs: list[torch.Tensor], want: list[bool], key: str, scale: float, rows: int, fused_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The blocked recompute backward: ``dq, dk, dv`` and the gradients of the inputs ``want`` names (zeros where the
    term does not reach one)."""
    with _autograd_inside_op():
        dq, dk, dv, grads = _blocked_backward(_spec_of(key, inputs), scale, (rows, fused_rows), None, False, q, k, v, out,
                                              lse, dout, inputs, want)
    # contiguous, as the fake kernel says: inside a compiled graph q, k, v (and so a gradient shaped like them) can be
    # laid out differently at trace time and at run time
    return (dq.contiguous(), dk.contiguous(), dv.contiguous(),
            [t.new_zeros(t.shape) if g is None else g.contiguous() for t, g, w in zip(inputs, grads, want) if w])


@_indexed_bias_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, inputs, want, key, scale, rows, fused_rows):
    grads = [t.new_empty(t.shape) for t, w in zip(inputs, want) if w]
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), grads


def _indexed_bias_attention_setup(ctx, inputs, output):
    q, k, v, ins, key, scale, rows, fused_rows = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, *ins)
    ctx.want = [t.requires_grad and t.is_floating_point() for t in ins]
    ctx.options = (key, scale, rows, fused_rows)


def _indexed_bias_attention_grad(ctx, dout, dlse):
    q, k, v, out, lse, *ins = ctx.saved_tensors
    dq, dk, dv, got = torch.ops.vispe.indexed_bias_attention_backward(dout, q, k, v, out, lse, ins, ctx.want, *ctx.options)
    it = iter(got)
    return dq, dk, dv, [next(it) if w else None for w in ctx.want], None, None, None, None


_indexed_bias_attention_op.register_autograd(_indexed_bias_attention_grad, setup_context=_indexed_bias_attention_setup)


_COMPILED_FLEX: Any = None
#: the largest ``(B, H, Lq, Lk)`` term the compiled CUDA path materialises for SDPA (2^28 elements: 512 MiB in bf16)
DENSE_TERM_ELEMENTS = 1 << 28
#: ``kernel_options`` handed to FlexAttention (tile sizes, pipeline stages): a score_mod that reads several tables
#: can need more shared memory per tile than the default tiles leave
FLEX_KERNEL_OPTIONS: dict[str, Any] = {}


def _triton_term_attention(q, k, v, spec: IndexedBias, attn_mask, is_causal, scale) -> torch.Tensor:
    """``attention_backend='triton'``: the term's one ``gather`` part -- a per-head table ``(H, C)`` or per-row vectors
    ``(B|1, H, L, C)`` read at the query's row, at :class:`OffsetIds` -- in the fused kernels. Anything else is refused
    here, before a kernel runs, with the reason."""
    from .triton_bias import term_attention

    other = [b for b in ATTENTION_BACKENDS if b != "triton"]

    def refuse(why: str) -> ValueError:
        return ValueError(f"attention_backend='triton' {why}; choose one of {other}")

    if attn_mask is not None or is_causal:
        raise refuse("takes no attention mask and no causal masking")
    if q.shape != k.shape or v.shape != q.shape:
        raise refuse(f"needs q, k and v of one shape (one head count, length and width); got {tuple(q.shape)}, "
                     f"{tuple(k.shape)} and {tuple(v.shape)}")
    if spec.gather is None:
        raise refuse("runs terms stated by a gather rule (lattice biases, iRPE); this term has none")
    tensors = spec.tensors()
    parts = spec.gather(0, q.shape[-2], k.shape[-2], tensors)
    if len(parts) != 1 or not isinstance(parts[0][1], OffsetIds) or parts[0][2]:
        raise refuse("runs a term of one lattice part read at the query's row (e.g. iRPE with sides='k' and one table); "
                     f"this term has {len(parts)} part(s)" + (" read at the key's row" if any(p[2] for p in parts) else ""))
    n, ids, _ = parts[0]
    return term_attention(q, k, v, tensors[n], ids.codes_q, ids.codes_k, ids.center, ids.fill, ids.lut, scale)


def _flex_attention(q, k, v, spec: IndexedBias, attn_mask, is_causal, scale) -> torch.Tensor:
    """FlexAttention with the term as ``score_mod`` (compiled; inside a compiled model the model's compile covers it)."""
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    tensors = spec.tensors()
    lq, lk = q.shape[-2], k.shape[-2]
    mask = attn_mask
    if mask is not None:
        mask = mask.expand(*q.shape[:2], lq, lk) if mask.dim() == 4 else mask.expand(lq, lk)[None, None].expand(*q.shape[:2], lq, lk)
    per_sample = spec.per_sample

    def score_mod(score, b, h, i, j):
        out = score + spec.fn(b if per_sample else torch.zeros_like(b), h, i, j, *tensors).to(score.dtype)
        if mask is not None:
            m = mask[b, h, i, j]
            out = torch.where(m, out, float("-inf")) if m.dtype == torch.bool else out + m.to(out.dtype)
        if is_causal:
            out = torch.where(j <= i + (lk - lq), out, float("-inf"))
        return out

    options = {**FLEX_KERNEL_OPTIONS, **(spec.flex_kernel_options or {})} or None
    if torch.compiler.is_compiling():
        return flex_attention(q, k, v, score_mod=score_mod, scale=scale, kernel_options=options)
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention)
    return _COMPILED_FLEX(q, k, v, score_mod=score_mod, scale=scale, kernel_options=options)


def _compiled_cuda_path(q: torch.Tensor, k: torch.Tensor, dropout_p: float) -> str:
    """'auto' inside a compiled model on CUDA. Inductor fuses a dense term into SDPA well (ALiBi-2D, ViT-S/16 at
    224 px, compiled on an H100: 0.83x of timm's compiled APE ViT dense, 2.06x as FlexAttention), and FlexAttention's
    lowering inside a whole-model graph fails for some score_mods (iRPE, torch 2.11). Past ``DENSE_TERM_ELEMENTS``
    the ``(B, H, Lq, Lk)`` term costs more memory than it saves time: FlexAttention (blocked with dropout)."""
    if q.shape[0] * q.shape[1] * q.shape[-2] * k.shape[-2] <= DENSE_TERM_ELEMENTS:
        return "dense"
    return "flex" if dropout_p == 0.0 else "blocked"


def resolve_attention_backend(backend: str, q: torch.Tensor, k: torch.Tensor, spec: IndexedBias, dropout_p: float,
                              training: bool, block_rows: int | None = None) -> str:
    """The path :func:`attend_indexed_bias` takes. ``'auto'``: FlexAttention on CUDA (no dropout); an eager training
    step is blocked (the term is rebuilt in backward, never kept: one block at short lengths); otherwise (inference,
    compiled graphs, dropout) the dense mask while one ``(B, H, Lq, Lk)`` term is no larger than a block, else
    blocked. A forced ``'flex'`` that PyTorch cannot run here raises."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={backend!r} is not valid; choose one of {list(ATTENTION_BACKENDS)}")
    if backend == "flex":
        if q.device.type != "cuda" and training:
            raise ValueError(
                "attention_backend='flex' trains only on CUDA (PyTorch's FlexAttention has no CPU backward); "
                "use 'blocked' or 'auto' for CPU training"
            )
        if dropout_p > 0:
            raise ValueError("attention_backend='flex' has no attention dropout; use 'blocked' or 'auto' with attn_drop > 0")
        return "flex"
    if backend == "triton":
        from .triton_bias import triton_bias_unavailable

        why = None if torch.compiler.is_compiling() else triton_bias_unavailable(q.device)  # eager checks it first
        if why is not None:
            raise ValueError(f"attention_backend='triton': {why}; choose one of {[b for b in ATTENTION_BACKENDS if b != 'triton']}")
        if dropout_p > 0:
            raise ValueError("attention_backend='triton' has no attention dropout; use 'blocked' or 'auto' with attn_drop > 0")
        return "triton"
    if backend != "auto":
        return backend
    if q.device.type == "cuda" and torch.compiler.is_compiling():
        return _compiled_cuda_path(q, k, dropout_p)
    if q.device.type == "cuda" and dropout_p == 0.0:
        return "flex"
    if training and dropout_p == 0.0 and not torch.compiler.is_compiling():
        return "blocked"
    rows = _row_blocks(q, k, spec.per_sample, block_rows)
    return "dense" if q.shape[-2] <= rows else "blocked"


def _training_rows(q: torch.Tensor, k: torch.Tensor, spec: IndexedBias, block_rows: int | None,
                   fused_elements: int = FUSED_BLOCK_ELEMENTS) -> tuple[int, int]:
    """Query rows per block of the blocked training path: (recompute backward, fused forward / backward). A per-sample
    term's block doubles as the logits' buffer in the recompute backward (two ``(B, H, rows, Lk)`` temporaries
    instead of three), so the same memory holds 1.5x the rows: fewer, faster block matmuls."""
    recompute = BLOCK_ELEMENTS * 3 // 2 if spec.per_sample else BLOCK_ELEMENTS
    return (_row_blocks(q, k, spec.per_sample, block_rows, recompute),
            _row_blocks(q, k, spec.per_sample, block_rows, fused_elements))


def attend_indexed_bias(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: IndexedBias,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    backend: str = "auto",
    block_rows: int | None = None,
) -> torch.Tensor:
    """Attention with the additive term ``spec`` (an :class:`IndexedBias`) on the path ``backend``
    (:data:`ATTENTION_BACKENDS`); every path gives the same outputs and gradients as ``'dense'``."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *spec.inputs))
    path = resolve_attention_backend(backend, q, k, spec, dropout_p, training, block_rows)
    bsz, heads, lq, _ = q.shape
    lk = k.shape[-2]
    if path == "dense":
        return sdpa(q, k, v, merge_attn_mask(attn_mask, spec.dense(bsz, heads, lq, lk, q.device), q.dtype), dropout_p, is_causal, scale)
    if path == "flex":
        return _flex_attention(q, k, v, spec, attn_mask, is_causal, scale)
    if path == "triton":
        return _triton_term_attention(q, k, v, spec, attn_mask, is_causal, scale)
    if q.shape[:-2] != k.shape[:-2]:  # grouped keys: the dense path broadcasts them
        return sdpa(q, k, v, merge_attn_mask(attn_mask, spec.dense(bsz, heads, lq, lk, q.device), q.dtype), dropout_p, is_causal, scale)
    rows = _row_blocks(q, k, spec.per_sample, block_rows)
    if training and dropout_p == 0.0 and not torch.compiler.is_compiling():
        return _BlockedBiasAttention.apply(spec, scale, _training_rows(q, k, spec, block_rows), attn_mask, is_causal, q, k, v,
                                           *spec.inputs)
    if training and dropout_p == 0.0 and _cpu_flash_blocks(q, attn_mask, is_causal):
        # a compiled training step: the same fused forward and recompute backward, as one opaque op per layer
        key = _op_key(spec)
        if key is not None:
            return torch.ops.vispe.indexed_bias_attention(
                q, k, v, list(spec.inputs), key, scale, *_training_rows(q, k, spec, block_rows, COMPILED_FUSED_BLOCK_ELEMENTS))[0]
    return _blocked_traceable(q, k, v, spec, attn_mask, dropout_p, is_causal, scale, rows)
