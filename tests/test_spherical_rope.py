"""Spherical RoPE (arXiv 2511.08368; no released code found): the rotations are proper orthogonal 3x3 blocks built
from a yaw by p_x then a roll by p_y (non-commuting generators); the logits are invariant to shifts along y (the
rotation applied last) and to shifts along x only within a row, so not to shifts in general, where the commuting
case is; coordinates on [-pi, pi]; the image ViT trains with it; bad options are refused at construction."""
from __future__ import annotations

import math

import pytest
import timm
import torch
from rotary_checks import check_vit_trains, shifted_block_logits

import vispe  # noqa: F401  (registers the models)
from vispe.encodings import EncodingContext, PositionGrid, create_encoding
from vispe.encodings.spherical_rope import SphericalRope, euler_rotations, spherical_coordinates

YAW = torch.tensor([[0.0, -1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)  # turns channels 0, 1
ROLL = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, -1.0], [0.0, 1.0, 0.0]], dtype=torch.float64)  # turns channels 1, 2


def _sph(grid=(3, 4), heads=2, head_dim=16, prefix=0, **kw):
    ctx = EncodingContext(dim=heads * head_dim, num_heads=heads, depth=1, grid_size=tuple(grid), num_prefix_tokens=prefix)
    return create_encoding("spherical_rope", ctx, **kw)


def test_rotations_are_yaw_by_x_then_roll_by_y_and_proper_orthogonal():
    enc = _sph((4, 5), head_dim=15)
    grid = PositionGrid((4, 5), 0)
    rot = enc.rotations(grid).double()  # (N, T, 3, 3)
    assert rot.shape == (20, 5, 3, 3)
    eye = torch.eye(3, dtype=torch.float64)
    assert torch.allclose(rot.transpose(-1, -2) @ rot, eye.expand_as(rot), atol=1e-6)
    assert torch.allclose(torch.linalg.det(rot), torch.ones(20, 5, dtype=torch.float64), atol=1e-6)
    # the frequency ladder 100^(-2t/T) and the coordinates: the training grid's corners at -pi and pi
    w = 100.0 ** (-2.0 * torch.arange(5, dtype=torch.float64) / 5)
    pos = spherical_coordinates(grid, (4, 5), "extend").double()  # (p_y, p_x)
    assert torch.allclose(pos[0], torch.tensor([-math.pi, -math.pi], dtype=torch.float64), atol=1e-6)
    assert torch.allclose(pos[-1], torch.tensor([math.pi, math.pi], dtype=torch.float64), atol=1e-6)
    for n in (0, 7, 19):
        for t in range(5):
            want = torch.linalg.matrix_exp(w[t] * pos[n, 0] * ROLL) @ torch.linalg.matrix_exp(w[t] * pos[n, 1] * YAW)
            assert torch.allclose(rot[n, t], want, atol=1e-6)
    # the generators do not commute (their bracket is the third axis's generator), so the order matters
    assert torch.allclose(YAW @ ROLL - ROLL @ YAW, torch.tensor([[0.0, 0, 1], [0, 0, 0], [-1, 0, 0]], dtype=torch.float64))
    a, b = torch.tensor(0.7), torch.tensor(1.1)
    assert (euler_rotations(a, b) - euler_rotations(b, torch.tensor(0.0)) @ euler_rotations(torch.tensor(0.0), a)).abs().max() > 0.1


def test_rotation_is_the_matrices_preserves_norms_and_passes_the_channels_after_the_triplets():
    torch.manual_seed(0)
    enc = _sph((3, 4), head_dim=16, prefix=1)  # 5 triplets + 1 channel
    grid = PositionGrid((3, 4), 1)
    state = enc.prepare(grid)
    q, k = torch.randn(2, 2, 2, 13, 16).unbind(0)
    qr, kr = enc.rotate_qk(q, k, state)
    rot = enc.rotations(grid)  # (13, 5, 3, 3): the yaw then roll, applied as matrices
    for x, xr in ((q, qr), (k, kr)):
        want = torch.einsum("ntij,bhntj->bhnti", rot, x[..., :15].unflatten(-1, (5, 3))).flatten(-2)
        assert torch.allclose(xr[..., :15], want, atol=1e-5)
        trip, trip_r = x[..., :15].unflatten(-1, (5, 3)), xr[..., :15].unflatten(-1, (5, 3))
        assert torch.allclose(trip_r.norm(dim=-1), trip.norm(dim=-1), atol=1e-5)  # each triplet keeps its norm
        assert torch.equal(xr[..., 15], x[..., 15])  # the leftover channel passes
        assert torch.allclose(xr[..., 0, :], x[..., 0, :], atol=1e-6)  # the prefix token is not rotated
        assert (xr[..., 1:, :15] - x[..., 1:, :15]).abs().max() > 0.1  # the patches are


def _same_row(grid):
    rows = torch.arange(grid[0] * grid[1]) // grid[1]
    return rows[:, None] == rows[None, :]


@pytest.mark.parametrize("compiled", [False, True])
def test_rotation_and_its_gradient_equal_the_matrices_eager_and_compiled(compiled):
    """The written-out rotation (and its backward, the transposed rotation) against autograd through the 3x3 matrices,
    with patch dropout's per-sample tables and the channel after the triplets."""
    torch.manual_seed(1)
    enc = _sph((3, 4), head_dim=16, prefix=1)
    grid = PositionGrid((3, 4), 1)
    kept = grid.with_keep(torch.tensor([[1, 2, 4, 7, 11], [0, 3, 5, 8, 10]]))  # 5 of 12 patches per sample
    state = enc.keep_tokens(enc.prepare(grid), kept)
    rot = enc.rotations(grid)[kept.sequence_index()]  # (B, 1 + 5, 5, 3, 3): cls first
    q, k = torch.randn(2, 2, 2, 6, 16, dtype=torch.float32).unbind(0)
    gq, gk = torch.randn(2, 2, 2, 6, 16).unbind(0)

    def oracle(x):
        turned = torch.einsum("bntij,bhntj->bhnti", rot, x[..., :15].unflatten(-1, (5, 3))).flatten(-2)
        return torch.cat([turned, x[..., 15:]], -1)

    fn = torch.compile(enc.rotate_qk, fullgraph=True) if compiled else enc.rotate_qk
    q1, k1 = q.clone().requires_grad_(), k.clone().requires_grad_()
    qr, kr = fn(q1, k1, state)
    ((qr * gq).sum() + (kr * gk).sum()).backward()
    q2, k2 = q.clone().requires_grad_(), k.clone().requires_grad_()
    ((oracle(q2) * gq).sum() + (oracle(k2) * gk).sum()).backward()
    assert torch.allclose(qr, oracle(q), atol=1e-5) and torch.allclose(kr, oracle(k), atol=1e-5)
    assert torch.allclose(q1.grad, q2.grad, atol=1e-5) and torch.allclose(k1.grad, k2.grad, atol=1e-5)


@pytest.mark.parametrize("shift", [(2, 0), (1, 0)])
def test_logits_are_invariant_to_shifts_along_y(shift):
    """R(p_i)^T R(p_j) = Yaw(-w x_i) Roll(w (y_j - y_i)) Yaw(w x_j): moving both tokens along y changes nothing."""
    torch.manual_seed(0)
    enc = _sph((3, 4), head_dim=15)
    a, b, crossed = shifted_block_logits(enc, (3, 4), shift, head_dim=15)
    assert (a - b).abs().max() < 1e-5 * a.abs().max()
    assert (a - crossed).abs().max() > 1e-2  # keys moved against the queries: the logits change


@pytest.mark.parametrize("shift", [(0, 2), (1, 1)])
def test_logits_are_not_shift_invariant_along_x_except_within_a_row(shift):
    """A shift with an x part leaves the logits of two tokens of one row alone (only the yaws meet, and they commute)
    but changes those of tokens on different rows: non-commuting generators, no shift-equivariance in general."""
    torch.manual_seed(0)
    enc = _sph((3, 4), head_dim=15)
    a, b, _ = shifted_block_logits(enc, (3, 4), shift, head_dim=15)
    same = _same_row((3, 4)).expand_as(a)
    assert (a - b)[same].abs().max() < 1e-5 * a.abs().max()
    assert (a - b)[~same].abs().max() > 1e-2 * a.abs().max()


class _CommutingControl(SphericalRope):
    """Both angles in the yaw plane (commuting generators: RoPE-Mixed-like), the control of the test below."""

    def euler_angles(self, grid, device=None):
        yaw, roll = super().euler_angles(grid, device)
        return yaw + roll, torch.zeros_like(roll)


def test_the_commuting_case_is_shift_invariant_where_spherical_is_not():
    torch.manual_seed(0)
    control = _CommutingControl(head_dim=15, grid_size=(3, 4))
    a, b, crossed = shifted_block_logits(control, (3, 4), (1, 1), head_dim=15)
    assert (a - b).abs().max() < 1e-5 * a.abs().max() and (a - crossed).abs().max() > 1e-2
    torch.manual_seed(0)
    a, b, _ = shifted_block_logits(_sph((3, 4), head_dim=15), (3, 4), (1, 1), head_dim=15)
    assert (a - b).abs().max() > 1e-2 * a.abs().max()


def test_extend_keeps_the_patch_step_and_interpolate_the_range():
    big = PositionGrid((8, 8), 0)
    ext = _sph((4, 4)).rotations(big)
    pos = spherical_coordinates(big, (4, 4), "extend")
    assert torch.allclose(pos[1, 1] - pos[0, 1], torch.tensor(2 * math.pi / 3))  # the 4-wide training grid's step
    assert torch.allclose(pos[-1], torch.tensor([7 * math.pi / 3] * 2))  # past pi, centred
    interp = _sph((4, 4), extrapolation="interpolate")
    pos = spherical_coordinates(big, (4, 4), interp.resolution_policy)
    assert torch.allclose(pos[0], torch.tensor([-math.pi] * 2)) and torch.allclose(pos[-1], torch.tensor([math.pi] * 2))
    assert (interp.rotations(big) - ext).abs().max() > 0.1


def test_rotary_fraction_rotates_the_leading_channels_only():
    torch.manual_seed(0)
    enc = _sph((3, 4), head_dim=16, rotary_fraction=0.75)  # 12 channels: 4 triplets
    assert enc.triplets == 4
    q, k = torch.randn(2, 1, 2, 12, 16).unbind(0)
    qr, _ = enc.rotate_qk(q, k, enc.prepare(PositionGrid((3, 4), 0)))
    assert torch.equal(qr[..., 12:], q[..., 12:]) and (qr[..., :12] - q[..., :12]).abs().max() > 0.1


def _vit(**kw):
    return timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding=kw.pop("pos_encoding", "spherical_rope"), depth=2,
                             embed_dim=64, num_heads=4, num_classes=5, **kw)


def test_vit_trains_at_three_grids_with_patch_dropout_and_bf16():
    torch.manual_seed(0)
    model = _vit()
    assert isinstance(model.pos_encoding, SphericalRope) and model.pos_encoding.triplets == 5
    check_vit_trains(_vit, model)


def test_vit_loss_falls_in_a_few_steps():
    torch.manual_seed(0)
    model = _vit().train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 5, (8,))
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]


@pytest.mark.parametrize("options,needle", [
    ({"theta": 1.0}, r"theta=1\.0 is not valid"),
    ({"extrapolation": "yarn"}, r"'yarn'.*(extend|interpolate)"),
    ({"head_dim": 2}, r"head_dim=2"),
    ({"grid_size": (2, 3, 3)}, r"takes 2-D grids.*\(2, 3, 3\) is 3-D"),
])
def test_bad_options_are_refused_at_construction(options, needle):
    head_dim = options.pop("head_dim", 16)
    grid = options.pop("grid_size", (3, 4))
    with pytest.raises(ValueError, match=needle):
        _sph(grid, head_dim=head_dim, **options)
