"""The one way to name an encoding with options, used by models, configs, tasks and every CLI.

Three equivalent forms:

* ``"irpe[mode=bias,sides=qk]"`` -- a string (options in a trailing ``[key=value,...]``; values are Python
  literals or bare strings); a plain name has no brackets;
* ``{"name": "irpe", "mode": "bias"}`` -- a mapping (YAML configs; ``kwargs:`` may hold the options);
* ``("irpe", {"mode": "bias"})`` -- a pair.

A comma-separated list of string specs (``"learned,irpe[mode=bias,sides=qk],rope_mixed"``) is what
``--encodings`` takes in every benchmark command.

Composed encodings (:mod:`vispe.encodings.composed`): parts joined by ``+`` (``"learned+rope_axial[theta=10.0]"``) or
a list of specs (``["learned", {"name": "rope_axial", "theta": 10.0}]``); both resolve to the one canonical name
``"learned+rope_axial[theta=10.0]"`` with no options of its own.
"""
from __future__ import annotations

import ast
from typing import Any, Mapping, Sequence, Union

__all__ = ["PosEncodingArg", "EXTRAPOLATION_MODES", "ROTARY_EXTRAPOLATION_MODES", "parse_pos_encoding", "parse_encoding_list", "format_spec",
           "split_composed"]

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
    if len(split_composed(spec)) > 1:
        return _compose(split_composed(spec), spec), {}
    if "[" not in spec and "]" not in spec:
        return spec, {}
    if not spec.endswith("]") or spec.count("[") != 1 or spec.count("]") != 1:
        raise ValueError(f"encoding spec {spec!r}: options go in one trailing [key=value,...]")
    name, opts = spec[:-1].split("[", 1)
    kwargs: dict[str, Any] = {}
    for item in filter(None, (o.strip() for o in _split_top_level(opts, ",", "([{", ")]}"))):
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
    if isinstance(spec, (tuple, list)) and not _is_pair(spec):
        return _compose(list(spec), spec), {}
    if isinstance(spec, Mapping):
        spec = dict(spec)
        if "name" not in spec:
            raise ValueError(f"pos_encoding mapping needs a 'name' key, got keys {sorted(spec)}")
        name = spec.pop("name")
        kwargs = dict(spec.pop("kwargs", {}) or {})
        kwargs.update(spec)
        if isinstance(name, str) and len(split_composed(name)) > 1:
            if kwargs:
                raise ValueError(f"composed encoding {name!r} takes options per part ('learned[init_std=0.0]+rope_axial'), "
                                 f"not {sorted(kwargs)}")
            return _compose(split_composed(name), name), {}
        return name, kwargs
    if isinstance(spec, (tuple, list)) and len(spec) == 2 and isinstance(spec[0], str) and isinstance(spec[1], Mapping):
        return spec[0], dict(spec[1])
    raise ValueError(f"pos_encoding must be a name, 'name[key=value,...]', a mapping with 'name', or (name, options); got {spec!r}")


def _is_pair(spec: Sequence[Any]) -> bool:
    """``(name, options)``: a name and a mapping of options (a mapping with a ``name`` is a part's spec instead)."""
    return len(spec) == 2 and isinstance(spec[0], str) and isinstance(spec[1], Mapping) and "name" not in spec[1]


def _compose(parts: Sequence[Any], spec: Any) -> str:
    """The canonical name of a composition: each part's string form, joined by ``+``."""
    if len(parts) < 2:
        raise ValueError(f"a composed encoding needs at least two parts, got {spec!r}")
    names = []
    for part in parts:
        if isinstance(part, str) and len(split_composed(part)) > 1:
            names.extend(split_composed(_compose(split_composed(part), part)))
            continue
        name, options = parse_pos_encoding(part)
        text = format_spec(name, options)
        if _parse_string(text) != (name, options):  # e.g. an option value with a comma: no string form
            raise ValueError(f"part {part!r} of composed encoding {spec!r} has options without a string form ({options}); "
                             "register a preset for it instead")
        names.append(text)
    return "+".join(names)


def split_composed(text: str) -> list[str]:
    """``'learned+rope_axial[theta=1e+2]'`` -> ``['learned', 'rope_axial[theta=1e+2]']`` (``+`` outside brackets)."""
    return _split_top_level(text, "+")


def _split_top_level(text: str, sep: str = ",", opening: str = "[", closing: str = "]") -> list[str]:
    """``text`` split at ``sep`` outside brackets (option values such as ``nope_layers=(3, 7)`` keep their commas)."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch in opening:
            depth += 1
        elif ch in closing:
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced {ch!r} in {text!r}")
        if ch == sep and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ValueError(f"unbalanced brackets in {text!r}")
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

