"""Image classification over any timm / vispe model (the model owns its positional encoding)."""
from __future__ import annotations

import os
import random
from typing import Any, Mapping

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torchmetrics import Accuracy, MetricCollection

from vispe.tasks.auxiliary import add_auxiliary_loss, check_aux_loss_weight
from vispe.tasks.backbone import Backbone, backbone_name, resolve_backbone, unrecorded
from vispe.tasks.optim import adamw_warmup_cosine, check_schedule, param_groups_no_decay

__all__ = ["ImageClassification"]

MIX_BACKENDS = ("timm", "torchvision")


class ImageClassification(pl.LightningModule):
    """Supervised image classification.

    Args:
        model: the backbone: an ``nn.Module`` (any timm / vispe model instance, or a config's ``class_path``), or a
            timm model name, e.g. ``'vispe_vit_tiny_patch4_32'`` (:mod:`vispe.tasks.backbone`).
        model_kwargs: extra ``timm.create_model`` arguments (``depth``, ``embed_dim``, ...) of a model given by name.
        pos_encoding: encoding name or ``{'name': ..., **options}`` (vispe models given by name only).
        num_classes, in_chans, img_size: linked from the DataModule by ``vispe fit``; a model given by name is built
            with them, a module is checked against ``num_classes`` / ``in_chans``.
        lr, weight_decay, betas: AdamW (no decay on biases, norms and ``no_weight_decay()``).
        warmup_epochs, warmup_steps: linear warm-up length, in epochs (fractions allowed) or optimiser steps (one of
            the two, the other None); then cosine to ``min_lr`` (:mod:`vispe.tasks.optim`, shared by every task).
        label_smoothing: cross-entropy smoothing (hard labels only; mixed labels are already soft).
        mixup_alpha, cutmix_alpha, mix_prob: batch mixing (0 disables); ``mix_backend`` 'timm' or 'torchvision'.
        aux_loss_weight: weight of the positional encoding's auxiliary loss (``auxiliary_loss()``, e.g. SeqPE's
            regularisers; logged as ``train/aux_loss``), 0 to turn it off.
        deterministic_resume: reseed python/numpy/torch RNGs from ``(global seed, epoch, batch, rank)``
            before every training batch, so a run resumed from a checkpoint draws exactly the mixing
            and dropout randomness of an uninterrupted one (the RNG state is not in checkpoints).
    """

    def __init__(
        self,
        model: Backbone = "vispe_vit_tiny_patch4_32",
        model_kwargs: dict[str, Any] | None = None,
        pos_encoding: str | dict[str, Any] | None = None,
        num_classes: int = 10,
        in_chans: int = 3,
        img_size: int | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.05,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_epochs: float | None = 1.0,
        min_lr: float = 1e-5,
        label_smoothing: float = 0.1,
        mixup_alpha: float = 0.0,
        cutmix_alpha: float = 0.0,
        mix_prob: float = 1.0,
        mix_backend: str = "timm",
        deterministic_resume: bool = True,
        aux_loss_weight: float = 1.0,
        warmup_steps: int | None = None,
    ) -> None:
        super().__init__()
        backbone, model = model, unrecorded(model)
        self.save_hyperparameters()
        check_aux_loss_weight(aux_loss_weight)
        if mix_backend not in MIX_BACKENDS:
            raise ValueError(f"mix_backend={mix_backend!r} is not valid; choose one of {list(MIX_BACKENDS)}")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        check_schedule(lr, weight_decay, min_lr, warmup_epochs, warmup_steps)
        overrides: dict[str, Any] = dict(num_classes=num_classes, in_chans=in_chans)
        if img_size is not None:
            overrides["img_size"] = img_size
        self.model = resolve_backbone(backbone, model_kwargs, pos_encoding, **overrides)
        self._backbone_name = backbone_name(backbone)
        self.num_classes = int(num_classes)
        self.mixer = self._build_mixer()
        top5 = min(5, self.num_classes)
        metrics = MetricCollection({
            "acc": Accuracy(task="multiclass", num_classes=self.num_classes, top_k=1),
            "acc_top5": Accuracy(task="multiclass", num_classes=self.num_classes, top_k=top5),
        })
        self.train_metrics = MetricCollection({"acc": Accuracy(task="multiclass", num_classes=self.num_classes)}, prefix="train/")
        self.val_metrics = metrics.clone(prefix="val/")
        self.test_metrics = metrics.clone(prefix="test/")

    # -- mixing ------------------------------------------------------------------------------
    def _build_mixer(self):
        hp = self.hparams
        if hp.mixup_alpha <= 0 and hp.cutmix_alpha <= 0:
            return None
        if hp.mix_backend == "timm":
            from timm.data import Mixup

            return Mixup(
                mixup_alpha=hp.mixup_alpha, cutmix_alpha=hp.cutmix_alpha, prob=hp.mix_prob,
                label_smoothing=hp.label_smoothing, num_classes=self.num_classes,
            )
        from torchvision.transforms import v2

        choices = []
        if hp.mixup_alpha > 0:
            choices.append(v2.MixUp(alpha=hp.mixup_alpha, num_classes=self.num_classes))
        if hp.cutmix_alpha > 0:
            choices.append(v2.CutMix(alpha=hp.cutmix_alpha, num_classes=self.num_classes))
        mix = v2.RandomChoice(choices) if len(choices) > 1 else choices[0]
        return v2.RandomApply([mix], p=hp.mix_prob) if hp.mix_prob < 1 else mix

    def _mix(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.hparams.mix_backend == "timm":
            if x.shape[0] % 2:  # timm's Mixup pairs samples: needs an even batch
                x, y = x[:-1], y[:-1]
            return self.mixer(x, y)
        x, soft = self.mixer(x, y)
        if soft.ndim == 1:  # RandomApply skipped the mix: one-hot
            soft = F.one_hot(soft, self.num_classes).to(x.dtype)
        eps = self.hparams.label_smoothing
        return x, soft * (1 - eps) + eps / self.num_classes

    def setup(self, stage: str) -> None:
        """Hand the model's patch size to the data module (its mixed resolutions must tile it), so a config states
        it once: in the model."""
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        patch = getattr(getattr(self.model, "patch_embed", None), "patch_size", None)
        if dm is None or patch is None or not hasattr(dm, "use_model_patch_size"):
            return
        patch = tuple(patch) if isinstance(patch, (tuple, list)) else (patch, patch)
        if patch[0] == patch[1]:
            dm.use_model_patch_size(int(patch[0]), model_name=f"model {self._backbone_name}")

    # -- steps ------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.hparams.deterministic_resume:
            base = int(os.environ.get("PL_GLOBAL_SEED", "0"))
            s = (((base * 100_003 + self.current_epoch) * 100_003 + batch_idx) * 1_009 + self.global_rank) % (2**31 - 1)
            random.seed(s)
            np.random.seed(s)
            torch.manual_seed(s)

    @staticmethod
    def _num_samples(x: Any) -> int:
        """Batch size of images ``(B, C, H, W)``, a mixed-resolution NaFlex dict or a list of images."""
        if isinstance(x, dict):
            return int(x["patches"].shape[0])
        return len(x) if isinstance(x, (list, tuple)) else int(x.shape[0])

    def _check_labels(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Labels agree with the images and lie in [0, num_classes) (else: torch's 'Target 7 is out of bounds')."""
        n = self._num_samples(x)
        if y.ndim != 1 or y.shape[0] != n or y.is_floating_point():
            raise ValueError(f"labels must be integer class ids of shape (B,) = ({n},), got {y.dtype} {tuple(y.shape)}")
        bad = (y < 0) | (y >= self.hparams.num_classes)
        if bool(bad.any()):
            raise ValueError(f"label {int(y[bad][0])} is outside [0, num_classes={self.hparams.num_classes}); check the data module's classes")

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        self._check_labels(x, y)
        if self.mixer is not None:
            if not isinstance(x, torch.Tensor):
                raise ValueError("mixup/cutmix mix images of one size; a mixed-resolution batch (resolution_sampling='sample') "
                                 "cannot be mixed: set mixup_alpha=0 and cutmix_alpha=0, or resolution_sampling='batch'")
            x, soft = self._mix(x, y)
            logits = self(x)
            loss = torch.sum(-soft * F.log_softmax(logits, dim=-1), dim=-1).mean()
            y = soft.argmax(-1)
        else:
            logits = self(x)
            loss = F.cross_entropy(logits, y, label_smoothing=self.hparams.label_smoothing)
        loss = add_auxiliary_loss(self, self.model, loss, self.hparams.aux_loss_weight, self._num_samples(x))
        self.train_metrics.update(logits.detach(), y)
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=True, batch_size=self._num_samples(x), sync_dist=True)
        self.log_dict(self.train_metrics, on_step=False, on_epoch=True, batch_size=self._num_samples(x))
        return loss

    def _eval_step(self, batch: tuple[torch.Tensor, torch.Tensor], metrics: MetricCollection, stage: str) -> None:
        x, y = batch
        self._check_labels(x, y)
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        metrics.update(logits, y)
        self.log(f"{stage}/loss", loss, prog_bar=stage == "val", batch_size=self._num_samples(x), sync_dist=True)
        self.log_dict(metrics, prog_bar=stage == "val", batch_size=self._num_samples(x))

    def validation_step(self, batch, batch_idx: int) -> None:
        self._eval_step(batch, self.val_metrics, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._eval_step(batch, self.test_metrics, "test")

    def predict_step(self, batch, batch_idx: int) -> torch.Tensor:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x).softmax(-1)

    def on_fit_start(self) -> None:
        # world size in the metrics makes multi-process runs checkable from metrics.csv
        if self.logger is not None:
            self.logger.log_hyperparams({"world_size": self.trainer.world_size})

    # -- optimisation -----------------------------------------------------------------------
    def configure_model(self) -> None:
        """Under Lightning's ``ModelParallelStrategy``: FSDP2, one group per transformer block (see
        :func:`vispe.distributed.configure_sharding`); nothing under other strategies."""
        from vispe.distributed import configure_sharding

        configure_sharding(self, self.model)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        return adamw_warmup_cosine(self.trainer, param_groups_no_decay(self.model, hp.weight_decay), lr=hp.lr, min_lr=hp.min_lr,
                                   warmup_epochs=hp.warmup_epochs, warmup_steps=hp.warmup_steps, betas=hp.betas)

    # -- checkpoint metadata for the resolution sweep ------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        if dm is not None:
            from vispe.data.image_datamodule import ImageDataModule

            # the former per-dataset names build the one ImageDataModule, whose arguments the record holds
            cls = ImageDataModule if isinstance(dm, ImageDataModule) else type(dm)
            checkpoint["vispe_datamodule"] = {
                "class_path": f"{cls.__module__}.{cls.__qualname__}",
                "init_args": dict(getattr(dm, "hparams", {})),
                "cwd": os.getcwd(),  # relative data paths are relative to here (vispe resolution may run elsewhere)
            }
