"""The one runner: every vispe experiment that trains goes through here, and here only through LightningCLI.

A run is a recipe (``vispe/recipes/<name>.yaml`` or any LightningCLI YAML file), overrides on top of it
(dotted keys, ``{"model.init_args.lr": 1e-3}`` or ``["model.init_args.lr=1e-3"]``) and a seed. The
benchmarks (``vispe three-cell``, ``vispe niah``, ``vispe retrieval``) are grids of such runs plus a scoring
function; they evaluate the trained model on their extra loaders with the run's own Trainer
(:meth:`RunResult.evaluate`) instead of building another one::

    from vispe.runner import run
    result = run("three_cell", {"model.init_args.pos_encoding": "rope_mixed", "trainer.max_epochs": 1}, seed=0)
    result.evaluate("test")              # the recipe's test loader, same Trainer
    result.metrics["test/avg"]

The Trainer is built by :class:`vispe.train_cli.VispeCLI` (``run=False``), so a recipe means the same thing to
``vispe fit -c`` and to a benchmark.
"""
from __future__ import annotations

import copy
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, Sequence

import yaml

from vispe.recipes import recipe_path

__all__ = ["RunResult", "apply_overrides", "build", "load_recipe", "parse_overrides", "run"]

_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")

Overrides = Mapping[str, Any] | Iterable[str] | None


@dataclass
class RunResult:
    """A built (and, after :func:`run`, trained) run: the objects LightningCLI made and what they logged."""

    trainer: Any
    model: Any
    datamodule: Any
    config: dict[str, Any]
    run_dir: Path | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    def evaluate(self, stage: Literal["test", "validate"] = "test", dataloaders: Any = None) -> dict[str, float]:
        """``trainer.test`` / ``trainer.validate`` of the trained model with the run's own Trainer, on ``dataloaders``
        (default: the datamodule's). Every batch is evaluated, whatever ``limit_*_batches`` the recipe sets for
        validation during training. Returns the logged metrics (also merged into :attr:`metrics`)."""
        if stage not in ("test", "validate"):
            raise ValueError(f"stage={stage!r}; choose 'test' or 'validate'")
        attr = "limit_test_batches" if stage == "test" else "limit_val_batches"
        limit = getattr(self.trainer, attr)
        setattr(self.trainer, attr, 1.0)
        try:
            source = {"dataloaders": dataloaders} if dataloaders is not None else {"datamodule": self.datamodule}
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", ".*does not have many workers.*")
                outputs = getattr(self.trainer, stage)(self.model, verbose=False, **source)
        finally:
            setattr(self.trainer, attr, limit)
        metrics: dict[str, float] = {}
        for out in outputs:
            metrics.update({k: float(v) for k, v in out.items()})
        self.metrics.update(metrics)
        return metrics


def load_recipe(recipe: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A recipe as a dict: a shipped name (:func:`vispe.recipes.recipe_path`), a YAML file, or a dict (copied)."""
    if isinstance(recipe, Mapping):
        return copy.deepcopy(dict(recipe))
    path = recipe_path(recipe)
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"recipe {str(path)!r} is not valid YAML: {' '.join(str(err).split())}") from None
    if not isinstance(config, dict):
        what = "empty" if config is None else f"a YAML {type(config).__name__}"
        raise ValueError(f"recipe {str(path)!r} is {what}, not a LightningCLI config (a mapping with trainer/model/data)")
    return config


def parse_overrides(overrides: Overrides) -> dict[str, Any]:
    """``{"a.b": value}`` from a mapping or from ``"a.b=value"`` strings (values read as YAML: ``1e-3``, ``[4, 8]``,
    ``{name: learned}``, ``null``)."""
    if overrides is None:
        return {}
    if isinstance(overrides, Mapping):
        return dict(overrides)
    out: dict[str, Any] = {}
    for item in overrides:
        key, sep, text = str(item).partition("=")
        if not sep or not key.strip():
            raise ValueError(f"override {item!r} is not KEY=VALUE (e.g. model.init_args.lr=1e-3)")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            raise ValueError(f"override {item!r}: the value is not valid YAML") from None
        if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
        out[key.strip()] = value
    return out


def apply_overrides(config: Mapping[str, Any], overrides: Overrides) -> dict[str, Any]:
    """A copy of ``config`` with each dotted key set (missing levels created); a key that goes through a value
    that is not a mapping is an error naming it."""
    config = copy.deepcopy(dict(config))
    for key, value in parse_overrides(overrides).items():
        node = config
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ValueError(f"override {key!r}: {'.'.join(parts[: i + 1])} is {child!r}, not a mapping")
            node = child
        node[parts[-1]] = copy.deepcopy(value)
    return config


def build(
    recipe: str | Path | Mapping[str, Any],
    overrides: Overrides = None,
    *,
    seed: int | None = None,
    out_dir: str | Path | None = None,
    callbacks: Sequence[Any] = (),
) -> RunResult:
    """Instantiate a run (model, datamodule, Trainer) through :class:`vispe.train_cli.VispeCLI` without training it.

    ``seed`` sets ``seed_everything`` (every RNG, workers included, seeded before anything is built); ``out_dir``
    becomes ``trainer.default_root_dir`` and receives the resolved ``config.yaml``; ``callbacks`` are added to the
    recipe's own.
    """
    from jsonargparse import ArgumentError

    from vispe.train_cli import VispeCLI, launcher_trainer_settings

    config = apply_overrides(load_recipe(recipe), overrides)
    if seed is not None:
        config["seed_everything"] = int(seed)
    if out_dir is not None:
        config.setdefault("trainer", {})["default_root_dir"] = str(out_dir)
    trainer_defaults: dict[str, Any] = {k: v for k, (v, _) in launcher_trainer_settings().items()}
    if callbacks:
        trainer_defaults["callbacks"] = list(callbacks)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        try:
            cli = VispeCLI(args=config, run=False, trainer_defaults=trainer_defaults, parser_kwargs={"exit_on_error": False},
                           save_config_callback=None if out_dir is None else _save_config_callback())
        except ArgumentError as err:  # a misspelt key or a value of the wrong type: one line naming it, not the usage text
            raise ValueError(f"recipe {recipe if not isinstance(recipe, Mapping) else '(dict)'}: {' '.join(str(err).split())}") from None
    run_dir = Path(cli.trainer.log_dir) if out_dir is not None and cli.trainer.log_dir else None
    return RunResult(trainer=cli.trainer, model=cli.model, datamodule=cli.datamodule, config=config, run_dir=run_dir)


def _refuse_other_model(ckpt_path: str, result: RunResult) -> None:
    """The resume check of ``vispe fit --ckpt_path``: the checkpoint's model hyper-parameters against the built model's."""
    from vispe.files import read_checkpoint
    from vispe.train_cli import find_last_checkpoint, refuse_other_model

    path = Path(ckpt_path)
    if str(ckpt_path) == "last" and result.run_dir is not None:
        found = find_last_checkpoint(result.run_dir.parent)
        path = found if found is not None else path
    if not path.is_file():
        if str(ckpt_path) in ("last", "best", "hpc") or "://" in str(ckpt_path) or str(ckpt_path).startswith("registry:"):
            return  # resolved by the Trainer
        raise FileNotFoundError(f"ckpt_path {str(ckpt_path)!r} does not exist; pass a checkpoint file to resume from")
    ckpt = read_checkpoint(path)
    hparams = dict(ckpt.get("hyper_parameters") or {}) if isinstance(ckpt, dict) else {}
    model_cfg = {"class_path": (result.config.get("model") or {}).get("class_path"),
                 "init_args": {k: v for k, v in dict(result.model.hparams).items() if not k.startswith("_")}}
    refuse_other_model(path, hparams, model_cfg, "Resume from a checkpoint of this model, or pass ckpt_hparams='config' "
                                                 "to load its weights into the configured model", what="ckpt_path")


def _save_config_callback() -> Any:
    from lightning.pytorch.cli import SaveConfigCallback

    return SaveConfigCallback


def run(
    recipe: str | Path | Mapping[str, Any],
    overrides: Overrides = None,
    *,
    seed: int | None = None,
    out_dir: str | Path | None = None,
    callbacks: Sequence[Any] = (),
    ckpt_path: str | None = None,
    ckpt_hparams: Literal["refuse", "config"] = "refuse",
) -> RunResult:
    """:func:`build` then ``trainer.fit``; :attr:`RunResult.metrics` holds what training logged.

    ``ckpt_path`` resumes a run. As with ``vispe fit``, a checkpoint file saved from a model with other
    hyper-parameters (another encoding, another width) is refused naming each difference, before any step;
    ``ckpt_hparams='config'`` loads its weights into the configured model anyway (they must fit it).
    """
    from vispe._checks import check_choice

    check_choice("ckpt_hparams", ckpt_hparams, ("refuse", "config"))
    result = build(recipe, overrides, seed=seed, out_dir=out_dir, callbacks=callbacks)
    if ckpt_path is not None and ckpt_hparams == "refuse":
        _refuse_other_model(ckpt_path, result)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        result.trainer.fit(result.model, datamodule=result.datamodule, ckpt_path=ckpt_path)
    result.metrics.update({k: float(v) for k, v in result.trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1})
    return result
