"""3D encodings for video ViTs and the timm-registered video ViT."""
from __future__ import annotations

import pytest
import timm
import torch
from timm.layers import apply_rot_embed, build_rotary_pos_embed, freq_bands

import vispe
from vispe.encodings import EncodingContext, PositionGrid, create_encoding
from vispe.models.video_vit import VispeVideoViT

VIDEO_ENCODINGS = ["rope_axial_3d", "rope_mixed_3d", "sincos3d", "learned_3d", "comrope_ld_3d", "rope_dinov3_3d",
                   "alibi_3d", "fire_3d", "liere_3d"]
TINY = dict(embed_dim=48, depth=1, num_heads=2, img_size=32, num_frames=8, tubelet_size=2, patch_size=8, num_classes=5)


def _need(name: str) -> None:
    if name not in vispe.list_encodings():
        pytest.skip(f"{name} is not registered in this checkout")


def ctx(head_dim=24, heads=2, grid=(4, 4, 4), prefix=1, depth=2):
    return EncodingContext(dim=head_dim * heads, num_heads=heads, depth=depth, grid_size=grid, num_prefix_tokens=prefix)


# ---------------------------------------------------------------------------------------------
# encodings
# ---------------------------------------------------------------------------------------------


def test_rope_axial_3d_matches_timm_functional_3d_rope():
    """Equal t/h/w split: the rotation equals timm's build_rotary_pos_embed + apply_rot_embed (interleaved)."""
    head_dim, grid = 48, PositionGrid((3, 4, 5), 0)
    e = create_encoding("rope_axial_3d", ctx(head_dim, 2, grid.shape, 0), sections=(8, 8, 8), theta=100.0)
    state = e.prepare(grid)
    x = torch.randn(2, 2, grid.num_patches, head_dim)
    sin, cos = build_rotary_pos_embed(list(grid.shape), bands=freq_bands(8, temperature=100.0, step=1), in_pixels=False)
    assert torch.allclose(e.rotate(x, state), apply_rot_embed(x, sin, cos), atol=1e-5)


def test_rope_axial_3d_single_frame_equals_2d_rope_axial():
    """sections (0, P/2, P/2): a T=1 video gets 2D rope_axial's ladders (chunks in (h, w) order instead of (x, y))."""
    head_dim = 32
    e3 = create_encoding("rope_axial_3d", ctx(head_dim, 2, (1, 4, 6), 0), sections=(0, 8, 8))
    e2 = create_encoding("rope_axial", ctx(head_dim, 2, (4, 6), 0))
    a3 = e3.angles(PositionGrid((1, 4, 6)), None)
    a2 = e2.angles(PositionGrid((4, 6)), None)
    assert torch.equal(a3, torch.cat([a2[:, 8:], a2[:, :8]], -1))  # one implementation: bit-identical ladders


def test_rope_axial_3d_relative_in_time():
    """Shifting every frame index by one keeps all within-pair score structure (q.k depends on differences)."""
    e = create_encoding("rope_axial_3d", ctx(24, 2, (6, 2, 2), 0))
    ang = e.angles(PositionGrid((6, 2, 2)), None).reshape(6, 4, -1)
    diff = ang[1:] - ang[:-1]  # consecutive frames: same angle increment everywhere
    assert torch.allclose(diff, diff[:1].expand_as(diff), atol=1e-5)


def test_rope_mixed_3d_angles_and_init():
    e = create_encoding("rope_mixed_3d", ctx(24, 2, (4, 3, 3), 1, depth=3))
    assert e.freqs.shape == (3, 3, 2, 12) and e.no_weight_decay() == {"freqs"}
    grid = PositionGrid((2, 3, 4), 1)
    ang = e.angles(grid, None)  # (depth, H, N, P)
    idx = grid.indices()
    f = e.freqs.detach()
    naive = torch.einsum("na,adhp->dhnp", idx, f)
    assert torch.allclose(ang, naive, atol=1e-6)
    ladder = 100.0 ** (-torch.arange(12) / 12)
    assert torch.allclose(f[0, 0, 0], ladder)
    zero = create_encoding("rope_mixed_3d", ctx(24, 2, (4, 3, 3)), temporal_init="zero")
    assert torch.equal(zero.freqs[0], torch.zeros_like(zero.freqs[0]))
    with pytest.raises(ValueError, match="temporal_init"):
        create_encoding("rope_mixed_3d", ctx(), temporal_init="random")


def test_sincos3d_formula_and_extension():
    dim = 48
    e = create_encoding("sincos3d", ctx(24, 2, (2, 3, 4), 0))
    small = e.table_for(PositionGrid((2, 3, 4)), None)[0].reshape(2, 3, 4, dim)
    big = e.table_for(PositionGrid((3, 5, 6)), None)[0].reshape(3, 5, 6, dim)
    assert torch.allclose(small, big[:2, :3, :4])  # 'extend' evaluates the same formula at each index
    # independent check for one token: t/h/w parts of 8/8/8 bands, [sin | cos] per axis
    t, h, w = 1, 2, 3
    expect = []
    for v in (t, h, w):
        om = 10000.0 ** (-torch.arange(8, dtype=torch.float64) / 8)
        expect += [torch.sin(v * om), torch.cos(v * om)]
    assert torch.allclose(small[t, h, w].double(), torch.cat(expect), atol=1e-6)
    interp = create_encoding("sincos3d", ctx(24, 2, (2, 3, 4), 0), extrapolation="interpolate")
    assert torch.equal(interp.table_for(PositionGrid((2, 3, 4)), None), e.table_for(PositionGrid((2, 3, 4)), None))


def test_learned_3d_resample_and_prefix():
    e = create_encoding("learned_3d", ctx(24, 2, (2, 3, 3), 1))
    x = torch.zeros(1, 1 + 18, 48)
    out = e.embed_tokens(x, PositionGrid((2, 3, 3), 1))
    assert torch.equal(out[0, 1:], e.pos_embed[0].reshape(18, 48)) and torch.equal(out[0, :1], e.prefix_embed[0])
    out = e.embed_tokens(torch.zeros(1, 1 + 4 * 6 * 6, 48), PositionGrid((4, 6, 6), 1))
    assert out.shape == (1, 145, 48)
    const = create_encoding("learned_3d", ctx(24, 2, (2, 3, 3), 0), embed_prefix=False)
    with torch.no_grad():
        const.pos_embed.fill_(0.5)
    assert torch.allclose(const.embed_tokens(torch.zeros(1, 40, 48), PositionGrid((2, 4, 5), 0)), torch.full((1, 40, 48), 0.5))


# ---------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------


def test_registered_in_timm():
    names = timm.list_models("vispe_video_vit_*")
    assert {"vispe_video_vit_tiny_patch16_224", "vispe_video_vit_small_patch16_224", "vispe_video_vit_nano_patch8_64"} <= set(names)
    m = timm.create_model("vispe_video_vit_nano_patch8_64", pos_encoding="rope_axial_3d", depth=1, num_classes=3)
    assert isinstance(m, VispeVideoViT) and m.grid_size == (4, 8, 8) and m.patch_embed.kernel == (2, 8, 8)
    assert m(torch.randn(1, 3, 8, 64, 64)).shape == (1, 3)


@pytest.mark.parametrize("name", VIDEO_ENCODINGS)
@pytest.mark.parametrize("frames, size", [(8, 32), (32, 48)])
def test_forward_backward_frames_and_resolutions(name, frames, size):
    _need(name)
    torch.manual_seed(0)
    m = VispeVideoViT(pos_encoding=name, **TINY)
    x = torch.randn(1, 3, frames, size, size)
    y = m(x)
    assert y.shape == (1, 5) and torch.isfinite(y).all()
    y.sum().backward()
    assert m.patch_embed.proj.weight.grad is not None
    for n, p in m.pos_encoding.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
    tokens = m.forward_video_tokens(x)
    assert tokens.shape == (1, frames // 2, size // 8, size // 8, 48)


def test_single_frame_video_vit_equals_2d_vispe_vit():
    """tubelet 1, T = 1, rope_axial_3d with sections (0, P/2, P/2) == the 2D ViT with rope_axial (timm blocks).

    The 3D chunks are (h, w) and the 2D ones (x, y); swapping the two halves of every q/k head in the
    copied qkv weights maps one onto the other, and q.k is unchanged by a common channel permutation.
    """
    torch.manual_seed(0)
    common = dict(embed_dim=64, depth=2, num_heads=2, num_classes=5)
    m2 = timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding="rope_axial", img_size=32, patch_size=8, **common).eval()
    m3 = VispeVideoViT(
        pos_encoding={"name": "rope_axial_3d", "sections": (0, 8, 8)}, img_size=32, num_frames=1, tubelet_size=1, patch_size=8, **common
    ).eval()
    sd = {k: v.clone() for k, v in m2.state_dict().items()}
    sd["patch_embed.proj.weight"] = sd["patch_embed.proj.weight"][:, :, None]
    dim, hd = 64, 32
    perm = torch.cat([torch.arange(16, 32), torch.arange(0, 16)])
    for i in range(2):
        for suffix in ("weight", "bias"):
            w = sd[f"blocks.{i}.attn.qkv.{suffix}"]
            for part in (0, 1):  # q and k, not v
                for h in range(2):
                    sl = slice(part * dim + h * hd, part * dim + (h + 1) * hd)
                    w[sl] = w[sl][perm]
    missing, unexpected = m3.load_state_dict(sd, strict=False)
    assert missing == [] and unexpected == []
    img = torch.randn(2, 3, 32, 32)
    assert torch.allclose(m3(img[:, :, None]), m2(img), atol=1e-5)


def test_set_input_size_resamples_learned_table():
    m = VispeVideoViT(pos_encoding="learned_3d", **TINY)
    assert m.pos_encoding.pos_embed.shape[1:4] == (4, 4, 4)
    m.set_input_size(img_size=48, num_frames=16)
    assert m.grid_size == (8, 6, 6) and m.pos_encoding.pos_embed.shape[1:4] == (8, 6, 6)
    with pytest.raises(ValueError, match="tubelet"):
        m.set_input_size(num_frames=5)


def test_bad_inputs_raise():
    m = VispeVideoViT(pos_encoding="rope_axial_3d", **TINY)
    with pytest.raises(ValueError, match="tubelet"):
        m(torch.randn(1, 3, 7, 32, 32))
    with pytest.raises(ValueError, match="tubelet"):
        m(torch.randn(1, 3, 8, 30, 32))
    with pytest.raises(ValueError, match=r"\(B, C=3, T, H, W\) or an image \(B, C=3, H, W\), got \(1, 4, 32, 32\)"):
        m(torch.randn(1, 4, 32, 32))  # wrong channel count
    with pytest.raises(ValueError, match=r"got \(3, 32, 32\)"):
        m(torch.randn(3, 32, 32))
    with pytest.raises(ValueError, match="3D"):
        VispeVideoViT(pos_encoding="rope_axial", **TINY)
    with pytest.raises(ValueError, match="unknown positional encoding"):
        VispeVideoViT(pos_encoding="rope_4d", **TINY)
    with pytest.raises(TypeError, match="valid options"):
        VispeVideoViT(pos_encoding={"name": "rope_axial_3d", "bogus": 1}, **TINY)
    with pytest.raises(ValueError, match="sections"):
        VispeVideoViT(pos_encoding={"name": "rope_axial_3d", "sections": (1, 1, 1)}, **TINY)


def test_image_input_is_a_still_clip_of_one_tubelet():
    """timm feeds every registered model (B, C, H, W): the video ViT reads it as one tubelet of identical frames."""
    torch.manual_seed(0)
    m = VispeVideoViT(pos_encoding="rope_axial_3d", **TINY).eval()
    image = torch.randn(2, 3, 32, 32)
    still = image.unsqueeze(2).expand(-1, -1, m.patch_embed.kernel[0], -1, -1)
    with torch.no_grad():
        assert torch.equal(m(image), m(still))
        tokens, grid = m.embed(image)
    assert grid.shape == (1, 32 // m.patch_embed.kernel[1], 32 // m.patch_embed.kernel[2])
