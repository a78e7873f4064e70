"""Errors name the flag of the command being run and the fix that works: data paths, recorded relative paths,
class counts, encodings for another grid, distributed errors printed once."""
from __future__ import annotations

import json

import pytest
import timm
import torch

import vispe  # noqa: F401
from vispe.data import ImageFolderDataModule
from vispe.data.eval_sets import class_index_map, torchvision_set
from vispe.data.loading import locate_recorded_paths, resolve_data_path


def test_missing_image_folder_names_its_argument_and_flag_not_the_data_root(tmp_path, monkeypatch):
    monkeypatch.setenv("VISPE_DATA_ROOT", str(tmp_path))
    with pytest.raises(FileNotFoundError) as err:
        ImageFolderDataModule(train_dir=str(tmp_path / "no_train"), val_dir=str(tmp_path))
    msg = str(err.value)
    assert "no_train" in msg and "--data.init_args.dataset.init_args.train_dir" in msg
    assert "data_dir" not in msg and "VISPE_DATA_ROOT" not in msg  # it has no effect on an explicit folder


def test_torchvision_set_of_vispe_resolution_suggests_data_root(tmp_path, monkeypatch):
    monkeypatch.setenv("VISPE_DATA_ROOT", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"--data-root") as err:
        torchvision_set("CIFAR10")
    assert "--data.data_dir" not in str(err.value) and "--data.init_args" not in str(err.value)
    monkeypatch.delenv("VISPE_DATA_ROOT")
    with pytest.raises(FileNotFoundError, match=r"given by root: --data-root"):
        torchvision_set("CIFAR10", root=str(tmp_path / "nope"))


def test_default_location_message_names_the_flag(tmp_path, monkeypatch):
    monkeypatch.delenv("VISPE_DATA_ROOT", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"pass --data\.init_args\.data_dir /path/to/fashion-mnist, or set VISPE_DATA_ROOT"):
        resolve_data_path(None, "fashion-mnist", "Fashion-MNIST IDX files")


def test_recorded_relative_paths_resolve_against_the_run_directory(tmp_path, monkeypatch):
    run_dir = tmp_path / "project"
    (run_dir / "imgs" / "train").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    init = {"train_dir": "imgs/train", "val_dir": "imgs/train", "batch_size": 4, "data_dir": None}
    out = locate_recorded_paths(init, str(run_dir), "the checkpoint's ImageFolderDataModule", "pass --data")
    assert out["train_dir"] == str(run_dir / "imgs" / "train") and out["batch_size"] == 4
    with pytest.raises(FileNotFoundError, match=r"train_dir='imgs/gone' \(looked for at 'imgs/gone' and '.*project/imgs/gone'\).*; pass --data"):
        locate_recorded_paths({"train_dir": "imgs/gone"}, str(run_dir), "the checkpoint's ImageFolderDataModule", "pass --data")
    # data_dir falls back to $VISPE_DATA_ROOT / data/: not an error here
    assert locate_recorded_paths({"data_dir": "gone"}, str(run_dir), "x", "y") == {"data_dir": "gone"}


def test_class_count_message_says_everything_the_timm_sweep_needs():
    with pytest.raises(ValueError) as err:
        class_index_map(("cat", "dog"), 2, None, 1000, set_name="my_images/", model_name="vit_small_patch16_224")
    msg = str(err.value)
    assert "--classes FILE" in msg and "--allow-class-subset" in msg and "2 of the model's 1000 classes" in msg
    names = [f"c{i}" for i in range(998)] + ["cat", "dog"]
    assert class_index_map(("cat", "dog"), 2, names, 1000, allow_subset=True).tolist() == [998, 999]


def test_3d_encoding_in_a_2d_model_is_refused_naming_the_2d_variant():
    with pytest.raises(ValueError, match=r"'rope_mixed_3d' takes 3-D grids, but the model's grid \(8, 8\) is 2-D.*did you mean 'rope_mixed'"):
        timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding="rope_mixed_3d", num_classes=3)
    model = timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding="rope_mixed", num_classes=3)
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 3)


@pytest.mark.parametrize("rank", ["0", "1"])
def test_distributed_error_printed_once_and_handed_to_the_launcher(rank, tmp_path, monkeypatch, capsys):
    from vispe import cli

    error_file = tmp_path / f"error_{rank}.json"
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "1")  # no wait in the test
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    assert cli.main(["fit", "--recipe", "smok"]) == 2
    err = capsys.readouterr().err
    assert (err.count("recipe='smok'") == 1) == (rank == "0") and (err == "") == (rank != "0")
    assert "recipe='smok'" in json.loads(error_file.read_text())["message"]
