"""Foundation: contracts, baselines, the timm ViT, registration, checkpoint loading.

Oracles: timm's own ViT (learned APE) and timm's Eva RoPE ViTs (RoPE-Axial / RoPE-Mixed).
"""
from __future__ import annotations

import pytest
import timm
import torch

import vispe
from vispe.encodings import PositionGrid, RotaryEncoding, create_encoding, list_encodings
from vispe.models import load_timm_checkpoint

SMALL = dict(depth=2, img_size=64)


class ShiftedGrid(PositionGrid):
    """A grid whose lattice indices are offset by a constant (tests only)."""

    def __init__(self, shape, num_prefix_tokens=0, offset=0.0):
        super().__init__(shape, num_prefix_tokens)
        object.__setattr__(self, "offset", offset)

    def indices(self, device=None, rescale_to=None):
        return super().indices(device, rescale_to) + self.offset


def _copy_eva_weights(eva, model):
    sd = {}
    for k, v in eva.state_dict().items():
        k = k.replace(".gamma_1", ".ls1.gamma").replace(".gamma_2", ".ls2.gamma")
        if k == "rope.freqs":
            k = "pos_encoding.freqs"
        sd[k] = v
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert not missing, missing


@pytest.mark.parametrize(
    "timm_name,pe",
    [("vit_small_patch16_rope_224", "rope_axial"), ("vit_small_patch16_rope_mixed_224", "rope_mixed")],
)
@pytest.mark.parametrize("size", [(64, 64), (48, 80)])
def test_rope_matches_timm_eva(timm_name, pe, size):
    torch.manual_seed(0)
    eva = timm.create_model(timm_name, pretrained=False, dynamic_img_size=True, **SMALL).eval()
    model = timm.create_model("vispe_vit_small_patch16_224", pos_encoding=pe, init_values=1e-5, **SMALL).eval()
    _copy_eva_weights(eva, model)
    x = torch.randn(2, 3, *size)
    with torch.no_grad():
        diff = (eva(x) - model(x)).abs().max().item()
    assert diff <= 1e-5, diff


def test_learned_is_bit_exact_with_timm_vit():
    torch.manual_seed(0)
    ref = timm.create_model("vit_small_patch16_224", pretrained=False, **SMALL).eval()
    model = timm.create_model("vispe_vit_small_patch16_224", pos_encoding="learned", dynamic_img_size=False, **SMALL).eval()
    report = load_timm_checkpoint(model, ref.state_dict())
    assert not report.dropped and not report.new and not report.resampled
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(ref(x), model(x))
        assert torch.equal(ref.forward_features(x), model.forward_features(x))


def test_learned_init_options():
    from timm.layers import build_sincos2d_pos_embed, trunc_normal_

    # default: exactly timm's init (its trunc_normal_, std 0.02) for the same seed
    torch.manual_seed(0)
    table = create_encoding("learned", dim=64, grid_size=(8, 8)).pos_embed
    torch.manual_seed(0)
    assert torch.equal(table.detach(), trunc_normal_(torch.zeros(1, 65, 64), std=0.02))
    assert abs(create_encoding("learned", dim=64, grid_size=(8, 8), init_std=0.5).pos_embed.std().item() - 0.5) < 0.1
    # sincos2d start: lattice rows are timm's fixed sin-cos table, prefix rows zero; still a parameter
    enc = create_encoding("learned", dim=64, grid_size=(6, 8), init="sincos2d")
    assert torch.equal(enc.pos_embed[0, 1:].detach(), build_sincos2d_pos_embed([6, 8], dim=64))
    assert torch.equal(enc.pos_embed[0, 0].detach(), torch.zeros(64)) and enc.pos_embed.requires_grad
    with pytest.raises(ValueError, match="init"):
        create_encoding("learned", dim=64, grid_size=(8, 8), init="xavier")


def _patch_logits(enc, grid, q, k, layer=0):
    state = enc.build_state(grid, None)
    s = grid.num_prefix_tokens
    qr = enc.rotate(q, state, layer)[:, :, s:].double()
    kr = enc.rotate(k, state, layer)[:, :, s:].double()
    return qr @ kr.transpose(-1, -2)


def _rotary_2d():
    return [n for n in list_encodings(kind="rotary", grid_ndim=2) if n in ("rope_axial", "rope_mixed")]


@pytest.mark.parametrize("name", _rotary_2d())
def test_rotary_logits_invariant_to_global_shift(name):
    torch.manual_seed(0)
    enc = create_encoding(name, head_dim=32, num_heads=2, depth=2) if name == "rope_mixed" else create_encoding(name, head_dim=32)
    q, k = torch.randn(2, 2, 1 + 30, 32), torch.randn(2, 2, 1 + 30, 32)
    base = _patch_logits(enc, ShiftedGrid((5, 6), 1, 0.0), q, k, layer=1 if name == "rope_mixed" else 0)
    moved = _patch_logits(enc, ShiftedGrid((5, 6), 1, 7.0), q, k, layer=1 if name == "rope_mixed" else 0)
    assert torch.allclose(base, moved, rtol=0, atol=1e-4 * base.abs().max().item())
    # the rotation is real: logits differ from the unrotated ones
    plain = q[:, :, 1:].double() @ k[:, :, 1:].double().transpose(-1, -2)
    assert (plain - base).abs().max() > 1e-2
    # prefix (cls) tokens are not rotated
    state = enc.build_state(PositionGrid((5, 6), 1), None)
    assert torch.equal(enc.rotate(q, state, 0)[:, :, :1], q[:, :, :1])


@pytest.mark.parametrize("name", _rotary_2d())
def test_rotary_relative_property_bf16_autocast_far_positions(name):
    """Angles/tables are float32 under bf16 autocast, so positions >= 10,000 keep the relative property."""
    torch.manual_seed(0)
    enc = create_encoding(name, head_dim=64, num_heads=6, depth=2) if name == "rope_mixed" else create_encoding(name, head_dim=64)
    q, k = torch.randn(2, 6, 1 + 196, 64), torch.randn(2, 6, 1 + 196, 64)

    def rel_err(a, b):
        return ((a - b).norm() / b.norm()).item()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        near = _patch_logits(enc, ShiftedGrid((14, 14), 1, 0.0), q, k)
        far = _patch_logits(enc, ShiftedGrid((14, 14), 1, 10_000.0), q, k)
        assert rel_err(far, near) <= 1e-3
        # bf16 activations: rotated q/k are stored in bf16 (as timm and HF do); that rounding is the
        # same at any position, so the error at 10,000 stays at the error of a small shift.
        near_bf = _patch_logits(enc, ShiftedGrid((14, 14), 1, 0.0), q.bfloat16(), k.bfloat16())
        far_bf = _patch_logits(enc, ShiftedGrid((14, 14), 1, 10_000.0), q.bfloat16(), k.bfloat16())
        one_bf = _patch_logits(enc, ShiftedGrid((14, 14), 1, 1.0), q.bfloat16(), k.bfloat16())
        assert rel_err(far_bf, near_bf) <= 2.0 * rel_err(one_bf, near_bf) + 1e-3

    # the check can fail: bf16 angles at these positions destroy the relative property
    class Bf16Angles(type(enc)):
        def angles(self, grid, device):
            return super().angles(grid, device).bfloat16().float()

    bad = Bf16Angles.__new__(Bf16Angles)
    bad.__dict__ = enc.__dict__
    assert rel_err(_patch_logits(bad, ShiftedGrid((14, 14), 1, 10_000.0), q, k), near) > 0.1


def _tiny(pe, **kw):
    args = dict(pos_encoding=pe, depth=2, embed_dim=64, num_heads=4, num_classes=5)
    args.update(kw)
    return timm.create_model("vispe_vit_tiny_patch4_32", **args)


def test_timm_registration_and_create_model():
    names = timm.list_models("vispe_*")
    for n in [
        "vispe_vit_tiny_patch16_224",
        "vispe_vit_small_patch16_224",
        "vispe_vit_base_patch16_224",
        "vispe_vit_tiny_patch4_32",
        "vispe_vit_small_patch4_32",
    ]:
        assert n in names
    m = timm.create_model("vispe_vit_small_patch16_224", pos_encoding="rope_mixed")
    assert m.pos_encoding.freqs.shape == (2, 12, 6, 32)
    assert "pos_encoding.freqs" in m.no_weight_decay()
    m = timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding={"name": "rope_axial", "theta": 10.0}, depth=1)
    assert m.pos_encoding.theta == 10.0


def test_forward_intermediates_and_features_only_apply_the_encoding():
    torch.manual_seed(0)
    model = _tiny("rope_mixed").eval()
    x = torch.randn(2, 3, 24, 40)
    with torch.no_grad():
        final, inter = model.forward_intermediates(x, indices=[0, 1], norm=True)
        assert inter[-1].shape == (2, 64, 6, 10)
        ref = model.forward_features(x)
        assert torch.allclose(final, ref)
        assert torch.allclose(inter[-1].flatten(2).transpose(1, 2), ref[:, 1:])
    feat = timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding="rope_mixed", depth=2, embed_dim=64, num_heads=4, features_only=True, out_indices=(1,))
    missing, _ = feat.load_state_dict({f"model.{k}": v for k, v in model.state_dict().items()}, strict=False)
    assert not missing
    with torch.no_grad():
        fmap = feat.eval()(x)[0]
    assert torch.allclose(fmap, model.forward_intermediates(x, indices=[1], intermediates_only=True)[0], atol=1e-6)


def test_set_input_size_resamples_learned_table():
    model = _tiny("learned", dynamic_img_size=False)
    model.set_input_size((48, 48))
    assert model.pos_encoding.pos_embed.shape == (1, 1 + 144, 64)
    assert model(torch.randn(1, 3, 48, 48)).shape == (1, 5)
    model = _tiny("rope_axial", dynamic_img_size=False)
    model.set_input_size((48, 40))
    assert model(torch.randn(1, 3, 48, 40)).shape == (1, 5)


def test_rotary_table_cache_reused_and_invalidated():
    model = _tiny("rope_axial").eval()
    with torch.no_grad():
        model(torch.randn(1, 3, 32, 32))
        model(torch.randn(1, 3, 48, 48))
        n = len(model.pos_encoding._state_cache)
        model(torch.randn(1, 3, 48, 48))
    assert n == 2 and len(model.pos_encoding._state_cache) == 2
    mixed = _tiny("rope_mixed")
    with torch.no_grad():
        a = mixed.pos_encoding.prepare(PositionGrid((4, 4), 1), None).table
        mixed.pos_encoding.freqs.add_(0.5)  # an optimizer step bumps the version: no stale table
        b = mixed.pos_encoding.prepare(PositionGrid((4, 4), 1), None).table
    assert not torch.allclose(a, b)


def test_load_timm_checkpoint_reports_every_key(tmp_path):
    src = timm.create_model("vit_tiny_patch16_224", pretrained=False, depth=2, num_classes=7)
    path = tmp_path / "vit.pth"
    torch.save(src.state_dict(), path)
    rope = timm.create_model("vispe_vit_tiny_patch16_224", pos_encoding="rope_mixed", depth=2, num_classes=10)
    report = load_timm_checkpoint(rope, path)
    assert any(d.startswith("pos_embed") for d in report.dropped)
    assert any(d.startswith("head.weight") for d in report.dropped)
    assert set(report.new) == {"pos_encoding.freqs", "head.weight", "head.bias"}
    assert torch.equal(rope.blocks[1].attn.qkv.weight, src.blocks[1].attn.qkv.weight)
    learned = timm.create_model("vispe_vit_tiny_patch16_224", pos_encoding="learned", depth=2, num_classes=7, img_size=96)
    report = load_timm_checkpoint(learned, path)
    assert report.resampled == ["pos_embed -> pos_encoding.pos_embed"] and not report.new
    # through timm's factory (file overlay, no network)
    model = timm.create_model(
        "vispe_vit_tiny_patch16_224", pretrained=True, pos_encoding="rope_axial", depth=2, num_classes=7,
        pretrained_cfg_overlay=dict(file=str(path)),
    )
    assert torch.equal(model.blocks[0].mlp.fc1.weight, src.blocks[0].mlp.fc1.weight)
    assert any(d.startswith("pos_embed") for d in model.last_load_report.dropped)


# ---- bad input: early and clear -----------------------------------------------------------


def test_unknown_encoding_name_lists_choices():
    with pytest.raises(ValueError, match=r"unknown positional encoding 'ropee'.*rope_axial"):
        timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding="ropee")
    with pytest.raises(ValueError, match="rope_mixed"):
        create_encoding("nope")


def test_unknown_encoding_option_lists_valid_ones():
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['thetaa'\].*theta"):
        _tiny({"name": "rope_axial", "thetaa": 3})


@pytest.mark.parametrize("name", ["rope_axial", "rope_mixed"])
def test_rotary_head_dim_that_cannot_split(name):
    with pytest.raises(ValueError, match=r"head_dim=18"):
        _tiny(name, embed_dim=54, num_heads=3)


def test_image_size_not_divisible_by_patch():
    with pytest.raises(ValueError, match=r"img_size=\(30, 30\) is not divisible by patch_size=\(4, 4\)"):
        timm.create_model("vispe_vit_tiny_patch4_32", img_size=30)
    timm.create_model("vispe_vit_tiny_patch4_32", img_size=30, dynamic_img_pad=True, depth=1)
    model = _tiny("rope_axial")
    with pytest.raises(ValueError, match=r"input size 33x32 is not divisible by the patch size 4x4"):
        model(torch.randn(1, 3, 33, 32))
    padded = _tiny("rope_axial", dynamic_img_pad=True)
    assert padded(torch.randn(1, 3, 33, 30)).shape == (1, 5)


def test_checkpoint_with_other_width_is_refused():
    src = timm.create_model("vit_small_patch16_224", pretrained=False, depth=1)
    model = timm.create_model("vispe_vit_tiny_patch16_224", pos_encoding="rope_axial", depth=1)
    with pytest.raises(ValueError, match=r"checkpoint width 384 .* embed_dim=192"):
        load_timm_checkpoint(model, src.state_dict())


def test_bad_grid_and_registry_use():
    with pytest.raises(ValueError, match="positive sizes"):
        PositionGrid((0, 4))
    with pytest.raises(ValueError, match="takes"):
        create_encoding("rope_axial", head_dim=16).prepare(PositionGrid((2, 2, 2)), None)
    with pytest.raises(ValueError, match="already registered"):
        vispe.register_encoding("rope_axial")(type("Other", (RotaryEncoding,), {}))


def test_per_layer_rotary_tables_are_views_whose_gradient_is_the_indexed_tables():
    """A per-layer state hands each layer a view of its table (no copy), and the gradient that reaches the angles
    through those views is the one indexing the table per layer gives; ``replace`` with another table rebuilds
    the layers from that table."""
    from dataclasses import replace

    from vispe.encodings.rotary import RotaryState, apply_rotary, rotary_table

    gen = torch.Generator().manual_seed(0)
    angles = torch.randn(3, 2, 5, 4, generator=gen, requires_grad=True)  # (depth, H, L, P)
    xs = [torch.randn(2, 2, 5, 8, generator=gen) for _ in range(3)]

    def loss(for_layer):
        # two uses of one layer (q and k), one layer unused (a NoPE layer)
        return sum((apply_rotary(x, for_layer(i)) * apply_rotary(x.flip(-2), for_layer(i))).sum() for i, x in
                   zip((0, 2), xs))

    table = rotary_table(angles)
    state = RotaryState(table, per_layer=True)
    assert all(state.for_layer(i)._base is table for i in range(3))
    (got,) = torch.autograd.grad(loss(state.for_layer), angles)
    (want,) = torch.autograd.grad(loss(lambda i: rotary_table(angles)[i]), angles)
    torch.testing.assert_close(got, want)
    assert got[1].abs().max() == 0
    other = replace(state, table=table.conj())
    torch.testing.assert_close(other.for_layer(2), table[2].conj())
