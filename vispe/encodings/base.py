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

import dataclasses
import functools
import inspect
import re
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Callable, ClassVar, Hashable, Mapping, Sequence, TypeVar

import torch
import torch.nn as nn

from .._checks import Bool, Choice, Int, Ints, OptionCheck, Real, Str, check_options, did_you_mean
from ..positions import SCHEMES

# the attention kernels live in .attention; re-exported here for the encodings that import them from .base
from .attention import (
    ATTENTION_BACKENDS,
    IndexedBias,
    attend_indexed_bias,
    autocast_off_in_backward,
    fold_causal_mask,
    merge_attn_mask,
    save_as_recomputed,
    sdpa,
    sdpa_with_bias,
    split_qkv,
)
from .coordinates import coordinate_option_rules
from .grid import PositionGrid
from .resolution import ResolutionContract

_T = TypeVar("_T")

__all__ = [
    "EncodingContext",
    "PositionalEncoding",
    "TokenEncoding",
    "AttentionBiasEncoding",
    "CONTRACTS",
    "EncodingRecord",
    "register_encoding",
    "register_preset",
    "register_alias",
    "encoding_records",
    "list_encodings",
    "get_record",
    "get_extrapolation",
    "set_extrapolation",
    "check_context_fields",
    "sdpa",
    "split_qkv",
    "merge_attn_mask",
    "sdpa_with_bias",
    "save_as_recomputed",
    "autocast_off_in_backward",
    "fold_causal_mask",
    "ATTENTION_BACKENDS",
    "IndexedBias",
]


#: Rules for the fields a host model passes (:class:`EncodingContext`); every encoding that takes one of
#: them checks it with the same rule (see :attr:`PositionalEncoding.option_checks`).
CONTEXT_OPTION_CHECKS: dict[str, OptionCheck] = {
    "dim": Int(1),
    "num_heads": Int(1),
    "head_dim": Int(1),
    "depth": Int(0),  # a model may have no blocks
    "grid_size": Ints(1),
    "num_prefix_tokens": Int(0),
    "in_chans": Int(1),
    "patch_size": Ints(1),
}
_CONTEXT_FIELDS = ("dim", "num_heads", "depth", "grid_size", "num_prefix_tokens", "in_chans", "patch_size")


def check_context_fields(owner: str, dim_name: str = "dim", **fields: Any) -> None:
    """Check the model fields an :class:`EncodingContext` carries (any subset; ``dim`` may be named
    ``dim_name``, e.g. a model's ``embed_dim``) and that the width splits into heads. Host models call it
    before building their blocks, so ``num_heads=0`` is a clear error rather than a ``ZeroDivisionError``."""
    rules = dict(CONTEXT_OPTION_CHECKS, **{dim_name: CONTEXT_OPTION_CHECKS["dim"]})
    check_options(owner, rules, fields)
    dim, heads = fields.get(dim_name), fields.get("num_heads")
    if dim is not None and heads is not None and dim % heads:
        raise ValueError(
            f"{owner}: {dim_name}={dim!r} is not divisible by num_heads={heads!r}; each head gets "
            f"{dim_name} / num_heads channels (head_dim), so {dim_name} must be a multiple of num_heads"
        )


def _annotation_check(annotation: Any) -> OptionCheck | None:
    """The rule an undeclared option's annotation implies (``float`` -> finite number, ``int`` -> int,
    ``bool`` -> strict bool, ``str`` -> string, each ``| None`` -> also ``None``); ``None`` for other types."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    text = text.replace(" ", "")
    optional = text.endswith("|None") or (text.startswith("Optional[") and text.endswith("]"))
    core = text[: -len("|None")] if text.endswith("|None") else (text[9:-1] if text.startswith("Optional[") else text)
    make = {"float": Real, "int": Int, "bool": Bool, "str": Str}.get(core)
    return None if make is None else make(optional=optional)


def _validating_init(init: Callable[..., None]) -> Callable[..., None]:
    """Wrap an encoding's ``__init__`` so its options are checked (:meth:`PositionalEncoding.option_rules`)
    before anything is built, however it is constructed (registry, class, model spec). Only the outermost
    constructor checks: a subclass's call to ``super().__init__`` passes values already checked or derived."""
    sig = inspect.signature(init)
    var_kw = next((p.name for p in sig.parameters.values() if p.kind == p.VAR_KEYWORD), None)

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        cls = type(self)
        if cls.__init__ is __init__:
            try:
                bound = sig.bind(self, *args, **kwargs)
            except TypeError:
                bound = None  # a wrong call: let the constructor itself raise Python's message
            if bound is not None:
                values = dict(bound.arguments)
                values.pop(next(iter(sig.parameters)), None)  # self
                if var_kw:
                    values.update(values.pop(var_kw, None) or {})
                check_options(cls.registry_name or cls.__name__, cls.option_rules(), values)
        init(self, *args, **kwargs)

    __init__._validates_options = True  # type: ignore[attr-defined]
    return __init__


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

    def __post_init__(self) -> None:
        # a bad width or head count would otherwise end deep inside an encoding (num_heads=0: ZeroDivisionError)
        check_context_fields("EncodingContext", **{f: getattr(self, f) for f in _CONTEXT_FIELDS})

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

    #: 'none' | 'token' | 'bias' | 'rotary' | 'conditional' | 'composed' -- informative, models never read it.
    kind: ClassVar[str] = "none"
    #: Which of the three contracts (:data:`CONTRACTS`) the class implements; the registry's ``kind`` tag.
    contract: ClassVar[str] = "token"
    #: A composition hands every hook to its parts (:class:`~vispe.encodings.composed.ComposedEncoding`).
    is_composition: ClassVar[bool] = False
    #: Grid dimensionalities this encoding accepts (e.g. (2,) for image-only, (2, 3) for both).
    grid_ndims: ClassVar[tuple[int, ...]] = (1, 2, 3)
    #: How prefix tokens (cls, registers) are treated; one sentence, shown in docs and repr.
    prefix_policy: ClassVar[str] = "prefix tokens are untouched"
    #: Whether the encoding still works when timm's PatchDropout removes tokens (see :meth:`keep_tokens`).
    supports_token_dropout: ClassVar[bool] = True
    #: Whether ``embed_tokens`` reads the pixels (``image=``); a host that holds only patches rebuilds them for it.
    reads_image: bool = False

    registry_name: ClassVar[str] = ""
    #: Entries kept by :meth:`cached` (least recently used dropped first).
    cache_size: ClassVar[int] = 8
    #: The rule of each constructor option (``vispe._checks``: ``Real``, ``Int``, ``Bool``, ``Choice``, ...),
    #: checked before ``__init__`` runs, whichever way the encoding is built. A class declares only its own
    #: options (merged along the class hierarchy, a subclass's rule wins); the model's fields
    #: (:data:`CONTEXT_OPTION_CHECKS`) are declared here, and an undeclared ``float``/``int``/``bool``/``str``
    #: option gets its annotation's type check (see :meth:`option_rules`).
    option_checks: ClassVar[Mapping[str, OptionCheck]] = CONTEXT_OPTION_CHECKS
    #: The resolution contract (:mod:`vispe.encodings.resolution`): the policies the encoding offers on a grid other
    #: than the training one, as values of its ``extrapolation`` option, and the one a freshly built encoding uses
    #: (empty: one built-in behaviour, nothing to choose). The option's rule is derived from it; the active policy
    #: is :attr:`extrapolation` (settable on a built or loaded encoding: :func:`set_extrapolation`).
    resolution: ClassVar[ResolutionContract] = ResolutionContract()
    #: The contract's listed names (:attr:`ResolutionContract.names`), derived from :attr:`resolution`.
    extrapolation_policies: ClassVar[tuple[str, ...]] = ()
    #: The training-time coordinate options the encoding takes (``coord_shift``, ``coord_jitter``,
    #: ``coord_rescale``, ``random_positions``, or DINOv3's names); their rules are declared once, in
    #: :data:`vispe.encodings.coordinates.COORDINATE_OPTION_CHECKS`.
    coordinate_options: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "extrapolation_policies" in cls.__dict__:
            raise TypeError(f"{cls.__name__}: declare the policies as resolution = ResolutionContract(policies, default) "
                            "(vispe.encodings.resolution); extrapolation_policies is derived from it")
        cls.extrapolation_policies = cls.resolution.names
        init = cls.__dict__.get("__init__")
        if init is not None and not getattr(init, "_validates_options", False):
            cls.__init__ = _validating_init(init)  # type: ignore[method-assign]
        if init is not None and cls.coordinate_options:
            # a subclass whose constructor fixes some coordinate options does not declare them
            accepted, var_kw = _init_params(cls)
            if not var_kw:
                cls.coordinate_options = tuple(o for o in cls.coordinate_options if o in accepted)

    @classmethod
    def option_rules(cls) -> dict[str, OptionCheck]:
        """Every constructor option's rule: declared (:attr:`option_checks` along the MRO) or implied by
        the option's annotation; options with neither are absent (how many axes ``grid_size`` may have is
        each encoding's own check: :attr:`grid_ndims` lists hosts, some encodings take any number of axes)."""
        declared: dict[str, OptionCheck] = coordinate_option_rules(cls.coordinate_options)
        for klass in reversed(cls.__mro__):
            declared.update(klass.__dict__.get("option_checks", {}) or {})
        if cls.resolution.policies:
            declared["extrapolation"] = cls.resolution.option_check()
        rules: dict[str, OptionCheck] = {}
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
        for param in params:
            name = param.name
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            rule = declared.get(name) or _annotation_check(param.annotation)
            if rule is not None:
                rules[name] = rule
        if any(p.kind == p.VAR_KEYWORD for p in params):  # options taken through **kwargs (composed encodings)
            rules.update({k: v for k, v in declared.items() if k not in rules and k not in CONTEXT_OPTION_CHECKS})
        return rules

    def __init__(self) -> None:
        super().__init__()
        self._state_cache: OrderedDict[Any, Any] = OrderedDict()
        self.__dict__["_extrapolation"] = self.resolution.default  # the declared default until the encoding sets one
        self.__dict__["_resolution_policy"] = self.resolution.default

    # -- the extrapolation policy (see resolution) ---------------------------------------------------
    @property
    def extrapolation(self) -> str | None:
        """The active extrapolation policy, under the name it was given (``None`` for an encoding without policies);
        :attr:`resolution_policy` is what it does."""
        return self.__dict__.get("_extrapolation")

    @extrapolation.setter
    def extrapolation(self, policy: str | None) -> None:
        # None: the declared default; a name the contract does not accept: ValueError naming it and the choices
        resolved = self.resolution.resolve(policy, self.registry_name or type(self).__name__)
        self.__dict__["_extrapolation"] = self.resolution.default if policy is None else policy
        # resolved once here, not per forward: the contract's alias lookups (generator expressions) were ~15 % of the
        # bytecode dynamo traces in a compiled forward
        self.__dict__["_resolution_policy"] = resolved
        if "_state_cache" in self.__dict__:  # tables built under the previous policy
            self.clear_cache()

    @property
    def resolution_policy(self) -> str | None:
        """The policy in force (``extend``, ``rescale``, ``resample``, ``ntk``, ``yarn``; ``None`` without policies):
        :attr:`extrapolation` with the alias ``interpolate`` resolved. Encodings dispatch on this, through
        :mod:`vispe.encodings.coordinates` and :mod:`vispe.encodings.resolution`."""
        held = self.__dict__
        # an encoding pickled whole before this attribute existed has only the name: resolve it (never read None)
        return held["_resolution_policy"] if "_resolution_policy" in held else self.resolution.resolve(self.extrapolation)

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
        if torch.compiler.is_compiling():
            # a compiled graph rebuilds the (cheap, fused) tables itself; a Python dict keyed by tensor versions
            # would break the graph or guard on every entry
            return build()
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
        """A per-head linear map ``(H, dh, dh)`` -- or a block-diagonal one given by its blocks ``(H, m, b, b)`` --
        that :meth:`attend` would apply to every token's q and k (``q @ basis``), offered for the host to fold into
        its q/k projection weights instead -- once per layer and step rather than once per token -- and the state
        :meth:`attend` then takes (marked as folded).
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

    def attend_qkv(
        self,
        qkv: torch.Tensor,
        *,
        layer: int = 0,
        state: Any = None,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Attention from a fused projection's output ``(B, L, 3, H, dh)`` (timm's qkv), for hosts whose q and k go
        straight from the projection to attention, so an encoding may fuse its work into the split. Default: q, k, v
        as views (:func:`split_qkv`) and :meth:`attend`."""
        q, k, v = split_qkv(qkv)
        return self.attend(q, k, v, layer=layer, state=state, attn_mask=attn_mask, dropout_p=dropout_p,
                           is_causal=is_causal, scale=scale)

    #: A run-time choice of how the encoding computes, not of what it computes: the option's name (``None``: it
    #: has none), taken by ``create_encoding`` and settable later with :meth:`set_backend`; not a hyperparameter.
    backend_option: ClassVar[str | None] = None
    #: the values ``backend_option`` takes
    backend_choices: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def check_backend(cls, value: Any) -> None:
        """Refuse a ``backend_option`` value this class cannot run, naming the valid ones (before anything is built)."""
        if cls.backend_option is None:
            raise TypeError(f"{cls.__name__} has no backend option")
        if value not in cls.backend_choices:
            raise ValueError(f"{cls.backend_option}={value!r} is not valid; choose one of {list(cls.backend_choices)}")

    def set_backend(self, value: str) -> None:
        """Set the ``backend_option`` (checked by :meth:`check_backend`)."""
        type(self).check_backend(value)
        setattr(self, type(self).backend_option, value)  # type: ignore[arg-type]

    def set_grid_size(self, grid_size: Sequence[int]) -> None:
        """Called by a host model's ``set_input_size``: adapt to a new training grid. Default: an encoding
        that keeps its training grid (``grid_size``) stores the new one; cached state is dropped."""
        if hasattr(self, "grid_size"):
            self.grid_size = tuple(int(g) for g in grid_size)
        self.clear_cache()

    def no_weight_decay(self) -> set[str]:
        """Parameter names (relative to this module) that must not be weight-decayed."""
        return set()

    def auxiliary_loss(self) -> torch.Tensor | None:
        """A training regulariser of the encoding's own (a scalar the task adds to its loss with its
        ``aux_loss_weight``; e.g. SeqPE's contrastive and distillation terms), or ``None`` (default)."""
        return None

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
    """An additive logit term in attention.

    Subclasses describe the term by index -- :meth:`indexed_bias` returns an
    :class:`~vispe.encodings.attention.IndexedBias`, ``bias[b, h, i, j]`` as a function of the indices and small
    tables -- so attention never needs it as a ``(B, H, L, L)`` tensor: :meth:`attend` runs it on the path
    ``attention_backend`` names (:data:`~vispe.encodings.attention.ATTENTION_BACKENDS`: ``'auto'``, ``'dense'``
    -- the float ``attn_mask`` of SDPA, the oracle --, ``'blocked'``, ``'flex'``, ``'triton'``). :meth:`bias` is the dense term
    (by default the indexed one evaluated everywhere). A subclass with only :meth:`bias` gets the dense path.
    ``attention_backend`` is an option of every bias encoding (``create_encoding('alibi_2d',
    attention_backend='blocked')``, ``pos_encoding={'name': 'fire', 'attention_backend': 'dense'}``) and an
    attribute that may be set later.
    """

    kind = "bias"
    contract = "bias"
    #: see :data:`~vispe.encodings.attention.ATTENTION_BACKENDS`; ``'auto'`` chooses per call
    attention_backend: str = "auto"
    #: query rows per block of the blocked path (``None``: sized so a block's term stays near 8 MiB)
    attention_block_rows: int | None = None

    backend_option = "attention_backend"
    backend_choices = ATTENTION_BACKENDS

    @classmethod
    def check_backend(cls, value: Any) -> None:
        super().check_backend(value)
        if value == "triton":
            from .triton_bias import triton_bias_unavailable

            why = triton_bias_unavailable()
            if why is not None:
                raise ValueError(f"attention_backend='triton' needs Triton: {why}; choose one of "
                                 f"{[b for b in ATTENTION_BACKENDS if b != 'triton']}")

    def set_backend(self, value: str) -> None:
        self.set_attention_backend(value)

    def set_attention_backend(self, backend: str, block_rows: int | None = None) -> None:
        self.check_backend(backend)
        if block_rows is not None and (not isinstance(block_rows, int) or block_rows < 1):
            raise ValueError(f"attention block_rows must be a positive int or None, got {block_rows!r}")
        self.attention_backend = backend
        self.attention_block_rows = block_rows

    def indexed_bias(self, q: torch.Tensor, k: torch.Tensor, *, layer: int, state: Any, scale: float) -> IndexedBias | None:
        """This layer's term by index (``None``: no term in this layer). Default: not described by index."""
        return None

    def bias(self, q: torch.Tensor, k: torch.Tensor, *, layer: int, state: Any) -> torch.Tensor | None:
        """The dense term, broadcastable to ``(B, H, L, L)`` (includes the softmax scale where the term depends on it)."""
        spec = self.indexed_bias(q, k, layer=layer, state=state, scale=q.shape[-1] ** -0.5)
        if spec is None:
            return None
        return spec.dense(q.shape[0], q.shape[1], q.shape[-2], k.shape[-2], q.device)

    def attend(self, q, k, v, *, layer=0, state=None, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        if state is None:
            return sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale)
        s = q.shape[-1] ** -0.5 if scale is None else scale
        spec = self.indexed_bias(q, k, layer=layer, state=state, scale=s)
        if spec is None:
            if type(self).indexed_bias is not AttentionBiasEncoding.indexed_bias:
                return sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale)  # no term in this layer
            attn_mask = merge_attn_mask(attn_mask, self.bias(q, k, layer=layer, state=state), q.dtype)
            return sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale)
        return attend_indexed_bias(q, k, v, spec, attn_mask, dropout_p, is_causal, s, self.attention_backend,
                                   self.attention_block_rows)


# ---------------------------------------------------------------------------------------------
# Registry: one record per registered name
# ---------------------------------------------------------------------------------------------

#: The three encoding contracts a record's ``kind`` names (what a host drives: tokens, an attention bias, a q/k rotation).
CONTRACTS = ("token", "bias", "rotary")
_ARXIV = re.compile(r"arXiv:?\s*(\d{4}\.\d{4,5})")


@dataclass(frozen=True)
class EncodingRecord:
    """What the registry knows about one name: the class, the defaults a preset changes, and tags to query by
    (:func:`encoding_records`). Tags are derived from the class where they can be; a decorator states the rest.

    Attributes:
        name: the registered name.
        cls: the class built (a preset's class, or the renamed class for a deprecated alias).
        defaults: options a preset changes (applied by ``create_encoding`` under the host's context and the
            caller's options; the class itself is untouched).
        grid_ndim: grid dimensionalities a host may give it (the class's ``grid_ndims``).
        kind: the contract: ``'token'`` (added to tokens, conditional encodings and no encoding included),
            ``'bias'`` (attention bias) or ``'rotary'`` (q/k rotation); a composition is listed under its
            attention-side part's contract (its class's ``contract``).
        mechanism: the class's finer ``kind`` (``'none'``, ``'token'``, ``'conditional'``, ``'bias'``,
            ``'rotary'``, ``'composed'``), as rows of result tables show it.
        family: the module that defines it (``'rope_vit'``, ``'comrope'``, ...), unless stated.
        paper: the arXiv id of the paper: stated, else the first ``arXiv NNNN.NNNNN`` the class's docstring (or a
            base class's) cites; ``None`` when none is known.
        deprecated: for a renamed encoding, the new name (building the old one warns ``FutureWarning``).
        benchmark: the grid dimensionalities for which benchmarks include it by default (``()``: opt-in
            only, e.g. a variant, a composition preset, an LLM-side scheme, a very slow default).
        benchmark_options: options benchmarks build it with (e.g. a cheaper block size).
        groups: further named sets a benchmark may select by (``'scaling'``: the default set of
            ``vispe bench scaling``).
        scheme: for a multimodal rotary encoding, its position scheme (:class:`vispe.positions.PositionScheme`:
            label, coordinates per token, builder, evaluation options), the one declared beside its builder under
            the same name (:data:`vispe.positions.SCHEMES`, which :mod:`vispe.positions` needs without the encodings).
    """

    name: str
    cls: type
    defaults: Mapping[str, Any] = field(default_factory=dict)
    grid_ndim: tuple[int, ...] = ()
    kind: str = "token"
    mechanism: str = "none"
    family: str = ""
    paper: str | None = None
    deprecated: str | None = None
    benchmark: tuple[int, ...] = ()
    benchmark_options: Mapping[str, Any] = field(default_factory=dict)
    groups: tuple[str, ...] = ()
    scheme: Any = None

    def matches(self, **tags: Any) -> bool:
        """Whether every tag matches: a tuple-valued tag (``grid_ndim``, ``benchmark``, ``groups``) contains the
        value; any other equals it; ``None`` matches anything."""
        for tag, want in tags.items():
            if want is None:
                continue
            have = getattr(self, tag)
            if not (want in have if isinstance(have, tuple) else have == want):
                return False
        return True


_RECORDS: dict[str, EncodingRecord] = {}
_CONTEXT_KEYS = set(EncodingContext(1, 1, 1, (1, 1)).as_kwargs())
_TAGS = tuple(f.name for f in fields(EncodingRecord) if f.name not in ("name", "cls", "defaults"))


def _paper(cls: type) -> str | None:
    """The first arXiv id the class's docstring (or a base class's) cites."""
    for klass in cls.__mro__:
        if klass is PositionalEncoding:
            break
        found = _ARXIV.search(klass.__dict__.get("__doc__") or "")
        if found:
            return found.group(1)
    return None


def _family(cls: type) -> str:
    module = cls.__module__
    prefix = __name__.rsplit(".", 1)[0] + "."
    return module[len(prefix):].split(".")[0] if module.startswith(prefix) else module


def _benchmark_ndims(benchmark: bool | Sequence[int], ndims: tuple[int, ...]) -> tuple[int, ...]:
    if benchmark is True:
        return tuple(d for d in ndims if d > 1)  # benchmarks run image and video lattices
    if benchmark is False:
        return ()
    return tuple(benchmark)


def _add_record(record: EncodingRecord) -> None:
    old = _RECORDS.get(record.name)
    if old is not None and old.cls is not record.cls:
        raise ValueError(f"encoding name {record.name!r} is already registered to {old.cls.__name__}")
    if record.kind not in CONTRACTS:
        raise ValueError(f"encoding {record.name!r}: kind={record.kind!r} is not a contract; choose one of {list(CONTRACTS)}")
    _RECORDS[record.name] = record


def register_encoding(
    name: str,
    *,
    defaults: Mapping[str, Any] | None = None,
    kind: str | None = None,
    family: str | None = None,
    paper: str | None = None,
    deprecated: str | None = None,
    benchmark: bool | Sequence[int] = True,
    benchmark_options: Mapping[str, Any] | None = None,
    groups: Sequence[str] = (),
    scheme: Any = None,
) -> Callable[[type[PositionalEncoding]], type[PositionalEncoding]]:
    """Class decorator: ``@register_encoding('rope_axial')`` records the class under ``name`` (names are unique).

    Only what cannot be read off the class is stated here (see :class:`EncodingRecord`): ``grid_ndim`` comes from
    ``grid_ndims``, ``kind`` from the contract base class, ``family`` from the module, ``paper`` from the
    docstring's arXiv id. ``benchmark``: ``True`` (default: every benchmark on the class's image/video grids
    includes it), ``False`` (opt-in), or the grid dimensionalities to include it for. ``defaults``: options a preset
    changes (see :func:`register_preset`). ``deprecated``: the new name of a renamed encoding (it still builds,
    with a ``FutureWarning``; see also :func:`register_alias`)."""

    def wrap(cls: type[PositionalEncoding]) -> type[PositionalEncoding]:
        if not (isinstance(cls, type) and issubclass(cls, PositionalEncoding)):
            raise TypeError(f"register_encoding({name!r}) expects a PositionalEncoding subclass, got {cls!r}")
        if defaults:
            accepted, var_kw = _init_params(cls)
            unknown = sorted(set(defaults) - accepted)
            if unknown and not var_kw:
                owner = next(k for k in cls.__mro__ if "__init__" in k.__dict__)  # the constructor the defaults go to
                raise TypeError(f"preset {name!r}: {owner.__name__} has no option(s) {unknown}")
        record = EncodingRecord(
            name, cls, MappingProxyType(dict(defaults or {})), tuple(cls.grid_ndims), kind or cls.contract, cls.kind,
            family or _family(cls), paper if paper is not None else _paper(cls), deprecated,
            _benchmark_ndims(benchmark, tuple(cls.grid_ndims)), MappingProxyType(dict(benchmark_options or {})),
            tuple(groups), scheme if scheme is not None else SCHEMES.get(name),
        )
        _add_record(record)
        if not deprecated:
            cls.registry_name = name
        return cls

    return wrap


def register_preset(name: str, **defaults: Any) -> Callable[[type[PositionalEncoding]], type[PositionalEncoding]]:
    """Class decorator: register ``name`` as the decorated class's base with other default options (timm's way: a
    registered name is a class plus default kwargs)::

        @register_preset("rope_axial_3d", grid_size=(8, 14, 14))
        class RopeAxial3d(RopeAxial):
            # docstring: what the preset is
            grid_ndims = (3,)

    The decorated class states only what describes the preset (docstring, the grids it is listed for) and no
    constructor; the record keeps ``defaults`` (``encoding_records(name=...)[0].defaults``), which
    ``create_encoding`` passes under the host's context and the caller's options. Same as
    ``register_encoding(name, defaults=defaults)`` on a class without its own ``__init__``."""

    def wrap(cls: type[PositionalEncoding]) -> type[PositionalEncoding]:
        if "__init__" in cls.__dict__:
            raise TypeError(f"preset {name!r}: {cls.__name__} defines __init__; a preset only changes defaults "
                            "(register a class with its own constructor with register_encoding)")
        return register_encoding(name, defaults=defaults)(cls)

    return wrap


def register_alias(old: str, new: str) -> None:
    """Keep a renamed encoding's old name building: ``old`` becomes a record of ``new``'s class and defaults marked
    ``deprecated=new`` (building it warns ``FutureWarning`` naming ``new``; listings leave it out)."""
    target = get_record(new)
    _add_record(dataclasses.replace(target, name=old, deprecated=new, benchmark=(), groups=()))


def encoding_records(*, include_deprecated: bool = False, **tags: Any) -> list[EncodingRecord]:
    """The registry's records, by name, filtered by tags (see :class:`EncodingRecord`; ``None``: any).

    This is the query benchmarks use instead of hand lists, e.g. ``encoding_records(benchmark=2)`` (what an
    image benchmark covers by default), ``encoding_records(kind='bias', grid_ndim=2)``,
    ``encoding_records(groups='scaling')``, ``encoding_records(family='comrope')``; a new encoding appears in each
    query its tags match with no list to edit. Deprecated aliases are left out unless ``include_deprecated``."""
    unknown = sorted(set(tags) - set(_TAGS))
    if unknown:
        raise TypeError(f"unknown encoding tag(s) {unknown}; valid tags: {list(_TAGS)}")
    return [r for _, r in sorted(_RECORDS.items())
            if (include_deprecated or not r.deprecated) and r.matches(**tags)]


def list_encodings(kind: str | None = None, grid_ndim: int | None = None, **tags: Any) -> list[str]:
    """Registered encoding names, optionally filtered by ``kind`` (a contract, or a class's finer kind such as
    ``'conditional'``), a grid dimensionality or any other tag (:func:`encoding_records`)."""
    if kind is not None and kind not in CONTRACTS:
        tags["mechanism"] = kind
        kind = None
    return [r.name for r in encoding_records(kind=kind, grid_ndim=grid_ndim, **tags)]


def get_record(name: str) -> EncodingRecord:
    """The record of a registered name (a deprecated alias warns ``FutureWarning`` naming the new name); an unknown
    name raises ``ValueError`` listing the registered ones."""
    record = _RECORDS.get(name) if isinstance(name, str) else None
    if record is None:
        raise ValueError(f"unknown positional encoding {name!r}; choose one of {list_encodings()}{did_you_mean(name, _RECORDS)}")
    if record.deprecated:
        warnings.warn(f"encoding {name!r} is deprecated: it was renamed {record.deprecated!r}; use that name",
                      FutureWarning, stacklevel=3)
    return record


def _policy_encodings(source: Any) -> list[PositionalEncoding]:
    """The encodings of a model (or the encoding itself) that hold an extrapolation policy; a composition is walked
    to its parts (it holds none of its own)."""
    modules = source.modules() if isinstance(source, nn.Module) else ()
    return [m for m in modules if isinstance(m, PositionalEncoding) and not m.is_composition and m.extrapolation_policies]


def _common_policies(groups: Sequence[Sequence[str]]) -> tuple[str, ...]:
    if not groups:
        return ()
    return tuple(p for p in groups[0] if all(p in g for g in groups[1:]))


def get_extrapolation(model: nn.Module) -> str | None:
    """The active extrapolation policy of a model's (or an encoding's) encodings, under its listed name (one of
    :func:`extrapolation_policies`: ``interpolate`` for ``rescale`` / ``resample``; ``None``: none has one)."""
    active = {m.resolution.name_of(m.extrapolation) for m in _policy_encodings(model)}
    if len(active) > 1:
        raise ValueError(f"the encodings of this model use different extrapolation policies {sorted(active)}")
    return active.pop() if active else None


def set_extrapolation(model: nn.Module, policy: str) -> nn.Module:
    """Switch every encoding of ``model`` (a model or an encoding; composed encodings' parts included) to the
    extrapolation policy ``policy``, in place, without rebuilding anything: tables built under the previous policy
    are dropped. Raises ``ValueError`` naming ``policy`` and the valid ones (none when no encoding has a policy).
    Returns ``model``."""
    holders = _policy_encodings(model)
    if not holders:
        names = sorted({m.registry_name or type(m).__name__ for m in model.modules() if isinstance(m, PositionalEncoding)})
        raise ValueError(f"cannot set extrapolation={policy!r}: encoding {' + '.join(names) or 'none'} has no extrapolation "
                         "option (it meets every grid one way)")
    valid = _common_policies([m.extrapolation_policies for m in holders])
    if not all(isinstance(policy, str) and policy in m.resolution.accepted for m in holders):
        precise = {m.resolution.interpolates_by for m in holders}
        alias = f" (or {precise.pop()!r}, what 'interpolate' does here)" if len(precise) == 1 and "interpolate" in valid else ""
        # the encodings by name: those holding a policy and those made of them (a composed encoding's own name)
        named = [m for m in (model.modules() if isinstance(model, nn.Module) else ()) if isinstance(m, PositionalEncoding)
                 and (m.extrapolation_policies or any(h in holders for h in m.modules()))]
        raise ValueError(f"extrapolation={policy!r} is not valid for this model's encoding(s) "
                         f"{sorted({m.registry_name or type(m).__name__ for m in named})}; choose one of {list(valid)}{alias}"
                         f"{did_you_mean(policy, valid)}")
    for m in holders:
        m.extrapolation = policy
    for m in model.modules():
        if isinstance(m, PositionalEncoding):
            m.clear_cache()
    return model


def _init_params(cls: type) -> tuple[set[str], bool]:
    sig = inspect.signature(cls.__init__)
    names = {p.name for p in list(sig.parameters.values())[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    var_kw = any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values())
    return names, var_kw
