"""CIFAR-10 benchmark: train one small ViT per positional encoding with ONE shared recipe, then
run the resolution sweep over all checkpoints.

    VISPE_DATA_ROOT=/path/to/data python train/cifar10_benchmark.py --out outputs/cifar10_bench

The recipe is the CPU one used for the README (``--recipe cpu``): a 4-block, 64-wide ViT (4 heads,
MLP ratio 2, patch 4, 32 px -> 8x8 tokens), 10,000 class-balanced training images, 2 epochs,
AdamW lr 2e-3, batch 128, no mixup. ``--recipe full`` keeps the configs' ViT-Tiny-class model and
schedule (for a GPU). Each run is ``vispe fit -c configs/cifar10/<encoding>.yaml`` plus overrides,
so every number can be reproduced run by run.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

try:
    import vispe  # noqa: F401
except ModuleNotFoundError:  # running from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vispe.train_cli import find_last_checkpoint

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_ENCODINGS = [
    "learned", "sincos2d", "rope_axial", "rope_mixed",
    "irpe", "cpe", "lff", "loope", "comrope_ap", "comrope_ld", "none",
]

RECIPES: dict[str, list[str]] = {
    "cpu": [
        "--model.init_args.model_kwargs", "{embed_dim: 64, depth: 4, num_heads: 4, mlp_ratio: 2}",
        "--model.init_args.lr", "2e-3",
        "--model.init_args.warmup_epochs", "0.25",
        "--model.init_args.mixup_alpha", "0",
        "--model.init_args.cutmix_alpha", "0",
        "--trainer.max_epochs", "2",
        "--trainer.log_every_n_steps", "10",
        "--data.init_args.train_subset", "10000",
        "--data.init_args.eval_subset", "2000",
        "--data.init_args.batch_size", "128",
    ],
    "full": [],
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--encodings", default=",".join(DEFAULT_ENCODINGS), help="comma-separated encoding names")
    p.add_argument("--recipe", choices=sorted(RECIPES), default="cpu")
    p.add_argument("--out", default="outputs/cifar10_bench", help="run folder (logs, checkpoints, timings)")
    p.add_argument("--cache-dir", default=None, help="cache for decoded CIFAR arrays (.npz)")
    p.add_argument("--no-progress", action="store_true", help="disable the progress bar (log files)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per run (1 is fastest on a shared CPU)")
    p.add_argument("--sweep", action="store_true", help="run the resolution sweep over the checkpoints afterwards")
    p.add_argument("--sweep-args", default="", help="extra arguments for 'vispe resolution'")
    args = p.parse_args(argv)

    out = Path(args.out).resolve()
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    out.mkdir(parents=True, exist_ok=True)
    timings_path = out / "timings.json"
    timings = json.loads(timings_path.read_text()) if timings_path.is_file() else {}
    ckpts = []
    for enc in [e.strip() for e in args.encodings.split(",") if e.strip()]:
        cfg = ROOT / "configs" / "cifar10" / f"{enc}.yaml"
        if not cfg.is_file():
            raise FileNotFoundError(f"no config {cfg} for encoding {enc!r}")
        ckpt = find_last_checkpoint(out / enc)
        if ckpt is None:
            cmd = [sys.executable, "-m", "vispe.cli", "fit", "-c", str(cfg), *RECIPES[args.recipe],
                   "--trainer.logger.init_args.save_dir", str(out)]
            if args.cache_dir:
                cmd += ["--data.init_args.cache_dir", str(Path(args.cache_dir).resolve())]
            if args.no_progress:
                cmd += ["--trainer.enable_progress_bar", "false"]
            print(f"[{time.strftime('%H:%M:%S')}] {enc}: {' '.join(cmd)}", flush=True)
            t0 = time.perf_counter()
            subprocess.run(cmd, check=True, cwd=ROOT, env=env)
            timings[enc] = {"wall_s": round(time.perf_counter() - t0, 1), "recipe": args.recipe}
            timings_path.write_text(json.dumps(timings, indent=2))
            print(f"[{time.strftime('%H:%M:%S')}] {enc}: done in {timings[enc]['wall_s']} s", flush=True)
            ckpt = find_last_checkpoint(out / enc)
        ckpts.append(str(ckpt))
    if args.sweep:
        cmd = [sys.executable, "-m", "vispe.cli", "resolution", *ckpts, "--out", str(out / "resolution"), *args.sweep_args.split()]
        print(" ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
