"""What calling an operator costs the host, against calling its Python body: why the fused kernels' operators are
``triton_op`` s that a compiled graph traces into, not ``custom_op`` s it calls.

A compiled ViT-S/16 step at 224 px is bound by the host's launches on an H200 (docs/speed-gpu.md). An opaque custom op
is called from the compiled graph through PyTorch's dispatcher into Python once per layer, forward and backward; a
``triton_op`` is traced, so the graph launches the kernels itself. This times, on tiny CPU tensors, one call of an
operator with the term operator's signature (10 arguments) whose body only allocates its two outputs: as a
``torch.library.custom_op``, as an operator defined through ``torch.library.Library``, and its body called directly.

Usage: ``python results/speed/cpu-op-call-overhead-2026-11-28.py OUT.json [CALLS]``.
"""
from __future__ import annotations

import json
import platform
import statistics
import sys
import time

import torch


def body(q, k, v, table, codes_q, codes_k, lut, center, fill, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:3])


@torch.library.custom_op("overhead_probe::custom", mutates_args=())
def custom(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, codes_q: torch.Tensor,
           codes_k: torch.Tensor, lut: torch.Tensor | None, center: int, fill: int, scale: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    return body(q, k, v, table, codes_q, codes_k, lut, center, fill, scale)


library = torch.library.Library("overhead_probe", "FRAGMENT")
library.define("plain(Tensor q, Tensor k, Tensor v, Tensor table, Tensor codes_q, Tensor codes_k, Tensor? lut, int center, "
               "int fill, float scale) -> (Tensor, Tensor)")
library.impl("plain", body, "CPU")


def per_call_us(fn, calls: int) -> float:
    for _ in range(200):
        fn()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(rounds)


def main() -> None:
    out_path = sys.argv[1]
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 20000
    torch.set_num_threads(1)
    x = torch.randn(2, 2, 4, 4)
    args = (x, x, x, x, x, x, None, 1, 2, 0.5)
    rows = {
        "custom_op": per_call_us(lambda: torch.ops.overhead_probe.custom.default(*args), calls),
        "library_op": per_call_us(lambda: torch.ops.overhead_probe.plain.default(*args), calls),
        "body": per_call_us(lambda: body(*args), calls),
    }
    for name, us in rows.items():
        print(f"{name:12s} {us:7.2f} us a call")
    meta = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__, "calls": calls, "threads": 1}
    with open(out_path, "w") as f:
        json.dump({"meta": meta, "us_per_call": {k: round(v, 2) for k, v in rows.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
