"""SeqPE as released (ghrua/seqpe, commit 4c4b9082be29a63ae44b5f967506c553b80d99bd, ``image_seqpe/models/
sequential_pe.py``: ``SequentialPE``): released-layout weights through ``load_released_seqpe`` give the released
outputs, the loader's report and strictness, the encoder options, and old vispe checkpoints still loading.

The golden figures below are outputs of the released ``SequentialPE`` (run outside this repository with torch 2.14.1,
``use_last_layernorm=True``, ``mask_padding=False``, causal, ``gelu_new``, eval mode) on the weights that
:func:`released_state_dict` builds; the released code is not needed to run these tests.
"""
from __future__ import annotations

import logging
import math

import pytest
import timm
import torch

from vispe.encodings import EncodingContext, PositionGrid, create_encoding
from vispe.models.checkpoint import load_released_seqpe, released_seqpe_options

WIDTH, HEADS, DEPTH, DIM, DIGITS = 8, 2, 2, 6, 2


def released_state_dict(final_layer_norm: bool = True, width: int = WIDTH, depth: int = DEPTH, dim: int = DIM,
                        digits: int = DIGITS) -> dict[str, torch.Tensor]:
    """A ``SequentialPE(pe_embed_dim=width, num_attention_heads=2, layer_num=depth, max_digits=digits,
    out_proj_dim=dim, data_dim=2)`` state dict in the released layout (GPT-2 ``Conv1D`` weights stored ``(in, out)``),
    with values from a fixed formula (no random generator: the same on every torch version)."""
    WIDTH, DEPTH, DIM, DIGITS = width, depth, dim, digits  # the shapes below read as the module-level ones
    shapes = {
        "pos_of_seqpe_embed.weight": (DIGITS * 2, WIDTH),
        "token_of_seqpe_embed.weight": (10, WIDTH),
        "dim_token_embed": (2, 1, WIDTH),
        "cls_token_embed": (1, 1, WIDTH),
    }
    for i in range(DEPTH):
        b = f"transformers.{i}."
        shapes.update({
            b + "attn.c_attn.weight": (WIDTH, 3 * WIDTH), b + "attn.c_attn.bias": (3 * WIDTH,),
            b + "attn.c_proj.weight": (WIDTH, WIDTH), b + "attn.c_proj.bias": (WIDTH,),
            b + "layernorm_1.weight": (WIDTH,), b + "layernorm_1.bias": (WIDTH,),
            b + "layernorm_2.weight": (WIDTH,), b + "layernorm_2.bias": (WIDTH,),
            b + "mlp.c_fc.weight": (WIDTH, 4 * WIDTH), b + "mlp.c_fc.bias": (4 * WIDTH,),
            b + "mlp.c_proj.weight": (4 * WIDTH, WIDTH), b + "mlp.c_proj.bias": (WIDTH,),
        })
    if final_layer_norm:
        shapes.update({"layernorm.weight": (WIDTH,), "layernorm.bias": (WIDTH,)})
    shapes.update({"out_proj.weight": (DIM, WIDTH), "out_proj.bias": (DIM,)})
    out = {}
    for j, (name, shape) in enumerate(shapes.items()):
        k = torch.arange(math.prod(shape), dtype=torch.float64)
        wave = torch.sin(0.731 * k + 0.0137 * k * k + 1.3 * j)  # a chirp: no low-rank structure
        value = 1.0 + 0.3 * wave if name.endswith("layernorm_1.weight") or name.endswith("layernorm_2.weight") \
            or name == "layernorm.weight" else 0.5 * wave
        if name == "out_proj.weight":  # outputs of a few units at any width (the factor is 1 at width 8)
            value = value * math.sqrt(8 / width)
        out[name] = value.float().reshape(shape)
    return out


#: positions (row, col) and the released SequentialPE's outputs there (final LayerNorm on)
POSITIONS = [(0, 0), (3, 7), (13, 13), (27, 5), (55, 55), (99, 0)]
GOLDEN = [
    [-0.5437192, 0.1362698, -0.6566333, 0.2397238, 0.6607076, -0.9012484],
    [-0.7504773, -0.1615465, -0.4754636, 0.2494594, 0.6323004, -0.9134281],
    [-0.8045885, -0.3491262, -0.3068333, 0.7283183, 1.138002, -1.107094],
    [-0.9600648, -0.3884852, -0.1525186, 1.147106, 1.434358, -0.5710883],
    [-0.3626046, 0.408517, -0.891926, 0.2936929, 0.7204942, -1.008998],
    [-1.294629, -0.3368354, -0.2872858, 0.9261136, 1.085874, -1.06553],
]
#: the same weights without the final LayerNorm (``use_last_layernorm=False``)
GOLDEN_NO_FINAL_NORM = [
    [0.4195816, -2.912439, 2.624638, 0.4127709, -0.3723579, 2.72594],
    [1.279807, -1.970395, 2.067409, 0.4153781, -0.001215556, 2.308226],
    [1.866599, -2.206636, 2.616294, -0.9836378, -1.314018, 3.837234],
    [1.848401, -2.474498, 2.960456, -2.197086, -2.286102, 2.35409],
    [-0.4048898, -3.825165, 3.426393, 0.4279601, -0.5613292, 3.461216],
    [3.570866, -3.963755, 4.001697, -1.822957, -1.406366, 4.246675],
]
#: rows 0, 10, 24, 48 of the released evaluation's table for a 7x7 grid: the 4x4 training table through
#: ``PeUtils.full_interpolation(..., mode='bicubic')`` (``F.interpolate``, ``align_corners=False``, no antialias)
INTERP_ROWS = [0, 10, 24, 48]
GOLDEN_INTERP = [
    [-0.5199105, 0.155289, -0.6674005, 0.2261439, 0.6523677, -0.8787037],
    [-0.6893181, -0.04086355, -0.5504994, 0.277941, 0.6787336, -0.9994737],
    [-0.7354103, -0.08109717, -0.5369634, 0.2918227, 0.6747552, -1.021466],
    [-0.6646226, -0.05324564, -0.5039006, 0.3685253, 0.7846774, -0.8364195],
]


def _encoding(grid=(14, 14), num_prefix_tokens=1, **kw):
    return create_encoding("seqpe", EncodingContext(DIM, HEADS, 1, grid, num_prefix_tokens),
                           encoder_dim=WIDTH, encoder_heads=HEADS, encoder_depth=DEPTH, **kw)


def _whole_checkpoint(final_layer_norm: bool = True) -> dict:
    """A released training checkpoint: the position network under ``pe_model``, the ViT under ``model``."""
    cls = 0.25 * torch.cos(torch.arange(DIM, dtype=torch.float32)).reshape(1, 1, DIM)
    return {"pe_model": released_state_dict(final_layer_norm),
            "model": {"cls_token_pos_embed": cls, "patch_embed.proj.weight": torch.zeros(DIM, 3, 4, 4)}, "epoch": 3}


def test_loader_report_transposes_the_conv1d_weights_and_keeps_the_rest():
    enc = _encoding()
    report = load_released_seqpe(enc, _whole_checkpoint())
    assert len(report.transposed) == 4 * DEPTH and all("c_attn" in t or "c_proj" in t or "c_fc" in t for t in report.transposed)
    assert len(report.kept) == 4 + 8 * DEPTH + 4 + 1  # embeddings, block biases/norms, final norm + out_proj, cls vector
    assert report.new == [] and len(report.dropped) == 1 and "not part of the positional encoding" in report.dropped[0]
    sd, released = enc.state_dict(), released_state_dict()
    assert torch.equal(sd["encoder.blocks.1.mlp.fc1.weight"], released["transformers.1.mlp.c_fc.weight"].t())
    assert torch.equal(sd["encoder.blocks.0.attn.qkv.bias"], released["transformers.0.attn.c_attn.bias"])
    assert torch.equal(sd["prefix_embed"], _whole_checkpoint()["model"]["cls_token_pos_embed"])


@pytest.mark.parametrize("final_layer_norm", [True, False])
def test_outputs_equal_the_released_sequential_pe(final_layer_norm):
    enc = _encoding(final_layer_norm=final_layer_norm).eval()
    load_released_seqpe(enc, _whole_checkpoint(final_layer_norm))
    with torch.no_grad():
        out = enc.embed_positions(torch.tensor(POSITIONS))
        table = enc.table_for(PositionGrid((56, 56), 1), torch.device("cpu"))[0]
    golden = torch.tensor(GOLDEN if final_layer_norm else GOLDEN_NO_FINAL_NORM)
    assert (out - golden).abs().max() <= 5e-6
    # the lattice table (what the model adds) holds the same vectors at those positions
    inside = [i for i, (r, c) in enumerate(POSITIONS) if r < 56 and c < 56]
    rows = torch.tensor([POSITIONS[i][0] * 56 + POSITIONS[i][1] for i in inside])
    assert (table[rows] - golden[inside]).abs().max() <= 5e-6


#: the released ``SequentialPE`` with the image recipe's size (width 384, 6 heads, 2 layers, out_proj to 384, final
#: LayerNorm on, 2 digits per axis) on ``released_state_dict(width=384, dim=384)``, run in float64 (its attention mask
#: cast to float64 too: the released code builds it in float32, where float64's ``finfo.min`` overflows): tables of
#: 14x14, 28x28 and 56x56 lattices at (row, col) -> {channel: value}, at the channels where, in float32, SDPA and
#: torch's tanh-GELU kernel rounded furthest from the released order.
#: float64 keeps the figures independent of a CPU's float32 kernels: run in float32, the released code itself gives
#: values up to 6.5e-5 apart at these channels on an AVX-512 Xeon and on an AVX2 EPYC.
GOLDEN_384 = {
    14: {(4, 5): {206: -0.816734327864, 216: 0.465211044652, 251: 0.38977118428, 252: 1.47220951802},
         (4, 7): {224: -0.19116958473, 230: -1.60393210419, 251: -0.0771105909985, 254: -0.391966911983},
         (0, 0): {15: 0.850514323184, 76: 2.00822397113, 183: -1.68680850056, 190: 1.86726826352}},
    28: {(18, 9): {163: -0.407237210825, 332: -0.0209770030312, 333: 0.0687348912537, 336: -0.383791268497},
         (16, 9): {71: 2.4607104087, 80: -0.21885462233, 96: -1.50579541487, 113: 1.1449909573},
         (27, 0): {167: -1.67975068612, 269: 1.8994371168, 342: 1.72498585901, 359: -0.118056091235}},
    56: {(42, 4): {342: 1.64025746533, 357: -1.44865327668, 364: -1.79214483345, 367: -0.646770918285},
         (40, 52): {19: 1.52727887255, 29: -0.499198039639, 35: 0.71315899371, 63: 1.8239849515},
         (55, 55): {111: 0.129344790891, 202: -1.68723095758, 253: 3.23508839965, 286: 3.07223519256}},
}


@pytest.mark.parametrize("size", sorted(GOLDEN_384))
def test_default_encoder_equals_the_released_at_image_recipe_size(size):
    """The default encoder on copied weights gives the released outputs: in float64 to 1e-9 (the same function on
    any CPU), and in float32 within float32 rounding of them (2e-4: at these channels a CPU's float32 kernels put
    the released code itself up to 6e-5 from its float64 values)."""
    enc = create_encoding("seqpe", EncodingContext(384, 6, 1, (14, 14), 0)).eval()
    report = load_released_seqpe(enc, released_state_dict(width=384, dim=384))
    assert report.new == [] and enc.num_digits == DIGITS
    for dtype, tol in ((torch.float64, 1e-9), (torch.float32, 2e-4)):
        with torch.no_grad():
            table = enc.to(dtype).table_for(PositionGrid((size, size), 0), torch.device("cpu"))[0].double()
        for (r, c), golden in GOLDEN_384[size].items():
            got = table[r * size + c, list(golden)]
            assert (got - torch.tensor(list(golden.values()), dtype=torch.float64)).abs().max() <= tol, (dtype, r, c)


def test_interpolate_is_the_released_plain_bicubic():
    enc = _encoding(grid=(4, 4), extrapolation="interpolate").eval()
    load_released_seqpe(enc, _whole_checkpoint())
    with torch.no_grad():
        table = enc.table_for(PositionGrid((7, 7), 1), torch.device("cpu"))[0]
    assert (table[INTERP_ROWS] - torch.tensor(GOLDEN_INTERP)).abs().max() <= 5e-6
    # timm's antialiased resampler (the kernel vispe used before) is another table
    anti = _encoding(grid=(4, 4), extrapolation="interpolate", antialias=True).eval()
    load_released_seqpe(anti, _whole_checkpoint())
    with torch.no_grad():
        other = anti.table_for(PositionGrid((7, 7), 1), torch.device("cpu"))[0]
    assert (other[INTERP_ROWS] - torch.tensor(GOLDEN_INTERP)).abs().max() > 1e-3


def test_defaults_are_the_released_image_recipe():
    enc = create_encoding("seqpe", EncodingContext(64, 4, 1, (8, 8)))
    norms = [m for m in enc.encoder.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(norms) == 2 * 2 + 1 and all(m.eps == 1e-5 for m in norms)  # two per block + the final one
    assert enc.encoder.final_layer_norm and enc.interpolation == "bicubic" and enc.antialias is False
    off = create_encoding("seqpe", EncodingContext(64, 4, 1, (8, 8)), final_layer_norm=False, layer_norm_eps=1e-6)
    assert isinstance(off.encoder.final_norm, torch.nn.Identity) and "encoder.final_norm.weight" not in off.state_dict()
    assert all(m.eps == 1e-6 for m in off.encoder.modules() if isinstance(m, torch.nn.LayerNorm))
    assert create_encoding("seqpe_3d", EncodingContext(64, 4, 1, (2, 4, 4))).interpolation == "trilinear"


def test_the_final_norm_and_eps_change_the_embedding():
    ref = _encoding().eval()
    load_released_seqpe(ref, _whole_checkpoint())
    eps = _encoding(layer_norm_eps=1e-6).eval()
    load_released_seqpe(eps, _whole_checkpoint())
    pos = torch.tensor(POSITIONS)
    with torch.no_grad():
        assert (ref.embed_positions(pos) - eps.embed_positions(pos)).abs().max() > 1e-6
        assert (ref.embed_positions(pos) - eps.embed_positions(pos)).abs().max() < 1e-3


@pytest.mark.parametrize("kw,match", [
    ({"layer_norm_eps": 0.0}, r"layer_norm_eps=0.0 is not valid"),
    ({"final_layer_norm": "yes"}, r"final_layer_norm='yes' is not valid; it must be True or False"),
    ({"interpolation": "lanczos"}, r"interpolation='lanczos' is not valid; choose one of \['bicubic', 'bilinear', 'nearest'"),
    ({"antialias": 1}, r"antialias=1 is not valid"),
])
def test_bad_options(kw, match):
    with pytest.raises((TypeError, ValueError), match=match):
        create_encoding("seqpe", EncodingContext(16, 2, 1, (4, 4)), **kw)


def test_bad_options_3d():
    ctx = EncodingContext(16, 2, 1, (2, 4, 4))
    with pytest.raises(ValueError, match=r"interpolation='bicubic' is not valid; choose one of \['trilinear', 'nearest'"):
        create_encoding("seqpe_3d", ctx, interpolation="bicubic")
    with pytest.raises(ValueError, match=r"antialias=True is 2D only"):
        create_encoding("seqpe_3d", ctx, antialias=True)


# -- strictness (as load_timm_checkpoint) -------------------------------------------------------------------
def test_loader_refuses_a_dict_that_keeps_nothing_and_leaves_the_encoding_alone():
    enc = _encoding()
    before = {k: v.clone() for k, v in enc.state_dict().items()}
    with pytest.raises(ValueError, match=r"keeps nothing of the seqpe encoding: 0 of \d+ encoding tensors.*not a released SeqPE"):
        load_released_seqpe(enc, {"blocks.0.norm1.weight": torch.ones(8)})
    assert all(torch.equal(v, enc.state_dict()[k]) for k, v in before.items())
    with pytest.raises(TypeError, match=r"needs a 'seqpe' / 'seqpe_3d' encoding"):
        load_released_seqpe(create_encoding("learned", EncodingContext(16, 2, 1, (4, 4))), released_state_dict())


def test_loader_refuses_partial_loads_naming_keys_and_options():
    # the module state dict alone has no cls vector: prefix_embed would stay newly initialised
    with pytest.raises(ValueError, match=r"fits the seqpe encoding only in part: 1 encoding tensors would stay newly initialised \(prefix_embed\)"):
        load_released_seqpe(_encoding(), released_state_dict())
    report = load_released_seqpe(_encoding(), released_state_dict(), allow_partial=True)
    assert report.new == ["prefix_embed"]
    # weights trained without the final LayerNorm into an encoding with one: named, with the option they need
    with pytest.raises(ValueError, match=r"encoder\.final_norm\.weight.*need final_layer_norm=False \(this encoding has final_layer_norm=True\)"):
        load_released_seqpe(_encoding(), _whole_checkpoint(final_layer_norm=False))
    assert load_released_seqpe(_encoding(final_layer_norm=False), _whole_checkpoint(final_layer_norm=False)).new == []
    # other sizes: the misfit tensors are named
    with pytest.raises(ValueError, match=r"do not fit \(pos_of_seqpe_embed.weight \(checkpoint \(4, 8\) vs encoding encoder.slot_embed.weight \(4, 16\)\).*"
                       r"need encoder_dim=8 \(this encoding has encoder_dim=16\)"):
        load_released_seqpe(create_encoding("seqpe", EncodingContext(DIM, 2, 1, (14, 14)), encoder_dim=16, encoder_heads=2),
                            _whole_checkpoint())
    options = released_seqpe_options(_whole_checkpoint())
    assert options == {"final_layer_norm": True, "base": 10, "encoder_dim": WIDTH, "num_axes": 2, "num_digits": DIGITS,
                       "encoder_depth": DEPTH, "dim": DIM}


def test_loader_reads_files_and_models(tmp_path):
    path = tmp_path / "released.pth"
    torch.save(_whole_checkpoint(), path)
    model = timm.create_model("vispe_vit_tiny_patch4_32", depth=1, embed_dim=DIM, num_heads=2, pos_encoding={
        "name": "seqpe", "encoder_dim": WIDTH, "encoder_heads": HEADS, "encoder_depth": DEPTH})
    report = load_released_seqpe(model, path)
    assert report.new == [] and torch.equal(model.pos_encoding.state_dict()["encoder.out_proj.weight"],
                                            released_state_dict()["out_proj.weight"])
    with pytest.raises(FileNotFoundError):
        load_released_seqpe(model, tmp_path / "missing.pth")


# -- old vispe checkpoints --------------------------------------------------------------------------------
def _old_vispe_state_dict(enc) -> dict:
    """What a vispe ``seqpe`` saved before ``layer_norm_eps`` / ``final_layer_norm`` existed looks like: no
    ``encoder.final_norm.*`` and the encoder's state-dict version 1."""
    sd = enc.state_dict()
    for k in ("encoder.final_norm.weight", "encoder.final_norm.bias"):
        sd.pop(k, None)
    sd._metadata["encoder"]["version"] = 1
    return sd


def test_old_vispe_checkpoints_load_and_compute_what_they_computed(caplog):
    torch.manual_seed(0)
    old = _encoding(final_layer_norm=False, layer_norm_eps=1e-6).eval()
    with torch.no_grad():
        for p in old.parameters():
            p.add_(torch.randn_like(p) * 0.3)
        want = old.embed_positions(torch.tensor(POSITIONS))
    sd = _old_vispe_state_dict(old)
    new = _encoding().eval()  # today's defaults: final norm on, eps 1e-5
    with caplog.at_level(logging.WARNING, logger="vispe"):
        missing, unexpected = new.load_state_dict(sd)  # strict: no missing keys
    assert not missing and not unexpected
    assert not new.encoder.final_layer_norm
    assert all(m.eps == 1e-6 for m in new.encoder.modules() if isinstance(m, torch.nn.LayerNorm))
    assert "final_layer_norm=False" in caplog.text and "eps 1e-6" in caplog.text
    with torch.no_grad():
        assert torch.equal(new.embed_positions(torch.tensor(POSITIONS)), want)
    # a state dict without metadata (safetensors) and without the final norm: the norm is switched off, eps kept
    plain = dict(sd)
    fresh = _encoding().eval()
    fresh.load_state_dict(plain)
    assert not fresh.encoder.final_layer_norm
    assert all(m.eps == 1e-5 for m in fresh.encoder.modules() if isinstance(m, torch.nn.LayerNorm))
    # today's checkpoints round-trip unchanged
    current = _encoding()
    again = _encoding()
    again.load_state_dict(current.state_dict())
    assert again.encoder.final_layer_norm and torch.equal(again.encoder.final_norm.weight, current.encoder.final_norm.weight)
