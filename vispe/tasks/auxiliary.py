"""A positional encoding's auxiliary loss (e.g. SeqPE's regularisers) added to a task's loss."""
from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn as nn

from vispe.models.layers import auxiliary_loss

__all__ = ["add_auxiliary_loss", "check_aux_loss_weight"]


def add_auxiliary_loss(task: pl.LightningModule, model: nn.Module, loss: torch.Tensor, weight: float,
                       batch_size: int | None = None) -> torch.Tensor:
    """``loss + weight * auxiliary_loss(model)`` -- the auxiliary losses of the model's modules, found by walking them
    (:func:`vispe.models.layers.auxiliary_loss`; e.g. SeqPE's regulariser) -- logged as ``train/aux_loss``; ``loss``
    unchanged when the weight is 0 or no module has one."""
    if weight == 0:
        return loss
    aux = auxiliary_loss(model)
    if aux is None:
        return loss
    task.log("train/aux_loss", aux.detach(), on_step=True, on_epoch=True, batch_size=batch_size)
    return loss + weight * aux


def check_aux_loss_weight(weight: float) -> float:
    """``aux_loss_weight`` as a float, refused unless a number >= 0."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0:
        raise ValueError(f"aux_loss_weight must be a number >= 0 (0 turns the encoding's auxiliary loss off), got {weight!r}")
    return float(weight)
