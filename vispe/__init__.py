"""vispe: positional encodings for vision and video/multimodal transformers, native to timm and Lightning.

``import vispe`` registers every encoding (``vispe.list_encodings()``) and every model in timm
(``timm.list_models('vispe_*')``).

Both happen when first needed, so ``import vispe`` (and the ``vispe`` command's ``--help``) does not pay for torch,
timm and torchvision: the encodings load on the first use of ``vispe.list_encodings`` / ``create_encoding`` /
..., and the ``vispe_*`` models register in timm as soon as timm is imported (right away when it already is), so
``import vispe, timm; timm.create_model("vispe_vit_small_patch16_224")`` works in either import order.
"""
from __future__ import annotations

import importlib
from typing import Any

from ._lazy import register_models_when_timm_loads

__version__ = "0.1.0"

#: public name -> the module that defines it (imported on first access)
_LAZY_ATTRS = {
    "PositionGrid": "vispe.encodings",
    "create_encoding": "vispe.encodings",
    "get_encoding_class": "vispe.encodings",
    "list_encodings": "vispe.encodings",
    "register_encoding": "vispe.encodings",
}
_SUBMODULES = ("analysis", "benchmarks", "data", "encodings", "integrations", "models", "positions", "recipes", "tasks")

__all__ = ["PositionGrid", "create_encoding", "get_encoding_class", "list_encodings", "register_encoding", "models", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY_ATTRS:
        value = getattr(importlib.import_module(_LAZY_ATTRS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_ATTRS, *_SUBMODULES})


register_models_when_timm_loads()
