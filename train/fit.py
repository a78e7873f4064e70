"""Train with a recipe or a YAML config: ``python train/fit.py --recipe smoke`` (same as ``vispe fit --recipe smoke``;
``-c FILE`` and overrides as with ``vispe fit``).

Also runs under ``fabric run --accelerator cpu --devices 2 train/fit.py --recipe smoke`` (one DDP job) and
``torchrun``, which need a script path. A first argument of ``fit|validate|test|predict`` selects another
subcommand. Errors are one sentence, as with ``vispe`` (``--debug`` or ``VISPE_DEBUG=1`` for the traceback).
"""
from __future__ import annotations

import sys
from pathlib import Path

try:
    import vispe  # noqa: F401
except ModuleNotFoundError:  # running from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vispe.cli import exit_without_final_collection, main

if __name__ == "__main__":
    exit_without_final_collection()
    args = sys.argv[1:]
    if not args or args[0] not in ("fit", "validate", "test", "predict"):
        args = ["fit", *args]
    sys.exit(main(args))
