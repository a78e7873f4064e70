"""Frequency-rescaling policies of the rotary lattice encodings (``ntk``, ``yarn``): what they equal where
they must, the NTK-aware base change on a ladder, YaRN's ramp, the relative property, and the sweep."""
from __future__ import annotations

import math

import pytest
import torch

from vispe.encodings.grid import PositionGrid
from vispe.encodings.rope_vit import RopeAxial, RopeAxial3d, RopeMixed, RopeMixed3d


def _encodings(policy: str):
    torch.manual_seed(0)
    return [
        RopeAxial(32, grid_size=(4, 6), extrapolation=policy),
        RopeMixed(32, 2, 3, grid_size=(4, 6), extrapolation=policy),
        RopeAxial3d(48, grid_size=(2, 4, 4), extrapolation=policy),
        RopeMixed3d(48, 2, 2, grid_size=(2, 4, 4), extrapolation=policy),
    ]


@pytest.mark.parametrize("policy", ["ntk", "yarn"])
def test_rescaling_equals_extend_where_no_axis_grows(policy):
    for scaled, extend in zip(_encodings(policy), _encodings("extend")):
        train = scaled.grid_size
        smaller = tuple(max(1, g // 2) for g in train)
        mixed = (train[0] - 1,) + train[1:]  # one axis shrinks, none grows
        for shape in (train, smaller, mixed):
            g = PositionGrid(shape)
            assert torch.equal(scaled.angles(g, None), extend.angles(g, None)), (type(scaled).__name__, policy, shape)


def test_ntk_on_the_ladder_is_the_ntk_aware_base_change():
    # theta' = theta * s^(n/(n-1)) on an n-pair ladder: the LLM formula theta * s^(d/(d-2)) with d = 2n
    head_dim, train, s = 32, (4, 4), 2
    n = head_dim // 4  # pairs per axis
    ntk = RopeAxial(head_dim, grid_size=train, extrapolation="ntk")
    based = RopeAxial(head_dim, grid_size=train, theta=100.0 * s ** (n / (n - 1)), extrapolation="extend")
    g = PositionGrid((train[0] * s, train[1] * s))
    torch.testing.assert_close(ntk.angles(g, None), based.angles(g, None), rtol=1e-5, atol=1e-6)
    # the highest frequency is kept, the lowest is interpolated
    ext = RopeAxial(head_dim, grid_size=train, extrapolation="extend").angles(g, None)
    itp = RopeAxial(head_dim, grid_size=train, extrapolation="interpolate").angles(g, None)
    a = ntk.angles(g, None)
    assert torch.equal(a[:, 0], ext[:, 0]) and torch.equal(a[:, n], ext[:, n])
    torch.testing.assert_close(a[:, n - 1], itp[:, n - 1])


class _ShortRampRope(RopeAxial):
    """A ramp that the 16-wide test grid spans: pairs above 2 turns kept, below 1 turn interpolated."""

    yarn_beta = 2.0


def test_yarn_keeps_fast_pairs_interpolates_slow_ones_and_blends_between():
    train, new = (16, 16), PositionGrid((32, 32))
    yarn = _ShortRampRope(32, grid_size=train, extrapolation="yarn")
    ext = RopeAxial(32, grid_size=train, extrapolation="extend").angles(new, None)
    itp = RopeAxial(32, grid_size=train, extrapolation="interpolate").angles(new, None)
    a = yarn.angles(new, None)
    turns = yarn.bands(8, None) * train[0] / (2 * math.pi)  # per pair of an axis chunk
    fast, slow = turns >= 2.0, turns <= 1.0
    assert fast.any() and slow.any() and (~fast & ~slow).any()
    for chunk in (0, 8):
        cols = torch.arange(8) + chunk
        torch.testing.assert_close(a[:, cols[fast]], ext[:, cols[fast]])
        torch.testing.assert_close(a[:, cols[slow]], itp[:, cols[slow]])
        mid = cols[~fast & ~slow]
        lo, hi = torch.minimum(ext[:, mid], itp[:, mid]), torch.maximum(ext[:, mid], itp[:, mid])
        assert ((a[:, mid] >= lo - 1e-5) & (a[:, mid] <= hi + 1e-5)).all()


@pytest.mark.parametrize("policy", ["ntk", "yarn"])
def test_rescaled_angles_stay_relative(policy):
    """Angles stay linear in the lattice index, so q.k after rotation depends only on the offset."""
    for enc in _encodings(policy)[:2]:
        g = PositionGrid((8, 12))
        a = enc.angles(g, None)  # (..., N, P)
        idx = g.indices().long()
        row = {tuple(v.tolist()): i for i, v in enumerate(idx)}
        for p, q, off in [((0, 0), (3, 5), (2, 1)), ((1, 2), (4, 9), (3, 2))]:
            dp = a[..., row[(p[0] + off[0], p[1] + off[1])], :] - a[..., row[p], :]
            dq = a[..., row[(q[0] + off[0], q[1] + off[1])], :] - a[..., row[q], :]
            torch.testing.assert_close(dp, dq, rtol=1e-5, atol=1e-5)


def test_bad_policy_names_the_choices():
    with pytest.raises(ValueError, match=r"extrapolation.*'ntx'.*ntk.*yarn"):
        RopeAxial(32, grid_size=(4, 4), extrapolation="ntx")
