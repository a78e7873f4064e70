"""Session settings shared by every test file.

The README's test command runs the suite in parallel (pytest-xdist, ``-n auto``: one worker process per core). torch
gives every process one thread per core, so each worker would run as many threads as the machine has cores and the
workers would oversubscribe them; each worker takes its share of the cores instead (a set ``OMP_NUM_THREADS`` wins).
"""
from __future__ import annotations

import os


def _worker_threads() -> int | None:
    """torch threads for this process: its share of the cores under xdist, ``None`` outside xdist or when
    ``OMP_NUM_THREADS`` is set (the user's choice)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers or os.environ.get("OMP_NUM_THREADS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // int(workers))


def pytest_configure(config) -> None:
    threads = _worker_threads()
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the subprocesses the tests start (CLI runs, distributed ranks)
