"""Bad-input battery (issue 32), shapes half: images and videos at the model's door (category ``images``).

The image ViT, the video ViT and the video-LLM check rank, channels, dtype, batch agreement of every input and the
token range before any compute; each error names the argument, the shape got and the shape expected. The still-clip
path (a 4D image into the video ViT) is accepted on purpose and checked against its definition.
"""
from __future__ import annotations

import pytest
import timm
import torch

import vispe  # noqa: F401  (registers models)
from bad_input import expect_clear_error
from vispe.models.video_llm import KVCache, VideoLLM
from vispe.models.video_vit import VispeVideoViT

TINY_VIT = dict(embed_dim=32, depth=1, num_heads=2, img_size=16, num_classes=4)
TINY_VIDEO = dict(img_size=16, num_frames=4, tubelet_size=2, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=3)


@pytest.fixture(scope="module")
def vit():
    return timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding="rope_axial", **TINY_VIT).eval()


@pytest.fixture(scope="module")
def video_vit():
    return VispeVideoViT(pos_encoding="rope_axial_3d", **TINY_VIDEO).eval()


@pytest.fixture(scope="module")
def llm():
    torch.manual_seed(0)
    return VideoLLM(vocab_size=50, dim=32, depth=2, num_heads=2).eval()


# ---------------------------------------------------------------------------------------------------------------------
# image ViT
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case, make, needles", [
    ("channels last", lambda: torch.randn(2, 16, 16, 3), ["(2, 16, 16, 3)", "channels last", "permute(0, 3, 1, 2)"]),
    ("no batch dim", lambda: torch.randn(3, 16, 16), ["(3, 16, 16)", "no batch dimension", "unsqueeze(0)"]),
    ("video into image model", lambda: torch.randn(2, 3, 4, 16, 16), ["(2, 3, 4, 16, 16)", "(b, c=3, h, w)"]),
    ("grey into rgb model", lambda: torch.randn(2, 1, 16, 16), ["(2, 1, 16, 16)", "c=3", "in_chans"]),
    ("flat vector", lambda: torch.randn(2, 768), ["(2, 768)", "(b, c=3, h, w)"]),
    ("uint8 pixels", lambda: torch.zeros(2, 3, 16, 16, dtype=torch.uint8), ["torch.uint8", "floating-point"]),
    ("int64 pixels", lambda: torch.zeros(2, 3, 16, 16, dtype=torch.long), ["torch.int64", "floating-point"]),
    ("empty batch", lambda: torch.randn(0, 3, 16, 16), ["(0, 3, 16, 16)", "non-zero"]),
    ("zero height", lambda: torch.randn(1, 3, 0, 16), ["(1, 3, 0, 16)", "non-zero"]),
    ("size not a patch multiple", lambda: torch.randn(1, 3, 18, 16), ["18x16", "patch size 4x4"]),
    ("numpy array", lambda: torch.randn(1, 3, 16, 16).numpy(), ["torch.tensor", "ndarray"]),
    ("float64 into float32 model", lambda: torch.randn(1, 3, 16, 16, dtype=torch.float64), ["torch.float64", "torch.float32", "autocast"]),
])
def test_images_vit_refuses_bad_input(case, make, needles, vit):
    x = make()
    with torch.no_grad():
        expect_clear_error(lambda: vit(x), needles)
        if isinstance(x, torch.Tensor):  # every public entry shares the same door
            expect_clear_error(lambda: vit.forward_features(x), needles)
            expect_clear_error(lambda: vit.forward_intermediates(x), needles)


@pytest.mark.parametrize("mask, needles", [
    (torch.ones(3, 5, 5, dtype=torch.bool), ["(3, 5, 5)", "(2, 2, 17, 17)"]),
    (torch.ones(2, 1, 16, 16, dtype=torch.bool), ["(2, 1, 16, 16)", "prefix tokens"]),
    (torch.ones(17, dtype=torch.bool), ["(17,)"]),
])
def test_images_vit_attn_mask_of_another_shape(mask, needles, vit):
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        expect_clear_error(lambda: vit.forward_features(x, attn_mask=mask), needles)
        expect_clear_error(lambda: vit.forward_intermediates(x, attn_mask=mask), needles)
        # a mask that broadcasts is taken: (N, N) for every sample and head
        assert vit.forward_features(x, attn_mask=torch.ones(17, 17, dtype=torch.bool)).shape == (2, 17, 32)


def test_images_vit_bf16_input_under_autocast_is_accepted(vit):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert vit(torch.randn(1, 3, 16, 16, dtype=torch.bfloat16)).shape == (1, 4)


def test_images_fixed_size_vit_refuses_another_size():
    fixed = timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding="learned", dynamic_img_size=False, **TINY_VIT).eval()
    expect_clear_error(lambda: fixed(torch.randn(1, 3, 24, 24)), ["24x24", "img_size (16, 16)", "dynamic_img_size"])


def test_images_vit_grey_model_accepts_grey(vit):
    grey = timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding="rope_axial", in_chans=1, **TINY_VIT).eval()
    with torch.no_grad():
        assert grey(torch.randn(2, 1, 16, 16)).shape == (2, 4)
    expect_clear_error(lambda: grey(torch.randn(2, 3, 16, 16)), ["(2, 3, 16, 16)", "c=1"])


# ---------------------------------------------------------------------------------------------------------------------
# video ViT
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case, make, needles", [
    ("frames before channels", lambda: torch.randn(2, 4, 3, 16, 16), ["(2, 4, 3, 16, 16)", "frames before channels", "transpose(1, 2)"]),
    ("channels last", lambda: torch.randn(2, 4, 16, 16, 3), ["(2, 4, 16, 16, 3)", "channels last", "permute(0, 4, 1, 2, 3)"]),
    ("no batch dim", lambda: torch.randn(3, 4, 16, 16), ["(3, 4, 16, 16)", "no batch dimension", "unsqueeze(0)"]),
    ("uint8 frames", lambda: torch.zeros(1, 3, 4, 16, 16, dtype=torch.uint8), ["torch.uint8", "floating-point"]),
    ("wrong channels", lambda: torch.randn(1, 2, 4, 16, 16), ["(1, 2, 4, 16, 16)", "c=3"]),
    ("rank 6", lambda: torch.randn(1, 1, 3, 4, 16, 16), ["(1, 1, 3, 4, 16, 16)", "(b, c=3, t, h, w)"]),
    ("odd frame count", lambda: torch.randn(1, 3, 3, 16, 16), ["3 frames", "tubelet 2x8x8"]),
    ("size not a patch multiple", lambda: torch.randn(1, 3, 4, 12, 16), ["12x16", "tubelet 2x8x8"]),
    ("empty batch", lambda: torch.randn(0, 3, 4, 16, 16), ["(0, 3, 4, 16, 16)", "non-zero"]),
    ("list of frames", lambda: [torch.randn(3, 16, 16)] * 4, ["torch.tensor", "list"]),
    ("float64 into float32 model", lambda: torch.randn(1, 3, 4, 16, 16, dtype=torch.float64), ["torch.float64", "torch.float32"]),
])
def test_images_video_vit_refuses_bad_input(case, make, needles, video_vit):
    x = make()
    with torch.no_grad():
        expect_clear_error(lambda: video_vit(x), needles)
        if isinstance(x, torch.Tensor):
            expect_clear_error(lambda: video_vit.forward_video_tokens(x), needles)


def test_images_video_vit_still_image_is_a_one_tubelet_clip(video_vit):
    """The documented 4D path: an image equals the clip that repeats it over one tubelet (same logits, one time step)."""
    img = torch.randn(2, 3, 16, 16)
    clip = img[:, :, None].expand(-1, -1, TINY_VIDEO["tubelet_size"], -1, -1)
    with torch.no_grad():
        assert torch.equal(video_vit(img), video_vit(clip))
        assert video_vit.forward_video_tokens(img).shape[1] == 1
    assert "still clip" in VispeVideoViT.forward.__doc__


# ---------------------------------------------------------------------------------------------------------------------
# video-LLM
# ---------------------------------------------------------------------------------------------------------------------
def _ids(b: int = 2, length: int = 5) -> torch.Tensor:
    return torch.randint(0, 50, (b, length), generator=torch.Generator().manual_seed(0))


def _cache(llm: VideoLLM, b: int = 2) -> KVCache:
    with torch.no_grad():
        return llm(input_ids=_ids(b), use_cache=True).cache


@pytest.mark.parametrize("case, kwargs, needles", [
    ("attention_mask batch", lambda m: dict(input_ids=_ids(2), attention_mask=torch.ones(3, 5, dtype=torch.bool)),
     ["attention_mask", "(2, 5)", "(3, 5)"]),
    ("attention_mask length", lambda m: dict(input_ids=_ids(2), attention_mask=torch.ones(2, 4, dtype=torch.bool)),
     ["attention_mask", "(2, 5)", "(2, 4)"]),
    ("attention_mask rank", lambda m: dict(input_ids=_ids(2), attention_mask=torch.ones(2, 1, 5, 5, dtype=torch.bool)),
     ["attention_mask", "(2, 1, 5, 5)"]),
    ("labels batch", lambda m: dict(input_ids=_ids(2), labels=_ids(3)), ["labels", "(2, 5)", "(3, 5)"]),
    ("labels length", lambda m: dict(input_ids=_ids(2), labels=_ids(2, 6)), ["labels", "(2, 6)"]),
    ("labels out of vocabulary", lambda m: dict(input_ids=_ids(2), labels=torch.full((2, 5), 50)), ["labels", "vocab_size=50", "50"]),
    ("labels negative", lambda m: dict(input_ids=_ids(2), labels=torch.full((2, 5), -5)), ["labels", "-100", "-5"]),
    ("labels float", lambda m: dict(input_ids=_ids(2), labels=torch.zeros(2, 5)), ["labels", "integer", "float32"]),
    ("token id too large", lambda m: dict(input_ids=torch.tensor([[1, 2, 50]])), ["input_ids", "vocab_size=50", "50"]),
    ("token id negative", lambda m: dict(input_ids=torch.tensor([[1, -1, 3]])), ["input_ids", "-1"]),
    ("ids without batch dim", lambda m: dict(input_ids=torch.tensor([1, 2, 3])), ["input_ids", "(3,)", "ids[none]"]),
    ("float ids", lambda m: dict(input_ids=torch.zeros(2, 5)), ["input_ids", "integer", "float32"]),
    ("empty sequence", lambda m: dict(input_ids=torch.zeros(2, 0, dtype=torch.long)), ["empty", "l = 0"]),
    ("inputs_embeds width", lambda m: dict(inputs_embeds=torch.randn(2, 5, 16)), ["inputs_embeds", "dim=32", "(2, 5, 16)"]),
    ("inputs_embeds rank", lambda m: dict(inputs_embeds=torch.randn(5, 32)), ["inputs_embeds", "(5, 32)"]),
    ("inputs_embeds integer", lambda m: dict(inputs_embeds=torch.zeros(2, 5, 32, dtype=torch.long)), ["inputs_embeds", "float", "int64"]),
    ("both ids and embeds", lambda m: dict(input_ids=_ids(2), inputs_embeds=torch.randn(2, 5, 32)), ["exactly one"]),
    ("position_ids shape", lambda m: dict(input_ids=_ids(2), position_ids=torch.zeros(3, 1, 5, dtype=torch.long)), ["position_ids", "(3, 1, 5)"]),
    ("rope_delta size", lambda m: dict(input_ids=_ids(2), rope_delta=torch.zeros(3, dtype=torch.long)), ["rope_delta", "b=2", "(3,)"]),
    ("kv cache of another batch", lambda m: dict(input_ids=_ids(3, 1), cache=_cache(m, 2)), ["cache", "b=3", "(2,)"]),
    ("kv cache of another depth", lambda m: dict(input_ids=_ids(2, 1), cache=KVCache(_cache(m).keys[:1], _cache(m).values[:1],
                                                                                          _cache(m).attention_mask, _cache(m).rope_delta)),
     ["cache holds 1 layers", "has 2"]),
    ("kv cache keys of another batch", lambda m: dict(input_ids=_ids(2, 1), cache=KVCache([k[:1] for k in _cache(m).keys], _cache(m).values,
                                                                                             _cache(m).attention_mask, _cache(m).rope_delta)),
     ["cache layer 0", "(2, 2, 5, 16)", "(1, 2, 5, 16)"]),
    ("cache is a tuple", lambda m: dict(input_ids=_ids(2, 1), cache=(torch.zeros(1),)), ["cache", "kvcache", "tuple"]),
    ("additive float mask", lambda m: dict(input_ids=_ids(2), attention_mask=torch.zeros(2, 5)), ["attention_mask", "bool or integer", "float32"]),
    ("inputs_embeds float64", lambda m: dict(inputs_embeds=torch.randn(2, 5, 32, dtype=torch.float64)), ["inputs_embeds", "float64", "float32"]),
])
def test_images_video_llm_refuses_bad_input(case, kwargs, needles, llm):
    args = kwargs(llm)
    with torch.no_grad():
        expect_clear_error(lambda: llm(**args), needles)


def test_images_video_llm_good_inputs_still_work(llm):
    """The checks accept what the model's own paths produce: a padded prefill with labels, then cached decoding."""
    ids = _ids(2)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, :2] = False
    labels = ids.clone()
    labels[0, :2] = -100
    with torch.no_grad():
        out = llm(input_ids=ids, attention_mask=mask, labels=labels, use_cache=True)
        assert torch.isfinite(out.loss)
        step = llm(input_ids=ids[:, :1], cache=out.cache, use_cache=True)
        assert step.logits.shape == (2, 1, 50)
        assert llm.generate([[ids[0]], [ids[1, :3]]], max_new_tokens=3).shape == (2, 3)


@pytest.mark.parametrize("kwargs, needles", [
    (dict(max_new_tokens=0), ["max_new_tokens", "0"]),
    (dict(max_new_tokens=2.5), ["max_new_tokens", "2.5"]),
    (dict(max_new_tokens=2, eos_token_id=99), ["eos_token_id=99", "[0, 50)"]),
])
def test_images_video_llm_generate_refuses_bad_arguments(kwargs, needles, llm):
    expect_clear_error(lambda: llm.generate([[torch.tensor([1, 2])]], **kwargs), needles)


@pytest.mark.parametrize("case, samples, needles", [
    ("token outside vocabulary", lambda: [[torch.tensor([1, 99])]], ["sample 0 item 0", "[0, 50)"]),
    ("visual features without time axis", lambda: [[torch.tensor([1]), torch.randn(2, 2, 32)]], ["sample 0 item 1", "(t, h, w, c)", "(2, 2, 32)"]),
    ("visual features wrong width", lambda: [[torch.randn(1, 2, 2, 7)]], ["(1, 1, 2, 2, 7)", "dim=32"]),
    ("a tensor instead of samples", lambda: torch.tensor([1, 2]), ["non-empty list of samples"]),
    ("a sample that is a tensor", lambda: [torch.tensor([1, 2])], ["sample 0", "list of items"]),
])
def test_images_video_llm_pack_refuses_bad_samples(case, samples, needles, llm):
    expect_clear_error(lambda: llm.pack(samples()), needles)


# ---------------------------------------------------------------------------------------------------------------------
# the classification task's batches
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case, labels, needles", [
    ("label outside num_classes", torch.tensor([1, 7]), ["label 7", "num_classes=4"]),
    ("negative label", torch.tensor([-1, 0]), ["label -1", "num_classes=4"]),
    ("labels of another batch size", torch.tensor([1]), ["(2,)", "(1,)"]),
    ("one-hot labels", torch.eye(4)[:2], ["(2,)", "(2, 4)"]),
])
def test_images_classification_step_refuses_bad_labels(case, labels, needles):
    from vispe.tasks import ImageClassification

    task = ImageClassification("vispe_vit_tiny_patch4_32", dict(embed_dim=32, depth=1, num_heads=2), "rope_axial", num_classes=4, img_size=16)
    x = torch.randn(2, 3, 16, 16)
    expect_clear_error(lambda: task.training_step((x, labels), 0), needles)
    expect_clear_error(lambda: task.validation_step((x, labels), 0), needles)
