"""Video files: writing clips with PyAV, reading them with decord (or PyAV), frame sampling and resizing.

A missing or undecodable video raises :class:`VideoReadError` naming the file.
"""
from __future__ import annotations

import numbers
import os
import random
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .._checks import check_choice

__all__ = ["CODECS", "IMAGENET_MEAN", "IMAGENET_STD", "VideoReadError", "write_video", "read_video", "sample_frame_indices",
           "resize_video", "to_model_input"]

#: file suffix -> PyAV encoder used by :func:`write_video` (decord 0.6 decodes all three)
CODECS: dict[str, str] = {"libx264": ".mp4", "h264": ".mp4", "mpeg4": ".mp4", "mjpeg": ".avi"}
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class VideoReadError(RuntimeError):
    """A video file could not be opened or decoded; the message names the file."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"cannot read video {self.path!r}: {reason}")




def write_video(
    path: str | os.PathLike, frames: np.ndarray | torch.Tensor, fps: int = 8, codec: str = "libx264", quality: int = 18
) -> Path:
    """Write uint8 ``(T, H, W, 3)`` RGB frames with PyAV.

    ``codec``: 'libx264'/'h264' (crf ``quality``, yuv420p, even sizes), 'mpeg4' (qscale 2), 'mjpeg'
    (.avi). Returns the path written.
    """
    import av

    check_choice("codec", codec, CODECS)
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
    check_choice("sampling mode", mode, ("uniform", "random"))
    if isinstance(num_frames, bool) or not isinstance(num_frames, numbers.Integral) or num_frames < 1:
        raise ValueError(f"num_frames must be an integer >= 1 (or None for every frame), got {num_frames!r}")
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
    check_choice("backend", backend, ("decord", "pyav"))
    if num_frames is not None and (isinstance(num_frames, bool) or not isinstance(num_frames, numbers.Integral) or num_frames < 1):
        raise ValueError(f"num_frames must be an integer >= 1 (or None for every frame), got {num_frames!r}")
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
    check_choice("resize mode", mode, ("center_crop", "squash"))
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
