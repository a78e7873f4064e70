"""A video ViT with a pluggable 3D positional encoding, registered in timm as ``vispe_video_vit_*``.

``VispeVideoViT(pos_encoding='rope_axial_3d', img_size=224, num_frames=16, tubelet_size=2, patch_size=16, ...)``

* Input: ``(B, C, T, H, W)`` (PyTorch video layout). ``T`` must be divisible by ``tubelet_size``
  and ``H, W`` by ``patch_size``; any number of frames and any resolution work at inference (the
  token lattice is ``(T/t, H/p, W/p)``). A 4D image ``(B, C, H, W)`` is a still video: it is
  repeated over one tubelet (``tubelet_size`` identical frames, one temporal position), the way
  video models take images; this is also what timm's generic model tests feed.
* Tubelet embedding: a ``Conv3d`` with kernel = stride = ``(tubelet_size, patch_size, patch_size)``
  (``tubelet_size=1`` gives per-frame patches).
* Blocks: timm ``Block``/``Attention`` (:class:`vispe.models.layers.PEBlock` / ``PEAttention``, same
  parameter names), driven exactly like :class:`vispe.models.VispeVisionTransformer`: the encoding's
  ``prepare`` runs once per forward, each block gets ``LayerPE(encoding, state, i)``, then
  ``after_block``; token encodings act in ``embed_tokens``. Any encoding registered for 3D grids
  works (``vispe.list_encodings(grid_ndim=3)``: ``rope_axial_3d``, ``rope_mixed_3d``, ``sincos3d``,
  ``learned_3d``, ``comrope_ld_3d``, ``none``, ...).
* Prefix tokens: ``class_token=True`` (default) and ``reg_tokens`` registers; ``global_pool`` is
  ``'token'`` (cls), ``'avg'`` (mean of lattice tokens) or ``''`` (no pooling).

Stable API (used by the video-LLM and retrieval code):
    ``embed(x) -> (tokens (B, S+N, D), grid)`` (``embed_with_state`` adds the encoding's prepared state);
    ``iter_blocks(x, grid, state=...)``;
    ``forward_features(x) -> (B, S+N, D)`` (normed);
    ``forward_video_tokens(x) -> (B, T', H', W', D)`` lattice tokens (normed, no prefix tokens);
    ``forward_head(feats, pre_logits=False)``; ``forward(x) -> (B, num_classes)``;
    ``embed_dim``, ``num_prefix_tokens``, ``grid_size`` (training lattice), ``no_weight_decay()``,
    ``set_input_size(img_size=None, num_frames=None)``, ``reset_classifier(n)``.

Registered: ``vispe_video_vit_tiny_patch16_224`` (192 wide, 12 blocks, 3 heads, tubelet 2x16x16,
16 frames), ``vispe_video_vit_small_patch16_224`` (384/12/6, tubelet 2x16x16) and the CPU-sized
``vispe_video_vit_nano_patch8_64`` (96 wide, 4 blocks, 3 heads, tubelet 2x8x8, 8 frames of 64x64).
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
import torch.fx
from timm.layers import LayerNorm, PatchDropoutWithIndices, register_notrace_function, trunc_normal_
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models._features import feature_take_indices
from torch import nn

from ..encodings import (
    EncodingContext,
    PositionGrid,
    create_encoding,
    get_encoding_class,
)
from .._checks import Int, Ints, check_options
from ..encodings.base import check_context_fields
from .layers import NOT_PREPARED, PEAttention, PEBlock, auxiliary_loss, embed_grid, record_auxiliary_loss, run_blocks
from ..encodings.spec import PosEncodingArg, parse_pos_encoding

__all__ = ["TubeletEmbed", "VispeVideoViT"]


def _triple(x: int | Sequence[int]) -> tuple[int, ...]:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


@register_notrace_function
def _as_video(x: torch.Tensor, in_chans: int, kernel: tuple[int, int, int], weight_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Check a video's layout and size; a 4D image becomes a still clip of one tubelet (opaque under FX:
    it branches on the input's shape)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"video input x must be a torch.Tensor (B, C, T, H, W), got {type(x).__name__}")
    shape = tuple(x.shape)
    if x.ndim == 4 and x.shape[1] == in_chans:
        x = x.unsqueeze(2).expand(-1, -1, kernel[0], -1, -1)
    elif x.ndim == 5 and shape[1] != in_chans and shape[2] == in_chans:
        raise ValueError(f"video input x has shape {shape}, frames before channels; expected (B, C={in_chans}, T, H, W): use x.transpose(1, 2)")
    elif x.ndim == 5 and shape[1] != in_chans and shape[-1] == in_chans:
        raise ValueError(f"video input x has shape {shape}, channels last; expected (B, C={in_chans}, T, H, W): use x.permute(0, 4, 1, 2, 3)")
    elif x.ndim == 4 and shape[0] == in_chans:
        raise ValueError(f"video input x has shape {shape}, no batch dimension; expected (B, C={in_chans}, T, H, W): use x.unsqueeze(0)")
    if x.ndim != 5 or x.shape[1] != in_chans:
        raise ValueError(
            f"expected a video of shape (B, C={in_chans}, T, H, W) or an image (B, C={in_chans}, H, W), got {shape}"
        )
    if not x.is_floating_point():
        raise TypeError(f"video input x has dtype {x.dtype}; expected a floating-point tensor (e.g. x.float() / 255, then normalise)")
    if weight_dtype is not None and x.dtype != weight_dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(f"video input x has dtype {x.dtype}, the model's weights {weight_dtype}; convert with x.to({weight_dtype}) or run under torch.autocast")
    if 0 in tuple(x.shape):
        raise ValueError(f"video input x has shape {shape}: every size must be non-zero")
    tubelet_lattice(*x.shape[2:], kernel=kernel)
    return x


def tubelet_lattice(t: int, h: int, w: int, kernel: tuple[int, int, int]) -> tuple[int, int, int]:
    """The token lattice ``(t/kt, h/kh, w/kw)`` of a clip; a size the tubelet cannot tile fails naming it."""
    kt, kh, kw = kernel
    if t % kt or h % kh or w % kw:
        raise ValueError(
            f"video of {t} frames at {h}x{w} is not divisible by the tubelet {kt}x{kh}x{kw}; use a frame count that is a "
            f"multiple of {kt} and a resolution that is a multiple of {kh}x{kw}"
        )
    return t // kt, h // kh, w // kw


@register_notrace_function
def _tubelet_grid(tokens: torch.Tensor, num_prefix_tokens: int) -> PositionGrid:
    return PositionGrid(tuple(int(v) for v in tokens.shape[1:4]), num_prefix_tokens)


torch.fx.wrap("_as_video")  # opaque under any FX tracer (see vispe.models.layers)
torch.fx.wrap("_tubelet_grid")


#: the clip size a video ViT is built for: frame count and (H, W) (or one side), refused naming the option when bad
_INPUT_SIZE_CHECKS = {"num_frames": Int(1), "img_size": Ints(1, length=(1, 2), scalar_ok=True)}


class TubeletEmbed(nn.Module):
    """``Conv3d`` tubelet embedding: ``(B, C, T, H, W) -> (B, T/t, H/p, W/p, D)``."""

    def __init__(self, tubelet_size: int = 2, patch_size: int | Sequence[int] = 16, in_chans: int = 3, embed_dim: int = 768, bias: bool = True) -> None:
        super().__init__()
        ps = _triple(patch_size)
        ps = ps * 2 if len(ps) == 1 else ps
        if len(ps) != 2 or min(ps) < 1 or not isinstance(tubelet_size, int) or tubelet_size < 1:
            raise ValueError(f"tubelet_size must be an int >= 1 and patch_size an int or (ph, pw), got {tubelet_size!r}, {patch_size!r}")
        self.kernel = (tubelet_size, ps[0], ps[1])
        self.in_chans = in_chans
        self.proj = nn.Conv3d(in_chans, embed_dim, kernel_size=self.kernel, stride=self.kernel, bias=bias)

    def grid_for(self, t: int, h: int, w: int) -> tuple[int, int, int]:
        return tubelet_lattice(t, h, w, self.kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, C, T, H, W)`` video or ``(B, C, H, W)`` still image -> tubelet tokens ``(B, t, h, w, D)``."""
        x = _as_video(x, self.in_chans, self.kernel, self.proj.weight.dtype)
        return self.proj(x).permute(0, 2, 3, 4, 1)


class VispeVideoViT(nn.Module):
    """Video ViT (joint space-time attention) whose positional encoding is any 3D vispe encoding.

    Args:
        pos_encoding: encoding name, ``{'name': ..., **options}`` or ``(name, options)``.
        img_size: training resolution (sets the encoding's training grid; any size works later).
        num_frames: training frame count (likewise).
        tubelet_size: frames per tubelet; patch_size: spatial patch.
        num_classes, global_pool, class_token, reg_tokens, embed_dim, depth, num_heads, mlp_ratio,
        qkv_bias, qk_norm, init_values, drop_rate, pos_drop_rate, attn_drop_rate, proj_drop_rate,
        patch_drop_rate, drop_path_rate: as in timm's ``VisionTransformer`` (patch dropout drops tubelet
        tokens in training; the encoding follows the kept ones, as timm's Eva does with RoPE).
    """

    def __init__(
        self,
        pos_encoding: PosEncodingArg = "rope_axial_3d",
        img_size: int | Sequence[int] = 224,
        num_frames: int = 16,
        tubelet_size: int = 2,
        patch_size: int | Sequence[int] = 16,
        in_chans: int = 3,
        num_classes: int = 400,
        global_pool: str = "token",
        class_token: bool = True,
        reg_tokens: int = 0,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        qk_norm: bool = False,
        init_values: float | None = None,
        drop_rate: float = 0.0,
        pos_drop_rate: float = 0.0,
        attn_drop_rate: float = 0.0,
        proj_drop_rate: float = 0.0,
        patch_drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        norm_layer: type[nn.Module] | None = None,
    ) -> None:
        super().__init__()
        name, pe_kwargs = parse_pos_encoding(pos_encoding)
        enc_cls = get_encoding_class(name)  # unknown names fail before any weight is built
        if 3 not in enc_cls.grid_ndims:
            raise ValueError(f"encoding {name!r} does not take 3D (t, h, w) grids; choose one of {_list_3d()}")
        if global_pool not in ("token", "avg", ""):
            raise ValueError(f"global_pool={global_pool!r}; choose 'token', 'avg' or ''")
        if global_pool == "token" and not class_token:
            raise ValueError("global_pool='token' needs class_token=True; use global_pool='avg' without a class token")
        check_context_fields(type(self).__name__, dim_name="embed_dim", embed_dim=embed_dim, num_heads=num_heads, depth=depth)
        check_options(type(self).__name__, _INPUT_SIZE_CHECKS, {"num_frames": num_frames, "img_size": img_size})
        norm_layer = norm_layer or partial(LayerNorm, eps=1e-6)
        img = _triple(img_size)
        img = img * 2 if len(img) == 1 else img
        self.num_classes = num_classes
        self.global_pool = global_pool
        self.embed_dim = self.num_features = self.head_hidden_size = embed_dim
        self.num_prefix_tokens = int(class_token) + reg_tokens
        self.has_class_token = class_token
        self.grad_checkpointing = False

        self.patch_embed = TubeletEmbed(tubelet_size, patch_size, in_chans, embed_dim)
        self.grid_size = self.patch_embed.grid_for(num_frames, img[0], img[1])
        self.img_size, self.num_frames = tuple(img), num_frames
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if class_token else None
        self.reg_token = nn.Parameter(torch.zeros(1, reg_tokens, embed_dim)) if reg_tokens else None
        self.pos_drop = nn.Dropout(pos_drop_rate)
        self.norm_pre = nn.Identity()  # the host protocol's pre-block norm (timm's ViT has one; none here)
        if not 0.0 <= patch_drop_rate < 1.0:
            raise ValueError(f"patch_drop_rate={patch_drop_rate!r} must be in [0, 1)")
        self.patch_drop = (
            PatchDropoutWithIndices(patch_drop_rate, num_prefix_tokens=self.num_prefix_tokens) if patch_drop_rate > 0 else nn.Identity()
        )
        dpr = [x.item() for x in torch.linspace(0, drop_path_rate, depth, device="cpu")]  # also under a meta device
        self.blocks = nn.Sequential(
            *[
                PEBlock(
                    dim=embed_dim, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, qk_norm=qk_norm,
                    init_values=init_values, proj_drop=proj_drop_rate, attn_drop=attn_drop_rate, drop_path=dpr[i],
                    norm_layer=norm_layer, attn_layer=PEAttention,
                )
                for i in range(depth)
            ]
        )
        self.norm = norm_layer(embed_dim)
        # timm's feature metadata (reduction = the spatial patch size; features_only / forward_intermediates)
        self.feature_info = [dict(module=f"blocks.{i}", num_chs=embed_dim, reduction=self.patch_embed.kernel[1]) for i in range(depth)]
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()

        self.pos_encoding_name = name
        self.pos_encoding_kwargs = dict(pe_kwargs)
        context = EncodingContext(
            dim=embed_dim, num_heads=num_heads, depth=depth, grid_size=self.grid_size,
            num_prefix_tokens=self.num_prefix_tokens, in_chans=in_chans, patch_size=self.patch_embed.kernel,
        )
        self.pos_encoding = create_encoding(name, context, **pe_kwargs)
        self.init_weights()

    def init_weights(self) -> None:
        """Prefix tokens, linear layers and the patch projection (encodings own their init: ``reset_parameters``)."""
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        if self.reg_token is not None:
            nn.init.normal_(self.reg_token, std=1e-6)
        for name, m in self.named_modules():
            if name.startswith("pos_encoding"):
                continue  # encodings own their init
            if isinstance(m, nn.Linear):
                trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        w = self.patch_embed.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))

    # ------------------------------------------------------------------------------------
    def embed(self, x: torch.Tensor) -> tuple[torch.Tensor, PositionGrid]:
        """Tubelet-embed, prepend prefix tokens, apply token encodings. Returns tokens and their grid."""
        x, grid, _ = self.embed_with_state(x)
        return x, grid

    def embed_with_state(self, x: torch.Tensor) -> tuple[torch.Tensor, PositionGrid, Any]:
        """:meth:`embed` plus the encoding's per-forward state (``prepare`` first, narrowed after patch dropout)."""
        video = x
        x = self.patch_embed(x)  # (B, t, h, w, D)
        grid = _tubelet_grid(x, self.num_prefix_tokens)
        return embed_grid(self, x.flatten(1, 3), grid, video)

    def iter_blocks(self, x: torch.Tensor, grid: PositionGrid, attn_mask: torch.Tensor | None = None, state: Any = NOT_PREPARED):
        """Run the blocks, yielding ``(index, tokens)`` after each (``state`` from :meth:`embed_with_state`;
        prepared here when not given)."""
        yield from run_blocks(self.blocks, self.pos_encoding, x, grid, attn_mask, False, self.grad_checkpointing, state=state)

    def forward_features_grid(self, x: torch.Tensor) -> tuple[torch.Tensor, PositionGrid]:
        tokens, grid, state = self.embed_with_state(x)
        for _, tokens in self.iter_blocks(tokens, grid, state=state):  # noqa: B007,B020
            pass
        return self.norm(tokens), grid

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_features_grid(x)[0]

    def forward_video_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Normed lattice tokens ``(B, T', H', W', D)`` in raster order (prefix tokens dropped)."""
        feats, grid = self.forward_features_grid(x)
        return feats[:, self.num_prefix_tokens :].reshape(feats.shape[0], *grid.shape, -1)

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: int | list[int] | None = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCTHW",
        intermediates_only: bool = False,
    ) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        """timm's ``forward_intermediates`` for video: block outputs as ``'NCTHW'`` ``(B, D, T', H', W')``,
        ``'NCHW'`` (tubelets folded into the batch, ``(B*T', D, H', W')``, batch-major: per-frame maps for 2D
        heads, and what timm's ``features_only`` wrapper asks for) or ``'NLC'`` tokens."""
        if output_fmt not in ("NCTHW", "NCHW", "NLC"):
            raise ValueError(f"output_fmt={output_fmt!r}; choose 'NCTHW', 'NCHW' or 'NLC'")
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        tokens, grid, state = self.embed_with_state(x)
        intermediates = []
        for i, tokens in run_blocks(self.blocks, self.pos_encoding, tokens, grid, None, False, self.grad_checkpointing,
                                    max_index if stop_early else None, state):
            if i in take_indices:
                intermediates.append(self.norm(tokens) if norm else tokens)
        npt = self.num_prefix_tokens
        prefix = [y[:, :npt] for y in intermediates] if npt else None
        lattice = [y[:, npt:] for y in intermediates]
        if output_fmt != "NLC":
            b, (t, h, w) = tokens.shape[0], grid.shape
            maps = [y.reshape(b, t, h, w, -1) for y in lattice]
            if output_fmt == "NCTHW":
                lattice = [m.permute(0, 4, 1, 2, 3).contiguous() for m in maps]
            else:
                lattice = [m.flatten(0, 1).permute(0, 3, 1, 2).contiguous() for m in maps]
        if return_prefix_tokens and prefix is not None:
            lattice = list(zip(lattice, prefix))
        if intermediates_only:
            return lattice
        return self.norm(tokens), lattice

    def prune_intermediate_layers(self, indices: int | list[int] = 1, prune_norm: bool = False, prune_head: bool = True) -> list[int]:
        """Drop the blocks after the last wanted one (timm's API for feature extractors)."""
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        self.blocks = self.blocks[: max_index + 1]
        if prune_norm:
            self.norm = nn.Identity()
        if prune_head:
            self.reset_classifier(0, "")
        return take_indices

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.global_pool == "token":
            x = x[:, 0]
        elif self.global_pool == "avg":
            x = x[:, self.num_prefix_tokens :].mean(dim=1)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of a float video ``(B, C, T, H, W)``.

        A 4D float image ``(B, C, H, W)`` is accepted on purpose as a still clip (one tubelet of identical frames, one
        temporal position): video models take images this way and timm's generic model tests feed images. Every other
        layout (frames before channels, channels last, no batch dimension, integer pixels) is refused before any compute.
        """
        out = self.forward_head(self.forward_features(x))
        record_auxiliary_loss(self)
        return out

    # ------------------------------------------------------------------------------------
    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        self.num_classes = num_classes
        if global_pool is not None:
            self.global_pool = global_pool
        self.head = nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()

    def set_input_size(self, img_size: int | Sequence[int] | None = None, num_frames: int | None = None) -> None:
        """Change the training lattice (e.g. before fine-tuning at another size); encodings adapt their tables."""
        check_options(f"{type(self).__name__}.set_input_size", _INPUT_SIZE_CHECKS,
                      {k: v for k, v in (("num_frames", num_frames), ("img_size", img_size)) if v is not None})
        img = self.img_size if img_size is None else _triple(img_size)
        img = img * 2 if len(img) == 1 else img
        frames = self.num_frames if num_frames is None else num_frames
        self.grid_size = self.patch_embed.grid_for(frames, img[0], img[1])
        self.img_size, self.num_frames = tuple(img), frames
        self.pos_encoding.set_grid_size(self.grid_size)

    def get_classifier(self) -> nn.Module:
        return self.head

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        names = {"cls_token", "reg_token"}
        names |= {f"pos_encoding.{n}" for n in self.pos_encoding.no_weight_decay()}
        return names

    def auxiliary_loss(self) -> torch.Tensor | None:
        """The training regularisers of this model's modules (the positional encoding's, e.g. SeqPE's; ``None`` if
        none has one), as :func:`vispe.models.layers.auxiliary_loss` finds them; recorded inside the training
        forward (sharded training)."""
        return auxiliary_loss(self)


def _list_3d() -> list[str]:
    from ..encodings import list_encodings

    return list_encodings(grid_ndim=3)


# ----------------------------------------------------------------------------------------
# timm registration
# ----------------------------------------------------------------------------------------

KINETICS_MEAN, KINETICS_STD = (0.45, 0.45, 0.45), (0.225, 0.225, 0.225)


def _cfg(**kwargs: Any) -> dict[str, Any]:
    return {
        "url": "",
        "num_classes": 400,
        "input_size": (3, 224, 224),  # per frame; timm's cfg holds (C, H, W) only
        "pool_size": None,
        "crop_pct": 1.0,
        "interpolation": "bilinear",
        "fixed_input_size": False,
        "mean": KINETICS_MEAN,
        "std": KINETICS_STD,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
        "license": "apache-2.0",
        **kwargs,
    }


default_cfgs = generate_default_cfgs(
    {
        "vispe_video_vit_tiny_patch16_224.untrained": _cfg(),
        "vispe_video_vit_small_patch16_224.untrained": _cfg(),
        "vispe_video_vit_nano_patch8_64.untrained": _cfg(num_classes=10, input_size=(3, 64, 64)),
    }
)


def _create_video_vit(variant: str, pretrained: bool = False, **kwargs: Any) -> VispeVideoViT:
    out_indices = kwargs.pop("out_indices", 3)
    return build_model_with_cfg(
        VispeVideoViT, variant, pretrained, pretrained_strict=kwargs.pop("pretrained_strict", False),
        feature_cfg=dict(out_indices=out_indices, feature_cls="getter"), **kwargs,
    )


@register_model
def vispe_video_vit_tiny_patch16_224(pretrained: bool = False, **kwargs: Any) -> VispeVideoViT:
    """Video ViT-Ti: 192 wide, 12 blocks, 3 heads, tubelet 2x16x16, 16 frames at 224."""
    args = dict(img_size=224, num_frames=16, tubelet_size=2, patch_size=16, embed_dim=192, depth=12, num_heads=3)
    return _create_video_vit("vispe_video_vit_tiny_patch16_224", pretrained, **dict(args, **kwargs))


@register_model
def vispe_video_vit_small_patch16_224(pretrained: bool = False, **kwargs: Any) -> VispeVideoViT:
    """Video ViT-S: 384 wide, 12 blocks, 6 heads, tubelet 2x16x16, 16 frames at 224."""
    args = dict(img_size=224, num_frames=16, tubelet_size=2, patch_size=16, embed_dim=384, depth=12, num_heads=6)
    return _create_video_vit("vispe_video_vit_small_patch16_224", pretrained, **dict(args, **kwargs))


@register_model
def vispe_video_vit_nano_patch8_64(pretrained: bool = False, **kwargs: Any) -> VispeVideoViT:
    """CPU-sized video ViT: 96 wide, 4 blocks, 3 heads (head_dim 32), tubelet 2x8x8, 8 frames at 64x64."""
    args = dict(img_size=64, num_frames=8, tubelet_size=2, patch_size=8, embed_dim=96, depth=4, num_heads=3)
    return _create_video_vit("vispe_video_vit_nano_patch8_64", pretrained, **dict(args, **kwargs))
