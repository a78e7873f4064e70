"""Small argument checks shared across vispe (one wording for every bad-option error).

:func:`check_choice` is the one bad-choice message. The option rules below (:class:`Real`, :class:`Int`,
:class:`Bool`, :class:`Choice`, :class:`Ints`, :class:`Seq`, :class:`AnyOf`, :class:`Satisfies`) are declared once per option
(an encoding's ``option_checks``, a position scheme's options) and raise, before anything is built,
``TypeError`` (wrong type) or ``ValueError`` (out of range) naming the option, the bad value and what
is valid: ``"rope_axial: theta=0 is not valid; it must be a finite number > 0"``.
"""
from __future__ import annotations

import difflib
import math
import numbers
from typing import Any, Iterable, Sequence

__all__ = ["check_choice", "did_you_mean", "OptionCheck", "Real", "Int", "Bool", "Str", "Choice", "Ints", "Seq", "AnyOf", "Satisfies", "check_options"]


def did_you_mean(value: Any, choices: Iterable[Any], n: int = 3) -> str:
    """``"; did you mean 'smoke'?"`` for the choices closest to a misspelt ``value``, ``""`` when none is close.

    Appended to every "choose one of" message: in a list of 43 names the near miss is hard to spot.
    """
    names = [str(c) for c in choices]
    close = difflib.get_close_matches(str(value), names, n=n, cutoff=0.6)
    if not close:  # a prefix or a part of a name ("rope" -> rope_axial, rope_mixed) is as good a hint
        low = str(value).lower()
        close = [c for c in names if len(low) >= 3 and low in c.lower()][:n]
    if not close:
        return ""
    return f"; did you mean {' or '.join(repr(c) for c in close)}?"


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> None:
    """Raise ``ValueError`` naming ``value`` and the valid ``choices`` unless ``value`` is one of them."""
    choices = list(choices)
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {choices}{did_you_mean(value, choices)}")


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


class OptionCheck:
    """One option's rule. ``check(name, value)`` raises or returns; :meth:`describe` is the valid range in words.

    ``optional=True`` also accepts ``None`` (the option's "default / off" value).
    """

    optional: bool = False

    def describe(self) -> str:
        raise NotImplementedError

    def _valid(self, value: Any) -> str | None:
        """``None`` if ``value`` is valid, else ``'type'`` or ``'value'`` (which exception to raise)."""
        raise NotImplementedError

    def check(self, name: str, value: Any) -> None:
        if value is None and self.optional:
            return
        bad = self._valid(value)
        if bad is not None:
            exc = TypeError if bad == "type" else ValueError
            got = f" (got {type(value).__name__})" if bad == "type" else ""
            none = " or None" if self.optional else ""
            raise exc(f"{name}={value!r} is not valid; it must be {self.describe()}{none}{got}")

    def is_valid(self, value: Any) -> bool:
        try:
            self.check("value", value)
        except (TypeError, ValueError):
            return False
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()}{' or None' if self.optional else ''})"


def _bounds(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    def show(v: float) -> str:  # an int bound in full (2**20, not 1.04858e+06)
        return str(v) if isinstance(v, int) else f"{v:g}"

    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {show(low)}")
    if high is not None:
        parts.append(f"{'<' if high_open else '<='} {show(high)}")
    return " and ".join(parts)


class Real(OptionCheck):
    """A finite real number (an ``int`` or ``float``, never a ``bool`` or a string) in ``[low, high]``;
    ``low_open`` / ``high_open`` exclude the bound (``Real(low=0, low_open=True)``: positive)."""

    def __init__(self, low: float | None = None, high: float | None = None, *, low_open: bool = False,
                 high_open: bool = False, optional: bool = False) -> None:
        self.low, self.high, self.low_open, self.high_open, self.optional = low, high, low_open, high_open, optional

    def describe(self) -> str:
        b = _bounds(self.low, self.high, self.low_open, self.high_open)
        return "a finite number" + (f" {b}" if b else "")

    def _valid(self, value: Any) -> str | None:
        if not _is_real(value):
            return "type"
        v = float(value)
        if not math.isfinite(v):
            return "value"
        if self.low is not None and (v <= self.low if self.low_open else v < self.low):
            return "value"
        if self.high is not None and (v >= self.high if self.high_open else v > self.high):
            return "value"
        return None


def Positive(optional: bool = False) -> Real:
    """A finite number > 0."""
    return Real(0, low_open=True, optional=optional)


__all__ += ["Positive"]


class Int(OptionCheck):
    """An integer (not a ``bool``, not a float such as ``2.0``) in ``[low, high]``, optionally a multiple of ``multiple_of``."""

    def __init__(self, low: int | None = None, high: int | None = None, *, multiple_of: int | None = None,
                 odd: bool = False, optional: bool = False) -> None:
        self.low, self.high, self.multiple_of, self.odd, self.optional = low, high, multiple_of, odd, optional

    def describe(self) -> str:
        b = _bounds(self.low, self.high, False, False)
        what = "an odd int" if self.odd else ("an even int" if self.multiple_of == 2 else "an int")
        if self.multiple_of not in (None, 2):
            what += f" multiple of {self.multiple_of}"
        return what + (f" {b}" if b else "")

    def _valid(self, value: Any) -> str | None:
        if not _is_int(value):
            return "type"
        if (self.low is not None and value < self.low) or (self.high is not None and value > self.high):
            return "value"
        if self.multiple_of and value % self.multiple_of:
            return "value"
        if self.odd and value % 2 == 0:
            return "value"
        return None


class Bool(OptionCheck):
    """Strictly ``True`` or ``False`` (``'no'``, ``0`` and ``1`` are refused: a string is always truthy)."""

    def __init__(self, optional: bool = False) -> None:
        self.optional = optional

    def describe(self) -> str:
        return "True or False"

    def _valid(self, value: Any) -> str | None:
        return None if isinstance(value, bool) else "type"


class Str(OptionCheck):
    """Any string (an undeclared ``str`` option: the type its annotation states)."""

    def __init__(self, optional: bool = False) -> None:
        self.optional = optional

    def describe(self) -> str:
        return "a string"

    def _valid(self, value: Any) -> str | None:
        return None if isinstance(value, str) else "type"


class Choice(OptionCheck):
    """One of ``choices`` (compared with ``==``; the message lists them)."""

    def __init__(self, choices: Iterable[Any], optional: bool = False) -> None:
        self.choices, self.optional = tuple(choices), optional

    def describe(self) -> str:
        return f"one of {list(self.choices)}"

    def _valid(self, value: Any) -> str | None:
        try:
            return None if value in self.choices else "value"
        except TypeError:  # unhashable / incomparable
            return "value"

    def check(self, name: str, value: Any) -> None:
        if value is None and self.optional:
            return
        if self._valid(value) is not None:
            check_choice(name, value, list(self.choices) + ([None] if self.optional else []))


class Seq(OptionCheck):
    """A list or tuple (not a string) whose every item passes ``item``; ``length`` (an int or a tuple of
    allowed lengths) and ``min_length`` bound its length, ``distinct`` forbids repeats."""

    def __init__(self, item: OptionCheck, *, length: int | Sequence[int] | None = None, min_length: int = 0,
                 distinct: bool = False, scalar_ok: bool = False, optional: bool = False) -> None:
        self.item, self.min_length, self.distinct, self.scalar_ok, self.optional = item, min_length, distinct, scalar_ok, optional
        self.length = (length,) if isinstance(length, int) else (None if length is None else tuple(length))

    def describe(self) -> str:
        if self.length is not None:
            n = " or ".join(str(x) for x in self.length)
            size = f"a sequence of {n}"
        elif self.min_length:
            size = f"a sequence of at least {self.min_length}"
        else:
            size = "a sequence of"
        extra = ", distinct" if self.distinct else ""
        single = " (or one such value)" if self.scalar_ok else ""
        return f"{size} items each {self.item.describe()}{extra}{single}"

    def _valid(self, value: Any) -> str | None:
        if self.scalar_ok and not isinstance(value, (list, tuple)):
            return self.item._valid(value)
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            return "type"
        if self.length is not None and len(value) not in self.length:
            return "value"
        if len(value) < self.min_length:
            return "value"
        for v in value:
            bad = self.item._valid(v) if v is not None or not self.item.optional else None
            if bad is not None:
                return bad
        if self.distinct and len(set(value)) != len(value):
            return "value"
        return None


def Ints(low: int | None = 1, *, length: int | Sequence[int] | None = None, min_length: int = 1, distinct: bool = False,
         scalar_ok: bool = False, optional: bool = False) -> Seq:
    """A non-empty sequence of ints ``>= low`` (sizes: ``grid_size``, ``patch_size``, ``sections``)."""
    return Seq(Int(low), length=length, min_length=min_length, distinct=distinct, scalar_ok=scalar_ok, optional=optional)


class AnyOf(OptionCheck):
    """Valid when any of ``checks`` accepts the value (e.g. a choice or a sequence of choices)."""

    def __init__(self, *checks: OptionCheck, optional: bool = False) -> None:
        self.checks, self.optional = checks, optional

    def describe(self) -> str:
        return " or ".join(c.describe() for c in self.checks)

    def _valid(self, value: Any) -> str | None:
        results = [c._valid(value) if not (value is None and c.optional) else None for c in self.checks]
        if any(r is None for r in results):
            return None
        return "type" if all(r == "type" for r in results) else "value"


class Satisfies(OptionCheck):
    """Any other rule: ``predicate(value)`` is true (e.g. a list of encoding specs); ``description`` says what
    is valid, in the words of :meth:`describe`."""

    def __init__(self, predicate: Any, description: str, optional: bool = False) -> None:
        self.predicate, self.description, self.optional = predicate, description, optional

    def describe(self) -> str:
        return self.description

    def _valid(self, value: Any) -> str | None:
        try:
            return None if self.predicate(value) else "value"
        except (TypeError, ValueError):
            return "type"


def check_options(owner: str, checks: dict[str, OptionCheck], values: dict[str, Any]) -> None:
    """Check every ``values[name]`` that has a rule in ``checks``; the error starts with ``owner``."""
    for name, value in values.items():
        rule = checks.get(name)
        if rule is None:
            continue
        try:
            rule.check(name, value)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{owner}: {e}") from None
