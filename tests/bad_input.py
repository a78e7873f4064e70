"""Shared by the bad-input battery tests (issue 32): one way to say "this input gets an early, clear error".

Each battery case is a test whose id starts with its category (``options``, ``images``, ``positions``,
``checkpoints``, ``data``, ``cli``, ``faults``), so ``pytest -q -rA tests/test_bad_input_*.py`` counts them
per category. A case vispe does not handle yet is marked ``xfail(strict=True)`` with the reason, never dropped.
"""
from __future__ import annotations

import errno
from typing import Callable, Iterable

import pytest

CATEGORIES = ("options", "images", "positions", "checkpoints", "data", "cli", "faults")

#: Exceptions that count as a clear, early refusal (a shape error from deep inside is a RuntimeError/IndexError
#: whose text names no option: the needles below are what separate the two).
CLEAR_ERRORS = (ValueError, TypeError, FileNotFoundError, RuntimeError, OSError, KeyError, IndexError)


def expect_clear_error(fn: Callable[[], object], needles: Iterable[str], exc: type | tuple = CLEAR_ERRORS) -> BaseException:
    """Run ``fn`` and require an exception of ``exc`` whose message contains every needle (case-insensitive).

    ``needles`` are what a user needs to read to fix the input: the option's name, the bad value, the file.
    """
    with pytest.raises(exc) as info:
        fn()
    text = str(info.value).lower()
    missing = [n for n in needles if str(n).lower() not in text]
    assert not missing, f"error {type(info.value).__name__}: {info.value!s} does not name {missing}"
    return info.value


class _FullDisk:
    """A file whose writes fail as on a full disk once ``after`` bytes are written (what the OS does, not torch)."""

    def __init__(self, f, after):
        self.f, self.after, self.written = f, after, 0

    def write(self, data):
        self.written += len(data)
        if self.written > self.after:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def full_disk(monkeypatch, after: int) -> None:
    """Every file vispe opens for writing through ``os.fdopen`` (its atomic writer) fills the disk after ``after`` bytes."""
    import os

    real = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda *a, **k: _FullDisk(real(*a, **k), after))
