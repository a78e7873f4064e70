"""Resolution sweep: model sources, image sets and their class check, shapes and resize policies, policies, memory."""
from __future__ import annotations

import json
import os
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

import vispe.benchmarks.resolution_sweep as sweep_mod
from vispe.benchmarks.resolution_sweep import (
    _checkpoint,
    aspect_shapes,
    load_classifier,
    main,
    parse_shapes,
    prepare_batch,
    run_sweep,
    weights_sources,
)
from vispe.data import SyntheticDataModule
from vispe.data.eval_sets import class_index_map, open_eval_set, stratified_indices
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


def _write_folder(root: Path, classes: list[str], per_class: int, size=(16, 16), seed: int = 0) -> Path:
    """PNG images of the synthetic set, one sub-folder per class name."""
    from PIL import Image

    dm = SyntheticDataModule(num_classes=4, image_size=16, val_size=4 * per_class, noise=0.2, seed=0)
    val = dm.dataset.generate(4 * per_class, stream=2, seed=0)
    count = {c: 0 for c in range(4)}
    for x, y in zip(val.images, val.labels.tolist()):
        if y >= len(classes) or count[y] >= per_class:
            continue
        count[y] += 1
        (root / classes[y]).mkdir(parents=True, exist_ok=True)
        img = Image.fromarray(x.permute(1, 2, 0).numpy()).resize(size[::-1])
        img.save(root / classes[y] / f"{count[y]:03d}.png")
    return root


# ------------------------------------------------------------------------------------------
# checkpoints (the sweep as before: own test split, policies, reuse)
# ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_sweep_writes_json_md_png_for_two_checkpoints(ckpts, tmp_path):
    out = tmp_path / "sweep"
    rc = main([ckpts["rope_axial"][0], ckpts["learned"][0], "--sizes", "8,16,24,32", "--extrapolation", "both",
               "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "resolution.json").read_text())
    labels = [r["label"] for r in report["results"]]
    # rope_axial has an extrapolation option (both policies run); learned APE has a single policy
    assert labels == ["rope_axial (extend)", "rope_axial (interpolate)", "learned"]
    for r in report["results"]:
        assert [e["shape"] for e in r["evaluations"]] == ["8x8", "16x16", "24x24", "32x32"]
        assert r["num_samples"] == 64 and r["train_shape"] == "16x16" and r["train_size"] == 16
        assert set(r["accuracy"]) == {"8", "16", "24", "32"}
        assert all(0.0 <= e["top1"] <= e["top4"] <= 100.0 for e in r["evaluations"])
    md = (out / "resolution.md").read_text()
    assert "| rope_axial (extend) |" in md and "16x16*" in md and "peak memory (MiB)" in md
    png = (out / "resolution.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    # a second call into the same folder reuses the finished evaluations (same numbers, same timings)
    assert main([ckpts["rope_axial"][0], ckpts["learned"][0], "--sizes", "8,16,24,32", "--extrapolation", "both",
                 "--out", str(out)]) == 0
    assert json.loads((out / "resolution.json").read_text())["results"] == report["results"]


@pytest.mark.slow
def test_sweep_at_training_size_equals_lightning_validation(ckpts, tmp_path):
    report = run_sweep([ckpts["rope_axial"][0], ckpts["learned"][0]], [16], "native", tmp_path)
    for r, enc in zip(report["results"], ("rope_axial", "learned")):
        assert r["accuracy"]["16"]["top1"] == pytest.approx(ckpts[enc][1], abs=1e-4)


@pytest.mark.slow
def test_policy_switched_in_place_equals_the_model_built_with_it(ckpts):
    ck = _checkpoint(ckpts["rope_axial"][0])
    ext, itp = load_classifier(ck, "extend"), load_classifier(ck, "interpolate")
    assert ext.model.pos_encoding.extrapolation == "extend" and itp.model.pos_encoding.extrapolation == "interpolate"
    hp = {k: v for k, v in ck["hyper_parameters"].items() if k in ("model", "model_kwargs", "num_classes", "img_size")}
    built = ImageClassification(**hp, pos_encoding="rope_axial[extrapolation=interpolate]")
    built.load_state_dict(ck["state_dict"])
    torch.manual_seed(0)
    with torch.no_grad():
        x16, x32 = torch.randn(4, 3, 16, 16), torch.randn(4, 3, 32, 32)
        torch.testing.assert_close(ext(x16), itp(x16))  # the policies agree on the training grid ...
        assert (ext(x32) - itp(x32)).abs().max() > 1e-4  # ... and differ off it
        torch.testing.assert_close(itp(x32), built.eval()(x32))  # switched in place == built that way


@pytest.mark.slow
def test_untileable_size_fails_before_evaluating(ckpts, tmp_path, capsys):
    out = tmp_path / "bad"
    rc = main([ckpts["rope_axial"][0], ckpts["learned"][0], "--sizes", "16,18", "--out", str(out)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "shapes ['18x18'] cannot be tiled by the patch size 4x4" in err
    assert not out.exists()
    with pytest.raises(ValueError, match="extrapolation='sideways' is not valid"):
        run_sweep([ckpts["learned"][0]], [16], "sideways", tmp_path)
    assert main([str(tmp_path / "missing.ckpt"), "--out", str(out)]) == 2
    assert "checkpoint not found" in capsys.readouterr().err
    with pytest.raises(ValueError, match="has no extrapolation='extend'"):
        load_classifier(_checkpoint(ckpts["learned"][0]), "extend")
    with pytest.raises(ValueError, match="--sizes takes positive sizes from 1 to 16384 px or HxW shapes .*'2x3x4' is not one"):
        parse_shapes("16,2x3x4")


@pytest.mark.slow
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


# ------------------------------------------------------------------------------------------
# image sets and the class check
# ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_folder_csv_and_json_lists_give_the_same_sweep(ckpts, tmp_path):
    root = _write_folder(tmp_path / "folder", ["c0", "c1", "c2", "c3"], per_class=6)
    rows = [(str(p.relative_to(root)), p.parent.name) for p in sorted(root.rglob("*.png"))]
    (root / "list.csv").write_text("path,label\n" + "".join(f"{p},{c}\n" for p, c in rows))
    (root / "list.json").write_text(json.dumps([{"path": p, "label": c} for p, c in rows]))
    names = "c0,c1,c2,c3"
    acc = {}
    for spec in (str(root), str(root / "list.csv"), str(root / "list.json")):
        rep = run_sweep([ckpts["rope_axial"][0]], [16, 24], "native", tmp_path / Path(spec).name, data=spec, classes=names.split(","))
        acc[spec] = [e["top1"] for e in rep["results"][0]["evaluations"]]
        assert rep["results"][0]["num_samples"] == 24
    assert len({tuple(v) for v in acc.values()}) == 1
    # the images are the synthetic validation images: at the training size the checkpoint does as well as it validated
    assert acc[str(root)][0] >= 50.0


@pytest.mark.slow
def test_class_mismatch_and_empty_folders_fail_before_any_compute(ckpts, tmp_path, monkeypatch, capsys):
    def no_compute(*args, **kwargs):
        raise AssertionError("evaluated before the set was checked")

    monkeypatch.setattr(sweep_mod, "evaluate_shapes", no_compute)
    three = _write_folder(tmp_path / "three", ["c0", "c1", "c2"], per_class=2)
    rc = main([ckpts["learned"][0], "--data", str(three), "--sizes", "16", "--out", str(tmp_path / "o1")])
    err = capsys.readouterr().err
    assert rc == 2 and "class counts do not match" in err and "4 classes" in err and "3 classes (c0, c1, c2)" in err
    # named on both sides: names that are not the model's are named
    four = _write_folder(tmp_path / "four", ["c0", "c1", "c2", "zebra"], per_class=2)
    rc = main([ckpts["learned"][0], "--data", str(four), "--classes", "c0,c1,c2,c3", "--sizes", "16", "--out", str(tmp_path / "o2")])
    err = capsys.readouterr().err
    assert rc == 2 and "['zebra'] are not classes of" in err
    (tmp_path / "empty").mkdir()
    rc = main([ckpts["learned"][0], "--data", str(tmp_path / "empty"), "--out", str(tmp_path / "o3")])
    assert rc == 2 and "has no class sub-folders" in capsys.readouterr().err
    (tmp_path / "hollow" / "a").mkdir(parents=True)
    (tmp_path / "hollow" / "b").mkdir()
    rc = main([ckpts["learned"][0], "--data", str(tmp_path / "hollow"), "--out", str(tmp_path / "o4")])
    assert rc == 2 and "holds no images" in capsys.readouterr().err
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 5))


def test_class_index_map_matches_names_in_any_order():
    assert class_index_map(["b", "a"], 2, ["a", "b"], 2).tolist() == [1, 0]
    assert class_index_map(None, 3, None, 3).tolist() == [0, 1, 2]
    assert class_index_map(["c"], 1, ["a", "b", "c"], 3, allow_subset=True).tolist() == [2]
    with pytest.raises(ValueError, match="the model has 3 classes .a, b, c.; the image set has 1 classes .c."):
        class_index_map(["c"], 1, ["a", "b", "c"], 3)
    with pytest.raises(ValueError, match="class counts do not match"):
        class_index_map(None, 7, None, 10)


def test_stratified_sample_is_seeded_proportional_and_not_the_first_n():
    labels = torch.arange(10).repeat_interleave(torch.tensor([100] * 5 + [20] * 5))  # class order, unequal classes
    keep = stratified_indices(labels, 120, seed=0)
    assert len(keep) == 120 and len(set(keep.tolist())) == 120
    counts = torch.bincount(labels[keep], minlength=10)
    assert counts[:5].tolist() == [20] * 5 and counts[5:].tolist() == [4] * 5  # each class in proportion
    assert torch.equal(keep, stratified_indices(labels, 120, seed=0))  # fixed given the seed ...
    assert not torch.equal(keep, stratified_indices(labels, 120, seed=1))  # ... and drawn, not the first n
    assert keep.max() > 120
    assert torch.equal(stratified_indices(labels, None), torch.arange(len(labels)))


# ------------------------------------------------------------------------------------------
# timm weights from a local file, under several encodings
# ------------------------------------------------------------------------------------------
TIMM_KW = {"depth": 2, "embed_dim": 32, "num_heads": 2, "img_size": 32, "patch_size": 8}


@pytest.fixture(scope="module")
def timm_weights(tmp_path_factory):
    import timm

    torch.manual_seed(0)
    ref = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=4, dynamic_img_size=True, **TIMM_KW).eval()
    path = tmp_path_factory.mktemp("timm") / "vit.pth"
    torch.save(ref.state_dict(), path)
    return ref, path


def test_timm_weights_under_learned_reproduce_timm_and_swap_zero_shot(timm_weights):
    ref, path = timm_weights
    srcs = weights_sources("vit_small_patch16_224", path, ["learned", "rope_axial", "cpe"], TIMM_KW)
    assert [s.label for s in srcs] == ["learned", "rope_axial", "cpe"] and srcs[0].num_classes == 4
    assert srcs[0].train_shape == (32, 32) and srcs[0].patch == (8, 8)
    torch.manual_seed(1)
    with torch.no_grad():
        for hw in ((32, 32), (48, 48), (32, 64)):  # timm (dynamic_img_size) is the oracle, off the training size too
            x = torch.randn(2, 3, *hw)
            torch.testing.assert_close(srcs[0].model(x), ref(x), atol=1e-5, rtol=1e-5)
        # a vispe_* model name with the same architecture takes the same file
        (vispe_learned,) = weights_sources("vispe_vit_tiny_patch4_32", path, ["learned"], {**TIMM_KW, "img_size": 32})
        x = torch.randn(2, 3, 40, 40)
        torch.testing.assert_close(vispe_learned.model(x), ref(x), atol=1e-5, rtol=1e-5)
        assert vispe_learned.mean == (0.4914, 0.4822, 0.4465)  # the vispe model's own default normalisation
        # the swapped encoding's new parameters are seeded: the same command gives the same model
        (again,) = weights_sources("vit_small_patch16_224", path, ["cpe"], TIMM_KW)
        torch.testing.assert_close(again.model(x), srcs[2].model(x))
        # the swapped encodings keep every block weight of the file
        for s in srcs[1:]:
            assert torch.equal(s.model.blocks[1].mlp.fc2.weight, ref.blocks[1].mlp.fc2.weight)
            assert "dropped" in s.origin


@pytest.mark.slow
def test_timm_weights_sweep_on_a_folder_with_both_policies(timm_weights, tmp_path):
    _, path = timm_weights
    root = _write_folder(tmp_path / "imgs", ["c0", "c1", "c2", "c3"], per_class=3, size=(20, 28))
    out = tmp_path / "o"
    rc = main(["--model", "vit_small_patch16_224", "--weights", str(path), "--model-kwargs", json.dumps(TIMM_KW),
               "--pos-encoding", "learned,rope_axial,cpe", "--extrapolation", "both", "--data", str(root),
               "--sizes", "16,32,32x64", "--aspect-ratios", "1:2,1:1,2:1", "--resize", "resize,pad", "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "resolution.json").read_text())
    labels = [r["label"] for r in report["results"]]
    assert labels[:2] == ["learned [resize]", "learned [pad]"]
    assert {lab.split(" [")[0] for lab in labels} == {"learned", "rope_axial (extend)", "rope_axial (interpolate)", "cpe"}
    r = report["results"][0]
    aspect = [e for e in r["evaluations"] if e["sweep"] == "aspect"]
    assert [e["aspect_label"] for e in aspect] == ["1:2", "1:1", "2:1"] and [e["shape"] for e in aspect] == ["48x24", "32x32", "24x48"]
    assert all(e["tokens"] in (16, 18) for e in aspect)
    mem = {e["shape"]: e["peak_memory"]["tensor_peak_mib"] for e in r["evaluations"]}
    assert 0 < mem["16x16"] < mem["32x64"]  # measured per shape: more tokens, more memory
    md = (out / "resolution.md").read_text()
    assert "1:2 48x24 (18 tok)" in md and "32x64" in md


@pytest.mark.slow
def test_timm_rope_vit_weights_load_into_the_vispe_model_with_its_encoding(tmp_path, capsys):
    """timm's RoPE ViT (``vit_small_patch16_rope_mixed_224``, an ``Eva``) state dict under ``--model
    vispe_vit_small_patch16_224 --pos-encoding rope_mixed``: loaded through ``load_timm_checkpoint``, the logits
    are timm's at 224 px; naming the timm model itself is refused with the command that works."""
    import timm

    torch.manual_seed(0)
    eva = timm.create_model("vit_small_patch16_rope_mixed_224", pretrained=False, num_classes=4, depth=2).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # random init has layer scale 1e-5 and a tiny head: make the blocks and the logits count
        for n, p in eva.named_parameters():
            if n.endswith(("gamma_1", "gamma_2", "ls1.gamma", "ls2.gamma")):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
        eva.head.weight.copy_(torch.randn(eva.head.weight.shape, generator=g) / 8)
    path = tmp_path / "eva.pth"
    torch.save(eva.state_dict(), path)
    mixed, axial = weights_sources("vispe_vit_small_patch16_224", path, ["rope_mixed", "rope_axial"], {"depth": 2})
    assert "0 new" in mixed.origin and "0 dropped" in mixed.origin, mixed.origin
    assert torch.equal(mixed.model.pos_encoding.freqs, eva.rope.freqs)  # the learned mixed frequencies are the file's
    x = torch.randn(2, 3, 224, 224, generator=g)
    with torch.no_grad():
        want, got, other = eva(x), mixed.model(x), axial.model(x)
    assert want.abs().max() > 0.5 and (want[0] - want[1]).abs().max() > 1e-2
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (other - want).abs().max() > 1e-3  # the same blocks under axial RoPE: the frequencies matter
    # through the command line, on a folder of images
    root = _write_folder(tmp_path / "imgs", ["c0", "c1", "c2", "c3"], per_class=2)
    out = tmp_path / "o"
    assert main(["--model", "vispe_vit_small_patch16_224", "--pos-encoding", "rope_mixed", "--weights", str(path),
                 "--model-kwargs", '{"depth": 2}', "--data", str(root), "--sizes", "224", "--out", str(out)]) == 0
    report = json.loads((out / "resolution.json").read_text())
    (r,) = report["results"]
    assert r["encoding"] == "rope_mixed" and r["train_shape"] == "224x224" and "0 dropped" in r["source"]
    capsys.readouterr()
    assert main(["--model", "vit_small_patch16_rope_mixed_224", "--weights", str(path), "--model-kwargs", '{"depth": 2}',
                 "--data", str(root), "--sizes", "224", "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err
    assert "is a timm Eva" in err and "--model vispe_vit_small_patch16_224 --pos-encoding rope_mixed" in err, err
    assert not (tmp_path / "refused" / "resolution.json").exists()


# ------------------------------------------------------------------------------------------
# shapes and resize policies
# ------------------------------------------------------------------------------------------
def test_aspect_shapes_keep_the_ratio_near_the_token_budget():
    for (h, w), r in zip(aspect_shapes([0.5, 2 / 3, 1.0, 1.5, 2.0], 256, (16, 16)), (0.5, 2 / 3, 1.0, 1.5, 2.0)):
        assert h % 16 == 0 and w % 16 == 0
        assert abs(np.log((w / h) / r)) < 0.05 and 0.85 < (h // 16) * (w // 16) / 256 < 1.15
    # a ratio and its inverse get transposed grids, also at small budgets (Fashion-MNIST: 4x4 tokens, patch 7)
    for tokens, patch in ((16, (7, 7)), (64, (4, 4)), (196, (16, 16)), (256, (16, 16))):
        shapes = aspect_shapes([0.5, 2 / 3, 1.0, 1.5, 2.0], tokens, patch)
        assert shapes == [(w, h) for h, w in shapes[::-1]], (tokens, shapes)
    assert aspect_shapes([2 / 3, 1.5], 16, (7, 7)) == [(35, 21), (21, 35)]  # 5x3 and 3x5 patches, 15 tokens each
    assert parse_shapes("16, 24x48,16") == [(16, 16), (24, 48)]


def test_resize_policies():
    torch.manual_seed(0)
    square = (torch.rand(3, 20, 20) * 255).to(torch.uint8)
    wide = (torch.rand(3, 10, 30) * 255).to(torch.uint8)
    mean, std = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
    # a square image to a square shape: the three policies are the same resize
    same = [prepare_batch([square], (16, 16), p, mean, std, 3) for p in ("resize", "crop", "pad")]
    torch.testing.assert_close(same[0], same[1]) and torch.testing.assert_close(same[0], same[2])
    pad = prepare_batch([wide], (24, 24), "pad", mean, std, 3)[0]
    assert pad.shape == (3, 24, 24)
    assert pad[:, :8].abs().max() == 0 and pad[:, 16:].abs().max() == 0  # 8-px bands of the mean colour
    assert pad[:, 8:16].abs().sum() > 0
    # crop: the centre 10x10 of the wide image, resized to 24x24 (away from the cut, where bicubic sees the neighbours)
    crop = prepare_batch([wide], (24, 24), "crop", mean, std, 3)[0]
    centre = prepare_batch([wide[:, :, 10:20]], (24, 24), "resize", mean, std, 3)[0]
    torch.testing.assert_close(crop[..., 4:-4], centre[..., 4:-4], atol=1e-4, rtol=0)
    grey = prepare_batch([square[:1]], (16, 16), "resize", mean, std, 3)  # grey images meet an RGB model
    assert grey.shape == (1, 3, 16, 16) and torch.equal(grey[:, 0], grey[:, 2])


# ------------------------------------------------------------------------------------------
# real data (skipped without $VISPE_DATA_ROOT)
# ------------------------------------------------------------------------------------------
DATA_ROOT = os.environ.get("VISPE_DATA_ROOT")
needs_data = pytest.mark.skipif(not DATA_ROOT or not Path(DATA_ROOT, "cifar10-jpeg", "cifar10_test_jpeg.zip").is_file(),
                                reason="$VISPE_DATA_ROOT with cifar10-jpeg/ not present")


@needs_data
def test_cifar10_test_zip_alone_lists_and_samples(tmp_path):
    (tmp_path / "cifar10-jpeg").mkdir()  # a folder holding the test archive and nothing else
    (tmp_path / "cifar10-jpeg" / "cifar10_test_jpeg.zip").symlink_to(Path(DATA_ROOT, "cifar10-jpeg", "cifar10_test_jpeg.zip"))
    es = open_eval_set("cifar10-test", str(tmp_path / "cifar10-jpeg"))
    assert len(es) == 10_000 and es.classes[0] == "airplane" and es.classes[-1] == "truck"
    keep = stratified_indices(es.labels, 50, seed=0)
    assert torch.bincount(es.labels[keep]).tolist() == [5] * 10
    images = es.load(keep[:3].tolist())
    assert all(im.dtype == torch.uint8 and im.shape == (3, 32, 32) for im in images)


def _write_idx(path: Path, array: np.ndarray) -> None:
    """An unsigned-byte IDX file (the MNIST layout): magic 0x0000 08 <ndim>, big-endian sizes, the bytes."""
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def test_torchvision_dataset_by_name_is_read_from_disk_and_never_downloaded(tmp_path):
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    labels = np.arange(30) % 10
    _write_idx(raw / "t10k-images-idx3-ubyte", rng.integers(0, 256, (30, 28, 28)))
    _write_idx(raw / "t10k-labels-idx1-ubyte", labels)
    _write_idx(raw / "train-images-idx3-ubyte", rng.integers(0, 256, (2, 28, 28)))  # torchvision checks every file is there
    _write_idx(raw / "train-labels-idx1-ubyte", labels[:2])
    es = open_eval_set("torchvision:FashionMNIST", str(tmp_path))
    assert len(es) == 30 and es.num_classes == 10 and es.classes[0].startswith("T-shirt")
    assert torch.equal(es.labels, torch.from_numpy(labels))
    im = es.load([3])[0]
    assert im.dtype == torch.uint8 and im.shape == (1, 28, 28)
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        open_eval_set("torchvision:MNIST", str(tmp_path))
    with pytest.raises(ValueError, match="unknown torchvision dataset 'Nope'"):
        open_eval_set("torchvision:Nope", str(tmp_path))
