"""CPE / PEG -- conditional positional encoding (Chu et al., CPVT, ICLR 2023).

A Position Encoding Generator folds the patch tokens back into their ``(h, w)`` map, runs a
depthwise ``k x k`` convolution with **zero** padding and adds the result to its input
(``x + DWConv(x)``); the zero padding is what leaks absolute position at the borders, the
convolution keeps the encoding local and translation-equivariant, and nothing depends on the grid
size. Prefix tokens (cls, registers) bypass it. One PEG sits after each block listed in
``positions`` (default ``(0,)``: between block 0 and block 1, the CPVT default; ``-1`` means right
after the patch embedding). For ``kernel_size=3`` a PEG equals timm's ``twins.PosConv`` (stride 1),
which the tests use as the oracle; vispe keeps its own module for other kernel sizes.

Init (authors' code): weight ``N(0, sqrt(2 / fan_out))`` with ``fan_out = k^2`` for a depthwise
conv, bias 0; PEG parameters are excluded from weight decay.

GAP variant (CPVT-GAP): not an encoding option but a model configuration --
``timm.create_model(..., pos_encoding='cpe', class_token=False, global_pool='avg', fc_norm=False)``
(no cls token, tokens averaged for the classifier; ``fc_norm=False`` keeps the final LayerNorm
before the mean as in the authors' code).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn as nn

from .._checks import Int, Seq
from .base import PositionalEncoding, register_encoding
from .grid import PositionGrid

__all__ = ["PEG", "ConditionalPE"]


class PEG(nn.Module):
    """Depthwise ``k x k`` conv with zero padding, residual, on the lattice tokens of a 2D grid."""

    def __init__(self, dim: int, kernel_size: int = 3) -> None:
        super().__init__()
        self.proj = nn.Conv2d(dim, dim, kernel_size, stride=1, padding=kernel_size // 2, groups=dim, bias=True)
        nn.init.normal_(self.proj.weight, std=math.sqrt(2.0 / (kernel_size * kernel_size)))
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: torch.Tensor, grid: PositionGrid) -> torch.Tensor:
        s = grid.num_prefix_tokens
        h, w = grid.shape
        bsz, length, dim = x.shape
        keep = grid.keep
        present = grid.seq_len if keep is None else s + keep.shape[1]
        if length != present:
            raise ValueError(f"PEG expects {present} tokens for grid {grid.shape} + {s} prefix, got {length}")
        patches = x[:, s:]
        lattice = patches
        if keep is not None:  # after patch dropout the dropped tokens are zeros on the lattice
            rows = keep[..., None].expand(-1, -1, dim)
            lattice = patches.new_zeros(bsz, h * w, dim).scatter(1, rows, patches)
        feat = lattice.transpose(1, 2).reshape(bsz, dim, h, w)  # row-major fold
        conv = self.proj(feat).flatten(2).transpose(1, 2)
        patches = patches + (conv if keep is None else conv.gather(1, rows))
        return torch.cat([x[:, :s], patches], dim=1) if s else patches


@register_encoding("cpe")
class ConditionalPE(PositionalEncoding):
    """PEGs after the blocks in ``positions`` (``-1`` = before block 0).

    Args:
        positions: block indices after which a PEG runs (default ``(0,)``).
        kernel_size: odd kernel size (default 3).
    """

    kind = "conditional"
    grid_ndims = (2,)
    prefix_policy = "prefix tokens bypass the PEG (only the lattice tokens are convolved)"

    #: option rules, checked before __init__ (vispe._checks; see PositionalEncoding.option_checks)
    option_checks = {"positions": Seq(Int(-1), min_length=1, distinct=True, scalar_ok=True), "kernel_size": Int(1, odd=True)}

    def __init__(self, dim: int, depth: int, positions: Sequence[int] = (0,), kernel_size: int = 3) -> None:
        super().__init__()
        if isinstance(positions, int):
            positions = (positions,)
        positions = tuple(int(p) for p in positions)
        bad = [p for p in positions if not -1 <= p < depth]
        if bad or not positions or len(set(positions)) != len(positions):
            raise ValueError(f"cpe positions={positions} must be distinct block indices in [-1, {depth}) (-1 = before block 0)")
        if not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"cpe kernel_size must be an odd positive integer (3 is the default), got {kernel_size!r}")
        self.positions = positions
        self.kernel_size = kernel_size
        self.pegs = nn.ModuleDict({str(p): PEG(dim, kernel_size) for p in positions})

    def embed_tokens(self, x, grid, state=None, image=None):
        if "-1" in self.pegs:
            self.check_grid(grid)
            x = self.pegs["-1"](x, grid)
        return x

    def after_block(self, index, x, grid, state=None):
        peg = self.pegs[str(index)] if str(index) in self.pegs else None
        if peg is None:
            return x
        self.check_grid(grid)
        return peg(x, grid)

    def no_weight_decay(self) -> set[str]:
        return {name for name, _ in self.named_parameters()}
