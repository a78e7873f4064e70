"""timm's Attention and Block with one extra argument: the layer's positional-encoding binding.

Parameter names are timm's, so every timm ViT checkpoint loads. With ``pe=None`` the maths is
exactly timm's fused path.

Hosts call an encoding's hooks only through the ``encoding_*`` functions below. They are registered
with timm's FX tracer as opaque calls (``register_notrace_function``), as timm does for its own
position helpers: position work depends on the input's size, which symbolic tracing cannot branch
on, so a traced vispe model records one node per hook and runs the hook as is.
"""
from __future__ import annotations

from typing import Any, Iterator, NamedTuple, Optional

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.modules.module as _module_hooks
from timm.layers import Attention, PatchDropoutWithIndices, register_notrace_function
from timm.models.vision_transformer import Block
from torch.utils.checkpoint import checkpoint

from ..encodings.base import PositionalEncoding, autocast_off_in_backward, sdpa, split_qkv

__all__ = [
    "LayerPE",
    "PEAttention",
    "PEBlock",
    "run_blocks",
    "encoding_prepare",
    "encoding_keep_tokens",
    "encoding_embed_tokens",
    "encoding_after_block",
    "encoding_attend",
    "encoding_attend_qkv",
    "encoding_project_qkv",
    "fold_qk_basis_into_weights",
    "drop_patches",
    "embed_grid",
    "hook_owners",
    "record_auxiliary_loss",
    "auxiliary_loss",
    "NOT_PREPARED",
]


@register_notrace_function
def encoding_prepare(encoding: PositionalEncoding, grid: Any, like: torch.Tensor) -> Any:
    """``encoding.prepare`` on ``like``'s device (one traced node): the first hook of every forward."""
    return encoding.prepare(grid, like.device)


@register_notrace_function
def encoding_keep_tokens(encoding: PositionalEncoding, state: Any, grid: Any) -> Any:
    """After patch dropout (``grid.keep``), the state narrowed to the kept tokens; otherwise unchanged."""
    return state if getattr(grid, "keep", None) is None else encoding.keep_tokens(state, grid)


@register_notrace_function
def encoding_embed_tokens(
    encoding: PositionalEncoding, x: torch.Tensor, grid: Any, state: Any, image: Optional[torch.Tensor] = None
) -> torch.Tensor:
    return encoding.embed_tokens(x, grid, state, image=image)


@register_notrace_function
def encoding_after_block(encoding: PositionalEncoding, index: int, x: torch.Tensor, grid: Any, state: Any) -> torch.Tensor:
    return encoding.after_block(index, x, grid, state)


@register_notrace_function
def encoding_attend(
    pe: "LayerPE",
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    dropout_p: float,
    is_causal: bool,
) -> torch.Tensor:
    return pe.encoding.attend(q, k, v, layer=pe.layer, state=pe.state, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal)


@register_notrace_function
def encoding_attend_qkv(
    pe: "LayerPE", qkv: torch.Tensor, attn_mask: Optional[torch.Tensor], dropout_p: float, is_causal: bool
) -> torch.Tensor:
    """:func:`encoding_attend` from the fused projection's output ``(B, N, 3, H, dh)`` (q and k un-normalised)."""
    return pe.encoding.attend_qkv(qkv, layer=pe.layer, state=pe.state, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal)


def _per_block(rows: torch.Tensor, basis: torch.Tensor, lead: int = 0) -> torch.Tensor:
    """Per-head rows ``(..., H, dh, X)`` split into the basis's diagonal blocks ``(..., H, m, b, X)`` when ``basis``
    is given as blocks ``(*L, H, m, b, b)`` (``lead`` = len(L) layer dims); unchanged for a dense ``(*L, H, dh, dh)``."""
    return rows.unflatten(-2, basis.shape[lead + 1 : lead + 3]) if basis.ndim - lead == 4 else rows


def _per_block_row(vec: torch.Tensor, basis: torch.Tensor, lead: int = 0) -> torch.Tensor:
    """A per-head row vector ``(..., H, dh)`` as one row per block: ``(..., H, 1, dh)`` / ``(..., H, m, 1, b)``."""
    return (vec.unflatten(-1, basis.shape[lead + 1 : lead + 3]) if basis.ndim - lead == 4 else vec).unsqueeze(-2)


def fold_qk_basis_into_weights(
    weight: torch.Tensor, bias: Optional[torch.Tensor], basis: torch.Tensor
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A fused qkv projection ``(3 H dh, D)`` (timm's row order: q heads, k heads, v heads) whose q and k outputs
    come out multiplied per head by ``basis``: ``q_h @ B_h = x @ (B_h^T W_q,h)^T + b_q,h @ B_h``. ``basis`` is
    ``(H, dh, dh)``, or block-diagonal given by its blocks ``(H, m, b, b)`` (``m b = dh``), which costs ``m`` times
    fewer multiply-adds than the dense form of the same matrix. float32 maths (autocast then rounds the folded
    weight once, as it rounds any weight)."""
    return _fold_layers(weight, bias, basis, weight.dtype)


def _fold_layers(
    weight: torch.Tensor, bias: Optional[torch.Tensor], basis: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """:func:`fold_qk_basis_into_weights` for one layer, or for a stack of layers in one product: ``weight``
    ``(*L, 3 H dh, D)``, ``bias`` ``(*L, 3 H dh)``, ``basis`` ``(*L, H, dh, dh)`` or ``(*L, H, m, b, b)``. float32
    maths; the folded weight and bias come out in ``dtype``."""
    lead = weight.ndim - 2
    heads = basis.shape[lead]
    rows = weight.shape[-2] // 3
    with torch.autocast(device_type=weight.device.type, enabled=False):
        bf = basis.float()
        bq = bf.unsqueeze(lead)  # one basis for a layer's q rows and its k rows
        w = _per_block(weight.float()[..., : 2 * rows, :].unflatten(-2, (2, heads, -1)), bf, lead)  # (*L, 2, H, [m,] dh|b, D)
        w_qk = torch.matmul(bq.transpose(-1, -2), w).flatten(lead, -2)
        folded_w = torch.cat([w_qk, weight[..., 2 * rows:, :].float()], dim=-2).to(dtype)
        folded_b = None
        if bias is not None:
            b = _per_block_row(bias.float()[..., : 2 * rows].unflatten(-1, (2, heads, -1)), bf, lead)
            folded_b = torch.cat([torch.matmul(b, bq).flatten(lead), bias[..., 2 * rows:].float()], dim=-1).to(dtype)
    return folded_w, folded_b


class _FoldedProjection(torch.autograd.Function):
    """``linear(x, *fold_qk_basis_into_weights(weight, bias, basis))`` that keeps for the backward only what a plain
    linear layer keeps (``x`` and the parameter ``weight``) plus the small ``basis``: the folded weight (a copy of
    the projection per layer) is rebuilt in the backward instead of being stored through the whole forward.
    The matmuls run in the autocast dtype of the forward, as autocast runs ``nn.Linear``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], basis: torch.Tensor):  # type: ignore[override]
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        with torch.autocast(device_type=x.device.type, enabled=False):
            w, b = fold_qk_basis_into_weights(weight, bias, basis)
            out = torch.nn.functional.linear(x.to(dtype), w.to(dtype), None if b is None else b.to(dtype))
        ctx.save_for_backward(x, weight, bias, basis)
        ctx.compute_dtype = dtype
        return out

    @staticmethod
    @autocast_off_in_backward
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        x, weight, bias, basis = ctx.saved_tensors
        dtype = ctx.compute_dtype
        heads = basis.shape[0]
        rows = weight.shape[0] // 3
        w, _ = fold_qk_basis_into_weights(weight, None, basis)
        g = grad.to(dtype)
        grad_x = (g @ w.to(dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        g2 = g.reshape(-1, g.shape[-1])
        grad_w_folded = (g2.t() @ x.reshape(-1, x.shape[-1]).to(dtype)).float()  # (3 H dh, D)
        grad_b_folded = g2.float().sum(0) if bias is not None else None
        # back through W'_h = B_h^T W_h (q and k rows) and b'_h = b_h B_h:  dW_h = B_h dW'_h,  dB_h = W_h dW'_h^T + b_h^T db'_h
        # (per diagonal block when the basis comes as blocks)
        bf = basis.float()
        gq = _per_block(grad_w_folded[: 2 * rows].unflatten(0, (2, heads, -1)), bf)  # (2, H, [m,] dh|b, D)
        wq = _per_block(weight.float()[: 2 * rows].unflatten(0, (2, heads, -1)), bf)
        grad_weight = grad_basis = grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_weight = torch.cat([torch.matmul(bf, gq).reshape(2 * rows, -1), grad_w_folded[2 * rows:]]).to(weight.dtype)
        if ctx.needs_input_grad[3]:
            grad_basis = torch.matmul(wq, gq.transpose(-1, -2)).sum(0)  # like basis
        if bias is not None:
            gb = _per_block_row(grad_b_folded[: 2 * rows].unflatten(0, (2, heads, -1)), bf)
            bq = _per_block_row(bias.float()[: 2 * rows].unflatten(0, (2, heads, -1)), bf)
            if ctx.needs_input_grad[2]:
                grad_bias = torch.cat([torch.matmul(gb, bf.transpose(-1, -2)).reshape(-1), grad_b_folded[2 * rows:]]).to(bias.dtype)
            if grad_basis is not None:
                grad_basis = grad_basis + torch.matmul(bq.transpose(-1, -2), gb).sum(0)
        if grad_basis is not None:
            grad_basis = grad_basis.to(basis.dtype)
        return grad_x, grad_weight, grad_bias, grad_basis


def _observed(module: nn.Module) -> bool:
    """Something watches ``module``'s calls (its own or global forward hooks): it must be called, not folded away."""
    return bool(module._forward_hooks or module._forward_pre_hooks or _module_hooks._global_forward_hooks
                or _module_hooks._global_forward_pre_hooks)


@register_notrace_function
def encoding_project_qkv(pe: "LayerPE", qkv: nn.Linear, x: torch.Tensor, can_fold: bool) -> tuple[torch.Tensor, "LayerPE"]:
    """One layer's fused qkv projection. An encoding that multiplies every token's q and k by a per-head matrix
    (ComRoPE's spectral basis) has it folded into the projection's q/k weights here -- once per layer and step
    instead of once per token -- and the returned binding's state says so. Without such a matrix, when the host
    cannot fold (``can_fold``: q/k norms, another projection) or when hooks watch ``qkv``, this is ``qkv(x)``.
    Opaque to FX (like the other hooks), so a traced model folds exactly as the eager one does."""
    basis, state = pe.encoding.fold_qk_basis(pe.state, pe.layer) if can_fold and not _observed(qkv) else (None, pe.state)
    if basis is None:
        return qkv(x), pe
    return _FoldedProjection.apply(x, qkv.weight, qkv.bias, basis), LayerPE(pe.encoding, state, pe.layer)


# torch.fx.wrap patches these names in this module's globals for any FX tracer (timm's registration
# above only reaches modules whose forward the tracer enters through a module call)
for _fn in ("encoding_prepare", "encoding_keep_tokens", "encoding_embed_tokens", "encoding_after_block", "encoding_attend",
            "encoding_attend_qkv", "encoding_project_qkv", "drop_patches"):
    torch.fx.wrap(_fn)


#: ``run_blocks(state=NOT_PREPARED)``: the caller has not run ``prepare`` (``None`` is a valid state).
NOT_PREPARED: Any = type("NotPrepared", (), {"__repr__": lambda self: "NOT_PREPARED"})()


def drop_patches(patch_drop: nn.Module, x: torch.Tensor, grid: Any) -> tuple[torch.Tensor, Any]:
    """timm's patch dropout; with ``PatchDropoutWithIndices`` the kept indices travel in the grid
    (``grid.keep``) to the encoding's ``keep_tokens``. Any other module (``Identity``) is just applied."""
    if isinstance(patch_drop, PatchDropoutWithIndices):
        x, keep = patch_drop(x)
        return x, grid.with_keep(keep)
    return patch_drop(x), grid


class LayerPE(NamedTuple):
    """What one attention layer needs from the encoding: the encoding, its per-forward state, the layer index, and
    (from :func:`run_blocks`) the layer's qkv weight and bias with the encoding's basis already folded in."""

    encoding: PositionalEncoding
    state: Any
    layer: int
    folded_qkv: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]] = None


class PEAttention(Attention):
    """timm ``Attention`` whose score computation is delegated to the encoding's ``attend`` hook."""

    @property
    def qk_unnormalised(self) -> bool:
        """q and k go from the projection to attention as they are (no q/k norm between)."""
        return isinstance(self.q_norm, nn.Identity) and isinstance(self.k_norm, nn.Identity)

    @property
    def folds_qk_basis(self) -> bool:
        """An encoding's per-head q/k basis may be folded into the projection: q and k come straight out of one
        plain linear layer (no q/k norm between the projection and the rotation)."""
        return (type(self.qkv) is nn.Linear and self.qk_unnormalised
                and self.qkv.out_features == 3 * self.num_heads * self.head_dim)

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: Optional[torch.Tensor] = None,
        is_causal: bool = False,
        pe: Optional[LayerPE] = None,
    ) -> torch.Tensor:
        B, N, C = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        if pe is None:
            qkv = self.qkv(x)
        elif pe.folded_qkv is not None:
            qkv = F.linear(x, *pe.folded_qkv)
        else:
            qkv, pe = encoding_project_qkv(pe, self.qkv, x, self.folds_qk_basis)
        qkv = qkv.reshape(B, N, 3, self.num_heads, self.head_dim)
        dropout_p = self.attn_drop.p if self.training else 0.0
        if pe is not None and self.qk_unnormalised:
            # the encoding gets the projection's output whole, so it may fuse its work into the split
            x = encoding_attend_qkv(pe, qkv, attn_mask, dropout_p, is_causal)
        else:
            q, k, v = split_qkv(qkv)
            q, k = self.q_norm(q), self.k_norm(k)
            if pe is None:
                x = sdpa(q, k, v, attn_mask, dropout_p, is_causal)
            else:
                x = encoding_attend(pe, q, k, v, attn_mask, dropout_p, is_causal)
        x = x.transpose(1, 2).reshape(B, N, self.attn_dim)
        x = self.norm(x)
        if gate is not None:
            x = x * gate
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class PEBlock(Block):
    """timm ``Block`` that forwards the layer's :class:`LayerPE` to its attention."""

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: Optional[torch.Tensor] = None,
        is_causal: bool = False,
        pe: Optional[LayerPE] = None,
    ) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), attn_mask=attn_mask, is_causal=is_causal, pe=pe)))
        x = x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
        return x


def run_blocks(
    blocks: nn.Module,
    encoding: PositionalEncoding,
    x: torch.Tensor,
    grid: Any,
    attn_mask: Optional[torch.Tensor] = None,
    is_causal: bool = False,
    grad_checkpointing: bool = False,
    last_index: Optional[int] = None,
    state: Any = NOT_PREPARED,
) -> Iterator[tuple[int, torch.Tensor]]:
    """The one loop that drives an encoding through a stack of :class:`PEBlock`.

    ``state`` is what the host's ``prepare`` gave at the start of the forward (prepared here, for all
    layers at once, when the caller has none); each block gets its :class:`LayerPE`; ``after_block`` runs
    between blocks. Yields ``(index, tokens)`` after each block.
    """
    if state is NOT_PREPARED:
        state = encoding_keep_tokens(encoding, encoding_prepare(encoding, grid, x), grid)
    use_ckpt = grad_checkpointing and not torch.jit.is_scripting() and torch.is_grad_enabled()
    # in a compiled graph only: there the per-layer fold's launches cost host time; eager keeps the per-layer fold,
    # which stores no folded weights (ViT-S/16 on a CPU, eager: the stacked fold 1.08x slower a step)
    folded = fold_qk_bases_of_blocks(blocks, encoding, state, last_index) if torch.compiler.is_compiling() else None
    for i, blk in enumerate(blocks):
        if last_index is not None and i > last_index:
            break
        pe = LayerPE(encoding, state, i) if folded is None else folded[i]
        if use_ckpt:
            x = checkpoint(blk, x, attn_mask, is_causal, pe, use_reentrant=False)
        else:
            x = blk(x, attn_mask=attn_mask, is_causal=is_causal, pe=pe)
        x = encoding_after_block(encoding, i, x, grid, state)
        yield i, x


def fold_qk_bases_of_blocks(
    blocks: nn.Module, encoding: PositionalEncoding, state: Any, last_index: Optional[int] = None
) -> Optional[list[LayerPE]]:
    """Every layer's q/k basis (``fold_qk_basis``, ComRoPE's spectral basis) folded into its qkv weights in one
    batched product for the whole stack, each block's :class:`LayerPE` carrying its folded weights; ``None`` when
    the layers do not all fold alike (a layer without a basis, a projection that cannot fold, a block or projection
    watched by hooks, different shapes): :func:`encoding_project_qkv` then folds layer by layer. Per layer, the fold and its backward
    are a handful of small products and copies that a compiled step launches one by one; for the stack they are a
    few (a compiled ViT-S/16 step: about 60 fewer operations). The stacked weights stay alive until the backward,
    a float32 copy of the qkv projections (ViT-S/16: 21 MB)."""
    layers = list(blocks)[: None if last_index is None else last_index + 1]
    if len(layers) < 2:
        return None
    folds = []
    for i, blk in enumerate(layers):
        attn = getattr(blk, "attn", None)
        # a watched block folds its own weights when it runs: its hooks may change them first (FSDP2 gathers a
        # block's parameters in its pre-forward hook)
        if not isinstance(attn, PEAttention) or not attn.folds_qk_basis or _observed(attn.qkv) or _observed(blk):
            return None
        basis, layer_state = encoding.fold_qk_basis(state, i)
        if basis is None:
            return None
        folds.append((attn.qkv, basis, layer_state))
    first, first_basis = folds[0][0], folds[0][1]
    if any(q.weight.shape != first.weight.shape or q.weight.dtype != first.weight.dtype or (q.bias is None) != (first.bias is None)
           or b.shape != first_basis.shape for q, b, _ in folds):
        return None
    # autocast would cast each layer's folded weight on its own: cast the stack once instead
    device = first.weight.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else first.weight.dtype
    weight, bias = _fold_layers(
        torch.stack([q.weight for q, _, _ in folds]),
        None if first.bias is None else torch.stack([q.bias for q, _, _ in folds]),
        torch.stack([b for _, b, _ in folds]),
        dtype,
    )
    return [LayerPE(encoding, layer_state, i, (weight[i], None if bias is None else bias[i]))
            for i, (_, _, layer_state) in enumerate(folds)]


def embed_grid(host: nn.Module, x: torch.Tensor, grid: Any, image: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Any, Any]:
    """The one embedding step of every host: patch tokens ``(B, N, D)`` of one grid -> prefix tokens prepended
    (``host.cls_token``, ``host.reg_token``), the encoding's ``prepare`` and ``embed_tokens``, ``host.pos_drop``,
    patch dropout (``host.patch_drop``; the state narrowed to the kept tokens), ``host.norm_pre``. Returns the
    tokens, their grid (with ``keep`` after patch dropout) and the state every block receives. The image ViT, the
    video ViT and each grid group of a mixed-resolution batch run exactly this."""
    to_cat = []
    if host.cls_token is not None:
        to_cat.append(host.cls_token.expand(x.shape[0], -1, -1))
    if host.reg_token is not None:
        to_cat.append(host.reg_token.expand(x.shape[0], -1, -1))
    if to_cat:
        x = torch.cat(to_cat + [x], dim=1)
    state = encoding_prepare(host.pos_encoding, grid, x)
    x = encoding_embed_tokens(host.pos_encoding, x, grid, state, image)
    x = host.pos_drop(x)
    x, grid = drop_patches(host.patch_drop, x, grid)
    state = encoding_keep_tokens(host.pos_encoding, state, grid)
    return host.norm_pre(x), grid, state


# -- hooks found by walking the modules ------------------------------------------------------------------
_NO_PENDING = object()

#: The per-module method whose training scalars a task adds to its loss (e.g. SeqPE's regularisers).
AUXILIARY_LOSS = "auxiliary_loss"


def hook_owners(model: nn.Module, hook: str = AUXILIARY_LOSS) -> Iterator[nn.Module]:
    """The topmost modules below ``model`` (``model`` itself excluded) that expose the method ``hook``: the walk does
    not enter a module it yields, which owns its subtree's share (a composed encoding sums its parts; a host model
    collects its own modules). Encodings that keep the base class's no-op are left out. So a new module with such a
    method is found wherever it sits, with nothing to thread through models and tasks."""
    stack = list(reversed(list(model.children())))
    seen: set[int] = set()
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        method = getattr(type(m), hook, None)
        if callable(method):
            if method is not getattr(PositionalEncoding, hook, None):
                yield m
            continue
        stack.extend(reversed(list(m.children())))


def _sum(losses: list[torch.Tensor]) -> Optional[torch.Tensor]:
    if not losses:
        return None
    total = losses[0].reshape(())
    for loss in losses[1:]:
        total = total + loss.reshape(())
    return total


def record_auxiliary_loss(host: nn.Module) -> None:
    """At the end of a host's training forward: compute the auxiliary losses of the host's modules
    (:func:`hook_owners`) while the forward's parameters are live. Under FSDP2 the parameters are sharded again once
    the forward returns, so a loss computed afterwards by the task would read sharded weights. Hosts without such a
    module cost a walk. Inside a compiled or FX-traced graph nothing is recorded (the graph stays whole; the task
    computes the loss after the forward)."""
    if torch.compiler.is_compiling() or torch.fx._symbolic_trace.is_fx_tracing():
        return
    if not (host.training and torch.is_grad_enabled()):
        return
    for m in hook_owners(host):
        m.__dict__["_pending_auxiliary_loss"] = getattr(m, AUXILIARY_LOSS)()


def auxiliary_loss(model: nn.Module) -> Optional[torch.Tensor]:
    """The sum of the auxiliary losses of ``model``'s modules (:func:`hook_owners`): each one recorded by the last
    training forward (taken once), else computed now (eager, unsharded use); ``None`` when no module has one.
    The one helper every task adds to its loss."""
    losses = []
    for m in hook_owners(model):
        pending = m.__dict__.pop("_pending_auxiliary_loss", _NO_PENDING)
        loss = getattr(m, AUXILIARY_LOSS)() if pending is _NO_PENDING else pending
        if loss is not None:
            losses.append(loss)
    return _sum(losses)
