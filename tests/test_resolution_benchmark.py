"""``vispe resolution-benchmark`` end to end on the tiny recipe (generated data, seconds): trains every run,
sweeps 0.5x-2x with both extrapolation policies, groups seeds, resumes without retraining."""
from __future__ import annotations

import json
import math
import statistics

import pytest

from vispe.benchmarks.resolution_benchmark import RECIPES, main


def test_tiny_recipe_end_to_end_and_resume(tmp_path, capsys):
    assert main(["--recipe", "tiny", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    sweep = json.loads((tmp_path / "synthetic" / "resolution" / "resolution.json").read_text())
    part = RECIPES["tiny"][0]
    assert part.sizes() == [8, 12, 16, 20, 24, 28, 32]  # 0.5x .. 2x of 16 px, patch 4
    rows = {(r["encoding"], r["extrapolation"]): r for r in summary["rows"]}
    assert set(rows) == {("none", "own (no option)"), ("rope_axial", "extend"), ("rope_axial", "interpolate")}
    assert rows[("rope_axial", "extend")]["seeds"] == 2 and rows[("none", "own (no option)")]["seeds"] == 1
    # the summary is the per-checkpoint sweep regrouped: mean and std over seeds, binomial s.e. for one seed
    per_seed = [r for r in sweep["results"] if r["encoding"] == "rope_axial" and r["extrapolation"] == "extend"]
    for s in part.sizes():
        vals = [r["accuracy"][str(s)]["top1"] for r in per_seed]
        row = rows[("rope_axial", "extend")]
        assert row["mean"][str(s)] == pytest.approx(statistics.fmean(vals))
        assert row["spread"][str(s)] == pytest.approx(statistics.stdev(vals))
        p = rows[("none", "own (no option)")]["mean"][str(s)] / 100
        assert rows[("none", "own (no option)")]["spread"][str(s)] == pytest.approx(100 * math.sqrt(p * (1 - p) / 64))
    assert (tmp_path / "summary.png").stat().st_size > 0 and "| rope_axial (extend) | 2 |" in (tmp_path / "summary.md").read_text()
    # a second call finds every checkpoint and trains nothing
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.glob("synthetic/*/checkpoints/last.ckpt")}
    assert len(stamps) == 3
    capsys.readouterr()
    assert main(["--recipe", "tiny", "--out", str(tmp_path)]) == 0
    assert "start" not in capsys.readouterr().err
    assert stamps == {p: p.stat().st_mtime_ns for p in tmp_path.glob("synthetic/*/checkpoints/last.ckpt")}


def test_bad_arguments_fail_before_training(tmp_path, capsys):
    assert main(["--recipe", "tiny", "--parts", "imagenet", "--out", str(tmp_path)]) == 2
    assert "unknown part(s) ['imagenet']" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown positional encoding 'rope_9d'"):
        main(["--recipe", "tiny", "--encodings", "rope_9d", "--out", str(tmp_path)])
    assert main(["--recipe", "cpu", "--parts", "fashion_mnist", "--data-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path)]) == 2
    assert "needs 'fashion-mnist'" in capsys.readouterr().err
    assert not any((tmp_path).glob("*/*/checkpoints"))
