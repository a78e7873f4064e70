"""Attention biases without an (L, L) tensor: every path of an :class:`IndexedBias` equals the dense ``attn_mask``
oracle -- outputs and the gradients of q, k, v and the encoding's parameters -- for every bias encoding (the
registry's ``kind == 'bias'`` names, so later ones are covered), on grids with and without prefix tokens and after
patch dropout; the per-token pair codes give the same pair ids as the explicit ``(L, L)`` map; the path is chosen
automatically and can be forced; the blocked path keeps nothing of size L x L for backward.
"""
from __future__ import annotations

import os

import pytest
import timm
import torch

import vispe
from bias_checks import attention_inputs, bias_encoding, bias_grid_shape
from vispe.encodings import EncodingContext, PositionGrid, create_encoding
from vispe.encodings.lattice_bias import LatticePairCodes, lattice_offsets
from vispe.encodings.attention import _blocked_traceable, resolve_attention_backend
from vispe.encodings.irpe import irpe_bucket_ids

BIAS = vispe.list_encodings(kind="bias")
# extra option sets that change what the term reads (per-head tables, query side, contextual q/k, two tables)
VARIANTS = [(n, {}) for n in BIAS] + [
    ("irpe", {"mode": "bias", "sides": "qk", "shared_head": False, "method": "cross"}),
    ("irpe", {"mode": "contextual", "sides": "qk", "method": "euclidean"}),
    ("fire", {"distance": "axial", "share_layers": True}),
]
TOL = dict(atol=1e-5, rtol=1e-5)


def _run(enc, grid, q, k, v, w, path: str, mask=None, causal=False):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    enc.zero_grad(set_to_none=True)
    state = enc.prepare(grid)
    if grid.keep is not None:
        state = enc.keep_tokens(state, grid)
    if path == "traceable":  # the compiled / dropout form of the blocked path (checkpointed blocks)
        spec = enc.indexed_bias(*leaves[:2], layer=1, state=state, scale=q.shape[-1] ** -0.5)
        out = _blocked_traceable(*leaves, spec, mask, 0.0, causal, q.shape[-1] ** -0.5, 2)
    else:
        enc.set_attention_backend(path, block_rows=2 if path == "blocked" else None)
        out = enc.attend(*leaves, layer=1, state=state, attn_mask=mask, is_causal=causal)
    (out * w).sum().backward()
    grads = [t.grad for t in leaves] + [None if p.grad is None else p.grad.clone() for p in enc.parameters()]
    return out.detach(), grads


@pytest.mark.parametrize("prefix", [0, 1], ids=["no_prefix", "cls"])
@pytest.mark.parametrize("dropout", [False, True], ids=["all_tokens", "patch_dropout"])
@pytest.mark.parametrize("name, options", VARIANTS, ids=[f"{n}{o or ''}" for n, o in VARIANTS])
def test_blocked_paths_equal_the_dense_mask(name, options, dropout, prefix):
    enc = bias_encoding(name, options, prefix)
    grid, (q, k, v, w) = attention_inputs(PositionGrid(bias_grid_shape(name), prefix), dropout, 7)
    out_d, grads_d = _run(enc, grid, q, k, v, w, "dense")
    assert any(gd is not None and gd.abs().sum() > 0 for gd in grads_d[3:]) or not list(enc.parameters())
    for path in ("blocked", "traceable"):
        out, grads = _run(enc, grid, q, k, v, w, path)
        torch.testing.assert_close(out, out_d, **TOL)
        for i, (a, b) in enumerate(zip(grads, grads_d)):
            if b is None:
                assert a is None or a.abs().sum() == 0
            else:
                torch.testing.assert_close(a, b, **TOL, msg=lambda m, i=i, p=path: f"{p}: gradient {i}: {m}")


@pytest.mark.parametrize("mask_kind, causal", [("bool", False), ("float", True), (None, True)])
def test_blocked_path_with_a_callers_mask_and_causal(mask_kind, causal):
    enc = bias_encoding("fire", {}, 1)
    grid = PositionGrid((3, 4), 1)
    g = torch.Generator().manual_seed(4)
    q, k, v, w = (torch.randn(2, 2, grid.seq_len, 8, generator=g, dtype=torch.float64) for _ in range(4))
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(2, 1, grid.seq_len, grid.seq_len, generator=g) > 0.3
        mask[..., 0] = True
    elif mask_kind == "float":
        mask = torch.randn(grid.seq_len, grid.seq_len, generator=g, dtype=torch.float64)
    out_d, grads_d = _run(enc, grid, q, k, v, w, "dense", mask, causal)
    for path in ("blocked", "traceable"):
        out, grads = _run(enc, grid, q, k, v, w, path, mask, causal)
        torch.testing.assert_close(out, out_d, **TOL)
        for a, b in zip(grads, grads_d):
            torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("shape, prefix", [((3, 4), 1), ((5, 2), 0), ((2, 3, 2), 2)])
def test_pair_codes_give_the_explicit_pair_map(shape, prefix):
    grid = PositionGrid(shape, prefix)
    codes = LatticePairCodes.of(grid)
    assert torch.equal(codes.dense_ids(), lattice_offsets(grid).ids)
    keep = torch.stack([torch.randperm(grid.num_patches)[:4] for _ in range(3)])
    rows = grid.with_keep(keep).sequence_index()
    narrowed = codes.select(rows).dense_ids()
    full = lattice_offsets(grid).ids
    for b in range(3):
        assert torch.equal(narrowed[b], full[rows[b]][:, rows[b]])


@pytest.mark.parametrize("method", ["product", "cross", "euclidean", "quant"])
def test_irpe_buckets_by_code_equal_the_released_bucket_maps(method):
    enc = create_encoding("irpe", EncodingContext(16, 2, 1, (5, 6)), method=method)
    grid = PositionGrid((5, 6), 1)
    ids, per_table = irpe_bucket_ids(grid, method, 1.9, True)
    offset = torch.arange(ids.shape[0])[:, None, None] * per_table
    assert torch.equal(enc.prepare(grid).ids, ids + offset)


def test_backend_is_chosen_automatically_and_can_be_forced():
    ctx = EncodingContext(dim=384, num_heads=6, depth=1, grid_size=(32, 32))
    enc = create_encoding("alibi_2d", ctx)
    assert enc.attention_backend == "auto"
    q = torch.zeros(2, 6, 1025, 64)
    spec = enc.indexed_bias(q, q, layer=0, state=enc.prepare(PositionGrid((32, 32), 1)), scale=0.125)
    assert resolve_attention_backend("auto", q, q, spec, 0.0, training=True) == "blocked"
    assert resolve_attention_backend("auto", q, q, spec, 0.0, training=False) == "blocked"  # 1,025^2 x 6: too big
    small = torch.zeros(2, 6, 197, 64)
    assert resolve_attention_backend("auto", small, small, spec, 0.0, training=False) == "dense"
    with pytest.raises(ValueError, match="no CPU backward"):
        resolve_attention_backend("flex", q, q, spec, 0.0, training=True)
    assert resolve_attention_backend("flex", q, q, spec, 0.0, training=False) == "flex"
    forced = create_encoding("fire[attention_backend=dense]", ctx)
    assert forced.attention_backend == "dense"
    model = timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding={"name": "irpe", "attention_backend": "blocked"}, depth=1)
    assert model.pos_encoding.attention_backend == "blocked"
    with pytest.raises(ValueError, match="attention_backend='fast'.*choose one of"):
        create_encoding("alibi_2d", ctx, attention_backend="fast")
    with pytest.raises(TypeError, match="unknown option"):
        create_encoding("rope_axial", ctx, attention_backend="blocked")  # rotary encodings have no bias path


@pytest.mark.parametrize("name", ["alibi_2d", "fire", "irpe"])
def test_blocked_training_keeps_no_square_tensor(name):
    model = timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding=name, depth=2, img_size=64)
    model.pos_encoding.set_attention_backend("blocked", block_rows=32)
    L = model.patch_embed.num_patches + model.num_prefix_tokens
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        out = model(torch.randn(2, 3, 64, 64))
    assert not [s for s in saved if len(s) >= 2 and s[-1] == L and s[-2] >= 32], saved
    out.sum().backward()


@pytest.mark.skipif(not os.environ.get("VISPE_TEST_FLEX"), reason="compiles FlexAttention (about a minute on 2 CPU cores); "
                    "set VISPE_TEST_FLEX=1")
@pytest.mark.parametrize("name", ["alibi_2d", "fire", pytest.param("irpe", marks=pytest.mark.xfail(
    reason="torch 2.15 CPU inductor: FlexAttention's C++ template fails to compile a score_mod that gathers a per-query "
    "(B, H, L, buckets) tensor (cur_kvSplitSize undeclared); 'auto' never picks flex on CPU", strict=False))])
def test_flex_attention_inference_equals_the_dense_mask(name):
    enc = bias_encoding(name, {}, 1).float().eval()
    grid = PositionGrid(bias_grid_shape(name), 1)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, grid.seq_len, 8, generator=g) for _ in range(3))
    state = enc.prepare(grid)
    with torch.no_grad():
        enc.set_attention_backend("dense")
        want = enc.attend(q, k, v, layer=1, state=state)
        enc.set_attention_backend("flex")
        got = enc.attend(q, k, v, layer=1, state=state)
    torch.testing.assert_close(got, want, **TOL)


# ---- GPU-only choices, checked on CPU (the H100 run behind them: docs/speed-gpu.md) ----------------------------


def test_compiled_cuda_path_is_dense_until_the_term_is_large():
    from vispe.encodings.attention import DENSE_TERM_ELEMENTS, _compiled_cuda_path

    q = torch.zeros(128, 6, 197, 1)  # ViT-S/16 at 224 px, batch 128: a 30M-element term
    assert _compiled_cuda_path(q, q, 0.0) == "dense"
    big = torch.zeros(128, 6, 785, 1)  # 448 px: 473M elements, past the limit
    assert 128 * 6 * 785 * 785 > DENSE_TERM_ELEMENTS
    assert _compiled_cuda_path(big, big, 0.0) == "flex" and _compiled_cuda_path(big, big, 0.1) == "blocked"


def test_irpe_hands_its_flex_tiles_to_flex_attention(monkeypatch):
    """iRPE's term asks FlexAttention for 32 x 32 tiles (the default tiles overflow an H100's shared memory in backward);
    the options reach the kernel merged over the module-wide ones."""
    from vispe.encodings import attention, create_encoding
    from vispe.encodings.grid import PositionGrid

    seen = {}

    def fake_flex(q, k, v, score_mod=None, scale=None, kernel_options=None):
        seen["options"] = kernel_options
        return torch.zeros_like(q)

    monkeypatch.setattr(attention, "_COMPILED_FLEX", fake_flex)
    monkeypatch.setattr(attention, "FLEX_KERNEL_OPTIONS", {"num_warps": 4})
    enc = create_encoding("irpe", EncodingContext(32, 2, 1, (3, 3)), attention_backend="flex")
    grid = PositionGrid((3, 3), 1)
    q = torch.randn(1, 2, 10, 16)
    with torch.no_grad():
        enc.attend(q, q, q, layer=0, state=enc.prepare(grid, q.device))
    assert seen["options"]["BLOCK_M1"] == 32 and seen["options"]["BLOCK_N2"] == 32 and seen["options"]["num_warps"] == 4


# ---- the compiled CPU training path: the blocked fused kernels as custom ops ---------------------------------------
COMPILED_VARIANTS = [
    ("alibi_2d", {}, False),
    ("fire", {}, False),
    ("fire", {}, True),  # per-sample pair codes after patch dropout
    ("irpe", {}, False),  # contextual, key side: the term reads s q table, rebuilt from q in backward
    ("irpe", {"mode": "contextual", "sides": "qk", "method": "euclidean"}, False),
    ("irpe", {"mode": "bias", "sides": "qk", "shared_head": False}, False),
]


class _GraphRecorder:
    """An ``aot_eager`` backend that keeps the text of every graph dynamo hands it."""

    def __init__(self):
        self.graphs: list[str] = []
        self._inner = torch._dynamo.lookup_backend("aot_eager")

    def __call__(self, gm, example_inputs):
        self.graphs.append(str(gm.graph))
        return self._inner(gm, example_inputs)


@pytest.mark.parametrize("name, options, dropout", COMPILED_VARIANTS,
                         ids=[f"{n}{o or ''}{'-patch_dropout' if d else ''}" for n, o, d in COMPILED_VARIANTS])
def test_compiled_training_runs_the_custom_op_and_equals_the_dense_mask(name, options, dropout):
    """``torch.compile(fullgraph=True)`` of a training step on the blocked path calls ``vispe::indexed_bias_attention``
    (forward) and its backward op; outputs and the gradients of q, k, v and the encoding's parameters equal the dense
    oracle's; a second step reuses the graph (the op's key is stable across calls)."""
    enc = bias_encoding(name, options, 1)
    grid, (q, k, v, w) = attention_inputs(PositionGrid(bias_grid_shape(name), 1), dropout, 7)

    def step(q, k, v):
        state = enc.prepare(grid)
        if grid.keep is not None:
            state = enc.keep_tokens(state, grid)
        return enc.attend(q, k, v, layer=1, state=state)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        enc.zero_grad(set_to_none=True)
        out = fn(*leaves)
        (out * w).sum().backward()
        return out.detach(), [t.grad for t in leaves] + [None if p.grad is None else p.grad.clone() for p in enc.parameters()]

    enc.set_attention_backend("dense")
    out_d, grads_d = run(step)
    assert any(gd is not None and gd.abs().sum() > 0 for gd in grads_d[3:]) or not list(enc.parameters())
    enc.set_attention_backend("blocked", block_rows=3)  # several blocks, the last one short
    torch._dynamo.reset()
    recorder = _GraphRecorder()
    compiled = torch.compile(step, fullgraph=True, backend=recorder)
    for _ in range(2):
        out, grads = run(compiled)
        torch.testing.assert_close(out, out_d, **TOL)
        for i, (a, b) in enumerate(zip(grads, grads_d)):
            if b is None:
                assert a is None or a.abs().sum() == 0
            else:
                torch.testing.assert_close(a, b, **TOL, msg=lambda m, i=i: f"gradient {i}: {m}")
    assert len(recorder.graphs) == 1 and "vispe.indexed_bias_attention" in recorder.graphs[0]
    torch._dynamo.reset()


def _op_arguments(name: str, options: dict, dtype: torch.dtype = torch.float64):
    """The custom op's arguments for one layer of ``name``: ``(q, k, v, inputs, key, scale, rows, fused_rows)``."""
    from vispe.encodings.attention import _op_key

    enc = bias_encoding(name, options, 1).to(dtype)
    grid = PositionGrid(bias_grid_shape(name), 1)
    g = torch.Generator().manual_seed(6)
    # (B, L, H, D) memory seen as (B, H, L, D), as a ViT's q, k, v are: the fake kernels must not copy the layout
    q, k, v = (torch.randn(2, grid.seq_len, 2, 8, generator=g, dtype=dtype).transpose(1, 2).requires_grad_()
               for _ in range(3))
    spec = enc.indexed_bias(q, k, layer=1, state=enc.prepare(grid), scale=8**-0.5)
    key = _op_key(spec)
    assert key is not None and key == _op_key(enc.indexed_bias(q, k, layer=1, state=enc.prepare(grid), scale=8**-0.5))
    inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in spec.inputs]
    return q, k, v, inputs, key, 8**-0.5, 3, 5


@pytest.mark.parametrize("native", [False, True], ids=["pytorch_ops", "native_kernels"])
@pytest.mark.parametrize("name, options", [("alibi_2d", {}), ("fire", {}), ("irpe", {"mode": "contextual", "sides": "qk"})])
def test_custom_ops_pass_opcheck(name, options, native, monkeypatch):
    """``torch.library.opcheck``: schema, fake tensors (the output's ``(B, L, H, D)`` layout included), autograd
    registration and AOT dispatch of both ops, on the PyTorch-ops path (float64) and on the native kernels (float32,
    every length native; skipped where they cannot be built)."""
    if native:
        from vispe.encodings import attention as attention_module
        from vispe.encodings.native import indexed_term_kernels

        if indexed_term_kernels() is None:
            pytest.skip("the native kernels could not be built here (no C++ compiler?)")
        monkeypatch.setattr(attention_module, "NATIVE_MIN_KEYS", 0)
    args = _op_arguments(name, options, torch.float32 if native else torch.float64)
    torch.library.opcheck(torch.ops.vispe.indexed_bias_attention.default, args)
    q, k, v, inputs, key, scale, rows, fused_rows = args
    with torch.no_grad():
        out, lse = torch.ops.vispe.indexed_bias_attention(q, k, v, inputs, key, scale, rows, fused_rows)
    want = [t.is_floating_point() for t in inputs]
    dout = torch.randn_like(out)
    bwd = (dout, q.detach(), k.detach(), v.detach(), out, lse, [t.detach() for t in inputs], want, key, scale, rows,
           fused_rows)
    torch.library.opcheck(torch.ops.vispe.indexed_bias_attention_backward.default, bwd)


def test_terms_of_unnamed_callables_keep_the_traceable_path():
    from vispe.encodings.attention import IndexedBias, _op_key, bias_function

    table = torch.zeros(2, 5)
    assert _op_key(IndexedBias(lambda b, h, i, j, t: t[h, j], (table,))) is None
    with pytest.raises(ValueError, match="already registered"):
        bias_function("lattice_pair_term")(lambda b, h, i, j, t: t)


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_with_qk_wider_than_v_stays_on_the_fused_kernel(causal):
    """q/k wider than v (PoPE): vispe's sdpa runs on the flash kernel alone (the math fallback, which keeps (L, L)
    probabilities, is off) and equals softmax(q k^T s) v, gradients included."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from vispe.encodings.attention import sdpa

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 9, 16, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 3, 9, 8, generator=g, requires_grad=True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = sdpa(q, k, v, is_causal=causal, scale=8 ** -0.5)
    logits = q @ k.transpose(-1, -2) * 8 ** -0.5
    if causal:
        logits = logits.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.softmax(logits, -1) @ v
    torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-5)
    for got, ref in zip(torch.autograd.grad(out.square().sum(), (q, k, v)), torch.autograd.grad(want.square().sum(), (q, k, v))):
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
