"""Video needle-in-a-haystack for the video-LLM: train at one haystack length, evaluate accuracy
over lengths x needle depths (see :mod:`vispe.data.niah`).

A sample is ``[<bos>] [haystack + needle: (F+1) x h x w visual tokens] [what color is the needle ?]``
followed by the one-token answer. Training is teacher-forced cross-entropy on the answer token only;
evaluation takes the argmax over the whole vocabulary at the last prompt position (exact match of a
single-token answer, as in the reference protocol). Position ids come from the model's multimodal
scheme: the whole haystack is one visual block. HoPE's ``gamma`` and V2PE's ``delta`` are drawn per
block at training and fixed (``position_kwargs``) at evaluation.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import lightning.pytorch as pl
import torch

from vispe.data.niah import NIAHVocab
from vispe.positions import SCHEMES
from vispe.tasks.optim import adamw_warmup_cosine, check_schedule, param_groups_no_decay

__all__ = ["VideoNIAH", "accuracy_grid", "EVAL_POSITION_DEFAULTS"]

#: evaluation-time position options per scheme (from the scheme records: HoPE's V-NIAH gamma, V2PE's delta)
EVAL_POSITION_DEFAULTS: dict[str, dict[str, Any]] = {n: dict(r.eval_options) for n, r in SCHEMES.items() if r.eval_options}


def accuracy_grid(records: Sequence[tuple[int, float, bool]]) -> dict[int, dict[float, float]]:
    """``[(num_frames, depth, correct), ...]`` -> ``{num_frames: {depth: accuracy %}}``."""
    sums: dict[int, dict[float, list[int]]] = {}
    for f, d, ok in records:
        cell = sums.setdefault(int(f), {}).setdefault(round(float(d), 4), [0, 0])
        cell[0] += int(ok)
        cell[1] += 1
    return {f: {d: 100.0 * c / n for d, (c, n) in sorted(row.items())} for f, row in sorted(sums.items())}


class VideoNIAH(pl.LightningModule):
    """A :class:`vispe.models.video_llm.VideoLLM` trained and scored on NIAH episodes.

    Args:
        pos_scheme: ``rope_1d, mrope, mrope_interleave, mhrope, vrope, hope, v2pe, videorope, qwen3vl`` (name or
            ``{'name': ..., 'theta': ...}``).
        position_kwargs: evaluation-time position options (default :data:`EVAL_POSITION_DEFAULTS`).
        visual_dim: width of the raw patch features (``patch * patch * 3``).
        visual_projector: ``'linear'`` (a ViT-style linear patch embedding owned by the task; the
            LLM then takes ``dim``-wide features) or ``'merger'`` (the LLM's own Qwen2-VL style
            LayerNorm -> MLP projector; its per-token LayerNorm amplifies the small colour casts
            of near-grey haystack patches, which makes the needle harder to learn from raw pixels).
        dim, depth, num_heads, mlp_ratio: decoder size.
        lr, weight_decay, min_lr, warmup_epochs | warmup_steps: AdamW, linear warm-up, cosine to ``min_lr`` (per step;
            :mod:`vispe.tasks.optim`, shared by every task).
    """

    def __init__(
        self,
        pos_scheme: str | Mapping[str, Any] = "mrope",
        position_kwargs: Mapping[str, Any] | None = None,
        visual_dim: int = 48,
        visual_projector: str = "linear",
        dim: int = 64,
        depth: int = 2,
        num_heads: int = 2,
        mlp_ratio: float = 4.0,
        lr: float = 1e-3,
        weight_decay: float = 0.05,
        min_lr: float = 1e-5,
        warmup_steps: int | None = 20,
        warmup_epochs: float | None = None,
    ) -> None:
        super().__init__()
        from vispe.models.video_llm import VideoLLM
        from vispe.encodings.spec import parse_pos_encoding

        self.save_hyperparameters()
        check_schedule(lr, weight_decay, min_lr, warmup_epochs, warmup_steps)
        if visual_projector not in ("linear", "merger"):
            raise ValueError(f"visual_projector={visual_projector!r}; choose 'linear' or 'merger'")
        self.vocab = NIAHVocab()
        name, _ = parse_pos_encoding(pos_scheme)
        pk = dict(EVAL_POSITION_DEFAULTS.get(name, {})) if position_kwargs is None else dict(position_kwargs)
        self.model = VideoLLM(
            vocab_size=len(self.vocab), dim=dim, depth=depth, num_heads=num_heads, mlp_ratio=mlp_ratio,
            pos_scheme=pos_scheme, position_kwargs=pk, pad_token_id=self.vocab.pad_id,
            visual_dim=visual_dim if visual_projector == "merger" else None,
        )
        self.patch_embed = torch.nn.Linear(visual_dim, dim) if visual_projector == "linear" else None
        self.scheme = name
        self.register_buffer("answer_ids", self.vocab.answer_ids, persistent=False)
        self._records: list[tuple[int, float, bool]] = []
        self.last_grid: dict[int, dict[float, float]] = {}

    # -- episodes -> packed sequences ---------------------------------------------------------
    def samples(self, features: torch.Tensor, answers: torch.Tensor | None = None) -> list[list[torch.Tensor]]:
        bos = torch.tensor([self.vocab.bos_id])
        question = self.vocab.question_ids()
        if self.patch_embed is not None:
            features = self.patch_embed(features)
        out = []
        for b in range(features.shape[0]):
            tail = question if answers is None else torch.cat([question, self.answer_ids[answers[b]].view(1).cpu()])
            out.append([bos, features[b], tail])
        return out

    def loss_and_logits(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        packed = self.model.pack(self.samples(batch["features"], batch["answer"]), padding_side="left")
        labels = torch.full_like(packed.token_ids, -100)
        labels[:, -1] = self.answer_ids[batch["answer"]]  # left padding: the answer is the last token of every row
        out = self.model.forward_batch(packed, labels=labels)
        return out.loss, out.logits[:, -2]

    @torch.no_grad()
    def predict_answers(self, features: torch.Tensor) -> torch.Tensor:
        """Vocabulary argmax at the last prompt position: ``(B,)`` token ids."""
        packed = self.model.pack(self.samples(features), padding_side="left")
        return self.model.forward_batch(packed).logits[:, -1].argmax(-1)

    # -- Lightning -------------------------------------------------------------------------
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        loss, logits = self.loss_and_logits(batch)
        acc = (logits.argmax(-1) == self.answer_ids[batch["answer"]]).float().mean()
        n = batch["features"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=n)
        self.log("train/acc", acc, prog_bar=True, batch_size=n)
        return loss

    def _eval_step(self, batch: dict[str, Any]) -> None:
        pred = self.predict_answers(batch["features"])
        ok = (pred == self.answer_ids[batch["answer"]]).cpu()
        f = batch["num_frames"]
        self._records += [(f, float(d), bool(o)) for d, o in zip(batch["depth"].tolist(), ok.tolist())]

    def validation_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_step(batch)

    def test_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_step(batch)

    def _eval_epoch_end(self, stage: str) -> None:
        if not self._records:
            return
        grid = accuracy_grid(self._records)
        self.last_grid = grid
        for f, row in grid.items():
            self.log(f"{stage}/acc_{f}f", sum(row.values()) / len(row), add_dataloader_idx=False)
        self.log(f"{stage}/acc", 100.0 * sum(ok for _, _, ok in self._records) / len(self._records), prog_bar=True, add_dataloader_idx=False)
        self._records = []

    def on_validation_epoch_end(self) -> None:
        self._eval_epoch_end("val")

    def on_test_epoch_end(self) -> None:
        self._eval_epoch_end("test")

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        return adamw_warmup_cosine(self.trainer, param_groups_no_decay(self, hp.weight_decay), lr=hp.lr, min_lr=hp.min_lr,
                                   warmup_epochs=hp.warmup_epochs, warmup_steps=hp.warmup_steps)
