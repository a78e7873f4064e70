"""Patch dropout (timm's ``patch_drop_rate``) with every encoding that has positions.

The property: a model that drops tokens computes, for the tokens it keeps, exactly what the same model
computes on the full sequence when attention may only look at those tokens (keys of the dropped ones
masked). So rotary tables, bias maps and ComRoPE rotations must follow each sample's kept tokens.
PEG (``cpe``) convolves the lattice, so with dropout the dropped tokens are zeros there; it is checked
against that definition instead.
"""
from __future__ import annotations

import pytest
import timm
import torch
import torch.nn as nn
from timm.layers import PatchDropoutWithIndices

import vispe
from vispe.encodings import EncodingContext, PositionGrid, get_encoding_class
from vispe.models.video_vit import VispeVideoViT

ENC_2D = [n for n in vispe.list_encodings() if 2 in get_encoding_class(n).grid_ndims]
ENC_3D = [n for n in vispe.list_encodings() if 3 in get_encoding_class(n).grid_ndims]
# encodings whose per-token state lives between blocks on the lattice (checked on their own below)
LATTICE_CONV = {"cpe"}


class FixedKeep(PatchDropoutWithIndices):
    """Patch dropout that keeps given lattice indices (so both runs see the same tokens)."""

    def __init__(self, keep: torch.Tensor, num_prefix_tokens: int) -> None:
        super().__init__(0.5, num_prefix_tokens=num_prefix_tokens)
        self.keep = keep

    def forward(self, x):
        s = self.num_prefix_tokens
        kept = x[:, s:].gather(1, self.keep[..., None].expand(-1, -1, x.shape[-1]))
        return torch.cat([x[:, :s], kept], dim=1), self.keep


def _random_keep(bsz: int, num_patches: int, num_keep: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(num_patches, generator=g)[:num_keep] for _ in range(bsz)])


def _run(model, inp, attn_mask=None):
    x, grid = model.embed(inp)
    for _, x in model.iter_blocks(x, grid, attn_mask):
        pass
    return x, grid


def _kept_vs_masked(model, inp, num_patches: int, num_keep: int):
    s = model.num_prefix_tokens
    keep = _random_keep(inp.shape[0], num_patches, num_keep)
    model.train()
    model.patch_drop = FixedKeep(keep, s)
    torch.manual_seed(1)  # training-time randomness inside encodings (e.g. ComRoPE jitter) drawn alike
    dropped, grid = _run(model, inp)
    assert grid.keep is keep and dropped.shape[1] == s + num_keep
    model.patch_drop = nn.Identity()
    rows = grid.sequence_index()
    allowed = torch.zeros(inp.shape[0], s + num_patches, dtype=torch.bool)
    allowed.scatter_(1, rows, True)
    mask = allowed[:, None, None, :].expand(-1, 1, s + num_patches, -1)
    torch.manual_seed(1)
    full, _ = _run(model, inp, mask)
    ref = full.gather(1, rows[..., None].expand(-1, -1, full.shape[-1]))
    return dropped, ref


@pytest.mark.parametrize("name", [n for n in ENC_2D if n not in LATTICE_CONV])
def test_image_vit_patch_dropout_equals_masked_full_sequence(name):
    torch.manual_seed(0)
    model = timm.create_model(
        "vispe_vit_tiny_patch16_224", pos_encoding=name, img_size=48, patch_size=8, embed_dim=48, depth=2,
        num_heads=3, num_classes=4, patch_drop_rate=0.5,
    )
    assert isinstance(model.patch_drop, PatchDropoutWithIndices)
    inp = torch.randn(2, 3, 48, 48)
    dropped, ref = _kept_vs_masked(model, inp, 36, 17)
    torch.testing.assert_close(dropped, ref, atol=2e-5, rtol=1e-4)
    # and it trains: gradients reach the encoding's parameters where it has any
    model.patch_drop = PatchDropoutWithIndices(0.5, num_prefix_tokens=model.num_prefix_tokens)
    model(inp).logsumexp(-1).sum().backward()
    grads = [p.grad for p in model.pos_encoding.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("name", ENC_3D)
def test_video_vit_patch_dropout_equals_masked_full_sequence(name):
    torch.manual_seed(0)
    model = VispeVideoViT(
        pos_encoding=name, img_size=32, num_frames=4, tubelet_size=2, patch_size=8, embed_dim=48, depth=2, num_heads=3,
        num_classes=3, patch_drop_rate=0.5,
    )
    inp = torch.randn(2, 3, 4, 32, 32)
    dropped, ref = _kept_vs_masked(model, inp, 2 * 4 * 4, 13)
    torch.testing.assert_close(dropped, ref, atol=2e-5, rtol=1e-4)
    model.patch_drop = PatchDropoutWithIndices(0.5, num_prefix_tokens=model.num_prefix_tokens)
    model(inp).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_peg_with_dropped_tokens():
    """With dropped tokens, PEG sees zeros at their lattice cells and returns the kept tokens only."""
    torch.manual_seed(0)
    enc = vispe.create_encoding("cpe", EncodingContext(dim=8, num_heads=2, depth=2, grid_size=(4, 5)))
    peg = enc.pegs["0"]
    x = torch.randn(2, 1 + 20, 8)
    keep = _random_keep(2, 20, 9, seed=3)
    grid = PositionGrid((4, 5), 1).with_keep(keep)
    rows = grid.sequence_index()
    kept = x.gather(1, rows[..., None].expand(-1, -1, 8))
    out = enc.after_block(0, kept, grid)
    zeroed = torch.zeros_like(x)
    zeroed.scatter_(1, rows[..., None].expand(-1, -1, 8), kept)
    ref = peg(zeroed, PositionGrid((4, 5), 1)).gather(1, rows[..., None].expand(-1, -1, 8))
    torch.testing.assert_close(out, ref)
    # PEG is not trivially zero here (the check above would pass for any identity)
    assert (out[:, 1:] - kept[:, 1:]).abs().max() > 1e-3


def test_keep_indices_are_validated():
    with pytest.raises(ValueError, match="int64 lattice indices"):
        PositionGrid((2, 2)).with_keep(torch.zeros(3, dtype=torch.int64))
