"""iRPE: the spec's piecewise table, bucket counts, equality with a naive per-pair implementation
(all sides and modes), grids, bf16, parameter counts, bad input."""
from __future__ import annotations

import math

import pytest
import timm
import torch

import vispe  # noqa: F401
from vispe.encodings import EncodingContext, PositionGrid, create_encoding
from vispe.encodings.irpe import irpe_bucket_ids, piecewise_index

MODEL = "vispe_vit_tiny_patch4_32"


def test_piecewise_table_r19():
    # spec table for r = 1.9: |d| 0 1 2 3 >=4  ->  |g| 0 1 2 2 3
    d = torch.tensor([0, 1, 2, 3, 4, 5, 7, 13, 100])
    expected = torch.tensor([0, 1, 2, 2, 3, 3, 3, 3, 3])
    assert torch.equal(piecewise_index(d, 1.9, 3.8, 15.2), expected)
    assert torch.equal(piecewise_index(-d, 1.9, 3.8, 15.2), -expected)


def test_product_has_49_buckets_plus_prefix():
    ids, per_table = irpe_bucket_ids(PositionGrid((14, 14), 1), "product", 1.9, True)
    assert per_table == 50 and ids.shape == (1, 197, 197)
    assert torch.equal(torch.unique(ids), torch.arange(50))
    assert (ids[0, 0] == 49).all() and (ids[0, :, 0] == 49).all() and (ids[0, 1:, 1:] < 49).all()
    enc = create_encoding("irpe", EncodingContext(384, 6, 12, (14, 14)))
    assert enc.table_k.shape == (12, 1, 64, 50)


# ----------------------------------------------------------------------------------------------
# naive reference: per-pair python loops, bucket computed from scratch with math.*
# ----------------------------------------------------------------------------------------------
def _g(x: float, r: float) -> int:
    a, b, c = r, 2 * r, 8 * r
    if abs(x) <= a:
        return int(round(x))
    v = round(a + math.log(abs(x) / a) / math.log(c / a) * (b - a))
    return int(math.copysign(min(b, v), x))


def _buckets(qi, kj, method, r, s, n_per):
    """List of (table, bucket) for the query/key token indices (prefix first)."""
    bi = int(2 * r)
    w = 2 * bi + 1
    if qi < s or kj < s:
        return [(t, n_per - 1) for t in range(2 if method == "cross" else 1)]
    (r1, c1), (r2, c2) = qi_rc(qi - s), qi_rc(kj - s)
    dr, dc = r1 - r2, c1 - c2
    if method == "product":
        return [(0, (_g(dr, r) + bi) * w + _g(dc, r) + bi)]
    if method == "cross":
        return [(0, _g(dr, r) + bi), (1, _g(dc, r) + bi)]
    if method == "euclidean":
        return [(0, _g(round(math.sqrt(dr * dr + dc * dc)), r) + bi)]
    return [(0, _g(dr * dr + dc * dc, r) + bi)]


GRID_W = 4


def qi_rc(p):
    return divmod(p, GRID_W)


def naive_attention(q, k, v, enc, layer, grid):
    bsz, heads, length, dh = q.shape
    s = grid.num_prefix_tokens
    scale = dh**-0.5
    slot = enc.layers.index(layer)
    n_per = enc.buckets_per_table
    logits = torch.zeros(bsz, heads, length, length, dtype=torch.float64)
    for i in range(length):
        for j in range(length):
            val = scale * (q[:, :, i] * k[:, :, j]).sum(-1)
            for side in enc.sides:
                if side == "v":
                    continue
                tab = getattr(enc, f"table_{side}")[slot].double()
                # key side: bucket of p_i - p_j with q_i; query side (released code): bucket of p_j - p_i with k_j
                pairs = _buckets(i, j, enc.method, enc.ratio, s, n_per) if side == "k" else _buckets(j, i, enc.method, enc.ratio, s, n_per)
                for t, u in pairs:
                    col = t * n_per + u
                    if enc.mode == "bias":
                        val = val + tab[:, col].expand(heads)
                    else:
                        vec = q[:, :, i] if side == "k" else k[:, :, j]
                        val = val + scale * (vec * tab[:, :, col].expand(heads, dh)).sum(-1)
            logits[:, :, i, j] = val
    attn = logits.softmax(-1)
    out = attn @ v
    if "v" in enc.sides:
        tab = enc.table_v[slot].double()
        for i in range(length):
            for j in range(length):
                for t, u in _buckets(i, j, enc.method, enc.ratio, s, n_per):
                    out[:, :, i] += attn[:, :, i, j, None] * tab[:, t * n_per + u].expand(heads, dh)
    return out


@pytest.mark.parametrize(
    "opts",
    [
        {},  # DeiT default: contextual product shared K
        {"shared_head": False, "sides": "qk"},
        {"method": "cross", "sides": "qkv"},
        {"method": "euclidean", "ratio": 2.0, "sides": "kv", "shared_head": False},
        {"method": "quant", "ratio": 1.5},
        {"mode": "bias", "method": "product", "sides": "qk", "shared_head": False},
        {"mode": "bias", "method": "cross", "sides": "k"},
    ],
)
def test_matches_naive_loop(opts):
    torch.manual_seed(0)
    heads, dh = 2, 8
    grid = PositionGrid((3, GRID_W), 1)
    enc = create_encoding("irpe", EncodingContext(heads * dh, heads, 2, (3, GRID_W)), init_std=0.5, **opts).double()
    state = enc.prepare(grid, None)
    q, k, v = (torch.randn(2, heads, grid.seq_len, dh, dtype=torch.float64) for _ in range(3))
    out = enc.attend(q, k, v, layer=1, state=state)
    ref = naive_attention(q, k, v, enc, 1, grid)
    assert torch.allclose(out, ref, atol=1e-9), (out - ref).abs().max()
    # gradients reach the tables through the SDPA mask / explicit path and equal the reference's
    out.square().sum().backward()
    got = {n: p.grad.clone() for n, p in enc.named_parameters()}
    enc.zero_grad()
    naive_attention(q, k, v, enc, 1, grid).square().sum().backward()
    for n, p in enc.named_parameters():
        assert p.grad.abs().sum() > 0
        assert torch.allclose(got[n], p.grad, atol=1e-8), n


def test_layers_without_tables_are_plain_attention():
    enc = create_encoding("irpe", EncodingContext(16, 2, 3, (3, 4)), layers=(1,), init_std=1.0)
    assert enc.table_k.shape[0] == 1
    grid = PositionGrid((3, 4), 1)
    q, k, v = (torch.randn(1, 2, grid.seq_len, 8) for _ in range(3))
    state = enc.prepare(grid, None)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert torch.allclose(enc.attend(q, k, v, layer=0, state=state), ref, atol=1e-6)
    assert not torch.allclose(enc.attend(q, k, v, layer=1, state=state), ref, atol=1e-3)


@pytest.mark.parametrize("opts", [{"sides": "qkv", "method": "cross"}, {"mode": "bias", "shared_head": False}])  # defaults: the contracts suite
def test_forward_backward_grids_and_bf16(opts):
    model = timm.create_model(MODEL, pos_encoding={"name": "irpe", **opts}, depth=1)
    n_params = sum(p.numel() for p in model.pos_encoding.parameters())
    for hw in [(32, 32), (48, 48), (32, 56)]:
        model.zero_grad()
        model(torch.randn(2, 3, *hw)).sum().backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.pos_encoding.parameters())
    assert sum(p.numel() for p in model.pos_encoding.parameters()) == n_params  # no resizing
    assert len(model.pos_encoding._state_cache) == 3  # one bucket map per grid
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(2, 3, 40, 32))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


@pytest.mark.parametrize(
    "opts,per_layer",
    [
        ({}, 64 * 50),  # contextual, shared, K: h' dh (n_b + 1)
        ({"shared_head": False}, 12 * 64 * 50),
        ({"sides": "qkv"}, 3 * 64 * 50),
        ({"mode": "bias", "shared_head": False}, 12 * 50),  # bias: h' (n_b + 1)
        ({"method": "cross"}, 64 * 2 * (7 + 1)),  # two tables of 2 beta_int + 1 (+1 prefix)
        ({"method": "euclidean", "ratio": 20}, 64 * (2 * 40 + 1 + 1)),
    ],
)
def test_param_count_vit_b(opts, per_layer):
    with torch.device("meta"):
        model = timm.create_model("vispe_vit_base_patch16_224", pos_encoding={"name": "irpe", **opts})
    assert sum(p.numel() for p in model.pos_encoding.parameters()) == 12 * per_layer


def test_deit_s_spec_counts():
    for opts, n in [({}, 38_400), ({"shared_head": False}, 230_400), ({"sides": "qkv"}, 115_200)]:
        enc = create_encoding("irpe", EncodingContext(384, 6, 12, (14, 14)), **opts)
        assert sum(p.numel() for p in enc.parameters()) == n


def test_bad_input():
    ctx = EncodingContext(16, 2, 2, (3, 4))
    with pytest.raises(ValueError, match=r"method='hex' is not valid; choose one of \['euclidean', 'quant', 'cross', 'product'\]"):
        create_encoding("irpe", ctx, method="hex")
    with pytest.raises(ValueError, match=r"mode='ctx' is not valid; choose one of \['bias', 'contextual'\]"):
        create_encoding("irpe", ctx, mode="ctx")
    with pytest.raises(ValueError, match="sides"):
        create_encoding("irpe", ctx, sides="kx")
    with pytest.raises(ValueError, match="bias mode"):
        create_encoding("irpe", ctx, mode="bias", sides="qkv")
    with pytest.raises(ValueError, match="layers"):
        create_encoding("irpe", ctx, layers=(5,))
    with pytest.raises(ValueError, match="ratio"):
        create_encoding("irpe", ctx, ratio=0.2)
    with pytest.raises(ValueError, match="grid"):
        create_encoding("irpe", ctx).prepare(PositionGrid((2, 2, 2), 1))
    with pytest.raises(ValueError, match="method='bogus' is not valid"):
        timm.create_model(MODEL, pos_encoding={"name": "irpe", "method": "bogus"}, depth=1)


# ----------------------------------------------------------------------------------------------
# memory: the (B, H, L, L) logit term is rebuilt in backward, never kept per layer
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "mask_kind,causal", [(None, False), ("float", False), ("bool", False), (None, True), ("float", True)]
)
def test_sdpa_with_bias_gradients_equal_autograd(mask_kind, causal):
    from vispe.encodings.base import merge_attn_mask, sdpa, sdpa_with_bias

    torch.manual_seed(0)
    b, h, L, d, nb = 2, 3, 7, 4, 5
    q, k, v = (torch.randn(b, h, L, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    z = torch.randn(b, h, L, nb, dtype=torch.float64, requires_grad=True)
    tab = torch.randn(1, h, 1, 1, dtype=torch.float64, requires_grad=True)  # a broadcast (1, H, 1, 1) input
    ids = torch.randint(0, nb, (L, L))
    mask = None
    if mask_kind == "float":
        mask = torch.randn(L, L, dtype=torch.float64)
    elif mask_kind == "bool":
        mask = torch.rand(L, L) > 0.3
        mask[:, 0] = True  # no fully masked row

    def fn(z_, t_):
        return torch.gather(z_, -1, ids.expand(b, h, L, L)) + t_

    out = sdpa_with_bias(q, k, v, fn, [z, tab], mask, is_causal=causal, scale=0.7)
    ref = sdpa(q, k, v, merge_attn_mask(mask, fn(z, tab), q.dtype), is_causal=causal, scale=0.7)
    assert torch.allclose(out, ref, atol=1e-12)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, z, tab), g)
    want = torch.autograd.grad(ref, (q, k, v, z, tab), g)
    for name, a, w in zip("qkvzt", got, want):
        assert torch.allclose(a, w, atol=1e-10), (name, (a - w).abs().max())
    # second-order inputs that need no gradient get None, the rest still flows
    out2 = sdpa_with_bias(q, k, v, fn, [z.detach(), tab], mask, is_causal=causal, scale=0.7)
    assert torch.autograd.grad(out2.sum(), tab)[0].shape == tab.shape


def test_training_keeps_no_square_logit_tensor_per_layer():
    model = timm.create_model(MODEL, pos_encoding="irpe", depth=2)
    L = model.patch_embed.num_patches + model.num_prefix_tokens
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(torch.randn(2, 3, 32, 32))
    square = [s for s in saved if len(s) >= 2 and s[-2:] == (L, L)]
    assert not square, f"tensors of shape (..., {L}, {L}) kept for backward: {square}"
    out.sum().backward()
    assert model.pos_encoding.table_k.grad.abs().sum() > 0


@pytest.mark.parametrize("opts", [{}, {"sides": "qk"}, {"method": "cross", "sides": "qk", "shared_head": False}])
def test_one_hot_term_equals_the_gather(opts, monkeypatch):
    """The contextual term as a product with one-hot buckets (CUDA's form: its gradient is a matmul, not a contended
    scatter-add) gives the gather's outputs and gradients, eager and traced whole (the dense path: compiled CUDA
    graphs take it; a compiled CPU step runs the blocked custom op, whose native kernels read the buckets)."""
    import vispe.encodings.irpe as irpe_module

    torch._dynamo.reset()
    grid = PositionGrid((3, GRID_W), 1)
    enc = create_encoding("irpe", EncodingContext(16, 2, 2, (3, GRID_W)), init_std=0.5, **opts).train()
    g = torch.Generator().manual_seed(5)
    # batch x heads >= buckets (50): the one-hot (rows, L, buckets) is then no larger than the term
    q, k, v, w = (torch.randn(26, 2, grid.seq_len, 8, generator=g) for _ in range(4))

    def attend(q, k, v):
        return enc.attend(q, k, v, layer=1, state=enc.prepare(grid))

    def run(fn, backend):
        enc.set_attention_backend(backend)
        enc.zero_grad(set_to_none=True)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        (out * w).sum().backward()
        return out.detach(), [t.grad for t in leaves] + [p.grad for p in enc.parameters()]

    ref_out, ref_grads = run(attend, "dense")  # the gather (CPU's form)
    calls = []
    one_hot_term = irpe_module._one_hot_term
    monkeypatch.setattr(irpe_module, "ONE_HOT_TERM_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(irpe_module, "_one_hot_term", lambda *a: calls.append(1) or one_hot_term(*a))
    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    for fn, backend in ((attend, "dense"), (compiled, "dense")):
        torch._dynamo.reset()
        n = len(calls)
        out, grads = run(fn, backend)
        assert len(calls) > n, (backend, "the one-hot form was not taken")
        assert torch.allclose(out, ref_out, atol=1e-5), (backend, (out - ref_out).abs().max())
        for got, ref in zip(grads, ref_grads):
            assert ref.abs().sum() > 0 and torch.allclose(got, ref, atol=1e-5), (backend, (got - ref).abs().max())


def test_one_hot_term_only_where_no_larger_than_the_term(monkeypatch):
    """Batch x heads below the bucket count: the one-hot ``(rows, L, buckets)`` would outgrow the term, so the gather stays."""
    import vispe.encodings.irpe as irpe_module

    calls = []
    one_hot_term = irpe_module._one_hot_term
    monkeypatch.setattr(irpe_module, "ONE_HOT_TERM_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(irpe_module, "_one_hot_term", lambda *a: calls.append(a[0].shape) or one_hot_term(*a))
    grid = PositionGrid((3, GRID_W), 1)
    enc = create_encoding("irpe", EncodingContext(16, 2, 2, (3, GRID_W)), init_std=0.5)
    enc.set_attention_backend("dense")
    for batch, taken in ((2, False), (25, True)):  # 50 buckets; 2 heads
        q, k, v = (torch.randn(batch, 2, grid.seq_len, 8) for _ in range(3))
        enc.attend(q, k, v, layer=1, state=enc.prepare(grid))
        assert (len(calls) == 1) == taken, (batch, calls)


@pytest.mark.parametrize("side", ["k", "q"])
def test_one_hot_term_reads_a_blocks_rows(side):
    """A block of rows reads ``z`` at its own rows (a query block on the key side, all keys on the query side); the
    block of every row reads ``z`` whole, without indexing: both equal the gather."""
    import vispe.encodings.irpe as irpe_module

    g = torch.Generator().manual_seed(3)
    length, nb = 9, 6
    z = torch.randn(2, 3, length, nb, generator=g, dtype=torch.float64)
    for start, stop in ((2, 7), (0, length)):
        i = torch.arange(start, stop).view(1, 1, -1, 1)
        j = torch.arange(length).view(1, 1, 1, -1)
        bucket = torch.randint(0, nb, (stop - start, length), generator=g)
        got = irpe_module._one_hot_term(z, bucket, side, i, j)
        if side == "k":  # z at the query's row
            ref = torch.gather(z[:, :, start:stop], -1, bucket.expand(2, 3, -1, -1))
        else:  # z at the key's row: ref[b, h, r, c] = z[b, h, c, bucket[r, c]]
            ref = torch.gather(z, -1, bucket.t().expand(2, 3, -1, -1)).transpose(-1, -2)
        assert torch.allclose(got, ref), (side, start, stop)
