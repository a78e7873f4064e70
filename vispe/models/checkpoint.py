"""Load timm ViT checkpoints into vispe models with any positional encoding, and say what happened.

Covers timm's ``VisionTransformer`` checkpoints (ViT, DeiT, DeiT-III, CLIP/DINOv2 layouts through
timm's own converter) and timm's Eva RoPE ViTs (``vit_*_patch16_rope_*``, ``..._rope_mixed_*``):
Eva's layer scale (``gamma_1/gamma_2``), split q/v biases and learned RoPE-Mixed frequencies
(``rope.freqs``) are mapped onto vispe's names.

Every key ends in exactly one bucket of a :class:`LoadReport`: kept (loaded as is), resampled
(loaded after a shape change: patch embedding, learned position table), new (the model has it,
the checkpoint does not: freshly initialised), dropped (the checkpoint has it, the model does
not, e.g. ``pos_embed`` when the encoding is rotary, or a head of another size). Changes made to
the model so that it can hold the checkpoint (layer scale switched on) are listed as ``adapted``.
Nothing is dropped silently: the report is logged at WARNING level whenever something was dropped or is new,
and a state dict of which nothing fits the model (a ResNet's, say) is refused with ``ValueError``.
Files are read through :mod:`vispe.files` (safetensors, or ``torch.load(weights_only=True)``): never unpickled code.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.nn as nn

__all__ = [
    "LoadReport", "adapt_timm_state_dict", "load_timm_checkpoint", "timm_checkpoint_filter",
    "adapt_released_loope_state_dict", "load_released_loope", "released_loope_options",
    "adapt_released_seqpe_state_dict", "load_released_seqpe", "released_seqpe_options",
]

_logger = logging.getLogger("vispe")


@dataclass
class LoadReport:
    kept: list[str] = field(default_factory=list)
    resampled: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    #: model changes made so it can hold the checkpoint (e.g. layer scale switched on)
    adapted: list[str] = field(default_factory=list)
    #: checkpoint keys renamed from another layout, ``"source -> target"`` (Eva -> VisionTransformer)
    renamed: list[str] = field(default_factory=list)
    #: loaded after reordering an axis (e.g. input channels in another order), ``"source -> target (how)"``
    permuted: list[str] = field(default_factory=list)
    #: loaded transposed (a GPT-2 ``Conv1D`` weight ``(in, out)`` into an ``nn.Linear`` ``(out, in)``), ``"source -> target"``
    transposed: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        def fmt(keys: list[str]) -> str:
            return ", ".join(keys) if len(keys) <= 12 else ", ".join(keys[:12]) + f", ... (+{len(keys) - 12})"

        lines = [f"checkpoint load: {len(self.kept)} kept, {len(self.resampled)} resampled, {len(self.new)} new, {len(self.dropped)} dropped"]
        if self.permuted:
            lines[0] += f", {len(self.permuted)} permuted"
            lines.append(f"  permuted: {fmt(self.permuted)}")
        if self.transposed:
            lines[0] += f", {len(self.transposed)} transposed"
            lines.append(f"  transposed: {fmt(self.transposed)}")
        if self.adapted:
            lines.append(f"  model adapted: {fmt(self.adapted)}")
        if self.renamed:
            lines.append(f"  renamed: {fmt(self.renamed)}")
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


_EVA_KEY = re.compile(r"^blocks\.(\d+)\.(gamma_[12]|attn\.(q_bias|v_bias|[qkv]_proj\.(weight|bias)))$")


def _is_eva(sd: Mapping[str, torch.Tensor]) -> bool:
    return "rope.freqs" in sd or any(_EVA_KEY.match(k) for k in sd)


def _eva_to_vit(sd: dict[str, torch.Tensor], report: LoadReport) -> dict[str, torch.Tensor]:
    """Rename timm Eva keys to timm ``VisionTransformer`` keys (the two share everything else).

    ``gamma_1/2`` -> ``ls1/ls2.gamma``; ``attn.q_bias`` + ``attn.v_bias`` -> ``attn.qkv.bias`` (the k bias
    is zero in Eva); separate ``q/k/v_proj`` -> fused ``attn.qkv``.
    """
    out: dict[str, torch.Tensor] = {}
    blocks: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in sd.items():
        m = _EVA_KEY.match(k)
        if m is None:
            out[k] = v
            continue
        i, part = m.group(1), m.group(2)
        if part.startswith("gamma_"):
            target = f"blocks.{i}.ls{part[-1]}.gamma"
            out[target] = v
            report.renamed.append(f"{k} -> {target}")
        else:
            blocks.setdefault(i, {})[part[len("attn."):]] = v
    for i, parts in blocks.items():
        if "q_bias" in parts and "v_bias" in parts:
            q, v = parts.pop("q_bias"), parts.pop("v_bias")
            out[f"blocks.{i}.attn.qkv.bias"] = torch.cat([q, torch.zeros_like(q), v])
            report.renamed.append(f"blocks.{i}.attn.q_bias + v_bias -> blocks.{i}.attn.qkv.bias")
        for kind in ("weight", "bias"):
            split = [parts.pop(f"{n}_proj.{kind}", None) for n in "qkv"]
            if all(t is not None for t in split):
                out[f"blocks.{i}.attn.qkv.{kind}"] = torch.cat(split)
                report.renamed.append(f"blocks.{i}.attn.[qkv]_proj.{kind} -> blocks.{i}.attn.qkv.{kind}")
        for rest, v in parts.items():  # an incomplete split: keep it under its own name (reported as dropped)
            out[f"blocks.{i}.attn.{rest}"] = v
    return out


def _enable_layer_scale(sd: Mapping[str, torch.Tensor], model: nn.Module, report: LoadReport) -> None:
    """Switch on layer scale (timm ``LayerScale``) in blocks that lack it when the checkpoint carries it.

    Refusing would make every DeiT-III / Eva RoPE checkpoint unusable with a default-built model, and
    dropping the scales silently changes the network; the scales are loaded right after.
    """
    from timm.layers import LayerScale

    enabled = []
    for i, block in enumerate(getattr(model, "blocks", [])):
        for name in ("ls1", "ls2"):
            if f"blocks.{i}.{name}.gamma" in sd and isinstance(getattr(block, name, None), nn.Identity):
                ref = next(model.parameters())
                setattr(block, name, LayerScale(model.embed_dim, init_values=1.0).to(device=ref.device, dtype=ref.dtype))
                enabled.append(f"blocks.{i}.{name}")
    if enabled:
        report.adapted.append(f"layer scale switched on in {len(enabled)} places ({enabled[0]}, ...) to hold the checkpoint's scales")


def adapt_timm_state_dict(state_dict: Mapping[str, Any], model: nn.Module) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """Map a timm ViT state dict onto a :class:`~vispe.models.VispeVisionTransformer`.

    Uses timm's own converter (``checkpoint_filter_fn``: patch-embed resampling, CLIP/DINOv2/
    open_clip layouts), then hands ``pos_embed`` to the encoding's ``load_timm_pos_embed``.
    """
    from timm.models.vision_transformer import checkpoint_filter_fn

    report = LoadReport()
    sd = _unwrap(state_dict)
    _check_width(sd, model)
    if _is_eva(sd):
        sd = _eva_to_vit(sd, report)
    _enable_layer_scale(sd, model, report)
    original_shapes = {k: tuple(v.shape) for k, v in sd.items()}
    pos_embed = sd.pop("pos_embed", None)
    if "dist_token" in sd and "dist_token" not in model.state_dict():
        # distilled DeiT: its pos_embed rows are (cls, dist, grid...); vispe ViTs have no distillation token
        sd.pop("dist_token")
        if pos_embed is not None:
            pos_embed = torch.cat([pos_embed[:, :1], pos_embed[:, 2:]], dim=1)
        report.dropped.append("dist_token and its pos_embed row (vispe ViTs have no distillation token)")
    rope_freqs = sd.pop("rope.freqs", None)
    sd = checkpoint_filter_fn(sd, model)
    target = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    if rope_freqs is not None:
        mapped = model.pos_encoding.load_timm_rope_freqs(rope_freqs)
        if not mapped:
            report.dropped.append(f"rope.freqs (encoding {model.pos_encoding_name!r} has no learned rotary frequencies)")
        for k, v in (mapped or {}).items():
            key = f"pos_encoding.{k}"
            if key in target and tuple(target[key].shape) == tuple(v.shape):
                out[key] = v
                report.kept.append(f"rope.freqs -> {key}")
            else:
                shape = tuple(target[key].shape) if key in target else None
                report.dropped.append(f"rope.freqs (checkpoint {tuple(v.shape)} vs model {key} {shape})")
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
    if not report.kept and not report.resampled:
        raise ValueError(
            f"the checkpoint keeps nothing of the model: 0 of {len(target)} model tensors found a match "
            f"({len(report.dropped)} checkpoint tensors dropped, e.g. {', '.join(report.dropped[:3])}); it is not a timm "
            f"VisionTransformer checkpoint of this layout. Pass a ViT/DeiT/Eva checkpoint, or build the model without one"
        )
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


def _as_state_dict(checkpoint: str | os.PathLike | Mapping[str, Any]) -> Mapping[str, Any]:
    """A state dict as given, or read from a ``.pth`` / ``.safetensors`` file through vispe's checked reader
    (safetensors, or ``torch.load(weights_only=True)``: a file never runs code)."""
    if isinstance(checkpoint, Mapping):
        return checkpoint
    from vispe.files import read_state_dict

    path = os.fspath(checkpoint)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file not found: {path}")
    state = read_state_dict(path)
    if not isinstance(state, Mapping):
        raise ValueError(f"checkpoint {path!r} holds a {type(state).__name__}, not a state dict")
    return state


def load_timm_checkpoint(model: nn.Module, checkpoint: str | os.PathLike | Mapping[str, Any]) -> LoadReport:
    """Load a timm ViT checkpoint (a state dict or a ``.pth``/``.safetensors`` file) into ``model``."""
    checkpoint = _as_state_dict(checkpoint)
    out, report = adapt_timm_state_dict(checkpoint, model)
    missing, unexpected = model.load_state_dict(out, strict=False)
    assert not unexpected, unexpected  # adapt_timm_state_dict only returns model keys
    _log(report)
    return report


# ---------------------------------------------------------------------------------------------
# LOOPE's released code (AbtahiMajeed144/LOOPE, models/positional_encodings/art_pe.py: ArtPE)
# ---------------------------------------------------------------------------------------------

#: ArtPE's ``art_conv`` Sequential index -> vispe LoopeContext parameter prefix (convs share indices)
_ARTPE_MODULES = {**{str(i): f"context.cnn.{i}" for i in (0, 2, 4, 6, 8)}, "10": "context.norm", "12": "context.head"}
#: ArtPE buffers vispe recomputes from the grid (checked against the encoding, then dropped)
_ARTPE_RECOMPUTED = ("cord", "wrap_pos_hilbert", "div_term")


def adapt_released_loope_state_dict(
    state_dict: Mapping[str, Any], encoding: nn.Module
) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """Map a released LOOPE ``ArtPE`` state dict onto a vispe ``loope`` encoding (keys relative to it).

    Accepts the ``ArtPE`` module's own keys (``art_conv.*``, ``cls_token``, buffers) or a whole released
    ``ViT_Art`` state dict (its ``pos_embedding.*`` keys are used, the rest is reported as dropped).
    The first convolution's input channels are permuted when the encoding uses ``channel_order='xy_image'``
    (released: R, G, B, y, x). The recomputed buffers (``cord``, ``wrap_pos_hilbert``, ``div_term``) are
    dropped; when the checkpoint's curve positions differ from the encoding's (other ``curve_start`` or
    ``orientation``), the report says so in ``adapted``.
    """
    from ..encodings.loope import LOOPE

    if not isinstance(encoding, LOOPE):
        raise TypeError(f"adapt_released_loope_state_dict needs a vispe 'loope' encoding, got {type(encoding).__name__}")
    report = LoadReport()
    sd = _unwrap(state_dict)
    if any(k.startswith("pos_embedding.") for k in sd):
        outer = {k: v for k, v in sd.items() if not k.startswith("pos_embedding.")}
        report.dropped += [f"{k} (not part of the positional encoding)" for k in outer]
        sd = {k[len("pos_embedding."):]: v for k, v in sd.items() if k.startswith("pos_embedding.")}
    target = encoding.state_dict()
    out: dict[str, torch.Tensor] = {}

    def put(src: str, dst: str, value: torch.Tensor, bucket: list[str], how: str = "") -> None:
        _put_released(report, target, out, src, dst, value, bucket, how,
                      absent=f"offset={encoding.context is not None}, head options")

    for key, value in sd.items():
        if key in _ARTPE_RECOMPUTED:
            continue
        if key == "cls_token":
            put(key, "prefix_embed", value.reshape(1, -1, value.shape[-1]), report.kept)
            continue
        parts = key.split(".")
        if len(parts) == 3 and parts[0] == "art_conv" and parts[1] in _ARTPE_MODULES:
            dst = f"{_ARTPE_MODULES[parts[1]]}.{parts[2]}"
            if key == "art_conv.0.weight" and encoding.context is not None and encoding.context.channel_order == "xy_image":
                # released input channels (R, G, B, y, x) -> vispe's (x, y, R, G, B)
                put(key, dst, value[:, [4, 3, 0, 1, 2]], report.permuted, "channels (R,G,B,y,x) -> (x,y,R,G,B)")
            else:
                put(key, dst, value, report.kept)
            continue
        report.dropped.append(key)
    # the recomputed buffers: dropped, but say when they disagree with this encoding
    from ..encodings.grid import PositionGrid

    grid = PositionGrid(tuple(encoding.grid_size), 0)
    curve = sd.get("wrap_pos_hilbert")
    if curve is not None:
        mine = encoding.curve_positions(grid, None)
        if curve.numel() != mine.numel() or not torch.equal(curve.reshape(-1).float(), mine.cpu()):
            report.adapted.append(
                "checkpoint curve positions (wrap_pos_hilbert) differ from this encoding's; the encoding's are used "
                "(released convention: curve_start=1, orientation='released')"
            )
    div = sd.get("div_term")
    if div is not None:
        mine = encoding.temperature ** (-torch.arange(0, encoding.dim, 2, dtype=torch.float64) / encoding.dim)
        if div.numel() != mine.numel() or not torch.allclose(div.reshape(-1).double(), mine, rtol=1e-4, atol=1e-7):
            report.adapted.append("checkpoint div_term differs from this encoding's frequencies (dim / temperature)")
    report.dropped += [f"{k} (recomputed from the grid)" for k in _ARTPE_RECOMPUTED if k in sd]
    report.new = [k for k in target if k not in out]
    return out, report


def released_loope_options(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The ``loope`` options and model sizes a released ``ArtPE`` (or ``ViT_Art``) state dict needs, read from its
    shapes: ``head='linear'`` (a ``Linear(N, N)`` head over ``N`` patches) with ``linear_bias`` when it has one,
    ``order_scale='index'`` (the released code's raw curve steps), and ``embed_dim`` / ``in_chans`` / ``patch_size``
    / ``num_patches`` where the tensors show them."""
    sd = _unwrap(state_dict)
    if any(k.startswith("pos_embedding.") for k in sd):
        sd = {k[len("pos_embedding."):]: v for k, v in sd.items() if k.startswith("pos_embedding.")}
    out: dict[str, Any] = {"order_scale": "index"}
    head = sd.get("art_conv.12.weight")
    if isinstance(head, torch.Tensor) and head.ndim == 2:
        out.update(head="linear", linear_bias="art_conv.12.bias" in sd, num_patches=int(head.shape[0]))
    cls = sd.get("cls_token")
    if isinstance(cls, torch.Tensor) and cls.ndim >= 1:
        out["embed_dim"] = int(cls.shape[-1])
    conv = sd.get("art_conv.0.weight")
    if isinstance(conv, torch.Tensor) and conv.ndim == 4:
        out.update(in_chans=int(conv.shape[1]) - 2, patch_size=tuple(int(v) for v in conv.shape[2:]))
    return out


def _encoding_values(encoding: nn.Module) -> dict[str, Any]:
    ctx = encoding.context
    out: dict[str, Any] = {"order_scale": encoding.order_scale, "embed_dim": int(encoding.dim)}
    if ctx is not None:
        head = ctx.head
        out.update(head=ctx.head_kind, num_patches=int(ctx.num_patches),
                   linear_bias=ctx.head_kind == "linear" and getattr(head, "bias", None) is not None,
                   in_chans=int(ctx.cnn[0].in_channels) - 2, patch_size=tuple(int(v) for v in ctx.cnn[0].kernel_size))
    return out


def load_released_loope(target: nn.Module, checkpoint: str | os.PathLike | Mapping[str, Any], allow_partial: bool = False) -> LoadReport:
    """Load a released LOOPE ``ArtPE`` (or ``ViT_Art``) state dict into a ``loope`` encoding.

    ``target`` is the encoding or a vispe model whose ``pos_encoding`` is one; ``checkpoint`` a state dict
    or a ``.pth`` file. Returns the :class:`LoadReport` (kept / permuted / new / dropped), also logged.

    As strict as :func:`load_timm_checkpoint`: a state dict that keeps nothing of the encoding is refused, and so is
    one that fits only in part (encoding tensors left newly initialised, or checkpoint tensors of other shapes),
    with the options the released weights need (:func:`released_loope_options`: ``head='linear'``,
    ``order_scale='index'``, sizes) against this encoding's; ``allow_partial=True`` loads the part that fits.
    """
    encoding = getattr(target, "pos_encoding", target)
    return _load_released(
        encoding, checkpoint, allow_partial, "loope", adapt_released_loope_state_dict, ("kept", "permuted"),
        "it is not a released LOOPE ArtPE / ViT_Art state dict",
        lambda state: (released_loope_options(state), _encoding_values(encoding)),
        "pos_encoding='loope[head=linear,order_scale=index]'",
    )


def _put_released(report: LoadReport, target: Mapping[str, torch.Tensor], out: dict[str, torch.Tensor], src: str,
                  dst: str, value: Any, bucket: list[str], how: str = "", absent: str = "") -> None:
    """One released tensor into ``out[dst]`` (recorded in ``bucket``), or into ``report.dropped`` saying why."""
    if not isinstance(value, torch.Tensor):
        report.dropped.append(f"{src} (not a tensor)")
    elif dst not in target:
        report.dropped.append(f"{src} (the encoding has no {dst}" + (f": {absent})" if absent else ")"))
    elif tuple(target[dst].shape) != tuple(value.shape):
        report.dropped.append(f"{src} (checkpoint {tuple(value.shape)} vs encoding {dst} {tuple(target[dst].shape)})")
    else:
        out[dst] = value
        bucket.append(f"{src} -> {dst}" + (f" ({how})" if how else ""))


def _load_released(encoding: nn.Module, checkpoint: str | os.PathLike | Mapping[str, Any], allow_partial: bool, name: str,
                   adapt: Any, loaded: tuple[str, ...], not_this: str, options: Any, example: str) -> LoadReport:
    """The released-weight loaders' common path, as strict as :func:`load_timm_checkpoint`: read, ``adapt`` (-> state
    dict, report), refuse a state dict that keeps nothing of the encoding (no key in the report's ``loaded`` buckets),
    and one that fits only in part (encoding tensors left newly initialised, or checkpoint tensors of other shapes)
    unless ``allow_partial``, naming the tensors and the options the weights need against the encoding's
    (``options(state)`` -> ``(needed, have)``); then load, drop the cached tables, log the report."""
    source = f"{os.fspath(checkpoint)!r}" if not isinstance(checkpoint, Mapping) else "the state dict"
    state = _as_state_dict(checkpoint)
    out, report = adapt(state, encoding)
    target_keys = list(encoding.state_dict())
    if not any(getattr(report, bucket) for bucket in loaded):
        raise ValueError(
            f"{source} keeps nothing of the {name} encoding: 0 of {len(target_keys)} encoding tensors found a match "
            f"({len(report.dropped)} checkpoint tensors dropped{', e.g. ' + ', '.join(report.dropped[:3]) if report.dropped else ''}); "
            f"{not_this}"
        )
    misfit = [d for d in report.dropped if "(checkpoint " in d or "(the encoding has no" in d]
    if (report.new or misfit) and not allow_partial:
        needed, have = options(state)
        differ = {k: v for k, v in needed.items() if have.get(k, v) != v}
        fix = (f"the released weights need {', '.join(f'{k}={v!r}' for k, v in differ.items())} "
               f"(this encoding has {', '.join(f'{k}={have.get(k)!r}' for k in differ)})" if differ else
               f"the released weights need {', '.join(f'{k}={v!r}' for k, v in needed.items())}")
        raise ValueError(
            f"{source} fits the {name} encoding only in part: {len(report.new)} encoding tensors would stay newly initialised "
            f"({', '.join(report.new[:3]) or 'none'}) and {len(misfit)} checkpoint tensors do not fit ({', '.join(misfit[:2]) or 'none'}); "
            f"{fix}. Build the encoding with them (e.g. {example}), or pass allow_partial=True to load the part that fits"
        )
    encoding.load_state_dict(out, strict=False)
    encoding.clear_cache()
    _log(report)
    return report


# ---------------------------------------------------------------------------------------------
# SeqPE's released code (ghrua/seqpe, image_seqpe/models/sequential_pe.py: SequentialPE)
# ---------------------------------------------------------------------------------------------

#: SequentialPE top-level tensors -> vispe ``seqpe`` encoding keys
_SEQPE_TOP = {
    "token_of_seqpe_embed.weight": "encoder.digit_embed.weight",
    "pos_of_seqpe_embed.weight": "encoder.slot_embed.weight",
    "dim_token_embed": "encoder.axis_embed",
    "cls_token_embed": "encoder.summary_token",
    "layernorm.weight": "encoder.final_norm.weight",
    "layernorm.bias": "encoder.final_norm.bias",
    "out_proj.weight": "encoder.out_proj.weight",
    "out_proj.bias": "encoder.out_proj.bias",
}
#: SequentialPeBlock parts -> timm Block parts; the GPT-2 Conv1D ones store their weight as (in, out)
_SEQPE_BLOCK = re.compile(r"^transformers\.(\d+)\.(layernorm_1|layernorm_2|attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.(weight|bias)$")
_SEQPE_BLOCK_PARTS = {"layernorm_1": "norm1", "layernorm_2": "norm2", "attn.c_attn": "attn.qkv", "attn.c_proj": "attn.proj",
                      "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
_CONV1D_PARTS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def _released_seqpe_parts(state_dict: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(SequentialPE state dict, ViT state dict or {})``: a released training checkpoint holds the position
    network under ``pe_model`` and the ViT (with the cls token's own vector ``cls_token_pos_embed``) under ``model``."""
    def strip(sd: Mapping[str, Any]) -> dict[str, Any]:
        return {k[len("module."):] if k.startswith("module.") else k: v for k, v in sd.items()}

    if isinstance(state_dict.get("pe_model"), Mapping):
        vit = state_dict.get("model")
        return strip(state_dict["pe_model"]), strip(vit) if isinstance(vit, Mapping) else {}
    return strip(state_dict), {}


def adapt_released_seqpe_state_dict(
    state_dict: Mapping[str, Any], encoding: nn.Module
) -> tuple[dict[str, torch.Tensor], LoadReport]:
    """Map a released SeqPE ``SequentialPE`` state dict onto a vispe ``seqpe`` / ``seqpe_3d`` encoding (keys
    relative to it).

    Accepts the ``SequentialPE`` module's own keys, or a released training checkpoint (``{'model': ViT,
    'pe_model': SequentialPE, ...}``), whose ViT gives the cls token's vector (``cls_token_pos_embed`` ->
    ``prefix_embed``; its other tensors are not part of the encoding and are reported as one dropped entry).
    The four GPT-2 ``Conv1D`` weights of each block are transposed into timm's ``nn.Linear`` layout.
    """
    from ..encodings.seqpe import SeqPE

    if not isinstance(encoding, SeqPE):
        raise TypeError(f"adapt_released_seqpe_state_dict needs a vispe 'seqpe' or 'seqpe_3d' encoding, got {type(encoding).__name__}")
    report = LoadReport()
    pe, vit = _released_seqpe_parts(state_dict)
    target = encoding.state_dict()
    out: dict[str, torch.Tensor] = {}

    def put(src: str, dst: str, value: Any, bucket: list[str]) -> None:
        _put_released(report, target, out, src, dst, value, bucket)

    for key, value in pe.items():
        m = _SEQPE_BLOCK.match(key)
        if key in _SEQPE_TOP:
            put(key, _SEQPE_TOP[key], value, report.kept)
        elif m is not None:
            i, part, kind = m.groups()
            dst = f"encoder.blocks.{i}.{_SEQPE_BLOCK_PARTS[part]}.{kind}"
            if part in _CONV1D_PARTS and kind == "weight" and isinstance(value, torch.Tensor) and value.ndim == 2:
                put(key, dst, value.t().contiguous(), report.transposed)
            else:
                put(key, dst, value, report.kept)
        else:
            report.dropped.append(key)
    if "cls_token_pos_embed" in vit:
        put("model.cls_token_pos_embed", "prefix_embed", vit["cls_token_pos_embed"], report.kept)
    rest = [k for k in vit if k != "cls_token_pos_embed"]
    if rest:
        report.dropped.append(f"{len(rest)} ViT tensors of 'model' ({rest[0]}, ...; not part of the positional encoding)")
    report.new = [k for k in target if k not in out]
    return out, report


def released_seqpe_options(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """The ``seqpe`` options and sizes a released ``SequentialPE`` state dict needs, read from its shapes:
    ``final_layer_norm`` (``layernorm.*`` present), ``encoder_dim``, ``encoder_depth``, ``base`` (digit
    vocabulary), ``num_digits`` (digits per axis: ``max_position`` must need exactly as many), ``num_axes`` and the
    embedding ``dim``. The released heads (``width // 64``), LayerNorm eps (1e-5) and temperature (1) are not in
    the weights."""
    pe, _ = _released_seqpe_parts(state_dict)
    out: dict[str, Any] = {"final_layer_norm": "layernorm.weight" in pe}
    digits, slots = pe.get("token_of_seqpe_embed.weight"), pe.get("pos_of_seqpe_embed.weight")
    if isinstance(digits, torch.Tensor) and digits.ndim == 2:
        out.update(base=int(digits.shape[0]), encoder_dim=int(digits.shape[1]))
    axes = pe.get("dim_token_embed")
    num_axes = int(axes.shape[0]) if isinstance(axes, torch.Tensor) and axes.ndim == 3 else 1
    out["num_axes"] = num_axes
    if isinstance(slots, torch.Tensor) and slots.ndim == 2:
        out["num_digits"] = int(slots.shape[0]) // num_axes
    blocks = {int(m.group(1)) for k in pe if (m := _SEQPE_BLOCK.match(k))}
    if blocks:
        out["encoder_depth"] = max(blocks) + 1
    proj = pe.get("out_proj.weight")
    if isinstance(proj, torch.Tensor) and proj.ndim == 2:
        out["dim"] = int(proj.shape[0])
    return out


def _seqpe_values(encoding: nn.Module) -> dict[str, Any]:
    enc = encoding.encoder
    return {"final_layer_norm": enc.final_layer_norm, "base": int(encoding.base), "encoder_dim": int(enc.digit_embed.weight.shape[1]),
            "num_axes": int(encoding.num_axes), "num_digits": int(encoding.num_digits), "encoder_depth": len(enc.blocks),
            "dim": int(encoding.dim)}


def load_released_seqpe(target: nn.Module, checkpoint: str | os.PathLike | Mapping[str, Any], allow_partial: bool = False) -> LoadReport:
    """Load released SeqPE weights (ghrua/seqpe ``SequentialPE``; its module state dict, or a whole released
    checkpoint with ``pe_model`` and ``model``) into a ``seqpe`` / ``seqpe_3d`` encoding.

    ``target`` is the encoding or a vispe model whose ``pos_encoding`` is one; ``checkpoint`` a state dict or a
    ``.pth`` / ``.safetensors`` file. Returns the :class:`LoadReport` (kept / transposed / new / dropped), also logged.

    As strict as :func:`load_timm_checkpoint`: a state dict that keeps nothing of the encoding is refused, and so is
    one that fits only in part -- encoding tensors left newly initialised (the cls vector ``prefix_embed`` is only in
    a whole checkpoint's ``model``; ``encoder.final_norm.*`` is absent from weights trained without
    ``--seqpe_last_layernorm``) or checkpoint tensors of other shapes -- naming them and the options the weights need
    (:func:`released_seqpe_options`) against this encoding's; ``allow_partial=True`` loads the part that fits.
    """
    from ..encodings.seqpe import SeqPE

    encoding = getattr(target, "pos_encoding", target)
    if not isinstance(encoding, SeqPE):
        raise TypeError(f"load_released_seqpe needs a 'seqpe' / 'seqpe_3d' encoding or a model with one, got {type(encoding).__name__}")
    return _load_released(
        encoding, checkpoint, allow_partial, "seqpe", adapt_released_seqpe_state_dict, ("kept", "transposed"),
        "it is not a released SeqPE SequentialPE state dict (or a released checkpoint with 'pe_model')",
        lambda state: (released_seqpe_options(state), _seqpe_values(encoding)),
        "pos_encoding='seqpe[encoder_dim=384,final_layer_norm=True]'",
    )
