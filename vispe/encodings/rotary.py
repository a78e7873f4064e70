"""The one rotary application path shared by every pair-wise rotary encoding in vispe.

A rotary encoding assigns each token ``n`` and each rotation pair ``i`` an angle ``phi[n, i]``
(float32, computed with autocast off). Pairs are stored in one of two layouts:

* ``'interleaved'`` -- pair ``i`` is channels ``(2i, 2i+1)``: RoPE-ViT, EVA-02, timm's
  ``apply_rot_embed_cat`` (the ViT side of vispe uses this).
* ``'half'`` -- pair ``i`` is channels ``(i, i + P)``: the Qwen/HF LLM family (``rotate_half``).

Both layouts compute ``x' = x * cos(phi) + rot(x) * sin(phi)`` for each pair; the table is a
complex tensor ``exp(i*phi)`` so the rotation is a single complex multiply in float32, and the
result is cast back to the input dtype. Prefix tokens that must not rotate get ``phi = 0``,
i.e. an exact identity (``(a + ib)(1 + 0i)`` is bit-exact), so q/k never need slicing or
concatenation.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from .._checks import Int, Real, Seq
from .base import PositionalEncoding, save_as_recomputed, sdpa
from .grid import PositionGrid

__all__ = ["apply_rotary", "rotary_table", "RotaryEncoding", "RotaryState", "ROTARY_LAYOUTS", "LAYER_SCHEDULE_OPTIONS",
           "LayerSchedule", "ROTARY_BACKENDS"]

ROTARY_LAYOUTS = ("interleaved", "half")
#: How a pairwise rotary encoding rotates q and k (``rotary_backend``): ``'torch'``, PyTorch ops (the reference, any
#: device); ``'triton'``, one fused kernel from the qkv projection's output to attention's inputs and one back
#: (:mod:`vispe.encodings.triton_rotary`; CUDA, or CPU in Triton's interpreter).
ROTARY_BACKENDS = ("torch", "triton")


def rotary_table(angles: torch.Tensor) -> torch.Tensor:
    """``exp(i * angles)`` as complex64, computed in float32 regardless of autocast."""
    angles = angles.float()
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary(x: torch.Tensor, table: torch.Tensor, layout: str = "interleaved") -> torch.Tensor:
    """Rotate the last dimension of ``x`` (``(..., L, 2P)``) by a complex ``table`` (``(..., L, P)``), or by its
    real view ``(..., L, P, 2)`` (``torch.view_as_real``; what :meth:`RotaryState.rotation_table` gives under
    ``torch.compile``).

    The table broadcasts against ``x``'s leading dimensions (batch, heads). Math runs in float32;
    the output has ``x``'s dtype.
    """
    real = not table.is_complex()
    d = x.shape[-1]
    p = table.shape[-2] if real else table.shape[-1]
    if d != 2 * p:
        raise ValueError(f"rotary table has {p} pairs but the head dimension is {d} (needs {2 * p})")
    xf = x.float()
    if real or torch.compiler.is_compiling():
        # inductor generates no code for complex ops: the same rotation on real tensors fuses into one kernel
        return _apply_rotary_real(xf, table if real else torch.view_as_real(table), layout).type_as(x)
    if layout == "interleaved":
        xc = torch.view_as_complex(xf.reshape(*xf.shape[:-1], p, 2))
        out = torch.view_as_real(xc * table).flatten(-2)
    elif layout == "half":
        xc = torch.complex(xf[..., :p], xf[..., p:])
        r = xc * table
        # written in x's memory order (token-major for q/k sliced from a fused qkv), as the interleaved
        # layout's elementwise product is: SDPA's output then stays token-major and the head merge a view
        out = torch.empty_permuted((*r.shape[:-1], d), _memory_order(r), dtype=torch.float32, device=r.device)
        out[..., :p] = r.real
        out[..., p:] = r.imag
    else:
        raise ValueError(f"unknown rotary layout {layout!r}; choose one of {ROTARY_LAYOUTS}")
    return out.type_as(x)


def _memory_order(t: torch.Tensor) -> tuple[int, ...]:
    """The dimensions of ``t`` from outermost to innermost in memory (the last dimension last)."""
    lead = sorted(range(t.ndim - 1), key=lambda i: -t.stride(i) if t.shape[i] > 1 else 0)
    return (*lead, t.ndim - 1)


def _apply_rotary_real(xf: torch.Tensor, table_ri: torch.Tensor, layout: str) -> torch.Tensor:
    """``apply_rotary`` on real tensors: ``xf`` float32 ``(..., L, 2P)``, ``table_ri`` = ``view_as_real(table)`` ``(..., L, P, 2)``."""
    p = table_ri.shape[-2]
    c, s = table_ri[..., 0], table_ri[..., 1]
    if layout == "interleaved":
        x2 = xf.unflatten(-1, (p, 2))
        a, b = x2[..., 0], x2[..., 1]
        return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
    if layout == "half":
        a, b = xf[..., :p], xf[..., p:]
        return torch.cat([a * c - b * s, a * s + b * c], dim=-1)
    raise ValueError(f"unknown rotary layout {layout!r}; choose one of {ROTARY_LAYOUTS}")


@dataclass
class RotaryState:
    """Per-forward rotary tables: ``table`` is ``(L, P)``, ``(H, L, P)`` or ``(depth, H, L, P)``."""

    table: torch.Tensor
    per_layer: bool = False

    def __post_init__(self) -> None:
        # The tables of the layers as views, made once per state; plain attributes, not fields, so that anything
        # rebuilding the state from its fields (dataclasses.replace, FSDP's casting of a block's inputs) builds
        # them anew from the new table. Indexing the table per layer instead would give every use a backward that
        # writes a zero-filled gradient of the whole (depth, ...) table (select's backward: depth^2 work, and complex
        # ops inductor cannot fuse); unbind's backward stacks the layers' gradients once. The real views (..., P, 2)
        # are what the rotation reads under torch.compile, so its backward stays in real arithmetic.
        real = torch.view_as_real(self.table.resolve_conj())  # (a conjugate view has no real view of its own)
        self.layers: tuple[torch.Tensor, ...] = self.table.unbind(0) if self.per_layer else (self.table,)
        self.real_layers: tuple[torch.Tensor, ...] = real.unbind(0) if self.per_layer else (real,)

    def for_layer(self, layer: int) -> torch.Tensor:
        """The complex table ``(..., L, P)`` of ``layer`` (the shared table for every layer unless ``per_layer``)."""
        return self.layers[layer if self.per_layer else 0]

    def rotation_table(self, layer: int) -> torch.Tensor:
        """What :func:`apply_rotary` takes for ``layer``: :meth:`for_layer`, or its real view under torch.compile."""
        return (self.real_layers if torch.compiler.is_compiling() else self.layers)[layer if self.per_layer else 0]

    def select(self, index: torch.Tensor) -> "RotaryState":
        """Per-sample token rows ``index`` ``(B, n)``: tables become ``(B, 1|H, n, P)`` (``(depth, B, H, n, P)``)."""
        bsz, n = index.shape
        t = self.table.index_select(-2, index.reshape(-1)).unflatten(-2, (bsz, n))  # (..., B, n, P)
        if self.per_layer:
            t = t.movedim(-3, 1)
        elif t.ndim == 3:
            t = t.unsqueeze(1)
        else:
            t = t.movedim(-3, 0)
        return RotaryState(t, per_layer=self.per_layer)


# ---------------------------------------------------------------------------------------------
# Layer schedules: options every rotary encoding takes, applied here once (never per encoding)
# ---------------------------------------------------------------------------------------------

#: ``nope_layers``: layers whose attention gets no position (q and k unrotated); ``rotary_fraction``: the share of
#: each head's channels that rotate (transformers' ``partial_rotary_factor``: the first ``int(head_dim * f)``
#: channels, frequencies laid out for that width, the rest pass through); ``layer_theta``: one rotary base per layer.
LAYER_SCHEDULE_OPTIONS = ("nope_layers", "rotary_fraction", "layer_theta")


@dataclass(frozen=True)
class LayerSchedule:
    """What the layer-schedule options resolved to (the defaults: ``LayerSchedule()``, which changes nothing)."""

    nope_layers: frozenset[int] = frozenset()
    #: rotated channels per head (``None``: all of them)
    rotary_dim: int | None = None
    #: per layer, the index into the encoding's ``layer_theta_encodings`` (``None``: one base for every layer)
    theta_index: tuple[int, ...] | None = None


@dataclass
class LayerThetaState:
    """Per-layer rotary base: the state of each base's encoding and which one each layer uses."""

    states: tuple[Any, ...]
    index: tuple[int, ...]

    def for_layer(self, layer: int) -> Any:
        if not 0 <= layer < len(self.index):
            raise ValueError(f"layer_theta gives {len(self.index)} layers, attention asked for layer {layer}")
        return self.states[self.index[layer]]


def _schedule_error(owner: str, option: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{owner}: {option}={value!r} is not valid; {why}")


def _resolve_schedule(cls: type, owner: str, given: dict[str, Any], options: dict[str, Any], depth: int | None) -> LayerSchedule:
    """Check the given layer-schedule options against the class's support and the model (depth, head width)."""
    for opt, value in given.items():
        if value is not None and opt not in cls.layer_schedules and not (opt == "rotary_fraction" and value == 1):
            raise _schedule_error(owner, opt, value, f"{owner} supports the layer schedules {list(cls.layer_schedules)} only "
                                  f"(see {cls.__name__}.layer_schedules)")
    nope = given.get("nope_layers")
    nope_list = [int(i) for i in ([nope] if isinstance(nope, int) else (nope or ()))]
    if depth is None and any(i < 0 for i in nope_list):
        raise _schedule_error(owner, "nope_layers", nope, "a negative index counts from the last layer and needs the "
                              "model's depth (pass depth=, as host models do)")
    if depth is not None and any(not -depth <= i < depth for i in nope_list):
        raise _schedule_error(owner, "nope_layers", nope, f"the model has depth={depth}: layer indices 0..{depth - 1} "
                              f"(or -{depth}..-1 from the last)")
    nope_set = frozenset(i % depth if depth else i for i in nope_list)
    rotary_dim = None
    frac = given.get("rotary_fraction", 1.0)
    if frac is not None and frac != 1:
        head_dim = options.get("head_dim")
        if head_dim is None:
            raise _schedule_error(owner, "rotary_fraction", frac, f"{owner} takes no head_dim to cut")
        rotary_dim = int(head_dim * frac)  # transformers' rounding (int of the product)
        if rotary_dim < 2 or rotary_dim % 2:
            even = [f for f in (0.25, 0.5, 0.75, 1.0) if int(head_dim * f) % 2 == 0 and int(head_dim * f) >= 2]
            raise _schedule_error(owner, "rotary_fraction", frac, f"it rotates int(head_dim={head_dim} * {frac}) = {rotary_dim} "
                                  f"channels, which must be an even count >= 2 (e.g. rotary_fraction in {even})")
    theta_index = None
    thetas = given.get("layer_theta")
    if thetas is not None:
        thetas = tuple(float(t) for t in thetas)
        if cls.layer_theta_option not in options:
            raise _schedule_error(owner, "layer_theta", thetas, f"{owner} has no option {cls.layer_theta_option!r} to set per layer")
        if depth is not None and len(thetas) != depth:
            raise _schedule_error(owner, "layer_theta", thetas, f"give one base per layer: {depth} values (depth={depth})")
        distinct = sorted(set(thetas))
        theta_index = tuple(distinct.index(t) for t in thetas)
    return LayerSchedule(nope_set, rotary_dim, theta_index)


def _scheduled_init(init: Callable[..., None]) -> Callable[..., None]:
    """A rotary encoding's constructor that also takes the layer-schedule options (and the model's ``depth``, to
    check layer indices, where it takes none of its own). The encoding is built for the rotated width
    (``head_dim`` = the rotated channels), so its frequencies are those of a head that wide, as in transformers."""
    sig = inspect.signature(init)
    params = list(sig.parameters.values())
    names = {p.name for p in params}
    own_depth = "depth" in names
    kw_only = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=d) for n, d in
               ((("depth", None),) if not own_depth else ()) + (("nope_layers", None), ("rotary_fraction", 1.0), ("layer_theta", None))]
    var = [p for p in params if p.kind == p.VAR_KEYWORD]
    new_sig = sig.replace(parameters=[p for p in params if p.kind != p.VAR_KEYWORD] + kw_only + var)

    @functools.wraps(init)
    def __init__(self: "RotaryEncoding", *args: Any, **kwargs: Any) -> None:
        given = {o: kwargs.pop(o) for o in LAYER_SCHEDULE_OPTIONS if o in kwargs}
        depth = None if own_depth else kwargs.pop("depth", None)
        if not given:  # the defaults (or a subclass's constructor calling this one): nothing to schedule
            init(self, *args, **kwargs)
            return
        cls = type(self)
        owner = cls.registry_name or cls.__name__
        bound = sig.bind(self, *args, **kwargs)
        bound.apply_defaults()
        options = dict(bound.arguments)
        options.pop(params[0].name)
        if own_depth:
            depth = options.get("depth")
        schedule = _resolve_schedule(cls, owner, given, options, depth)
        built = dict(options)
        if schedule.rotary_dim is not None:
            built["head_dim"] = schedule.rotary_dim
        try:
            init(self, **built)
        except ValueError as e:
            if schedule.rotary_dim is None:
                raise
            raise ValueError(f"{owner}: with rotary_fraction={given['rotary_fraction']!r} the rotated width is "
                             f"{schedule.rotary_dim} of head_dim={options['head_dim']}: {e}") from None
        if schedule.theta_index is not None:
            if any(True for _ in self.parameters()):
                raise _schedule_error(owner, "layer_theta", given["layer_theta"],
                                      f"{owner} learns its rotations (its {cls.layer_theta_option!r} only initialises them)")
            if getattr(self, "augments_coordinates", False) or getattr(self, "random_positions", 1.0) > 1:
                # each base's encoding would draw its own coordinates: layers would see different positions
                raise _schedule_error(owner, "layer_theta", given["layer_theta"], "it cannot be combined with the "
                                      "coordinate options (coord_shift / coord_jitter / coord_rescale / random_positions)")
            thetas = sorted(set(float(t) for t in given["layer_theta"]))
            frac = given.get("rotary_fraction", 1.0)
            # one encoding per distinct base: a layer's rotation is exactly that of an encoding built with its base
            self.layer_theta_encodings = nn.ModuleList(
                [cls(**{**options, cls.layer_theta_option: t}, rotary_fraction=frac) for t in thetas])
        self.layer_schedule = schedule

    __init__.__signature__ = new_sig  # type: ignore[attr-defined]
    __init__._layer_schedule = True  # type: ignore[attr-defined]
    return __init__


def _scheduled_rotate_qk(fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """``rotate_qk`` under the encoding's layer schedule: nothing in a NoPE layer, the layer's base under
    ``layer_theta``, only the first ``rotary_dim`` channels under ``rotary_fraction``."""

    @functools.wraps(fn)
    def rotate_qk(self: "RotaryEncoding", q: torch.Tensor, k: torch.Tensor, state: Any, layer: int | None = None):
        sched = self.layer_schedule
        per_layer = bool(sched.nope_layers) or sched.theta_index is not None
        if layer is None:
            if per_layer:
                raise ValueError(f"{self.registry_name or type(self).__name__} has a per-layer schedule (nope_layers / "
                                 "layer_theta) but its host called rotate_qk without the layer index")
            layer = 0
        if layer in sched.nope_layers:
            return q, k
        if isinstance(state, LayerThetaState):
            state = state.for_layer(layer)
        r = sched.rotary_dim
        if r is None or q.shape[-1] == r:
            return fn(self, q, k, state, layer)
        qr, kr = fn(self, q[..., :r], k[..., :r], state, layer)
        return torch.cat([qr, q[..., r:]], dim=-1), torch.cat([kr, k[..., r:]], dim=-1)

    rotate_qk._layer_schedule = True  # type: ignore[attr-defined]
    return rotate_qk


def _scheduled_fold(fn: Callable[..., tuple[Any, Any]]) -> Callable[..., tuple[Any, Any]]:
    """``fold_qk_basis`` (a basis change folded into the q/k projection): not in a NoPE layer, nor on a partial
    head (the basis covers the rotated channels only); ``rotate_qk`` then rotates the unfolded q and k."""

    @functools.wraps(fn)
    def fold_qk_basis(self: "RotaryEncoding", state: Any, layer: int = 0):
        sched = self.layer_schedule
        if layer in sched.nope_layers or sched.rotary_dim is not None:
            return None, state
        return fn(self, state, layer)

    fold_qk_basis._layer_schedule = True  # type: ignore[attr-defined]
    return fold_qk_basis


class RotaryEncoding(PositionalEncoding):
    """Base for encodings that rotate q and k by per-pair angles.

    Subclasses implement :meth:`angles` (and optionally :meth:`prefix_angles`). This class
    builds the complex table once per forward for all layers, caches it per (grid, device)
    when no gradient flows through it, and rotates q and k before SDPA.
    """

    kind = "rotary"
    contract = "rotary"
    prefix_policy: ClassVar[str] = "prefix tokens are not rotated (identity rotation)"
    #: The rotation is a phase per channel pair given by :meth:`angles` (False: general block rotations).
    pairwise_phases: ClassVar[bool] = True
    #: Angle tables carry a leading ``depth`` dimension (one table per layer).
    per_layer: bool = False
    layout: str = "interleaved"
    #: The layer-schedule options (:data:`LAYER_SCHEDULE_OPTIONS`) this encoding supports; every rotary encoding's
    #: constructor takes all three and refuses the others by name.
    layer_schedules: ClassVar[tuple[str, ...]] = LAYER_SCHEDULE_OPTIONS
    #: The constructor option ``layer_theta`` sets per layer.
    layer_theta_option: ClassVar[str] = "theta"
    layer_schedule: LayerSchedule = LayerSchedule()
    backend_option = "rotary_backend"
    backend_choices = ROTARY_BACKENDS
    #: see :data:`ROTARY_BACKENDS`; a run-time choice (``create_encoding(name, rotary_backend=...)`` or
    #: :meth:`set_backend`), not a constructor option
    rotary_backend: str = "torch"
    option_checks = {
        "nope_layers": Seq(Int(), distinct=True, scalar_ok=True, optional=True),
        "rotary_fraction": Real(0, 1, low_open=True),
        "layer_theta": Seq(Real(0, low_open=True), min_length=1, optional=True),
    }

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # before the base class wraps the constructor with its option checks, so they see the schedule options
        init = cls.__dict__.get("__init__")
        if init is not None and not getattr(init, "_layer_schedule", False) and not getattr(init, "_validates_options", False):
            cls.__init__ = _scheduled_init(init)  # type: ignore[method-assign]
        for name, wrap in (("rotate_qk", _scheduled_rotate_qk), ("fold_qk_basis", _scheduled_fold)):
            fn = cls.__dict__.get(name)
            if fn is not None and not getattr(fn, "_layer_schedule", False):
                setattr(cls, name, wrap(fn))
        super().__init_subclass__(**kwargs)

    @classmethod
    def fuses_rotation(cls) -> bool:
        """``rotary_backend='triton'`` applies: the class rotates by this base class's per-pair phases, untouched, or
        says itself which layers do (:meth:`fused_phase_table`)."""
        base = RotaryEncoding
        if cls.attend is not base.attend or cls.attend_qkv is not base.attend_qkv:
            return False
        if cls.fused_phase_table is not base.fused_phase_table:
            return True
        return cls.pairwise_phases and cls.rotate is base.rotate and cls.rotate_qk is base.rotate_qk

    def check_backend_device(self, device: torch.device | str | None) -> None:
        """``rotary_backend='triton'`` on a device the kernel cannot run: refused in ``prepare``, before the first
        layer, rather than inside attention."""
        if self.rotary_backend == "triton" and not torch.compiler.is_compiling():
            from .triton_rotary import triton_rotary_unavailable

            why = triton_rotary_unavailable(device if device is not None else "cpu")
            if why is not None:
                raise ValueError(f"{self.registry_name or type(self).__name__}: rotary_backend='triton': {why}; "
                                 "choose rotary_backend='torch'")

    def fused_phase_table(self, state: Any, layer: int) -> torch.Tensor | None:
        """The real table ``(cos, sin)`` ``(..., L, P, 2)`` by which this layer rotates q and k (``apply_rotary`` in
        :attr:`layout`), what the fused kernel applies; ``None`` where the layer does something else (no rotation,
        a partial one, a per-layer base), which then runs in PyTorch ops."""
        sched = self.layer_schedule
        if not isinstance(state, RotaryState) or layer in sched.nope_layers or sched.rotary_dim is not None:
            return None
        return state.real_layers[layer if state.per_layer else 0]

    @classmethod
    def check_backend(cls, value: Any) -> None:
        super().check_backend(value)
        if value == "triton":
            if not cls.fuses_rotation():
                raise ValueError(f"rotary_backend='triton' fuses the per-pair phase rotation; {cls.__name__} rotates q and k "
                                 "its own way; choose rotary_backend='torch'")
            from .triton_rotary import triton_rotary_unavailable

            why = triton_rotary_unavailable()
            if why is not None:
                raise ValueError(f"rotary_backend='triton' needs Triton: {why}; choose rotary_backend='torch'")

    # -- to implement --------------------------------------------------------------------
    def angles(self, grid: PositionGrid, device: torch.device | None) -> torch.Tensor:
        """float32 angles ``(..., N, P)`` for the lattice tokens, leading dims ``()``, ``(H,)`` or ``(depth, H)``."""
        raise NotImplementedError

    def prefix_angles(self, grid: PositionGrid, device: torch.device | None) -> torch.Tensor | None:
        """Angles for prefix tokens (``(..., S, P)``), or ``None`` for the identity (no rotation)."""
        return None

    # -- shared machinery ----------------------------------------------------------------
    def build_state(self, grid: PositionGrid, device: torch.device | None) -> RotaryState:
        dev_type = torch.device(device).type if device is not None else "cpu"
        with torch.autocast(device_type=dev_type, enabled=False):
            ang = self.angles(grid, device).float()
            s = grid.num_prefix_tokens
            if s:
                pre = self.prefix_angles(grid, device)
                if pre is None:
                    pre = ang.new_zeros(*ang.shape[:-2], s, ang.shape[-1])
                else:
                    pre = pre.float().expand(*ang.shape[:-2], s, ang.shape[-1])
                ang = torch.cat([pre, ang], dim=-2)
            table = rotary_table(ang)
        return RotaryState(table, per_layer=self.per_layer)

    def prepare(self, grid: PositionGrid, device: torch.device | None = None) -> RotaryState | LayerThetaState:
        self.check_grid(grid)
        self.check_backend_device(device)
        per_theta = self._modules.get("layer_theta_encodings")
        if per_theta is not None:
            return LayerThetaState(tuple(e.prepare(grid, device) for e in per_theta), self.layer_schedule.theta_index)
        key = ("rotary", grid.shape, grid.num_prefix_tokens, str(device))
        return self.cached(key, lambda: self.build_state(grid, device), uses_parameters=True)

    def keep_tokens(self, state: RotaryState | LayerThetaState, grid: PositionGrid) -> RotaryState | LayerThetaState:
        if isinstance(state, LayerThetaState):
            return replace(state, states=tuple(e.keep_tokens(s, grid) for e, s in zip(self._modules["layer_theta_encodings"], state.states)))
        return state.select(grid.sequence_index())

    def rotate(self, x: torch.Tensor, state: RotaryState, layer: int = 0) -> torch.Tensor:
        return apply_rotary(x, state.rotation_table(layer), self.layout)

    @_scheduled_rotate_qk
    def rotate_qk(self, q: torch.Tensor, k: torch.Tensor, state: Any, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate one layer's q and k (one call, so a family that rotates the pair jointly, as ComRoPE's
        block rotations do, overrides this and nothing else of the attention path). Every override runs under
        the layer schedule (:data:`LAYER_SCHEDULE_OPTIONS`), applied here and not in the override."""
        return self.rotate(q, state, layer), self.rotate(k, state, layer)

    def attend(self, q, k, v, *, layer=0, state=None, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        if state is None or layer in self.layer_schedule.nope_layers:
            return sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale)
        q0, k0 = q, k
        q, k = self.rotate_qk(q0, k0, state, layer)
        # SDPA would keep the rotated q/k for backward; re-rotating the unrotated ones is cheaper than the memory
        with save_as_recomputed((q, k), lambda: self.rotate_qk(q0, k0, state, layer)):
            return sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale)

    def attend_qkv(self, qkv, *, layer=0, state=None, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        table = self.fused_phase_table(state, layer) if self.rotary_backend == "triton" and state is not None else None
        if table is None:
            return super().attend_qkv(qkv, layer=layer, state=state, attn_mask=attn_mask, dropout_p=dropout_p,
                                      is_causal=is_causal, scale=scale)
        from .triton_rotary import rotary_qkv

        # attention keeps the kernel's outputs for its backward, as it keeps timm's q, k, v: nothing to recompute
        q, k, v = rotary_qkv(qkv, table, self.layout)
        return sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale)
