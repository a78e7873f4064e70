"""A CPU proxy for the host side of a compiled GPU train step: what each encoding adds to the work of *launching* a
step, measured where no GPU is lent.

On an H100 the compiled ViT-S/16 step at 224 px is bound by the host's kernel launches (docs/speed-gpu.md). This
script builds the same model structure (depth 12, 6 heads) at width 96 with 4 patches, so that the arithmetic is
negligible on a CPU and a step is mostly the dispatch of its operations: the generated kernels, the library calls
(``mm``, ``bmm``, ``eigh``) and the operations inductor leaves to ATen (complex ops). Two figures per model:

* **operations per step**, counted (not timed): every call the compiled graphs' wrapper code makes into a kernel, a
  library routine or an ATen operation, forward and backward, from one profiled step (``cProfile``'s caller
  records). It does not depend on the machine's load. On a GPU each is at least one launch.
* **step time**, interleaved round by round (the order rotates each round) in one process, as the median of the
  per-round ratios to timm's APE ViT with its interquartile range. The per-call costs of a CPU are not a GPU's, so
  this is a proxy, noisy on a shared CPU.

    PYTHONPATH=. python results/speed/cpu-host-proxy-2026-11-28.py OUT.json [ROUNDS] [ENCODING ...]

One thread, ``torch.compile`` (inductor), SGD, batch 2. Writes every round's times and the counts to OUT.json.
"""
import cProfile
import json
import platform
import pstats
import statistics
import sys
import time

import timm
import torch

import vispe  # noqa: F401  (registers the vispe models in timm)

out_path = sys.argv[1]
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 15
names = ["ape"] + (sys.argv[3:] or ["rope_axial", "rope_mixed", "comrope_ap", "comrope_ld"])
torch.set_num_threads(1)
KW = {"img_size": 32, "patch_size": 16, "embed_dim": 96, "depth": 12, "num_heads": 6, "num_classes": 10}
STEPS = 20  # steps per timed run
#: helpers of the wrapper code that launch nothing (views of buffers, allocations, checks)
NOT_LAUNCHES = ("reinterpret_tensor", "empty_strided", "assert_size_stride", "assert_alignment", "assert_tensor_metadata",
                "assert_size_stride_grouped", "_reinterpret_tensor", "_empty_strided_cpu", "len", "isinstance", "clear",
                "get_raw_stream", "_is_view", "getattr", "id")


def build(name: str):
    torch.manual_seed(0)
    if name == "ape":
        model = timm.create_model("vit_small_patch16_224", **KW)
    else:
        model = timm.create_model("vispe_vit_small_patch16_224", pos_encoding=name, **KW)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    run = torch.compile(model)
    x = torch.randn(2, 3, 32, 32)

    def step():
        opt.zero_grad(set_to_none=True)
        run(x).square().mean().backward()

    return step


def operations_per_step(step) -> dict[str, int]:
    """Calls made by the compiled graphs' wrapper functions (``call`` in inductor's generated modules) in one step."""
    prof = cProfile.Profile()
    prof.enable()
    step()
    prof.disable()
    counts = {"kernels": 0, "library": 0, "aten": 0}
    for (fn, _, name), (_, ncalls, _, _, callers) in pstats.Stats(prof).stats.items():
        from_wrapper = sum(n for (cfile, _, cname), (n, *_rest) in callers.items()
                           if cname == "call" and "torchinductor" in cfile)
        if not from_wrapper or any(h in name for h in NOT_LAUNCHES):
            continue
        if "kernel" in name:
            counts["kernels"] += from_wrapper  # a generated C++ kernel (on a GPU: a Triton launch)
        elif fn.endswith("_ops.py"):
            counts["aten"] += from_wrapper  # an operation inductor does not generate (complex ops, eigh, polar, ...)
        else:
            counts["library"] += from_wrapper  # extern kernels: mm, addmm, bmm, convolution, SDPA
    counts["total"] = sum(counts.values())
    return counts


steps = {}
for name in names:
    steps[name] = build(name)
    for _ in range(3):  # compiles
        steps[name]()
ops = {name: operations_per_step(steps[name]) for name in names}
times = {name: [] for name in names}
for r in range(rounds):
    order = names[r % len(names):] + names[: r % len(names)]
    for name in order:
        t0 = time.perf_counter()
        for _ in range(STEPS):
            steps[name]()
        times[name].append((time.perf_counter() - t0) / STEPS * 1e3)
rows = []
print(f"{'model':12s} {'ops/step':>8s} {'kernels':>7s} {'library':>7s} {'aten':>5s} {'ms/step':>8s} {'x APE':>6s} {'IQR':>11s}")
for name in names:
    ratios = [t / a for t, a in zip(times[name], times["ape"])]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0], 0, ratios[0])
    row = {"model": name, **ops[name], "ms_per_step": round(statistics.median(times[name]), 3),
           "x_ape": round(statistics.median(ratios), 3), "x_ape_iqr": [round(q1, 3), round(q3, 3)], "ms": times[name]}
    rows.append(row)
    o = ops[name]
    print(f"{name:12s} {o['total']:8d} {o['kernels']:7d} {o['library']:7d} {o['aten']:5d} {row['ms_per_step']:8.2f} "
          f"{row['x_ape']:6.3f} {q1:5.3f}-{q3:5.3f}")
with open(out_path, "w") as f:
    json.dump({"machine": platform.processor() or platform.machine(), "torch": torch.__version__, "timm": timm.__version__,
               "rounds": rounds, "steps_per_run": STEPS, "model": KW, "batch": 2, "threads": 1, "rows": rows}, f, indent=1)
print(f"wrote {out_path}")
