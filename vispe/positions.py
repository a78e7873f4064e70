"""Multimodal position ids for text + image/video sequences (pure functions, no model).

A sample is a list of segments, :class:`Text` ``(n)`` or :class:`Visual` ``(T, H, W)`` (an image is
``T = 1``). :func:`build_positions` turns it into coordinates per token, ``pos`` of shape ``(K, L)``,
plus ``rope_delta`` for cached decoding:

=====================  ===  =============================================================
scheme                  K   positions
=====================  ===  =============================================================
``rope_1d``             1   ``0..L-1``; a visual block uses ``T*H*W`` consecutive indices
``mrope``               3   Qwen2-VL ``(t, h, w)``; optional absolute time (Qwen2.5-VL:
                            ``fps`` or ``seconds_per_grid`` and ``tokens_per_second``)
``mrope_interleave``    3   as ``mrope`` with ``temporal_stride`` and spatial-reset (h, w
                            local to the block; default on, the paper's proposal)
``mhrope``              3   same positions as ``mrope_interleave`` (per-head axis is a
                            frequency-allocation matter, see :mod:`vispe.encodings.multimodal_rope`)
``vrope``               4   four corner-origin diagonals, frames tiled along the text axis
``videorope``           3   VideoRoPE diagonal layout (spatial rows centred on the frame and
                            shifted by ``t``), frames ``delta`` apart (default 2)
``hope``                3   VideoRoPE layout (spatial rows centred on ``t``), ``t`` stride
                            ``gamma`` (sampled per block at training, fixed at inference)
``v2pe``                1   text steps by 1, visual tokens by ``delta``
``qwen3vl``             3   Qwen3-VL: every temporal patch of a video is its own ``(1, H, W)``
                            block, after the positions of its ``<x.y seconds>`` timestamp text
=====================  ===  =============================================================

Text tokens carry the same value on every coordinate. ``rope_delta = next_free_position - L``: a
token generated at cache index ``j`` gets position ``j + rope_delta`` on every coordinate.
``next_free_position`` is where a text token following the sequence would be placed by the
scheme's own rule, so decoding continues exactly as a longer prefill would.

Positions are int64 when a scheme's options can only produce integers and float32 otherwise
(``hope``, ``v2pe``, absolute-time ``mrope`` without the floor, fractional temporal strides), or float64
where float32 would not hold every position exactly (past 2^24, or fine fractional steps such as V2PE's
``delta = 1/256`` after a long text): distinct positions stay distinct, and the rotary encodings take
float64 positions through a float64 angle computation. Options are checked by name
(:data:`SCHEME_OPTION_CHECKS`) before anything is built, and positions past 2^53 (where float64 stops
counting exactly) are refused.
Visual tokens must be fed in raster order (t-major, then h, then w), with ``H, W`` the LLM-side
grid; ``spatial_merge_size=m`` lets ``Visual`` carry the ViT grid instead (``H, W`` divisible by
``m``).

VideoRoPE (Wei et al., "VideoRoPE: What Makes for Good Video Rotary Position Embedding?", ICML 2025,
arXiv 2502.05173; code Wiselnn570/VideoRoPE) has two published definitions, picked by ``convention``:
``'code'`` (default: the released transformers / vLLM code behind its checkpoints, and the layout HoPE
builds on) offsets a frame's spatial rows by ``(H-1)//2`` / ``(W-1)//2`` (integers) and starts the text
after a video at ``last t + 1``; ``'paper'`` (Eq. 7) offsets them by ``H/2`` / ``W/2`` (half-integers for
odd sizes) and starts the text after ``T_v`` frames at ``T_s + delta*T_v`` (text index
``tau + (delta - 1)*T_v``), so the frame spacing carries on into the text.

Qwen3-VL (transformers' ``Qwen3VLProcessor`` and ``get_rope_index``) writes a video as, per temporal
patch ``i``: the text ``<x.y seconds>`` (the patch's time, one decimal), ``<|vision_start|>``, the patch's
``H*W`` tokens as a ``(1, H, W)`` block (``t`` constant; ``h, w`` offset by the running index, no reset),
``<|vision_end|>``; the next index is always the maximum so far + 1. Under ``qwen3vl`` a ``Visual`` with
``T > 1`` (or with ``seconds_per_grid``) stands for that whole expansion: only its visual tokens are in
the sequence and the indices of the timestamp text and of the two markers are skipped, so the visual
tokens and the text around the video get exactly Qwen3-VL's ids. ``timestamp_tokens`` is the token count
of one timestamp: an int, or a callable ``seconds -> int`` (e.g. the length of your tokenizer's ids for
:func:`timestamp_text`); the default :func:`estimate_timestamp_tokens` is an estimate (digits + 4), not a
tokenizer count. To feed real timestamp tokens, lay the video out with :func:`qwen3vl_video_segments`
(text segments and ``(1, H, W)`` blocks) and put your ids in its text segments: both forms give the same
ids. A ``Visual`` with ``T = 1`` and no ``seconds_per_grid`` is an image (one block, nothing skipped; the
markers around it are the caller's text; a one-patch video needs ``seconds_per_grid`` to be read as a
video). Patch ``i`` of ``p = temporal_patch_size`` frames sampled uniformly at ``fps`` from 0 s (the
processor's default is 2 fps) is at ``(i + (p - 1) / (2p)) * s`` seconds with ``s = p / fps`` (or the
block's ``seconds_per_grid``): the mean time of its first and last frame.
"""
from __future__ import annotations

import math
import numbers
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Mapping, Union

import torch

from ._checks import Bool, Choice, Int, Positive, Seq, check_choice, check_options

__all__ = [
    "HOPE_TRAIN_GAMMAS",
    "MROPE_AFTER_VISUAL",
    "MROPE_TIME_RULES",
    "NUM_COORDS",
    "VIDEOROPE_CONVENTIONS",
    "POSITION_SCHEMES",
    "PositionScheme",
    "SCHEMES",
    "SCHEME_OPTION_CHECKS",
    "get_scheme",
    "V2PE_TRAIN_DELTAS",
    "BatchPositions",
    "Segment",
    "Text",
    "Visual",
    "build_positions",
    "build_positions_batch",
    "decode_positions",
    "estimate_timestamp_tokens",
    "num_tokens",
    "qwen3vl_timestamps",
    "qwen3vl_video_segments",
    "timestamp_text",
    "validate_segments",
]


@dataclass(frozen=True)
class Text:
    """``n`` text tokens."""

    n: int


@dataclass(frozen=True)
class Visual:
    """A visual block of ``T x H x W`` tokens in raster order (an image is ``T = 1``).

    ``seconds_per_grid`` optionally gives this video's duration of one temporal grid step
    (absolute-time M-RoPE, Qwen3-VL's timestamps); it overrides the scheme-level ``fps`` /
    ``seconds_per_grid``.
    """

    T: int
    H: int
    W: int
    seconds_per_grid: float | None = None

    @property
    def num_tokens(self) -> int:
        return self.T * self.H * self.W


Segment = Union[Text, Visual]

#: HoPE's dynamic temporal scaling set used at training (one draw per visual block).
HOPE_TRAIN_GAMMAS = (0.5, 0.75, 1.0, 1.25, 1.5)
#: V2PE's training deltas ``S / 256`` for ``S`` in 1, 2, 4, ..., 256 (one draw per visual block).
V2PE_TRAIN_DELTAS = tuple(2**i / 256 for i in range(9))
#: M-RoPE's text position after a visual block: the paper's largest coordinate + 1 (default), or the block's start +
#: max(H, W) (transformers 5.x's Qwen2-VL / Qwen2.5-VL code, which differs once a video's temporal extent is larger).
MROPE_AFTER_VISUAL = ("max", "spatial")
#: VideoRoPE's two definitions: the released code's (default) and the paper's Eq. 7.
VIDEOROPE_CONVENTIONS = ("code", "paper")


# ---------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def validate_segments(segments: Sequence[Segment], spatial_merge_size: int = 1) -> list[Segment]:
    """Check a segment list and return it with ``Visual`` sizes on the LLM grid.

    Raises ``ValueError``/``TypeError`` for an empty list, a non-segment, negative or zero sizes
    (an empty visual block) and ViT grids not divisible by ``spatial_merge_size``.
    """
    if not _is_int(spatial_merge_size) or spatial_merge_size < 1:
        raise ValueError(f"spatial_merge_size must be a positive int, got {spatial_merge_size!r}")
    if isinstance(segments, (Text, Visual)):
        segments = [segments]
    segments = list(segments)
    if not segments:
        raise ValueError("a sample needs at least one segment (Text(n) or Visual(T, H, W)); got an empty list")
    out: list[Segment] = []
    for i, seg in enumerate(segments):
        if isinstance(seg, Text):
            if not _is_int(seg.n) or seg.n < 0:
                raise ValueError(f"segment {i}: Text(n) needs an int n >= 0, got n={seg.n!r}")
            if seg.n:
                out.append(Text(int(seg.n)))
        elif isinstance(seg, Visual):
            sizes = dict(T=seg.T, H=seg.H, W=seg.W)
            for k, v in sizes.items():
                if not _is_int(v):
                    raise TypeError(f"segment {i}: Visual {k} must be an int, got {v!r}")
            bad = {k: v for k, v in sizes.items() if v <= 0}
            if bad:
                raise ValueError(
                    f"segment {i}: Visual(T={seg.T}, H={seg.H}, W={seg.W}) is an empty or negative visual block "
                    f"({', '.join(f'{k}={v}' for k, v in bad.items())}); every size must be >= 1"
                )
            if seg.seconds_per_grid is not None and not Positive().is_valid(seg.seconds_per_grid):
                raise ValueError(f"segment {i}: seconds_per_grid must be a finite number > 0, got {seg.seconds_per_grid!r}")
            m = spatial_merge_size
            seg = Visual(int(seg.T), int(seg.H), int(seg.W), seg.seconds_per_grid)
            if m > 1:
                if seg.H % m or seg.W % m:
                    raise ValueError(
                        f"segment {i}: Visual(T={seg.T}, H={seg.H}, W={seg.W}) has H/W not divisible by the spatial merge "
                        f"size {m}; the ViT grid must be a multiple of {m} on both spatial axes"
                    )
                seg = Visual(seg.T, seg.H // m, seg.W // m, seg.seconds_per_grid)
            out.append(seg)
        else:
            raise TypeError(f"segment {i} is {seg!r}; use vispe.positions.Text(n) or Visual(T, H, W)")
    if not out:
        raise ValueError("the sample has no tokens (all Text segments have n=0)")
    total = sum(seg.n if isinstance(seg, Text) else seg.num_tokens for seg in out)
    if total > MAX_SEQUENCE_TOKENS:
        biggest = max(range(len(out)), key=lambda j: out[j].n if isinstance(out[j], Text) else out[j].num_tokens)
        raise ValueError(
            f"the sample has {total:,} tokens (the largest segment, {out[biggest]}, alone "
            f"{out[biggest].n if isinstance(out[biggest], Text) else out[biggest].num_tokens:,}); positions are built for at most "
            f"{MAX_SEQUENCE_TOKENS:,} tokens ({MAX_SEQUENCE_TOKENS * NUM_COORDS_MAX * 8 / 2**30:.0f} GiB of int64 positions)"
        )
    return out


#: The longest sequence whose positions are built (2^30 tokens, far beyond any model's context): a larger one is
#: refused naming the segment, before an allocation that would fail or exhaust memory.
MAX_SEQUENCE_TOKENS = 2**30
NUM_COORDS_MAX = 3


def num_tokens(segments: Sequence[Segment], spatial_merge_size: int = 1) -> int:
    """Sequence length ``L`` of a segment list (visual blocks counted on the LLM grid)."""
    return sum(s.n if isinstance(s, Text) else s.num_tokens for s in validate_segments(segments, spatial_merge_size))


def _check_positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def _draw(choices: Sequence[float], rng: random.Random | None) -> float:
    return (rng or random).choice(list(choices))


# ---------------------------------------------------------------------------------------------
# per-scheme builders: each returns (list of (K, n) float64 columns, next free position)
# float64 internally so that large offsets plus fractional steps stay exact before the final cast
# ---------------------------------------------------------------------------------------------

_F = torch.float64


def _text(nxt: float, n: int, k: int) -> torch.Tensor:
    return (nxt + torch.arange(n, dtype=_F)).expand(k, n)


def _mesh(T: int, H: int, W: int, t: torch.Tensor | None = None):
    t = torch.arange(T, dtype=_F) if t is None else t
    tt, hh, ww = torch.meshgrid(t, torch.arange(H, dtype=_F), torch.arange(W, dtype=_F), indexing="ij")
    return tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)


def _rope_1d(segments: Sequence[Segment]) -> tuple[list[torch.Tensor], float]:
    cols, nxt = [], 0.0
    for seg in segments:
        n = seg.n if isinstance(seg, Text) else seg.num_tokens
        cols.append(_text(nxt, n, 1))
        nxt += n
    return cols, nxt


#: largest denominator used to read a float option as the rational number it stands for (see _exact)
_EXACT_MAX_DENOMINATOR = 10**9


def _exact(value: float | int | Fraction) -> Fraction:
    """The rational number a positive option stands for: ints and Fractions as they are, a float as the
    nearest fraction with denominator <= 1e9 (``2 / 3`` typed as ``0.6666666666666666`` -> ``2/3``,
    ``29.97`` -> ``2997/100``), so products such as ``3 * (2/3) * 25`` are exactly 50 before the floor."""
    if isinstance(value, (int, Fraction)):
        return Fraction(value)
    exact = Fraction(value)
    nearest = exact.limit_denominator(_EXACT_MAX_DENOMINATOR)
    return nearest if nearest else exact  # below 1e-9 the nearest such fraction is 0: keep the float's own value


#: How absolute-time M-RoPE turns ``t * seconds_per_grid * tokens_per_second`` into ids: ``'exact'`` (rational
#: arithmetic, then the floor: ``3 * (2/3) * 25`` is 50) or the float product of transformers' Qwen2.5-VL code in that
#: precision (the dtype of its ``second_per_grid_ts``), truncated: ``trunc(t * (tokens_per_second * seconds_per_grid))``,
#: where ``3 * float32(0.08) * 25`` rounds to ``5.9999995`` and gives 5 instead of 6; ``'integer_seconds'``:
#: transformers 4.57's code, which casts ``seconds_per_grid`` to an integer before multiplying (0.5 s -> 0).
MROPE_TIME_RULES = ("exact", "float16", "bfloat16", "float32", "float64", "integer_seconds")


def absolute_time_ids(num_grids: int, seconds_per_grid: float | Fraction, tokens_per_second: float | Fraction,
                      floor: bool = True, rule: str = "exact") -> torch.Tensor:
    """Absolute-time M-RoPE temporal ids ``t * seconds_per_grid * tokens_per_second`` for ``t < num_grids``
    (float64 ``(num_grids,)``). ``rule='exact'``: exact rational arithmetic, then floored (a float product
    floors ``3 * (2/3) * 25 = 49.999...`` to 49); ``'float32'`` / ``'float64'``: transformers' float product
    in that precision, truncated (:data:`MROPE_TIME_RULES`)."""
    check_choice("time_rule", rule, MROPE_TIME_RULES)
    if rule == "integer_seconds":
        return (torch.arange(num_grids) * torch.as_tensor(float(seconds_per_grid), dtype=torch.int64) * tokens_per_second).long().to(_F)
    if rule != "exact":
        dtype = getattr(torch, rule)
        interval = float(tokens_per_second) * torch.tensor(float(seconds_per_grid), dtype=dtype)
        return (torch.arange(num_grids) * interval).long().to(_F)
    step = _exact(seconds_per_grid) * _exact(tokens_per_second)
    num, den = step.numerator, step.denominator
    if floor:
        return torch.tensor([t * num // den for t in range(num_grids)], dtype=_F)
    return torch.tensor([float(Fraction(t * num, den)) for t in range(num_grids)], dtype=_F)


def _mrope(
    segments: Sequence[Segment],
    fps: float | None = None,
    seconds_per_grid: float | None = None,
    tokens_per_second: float = 2.0,
    temporal_patch_size: int = 2,
    time_floor: bool = True,
    after_visual: str = "max",
    time_rule: str = "exact",
) -> tuple[list[torch.Tensor], float]:
    check_choice("after_visual", after_visual, MROPE_AFTER_VISUAL)
    check_choice("time_rule", time_rule, MROPE_TIME_RULES)
    if time_rule != "exact" and not time_floor:
        raise ValueError(f"time_floor=False keeps fractional temporal ids, which only time_rule='exact' has; time_rule={time_rule!r} "
                         "truncates as transformers does")
    default_spg = None
    if fps is not None and seconds_per_grid is not None:
        raise ValueError("give either fps or seconds_per_grid for absolute-time M-RoPE, not both")
    if fps is not None:
        _check_positive("fps", fps)
        default_spg = Fraction(temporal_patch_size) / _exact(fps)
    elif seconds_per_grid is not None:
        default_spg = _check_positive("seconds_per_grid", seconds_per_grid)
    _check_positive("tokens_per_second", tokens_per_second)  # the value itself stays exact (absolute_time_ids)
    cols, nxt, top = [], 0.0, -1.0
    for seg in segments:
        if isinstance(seg, Text):
            cols.append(_text(nxt, seg.n, 3))
            nxt += seg.n
            top = max(top, nxt - 1)
            continue
        spg = seg.seconds_per_grid if seg.seconds_per_grid is not None else default_spg
        t = None
        if spg is not None:
            # exact rational product, floored at the end (an integer cast of spg zeroes t above 2 fps)
            t = absolute_time_ids(seg.T, spg, tokens_per_second, floor=time_floor, rule=time_rule)
        tt, hh, ww = _mesh(seg.T, seg.H, seg.W, t)
        blk = torch.stack([tt, hh, ww]) + nxt
        cols.append(blk)
        top = max(top, float(blk.max()))
        # 'max': the paper's rule, max over all three rows + 1 (not t_last + 1); 'spatial': transformers 5.x's
        # Qwen2-VL code advances by max(H, W) only, so a long video's t row can pass the following text
        nxt = top + 1.0 if after_visual == "max" else nxt + max(seg.H, seg.W)
    return cols, max(nxt, top + 1.0)  # decoding continues above every position used (what both rules' deltas give)


def _reset(segments: Sequence[Segment], temporal_stride: float = 1.0, spatial_reset: bool = True) -> tuple[list[torch.Tensor], float]:
    stride = _check_positive("temporal_stride", temporal_stride)
    cols, nxt = [], 0.0
    for seg in segments:
        if isinstance(seg, Text):
            cols.append(_text(nxt, seg.n, 3))
            nxt += seg.n
            continue
        tt, hh, ww = _mesh(seg.T, seg.H, seg.W, stride * torch.arange(seg.T, dtype=_F))
        if spatial_reset:
            blk = torch.stack([tt + nxt, hh, ww])  # h, w local to the block; t keeps the global offset
        else:
            blk = torch.stack([tt, hh, ww]) + nxt
        cols.append(blk)
        # the next token sits where un-reset M-RoPE would put it (never a max over reset rows)
        nxt = nxt + max(stride * (seg.T - 1), seg.H - 1, seg.W - 1) + 1
    return cols, nxt


def _vrope(segments: Sequence[Segment]) -> tuple[list[torch.Tensor], float]:
    cols, nxt = [], 0.0
    for seg in segments:
        if isinstance(seg, Text):
            cols.append(_text(nxt, seg.n, 4))
            nxt += seg.n
            continue
        T, H, W = seg.T, seg.H, seg.W
        span = H + W - 1  # each frame occupies one slot of H + W - 1 indices on the text axis
        tt, hh, ww = _mesh(T, H, W)
        o = nxt + tt * span
        # code order [h+w, h+(W-1-w), (H-1-h)+w, (H-1-h)+(W-1-w)] = paper (v1, v4, v2, v3)
        cols.append(torch.stack([o + hh + ww, o + hh + (W - 1 - ww), o + (H - 1 - hh) + ww, o + (H - 1 - hh) + (W - 1 - ww)]))
        nxt = nxt + T * span  # = last frame's max + 1: the following text continues without a jump
    return cols, nxt


def _check_train_or_fixed(name: str, value: float, training: bool, choices: Sequence[float], what: str) -> float:
    """HoPE's gamma / V2PE's delta: one fixed positive value at inference, drawn from ``choices`` in training."""
    if not training:
        return _check_positive(name, value)
    if not choices:
        raise ValueError(f"{name}_choices must be a non-empty sequence of positive {what}")
    for c in choices:
        _check_positive(f"{name}_choices entry", c)
    return value


def _diagonal_block(nxt: float, seg: Visual, step: float, half_sizes: bool = False) -> tuple[torch.Tensor, float]:
    """VideoRoPE's diagonal layout of one block: ``t = nxt + step * frame``, spatial rows centred on ``t``.

    Returns the ``(3, n)`` ids and the last frame's ``t``. ``half_sizes`` centres on ``H/2, W/2`` (the
    paper's Eq. 7) instead of the code's integer ``(H-1)//2, (W-1)//2``.
    """
    T, H, W = seg.T, seg.H, seg.W
    tt, hh, ww = _mesh(T, H, W)
    t = nxt + step * tt
    ch, cw = (H / 2, W / 2) if half_sizes else ((H - 1) // 2, (W - 1) // 2)
    return torch.stack([t, t + hh - ch, t + ww - cw]), nxt + step * (T - 1)


def _hope(
    segments: Sequence[Segment],
    gamma: float = 1.0,
    training: bool = False,
    gamma_choices: Sequence[float] = HOPE_TRAIN_GAMMAS,
    rng: random.Random | None = None,
) -> tuple[list[torch.Tensor], float]:
    gamma = _check_train_or_fixed("gamma", gamma, training, gamma_choices, "scales")
    cols, nxt = [], 0.0
    for seg in segments:
        if isinstance(seg, Text):
            cols.append(_text(nxt, seg.n, 3))
            nxt += seg.n
            continue
        g = float(_draw(gamma_choices, rng)) if training else gamma
        blk, last_t = _diagonal_block(nxt, seg, g)
        cols.append(blk)
        nxt = last_t + 1  # last t + 1 on the t row (spatial rows may overlap the next text)
    return cols, nxt


def _videorope(segments: Sequence[Segment], delta: float = 2.0, convention: str = "code") -> tuple[list[torch.Tensor], float]:
    delta = _check_positive("delta", delta)
    check_choice("convention", convention, VIDEOROPE_CONVENTIONS)
    paper = convention == "paper"
    cols, nxt = [], 0.0
    for seg in segments:
        if isinstance(seg, Text):
            cols.append(_text(nxt, seg.n, 3))
            nxt += seg.n
            continue
        blk, last_t = _diagonal_block(nxt, seg, delta, half_sizes=paper)
        cols.append(blk)
        # paper: the frames' spacing delta carries on into the text (T_s + delta * T_v); code: last t + 1
        nxt = nxt + delta * seg.T if paper else last_t + 1
    return cols, nxt


def _v2pe(
    segments: Sequence[Segment],
    delta: float = 1.0,
    training: bool = False,
    delta_choices: Sequence[float] = V2PE_TRAIN_DELTAS,
    rng: random.Random | None = None,
) -> tuple[list[torch.Tensor], float]:
    delta = _check_train_or_fixed("delta", delta, training, delta_choices, "steps")
    cols, nxt = [], 0.0
    for seg in segments:
        if isinstance(seg, Text):
            cols.append(_text(nxt, seg.n, 1))
            nxt += seg.n
            continue
        d = float(_draw(delta_choices, rng)) if training else delta
        p = (nxt - 1) + d * torch.arange(1, seg.num_tokens + 1, dtype=_F)
        cols.append(p[None])
        nxt = math.ceil(float(p[-1])) + 1  # next text at ceil(last visual) + 1 (training's rounding rule)
    return cols, nxt


def timestamp_text(seconds: float) -> str:
    """Qwen3-VL's timestamp text for one temporal patch, e.g. ``'<1.2 seconds>'`` (one decimal)."""
    return f"<{seconds:.1f} seconds>"


def estimate_timestamp_tokens(seconds: float) -> int:
    """Estimated token count of :func:`timestamp_text`: one per digit plus ``<``, ``.``, `` seconds``, ``>``.

    An assumption about Qwen's tokenizer (digits split one per token), not a tokenizer count: pass
    ``timestamp_tokens=lambda s: len(tokenizer(timestamp_text(s)).input_ids)`` for the real one.
    """
    return sum(c.isdigit() for c in f"{seconds:.1f}") + 4


def qwen3vl_timestamps(
    num_patches: int, fps: float = 2.0, temporal_patch_size: int = 2, seconds_per_grid: float | None = None
) -> list[float]:
    """Seconds of each temporal patch as Qwen3-VL's processor computes them: the mean time of the patch's
    first and last frame, ``(i + (p - 1) / (2p)) * s`` with ``s = p / fps`` (or ``seconds_per_grid``)."""
    if not _is_int(num_patches) or num_patches < 1:
        raise ValueError(f"num_patches must be an int >= 1, got {num_patches!r}")
    if not _is_int(temporal_patch_size) or temporal_patch_size < 1:
        raise ValueError(f"temporal_patch_size must be an int >= 1, got {temporal_patch_size!r}")
    p = temporal_patch_size
    spg = p / _check_positive("fps", fps) if seconds_per_grid is None else _check_positive("seconds_per_grid", seconds_per_grid)
    return [(i + (p - 1) / (2 * p)) * spg for i in range(num_patches)]


TimestampTokens = Union[int, Callable[[float], int]]


def _check_timestamp_tokens(timestamp_tokens: Any) -> None:
    if not callable(timestamp_tokens) and not (_is_int(timestamp_tokens) and timestamp_tokens >= 0):
        raise ValueError(
            f"timestamp_tokens must be an int >= 0 or a callable seconds -> int (tokens of one '<x.y seconds>' text), "
            f"got {timestamp_tokens!r}"
        )


def _timestamp_count(timestamp_tokens: TimestampTokens, seconds: float) -> int:
    n = timestamp_tokens(seconds) if callable(timestamp_tokens) else timestamp_tokens
    if not _is_int(n) or n < 0:
        raise ValueError(f"timestamp_tokens gave {n!r} for the timestamp {timestamp_text(seconds)}; it must be an int >= 0")
    return int(n)


def _is_video(seg: Visual) -> bool:
    # T = 1 without a duration is an image: Qwen3-VL puts no timestamp before images
    return seg.T > 1 or seg.seconds_per_grid is not None


def _qwen3vl(
    segments: Sequence[Segment],
    fps: float = 2.0,
    temporal_patch_size: int = 2,
    timestamp_tokens: TimestampTokens = estimate_timestamp_tokens,
    vision_markers: bool = True,
) -> tuple[list[torch.Tensor], float]:
    _check_timestamp_tokens(timestamp_tokens)
    qwen3vl_timestamps(1, fps, temporal_patch_size)  # validates fps and the patch size for every sample
    marker = 1.0 if vision_markers else 0.0
    cols, nxt = [], 0.0
    for seg in segments:
        if isinstance(seg, Text):
            cols.append(_text(nxt, seg.n, 3))
            nxt += seg.n
            continue
        extent = max(seg.H, seg.W)  # a (1, H, W) block spans max(H, W) indices: next = its max + 1
        tt, hh, ww = _mesh(seg.T, seg.H, seg.W)
        if not _is_video(seg):
            cols.append(torch.stack([tt, hh, ww]) + nxt)
            nxt += extent
            continue
        times = qwen3vl_timestamps(seg.T, fps, temporal_patch_size, seg.seconds_per_grid)
        # skipped indices before each patch: its timestamp text and <|vision_start|>; after it: <|vision_end|>
        before = torch.tensor([_timestamp_count(timestamp_tokens, s) + marker for s in times], dtype=_F)
        span = before + extent + marker
        start = nxt + torch.cumsum(span, 0) - span + before  # index of each patch's (0, 0) token
        s = start[tt.long()]
        cols.append(torch.stack([s, s + hh, s + ww]))
        nxt += float(span.sum())
    return cols, nxt


def qwen3vl_video_segments(
    video: Visual,
    fps: float = 2.0,
    temporal_patch_size: int = 2,
    timestamp_tokens: TimestampTokens = estimate_timestamp_tokens,
    vision_markers: bool = True,
) -> list[Segment]:
    """Qwen3-VL's token layout of one video: per temporal patch ``Text(timestamp [+ <|vision_start|>])``,
    ``Visual(1, H, W)``, ``[Text(<|vision_end|>)]``, with adjacent text merged.

    ``build_positions('qwen3vl', ...)`` gives the visual tokens of this layout the same ids as the compact
    ``video`` (whose timestamp indices it skips); use it to feed the timestamp tokens themselves.
    """
    if not isinstance(video, Visual):
        raise TypeError(f"qwen3vl_video_segments takes one Visual(T, H, W), got {video!r}")
    if not isinstance(vision_markers, bool):
        raise TypeError(f"vision_markers must be a bool, got {vision_markers!r}")
    _check_timestamp_tokens(timestamp_tokens)
    video = validate_segments([video])[0]
    marker = int(vision_markers)
    out: list[Segment] = []
    pending = 0  # text tokens not yet emitted (the previous <|vision_end|> merges with the next timestamp)
    for s in qwen3vl_timestamps(video.T, fps, temporal_patch_size, video.seconds_per_grid):
        pending += _timestamp_count(timestamp_tokens, s) + marker
        if pending:
            out.append(Text(pending))
        out.append(Visual(1, video.H, video.W))  # no duration: a (1, H, W) block, nothing skipped
        pending = marker
    if pending:
        out.append(Text(pending))
    return out


def _always_integer(kw: dict[str, Any]) -> bool:
    return True


def _never_integer(kw: dict[str, Any]) -> bool:
    return False  # fractional scales by design


def _mrope_integer(kw: dict[str, Any]) -> bool:
    timed = kw.get("fps") is not None or kw.get("seconds_per_grid") is not None or kw.get("_any_block_time", False)
    return not timed or kw.get("time_floor", True) or kw.get("time_rule", "exact") != "exact"


def _stride_integer(kw: dict[str, Any]) -> bool:
    return float(kw.get("temporal_stride", 1.0)).is_integer()


def _videorope_integer(kw: dict[str, Any]) -> bool:
    # the paper's H/2, W/2 centring gives half-integers for odd sizes
    return kw.get("convention", "code") == "code" and float(kw.get("delta", 2.0)).is_integer()


@dataclass(frozen=True)
class PositionScheme:
    """Everything vispe knows about one multimodal position scheme, registered once in :data:`SCHEMES`.

    The rotary encoding registered under the same ``name`` (``vispe.create_encoding(name, ...)``) holds the
    frequency layout; the video-LLM, the NIAH task and benchmark, and the HF integration read this record.

    Attributes:
        name: the scheme's (and its rotary encoding's) registry name.
        label: display name in tables and plots.
        num_coords: coordinates per token (``K`` of ``pos (K, L)``).
        builder: ``builder(segments, **options) -> (columns, next_free_position)``.
        integer_valued: whether the options can only give integer positions (decides the dtype).
        train_draws: the builder draws a scale per visual block while training (``training=`` option).
        eval_options: evaluation-time options the NIAH task and benchmark use by default.
        bool_options: options that must be ``bool``.
    """

    name: str
    label: str
    num_coords: int
    builder: Callable[..., tuple[list[torch.Tensor], float]]
    integer_valued: Callable[[dict[str, Any]], bool] = _always_integer
    train_draws: bool = False
    eval_options: Mapping[str, Any] = field(default_factory=dict)
    bool_options: tuple[str, ...] = ()

    def options(self) -> list[str]:
        """The builder's option names."""
        import inspect

        return [p for p in inspect.signature(self.builder).parameters if p != "segments"]

    def builder_options(self, options: Mapping[str, Any], training: bool) -> dict[str, Any]:
        """``options`` plus the train/eval switch for schemes that draw scales while training."""
        kw = dict(options)
        if self.train_draws:
            kw.setdefault("training", training)
        return kw


#: The registered multimodal position schemes, in the order tables list them.
SCHEMES: dict[str, PositionScheme] = {
    rec.name: rec
    for rec in (
        PositionScheme("rope_1d", "1D RoPE", 1, _rope_1d),
        PositionScheme("mrope", "M-RoPE", 3, _mrope, _mrope_integer),
        PositionScheme("mrope_interleave", "MRoPE-I", 3, _reset, _stride_integer, bool_options=("spatial_reset",)),
        PositionScheme("mhrope", "MHRoPE", 3, _reset, _stride_integer, bool_options=("spatial_reset",)),
        PositionScheme("vrope", "VRoPE", 4, _vrope),
        # VideoRoPE: the paper's (and its code's) delta = 2
        PositionScheme("videorope", "VideoRoPE", 3, _videorope, _videorope_integer, eval_options={"delta": 2.0}),
        # HoPE: the paper's V-NIAH gamma; V2PE: delta = 64/256 (its README's long-context setting)
        PositionScheme("hope", "HoPE", 3, _hope, _never_integer, train_draws=True, eval_options={"gamma": 0.75}),
        PositionScheme("v2pe", "V2PE", 1, _v2pe, _never_integer, train_draws=True, eval_options={"delta": 0.25}),
        # Qwen3-VL: 2 fps is its video processor's default sampling rate
        PositionScheme("qwen3vl", "Qwen3-VL", 3, _qwen3vl, bool_options=("vision_markers",), eval_options={"fps": 2.0}),
    )
}
#: Coordinates per token for each scheme (a view of :data:`SCHEMES`).
NUM_COORDS = {name: rec.num_coords for name, rec in SCHEMES.items()}
POSITION_SCHEMES = tuple(SCHEMES)


def get_scheme(scheme: str) -> PositionScheme:
    """The record of a registered scheme; an unknown name raises ``ValueError`` listing the valid ones."""
    rec = SCHEMES.get(scheme) if isinstance(scheme, str) else None
    if rec is None:
        raise ValueError(f"unknown position scheme {scheme!r}; choose one of {list(POSITION_SCHEMES)}")
    return rec


#: The rule of every position-scheme option, by name (a name means the same in every scheme that takes it),
#: checked by :func:`build_positions` before any position is built, in training and evaluation alike.
SCHEME_OPTION_CHECKS = {
    "fps": Positive(optional=True),
    "seconds_per_grid": Positive(optional=True),
    "tokens_per_second": Positive(),
    "temporal_patch_size": Int(1),
    "time_floor": Bool(),
    "temporal_stride": Positive(),
    "spatial_reset": Bool(),
    "delta": Positive(),
    "convention": Choice(VIDEOROPE_CONVENTIONS),
    "after_visual": Choice(MROPE_AFTER_VISUAL),
    "time_rule": Choice(MROPE_TIME_RULES),
    "gamma": Positive(),
    "training": Bool(),
    "gamma_choices": Seq(Positive(), min_length=1),
    "delta_choices": Seq(Positive(), min_length=1),
    "vision_markers": Bool(),
}
#: Largest position magnitude kept: float64 counts every integer exactly up to 2^53.
MAX_EXACT_POSITION = 2.0**53


def _check_scheme(scheme: str) -> None:
    get_scheme(scheme)


def _scheme_kwargs(scheme: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    rec = get_scheme(scheme)
    allowed = rec.options()
    unknown = [k for k in kwargs if k not in allowed]
    if unknown:
        raise TypeError(f"position scheme {scheme!r} got unknown option(s) {unknown}; valid options: {allowed}")
    for name in rec.bool_options:
        if name in kwargs and not isinstance(kwargs[name], bool):
            raise TypeError(f"{name} must be a bool, got {kwargs[name]!r}")
    check_options(f"position scheme {scheme!r}", SCHEME_OPTION_CHECKS, kwargs)
    return kwargs


def build_positions(
    scheme: str, segments: Sequence[Segment], *, spatial_merge_size: int = 1, **scheme_kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Position ids of one sample.

    Args:
        scheme: one of :data:`POSITION_SCHEMES`.
        segments: ``[Text(n) | Visual(T, H, W), ...]``.
        spatial_merge_size: ``Visual`` sizes are ViT-grid sizes merged ``m x m`` into one LLM token
            (``H, W`` must be divisible by ``m``); 1 means they already are LLM-grid sizes.
        **scheme_kwargs: the scheme's options (papers' names):
            ``mrope``: ``fps`` or ``seconds_per_grid``, ``tokens_per_second=2``, ``temporal_patch_size=2``,
            ``time_floor=True``, ``after_visual='max'`` (or ``'spatial'``: transformers 5.x's rule, see
            :data:`MROPE_AFTER_VISUAL`), ``time_rule='exact'`` (or ``'float32'``, ``'float64'``, ...: transformers'
            truncated float product, see :data:`MROPE_TIME_RULES`); ``mrope_interleave``/``mhrope``: ``temporal_stride=1``, ``spatial_reset=True``;
            ``videorope``: ``delta=2.0``, ``convention='code'`` (or ``'paper'``);
            ``hope``: ``gamma=1.0`` (inference), ``training=False``, ``gamma_choices``, ``rng``;
            ``v2pe``: ``delta=1.0`` (inference), ``training=False``, ``delta_choices``, ``rng``;
            ``qwen3vl``: ``fps=2.0``, ``temporal_patch_size=2``, ``timestamp_tokens`` (int or
            ``seconds -> int``, default :func:`estimate_timestamp_tokens`), ``vision_markers=True``.

    Returns:
        ``(pos, rope_delta)``: ``pos`` of shape ``(K, L)`` (int64, or float32 for fractional schemes)
        and a 0-d tensor ``rope_delta = next_free_position - L`` of the same dtype.
    """
    _check_scheme(scheme)
    segs = validate_segments(segments, spatial_merge_size)
    kw = _scheme_kwargs(scheme, dict(scheme_kwargs))
    rec = get_scheme(scheme)
    cols, nxt = rec.builder(segs, **kw)
    pos = torch.cat(cols, dim=1)
    L = pos.shape[1]
    top = max(float(pos.abs().max()), abs(nxt))
    if not math.isfinite(top) or top > MAX_EXACT_POSITION:
        raise ValueError(
            f"position scheme {scheme!r}: these options and segments ({kw}) give positions up to {top:g}, past 2^53 where "
            f"positions stop being exact (or not finite); use a smaller time scale (fps, seconds_per_grid, "
            f"tokens_per_second, delta, gamma) or a shorter sequence"
        )
    if any(isinstance(s, Visual) and s.seconds_per_grid is not None for s in segs):
        kw = dict(kw, _any_block_time=True)  # per-block absolute time (read by M-RoPE's dtype rule)
    if rec.integer_valued(kw):
        dtype = torch.int64
    else:  # float32 unless it would merge or move positions (past 2^24, fine fractional steps on large offsets)
        exact = torch.equal(pos.to(torch.float32).to(torch.float64), pos) and float(torch.tensor(nxt - L, dtype=torch.float32)) == nxt - L
        dtype = torch.float32 if exact else torch.float64
    return pos.to(dtype), torch.tensor(nxt - L, dtype=torch.float64).to(dtype)


@dataclass
class BatchPositions:
    """Padded batch: ``pos (K, B, L)``, ``rope_delta (B,)``, ``attention_mask (B, L)`` (bool, True = real),
    ``lengths (B,)``. ``rope_delta`` is relative to the padded length ``L``: the token appended at cache
    index ``j >= L`` of row ``b`` gets position ``j + rope_delta[b]``."""

    pos: torch.Tensor
    rope_delta: torch.Tensor
    attention_mask: torch.Tensor
    lengths: torch.Tensor

    def __iter__(self):  # allows ``pos, rope_delta, mask, lengths = build_positions_batch(...)``
        return iter((self.pos, self.rope_delta, self.attention_mask, self.lengths))


def build_positions_batch(
    scheme: str,
    batch: Sequence[Sequence[Segment]],
    *,
    padding_side: str = "left",
    pad_position: int = 0,
    spatial_merge_size: int = 1,
    **scheme_kwargs: Any,
) -> BatchPositions:
    """Position ids for a batch of samples, padded to the longest one.

    ``padding_side='left'`` (generation) puts pads before the tokens, ``'right'`` after. Pad slots get
    ``pad_position`` on every coordinate (they must be masked with ``attention_mask``). Random draws
    (HoPE/V2PE at training) are independent per visual block.
    """
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side={padding_side!r}; choose 'left' or 'right'")
    if isinstance(batch, (Text, Visual)) or not len(batch):
        raise ValueError("build_positions_batch needs a non-empty list of samples (each a list of segments)")
    if all(isinstance(s, (Text, Visual)) for s in batch):
        raise ValueError("build_positions_batch got one sample (a list of segments); wrap it in a list or use build_positions")
    built = [build_positions(scheme, s, spatial_merge_size=spatial_merge_size, **scheme_kwargs) for s in batch]
    dtype = torch.int64
    if any(p.dtype.is_floating_point for p, _ in built):  # float32 only where it holds every row's positions exactly
        exact = all(torch.equal(p.to(torch.float32).to(p.dtype), p) for p, _ in built)
        dtype = torch.float32 if exact else torch.float64
    K = built[0][0].shape[0]
    lengths = torch.tensor([p.shape[1] for p, _ in built])
    L = int(lengths.max())
    pos = torch.full((K, len(built), L), pad_position, dtype=dtype)
    mask = torch.zeros(len(built), L, dtype=torch.bool)
    deltas = torch.empty(len(built), dtype=torch.float64)
    for b, (p, d) in enumerate(built):
        n = p.shape[1]
        sl = slice(L - n, L) if padding_side == "left" else slice(0, n)
        pos[:, b, sl] = p.to(dtype)
        mask[b, sl] = True
        deltas[b] = float(d) + n - L  # next_free - L_padded
    return BatchPositions(pos, deltas.to(dtype), mask, lengths)


def decode_positions(rope_delta: torch.Tensor, cache_index: int, num_coords: int, num_new: int = 1) -> torch.Tensor:
    """Positions ``(K, B, num_new)`` of tokens generated at cache indices ``cache_index ..`` (all coordinates equal)."""
    rope_delta = torch.as_tensor(rope_delta)
    if rope_delta.ndim == 0:
        rope_delta = rope_delta[None]
    steps = torch.arange(cache_index, cache_index + num_new, device=rope_delta.device)
    p = steps[None, :].to(rope_delta.dtype) + rope_delta[:, None]
    return p[None].expand(num_coords, -1, -1)
