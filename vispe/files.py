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
* JSON (manifests, specs): :func:`read_json` (line and column of a syntax error); results are written with
  :func:`write_json_atomic` (a temporary file and a rename).

Every refusal is a :class:`DamagedFileError` (a ``ValueError``) or :class:`UnsafeCheckpointError`, or
``FileNotFoundError`` for a path that does not exist.
"""
from __future__ import annotations

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
    "UnsafeCheckpointError",
    "check_idx",
    "check_zip",
    "read_checkpoint",
    "read_idx",
    "read_json",
    "read_safetensors",
    "read_state_dict",
    "write_json_atomic",
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
def write_text_atomic(path: PathLike, text: str) -> None:
    """Write ``text`` through a temporary file in the same folder and a rename: a killed or failed write leaves the
    previous file (never half of one) and no temporary file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_json(path: PathLike, what: str = "JSON file") -> Any:
    """Parse a JSON file; a syntax error names the file, line and column."""
    path = _existing_file(path, what)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DamagedFileError(path, f"is not UTF-8 text ({err.reason} at byte {err.start}), so not a {what}", "pass the JSON file itself") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise DamagedFileError(
            path, f"is not valid JSON ({err.msg} at line {err.lineno}, column {err.colno}), so not a {what}",
            "fix the file or write it again",
        ) from None


def write_json_atomic(path: PathLike, obj: Any) -> None:
    """Write ``obj`` as JSON through a temporary file and a rename: a killed call leaves the previous file, never half of one."""
    write_text_atomic(path, json.dumps(obj, indent=2, default=str))
