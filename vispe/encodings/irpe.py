"""iRPE -- image relative position encoding (Wu et al., ICCV 2021), pure PyTorch.

Each (query, key) pair gets a bucket of its 2D offset (piecewise index function); a learned table per
bucket enters attention as a logit bias (``mode='bias'``) or a vector dotted with q / k or summed into the
output (``mode='contextual'``, sides ``q``/``k``/``v``). Defaults are the released DeiT configuration.
The maths, the SDPA path and the paper-vs-code choices: ``docs/design/irpe.md``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._checks import AnyOf, Choice, Ints, Real, Seq, Str
from .attention import OffsetIds, bias_function
from .lattice_bias import LatticePairCodes, _lattice_offset_rows, take_columns
from .base import AttentionBiasEncoding, IndexedBias, fold_causal_mask, merge_attn_mask, register_encoding
from .grid import PositionGrid

__all__ = ["IRPE", "IRPEState", "piecewise_index", "irpe_bucket_ids", "offset_buckets", "IRPE_METHODS", "IRPE_MODES", "IRPE_SIDES"]

IRPE_METHODS = ("euclidean", "quant", "cross", "product")
IRPE_MODES = ("bias", "contextual")
IRPE_SIDES = ("q", "k", "v")
#: devices where a contextual term shared by the batch is built as a product with one-hot buckets
#: (:func:`_one_hot_term`) instead of a gather. On CUDA a gather's gradient is a scatter-add whose atomics contend on
#: the few buckets (~50 per row of 197 keys): 41 ms of a 67 ms compiled ViT-S/16 train step (batch 128, bf16
#: autocast, H100), where the product's gradient is one batched matmul. Taken while the one-hot ``(rows, L, nb)`` is no
#: larger than the term ``(B, H, rows, L)`` (``B * H >= nb``: a small batch's scatter is small too). CPU keeps the
#: gathers (its index_add runs without atomics); with TF32 matmuls allowed, the product rounds ``z`` as every other
#: TF32 matmul does.
ONE_HOT_TERM_DEVICES: frozenset[str] = frozenset({"cuda"})


def piecewise_index(rel: torch.Tensor, alpha: float, beta: float, gamma: float) -> torch.Tensor:
    """The iRPE index function ``g`` (released-code form), int64 output.

    ``g(x) = round(x)`` for ``|x| <= alpha``, else
    ``sign(x) * trunc(min(beta, round(alpha + ln(|x|/alpha) / ln(gamma/alpha) * (beta - alpha))))``.
    """
    rel = rel.float()
    mag = rel.abs()
    near = mag <= alpha
    safe = torch.where(near, torch.full_like(mag, alpha), mag)  # avoid log(0) in the unused branch
    far = alpha + torch.log(safe / alpha) / math.log(gamma / alpha) * (beta - alpha)
    far = torch.sign(rel) * far.round().clamp(max=beta)
    out = torch.where(near, rel.round(), far)
    return out.trunc().to(torch.int64)


def irpe_bucket_ids(
    grid: PositionGrid, method: str, ratio: float, prefix_bucket: bool, device: torch.device | str | None = None
) -> tuple[torch.Tensor, int]:
    """Bucket maps of a 2D grid.

    Returns:
        ``(ids, buckets_per_table)``: ``ids`` is int64 ``(T, L, L)`` with ``T = 2`` for ``'cross'``
        (row table, column table) and 1 otherwise, query index first; each table has
        ``buckets_per_table`` entries (the last one is the prefix bucket when ``prefix_bucket``).
    """
    if method not in IRPE_METHODS:
        raise ValueError(f"unknown iRPE method {method!r}; choose one of {list(IRPE_METHODS)}")
    idx = grid.indices(device)  # (N, 2) rows, cols
    d = idx[:, None, :] - idx[None, :, :]  # (N, N, 2) query minus key
    ids, n = offset_buckets(d[..., 0], d[..., 1], method, ratio)
    s = grid.num_prefix_tokens
    if s:
        if not prefix_bucket:
            raise ValueError(
                f"the sequence has {s} prefix token(s) but this iRPE was built without a prefix bucket "
                f"(built for num_prefix_tokens=0)"
            )
        full = torch.full((ids.shape[0], grid.seq_len, grid.seq_len), n, dtype=torch.int64, device=ids.device)
        full[:, s:, s:] = ids
        ids = full
    return ids, n + (1 if prefix_bucket else 0)


def offset_buckets(dr: torch.Tensor, dc: torch.Tensor, method: str, ratio: float) -> tuple[torch.Tensor, int]:
    """The bucket of each 2D offset (query minus key; ``dr``, ``dc`` float of any shape ``S``): ``(T, *S)`` int64,
    ``T = 2`` for ``'cross'`` (row table, column table) else 1, and the buckets per table (no prefix bucket)."""
    alpha, beta, gamma = ratio, 2 * ratio, 8 * ratio
    beta_int = int(beta)
    width = 2 * beta_int + 1
    if method == "euclidean":
        ids = (piecewise_index(torch.sqrt(dr * dr + dc * dc).round(), alpha, beta, gamma) + beta_int)[None]
        n = width
    elif method == "quant":
        ids = (piecewise_index(dr * dr + dc * dc, alpha, beta, gamma) + beta_int)[None]
        n = width
    elif method == "cross":
        ids = torch.stack([piecewise_index(dr, alpha, beta, gamma), piecewise_index(dc, alpha, beta, gamma)]) + beta_int
        n = width
    else:  # product
        ids = ((piecewise_index(dr, alpha, beta, gamma) + beta_int) * width + piecewise_index(dc, alpha, beta, gamma) + beta_int)[None]
        n = width * width
    return ids, n


@dataclass
class IRPEState:
    """Per-forward bucket description: each token's lattice code (:class:`~vispe.encodings.alibi.LatticePairCodes`)
    and, per distinct offset, its bucket in each table (``lut`` ``(T, U + 1)``, table ``t`` offset by ``t * buckets``,
    the last column the prefix bucket). A pair's bucket is ``lut[t, code[i] - code[j] + center]``, so no
    ``(L, L)`` map is kept; :attr:`ids` builds one on demand for the dense paths."""

    pairs: LatticePairCodes
    lut: torch.Tensor
    num_buckets: int  # total columns of the concatenated tables

    @property
    def ids(self) -> torch.Tensor:
        """Bucket maps ``(T, L, L)`` (query index first), ``(T, B, n, n)`` after patch dropout."""
        return self.lut[:, self.pairs.dense_ids()]

    @property
    def ids_t(self) -> torch.Tensor:
        """:attr:`ids` transposed (key as row), for the query side."""
        return self.ids.transpose(-1, -2)

    @property
    def num_tokens(self) -> int:
        return self.pairs.codes.shape[-1]

    def buckets(self, t: int, b: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """Table ``t``'s bucket (offset included) of the pairs ``(i, j)`` of sample ``b`` (broadcasting index tensors)."""
        return _bucket_of(self.lut[t], self.pairs.pair_ids(b, i, j))

    def select(self, index: torch.Tensor) -> "IRPEState":
        """The codes of each sample's present tokens ``index`` ``(B, n)``."""
        return IRPEState(self.pairs.select(index), self.lut, self.num_buckets)


def _batch_index(b: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return b if t.shape[0] > 1 else torch.zeros_like(b)


def _bucket_of(lut_row: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``lut_row[ids]``: the buckets of a block's pair ids. In eager an ``index_select`` on the flattened ids (~4x
    faster on CPU than advanced indexing for a 1,024-token block); compiled graphs and FlexAttention's one pair at a
    time keep the indexing inductor lowers."""
    if ids.dim() == 0 or torch.compiler.is_compiling():
        return lut_row[ids]
    return lut_row.index_select(0, ids.reshape(-1)).view(ids.shape)


@bias_function("irpe_term")  # named: compiled training runs the term as a custom op
def _irpe_term(b, h, i, j, *tensors, parts: tuple[tuple[str, str], ...], center: int, num_offsets: int):
    """The iRPE logit term by index (the :class:`IndexedBias` form). ``tensors``: ``codes (1|B, L)``, ``lut (T, U + 1)``,
    then per part its tensor: bias mode a table ``(H, nb)``; contextual the projection ``z (B, H, L, nb)``.
    Key side reads the pair ``(i, j)``, query side ``(j, i)``."""
    codes, lut, *per_part = tensors
    pairs = LatticePairCodes(codes, center, num_offsets)
    bc = _batch_index(b, codes)
    out = None
    block = h.dim() > 0  # a block of rows (else FlexAttention's score_mod: one pair at a time)
    for (mode, side), x in zip(parts, per_part):
        row, col = (i, j) if side == "k" else (j, i)
        ids = pairs.pair_ids(bc, row, col)
        for t in range(lut.shape[0]):
            bucket = _bucket_of(lut[t], ids)
            if not block:
                term = x[h, bucket] if mode == "bias" else x[_batch_index(b, x), h, row, bucket]
            elif mode == "bias":
                term = take_columns(x, bucket)  # (B|1, H, rows, L): one index_select on the table's columns
            elif bucket.shape[0] == 1 and x.device.type in ONE_HOT_TERM_DEVICES and x.shape[0] * x.shape[1] >= x.shape[-1]:
                term = _one_hot_term(x, bucket[0, 0], side, i, j)
            elif bucket.shape[0] == 1 and not torch.compiler.is_compiling():
                # eager, buckets shared by the batch: the term reads z flattened per (sample, head) at
                # ``row * nb + bucket``, one int32 index_select for every sample and head at once straight from z
                # (backward: one index_add into dz); compiled graphs keep the gather below (inductor's code for it
                # measured faster)
                flat = take_columns(x.reshape(-1, x.shape[2] * x.shape[-1]), _flat_bucket(bucket, side, i, j, x.shape[-1]).int())
                term = flat.view(x.shape[0], x.shape[1], *flat.shape[2:])  # (B, H, rows, L)
            else:
                # per-sample buckets: the rows' projections, then one gather along the bucket axis (backward: one scatter-add)
                if side == "k":
                    zr = x.index_select(2, i.reshape(-1))  # (B, H, rows, nb)
                    term = torch.gather(zr, -1, bucket.expand(zr.shape[0], zr.shape[1], -1, -1))
                else:  # key rows: the (j, i) buckets of all keys, gathered, then transposed to (rows, keys)
                    zr = x.index_select(2, j.reshape(-1))  # (B, H, L, nb)
                    bt = bucket.transpose(-1, -2)  # (B|1, 1, L, rows)
                    term = torch.gather(zr, -1, bt.expand(zr.shape[0], zr.shape[1], -1, -1)).transpose(-1, -2)
            out = term if out is None else out + term
    return out


def _one_hot_term(z: torch.Tensor, bucket: torch.Tensor, side: str, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """The contextual term of a block of rows as a product with the pairs' one-hot buckets ``(rows, L, nb)``, so that
    its gradient is a matmul too: ``z[b, h, row, bucket]`` summed over the one bucket each pair has (exact: one
    nonzero per sum). ``bucket``: ``(rows, L)``; key side reads ``z`` at the query's row, query side at the key's."""
    one_hot = F.one_hot(bucket, z.shape[-1]).to(z.dtype)  # (rows, L, nb)
    if side == "k":
        return torch.einsum("bhrn,rcn->bhrc", _rows_of(z, i), one_hot)
    return torch.einsum("bhcn,rcn->bhrc", _rows_of(z, j), one_hot)


def _rows_of(z: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``z``'s rows at ``index`` (a block's ``arange(start, stop)``). A block of all ``L`` rows is ``arange(0, L)``: ``z``
    itself, without the ``index_select`` whose backward, an ``index_add`` over ``(B, H, L, nb)``, took 0.85 ms of a
    compiled ViT-S/16 train step's 25.7 ms on an H200 (batch 128, bf16), where the dense term is one block."""
    if index.numel() == z.shape[2]:
        return z
    return z.index_select(2, index.reshape(-1))


def _flat_bucket(bucket: torch.Tensor, side: str, i: torch.Tensor, j: torch.Tensor, nb: int) -> torch.Tensor:
    """Where a pair's contextual term sits in ``z`` flattened per (sample, head) ``(L * nb)``: ``row * nb + bucket``,
    the row being the query for the key side and the key for the query side."""
    return bucket + (i if side == "k" else j) * nb


@bias_function("irpe_term_grad")  # named: the custom op of compiled training keeps the rule
def _irpe_term_grad(ds, start, stop, tensors, grads, *, parts: tuple[tuple[str, str], ...], center: int, num_offsets: int):
    """The gradient of :func:`_irpe_term` for query rows ``start:stop``, added in place to ``grads`` (the
    :attr:`IndexedBias.accumulate_grad` rule): each pair's logit gradient ``ds`` lands on the table entry (bias mode)
    or the ``z`` entry (contextual) that its term read, by one ``index_add`` per part and table."""
    codes, lut, *per_part = tensors
    pairs = LatticePairCodes(codes, center, num_offsets)
    bsz, heads, rows, length = ds.shape
    dev = ds.device
    b = torch.arange(codes.shape[0], device=dev).view(-1, 1, 1, 1)
    i = torch.arange(start, stop, device=dev).view(1, 1, -1, 1)
    j = torch.arange(length, device=dev).view(1, 1, 1, -1)
    for (mode, side), x, g in zip(parts, per_part, grads[2:]):
        if g is None:
            continue
        row, col = (i, j) if side == "k" else (j, i)
        ids = pairs.pair_ids(b, row, col)  # (B|1, 1, rows, L)
        for t in range(lut.shape[0]):
            bucket = _bucket_of(lut[t], ids)
            if mode == "bias":  # g: (H, nb); a shared table's rows are summed by prepare's expand
                d = ds.sum(0) if bucket.shape[0] == 1 else ds.transpose(0, 1)  # (H, [B,] rows, L), as bucket's order
                g.index_add_(1, bucket.reshape(-1), d.reshape(heads, -1).to(g.dtype))
            else:  # g: (B, H, L, nb), read at row * nb + bucket per (sample, head)
                flat = _flat_bucket(bucket, side, i, j, x.shape[-1]).expand(-1, 1, rows, length)
                gf, dsf = g.view(bsz, heads, -1), ds.to(g.dtype)
                for n in range(bsz):
                    gf[n].index_add_(1, flat[n if flat.shape[0] > 1 else 0].reshape(-1), dsf[n].reshape(heads, -1))


@bias_function("irpe_term_gather")  # named: the custom op of compiled training keeps the native kernels
def _irpe_term_gather(start, stop, length, tensors, *, parts: tuple[tuple[str, str], ...], center: int, num_offsets: int,
                      span: int = 0):
    """:func:`_irpe_term` for query rows ``start:stop`` as parts the native kernels read (the :attr:`IndexedBias.gather`
    rule): per part and table, the part's tensor at each pair's bucket -- a table ``(H, nb)``, or ``z (B, H, L, nb)``
    at the query's row (key side) or the key's (query side). ``span``: the lattice's offsets along its last axis (the
    kernels read each distinct row of buckets once per query)."""
    codes, lut, *_ = tensors
    ids = None  # the (key, query) pairs' offset ids, built only for a query-side part
    out = []
    for n, (_, side) in enumerate(parts):
        for t in range(lut.shape[0]):
            if side == "k":  # the bucket of each pair's offset, looked up by the kernels from the codes
                out.append((2 + n, OffsetIds(codes[:, start:stop], codes[:, :length], center, num_offsets, lut[t], span), False))
            else:  # read at the key's row: explicit buckets of the (key, query) pairs
                if ids is None:
                    dev = codes.device
                    b = torch.arange(codes.shape[0], device=dev).view(-1, 1, 1, 1)
                    i = torch.arange(start, stop, device=dev).view(1, 1, -1, 1)
                    j = torch.arange(length, device=dev).view(1, 1, 1, -1)
                    ids = LatticePairCodes(codes.int(), center, num_offsets).pair_ids(b, j, i)
                out.append((2 + n, _bucket_of(lut[t], ids)[:, 0], True))
    return out


@bias_function("irpe_prepare")  # named: compiled training runs the term as a custom op
def _irpe_prepare(codes, lut, *xs, heads: int, kinds: tuple[str, ...], scale: float) -> list[torch.Tensor]:
    """The tensors :func:`_irpe_term` reads from the :class:`IndexedBias` inputs: per part, bias mode its table for every
    head; contextual mode ``z = s x table`` ``(B, H, L, nb)``."""
    out, pos = [codes, lut], 0
    for kind in kinds:
        if kind == "bias":
            out.append(xs[pos].expand(heads, -1))  # a shared table reads as every head's
            pos += 1
        else:
            x, t = xs[pos], xs[pos + 1]
            # the scale on the small table, not on the (B, H, L, nb) product: no full-size pass (nor one in the backward)
            out.append(torch.matmul(x, t.to(x.dtype) * scale))  # (B, H, L, nb)
            pos += 2
    return out


def _expand_ids(ids: torch.Tensor, bsz: int, heads: int, length: int) -> torch.Tensor:
    """One table's map ``(L, L)`` or per-sample ``(B, L, L)`` as a ``(B, H, L, L)`` gather index (a view)."""
    return (ids if ids.ndim == 2 else ids[:, None]).expand(bsz, heads, length, length)


def _parse_sides(sides: str | Iterable[str]) -> tuple[str, ...]:
    items = tuple(sides) if not isinstance(sides, str) else tuple(sides.lower())
    bad = [c for c in items if c not in IRPE_SIDES]
    if bad or not items or len(set(items)) != len(items):
        raise ValueError(f"iRPE sides={sides!r} is not valid; use a non-empty combination of {list(IRPE_SIDES)} such as 'k', 'qk', 'qkv'")
    return tuple(c for c in IRPE_SIDES if c in items)


@register_encoding("irpe", groups=("scaling",))
class IRPE(AttentionBiasEncoding):
    """iRPE attention term (see the module docstring for the maths and paper/code choices).

    An attention bias: :meth:`bias` is the additive logit term; :meth:`attend` rebuilds it in the
    backward instead of keeping it, and adds the value-side term when ``'v'`` is among the sides.

    Args:
        mode: ``'contextual'`` (default) or ``'bias'``.
        method: ``'product'`` (default), ``'cross'``, ``'euclidean'`` or ``'quant'``.
        sides: where tables attach, any of ``'q'``, ``'k'``, ``'v'`` (default ``'k'``); bias mode
            allows ``'q'``/``'k'`` only.
        shared_head: one table shared by all heads (default) or one per head.
        ratio: ``r`` of the index function (``alpha = r, beta = 2r, gamma = 8r``), default 1.9.
        layers: block indices that get tables (default: all).
        init_std: 0 (default, released code) zero-initialises; otherwise truncated normal std.
    """

    grid_ndims = (2,)
    prefix_policy = "every pair involving a prefix token (cls/registers) uses one extra learned bucket per table"

    #: option rules, checked before __init__ (vispe._checks; see PositionalEncoding.option_checks)
    option_checks = {
        "mode": Choice(IRPE_MODES),
        "method": Choice(IRPE_METHODS),
        "sides": AnyOf(Str(), Seq(Choice(IRPE_SIDES), min_length=1)),
        "ratio": Real(0.5, 100),  # beta = 2r buckets per side: r >= 0.5 gives more than one, r <= 100 a table that fits
        "layers": Ints(0, min_length=0, distinct=True, optional=True),
        "init_std": Real(0, 1e3),
    }

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        depth: int,
        num_prefix_tokens: int = 1,
        mode: str = "contextual",
        method: str = "product",
        sides: str | Sequence[str] = "k",
        shared_head: bool = True,
        ratio: float = 1.9,
        layers: Sequence[int] | None = None,
        init_std: float = 0.0,
    ) -> None:
        super().__init__()
        if mode not in IRPE_MODES:
            raise ValueError(f"unknown iRPE mode {mode!r}; choose one of {list(IRPE_MODES)}")
        if method not in IRPE_METHODS:
            raise ValueError(f"unknown iRPE method {method!r}; choose one of {list(IRPE_METHODS)}")
        self.sides = _parse_sides(sides)
        if mode == "bias" and "v" in self.sides:
            raise ValueError("iRPE bias mode exists only for the query/key sides; use sides='k' or 'qk', or mode='contextual'")
        if not ratio > 0:
            raise ValueError(f"iRPE ratio r must be > 0, got {ratio}")
        if int(2 * ratio) < 1:
            raise ValueError(f"iRPE ratio r={ratio} gives beta_int = floor(2r) = 0 (a single bucket); use r >= 0.5")
        layers = tuple(range(depth)) if layers is None else tuple(int(i) for i in layers)
        bad = [i for i in layers if not 0 <= i < depth]
        if bad or len(set(layers)) != len(layers):
            raise ValueError(f"iRPE layers={layers} must be distinct block indices in [0, {depth})")
        self.mode, self.method, self.shared_head, self.ratio = mode, method, shared_head, float(ratio)
        self.num_heads, self.head_dim = num_heads, head_dim
        self.prefix_bucket = num_prefix_tokens > 0
        self.layers = layers
        self._slot = {layer: n for n, layer in enumerate(layers)}
        beta_int = int(2 * ratio)
        width = 2 * beta_int + 1
        per_table = (width * width if method == "product" else width) + (1 if self.prefix_bucket else 0)
        self.num_tables = 2 if method == "cross" else 1
        self.buckets_per_table = per_table
        nb = per_table * self.num_tables
        h = 1 if shared_head else num_heads
        n_layers = len(layers)
        for side in self.sides:
            if mode == "bias":
                shape = (n_layers, h, nb)
            elif side == "v":
                shape = (n_layers, h, nb, head_dim)
            else:
                shape = (n_layers, h, head_dim, nb)
            table = nn.Parameter(torch.zeros(shape))
            if init_std > 0:
                nn.init.trunc_normal_(table, std=init_std)
            self.register_parameter(f"table_{side}", table)

    # -- grid-dependent bucket maps ---------------------------------------------------------------
    def prepare(self, grid: PositionGrid, device: torch.device | None = None) -> IRPEState:
        self.check_grid(grid)
        return self.cached(("irpe", grid.shape, grid.num_prefix_tokens, str(device)), lambda: self._bucket_state(grid, device))

    def _bucket_state(self, grid: PositionGrid, device: torch.device | None) -> IRPEState:
        if grid.num_prefix_tokens and not self.prefix_bucket:
            raise ValueError(
                f"the sequence has {grid.num_prefix_tokens} prefix token(s) but this iRPE was built without a prefix bucket "
                f"(built for num_prefix_tokens=0)"
            )
        offsets = _lattice_offset_rows(grid, device)  # (U, 2)
        lut, n = offset_buckets(offsets[:, 0], offsets[:, 1], self.method, self.ratio)  # (T, U)
        per_table = self.buckets_per_table
        lut = F.pad(lut, (0, 1), value=n)  # the prefix bucket (unused without prefix tokens)
        lut = lut + torch.arange(lut.shape[0], device=lut.device)[:, None] * per_table
        return IRPEState(LatticePairCodes.of(grid, device), lut.contiguous(), per_table * lut.shape[0])

    def keep_tokens(self, state: IRPEState, grid: PositionGrid) -> IRPEState:
        return state.select(grid.sequence_index())

    # -- attention terms --------------------------------------------------------------------------
    @staticmethod
    def _gather(z: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``out[b, h, i, j] = sum_t z[b, h, i, ids[t, i, j]]`` (``z``: ``(B, H, L, nb)``)."""
        bsz, heads, length, _ = z.shape
        out = None
        for t in range(ids.shape[0]):
            term = torch.gather(z, -1, _expand_ids(ids[t], bsz, heads, length))
            out = term if out is None else out + term
        return out

    def _bias_term(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Bias mode: ``(1, H', L, L)`` from a ``(H', nb)`` table (``(B, H', n, n)`` for per-sample maps)."""
        out = None
        for t in range(ids.shape[0]):
            term = table[:, ids[t]]  # (H', L, L) or (H', B, n, n)
            out = term if out is None else out + term
        return out[None] if ids.ndim == 3 else out.transpose(0, 1)

    def _contextual_term(self, x: torch.Tensor, table: torch.Tensor, ids: torch.Tensor, scale: float, side: str) -> torch.Tensor:
        """Key side: ``(s q_i) . r_{b(i, j)}``; query side: ``(s k_j) . r_{b(j, i)}`` (key as the row, transposed)."""
        z = torch.matmul(x, table.to(x.dtype)) * scale  # (B, H, L, nb)
        out = self._gather(z, ids)
        return out if side == "k" else out.transpose(-1, -2)

    def _check_tokens(self, state: IRPEState, length: int) -> None:
        if state.num_tokens != length:
            raise ValueError(
                f"iRPE bucket map covers {state.num_tokens} tokens but attention got {length} "
                f"(patch dropout must narrow the maps through keep_tokens)"
            )

    def logit_sources(
        self, q: torch.Tensor, k: torch.Tensor, layer: int, state: IRPEState, scale: float
    ) -> tuple[list[torch.Tensor], Any] | None:
        """This layer's logit term as ``(inputs, fn)``: ``fn(*inputs)`` is the additive ``(B|1, H, L, L)`` term,
        built densely from the bucket maps (the oracle path; attention uses :meth:`indexed_bias`)."""
        slot = self._slot.get(layer)
        if slot is None:
            return None
        self._check_tokens(state, q.shape[-2])
        ids = state.ids
        inputs: list[torch.Tensor] = []
        parts: list[tuple[int, Any]] = []  # (number of inputs, fn of them)
        for side in ("k", "q"):
            if side not in self.sides:
                continue
            table = getattr(self, f"table_{side}")[slot]
            if self.mode == "bias":
                inputs.append(table)
                parts.append((1, lambda t, ids=(ids if side == "k" else ids.transpose(-1, -2)): self._bias_term(t, ids)))
            else:
                inputs += [q if side == "k" else k, table]
                parts.append((2, lambda x, t, side=side: self._contextual_term(x, t, ids, scale, side)))

        def term(*xs: torch.Tensor) -> torch.Tensor:
            out, pos = None, 0
            for n, part in parts:
                t = part(*xs[pos : pos + n])
                pos += n
                out = t if out is None else out + t
            return out

        return inputs, term

    def logit_term(self, q: torch.Tensor, k: torch.Tensor, layer: int, state: IRPEState, scale: float) -> torch.Tensor | None:
        """The additive logit term of this layer (already including the softmax scale ``s``), dense."""
        src = self.logit_sources(q, k, layer, state, scale)
        return None if src is None else src[1](*src[0])

    def bias(self, q: torch.Tensor, k: torch.Tensor, *, layer: int, state: IRPEState) -> torch.Tensor | None:
        return self.logit_term(q, k, layer, state, q.shape[-1] ** -0.5)

    def indexed_bias(self, q, k, *, layer: int, state: IRPEState, scale: float) -> IndexedBias | None:
        """The q/k-side term by index: bias mode reads ``table[h, bucket(i, j)]``; contextual mode reads
        ``z[b, h, i, bucket(i, j)]`` with ``z = s q table`` ``(B, H, L, buckets)``, rebuilt from q (k for the
        query side) and the table by the blocked path's backward, so nothing of size ``B x H x L`` is kept for it."""
        slot = self._slot.get(layer)
        if slot is None:
            return None
        self._check_tokens(state, q.shape[-2])
        heads = q.shape[1]
        parts, inputs, kinds = [], [state.pairs.codes, state.lut], []
        for side in ("k", "q"):
            if side not in self.sides:
                continue
            table = getattr(self, f"table_{side}")[slot]
            parts.append((self.mode, side))
            if self.mode == "bias":
                inputs.append(table)
            else:
                inputs += [q if side == "k" else k, table]
            kinds.append(self.mode)
        if not parts:
            return None
        prepare = functools.partial(_irpe_prepare, heads=heads, kinds=tuple(kinds), scale=scale)
        fn = functools.partial(_irpe_term, parts=tuple(parts), center=state.pairs.center, num_offsets=state.pairs.num_offsets)
        # 32-row tiles: with the default tiles FlexAttention's backward for the contextual term needs 240 KiB of
        # shared memory, more than an H100 has (227 KiB); 32 x 32 tiles ran at 1.62x timm's APE ViT (ViT-S/16, 224 px)
        tiles = {k: 32 for k in ("BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2")}
        grad = functools.partial(_irpe_term_grad, parts=tuple(parts), center=state.pairs.center,
                                 num_offsets=state.pairs.num_offsets)
        gather = functools.partial(_irpe_term_gather, parts=tuple(parts), center=state.pairs.center,
                                   num_offsets=state.pairs.num_offsets, span=state.pairs.span)
        return IndexedBias(fn, tuple(inputs), prepare, per_sample=self.mode == "contextual" or state.pairs.per_sample,
                           flex_kernel_options=tiles, accumulate_grad=grad, gather=gather)

    def attend(self, q, k, v, *, layer=0, state=None, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        if state is None or "v" not in self.sides or layer not in self._slot:
            return super().attend(q, k, v, layer=layer, state=state, attn_mask=attn_mask, dropout_p=dropout_p,
                                  is_causal=is_causal, scale=scale)
        s = scale if scale is not None else q.shape[-1] ** -0.5
        src = self.logit_sources(q, k, layer, state, s)
        mask = attn_mask if src is None else merge_attn_mask(attn_mask, src[1](*src[0]), q.dtype)
        slot = self._slot[layer]
        # value side: explicit attention, the probabilities are needed
        logits = torch.matmul(q, k.transpose(-1, -2)) * s
        if is_causal:
            mask = fold_causal_mask(q, k, mask)
        if mask is not None:
            logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask.to(logits.dtype)
        attn = logits.softmax(dim=-1)
        if dropout_p > 0:
            attn = F.dropout(attn, p=dropout_p)
        out = torch.matmul(attn, v)
        table_v = self.table_v[slot].to(attn.dtype)  # (H', nb, dh)
        bsz, heads, length, _ = attn.shape
        ids = state.ids
        weights = attn.new_zeros(bsz, heads, length, state.num_buckets)
        for t in range(ids.shape[0]):
            weights = weights.scatter_add(-1, _expand_ids(ids[t], bsz, heads, length), attn)
        return out + torch.matmul(weights, table_v)

    # -- misc -------------------------------------------------------------------------------------
    def no_weight_decay(self) -> set[str]:
        return {f"table_{side}" for side in self.sides}  # paper supplement: no decay on the tables

    def extra_repr(self) -> str:
        return (
            f"mode={self.mode!r}, method={self.method!r}, sides={''.join(self.sides)!r}, shared_head={self.shared_head}, "
            f"ratio={self.ratio}, buckets_per_table={self.buckets_per_table}, layers={len(self.layers)}"
        )
