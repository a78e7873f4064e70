"""Benchmark grids as data: the grid format refuses bad keys early (naming the key, the file and the choices), the
registry query selects the 2D encodings a benchmark trains, and each shipped resolution grid makes exactly the runs
(names, encoding values, overrides, seeds) the Python parts it replaced made."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from vispe.benchmarks.grid import Part, list_grids, load_grid, select_encodings
from vispe.benchmarks.resolution_benchmark import run_task

#: the resolution benchmark's 2D encodings when the grids replaced the hand-written list (ALL_2D): a change in what
#: the registry query selects shows here
ALL_2D_AT_WRITING = ("none", "learned", "sincos2d", "rope_axial", "rope_mixed", "irpe", "cpe", "lff", "loope", "comrope_ap",
                     "comrope_ld", "rope_dinov3", "alibi_2d", "fire", "liere", "seqpe", "learned+rope_axial", "qwen3vl_vision",
                     "glm4v_vision", "gemma4_vision")
#: the catalogue's 2D encodings registered after ALL_2D_AT_WRITING was written (they join the registry grids unlisted)
NEWER_2D = {"pope", "golden_rope", "nd_rope", "spherical_rope"}
HEADLINE = ("learned", "sincos2d", "rope_axial", "rope_mixed", "comrope_ap", "comrope_ld")
QUICK_ENCODINGS = ("learned", "sincos2d", "rope_axial", "rope_mixed", "irpe", "cpe", "lff", "loope", "comrope_ap", "comrope_ld", "none")
MIXED = {"data.init_args.resolutions": [[28, 28], [21, 35], [35, 21], [21, 21], [35, 35]],
         "data.init_args.resolution_sampling": "sample", "data.init_args.patch_size": 7}
TECHNIQUES = {"coordaug": "coord_shift=1.0,coord_rescale=2.0", "randpos": "random_positions=2.0"}
SEQPE = {"name": "seqpe", "num_pivots": 8, "num_negatives": 16, "num_windows": 8, "num_distill": 16}
#: the Python parts the grids replaced: (grid, part) -> (recipe, overrides, encodings, seeds, encodings with every
#: seed, train size, patch, eval subset, data folder)
OLD_PARTS = {
    ("tiny", "synthetic"): ("synthetic_tiny", {}, ("none", "rope_axial"), (0, 1), ("rope_axial",), 16, 4, None, None),
    ("cpu", "fashion_mnist"): ("fashion_mnist", {}, ALL_2D_AT_WRITING, (0, 1, 2),
                               HEADLINE + ("rope_dinov3", "alibi_2d", "fire", "liere", "seqpe", "learned+rope_axial",
                                           "qwen3vl_vision", "glm4v_vision", "gemma4_vision"), 28, 7, None, "fashion-mnist"),
    ("cpu", "cifar10"): ("cifar10_cpu", {}, HEADLINE, (0, 1, 2), HEADLINE, 32, 4, 5000, "cifar10-jpeg"),
    ("cpu", "fashion_mnist_mixed"): ("fashion_mnist", MIXED, HEADLINE, (0, 1, 2), HEADLINE, 28, 7, None, "fashion-mnist"),
    ("gpu", "cifar10"): ("cifar10", {"trainer.accelerator": "gpu", "trainer.precision": "bf16-mixed", "data.init_args.batch_size": 256},
                         HEADLINE, (0, 1, 2), HEADLINE, 32, 4, None, "cifar10-jpeg"),
    ("cifar10_quick", "cifar10"): ("cifar10_cpu", {"trainer.max_epochs": 2, "trainer.log_every_n_steps": 10,
                                                   "model.init_args.warmup_epochs": 0.25, "data.init_args.train_subset": 10000,
                                                   "data.init_args.eval_subset": 2000},
                                   QUICK_ENCODINGS, (0,), (), 32, 4, 2000, "cifar10-jpeg"),
}


def _old_runs(encodings, seeds, every_seed, techniques=()):
    plain = [(e, s) for e in encodings for s in (seeds if e in every_seed else seeds[:1])]
    return plain + [(f"{e}+{t}", s) for e in encodings if e in ("rope_axial", "rope_mixed", "comrope_ld") for t in techniques for s in seeds]


def _old_pos_encoding(run_encoding):
    encoding, _, technique = run_encoding.rpartition("+")
    if technique in TECHNIQUES:
        return f"{encoding}[{TECHNIQUES[technique]}]"
    return SEQPE if run_encoding == "seqpe" else run_encoding


def test_registry_selection_is_the_list_it_replaced():
    selected = select_encodings({"registry": {"grid_ndim": 2}, "add": ["learned+rope_axial"]})
    assert set(ALL_2D_AT_WRITING) <= set(selected) and len(selected) == len(set(selected))
    # what joined since the list was written: the catalogue's newer encodings, with no list edited
    assert set(selected) - set(ALL_2D_AT_WRITING) == NEWER_2D
    assert select_encodings(["rope_axial", "none"]) == ("rope_axial", "none")  # a list is taken as written
    with pytest.raises(ValueError, match="unknown key 'tags'; choose from \\['registry', 'add'\\]"):
        select_encodings({"tags": ["benchmark"]})
    with pytest.raises(ValueError, match="encodings.registry: unknown key 'ndim'.*grid_ndim"):
        select_encodings({"registry": {"ndim": 2}})
    with pytest.raises(ValueError, match="unknown positional encoding 'rope_9d'"):
        select_encodings(["rope_9d"])


@pytest.mark.parametrize("grid_name, part_name", list(OLD_PARTS))
def test_shipped_grids_make_the_runs_of_the_parts_they_replaced(grid_name, part_name, tmp_path):
    recipe, overrides, encodings, seeds, every_seed, train_size, patch, eval_subset, data = OLD_PARTS[(grid_name, part_name)]
    grid = load_grid(grid_name, "resolution")
    part = grid.part(part_name)
    assert (part.recipe, part.overrides, part.seeds, part.needs_data) == (recipe, overrides, seeds, data)
    assert part.evaluate == {"train_size": train_size, "patch": patch, **({"eval_subset": eval_subset} if eval_subset else {})}
    techniques = tuple(TECHNIQUES) if grid.techniques else ()
    part = part.replace(techniques=techniques)
    # the old part's runs, exactly; a registry query adds the encodings registered since (their own runs only)
    old = _old_runs(encodings, seeds, every_seed, techniques)
    kept = [r for r in part.runs() if r[0].split("+")[0] in encodings or r[0] in encodings]
    assert sorted(kept) == sorted(old)
    assert {r[0] for r in part.runs()} - {r[0] for r in kept} <= NEWER_2D
    for run_encoding, seed in part.runs():
        task = run_task(grid, part, run_encoding, seed, tmp_path, "/data")
        assert task.name == f"{run_encoding}-s{seed}" and task.seed == seed and task.recipe == recipe
        assert task.overrides["model.init_args.pos_encoding"] == _old_pos_encoding(run_encoding)
        assert {k: task.overrides[k] for k in overrides} == overrides
        assert task.overrides.get("data.init_args.dataset.init_args.data_dir") == (str(Path("/data") / data) if data else None)


def test_every_shipped_grid_loads():
    assert {"resolution_tiny", "resolution_cpu", "resolution_gpu", "resolution_cifar10_quick"} <= set(list_grids())
    for name in list_grids():
        grid = load_grid(name)
        assert grid.parts and all(isinstance(p, Part) and p.runs() for p in grid.parts)


def _write(tmp_path, grid):
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(grid))
    return path


GOOD_PART = {"name": "p", "recipe": "synthetic_tiny", "encodings": ["none"], "seeds": [0], "evaluate": {"train_size": 16, "patch": 4}}


@pytest.mark.parametrize("grid, needles", [
    ({"benchmark": "resolution", "part": [GOOD_PART]}, ["unknown key 'part'", "'parts'"]),
    ({"benchmark": "speed", "parts": [GOOD_PART]}, ["benchmark='speed' is not valid", "['resolution']"]),
    ({"benchmark": "resolution", "parts": [{**GOOD_PART, "encoding": ["none"]}]}, ["parts[0] ('p'): unknown key 'encoding'", "'encodings'"]),
    ({"benchmark": "resolution", "parts": [{**GOOD_PART, "evaluate": {"train_size": 16}}]}, ["evaluate: missing key 'patch'"]),
    ({"benchmark": "resolution", "parts": [{**GOOD_PART, "evaluate": {"train_size": 16, "patch": 4, "size": 3}}]},
     ["evaluate: unknown key 'size'", "'eval_subset'"]),
    ({"benchmark": "resolution", "parts": [{**GOOD_PART, "recipe": "tiny"}]}, ["recipe='tiny' is neither a shipped recipe"]),
    ({"benchmark": "resolution", "parts": [{**GOOD_PART, "overrides": {"max_epochs": 2}}]}, ["override 'max_epochs' is not a dotted"]),
    ({"benchmark": "resolution", "parts": [{**GOOD_PART, "encodings": {"registry": {"grid_ndim": 2}, "plus": ["x"]}}]},
     ["unknown key 'plus'", "['registry', 'add']"]),
])
def test_bad_grid_keys_are_refused_when_the_file_is_read(tmp_path, grid, needles):
    path = _write(tmp_path, grid)
    with pytest.raises(ValueError) as err:
        load_grid(path)
    text = str(err.value)
    assert text.startswith(f"grid {str(path)!r}") and "\n" not in text
    assert all(n in text for n in needles), text


def test_grid_names_short_long_and_misspelt(tmp_path):
    with pytest.raises(ValueError, match="grid='cpux' is neither a shipped grid nor a YAML file; choose one of .*did you mean 'cpu'"):
        load_grid("cpux", "resolution")
    assert load_grid("cpu", "resolution").name == load_grid("resolution_cpu").name == "resolution_cpu"


def test_a_newly_registered_2d_encoding_joins_the_registry_grids_and_three_cell_all():
    from vispe.benchmarks.three_cell import _resolve_encodings
    from vispe.encodings import base
    from vispe.encodings.absolute import SinCos2d

    class _NewEncoding(SinCos2d):
        """A stand-in for a new catalogue entry."""

    base.register_encoding("zz_new_2d")(_NewEncoding)
    try:
        part = load_grid("cpu", "resolution").part("fashion_mnist")
        assert "zz_new_2d" in part.encodings and "zz_new_2d" in dict(part.runs())
        assert "zz_new_2d" not in load_grid("cpu", "resolution").part("cifar10").encodings  # a list stays as written
        assert _resolve_encodings("all", quick=False) == list(select_encodings({"registry": {"grid_ndim": 2}}))
        assert "zz_new_2d" in _resolve_encodings("all", quick=False)
    finally:
        base._RECORDS.pop("zz_new_2d")
    assert set(_resolve_encodings("all", quick=False)) == (set(ALL_2D_AT_WRITING) - {"learned+rope_axial"}) | NEWER_2D


@pytest.mark.slow
def test_vispe_bench_runs_a_grid_by_name(tmp_path, capsys):
    from vispe.cli import main as vispe_main

    assert vispe_main(["bench", "resolution_tiny", "--encodings", "none", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "summary.json").read_text())["rows"]
    assert [(r["encoding"], r["seeds"]) for r in rows] == [("none", 1)]
    assert vispe_main(["bench", "resolution_tinyy"]) == 2
    assert "unknown benchmark 'resolution_tinyy'; choose 'speed', 'scaling', a grid [" in capsys.readouterr().err
