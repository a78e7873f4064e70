"""Attention biases that are a per-head function of the lattice offset between query and key: the machinery
ALiBi (:mod:`vispe.encodings.alibi`), FIRE (:mod:`vispe.encodings.fire`) and iRPE's lattice codes share.

A lattice of sizes ``s_a`` has only ``U = prod(2 s_a - 1)`` distinct query-minus-key offsets. An encoding computes
one value per head per offset (a ``(H, U)`` table, plus one zero column for pairs with a prefix token). A pair's
offset id is the difference of two per-token codes (:class:`LatticePairCodes`), so the term is a function of
(query index, key index, head) plus that table and one code per token (:class:`~vispe.encodings.attention.IndexedBias`):
attention builds it per block of queries or inside FlexAttention, never as an ``(L, L)`` map; patch dropout narrows
the codes to the kept tokens. Design notes: ``docs/design/attention-bias-2d.md`` and ``docs/speed.md``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from .attention import OffsetIds, bias_function
from .base import AttentionBiasEncoding, IndexedBias
from .grid import PositionGrid

__all__ = [
    "LatticeOffsetBias",
    "LatticeOffsets",
    "LatticePairCodes",
    "PairBiasState",
    "gather_pair_bias",
    "lattice_offsets",
    "pair_distance",
    "take_columns",
]


# ---------------------------------------------------------------------------------------------
# Lattice offsets: every query-minus-key offset once, and the offset of each token pair
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LatticeOffsets:
    """The distinct offsets of a lattice and the offset id of every token pair.

    Attributes:
        offsets: float32 ``(U, ndim)``, ``U = prod(2 s_a - 1)``: every offset ``p_query - p_key``, row-major over
            the per-axis ranges ``-(s_a - 1) .. s_a - 1``.
        ids: int64 ``(L, L)`` (query row, key column) over the whole sequence: the row of ``offsets`` of a pair of
            lattice tokens, or ``U`` (the zero column of every table) when either token is a prefix token.
    """

    offsets: torch.Tensor
    ids: torch.Tensor

    @property
    def num_offsets(self) -> int:
        return self.offsets.shape[0]


def _lattice_offset_rows(grid: PositionGrid, device: torch.device | str | None = None) -> torch.Tensor:
    """:attr:`LatticeOffsets.offsets` alone (no ``(L, L)`` pair map): every offset once, row-major."""
    axes = [torch.arange(1 - s, s, device=device, dtype=torch.float32) for s in grid.shape]
    return torch.stack([m.reshape(-1) for m in torch.meshgrid(*axes, indexing="ij")], dim=-1)


def lattice_offsets(grid: PositionGrid, device: torch.device | str | None = None) -> LatticeOffsets:
    """:class:`LatticeOffsets` of ``grid`` (prefix tokens first, then the lattice in row-major order)."""
    shape = grid.shape
    spans = [2 * s - 1 for s in shape]
    axes = [torch.arange(1 - s, s, device=device, dtype=torch.float32) for s in shape]
    offsets = torch.stack([m.reshape(-1) for m in torch.meshgrid(*axes, indexing="ij")], dim=-1)
    idx = grid.indices(device).long()
    n = grid.num_patches
    ids = torch.zeros(n, n, dtype=torch.int64, device=offsets.device)
    stride = 1
    for a in reversed(range(grid.ndim)):  # row-major: the last axis varies fastest
        col = idx[:, a]
        ids += (col[:, None] - col[None, :] + (shape[a] - 1)) * stride
        stride *= spans[a]
    s = grid.num_prefix_tokens
    if s:
        full = torch.full((grid.seq_len, grid.seq_len), offsets.shape[0], dtype=torch.int64, device=ids.device)
        full[s:, s:] = ids
        ids = full
    return LatticeOffsets(offsets, ids)


@dataclass(frozen=True)
class LatticePairCodes:
    """One int64 code per token such that a pair's offset id (the row of :attr:`LatticeOffsets.offsets`) is
    ``code[i] - code[j] + center``: the row-major mixed-radix number of the token's lattice index in the offset
    spans ``2 s_a - 1``. Prefix tokens have code ``-1`` and their pairs id ``U`` (the zero column).

    Attributes:
        codes: ``(1, L)`` over the whole sequence, or ``(B, n)`` per sample after patch dropout.
        center: the id of offset zero.
        num_offsets: ``U``.
        span: the offsets along the last axis (``2 s - 1``): ids are row-major in them (0: unknown).
    """

    codes: torch.Tensor
    center: int
    num_offsets: int
    span: int = 0

    def pair_ids(self, b: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """Offset ids of the pairs ``(i, j)`` of sample ``b`` (index tensors that broadcast)."""
        if self.codes.shape[0] == 1:  # shared by the batch: one index instead of two
            ci, cj = self.codes[0][i], self.codes[0][j]
            if ci.device.type == "cpu" and not torch.compiler.is_compiling():
                ids = self._block_ids(ci, cj)
                if ids is not None:
                    return ids
        else:
            ci, cj = self.codes[b, i], self.codes[b, j]
        return torch.where((ci < 0) | (cj < 0), self.num_offsets, ci - cj + self.center)

    def _block_ids(self, ci: torch.Tensor, cj: torch.Tensor) -> torch.Tensor | None:
        """:meth:`pair_ids` from codes that each vary along one axis (a block's ``(..., rows, 1)`` and ``(..., 1, L)``)
        in one pass: the difference, then the few prefix rows and columns filled in place (a ``where`` over the
        broadcast prefix test is ~7x slower on CPU at 1,025 tokens). ``None`` for other layouts. Eager CPU only: it
        reads which tokens are prefix tokens."""
        ids = (ci + self.center) - cj
        for c in (ci, cj):
            axes = [ids.dim() - c.dim() + a for a, n in enumerate(c.shape) if n > 1]
            if len(axes) > 1:
                return None
            prefix = (c.reshape(-1) < 0).nonzero().view(-1)
            if prefix.numel():
                if axes:
                    ids.index_fill_(axes[0], prefix, self.num_offsets)
                else:
                    ids.fill_(self.num_offsets)
        return ids

    def select(self, index: torch.Tensor) -> "LatticePairCodes":
        """The codes of each sample's present tokens ``index`` ``(B, n)`` (rows of the full sequence)."""
        return LatticePairCodes(self.codes[0][index], self.center, self.num_offsets, self.span)

    @property
    def per_sample(self) -> bool:
        """Codes differ per sample (after patch dropout): the term depends on the batch index."""
        return self.codes.shape[0] > 1

    @staticmethod
    def of(grid: PositionGrid, device: torch.device | str | None = None) -> "LatticePairCodes":
        shape = grid.shape
        idx = grid.indices(device).long()
        codes = torch.zeros(idx.shape[0], dtype=torch.int64, device=idx.device)
        center, stride = 0, 1
        for a in reversed(range(grid.ndim)):  # row-major: the last axis varies fastest
            codes += idx[:, a] * stride
            center += (shape[a] - 1) * stride
            stride *= 2 * shape[a] - 1
        codes = torch.cat([torch.full((grid.num_prefix_tokens,), -1, dtype=torch.int64, device=codes.device), codes])
        return LatticePairCodes(codes[None], center, stride, 2 * shape[-1] - 1)

    def dense_ids(self) -> torch.Tensor:
        """Every pair's id: ``(L, L)``, or ``(B, n, n)`` per sample (for the dense path and tests)."""
        n = self.codes.shape[1]
        b = torch.arange(self.codes.shape[0], device=self.codes.device)[:, None, None]
        i = torch.arange(n, device=self.codes.device)
        ids = self.pair_ids(b, i[None, :, None], i[None, None, :])
        return ids[0] if not self.per_sample else ids


def pair_distance(offsets: torch.Tensor, distance: str) -> torch.Tensor:
    """Non-negative distance of each offset ``(..., ndim)``: ``(..., 1)`` for ``'euclidean'`` / ``'manhattan'``,
    ``(..., ndim)`` per-axis magnitudes for ``'axial'``."""
    if distance == "euclidean":
        return offsets.square().sum(-1, keepdim=True).sqrt()
    if distance == "manhattan":
        return offsets.abs().sum(-1, keepdim=True)
    if distance == "axial":
        return offsets.abs()
    raise ValueError(f"distance={distance!r} is not valid; choose one of ['euclidean', 'manhattan', 'axial']")


def gather_pair_bias(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """One table ``(H, U + 1)`` read at the pair map: ``(1, H, L, L)`` for a map ``(L, L)``, ``(B, H, n, n)`` for
    per-sample maps ``(B, n, n)`` (after patch dropout)."""
    out = values[:, ids]
    return out[None] if ids.ndim == 2 else out.transpose(0, 1)


@dataclass
class PairBiasState:
    """One forward's pair-bias state: the tokens' pair codes and the tables they read.

    ``pairs`` codes every token (``(1, L)``, or ``(B, n)`` after patch dropout); ``values`` is ``(M, H, U + 1)``:
    ``M`` tables (one per layer, or one shared by all), the last column zero (pairs with a prefix token).
    """

    pairs: LatticePairCodes
    values: torch.Tensor

    @property
    def ids(self) -> torch.Tensor:
        """Every pair's offset id, ``(L, L)`` or ``(B, n, n)`` (built on demand: the attention paths never need it)."""
        return self.pairs.dense_ids()

    @property
    def num_tokens(self) -> int:
        return self.pairs.codes.shape[-1]

    def select(self, index: torch.Tensor) -> "PairBiasState":
        """The codes of each sample's present tokens ``index`` ``(B, n)`` (rows of the full sequence)."""
        return PairBiasState(self.pairs.select(index), self.values)


@bias_function("lattice_pair_term")  # named: compiled training runs the term as a custom op
def _pair_term(b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor, table: torch.Tensor,
               codes: torch.Tensor, center: int, num_offsets: int) -> torch.Tensor:
    """``table[h, id(i, j)]`` for a ``(H, U + 1)`` table (the :class:`IndexedBias` form of the lattice pair bias)."""
    if h.dim() == 0:  # FlexAttention's score_mod: one pair at a time
        return table[h, LatticePairCodes(codes, center, num_offsets).pair_ids(b, i, j)]
    # a block of rows in eager: int32 ids (tables have far fewer than 2^31 columns), which index_select reads ~3x
    # faster; compiled graphs keep int64 (inductor's code for the int64 read measured faster than for int32)
    if not torch.compiler.is_compiling():
        codes = codes.int()
    return take_columns(table, LatticePairCodes(codes, center, num_offsets).pair_ids(b, i, j))


@bias_function("lattice_pair_term_grad")  # named: the custom op of compiled training keeps the rule
def _pair_term_grad(ds: torch.Tensor, start: int, stop: int, tensors, grads, *, center: int, num_offsets: int) -> None:
    """The gradient of :func:`_pair_term` for query rows ``start:stop`` (the :class:`IndexedBias` ``accumulate_grad``
    rule): each pair's logit gradient ``ds`` summed onto the table column of its offset, one ``index_add``."""
    table, codes = tensors
    g = grads[0]
    if g is None:
        return
    dev = ds.device
    b = torch.arange(codes.shape[0], device=dev).view(-1, 1, 1, 1)
    i = torch.arange(start, stop, device=dev).view(1, 1, -1, 1)
    j = torch.arange(ds.shape[-1], device=dev).view(1, 1, 1, -1)
    ids = LatticePairCodes(codes, center, num_offsets).pair_ids(b, i, j)  # (B|1, 1, rows, L)
    d = ds.sum(0) if ids.shape[0] == 1 else ds.transpose(0, 1)  # (H, [B,] rows, L), in ids' order
    g.index_add_(1, ids.reshape(-1), d.reshape(g.shape[0], -1).to(g.dtype))


@bias_function("lattice_pair_term_gather")  # named: the custom op of compiled training keeps the native kernels
def _pair_term_gather(start: int, stop: int, length: int, tensors, *, center: int, num_offsets: int):
    """:func:`_pair_term` for query rows ``start:stop`` as the part the native kernels read (the :attr:`IndexedBias.gather`
    rule): the table ``(H, U + 1)`` at each pair's offset id, given by the tokens' codes."""
    table, codes = tensors
    return [(0, OffsetIds(codes[:, start:stop], codes[:, :length], center, num_offsets), False)]


def take_columns(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``table[:, ids[:, 0]]`` as ``(B|1, H, rows, L)`` for a ``(H, C)`` table and ids ``(B|1, 1, rows, L)``: every head at
    once through ``index_select`` on the columns, whose backward is one ``index_add`` (advanced indexing's backward,
    an accumulating ``index_put``, is ~20x slower on CPU for a block of a 1,024-token term)."""
    if torch.compiler.is_compiling() or not (torch.is_grad_enabled() and table.requires_grad):
        flat = table.index_select(1, ids.reshape(-1))  # (H, B|1 * rows * L)
    else:
        flat = _TakeColumns.apply(table, ids.reshape(-1))
    return flat.view(table.shape[0], ids.shape[0], *ids.shape[2:]).transpose(0, 1)


class _TakeColumns(torch.autograd.Function):
    """``table.index_select(1, ids)`` whose backward is one ``index_add`` with int64 ids whatever ``ids``' dtype: on CPU
    ``index_select`` reads int32 ids ~3x faster than int64, while ``index_add`` takes ~10x longer with int32 ones."""

    @staticmethod
    def forward(ctx, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(ids)
        ctx.columns = table.shape[1]
        return table.index_select(1, ids)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (ids,) = ctx.saved_tensors
        out = grad.new_zeros(grad.shape[0], ctx.columns)
        return out.index_add_(1, ids.long(), grad), None


class LatticeOffsetBias(AttentionBiasEncoding):
    """An attention bias that is a per-head function of the lattice offset between query and key.

    Subclasses implement :meth:`tables` (one value per head per distinct offset of the grid) and say which
    table a layer reads (:meth:`table_index`). Tables are cached per grid while no gradient must reach the
    parameters; the pair map is cached per grid, prefix count and device.
    """

    grid_ndims = (2,)
    prefix_policy = "zero bias to and from prefix tokens (cls/registers)"
    #: number of tables (``M`` of :class:`PairBiasState`): set by subclasses
    num_tables: int = 1

    def _training_grid(self, grid_size: Sequence[int]) -> tuple[int, ...]:
        gs = tuple(int(g) for g in grid_size)
        if len(gs) not in self.grid_ndims or min(gs) < 1:
            raise ValueError(
                f"{type(self).__name__}: grid_size={tuple(grid_size)!r} must have {self.grid_ndims} positive sizes "
                f"(use the 2D / 3D variant that matches the grid)"
            )
        return gs

    def tables(self, grid: PositionGrid, offsets: torch.Tensor) -> torch.Tensor:
        """``(M, H, U + 1)``, at least float32: the bias of each distinct offset of ``grid`` (rows of ``offsets``) per head,
        last column zero."""
        raise NotImplementedError

    def table_index(self, layer: int) -> int:
        """Which of the ``M`` tables block ``layer`` reads."""
        return 0

    # -- the lifecycle hooks ----------------------------------------------------------------------
    def prepare(self, grid: PositionGrid, device: torch.device | None = None) -> PairBiasState:
        self.check_grid(grid)
        pairs = self.cached(("codes", grid.shape, grid.num_prefix_tokens, str(device)), lambda: LatticePairCodes.of(grid, device))
        values = self.cached(
            ("tables", grid.shape, str(device)), lambda: self.tables(grid, _lattice_offset_rows(grid, device)), uses_parameters=True
        )
        return PairBiasState(pairs, values)

    def keep_tokens(self, state: PairBiasState, grid: PositionGrid) -> PairBiasState:
        return state.select(grid.sequence_index())

    def _layer_values(self, layer: int, state: PairBiasState, length: int) -> torch.Tensor:
        if state.num_tokens != length:
            raise ValueError(
                f"{self.registry_name}: the pair map covers {state.num_tokens} tokens but attention got {length} "
                f"(patch dropout must narrow it through keep_tokens)"
            )
        t = self.table_index(layer)
        if not 0 <= t < state.values.shape[0]:
            raise ValueError(
                f"{self.registry_name}: layer={layer} has no table; this encoding was built for {self.num_tables} table(s)"
            )
        return state.values[t]

    def bias(self, q: torch.Tensor, k: torch.Tensor, *, layer: int, state: PairBiasState) -> torch.Tensor:
        """The additive logit term of block ``layer``: ``(1, H, L, L)`` (``(B, H, n, n)`` after patch dropout)."""
        return gather_pair_bias(self._layer_values(layer, state, k.shape[-2]), state.ids)

    def indexed_bias(self, q, k, *, layer: int, state: PairBiasState, scale: float) -> IndexedBias:
        """The term by index: ``values[h, code[i] - code[j] + center]`` (prefix pairs read the zero column)."""
        values = self._layer_values(layer, state, k.shape[-2])
        pairs = state.pairs
        return IndexedBias(
            functools.partial(_pair_term, center=pairs.center, num_offsets=pairs.num_offsets),
            (values, pairs.codes), per_sample=pairs.per_sample,
            accumulate_grad=functools.partial(_pair_term_grad, center=pairs.center, num_offsets=pairs.num_offsets),
            gather=functools.partial(_pair_term_gather, center=pairs.center, num_offsets=pairs.num_offsets),
        )
