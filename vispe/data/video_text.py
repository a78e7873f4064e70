"""Video-text datasets and LightningDataModules: real manifests and the generated "where and when" set.

Bad files: a missing or undecodable video raises :class:`VideoReadError` naming the file
(``on_error='raise'``), or is skipped (``on_error='skip'``): :func:`collate_video_text` drops it,
keeps the rest of the batch and reports ``num_skipped`` / ``skipped`` in the batch.

The pieces live by job: :mod:`vispe.data.video_io` (files, decoding), :mod:`vispe.data.video_scenes`
(the generated set), :mod:`vispe.data.video_manifest` (real manifests); their public names are
re-exported here.
"""
from __future__ import annotations

import math
import numbers
import os
import random
import tempfile
from pathlib import Path
from typing import Any, Sequence

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from .._checks import check_choice
from .video_io import CODECS, IMAGENET_MEAN, IMAGENET_STD, VideoReadError, read_video, resize_video, sample_frame_indices, to_model_input, write_video
from .video_manifest import VideoTextRecord, load_manifest
from .video_scenes import (  # noqa: F401  (re-exported)
    BACKGROUND,
    COLORS,
    EVENT_KINDS,
    SHAPES,
    Event,
    SyntheticVideoTextSpec,
    caption_for,
    cell_box,
    cell_name,
    event_segments,
    events_from_record,
    generate_video_text_set,
    position_free_r1,
    render_events,
    sample_events,
)

__all__ = [
    "COLORS",
    "SHAPES",
    "CODECS",
    "Event",
    "VideoReadError",
    "VideoTextRecord",
    "SyntheticVideoTextSpec",
    "cell_name",
    "caption_for",
    "sample_events",
    "event_segments",
    "cell_box",
    "events_from_record",
    "position_free_r1",
    "resize_video",
    "to_model_input",
    "render_events",
    "write_video",
    "read_video",
    "sample_frame_indices",
    "generate_video_text_set",
    "load_manifest",
    "VideoTextDataset",
    "collate_video_text",
    "VideoTextDataModule",
    "SyntheticVideoTextDataModule",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
]

ON_ERROR = ("raise", "skip")
CAPTION_MODES = ("first", "random", "all")


# ---------------------------------------------------------------------------------------------
# Dataset, collate, DataModules
# ---------------------------------------------------------------------------------------------


class VideoTextDataset(Dataset):
    """Clips + captions: items are ``{'video': float (3, T, H, W), 'captions': [str], 'caption': str, 'index', 'path'}``.

    Args:
        records: from :func:`load_manifest` (or a manifest path).
        num_frames / size: frames sampled per clip and output size ``(h, w)``.
        sampling: 'uniform' (eval) or 'random' (one random frame per segment, for training).
        caption_mode: 'first', 'random' (a random caption per epoch) or 'all' (every caption;
            the collate function then flattens them with a caption -> video map).
        on_error: 'raise' (:class:`VideoReadError` naming the file) or 'skip' (the item is
            ``None``; :func:`collate_video_text` drops and counts it).
        cache: keep decoded uint8 clips in memory (small generated sets).
    """

    def __init__(
        self,
        records: Sequence[VideoTextRecord] | str | os.PathLike,
        num_frames: int = 8,
        size: tuple[int, int] | int = (32, 32),
        sampling: str = "uniform",
        caption_mode: str = "first",
        on_error: str = "raise",
        resize_mode: str = "center_crop",
        cache: bool = False,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        seed: int = 0,
    ) -> None:
        check_choice("on_error", on_error, ON_ERROR)
        check_choice("caption_mode", caption_mode, CAPTION_MODES)
        check_choice("sampling", sampling, ("uniform", "random"))
        check_choice("resize_mode", resize_mode, ("center_crop", "squash"))
        if num_frames < 1:
            raise ValueError(f"num_frames must be >= 1, got {num_frames}")
        self.records = load_manifest(records) if isinstance(records, (str, os.PathLike)) else list(records)
        self.num_frames = num_frames
        self.size = (size, size) if isinstance(size, int) else tuple(size)
        self.sampling, self.caption_mode, self.on_error, self.resize_mode = sampling, caption_mode, on_error, resize_mode
        self.cache = cache and sampling == "uniform"
        self._cache: dict[int, torch.Tensor] = {}
        self.mean, self.std = tuple(mean), tuple(std)
        self.seed = seed
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.records)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def load_frames(self, index: int) -> torch.Tensor:
        if self.cache and index in self._cache:
            return self._cache[index]
        rng = random.Random(hash((self.seed, self.epoch, index)))
        frames = read_video(self.records[index].video, self.num_frames, sampling=self.sampling, rng=rng)
        frames = resize_video(frames, self.size, self.resize_mode)
        if self.cache:
            self._cache[index] = frames
        return frames

    def __getitem__(self, index: int) -> dict[str, Any] | None:
        rec = self.records[index]
        try:
            frames = self.load_frames(index)
        except VideoReadError as err:
            if self.on_error == "raise":
                raise
            return {"skipped": err.path, "reason": err.reason}
        if self.caption_mode == "random" and len(rec.captions) > 1:
            caption = random.Random(hash((self.seed, self.epoch, index, "cap"))).choice(rec.captions)
        else:
            caption = rec.captions[0]
        return {
            "video": to_model_input(frames, self.mean, self.std),
            "caption": caption,
            "captions": list(rec.captions) if self.caption_mode == "all" else [caption],
            "index": index,
            "path": rec.video,
        }


def collate_video_text(items: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
    """Stack clips, flatten captions; skipped items are dropped and reported.

    Returns ``video`` (B, 3, T, H, W), ``captions`` (list of Nt strings), ``caption_video``
    (LongTensor (Nt,): index of each caption's clip in the batch), ``index``, ``path``,
    ``num_skipped`` and ``skipped`` (paths).
    """
    good = [it for it in items if it is not None and "skipped" not in it]
    skipped = [it["skipped"] for it in items if it is not None and "skipped" in it]
    captions, owner = [], []
    for b, it in enumerate(good):
        captions.extend(it["captions"])
        owner.extend([b] * len(it["captions"]))
    return {
        "video": torch.stack([it["video"] for it in good]) if good else torch.empty(0),
        "captions": captions,
        "caption_video": torch.tensor(owner, dtype=torch.long),
        "index": torch.tensor([it["index"] for it in good], dtype=torch.long),
        "path": [it["path"] for it in good],
        "num_skipped": len(skipped),
        "skipped": skipped,
    }


def _default_root() -> Path:
    """Where generated sets go when no ``root`` is given: ``$VISPE_DATA_ROOT/generated`` or the temp dir."""
    base = os.environ.get("VISPE_DATA_ROOT")
    return Path(base) / "generated" if base else Path(tempfile.gettempdir()) / "vispe-generated"


class VideoTextDataModule(L.LightningDataModule):
    """Video-text retrieval data from manifests (MSR-VTT style CSV/JSON).

    ``eval_settings`` lists extra ``(num_frames, size)`` views of the validation/test clips (e.g.
    more frames and a higher resolution than training); ``val_dataloader`` returns one loader per
    view, the first being the training view.
    """

    def __init__(
        self,
        train_manifest: str | None = None,
        val_manifest: str | None = None,
        test_manifest: str | None = None,
        video_root: str | None = None,
        num_frames: int = 8,
        size: int | tuple[int, int] = 32,
        eval_settings: Sequence[tuple[int, int | tuple[int, int]]] = (),
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        on_error: str = "raise",
        resize_mode: str = "center_crop",
        train_sampling: str = "random",
        cache: bool = False,
    ) -> None:
        super().__init__()
        check_choice("on_error", on_error, ON_ERROR)
        self.save_hyperparameters()
        self.train_manifest, self.val_manifest, self.test_manifest = train_manifest, val_manifest, test_manifest
        self.video_root = video_root
        self.num_frames = num_frames
        self.size = (size, size) if isinstance(size, int) else tuple(size)
        self.eval_settings = [(int(t), (s, s) if isinstance(s, int) else tuple(s)) for t, s in eval_settings]
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers = num_workers
        self.on_error, self.resize_mode, self.train_sampling, self.cache = on_error, resize_mode, train_sampling, cache
        if isinstance(num_frames, bool) or not isinstance(num_frames, numbers.Integral) or num_frames < 1:
            raise ValueError(f"num_frames must be an integer >= 1, got {num_frames!r}")
        for name, manifest in (("train_manifest", train_manifest), ("val_manifest", val_manifest), ("test_manifest", test_manifest)):
            if manifest is not None:  # a missing or damaged manifest fails at construction, not in setup
                try:
                    records = load_manifest(manifest, video_root)
                except FileNotFoundError as err:
                    raise FileNotFoundError(f"{name}: {err}") from None
                missing = [r.video for r in records if not os.path.isfile(r.video)] if on_error == "raise" else []
                if missing:
                    raise FileNotFoundError(
                        f"{name} {str(manifest)!r}: {len(missing)} of {len(records)} videos do not exist (first: {missing[0]!r}); "
                        f"set video_root to the folder that holds them, or on_error='skip' to train without them"
                    )
        self.train_set: VideoTextDataset | None = None
        self.val_sets: list[VideoTextDataset] = []
        self.test_sets: list[VideoTextDataset] = []

    @property
    def views(self) -> list[tuple[int, tuple[int, int]]]:
        """Evaluation views ``(num_frames, (h, w))``: the training view first, then ``eval_settings``."""
        out = [(self.num_frames, self.size)]
        out += [v for v in self.eval_settings if v not in out]
        return out

    def _manifests(self) -> tuple[str | None, str | None, str | None]:
        return self.train_manifest, self.val_manifest, self.test_manifest

    def _dataset(self, manifest: str, num_frames: int, size: tuple[int, int], train: bool) -> VideoTextDataset:
        records = load_manifest(manifest, self.video_root)
        return VideoTextDataset(
            records, num_frames, size,
            sampling=self.train_sampling if train else "uniform",
            caption_mode="random" if train else "first",
            on_error=self.on_error, resize_mode=self.resize_mode, cache=self.cache,
        )

    def setup(self, stage: str | None = None) -> None:
        train, val, test = self._manifests()
        if stage in (None, "fit") and train is not None:
            self.train_set = self._dataset(train, self.num_frames, self.size, True)
        if stage in (None, "fit", "validate") and val is not None:
            self.val_sets = [self._dataset(val, t, s, False) for t, s in self.views]
        if stage in (None, "test") and (test or val) is not None:
            self.test_sets = [self._dataset(test or val, t, s, False) for t, s in self.views]

    def _loader(self, ds: Dataset, shuffle: bool, batch_size: int) -> DataLoader:
        return DataLoader(
            ds, batch_size=batch_size, shuffle=shuffle, num_workers=self.num_workers, collate_fn=collate_video_text,
            drop_last=False, persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        if self.train_set is None:
            raise ValueError("no training manifest: set train_manifest (or use SyntheticVideoTextDataModule)")
        return self._loader(self.train_set, True, self.batch_size)

    def val_dataloader(self) -> list[DataLoader]:
        return [self._loader(ds, False, self.eval_batch_size) for ds in self.val_sets]

    def test_dataloader(self) -> list[DataLoader]:
        return [self._loader(ds, False, self.eval_batch_size) for ds in self.test_sets]


class SyntheticVideoTextDataModule(VideoTextDataModule):
    """The generated "where and when" set (see the module docstring), written to ``root`` once and re-used.

    The training split is rendered at ``num_frames`` x ``size``; the validation/test splits are
    rendered at the largest evaluation view so that more frames and a higher resolution are real
    content, not upsampling, and are read at each view by uniform frame sampling and resizing.
    """

    def __init__(
        self,
        root: str | None = None,
        num_train: int = 2048,
        num_val: int = 256,
        num_test: int = 0,
        num_frames: int = 8,
        size: int | tuple[int, int] = 32,
        eval_settings: Sequence[tuple[int, int | tuple[int, int]]] = (),
        fps: int = 8,
        num_events: int = 2,
        grid: int = 2,
        colors: Sequence[str] = ("red", "green", "blue"),
        shapes: Sequence[str] = ("square", "circle"),
        kinds: Sequence[str] = EVENT_KINDS,
        codec: str = "libx264",
        seed: int = 0,
        batch_size: int = 32,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        on_error: str = "raise",
        train_sampling: str = "uniform",
        cache: bool = True,
    ) -> None:
        super().__init__(
            num_frames=num_frames, size=size, eval_settings=eval_settings, batch_size=batch_size,
            eval_batch_size=eval_batch_size, num_workers=num_workers, on_error=on_error,
            train_sampling=train_sampling, cache=cache, resize_mode="squash",
        )
        self.root = Path(root) if root is not None else _default_root()
        common = dict(fps=fps, num_events=num_events, grid=grid, colors=tuple(colors), shapes=tuple(shapes), kinds=tuple(kinds), codec=codec)
        max_t = max(t for t, _ in self.views)
        max_hw = tuple(max(s[i] for _, s in self.views) for i in range(2))
        # validation/test renderings: frame count a multiple of every view's so uniform sampling lands on whole events
        render_t = math.lcm(*[t for t, _ in self.views]) if max_t <= 64 else max_t
        self.train_spec = SyntheticVideoTextSpec(num_train, num_frames, size=self.size, seed=seed, **common)
        self.val_spec = SyntheticVideoTextSpec(num_val, render_t, size=max_hw, seed=seed + 1_000_003, **common)
        self.test_spec = SyntheticVideoTextSpec(num_test, render_t, size=max_hw, seed=seed + 2_000_003, **common) if num_test else None
        self._paths: dict[str, str] = {}

    def prepare_data(self) -> None:
        self._paths["train"] = str(generate_video_text_set(self.root, self.train_spec))
        self._paths["val"] = str(generate_video_text_set(self.root, self.val_spec))
        if self.test_spec is not None:
            self._paths["test"] = str(generate_video_text_set(self.root, self.test_spec))

    def _manifests(self):
        if not self._paths:
            self.prepare_data()
        return self._paths.get("train"), self._paths.get("val"), self._paths.get("test")

    @property
    def chance_r1(self) -> float:
        """R@1 (%) of a random ranking on the validation gallery."""
        return 100.0 / self.val_spec.num_videos
