"""The backbone a task trains: a model instance (any ``nn.Module``) or a timm / vispe model built from its name.

Every task takes its backbone as one constructor argument. From Python, pass the module itself
(``ImageClassification(model=my_vit)``); in a config, pass a timm model name plus ``model_kwargs`` /
``pos_encoding`` (``model: vispe_vit_tiny_patch4_32``), or the module's class with its arguments
(``model: {class_path: vispe.models.VispeViT, init_args: {...}}``; LightningCLI builds it).
"""
from __future__ import annotations

import difflib
import importlib
import inspect
from typing import Any, Mapping

import timm
import torch.nn as nn

__all__ = ["Backbone", "backbone_name", "build_model", "check_backbone", "resolve_backbone", "unrecorded"]

#: a task's ``model`` argument: a module instance, or a timm model name (``timm.list_models('vispe_*')`` for vispe's)
Backbone = nn.Module | str


def build_model(
    model: str,
    model_kwargs: Mapping[str, Any] | None = None,
    pos_encoding: str | Mapping[str, Any] | None = None,
    **overrides: Any,
) -> nn.Module:
    """``timm.create_model(model, **model_kwargs, **overrides)`` with ``pos_encoding`` for ``vispe_*`` models.

    Overrides that are ``None`` are left out (the model's default). Unknown model / encoding names raise
    ``ValueError`` naming the valid choices.
    """
    import vispe  # noqa: F401  (registers vispe_* models and the encodings)
    from vispe.encodings.spec import parse_pos_encoding

    if not isinstance(model, str) or not timm.is_model(model):
        names = timm.list_models()
        close = difflib.get_close_matches(str(model), names, n=5, cutoff=0.6)
        raise ValueError(
            f"unknown model {model!r}: not a timm model; vispe models are {timm.list_models('vispe_*')}"
            + (f", close timm names: {close}" if close else "")
        )
    kwargs = dict(model_kwargs or {})
    kwargs.update({k: v for k, v in overrides.items() if v is not None})
    if pos_encoding is not None:
        if "pos_encoding" in kwargs:
            raise ValueError("give pos_encoding either as an argument or inside model_kwargs, not both")
        kwargs["pos_encoding"] = pos_encoding
    if "pos_encoding" in kwargs:
        if not model.startswith("vispe_"):
            raise ValueError(f"pos_encoding is an option of vispe_* models; {model!r} is a plain timm model")
        name, _ = parse_pos_encoding(kwargs["pos_encoding"])
        vispe.get_encoding_class(name)  # ValueError listing the registered encodings
    return timm.create_model(model, **kwargs)


def _module_from_config(config: Mapping[str, Any]) -> nn.Module:
    """``{'class_path': 'pkg.Class', 'init_args': {...}}`` (a checkpoint's record of a module backbone) -> the module."""
    class_path = config.get("class_path")
    module_name, _, name = str(class_path).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError):
        raise ValueError(f"model: class_path {class_path!r} cannot be imported; give an importable nn.Module class") from None
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"model: class_path {class_path!r} is not an nn.Module class")
    return cls(**{k: _imported(v, _callable_params(cls).get(k)) for k, v in dict(config.get("init_args") or {}).items()})


def _callable_params(cls: type) -> dict[str, Any]:
    """Parameters of ``cls`` and of the classes it forwards ``**kwargs`` to whose default is a class or function
    (timm's ``embed_layer=PatchEmbed``, ``block_fn=Block``, ...)."""
    out: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        for name, p in inspect.signature(init).parameters.items():
            if callable(p.default):
                out[name] = p.default
    return out


def _imported(value: Any, default: Any) -> Any:
    """A recorded import path (``'timm.layers.PatchEmbed'``: how a config dump writes a class or function argument)
    as the object, for a parameter whose default is a class or function; any other value as it is."""
    if default is None or not isinstance(value, str) or "." not in value:
        return value
    module_name, _, name = value.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError):
        return value


def _in_chans(module: nn.Module) -> int | None:
    proj = getattr(getattr(module, "patch_embed", None), "proj", None)
    return getattr(proj, "in_channels", None) if isinstance(proj, nn.Module) else None


def check_backbone(module: nn.Module, **expected: Any) -> None:
    """Refuse a module backbone whose output / input sizes differ from what the task and data say
    (``num_classes``, ``in_chans``), naming both values, instead of a shape error in the first step."""
    found = {"num_classes": getattr(module, "num_classes", None), "in_chans": _in_chans(module)}
    for key, want in expected.items():
        have = found.get(key)
        if want is not None and have is not None and int(have) != int(want):
            raise ValueError(f"model: the given {type(module).__name__} has {key}={have} but the task needs {key}={want} "
                             f"(from the data or the task's arguments); build the module with {key}={want}")


def unrecorded(model: Any) -> Any:
    """A task's ``model`` argument as its hyper-parameter: a module passed in Python is not recorded (``None``: its
    weights are the state dict; give it again to ``load_from_checkpoint(path, model=...)``); a name is. A module given
    by a config is recorded by LightningCLI as its ``{'class_path', 'init_args'}``, which builds it again."""
    return None if isinstance(model, nn.Module) else model


def resolve_backbone(
    model: Backbone | Mapping[str, Any],
    model_kwargs: Mapping[str, Any] | None = None,
    pos_encoding: str | Mapping[str, Any] | None = None,
    **overrides: Any,
) -> nn.Module:
    """A task's backbone: ``model`` itself when it is an ``nn.Module`` (checked against ``overrides`` such as
    ``num_classes``), built from its record (``{'class_path', 'init_args'}``, how a checkpoint stores a module
    backbone), or :func:`build_model` of a model name with ``model_kwargs``, ``pos_encoding`` and ``overrides``."""
    if isinstance(model, Mapping) and "class_path" in model:
        model = _module_from_config(model)
    if isinstance(model, nn.Module):
        given = [k for k, v in (("model_kwargs", model_kwargs), ("pos_encoding", pos_encoding)) if v]
        if given:
            raise ValueError(f"{' and '.join(given)} configure a model built from its name; model is already a "
                             f"{type(model).__name__} instance: set them on the module instead")
        check_backbone(model, **{k: v for k, v in overrides.items() if k in ("num_classes", "in_chans")})
        return model
    if model is None:
        raise ValueError("model: no backbone; the checkpoint's task was given a module in Python, which it does not record: "
                         "pass it again (load_from_checkpoint(path, model=<the module>))")
    if not isinstance(model, str):
        raise ValueError(f"model must be an nn.Module or a timm model name, got {type(model).__name__} {model!r}")
    return build_model(model, model_kwargs, pos_encoding, **overrides)


def backbone_name(model: Any) -> str:
    """How messages name a task's backbone: its model name, or its class."""
    if isinstance(model, str):
        return repr(model)
    if isinstance(model, Mapping) and "class_path" in model:
        return str(model["class_path"])
    return type(model).__name__
