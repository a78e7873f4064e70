"""The Three Cell Experiment data (LOOPE, Chowdhury et al. 2025): a reference generator.

A grid of flat square cells with three coloured ones (R, G, B; distinct, never colinear); the 6-bit
multi-label target (distance, orientation, area, vector sum) can only be read from where the coloured
patches are. Reproducible per ``(seed, index)``; split 80/10/10 by index. Coordinates, label formulas,
the paper's ambiguities and the generation algorithm: ``docs/design/three-cell-data.md``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

try:  # Lightning is a hard dependency of vispe, but keep the generator importable without it
    from lightning.pytorch import LightningDataModule
except ImportError:  # pragma: no cover
    LightningDataModule = object  # type: ignore[assignment,misc]

__all__ = [
    "LABEL_NAMES",
    "LABEL_GROUPS",
    "MODES",
    "VECTOR_SUM_READINGS",
    "SPLITS",
    "ThreeCellSamples",
    "offset_table",
    "three_cell_labels",
    "sample_three_cell",
    "generate_three_cell",
    "render_three_cell",
    "save_npz",
    "load_npz",
    "ThreeCellDataset",
    "ThreeCellDataModule",
]

LABEL_NAMES: tuple[str, ...] = ("dist_rg_gt_rb", "dist_rb_gt_rg", "orientation", "area_rg_gt_rb", "area_rb_gt_rg", "vector_sum")
#: label indices of each group scored by the paper (accuracy of a group = mean bit accuracy)
LABEL_GROUPS: dict[str, tuple[int, ...]] = {
    "distance": (0, 1),
    "orientation": (2,),
    "area": (3, 4),
    "vector_sum": (5,),
}
#: 1 = equal distances, 2 = G nearer than B, 3 = G farther than B
MODES: tuple[int, ...] = (1, 2, 3)
VECTOR_SUM_READINGS: tuple[str, ...] = ("and", "or")
SPLITS: tuple[str, ...] = ("train", "val", "test")
#: RGB of the three cells (float, 0..1): red reference, green, blue
CELL_COLORS: tuple[tuple[float, float, float], ...] = ((1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0))

_MAX_TRIES = 100_000


def _grid_hw(grid_size: int | Sequence[int]) -> tuple[int, int]:
    if isinstance(grid_size, int):
        grid_size = (grid_size, grid_size)
    hw = tuple(int(g) for g in grid_size)
    if len(hw) != 2 or min(hw) < 2:
        raise ValueError(f"grid_size must be an int or (rows, cols) with both >= 2, got {grid_size!r}")
    return hw  # type: ignore[return-value]


def _check_reading(vector_sum: str) -> None:
    if vector_sum not in VECTOR_SUM_READINGS:
        raise ValueError(f"vector_sum={vector_sum!r} is not valid; choose one of {list(VECTOR_SUM_READINGS)}")


def default_max_sq_distance(grid_size: int | Sequence[int]) -> int:
    """``L = (H-1)^2 + (W-1)^2``: 338 for the paper's 14 x 14 grid."""
    h, w = _grid_hw(grid_size)
    return (h - 1) ** 2 + (w - 1) ** 2


def offset_table(max_sq_distance: int = 338) -> dict[int, list[tuple[int, int]]]:
    """Sum-of-squares table: ``n -> [(a, b), ...]`` with ``a^2 + b^2 = n``, ``0 < n <= L``.

    Keys with a single representation are dropped (the supplement's rule; with signed offsets
    every key has at least four, so the rule never fires, but it is kept as written).
    """
    if int(max_sq_distance) < 1:
        raise ValueError(f"max_sq_distance must be >= 1, got {max_sq_distance!r}")
    limit = int(max_sq_distance)
    bound = math.isqrt(limit)
    table: dict[int, list[tuple[int, int]]] = {}
    for a in range(-bound, bound + 1):
        for b in range(-bound, bound + 1):
            n = a * a + b * b
            if 0 < n <= limit:
                table.setdefault(n, []).append((a, b))
    return {n: pairs for n, pairs in sorted(table.items()) if len(pairs) > 1}


def three_cell_labels(
    red: Sequence[int], green: Sequence[int], blue: Sequence[int], grid_size: int | Sequence[int] = 14, vector_sum: str = "and"
) -> np.ndarray:
    """The 6-bit target of one triple of ``(x, y)`` cells (see the module docstring)."""
    _check_reading(vector_sum)
    h, w = _grid_hw(grid_size)
    (xr, yr), (xg, yg), (xb, yb) = red, green, blue
    d_rg = (xg - xr) ** 2 + (yg - yr) ** 2
    d_rb = (xb - xr) ** 2 + (yb - yr) ** 2
    cross = (xg - xr) * (yb - yr) - (yg - yr) * (xb - xr)
    # twice the trapezium areas: the comparison does not need the 1/2
    a_rg = abs((yr + yg) * (xg - xr))
    a_rb = abs((yr + yb) * (xb - xr))
    sx, sy = xr + xg + xb, yr + yg + yb
    over_x, over_y = sx > w - 1, sy > h - 1
    vsum = (over_x and over_y) if vector_sum == "and" else (over_x or over_y)
    return np.array([d_rg > d_rb, d_rb > d_rg, cross > 0, a_rg > a_rb, a_rb > a_rg, vsum], dtype=np.uint8)


def _two_distinct(rng: np.random.Generator, n: int) -> tuple[int, int]:
    """Two different indices in ``range(n)``, uniform over ordered pairs."""
    i = int(rng.integers(n))
    j = int(rng.integers(n - 1))
    return i, j + (j >= i)


def sample_three_cell(
    rng: np.random.Generator,
    grid_size: int | Sequence[int] = 14,
    table: dict[int, list[tuple[int, int]]] | None = None,
) -> tuple[int, np.ndarray]:
    """Draw one configuration: ``(mode, cells)`` with ``cells`` int (3, 2) rows R, G, B as ``(x, y)``."""
    h, w = _grid_hw(grid_size)
    if table is None:
        table = offset_table(default_max_sq_distance((h, w)))
    keys = list(table)
    if len(keys) < 2:
        raise ValueError(f"the offset table has {len(keys)} keys; modes 2 and 3 need at least two (raise max_sq_distance)")
    mode = int(rng.integers(1, 4))
    xr, yr = int(rng.integers(0, w)), int(rng.integers(0, h))
    for _ in range(_MAX_TRIES):
        if mode == 1:
            pairs = table[keys[int(rng.integers(len(keys)))]]
            i, j = _two_distinct(rng, len(pairs))
            og, ob = pairs[i], pairs[j]
        else:
            k_small, k_large = sorted(_two_distinct(rng, len(keys)))
            near, far = table[keys[k_small]], table[keys[k_large]]
            o_near = near[int(rng.integers(len(near)))]
            o_far = far[int(rng.integers(len(far)))]
            og, ob = (o_near, o_far) if mode == 2 else (o_far, o_near)
        xg, yg = xr + og[0], yr + og[1]
        xb, yb = xr + ob[0], yr + ob[1]
        if not (0 <= xg < w and 0 <= yg < h and 0 <= xb < w and 0 <= yb < h):
            continue
        if (xg, yg) == (xb, yb):
            continue
        if og[0] * ob[1] - og[1] * ob[0] == 0:  # colinear (includes G == B)
            continue
        return mode, np.array([[xr, yr], [xg, yg], [xb, yb]], dtype=np.int64)
    raise RuntimeError(f"no valid three-cell configuration found for mode {mode} at R=({xr}, {yr}) on a {h}x{w} grid")


@dataclass
class ThreeCellSamples:
    """A generated set: cell coordinates ``(n, 3, 2)`` as ``(x, y)`` for R, G, B; modes; 6-bit labels."""

    cells: np.ndarray  # int16 (n, 3, 2)
    modes: np.ndarray  # int8 (n,)
    labels: np.ndarray  # uint8 (n, 6)
    grid_size: tuple[int, int]
    seed: int
    vector_sum: str
    max_sq_distance: int

    def __len__(self) -> int:
        return int(self.cells.shape[0])

    def subset(self, start: int, stop: int) -> "ThreeCellSamples":
        return ThreeCellSamples(
            self.cells[start:stop], self.modes[start:stop], self.labels[start:stop],
            self.grid_size, self.seed, self.vector_sum, self.max_sq_distance,
        )


def generate_three_cell(
    num_samples: int = 10_000,
    grid_size: int | Sequence[int] = 14,
    seed: int = 0,
    vector_sum: str = "and",
    max_sq_distance: int | None = None,
    start: int = 0,
) -> ThreeCellSamples:
    """Samples ``start .. start + num_samples - 1``; sample ``i`` is drawn from ``default_rng([seed, i])``."""
    if int(num_samples) < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples!r}")
    _check_reading(vector_sum)
    hw = _grid_hw(grid_size)
    limit = default_max_sq_distance(hw) if max_sq_distance is None else int(max_sq_distance)
    table = offset_table(limit)
    n = int(num_samples)
    cells = np.zeros((n, 3, 2), dtype=np.int16)
    modes = np.zeros((n,), dtype=np.int8)
    labels = np.zeros((n, 6), dtype=np.uint8)
    for k in range(n):
        rng = np.random.default_rng([int(seed), start + k])
        mode, c = sample_three_cell(rng, hw, table)
        cells[k], modes[k] = c, mode
        labels[k] = three_cell_labels(c[0], c[1], c[2], hw, vector_sum)
    return ThreeCellSamples(cells, modes, labels, hw, int(seed), vector_sum, limit)


def render_three_cell(cells: np.ndarray | torch.Tensor, grid_size: int | Sequence[int] = 14, cell_size: int = 16) -> torch.Tensor:
    """Float image(s) in [0, 1]: ``(3, H*c, W*c)`` for cells ``(3, 2)``, ``(B, 3, H*c, W*c)`` for ``(B, 3, 2)``."""
    if int(cell_size) < 1:
        raise ValueError(f"cell_size must be >= 1 pixel, got {cell_size!r}")
    h, w = _grid_hw(grid_size)
    c = torch.as_tensor(np.asarray(cells), dtype=torch.long)
    single = c.ndim == 2
    if single:
        c = c[None]
    if c.ndim != 3 or tuple(c.shape[1:]) != (3, 2):
        raise ValueError(f"cells must have shape (3, 2) or (B, 3, 2), got {tuple(c.shape)}")
    b = c.shape[0]
    img = torch.zeros(b, 3, h, w)
    rows = torch.arange(b)
    for slot, color in enumerate(CELL_COLORS):
        img[rows, :, c[:, slot, 1], c[:, slot, 0]] = torch.tensor(color)
    if cell_size > 1:
        img = img.repeat_interleave(cell_size, dim=2).repeat_interleave(cell_size, dim=3)
    return img[0] if single else img


def save_npz(samples: ThreeCellSamples, path: str | Path) -> Path:
    """Write the compact format (coordinates, modes, labels, metadata) to ``path`` (.npz)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        path, cells=samples.cells, modes=samples.modes, labels=samples.labels,
        grid_size=np.array(samples.grid_size), seed=np.array(samples.seed),
        vector_sum=np.array(samples.vector_sum), max_sq_distance=np.array(samples.max_sq_distance),
    )
    return path


def load_npz(path: str | Path) -> ThreeCellSamples:
    """Samples written by :func:`save_npz` (no pickles: ``allow_pickle=False``); a damaged file is named."""
    from ..files import DamagedFileError, check_zip

    check_zip(path, "Three Cell samples file (.npz)")
    with np.load(Path(path), allow_pickle=False) as npz:
        try:
            f = {k: npz[k] for k in npz.files}
        except ValueError as err:  # object arrays: numpy refuses to unpickle them, without naming the file
            raise DamagedFileError(path, f"holds pickled Python objects ({err}); Three Cell files hold plain arrays only", "generate it again") from None
    missing = [k for k in ("cells", "modes", "labels", "grid_size", "seed", "vector_sum", "max_sq_distance") if k not in f]
    if missing:
        raise DamagedFileError(path, f"lacks the arrays {missing} of a Three Cell samples file", "generate it again (generate_three_cell / save_npz)")
    return ThreeCellSamples(
        f["cells"], f["modes"], f["labels"], tuple(int(g) for g in f["grid_size"]),  # type: ignore[arg-type]
        int(f["seed"]), str(f["vector_sum"]), int(f["max_sq_distance"]),
    )


def split_bounds(num_samples: int, split: str, fractions: Sequence[float] = (0.8, 0.1, 0.1)) -> tuple[int, int]:
    """Index range of ``split`` (train first, then val, then test)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not valid; choose one of {list(SPLITS)}")
    if len(fractions) != 3 or any(f < 0 for f in fractions) or abs(sum(fractions) - 1.0) > 1e-6:
        raise ValueError(f"split fractions must be three non-negative numbers summing to 1, got {tuple(fractions)}")
    n_train = int(round(num_samples * fractions[0]))
    n_val = int(round(num_samples * fractions[1]))
    bounds = {"train": (0, n_train), "val": (n_train, n_train + n_val), "test": (n_train + n_val, num_samples)}
    return bounds[split]


class ThreeCellDataset(Dataset):
    """``(image, target)`` pairs of one split; images are rendered on the fly.

    Args:
        split: 'train' | 'val' | 'test' (80/10/10 of ``num_samples`` by index).
        num_samples: size of the whole dataset (10,000 in the paper).
        grid_size: cells per side (14 in the paper), int or (rows, cols).
        cell_size: pixels per cell; use it as the ViT patch size (16 in the paper, 2-4 on a CPU).
        seed: generation seed.
        vector_sum: 'and' | 'or' reading of the vector-sum bit.
        path: optional .npz file (see ``save_npz``); loaded instead of generating when it exists.
        samples: an already generated :class:`ThreeCellSamples` of the whole dataset (shared by splits).
    """

    def __init__(
        self,
        split: str = "train",
        num_samples: int = 10_000,
        grid_size: int | Sequence[int] = 14,
        cell_size: int = 16,
        seed: int = 0,
        vector_sum: str = "and",
        max_sq_distance: int | None = None,
        path: str | Path | None = None,
        samples: ThreeCellSamples | None = None,
        fractions: Sequence[float] = (0.8, 0.1, 0.1),
    ) -> None:
        if int(cell_size) < 1:
            raise ValueError(f"cell_size must be >= 1 pixel, got {cell_size!r}")
        if samples is None:
            if path is not None and Path(path).exists():
                samples = load_npz(path)
            else:
                samples = generate_three_cell(num_samples, grid_size, seed, vector_sum, max_sq_distance)
                if path is not None:
                    save_npz(samples, path)
        start, stop = split_bounds(len(samples), split, fractions)
        self.split = split
        self.samples = samples.subset(start, stop)
        self.grid_size = samples.grid_size
        self.cell_size = int(cell_size)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = render_three_cell(self.samples.cells[index], self.grid_size, self.cell_size)
        target = torch.from_numpy(self.samples.labels[index].astype(np.float32))
        return image, target


class ThreeCellDataModule(LightningDataModule):
    """Train / val / test loaders of one generated Three Cell dataset (no augmentation: every
    geometric transform would change the labels)."""

    def __init__(
        self,
        num_samples: int = 10_000,
        grid_size: int | Sequence[int] = 14,
        cell_size: int = 16,
        seed: int = 0,
        vector_sum: str = "and",
        max_sq_distance: int | None = None,
        path: str | None = None,
        batch_size: int = 64,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        _check_reading(vector_sum)
        _grid_hw(grid_size)
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        self.save_hyperparameters()
        self.num_samples, self.grid_size, self.cell_size, self.seed = num_samples, grid_size, cell_size, seed
        self.vector_sum, self.max_sq_distance, self.path = vector_sum, max_sq_distance, path
        self.batch_size, self.eval_batch_size = int(batch_size), int(eval_batch_size or batch_size)
        self.num_workers = num_workers
        self._data: dict[str, ThreeCellDataset] = {}

    @property
    def image_size(self) -> tuple[int, int]:
        h, w = _grid_hw(self.grid_size)
        return h * self.cell_size, w * self.cell_size

    def setup(self, stage: str | None = None) -> None:
        if self._data:
            return
        path = Path(self.path) if self.path else None
        if path is not None and path.exists():
            samples = load_npz(path)
        else:
            samples = generate_three_cell(self.num_samples, self.grid_size, self.seed, self.vector_sum, self.max_sq_distance)
            if path is not None:
                save_npz(samples, path)
        for split in SPLITS:
            self._data[split] = ThreeCellDataset(split, cell_size=self.cell_size, samples=samples)

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        self.setup()
        bs = self.batch_size if split == "train" else self.eval_batch_size
        return DataLoader(
            self._data[split], batch_size=bs, shuffle=shuffle, num_workers=self.num_workers,
            drop_last=shuffle and len(self._data[split]) > bs, persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", False)
