"""PESI metrics on similarity maps with known answers, and materialisation vs independent oracles."""
from __future__ import annotations

import math

import numpy as np
import pytest
import timm
import torch
from timm.layers import build_sincos2d_pos_embed

import vispe  # noqa: F401  (registers encodings and models)
from vispe.analysis.pesi import (
    cosine_similarity_maps,
    materialize_pe,
    pesi_from_similarity,
    pesi_metrics,
    plot_similarity_maps,
    similarity_maps,
)
from vispe.encodings import EncodingContext, create_encoding
from vispe.encodings.grid import PositionGrid
from vispe.encodings.rotary import apply_rotary, rotary_table


def _maps(fn, h=7, w=6):
    ys, xs = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    d = np.hypot(ys[:, :, None, None] - ys[None, None], xs[:, :, None, None] - xs[None, None])
    return fn(d)


def test_radial_step_function_is_ideal():
    # similarity depends on the rounded radius only and falls with it: monotone and symmetric
    m = pesi_from_similarity(_maps(lambda d: np.exp(-np.rint(d))))
    assert m["M_U"] == pytest.approx(2.0)
    assert m["M_D"] == pytest.approx(2.0)
    assert m["A_SU"] == pytest.approx(0.0, abs=1e-12)


def test_increasing_similarity_gives_zero_and_asymmetry_is_positive():
    m = pesi_from_similarity(_maps(lambda d: 1.0 + d))
    assert m["M_U"] == pytest.approx(0.0) and m["M_D"] == pytest.approx(0.0)
    # exact distances vary inside a rounded-radius bin -> some asymmetry, but small
    m2 = pesi_from_similarity(_maps(lambda d: np.exp(-d / 3)))
    assert m2["M_U"] == pytest.approx(2.0) and 0 < m2["A_SU"] < 0.2


def test_a_su_is_the_coefficient_of_variation():
    # a 1 x 3 grid: from the middle cell the two neighbours share radius 1
    sim = np.ones((1, 3, 1, 3))
    sim[0, 1, 0, 0], sim[0, 1, 0, 2] = 0.2, 0.6
    m = pesi_from_similarity(sim)
    assert m["A_SU"] == pytest.approx(np.std([0.2, 0.6]) / 0.4)  # only the middle cell has a ring of 2


def test_sincos_is_more_monotone_than_random():
    g = torch.Generator().manual_seed(0)
    sincos = build_sincos2d_pos_embed([10, 10], dim=64).reshape(10, 10, 64)
    random = torch.randn(10, 10, 64, generator=g)
    ms, mr = pesi_metrics(sincos), pesi_metrics(random)
    assert ms["M_U"] > 1.8 and abs(mr["M_U"] - 1.0) < 0.3 and ms["M_U"] > mr["M_U"] + 0.5


def test_materialise_token_encodings_match_their_tables():
    m = timm.create_model("vispe_vit_tiny_patch16_224", pos_encoding="sincos2d", img_size=32, patch_size=4, depth=1, embed_dim=32, num_heads=2)
    pe = materialize_pe(m)
    ref = build_sincos2d_pos_embed([8, 8], dim=32).reshape(8, 8, 32)
    torch.testing.assert_close(pe, ref)
    m = timm.create_model("vispe_vit_tiny_patch16_224", pos_encoding="learned", img_size=32, patch_size=4, depth=1, embed_dim=32, num_heads=2)
    torch.testing.assert_close(materialize_pe(m), m.pos_encoding.pos_embed[0, 1:].detach().reshape(8, 8, 32))


@pytest.mark.parametrize("name", ["rope_axial", "rope_mixed"])
def test_rotary_similarity_is_the_attention_kernel(name):
    ctx = EncodingContext(dim=32, num_heads=2, depth=2, grid_size=(5, 4), num_prefix_tokens=0)
    enc = create_encoding(name, ctx)
    sim = cosine_similarity_maps(materialize_pe(enc, (5, 4))).reshape(20, 20)
    # oracle: rotate an all-ones query/key through the shared rotary path; normalised q.k over heads/layers
    grid = PositionGrid((5, 4), 0)
    ang = enc.angles(grid, None).float()
    ang = ang.reshape(-1, 20, ang.shape[-1])  # (layers*heads or 1, N, P)
    q = torch.ones(ang.shape[0], 20, ang.shape[-1] * 2)
    rotated = torch.stack([apply_rotary(q[i : i + 1][None], rotary_table(ang[i]), "interleaved")[0, 0] for i in range(ang.shape[0])])
    dots = torch.einsum("hnd,hmd->nm", rotated, rotated) / (rotated[0, 0] @ rotated[0, 0] * ang.shape[0])
    torch.testing.assert_close(sim, dots, atol=1e-5, rtol=1e-5)


def test_not_materialisable_encodings_raise():
    m = timm.create_model("vispe_vit_tiny_patch16_224", pos_encoding="none", img_size=32, patch_size=4, depth=1, embed_dim=32, num_heads=2)
    with pytest.raises(ValueError, match="cannot be materialised"):
        materialize_pe(m)
    with pytest.raises(ValueError, match="grid_size is required"):
        materialize_pe(m.pos_encoding)
    with pytest.raises(ValueError, match="expected similarity maps"):
        pesi_from_similarity(np.zeros((3, 3)))


@pytest.mark.parametrize("name", ["irpe", "cpe"])
def test_bias_and_conditional_encodings_raise(name):
    if name not in vispe.list_encodings():
        pytest.skip(f"{name} not registered")
    m = timm.create_model("vispe_vit_tiny_patch16_224", pos_encoding=name, img_size=32, patch_size=4, depth=1, embed_dim=32, num_heads=2)
    with pytest.raises(ValueError, match="cannot be materialised"):
        materialize_pe(m)


@pytest.mark.parametrize("name", ["rope_axial", "rope_mixed"])
def test_attend_hook_kernel_equals_angle_features(name):
    # two independent routes to the rotary kernel: the encoding's attend() vs its angles()
    m = timm.create_model("vispe_vit_tiny_patch16_224", pos_encoding=name, img_size=24, patch_size=4, depth=2, embed_dim=32, num_heads=2).eval()
    torch.testing.assert_close(similarity_maps(m), cosine_similarity_maps(materialize_pe(m)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["lff", "loope", "comrope_ap", "comrope_ld"])
def test_other_materialisable_encodings(name):
    if name not in vispe.list_encodings():
        pytest.skip(f"{name} not registered")
    m = timm.create_model("vispe_vit_tiny_patch16_224", pos_encoding=name, img_size=32, patch_size=4, depth=1, embed_dim=32, num_heads=2)
    m.eval()
    sim = similarity_maps(m).reshape(64, 64)
    assert torch.isfinite(sim).all()
    torch.testing.assert_close(torch.diagonal(sim), torch.ones(64), atol=1e-4, rtol=0)
    torch.testing.assert_close(sim, sim.T, atol=1e-4, rtol=0)  # rotations and dot products are symmetric
    metrics = pesi_metrics(m)
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.slow
def test_plot_similarity_maps(tmp_path):
    pe = build_sincos2d_pos_embed([6, 6], dim=32).reshape(6, 6, 32)
    path = plot_similarity_maps(pe, tmp_path / "maps.png", title="sincos2d")
    assert path.exists() and path.stat().st_size > 1000
    path = plot_similarity_maps(pe, tmp_path / "few.png", cells=[(0, 0), (3, 3)])
    assert path.exists()
    with pytest.raises(ValueError, match="outside"):
        plot_similarity_maps(pe, tmp_path / "bad.png", cells=[(6, 0)])
