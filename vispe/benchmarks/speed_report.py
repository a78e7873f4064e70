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
    ("model", "model", None),
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
            out.append(f"{v} [error]")
        elif fmt is None:
            out.append(str(v))
        else:
            out.append(_f(v, fmt))
    return out


def format_table(rows: list[dict[str, Any]]) -> str:
    head = [c[0] for c in _COLUMNS]
    body = [_cells(r) for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) if i >= 3 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def format_markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    head = [c[0] for c in _COLUMNS]
    lines = [
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" if i < 3 else "---:" for i in range(len(head))) + "|",
    ]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    errors = [f"- `{r['config']}/{r['mode']}/{r['model']}`: {r['error']}" for r in rows if r.get("error")]
    text = (
        f"Machine: {meta['machine']}; torch {meta['torch']}, timm {meta['timm']}, {meta['threads']} threads, device `{meta['device']}`.\n"
        f"Command: `{meta['command']}`; wall time {meta['wall_s']:.0f} s (process CPU {meta['process_cpu_s']:.0f} s)"
        f"{'' if meta['complete'] else ' -- INCOMPLETE (partial results)'}; load average start/end {meta['loadavg_start']} / {meta['loadavg_end']}.\n\n"
        + "\n".join(lines)
        + f"\n\nTimes are {'process CPU time' if meta['clock'] == 'cpu' else 'wall clock'} per step (median over rounds); "
        "`x` = median over rounds of (this model's time / the reference's time in the same round; the reference is timm's APE "
        "ViT, and vispe's `learned_3d` video ViT for `video_s16`), `x range` = lowest-highest of those per-round ratios; "
        "memory `x` = peak / the reference's peak; target = issue 8's time/memory limits (CPU eager). "
        f"Peak memory: {meta['memory_method']}.\n"
    )
    if errors:
        text += "\nErrors:\n" + "\n".join(errors) + "\n"
    return text


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
