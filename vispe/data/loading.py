"""Where data lives and how a training loader resumes: the data root, and a sampler and loader whose position
inside an epoch is part of the checkpoint (used by every DataModule that trains from a map-style set)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import torch
from torch.utils.data import DataLoader, RandomSampler

__all__ = ["DATA_ROOT_ENV", "DEFAULT_DATA_ROOT", "EpochSeededRandomSampler", "ResumableDataLoader", "resolve_data_path"]

#: Environment variable holding the folder that contains the dataset folders (``cifar10-jpeg/`` ...).
DATA_ROOT_ENV = "VISPE_DATA_ROOT"


#: Where datasets live when neither an argument nor ``$VISPE_DATA_ROOT`` says: ``data/`` in the working directory
#: (the top-level ``data/`` of a vispe checkout, whose READMEs describe each layout vispe reads).
DEFAULT_DATA_ROOT = Path("data")


def _placeholder(path: Path) -> bool:
    """A dataset folder of the checkout's ``data/`` that holds only its README (the data not put there yet)."""
    return path.is_dir() and all(p.name.lower() == "readme.md" for p in path.iterdir())


def resolve_data_path(explicit: str | os.PathLike | None, default_subdir: str, what: str) -> Path:
    """Return the dataset location: ``explicit`` if given, else ``$VISPE_DATA_ROOT/<default_subdir>``, else
    ``data/<default_subdir>`` (:data:`DEFAULT_DATA_ROOT`).

    Raises ``FileNotFoundError`` naming the path that is missing (and how to set it) so a run fails
    at configuration time, before any training.
    """
    if explicit is not None and str(explicit) != "":
        path = Path(explicit).expanduser()
        origin = "the data_dir argument"
    elif os.environ.get(DATA_ROOT_ENV):
        path = Path(os.environ[DATA_ROOT_ENV]).expanduser() / default_subdir
        origin = f"${DATA_ROOT_ENV}/{default_subdir}"
    else:
        path = DEFAULT_DATA_ROOT / default_subdir
        if not path.exists() or _placeholder(path):
            raise FileNotFoundError(
                f"no {what} at the default location {str(path)!r}: put the files there (see data/README.md), "
                f"pass data_dir (e.g. --data.data_dir /path/to/{default_subdir}) or set {DATA_ROOT_ENV} to the folder "
                f"that contains {default_subdir}/"
            )
        origin = f"the default data root {str(DEFAULT_DATA_ROOT)!r}"
    if not path.exists():
        raise FileNotFoundError(f"{what} not found at {str(path)!r} (from {origin}); check the path or set {DATA_ROOT_ENV}")
    return path



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
