"""timm-compatible models that take vispe positional encodings (registered in timm on import)."""
from .checkpoint import (
    LoadReport, adapt_timm_state_dict, load_released_loope, load_released_seqpe, load_timm_checkpoint, timm_checkpoint_filter,
)
from .layers import LayerPE, PEAttention, PEBlock, auxiliary_loss, embed_grid, run_blocks
from .materialize import init_empty_weights
from .naflex import patchify_images
from .vispe_vit import VispeVisionTransformer, parse_pos_encoding
from . import video_vit, video_llm  # noqa: F401,E402  (registers vispe_video_vit_* in timm)

__all__ = [
    "LoadReport",
    "adapt_timm_state_dict",
    "load_timm_checkpoint",
    "load_released_loope",
    "load_released_seqpe",
    "timm_checkpoint_filter",
    "init_empty_weights",
    "LayerPE",
    "PEAttention",
    "PEBlock",
    "auxiliary_loss",
    "embed_grid",
    "run_blocks",
    "patchify_images",
    "VispeVisionTransformer",
    "parse_pos_encoding",
]
