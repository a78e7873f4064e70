"""Any vispe multimodal position scheme in Hugging Face ``transformers`` Qwen2-VL / Qwen2.5-VL.

    from vispe.integrations.hf import apply_position_scheme
    model = apply_position_scheme(model, "hope", gamma=0.75)   # model: Qwen2(_5)VLForConditionalGeneration

The patch is per model instance (nothing in ``transformers`` is modified) and leaves the
``state_dict`` unchanged. It replaces two things:

* ``model.model.get_rope_index`` -> :func:`vispe.positions.build_positions` on the segments read
  from ``input_ids`` (or ``mm_token_type_ids``) and ``image_grid_thw`` / ``video_grid_thw``
  (Qwen2.5-VL + ``mrope``: absolute time from ``second_per_grid_ts`` and the vision config's
  ``tokens_per_second``). ``rope_deltas`` follows the installed version's convention, so the
  model's own cached-decoding path (``generate``) continues every scheme correctly.
* the text model's ``rotary_emb`` -> the scheme's rotary table from
  :mod:`vispe.encodings.multimodal_rope` (pair->axis map and frequencies: MRoPE-Interleave's
  round robin, HoPE's zero-frequency temporal pairs, ...) on the model's own inverse-frequency
  ladder, handed to the attention as HF's ``cos`` / ``sin``. MHRoPE's table differs per KV head,
  which HF's shared ``cos`` / ``sin`` cannot carry: there HF's rotation is made the identity and
  forward hooks on every attention's ``q_proj`` / ``k_proj`` apply vispe's per-head rotation.

Positions travel through HF in its usual three rows: one-coordinate schemes (``rope_1d``, ``v2pe``)
repeat their coordinate; VRoPE's four diagonals satisfy ``c0 + c3 = c1 + c2``, so rows
``(c0, c1, c2)`` carry them exactly and the rotary rebuilds ``c3``. HF's 4-row generation layout,
its ``rope_deltas`` decode and its text-only default positions therefore work unchanged; a text
token has equal rows, so text-only input gets 1D RoPE for every scheme (HoPE: 1D RoPE on its
non-temporal pairs, identity on the zero-frequency ones).
"""
from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..encodings import EncodingContext, create_encoding
from ..encodings.multimodal_rope import MultimodalRotary
from ..encodings.rotary import apply_rotary
from ..positions import NUM_COORDS, POSITION_SCHEMES, Segment, Text, Visual, build_positions, get_scheme

__all__ = [
    "SUPPORTED_MODELS",
    "TRANSFORMERS_REQUIREMENT",
    "VispeRotaryEmbedding",
    "apply_position_scheme",
    "check_transformers_version",
    "position_coordinates",
    "remove_position_scheme",
]

#: The tested range (keep in sync with the ``hf`` extra in pyproject.toml).
TRANSFORMERS_REQUIREMENT = "transformers>=4.57,<6"
_MIN_VERSION, _MAX_VERSION = (4, 57), (6, 0)
SUPPORTED_MODELS = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
#: Options that configure the rotary table (the rest go to the position builder).
def rotary_options(scheme: str) -> tuple[str, ...]:
    """Options of the scheme's rotary encoding that apply in an HF model (its frequency layout: sections,
    HoPE's temporal pairs); the rotary base and pair layout are the model's own."""
    from ..encodings import get_encoding_class

    sig = inspect.signature(get_encoding_class(scheme).__init__)
    return tuple(p for p in list(sig.parameters)[1:] if p not in ("head_dim", "num_heads", "depth", "theta", "layout"))


def check_transformers_version() -> str:
    """The installed ``transformers`` version; ``ImportError`` naming the supported range otherwise."""
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(f"vispe.integrations.hf needs Hugging Face transformers: pip install 'vispe[hf]' ({TRANSFORMERS_REQUIREMENT})") from e
    from packaging.version import Version

    version = transformers.__version__
    release = Version(version).release[:2]
    if not _MIN_VERSION <= release < _MAX_VERSION:
        raise ImportError(
            f"transformers {version} is not supported by vispe.integrations.hf; supported range: {TRANSFORMERS_REQUIREMENT} "
            "(install it with pip install 'vispe[hf]')"
        )
    return version


# ---------------------------------------------------------------------------------------------
# positions <-> HF's three rows
# ---------------------------------------------------------------------------------------------


def _to_rows(pos: torch.Tensor) -> torch.Tensor:
    """vispe positions ``(K, ...)`` -> HF's three rows ``(3, ...)``."""
    if pos.shape[0] == 1:
        return pos.expand(3, *pos.shape[1:])
    if pos.shape[0] == 4:  # VRoPE: c3 = c1 + c2 - c0 is implied
        return pos[:3]
    return pos


def position_coordinates(position_ids: torch.Tensor, scheme: str) -> torch.Tensor:
    """HF position ids (``(3, B, L)``, ``(B, L)`` or ``(1, B, L)``) -> the scheme's ``(K, B, L)`` coordinates."""
    if scheme not in NUM_COORDS:
        raise ValueError(f"unknown position scheme {scheme!r}; choose one of {list(POSITION_SCHEMES)}")
    p = position_ids
    if p.ndim == 2:
        p = p[None]
    if p.ndim != 3 or p.shape[0] not in (1, 3):
        raise ValueError(f"position_ids must be (3, B, L), (1, B, L) or (B, L); got {tuple(position_ids.shape)}")
    if p.shape[0] == 1:
        p = p.expand(3, -1, -1)
    k = NUM_COORDS[scheme]
    if k == 1:
        return p[:1]
    if k == 4:
        return torch.cat([p, (p[1] + p[2] - p[0])[None]], dim=0)
    return p


# ---------------------------------------------------------------------------------------------
# the rotary module and MHRoPE's per-head hooks
# ---------------------------------------------------------------------------------------------


def _model_ladder(ladder: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    return ladder.to(device)


class VispeRotaryEmbedding(nn.Module):
    """Stands in for a Qwen2-VL text model's ``rotary_emb``: ``forward(x, position_ids) -> (cos, sin)``
    from a vispe :class:`~vispe.encodings.multimodal_rope.MultimodalRotary` table.

    ``stacked=True`` returns ``(3, B, L, d)`` (transformers versions whose attention recombines the
    sections itself; every row is the same table), else ``(B, L, d)``. A per-head encoding
    (MHRoPE) returns the identity and keeps its table in ``last_table`` for the q/k hooks.
    """

    def __init__(self, encoding: MultimodalRotary, scheme: str, original: nn.Module, stacked: bool) -> None:
        super().__init__()
        self.encoding = encoding
        self.scheme = scheme
        self.stacked = stacked
        self.per_head = encoding.axis_map().ndim == 2
        self.attention_scaling = float(getattr(original, "attention_scaling", 1.0) or 1.0)
        self.register_buffer("inv_freq", original.inv_freq.detach().clone(), persistent=False)
        self.rope_type = "default"
        self.config = getattr(original, "config", None)
        self.last_table: torch.Tensor | None = None

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        coords = position_coordinates(position_ids.to(x.device), self.scheme)
        table = self.encoding.table_from_positions(coords)  # (B, 1 | H_kv, L, P) complex64
        B, L = table.shape[0], table.shape[2]
        d = 2 * table.shape[-1]
        if self.per_head:
            self.last_table = table
            cos = torch.ones(B, L, d, device=x.device)
            sin = torch.zeros(B, L, d, device=x.device)
        else:
            t = table[:, 0]
            cos = torch.cat([t.real, t.real], dim=-1) * self.attention_scaling
            sin = torch.cat([t.imag, t.imag], dim=-1) * self.attention_scaling
        if self.stacked:
            cos, sin = cos[None].expand(3, -1, -1, -1), sin[None].expand(3, -1, -1, -1)
        return cos.to(x.dtype), sin.to(x.dtype)

    def extra_repr(self) -> str:
        return f"scheme={self.scheme!r}, per_head={self.per_head}, stacked={self.stacked}"


def _per_head_rotation(rotary: VispeRotaryEmbedding, repeats: int, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """Forward hook on ``q_proj`` / ``k_proj``: rotate each head by its own table (``(B, L, H*d)`` in and out)."""
    table = rotary.last_table
    B, L, _ = output.shape
    if table is None or table.shape[-2] != L:
        raise RuntimeError("MHRoPE hook: no rotary table for this forward (the attention ran outside the patched text model)")
    if repeats > 1:  # query head i uses key head i // repeats (HF's repeat_kv)
        table = table.repeat_interleave(repeats, dim=1)
    x = output.view(B, L, table.shape[1], -1).transpose(1, 2)
    return apply_rotary(x, table, "half").transpose(1, 2).reshape(B, L, -1)


# ---------------------------------------------------------------------------------------------
# get_rope_index
# ---------------------------------------------------------------------------------------------


@dataclass
class _Patch:
    scheme: str
    position_options: dict[str, Any]
    rotary: VispeRotaryEmbedding
    original_rotary: nn.Module
    signature: inspect.Signature
    spatial_merge_size: int
    image_token_id: int
    video_token_id: int
    tokens_per_second: float | None  # Qwen2.5-VL absolute time (mrope only)
    pad_value: int
    padded_deltas: bool  # rope_deltas relative to the padded length (older versions) or to the real tokens
    hooks: list = field(default_factory=list)

    def builder_options(self, training: bool) -> dict[str, Any]:
        rec = get_scheme(self.scheme)
        kw = rec.builder_options(self.position_options, training)
        if rec.qwen2vl_native and self.tokens_per_second is not None:
            kw.setdefault("tokens_per_second", self.tokens_per_second)
        return kw


def _row_segments(types: list[int], grids: dict[int, Iterator], times: Iterator, timed: bool, m: int) -> list[Segment]:
    """Segments of one sample from its token types (0 text, 1 image, 2 video), consuming grids in order."""
    segs: list[Segment] = []
    for kind, run in itertools.groupby(types):
        n = len(list(run))
        if kind == 0:
            segs.append(Text(n))
            continue
        what = "image" if kind == 1 else "video"
        while n > 0:  # adjacent blocks of one modality form one run
            try:
                t, h, w = (int(v) for v in next(grids[kind]))
            except (StopIteration, TypeError):
                raise ValueError(f"more {what} tokens in input_ids than {what}_grid_thw rows describe") from None
            count = t * h * w // (m * m)
            if count > n:
                raise ValueError(f"{what} grid (t={t}, h={h}, w={w}) needs {count} tokens but its run of {what} tokens has {n} left")
            spg = None
            if kind == 2 and timed:
                spg = float(next(times))
            segs.append(Visual(t, h, w, spg))
            n -= count
    return segs


def _vispe_get_rope_index(model: nn.Module, patch: _Patch, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    a = patch.signature.bind_partial(*args, **kwargs).arguments
    extra = a.pop("kwargs", {}) if "kwargs" in a else {}
    a.update(extra)
    input_ids = a.get("input_ids")
    if input_ids is None:
        raise ValueError("get_rope_index needs input_ids to locate image / video tokens")
    B, L = input_ids.shape
    device = input_ids.device
    mask = a.get("attention_mask")
    mask = torch.ones(B, L, dtype=torch.bool, device=device) if mask is None else mask.to(device).bool()
    types = a.get("mm_token_type_ids")
    if types is None:
        types = (input_ids == patch.image_token_id).long() + 2 * (input_ids == patch.video_token_id).long()
    grids = {k: iter(g.tolist()) if g is not None else iter(()) for k, g in ((1, a.get("image_grid_thw")), (2, a.get("video_grid_thw")))}
    spg = a.get("second_per_grid_ts")
    timed = get_scheme(patch.scheme).qwen2vl_native and patch.tokens_per_second is not None
    times = iter(spg.tolist()) if spg is not None else itertools.repeat(1.0)  # HF's default: 1 s per temporal patch
    options = patch.builder_options(model.training)
    built = []
    for b in range(B):
        segs = _row_segments(types[b][mask[b]].tolist(), grids, times, timed, patch.spatial_merge_size)
        built.append(build_positions(patch.scheme, segs, spatial_merge_size=patch.spatial_merge_size, **options))
    dtype = torch.float32 if any(p.dtype.is_floating_point for p, _ in built) else torch.int64
    rows = torch.full((3, B, L), patch.pad_value, dtype=dtype, device=device)
    deltas = torch.empty(B, 1, dtype=torch.float64)
    for b, (pos, delta) in enumerate(built):
        rows[:, b, mask[b]] = _to_rows(pos).to(device, dtype)
        # vispe: delta = next_free - real length; older versions count from the padded length
        deltas[b, 0] = float(delta) + (pos.shape[1] - L if patch.padded_deltas else 0)
    return rows, deltas.to(device=device, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# apply / remove
# ---------------------------------------------------------------------------------------------


def _check_model(model: nn.Module) -> None:
    names = [c.__name__ for c in type(model).__mro__]
    if not any(n in SUPPORTED_MODELS for n in names):
        raise TypeError(f"apply_position_scheme supports {list(SUPPORTED_MODELS)} (and subclasses), got {type(model).__name__}")
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "get_rope_index") or not hasattr(getattr(inner, "language_model", None), "rotary_emb"):
        raise TypeError(f"{type(model).__name__} does not have the model.get_rope_index / model.language_model.rotary_emb layout of {TRANSFORMERS_REQUIREMENT}")


def _probe_conventions(original: Any, signature: inspect.Signature, config: Any, m: int) -> tuple[int, bool]:
    """Ask the installed get_rope_index for its pad value and rope_deltas base on a left-padded one-image sample."""
    vs, img = config.vision_start_token_id, config.image_token_id
    ve = getattr(config, "vision_end_token_id", vs)
    ids = torch.tensor([[0, vs, img, ve, 0]])
    kw: dict[str, Any] = {"input_ids": ids, "image_grid_thw": torch.tensor([[1, m, m]]), "attention_mask": torch.tensor([[0, 1, 1, 1, 1]])}
    if "mm_token_type_ids" in signature.parameters:
        kw["mm_token_type_ids"] = (ids == img).long()
    pos, delta = original(**kw)
    d = int(torch.as_tensor(delta).reshape(-1)[0])
    if d not in (0, -1):  # real tokens sit at 0..3: next free 4, real length 4, padded length 5
        raise RuntimeError(f"unrecognised rope_deltas convention in this transformers version (probe gave {d}); supported: {TRANSFORMERS_REQUIREMENT}")
    return int(pos[0, 0, 0]), d == -1


def _mrope_section(config: Any) -> list[int] | None:
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(config, name, None)
        if isinstance(params, dict) and params.get("mrope_section") is not None:
            return [int(s) for s in params["mrope_section"]]
    return None


def apply_position_scheme(model: nn.Module, scheme: str, **options: Any) -> nn.Module:
    """Switch a Qwen2-VL / Qwen2.5-VL model to a vispe position scheme (in place; returns the model).

    Args:
        model: ``Qwen2VLForConditionalGeneration`` or ``Qwen2_5_VLForConditionalGeneration``.
        scheme: one of ``rope_1d, mrope, mrope_interleave, mhrope, vrope, hope, v2pe, videorope, qwen3vl``.
        **options: rotary options (``mrope_section`` for ``mrope`` / ``mrope_interleave`` /
            ``mhrope`` -- pairs, or KV heads for ``mhrope``; ``mrope`` defaults to the model's own;
            ``temporal_pairs`` for ``hope``) and position options of
            :func:`vispe.positions.build_positions` (``gamma``, ``delta``, ``spatial_reset``,
            ``temporal_stride``, ``time_floor``, ...). HoPE's ``gamma`` / V2PE's ``delta`` are drawn
            per visual block while ``model.training`` and fixed (the option, default 1) in eval mode.

    Calling it again switches scheme; :func:`remove_position_scheme` restores the model's own code.
    """
    check_transformers_version()
    if scheme not in NUM_COORDS:
        raise ValueError(f"unknown position scheme {scheme!r}; choose one of {list(POSITION_SCHEMES)}")
    _check_model(model)
    remove_position_scheme(model)
    inner = model.model
    text_model = inner.language_model
    original_rotary = text_model.rotary_emb
    config = model.config
    tcfg = getattr(config, "text_config", config)
    vcfg = config.vision_config
    rope_type = getattr(original_rotary, "rope_type", "default")
    if rope_type not in ("default", "mrope"):
        raise NotImplementedError(f"rope_type={rope_type!r} is not supported by apply_position_scheme; supported: 'default' (plain theta ladder)")
    num_heads = int(tcfg.num_attention_heads)
    num_kv = int(getattr(tcfg, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(tcfg, "head_dim", None) or tcfg.hidden_size // num_heads)
    m = int(vcfg.spatial_merge_size)

    options = dict(options)
    rotary_kw = {k: options.pop(k) for k in rotary_options(scheme) if k in options}
    if get_scheme(scheme).qwen2vl_native and "mrope_section" not in rotary_kw and _mrope_section(tcfg) is not None:
        rotary_kw["mrope_section"] = _mrope_section(tcfg)
    context = EncodingContext(dim=head_dim * num_kv, num_heads=num_kv, depth=int(tcfg.num_hidden_layers), grid_size=(1, 1, 1), num_prefix_tokens=0)
    encoding = create_encoding(scheme, context, **rotary_kw)
    ladder = original_rotary.inv_freq.detach().float().clone()
    if ladder.shape != (head_dim // 2,):
        raise ValueError(f"the model's rotary inv_freq has shape {tuple(ladder.shape)}, expected ({head_dim // 2},) for head_dim={head_dim}")
    # the model's own ladder (its theta, bit-identical to HF's) instead of vispe's recomputation
    encoding.inv_freq = functools.partial(_model_ladder, ladder)  # type: ignore[method-assign]

    tokens_per_second = getattr(vcfg, "tokens_per_second", None)
    is_qwen25 = any(c.__name__ == "Qwen2_5_VLForConditionalGeneration" for c in type(model).__mro__)
    original_index = inner.get_rope_index
    signature = inspect.signature(original_index)
    pad_value, padded_deltas = _probe_conventions(original_index, signature, config, m)
    with torch.no_grad():
        probe_cos, _ = original_rotary(torch.zeros(1, 1), torch.zeros(3, 1, 1, dtype=torch.long))
    rotary = VispeRotaryEmbedding(encoding, scheme, original_rotary, stacked=probe_cos.ndim == 4).to(ladder.device)
    patch = _Patch(
        scheme=scheme,
        position_options=options,
        rotary=rotary,
        original_rotary=original_rotary,
        signature=signature,
        spatial_merge_size=m,
        image_token_id=int(config.image_token_id),
        video_token_id=int(config.video_token_id),
        tokens_per_second=float(tokens_per_second) if (is_qwen25 and tokens_per_second is not None) else None,
        pad_value=pad_value,
        padded_deltas=padded_deltas,
    )
    # bad position options fail here, not at the first forward
    build_positions(scheme, [Text(1), Visual(2, m, m, 1.0 if patch.tokens_per_second else None), Text(1)],
                    spatial_merge_size=m, **patch.builder_options(False))
    text_model.rotary_emb = rotary
    if rotary.per_head:
        for layer in text_model.layers:
            attn = layer.self_attn
            patch.hooks.append(attn.q_proj.register_forward_hook(functools.partial(_per_head_rotation, rotary, num_heads // num_kv)))
            patch.hooks.append(attn.k_proj.register_forward_hook(functools.partial(_per_head_rotation, rotary, 1)))
    inner.get_rope_index = functools.partial(_vispe_get_rope_index, inner, patch)
    inner.rope_deltas = None
    model._vispe_position_patch = patch
    return model


def remove_position_scheme(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_position_scheme` (no-op on an unpatched model)."""
    patch: _Patch | None = getattr(model, "_vispe_position_patch", None)
    if patch is None:
        return model
    for h in patch.hooks:
        h.remove()
    model.model.language_model.rotary_emb = patch.original_rotary
    if "get_rope_index" in vars(model.model):
        del model.model.get_rope_index
    model.model.rope_deltas = None
    del model._vispe_position_patch
    return model
