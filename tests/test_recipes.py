"""Training recipes as package data: every shipped recipe parses through LightningCLI, the cifar10 recipe takes every
2D encoding as an override (and names the run after it), ``--recipe`` resolves from an installed wheel, and bad
recipe names / overrides are one clear sentence."""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from child_python import FAST_EXIT

from vispe.benchmarks.grid import list_grids, load_grid
from vispe.recipes import list_recipes, recipe_path
from vispe.train_cli import expand_recipe_args, main, run_name

REPO = Path(__file__).resolve().parents[1]


def _parsed(*args: str) -> dict:
    """The full configuration ``vispe fit ARGS`` would run with (``--print_config``: parse only, nothing is built)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as stop:
        main(["fit", *args, "--print_config"])
    assert stop.value.code in (0, None)
    return yaml.safe_load(out.getvalue())


def test_shipped_recipes_are_the_package_data_files():
    names = list_recipes()
    assert {"cifar10", "cifar10_cpu", "fashion_mnist", "smoke", "synthetic_tiny"} <= set(names)
    for name in names:
        path = recipe_path(name)
        assert path.is_file() and path.parent == REPO / "vispe" / "recipes" and path.stem == name
    # the per-encoding files are gone: an encoding is an override, not a file
    assert not (REPO / "configs" / "cifar10").exists() and not any("rope" in n for n in names)


@pytest.mark.parametrize("name", list_recipes())
@pytest.mark.slow
def test_every_shipped_recipe_parses_through_lightning_cli(name):
    cfg = _parsed("--recipe", name)
    assert cfg["model"]["class_path"].startswith("vispe.tasks.") and cfg["data"]["class_path"].startswith("vispe.data.")
    raw = yaml.safe_load(recipe_path(name).read_text())
    assert cfg["seed_everything"] == raw["seed_everything"]
    for key, value in raw["model"]["init_args"].items():  # the recipe's numbers are what the run gets
        assert cfg["model"]["init_args"][key] == value, key


@pytest.mark.parametrize("encoding", load_grid("cpu", "resolution").part("fashion_mnist").encodings)
@pytest.mark.slow
def test_cifar10_recipe_takes_every_2d_encoding_as_an_override(encoding):
    cfg = _parsed("--recipe", "cifar10", "--model.init_args.pos_encoding", encoding)
    init = cfg["model"]["init_args"]
    assert init["pos_encoding"] == encoding and run_name(cfg["model"]) == encoding
    # the rest is the published recipe, whatever the encoding
    assert (init["model"], init["lr"], init["weight_decay"], init["warmup_epochs"], init["min_lr"]) == (
        "vispe_vit_tiny_patch4_32", 1e-3, 0.05, 5, 1e-5)
    assert cfg["trainer"]["max_epochs"] == 100 and cfg["data"]["init_args"]["batch_size"] == 128
    assert cfg["trainer"]["logger"]["init_args"]["name"] == "lightning_logs"  # unset: the run takes the encoding's name
    from vispe.tasks import build_model

    model = build_model(init["model"], init["model_kwargs"], init["pos_encoding"], num_classes=10, img_size=32)
    assert model.patch_embed.patch_size == (4, 4) and model.embed_dim == 192  # ViT-Tiny class, patch 4
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 10)


def test_run_name_is_the_encoding_without_its_options():
    def model(spec):
        return {"init_args": {"pos_encoding": spec}}

    assert run_name(model("rope_axial[coord_shift=1.0,coord_rescale=2.0]")) == "rope_axial"
    assert run_name(model({"name": "seqpe", "num_pivots": 8})) == "seqpe"
    assert run_name(model("learned[init_std=0.0]+rope_axial")) == "learned+rope_axial"
    assert run_name(model(None)) is None and run_name({"init_args": {}}) is None


@pytest.mark.slow
def test_fit_with_a_recipe_names_the_run_after_the_encoding(tmp_path):
    main(["fit", "--recipe", "smoke", "--model.init_args.pos_encoding", "rope_axial",
          "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.max_steps", "1", "--trainer.limit_val_batches", "1",
          "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"])
    ckpt = torch.load(tmp_path / "rope_axial" / "version_0" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["hyper_parameters"]["pos_encoding"] == "rope_axial" and ckpt["global_step"] == 1
    # an explicit name wins
    main(["fit", "--recipe", "smoke", "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.logger.init_args.name", "mine",
          "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false",
          "--trainer.enable_model_summary", "false"])
    assert (tmp_path / "mine" / "version_0" / "checkpoints" / "last.ckpt").is_file()


def test_recipe_flag_is_a_config_file_in_place():
    assert expand_recipe_args(["fit", "--recipe", "smoke", "--x", "1"]) == ["fit", "-c", str(recipe_path("smoke")), "--x", "1"]
    assert expand_recipe_args(["fit", "--recipe=cifar10"]) == ["fit", "-c", str(recipe_path("cifar10"))]
    assert expand_recipe_args(["fit", "--recipe", str(REPO / "configs" / "image_folder.yaml")])[2] == str(REPO / "configs" / "image_folder.yaml")


@pytest.mark.parametrize("args, needles", [
    (["--recipe", "cifar100"], ["cifar100", "shipped recipes", "cifar10"]),
    (["--recipe"], ["--recipe needs a recipe name"]),
    (["--recipe", "smoke", "--model.init_args.lrr", "3"], ["lrr", "not accepted"]),
    (["--recipe", "smoke", "--trainer.max_epochs", "many"], ["max_epochs", "many"]),
])
def test_bad_recipe_or_override_is_one_sentence(args, needles, tmp_path):
    from vispe.cli import main as vispe

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert vispe(["fit", *args, "--trainer.logger.init_args.save_dir", str(tmp_path)]) == 2
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("vispe fit: error: ") and "--debug" in lines[1], err.getvalue()
    assert all(n in lines[0] for n in needles), lines[0]
    assert "usage:" not in err.getvalue() and "Traceback" not in err.getvalue()


def test_resolution_benchmark_parts_are_shipped_recipes_with_overrides():
    for name in list_grids():
        for part in load_grid(name).parts:
            assert part.recipe in list_recipes(), part
            assert all(k.split(".")[0] in ("trainer", "model", "data") for k in part.overrides), part.overrides


@pytest.mark.slow
def test_recipes_resolve_and_parse_from_an_installed_copy(tmp_path):
    """``pip install --target`` of this source tree, then a fresh interpreter whose cwd is an empty folder and whose
    only vispe is the installed one: ``--recipe`` resolves to the installed file and LightningCLI parses it.
    (~10-30 s: the wheel build is the slow part.)"""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copytree(REPO / "vispe", src / "vispe", ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / f, src / f)
    site = tmp_path / "site"
    build = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
                            "--target", str(site), str(src)], capture_output=True, text=True, timeout=600, check=False)
    if build.returncode != 0 and "No module named" in build.stderr and "setuptools" in build.stderr:
        pytest.skip("setuptools is not installed: the wheel cannot be built offline")
    assert build.returncode == 0, build.stderr[-2000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = textwrap.dedent(f"""
        import contextlib, io, yaml
        import vispe, vispe.recipes as r
        from vispe.train_cli import main
        assert vispe.__file__.startswith({str(site)!r}), vispe.__file__
        path = r.recipe_path("cifar10")
        assert str(path).startswith({str(site)!r}) and path.is_file(), path
        assert set(r.list_recipes()) == {set(list_recipes())!r}
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                main(["fit", "--recipe", "cifar10", "--model.init_args.pos_encoding", "comrope_ld", "--print_config"])
            except SystemExit as stop:
                assert stop.code in (0, None)
        cfg = yaml.safe_load(out.getvalue())
        assert cfg["model"]["init_args"]["pos_encoding"] == "comrope_ld" and cfg["trainer"]["max_epochs"] == 100
        print("ok", path)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    run = subprocess.run([sys.executable, "-c", FAST_EXIT + code], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("ok ")
