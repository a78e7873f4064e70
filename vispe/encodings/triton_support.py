"""What the Triton kernels of :mod:`vispe.encodings.triton_rotary` and :mod:`vispe.encodings.triton_bias` share: whether
Triton imports, whether a device can run them, and building a kernel for a device.

A kernel source is a plain function in a module of its own (``_triton_*_kernel.py``); it becomes ``triton.jit(fn)`` for
CUDA tensors and Triton's ``InterpretedFunction(fn)`` for CPU tensors when ``TRITON_INTERPRET=1`` (slow; for tests).
"""
from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["interpreter_enabled", "kernel_for", "on_device", "triton_unavailable"]


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


def triton_unavailable(what: str, device: torch.device | str | None = None) -> str | None:
    """Why ``what`` (a kernel's name, for the message) cannot run on ``device`` (``None``: it can); without a device,
    only whether Triton imports."""
    err = _triton_import_error()
    if err is not None:
        return f"Triton does not import ({err})"
    if device is None:
        return None
    kind = torch.device(device).type
    if kind == "cuda" or (kind == "cpu" and interpreter_enabled()):
        return None
    return f"{what} runs CUDA tensors (CPU ones only in Triton's interpreter, TRITON_INTERPRET=1), not {kind}"


@functools.cache
def kernel_for(fn: Callable[..., Any], compiled: bool) -> Any:
    """``fn`` as a launchable kernel: ``triton.jit(fn)`` (``compiled``) or ``InterpretedFunction(fn)``."""
    if compiled:
        import triton

        return triton.jit(fn)
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(fn)


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Launch on ``t``'s CUDA device (a no-op for CPU tensors)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()
