"""LOOPE: Gilbert order (every cell once, unit steps, inverse permutation), sinusoid of the order,
bounded image-conditioned offset, size-agnostic head, grids, bf16, parameter counts, bad input."""
from __future__ import annotations

import pytest
import timm
import torch

import vispe  # noqa: F401
from vispe.encodings import EncodingContext, PositionGrid, create_encoding
from vispe.encodings.gilbert import gilbert_order, gilbert_path
from vispe.encodings.loope import sinusoid_1d
from vispe.models.checkpoint import load_released_loope

MODEL = "vispe_vit_tiny_patch4_32"


def _loope(dim=16, grid=(4, 4), patch=(4, 4), **kw):
    return create_encoding("loope", EncodingContext(dim, 1, 1, grid, patch_size=patch), **kw)  # one head: dim may be odd


@pytest.mark.parametrize("h,w", [(h, w) for h in range(1, 13) for w in range(1, 13)] + [(14, 14), (7, 24), (24, 7), (15, 20), (20, 15), (33, 31)])
def test_gilbert_visits_every_cell_once_with_unit_steps(h, w):
    path = gilbert_path(h, w)
    assert len(path) == h * w and len(set(path)) == h * w
    assert all(0 <= r < h and 0 <= c < w for r, c in path)
    assert all(abs(r1 - r2) + abs(c1 - c2) == 1 for (r1, c1), (r2, c2) in zip(path, path[1:]))
    order = gilbert_order(h, w)
    # inverse permutation: patch p (row-major) is visited at step order[p]
    for step, (r, c) in enumerate(path):
        assert order[r * w + c] == step


def test_gilbert_square_starts_along_x_and_is_local():
    path = gilbert_path(8, 8)
    assert path[0] == (0, 0) and path[-1] == (0, 7)  # major axis x: from the top-left to the top-right corner
    # Hilbert-like locality: each aligned 2x2 quad of an 8x8 grid is visited in 4 consecutive steps
    order = gilbert_order(8, 8).reshape(8, 8)
    for i in range(0, 8, 2):
        for j in range(0, 8, 2):
            q = order[i : i + 2, j : j + 2].flatten().sort().values
            assert (q[-1] - q[0]).item() == 3


def test_fixed_order_is_sinusoid_of_curve_step():
    enc = _loope(offset=False)
    grid = PositionGrid((4, 4), 1)
    x = torch.zeros(1, 17, 16)
    full = enc.embed_tokens(x, grid)[0]
    pe = full[1:]
    xg = gilbert_order(4, 4).float() + 1  # counted from 1, as released
    assert torch.allclose(pe[:, 0], torch.sin(xg), atol=1e-6) and torch.allclose(pe[:, 1], torch.cos(xg), atol=1e-6)
    w1 = 10000 ** (-2 / 16)
    assert torch.allclose(pe[:, 2], torch.sin(xg * w1), atol=1e-6) and torch.allclose(pe[:, 3], torch.cos(xg * w1), atol=1e-6)
    assert torch.allclose(full[0], sinusoid_1d(torch.zeros(1), 16)[0])  # released: cls at position 0
    assert sum(p.numel() for p in enc.parameters()) == 0
    learned = _loope(offset=False, fixed_prefix="learned")
    assert sum(p.numel() for p in learned.parameters()) == 16 and learned.embed_tokens(x, grid)[0, 0].abs().sum() == 0


def test_offset_is_bounded_image_conditioned_and_differentiable():
    torch.manual_seed(0)
    enc = _loope()
    grid = PositionGrid((4, 4), 1)
    img = torch.randn(3, 3, 16, 16)
    off = enc.positions(grid, img, None) - gilbert_order(4, 4).float() - 1
    assert off.shape == (3, 16) and (off.abs() < 1).all() and off.abs().max() > 0.05
    big = _loope()
    with torch.no_grad():
        for p in big.context.parameters():
            p.mul_(50)  # saturate the squashing: still bounded (float32 may round to exactly +-1)
        off_big = big.positions(grid, img, None) - gilbert_order(4, 4).float() - 1
    assert torch.isfinite(off_big).all() and (off_big.abs() <= 1).all() and off_big.abs().max() > 0.9
    assert not torch.allclose(off[0], off[1])  # per image
    out = enc.embed_tokens(torch.zeros(3, 17, 16), grid, image=img)
    (out * torch.randn_like(out)).sum().backward()  # not out.square(): sin^2 + cos^2 is constant
    assert enc.context.cnn[0].weight.grad.abs().sum() > 0


def test_size_agnostic_default_and_linear_head_error():
    torch.manual_seed(0)
    enc = _loope()  # grid (4, 4), N_train = 16
    grid = PositionGrid((6, 10), 1)
    xg = enc.curve_positions(grid, None)
    assert xg.min() == 1 and abs(xg.max().item() - 16) < 1e-5  # normalised: spans the training range 1..16
    out = enc.embed_tokens(torch.zeros(2, grid.seq_len, 16), grid, image=torch.randn(2, 3, 24, 40))
    assert out.shape == (2, 61, 16) and torch.isfinite(out).all()
    raw = _loope(order_scale="index")
    assert raw.curve_positions(grid, None).max() == 60
    lin = _loope(head="linear")
    lin.embed_tokens(torch.zeros(1, 17, 16), PositionGrid((4, 4), 1), image=torch.randn(1, 3, 16, 16))
    with pytest.raises(ValueError, match="head='local'"):
        lin.embed_tokens(torch.zeros(1, 61, 16), grid, image=torch.randn(1, 3, 24, 40))


@pytest.mark.parametrize("opts", [{"offset": False}])  # defaults: tests/test_encoding_contracts.py
def test_forward_backward_grids_and_bf16(opts):
    model = timm.create_model(MODEL, pos_encoding={"name": "loope", **opts}, depth=1)
    for hw in [(32, 32), (48, 48), (32, 56)]:
        model.zero_grad()
        model(torch.randn(2, 3, *hw)).sum().backward()
        assert all(p.grad is not None for p in model.pos_encoding.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(2, 3, 40, 32))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_dynamic_img_pad():
    model = timm.create_model(MODEL, pos_encoding="loope", depth=1, dynamic_img_pad=True)
    assert model(torch.randn(1, 3, 30, 35)).shape == (1, 10)


def test_param_count_vit_b():
    # code version: convs 57,921 + BN 2 + Linear 196x196 (no bias) 38,416 + cls 768 = 97,107
    with torch.device("meta"):
        code = timm.create_model("vispe_vit_base_patch16_224", pos_encoding={"name": "loope", "head": "linear"})
        paper = timm.create_model("vispe_vit_base_patch16_224", pos_encoding={"name": "loope", "head": "linear", "linear_bias": True})
        local = timm.create_model("vispe_vit_base_patch16_224", pos_encoding="loope")
        fixed = timm.create_model("vispe_vit_base_patch16_224", pos_encoding={"name": "loope", "offset": False})
    count = lambda m: sum(p.numel() for p in m.pos_encoding.parameters())  # noqa: E731
    assert count(code) == 97_107 and count(paper) == 97_107 + 196
    assert count(local) == 57_921 + 2 + 3 + 768 and count(fixed) == 0  # fixed: cls gets the sinusoid of 0


def test_sinusoid_shape_and_bad_input():
    assert sinusoid_1d(torch.arange(5.0), 8).shape == (5, 8)
    with pytest.raises(ValueError, match="even"):
        _loope(dim=15)
    with pytest.raises(ValueError, match=r"head='mlp' is not valid; choose one of \['local', 'linear'\]"):
        _loope(head="mlp")
    with pytest.raises(ValueError, match="order_scale"):
        _loope(order_scale="raw")
    with pytest.raises(ValueError, match="image"):
        _loope().embed_tokens(torch.zeros(1, 17, 16), PositionGrid((4, 4), 1))


# --- the released code's conventions (AbtahiMajeed144/LOOPE, models/positional_encodings/hilbert.py, art_pe.py) ---
# Golden figures below were computed by running the released gilbert_2d / ArtPE on the stated inputs.
RELEASED_GILBERT_4x5 = [[1, 2, 18, 19, 20], [4, 3, 17, 16, 15], [5, 8, 9, 14, 13], [6, 7, 10, 11, 12]]  # gilbert_2d(5, 4)
RELEASED_GILBERT_6x4 = [[1, 2, 23, 24], [4, 3, 22, 21], [5, 6, 19, 20], [8, 7, 18, 17], [9, 12, 13, 16], [10, 11, 14, 15]]


@pytest.mark.parametrize("golden", [RELEASED_GILBERT_4x5, RELEASED_GILBERT_6x4])
def test_curve_positions_match_released_gilbert_2d(golden):
    h, w = len(golden), len(golden[0])
    enc = _loope(grid=(h, w), offset=False, order_scale="index")
    pos = enc.curve_positions(PositionGrid((h, w), 1), None)
    assert pos[0].item() == 1  # the first patch sits at position 1 (main before issue 27: 0)
    assert pos.tolist() == [float(v) for row in golden for v in row]
    # vispe's rectangle variant is an option: unit steps on a taller-than-wide or odd-by-even grid
    adaptive = _loope(grid=(h, w), offset=False, order_scale="index", orientation="adaptive", curve_start=0)
    assert adaptive.curve_positions(PositionGrid((h, w), 1), None).tolist() == gilbert_order(h, w).float().tolist()
    assert adaptive.curve_positions(PositionGrid((h, w), 1), None).tolist() != [v - 1.0 for row in golden for v in row]


def test_released_orientation_visits_every_cell_once():
    for h in range(1, 10):
        for w in range(1, 10):
            path = gilbert_path(h, w, "released")
            assert len(set(path)) == h * w and all(0 <= r < h and 0 <= c < w for r, c in path)
            if h == w:
                assert path == gilbert_path(h, w, "adaptive")  # identical on squares


def _released_artpe_state_dict(dim=8, img=64, patch=16):
    """A state dict with the released ArtPE's names and shapes (4x4 grid), filled with fixed deterministic
    values: parameter ``i`` (in ArtPE.named_parameters() order) = ``sin(0.37 k + i)``, scaled."""
    n = (img // patch) ** 2
    shapes = {
        "cls_token": (1, dim),
        "art_conv.0.weight": (32, 5, patch, patch), "art_conv.0.bias": (32,),
        "art_conv.2.weight": (16, 32, 5, 5), "art_conv.2.bias": (16,),
        "art_conv.4.weight": (8, 16, 5, 5), "art_conv.4.bias": (8,),
        "art_conv.6.weight": (4, 8, 5, 5), "art_conv.6.bias": (4,),
        "art_conv.8.weight": (1, 4, 5, 5), "art_conv.8.bias": (1,),
        "art_conv.10.weight": (1,), "art_conv.10.bias": (1,),
        "art_conv.12.weight": (n, n),
    }
    sd = {}
    for i, (k, shape) in enumerate(shapes.items()):
        numel = torch.Size(shape).numel()
        sd[k] = (torch.sin(torch.arange(numel, dtype=torch.float64) * 0.37 + i).reshape(shape) * (0.3 if len(shape) > 1 else 0.1)).float()
    ys = torch.linspace(-1, 1, img)
    sd["cord"] = torch.stack(torch.meshgrid(ys, ys, indexing="ij"))
    sd["wrap_pos_hilbert"] = (gilbert_order(4, 4, orientation="released") + 1).float()[:, None]
    sd["div_term"] = (10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim))[None]
    sd["art_conv.10.running_mean"] = torch.tensor([0.05])
    sd["art_conv.10.running_var"] = torch.tensor([0.7])
    sd["art_conv.10.num_batches_tracked"] = torch.tensor(0)
    return sd


# released ArtPE(17, 8, img_size=64, patch_size=16).eval() with the state dict above, on
# x = cos(0.013 k).reshape(2, 3, 64, 64): output[0, 1:, 0] and output[0, 1:, 1]
RELEASED_ARTPE_SIN = [0.828071, 0.916516, 0.656892, -0.289222, -0.76414, 0.121545, 0.993785, 0.445536,
                      -0.950916, 0.985861, 0.398625, -0.532131, -0.284153, 0.645998, -0.525312, -0.999747]
RELEASED_ARTPE_COS = [0.560624, -0.399998, -0.753985, -0.957262, -0.645051, -0.992586, 0.11132, 0.895264,
                      0.309449, -0.167563, -0.917114, 0.846662, 0.958779, 0.763339, -0.85091, -0.022479]


@pytest.mark.parametrize("channel_order", ["image_yx", "xy_image"])
def test_released_artpe_state_dict_loads_and_matches(channel_order):
    sd = _released_artpe_state_dict()
    enc = _loope(dim=8, grid=(4, 4), patch=(16, 16), head="linear", order_scale="index", channel_order=channel_order)
    report = load_released_loope(enc, sd)
    assert report.new == [] and len(report.kept) + len(report.permuted) == 17
    assert report.permuted == ([] if channel_order == "image_yx" else ["art_conv.0.weight -> context.cnn.0.weight (channels (R,G,B,y,x) -> (x,y,R,G,B))"])
    assert sorted(report.dropped) == sorted(f"{k} (recomputed from the grid)" for k in ("cord", "wrap_pos_hilbert", "div_term"))
    assert report.adapted == []  # the checkpoint's curve and frequencies agree with the encoding's
    enc.eval()
    x = torch.cos(torch.arange(2 * 3 * 64 * 64, dtype=torch.float64) * 0.013).reshape(2, 3, 64, 64).float()
    out = enc.embed_tokens(torch.zeros(2, 17, 8), PositionGrid((4, 4), 1), image=x)
    # main before issue 27 (0-based curve, channels permuted by hand): max |diff| 0.958 over the whole output
    assert torch.allclose(out[0, 1:, 0], torch.tensor(RELEASED_ARTPE_SIN), atol=5e-6)
    assert torch.allclose(out[0, 1:, 1], torch.tensor(RELEASED_ARTPE_COS), atol=5e-6)
    assert torch.equal(out[:, 0], sd["cls_token"].expand(2, -1))


def test_released_loader_whole_model_and_mismatches():
    sd = {f"pos_embedding.{k}": v for k, v in _released_artpe_state_dict().items()}
    sd["model.vit.embeddings.patch_embeddings.projection.weight"] = torch.zeros(8, 3, 16, 16)
    model = timm.create_model("vispe_vit_tiny_patch16_224", img_size=64, embed_dim=8, num_heads=2, depth=1,
                              pos_encoding={"name": "loope", "head": "linear", "order_scale": "index", "curve_start": 0})
    report = load_released_loope(model, sd)
    assert any(d.startswith("model.vit.embeddings") for d in report.dropped)
    assert any("wrap_pos_hilbert" in a for a in report.adapted)  # 0-based curve: the report says it differs
    assert torch.equal(model.pos_encoding.context.head.weight, sd["pos_embedding.art_conv.12.weight"])
    local = _loope(dim=8, grid=(4, 4), patch=(16, 16))  # head='local': the Linear(N, N) has nowhere to go
    with pytest.raises(ValueError, match=r"fits the loope encoding only in part") as info:
        load_released_loope(local, _released_artpe_state_dict())
    assert "need order_scale='index', head='linear'" in str(info.value)
    assert "this encoding has order_scale='normalized', head='local'" in str(info.value)
    before = local.context.head.weight.detach().clone()
    assert torch.equal(local.context.head.weight, before)  # refused: nothing was loaded
    report = load_released_loope(local, _released_artpe_state_dict(), allow_partial=True)  # the part that fits, on request
    assert any(d.startswith("art_conv.12.weight") for d in report.dropped)
    assert "context.head.weight" in report.new and "context.head.bias" in report.new


@pytest.mark.parametrize("opt,value", [("curve_start", 2), ("orientation", "tall"), ("channel_order", "rgbxy"), ("fixed_prefix", "zeros")])
def test_released_convention_options_bad_input(opt, value):
    with pytest.raises(ValueError, match=opt):
        _loope(**{opt: value})
