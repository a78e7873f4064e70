"""A check the rotary encodings' own tests share: the same q/k placed on a block of a lattice and on that block
shifted give the same logits (attention depends on offsets only)."""
from __future__ import annotations

from typing import Sequence

import torch

from vispe.encodings import PositionGrid


def shifted_block_logits(enc, grid: Sequence[int], shift: Sequence[int], head_dim: int, heads: int = 2):
    """Logits ``(a, b, crossed)`` of one random q/k set on the ``grid`` block at the origin of a lattice ``grid +
    shift`` (``a``), on the block moved by ``shift`` (``b``), and with only the keys moved (``crossed``); the other
    tokens get other random content. ``a == b`` for an encoding whose logits depend on offsets only."""
    big = PositionGrid(tuple(g + s for g, s in zip(grid, shift)), 0)
    idx = big.indices()
    here = torch.stack([idx[:, a] < g for a, g in enumerate(grid)]).all(0).nonzero().squeeze(1)
    moved = torch.stack([idx[:, a] >= s for a, s in enumerate(shift)]).all(0).nonzero().squeeze(1)
    state = enc.prepare(big)
    q, k = torch.randn(2, 1, heads, here.numel(), head_dim).unbind(0)
    out = []
    for q_rows, k_rows in ((here, here), (moved, moved), (here, moved)):
        qb, kb = torch.randn(2, 1, heads, big.num_patches, head_dim).unbind(0)
        qb[..., q_rows, :], kb[..., k_rows, :] = q, k
        qr, kr = enc.rotate_qk(qb, kb, state)
        out.append((qr @ kr.transpose(-1, -2))[..., q_rows[:, None], k_rows])
    return tuple(out)
