"""The one optimiser and schedule of every vispe task: AdamW, no decay on biases / norms / position
tables, linear warm-up, then cosine to ``min_lr``, stepped every optimiser step.

Every task names its hyper-parameters the same way: ``lr`` (peak), ``weight_decay``, ``min_lr`` (the
absolute LR at the end of the cosine) and the warm-up as ``warmup_epochs`` (float, fractions allowed)
or ``warmup_steps`` (int) -- one of the two, the other ``None``.
"""
from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn as nn

__all__ = ["PEAK_STEPS", "adamw_warmup_cosine", "check_schedule", "param_groups_no_decay", "warmup_cosine", "warmup_length"]

#: where the linear warm-up reaches the peak LR (see :func:`warmup_cosine`)
PEAK_STEPS = ("last_warmup", "first_cosine")


def param_groups_no_decay(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two AdamW groups: decay for weight matrices; none for biases, norms (any 1-D parameter) and
    whatever the model lists in ``no_weight_decay()`` (position tables, cls token, RoPE freqs ...)."""
    skip = set(module.no_weight_decay()) if hasattr(module, "no_weight_decay") else set()
    decay, no_decay = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim <= 1 or name.endswith(".bias") or name in skip or any(name.startswith(s + ".") for s in skip):
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def warmup_cosine(step: int, total: int, warmup: int, min_ratio: float,
                  peak_step: Literal["last_warmup", "first_cosine"] = "last_warmup") -> float:
    """LR multiplier of optimiser step ``step`` (0-based) of ``total``: linear warm-up over ``warmup`` steps,
    then cosine from 1 to ``min_ratio`` over the remaining ``total - warmup`` steps.

    ``peak_step`` says where the warm-up ramp ends: ``'last_warmup'`` ramps ``(step + 1) / warmup`` (the last
    warm-up step already runs at the peak); ``'first_cosine'`` ramps ``(step + 1) / (warmup + 1)`` (the peak is
    the cosine's first step; the Three Cell recipe's form).
    """
    if warmup > 0 and step < warmup:
        return (step + 1) / (warmup if peak_step == "last_warmup" else warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def check_schedule(lr: float, weight_decay: float, min_lr: float, warmup_epochs: float | None, warmup_steps: int | None) -> None:
    """``ValueError`` naming the bad value (raised when a task is built, before any training)."""
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr!r}")
    for name, value in (("weight_decay", weight_decay), ("min_lr", min_lr)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:  # also refuses NaN
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    if min_lr > lr:
        raise ValueError(f"min_lr must be <= lr (the cosine ends at min_lr), got lr={lr!r}, min_lr={min_lr!r}")
    if warmup_epochs is not None and warmup_steps is not None:
        raise ValueError(f"give the warm-up as warmup_epochs or warmup_steps, not both (got warmup_epochs={warmup_epochs!r}, "
                         f"warmup_steps={warmup_steps!r}); set the other to null")
    if warmup_epochs is not None and (isinstance(warmup_epochs, bool) or not isinstance(warmup_epochs, (int, float)) or not warmup_epochs >= 0):
        raise ValueError(f"warmup_epochs must be a number >= 0 (fractions allowed), got {warmup_epochs!r}")
    if warmup_steps is not None and (isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0):
        hint = "; for a fraction of the run use warmup_epochs" if isinstance(warmup_steps, float) else ""
        raise ValueError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}{hint}")


def warmup_length(trainer: Any, warmup_epochs: float | None, warmup_steps: int | None) -> tuple[int, int]:
    """``(total optimiser steps, warm-up steps)`` of the trainer's run; the warm-up is kept below ``total``."""
    total = max(1, int(trainer.estimated_stepping_batches))  # also loads the train loader
    if warmup_steps is not None:
        warmup = int(warmup_steps)
    elif warmup_epochs:
        batches = trainer.num_training_batches
        steps_per_epoch = total if math.isinf(batches) else math.ceil(batches / trainer.accumulate_grad_batches)
        warmup = int(round(warmup_epochs * steps_per_epoch))
    else:
        warmup = 0
    return total, min(warmup, max(0, total - 1))


def adamw_warmup_cosine(
    trainer: Any,
    param_groups: list[dict[str, Any]],
    *,
    lr: float,
    min_lr: float,
    warmup_epochs: float | None = None,
    warmup_steps: int | None = None,
    betas: tuple[float, float] = (0.9, 0.999),
    peak_step: Literal["last_warmup", "first_cosine"] = "last_warmup",
) -> dict[str, Any]:
    """What a task's ``configure_optimizers`` returns: AdamW over ``param_groups`` (their own weight decay) and a
    per-step :func:`warmup_cosine` schedule from ``lr`` to ``min_lr``."""
    if peak_step not in PEAK_STEPS:
        raise ValueError(f"peak_step={peak_step!r}; choose one of {list(PEAK_STEPS)}")
    opt = torch.optim.AdamW(param_groups, lr=lr, betas=tuple(betas))
    total, warmup = warmup_length(trainer, warmup_epochs, warmup_steps)
    min_ratio = min(1.0, min_lr / lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: warmup_cosine(step, total, warmup, min_ratio, peak_step))
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
