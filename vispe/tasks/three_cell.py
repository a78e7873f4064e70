"""LightningModule for the Three Cell Experiment: BCE over the 6 bits, accuracy per group.

The model is an ``nn.Module`` with 6 outputs, or any timm model name (vispe models included) plus keyword arguments, e.g.
``ThreeCellTask('vispe_vit_tiny_patch16_224', {'patch_size': 2, 'embed_dim': 64, 'depth': 2,
'num_heads': 4}, pos_encoding='rope_mixed', img_size=16)``: the positional encoding is only
ever chosen through the model's own ``pos_encoding`` argument. The signature follows
:class:`vispe.tasks.classification.ImageClassification` (``model``, ``model_kwargs``,
``pos_encoding``, ``img_size``), so ``vispe fit`` links ``img_size`` from the DataModule.

Metrics (val/test), as in the LOOPE paper: accuracy of each group at threshold 0.5 --
``distance`` (bits 0-1), ``orientation`` (bit 2), ``area`` (bits 3-4), ``vector_sum`` (bit 5);
the accuracy of a two-bit group is the mean of its bit accuracies -- and ``avg``, the mean of the
four group accuracies. Values are fractions in [0, 1] (the benchmark prints percentages).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torchmetrics import MetricCollection
from torchmetrics.classification import BinaryAccuracy, MultilabelAccuracy

from vispe.data.three_cell import LABEL_GROUPS, LABEL_NAMES
from vispe.tasks.auxiliary import add_auxiliary_loss, check_aux_loss_weight
from vispe.tasks.backbone import Backbone, resolve_backbone, unrecorded
from vispe.tasks.optim import adamw_warmup_cosine, check_schedule, param_groups_no_decay

__all__ = ["ThreeCellTask", "GROUPS"]

GROUPS: tuple[str, ...] = tuple(LABEL_GROUPS)


def _group_metrics() -> MetricCollection:
    # micro average over a group's bits = mean bit accuracy of the group
    return MetricCollection(
        {
            g: MultilabelAccuracy(num_labels=len(idx), threshold=0.5, average="micro") if len(idx) > 1 else BinaryAccuracy(threshold=0.5)
            for g, idx in LABEL_GROUPS.items()
        }
    )


class ThreeCellTask(LightningModule):
    """Multi-label (6-bit) Three Cell training around a timm model.

    Args:
        model: the backbone: an ``nn.Module`` with 6 outputs, or a timm model name (``timm.list_models('vispe_*')``
            for vispe's ViTs; :mod:`vispe.tasks.backbone`).
        model_kwargs: passed to ``timm.create_model`` for a model given by name (``patch_size`` = the cell size,
            ``embed_dim``, ``depth``, ...); ``num_classes`` is always 6.
        pos_encoding: the model's ``pos_encoding`` (name, ``{'name': ..., **options}``); None
            leaves the model's default (or ``model_kwargs['pos_encoding']``).
        img_size: input size in pixels (grid x cell size); None leaves the model's default.
        lr: peak learning rate (AdamW).
        min_lr: final learning rate of the cosine schedule.
        weight_decay: AdamW weight decay (not applied to biases, norms, the model's
            ``no_weight_decay()`` names).
        warmup_epochs, warmup_steps: linear warm-up length in epochs (fractions allowed) or optimiser steps (one of the
            two, the other None); the ramp reaches ``lr`` on the first cosine step (:func:`vispe.tasks.optim.warmup_cosine`,
            ``peak_step='first_cosine'``: the published Three Cell tables were trained with it).
        betas: AdamW betas.
        aux_loss_weight: weight of the positional encoding's auxiliary loss (``train/aux_loss``; 0 = off).
    """

    def __init__(
        self,
        model: Backbone = "vispe_vit_tiny_patch16_224",
        model_kwargs: Mapping[str, Any] | None = None,
        pos_encoding: str | Mapping[str, Any] | None = None,
        img_size: int | tuple[int, int] | None = None,
        lr: float = 1e-3,
        min_lr: float = 2.5e-5,
        weight_decay: float = 0.05,
        warmup_epochs: float | None = 0.5,
        warmup_steps: int | None = None,
        betas: tuple[float, float] = (0.9, 0.999),
        aux_loss_weight: float = 1.0,
    ) -> None:
        super().__init__()
        check_aux_loss_weight(aux_loss_weight)
        check_schedule(lr, weight_decay, min_lr, warmup_epochs, warmup_steps)
        model_kwargs = dict(model_kwargs or {})
        if "num_classes" in model_kwargs and model_kwargs["num_classes"] != len(LABEL_NAMES):
            raise ValueError(f"the Three Cell target has {len(LABEL_NAMES)} bits; got num_classes={model_kwargs['num_classes']}")
        backbone, model = model, unrecorded(model)
        self.save_hyperparameters()
        build_kwargs = {k: v for k, v in model_kwargs.items() if k != "num_classes"}
        self.model: nn.Module = resolve_backbone(backbone, build_kwargs or None, pos_encoding, num_classes=len(LABEL_NAMES),
                                                 img_size=None if isinstance(backbone, nn.Module) else img_size)
        self.val_metrics = _group_metrics()
        self.test_metrics = _group_metrics()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, target = batch
        loss = F.binary_cross_entropy_with_logits(self(images), target)
        loss = add_auxiliary_loss(self, self.model, loss, self.hparams.aux_loss_weight, len(images))
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        return loss

    def _eval_step(self, batch: tuple[torch.Tensor, torch.Tensor], metrics: MetricCollection, stage: str) -> None:
        images, target = batch
        logits = self(images)
        self.log(f"{stage}/loss", F.binary_cross_entropy_with_logits(logits, target), on_epoch=True, batch_size=len(images))
        probs, target = torch.sigmoid(logits), target.long()
        for group, idx in LABEL_GROUPS.items():
            cols = list(idx)
            if len(cols) == 1:
                metrics[group].update(probs[:, cols[0]], target[:, cols[0]])
            else:
                metrics[group].update(probs[:, cols], target[:, cols])

    def _eval_epoch_end(self, metrics: MetricCollection, stage: str) -> None:
        values = {g: metrics[g].compute() for g in GROUPS}
        for g, v in values.items():
            self.log(f"{stage}/{g}", v)
        self.log(f"{stage}/avg", torch.stack(list(values.values())).mean(), prog_bar=True)
        metrics.reset()

    def validation_step(self, batch, batch_idx):
        self._eval_step(batch, self.val_metrics, "val")

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end(self.val_metrics, "val")

    def test_step(self, batch, batch_idx):
        self._eval_step(batch, self.test_metrics, "test")

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end(self.test_metrics, "test")

    def configure_model(self) -> None:
        """Under Lightning's ``ModelParallelStrategy``: FSDP2, one group per transformer block (see
        :func:`vispe.distributed.configure_sharding`); nothing under other strategies."""
        from vispe.distributed import configure_sharding

        configure_sharding(self, self.model)

    def configure_optimizers(self):
        hp = self.hparams
        # shared with the other tasks: no decay on biases, norms and the model's no_weight_decay() names
        # (position tables such as pos_encoding.pos_embed, iRPE tables, RoPE frequencies, the cls token)
        return adamw_warmup_cosine(self.trainer, param_groups_no_decay(self.model, hp.weight_decay), lr=hp.lr, min_lr=hp.min_lr,
                                   warmup_epochs=hp.warmup_epochs, warmup_steps=hp.warmup_steps, betas=hp.betas, peak_step="first_cosine")
