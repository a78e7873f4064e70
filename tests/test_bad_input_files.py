"""Bad-input battery (issue 32), files half: hostile and damaged checkpoints, damaged data files, bad CLI/YAML.

Every case is a test whose id starts with its category (``checkpoints``, ``data``, ``cli``); each requires an early
error whose message names what the user must fix (see ``tests/bad_input.py``). The hostile-pickle test runs the same
payload through every public loading path and checks that the payload never ran.
"""
from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import timm
import torch

import vispe  # noqa: F401  (registers models)
from bad_input import expect_clear_error
from vispe.files import DamagedFileError, UnsafeCheckpointError, check_idx, read_checkpoint, read_idx, read_json, read_safetensors
from vispe.encodings import EncodingContext, create_encoding
from vispe.recipes import recipe_path

REPO = Path(__file__).resolve().parents[1]
SMOKE = recipe_path("smoke")
TINY_VIT = dict(embed_dim=32, depth=2, num_heads=2, img_size=16, num_classes=4)


class _Hostile:
    """Pickles to a call of ``os.mkdir(marker)``: what a malicious checkpoint runs at load time."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _tiny_vit(pe: str = "rope_axial"):
    return timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding=pe, **TINY_VIT)


def _cli_error(fn, capsys):
    """Run a CLI entry point; a non-zero exit (argparse/jsonargparse usage error) becomes a ValueError carrying stderr."""

    def run():
        try:
            rc = fn()
        except SystemExit as stop:
            rc = stop.code
        if rc not in (0, None):
            raise ValueError(capsys.readouterr().err)

    return run


# ---------------------------------------------------------------------------------------------------------------------
# Hostile checkpoints: nothing in a file ever runs
# ---------------------------------------------------------------------------------------------------------------------
@pytest.fixture(params=["zip", "legacy"])
def hostile(request, tmp_path) -> tuple[Path, Path]:
    """A checkpoint laid out like a vispe Lightning checkpoint whose hyper-parameters hold the payload."""
    marker = tmp_path / "payload_ran"
    path = tmp_path / "evil.ckpt"
    if request.param == "zip":
        torch.save({"state_dict": {"w": torch.zeros(2)}, "hyper_parameters": {"lr": _Hostile(marker)}, "epoch": 0}, path)
    else:  # a plain pickle (what PyTorch's legacy, non-zip format starts with)
        path.write_bytes(pickle.dumps({"hyper_parameters": {"lr": _Hostile(marker)}, "state_dict": {}}, protocol=2))
    return path, marker


def _loading_paths(path: Path, tmp_path: Path, capsys):
    """Every public way vispe reads a checkpoint file, as zero-argument callables."""
    from vispe.benchmarks.resolution_sweep import main as resolution_main
    from vispe.cli import main as vispe_main
    from vispe.models import load_released_loope, load_timm_checkpoint
    from vispe.tasks.retrieval import build_text_tower, load_text_tower_checkpoint
    from vispe.train_cli import AtomicCheckpointIO
    from vispe.train_cli import main as fit_main

    fit = ["fit", "-c", str(SMOKE), "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), "--ckpt_path", str(path)]
    return {
        "read_checkpoint": lambda: read_checkpoint(path),
        "vispe resolution (cli)": _cli_error(lambda: vispe_main(["resolution", str(path), "--out", str(tmp_path / "res")]), capsys),
        "resolution.main": _cli_error(lambda: resolution_main([str(path), "--out", str(tmp_path / "res")]), capsys),
        "vispe fit --ckpt_path": lambda: fit_main(fit),
        "vispe fit --ckpt_path --weights_only false": lambda: fit_main([*fit, "--weights_only", "false"]),
        "vispe validate --ckpt_path": lambda: fit_main(["validate", *fit[1:]]),
        "fit resume 'last' (checkpoint io)": lambda: AtomicCheckpointIO().load_checkpoint(path),
        "load_timm_checkpoint": lambda: load_timm_checkpoint(_tiny_vit(), path),
        "load_released_loope": lambda: load_released_loope(create_encoding("loope", EncodingContext(64, 4, 1, (4, 4))), path),
        "text tower": lambda: load_text_tower_checkpoint(build_text_tower(16, dict(context_length=8, width=32, heads=2, layers=1)), path),
    }


def test_checkpoints_hostile_pickle_never_runs_on_any_loading_path(hostile, tmp_path, capsys):
    path, marker = hostile
    for name, load in _loading_paths(path, tmp_path, capsys).items():
        err = expect_clear_error(load, [str(path), "mkdir", "never runs"])
        assert not marker.exists(), f"{name}: the checkpoint's payload ran"
        assert "weights_only" in str(err), name
        assert isinstance(err, UnsafeCheckpointError) or "resolution" in name, (name, type(err))  # CLIs print it, exit 2
    # timm's own factory (vispe models registered with pretrained=True and a local file) reads with weights_only too
    with pytest.raises((pickle.UnpicklingError, RuntimeError), match="weights_only"):
        timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding="rope_axial", pretrained=True,
                          pretrained_cfg_overlay=dict(file=str(path)), **TINY_VIT)
    assert not marker.exists()
    # and Lightning's own load_from_checkpoint (weights_only by PyTorch's default)
    from vispe.tasks import ImageClassification

    with pytest.raises(pickle.UnpicklingError):
        ImageClassification.load_from_checkpoint(path)
    assert not marker.exists()


def test_checkpoints_hostile_pickle_through_the_hf_loader(hostile, tmp_path):
    """`vispe.integrations.hf.from_pretrained` on a model folder whose `pytorch_model.bin` is the hostile pickle:
    transformers reads `.bin` weights with weights_only, so the payload never runs and loading fails."""
    transformers = pytest.importorskip("transformers")
    from test_hf_integration import _qwen2_vl

    from vispe.integrations import hf as vhf

    path, marker = hostile
    folder = tmp_path / "hf_model"
    _qwen2_vl().save_pretrained(folder)
    for f in folder.glob("*.safetensors"):  # transformers 5 saves safetensors only: put the pickle format in their place
        f.unlink()
    (folder / "pytorch_model.bin").write_bytes(path.read_bytes())
    with pytest.raises(Exception) as info:
        vhf.from_pretrained(transformers.Qwen2VLForConditionalGeneration, folder)
    assert not marker.exists(), "the checkpoint's payload ran"
    assert "weights_only" in str(info.value) or "Weights only load failed" in str(info.value) or "pickle" in str(info.value).lower()


def test_checkpoints_no_unchecked_torch_load_in_vispe():
    """Every file read goes through vispe.files: no other torch.load / pickle.load / weights_only=False in the package."""
    import ast

    offenders = []
    for py in (REPO / "vispe").rglob("*.py"):
        for node in ast.walk(ast.parse(py.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = ast.unparse(node.func)
            if func in ("torch.load", "pickle.load", "pickle.loads", "torch.hub.load_state_dict_from_url") and py.name != "files.py":
                offenders.append(f"{py.relative_to(REPO)}:{node.lineno}: {func}")
            for kw in node.keywords:
                if (kw.arg, ast.unparse(kw.value)) in (("weights_only", "False"), ("allow_pickle", "True")):
                    offenders.append(f"{py.relative_to(REPO)}:{node.lineno}: {kw.arg}={ast.unparse(kw.value)}")
    assert not offenders, offenders


def test_checkpoints_vispe_written_lightning_checkpoint_loads_weights_only(tmp_path):
    """The reader accepts what vispe writes: a Lightning checkpoint of a trained ImageClassification (hparams, callbacks,
    optimizer and scheduler states) loads with weights_only and rebuilds the same model."""
    import lightning.pytorch as pl

    from vispe.benchmarks.resolution_sweep import load_classifier
    from vispe.data import SyntheticDataModule
    from vispe.tasks import ImageClassification

    pl.seed_everything(0, verbose=False)
    dm = SyntheticDataModule(num_classes=4, image_size=16, train_size=32, val_size=32, batch_size=16)
    task = ImageClassification("vispe_vit_tiny_patch4_32", dict(embed_dim=32, depth=1, num_heads=2), "rope_mixed", num_classes=4, img_size=16)
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path, limit_val_batches=1, num_sanity_val_steps=0)
    trainer.fit(task, datamodule=dm)
    path = tmp_path / "ok.ckpt"
    trainer.save_checkpoint(path)
    ckpt = read_checkpoint(path)
    assert {"state_dict", "hyper_parameters", "optimizer_states", "lr_schedulers", "callbacks"} <= set(ckpt)
    rebuilt = load_classifier(ckpt)
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(rebuilt(x), task.eval()(x))


def test_checkpoints_path_objects_in_hyper_parameters_are_plain_data(tmp_path):
    path = tmp_path / "p.ckpt"
    torch.save({"hyper_parameters": {"text_checkpoint": Path("towers/text.pt")}, "state_dict": {}}, path)
    assert read_checkpoint(path)["hyper_parameters"]["text_checkpoint"] == Path("towers/text.pt")


# ---------------------------------------------------------------------------------------------------------------------
# Damaged checkpoints
# ---------------------------------------------------------------------------------------------------------------------
def _good_state_dict_file(tmp_path: Path) -> Path:
    path = tmp_path / "good.pth"
    torch.save(_tiny_vit().state_dict(), path)
    return path


def _damage(kind: str, tmp_path: Path, suffix: str = ".pth") -> Path:
    good = _good_state_dict_file(tmp_path).read_bytes()
    path = tmp_path / f"damaged{suffix}"
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif kind == "random":
        path.write_bytes(np.random.default_rng(0).bytes(4096))
    elif kind == "text":
        path.write_text("<html>404 Not Found</html>\n")
    elif kind == "legacy_truncated":
        buf = io.BytesIO()
        torch.save(_tiny_vit().state_dict(), buf, _use_new_zipfile_serialization=False)
        path.write_bytes(buf.getvalue()[:5000])
    return path


@pytest.mark.parametrize("kind, needles", [
    ("empty", ["empty", "0 bytes"]),
    ("truncated", ["truncated"]),
    ("random", ["not a pytorch checkpoint"]),
    ("text", ["not a pytorch checkpoint"]),
    ("legacy_truncated", ["checkpoint"]),
])
@pytest.mark.parametrize("reader", ["read_checkpoint", "load_timm_checkpoint", "resolution", "fit"])
def test_checkpoints_damaged_file_is_named(kind, needles, reader, tmp_path, capsys):
    from vispe.benchmarks.resolution_sweep import main as resolution_main
    from vispe.models import load_timm_checkpoint
    from vispe.train_cli import main as fit_main

    path = _damage(kind, tmp_path, ".ckpt" if reader in ("resolution", "fit") else ".pth")
    fn = {
        "read_checkpoint": lambda: read_checkpoint(path),
        "load_timm_checkpoint": lambda: load_timm_checkpoint(_tiny_vit(), path),
        "resolution": _cli_error(lambda: resolution_main([str(path), "--out", str(tmp_path / "res")]), capsys),
        "fit": lambda: fit_main(["fit", "-c", str(SMOKE), "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), "--ckpt_path", str(path)]),
    }[reader]
    expect_clear_error(fn, [str(path), *needles])
    assert not (tmp_path / "runs").exists()  # fit refused before building a logger or a checkpoint folder


def test_checkpoints_directory_and_missing_file(tmp_path):
    from vispe.models import load_timm_checkpoint

    expect_clear_error(lambda: read_checkpoint(tmp_path), [str(tmp_path), "directory"])
    expect_clear_error(lambda: read_checkpoint(tmp_path / "nope.ckpt"), ["nope.ckpt", "does not exist"], FileNotFoundError)
    expect_clear_error(lambda: load_timm_checkpoint(_tiny_vit(), tmp_path / "nope.pth"), ["nope.pth", "not found"], FileNotFoundError)


@pytest.mark.parametrize("kind", ["truncated", "empty", "random", "header_only"])
def test_checkpoints_damaged_safetensors(kind, tmp_path):
    from safetensors.torch import save_file

    from vispe.models import load_timm_checkpoint

    good = tmp_path / "good.safetensors"
    save_file(_tiny_vit().state_dict(), str(good))
    data = good.read_bytes()
    path = tmp_path / "bad.safetensors"
    header_len = struct.unpack("<Q", data[:8])[0]
    path.write_bytes({"truncated": data[: len(data) // 2], "empty": b"", "random": np.random.default_rng(1).bytes(256),
                      "header_only": data[: 8 + header_len]}[kind])
    for fn in (lambda: read_safetensors(path), lambda: load_timm_checkpoint(_tiny_vit(), path)):
        expect_clear_error(fn, [str(path)], DamagedFileError)


def test_checkpoints_state_dict_that_keeps_nothing_is_refused(tmp_path):
    from vispe.models import load_timm_checkpoint

    resnet = timm.create_model("resnet18", num_classes=4).state_dict()
    model = _tiny_vit()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    expect_clear_error(lambda: load_timm_checkpoint(model, resnet), ["keeps nothing", "0 of", "conv1.weight"])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # untouched
    path = tmp_path / "resnet.pth"
    torch.save(resnet, path)
    expect_clear_error(lambda: load_timm_checkpoint(_tiny_vit(), path), ["keeps nothing"])
    expect_clear_error(lambda: load_timm_checkpoint(_tiny_vit(), {}), ["keeps nothing"])


def test_checkpoints_file_that_is_not_a_state_dict(tmp_path):
    from vispe.models import load_timm_checkpoint

    path = tmp_path / "list.pth"
    torch.save([torch.zeros(2)], path)
    expect_clear_error(lambda: load_timm_checkpoint(_tiny_vit(), path), [str(path), "not a state dict"])


def test_checkpoints_wrong_width_into_vit():
    from vispe.models import load_timm_checkpoint

    wide = timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding="rope_axial", **dict(TINY_VIT, embed_dim=48)).state_dict()
    expect_clear_error(lambda: load_timm_checkpoint(_tiny_vit(), wide), ["width 48", "embed_dim=32"])


@pytest.mark.slow
def test_checkpoints_resolution_sweep_of_another_task_or_tampered_weights(narrow_ckpt, tmp_path, capsys):
    from vispe.benchmarks.resolution_sweep import main as resolution_main

    ckpt = read_checkpoint(narrow_ckpt)
    other = dict(ckpt, hyper_parameters=dict(ckpt["hyper_parameters"], _class_path="vispe.tasks.VideoTextRetrieval"))
    torch.save(other, tmp_path / "other.ckpt")
    expect_clear_error(_cli_error(lambda: resolution_main([str(tmp_path / "other.ckpt"), "--out", str(tmp_path / "r")]), capsys),
                       ["other.ckpt", "VideoTextRetrieval", "ImageClassification"])
    tampered = dict(ckpt, state_dict={k: v for k, v in ckpt["state_dict"].items() if "blocks.1." not in k})
    torch.save(tampered, tmp_path / "tampered.ckpt")
    expect_clear_error(_cli_error(lambda: resolution_main([str(tmp_path / "tampered.ckpt"), "--out", str(tmp_path / "r")]), capsys),
                       ["tampered.ckpt", "do not rebuild", "blocks.1"])


@pytest.mark.slow
def test_data_damaged_earlier_sweep_results_are_named(narrow_ckpt, tmp_path, capsys):
    from vispe.benchmarks.resolution_sweep import main as resolution_main

    out = tmp_path / "res"
    out.mkdir()
    (out / "resolution.json").write_text('{"results": [')  # a sweep killed while writing (or a hand edit)
    expect_clear_error(_cli_error(lambda: resolution_main([str(narrow_ckpt), "--out", str(out), "--sizes", "16"]), capsys),
                       ["resolution.json", "not valid json", "line 1"])


def test_checkpoints_resolution_sweep_of_a_plain_state_dict(tmp_path, capsys):
    from vispe.benchmarks.resolution_sweep import main as resolution_main

    path = _good_state_dict_file(tmp_path)
    expect_clear_error(_cli_error(lambda: resolution_main([str(path), "--out", str(tmp_path / "r")]), capsys),
                       [str(path), "not a lightning checkpoint"])


# ---------------------------------------------------------------------------------------------------------------------
# fit --ckpt_path: the checkpoint's architecture never silently replaces the configured one
# ---------------------------------------------------------------------------------------------------------------------
def _fit_args(save_dir: Path, *extra: str) -> list[str]:
    return ["fit", "-c", str(SMOKE), "--trainer.logger.init_args.save_dir", str(save_dir), "--trainer.max_epochs", "1",
            "--trainer.limit_train_batches", "1", "--trainer.limit_val_batches", "1", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", *extra]


@pytest.fixture(scope="module")
def narrow_ckpt(tmp_path_factory) -> Path:
    """A 32-wide smoke-config checkpoint written by `vispe fit` (one step)."""
    from vispe.train_cli import main as fit_main

    out = tmp_path_factory.mktemp("narrow")
    fit_main(_fit_args(out))
    return out / "rope_mixed" / "version_0" / "checkpoints" / "last.ckpt"


WIDE = '{embed_dim: 48, depth: 2, num_heads: 2}'


@pytest.mark.slow
def test_checkpoints_fit_resume_other_architecture_is_refused(narrow_ckpt, tmp_path):
    from vispe.train_cli import main as fit_main

    err = expect_clear_error(lambda: fit_main(_fit_args(tmp_path, "--ckpt_path", str(narrow_ckpt), "--model.init_args.model_kwargs", WIDE)),
                             [str(narrow_ckpt), "embed_dim': 48", "embed_dim': 32", "--ckpt_hparams checkpoint", "--ckpt_hparams config"])
    assert isinstance(err, ValueError)
    assert not any(tmp_path.iterdir())  # refused before any logger / checkpoint folder


@pytest.mark.slow
def test_checkpoints_fit_resume_last_of_other_architecture_is_refused(narrow_ckpt, tmp_path):
    """`--ckpt_path last` is resolved by the Trainer; the comparison runs there, before any training step."""
    import shutil

    from vispe.train_cli import main as fit_main

    run = tmp_path / "run"
    shutil.copytree(narrow_ckpt.parents[3], run)
    last = run / "rope_mixed" / "version_0" / "checkpoints" / "last.ckpt"
    stamp = last.stat().st_mtime_ns
    expect_clear_error(lambda: fit_main(_fit_args(run, "--ckpt_path", "last", "--model.init_args.model_kwargs", WIDE)),
                       ["--ckpt_path last", "last.ckpt", "embed_dim': 48", "embed_dim': 32"])
    assert last.stat().st_mtime_ns == stamp  # nothing trained, nothing saved over it


@pytest.mark.slow
def test_checkpoints_fit_resume_opt_in_to_the_checkpoint_architecture(narrow_ckpt, tmp_path):
    """`--ckpt_hparams checkpoint` is the explicit opt-in: the 32-wide model of the checkpoint is built and trained on."""
    from vispe.train_cli import main as fit_main

    fit_main(_fit_args(tmp_path, "--ckpt_path", str(narrow_ckpt), "--model.init_args.model_kwargs", WIDE,
                       "--ckpt_hparams", "checkpoint", "--trainer.max_epochs", "2"))
    saved = read_checkpoint(tmp_path / "rope_mixed" / "version_0" / "checkpoints" / "last.ckpt")
    assert saved["hyper_parameters"]["model_kwargs"]["embed_dim"] == 32
    assert saved["state_dict"]["model.patch_embed.proj.weight"].shape[0] == 32


@pytest.mark.slow
def test_checkpoints_fit_resume_keep_config_architecture_fails_on_the_weights(narrow_ckpt, tmp_path):
    """`--ckpt_hparams config` builds the configured 48-wide model; the 32-wide weights cannot fill it: a size error."""
    from vispe.train_cli import main as fit_main

    expect_clear_error(lambda: fit_main(_fit_args(tmp_path, "--ckpt_path", str(narrow_ckpt), "--model.init_args.model_kwargs", WIDE,
                                                  "--ckpt_hparams", "config")), ["size mismatch", "patch_embed.proj.weight"])


@pytest.mark.slow
def test_checkpoints_fit_resume_same_architecture_needs_no_flag(narrow_ckpt, tmp_path):
    from vispe.train_cli import main as fit_main

    fit_main(_fit_args(tmp_path, "--ckpt_path", str(narrow_ckpt), "--trainer.max_epochs", "2"))
    assert read_checkpoint(tmp_path / "rope_mixed" / "version_0" / "checkpoints" / "last.ckpt")["epoch"] == 1


# ---------------------------------------------------------------------------------------------------------------------
# Damaged data files: refused when the DataModule is built, naming the file
# ---------------------------------------------------------------------------------------------------------------------
def _cifar_dir(tmp_path: Path, train_bytes: bytes | None = None) -> Path:
    """A tiny CIFAR-10 layout: two zips with one 32x32 JPEG per split (``train_bytes`` replaces the train zip)."""
    from PIL import Image

    d = tmp_path / "cifar10-jpeg"
    d.mkdir(parents=True)
    buf = io.BytesIO()
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(buf, format="JPEG")
    for split in ("train", "test"):
        with zipfile.ZipFile(d / f"cifar10_{split}_jpeg.zip", "w") as z:
            for i in range(4):
                z.writestr(f"{split}/cat/{i:04d}.jpg", buf.getvalue())
    if train_bytes is not None:
        (d / "cifar10_train_jpeg.zip").write_bytes(train_bytes)
    return d


def test_data_cifar10_good_zip_builds(tmp_path):
    from vispe.data import CIFAR10JpegDataModule

    dm = CIFAR10JpegDataModule(data_dir=str(_cifar_dir(tmp_path)), batch_size=2)
    train, val, _ = dm.build_datasets()
    assert len(train) == 4 and len(val) == 4 and train[0][0].shape == (3, 32, 32)


@pytest.mark.parametrize("kind, needles", [
    ("not_a_zip", ["not a zip archive"]),
    ("truncated", ["cut short"]),
    ("empty", ["empty"]),
    ("no_jpegs", ["no .jpg members"]),
])
def test_data_cifar10_damaged_zip_fails_at_construction(kind, needles, tmp_path):
    from vispe.data import CIFAR10JpegDataModule

    good = _cifar_dir(tmp_path / "ref")
    data = (good / "cifar10_train_jpeg.zip").read_bytes()
    other = io.BytesIO()
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("README.txt", "hello")
    bad = {"not_a_zip": b"this is an HTML error page, not a zip" * 20, "truncated": data[: len(data) * 2 // 3], "empty": b"",
           "no_jpegs": other.getvalue()}[kind]
    d = _cifar_dir(tmp_path, bad)
    expect_clear_error(lambda: CIFAR10JpegDataModule(data_dir=str(d)), ["cifar10_train_jpeg.zip", *needles])


def test_data_cifar10_corrupt_member_is_named(tmp_path):
    from vispe.data import load_cifar10_zip

    d = tmp_path / "c"
    d.mkdir()
    with zipfile.ZipFile(d / "x.zip", "w") as z:
        z.writestr("train/cat/0000.jpg", b"\xff\xd8 not really a jpeg")
    expect_clear_error(lambda: load_cifar10_zip(d / "x.zip"), ["x.zip", "train/cat/0000.jpg", "damaged"])


def test_data_cifar10_damaged_cache_is_named(tmp_path):
    from vispe.data import CIFAR10JpegDataModule

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "cifar10_train_uint8.npz").write_bytes(b"PK\x03\x04 cut")
    dm = CIFAR10JpegDataModule(data_dir=str(_cifar_dir(tmp_path)), cache_dir=str(cache))
    expect_clear_error(lambda: dm.dataset._load("train"), ["cifar10_train_uint8.npz", "delete it"])


def _image_folder(root: Path, classes: tuple[str, ...], broken: bool = False) -> Path:
    from PIL import Image

    for c in classes:
        (root / c).mkdir(parents=True)
        Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(root / c / "0.png")
    if broken:
        (root / classes[0] / "1.png").write_bytes(b"\x89PNG cut")
    return root


def test_data_image_folder_class_mismatch_fails_at_construction(tmp_path):
    from vispe.data import ImageFolderDataModule

    train = _image_folder(tmp_path / "train", ("cat", "dog"))
    val = _image_folder(tmp_path / "val", ("cat", "dgo"))
    expect_clear_error(lambda: ImageFolderDataModule(str(train), str(val), image_size=8), ["val_dir", "dgo", "train_dir"])
    empty = tmp_path / "empty"
    empty.mkdir()
    expect_clear_error(lambda: ImageFolderDataModule(str(empty), str(val), image_size=8), ["train_dir", "no class sub-folders"])


@pytest.mark.xfail(strict=True, reason="a corrupt image inside an ImageFolder tree is found when its batch is decoded (PIL names the "
                                       "file then); finding it at construction would decode the whole data set")
def test_data_image_folder_corrupt_image_fails_at_construction(tmp_path):
    from vispe.data import ImageFolderDataModule

    train = _image_folder(tmp_path / "train", ("cat", "dog"), broken=True)
    val = _image_folder(tmp_path / "val", ("cat", "dog"))
    expect_clear_error(lambda: ImageFolderDataModule(str(train), str(val), image_size=8), ["1.png"])


def _idx_bytes(images: bool = True, n: int = 5) -> bytes:
    if images:
        return struct.pack(">IIII", 2051, n, 28, 28) + bytes(n * 28 * 28)
    return struct.pack(">II", 2049, n) + bytes(range(n))


def _fmnist_dir(tmp_path: Path, damage: dict[str, bytes] | None = None, gz: bool = True) -> Path:
    d = tmp_path / "fashion-mnist"
    d.mkdir()
    for prefix in ("train", "t10k"):
        for kind, images in (("images-idx3-ubyte", True), ("labels-idx1-ubyte", False)):
            name = f"{prefix}-{kind}"
            raw = _idx_bytes(images)
            (d / (name + (".gz" if gz else ""))).write_bytes(gzip.compress(raw) if gz else raw)
    for name, data in (damage or {}).items():
        (d / name).write_bytes(data)
    return d


def test_data_fashion_mnist_good_files_build(tmp_path):
    from vispe.data import FashionMNISTDataModule

    dm = FashionMNISTDataModule(data_dir=str(_fmnist_dir(tmp_path)))
    train, _, _ = dm.build_datasets()
    assert len(train) == 5 and train[0][0].shape == (1, 28, 28)


@pytest.mark.parametrize("kind, needles", [
    ("truncated_gz", ["truncated or damaged gzip"]),
    ("random_gz", ["not a readable gzip"]),
    ("wrong_magic", ["not an idx file"]),
    ("short_raw", ["header promises"]),
])
def test_data_fashion_mnist_damaged_file_fails_at_construction(kind, needles, tmp_path):
    from vispe.data import FashionMNISTDataModule

    full = gzip.compress(_idx_bytes(True, n=200))
    name = "train-images-idx3-ubyte.gz"
    if kind == "truncated_gz":
        damage, gz = {name: full[: len(full) // 2]}, True
    elif kind == "random_gz":
        damage, gz = {name: np.random.default_rng(2).bytes(300)}, True
    elif kind == "wrong_magic":
        damage, gz = {name: gzip.compress(b"\x12\x34\x56\x78" + bytes(100))}, True
    else:
        name = "train-images-idx3-ubyte"
        damage, gz = {name: _idx_bytes(True)[:-7]}, False
    d = _fmnist_dir(tmp_path, damage, gz)
    expect_clear_error(lambda: FashionMNISTDataModule(data_dir=str(d)), [name, *needles])


def test_data_fashion_mnist_labels_of_another_split_fail_at_construction(tmp_path):
    from vispe.data import FashionMNISTDataModule

    d = _fmnist_dir(tmp_path, {"t10k-labels-idx1-ubyte.gz": gzip.compress(_idx_bytes(False, n=7))})
    expect_clear_error(lambda: FashionMNISTDataModule(data_dir=str(d)), ["t10k-labels-idx1-ubyte.gz", "(7,)", "(5, 28, 28)"])


def test_data_read_idx_of_truncated_gz_names_the_file(tmp_path):
    path = tmp_path / "x-idx3-ubyte.gz"
    full = gzip.compress(_idx_bytes(True, n=300))
    path.write_bytes(full[: len(full) - 40])
    expect_clear_error(lambda: read_idx(path), [str(path), "truncated"])
    path.write_bytes(gzip.compress(_idx_bytes(True)))
    assert check_idx(path) == (5, 28, 28) and read_idx(path).shape == (5, 28, 28)


@pytest.mark.parametrize("kind, needles", [
    ("truncated", ["not a readable digits csv"]),
    ("columns", ["columns, expected 65"]),
])
def test_data_digits_damaged_csv_fails_at_construction(kind, needles, tmp_path):
    from vispe.data import DigitsDataModule

    rows = "\n".join(",".join(["1"] * 65) for _ in range(20)) + "\n"
    path = tmp_path / "digits.csv.gz"
    full = gzip.compress(rows.encode())
    path.write_bytes(full[: len(full) // 2] if kind == "truncated" else gzip.compress(b"1,2,3\n4,5,6\n"))
    expect_clear_error(lambda: DigitsDataModule(data_path=str(path)), [str(path), *needles])


def _manifest(tmp_path: Path, text: str | bytes, name: str = "m.json") -> Path:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


@pytest.mark.parametrize("content, name, needles", [
    ('[{"video": "a.mp4", "caption": "x"}', "m.json", ["not valid json", "line 1"]),
    ("", "m.json", ["empty"]),
    (b"\xff\xfe\x00garbage", "m.json", ["not utf-8"]),
    ('{"a.mp4": {"title": "no caption"}}', "m.json", ["no caption key"]),
    ("[]", "m.json", ["lists no videos"]),
    ("42", "m.json", ["unsupported manifest layout"]),
    ("video,title\na.mp4,x\n", "m.csv", ["m.csv:2", "caption key"]),
    (b"video,caption\n\xff\xfe,x\n", "m.csv", ["not a readable csv"]),
])
def test_data_damaged_manifest(content, name, needles, tmp_path):
    from vispe.data import VideoTextDataModule, load_manifest

    path = _manifest(tmp_path, content, name)
    expect_clear_error(lambda: load_manifest(path), [str(path), *needles])
    # the DataModule reads its manifests when it is built, not in setup
    expect_clear_error(lambda: VideoTextDataModule(train_manifest=str(path)), [str(path), *needles])


def test_data_missing_manifest_names_the_argument(tmp_path):
    from vispe.data import VideoTextDataModule

    expect_clear_error(lambda: VideoTextDataModule(val_manifest=str(tmp_path / "nope.json")), ["val_manifest", "nope.json"], FileNotFoundError)


def test_data_manifest_listing_missing_videos_fails_at_construction(tmp_path, tiny_video):
    from vispe.data import VideoTextDataModule

    path = _manifest(tmp_path, json.dumps([{"video": str(tiny_video), "caption": "a"}, {"video": "gone.mp4", "caption": "b"}]))
    expect_clear_error(lambda: VideoTextDataModule(train_manifest=str(path)), ["train_manifest", "1 of 2 videos", "gone.mp4", "video_root"],
                       FileNotFoundError)
    assert VideoTextDataModule(train_manifest=str(path), on_error="skip").train_manifest == str(path)  # the opt-out


def test_data_read_json_names_line_and_column(tmp_path):
    path = _manifest(tmp_path, '{\n  "a": 1,\n  "b": }\n')
    expect_clear_error(lambda: read_json(path), [str(path), "line 3", "column"])


@pytest.fixture(scope="module")
def tiny_video(tmp_path_factory) -> Path:
    from vispe.data.video_io import write_video

    return write_video(tmp_path_factory.mktemp("v") / "clip.mp4", np.zeros((4, 16, 16, 3), np.uint8), codec="mpeg4")


@pytest.mark.parametrize("num_frames", [-3, 0, 2.5, True, "4"])
@pytest.mark.parametrize("backend", ["decord", "pyav"])
def test_data_read_video_bad_num_frames(num_frames, backend, tiny_video):
    from vispe.data.video_io import read_video

    expect_clear_error(lambda: read_video(tiny_video, num_frames=num_frames, backend=backend), ["num_frames", repr(num_frames)])


@pytest.mark.parametrize("content", [b"", b"\x00" * 64, b"not a video at all" * 10])
def test_data_read_video_damaged_file(content, tmp_path):
    from vispe.data.video_io import VideoReadError, read_video

    path = tmp_path / "broken.mp4"
    path.write_bytes(content)
    expect_clear_error(lambda: read_video(path), [str(path)], VideoReadError)


@pytest.mark.parametrize("num_frames", [0, -1, 1.5])
def test_data_video_datamodule_bad_num_frames(num_frames):
    from vispe.data import VideoTextDataModule

    expect_clear_error(lambda: VideoTextDataModule(num_frames=num_frames), ["num_frames", repr(num_frames)])


def test_data_three_cell_damaged_npz(tmp_path):
    from vispe.data.three_cell import load_npz

    path = tmp_path / "samples.npz"
    path.write_bytes(b"PK\x03\x04" + bytes(50))
    expect_clear_error(lambda: load_npz(path), [str(path), "cut short"])
    np.savez(path, cells=np.zeros(3))
    expect_clear_error(lambda: load_npz(path), [str(path), "lacks the arrays"])
    np.savez(path, cells=np.array([{"payload": 1}], dtype=object))  # a pickle inside the npz is never loaded
    expect_clear_error(lambda: load_npz(path), [str(path), "pickled python objects"])


# ---------------------------------------------------------------------------------------------------------------------
# CLI / YAML: misspelled keys and bad values are refused while the config is parsed
# ---------------------------------------------------------------------------------------------------------------------
def _fit(tmp_path: Path, *args: str, config: Path = SMOKE):
    from vispe.train_cli import main as fit_main

    return lambda: fit_main(["fit", "-c", str(config), "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), *args])


def _yaml(tmp_path: Path, old: str, new: str) -> Path:
    """The smoke config with one edit and its logs under ``tmp_path/runs``."""
    text = SMOKE.read_text().replace("save_dir: runs/smoke", f"save_dir: {tmp_path / 'runs'}")
    assert old in text
    path = tmp_path / "bad.yaml"
    path.write_text(text.replace(old, new))
    return path


@pytest.mark.parametrize("case, args, needles", [
    ("model key misspelled", ["--model.init_args.lrr", "0.1"], ["lrr"]),
    ("trainer key misspelled", ["--trainer.max_epohcs", "3"], ["max_epohcs"]),
    ("prefix of a real key", ["--trainer.max_epoch", "3"], ["max_epoch"]),
    ("float as text", ["--model.init_args.lr", "fast"], ["lr", "fast"]),
    ("int as text", ["--trainer.max_epochs", "many"], ["max_epochs", "many"]),
    ("data key misspelled", ["--data.init_args.batchsize", "8"], ["batchsize"]),
    ("unknown data class", ["--data", "vispe.data.NoSuchDataModule"], ["NoSuchDataModule"]),
    ("ckpt_hparams choice", ["--ckpt_path", str(SMOKE), "--ckpt_hparams", "whatever"], ["--ckpt_hparams", "whatever", "refuse"]),
    ("missing ckpt_path", ["--ckpt_path", "no/such/run.ckpt"], ["no/such/run.ckpt", "does not exist"]),
    ("unknown pe", ["--model.init_args.pos_encoding", "rope_axail"], ["rope_axail", "choose one of"]),
    ("bad batch size", ["--data.init_args.batch_size", "0"], ["batch_size", "0"]),
    ("bad augment", ["--data.init_args.augment", "rotate"], ["augment", "rotate"]),
    ("heads do not split width", ["--model.init_args.model_kwargs", "{embed_dim: 30, depth: 1, num_heads: 4}"], ["num_heads"]),
    ("negative lr", ["--model.init_args.lr", "-1"], ["lr must be > 0", "-1"]),
    ("negative warmup", ["--model.init_args.warmup_epochs", "-1"], ["warmup_epochs", "-1"]),
    ("nan weight decay", ["--model.init_args.weight_decay", "nan"], ["weight_decay", "nan"]),
    ("label smoothing 2", ["--model.init_args.label_smoothing", "2"], ["label_smoothing", "[0, 1)"]),
    ("mix backend", ["--model.init_args.mix_backend", "foo"], ["mix_backend", "foo", "timm"]),
    ("negative workers", ["--data.init_args.num_workers", "-1"], ["num_workers", "-1"]),
    ("zero channels", ["--data.init_args.dataset.init_args.in_chans", "0"], ["in_chans", "0"]),
    ("zero eval batch", ["--data.init_args.eval_batch_size", "0"], ["eval_batch_size", "0"]),
    ("zero eval subset", ["--data.init_args.eval_subset", "0"], ["subset size", "0"]),
    ("image size not a patch multiple", ["--data.init_args.dataset.init_args.image_size", "18"], ["img_size=(18, 18)", "patch_size=(4, 4)"]),
    ("zero devices", ["--trainer.devices", "0"], ["devices", "0"]),
    ("negative max_epochs", ["--trainer.max_epochs", "-5"], ["max_epochs", "-5"]),
])
@pytest.mark.slow
def test_cli_bad_flag(case, args, needles, tmp_path, capsys):
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    expect_clear_error(_cli_error(_fit(tmp_path, *args), capsys), needles, (ValueError, TypeError, FileNotFoundError, MisconfigurationException))
    assert not (tmp_path / "runs").exists(), case


@pytest.mark.parametrize("case, old, new, needles", [
    ("top-level key misspelled", "trainer:", "trainr:", ["trainr"]),
    ("init_args key misspelled", "    model_kwargs:", "    model_kwarg:", ["model_kwarg"]),
    ("yaml syntax", "  max_epochs: 2", "  max_epochs: [2", ["bad.yaml", "not valid yaml", "line 8"]),
    ("wrong type in yaml", "    lr: 0.003", "    lr: [0.003]", ["lr"]),
    ("data value", "    image_size: 16", "    image_size: 2", ["image_size", "2"]),
])
@pytest.mark.slow
def test_cli_bad_yaml(case, old, new, needles, tmp_path, capsys):
    from vispe.train_cli import main as fit_main

    config = _yaml(tmp_path, old, new)
    expect_clear_error(_cli_error(lambda: fit_main(["fit", "-c", str(config)]), capsys), needles)
    assert not (tmp_path / "runs").exists(), case


@pytest.mark.parametrize("text, needles", [("- a\n- b\n", ["odd.yaml", "is a YAML list", "not a LightningCLI config"]),
                                           ("", ["odd.yaml", "is empty", "not a LightningCLI config"])])
def test_cli_config_that_is_not_a_mapping(text, needles, tmp_path, capsys):
    from vispe.train_cli import main as fit_main

    path = tmp_path / "odd.yaml"
    path.write_text(text)
    expect_clear_error(_cli_error(lambda: fit_main(["fit", "-c", str(path)]), capsys), needles)


def test_cli_missing_config_file(tmp_path, capsys):
    expect_clear_error(_cli_error(_fit(tmp_path, config=tmp_path / "nope.yaml"), capsys), ["nope.yaml", "does not exist"])


def test_cli_unknown_subcommand(capsys):
    from vispe.cli import main as vispe_main

    expect_clear_error(_cli_error(lambda: vispe_main(["fitt"]), capsys), ["fitt", "choose one of"])


def test_cli_resolution_missing_checkpoint(tmp_path, capsys):
    from vispe.cli import main as vispe_main

    expect_clear_error(_cli_error(lambda: vispe_main(["resolution", str(tmp_path / "none.ckpt"), "--out", str(tmp_path)]), capsys),
                       ["none.ckpt", "not found"])
