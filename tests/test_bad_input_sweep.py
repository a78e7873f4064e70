"""`vispe resolution` / `run_sweep` refuse what they cannot evaluate correctly: bad options (command line and Python,
one rule each), conflicting options, stale results, non-finite or partly random models, a foreign resolution.json."""
from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from bad_input import full_disk

import vispe.benchmarks.resolution_sweep as sweep
from vispe.benchmarks.resolution_sweep import OPTIONS, evaluate_shapes, main, run_sweep, weights_sources
from vispe.files import read_checkpoint

TIMM_KW = {"depth": 1, "embed_dim": 32, "num_heads": 2, "img_size": 16, "patch_size": 4}


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    """A 1-step checkpoint, a NaN copy of it, 1-block timm weights and a 2-class PNG folder."""
    import timm
    from PIL import Image

    from vispe.data import SyntheticDataModule
    from vispe.tasks import ImageClassification

    d = tmp_path_factory.mktemp("sweep_fx")
    pl.seed_everything(0, verbose=False)
    dm = SyntheticDataModule(num_classes=2, image_size=16, train_size=32, val_size=16, batch_size=16)
    task = ImageClassification("vispe_vit_tiny_patch4_32", {"embed_dim": 32, "depth": 1, "num_heads": 2}, "rope_axial",
                               num_classes=2, img_size=16)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(task, datamodule=dm)
    trainer.save_checkpoint(d / "a.ckpt")
    ck = read_checkpoint(d / "a.ckpt")
    key = next(k for k in ck["state_dict"] if k.endswith("blocks.0.mlp.fc1.weight"))
    ck["state_dict"][key][0, 0] = float("nan")
    torch.save(ck, d / "nan.ckpt")
    torch.manual_seed(0)
    ref = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=2, **TIMM_KW)
    torch.save(ref.state_dict(), d / "vit1.pth")
    rng = np.random.default_rng(0)
    for c in ("c0", "c1"):
        (d / "imgs" / c).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(d / "imgs" / c / f"{i}.png")
    return {"ckpt": str(d / "a.ckpt"), "nan": str(d / "nan.ckpt"), "weights": str(d / "vit1.pth"), "imgs": d / "imgs", "key": key}


def _run(capsys, argv: list[str]) -> tuple[int, str]:
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err


# ------------------------------------------------------------------------------------------
# options: one rule per option, one sentence naming the option and the value
# ------------------------------------------------------------------------------------------
BAD_OPTIONS = [
    (["--token-budget", "0", "--aspect-ratios", "1:1"], ["--token-budget='0'", "int >= 1"]),
    (["--token-budget", "-4", "--aspect-ratios", "1:1"], ["--token-budget='-4'", "int >= 1"]),
    (["--batch-size", "-1"], ["--batch-size='-1'", "int >= 1"]),
    (["--batch-size", "0"], ["--batch-size='0'", "int >= 1"]),
    (["--batch-size", "2.5"], ["--batch-size='2.5'", "an integer"]),
    (["--threads", "-1"], ["--threads='-1'", "int >= 1"]),
    (["--aspect-ratios", "inf:1"], ["--aspect-ratios='inf:1'", "finite positive"]),
    (["--aspect-ratios", "1:0"], ["--aspect-ratios='1:0'", "'1:0' is not one"]),
    (["--aspect-ratios", "nan"], ["--aspect-ratios='nan'"]),
    (["--sizes", "16,0"], ["--sizes='16,0'", "'0' is not one"]),
    (["--sizes", "100000"], ["--sizes='100000'", "16384"]),
    (["--scales", "inf"], ["--scales='inf'", "finite"]),
    (["--scales", "-1"], ["--scales='-1'", "> 0"]),
    (["--num-images", "0"], ["--num-images='0'", "int >= 1"]),
    (["--seed", "-3"], ["--seed='-3'", ">= 0"]),
    (["--resize", "resize,zoom"], ["--resize='resize,zoom'", "'crop'"]),
    (["--resize", "crop,crop"], ["--resize='crop,crop'", "distinct"]),
    (["--extrapolation", "wild"], ["--extrapolation='wild'", "'interpolate'"]),
    (["--device", "tpu:0"], ["--device='tpu:0'", "cpu"]),
    (["--device", "cuda:7"], ["--device='cuda:7'", "cpu"]),
    (["--sizes", "16", "--scales", "1,2"], ["--sizes and --scales cannot be used together"]),
    (["--token-budget", "8"], ["--token-budget needs --aspect-ratios"]),
    (["--mean", "0.1"], ["--mean needs --model", "checkpoint"]),
    (["--std", "0.2"], ["--std needs --model", "checkpoint"]),
    (["--model-kwargs", '{"depth": 3}'], ["--model-kwargs needs --model", "checkpoint"]),
    (["--pos-encoding", "cpe"], ["--pos-encoding needs --model"]),
    (["--allow-partial"], ["--allow-partial needs --model"]),
    (["--split", "train"], ["--split needs --data"]),
]


@pytest.mark.parametrize("extra,needles", BAD_OPTIONS, ids=[" ".join(e) for e, _ in BAD_OPTIONS])
def test_options_bad_sweep_option_exits_2_naming_it(fx, tmp_path, capsys, monkeypatch, extra, needles):
    monkeypatch.setattr(sweep, "evaluate_shapes", lambda *a, **k: pytest.fail("evaluated despite a bad option"))
    data = [] if "--split" in extra else ["--data", fx["imgs"]]
    rc, err = _run(capsys, [fx["ckpt"], *data, *extra, "--out", tmp_path / "o"])
    assert rc == 2
    line = err.strip().splitlines()[-1]
    assert line.startswith("vispe resolution: error: ")
    for n in needles:
        assert n in line, line
    assert not (tmp_path / "o").exists()  # refused before anything was written


WEIGHT_OPTIONS = [
    (["--std", "1e-45"], ["--std='1e-45'", ">= 1e-06"]),
    (["--mean", "nan"], ["--mean='nan'", "finite"]),
    (["--mean", "0.5,0.5"], ["--mean has 2 values", "3 input channels"]),
    (["--model-kwargs", "{depth: 1"], ["--model-kwargs='{depth: 1'", "not valid JSON"]),
    (["--model-kwargs", "[1, 2]"], ["--model-kwargs='[1, 2]'", "a JSON object"]),
]


@pytest.mark.parametrize("extra,needles", WEIGHT_OPTIONS, ids=[" ".join(e) for e, _ in WEIGHT_OPTIONS])
def test_options_bad_model_option_exits_2_naming_it(fx, tmp_path, capsys, extra, needles):
    base = ["--model", "vit_small_patch16_224", "--weights", fx["weights"], "--data", fx["imgs"], "--sizes", "16"]
    if not any(e == "--model-kwargs" for e in extra):
        base += ["--model-kwargs", json.dumps(TIMM_KW)]
    rc, err = _run(capsys, [*base, *extra, "--out", tmp_path / "o"])
    assert rc == 2
    line = err.strip().splitlines()[-1]
    for n in needles:
        assert n in line, line


@pytest.mark.parametrize("kwargs,needles", [
    (dict(batch_size=-1), ["batch_size=-1", "int >= 1"]),
    (dict(batch_size=True), ["batch_size=True"]),
    (dict(token_budget=0, aspect_ratios=[(1.0, "1:1")]), ["token_budget=0"]),
    (dict(token_budget=8), ["token_budget needs aspect_ratios"]),
    (dict(scales=[1.0, 2.0]), ["sizes and scales cannot be used together"]),
    (dict(aspect_ratios=[(float("inf"), "inf:1")]), ["aspect_ratios="]),
    (dict(eval_subset=0), ["eval_subset=0"]),
    (dict(device="cuda:7"), ["device='cuda:7'"]),
    (dict(resize=["zoom"]), ["resize=['zoom']"]),
    (dict(extrapolation="sideways"), ["extrapolation='sideways'"]),
])
def test_options_python_calls_get_the_same_rules(fx, tmp_path, kwargs, needles):
    kwargs = {"sizes": [16], **kwargs}
    with pytest.raises((ValueError, TypeError)) as info:
        run_sweep([fx["ckpt"]], out_dir=tmp_path, data=str(fx["imgs"]), **kwargs)
    for n in needles:
        assert n in str(info.value), str(info.value)


def test_options_layer_declares_each_flag_once():
    flags = [o.cli_name for o in OPTIONS.options.values() if not o.positional]
    assert len(flags) == len(set(flags))
    # every rule a parser produces is checked again by the same rule object (Python and CLI agree)
    assert OPTIONS["batch_size"].value_from_text("8") == 8
    with pytest.raises(ValueError, match=r"--batch-size='0' is not valid"):
        OPTIONS["batch_size"].value_from_text("0")
    with pytest.raises(ValueError, match=r"batch_size=0 is not valid"):
        OPTIONS.check({"batch_size": 0})
    with pytest.raises(ValueError, match=r"std=\[1e-45\] is not valid"):
        weights_sources("vit_small_patch16_224", "never-read.pth", ["learned"], TIMM_KW, std=[1e-45])


# ------------------------------------------------------------------------------------------
# results keyed by what produced them
# ------------------------------------------------------------------------------------------
def test_results_changed_images_batch_size_or_device_re_run(fx, tmp_path, capsys):
    import shutil

    from PIL import Image

    data = tmp_path / "set"
    shutil.copytree(fx["imgs"], data)
    out = tmp_path / "o"
    args = [fx["ckpt"], "--data", data, "--sizes", "16", "--out", out]
    assert main([str(a) for a in args]) == 0
    first = json.loads((out / "resolution.json").read_text())["results"][0]
    assert main([str(a) for a in args]) == 0  # unchanged: reused (same timing, same key)
    assert json.loads((out / "resolution.json").read_text())["results"][0] == first
    # same folder, same count, other pixels: re-evaluated, the key names the content
    for i, f in enumerate(sorted(data.rglob("*.png"))):
        Image.fromarray(np.full((16, 16, 3), 60 * i, dtype=np.uint8)).save(f)
    assert main([str(a) for a in args]) == 0
    changed = json.loads((out / "resolution.json").read_text())["results"][0]
    assert changed["key"] != first["key"]
    assert json.loads(changed["key"])["images_content"] != json.loads(first["key"])["images_content"]
    # another batch size is another evaluation option: re-run, recorded in the key
    assert main([str(a) for a in [*args, "--batch-size", "1"]]) == 0
    again = json.loads((out / "resolution.json").read_text())["results"][0]
    assert json.loads(again["key"])["batch_size"] == 1 and again["key"] != changed["key"]
    key = json.loads(again["key"])
    assert {"model", "device", "vispe", "torch", "seed", "resize"} <= set(key)
    # a device that does not exist is refused even though earlier results are there
    rc, err = _run(capsys, [*args, "--device", "cuda:9"])
    assert rc == 2 and "--device='cuda:9'" in err


def test_results_checkpoint_content_not_name_is_the_model_key(fx, tmp_path):
    import shutil

    from vispe.benchmarks.resolution_sweep import checkpoint_source

    copy = tmp_path / "copy.ckpt"
    shutil.copy(fx["ckpt"], copy)
    a, b = checkpoint_source(fx["ckpt"]), checkpoint_source(copy)
    assert a.key == b.key  # same bytes, same model
    ck = read_checkpoint(copy)
    ck["state_dict"][fx["key"]][0, 0] += 1.0
    torch.save(ck, copy)
    assert checkpoint_source(copy).key != a.key  # one weight changed: another model


def test_results_foreign_resolution_json_is_named(fx, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "resolution.json").write_text("[1, 2]")
    rc, err = _run(capsys, [fx["ckpt"], "--data", fx["imgs"], "--sizes", "16", "--out", out])
    assert rc == 2 and "resolution.json" in err and "is not a resolution sweep's results" in err
    assert (out / "resolution.json").read_text() == "[1, 2]"  # untouched


def test_results_stale_temp_removed_and_failed_write_named(fx, tmp_path, capsys, monkeypatch):
    import vispe.files as files

    out = tmp_path / "o"
    out.mkdir()
    stale = out / ".resolution.json.abc123.tmp"
    stale.write_text("half")
    (out / "resolution.json.tmp").write_text("half")  # the earlier fixed name
    assert main([fx["ckpt"], "--data", str(fx["imgs"]), "--sizes", "16", "--out", str(out)]) == 0
    assert not stale.exists() and not (out / "resolution.json.tmp").exists()
    capsys.readouterr()
    before = (out / "resolution.json").read_text()

    full_disk(monkeypatch, after=16)  # the disk is full: the results file cannot be written
    with pytest.raises(files.FileWriteError, match=r"resolution.json.*the disk is full"):
        main([fx["ckpt"], "--data", str(fx["imgs"]), "--sizes", "16,8", "--out", str(out)])
    assert (out / "resolution.json").read_text() == before  # the previous file is intact
    assert not list(out.glob(".*.tmp"))  # and no temp file is left


# ------------------------------------------------------------------------------------------
# models checked before they are scored
# ------------------------------------------------------------------------------------------
def test_models_nan_checkpoint_refused_naming_the_tensor(fx, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sweep, "evaluate_shapes", lambda *a, **k: pytest.fail("a NaN model was evaluated"))
    rc, err = _run(capsys, [fx["nan"], "--data", fx["imgs"], "--sizes", "16", "--out", tmp_path / "o"])
    assert rc == 2
    assert "nan.ckpt" in err and fx["key"] in err and "non-finite" in err


def test_models_non_finite_logits_stop_the_sweep():
    class Nan(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.patch_embed = torch.nn.Module()
            self.patch_embed.proj = torch.nn.Conv2d(3, 2, 4, 4)

        def forward(self, x):
            out = torch.zeros(len(x), 2)
            out[1] = float("nan")
            return out

    images = [torch.zeros(3, 8, 8, dtype=torch.uint8)] * 3
    with pytest.raises(ValueError, match=r"nanmodel gives non-finite logits .* for 1 of 3 images at 8x8"):
        evaluate_shapes(Nan(), images, torch.zeros(3, dtype=torch.long), [(8, 8)], (0.5,), (0.5,), name="nanmodel")


def test_models_partial_load_refused_unless_allow_partial(fx, tmp_path, capsys):
    deeper = json.dumps({**TIMM_KW, "depth": 3})
    base = ["--model", "vit_small_patch16_224", "--weights", fx["weights"], "--model-kwargs", deeper, "--data", fx["imgs"],
            "--sizes", "16", "--out", tmp_path / "o"]
    rc, err = _run(capsys, base)
    assert rc == 2
    line = err.strip().splitlines()[-1]
    assert "leaves 24 model tensors newly initialised" in line and "blocks.1." in line and "--allow-partial" in line
    assert _run(capsys, [*base, "--allow-partial"])[0] == 0
    # a zero-shot swap keeps every block weight: only the swapped encoding's own tensors are new, which is the point
    srcs = weights_sources("vit_small_patch16_224", fx["weights"], ["cpe"], TIMM_KW)
    assert srcs[0].encoding == "cpe"


def test_models_unknown_encoding_in_checkpoint_names_the_file(fx, tmp_path, capsys):
    ck = read_checkpoint(fx["ckpt"])
    ck["hyper_parameters"]["pos_encoding"] = "no_such_encoding"
    torch.save(ck, tmp_path / "u.ckpt")
    rc, err = _run(capsys, [tmp_path / "u.ckpt", "--data", fx["imgs"], "--sizes", "16", "--out", tmp_path / "o"])
    assert rc == 2 and "u.ckpt" in err and "no_such_encoding" in err


def test_models_python_path_checks_the_same(fx, tmp_path):
    with pytest.raises(ValueError, match=r"nan.ckpt.*non-finite"):
        run_sweep([fx["nan"]], [16], out_dir=tmp_path, data=str(fx["imgs"]))
    with pytest.raises(ValueError, match="newly initialised"):
        weights_sources("vit_small_patch16_224", fx["weights"], ["learned"], {**TIMM_KW, "depth": 2})
    ok = weights_sources("vit_small_patch16_224", fx["weights"], ["learned"], {**TIMM_KW, "depth": 2}, allow_partial=True)
    assert len(ok[0].model.blocks) == 2
    assert Path(fx["weights"]).is_file()
