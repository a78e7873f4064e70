"""``vispe resolution-benchmark``: train a grid of 2D encodings with their recipes, then sweep 0.5x-2x the training size.

    VISPE_DATA_ROOT=/path/to/data vispe resolution-benchmark --grid cpu --out outputs/resbench
    vispe resolution-benchmark --grid tiny --out /tmp/resbench          # generated data, seconds

The grid is data (:mod:`vispe.benchmarks.grid`): a YAML file ``vispe/recipes/grids/resolution_<name>.yaml`` (``--grid
<name>``) or any file of that form, a list of parts; a part is a shipped training recipe (``vispe/recipes/<name>.yaml``:
data set, model size, schedule) with overrides, the encodings (a list, or every 2D encoding the registry lists) and
their seeds, and the sweep's training size and patch. Every run is :func:`vispe.runner.run` of the part's recipe with
the encoding, the seed and the overrides (``--jobs N``: N runner workers in a process pool); the sweep is
:func:`vispe.benchmarks.resolution_sweep.run_sweep` with both extrapolation policies where an encoding has them. Runs
whose wall time is in ``timings.json`` are skipped and a run killed mid-way resumes from its ``last.ckpt`` (killed runs
first, then seed by seed: every encoding's first seed comes early), so an interrupted benchmark resumes. The summary
groups the seeds of each (encoding, policy): mean +- standard deviation over seeds, and for a single seed the binomial
standard error of the test accuracy ``sqrt(p (1 - p) / n)`` (what a bootstrap over the test set estimates), marked as such.

Outputs under ``--out``: one folder per part with the runs, ``resolution/`` (the per-checkpoint sweep) and the
part's own ``summary.json`` / ``summary.png``; at the top, ``summary.json``, ``summary.md`` and ``summary.png``
(accuracy vs evaluation size with error bands, one panel per part); with ``--techniques`` also ``techniques.png``
(one panel per encoding, plain vs each technique) and, in the summary, each technique's difference from its
encoding's plain runs at 0.5x, the training size and 2x.

    vispe resolution-benchmark --grid cpu --parts fashion_mnist --techniques all --policies all   # + RPE-2D, DINOv3 aug

``--aspect-ratios 1:2,2:3,1:1,3:2,2:1`` also sweeps every run at those aspect ratios (width:height) at the training
grid's token budget (a second ``run_sweep`` into ``<part>/aspect/``) and adds an aspect-ratio table (``aspect_rows`` in
``summary.json``) and ``aspect.png``. ``--sweep-only`` trains nothing (existing checkpoints only); ``--aspect-only``
skips the size sweep. The ``cpu`` grid's ``fashion_mnist_mixed`` part is the ``fashion_mnist`` part trained on
mixed grids (one resolution per sample, NaFlex batches).

    vispe resolution-benchmark --grid cpu --parts fashion_mnist --sweep-only --aspect-only --aspect-ratios 1:2,1:1,2:1
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Collection, Sequence

from vispe._checks import Choice, Int
from vispe.benchmarks.grid import (POLICY_LINE_NOTE, POLICY_STYLES, Grid, Part, RunTask, accuracy_axes, add_recipe_arguments,
                                   benchmark_parser, figure_legend, load_grid, part_title, save_figure, train_runs)
from vispe.cli_options import Conflict, Option, Options, int_text, strings_text
from vispe.files import read_json, write_json_atomic
from vispe.runs import find_last_checkpoint

__all__ = ["CLAIMS", "OPTIONS", "claims", "main", "markdown_aspect", "plot_aspect", "plot_techniques", "run_task", "sizes",
           "summarise", "summarise_aspect", "technique_effects", "training_order"]


def sizes(part: Part) -> list[int]:
    """0.5x .. 2x the part's training size, in steps of about a quarter of it (multiples of the patch)."""
    train_size, patch = part.evaluate["train_size"], part.evaluate["patch"]
    step = patch * max(1, round(train_size / 4 / patch))
    lo = patch * math.ceil(train_size / 2 / patch)
    return list(range(lo, 2 * train_size + 1, step))


def run_task(grid: Grid, part: Part, run_encoding: str, seed: int, out: Path, data_dir: str | None, threads: int = 1,
             recipe: str | None = None, overrides: dict[str, Any] | None = None) -> RunTask:
    """One run of a part: its recipe (or ``recipe``) with the encoding, the seed, the run's folder
    (``<out>/<run encoding>-s<seed>/version_N``), the part's overrides, then ``overrides``; a run with a
    ``last.ckpt`` resumes from it, in its own version folder."""
    name = f"{run_encoding}-s{seed}"
    values: dict[str, Any] = {"model.init_args.pos_encoding": grid.pos_encoding(run_encoding),
                              "trainer.logger.init_args.save_dir": str(out), "trainer.logger.init_args.name": name,
                              "trainer.enable_progress_bar": False, "trainer.enable_model_summary": False}
    values.update(part.overrides)
    if data_dir is not None and part.needs_data:
        values["data.init_args.dataset.init_args.data_dir"] = str(Path(data_dir) / part.needs_data)
    values.update(overrides or {})
    values["threads"] = threads  # the recipe's own yields: the run's threads are the benchmark's
    last = find_last_checkpoint(out / name)
    if last is not None:  # resume into the folder the run was saved in
        values["trainer.logger.init_args.version"] = int(last.parent.parent.name.rpartition("_")[2]) \
            if last.parent.parent.name.startswith("version_") else None
    return RunTask(name=name, recipe=recipe or part.recipe, overrides=values, seed=seed,
                   ckpt_path=None if last is None else str(last), log=out / "logs" / f"{name}.log")


def training_order(runs: Sequence[tuple[str, int]], out: Path, timings: dict[str, Any]) -> list[tuple[str, int]]:
    """The runs still to train, in the order to train them.

    A run killed mid-way (``last.ckpt`` but no recorded time) resumes first; then seed by seed, so that an interrupted
    benchmark has every encoding's first seed before any encoding's third. The order changes no result: each run is
    seeded and deterministic on its own.
    """
    todo = [(i, (e, s)) for i, (e, s) in enumerate(runs) if f"{e}-s{s}" not in timings]
    def key(item: tuple[int, tuple[str, int]]) -> tuple[bool, int, int]:
        i, (enc, seed) = item
        return (find_last_checkpoint(out / f"{enc}-s{seed}") is None, seed, i)
    return [run for _, run in sorted(todo, key=key)]


def record_timing(path: Path, name: str, seconds: float) -> dict[str, Any]:
    """Add one run's wall time to ``timings.json`` and return the file's timings.

    Several calls may train runs of one part at once (``--seeds`` / ``--encodings`` queues, each its own process), so
    the file is re-read and merged under an exclusive lock instead of being overwritten from this process's memory
    (which would drop a run another call finished meanwhile); the write goes through a rename, so a killed call
    never leaves half a file."""
    lock_path = path.with_name(path.name + ".lock")
    with open(lock_path, "a") as lock:
        try:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)
        except ImportError:  # no POSIX locks (Windows): merge without one
            pass
        timings = read_json(path, "benchmark cache") if path.is_file() else {}
        timings[name] = round(seconds, 1)
        write_json_atomic(path, timings)  # one writer at a time under the lock, so its one temporary name is safe
    return timings


def train_part(grid: Grid, part: Part, out: Path, jobs: int, threads: int, data_dir: str | None, log,
               recipe: str | None = None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train the part's runs through the runner (``jobs`` runner workers at a time), skipping finished ones; returns
    wall times."""
    timings_path = out / "timings.json"
    timings = read_json(timings_path, "benchmark cache") if timings_path.is_file() else {}
    # ``last.ckpt`` is rewritten every epoch, so it does not mean "finished": a run is finished once its
    # wall time is recorded. A killed run has a ``last.ckpt`` but no timing and resumes from it.
    tasks = [run_task(grid, part, enc, seed, out, data_dir, threads, recipe, overrides)
             for enc, seed in training_order(part.runs(), out, timings)]

    def done(task: RunTask, seconds: float, _: Any) -> None:
        nonlocal timings
        timings = record_timing(timings_path, task.name, seconds)

    train_runs(tasks, jobs=jobs, threads=threads, done=done, log=lambda msg: log(f"{part.name}: {msg}"))
    return timings


def _trained_checkpoint(run_dir: Path) -> Path:
    found = find_last_checkpoint(run_dir)
    if found is None:
        raise FileNotFoundError(f"no last.ckpt under {run_dir}: the run did not train (see its log under logs/)")
    return found


def _int_sizes(row: dict[str, Any]) -> dict[str, Any]:
    """A summary row read back from JSON (size keys are strings there) with integer size keys again."""
    return {**row, "mean": {int(k): v for k, v in row["mean"].items()}, "spread": {int(k): v for k, v in row["spread"].items()}}


def _run_folder(checkpoint: str) -> str:
    """``<out>/<part>/<run encoding>-s<seed>/[version_N/]checkpoints/last.ckpt`` -> ``<run encoding>-s<seed>``."""
    folder = Path(checkpoint).parent.parent
    return folder.parent.name if folder.name.startswith("version_") else folder.name


def _group_runs(sweep: dict[str, Any], techniques: Collection[str]) -> list[tuple[tuple[str, str, str], list[dict[str, Any]]]]:
    """The sweep's per-checkpoint rows grouped by (encoding, technique, policy): the seeds of one table row
    (``techniques``: the grid's technique names, the suffix of a technique run's folder)."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in sweep["results"]:
        encoding, _, technique = _run_folder(r["checkpoint"]).rsplit("-s", 1)[0].rpartition("+")
        technique = technique if encoding and technique in techniques else None
        groups.setdefault((r["encoding"], technique or "", r["extrapolation"]), []).append(r)
    return sorted(groups.items())


def _mean_spread(vals: list[float], num_samples: int) -> tuple[float, float]:
    """Mean over seeds and its spread: the std over seeds, or for one seed the binomial s.e. of its accuracy."""
    if len(vals) > 1:
        return statistics.fmean(vals), statistics.stdev(vals)
    p = vals[0] / 100.0
    return vals[0], 100.0 * math.sqrt(max(p * (1 - p), 0.0) / num_samples)


def _row(part: Part, key: tuple[str, str, str], rs: list[dict[str, Any]]) -> dict[str, Any]:
    enc, technique, policy = key
    return {"part": part.name, "encoding": enc, "technique": technique or None, "extrapolation": policy, "seeds": len(rs),
            "train_size": part.evaluate["train_size"], "num_samples": rs[0]["num_samples"], "mean": {}, "spread": {},
            "spread_kind": "std over seeds" if len(rs) > 1 else "binomial s.e. (1 seed)"}


def summarise(sweep: dict[str, Any], part: Part, techniques: Collection[str] = ()) -> list[dict[str, Any]]:
    """Group the sweep's per-checkpoint rows by (encoding, technique, policy): mean and spread per size over seeds."""
    rows = []
    for key, rs in _group_runs(sweep, techniques):
        row = _row(part, key, rs)
        for s in sorted({int(s) for r in rs for s in r["accuracy"]}):
            row["mean"][s], row["spread"][s] = _mean_spread([r["accuracy"][str(s)]["top1"] for r in rs], rs[0]["num_samples"])
        rows.append(row)
    return rows


def summarise_aspect(sweep: dict[str, Any], part: Part, techniques: Collection[str] = ()) -> list[dict[str, Any]]:
    """The aspect-ratio sweep grouped like :func:`summarise`: per (encoding, technique, policy), mean and spread over
    seeds of the top-1 at each aspect ratio (keyed by its ``w:h`` label), with the evaluated shape and token count."""
    rows = []
    for key, rs in _group_runs(sweep, techniques):
        points = {e["aspect_label"]: e for e in rs[0]["evaluations"] if e["sweep"] == "aspect"}
        row = _row(part, key, rs)
        row["aspects"] = [{"label": k, "aspect": e["aspect"], "shape": e["shape"], "tokens": e["tokens"]}
                          for k, e in sorted(points.items(), key=lambda kv: kv[1]["aspect"])]
        for label in points:
            vals = [next(e["top1"] for e in r["evaluations"] if e["sweep"] == "aspect" and e["aspect_label"] == label) for r in rs]
            row["mean"][label], row["spread"][label] = _mean_spread(vals, rs[0]["num_samples"])
        rows.append(row)
    return rows


def markdown_aspect(rows: list[dict[str, Any]]) -> str:
    """One table per part: top-1 by aspect ratio at the training grid's token budget, mean ± spread over seeds."""
    out = []
    for part in dict.fromkeys(r["part"] for r in rows):
        pr = [r for r in rows if r["part"] == part]
        cols = list(dict.fromkeys((a["label"], a["shape"], a["tokens"], a["aspect"]) for r in pr for a in r["aspects"]))
        cols.sort(key=lambda c: c[3])
        train = pr[0]["train_size"]
        out.append(f"\n### {part}: aspect ratio width:height at the training token budget (train {train}x{train} px; "
                   f"top-1 %, mean ± spread)\n")
        out.append("| encoding (policy) | seeds | " + " | ".join(
            f"{lab} {shape} ({tok} tok){'*' if shape == f'{train}x{train}' else ''}" for lab, shape, tok, _ in cols) + " |")
        out.append("|---|---:|" + "---:|" * len(cols))
        for r in pr:
            cells = [f"{r['mean'][c[0]]:.1f} ± {r['spread'][c[0]]:.1f}" if c[0] in r["mean"] else "-" for c in cols]
            out.append(f"| {_label(r)} | {r['seeds']} | " + " | ".join(cells) + " |")
    out.append("\nShapes are H x W (the patch grid closest to the ratio and to the training grid's tokens); the whole image "
               "is resized to each shape (bicubic, antialiased). Spread as above.")
    return "\n".join(out) + "\n"


def plot_aspect(rows: list[dict[str, Any]], path: Path, policies: Sequence[str] = ("extend", "interpolate")) -> None:
    """One panel per part: top-1 vs aspect ratio (log scale; ticks ``w:h`` and the evaluated ``H x W``), bands = spread;
    colour = encoding, line style = policy as in :func:`plot`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if _shown(r, policies)]
    parts = list(dict.fromkeys(r["part"] for r in rows))
    if not parts:
        return
    # one y scale and one colour per encoding across the panels: a part trained on mixed grids reads against the plain one
    fig, axes = plt.subplots(1, len(parts), figsize=(6.5 * len(parts), 4.8), squeeze=False, sharey=True)
    colour_of = _encoding_colours(rows)
    for ax, part in zip(axes[0], parts):
        part_rows = [r for r in rows if r["part"] == part]
        ticks = {}
        for r in part_rows:
            for a in r["aspects"]:
                ticks[math.log2(a["aspect"])] = f"{a['label']}\n{a['shape']}"
            points = [(math.log2(a["aspect"]), a["label"]) for a in r["aspects"] if a["label"] in r["mean"]]
            _draw(ax, r, colour_of[(r["encoding"], r.get("technique"))], _label(r), alpha=0.15, points=points)
        ax.axvline(0.0, color="grey", ls=":", lw=1)
        ax.set_xticks(sorted(ticks))
        ax.set_xticklabels([ticks[x] for x in sorted(ticks)], fontsize=7)
        ax.minorticks_off()
        ax.set(title=part_title(part), xlabel="aspect ratio width:height at the training token budget (evaluated H x W)")
        accuracy_axes(ax)
    legend = figure_legend(fig, axes[0], POLICY_LINE_NOTE.replace("training size", "training shape (1:1)") + _BAND_NOTE)
    fig.tight_layout(rect=(0, legend, 1, 1))
    save_figure(fig, path)


def _default_policy(encoding: str) -> str | None:
    """The extrapolation policy an encoding uses unless told otherwise, under its listed name (``None``: it declares
    no policy): the declared resolution contract's default."""
    from vispe.encodings import get_encoding_class
    from vispe.encodings.spec import parse_pos_encoding

    contract = get_encoding_class(parse_pos_encoding(encoding)[0]).resolution
    return contract.name_of(contract.default) if contract.policies else None


def _native_row(rows: list[dict[str, Any]], part: str, encoding: str) -> dict[str, Any] | None:
    policy = _default_policy(encoding)
    for r in rows:
        if (r["part"] == part and r["encoding"] == encoding and r.get("technique") is None
                and (policy is None or r["extrapolation"] == policy)):
            return r
    return None


def _compare(a: dict[str, Any], sa: int, b: dict[str, Any], sb: int) -> tuple[float, float]:
    """``mean_a(sa) - mean_b(sb)`` and its standard error (seed std / sqrt(seeds), or the binomial s.e.)."""
    def se(r: dict[str, Any], s: int) -> float:
        return r["spread"][s] / math.sqrt(r["seeds"]) if r["seeds"] > 1 else r["spread"][s]

    return a["mean"][sa] - b["mean"][sb], math.sqrt(se(a, sa) ** 2 + se(b, sb) ** 2)


def _verdict(diff: float, err: float) -> str:
    if diff > 2 * err:
        return "holds"
    if diff < -2 * err:
        return "does not hold"
    return "not resolved (|difference| < 2 s.e.)"


#: The published claims the benchmark checks, each against the encodings' default extrapolation policies.
CLAIMS = (
    ("RoPE-Mixed keeps more accuracy than APE (learned) at 2x the training size (RoPE-ViT)", "rope_mixed", "learned", "2x"),
    ("ComRoPE-AP keeps more accuracy than APE (learned) at 2x the training size (ComRoPE)", "comrope_ap", "learned", "2x"),
    ("ComRoPE-LD keeps more accuracy than APE (learned) at 2x the training size (ComRoPE)", "comrope_ld", "learned", "2x"),
    ("RoPE-Mixed improves slightly above the training size (RoPE-ViT)", "rope_mixed", "rope_mixed", "above"),
)


def claims(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each claim of :data:`CLAIMS` on each part's table: the figures, the difference, its s.e. and a verdict."""
    out = []
    for part in dict.fromkeys(r["part"] for r in rows):
        for text, enc, ref, where in CLAIMS:
            a, b = _native_row(rows, part, enc), _native_row(rows, part, ref)
            if a is None or b is None:
                continue
            train = a["train_size"]
            if where == "2x":
                sa = sb = 2 * train
            else:  # the first evaluation size above the training size vs the training size
                sa, sb = min(s for s in a["mean"] if s > train), train
            if sa not in a["mean"] or sb not in b["mean"]:
                continue
            diff, err = _compare(a, sa, b, sb)
            out.append({"part": part, "claim": text, "encoding": f"{enc} @ {sa}px", "reference": f"{ref} @ {sb}px",
                        "value": a["mean"][sa], "reference_value": b["mean"][sb], "difference": diff, "se": err,
                        "verdict": _verdict(diff, err)})
    return out


def technique_effects(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each technique row against its encoding's plain row under the same policy, at 0.5x, the training size and 2x:
    the difference of the means, its s.e. and a verdict at 2 s.e."""
    out = []
    for r in rows:
        if not r.get("technique"):
            continue
        base = next((b for b in rows if b["part"] == r["part"] and b["encoding"] == r["encoding"] and b.get("technique") is None
                     and b["extrapolation"] == r["extrapolation"]), None)
        if base is None:
            continue
        train = r["train_size"]
        at = {}
        for name, size in (("0.5x", min(r["mean"], key=int)), ("train", train), ("2x", 2 * train)):
            size = int(size)
            if size not in r["mean"] or size not in base["mean"]:
                continue
            diff, err = _compare(r, size, base, size)
            at[name] = {"size": size, "value": r["mean"][size], "base": base["mean"][size], "difference": diff, "se": err,
                        "verdict": "helps" if diff > 2 * err else "hurts" if diff < -2 * err else "not resolved"}
        out.append({"part": r["part"], "encoding": r["encoding"], "technique": r["technique"],
                    "extrapolation": r["extrapolation"], "effects": at})
    return out


def _label(row: dict[str, Any]) -> str:
    own = row["extrapolation"].startswith("own")
    name = row["encoding"] + (f" + {row['technique']}" if row.get("technique") else "")
    return name if own else f"{name} ({row['extrapolation']})"


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    out = []
    for part in dict.fromkeys(r["part"] for r in rows):
        pr = [r for r in rows if r["part"] == part]
        sizes = sorted({s for r in pr for s in r["mean"]})
        train = pr[0]["train_size"]
        out.append(f"### {part} (train {train} px; top-1 %, mean ± spread)\n")
        out.append("| encoding (policy) | seeds | " + " | ".join(f"{s}{'*' if s == train else ''}" for s in sizes) + " |")
        out.append("|---|---:|" + "---:|" * len(sizes))
        for r in pr:
            cells = [f"{r['mean'][s]:.1f} ± {r['spread'][s]:.1f}" if s in r["mean"] else "-" for s in sizes]
            out.append(f"| {_label(r)} | {r['seeds']} | " + " | ".join(cells) + " |")
        out.append("")
    out.append(f"Spread: std over seeds where seeds > 1, else the binomial standard error of one run. "
               f"Grid `{meta.get('grid', meta.get('recipe'))}`; wall time {meta['wall_s']:.0f} s; {meta['machine']}.")
    for name, m in meta.get("earlier_parts", {}).items():
        out.append(f"Part `{name}`: from an earlier call (`vispe resolution-benchmark {' '.join(m['argv'])}`, "
                   f"wall time {m['wall_s']:.0f} s; {m['machine']}).")
    effects = technique_effects(rows)
    if effects:
        out.append("\n### Techniques against their encoding's plain runs (same policy; difference ± s.e., verdict at 2 s.e.)\n")
        out.append("| part | encoding + technique (policy) | 0.5x | train size | 2x |")
        out.append("|---|---|---:|---:|---:|")
        for e in effects:
            cells = [f"{e['effects'][k]['difference']:+.1f} ± {e['effects'][k]['se']:.1f} ({e['effects'][k]['verdict']})"
                     if k in e["effects"] else "-" for k in ("0.5x", "train", "2x")]
            out.append(f"| {e['part']} | {e['encoding']} + {e['technique']} ({e['extrapolation']}) | " + " | ".join(cells) + " |")
    checked = claims(rows)
    if checked:
        out.append("\n### Paper claims on these tables (default extrapolation policies; verdict at 2 s.e. of the difference)\n")
        out.append("| part | claim | figures | difference ± s.e. | verdict |")
        out.append("|---|---|---|---:|---|")
        for c in checked:
            out.append(f"| {c['part']} | {c['claim']} | {c['encoding']}: {c['value']:.1f} vs {c['reference']}: {c['reference_value']:.1f} "
                       f"| {c['difference']:+.1f} ± {c['se']:.1f} | {c['verdict']} |")
    return "\n".join(out) + "\n"




_BAND_NOTE = ";\nband: spread over seeds (1 s.d.; one seed: binomial s.e.)"


def _shown(row: dict[str, Any], policies: Sequence[str]) -> bool:
    """Whether a plot draws this row: encodings without policies always, the others under ``policies``."""
    return row["extrapolation"].startswith("own") or row["extrapolation"] in policies


def _encoding_colours(rows: list[dict[str, Any]]) -> dict[tuple[str, str | None], Any]:
    """One colour per (encoding, technique) over all ``rows``, so every panel of a figure uses the same one:
    ten distinct hues first, then their light shades (more than ten encodings)."""
    import matplotlib.pyplot as plt

    tab20 = plt.get_cmap("tab20").colors
    colours = tab20[0::2] + tab20[1::2]
    keys = dict.fromkeys((r["encoding"], r.get("technique")) for r in rows)
    return {k: colours[i % len(colours)] for i, k in enumerate(keys)}


def _draw(ax: Any, row: dict[str, Any], colour: Any, label: str, alpha: float,
          points: Sequence[tuple[float, Any]] | None = None) -> None:
    """One summary row as accuracy vs ``points`` (``(x, key into row["mean"])``; default: the evaluation sizes), its
    spread as a band, in the policy's line style."""
    if points is None:  # size keys are strings once read back from summary.json
        points = [(int(s), s) for s in sorted(row["mean"], key=int)]
    xs = [x for x, _ in points]
    m, e = [row["mean"][k] for _, k in points], [row["spread"][k] for _, k in points]
    ax.plot(xs, m, marker="o", ms=3, color=colour, ls=POLICY_STYLES.get(row["extrapolation"], "-"), label=label)
    ax.fill_between(xs, [a - b for a, b in zip(m, e)], [a + b for a, b in zip(m, e)], color=colour, alpha=alpha)


def plot(rows: list[dict[str, Any]], path: Path, policies: Sequence[str] = ("extend", "interpolate")) -> None:
    """One panel per part: accuracy vs evaluation size of the plain runs, bands = spread; one colour per encoding,
    the policy as line style (every policy's rows stay in ``summary.md``).
    Technique runs are left to :func:`plot_techniques`, which sets them against their plain runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if not r.get("technique") and _shown(r, policies)]
    parts = list(dict.fromkeys(r["part"] for r in rows))
    if not parts:  # an --aspect-only call with no earlier size table
        return
    fig, axes = plt.subplots(1, len(parts), figsize=(6.5 * len(parts), 4.5), squeeze=False)
    colour_of = _encoding_colours(rows)  # the same colour in every panel: plain vs mixed grids read against each other
    for ax, part in zip(axes[0], parts):
        part_rows = [r for r in rows if r["part"] == part]
        for r in part_rows:
            _draw(ax, r, colour_of[(r["encoding"], None)], _label(r), alpha=0.15)
        ax.axvline(part_rows[0]["train_size"], color="grey", ls=":", lw=1)
        ax.set(title=part_title(part), xlabel="evaluation size (px)")
        accuracy_axes(ax)
    legend = figure_legend(fig, axes[0], POLICY_LINE_NOTE + _BAND_NOTE)
    fig.tight_layout(rect=(0, legend, 1, 1))
    save_figure(fig, path)


def plot_techniques(rows: list[dict[str, Any]], path: Path, policies: Sequence[str] = ("extend", "interpolate")) -> None:
    """One panel per (part, encoding) that has technique rows: accuracy vs evaluation size for the plain runs and each
    technique (colour), under each policy in ``policies`` (line style; encodings without policies: solid), with bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys((r["part"], r["encoding"]) for r in rows if r.get("technique")))
    if not keys:
        return
    techniques = [None, *dict.fromkeys(r["technique"] for r in rows if r.get("technique"))]
    colours = plt.get_cmap("tab10").colors
    fig, axes = plt.subplots(1, len(keys), figsize=(5.0 * len(keys), 4.2), squeeze=False)
    for ax, (part, enc) in zip(axes[0], keys):
        panel = [r for r in rows if r["part"] == part and r["encoding"] == enc and _shown(r, policies)]
        for r in panel:
            own = r["extrapolation"].startswith("own")
            _draw(ax, r, colours[techniques.index(r.get("technique")) % len(colours)],
                  (r.get("technique") or "plain") + ("" if own else f" ({r['extrapolation']})"), alpha=0.12)
        if panel:
            ax.axvline(panel[0]["train_size"], color="grey", ls=":", lw=1)
        ax.set(title=f"{enc} ({part_title(part)})", xlabel="evaluation size (px)")
        accuracy_axes(ax)
    legend = figure_legend(fig, axes[0], "colour: technique; " + POLICY_LINE_NOTE.replace("\n", " ") + _BAND_NOTE.replace("\n", " "))
    fig.tight_layout(rect=(0, legend, 1, 1))
    save_figure(fig, path)


def _ints_text(text: str) -> list[int]:
    """``"1,2"`` -> ``[1, 2]``."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError("integers separated by commas (e.g. 0 or 1,2)") from None
    if not values:
        raise ValueError("integers separated by commas (e.g. 0 or 1,2)")
    return values


def _aspect_text(text: str) -> list[tuple[float, str]]:
    from vispe.benchmarks.resolution_sweep import parse_aspect_ratios

    return parse_aspect_ratios(text)


#: ``vispe resolution-benchmark``'s options, declared once (vispe.cli_options): the grid and its selection, the runs, the sweep
OPTIONS = Options("vispe resolution-benchmark", [
    Option("grid", parse=str, default="cpu", help="the grid: a shipped name (vispe/recipes/grids/resolution_<name>.yaml: "
                                                  "tiny, cpu, gpu, cifar10_quick) or a grid YAML file"),
    Option("parts", parse=strings_text, help="comma-separated parts of the grid to run (default: all)"),
    Option("encodings", parse=strings_text, help="restrict to these encodings (comma-separated)"),
    Option("out", parse=str, default="outputs/resolution_benchmark", help="output folder"),
    Option("data_dir", parse=str, help="data root (default $VISPE_DATA_ROOT)"),
    Option("jobs", Int(1), int_text, default=1, help="training runs at a time (runner workers in a process pool)"),
    Option("threads", Int(1), int_text, default=1, help="torch threads per run"),
    Option("techniques", parse=strings_text,
           help="also train the grid's technique encodings with these training-time techniques, every seed "
                "(comma-separated, or 'all'; the grid's techniques)"),
    Option("policies", Choice(("both", "all")), str, default="both",
           help="evaluation policies of the sweep: extend + interpolate (default), or every one an encoding has "
                "(adds ntk / yarn for the rotary lattice encodings)"),
    Option("seeds", parse=_ints_text,
           help="only the runs with these seeds (comma-separated, e.g. 0 or 1,2); an encoding the part trains "
                "with one seed keeps its seed-0 run, so --seeds 1,2 trains only the multi-seed encodings"),
    Option("aspect_ratios", parse=_aspect_text,
           help="also sweep every run at these aspect ratios width:height (e.g. 1:2,2:3,1:1,3:2,2:1) at the training "
                "grid's token budget; adds an aspect-ratio table and aspect.png to the summary"),
    Option("aspect_only", switch=True, help="with --aspect-ratios: run only the aspect-ratio sweep (the part's size table "
                                            "from an earlier call into the same --out is kept in the summary)"),
    Option("sweep_only", switch=True,
           help="train nothing: sweep the part's runs that have a last.ckpt under --out (the others are listed and left out)"),
    Option("train_only", switch=True,
           help="train (or resume) the runs and stop: no sweep, no summary (a later --sweep-only call sweeps them; "
                "lets several training calls, e.g. one per seed, share the CPU before one sweep)"),
], conflicts=[Conflict("train_only", "sweep_only", "one trains without sweeping, the other sweeps without training"),
              Conflict("aspect_only", "aspect_ratios", "it sweeps only the aspect ratios given", kind="requires")])


def _select(grid: Grid, values: dict[str, Any], overrides: list[str]) -> list[Part]:
    """The grid's parts after --parts, --encodings, --techniques and --seeds (each refused naming the valid choices)."""
    from vispe.runner import parse_overrides

    parse_overrides(overrides)  # a bad --set: one line, before anything trains
    parts = list(grid.parts)
    if values["parts"]:
        names = [pt.name for pt in parts]
        bad = [w for w in values["parts"] if w not in names]
        if bad:
            raise ValueError(f"unknown part(s) {bad}; grid {grid.name!r} has {names}")
        parts = [pt for pt in parts if pt.name in values["parts"]]
    if values["encodings"]:
        from vispe.encodings import get_encoding_class

        for e in values["encodings"]:
            get_encoding_class(e)  # unknown names fail here, naming the valid ones
        parts = [pt.replace(encodings=tuple(e for e in pt.encodings if e in values["encodings"])) for pt in parts]
    if values["techniques"]:
        techniques = list(grid.techniques) if values["techniques"] == ["all"] else values["techniques"]
        bad = [t for t in techniques if t not in grid.techniques]
        if bad:
            raise ValueError(f"unknown technique(s) {bad}; grid {grid.name!r} has {list(grid.techniques)} or 'all'")
        parts = [pt.replace(techniques=tuple(techniques)) for pt in parts]
    if values["seeds"]:
        # a filter on the part's runs, not new seeds: `--seeds 1` trains seed 1 of the encodings that have it and
        # leaves the one-seed encodings (their run is seed 0) alone
        parts = [pt.replace(only_seeds=tuple(sorted(set(values["seeds"])))) for pt in parts]
        if not any(pt.runs() for pt in parts):
            have = sorted({v for pt in parts for v in pt.seeds})
            raise ValueError(f"--seeds {values['seeds']}: no run has these seeds (the parts' seeds: {have})")
    return parts


def main(argv: Sequence[str] | None = None) -> int:
    parser = benchmark_parser("vispe resolution-benchmark", __doc__, "raw")
    OPTIONS.add_to(parser, {"grid": ["grid", "parts", "encodings", "techniques", "seeds"]})
    add_recipe_arguments(parser, None, "--set trainer.max_epochs=2 (every part; default: each part's own recipe)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        values = OPTIONS.from_namespace(args)
        if args.recipe is not None:
            from vispe.recipes import recipe_path

            recipe_path(args.recipe)  # a training recipe; a grid name here is refused naming the shipped recipes
        grid = load_grid(values["grid"], "resolution")
        parts = _select(grid, values, args.overrides)
    except ValueError as err:
        print(f"vispe resolution-benchmark: {err}", file=sys.stderr)
        return 2
    from vispe.benchmarks.resolution_sweep import run_sweep
    from vispe.benchmarks.speed import _machine
    from vispe.runner import parse_overrides

    import torch

    overrides = parse_overrides(args.overrides)
    data_dir = values["data_dir"] or os.environ.get("VISPE_DATA_ROOT")
    for pt in parts:
        if pt.needs_data and not (data_dir and (Path(data_dir) / pt.needs_data).exists()):
            print(f"vispe resolution-benchmark: part {pt.name!r} needs {pt.needs_data!r} under --data-dir or $VISPE_DATA_ROOT "
                  f"(got {data_dir!r})", file=sys.stderr)
            return 2
    threads, jobs, policies, aspect_ratios = values["threads"], values["jobs"], values["policies"], values["aspect_ratios"]
    torch.set_num_threads(threads)
    out = Path(values["out"])
    t_start = time.perf_counter()
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    machine = _machine(torch.device("cpu"))
    techniques = tuple(grid.techniques)
    rows, aspect_rows, timings = [], [], {}
    for pt in parts:
        part_out = out / pt.name
        part_out.mkdir(parents=True, exist_ok=True)
        t_part = time.perf_counter()
        if values["sweep_only"]:
            runs = [(e, s) for e, s in pt.runs() if find_last_checkpoint(part_out / f"{e}-s{s}") is not None]
            missing = [f"{e}-s{s}" for e, s in pt.runs() if (e, s) not in runs]
            if missing:
                log(f"{pt.name}: --sweep-only: no last.ckpt for {', '.join(missing)}; left out")
            if not runs:
                print(f"vispe resolution-benchmark: --sweep-only: part {pt.name!r} has no trained run under {part_out}", file=sys.stderr)
                return 2
            tpath = part_out / "timings.json"
            timings[pt.name] = read_json(tpath, "benchmark cache") if tpath.is_file() else {}
        else:
            timings[pt.name] = train_part(grid, pt, part_out, jobs, threads, data_dir, log, args.recipe, overrides)
            runs = pt.runs()
            if values["train_only"]:
                log(f"{pt.name}: --train-only: {len(runs)} run(s) trained under {part_out}; sweep them with --sweep-only")
                continue
        ckpts = [str(_trained_checkpoint(part_out / f"{e}-s{s}")) for e, s in runs]
        labels = [f"{e}-s{s}" for e, s in runs]
        part_data = str(Path(data_dir) / pt.needs_data) if pt.needs_data else None
        eval_subset = pt.evaluate.get("eval_subset")
        if values["aspect_only"]:  # keep the size rows an earlier call wrote for this part
            earlier_part = part_out / "summary.json"
            part_rows = [_int_sizes(r) for r in read_json(earlier_part, "benchmark cache")["rows"]] if earlier_part.is_file() else []
        else:
            sweep = run_sweep(ckpts, sizes(pt), policies, part_out / "resolution", labels=labels,
                              eval_subset=eval_subset, data_dir=part_data)
            part_rows = summarise(sweep, pt, techniques)
        rows += part_rows
        part_aspect: list[dict[str, Any]] = []
        if aspect_ratios:  # a sweep of its own (its cache apart from the size sweep's), at the training grid's token budget
            aspect = run_sweep(ckpts, [], policies, part_out / "aspect", labels=labels, eval_subset=eval_subset,
                               data_dir=part_data, aspect_ratios=aspect_ratios)
            part_aspect = summarise_aspect(aspect, pt, techniques)
            aspect_rows += part_aspect
        part_meta = {"grid": grid.name, "part": pt.name, "argv": list(argv) if argv is not None else sys.argv[1:],
                     "policies": policies, "wall_s": time.perf_counter() - t_part, "machine": machine,
                     "threads": threads, "jobs": jobs, "torch": torch.__version__,
                     "train_seconds": timings[pt.name], "config": dict(pt.__dict__)}
        write_json_atomic(part_out / "summary.json", {"meta": part_meta, "rows": part_rows, "aspect_rows": part_aspect})
        plot(part_rows, part_out / "summary.png")
        if part_aspect:
            plot_aspect(part_aspect, part_out / "aspect.png")
    if values["train_only"]:
        return 0
    # parts of the grid run by an earlier call into the same --out keep their rows (each with its own meta),
    # so a long part run on its own joins the table without re-running the others
    run_now = {pt.name for pt in parts}
    earlier = {}
    for pt in grid.parts:
        f = out / pt.name / "summary.json"
        if pt.name not in run_now and f.is_file():
            earlier[pt.name] = read_json(f, "benchmark cache")
            rows += [_int_sizes(r) for r in earlier[pt.name]["rows"]]
            aspect_rows += earlier[pt.name].get("aspect_rows", [])
    order = [pt.name for pt in grid.parts]
    rows.sort(key=lambda r: order.index(r["part"]) if r["part"] in order else len(order))  # stable: keeps each part's order
    aspect_rows.sort(key=lambda r: order.index(r["part"]) if r["part"] in order else len(order))
    meta = {"grid": grid.name, "wall_s": time.perf_counter() - t_start, "machine": machine,
            "threads": threads, "jobs": jobs, "torch": torch.__version__, "train_seconds": timings,
            "parts": [dict(pt.__dict__) for pt in parts],
            "earlier_parts": {name: e["meta"] for name, e in earlier.items()}}
    write_json_atomic(out / "summary.json", {"meta": meta, "rows": rows, "claims": claims(rows), "techniques": technique_effects(rows),
                                             "aspect_rows": aspect_rows})
    text = markdown(rows, meta) + (markdown_aspect(aspect_rows) if aspect_rows else "")
    (out / "summary.md").write_text(text)
    plot(rows, out / "summary.png")
    if aspect_rows:
        plot_aspect(aspect_rows, out / "aspect.png")
    if any(r.get("technique") for r in rows):
        plot_techniques(rows, out / "techniques.png")
    print(text)
    print(f"wrote {out / 'summary.json'}, summary.md, summary.png" + (", aspect.png" if aspect_rows else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
