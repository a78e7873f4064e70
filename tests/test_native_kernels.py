"""The native CPU kernels of the blocked attention path (vispe/encodings/csrc/indexed_term.cpp): for every bias encoding
(the registry's ``kind == 'bias'`` names) and the option sets that change what the term reads, a float32 training step
on the native forward and backward equals the float64 dense ``attn_mask`` oracle -- outputs and the gradients of q, k,
v and the encoding's parameters -- with prefix tokens and after patch dropout, over several blocks and partial tiles; the
native path is really taken, also inside a compiled graph, and ``VISPE_NATIVE_KERNELS=0`` switches it off.

The kernels are compiled on first use; where no C++ compiler is available the tests skip and say so.
"""
from __future__ import annotations

import pytest
import torch

import vispe
from bias_checks import attention_inputs, bias_encoding, bias_grid_shape
from vispe.encodings import PositionGrid
from vispe.encodings import attention as attention_module
from vispe.encodings import native

BIAS = vispe.list_encodings(kind="bias")
VARIANTS = [(n, {}) for n in BIAS] + [
    ("irpe", {"mode": "bias", "sides": "qk", "shared_head": False, "method": "cross"}),
    ("irpe", {"mode": "contextual", "sides": "qk", "method": "euclidean"}),
    ("fire", {"distance": "axial", "share_layers": True}),
]


@pytest.fixture(scope="module")
def kernels():
    built = native.indexed_term_kernels()
    if built is None:
        pytest.skip("the native kernels could not be built here (no C++ compiler?); the PyTorch-ops path is tested elsewhere")
    return built


@pytest.fixture
def spy(kernels, monkeypatch):
    """Counts the kernel calls; small tiles and blocks so a short sequence spans several of each, with partial ones."""
    calls = {"forward": 0, "backward": 0, "gather": 0}

    class Counting:
        def term_attention_forward(self, *args):
            calls["forward"] += 1
            return kernels.term_attention_forward(*args)

        def term_attention_backward(self, *args):
            calls["backward"] += 1
            return kernels.term_attention_backward(*args)

        def gather_term(self, *args):
            calls["gather"] += 1
            return kernels.gather_term(*args)

    monkeypatch.setitem(native._STATE, "module", Counting())
    monkeypatch.setattr(attention_module, "NATIVE_TILE_ROWS", 4)
    monkeypatch.setattr(attention_module, "NATIVE_INDEX_ELEMENTS", 64)
    monkeypatch.setattr(attention_module, "NATIVE_MIN_KEYS", 0)  # every path native, whatever the length
    return calls


def _step(enc, grid, tensors, dtype, backend, compiled=False):
    enc = enc.to(dtype)
    enc.zero_grad(set_to_none=True)
    q, k, v, w = (t.to(dtype) for t in tensors)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    state = enc.prepare(grid)
    if grid.keep is not None:
        state = enc.keep_tokens(state, grid)
    enc.set_attention_backend(backend)

    def attend(q_, k_, v_):
        return enc.attend(q_, k_, v_, layer=1, state=state)

    out = (torch.compile(attend, fullgraph=True, backend="aot_eager") if compiled else attend)(*leaves)
    (out * w).sum().backward()
    grads = [t.grad for t in leaves] + [None if p.grad is None else p.grad.clone() for p in enc.parameters()]
    return out.detach().double(), [None if g is None else g.double() for g in grads]


def _assert_equal_to_oracle(got, want):
    out, grads = got
    out_d, grads_d = want
    tol = dict(atol=2e-5, rtol=2e-4)  # float32 against the float64 oracle
    torch.testing.assert_close(out, out_d, **tol)
    for i, (a, b) in enumerate(zip(grads, grads_d)):
        if b is None or b.abs().sum() == 0:
            assert a is None or a.abs().sum() == 0, f"gradient {i} should be zero"
        else:
            torch.testing.assert_close(a, b, **tol, msg=lambda m, i=i: f"gradient {i}: {m}")


@pytest.mark.parametrize("prefix", [0, 1, 3], ids=["no_prefix", "cls", "cls_registers"])
@pytest.mark.parametrize("dropout", [False, True], ids=["all_tokens", "patch_dropout"])
@pytest.mark.parametrize("name, options", VARIANTS, ids=[f"{n}{o or ''}" for n, o in VARIANTS])
def test_native_training_step_equals_the_dense_oracle(spy, name, options, dropout, prefix):
    enc = bias_encoding(name, options, prefix)
    grid, tensors = attention_inputs(PositionGrid(bias_grid_shape(name), prefix), dropout, 7)
    want = _step(enc, grid, tensors, torch.float64, "dense")
    assert spy == {"forward": 0, "backward": 0, "gather": 0}  # float64 and the dense path stay in PyTorch ops
    got = _step(enc, grid, tensors, torch.float32, "blocked")
    blocks = -(-tensors[0].shape[2] // 4)  # NATIVE_INDEX_ELEMENTS = 64 over >= 13 keys: 4 rows (one tile) a block
    assert spy["forward"] >= blocks - 1 and spy["backward"] >= blocks - 1, spy
    _assert_equal_to_oracle(got, want)


@pytest.mark.parametrize("prefix", [0, 2], ids=["no_prefix", "prefix"])
@pytest.mark.parametrize("dropout", [False, True], ids=["all_tokens", "patch_dropout"])
@pytest.mark.parametrize(
    "options, shape",
    [({"ratio": 0.5}, (8, 9)), ({}, (20, 20)), ({"method": "cross", "sides": "qk"}, (6, 7)), ({"mode": "bias"}, (20, 20))],
    ids=["product_r0.5", "product_default", "cross_qk", "bias_mode"],
)
def test_irpe_bucket_row_templates_equal_the_dense_oracle(spy, options, shape, dropout, prefix):
    """On grids where the distinct rows of iRPE's bucket lookup (one per row bucket) hold at most 3/4 as many entries as
    there are keys, the kernels read the buckets through per-query templates: equal to the oracle over whole and
    partial lattice rows (patch dropout keeps all but 3 patches), with prefix tokens."""
    enc = bias_encoding("irpe", options, prefix, shape)
    kept = shape[0] * shape[1] - 3
    grid, tensors = attention_inputs(PositionGrid(shape, prefix), dropout, kept)
    state = enc.prepare(PositionGrid(shape, prefix))
    span = state.pairs.span
    assert span == 2 * shape[1] - 1
    rows = state.lut[-1, :-1].view(-1, span)  # the column table of 'cross'; the product table otherwise
    assert 4 * rows.unique(dim=0).numel() <= 3 * tensors[0].shape[2]  # the templates' condition holds for this grid
    want = _step(enc, grid, tensors, torch.float64, "dense")
    got = _step(enc, grid, tensors, torch.float32, "blocked")
    assert spy["forward"] > 0 and spy["backward"] > 0, spy
    _assert_equal_to_oracle(got, want)


@pytest.mark.parametrize("pack", [True, False], ids=["keys_copied_per_head", "keys_read_in_place"])
@pytest.mark.parametrize("name", ["fire", "irpe", "alibi_2d"])
def test_kernels_read_qkv_views_in_place(spy, kernels, name, pack):
    """As in a model, q, k and v are views of one (B, L, 3, H, D) projection: the kernels read q where it lies, and
    k and v either once copied per (sample, head) for all its tiles (the default: their rows are 3 H D floats apart)
    or where they lie; the output comes laid out (B, L, H, D), so merging the heads is a view. Outputs and the
    projection's gradient equal the oracle's, also for a loss whose output gradient is an expanded (stride-0) tensor."""
    kernels.set_pack_keys(pack)
    try:
        _check_qkv_views(spy, name)
    finally:
        kernels.set_pack_keys(True)


def _check_qkv_views(spy, name):
    enc = bias_encoding(name, {}, 1)
    grid = PositionGrid(bias_grid_shape(name), 1)
    n, g = grid.seq_len, torch.Generator().manual_seed(5)
    qkv = torch.randn(2, n, 3, 2, 8, generator=g, dtype=torch.float64)
    weight = torch.randn(2, n, 16, generator=g, dtype=torch.float64)
    results = []
    for dtype, backend in ((torch.float64, "dense"), (torch.float32, "blocked")):
        enc = enc.to(dtype)
        enc.set_attention_backend(backend)
        grads = []
        for loss in ("weighted", "sum"):
            state = enc.prepare(grid)
            x = qkv.to(dtype).detach().requires_grad_()
            q, k, v = x.permute(2, 0, 3, 1, 4).unbind(0)
            out = enc.attend(q, k, v, layer=1, state=state)
            merged = out.transpose(1, 2).reshape(2, n, 16)
            if backend == "blocked":
                assert merged.data_ptr() == out.data_ptr() and out.transpose(1, 2).is_contiguous()
            (merged * weight.to(dtype) if loss == "weighted" else merged).sum().backward()
            grads.append(x.grad.double())
        results.append((out.detach().double(), grads))
    assert spy["forward"] > 0 and spy["backward"] > 0, spy
    _assert_equal_to_oracle(results[1], results[0])


@pytest.mark.parametrize("direct", [True, False], ids=["direct_sgemm", "at_mm"])
@pytest.mark.parametrize("name", ["fire", "irpe", "alibi_2d"])
def test_tile_products_through_either_blas_entry(spy, kernels, name, direct):
    """The tiles' products call the BLAS's sgemm directly where PyTorch's library exports it (MKL builds), else at::mm
    on views of the same memory: both equal the oracle (the transposed and accumulating products of the backward
    included)."""
    if direct and not kernels.has_direct_blas():
        pytest.skip("this PyTorch's BLAS exports no Fortran sgemm; the at::mm case covers the kernels")
    enc = bias_encoding(name, {}, 1)
    grid, tensors = attention_inputs(PositionGrid(bias_grid_shape(name), 1), True, 9)
    want = _step(enc, grid, tensors, torch.float64, "dense")
    kernels.set_direct_blas(direct)
    try:
        got = _step(enc, grid, tensors, torch.float32, "blocked")
    finally:
        kernels.set_direct_blas(True)
    assert spy["forward"] > 0 and spy["backward"] > 0, spy
    _assert_equal_to_oracle(got, want)


@pytest.mark.parametrize("name", ["fire", "irpe"])
def test_native_path_runs_inside_a_compiled_graph(spy, name):
    """Compiled training calls the blocked path as the custom ops vispe::indexed_bias_attention(_backward), whose
    kernels are the native ones: same values as the oracle, kernels called."""
    enc = bias_encoding(name, {}, 1)
    grid, tensors = attention_inputs(PositionGrid(bias_grid_shape(name), 1), False, 7)
    want = _step(enc, grid, tensors, torch.float64, "dense")
    got = _step(enc, grid, tensors, torch.float32, "blocked", compiled=True)
    assert spy["forward"] > 0 and spy["backward"] > 0, spy
    _assert_equal_to_oracle(got, want)


@pytest.mark.parametrize("name, backward", [("fire", True), ("irpe", True), ("alibi_2d", False)])
def test_short_sequences_keep_the_fused_flash_kernels_unless_a_term_gradient_is_needed(spy, monkeypatch, name, backward):
    """Below NATIVE_MIN_KEYS the forward (and the backward of a term without parameters) stays on PyTorch's fused flash
    kernels; a learnable term's backward is native at any length."""
    monkeypatch.setattr(attention_module, "NATIVE_MIN_KEYS", 1000)
    enc = bias_encoding(name, {}, 1)
    grid, tensors = attention_inputs(PositionGrid(bias_grid_shape(name), 1), False, 7)
    want = _step(enc, grid, tensors, torch.float64, "dense")
    got = _step(enc, grid, tensors, torch.float32, "blocked")
    assert spy["forward"] == 0 and (spy["backward"] > 0) == backward, spy
    _assert_equal_to_oracle(got, want)


def test_switched_off_by_the_environment(spy, monkeypatch):
    monkeypatch.setenv(native.NATIVE_KERNELS_ENV, "0")
    assert native.indexed_term_kernels() is None
    enc = bias_encoding("fire", {}, 1)
    grid, tensors = attention_inputs(PositionGrid((3, 4), 1), False, 7)
    want = _step(enc, grid, tensors, torch.float64, "dense")
    got = _step(enc, grid, tensors, torch.float32, "blocked")
    assert spy == {"forward": 0, "backward": 0, "gather": 0}
    _assert_equal_to_oracle(got, want)


def test_kernels_reject_bad_blocks_with_a_clear_error(kernels):
    q = torch.zeros(1, 1, 4, 8)
    k = torch.zeros(1, 1, 5, 8)
    out, lse = torch.empty(1, 1, 4, 8), torch.empty(1, 1, 4)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        kernels.term_attention_forward(q, k, k, [], [], [], [], [], [], out, lse.double(), 0, 4, 4, 1.0)
    with pytest.raises(RuntimeError, match=r"q: float32 \(B, H, rows, D\) with contiguous rows"):
        kernels.term_attention_forward(q.double(), k, k, [], [], [], [], [], [], out, lse, 0, 4, 4, 1.0)
    with pytest.raises(RuntimeError, match=r"rows row0 \.\. row0 \+ R of the queries"):
        kernels.term_attention_forward(q, k, k, [], [], [], [], [], [], out, lse, 2, 4, 4, 1.0)
    with pytest.raises(RuntimeError, match="one table, gradient, index"):
        kernels.term_attention_forward(q, k, k, [torch.zeros(1, 3)], [], [], [], [], [], out, lse, 0, 4, 4, 1.0)
    bad_ids = torch.zeros(1, 3, 5, dtype=torch.int32)  # 3 rows for a 4-row block
    ints = [0, 3, 0, 0, 0, 0, 0, 0, 0, 0]
    none = torch.empty(0, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"ids: contiguous int32 \(B\|1, rows, L\)"):
        kernels.term_attention_forward(q, k, k, [torch.zeros(1, 3)], [bad_ids], [none], [none], [none], ints, out, lse, 0, 4,
                                       4, 1.0)
    codes_q, codes_k = torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, 5, dtype=torch.int32)
    lut = torch.zeros(10, dtype=torch.int32)  # 9 offset ids and the fill
    ints = [0, 3, 0, 0, 0, 0, 0, 4, 9, 2]  # a span of 2 does not divide 9 offset ids
    with pytest.raises(RuntimeError, match="lookup rows: a span that divides the offset ids"):
        kernels.term_attention_forward(q, k, k, [torch.zeros(1, 3)], [none], [codes_q], [codes_k], [lut], ints, out, lse,
                                       0, 4, 4, 1.0)


def test_exp_and_softmax_of_the_forward_match_torch(kernels):
    """The forward's exp polynomial and log-sum-exp over a wide logit range (no term): torch's softmax to float32
    rounding, including rows whose logits span ~80 (weights down at exp(-80))."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 37, 16, generator=g) * 3.0
    k = torch.randn(2, 3, 41, 16, generator=g) * 3.0
    v = torch.randn(2, 3, 41, 16, generator=g)
    out, lse = torch.empty(2, 3, 37, 16), torch.empty(2, 3, 37)
    kernels.term_attention_forward(q, k, v, [], [], [], [], [], [], out, lse, 0, 37, 8, 1.0)
    logits = q.double() @ k.double().transpose(-1, -2)
    assert logits.amax(-1).sub(logits.amin(-1)).max() > 60
    torch.testing.assert_close(lse.double(), torch.logsumexp(logits, -1), atol=1e-4, rtol=1e-6)
    torch.testing.assert_close(out.double(), torch.softmax(logits, -1) @ v.double(), atol=1e-5, rtol=1e-5)


# -- batched small products (LieRE's 8 x 8 blocks) ---------------------------------------------------------------
@pytest.mark.parametrize("n,m,k,a_t,b_t", [(37, 8, 8, False, False), (37, 8, 8, True, False), (5, 16, 8, False, False),
                                           (9, 8, 16, True, False), (1, 3, 5, False, False), (0, 8, 8, False, False),
                                           (37, 8, 8, True, True)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_small_bmm_equals_torch_bmm(kernels, monkeypatch, n, m, k, a_t, b_t, accumulate):
    """``small_bmm`` runs the native kernel for float32 products with 8 result columns (a transposed ``a`` and
    accumulation included; a transposed ``b`` takes ``torch.bmm``), and equals ``torch.bmm`` / ``baddbmm_``."""
    calls = []
    monkeypatch.setattr(native, "indexed_term_kernels", lambda: calls.append(1) or kernels)
    torch.manual_seed(0)
    a = torch.randn(n, k, m).transpose(1, 2) if a_t else torch.randn(n, m, k)
    b = torch.randn(n, 8, k).transpose(1, 2) if b_t else torch.randn(n, k, 8)
    want = torch.bmm(a, b)
    if accumulate:
        out = torch.randn(n, m, 8)
        want = want + out
        got = native.small_bmm(a, b, out=out, accumulate=True)
        assert got is out
    else:
        got = native.small_bmm(a, b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert bool(calls) != b_t, "the native kernel runs exactly when b's rows are contiguous"


def test_small_bmm_falls_back_to_torch_where_the_kernel_does_not_apply(kernels, monkeypatch):
    """Other widths, taller products, float64, and inputs autograd must follow go through ``torch.bmm`` (same values,
    gradients kept)."""
    def refuse():
        raise AssertionError("the native kernel must not be used here")

    monkeypatch.setattr(native, "indexed_term_kernels", refuse)
    a, b = torch.randn(4, 8, 8), torch.randn(4, 8, 7)
    torch.testing.assert_close(native.small_bmm(a, b), torch.bmm(a, b))
    torch.testing.assert_close(native.small_bmm(a.double(), b.double()), torch.bmm(a.double(), b.double()))
    tall, square = torch.randn(4, 24, 8), torch.randn(4, 8, 8)
    torch.testing.assert_close(native.small_bmm(tall, square), torch.bmm(tall, square))
    w = torch.randn(4, 8, 8, requires_grad=True)
    native.small_bmm(a, w).sum().backward()
    torch.testing.assert_close(w.grad, torch.bmm(a.transpose(1, 2), torch.ones(4, 8, 8)))


def test_liere_training_step_is_the_same_with_the_native_small_products(kernels, monkeypatch):
    """LieRE (8 x 8 blocks, float32): logits and every gradient of a training step equal those with the native
    kernels switched off (``VISPE_NATIVE_KERNELS=0``: ``torch.bmm`` for every product)."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vispe_vit_small_patch16_224", pretrained=False, depth=2, img_size=64,
                              pos_encoding={"name": "liere", "block_size": 8}).train()
    x, y = torch.randn(2, 3, 64, 64), torch.tensor([0, 1])

    def run():
        model.zero_grad()
        out = model(x)
        torch.nn.functional.cross_entropy(out, y).backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    calls = []
    monkeypatch.setattr(native, "indexed_term_kernels", lambda: calls.append(1) or kernels)
    out_native, g_native = run()
    assert calls, "the native kernel was not used"
    monkeypatch.setattr(native, "indexed_term_kernels", lambda: None)
    out_torch, g_torch = run()
    torch.testing.assert_close(out_native, out_torch, rtol=1e-5, atol=1e-5)
    for n in g_torch:
        scale = g_torch[n].abs().max().clamp_min(1e-12)
        assert ((g_native[n] - g_torch[n]).abs().max() / scale) < 1e-4, n
