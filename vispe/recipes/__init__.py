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
from typing import Sequence

from vispe._checks import did_you_mean

__all__ = ["check_config_files", "expand_recipe_args", "list_recipes", "main", "recipe_path"]


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
        raise ValueError(f"recipe={name!r} is neither a shipped recipe nor a YAML file; shipped recipes: {shipped}"
                         f"{did_you_mean(name, shipped)}")
    return Path(str(resources.files(__package__).joinpath(f"{name}.yaml")))


def expand_recipe_args(argv: Sequence[str]) -> list[str]:
    """``--recipe NAME`` (or ``--recipe=NAME``) -> ``-c <vispe/recipes/NAME.yaml>`` in the same place, so options
    after it override the recipe. Unknown names raise ``ValueError`` listing the shipped recipes."""
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg == "--recipe" or arg.startswith("--recipe="):
            name = arg.split("=", 1)[1] if "=" in arg else next(it, None)
            if not name or name.startswith("-"):
                raise ValueError(f"--recipe needs a recipe name or a YAML file; shipped recipes: {list_recipes()}")
            out += ["-c", str(recipe_path(name))]
        else:
            out.append(arg)
    return out


def check_config_files(argv: Sequence[str]) -> None:
    """Parse every ``-c/--config`` file as YAML first: jsonargparse's syntax errors give a line but not the file.

    Light (no torch, no Lightning), so ``vispe fit`` refuses a bad recipe or config file in well under a second.
    """
    import yaml

    paths = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("-c", "--config")]
    paths += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    for path in paths:
        if not Path(path).is_file():
            if "\n" in path or ":" in path:  # an inline YAML string, not a file name
                continue
            raise FileNotFoundError(f"config file {path!r} does not exist")
        try:
            config = yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError as err:
            raise ValueError(f"config file {path!r} is not valid YAML: {' '.join(str(err).split())}") from None
        except UnicodeDecodeError as err:
            raise ValueError(f"config file {path!r} is not UTF-8 text ({err.reason} at byte {err.start})") from None
        if not isinstance(config, dict):
            what = "empty" if config is None else f"a YAML {type(config).__name__}"
            raise ValueError(f"config file {path!r} is {what}, not a LightningCLI config (a mapping with trainer / model / "
                             "data keys, e.g. vispe/recipes/cifar10.yaml)")


def main(argv: list[str] | None = None) -> int:
    """``vispe recipes``: each shipped recipe's name, its first comment line and its file."""
    if argv:
        raise ValueError(f"vispe recipes takes no arguments, got {list(argv)}")
    for name in list_recipes():
        path = recipe_path(name)
        first = next((line.lstrip("# ").strip() for line in path.read_text().splitlines() if line.startswith("#")), "")
        print(f"{name:16s} {first}\n{'':16s} {path}")
    return 0
