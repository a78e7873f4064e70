"""LOOPE: Gilbert order (every cell once, unit steps, inverse permutation), sinusoid of the order,
bounded image-conditioned offset, size-agnostic head, grids, bf16, parameter counts, bad input."""
from __future__ import annotations

import pytest
import timm
import torch

import vispe  # noqa: F401
from vispe.encodings import EncodingContext, PositionGrid, create_encoding
from vispe.encodings.gilbert import gilbert_order, gilbert_path
from vispe.encodings.loope import sinusoid_1d

MODEL = "vispe_vit_tiny_patch4_32"


def _loope(dim=16, grid=(4, 4), patch=(4, 4), **kw):
    return create_encoding("loope", EncodingContext(dim, 1, 1, grid, patch_size=patch), **kw)  # one head: dim may be odd


@pytest.mark.parametrize("h,w", [(h, w) for h in range(1, 13) for w in range(1, 13)] + [(14, 14), (7, 24), (24, 7), (15, 20), (20, 15), (33, 31)])
def test_gilbert_visits_every_cell_once_with_unit_steps(h, w):
    path = gilbert_path(h, w)
    assert len(path) == h * w and len(set(path)) == h * w
    assert all(0 <= r < h and 0 <= c < w for r, c in path)
    assert all(abs(r1 - r2) + abs(c1 - c2) == 1 for (r1, c1), (r2, c2) in zip(path, path[1:]))
    order = gilbert_order(h, w)
    # inverse permutation: patch p (row-major) is visited at step order[p]
    for step, (r, c) in enumerate(path):
        assert order[r * w + c] == step


def test_gilbert_square_starts_along_x_and_is_local():
    path = gilbert_path(8, 8)
    assert path[0] == (0, 0) and path[-1] == (0, 7)  # major axis x: from the top-left to the top-right corner
    # Hilbert-like locality: each aligned 2x2 quad of an 8x8 grid is visited in 4 consecutive steps
    order = gilbert_order(8, 8).reshape(8, 8)
    for i in range(0, 8, 2):
        for j in range(0, 8, 2):
            q = order[i : i + 2, j : j + 2].flatten().sort().values
            assert (q[-1] - q[0]).item() == 3


def test_fixed_order_is_sinusoid_of_curve_step():
    enc = _loope(offset=False)
    grid = PositionGrid((4, 4), 1)
    x = torch.zeros(1, 17, 16)
    pe = enc.embed_tokens(x, grid)[0, 1:]
    xg = gilbert_order(4, 4).float()
    assert torch.allclose(pe[:, 0], torch.sin(xg), atol=1e-6) and torch.allclose(pe[:, 1], torch.cos(xg), atol=1e-6)
    w1 = 10000 ** (-2 / 16)
    assert torch.allclose(pe[:, 2], torch.sin(xg * w1), atol=1e-6) and torch.allclose(pe[:, 3], torch.cos(xg * w1), atol=1e-6)
    assert sum(p.numel() for p in enc.parameters()) == 16  # only the cls vector


def test_offset_is_bounded_image_conditioned_and_differentiable():
    torch.manual_seed(0)
    enc = _loope()
    grid = PositionGrid((4, 4), 1)
    img = torch.randn(3, 3, 16, 16)
    off = enc.positions(grid, img, None) - gilbert_order(4, 4).float()
    assert off.shape == (3, 16) and (off.abs() < 1).all() and off.abs().max() > 0.05
    big = _loope()
    with torch.no_grad():
        for p in big.context.parameters():
            p.mul_(50)  # saturate the squashing: still bounded (float32 may round to exactly +-1)
        off_big = big.positions(grid, img, None) - gilbert_order(4, 4).float()
    assert torch.isfinite(off_big).all() and (off_big.abs() <= 1).all() and off_big.abs().max() > 0.9
    assert not torch.allclose(off[0], off[1])  # per image
    out = enc.embed_tokens(torch.zeros(3, 17, 16), grid, image=img)
    (out * torch.randn_like(out)).sum().backward()  # not out.square(): sin^2 + cos^2 is constant
    assert enc.context.cnn[0].weight.grad.abs().sum() > 0


def test_size_agnostic_default_and_linear_head_error():
    torch.manual_seed(0)
    enc = _loope()  # grid (4, 4), N_train = 16
    grid = PositionGrid((6, 10), 1)
    xg = enc.curve_positions(grid, None)
    assert xg.min() == 0 and abs(xg.max().item() - 15) < 1e-5  # normalised: spans the training range
    out = enc.embed_tokens(torch.zeros(2, grid.seq_len, 16), grid, image=torch.randn(2, 3, 24, 40))
    assert out.shape == (2, 61, 16) and torch.isfinite(out).all()
    raw = _loope(order_scale="index")
    assert raw.curve_positions(grid, None).max() == 59
    lin = _loope(head="linear")
    lin.embed_tokens(torch.zeros(1, 17, 16), PositionGrid((4, 4), 1), image=torch.randn(1, 3, 16, 16))
    with pytest.raises(ValueError, match="head='local'"):
        lin.embed_tokens(torch.zeros(1, 61, 16), grid, image=torch.randn(1, 3, 24, 40))


@pytest.mark.parametrize("opts", [{}, {"offset": False}])
def test_forward_backward_grids_and_bf16(opts):
    model = timm.create_model(MODEL, pos_encoding={"name": "loope", **opts}, depth=1)
    for hw in [(32, 32), (48, 48), (32, 56)]:
        model.zero_grad()
        model(torch.randn(2, 3, *hw)).sum().backward()
        assert all(p.grad is not None for p in model.pos_encoding.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(2, 3, 40, 32))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_dynamic_img_pad():
    model = timm.create_model(MODEL, pos_encoding="loope", depth=1, dynamic_img_pad=True)
    assert model(torch.randn(1, 3, 30, 35)).shape == (1, 10)


def test_param_count_vit_b():
    # code version: convs 57,921 + BN 2 + Linear 196x196 (no bias) 38,416 + cls 768 = 97,107
    with torch.device("meta"):
        code = timm.create_model("vispe_vit_base_patch16_224", pos_encoding={"name": "loope", "head": "linear"})
        paper = timm.create_model("vispe_vit_base_patch16_224", pos_encoding={"name": "loope", "head": "linear", "linear_bias": True})
        local = timm.create_model("vispe_vit_base_patch16_224", pos_encoding="loope")
        fixed = timm.create_model("vispe_vit_base_patch16_224", pos_encoding={"name": "loope", "offset": False})
    count = lambda m: sum(p.numel() for p in m.pos_encoding.parameters())  # noqa: E731
    assert count(code) == 97_107 and count(paper) == 97_107 + 196
    assert count(local) == 57_921 + 2 + 3 + 768 and count(fixed) == 768


def test_sinusoid_shape_and_bad_input():
    assert sinusoid_1d(torch.arange(5.0), 8).shape == (5, 8)
    with pytest.raises(ValueError, match="even"):
        _loope(dim=15)
    with pytest.raises(ValueError, match=r"head='mlp' is not valid; choose one of \['local', 'linear'\]"):
        _loope(head="mlp")
    with pytest.raises(ValueError, match="order_scale"):
        _loope(order_scale="raw")
    with pytest.raises(ValueError, match="image"):
        _loope().embed_tokens(torch.zeros(1, 17, 16), PositionGrid((4, 4), 1))
