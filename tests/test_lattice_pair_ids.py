"""The eager CPU pair ids of a block (one pass, prefix rows and columns filled in place) equal the generic
``where`` form in every layout attention reads them in: a block of query rows against all keys, the transposed
(query-side) read, one row, 0-d indices, with 0, 1 and 2 prefix tokens, and per-sample codes after patch dropout."""
from __future__ import annotations

import pytest
import torch

from vispe.encodings import PositionGrid
from vispe.encodings.lattice_bias import LatticePairCodes


def _where_ids(pc: LatticePairCodes, b, i, j) -> torch.Tensor:
    codes = pc.codes
    ci, cj = (codes[0][i], codes[0][j]) if codes.shape[0] == 1 else (codes[b, i], codes[b, j])
    return torch.where((ci < 0) | (cj < 0), pc.num_offsets, ci - cj + pc.center)


@pytest.mark.parametrize("prefix", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_block_pair_ids_equal_the_where_form(prefix, dtype):
    pc = LatticePairCodes.of(PositionGrid((3, 5), prefix))
    pc = LatticePairCodes(pc.codes.to(dtype), pc.center, pc.num_offsets)
    n = pc.codes.shape[1]
    b = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    keys = torch.arange(n).view(1, 1, 1, -1)
    layouts = []
    for start, stop in [(0, n), (0, 2), (1, 4), (n - 1, n)]:
        rows = torch.arange(start, stop).view(1, 1, -1, 1)
        layouts += [(rows, keys), (keys, rows)]  # key side (i, j) and query side (j, i)
    layouts += [(torch.tensor(0), torch.tensor(n - 1)), (torch.tensor(n - 1), torch.tensor(0))]  # score_mod's 0-d
    for i, j in layouts:
        got = pc.pair_ids(b, i, j)
        want = _where_ids(pc, b, i, j)
        assert got.shape == want.shape and torch.equal(got, want), (i.shape, j.shape)
    if prefix:  # prefix pairs read the zero column, in both orders
        ids = pc.pair_ids(b, torch.arange(n).view(1, 1, -1, 1), keys)[0, 0]
        assert (ids[:prefix] == pc.num_offsets).all() and (ids[:, :prefix] == pc.num_offsets).all()
        assert (ids[prefix:, prefix:] < pc.num_offsets).all()


def test_per_sample_codes_keep_the_where_form():
    grid = PositionGrid((3, 4), 1)
    pc = LatticePairCodes.of(grid)
    keep = torch.stack([torch.randperm(grid.num_patches, generator=torch.Generator().manual_seed(s))[:5] for s in (0, 1)])
    sel = pc.select(grid.with_keep(keep).sequence_index())
    b = torch.arange(2).view(-1, 1, 1, 1)
    i, j = torch.arange(6).view(1, 1, -1, 1), torch.arange(6).view(1, 1, 1, -1)
    assert torch.equal(sel.pair_ids(b, i, j), _where_ids(sel, b, i, j))
