"""The ``vispe`` console script: one entry point, subcommands imported lazily.

``vispe fit|validate|test|predict -c configs/...`` is LightningCLI; the other subcommands are
benchmark commands that print tables and write JSON / Markdown / PNG.
"""
from __future__ import annotations

import importlib
import sys
from typing import Callable, Sequence

# subcommand -> (module:function taking argv, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "fit": ("vispe.train_cli:main", "train a model (LightningCLI)"),
    "validate": ("vispe.train_cli:main", "validate a checkpoint (LightningCLI)"),
    "test": ("vispe.train_cli:main", "test a checkpoint (LightningCLI)"),
    "predict": ("vispe.train_cli:main", "predict with a checkpoint (LightningCLI)"),
    "resolution": ("vispe.benchmarks.resolution:main", "accuracy of checkpoints across input resolutions"),
    "resolution-benchmark": ("vispe.benchmarks.resolution_benchmark:main", "train every 2D encoding, sweep 0.5x-2x (seeds, spreads)"),
    "three-cell": ("vispe.benchmarks.three_cell:main", "the Three Cell Experiment leaderboard (--quick for a first run)"),
    "bench": ("vispe.benchmarks.speed:main", "speed and memory of every encoding vs timm ('vispe bench speed')"),
    "retrieval": ("vispe.benchmarks.retrieval:main", "text-video retrieval benchmark"),
    "niah": ("vispe.benchmarks.niah:main", "video needle-in-a-haystack benchmark for the video-LLM"),
}

_LIGHTNING = {"fit", "validate", "test", "predict"}


def _usage() -> str:
    width = max(len(k) for k in SUBCOMMANDS)
    rows = "\n".join(f"  {k.ljust(width)}  {h}" for k, (_, h) in SUBCOMMANDS.items())
    return f"usage: vispe <command> [options]\n\ncommands:\n{rows}\n\n'vispe <command> --help' shows a command's options."


def _load(target: str) -> Callable[[Sequence[str]], int | None]:
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in SUBCOMMANDS:
        print(f"vispe: unknown command {cmd!r}; choose one of {sorted(SUBCOMMANDS)}\n\n{_usage()}", file=sys.stderr)
        return 2
    fn = _load(SUBCOMMANDS[cmd][0])
    # LightningCLI parses its own subcommand, so it receives it back
    rc = fn([cmd, *rest] if cmd in _LIGHTNING else rest)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
