"""What the Triton kernels of :mod:`vispe.encodings.triton_rotary` and :mod:`vispe.encodings.triton_bias` share: whether
Triton imports, whether a device can run them, and launching a kernel so that ``torch.compile`` sees it.

The kernels are ordinary ``@triton.jit`` functions in modules of their own (``_triton_*_kernel.py``, imported only when
a kernel runs), and the operators that launch them are ``torch.library.triton_op`` s: inductor traces into them, so a
compiled model launches the kernels from its own generated code (no Python operator call around each) and fuses and
shares the operators' PyTorch work (layouts, casts, position-only tensors) with the rest of the graph.

CPU tensors run in Triton's interpreter, as Triton provides it: ``TRITON_INTERPRET=1`` set before Triton is imported
(``@triton.jit`` then builds interpreted functions, Triton's own library included). Slow; for tests.
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

import torch

__all__ = ["interpreter_enabled", "launch", "on_device", "triton_unavailable"]


def interpreter_enabled() -> bool:
    """``TRITON_INTERPRET=1``: Triton kernels may run CPU tensors in its interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


@functools.cache
def _triton_import_error() -> str | None:
    try:
        import triton.language  # noqa: F401  (Triton ships with PyTorch's CUDA builds)
    except Exception as exc:  # noqa: BLE001  (ImportError, or whatever a broken install raises)
        return f"{type(exc).__name__}: {exc}"
    return None


def _built_for_interpreter() -> bool:
    """Whether ``@triton.jit`` functions were built as interpreted ones (``TRITON_INTERPRET=1`` when Triton was imported):
    Triton's own ``tl.sum`` is one, so its type says."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


def triton_unavailable(what: str, device: torch.device | str | None = None) -> str | None:
    """Why ``what`` (a kernel's name, for the message) cannot run on ``device`` (``None``: it can); without a device,
    only whether Triton imports."""
    err = _triton_import_error()
    if err is not None:
        return f"Triton does not import ({err})"
    if device is None:
        return None
    kind = torch.device(device).type
    if kind == "cuda":
        return None
    if kind == "cpu" and interpreter_enabled():
        if _built_for_interpreter():
            return None
        return (f"{what} runs CPU tensors only in Triton's interpreter, which needs TRITON_INTERPRET=1 set before Triton "
                "is imported (this process imported it without)")
    return f"{what} runs CUDA tensors (CPU ones only in Triton's interpreter, TRITON_INTERPRET=1), not {kind}"


@functools.cache
def _traceable(kernel: Any) -> Any:
    """An interpreted kernel as a ``JITFunction`` that launches it in the interpreter: ``wrap_triton`` records only
    ``JITFunction`` s in a graph, so CPU tests trace the operators as a compiled CUDA model does."""
    from triton.runtime.jit import JITFunction

    class _InterpretedKernel(JITFunction):
        def __init__(self, interpreted: Any) -> None:
            super().__init__(interpreted.fn)
            self.interpreted = interpreted

        @property
        def cache_key(self) -> str:  # the kernel's interpreted helpers have no compiled cache key
            return "interpreted:" + self.src

        def __getitem__(self, grid: Any) -> Any:
            return self.interpreted[grid]

        def run(self, *args: Any, grid: Any, warmup: bool = False, **kwargs: Any) -> Any:
            return self.interpreted.run(*args, grid=grid, warmup=warmup, **kwargs)

    return _InterpretedKernel(kernel)


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """Launch ``kernel`` (a ``@triton.jit`` function) over ``grid`` on the first tensor argument's device, through
    ``torch.library.wrap_triton`` (inside a ``triton_op`` a compiled graph records the launch)."""
    from torch.library import wrap_triton
    from triton.runtime.jit import JITFunction

    first = next(a for a in args if isinstance(a, torch.Tensor))
    if not isinstance(kernel, JITFunction):  # interpreted: TRITON_INTERPRET=1 when Triton was imported
        kernel = _traceable(kernel)
    with on_device(first):
        wrap_triton(kernel)[grid](*args, **kwargs)


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Launch on ``t``'s CUDA device (a no-op for CPU tensors)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()
