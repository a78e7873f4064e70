"""Video needle-in-a-haystack (V-NIAH) episodes for a small video-LLM (synthetic analogue of the
protocol in the reference, section 7).

An episode is a haystack of ``F`` frames (procedurally generated "video": drifting blobs over a
slowly changing, low-saturation background, or windows of real clips decoded with decord), with
one *needle* frame inserted at depth ``d``: the needle becomes frame ``round(d * F)`` of the
``F + 1`` frames (``d = 0`` is the very start, ``d = 1`` the very end). The needle is a haystack
frame with a saturated square of one of four colours; the question is always the same
("what color is the needle ?") and the answer is a single token, the colour (chance 25 %).

Frames are turned into raw patch features ``(F + 1, H/p, W/p, p*p*3)`` (pixels scaled to
[-1, 1]); the video-LLM's projector maps them to its width. Everything is deterministic by seed.
"""
from __future__ import annotations

import math
import os
from typing import Any, Sequence

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

__all__ = [
    "NIAH_COLORS",
    "NIAHVocab",
    "procedural_haystack",
    "VideoHaystack",
    "insert_needle",
    "needle_index",
    "patchify",
    "NIAHDataset",
    "collate_niah",
    "NIAHDataModule",
]

#: answer colours (RGB) -- saturated, unlike the haystack
NIAH_COLORS: dict[str, tuple[int, int, int]] = {
    "red": (235, 25, 25),
    "green": (25, 210, 40),
    "blue": (30, 50, 240),
    "yellow": (240, 225, 20),
}
QUESTION = ("what", "color", "is", "the", "needle", "?")


class NIAHVocab:
    """The tiny word-level vocabulary of the episodes: ``<pad> <bos>``, the question words, the colours."""

    def __init__(self) -> None:
        self.tokens: list[str] = ["<pad>", "<bos>", *QUESTION, *NIAH_COLORS]
        self.index = {t: i for i, t in enumerate(self.tokens)}
        self.pad_id, self.bos_id = 0, 1

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, words: Sequence[str]) -> torch.Tensor:
        bad = [w for w in words if w not in self.index]
        if bad:
            raise ValueError(f"words {bad} are not in the NIAH vocabulary {self.tokens}")
        return torch.tensor([self.index[w] for w in words], dtype=torch.long)

    def question_ids(self) -> torch.Tensor:
        return self.encode(QUESTION)

    @property
    def answer_ids(self) -> torch.Tensor:
        """Token id of each colour, in :data:`NIAH_COLORS` order."""
        return self.encode(list(NIAH_COLORS))


def _reflect(x: np.ndarray) -> np.ndarray:
    """Fold positions into [0, 1] as a ball bouncing between the borders would move."""
    return 1.0 - np.abs(1.0 - np.mod(x, 2.0))


def procedural_haystack(num_frames: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 ``(T, size, size, 3)``: a low-saturation background gradient that drifts in time plus
    two grey blobs moving with constant velocity (bouncing), so consecutive frames are correlated."""
    if num_frames < 1 or size < 4:
        raise ValueError(f"need num_frames >= 1 and size >= 4, got {num_frames}, {size}")
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    angle, speed = rng.uniform(0, 2 * np.pi), rng.uniform(0.05, 0.2)
    tint = rng.uniform(-12, 12, size=3).astype(np.float32)  # low saturation
    base = rng.uniform(70, 150)
    pos0 = rng.uniform(0, 1, size=(2, 2)).astype(np.float32)
    vel = rng.uniform(-0.08, 0.08, size=(2, 2)).astype(np.float32)
    level = rng.uniform(-60, 60, size=2).astype(np.float32)
    radius = rng.uniform(0.12, 0.3, size=2).astype(np.float32)
    t = np.arange(num_frames, dtype=np.float32)
    wave = np.sin(2 * np.pi * (np.cos(angle) * xx + np.sin(angle) * yy)[None] + speed * t[:, None, None])
    frames = base + 30 * wave  # (T, S, S)
    pos = _reflect(pos0[None] + vel[None] * t[:, None, None])  # (T, blob, axis)
    for b in range(2):
        d2 = (yy[None] - pos[:, b, 0, None, None]) ** 2 + (xx[None] - pos[:, b, 1, None, None]) ** 2
        frames = frames + level[b] * np.exp(-d2 / (2 * radius[b] ** 2))
    return np.clip(frames[..., None] + tint, 0, 255).astype(np.uint8)


class VideoHaystack:
    """Haystack frames from real clips: every frame decoded once with decord, resized to ``size``,
    concatenated; episodes take random windows (tiled when a window is longer than the footage)."""

    def __init__(self, paths: Sequence[str | os.PathLike], size: int) -> None:
        from .video_io import read_video, resize_video

        if not paths:
            raise ValueError("VideoHaystack needs at least one video path")
        clips = [resize_video(read_video(p), (size, size), "center_crop") for p in paths]
        self.frames = torch.cat(clips).numpy()

    def clip(self, num_frames: int, rng: np.random.Generator) -> np.ndarray:
        n = self.frames.shape[0]
        start = int(rng.integers(n))
        idx = (start + np.arange(num_frames)) % n
        return self.frames[idx]


def needle_index(depth: float, num_frames: int) -> int:
    """Frame index of the needle among ``num_frames + 1`` frames for ``depth`` in [0, 1]."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    return int(round(depth * num_frames))


def insert_needle(haystack: np.ndarray, depth: float, color: str, rng: np.random.Generator, square: int | None = None) -> tuple[np.ndarray, int]:
    """Insert a needle frame into ``haystack`` (F frames) at ``depth``; returns ``(F + 1 frames, needle index)``.

    The needle frame is a copy of its neighbouring haystack frame with a saturated ``color`` square
    of side ``square`` (default ``size // 2``) in a random cell of a ``square``-aligned lattice, so
    with ``square = patch`` exactly one visual token carries the colour.
    """
    if color not in NIAH_COLORS:
        raise ValueError(f"needle colour {color!r} is not one of {list(NIAH_COLORS)}")
    F, size = haystack.shape[0], haystack.shape[1]
    k = needle_index(depth, F)
    needle = haystack[min(k, F - 1)].copy()
    s = square or max(2, size // 2)
    if size % s:
        raise ValueError(f"needle square {s} does not tile the frame size {size}")
    y, x = s * int(rng.integers(0, size // s)), s * int(rng.integers(0, size // s))
    needle[y : y + s, x : x + s] = NIAH_COLORS[color]
    return np.concatenate([haystack[:k], needle[None], haystack[k:]]), k


def patchify(frames: np.ndarray | torch.Tensor, patch: int) -> torch.Tensor:
    """uint8 ``(T, H, W, 3)`` -> float32 ``(T, H/p, W/p, p*p*3)`` in [-1, 1] (raw patch features)."""
    x = torch.as_tensor(frames)
    T, H, W, C = x.shape
    if H % patch or W % patch:
        raise ValueError(f"frame size {H}x{W} is not divisible by patch={patch}")
    x = x.reshape(T, H // patch, patch, W // patch, patch, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(T, H // patch, W // patch, patch * patch * C).float().div(127.5).sub(1.0)


class NIAHDataset(Dataset):
    """``num_episodes`` episodes of ``num_frames`` haystack frames + 1 needle.

    Args:
        depths: cycle through these depths (evaluation grid); ``None`` draws a uniform depth per
            episode (training).
        frame_size, patch: frames are ``frame_size``² pixels, cut into ``patch``² patches
            (``(frame_size / patch)²`` LLM tokens per frame).
        haystack: ``None`` (procedural) or a :class:`VideoHaystack`.
    """

    def __init__(
        self,
        num_episodes: int,
        num_frames: int,
        depths: Sequence[float] | None = None,
        frame_size: int = 8,
        patch: int = 4,
        seed: int = 0,
        haystack: VideoHaystack | None = None,
    ) -> None:
        if num_episodes < 1 or num_frames < 1:
            raise ValueError(f"num_episodes and num_frames must be >= 1, got {num_episodes}, {num_frames}")
        if frame_size % patch:
            raise ValueError(f"frame_size={frame_size} is not divisible by patch={patch}")
        if depths is not None:
            for d in depths:
                needle_index(d, num_frames)
        self.num_episodes, self.num_frames = num_episodes, num_frames
        self.depths = list(depths) if depths is not None else None
        self.frame_size, self.patch, self.seed, self.haystack = frame_size, patch, seed, haystack
        self.colors = list(NIAH_COLORS)

    def __len__(self) -> int:
        return self.num_episodes

    def frames(self, index: int) -> tuple[np.ndarray, dict[str, Any]]:
        """The episode's uint8 frames ``(F + 1, S, S, 3)`` and its metadata."""
        rng = np.random.default_rng([self.seed, self.num_frames, index])
        depth = self.depths[index % len(self.depths)] if self.depths else float(rng.uniform(0, 1))
        answer = int(rng.integers(len(self.colors)))
        if self.haystack is None:
            hay = procedural_haystack(self.num_frames, self.frame_size, rng)
        else:
            hay = self.haystack.clip(self.num_frames, rng)
        frames, k = insert_needle(hay, depth, self.colors[answer], rng, square=self.patch)
        return frames, {"answer": answer, "depth": float(depth), "needle_index": k}

    def __getitem__(self, index: int) -> dict[str, Any]:
        frames, meta = self.frames(index)
        return {"features": patchify(frames, self.patch), "num_frames": self.num_frames, **meta}


def collate_niah(items: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {
        "features": torch.stack([it["features"] for it in items]),
        "answer": torch.tensor([it["answer"] for it in items], dtype=torch.long),
        "depth": torch.tensor([it["depth"] for it in items], dtype=torch.float32),
        "needle_index": torch.tensor([it["needle_index"] for it in items], dtype=torch.long),
        "num_frames": int(items[0]["num_frames"]),
    }


class NIAHDataModule(L.LightningDataModule):
    """Train at one haystack length (random depths); validate/test on a grid of lengths x depths.

    ``val_dataloader`` returns one loader per length in ``eval_lengths``; each holds
    ``episodes_per_cell`` episodes for every depth of ``eval_depths``.
    """

    def __init__(
        self,
        train_frames: int = 16,
        train_episodes: int = 8192,
        eval_lengths: Sequence[int] = (8, 16, 32, 64, 128),
        eval_depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
        episodes_per_cell: int = 32,
        frame_size: int = 8,
        patch: int = 4,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        haystack_videos: Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if frame_size % patch:
            raise ValueError(f"frame_size={frame_size} is not divisible by patch={patch}")
        for d in eval_depths:
            if not 0.0 <= d <= 1.0:
                raise ValueError(f"eval depth {d} is outside [0, 1]")
        if any(int(n) < 1 for n in (train_frames, *eval_lengths)):
            raise ValueError(f"haystack lengths must be >= 1, got train_frames={train_frames}, eval_lengths={list(eval_lengths)}")
        self.train_frames, self.train_episodes = train_frames, train_episodes
        self.eval_lengths, self.eval_depths = [int(n) for n in eval_lengths], [float(d) for d in eval_depths]
        self.episodes_per_cell = episodes_per_cell
        self.frame_size, self.patch = frame_size, patch
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or batch_size
        self.num_workers, self.seed = num_workers, seed
        self.haystack_videos = list(haystack_videos) if haystack_videos else None
        self._haystack: VideoHaystack | None = None

    @property
    def visual_dim(self) -> int:
        return self.patch * self.patch * 3

    @property
    def tokens_per_frame(self) -> int:
        return (self.frame_size // self.patch) ** 2

    def setup(self, stage: str | None = None) -> None:
        if self.haystack_videos and self._haystack is None:
            self._haystack = VideoHaystack(self.haystack_videos, self.frame_size)

    def _loader(self, ds: Dataset, shuffle: bool, batch_size: int) -> DataLoader:
        return DataLoader(ds, batch_size=batch_size, shuffle=shuffle, num_workers=self.num_workers, collate_fn=collate_niah)

    def train_dataloader(self) -> DataLoader:
        ds = NIAHDataset(self.train_episodes, self.train_frames, None, self.frame_size, self.patch, self.seed, self._haystack)
        return self._loader(ds, True, self.batch_size)

    def _eval_loaders(self, seed_offset: int) -> list[DataLoader]:
        n = self.episodes_per_cell * len(self.eval_depths)
        return [
            self._loader(
                NIAHDataset(n, f, self.eval_depths, self.frame_size, self.patch, self.seed + seed_offset, self._haystack),
                False, self.eval_batch_size,
            )
            for f in self.eval_lengths
        ]

    def val_dataloader(self) -> list[DataLoader]:
        return self._eval_loaders(1_000_003)

    def test_dataloader(self) -> list[DataLoader]:
        return self._eval_loaders(2_000_003)

    @property
    def chance(self) -> float:
        return 100.0 / len(NIAH_COLORS)

    def max_ratio(self) -> float:
        return max(self.eval_lengths) / self.train_frames if self.eval_lengths else math.nan
