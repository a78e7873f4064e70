"""Three Cell generator: labels vs an independent recomputation from the rendered pixels,
geometry constraints, mode balance, determinism, splits, bad input."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vispe.data.three_cell import (
    LABEL_GROUPS,
    ThreeCellDataModule,
    ThreeCellDataset,
    generate_three_cell,
    load_npz,
    offset_table,
    render_three_cell,
    save_npz,
    split_bounds,
)

GRID = 14
N = 3000


@pytest.fixture(scope="module")
def samples():
    return generate_three_cell(N, GRID, seed=123)


def _decode(image: torch.Tensor, cell: int) -> dict[str, tuple[int, int]]:
    """(x=column, y=row) of the red, green and blue cells, read back from the pixels."""
    out = {}
    for ch, name in enumerate(("red", "green", "blue")):
        ys, xs = torch.nonzero(image[ch] > 0.5, as_tuple=True)
        assert len(ys) == cell * cell, f"{name} cell must cover exactly one {cell}x{cell} cell"
        assert (ys // cell).unique().numel() == 1 and (xs // cell).unique().numel() == 1
        out[name] = (int(xs[0]) // cell, int(ys[0]) // cell)
    return out


def _naive_labels(r, g, b, grid, reading):
    """The paper's formulas written out directly (floats, the 1/2 kept, math.dist)."""
    d_rg, d_rb = math.dist(r, g), math.dist(r, b)
    delta = (g[0] - r[0]) * (b[1] - r[1]) - (g[1] - r[1]) * (b[0] - r[0])
    area_rg = 0.5 * abs((r[1] + g[1]) * (g[0] - r[0]))
    area_rb = 0.5 * abs((r[1] + b[1]) * (b[0] - r[0]))
    sx, sy = r[0] + g[0] + b[0], r[1] + g[1] + b[1]
    ref = grid - 1
    vs = (sx > ref and sy > ref) if reading == "and" else (sx > ref or sy > ref)
    return [int(d_rg > d_rb + 1e-9), int(d_rb > d_rg + 1e-9), int(delta > 0), int(area_rg > area_rb), int(area_rb > area_rg), int(vs)]


def test_offset_table_matches_brute_force():
    table = offset_table(338)
    brute: dict[int, set] = {}
    for a in range(-20, 21):
        for b in range(-20, 21):
            if 0 < a * a + b * b <= 338:
                brute.setdefault(a * a + b * b, set()).add((a, b))
    assert set(table) == {n for n, reps in brute.items() if len(reps) > 1}
    for n, pairs in table.items():
        assert set(pairs) == brute[n]
    assert max(table) == 338 and (13, 13) in table[338] and (7, 17) in table[338]


@pytest.mark.parametrize("reading", ["and", "or"])
@pytest.mark.slow
def test_labels_agree_with_pixels_and_direct_formulas(samples, reading):
    cell = 2
    labels = samples.labels if reading == "and" else generate_three_cell(N, GRID, seed=123, vector_sum="or").labels
    images = render_three_cell(samples.cells, GRID, cell)
    for k in range(N):
        pos = _decode(images[k], cell)
        assert _naive_labels(pos["red"], pos["green"], pos["blue"], GRID, reading) == labels[k].tolist(), k


def test_geometry_constraints(samples):
    c = samples.cells.astype(np.int64)
    assert c.min() >= 0 and c.max() < GRID
    r, g, b = c[:, 0], c[:, 1], c[:, 2]
    assert (np.abs(r - g).sum(1) > 0).all() and (np.abs(r - b).sum(1) > 0).all() and (np.abs(g - b).sum(1) > 0).all()
    cross = (g[:, 0] - r[:, 0]) * (b[:, 1] - r[:, 1]) - (g[:, 1] - r[:, 1]) * (b[:, 0] - r[:, 0])
    assert (cross != 0).all(), "colinear triple generated"
    d_rg, d_rb = ((g - r) ** 2).sum(1), ((b - r) ** 2).sum(1)
    assert d_rg.max() <= 338 and d_rb.max() <= 338
    m = samples.modes
    assert (d_rg[m == 1] == d_rb[m == 1]).all()
    assert (d_rg[m == 2] < d_rb[m == 2]).all()
    assert (d_rg[m == 3] > d_rb[m == 3]).all()


def test_modes_equiprobable_and_reference_uniform(samples):
    counts = np.bincount(samples.modes, minlength=4)[1:]
    sigma = math.sqrt(N * (1 / 3) * (2 / 3))
    assert np.all(np.abs(counts - N / 3) < 4 * sigma), counts
    # the distance bits follow the modes exactly: 1/3 each of (0,0), (0,1), (1,0)
    d = samples.labels[:, list(LABEL_GROUPS["distance"])]
    assert ((d.sum(1) == 0) == (samples.modes == 1)).all()
    # the reference cell is uniform over the grid (chi-square on 196 cells, generous bound)
    rx = samples.cells[:, 0, 0].astype(int) + GRID * samples.cells[:, 0, 1].astype(int)
    obs = np.bincount(rx, minlength=GRID * GRID)
    chi2 = ((obs - N / GRID**2) ** 2 / (N / GRID**2)).sum()
    assert chi2 < 195 + 6 * math.sqrt(2 * 195)


def test_same_seed_same_dataset_and_disk_roundtrip(samples, tmp_path):
    again = generate_three_cell(N, GRID, seed=123)
    assert np.array_equal(again.cells, samples.cells) and np.array_equal(again.labels, samples.labels)
    other = generate_three_cell(200, GRID, seed=124)
    assert not np.array_equal(other.cells, samples.cells[:200])
    # sample i depends on (seed, i) only: a shifted window reproduces the same samples
    window = generate_three_cell(50, GRID, seed=123, start=1000)
    assert np.array_equal(window.cells, samples.cells[1000:1050])
    path = save_npz(samples, tmp_path / "tc.npz")
    loaded = load_npz(path)
    assert np.array_equal(loaded.cells, samples.cells) and np.array_equal(loaded.labels, samples.labels)
    assert loaded.grid_size == (GRID, GRID) and loaded.seed == 123 and loaded.max_sq_distance == 338


def test_splits_and_dataset_items(samples):
    assert split_bounds(10_000, "train") == (0, 8000)
    assert split_bounds(10_000, "val") == (8000, 9000)
    assert split_bounds(10_000, "test") == (9000, 10_000)
    parts = [ThreeCellDataset(s, cell_size=3, samples=samples) for s in ("train", "val", "test")]
    assert [len(p) for p in parts] == [2400, 300, 300]
    image, target = parts[2][0]
    assert image.shape == (3, GRID * 3, GRID * 3) and target.shape == (6,) and target.dtype == torch.float32
    assert np.array_equal(parts[2].samples.cells[0], samples.cells[2700])
    # black background, three flat cells
    assert int((image.sum(0) > 0).sum()) == 3 * 9 and set(image.unique().tolist()) == {0.0, 1.0}


def test_datamodule_batches():
    dm = ThreeCellDataModule(num_samples=100, grid_size=8, cell_size=2, batch_size=16, seed=1)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (16, 3, 16, 16) and y.shape == (16, 6)
    assert len(dm.test_dataloader().dataset) == 10


@pytest.mark.parametrize(
    "kwargs",
    [dict(vector_sum="xor"), dict(grid_size=1), dict(grid_size=(14, 14, 2)), dict(num_samples=-1)],
)
def test_bad_generation_arguments(kwargs):
    with pytest.raises(ValueError):
        generate_three_cell(**{"num_samples": 10, **kwargs})


def test_bad_split_and_cell_size(samples):
    with pytest.raises(ValueError, match="split"):
        ThreeCellDataset("dev", samples=samples)
    with pytest.raises(ValueError, match="cell_size"):
        ThreeCellDataset("train", cell_size=0, samples=samples)
