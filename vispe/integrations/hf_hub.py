"""A switched Hugging Face model saves as a model that loads switched, or not at all.

``save_pretrained`` (and so ``push_to_hub``) of a model switched by :func:`vispe.integrations.hf.apply_position_scheme`
writes transformers' custom-code layout beside the weights:

* ``modeling_vispe.py``: classes ``Vispe<Family>Config`` / ``Vispe<Family>Model`` /
  ``Vispe<Family>ForConditionalGeneration`` (subclasses of the family's own, model type ``vispe_<family>``) whose
  ``from_pretrained`` re-applies the scheme recorded in ``config.json``;
* ``config.json``: that model type, ``architectures`` naming the vispe class and an ``auto_map`` for
  ``AutoConfig``, ``AutoModel`` and ``AutoModelForImageTextToText``.

transformers does not know the model type, so an Auto class (or a pipeline) loads it only with
``trust_remote_code=True`` (the modeling file imports vispe: without the package, transformers names it) and
otherwise raises its own "requires trust_remote_code" error. Importing :mod:`vispe.integrations.hf` registers the
vispe classes with the Auto classes (no remote code needed) and makes ``from_pretrained`` of the supported classes
restore a recorded scheme, or refuse naming the record when it cannot be restored. A model running its own scheme
with default options saves as the family's own model (it is the same model).
"""
from __future__ import annotations

import functools
import json
import os
from typing import Any

from torch import nn

__all__ = ["MODEL_TYPE_PREFIX", "MODELING_FILE", "install", "saved_classes"]

#: ``model_type`` of a switched save: this prefix + the family's model type (unknown to transformers itself).
MODEL_TYPE_PREFIX = "vispe_"
#: The modeling file written beside the weights (``auto_map`` points into it).
MODELING_FILE = "modeling_vispe.py"
#: Where a switched save keeps the text config (``text_config`` holds a sentence the family's own config class rejects).
TEXT_CONFIG_KEY = "vispe_text_config"
#: kwarg of ``from_pretrained`` carrying options ``config.json`` could not hold (see ``restore_position_scheme``).
SCHEME_OPTIONS_KWARG = "vispe_scheme_options"

_MODELING_TEMPLATE = '''"""Written by vispe's save_pretrained: this {family} model runs the position scheme recorded in config.json
(``vispe_position_scheme``). Loading it needs the vispe package (pip install 'vispe[hf]')."""
import vispe.integrations.hf  # noqa: F401  (guards from_pretrained, which restores the recorded scheme)
from vispe.integrations.hf_hub import saved_classes

_classes = saved_classes("{family}")
{assignments}
'''


def _family(name: str):
    from .hf import MODEL_FAMILIES

    for fam in MODEL_FAMILIES:
        if fam.name == name:
            return fam
    raise ValueError(f"unknown model family {name!r}; choose one of {[f.name for f in MODEL_FAMILIES]}")


def _family_classes(fam) -> tuple[type, type] | None:
    import transformers

    gen, bare = (getattr(transformers, c, None) for c in fam.classes)
    return None if gen is None or bare is None else (gen, bare)


@functools.cache
def saved_classes(family: str) -> dict[str, type]:
    """``{class name: class}`` of a family's switched save: the config (model type ``vispe_<family>``) and the
    ``…ForConditionalGeneration`` / bare ``…Model`` subclasses whose ``from_pretrained`` restores the scheme."""
    fam = _family(family)
    classes = _family_classes(fam)
    if classes is None:
        import transformers

        raise ImportError(f"transformers {transformers.__version__} has no {fam.classes[0]}; see vispe.integrations.hf.MODEL_FAMILIES")
    gen, bare = classes
    base_config = gen.config_class

    def from_dict(cls: type, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        config_dict = dict(config_dict)
        if TEXT_CONFIG_KEY in config_dict:  # the text config, kept away from the family's own config class
            config_dict["text_config"] = config_dict.pop(TEXT_CONFIG_KEY)
        return base_config.from_dict.__func__(cls, config_dict, **kwargs)

    config_cls = type(f"Vispe{base_config.__name__}", (base_config,), {"model_type": MODEL_TYPE_PREFIX + fam.name,
                                                                      "from_dict": classmethod(from_dict), "__module__": __name__})
    out: dict[str, type] = {config_cls.__name__: config_cls}
    for cls in (gen, bare):
        # from_pretrained: the guarded one of the family class (restores the recorded scheme)
        out[f"Vispe{cls.__name__}"] = type(f"Vispe{cls.__name__}", (cls,), {"config_class": config_cls, "__module__": __name__})
    _share_checkpoint_conversions({fam.name: config_cls.model_type, **{c.__name__: f"Vispe{c.__name__}" for c in classes}})
    return out


def _share_checkpoint_conversions(names: dict[str, str]) -> None:
    """The family's checkpoint key conversions (transformers 5.x saves some families in their original key layout and
    renames on load, by class name or model type) also for the vispe classes and model type."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
    except ImportError:  # transformers 4.x: no conversion on load
        return
    for own, vispe in names.items():
        mapping = get_checkpoint_conversion_mapping(own)
        if mapping is not None:
            register_checkpoint_conversion_mapping(vispe, mapping, overwrite=True)


def _auto_map(family: str) -> dict[str, str]:
    fam = _family(family)
    mod = MODELING_FILE.removesuffix(".py")
    names = list(saved_classes(family))
    return {"AutoConfig": f"{mod}.{names[0]}", "AutoModel": f"{mod}.Vispe{fam.classes[1]}",
            "AutoModelForImageTextToText": f"{mod}.Vispe{fam.classes[0]}"}


def _runs_own_code(model: nn.Module) -> bool:
    """The model's own scheme with default options: the saved model is the family's own model."""
    patch = getattr(model, "_vispe_position_patch", None)
    return patch is None or patch.identical


def write_switched_folder(model: nn.Module, save_directory: str | os.PathLike) -> None:
    """Turn a ``save_pretrained`` folder of a switched model into transformers' custom-code layout (see module doc)."""
    from .hf import model_family

    fam = model_family(model)
    path = os.path.join(save_directory, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    classes = saved_classes(fam.name)
    is_gen = any(c.__name__ == fam.classes[0] for c in type(model).__mro__)
    config["model_type"] = MODEL_TYPE_PREFIX + fam.name
    # the family's own config class (a plain Qwen2VLForConditionalGeneration.from_pretrained without vispe, vLLM, ...)
    # rejects a text config that is not a mapping: it fails naming this, instead of building the unswitched model
    config[TEXT_CONFIG_KEY] = config.pop("text_config")
    scheme = getattr(model, "_vispe_position_patch").scheme
    config["text_config"] = (f"this {fam.name} model runs the vispe position scheme {scheme!r} (vispe_position_scheme); load it with "
                             f"trust_remote_code=True, or after `import vispe.integrations.hf` (pip install 'vispe[hf]'), which read "
                             f"the text config from {TEXT_CONFIG_KEY}")
    config["architectures"] = [f"Vispe{fam.classes[0] if is_gen else fam.classes[1]}"]
    config["auto_map"] = _auto_map(fam.name)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    assignments = "\n".join(f'{name} = _classes["{name}"]' for name in classes)
    with open(os.path.join(save_directory, MODELING_FILE), "w", encoding="utf-8") as f:
        f.write(_MODELING_TEMPLATE.format(family=fam.name, assignments=assignments))


def _loaded(result: Any) -> nn.Module:
    return result[0] if isinstance(result, tuple) else result


def _guarded_from_pretrained(original: classmethod, cls: type, *args: Any, **kwargs: Any) -> Any:
    """``from_pretrained`` of a supported class: transformers' own, then the recorded scheme is restored (or the
    load is refused naming the record)."""
    from .hf import CONFIG_KEY, restore_position_scheme

    options = kwargs.pop(SCHEME_OPTIONS_KWARG, None) or {}
    vispe_cls = _switched_save_class(cls, args, kwargs)
    if vispe_cls is not None:  # a switched save loaded through the family's own class: its vispe subclass reads it
        return vispe_cls.from_pretrained(*args, **{SCHEME_OPTIONS_KWARG: options}, **kwargs)
    result = original.__get__(None, cls)(*args, **kwargs)
    model = _loaded(result)
    record = getattr(model.config, CONFIG_KEY, None)
    if record is not None:
        try:
            restore_position_scheme(model, **options)
        except (ValueError, TypeError, NotImplementedError) as e:
            raise ValueError(f"{cls.__name__}.from_pretrained: the saved model runs the vispe position scheme recorded in config.json "
                             f"({CONFIG_KEY}={record!r}), which could not be restored: {e}") from e
    return result


_HUB_KWARGS = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder")


def _switched_save_class(cls: type, args: tuple, kwargs: dict[str, Any]) -> type | None:
    """The vispe subclass of ``cls`` when ``from_pretrained``'s folder is a switched save (and no config is given)."""
    if not args or kwargs.get("config") is not None or cls.__module__ == __name__ or not isinstance(args[0], (str, os.PathLike)):
        return None
    from transformers import PretrainedConfig

    try:
        config_dict, _ = PretrainedConfig.get_config_dict(args[0], **{k: kwargs[k] for k in _HUB_KWARGS if k in kwargs})
    except (OSError, ValueError):
        return None  # transformers' own loading reports it
    model_type = str(config_dict.get("model_type", ""))
    if not model_type.startswith(MODEL_TYPE_PREFIX):
        return None
    return saved_classes(model_type.removeprefix(MODEL_TYPE_PREFIX)).get(f"Vispe{cls.__name__}")


def _guarded_save_pretrained(self: nn.Module, original: Any, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> Any:
    if _runs_own_code(self):
        return original(self, save_directory, *args, **kwargs)
    if kwargs.get("push_to_hub"):  # transformers would upload before the custom-code layout is written
        raise ValueError("save_pretrained(..., push_to_hub=True) of a model switched by vispe would upload it without the code that "
                         "loads it switched; call model.push_to_hub(repo_id) (it saves through this layout) or save_pretrained(path) "
                         "and upload the folder")
    out = original(self, save_directory, *args, **kwargs)
    write_switched_folder(self, save_directory)
    return out


def _unguarded(cls: type, name: str) -> Any:
    """The class attribute ``name`` as transformers defines it (under any guard an ancestor family class got)."""
    import inspect

    attr = inspect.getattr_static(cls, name)
    inner = getattr(attr, "__func__", attr)
    if isinstance(inner, functools.partial) and inner.func is _guarded_from_pretrained:
        return inner.args[0]
    if isinstance(attr, functools.partialmethod) and attr.func is _guarded_save_pretrained:
        return attr.args[0]
    return attr


@functools.cache
def install() -> None:
    """Guard ``from_pretrained`` / ``save_pretrained`` of every supported class in the installed transformers and
    register the vispe classes with the Auto classes (once per process; run when :mod:`vispe.integrations.hf`
    is imported)."""
    try:
        import transformers
    except ImportError:  # without the extra there is nothing to guard (apply_position_scheme names the install)
        return
    from .hf import MODEL_FAMILIES

    autos = [getattr(transformers, n, None) for n in ("AutoConfig", "AutoModel", "AutoModelForImageTextToText")]
    if any(a is None for a in autos):
        return  # a transformers release before the supported range: check_transformers_version names it
    for fam in MODEL_FAMILIES:
        classes = _family_classes(fam)
        if classes is None:
            continue  # a family newer than the installed transformers
        for cls in classes:
            if "_vispe_guarded" in vars(cls):
                continue
            cls.from_pretrained = classmethod(functools.partial(_guarded_from_pretrained, _unguarded(cls, "from_pretrained")))
            cls.save_pretrained = functools.partialmethod(_guarded_save_pretrained, _unguarded(cls, "save_pretrained"))
            cls._vispe_guarded = True
        saved = saved_classes(fam.name)
        config_cls = saved[f"Vispe{classes[0].config_class.__name__}"]
        transformers.AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        transformers.AutoModel.register(config_cls, saved[f"Vispe{fam.classes[1]}"], exist_ok=True)
        transformers.AutoModelForImageTextToText.register(config_cls, saved[f"Vispe{fam.classes[0]}"], exist_ok=True)
