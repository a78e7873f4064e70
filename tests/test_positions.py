"""Multimodal position ids (vispe.positions) and the LLM-side rotary encodings (multimodal_rope)."""
from __future__ import annotations

import math
import random

import pytest
import torch

import vispe  # noqa: F401  (registers encodings)
from vispe.encodings import EncodingContext, create_encoding
from vispe.encodings.rotary import apply_rotary
from vispe.positions import (
    HOPE_TRAIN_GAMMAS,
    NUM_COORDS,
    Text,
    Visual,
    build_positions,
    build_positions_batch,
)

SCHEMES = list(NUM_COORDS)
EX = [Text(3), Visual(2, 2, 3), Text(2)]  # the reference's worked-example sample
# scheme options used where a scheme needs a fixed value at inference
OPTS = {"hope": dict(gamma=0.75), "v2pe": dict(delta=0.25)}


def enc(name: str, head_dim: int = 32, num_heads: int = 4, **kw):
    ctx = EncodingContext(dim=head_dim * num_heads, num_heads=num_heads, depth=1, grid_size=(1, 1, 1), num_prefix_tokens=0)
    return create_encoding(name, ctx, **kw)


def scores(e, q, k, pos):
    """All q.k scores (B, H, L, L) after rotation by the encoding's table for ``pos`` (K, L)."""
    table = e.table_from_positions(pos[:, None])
    return e.rotate(q, table) @ e.rotate(k, table).transpose(-1, -2)


# ---------------------------------------------------------------------------------------------
# worked examples of the reference (exact)
# ---------------------------------------------------------------------------------------------


def test_mrope_worked_example():
    pos, delta = build_positions("mrope", EX)
    frame0 = [(3, 3, 3), (3, 3, 4), (3, 3, 5), (3, 4, 3), (3, 4, 4), (3, 4, 5)]
    frame1 = [(4, h, w) for _, h, w in frame0]
    expected = [(i, i, i) for i in range(3)] + frame0 + frame1 + [(6, 6, 6), (7, 7, 7)]
    assert pos.T.tolist() == [list(e) for e in expected]
    assert pos.dtype == torch.int64
    assert int(delta) == 8 - 17  # next free position 8, L = 17


def test_mrope_text_after_block_uses_max_over_all_rows():
    # t_last + 1 would give 2, but the w row reached 7 -> next text at max over all rows + 1 (pitfall 1)
    pos, _ = build_positions("mrope", [Text(1), Visual(1, 2, 7), Text(1)])
    assert pos[:, -1].tolist() == [8, 8, 8]


def test_vrope_worked_example():
    pos, delta = build_positions("vrope", EX)
    frame0 = [(3, 5, 4, 6), (4, 4, 5, 5), (5, 3, 6, 4), (4, 6, 3, 5), (5, 5, 4, 4), (6, 4, 5, 3)]
    frame1 = [tuple(v + 4 for v in tok) for tok in frame0]
    expected = [(i,) * 4 for i in range(3)] + frame0 + frame1 + [(11,) * 4, (12,) * 4]
    assert pos.T.tolist() == [list(e) for e in expected]
    assert int(delta) == 13 - 17


def test_hope_worked_example():
    pos, delta = build_positions("hope", EX, gamma=0.5)
    frame0 = [(3, 3, 2), (3, 3, 3), (3, 3, 4), (3, 4, 2), (3, 4, 3), (3, 4, 4)]
    frame1 = [tuple(v + 0.5 for v in tok) for tok in frame0]
    expected = [(i,) * 3 for i in range(3)] + frame0 + frame1 + [(4.5,) * 3, (5.5,) * 3]
    assert pos.dtype == torch.float32
    assert pos.T.tolist() == [list(e) for e in expected]
    assert float(delta) == 6.5 - 17


def test_spatial_reset_worked_example():
    pos, delta = build_positions("mrope_interleave", EX, spatial_reset=True)
    frame0 = [(3, h, w) for h in range(2) for w in range(3)]
    frame1 = [(4, h, w) for h in range(2) for w in range(3)]
    expected = [(i,) * 3 for i in range(3)] + frame0 + frame1 + [(6,) * 3, (7,) * 3]
    assert pos.T.tolist() == [list(e) for e in expected]
    # tokens outside the block sit exactly where plain M-RoPE puts them
    ref, ref_delta = build_positions("mrope", EX)
    assert torch.equal(pos[:, :3], ref[:, :3]) and torch.equal(pos[:, -2:], ref[:, -2:]) and delta == ref_delta
    # without the reset (stride 1) the positions are plain M-RoPE's
    assert torch.equal(build_positions("mrope_interleave", EX, spatial_reset=False)[0], ref)
    assert torch.equal(build_positions("mhrope", EX)[0], pos)


def test_mrope_absolute_time():
    seg = [Text(1), Visual(4, 1, 1), Text(1)]
    # one t unit = 0.5 s regardless of the sampling rate (tokens_per_second = 2, 2-frame patches)
    for fps, step in [(2.0, 2), (1.0, 4), (4.0, 1)]:
        pos, _ = build_positions("mrope", seg, fps=fps, tokens_per_second=2)
        assert pos[0, 1:5].tolist() == [1 + step * i for i in range(4)]
    # above 2 fps the step is fractional: float multiply then floor, never zeroed (pitfall 5)
    pos, _ = build_positions("mrope", seg, fps=8.0, tokens_per_second=2)
    assert pos[0, 1:5].tolist() == [1, 1, 2, 2]
    pos, _ = build_positions("mrope", seg, fps=8.0, tokens_per_second=2, time_floor=False)
    assert pos.dtype == torch.float32 and pos[0, 1:5].tolist() == [1.0, 1.5, 2.0, 2.5]
    # seconds_per_grid on the block overrides the scheme-level value; images (T=1) keep t constant
    pos, _ = build_positions("mrope", [Text(1), Visual(3, 1, 1, seconds_per_grid=1.5)], tokens_per_second=2)
    assert pos[0, 1:].tolist() == [1, 4, 7]
    pos, _ = build_positions("mrope", [Visual(1, 2, 2)], seconds_per_grid=2.0)
    assert pos[0].tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="fps"):
        build_positions("mrope", seg, fps=0)


def test_mrope_absolute_time_is_exact_rational():
    """Temporal ids are floor(t * (p / fps) * tokens_per_second) in exact arithmetic: a float64 product
    floors 3 * (2/3) * 25 = 49.999... to 49 (main before issue 27: 78 of these 640 ids one step low)."""
    from fractions import Fraction

    wrong = 0
    for fps in (1.5, 3, 6, 12, 24):
        for tps in (2, 25):
            pos, _ = build_positions("mrope", [Visual(64, 1, 1)], fps=fps, tokens_per_second=tps)
            exact = [math.floor(t * Fraction(2) / Fraction(fps) * tps) for t in range(64)]
            wrong += sum(a != b for a, b in zip(pos[0].tolist(), exact))
    assert wrong == 0
    pos, _ = build_positions("mrope", [Visual(64, 1, 1)], fps=3, tokens_per_second=25)
    assert pos[0, 3].item() == 50
    # a float seconds_per_grid stands for the rational it was typed as (2/3 s, 29.97 fps)
    pos, _ = build_positions("mrope", [Visual(4, 1, 1, seconds_per_grid=2 / 3)], tokens_per_second=25)
    assert pos[0].tolist() == [0, 16, 33, 50]
    pos, _ = build_positions("mrope", [Visual(31, 1, 1)], fps=29.97, tokens_per_second=2)
    assert pos[0].tolist() == [math.floor(t * Fraction(2) * 100 / 2997 * 2) for t in range(31)]
    pos, _ = build_positions("mrope", [Visual(4, 1, 1)], fps=3, tokens_per_second=25, time_floor=False)
    assert torch.allclose(pos[0].double(), torch.tensor([0, 50 / 3, 100 / 3, 50], dtype=torch.float64))


def test_mrope_absolute_time_matches_transformers_qwen2_5_vl():
    """transformers' own Qwen2.5-VL ``get_vision_position_ids`` (the processor's seconds-per-grid as a float32
    tensor, as ``Qwen2_5_VLProcessor`` makes it) gives the same temporal ids over the fps x tps scan."""
    qwen = pytest.importorskip("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl")
    for fps in (1.5, 3, 6, 12, 24):
        for tps in (2, 25):
            spg = torch.tensor([2 / fps])  # float32, as the processor stores second_per_grid_ts
            ref = qwen.Qwen2_5_VLModel.get_vision_position_ids(None, 0, torch.tensor([64, 1, 1]), 1, 1, tps * spg[0])
            pos, _ = build_positions("mrope", [Visual(64, 1, 1)], fps=fps, tokens_per_second=tps)
            assert pos[0].tolist() == ref[0].tolist(), (fps, tps)


def test_v2pe_visual_positions_advance_by_delta():
    for delta in (1 / 256, 0.25, 0.5, 1.0):
        pos, rd = build_positions("v2pe", [Text(3), Visual(1, 4, 5), Text(2)], delta=delta)
        vis = pos[0, 3:23].double()
        assert vis[0].item() == pytest.approx(2 + delta)
        assert torch.allclose(vis.diff(), torch.full((19,), delta, dtype=torch.float64), atol=1e-6)
        nxt = math.ceil(2 + 20 * delta) + 1
        assert pos[0, 23:].tolist() == [nxt, nxt + 1]
    # delta = 1 reduces to plain 1D positions
    pos, rd = build_positions("v2pe", [Text(3), Visual(1, 4, 5), Text(2)], delta=1.0)
    assert pos[0].tolist() == list(range(25)) and float(rd) == 0.0


def test_vrope_text_after_video_continues_without_jump():
    for T, H, W in [(1, 1, 1), (2, 2, 3), (3, 4, 4), (5, 3, 7)]:
        pos, _ = build_positions("vrope", [Text(2), Visual(T, H, W), Text(1)])
        n_vis = T * H * W
        last_frame = pos[:, 2 + n_vis - H * W : 2 + n_vis]
        # first text token = last frame's maximum + 1 on every coordinate; frames tile the axis
        assert pos[:, -1].tolist() == [int(last_frame.max()) + 1] * 4
        frame_min = pos[:, 2 : 2 + n_vis].reshape(4, T, H * W).amin(dim=(0, 2))
        frame_max = pos[:, 2 : 2 + n_vis].reshape(4, T, H * W).amax(dim=(0, 2))
        assert frame_min[0].item() == 2 and torch.equal(frame_min[1:], frame_max[:-1] + 1)
        # every frame's centre lies on the text diagonal: all four coordinates agree there
        if H % 2 and W % 2:
            c = 2 + (H // 2) * W + W // 2
            assert len(set(pos[:, c].tolist())) == 1


def test_hope_dynamic_temporal_scaling():
    rng = random.Random(0)
    seen = set()
    for _ in range(20):
        pos, _ = build_positions("hope", [Visual(3, 1, 1), Text(1), Visual(2, 1, 1)], training=True, rng=rng)
        seen.add(round(float(pos[0, 1] - pos[0, 0]), 4))
        seen.add(round(float(pos[0, 5] - pos[0, 4]), 4))
    assert seen <= set(HOPE_TRAIN_GAMMAS) and len(seen) >= 3  # drawn per block from the training set
    fixed = [build_positions("hope", [Visual(3, 1, 1)], gamma=0.75)[0] for _ in range(3)]
    assert all(torch.equal(f, fixed[0]) for f in fixed) and float(fixed[0][0, 1]) == 0.75


def test_rope_1d_counts_every_visual_token():
    pos, delta = build_positions("rope_1d", EX)
    assert pos.shape == (1, 17) and pos[0].tolist() == list(range(17)) and int(delta) == 0


# ---------------------------------------------------------------------------------------------
# properties for every scheme
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", SCHEMES)
def test_shape_and_rope_delta_continue_like_a_longer_prefill(scheme):
    segs = [Text(2), Visual(3, 2, 4), Text(1), Visual(1, 3, 2)]  # ends with a visual block
    pos, delta = build_positions(scheme, segs, **OPTS.get(scheme, {}))
    L = pos.shape[1]
    assert pos.shape == (NUM_COORDS[scheme], 2 + 24 + 1 + 6)
    longer, _ = build_positions(scheme, segs + [Text(3)], **OPTS.get(scheme, {}))
    # a token generated at cache index j sits at j + rope_delta on every coordinate
    for j in range(3):
        assert torch.allclose(longer[:, L + j].double(), torch.full((pos.shape[0],), L + j + float(delta), dtype=torch.float64))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("side", ["left", "right"])
def test_batched_padding(scheme, side):
    batch = [EX, [Text(2)], [Visual(1, 2, 2), Text(4)]]
    bp = build_positions_batch(scheme, batch, padding_side=side, **OPTS.get(scheme, {}))
    K, B, L = bp.pos.shape
    assert (K, B) == (NUM_COORDS[scheme], 3) and bp.attention_mask.sum(1).tolist() == bp.lengths.tolist()
    for b, segs in enumerate(batch):
        p, d = build_positions(scheme, segs, **OPTS.get(scheme, {}))
        assert torch.equal(bp.pos[:, b][:, bp.attention_mask[b]], p.to(bp.pos.dtype))
        # rope_delta is relative to the padded length: next free position - L
        assert float(bp.rope_delta[b]) == pytest.approx(float(d) + p.shape[1] - L)
    real = bp.attention_mask.nonzero()[:, 1]
    if side == "left":
        assert bool(bp.attention_mask[:, -1].all())
    else:
        assert bool(bp.attention_mask[:, 0].all()) and int(real.min()) == 0


@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s != "hope"])
def test_text_only_equals_plain_1d_rope(scheme):
    head_dim = 32
    e, ref = enc(scheme, head_dim), enc("rope_1d", head_dim)
    pos, delta = build_positions(scheme, [Text(11)])
    assert int(delta) == 0 and all(pos[k].tolist() == list(range(11)) for k in range(pos.shape[0]))
    t = e.table_from_positions(pos[:, None])
    t_ref = ref.table_from_positions(torch.arange(11)[None, None])
    assert torch.equal(t.expand_as(t) if t.shape[1] > 1 else t, t_ref.expand_as(t))
    # and the same as an independent textbook RoPE in the 'half' layout
    x = torch.randn(1, 4, 11, head_dim)
    inv = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.arange(11, dtype=torch.float64)[:, None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    rot_half = torch.cat([-x[..., head_dim // 2 :], x[..., : head_dim // 2]], -1)
    naive = (x.double() * cos + rot_half.double() * sin).float()
    assert torch.allclose(e.rotate(x, t), naive, atol=1e-5)


def test_hope_text_is_1d_rope_except_the_zero_frequency_pairs():
    e, ref = enc("hope", 32), enc("rope_1d", 32)
    pos, _ = build_positions("hope", [Text(9)])
    t, t_ref = e.table_from_positions(pos[:, None]), ref.table_from_positions(pos[:1, None])
    P, tp = e.num_pairs, e.temporal_pairs
    assert torch.equal(t[..., : P - tp], t_ref[..., : P - tp])
    assert torch.equal(t[..., P - tp :], torch.ones_like(t[..., P - tp :]))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("shift", [7.0, 53.5])
def test_scores_invariant_to_a_constant_shift(scheme, shift):
    torch.manual_seed(0)
    e = enc(scheme, 32, 4)
    pos, _ = build_positions(scheme, [Text(3), Visual(2, 3, 2), Text(4)], **OPTS.get(scheme, {}))
    q, k = torch.randn(1, 4, pos.shape[1], 32), torch.randn(1, 4, pos.shape[1], 32)
    s0 = scores(e, q, k, pos.double())
    s1 = scores(e, q, k, pos.double() + shift)
    assert torch.allclose(s0, s1, atol=1e-4, rtol=1e-4)
    # sanity: a non-constant change (text vs visual) does change scores
    bumped = pos.double().clone()
    bumped[:, -1] += 3
    assert not torch.allclose(s0, scores(e, q, k, bumped), atol=1e-3)


def test_hope_temporal_pairs_have_zero_frequency():
    e = enc("hope", 128)  # d = 128: pairs 48..63 are the temporal ones
    amap, freq = e.axis_map(), e.pair_frequencies()
    assert e.temporal_pairs == 16
    assert (amap[48:] == 0).all() and torch.equal(freq[48:], torch.zeros(16))
    assert (freq[:48] > 0).all()
    assert amap[:48].tolist() == [1, 2] * 24  # h on even, w on odd pairs
    # the t coordinate has no effect on the rotation at all
    pos, _ = build_positions("hope", [Text(2), Visual(4, 2, 2)], gamma=1.0)
    moved = pos.clone()
    moved[0] += torch.arange(pos.shape[1]) * 3.7
    assert torch.equal(e.table_from_positions(pos[:, None]), e.table_from_positions(moved[:, None]))


def test_mrope_interleave_map_is_round_robin():
    e = enc("mrope_interleave", 128)
    a = e.axis_map()
    assert e.mrope_section == [24, 20, 20]
    assert a[:60].tolist() == [0, 1, 2] * 20 and a[60:].tolist() == [0] * 4
    assert torch.bincount(a).tolist() == [24, 20, 20]
    small = enc("mrope_interleave", 32).axis_map()  # P = 16: [6, 5, 5]
    assert small[:15].tolist() == [0, 1, 2] * 5 and small[15].item() == 0


def test_mrope_chunked_map_default_section():
    e = enc("mrope", 128)
    assert e.mrope_section == [16, 24, 24]
    assert e.axis_map().tolist() == [0] * 16 + [1] * 24 + [2] * 24
    with pytest.raises(ValueError, match="mrope_section"):
        enc("mrope", 32, mrope_section=[4, 4, 4])


def test_mhrope_per_head_axis_and_full_ladder():
    e = enc("mhrope", 16, num_heads=8)
    amap = e.axis_map()
    assert e.mrope_section == [2, 3, 3] and amap.shape == (8, 8)
    assert amap[:, 0].tolist() == [0, 0, 1, 1, 1, 2, 2, 2] and (amap == amap[:, :1]).all()
    pos, _ = build_positions("mhrope", [Text(1), Visual(2, 2, 2)])
    ang = e.angles_from_positions(pos[:, None])  # (B, H, L, P)
    inv = e.inv_freq()
    for h in range(8):
        axis = int(amap[h, 0])
        assert torch.allclose(ang[0, h], pos[axis].float()[:, None] * inv)
    nope = enc("mhrope", 16, num_heads=8, mrope_section=[2, 2, 2])  # heads 6, 7: NoPE
    assert (nope.axis_map()[6:] == -1).all()
    assert torch.equal(nope.angles_from_positions(pos[:, None])[0, 6:], torch.zeros(2, pos.shape[1], 8))


def test_vrope_map_and_rotation_layouts():
    e = enc("vrope", 32)
    assert e.axis_map().tolist() == [i % 4 for i in range(16)]
    # the 'half' and 'interleaved' layouts rotate the same pairs, only stored differently
    pos, _ = build_positions("vrope", EX)
    table = e.table_from_positions(pos[:, None])
    x = torch.randn(1, 2, pos.shape[1], 32)
    half = apply_rotary(x, table, "half")
    x_il = torch.stack([x[..., :16], x[..., 16:]], -1).flatten(-2)  # pair i -> channels (2i, 2i+1)
    il = apply_rotary(x_il, table, "interleaved")
    assert torch.allclose(torch.cat([il[..., 0::2], il[..., 1::2]], -1), half, atol=1e-6)


def test_angles_are_float32_under_autocast():
    e = enc("mrope", 32)
    pos, _ = build_positions("mrope", [Text(5), Visual(1, 2, 2)])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ang = e.angles_from_positions(pos[:, None] + 100000)
    assert ang.dtype == torch.float32
    assert torch.allclose(ang[0, 0, :, 0], (pos[0] + 100000).float())  # pair 0 has frequency 1, exact


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "segs, match",
    [
        ([], "at least one segment"),
        ([Text(2), Visual(0, 2, 2)], "empty or negative visual block"),
        ([Visual(1, -2, 2)], "empty or negative visual block"),
        ([Text(-1)], "n >= 0"),
        ([Text(0)], "no tokens"),
        (["hello"], "Text\\(n\\) or Visual"),
    ],
)
def test_bad_segment_lists_raise(segs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        build_positions("mrope", segs)


def test_merge_size_divisibility():
    pos, _ = build_positions("mrope", [Visual(2, 4, 6)], spatial_merge_size=2)
    assert pos.shape == (3, 2 * 2 * 3)
    with pytest.raises(ValueError, match="not divisible by the spatial merge size 2"):
        build_positions("mrope", [Text(1), Visual(2, 3, 4)], spatial_merge_size=2)


def test_bad_scheme_and_options():
    with pytest.raises(ValueError, match="unknown position scheme"):
        build_positions("rope3d", EX)
    with pytest.raises(TypeError, match="valid options"):
        build_positions("mrope", EX, gamma=0.5)
    with pytest.raises(ValueError, match="gamma"):
        build_positions("hope", EX, gamma=-1)
    with pytest.raises(ValueError, match="delta"):
        build_positions("v2pe", EX, delta=0)
    with pytest.raises(ValueError, match="padding_side"):
        build_positions_batch("mrope", [EX], padding_side="middle")
    e = enc("vrope", 32)
    with pytest.raises(ValueError, match="K=4"):
        e.table_from_positions(torch.zeros(3, 1, 5))
