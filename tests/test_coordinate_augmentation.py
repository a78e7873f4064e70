"""Training-time coordinate augmentation of the rotary lattice encodings (shift / jitter / rescale): off in
eval and by default, redrawn per forward in training, offsets-only attention kept, bad options refused."""
from __future__ import annotations

import pytest
import timm
import torch

import vispe  # noqa: F401
from vispe.encodings.grid import PositionGrid
from vispe.encodings.rope_vit import RopeAxial, RopeAxial3d, RopeMixed, RopeMixed3d

AUG = {"coord_shift": 1.5, "coord_jitter": 1.2, "coord_rescale": 2.0}


def _pair(cls, *args, grid_size):
    torch.manual_seed(0)
    plain = cls(*args, grid_size=grid_size)
    torch.manual_seed(0)
    aug = cls(*args, grid_size=grid_size, **AUG)
    return plain, aug


CASES = [
    (RopeAxial, (32,), (4, 6)),
    (RopeMixed, (32, 2, 3), (4, 6)),
    (RopeAxial3d, (48,), (2, 4, 4)),
    (RopeMixed3d, (48, 2, 2), (2, 4, 4)),
]


@pytest.mark.parametrize("cls, args, grid_size", CASES)
def test_off_in_eval_and_redrawn_every_training_forward(cls, args, grid_size):
    plain, aug = _pair(cls, *args, grid_size=grid_size)
    g = PositionGrid(grid_size)
    with torch.no_grad():
        ref = plain.angles(g, None)
        aug.eval()
        assert torch.equal(aug.angles(g, None), ref)  # eval: exactly the encoding without augmentation
        aug.train()
        plain.train()
        assert torch.equal(plain.angles(g, None), ref)  # defaults: no augmentation in training either
        torch.manual_seed(1)
        a1 = aug.angles(g, None)
        a2 = aug.angles(g, None)
    assert not torch.equal(a1, ref) and not torch.equal(a1, a2)
    with torch.no_grad():  # where the tables may be reused: never while coordinates are drawn per forward
        assert plain.cacheable() and not aug.cacheable()
        aug.eval()
        assert aug.cacheable()


def _logits(enc, q, k, grid):
    state = enc.prepare(grid)
    qr, kr = enc.rotate_qk(q, k, state, 0)
    return qr @ kr.transpose(-1, -2)


def test_a_pure_shift_leaves_the_patch_to_patch_logits_unchanged():
    """Patch pairs see only offsets; the unrotated cls token sees absolute positions, so its row moves."""
    torch.manual_seed(0)
    plain = RopeAxial(16, grid_size=(4, 4))
    shifted = RopeAxial(16, grid_size=(4, 4), coord_shift=3.0).train()
    g = PositionGrid((4, 4), num_prefix_tokens=1)
    q, k = torch.randn(2, 1, 17, 16), torch.randn(2, 1, 17, 16)
    with torch.no_grad():
        ref = _logits(plain, q, k, g)
        for seed in range(3):
            torch.manual_seed(seed)
            got = _logits(shifted, q, k, g)
            torch.testing.assert_close(got[..., 1:, 1:], ref[..., 1:, 1:], rtol=1e-4, atol=1e-4)
            assert not torch.allclose(got[..., 0, 1:], ref[..., 0, 1:])


def test_rescaled_coordinates_keep_attention_a_function_of_offsets():
    enc = RopeMixed(16, 2, 1, grid_size=(6, 6), **AUG).train()
    g = PositionGrid((6, 6))
    torch.manual_seed(3)
    with torch.no_grad():
        a = enc.angles(g, None)[0, 0]  # (N, P)
    row = {tuple(v.tolist()): i for i, v in enumerate(g.indices().long())}
    off = (2, 1)
    d1 = a[row[(0 + off[0], 0 + off[1])]] - a[row[(0, 0)]]
    d2 = a[row[(3 + off[0], 4 + off[1])]] - a[row[(3, 4)]]
    torch.testing.assert_close(d1, d2, rtol=1e-5, atol=1e-5)


def test_a_model_trains_with_augmentation_and_evaluates_without_it():
    spec = "rope_axial[coord_shift=1.0,coord_rescale=2.0]"
    model = timm.create_model("vispe_vit_tiny_patch16_224", pos_encoding=spec, img_size=64, num_classes=3)
    x = torch.randn(2, 3, 64, 64)
    model.train()
    model(x).sum().backward()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), model(x))


@pytest.mark.parametrize("opt, value", [("coord_shift", -1.0), ("coord_jitter", 0.5), ("coord_rescale", 0.9)])
def test_bad_options_are_refused_at_construction(opt, value):
    with pytest.raises(ValueError, match=f"{opt}.*{value}"):
        RopeAxial(32, grid_size=(4, 4), **{opt: value})
