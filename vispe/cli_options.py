"""One options layer for vispe's command lines and the Python functions behind them.

Each option is declared once, as an :class:`Option`: its Python name, its command-line flag, how command-line text
becomes a value (:func:`int_text`, :func:`floats_text`, :func:`json_object_text`, ...) and its rule (a
:mod:`vispe._checks` rule: type, range, finiteness). :class:`Options` builds the ``argparse`` arguments from the
declarations, turns a parsed namespace into checked values (errors name the ``--flag``), and checks the same
values passed from Python (errors name the keyword). Pairs of options that cannot be combined, or that need each
other, are :class:`Conflict` entries checked on both paths::

    OPTIONS = Options("vispe resolution", [
        Option("batch_size", Int(1), int_text, default=256, help="images per forward pass"),
        Option("sizes", SIZES_RULE, parse_shapes),
        Option("scales", Seq(Real(0, 64, low_open=True), min_length=1), floats_text),
    ], conflicts=[Conflict("sizes", "scales", "--sizes gives the shapes, --scales multiples of the training size")])
    values = OPTIONS.from_namespace(parser.parse_args(argv))    # ValueError: "--batch-size=-1 is not valid; ..."
    OPTIONS.check({"batch_size": -1}, style="python")           # ValueError: "batch_size=-1 is not valid; ..."

Every error is one sentence: the option (and, for a conflict, both options), the value and what is valid.
Command-line values arrive as text, so argparse never prints its own usage error: a bad value is reported by
the option's parser or rule like any other.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence

import torch

from vispe._checks import OptionCheck, Satisfies

__all__ = [
    "Conflict", "Option", "Options", "TextError", "check_device", "device_rule", "floats_text", "int_text", "json_object_text",
    "strings_text",
]

Style = Literal["cli", "python"]


class TextError(ValueError):
    """A text parser's refusal: ``str()`` is a whole sentence (for a direct caller), ``expected`` what the value must
    be (for :class:`Option`, which adds the flag and the text typed)."""

    def __init__(self, sentence: str, expected: str) -> None:
        super().__init__(sentence)
        self.expected = expected


# ------------------------------------------------------------------------------------------------------------------
# text -> value parsers (a ValueError's text is what the value must be; Options adds the flag and the text)
# ------------------------------------------------------------------------------------------------------------------
def int_text(text: str) -> int:
    """``"12"`` -> 12 (``"1.5"``, ``"1e3"``, ``""`` refused)."""
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError("an integer") from None


def float_text(text: str) -> float:
    """``"0.5"`` -> 0.5; ``"inf"`` / ``"nan"`` parse here and are refused by a finite rule."""
    try:
        return float(text.strip())
    except ValueError:
        raise ValueError("a number") from None


def floats_text(text: str) -> list[float]:
    """``"0.5,0.25"`` -> ``[0.5, 0.25]``."""
    items = [s for s in text.replace(" ", "").split(",") if s]
    try:
        return [float(s) for s in items]
    except ValueError:
        raise ValueError("numbers separated by commas") from None


def strings_text(text: str) -> list[str]:
    """``"a, b,"`` -> ``["a", "b"]``."""
    return [s.strip() for s in text.split(",") if s.strip()]


def json_object_text(text: str) -> dict[str, Any]:
    """A JSON object (``'{"depth": 2}'``)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"a JSON object such as '{{\"depth\": 2}}' (not valid JSON: {err.msg} at column {err.colno})") from None
    if not isinstance(value, dict):
        raise ValueError(f"a JSON object such as '{{\"depth\": 2}}' (got a JSON {type(value).__name__})")
    return value


# ------------------------------------------------------------------------------------------------------------------
# devices
# ------------------------------------------------------------------------------------------------------------------
def _available_devices() -> str:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "cpu" + (f", cuda:0..cuda:{n - 1}" if n else "; this machine has no CUDA device")


def check_device(name: str, value: Any) -> torch.device:
    """``value`` as a ``torch.device`` that exists on this machine (cpu, or a CUDA index below the device count),
    else ``ValueError`` naming ``name``, the value and the devices there are."""
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(f"{name}={value!r} is not valid; it must be cpu or cuda[:i] (this machine: {_available_devices()})") from None
    if device.type == "cpu":
        return device
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count and (device.index is None or device.index < count):
            return device
    raise ValueError(f"{name}={value!r} is not a device of this machine; it must be one of: {_available_devices()}")


def device_rule() -> OptionCheck:
    """The rule of a ``--device`` option (see :func:`check_device`)."""

    def ok(v: Any) -> bool:
        try:
            check_device("device", v)
        except ValueError:
            return False
        return True

    return Satisfies(ok, f"a device of this machine: {_available_devices()}")


# ------------------------------------------------------------------------------------------------------------------
# options and conflicts
# ------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Option:
    """One option, declared once.

    Args:
        name: the Python keyword (and argparse ``dest``).
        rule: the value's rule (``None``: any value); checked on both paths.
        parse: command-line text -> value; raises ``ValueError`` whose text says what the value must be.
            ``None`` keeps the text.
        default: the value when the option is not given (never checked: it is vispe's own).
        help: the ``--help`` text.
        flag: the command-line flag (default ``--`` + ``name`` with dashes); ``aliases`` are more flags.
        switch: a flag without a value (``store_true``).
        positional: a positional argument (``nargs='*'``, a list of strings).
        cli_only: not a keyword of the Python function (checked only on the command line).
    """

    name: str
    rule: OptionCheck | None = None
    parse: Callable[[str], Any] | None = None
    default: Any = None
    help: str = ""
    flag: str | None = None
    aliases: tuple[str, ...] = ()
    switch: bool = False
    positional: bool = False
    cli_only: bool = False
    metavar: str | None = None

    @property
    def cli_name(self) -> str:
        if self.positional:
            return self.name
        return self.flag or "--" + self.name.replace("_", "-")

    def label(self, style: Style) -> str:
        return self.cli_name if style == "cli" else self.name

    def is_set(self, value: Any) -> bool:
        """Given by the user: not the default, not empty."""
        if value is None or value is False or (isinstance(value, (list, tuple, str, dict)) and len(value) == 0):
            return False
        return value != self.default

    def add_to(self, parser: argparse.ArgumentParser | Any) -> None:
        if self.positional:
            parser.add_argument(self.name, nargs="*", help=self.help)
        elif self.switch:
            parser.add_argument(self.cli_name, *self.aliases, dest=self.name, action="store_true", help=self.help)
        else:  # text: parsed and checked by Options (one sentence, not argparse's usage error)
            help = self.help + (f" (default {self.default})" if self.default not in (None, False) else "")
            parser.add_argument(self.cli_name, *self.aliases, dest=self.name, default=None, metavar=self.metavar,
                                help=help.replace("%", "%%"))

    def value_from_text(self, text: Any) -> Any:
        """The value of the command-line ``text`` (checked)."""
        if text is None:
            return self.default
        if self.switch or self.positional:
            value = text
        elif self.parse is None:
            value = text
        else:
            try:
                value = self.parse(str(text))
            except ValueError as err:
                what = getattr(err, "expected", None) or str(err) or (self.rule.describe() if self.rule is not None else "valid")
                raise ValueError(f"{self.cli_name}={text!r} is not valid; it must be {what}") from None
        self.check(value, "cli", text=text)
        return value

    def check(self, value: Any, style: Style = "python", text: Any = None) -> None:
        if self.rule is None or (value is None and not self.positional) or value is self.default:
            return
        try:
            self.rule.check(self.label(style), value)
        except (TypeError, ValueError) as err:
            if text is not None:  # name the text the user typed, not the parsed value
                message = str(err).replace(f"{self.label(style)}={value!r}", f"{self.label(style)}={text!r}", 1)
                raise type(err)(message) from None
            raise


@dataclass(frozen=True)
class Conflict:
    """Two options that cannot be combined (``kind='exclusive'``), or of which the first needs the second
    (``kind='requires'``); ``reason`` says why, in a few words."""

    first: str
    second: str
    reason: str
    kind: Literal["exclusive", "requires"] = "exclusive"


class Options:
    """A command's options: argparse arguments, checked values from a namespace, the same checks from Python."""

    def __init__(self, owner: str, options: Iterable[Option], conflicts: Iterable[Conflict] = ()) -> None:
        self.owner = owner
        self.options = {o.name: o for o in options}
        self.conflicts = tuple(conflicts)
        for c in self.conflicts:
            for name in (c.first, c.second):
                if name not in self.options:
                    raise KeyError(f"{owner}: conflict names the undeclared option {name!r}")

    def __getitem__(self, name: str) -> Option:
        return self.options[name]

    def add_to(self, parser: argparse.ArgumentParser, groups: Mapping[str, Sequence[str]] | None = None) -> None:
        """Add every option to ``parser``; ``groups`` (title -> option names) puts them in argument groups."""
        placed: set[str] = set()
        for title, names in (groups or {}).items():
            group = parser.add_argument_group(title)
            for name in names:
                self.options[name].add_to(group)
                placed.add(name)
        for name, option in self.options.items():
            if name not in placed:
                option.add_to(parser)

    def from_namespace(self, ns: argparse.Namespace) -> dict[str, Any]:
        """Checked values of a parsed command line (every option, defaults filled), conflicts included."""
        values = {name: option.value_from_text(getattr(ns, name, None)) for name, option in self.options.items()}
        self.check_conflicts(values, "cli")
        return values

    def check(self, values: Mapping[str, Any], style: Style = "python") -> None:
        """Check ``values`` given from Python (only the declared names that are present) and the conflicts among them."""
        for name, value in values.items():
            option = self.options.get(name)
            if option is not None and not (style == "python" and option.cli_only):
                option.check(value, style)
        self.check_conflicts(values, style)

    def check_conflicts(self, values: Mapping[str, Any], style: Style) -> None:
        for c in self.conflicts:
            a, b = self.options[c.first], self.options[c.second]
            if style == "python" and (a.cli_only or b.cli_only):
                continue
            a_set, b_set = a.is_set(values.get(c.first)), b.is_set(values.get(c.second))
            if c.kind == "exclusive" and a_set and b_set:
                raise ValueError(f"{a.label(style)} and {b.label(style)} cannot be used together: {c.reason}")
            if c.kind == "requires" and a_set and not b_set:
                raise ValueError(f"{a.label(style)} needs {b.label(style)}: {c.reason}")

