"""The step from a fused qkv projection to attention's inputs, forward and backward, with and without rotation.

One layer of ViT-S/16 at 224 px, batch 128 (q, k, v: 128 x 197 tokens x 6 heads x 64, bf16), the gradients of q, k
and v given. Variants, each timed as forward + backward of ``split(qkv) -> (q, k, v)`` into a ``(B, N, 3, H, dh)``
gradient:

- ``split``: timm's views (no work forward; the backward stacks the three gradients): APE's share of the step;
- ``torch``: q and k rotated by ``apply_rotary`` (float32 maths), what ``rotary_backend='torch'`` runs eagerly;
- ``torch_compiled``: the same under ``torch.compile`` (inductor), what a compiled model runs;
- ``triton``: the fused kernel, ``rotary_backend='triton'``; ``triton_compiled``: under ``torch.compile``, which traces
  the operator and launches the kernel from its own code, as in a compiled model.

Two tables: one shared by every head, no gradient (``rope_axial``), and one per head with a gradient (learned
frequencies, ``rope_mixed``). Reports the median time of ``REPS`` runs (CUDA events) and the bytes each variant
must move at least (the bandwidth floor), so a variant's distance from its floor is read directly.

Usage: ``PYTHONPATH=. python results/speed/gpu-rotary-kernel-2026-11-28.py OUT.json [REPS]``; without CUDA it runs
a tiny version in Triton's interpreter to check the script.
"""
from __future__ import annotations

import os
import sys

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from vispe.benchmarks.speed_measure import median_backward_ms, triton_mutation_fallbacks, write_probe
from vispe.encodings.rotary import apply_rotary, rotary_table
from vispe.encodings.triton_rotary import rotary_qkv


def split(qkv, table):
    return qkv.permute(2, 0, 3, 1, 4).unbind(0)


def torch_rotation(qkv, table):
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    return apply_rotary(q, table), apply_rotary(k, table), v


def fused(qkv, table):
    return rotary_qkv(qkv, table)


def main() -> None:
    out_path = sys.argv[1]
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 50
    device = torch.device("cuda" if CUDA else "cpu")
    bsz, tokens, heads, dh = (128, 197, 6, 64) if CUDA else (2, 5, 2, 8)
    plane = bsz * tokens * heads * dh * 2  # bytes of q (bf16)
    rows = []
    watch = triton_mutation_fallbacks()  # kept: the watch ends when it is collected
    fallbacks = watch.__enter__()
    for label, lead, learned in (("shared table (rope_axial)", (), False), ("per-head learned table (rope_mixed)", (heads,), True)):
        angles = torch.randn(*lead, tokens, dh // 2, device=device)
        base = torch.view_as_real(rotary_table(angles)).contiguous()
        complex_table = rotary_table(angles)
        grads = [torch.randn(bsz, tokens, heads, dh, device=device, dtype=torch.bfloat16).transpose(1, 2) for _ in range(3)]
        # first, that the kernel computes the rotation on this device: against float32 PyTorch maths, within one
        # bfloat16 rounding of the outputs, and the gradients of qkv and of the table
        qkv = torch.randn(bsz, tokens, 3, heads, dh, device=device, dtype=torch.bfloat16)
        errs = {}
        for name, fn, table in (("triton", fused, base), ("reference", torch_rotation, complex_table)):
            x = (qkv.clone() if name == "triton" else qkv.float()).requires_grad_()
            t = table.detach().requires_grad_(learned)
            outs = fn(x, t)
            torch.autograd.backward(outs, [g.to(outs[0].dtype) for g in grads])
            errs[name] = [o.float() for o in outs] + [x.grad.float()] + ([torch.view_as_real(t.grad) if t.grad.is_complex() else t.grad] if learned else [])
        worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(errs["triton"], errs["reference"]))
        print(f"{label}: kernel vs float32 PyTorch, largest relative difference {worst:.2e}")
        rows.append({"table": label, "variant": "check", "max_rel_diff_vs_float32": worst})
        compiled = torch.compile(torch_rotation)
        for name, fn, table in (("split", split, base), ("torch", torch_rotation, complex_table),
                                ("torch_compiled", compiled, base), ("triton", fused, base),
                                ("triton_compiled", torch.compile(fused, backend="inductor" if CUDA else "aot_eager"), base)):
            qkv = torch.randn(bsz, tokens, 3, heads, dh, device=device, dtype=torch.bfloat16, requires_grad=True)
            t = table.detach().requires_grad_(learned)
            ms = median_backward_ms(fn, (qkv, t), grads, reps)
            # the least a variant moves: the backward reads 3 gradient planes and writes 3; the rotations read and
            # write q and k in the forward (the fused kernel also copies v: 6 planes)
            floor = 6 * plane + {"split": 0, "triton": 6 * plane, "triton_compiled": 6 * plane}.get(name, 4 * plane)
            rows.append({"table": label, "variant": name, "ms": round(ms, 4), "floor_bytes": floor,
                         "gb_per_s_at_floor": round(floor / ms / 1e6, 1)})
            print(f"{label:38s} {name:15s} {ms:8.3f} ms   floor {floor / 1e6:7.1f} MB   {floor / ms / 1e6:8.1f} GB/s")
    write_probe(out_path, rows, fallbacks, shape=[bsz, tokens, 3, heads, dh], dtype="bfloat16", reps=reps)

if __name__ == "__main__":
    main()
