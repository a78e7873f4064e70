"""Shared by the bad-input battery tests (issue 32): one way to say "this input gets an early, clear error".

Each battery case is a test whose id starts with its category (``options``, ``images``, ``positions``,
``checkpoints``, ``data``, ``cli``, ``faults``), so ``pytest -q -rA tests/test_bad_input_*.py`` counts them
per category. A case vispe does not handle yet is marked ``xfail(strict=True)`` with the reason, never dropped.
"""
from __future__ import annotations

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
