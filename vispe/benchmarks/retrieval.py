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
import warnings
from pathlib import Path
from typing import Any, Sequence

from vispe.files import read_json

__all__ = ["main", "build_parser", "run_one", "run_benchmark", "format_table", "plot_results", "DEFAULTS", "DEFAULT_ENCODINGS"]

DEFAULT_ENCODINGS: tuple[str, ...] = ("rope_axial_3d", "rope_mixed_3d", "sincos3d", "learned_3d", "none")

#: the default CPU recipe (see docs/video-retrieval.md)
DEFAULTS: dict[str, Any] = dict(
    model="vispe_video_vit_nano_patch8_64",
    frames=8,
    size=32,
    tubelet=2,
    patch=8,
    embed_dim=64,
    depth=2,
    num_heads=2,
    text_width=64,
    text_layers=2,
    text_heads=2,
    context_length=32,
    joint_dim=64,
    num_train=2048,
    num_val=256,
    num_events=2,
    grid=2,
    global_pool="avg",
    steps=200,
    batch_size=64,
    lr=1e-3,
    weight_decay=0.05,
    warmup=20,
    seed=0,
    eval_views="16x32,8x64,16x64",
)


def _parse_views(text: str) -> list[tuple[int, int]]:
    views = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        try:
            t, s = item.lower().split("x")
            views.append((int(t), int(s)))
        except ValueError:
            raise ValueError(f"--eval-views item {item!r} is not FRAMESxSIZE (e.g. 16x64)") from None
    return views


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vispe retrieval",
        description="Text-video retrieval benchmark: one small video-text CLIP per 3D positional encoding, generated data.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = DEFAULTS
    p.add_argument("--encodings", default=",".join(DEFAULT_ENCODINGS), help="comma-separated 3D encodings (vispe.list_encodings(grid_ndim=3))")
    p.add_argument("--out", default="outputs/retrieval", help="output folder for results.json/.md/.png")
    p.add_argument("--data-root", default=None, help="where generated clips are written (default $VISPE_DATA_ROOT/generated or the temp dir)")
    p.add_argument("--quick", action="store_true", help="tiny smoke run (few clips and steps; numbers are meaningless)")
    g = p.add_argument_group("data")
    g.add_argument("--num-train", type=int, default=d["num_train"])
    g.add_argument("--num-val", type=int, default=d["num_val"])
    g.add_argument("--frames", type=int, default=d["frames"], help="training frames")
    g.add_argument("--size", type=int, default=d["size"], help="training resolution (px)")
    g.add_argument("--eval-views", default=d["eval_views"], help="extra evaluation views FRAMESxSIZE, comma-separated")
    g.add_argument("--num-events", type=int, default=d["num_events"])
    g.add_argument("--grid", type=int, default=d["grid"], choices=(2, 3))
    m = p.add_argument_group("model")
    m.add_argument("--model", default=d["model"])
    m.add_argument("--global-pool", default=d["global_pool"], choices=("avg", "token"),
                   help="video tower pooling ('token' collapsed to a constant embedding in our CPU runs)")
    for k in ("tubelet", "patch", "embed_dim", "depth", "num_heads", "text_width", "text_layers", "text_heads", "context_length", "joint_dim"):
        m.add_argument(f"--{k.replace('_', '-')}", type=int, default=d[k])
    o = p.add_argument_group("optimisation")
    o.add_argument("--steps", type=int, default=d["steps"])
    o.add_argument("--batch-size", type=int, default=d["batch_size"])
    o.add_argument("--lr", type=float, default=d["lr"])
    o.add_argument("--weight-decay", type=float, default=d["weight_decay"])
    o.add_argument("--warmup", type=int, default=d["warmup"], help="warm-up steps")
    o.add_argument("--seed", type=int, default=d["seed"])
    o.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave torch's default)")
    o.add_argument("--accelerator", default="cpu")
    return p


def _datamodule(args: argparse.Namespace):
    from vispe.data.video_text import SyntheticVideoTextDataModule

    return SyntheticVideoTextDataModule(
        root=args.data_root, num_train=args.num_train, num_val=args.num_val, num_frames=args.frames, size=args.size,
        eval_settings=[(t, s) for t, s in _parse_views(args.eval_views)], num_events=args.num_events, grid=args.grid,
        seed=args.seed, batch_size=args.batch_size, eval_batch_size=128,
    )


def run_one(name: str, args: argparse.Namespace, datamodule: Any) -> dict[str, Any]:
    """Train one encoding and evaluate it on every view; returns its row (recalls in %)."""
    import lightning.pytorch as pl

    from vispe.tasks.retrieval import VideoTextRetrieval, view_name

    pl.seed_everything(args.seed, workers=True, verbose=False)
    task = VideoTextRetrieval(
        video_model=args.model,
        pos_encoding=name,
        video_model_kwargs=dict(
            img_size=args.size, num_frames=args.frames, tubelet_size=args.tubelet, patch_size=args.patch,
            embed_dim=args.embed_dim, depth=args.depth, num_heads=args.num_heads, global_pool=args.global_pool,
        ),
        embed_dim=args.joint_dim,
        text_cfg=dict(context_length=args.context_length, width=args.text_width, heads=args.text_heads, layers=args.text_layers),
        lr=args.lr, weight_decay=args.weight_decay, warmup_steps=args.warmup,
    )
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=1, max_steps=args.steps, max_epochs=-1, logger=False,
        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
        num_sanity_val_steps=0, limit_val_batches=0, deterministic=False,
    )
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")
        trainer.fit(task, datamodule=datamodule)
        train_s = time.perf_counter() - start
        evaluator = pl.Trainer(accelerator=args.accelerator, devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
        evaluator.validate(task, datamodule=datamodule, verbose=False)
    wall_s = time.perf_counter() - start
    views = datamodule.views
    row: dict[str, Any] = {
        "encoding": name,
        "kind": task.visual.pos_encoding.kind,
        "pe_params": sum(p.numel() for p in task.visual.pos_encoding.parameters()),
        "video_params": sum(p.numel() for p in task.visual.parameters()),
        "steps": int(trainer.global_step),
        "train_s": round(train_s, 1),
        "wall_s": round(wall_s, 1),
        "views": {},
    }
    for i, (t, s) in enumerate(views):
        key = "val" if i == 0 else f"val_{view_name(t, s)}"
        met = task.last_metrics.get(key, {})
        row["views"][view_name(t, s)] = {k: round(v, 2) for k, v in met.items()}
    return row


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
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _recipe(args: argparse.Namespace) -> dict[str, Any]:
    skip = {"out", "data_root", "encodings", "quick"}
    return {k: v for k, v in vars(args).items() if k not in skip}


def run_benchmark(args: argparse.Namespace) -> tuple[list[dict[str, Any]], float, float, float]:
    import torch

    import vispe

    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.encodings.split(",") if n.strip()]
    valid = vispe.list_encodings(grid_ndim=3)
    bad = [n for n in names if n not in valid]
    if bad:
        raise ValueError(f"unknown or non-3D encoding(s) {bad}; choose from {valid}")
    _parse_views(args.eval_views)
    dm = _datamodule(args)
    t0 = time.perf_counter()
    dm.prepare_data()
    gen_s = time.perf_counter() - t0
    from vispe.data.video_text import position_free_r1

    ceiling = position_free_r1(read_json(Path(dm._manifests()[1]), "manifest"))
    print(f"data: {args.num_train} train / {args.num_val} val clips under {dm.root} ({gen_s:.0f} s incl. generation)", flush=True)
    rows = []
    for name in names:
        row = run_one(name, args, dm)
        rows.append(row)
        m = row["views"][next(iter(row["views"]))]
        print(f"{name:>15}: t2v R@1 {m.get('t2v_R@1', float('nan')):5.1f}  v2t R@1 {m.get('v2t_R@1', float('nan')):5.1f}  ({row['wall_s']:.0f} s)", flush=True)
    return rows, dm.chance_r1, gen_s, ceiling


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.num_train, args.num_val, args.steps, args.warmup = 64, 32, 4, 1
    try:
        _parse_views(args.eval_views)
    except ValueError as err:
        print(f"vispe retrieval: {err}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    rows, chance, gen_s, ceiling = run_benchmark(args)
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
