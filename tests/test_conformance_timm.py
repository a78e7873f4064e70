"""Conformance with timm >= 1.0.31 as installed (the oracle): vispe's ``rope_axial`` / ``rope_mixed`` /
``rope_dinov3`` against timm's ``RotaryEmbeddingCat`` / ``RotaryEmbeddingMixed`` / ``RotaryEmbeddingDinoV3`` with
each ``grid_type``, ``normalize_coords`` and coordinate augmentation (same coordinates, same rotations, the same
seed giving the same draws), and the ``qwen3vl_vision`` tower against timm's ``qwen3_vit`` on copied weights.

Skipped as a whole when the installed timm is older than 1.0.31 (its RoPE coordinate options and ``qwen3_vit``
appeared there). Every compared setting is listed in ``docs/conformance.md``.
"""
from __future__ import annotations

import pytest
import timm
import torch
from packaging.version import Version

TIMM_MIN = "1.0.31"
pytestmark = pytest.mark.skipif(Version(timm.__version__) < Version(TIMM_MIN),
                                reason=f"timm {timm.__version__} is older than {TIMM_MIN} (the oracle's RoPE options)")

from vispe.encodings import EncodingContext, PositionGrid, create_encoding  # noqa: E402
from vispe.encodings.rope_vit import lattice_coordinates  # noqa: E402

HEADS, HEAD_DIM = 2, 16
GRIDS = [(4, 4), (3, 5)]
#: (timm grid_type, normalize_coords): timm reads normalize_coords for 'centered' grids only
COORDS = [("index", "separate"), ("pixel", "separate"), ("centered", "separate"), ("centered", "min"), ("centered", "max")]
#: timm's augmentation keywords -> vispe's; each alone and all three
AUGS = [{}, {"shift_coords": 0.75}, {"jitter_coords": 1.5}, {"rescale_coords": 2.0},
        {"shift_coords": 0.75, "jitter_coords": 1.5, "rescale_coords": 2.0}]
TO_VISPE = {"shift_coords": "coord_shift", "jitter_coords": "coord_jitter", "rescale_coords": "coord_rescale"}


def _vispe_aug(aug: dict) -> dict:
    return {TO_VISPE[k]: v for k, v in aug.items()} | ({"coord_aug_style": "timm"} if aug else {})


def _qk(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(2, HEADS, n, HEAD_DIM, generator=torch.Generator().manual_seed(seed))


def _ctx(grid, depth: int = 1) -> EncodingContext:
    return EncodingContext(HEADS * HEAD_DIM, HEADS, depth, grid, 0)


def _rotate_both(enc, timm_embed, shape, layer: int = 0, half: bool = False, seed: int = 7):
    """Rotate the same q by vispe's encoding and by timm's table, each after the same seed."""
    from timm.layers.pos_embed_sincos import apply_rot_embed_cat

    q = _qk(shape[0] * shape[1])
    torch.manual_seed(seed)
    ref = apply_rot_embed_cat(q, timm_embed(), half=half)
    torch.manual_seed(seed)
    enc.clear_cache()
    out = enc.rotate(q, enc.prepare(PositionGrid(shape, 0)), layer)
    return out, ref


# -- rope_axial vs RotaryEmbeddingCat ----------------------------------------------------------------------
@pytest.mark.parametrize("grid_type,normalize", COORDS)
@pytest.mark.parametrize("shape", GRIDS)
def test_coordinates_equal_timm_build_grid(grid_type, normalize, shape):
    from timm.layers.pos_embed_sincos import _build_grid

    ref = _build_grid(list(shape), grid_type=grid_type, normalize_coords=normalize).reshape(-1, 2)
    mine = lattice_coordinates(PositionGrid(shape, 0), grid_type, normalize)
    assert torch.equal(mine, ref)


@pytest.mark.parametrize("aug", AUGS, ids=lambda a: "+".join(a) or "none")
@pytest.mark.parametrize("grid_type,normalize", COORDS)
@pytest.mark.parametrize("shape", GRIDS)
def test_rope_axial_equals_timm_rotary_embedding_cat(shape, grid_type, normalize, aug):
    from timm.layers.pos_embed_sincos import RotaryEmbeddingCat

    rope = RotaryEmbeddingCat(HEAD_DIM, temperature=100.0, in_pixels=False, grid_indexing="xy", grid_type=grid_type,
                              normalize_coords=normalize, **aug)
    enc = create_encoding("rope_axial", _ctx(shape), theta=100.0, grid_type=grid_type, normalize_coords=normalize,
                          **_vispe_aug(aug))
    for train in (False, True):  # augmentation draws in training only, in both
        rope.train(train), enc.train(train)
        out, ref = _rotate_both(enc, lambda: rope.get_embed(list(shape)), shape)
        assert (out - ref).abs().max() <= 1e-6, (train, (out - ref).abs().max())
    if aug:  # the draws matter: another seed gives another rotation
        torch.manual_seed(8)
        other = enc.rotate(_qk(shape[0] * shape[1]), enc.prepare(PositionGrid(shape, 0)))
        assert (other - out).abs().max() > 1e-3


@pytest.mark.parametrize("aug", [AUGS[0], AUGS[-1]], ids=["none", "all"])
@pytest.mark.parametrize("grid_type,normalize", [("index", "separate"), ("centered", "max")])
def test_rope_axial_row_first_equals_timm_ij_indexing(grid_type, normalize, aug):
    """timm's ``grid_indexing='ij'`` (rows first, the Qwen vision layout) is vispe's ``chunk_axes=(0, 1)``."""
    from timm.layers.pos_embed_sincos import RotaryEmbeddingCat

    shape = (3, 5)
    rope = RotaryEmbeddingCat(HEAD_DIM, temperature=100.0, in_pixels=False, grid_indexing="ij", grid_type=grid_type,
                              normalize_coords=normalize, **aug)
    enc = create_encoding("rope_axial", _ctx(shape), theta=100.0, chunk_axes=(0, 1), grid_type=grid_type,
                          normalize_coords=normalize, **_vispe_aug(aug))
    for train in (False, True):
        rope.train(train), enc.train(train)
        out, ref = _rotate_both(enc, lambda: rope.get_embed(list(shape)), shape)
        assert (out - ref).abs().max() <= 1e-6


@pytest.mark.parametrize("shape", [(6, 6), (3, 5), (8, 4)])
def test_rope_axial_interpolate_equals_timm_ref_feat_shape(shape):
    """vispe's ``extrapolation='interpolate'`` (indices times ``train / size``) is timm's Eva rescale to the
    pre-training grid (``ref_feat_shape``), up to the order of one float32 multiply and divide."""
    from timm.layers.pos_embed_sincos import RotaryEmbeddingCat

    train = (4, 4)
    rope = RotaryEmbeddingCat(HEAD_DIM, temperature=100.0, in_pixels=False, grid_indexing="xy", ref_feat_shape=list(train))
    enc = create_encoding("rope_axial", _ctx(train), theta=100.0, extrapolation="interpolate")
    out, ref = _rotate_both(enc, lambda: rope.get_embed(list(shape)), shape)
    assert (out - ref).abs().max() <= 1e-5
    extend = create_encoding("rope_axial", _ctx(train), theta=100.0)  # the policies differ: the comparison can fail
    assert (extend.rotate(_qk(shape[0] * shape[1]), extend.prepare(PositionGrid(shape, 0))) - ref).abs().max() > 1e-2


def test_rope_axial_bf16_keeps_float32_frequencies_as_timm():
    from timm.layers.pos_embed_sincos import RotaryEmbeddingCat

    shape = (6, 6)
    rope = RotaryEmbeddingCat(HEAD_DIM, temperature=100.0, in_pixels=False, grid_indexing="xy").to(torch.bfloat16)
    assert rope.bands.dtype == torch.float32
    enc = create_encoding("rope_axial", _ctx(shape), theta=100.0).to(torch.bfloat16)
    out, ref = _rotate_both(enc, lambda: rope.get_embed(list(shape)), shape)
    assert (out - ref).abs().max() <= 1e-6


# -- rope_mixed vs RotaryEmbeddingMixed ----------------------------------------------------------------------
@pytest.mark.parametrize("aug", AUGS, ids=lambda a: "+".join(a) or "none")
@pytest.mark.parametrize("shape", GRIDS)
def test_rope_mixed_equals_timm_rotary_embedding_mixed(shape, aug):
    from timm.layers.pos_embed_sincos import RotaryEmbeddingMixed

    depth = 2
    torch.manual_seed(0)
    rope = RotaryEmbeddingMixed(HEADS * HEAD_DIM, depth=depth, num_heads=HEADS, temperature=10.0, grid_indexing="xy", **aug)
    enc = create_encoding("rope_mixed", _ctx(shape, depth), theta=10.0, **_vispe_aug(aug))
    with torch.no_grad():
        enc.freqs.copy_(rope.freqs)  # the same (2, depth, heads, P) layout, (f_x, f_y)
    for train in (False, True):
        rope.train(train), enc.train(train)
        for layer in range(depth):
            out, ref = _rotate_both(enc, lambda: rope.get_embed(list(shape))[layer], shape, layer=layer)
            assert (out - ref).abs().max() <= 1e-6, (train, layer, (out - ref).abs().max())


# -- rope_dinov3 vs RotaryEmbeddingDinoV3 ---------------------------------------------------------------------
@pytest.mark.parametrize("aug", AUGS, ids=lambda a: "+".join(a) or "none")
@pytest.mark.parametrize("normalize", ["separate", "min", "max"])
@pytest.mark.parametrize("shape", GRIDS)
def test_rope_dinov3_equals_timm_rotary_embedding_dinov3(shape, normalize, aug):
    from timm.layers.pos_embed_sincos import RotaryEmbeddingDinoV3

    rope = RotaryEmbeddingDinoV3(HEAD_DIM, temperature=100.0, normalize_coords=normalize, **aug)
    enc = create_encoding("rope_dinov3", _ctx(shape), base=100.0, normalize_coords=normalize, **aug)
    for train in (False, True):
        rope.train(train), enc.train(train)
        out, ref = _rotate_both(enc, lambda: rope.get_embed(list(shape)), shape, half=True)
        assert (out - ref).abs().max() <= 1e-6, (train, (out - ref).abs().max())


# -- qwen3vl_vision vs timm's qwen3_vit --------------------------------------------------------------------------
@pytest.mark.parametrize("grid", [(5, 5), (4, 4), (6, 4), (3, 7)])
def test_qwen3vl_vision_tower_equals_timm_qwen3_vit(grid):
    """A vispe ViT with ``qwen3vl_vision`` and timm's ``Qwen3VitEncoder`` (learned 5 x 5 table resampled bilinearly
    with ``align_corners=True`` + axial RoPE, 'half' layout) on the same weights: the same patch features."""
    from timm.models.qwen3_vit import Qwen3VitEncoder

    from vispe.models import VispeVisionTransformer

    torch.manual_seed(0)
    p, side, dim, heads = 4, 5, 32, 2
    ref = Qwen3VitEncoder(img_size=side * p, patch_size=p, embed_dim=dim, depth=2, num_heads=heads, mlp_ratio=2.0,
                          pos_embed_grid_size=side, global_pool="").eval()
    with torch.no_grad():  # weights large enough that attention is far from uniform: position errors show in the output
        for name, param in ref.named_parameters():
            param.normal_(0, 0.5 if "qkv" in name else 0.2)
    ours = VispeVisionTransformer(pos_encoding=f"qwen3vl_vision[table_size={side}]", img_size=(grid[0] * p, grid[1] * p),
                                  patch_size=p, embed_dim=dim, depth=2, num_heads=heads, mlp_ratio=2.0, class_token=False,
                                  global_pool="avg", act_layer="gelu_tanh", num_classes=0).eval()
    sd = {("pos_encoding.parts.0.pos_embed" if k == "pos_embed" else k): v for k, v in ref.state_dict().items()
          if not k.startswith("rope.")}
    missing, unexpected = ours.load_state_dict(sd, strict=False)
    assert not unexpected and all(k.startswith(("norm.", "head", "fc_norm")) for k in missing), missing
    image = torch.randn(2, 3, grid[0] * p, grid[1] * p)
    with torch.no_grad():
        want = ref.forward_features(image).flatten(1, 2)  # (B, H*W, C), no final norm
        x, g, state = ours.embed_with_state(image)
        for _, x in ours.iter_blocks(x, g, state=state):
            pass
    assert (x - want).abs().max() <= 1e-5, (x - want).abs().max()
    assert want.std() > 0.1  # not a degenerate comparison
