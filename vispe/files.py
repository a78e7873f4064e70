"""Checked readers for every kind of file vispe reads: one per format, each naming the file, what is wrong and what to do.

* Checkpoints (``.ckpt`` / ``.pth`` / ``.pt``): :func:`read_checkpoint` always unpickles with
  ``torch.load(weights_only=True)``: tensors, plain containers and numbers only. A file whose pickle refers to any
  other Python object (a function such as ``os.system``, a class) is refused *before* the reference is resolved,
  so nothing in a downloaded checkpoint ever runs. Checkpoints written by vispe (Lightning's ``Trainer`` through
  ``vispe fit``, :func:`torch.save` of a state dict) hold only such types.
* ``.safetensors``: :func:`read_safetensors` (no pickle at all; the header is checked against the file size).
* :func:`read_state_dict` picks one of the two from the suffix.
* Zip archives (CIFAR-10 JPEG zips): :func:`check_zip`, cheap enough for a DataModule's constructor (central
  directory present, every member inside the file).
* IDX files, raw or gzip (Fashion-MNIST): :func:`check_idx` (header and size agree; for ``.gz`` the gzip trailer's
  length) and :func:`read_idx`.
* JSON (manifests, specs): :func:`read_json` (line and column of a syntax error).
* Images: :func:`read_image` / :func:`image_to_uint8`, the one decoder of training, evaluation and the resolution
  sweep (every PIL mode converted by a stated rule or refused; non-finite pixels and decompression bombs refused).

Writers: :func:`write_atomic` / :func:`write_json_atomic` write through a temporary file in the same folder and a
rename, remove the temporary file when the write fails, and name the file and the cause (disk full, permission) in
a :class:`FileWriteError`. :func:`file_digest` is a file's SHA-256 (the identity of a model file).

Every refusal is a :class:`DamagedFileError` (a ``ValueError``) or :class:`UnsafeCheckpointError`, or
``FileNotFoundError`` for a path that does not exist.
"""
from __future__ import annotations

import errno
import gzip
import json
import os
import pathlib
import pickle
import re
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "DamagedFileError",
    "FileWriteError",
    "ImageDecodeError",
    "file_digest",
    "image_to_uint8",
    "read_image",
    "write_atomic",
    "write_json_atomic",
    "UnsafeCheckpointError",
    "check_idx",
    "check_zip",
    "read_checkpoint",
    "read_idx",
    "read_json",
    "read_safetensors",
    "read_state_dict",
    "remove_stale_temp_files",
    "write_text_atomic",
]

PathLike = str | os.PathLike


class DamagedFileError(ValueError):
    """A file exists but cannot be read as what it should be; the message names the file, the problem and the fix."""

    def __init__(self, path: PathLike, problem: str, fix: str) -> None:
        self.path, self.problem, self.fix = str(path), problem, fix
        super().__init__(f"{self.path!r}: {problem}; {fix}")


class UnsafeCheckpointError(DamagedFileError):
    """A checkpoint's pickle refers to Python code; it was refused before anything in it ran."""


class FileWriteError(OSError):
    """A file could not be written; the message names the file and the cause (disk full, permission, ...)."""


_WRITE_CAUSES = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
                 errno.EACCES: "permission denied", errno.EPERM: "permission denied", errno.EROFS: "the file system is read-only",
                 errno.ENOENT: "the folder does not exist", errno.EFBIG: "the file is too large for the file system"}


def write_error(path: PathLike, err: BaseException, what: str = "file") -> FileWriteError:
    """A :class:`FileWriteError` naming ``path`` and the cause of ``err`` (an ``OSError``'s errno in words)."""
    code = getattr(err, "errno", None)
    cause = _WRITE_CAUSES.get(code, "") if code is not None else ""
    detail = getattr(err, "strerror", None) or str(err) or type(err).__name__
    text = f"{cause} ({detail})" if cause else detail
    out = FileWriteError(f"could not write the {what} {str(path)!r}: {text}; nothing was replaced "
                         "(free space or fix the permissions, then run again)")
    out.errno = code or errno.EIO  # one-argument OSError: its text is the sentence alone
    return out


class _RecordingWriter:
    """A binary file that remembers the first ``OSError`` of a write: a writer that catches it (``torch.save``'s
    zip writer reports only "unexpected pos") no longer hides the cause."""

    def __init__(self, f: Any) -> None:
        self.f, self.error = f, None

    def write(self, data: Any) -> int:
        try:
            return self.f.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)


def write_atomic(path: PathLike, write: Any, what: str = "file", prefix: str | None = None) -> None:
    """Write ``path`` through ``write(binary_file)`` into a temporary file beside it, fsync, then rename.

    A failure (disk full, permission, an exception of ``write``) leaves the previous file untouched, removes the
    temporary file and raises :class:`FileWriteError` naming ``path`` and the cause (other exceptions pass through
    unchanged after the clean-up). The temporary file is ``.<name>.<random>.tmp`` (``prefix`` overrides
    ``.<name>.``), so :func:`remove_stale_temp_files` can find what a killed process left.
    """
    import tempfile

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=prefix or f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        raise write_error(path, err, what) from None
    recorder = None
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; the result is an ordinary file
        with os.fdopen(fd, "wb") as f:
            recorder = _RecordingWriter(f)
            write(recorder)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        if os.path.exists(tmp):
            os.unlink(tmp)
        cause = recorder.error if recorder is not None and recorder.error is not None else err
        if isinstance(cause, OSError) and not isinstance(cause, FileWriteError):
            raise write_error(path, cause, what) from None
        if isinstance(err, RuntimeError) and "pos" in str(err):  # torch's zip writer lost the cause: say what is known
            raise write_error(path, OSError(errno.EIO, f"the writer failed ({_first_line(err)})"), what) from None
        raise
    try:  # make the rename itself durable
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def write_json_atomic(path: PathLike, obj: Any, what: str = "JSON file") -> None:
    """Write ``obj`` as JSON through :func:`write_atomic`: a killed call leaves the previous file, never half of one."""
    data = json.dumps(obj, indent=2, default=str).encode()
    write_atomic(path, lambda f: f.write(data), what)


def remove_stale_temp_files(folder: PathLike, name: str) -> list[Path]:
    """Remove the temporary files :func:`write_atomic` left for ``folder/name`` (``.<name>.*.tmp``: a process killed
    mid-write). Call it when the run that owns ``name`` starts again; returns what was removed."""
    folder = Path(folder)
    removed = []
    if folder.is_dir():
        for tmp in folder.glob(f".{name}.*.tmp"):
            try:
                tmp.unlink()
                removed.append(tmp)
            except OSError:
                pass
    return removed


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def file_digest(path: PathLike, algorithm: str = "sha256") -> str:
    """The hex digest of a file's bytes (read in 1 MiB blocks); cached per (path, size, mtime) within the process.
    A folder (a sharded checkpoint) digests its files' names and digests, in name order."""
    import hashlib

    path = Path(path)
    if path.is_dir():
        h = hashlib.new(algorithm)
        for child in sorted(p for p in path.iterdir() if p.is_file()):
            h.update(f"{child.name}\0{file_digest(child, algorithm)}\0".encode())
        return h.hexdigest()
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns, algorithm)
    if key not in _DIGESTS:
        h = hashlib.new(algorithm)
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


_DIGESTS: dict[tuple[str, int, int, str], str] = {}


def _existing_file(path: PathLike, what: str) -> Path:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{what} {str(path)!r} does not exist")
    if not path.is_file():
        raise DamagedFileError(path, f"is a directory, not a {what} file", f"pass the {what} file itself")
    if path.stat().st_size == 0:
        raise DamagedFileError(path, f"is empty (0 bytes), not a {what}", "the write or download was interrupted: write or download it again")
    return path


def _first_line(err: BaseException) -> str:
    """``Type: first sentence`` of an error (PyTorch's and miniz's texts go on for lines)."""
    text = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {text.split('. ')[0][:160]}"


# ----------------------------------------------------------------------------------------------------------------
# checkpoints
# ----------------------------------------------------------------------------------------------------------------
#: Globals a vispe checkpoint may hold besides what ``weights_only`` allows by default. Lightning checkpoints written
#: by ``vispe fit`` need none (hyper-parameters, callback, optimizer and scheduler states are dicts, lists, numbers,
#: strings and tensors); a path given as a ``pathlib`` object in Python lands in the hyper-parameters as one, and
#: rebuilding a path runs nothing. Only plain data types belong here, never a callable.
SAFE_GLOBALS: tuple[Any, ...] = (pathlib.PosixPath, pathlib.PurePosixPath)

_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def read_checkpoint(path: PathLike, map_location: Any = "cpu", what: str = "checkpoint") -> Any:
    """``torch.load(path, weights_only=True)`` with errors that say what is wrong with the file.

    Raises :class:`UnsafeCheckpointError` when the pickle refers to a Python global that is not plain data (the
    reference is refused by PyTorch's weights-only unpickler before it is looked up or called), and
    :class:`DamagedFileError` for an empty, truncated or random file.
    """
    if Path(path).is_dir() and (Path(path) / ".metadata").is_file():
        return _read_distributed_checkpoint(Path(path), map_location, what)
    path = _existing_file(path, what)
    try:
        with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        found = _GLOBAL.search(str(err))
        if found is not None:
            raise UnsafeCheckpointError(
                path,
                f"the {what} refers to the Python object {found.group(1)!r}, which is code or a class, not tensors and plain data; "
                "vispe loads checkpoints with torch.load(weights_only=True) and never runs anything stored in a file",
                "re-save only the weights (torch.save(model.state_dict(), path), or safetensors) from a copy you trust",
            ) from None
        raise DamagedFileError(
            path, f"is not a PyTorch {what} or is damaged ({_first_line(err)})",
            "check that it is the right file and download or save it again",
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, struct.error, zipfile.BadZipFile, IndexError) as err:
        size = path.stat().st_size
        raise DamagedFileError(
            path, f"is truncated or not a PyTorch {what} ({size} bytes; {_first_line(err)})",
            "the write or download was probably interrupted: save or download it again",
        ) from None


def _read_distributed_checkpoint(path: Path, map_location: Any, what: str) -> Any:
    """A sharded checkpoint folder (``torch.distributed.checkpoint``: Lightning's ``ModelParallelStrategy`` / FSDP)
    read whole in one process: the shards consolidated by ``dcp_to_torch_save`` (no process group) into a temporary
    file, loaded like any checkpoint, plus Lightning's ``meta.pt`` (epoch, step, loops, hyper-parameters)."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        full = Path(tmp) / "consolidated.pt"
        try:
            dcp_to_torch_save(path, full)
        except Exception as err:  # a missing or damaged shard
            raise DamagedFileError(
                path, f"is a sharded {what} that cannot be read whole ({_first_line(err)})",
                "check that every rank's shard file (__N_0.distcp) is in the folder",
            ) from None
        ckpt = read_checkpoint(full, map_location, what)
    meta = path / "meta.pt"
    if meta.is_file():
        ckpt.update(read_checkpoint(meta, map_location, what))
    return ckpt


def read_safetensors(path: PathLike, what: str = "safetensors file") -> dict[str, torch.Tensor]:
    """Tensors of a ``.safetensors`` file, after checking that its header fits in the file."""
    from safetensors.torch import load_file

    path = _existing_file(path, what)
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
    header_len = struct.unpack("<Q", head)[0] if len(head) == 8 else None
    if header_len is None or header_len + 8 > size:
        raise DamagedFileError(
            path, f"is truncated or not a safetensors file (header says {header_len} header bytes, the file has {size})",
            "download or save it again",
        )
    try:
        return load_file(str(path))
    except Exception as err:  # safetensors raises SafetensorError (not exported under a stable name) for bad data
        raise DamagedFileError(path, f"is a damaged safetensors file ({_first_line(err)})", "download or save it again") from None


def read_state_dict(path: PathLike, what: str = "checkpoint") -> Any:
    """A ``.safetensors`` file or a PyTorch checkpoint (``weights_only``), chosen by the suffix."""
    if str(path).endswith(".safetensors"):
        return read_safetensors(path, what=f"{what} (safetensors)")
    return read_checkpoint(path, what=what)


# ----------------------------------------------------------------------------------------------------------------
# zip archives
# ----------------------------------------------------------------------------------------------------------------
def check_zip(path: PathLike, what: str = "zip archive", member_suffix: str | None = None) -> list[str]:
    """Member names of a zip archive, after checking it is one and is complete; cheap (reads the directory only).

    A zip cut short loses its central directory (at the end), so truncation is caught here; a member whose data
    would lie past the end of the file is reported too. ``member_suffix`` requires at least one such member.
    """
    path = _existing_file(path, what)
    size = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as z:
            infos = z.infolist()
    except zipfile.BadZipFile as err:
        raise DamagedFileError(
            path, f"is not a zip archive or is cut short ({err}; {size} bytes), so not a valid {what}", "download or copy the archive again"
        ) from None
    past_end = [i.filename for i in infos if i.header_offset + i.compress_size > size]
    if past_end:
        raise DamagedFileError(path, f"is cut short: member {past_end[0]!r} lies past the end of the file ({what})", "download or copy the archive again")
    names = [i.filename for i in infos]
    if member_suffix is not None and not any(n.lower().endswith(member_suffix) for n in names):
        raise DamagedFileError(path, f"holds no {member_suffix} members ({len(names)} members)", f"check that it is the {what}")
    return names


# ----------------------------------------------------------------------------------------------------------------
# IDX (raw or gzip)
# ----------------------------------------------------------------------------------------------------------------
_IDX_DTYPES = {0x08: np.uint8}


def _idx_header(head: bytes, path: Path) -> tuple[int, tuple[int, ...]]:
    """(header length, shape) from the first bytes of an IDX stream."""
    if len(head) < 4 or head[0] != 0 or head[1] != 0:
        raise DamagedFileError(path, "is not an IDX file (bad magic number)", "check that it is a Fashion-MNIST/MNIST IDX file")
    if head[2] not in _IDX_DTYPES:
        raise DamagedFileError(path, f"is an IDX file of element type 0x{head[2]:02x}; only unsigned bytes (0x08) are read", "use the official IDX files")
    ndim = head[3]
    if ndim < 1 or len(head) < 4 + 4 * ndim:
        raise DamagedFileError(path, "has a truncated IDX header", "download the file again")
    shape = struct.unpack(f">{ndim}I", head[4:4 + 4 * ndim])
    return 4 + 4 * ndim, tuple(shape)


def check_idx(path: PathLike, what: str = "IDX file") -> tuple[int, ...]:
    """Shape of an IDX file (raw or ``.gz``) after checking its length against its header; no decompression beyond the header."""
    path = _existing_file(path, what)
    gz = str(path).endswith(".gz")
    try:
        with (gzip.open(path, "rb") if gz else path.open("rb")) as f:
            head = f.read(4 + 4 * 4)
    except (OSError, EOFError, zlib.error) as err:
        raise DamagedFileError(path, f"is not a readable {'gzip ' if gz else ''}{what} ({_first_line(err)})", "download the file again") from None
    header_len, shape = _idx_header(head, path)
    expected = header_len + int(np.prod(shape))
    if gz:
        with path.open("rb") as f:  # gzip's trailer holds the uncompressed length mod 2**32
            f.seek(-4, os.SEEK_END)
            stored = struct.unpack("<I", f.read(4))[0]
        if stored != expected % 2**32:
            raise DamagedFileError(
                path, f"is a truncated or damaged gzip file: its header promises shape {shape} ({expected} bytes), "
                      f"its gzip trailer says {stored} bytes", "download the file again",
            )
    elif path.stat().st_size != expected:
        raise DamagedFileError(path, f"has {path.stat().st_size} bytes, its header promises shape {shape} ({expected} bytes)", "download the file again")
    return shape


def read_idx(path: PathLike, what: str = "IDX file") -> np.ndarray:
    """Read an unsigned-byte IDX file (``.gz`` or raw) into an array of the header's shape."""
    path = _existing_file(path, what)
    gz = str(path).endswith(".gz")
    try:
        with (gzip.open(path, "rb") if gz else path.open("rb")) as f:
            data = f.read()
    except (OSError, EOFError, zlib.error) as err:
        raise DamagedFileError(path, f"is a truncated or damaged {'gzip ' if gz else ''}{what} ({_first_line(err)})", "download the file again") from None
    header_len, shape = _idx_header(data[:4 + 4 * 4], path)
    payload = np.frombuffer(data, dtype=np.uint8, offset=min(header_len, len(data)))
    if payload.size != int(np.prod(shape)):
        raise DamagedFileError(path, f"holds {payload.size} data bytes, its header promises shape {shape}", "download the file again")
    return payload.reshape(shape)


# ----------------------------------------------------------------------------------------------------------------
# JSON
# ----------------------------------------------------------------------------------------------------------------
def write_text_atomic(path: PathLike, text: str, what: str = "file") -> None:
    """Write ``text`` (UTF-8) through :func:`write_atomic`: a killed or failed write leaves the previous file."""
    data = text.encode("utf-8")
    write_atomic(path, lambda f: f.write(data), what)


def read_json(path: PathLike, what: str = "JSON file") -> Any:
    """Parse a JSON file; a syntax error names the file, line and column."""
    path = _existing_file(path, what)
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark is not JSON's first character
    except UnicodeDecodeError as err:
        raise DamagedFileError(path, f"is not UTF-8 text ({err.reason} at byte {err.start}), so not a {what}", "pass the JSON file itself") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise DamagedFileError(
            path, f"is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}), so not a {what}",
            "fix the file or write it again",
        ) from None


# ----------------------------------------------------------------------------------------------------------------
# images: the one decoder of training, evaluation and the resolution sweep
# ----------------------------------------------------------------------------------------------------------------
class ImageDecodeError(DamagedFileError):
    """An image file cannot be decoded into pixels vispe can trust (unreadable, a mode without a rule, values out of
    range, non-finite pixels, a decompression bomb); the message names the file and what is wrong."""


#: How each PIL mode becomes ``uint8`` pixels (one grey channel or three RGB channels). Documented in
#: docs/files-and-inputs.md; a mode not listed is refused naming the file and the mode.
IMAGE_MODE_RULES: dict[str, str] = {
    "L": "grey, as stored",
    "1": "grey: 0 -> 0, 1 -> 255",
    "RGB": "as stored",
    "RGBX": "RGB (the padding byte dropped)",
    "RGBA": "RGB composited over black (each channel x alpha / 255)",
    "RGBa": "RGB as stored (already multiplied by alpha)",
    "LA": "grey composited over black (grey x alpha / 255)",
    "La": "grey as stored (already multiplied by alpha)",
    "P": "palette colours -> RGB; a transparent palette entry is composited over black",
    "PA": "palette colours -> RGB composited over black",
    "CMYK": "RGB by PIL's formula (R = 255 - min(255, C + K), ...; no ICC profile applied)",
    "YCbCr": "RGB by PIL's conversion", "LAB": "RGB by PIL's conversion", "HSV": "RGB by PIL's conversion",
    "I;16": "16-bit grey scaled by its bit depth: round(v x 255 / 65535)",
    "I;16L": "16-bit grey, as I;16", "I;16B": "16-bit grey, as I;16", "I;16N": "16-bit grey, as I;16",
    "I": "32-bit integer grey read as 16-bit: values must lie in [0, 65535], then as I;16",
    "F": "32-bit float grey: values must be finite and in [0, 1], then round(v x 255)",
}


def _image_name(source: Any, name: str | None) -> str:
    return name if name is not None else str(source)


def image_to_uint8(img: Any, name: str = "image") -> torch.Tensor:
    """A PIL image -> ``uint8`` ``(C, H, W)`` (``C`` = 1 grey or 3 RGB) by the rule of its mode (:data:`IMAGE_MODE_RULES`).

    A mode without a rule, integer values outside 16 bits, float values outside ``[0, 1]`` and non-finite pixels
    raise :class:`ImageDecodeError` naming ``name`` (the file) and the mode. A multi-frame file (GIF, TIFF pages)
    gives its first frame; the EXIF orientation is not applied (as torchvision's loader).
    """
    mode = img.mode
    if mode not in IMAGE_MODE_RULES:
        raise ImageDecodeError(name, f"is a {mode!r} image, a PIL mode vispe has no conversion rule for",
                               f"convert it to 8-bit RGB or grey, or 16-bit grey (modes vispe reads: {sorted(IMAGE_MODE_RULES)})")
    if mode in ("L", "RGB"):
        a = np.asarray(img)
    elif mode == "1":
        a = np.asarray(img.convert("L"))
    elif mode in ("RGBX", "RGBa", "La"):
        a = np.asarray(img)[..., :3] if mode != "La" else np.asarray(img)[..., 0]
    elif mode in ("RGBA", "LA", "P", "PA"):
        if mode == "P" and "transparency" not in img.info:
            a = np.asarray(img.convert("RGB"))
        else:
            rgba = np.asarray(img.convert("RGBA") if mode in ("P", "PA") else img).astype(np.float32)
            a = np.rint(rgba[..., :-1] * (rgba[..., -1:] / 255.0)).astype(np.uint8)
            if mode == "LA":
                a = a[..., 0]
    elif mode in ("CMYK", "YCbCr", "LAB", "HSV"):
        a = np.asarray(img.convert("RGB"))
    elif mode.startswith("I"):
        v = np.asarray(img).astype(np.int64)
        if v.size and (v.min() < 0 or v.max() > 65535):
            raise ImageDecodeError(name, f"is a {mode!r} (32-bit integer) image with values in [{v.min()}, {v.max()}]; "
                                         "vispe reads integer images as 16-bit values in [0, 65535]",
                                   "save it as 8-bit or 16-bit grey, or scale it into [0, 65535]")
        a = np.rint(v * (255.0 / 65535.0)).astype(np.uint8)
    else:  # "F"
        v = np.asarray(img, dtype=np.float32)
        bad = ~np.isfinite(v)
        if bad.any():
            y, x = np.argwhere(bad)[0]
            raise ImageDecodeError(name, f"holds {int(bad.sum())} non-finite pixels (NaN or inf; the first at row {y}, column {x}) "
                                         "in a float ('F') image", "fix or drop the image")
        if v.size and (v.min() < 0 or v.max() > 1):
            raise ImageDecodeError(name, f"is a float ('F') image with values in [{v.min():g}, {v.max():g}]; vispe reads float "
                                         "images as values in [0, 1]", "scale it into [0, 1] or save it as 8/16-bit")
        a = np.rint(v * 255.0).astype(np.uint8)
    t = torch.from_numpy(np.array(a, dtype=np.uint8, order="C", copy=True))
    return t[None] if t.ndim == 2 else t.permute(2, 0, 1).contiguous()


def read_image(source: PathLike | bytes, name: str | None = None) -> torch.Tensor:
    """Decode an image file (a path, or its bytes with ``name`` for messages) -> ``uint8`` ``(C, H, W)`` through
    :func:`image_to_uint8`. Unreadable or truncated data and decompression bombs (more than twice
    ``PIL.Image.MAX_IMAGE_PIXELS``) raise :class:`ImageDecodeError` naming the file; a missing path ``FileNotFoundError``."""
    import io

    from PIL import Image

    label = _image_name(source, name)
    if not isinstance(source, (bytes, bytearray)) and not Path(source).is_file():
        raise FileNotFoundError(f"image {label!r} does not exist")
    try:
        with Image.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source) as img:
            img.load()
            return image_to_uint8(img, label)
    except Image.DecompressionBombError as err:
        raise ImageDecodeError(label, f"is refused as a possible decompression bomb ({err})",
                               "if the file is trusted, raise PIL.Image.MAX_IMAGE_PIXELS before reading it") from None
    except ImageDecodeError:
        raise
    except (OSError, ValueError, EOFError, SyntaxError, struct.error, zlib.error) as err:
        raise ImageDecodeError(label, f"is not a readable image ({_first_line(err)})",
                               "check the file, or remove it from the set") from None


def image_loader(path: str) -> torch.Tensor:
    """``torchvision.datasets.ImageFolder``'s ``loader``: :func:`read_image` (a module-level function, so it pickles)."""
    return read_image(path)
