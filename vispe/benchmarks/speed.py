"""``vispe bench speed``: train-step time, inference throughput and peak memory of every encoding vs timm.

All models of one configuration live in ONE process and are measured round-robin (the order
rotates every round), so a machine whose load drifts -- a shared CPU -- slows every model alike;
each encoding's ratio to timm's APE ViT is the median of per-round ratios (paired with the APE
measurement of the same round), next to the ratio of medians.

Conventions follow timm's ``benchmark.py``: random ``randn`` inputs, a train step is
``zero_grad -> forward -> CrossEntropyLoss(random targets) -> backward -> SGD step`` with
``create_optimizer_v2(model, 'sgd', lr=1e-4)``, inference runs under ``torch.inference_mode()``,
``time.perf_counter`` (with a device synchronize on accelerators).

Peak memory: on CUDA, ``torch.cuda.max_memory_allocated`` over one step above what was allocated before it. On CPU there is no
allocator counter, so one extra (untimed) step runs under ``torch.profiler`` with
``profile_memory=True``; every allocation/free the CPU allocator reports is replayed in time
order and the running maximum is the step's peak *above* what was live before it. The reported
peak adds the bytes that stay resident (parameters, buffers and -- for training -- optimizer
state). Gradients are set to ``None`` before each step, so they count in the step's peak.
Memory that bypasses the PyTorch allocator (oneDNN scratch pads, the Python heap) is not seen;
it is the same kind of memory for every model.

Usage::

    vispe bench speed                         # every registered 2D encoding + timm refs, eager
    vispe bench speed --models vit_s16 --encodings learned,rope_axial --iters 10
    vispe bench speed --modes eager,compile   # also torch.compile (slow to warm up on CPU)
    vispe bench speed --models vit_s16 --img-sizes 224,384,512 --plot outputs/speed-growth.png
                                              # cost growth with tokens: ratios to timm's APE at each size
    vispe bench speed --models video_s16 --frames 8,16   # the video frame-count axis
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from vispe.files import write_text_atomic

__all__ = ["main", "parse_encoding_specs", "BENCH_CONFIGS", "TARGETS"]

# ----------------------------------------------------------------------------------------------
# What is measured
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchConfig:
    """One model size: the vispe model name and the timm reference models built at the same size.

    ``frames > 0`` makes it a video configuration (input ``(B, 3, frames, H, W)``, 3D encodings). timm
    has no video ViT, so there the ratio denominator is vispe's own video ViT with ``reference`` (the
    learned absolute table, the video counterpart of timm's APE ViT).
    """

    vispe_model: str
    img_size: int
    cpu_batch: int
    gpu_batch: int
    num_classes: int
    timm_refs: dict[str, tuple[str, dict[str, Any]]]
    frames: int = 0
    reference: str = "timm:ape"
    model_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def grid_ndim(self) -> int:
        return 3 if self.frames else 2

    @property
    def default_encodings(self) -> tuple[str, ...]:
        """The encodings measured without ``--encodings``: the registry's benchmark set for this size's grids
        (:func:`vispe.encodings.benchmark_encodings`), each with its benchmark options."""
        return default_encodings(self.grid_ndim)


_TIMM_S16 = {
    "ape": ("vit_small_patch16_224", {}),
    "rope_axial": ("vit_small_patch16_rope_224", {}),
    "rope_mixed": ("vit_small_patch16_rope_mixed_224", {}),
}
_TIMM_B16 = {
    "ape": ("vit_base_patch16_224", {}),
    "rope_axial": ("vit_base_patch16_rope_224", {}),
    "rope_mixed": ("vit_base_patch16_rope_mixed_224", {}),
}
_SMALL_IMG = dict(img_size=32, patch_size=4, num_classes=10)



def default_encodings(grid_ndim: int) -> tuple[str, ...]:
    """The encodings benchmarked by default on ``grid_ndim``-D grids: every registered encoding whose record is tagged
    for them (``benchmark``; variants, composition presets, LLM-side schemes and SeqPE are opt-in), each under its
    defaults and ``benchmark_options`` (e.g. LieRE with 8x8 blocks: its dense default, one 64x64 matrix_exp per token,
    head and layer, costs ~14 s forward + ~72 s backward per ViT-S/16 step on one CPU thread)."""
    from vispe.encodings import benchmark_encodings

    return tuple(benchmark_encodings(grid_ndim))


BENCH_CONFIGS: dict[str, BenchConfig] = {
    "vit_s16": BenchConfig("vispe_vit_small_patch16_224", 224, 8, 128, 1000, _TIMM_S16),
    "vit_b16": BenchConfig("vispe_vit_base_patch16_224", 224, 4, 128, 1000, _TIMM_B16),
    "vit_s4_32": BenchConfig(
        "vispe_vit_small_patch4_32", 32, 16, 512, 10, {k: (n, dict(_SMALL_IMG)) for k, (n, _) in _TIMM_S16.items()},
    ),
    # video ViT-S, tubelet 2x16x16, 8 frames of 112 px: (4, 7, 7) = 196 tokens + cls, the token count of ViT-S/16@224
    "video_s16": BenchConfig(
        "vispe_video_vit_small_patch16_224", 112, 8, 64, 400, {}, frames=8,
        reference="vispe:learned_3d", model_kwargs={"img_size": 112, "num_frames": 8},
    ),
}
#: What ``vispe bench speed`` runs without ``--models`` (``video_s16`` is opt-in: it has no timm counterpart).
DEFAULT_MODELS = ("vit_s16", "vit_s4_32")

#: Per-encoding cost limits: (max time ratio to timm APE, max peak-memory ratio), CPU eager at the size's own resolution.
TARGETS: dict[str, tuple[float, float]] = {
    "rope_axial": (1.05, 1.10),
    "rope_mixed": (1.05, 1.10),
    "comrope_ap": (1.10, 1.10),
    "comrope_ld": (1.10, 1.10),
    "irpe": (1.20, 1.10),
    "cpe": (1.03, 1.10),
    "lff": (1.03, 1.10),
    "sincos2d": (1.03, 1.10),
    "learned": (1.03, 1.10),
    "loope": (1.10, 1.10),
    # video (ratios to vispe's learned_3d video ViT): the same limits as their 2D counterparts
    "rope_axial_3d": (1.05, 1.10),
    "rope_mixed_3d": (1.05, 1.10),
    "comrope_ld_3d": (1.10, 1.10),
    "sincos3d": (1.03, 1.10),
}


def parse_encoding_specs(text: str) -> list[tuple[str, str, dict[str, Any]]]:
    """``'learned,irpe[mode=contextual,skip=1],rope_mixed'`` -> ``[(label, name, kwargs), ...]`` (vispe's one
    spec grammar, :func:`vispe.encodings.spec.parse_encoding_list`)."""
    from vispe.encodings.spec import parse_encoding_list

    return parse_encoding_list(text)


def default_encoding_specs(every: bool = False, cfg: BenchConfig | None = None) -> str:
    """The default encodings of a configuration (:func:`default_encodings`; ``every``: every encoding that
    takes the configuration's grids); ``cfg`` defaults to ``vit_s16``."""
    from vispe.encodings import list_encodings

    cfg = cfg or BENCH_CONFIGS["vit_s16"]
    return ",".join(list_encodings(grid_ndim=cfg.grid_ndim) if every else cfg.default_encodings)


from .speed_measure import PRECISIONS, Entry, graphs_compiled, infer_step, measure_peak, profile_step, train_step, _timed  # noqa: F401  (re-exported)
from .speed_report import SKIPPED_PREFIX, _machine, compile_lines, format_markdown, format_table  # noqa: F401  (re-exported)


# ----------------------------------------------------------------------------------------------
# Building
# ----------------------------------------------------------------------------------------------


def sized_config(cfg: BenchConfig, img_size: int | None = None, frames: int | None = None) -> BenchConfig:
    """``cfg`` at another input size (``img_size`` px, ``frames`` frames for a video size): every model of the run --
    timm's references included -- is built for that size (timm resizes its APE table at construction)."""
    from dataclasses import replace

    img = cfg.img_size if img_size is None else int(img_size)
    nf = cfg.frames if frames is None or not cfg.frames else int(frames)
    kw = dict(cfg.model_kwargs)
    if img != cfg.img_size or "img_size" in kw:
        kw["img_size"] = img
    if cfg.frames:
        kw["num_frames"] = nf
    refs = {k: (n, {**a, "img_size": img}) if img != cfg.img_size else (n, a) for k, (n, a) in cfg.timm_refs.items()}
    return replace(cfg, img_size=img, frames=nf, model_kwargs=kw, timm_refs=refs)


def token_count(model: nn.Module) -> int | None:
    """Tokens one attention layer sees (prefix tokens included), from the model's own patch grid."""
    grid = getattr(model, "grid_size", None) or getattr(getattr(model, "patch_embed", None), "grid_size", None)
    if grid is None:
        return None
    n = 1
    for g in grid:
        n *= int(g)
    return n + int(getattr(model, "num_prefix_tokens", 0))


def build_entries(
    config_name: str,
    cfg: BenchConfig,
    specs: Sequence[tuple[str, str, dict[str, Any]]],
    timm_refs: Sequence[str],
    modes: Sequence[str],
    device: torch.device,
    depth: int | None,
    log: Callable[[str], None],
    precisions: Sequence[str] = ("fp32",),
) -> list[Entry]:
    import timm
    from timm.optim import create_optimizer_v2

    import vispe  # noqa: F401

    extra = {} if depth is None else {"depth": depth}
    builders: list[tuple[str, str, str, Callable[[], nn.Module]]] = []
    for ref in timm_refs:
        if ref not in cfg.timm_refs:
            raise ValueError(f"unknown timm reference {ref!r}; choose from {sorted(cfg.timm_refs)}")
        name, kw = cfg.timm_refs[ref]
        builders.append((f"timm:{ref}", "timm", ref, lambda n=name, k=kw: timm.create_model(n, pretrained=False, **k, **extra)))
    for label, enc_name, enc_kwargs in specs:
        spec = {"name": enc_name, **enc_kwargs}
        builders.append(
            (
                f"vispe:{label}",
                "vispe",
                enc_name,
                lambda s=spec: timm.create_model(
                    cfg.vispe_model, pretrained=False, pos_encoding=s, num_classes=cfg.num_classes, **cfg.model_kwargs, **extra
                ),
            )
        )
    entries = []
    for mode in modes:
        for precision in precisions:
            for label, family, enc, build in builders:
                torch.manual_seed(0)
                t0 = time.perf_counter()
                try:
                    model = build().to(device)
                    if precision == "bf16":
                        model = model.to(torch.bfloat16)
                except Exception as err:  # a broken encoding must not sink the whole run
                    log(f"  ! {config_name}/{mode}/{precision}/{label}: build failed: {type(err).__name__}: {err}")
                    dummy = nn.Linear(1, 1)
                    entries.append(
                        Entry(config_name, label, family, enc, mode, dummy, dummy, torch.optim.SGD(dummy.parameters(), lr=0.0), 0,
                              0.0, error=f"build: {type(err).__name__}: {err}", precision=precision)
                    )
                    continue
                runner: Any = torch.compile(model) if mode == "compile" else model
                opt = create_optimizer_v2(model, opt="sgd", lr=1e-4)
                n_params = sum(p.numel() for p in model.parameters())
                entries.append(Entry(config_name, label, family, enc, mode, model, runner, opt, n_params, time.perf_counter() - t0,
                                     precision=precision))
    return entries


# ----------------------------------------------------------------------------------------------
# Running
# ----------------------------------------------------------------------------------------------


def _short_error(err: Exception, limit: int) -> str:
    """``Type: first line`` of an error for the JSON (compiler errors run to pages of generated code; the log keeps
    them whole)."""
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first[:limit]}"


def _log_failure(entry: Entry, what: str, err: Exception, log: Callable[[str], None]) -> None:
    log(f"  ! {entry.config}/{entry.mode}/{entry.precision}/{entry.label}: {what}: {type(err).__name__}: {err}")


def _guard(entry: Entry, what: str, fn: Callable[[], Any], log: Callable[[str], None]) -> Any:
    if entry.error:
        return None
    try:
        return fn()
    except Exception as err:
        entry.error = f"{what}: {_short_error(err, 500)}"
        _log_failure(entry, what, err, log)
        return None


def run_config(
    entries: list[Entry],
    x: torch.Tensor,
    y: torch.Tensor,
    device: torch.device,
    iters: int,
    warmup: int,
    min_run_s: float,
    benches: Sequence[str],
    log: Callable[[str], None],
    deadline: float | None = None,
    profile: bool = False,
) -> None:
    """Warm up (and compile), time ``iters`` round-robin rounds, then take peak memory, then (``profile``) profile one
    train step per model. Past ``deadline`` (a ``time.perf_counter()`` value) no further model is warmed up -- those
    not yet warm are recorded as skipped, never estimated -- timing stops after the round in progress (one round at
    least) and no further model is profiled."""
    do_train, do_infer, do_mem = "train" in benches, "infer" in benches, "memory" in benches

    def late() -> bool:
        return deadline is not None and time.perf_counter() > deadline

    # warm-up (also compiles) round-robin, and calibrate how many steps make one timed run
    # compiled models always get their untimed first calls: a timed step must never include compilation
    n_warm = max(warmup, 1 if min_run_s > 0 or any(e.mode == "compile" for e in entries) else 0)
    for w in range(n_warm):
        for e in entries:
            if w == 0 and late() and not e.error:
                e.error = SKIPPED_PREFIX + "time budget spent before this model was warmed up"
                log(f"  ! {e.config}/{e.mode}/{e.precision}/{e.label}: {e.error}")
                continue
            if e.mode == "compile" and w == 0:
                # compile, then recompile for the cached-table path (first call fills the caches)
                for call in range(2):
                    if do_train:
                        before = graphs_compiled()
                        _guard(e, "train compile", lambda: train_step(e, x, y), log)
                        if call == 0 and not e.error:
                            e.graphs_per_step = graphs_compiled() - before
                            if e.graphs_per_step > 1:
                                log(f"  ! {e.config}/{e.mode}/{e.precision}/{e.label}: {e.graphs_per_step} compiled graphs per "
                                    "train step (graph breaks; TORCH_LOGS=graph_breaks says where)")
                    if do_infer:
                        _guard(e, "infer compile", lambda: infer_step(e, x), log)
            if do_train:
                t = _guard(e, "train warm-up", lambda: _timed(lambda: train_step(e, x, y), 1, device), log)
                if t is not None and w == n_warm - 1:
                    e.inner_train = max(1, math.ceil(min_run_s / max(t[0], 1e-9)))
            if do_infer:
                t = _guard(e, "infer warm-up", lambda: _timed(lambda: infer_step(e, x), 1, device), log)
                if t is not None and w == n_warm - 1:
                    e.inner_infer = max(1, math.ceil(min_run_s / max(t[0], 1e-9)))
        log(f"  warm-up round {w + 1}/{n_warm} done")
    for r in range(iters):
        k = r % len(entries)
        order = entries[k:] + entries[:k]  # rotate so no model always runs first after a slow one
        for e in order:
            compiled_before = graphs_compiled()
            if do_train:
                t = _guard(e, "train", lambda: _timed(lambda: train_step(e, x, y), e.inner_train, device), log)
                if t is not None:
                    e.train_s.append(t[0])
                    e.train_cpu_s.append(t[1])
            if do_infer:
                t = _guard(e, "infer", lambda: _timed(lambda: infer_step(e, x), e.inner_infer, device), log)
                if t is not None:
                    e.infer_s.append(t[0])
                    e.infer_cpu_s.append(t[1])
            if e.mode == "compile" and graphs_compiled() > compiled_before:
                e.compiles_in_timing += graphs_compiled() - compiled_before
                log(f"  ! {e.config}/{e.mode}/{e.precision}/{e.label}: compiled {graphs_compiled() - compiled_before} "
                    f"graph(s) in timed round {r + 1} (TORCH_LOGS=recompiles says why)")
        log(f"  round {r + 1}/{iters} done")
        if late():
            log(f"  time budget spent: timing stops after {r + 1} of {iters} rounds")
            break
    if do_mem:
        for e in entries:
            if do_train:
                e.train_peak = _guard(e, "train memory", lambda: measure_peak(e, lambda: train_step(e, x, y), device, True), log)
            if do_infer:
                e.infer_peak = _guard(e, "infer memory", lambda: measure_peak(e, lambda: infer_step(e, x), device, False), log)
    if profile and do_train:
        for e in entries:
            if late():
                log("  time budget spent: no further model is profiled")
                break
            if e.error:
                continue
            try:
                e.profile = profile_step(lambda: train_step(e, x, y), device)
            except Exception as err:  # a profiler failure costs the profile only, never the measured times
                e.profile = {PROFILE_ERROR: {"error": _short_error(err, 300)}}
                _log_failure(e, "profile", err, log)


def _median(v: Sequence[float]) -> float | None:
    return statistics.median(v) if v else None


def _paired_ratios(a: Sequence[float], ref: Sequence[float]) -> list[float]:
    n = min(len(a), len(ref))
    return [a[i] / ref[i] for i in range(n)]


def _paired_ratio(a: Sequence[float], ref: Sequence[float]) -> float | None:
    r = _paired_ratios(a, ref)
    return statistics.median(r) if r else None


#: ``Entry.profile`` key of a profile that failed (its value holds the error): the row keeps its times
PROFILE_ERROR = "(profile failed)"


def profile_summary(prof: dict[str, dict[str, float]], ref: dict[str, dict[str, float]] | None, top: int) -> dict[str, Any]:
    """A profiled step for the JSON: its ``top`` ops by self time, and the ``top`` ops that take the most time beyond
    the reference model's time in the same op (``extra``: where an encoding's cost goes)."""
    if PROFILE_ERROR in prof:
        return {"error": prof[PROFILE_ERROR]["error"]}
    ref = {} if ref is None or PROFILE_ERROR in ref else ref

    def item(name: str) -> dict[str, Any]:
        ms, ref_ms = prof[name]["ms"], ref.get(name, {}).get("ms", 0.0)
        return {"op": name, "ms": round(ms, 4), "calls": round(prof[name]["calls"], 2), "ref_ms": round(ref_ms, 4),
                "extra_ms": round(ms - ref_ms, 4)}

    by_time = sorted(prof, key=lambda n: -prof[n]["ms"])[:top]
    extra = sorted(prof, key=lambda n: -(prof[n]["ms"] - ref.get(n, {}).get("ms", 0.0)))
    return {
        "step_ms": round(sum(v["ms"] for v in prof.values()), 3),
        "ref_step_ms": round(sum(v["ms"] for v in ref.values()), 3) if ref else None,
        "top": [item(n) for n in by_time],
        "extra": [item(n) for n in extra[:top] if prof[n]["ms"] - ref.get(n, {}).get("ms", 0.0) > 0] if ref else [],
    }


def summarise(
    entries: list[Entry], batch: int, img_size: int, clock: str, ref_label: str = "timm:ape", frames: int = 0,
    profile_top: int = 0,
) -> list[dict[str, Any]]:
    """Rows for the table/JSON. ``clock='cpu'`` headlines process CPU time, ``'wall'`` wall time; both are kept.
    ``profile_top``: how many ops of each profiled step the row keeps."""
    rows = []
    refs = {(e.config, e.mode, e.precision): e for e in entries if e.label == ref_label and not e.error}
    # vispe's own model without a PE: ratios to it isolate what the encoding itself costs
    nones = {(e.config, e.mode, e.precision): e for e in entries if e.label == "vispe:none" and not e.error}

    def series(e: Entry, what: str) -> list[float]:
        return getattr(e, f"{what}_cpu_s" if clock == "cpu" else f"{what}_s")

    for e in entries:
        ref = refs.get((e.config, e.mode, e.precision))
        tr, inf = _median(series(e, "train")), _median(series(e, "infer"))
        row: dict[str, Any] = {
            "config": e.config,
            "mode": e.mode,
            "precision": e.precision,
            "model": e.label,
            "family": e.family,
            "encoding": e.encoding,
            "batch_size": batch,
            "img_size": img_size,
            "frames": frames,
            "tokens": token_count(e.model) if not e.error else None,
            "ratio_reference": ref_label,
            "param_count_m": round(e.param_count / 1e6, 3),
            "clock": clock,
            "rounds": len(e.train_s) or len(e.infer_s),
            "steps_per_run": {"train": e.inner_train, "infer": e.inner_infer},
            "train_step_ms": None if tr is None else 1e3 * tr,
            "train_samples_per_sec": None if tr is None else batch / tr,
            "infer_step_ms": None if inf is None else 1e3 * inf,
            "infer_samples_per_sec": None if inf is None else batch / inf,
            "train_wall_ms_all": [1e3 * t for t in e.train_s],
            "train_cpu_ms_all": [1e3 * t for t in e.train_cpu_s],
            "infer_wall_ms_all": [1e3 * t for t in e.infer_s],
            "infer_cpu_ms_all": [1e3 * t for t in e.infer_cpu_s],
            "train_peak_mb": None if e.train_peak is None else e.train_peak / 2**20,
            "infer_peak_mb": None if e.infer_peak is None else e.infer_peak / 2**20,
            "error": e.error,
        }
        if e.mode == "compile":
            row["graphs_per_step"] = e.graphs_per_step
            row["compiles_in_timing"] = e.compiles_in_timing
        if e.profile is not None and profile_top > 0:
            ref_profile = ref.profile if ref is not None and ref is not e else None
            # what profile_step counted: device events on CUDA, whichever clock the timing used
            on_gpu = any(p.is_cuda for p in e.model.parameters())
            summary = profile_summary(e.profile, ref_profile, profile_top)
            row["profile"] = summary if "error" in summary else {"time": "GPU kernel time" if on_gpu else "CPU op self time",
                                                                  **summary}
        if ref is not None and not e.error:
            row["train_ratio"] = _paired_ratio(series(e, "train"), series(ref, "train"))
            row["infer_ratio"] = _paired_ratio(series(e, "infer"), series(ref, "infer"))
            for what in ("train", "infer"):  # the spread of the per-round ratios: how far to trust the median
                r = _paired_ratios(series(e, what), series(ref, what))
                row[f"{what}_ratio_range"] = [min(r), max(r)] if r else None
            row["train_ratio_wall"] = _paired_ratio(e.train_s, ref.train_s)
            row["infer_ratio_wall"] = _paired_ratio(e.infer_s, ref.infer_s)
            none = nones.get((e.config, e.mode, e.precision))
            if none is not None:
                row["train_ratio_vs_none"] = _paired_ratio(series(e, "train"), series(none, "train"))
                row["infer_ratio_vs_none"] = _paired_ratio(series(e, "infer"), series(none, "infer"))
            rt, ri = _median(series(ref, "train")), _median(series(ref, "infer"))
            row["train_ratio_of_medians"] = tr / rt if tr and rt else None
            row["infer_ratio_of_medians"] = inf / ri if inf and ri else None
            row["train_mem_ratio"] = e.train_peak / ref.train_peak if e.train_peak and ref.train_peak else None
            row["infer_mem_ratio"] = e.infer_peak / ref.infer_peak if e.infer_peak and ref.infer_peak else None
            # the limits are CPU eager at the configuration's own size
            home = BENCH_CONFIGS.get(e.config)
            at_home = home is None or (img_size == home.img_size and frames == home.frames)
            on_cpu = e.precision == "fp32" and not any(p.is_cuda for p in e.model.parameters())
            tgt = TARGETS.get(e.encoding) if e.family == "vispe" and e.mode == "eager" and at_home and on_cpu else None
            if tgt is not None:
                time_ok = all(row[k] is None or row[k] <= tgt[0] for k in ("train_ratio", "infer_ratio"))
                mem_ok = all(row[k] is None or row[k] <= tgt[1] for k in ("train_mem_ratio", "infer_mem_ratio"))
                row["target"] = {"time": tgt[0], "memory": tgt[1], "met": time_ok and mem_ok, "time_met": time_ok, "memory_met": mem_ok}
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from vispe.benchmarks.grid import benchmark_parser

    p = benchmark_parser("vispe bench speed", "Train-step time, inference throughput and peak memory of every encoding vs timm's "
                         "own ViTs (one process, models interleaved round-robin).", "plain")
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help=f"model sizes, comma-separated from {sorted(BENCH_CONFIGS)} (video_s16: the video ViT with 3D encodings)")
    p.add_argument("--encodings", default=None,
                   help="vispe encodings, e.g. 'learned,rope_axial,irpe[mode=bias]' (default: per model size, the registry's "
                   "benchmark set for its grids, vispe.encodings.benchmark_encodings(2) or (3)); 'all' (or 'all2d') = "
                   "every registered encoding for the size's grids; '' = none; names that do not take a size's grids are skipped there")
    p.add_argument("--timm-refs", default="ape,rope_axial,rope_mixed",
                   help="timm reference models: ape (vit_small_patch16_224, the ratio denominator), rope_axial, rope_mixed")
    p.add_argument("--img-sizes", default=None,
                   help="input sizes in px, comma-separated (e.g. 224,384,512): every model is built and measured at each, "
                   "ratios to the reference of the same size (default: the model size's own)")
    p.add_argument("--frames", default=None,
                   help="video sizes only: frame counts, comma-separated (e.g. 8,16), the temporal token axis (default: 8)")
    p.add_argument("--plot", default=None,
                   help="write a PNG of train time / peak memory x (vs the reference) against tokens per encoding and mode")
    p.add_argument("--modes", default="eager", help="'eager', 'compile' or 'eager,compile' (torch.compile warm-up is slow on CPU)")
    p.add_argument("--bench", default="train,infer,memory", help="what to measure: any of train, infer, memory")
    p.add_argument("--precisions", default="fp32",
                   help="numeric precisions, comma-separated from fp32, amp_bf16 (autocast), bf16 (pure: weights and inputs)")
    p.add_argument("--plan", default=None,
                   help="run a prepared plan instead of the size/mode options: a shipped name ('gpu': ViT-S/16 and ViT-B/16, "
                   "224 and 448 px, eager and compiled, fp32 / bf16 autocast / pure bf16, batch 128) or a YAML file")
    p.add_argument("--parts", default=None,
                   help="with --plan: run only these parts, comma-separated plan part names (e.g. the parts an earlier run "
                   "listed as skipped)")
    p.add_argument("--profile", type=int, default=None, metavar="N",
                   help="after timing, profile one train step per model (torch.profiler; GPU kernel time on CUDA) and keep "
                   "its N costliest ops, and the N that cost most beyond the reference model's same op, in the JSON and "
                   "Markdown: where an encoding's time goes (overrides a plan part's 'profile')")
    p.add_argument("--dry-run", action="store_true",
                   help="with --plan: every part on the tiny CPU model (depth 1, batch 2, one round, two encodings)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="no part starts after this many seconds (skipped parts are listed in the JSON; a plan sets its own)")
    p.add_argument("--iters", type=int, default=3, help="timed rounds (each model measured once per round)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds before timing")
    p.add_argument("--min-run-s", type=float, default=0.0,
                   help="repeat a step inside one timed run until it lasts about this long (0: one step per run)")
    p.add_argument("--batch-size", type=int, default=None, help="override the batch size of every model size")
    p.add_argument("--depth", type=int, default=None, help="override the depth of every model (quick checks only)")
    p.add_argument("--device", default="cpu", help="'cpu' or 'cuda'")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads on CPU (default 1: on a CPU shared with other jobs every multi-threaded op "
                   "waits for a scheduler slice, which would be measured instead of the kernels; 0 = torch's default)")
    p.add_argument("--out-dir", default="outputs/bench_speed", help="where speed.json and speed.md go")
    p.add_argument("--tag", default="speed", help="file stem of the JSON / Markdown outputs")
    p.add_argument("--jobs", type=int, default=1,
                   help="CPU only: split the encodings over this many worker processes run side by side (each with --threads "
                   "threads and its own timm reference models, so every ratio is still taken in one process); one merged "
                   "JSON / Markdown. Use at most the idle cores (e.g. a growth table of every encoding on a many-core host)")
    p.add_argument("--compare", default=None, metavar="BEFORE.json",
                   help="also print (and write as <tag>-compare.md) a before -> after table of train time x and peak memory x "
                   "per token count against this earlier run's JSON (e.g. the growth table before a change)")
    p.add_argument("--report", default=None, metavar="RESULTS.json",
                   help="run nothing: with --compare, the before -> after table of this saved run against BEFORE.json")
    p.add_argument("--clock", default=None, choices=("cpu", "wall"),
                   help="headline timer: 'cpu' = process CPU time (default on CPU: robust when other jobs share the cores), "
                   "'wall' = wall clock (default on CUDA); both are written to the JSON")
    return p


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _checked_choices(args: argparse.Namespace):
    """Validate the command line before anything is built: model sizes, modes, measurements, timm
    references, encoding specs, iterations and threads (each error names the bad value and the choices)."""
    from vispe.encodings import get_encoding_class

    configs, modes, benches, refs = _split(args.models), _split(args.modes), _split(args.bench), _split(args.timm_refs)
    for c in configs:
        if c not in BENCH_CONFIGS:
            raise ValueError(f"--models: unknown model size {c!r}; choose from {sorted(BENCH_CONFIGS)}")
    for m in modes:
        if m not in ("eager", "compile"):
            raise ValueError(f"--modes: unknown mode {m!r}; choose 'eager' and/or 'compile'")
    for b in benches:
        if b not in ("train", "infer", "memory"):
            raise ValueError(f"--bench: unknown measurement {b!r}; choose from train, infer, memory")
    known_refs = sorted({r for c in BENCH_CONFIGS.values() for r in c.timm_refs})
    for r in refs:
        if r not in known_refs:
            raise ValueError(f"--timm-refs: unknown timm reference {r!r}; choose from {known_refs}")
    every = args.encodings in ("all", "all2d")
    user_specs = None if args.encodings is None or every else parse_encoding_specs(args.encodings)
    for _, name, _ in user_specs or ():
        get_encoding_class(name)  # unknown names fail before anything is built
    if args.iters < 1:
        raise ValueError(f"--iters must be >= 1, got {args.iters}")
    if args.profile is not None and args.profile < 0:
        raise ValueError(f"--profile must be >= 0 (ops kept per profiled step; 0 = no profile), got {args.profile}")
    if args.profile and not args.plan and "train" not in benches:
        raise ValueError(f"--profile profiles the train step, but --bench {args.bench!r} leaves it out; add train")
    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0, got {args.threads}")
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    if args.jobs > 1 and (args.plan or args.device != "cpu"):
        raise ValueError(f"--jobs {args.jobs}: worker processes split a CPU run; drop --jobs for --plan or --device {args.device}")
    for pr in _split(args.precisions):
        if pr not in PRECISIONS:
            raise ValueError(f"--precisions: unknown precision {pr!r}; choose from {list(PRECISIONS)}")
    if args.dry_run and not args.plan:
        raise ValueError("--dry-run shrinks a --plan; give --plan NAME too")
    if args.parts and not args.plan:
        raise ValueError("--parts selects parts of a --plan; give --plan NAME too")
    if args.budget_s is not None and not (math.isfinite(args.budget_s) and args.budget_s > 0):
        raise ValueError(f"--budget-s must be a positive number of seconds, got {args.budget_s}")
    for opt, text in (("--img-sizes", args.img_sizes), ("--frames", args.frames)):
        for v in _split(text or ""):
            if not v.isdigit() or int(v) < 1:
                raise ValueError(f"{opt}: {v!r} is not a positive integer; give sizes like 224,384,512")

    def specs_for(cfg: BenchConfig) -> list[tuple[str, str, dict[str, Any]]]:
        if user_specs is None:
            return parse_encoding_specs(default_encoding_specs(every, cfg))
        return [sp for sp in user_specs if cfg.grid_ndim in get_encoding_class(sp[1]).grid_ndims]

    return configs, modes, benches, refs, user_specs, specs_for


def _allow_many_compiled_models() -> None:
    """Every compiled model of a run shares the forward code objects of its class, and dynamo keeps at most
    ``recompile_limit`` (8) graphs per code object before it silently runs the frame eagerly: a run of 18 compiled
    encodings would time the last ones uncompiled. Raise the limit for this process."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), 256))


@dataclass
class Part:
    """One measured group: models of one size built side by side, in the given modes and precisions, with ratios to
    the reference of the same group."""

    name: str
    config: str
    cfg: BenchConfig
    specs: list[tuple[str, str, dict[str, Any]]]
    refs: list[str]
    modes: list[str]
    precisions: list[str]
    batch: int
    benches: list[str]
    iters: int
    warmup: int
    min_run_s: float
    profile: int = 0  # ops kept per profiled train step (0: no profile)


def _plan_path(name: str) -> Path:
    """A shipped plan (``vispe/benchmarks/plans/NAME.yaml``) or a YAML file."""
    shipped = Path(__file__).with_name("plans") / f"{name}.yaml"
    if shipped.is_file():
        return shipped
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    known = sorted(p.stem for p in shipped.parent.glob("*.yaml"))
    raise ValueError(f"--plan: {name!r} is neither a shipped plan ({', '.join(known)}) nor a YAML file")


def load_plan(name: str, args: argparse.Namespace, specs_for: Callable[[BenchConfig], list], device: torch.device) -> tuple[list[Part], float | None]:
    """The parts of a plan file (see ``vispe/benchmarks/plans/gpu.yaml``) and its time budget. ``--dry-run``
    shrinks every part to the tiny CPU model (``vit_s4_32`` at depth 1, sizes / 7, batch 2, one round, the first two
    encodings) so the plan's machinery is checked without the hardware it is written for."""
    import yaml

    path = _plan_path(name)
    raw = yaml.safe_load(path.read_text())
    if not isinstance(raw, dict) or not isinstance(raw.get("parts"), list) or not raw["parts"]:
        raise ValueError(f"--plan {path}: expected a mapping with a non-empty 'parts' list")
    defaults = raw.get("defaults") or {}
    allowed = {"name", "models", "img_size", "frames", "modes", "precisions", "bench", "encodings", "timm_refs", "batch_size",
               "iters", "warmup", "min_run_s", "chunk", "profile"}
    parts: list[Part] = []
    for k, item in enumerate(raw["parts"]):
        spec = {**defaults, **item}
        unknown = sorted(set(spec) - allowed)
        if unknown:
            raise ValueError(f"--plan {path}: part {k} has unknown keys {unknown}; allowed: {sorted(allowed)}")
        config = spec.get("models")
        if config not in BENCH_CONFIGS:
            raise ValueError(f"--plan {path}: part {k}: unknown model size {config!r}; choose from {sorted(BENCH_CONFIGS)}")
        modes, precisions = list(spec.get("modes", ["eager"])), list(spec.get("precisions", ["fp32"]))
        for m in modes:
            if m not in ("eager", "compile"):
                raise ValueError(f"--plan {path}: part {k}: unknown mode {m!r}; choose 'eager' and/or 'compile'")
        for pr in precisions:
            if pr not in PRECISIONS:
                raise ValueError(f"--plan {path}: part {k}: unknown precision {pr!r}; choose from {list(PRECISIONS)}")
        img_size = spec.get("img_size")
        cfg = sized_config(BENCH_CONFIGS[config], img_size, spec.get("frames"))
        enc = spec.get("encodings", "default")
        specs = specs_for(cfg) if enc == "default" else parse_encoding_specs(",".join(enc) if isinstance(enc, list) else enc)
        refs = [r for r in spec.get("timm_refs", list(cfg.timm_refs)) if r in cfg.timm_refs]
        batch = int(spec.get("batch_size") or (cfg.gpu_batch if device.type == "cuda" else cfg.cpu_batch))
        benches = list(spec.get("bench", ["train", "infer", "memory"]))
        iters, warmup, min_run_s = int(spec.get("iters", 3)), int(spec.get("warmup", 1)), float(spec.get("min_run_s", 0.0))
        profile = int(spec.get("profile") or 0) if args.profile is None else args.profile
        if profile < 0 or (profile and "train" not in benches):
            raise ValueError(f"--plan {path}: part {k}: profile must be >= 0 and needs 'train' in bench, got profile {profile}, "
                             f"bench {benches}")
        if args.dry_run:
            cfg = sized_config(BENCH_CONFIGS["vit_s4_32"], max(16, (img_size or 224) // 7 // 4 * 4))
            specs, batch, iters, warmup, min_run_s = specs[:2], 2, 1, 0, 0.0
        chunk = int(spec.get("chunk") or 0) or len(specs) or 1
        for c0 in range(0, max(len(specs), 1), chunk):
            # later chunks re-measure only the ratio reference (compiled models are many: chunks keep each group short)
            chunk_refs = refs if c0 == 0 else [r for r in refs if f"timm:{r}" == cfg.reference]
            suffix = f"#{c0 // chunk + 1}" if chunk < len(specs) else ""
            parts.append(Part(f"{spec.get('name', f'part{k}')}{suffix}", config, cfg, specs[c0:c0 + chunk], chunk_refs, modes,
                              precisions, batch, benches, iters, warmup, min_run_s, profile))
    budget = raw.get("budget_s")
    return parts, None if budget is None or args.dry_run else float(budget)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "speed":  # 'vispe bench speed ...' arrives as ['speed', ...]
        argv = argv[1:]
    elif argv and argv[0] == "scaling":
        from .scaling import main as scaling_main

        return scaling_main(argv[1:])
    elif argv and not argv[0].startswith("-"):
        from .grid import bench_grid, is_grid, list_grids

        if is_grid(argv[0]):  # 'vispe bench resolution_tiny ...': a training benchmark's grid
            return bench_grid(argv)
        print(f"vispe bench: unknown benchmark {argv[0]!r}; choose 'speed', 'scaling', a grid {list_grids()} or a grid YAML file",
              file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    if args.report is not None:
        if not args.compare:
            raise ValueError("--report RESULTS.json compares a saved run: give --compare BEFORE.json too")
        print(_comparison(args.compare, _read_results(args.report, "--report")))
        return 0
    if args.compare:
        _read_results(args.compare, "--compare")  # a bad file fails now, not after the run
    t_start = time.perf_counter()
    load_start = tuple(round(v, 2) for v in os.getloadavg())
    configs, modes, benches, refs, user_specs, specs_for = _checked_choices(args)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: this PyTorch build sees no CUDA device; use --device cpu (or --dry-run for a plan)")
    clock = args.clock or ("wall" if device.type == "cuda" else "cpu")
    if args.threads and device.type == "cpu":
        torch.set_num_threads(args.threads)

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.0f}s] {msg}", file=sys.stderr, flush=True)

    import timm

    if args.jobs > 1:
        return run_jobs(args, argv, configs, refs, specs_for, t_start, load_start, log)
    if args.plan:
        parts, budget = load_plan(args.plan, args, specs_for, device)
        if args.dry_run and args.depth is None:
            args.depth = 1  # the tiny model the dry run promises: the machinery, not the model, is what it checks
        if args.parts:
            wanted = _split(args.parts)
            known = list(dict.fromkeys(p.name.split("#")[0] for p in parts))
            unknown = [w for w in wanted if w not in known]
            if unknown:
                raise ValueError(f"--parts: {', '.join(unknown)} not in plan {args.plan!r}; its parts: {', '.join(known)}")
            parts = [p for p in parts if p.name.split("#")[0] in wanted]
        if args.budget_s is not None:
            budget = args.budget_s
    else:
        budget = args.budget_s
        parts = []
        sizes = [int(v) for v in _split(args.img_sizes or "")] or [None]
        frame_counts = [int(v) for v in _split(args.frames or "")] or [None]
        for c in configs:
            for size in sizes:
                for nf in frame_counts if BENCH_CONFIGS[c].frames else [None]:
                    cfg = sized_config(BENCH_CONFIGS[c], size, nf)
                    specs = specs_for(cfg)
                    skipped = [sp[0] for sp in user_specs or () if sp not in specs]
                    if skipped:
                        log(f"[{c}] skipping {skipped}: they do not take {cfg.grid_ndim}D grids")
                    batch = args.batch_size or (cfg.gpu_batch if device.type == "cuda" else cfg.cpu_batch)
                    parts.append(Part(c, c, cfg, specs, [r for r in refs if r in cfg.timm_refs], modes, _split(args.precisions),
                                      batch, benches, args.iters, args.warmup, args.min_run_s, args.profile or 0))
    deadline = None if budget is None else t_start + budget
    if any("compile" in p.modes for p in parts):
        _allow_many_compiled_models()

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cpu_start = time.process_time()
    part_log: list[dict[str, Any]] = []

    def write(rows: list[dict[str, Any]], done: bool) -> dict[str, Any]:
        meta = {
            "machine": _machine(device),
            "device": str(device),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "timm": timm.__version__,
            "command": "vispe bench speed " + " ".join(argv),
            "complete": done,
            "iters": args.iters,
            "warmup": args.warmup,
            "modes": sorted({m for p in parts for m in p.modes}),
            "precisions": sorted({pr for p in parts for pr in p.precisions}),
            "plan": args.plan,
            "budget_s": budget,
            "parts": part_log,
            "wall_s": time.perf_counter() - t_start,
            "process_cpu_s": time.process_time() - cpu_start,
            "loadavg_start": load_start,
            "loadavg_end": tuple(round(v, 2) for v in os.getloadavg()),
            "memory_method": "resident params/buffers(/optimizer state) + the step's peak above the allocation before it "
            + ("(torch.cuda.max_memory_allocated)" if device.type == "cuda" else "(torch.profiler CPU allocator events)"),
            "clock": clock,
            "ratio_method": "median over rounds of time / the reference's time in the same round (timm APE; "
            "vispe learned_3d for the video size), within one part, mode and precision",
        }
        write_text_atomic(out / f"{args.tag}.json", json.dumps({"meta": meta, "results": rows}, indent=2))
        write_text_atomic(out / f"{args.tag}.md", format_markdown(rows, meta))
        return meta

    rows: list[dict[str, Any]] = []
    for part in parts:
        if deadline is not None and time.perf_counter() > deadline:
            part_log.append({"name": part.name, "status": "skipped (time budget spent)", "wall_s": 0.0})
            log(f"[{part.name}] skipped: the {budget:.0f} s budget is spent")
            continue
        t_part = time.perf_counter()
        cfg = part.cfg
        frames = f"{cfg.frames} frames of " if cfg.frames else ""
        log(f"[{part.name}] building {len(part.refs) + len(part.specs)} models x {part.modes} x {part.precisions} "
            f"(batch {part.batch}, {frames}{cfg.img_size}px)")
        entries = build_entries(part.config, cfg, part.specs, part.refs, part.modes, device, args.depth, log, part.precisions)
        g = torch.Generator().manual_seed(0)
        shape = (part.batch, 3, cfg.frames, cfg.img_size, cfg.img_size) if cfg.frames else (part.batch, 3, cfg.img_size, cfg.img_size)
        x = torch.randn(*shape, generator=g).to(device)
        y = torch.randint(0, cfg.num_classes, (part.batch,), generator=g).to(device)
        # a hard stop a little after the budget: a part that started in time may finish its round, not run on
        hard = None if deadline is None else deadline + 0.2 * budget
        run_config(entries, x, y, device, part.iters, part.warmup, part.min_run_s, part.benches, log, hard, part.profile > 0)
        if not any(e.label == cfg.reference for e in entries):
            log(f"[{part.name}] no ratios: the reference model {cfg.reference!r} is not in this run")
        part_rows = summarise(entries, part.batch, cfg.img_size, clock, ref_label=cfg.reference, frames=cfg.frames,
                              profile_top=part.profile)
        for r in part_rows:
            r["part"] = part.name
        rows += part_rows
        part_log.append({"name": part.name, "status": "done", "wall_s": round(time.perf_counter() - t_part, 1)})
        log(f"[{part.name}] done in {time.perf_counter() - t_part:.0f} s")
        del entries
        if device.type == "cuda":
            torch.cuda.empty_cache()
        write(rows, done=False)  # partial results survive an interrupted run

    meta = write(rows, done=True)
    if args.plot:
        from .speed_report import plot_growth

        plot_growth(rows, args.plot, meta)
        log(f"wrote {args.plot}")
    print(format_table(rows))
    for line in compile_lines(rows):
        print(line[2:])
    print(
        f"\nwall time {meta['wall_s']:.0f} s (process CPU {meta['process_cpu_s']:.0f} s) on {meta['machine']}, "
        f"{meta['threads']} threads; load average {load_start} -> {meta['loadavg_end']}"
    )
    skipped = [p["name"] for p in part_log if p["status"] != "done"]
    if skipped:
        print(f"parts not run (time budget): {', '.join(skipped)}")
    print(f"wrote {out / (args.tag + '.json')} and {out / (args.tag + '.md')}")
    _write_comparison(args, rows, out)
    return 0

def _read_results(path: str, option: str) -> list[dict[str, Any]]:
    """The result rows of a saved ``vispe bench speed`` JSON; a missing or foreign file is a clear error."""
    from vispe.files import read_json

    if not Path(path).is_file():
        raise ValueError(f"{option} {path!r}: no such file (give the JSON a 'vispe bench speed' run wrote)")
    data = read_json(path, "'vispe bench speed' JSON")  # bad JSON: the file, line and column
    rows = data.get("results") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise ValueError(f"{option} {path!r} is not a 'vispe bench speed' JSON (no 'results' list)")
    return rows


def _comparison(before: str, after_rows: list[dict[str, Any]]) -> str:
    from .speed_report import growth_comparison

    return (f"Train time x and peak memory x of the reference, before ({before}) -> after:\n\n"
            + growth_comparison(_read_results(before, "--compare"), after_rows))


def _write_comparison(args: argparse.Namespace, rows: list[dict[str, Any]], out: Path) -> None:
    if not args.compare:
        return
    text = _comparison(args.compare, rows)
    write_text_atomic(out / f"{args.tag}-compare.md", text + "\n")
    print("\n" + text)
    print(f"wrote {out / (args.tag + '-compare.md')}")


def _job_chunks(labels: Sequence[str], keep: Sequence[str], jobs: int) -> list[list[str]]:
    """``labels`` dealt round-robin over ``jobs`` workers (each worker's share costs about the same), every worker
    also given ``keep`` (a vispe reference model its ratios need); empty shares are dropped."""
    rest = [lb for lb in labels if lb not in keep]
    chunks = [list(keep) + rest[k::jobs] for k in range(jobs)]
    return [c for c in chunks if len(c) > len(keep)] or [list(keep)]


def run_jobs(args: argparse.Namespace, argv: list[str], configs: list[str], refs: list[str],
             specs_for: Callable[[BenchConfig], list], t_start: float, load_start: tuple, log: Callable[[str], None]) -> int:
    """``--jobs N``: the same command in N worker processes, each measuring a share of the encodings against its own
    timm reference models (so each ratio is in-process, as in a single run), then one merged JSON / Markdown.
    Reference rows from every worker are kept in the JSON (``shard``); the table shows the first worker's."""
    import subprocess

    import timm

    labels: list[str] = []
    vispe_refs: list[str] = []
    for c in configs:
        cfg = BENCH_CONFIGS[c]
        labels += [sp[0] for sp in specs_for(cfg) if sp[0] not in labels]
        if cfg.reference.startswith("vispe:") and cfg.reference[6:] not in vispe_refs:
            vispe_refs.append(cfg.reference[6:])
    chunks = _job_chunks(labels, vispe_refs, args.jobs)
    ref_names = {BENCH_CONFIGS[c].reference.split(":", 1)[1] for c in configs if BENCH_CONFIGS[c].reference.startswith("timm:")}
    out = Path(args.out_dir)
    work = out / f"{args.tag}-jobs"
    work.mkdir(parents=True, exist_ok=True)
    procs = []
    for k, chunk in enumerate(chunks):
        worker_refs = refs if k == 0 else [r for r in refs if r in ref_names]
        cmd = [sys.executable, "-m", "vispe.cli", "bench", "speed", *argv, "--encodings", ",".join(chunk),
               "--timm-refs", ",".join(worker_refs), "--jobs", "1", "--out-dir", str(work), "--tag", f"job{k}", "--plot", "",
               "--compare", ""]  # the comparison is of the merged rows
        log_file = open(work / f"job{k}.log", "w")
        procs.append((k, subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT), log_file))
        log(f"[job {k}] {len(chunk)} encodings: {','.join(chunk)} (log {work / f'job{k}.log'})")
    failed = []
    for k, proc, log_file in procs:
        rc = proc.wait()
        log_file.close()
        log(f"[job {k}] exited {rc}")
        if rc != 0:
            failed.append(k)
    rows: list[dict[str, Any]] = []
    shards = []
    for k, _, _ in procs:
        path = work / f"job{k}.json"
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        shards.append({"shard": k, "command": data["meta"]["command"], "wall_s": data["meta"]["wall_s"],
                       "process_cpu_s": data["meta"]["process_cpu_s"], "complete": data["meta"]["complete"]})
        for r in data["results"]:
            r["shard"] = k
            rows.append(r)
    if not shards:
        print(f"vispe bench speed: no worker wrote results; see the logs in {work}", file=sys.stderr)
        return 1
    first = json.loads((work / f"job{shards[0]['shard']}.json").read_text())["meta"]
    meta = {**first, "command": "vispe bench speed " + " ".join(argv), "complete": not failed and len(shards) == len(procs),
            "jobs": len(procs), "shards": shards, "threads": first["threads"], "timm": timm.__version__,
            "wall_s": time.perf_counter() - t_start, "process_cpu_s": sum(s["process_cpu_s"] for s in shards),
            "loadavg_start": load_start, "loadavg_end": tuple(round(v, 2) for v in os.getloadavg()),
            "ratio_method": first["ratio_method"] + "; with --jobs each worker process has its own reference (row 'shard')"}
    # one table in size order (workers interleave their sizes), the first worker's timm rows as the shown references
    rows.sort(key=lambda r: (r["config"], r.get("img_size") or 0, r.get("frames") or 0))
    shown = [r for r in rows if r["shard"] == shards[0]["shard"] or r["family"] != "timm"]
    write_text_atomic(out / f"{args.tag}.json", json.dumps({"meta": meta, "results": rows}, indent=2))
    write_text_atomic(out / f"{args.tag}.md", format_markdown(shown, meta))
    if args.plot:
        from .speed_report import plot_growth

        plot_growth(shown, args.plot, meta)
        log(f"wrote {args.plot}")
    print(format_table(shown))
    for line in compile_lines(shown):
        print(line[2:])
    print(f"\nwall time {meta['wall_s']:.0f} s (worker CPU {meta['process_cpu_s']:.0f} s) on {meta['machine']}, {len(procs)} "
          f"worker processes x {meta['threads']} threads; load average {load_start} -> {meta['loadavg_end']}")
    if failed:
        print(f"workers that failed: {failed} (logs in {work})", file=sys.stderr)
    print(f"wrote {out / (args.tag + '.json')} and {out / (args.tag + '.md')}")
    _write_comparison(args, rows, out)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
