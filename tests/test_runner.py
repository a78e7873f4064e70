"""The one runner (vispe.runner) and the one optimiser/schedule helper (vispe.tasks.optim).

The schedule tests compare the helper, driven through each task's ``configure_optimizers``, with the formulas the
tasks used before the helper existed (written out here as the oracle), step by step, for the published recipes.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from vispe.runner import apply_overrides, parse_overrides
from vispe.tasks.optim import check_schedule, warmup_cosine


# -- the schedules before vispe.tasks.optim (oracle) -----------------------------------------------------------------
def _old_classification(step: int, total: int, warmup: int, min_ratio: float) -> float:  # also NIAH / retrieval
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _old_three_cell(step: int, total: int, warmup_fraction: float, lr: float, min_lr: float) -> float:
    warmup = int(warmup_fraction * total) if warmup_fraction < 1 else int(warmup_fraction)
    floor = min_lr / lr
    if step < warmup:
        return (step + 1) / (warmup + 1)
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))


def _lrs(task, total: int, steps_per_epoch: int) -> list[float]:
    """Per-step LR of the task's own optimiser + scheduler over ``total`` steps (a stand-in trainer gives the length)."""
    task._trainer = SimpleNamespace(estimated_stepping_batches=total, num_training_batches=steps_per_epoch, accumulate_grad_batches=1)
    conf = task.configure_optimizers()
    opt, sched = conf["optimizer"], conf["lr_scheduler"]["scheduler"]
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


class _Task(torch.nn.Module):
    """The smallest object a task's configure_optimizers runs on: hparams, parameters, a trainer."""

    def __init__(self, cls, hparams: dict) -> None:
        super().__init__()
        self.model = torch.nn.Linear(2, 2)
        self.visual, self.text = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        self.logit_scale = torch.nn.Parameter(torch.zeros(()))
        self.hparams = SimpleNamespace(**{"betas": (0.9, 0.999), "warmup_epochs": None, "warmup_steps": None, **hparams})
        self.configure_optimizers = lambda: cls.configure_optimizers(self)

    @property
    def trainer(self):
        return self._trainer


# (task class, its published hparams, total steps, steps per epoch, oracle multiplier)
def _published():
    from vispe.tasks import ImageClassification, ThreeCellTask, VideoNIAH, VideoTextRetrieval

    return [
        # vispe three-cell --quick (4 epochs x 250 steps, 5 % warm-up) and the full recipe (10 epochs)
        ("three_cell quick", ThreeCellTask, dict(lr=3e-3, min_lr=2.5e-5, weight_decay=0.05, warmup_epochs=0.2), 1000, 250,
         lambda s: _old_three_cell(s, 1000, 0.05, 3e-3, 2.5e-5)),
        ("three_cell", ThreeCellTask, dict(lr=3e-3, min_lr=2.5e-5, weight_decay=0.05, warmup_epochs=0.5), 2500, 250,
         lambda s: _old_three_cell(s, 2500, 0.05, 3e-3, 2.5e-5)),
        # vispe niah (200 steps, 20 warm-up, min_lr_ratio 0.01 of lr 2e-3) and vispe niah --quick (3 steps, 1 warm-up)
        ("niah", VideoNIAH, dict(lr=2e-3, min_lr=2e-5, weight_decay=0.05, warmup_steps=20), 200, 200,
         lambda s: _old_classification(s, 200, 20, 0.01)),
        ("niah quick", VideoNIAH, dict(lr=2e-3, min_lr=2e-5, weight_decay=0.05, warmup_steps=1), 3, 3,
         lambda s: _old_classification(s, 3, 1, 0.01)),
        # vispe retrieval (200 steps, 20 warm-up, lr 1e-3) and --quick (4 steps, 1 warm-up)
        ("retrieval", VideoTextRetrieval, dict(lr=1e-3, min_lr=1e-5, weight_decay=0.05, warmup_steps=20), 200, 32,
         lambda s: _old_classification(s, 200, 20, 0.01)),
        ("retrieval quick", VideoTextRetrieval, dict(lr=1e-3, min_lr=1e-5, weight_decay=0.05, warmup_steps=1), 4, 1,
         lambda s: _old_classification(s, 4, 1, 0.01)),
        # configs/smoke.yaml-like classification (warm-up 0.5 epoch of 7 batches) and a CIFAR recipe (5 of 100 epochs)
        ("classification smoke", ImageClassification, dict(lr=1e-3, min_lr=1e-5, weight_decay=0.05, warmup_epochs=0.5), 14, 7,
         lambda s: _old_classification(s, 14, min(int(round(0.5 * 7)), 13), 0.01)),
        ("classification cifar", ImageClassification, dict(lr=1e-3, min_lr=1e-5, weight_decay=0.05, warmup_epochs=5), 1000, 10,
         lambda s: _old_classification(s, 1000, 50, 0.01)),
    ]


@pytest.mark.parametrize("case", range(8))
def test_every_task_schedule_equals_its_old_formula(case):
    name, cls, hparams, total, per_epoch, oracle = _published()[case]
    lrs = _lrs(_Task(cls, hparams), total, per_epoch)
    want = [hparams["lr"] * oracle(s) for s in range(total)]
    assert lrs == want, name  # bit for bit: the published tables depend on it


def test_warmup_forms_and_cosine_end():
    total, warm = 100, 10
    a = [warmup_cosine(s, total, warm, 0.01) for s in range(total + 1)]
    b = [warmup_cosine(s, total, warm, 0.01, "first_cosine") for s in range(total + 1)]
    assert a[warm - 1] == 1.0 and b[warm - 1] == pytest.approx(warm / (warm + 1)) and a[warm] == b[warm] == 1.0
    assert a[warm:] == b[warm:]  # the forms differ only in the ramp
    assert all(x >= y for x, y in zip(a[warm:], a[warm + 1:])) and a[-1] == pytest.approx(0.01)


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr=0.0), "lr must be > 0, got 0.0"),
    (dict(min_lr=1.0), "min_lr must be <= lr"),
    (dict(weight_decay=-1.0), "weight_decay must be a number >= 0, got -1.0"),
    (dict(warmup_epochs=1.0, warmup_steps=5), "warmup_epochs or warmup_steps, not both"),
    (dict(warmup_steps=0.05), "warmup_steps must be an integer >= 0, got 0.05; for a fraction of the run use warmup_epochs"),
    (dict(warmup_epochs=-0.5), "warmup_epochs must be a number >= 0"),
])
def test_schedule_names_are_checked_with_the_bad_value(kwargs, match):
    full = {**dict(lr=1e-3, weight_decay=0.05, min_lr=1e-5, warmup_epochs=None, warmup_steps=None), **kwargs}
    with pytest.raises(ValueError, match=match):
        check_schedule(**full)


def test_tasks_share_the_names_and_refuse_the_old_ones():
    import inspect

    from vispe.tasks import ImageClassification, ThreeCellTask, VideoNIAH, VideoTextRetrieval

    for cls in (ImageClassification, ThreeCellTask, VideoNIAH, VideoTextRetrieval):
        params = inspect.signature(cls.__init__).parameters
        assert {"lr", "weight_decay", "min_lr", "warmup_epochs", "warmup_steps"} <= set(params), cls
        assert "min_lr_ratio" not in params
    with pytest.raises(ValueError, match="warmup_steps must be an integer"):
        ThreeCellTask("vispe_vit_tiny_patch16_224", dict(patch_size=2, embed_dim=16, depth=1, num_heads=2), img_size=12,
                      warmup_epochs=None, warmup_steps=0.05)


# -- overrides -----------------------------------------------------------------------------------------------------
def test_overrides_from_strings_are_yaml_values_and_set_nested_keys():
    got = parse_overrides(["model.init_args.lr=1e-3", "data.init_args.eval_lengths=[4, 8]", "model.init_args.pos_encoding={name: learned}",
                           "trainer.logger=false", "model.init_args.warmup_epochs=null"])
    assert got == {"model.init_args.lr": 1e-3, "data.init_args.eval_lengths": [4, 8], "model.init_args.pos_encoding": {"name": "learned"},
                   "trainer.logger": False, "model.init_args.warmup_epochs": None}
    base = {"model": {"class_path": "X", "init_args": {"lr": 1.0, "model_kwargs": {"depth": 2, "embed_dim": 64}}}}
    out = apply_overrides(base, {"model.init_args.model_kwargs.depth": 1, "trainer.max_steps": 3})
    assert out == {"model": {"class_path": "X", "init_args": {"lr": 1.0, "model_kwargs": {"depth": 1, "embed_dim": 64}}},
                   "trainer": {"max_steps": 3}}
    assert base["model"]["init_args"]["model_kwargs"]["depth"] == 2  # the recipe itself is untouched


def test_bad_overrides_name_the_item():
    with pytest.raises(ValueError, match=r"override 'lr' is not KEY=VALUE"):
        parse_overrides(["lr"])
    with pytest.raises(ValueError, match=r"override 'model.init_args.lr.x': model.init_args.lr is 1.0, not a mapping"):
        apply_overrides({"model": {"init_args": {"lr": 1.0}}}, {"model.init_args.lr.x": 2})


# -- the runner end to end -----------------------------------------------------------------------------------------
TINY_THREE_CELL = {
    "trainer.max_steps": 4, "trainer.logger": False, "trainer.enable_checkpointing": False, "trainer.enable_progress_bar": False,
    "trainer.enable_model_summary": False, "trainer.limit_val_batches": 0, "data.init_args.num_samples": 120,
    "data.init_args.grid_size": 6, "data.init_args.batch_size": 16, "model.init_args.model_kwargs.embed_dim": 16,
    "model.init_args.model_kwargs.depth": 1, "model.init_args.model_kwargs.num_heads": 2, "model.init_args.pos_encoding": "rope_mixed",
}


@pytest.fixture
def restore_deterministic():
    deterministic = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(deterministic)


def test_run_trains_through_lightning_cli_and_evaluates_with_the_same_trainer(tmp_path, restore_deterministic):
    import lightning.pytorch as pl

    from vispe.runner import run
    from vispe.tasks.three_cell import ThreeCellTask

    result = run("three_cell", TINY_THREE_CELL, seed=3, out_dir=tmp_path / "run")
    assert isinstance(result.trainer, pl.Trainer) and isinstance(result.model, ThreeCellTask)
    assert result.trainer.global_step == 4 and result.config["seed_everything"] == 3
    assert (result.run_dir / "config.yaml").is_file()  # the resolved recipe, saved next to the run
    trainer = result.trainer
    val = result.evaluate("validate")  # the recipe turns validation off during training; evaluate scores every batch
    assert result.trainer is trainer and trainer.limit_val_batches == 0 and 0.0 <= val["val/avg"] <= 1.0
    test = result.evaluate("test")
    assert set(test) >= {"test/avg", "test/distance"} and result.metrics["test/avg"] == test["test/avg"]
    # same recipe, overrides and seed: the same weights (seed_everything runs before anything is built)
    again = run("three_cell", TINY_THREE_CELL, seed=3)
    assert again.run_dir is None
    for a, b in zip(result.model.parameters(), again.model.parameters()):
        assert torch.equal(a, b)


def test_run_refuses_a_misspelt_key_in_one_line():
    from vispe.runner import build

    with pytest.raises(ValueError, match="recipe three_cell: .*max_stepz"):
        build("three_cell", {**TINY_THREE_CELL, "trainer.max_stepz": 3})
    with pytest.raises(ValueError, match="neither a shipped recipe nor a YAML file"):
        build("no_such_recipe")


def test_only_lightning_cli_builds_a_trainer():
    # the acceptance grep: no module of vispe (or train/) constructs a Trainer itself
    from pathlib import Path

    import vispe

    root = Path(vispe.__file__).parent
    files = [*root.rglob("*.py"), *(root.parent / "train").glob("*.py")]
    hits = [f"{p.name}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1) if "Trainer(" in line]
    assert hits == []
