"""Meta-device builds, the way FSDP2 and large-model recipes make models: ``with torch.device('meta')`` ->
``to_empty`` -> a state dict, or in-place init (:func:`vispe.models.init_empty_weights`). For every registered
encoding (2D in the image ViT, 3D in the video ViT, every multimodal scheme in the video-LLM), both must give the
model a normal build gives: no derived table may be left with the undefined contents ``to_empty`` gives."""
from __future__ import annotations

import pytest
import timm
import torch

import vispe  # noqa: F401  (registers the models)
from vispe.encodings import list_encodings
from vispe.models import init_empty_weights
from vispe.models.video_llm import VideoLLM
from vispe.positions import NUM_COORDS

ENCODINGS_2D = list_encodings(grid_ndim=2)
ENCODINGS_3D = [n for n in list_encodings(grid_ndim=3) if n not in ENCODINGS_2D]


def _image(name):
    return timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding=name, depth=2, num_classes=5, img_size=16)


def _video(name):
    return timm.create_model("vispe_video_vit_nano_patch8_64", pos_encoding=name, depth=1, num_classes=3, img_size=16, num_frames=4)


def _llm(scheme):
    return VideoLLM(vocab_size=40, dim=32, depth=2, num_heads=4, pos_scheme=scheme)


def _input(kind):
    g = torch.Generator().manual_seed(1)
    if kind == "image":
        return torch.randn(2, 3, 16, 16, generator=g)
    if kind == "video":
        return torch.randn(1, 3, 4, 16, 16, generator=g)
    return torch.randint(0, 40, (2, 7), generator=g)


def _out(model, x):
    with torch.no_grad():
        out = model(x)
    return getattr(out, "logits", out)


def _garbage(model):
    """What ``to_empty`` may leave: fill every tensor with NaN / huge integers so nothing passes by luck."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            t.fill_(float("nan") if t.is_floating_point() else 2**40 if t.dtype == torch.int64 else 1)
    return model


CASES = [("image", n) for n in ENCODINGS_2D] + [("video", n) for n in ENCODINGS_3D] + [("llm", s) for s in NUM_COORDS]
BUILD = {"image": _image, "video": _video, "llm": _llm}


@pytest.mark.parametrize("kind,name", CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_meta_build_then_state_dict_equals_the_eager_model(kind, name):
    torch.manual_seed(0)
    ref = BUILD[kind](name).eval()
    with torch.device("meta"):
        model = BUILD[kind](name)
    model = _garbage(model.to_empty(device="cpu")).eval()
    model.load_state_dict(ref.state_dict(), strict=True)
    x = _input(kind)
    torch.testing.assert_close(_out(model, x), _out(ref, x), rtol=0, atol=0)
    if kind == "llm":  # the tied head is tied again (to_empty untied it)
        assert model.lm_head.weight is model.tok_embed.weight


@pytest.mark.parametrize("kind,name", CASES, ids=[f"{k}-{n}" for k, n in CASES])
def test_meta_build_then_init_gives_a_consistent_finite_model(kind, name):
    """Without a state dict: init in place; every derived table then agrees with the parameters (a normal build
    loading those parameters gives the same outputs) and nothing is left undefined."""
    with torch.device("meta"):
        model = BUILD[kind](name)
    model = init_empty_weights(_garbage(model.to_empty(device="cpu"))).eval()
    for key, t in model.state_dict().items():
        if t.is_floating_point():
            assert torch.isfinite(t).all(), f"{name}: {key} left uninitialised"
    fresh = BUILD[kind](name).eval()
    fresh.load_state_dict(model.state_dict(), strict=True)
    x = _input(kind)
    out = _out(model, x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, _out(fresh, x), rtol=0, atol=0)
    if kind == "llm":
        assert model.lm_head.weight is model.tok_embed.weight
