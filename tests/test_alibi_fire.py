"""ALiBi (``alibi_2d`` / ``alibi_3d``) and FIRE (``fire`` / ``fire_3d``) attention biases on patch lattices.

Properties: ALiBi's slopes are Press et al.'s formula; its bias is ``-slope * distance`` on a worked example,
symmetric, and zero for prefix pairs; both biases depend only on the lattice offset; FIRE's bias equals a naive
per-pair evaluation of ``f_theta(psi(d) / psi(max(L, E)))``, its MLP inputs stay in ``[0, 1]`` at every grid
(reaching 1 at the training grid and beyond); attention through SDPA's float mask equals explicit
``softmax(q k^T s + bias) v`` (values and gradients); gradients reach FIRE's MLP, ``c`` and ``L``; image and
video ViTs train at three grids, under bf16 autocast and with patch dropout.
"""
from __future__ import annotations

import math

import pytest
import timm
import torch

import vispe
from bias_checks import attention_inputs
from vispe.encodings import EncodingContext, PositionGrid, create_encoding, get_encoding_class
from vispe.encodings.alibi import alibi_slopes
from vispe.encodings.lattice_bias import lattice_offsets
from vispe.encodings.fire import fire_inputs, lattice_extent
from vispe.models.video_vit import VispeVideoViT

IMAGE = "vispe_vit_tiny_patch4_32"  # 8 x 8 training grid at 32 px
VIDEO = dict(embed_dim=48, depth=2, num_heads=2, img_size=32, num_frames=8, tubelet_size=2, patch_size=8, num_classes=5)


def _ctx(grid, heads=2, head_dim=8, depth=2, prefix=1) -> EncodingContext:
    return EncodingContext(dim=heads * head_dim, num_heads=heads, depth=depth, grid_size=tuple(grid), num_prefix_tokens=prefix)


def _bias(enc, grid: PositionGrid, layer: int = 0) -> torch.Tensor:
    """The encoding's additive term for ``grid`` as ``(H, L, L)``."""
    state = enc.prepare(grid)
    k = torch.zeros(1, enc.num_heads, grid.seq_len, 4)
    return enc.bias(k, k, layer=layer, state=state)[0]


def _image_model(spec: str, **kw) -> torch.nn.Module:
    return timm.create_model(IMAGE, pos_encoding=spec, depth=2, embed_dim=64, num_heads=4, num_classes=5, **kw)


def _coords(shape):
    return [tuple(int(v) for v in c) for c in PositionGrid(shape).indices().long()]


# ---------------------------------------------------------------------------------------------
# ALiBi: slopes and worked examples
# ---------------------------------------------------------------------------------------------
def test_alibi_slopes_follow_press_et_al():
    # H = 8: 1/2, 1/4, ..., 1/256 (the paper's example)
    assert alibi_slopes(8) == [2.0 ** -h for h in range(1, 9)]
    # H = 6: the 4-head slopes 2^-2, 2^-4, 2^-6, 2^-8, then the odd slopes of 8 heads: 2^-1, 2^-3
    assert alibi_slopes(6) == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]
    twelve = alibi_slopes(12)  # 8 heads' slopes, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 (odd h of 16 heads)
    assert twelve[:8] == alibi_slopes(8)
    assert twelve[8:] == pytest.approx([2 ** -0.5, 2 ** -1.5, 2 ** -2.5, 2 ** -3.5], rel=1e-15)
    assert alibi_slopes(1) == [2.0 ** -8] and alibi_slopes(3) == [2.0 ** -4, 2.0 ** -8, 2.0 ** -2]
    with pytest.raises(ValueError, match="num_heads"):
        alibi_slopes(0)


@pytest.mark.parametrize("distance", ["euclidean", "manhattan"])
def test_alibi_bias_is_minus_slope_times_distance(distance):
    enc = create_encoding("alibi_2d", _ctx((2, 3)), distance=distance)  # 2 heads: slopes 1/16, 1/256
    b = _bias(enc, PositionGrid((2, 3), 1))
    assert b.shape == (2, 7, 7)
    # worked example: patch (0, 0) -> patch (1, 2) is sequence 1 -> 6
    d = math.sqrt(5.0) if distance == "euclidean" else 3.0
    torch.testing.assert_close(b[:, 1, 6], torch.tensor([-d / 16, -d / 256]))
    # every pair against a per-pair formula
    coords = _coords((2, 3))
    for i, (r1, c1) in enumerate(coords):
        for j, (r2, c2) in enumerate(coords):
            dist = math.hypot(r1 - r2, c1 - c2) if distance == "euclidean" else abs(r1 - r2) + abs(c1 - c2)
            torch.testing.assert_close(b[:, 1 + i, 1 + j], torch.tensor([-dist / 16, -dist / 256]), atol=1e-7, rtol=0)
    assert torch.equal(b, b.transpose(-1, -2))  # symmetric
    assert (b[:, 0] == 0).all() and (b[:, :, 0] == 0).all()  # prefix policy: zero to and from the cls token
    assert (b[:, 1:, 1:] <= 0).all() and (b.diagonal(dim1=-2, dim2=-1) == 0).all()


def test_alibi_3d_on_one_frame_is_alibi_2d_and_counts_time_steps():
    a2 = create_encoding("alibi_2d", _ctx((3, 4), heads=3))
    a3 = create_encoding("alibi_3d", _ctx((2, 3, 4), heads=3))
    torch.testing.assert_close(_bias(a3, PositionGrid((1, 3, 4), 1)), _bias(a2, PositionGrid((3, 4), 1)), atol=0, rtol=0)
    b = _bias(a3, PositionGrid((3, 2, 2), 0))
    # (t, h, w) = (0, 0, 0) -> (2, 1, 1): distance sqrt(4 + 1 + 1)
    torch.testing.assert_close(b[:, 0, 11], -torch.tensor(alibi_slopes(3)) * math.sqrt(6.0))


def test_alibi_interpolate_maps_a_larger_grid_onto_the_training_one():
    enc = create_encoding("alibi_2d", _ctx((3, 4)), extrapolation="interpolate")
    big = _bias(enc, PositionGrid((6, 8), 0))
    even = [r * 8 + c for r in range(0, 6, 2) for c in range(0, 8, 2)]  # patches at (2i, 2j)
    train = _bias(enc, PositionGrid((3, 4), 0))
    torch.testing.assert_close(big[:, even][:, :, even], train)
    extend = create_encoding("alibi_2d", _ctx((3, 4)))
    torch.testing.assert_close(_bias(extend, PositionGrid((6, 8), 0))[:, even][:, :, even], 2 * train)


# ---------------------------------------------------------------------------------------------
# both: offset-only (translation invariance)
# ---------------------------------------------------------------------------------------------
SPECS_2D = ["alibi_2d", "alibi_2d[distance=manhattan]", "fire", "fire[distance=axial]", "fire[distance=manhattan]"]
SPECS_3D = ["alibi_3d", "fire_3d", "fire_3d[distance=axial]"]


def _randomised(spec: str, grid, heads=2, depth=2):
    torch.manual_seed(0)
    enc = create_encoding(spec, _ctx(grid, heads=heads, depth=depth))
    with torch.no_grad():  # move FIRE off its init so a wrong gather could not hide behind near-constant outputs
        for p in enc.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return enc.eval()


@pytest.mark.parametrize("spec, shape", [(s, (5, 6)) for s in SPECS_2D] + [(s, (3, 4, 5)) for s in SPECS_3D])
def test_bias_depends_only_on_the_offset(spec, shape):
    enc = _randomised(spec, shape)
    with torch.no_grad():
        b = _bias(enc, PositionGrid(shape, 1), layer=1)[:, 1:, 1:]  # lattice block
    coords = torch.tensor(_coords(shape))
    offsets = coords[:, None, :] - coords[None, :, :]  # (N, N, ndim)
    key = torch.zeros(offsets.shape[:2], dtype=torch.int64)
    for a, s in enumerate(shape):
        key = key * (2 * s - 1) + offsets[..., a] + s - 1
    flat, vals = key.reshape(-1), b.reshape(b.shape[0], -1)
    n = int(flat.max()) + 1
    hi = torch.full((b.shape[0], n), -math.inf).scatter_reduce(1, flat.expand_as(vals), vals, "amax")
    lo = torch.full((b.shape[0], n), math.inf).scatter_reduce(1, flat.expand_as(vals), vals, "amin")
    present = torch.isfinite(hi[0])
    assert present.sum() == math.prod(2 * s - 1 for s in shape)  # every offset occurs
    assert torch.equal(hi[:, present], lo[:, present])  # one value per offset and head
    assert (hi[:, present].max(1).values - hi[:, present].min(1).values > 1e-3).all()  # ... and not one value overall
    # shifting a window inside the grid leaves its block of the bias unchanged
    win = [tuple(int(v) for v in c) for c in PositionGrid(tuple(s - 2 for s in shape)).indices().long()]
    rows = {c: i for i, c in enumerate(_coords(shape))}
    w0 = [rows[c] for c in win]
    w1 = [rows[tuple(v + 2 for v in c)] for c in win]
    torch.testing.assert_close(b[:, w0][:, :, w0], b[:, w1][:, :, w1], atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------
# FIRE: progressive interpolation and the per-pair formula
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("distance", ["euclidean", "manhattan", "axial"])
def test_fire_inputs_lie_in_unit_interval_at_every_grid(distance):
    train = (4, 4)
    enc = create_encoding("fire", _ctx(train), distance=distance)
    c, L = enc.c[0].detach(), enc.threshold[0].detach()
    for shape in [(1, 1), (2, 2), (3, 5), train, (9, 9), (20, 13), (32, 24)]:
        x = fire_inputs(lattice_offsets(PositionGrid(shape)).offsets, shape, c, L, distance)
        mag = x.abs()
        assert mag.min() >= 0 and mag.max() <= 1 + 1e-6, (shape, mag.max())
        if distance != "axial":
            assert (x >= 0).all()
        extent = lattice_extent(shape, distance)
        for a in range(x.shape[-1]):
            top = mag[:, a].max().item()
            if extent[a] >= L[a]:  # the training grid and larger ones span exactly [0, 1]: progressive interpolation
                assert top == pytest.approx(1.0, abs=1e-5), shape
            else:  # smaller: the threshold keeps the training scale, below 1
                want = math.log1p(0.1 * extent[a].item()) / (math.log1p(0.1 * L[a].item()) + 1e-6)
                assert top == pytest.approx(want, abs=1e-6) and top < 0.999, shape
    assert torch.equal(L, lattice_extent(train, distance))  # the threshold starts at the training extent
    # worked example at the training grid: E = L = sqrt(18), c = 0.1, offset (0, 1)
    offsets = torch.tensor([[0.0, 1.0], [2.0, -3.0]])
    x = fire_inputs(offsets, train, torch.tensor([0.1]), torch.tensor([math.sqrt(18)]), "euclidean")
    denom = math.log(1 + 0.1 * math.sqrt(18)) + 1e-6
    torch.testing.assert_close(x[:, 0], torch.tensor([math.log(1.1) / denom, math.log(1 + 0.1 * math.sqrt(13)) / denom]))


def _naive_fire(enc, shape, prefix: int, layer: int) -> torch.Tensor:
    """FIRE's bias from scratch: python loops over token pairs, math.* for psi, the MLP by hand."""
    t = enc.table_index(layer)
    c = [abs(v) for v in enc.c[t].tolist()]
    L = enc.threshold[t].tolist()
    w1, b1 = enc.fc1_weight[t].tolist(), enc.fc1_bias[t].tolist()
    w2, b2 = enc.fc2_weight[t].tolist(), enc.fc2_bias[t].tolist()
    axial = enc.distance == "axial"
    ext = [s - 1 for s in shape] if axial else [math.sqrt(sum((s - 1) ** 2 for s in shape))]
    coords = _coords(shape)
    n = prefix + len(coords)
    out = torch.zeros(enc.num_heads, n, n, dtype=torch.float64)
    for i, p in enumerate(coords):
        for j, q in enumerate(coords):
            d = [a - b for a, b in zip(p, q)]
            dists = [abs(v) for v in d] if axial else [math.sqrt(sum(v * v for v in d))]
            x = [math.log(c[a] * r + 1) / (math.log(c[a] * max(L[a], ext[a]) + 1) + 1e-6) for a, r in enumerate(dists)]
            if axial:
                x = [v * (1 if s > 0 else -1 if s < 0 else 0) for v, s in zip(x, d)]
            hid = [max(0.0, sum(w * v for w, v in zip(row, x)) + bb) for row, bb in zip(w1, b1)]
            for h in range(enc.num_heads):
                out[h, prefix + i, prefix + j] = sum(w * v for w, v in zip(w2[h], hid)) + b2[h]
    return out


@pytest.mark.parametrize("spec, train, shape", [
    ("fire", (3, 4), (3, 4)), ("fire", (3, 4), (5, 2)), ("fire[distance=axial]", (3, 4), (4, 5)),
    ("fire_3d", (2, 2, 3), (2, 3, 2)), ("fire_3d[distance=axial]", (2, 2, 3), (3, 2, 2)),
])
def test_fire_bias_equals_per_pair_formula(spec, train, shape):
    enc = _randomised(spec, train, heads=3)
    with torch.no_grad():
        for layer in (0, 1):
            got = _bias(enc, PositionGrid(shape, 2), layer=layer)
            torch.testing.assert_close(got.double(), _naive_fire(enc, shape, 2, layer), atol=2e-6, rtol=1e-5)
        state = enc.prepare(PositionGrid(shape, 2))
    # the MLP ran over the distinct offsets only: one column per offset, plus the zero column of prefix pairs
    assert state.values.shape == (2, 3, math.prod(2 * s - 1 for s in shape) + 1)
    assert (state.values[..., -1] == 0).all()


def test_fire_3d_on_one_frame_is_fire_2d():
    torch.manual_seed(0)
    f2 = create_encoding("fire", _ctx((3, 4)), init_threshold=6.0)
    f3 = create_encoding("fire_3d", _ctx((2, 3, 4)), init_threshold=6.0)
    f3.load_state_dict(f2.state_dict())
    with torch.no_grad():
        one_frame = _bias(f3, PositionGrid((1, 3, 4), 1), 1)
        torch.testing.assert_close(one_frame, _bias(f2, PositionGrid((3, 4), 1), 1), atol=0, rtol=0)


def test_fire_layers_own_or_share_their_function():
    per_layer = create_encoding("fire", _ctx((3, 3), depth=3))
    shared = create_encoding("fire", _ctx((3, 3), depth=3), share_layers=True)
    assert per_layer.fc1_weight.shape == (3, 32, 1) and per_layer.fc2_weight.shape == (3, 2, 32)
    assert shared.fc1_weight.shape == (1, 32, 1) and shared.c.shape == (1, 1)
    grid = PositionGrid((3, 3), 1)
    with torch.no_grad():
        assert not torch.equal(_bias(per_layer, grid, 0), _bias(per_layer, grid, 2))
        assert torch.equal(_bias(shared, grid, 0), _bias(shared, grid, 2))
    assert create_encoding("fire", _ctx((3, 3)), distance="axial").fc1_weight.shape[-1] == 2


# ---------------------------------------------------------------------------------------------
# attention: SDPA's float mask equals the explicit formula (values and gradients)
# ---------------------------------------------------------------------------------------------
ORACLE = [
    ("alibi_2d", (3, 4)), ("fire", (3, 4)), ("fire[distance=axial]", (3, 4)), ("alibi_3d", (2, 2, 3)), ("fire_3d", (2, 2, 3)),
]


@pytest.mark.parametrize("dropout", [False, True], ids=["all_tokens", "patch_dropout"])
@pytest.mark.parametrize("spec, shape", ORACLE)
def test_attention_equals_explicit_softmax_reference(spec, shape, dropout):
    enc = _randomised(spec, shape, heads=2).double().train()
    grid, (q, k, v, w) = attention_inputs(PositionGrid(shape, 1), dropout, 5)
    n = q.shape[-2]
    scale = 8 ** -0.5
    results = []
    for path in ("sdpa", "explicit"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        enc.zero_grad()
        state = enc.prepare(grid)
        if grid.keep is not None:
            state = enc.keep_tokens(state, grid)
        if path == "sdpa":
            out = enc.attend(*leaves, layer=1, state=state)
        else:
            bias = enc.bias(leaves[0], leaves[1], layer=1, state=state)
            assert bias.shape == ((2 if dropout else 1), 2, n, n)
            logits = leaves[0] @ leaves[1].transpose(-1, -2) * scale + bias
            out = logits.softmax(-1) @ leaves[2]
        (out * w).sum().backward()
        grads = [t.grad for t in leaves] + [p.grad.clone() for p in enc.parameters()]
        results.append((out.detach(), grads))
    (out_a, grads_a), (out_b, grads_b) = results
    torch.testing.assert_close(out_a, out_b, atol=1e-10, rtol=1e-10)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(ga, gb, atol=1e-9, rtol=1e-7)
    if spec.startswith("fire"):
        assert all(g.abs().sum() > 0 for g in grads_a[3:])  # the gradient went through the recomputed bias


def test_gradients_reach_fire_mlp_c_and_threshold():
    enc = create_encoding("fire", _ctx((4, 4)))  # threshold starts at the training extent
    names = [n for n, _ in enc.named_parameters()]
    assert names == ["c", "threshold_scale", "fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"]
    for shape, threshold_active in [((4, 4), True), ((3, 2), True), ((7, 7), False)]:
        enc.zero_grad()
        grid = PositionGrid(shape, 1)
        q, k, v = (torch.randn(2, 2, grid.seq_len, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
        enc.attend(q, k, v, layer=0, state=enc.prepare(grid)).square().sum().backward()
        for n, p in enc.named_parameters():
            layer0 = p.grad[0]
            if n == "threshold_scale" and not threshold_active:
                # larger than the threshold: the normaliser is the grid's own extent (progressive interpolation)
                assert layer0.abs().sum() == 0
            else:
                assert layer0.abs().sum() > 0, (shape, n)
            assert p.grad[1].abs().sum() == 0  # layer 1's FIRE took no part


# ---------------------------------------------------------------------------------------------
# lifecycle: cache, patch dropout, dtype
# ---------------------------------------------------------------------------------------------
def test_fire_tables_cached_in_eval_rebuilt_for_training_and_after_updates():
    enc = create_encoding("fire", _ctx((3, 3)))
    grid = PositionGrid((3, 3), 1)
    with torch.no_grad():
        a = enc.prepare(grid).values
        assert enc.prepare(grid).values is a  # reused
        enc.fc2_bias.add_(1.0)  # an optimizer step: a new parameter version
        b = enc.prepare(grid).values
    assert b is not a and torch.allclose(b[..., :-1], a[..., :-1] + 1.0)
    assert enc.prepare(grid).values.requires_grad  # training: rebuilt with a graph to the parameters


@pytest.mark.parametrize("spec", ["alibi_2d", "fire", "alibi_3d", "fire_3d"])
def test_keep_tokens_narrows_the_bias_to_each_samples_tokens(spec):
    shape = (3, 4) if "3d" not in spec else (2, 3, 3)
    enc = _randomised(spec, shape)
    grid = PositionGrid(shape, 1)
    keep = torch.stack([torch.randperm(grid.num_patches, generator=torch.Generator().manual_seed(s))[:6] for s in (0, 1)])
    kept = grid.with_keep(keep)
    with torch.no_grad():
        state = enc.prepare(grid)
        full = _bias(enc, grid, layer=1)
        q = torch.zeros(2, 2, 7, 4)
        narrowed = enc.bias(q, q, layer=1, state=enc.keep_tokens(state, kept))
    rows = kept.sequence_index()
    for b in range(2):
        torch.testing.assert_close(narrowed[b], full[:, rows[b]][:, :, rows[b]], atol=0, rtol=0)
    with pytest.raises(ValueError, match=f"covers {grid.seq_len} tokens but attention got 7"):
        enc.attend(q, q, q, layer=1, state=state)


def test_image_vit_trains_at_three_grids_with_axial_fire():
    """`alibi_2d` and `fire` at their defaults train at these grids in the registry-wide
    tests/test_encoding_contracts.py::test_trains_at_train_larger_and_nonsquare_grids; here FIRE's signed
    per-axis offsets, which no registry-wide suite builds, and FIRE's parameters kept out of weight decay."""
    torch.manual_seed(0)
    model = _image_model("fire[distance=axial]")
    for size in [(32, 32), (48, 48), (24, 40)]:  # training grid 8x8, larger, non-square smaller
        model.zero_grad()
        out = model(torch.randn(2, 3, *size))
        assert out.shape == (2, 5) and torch.isfinite(out).all()
        out.square().mean().backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    for spec in ("fire", "fire[distance=axial]"):
        assert {"pos_encoding.c", "pos_encoding.threshold_scale"} <= _image_model(spec).no_weight_decay()


@pytest.mark.parametrize("spec", ["alibi_3d", "fire_3d"])
def test_video_vit_trains_at_three_grids_and_on_images(spec):
    torch.manual_seed(0)
    model = VispeVideoViT(pos_encoding=spec, **VIDEO)  # training lattice (4, 4, 4)
    for shape in [(1, 3, 8, 32, 32), (1, 3, 4, 48, 48), (2, 3, 2, 24, 40), (2, 3, 32, 32)]:  # the last: a still image
        model.zero_grad()
        out = model(torch.randn(*shape))
        assert out.shape == (shape[0], 5) and torch.isfinite(out).all()
        out.square().mean().backward()
        for n, p in model.pos_encoding.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), n


@pytest.mark.parametrize("spec", ["alibi_2d", "fire", "alibi_3d", "fire_3d"])
def test_bf16_autocast_trains_with_float32_tables(spec):
    torch.manual_seed(0)
    if "3d" in spec:
        model, x = VispeVideoViT(pos_encoding=spec, **VIDEO), torch.randn(2, 3, 4, 32, 32)
    else:
        model, x = _image_model(spec), torch.randn(2, 3, 32, 48)
    y = torch.tensor([1, 3])
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(model(x), y).item()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        grid = PositionGrid((2, 4, 4) if "3d" in spec else (8, 12), 1)
        assert model.pos_encoding.prepare(grid).values.dtype == torch.float32
    loss.backward()
    assert abs(loss.item() - ref) <= 0.05 * max(1.0, abs(ref))
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert all(p.grad is not None for p in model.pos_encoding.parameters())


# ---------------------------------------------------------------------------------------------
# registry and bad input
# ---------------------------------------------------------------------------------------------
def test_registered_as_attention_biases_for_2d_and_3d():
    assert {"alibi_2d", "fire"} <= set(vispe.list_encodings(kind="bias", grid_ndim=2))
    assert {"alibi_3d", "fire_3d"} <= set(vispe.list_encodings(kind="bias", grid_ndim=3))
    for name in ("alibi_2d", "fire", "alibi_3d", "fire_3d"):
        cls = get_encoding_class(name)
        assert cls.kind == "bias" and "zero bias to and from prefix tokens" in cls.prefix_policy
    assert list(create_encoding("alibi_2d", _ctx((3, 3))).parameters()) == []


def test_bad_input_is_refused_at_construction():
    ctx = _ctx((4, 4))
    with pytest.raises(ValueError, match=r"distance='cosine' is not valid; choose one of \['euclidean', 'manhattan'\]"):
        create_encoding("alibi_2d", ctx, distance="cosine")
    with pytest.raises(ValueError, match=r"distance='cosine' is not valid; choose one of \['euclidean', 'manhattan', 'axial'\]"):
        create_encoding("fire", ctx, distance="cosine")
    with pytest.raises(ValueError, match=r"extrapolation='ntk' is not valid; choose one of \['extend', 'interpolate'\]"):
        create_encoding("alibi_2d", ctx, extrapolation="ntk")
    with pytest.raises(ValueError, match=r"mlp_width=0 is not valid; it must be an int >= 1"):
        create_encoding("fire", ctx, mlp_width=0)
    with pytest.raises(ValueError, match=r"init_c=0 is not valid; it must be a finite number > 0"):
        create_encoding("fire", ctx, init_c=0)
    with pytest.raises(ValueError, match=r"init_threshold=-1.0 is not valid; it must be a finite number > 0 and <= 1e\+06 or None"):
        create_encoding("fire", ctx, init_threshold=-1.0)
    with pytest.raises(ValueError, match=r"encoding 'fire' takes 2-D grids, but the model's grid \(2, 4, 4\) is 3-D; .*did you mean 'fire_3d'"):
        create_encoding("fire", _ctx((2, 4, 4)))
    with pytest.raises(TypeError, match="valid options"):
        create_encoding("alibi_2d", ctx, mlp_width=4)
    with pytest.raises(ValueError, match=r"takes \(2,\)-D grids, got a 3-D grid"):
        create_encoding("alibi_2d", ctx).prepare(PositionGrid((1, 4, 4)))
