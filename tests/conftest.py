"""Session settings shared by every test file.

The README's test command runs the suite in parallel (pytest-xdist, ``-n auto``: one worker process per core). torch
gives every process one thread per core, so each worker would run as many threads as the machine has cores and the
workers would oversubscribe them; each worker takes its share of the cores instead (a set ``OMP_NUM_THREADS`` wins).
"""
from __future__ import annotations

import collections
import os

import pytest


def _worker_threads() -> int | None:
    """torch threads for this process: its share of the cores under xdist, ``None`` outside xdist or when
    ``OMP_NUM_THREADS`` is set (the user's choice)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers or os.environ.get("OMP_NUM_THREADS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // int(workers))


def pytest_configure(config) -> None:
    if hasattr(config.option, "loadscopereorder"):
        # hand out work in the order pytest_collection_modifyitems gives (xdist's default reorders groups by their
        # number of tests, which puts the few-test, long files last)
        config.option.loadscopereorder = False
    threads = _worker_threads()
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)  # the subprocesses the tests start (CLI runs, distributed ranks)


#: Files whose tests are independent long runs (the docs' commands, multi-process fits, benchmark commands): under the
#: README's ``--dist loadgroup`` their tests are shared out one by one. Every other file runs whole on one worker
#: (``xdist_group`` = its path), so its module fixtures and warm caches (dynamo, imports) are built once.
SPREAD_FILES = ("test_docs_commands.py", "test_distributed.py", "test_resolution_benchmark.py")


def pytest_collection_modifyitems(config, items) -> None:
    import pytest

    # files with the most `slow` tests first (stable: each file keeps its order), so that no worker is left with a
    # long file at the end while the other idles
    slow = collections.Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])
    for item in items:
        if item.path.name not in SPREAD_FILES:
            item.add_marker(pytest.mark.xdist_group(item.path.name))


def pytest_collection_finish(session) -> None:
    import gc

    # what exists now (torch, the collected items) lives for the session: out of the collector's sight, the full
    # collections that torch.compile's tracing triggers walk only what the tests made (~8 % of the compile tests' time)
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config) -> None:
    from vispe.cli import exit_without_final_collection

    # each xdist worker (and the controller) ends without the interpreter's last collection over the session's heap
    exit_without_final_collection()



@pytest.fixture
def triton_interpreter(monkeypatch):
    """Triton kernels run CPU tensors in Triton's interpreter for the test (``TRITON_INTERPRET=1``); dynamo starts and
    ends clean, so no graph compiled around one kernel path is reused by another test."""
    import torch

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
