"""Composed encodings (a token encoding and an attention-side encoding in one model) and the vision-tower presets.

Oracles: the transformers vision towers themselves (tiny configs, random weights, nothing downloaded) for
``qwen3vl_vision`` (whole tower output), ``glm4v_vision`` and ``gemma4_vision`` (their position contributions:
resampled tables and rotated q/k); the paper's formula for ``eva02at`` (no released code); and single encodings
for the composition machinery (a composition equals its parts applied one after the other).
"""
from __future__ import annotations

import math

import pytest
import torch

import vispe
from vispe import create_encoding, list_encodings
from vispe.encodings import EncodingContext, PositionalEncoding, PositionGrid
from vispe.encodings.composed import ComposedEncoding
from vispe.encodings.spec import parse_encoding_list, parse_pos_encoding
from vispe.encodings.vision_towers import gemma4_channel_order
from vispe.models import VispeVisionTransformer
from vispe.models.checkpoint import load_timm_checkpoint
from vispe.models.video_vit import VispeVideoViT

PRESETS_2D = ("qwen3vl_vision", "glm4v_vision", "gemma4_vision")


def _vit(pos_encoding, **kw):
    args = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5, dynamic_img_size=True)
    args.update(kw)
    return VispeVisionTransformer(pos_encoding=pos_encoding, **args)


# -- the spec: one canonical name for every form ------------------------------------------------------------------
def test_every_form_names_the_same_composition():
    want = ("learned+rope_axial[theta=10.0]", {})
    assert parse_pos_encoding("learned + rope_axial[theta=10.0]") == want
    assert parse_pos_encoding(["learned", {"name": "rope_axial", "theta": 10.0}]) == want
    assert parse_pos_encoding(("learned", "rope_axial[theta=10.0]")) == want
    assert parse_pos_encoding({"name": "learned+rope_axial[theta=10.0]"}) == want
    assert parse_pos_encoding(("irpe", {"mode": "bias"})) == ("irpe", {"mode": "bias"})  # the (name, options) pair is kept
    assert parse_pos_encoding("rope_axial[theta=1e+2]") == ("rope_axial", {"theta": 100.0})  # '+' inside options
    labels = [label for label, _, _ in parse_encoding_list("learned+rope_axial,rope_mixed")]
    assert labels == ["learned+rope_axial", "rope_mixed"]


@pytest.mark.parametrize("spec, words", [
    ("rope_axial+alibi_2d", ["'rope_axial'", "'alibi_2d'", "attention-side"]),
    ("rope_axial+comrope_ld", ["'rope_axial'", "'comrope_ld'", "attention-side"]),
    ("learned+learned", ["same encoding twice", "learned"]),
    ("learned+rope_axial_3d", ["different grids", "learned", "rope_axial_3d"]),
    ("learned+nope", ["unknown positional encoding", "'nope'"]),
    ("learned+", ["at least two parts"]),
])
def test_combinations_that_cannot_compose_are_refused_by_name(spec, words):
    with pytest.raises(ValueError) as err:
        vispe.get_encoding_class(spec)
    assert all(w in str(err.value) for w in words), str(err.value)
    with pytest.raises(ValueError):
        _vit(spec)


def test_composed_options_go_to_the_parts():
    with pytest.raises(ValueError, match="options per part"):
        parse_pos_encoding({"name": "learned+rope_axial", "theta": 10.0})
    with pytest.raises(TypeError, match="unknown option"):
        _vit("learned+rope_axial[thetaa=10.0]")
    m = _vit("learned[init_std=0.0]+rope_axial[theta=10.0]")
    assert float(m.pos_encoding.parts[1].theta) == 10.0 and m.pos_encoding.parts[0].pos_embed.abs().max() == 0


def test_video_vit_refuses_an_image_only_composition():
    with pytest.raises(ValueError, match="3D"):
        VispeVideoViT(pos_encoding="learned+rope_axial", img_size=16, num_frames=2, patch_size=8, embed_dim=32, depth=1, num_heads=2)


# -- the lifecycle: a composition is its parts applied in turn --------------------------------------------------
def test_composition_equals_its_parts_in_turn():
    """``learned+rope_axial``: the learned table added to the tokens, then the rotary in every attention; with the table
    set to zero the model is the ``rope_axial`` model with the same weights, and the table's contribution is exactly the
    ``learned`` encoding's."""
    torch.manual_seed(0)
    comp = _vit("learned+rope_axial").eval()
    rope = _vit("rope_axial").eval()
    learned = _vit("learned").eval()
    sd = {k: v for k, v in comp.state_dict().items() if not k.startswith("pos_encoding.")}
    rope.load_state_dict(sd)
    learned.load_state_dict({**sd, "pos_encoding.pos_embed": comp.pos_encoding.parts[0].pos_embed.detach()})
    x = torch.randn(2, 3, 40, 24)  # not the training grid: the table is resampled, the rotary extends
    tokens, grid = comp.embed(x)
    ref_tokens, _ = learned.embed(x)
    torch.testing.assert_close(tokens, ref_tokens, rtol=0, atol=0)
    assert comp.pos_encoding.uses_attention()
    with torch.no_grad():
        comp.pos_encoding.parts[0].pos_embed.zero_()
    torch.testing.assert_close(comp(x), rope(x), rtol=0, atol=0)


def test_state_follows_patch_dropout_and_grid_changes():
    torch.manual_seed(0)
    m = _vit("learned+rope_axial", patch_drop_rate=0.5).train()
    out = m(torch.randn(3, 3, 32, 32))
    out.sum().backward()
    assert m.pos_encoding.parts[0].pos_embed.grad is not None
    m.set_input_size(img_size=(48, 48))
    assert m.pos_encoding.parts[0].grid_size == (6, 6) and m.pos_encoding.parts[1].grid_size == (6, 6)
    assert m.pos_encoding.parts[0].pos_embed.shape[1] == 1 + 36
    assert "pos_encoding.parts.0.pos_embed" in m.no_weight_decay()


def test_fold_qk_basis_goes_to_the_attention_part():
    """ComRoPE folds its basis into the q/k projection; composed with a table it still folds, and the output equals the
    unfolded path (a host that does not fold, here with hooks watching qkv)."""
    torch.manual_seed(0)
    m = _vit("learned+comrope_ld").eval()
    state = m.pos_encoding.prepare(PositionGrid((4, 4), 1))
    basis, folded = m.pos_encoding.fold_qk_basis(state, 0)
    assert basis is not None and folded[0] is state[0] and folded[1] is not state[1]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = m(x)
        handle = m.blocks[0].attn.qkv.register_forward_hook(lambda *a: None)  # observed qkv: no folding in block 0
        out = m(x)
        handle.remove()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_timm_checkpoint_pos_embed_reaches_the_token_part():
    torch.manual_seed(0)
    src = _vit("learned")
    sd = {k.replace("pos_encoding.pos_embed", "pos_embed"): v for k, v in src.state_dict().items()}
    for spec, key in (("learned+rope_axial", "pos_encoding.parts.0.pos_embed"),
                      ("qwen3vl_vision[table_size=6]", "pos_encoding.parts.0.pos_embed")):
        dst = _vit(spec)
        report = load_timm_checkpoint(dst, sd)
        assert any(key in k for k in report.kept + report.resampled), str(report)
        if spec.startswith("learned"):
            torch.testing.assert_close(dst.state_dict()[key], sd["pos_embed"])
        else:  # 16 lattice rows (cls row left out) resampled onto the 6 x 6 table
            assert dst.state_dict()[key].shape == (1, 36, 32)


def test_every_hook_of_the_base_class_is_delegated():
    """A hook added to PositionalEncoding must be delegated by ComposedEncoding too: this lists every public method of
    the base class that ComposedEncoding does not override, which must be only the non-hook helpers."""
    helpers = {"cacheable", "cached", "check_grid"}
    hooks = {n for n, v in vars(PositionalEncoding).items() if callable(v) and not n.startswith("_")}
    not_delegated = {n for n in hooks - helpers if getattr(ComposedEncoding, n) is getattr(PositionalEncoding, n)}
    assert not not_delegated, f"ComposedEncoding does not delegate {sorted(not_delegated)} to its parts"


def test_video_composition_runs_the_lifecycle():
    torch.manual_seed(0)
    m = VispeVideoViT(pos_encoding="learned_3d+rope_axial_3d", img_size=16, num_frames=4, patch_size=8, embed_dim=32, depth=1,
                      num_heads=2, num_classes=3, patch_drop_rate=0.25).train()
    m(torch.randn(2, 3, 4, 16, 16)).sum().backward()
    assert m.pos_encoding.parts[0].pos_embed.grad is not None
    assert m.eval()(torch.randn(1, 3, 6, 24, 16)).shape == (1, 3)


# -- presets: registered, validated, every host ---------------------------------------------------------------
@pytest.mark.parametrize("name", PRESETS_2D)
def test_image_presets_train_and_change_resolution(name):
    torch.manual_seed(0)
    m = _vit(name)
    m(torch.randn(2, 3, 32, 32)).sum().backward()
    assert all(p.grad is not None for p in m.pos_encoding.parameters())
    assert m.eval()(torch.randn(1, 3, 48, 24)).shape == (1, 5)


@pytest.mark.parametrize("name", ["eva02at", "qwen3vl_vision", "glm4v_vision"])
def test_video_presets(name):
    m = VispeVideoViT(pos_encoding=name, img_size=16, num_frames=4, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=3)
    assert m(torch.randn(1, 3, 4, 16, 16)).shape == (1, 3) and m(torch.randn(1, 3, 8, 24, 16)).shape == (1, 3)


def test_presets_are_listed_and_refuse_bad_options():
    assert set(PRESETS_2D) | {"eva02at", "learned_resampled", "learned_xy", "learned_st", "rope_st_joint"} <= set(list_encodings())
    ctx = EncodingContext(dim=32, num_heads=2, depth=1, grid_size=(4, 4))
    for spec, word in (("qwen3vl_vision[table_size=0]", "table_size"), ("qwen3vl_vision[theta=-1.0]", "theta"),
                       ("glm4v_vision[table_size='big']", "table_size"), ("gemma4_vision[table_size=2.5]", "table_size"),
                       ("learned_resampled[mode='nearest']", "nearest"), ("eva02at", "video")):
        with pytest.raises((ValueError, TypeError), match=word):  # a wrong type is a TypeError (vispe._checks)
            create_encoding(spec, ctx)
    with pytest.raises(ValueError, match="head_dim divisible by 4"):
        create_encoding("qwen3vl_vision", EncodingContext(dim=12, num_heads=2, depth=1, grid_size=(4, 4)))
    with pytest.raises(ValueError, match="larger than"):
        create_encoding("gemma4_vision[table_size=4]", ctx).prepare(PositionGrid((5, 4), 1))
        _vit("gemma4_vision[table_size=4]")(torch.randn(1, 3, 40, 32))


# -- parity with the transformers vision towers ---------------------------------------------------------------
def _merge_order(h: int, w: int, m: int) -> torch.Tensor:
    """Row-major lattice index of each token in the towers' merge-block order (block row, block col, in-row, in-col)."""
    idx = torch.arange(h * w).reshape(h // m, m, w // m, m).permute(0, 2, 1, 3)
    return idx.reshape(-1)


@pytest.mark.parametrize("grid", [(4, 4), (6, 4)])
def test_qwen3vl_vision_tower_output_matches_transformers(grid):
    """The whole Qwen3-VL vision tower (before the patch merger): a vispe ViT with ``qwen3vl_vision`` and the tower's
    weights gives the tower's hidden states (the tower's blocks are timm's pre-norm blocks)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    torch.manual_seed(0)
    p, side, dim, heads = 4, 5, 32, 2
    cfg = transformers.Qwen3VLVisionConfig(depth=2, hidden_size=dim, intermediate_size=64, num_heads=heads, patch_size=p,
                                           temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=side * side,
                                           out_hidden_size=dim, deepstack_visual_indexes=[], in_channels=3)
    cfg._attn_implementation = "eager"
    hf = Qwen3VLVisionModel(cfg).eval()
    with torch.no_grad():  # weights large enough that attention is far from uniform: position errors show in the output
        for name, param in hf.named_parameters():
            param.normal_(0, 0.5 if "qkv" in name else 0.2)
    ours = VispeVisionTransformer(pos_encoding=f"qwen3vl_vision[table_size={side}]", img_size=(grid[0] * p, grid[1] * p),
                                  patch_size=p, embed_dim=dim, depth=2, num_heads=heads, mlp_ratio=2.0, class_token=False,
                                  global_pool="avg", act_layer="gelu_tanh", num_classes=0).eval()
    sd = {"patch_embed.proj.weight": hf.patch_embed.proj.weight.sum(2),  # identical frames: Conv3d over 2 = Conv2d of the sum
          "patch_embed.proj.bias": hf.patch_embed.proj.bias,
          "pos_encoding.parts.0.pos_embed": hf.pos_embed.weight[None]}
    names = {"norm1": "norm1", "norm2": "norm2", "attn.qkv": "attn.qkv", "attn.proj": "attn.proj", "mlp.fc1": "mlp.linear_fc1",
             "mlp.fc2": "mlp.linear_fc2"}
    for i, blk in enumerate(hf.blocks):
        for ours_name, hf_name in names.items():
            for t in ("weight", "bias"):
                sd[f"blocks.{i}.{ours_name}.{t}"] = blk.get_submodule(hf_name).get_parameter(t)
    missing, unexpected = ours.load_state_dict(sd, strict=False)
    assert not unexpected and all(k.startswith(("norm.", "head", "fc_norm")) for k in missing), missing
    h, w = grid
    image = torch.randn(1, 3, h * p, w * p)
    # the tower's input: every patch (C, T=2, p, p) of two identical frames, in merge-block order
    patches = image.reshape(3, h, p, w, p).permute(1, 3, 0, 2, 4).reshape(h * w, 3, 1, p, p).expand(-1, -1, 2, -1, -1)
    order = _merge_order(h, w, 2)
    with torch.no_grad():
        ref = hf(patches[order].reshape(h * w, -1), grid_thw=torch.tensor([[1, h, w]])).last_hidden_state
        x, g, state = ours.embed_with_state(image)
        for _, x in ours.iter_blocks(x, g, state=state):
            pass
    assert (x[0][order] - ref).abs().max() <= 1e-5


def _rotate_like_hf(q, cos, sin):
    half = q.shape[-1] // 2
    rot = torch.cat([-q[..., half:], q[..., :half]], dim=-1)
    return q * cos + rot * sin


def test_glm4v_vision_position_contributions_match_transformers():
    """GLM-4V's tower (RMSNorm, SwiGLU, a conv downsampler) is not timm's ViT, so the position contributions are compared:
    the table sampled bicubically at each patch and the 2D rotary applied to q."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.glm4v.modeling_glm4v import Glm4vVisionEmbeddings, Glm4vVisionRotaryEmbedding

    torch.manual_seed(0)
    dim, heads, h, w = 32, 2, 6, 8
    cfg = transformers.Glm4vVisionConfig(hidden_size=dim, num_heads=heads, image_size=5 * 4, patch_size=4, depth=1)
    emb = Glm4vVisionEmbeddings(cfg)
    torch.nn.init.normal_(emb.position_embedding.weight)
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    rows, cols = rows.flatten(), cols.flatten()
    hf_table = emb(torch.zeros(h * w, dim), torch.tensor([h * w]), torch.tensor([[1, h, w]]), rows, cols)
    enc = create_encoding("glm4v_vision", EncodingContext(dim=dim, num_heads=heads, depth=1, grid_size=(5, 5), num_prefix_tokens=0))
    assert enc.parts[0].pos_embed.shape == (1, 25, dim)  # default table: the training grid, as GLM's image_size / patch_size
    with torch.no_grad():
        enc.parts[0].pos_embed.copy_(emb.position_embedding.weight[None])
    grid = PositionGrid((h, w), 0)
    ours = enc.embed_tokens(torch.zeros(1, h * w, dim), grid, enc.prepare(grid))[0]
    assert (ours - hf_table).abs().max() <= 1e-5
    # rotary: HF's cos / sin of (row, col) positions on q, against vispe's rotation
    rope = Glm4vVisionRotaryEmbedding(cfg)
    cos, sin = rope(hf_table, torch.stack([rows, cols], dim=-1))
    q = torch.randn(1, heads, h * w, dim // heads)
    state = enc.prepare(grid)
    ours_q = enc.parts[1].rotate(q, state[1])
    assert (ours_q - _rotate_like_hf(q, cos[None, None], sin[None, None])).abs().max() <= 1e-5


def test_qwen3vl_vision_rotary_and_table_match_transformers_on_a_video():
    """On a video each frame gets the same table and rotation (the tower's (h, w) ids repeated over t)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionRotaryEmbedding
    from transformers.vision_utils import get_vision_position_ids

    torch.manual_seed(0)
    dim, heads, t, h, w = 32, 2, 3, 4, 6
    cfg = transformers.Qwen3VLVisionConfig(hidden_size=dim, num_heads=heads, depth=1)
    enc = create_encoding("qwen3vl_vision[table_size=5]", EncodingContext(dim=dim, num_heads=heads, depth=1, grid_size=(2, 4, 4), num_prefix_tokens=0))
    ids = get_vision_position_ids(torch.tensor([[t, h, w]]), 1)  # raster order, (h, w) per token, repeated per frame
    cos, sin = Qwen3VLVisionRotaryEmbedding(cfg)(torch.zeros(1), ids)
    grid = PositionGrid((t, h, w), 0)
    state = enc.prepare(grid)
    q = torch.randn(1, heads, t * h * w, dim // heads)
    assert (enc.parts[1].rotate(q, state[1]) - _rotate_like_hf(q, cos[None, None], sin[None, None])).abs().max() <= 1e-5
    table = enc.parts[0].lattice(grid)
    torch.testing.assert_close(table[: h * w], table[h * w: 2 * h * w], rtol=0, atol=0)


def test_gemma4_vision_position_contributions_match_transformers():
    """Gemma 4's tower (sandwich RMSNorms, q/k/v norms, gated MLP) is not timm's ViT: the summed x / y tables and the
    rotated q/k are compared. Gemma's per-axis pair layout is vispe's up to the channel order of gemma4_channel_order."""
    pytest.importorskip("transformers")
    from transformers.models.gemma4.configuration_gemma4 import Gemma4VisionConfig
    from transformers.models.gemma4.modeling_gemma4 import (Gemma4VisionPatchEmbedder, Gemma4VisionRotaryEmbedding,
                                                            apply_multidimensional_rope)

    torch.manual_seed(0)
    dim, heads, dh, h, w = 32, 2, 16, 5, 7
    cfg = Gemma4VisionConfig(hidden_size=dim, num_attention_heads=heads, head_dim=dh, patch_size=4, position_embedding_size=9,
                             num_hidden_layers=1, intermediate_size=64)
    pe = Gemma4VisionPatchEmbedder(cfg)
    torch.nn.init.normal_(pe.position_embedding_table)
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    xy = torch.stack([cols.flatten(), rows.flatten()], dim=-1)[None]  # Gemma's (x, y) pixel position ids
    hf_table = pe._position_embeddings(xy, torch.zeros(1, h * w, dtype=torch.bool))[0]
    enc = create_encoding("gemma4_vision[table_size=9]", EncodingContext(dim=dim, num_heads=heads, depth=1, grid_size=(4, 4), num_prefix_tokens=0))
    with torch.no_grad():
        enc.parts[0].pos_embed.copy_(pe.position_embedding_table)
    grid = PositionGrid((h, w), 0)
    state = enc.prepare(grid)
    assert (enc.embed_tokens(torch.zeros(1, h * w, dim), grid, state)[0] - hf_table).abs().max() <= 1e-5
    cos, sin = Gemma4VisionRotaryEmbedding(cfg)(hf_table, xy)
    q = torch.randn(1, h * w, heads, dh)  # Gemma's (B, L, H, dh)
    hf_q = apply_multidimensional_rope(q, cos, sin, xy)
    order = gemma4_channel_order(dh)
    q_ours = torch.empty_like(q)
    q_ours[..., order] = q
    rotated = enc.parts[1].rotate(q_ours.transpose(1, 2), state[1]).transpose(1, 2)[..., order]
    assert (rotated - hf_q).abs().max() <= 1e-5
    assert sorted(order.tolist()) == list(range(dh))


def test_eva02at_joint_rotary_follows_the_paper():
    """EVA02-AT (no released code): pair j turns by (2D axial angle of (h, w)) + t * temporal_theta^(-j/P), written out
    here from the paper; attention logits then depend on (t, h, w) offsets only, and one frame is the 2D RoPE."""
    dim, heads, grid = 32, 2, (3, 4, 5)
    enc = create_encoding("eva02at[extrapolation='extend']", EncodingContext(dim=dim, num_heads=heads, depth=1, grid_size=grid, num_prefix_tokens=0))
    rope = enc.parts[1]
    P, Q = dim // heads // 2, dim // heads // 4
    t, hh, ww = torch.meshgrid(*(torch.arange(n, dtype=torch.float32) for n in grid), indexing="ij")
    k = torch.arange(Q, dtype=torch.float32)
    spatial = torch.cat([hh.reshape(-1, 1) * 10000.0 ** (-k / Q), ww.reshape(-1, 1) * 10000.0 ** (-k / Q)], dim=-1)
    want = spatial + t.reshape(-1, 1) * 10000.0 ** (-torch.arange(P, dtype=torch.float32) / P)
    torch.testing.assert_close(rope.angles(PositionGrid(grid, 0), None), want)
    # relative: shifting every token by one frame leaves q.k unchanged
    torch.manual_seed(0)
    q, kk = torch.randn(1, 1, 1, 2 * P), torch.randn(1, 1, 1, 2 * P)
    state = rope.prepare(PositionGrid(grid, 0))
    n = math.prod(grid[1:])
    rq, rk = rope.rotate(q.expand(1, 1, 3 * n, -1), state), rope.rotate(kk.expand(1, 1, 3 * n, -1), state)
    torch.testing.assert_close((rq[..., 0, :] * rk[..., 2, :]).sum(), (rq[..., n, :] * rk[..., n + 2, :]).sum())
    # the token part: spatial row + temporal row
    tables = enc.parts[0]
    lat = tables.lattice(PositionGrid(grid, 0))
    torch.testing.assert_close(lat[n + 3], tables.pos_embed[0, 3] + tables.temporal_embed[0, 1])


def test_benchmarks_take_composed_names():
    from vispe.benchmarks.grid import load_grid
    from vispe.benchmarks.three_cell import _resolve_encodings

    grid = load_grid("cpu", "resolution")
    assert grid.split_run_encoding("learned+rope_axial") == ("learned+rope_axial", None)
    assert grid.split_run_encoding("rope_axial+randpos") == ("rope_axial", "randpos")
    assert grid.pos_encoding("rope_axial+randpos") == "rope_axial[random_positions=2.0]"
    assert _resolve_encodings("learned+rope_axial,qwen3vl_vision", quick=False) == ["learned+rope_axial", "qwen3vl_vision"]
    with pytest.raises(ValueError, match="attention-side"):
        _resolve_encodings("rope_axial+rope_mixed", quick=False)
    with pytest.raises(ValueError, match="eva02at"):
        _resolve_encodings("eva02at", quick=False)


def test_auxiliary_losses_of_the_parts_are_summed():
    class WithLoss(vispe.encodings.TokenEncoding):
        def __init__(self, value):
            super().__init__()
            self.value = value

        def auxiliary_loss(self):
            return torch.tensor(self.value)

    comp = ComposedEncoding([WithLoss(1.5), create_encoding("rope_axial", EncodingContext(32, 2, 1, (4, 4)))])
    assert float(comp.auxiliary_loss()) == 1.5
    class OtherLoss(WithLoss):
        pass

    comp = ComposedEncoding([WithLoss(1.5), OtherLoss(2.0)])
    assert float(comp.auxiliary_loss()) == 3.5
    assert ComposedEncoding([create_encoding("learned", EncodingContext(32, 2, 1, (4, 4))),
                             create_encoding("rope_axial", EncodingContext(32, 2, 1, (4, 4)))]).auxiliary_loss() is None
