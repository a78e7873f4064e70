"""Compiled train steps on a GPU: iRPE with its one-hot contextual term, and where compiled ComRoPE-LD's time goes.

ViT-S/16 at 224 px, batch 128, bf16 autocast, AdamW, ``torch.compile`` (inductor). The models of one process step
in turn, each round timing ``STEPS`` steps of each between two device synchronisations; timm's APE ViT
(``vit_small_patch16_224``) is in every process, the ratio reference. Default models: ``ape``, ``irpe`` (contextual,
key side; its compiled term is a product with one-hot buckets) and ``comrope_ld`` (``torch.linalg.eigh`` of the
generators in every forward, which synchronises the host with the device).

``--fixed-basis`` times ``ape`` and ``comrope_ld_fixed_basis``: ComRoPE-LD with the eigendecomposition replaced by
its value at the start (a constant: no ``eigh``, no gradient through it), a probe, not a model, that bounds what a
decomposition without the synchronisation could gain. It needs its own process: a second ComRoPE-LD model of the
same structure reuses the first one's compiled graph (torch 2.11 inlines the modules), which a probe run in the
same process did (its "compile" took 0.7 s and it timed the shipped model again).

Before timing, one eager ComRoPE-LD step runs under ``torch.cuda.set_sync_debug_mode('warn')`` and every
synchronising call site is recorded; after timing, two steps of each model are profiled on the host (self CPU time
per operator: launches, synchronisations, the compiled graphs' wrappers).

Usage: ``python results/speed/gpu-h100-2026-11-27-probe.py OUT.json [ROUNDS] [--fixed-basis]`` from the repository
root (``PYTHONPATH=.``); without CUDA it runs a tiny CPU version (depth 2, batch 2, 64 px) to check the script.
"""
from __future__ import annotations

import json
import statistics
from typing import Callable
import sys
import time
import warnings

import timm
import torch
import torch.nn.functional as F
from timm.optim import create_optimizer_v2

import vispe  # noqa: F401  (registers the vispe_* models)
import vispe.encodings.comrope.encodings as comrope_encodings
from vispe.encodings.comrope.spectral import spectral_decomposition

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
BATCH, IMG, DEPTH = (128, 224, 12) if CUDA else (2, 64, 2)
STEPS = 5


def build(name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    size = {"img_size": IMG, "depth": DEPTH}
    if name == "ape":
        model = timm.create_model("vit_small_patch16_224", pretrained=False, **size)
    else:
        model = timm.create_model("vispe_vit_small_patch16_224", pretrained=False,
                                  pos_encoding={"name": name.replace("_fixed_basis", "")}, **size)
    model = model.to(DEVICE)
    return model, create_optimizer_v2(model, opt="adamw", lr=1e-4, weight_decay=0.05)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def host_profile(step: Callable[[], None], steps: int = 2) -> dict:
    """Self CPU time per operator (ms per step) over ``steps`` calls: the host's share of a step."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    sync()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        sync()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows) / 1e3 / steps
    return {"host_ms_per_step": round(total, 2),
            "top": [{"op": e.key[:100], "self_cpu_ms": round(e.self_cpu_time_total / 1e3 / steps, 3),
                     "calls": e.count / steps} for e in rows[:25]]}


def main(out_path: str, rounds: int, fixed_basis: bool) -> None:
    x = torch.randn(BATCH, 3, IMG, IMG, device=DEVICE)
    y = torch.randint(0, 1000, (BATCH,), device=DEVICE)

    def step(runner: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            loss = F.cross_entropy(runner(x).float(), y)
        loss.backward()
        opt.step()

    result: dict = {"device": torch.cuda.get_device_name() if CUDA else "cpu", "torch": torch.__version__,
                    "timm": timm.__version__, "batch": BATCH, "img_size": IMG, "depth": DEPTH, "steps": STEPS}
    t0 = time.perf_counter()

    def save() -> None:  # after each phase: a run cut short still leaves what it measured
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)

    # 1. where an eager ComRoPE-LD step makes the host wait for the device
    model, opt = build("comrope_ld")
    step(model, opt)
    sync()
    sites: dict[str, int] = {}
    if CUDA:
        torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(model, opt)
        sync()
    if CUDA:
        torch.cuda.set_sync_debug_mode(0)
    for w in caught:
        key = f"{w.filename.split('site-packages/')[-1]}:{w.lineno}: {str(w.message)[:100]}"
        sites[key] = sites.get(key, 0) + 1
    result["eager_comrope_ld_sync_sites"] = sites
    print("synchronising calls in one eager ComRoPE-LD step:", json.dumps(sites, indent=1), flush=True)
    save()
    enc = model.pos_encoding if hasattr(model, "pos_encoding") else None
    with torch.no_grad():
        fixed = [t.detach().clone() for t in spectral_decomposition(enc.skew_blocks())]

    def fixed_decomposition(skew: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        zero = skew.sum() * 0  # keeps the generators in the graph, with a zero gradient
        return fixed[0] + zero, fixed[1] + zero, fixed[2] + zero.double()

    # 2. compile the four models, then time them in turn
    names = ("ape", "comrope_ld_fixed_basis") if fixed_basis else ("ape", "irpe", "comrope_ld")
    runs = {}
    for name in names:
        model, opt = build(name)
        if name.endswith("_fixed_basis"):
            model.pos_encoding.load_state_dict(enc.state_dict())  # the generators the fixed basis came from
        runs[name] = (torch.compile(model), opt)
    compile_s = {}
    for name in names:
        comrope_encodings.spectral_decomposition = fixed_decomposition if name.endswith("_fixed_basis") else spectral_decomposition
        t = time.perf_counter()
        for _ in range(2):
            step(*runs[name])
        sync()
        compile_s[name] = round(time.perf_counter() - t, 1)
        print(f"[{time.perf_counter() - t0:6.0f}s] {name}: compiled and warmed up in {compile_s[name]} s", flush=True)
        result["compile_and_warmup_s"] = compile_s
        save()
    ms = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            comrope_encodings.spectral_decomposition = fixed_decomposition if name.endswith("_fixed_basis") else spectral_decomposition
            sync()
            t = time.perf_counter()
            for _ in range(STEPS):
                step(*runs[name])
            sync()
            ms[name].append((time.perf_counter() - t) / STEPS * 1e3)
    result["host_profile"] = {}
    for name in names:
        comrope_encodings.spectral_decomposition = fixed_decomposition if name.endswith("_fixed_basis") else spectral_decomposition
        result["host_profile"][name] = host_profile(lambda: step(*runs[name]))
    comrope_encodings.spectral_decomposition = spectral_decomposition
    result["train_ms_per_round"] = {n: [round(v, 2) for v in vals] for n, vals in ms.items()}
    result["train_ms_median"] = {n: round(statistics.median(v), 2) for n, v in ms.items()}
    result["ratio_to_ape_median"] = {
        n: round(statistics.median(a / b for a, b in zip(ms[n], ms["ape"])), 3) for n in names}
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps({k: result[k] for k in ("train_ms_median", "ratio_to_ape_median", "wall_s")}, indent=1))
    save()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--fixed-basis"]
    main(args[0], int(args[1]) if len(args) > 1 else 5, "--fixed-basis" in sys.argv)
