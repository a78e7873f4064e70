"""Resolution sweep: outputs for several checkpoints, consistency with validation, policies, bad input."""
from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch

from vispe.benchmarks.resolution_sweep import _checkpoint, load_classifier, main, run_sweep
from vispe.data import SyntheticDataModule
from vispe.tasks import ImageClassification

TINY = {"embed_dim": 32, "depth": 2, "num_heads": 2}


def _train(tmp_path, encoding: str) -> tuple[str, float]:
    pl.seed_everything(0, verbose=False)
    dm = SyntheticDataModule(num_classes=4, image_size=16, train_size=128, val_size=64, noise=0.2, batch_size=32)
    task = ImageClassification("vispe_vit_tiny_patch4_32", TINY, encoding, num_classes=4, img_size=16, lr=3e-3, warmup_epochs=0.5)
    trainer = pl.Trainer(max_epochs=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(task, datamodule=dm)
    val_acc = trainer.validate(task, datamodule=dm, verbose=False)[0]["val/acc"]
    path = tmp_path / f"{encoding}.ckpt"
    trainer.save_checkpoint(path)
    return str(path), 100.0 * val_acc


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpts")
    return {enc: _train(d, enc) for enc in ("rope_axial", "learned")}


def test_sweep_writes_json_md_png_for_two_checkpoints(ckpts, tmp_path):
    out = tmp_path / "sweep"
    rc = main([ckpts["rope_axial"][0], ckpts["learned"][0], "--sizes", "8,16,24,32", "--extrapolation", "both",
               "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "resolution.json").read_text())
    labels = [r["label"] for r in report["results"]]
    # rope_axial has an extrapolation option (both policies run); learned APE has a single policy
    assert labels == ["rope_axial (extend)", "rope_axial (interpolate)", "learned"]
    assert report["sizes"] == [8, 16, 24, 32]
    for r in report["results"]:
        assert set(r["accuracy"]) == {"8", "16", "24", "32"} and r["num_samples"] == 64 and r["train_size"] == 16
        assert all(0.0 <= v["top1"] <= v["top4"] <= 100.0 for v in r["accuracy"].values())
    md = (out / "resolution.md").read_text()
    assert "| rope_axial (extend) |" in md and "16*" in md
    png = (out / "resolution.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    # a second call into the same folder reuses the finished evaluations (same numbers, same timings)
    assert main([ckpts["rope_axial"][0], ckpts["learned"][0], "--sizes", "8,16,24,32", "--extrapolation", "both",
                 "--out", str(out)]) == 0
    assert json.loads((out / "resolution.json").read_text())["results"] == report["results"]


def test_sweep_at_training_size_equals_lightning_validation(ckpts, tmp_path):
    report = run_sweep([ckpts["rope_axial"][0], ckpts["learned"][0]], [16], "native", tmp_path)
    for r, enc in zip(report["results"], ("rope_axial", "learned")):
        assert r["accuracy"]["16"]["top1"] == pytest.approx(ckpts[enc][1], abs=1e-4)


def test_policies_agree_on_the_training_grid_and_differ_off_it(ckpts):
    ck = _checkpoint(ckpts["rope_axial"][0])
    ext, itp = load_classifier(ck, "extend"), load_classifier(ck, "interpolate")
    assert ext.model.pos_encoding.extrapolation == "extend" and itp.model.pos_encoding.extrapolation == "interpolate"
    torch.manual_seed(0)
    with torch.no_grad():
        x16, x32 = torch.randn(4, 3, 16, 16), torch.randn(4, 3, 32, 32)
        torch.testing.assert_close(ext(x16), itp(x16))
        assert (ext(x32) - itp(x32)).abs().max() > 1e-4


def test_untileable_size_fails_before_evaluating(ckpts, tmp_path, capsys):
    out = tmp_path / "bad"
    rc = main([ckpts["rope_axial"][0], ckpts["learned"][0], "--sizes", "16,18", "--out", str(out)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "sizes [18] cannot be tiled by the patch size 4x4" in err
    assert not out.exists()
    with pytest.raises(ValueError, match="extrapolation='sideways' is not valid"):
        run_sweep([ckpts["learned"][0]], [16], "sideways", tmp_path)
    assert main([str(tmp_path / "missing.ckpt"), "--out", str(out)]) == 2
    assert "checkpoint not found" in capsys.readouterr().err
    with pytest.raises(ValueError, match="has no extrapolation option"):
        load_classifier(_checkpoint(ckpts["learned"][0]), "extend")


def test_all_policies_add_the_frequency_rescalings_for_rotary_checkpoints(ckpts, tmp_path):
    report = run_sweep([ckpts["rope_axial"][0], ckpts["learned"][0]], [16, 32], "all", tmp_path)
    rows = {r["label"]: r for r in report["results"]}
    assert list(rows) == ["rope_axial (extend)", "rope_axial (interpolate)", "rope_axial (ntk)", "rope_axial (yarn)", "learned"]
    # at the training size every policy is the trained model
    assert len({rows[f"rope_axial ({p})"]["accuracy"]["16"]["top1"] for p in ("extend", "interpolate", "ntk", "yarn")}) == 1
    # forced: the rotary checkpoint runs ntk, the one without an option keeps its own policy
    forced = run_sweep([ckpts["rope_axial"][0], ckpts["learned"][0]], [16, 32], "ntk", tmp_path / "forced")
    assert [r["label"] for r in forced["results"]] == ["rope_axial (ntk)", "learned"]
    assert forced["results"][0]["accuracy"] == rows["rope_axial (ntk)"]["accuracy"]
