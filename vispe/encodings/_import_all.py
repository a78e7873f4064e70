"""Import every encoding module of this package, subpackages included, so that each registers its names: a new
module is found by walking the package, never by a list."""
from __future__ import annotations

import importlib
import pkgutil


def import_encoding_modules() -> None:
    pkg = importlib.import_module(__package__)
    for info in pkgutil.walk_packages(pkg.__path__, prefix=f"{__package__}."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            importlib.import_module(info.name)
