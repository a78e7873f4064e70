"""Video-text data: a generated set whose captions need "where" and "when", real video/caption
manifests (MSR-VTT style), decoding with decord, and LightningDataModules.

Generated set
    Each clip shows ``num_events`` events, one after the other in equal time segments. An event is
    a coloured shape that either *appears* in one cell of a ``grid x grid`` layout or *moves* from
    one cell to a neighbouring cell (it jumps half-way through its segment). Only one object is
    visible at a time and every object is visible for the same number of frames, so the set of
    patch contents is the same whatever the cells and the order are: a model without spatial and
    temporal position sees only "which objects occur", never where or in what order. Captions
    read e.g. ``"a red square appears in the top left, then a blue circle moves from the bottom
    left to the bottom right"``. Clips are written as real files with PyAV (h264 or mpeg4) and read
    back with decord; everything is deterministic by seed.

Real data
    :func:`load_manifest` reads the usual forms: a CSV with ``video`` and ``caption`` columns, a
    JSON list of ``{"video": ..., "caption(s)": ...}`` records, a JSON object keyed by file name
    (``{"clip.mp4": {"captions": [...]}}``), or MSR-VTT's ``{"videos": [...], "sentences": [...]}``.

Bad files
    A missing or undecodable video raises :class:`VideoReadError` naming the file
    (``on_error='raise'``), or is skipped (``on_error='skip'``): :func:`collate_video_text` drops it,
    keeps the rest of the batch and reports ``num_skipped`` / ``skipped`` in the batch.
"""
from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import random
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

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

#: colour name -> RGB (saturated, far apart so that lossy codecs keep them distinguishable)
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (230, 30, 30),
    "green": (30, 200, 40),
    "blue": (40, 60, 230),
    "yellow": (235, 220, 30),
    "white": (240, 240, 240),
    "magenta": (220, 40, 220),
}
SHAPES = ("square", "circle", "triangle")
EVENT_KINDS = ("appears", "moves")
#: file suffix -> PyAV encoder used by :func:`write_video` (decord 0.6 decodes all three)
CODECS: dict[str, str] = {"libx264": ".mp4", "h264": ".mp4", "mpeg4": ".mp4", "mjpeg": ".avi"}
BACKGROUND = (24, 24, 24)
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
ON_ERROR = ("raise", "skip")
CAPTION_MODES = ("first", "random", "all")


class VideoReadError(RuntimeError):
    """A video file could not be opened or decoded; the message names the file."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"cannot read video {self.path!r}: {reason}")


def _check_choice(name: str, value: Any, choices: Iterable[Any]) -> None:
    choices = list(choices)
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {choices}")


# ---------------------------------------------------------------------------------------------
# Scene description and captions
# ---------------------------------------------------------------------------------------------


def cell_name(cell: tuple[int, int], grid: int) -> str:
    """Words for a cell ``(row, col)`` of a ``grid x grid`` layout, e.g. ``'top left'``."""
    row, col = cell
    if grid == 2:
        rows, cols = ("top", "bottom"), ("left", "right")
    elif grid == 3:
        rows, cols = ("top", "middle", "bottom"), ("left", "center", "right")
    else:
        raise ValueError(f"grid={grid} has no cell names; choose 2 or 3")
    if grid == 3 and (row, col) == (1, 1):
        return "center"
    return f"{rows[row]} {cols[col]}"


@dataclass(frozen=True)
class Event:
    """One event: ``kind`` 'appears' (``start == end``) or 'moves' (``start -> end``, neighbouring cells)."""

    color: str
    shape: str
    kind: str
    start: tuple[int, int]
    end: tuple[int, int]

    def phrase(self, grid: int) -> str:
        if self.kind == "appears":
            return f"a {self.color} {self.shape} appears in the {cell_name(self.start, grid)}"
        return f"a {self.color} {self.shape} moves from the {cell_name(self.start, grid)} to the {cell_name(self.end, grid)}"

    def cell_at(self, fraction: float) -> tuple[int, int]:
        """Cell occupied at ``fraction`` in [0, 1) of the event's time segment."""
        return self.start if (self.kind == "appears" or fraction < 0.5) else self.end


def caption_for(events: Sequence[Event], grid: int) -> str:
    """``'<event 1>, then <event 2>, then ...'``."""
    return ", then ".join(e.phrase(grid) for e in events)


@dataclass
class SyntheticVideoTextSpec:
    """Everything that determines a generated split (its hash names the cache folder)."""

    num_videos: int = 256
    num_frames: int = 8
    fps: int = 8
    size: tuple[int, int] = (32, 32)
    num_events: int = 2
    grid: int = 2
    colors: tuple[str, ...] = ("red", "green", "blue")
    shapes: tuple[str, ...] = ("square", "circle")
    kinds: tuple[str, ...] = EVENT_KINDS
    seed: int = 0
    codec: str = "libx264"
    unique_captions: bool = True

    def __post_init__(self) -> None:
        self.size = tuple(int(s) for s in self.size)  # type: ignore[assignment]
        self.colors, self.shapes, self.kinds = tuple(self.colors), tuple(self.shapes), tuple(self.kinds)
        if self.num_videos < 1:
            raise ValueError(f"num_videos must be >= 1, got {self.num_videos}")
        if self.num_events < 1:
            raise ValueError(f"num_events must be >= 1, got {self.num_events}")
        if self.grid not in (2, 3):
            raise ValueError(f"grid={self.grid} is not valid; choose 2 or 3")
        for c in self.colors:
            _check_choice("color", c, COLORS)
        for s in self.shapes:
            _check_choice("shape", s, SHAPES)
        for k in self.kinds:
            _check_choice("event kind", k, EVENT_KINDS)
        _check_choice("codec", self.codec, CODECS)
        min_frames = self.num_events * (2 if "moves" in self.kinds else 1)
        if self.num_frames < min_frames:
            raise ValueError(
                f"num_frames={self.num_frames} is too few for {self.num_events} events with kinds {self.kinds}; need >= {min_frames}"
            )
        h, w = self.size
        if h < 4 * self.grid or w < 4 * self.grid:
            raise ValueError(f"size={self.size} is too small for a {self.grid}x{self.grid} layout; need >= {4 * self.grid} px per side")
        if self.codec in ("libx264", "h264") and (h % 2 or w % 2):
            raise ValueError(f"libx264 (yuv420p) needs an even width and height, got size={self.size}; use even sizes or codec='mpeg4'")
        if self.fps < 1:
            raise ValueError(f"fps must be >= 1, got {self.fps}")

    def key(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True, default=list).encode()
        return hashlib.sha1(blob).hexdigest()[:12]

    def num_distinct_captions(self) -> int:
        per_event = len(self.colors) * len(self.shapes) * len(_event_cells(self.grid, self.kinds))
        return per_event**self.num_events


def _neighbours(cell: tuple[int, int], grid: int) -> list[tuple[int, int]]:
    r, c = cell
    out = [(r + dr, c + dc) for dr, dc in ((0, 1), (0, -1), (1, 0), (-1, 0))]
    return [(a, b) for a, b in out if 0 <= a < grid and 0 <= b < grid]


def _event_cells(grid: int, kinds: Sequence[str]) -> list[tuple[str, tuple[int, int], tuple[int, int]]]:
    cells = [(r, c) for r in range(grid) for c in range(grid)]
    out = []
    if "appears" in kinds:
        out += [("appears", c, c) for c in cells]
    if "moves" in kinds:
        out += [("moves", c, n) for c in cells for n in _neighbours(c, grid)]
    return out


def sample_events(rng: random.Random, spec: SyntheticVideoTextSpec) -> list[Event]:
    """Draw ``spec.num_events`` events; consecutive events differ in colour or shape."""
    options = _event_cells(spec.grid, spec.kinds)
    events: list[Event] = []
    while len(events) < spec.num_events:
        color, shape = rng.choice(spec.colors), rng.choice(spec.shapes)
        if events and (events[-1].color, events[-1].shape) == (color, shape) and len(spec.colors) * len(spec.shapes) > 1:
            continue
        kind, a, b = rng.choice(options)
        events.append(Event(color, shape, kind, a, b))
    return events


def event_segments(num_frames: int, num_events: int) -> list[tuple[int, int]]:
    """Frame ranges ``[start, stop)`` of each event (equal split, remainder spread)."""
    bounds = [round(k * num_frames / num_events) for k in range(num_events + 1)]
    return [(bounds[k], bounds[k + 1]) for k in range(num_events)]


def _draw(frame: np.ndarray, shape: str, color: tuple[int, int, int], box: tuple[int, int, int, int]) -> None:
    y0, x0, y1, x1 = box
    h, w = y1 - y0, x1 - x0
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    if shape == "square":
        mask = np.ones((h, w), dtype=bool)
    elif shape == "circle":
        cy, cx, r = (h - 1) / 2, (w - 1) / 2, min(h, w) / 2
        mask = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
    elif shape == "triangle":  # apex up
        mask = np.abs(xx - (w - 1) / 2) <= (yy + 1) * (w / 2) / h
    else:
        raise ValueError(f"unknown shape {shape!r}; choose one of {list(SHAPES)}")
    frame[y0:y1, x0:x1][mask] = color


def cell_box(cell: tuple[int, int], size: tuple[int, int], grid: int) -> tuple[int, int, int, int]:
    """Pixel box ``(y0, x0, y1, x1)`` of the object drawn in ``cell``: the middle half of the cell."""
    h, w = size
    ch, cw = h / grid, w / grid
    r, c = cell
    y0, x0 = round(r * ch + ch / 4), round(c * cw + cw / 4)
    return y0, x0, round(r * ch + 3 * ch / 4), round(c * cw + 3 * cw / 4)


def render_events(events: Sequence[Event], num_frames: int, size: tuple[int, int], grid: int) -> np.ndarray:
    """uint8 frames ``(T, H, W, 3)``: one object visible at a time, in its event's time segment."""
    h, w = size
    frames = np.empty((num_frames, h, w, 3), dtype=np.uint8)
    frames[:] = BACKGROUND
    for ev, (a, b) in zip(events, event_segments(num_frames, len(events))):
        for t in range(a, b):
            cell = ev.cell_at((t - a) / max(b - a, 1))
            _draw(frames[t], ev.shape, COLORS[ev.color], cell_box(cell, size, grid))
    return frames


# ---------------------------------------------------------------------------------------------
# Video files
# ---------------------------------------------------------------------------------------------


def write_video(
    path: str | os.PathLike, frames: np.ndarray | torch.Tensor, fps: int = 8, codec: str = "libx264", quality: int = 18
) -> Path:
    """Write uint8 ``(T, H, W, 3)`` RGB frames with PyAV.

    ``codec``: 'libx264'/'h264' (crf ``quality``, yuv420p, even sizes), 'mpeg4' (qscale 2), 'mjpeg'
    (.avi). Returns the path written.
    """
    import av

    _check_choice("codec", codec, CODECS)
    frames = frames.numpy() if isinstance(frames, torch.Tensor) else np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 (T, H, W, 3), got {frames.dtype} {tuple(frames.shape)}")
    t, h, w, _ = frames.shape
    if codec in ("libx264", "h264") and (h % 2 or w % 2):
        raise ValueError(f"libx264 with yuv420p needs even width and height, got {w}x{h}; use codec='mpeg4'")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")  # atomic: a crash leaves no half file under `path`
    with av.open(str(tmp), mode="w") as container:
        stream = container.add_stream("libx264" if codec == "h264" else codec, rate=fps)
        stream.width, stream.height = w, h
        if codec == "mjpeg":
            stream.pix_fmt = "yuvj420p"
            stream.options = {"q:v": "2"}
        else:
            stream.pix_fmt = "yuv420p"
            stream.options = {"crf": str(quality)} if codec in ("libx264", "h264") else {"qscale": "2"}
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    os.replace(tmp, path)
    return path


def sample_frame_indices(num_available: int, num_frames: int, mode: str = "uniform", rng: random.Random | None = None) -> list[int]:
    """Indices of ``num_frames`` frames out of ``num_available``.

    'uniform': centres of ``num_frames`` equal segments (TSN-style test sampling; taking 8 of 16
    frames gives 1, 3, 5, ...); 'random': one random frame per segment (training jitter).
    Repeats frames when the clip is shorter than requested.
    """
    _check_choice("sampling mode", mode, ("uniform", "random"))
    if num_available < 1:
        raise ValueError("the video has no frames")
    seg = num_available / num_frames
    if mode == "uniform" or rng is None:
        idx = [int(seg * k + seg / 2) for k in range(num_frames)]
    else:
        idx = [int(seg * k + rng.random() * seg) for k in range(num_frames)]
    return [min(max(i, 0), num_available - 1) for i in idx]


def _read_pyav(path: Path, indices: Sequence[int] | None, num_frames: int | None, sampling: str, rng: random.Random | None) -> np.ndarray:
    import av

    with av.open(str(path)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    if not frames:
        raise VideoReadError(path, "the file has no video frames")
    n = len(frames)
    if indices is None:
        indices = list(range(n)) if num_frames is None else sample_frame_indices(n, num_frames, sampling, rng)
    bad = [i for i in indices if not 0 <= int(i) < n]
    if bad:
        raise VideoReadError(path, f"frame indices {bad[:5]} are out of range for {n} frames")
    return np.stack([frames[int(i)] for i in indices])


def read_video(
    path: str | os.PathLike,
    num_frames: int | None = None,
    indices: Sequence[int] | None = None,
    sampling: str = "uniform",
    rng: random.Random | None = None,
    backend: str = "decord",
) -> torch.Tensor:
    """Decode frames: uint8 ``(T, H, W, 3)``. All frames, ``num_frames`` sampled, or ``indices``.

    ``backend='decord'`` (default) decodes with decord and falls back to PyAV only for decord's
    row-stride bug on some small widths (16, 24, 48, 72 px: "DECORDArrayCopyFromTo: The size must
    exactly match", dmlc/decord#336); ``'pyav'`` decodes everything with PyAV.
    Raises :class:`VideoReadError` (naming the file) for a missing, empty or undecodable file.
    """
    _check_choice("backend", backend, ("decord", "pyav"))
    path = Path(path)
    if not path.is_file():
        raise VideoReadError(path, "no such file")
    try:
        if backend == "pyav":
            return torch.from_numpy(_read_pyav(path, indices, num_frames, sampling, rng))
        import decord

        vr = decord.VideoReader(str(path), ctx=decord.cpu(0), num_threads=1)
        n = len(vr)
        if n == 0:
            raise VideoReadError(path, "the file has no video frames")
        if indices is None:
            indices = list(range(n)) if num_frames is None else sample_frame_indices(n, num_frames, sampling, rng)
        else:
            bad = [i for i in indices if not 0 <= int(i) < n]
            if bad:
                raise VideoReadError(path, f"frame indices {bad[:5]} are out of range for {n} frames")
        try:
            frames = vr.get_batch(list(indices)).asnumpy()
        except Exception as err:
            if "DECORDArrayCopyFromTo" not in str(err):
                raise
            frames = _read_pyav(path, list(indices), None, sampling, rng)
        vr.seek(0)  # releases decoder buffers (dmlc/decord#197)
    except VideoReadError:
        raise
    except Exception as err:  # decord raises DECORDError / RuntimeError with FFmpeg's words
        raise VideoReadError(path, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}") from err
    return torch.from_numpy(frames)


def resize_video(frames: torch.Tensor, size: tuple[int, int], mode: str = "center_crop") -> torch.Tensor:
    """uint8 ``(T, H, W, 3)`` -> uint8 ``(T, h, w, 3)``.

    'center_crop': resize the short side (keeping the aspect ratio) and crop the centre;
    'squash': resize both sides. Bilinear, antialiased when shrinking.
    """
    _check_choice("resize mode", mode, ("center_crop", "squash"))
    th, tw = size
    t, h, w, _ = frames.shape
    if (h, w) == (th, tw):
        return frames
    x = frames.permute(0, 3, 1, 2).float()
    if mode == "squash":
        out_hw = (th, tw)
    else:
        scale = max(th / h, tw / w)
        out_hw = (max(th, round(h * scale)), max(tw, round(w * scale)))
    x = F.interpolate(x, size=out_hw, mode="bilinear", align_corners=False, antialias=out_hw[0] < h or out_hw[1] < w)
    if mode == "center_crop":
        y0, x0 = (out_hw[0] - th) // 2, (out_hw[1] - tw) // 2
        x = x[:, :, y0 : y0 + th, x0 : x0 + tw]
    return x.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)


def to_model_input(frames: torch.Tensor, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD) -> torch.Tensor:
    """uint8 ``(T, H, W, 3)`` -> normalised float32 ``(3, T, H, W)`` (the video ViT's layout)."""
    x = frames.permute(3, 0, 1, 2).float().div_(255.0)
    m = torch.tensor(mean, dtype=x.dtype).view(3, 1, 1, 1)
    s = torch.tensor(std, dtype=x.dtype).view(3, 1, 1, 1)
    return (x - m) / s


# ---------------------------------------------------------------------------------------------
# Generated set
# ---------------------------------------------------------------------------------------------


@dataclass
class VideoTextRecord:
    """One video and its captions (``video`` is relative to the manifest's folder unless absolute)."""

    video: str
    captions: list[str]
    meta: dict[str, Any] = field(default_factory=dict)


def generate_video_text_set(root: str | os.PathLike, spec: SyntheticVideoTextSpec, overwrite: bool = False) -> Path:
    """Write ``spec.num_videos`` clips and ``manifest.json`` under ``root/<spec key>/``; returns the manifest.

    Re-uses an existing complete folder with the same spec. The manifest is a JSON list of
    ``{"video", "caption", "events", "num_frames", "size", "fps"}`` records, readable by
    :func:`load_manifest`.
    """
    out = Path(root) / f"video_text_{spec.key()}"
    manifest = out / "manifest.json"
    if manifest.is_file() and not overwrite:
        return manifest
    if spec.unique_captions and spec.num_videos > spec.num_distinct_captions():
        raise ValueError(
            f"unique_captions=True but num_videos={spec.num_videos} exceeds the {spec.num_distinct_captions()} distinct captions "
            f"of this spec; add colours/shapes/events or set unique_captions=False"
        )
    rng = random.Random(spec.seed)
    suffix = CODECS[spec.codec]
    seen: set[str] = set()
    records = []
    for i in range(spec.num_videos):
        while True:
            events = sample_events(rng, spec)
            caption = caption_for(events, spec.grid)
            if not spec.unique_captions or caption not in seen:
                break
        seen.add(caption)
        frames = render_events(events, spec.num_frames, spec.size, spec.grid)
        name = f"clip_{i:05d}{suffix}"
        write_video(out / name, frames, fps=spec.fps, codec=spec.codec)
        records.append(
            {
                "video": name,
                "caption": caption,
                "events": [asdict(e) for e in events],
                "num_frames": spec.num_frames,
                "size": list(spec.size),
                "fps": spec.fps,
                "grid": spec.grid,
            }
        )
    (out / "spec.json").write_text(json.dumps(asdict(spec), indent=1, default=list))
    tmp = manifest.with_suffix(".tmp")
    tmp.write_text(json.dumps(records, indent=1))
    os.replace(tmp, manifest)  # the manifest appears last: its presence means the folder is complete
    return manifest


def events_from_record(record: Mapping[str, Any]) -> list[Event]:
    return [Event(e["color"], e["shape"], e["kind"], tuple(e["start"]), tuple(e["end"])) for e in record["events"]]


def position_free_r1(records: Sequence[Mapping[str, Any]]) -> float:
    """Expected text->video R@1 (%) of an ideal model that sees only *which* objects occur.

    Clips whose captions name the same multiset of (colour, shape) are indistinguishable without
    position, so such a model ranks them in random order: R@1 = mean over captions of 1 / (size of
    its group). This is the ceiling for an encoding-free (``none``) model on a generated split.
    """
    groups: dict[tuple, int] = {}
    keys = []
    for r in records:
        key = tuple(sorted((e["color"], e["shape"]) for e in r["events"]))
        keys.append(key)
        groups[key] = groups.get(key, 0) + 1
    return 100.0 * sum(1.0 / groups[k] for k in keys) / len(keys)


# ---------------------------------------------------------------------------------------------
# Manifests (real data sets)
# ---------------------------------------------------------------------------------------------

_VIDEO_KEYS = ("video", "video_path", "path", "file", "filename", "video_id", "clip")
_CAPTION_KEYS = ("captions", "caption", "sentences", "text", "sentence")


def _as_captions(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ValueError(f"captions must be a string or a list of strings, got {value!r}")


def _record_from_mapping(item: Mapping[str, Any], where: str) -> VideoTextRecord:
    vkey = next((k for k in _VIDEO_KEYS if k in item), None)
    ckey = next((k for k in _CAPTION_KEYS if k in item), None)
    if vkey is None or ckey is None:
        raise ValueError(f"{where}: a record needs a video key (one of {list(_VIDEO_KEYS)}) and a caption key (one of {list(_CAPTION_KEYS)}); got keys {sorted(item)}")
    meta = {k: v for k, v in item.items() if k not in (vkey, ckey)}
    return VideoTextRecord(str(item[vkey]), _as_captions(item[ckey]), meta)


def _resolve_video(name: str, root: Path, suffixes: Sequence[str]) -> str:
    p = Path(name)
    if p.suffix or p.is_absolute():
        return str(p if p.is_absolute() else root / p)
    for s in suffixes:  # MSR-VTT ids ("video7020") name files without a suffix
        if (root / f"{name}{s}").is_file():
            return str(root / f"{name}{s}")
    return str(root / f"{name}{suffixes[0]}")


def load_manifest(
    path: str | os.PathLike, video_root: str | os.PathLike | None = None, suffixes: Sequence[str] = (".mp4", ".avi", ".mkv", ".webm")
) -> list[VideoTextRecord]:
    """Read a video/caption manifest; video paths are resolved against ``video_root`` (default: the manifest's folder).

    Accepted: CSV (header with a video and a caption column; rows with the same video are merged),
    JSON list of records, JSON object keyed by file name, MSR-VTT ``{"videos", "sentences"}``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"manifest {str(path)!r} does not exist")
    root = Path(video_root) if video_root is not None else path.parent
    merged: dict[str, VideoTextRecord] = {}

    def add(rec: VideoTextRecord) -> None:
        rec.video = _resolve_video(rec.video, root, suffixes)
        if rec.video in merged:
            merged[rec.video].captions.extend(rec.captions)
        else:
            merged[rec.video] = rec

    if path.suffix.lower() in (".csv", ".tsv"):
        with path.open(newline="") as fh:
            reader = csv.DictReader(fh, delimiter="\t" if path.suffix.lower() == ".tsv" else ",")
            for i, row in enumerate(reader):
                add(_record_from_mapping(row, f"{path}:{i + 2}"))
    else:
        data = json.loads(path.read_text())
        if isinstance(data, Mapping) and "sentences" in data:  # MSR-VTT train_val_videodatainfo.json
            for s in data["sentences"]:
                add(VideoTextRecord(str(s["video_id"]), [s["caption"]]))
        elif isinstance(data, Mapping):  # {"clip.mp4": {"captions": [...], ...}} or {"clip.mp4": "caption"}
            for name, value in data.items():
                if isinstance(value, Mapping):
                    ckey = next((k for k in _CAPTION_KEYS if k in value), None)
                    if ckey is None:
                        raise ValueError(f"{path}: entry {name!r} has no caption key (one of {list(_CAPTION_KEYS)})")
                    add(VideoTextRecord(name, _as_captions(value[ckey]), {k: v for k, v in value.items() if k != ckey}))
                else:
                    add(VideoTextRecord(name, _as_captions(value)))
        elif isinstance(data, list):
            for i, item in enumerate(data):
                add(_record_from_mapping(item, f"{path}[{i}]"))
        else:
            raise ValueError(f"{path}: unsupported manifest layout ({type(data).__name__})")
    if not merged:
        raise ValueError(f"manifest {str(path)!r} lists no videos")
    return list(merged.values())


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
        _check_choice("on_error", on_error, ON_ERROR)
        _check_choice("caption_mode", caption_mode, CAPTION_MODES)
        _check_choice("sampling", sampling, ("uniform", "random"))
        _check_choice("resize_mode", resize_mode, ("center_crop", "squash"))
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
        _check_choice("on_error", on_error, ON_ERROR)
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
