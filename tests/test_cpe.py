"""CPE/PEG: equality with timm's twins.PosConv, interior translation equivariance, zero-padding
position cue, prefix bypass, placement, GAP variant, grids, bf16, parameter counts, bad input."""
from __future__ import annotations

import pytest
import timm
import torch
from timm.models.twins import PosConv

import vispe  # noqa: F401
from vispe.encodings import EncodingContext, PositionGrid, create_encoding

MODEL = "vispe_vit_tiny_patch4_32"


def _cpe(dim=8, depth=3, **kw):
    return create_encoding("cpe", EncodingContext(dim, 2, depth, (4, 4)), **kw)


def test_equals_timm_posconv_and_prefix_bypass():
    torch.manual_seed(0)
    enc = _cpe()
    ref = PosConv(8, 8)
    ref.proj[0].load_state_dict(enc.pegs["0"].proj.state_dict())
    grid = PositionGrid((3, 5), 2)
    x = torch.randn(2, grid.seq_len, 8)
    out = enc.after_block(0, x, grid)
    assert torch.equal(out[:, :2], x[:, :2])  # prefix tokens untouched
    assert torch.allclose(out[:, 2:], ref(x[:, 2:], (3, 5)), atol=1e-6)


def test_translation_equivariant_on_interior_tokens():
    torch.manual_seed(0)
    enc = _cpe(kernel_size=3)
    h, w, dy, dx = 7, 9, 1, 2
    grid = PositionGrid((h, w), 1)
    x = torch.randn(1, grid.seq_len, 8)
    fmap = x[:, 1:].reshape(1, h, w, 8)
    shifted = torch.roll(fmap, shifts=(dy, dx), dims=(1, 2))
    xs = torch.cat([x[:, :1], shifted.reshape(1, h * w, 8)], dim=1)
    y = enc.after_block(0, x, grid)[:, 1:].reshape(1, h, w, 8)
    ys = enc.after_block(0, xs, grid)[:, 1:].reshape(1, h, w, 8)
    # interior: the 3x3 window of (i, j) in the shifted map is the unshifted window of (i-dy, j-dx),
    # with no wrap-around and no padding involved
    r0, c0 = dy + 1, dx + 1
    assert torch.allclose(ys[:, r0 : h - 1, c0 : w - 1], y[:, r0 - dy : h - 1 - dy, c0 - dx : w - 1 - dx], atol=1e-6)
    # ... but not at the border, where zero padding leaks absolute position
    assert not torch.allclose(ys[:, 0, 0], y[:, -dy, -dx], atol=1e-3)


def test_zero_padding_gives_absolute_cue():
    enc = _cpe()
    grid = PositionGrid((5, 5), 0)
    const = torch.ones(1, 25, 8)
    out = enc.after_block(0, const, grid).reshape(5, 5, 8)
    assert not torch.allclose(out[0, 0], out[2, 2])  # corner differs from centre for a constant input
    assert torch.allclose(out[1, 1], out[2, 2]) and torch.allclose(out[1, 2], out[3, 3])  # interior is uniform


def test_placement():
    enc = _cpe(depth=4, positions=(-1, 0, 2))
    grid = PositionGrid((4, 4), 1)
    x = torch.randn(1, 17, 8)
    assert torch.equal(enc.after_block(1, x, grid), x)
    assert torch.equal(enc.after_block(3, x, grid), x)
    assert not torch.allclose(enc.after_block(2, x, grid), x)
    assert not torch.allclose(enc.embed_tokens(x, grid), x)  # position -1: right after patch embedding
    assert torch.equal(_cpe().embed_tokens(x, grid), x)  # default: nothing before block 0


@pytest.mark.parametrize("opts", [{"positions": (0, 1), "kernel_size": 5}])  # defaults: tests/test_encoding_contracts.py
def test_forward_backward_grids_and_bf16(opts):
    model = timm.create_model(MODEL, pos_encoding={"name": "cpe", **opts}, depth=3)
    for hw in [(32, 32), (48, 48), (32, 56)]:
        model.zero_grad()
        model(torch.randn(2, 3, *hw)).sum().backward()
        assert all(p.grad.abs().sum() > 0 for p in model.pos_encoding.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(2, 3, 40, 32))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    nwd = model.no_weight_decay()
    assert "pos_encoding.pegs.0.proj.weight" in nwd and "pos_encoding.pegs.0.proj.bias" in nwd


def test_gap_variant():
    """CPVT-GAP: no cls token, average pooling -- a model config, not an encoding option."""
    model = timm.create_model(MODEL, pos_encoding="cpe", depth=2, class_token=False, global_pool="avg", fc_norm=False)
    assert model.num_prefix_tokens == 0 and model.cls_token is None
    x = torch.randn(2, 3, 32, 48)
    out = model(x)
    out.sum().backward()
    assert out.shape == (2, 10) and model.pos_encoding.pegs["0"].proj.weight.grad.abs().sum() > 0
    # pooled logits equal the head applied to the mean of the final (normed) tokens
    with torch.no_grad():
        feats = model.forward_features(x)
        assert torch.allclose(out, model.head(feats.mean(1)), atol=1e-5)


def test_param_count_vit_b():
    with torch.device("meta"):
        one = timm.create_model("vispe_vit_base_patch16_224", pos_encoding="cpe")
        six = timm.create_model("vispe_vit_base_patch16_224", pos_encoding={"name": "cpe", "positions": tuple(range(6))})
    assert sum(p.numel() for p in one.pos_encoding.parameters()) == 768 * 9 + 768 == 7_680
    assert sum(p.numel() for p in six.pos_encoding.parameters()) == 6 * 7_680
    tiny = _cpe(dim=192)
    assert sum(p.numel() for p in tiny.parameters()) == 1_920


def test_init_matches_authors():
    torch.manual_seed(0)
    w = _cpe(dim=4096).pegs["0"].proj
    assert abs(w.weight.std().item() - (2 / 9) ** 0.5) < 0.02 and torch.equal(w.bias, torch.zeros(4096))


def test_bad_input():
    with pytest.raises(ValueError, match="kernel_size"):
        _cpe(kernel_size=4)
    with pytest.raises(ValueError, match="positions"):
        _cpe(positions=(5,))
    with pytest.raises(ValueError, match="positions"):
        _cpe(positions=(0, 0))
    with pytest.raises(ValueError, match="grid"):
        _cpe().after_block(0, torch.randn(1, 9, 8), PositionGrid((2, 2, 2), 1))
