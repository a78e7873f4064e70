"""Learnable Fourier features: the paper's init and kernel, resolution = new inputs, grouping,
prefix vectors, grids, bf16, parameter counts, bad input."""
from __future__ import annotations

import math

import pytest
import timm
import torch

import vispe  # noqa: F401
from vispe.encodings import EncodingContext, PositionGrid, create_encoding
from vispe.encodings.lff import LearnableFourierFeatures

MODEL = "vispe_vit_tiny_patch4_32"


def _lff(dim=16, grid=(4, 4), **kw):
    return create_encoding("lff", EncodingContext(dim, 1, 1, grid), **kw)  # one head: dim may be odd


def test_init_is_paper_gaussian_kernel():
    """W_r ~ N(0, gamma^-2) and the 1/sqrt(|F|) factor: F(x).F(y) ~ 0.5 exp(-|x-y|^2 / (2 gamma^2))."""
    torch.manual_seed(0)
    gamma = 0.2
    lff = LearnableFourierFeatures(2, 8, fourier_dim=40_000, gamma=gamma)
    assert abs(lff.freqs.std().item() - 1 / gamma) < 0.05 / gamma
    x = torch.tensor([[[0.3, 0.4]]])
    for d in (0.0, 0.1, 0.2, 0.4):
        y = x + torch.tensor([d, 0.0])
        got = (lff.fourier(x) * lff.fourier(y)).sum().item()
        assert abs(got - 0.5 * math.exp(-d * d / (2 * gamma**2))) < 0.02


def test_lightglue_init_option_draws_std_gamma_to_the_minus_2():
    """The widely used implementation (cvg/LightGlue) draws W_r with std gamma^-2: its kernel length scale is gamma^2."""
    torch.manual_seed(0)
    gamma = 0.5
    paper = LearnableFourierFeatures(2, 8, fourier_dim=40_000, gamma=gamma)
    common = LearnableFourierFeatures(2, 8, fourier_dim=40_000, gamma=gamma, freq_init="lightglue")
    assert abs(paper.freqs.std().item() - 2.0) < 0.05 and abs(common.freqs.std().item() - 4.0) < 0.1
    x = torch.tensor([[[0.3, 0.4]]])
    y = x + torch.tensor([0.2, 0.0])
    got = (common.fourier(x) * common.fourier(y)).sum().item()
    assert abs(got - 0.5 * math.exp(-0.04 / (2 * gamma**4))) < 0.02
    assert _lff(freq_init="lightglue").features.freqs.shape == _lff().features.freqs.shape
    with pytest.raises(ValueError, match="freq_init"):
        _lff(freq_init="std")


def test_new_resolution_is_new_inputs():
    """Coordinates are normalised centres: column c of a w-wide grid and column 3c+1 of a 3w-wide grid
    are the same point, so they get the same encoding."""
    torch.manual_seed(0)
    enc = _lff()
    small = enc.table_for(PositionGrid((4, 4), 1), None).reshape(4, 4, -1)
    wide = enc.table_for(PositionGrid((4, 12), 1), None).reshape(4, 12, -1)
    tall = enc.table_for(PositionGrid((12, 4), 1), None).reshape(12, 4, -1)
    assert torch.allclose(wide[:, 1::3], small, atol=1e-6)
    assert torch.allclose(tall[1::3], small, atol=1e-6)
    assert not torch.allclose(wide[:, 0::3], small, atol=1e-4)


def test_groups_per_axis_are_separable():
    torch.manual_seed(0)
    enc = _lff(groups=2)
    pe = enc.table_for(PositionGrid((3, 5), 1), None).reshape(3, 5, 16)
    rows, cols = pe[..., :8], pe[..., 8:]
    assert torch.allclose(rows, rows[:, :1].expand_as(rows), atol=1e-6)  # first half: row only
    assert torch.allclose(cols, cols[:1].expand_as(cols), atol=1e-6)  # second half: column only
    assert not torch.allclose(rows[0], rows[1], atol=1e-4)


def test_prefix_vectors_and_tokens():
    enc = _lff()
    grid = PositionGrid((4, 4), 1)
    x = torch.randn(2, 17, 16)
    out = enc.embed_tokens(x, grid)
    assert torch.equal(out[:, :1], x[:, :1])  # zero-initialised prefix vector
    assert torch.allclose(out[:, 1:] - x[:, 1:], enc.table_for(grid, None)[None].expand(2, -1, -1), atol=1e-6)
    out.sum().backward()
    assert enc.prefix_embed.grad.abs().sum() > 0


@pytest.mark.parametrize("opts", [{"groups": 2, "fourier_dim": 64}])  # defaults: tests/test_encoding_contracts.py
def test_forward_backward_grids_and_bf16(opts):
    model = timm.create_model(MODEL, pos_encoding={"name": "lff", **opts}, depth=1)
    for hw in [(32, 32), (48, 48), (32, 56)]:
        model.zero_grad()
        model(torch.randn(2, 3, *hw)).sum().backward()
        assert model.pos_encoding.features.freqs.grad.abs().sum() > 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(2, 3, 40, 32))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    assert "pos_encoding.features.freqs" in model.no_weight_decay()


def test_video_grid():
    enc = create_encoding("lff", EncodingContext(24, 2, 1, (2, 3, 3)), groups=3)
    grid = PositionGrid((4, 3, 5), 0)
    out = enc.embed_tokens(torch.zeros(1, grid.seq_len, 24), grid)
    assert out.shape == (1, 60, 24) and torch.isfinite(out).all()


def test_param_count_vit_b():
    # |F| M/2 + |F||H| + |H| + |H| D/G + D/G with |F|=768, |H|=32, D=768, G=1, M=2: 50,720 (+768 cls vector)
    with torch.device("meta"):
        model = timm.create_model("vispe_vit_base_patch16_224", pos_encoding="lff")
        no_cls = timm.create_model("vispe_vit_base_patch16_224", pos_encoding={"name": "lff", "prefix_embed": False})
        grouped = timm.create_model("vispe_vit_base_patch16_224", pos_encoding={"name": "lff", "groups": 2})
    count = lambda m: sum(p.numel() for p in m.pos_encoding.parameters())  # noqa: E731
    assert count(no_cls) == 50_720 and count(model) == 50_720 + 768
    f, h, d, g, m = 768, 32, 768, 2, 1
    assert count(grouped) == f * m // 2 + f * h + h + h * d // g + d // g + 768


def test_bad_input():
    with pytest.raises(ValueError, match="even"):
        _lff(fourier_dim=33)
    with pytest.raises(ValueError, match="groups=3"):
        _lff(groups=3)
    with pytest.raises(ValueError, match="divisible by groups"):
        _lff(dim=15, groups=2)
    with pytest.raises(ValueError, match="gamma"):
        _lff(gamma=0.0)
