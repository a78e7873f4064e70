"""End-to-end: `vispe three-cell` trains two encodings for a few steps and writes its table;
the task's group metrics against a direct computation."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from vispe.cli import main as vispe_main
from vispe.data.three_cell import LABEL_GROUPS, generate_three_cell
from vispe.tasks.three_cell import GROUPS, ThreeCellTask

TINY = ["--num-samples", "120", "--grid", "6", "--cell-size", "2", "--embed-dim", "16", "--depth", "1",
        "--num-heads", "2", "--batch-size", "16", "--no-progress", "--threads", "1"]


def test_three_cell_command_trains_two_encodings(tmp_path, capsys):
    out = tmp_path / "tc"
    rc = vispe_main(["three-cell", "--encodings", "none,sincos2d", "--max-steps", "3", "--out", str(out), *TINY])
    assert rc == 0
    result = json.loads((out / "results.json").read_text())
    rows = {r["encoding"]: r for r in result["results"]}
    assert set(rows) == {"none", "sincos2d"}
    for r in rows.values():
        assert r["steps"] == 3 and r["wall_s"] > 0
        for g in (*GROUPS, "avg"):
            assert 0.0 <= r[g] <= 100.0
        assert r["avg"] == pytest.approx(np.mean([r[g] for g in GROUPS]), abs=0.02)
    assert result["recipe"]["grid"] == 6 and result["recipe"]["seed"] == 0
    # PESI of the trained encodings: sin-cos is materialisable (and monotone), no-PE is not
    assert rows["none"]["pesi"] is None
    assert rows["sincos2d"]["pesi"]["M_U"] > 1.5
    assert (out / "similarity" / "sincos2d.png").exists()
    assert (out / "results.png").stat().st_size > 1000
    assert "| none |" in (out / "results.md").read_text()
    printed = capsys.readouterr().out
    assert "Three Cell Experiment" in printed and "| sincos2d |" in printed
    # runs split over processes merge into one table
    merged = tmp_path / "merged"
    assert vispe_main(["three-cell", "--merge", str(out), str(out), "--out", str(merged)]) == 0
    assert {r["encoding"] for r in json.loads((merged / "results.json").read_text())["results"]} == {"none", "sincos2d"}
    assert (merged / "results.png").exists()


def test_three_cell_command_rejects_bad_input(tmp_path, capsys):
    assert vispe_main(["three-cell", "--encodings", "nope", "--out", str(tmp_path), *TINY]) == 2
    assert "unknown or non-2D encoding" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        vispe_main(["three-cell", "--vector-sum", "xor"])


def test_task_group_metrics_match_direct_computation():
    task = ThreeCellTask("vispe_vit_tiny_patch16_224", dict(patch_size=2, embed_dim=16, depth=1, num_heads=2), pos_encoding="none", img_size=12)
    labels = torch.from_numpy(generate_three_cell(300, 6, seed=5).labels.astype(np.float32))
    rng = torch.Generator().manual_seed(0)
    logits = torch.randn(300, 6, generator=rng)
    task.model.forward = lambda x: logits  # fixed predictions; the metric wiring is what is tested
    task._eval_step((torch.zeros(300, 3, 12, 12), labels), task.test_metrics, "test")
    values = {g: float(task.test_metrics[g].compute()) for g in GROUPS}
    pred = (logits > 0).float()
    for g, idx in LABEL_GROUPS.items():
        assert values[g] == pytest.approx(float((pred[:, list(idx)] == labels[:, list(idx)]).float().mean()), abs=1e-6)


def test_task_rejects_bad_arguments():
    with pytest.raises(ValueError, match="not a timm model"):
        ThreeCellTask("not_a_model")
    with pytest.raises(ValueError, match="num_classes"):
        ThreeCellTask("vispe_vit_tiny_patch16_224", dict(num_classes=10))
