"""Small argument checks shared across vispe (one wording for every bad-choice error)."""
from __future__ import annotations

from typing import Any, Iterable

__all__ = ["check_choice"]


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> None:
    """Raise ``ValueError`` naming ``value`` and the valid ``choices`` unless ``value`` is one of them."""
    choices = list(choices)
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {choices}")
