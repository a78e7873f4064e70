"""What every training benchmark shares: a benchmark is a **grid** of (recipe, overrides, seed) runs through
:func:`vispe.runner.run` plus one scoring / report function.

A grid is data: a YAML file shipped beside the recipes (``vispe/recipes/grids/<name>.yaml``, :func:`list_grids`) or
any YAML file of the same form::

    benchmark: resolution             # whose score/report function reads it
    description: one line
    techniques: {randpos: "random_positions=2.0"}   # optional: name -> encoding options a technique turns on
    technique_encodings: [rope_axial]               # the encodings a technique is run for
    encoding_options: {seqpe: {num_pivots: 8}}      # optional: options an encoding always trains with
    parts:
      - name: fashion_mnist
        recipe: fashion_mnist         # a shipped recipe name or a recipe YAML file
        overrides: {}                 # dotted LightningCLI keys on top of it
        encodings: {registry: {grid_ndim: 2}, add: [learned+rope_axial]}   # or a list of names
        seeds: [0, 1, 2]
        first_seed_only: [none]       # these train seeds[0] only
        evaluate: {train_size: 28, patch: 7}        # what the benchmark's scoring needs
        needs_data: fashion-mnist     # folder under the data root the part reads

:func:`load_grid` checks every key when the file is read (an unknown key is refused naming it, the file and the
valid keys). :func:`select_encodings` resolves an ``encodings`` entry; :func:`train_runs` trains a list of runs
(``jobs`` at a time in a process pool of runner workers). The command-line part every benchmark shares is
:func:`benchmark_parser` (``--recipe`` is a training recipe everywhere; a grid is ``--grid``); the benchmark-mode
trainer settings are :data:`BENCHMARK_TRAINER`.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from vispe._checks import did_you_mean

__all__ = ["BENCHMARK_TRAINER", "EVALUATE_KEYS", "GRID_KEYS", "Grid", "PART_KEYS", "POLICY_LINE_NOTE", "POLICY_STYLES", "Part", "RunTask",
           "accuracy_axes", "add_recipe_arguments", "bench_grid", "benchmark_parser", "is_grid", "figure_legend", "grid_path", "list_grids", "load_grid", "part_title",
           "save_figure", "select_encodings", "train_one", "train_runs"]

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

# ------------------------------------------------------------------------------------------------------------------
# the grid format
# ------------------------------------------------------------------------------------------------------------------
#: top-level keys of a grid file (``benchmark`` and ``parts`` required)
GRID_KEYS = ("benchmark", "description", "techniques", "technique_encodings", "encoding_options", "parts")
#: keys of one part (``name``, ``recipe``, ``encodings``, ``seeds`` required)
PART_KEYS = ("name", "recipe", "overrides", "encodings", "seeds", "first_seed_only", "evaluate", "needs_data", "notes")
#: the benchmarks that read grids, and the ``evaluate`` keys each needs (required, optional)
EVALUATE_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "resolution": (("train_size", "patch"), ("eval_subset",)),
}
#: the command that runs each benchmark's grids (``vispe bench GRID`` dispatches here)
BENCHMARK_MAINS: dict[str, str] = {"resolution": "vispe.benchmarks.resolution_benchmark:main"}
#: keys of an ``encodings: {...}`` query
_QUERY_KEYS = ("registry", "add")
#: registered 2D encodings no benchmark trains on their own: the parts of the vision towers' composed encodings
#: (benchmarked through their towers). Replaced by the registry's ``benchmark`` tag once records carry tags.
_NOT_BENCHMARKED = frozenset({"learned_resampled", "learned_xy"})


def select_encodings(query: Sequence[str] | Mapping[str, Any]) -> tuple[str, ...]:
    """The encodings of a grid part: a list of names as written, or a registry query
    ``{registry: {grid_ndim: 2}, add: [learned+rope_axial]}``: every encoding ``vispe.list_encodings(**registry)``
    lists (sorted by name) that a benchmark trains on its own -- not a multimodal position scheme (those are the
    video-LLM's, ``vispe niah``), not a part of a vision tower's composed encoding -- then the ``add`` names
    (compositions are not registered). A new encoding joins every registry grid without a list to edit."""
    import vispe
    from vispe.positions import SCHEMES

    if isinstance(query, str) or not isinstance(query, (Mapping, Sequence)):
        raise ValueError(f"encodings={query!r} is not valid; give a list of names or {{registry: {{grid_ndim: 2}}, add: [...]}}")
    if not isinstance(query, Mapping):
        names = tuple(str(n) for n in query)
    else:
        _refuse_unknown(query, _QUERY_KEYS, "encodings")
        registry = query.get("registry") or {}
        if not isinstance(registry, Mapping):
            raise ValueError(f"encodings.registry={registry!r} is not valid; give list_encodings filters such as {{grid_ndim: 2}}")
        _refuse_unknown(registry, ("kind", "grid_ndim"), "encodings.registry")
        listed = vispe.list_encodings(**registry) if "registry" in query else []
        names = tuple(n for n in listed if n not in SCHEMES and n not in _NOT_BENCHMARKED) + tuple(query.get("add") or ())
    for name in names:
        vispe.get_encoding_class(name)  # an unknown name fails here, naming the registered ones
    return names


def _refuse_unknown(mapping: Mapping[str, Any], keys: Sequence[str], where: str) -> None:
    bad = [k for k in mapping if k not in keys]
    if bad:
        raise ValueError(f"{where}: unknown key {bad[0]!r}; choose from {list(keys)}{did_you_mean(bad[0], keys)}")


@dataclass(frozen=True)
class Part:
    """One trained table of a grid: a recipe with dotted LightningCLI overrides, which encodings with which seeds, and
    what the benchmark's scoring needs (``evaluate``)."""

    name: str
    recipe: str
    overrides: dict[str, Any]
    encodings: tuple[str, ...]
    seeds: tuple[int, ...]
    evaluate: dict[str, Any] = field(default_factory=dict)
    first_seed_only: tuple[str, ...] = ()  # these train seeds[0] only; the others every seed
    needs_data: str | None = None  # folder under the data root the part reads
    notes: str = ""
    techniques: tuple[str, ...] = ()  # technique names turned on (the grid's ``techniques``), run for technique_encodings
    technique_encodings: tuple[str, ...] = ()
    only_seeds: tuple[int, ...] | None = None  # keep these of runs(); a one-seed encoding keeps seeds[0]

    def runs(self) -> list[tuple[str, int]]:
        """``(run encoding, seed)``; a run encoding is an encoding name or ``<encoding>+<technique>``."""
        plain = [(e, s) for e in self.encodings for s in (self.seeds[:1] if e in self.first_seed_only else self.seeds)]
        extra = [(f"{e}+{t}", s) for e in self.encodings if e in self.technique_encodings for t in self.techniques for s in self.seeds]
        runs = plain + extra
        return runs if self.only_seeds is None else [(e, s) for e, s in runs if s in self.only_seeds]

    def replace(self, **changes: Any) -> Part:
        return Part(**{**self.__dict__, **changes})


@dataclass(frozen=True)
class Grid:
    """A grid file, checked: its benchmark, parts and the options of its techniques and encodings."""

    name: str
    benchmark: str
    parts: tuple[Part, ...]
    description: str = ""
    techniques: dict[str, str] = field(default_factory=dict)
    encoding_options: dict[str, dict[str, Any]] = field(default_factory=dict)

    def part(self, name: str) -> Part:
        names = [p.name for p in self.parts]
        if name not in names:
            raise ValueError(f"grid {self.name!r} has no part {name!r}; its parts: {names}{did_you_mean(name, names)}")
        return self.parts[names.index(name)]

    def split_run_encoding(self, run_encoding: str) -> tuple[str, str | None]:
        """``'rope_axial+randpos'`` -> ``('rope_axial', 'randpos')``; a plain or composed name
        (``'learned+rope_axial'``) -> ``(name, None)``."""
        encoding, _, technique = run_encoding.rpartition("+")
        return (encoding, technique) if technique in self.techniques else (run_encoding, None)

    def pos_encoding(self, run_encoding: str) -> Any:
        """The ``model.init_args.pos_encoding`` value of a run: ``'rope_axial[random_positions=2.0]'`` for a technique
        run, ``{name: seqpe, ...}`` for an encoding with options, else the name."""
        encoding, technique = self.split_run_encoding(run_encoding)
        if technique is not None:
            return f"{encoding}[{self.techniques[technique]}]"
        options = self.encoding_options.get(encoding)
        return {"name": encoding, **options} if options else encoding


def list_grids() -> list[str]:
    """Names of the grids shipped with vispe (``vispe/recipes/grids/<name>.yaml``)."""
    folder = resources.files("vispe.recipes").joinpath("grids")
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def grid_path(name_or_path: str | Path, benchmark: str | None = None) -> Path:
    """The YAML file of a grid: an existing file, a shipped grid name, or (with ``benchmark``) the short name of one of
    that benchmark's shipped grids (``'cpu'`` -> ``resolution_cpu``). Unknown names raise naming the shipped ones."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    name, shipped = str(name_or_path), list_grids()
    for candidate in ([f"{benchmark}_{name}"] if benchmark else []) + [name]:
        if candidate in shipped:
            return Path(str(resources.files("vispe.recipes").joinpath("grids", f"{candidate}.yaml")))
    mine = [g[len(benchmark) + 1:] for g in shipped if benchmark and g.startswith(benchmark + "_")] or shipped
    raise ValueError(f"grid={name!r} is neither a shipped grid nor a YAML file; choose one of {mine}{did_you_mean(name, mine)}")


def is_grid(name_or_path: str) -> bool:
    """A shipped grid's name or a YAML file (``vispe bench GRID``)."""
    return name_or_path in list_grids() or (Path(name_or_path).suffix in (".yaml", ".yml") and Path(name_or_path).is_file())


def bench_grid(argv: Sequence[str]) -> int:
    """``vispe bench GRID [options]``: the grid's own benchmark command with ``--grid GRID`` (its options follow)."""
    import yaml

    path = grid_path(argv[0])
    data = yaml.safe_load(path.read_text())
    kind = data.get("benchmark") if isinstance(data, dict) else None
    if kind not in BENCHMARK_MAINS:
        raise ValueError(f"grid {str(path)!r}: benchmark={kind!r} is not valid; choose one of {list(BENCHMARK_MAINS)}")
    return _function(BENCHMARK_MAINS[kind])(["--grid", str(argv[0]), *argv[1:]])


def load_grid(name_or_path: str | Path, benchmark: str | None = None) -> Grid:
    """Read and check a grid file (see the module's docstring); ``benchmark`` also requires the grid to be that
    benchmark's. Every error is one ``ValueError`` naming the file, the key and what is valid."""
    import yaml

    from vispe.recipes import recipe_path

    path = grid_path(name_or_path, benchmark)
    where = f"grid {str(path)!r}"
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"{where} is not valid YAML: {' '.join(str(err).split())}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where} is not a mapping with the keys {list(GRID_KEYS)}")
    try:
        _refuse_unknown(data, GRID_KEYS, "")
        for key in ("benchmark", "parts"):
            if key not in data:
                raise ValueError(f": missing key {key!r}")
        kind = data["benchmark"]
        if kind not in EVALUATE_KEYS:  # one entry per benchmark of BENCHMARK_MAINS
            raise ValueError(f": benchmark={kind!r} is not valid; choose one of {list(EVALUATE_KEYS)}{did_you_mean(kind, EVALUATE_KEYS)}")
        if benchmark is not None and kind != benchmark:
            raise ValueError(f" is a {kind!r} grid, not a {benchmark!r} grid")
        techniques = {str(k): str(v) for k, v in (data.get("techniques") or {}).items()}
        technique_encodings = tuple(data.get("technique_encodings") or ())
        encoding_options = {str(k): dict(v) for k, v in (data.get("encoding_options") or {}).items()}
        if not isinstance(data["parts"], list) or not data["parts"]:
            raise ValueError(": parts must be a non-empty list of parts")
        parts = []
        for i, raw in enumerate(data["parts"]):
            label = f"parts[{i}]" + (f" ({raw.get('name')!r})" if isinstance(raw, dict) and raw.get("name") else "")
            if not isinstance(raw, dict):
                raise ValueError(f": {label} is not a mapping with the keys {list(PART_KEYS)}")
            _refuse_unknown(raw, PART_KEYS, f"{label}")
            missing = [k for k in ("name", "recipe", "encodings", "seeds") if k not in raw]
            if missing:
                raise ValueError(f": {label}: missing key {missing[0]!r}")
            recipe_path(raw["recipe"])  # an unknown recipe: one line naming the shipped ones
            overrides = dict(raw.get("overrides") or {})
            bad = [k for k in overrides if k.split(".")[0] not in ("trainer", "model", "data", "threads", "seed_everything")]
            if bad:
                raise ValueError(f": {label}: override {bad[0]!r} is not a dotted LightningCLI key (trainer.*, model.*, data.*)")
            required, optional = EVALUATE_KEYS[kind]
            evaluate = dict(raw.get("evaluate") or {})
            _refuse_unknown(evaluate, required + optional, f"{label}.evaluate")
            missing = [k for k in required if k not in evaluate]
            if missing:
                raise ValueError(f": {label}.evaluate: missing key {missing[0]!r} (a {kind!r} part needs {list(required)})")
            seeds = tuple(int(s) for s in raw["seeds"])
            if not seeds:
                raise ValueError(f": {label}: seeds must list at least one seed")
            parts.append(Part(name=str(raw["name"]), recipe=str(raw["recipe"]), overrides=overrides,
                              encodings=select_encodings(raw["encodings"]), seeds=seeds, evaluate=evaluate,
                              first_seed_only=tuple(raw.get("first_seed_only") or ()), needs_data=raw.get("needs_data"),
                              notes=str(raw.get("notes") or ""), technique_encodings=technique_encodings))
    except ValueError as err:
        text = str(err)
        raise ValueError(f"{where}{text}" if text.startswith((":", " ")) else f"{where}: {text}") from None
    return Grid(name=path.stem, benchmark=kind, parts=tuple(parts), description=str(data.get("description") or ""),
                techniques=techniques, encoding_options=encoding_options)


# ------------------------------------------------------------------------------------------------------------------
# training a grid's runs: every run is vispe.runner.run, in this process or in a pool of runner workers
# ------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunTask:
    """One run to train: ``runner.run(recipe, overrides, seed=seed, ckpt_path=ckpt_path)``; ``log``: the file its
    output goes to when it trains in a worker process.

    ``score`` (``'module:function'``, importable in a worker) scores the trained run where it trained, with the run's
    own Trainer: ``function(task, result, started)`` (``result``: the :class:`vispe.runner.RunResult`; ``started``:
    ``(time.perf_counter(), time.process_time())`` at the run's start) returns the benchmark's row. ``callbacks``
    (``'module:function'`` each) make Lightning callbacks for the run: ``function(task)``. ``context``: what they
    need (picklable)."""

    name: str
    recipe: str
    overrides: dict[str, Any]
    seed: int
    ckpt_path: str | None = None
    log: Path | None = None
    score: str | None = None
    callbacks: tuple[str, ...] = ()
    context: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def _output_to(path: Path | None) -> Iterator[None]:
    """stdout and stderr (the file descriptors: Lightning's and torch's output too) into ``path`` for the block."""
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(path, "a") as fh:
        os.dup2(fh.fileno(), 1)
        os.dup2(fh.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def _function(target: str) -> Callable[..., Any]:
    import importlib

    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _train(task: RunTask) -> tuple[float, Any]:
    """A runner worker: train one run (and score it, with ``task.score``); returns its training wall time in seconds
    and the score."""
    import warnings

    from vispe.runner import run

    with _output_to(task.log), warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*GPU available but not used.*")
        started = (time.perf_counter(), time.process_time())
        result = run(task.recipe, task.overrides, seed=task.seed, ckpt_path=task.ckpt_path,
                     callbacks=[_function(c)(task) for c in task.callbacks])
        seconds = time.perf_counter() - started[0]
        return seconds, None if task.score is None else _function(task.score)(task, result, started)


def train_one(task: RunTask) -> Any:
    """Train one run in this process; returns what its ``score`` function returned."""
    return _train(RunTask(**{**task.__dict__, "log": None}))[1]


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def train_runs(tasks: Sequence[RunTask], jobs: int = 1, threads: int = 1,
               done: Callable[[RunTask, float, Any], None] | None = None, log: Callable[[str], None] | None = None) -> None:
    """Train ``tasks`` in order through :func:`vispe.runner.run`: in this process for ``jobs == 1``, else ``jobs`` at a
    time in a process pool of runner workers (spawned, ``OMP_NUM_THREADS=threads``, a fixed hash seed; each run's output
    goes to its ``log`` file). ``done(task, seconds, score)`` is called as each run finishes (``score``: what
    ``task.score`` returned, else ``None``); a failed run raises naming its log."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs={jobs!r} is not valid; it must be an integer >= 1 (runs trained at a time)")
    say = log or (lambda msg: None)
    if jobs == 1:
        for task in tasks:
            say(f"[{time.strftime('%H:%M:%S')}] start {task.name}")
            seconds, score = _train(RunTask(**{**task.__dict__, "log": None}))
            if done is not None:
                done(task, seconds, score)
        return
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    from vispe.cli import exit_without_final_collection

    todo = list(tasks)
    # each worker ends without the interpreter's last collection (2-3 s a worker with torch and Lightning imported)
    with _environment(OMP_NUM_THREADS=str(threads), PYTHONHASHSEED="0"), \
            ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                                initializer=exit_without_final_collection) as pool:
        running: dict[Any, RunTask] = {}
        while todo or running:
            while todo and len(running) < jobs:  # one start at a time, so the log says when each run began
                task = todo.pop(0)
                say(f"[{time.strftime('%H:%M:%S')}] start {task.name}")
                running[pool.submit(_train, task)] = task
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                task = running.pop(future)
                err = future.exception()
                if err is not None:
                    raise RuntimeError(f"{task.name} failed ({type(err).__name__}: {err}); see {task.log}") from err
                seconds, score = future.result()
                say(f"[{time.strftime('%H:%M:%S')}] {task.name} done in {seconds:.1f} s")
                if done is not None:
                    done(task, seconds, score)


# ------------------------------------------------------------------------------------------------------------------
# the command line every benchmark shares
# ------------------------------------------------------------------------------------------------------------------
def benchmark_parser(prog: str, description: str, formatter: str = "defaults") -> argparse.ArgumentParser:
    """The parser of a benchmark command, the one construction every ``vispe`` benchmark command uses (its options
    come from :func:`add_recipe_arguments` and :class:`vispe.cli_options.Options`). ``formatter``: ``'defaults'``
    (the help shows each default), ``'raw'`` (the description as written: a module docstring) or ``'plain'``."""
    formatters = {"defaults": argparse.ArgumentDefaultsHelpFormatter, "raw": argparse.RawDescriptionHelpFormatter,
                  "plain": argparse.HelpFormatter}
    return argparse.ArgumentParser(prog=prog, description=description, formatter_class=formatters[formatter])


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
