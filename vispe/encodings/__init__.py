"""Positional encodings: three contracts (token, attention bias, rotary) and one registry."""
from .grid import PositionGrid, as_grid
from .base import (
    AttentionBiasEncoding,
    EncodingContext,
    PositionalEncoding,
    TokenEncoding,
    create_encoding,
    extrapolation_policies,
    get_encoding_class,
    get_extrapolation,
    list_encodings,
    register_encoding,
    sdpa,
    set_extrapolation,
)
from .rotary import ROTARY_LAYOUTS, RotaryEncoding, RotaryState, apply_rotary, rotary_table
from .spec import EXTRAPOLATION_MODES, PosEncodingArg, parse_encoding_list, parse_pos_encoding

# registered encodings (import order does not matter; each module registers its names)
from . import absolute, rope_vit  # noqa: F401,E402
from ._import_all import import_encoding_modules  # noqa: E402

import_encoding_modules()

__all__ = [
    "PositionGrid",
    "as_grid",
    "EncodingContext",
    "PositionalEncoding",
    "TokenEncoding",
    "AttentionBiasEncoding",
    "RotaryEncoding",
    "RotaryState",
    "apply_rotary",
    "rotary_table",
    "ROTARY_LAYOUTS",
    "create_encoding",
    "get_encoding_class",
    "list_encodings",
    "register_encoding",
    "sdpa",
    "parse_pos_encoding",
    "parse_encoding_list",
    "PosEncodingArg",
    "EXTRAPOLATION_MODES",
    "extrapolation_policies",
    "get_extrapolation",
    "set_extrapolation",
]
