"""Per-layer rotary tables: one layer's table taken by indexing the (depth, ...) table at each use (the code before
RotaryState.layers) against views made once per state (``unbind``; compiled, of the real view), on the rotation
alone: ``depth`` layers, each rotating its q and k twice (forward and the backward's recompute), then backward.

    PYTHONPATH=. python results/speed/cpu-rotary-layer-tables-2026-11-28.py OUT.json [DEPTH] [TOKENS] [ROUNDS]

ViT-S/16's heads at 224 px by default (6 heads, 32 pairs, 197 tokens, batch 2), depth 12, one thread; prints the
median step time per variant and the median per-round ratio to indexing, and writes them to OUT.json.
"""
import json
import platform
import statistics
import sys
import time

import torch

from vispe.encodings.rotary import _apply_rotary_real

out_path = sys.argv[1]
depth, tokens, rounds = (int(a) for a in (sys.argv[2:] + ["12", "197", "40"][len(sys.argv) - 2:])[:3])
torch.set_num_threads(1)
heads, pairs = 6, 32
gen = torch.Generator().manual_seed(0)
angles = torch.randn(depth, heads, tokens, pairs, generator=gen, requires_grad=True)
qs = [torch.randn(2, heads, tokens, 2 * pairs, generator=gen, requires_grad=True) for _ in range(depth)]


def complex_rotation(x, t):
    return torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (pairs, 2))) * t).flatten(-2)


def real_rotation(x, t):
    return _apply_rotary_real(x, t, "interleaved")


def variant(layers_of, rotate):
    def step(angles, *qs):
        table = torch.polar(torch.ones_like(angles), angles)
        layers = layers_of(table)
        out = 0
        for i, q in enumerate(qs):
            for _ in range(2):
                out = out + (rotate(q, layers(i)) * rotate(q.flip(-2), layers(i))).sum()
        return out
    return step


VARIANTS = {
    # eager: complex products; compiled: the real form of the same product on each use's real view
    ("eager", "indexed"): variant(lambda t: lambda i: t[i], complex_rotation),
    ("eager", "views"): variant(lambda t: t.unbind(0).__getitem__, complex_rotation),
    ("compile", "indexed"): torch.compile(variant(lambda t: lambda i: torch.view_as_real(t[i]), real_rotation), fullgraph=True),
    ("compile", "views"): torch.compile(variant(lambda t: torch.view_as_real(t).unbind(0).__getitem__, real_rotation), fullgraph=True),
}


def run(fn):
    fn(angles, *qs).backward()


for fn in VARIANTS.values():
    for _ in range(3):
        run(fn)
times = {k: [] for k in VARIANTS}
for _ in range(rounds):
    for k, fn in VARIANTS.items():
        t0 = time.perf_counter()
        for _ in range(5):
            run(fn)
        times[k].append((time.perf_counter() - t0) / 5 * 1e3)
rows = []
for mode in ("eager", "compile"):
    ratio = statistics.median(a / b for a, b in zip(times[(mode, "views")], times[(mode, "indexed")]))
    row = {"mode": mode, "indexed_ms": statistics.median(times[(mode, "indexed")]),
           "views_ms": statistics.median(times[(mode, "views")]), "views_over_indexed": ratio}
    rows.append(row)
    print(f"{mode:8s} indexed {row['indexed_ms']:7.2f} ms  views {row['views_ms']:7.2f} ms  ratio {ratio:.3f}")
json.dump({"depth": depth, "tokens": tokens, "heads": heads, "pairs": pairs, "batch": 2, "rounds": rounds,
           "machine": platform.processor() or platform.machine(), "torch": torch.__version__, "rows": rows,
           "times_ms": {f"{m}/{v}": ts for (m, v), ts in times.items()}}, open(out_path, "w"), indent=1)
