"""What every training benchmark shares: a benchmark is a grid of (recipe, overrides, seed) runs through
:mod:`vispe.runner` plus a scoring function; this module holds the grid's command-line part and the benchmark-mode
trainer settings, so the benchmarks only state their grid and their scoring."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["BENCHMARK_TRAINER", "add_recipe_arguments", "save_figure"]

#: how a benchmark runs a recipe: no logger, checkpoints or model summary (each benchmark scores the trained model
#: itself and writes its own results); benchmarks add their own settings on top
BENCHMARK_TRAINER: dict[str, Any] = {"trainer.logger": False, "trainer.enable_checkpointing": False,
                                     "trainer.enable_model_summary": False}


def add_recipe_arguments(parser: argparse.ArgumentParser, recipe: str, examples: str) -> argparse._ArgumentGroup:
    """The ``recipe`` argument group: ``--recipe`` (a shipped recipe name or a LightningCLI YAML file) and the
    repeatable ``--set KEY=VALUE`` override (``examples``: a few, for the help). Returns the group for more options."""
    group = parser.add_argument_group("recipe")
    group.add_argument("--recipe", default=recipe, help="recipe name (vispe.recipes.list_recipes()) or LightningCLI YAML file")
    group.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help=f"override a recipe setting, repeatable: {examples}")
    return group


def save_figure(fig: Any, path: str | Path, **savefig_kwargs: Any) -> Path:
    """Write a matplotlib figure (120 dpi, parent folders created) and close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, **savefig_kwargs)
    plt.close(fig)
    return path
