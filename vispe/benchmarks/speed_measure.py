"""Measuring one benchmarked model for ``vispe bench speed``: the model entry, a train / inference step,
timing on the chosen clock and peak memory (see :mod:`vispe.benchmarks.speed` for the method)."""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------
# One benchmarked model
# ----------------------------------------------------------------------------------------------

#: Numeric precisions a model is measured in: ``fp32``; ``amp_bf16`` = float32 weights, forward and loss under
#: ``torch.autocast(dtype=bfloat16)`` (the usual mixed-precision recipe); ``bf16`` = weights, inputs and optimizer
#: in bfloat16 ("pure" bf16; encodings keep their angle tables in float32 themselves).
PRECISIONS = ("fp32", "amp_bf16", "bf16")


@dataclass
class Entry:
    config: str
    label: str  # 'timm:ape', 'vispe:rope_axial', ...
    family: str  # 'timm' | 'vispe'
    encoding: str  # encoding name ('ape' for timm's APE)
    mode: str  # 'eager' | 'compile'
    model: nn.Module
    runner: nn.Module | Callable
    optimizer: torch.optim.Optimizer
    param_count: int
    build_s: float
    inner_train: int = 1
    inner_infer: int = 1
    train_s: list[float] = field(default_factory=list)  # per-step wall seconds, one value per round
    infer_s: list[float] = field(default_factory=list)
    train_cpu_s: list[float] = field(default_factory=list)  # per-step process CPU seconds
    infer_cpu_s: list[float] = field(default_factory=list)
    train_peak: float | None = None  # bytes
    infer_peak: float | None = None
    error: str | None = None
    precision: str = "fp32"  # one of PRECISIONS
    #: one profiled train step (``--profile``): op or kernel name -> {"ms": self time per step, "calls": per step}
    profile: dict[str, dict[str, float]] | None = None
    _cast: tuple[int, torch.Tensor] | None = None  # (id of the shared input, this entry's copy in its dtype)
    #: compiled entries: the graphs dynamo captured for the first train step (1: the step compiled whole; more: graph
    #: breaks, each with eager code between graphs) and the graphs compiled while timed (each a round that timed compilation)
    graphs_per_step: int | None = None
    compiles_in_timing: int = 0

    def input(self, x: torch.Tensor) -> torch.Tensor:
        """The benchmark input in this entry's dtype, cast once (not inside the timed steps)."""
        if self.precision != "bf16" or not x.is_floating_point():
            return x
        if self._cast is None or self._cast[0] != id(x):
            self._cast = (id(x), x.to(torch.bfloat16))
        return self._cast[1]

    def autocast(self) -> ContextManager:
        if self.precision != "amp_bf16":
            return contextlib.nullcontext()
        device = next((p.device.type for p in self.model.parameters()), "cpu")
        return torch.autocast(device_type=device, dtype=torch.bfloat16)


def graphs_compiled() -> int:
    """Graphs dynamo has captured in this process so far (a graph break or a recompilation adds one)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def median_backward_ms(fn: Callable[..., Any], args: Iterable[Any], grads: Any, reps: int) -> float:
    """:func:`median_call_ms` of one forward ``fn(*args)`` and its backward from the output gradients ``grads``."""
    args = tuple(args)

    def once() -> None:
        torch.autograd.backward(fn(*args), grads)

    return median_call_ms(once, reps)


@contextlib.contextmanager
def triton_mutation_fallbacks() -> Iterator[list[str]]:
    """PyTorch's warnings, within the block, that it could not read which arguments a Triton kernel writes from the
    kernel's Triton IR when tracing a graph around it (it then assumes every argument written and copies each): one
    message per kernel launch traced so. Empty where every compiled kernel was analysed (as on a GPU it should be)."""
    import logging

    names: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "assuming every input is mutated" in record.getMessage():
                names.append(record.getMessage())

    logger = logging.getLogger("torch._dynamo")  # where torch._higher_order_ops.triton_kernel_wrap logs it
    handler = Catch(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield names
    finally:
        logger.removeHandler(handler)


def write_probe(out_path: str, rows: list[dict], fallbacks: list[str], **meta: Any) -> None:
    """A kernel probe's JSON (results/speed/gpu-*.py): its rows, and the device, torch version, ``meta`` and the number
    of compiled kernel launches PyTorch could not analyse (:func:`triton_mutation_fallbacks`), which it also prints."""
    import json

    print(f"kernels compiled into graphs whose written arguments PyTorch could not read (each argument copied): {len(fallbacks)}")
    meta = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (interpreter check)",
            "torch": torch.__version__, **meta, "compiled_kernels_analysis_fallbacks": len(fallbacks)}
    with open(out_path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_call_ms(once: Callable[[], None], reps: int, warmup: int = 3) -> float:
    """Milliseconds of one call of ``once`` (kernel-level probes, results/speed/gpu-*.py): after ``warmup`` calls, the
    median of ``reps`` calls timed by CUDA events when CUDA is available, else the wall time of one call (a CPU run
    only checks that the probe works)."""
    for _ in range(warmup):
        once()
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        once()
        return (time.perf_counter() - t0) * 1e3
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        once()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return float(statistics.median(times))


def train_step(entry: Entry, x: torch.Tensor, y: torch.Tensor) -> None:
    entry.model.train()
    entry.optimizer.zero_grad(set_to_none=True)
    with entry.autocast():
        out = entry.runner(entry.input(x))
        loss = F.cross_entropy(out.float(), y)
    loss.backward()
    entry.optimizer.step()
    # free the gradients now: all models of a run live in one process, and each would otherwise
    # hold a full set of gradients between its steps
    entry.optimizer.zero_grad(set_to_none=True)


def infer_step(entry: Entry, x: torch.Tensor) -> None:
    entry.model.eval()
    with torch.inference_mode(), entry.autocast():
        entry.runner(entry.input(x))


def _timed(fn: Callable[[], None], n: int, device: torch.device) -> tuple[float, float]:
    """Seconds per call of ``fn``: (wall clock, CPU time of this process)."""
    _sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(n):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n


def _resident_bytes(entry: Entry, with_optimizer: bool) -> int:
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()

    for t in list(entry.model.parameters()) + list(entry.model.buffers()):
        add(t)
    if with_optimizer:
        for st in entry.optimizer.state.values():
            for v in st.values():
                if torch.is_tensor(v):
                    add(v)
    return total


def _cpu_step_peak(fn: Callable[[], None]) -> int:
    """Peak bytes allocated above the starting level during ``fn``, from the profiler's allocator events."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        ev = stack.pop()
        if ev.tag == _EventType.Allocation:
            events.append((ev.start_time_ns, ev.extra_fields.alloc_size))
        stack.extend(ev.children)
    events.sort()
    cur = peak = 0
    for _, nbytes in events:
        cur += nbytes
        peak = max(peak, cur)
    return peak


def measure_peak(entry: Entry, fn: Callable[[], None], device: torch.device, train: bool) -> float:
    if train:
        entry.optimizer.zero_grad(set_to_none=True)  # grads are allocated inside the step
    if device.type == "cuda":
        # every model of the run is resident on the device: count this model's own bytes plus the step's rise
        # above what was allocated before it, the same quantity as on CPU
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        step_peak = torch.cuda.max_memory_allocated(device) - before
        return float(_resident_bytes(entry, with_optimizer=train) + step_peak)
    return float(_resident_bytes(entry, with_optimizer=train) + _cpu_step_peak(fn))


#: Profiled steps per model (``--profile``): their mean is kept.
PROFILE_STEPS = 2


def _op_name(key: str) -> str:
    """A profiler key comparable across models: a compiled graph's call names the graph's hash, which differs per model."""
    if key.startswith("## Call CompiledFxGraph"):
        return "CompiledFxGraph (wrapper)"
    if key.startswith("Torch-Compiled Region:"):  # numbered per compiled frame
        return "Torch-Compiled Region"
    return key if len(key) <= 120 else key[:117] + "..."


def profile_step(fn: Callable[[], None], device: torch.device, steps: int = PROFILE_STEPS) -> dict[str, dict[str, float]]:
    """Self time per step of every op (CPU) or every kernel and copy (CUDA: device time) over ``steps`` calls of
    ``fn``, from ``torch.profiler``: where a step's time goes. Compiled CPU graphs show as their wrapper plus the
    ATen ops they call (inductor's own loops are not broken out)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    _sync(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        _sync(device)
    return op_times(prof.key_averages(), cuda, steps)


def op_times(averages: Iterable[Any], cuda: bool, steps: int) -> dict[str, dict[str, float]]:
    """The profiler's per-op averages as name -> {"ms": self time per step, "calls": per step}: CPU self time, or on
    CUDA the device events' own time (a CPU op's self device time is its kernels' time again, so CPU ops are left
    out there)."""
    from torch.autograd import DeviceType

    out: dict[str, dict[str, float]] = {}
    for ev in averages:
        if cuda and ev.device_type == DeviceType.CPU:
            continue
        us = ev.self_device_time_total if cuda else ev.self_cpu_time_total
        if us <= 0:
            continue
        slot = out.setdefault(_op_name(ev.key), {"ms": 0.0, "calls": 0.0})
        slot["ms"] += us / 1e3 / steps
        slot["calls"] += ev.count / steps
    return out
