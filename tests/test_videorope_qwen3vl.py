"""VideoRoPE (Wei et al., ICML 2025) and Qwen3-VL's timestamped video layout: worked examples written from
the paper's Eq. 7 / the released code's rules, oracle re-implementations, frequency maps, relative property."""
from __future__ import annotations

import pytest
import torch

import vispe  # noqa: F401  (registers encodings)
from vispe.encodings import EncodingContext, create_encoding
from vispe.positions import (
    Text,
    Visual,
    build_positions,
    decode_positions,
    estimate_timestamp_tokens,
    qwen3vl_timestamps,
    qwen3vl_video_segments,
    timestamp_text,
)

EX = [Text(3), Visual(2, 2, 3), Text(2)]  # 3 text tokens, 2 frames of 2 x 3 tokens, 2 text tokens


def enc(name: str, head_dim: int = 32, num_heads: int = 2, **kw):
    ctx = EncodingContext(dim=head_dim * num_heads, num_heads=num_heads, depth=1, grid_size=(1, 1, 1), num_prefix_tokens=0)
    return create_encoding(name, ctx, **kw)


def scores(e, q, k, pos):
    table = e.table_from_positions(pos[:, None])
    return e.rotate(q, table) @ e.rotate(k, table).transpose(-1, -2)


def rows(pos: torch.Tensor) -> list[list[float]]:
    return pos.T.tolist()


# ---------------------------------------------------------------------------------------------
# VideoRoPE positions
# ---------------------------------------------------------------------------------------------


def test_videorope_worked_example_code_convention():
    # released code, delta = 2: t = 3 + 2 * frame; h = t + row - (2-1)//2; w = t + col - (3-1)//2; text after = last t + 1
    pos, delta = build_positions("videorope", EX)
    frame0 = [(3, 3, 2), (3, 3, 3), (3, 3, 4), (3, 4, 2), (3, 4, 3), (3, 4, 4)]
    frame1 = [(5, 5, 4), (5, 5, 5), (5, 5, 6), (5, 6, 4), (5, 6, 5), (5, 6, 6)]
    expected = [(0, 0, 0), (1, 1, 1), (2, 2, 2)] + frame0 + frame1 + [(6, 6, 6), (7, 7, 7)]
    assert rows(pos) == [list(e) for e in expected]
    assert pos.dtype == torch.int64
    assert int(delta) == 8 - 17  # next free position 8, L = 17


def test_videorope_worked_example_paper_eq7():
    # Eq. 7 with T_s = 3, T_v = 2 frames of W x H = 3 x 2, delta = 2: t = 3 + 2 tau', x = t + w - 3/2, y = t + h - 2/2;
    # ending text tau = 5, 6 -> tau + (delta - 1) * T_v = 7, 8. vispe's rows are (t, h, w) = (t, y, x).
    pos, delta = build_positions("videorope", EX, convention="paper")
    frame0 = [(3, 2, 1.5), (3, 2, 2.5), (3, 2, 3.5), (3, 3, 1.5), (3, 3, 2.5), (3, 3, 3.5)]
    frame1 = [(5, 4, 3.5), (5, 4, 4.5), (5, 4, 5.5), (5, 5, 3.5), (5, 5, 4.5), (5, 5, 5.5)]
    expected = [(0, 0, 0), (1, 1, 1), (2, 2, 2)] + frame0 + frame1 + [(7, 7, 7), (8, 8, 8)]
    assert rows(pos) == [list(e) for e in expected]
    assert pos.dtype == torch.float32  # half-integer centring
    assert float(delta) == 9 - 17


def eq7(T_s: int, T_v: int, H: int, W: int, T_e: int, d: float) -> list[tuple[float, float, float]]:
    """The paper's Eq. 7, token by token (frames in raster order), as (t, y, x) = (t, h, w)."""
    out = [(float(tau),) * 3 for tau in range(T_s)]
    for f in range(T_v):
        t = T_s + d * f
        out += [(t, t + h - H / 2, t + w - W / 2) for h in range(H) for w in range(W)]
    out += [(float(tau + (d - 1) * T_v),) * 3 for tau in range(T_s + T_v, T_s + T_v + T_e)]
    return out


@pytest.mark.parametrize("T_s, T_v, H, W, T_e, d", [(0, 1, 1, 1, 1, 2.0), (4, 3, 3, 2, 2, 2.0), (2, 5, 2, 4, 3, 0.5), (1, 2, 5, 5, 1, 3.0)])
def test_videorope_paper_convention_equals_eq7(T_s, T_v, H, W, T_e, d):
    pos, delta = build_positions("videorope", [Text(T_s), Visual(T_v, H, W), Text(T_e)], delta=d, convention="paper")
    assert torch.equal(pos.double().T, torch.tensor(eq7(T_s, T_v, H, W, T_e, d), dtype=torch.float64))
    assert float(delta) == T_s + d * T_v + T_e - pos.shape[1]  # next free = last text + 1


@pytest.mark.parametrize("convention", ["code", "paper"])
@pytest.mark.parametrize("d", [1.0, 2.0, 0.75])
def test_videorope_text_after_the_video_and_decode_continue(convention, d):
    T_s, T_v, H, W = 2, 4, 3, 3
    segs = [Text(T_s), Visual(T_v, H, W)]  # ends with the video: the next token comes from rope_delta
    pos, delta = build_positions("videorope", segs, delta=d, convention=convention)
    last_t = T_s + d * (T_v - 1)
    first_text = last_t + 1 if convention == "code" else T_s + d * T_v
    L = pos.shape[1]
    longer, _ = build_positions("videorope", segs + [Text(3)], delta=d, convention=convention)
    assert longer[:, L:].double().tolist() == [[first_text + j for j in range(3)]] * 3
    # cached decoding: the token at cache index L + j gets L + j + rope_delta on every coordinate
    dec = decode_positions(delta.double(), L, 3, num_new=3)[:, 0]
    assert torch.equal(dec, longer[:, L:].double())
    # the frames sit delta apart on t, their centre on the diagonal (odd sizes: every coordinate equals t)
    vis = pos[:, T_s:].double().reshape(3, T_v, H * W)
    assert torch.equal(vis[0, :, 0], T_s + d * torch.arange(T_v, dtype=torch.float64))
    centre = vis[:, :, (H // 2) * W + W // 2]
    if convention == "code":
        assert torch.equal(centre, centre[:1].expand(3, -1))
    else:  # H/2 centring sits half a step below the middle token
        assert torch.equal(centre[1:], (centre[0] - 0.5).expand(2, -1))


def test_videorope_integer_dtype_only_when_every_id_is_integral():
    assert build_positions("videorope", EX, delta=3)[0].dtype == torch.int64
    assert build_positions("videorope", EX, delta=1.5)[0].dtype == torch.float32
    assert build_positions("videorope", EX, convention="paper", delta=2)[0].dtype == torch.float32


def test_hope_is_videorope_layout_with_gamma():
    # HoPE builds on VideoRoPE's layout (code convention); same positions at gamma = delta
    for g in (0.5, 2.0):
        hope, hd = build_positions("hope", EX, gamma=g)
        video, vd = build_positions("videorope", EX, delta=g)
        assert torch.equal(hope.double(), video.double()) and float(hd) == float(vd)


# ---------------------------------------------------------------------------------------------
# VideoRoPE frequencies
# ---------------------------------------------------------------------------------------------


def videorope_code_channel_rows(mrope_section=(16, 24, 24)) -> list[int]:
    """The released code's channel selection on the doubled ('half' layout) cos/sin: sections [48, 16, 48, 16],
    spatial sections alternating row 1 (h) / row 2 (w) channel by channel, temporal sections row 0."""
    s_t, s_hw = mrope_section[0], mrope_section[1] + mrope_section[2]
    out = []
    for half in range(2):
        out += [1 if j % 2 == 0 else 2 for j in range(s_hw)]
        out += [0] * s_t
    return out


def test_videorope_low_frequency_temporal_allocation():
    e = enc("videorope", 128)
    amap, freq = e.axis_map(), e.pair_frequencies()
    assert e.temporal_pairs == 16
    assert amap[:48].tolist() == [1, 2] * 24 and amap[48:].tolist() == [0] * 16
    # the released code's map, read on the doubled channels
    assert torch.cat([amap, amap]).tolist() == videorope_code_channel_rows()
    # every frequency is the base ladder (nothing zeroed), and t owns the 16 slowest pairs
    assert torch.equal(freq, e.inv_freq()) and bool((freq > 0).all())
    assert float(freq[amap == 0].max()) < float(freq[amap != 0].min())
    # moving t changes only the temporal pairs' angles
    pos, _ = build_positions("videorope", [Text(2), Visual(3, 2, 2)])
    moved = pos.double().clone()
    moved[0] += torch.arange(pos.shape[1]) * 1.7
    a0, a1 = e.angles_from_positions(pos[:, None]), e.angles_from_positions(moved[:, None])
    changed = (a0 != a1).any(dim=2)[0, 0]  # (P,)
    assert changed.tolist() == [False] * 48 + [True] * 16


def test_hope_shares_videorope_map_with_zero_temporal_frequency():
    v, h = enc("videorope", 64), enc("hope", 64)
    assert torch.equal(v.axis_map(), h.axis_map())
    P, tp = v.num_pairs, v.temporal_pairs
    assert torch.equal(h.pair_frequencies()[: P - tp], v.pair_frequencies()[: P - tp])
    assert torch.equal(h.pair_frequencies()[P - tp :], torch.zeros(tp))


# ---------------------------------------------------------------------------------------------
# Qwen3-VL layout
# ---------------------------------------------------------------------------------------------


def test_qwen3vl_timestamps_follow_the_processor():
    # frames j sampled at fps sit at j / fps; a patch of p frames is stamped with (first + last) / 2
    for fps, p in [(2.0, 2), (1.0, 2), (4.0, 1), (3.0, 3)]:
        want = [((i * p) / fps + (i * p + p - 1) / fps) / 2 for i in range(4)]
        assert qwen3vl_timestamps(4, fps, p) == pytest.approx(want)
    assert qwen3vl_timestamps(3, seconds_per_grid=1.5) == pytest.approx([0.375, 1.875, 3.375])  # p = 2: offset s / 4
    assert [timestamp_text(s) for s in qwen3vl_timestamps(2)] == ["<0.2 seconds>", "<1.2 seconds>"]
    assert estimate_timestamp_tokens(0.25) == 6 and estimate_timestamp_tokens(12.25) == 7


def test_qwen3vl_worked_example():
    # prompt of 3 tokens, a 2-patch video of 2 x 2 merged tokens at 2 fps, 2 trailing tokens; 6 tokens per timestamp.
    # Qwen3-VL's sequence: T T T | <0.2 seconds>(6) <vs> F0(4) <ve> | <1.2 seconds>(6) <vs> F1(4) <ve> | T T
    # text ids run on; a frame block at st gets (st, st + h, st + w); after a block: its max + 1.
    seen = []

    def six(seconds: float) -> int:
        seen.append(seconds)
        return 6

    pos, delta = build_positions("qwen3vl", [Text(3), Visual(2, 2, 2), Text(2)], timestamp_tokens=six)
    # prompt 0..2; <0.2 seconds> 3..8, <vs> 9; F0 at 10 (max 11); <ve> 12; <1.2 seconds> 13..18, <vs> 19;
    # F1 at 20 (max 21); <ve> 22; trailing text 23, 24
    expected = [(0, 0, 0), (1, 1, 1), (2, 2, 2)]
    expected += [(10, 10, 10), (10, 10, 11), (10, 11, 10), (10, 11, 11)]
    expected += [(20, 20, 20), (20, 20, 21), (20, 21, 20), (20, 21, 21)]
    expected += [(23, 23, 23), (24, 24, 24)]
    assert rows(pos) == [list(e) for e in expected]
    assert pos.dtype == torch.int64
    assert seen == [0.25, 1.25]
    assert int(delta) == 25 - 13  # next free 25, L = 13 tokens in the sequence


def qwen3vl_reference(layout: list[tuple]) -> tuple[list[tuple[int, int, int]], int]:
    """Qwen3-VL's get_rope_index rule on an explicit token layout [('text', n) | ('frame', H, W)]:
    text ids continue from the previous maximum + 1, a (1, H, W) block at st is (st, st + h, st + w)."""
    ids: list[tuple[int, int, int]] = []
    nxt = 0
    for item in layout:
        if item[0] == "text":
            ids += [(nxt + i,) * 3 for i in range(item[1])]
            nxt += item[1]
        else:
            _, H, W = item
            ids += [(nxt, nxt + h, nxt + w) for h in range(H) for w in range(W)]
            nxt = max(max(r) for r in ids[-H * W:]) + 1
    return ids, nxt


@pytest.mark.parametrize("markers", [True, False])
def test_qwen3vl_compact_video_equals_the_explicit_layout_and_the_reference(markers):
    def count(seconds: float) -> int:  # a stand-in tokenizer: grows with the timestamp
        return len(timestamp_text(seconds)) - 9

    video = Visual(3, 2, 3, seconds_per_grid=6.0)  # patches at 1.5, 7.5, 13.5 s: 4, 4, 5 tokens
    opts = dict(timestamp_tokens=count, vision_markers=markers)
    compact = [Text(2), video, Text(3), Visual(1, 3, 2), Text(1)]  # a video, then an image
    expanded = [Text(2)] + qwen3vl_video_segments(video, **opts) + [Text(3), Visual(1, 3, 2), Text(1)]
    pos_c, d_c = build_positions("qwen3vl", compact, **opts)
    pos_e, d_e = build_positions("qwen3vl", expanded, **opts)
    # the explicit layout's tokens: keep the ones the compact form has (everything but timestamp / marker text)
    keep = [True] * 2
    for seg in expanded[1:-3]:
        keep += [isinstance(seg, Visual)] * (seg.n if isinstance(seg, Text) else seg.num_tokens)
    keep += [True] * (3 + 6 + 1)
    keep = torch.tensor(keep)
    assert torch.equal(pos_e[:, keep], pos_c)
    assert int(d_c) + pos_c.shape[1] == int(d_e) + pos_e.shape[1]  # the same next free position
    # and both equal an independent re-implementation of get_rope_index on the explicit layout
    layout = [("text", s.n) if isinstance(s, Text) else ("frame", s.H, s.W) for s in expanded]
    ref, nxt = qwen3vl_reference(layout)
    assert rows(pos_e) == [list(r) for r in ref] and int(d_e) + pos_e.shape[1] == nxt
    times = qwen3vl_timestamps(3, seconds_per_grid=6.0)
    skipped = sum(count(s) for s in times) + (2 * 3 if markers else 0)
    assert sum(s.n for s in expanded if isinstance(s, Text)) == 2 + skipped + 3 + 1


def test_qwen3vl_images_skip_nothing_and_one_patch_videos_need_a_duration():
    segs = [Text(2), Visual(1, 2, 3), Text(1)]
    # an image: one (1, H, W) block, as Qwen2-VL's rule without time
    assert torch.equal(build_positions("qwen3vl", segs)[0], build_positions("mrope", segs)[0])
    # with a duration the same block is a one-patch video: its timestamp and markers are skipped
    pos, _ = build_positions("qwen3vl", [Text(2), Visual(1, 2, 3, seconds_per_grid=2.0), Text(1)], timestamp_tokens=5)
    assert pos[:, 2].tolist() == [2 + 5 + 1] * 3 and pos[:, -1].tolist() == [8 + 3 + 1] * 3


def test_qwen3vl_decode_continues_after_a_final_video():
    segs = [Text(1), Visual(2, 3, 2)]
    pos, delta = build_positions("qwen3vl", segs, timestamp_tokens=4)
    longer, _ = build_positions("qwen3vl", segs + [Text(2)], timestamp_tokens=4)
    L = pos.shape[1]
    assert torch.equal(decode_positions(delta, L, 3, num_new=2)[:, 0], longer[:, L:])
    assert longer[:, L].tolist() == [1 + 2 * (4 + 1 + 3 + 1)] * 3  # past the last <|vision_end|>


def apply_interleaved_mrope_rows(P: int, section: tuple[int, int, int]) -> list[int]:
    """Qwen3-VL's apply_interleaved_mrope on a (3, P) table whose row r holds r: start from row t, then
    h at pairs 1, 4, ... below 3 * s_h and w at pairs 2, 5, ... below 3 * s_w."""
    table = torch.arange(3)[:, None].expand(3, P)
    out = table[0].clone()
    for axis, offset in ((1, 1), (2, 2)):
        idx = slice(offset, section[axis] * 3, 3)
        out[idx] = table[axis, idx]
    return out.tolist()


def test_qwen3vl_frequency_map_is_qwen3vl_interleave():
    e = enc("qwen3vl", 128)
    assert e.mrope_section == [24, 20, 20]
    assert e.axis_map().tolist() == apply_interleaved_mrope_rows(64, (24, 20, 20))
    assert torch.equal(e.axis_map(), enc("mrope_interleave", 128).axis_map())
    small = enc("qwen3vl", 32, mrope_section=[6, 5, 5])
    assert small.axis_map().tolist() == apply_interleaved_mrope_rows(16, (6, 5, 5))


# ---------------------------------------------------------------------------------------------
# both: relative property, text-only, model / task wiring, bad input
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme, opts", [("videorope", {}), ("videorope", {"convention": "paper"}), ("qwen3vl", {})])
def test_logits_depend_only_on_coordinate_differences(scheme, opts):
    torch.manual_seed(0)
    e = enc(scheme, 32, 2)
    pos, _ = build_positions(scheme, [Text(3), Visual(3, 3, 2), Text(2)], **opts)
    q, k = torch.randn(1, 2, pos.shape[1], 32), torch.randn(1, 2, pos.shape[1], 32)
    s0 = scores(e, q, k, pos.double())
    for shift in ([11.0, 11.0, 11.0], [2.5, -4.0, 7.0]):  # a common shift, then a different one per axis
        s1 = scores(e, q, k, pos.double() + torch.tensor(shift, dtype=torch.float64)[:, None])
        assert torch.allclose(s0, s1, atol=1e-4, rtol=1e-4)
    moved = pos.double().clone()
    moved[:, -1] += 5  # one token moved: scores change
    assert not torch.allclose(s0, scores(e, q, k, moved), atol=1e-3)


@pytest.mark.parametrize("scheme", ["videorope", "qwen3vl"])
def test_text_only_is_plain_rope(scheme):
    pos, delta = build_positions(scheme, [Text(9)])
    assert int(delta) == 0 and all(pos[i].tolist() == list(range(9)) for i in range(3))
    t = enc(scheme, 32).table_from_positions(pos[:, None])
    assert torch.equal(t, enc("rope_1d", 32).table_from_positions(torch.arange(9)[None, None]))


@pytest.mark.parametrize("scheme", ["videorope", "qwen3vl"])
def test_video_llm_and_niah_read_the_scheme_records(scheme):
    from vispe.benchmarks.niah import build_parser
    from vispe.models.video_llm import VideoLLM
    from vispe.tasks.niah import VideoNIAH

    torch.manual_seed(0)
    m = VideoLLM(vocab_size=20, dim=32, depth=1, num_heads=2, pos_scheme=scheme, visual_dim=8).eval()
    ids = torch.randint(0, 20, (5,))
    vis = torch.randn(2, 2, 3, 8)
    batch = m.pack([[ids[:3], vis, ids[3:]]])
    want, delta = build_positions(scheme, [Text(3), Visual(2, 2, 3), Text(2)])
    assert torch.equal(batch.position_ids[:, 0], want) and int(batch.rope_delta[0]) == int(delta)
    with torch.no_grad():  # one cached step == the longer prefill
        full = m.forward_batch(m.pack([[ids[:3], vis, ids[3:], ids[:1]]])).logits[:, -1]
        step = m(input_ids=ids[None, :1], cache=m.forward_batch(batch, use_cache=True).cache).logits[:, -1]
    assert torch.allclose(step, full, atol=1e-4)
    defaults = {"videorope": {"delta": 2.0}, "qwen3vl": {"fps": 2.0}}[scheme]
    assert VideoNIAH(scheme, dim=32, depth=1, num_heads=2).model.position_kwargs == defaults
    opt, value = next(iter(defaults.items()))
    args = build_parser().parse_args([f"--{scheme}-{opt}", "3"])
    assert getattr(args, f"{scheme}_{opt}") == 3.0 and scheme in build_parser().parse_args([]).schemes.split(",")


def test_bad_options_raise_with_the_value_and_the_choices():
    with pytest.raises(ValueError, match=r"convention='eq7' is not valid; choose one of \['code', 'paper'\]"):
        build_positions("videorope", EX, convention="eq7")
    with pytest.raises(ValueError, match=r"delta=0 is not valid; it must be a finite number > 0"):
        build_positions("videorope", EX, delta=0)
    with pytest.raises(ValueError, match=r"temporal_pairs must be an int in \[0, 64\)"):
        enc("videorope", 128, temporal_pairs=64)
    with pytest.raises(ValueError, match="timestamp_tokens must be an int >= 0 or a callable"):
        build_positions("qwen3vl", EX, timestamp_tokens=-1)
    with pytest.raises(ValueError, match=r"timestamp_tokens gave 2.5 for the timestamp <0.2 seconds>"):
        build_positions("qwen3vl", EX, timestamp_tokens=lambda s: 2.5)
    with pytest.raises(TypeError, match="vision_markers must be a bool"):
        build_positions("qwen3vl", EX, vision_markers=1)
    with pytest.raises(TypeError, match="vision_markers must be a bool"):
        qwen3vl_video_segments(Visual(2, 2, 2), vision_markers="yes")
    with pytest.raises(ValueError, match=r"fps=0 is not valid; it must be a finite number > 0"):
        build_positions("qwen3vl", [Text(1)], fps=0)
    with pytest.raises(TypeError, match="valid options"):
        build_positions("qwen3vl", EX, delta=2.0)
    with pytest.raises(ValueError, match="mrope_section"):
        enc("qwen3vl", 32, mrope_section=[8, 8, 8])
    from vispe.models.video_llm import VideoLLM

    with pytest.raises(ValueError, match="convention"):  # at construction, not in the first forward
        VideoLLM(vocab_size=8, dim=32, depth=1, num_heads=2, pos_scheme="videorope", position_kwargs={"convention": "x"})
