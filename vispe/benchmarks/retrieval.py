"""``vispe retrieval``: text-video retrieval on the generated "where and when" set, one run per 3D encoding.

For each encoding a small CLIP-style model (video ViT with that encoding + open_clip text tower,
``ClipLoss``) trains with one recipe on the same generated clips, then is evaluated on the
validation clips at the training view and at more frames / a higher resolution. Writes
``results.json``, ``results.md`` and ``results.png`` to ``--out`` and prints the table.
Chance level (R@1 of a random ranking) is ``100 / num_val`` %.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from vispe.benchmarks import grid
from vispe.files import read_json

__all__ = ["main", "build_parser", "run_one", "run_benchmark", "format_table", "plot_results", "DEFAULT_ENCODINGS", "QUICK", "RECIPE", "run_task", "score_run"]

DEFAULT_ENCODINGS: tuple[str, ...] = ("rope_axial_3d", "rope_mixed_3d", "sincos3d", "learned_3d", "none")

#: the recipe (``vispe/recipes/retrieval.yaml``, the CPU recipe; see docs/video-retrieval.md)
RECIPE = "retrieval"
#: ``--quick``: a smoke run (few clips and steps; numbers are meaningless)
QUICK: dict[str, Any] = {"data.init_args.num_train": 64, "data.init_args.num_val": 32, "trainer.max_steps": 4, "model.init_args.warmup_steps": 1}
#: how the benchmark runs a recipe: no logger, checkpoints, progress bar or validation while training (scored after)
BENCHMARK_TRAINER: dict[str, Any] = {**grid.BENCHMARK_TRAINER, "trainer.enable_progress_bar": False, "trainer.limit_val_batches": 0,
                                     "trainer.deterministic": False}


def build_parser() -> argparse.ArgumentParser:
    p = grid.benchmark_parser(
        "vispe retrieval",
        "Text-video retrieval benchmark: one small video-text CLIP per 3D positional encoding, generated data. "
        "The recipe (clips, towers, schedule, evaluation views) is vispe/recipes/retrieval.yaml; change it with --set.")
    p.add_argument("--encodings", default=",".join(DEFAULT_ENCODINGS), help="comma-separated 3D encodings (vispe.list_encodings(grid_ndim=3))")
    p.add_argument("--out", default="outputs/retrieval", help="output folder for results.json/.md/.png")
    p.add_argument("--data-root", default=None, help="where generated clips are written (default $VISPE_DATA_ROOT/generated or the temp dir)")
    p.add_argument("--quick", action="store_true", help="tiny smoke run (few clips and steps; numbers are meaningless)")
    g = grid.add_recipe_arguments(p, RECIPE, "--recipe retrieval_smoke --set trainer.max_steps=400 "
                                  "--set data.init_args.eval_settings=[[16,64]] --set model.init_args.lr=3e-4")
    g.add_argument("--seed", type=int, default=0, help="data and initialisation seed (seed_everything and data.init_args.seed)")
    g.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave torch's default)")
    g.add_argument("--jobs", type=int, default=1, help="encodings trained at a time (runner workers in a process pool; "
                   "each run's output in --out/logs/)")
    return p


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The grid's fixed overrides: benchmark mode, --quick, the seed, --data-root, then the user's --set."""
    from vispe.runner import parse_overrides

    out: dict[str, Any] = {**BENCHMARK_TRAINER, "data.init_args.seed": args.seed}
    if args.quick:
        out.update(QUICK)
    if args.data_root is not None:
        out["data.init_args.root"] = args.data_root
    out.update(parse_overrides(args.overrides))
    return out


def run_task(name: str, args: argparse.Namespace) -> grid.RunTask:
    """One run of the grid: the recipe with the encoding ``name``, scored by :func:`score_run` where it trains."""
    return grid.RunTask(name=name, recipe=args.recipe, overrides={**_overrides(args), "model.init_args.pos_encoding": name},
                        seed=args.seed, log=Path(args.out) / "logs" / f"{name}.log", score=f"{__name__}:score_run")


def score_run(run: grid.RunTask, result: Any, started: tuple[float, float]) -> dict[str, Any]:
    """Every view's loader with the run's own Trainer; the encoding's row (recalls in %)."""
    from vispe.tasks.retrieval import view_name

    train_s = time.perf_counter() - started[0]
    result.evaluate("validate")
    wall_s = time.perf_counter() - started[0]
    task, views = result.model, result.datamodule.views
    row: dict[str, Any] = {
        "encoding": run.name,
        "kind": task.visual.pos_encoding.kind,
        "pe_params": sum(p.numel() for p in task.visual.pos_encoding.parameters()),
        "video_params": sum(p.numel() for p in task.visual.parameters()),
        "steps": int(result.trainer.global_step),
        "train_s": round(train_s, 1),
        "wall_s": round(wall_s, 1),
        "views": {},
    }
    for i, (t, s) in enumerate(views):
        key = "val" if i == 0 else f"val_{view_name(t, s)}"
        met = task.last_metrics.get(key, {})
        row["views"][view_name(t, s)] = {k: round(v, 2) for k, v in met.items()}
    return row


def run_one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train one encoding and evaluate it on every view, in this process; returns its row (recalls in %)."""
    return grid.train_one(run_task(name, args))


def format_table(rows: Sequence[dict[str, Any]], chance: float, ceiling: float | None = None) -> str:
    """Markdown: t2v/v2t recall at the training view, then t2v R@1 at every other view."""
    if not rows:
        return "(no results)"
    views = list(rows[0]["views"])
    train_view, others = views[0], views[1:]
    head = (
        "| PE | kind | t2v R@1 | t2v R@5 | t2v R@10 | t2v MdR | t2v MnR | v2t R@1 | v2t R@5 | v2t R@10 | v2t MdR | "
        + "".join(f"t2v R@1 {v} | " for v in others) + "train (s) |"
    )
    sep = "|---|---|" + "---:|" * (10 + len(others) + 1)
    note = f"Training view {train_view}; chance R@1 = {chance:.2f} % (R@5 = {5 * chance:.2f} %, R@10 = {10 * chance:.2f} %)."
    if ceiling is not None:
        note += f" Position-free ceiling R@1 = {ceiling:.2f} % (an ideal model that only knows which objects occur)."
    lines = [note, "", head, sep]
    for r in sorted(rows, key=lambda r: -r["views"][train_view].get("t2v_R@1", 0.0)):
        m = r["views"][train_view]
        cells = [f"{m.get(k, float('nan')):.1f}" for k in ("t2v_R@1", "t2v_R@5", "t2v_R@10", "t2v_MdR", "t2v_MnR", "v2t_R@1", "v2t_R@5", "v2t_R@10", "v2t_MdR")]
        cells += [f"{r['views'][v].get('t2v_R@1', float('nan')):.1f}" for v in others]
        lines.append(f"| {r['encoding']} | {r['kind']} | " + " | ".join(cells) + f" | {r['train_s']:.0f} |")
    return "\n".join(lines)


def plot_results(rows: Sequence[dict[str, Any]], path: str | Path, chance: float) -> Path:
    """Grouped bars: t2v R@1 per encoding at every evaluation view, chance as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    views = list(rows[0]["views"])
    rows = sorted(rows, key=lambda r: -r["views"][views[0]].get("t2v_R@1", 0.0))
    x = np.arange(len(rows))
    width = 0.8 / len(views)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(rows) + 2), 4.0))
    for i, v in enumerate(views):
        label = f"{v} (train)" if i == 0 else v
        ax.bar(x + (i - (len(views) - 1) / 2) * width, [r["views"][v].get("t2v_R@1", 0.0) for r in rows], width, label=label)
    ax.axhline(chance, color="black", linestyle="--", linewidth=1, label=f"chance {chance:.1f} %")
    ax.set_xticks(x, [r["encoding"] for r in rows], rotation=20, ha="right")
    ax.set_ylabel("text->video R@1 (%)")
    ax.set_title("Text-video retrieval on generated 'where and when' clips")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return grid.save_figure(fig, path)


def _recipe(args: argparse.Namespace) -> dict[str, Any]:
    overrides = {k: v for k, v in _overrides(args).items() if k not in BENCHMARK_TRAINER and k != "data.init_args.root"}
    return {"recipe": str(args.recipe), "overrides": overrides, "seed": args.seed, "threads": args.threads}


def run_benchmark(args: argparse.Namespace) -> tuple[list[dict[str, Any]], float, float, float]:
    import torch

    import vispe
    from vispe.data.video_text import position_free_r1
    from vispe.runner import build

    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.encodings.split(",") if n.strip()]
    valid = vispe.list_encodings(grid_ndim=3)
    bad = [n for n in names if n not in valid]
    if bad:
        raise ValueError(f"unknown or non-3D encoding(s) {bad}; choose from {valid}")
    dm = build(args.recipe, {**_overrides(args), "model.init_args.pos_encoding": names[0]}).datamodule
    t0 = time.perf_counter()
    dm.prepare_data()  # the clips, written once; every run of the grid reads them
    gen_s = time.perf_counter() - t0
    ceiling = position_free_r1(read_json(Path(dm._manifests()[1]), "manifest"))
    print(f"data: {dm.train_spec.num_videos} train / {dm.val_spec.num_videos} val clips under {dm.root} ({gen_s:.0f} s incl. generation)", flush=True)
    rows: dict[str, dict[str, Any]] = {}

    def done(task: grid.RunTask, seconds: float, row: dict[str, Any]) -> None:
        rows[task.name] = row
        m = row["views"][next(iter(row["views"]))]
        print(f"{task.name:>15}: t2v R@1 {m.get('t2v_R@1', float('nan')):5.1f}  v2t R@1 {m.get('v2t_R@1', float('nan')):5.1f}  "
              f"({row['wall_s']:.0f} s)", flush=True)

    grid.train_runs([run_task(name, args) for name in names], jobs=args.jobs, threads=args.threads or 1, done=done)
    return [rows[name] for name in names], dm.chance_r1, gen_s, ceiling


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        rows, chance, gen_s, ceiling = run_benchmark(args)
    except ValueError as err:
        print(f"vispe retrieval: {err}", file=sys.stderr)
        return 2
    total_s = time.perf_counter() - start
    table = format_table(rows, chance, ceiling)
    print("\n" + table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    recipe = _recipe(args)
    (out / "results.json").write_text(json.dumps(
        {"recipe": recipe, "chance_r1": chance, "position_free_r1": round(ceiling, 2), "data_s": round(gen_s, 1), "total_s": round(total_s, 1), "results": rows}, indent=2))
    (out / "results.md").write_text(
        f"# Text-video retrieval (generated 'where and when' clips)\n\nrecipe: `{json.dumps(recipe)}`\n\n{table}\n\n"
        f"total wall time {total_s:.0f} s (data {gen_s:.0f} s)\n"
    )
    plot_results(rows, out / "results.png", chance)
    print(f"\nwrote {out / 'results.json'}, results.md, results.png ({total_s:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
