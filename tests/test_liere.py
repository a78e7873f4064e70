"""LieRE: skew-symmetric generators and orthogonal rotations, identity at zero, blockwise = dense exponential,
ComRoPE = LieRE with commuting generators, RoPE-Mixed = LieRE with 2x2 blocks, relative only when the
generators commute, the released code's coordinates, ViT / video ViT at three grids, bf16, patch dropout,
caching, bad input."""
from __future__ import annotations

import math

import pytest
import timm
import torch

import vispe  # noqa: F401  (registers the models)
from vispe.encodings import EncodingContext, PositionGrid, create_encoding, liere, sdpa
from vispe.encodings.block_rotation import rotate_blocks
from vispe.encodings.liere import (
    entries_from_skew,
    liere_coordinates,
    rotations_from_generators,
    skew_from_entries,
)
from vispe.models.video_vit import VispeVideoViT


def _ctx(ndim: int = 2, heads: int = 2, head_dim: int = 16, depth: int = 2, grid=None) -> EncodingContext:
    grid = grid or ((3, 4) if ndim == 2 else (2, 3, 3))
    return EncodingContext(dim=heads * head_dim, num_heads=heads, depth=depth, grid_size=tuple(grid))


def _liere(ndim: int = 2, **kw):
    return create_encoding("liere" if ndim == 2 else "liere_3d", _ctx(ndim, **{k: kw.pop(k) for k in ("heads", "head_dim", "depth", "grid") if k in kw}), **kw)


def _block_diag(blocks: torch.Tensor) -> torch.Tensor:
    """``(..., m, b, b)`` -> dense ``(..., m*b, m*b)`` block-diagonal matrices."""
    lead, m, b = blocks.shape[:-3], blocks.shape[-3], blocks.shape[-1]
    flat = blocks.reshape(-1, m, b, b)
    return torch.stack([torch.block_diag(*f) for f in flat]).reshape(*lead, m * b, m * b)


def _logits(q, k, rot):
    q2, k2 = rotate_blocks(q, k, rot)
    return q2 @ k2.transpose(-1, -2)


# -- generators and rotations ------------------------------------------------------------------


@pytest.mark.parametrize("ndim", [2, 3])
def test_generators_are_skew_symmetric_with_the_released_init(ndim):
    torch.manual_seed(0)
    enc = _liere(ndim, block_size=4)
    gens = enc.axis_generators()
    assert gens.shape == (ndim, 2, 2, 4, 4, 4)  # (axes, layers, heads, blocks, b, b)
    assert torch.equal(gens, -gens.transpose(-1, -2))
    upper = gens[..., torch.triu_indices(4, 4, 1)[0], torch.triu_indices(4, 4, 1)[1]]
    # the released code: strictly upper entries ~ U(0, 2 pi)
    assert upper.min() >= 0 and upper.max() < 2 * math.pi and upper.std() > 1.0
    assert torch.equal(entries_from_skew(skew_from_entries(enc.generator_entries, 4)), enc.generator_entries)


@pytest.mark.parametrize("ndim,block_size", [(2, 4), (2, None), (3, 2), (3, 8)])
def test_rotations_are_orthogonal_with_det_one(ndim, block_size):
    torch.manual_seed(0)
    enc = _liere(ndim, block_size=block_size)
    rot = enc.rotations(PositionGrid((3, 5) if ndim == 2 else (2, 3, 4), 1))
    b = enc.block_size
    eye = torch.eye(b).expand_as(rot)
    assert (rot.transpose(-1, -2) @ rot - eye).abs().max() < 1e-4
    assert (torch.linalg.det(rot.double()) - 1).abs().max() < 1e-4
    assert (rot - eye).abs().max() > 0.5  # a real rotation, not the identity


def test_zero_generators_are_the_identity():
    torch.manual_seed(0)
    enc = _liere(zero_init=True, block_size=4)
    grid = PositionGrid((3, 4), 1)
    state = enc.prepare(grid)
    assert torch.equal(state.rotations, torch.eye(4).expand_as(state.rotations))
    q, k, v = (torch.randn(2, 2, grid.seq_len, 16) for _ in range(3))
    q2, k2 = enc.rotate_qk(q, k, state, 1)
    assert torch.equal(q2, q) and torch.equal(k2, k)
    torch.testing.assert_close(enc.attend(q, k, v, layer=0, state=state), sdpa(q, k, v), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("ndim", [2, 3])
def test_blockwise_rotation_equals_dense_exponential_of_the_generator_sum(ndim):
    """Oracle: the dense head_dim x head_dim exp(sum_i x_i A_i) of the block-diagonal generators, applied as a
    dense matrix, equals the blockwise rotations and their blockwise application."""
    torch.manual_seed(0)
    enc = _liere(ndim, block_size=4, init_range=1.0)
    grid = PositionGrid((2, 3) if ndim == 2 else (2, 2, 2), 1)
    state = enc.prepare(grid)
    coords = enc.token_coordinates(grid)
    dense_gen = _block_diag(enc.axis_generators())  # (N, depth, H, dh, dh)
    dense = torch.linalg.matrix_exp(torch.einsum("ln,ndhij->dhlij", coords, dense_gen).contiguous())  # (depth, H, L, dh, dh)
    assert (dense - _block_diag(state.rotations)).abs().max() < 1e-5
    q, k = torch.randn(2, 2, grid.seq_len, 16), torch.randn(2, 2, grid.seq_len, 16)
    for layer in range(2):
        q2, k2 = enc.rotate_qk(q, k, state, layer)
        assert q2.stride(-1) == 1 and k2.stride(-1) == 1
        torch.testing.assert_close(q2, torch.einsum("hlij,bhlj->bhli", dense[layer], q), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(k2, torch.einsum("hlij,bhlj->bhli", dense[layer], k), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("per_sample,heads", [(False, 2), (False, 1), (True, 2), (True, 1)])
def test_blockwise_rotation_gradients(per_sample, heads):
    torch.manual_seed(0)
    q = torch.randn(2, 2, 2, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn_like(q, requires_grad=True)
    rot = torch.randn(*((2,) if per_sample else ()), heads, 2, 2, 2, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda r, a, b: rotate_blocks(a, b, r, per_sample=per_sample), (rot, q, k))


def test_rotation_table_gradients():
    """The table's own backward (generator sums rebuilt, adjoint Frechet derivative of exp) is the true gradient."""
    torch.manual_seed(0)
    coords = torch.rand(4, 2, dtype=torch.float64)
    entries = torch.randn(2, 2, 1, 2, 3, dtype=torch.float64, requires_grad=True)  # (N, layers, heads, m, b(b-1)/2), b = 3
    assert torch.autograd.gradcheck(lambda e: rotations_from_generators(coords, skew_from_entries(e, 3)), (entries,))



@pytest.mark.parametrize("block_size", [2, 3, 4])
def test_rotation_table_equals_matrix_exp_with_equal_eigenvalues(block_size):
    """The eigenbasis exponential and its backward against torch.linalg.matrix_exp and its autograd (the oracle),
    where eigenvalues coincide: a token at the origin (zero generator sum), a generator with a repeated pair
    (+-w twice), and odd blocks (a zero eigenvalue)."""
    torch.manual_seed(0)
    coords = torch.cat([torch.zeros(1, 2), torch.rand(3, 2)]).double()
    gens = torch.randn(2, 1, 2, 2, block_size, block_size, dtype=torch.float64)
    gens = gens - gens.transpose(-1, -2)
    if block_size == 4:
        gens[:, 0, 0, 0] = 0.0
        gens[:, 0, 0, 0, 0, 1], gens[:, 0, 0, 0, 2, 3] = 0.7, 0.7
        gens[:, 0, 0, 0, 1, 0], gens[:, 0, 0, 0, 3, 2] = -0.7, -0.7
    gens.requires_grad_(True)
    weight = torch.randn(1, 2, 4, 2, block_size, block_size, dtype=torch.float64)
    got = rotations_from_generators(coords, gens)
    (g_got,) = torch.autograd.grad((got * weight).sum(), gens)
    want = torch.linalg.matrix_exp(torch.einsum("ln,n...ij->...lij", coords, gens).movedim(-3, -4).contiguous())
    (g_want,) = torch.autograd.grad((want * weight).sum(), gens)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(g_got, g_want, atol=1e-10, rtol=1e-10)

def _dense_oracle(coords: torch.Tensor, gens: torch.Tensor) -> torch.Tensor:
    """One torch.linalg.matrix_exp per token and block of ``sum_i x_i A_i`` (autograd through it: the oracle gradient)."""
    return torch.linalg.matrix_exp(torch.einsum("ln,n...ij->...lij", coords, gens).movedim(-3, -4).contiguous())


@pytest.mark.parametrize("num_axes,block_size,lead", [(1, 2, (2,)), (2, 3, ()), (2, 8, (2, 3)), (3, 4, (2,))])
def test_rotation_table_equals_the_dense_oracle_at_every_squaring_count(num_axes, block_size, lead):
    """The word-sum polynomial + per-token squarings (and its hand-written backward) against one matrix_exp per token
    in float64, with generators large enough that tokens take different numbers of squarings (the origin none)."""
    torch.manual_seed(0)
    coords = torch.cat([torch.zeros(1, num_axes), torch.rand(8, num_axes) * 2]).double()
    gens = torch.randn(num_axes, *lead, 2, block_size, block_size, dtype=torch.float64) * 3
    gens = (gens - gens.transpose(-1, -2)).requires_grad_(True)
    plan = liere._exp_plan(coords, gens.detach())
    assert len(set(plan.squarings)) >= 3 and min(plan.squarings) == 0  # mixed squaring counts, the origin exact
    weight = torch.randn(*lead, 9, 2, block_size, block_size, dtype=torch.float64)
    got = rotations_from_generators(coords, gens)
    (g_got,) = torch.autograd.grad((got * weight).sum(), gens)
    want = _dense_oracle(coords, gens)
    (g_want,) = torch.autograd.grad((want * weight).sum(), gens)
    torch.testing.assert_close(got, want, atol=1e-11, rtol=1e-11)
    torch.testing.assert_close(g_got, g_want, atol=1e-10 * g_want.abs().max().item(), rtol=1e-10)


def test_float32_rotation_table_is_as_accurate_as_matrix_exp():
    """In float32 the table is as close to the float64 oracle as torch.linalg.matrix_exp's own float32 result is
    (both scale and square); so are the generator gradients."""
    torch.manual_seed(0)
    enc = _liere(block_size=8, heads=3, head_dim=16, depth=2, grid=(6, 6))
    grid = PositionGrid((6, 6), 1)
    coords = enc.token_coordinates(grid)
    gens = enc.axis_generators().detach()
    weight = torch.randn(2, 3, grid.seq_len, 2, 8, 8, dtype=torch.float64)
    g64 = gens.double().requires_grad_(True)
    want = _dense_oracle(coords.double(), g64)
    (g_want,) = torch.autograd.grad((want * weight).sum(), g64)
    g32 = gens.clone().requires_grad_(True)
    got = rotations_from_generators(coords, g32)
    (g_got,) = torch.autograd.grad((got * weight.float()).sum(), g32)
    torch_err = (_dense_oracle(coords, gens).double() - want).abs().max().item()
    assert (got.double() - want).abs().max().item() <= 3 * torch_err + 1e-6
    assert (g_got.double() - g_want).abs().max().item() <= 1e-4 * g_want.abs().max().item()


def test_compiled_training_step_equals_the_dense_oracle(monkeypatch):
    """A tiny LieRE ViT compiled whole (the table as one opaque custom op) trains a step with the loss and gradients of
    the same model whose rotations are one matrix_exp per token (eager, autograd through matrix_exp)."""
    from vispe.encodings import liere as liere_module

    torch.manual_seed(0)
    model = _vit(pos_encoding="liere[block_size=8]")
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 3])
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.nn.functional.cross_entropy(compiled(x), y).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    monkeypatch.setattr(liere_module, "rotations_from_generators", lambda c, g: _dense_oracle(c.to(g.dtype), g))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    assert got["pos_encoding.generator_entries"].abs().sum() > 0
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, atol=2e-5, rtol=1e-3, msg=lambda m, n=n: f"gradient of {n}: {m}")


def test_overflowing_generators_are_refused():
    gens = torch.zeros(2, 1, 1, 2, 2)
    gens[0, 0, 0, 0, 1], gens[0, 0, 0, 1, 0] = float("inf"), -float("inf")
    with pytest.raises(ValueError, match="not finite"):
        rotations_from_generators(torch.rand(3, 2), gens)


def test_padded_block_rotation_equals_the_dense_product():
    """Batch 2 with 8 x 8 blocks: the q/k columns are zero-padded past ATen's small-bmm loop on CPU; the products and
    their gradients are unchanged (float64 gradcheck, and the dense per-token oracle)."""
    from vispe.encodings.block_rotation import _padded_width

    assert _padded_width(8, 4, torch.device("cpu")) > 4
    torch.manual_seed(0)
    q = torch.randn(2, 2, 3, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn_like(q, requires_grad=True)
    rot = torch.linalg.matrix_exp(torch.randn(2, 3, 2, 8, 8, dtype=torch.float64) - torch.randn(2, 3, 2, 8, 8).double().mT)
    rot.requires_grad_(True)
    q2, k2 = rotate_blocks(q, k, rot)
    dense = _block_diag(rot)  # (H, L, dh, dh)
    torch.testing.assert_close(q2, torch.einsum("hlij,bhlj->bhli", dense, q))
    torch.testing.assert_close(k2, torch.einsum("hlij,bhlj->bhli", dense, k))
    assert torch.autograd.gradcheck(lambda r, a, b: rotate_blocks(a, b, r), (rot, q, k))


# -- special cases: ComRoPE and RoPE-Mixed are LieRE ---------------------------------------------


@pytest.mark.parametrize("name,ndim", [("comrope_ap", 2), ("comrope_ld", 2), ("comrope_ld_3d", 3)])
def test_comrope_is_liere_with_commuting_generators(name, ndim):
    """ComRoPE subset of LieRE: LieRE loaded with ComRoPE's (commuting) block generators, on the shared
    coordinate convention, gives ComRoPE's rotations, rotated logits and attention output."""
    torch.manual_seed(0)
    ctx = _ctx(ndim)
    # LieRE's 'centers' put every axis at (i + 0.5) / n; ComRoPE-3D's default places time as released,
    # (t + 0.5) / n_spatial, so the shared convention on video grids is its time_scale='frames'
    com = create_encoding(name, ctx, block_size=4, **({"time_scale": "frames"} if ndim == 3 else {}))
    lie = create_encoding("liere" if ndim == 2 else "liere_3d", ctx, block_size=4, coords="centers")
    gens = com.axis_generators()  # (N, depth, H, m, b, b)
    for i in range(ndim):  # they commute (so the subset claim is about commuting generators)
        for j in range(ndim):
            assert torch.allclose(gens[i] @ gens[j], gens[j] @ gens[i], atol=1e-5)
    lie.set_generators(gens)
    assert torch.equal(lie.axis_generators(), gens)
    grid = PositionGrid((3, 4) if ndim == 2 else (2, 3, 3), 1)
    sc, sl = com.prepare(grid), lie.prepare(grid)
    assert (lie.rotations(grid) - com.rotations(grid, None)).abs().max() < 1e-5
    q, k, v = (torch.randn(2, 2, grid.seq_len, 16) for _ in range(3))
    for layer in range(2):
        out_c = com.attend(q, k, v, layer=layer, state=sc)
        out_l = lie.attend(q, k, v, layer=layer, state=sl)
        assert (out_c - out_l).abs().max() <= 1e-5
        qc, kc = com.rotate_qk(q, k, sc, layer)
        ql, kl = lie.rotate_qk(q, k, sl, layer)
        logit_c, logit_l = qc @ kc.transpose(-1, -2), ql @ kl.transpose(-1, -2)
        assert (logit_c - logit_l).abs().max() <= 1e-5 * logit_c.abs().max()  # float32 rounding of |logit| ~ 10


def test_block_size_two_is_rope_mixed():
    """The paper: RoPE-Mixed is LieRE restricted to 2x2 blocks. With the released coordinates on the training
    grid (x = index / (n - 1), prefix unrotated) and A_a's block p = (n_a - 1) f_a[p] J, LieRE's rotated q/k
    are RoPE-Mixed's."""
    torch.manual_seed(0)
    grid_size = (3, 5)
    ctx = _ctx(grid=grid_size, head_dim=8, depth=2)
    mixed = create_encoding("rope_mixed", ctx)
    lie = create_encoding("liere", ctx, block_size=2)
    freqs = mixed.freqs.detach()  # (ndim, depth, H, P), row i multiplies grid axis chunk_axes[i]
    per_axis = torch.stack([sum(freqs[i] for i, a in enumerate(mixed.chunk_axes) if a == axis) for axis in range(2)])
    scale = torch.tensor([n - 1 for n in grid_size], dtype=torch.float32)[:, None, None, None]
    J = torch.tensor([[0.0, -1.0], [1.0, 0.0]])
    lie.set_generators((per_axis * scale)[..., None, None] * J)
    grid = PositionGrid(grid_size, 1)
    sm, sl = mixed.prepare(grid), lie.prepare(grid)
    q, k = torch.randn(2, 2, grid.seq_len, 8), torch.randn(2, 2, grid.seq_len, 8)
    for layer in range(2):
        qm, km = mixed.rotate_qk(q, k, sm, layer)
        ql, kl = lie.rotate_qk(q, k, sl, layer)
        torch.testing.assert_close(ql, qm, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kl, km, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ql, q, atol=1e-2)


def test_logits_relative_only_with_commuting_generators():
    """Commuting generators: q R(x)^T R(y) k depends on y - x only (a global shift changes nothing). LieRE's own
    (generic, non-commuting) generators: it does not, measurably."""
    torch.manual_seed(0)
    ctx = _ctx()
    grid = PositionGrid((3, 4), 1)
    lie = create_encoding("liere", ctx, block_size=4, coords="centers")
    coords = lie.token_coordinates(grid)
    shift = torch.tensor([0.37, -1.3])
    q, k = torch.randn(2, 2, grid.seq_len, 16), torch.randn(2, 2, grid.seq_len, 16)

    def violation(gens: torch.Tensor) -> float:
        base = _logits(q, k, rotations_from_generators(coords, gens)[0])
        moved = _logits(q, k, rotations_from_generators(coords + shift, gens)[0])
        return ((base - moved).abs().max() / base.abs().max()).item()

    commuting = create_encoding("comrope_ld", ctx, block_size=4).axis_generators()
    lie.set_generators(commuting)
    assert violation(lie.axis_generators()) < 1e-5
    moved_rot = rotations_from_generators(coords + shift, commuting)
    assert not torch.allclose(rotations_from_generators(coords, commuting), moved_rot, atol=1e-2)  # the rotations did move

    generic = create_encoding("liere", ctx, block_size=4, init_range=1.0).axis_generators()
    assert not torch.allclose(generic[0] @ generic[1], generic[1] @ generic[0], atol=1e-2)
    assert violation(generic) > 1e-2


# -- coordinates ---------------------------------------------------------------------------------


def test_released_coordinates_and_prefix_identity():
    grid = PositionGrid((3, 5), 1)
    c = liere_coordinates(grid, "liere", (3, 5))
    torch.testing.assert_close(c[:5, 1], torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0]))  # corner to corner on the training grid
    torch.testing.assert_close(c[::5, 0], torch.tensor([0.0, 0.5, 1.0]))
    big = liere_coordinates(PositionGrid((6, 5)), "liere", (3, 5))
    torch.testing.assert_close(big[::5, 0], torch.linspace(0, 2, 6))  # a larger grid extends the range
    assert torch.equal(liere_coordinates(grid, "centers"), grid.centers())
    enc = _liere(grid=(3, 5), block_size=4)
    rot = enc.rotations(PositionGrid((3, 5), 2))
    assert torch.equal(rot[:, :, :2], torch.eye(4).expand_as(rot[:, :, :2]))  # cls/registers: identity
    centred = _liere(grid=(3, 5), block_size=4, coords="centers")
    rot = centred.rotations(PositionGrid((3, 5), 2))
    at_centre = rotations_from_generators(torch.full((1, 2), 0.5), centred.axis_generators())
    assert torch.allclose(rot[:, :, :2], at_centre.expand_as(rot[:, :, :2]), atol=1e-6)
    enc.set_grid_size((6, 10))  # a new training grid (timm's set_input_size) rescales the released coordinates
    coords = enc.token_coordinates(PositionGrid((3, 5)))  # now half the training grid: [0, 0.5] per axis
    assert enc.grid_size == (6, 10)
    torch.testing.assert_close(coords[[1, 5, -1]], torch.tensor([[0.0, 0.125], [0.25, 0.0], [0.5, 0.5]]))


# -- options, cache, bad input ------------------------------------------------------------------------


@pytest.mark.parametrize("per_layer,per_head", [(True, True), (False, True), (True, False), (False, False)])
def test_per_layer_and_per_head_options(per_layer, per_head):
    torch.manual_seed(0)
    enc = _liere(block_size=4, per_layer=per_layer, per_head=per_head, heads=2, depth=3)
    layers, heads = (3 if per_layer else 1), (2 if per_head else 1)
    assert enc.generator_entries.numel() == 2 * layers * heads * 4 * 6  # axes x layers' x heads' x blocks x b(b-1)/2
    grid = PositionGrid((3, 4), 1)
    state = enc.prepare(grid)
    assert state.rotations.shape == (layers, heads, grid.seq_len, 4, 4, 4)
    q, k = torch.randn(2, 2, grid.seq_len, 16), torch.randn(2, 2, grid.seq_len, 16)
    outs = [enc.rotate_qk(q, k, state, layer)[0] for layer in range(3)]
    assert torch.equal(outs[0], outs[2]) != per_layer
    torch.testing.assert_close(outs[0].norm(dim=-1), q.norm(dim=-1), atol=1e-4, rtol=1e-5)  # orthogonal: norms kept
    dense = _block_diag(state.for_layer(0)).expand(2, -1, -1, -1)  # (H, L, dh, dh): the shared-heads path too
    torch.testing.assert_close(outs[0], torch.einsum("hlij,bhlj->bhli", dense, q), atol=1e-5, rtol=1e-5)


def test_patch_dropout_state_follows_each_samples_tokens():
    """Kept tokens rotate exactly as they do in the full sequence, per sample, for per-head and shared rotations."""
    torch.manual_seed(0)
    grid = PositionGrid((3, 4), 1)
    keep = torch.stack([torch.randperm(12)[:5] for _ in range(2)])
    for per_head in (True, False):
        enc = _liere(block_size=4, per_head=per_head)
        state = enc.prepare(grid)
        kept_grid = grid.with_keep(keep)
        narrowed = enc.keep_tokens(state, kept_grid)
        rows = kept_grid.sequence_index()
        q, k = torch.randn(2, 2, grid.seq_len, 16), torch.randn(2, 2, grid.seq_len, 16)
        q_full, k_full = enc.rotate_qk(q, k, state, 1)
        pick = lambda t: t.gather(2, rows[:, None, :, None].expand(-1, 2, -1, 16))  # noqa: E731
        q_kept, k_kept = enc.rotate_qk(pick(q), pick(k), narrowed, 1)
        torch.testing.assert_close(q_kept, pick(q_full), atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(k_kept, pick(k_full), atol=1e-6, rtol=1e-6)
        with pytest.raises(ValueError, match="keep_tokens"):
            enc.rotate_qk(pick(q), pick(k), state, 0)


def test_state_is_cached_without_gradient_and_rebuilt_with_it():
    torch.manual_seed(0)
    enc = _liere(block_size=4)
    grid = PositionGrid((3, 4), 1)
    with torch.no_grad():
        a = enc.prepare(grid)
        assert enc.prepare(grid) is a and not a.rotations.requires_grad
        enc.generator_entries.mul_(0.5)  # an optimizer step: the parameter version changes
        b = enc.prepare(grid)
    assert b is not a and not torch.allclose(a.rotations, b.rotations)
    c = enc.prepare(grid)  # gradient needed: built fresh, with a graph to the generators
    assert c is not enc.prepare(grid) and c.rotations.requires_grad
    c.rotations.sum().backward()
    assert enc.generator_entries.grad.abs().sum() > 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert enc.prepare(grid).rotations.dtype == torch.float32


def test_bad_input_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"block_size=5 is not valid for head_dim=16; choose one of \[2, 4, 8, 16\]"):
        _liere(block_size=5)
    with pytest.raises(ValueError, match=r"block_size=1 is not valid"):
        _liere(block_size=1)
    with pytest.raises(ValueError, match=r"coords='corners' is not valid.*\['liere', 'centers'\]"):
        _liere(coords="corners")
    with pytest.raises(ValueError, match="init_range"):
        _liere(init_range=-1.0)
    with pytest.raises(ValueError, match=r"encoding 'liere' takes 2-D grids, but the model's grid \(4, 4, 4\) is 3-D; .*did you mean 'liere_3d'"):
        create_encoding("liere", EncodingContext(dim=32, num_heads=2, depth=1, grid_size=(4, 4, 4)))
    with pytest.raises(ValueError, match="head_dim=1"):
        create_encoding("liere", EncodingContext(dim=2, num_heads=2, depth=1, grid_size=(4, 4)))
    with pytest.raises(TypeError, match="valid options"):
        _liere(blocksize=4)
    enc = _liere(block_size=4)
    with pytest.raises(ValueError, match="3-D grid"):
        enc.prepare(PositionGrid((2, 3, 4)))
    with pytest.raises(ValueError, match="skew-symmetric"):
        enc.set_generators(torch.ones(2, 2, 2, 4, 4, 4))
    with pytest.raises(ValueError, match="do not fit"):
        enc.set_generators(torch.zeros(2, 2, 2, 2, 8, 8))
    assert create_encoding("liere[block_size=8,coords=centers,per_head=False]", _ctx()).block_size == 8


# -- through the models: three grids, bf16, patch dropout -------------------------------------------------


def _vit(**kw):
    return timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding=kw.pop("pos_encoding", "liere"), depth=2, embed_dim=64,
                             num_heads=4, num_classes=5, **kw)


@pytest.mark.parametrize("spec", ["liere[block_size=4,coords=centers,per_head=False]"])  # defaults: the contracts suite
def test_vit_trains_at_three_grids(spec):
    torch.manual_seed(0)
    model = _vit(pos_encoding=spec)
    for size in [(32, 32), (48, 48), (24, 40)]:
        model.zero_grad()
        out = model(torch.randn(2, 3, *size))
        assert out.shape == (2, 5) and torch.isfinite(out).all()
        out.square().mean().backward()
        g = model.pos_encoding.generator_entries.grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("frames,size", [(8, 32), (4, 48), (2, 24)])
def test_video_vit_trains_at_three_grids(frames, size):
    torch.manual_seed(0)
    model = VispeVideoViT(pos_encoding="liere_3d", embed_dim=48, depth=2, num_heads=2, img_size=32, num_frames=8, tubelet_size=2,
                          patch_size=8, num_classes=5)
    assert model.pos_encoding.grid_size == (4, 4, 4) and model.pos_encoding.block_size == 24
    out = model(torch.randn(1, 3, frames, size, size))
    assert out.shape == (1, 5) and torch.isfinite(out).all()
    out.sum().backward()
    g = model.pos_encoding.generator_entries.grad
    assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0


@pytest.mark.parametrize("ndim", [2, 3])
def test_bf16_autocast_step(ndim):
    torch.manual_seed(0)
    if ndim == 2:
        model, x = _vit(pos_encoding="liere[block_size=8]"), torch.randn(2, 3, 32, 48)
    else:
        model = VispeVideoViT(pos_encoding="liere_3d", embed_dim=48, depth=2, num_heads=2, img_size=32, num_frames=4,
                              tubelet_size=2, patch_size=8, num_classes=5)
        x = torch.randn(2, 3, 4, 32, 32)
    y = torch.tensor([1, 3])
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(model(x), y).item()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    loss.backward()
    assert torch.isfinite(loss) and abs(loss.item() - ref) <= 0.05 * max(1.0, ref)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    g = model.pos_encoding.generator_entries.grad
    assert g is not None and g.abs().sum() > 0


def test_vit_patch_dropout_trains():
    torch.manual_seed(0)
    model = _vit(pos_encoding="liere[block_size=4]", patch_drop_rate=0.5).train()
    model(torch.randn(2, 3, 32, 32)).logsumexp(-1).sum().backward()
    g = model.pos_encoding.generator_entries.grad
    assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
