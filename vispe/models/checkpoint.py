"""Load timm ViT checkpoints into vispe models with any positional encoding, and say what happened.

Every key ends in exactly one bucket of a :class:`LoadReport`: kept (loaded as is), resampled
(loaded after a shape change: patch embedding, learned position table), new (the model has it,
the checkpoint does not: freshly initialised), dropped (the checkpoint has it, the model does
not, e.g. ``pos_embed`` when the encoding is rotary, or a head of another size). Nothing is
dropped silently: the report is logged at WARNING level whenever something was dropped or is new.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.nn as nn

__all__ = ["LoadReport", "adapt_timm_state_dict", "load_timm_checkpoint", "timm_checkpoint_filter"]

_logger = logging.getLogger("vispe")


@dataclass
class LoadReport:
    kept: list[str] = field(default_factory=list)
    resampled: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        def fmt(keys: list[str]) -> str:
            return ", ".join(keys) if len(keys) <= 12 else ", ".join(keys[:12]) + f", ... (+{len(keys) - 12})"

        lines = [f"checkpoint load: {len(self.kept)} kept, {len(self.resampled)} resampled, {len(self.new)} new, {len(self.dropped)} dropped"]
        if self.resampled:
            lines.append(f"  resampled: {fmt(self.resampled)}")
        if self.new:
            lines.append(f"  newly initialised: {fmt(self.new)}")
        if self.dropped:
            lines.append(f"  dropped: {fmt(self.dropped)}")
        return "\n".join(lines)


def _unwrap(state_dict: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    for key in ("state_dict_ema", "model_ema", "state_dict", "model"):
        if key in state_dict and isinstance(state_dict[key], Mapping):
            state_dict = state_dict[key]
            break
    sd = {k[len("module."):] if k.startswith("module.") else k: v for k, v in state_dict.items()}
    return sd


def _check_width(sd: Mapping[str, torch.Tensor], model: nn.Module) -> None:
    w = sd.get("patch_embed.proj.weight")
    if w is not None and w.shape[0] != model.embed_dim:
        raise ValueError(
            f"checkpoint width {w.shape[0]} (patch_embed.proj.weight {tuple(w.shape)}) does not match the model's "
            f"embed_dim={model.embed_dim}; pick the vispe model of the checkpoint's size (tiny=192, small=384, base=768)"
        )
    n_blocks = 1 + max((int(k.split(".")[1]) for k in sd if k.startswith("blocks.")), default=-1)
    if n_blocks and n_blocks != len(model.blocks):
        _logger.warning("checkpoint has %d blocks, model has %d: extra blocks are dropped, missing ones are new", n_blocks, len(model.blocks))


def adapt_timm_state_dict(state_dict: Mapping[str, Any], model: nn.Module) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """Map a timm ViT state dict onto a :class:`~vispe.models.VispeVisionTransformer`.

    Uses timm's own converter (``checkpoint_filter_fn``: patch-embed resampling, CLIP/DINOv2/
    open_clip layouts), then hands ``pos_embed`` to the encoding's ``load_timm_pos_embed``.
    """
    from timm.models.vision_transformer import checkpoint_filter_fn

    sd = _unwrap(state_dict)
    _check_width(sd, model)
    original_shapes = {k: tuple(v.shape) for k, v in sd.items()}
    pos_embed = sd.pop("pos_embed", None)
    sd = checkpoint_filter_fn(sd, model)
    report = LoadReport()
    target = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    if pos_embed is not None:
        mapped = model.pos_encoding.load_timm_pos_embed(pos_embed)
        if mapped:
            for k, v in mapped.items():
                out[f"pos_encoding.{k}"] = v
                (report.resampled if tuple(v.shape) != tuple(pos_embed.shape) else report.kept).append(f"pos_embed -> pos_encoding.{k}")
        else:
            report.dropped.append(f"pos_embed (encoding {model.pos_encoding_name!r} has no absolute table)")
    for k, v in sd.items():
        if k not in target:
            report.dropped.append(k)
        elif tuple(target[k].shape) != tuple(v.shape):
            report.dropped.append(f"{k} (checkpoint {tuple(v.shape)} vs model {tuple(target[k].shape)})")
        else:
            out[k] = v
            if original_shapes.get(k, tuple(v.shape)) != tuple(v.shape):
                report.resampled.append(k)
            else:
                report.kept.append(k)
    report.new = [k for k in target if k not in out]
    return out, report


def _log(report: LoadReport) -> None:
    level = logging.WARNING if (report.dropped or report.new) else logging.INFO
    _logger.log(level, "%s", report)


def timm_checkpoint_filter(state_dict: Mapping[str, Any], model: nn.Module) -> dict[str, torch.Tensor]:
    """``pretrained_filter_fn`` for timm's factory: adapts and logs the :class:`LoadReport`."""
    out, report = adapt_timm_state_dict(state_dict, model)
    _log(report)
    model.last_load_report = report
    return out


def load_timm_checkpoint(model: nn.Module, checkpoint: str | os.PathLike | Mapping[str, Any]) -> LoadReport:
    """Load a timm ViT checkpoint (a state dict or a ``.pth``/``.safetensors`` file) into ``model``."""
    if not isinstance(checkpoint, Mapping):
        path = os.fspath(checkpoint)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"checkpoint file not found: {path}")
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            checkpoint = load_file(path)
        else:
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    out, report = adapt_timm_state_dict(checkpoint, model)
    missing, unexpected = model.load_state_dict(out, strict=False)
    assert not unexpected, unexpected  # adapt_timm_state_dict only returns model keys
    _log(report)
    return report
