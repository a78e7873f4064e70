"""vispe: positional encodings for vision and video/multimodal transformers, native to timm and Lightning.

``import vispe`` registers every encoding (``vispe.list_encodings()``) and every model in timm
(``timm.list_models('vispe_*')``).
"""
from .encodings import (
    PositionGrid,
    create_encoding,
    get_encoding_class,
    list_encodings,
    register_encoding,
)
from . import models  # noqa: F401  (registers vispe_* models in timm)

__version__ = "0.1.0"

__all__ = ["PositionGrid", "create_encoding", "get_encoding_class", "list_encodings", "register_encoding", "models", "__version__"]
