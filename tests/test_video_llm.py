"""The small video-LLM backbone: decode consistency for every scheme, generation, training step, errors."""
from __future__ import annotations

import pytest
import torch

from vispe.models.video_llm import VideoLLM, VisualFeatures
from vispe.models.video_vit import VispeVideoViT
from vispe.positions import NUM_COORDS, Text, Visual, build_positions

SCHEMES = list(NUM_COORDS)
OPTS = {"hope": dict(gamma=0.75), "v2pe": dict(delta=0.25), "mrope": dict(fps=1.0)}
VOCAB, VDIM = 40, 24


def make(scheme: str, **kw) -> VideoLLM:
    torch.manual_seed(0)
    args = dict(vocab_size=VOCAB, dim=64, depth=2, num_heads=4, pos_scheme=scheme, position_kwargs=OPTS.get(scheme), visual_dim=VDIM, spatial_merge_size=2)
    args.update(kw)
    return VideoLLM(**args).eval()


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def feats(T: int, H: int, W: int, seed: int) -> torch.Tensor:
    return torch.randn(T, H, W, VDIM, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_decode_consistency(scheme):
    """logits for token L from a prefill over L+1 tokens == prefill over L tokens + one cached step (rope_delta)."""
    m = make(scheme)
    text = ids(12, 1)
    # sample 0 ends with a video (next text position comes from the scheme's rule), sample 1 with text;
    # different lengths -> left padding
    prompts = [[text[:3], feats(3, 4, 6, 2), text[3:5], VisualFeatures(feats(2, 2, 2, 3))], [text[5:7], feats(1, 2, 4, 4), text[7:10]]]
    nxt = torch.stack([text[10], text[11]])
    with torch.no_grad():
        full = m.forward_batch(m.pack([p + [t[None]] for p, t in zip(prompts, nxt, strict=True)])).logits[:, -1]
        pre = m.forward_batch(m.pack(prompts), use_cache=True)
        step = m(input_ids=nxt[:, None], cache=pre.cache).logits[:, -1]
    assert torch.allclose(step, full, atol=1e-4), (step - full).abs().max()
    if scheme != "rope_1d":
        # the raw cache index (rope_delta ignored) is the classic bug: it gives different logits here
        pre.cache.rope_delta = torch.zeros_like(pre.cache.rope_delta)
        with torch.no_grad():
            wrong = m(input_ids=nxt[:, None], cache=pre.cache).logits[:, -1]
        assert not torch.allclose(wrong, full, atol=1e-4)


@pytest.mark.parametrize("scheme", ["vrope", "v2pe"])
def test_greedy_generate_matches_uncached_recompute(scheme):
    m = make(scheme)
    prompt = [[ids(4, 5), feats(2, 4, 4, 6), ids(2, 7)], [ids(2, 8), feats(1, 2, 2, 9), ids(5, 10)]]
    gen = m.generate(prompt, max_new_tokens=3)
    assert gen.shape == (2, 3)
    with torch.no_grad():
        for b in range(2):
            sample = list(prompt[b])
            for j in range(3):
                tok = m.forward_batch(m.pack([sample])).logits[0, -1].argmax()
                assert int(tok) == int(gen[b, j])
                sample = sample + [tok[None]]


def test_generate_stops_at_eos():
    m = make("mrope")
    prompt = [[ids(3, 11), feats(1, 2, 2, 12), ids(2, 13)]]
    first = int(m.generate(prompt, max_new_tokens=1)[0, 0])
    out = m.generate(prompt, max_new_tokens=5, eos_token_id=first)
    assert out[0, 0].item() == first and (out[0, 1:] == m.pad_token_id).all()


def test_pack_places_visual_tokens_in_raster_order_and_positions():
    m = make("mrope", spatial_merge_size=1, position_kwargs=None)
    f = feats(2, 2, 3, 14)
    batch = m.pack([[ids(3, 15), f, ids(2, 16)]])
    with torch.no_grad():
        proj = m.projector(f[None])[0].reshape(-1, 64)
    assert torch.allclose(batch.inputs_embeds[0, 3:15], proj)
    expected, delta = build_positions("mrope", [Text(3), Visual(2, 2, 3), Text(2)])
    assert torch.equal(batch.position_ids[:, 0], expected) and int(batch.rope_delta[0]) == int(delta)
    assert batch.visual_mask[0].sum() == 12 and (batch.token_ids[0, 3:15] == -100).all()


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("frames, size", [(8, 32), (32, 48)])
def test_forward_backward_with_video_vit(scheme, frames, size):
    torch.manual_seed(0)
    vit = VispeVideoViT(pos_encoding="rope_axial_3d", embed_dim=24, depth=1, num_heads=2, img_size=32, num_frames=8, tubelet_size=2, patch_size=8, num_classes=0)
    m = VideoLLM(vocab_size=VOCAB, dim=32, depth=1, num_heads=4, pos_scheme=scheme, vision_encoder=vit, spatial_merge_size=2, position_kwargs=OPTS.get(scheme))
    m.train()  # HoPE / V2PE draw gamma / delta per visual block here
    video = torch.randn(1, 3, frames, size, size)
    vis = m.encode_video(video)[0]  # (T/2, size/8, size/8, 24)
    assert vis.shape == (frames // 2, size // 8, size // 8, 24)
    batch = m.pack([[ids(3, 17), vis, ids(4, 18)]])
    n_vis = (frames // 2) * (size // 16) ** 2
    assert batch.inputs_embeds.shape[1] == 7 + n_vis
    out = m.forward_batch(batch, labels=batch.token_ids)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert vit.patch_embed.proj.weight.grad is not None and m.projector.fc1.weight.grad is not None
    assert m.tok_embed.weight.grad is not None


def test_text_only_forward_defaults_to_1d_positions():
    m = make("mrope_interleave")
    x = ids(7, 19)[None]
    with torch.no_grad():
        a = m(input_ids=x).logits
        b = m(input_ids=x, position_ids=torch.arange(7)[None, None].expand(3, 1, 7)).logits
    assert torch.allclose(a, b)


def test_bad_inputs_raise():
    m = make("mrope")
    with pytest.raises(ValueError, match="every size >= 1"):
        m.pack([[ids(2, 0), torch.randn(0, 2, 2, VDIM)]])
    with pytest.raises(ValueError, match="not divisible by the spatial merge size 2"):
        m.pack([[ids(2, 0), torch.randn(1, 3, 4, VDIM)]])
    with pytest.raises(ValueError, match="token ids must lie"):
        m.pack([[torch.tensor([VOCAB + 1])]])
    with pytest.raises(ValueError, match="not a multimodal scheme"):
        VideoLLM(pos_scheme="rope_axial")
    with pytest.raises(TypeError, match="valid options"):
        VideoLLM(pos_scheme="hope", position_kwargs=dict(delta=0.5))
    with pytest.raises(ValueError, match=r"position_ids must be \(3"):
        m(input_ids=ids(4, 0)[None], position_ids=torch.zeros(4, 1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="needs the rope_delta"):
        m(input_ids=ids(4, 0)[None], position_ids=torch.zeros(3, 1, 4, dtype=torch.long), use_cache=True)
