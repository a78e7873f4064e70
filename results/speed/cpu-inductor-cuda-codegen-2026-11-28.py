"""What inductor writes for the fused kernels' operators on a CUDA device, seen without one.

The operators (``vispe::rotary_qkv``, ``vispe::term_attention`` and their backwards) are ``triton_op`` s that a compiled
graph traces into. Whether inductor then writes a graph that launches the kernels itself is only known where it
writes CUDA code, which needs a GPU. This script lets inductor write that code on a CPU machine: the operators run on
fake CUDA tensors (shapes of ViT-S/16 at 224 px, batch 8), the few CUDA driver queries inductor makes answer as an
H200 would (device properties, sm_90), and Triton's compilation of the written kernels, the one step that needs the
driver, is skipped. It prints, per graph (each operator and its backward, called directly), every launch in the
written code: the operators' kernels, inductor's own kernels, library calls. A development check before a GPU run,
tied to PyTorch's internals (checked with torch 2.14 and 2.11); not a test.

Usage: ``PYTHONPATH=. python results/speed/cpu-inductor-cuda-codegen-2026-11-28.py OUT.json``.
"""
from __future__ import annotations

import contextlib
import json
import re
import sys
from unittest import mock

import torch


def h200_patches() -> list:
    """What inductor asks of the CUDA driver, answered as an H200 would (only while it writes code: tracing the
    operators on fake tensors needs none of it); Triton's compile of the written kernels is skipped
    (``async_compile.triton`` returns the kernel's source)."""
    import triton
    from triton.backends.compiler import GPUTarget

    class Hopper:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    triton.runtime.driver.set_active(Hopper())
    props = type("Props", (), {"name": "NVIDIA H200 (stand-in)", "major": 9, "minor": 0, "multi_processor_count": 132,
                               "total_memory": 140e9, "warp_size": 32, "max_threads_per_multi_processor": 2048,
                               "regs_per_multiprocessor": 65536, "max_threads_per_block": 1024})()
    none = lambda *a, **k: None
    return [
        mock.patch("torch.cuda.get_device_properties", lambda *a, **k: props),
        mock.patch("torch._dynamo.device_interface.CudaInterface.get_device_properties", staticmethod(lambda *a: props)),
        mock.patch("torch._dynamo.device_interface.CudaInterface.get_compute_capability", staticmethod(lambda *a: 90)),
        mock.patch("torch.cuda.is_available", lambda: True), mock.patch("torch.cuda.is_initialized", lambda: True),
        mock.patch("torch.cuda.current_device", lambda: 0), mock.patch("torch.cuda.device_count", lambda: 1),
        mock.patch("torch.cuda.get_device_capability", lambda *a: (9, 0)), mock.patch("torch.cuda.set_device", none),
        mock.patch("torch.cuda.synchronize", none), mock.patch("torch.cuda._lazy_init", none),
        mock.patch("torch.cuda.get_rng_state", lambda *a: torch.zeros(16, dtype=torch.uint8)),
        mock.patch("torch.cuda.set_rng_state", none),
        mock.patch("torch.cuda._exchange_device", lambda i: 0), mock.patch("torch.cuda._maybe_exchange_device", lambda i: 0),
        mock.patch("torch._inductor.fx_passes.joint_graph.lazy_init", none),  # pattern tables built with real tensors
        mock.patch("torch._inductor.fx_passes.post_grad.lazy_init", none),
        mock.patch("torch._inductor.async_compile.AsyncCompile.triton", lambda self, name, src, *a, **k: src),
    ]


def written_code(fn, inputs) -> str:
    """The wrapper code inductor writes for ``fn(*inputs)`` (fake CUDA tensors), inference only."""
    from torch._inductor import config
    from torch._inductor import graph as lowering
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental.proxy_tensor import make_fx

    codes: list[str] = []
    codegen = lowering.GraphLowering.codegen

    def keep(self, *args, **kwargs):
        out = codegen(self, *args, **kwargs)
        codes.append(out[0].value if hasattr(out[0], "value") else str(out[0]))
        return out

    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    with contextlib.ExitStack() as stack:
        for patch in h200_patches():
            stack.enter_context(patch)
        stack.enter_context(mock.patch.object(lowering.GraphLowering, "codegen", keep))
        stack.enter_context(config.patch(compile_threads=1, pattern_matcher=False, joint_graph_constant_folding=False,
                                         fx_graph_cache=False))
        compile_fx(gm, list(inputs))
    return codes[-1]


def launches(code: str) -> list[str]:
    """The kernel launches and library calls of the wrapper's ``call``, by name."""
    body = code[code.index("def call("):]
    found = re.findall(r"^\s+(\w+)\.run\(|^\s+(extern_kernels\.\w+)\(|(torch\.ops\.\w+\.\w+)", body, flags=re.MULTILINE)
    return [next(x for x in m if x) for m in found]


def main() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    out_path = sys.argv[1]
    rows = {}
    # the launch's device context would ask the driver; a traced launch needs none
    with mock.patch("vispe.encodings.triton_support.on_device", lambda t: contextlib.nullcontext()):
        import vispe.encodings.triton_bias
        import vispe.encodings.triton_rotary  # noqa: F401

        bsz, heads, tokens, dh, buckets = 8, 6, 197, 64, 50
        with FakeTensorMode():
            qkv = torch.empty(bsz, tokens, 3, heads, dh, device="cuda", dtype=torch.bfloat16)
            table = torch.empty(tokens, dh // 2, 2, device="cuda")
            q, k, v, out, dout = (torch.empty(bsz, tokens, heads, dh, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                                  for _ in range(5))
            z = torch.empty(bsz, heads, tokens, buckets, device="cuda", dtype=torch.bfloat16)
            lse = torch.empty(bsz, heads, tokens, device="cuda")
            codes = torch.empty(1, tokens, device="cuda", dtype=torch.int32)
            lut = torch.empty(27 * 27 + 1, device="cuda", dtype=torch.int32)

        def rotary(qkv, table, dq, dk, dv):
            return (*torch.ops.vispe.rotary_qkv(qkv, table, True), torch.ops.vispe.rotary_qkv_backward(dq, dk, dv, table, True))

        def term(q, k, v, out, dout, z, lse, codes, lut):  # iRPE's term: z read at each pair's bucket
            forward = torch.ops.vispe.term_attention(q, k, v, z, codes, codes, lut, 27 * 13 + 13, 27 * 27, dh ** -0.5)
            backward = torch.ops.vispe.term_attention_backward(dout, q, k, v, out, lse, z, codes, codes, lut,
                                                               27 * 13 + 13, 27 * 27, dh ** -0.5, True)
            return (*forward, *backward)

        for name, fn, inputs in (("rotary_qkv + backward", rotary, (qkv, table, q, k, v)),
                                 ("term_attention + backward (iRPE)", term, (q, k, v, out, dout, z, lse, codes, lut))):
            found = launches(written_code(fn, inputs))
            rows[name] = found
            print(f"{name}: {len(found)} launches")
            for launch in found:
                print(f"    {launch}")
    meta = {"torch": torch.__version__, "device": "none (inductor answered as an H200, sm_90)",
            "shapes": {"batch": bsz, "heads": heads, "tokens": tokens, "head_dim": dh, "buckets": buckets}}
    with open(out_path, "w") as f:
        json.dump({"meta": meta, "launches": rows}, f, indent=1)


if __name__ == "__main__":
    main()
