"""Text-video retrieval: a video ViT tower (any 3D encoding) + an open_clip text tower, trained with
open_clip's ``ClipLoss``.

The module mirrors open_clip's ``CustomTextCLIP`` attribute names (``visual``, ``text``,
``logit_scale``) so ``encode_image`` / ``encode_text`` behave as in open_clip; the text tower is
built by open_clip from a ``CLIPTextCfg`` (or from a named open_clip model config) and tokenised
with open_clip's bundled BPE tokenizer, so nothing is downloaded. ``text_checkpoint`` initialises
the text tower (and the logit scale) from an open_clip checkpoint file the user already has.

Metrics are computed from the full similarity matrix (not with torchmetrics' retrieval classes,
which count a ground truth whose score is <= 0 as irrelevant): text->video and video->text
R@1/5/10, median rank and mean rank, with ties counted against the query. Every validation
dataloader is one evaluation *view* (frames x resolution); the first is the training view and is
logged as ``val/...``, the others as ``val_<T>f<H>px/...``.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F

from vispe.tasks.auxiliary import add_auxiliary_loss, check_aux_loss_weight
from vispe.tasks.backbone import Backbone, resolve_backbone, unrecorded
from vispe.tasks.optim import adamw_warmup_cosine, check_schedule, param_groups_no_decay

__all__ = [
    "VideoTextRetrieval",
    "retrieval_metrics",
    "retrieval_ranks",
    "build_text_tower",
    "load_text_tower_checkpoint",
    "view_name",
]


# ---------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------


def retrieval_ranks(scores: torch.Tensor, relevant: torch.Tensor) -> torch.Tensor:
    """1-based rank of the best relevant item for every query (row).

    ``scores`` (Q, G) and a boolean ``relevant`` (Q, G) with >= 1 True per row. The rank is one
    plus the number of *irrelevant* items scoring at least as high as the best relevant one, so
    ties count against the query (a constant score matrix gets the worst rank, not the best).
    """
    if scores.shape != relevant.shape or scores.ndim != 2:
        raise ValueError(f"scores {tuple(scores.shape)} and relevant {tuple(relevant.shape)} must be equal 2-D shapes")
    if not bool(relevant.any(1).all()):
        raise ValueError("every query needs at least one relevant item")
    scores = scores.float()
    best = scores.masked_fill(~relevant, float("-inf")).amax(1, keepdim=True)
    return 1 + ((scores >= best) & ~relevant).sum(1)


def _summary(ranks: torch.Tensor, ks: Sequence[int]) -> dict[str, float]:
    r = ranks.float()
    out = {f"R@{k}": 100.0 * (r <= k).float().mean().item() for k in ks}
    out["MdR"] = r.median().item() if r.numel() % 2 else r.sort().values[r.numel() // 2 - 1 : r.numel() // 2 + 1].mean().item()
    out["MnR"] = r.mean().item()
    return out


def retrieval_metrics(sim: torch.Tensor, caption_video: torch.Tensor | None = None, ks: Sequence[int] = (1, 5, 10)) -> dict[str, float]:
    """Text->video and video->text metrics from a similarity matrix ``sim`` (num_texts, num_videos).

    ``caption_video[i]`` is the video of caption ``i`` (default: the diagonal). Returns
    ``t2v_R@k, t2v_MdR, t2v_MnR, v2t_R@k, v2t_MdR, v2t_MnR`` (recalls in %). For videos with several
    captions, v2t ranks the first relevant caption. The median of an even count is the mean of the
    two middle ranks.
    """
    nt, nv = sim.shape
    if caption_video is None:
        if nt != nv:
            raise ValueError(f"sim is {nt}x{nv}; pass caption_video when texts and videos differ in number")
        caption_video = torch.arange(nt, device=sim.device)
    caption_video = caption_video.to(sim.device)
    rel = F.one_hot(caption_video, nv).bool()  # (Nt, Nv)
    if not bool(rel.any(0).all()):
        raise ValueError("every video needs at least one caption for video->text metrics")
    out = {f"t2v_{k}": v for k, v in _summary(retrieval_ranks(sim, rel), ks).items()}
    out.update({f"v2t_{k}": v for k, v in _summary(retrieval_ranks(sim.t(), rel.t()), ks).items()})
    return out


def view_name(num_frames: int, size: Sequence[int]) -> str:
    h, w = size
    return f"{num_frames}f{h}px" if h == w else f"{num_frames}f{h}x{w}px"


# ---------------------------------------------------------------------------------------------
# Text tower (open_clip)
# ---------------------------------------------------------------------------------------------


def build_text_tower(embed_dim: int, text_cfg: Mapping[str, Any] | None = None, open_clip_model: str | None = None) -> nn.Module:
    """An open_clip text tower projecting to ``embed_dim``.

    ``open_clip_model`` (e.g. ``'ViT-B-32'``) takes the tower's config from open_clip's model
    configs (``text_cfg`` entries then override it); otherwise ``text_cfg`` holds
    ``CLIPTextCfg`` fields. Towers needing HuggingFace are refused (they would download).
    """
    import open_clip
    from open_clip.model import CLIPTextCfg, _build_text_tower

    cfg: dict[str, Any] = {}
    if open_clip_model is not None:
        full = open_clip.get_model_config(open_clip_model)
        if full is None:
            raise ValueError(f"unknown open_clip model {open_clip_model!r}; choose one of open_clip.list_models()")
        cfg.update(full.get("text_cfg", {}))
    cfg.update(dict(text_cfg or {}))
    valid = set(CLIPTextCfg.__dataclass_fields__)
    unknown = sorted(set(cfg) - valid)
    if unknown:
        raise ValueError(f"unknown text_cfg field(s) {unknown}; valid: {sorted(valid)}")
    if cfg.get("hf_model_name") or cfg.get("hf_tokenizer_name"):
        raise ValueError("HuggingFace text towers need a download and transformers; use an open_clip TextTransformer config")
    return _build_text_tower(embed_dim, CLIPTextCfg(**cfg))


def load_text_tower_checkpoint(text: nn.Module, path: str | Path, strict: bool = True) -> dict[str, Any]:
    """Load an open_clip checkpoint *file* into ``text`` (a TextTransformer).

    Accepts a raw state dict or ``{'state_dict': ...}`` (open_clip's training checkpoints, with or
    without DDP's ``module.`` prefix), from a ``CLIP`` (flat text keys: ``token_embedding``,
    ``positional_embedding``, ``transformer.*``, ``ln_final``, ``text_projection``) or a
    ``CustomTextCLIP`` (``text.*``). Returns ``{'loaded': n, 'missing': [...], 'unexpected': [...],
    'logit_scale': tensor | None}``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text tower checkpoint {str(path)!r} does not exist")
    from vispe.files import read_checkpoint

    sd = read_checkpoint(path, what="text tower checkpoint")
    if isinstance(sd, Mapping) and "state_dict" in sd:
        sd = sd["state_dict"]
    if not isinstance(sd, Mapping):
        raise ValueError(f"{path}: expected a state dict, got {type(sd).__name__}")
    sd = {k[len("module."):] if k.startswith("module.") else k: v for k, v in sd.items()}
    own = set(text.state_dict())
    if any(k.startswith("text.") for k in sd):
        picked = {k[len("text."):]: v for k, v in sd.items() if k.startswith("text.")}
    else:
        picked = {k: v for k, v in sd.items() if k in own or k.split(".")[0] in ("transformer", "token_embedding", "ln_final")}
    picked.pop("attn_mask", None)  # a buffer rebuilt from the context length
    if not picked:
        raise ValueError(f"{path}: no text-tower weights found (looked for 'text.*' and open_clip CLIP text keys)")
    shapes = {k: (tuple(v.shape), tuple(text.state_dict()[k].shape)) for k, v in picked.items() if k in own and v.shape != text.state_dict()[k].shape}
    if shapes:
        raise ValueError(f"{path}: text-tower shapes differ from the configured tower {shapes}; configure the same text_cfg / open_clip_model")
    res = text.load_state_dict(picked, strict=False)
    missing = [k for k in res.missing_keys if k != "attn_mask"]
    if strict and (missing or res.unexpected_keys):
        raise ValueError(f"{path}: text tower keys missing {missing} / unexpected {res.unexpected_keys}")
    return {"loaded": len(picked), "missing": missing, "unexpected": list(res.unexpected_keys), "logit_scale": sd.get("logit_scale")}


# ---------------------------------------------------------------------------------------------
# LightningModule
# ---------------------------------------------------------------------------------------------


class VideoTextRetrieval(pl.LightningModule):
    """CLIP-style text-video retrieval.

    Args:
        video_model: the video tower: an ``nn.Module`` (its positional encoding is its own; ``pos_encoding`` then
            unused) or the timm name of a video ViT (``vispe_video_vit_*``; :mod:`vispe.tasks.backbone`).
        pos_encoding: the video tower's 3D encoding (name or ``{'name': ..., **options}``).
        video_model_kwargs: more ``timm.create_model`` arguments (``depth``, ``embed_dim``,
            ``num_frames``, ``img_size``, ...). The tower's head projects to ``embed_dim``.
        embed_dim: joint embedding width.
        text_cfg: open_clip ``CLIPTextCfg`` fields of the text tower (tiny by default).
        open_clip_model: take the text config from this open_clip model (e.g. ``'ViT-B-32'``).
        text_checkpoint: optional open_clip checkpoint file initialising the text tower
            (and the logit scale when present).
        lock_text: freeze the text tower (useful with a pretrained checkpoint).
        lr, weight_decay, min_lr, warmup_epochs | warmup_steps: AdamW, linear warm-up, cosine to ``min_lr`` (per step;
            :mod:`vispe.tasks.optim`, shared by every task).
        init_logit_scale: initial ``log(1/temperature)`` (CLIP: ``log(1/0.07)``).
        aux_loss_weight: weight of the video model's positional-encoding auxiliary loss (``train/aux_loss``; 0 = off).
    """

    def __init__(
        self,
        video_model: Backbone = "vispe_video_vit_tiny",
        pos_encoding: str | Mapping[str, Any] = "rope_axial_3d",
        video_model_kwargs: Mapping[str, Any] | None = None,
        embed_dim: int = 128,
        text_cfg: Mapping[str, Any] | None = None,
        open_clip_model: str | None = None,
        text_checkpoint: str | None = None,
        lock_text: bool = False,
        lr: float = 1e-3,
        weight_decay: float = 0.05,
        min_lr: float = 1e-5,
        warmup_steps: int | None = 50,
        warmup_epochs: float | None = None,
        init_logit_scale: float = math.log(1 / 0.07),
        aux_loss_weight: float = 1.0,
    ) -> None:
        super().__init__()
        check_aux_loss_weight(aux_loss_weight)
        check_schedule(lr, weight_decay, min_lr, warmup_epochs, warmup_steps)
        import open_clip

        backbone, video_model = video_model, unrecorded(video_model)
        self.save_hyperparameters()
        if text_cfg is None and open_clip_model is None:
            text_cfg = {"context_length": 32, "width": 128, "heads": 4, "layers": 2}
        # a module is used as given (its encoding is its own); a name is built with pos_encoding
        self.visual = resolve_backbone(backbone, video_model_kwargs,
                                       None if isinstance(backbone, nn.Module) else pos_encoding, num_classes=embed_dim)
        self.text = build_text_tower(embed_dim, text_cfg, open_clip_model)
        self.context_length = self.text.context_length
        self.tokenizer = open_clip.tokenizer.SimpleTokenizer(context_length=self.context_length)  # bundled BPE, offline
        self.logit_scale = nn.Parameter(torch.tensor(float(init_logit_scale)))
        self.text_load_report: dict[str, Any] | None = None
        if text_checkpoint:
            self.text_load_report = load_text_tower_checkpoint(self.text, text_checkpoint)
            if self.text_load_report["logit_scale"] is not None:
                with torch.no_grad():
                    self.logit_scale.copy_(self.text_load_report["logit_scale"].float().reshape(()))
        if lock_text:
            for p in self.text.parameters():
                p.requires_grad_(False)
        self.loss_fn: nn.Module | None = None
        self._eval_buffers: dict[int, dict[str, list[torch.Tensor]]] = {}
        self.last_metrics: dict[str, dict[str, float]] = {}

    # -- towers (open_clip's method names) ------------------------------------------------
    def tokenize(self, captions: Sequence[str]) -> torch.Tensor:
        return self.tokenizer(list(captions)).to(self.device)

    def encode_image(self, video: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        """``video`` (B, 3, T, H, W) -> (B, embed_dim)."""
        f = self.visual(video)
        return F.normalize(f, dim=-1) if normalize else f

    def encode_text(self, tokens: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        f = self.text(tokens)
        return F.normalize(f, dim=-1) if normalize else f

    def forward(self, video: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As open_clip's ``CLIP.forward``: normalised video and text features and ``logit_scale.exp()``."""
        return self.encode_image(video), self.encode_text(tokens), self.logit_scale.exp()

    # -- training ------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        from open_clip import ClipLoss

        world = self.trainer.world_size if self._trainer is not None else 1
        rank = self.trainer.global_rank if self._trainer is not None else 0
        # under DDP each rank scores its texts against every rank's videos (open_clip's recipe)
        self.loss_fn = ClipLoss(local_loss=world > 1, gather_with_grad=world > 1, cache_labels=True, rank=rank, world_size=world)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        if self.loss_fn is None:
            self.setup("fit")
        if batch["num_skipped"]:
            self.log("train/skipped_videos", float(batch["num_skipped"]), reduce_fx="sum", on_step=False, on_epoch=True)
        video = batch["video"]
        if video.numel() == 0:
            raise ValueError(f"every clip of a training batch was unreadable: {batch['skipped']}")
        # one caption per clip for the contrastive diagonal
        first: dict[int, str] = {}
        for caption, b in zip(batch["captions"], batch["caption_video"].tolist()):
            first.setdefault(b, caption)
        captions = [first[b] for b in range(video.shape[0])]
        v, t, scale = self(video, self.tokenize(captions))
        loss = self.loss_fn(v, t, scale)
        loss = add_auxiliary_loss(self, self.visual, loss, self.hparams.aux_loss_weight, video.shape[0])
        with torch.no_grad():
            self.logit_scale.clamp_(0, math.log(100))  # CLIP's clamp
        self.log("train/loss", loss, prog_bar=True, batch_size=video.shape[0])
        self.log("train/logit_scale", scale.detach(), batch_size=video.shape[0])
        return loss

    # -- evaluation ----------------------------------------------------------------------
    def _eval_step(self, batch: dict[str, Any], dataloader_idx: int) -> None:
        buf = self._eval_buffers.setdefault(dataloader_idx, {"v": [], "t": [], "owner": [], "skipped": [0], "shape": []})
        buf["skipped"][0] += batch["num_skipped"]
        if batch["video"].numel() == 0:
            return
        offset = sum(x.shape[0] for x in buf["v"])
        buf["shape"] = list(batch["video"].shape[2:])
        buf["v"].append(self.encode_image(batch["video"]).float())
        buf["t"].append(self.encode_text(self.tokenize(batch["captions"])).float())
        buf["owner"].append(batch["caption_video"].to(self.device) + offset)

    def validation_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_step(batch, dataloader_idx)

    def test_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_step(batch, dataloader_idx)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        if self._trainer is None or self.trainer.world_size == 1:
            return x
        g = self.all_gather(x)  # (world, n, ...); DistributedSampler pads ranks to equal length
        return g.reshape(-1, *x.shape[1:])

    def _eval_epoch_end(self, stage: str) -> None:
        results: dict[str, dict[str, float]] = {}
        for idx in sorted(self._eval_buffers):
            buf = self._eval_buffers[idx]
            if not buf["v"]:
                continue
            v, t, owner = torch.cat(buf["v"]), torch.cat(buf["t"]), torch.cat(buf["owner"])
            if self._trainer is not None and self.trainer.world_size > 1:
                # rank r's captions point at rank r's clips; all_gather needs equal counts per rank
                # (DistributedSampler pads the clips; several captions per clip must match too)
                owner = owner + self.trainer.global_rank * v.shape[0]
                v, t, owner = self._gather(v), self._gather(t), self._gather(owner)
            metrics = retrieval_metrics(t @ v.t(), owner)
            metrics["num_videos"] = float(v.shape[0])
            metrics["skipped_videos"] = float(buf["skipped"][0])
            t_, h_, w_ = buf["shape"]
            prefix = stage if idx == 0 else f"{stage}_{view_name(t_, (h_, w_))}"
            results[prefix] = metrics
            for k, val in metrics.items():
                self.log(f"{prefix}/{k}", val, prog_bar=(idx == 0 and k == "t2v_R@1"), add_dataloader_idx=False, sync_dist=False)
        self.last_metrics = results
        self._eval_buffers = {}

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")

    # -- optimisation --------------------------------------------------------------------
    def configure_model(self) -> None:
        """Under Lightning's ``ModelParallelStrategy``: FSDP2, one group per transformer block (see
        :func:`vispe.distributed.configure_sharding`); nothing under other strategies."""
        from vispe.distributed import configure_sharding

        configure_sharding(self, self.visual)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        groups = param_groups_no_decay(self.visual, hp.weight_decay)
        text_groups = param_groups_no_decay(self.text, hp.weight_decay)
        groups[0]["params"] += text_groups[0]["params"]
        groups[1]["params"] += text_groups[1]["params"] + [self.logit_scale]
        return adamw_warmup_cosine(self.trainer, groups, lr=hp.lr, min_lr=hp.min_lr, warmup_epochs=hp.warmup_epochs,
                                   warmup_steps=hp.warmup_steps)
