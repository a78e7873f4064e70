"""``vispe resolution-benchmark`` end to end on the tiny recipe (generated data, seconds): trains every run,
sweeps 0.5x-2x with both extrapolation policies, groups seeds, resumes without retraining."""
from __future__ import annotations

import json
import math
import statistics

import pytest
import yaml

from vispe.benchmarks.grid import load_grid
from vispe.benchmarks.resolution_benchmark import main, sizes, training_order


@pytest.mark.slow
def test_tiny_recipe_end_to_end_and_resume(tmp_path, capsys):
    assert main(["--grid", "tiny", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    sweep = json.loads((tmp_path / "synthetic" / "resolution" / "resolution.json").read_text())
    part = load_grid("tiny", "resolution").parts[0]
    assert sizes(part) == [8, 12, 16, 20, 24, 28, 32]  # 0.5x .. 2x of 16 px, patch 4
    rows = {(r["encoding"], r["extrapolation"]): r for r in summary["rows"]}
    assert set(rows) == {("none", "own (no option)"), ("rope_axial", "extend"), ("rope_axial", "interpolate")}
    assert rows[("rope_axial", "extend")]["seeds"] == 2 and rows[("none", "own (no option)")]["seeds"] == 1
    # the summary is the per-checkpoint sweep regrouped: mean and std over seeds, binomial s.e. for one seed
    per_seed = [r for r in sweep["results"] if r["encoding"] == "rope_axial" and r["extrapolation"] == "extend"]
    for s in sizes(part):
        vals = [r["accuracy"][str(s)]["top1"] for r in per_seed]
        row = rows[("rope_axial", "extend")]
        assert row["mean"][str(s)] == pytest.approx(statistics.fmean(vals))
        assert row["spread"][str(s)] == pytest.approx(statistics.stdev(vals))
        p = rows[("none", "own (no option)")]["mean"][str(s)] / 100
        assert rows[("none", "own (no option)")]["spread"][str(s)] == pytest.approx(100 * math.sqrt(p * (1 - p) / 64))
    assert (tmp_path / "summary.png").stat().st_size > 0 and "| rope_axial (extend) | 2 |" in (tmp_path / "summary.md").read_text()
    # a second call finds every checkpoint and trains nothing
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.glob("synthetic/*/version_*/checkpoints/last.ckpt")}
    assert len(stamps) == 3
    capsys.readouterr()
    assert main(["--grid", "tiny", "--out", str(tmp_path)]) == 0
    assert "start" not in capsys.readouterr().err
    assert stamps == {p: p.stat().st_mtime_ns for p in tmp_path.glob("synthetic/*/version_*/checkpoints/last.ckpt")}
    # a run killed mid-way has a last.ckpt (written every epoch) but no recorded wall time: it is not
    # skipped, it resumes from that checkpoint, and the table does not change
    timings_path = tmp_path / "synthetic" / "timings.json"
    timings = json.loads(timings_path.read_text())
    del timings["rope_axial-s1"]
    timings_path.write_text(json.dumps(timings))
    capsys.readouterr()
    assert main(["--grid", "tiny", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "start rope_axial-s1" in err and "start rope_axial-s0" not in err and "start none" not in err
    assert "rope_axial-s1" in json.loads(timings_path.read_text())
    assert json.loads((tmp_path / "summary.json").read_text())["rows"] == summary["rows"]


def test_training_order_resumes_killed_runs_first_then_goes_seed_by_seed(tmp_path):
    runs = [(e, s) for e in ("learned", "rope_axial", "comrope_ld") for s in (0, 1, 2)]
    (tmp_path / "comrope_ld-s1" / "checkpoints").mkdir(parents=True)
    (tmp_path / "comrope_ld-s1" / "checkpoints" / "last.ckpt").write_bytes(b"")  # killed mid-way
    (tmp_path / "learned-s1" / "checkpoints").mkdir(parents=True)
    (tmp_path / "learned-s1" / "checkpoints" / "last.ckpt").write_bytes(b"")  # finished: its time is recorded
    order = training_order(runs, tmp_path, {"learned-s0": 1.0, "learned-s1": 2.0})
    assert sorted(order) == sorted(set(runs) - {("learned", 0), ("learned", 1)})  # each unfinished run once
    assert order[0] == ("comrope_ld", 1)
    seeds = [s for _, s in order[1:]]
    assert seeds == sorted(seeds)  # then every encoding's seed 0, then seed 1, ...
    assert order[1:3] == [("rope_axial", 0), ("comrope_ld", 0)]  # recipe order within a seed


def test_bad_arguments_fail_before_training(tmp_path, capsys):
    assert main(["--grid", "tiny", "--parts", "imagenet", "--out", str(tmp_path)]) == 2
    assert "unknown part(s) ['imagenet']" in capsys.readouterr().err
    assert main(["--grid", "tiny", "--encodings", "rope_9d", "--out", str(tmp_path)]) == 2
    assert "unknown positional encoding 'rope_9d'" in capsys.readouterr().err
    # --recipe is a training recipe everywhere: a grid name there is refused naming the shipped recipes
    assert main(["--recipe", "cpu", "--out", str(tmp_path)]) == 2
    assert "recipe='cpu' is neither a shipped recipe" in capsys.readouterr().err
    assert main(["--grid", "cpux", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "grid='cpux' is neither a shipped grid" in err and "did you mean 'cpu'" in err
    assert main(["--grid", "cpu", "--parts", "fashion_mnist", "--data-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path)]) == 2
    assert "needs 'fashion-mnist'" in capsys.readouterr().err
    assert not any((tmp_path).glob("**/checkpoints"))


def test_claims_verdicts_follow_the_figures():
    from vispe.benchmarks.resolution_benchmark import claims

    def row(enc, policy, means, spread, seeds=3):
        return {"part": "p", "encoding": enc, "extrapolation": policy, "seeds": seeds, "train_size": 28,
                "mean": dict(means), "spread": {s: spread for s in means}}

    rows = [
        row("learned", "own (no option)", {28: 90.0, 35: 80.0, 56: 40.0}, 1.0),
        row("rope_mixed", "extend", {28: 90.0, 35: 90.5, 56: 60.0}, 1.0),
        row("rope_mixed", "interpolate", {28: 90.0, 35: 10.0, 56: 10.0}, 1.0),  # not the default policy: ignored
        row("comrope_ap", "own (no option)", {28: 90.0, 35: 85.0, 56: 40.5}, 1.0),
        row("comrope_ld", "own (no option)", {28: 90.0, 35: 85.0, 56: 20.0}, 1.0),
    ]
    got = {c["claim"].rsplit(" (", 1)[0]: c for c in claims(rows)}
    mixed = got["RoPE-Mixed keeps more accuracy than APE (learned) at 2x the training size"]
    assert mixed["verdict"] == "holds" and mixed["difference"] == pytest.approx(20.0)
    assert mixed["se"] == pytest.approx((2 / 3) ** 0.5)
    assert got["ComRoPE-AP keeps more accuracy than APE (learned) at 2x the training size"]["verdict"].startswith("not resolved")
    assert got["ComRoPE-LD keeps more accuracy than APE (learned) at 2x the training size"]["verdict"] == "does not hold"
    above = got["RoPE-Mixed improves slightly above the training size"]
    assert above["encoding"] == "rope_mixed @ 35px" and above["verdict"].startswith("not resolved")


@pytest.mark.slow
def test_same_command_same_numbers(tmp_path):
    """Run to run on one machine the benchmark's numbers are identical (seeded runs, one thread each), whether the
    runs train in this process or in a pool of runner workers (--jobs 2)."""
    tables = []
    for out, jobs in ((tmp_path / "a", "1"), (tmp_path / "b", "2")):
        assert main(["--grid", "tiny", "--out", str(out), "--encodings", "rope_axial", "--jobs", jobs]) == 0
        tables.append([(r["encoding"], r["extrapolation"], r["mean"]) for r in json.loads((out / "summary.json").read_text())["rows"]])
    assert tables[0] == tables[1]


@pytest.mark.slow
def test_parts_run_by_separate_calls_join_one_summary(tmp_path, monkeypatch, capsys):
    """A long part run on its own joins the top-level table: each part keeps its rows and meta in
    ``<part>/summary.json``; the top-level summary has every part of the recipe found under ``--out``, in the
    recipe's order. The sweep keeps evaluations a narrower call did not ask for, and reuses them later."""
    part = {"recipe": "synthetic_tiny", "seeds": [0], "evaluate": {"train_size": 16, "patch": 4}}
    grid_file = tmp_path / "two_parts.yaml"
    grid_file.write_text(yaml.safe_dump({"benchmark": "resolution", "parts": [
        {"name": "synthetic", "encodings": ["none"], **part}, {"name": "synthetic_b", "encodings": ["none", "rope_axial"], **part}]}))
    out = tmp_path / "bench"
    assert main(["--grid", str(grid_file), "--parts", "synthetic_b", "--encodings", "rope_axial", "--out", str(out)]) == 0
    assert main(["--grid", str(grid_file), "--parts", "synthetic", "--out", str(out)]) == 0
    alone = json.loads((out / "synthetic" / "summary.json").read_text())
    assert alone["meta"]["part"] == "synthetic" and alone["meta"]["argv"][-1] == str(out)
    assert all((out / p / "summary.png").stat().st_size > 0 for p in ("synthetic", "synthetic_b"))  # each part's own plot
    summary = json.loads((out / "summary.json").read_text())
    assert [r["part"] for r in summary["rows"]] == ["synthetic", "synthetic_b", "synthetic_b"]
    assert summary["rows"][0] == alone["rows"][0]
    assert summary["rows"][1:] == json.loads((out / "synthetic_b" / "summary.json").read_text())["rows"]
    assert set(summary["meta"]["earlier_parts"]) == {"synthetic_b"}
    text = (out / "summary.md").read_text()
    assert "### synthetic (" in text and "### synthetic_b (" in text and "Part `synthetic_b`: from an earlier call" in text
    # widening the second part trains and evaluates only the new run; narrowing it again evaluates nothing
    capsys.readouterr()
    assert main(["--grid", str(grid_file), "--parts", "synthetic_b", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "start none-s0" in printed.err and "start rope_axial" not in printed.err
    assert "none-s0" in printed.out and "rope_axial-s0 (extend)" not in printed.out
    assert main(["--grid", str(grid_file), "--parts", "synthetic_b", "--encodings", "rope_axial", "--out", str(out)]) == 0
    sweep = json.loads((out / "synthetic_b" / "resolution" / "resolution.json").read_text())
    assert {r["label"] for r in sweep["results"]} == {"rope_axial-s0 (extend)", "rope_axial-s0 (interpolate)"}
    assert [r["label"] for r in sweep["other_results"]] == ["none-s0"]
    capsys.readouterr()
    assert main(["--grid", str(grid_file), "--parts", "synthetic_b", "--out", str(out)]) == 0
    assert "none-s0" not in capsys.readouterr().out  # reused from other_results, not evaluated again


@pytest.mark.slow
def test_techniques_train_with_the_encoding_options_and_compare_with_the_plain_runs(tmp_path, capsys):
    """``--techniques``: each run ``<encoding>+<technique>`` is the encoding trained with the technique's options
    (recorded in the checkpoint), every seed; the summary keeps them apart from the plain rows and compares each with
    the plain row of the same policy; ``--policies all`` adds ntk / yarn; bad names are refused before training."""
    import torch

    techniques = load_grid("tiny", "resolution").techniques

    assert main(["--grid", "tiny", "--out", str(tmp_path), "--encodings", "rope_axial", "--techniques", "randpos",
                 "--policies", "all"]) == 0
    ckpt = torch.load(tmp_path / "synthetic" / "rope_axial+randpos-s1" / "version_0" / "checkpoints" / "last.ckpt", map_location="cpu",
                      weights_only=False)
    assert ckpt["hyper_parameters"]["pos_encoding"] == f"rope_axial[{techniques['randpos']}]"
    summary = json.loads((tmp_path / "summary.json").read_text())
    rows = {(r["technique"], r["extrapolation"]): r for r in summary["rows"]}
    assert set(rows) == {(t, p) for t in (None, "randpos") for p in ("extend", "interpolate", "ntk", "yarn")}
    assert all(r["seeds"] == 2 for r in rows.values())
    effects = {(e["technique"], e["extrapolation"]): e["effects"] for e in summary["techniques"]}
    assert set(effects) == {("randpos", p) for p in ("extend", "interpolate", "ntk", "yarn")}
    e2x = effects[("randpos", "extend")]["2x"]
    assert e2x["size"] == 32 and e2x["difference"] == pytest.approx(rows[("randpos", "extend")]["mean"]["32"]
                                                                   - rows[(None, "extend")]["mean"]["32"])
    assert "| rope_axial + randpos (extend) | 2 |" in (tmp_path / "summary.md").read_text()
    assert (tmp_path / "techniques.png").stat().st_size > 0
    # the claims use the plain rows only
    assert all("+" not in c["encoding"] for c in summary["claims"])
    capsys.readouterr()
    assert main(["--grid", "tiny", "--out", str(tmp_path / "bad"), "--techniques", "dropout"]) == 2
    assert "unknown technique(s) ['dropout']" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def _data_root():
    import os
    from pathlib import Path

    env = os.environ.get("VISPE_TEST_DATA")
    root = Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"
    return root if (root / "cifar10-jpeg").is_dir() else None


@pytest.mark.skipif(_data_root() is None, reason="real data folder (../shared/data or $VISPE_TEST_DATA) with cifar10-jpeg not present")
@pytest.mark.slow
def test_gpu_recipe_trains_on_cpu_with_a_tiny_budget(tmp_path):
    """No GPU here: the GPU recipe's own fit command (its model, schedule, data) runs 2 steps on CPU (through the runner, as the benchmark runs it)."""
    from vispe.benchmarks.resolution_benchmark import run_task
    from vispe.runner import run

    grid = load_grid("gpu", "resolution")
    task = run_task(grid, grid.parts[0], "rope_mixed", 0, tmp_path, str(_data_root()))
    assert task.overrides["trainer.accelerator"] == "gpu" and task.recipe == "cifar10"
    overrides = {**task.overrides, "trainer.accelerator": "cpu", "trainer.precision": "32-true", "trainer.max_steps": 2,
                 "trainer.max_epochs": 1, "trainer.limit_val_batches": 1, "data.init_args.train_subset": 64,
                 "data.init_args.eval_subset": 64}
    run(task.recipe, overrides, seed=task.seed)
    assert list(tmp_path.glob("rope_mixed-s0/**/checkpoints/last.ckpt"))


@pytest.mark.slow
def test_aspect_ratio_part_on_trained_runs_and_sweep_only(tmp_path, capsys):
    import shutil

    ratios = "1:2,1:1,2:1"
    assert main(["--grid", "tiny", "--out", str(tmp_path), "--aspect-ratios", ratios]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    aspect = json.loads((tmp_path / "synthetic" / "aspect" / "resolution.json").read_text())
    rows = {(r["encoding"], r["extrapolation"]): r for r in summary["aspect_rows"]}
    assert set(rows) == {("none", "own (no option)"), ("rope_axial", "extend"), ("rope_axial", "interpolate")}
    assert rows[("rope_axial", "extend")]["seeds"] == 2 and rows[("none", "own (no option)")]["seeds"] == 1
    # shapes at the training grid's token budget (16 px, patch 4: 4x4 = 16 tokens): 1:1 is the training shape,
    # the others have the ratio's width:height and about 16 tokens
    shapes = {a["label"]: a for a in rows[("rope_axial", "extend")]["aspects"]}
    assert [a["label"] for a in rows[("rope_axial", "extend")]["aspects"]] == ["1:2", "1:1", "2:1"]
    assert shapes["1:1"]["shape"] == "16x16" and shapes["1:1"]["tokens"] == 16
    for label, ratio in (("1:2", 0.5), ("2:1", 2.0)):
        h, w = (int(v) for v in shapes[label]["shape"].split("x"))
        assert w / h == pytest.approx(ratio) and 12 <= shapes[label]["tokens"] <= 20
    # the table is the per-checkpoint aspect sweep regrouped over seeds
    per_seed = [r for r in aspect["results"] if r["encoding"] == "rope_axial" and r["extrapolation"] == "interpolate"]
    assert len(per_seed) == 2 and all(e["sweep"] == "aspect" for r in per_seed for e in r["evaluations"])
    for label in ("1:2", "1:1", "2:1"):
        vals = [next(e["top1"] for e in r["evaluations"] if e["aspect_label"] == label) for r in per_seed]
        assert rows[("rope_axial", "interpolate")]["mean"][label] == pytest.approx(statistics.fmean(vals))
        assert rows[("rope_axial", "interpolate")]["spread"][label] == pytest.approx(statistics.stdev(vals))
    # at the training shape the aspect sweep and the size sweep evaluate the same images the same way
    size_rows = {(r["encoding"], r["extrapolation"]): r for r in summary["rows"]}
    assert rows[("rope_axial", "extend")]["mean"]["1:1"] == pytest.approx(size_rows[("rope_axial", "extend")]["mean"]["16"])
    md = (tmp_path / "summary.md").read_text()
    assert "aspect ratio width:height" in md and "1:1 16x16 (16 tok)*" in md and "| rope_axial (interpolate) | 2 |" in md
    assert (tmp_path / "aspect.png").stat().st_size > 0 and (tmp_path / "synthetic" / "aspect.png").stat().st_size > 0
    # --sweep-only trains nothing and leaves out the runs without a checkpoint; --aspect-only re-runs the aspect
    # sweep alone and keeps the part's size table of the earlier call
    shutil.rmtree(tmp_path / "synthetic" / "rope_axial-s1")
    size_sweep = tmp_path / "synthetic" / "resolution" / "resolution.json"
    stamp = size_sweep.stat().st_mtime_ns
    capsys.readouterr()
    assert main(["--grid", "tiny", "--out", str(tmp_path), "--aspect-ratios", ratios, "--sweep-only", "--aspect-only"]) == 0
    err = capsys.readouterr().err
    assert "start" not in err and "no last.ckpt for rope_axial-s1" in err
    again_summary = json.loads((tmp_path / "summary.json").read_text())
    again = {(r["encoding"], r["extrapolation"]): r for r in again_summary["aspect_rows"]}
    assert again[("rope_axial", "extend")]["seeds"] == 1
    assert again_summary["rows"] == summary["rows"] and size_sweep.stat().st_mtime_ns == stamp
    assert not (tmp_path / "synthetic" / "rope_axial-s1").exists()
    assert main(["--grid", "tiny", "--out", str(tmp_path), "--aspect-ratios", "1:0"]) == 2
    assert "--aspect-ratios='1:0' is not valid; it must be width:height ratios" in capsys.readouterr().err
    assert main(["--grid", "tiny", "--out", str(tmp_path / "empty"), "--sweep-only"]) == 2
    assert main(["--grid", "tiny", "--out", str(tmp_path), "--aspect-only"]) == 2  # needs --aspect-ratios


@pytest.mark.slow
def test_train_only_calls_per_seed_then_one_sweep(tmp_path, capsys):
    # training split over calls (one per seed, as two CPU queues would run them) writes checkpoints and no sweep;
    # the --sweep-only call after them sweeps every run and trains nothing
    assert main(["--grid", "tiny", "--out", str(tmp_path), "--seeds", "0", "--train-only"]) == 0
    assert "--train-only: 2 run(s)" in capsys.readouterr().err
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "synthetic" / "resolution").exists()
    assert main(["--grid", "tiny", "--out", str(tmp_path), "--seeds", "1", "--train-only"]) == 0
    err = capsys.readouterr().err
    # seed 0 is done (skipped); `none` has one seed, its run is seed 0: --seeds 1 leaves it alone
    assert "start rope_axial-s1" in err and "-s0" not in err and "start none" not in err
    assert set(json.loads((tmp_path / "synthetic" / "timings.json").read_text())) == {"none-s0", "rope_axial-s0", "rope_axial-s1"}
    assert main(["--grid", "tiny", "--out", str(tmp_path), "--sweep-only"]) == 0
    assert "start" not in capsys.readouterr().err
    rows = {(r["encoding"], r["extrapolation"]): r for r in json.loads((tmp_path / "summary.json").read_text())["rows"]}
    assert rows[("rope_axial", "extend")]["seeds"] == 2 and rows[("none", "own (no option)")]["seeds"] == 1
    assert main(["--grid", "tiny", "--out", str(tmp_path), "--train-only", "--sweep-only"]) == 2
    assert "--train-only and --sweep-only cannot be used together" in capsys.readouterr().err
    assert main(["--grid", "tiny", "--out", str(tmp_path), "--seeds", "7", "--train-only"]) == 2
    assert "no run has these seeds (the parts' seeds: [0, 1])" in capsys.readouterr().err


@pytest.mark.slow
def test_timings_of_concurrent_calls_are_merged_not_overwritten(tmp_path):
    # two training calls on one part (e.g. a --seeds 1 queue and a --seeds 2 queue) each record their runs; a call
    # must not write back its own stale copy over a run the other finished meanwhile
    import multiprocessing as mp

    from vispe.benchmarks.resolution_benchmark import record_timing

    path = tmp_path / "timings.json"
    record_timing(path, "a-s0", 1.0)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_record_many, args=(path, tag)) for tag in ("x", "y")]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join(60)
        assert pr.exitcode == 0
    timings = json.loads(path.read_text())
    assert set(timings) == {"a-s0"} | {f"{tag}-s{i}" for tag in ("x", "y") for i in range(20)}
    assert not list(tmp_path.glob("*.tmp"))


def _record_many(path, tag):
    from vispe.benchmarks.resolution_benchmark import record_timing

    for i in range(20):
        record_timing(path, f"{tag}-s{i}", float(i))


def test_mixed_resolution_part_trains_the_fashion_mnist_recipe_on_mixed_grids(tmp_path):
    from vispe.benchmarks.resolution_benchmark import run_task
    from vispe.data.image_datamodule import parse_resolutions

    grid = load_grid("cpu", "resolution")
    mixed, plain = grid.part("fashion_mnist_mixed"), grid.part("fashion_mnist")
    assert mixed.recipe == plain.recipe and mixed.evaluate == plain.evaluate == {"train_size": 28, "patch": 7}
    assert mixed.encodings == grid.part("cifar10").encodings and mixed.seeds == (0, 1, 2)
    resolutions = mixed.overrides["data.init_args.resolutions"]
    grids = {(h // 7, w // 7) for h, w in parse_resolutions(resolutions, 7)}
    assert (4, 4) in grids and {(3, 5), (5, 3)} <= grids  # the training grid and both orientations
    task = run_task(grid, mixed, "rope_mixed", 1, tmp_path, str(tmp_path / "data"))
    assert task.overrides["data.init_args.resolutions"] == resolutions
    assert task.overrides["data.init_args.resolution_sampling"] == "sample" and task.overrides["data.init_args.patch_size"] == 7
    assert task.recipe == "fashion_mnist" and task.seed == 1
    assert task.overrides["data.init_args.dataset.init_args.data_dir"] == str(tmp_path / "data" / "fashion-mnist")


def test_published_fashion_mnist_table_is_the_report_of_its_raw_results():
    """docs/resolution-benchmark.md shows the table :func:`markdown` makes from the raw results in results/ (every row)."""
    from pathlib import Path

    from vispe.benchmarks.resolution_benchmark import _int_sizes, markdown

    root = Path(__file__).resolve().parents[1]
    raw = json.loads((root / "results" / "resolution-benchmark-fmnist.json").read_text())
    table = [line for line in markdown([_int_sizes(r) for r in raw["rows"]], {"wall_s": 0, "machine": ""}).splitlines()
             if line.startswith("| ")]
    docs = (root / "docs" / "resolution-benchmark.md").read_text().splitlines()
    assert len(table) == 25 and all(line in docs for line in table), [line for line in table if line not in docs]
