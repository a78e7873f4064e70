"""Tiny host models for registry-wide tests: the model family that hosts an encoding, inputs at three grids, and
one training step's loss (shared by tests/test_encoding_contracts.py and tests/test_mixed_precision.py)."""
from __future__ import annotations

from typing import Any, Callable

import timm
import torch

from vispe.encodings import get_encoding_class
from vispe.models.video_llm import VideoLLM
from vispe.models.video_vit import VispeVideoViT
from vispe.positions import SCHEMES

#: encodings whose host is the video-LLM (a multimodal position scheme), with the schemes' evaluation options
MULTIMODAL = list(SCHEMES)
SCHEME_OPTS = {"hope": dict(gamma=0.75), "v2pe": dict(delta=0.25)}


def image_model(name: Any, **kw: Any) -> torch.nn.Module:
    """A 2-block ViT at 32 px, patch 4 (an 8x8 training grid)."""
    return timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding=name, depth=2, embed_dim=64, num_heads=4, num_classes=5, **kw)


def video_model(name: Any, **kw: Any) -> torch.nn.Module:
    """A 2-block video ViT: 4 frames of 32 px, tubelet 2x8x8 (a 2x4x4 training lattice)."""
    return VispeVideoViT(pos_encoding=name, embed_dim=48, depth=2, num_heads=2, img_size=32, num_frames=4, tubelet_size=2,
                         patch_size=8, num_classes=5, **kw)


def is_image(name: str) -> bool:
    return 2 in get_encoding_class(name).grid_ndims


def host_model(name: str, **kw: Any) -> torch.nn.Module:
    """The image ViT for an encoding that takes 2D grids, else the video ViT."""
    return image_model(name, **kw) if is_image(name) else video_model(name, **kw)


def three_grids(name: str) -> list[tuple[int, ...]]:
    """Input shapes at the training grid, a larger one and a non-square smaller one."""
    if is_image(name):
        return [(2, 3, 32, 32), (2, 3, 48, 48), (2, 3, 24, 40)]
    return [(1, 3, 4, 32, 32), (1, 3, 8, 48, 48), (2, 3, 2, 24, 40)]


def step_loss(name: str, seed: int = 0) -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
    """(model, loss closure) for one training step of the model family that hosts ``name``."""
    torch.manual_seed(seed)
    if name in MULTIMODAL:
        model = VideoLLM(vocab_size=40, dim=64, depth=2, num_heads=4, pos_scheme=name, visual_dim=24, spatial_merge_size=2,
                         position_kwargs=SCHEME_OPTS.get(name))
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 40, (12,), generator=g)
        vis = torch.randn(2, 4, 4, 24, generator=g)
        batch = model.pack([[ids[:4], vis, ids[4:]]])
        return model, lambda: model.forward_batch(batch, labels=batch.token_ids).loss
    if is_image(name):
        model, x = image_model(name), torch.randn(2, 3, 32, 48)
    else:
        model, x = video_model(name), torch.randn(2, 3, 4, 32, 32)
    y = torch.tensor([1, 3])
    return model, lambda: torch.nn.functional.cross_entropy(model(x).float(), y)


def pe_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad and ("pos_encoding" in n or "rope" in n.lower())]


def check_grads(model: torch.nn.Module, when: str = "") -> None:
    """Every gradient finite, and every encoding parameter got one."""
    for n, p in model.named_parameters():
        if p.grad is not None:
            assert torch.isfinite(p.grad).all(), f"non-finite gradient in {n}"
    for n, p in pe_params(model):
        assert p.grad is not None, f"encoding parameter {n} got no gradient {when}".strip()
