"""Positional encodings: three contracts (token, attention bias, rotary) and one registry."""
from .grid import PositionGrid, as_grid
from .base import (
    CONTRACTS,
    AttentionBiasEncoding,
    EncodingContext,
    EncodingRecord,
    PositionalEncoding,
    TokenEncoding,
    encoding_records,
    get_extrapolation,
    get_record,
    list_encodings,
    register_alias,
    register_encoding,
    register_preset,
    sdpa,
    set_extrapolation,
)
from .rotary import ROTARY_LAYOUTS, RotaryEncoding, RotaryState, apply_rotary, rotary_table
from .spec import (
    EXTRAPOLATION_MODES,
    PosEncodingArg,
    benchmark_encodings,
    create_encoding,
    extrapolation_policies,
    get_encoding_class,
    parse_encoding_list,
    parse_pos_encoding,
)
from ._import_all import import_encoding_modules  # noqa: E402

# every module of this package registers its names on import: discovered, not listed
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
    "encoding_records",
    "benchmark_encodings",
    "get_record",
    "EncodingRecord",
    "CONTRACTS",
    "register_encoding",
    "register_preset",
    "register_alias",
    "sdpa",
    "parse_pos_encoding",
    "parse_encoding_list",
    "PosEncodingArg",
    "EXTRAPOLATION_MODES",
    "extrapolation_policies",
    "get_extrapolation",
    "set_extrapolation",
]
