"""rope_dinov3 / rope_dinov3_3d: DINOv3's RoPE (Siméoni et al., arXiv 2508.10104).

Oracle: timm's ``RotaryEmbeddingDinoV3`` applied as timm's Eva applies it (half layout, prefix tokens not
rotated), on the same q/k and in a whole DINOv3 Eva ViT with copied weights; with training-time coordinate
augmentation both sides draw the same numbers from the same seed. Properties: worked examples of the
coordinates and periods, attention depending only on normalised-coordinate offsets, prefix tokens
unrotated, augmentation off in eval / redrawn per training forward / within its bounds, the 3D variant's
single frame equal to the 2D encoding, clear errors, and forward + backward (float32 and bf16) at several
grids in the image ViT and the video ViT.
"""
from __future__ import annotations

import math
from functools import partial

import pytest
import timm
import torch
from timm.layers.pos_embed_sincos import RotaryEmbeddingDinoV3, apply_rot_embed_cat

import vispe  # noqa: F401  (registers the models and encodings)
from vispe.encodings import EncodingContext, PositionGrid, create_encoding
from vispe.encodings.rope_dinov3 import RopeDinoV3, RopeDinoV3_3d, dinov3_periods
from vispe.models.video_vit import VispeVideoViT

MODES = ["separate", "min", "max"]
PERIODS = [{"base": 100.0}, {"base": 10.0}, {"min_period": 0.5, "max_period": 16.0}]
GRIDS = [(4, 4), (3, 5), (7, 2)]


def _timm_rope(head_dim: int, mode: str, periods: dict, **aug) -> RotaryEmbeddingDinoV3:
    return RotaryEmbeddingDinoV3(head_dim, temperature=periods.get("base"), min_period=periods.get("min_period"),
                                 max_period=periods.get("max_period"), normalize_coords=mode, **aug)


def _timm_rotate(x: torch.Tensor, rope: torch.Tensor, num_prefix: int) -> torch.Tensor:
    """What timm's Eva attention does with a DINOv3 rope table: prefix tokens as they are, the rest rotated (half)."""
    return torch.cat([x[:, :, :num_prefix], apply_rot_embed_cat(x[:, :, num_prefix:], rope, half=True)], dim=2)


def _qk(shape, num_prefix: int, head_dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n = num_prefix + shape[0] * shape[1]
    return torch.randn(2, 3, n, head_dim, generator=g), torch.randn(2, 3, n, head_dim, generator=g)


# ---------------------------------------------------------------------------------------------
# timm as the oracle
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("periods", PERIODS, ids=["base100", "base10", "period_range"])
@pytest.mark.parametrize("mode", MODES)
def test_rotated_qk_and_logits_equal_timm(mode, periods):
    head_dim, s = 32, 2
    timm_rope = _timm_rope(head_dim, mode, periods).eval()
    enc = create_encoding("rope_dinov3", head_dim=head_dim, normalize_coords=mode, **periods).eval()
    worst = 0.0
    for shape in GRIDS:
        q, k = _qk(shape, s, head_dim)
        rope = timm_rope.get_embed(list(shape))
        q_ref, k_ref = _timm_rotate(q, rope, s), _timm_rotate(k, rope, s)
        q_got, k_got = enc.rotate_qk(q, k, enc.prepare(PositionGrid(shape, s)))
        worst = max(worst, (q_got - q_ref).abs().max().item(), (k_got - k_ref).abs().max().item())
        logits_diff = (q_got @ k_got.transpose(-1, -2) - q_ref @ k_ref.transpose(-1, -2)).abs().max().item()
        assert logits_diff <= 1e-5, (shape, logits_diff)
    assert worst <= 1e-5, worst


AUGMENTATIONS = [
    {"shift_coords": 0.3},
    {"jitter_coords": 1.5},
    {"rescale_coords": 2.0},
    {"shift_coords": 0.2, "jitter_coords": 1.3, "rescale_coords": 2.0},
]


@pytest.mark.parametrize("aug", AUGMENTATIONS, ids=["shift", "jitter", "rescale", "all"])
def test_augmented_rotation_equals_timm_with_the_same_seed(aug):
    """DINOv3's draw order (shift, jitter, rescale) and calls are timm's: the same seed gives the same coordinates."""
    head_dim, shape = 16, (3, 5)
    timm_rope = _timm_rope(head_dim, "min", {"base": 100.0}, **aug).train()
    enc = create_encoding("rope_dinov3", head_dim=head_dim, normalize_coords="min", **aug).train()
    q, _ = _qk(shape, 1, head_dim)
    plain = enc.eval().rotate(q, enc.prepare(PositionGrid(shape, 1)))
    enc.train()
    for seed in (0, 1):
        torch.manual_seed(seed)
        ref = _timm_rotate(q, timm_rope.get_embed(list(shape)), 1)
        torch.manual_seed(seed)
        got = enc.rotate(q, enc.prepare(PositionGrid(shape, 1)))
        assert (got - ref).abs().max().item() <= 1e-5
        assert (got - plain).abs().max().item() > 1e-2  # the augmentation did move the coordinates


def _vit_pair(pe: str, **eva_kw):
    """timm's DINOv3 Eva and the vispe ViT with ``pe``, same weights (layer scale 1 so attention matters)."""
    common = dict(embed_dim=64, num_heads=2, depth=2, img_size=64, num_classes=5, init_values=1.0)
    torch.manual_seed(0)
    eva = timm.create_model("vit_small_patch16_dinov3", pretrained=False, **eva_kw, **common)
    model = timm.create_model(
        "vispe_vit_tiny_patch16_224", pos_encoding=pe, reg_tokens=4, qkv_bias=False, global_pool="avg", fc_norm=False,
        norm_layer=partial(torch.nn.LayerNorm, eps=1e-5), dynamic_img_size=True, **common,
    )
    state = {k.replace(".gamma_1", ".ls1.gamma").replace(".gamma_2", ".ls2.gamma"): v for k, v in eva.state_dict().items()}
    model.load_state_dict(state)  # strict: every parameter has its counterpart
    return eva, model


@pytest.mark.parametrize("mode", MODES)
def test_vit_equals_timm_dinov3_eva(mode):
    """A whole DINOv3 ViT (cls + 4 registers unrotated) at a square and a non-square grid."""
    eva, model = _vit_pair(f"rope_dinov3[normalize_coords={mode!r}]")
    eva.rope.normalize_coords = mode  # timm's Eva has no argument for it; the rope module reads it per call
    eva.eval()
    model.eval()
    for size in [(64, 64), (48, 80)]:
        x = torch.randn(2, 3, *size)
        with torch.no_grad():
            diff = (eva.forward_features(x) - model.forward_features(x)).abs().max().item()
        assert diff <= 1e-5, (size, diff)
    # the comparison can fail: another normalisation differs on the non-square grid
    other = "max" if mode == "separate" else "separate"
    model.pos_encoding.normalize_coords = other
    model.pos_encoding.clear_cache()
    with torch.no_grad():
        x = torch.randn(2, 3, 48, 80)
        assert (eva.forward_features(x) - model.forward_features(x)).abs().max().item() > 1e-3


def test_vit_with_augmentation_equals_timm_eva_in_training():
    eva, model = _vit_pair("rope_dinov3[shift_coords=0.1,jitter_coords=1.2,rescale_coords=2.0]",
                           rope_shift_coords=0.1, rope_jitter_coords=1.2, rope_rescale_coords=2.0)
    eva.train()
    model.train()  # no dropout anywhere: the coordinate draws are the only randomness
    x = torch.randn(2, 3, 48, 80)
    with torch.no_grad():
        torch.manual_seed(3)
        ref = eva.forward_features(x)
        torch.manual_seed(3)
        got = model.forward_features(x)
        torch.manual_seed(4)
        other_draw = model.forward_features(x)
    assert (got - ref).abs().max().item() <= 1e-5
    assert (other_draw - ref).abs().max().item() > 1e-3


# ---------------------------------------------------------------------------------------------
# worked examples
# ---------------------------------------------------------------------------------------------


def test_normalized_coordinates_worked_examples():
    """A 2 x 4 grid; row-major tokens, columns (h, w)."""
    grid = PositionGrid((2, 4))
    h_sep, w_all = [-0.5, 0.5], [-0.75, -0.25, 0.25, 0.75]
    expect = {
        "separate": (h_sep, w_all),  # each axis by its own length
        "max": ([-0.75, -0.25], w_all),  # both by 4: the long side spans [-1, 1]
        "min": (h_sep, [-0.5, 0.5, 1.5, 2.5]),  # both by 2: the short side spans [-1, 1]
    }
    for mode, (hs, ws) in expect.items():
        c = RopeDinoV3(16, normalize_coords=mode).normalized_coordinates(grid)
        ref = torch.tensor([[h, w] for h in hs for w in ws])
        torch.testing.assert_close(c, ref, rtol=0, atol=1e-7)


def test_periods_worked_examples():
    torch.testing.assert_close(dinov3_periods(4, base=100.0), torch.tensor([1.0, 10**0.5, 10.0, 10**1.5]))
    torch.testing.assert_close(dinov3_periods(4, min_period=1.0, max_period=8.0), torch.tensor([1.0, 2.0, 4.0, 8.0]))
    assert dinov3_periods(1, min_period=2.0, max_period=8.0).tolist() == [2.0]
    # an angle is 2*pi*c / period: on a 1 x 2 grid ('separate') the second token sits at w = 0.5
    enc = RopeDinoV3(16, grid_size=(1, 2), min_period=1.0, max_period=8.0)
    ang = enc.angles(PositionGrid((1, 2)), None)
    torch.testing.assert_close(ang[1, 4:], 2 * math.pi * 0.5 / torch.tensor([1.0, 2.0, 4.0, 8.0]))  # [h | w]: w chunk
    torch.testing.assert_close(ang[1, :4], torch.zeros(4))  # one row: h = 0
    assert enc.layout == "half" and enc.sections == (4, 4)


# ---------------------------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------------------------


def test_angles_are_linear_in_normalised_coordinates():
    """Attention depends on normalised-coordinate offsets: one step along an axis is the same angle increment
    everywhere, and a grid twice as fine gives the same angles to pairs twice as many patches apart."""
    enc = RopeDinoV3(16, grid_size=(4, 6))
    ang = enc.angles(PositionGrid((4, 6)), None).reshape(4, 6, 8)
    for axis in (0, 1):
        step = ang.diff(dim=axis)
        torch.testing.assert_close(step, step.narrow(axis, 0, 1).expand_as(step), atol=1e-5, rtol=0)
    fine = enc.angles(PositionGrid((8, 12)), None).reshape(8, 12, 8)
    torch.testing.assert_close(fine[2, 4] - fine[0, 0], ang[1, 2] - ang[0, 0], atol=1e-5, rtol=0)
    assert (ang[1, 2] - ang[0, 0]).abs().max() > 0.1


def test_pure_shift_keeps_patch_logits_and_prefix_is_not_rotated():
    torch.manual_seed(0)
    plain = RopeDinoV3(16, grid_size=(4, 4))
    shifted = RopeDinoV3(16, grid_size=(4, 4), shift_coords=0.5).train()
    grid = PositionGrid((4, 4), num_prefix_tokens=2)
    q, k = _qk((4, 4), 2, 16)
    q0, k0 = plain.rotate_qk(q, k, plain.prepare(grid))
    assert torch.equal(q0[:, :, :2], q[:, :, :2]) and torch.equal(k0[:, :, :2], k[:, :, :2])  # identity, bit-exact
    ref = q0 @ k0.transpose(-1, -2)
    for seed in range(3):
        torch.manual_seed(seed)
        qs, ks = shifted.rotate_qk(q, k, shifted.prepare(grid))
        got = qs @ ks.transpose(-1, -2)
        torch.testing.assert_close(got[..., 2:, 2:], ref[..., 2:, 2:], atol=1e-4, rtol=1e-4)  # patch to patch: offsets only
        assert not torch.allclose(got[..., 0, 2:], ref[..., 0, 2:])  # the unrotated cls sees absolute positions


def test_augmentation_off_in_eval_redrawn_in_training_and_within_bounds():
    grid = PositionGrid((2, 4))  # even sizes: no coordinate is 0, so ratios are defined
    plain = RopeDinoV3(16, grid_size=(2, 4))
    base = plain.normalized_coordinates(grid)
    aug = RopeDinoV3(16, grid_size=(2, 4), shift_coords=0.4, jitter_coords=1.5, rescale_coords=2.0)
    with torch.no_grad():
        aug.eval()
        assert torch.equal(aug.angles(grid, None), plain.angles(grid, None)) and aug.cacheable()
        state = aug.prepare(grid)
        assert aug.prepare(grid) is state  # eval: tables cached per grid
        plain.train()
        assert torch.equal(plain.angles(grid, None), aug.angles(grid, None)) and plain.cacheable()  # off by default
        aug.train()
        assert not aug.cacheable() and aug.prepare(grid) is not aug.prepare(grid)
        a1, a2 = aug.angles(grid, None), aug.angles(grid, None)
        assert not torch.equal(a1, a2) and not torch.equal(a1, plain.angles(grid, None))

    def one(**opt):
        return RopeDinoV3(16, grid_size=(2, 4), **opt).train().coordinates(grid)

    torch.manual_seed(0)
    for _ in range(20):
        moved = one(shift_coords=0.4) - base  # one shift per axis, shared by all tokens
        assert torch.allclose(moved, moved[:1].expand_as(moved), atol=1e-6) and moved.abs().max() <= 0.4
        ratio = one(jitter_coords=1.5) / base  # one factor per axis in [1/1.5, 1.5]
        assert torch.allclose(ratio, ratio[:1].expand_as(ratio), atol=1e-5)
        assert ratio.min() >= 1 / 1.5 - 1e-6 and ratio.max() <= 1.5 + 1e-6
        ratio = one(rescale_coords=2.0) / base  # one factor for every axis in [1/2, 2]
        assert torch.allclose(ratio, ratio[0, 0].expand_as(ratio), atol=1e-5) and 0.5 - 1e-6 <= ratio[0, 0] <= 2.0 + 1e-6
    jitters = torch.stack([(one(jitter_coords=1.5) / base)[0] for _ in range(5)])
    assert (jitters[:, 0] - jitters[:, 1]).abs().max() > 1e-3  # the axes draw their own jitter


# ---------------------------------------------------------------------------------------------
# video
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_3d_single_frame_equals_2d_and_time_keeps_its_own_length(mode):
    e3 = RopeDinoV3_3d(32, grid_size=(1, 3, 5), normalize_coords=mode, sections=(0, 8, 8))
    e2 = RopeDinoV3(32, grid_size=(3, 5), normalize_coords=mode)
    assert torch.equal(e3.angles(PositionGrid((1, 3, 5)), None), e2.angles(PositionGrid((3, 5)), None))
    # time: tubelet centres by the clip length in every mode; the plane as in 2D
    c = RopeDinoV3_3d(32, grid_size=(4, 3, 5), normalize_coords=mode).normalized_coordinates(PositionGrid((4, 3, 5)))
    torch.testing.assert_close(c.reshape(4, 15, 3)[:, 0, 0], torch.tensor([-0.75, -0.25, 0.25, 0.75]))
    torch.testing.assert_close(c.reshape(4, 15, 3)[2, :, 1:], e2.normalized_coordinates(PositionGrid((3, 5))))


def test_3d_sections_relative_in_time_and_augmentation_per_axis():
    e = create_encoding("rope_dinov3_3d", EncodingContext(dim=32, num_heads=2, depth=1, grid_size=(4, 2, 2)))
    assert e.sections == (4, 2, 2) and e.layout == "half"  # P = 8: remainder to time, as rope_axial_3d
    ang = e.angles(PositionGrid((4, 2, 2)), None).reshape(4, 4, 8)
    step = ang[1:] - ang[:-1]
    torch.testing.assert_close(step, step[:1].expand_as(step), atol=1e-5, rtol=0)
    assert step[0, 0, :4].abs().min() > 0 and step[..., 4:].abs().max() < 1e-6  # time moves the time chunk only
    aug = RopeDinoV3_3d(16, grid_size=(4, 2, 2), shift_coords=0.5).train()
    torch.manual_seed(0)
    moved = aug.coordinates(PositionGrid((4, 2, 2))) - aug.normalized_coordinates(PositionGrid((4, 2, 2)))
    assert torch.allclose(moved, moved[:1].expand_as(moved)) and moved[0].abs().min() > 0  # a shift per axis, t included


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


def test_bad_options_fail_at_construction_naming_the_value():
    with pytest.raises(ValueError, match=r"normalize_coords='diag'.*\['separate', 'min', 'max'\]"):
        RopeDinoV3(16, normalize_coords="diag")
    with pytest.raises(ValueError, match=r"base=100\.0 or min_period/max_period"):
        RopeDinoV3(16, base=100.0, min_period=1.0, max_period=8.0)
    with pytest.raises(ValueError, match="both min_period and max_period"):
        RopeDinoV3(16, min_period=1.0)
    with pytest.raises(ValueError, match=r"min_period=8\.0 must be <= max_period=1\.0"):
        RopeDinoV3(16, min_period=8.0, max_period=1.0)
    with pytest.raises(ValueError, match=r"base=-2 is not valid; it must be a finite number >= 1"):
        RopeDinoV3(16, base=-2)
    with pytest.raises(ValueError, match=r"shift_coords=-0\.1 is not valid; it must be a finite number >= 0"):
        RopeDinoV3(16, shift_coords=-0.1)
    with pytest.raises(ValueError, match=r"jitter_coords=0\.5 is not valid; it must be a finite number >= 1"):
        RopeDinoV3(16, jitter_coords=0.5)
    with pytest.raises(ValueError, match=r"rescale_coords=inf is not valid"):
        RopeDinoV3(16, rescale_coords=float("inf"))
    with pytest.raises(ValueError, match="head_dim divisible by 4; got head_dim=18"):
        RopeDinoV3(18)
    with pytest.raises(ValueError, match="summing to P"):
        RopeDinoV3_3d(16, sections=(1, 1, 1))
    with pytest.raises(ValueError, match="takes 2-axis grids"):
        RopeDinoV3(16).prepare(PositionGrid((2, 3, 3)))
    with pytest.raises(TypeError, match="valid options"):
        create_encoding("rope_dinov3", EncodingContext(64, 4, 2, (4, 4)), temperature=100.0)


# ---------------------------------------------------------------------------------------------
# in the models
# ---------------------------------------------------------------------------------------------


def _finite_step(model: torch.nn.Module, x: torch.Tensor, bf16: bool) -> None:
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = model(x)
    assert torch.isfinite(out).all()
    out.float().square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_vit_trains_at_three_grids(bf16):
    torch.manual_seed(0)
    model = timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding="rope_dinov3[rescale_coords=2.0,shift_coords=0.1]",
                              depth=2, embed_dim=64, num_heads=4, num_classes=5, reg_tokens=2).train()
    for size in [(32, 32), (48, 48), (24, 40)]:
        _finite_step(model, torch.randn(2, 3, *size), bf16)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_video_vit_trains_at_three_clips(bf16):
    torch.manual_seed(0)
    model = VispeVideoViT(pos_encoding={"name": "rope_dinov3_3d", "normalize_coords": "max", "jitter_coords": 1.2},
                          embed_dim=48, depth=2, num_heads=2, img_size=32, num_frames=4, tubelet_size=2, patch_size=8,
                          num_classes=5).train()
    for frames, h, w in [(4, 32, 32), (8, 24, 40), (2, 16, 16)]:
        _finite_step(model, torch.randn(1, 3, frames, h, w), bf16)
