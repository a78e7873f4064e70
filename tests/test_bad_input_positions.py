"""Bad position-scheme options and segments are refused before any position is built, and large or fine
positions stay exact (issue 32, category ``positions``)."""
from __future__ import annotations

import math
import random

import pytest
import torch

from vispe.encodings import EncodingContext, create_encoding
from vispe.positions import SCHEME_OPTION_CHECKS, SCHEMES, Text, Visual, build_positions, build_positions_batch

from bad_input import expect_clear_error

NAN, INF = float("nan"), float("inf")
VID = [Text(3), Visual(4, 2, 2), Text(2)]

# (id, scheme, segments, options, needles)
POSITION_CASES = [
    ("mrope-temporal_patch_size-zero", "mrope", VID, {"fps": 2.0, "temporal_patch_size": 0}, ["temporal_patch_size", "0"]),
    ("mrope-temporal_patch_size-negative", "mrope", VID, {"fps": 2.0, "temporal_patch_size": -2}, ["temporal_patch_size", "-2"]),
    ("mrope-temporal_patch_size-float", "mrope", VID, {"fps": 2.0, "temporal_patch_size": 2.0}, ["temporal_patch_size", "2.0"]),
    ("mrope-fps-zero", "mrope", VID, {"fps": 0}, ["fps", "0"]),
    ("mrope-fps-nan", "mrope", VID, {"fps": NAN}, ["fps", "nan"]),
    ("mrope-fps-inf", "mrope", VID, {"fps": INF}, ["fps", "inf"]),
    ("mrope-fps-string", "mrope", VID, {"fps": "2"}, ["fps", "'2'"]),
    ("mrope-seconds_per_grid-negative", "mrope", VID, {"seconds_per_grid": -1.0}, ["seconds_per_grid", "-1.0"]),
    ("mrope-tokens_per_second-zero", "mrope", VID, {"fps": 2.0, "tokens_per_second": 0}, ["tokens_per_second", "0"]),
    ("mrope-tokens_per_second-nan", "mrope", VID, {"fps": 2.0, "tokens_per_second": NAN}, ["tokens_per_second", "nan"]),
    ("mrope-time_floor-string", "mrope", VID, {"fps": 2.0, "time_floor": "no"}, ["time_floor", "'no'"]),
    ("mrope-block-seconds_per_grid-inf", "mrope", [Visual(3, 2, 2, INF)], {}, ["seconds_per_grid", "inf"]),
    ("mrope-block-seconds_per_grid-string", "mrope", [Visual(3, 2, 2, "1")], {}, ["seconds_per_grid", "'1'"]),
    ("mrope-tiny-fps-huge-positions", "mrope", [Visual(3000, 2, 2)], {"fps": 1e-300}, ["positions", "2^53"]),
    ("mrope_interleave-temporal_stride-zero", "mrope_interleave", VID, {"temporal_stride": 0}, ["temporal_stride", "0"]),
    ("mrope_interleave-temporal_stride-inf", "mrope_interleave", VID, {"temporal_stride": INF}, ["temporal_stride", "inf"]),
    ("mhrope-spatial_reset-string", "mhrope", VID, {"spatial_reset": "no"}, ["spatial_reset", "'no'"]),
    ("videorope-delta-zero", "videorope", VID, {"delta": 0}, ["delta", "0"]),
    ("videorope-delta-nan", "videorope", VID, {"delta": NAN}, ["delta", "nan"]),
    ("videorope-convention-unknown", "videorope", VID, {"convention": "eq7"}, ["convention", "eq7", "paper"]),
    ("hope-gamma-negative", "hope", VID, {"gamma": -0.5}, ["gamma", "-0.5"]),
    ("hope-gamma-negative-training", "hope", VID, {"gamma": -0.5, "training": True}, ["gamma", "-0.5"]),
    ("hope-gamma-nan", "hope", VID, {"gamma": NAN}, ["gamma", "nan"]),
    ("hope-gamma_choices-empty", "hope", VID, {"training": True, "gamma_choices": ()}, ["gamma_choices", "()"]),
    ("hope-gamma_choices-negative", "hope", VID, {"training": True, "gamma_choices": (0.5, -1.0)}, ["gamma_choices", "-1.0"]),
    ("hope-training-string", "hope", VID, {"training": "yes"}, ["training", "'yes'"]),
    ("v2pe-delta-negative", "v2pe", VID, {"delta": -0.25}, ["delta", "-0.25"]),
    ("v2pe-delta-inf", "v2pe", VID, {"delta": INF}, ["delta", "inf"]),
    ("v2pe-delta_choices-zero", "v2pe", VID, {"training": True, "delta_choices": (0.0,)}, ["delta_choices", "0.0"]),
    ("qwen3vl-fps-negative", "qwen3vl", VID, {"fps": -2.0}, ["fps", "-2.0"]),
    ("qwen3vl-temporal_patch_size-zero", "qwen3vl", VID, {"temporal_patch_size": 0}, ["temporal_patch_size", "0"]),
    ("qwen3vl-vision_markers-int", "qwen3vl", VID, {"vision_markers": 1}, ["vision_markers", "1"]),
    ("qwen3vl-timestamp_tokens-negative", "qwen3vl", VID, {"timestamp_tokens": -1}, ["timestamp_tokens", "-1"]),
    ("segments-visual-zero-frames", "mrope", [Visual(0, 2, 2)], {}, ["T=0"]),
    ("segments-visual-float-size", "mrope", [Visual(2, 2.0, 2)], {}, ["H", "2.0"]),
    ("segments-text-negative", "rope_1d", [Text(-3)], {}, ["n=-3"]),
    ("segments-empty", "rope_1d", [], {}, ["at least one segment"]),
    ("unknown-option", "vrope", VID, {"delta": 2.0}, ["delta", "valid options"]),
    ("unknown-scheme", "mrope2", VID, {}, ["mrope2", "mrope"]),
]


@pytest.mark.parametrize("scheme,segments,opts,needles", [pytest.param(*c[1:], id=f"positions-{c[0]}") for c in POSITION_CASES])
def test_positions_battery(scheme, segments, opts, needles):
    expect_clear_error(lambda: build_positions(scheme, segments, **opts), needles, (TypeError, ValueError))


def test_positions_spatial_merge_size_zero():
    expect_clear_error(lambda: build_positions("mrope", VID, spatial_merge_size=0), ["spatial_merge_size", "0"], ValueError)


def test_positions_video_llm_refuses_bad_position_options_at_construction():
    from vispe.models.video_llm import VideoLLM

    build = lambda: VideoLLM(vocab_size=8, dim=32, depth=1, num_heads=2, pos_scheme="mrope",  # noqa: E731
                             position_kwargs={"fps": 2.0, "temporal_patch_size": 0})
    expect_clear_error(build, ["temporal_patch_size", "0"], ValueError)


_KINDS = [("negative", -1), ("zero", 0), ("nan", NAN), ("inf", INF), ("string", "1"), ("none", None), ("fraction", 0.5),
          ("bool", True), ("empty", ()), ("negative_entry", (0.5, -1.0))]
# options a scheme needs with the one walked (absolute time needs fps or seconds_per_grid; draws need training)
_PARTNERS = {"tokens_per_second": {"fps": 2.0}, "temporal_patch_size": {"fps": 2.0}, "time_floor": {"fps": 2.0},
             "gamma_choices": {"training": True}, "delta_choices": {"training": True}}


def _scheme_walk():
    cases = []
    for name, rec in SCHEMES.items():
        for option in rec.options():
            rule = SCHEME_OPTION_CHECKS.get(option)
            if rule is None:
                continue
            for kind, value in _KINDS:
                if not rule.is_valid(value):
                    cases.append(pytest.param(name, option, value, id=f"positions-walk-{name}-{option}-{kind}"))
    return cases


@pytest.mark.parametrize("scheme,option,value", _scheme_walk())
def test_positions_walk_refused_before_building(scheme, option, value):
    opts = {**_PARTNERS.get(option, {}), option: value}
    if scheme == "mrope" and option == "seconds_per_grid":
        opts.pop("fps", None)
    expect_clear_error(lambda: build_positions(scheme, VID, **opts), [option, repr(value)], (TypeError, ValueError))


def test_every_scheme_option_has_a_rule():
    """Every builder option is checked by name (``rng`` and ``timestamp_tokens`` are checked by the builders)."""
    for name, rec in SCHEMES.items():
        missing = [o for o in rec.options() if o not in SCHEME_OPTION_CHECKS and o not in ("rng", "timestamp_tokens")]
        assert not missing, f"{name}: options {missing} have no rule in vispe.positions.SCHEME_OPTION_CHECKS"


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_valid_scheme_options_give_finite_positions(scheme):
    opts = {"hope": {"gamma": 0.5}, "v2pe": {"delta": 1 / 256}, "mrope": {"fps": 0.5}, "qwen3vl": {"fps": 0.5}}.get(scheme, {})
    pos, delta = build_positions(scheme, [Text(5), Visual(3, 4, 6), Text(2), Visual(1, 2, 2)], **opts)
    assert torch.isfinite(pos.double()).all() and math.isfinite(float(delta))


# ---------------------------------------------------------------------------------------------
# V2PE: positions of a long text stay distinct (float64 where float32 would merge them)
# ---------------------------------------------------------------------------------------------
def test_positions_v2pe_text_past_2_pow_24_keeps_distinct_exact_positions():
    n = 2**24 + 3
    pos, delta = build_positions("v2pe", [Text(n), Visual(1, 2, 2), Text(2)], delta=0.25)
    p = pos[0]
    assert pos.dtype == torch.float64
    assert bool((p[1:] > p[:-1]).all())  # every token its own position (float32 would repeat values here)
    assert p[n - 1].item() == n - 1 and p[n - 2].item() == n - 2
    assert p[n : n + 4].tolist() == [n - 1 + 0.25 * k for k in range(1, 5)]
    assert p[-2:].tolist() == [n + 1, n + 2]  # text after the image: ceil(last visual) + 1
    assert float(delta) == float(n + 3 - pos.shape[1])
    f32 = pos.to(torch.float32)[0]
    assert not bool((f32[1:] > f32[:-1]).all())  # what float32 would have given: merged positions


def test_positions_v2pe_fine_steps_after_a_long_text_use_float64():
    # delta = 1/256 after 70k text tokens: float32's spacing there is 1/128, so consecutive visual tokens would collide
    pos, _ = build_positions("v2pe", [Text(70_000), Visual(1, 4, 4)], delta=1 / 256)
    assert pos.dtype == torch.float64
    vis = pos[0, 70_000:]
    assert bool((vis[1:] > vis[:-1]).all())
    torch.testing.assert_close(vis[1:] - vis[:-1], torch.full((15,), 1 / 256, dtype=torch.float64), rtol=0, atol=1e-12)
    # short samples keep float32 (exact there)
    assert build_positions("v2pe", [Text(10), Visual(1, 2, 2)], delta=0.25)[0].dtype == torch.float32


def test_positions_batch_promotes_to_float64_when_one_row_needs_it():
    bp = build_positions_batch("v2pe", [[Text(70_000), Visual(1, 2, 2)], [Text(3), Visual(1, 2, 2)]], delta=1 / 256)
    assert bp.pos.dtype == torch.float64 and bp.rope_delta.dtype == torch.float64
    row = bp.pos[0, 0, bp.attention_mask[0]]
    assert bool((row[1:] > row[:-1]).all())


def test_positions_v2pe_rotary_keeps_relative_logits_far_out():
    """q.k of two tokens depends only on their position difference, also 2^24 positions out, with float64 positions."""
    torch.manual_seed(0)
    enc = create_encoding("v2pe", EncodingContext(64, 4, 1, (1, 1, 1), num_prefix_tokens=0))
    q, k = torch.randn(1, 4, 2, 16), torch.randn(1, 4, 2, 16)
    base = 2.0**24 + 3
    near = torch.tensor([[[0.0, 0.25]]], dtype=torch.float64)
    far = near + base
    logits = []
    for p in (near, far):
        t = enc.table_from_positions(p)
        qr, kr = enc.rotate(q, t), enc.rotate(k, t)
        logits.append((qr[..., 1, :] * kr[..., 0, :]).sum(-1))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
    # the same far positions in float32 cannot hold the 0.25 step: their rotations for the two tokens coincide
    t32 = enc.table_from_positions(far.float())
    assert torch.equal(t32[..., 0, :], t32[..., 1, :])


def test_float64_angles_match_float32_where_float32_is_exact():
    enc = create_encoding("mrope", EncodingContext(64, 4, 1, (1, 1, 1), num_prefix_tokens=0))
    pos, _ = build_positions("mrope", [Text(4), Visual(2, 3, 3)], fps=1.0, time_floor=False, tokens_per_second=0.75)
    a32 = enc.angles_from_positions(pos.float()[:, None])
    a64 = enc.angles_from_positions(pos.double()[:, None])
    assert torch.equal(a32, a64)


def test_hope_training_draws_only_valid_gammas():
    rng = random.Random(0)
    pos, _ = build_positions("hope", [Visual(3, 2, 2)] * 3, training=True, gamma_choices=(0.5, 1.5), rng=rng)
    assert torch.isfinite(pos).all()


def test_positions_hf_v2pe_fine_steps_after_a_long_text_stay_distinct():
    pytest.importorskip("transformers")
    from test_hf_integration import IMG, VE, VS, _qwen2_vl, _rope_index

    from vispe.integrations import hf as vhf

    torch.manual_seed(0)
    model = vhf.apply_position_scheme(_qwen2_vl().eval(), "v2pe", delta=1 / 256)
    ids = torch.tensor([[5] * 70_000 + [VS] + [IMG] * 4 + [VE, 6]])
    kw = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    pos, _ = _rope_index(model, kw, (ids == IMG).long())
    vis = pos[0, 0, 70_001:70_005]
    assert bool((vis[1:] > vis[:-1]).all()), vis.tolist()
