"""``vispe three-cell``: the Three Cell Experiment leaderboard (LOOPE's benchmark, our generator).

Trains one small ViT per positional encoding with one recipe on generated Three Cell data and
prints a table of test accuracy per group (distance, orientation, area, vector sum), their
average and the wall time; writes ``results.json``, ``results.md`` and ``results.png`` to
``--out``. ``vispe three-cell --quick`` is the first command to run after installing: no files,
no downloads, a few encodings including ``none``, a few minutes on a 2-core CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

from vispe.benchmarks import grid
from vispe.files import read_json

__all__ = ["main", "build_parser", "run_leaderboard", "run_one", "run_task", "score_run", "format_table", "plot_results", "QUICK_ENCODINGS", "QUICK", "RECIPE"]

#: ``--quick``: no PE and the two RoPE-ViT baselines; they learn the task within the quick budget
#: (the additive encodings, sin-cos and the learned table, leave the no-PE plateau later than RoPE)
QUICK_ENCODINGS: tuple[str, ...] = ("none", "rope_axial", "rope_mixed")
GROUP_TITLES: dict[str, str] = {"distance": "Distance", "orientation": "Orientation", "area": "Area", "vector_sum": "Vector Sum"}

#: the recipe (``vispe/recipes/three_cell.yaml``, the CPU recipe; see docs/three-cell.md for how it was chosen)
RECIPE = "three_cell"
#: ``--quick`` overrides (smaller budget, the same 5 % warm-up; every other setting unchanged)
QUICK: dict[str, Any] = {"trainer.max_epochs": 4, "model.init_args.warmup_epochs": 0.2}
#: how the benchmark runs a recipe: no logger, checkpoints or model summary (the table is the output)
BENCHMARK_TRAINER: dict[str, Any] = dict(grid.BENCHMARK_TRAINER)


def build_parser() -> argparse.ArgumentParser:
    p = grid.benchmark_parser(
        "vispe three-cell",
        "Three Cell Experiment leaderboard: one tiny ViT per positional encoding, same recipe, generated data. "
        "The recipe (data, model, schedule) is vispe/recipes/three_cell.yaml; change it with --set.")
    p.add_argument("--quick", action="store_true", help=f"a few-minute CPU run of {', '.join(QUICK_ENCODINGS)} (writes nothing unless --out)")
    p.add_argument("--encodings", default=None, help="comma-separated encoding names, or 'all' (every 2D encoding a benchmark trains: "
                                                 "vispe.benchmarks.grid.select_encodings)")
    p.add_argument("--pe-options", default="{}", help='JSON {encoding: {option: value}} passed to the encodings, e.g. \'{"irpe": {"mode": "bias"}}\'')
    p.add_argument("--out", default=None, help="output folder for results.json/.md/.png (default: outputs/three-cell; none with --quick)")
    p.add_argument("--append", action="store_true", help="keep results already in --out/results.json for encodings not rerun")
    p.add_argument("--merge", nargs="+", default=None, metavar="DIR",
                   help="train nothing: merge the results.json of these folders (runs split over processes/machines) into --out")
    g = grid.add_recipe_arguments(p, RECIPE, "--set trainer.max_epochs=40 --set data.init_args.grid_size=14 --set model.init_args.lr=1e-3")
    g.add_argument("--seed", type=int, default=0, help="data and initialisation seed (seed_everything and data.init_args.seed)")
    g.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads; part of the recipe: the reduction order of CPU kernels depends on it, so runs "
                        "are bit-identical only at the same thread count (and PyTorch build / CPU)")
    g.add_argument("--jobs", type=int, default=1, help="encodings trained at a time (runner workers in a process pool; "
                   "each run's output in --out/logs/)")
    g.add_argument("--no-val", action="store_true", help="skip the per-epoch validation pass")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--no-pesi", action="store_true", help="skip the PESI metrics / similarity maps of the trained encodings")
    return p


def _resolve_encodings(spec: str | None, quick: bool) -> list[str]:
    import vispe

    available = [n for n in vispe.list_encodings(grid_ndim=2)]
    if spec is None:
        spec = ",".join(QUICK_ENCODINGS) if quick else "all"
    if spec.strip() == "all":  # what every benchmark trains: the registry's 2D encodings (grid.select_encodings)
        return list(grid.select_encodings({"registry": {"grid_ndim": 2}}))
    from vispe.encodings.spec import parse_encoding_list

    specs = parse_encoding_list(spec)  # names, or specs with options: 'learned[init=sincos2d]'
    # a composition ('learned+rope_axial') is resolved here: a part that cannot compose fails naming it
    bad = [name for _, name, _ in specs if name not in available and not ("+" in name and 2 in vispe.get_encoding_class(name).grid_ndims)]
    if bad or not specs:
        raise ValueError(f"unknown or non-2D encoding(s) {bad or spec!r}; choose from {available} or 'all'")
    return [label for label, _, _ in specs]


def _count_params(module: Any) -> int:
    return int(sum(p.numel() for p in module.parameters() if p.requires_grad))


def _epoch_printer_cls():
    import lightning.pytorch as pl

    class EpochPrinter(pl.Callback):
        """One line per validation epoch (readable in logs, unlike a progress bar)."""

        def __init__(self, name: str) -> None:
            self.name = name
            self.start = time.perf_counter()

        # on_validation_end runs after the module's on_validation_epoch_end has logged this epoch's values
        def on_validation_end(self, trainer, pl_module) -> None:
            m = trainer.callback_metrics
            if "val/avg" not in m or trainer.sanity_checking:
                return
            parts = " ".join(f"{g} {100 * float(m[f'val/{g}']):.1f}" for g in (*GROUP_TITLES, "avg") if f"val/{g}" in m)
            print(f"  {self.name} epoch {trainer.current_epoch} step {trainer.global_step}: val {parts} "
                  f"({time.perf_counter() - self.start:.0f} s)", flush=True)

    return EpochPrinter


def _EpochPrinter(name: str):  # noqa: N802  (built lazily: Lightning is imported only when training)
    return _epoch_printer_cls()(name)


def _epoch_printer(task: grid.RunTask):
    """The run's callback (:attr:`grid.RunTask.callbacks`): one line per validation epoch."""
    return _EpochPrinter(task.name)


def run_task(name: str, args: argparse.Namespace, pe_options: dict[str, Any]) -> grid.RunTask:
    """One run of the leaderboard: the recipe with the encoding ``name`` (a spec: ``'learned'`` or
    ``'learned[init=sincos2d]'``, plus its ``--pe-options``), scored by :func:`score_run` where it trains."""
    from vispe.encodings.spec import parse_pos_encoding

    base, options = parse_pos_encoding(name)
    options = {**pe_options.get(base, {}), **options}
    pos_encoding: Any = {"name": base, **options} if options else base
    log = Path(args.out) / "logs" / f"{name}.log" if args.out else None
    return grid.RunTask(name=name, recipe=args.recipe, overrides={**_overrides(args), "model.init_args.pos_encoding": pos_encoding},
                        seed=args.seed, log=log, score=f"{__name__}:score_run", callbacks=(f"{__name__}:_epoch_printer",),
                        context={"options": options, "pesi": not args.no_pesi, "out": args.out})


def score_run(task: grid.RunTask, result: Any, started: tuple[float, float]) -> dict[str, Any]:
    """Test the trained run with its own Trainer; its row of the table (accuracies in percent)."""
    from vispe.tasks.three_cell import GROUPS

    train_s = time.perf_counter() - started[0]
    metrics = result.evaluate("test")  # the run's own Trainer, the recipe's test split
    wall_s = time.perf_counter() - started[0]
    cpu_s = time.process_time() - started[1]
    task_module, trainer = result.model, result.trainer
    model = task_module.model
    row: dict[str, Any] = {"encoding": task.name, "kind": model.pos_encoding.kind if hasattr(model, "pos_encoding") else "?"}
    row["options"] = task.context["options"]
    row["params"] = _count_params(model)
    row["pe_params"] = _count_params(model.pos_encoding) if hasattr(model, "pos_encoding") else 0
    for g in (*GROUPS, "avg"):
        row[g] = round(100.0 * float(metrics[f"test/{g}"]), 2)
    row["pesi"] = _pesi_of(model, task.name, task.context["out"]) if task.context["pesi"] else None
    row["steps"] = int(trainer.global_step)
    row["train_s"] = round(train_s, 1)
    row["wall_s"] = round(wall_s, 3)
    # CPU seconds of this process (all threads): on a shared machine wall time depends on the load, this does not
    row["cpu_s"] = round(cpu_s, 3)
    return row


def run_one(name: str, args: argparse.Namespace, pe_options: dict[str, Any]) -> dict[str, Any]:
    """Train and test one encoding (one run of the recipe, in this process); returns its row of the table."""
    return grid.train_one(run_task(name, args, pe_options))


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The grid's fixed overrides: benchmark mode, --quick, the seed, --no-val/--no-progress, then the user's --set."""
    from vispe.runner import parse_overrides

    out: dict[str, Any] = {**BENCHMARK_TRAINER, "trainer.enable_progress_bar": not args.no_progress, "data.init_args.seed": args.seed}
    if args.quick:
        out.update(QUICK)
    if args.no_val:
        out["trainer.limit_val_batches"] = 0
    out.update(parse_overrides(args.overrides))
    return out


def _pesi_of(model: Any, name: str, out: str | None) -> dict[str, float] | None:
    """PESI metrics of the trained encoding (None when it cannot be materialised), plus its similarity maps."""
    from vispe.analysis.pesi import pesi_from_similarity, plot_similarity_maps, similarity_maps

    model.eval()
    try:
        sim = similarity_maps(model)
    except (ValueError, TypeError):
        return None
    metrics = {k: round(v, 4) for k, v in pesi_from_similarity(sim).items()}
    if out is not None:
        plot_similarity_maps(model, Path(out) / "similarity" / f"{name}.png", title=f"{name} (trained): cosine similarity")
    return metrics


def format_pesi_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown table of the PESI metrics of the trained encodings that can be materialised."""
    lines = ["| PE | M_U (ideal 2) | M_D (ideal 2) | A_SU (ideal 0) |", "|---|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: -r["avg"]):
        p = r.get("pesi")
        if p:
            lines.append(f"| {r['encoding']} | {p['M_U']:.3f} | {p['M_D']:.3f} | {p['A_SU']:.3f} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown table, best average first."""
    head = "| PE | kind | PE params | Distance | Orientation | Area | Vector Sum | **Avg** | wall (s) | CPU (s) |"
    sep = "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    lines = [head, sep]
    for r in sorted(rows, key=lambda r: -r["avg"]):
        lines.append(
            f"| {r['encoding']} | {r['kind']} | {r['pe_params']:,} | {r['distance']:.1f} | {r['orientation']:.1f} | "
            f"{r['area']:.1f} | {r['vector_sum']:.1f} | **{r['avg']:.1f}** | {r['wall_s']:.0f} | {r.get('cpu_s', float('nan')):.0f} |"
        )
    return "\n".join(lines)


def plot_results(rows: Sequence[dict[str, Any]], path: str | Path, title: str = "Three Cell Experiment") -> Path:
    """Grouped bar plot: one group of bars per encoding (4 groups + average)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = sorted(rows, key=lambda r: -r["avg"])
    keys = [*GROUP_TITLES, "avg"]
    labels = [*GROUP_TITLES.values(), "Average"]
    x = np.arange(len(rows))
    width = 0.8 / len(keys)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(rows) + 2), 4.0))
    for i, (k, lab) in enumerate(zip(keys, labels)):
        ax.bar(x + (i - (len(keys) - 1) / 2) * width, [r[k] for r in rows], width, label=lab,
               edgecolor="black" if k == "avg" else None, linewidth=0.8)
    ax.set_xticks(x, [r["encoding"] for r in rows], rotation=30, ha="right")
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(40, 100)
    ax.axhline(50, color="grey", linewidth=0.5, linestyle=":")
    ax.set_title(title)
    ax.legend(ncol=5, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.28))
    fig.tight_layout()
    return grid.save_figure(fig, path)


def _recipe(args: argparse.Namespace) -> dict[str, Any]:
    """What the table was trained with: the recipe, its overrides (benchmark mode excluded), seed and threads."""
    overrides = {k: v for k, v in _overrides(args).items() if k not in BENCHMARK_TRAINER and k != "trainer.enable_progress_bar"}
    return {"recipe": str(args.recipe), "overrides": overrides, "seed": args.seed, "threads": args.threads}


def run_leaderboard(args: argparse.Namespace) -> list[dict[str, Any]]:
    encodings = _resolve_encodings(args.encodings, args.quick)
    try:
        pe_options = json.loads(args.pe_options)
    except json.JSONDecodeError as e:
        raise ValueError(f"--pe-options is not valid JSON ({e}): {args.pe_options!r}") from None
    if not isinstance(pe_options, dict) or not all(isinstance(v, dict) for v in pe_options.values()):
        raise ValueError(f"--pe-options must be a JSON object {{encoding: {{option: value}}}}, got {args.pe_options!r}")
    out = Path(args.out) if args.out else None
    previous: dict[str, dict[str, Any]] = {}
    if out is not None and args.append and (out / "results.json").exists():
        previous = {r["encoding"]: r for r in read_json(out / "results.json", "earlier results")["results"]}
    print(f"recipe {args.recipe} (seed {args.seed}); training {len(encodings)} encodings: {', '.join(encodings)}", flush=True)
    rows = dict(previous)
    tasks = [run_task(name, args, pe_options) for name in encodings]
    count = {"done": 0}

    def done(task: grid.RunTask, seconds: float, row: dict[str, Any]) -> None:
        rows[task.name] = row
        count["done"] += 1
        print(f"[{count['done']}/{len(encodings)}] {task.name}: avg {row['avg']:.1f}  (distance {row['distance']:.1f}, orientation "
              f"{row['orientation']:.1f}, area {row['area']:.1f}, vector sum {row['vector_sum']:.1f}; {row['wall_s']:.0f} s)", flush=True)
        if out is not None:
            _write(out, list(rows.values()), args, plot=False)

    grid.train_runs(tasks, jobs=args.jobs, threads=args.threads, done=done, log=lambda msg: print(f"\n{msg}", flush=True))
    ordered = dict(previous)  # the table's order whatever order parallel runs finished in
    ordered.update({name: rows[name] for name in encodings})
    result = list(ordered.values())
    if out is not None:
        _write(out, result, args, plot=True)
    return result


def _write(out: Path, rows: list[dict[str, Any]], args: argparse.Namespace, plot: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"recipe": _recipe(args), "results": rows}, indent=2))
    (out / "results.md").write_text(
        f"# Three Cell Experiment\n\nrecipe: `{json.dumps(_recipe(args))}`\n\n{format_table(rows)}\n\n{format_pesi_table(rows)}\n"
    )
    if plot:
        plot_results(rows, out / "results.png")


def merge_results(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Combine the results of several runs of the same recipe (later folders win on duplicates)."""
    rows: dict[str, dict[str, Any]] = {}
    recipe: dict[str, Any] | None = None
    for folder in args.merge:
        path = Path(folder) / "results.json"
        if not path.exists():
            raise ValueError(f"--merge: {path} does not exist")
        data = read_json(path, "earlier results")
        other = {k: v for k, v in data["recipe"].items() if k != "threads"}
        if recipe is not None and other != recipe:
            diff = sorted(k for k in set(other) | set(recipe) if other.get(k) != recipe.get(k))
            raise ValueError(f"--merge: {path} was run with a different recipe (differs in {diff})")
        recipe = other
        rows.update({r["encoding"]: r for r in data["results"]})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = list(rows.values())
    (out / "results.json").write_text(json.dumps({"recipe": recipe, "results": result}, indent=2))
    (out / "results.md").write_text(
        f"# Three Cell Experiment\n\nrecipe: `{json.dumps(recipe)}`\n\n{format_table(result)}\n\n{format_pesi_table(result)}\n"
    )
    plot_results(result, out / "results.png")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.out is None and not args.quick:
        args.out = os.path.join("outputs", "three-cell")
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    import torch

    # fixed thread count + deterministic kernels: same command, same numbers (see docs/three-cell.md, "Determinism")
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*GPU available but not used.*")
    try:
        if not args.merge:
            from vispe.recipes import recipe_path
            from vispe.runner import parse_overrides

            recipe_path(args.recipe)  # unknown recipe / bad --set: one line, before anything trains
            parse_overrides(args.overrides)
        rows = merge_results(args) if args.merge else run_leaderboard(args)
    except ValueError as e:
        print(f"vispe three-cell: {e}", file=sys.stderr)
        return 2
    print("\nThree Cell Experiment, test accuracy (%):\n")
    print(format_table(rows))
    pesi = format_pesi_table(rows)
    if pesi:
        print(f"\nPESI of the trained encodings (LOOPE's metrics):\n\n{pesi}")
    if args.out:
        print(f"\nwrote {Path(args.out) / 'results.json'}, results.md, results.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
