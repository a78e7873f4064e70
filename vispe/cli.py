"""The ``vispe`` console script: one entry point, subcommands imported lazily.

``vispe fit|validate|test|predict --recipe NAME`` (a recipe shipped in ``vispe/recipes/``) or ``-c FILE`` is
LightningCLI; the other subcommands are benchmark commands that print tables and write JSON / Markdown / PNG.

Only the chosen subcommand's module is imported, and the checks that need no torch (an unknown command or recipe,
a config file that is not there or not YAML) run before it: ``vispe --help``, ``vispe recipes`` and those errors
answer in well under a second.

Errors (a bad option in YAML or on the command line, a launcher conflict, a missing file) end the command
with one sentence on stderr and exit code 2, not a traceback; ``--debug`` (anywhere on the command line) or
``VISPE_DEBUG=1`` shows the full traceback instead.
"""
from __future__ import annotations

import atexit
import importlib
import os
import sys
from typing import Callable, Sequence

from vispe._checks import did_you_mean

# subcommand -> (module:function taking argv, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "fit": ("vispe.train_cli:main", "train a model (LightningCLI: --recipe NAME or -c FILE, then overrides)"),
    "validate": ("vispe.train_cli:main", "validate a checkpoint (LightningCLI)"),
    "test": ("vispe.train_cli:main", "test a checkpoint (LightningCLI)"),
    "predict": ("vispe.train_cli:main", "predict with a checkpoint (LightningCLI)"),
    "recipes": ("vispe.recipes:main", "list the shipped training recipes and where their files are"),
    "resolution": ("vispe.benchmarks.resolution_sweep:main", "accuracy of checkpoints across input resolutions"),
    "resolution-benchmark": ("vispe.benchmarks.resolution_benchmark:main", "train every 2D encoding, sweep 0.5x-2x (seeds, spreads)"),
    "three-cell": ("vispe.benchmarks.three_cell:main", "the Three Cell Experiment leaderboard (--quick for a first run)"),
    "bench": ("vispe.benchmarks.speed:main", "'vispe bench speed|scaling': speed and memory of every encoding; 'vispe bench GRID': a training grid"),
    "retrieval": ("vispe.benchmarks.retrieval:main", "text-video retrieval benchmark"),
    "niah": ("vispe.benchmarks.niah:main", "video needle-in-a-haystack benchmark for the video-LLM"),
    "hf-figures": ("vispe.benchmarks.hf_figures:main", "figures of the HF integration's checks (needs a checkout's tests/)"),
}

_LIGHTNING = {"fit", "validate", "test", "predict"}

#: top-level module -> the extra that installs it (``pip install 'vispe[EXTRA]'``)
EXTRA_OF_MODULE: dict[str, str] = {
    "lightning": "train", "pytorch_lightning": "train", "lightning_fabric": "train", "torchmetrics": "train",
    "jsonargparse": "train", "matplotlib": "train", "torchvision": "train",
    "decord": "video", "av": "video", "open_clip": "video",
    "transformers": "hf",
}

DEBUG_ENV = "VISPE_DEBUG"


def _usage() -> str:
    width = max(len(k) for k in SUBCOMMANDS)
    rows = "\n".join(f"  {k.ljust(width)}  {h}" for k, (_, h) in SUBCOMMANDS.items())
    return f"usage: vispe <command> [options]\n\ncommands:\n{rows}\n\n'vispe <command> --help' shows a command's options."


def _load(target: str) -> Callable[[Sequence[str]], int | None]:
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


def exit_without_final_collection() -> None:
    """Make this process's exit skip Python's last cyclic garbage collection (call it in a process's entry point).

    At exit the interpreter runs a full collection over every object still alive; with torch, Lightning and timm
    imported that walk takes 2-3 s of a 2-core CPU, in every process: each CLI run and each rank of a distributed
    one. Freezing the heap at exit (``gc.freeze``) leaves those objects to the operating system. Everything else
    still runs: atexit handlers, the modules' teardown, the files our writers close themselves. Only objects held in
    reference cycles are not finalized, which Python never promises at exit."""
    import gc

    if not getattr(exit_without_final_collection, "registered", False):
        atexit.register(gc.freeze)  # atexit runs last-in first-out: this runs after every handler registered later
        exit_without_final_collection.registered = True  # type: ignore[attr-defined]


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:  # the process's entry point (the console script, ``python -m vispe.cli``), not a call from Python
        exit_without_final_collection()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in SUBCOMMANDS:
        print(f"vispe: unknown command {cmd!r}; choose one of {sorted(SUBCOMMANDS)}{did_you_mean(cmd, SUBCOMMANDS)}\n\n{_usage()}",
              file=sys.stderr)
        return 2
    debug = "--debug" in rest or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    rest = [a for a in rest if a != "--debug"]
    try:
        if cmd in _LIGHTNING:  # a misspelt recipe or a broken config file is refused before Lightning is imported
            from vispe.recipes import check_config_files, expand_recipe_args

            rest = expand_recipe_args(rest)
            check_config_files(rest)
        fn = _load(SUBCOMMANDS[cmd][0])
        # LightningCLI parses its own subcommand, so it receives it back
        rc = fn([cmd, *rest] if cmd in _LIGHTNING else rest)
    except ModuleNotFoundError as err:
        extra = EXTRA_OF_MODULE.get((err.name or "").split(".")[0])
        if debug or extra is None:
            raise
        print(f"vispe {cmd}: needs the {extra!r} extra ({err.name} is not installed): pip install 'vispe[{extra}]'", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as err:  # one clear sentence; the traceback is for --debug
        if debug:
            raise
        _report_error(f"vispe {cmd}: error: {_reason(err)}", f"(run with --debug or {DEBUG_ENV}=1 for the traceback)")
        return 2
    return int(rc or 0)


def _launcher_rank() -> int:
    """This process's rank under torchrun / ``fabric run`` / Lightning's launcher (0 when not launched)."""
    for var in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(var, "")
        if value.strip().isdigit():
            return int(value)
    return 0


def _report_error(sentence: str, hint: str) -> None:
    """Print the sentence once (rank 0) and hand it to a torchrun-style launcher for its failure summary.

    Every process of a distributed job fails on the same config error; printing it from each rank repeats it, and
    torchrun's summary would otherwise say only "To enable traceback see ...". Other ranks wait a moment before
    exiting, so rank 0 fails first: the launcher names it as the root cause instead of killing it mid-print.
    """
    import json
    import time

    rank = _launcher_rank()
    if rank == 0:
        print(f"{sentence}\n{hint}", file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        try:
            with open(error_file, "w") as f:
                json.dump({"message": sentence, "timestamp": int(time.time())}, f)
        except OSError:
            pass
    if rank != 0 and os.environ.get("WORLD_SIZE", "1") not in ("", "1"):
        time.sleep(3)


def _reason(err: BaseException) -> str:
    """The sentence that says what is wrong. jsonargparse reports a class that failed to build as "Does not validate
    against any of the Union subtypes" followed by one line per candidate type; the real reason is the line that is
    not a bare type mismatch (``Expected a <class 'NoneType'>``), so only that line is kept."""
    text = str(err)
    if "Errors:" in text:
        reasons = [line.strip()[2:] for line in text.split("Errors:", 1)[1].splitlines()
                   if line.strip().startswith("- ") and not line.strip().startswith("- Expected a <class")]
        if reasons:
            return "; ".join(reasons)
    return f"{type(err).__name__}: {text}"


if __name__ == "__main__":
    sys.exit(main())
