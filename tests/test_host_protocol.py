"""The one host protocol: every host embeds through ``embed_grid`` and runs ``run_blocks``; the video-LLM attends
through the encoding's ``attend``; auxiliary losses are found by walking the modules; NaFlex patches go through a
linear patch projection.

Each model is checked against the hook sequence written out here from the encodings' public hooks, so the
property is "the host is exactly prepare -> embed_tokens -> blocks(attend) -> after_block", not a stored output.
"""
from __future__ import annotations

import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F

import vispe.models.naflex as naflex_mod
import vispe.models.video_vit as video_vit_mod
import vispe.models.vispe_vit as vispe_vit_mod
from vispe.encodings.rotary import apply_rotary
from vispe.models.layers import LayerPE, auxiliary_loss, hook_owners
from vispe.models.naflex import patch_projection, patchify_images
from vispe.models.video_llm import VideoLLM
from vispe.models.video_vit import VispeVideoViT

IMAGE_ENCODINGS = ["learned", "rope_mixed", "irpe", "cpe", "seqpe", "loope"]
VIDEO_ENCODINGS = ["rope_axial_3d", "sincos3d", "learned_3d", "comrope_ld_3d"]
SEQPE = {"name": "seqpe", "encoder_dim": 32, "encoder_depth": 1, "encoder_heads": 2}


def _vit(name, **kw) -> nn.Module:
    torch.manual_seed(0)
    args = dict(pos_encoding=name, img_size=16, patch_size=4, embed_dim=64, depth=2, num_heads=4, num_classes=5, reg_tokens=1)
    args.update(kw)
    return timm.create_model("vispe_vit_tiny_patch4_32", **args)


def _by_hand(host: nn.Module, tokens: torch.Tensor, grid, image: torch.Tensor) -> torch.Tensor:
    """The host protocol spelt out with the encoding's hooks: prefix tokens, prepare, embed_tokens, norm_pre,
    each block with its LayerPE, after_block, final norm (eval mode: no dropout)."""
    enc = host.pos_encoding
    prefix = [t.expand(tokens.shape[0], -1, -1) for t in (host.cls_token, host.reg_token) if t is not None]
    x = torch.cat(prefix + [tokens], dim=1)
    state = enc.prepare(grid, x.device)
    x = host.norm_pre(enc.embed_tokens(x, grid, state, image=image))
    for i, blk in enumerate(host.blocks):
        x = enc.after_block(i, blk(x, pe=LayerPE(enc, state, i)), grid, state)
    return host.norm(x)


@pytest.mark.parametrize("name", IMAGE_ENCODINGS)
def test_image_vit_is_the_hook_sequence(name):
    from vispe.encodings import PositionGrid

    model = _vit(name).eval()
    x = torch.randn(2, 3, 16, 20)
    with torch.no_grad():
        tokens = model.patch_embed(x).flatten(1, 2)
        expected = model.forward_head(_by_hand(model, tokens, PositionGrid((4, 5), model.num_prefix_tokens), x))
        got = model(x)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


@pytest.mark.parametrize("name", VIDEO_ENCODINGS)
def test_video_vit_is_the_hook_sequence(name):
    from vispe.encodings import PositionGrid

    torch.manual_seed(0)
    model = VispeVideoViT(pos_encoding=name, img_size=16, num_frames=4, tubelet_size=2, patch_size=8, embed_dim=48, depth=2,
                          num_heads=3, num_classes=4, reg_tokens=1).eval()
    video = torch.randn(2, 3, 4, 16, 24)
    with torch.no_grad():
        tokens = model.patch_embed(video)
        grid = PositionGrid(tuple(tokens.shape[1:4]), model.num_prefix_tokens)
        expected = model.forward_head(_by_hand(model, tokens.flatten(1, 3), grid, video))
        got = model(video)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_every_host_embeds_through_the_one_step(monkeypatch):
    """The image ViT, the video ViT and each grid group of a NaFlex batch call ``embed_grid`` (once per grid)."""
    calls = []

    def spy_for(module):
        original = module.embed_grid

        def spy(host, x, grid, image=None):
            calls.append((type(host).__name__, tuple(grid.shape)))
            return original(host, x, grid, image)

        monkeypatch.setattr(module, "embed_grid", spy)

    for module in (vispe_vit_mod, video_vit_mod, naflex_mod):
        spy_for(module)
    vit = _vit("rope_mixed").eval()
    video = VispeVideoViT(pos_encoding="rope_axial_3d", img_size=16, num_frames=4, tubelet_size=2, patch_size=8, embed_dim=48,
                          depth=1, num_heads=3, num_classes=4).eval()
    with torch.no_grad():
        vit(torch.randn(1, 3, 16, 16))
        video(torch.randn(1, 3, 4, 16, 16))
        vit([torch.randn(3, 16, 16), torch.randn(3, 12, 20), torch.randn(3, 16, 16)])
    assert calls == [("VispeVisionTransformer", (4, 4)), ("VispeVideoViT", (2, 2, 2)),
                     ("VispeVisionTransformer", (4, 4)), ("VispeVisionTransformer", (3, 5))]


# -- the video-LLM attends through the encoding's attend -----------------------------------------------------
@pytest.mark.parametrize("scheme", ["mrope", "rope_1d", "mhrope", "videorope"])
def test_video_llm_attends_through_the_encodings_attend(scheme, monkeypatch):
    torch.manual_seed(0)
    m = VideoLLM(vocab_size=50, dim=32, depth=2, num_heads=4, pos_scheme=scheme, visual_dim=8).eval()
    batch = m.pack([[torch.randint(0, 50, (5,)), torch.randn(2, 2, 2, 8), torch.randint(0, 50, (3,))], [torch.randint(0, 50, (7,))]])
    enc = m.pos_encoding
    # the reference: the rotation written out (apply_rotary on q and k, then SDPA with the model's mask)
    table = enc.table_from_positions(batch.position_ids)
    mask = m._attn_mask(batch.attention_mask, batch.attention_mask.shape[1])
    x = batch.inputs_embeds
    with torch.no_grad():
        for blk in m.blocks:
            a = blk.attn
            B, L, C = x.shape
            q, k, v = a.qkv(blk.norm1(x)).reshape(B, L, 3, a.num_heads, a.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
            q, k = apply_rotary(q, table, enc.layout), apply_rotary(k, table, enc.layout)
            h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + a.proj(h.transpose(1, 2).reshape(B, L, C))
            x = x + blk.mlp(blk.norm2(x))
        expected = m.lm_head(m.norm(x))
    layers = []
    original = type(enc).attend

    def spy(self, q, k, v, **kw):
        layers.append(kw["layer"])
        return original(self, q, k, v, **kw)

    monkeypatch.setattr(type(enc), "attend", spy)
    with torch.no_grad():
        got = m.forward_batch(batch).logits
    assert layers == [0, 1]  # one attend per layer: the ViTs' path
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    # cached decoding keeps the keys before rotation plus their table, and matches a full recompute
    with torch.no_grad():
        ids = torch.randint(0, 50, (2, 6))
        full = m(input_ids=ids).logits[:, -1]
        pre = m(input_ids=ids[:, :-1], use_cache=True)
        assert pre.cache.key_table.shape[-2] == pre.cache.keys[0].shape[-2] == 5
        step = m(input_ids=ids[:, -1:], cache=pre.cache).logits[:, -1]
    torch.testing.assert_close(step, full, atol=1e-5, rtol=0)


# -- auxiliary losses found by walking the modules -----------------------------------------------------------
class _Probe(nn.Module):
    """A module with a training scalar of its own, dropped anywhere in a model: the one file a new hook needs."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(2.0))

    def auxiliary_loss(self) -> torch.Tensor:
        return self.w * 3


def _seeded(compute, seed=7):
    """SeqPE's regularisers draw random positions each call: the same draws for every call compared."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return compute()


def test_auxiliary_loss_is_found_by_the_walk_anywhere():
    from vispe.tasks.auxiliary import add_auxiliary_loss

    model = _vit(SEQPE).train()
    seqpe_loss = _seeded(model.pos_encoding.auxiliary_loss)
    assert [type(m).__name__ for m in hook_owners(model)] == [type(model.pos_encoding).__name__]
    model.blocks[1].mlp.probe = _Probe()  # deep inside a block: no model or task knows about it
    assert len(list(hook_owners(model))) == 2
    torch.testing.assert_close(_seeded(lambda: auxiliary_loss(model)), seqpe_loss + 6.0)
    wrapped = nn.ModuleDict({"backbone": model})  # a wrapper (DDP, a task) is walked through, the host counted once
    torch.testing.assert_close(_seeded(lambda: auxiliary_loss(wrapped)), seqpe_loss + 6.0)
    torch.testing.assert_close(_seeded(model.auxiliary_loss), seqpe_loss + 6.0)

    class Rec:
        logged: dict = {}

        def log(self, name, value, **kw):
            self.logged[name] = value

    base = torch.tensor(1.0)
    total = _seeded(lambda: add_auxiliary_loss(Rec(), model, base, 0.5))
    torch.testing.assert_close(total, base + 0.5 * (seqpe_loss + 6.0))
    # no module with a loss: None, and the task's loss is returned as is
    plain = _vit("rope_mixed")
    assert auxiliary_loss(plain) is None and add_auxiliary_loss(Rec(), plain, base, 1.0) is base


def test_composed_parts_are_counted_once():
    model = _vit("seqpe[encoder_dim=32,encoder_depth=1,encoder_heads=2]+rope_mixed").train()
    owners = list(hook_owners(model))
    assert owners == [model.pos_encoding]  # the composed encoding owns (and sums) its parts' losses
    torch.testing.assert_close(_seeded(lambda: auxiliary_loss(model)), _seeded(model.pos_encoding.parts[0].auxiliary_loss))


def test_auxiliary_loss_is_recorded_inside_the_training_forward():
    """Recorded while the forward's parameters are live (FSDP2 reshards them after the forward): a change to the
    weights after the forward does not reach the loss the task takes; taken once, then computed afresh. (A
    deterministic probe: SeqPE's own regularisers draw new random positions on every call.)"""
    model = _vit("rope_mixed").train()
    model.blocks[0].probe = _Probe()
    model(torch.randn(2, 3, 16, 16))
    with torch.no_grad():
        model.blocks[0].probe.w.fill_(10.0)
    recorded = auxiliary_loss(model)
    fresh = auxiliary_loss(model)
    torch.testing.assert_close(recorded - fresh, torch.tensor(6.0 - 30.0))
    model.eval()
    model(torch.randn(1, 3, 16, 16))  # eval forwards record nothing
    assert "_pending_auxiliary_loss" not in model.blocks[0].probe.__dict__


def test_compiled_forward_records_nothing_and_stays_one_graph():
    model = _vit(SEQPE, depth=1).train()
    model.blocks[0].probe = _Probe()
    compiled = torch.compile(model, backend="eager", fullgraph=True)  # fullgraph: a break in the walk would raise
    compiled(torch.randn(2, 3, 16, 16))
    assert all("_pending_auxiliary_loss" not in m.__dict__ for m in model.modules())
    eager = _seeded(model.pos_encoding.auxiliary_loss) + 6.0
    torch.testing.assert_close(_seeded(lambda: auxiliary_loss(compiled)), eager)  # computed after the forward, through the wrapper


# -- NaFlex: linear patch projection ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["learned", "rope_mixed", "irpe", "cpe", "loope"])
def test_naflex_gives_the_plain_logits_on_same_size_images(name):
    model = _vit(name).eval()
    images = torch.randn(3, 3, 12, 20)
    calls = []
    model.patch_embed.proj.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        plain = model(images)
        assert calls == [1]
        as_list = model(list(images))
        as_patches = model(patchify_images(list(images), 4))
    assert calls == [1]  # the NaFlex path never runs the conv: the patches go straight into the linear projection
    torch.testing.assert_close(as_list, plain, atol=1e-5, rtol=0)
    torch.testing.assert_close(as_patches, as_list, atol=0, rtol=0)


def test_patch_projection_is_the_conv():
    conv = nn.Conv2d(3, 8, kernel_size=(4, 2), stride=(4, 2))
    image = torch.randn(2, 3, 12, 10)
    ref = conv(image).flatten(2).transpose(1, 2)
    patches = patchify_images(list(image), (4, 2))["patches"]
    torch.testing.assert_close(patch_projection(conv, patches), ref, atol=1e-5, rtol=0)


def test_naflex_input_errors_name_the_value():
    model = _vit("learned").eval()
    with pytest.raises(TypeError, match="dtype torch.int64"):
        model([torch.zeros(3, 16, 16, dtype=torch.long)])
    with pytest.raises(ValueError, match=r"image 1 of the list has shape \(1, 8, 16\); expected \(C=3, H, W\)"):
        model([torch.randn(3, 16, 16), torch.randn(1, 8, 16)])
