"""timm checkpoints into vispe models: ViT / DeiT / DeiT-III and Eva RoPE ViTs, with exact logits where the
encodings match, a report that accounts for every key, and the same result through timm's factory."""
from __future__ import annotations

import pytest
import timm
import torch

import vispe  # noqa: F401  (registers the vispe_* models)
from vispe.models import load_timm_checkpoint

SMALL = dict(depth=2, img_size=64)


def _randomise_scales(model: torch.nn.Module) -> None:
    """Eva inits layer scale at 1e-5 and RoPE-Mixed freqs to a fixed pattern: make both matter for the logits."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("gamma_1", "gamma_2", "ls1.gamma", "ls2.gamma")):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif n == "rope.freqs":
                p.mul_(0.5 + torch.rand(p.shape, generator=g))
            elif n == "head.weight":  # timm's head init gives ~1e-3 logits: scale them to O(1) so 1e-5 is a real bound
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)


def _eva(name: str, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    eva = timm.create_model(name, pretrained=False, dynamic_img_size=True, **SMALL, **kw).eval()
    _randomise_scales(eva)
    return eva


EVA_CASES = [
    ("vit_small_patch16_rope_224", "vispe_vit_small_patch16_224", "rope_axial", {}),
    ("vit_small_patch16_rope_mixed_224", "vispe_vit_small_patch16_224", "rope_mixed", {}),
    ("vit_base_patch16_rope_mixed_224", "vispe_vit_base_patch16_224", "rope_mixed", {}),
    ("vit_small_patch16_rope_224", "vispe_vit_small_patch16_224", "rope_axial", {"qkv_fused": False}),  # q/k/v_proj
]


@pytest.mark.parametrize("timm_name, vispe_name, pe, eva_kw", EVA_CASES)
def test_eva_rope_checkpoint_loads_exactly(timm_name, vispe_name, pe, eva_kw):
    eva = _eva(timm_name, **eva_kw)
    model = timm.create_model(vispe_name, pos_encoding=pe, **SMALL).eval()  # built without layer scale
    report = load_timm_checkpoint(model, eva.state_dict())
    assert not report.new and not report.dropped, str(report)
    assert any("layer scale" in a for a in report.adapted)
    if pe == "rope_mixed":
        assert "rope.freqs -> pos_encoding.freqs" in report.kept
        assert torch.equal(model.pos_encoding.freqs, eva.rope.freqs)
    for size in [(64, 64), (48, 80)]:
        x = torch.randn(2, 3, *size)
        with torch.no_grad():
            diff = (eva(x) - model(x)).abs().max().item()
        assert diff <= 1e-5, (size, diff)


def test_eva_checkpoint_through_timm_factory_file(tmp_path):
    eva = _eva("vit_small_patch16_rope_mixed_224")
    path = tmp_path / "eva_rope_mixed.pth"
    torch.save(eva.state_dict(), path)
    model = timm.create_model("vispe_vit_small_patch16_224", pos_encoding="rope_mixed", pretrained=True,
                              pretrained_cfg_overlay=dict(file=str(path)), **SMALL).eval()
    report = model.last_load_report
    assert not report.new and not report.dropped, str(report)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert (eva(x) - model(x)).abs().max().item() <= 1e-5


def test_layer_scale_and_frequencies_are_what_make_the_logits_match():
    """The check above can fail: without the checkpoint's scales or frequencies the logits move far."""
    eva = _eva("vit_small_patch16_rope_mixed_224")
    sd = {k: v for k, v in eva.state_dict().items() if not k.endswith(("gamma_1", "gamma_2")) and k != "rope.freqs"}
    model = timm.create_model("vispe_vit_small_patch16_224", pos_encoding="rope_mixed", **SMALL).eval()
    report = load_timm_checkpoint(model, sd)
    assert report.new == ["pos_encoding.freqs"]
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ref = eva(x)
        assert (ref - model(x)).abs().max().item() > 0.1 * ref.abs().max().item()


def test_rope_mixed_checkpoint_into_rope_axial_reports_the_frequencies_dropped():
    eva = _eva("vit_small_patch16_rope_mixed_224")
    model = timm.create_model("vispe_vit_small_patch16_224", pos_encoding="rope_axial", **SMALL)
    report = load_timm_checkpoint(model, eva.state_dict())
    assert any(d.startswith("rope.freqs") for d in report.dropped) and not report.new


@pytest.mark.parametrize(
    "timm_name, pe, exact",
    [
        ("vit_small_patch16_224", "learned", True),
        ("deit_small_patch16_224", "learned", True),
        ("deit3_small_patch16_224", {"name": "learned", "embed_prefix": False}, True),  # no_embed_class + layer scale
        ("deit_small_distilled_patch16_224", "learned", False),  # distillation token: reported, logits differ
    ],
)
def test_vit_and_deit_checkpoints(timm_name, pe, exact):
    torch.manual_seed(0)
    ref = timm.create_model(timm_name, pretrained=False, depth=2).eval()
    _randomise_scales(ref)
    model = timm.create_model("vispe_vit_small_patch16_224", pos_encoding=pe, depth=2, dynamic_img_size=False).eval()
    report = load_timm_checkpoint(model, ref.state_dict())
    assert not report.new, str(report)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        out = ref(x)
        if exact:
            assert not report.dropped, str(report)
            assert (out - model(x)).abs().max().item() <= 1e-5
        else:
            assert report.dropped == ["dist_token and its pos_embed row (vispe ViTs have no distillation token)",
                                      "head_dist.weight", "head_dist.bias"], report.dropped
            assert torch.equal(model.pos_encoding.pos_embed[:, 0], ref.pos_embed[:, 0])
            assert torch.equal(model.pos_encoding.pos_embed[:, 1:], ref.pos_embed[:, 2:])
