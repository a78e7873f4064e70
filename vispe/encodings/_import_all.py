"""Import every encoding module in this package so that each registers its names."""
from __future__ import annotations

import importlib
import pkgutil


def import_encoding_modules() -> None:
    pkg = importlib.import_module(__package__)
    for info in pkgutil.iter_modules(pkg.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__package__}.{info.name}")
