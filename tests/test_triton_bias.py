"""The fused attention-term kernels (``attention_backend='triton'``) against the dense oracle (SDPA with the term as
``attn_mask``).

The kernels run here in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set per test): the same kernel
source the GPU compiles. Checked, in float32: the operator on its own (tables per row and per head, with and without
a bucket lookup, prefix tokens, per-sample codes as after patch dropout, shapes that fill no tile, every way the
backward returns the table's gradient), every bias encoding through its ``attend`` (outputs and the gradients of q, k,
v and every parameter) and a model eager and compiled whole; bfloat16 within its rounding; what the backward keeps;
the refusals; and that Triton compiles the four kernels for a Hopper GPU. Skipped where Triton does not import.
"""
from __future__ import annotations

import pytest
import timm
import torch
import torch.nn.functional as F
from bias_checks import attention_inputs, bias_encoding, bias_grid_shape
from functorch.compile import make_boxed_func
from torch._dynamo.testing import CompileCounterWithBackend

import vispe
from vispe.encodings import PositionGrid, triton_bias
from vispe.encodings.triton_bias import term_attention, triton_bias_unavailable

pytestmark = [pytest.mark.skipif(triton_bias_unavailable() is not None, reason="Triton does not import"),
              pytest.mark.usefixtures("triton_interpreter")]  # tests/conftest.py

BIAS = vispe.list_encodings(kind="bias")
#: options whose term the kernels take (one lattice part read at the query's row) ...
TAKEN = [(n, {}) for n in BIAS] + [
    ("irpe", {"mode": "bias", "shared_head": False}),
    ("irpe", {"method": "euclidean"}),
    ("fire", {"distance": "axial", "share_layers": True}),
]
#: ... and those it refuses, naming why: a query-side part, two tables
REFUSED = [("irpe", {"sides": "qk"}), ("irpe", {"mode": "bias", "method": "cross"})]
TOL = {"atol": 2e-5, "rtol": 2e-5}


def _buckets(codes_q, codes_k, lut, center, fill):
    pair = codes_q[:, :, None] - codes_k[:, None, :] + center
    pair = torch.where((codes_q[:, :, None] >= 0) & (codes_k[:, None, :] >= 0), pair, torch.tensor(fill))
    return pair if lut is None else lut[pair]


def _dense(q, k, v, table, codes, lut, center, fill, scale=None):
    """The oracle: the term gathered into ``(B, H, L, L)`` and handed to SDPA."""
    bsz, heads, tokens, _ = q.shape
    bucket = _buckets(codes, codes, lut, center, fill)  # (B|1, L, L)
    t = table.view(1, heads, 1, -1) if table.ndim == 2 else table
    t = t.expand(bsz, heads, tokens, t.shape[-1])
    term = torch.gather(t, -1, bucket[:, None].expand(bsz, heads, tokens, tokens))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=term, scale=scale)


def _codes(kind: str, bsz: int, tokens: int, g: torch.Generator) -> torch.Tensor:
    """Lattice codes of ``tokens`` tokens, the first a prefix token (-1): one row for the batch, or per sample a
    random subset of a larger lattice in random order (patch dropout)."""
    if kind == "shared":
        return torch.cat([torch.tensor([-1]), torch.arange(tokens - 1) * 3 % 53]).view(1, tokens)
    rows = [torch.cat([torch.tensor([-1]), torch.randperm(53, generator=g)[: tokens - 1]]) for _ in range(bsz)]
    return torch.stack(rows)


@pytest.mark.parametrize("row_grad", ["one_hot", "atomic", "matmul"])
@pytest.mark.parametrize("codes_kind", ["shared", "per_sample"])
@pytest.mark.parametrize("table_kind", ["per_row", "per_row_shared", "per_row_wide", "per_head", "per_head_lut"])
def test_operator_equals_the_dense_oracle_with_gradients(table_kind, codes_kind, row_grad, monkeypatch):
    monkeypatch.setattr(triton_bias, "ROW_GRAD", row_grad)
    g = torch.Generator().manual_seed(0)
    bsz, heads, tokens, dh = 2, 3, 37, 24  # 37 tokens fill no tile; 24 channels fill no power of two
    center, fill = 52, 105  # offsets of codes in [0, 53): [-52, 52] -> ids [0, 104]; 105 = a prefix pair
    columns = {"per_row": 9, "per_row_shared": 9, "per_row_wide": 140, "per_head": fill + 1, "per_head_lut": 11}[table_kind]
    lut = None if table_kind == "per_head" else torch.randint(0, columns - 1, (fill + 1,), generator=g)
    if lut is not None:
        lut[fill] = columns - 1  # the prefix bucket
    shape = {"per_row": (bsz, heads, tokens, columns), "per_row_shared": (1, heads, tokens, columns),
             "per_row_wide": (bsz, heads, tokens, columns)}.get(table_kind, (heads, columns))
    table = torch.randn(*shape, generator=g).requires_grad_()
    q, k, v = (torch.randn(bsz, heads, tokens, dh, generator=g).requires_grad_() for _ in range(3))
    codes = _codes(codes_kind, bsz, tokens, g)
    w = torch.randn(bsz, heads, tokens, dh, generator=g)
    by_matmul = []
    matmul = triton_bias._row_grad_by_matmul
    monkeypatch.setattr(triton_bias, "_row_grad_by_matmul", lambda *a: by_matmul.append(1) or matmul(*a))
    got = term_attention(q, k, v, table, codes, codes, center, fill, lut, scale=0.3)
    want = _dense(q, k, v, table, codes, lut, center, fill, scale=0.3)
    torch.testing.assert_close(got, want, **TOL)
    assert got.stride() == (tokens * heads * dh, dh, heads * dh, 1)  # token-major: the head merge is a view
    grads = torch.autograd.grad((got * w).sum(), (q, k, v, table))
    refs = torch.autograd.grad((want * w).sum(), (q, k, v, table))
    for name, a, b in zip(("q", "k", "v", "table"), grads, refs):
        assert b.abs().sum() > 0
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=name: f"gradient of {n}: {m}")
    # the batched product takes a narrow table per row whose buckets the batch shares; the rest is summed in the kernel
    assert bool(by_matmul) == (row_grad == "matmul" and codes_kind == "shared" and table_kind in ("per_row", "per_row_shared"))


def test_half_precision_within_its_rounding():
    # float16: Triton's interpreter multiplies bfloat16 tiles wrongly (tl.dot of two bf16 tiles is off by ~1e10 there,
    # on its own); the kernels take either 16-bit type the same way, and the GPU probe checks bfloat16 on the device
    g = torch.Generator().manual_seed(1)
    bsz, heads, tokens, dh, columns = 2, 2, 33, 16, 7
    q, k, v = (torch.randn(bsz, heads, tokens, dh, generator=g).requires_grad_() for _ in range(3))
    table = torch.randn(bsz, heads, tokens, columns, generator=g).requires_grad_()
    codes = _codes("shared", bsz, tokens, g)
    lut = torch.randint(0, columns, (106,), generator=g)
    w = torch.randn(bsz, heads, tokens, dh, generator=g)
    want = _dense(q, k, v, table, codes, lut, 52, 105)
    refs = torch.autograd.grad((want * w).sum(), (q, k, v, table))
    leaves = [t.detach().half().requires_grad_() for t in (q, k, v, table)]
    got = term_attention(*leaves, codes, codes, 52, 105, lut)
    assert got.dtype == torch.float16
    grads = torch.autograd.grad((got.float() * w).sum(), leaves)
    # 16-bit inputs and outputs (11 bits of mantissa), float32 inside: within a few roundings of the float32 result
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)
    for name, a, b in zip(("q", "k", "v", "table"), grads, refs):
        assert a.dtype == torch.float16
        torch.testing.assert_close(a.float(), b, atol=2e-2, rtol=2e-2, msg=lambda m, n=name: f"gradient of {n}: {m}")


def test_operator_passes_opcheck():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=g, requires_grad=True) for _ in range(3))
    table = torch.randn(1, 2, 9, 5, generator=g, requires_grad=True)
    codes = torch.cat([torch.tensor([-1]), torch.arange(8)]).view(1, 9)
    lut = torch.randint(0, 4, (18,), generator=g)
    torch.library.opcheck(torch.ops.vispe.term_attention.default, (q, k, v, table, codes, codes, lut, 8, 17, 0.25))


def _attend(enc, grid, q, k, v, w, backend):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    enc.zero_grad(set_to_none=True)
    state = enc.prepare(grid)
    if grid.keep is not None:
        state = enc.keep_tokens(state, grid)
    enc.set_attention_backend(backend)
    out = enc.attend(*leaves, layer=1, state=state)
    (out * w).sum().backward()
    return out.detach(), [t.grad for t in leaves] + [None if p.grad is None else p.grad.clone() for p in enc.parameters()]


@pytest.mark.parametrize("prefix", [0, 1], ids=["no_prefix", "cls"])
@pytest.mark.parametrize("dropout", [False, True], ids=["all_tokens", "patch_dropout"])
@pytest.mark.parametrize("name, options", TAKEN, ids=[f"{n}{o or ''}" for n, o in TAKEN])
def test_every_bias_encoding_equals_the_dense_path(name, options, dropout, prefix):
    enc = bias_encoding(name, options, prefix).float()
    grid, inputs = attention_inputs(PositionGrid(bias_grid_shape(name), prefix), dropout, 7)
    q, k, v, w = (t.float() for t in inputs)
    out_d, grads_d = _attend(enc, grid, q, k, v, w, "dense")
    out, grads = _attend(enc, grid, q, k, v, w, "triton")
    torch.testing.assert_close(out, out_d, **TOL)
    assert any(b is not None and b.abs().sum() > 0 for b in grads_d[3:]) or not list(enc.parameters())
    for i, (a, b) in enumerate(zip(grads, grads_d)):
        if b is None:
            assert a is None or a.abs().sum() == 0
        else:
            torch.testing.assert_close(a, b, **TOL, msg=lambda m, i=i: f"gradient {i}: {m}")


@pytest.mark.parametrize("name, options", REFUSED, ids=[f"{n}{o}" for n, o in REFUSED])
def test_terms_the_kernels_do_not_cover_are_refused_with_the_reason(name, options):
    enc = bias_encoding(name, options, 1).float()
    grid, inputs = attention_inputs(PositionGrid(bias_grid_shape(name), 1), False, 7)
    q, k, v, _ = (t.float() for t in inputs)
    enc.set_attention_backend("triton")
    with pytest.raises(ValueError, match=r"attention_backend='triton' runs a term of one lattice part read at the "
                                         r"query's row .* choose one of \['auto', 'dense', 'blocked', 'flex'\]"):
        enc.attend(q, k, v, layer=1, state=enc.prepare(grid))


def test_refusals_name_the_bad_setting(monkeypatch):
    enc = bias_encoding("alibi_2d", {}, 1).float()
    grid, inputs = attention_inputs(PositionGrid(bias_grid_shape("alibi_2d"), 1), False, 7)
    q, k, v, _ = (t.float() for t in inputs)
    state = enc.prepare(grid)
    enc.set_attention_backend("triton")
    with pytest.raises(ValueError, match="no attention dropout"):
        enc.attend(q, k, v, layer=1, state=state, dropout_p=0.1)
    with pytest.raises(ValueError, match="no attention mask and no causal masking"):
        enc.attend(q, k, v, layer=1, state=state, is_causal=True)
    with pytest.raises(ValueError, match=r"needs q, k and v of one shape .*\(2, 2, 13, 8\), \(2, 2, 13, 8\) and \(2, 2, 13, 4\)"):
        enc.attend(q, k, v[..., :4], layer=1, state=state)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match=r"runs CUDA tensors .*not cpu; choose one of \['auto', 'dense', 'blocked', 'flex'\]"):
        enc.attend(q, k, v, layer=1, state=state)
    with pytest.raises(ValueError, match=r"attention_backend='fused' is not valid; choose one of .*'triton'\]"):
        enc.set_attention_backend("fused")


MODEL = "vispe_vit_tiny_patch4_32"


@pytest.mark.parametrize("encoding", [{"name": "irpe", "init_std": 0.5}, {"name": "fire"}], ids=["irpe", "fire"])
def test_a_model_trains_the_same_eager_and_compiled_whole(encoding):
    """In a ViT, iRPE (its per-row projection, bucket lookup and per-row gradient) and FIRE (a learned per-head table,
    its gradient per pair): logits and every parameter gradient equal the dense path's, eager and compiled (one
    graph: the kernels are opaque operators); the backward keeps no (L, L) tensor."""
    torch.manual_seed(0)
    kw = {"pos_encoding": encoding, "embed_dim": 48, "depth": 2, "num_heads": 3, "num_classes": 5}
    ref = timm.create_model(MODEL, **kw)
    model = timm.create_model(MODEL, **kw)
    model.load_state_dict(ref.state_dict())
    model.pos_encoding.set_backend("triton")
    ref.pos_encoding.set_backend("dense")
    x = torch.randn(2, 3, 32, 32)
    tokens = model.patch_embed.num_patches + model.num_prefix_tokens
    ref(x).sum().backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    counter = CompileCounterWithBackend("aot_eager_decomp_partition")  # inductor's decompositions and partitioner
    for fn in (model, torch.compile(model, backend=counter, fullgraph=True)):
        model.zero_grad(set_to_none=True)
        saved = []

        def pack(t, saved=saved):
            saved.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(x)
        assert not [s for s in saved if len(s) >= 2 and s[-2:] == (tokens, tokens)], saved
        torch.testing.assert_close(out, ref(x), **TOL)
        out.sum().backward()
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[n], **TOL, msg=lambda m, n=n: f"{n}: {m}")
    assert counter.frame_count == 1


def test_a_compiled_model_launches_the_kernels_itself_and_builds_the_buckets_once():
    # the operators are traced (triton_op): the compiled graphs hold the kernel launches, and the backward's
    # position-only work -- every pair's bucket and its one-hot, the same in every layer -- is computed once
    import collections

    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    def backend(gm, example_inputs):  # inductor's decompositions and partitioner, the graphs kept
        return aot_module_simplified(gm, example_inputs, fw_compiler=keep, bw_compiler=keep,
                                     partition_fn=min_cut_rematerialization_partition, decompositions=select_decomp_table())

    depth = 3
    model = timm.create_model(MODEL, pos_encoding="irpe", embed_dim=48, depth=depth, num_heads=3, num_classes=5)
    model.pos_encoding.set_backend("triton")
    torch.compile(model, backend=backend, fullgraph=True)(torch.randn(2, 3, 32, 32)).sum().backward()
    forward, backward = (collections.Counter(str(n.target) for n in g.graph.nodes if n.op == "call_function") for g in graphs)
    assert not [op for op in (*forward, *backward) if op.startswith("vispe.")]  # no opaque operator left
    assert forward["triton_kernel_wrapper_functional"] == depth  # the forward kernel per layer
    assert backward["triton_kernel_wrapper_functional"] == 3 * depth  # row sums, keys', queries' kernels per layer
    assert backward["aten.index.Tensor"] == 1  # the pairs' bucket lookup: once
    assert backward["aten.eq.Tensor"] == 1 and backward["aten.constant_pad_nd.default"] == 1  # their one-hot: once


def test_pytorch_reads_what_each_kernel_writes_as_the_test_session_does():
    # a compiled graph copies what a kernel writes; PyTorch reads it from the kernel's Triton IR, which needs a GPU
    # target (in a child process here), and the test session from the source (tests/conftest.py): the two agree, and
    # the kernels write only their outputs. Two exceptions, both on the safe side: the source reading counts dterm for
    # the queries' kernel without a term gradient (a store a constant disables), and PyTorch counts the term's inputs
    # as written where atomic adds go to a column loaded from them (ROW_GRAD='atomic', not the default: 4 is)
    import inspect

    from triton_compile import pytorch_written_arguments, stored_arguments

    import vispe.encodings._triton_bias_kernel as source

    tensors = {n: "bfloat16" for n in ("q", "k", "v", "out", "dout", "dq", "dk", "dv", "table")}
    tensors |= {"lse": "float32", "delta": "float32", "dterm": "float32", "codes_q": "int32", "codes_k": "int32", "lut": "int32"}
    constexprs = {"HAS_LUT": True, "DOT_PRECISION": "ieee", "BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_D": 64, "PAIR_BATCH": False,
                  "BLOCK_C": 1, "scale": 0.125}
    plans = {name: {"tensors": tensors, "constexprs": constexprs} for name in
             ("term_attention_forward_kernel", "term_attention_dkdv_kernel", "term_attention_delta_kernel")}
    plans |= {f"term_attention_dq_kernel:{m}": {"tensors": tensors, "constexprs": {**constexprs, "TERM_GRAD": m,
                                                                                 "BLOCK_C": 64 if m == 1 else 1}}
              for m in (0, 1, 2, 3, 4)}
    found = pytorch_written_arguments("vispe.encodings._triton_bias_kernel", plans)
    outputs = {"term_attention_forward_kernel": ["lse", "out"], "term_attention_dkdv_kernel": ["dk", "dv"],
               "term_attention_delta_kernel": ["delta"]} | {f"term_attention_dq_kernel:{m}": ["dq", "dterm"] for m in (1, 2, 3, 4)}
    atomic = "term_attention_dq_kernel:2"
    assert found == outputs | {"term_attention_dq_kernel:0": ["dq"], atomic: ["codes_k", "codes_q", "dq", "dterm", "lut", "table"]}
    for key in found:
        fn = getattr(source, key.split(":")[0]).fn
        read = stored_arguments(inspect.getsource(fn), list(inspect.signature(fn).parameters))
        assert read == sorted(outputs.get(key, ["dq", "dterm"])), key


def test_the_kernels_compile_for_hopper_gpus():
    # what the interpreter cannot show: Triton's compiler takes the four kernels (no GPU needed to compile) as
    # inductor writes them into a compiled graph's code, with the tile helper they call, every gradient mode of the queries' kernel included; with the strides and head width
    # a ViT gives (multiples of 16, which Triton's launcher specialises on) the q/k/v tiles load 16 bytes at a time
    # and the products run on tensor cores
    import re

    from triton_compile import hopper_ptx

    pointers = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "out": "*bf16", "dout": "*bf16", "dq": "*bf16", "dk": "*bf16",
                "dv": "*bf16", "lse": "*fp32", "delta": "*fp32", "dterm": "*fp32", "table": "*bf16", "codes_q": "*i32",
                "codes_k": "*i32", "lut": "*i32", "scale": "fp64"}  # fp64: a compiled graph passes Python floats so
    aligned = [n for n in pointers if n != "scale"] + ["head_dim"]  # and the (batch, head, token) strides
    launch = triton_bias.LAUNCH  # the tiles the operators launch
    term = {"HAS_LUT": True, "DOT_PRECISION": "ieee", "BLOCK_D": 64}
    plans = [("term_attention_forward_kernel", {**term, "BLOCK_M": launch["forward"][0], "BLOCK_N": launch["forward"][1]})]
    plans += [("term_attention_dkdv_kernel", {**term, "BLOCK_M": launch["dkdv"][0], "BLOCK_N": launch["dkdv"][1]})]
    plans += [("term_attention_delta_kernel", {"BLOCK_M": launch["delta"][0], "BLOCK_D": 64})]
    for mode in (0, 1, 2, 3, 4):
        bm, bn, _ = launch["dq_one_hot" if mode == 1 else "dq"]
        plans += [("term_attention_dq_kernel", {**term, "BLOCK_M": bm, "BLOCK_N": bn, "TERM_GRAD": mode,
                                                "PAIR_BATCH": False, "BLOCK_C": 64 if mode == 1 else 1})]
    # mode 4 stores dS in the table's dtype (bf16 on a GPU)
    specs = [{"kernel": name, "types": {**pointers, "dterm": "*bf16"} if constants.get("TERM_GRAD") == 4 else pointers,
              "aligned": aligned, "aligned_suffixes": ["_b", "_h", "_n"], "constexprs": constants} for name, constants in plans]
    for (name, constants), ptx in zip(plans, hopper_ptx("vispe.encodings._triton_bias_kernel", specs)):
        assert re.search(r"\bld\.global(\.\w+)*\.v4\.b32\b", ptx), (name, constants, "no 16-byte tile loads")
        if name != "term_attention_delta_kernel":  # row sums: no products
            assert "wgmma.mma_async" in ptx or "mma.sync" in ptx, (name, constants, "no tensor-core products")


def test_float32_products_follow_pytorchs_tf32_setting():
    # float32 attention through the kernels multiplies as PyTorch's CUDA matmuls do: exactly unless TF32 is allowed
    allowed = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert triton_bias._dot_precision() == "ieee"
        torch.backends.cuda.matmul.allow_tf32 = True
        assert triton_bias._dot_precision() == "tf32"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allowed
