"""nD-RoPE (arXiv 2606.12146; no released code found): a regular simplex of wave vectors at every scale, all
directions alike under the simplex's symmetries, an isotropic second moment, offset-only logits, ViT / video ViT
training steps, bf16, patch dropout, bad options."""
from __future__ import annotations

import itertools
import math

import pytest
import timm
import torch
from rotary_checks import check_vit_trains, shifted_block_logits

import vispe  # noqa: F401  (registers the models)
from vispe.encodings import EncodingContext, PositionGrid, create_encoding
from vispe.encodings.nd_rope import simplex_vertices
from vispe.models.video_vit import VispeVideoViT


def _nd(grid=(3, 4), heads=2, head_dim=16, prefix=0, **kw):
    ctx = EncodingContext(dim=heads * head_dim, num_heads=heads, depth=1, grid_size=tuple(grid), num_prefix_tokens=prefix)
    return create_encoding("nd_rope", ctx, **kw)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_simplex_vertices_are_regular_and_centred(n):
    v = simplex_vertices(n)
    assert v.shape == (n + 1, n)
    gram = v @ v.T
    want = torch.full((n + 1, n + 1), -1.0 / n, dtype=torch.float64).fill_diagonal_(1.0)
    assert torch.allclose(gram, want, atol=1e-12)
    assert torch.allclose(v.sum(0), torch.zeros(n, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(v.T @ v, (n + 1) / n * torch.eye(n, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("grid,head_dim", [((4, 4), 16), ((2, 3, 3), 24)])
def test_scales_and_isotropic_second_moment(grid, head_dim):
    enc = _nd(grid, head_dim=head_dim)
    n, pairs = len(grid), head_dim // 2
    scales = pairs // (n + 1)
    w = enc.freqs.double()
    per_scale = w[: scales * (n + 1)].reshape(scales, n + 1, n)
    mags = per_scale.norm(dim=-1)
    assert torch.allclose(mags, mags[:, :1].expand_as(mags), atol=1e-6)  # one magnitude per scale
    assert torch.allclose(mags[:, 0], 100.0 ** (-torch.arange(scales, dtype=torch.float64) / scales), atol=1e-6)
    assert torch.equal(w[scales * (n + 1):], torch.zeros_like(w[scales * (n + 1):]))  # leftover pairs unrotated
    for s in range(scales):
        m = per_scale[s].T @ per_scale[s]
        assert torch.allclose(m, m.trace() / n * torch.eye(n, dtype=torch.float64), atol=1e-6)


@pytest.mark.parametrize("n", [2, 3])
def test_all_directions_alike_under_the_simplex_symmetries(n):
    """Every permutation of the vertices is an orthogonal map R of the lattice space; it permutes each scale's wave
    vectors, so the content-free kernel mean_p cos(omega_p . d) is the same at d and R d (for all (n+1)! of them)."""
    torch.manual_seed(0)
    enc = _nd((4,) * n, head_dim=4 * (n + 1))
    w = enc.freqs.double()
    verts = simplex_vertices(n)
    d = torch.randn(64, n, dtype=torch.float64) * 3

    def kernel(x):
        return torch.cos(x @ w.T).mean(-1)

    k0 = kernel(d)
    maps = 0
    for perm in itertools.permutations(range(n + 1)):
        rot = torch.linalg.lstsq(verts, verts[list(perm)]).solution.T  # R v_i = v_perm(i)
        assert torch.allclose(rot @ rot.T, torch.eye(n, dtype=torch.float64), atol=1e-10)
        assert torch.allclose(kernel(d @ rot.T), k0, atol=1e-10)
        maps += 1
    assert maps == math.factorial(n + 1)
    # and the kernel is not radial (a lattice encoding, not a blur): two directions at one distance differ
    assert (kernel(torch.tensor([[2.0] + [0.0] * (n - 1)], dtype=torch.float64))
            - kernel(torch.tensor([[0.0] * (n - 1) + [2.0]], dtype=torch.float64))).abs() > 1e-3


@pytest.mark.parametrize("grid,shift", [((3, 4), (2, 1)), ((2, 3, 3), (1, 2, 1))])
def test_logits_depend_on_offsets_only(grid, shift):
    torch.manual_seed(0)
    enc = _nd(grid, head_dim=16)
    a, b, crossed = shifted_block_logits(enc, grid, shift, head_dim=16)
    assert (a - b).abs().max() < 1e-5 * a.abs().max()
    assert (a - crossed).abs().max() > 1e-2  # positions do matter: keys moved against the queries change the logits


def test_prefix_tokens_are_not_rotated_and_interpolate_rescales():
    enc = _nd((4, 4), prefix=1)
    q = torch.randn(1, 2, 17, 16)
    assert torch.equal(enc.rotate(q, enc.prepare(PositionGrid((4, 4), 1)))[..., 0, :], q[..., 0, :])
    enc = _nd((4, 4), extrapolation="interpolate")
    big = enc.angles(PositionGrid((8, 8), 0), None).reshape(8, 8, -1)
    small = enc.angles(PositionGrid((4, 4), 0), None).reshape(4, 4, -1)
    assert torch.allclose(big[::2, ::2], small, atol=1e-6)  # the 8x8 grid spans the training grid's range


def _vit(**kw):
    return timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding=kw.pop("pos_encoding", "nd_rope"), depth=2,
                             embed_dim=64, num_heads=4, num_classes=5, **kw)


def test_vit_trains_at_three_grids_with_patch_dropout_and_bf16():
    torch.manual_seed(0)
    check_vit_trains(_vit, _vit())


@pytest.mark.parametrize("frames,size", [(4, 32), (2, 48)])
def test_video_vit_trains(frames, size):
    torch.manual_seed(0)
    model = VispeVideoViT(pos_encoding="nd_rope", embed_dim=48, depth=2, num_heads=2, img_size=32, num_frames=4,
                          tubelet_size=2, patch_size=8, num_classes=5)
    assert model.pos_encoding.freqs.shape == (12, 3)
    out = model(torch.randn(1, 3, frames, size, size))
    assert out.shape == (1, 5) and torch.isfinite(out).all()
    out.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("options,needle", [
    ({"theta": 1.0}, "theta=1.0"),
    ({"extrapolation": "yarn"}, "'yarn'"),
    ({"head_dim": 4}, "head_dim >= 6"),
])
def test_bad_options_are_refused_at_construction(options, needle):
    head_dim = options.pop("head_dim", 16)
    with pytest.raises(ValueError, match=needle):
        _nd((3, 4), head_dim=head_dim, **options)
