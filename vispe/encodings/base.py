"""The three encoding contracts and the registry.

Every positional encoding in vispe is a :class:`PositionalEncoding` module that a host model
(ViT, video ViT, ...) drives through four hooks, always with an explicit :class:`PositionGrid`:

* ``prepare(grid, device)`` -- position-only quantities for this forward (rotary tables,
  bias tables); computed once per forward for all layers and cached per (grid, device) where
  no gradient needs them.
* ``embed_tokens(x, grid, state, image)`` -- token encodings add to the token sequence
  (prefix tokens first, then the lattice in row-major order).
* ``after_block(index, x, grid, state)`` -- conditional encodings (PEG) act between blocks.
* ``attend(q, k, v, layer=..., state=...)`` -- attention-side encodings; the default is plain
  SDPA. :class:`AttentionBiasEncoding` adds a float ``attn_mask``; :class:`RotaryEncoding`
  rotates q and k through :func:`vispe.encodings.rotary.apply_rotary` and keeps SDPA.

Models never branch on an encoding's name: they call the hooks. Each class states its
``prefix_policy`` (what happens to cls/register tokens).
"""
from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from .grid import PositionGrid

__all__ = [
    "EncodingContext",
    "PositionalEncoding",
    "TokenEncoding",
    "AttentionBiasEncoding",
    "register_encoding",
    "create_encoding",
    "list_encodings",
    "get_encoding_class",
    "sdpa",
    "merge_attn_mask",
    "sdpa_with_bias",
    "save_as_recomputed",
    "autocast_off_in_backward",
    "fold_causal_mask",
]


@dataclass(frozen=True)
class EncodingContext:
    """What a host model tells an encoding about itself at construction.

    Only the fields an encoding's ``__init__`` names are passed to it, so an encoding declares
    what it needs simply by having the argument (``dim``, ``num_heads``, ``depth``, ...).
    """

    dim: int
    num_heads: int
    depth: int
    grid_size: tuple[int, ...]
    num_prefix_tokens: int = 1
    in_chans: int = 3
    patch_size: tuple[int, ...] = field(default=(16, 16))

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def ndim(self) -> int:
        return len(self.grid_size)

    def as_kwargs(self) -> dict[str, Any]:
        return dict(
            dim=self.dim,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            depth=self.depth,
            grid_size=tuple(self.grid_size),
            num_prefix_tokens=self.num_prefix_tokens,
            in_chans=self.in_chans,
            patch_size=tuple(self.patch_size),
        )


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
    if not training or dropout_p > 0.0 or q.shape[:-2] != k.shape[:-2]:
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


class PositionalEncoding(nn.Module):
    """Base class and the "no positional encoding" behaviour for every hook."""

    #: 'none' | 'token' | 'bias' | 'rotary' | 'conditional' -- informative, models never read it.
    kind: ClassVar[str] = "none"
    #: Grid dimensionalities this encoding accepts (e.g. (2,) for image-only, (2, 3) for both).
    grid_ndims: ClassVar[tuple[int, ...]] = (1, 2, 3)
    #: How prefix tokens (cls, registers) are treated; one sentence, shown in docs and repr.
    prefix_policy: ClassVar[str] = "prefix tokens are untouched"
    #: Whether the encoding still works when timm's PatchDropout removes tokens.
    supports_token_dropout: ClassVar[bool] = True

    registry_name: ClassVar[str] = ""

    def check_grid(self, grid: PositionGrid) -> None:
        if grid.ndim not in self.grid_ndims:
            raise ValueError(
                f"{type(self).__name__} ({self.registry_name!r}) takes {self.grid_ndims}-D grids, got a {grid.ndim}-D grid "
                f"{grid.shape}; pick a variant for this grid (see vispe.list_encodings())."
            )

    def prepare(self, grid: PositionGrid, device: torch.device | None = None) -> Any:
        """Position-only quantities for one forward (shared by all layers). Default: nothing."""
        return None

    def embed_tokens(
        self, x: torch.Tensor, grid: PositionGrid, state: Any = None, image: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Add a token encoding to ``x`` of shape ``(B, S + N, D)``. Default: identity."""
        return x

    def after_block(self, index: int, x: torch.Tensor, grid: PositionGrid, state: Any = None) -> torch.Tensor:
        """Act on the token sequence after block ``index``. Default: identity."""
        return x

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        layer: int = 0,
        state: Any = None,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Attention for ``q, k, v`` of shape ``(B, H, L, dh)``. Default: plain SDPA."""
        return sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale)

    def set_grid_size(self, grid_size: Sequence[int]) -> None:
        """Called by a host model's ``set_input_size``: adapt stored tables to a new training grid."""

    def no_weight_decay(self) -> set[str]:
        """Parameter names (relative to this module) that must not be weight-decayed."""
        return set()

    def load_timm_pos_embed(self, pos_embed: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """Map a timm checkpoint's ``pos_embed`` onto this encoding's parameters (``None``: not used)."""
        return None

    def load_timm_rope_freqs(self, freqs: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """Map a timm Eva checkpoint's learned ``rope.freqs`` onto this encoding's parameters (``None``: not used)."""
        return None

    def uses_attention(self) -> bool:
        """True if ``attend`` differs from plain SDPA (host models may skip work otherwise)."""
        return type(self).attend is not PositionalEncoding.attend


class TokenEncoding(PositionalEncoding):
    """An encoding added to the token sequence once, before the blocks."""

    kind = "token"


class AttentionBiasEncoding(PositionalEncoding):
    """An additive logit term passed to SDPA as a float ``attn_mask``.

    Subclasses implement :meth:`bias` returning a tensor broadcastable to ``(B, H, L, L)``.
    """

    kind = "bias"

    def bias(self, q: torch.Tensor, k: torch.Tensor, *, layer: int, state: Any) -> torch.Tensor | None:
        raise NotImplementedError

    def attend(self, q, k, v, *, layer=0, state=None, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        attn_mask = merge_attn_mask(attn_mask, self.bias(q, k, layer=layer, state=state), q.dtype)
        return sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale)


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------

_REGISTRY: dict[str, type[PositionalEncoding]] = {}
_CONTEXT_KEYS = set(EncodingContext(1, 1, 1, (1, 1)).as_kwargs())


def register_encoding(name: str) -> Callable[[type[PositionalEncoding]], type[PositionalEncoding]]:
    """Class decorator: ``@register_encoding('rope_axial')``. Names are unique."""

    def wrap(cls: type[PositionalEncoding]) -> type[PositionalEncoding]:
        if not (isinstance(cls, type) and issubclass(cls, PositionalEncoding)):
            raise TypeError(f"register_encoding({name!r}) expects a PositionalEncoding subclass, got {cls!r}")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"encoding name {name!r} is already registered to {_REGISTRY[name].__name__}")
        cls.registry_name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def list_encodings(kind: str | None = None, grid_ndim: int | None = None) -> list[str]:
    """Registered encoding names, optionally filtered by ``kind`` or by a grid dimensionality."""
    names = []
    for name, cls in sorted(_REGISTRY.items()):
        if kind is not None and cls.kind != kind:
            continue
        if grid_ndim is not None and grid_ndim not in cls.grid_ndims:
            continue
        names.append(name)
    return names


def get_encoding_class(name: str) -> type[PositionalEncoding]:
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown positional encoding {name!r}; choose one of {list_encodings()}")
    return _REGISTRY[name]


def _init_params(cls: type) -> tuple[set[str], bool]:
    sig = inspect.signature(cls.__init__)
    names = {p.name for p in list(sig.parameters.values())[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    var_kw = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
    return names, var_kw


def create_encoding(name: str, context: EncodingContext | None = None, **kwargs: Any) -> PositionalEncoding:
    """Build a registered encoding.

    Args:
        name: a name from :func:`list_encodings`.
        context: what the host model knows (width, heads, depth, grid); only the fields the
            encoding's constructor names are passed.
        **kwargs: the encoding's own options; unknown options raise a ``TypeError`` that lists
            the valid ones.
    """
    cls = get_encoding_class(name)
    accepted, var_kw = _init_params(cls)
    own = sorted(accepted - _CONTEXT_KEYS)
    unknown = [k for k in kwargs if k not in accepted and not var_kw]
    if unknown:
        raise TypeError(f"encoding {name!r} got unknown option(s) {unknown}; valid options: {own}")
    clash = [k for k in kwargs if k in _CONTEXT_KEYS and context is not None]
    if clash:
        raise TypeError(f"encoding {name!r}: {clash} come from the model, not from pos_encoding options")
    args: dict[str, Any] = {}
    if context is not None:
        args.update({k: v for k, v in context.as_kwargs().items() if k in accepted})
    args.update(kwargs)
    enc = cls(**args)
    return enc
