"""Randomized positions (RPE-2D style): ordered random indices from a larger grid while training, for the rotary
lattice encodings and 2D sin-cos; off in eval; the relative property of rotary encodings is kept."""
from __future__ import annotations

import pytest
import torch
from timm.layers import build_sincos2d_pos_embed

import vispe  # noqa: F401  (registers the models)
from vispe.encodings import EncodingContext, PositionGrid, create_encoding
from vispe.encodings.absolute import sincos2d_from_indices
from vispe.encodings.grid import random_lattice_indices

ROTARY = ["rope_axial", "rope_mixed"]


def _enc(name: str, ndim: int = 2, **kw):
    ctx = EncodingContext(dim=64, num_heads=2, depth=2, grid_size=(4,) * ndim)
    return create_encoding(name, ctx, **kw)


def test_random_indices_are_ordered_distinct_and_inside_the_pool():
    torch.manual_seed(0)
    for _ in range(20):
        idx = random_lattice_indices((3, 5), (9, 11))
        rows, cols = idx[:, 0].reshape(3, 5), idx[:, 1].reshape(3, 5)
        assert (rows == rows[:, :1]).all() and (cols == cols[:1]).all()  # a lattice: one index per row / column
        r, c = rows[:, 0], cols[0]
        assert (r.diff() > 0).all() and (c.diff() > 0).all()  # order along every axis preserved, no repeats
        assert r.min() >= 0 and r.max() <= 8 and c.min() >= 0 and c.max() <= 10
    # the pool the grid's own size: exactly the integer lattice
    assert torch.equal(random_lattice_indices((3, 4), (3, 4)), PositionGrid((3, 4)).indices())
    # draws spread over the whole pool, not only its start
    seen = torch.cat([random_lattice_indices((4,), (16,))[:, 0] for _ in range(200)])
    assert seen.max() == 15 and seen.min() == 0
    with pytest.raises(ValueError, match="pool"):
        random_lattice_indices((4, 4), (3, 8))


@pytest.mark.parametrize("name", ROTARY)
def test_rotary_random_positions_train_only_and_drawn_per_forward(name):
    grid = PositionGrid((4, 4), 1)
    plain, rnd = _enc(name), _enc(name, random_positions=2.0)
    rnd.load_state_dict(plain.state_dict())
    plain.eval(), rnd.eval()
    assert torch.equal(plain.prepare(grid).table, rnd.prepare(grid).table)  # eval: no draws
    rnd.train()
    torch.manual_seed(0)
    a, b = rnd.prepare(grid).table, rnd.prepare(grid).table
    assert not torch.equal(a, b)  # a new draw every training forward (not cached)
    assert not rnd.cacheable()
    rnd.eval()
    with torch.no_grad():
        assert rnd.cacheable()


@pytest.mark.parametrize("name", ROTARY)
def test_rotary_random_positions_are_the_grid_indices_drawn(name):
    """Training angles are the encoding's frequency map at the drawn indices, and the logits depend only on the
    drawn offsets: moving every drawn index by one constant leaves them unchanged (the relative property)."""
    from vispe.encodings.rotary import apply_rotary, rotary_table

    enc = _enc(name, random_positions=3.0).train()
    grid = PositionGrid((4, 4), 0)
    torch.manual_seed(1)
    ang = enc.angles(grid, None)
    torch.manual_seed(1)
    idx = random_lattice_indices((4, 4), (12, 12))
    assert not torch.equal(idx, grid.indices())
    plain = _enc(name)
    plain.load_state_dict(enc.state_dict())
    plain.eval()
    q, k = torch.randn(2, 16, 32), torch.randn(2, 16, 32)

    def logits(angles):
        t = rotary_table(angles)
        t = t[0] if t.ndim == 4 else t  # rope_mixed: per-layer tables (depth, H, L, P), take layer 0
        return apply_rotary(q, t) @ apply_rotary(k, t).transpose(-1, -2)

    for shift in (torch.zeros(2), torch.tensor([5.0, -2.0])):
        plain.lattice_indices = lambda g, d, s=shift: idx + s
        assert torch.allclose(logits(plain.angles(grid, None)), logits(ang), atol=1e-4)
    plain.lattice_indices = lambda g, d: grid.indices()
    assert not torch.allclose(logits(plain.angles(grid, None)), logits(ang), atol=1e-2)


def test_sincos_from_indices_equals_timm_on_the_lattice():
    grid = PositionGrid((3, 5))
    ours = sincos2d_from_indices(grid.indices(), 64)
    ref = build_sincos2d_pos_embed([3, 5], dim=64)
    assert torch.allclose(ours, ref, atol=1e-6)


def test_sincos_random_positions_train_only():
    torch.manual_seed(0)
    plain, rnd = _enc("sincos2d"), _enc("sincos2d", random_positions=2.0)
    grid = PositionGrid((4, 4), 1)
    x = torch.zeros(2, grid.seq_len, 64)
    plain.eval(), rnd.eval()
    assert torch.equal(plain.embed_tokens(x, grid), rnd.embed_tokens(x, grid))
    rnd.train()
    torch.manual_seed(3)
    out = rnd.embed_tokens(x, grid)
    torch.manual_seed(3)
    idx = random_lattice_indices((4, 4), (8, 8))
    assert torch.allclose(out[:, 1:], sincos2d_from_indices(idx, 64).expand(2, -1, -1))
    assert torch.equal(out[:, :1], x[:, :1])  # prefix tokens get nothing
    assert not torch.allclose(out, plain.embed_tokens(x, grid))


@pytest.mark.parametrize("name", ["rope_axial", "rope_mixed", "sincos2d", "rope_axial_3d"])
def test_bad_random_positions_named(name):
    with pytest.raises(ValueError, match="random_positions"):
        _enc(name, ndim=3 if name.endswith("3d") else 2, random_positions=0.5)


@pytest.mark.parametrize("name", ["rope_mixed", "sincos2d"])
def test_trains_through_the_vit(name):
    import timm

    model = timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding=f"{name}[random_positions=2.0]", depth=1, num_classes=3)
    model.train()
    out = model(torch.randn(2, 3, 32, 32))
    out.sum().backward()
    assert torch.isfinite(out).all()
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(torch.ones(1, 3, 32, 32)), model(torch.ones(1, 3, 32, 32)))
