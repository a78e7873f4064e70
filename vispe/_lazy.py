"""Register vispe's models in timm when timm is imported, so ``import vispe`` itself imports neither timm nor torch.

timm has no plugin hook for model registries; the ``vispe_*`` models register by importing :mod:`vispe.models`.
``import vispe`` does that at once when timm is already loaded, and otherwise puts a one-shot finder on
``sys.meta_path`` that runs it right after timm's own ``__init__`` finishes (before ``import timm`` returns).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, Sequence

_TIMM = "timm"
_REGISTERING_MODULE = "vispe.models"


def register_models_when_timm_loads() -> None:
    """Import :mod:`vispe.models` now if timm is loaded, else as soon as it is."""
    if _TIMM in sys.modules:
        importlib.import_module(_REGISTERING_MODULE)
    elif not any(isinstance(f, _AfterTimmFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTimmFinder())


class _AfterTimmFinder(importlib.abc.MetaPathFinder):
    """Finds timm through the other finders and wraps its loader; removed once timm has loaded.

    Availability checks (``importlib.util.find_spec("timm")``, as Lightning does) also come here without loading
    timm, so the finder stays until timm is really executed.
    """

    def __init__(self) -> None:
        self._searching = False

    def find_spec(self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname != _TIMM or self._searching:
            return None
        self._searching = True  # the search below asks every finder again, this one included
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._searching = False
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisterAfterLoader(spec.loader, self)
        return spec


class _RegisterAfterLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, finder: _AfterTimmFinder) -> None:
        self._loader, self._finder = loader, finder

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        if self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        # timm keeps its own loader (resource lookups, reloads); the wrapper only runs once
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        importlib.import_module(_REGISTERING_MODULE)
