"""The generated "where and when" video-text set: scenes, captions, rendering and the written set.

Each clip shows ``num_events`` events, one after the other in equal time segments. An event is a
coloured shape that either *appears* in one cell of a ``grid x grid`` layout or *moves* from one
cell to a neighbouring cell (it jumps half-way through its segment). Only one object is visible
at a time and every object is visible for the same number of frames, so the set of patch contents
is the same whatever the cells and the order are: a model without spatial and temporal position
sees only "which objects occur", never where or in what order. Captions read e.g. ``"a red square
appears in the top left, then a blue circle moves from the bottom left to the bottom right"``.
Clips are written as real files with PyAV (h264 or mpeg4) and read back with decord; everything
is deterministic by seed.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from .._checks import check_choice
from .video_io import CODECS, write_video

__all__ = ["BACKGROUND", "COLORS", "SHAPES", "EVENT_KINDS", "Event", "SyntheticVideoTextSpec", "cell_name", "caption_for", "sample_events",
           "event_segments", "cell_box", "render_events", "generate_video_text_set", "events_from_record", "position_free_r1"]


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
BACKGROUND = (24, 24, 24)


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
            check_choice("color", c, COLORS)
        for s in self.shapes:
            check_choice("shape", s, SHAPES)
        for k in self.kinds:
            check_choice("event kind", k, EVENT_KINDS)
        check_choice("codec", self.codec, CODECS)
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
# Generated set
# ---------------------------------------------------------------------------------------------

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
