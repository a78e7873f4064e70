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
from timm.layers import Attention, PatchDropoutWithIndices, register_notrace_function
from timm.models.vision_transformer import Block
from torch.utils.checkpoint import checkpoint

from ..encodings.base import PositionalEncoding, sdpa

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
    "drop_patches",
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


# torch.fx.wrap patches these names in this module's globals for any FX tracer (timm's registration
# above only reaches modules whose forward the tracer enters through a module call)
for _fn in ("encoding_prepare", "encoding_keep_tokens", "encoding_embed_tokens", "encoding_after_block", "encoding_attend"):
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
    """What one attention layer needs from the encoding: the encoding, its per-forward state, the layer index."""

    encoding: PositionalEncoding
    state: Any
    layer: int


class PEAttention(Attention):
    """timm ``Attention`` whose score computation is delegated to the encoding's ``attend`` hook."""

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: Optional[torch.Tensor] = None,
        is_causal: bool = False,
        pe: Optional[LayerPE] = None,
    ) -> torch.Tensor:
        B, N, C = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        dropout_p = self.attn_drop.p if self.training else 0.0
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
    for i, blk in enumerate(blocks):
        if last_index is not None and i > last_index:
            break
        pe = LayerPE(encoding, state, i)
        if use_ckpt:
            x = checkpoint(blk, x, attn_mask, is_causal, pe, use_reentrant=False)
        else:
            x = blk(x, attn_mask=attn_mask, is_causal=is_causal, pe=pe)
        x = encoding_after_block(encoding, i, x, grid, state)
        yield i, x
