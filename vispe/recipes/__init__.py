"""Training recipes: LightningCLI YAML shipped inside the package, so they work from an installed wheel.

A recipe names a task, a model, a data module and a schedule; the positional encoding (and anything else) is an
override on top of it, never a file of its own::

    vispe recipes                                                    # the shipped recipes and their files
    vispe fit --recipe cifar10 --model.init_args.pos_encoding rope_mixed
    vispe fit -c "$(python -c 'import vispe.recipes as r; print(r.recipe_path("cifar10"))')"

:func:`recipe_path` resolves a recipe name (or a path to any YAML file) to a file; :func:`list_recipes` lists the
shipped ones.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

__all__ = ["list_recipes", "main", "recipe_path"]


def list_recipes() -> list[str]:
    """Names of the recipes shipped with vispe (``vispe/recipes/<name>.yaml``)."""
    folder = resources.files(__package__)
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def recipe_path(name_or_path: str | Path) -> Path:
    """The YAML file of a shipped recipe name, or ``name_or_path`` itself when it is an existing file.

    Raises ``ValueError`` naming the unknown recipe and the shipped ones.
    """
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    name = str(name_or_path)
    shipped = list_recipes()
    if name not in shipped:
        raise ValueError(f"recipe={name!r} is neither a shipped recipe nor a YAML file; shipped recipes: {shipped}")
    return Path(str(resources.files(__package__).joinpath(f"{name}.yaml")))


def main(argv: list[str] | None = None) -> int:
    """``vispe recipes``: each shipped recipe's name, its first comment line and its file."""
    if argv:
        raise ValueError(f"vispe recipes takes no arguments, got {list(argv)}")
    for name in list_recipes():
        path = recipe_path(name)
        first = next((line.lstrip("# ").strip() for line in path.read_text().splitlines() if line.startswith("#")), "")
        print(f"{name:16s} {first}\n{'':16s} {path}")
    return 0
