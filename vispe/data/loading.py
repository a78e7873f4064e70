"""Where data lives and how a training loader resumes: the data root, and a sampler and loader whose position
inside an epoch is part of the checkpoint (used by every DataModule that trains from a map-style set)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Sequence, Union

import torch
from torch.utils.data import DataLoader, RandomSampler

__all__ = ["DATA_ROOT_ENV", "DEFAULT_DATA_ROOT", "EpochSeededRandomSampler", "NumWorkers", "ResumableDataLoader",
           "auto_num_workers", "auto_threads", "locate_recorded_paths", "resolve_data_path", "resolve_num_workers"]

#: Environment variable holding the folder that contains the dataset folders (``cifar10-jpeg/`` ...).
DATA_ROOT_ENV = "VISPE_DATA_ROOT"


#: Where datasets live when neither an argument nor ``$VISPE_DATA_ROOT`` says: ``data/`` in the working directory
#: (the top-level ``data/`` of a vispe checkout, whose READMEs describe each layout vispe reads).
DEFAULT_DATA_ROOT = Path("data")


def _placeholder(path: Path) -> bool:
    """A dataset folder of the checkout's ``data/`` that holds only its README (the data not put there yet)."""
    return path.is_dir() and all(p.name.lower() == "readme.md" for p in path.iterdir())


def resolve_data_path(explicit: str | os.PathLike | None, default_subdir: str, what: str, *, arg: str = "data_dir",
                      flag: str | None = None) -> Path:
    """Return the dataset location: ``explicit`` if given, else ``$VISPE_DATA_ROOT/<default_subdir>``, else
    ``data/<default_subdir>`` (:data:`DEFAULT_DATA_ROOT`).

    Raises ``FileNotFoundError`` naming the path that is missing and how to set it so a run fails at configuration
    time, before any training. ``arg`` is the argument that gives ``explicit`` and ``flag`` the command-line flag of
    the command being run that sets it (default: ``vispe fit``'s ``--data.init_args.<arg>``); ``$VISPE_DATA_ROOT`` is
    suggested only where it applies (a data set with a default folder, and no explicit path).
    """
    flag = flag or f"--data.init_args.{arg}"
    if explicit is not None and str(explicit) != "":
        path = Path(explicit).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"{what} not found at {str(path)!r} (given by {arg}: {flag}); check the path")
        return path
    if not default_subdir:
        raise FileNotFoundError(f"{what}: no path given; pass {flag} with the folder")
    if os.environ.get(DATA_ROOT_ENV):
        path = Path(os.environ[DATA_ROOT_ENV]).expanduser() / default_subdir
        if not path.exists():
            raise FileNotFoundError(f"{what} not found at {str(path)!r} (${DATA_ROOT_ENV}/{default_subdir}); put the files "
                                    f"there, or pass {flag} with their folder")
        return path
    path = DEFAULT_DATA_ROOT / default_subdir
    if not path.exists() or _placeholder(path):
        raise FileNotFoundError(
            f"no {what} at the default location {str(path)!r}: put the files there (see data/README.md), "
            f"pass {flag} /path/to/{default_subdir}, or set {DATA_ROOT_ENV} to the folder that contains {default_subdir}/"
        )
    return path


#: a DataLoader worker count, or ``"auto"`` (:func:`auto_num_workers`)
NumWorkers = Union[int, Literal["auto"]]


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _local_processes() -> int:
    """Processes of this job on this machine (torchrun / ``fabric run`` / Lightning's DDP launcher)."""
    for var in ("LOCAL_WORLD_SIZE", "LT_DEVICES"):
        value = os.environ.get(var, "")
        if value.strip().isdigit() and int(value) > 0:
            return int(value)
    return 1


def auto_threads() -> int:
    """Torch threads for one training process: its share of the cores this process may use, less what other work
    keeps busy (the 1-minute load average beyond this process), at least 1.

    On a shared machine more threads than free cores make every step wait for the slowest thread (CPU recipes ran
    4-11x slower at the default thread count than at one thread on a busy 2-core machine).
    """
    share = max(1, _cores() // _local_processes())
    try:
        busy = max(0.0, os.getloadavg()[0] - 1.0)  # this process is running now and counts as one
    except OSError:
        busy = 0.0
    return max(1, min(share, int(_cores() - busy)))


def auto_num_workers() -> int:
    """DataLoader workers for ``num_workers: auto``: one core of this process's share is left to the training
    loop and the rest (up to 4) load batches; a 1-core share loads in the main process (0)."""
    share = max(1, _cores() // _local_processes())
    return min(4, max(0, share - 1))


def resolve_num_workers(num_workers: Any) -> int:
    """``num_workers`` as a count: ``"auto"`` -> :func:`auto_num_workers`; a negative or other value raises
    ``ValueError`` naming it."""
    if num_workers == "auto":
        return auto_num_workers()
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers must be >= 0 (0: load in the main process) or 'auto', got {num_workers!r}")
    return int(num_workers)


#: data-module arguments that name a file or folder (a relative one is relative to where the run was made)
_PATH_ARG_SUFFIXES = ("_dir", "_root", "_path", "_manifest")
#: path arguments with a fallback of their own ($VISPE_DATA_ROOT, the default data/): a missing one is not an error here
_PATH_ARGS_WITH_DEFAULT = ("data_dir", "root", "data_path")


def locate_recorded_paths(init_args: dict[str, Any], run_cwd: str | None, what: str, fix: str) -> dict[str, Any]:
    """A data module's recorded arguments with relative paths resolved against ``run_cwd`` (the directory the run was
    made in, recorded in the checkpoint), so a checkpoint is usable from any directory.

    A relative path that exists from here is kept. One that exists nowhere raises ``FileNotFoundError`` naming it,
    where it was looked for, and ``fix`` (what to pass instead), except for the arguments that fall back to
    ``$VISPE_DATA_ROOT`` / ``data/`` (``data_dir``, ``root``, ``data_path``).
    """
    out = dict(init_args)
    gone = []
    for key, value in init_args.items():
        if key.startswith("_") or not isinstance(value, str) or not value or not (key.endswith(_PATH_ARG_SUFFIXES) or key == "root"):
            continue
        path = Path(value).expanduser()
        if path.exists():
            continue
        if not path.is_absolute() and run_cwd and (Path(run_cwd) / path).exists():
            out[key] = str(Path(run_cwd) / path)
        elif key not in _PATH_ARGS_WITH_DEFAULT:
            looked = [str(path)] + ([str(Path(run_cwd) / path)] if run_cwd and not path.is_absolute() else [])
            gone.append(f"{key}={value!r} (looked for at {' and '.join(repr(p) for p in dict.fromkeys(looked))})")
    if gone:
        raise FileNotFoundError(f"{what} reads {'; '.join(gone)}, which do not exist; {fix}")
    return out


class EpochSeededRandomSampler(RandomSampler):
    """A ``RandomSampler`` whose order depends only on ``(seed, epoch)``.

    Lightning calls ``set_epoch`` at every epoch start, so a run resumed from a checkpoint sees the
    same order as an uninterrupted one. Under DDP Lightning swaps it for a ``DistributedSampler``
    (it is a ``RandomSampler``), which is seeded per epoch as well. :meth:`skip_next` starts the next
    pass part-way through the epoch's order (a run resumed mid-epoch, see :class:`ResumableDataLoader`).
    """

    def __init__(self, data_source: Sequence[Any], seed: int = 0) -> None:
        super().__init__(data_source, generator=torch.Generator())
        self.seed = int(seed)
        self._skip = 0
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        self.generator.manual_seed(self.seed * 1_000_003 + int(epoch))

    def skip_next(self, n: int) -> None:
        """Leave out the first ``n`` indices of the next pass (the same permutation, drawn in full)."""
        self._skip = int(n)

    def __iter__(self):
        skip, self._skip = self._skip, 0
        order = iter(super().__iter__())
        for _ in range(skip):
            next(order, None)
        yield from order


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` that Lightning checkpoints: it remembers how many batches of the current epoch the
    training loop has taken, so a run killed mid-epoch and resumed continues with the next batch of the same
    epoch order instead of restarting the epoch (Lightning saves and restores any loader with
    ``state_dict`` / ``load_state_dict`` in the fit loop's state).

    Counting happens where batches leave the loader (after any worker prefetching), so the count is the
    number of batches the loop actually received. With :class:`EpochSeededRandomSampler` the resumed pass skips
    the consumed indices without loading them; with any other sampler (e.g. Lightning's ``DistributedSampler``
    under DDP) the consumed batches are drawn and dropped.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._taken = 0
        self._epoch: int | None = None
        self._resume: tuple[int | None, int] | None = None

    def _sampler_epoch(self) -> int | None:
        for s in (self.sampler, getattr(self.batch_sampler, "sampler", None)):
            if s is not None and hasattr(s, "epoch"):
                return int(s.epoch)
        return None

    def __iter__(self):
        epoch = self._sampler_epoch()
        skip = 0
        if self._resume is not None:
            resume_epoch, taken = self._resume
            self._resume = None
            if (resume_epoch is None or resume_epoch == epoch) and 0 < taken < len(self):
                skip = taken
        sampler = self.sampler
        if skip and isinstance(sampler, EpochSeededRandomSampler) and self.batch_size is not None:
            sampler.skip_next(skip * self.batch_size)
            batches = iter(super().__iter__())
        else:
            batches = iter(super().__iter__())
            for _ in range(skip):
                next(batches, None)
        self._epoch, self._taken = epoch, skip
        for batch in batches:
            self._taken += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "taken": self._taken}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume = (state.get("epoch"), int(state.get("taken", 0)))
