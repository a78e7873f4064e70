"""Checks the rotary encodings' own tests share: the same q/k placed on a block of a lattice and on that block
shifted give the same logits (attention depends on offsets only); a ViT with the encoding trains at three grids,
with patch dropout, under bf16 autocast and cast to bf16, with its rotation table kept complex64 (block rotations float32)."""
from __future__ import annotations

from typing import Callable, Sequence

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


def check_vit_trains(vit: Callable[..., torch.nn.Module], first_model: torch.nn.Module) -> None:
    """``first_model`` trains a step at 32x32, 48x48 and 24x40 with finite gradients; ``vit(patch_drop_rate=0.5)``
    trains with patch dropout; ``vit()`` under bf16 autocast stays within 5 % of its float32 loss, runs cast to bf16,
    and keeps its rotation table complex64 (angles in float32; block rotations: float32 matrices)."""
    model = first_model
    for size in [(32, 32), (48, 48), (24, 40)]:
        model.zero_grad()
        out = model(torch.randn(2, 3, *size))
        assert out.shape == (2, 5) and torch.isfinite(out).all()
        torch.nn.functional.cross_entropy(out, torch.tensor([1, 2])).backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model = vit(patch_drop_rate=0.5).train()
    model(torch.randn(2, 3, 32, 32)).logsumexp(-1).sum().backward()
    x, y = torch.randn(2, 3, 32, 48), torch.tensor([1, 3])
    model = vit().eval()
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(model(x), y).item()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    assert torch.isfinite(loss) and abs(loss.item() - ref) <= 0.05 * max(1.0, ref)
    out = model.to(torch.bfloat16)(x.bfloat16())
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    enc, grid = model.pos_encoding, PositionGrid((8, 12), 1)
    if enc.pairwise_phases:
        assert enc.prepare(grid).table.dtype == torch.complex64
    else:  # block rotations (spherical_rope, LieRE): float32 matrices
        assert enc.rotations(grid).dtype == torch.float32
