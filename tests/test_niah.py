"""Video NIAH: episode construction, sequence layout, scoring, and a few-step end-to-end run."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from vispe.data.niah import (
    NIAH_COLORS,
    NIAHDataModule,
    NIAHDataset,
    NIAHVocab,
    insert_needle,
    needle_index,
    patchify,
    procedural_haystack,
)
from vispe.tasks.niah import VideoNIAH, accuracy_grid

SHARED_CLIPS = Path(__file__).resolve().parents[2] / "shared" / "data" / "action-clips"


def saturation(frames: np.ndarray) -> np.ndarray:
    f = frames.astype(np.int32)
    return f.max(-1) - f.min(-1)


def test_needle_is_inserted_at_the_depth_and_is_the_only_saturated_frame() -> None:
    rng = np.random.default_rng(0)
    hay = procedural_haystack(10, 8, rng)
    assert hay.shape == (10, 8, 8, 3) and hay.dtype == np.uint8
    assert saturation(hay).max() < 100  # low-saturation haystack
    assert np.abs(hay[1:].astype(int) - hay[:-1]).mean() < np.abs(hay[5:].astype(int) - hay[:-5]).mean() + 1  # correlated in time
    for depth, want in [(0.0, 0), (0.5, 5), (1.0, 10), (0.26, 3)]:
        frames, k = insert_needle(hay, depth, "blue", rng, square=4)
        assert k == want == needle_index(depth, 10) and frames.shape[0] == 11
        sat = saturation(frames).reshape(11, -1).max(1)
        assert np.argmax(sat) == k and sat[k] > 150 and np.delete(sat, k).max() < 100
        cell = frames[k].reshape(2, 4, 2, 4, 3).transpose(0, 2, 1, 3, 4).reshape(4, 16, 3)
        assert sum(bool((c == NIAH_COLORS["blue"]).all()) for c in cell) == 1  # exactly one visual token is the needle
        assert np.array_equal(np.delete(frames, k, axis=0), hay)  # the haystack is untouched
    with pytest.raises(ValueError, match="depth"):
        needle_index(1.5, 10)
    with pytest.raises(ValueError, match="purple"):
        insert_needle(hay, 0.5, "purple", rng)


def test_patchify_is_a_lossless_rearrangement() -> None:
    frames = np.random.default_rng(1).integers(0, 256, (3, 8, 12, 3), dtype=np.uint8)
    feats = patchify(frames, 4)
    assert feats.shape == (3, 2, 3, 48) and feats.min() >= -1 and feats.max() <= 1
    back = ((feats + 1) * 127.5).round().reshape(3, 2, 3, 4, 4, 3).permute(0, 1, 3, 2, 4, 5).reshape(3, 8, 12, 3)
    assert torch.equal(back.to(torch.uint8), torch.from_numpy(frames))


def test_dataset_is_deterministic_and_cycles_depths() -> None:
    ds = NIAHDataset(8, 6, depths=[0.0, 1.0], frame_size=8, patch=4, seed=3)
    a, b = ds[5], NIAHDataset(8, 6, depths=[0.0, 1.0], frame_size=8, patch=4, seed=3)[5]
    assert torch.equal(a["features"], b["features"]) and a["answer"] == b["answer"]
    assert [ds[i]["needle_index"] for i in range(4)] == [0, 6, 0, 6]
    assert ds[0]["features"].shape == (7, 2, 2, 48)
    answers = {NIAHDataset(64, 4, seed=0)[i]["answer"] for i in range(64)}
    assert answers == {0, 1, 2, 3}


def test_accuracy_grid_worked_example() -> None:
    recs = [(8, 0.0, True), (8, 0.0, False), (8, 1.0, True), (32, 0.0, False), (32, 1.0, True), (32, 1.0, True)]
    assert accuracy_grid(recs) == {8: {0.0: 50.0, 1.0: 100.0}, 32: {0.0: 0.0, 1.0: 100.0}}


@pytest.mark.parametrize("scheme", ["mrope", "vrope", "v2pe"])
def test_sequence_layout_and_answer_only_loss(scheme: str) -> None:
    task = VideoNIAH(scheme, dim=32, depth=1, num_heads=2)
    ds = NIAHDataset(3, 5, depths=[0.5], seed=0)
    feats = torch.stack([ds[i]["features"] for i in range(3)])
    answers = torch.tensor([ds[i]["answer"] for i in range(3)])
    packed = task.model.pack(task.samples(feats, answers), padding_side="left")
    vocab = NIAHVocab()
    # <bos> + (5+1) frames x 2x2 tokens + 6 question words + the answer
    assert packed.inputs_embeds.shape[1] == 1 + 6 * 4 + 6 + 1
    assert int(packed.visual_mask[0].sum()) == 24
    assert packed.token_ids[:, -1].tolist() == [int(vocab.answer_ids[a]) for a in answers]
    loss, logits = task.loss_and_logits({"features": feats, "answer": answers})
    # the loss is the cross-entropy of the answer token alone
    ref = torch.nn.functional.cross_entropy(logits.float(), task.answer_ids[answers])
    assert torch.allclose(loss, ref, atol=1e-5)
    pred = task.predict_answers(feats)
    assert pred.shape == (3,) and pred.dtype == torch.long


def test_hope_and_v2pe_fix_their_scale_at_evaluation() -> None:
    assert VideoNIAH("hope").model.position_kwargs == {"gamma": 0.75}
    assert VideoNIAH("v2pe").model.position_kwargs == {"delta": 0.25}
    assert VideoNIAH("v2pe", position_kwargs={"delta": 0.5}).model.position_kwargs == {"delta": 0.5}
    with pytest.raises(ValueError, match="pos_scheme"):
        VideoNIAH("rope_axial_3d")


def test_fit_and_score_lengths_and_depths_end_to_end() -> None:
    import lightning.pytorch as pl

    dm = NIAHDataModule(train_frames=4, train_episodes=24, eval_lengths=(4, 16), eval_depths=(0.0, 1.0), episodes_per_cell=2, batch_size=8)
    task = VideoNIAH("mrope_interleave", dim=32, depth=1, num_heads=2, warmup_steps=1)
    before = [p.clone() for p in task.parameters()]
    trainer = pl.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(task, datamodule=dm)
    assert trainer.global_step == 3 and any(not torch.equal(a, b) for a, b in zip(before, task.parameters()))
    grid = task.last_grid
    assert set(grid) == {4, 16} and all(set(row) == {0.0, 1.0} for row in grid.values())
    assert all(0.0 <= a <= 100.0 and (a * 2 / 100).is_integer() for row in grid.values() for a in row.values())


@pytest.mark.slow
def test_benchmark_command_writes_json_md_png(tmp_path: Path) -> None:
    from vispe.benchmarks.niah import extrapolation_ratio, main

    assert extrapolation_ratio({4: 100.0, 8: 100.0, 16: 95.0, 32: 50.0, 64: 99.0}, 8, 0.9) == 2.0
    rc = main(["--quick", "--schemes", "mrope,rope_1d", "--out", str(tmp_path), "--set", "model.init_args.dim=32",
               "--set", "model.init_args.depth=1", "--set", "model.init_args.num_heads=2"])
    assert rc == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert [r["scheme"] for r in res["results"]] == ["mrope", "rope_1d"]
    assert set(res["results"][0]["by_length"]) == {"4", "8", "16"}  # the training length is always scored
    assert "kept up to" in (tmp_path / "results.md").read_text()
    for png in ("heatmaps.png", "accuracy_vs_length.png"):
        assert (tmp_path / png).stat().st_size > 1000
    assert res["recipe"]["recipe"] == "niah" and res["recipe"]["overrides"]["model.init_args.dim"] == 32
    assert res["results"][0]["steps"] == 3  # --quick's budget reached the run's Trainer


def test_benchmark_refuses_bad_input_in_one_line(tmp_path: Path, capsys) -> None:
    from vispe.benchmarks.niah import main

    assert main(["--quick", "--schemes", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown scheme(s) ['nope']" in capsys.readouterr().err
    # a bad recipe value: refused before any scheme trains
    assert main(["--quick", "--schemes", "rope_1d,mrope", "--set", "model.init_args.visual_projector=nope", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "visual_projector='nope'; choose 'linear' or 'merger'" in err and not (tmp_path / "results.json").exists()


def test_real_clips_as_haystack() -> None:
    videos = sorted(str(p) for p in SHARED_CLIPS.glob("*.avi"))
    if not videos:
        pytest.skip("the shared action clips are not available")
    dm = NIAHDataModule(train_frames=6, eval_lengths=(6,), haystack_videos=videos, frame_size=8, patch=4)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["features"].shape == (32, 7, 2, 2, 48)
