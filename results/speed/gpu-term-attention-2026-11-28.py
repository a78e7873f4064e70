"""One attention layer with a lattice bias term, forward and backward: the dense term a compiled model hands SDPA
against the fused kernels (``attention_backend='triton'``, :mod:`vispe.encodings.triton_bias`).

One layer of ViT-S/16 at 224 px, batch 128 (q, k, v: 128 x 6 heads x 197 tokens x 64, bf16, a class token), through
the encoding's own ``attend`` (iRPE builds its per-row projection ``z = s q r`` inside it, so its cost is counted).
Variants, each timed as forward + backward with the gradient of the output given:

- ``sdpa``: no term (SDPA's fused kernel; APE's attention, the floor every variant is read against);
- ``dense_compiled``: ``attention_backend='dense'`` under ``torch.compile``, what a compiled model runs on CUDA;
- ``triton``: the fused kernels, eager; ``triton_compiled``: under ``torch.compile``, which traces the operators and
  launches the kernels from its own code, as in a compiled model; for iRPE also ``triton_one_hot`` and ``triton_atomic`` (the term's gradient per
  row summed in the kernel by one-hot sums or atomic adds instead of the stored dS and a batched matmul:
  ``triton_bias.ROW_GRAD``), and then other tiles and warps per kernel (``triton_bias.LAUNCH``, one kernel changed
  at a time).

First, per encoding, that the kernels compute the layer on this device: bf16 inputs against the float32 dense path,
outputs and the gradients of q, k, v and the encoding's parameters. Reports the median of ``REPS`` runs (CUDA events).

Usage: ``PYTHONPATH=. python results/speed/gpu-term-attention-2026-11-28.py OUT.json [REPS]``; without CUDA it runs a
tiny version in Triton's interpreter (float16: the interpreter's bfloat16 products are wrong) to check the script.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from vispe.benchmarks.speed_measure import median_backward_ms, triton_mutation_fallbacks, write_probe
from vispe.encodings import (
    EncodingContext,
    PositionGrid,
    create_encoding,
    triton_bias,
)


def attend_fn(enc, grid, device):
    def fn(q, k, v):  # the state per call, as a model's forward builds it (FIRE's tables carry the MLP's graph)
        return enc.attend(q, k, v, layer=0, state=enc.prepare(grid, device))

    return fn


def main() -> None:
    out_path = sys.argv[1]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 30
    device = torch.device("cuda" if CUDA else "cpu")
    half = torch.bfloat16 if CUDA else torch.float16
    bsz, heads, side, dh = (128, 6, 14, 64) if CUDA else (2, 2, 3, 16)
    grid = PositionGrid((side, side), 1)
    tokens = grid.seq_len
    ctx = EncodingContext(dim=heads * dh, num_heads=heads, depth=1, grid_size=(side, side), num_prefix_tokens=1)
    rows = []
    g = torch.Generator(device=device).manual_seed(0)
    base = [torch.randn(bsz, heads, tokens, dh, device=device, generator=g) for _ in range(3)]
    grad = torch.randn(bsz, heads, tokens, dh, device=device, generator=g)
    watch = triton_mutation_fallbacks()  # kept: the watch ends when it is collected
    fallbacks = watch.__enter__()
    for name, options in (("irpe", {"init_std": 0.5}), ("alibi_2d", {}), ("fire", {})):
        enc = create_encoding(name, ctx, **options).to(device)
        fn = attend_fn(enc, grid, device)
        # on this device, bf16 kernels against the float32 dense path: outputs and every gradient
        results = {}
        for label, backend, dtype in (("reference", "dense", torch.float32), ("triton", "triton", half)):
            enc.set_attention_backend(backend)
            enc.zero_grad(set_to_none=True)
            leaves = [t.detach().to(dtype).requires_grad_() for t in base]
            with torch.autocast(device.type, dtype=half, enabled=dtype != torch.float32):
                out = fn(*leaves)
            torch.autograd.backward(out, grad.to(out.dtype))
            results[label] = [out.float()] + [t.grad.float() for t in leaves] + [p.grad.float() for p in enc.parameters()
                                                                                 if p.grad is not None]
        worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
                    for a, b in zip(results["triton"], results["reference"]))
        print(f"{name}: kernels ({half}) vs float32 dense path, largest relative difference {worst:.2e}")
        rows.append({"encoding": name, "variant": "check", "max_rel_diff_vs_float32": worst})
        inputs = [t.detach().to(half).requires_grad_() for t in base]
        g_half = grad.to(half)
        variants = [("sdpa", lambda q, k, v: F.scaled_dot_product_attention(q, k, v), None)]
        variants += [("dense_compiled", torch.compile(fn), "dense"), ("triton", fn, "triton"),
                     ("triton_compiled", torch.compile(fn, backend="inductor" if CUDA else "aot_eager"), "triton")]
        if name == "irpe":
            variants += [("triton_one_hot", fn, "triton"), ("triton_atomic", fn, "triton")]
        for variant, call, backend in variants:
            if backend is not None:
                enc.set_attention_backend(backend)
            triton_bias.ROW_GRAD = {"triton_atomic": "atomic", "triton_one_hot": "one_hot"}.get(variant, "matmul")
            try:
                ms = round(median_backward_ms(call, inputs, g_half, reps), 4)
            except Exception as exc:  # noqa: BLE001  (a variant that fails here: say so with its cause, go on)
                import traceback

                ms = f"failed: {type(exc).__name__}: {str(exc)[-1500:]}"
                traceback.print_exc()
            rows.append({"encoding": name, "variant": variant, "ms": ms})
            print(f"{name:10s} {variant:16s} {ms} ms")
        triton_bias.ROW_GRAD = "matmul"
    # iRPE's launch choices (tiles, warps) one kernel at a time, the others at their defaults: which to keep
    enc = create_encoding("irpe", ctx, init_std=0.5).to(device)
    enc.set_attention_backend("triton")
    fn = attend_fn(enc, grid, device)
    inputs = [t.detach().to(half).requires_grad_() for t in base]
    default = dict(triton_bias.LAUNCH)
    sweep = {"forward": [(128, 64, 8), (64, 32, 4), (128, 32, 4)], "dkdv": [(64, 64, 4), (16, 64, 4), (64, 128, 8)],
             "dq": [(32, 32, 4), (64, 64, 4), (128, 32, 8)]}
    for kernel, choices in sweep.items():
        for choice in choices:
            triton_bias.LAUNCH = {**default, kernel: choice}
            try:
                ms = round(median_backward_ms(fn, inputs, grad.to(half), reps), 4)
            except Exception as exc:  # noqa: BLE001  (a tile this GPU cannot hold: say so, keep sweeping)
                ms = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
            rows.append({"encoding": "irpe", "variant": "launch", "kernel": kernel, "launch": list(choice), "ms": ms})
            print(f"irpe launch {kernel:10s} {choice}: {ms} ms (default {default[kernel]})")
    triton_bias.LAUNCH = default
    write_probe(out_path, rows, fallbacks, shape=[bsz, heads, tokens, dh], dtype=str(half), reps=reps)

if __name__ == "__main__":
    main()
