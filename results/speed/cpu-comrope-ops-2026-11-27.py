"""Where compiled ComRoPE's step goes beyond RoPE-Mixed's, operator by operator (one process, profiled rounds).

ViT-S/16 at 224 px, depth 4, batch 2, one thread, ``torch.compile`` (inductor, its generated kernels profiled one by
one): ``rope_mixed`` and ``comrope_ap`` step in turn, each round profiling two train steps of each. The ATen
operators are grouped by input shapes, so the fold's batched 8 x 8 products, ``eigh`` and the copies show apart from
the model's own matrix products (which both models run at the same shapes).

Usage: ``python results/speed/cpu-comrope-ops-2026-11-27.py ROUNDS OUT.json``.
"""
from __future__ import annotations

import collections
import json
import sys

import timm
import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from timm.optim import create_optimizer_v2
from torch.profiler import ProfilerActivity, profile

import vispe  # noqa: F401  (registers the vispe_* models)

MODELS = ("rope_mixed", "comrope_ap")
STEPS = 2


def main(rounds: int, out_path: str) -> None:
    inductor_config.cpp.enable_kernel_profile = True
    torch.set_num_threads(1)
    x, y = torch.randn(2, 3, 224, 224), torch.randint(0, 1000, (2,))
    runs = {}
    for name in MODELS:
        torch.manual_seed(0)
        model = timm.create_model("vispe_vit_small_patch16_224", pretrained=False, pos_encoding={"name": name}, depth=4)
        runs[name] = (torch.compile(model), create_optimizer_v2(model, opt="sgd", lr=1e-4))

    def step(name: str) -> None:
        runner, opt = runs[name]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(runner(x), y).backward()
        opt.step()

    for name in MODELS:  # compile and warm up
        for _ in range(3):
            step(name)
    ms = {name: collections.Counter() for name in MODELS}
    for _ in range(rounds):
        for name in MODELS:
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                for _ in range(STEPS):
                    step(name)
            for ev in prof.key_averages(group_by_input_shape=True):
                key = ev.key
                if key.startswith("graph_"):
                    key = "inductor kernels"
                elif key.startswith("## Call CompiledFxGraph"):
                    key = "compiled graph wrapper"
                elif key in ("aten::mm", "aten::addmm", "aten::bmm", "aten::copy_", "aten::cat"):
                    key = f"{key} {ev.input_shapes[:2]}"
                ms[name][key] += ev.self_cpu_time_total / 1e3 / (rounds * STEPS)
    rows = sorted(({"op": k, **{n: round(ms[n][k], 3) for n in MODELS}} for k in set(ms[MODELS[0]]) | set(ms[MODELS[1]])),
                  key=lambda r: r[MODELS[0]] - r[MODELS[1]])
    totals = {n: round(sum(ms[n].values()), 1) for n in MODELS}
    print("self time per step (ms):", totals)
    for r in rows[:15]:
        print(f"{r['op'][:90]:90s} {r[MODELS[0]]:8.2f} {r[MODELS[1]]:8.2f}")
    with open(out_path, "w") as f:
        json.dump({"rounds": rounds, "steps_per_round": STEPS, "torch": torch.__version__, "timm": timm.__version__,
                   "totals_ms": totals, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
