"""ComRoPE's training-time resolution techniques: coordinate augmentation (shift / jitter / rescale) and randomized
positions drawn from a finer lattice, on top of the paper's per-line perturbation ``sigma``.

Properties: nothing moves in eval (bit-exact, cached); a draw per training forward; the moved coordinates are what
the rotations use (both rotation paths against per-token ``matrix_exp``); a pure shift leaves the logits unchanged
(the generators commute, so attention depends on offsets only); randomized positions keep the order and sit on
the lattice a larger grid is evaluated at; bad values are named at construction.
"""
from __future__ import annotations

import pytest
import torch

import vispe  # noqa: F401  (registers the models)
from vispe.encodings import EncodingContext, PositionGrid, create_encoding
from vispe.encodings.comrope import comrope_coordinates, line_offsets

NAMES = ["comrope_ap", "comrope_ld"]
AUG = {"coord_shift": 1.0, "coord_jitter": 1.2, "coord_rescale": 2.0, "random_positions": 2.0}


def _enc(name: str, ndim: int = 2, **kw):
    ctx = EncodingContext(dim=32, num_heads=2, depth=2, grid_size=(4,) * ndim)
    return create_encoding(name, ctx, block_size=4, **kw)


def _logits(enc, grid: PositionGrid, q: torch.Tensor, k: torch.Tensor, layer: int = 0) -> torch.Tensor:
    state = enc.build_state(grid, None)
    qr, kr = enc.rotate_qk(q, k, state, layer)
    return qr @ kr.transpose(-1, -2)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("option", sorted(AUG))
def test_off_in_eval_and_redrawn_every_training_forward(name, option):
    grid = PositionGrid((4, 3), 1)
    torch.manual_seed(0)
    plain = _enc(name)
    moved = _enc(name, **{option: AUG[option]})
    moved.load_state_dict(plain.state_dict())
    plain.eval(), moved.eval()
    q, k = torch.randn(2, 2, grid.seq_len, 16), torch.randn(2, 2, grid.seq_len, 16)
    with torch.no_grad():
        assert torch.equal(_logits(plain, grid, q, k), _logits(moved, grid, q, k))  # eval: nothing moves
        assert moved.cacheable()
    moved.train()
    assert not moved.cacheable()
    torch.manual_seed(1)
    a, b = _logits(moved, grid, q, k), _logits(moved, grid, q, k)
    assert not torch.allclose(a, b)  # a new draw every training forward
    assert moved.line_offsets(grid, None) is not None
    plain.train()
    assert plain.line_offsets(grid, None) is None  # nothing on, nothing drawn


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("rotation", ["auto", "blocks"])
def test_rotations_are_matrix_exp_at_the_moved_coordinates(name, rotation):
    """Both rotation paths rotate by ``exp(G(x))`` at the drawn coordinates (checked through the logits against the
    per-token ``matrix_exp`` reference at the same offsets)."""
    grid = PositionGrid((3, 4))
    torch.manual_seed(0)
    enc = _enc(name, rotation=rotation, **AUG).train()
    q, k = torch.randn(1, 2, grid.seq_len, 16, dtype=torch.float32), torch.randn(1, 2, grid.seq_len, 16)
    torch.manual_seed(7)
    got = _logits(enc, grid, q, k, layer=1)
    torch.manual_seed(7)
    offsets = enc.line_offsets(grid, None)
    ref_rot = enc.reference_rotations(grid, None, offsets)[1]  # (H, L, m, b, b)
    b = enc.block_size

    def rotate(x):
        xb = x.reshape(*x.shape[:-1], -1, b)  # (B, H, L, m, b)
        return torch.einsum("hlmij,bhlmj->bhlmi", ref_rot, xb).reshape(x.shape)

    want = rotate(q) @ rotate(k).transpose(-1, -2)
    assert torch.allclose(got, want, atol=2e-4, rtol=1e-4), (got - want).abs().max()


@pytest.mark.parametrize("name", NAMES)
def test_a_pure_shift_leaves_the_patch_to_patch_logits_unchanged(name):
    grid = PositionGrid((4, 4))
    torch.manual_seed(0)
    plain = _enc(name).eval()
    shifted = _enc(name, coord_shift=2.0)
    shifted.load_state_dict(plain.state_dict())
    shifted.train()
    q, k = torch.randn(1, 2, grid.seq_len, 16), torch.randn(1, 2, grid.seq_len, 16)
    with torch.no_grad():
        ref = _logits(plain, grid, q, k)
        torch.manual_seed(3)
        offs = shifted.line_offsets(grid, None)
        assert all(o.abs().max() > 0 for o in offs) and all(torch.allclose(o, o[:1].expand_as(o)) for o in offs)
        for seed in range(3):
            torch.manual_seed(seed)
            assert torch.allclose(_logits(shifted, grid, q, k), ref, atol=1e-4, rtol=1e-4)


def test_random_positions_keep_order_and_sit_on_the_finer_lattice():
    grid = PositionGrid((4, 5))
    torch.manual_seed(0)
    seen = []
    for _ in range(50):
        offs = line_offsets(grid, None, random_positions=2.0)
        for n, o in zip(grid.shape, offs):
            c = (torch.arange(n) + 0.5) / n + o  # the moved centres
            m = 2 * n
            idx = c * m - 0.5
            assert torch.allclose(idx, idx.round(), atol=1e-5)  # centres of the 2n-lattice over (0, 1)
            assert (idx.diff() > 0.5).all() and idx.min() >= -1e-5 and idx.max() <= m - 1 + 1e-5  # ordered, distinct, inside
            seen.append(idx.round())
    assert max(float(s.max()) for s in seen) == 9 and min(float(s.min()) for s in seen) == 0  # the whole pool is drawn
    # a grid twice as large is evaluated exactly on that lattice: every drawn coordinate is one of its centres
    big = comrope_coordinates(PositionGrid((8, 10)), None)
    assert set(torch.unique(big[:, 1]).mul(10).sub(0.5).round().tolist()) == set(range(10))  # the 2x5-centre lattice


def test_rescale_moves_lines_about_the_centre_and_keeps_their_order():
    grid = PositionGrid((6, 6))
    torch.manual_seed(0)
    for _ in range(20):
        offs = line_offsets(grid, None, coord_rescale=2.0, coord_jitter=1.5)
        for n, o in zip(grid.shape, offs):
            base = (torch.arange(n) + 0.5) / n
            c = base + o
            f = (c - 0.5) / (base - 0.5)  # one scale factor per axis, about the centre 0.5
            assert torch.allclose(f, f[:1].expand_as(f), atol=1e-5)
            assert 1 / 3.0 - 1e-5 <= float(f[0]) <= 3.0 + 1e-5  # within [1/(2 * 1.5), 2 * 1.5]
            assert (c.diff() > 0).all()


@pytest.mark.parametrize("opt, value", [("coord_shift", -1.0), ("coord_jitter", 0.5), ("coord_rescale", 0.9),
                                        ("random_positions", 0.5)])
def test_bad_options_are_refused_at_construction(opt, value):
    with pytest.raises(ValueError, match=opt) as err:
        _enc("comrope_ld", **{opt: value})
    assert repr(value) in str(err.value)


def test_comrope_ld_3d_takes_the_techniques_and_a_vit_trains_with_them():
    enc = _enc("comrope_ld_3d", ndim=3, coord_shift=1.0, random_positions=2.0).train()
    grid = PositionGrid((2, 3, 3))
    q, k = torch.randn(1, 2, grid.seq_len, 16), torch.randn(1, 2, grid.seq_len, 16)
    assert torch.isfinite(_logits(enc, grid, q, k)).all()
    import timm

    model = timm.create_model("vispe_vit_tiny_patch16_224", img_size=32, patch_size=8, depth=1, num_classes=3,
                              pos_encoding="comrope_ld[coord_shift=1.0,coord_rescale=2.0,random_positions=2.0]")
    x = torch.randn(2, 3, 32, 32)
    model.train()
    loss = model(x).logsumexp(-1).mean()
    loss.backward()
    grads = [p.grad for p in model.pos_encoding.parameters()]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), model(x))  # deterministic in eval
