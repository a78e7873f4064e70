"""Run folders: where ``vispe fit`` writes a run (``<save_dir>/<name>/version_N/checkpoints``) and where a resume
(``--ckpt_path last``, the benchmarks' skip-if-trained) finds it. No Lightning import: the benchmarks read run
folders without training."""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["find_last_checkpoint", "is_distributed_checkpoint"]


def _version_number(path: Path) -> int:
    try:
        return int(path.name.split("_", 1)[1])
    except (IndexError, ValueError):
        return -1


def find_last_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The ``last.ckpt`` to resume a run from: in the newest ``version_N/checkpoints`` of ``run_dir`` that has
    one (``<save_dir>/<name>``), else the unversioned ``run_dir/checkpoints`` of older vispe runs; ``None`` if
    there is none. A sharded run's ``last.ckpt`` is a folder (a distributed checkpoint: ``.metadata`` and one shard
    file per rank), a single-process run's a file."""
    run_dir = Path(run_dir)
    versions = sorted((d for d in run_dir.glob("version_*") if d.is_dir()), key=_version_number, reverse=True)
    for folder in [*(v / "checkpoints" for v in versions), run_dir / "checkpoints"]:
        last = folder / "last.ckpt"
        if last.is_file() or is_distributed_checkpoint(last):
            return last
    return None


def is_distributed_checkpoint(path: str | os.PathLike) -> bool:
    """A folder written by ``torch.distributed.checkpoint`` (Lightning's ``ModelParallelStrategy`` / FSDP with
    ``save_distributed_checkpoint``)."""
    return Path(path).is_dir() and (Path(path) / ".metadata").is_file()
