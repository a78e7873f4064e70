"""The ``vispe`` command starts without torch: help, the recipe list and light config errors import no heavy module,
and a near miss names its fix ("did you mean")."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from child_python import FAST_EXIT

from vispe._checks import check_choice, did_you_mean

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "timm", "torchvision", "lightning")


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", FAST_EXIT + code], capture_output=True, text=True, env=env, cwd=REPO, timeout=300)


def _loaded_after(argv: list[str]) -> tuple[int, list[str]]:
    code = (
        "import io, json, sys, contextlib\n"
        "import vispe.cli\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        f"    rc = vispe.cli.main({argv!r})\n"
        f"print(json.dumps([rc, [m for m in {HEAVY!r} if m in sys.modules]]))\n"
    )
    r = _python(code)
    assert r.returncode == 0, r.stderr
    rc, loaded = json.loads(r.stdout.strip().splitlines()[-1])
    return rc, loaded


@pytest.mark.parametrize("argv, rc", [(["--help"], 0), (["recipes"], 0), (["fit", "--recipe", "smok"], 2),
                                      (["fit", "-c", "no_such_config.yaml"], 2), (["fitt"], 2)])
def test_help_recipes_and_config_errors_import_no_heavy_module(argv, rc):
    assert _loaded_after(argv) == (rc, [])


@pytest.mark.slow  # two fresh interpreters importing torch and timm
def test_import_vispe_is_light_and_still_registers_models_in_timm_in_either_order():
    r = _python(
        "import sys, importlib.util, vispe\n"
        "heavy = [m for m in ('torch', 'timm', 'torchvision') if m in sys.modules]\n"
        "importlib.util.find_spec('timm')  # an availability check (Lightning does this) must not disarm the hook\n"
        "import timm\n"
        "m = timm.create_model('vispe_vit_tiny_patch4_32', pos_encoding='rope_mixed', num_classes=3)\n"
        "print(heavy, type(m).__name__, 'rope_axial' in vispe.list_encodings(), timm.__spec__.loader is timm.__loader__)\n"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["[]", "VispeVisionTransformer", "True", "True"]
    r = _python("import timm, vispe; print(len(timm.list_models('vispe_vit_*')) > 0)")
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr


def test_the_entry_point_ends_without_the_final_collection_and_a_call_from_python_keeps_it():
    """The console entry point (``main()`` reading ``sys.argv``) freezes the heap at exit, so the interpreter's last
    collection does not walk torch's objects; ``main(argv)`` called from Python leaves the caller's exit alone."""
    code = (
        "import atexit, gc, io, contextlib, sys\n"
        "from vispe.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['recipes'])\n"
        "atexit._run_exitfuncs()\n"
        "called = gc.get_freeze_count()\n"
        "sys.argv = ['vispe', 'recipes']\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main()\n"
        "atexit._run_exitfuncs()\n"
        "print(called, gc.get_freeze_count() > 0)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "True"]


def test_did_you_mean_names_the_closest_choices():
    assert did_you_mean("smok", ["cifar10", "smoke", "synthetic_tiny"]) == "; did you mean 'smoke'?"
    assert did_you_mean("zzz", ["cifar10", "smoke"]) == ""
    assert "'rope_mixed'" in did_you_mean("rope_mixd", ["rope_axial", "rope_mixed", "rope_mixed_3d", "learned"])
    with pytest.raises(ValueError, match=r"mode='bais' is not valid; choose one of \['bias', 'contextual'\]; did you mean 'bias'\?"):
        check_choice("mode", "bais", ["bias", "contextual"])


def test_cli_names_the_closest_recipe_and_command(capsys):
    from vispe.cli import main

    assert main(["fit", "--recipe", "smok"]) == 2
    assert "did you mean 'smoke'?" in capsys.readouterr().err
    assert main(["resolutoin"]) == 2
    assert "did you mean 'resolution'" in capsys.readouterr().err


def test_unknown_encoding_and_option_name_the_closest(capsys):
    from vispe.encodings import get_encoding_class
    from vispe.train_cli import _with_option_hint

    with pytest.raises(ValueError, match=r"did you mean 'rope_mixed'"):
        get_encoding_class("rope_mixd")
    sentence = "model: Problem with given class_path 'vispe.tasks.ImageClassification': Option 'pos_encodng' is not accepted"
    assert _with_option_hint(sentence).endswith("did you mean 'pos_encoding'?")


def test_misspelt_trainer_option_names_the_real_one(capsys):
    from vispe.cli import main

    assert main(["fit", "--recipe", "smoke", "--trainer.max_epoch", "1"]) == 2
    assert "did you mean '--trainer.max_epochs'" in capsys.readouterr().err
