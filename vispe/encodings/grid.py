"""Position grids: the one description of "where each token is" that every encoding consumes.

A grid is an N-D lattice of patch (or tubelet) tokens laid out in row-major order (last axis
fastest), preceded by ``num_prefix_tokens`` tokens that have no lattice position (cls, registers,
distillation). 2D image grids are ``(h, w)``, video grids are ``(t, h, w)``; nothing here is
specific to two axes. Multimodal (text + vision) position ids are not lattices and are built by
:mod:`vispe.positions` instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import torch

# the coordinate-augmentation draws live with the other augmentation code; re-exported here
from .coordinates import random_lattice_indices, random_scale_shift

__all__ = ["PositionGrid", "as_grid", "random_lattice_indices", "random_scale_shift"]


@dataclass(frozen=True)
class PositionGrid:
    """An N-D token lattice plus a count of prefix tokens that precede it in the sequence.

    Attributes:
        shape: lattice size per axis, e.g. ``(h, w)`` or ``(t, h, w)``.
        num_prefix_tokens: tokens before the lattice (cls, registers); they carry no coordinate.
        keep: lattice tokens that survive patch dropout, int64 ``(B, K)`` indices in row-major lattice
            order (timm's ``PatchDropoutWithIndices``), or ``None`` when every token is present. Not part
            of the grid's identity (tables are built for the full lattice, then narrowed to ``keep``).
    """

    shape: tuple[int, ...]
    num_prefix_tokens: int = 0
    keep: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        shape = tuple(int(s) for s in self.shape)
        if len(shape) == 0 or any(s <= 0 for s in shape):
            raise ValueError(f"PositionGrid shape must be a non-empty tuple of positive sizes, got {self.shape!r}")
        if self.num_prefix_tokens < 0:
            raise ValueError(f"num_prefix_tokens must be >= 0, got {self.num_prefix_tokens}")
        object.__setattr__(self, "shape", shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def num_patches(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def seq_len(self) -> int:
        return self.num_prefix_tokens + self.num_patches

    def indices(self, device: torch.device | str | None = None, rescale_to: Sequence[int] | None = None) -> torch.Tensor:
        """Integer lattice indices, float32 of shape ``(num_patches, ndim)``, axes in ``shape`` order.

        For a 2D grid column 0 is the row index and column 1 the column index. ``rescale_to`` (a training
        grid of the same number of axes): indices scaled by ``train / size`` per axis, so this grid spans
        the training grid's index range -- the ``'rescale'`` resolution policy
        (:func:`vispe.encodings.coordinates.policy_indices`).
        """
        axes = [torch.arange(s, device=device, dtype=torch.float32) for s in self.shape]
        mesh = torch.meshgrid(*axes, indexing="ij")
        idx = torch.stack([m.reshape(-1) for m in mesh], dim=-1)
        if rescale_to is not None and tuple(rescale_to) != self.shape:
            if len(rescale_to) != self.ndim:
                raise ValueError(f"rescale_to={tuple(rescale_to)} has {len(rescale_to)} axes but the grid {self.shape} has {self.ndim}")
            scale = torch.tensor([t / s for t, s in zip(rescale_to, self.shape)], device=idx.device, dtype=torch.float32)
            idx = idx * scale
        return idx

    def centers(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Patch centres normalised per axis to (0, 1): ``(i + 0.5) / size``; shape ``(num_patches, ndim)``."""
        size = torch.tensor(self.shape, device=device, dtype=torch.float32)
        return (self.indices(device) + 0.5) / size

    def with_prefix(self, num_prefix_tokens: int) -> "PositionGrid":
        return PositionGrid(self.shape, num_prefix_tokens)

    def with_keep(self, keep: Optional[torch.Tensor]) -> "PositionGrid":
        """This grid with patch dropout's kept lattice indices ``(B, K)`` (``None``: all tokens)."""
        if keep is not None:
            if keep.ndim != 2 or keep.dtype != torch.int64:
                raise ValueError(f"keep must be int64 lattice indices of shape (B, K), got {keep.dtype} {tuple(keep.shape)}")
        return replace(self, keep=keep)

    def sequence_index(self) -> torch.Tensor:
        """Row of each present token in the full sequence, ``(B, S + K)`` int64: the prefix tokens, then
        ``S + keep``. Requires :attr:`keep`."""
        if self.keep is None:
            raise ValueError("sequence_index needs the grid's keep indices (patch dropout)")
        s = self.num_prefix_tokens
        prefix = torch.arange(s, device=self.keep.device).expand(self.keep.shape[0], s)
        return torch.cat([prefix, self.keep + s], dim=1)


def as_grid(grid: PositionGrid | Sequence[int], num_prefix_tokens: int = 0) -> PositionGrid:
    """Accept a :class:`PositionGrid` or a plain shape tuple."""
    if isinstance(grid, PositionGrid):
        return grid
    return PositionGrid(tuple(grid), num_prefix_tokens)
