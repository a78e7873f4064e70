"""Tables and machine description for ``vispe bench speed`` results."""
from __future__ import annotations

import os
import platform
from typing import Any

import torch

# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------


def _f(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


_COLUMNS = [
    ("config", "config", None),
    ("mode", "mode", None),
    ("prec", "precision", None),
    ("model", "model", None),
    ("px", "img_size", None),
    ("tokens", "tokens", None),
    ("train ms", "train_step_ms", ".1f"),
    ("train x", "train_ratio", ".3f"),
    ("train x range", "train_ratio_range", None),
    ("infer img/s", "infer_samples_per_sec", ".1f"),
    ("infer x", "infer_ratio", ".3f"),
    ("train MB", "train_peak_mb", ".0f"),
    ("mem x", "train_mem_ratio", ".3f"),
    ("infer MB", "infer_peak_mb", ".0f"),
    ("imem x", "infer_mem_ratio", ".3f"),
    ("target", "target", None),
]


#: How a model that the time budget left unmeasured is recorded in its row's ``error`` (it failed nothing).
SKIPPED_PREFIX = "skipped: "


def is_skipped(row: dict[str, Any]) -> bool:
    """Whether a row was left unmeasured by the time budget rather than failing."""
    return str(row.get("error") or "").startswith(SKIPPED_PREFIX)


def _cells(row: dict[str, Any]) -> list[str]:
    out = []
    for _, key, fmt in _COLUMNS:
        v = row.get(key)
        if key == "target":
            if v is None:
                out.append("-")
            else:
                missed = [w for w in ("time", "memory") if not v.get(f"{w}_met", v["met"])]
                out.append(f"met (<={v['time']}x)" if v["met"] else f"MISSED {'+'.join(missed)} (<={v['time']}x/{v['memory']}x)")
        elif key.endswith("_range"):
            out.append("-" if v is None else f"{v[0]:.2f}-{v[1]:.2f}")
        elif key == "model" and row.get("error"):
            out.append(f"{v} [{'skipped' if is_skipped(row) else 'error'}]")
        elif v is None:
            out.append("-")
        elif fmt is None:
            out.append(str(v))
        else:
            out.append(_f(v, fmt))
    return out


def format_table(rows: list[dict[str, Any]]) -> str:
    head = [c[0] for c in _COLUMNS]
    body = [_cells(r) for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) if i >= 4 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def format_markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    head = [c[0] for c in _COLUMNS]
    lines = [
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" if i < 4 else "---:" for i in range(len(head))) + "|",
    ]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    errors = [f"- `{r['config']}/{r['mode']}/{r['model']}`: {r['error']}" for r in rows if r.get("error") and not is_skipped(r)]
    skipped = [f"- `{r['config']}/{r['mode']}/{r['model']}`: {r['error']}" for r in rows if is_skipped(r)]
    text = (
        f"Machine: {meta['machine']}; torch {meta['torch']}, timm {meta['timm']}, {meta['threads']} threads, device `{meta['device']}`.\n"
        f"Command: `{meta['command']}`; wall time {meta['wall_s']:.0f} s (process CPU {meta['process_cpu_s']:.0f} s)"
        f"{'' if meta['complete'] else ' -- INCOMPLETE (partial results)'}; load average start/end {meta['loadavg_start']} / {meta['loadavg_end']}.\n\n"
        + "\n".join(lines)
        + f"\n\nTimes are {'process CPU time' if meta['clock'] == 'cpu' else 'wall clock'} per step (median over rounds); "
        "`x` = median over rounds of (this model's time / the reference's time in the same round; the reference is timm's APE "
        "ViT, and vispe's `learned_3d` video ViT for `video_s16`), `x range` = lowest-highest of those per-round ratios; "
        "memory `x` = peak / the reference's peak; target = the per-encoding time/memory limits at the model's own size (CPU eager). "
        f"Peak memory: {meta['memory_method']}.\n"
    )
    verdicts = growth_verdicts(rows)
    if verdicts:
        text += "\nTargets (ratios to timm's APE ViT of the same size, this run; vispe.benchmarks.speed_report.GROWTH_TARGETS):\n" + "\n".join(verdicts) + "\n"
    compiled = compile_lines(rows)
    if compiled:
        text += "\nCompilation (a compiled model should be one graph per step, compiled before timing):\n" + "\n".join(compiled) + "\n"
    profiled = profile_lines(rows)
    if profiled:
        text += ("\nWhere the time goes (one profiled train step per model, `--profile`): the step's summed self time beside "
                 "the reference's, then the ops that cost most beyond the reference's time in the same op:\n"
                 + "\n".join(profiled) + "\n")
    if errors:
        text += "\nErrors:\n" + "\n".join(errors) + "\n"
    if skipped:
        text += "\nNot measured (time budget):\n" + "\n".join(skipped) + "\n"
    return text


def compile_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One Markdown line per compiled model that broke its graph or compiled while timed: its times then include
    eager code between graphs, or compilation."""
    out = []
    for r in rows:
        where = f"`{r['config']}/{r['mode']}/{r['precision']}/{r['model']}`"
        if (r.get("graphs_per_step") or 0) > 1:
            out.append(f"- {where}: {r['graphs_per_step']} graphs per train step (graph breaks)")
        if r.get("compiles_in_timing"):
            out.append(f"- {where}: compiled {r['compiles_in_timing']} graph(s) while timed (its slowest rounds include compilation)")
    return out


def profile_lines(rows: list[dict[str, Any]], shown: int = 5) -> list[str]:
    """One Markdown line per profiled model (the reference's own line lists its costliest ops)."""
    out = []
    for r in rows:
        prof = r.get("profile")
        if not prof:
            continue
        if "error" in prof:
            out.append(f"- `{r['config']}/{r['mode']}/{r['precision']}/{r['model']}`: not profiled ({prof['error']})")
            continue
        head = f"- `{r['config']}/{r['mode']}/{r['precision']}/{r['model']}` ({prof['time']}): {prof['step_ms']:.1f} ms"
        if prof.get("ref_step_ms") is None:
            ops = ", ".join(f"`{o['op']}` {o['ms']:.2f}" for o in prof["top"][:shown])
            out.append(f"{head}; costliest ops (ms): {ops}")
        else:
            ops = ", ".join(f"`{o['op']}` +{o['extra_ms']:.2f}" for o in prof["extra"][:shown])
            out.append(f"{head} (reference {prof['ref_step_ms']:.1f} ms); most extra time (ms): {ops or 'none'}")
    return out


#: Cost targets, as ratios to timm's APE ViT of the same size in the same run (CPU):
#: - ``bias``: every attention bias at 197, 577 and 1,025 tokens trains within 1.15x time, eager and compiled, with
#:   peak memory within 1.05x eager and 1.10x compiled;
#: - ``bias_infer_mem``: at 3,137 tokens they infer within 1.10x memory;
#: - ``compile_224``: compiled at 224 px, every 2D encoding trains within 1.10x, except the learned rotations in
#:   ``rotation_224`` (``liere``: 2.0x eager and compiled).
GROWTH_TARGETS: dict[str, Any] = {
    "bias": {"tokens": (197, 577, 1025), "time": 1.15, "memory": {"eager": 1.05, "compile": 1.10}},
    "bias_infer_mem": (3137, 1.10),
    "compile_224": (224, 1.10),
    "rotation_224": {"liere": 2.0},
}


def growth_biases() -> list[str]:
    """The attention-bias encodings the targets judge: the registry's 2D bias encodings benchmarked by default."""
    from vispe.encodings import benchmark_encodings

    return benchmark_encodings(2, kind="bias")


def growth_verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """One line per target (:data:`GROWTH_TARGETS`) that this run's rows can judge: met / MISSED with the ratio."""
    out = []
    ok = [r for r in rows if not r.get("error") and r.get("family") == "vispe"]
    biases = set(growth_biases())

    def fmt(v: Any) -> str:
        return "-" if v is None else f"{v:.3f}x"

    def verdict(met: bool) -> str:
        return "met" if met else "MISSED"

    bias = GROWTH_TARGETS["bias"]
    for r in ok:
        if r["encoding"] in biases and r.get("tokens") in bias["tokens"] and r["mode"] in bias["memory"]:
            t, m, m_max = r.get("train_ratio"), r.get("train_mem_ratio"), bias["memory"][r["mode"]]
            met = t is not None and m is not None and t <= bias["time"] and m <= m_max
            out.append(f"- {r['model']} {r['mode']} train at {r['tokens']} tokens: time {fmt(t)} (<= {bias['time']}x), "
                       f"peak memory {fmt(m)} (<= {m_max}x): {verdict(met)}")
    tok, m_max = GROWTH_TARGETS["bias_infer_mem"]
    for r in ok:
        if r["mode"] == "eager" and r.get("tokens") == tok and r["encoding"] in biases:
            m = r.get("infer_mem_ratio")
            out.append(f"- {r['model']} inference at {tok} tokens: peak memory {fmt(m)} (<= {m_max}x): "
                       f"{verdict(m is not None and m <= m_max)}")
    px, t_max = GROWTH_TARGETS["compile_224"]
    rotation = GROWTH_TARGETS["rotation_224"]
    for r in ok:
        if r.get("img_size") != px or r.get("frames") or r["encoding"] in biases:
            continue
        limit = rotation.get(r["encoding"], t_max if r["mode"] == "compile" else None)
        if limit is None:
            continue
        t = r.get("train_ratio")
        out.append(f"- {r['model']} {r['mode']} train at {px} px: time {fmt(t)} (<= {limit}x): {verdict(t is not None and t <= limit)}")
    return out


def growth_comparison(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> str:
    """A Markdown before -> after table of two runs' vispe rows: one row per model, mode and precision; per token count
    the train time x and peak memory x (ratios to each run's own reference). A cell reads ``before -> after``, or
    ``- -> after`` where the earlier run has no such row (a new encoding, or one it did not measure)."""

    def usable(rows: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
        return {(r["model"], r["mode"], r.get("precision", "fp32"), r.get("tokens")): r
                for r in rows if r.get("family") == "vispe" and not r.get("error")}

    old, new = usable(before), usable(after)
    tokens = sorted({k[3] for k in new if k[3] is not None})
    lines = ["| encoding | mode | " + " | ".join(f"{t} tok time x" for t in tokens) + " | "
             + " | ".join(f"{t} tok mem x" for t in tokens) + " |",
             "|---|---|" + "---:|" * (2 * len(tokens))]

    def cell(key: tuple, field: str) -> str:
        a = new.get(key, {}).get(field)
        if a is None:
            return "-"
        b = old.get(key, {}).get(field)
        return f"{'-' if b is None else f'{b:.2f}'} → {a:.2f}"

    order = {m: n for n, m in enumerate(dict.fromkeys(k[0] for k in new))}  # the run's model order, eager first
    for model, mode, prec in sorted(dict.fromkeys(k[:3] for k in new), key=lambda k: (order[k[0]], k[1] != "eager", k[2])):
        label = model.split(":", 1)[-1] + ("" if prec == "fp32" else f" ({prec})")
        cells = [cell((model, mode, prec, t), "train_ratio") for t in tokens]
        cells += [cell((model, mode, prec, t), "train_mem_ratio") for t in tokens]
        lines.append(f"| `{label}` | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_growth(rows: list[dict[str, Any]], path: str, meta: dict[str, Any]) -> None:
    """Train time x and peak train memory x (vs the reference of the same size) against tokens: one line per
    encoding and mode (eager solid, compiled dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    series: dict[tuple[str, str], list[tuple[int, float | None, float | None]]] = {}
    for r in rows:
        if r.get("error") or r.get("tokens") is None or r["model"] == r.get("ratio_reference"):
            continue
        series.setdefault((r["model"], r["mode"]), []).append((r["tokens"], r.get("train_ratio"), r.get("train_mem_ratio")))
    labels = sorted({m for m, _ in series})
    colours = {m: plt.cm.tab20(i % 20) for i, m in enumerate(labels)}
    for (model, mode), pts in sorted(series.items()):
        pts.sort()
        for ax, k in zip(axes, (1, 2)):
            xs = [p[0] for p in pts if p[k] is not None]
            ys = [p[k] for p in pts if p[k] is not None]
            if xs:
                ax.plot(xs, ys, marker="o", ls="-" if mode == "eager" else "--", color=colours[model],
                        label=f"{model.split(':', 1)[-1]} ({mode})")
    for ax, title in zip(axes, ("train step time x", "peak train memory x")):
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("tokens per image (log)")
        ax.set_title(f"{title} vs the reference of the same size")
    axes[1].legend(fontsize=7, ncol=2)
    fig.suptitle(f"{meta['machine']}, torch {meta['torch']}, {meta['threads']} thread(s), {meta['clock']} clock", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for ln in fh:
                if ln.startswith("model name"):
                    cpu = ln.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{os.cpu_count()}-core CPU ({cpu})"
