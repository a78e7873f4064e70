"""``vispe fit|validate|test|predict --recipe NAME | -c config.yaml``: LightningCLI with vispe's defaults.

* Recipes: ``--recipe NAME`` is ``-c`` with the shipped recipe ``vispe/recipes/NAME.yaml`` (:mod:`vispe.recipes`;
  a path to a YAML file works too), so it works from an installed wheel and layers like any ``-c``:
  ``vispe fit --recipe cifar10 -c my_data.yaml --model.init_args.pos_encoding comrope_ld``.
* Run names: a logger whose ``name`` is left at its default (the recipes set none) is named after the model's
  positional encoding, so one recipe serves every encoding: ``--model.init_args.pos_encoding rope_axial`` writes
  ``runs/cifar10/rope_axial/version_N`` (the default logger too, when the config has none).

* Launchers: plain ``python`` (Lightning starts the processes itself), ``torchrun`` and
  ``fabric run`` all work. ``fabric run`` only exports ``LT_*`` variables and starts the processes
  with torchrun; the Trainer ignores ``LT_*``, and a Trainer left on ``devices='auto'`` then runs N
  independent single-device copies of the job. The CLI maps ``LT_*`` (or torchrun's
  ``LOCAL_WORLD_SIZE``/``WORLD_SIZE``) onto the trainer settings and refuses to start when the
  Trainer's world size differs from the launcher's.
* Data-derived model arguments: ``num_classes``, ``in_chans``, ``img_size`` and ``visual_dim`` are linked from the
  built DataModule (its ``num_classes``, ``in_chans``, ``image_size``, ``visual_dim`` attributes;
  ``LightningCLI.link_arguments(..., apply_on="instantiate")``) into any model whose ``__init__`` accepts them, so
  configs state them once; a link whose attribute the DataModule lacks, or whose argument the model lacks, is skipped.
* Defaults added when the config has none: a TQDM progress bar refreshed every 2 s (30 s in a log), CSV logger (plus TensorBoard when
  installed), learning-rate monitor, and a :class:`FinalLastCheckpoint` with ``last.ckpt`` in the
  logger's versioned folder ``<save_dir>/<name>/version_N/checkpoints``: a rerun never overwrites an
  earlier run, and ``--ckpt_path last`` resumes from the newest version that has a ``last.ckpt``
  (:func:`vispe.runs.find_last_checkpoint`). ``last.ckpt`` always holds the final step of a run that ended normally.
* A run killed at any step and resumed with ``--ckpt_path last`` equals the uninterrupted run: the
  training loader (:class:`vispe.data.ResumableDataLoader`) continues the epoch where the checkpoint left it.
* Checkpoints are written atomically (temp file in the same folder, fsync, ``os.replace``, the permissions the
  user's umask gives any new file; a failed write removes its temp file and names the checkpoint and the cause, e.g.
  a full disk; temp files a kill left behind are removed when the run starts again) and read through
  :func:`vispe.files.read_checkpoint` (``torch.load(weights_only=True)``: a checkpoint's pickle never runs code;
  a damaged file is named with what to do).
* ``--ckpt_path`` of a checkpoint whose model hyper-parameters differ from the configured model is refused
  (LightningCLI would silently build the checkpoint's model instead). ``--ckpt_hparams checkpoint`` builds the
  checkpoint's model (LightningCLI's behaviour), ``--ckpt_hparams config`` keeps the configured one (its weights
  must then fit the checkpoint's).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint, ProgressBar, TQDMProgressBar
from lightning.pytorch.cli import LightningCLI, _InstantiatorFn
from lightning.pytorch.loggers import CSVLogger, Logger

from vispe._checks import check_choice, did_you_mean
from vispe.files import read_checkpoint, remove_stale_temp_files, write_atomic
from vispe.runs import _version_number, find_last_checkpoint  # noqa: F401  (re-exported: where ``--ckpt_path last`` looks)
from vispe.recipes import check_config_files, expand_recipe_args

__all__ = ["CKPT_HPARAMS", "AtomicCheckpointIO", "TimedProgressBar", "apply_threads", "FinalLastCheckpoint", "ResumeTrainLoaderState", "VispeCLI",
           "RunFinished", "checkpoint_finished", "expand_recipe_args", "find_last_checkpoint", "launcher_trainer_settings", "main",
           "refuse_other_model", "run_name"]


_TRAINER_DEFAULTS = {"accelerator": "auto", "devices": "auto", "num_nodes": 1, "strategy": "auto", "precision": None}
#: DataModule attribute -> model argument, linked once the DataModule is built
_DATA_TO_MODEL = {"num_classes": "num_classes", "in_chans": "in_chans", "image_size": "img_size", "visual_dim": "visual_dim"}
#: ``--ckpt_hparams``: what to do when ``--ckpt_path``'s model hyper-parameters differ from the configured model
CKPT_HPARAMS = ("refuse", "checkpoint", "config")
_LIGHTNING_CKPT_NAMES = ("last", "best", "hpc", "registry")


class AtomicCheckpointIO(TorchCheckpointIO):
    """``torch.save`` into a temp file next to the target, fsync, then ``os.replace``.

    Lightning's default goes through an fsspec transaction whose temp file lives in the system
    temp dir; when that is another filesystem the final move is a copy, so a kill mid-save can
    leave a truncated ``last.ckpt``. A same-folder ``os.replace`` cannot.
    """

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """Always ``weights_only`` (whatever the caller asks): a resumed checkpoint never runs code."""
        if "://" in str(path):  # remote filesystems: Lightning's own path, still weights_only
            return super().load_checkpoint(path, map_location=map_location or "cpu", weights_only=True)
        return read_checkpoint(path, map_location=map_location or "cpu")

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}")
        if "://" in str(path):  # remote filesystems: Lightning's own path
            return super().save_checkpoint(checkpoint, path, storage_options)
        # temp file beside the target, fsync, rename; a failure removes the temp file and names the file and the cause
        write_atomic(path, lambda f: torch.save(checkpoint, f), "checkpoint")


class FinalLastCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` whose ``last.ckpt`` is the end of the run: Lightning saves on validation /
    epoch ends, so a run stopped by ``max_steps`` between two of them (``max_steps: 130,
    val_check_interval: 40``) would leave step 120 behind as ``last.ckpt``. This one saves once more
    when training ends normally and the last save is older than the final step."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        # temp files of a save that a kill interrupted (AtomicCheckpointIO: .<name>.<random>.tmp) are not checkpoints:
        # removed from this run's folder and from the folder of the checkpoint it resumes (known once it is restored)
        if trainer.is_global_zero:
            resumed = trainer.ckpt_path
            for folder in {self.dirpath, str(Path(resumed).parent) if resumed and "://" not in str(resumed) else None} - {None}:
                remove_stale_temp_files(folder, "*.ckpt")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        if self.save_last and not trainer.sanity_checking and self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


class TimedProgressBar(TQDMProgressBar):
    """A TQDM bar that refreshes by time, not by a batch count: every ``interval`` seconds (2 s on a terminal, 30 s
    in a log file / CI) and at the end of each loop. A fixed ``refresh_rate=10`` at 16 s per step sat at "0/390" for
    minutes; a per-batch refresh floods a log at hundreds of steps per second."""

    def __init__(self, interval: float | None = None) -> None:
        super().__init__(refresh_rate=1)
        self.interval = float(interval) if interval is not None else (2.0 if sys.stderr.isatty() else 30.0)
        self._last_refresh = 0.0

    def _should_update(self, current: int, total: int) -> bool:
        import time

        if not self.is_enabled:
            return False
        now = time.monotonic()
        if current == total or current <= 1 or now - self._last_refresh >= self.interval:
            self._last_refresh = now
            return True
        return False


class ResumeTrainLoaderState(Callback):
    """Hands the training loader its checkpointed position when a run resumes.

    Lightning restores a stateful loader's ``state_dict`` only if the fit loop builds its loaders after the
    restore; a task whose ``configure_optimizers`` reads ``trainer.estimated_stepping_batches`` (every vispe
    task: the schedule's length) makes Lightning build them earlier, and the saved position would be ignored
    (the resumed epoch would start again from its first batch). This applies it once training starts.
    """

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.fit_loop._load_combined_loader_states()


class RunFinished(Exception):
    """``--ckpt_path last`` of a run that already reached its ``max_epochs`` / ``max_steps``: nothing to do."""


def checkpoint_finished(ckpt: dict[str, Any], max_epochs: int | None, max_steps: int | None) -> str | None:
    """Why a checkpoint's run is already done under these limits (``'epoch 2 of max_epochs=2'``), else ``None``.

    Mirrors Lightning's fit-loop stop rule: ``max_steps`` reached, or ``max_epochs`` epochs completed (Lightning's
    default of 1,000 epochs when neither is set).
    """
    step = int(ckpt.get("global_step", 0) or 0)
    if max_steps is not None and max_steps >= 0 and step >= max_steps:
        return f"step {step} of max_steps={max_steps}"
    if max_epochs is None:
        max_epochs = 1000 if max_steps in (None, -1) else -1
    try:
        done = int(ckpt["loops"]["fit_loop"]["epoch_progress"]["current"]["processed"])
    except (KeyError, TypeError, ValueError):
        return None
    if max_epochs >= 0 and done >= max_epochs:
        return f"epoch {done} of max_epochs={max_epochs}"
    return None


def _keep_metrics_until(logger: Logger, step: int) -> None:
    """A resumed CSV logger continues the run's ``metrics.csv``: rows logged up to the checkpoint's step stay, later
    ones (logged by the killed run after its last checkpoint, logged again now) go. Lightning's CSV writer deletes
    an existing file when it starts, so the kept rows are written back once it has."""
    import csv

    path = Path(logger.log_dir) / "metrics.csv"
    if not path.is_file():
        return
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        header = list(reader.fieldnames or [])
        rows = [r for r in reader if not r.get("step") or int(float(r["step"])) < step]
    writer = logger.experiment  # creates the writer, which removes the file
    with open(path, "w", newline="") as f:
        out = csv.DictWriter(f, fieldnames=header)
        out.writeheader()
        out.writerows(rows)
    writer.metrics_keys = sorted(header)


def _int_or_str(value: str) -> int | str:
    return int(value) if value.strip().isdigit() else value


def launcher_trainer_settings(env: dict[str, str] | None = None) -> dict[str, tuple[Any, str]]:
    """Trainer settings implied by the process launcher: ``{key: (value, source)}``.

    ``fabric run`` exports ``LT_CLI_USED``, ``LT_DEVICES``, ``LT_NUM_NODES`` and, when given,
    ``LT_ACCELERATOR``/``LT_STRATEGY``/``LT_PRECISION``; torchrun exports ``LOCAL_WORLD_SIZE`` and
    ``WORLD_SIZE``. Both start every process themselves, so the Trainer must be told the layout.
    """
    env = dict(os.environ if env is None else env)
    out: dict[str, tuple[Any, str]] = {}
    if env.get("LT_CLI_USED") == "1":
        for key, var in (("accelerator", "LT_ACCELERATOR"), ("strategy", "LT_STRATEGY"), ("precision", "LT_PRECISION")):
            if env.get(var):
                out[key] = (env[var], var)
        if env.get("LT_DEVICES"):
            out["devices"] = (_int_or_str(env["LT_DEVICES"]), "LT_DEVICES")
        if env.get("LT_NUM_NODES"):
            out["num_nodes"] = (int(env["LT_NUM_NODES"]), "LT_NUM_NODES")
    elif env.get("TORCHELASTIC_RUN_ID") and env.get("LOCAL_WORLD_SIZE") and env.get("WORLD_SIZE"):
        local, world = int(env["LOCAL_WORLD_SIZE"]), int(env["WORLD_SIZE"])
        out["devices"] = (local, "LOCAL_WORLD_SIZE")
        out["num_nodes"] = (max(1, world // local), "WORLD_SIZE/LOCAL_WORLD_SIZE")
    world = int(env.get("WORLD_SIZE", "1") or 1)
    if world > 1 and "strategy" not in out and out:
        out["strategy"] = ("ddp", "launcher world size > 1")
    return out


def _import_class(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _get(ns: Any, key: str, default: Any = None) -> Any:
    try:
        value = ns[key] if not hasattr(ns, "get") else ns.get(key, default)
    except (KeyError, TypeError):
        return default
    return default if value is None else value


class _AcceptedLinksInstantiator(_InstantiatorFn):
    """Lightning's instantiator (the config becomes the module's hyper-parameters), given only the linked values the
    class accepts: jsonargparse skips a link whose target the chosen class lacks (``num_classes`` into the retrieval
    task), Lightning would still record it as a hyper-parameter, and the checkpoint could not build the class again."""

    def __call__(self, class_type: type, *args: Any, applied_instantiation_links: dict, **kwargs: Any) -> Any:
        accepted = inspect.signature(class_type.__init__).parameters
        prefix = f"{self.key}.init_args."
        links = {k: v for k, v in applied_instantiation_links.items()
                 if not k.startswith(prefix) or k[len(prefix):].split(".", 1)[0] in accepted}
        return super().__call__(class_type, *args, applied_instantiation_links=links, **kwargs)


@contextlib.contextmanager
def _subclass_scans_made_once() -> Any:
    """Within one command, each jsonargparse listing of a class's imported subclasses is made once.

    jsonargparse resolves a bare name given to a class-typed option (``model: vispe_vit_tiny_patch4_32`` against
    ``Backbone = nn.Module | str``) by walking every imported subclass of the class, and does so about 50 times per
    command: seconds of a ``vispe fit`` start with timm and Lightning imported, more with transformers. A listing is
    reused while no module has been imported since it was made (a new import can add subclasses).
    """
    from jsonargparse import _typehints

    scan = getattr(_typehints, "get_all_subclass_paths", None)
    if scan is None:  # another jsonargparse layout: no shortcut
        yield
        return
    made: dict[Any, list[str]] = {}

    def listing(cls: Any, include_abstract: bool = False, closed_types: bool = True) -> list[str]:
        try:
            key = (cls, include_abstract, closed_types, len(sys.modules))
            if key not in made:
                made[key] = scan(cls, include_abstract=include_abstract, closed_types=closed_types)
        except TypeError:  # an unhashable type hint
            return scan(cls, include_abstract=include_abstract, closed_types=closed_types)
        return list(made[key])

    _typehints.get_all_subclass_paths = listing
    try:
        yield
    finally:
        _typehints.get_all_subclass_paths = scan


class VispeCLI(LightningCLI):
    """LightningCLI with launcher mapping, data -> model argument links and vispe defaults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        # a misspelt flag that happens to be a prefix of a real one (--trainer.max_epoch) is an error, not that flag
        # and a bad option raises (main() turns it into one sentence) instead of printing the whole usage
        parser_kwargs = dict(kwargs.get("parser_kwargs") or {})
        parser_kwargs.setdefault("allow_abbrev", False)
        parser_kwargs.setdefault("exit_on_error", False)
        for sub in self.subcommands():
            parser_kwargs[sub] = {"allow_abbrev": False, "exit_on_error": False, **dict(parser_kwargs.get(sub) or {})}
        kwargs["parser_kwargs"] = parser_kwargs
        kwargs.setdefault("trainer_defaults", {k: v for k, (v, _) in launcher_trainer_settings().items()})
        with _subclass_scans_made_once():
            super().__init__(pl.LightningModule, pl.LightningDataModule, *args, **kwargs)

    def add_arguments_to_parser(self, parser: Any) -> None:
        for data_attr, model_arg in _DATA_TO_MODEL.items():
            # once the DataModule is built (it checks its files), its sizes become the model's arguments
            parser.link_arguments(f"data.{data_attr}", f"model.init_args.{model_arg}", apply_on="instantiate")
        parser.add_argument(
            "--threads", type=Optional[Union[int, str]], default=None,
            help="torch CPU threads per process: a number, 'auto' (this process's share of the cores less what other work "
                 "keeps busy) or null (torch's default, or $OMP_NUM_THREADS); the CPU recipes set 1, as their timings used",
        )
        parser.add_argument(
            "--ckpt_hparams", type=str, default="refuse",
            help="when --ckpt_path's model hyper-parameters differ from the configured model: 'refuse' (default), "
                 "'checkpoint' (build the checkpoint's model) or 'config' (build the configured model, load the weights into it)",
        )

    def parse_arguments(self, parser: Any, args: Any) -> None:
        """A misspelt option names the closest real ones (``--trainer.max_epoch`` -> ``--trainer.max_epochs``)."""
        try:
            super().parse_arguments(parser, args)
        except argparse.ArgumentError as err:
            text = str(err)
            match = re.search(r"unrecognized arguments: (\S+)", text)
            if match is None:
                raise
            options = set(parser._option_string_actions)
            subparsers = getattr(getattr(parser, "_subcommands_action", None), "_name_parser_map", {}) or {}
            for sub, subparser in subparsers.items():
                if not args or sub in args:
                    options |= set(subparser._option_string_actions)
            bad = match.group(1).split("=", 1)[0]
            raise argparse.ArgumentError(None, f"{text}{did_you_mean(bad, sorted(options))}") from None

    # -- --ckpt_path: read safely, never swap the model silently ---------------------------
    def _parse_ckpt_path(self) -> None:
        """LightningCLI replaces the configured model's hyper-parameters by the checkpoint's; here that needs consent."""
        sub = self.config.get("subcommand")
        if not sub:
            return
        cfg = self.config[sub]
        policy = cfg.get("ckpt_hparams") or "refuse"
        check_choice("--ckpt_hparams", policy, CKPT_HPARAMS)
        ckpt_path = cfg.get("ckpt_path")
        if not ckpt_path or str(ckpt_path) in _LIGHTNING_CKPT_NAMES or str(ckpt_path).startswith("registry:") or "://" in str(ckpt_path):
            return  # 'last' / 'best' / registry / remote: resolved (and read through AtomicCheckpointIO) by the Trainer
        if not Path(ckpt_path).is_file():
            raise FileNotFoundError(
                f"--ckpt_path {str(ckpt_path)!r} does not exist; pass a checkpoint file, or 'last' to resume from the run's last.ckpt"
            )
        ckpt = read_checkpoint(ckpt_path)
        hparams = dict(ckpt.get("hyper_parameters") or {}) if isinstance(ckpt, dict) else {}
        hparams.pop("_instantiator", None)
        if not hparams or policy == "config":
            return
        if policy == "refuse" and cfg.get("model") is not None:
            # compared once the model is built (instantiate_trainer): its data-linked arguments (num_classes ...) take part
            self._ckpt_to_compare = (ckpt_path, hparams)
            return
        if "_class_path" in hparams:
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
        self.config = self.parser.parse_object({sub: {"model": hparams}}, self.config)

    def _last_checkpoint(self) -> Path:
        """``--ckpt_path last``: the newest ``last.ckpt`` among the run's versions (Lightning would look only in this
        run's new, empty version folder and silently start from scratch)."""
        run_dir = getattr(self, "_run_dir", None)
        found = find_last_checkpoint(run_dir) if run_dir is not None else None
        if found is None:
            where = f"{run_dir}/version_*/checkpoints" if run_dir is not None else "the logger's folder"
            raise FileNotFoundError(f"--ckpt_path last: no last.ckpt under {where}; nothing to resume "
                                    f"(pass a checkpoint file, or drop --ckpt_path to start a new run)")
        return found

    def _prepare_subcommand_kwargs(self, subcommand: str) -> dict[str, Any]:
        kwargs = super()._prepare_subcommand_kwargs(subcommand)
        if kwargs.get("ckpt_path") == "last":
            kwargs["ckpt_path"] = str(self._last_checkpoint())
        return kwargs

    def _check_last_checkpoint(self, path: Path | None = None) -> None:
        """``--ckpt_path last`` is resolved only once the Trainer exists: compare its hyper-parameters here (or with
        ``path``, the checkpoint it will resolve to, before then)."""
        cfg = self.config[self.subcommand]
        if str(cfg.get("ckpt_path")) != "last":
            return
        path = path if path is not None else self._last_checkpoint()
        if (cfg.get("ckpt_hparams") or "refuse") == "config":
            return
        ckpt = read_checkpoint(path)
        diffs = _hparam_differences(self._model_config(), dict(ckpt.get("hyper_parameters") or {}) if isinstance(ckpt, dict) else {})
        if diffs:
            raise ValueError(
                f"--ckpt_path last ({path!r}) was saved from a model with other hyper-parameters than the configured model: "
                f"{'; '.join(diffs)}. Make the config match, or pass the file itself (--ckpt_path {path}) with "
                f"--ckpt_hparams checkpoint to build the checkpoint's model"
            )

    def _model_config(self) -> Any:
        """The configured model as ``{'class_path', 'init_args'}``: the built model's hyper-parameters (with the values
        linked from the data) once it exists, the parsed config before."""
        model = getattr(self, "model", None)
        if isinstance(model, pl.LightningModule) and model.hparams:
            hp = dict(model.hparams)
            cls = type(model)
            return {"class_path": hp.get("_class_path") or f"{cls.__module__}.{cls.__qualname__}",
                    "init_args": {k: v for k, v in hp.items() if not k.startswith("_")}}
        return self.config[self.subcommand].get("model")

    def before_fit(self) -> None:
        self._check_last_checkpoint()

    def before_validate(self) -> None:
        self._check_last_checkpoint()

    def before_test(self) -> None:
        self._check_last_checkpoint()

    def before_predict(self) -> None:
        self._check_last_checkpoint()

    # -- before anything is built ----------------------------------------------------------
    def before_instantiate_classes(self) -> None:
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        apply_threads(cfg.get("threads"))
        self._apply_launcher(cfg)
        self._name_run_after_encoding(cfg)

    def _name_run_after_encoding(self, cfg: Any) -> None:
        """Loggers whose ``name`` is their class's default get the encoding's name (one recipe, every encoding)."""
        self._encoding_run_name = run_name(cfg.get("model"))
        trainer = cfg.get("trainer")
        loggers = trainer.get("logger") if trainer is not None else None
        if self._encoding_run_name is None or loggers in (None, True, False):
            return
        for logger in loggers if isinstance(loggers, list) else [loggers]:
            class_path, init = _get(logger, "class_path"), _get(logger, "init_args")
            if not class_path or init is None:
                continue
            param = inspect.signature(_import_class(class_path).__init__).parameters.get("name")
            if param is not None and init.get("name") in (None, param.default):
                init["name"] = self._encoding_run_name

    def _apply_launcher(self, cfg: Any) -> None:
        trainer = cfg.get("trainer")
        if trainer is None:
            return
        for key, (value, source) in launcher_trainer_settings().items():
            current = trainer.get(key)
            if current in (None, _TRAINER_DEFAULTS.get(key)) or str(current) == str(value):
                trainer[key] = value
            else:
                raise ValueError(
                    f"trainer.{key}={current!r} conflicts with the process launcher ({source}={value!r}): the launcher "
                    f"already started the processes; remove trainer.{key} from the config or launch with matching flags"
                )

    def instantiate_classes(self) -> None:
        """A constructor's own error (a missing data folder, an unknown model) as it was raised, not inside
        jsonargparse's "Does not validate against any of the Union subtypes" report."""
        try:
            super().instantiate_classes()
        except ValueError as err:
            cause = err
            while cause.__cause__ is not None:
                cause = cause.__cause__
            if cause is err:
                raise
            raise cause from None

    def _add_instantiators(self) -> None:
        with warnings.catch_warnings():  # the API LightningCLI itself uses (deprecated in jsonargparse 4.49, kept to 5.0)
            warnings.filterwarnings("ignore", message=".*add_instantiator")
            self.parser.add_instantiator(_AcceptedLinksInstantiator(cli=self, key="model"), pl.LightningModule,
                                         subclasses=self.subclass_mode_model)
            self.parser.add_instantiator(_AcceptedLinksInstantiator(cli=self, key="data"), pl.LightningDataModule,
                                         subclasses=self.subclass_mode_data)

    # -- --ckpt_path last: the same version folder, or nothing to do ------------------------
    def _resume_in_same_version(self, logger: Any, first_logger: Any, tcfg: dict[str, Any]) -> None:
        """A resumed run logs and checkpoints into the version folder it was saved in (one run, one folder of
        metrics); a run already at its ``max_epochs`` / ``max_steps`` raises :class:`RunFinished` before anything
        is written."""
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        if self.subcommand != "fit" or str(cfg.get("ckpt_path")) != "last" or not isinstance(first_logger, Logger) \
                or not getattr(first_logger, "save_dir", None):
            return
        found = find_last_checkpoint(Path(first_logger.save_dir) / (first_logger.name or ""))
        if found is None:
            return  # _last_checkpoint() says so with the fix
        self._check_last_checkpoint(found)  # another architecture is refused first, finished or not
        ckpt = read_checkpoint(found)
        done = checkpoint_finished(ckpt, tcfg.get("max_epochs"), tcfg.get("max_steps"))
        if done is not None:
            raise RunFinished(f"{found} is a finished run ({done}); nothing to resume and nothing written. Raise "
                              f"--trainer.max_epochs / --trainer.max_steps to train it further, or drop --ckpt_path "
                              f"for a new run")
        version = found.parent.parent.name
        if found.parent.name != "checkpoints" or not version.startswith("version_"):
            return  # an unversioned folder of older runs
        for lg in logger if isinstance(logger, (list, tuple)) else [logger]:
            if hasattr(lg, "_version") and getattr(lg, "_experiment", None) is None:
                lg._version = _version_number(found.parent.parent)
        for lg in logger if isinstance(logger, (list, tuple)) else [logger]:
            if isinstance(lg, CSVLogger) and Path(lg.log_dir) == found.parent.parent:
                _keep_metrics_until(lg, int(ckpt.get("global_step", 0) or 0))

    # -- trainer with vispe defaults -------------------------------------------------------
    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        compare = getattr(self, "_ckpt_to_compare", None)
        if compare is not None:  # --ckpt_path FILE: refused before any logger or checkpoint folder exists
            refuse_other_model(compare[0], compare[1], self._model_config(),
                               "Pass --ckpt_hparams checkpoint to build the checkpoint's model, --ckpt_hparams config to "
                               "build the configured one (the checkpoint's weights must fit it), or make the config match")
        tcfg = self._get(self.config_init, "trainer", default={}) or {}
        callbacks = list(tcfg.get("callbacks") or [])
        logger = tcfg.get("logger")
        if logger is None or logger is True:
            root = tcfg.get("default_root_dir") or "runs"
            name = getattr(self, "_encoding_run_name", None) or "vispe"
            logger = [CSVLogger(save_dir=root, name=name)]
            try:
                from lightning.pytorch.loggers import TensorBoardLogger

                logger.append(TensorBoardLogger(save_dir=root, name=name, version=logger[0].version))
            except ModuleNotFoundError:  # tensorboard is optional
                pass
            kwargs["logger"] = logger
        first_logger = logger[0] if isinstance(logger, (list, tuple)) and logger else logger
        self._resume_in_same_version(logger, first_logger, tcfg)
        if tcfg.get("enable_progress_bar", True) is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(TimedProgressBar())
        if logger is not False and not any(isinstance(c, LearningRateMonitor) for c in callbacks):
            callbacks.append(LearningRateMonitor(logging_interval="step"))
        if tcfg.get("enable_checkpointing", True) is not False and not any(isinstance(c, ModelCheckpoint) for c in callbacks):
            if isinstance(first_logger, Logger) and getattr(first_logger, "save_dir", None):
                # the logger's own version folder: a rerun gets version_N+1 and never overwrites this run
                ckpt_dir = Path(first_logger.log_dir) / "checkpoints"
            else:
                ckpt_dir = Path(tcfg.get("default_root_dir") or ".") / "checkpoints"
            callbacks.append(FinalLastCheckpoint(dirpath=str(ckpt_dir), filename="epoch{epoch:03d}", auto_insert_metric_name=False,
                                                 save_top_k=1, save_last=True))
        if not any(isinstance(c, ResumeTrainLoaderState) for c in callbacks):
            callbacks.append(ResumeTrainLoaderState())
        kwargs["callbacks"] = callbacks
        trainer = super().instantiate_trainer(**kwargs)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        self._run_dir = Path(first_logger.save_dir) / (first_logger.name or "") if isinstance(first_logger, Logger) and getattr(first_logger, "save_dir", None) else None
        launched = int(os.environ.get("WORLD_SIZE", "0") or 0)
        if launched and trainer.world_size != launched:
            raise RuntimeError(
                f"the launcher started WORLD_SIZE={launched} processes but the Trainer's world size is {trainer.world_size} "
                f"(devices={trainer.num_devices}, num_nodes={trainer.num_nodes}); each process would train its own copy. "
                f"Set trainer.devices/num_nodes to match the launcher."
            )
        return trainer


def apply_threads(threads: int | str | None) -> int:
    """``--threads``: set torch's CPU threads (``'auto'``: :func:`vispe.data.loading.auto_threads`; ``None``: leave
    torch's default) and return the count in use. Anything else raises ``ValueError`` naming the value."""
    from vispe.data.loading import auto_threads

    if threads is None:
        return torch.get_num_threads()
    if threads == "auto":
        threads = auto_threads()
    elif isinstance(threads, str) and threads.strip().isdigit():
        threads = int(threads)
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"--threads={threads!r} is not valid; give a number >= 1, 'auto' or null (torch's default)")
    torch.set_num_threads(threads)
    return threads


def _plain(value: Any) -> Any:
    """Config values as plain Python (jsonargparse Namespaces -> dicts, tuples -> lists) for comparison."""
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def run_name(model_cfg: Any) -> str | None:
    """The folder name a run of this model config is given: its positional encoding's name (options dropped:
    ``rope_axial[coord_shift=1.0]`` -> ``rope_axial``; a composition keeps its parts, ``learned+rope_axial``);
    ``None`` when the model has no ``pos_encoding``."""
    from vispe.encodings.spec import parse_pos_encoding

    init = _get(model_cfg, "init_args")
    spec = _plain(_get(init, "pos_encoding"))
    if spec is None:  # a backbone given as a module config: its own pos_encoding
        spec = _plain(_get(_get(_get(init, "model"), "init_args"), "pos_encoding"))
    if spec is None:
        return None
    try:
        name = parse_pos_encoding(spec)[0]
    except (ValueError, TypeError):
        return None  # the model refuses it with the full message when it is built
    name = re.sub(r"\[[^\]]*\]", "", str(name))  # per-part options of a composition
    name = re.sub(r"[^\w.+-]+", "_", name).strip("_")
    return name or None


def refuse_other_model(ckpt_path: Any, hparams: dict[str, Any], model_cfg: Any, fix: str, what: str = "--ckpt_path") -> None:
    """Raise ``ValueError`` naming every hyper-parameter (encoding, architecture, ...) in which the checkpoint's model
    differs from the configured one: resuming it would train another model than the one asked for."""
    diffs = _hparam_differences(model_cfg, hparams)
    if diffs:
        raise ValueError(f"{what} {str(ckpt_path)!r} was saved from a model with other hyper-parameters than the configured "
                         f"model: {'; '.join(diffs)}. {fix}")


def _hparam_differences(model_cfg: Any, hparams: dict[str, Any]) -> list[str]:
    """``'key: config X, checkpoint Y'`` for every saved hyper-parameter the configured model sets differently."""
    model_cfg = _plain(model_cfg) or {}
    diffs = []
    saved_class = hparams.get("_class_path")
    if saved_class and model_cfg.get("class_path") and saved_class != model_cfg["class_path"]:
        diffs.append(f"model class: config {model_cfg['class_path']}, checkpoint {saved_class}")
    init = model_cfg.get("init_args") or {}
    for key, saved in hparams.items():
        if key.startswith("_") or key not in init:
            continue
        if _plain(saved) != init[key]:
            diffs.append(f"{key}: config {init[key]!r}, checkpoint {_plain(saved)!r}")
    return diffs


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``vispe fit|validate|test|predict`` and ``train/fit.py``."""
    import vispe  # noqa: F401  (registers models and encodings)
    import vispe.data  # noqa: F401
    import vispe.tasks  # noqa: F401

    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:  # --recipe is vispe's, LightningCLI's help does not list it
        from vispe.recipes import list_recipes

        print(f"--recipe NAME          a shipped recipe, the same as -c vispe/recipes/NAME.yaml in its place: {', '.join(list_recipes())}\n")
    argv = expand_recipe_args(argv)
    check_config_files(argv)
    with warnings.catch_warnings():
        # vispe always passes the arguments explicitly (`vispe fit ...` re-dispatches sys.argv)
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        try:
            VispeCLI(args=argv)
        except RunFinished as done:
            print(f"vispe fit: {done}", file=sys.stderr)
            return 0
        except argparse.ArgumentError as err:
            raise ValueError(_with_option_hint(argument_error_sentence(str(err)))) from err
    return 0


def _with_option_hint(sentence: str) -> str:
    """jsonargparse's "Option 'x' is not accepted" for a class's init argument, with the closest real arguments."""
    match = re.search(r"class_path '([\w.]+)': Option '(\w+)' is not accepted", sentence)
    if match is None:
        return sentence
    try:
        params = [p for p in inspect.signature(_import_class(match.group(1)).__init__).parameters if p != "self"]
    except (ImportError, AttributeError, ValueError, TypeError):
        return sentence
    return sentence + did_you_mean(match.group(2), params)


def argument_error_sentence(text: str) -> str:
    """jsonargparse's report of a bad option as one line: ``'<key>: <reason>'``.

    A class that failed to parse is reported as "Does not validate against any of the Union subtypes" with one item
    per candidate type under ``Errors:``; the reason is the item that is not a bare type mismatch
    (``Expected a <class 'NoneType'>``), with its indented continuation lines.
    """
    lines = text.splitlines()
    key = re.match(r'Parser key "([^"]+)":', lines[0].strip()) if lines else None
    head = f"{key.group(1)}: " if key else ""
    body = lines[1:] if key else lines
    errors_at = next((i for i, line in enumerate(body) if line.strip() == "Errors:"), None)
    if errors_at is None:
        return head + " ".join(line.strip() for line in body if line.strip() and not line.strip().startswith("Given value"))
    indent = len(body[errors_at]) - len(body[errors_at].lstrip())
    items: list[list[str]] = []
    for line in body[errors_at + 1:]:
        if len(line) - len(line.lstrip()) <= indent:
            break
        if line.strip().startswith("- "):
            items.append([line.strip()[2:]])
        elif items:
            items[-1].append(line.strip())
    reasons = [" ".join(item) for item in items if not item[0].startswith("Expected a <class 'NoneType'>")]
    sentence = head + "; ".join(reasons or [" ".join(item) for item in items])
    given = next((line.strip()[len("Given value:"):].strip() for line in body if line.strip().startswith("Given value:")), "")
    if given and "NestedArg" not in given and given not in sentence:
        sentence += f" (got {given})"
    return sentence


if __name__ == "__main__":
    sys.exit(main())
