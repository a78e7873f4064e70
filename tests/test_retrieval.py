"""Text-video retrieval: metrics from the similarity matrix, open_clip text tower, end-to-end training."""
from __future__ import annotations

import json
import math
import socket
from pathlib import Path

import pytest
import torch

from vispe.tasks.retrieval import (
    VideoTextRetrieval,
    build_text_tower,
    load_text_tower_checkpoint,
    retrieval_metrics,
    retrieval_ranks,
)

TINY_TEXT = dict(context_length=24, width=32, heads=2, layers=1)
TINY_VIDEO = dict(img_size=32, num_frames=4, tubelet_size=2, patch_size=8, embed_dim=32, depth=1, num_heads=2, global_pool="avg")


def naive_ranks(sim: torch.Tensor) -> list[int]:
    """Independent reference: position of the diagonal item in a descending sort (distinct scores)."""
    out = []
    for i in range(sim.shape[0]):
        order = sorted(range(sim.shape[1]), key=lambda j: -float(sim[i, j]))
        out.append(order.index(i) + 1)
    return out


def test_metrics_match_naive_ranking_and_torchmetrics() -> None:
    torch.manual_seed(0)
    sim = torch.randn(40, 40) * 0.3
    m = retrieval_metrics(sim)
    t2v, v2t = naive_ranks(sim), naive_ranks(sim.t())
    for k in (1, 5, 10):
        assert m[f"t2v_R@{k}"] == pytest.approx(100 * sum(r <= k for r in t2v) / 40)
        assert m[f"v2t_R@{k}"] == pytest.approx(100 * sum(r <= k for r in v2t) / 40)
    assert m["t2v_MnR"] == pytest.approx(sum(t2v) / 40)
    s = sorted(t2v)
    assert m["t2v_MdR"] == pytest.approx((s[19] + s[20]) / 2)
    # torchmetrics agrees once scores are made positive (it treats a GT scoring <= 0 as irrelevant)
    from torchmetrics.retrieval import RetrievalRecall

    idx = torch.arange(40).repeat_interleave(40)
    target = torch.eye(40, dtype=torch.bool).flatten()
    rec = RetrievalRecall(top_k=5)
    assert 100 * rec(sim.flatten() + 2, target, indexes=idx).item() == pytest.approx(m["t2v_R@5"])


def test_negative_cosines_are_not_dropped() -> None:
    """The GT is always best but every score is negative: R@1 must be 100 (torchmetrics' raw scores give 0)."""
    sim = -torch.rand(8, 8) - 1.0
    sim.fill_diagonal_(-0.5)
    m = retrieval_metrics(sim)
    assert m["t2v_R@1"] == 100.0 and m["v2t_R@1"] == 100.0 and m["t2v_MdR"] == 1.0


def test_ties_count_against_the_query() -> None:
    m = retrieval_metrics(torch.zeros(10, 10))  # a collapsed model must not look perfect
    assert m["t2v_R@1"] == 0.0 and m["t2v_MdR"] == 10.0 and m["v2t_MnR"] == 10.0


def test_worked_example_and_several_captions_per_video() -> None:
    # 4 captions, 3 videos; captions 0 and 1 describe video 0
    sim = torch.tensor([
        [0.9, 0.1, 0.2],
        [0.1, 0.3, 0.2],   # caption 1 ranks video 0 third
        [0.2, 0.8, 0.1],
        [0.5, 0.6, 0.4],   # caption 3 ranks video 2 third
    ])
    owner = torch.tensor([0, 0, 1, 2])
    m = retrieval_metrics(sim, owner, ks=(1, 2))
    assert m["t2v_R@1"] == 50.0 and m["t2v_MnR"] == pytest.approx((1 + 3 + 1 + 3) / 4) and m["t2v_MdR"] == 2.0
    # v2t: every video's best caption outranks all captions of other videos
    assert retrieval_ranks(sim.t(), torch.nn.functional.one_hot(owner, 3).bool().t()).tolist() == [1, 1, 1]
    with pytest.raises(ValueError, match="caption_video"):
        retrieval_metrics(sim)


def test_text_tower_and_tokenizer_work_offline(monkeypatch) -> None:
    def no_network(*a, **k):
        raise OSError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    task = VideoTextRetrieval("vispe_video_vit_nano_patch8_64", "none", TINY_VIDEO, embed_dim=16, text_cfg=TINY_TEXT)
    tok = task.tokenize(["a red square appears in the top left", "x"])
    assert tok.shape == (2, 24) and tok.dtype == torch.long
    f = task.encode_text(tok)
    assert f.shape == (2, 16) and torch.allclose(f.norm(dim=-1), torch.ones(2), atol=1e-5)
    with pytest.raises(ValueError, match="unknown text_cfg"):
        build_text_tower(16, dict(TINY_TEXT, widht=3))


def test_text_tower_init_from_open_clip_checkpoint_file(tmp_path: Path) -> None:
    import open_clip

    torch.manual_seed(1)
    clip = open_clip.model.CLIP(
        embed_dim=16, vision_cfg=dict(layers=1, width=32, head_width=16, patch_size=8, image_size=16), text_cfg=TINY_TEXT
    ).eval()
    with torch.no_grad():
        clip.logit_scale.fill_(3.0)
    path = tmp_path / "open_clip_tiny.pt"
    torch.save({"epoch": 1, "state_dict": {f"module.{k}": v for k, v in clip.state_dict().items()}}, path)
    task = VideoTextRetrieval("vispe_video_vit_nano_patch8_64", "none", TINY_VIDEO, embed_dim=16, text_cfg=TINY_TEXT, text_checkpoint=str(path)).eval()
    tok = open_clip.tokenizer.SimpleTokenizer(context_length=24)(["two people are arm wrestling", "a pancake"])
    with torch.no_grad():
        assert torch.allclose(task.encode_text(tok), clip.encode_text(tok, normalize=True), atol=1e-5)
    assert task.logit_scale.item() == pytest.approx(3.0)
    assert task.text_load_report["missing"] == [] and task.text_load_report["loaded"] > 5
    # a checkpoint whose tower has another shape is refused with the offending keys
    other = VideoTextRetrieval("vispe_video_vit_nano_patch8_64", "none", TINY_VIDEO, embed_dim=16, text_cfg=dict(TINY_TEXT, width=48))
    with pytest.raises(ValueError, match="shapes differ"):
        load_text_tower_checkpoint(other.text, path)
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        load_text_tower_checkpoint(other.text, tmp_path / "nope.pt")


@pytest.mark.parametrize("encoding", ["rope_axial_3d", "sincos3d", "learned_3d", "none"])
def test_video_tower_runs_more_frames_and_higher_resolution(encoding: str) -> None:
    task = VideoTextRetrieval("vispe_video_vit_nano_patch8_64", encoding, TINY_VIDEO, embed_dim=16, text_cfg=TINY_TEXT)
    with torch.no_grad():
        assert task.encode_image(torch.randn(2, 3, 4, 32, 32)).shape == (2, 16)
        assert task.encode_image(torch.randn(2, 3, 8, 64, 64)).shape == (2, 16)


@pytest.mark.slow
def test_fit_and_evaluate_end_to_end(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from vispe.data.video_text import SyntheticVideoTextDataModule

    dm = SyntheticVideoTextDataModule(
        root=str(tmp_path), num_train=12, num_val=6, num_frames=4, size=32, eval_settings=[(8, 64)], batch_size=6,
    )
    task = VideoTextRetrieval("vispe_video_vit_nano_patch8_64", "rope_axial_3d", TINY_VIDEO, embed_dim=16, text_cfg=TINY_TEXT, lr=1e-3, warmup_steps=1)
    before = {k: v.clone() for k, v in task.state_dict().items()}
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(task, datamodule=dm)
    assert trainer.global_step == 3
    assert math.isfinite(float(trainer.callback_metrics["train/loss"]))
    changed = [k for k, v in task.state_dict().items() if v.dtype.is_floating_point and not torch.equal(v, before[k])]
    assert any(k.startswith("visual.") for k in changed) and any(k.startswith("text.") for k in changed)
    assert set(task.last_metrics) == {"val", "val_8f64px"}
    for view in task.last_metrics.values():
        assert view["num_videos"] == 6 and view["skipped_videos"] == 0
        assert 0.0 <= view["t2v_R@1"] <= view["t2v_R@5"] <= 100.0 and 1.0 <= view["t2v_MdR"] <= 6.0


def test_skipped_eval_clips_are_counted(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from vispe.data.video_text import SyntheticVideoTextDataModule, SyntheticVideoTextSpec, VideoTextDataModule, generate_video_text_set

    manifest = generate_video_text_set(tmp_path, SyntheticVideoTextSpec(num_videos=5, num_frames=4, size=(32, 32), kinds=("appears",)))
    rows = json.loads(manifest.read_text())
    rows.insert(2, {"video": "missing_clip.mp4", "caption": "a lost clip"})
    bad = tmp_path / "with_missing.json"
    bad.write_text(json.dumps(rows))
    dm = VideoTextDataModule(train_manifest=str(manifest), val_manifest=str(bad), video_root=str(manifest.parent),
                             num_frames=4, size=32, batch_size=3, on_error="skip")
    task = VideoTextRetrieval("vispe_video_vit_nano_patch8_64", "none", TINY_VIDEO, embed_dim=16, text_cfg=TINY_TEXT)
    pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False).validate(task, datamodule=dm, verbose=False)
    assert task.last_metrics["val"]["num_videos"] == 5 and task.last_metrics["val"]["skipped_videos"] == 1
    with pytest.raises(FileNotFoundError, match="missing_clip.mp4"):  # on_error='raise': refused when the DataModule is built
        VideoTextDataModule(val_manifest=str(bad), video_root=str(manifest.parent), num_frames=4, size=32, batch_size=3)
    assert SyntheticVideoTextDataModule  # imported for the docs example


@pytest.mark.slow
def test_benchmark_command_writes_json_md_png(tmp_path: Path) -> None:
    from vispe.benchmarks.retrieval import main

    rc = main([  # the smoke recipe (vispe/recipes/retrieval_smoke.yaml) shrunk further through --set
        "--recipe", "retrieval_smoke", "--encodings", "rope_axial_3d,none", "--out", str(tmp_path / "out"), "--data-root", str(tmp_path / "data"),
        "--set", "data.init_args.num_train=8", "--set", "data.init_args.num_val=4", "--set", "data.init_args.batch_size=4",
        "--set", "trainer.max_steps=1",
    ])
    assert rc == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [r["encoding"] for r in res["results"]] == ["rope_axial_3d", "none"]
    assert set(res["results"][0]["views"]) == {"4f32px", "8f64px"} and res["chance_r1"] == 25.0
    assert 0 < res["position_free_r1"] <= 100
    assert "t2v R@1" in (tmp_path / "out" / "results.md").read_text()
    assert (tmp_path / "out" / "results.png").stat().st_size > 1000
    assert res["results"][0]["steps"] == 1 and res["recipe"]["recipe"] == "retrieval_smoke"


def test_benchmark_refuses_bad_input_in_one_line(tmp_path: Path, capsys) -> None:
    from vispe.benchmarks.retrieval import main

    # a 2D encoding (or a misspelt one): one line naming it and the 3D choices, no traceback, nothing generated
    assert main(["--encodings", "rope_mixed", "--out", str(tmp_path / "x"), "--data-root", str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err
    assert "unknown or non-3D encoding(s) ['rope_mixed']" in err and "rope_mixed_3d" in err and "Traceback" not in err
    assert not (tmp_path / "data").exists()
