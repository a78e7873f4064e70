"""``vispe niah``: video needle-in-a-haystack for the small video-LLM, one row per multimodal scheme.

For each position scheme a small video-LLM trains with one recipe on NIAH episodes with a
haystack of ``--train-frames`` frames (needle at a random depth), then is scored on haystacks of
every length in ``--eval-lengths`` (up to 16x the training length by default) at every depth in
``--depths``. Writes ``results.json``, ``results.md``, ``heatmaps.png`` (one row per scheme:
depth x length accuracy, training length marked) and ``accuracy_vs_length.png`` to ``--out``.

A scheme "extrapolates to k x" when its mean accuracy over depths stays within ``--keep`` (90 %)
of its training-length accuracy at every length up to k times the training length.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from vispe.benchmarks import grid
from vispe.positions import POSITION_SCHEMES, SCHEMES

__all__ = ["main", "build_parser", "run_one", "run_benchmark", "format_table", "plot_heatmaps", "plot_lines", "extrapolation_ratio",
           "DEFAULT_SCHEMES", "QUICK", "RECIPE", "run_task", "score_run"]

DEFAULT_SCHEMES: tuple[str, ...] = POSITION_SCHEMES
SCHEME_TITLES = {name: rec.label for name, rec in SCHEMES.items()}

#: the recipe (``vispe/recipes/niah.yaml``, the CPU recipe; see docs/video-retrieval.md)
RECIPE = "niah"
#: ``--quick``: a smoke run (numbers are meaningless)
QUICK: dict[str, Any] = {"trainer.max_steps": 3, "data.init_args.train_episodes": 96, "data.init_args.episodes_per_cell": 2,
                         "data.init_args.eval_lengths": [4, 16], "data.init_args.eval_depths": [0.0, 1.0], "model.init_args.warmup_steps": 1}
#: how the benchmark runs a recipe: no logger, checkpoints, progress bar or validation while training (scored after)
BENCHMARK_TRAINER: dict[str, Any] = {**grid.BENCHMARK_TRAINER, "trainer.enable_progress_bar": False, "trainer.limit_val_batches": 0}
KEEP = 0.9


def build_parser() -> argparse.ArgumentParser:
    p = grid.benchmark_parser(
        "vispe niah",
        "Video needle-in-a-haystack: train a small video-LLM per position scheme at one length, score lengths x depths. "
        "The recipe (episodes, model, schedule) is vispe/recipes/niah.yaml; change it with --set.")
    p.add_argument("--schemes", default=",".join(DEFAULT_SCHEMES), help="comma-separated multimodal schemes")
    p.add_argument("--out", default="outputs/niah", help="output folder")
    p.add_argument("--quick", action="store_true", help="tiny smoke run (numbers are meaningless)")
    g = grid.add_recipe_arguments(p, RECIPE, "--set trainer.max_steps=400 --set data.init_args.train_episodes=12800 "
                                  "--set model.init_args.dim=32 --set data.init_args.haystack_videos=[a.mp4,b.mp4]")
    g.add_argument("--seeds", default="0", help="comma-separated seeds; each scheme trains once per seed and the grids are averaged")
    g.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave torch's default)")
    g.add_argument("--jobs", type=int, default=1, help="runs trained at a time (runner workers in a process pool; "
                   "each run's output in --out/logs/)")
    s = p.add_argument_group("scoring")
    for name, rec in SCHEMES.items():  # each scheme's evaluation-time options, e.g. --hope-gamma, --v2pe-delta
        for opt, value in rec.eval_options.items():
            s.add_argument(f"--{name}-{opt}", type=type(value), default=value, help=f"{rec.label}'s {opt} at evaluation")
    s.add_argument("--keep", type=float, default=KEEP, help="fraction of training-length accuracy that counts as 'kept'")
    return p


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The grid's fixed overrides: benchmark mode, --quick, then the user's --set; the training length is always scored."""
    from vispe.runner import apply_overrides, load_recipe, parse_overrides

    out: dict[str, Any] = dict(BENCHMARK_TRAINER)
    if args.quick:
        out.update(QUICK)
    out.update(parse_overrides(args.overrides))
    data = apply_overrides(load_recipe(args.recipe), out)["data"]["init_args"]
    out["data.init_args.eval_lengths"] = sorted({int(n) for n in data["eval_lengths"]} | {int(data["train_frames"])})
    return out


def extrapolation_ratio(by_length: dict[int, float], train_frames: int, keep: float) -> float:
    """Largest ``L / train_frames`` such that every length up to ``L`` keeps ``keep`` x the training accuracy."""
    base = by_length[train_frames]
    ratio = 1.0
    for f in sorted(k for k in by_length if k > train_frames):
        if by_length[f] >= keep * base:
            ratio = f / train_frames
        else:
            break
    return ratio


def run_task(scheme: str, args: argparse.Namespace, seed: int = 0) -> grid.RunTask:
    """One run of the grid: the recipe with ``scheme`` and ``seed`` (model init and episodes both follow it), scored by
    :func:`score_run` where it trains."""
    from vispe.runner import apply_overrides, load_recipe

    overrides = _overrides(args)
    # the scheme's evaluation options, each settable as --<scheme>-<option> (e.g. --hope-gamma)
    pos_kwargs = {opt: getattr(args, f"{scheme}_{opt}") for opt in SCHEMES[scheme].eval_options}
    recipe_scheme = apply_overrides(load_recipe(args.recipe), overrides)["model"]["init_args"].get("pos_scheme") or {}
    pos_scheme = {**(recipe_scheme if isinstance(recipe_scheme, dict) else {}), "name": scheme}
    return grid.RunTask(name=f"{scheme}-s{seed}", recipe=args.recipe, seed=seed, log=Path(args.out) / "logs" / f"{scheme}-s{seed}.log",
                        overrides={**overrides, "model.init_args.pos_scheme": pos_scheme, "model.init_args.position_kwargs": pos_kwargs,
                                   "data.init_args.seed": seed},
                        score=f"{__name__}:score_run", context={"scheme": scheme, "position_kwargs": pos_kwargs})


def score_run(task: grid.RunTask, result: Any, started: tuple[float, float]) -> dict[str, Any]:
    """Every length x depth loader with the run's own Trainer; the run's accuracy grid."""
    train_s = time.perf_counter() - started[0]
    result.evaluate("validate")
    return {
        "scheme": task.context["scheme"],
        "seed": task.seed,
        "position_kwargs": task.context["position_kwargs"],
        "grid": result.model.last_grid,
        "steps": int(result.trainer.global_step),
        "train_s": round(train_s, 1),
        "wall_s": round(time.perf_counter() - started[0], 1),
        "train_frames": int(result.datamodule.train_frames),
        "tokens_per_frame": int(result.datamodule.tokens_per_frame),
    }


def run_one(scheme: str, args: argparse.Namespace, seed: int = 0) -> dict[str, Any]:
    """Train and score one scheme with one seed, in this process."""
    return grid.train_one(run_task(scheme, args, seed))


def merge_runs(runs: Sequence[dict[str, Any]], train_frames: int, keep: float, tokens_per_frame: int) -> dict[str, Any]:
    """Average the accuracy grids of one scheme's runs (one per seed) into its table row."""
    first = runs[0]
    lengths = sorted(first["grid"])
    grid = {f: {d: sum(r["grid"][f][d] for r in runs) / len(runs) for d in first["grid"][f]} for f in lengths}
    by_length = {f: sum(row.values()) / len(row) for f, row in grid.items()}
    per_seed = {str(r["seed"]): {str(f): round(sum(row.values()) / len(row), 2) for f, row in r["grid"].items()} for r in runs}
    return {
        "scheme": first["scheme"],
        "title": SCHEME_TITLES.get(first["scheme"], first["scheme"]),
        "position_kwargs": first["position_kwargs"],
        "seeds": [r["seed"] for r in runs],
        "grid": {str(f): {str(d): round(a, 2) for d, a in row.items()} for f, row in grid.items()},
        "by_length": {str(f): round(a, 2) for f, a in by_length.items()},
        "by_length_per_seed": per_seed,
        "tokens_by_length": {str(f): (f + 1) * tokens_per_frame + 1 + 6 for f in lengths},
        "mean": round(sum(by_length.values()) / len(by_length), 2),
        "extrapolation_ratio": extrapolation_ratio(by_length, train_frames, keep),
        "steps": first["steps"],
        "train_s": round(sum(r["train_s"] for r in runs) / len(runs), 1),
        "wall_s": round(sum(r["wall_s"] for r in runs), 1),
    }


def format_table(rows: Sequence[dict[str, Any]], train_frames: int, keep: float) -> str:
    if not rows:
        return "(no results)"
    lengths = list(rows[0]["by_length"])
    tokens = rows[0]["tokens_by_length"]
    head = "| scheme | " + " | ".join(f"{f} fr ({tokens[f]} tok){' (train)' if int(f) == train_frames else ''}" for f in lengths) + " | mean | kept up to | train (s) |"
    sep = "|---|" + "---:|" * (len(lengths) + 3)
    lines = [head, sep]
    for r in rows:
        cells = [f"{r['by_length'][f]:.1f}" for f in lengths]
        lines.append(f"| {r['title']} | " + " | ".join(cells) + f" | {r['mean']:.1f} | {r['extrapolation_ratio']:g}x | {r['train_s']:.0f} |")
    lines.append("")
    lines.append(
        f"Accuracy (%) averaged over needle depths and {len(rows[0].get('seeds', [0]))} seed(s); chance 25 %. "
        f"'kept up to': the longest haystack (as a multiple of the "
        f"{train_frames}-frame training haystack) up to which accuracy stays >= {keep:.0%} of the training-length accuracy."
    )
    return "\n".join(lines)


def plot_heatmaps(rows: Sequence[dict[str, Any]], path: str | Path, train_frames: int) -> Path:
    """One row per scheme: depth (y) x haystack frames (x) accuracy, training length outlined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lengths = list(rows[0]["grid"])
    depths = list(rows[0]["grid"][lengths[0]])
    fig, axes = plt.subplots(len(rows), 1, figsize=(1.0 * len(lengths) + 2.5, 1.25 * len(rows) * max(1, len(depths) / 4) + 0.8), squeeze=False)
    for ax, r in zip(axes[:, 0], rows):
        a = np.array([[r["grid"][f][d] for f in lengths] for d in depths])
        im = ax.imshow(a, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        for i in range(a.shape[0]):
            for j in range(a.shape[1]):
                ax.text(j, i, f"{a[i, j]:.0f}", ha="center", va="center", fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{float(d):g}" for d in depths], fontsize=7)
        ax.set_xticks(range(len(lengths)), lengths, fontsize=7)
        ax.set_ylabel(f"{r['title']}\ndepth", fontsize=8)
        if str(train_frames) in lengths:
            j = lengths.index(str(train_frames))
            ax.add_patch(plt.Rectangle((j - 0.5, -0.5), 1, len(depths), fill=False, edgecolor="black", linewidth=2))
    axes[-1, 0].set_xlabel("haystack frames (black box: training length)")
    fig.colorbar(im, ax=axes[:, 0].tolist(), shrink=0.6, label="accuracy (%)")
    fig.suptitle("Video NIAH accuracy", fontsize=10)
    return grid.save_figure(fig, path, bbox_inches="tight")


def plot_lines(rows: Sequence[dict[str, Any]], path: str | Path, train_frames: int) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        xs = [int(f) for f in r["by_length"]]
        ax.plot(xs, list(r["by_length"].values()), marker="o", label=r["title"])
    ax.axvline(train_frames, color="black", linestyle=":", label="training length")
    ax.axhline(25, color="grey", linestyle="--", label="chance")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("haystack frames")
    ax.set_ylabel("accuracy (%), mean over depths")
    ax.set_ylim(0, 102)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return grid.save_figure(fig, path)


def run_benchmark(args: argparse.Namespace, partial: Any = None) -> list[dict[str, Any]]:
    import torch

    from vispe.runner import build

    if args.threads:
        torch.set_num_threads(args.threads)
    names = [s.strip() for s in args.schemes.split(",") if s.strip()]
    bad = [s for s in names if s not in SCHEMES]
    if bad:
        raise ValueError(f"unknown scheme(s) {bad}; choose from {list(SCHEMES)}")
    seeds = [int(x) for x in str(args.seeds).split(",") if x.strip()]
    overrides = _overrides(args)
    for s in names:  # every model must build (e.g. mhrope needs >= 3 heads) before any training starts
        build(args.recipe, {**overrides, "model.init_args.pos_scheme.name": s})
    rows: dict[str, dict[str, Any]] = {}
    runs: dict[str, dict[int, dict[str, Any]]] = {s: {} for s in names}

    def done(task: grid.RunTask, seconds: float, run: dict[str, Any]) -> None:
        scheme = run["scheme"]
        runs[scheme][run["seed"]] = run
        if len(runs[scheme]) < len(seeds):
            return
        mine = [runs[scheme][seed] for seed in seeds]  # a scheme's row once all its seeds are in
        row = rows[scheme] = merge_runs(mine, mine[0]["train_frames"], args.keep, mine[0]["tokens_per_frame"])
        if partial is not None:
            partial([rows[s] for s in names if s in rows])
        print(f"{row['title']:>8}: " + "  ".join(f"{f}:{a:5.1f}" for f, a in row["by_length"].items()) + f"  ({row['wall_s']:.0f} s)", flush=True)

    grid.train_runs([run_task(s, args, seed) for s in names for seed in seeds], jobs=args.jobs, threads=args.threads or 1, done=done)
    return [rows[s] for s in names]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from vispe.runner import apply_overrides, load_recipe

        config = apply_overrides(load_recipe(args.recipe), _overrides(args))  # bad recipe / --set: one line, before training
        train_frames = int(config["data"]["init_args"]["train_frames"])
    except (ValueError, KeyError, TypeError) as err:
        print(f"vispe niah: {err}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    recipe = {"recipe": str(args.recipe), "overrides": {k: v for k, v in _overrides(args).items() if k not in BENCHMARK_TRAINER},
              "seeds": args.seeds, "threads": args.threads, "keep": args.keep,
              **{k: v for k, v in vars(args).items() if any(k == f"{n}_{o}" for n, r in SCHEMES.items() for o in r.eval_options)}}

    def write(rows: list[dict[str, Any]], total_s: float | None = None) -> str:
        table = format_table(rows, train_frames, args.keep)
        total = {} if total_s is None else {"total_s": round(total_s, 1)}
        (out / "results.json").write_text(json.dumps({"recipe": recipe, "chance": 25.0, **total, "results": rows}, indent=2))
        tail = f"total wall time {total_s:.0f} s" if total_s is not None else "(partial: run in progress)"
        (out / "results.md").write_text(f"# Video needle-in-a-haystack\n\nrecipe: `{json.dumps(recipe)}`\n\n{table}\n\n{tail}\n")
        return table

    try:
        rows = run_benchmark(args, partial=write)
    except ValueError as err:
        print(f"vispe niah: {err}", file=sys.stderr)
        return 2
    total_s = time.perf_counter() - start
    table = write(rows, total_s)
    print("\n" + table)
    plot_heatmaps(rows, out / "heatmaps.png", train_frames)
    plot_lines(rows, out / "accuracy_vs_length.png", train_frames)
    print(f"\nwrote {out / 'results.json'}, results.md, heatmaps.png, accuracy_vs_length.png ({total_s:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
