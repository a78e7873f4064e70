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

This module is also where a spec becomes a class and a module (:func:`get_encoding_class`, :func:`create_encoding`):
a registered name through its record (:mod:`vispe.encodings.base`), a ``+`` name through
:func:`composed_class`. It sits above the registry and :mod:`~vispe.encodings.composed`, which import neither it
nor each other's callers.
"""
from __future__ import annotations

import ast
from typing import Any, ClassVar, Mapping, Sequence, Union

import torch.nn as nn

from .._checks import OptionCheck, did_you_mean
from .base import (  # the registry and its private helpers, shared with this layer
    _CONTEXT_KEYS,
    EncodingContext,
    PositionalEncoding,
    _common_policies,
    _init_params,
    _policy_encodings,
    encoding_records,
    get_record,
    list_encodings,
)
from .composed import ComposedEncoding, attention_side, check_parts
from .resolution import INTERPOLATE as _INTERPOLATE
from .resolution import ResolutionContract

__all__ = ["PosEncodingArg", "EXTRAPOLATION_MODES", "ROTARY_EXTRAPOLATION_MODES", "parse_pos_encoding", "parse_encoding_list", "format_spec",
           "split_composed", "get_encoding_class", "create_encoding", "composed_class", "encoding_option_checks",
           "extrapolation_policies", "benchmark_encodings", "contract_table"]

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



# ---------------------------------------------------------------------------------------------
# Resolution: a spec -> a class -> a module
# ---------------------------------------------------------------------------------------------

#: One class per composed name (``"learned+rope_axial"``), made on first use (not records: ``list_encodings`` lists
#: what can be composed, not every composition).
_COMPOSED_CLASSES: dict[str, type[ComposedEncoding]] = {}


class _NamedComposition(ComposedEncoding):
    """A composition named by its spec (``"learned+rope_axial[theta=10.0]"``); its parts come from that name and are
    built with the host's context. Classes are made by :func:`composed_class`."""

    part_specs: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        dim: int,
        num_heads: int,
        depth: int,
        grid_size: Sequence[int],
        num_prefix_tokens: int = 1,
        in_chans: int = 3,
        patch_size: Sequence[int] = (16, 16),
    ) -> None:
        context = EncodingContext(dim, num_heads, depth, tuple(grid_size), num_prefix_tokens, in_chans, tuple(patch_size))
        super().__init__([create_encoding(spec, context) for spec in self.part_specs])


def composed_class(name: str) -> type[ComposedEncoding]:
    """The class of a composed name (``"learned+rope_axial"``; canonical form from :func:`parse_pos_encoding`):
    checked once (known parts, at most one attention-side part, a grid dimensionality in common), then cached."""
    cls = _COMPOSED_CLASSES.get(name)
    if cls is not None:
        return cls
    specs = split_composed(name)
    names = [parse_pos_encoding(s)[0] for s in specs]
    classes = [get_encoding_class(n) for n in names]
    check_parts(name, names, classes)
    ndims = tuple(d for d in (1, 2, 3) if all(d in c.grid_ndims for c in classes))
    if not ndims:
        raise ValueError(f"{name!r} cannot compose: its parts take different grids "
                         f"({', '.join(f'{n}: {c.grid_ndims}-D' for n, c in zip(names, classes))})")
    contract = next((c.contract for c in classes if attention_side(c)), "token")
    cls = type(f"Composed[{name}]", (_NamedComposition,), {"part_specs": tuple(specs), "grid_ndims": ndims,
                                                             "resolution": ResolutionContract.common([c.resolution for c in classes]),
                                                             "contract": contract,
                                                             "registry_name": name, "__module__": __name__})
    _COMPOSED_CLASSES[name] = cls
    return cls


def benchmark_encodings(grid_ndim: int, **tags: Any) -> list[str]:
    """The encoding specs a benchmark on ``grid_ndim``-D grids covers by default: every record tagged for it
    (:attr:`~vispe.encodings.base.EncodingRecord.benchmark`), each with its ``benchmark_options``
    (``'liere[block_size=8]'``), further filtered by any tag (``kind='bias'``; see
    :func:`~vispe.encodings.base.encoding_records`). Benchmarks take their default encodings from here, so a new
    encoding appears in each with no list to edit."""
    return [format_spec(r.name, dict(r.benchmark_options)) for r in encoding_records(benchmark=grid_ndim, **tags)]


def get_encoding_class(name: str) -> type[PositionalEncoding]:
    """The class a registered name (or a ``+`` composition of them) builds; an unknown name raises ``ValueError``
    listing the registered ones."""
    if isinstance(name, str) and "+" in name:  # a composition ("learned+rope_axial")
        return composed_class(parse_pos_encoding(name)[0])
    return get_record(name).cls


def encoding_option_checks(name: str) -> dict[str, OptionCheck]:
    """The rule of every option of the registered encoding ``name`` (see :meth:`PositionalEncoding.option_rules`)."""
    return get_encoding_class(name).option_rules()


def extrapolation_policies(source: Any) -> tuple[str, ...]:
    """The extrapolation policies that can be set on ``source`` (empty: none), in the encoding's order.

    ``source`` is a model (every encoding in it, the parts of a composed encoding included: the policies all of
    them offer), an encoding, an encoding class, or a registered name or spec (``"rope_axial"``,
    ``"learned+rope_axial"``).
    """
    if isinstance(source, nn.Module):
        return _common_policies([m.extrapolation_policies for m in _policy_encodings(source)])
    if isinstance(source, type) and issubclass(source, PositionalEncoding):
        return source.extrapolation_policies
    if source is None:
        return ()
    return get_encoding_class(parse_pos_encoding(source)[0]).extrapolation_policies


def create_encoding(spec: Any, context: EncodingContext | None = None, **kwargs: Any) -> PositionalEncoding:
    """Build a registered encoding.

    Args:
        spec: a name from :func:`~vispe.encodings.base.list_encodings`, or a spec with options
            (``"irpe[mode=bias]"``, ``{"name": "irpe", "mode": "bias"}``, ``("irpe", {"mode": "bias"})``).
        context: what the host model knows (width, heads, depth, grid); only the fields the
            encoding's constructor names are passed.
        **kwargs: the encoding's own options (override the spec's, which override a preset's defaults); unknown
            options raise a ``TypeError`` that lists the valid ones.
    """
    name, options = parse_pos_encoding(spec)
    kwargs = {**options, **kwargs}
    if "+" in name:
        cls, defaults = composed_class(name), {}
    else:
        record = get_record(name)
        cls, defaults = record.cls, dict(record.defaults)
    grid_ndim = len(context.grid_size) if context is not None and context.grid_size else None
    if grid_ndim is not None and grid_ndim not in cls.grid_ndims:  # else it may run silently on the wrong axes
        raise ValueError(f"encoding {name!r} takes {'/'.join(map(str, cls.grid_ndims))}-D grids, but the model's grid "
                         f"{tuple(context.grid_size)} is {grid_ndim}-D; choose one of {list_encodings(grid_ndim=grid_ndim)}"
                         f"{did_you_mean(name, list_encodings(grid_ndim=grid_ndim))}")
    option = cls.backend_option  # how it computes: applied after construction, kept out of the constructor's options
    backend = kwargs.pop(option, None) if option else None
    accepted, var_kw = _init_params(cls)
    own = sorted((accepted - _CONTEXT_KEYS) | ({option} if option else set()))
    unknown = [k for k in kwargs if k not in accepted and not var_kw]
    if unknown:
        raise TypeError(f"encoding {name!r} got unknown option(s) {unknown}; valid options: {own}")
    clash = [k for k in kwargs if k in _CONTEXT_KEYS and context is not None]
    if clash:
        raise TypeError(f"encoding {name!r}: {clash} come from the model, not from pos_encoding options")
    args: dict[str, Any] = dict(defaults)
    if context is not None:
        args.update({k: v for k, v in context.as_kwargs().items() if k in accepted})
    args.update(kwargs)
    if backend is not None:  # before any weight is built
        try:
            cls.check_backend(backend)
        except ValueError as exc:
            raise ValueError(f"encoding {name!r}: {exc}") from None
    enc = cls(**args)
    if backend is not None:
        enc.set_backend(backend)
    # how it was built: a meta-device model is initialised by building its encodings again (models.init_empty_weights)
    enc.construction = (cls, dict(args), backend)
    return enc


def contract_table() -> str:
    """The registered encodings' contracts as a Markdown table (encodings sharing a contract on one row): what the
    docs show, generated here so they follow the registry."""
    groups: dict[ResolutionContract, list[str]] = {}
    for name in list_encodings():
        groups.setdefault(get_encoding_class(name).resolution, []).append(name)
    lines = [f"| encodings | policies | default | `{_INTERPOLATE}` is |", "|---|---|---|---|"]
    for contract, names in sorted(groups.items(), key=lambda kv: (-len(kv[0].policies), kv[0].policies, kv[1])):
        if contract.policies:
            lines.append(f"| {', '.join(f'`{n}`' for n in names)} | {', '.join(f'`{p}`' for p in contract.policies)} "
                         f"| `{contract.default}` | `{contract.interpolates_by}` |")
    lines.append("| every other encoding | none: one built-in behaviour | | |")
    return "\n".join(lines)
