"""ComRoPE's q/k basis folded into the qkv weights of all layers in one product vs layer by layer: an A/B in one process.

ViT-S/16 structure at 224 px (depth 4, batch 2, one thread, SGD), ``comrope_ld``; both variants are the same model,
stepping in turn, the order alternating per round; the layer-by-layer variant is the shipped code with
``vispe.models.layers.fold_qk_bases_of_blocks`` returning ``None`` (the fallback every host takes when the layers do
not fold alike). Reports per mode (eager, compiled) the median over rounds of the batched / per-layer step-time
ratio and its interquartile range.

Usage (repository root): ``PYTHONPATH=. python results/speed/cpu-comrope-batched-fold-2026-11-28.py OUT.json [ROUNDS] [ENCODING]``
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import timm
import torch
import torch.nn.functional as F

import vispe  # noqa: F401
import vispe.models.layers as layers

torch.set_num_threads(1)
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 31
ENCODING = sys.argv[3] if len(sys.argv) > 3 else "comrope_ld"
STEPS = 3
batched_fold = layers.fold_qk_bases_of_blocks


def per_layer(*args, **kwargs):
    return None


def build():
    torch.manual_seed(0)
    model = timm.create_model("vispe_vit_small_patch16_224", pos_encoding=ENCODING, depth=4)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


x, y = torch.randn(2, 3, 224, 224), torch.tensor([0, 1])
result = {"encoding": ENCODING, "torch": torch.__version__, "rounds": ROUNDS, "steps_per_run": STEPS}
for mode in ("eager", "compile"):
    model, opt = build()
    runner = torch.compile(model) if mode == "compile" else model

    def step():
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(runner(x), y).backward()
        opt.step()

    def timed(variant):
        layers.fold_qk_bases_of_blocks = batched_fold if variant == "batched" else per_layer
        t = time.perf_counter()
        for _ in range(STEPS):
            step()
        return (time.perf_counter() - t) / STEPS

    for variant in ("batched", "per_layer"):
        for _ in range(3):
            timed(variant)
    ratios, ms = [], {"batched": [], "per_layer": []}
    for r in range(ROUNDS):
        order = ("batched", "per_layer") if r % 2 == 0 else ("per_layer", "batched")
        t = {v: timed(v) for v in order}
        for v in t:
            ms[v].append(t[v] * 1e3)
        ratios.append(t["batched"] / t["per_layer"])
    q = statistics.quantiles(ratios, n=4)
    result[mode] = {"ratio_median": round(statistics.median(ratios), 3), "ratio_iqr": [round(q[0], 3), round(q[2], 3)],
                    "ms_median": {v: round(statistics.median(m), 1) for v, m in ms.items()}, "ratios": [round(r, 3) for r in ratios]}
    print(mode, json.dumps({k: v for k, v in result[mode].items() if k != "ratios"}), flush=True)
layers.fold_qk_bases_of_blocks = batched_fold
with open(sys.argv[1], "w") as f:
    json.dump(result, f, indent=1)
