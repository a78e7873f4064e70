"""What every training benchmark shares: a benchmark is a grid of (recipe, overrides, seed) runs through
:mod:`vispe.runner` plus a scoring function; this module holds the grid's command-line part and the benchmark-mode
trainer settings, so the benchmarks only state their grid and their scoring."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["BENCHMARK_TRAINER", "POLICY_LINE_NOTE", "POLICY_STYLES", "accuracy_axes", "add_recipe_arguments", "figure_legend",
           "part_title", "save_figure"]

#: One line convention for every resolution figure: the extrapolation policy is the line style (an encoding with
#: one built-in behaviour draws solid, like ``interpolate``)
POLICY_STYLES: dict[str, Any] = {"interpolate": "-", "extend": "--", "ntk": "-.", "yarn": (0, (3, 1, 1, 1, 1, 1))}
#: what the lines, bands and reference lines mean, in the legend's title of every resolution figure
POLICY_LINE_NOTE = ("line: solid interpolate or the encoding's own behaviour, dashed extend,\n"
                    "dash-dot ntk, dash-dot-dot yarn; grey dotted: training size")
_DATA_NAMES = {"fashion_mnist": "Fashion-MNIST", "cifar10": "CIFAR-10", "synthetic": "generated data"}
_PART_SUFFIXES = {"mixed": "mixed-grid training", "4x": "up to 4x the training size", "aspect": "aspect ratios"}

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


def part_title(part: str) -> str:
    """A benchmark part's name as a figure title: ``'fashion_mnist_mixed'`` -> ``'Fashion-MNIST, mixed-grid training'``."""
    for key, name in sorted(_DATA_NAMES.items(), key=lambda kv: -len(kv[0])):
        if part == key or part.startswith(key + "_"):
            rest = [_PART_SUFFIXES.get(w, w.replace("_", " ")) for w in part[len(key):].strip("_").split("_") if w]
            return ", ".join([name, *rest])
    return part.replace("_", " ")


def accuracy_axes(ax: Any, ylabel: str = "top-1 accuracy (%)") -> None:
    """Accuracy axes: limits inside [0, 100] (a band around chance never draws negative ticks), a light grid."""
    low, high = ax.get_ylim()
    ax.set_ylim(max(0.0, low), min(100.0, high))
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def figure_legend(fig: Any, axes: Any, note: str, fontsize: int = 8) -> float:
    """One legend for the whole figure, below the panels, readable (``fontsize``), with ``note`` as its title (what
    line styles, bands and reference lines mean). Returns the fraction of the figure height it takes (for
    ``tight_layout(rect=(0, that, 1, 1))``)."""
    handles, names = {}, []
    for ax in axes:
        for h, n in zip(*ax.get_legend_handles_labels()):
            if n not in handles:
                handles[n] = h
                names.append(n)
    ncol = 1 if len(names) <= 4 else 2 if len(names) <= 10 else 3 if len(names) <= 24 else 4
    rows = -(-len(names) // ncol)
    height_in = fig.get_size_inches()[1]
    legend_in = 0.19 * rows + 0.2 * (note.count("\n") + 1) + 0.3
    fig.set_size_inches(fig.get_size_inches()[0], height_in + legend_in)
    fig.legend([handles[n] for n in names], names, loc="lower center", ncol=ncol, fontsize=fontsize, frameon=False,
               title=note, title_fontsize=fontsize)
    return legend_in / (height_in + legend_in)
