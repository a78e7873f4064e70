"""The three encoding contracts and the registry.

Every positional encoding in vispe is a :class:`PositionalEncoding` module that a host model
(ViT, video ViT, ...) drives through four hooks, always with an explicit :class:`PositionGrid`:

* ``prepare(grid, device)`` -- position-only quantities for this forward (rotary tables,
  bias tables); computed once per forward for all layers and cached per (grid, device) where
  no gradient needs them.
* ``keep_tokens(state, grid)`` -- after patch dropout (``grid.keep``), narrow per-token state
  (rotary tables, bias maps, rotations) to the kept tokens.
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

import inspect
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Hashable, Sequence, TypeVar

import torch
import torch.nn as nn

# the attention kernels live in .attention; re-exported here for the encodings that import them from .base
from .attention import autocast_off_in_backward, fold_causal_mask, merge_attn_mask, save_as_recomputed, sdpa, sdpa_with_bias
from .grid import PositionGrid

_T = TypeVar("_T")

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


class PositionalEncoding(nn.Module):
    """Base class and the "no positional encoding" behaviour for every hook."""

    #: 'none' | 'token' | 'bias' | 'rotary' | 'conditional' -- informative, models never read it.
    kind: ClassVar[str] = "none"
    #: Grid dimensionalities this encoding accepts (e.g. (2,) for image-only, (2, 3) for both).
    grid_ndims: ClassVar[tuple[int, ...]] = (1, 2, 3)
    #: How prefix tokens (cls, registers) are treated; one sentence, shown in docs and repr.
    prefix_policy: ClassVar[str] = "prefix tokens are untouched"
    #: Whether the encoding still works when timm's PatchDropout removes tokens (see :meth:`keep_tokens`).
    supports_token_dropout: ClassVar[bool] = True

    registry_name: ClassVar[str] = ""
    #: Entries kept by :meth:`cached` (least recently used dropped first).
    cache_size: ClassVar[int] = 8

    def __init__(self) -> None:
        super().__init__()
        self._state_cache: OrderedDict[Any, Any] = OrderedDict()

    # -- the one cache of position-only state --------------------------------------------------
    def cacheable(self) -> bool:
        """Whether state built from the parameters may be reused: while no gradient must flow into it."""
        return not (torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()))

    def cached(self, key: Hashable, build: Callable[[], _T], *, uses_parameters: bool = False) -> _T:
        """``build()`` once per ``key`` (grid, device, dtype, ... as the caller needs), reused afterwards.

        Every encoding caches through this one method. ``uses_parameters=True``: the value is computed
        from the encoding's parameters, so it is rebuilt on every call while a gradient must reach them
        (:meth:`cacheable`), and cached entries are keyed by the parameters' versions (an optimizer step
        or a load invalidates them). Cached values are built outside inference mode and without
        autograd: plain tensors that a later training step can use. Moving the module (``.to``) and
        :meth:`clear_cache` drop every entry.
        """
        if uses_parameters:
            if not self.cacheable():
                return build()
            key = (key, tuple(p._version for p in self.parameters()))
        value = self._state_cache.get(key)
        if value is None:
            with torch.inference_mode(False), torch.no_grad():
                value = build()
            self._state_cache[key] = value
            while len(self._state_cache) > self.cache_size:
                self._state_cache.popitem(last=False)
        else:
            self._state_cache.move_to_end(key)
        return value

    def clear_cache(self) -> None:
        self._state_cache.clear()

    def _apply(self, fn, *args, **kwargs):  # device/dtype moves invalidate cached tables
        self.clear_cache()
        return super()._apply(fn, *args, **kwargs)

    def check_grid(self, grid: PositionGrid) -> None:
        if grid.ndim not in self.grid_ndims:
            raise ValueError(
                f"{type(self).__name__} ({self.registry_name!r}) takes {self.grid_ndims}-D grids, got a {grid.ndim}-D grid "
                f"{grid.shape}; pick a variant for this grid (see vispe.list_encodings())."
            )

    def prepare(self, grid: PositionGrid, device: torch.device | None = None) -> Any:
        """Position-only quantities for one forward (shared by all layers). Default: nothing."""
        return None

    def keep_tokens(self, state: Any, grid: PositionGrid) -> Any:
        """Narrow ``state`` to the tokens patch dropout kept (``grid.keep``; rows ``grid.sequence_index()``).

        Called by the host after :meth:`prepare` when tokens were dropped. Default: the state unchanged,
        right for encodings that hold nothing per token (token encodings add before the dropout).
        """
        return state

    def embed_tokens(
        self, x: torch.Tensor, grid: PositionGrid, state: Any = None, image: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Add a token encoding to ``x`` of shape ``(B, S + N, D)``. Default: identity."""
        return x

    def after_block(self, index: int, x: torch.Tensor, grid: PositionGrid, state: Any = None) -> torch.Tensor:
        """Act on the token sequence after block ``index``. Default: identity."""
        return x

    def fold_qk_basis(self, state: Any, layer: int = 0) -> tuple[torch.Tensor | None, Any]:
        """A per-head linear map ``(H, dh, dh)`` that :meth:`attend` would apply to every token's q and k
        (``q @ basis``), offered for the host to fold into its q/k projection weights instead -- once per layer
        and step rather than once per token -- and the state :meth:`attend` then takes (marked as folded).
        Default: nothing to fold, ``(None, state)``. A host that cannot fold (normalised q/k, a non-linear
        projection) simply does not call this and passes the original state."""
        return None, state

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
        """Called by a host model's ``set_input_size``: adapt to a new training grid. Default: an encoding
        that keeps its training grid (``grid_size``) stores the new one; cached state is dropped."""
        if hasattr(self, "grid_size"):
            self.grid_size = tuple(int(g) for g in grid_size)
        self.clear_cache()

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

    def add_to_tokens(
        self, x: torch.Tensor, lattice: torch.Tensor, grid: PositionGrid, prefix: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x`` ``(B, S + N, D)`` plus ``lattice`` ``(1|B, N, D)`` on the lattice tokens and ``prefix``
        ``(1, S, D)`` on the prefix tokens (nothing added to them when ``None``), in ``x``'s dtype."""
        s = grid.num_prefix_tokens
        lattice = lattice.to(x.dtype)
        if s == 0:
            return x + lattice
        if prefix is not None and prefix.shape[1] != s:
            raise ValueError(f"{self.registry_name} has {prefix.shape[1]} prefix vectors but the sequence has {s} prefix tokens")
        head = x[:, :s] if prefix is None else x[:, :s] + prefix.to(x.dtype)
        return torch.cat([head, x[:, s:] + lattice], dim=1)


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
    if isinstance(name, str) and "+" in name and name not in _REGISTRY:  # a composition ("learned+rope_axial")
        from .composed import composed_class

        return composed_class(name)
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown positional encoding {name!r}; choose one of {list_encodings()}")
    return _REGISTRY[name]


def _init_params(cls: type) -> tuple[set[str], bool]:
    sig = inspect.signature(cls.__init__)
    names = {p.name for p in list(sig.parameters.values())[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    var_kw = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
    return names, var_kw


def create_encoding(spec: Any, context: EncodingContext | None = None, **kwargs: Any) -> PositionalEncoding:
    """Build a registered encoding.

    Args:
        spec: a name from :func:`list_encodings`, or a spec with options (``"irpe[mode=bias]"``,
            ``{"name": "irpe", "mode": "bias"}``, ``("irpe", {"mode": "bias"})``; see :mod:`vispe.encodings.spec`).
        context: what the host model knows (width, heads, depth, grid); only the fields the
            encoding's constructor names are passed.
        **kwargs: the encoding's own options (override the spec's); unknown options raise a
            ``TypeError`` that lists the valid ones.
    """
    from .spec import parse_pos_encoding

    name, options = parse_pos_encoding(spec)
    kwargs = {**options, **kwargs}
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
