"""Composed encodings: a token encoding and an attention-side encoding in one model, through the one lifecycle.

Shipping vision towers combine two encodings -- Qwen3-VL adds a learned table **and** rotates q/k with 2D RoPE --
while a vispe model holds exactly one :class:`~vispe.encodings.PositionalEncoding`. :class:`ComposedEncoding` is
that one encoding: it holds its parts and hands every hook of the lifecycle to them, so models need no change and
never look at names.

* ``prepare`` / ``keep_tokens``: one state per part (a tuple, in part order).
* ``embed_tokens`` / ``after_block``: every part in turn (a part that does not act there is the identity).
* ``attend`` / ``fold_qk_basis``: the one attention-side part (the others attend with plain SDPA).
* ``set_grid_size``, ``no_weight_decay``, ``load_timm_pos_embed`` / ``load_timm_rope_freqs``, the cache: each part;
  parameter names are ``parts.<i>.<name>``, so a timm checkpoint's ``pos_embed`` reaches the token part.

Ways to ask for one (see :mod:`vispe.encodings.spec`): ``pos_encoding="learned+rope_axial"`` (options per part,
``"learned[init_std=0.0]+rope_axial[theta=10.0]"``), a list in YAML / Python (``[learned, rope_axial]``), or a
registered preset built from parts (``qwen3vl_vision``, ... in :mod:`vispe.encodings.vision_towers`). Names are
resolved into compositions by the spec layer (:func:`vispe.encodings.spec.composed_class`); this module needs no
registry.
Combinations that cannot compose are refused when the name is resolved, naming the parts: two attention-side
encodings (each would replace the other's attention), parts with no grid dimensionality in common.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn as nn

from .base import PositionalEncoding, sdpa
from .grid import PositionGrid

__all__ = ["ComposedEncoding", "attention_side", "check_parts"]


def attention_side(cls: type[PositionalEncoding]) -> bool:
    """Whether an encoding class replaces the attention (its own ``attend`` or a q/k basis to fold)."""
    return cls.attend is not PositionalEncoding.attend or cls.fold_qk_basis is not PositionalEncoding.fold_qk_basis


def check_parts(label: str, names: Sequence[str], classes: Sequence[type[PositionalEncoding]]) -> None:
    if len(classes) < 2:
        raise ValueError(f"a composed encoding needs at least two parts, got {list(names)} in {label!r}")
    attn = [n for n, c in zip(names, classes) if attention_side(c)]
    if len(attn) > 1:
        raise ValueError(
            f"{label!r} cannot compose: {attn} are all attention-side encodings (each replaces the attention scores), "
            "and only one may act there; compose one attention-side encoding with token encodings "
            f"(e.g. 'learned+{attn[0]}')"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"{label!r} names the same encoding twice ({sorted(n for n in set(names) if list(names).count(n) > 1)}); "
                         "compose different encodings")


class ComposedEncoding(PositionalEncoding):
    """Several encodings acting as one: each hook goes to the parts (see the module docstring).

    Build one from modules with ``ComposedEncoding([token_part, rotary_part])``; by name with
    ``create_encoding("learned+rope_axial", context)``; presets subclass it and build their parts.
    """

    kind = "composed"
    is_composition = True
    prefix_policy = "each part's own policy"

    def __init__(self, parts: Sequence[PositionalEncoding]) -> None:
        super().__init__()
        flat: list[PositionalEncoding] = []
        for p in parts:
            if not isinstance(p, PositionalEncoding):
                raise TypeError(f"ComposedEncoding parts must be PositionalEncoding modules, got {type(p).__name__}")
            flat.extend(p.parts if isinstance(p, ComposedEncoding) else [p])
        names = [p.registry_name or type(p).__name__ for p in flat]
        check_parts(self.registry_name or "+".join(names), names, [type(p) for p in flat])
        self.parts = nn.ModuleList(flat)
        attn = [i for i, p in enumerate(flat) if attention_side(type(p))]
        self.attention_index: int | None = attn[0] if attn else None
        # instance attributes: what the host reads of the class for a single encoding
        self.supports_token_dropout = all(p.supports_token_dropout for p in flat)
        self.reads_image = any(p.reads_image for p in flat)
        self.prefix_policy = "; ".join(f"{n}: {p.prefix_policy}" for n, p in zip(names, flat))

    # -- the lifecycle, delegated ------------------------------------------------------------------
    def _states(self, state: Any) -> tuple[Any, ...]:
        return tuple(state) if state is not None else (None,) * len(self.parts)

    def prepare(self, grid: PositionGrid, device: torch.device | None = None) -> tuple[Any, ...]:
        return tuple(p.prepare(grid, device) for p in self.parts)

    def keep_tokens(self, state: Any, grid: PositionGrid) -> tuple[Any, ...]:
        return tuple(p.keep_tokens(s, grid) for p, s in zip(self.parts, self._states(state)))

    def embed_tokens(self, x, grid, state=None, image=None):
        for p, s in zip(self.parts, self._states(state)):
            x = p.embed_tokens(x, grid, s, image=image)
        return x

    def after_block(self, index, x, grid, state=None):
        for p, s in zip(self.parts, self._states(state)):
            x = p.after_block(index, x, grid, s)
        return x

    def fold_qk_basis(self, state, layer=0):
        i = self.attention_index
        if i is None or state is None:
            return None, state
        basis, part_state = self.parts[i].fold_qk_basis(state[i], layer)
        if basis is None:
            return None, state
        return basis, tuple(part_state if j == i else s for j, s in enumerate(state))

    def attend(self, q, k, v, *, layer=0, state=None, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        i = self.attention_index
        if i is None:
            return sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale)
        return self.parts[i].attend(q, k, v, layer=layer, state=None if state is None else state[i], attn_mask=attn_mask,
                                    dropout_p=dropout_p, is_causal=is_causal, scale=scale)

    def attend_qkv(self, qkv, *, layer=0, state=None, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        i = self.attention_index
        if i is None:
            return super().attend_qkv(qkv, layer=layer, state=state, attn_mask=attn_mask, dropout_p=dropout_p,
                                      is_causal=is_causal, scale=scale)
        return self.parts[i].attend_qkv(qkv, layer=layer, state=None if state is None else state[i], attn_mask=attn_mask,
                                        dropout_p=dropout_p, is_causal=is_causal, scale=scale)

    def set_backend(self, value: str) -> None:
        """The attention-side part's backend option (``attention_backend`` or ``rotary_backend``): the composition's
        only one."""
        i = self.attention_index
        if i is None or self.parts[i].backend_option is None:
            raise TypeError(f"{self.registry_name or type(self).__name__} has no attention-side part with a backend option")
        self.parts[i].set_backend(value)

    def uses_attention(self) -> bool:
        return self.attention_index is not None and self.parts[self.attention_index].uses_attention()

    @property
    def extrapolation(self) -> str | None:
        """The parts' extrapolation policy (``None``: no part has one; see :func:`~vispe.encodings.set_extrapolation`)."""
        active = {p.extrapolation for p in getattr(self, "parts", ()) if p.extrapolation_policies}
        return active.pop() if len(active) == 1 else None

    @property
    def resolution_policy(self) -> str | None:
        return self.resolution.resolve(self.extrapolation)  # the parts' policy, which they hold and set

    @extrapolation.setter
    def extrapolation(self, policy: str | None) -> None:
        holders = [p for p in self.parts if p.extrapolation_policies]
        if not holders:
            PositionalEncoding.extrapolation.fset(self, policy)  # type: ignore[attr-defined]  # refuses a policy by name
        for p in holders:
            p.extrapolation = policy
        self.clear_cache()

    def set_grid_size(self, grid_size: Sequence[int]) -> None:
        for p in self.parts:
            p.set_grid_size(grid_size)
        self.clear_cache()

    def clear_cache(self) -> None:
        super().clear_cache()
        for p in getattr(self, "parts", ()):
            p.clear_cache()

    def no_weight_decay(self) -> set[str]:
        return {f"parts.{i}.{n}" for i, p in enumerate(self.parts) for n in p.no_weight_decay()}

    def auxiliary_loss(self) -> torch.Tensor | None:
        """The sum of the parts' own training regularisers (the hook SeqPE's work adds to the base class), or ``None``."""
        losses = [loss for p in self.parts if (loss := getattr(p, "auxiliary_loss", lambda: None)()) is not None]
        return torch.stack([loss.reshape(()) for loss in losses]).sum() if losses else None

    def _first_mapping(self, hook: str, value: torch.Tensor) -> dict[str, torch.Tensor] | None:
        for i, p in enumerate(self.parts):
            mapped = getattr(p, hook)(value)
            if mapped:
                return {f"parts.{i}.{k}": v for k, v in mapped.items()}
        return None

    def load_timm_pos_embed(self, pos_embed: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The first part with an absolute table takes the checkpoint's ``pos_embed``."""
        return self._first_mapping("load_timm_pos_embed", pos_embed)

    def load_timm_rope_freqs(self, freqs: torch.Tensor) -> dict[str, torch.Tensor] | None:
        return self._first_mapping("load_timm_rope_freqs", freqs)

    def extra_repr(self) -> str:
        return f"name={self.registry_name!r}" if self.registry_name else ""
