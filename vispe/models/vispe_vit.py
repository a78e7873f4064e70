"""timm's VisionTransformer with a pluggable positional encoding, registered in timm as ``vispe_vit_*``.

``VispeVisionTransformer(pos_encoding='rope_mixed', ...)`` keeps every timm parameter name and
every timm feature (``dynamic_img_size``, ``forward_intermediates`` / ``features_only``,
``set_input_size``, ``reset_classifier``, grad checkpointing); the encoding is driven through
the hooks of :class:`vispe.encodings.PositionalEncoding`, so the model never looks at its name.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Union

import torch
import torch.fx
from timm.layers import PatchDropoutWithIndices, register_notrace_function, to_2tuple
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models._features import feature_take_indices
from timm.models.vision_transformer import VisionTransformer

from ..encodings import EncodingContext, PositionGrid, create_encoding, get_encoding_class
from ..encodings.base import check_context_fields
from ..encodings.spec import PosEncodingArg, parse_pos_encoding
from .checkpoint import timm_checkpoint_filter
from .layers import NOT_PREPARED, PEAttention, PEBlock, auxiliary_loss, embed_grid, record_auxiliary_loss, run_blocks
from .naflex import GroupedEncoding, embed_naflex, forward_naflex_blocks, naflex_pool, parse_naflex_input

__all__ = ["VispeVisionTransformer", "parse_pos_encoding"]  # parse_pos_encoding: re-exported from vispe.encodings.spec


@register_notrace_function
def _check_image_input(
    x: torch.Tensor, patch_size: Tuple[int, int], img_size: Tuple[int, int], dynamic_pad: bool, dynamic_size: bool, in_chans: int = -1,
    weight_dtype: Optional[torch.dtype] = None,
) -> None:
    """Fail early, naming the shape, on an input the patch cannot tile or the model cannot take: rank, channels
    (channels-last and batch-less images are named as such), dtype, size.

    The checks branch on the input's shape, so they are one opaque node under FX tracing."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"image input x must be a torch.Tensor (B, C, H, W), got {type(x).__name__}")
    shape = tuple(x.shape)
    if x.ndim == 3 and shape[0] == in_chans:
        raise ValueError(f"image input x has shape {shape}, no batch dimension; expected (B, C={in_chans}, H, W): use x.unsqueeze(0)")
    if x.ndim == 4 and in_chans > 0 and shape[1] != in_chans and shape[-1] == in_chans:
        raise ValueError(f"image input x has shape {shape}, channels last; expected (B, C={in_chans}, H, W): use x.permute(0, 3, 1, 2)")
    if x.ndim != 4 or (in_chans > 0 and shape[1] != in_chans):
        raise ValueError(f"image input x has shape {shape}; expected (B, C={in_chans}, H, W) with C equal to the model's in_chans")
    if not x.is_floating_point():
        raise TypeError(f"image input x has dtype {x.dtype}; expected a floating-point tensor (e.g. x.float() / 255, then normalise)")
    if weight_dtype is not None and x.dtype != weight_dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(f"image input x has dtype {x.dtype}, the model's weights {weight_dtype}; convert with x.to({weight_dtype}) or run under torch.autocast")
    if shape[0] == 0 or 0 in shape[2:]:
        raise ValueError(f"image input x has shape {shape}: the batch and spatial sizes must be non-zero")
    h, w = x.shape[-2:]
    ph, pw = patch_size
    if not dynamic_pad and (h % ph or w % pw):
        raise ValueError(
            f"input size {h}x{w} is not divisible by the patch size {ph}x{pw}; resize to a multiple "
            f"or build the model with dynamic_img_pad=True"
        )
    if not dynamic_size and (h, w) != tuple(img_size):
        raise ValueError(
            f"input size {h}x{w} differs from the model's img_size {tuple(img_size)}; build the model with "
            f"dynamic_img_size=True or call set_input_size()"
        )


@register_notrace_function
def _check_attn_mask(attn_mask: Optional[torch.Tensor], x: torch.Tensor, num_heads: int) -> None:
    """An attention mask must broadcast to ``(B, num_heads, N, N)`` for the N tokens the blocks see (prefix tokens included)."""
    if attn_mask is None:
        return
    b, n = x.shape[:2]
    target = (b, num_heads, n, n)
    ok = attn_mask.ndim >= 2 and tuple(attn_mask.shape[-2:]) == (n, n)
    if ok:
        try:
            ok = torch.broadcast_shapes(tuple(attn_mask.shape), target) == target
        except RuntimeError:
            ok = False
    if not ok:
        raise ValueError(f"attn_mask has shape {tuple(attn_mask.shape)}; it must broadcast to (B, num_heads, N, N) = {target} "
                         f"(N counts the prefix tokens)")


@register_notrace_function
def _patch_grid(patch_embed: torch.nn.Module, patches: torch.Tensor, image: torch.Tensor, num_prefix_tokens: int) -> PositionGrid:
    """The lattice of the patch tokens (NHWC patches carry it; flattened ones get it from the image size)."""
    if patches.ndim == 4:
        grid_hw = tuple(int(v) for v in patches.shape[1:3])
    else:
        grid_hw = tuple(int(v) for v in patch_embed.dynamic_feat_size(image.shape[-2:]))
    return PositionGrid(grid_hw, num_prefix_tokens)


for _fn in ("_check_image_input", "_check_attn_mask", "_patch_grid"):
    torch.fx.wrap(_fn)  # opaque under any FX tracer (see vispe.models.layers)


class VispeVisionTransformer(VisionTransformer):
    """A timm ``VisionTransformer`` whose positional encoding is any registered vispe encoding.

    Args:
        pos_encoding: encoding name (see :func:`vispe.list_encodings`), a mapping
            ``{'name': ..., **options}``, or ``(name, options)``.
        **kwargs: timm ``VisionTransformer`` arguments (``pos_embed`` must stay unset: the
            encoding replaces it).
    """

    def __init__(self, pos_encoding: PosEncodingArg = "learned", **kwargs: Any) -> None:
        name, pe_kwargs = parse_pos_encoding(pos_encoding)
        get_encoding_class(name)  # unknown names fail before any weight is built
        if kwargs.get("pos_embed", "none") not in ("none", "", None):
            raise ValueError(
                f"pos_embed={kwargs['pos_embed']!r} is timm's own APE switch; vispe models take pos_encoding= instead "
                f"(e.g. pos_encoding='learned')"
            )
        kwargs["pos_embed"] = "none"
        sizes = {k: kwargs[k] for k in ("embed_dim", "num_heads", "depth") if k in kwargs}
        check_context_fields(type(self).__name__, dim_name="embed_dim", **sizes)  # before timm divides by num_heads
        img_size = to_2tuple(kwargs.get("img_size", 224))
        patch_size = to_2tuple(kwargs.get("patch_size", 16))
        if not kwargs.get("dynamic_img_pad", False) and (img_size[0] % patch_size[0] or img_size[1] % patch_size[1]):
            raise ValueError(
                f"img_size={img_size} is not divisible by patch_size={patch_size}; choose a multiple of the patch size "
                f"or pass dynamic_img_pad=True"
            )
        kwargs.setdefault("block_fn", PEBlock)
        kwargs.setdefault("attn_layer", PEAttention)
        super().__init__(**kwargs)
        self.pos_encoding_name = name
        self.pos_encoding_kwargs = dict(pe_kwargs)
        context = EncodingContext(
            dim=self.embed_dim,
            num_heads=self.blocks[0].attn.num_heads if len(self.blocks) else 1,
            depth=len(self.blocks),
            grid_size=tuple(self.patch_embed.grid_size),
            num_prefix_tokens=self.num_prefix_tokens,
            in_chans=self.patch_embed.proj.in_channels,
            patch_size=tuple(self.patch_embed.patch_size),
        )
        self.pos_encoding = create_encoding(name, context, **pe_kwargs)
        if kwargs.get("patch_drop_rate", 0.0) > 0:
            if not self.pos_encoding.supports_token_dropout:
                raise ValueError(f"patch_drop_rate > 0 drops tokens, which encoding {name!r} cannot follow; set patch_drop_rate=0")
            # as timm's Eva: the kept indices go to the encoding, which narrows its tables to them
            self.patch_drop = PatchDropoutWithIndices(kwargs["patch_drop_rate"], num_prefix_tokens=self.num_prefix_tokens)

    # ------------------------------------------------------------------------------------
    def embed(self, x: torch.Tensor) -> tuple[torch.Tensor, PositionGrid]:
        """Patchify, prepend prefix tokens, apply token encodings. Returns tokens and their grid."""
        x, grid, _ = self.embed_with_state(x)
        return x, grid

    def embed_with_state(self, x: torch.Tensor) -> tuple[torch.Tensor, PositionGrid, Any]:
        """:meth:`embed` plus the encoding's per-forward state: ``prepare`` runs first, its state feeds
        ``embed_tokens``, is narrowed after patch dropout and is what every block receives."""
        image = x
        pe_ = self.patch_embed
        _check_image_input(x, tuple(pe_.patch_size), tuple(pe_.img_size), pe_.dynamic_img_pad, self.dynamic_img_size, pe_.proj.in_channels,
                           pe_.proj.weight.dtype)
        x = self.patch_embed(x)
        grid = _patch_grid(self.patch_embed, x, image, self.num_prefix_tokens)
        if not self.patch_embed.flatten:  # NHWC patches (timm's dynamic_img_size mode)
            x = x.flatten(1, 2)
        return embed_grid(self, x, grid, image)

    def iter_blocks(
        self,
        x: torch.Tensor,
        grid: PositionGrid,
        attn_mask: Optional[torch.Tensor] = None,
        is_causal: bool = False,
        last_index: Optional[int] = None,
        state: Any = NOT_PREPARED,
    ):
        """Run the blocks, yielding ``(index, tokens)`` after each (``state`` from :meth:`embed_with_state`;
        prepared here when not given)."""
        _check_attn_mask(attn_mask, x, self.blocks[0].attn.num_heads if len(self.blocks) else 1)
        yield from run_blocks(self.blocks, self.pos_encoding, x, grid, attn_mask, is_causal, self.grad_checkpointing, last_index, state)

    def forward_features(
        self, x: torch.Tensor, attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
        patch_coord: Optional[torch.Tensor] = None, patch_valid: Optional[torch.Tensor] = None,
    ) -> Union[torch.Tensor, Dict[str, torch.Tensor]]:
        """timm's ``forward_features``; a mixed-resolution batch (see :meth:`forward`) gives timm NaFlexViT's
        dict ``{'patches', 'patch_valid'}`` (:meth:`forward_features_naflex`)."""
        naflex = parse_naflex_input(x, patch_coord, patch_valid)
        if naflex is not None:
            if attn_mask is not None or is_causal:
                raise ValueError("a mixed-resolution (NaFlex) batch builds its own key-padding mask; attn_mask / is_causal cannot be given")
            return self.forward_features_naflex(*naflex)
        x, grid, state = self.embed_with_state(x)
        for _, x in self.iter_blocks(x, grid, attn_mask, is_causal, state=state):
            pass
        return self.norm(x)

    def forward_intermediates(
        self,
        x: torch.Tensor,
        indices: Optional[Union[int, List[int]]] = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
        output_dict: bool = False,
        attn_mask: Optional[torch.Tensor] = None,
        is_causal: bool = False,
    ) -> Union[List[torch.Tensor], Tuple[torch.Tensor, List[torch.Tensor]], Dict[str, Any]]:
        """timm's ``forward_intermediates`` with the encoding applied in every block."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"output_fmt={output_fmt!r}; choose 'NCHW' or 'NLC'")
        take_indices, max_index = feature_take_indices(len(self.blocks), indices)
        B = x.shape[0]
        x, grid, state = self.embed_with_state(x)
        intermediates = []
        last = max_index if stop_early else None
        for i, x in self.iter_blocks(x, grid, attn_mask, is_causal, last_index=last, state=state):
            if i in take_indices:
                intermediates.append(self.norm(x) if norm else x)
        npt = self.num_prefix_tokens
        prefix_tokens = [y[:, :npt] for y in intermediates] if npt else None
        if npt:
            intermediates = [y[:, npt:] for y in intermediates]
        if output_fmt == "NCHW":
            H, W = grid.shape
            intermediates = [y.reshape(B, H, W, -1).permute(0, 3, 1, 2).contiguous() for y in intermediates]
        if output_dict:
            out: Dict[str, Any] = {"image_intermediates": intermediates}
            if prefix_tokens is not None and return_prefix_tokens:
                out["image_intermediates_prefix"] = prefix_tokens
            if not intermediates_only:
                out["image_features"] = self.norm(x)
            return out
        if return_prefix_tokens and prefix_tokens is not None:
            intermediates = list(zip(intermediates, prefix_tokens))
        if intermediates_only:
            return intermediates
        return self.norm(x), intermediates

    # -- mixed-resolution (NaFlex) batches ------------------------------------------------------
    def embed_naflex(
        self, patches: Union[torch.Tensor, List[torch.Tensor]], patch_coord: Optional[torch.Tensor] = None,
        patch_valid: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, GroupedEncoding]:
        """:meth:`embed_with_state` for a batch whose images have different grids (see :mod:`vispe.models.naflex`):
        padded NaFlex patches ``(B, N, P*P*C)`` with ``patch_coord`` / ``patch_valid``, or a list of ``(C, H, W)``
        images. Each group of samples sharing a grid is embedded exactly as a plain batch of that grid (the
        encoding prepared for that grid); returns the padded tokens ``(B, S + N, D)`` and the per-group binding
        the blocks run the encoding through."""
        return embed_naflex(self, patches, patch_coord, patch_valid)

    def forward_features_naflex(
        self, patches: Union[torch.Tensor, List[torch.Tensor]], patch_coord: Optional[torch.Tensor] = None,
        patch_valid: Optional[torch.Tensor] = None,
    ) -> Dict[str, torch.Tensor]:
        """Blocks over a mixed-resolution batch. Returns timm NaFlexViT's dict: ``patches`` (normalised tokens
        ``(B, S + N, D)``, prefix first, padding rows at the end of each sample) and ``patch_valid`` ``(B, N)``."""
        x, grouped = self.embed_naflex(patches, patch_coord, patch_valid)
        x = forward_naflex_blocks(self.blocks, x, grouped, self.grad_checkpointing)
        return {"patches": self.norm(x), "patch_valid": grouped.token_valid(x.device)[:, self.num_prefix_tokens:]}

    def pool(self, x: torch.Tensor, pool_type: Optional[str] = None, patch_valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """timm's pooling; with ``patch_valid`` (a mixed-resolution batch) padding tokens are left out."""
        if patch_valid is None:
            return super().pool(x, pool_type)
        return naflex_pool(self, x, patch_valid, pool_type)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False, patch_valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.pool(x, patch_valid=patch_valid)
        x = self.fc_norm(x)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(
        self,
        x: Union[torch.Tensor, Dict[str, torch.Tensor], List[torch.Tensor]],
        attn_mask: Optional[torch.Tensor] = None,
        is_causal: bool = False,
        patch_coord: Optional[torch.Tensor] = None,
        patch_valid: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """timm's forward for ``(B, C, H, W)`` images; a mixed-resolution batch -- timm NaFlexViT's dict
        (``patches``, ``patch_coord``, ``patch_valid``), padded ``patches`` with ``patch_coord`` / ``patch_valid``,
        or a list of ``(C, H, W)`` images of different sizes -- runs each sample on its own grid."""
        features = self.forward_features(x, attn_mask, is_causal, patch_coord, patch_valid)
        if isinstance(features, dict):
            out = self.forward_head(features["patches"], patch_valid=features["patch_valid"])
        else:
            out = self.forward_head(features)
        record_auxiliary_loss(self)
        return out

    def set_input_size(self, img_size: Optional[Tuple[int, int]] = None, patch_size: Optional[Tuple[int, int]] = None) -> None:
        super().set_input_size(img_size=img_size, patch_size=patch_size)
        self.pos_encoding.set_grid_size(tuple(self.patch_embed.grid_size))

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        names = set(super().no_weight_decay())
        names |= {f"pos_encoding.{n}" for n in self.pos_encoding.no_weight_decay()}
        return names

    def auxiliary_loss(self) -> Optional[torch.Tensor]:
        """The training regularisers of this model's modules (the positional encoding's, e.g. SeqPE's; ``None`` if
        none has one), as :func:`vispe.models.layers.auxiliary_loss` finds them; recorded inside the training
        forward (sharded training)."""
        return auxiliary_loss(self)


# ----------------------------------------------------------------------------------------
# timm registration
# ----------------------------------------------------------------------------------------

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def _cfg(**kwargs: Any) -> Dict[str, Any]:
    return {
        "url": "",
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "pool_size": None,
        "crop_pct": 0.9,
        "interpolation": "bicubic",
        "fixed_input_size": False,
        "mean": IMAGENET_MEAN,
        "std": IMAGENET_STD,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
        "license": "apache-2.0",
        **kwargs,
    }


_small_image_cfg = dict(num_classes=10, input_size=(3, 32, 32), crop_pct=1.0, mean=CIFAR_MEAN, std=CIFAR_STD)

default_cfgs = generate_default_cfgs(
    {
        "vispe_vit_tiny_patch16_224.untrained": _cfg(),
        "vispe_vit_small_patch16_224.untrained": _cfg(),
        "vispe_vit_base_patch16_224.untrained": _cfg(),
        "vispe_vit_tiny_patch4_32.untrained": _cfg(**_small_image_cfg),
        "vispe_vit_small_patch4_32.untrained": _cfg(**_small_image_cfg),
    }
)


def _create_vispe_vit(variant: str, pretrained: bool = False, **kwargs: Any) -> VispeVisionTransformer:
    out_indices = kwargs.pop("out_indices", 3)
    kwargs.setdefault("dynamic_img_size", True)  # resolution changes are the point of vispe
    strict = kwargs.pop("pretrained_strict", False)
    return build_model_with_cfg(
        VispeVisionTransformer,
        variant,
        pretrained,
        pretrained_filter_fn=timm_checkpoint_filter,
        pretrained_strict=strict,
        feature_cfg=dict(out_indices=out_indices, feature_cls="getter"),
        **kwargs,
    )


@register_model
def vispe_vit_tiny_patch16_224(pretrained: bool = False, **kwargs: Any) -> VispeVisionTransformer:
    """ViT-Ti/16 (192 wide, 12 blocks, 3 heads) with a pluggable ``pos_encoding``."""
    args = dict(patch_size=16, embed_dim=192, depth=12, num_heads=3)
    return _create_vispe_vit("vispe_vit_tiny_patch16_224", pretrained, **dict(args, **kwargs))


@register_model
def vispe_vit_small_patch16_224(pretrained: bool = False, **kwargs: Any) -> VispeVisionTransformer:
    """ViT-S/16 (384 wide, 12 blocks, 6 heads) with a pluggable ``pos_encoding``."""
    args = dict(patch_size=16, embed_dim=384, depth=12, num_heads=6)
    return _create_vispe_vit("vispe_vit_small_patch16_224", pretrained, **dict(args, **kwargs))


@register_model
def vispe_vit_base_patch16_224(pretrained: bool = False, **kwargs: Any) -> VispeVisionTransformer:
    """ViT-B/16 (768 wide, 12 blocks, 12 heads) with a pluggable ``pos_encoding``."""
    args = dict(patch_size=16, embed_dim=768, depth=12, num_heads=12)
    return _create_vispe_vit("vispe_vit_base_patch16_224", pretrained, **dict(args, **kwargs))


@register_model
def vispe_vit_tiny_patch4_32(pretrained: bool = False, **kwargs: Any) -> VispeVisionTransformer:
    """ViT-Ti-class model for 32-px images: patch 4 (8x8 grid), 192 wide, 12 blocks, 3 heads."""
    args = dict(img_size=32, patch_size=4, embed_dim=192, depth=12, num_heads=3)
    return _create_vispe_vit("vispe_vit_tiny_patch4_32", pretrained, **dict(args, **kwargs))


@register_model
def vispe_vit_small_patch4_32(pretrained: bool = False, **kwargs: Any) -> VispeVisionTransformer:
    """ViT-S-class model for 32-px images: patch 4 (8x8 grid), 384 wide, 12 blocks, 6 heads."""
    args = dict(img_size=32, patch_size=4, embed_dim=384, depth=12, num_heads=6)
    return _create_vispe_vit("vispe_vit_small_patch4_32", pretrained, **dict(args, **kwargs))
