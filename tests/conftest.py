"""Session settings shared by every test file.

The README's test command runs the suite in parallel (pytest-xdist, ``-n auto``: one worker process per core). torch
gives every process one thread per core, so each worker would run as many threads as the machine has cores and the
workers would oversubscribe them; each worker takes its share of the cores instead (a set ``OMP_NUM_THREADS`` wins).
"""
from __future__ import annotations

import collections
import os

import pytest

# Triton's interpreter runs the Triton kernels' tests on CPU tensors; Triton builds its functions (its own library's
# included) as interpreted ones only when this is set before it is imported, so it is set here, before any test
# module imports Triton (timm and lightning do). Not on a machine with CUDA, whose kernels would then be interpreted.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


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



def _stored_tensors(kernel, kwargs: dict) -> list[str] | None:
    """The tensor arguments an interpreted kernel of vispe's writes, read from its source (``None``: not one of
    vispe's interpreted kernels, or a store the source does not resolve)."""
    import torch
    from triton.runtime.jit import JITFunction
    from triton_compile import stored_arguments

    while not isinstance(kernel, JITFunction) and hasattr(kernel, "fn"):  # an Autotuner around the kernel
        kernel = kernel.fn
    if not isinstance(kernel, JITFunction) or not hasattr(kernel, "interpreted"):
        return None
    stored = stored_arguments(kernel.src, list(kwargs))
    return None if stored is None else [n for n in stored if isinstance(kwargs[n], torch.Tensor)]


@pytest.fixture
def triton_interpreter(monkeypatch):
    """Triton kernels run CPU tensors in Triton's interpreter for the test (``TRITON_INTERPRET=1``, set above before
    Triton's import); dynamo starts and ends clean, so no graph compiled around one kernel path is reused by another
    test. A compiled graph learns which tensors a kernel writes as on a GPU: there PyTorch reads it from the kernel's
    Triton IR, which needs a GPU driver; here from the kernel's stores in its source (PyTorch's own fallback assumes
    every argument written, which no GPU run does)."""
    import torch
    import torch._higher_order_ops.triton_kernel_wrap as wrap

    from vispe.encodings.triton_support import triton_unavailable

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    why = triton_unavailable("Triton's interpreter", "cpu")
    if why is not None:  # a CUDA machine: Triton was built for its compiler
        pytest.skip(why)
    pytorch_analysis = wrap.get_mutated_tensors

    def mutated(kernel_idx, constant_args_idx, kwargs, *args, **kw):
        stored = _stored_tensors(wrap.kernel_side_table.get_kernel(kernel_idx), kwargs)
        return pytorch_analysis(kernel_idx, constant_args_idx, kwargs, *args, **kw) if stored is None else stored

    monkeypatch.setattr(wrap, "get_mutated_tensors", mutated)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
