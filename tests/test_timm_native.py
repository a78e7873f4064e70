"""timm's own model checks (pytorch-image-models ``tests/test_models.py``), CI-sized, over every registered
``vispe_*`` model and every encoding: forward / backward, default-cfg conventions, forward_features and
forward_intermediates, ``features_only``, and FX tracing (forward equals eager, backward reaches every
parameter). TorchScript is not supported (encodings keep Python state: grids, cached tables).

The full timm file also passes over the ``vispe_*`` models when vispe's model names are added to its
ViT-family lists (see README, "timm-native").
"""
from __future__ import annotations

import pytest
import timm
import torch
from timm.layers import get_notrace_functions, get_notrace_modules
from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

import vispe  # noqa: F401  (registers the vispe_* models)
from vispe import list_encodings

IMAGE_MODELS = [n for n in timm.list_models("vispe_vit_*")]
VIDEO_MODELS = [n for n in timm.list_models("vispe_video_vit_*")]
# timm's test sizes are 128-384 px on 12-block models; CI-sized here: 2 blocks, small inputs
TINY = dict(depth=2)


def _input(model: torch.nn.Module, batch: int = 2, side: int = 32) -> torch.Tensor:
    c, h, w = model.pretrained_cfg["input_size"]
    side = min(side, h)
    return torch.randn(batch, c, side, side)


def _fx(model: torch.nn.Module) -> torch.nn.Module:
    """Trace like timm's ``_create_fx_model``: its tracer (notrace functions / modules), the output node."""
    kw = dict(leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions(), param_shapes_constant=True)
    train_nodes, eval_nodes = get_graph_node_names(model, tracer_kwargs=kw)
    return create_feature_extractor(model, train_return_nodes=[train_nodes[-1]], eval_return_nodes=[eval_nodes[-1]], tracer_kwargs=kw)


def _check_fx(model: torch.nn.Module, x: torch.Tensor) -> None:
    model.eval()
    with torch.inference_mode():
        ref = model(x)
        traced = _fx(model)
        out = torch.cat(tuple(traced(x).values()))
    assert torch.equal(out, ref)
    model.train()
    traced = _fx(model)
    out = torch.cat(tuple(traced(x).values()))
    out.mean().backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"no gradient through the FX graph for {missing}"


@pytest.mark.parametrize("name", IMAGE_MODELS + VIDEO_MODELS)
def test_forward_backward_and_default_cfg(name):
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, **TINY)
    x = _input(model)
    out = model(x)
    assert out.shape == (2, model.num_classes) and torch.isfinite(out).all()
    out.mean().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    model.eval()
    assert model.num_features > 0 and model.head_hidden_size > 0
    feats = model.forward_features(x)
    assert feats.ndim == 3 and feats.shape[-1] == model.num_features  # NLC, like timm's ViTs
    pre = model.forward_head(feats, pre_logits=True)
    assert pre.shape == (2, model.head_hidden_size)
    model.reset_classifier(0)
    assert model.num_classes == 0 and model(x).shape == pre.shape
    model.reset_classifier(0, "")
    assert model(x).shape == feats.shape  # no pooling: tokens
    cfg = model.pretrained_cfg
    sd = model.state_dict()
    assert cfg["first_conv"] + ".weight" in sd
    assert timm.data.resolve_data_config({}, model=model)["input_size"] == cfg["input_size"]


@pytest.mark.parametrize("name", IMAGE_MODELS + VIDEO_MODELS)
def test_forward_intermediates_and_features_only(name):
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, **TINY).eval()
    x = _input(model, batch=1)
    with torch.no_grad():
        final, inter = model.forward_intermediates(x, output_fmt="NCHW")
        assert torch.allclose(final, model.forward_features(x))
        reduction = model.feature_info[0]["reduction"]
        assert len(inter) == len(model.blocks)
        assert all(t.shape == (1, model.num_features, x.shape[-2] // reduction, x.shape[-1] // reduction) for t in inter)
    feat = timm.create_model(name, pretrained=False, features_only=True, out_indices=(0, 1), **TINY).eval()
    with torch.no_grad():
        maps = feat(x)
    assert [m.shape[1] for m in maps] == feat.feature_info.channels()
    assert all(torch.isfinite(m).all() for m in maps)


@pytest.mark.parametrize("name", IMAGE_MODELS + VIDEO_MODELS)
@pytest.mark.slow
def test_fx_trace_of_registered_model(name):
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, **TINY)
    _check_fx(model, _input(model))


@pytest.mark.parametrize("pe", list_encodings(grid_ndim=2))
@pytest.mark.slow
def test_fx_trace_with_every_2d_encoding(pe):
    torch.manual_seed(0)
    model = timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding=pe, depth=2, embed_dim=64, num_heads=4, num_classes=5)
    _check_fx(model, torch.randn(2, 3, 24, 40))


@pytest.mark.parametrize("pe", [n for n in list_encodings(grid_ndim=3) if n not in list_encodings(grid_ndim=2)])
@pytest.mark.slow
def test_fx_trace_with_every_3d_encoding(pe):
    torch.manual_seed(0)
    model = timm.create_model("vispe_video_vit_nano_patch8_64", pos_encoding=pe, depth=2, num_classes=5, img_size=32, num_frames=4)
    _check_fx(model, torch.randn(2, 3, 4, 32, 32))
