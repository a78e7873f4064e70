"""The fused rotary kernel (``rotary_backend='triton'``) against the PyTorch-ops rotation it replaces.

The kernel runs here in Triton's interpreter on CPU tensors (``TRITON_INTERPRET=1``, set per test): the same kernel
source the GPU compiles, executed element by element. Oracle: ``apply_rotary`` on the q/k views of the projection
(the ``'torch'`` backend), in float32 -- outputs and the gradients of the projection and of the angles -- and in
bfloat16 within one rounding. Models: every registered encoding that takes the backend (found by capability, so new
ones are covered) gives the same logits and parameter gradients as with ``'torch'``, eager and compiled whole.
Skipped where Triton does not import (CPU-only PyTorch builds).
"""
from __future__ import annotations

import contextlib

import pytest
import timm
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import vispe
from vispe.encodings import create_encoding, get_encoding_class
from vispe.encodings.rotary import RotaryEncoding, apply_rotary, rotary_table
from vispe.encodings.triton_rotary import rotary_qkv, triton_rotary_unavailable

pytestmark = [pytest.mark.skipif(triton_rotary_unavailable() is not None, reason="Triton does not import"),
              pytest.mark.usefixtures("triton_interpreter")]  # tests/conftest.py

FUSED = [n for n in vispe.list_encodings() if issubclass(get_encoding_class(n), RotaryEncoding)
         and get_encoding_class(n).fuses_rotation()]
NOT_FUSED = [n for n in vispe.list_encodings() if issubclass(get_encoding_class(n), RotaryEncoding)
             and not get_encoding_class(n).fuses_rotation()]


def _reference(qkv: torch.Tensor, angles: torch.Tensor, layout: str):
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    table = rotary_table(angles)
    return apply_rotary(q, table, layout), apply_rotary(k, table, layout), v


@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("table_lead", [(), (3,), (2, 1), (2, 3)], ids=["shared", "per-head", "per-sample", "per-sample-head"])
def test_kernel_equals_the_pytorch_rotation_with_gradients(layout, table_lead):
    torch.manual_seed(0)
    bsz, tokens, heads, dh = 2, 7, 3, 12  # 6 pairs: not a power of two, so the pair block is masked
    qkv = torch.randn(bsz, tokens, 3, heads, dh, requires_grad=True)
    angles = (torch.randn(*table_lead, tokens, dh // 2) * 3).requires_grad_()
    got = rotary_qkv(qkv, torch.view_as_real(rotary_table(angles)), layout)
    want = _reference(qkv, angles, layout)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
        assert g.shape == (bsz, heads, tokens, dh)
        assert g.stride() == (tokens * heads * dh, dh, heads * dh, 1)  # token-major, as timm's q/k/v views
    weights = torch.randn(3, bsz, heads, tokens, dh)
    grads_got = torch.autograd.grad(sum((o * w).sum() for o, w in zip(got, weights)), (qkv, angles))
    grads_want = torch.autograd.grad(sum((o * w).sum() for o, w in zip(want, weights)), (qkv, angles))
    for g, w in zip(grads_got, grads_want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_kernel_in_bfloat16_is_the_float32_rotation_rounded_once():
    torch.manual_seed(0)
    qkv = torch.randn(2, 5, 3, 2, 64, dtype=torch.bfloat16)
    angles = torch.randn(5, 32) * 10
    got = rotary_qkv(qkv, torch.view_as_real(rotary_table(angles)))
    exact = _reference(qkv.float(), angles, "interleaved")
    for g, e in zip(got, exact):
        assert g.dtype == torch.bfloat16
        # within one bfloat16 rounding of the float32 result (half an ulp, plus float32 noise at a tie)
        ulp = torch.finfo(torch.bfloat16).eps * e.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
        assert ((g.float() - e).abs() <= ulp).all()
    torch.testing.assert_close(got[2], qkv[:, :, 2].transpose(1, 2), atol=0, rtol=0)  # v copied exactly


def test_operator_registration_passes_pytorchs_checks():
    torch.manual_seed(0)
    qkv = torch.randn(2, 4, 3, 2, 8, requires_grad=True)
    table = torch.view_as_real(rotary_table(torch.randn(2, 4, 4))).detach().requires_grad_()
    # fake tensor (shapes and strides), autograd registration, schema: what torch.compile relies on
    torch.library.opcheck(torch.ops.vispe.rotary_qkv.default, (qkv, table, True))


def _model(name: str, backend: str | None = None, **options):
    spec = name if backend is None else f"{name}[rotary_backend={backend}]"
    torch.manual_seed(0)
    if 2 in get_encoding_class(name).grid_ndims:
        model = timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding=spec, embed_dim=48, depth=2, num_heads=3,
                                  num_classes=5, **options)
        return model, torch.randn(2, 3, 32, 32)
    model = timm.create_model("vispe_video_vit_nano_patch8_64", pos_encoding=spec, img_size=32, num_frames=4, embed_dim=48,
                              depth=2, num_heads=3, num_classes=5, **options)
    return model, torch.randn(2, 3, 4, 32, 32)


def _step(model, x):
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.square().sum().backward()
    return out.detach(), {n.removeprefix("_orig_mod."): p.grad for n, p in model.named_parameters() if p.grad is not None}


@contextlib.contextmanager
def _launches():
    """The kernel launches inside the block, by their rotation sign (1: forward, -1: backward): the kernel's runs, so a
    compiled graph's launches count and its tracing (which records them) does not."""
    from vispe.encodings._triton_rotary_kernel import rotate_qkv_kernel as kernel

    calls: list[int] = []
    run = kernel.run

    def counted(*args, **kwargs):
        calls.append({**dict(zip(kernel.arg_names, args)), **kwargs}["SIGN"])
        return run(*args, **kwargs)

    kernel.run = counted
    try:
        yield calls
    finally:
        del kernel.run


def test_the_fused_encodings_are_the_phase_rotations():
    assert {"rope_axial", "rope_mixed", "comrope_ld", "rope_axial_3d"} <= set(FUSED)
    assert {"liere", "pope", "mrope"} <= set(NOT_FUSED)  # their own rotations: the backend is refused for them


@pytest.mark.parametrize("name", FUSED)
def test_models_with_the_fused_kernel_equal_the_pytorch_path(name):
    ref, x = _model(name)
    fused, _ = _model(name, "triton")
    fused.load_state_dict(ref.state_dict())
    with _launches() as calls:
        out_ref, grads_ref = _step(ref, x)
        assert not calls
        out, grads = _step(fused, x)
    assert calls == [1, 1, -1, -1]  # each layer: one kernel forward, one backward
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
    assert grads.keys() == grads_ref.keys()
    for key in grads_ref:
        torch.testing.assert_close(grads[key], grads_ref[key], atol=1e-5, rtol=1e-4, msg=key)


@pytest.mark.parametrize("name", ["rope_mixed", "comrope_ld"])
def test_compiled_models_with_the_fused_kernel_stay_one_graph_and_equal_eager(name):
    ref, x = _model(name)
    fused, _ = _model(name, "triton")
    fused.load_state_dict(ref.state_dict())
    counter = CompileCounterWithBackend("aot_eager_decomp_partition")  # inductor's decompositions and partitioner
    compiled = torch.compile(fused, backend=counter, fullgraph=True)
    out_ref, grads_ref = _step(ref, x)
    with _launches() as calls:
        out, grads = _step(compiled, x)
    assert counter.frame_count == 1
    assert calls.count(1) == 2 and calls.count(-1) == 2
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
    for key in grads_ref:
        torch.testing.assert_close(grads[key], grads_ref[key], atol=1e-5, rtol=1e-4, msg=key)


@pytest.mark.parametrize("patch_drop_rate", [0.0, 0.5])
@pytest.mark.parametrize("options,fused_layers", [("", 2), ("nope_layers=1", 1), ("rotary_fraction=0.5", 0)])
def test_patch_dropout_and_layer_schedules(patch_drop_rate, options, fused_layers):
    # patch dropout: per-sample tables (B, 1, n, P); a no-position layer and a partial rotation run the PyTorch path
    def model(backend):
        opts = ",".join(o for o in (options, backend and f"rotary_backend={backend}") if o)
        torch.manual_seed(0)
        return timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding=f"rope_axial[{opts}]" if opts else "rope_axial",
                                 embed_dim=48, depth=2, num_heads=3, num_classes=5, patch_drop_rate=patch_drop_rate)

    ref, fused = model(None), model("triton")
    fused.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 32, 32)
    torch.manual_seed(1)
    out_ref, grads_ref = _step(ref, x)
    with _launches() as calls:
        torch.manual_seed(1)  # the same tokens dropped
        out, grads = _step(fused, x)
    assert calls.count(1) == fused_layers
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
    for key in grads_ref:
        torch.testing.assert_close(grads[key], grads_ref[key], atol=1e-5, rtol=1e-4, msg=key)


def _saved_bytes(model, x) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of one forward."""
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum()
    return sum(storages.values())


def test_the_fused_path_keeps_what_plain_attention_keeps():
    # attention keeps the kernel's outputs as it keeps timm's q/k/v views: beyond a model without an encoding, only
    # the angle tables and what builds them, the same at any batch size -- never a rotated copy of q or k
    plain, x = _model("none")
    for name in ("rope_axial", "rope_mixed"):  # rope_mixed: learned frequencies, the table's gradient needs q and k
        fused, _ = _model(name, "triton")
        extra = [_saved_bytes(fused, xb) - _saved_bytes(plain, xb) for xb in (x, x.repeat(4, 1, 1, 1))]
        assert extra[0] == extra[1] > 0, (name, extra)


def test_bad_backends_are_refused_before_anything_runs(monkeypatch):
    with pytest.raises(ValueError, match=r"rotary_backend='cuda' is not valid; choose one of \['torch', 'triton'\]"):
        create_encoding("rope_axial", rotary_backend="cuda")
    with pytest.raises(ValueError, match="LieRE.*its own way; choose rotary_backend='torch'"):
        create_encoding("liere[rotary_backend=triton]", head_dim=16)
    with pytest.raises(TypeError, match="rotary_backend"):  # not an option of a token encoding
        create_encoding("learned", rotary_backend="triton")
    enc = create_encoding("rope_axial", rotary_backend="triton", head_dim=16, grid_size=(4, 4))
    with pytest.raises(ValueError, match=r"rotary_backend='fast' is not valid"):
        enc.set_backend("fast")
    assert enc.rotary_backend == "triton"
    # a CPU tensor outside the interpreter: refused when the forward prepares its tables, not inside attention
    monkeypatch.delenv("TRITON_INTERPRET")
    model, x = _model("rope_axial", "triton")
    with pytest.raises(ValueError, match="runs CUDA tensors.*choose rotary_backend='torch'"):
        model(x)


def test_pytorch_reads_what_the_kernel_writes_as_the_test_session_does():
    # PyTorch's reading of the kernel's Triton IR (a Hopper target, in a child process) and the test session's reading
    # of its source (tests/conftest.py) agree: the kernel writes its outputs only (the source reading counts all three
    # pointers where one tensor's slots are written: on the safe side)
    import inspect

    from triton_compile import pytorch_written_arguments, stored_arguments

    from vispe.encodings._triton_rotary_kernel import rotate_qkv_kernel

    tensors = {n: "bfloat16" for n in ("q_in", "k_in", "v_in", "q_out", "k_out", "v_out")} | {"table": "float32"}
    plans = {f"rotate_qkv_kernel:{layout}:{stacked}": {"tensors": tensors, "constexprs": {
        "SIGN": 1, "INTERLEAVED": layout == "interleaved", "STACKED_OUT": stacked, "BLOCK_N": 16, "BLOCK_P": 32}}
        for layout in ("interleaved", "half") for stacked in (False, True)}
    found = pytorch_written_arguments("vispe.encodings._triton_rotary_kernel", plans)
    # three outputs (the forward), or one tensor's three slots (the backward: k_out and v_out unwritten)
    assert found == {key: ["q_out"] if key.endswith("True") else ["k_out", "q_out", "v_out"] for key in plans}
    fn = rotate_qkv_kernel.fn
    assert stored_arguments(inspect.getsource(fn), list(inspect.signature(fn).parameters)) == ["k_out", "q_out", "v_out"]


def test_the_kernel_compiles_for_hopper_gpus_with_128_bit_accesses():
    # what the interpreter cannot show: Triton's compiler takes the source inductor writes into a compiled graph's
    # code (no GPU needed to compile), and with the strides and pair count a ViT gives (multiples of 16, which
    # Triton's launcher specialises on) every global load and store of the tile is 16 bytes wide, in both pair layouts
    # and into three outputs or one tensor's slots
    import re

    from triton_compile import hopper_ptx

    pointers = {n: "*bf16" for n in ("q_in", "k_in", "v_in", "q_out", "k_out", "v_out")} | {"table": "*fp32"}
    strides = [f"{t}{io}_{d}" for t in "qkv" for io in "io" for d in "bhn"] + ["t_b", "t_h", "t_n", "o_slot"]
    plans = [{"kernel": "rotate_qkv_kernel", "types": pointers, "aligned": [*pointers, *strides, "pairs"],
              "constexprs": {"SIGN": -1, "INTERLEAVED": interleaved, "STACKED_OUT": stacked, "BLOCK_N": 64, "BLOCK_P": 32}}
             for interleaved in (True, False) for stacked in (False, True)]
    for plan, ptx in zip(plans, hopper_ptx("vispe.encodings._triton_rotary_kernel", plans)):
        accesses = re.findall(r"\b(ld|st)\.global(\.\w+)*", ptx)
        widths = set(re.findall(r"\b(?:ld|st)\.global(?:\.\w+)*?\.(v4\.b32|v2\.b32|b32|b16)\b", ptx))
        assert accesses and widths == {"v4.b32"}, (plan["constexprs"], widths)


def test_a_composition_runs_its_rotary_part_on_the_kernel():
    torch.manual_seed(0)
    ref = timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding="learned+rope_axial", embed_dim=48, depth=2,
                            num_heads=3, num_classes=5)
    fused = timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding="learned+rope_axial", embed_dim=48, depth=2,
                              num_heads=3, num_classes=5)
    fused.load_state_dict(ref.state_dict())
    fused.pos_encoding.set_backend("triton")
    assert fused.pos_encoding.parts[1].rotary_backend == "triton"
    x = torch.randn(2, 3, 32, 32)
    out_ref, grads_ref = _step(ref, x)
    with _launches() as calls:
        out, grads = _step(fused, x)
    assert calls == [1, 1, -1, -1]
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
    for key in grads_ref:
        torch.testing.assert_close(grads[key], grads_ref[key], atol=1e-5, rtol=1e-4, msg=key)
    tokens_only = timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding="learned+cpe", embed_dim=48, depth=2,
                                    num_heads=3, num_classes=5)
    with pytest.raises(TypeError, match="no attention-side part"):
        tokens_only.pos_encoding.set_backend("triton")
