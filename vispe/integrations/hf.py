"""Any vispe multimodal position scheme in Hugging Face ``transformers`` vision-language models.

    from vispe.integrations.hf import apply_position_scheme
    model = apply_position_scheme(model, "hope", gamma=0.75)

Supported (:data:`MODEL_FAMILIES`; the ``…ForConditionalGeneration`` and the bare ``…Model`` class of each):
Qwen2-VL, Qwen2.5-VL, Qwen3-VL (dense, MoE), Qwen3.5 (dense, MoE) and GLM-4V (dense, MoE).

The patch is per model instance and leaves the ``state_dict`` unchanged. The model's own scheme without
rotary options keeps the model's own rotary (any section, ``rope_type`` and buffer, as transformers runs them)
and takes its ids from vispe's builder by the installed transformers' rule. Otherwise it replaces two things:

* ``get_rope_index`` of the inner model -> :func:`vispe.positions.build_positions` on the segments
  read from ``input_ids`` (or ``mm_token_type_ids``) and ``image_grid_thw`` / ``video_grid_thw``
  (Qwen2.5-VL + ``mrope``: absolute time from ``second_per_grid_ts`` and the vision config's
  ``tokens_per_second``). Qwen3-VL, Qwen3.5 and GLM-4V write each temporal patch of a video as its own
  ``(1, H, W)`` block between timestamp text, so there a video reaches the scheme as those blocks.
  ``rope_deltas`` follows the installed version's convention, so the model's own cached-decoding path
  (``generate``) continues every scheme correctly.
* the text model's ``rotary_emb`` -> the scheme's rotary table from
  :mod:`vispe.encodings.multimodal_rope` (pair->axis map and frequencies) on the model's own
  inverse-frequency ladder, over the rotated part of each head only (``partial_rotary_factor``:
  Qwen3.5, GLM-4V), in the model's pair layout (rotate-half for Qwen, interleaved pairs for GLM),
  handed to the attention as HF's ``cos`` / ``sin``. MHRoPE's table differs per KV head, which HF's
  shared ``cos`` / ``sin`` cannot carry: there HF's rotation is made the identity and forward hooks on
  every attention's ``q_proj`` / ``k_proj`` (``q_norm`` / ``k_norm`` where the model normalises heads
  before rotating) apply vispe's per-head rotation.

Positions travel through HF in its usual three rows: one-coordinate schemes (``rope_1d``, ``v2pe``)
repeat their coordinate; VRoPE's four diagonals satisfy ``c0 + c3 = c1 + c2``, so rows
``(c0, c1, c2)`` carry them exactly and the rotary rebuilds ``c3``. HF's 4-row generation layout,
its ``rope_deltas`` decode and its text-only default positions therefore work unchanged; a text
token has equal rows, so text-only input gets 1D RoPE for every scheme (HoPE: 1D RoPE on its
non-temporal pairs, identity on the zero-frequency ones).

The scheme and its options are recorded in ``model.config`` (``vispe_position_scheme``). ``save_pretrained`` of
a switched model writes transformers' custom-code layout (:mod:`vispe.integrations.hf_hub`), so it loads switched
(``trust_remote_code=True``, or with this module imported: it registers the classes with the Auto classes and makes
``from_pretrained`` of the supported classes restore a recorded scheme or refuse naming it) and otherwise fails
with transformers' own errors instead of loading the unswitched model.

:func:`text_rotary_schedule` reads the per-layer rotary of other text models' configs (NoPE layers, partial rotary and
base per layer or layer type, M-RoPE sections: Muse Glimmer, NeoMME, Step3p7, HY-V4-VL) into vispe's layer-schedule
options; :class:`ScheduledTextRotary` turns each layer's q / k by it as the model's attention does.
"""
from __future__ import annotations

import functools
import inspect
import itertools
import json
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
    "CONFIG_KEY",
    "DYNAMIC_ROPE_TYPES",
    "MODEL_FAMILIES",
    "SUPPORTED_MODELS",
    "TRANSFORMERS_REQUIREMENT",
    "ModelFamily",
    "ScheduledTextRotary",
    "TextRotarySchedule",
    "VispeRotaryEmbedding",
    "apply_position_scheme",
    "check_transformers_version",
    "from_pretrained",
    "model_family",
    "position_coordinates",
    "recorded_scheme",
    "remove_position_scheme",
    "restore_position_scheme",
    "scheme_of",
    "text_rotary_schedule",
]

#: The tested range (keep in sync with the ``hf`` extra in pyproject.toml); families may need more (``min_version``).
TRANSFORMERS_REQUIREMENT = "transformers>=4.57,<6"
_MIN_VERSION, _MAX_VERSION = (4, 57), (6, 0)
#: Where ``apply_position_scheme`` records the scheme in ``model.config`` (and so in ``config.json``).
CONFIG_KEY = "vispe_position_scheme"


@dataclass(frozen=True)
class ModelFamily:
    """What the integration needs to know about one HF model family.

    Attributes:
        name: transformers' model type.
        classes: the ``…ForConditionalGeneration`` and bare ``…Model`` class names.
        native_scheme: the vispe scheme the model ships with (applying it reproduces the unpatched model).
        min_version: the first transformers release with the family (the tested lower end).
        frames_as_blocks: every temporal patch of a video is its own ``(1, H, W)`` block between timestamp
            text (``video_grid_thw`` rows are split into ``T`` one-patch grids, as the model's own code does).
        video_between_markers: video frames use the image token between ``video_start`` / ``video_end``
            tokens (GLM-4V), read when ``mm_token_type_ids`` is not given.
        absolute_time: ``mrope`` places video patches by ``second_per_grid_ts`` x ``tokens_per_second``.
        pair_layout: which channels of a head form a rotation pair in the attention: ``'half'`` ``(i, i + d/2)``
            or ``'interleaved'`` ``(2i, 2i+1)`` (GLM-4V's ``rotate_half_llm``; GLM-4V-MoE rotates halves).
    """

    name: str
    classes: tuple[str, str]
    native_scheme: str
    min_version: tuple[int, int]
    frames_as_blocks: bool = False
    video_between_markers: bool = False
    absolute_time: bool = False
    pair_layout: str = "half"


#: Supported families, in the order the docs list them.
MODEL_FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("qwen2_vl", ("Qwen2VLForConditionalGeneration", "Qwen2VLModel"), "mrope", (4, 57)),
    ModelFamily("qwen2_5_vl", ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLModel"), "mrope", (4, 57), absolute_time=True),
    ModelFamily("qwen3_vl", ("Qwen3VLForConditionalGeneration", "Qwen3VLModel"), "qwen3vl", (4, 57), frames_as_blocks=True),
    ModelFamily("qwen3_vl_moe", ("Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeModel"), "qwen3vl", (4, 57), frames_as_blocks=True),
    ModelFamily("qwen3_5", ("Qwen3_5ForConditionalGeneration", "Qwen3_5Model"), "qwen3vl", (5, 2), frames_as_blocks=True),
    ModelFamily("qwen3_5_moe", ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeModel"), "qwen3vl", (5, 2), frames_as_blocks=True),
    ModelFamily("glm4v", ("Glm4vForConditionalGeneration", "Glm4vModel"), "mrope", (4, 57), frames_as_blocks=True, video_between_markers=True,
                pair_layout="interleaved"),
    ModelFamily("glm4v_moe", ("Glm4vMoeForConditionalGeneration", "Glm4vMoeModel"), "mrope", (4, 57), frames_as_blocks=True,
                video_between_markers=True),
)
SUPPORTED_MODELS = tuple(c for f in MODEL_FAMILIES for c in f.classes)


def rotary_options(scheme: str) -> tuple[str, ...]:
    """Options of the scheme's rotary encoding that apply in an HF model (its frequency layout: sections,
    HoPE's temporal pairs); the rotary base and pair layout are the model's own."""
    from ..encodings import get_encoding_class

    sig = inspect.signature(get_encoding_class(scheme).__init__)
    return tuple(p for p in list(sig.parameters)[1:] if p not in ("head_dim", "num_heads", "depth", "theta", "layout"))


def _version_text(v: tuple[int, int]) -> str:
    return f"{v[0]}.{v[1]}"


def check_transformers_version(family: ModelFamily | None = None) -> str:
    """The installed ``transformers`` version; ``ImportError`` naming the supported range (of ``family``) otherwise."""
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
    if family is not None and release < family.min_version:
        raise ImportError(
            f"{family.name} needs transformers>={_version_text(family.min_version)},<6 (the first release with the model); "
            f"installed: {version}"
        )
    return version


def model_family(model: nn.Module) -> ModelFamily:
    """The :class:`ModelFamily` of a model (its class or a subclass); ``TypeError`` listing the supported classes otherwise."""
    for cls in type(model).__mro__:
        for fam in MODEL_FAMILIES:
            if cls.__name__ in fam.classes:
                return fam
    raise TypeError(f"apply_position_scheme supports {list(SUPPORTED_MODELS)} (and subclasses), got {type(model).__name__}")


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


def _rotary_ladder(rotary: nn.Module, device: torch.device | str | None = None) -> torch.Tensor:
    """The model's own inverse-frequency ladder (its theta, partial rotary and static scaling), read from the rotary's
    ``inv_freq`` buffer at every call so that ``init_weights`` refilling the buffer takes effect."""
    return rotary.inv_freq.to(device=device, dtype=torch.float32)


#: rope_type values whose rotary recomputes its frequencies from the sequence length in ``forward``
#: (transformers' ``dynamic_rope_update``): only the model's own rotary can follow them.
DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


class VispeRotaryEmbedding(nn.Module):
    """Stands in for the text model's ``rotary_emb``: ``forward(x, position_ids) -> (cos, sin)`` from a vispe
    :class:`~vispe.encodings.multimodal_rope.MultimodalRotary` table over the rotated channels of a head.

    ``stacked=True`` returns ``(3, B, L, d)`` (transformers versions whose attention recombines the
    sections itself; every row is the same table), else ``(B, L, d)``. ``output_layout`` is the order
    the model's own rotary returns (``'half'``: ``cos`` of pair ``i`` at channels ``i`` and ``i + d/2``;
    ``'interleaved'``: at ``2i`` and ``2i+1``), which its attention expects; ``pair_layout`` is which
    channels the attention rotates together (used by MHRoPE's hooks). A per-head encoding (MHRoPE)
    returns the identity and keeps its table in ``last_table`` for the q/k hooks.
    """

    def __init__(self, encoding: MultimodalRotary, scheme: str, original: nn.Module, stacked: bool, pair_layout: str = "half",
                 output_layout: str = "half") -> None:
        super().__init__()
        self.encoding = encoding
        self.scheme = scheme
        self.stacked = stacked
        self.pair_layout = pair_layout
        self.output_layout = output_layout
        self.per_head = encoding.axis_map().ndim == 2
        self.attention_scaling = float(getattr(original, "attention_scaling", 1.0) or 1.0)
        # the model's ladder as buffers under the names (and with the rope_type / config / init function) transformers'
        # init_weights rebuilds for every "...RotaryEmbedding" module; the encoding reads inv_freq at each call
        self.register_buffer("inv_freq", original.inv_freq.detach().clone(), persistent=False)
        if "original_inv_freq" in dict(original.named_buffers(recurse=False)):  # a buffer on 5.x, an attribute on 4.57
            self.register_buffer("original_inv_freq", original.inv_freq.detach().clone(), persistent=False)
        self.rope_type = getattr(original, "rope_type", "default")
        self.config = getattr(original, "config", None)
        if hasattr(original, "compute_default_rope_parameters"):
            self.compute_default_rope_parameters = original.compute_default_rope_parameters
        encoding.inv_freq = functools.partial(_rotary_ladder, self)  # type: ignore[method-assign]
        self.last_table: torch.Tensor | None = None

    def _expand(self, part: torch.Tensor) -> torch.Tensor:
        if self.output_layout == "interleaved":
            return part.repeat_interleave(2, dim=-1)
        return torch.cat([part, part], dim=-1)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        coords = position_coordinates(position_ids.to(x.device), self.scheme)
        if self.per_head:
            table = self.encoding.table_from_positions(coords)  # (B, H_kv, L, P) complex64
            self.last_table = table
            B, L, d = table.shape[0], table.shape[2], 2 * table.shape[-1]
            # HF's rotation becomes the identity times the model's attention scaling (YaRN's factor; 1 otherwise)
            cos = torch.full((B, L, d), self.attention_scaling, device=x.device)
            sin = torch.zeros(B, L, d, device=x.device)
        else:
            # cos / sin of the float32 angles, as HF computes them (bit-identical for the model's own scheme)
            ang = self.encoding.angles_from_positions(coords)[:, 0]  # (B, L, P)
            cos = self._expand(ang.cos()) * self.attention_scaling
            sin = self._expand(ang.sin()) * self.attention_scaling
        if self.stacked:
            cos, sin = cos[None].expand(3, -1, -1, -1), sin[None].expand(3, -1, -1, -1)
        return cos.to(x.dtype), sin.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"scheme={self.scheme!r}, per_head={self.per_head}, stacked={self.stacked}, pair_layout={self.pair_layout!r}, "
                f"output_layout={self.output_layout!r}")


def _per_head_rotation(rotary: VispeRotaryEmbedding, head_dim: int, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """Forward hook on ``q_proj`` / ``k_proj`` (``(B, L, H*d)``) or ``q_norm`` / ``k_norm`` (``(B, L, H, d)``):
    rotate the rotary channels of each head by its own table; the output keeps its shape."""
    table = rotary.last_table
    B, L = output.shape[:2]
    if table is None or table.shape[-2] != L:
        raise RuntimeError("MHRoPE hook: no rotary table for this forward (the attention ran outside the patched text model)")
    x = output.reshape(B, L, -1, head_dim).transpose(1, 2)  # (B, H, L, d)
    if x.shape[1] != table.shape[1]:  # query head i uses key head i // repeats (HF's repeat_kv)
        table = table.repeat_interleave(x.shape[1] // table.shape[1], dim=1)
    rot = 2 * table.shape[-1]  # partial rotary: the first `rot` channels of each head turn
    turned = apply_rotary(x[..., :rot], table, rotary.pair_layout)
    x = torch.cat([turned, x[..., rot:]], dim=-1) if rot < head_dim else turned
    return x.transpose(1, 2).reshape(output.shape)


# ---------------------------------------------------------------------------------------------
# get_rope_index
# ---------------------------------------------------------------------------------------------


@dataclass
class _Patch:
    scheme: str
    family: ModelFamily
    position_options: dict[str, Any]
    recorded: dict[str, Any]
    rotary: VispeRotaryEmbedding
    original_rotary: nn.Module
    signature: inspect.Signature
    spatial_merge_size: int
    image_token_id: int
    video_token_id: int
    video_markers: tuple[int, int] | None  # GLM-4V: (video_start, video_end) around video frames
    tokens_per_second: float | None  # Qwen2.5-VL absolute time (mrope only)
    pad_value: int
    padded_deltas: bool  # rope_deltas relative to the padded length (older versions) or to the real tokens
    clamped_deltas: bool = False  # the native scheme's rope_deltas floored at 0, as transformers 5.2's Qwen2-VL does
    installed_time_rule: str | None = None  # the own mrope's absolute-time rule: 'float' (in spg's precision) or a MROPE_TIME_RULES name
    identical: bool = False  # the model's own scheme with default options: the model runs exactly as unpatched
    hooks: list = field(default_factory=list)

    def builder_options(self, training: bool) -> dict[str, Any]:
        rec = get_scheme(self.scheme)
        kw = rec.builder_options(self.position_options, training)
        if self.scheme == "mrope" and self.tokens_per_second is not None:
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


def _token_types(input_ids: torch.Tensor, patch: _Patch) -> torch.Tensor:
    """0 text / 1 image / 2 video per token, read from the ids (what ``mm_token_type_ids`` carries on 5.x)."""
    if patch.video_markers is not None:  # GLM-4V: frames are image tokens between video_start and video_end
        start, end = patch.video_markers
        inside = (torch.cumsum((input_ids == start).long(), -1) - torch.cumsum((input_ids == end).long(), -1)) > 0
        return (input_ids == patch.image_token_id).long() * (1 + inside.long())
    return (input_ids == patch.image_token_id).long() + 2 * (input_ids == patch.video_token_id).long()


def _split_frames(grid: torch.Tensor | None) -> torch.Tensor | None:
    """``(T, H, W)`` rows -> ``T`` rows ``(1, H, W)`` (one per temporal patch, each its own block)."""
    if grid is None:
        return None
    grid = torch.as_tensor(grid)
    out = torch.repeat_interleave(grid, grid[:, 0], dim=0).clone()
    out[:, 0] = 1
    return out


def _installed_time_rule(second_per_grid_ts: Any) -> str:
    """The precision of transformers' ``tokens_per_second * second_per_grid_ts`` product: the tensor's float dtype
    (a list or no value: torch's default float32; integer seconds: an exact integer product)."""
    if isinstance(second_per_grid_ts, torch.Tensor):
        if not second_per_grid_ts.dtype.is_floating_point:
            return "exact"
        return str(second_per_grid_ts.dtype).removeprefix("torch.")
    return "float32"


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
        types = _token_types(input_ids, patch)
    video_grid = a.get("video_grid_thw")
    if patch.family.frames_as_blocks:
        video_grid = _split_frames(video_grid)
    grids = {k: iter(g.tolist()) if g is not None else iter(()) for k, g in ((1, a.get("image_grid_thw")), (2, video_grid))}
    spg = a.get("second_per_grid_ts")
    timed = patch.scheme == "mrope" and patch.tokens_per_second is not None
    times = iter(spg.tolist()) if spg is not None else itertools.repeat(1.0)  # HF's default: 1 s per temporal patch
    options = patch.builder_options(model.training)
    if timed and patch.installed_time_rule is not None:
        options["time_rule"] = _installed_time_rule(spg) if patch.installed_time_rule == "float" else patch.installed_time_rule
    built = []
    for b in range(B):
        segs = _row_segments(types[b][mask[b]].tolist(), grids, times, timed, patch.spatial_merge_size)
        built.append(build_positions(patch.scheme, segs, spatial_merge_size=patch.spatial_merge_size, **options))
    # float64 where the builders needed it (V2PE past 2^24, or fine steps far out: float32 would merge positions)
    dtypes = {p.dtype for p, _ in built}
    dtype = torch.float64 if torch.float64 in dtypes else torch.float32 if any(d.is_floating_point for d in dtypes) else torch.int64
    rows = torch.full((3, B, L), patch.pad_value, dtype=dtype, device=device)
    deltas = torch.empty(B, 1, dtype=torch.float64)
    for b, (pos, delta) in enumerate(built):
        rows[:, b, mask[b]] = _to_rows(pos).to(device, dtype)
        # vispe: delta = next_free - real length; older versions count from the padded length
        deltas[b, 0] = float(delta) + (pos.shape[1] - L if patch.padded_deltas else 0)
    if patch.clamped_deltas:  # the installed model's own (lossy) floor, kept for its own scheme only
        deltas.clamp_(min=0)
    return rows, deltas.to(device=device, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# apply / remove
# ---------------------------------------------------------------------------------------------


def _inner_model(model: nn.Module) -> nn.Module:
    """The module holding ``get_rope_index`` and ``language_model``: ``model.model``, or the bare model itself."""
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "get_rope_index"):
        return inner
    return model


def _check_layout(model: nn.Module, inner: nn.Module) -> None:
    if not hasattr(inner, "get_rope_index") or not hasattr(getattr(inner, "language_model", None), "rotary_emb"):
        raise TypeError(f"{type(model).__name__} does not have the get_rope_index / language_model.rotary_emb layout of {TRANSFORMERS_REQUIREMENT}")


def _vision_start(config: Any) -> int:
    for name in ("vision_start_token_id", "image_start_token_id"):
        v = getattr(config, name, None)
        if v is not None:
            return int(v)
    raise TypeError("the model config has no vision_start_token_id / image_start_token_id")


def _call_original(original: Any, signature: inspect.Signature, patch_like: _Patch, ids: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, Any]:
    if "mm_token_type_ids" in signature.parameters:
        kw["mm_token_type_ids"] = _token_types(ids, patch_like)
    return original(input_ids=ids, **kw)


def _probe_conventions(original: Any, signature: inspect.Signature, config: Any, m: int, patch_like: _Patch) -> tuple[int, bool, bool, str]:
    """Ask the installed get_rope_index for its pad value, rope_deltas base (padded or real length, floored at
    0 or not) and (M-RoPE) next-text rule."""
    vs, img = _vision_start(config), patch_like.image_token_id
    ve = int(getattr(config, "vision_end_token_id", None) or getattr(config, "image_end_token_id", None) or vs)
    # a 2x2-token image: positions 0, 1..2, 3 for 6 tokens, so the true delta is 4 - 6 = -2
    _, neg = _call_original(original, signature, patch_like, torch.tensor([[vs] + [img] * 4 + [ve]]), image_grid_thw=torch.tensor([[1, 2 * m, 2 * m]]))
    clamped = int(torch.as_tensor(neg).reshape(-1)[0]) == 0
    ids = torch.tensor([[0, vs, img, ve, 0]])
    pos, delta = _call_original(original, signature, patch_like, ids, image_grid_thw=torch.tensor([[1, m, m]]),
                                attention_mask=torch.tensor([[0, 1, 1, 1, 1]]))
    d = int(torch.as_tensor(delta).reshape(-1)[0])
    if d not in (0, -1):  # real tokens sit at 0..3: next free 4, real length 4, padded length 5
        raise RuntimeError(f"unrecognised rope_deltas convention in this transformers version (probe gave {d}); supported: {TRANSFORMERS_REQUIREMENT}")
    padded = d == -1 or clamped  # a floored delta hides the base: the code that floors (5.2) counts from the padded length
    after_visual = "max"
    if not patch_like.family.frames_as_blocks:
        # a 4-patch video on a 1x1 grid: text after it at max + 1 = 5 (paper) or at start + max(H, W) = 2 (5.x)
        vid = patch_like.video_token_id
        ids = torch.tensor([[vs] + [vid] * 4 + [ve]])
        kw: dict[str, Any] = {"video_grid_thw": torch.tensor([[4, m, m]])}
        if "second_per_grid_ts" in signature.parameters:
            kw["second_per_grid_ts"] = torch.tensor([1.0])  # t extent 3 * tokens_per_second >= 3
        vpos, _ = _call_original(original, signature, patch_like, ids, **kw)
        after_visual = "spatial" if int(vpos[0, 0, -1]) == 2 else "max"
    return int(pos[0, 0, 0]), padded, clamped, after_visual


def _probe_time_rule(original: Any, signature: inspect.Signature, config: Any, m: int, patch_like: _Patch) -> str:
    """Which absolute-time rule the installed Qwen2.5-VL code follows: its float product (5.x: ``'float'``, in the
    precision of ``second_per_grid_ts``) or 4.57's integer cast of the seconds (``'integer_seconds'``), read from a
    4-patch video at 0.5 s per patch."""
    from ..positions import absolute_time_ids

    vs, vid = _vision_start(config), patch_like.video_token_id
    ve = int(getattr(config, "vision_end_token_id", None) or vs)
    ids = torch.tensor([[vs] + [vid] * 4 + [ve]])
    pos, _ = _call_original(original, signature, patch_like, ids, video_grid_thw=torch.tensor([[4, m, m]]),
                            second_per_grid_ts=torch.tensor([0.5]))
    t = pos[0, 0, 1:5].to(torch.float64) - float(pos[1, 0, 1])  # the video's t row minus its start
    for rule, name in (("float32", "float"), ("integer_seconds", "integer_seconds")):
        if torch.equal(t, absolute_time_ids(4, 0.5, patch_like.tokens_per_second, rule=rule)):
            return name
    raise RuntimeError(f"unrecognised absolute-time rule in this transformers version (probe gave {t.tolist()}); "
                       f"supported: {TRANSFORMERS_REQUIREMENT}")


def _mrope_section(config: Any) -> list[int] | None:
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(config, name, None)
        if isinstance(params, dict) and params.get("mrope_section") is not None:
            return [int(s) for s in params["mrope_section"]]
    return None


def _is_meta(t: torch.Tensor) -> bool:
    return t.device.type == "meta"


def _json_options(options: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The options ``config.json`` can hold, and the names of those it cannot (callables, generators)."""
    kept, dropped = {}, []
    for k, v in options.items():
        try:
            json.dumps(v)
        except (TypeError, ValueError):
            dropped.append(k)
        else:
            kept[k] = list(v) if isinstance(v, tuple) else v
    return kept, dropped


def apply_position_scheme(model: nn.Module, scheme: str, **options: Any) -> nn.Module:
    """Switch a supported HF vision-language model to a vispe position scheme (in place; returns the model).

    Args:
        model: a ``…ForConditionalGeneration`` or bare ``…Model`` of :data:`MODEL_FAMILIES` (Qwen2-VL,
            Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE, GLM-4V, GLM-4V-MoE), with its weights
            materialised (not on the meta device).
        scheme: one of ``rope_1d, mrope, mrope_interleave, mhrope, vrope, videorope, hope, v2pe, qwen3vl``.
        **options: rotary options (``mrope_section`` for ``mrope`` / ``mrope_interleave`` / ``qwen3vl`` /
            ``mhrope`` -- pairs of the rotated part, or KV heads for ``mhrope``; the model's own section for
            its native scheme; ``temporal_pairs`` for ``videorope`` / ``hope``) and position options of
            :func:`vispe.positions.build_positions` (``gamma``, ``delta``, ``spatial_reset``,
            ``temporal_stride``, ``after_visual``, ...). Defaults are the registry's: HoPE ``gamma=0.75``,
            V2PE ``delta=0.25`` (:data:`vispe.positions.SCHEMES` ``eval_options``), drawn per visual block
            while ``model.training``; ``mrope``'s ``after_visual`` defaults to the installed transformers'
            own rule (``'spatial'`` on 5.x, ``'max'`` -- the paper's -- on 4.57).

    The scheme and its options are recorded in ``model.config`` (saved by ``save_pretrained``; see
    :func:`from_pretrained`). Calling it again switches scheme; :func:`remove_position_scheme` restores the
    model's own code. Qwen2.5-VL's own ``mrope`` computes absolute time by the installed transformers' float
    product; ``time_rule='exact'`` selects vispe's exact rule (:data:`vispe.positions.MROPE_TIME_RULES`). A
    ``rope_type`` in :data:`DYNAMIC_ROPE_TYPES` is kept by the own scheme and refused (``ValueError``) by others.
    """
    family = model_family(model)
    check_transformers_version(family)
    rec = get_scheme(scheme)
    inner = _inner_model(model)
    _check_layout(model, inner)
    text_model = inner.language_model
    current = getattr(model, "_vispe_position_patch", None)
    original_rotary = current.original_rotary if current is not None else text_model.rotary_emb
    if _is_meta(original_rotary.inv_freq):
        raise RuntimeError(
            f"{type(model).__name__} is on the meta device (its rotary inv_freq has no values): call apply_position_scheme once the "
            "model is materialised -- after from_pretrained(..., device_map=...) / load_checkpoint_and_dispatch, or after "
            "to_empty() + load_state_dict() with the rotary inv_freq buffers refilled; models built under accelerate's init_empty_weights() keep "
            "their buffers and can be patched before the weights are loaded"
        )
    config = model.config
    tcfg = getattr(config, "text_config", config)
    vcfg = config.vision_config
    user_options = dict(options)
    options = dict(options)
    rotary_kw = {k: options.pop(k) for k in rotary_options(scheme) if k in options}
    # the model's own scheme without rotary options keeps the model's own rotary (its sections, rope_type and
    # buffers, exactly as transformers runs them); only the position ids come from vispe's builder
    own = scheme == family.native_scheme and not rotary_kw
    rope_type = getattr(original_rotary, "rope_type", "default")
    if not own and rope_type in DYNAMIC_ROPE_TYPES:
        raise ValueError(
            f"rope_type={rope_type!r} recomputes the rotary frequencies from the sequence length, which the switched scheme {scheme!r} "
            f"cannot follow; switched schemes keep static scalings (default, linear, yarn, llama3, ...), and the model's own scheme "
            f"{family.native_scheme!r} (without rotary options) keeps {rope_type!r}"
        )
    num_heads = int(tcfg.num_attention_heads)
    num_kv = int(getattr(tcfg, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(tcfg, "head_dim", None) or tcfg.hidden_size // num_heads)
    m = int(vcfg.spatial_merge_size)
    ladder = original_rotary.inv_freq
    rot_dim = 2 * ladder.shape[-1]  # partial_rotary_factor < 1: only the first rot_dim channels of a head turn
    if ladder.ndim != 1 or rot_dim > head_dim:
        raise ValueError(f"the model's rotary inv_freq has shape {tuple(ladder.shape)}, expected (<= {head_dim // 2},) for head_dim={head_dim}")

    for k, v in rec.eval_options.items():  # one default per scheme name: the registry's
        options.setdefault(k, v)

    tokens_per_second = getattr(vcfg, "tokens_per_second", None)
    original_index = type(inner).get_rope_index.__get__(inner)
    signature = inspect.signature(original_index)
    markers = None
    if family.video_between_markers:
        markers = (int(config.video_start_token_id), int(config.video_end_token_id))
    rotary = None if own else _vispe_rotary(scheme, rotary_kw, original_rotary, family, tcfg, rot_dim, num_kv)
    patch = _Patch(
        scheme=scheme,
        family=family,
        position_options=options,
        recorded={},
        rotary=rotary if rotary is not None else original_rotary,
        original_rotary=original_rotary,
        signature=signature,
        spatial_merge_size=m,
        image_token_id=int(config.image_token_id),
        video_token_id=int(getattr(config, "video_token_id", None) or config.image_token_id),
        video_markers=markers,
        tokens_per_second=float(tokens_per_second) if (family.absolute_time and tokens_per_second is not None) else None,
        pad_value=0,
        padded_deltas=False,
    )
    native = scheme == family.native_scheme
    patch.pad_value, patch.padded_deltas, clamped, after_visual = _probe_conventions(original_index, signature, config, m, patch)
    patch.clamped_deltas = clamped and native
    if scheme == "mrope":
        options.setdefault("after_visual", after_visual)  # default: what the installed model does
        # absolute time: the model's own scheme follows transformers' float product (per call, in the precision of
        # second_per_grid_ts); an explicit time_rule (e.g. 'exact') is kept
        if native and patch.tokens_per_second is not None and "time_rule" not in options:
            patch.installed_time_rule = _probe_time_rule(original_index, signature, config, m, patch)
    # bad position options fail here, not at the first forward
    build_positions(scheme, [Text(1), Visual(2, m, m, 1.0 if patch.tokens_per_second else None), Text(1)],
                    spatial_merge_size=m, **patch.builder_options(False))
    remove_position_scheme(model)
    if rotary is not None:
        text_model.rotary_emb = rotary
    if rotary is not None and rotary.per_head:
        for layer in text_model.layers:
            attn = getattr(layer, "self_attn", None)
            if attn is None:  # Qwen3.5's linear-attention layers have no rotary
                continue
            names = ("q_norm", "k_norm") if hasattr(attn, "q_norm") else ("q_proj", "k_proj")
            for name in names:
                patch.hooks.append(getattr(attn, name).register_forward_hook(functools.partial(_per_head_rotation, rotary, head_dim)))
    inner.get_rope_index = functools.partial(_vispe_get_rope_index, inner, patch)
    inner.rope_deltas = None
    recorded = {k: v for k, v in user_options.items()}
    for k, v in rec.eval_options.items():
        recorded.setdefault(k, v)
    patch.identical = own and not user_options
    kept, dropped = _json_options(recorded)
    patch.recorded = {"scheme": scheme, "options": kept, **({"unrecorded_options": dropped} if dropped else {})}
    setattr(config, CONFIG_KEY, dict(patch.recorded))
    model._vispe_position_patch = patch
    return model


def _vispe_rotary(scheme: str, rotary_kw: dict[str, Any], original_rotary: nn.Module, family: ModelFamily, tcfg: Any, rot_dim: int,
                  num_kv: int) -> VispeRotaryEmbedding:
    """The scheme's rotary in the model's pair layout, on the model's own ladder (bit-identical to HF's cos / sin)."""
    rotary_kw = dict(rotary_kw)
    if scheme == family.native_scheme and "mrope_section" not in rotary_kw and _mrope_section(tcfg) is not None:
        rotary_kw["mrope_section"] = _mrope_section(tcfg)
    context = EncodingContext(dim=rot_dim * num_kv, num_heads=num_kv, depth=int(tcfg.num_hidden_layers), grid_size=(1, 1, 1), num_prefix_tokens=0)
    encoding = create_encoding(scheme, context, **rotary_kw)
    with torch.no_grad():  # position 1: pair 0 (frequency 1) and pair 1 differ, so the cos order shows
        probe_cos, _ = original_rotary(torch.zeros(1, 1), torch.ones(3, 1, 1, dtype=torch.long))
    stacked = probe_cos.ndim == 4
    c = probe_cos.reshape(-1, probe_cos.shape[-1])[0]
    output_layout = "interleaved" if c.shape[0] >= 4 and torch.equal(c[0], c[1]) and not torch.equal(c[0], c[c.shape[0] // 2]) else "half"
    rotary = VispeRotaryEmbedding(encoding, scheme, original_rotary, stacked=stacked, pair_layout=family.pair_layout, output_layout=output_layout)
    return rotary.to(original_rotary.inv_freq.device)


def remove_position_scheme(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_position_scheme` (no-op on an unpatched model); the config's record goes too."""
    patch: _Patch | None = getattr(model, "_vispe_position_patch", None)
    if patch is None:
        return model
    inner = _inner_model(model)
    for h in patch.hooks:
        h.remove()
    inner.language_model.rotary_emb = patch.original_rotary
    if "get_rope_index" in vars(inner):
        del inner.get_rope_index
    inner.rope_deltas = None
    if hasattr(model.config, CONFIG_KEY):
        delattr(model.config, CONFIG_KEY)
    del model._vispe_position_patch
    return model


# ---------------------------------------------------------------------------------------------
# per-layer rotary of a text model (NoPE layers, partial rotary, per-layer theta) -> vispe's layer schedule
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TextRotarySchedule:
    """The rotary of each layer of an HF text model, as its config sets it (:func:`text_rotary_schedule`).

    Attributes:
        model_type: the config's ``model_type``.
        head_dim: the width of the head the rotary sees (MLA models: the rope slice, ``qk_rope_head_dim``).
        layer_theta: the rotary base of each layer.
        rotary_fraction: the share of ``head_dim`` each layer rotates (its first ``int(head_dim * f)`` channels).
        nope_layers: layers whose attention gets no position.
        mrope_section: M-RoPE pairs per (t, h, w) axis (``None``: one coordinate).
        mrope_interleaved: the sections' pairs interleave t/h/w (Qwen3-VL's ``mrope_interleaved``, HY-V4-VL) rather
            than follow one another.
        pair_layout: which channels the attention turns together: ``'half'`` ``(i, i + d/2)`` or ``'interleaved'``
            ``(2i, 2i+1)`` (HY-V4-VL's GLM-style rotation).
    """

    model_type: str
    head_dim: int
    layer_theta: tuple[float, ...]
    rotary_fraction: tuple[float, ...]
    nope_layers: frozenset[int] = frozenset()
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False
    pair_layout: str = "half"

    @property
    def depth(self) -> int:
        return len(self.layer_theta)

    def encoding_options(self) -> list[tuple[tuple[int, ...], dict[str, Any]]]:
        """vispe rotary options (``theta``, ``nope_layers``, ``rotary_fraction``, ``layer_theta``, ``mrope_section``)
        reproducing the schedule, one option set per rotated width (vispe's ``rotary_fraction`` is one width per
        encoding), each with the layers it rotates; in each set every other layer is a NoPE layer."""
        rotating = [i for i in range(self.depth) if i not in self.nope_layers]
        out = []
        for frac in dict.fromkeys(self.rotary_fraction[i] for i in rotating):
            layers = tuple(i for i in rotating if self.rotary_fraction[i] == frac)
            opts: dict[str, Any] = {"theta": self.layer_theta[layers[0]], "layout": self.pair_layout}
            others = sorted(set(range(self.depth)) - set(layers))
            if others:
                opts["nope_layers"] = others
            if frac != 1:
                opts["rotary_fraction"] = frac
            if len({self.layer_theta[i] for i in layers}) > 1:  # a NoPE layer's entry is never used: any valid base
                opts["layer_theta"] = [self.layer_theta[i] if i in layers else opts["theta"] for i in range(self.depth)]
            if self.mrope_section is not None:
                opts["mrope_section"] = list(self.mrope_section)
            out.append((layers, opts))
        return out


#: text models whose attention turns channel pairs ``(2i, 2i+1)``, and whose M-RoPE sections interleave t/h/w without
#: a config flag (both are in the modeling code, not the config)
_INTERLEAVED_PAIRS = ("hy_v4_vl_text",)
_INTERLEAVED_SECTIONS = ("hy_v4_vl_text",)
#: layer types that take no position embeddings (linear attention)
_POSITIONLESS_LAYER_TYPES = ("linear_attention",)


def _per_type_rope(rp: Any, layer_types: Any) -> bool:
    return isinstance(rp, dict) and bool(layer_types) and all(isinstance(rp.get(t), dict) for t in set(layer_types))


def text_rotary_schedule(config: Any) -> TextRotarySchedule:
    """Read the per-layer rotary of an HF text model from its config (or a multimodal config's ``text_config``).

    Read as transformers runs them: ``rope_parameters`` keyed by ``layer_types`` (per-type ``rope_theta`` and
    ``partial_rotary_factor``: NeoMME, Step3p7), ``layer_rope_theta`` (Muse Glimmer: ``0`` marks a NoPE layer; the
    installed rotary uses the global ``rope_theta`` on every other layer, whatever value is written there), a global
    ``rope_parameters`` with ``partial_rotary_factor`` and ``mrope_section`` (HY-V4-VL: on the MLA rope slice of width
    ``head_dim``; Qwen3.5), ``linear_attention`` layer types (Qwen3.5: no position reaches them). ``ValueError`` for a ``rope_type`` other than ``'default'`` (its ladder is not a theta ladder).
    """
    tcfg = getattr(config, "text_config", None) or config
    depth = int(tcfg.num_hidden_layers)
    head_dim = int(getattr(tcfg, "head_dim", None) or tcfg.hidden_size // tcfg.num_attention_heads)
    rp = getattr(tcfg, "rope_parameters", None) or {}
    layer_types = getattr(tcfg, "layer_types", None)
    if _per_type_rope(rp, layer_types):
        per_layer = [rp[t] for t in layer_types]
        where = [f"rope_parameters[{t!r}]" for t in layer_types]
    else:
        per_layer, where = [rp] * depth, ["rope_parameters"] * depth
    for params, name in zip(per_layer, where):
        if params.get("rope_type", "default") != "default":
            raise ValueError(f"{tcfg.model_type}: {name}['rope_type']={params['rope_type']!r} is not a theta ladder; vispe's layer "
                             "schedule reproduces rope_type 'default' only")
    if any(p.get("rope_theta", getattr(tcfg, "rope_theta", None)) is None for p in per_layer):
        raise ValueError(f"{tcfg.model_type}: the config has no rope_theta (in rope_parameters or as an attribute)")
    theta = [float(p.get("rope_theta", getattr(tcfg, "rope_theta", None))) for p in per_layer]
    fraction = [float(p.get("partial_rotary_factor", 1.0) or 1.0) for p in per_layer]
    # layers without softmax attention (Qwen3.5's Gated DeltaNet) receive no position
    nope = {i for i, t in enumerate(layer_types or ()) if t in _POSITIONLESS_LAYER_TYPES}
    layer_rope_theta = getattr(tcfg, "layer_rope_theta", None)
    if layer_rope_theta is not None:
        if len(layer_rope_theta) != depth:
            raise ValueError(f"{tcfg.model_type}: layer_rope_theta has {len(layer_rope_theta)} entries for {depth} layers")
        nope |= {i for i, t in enumerate(layer_rope_theta) if not t}
    section = rp.get("mrope_section") if not _per_type_rope(rp, layer_types) else None
    return TextRotarySchedule(str(tcfg.model_type), head_dim, tuple(theta), tuple(fraction), frozenset(nope),
                              tuple(int(s) for s in section) if section is not None else None,
                              bool(rp.get("mrope_interleaved")) or tcfg.model_type in _INTERLEAVED_SECTIONS,
                              "interleaved" if tcfg.model_type in _INTERLEAVED_PAIRS else "half")


def _default_ladder(theta: float, dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """transformers' ``rope_type='default'`` inverse frequencies of a ``dim``-wide rotary, as it rounds them (float32)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


class ScheduledTextRotary(nn.Module):
    """vispe's rotary under a :class:`TextRotarySchedule`: one vispe encoding per rotated width, built with the
    schedule's layer options on transformers' float32 frequency ladder, so ``rotate_qk(q, k, positions, layer)`` turns
    each layer's q and k as the model's own attention does (to float32 rounding; ``positions``: ``(B, L)`` token
    indices or the scheme's ``(K, B, L)`` coordinates). ``scheme`` defaults to ``'rope_1d'``, or where the schedule
    has ``mrope_section`` to ``'qwen3vl'`` (interleaved sections) or ``'mrope'`` (consecutive ones)."""

    def __init__(self, schedule: TextRotarySchedule, scheme: str | None = None, num_heads: int = 1) -> None:
        super().__init__()
        self.schedule = schedule
        if scheme is None:
            scheme = "rope_1d" if schedule.mrope_section is None else "qwen3vl" if schedule.mrope_interleaved else "mrope"
        self.scheme = scheme
        context = EncodingContext(dim=schedule.head_dim * num_heads, num_heads=num_heads, depth=schedule.depth, grid_size=(1, 1, 1),
                                  num_prefix_tokens=0)
        groups = schedule.encoding_options()
        self.encodings = nn.ModuleList([create_encoding(self.scheme, context, **opts) for _, opts in groups])
        for enc in self.encodings:  # transformers' float32 ladder (vispe's own rounds theta^(-2i/d) in float64)
            for e in [enc, *enc._modules.get("layer_theta_encodings", ())]:
                e.inv_freq = functools.partial(_default_ladder, e.theta, e.head_dim)  # type: ignore[method-assign]
        self.layer_encoding = {layer: g for g, (layers, _) in enumerate(groups) for layer in layers}

    def rotate_qk(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= layer < self.schedule.depth:
            raise ValueError(f"layer={layer} is outside the model's {self.schedule.depth} layers")
        g = self.layer_encoding.get(layer)
        if g is None:  # a NoPE layer
            return q, k
        enc = self.encodings[g]
        coords = positions[None] if positions.ndim == 2 else positions
        if coords.shape[0] != enc.num_coords:
            coords = coords[:1].expand(enc.num_coords, *coords.shape[1:])  # text: every coordinate is the token index
        return enc.rotate_qk(q, k, enc.table_from_positions(coords), layer)


# ---------------------------------------------------------------------------------------------
# save / load
# ---------------------------------------------------------------------------------------------


def scheme_of(model: nn.Module) -> str | None:
    """The vispe scheme active in ``model`` (``None``: the model runs its own position code)."""
    patch = getattr(model, "_vispe_position_patch", None)
    return None if patch is None else patch.scheme


def recorded_scheme(model: nn.Module) -> str | None:
    """The scheme recorded in ``model.config`` (by :func:`apply_position_scheme`, kept by ``save_pretrained``).

    With this module imported, ``from_pretrained`` restores it; a model whose record was not restored (built from
    a config, say) has ``recorded_scheme(model) != scheme_of(model)`` -- call :func:`restore_position_scheme`.
    """
    rec = getattr(model.config, CONFIG_KEY, None)
    return rec.get("scheme") if isinstance(rec, dict) else None


def restore_position_scheme(model: nn.Module, **options: Any) -> nn.Module:
    """Re-apply the scheme recorded in ``model.config`` (a no-op when nothing is recorded).

    ``options`` are added to the recorded ones: options ``config.json`` could not hold (callables such as
    ``timestamp_tokens``, an ``rng``) must be passed again, else this raises naming them.
    """
    rec = getattr(model.config, CONFIG_KEY, None)
    if rec is None:
        return model
    expected = f"expected {{'scheme': one of {list(POSITION_SCHEMES)}, 'options': {{name: value}}, 'unrecorded_options': [names]}}"
    if not isinstance(rec, dict) or rec.get("scheme") not in POSITION_SCHEMES:
        raise ValueError(f"config.{CONFIG_KEY}={rec!r} is not a vispe record; {expected}")
    if not isinstance(rec.get("options", {}), dict) or not all(isinstance(k, str) for k in rec.get("options", {})):
        raise ValueError(f"config.{CONFIG_KEY}['options']={rec.get('options')!r} is not a mapping of option names to values "
                         f"(the config.json was edited or written by something else); {expected}")
    unrecorded = rec.get("unrecorded_options", [])
    if not isinstance(unrecorded, list) or not all(isinstance(k, str) for k in unrecorded):
        raise ValueError(f"config.{CONFIG_KEY}['unrecorded_options']={unrecorded!r} is not a list of option names; {expected}")
    missing = [k for k in unrecorded if k not in options]
    if missing:
        raise ValueError(f"the saved {rec['scheme']!r} scheme used options config.json cannot hold: {missing}; pass them to restore_position_scheme / from_pretrained")
    return apply_position_scheme(model, rec["scheme"], **{**rec.get("options", {}), **options})


def from_pretrained(cls: type, pretrained_model_name_or_path: Any, *model_args: Any, scheme_options: dict[str, Any] | None = None,
                    **kwargs: Any) -> nn.Module:
    """``cls.from_pretrained(...)`` with the scheme saved with the model restored (what the guarded
    ``from_pretrained`` of the supported and Auto classes does), plus ``scheme_options``: options ``config.json``
    could not hold (passed to :func:`restore_position_scheme`)."""
    # the supported classes' from_pretrained (guarded on import, see vispe.integrations.hf_hub) restores the scheme
    # and takes the options config.json could not hold under this kwarg; Auto classes hand it on to them
    return cls.from_pretrained(pretrained_model_name_or_path, *model_args, **{SCHEME_OPTIONS_KWARG: scheme_options or {}}, **kwargs)


from .hf_hub import SCHEME_OPTIONS_KWARG, install as _install_hub  # noqa: E402  (needs the names above)

_install_hub()
