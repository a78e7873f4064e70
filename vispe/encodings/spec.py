"""The one way to name an encoding with options, used by models, configs, tasks and every CLI.

Three equivalent forms:

* ``"irpe[mode=bias,sides=qk]"`` -- a string (options in a trailing ``[key=value,...]``; values are Python
  literals or bare strings); a plain name has no brackets;
* ``{"name": "irpe", "mode": "bias"}`` -- a mapping (YAML configs; ``kwargs:`` may hold the options);
* ``("irpe", {"mode": "bias"})`` -- a pair.

A comma-separated list of string specs (``"learned,irpe[mode=bias,sides=qk],rope_mixed"``) is what
``--encodings`` takes in every benchmark command.
"""
from __future__ import annotations

import ast
from typing import Any, Mapping, Sequence, Union

__all__ = ["PosEncodingArg", "EXTRAPOLATION_MODES", "ROTARY_EXTRAPOLATION_MODES", "parse_pos_encoding", "parse_encoding_list", "format_spec"]

#: What a model's ``pos_encoding`` argument takes (a loose type so LightningCLI accepts every form).
PosEncodingArg = Union[str, Mapping[str, Any], Sequence[Any]]

#: How lattice encodings meet a grid other than the training one: evaluate the formula at the new
#: integer indices (``extend``) or rescale the new grid onto the training one (``interpolate``).
EXTRAPOLATION_MODES = ("extend", "interpolate")
#: Rotary lattice encodings also rescale their frequencies per axis on a larger grid: ``ntk`` (NTK-aware,
#: the lowest frequency interpolated, the highest kept, geometric in between) and ``yarn`` (YaRN's
#: per-frequency ramp on the number of turns a pair makes across the training grid).
ROTARY_EXTRAPOLATION_MODES = EXTRAPOLATION_MODES + ("ntk", "yarn")


def _parse_string(spec: str) -> tuple[str, dict[str, Any]]:
    spec = spec.strip()
    if "[" not in spec and "]" not in spec:
        return spec, {}
    if not spec.endswith("]") or spec.count("[") != 1 or spec.count("]") != 1:
        raise ValueError(f"encoding spec {spec!r}: options go in one trailing [key=value,...]")
    name, opts = spec[:-1].split("[", 1)
    kwargs: dict[str, Any] = {}
    for item in filter(None, (o.strip() for o in opts.split(","))):
        if "=" not in item:
            raise ValueError(f"encoding spec {spec!r}: option {item!r} is not key=value")
        k, v = (t.strip() for t in item.split("=", 1))
        try:
            kwargs[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            kwargs[k] = v
    return name.strip(), kwargs


def parse_pos_encoding(spec: PosEncodingArg) -> tuple[str, dict[str, Any]]:
    """Any of the three forms -> ``(name, options)``."""
    if isinstance(spec, str):
        return _parse_string(spec)
    if isinstance(spec, Mapping):
        spec = dict(spec)
        if "name" not in spec:
            raise ValueError(f"pos_encoding mapping needs a 'name' key, got keys {sorted(spec)}")
        name = spec.pop("name")
        kwargs = dict(spec.pop("kwargs", {}) or {})
        kwargs.update(spec)
        return name, kwargs
    if isinstance(spec, (tuple, list)) and len(spec) == 2 and isinstance(spec[0], str) and isinstance(spec[1], Mapping):
        return spec[0], dict(spec[1])
    raise ValueError(f"pos_encoding must be a name, 'name[key=value,...]', a mapping with 'name', or (name, options); got {spec!r}")


def _split_top_level(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in {text!r}")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ValueError(f"unbalanced '[' in {text!r}")
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def parse_encoding_list(text: str) -> list[tuple[str, str, dict[str, Any]]]:
    """``'learned,irpe[mode=contextual,skip=1],rope_mixed'`` -> ``[(label, name, options), ...]`` (label = the spec)."""
    return [(spec, *_parse_string(spec)) for spec in _split_top_level(text)]


def format_spec(name: str, options: Mapping[str, Any] | None = None) -> str:
    """The string form of ``(name, options)`` (round-trips through :func:`parse_pos_encoding`)."""
    if not options:
        return name
    return name + "[" + ",".join(f"{k}={v!r}" for k, v in options.items()) + "]"

