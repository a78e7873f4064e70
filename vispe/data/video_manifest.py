"""Video/caption manifests of real data sets (MSR-VTT style).

:func:`load_manifest` reads the usual forms: a CSV with ``video`` and ``caption`` columns, a JSON
list of ``{"video": ..., "caption(s)": ...}`` records, a JSON object keyed by file name
(``{"clip.mp4": {"captions": [...]}}``), or MSR-VTT's ``{"videos": [...], "sentences": [...]}``.
"""
from __future__ import annotations

import csv
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..files import DamagedFileError, read_json

__all__ = ["VideoTextRecord", "load_manifest"]


@dataclass
class VideoTextRecord:
    """One video and its captions (``video`` is relative to the manifest's folder unless absolute)."""

    video: str
    captions: list[str]
    meta: dict[str, Any] = field(default_factory=dict)



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
        try:
            with path.open(newline="", encoding="utf-8") as fh:
                reader = csv.DictReader(fh, delimiter="\t" if path.suffix.lower() == ".tsv" else ",")
                for i, row in enumerate(reader):
                    add(_record_from_mapping({k: v for k, v in row.items() if k is not None and v is not None}, f"{path}:{i + 2}"))
        except (UnicodeDecodeError, csv.Error) as err:
            raise DamagedFileError(path, f"is not a readable CSV manifest ({type(err).__name__}: {err})", "write it as UTF-8 CSV with a header row") from None
    else:
        data = read_json(path, "video/caption manifest")
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
