"""`pip install vispe` (no extras) is the library core: torch + timm. The lab's packages are extras.

The test runs a fresh interpreter in which every extra's top-level package is made unimportable (a meta-path
finder refuses it, exactly as on a machine where it was never installed) and requires that ``import vispe``
works and that every registered encoding and every registered model builds and runs a forward pass.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from child_python import FAST_EXIT

ROOT = Path(__file__).resolve().parents[1]

# the top-level modules that only the extras install (train, video, hf, docs)
EXTRA_MODULES = [
    "lightning", "pytorch_lightning", "lightning_fabric", "torchmetrics", "jsonargparse", "matplotlib",
    "decord", "av", "open_clip", "transformers", "mkdocs",
]

_BLOCKER = textwrap.dedent(
    """
    import importlib.abc, sys
    BLOCKED = set(%r)

    class _NotInstalled(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked: not part of the core install)", name=name)
            return None

    for mod in list(sys.modules):
        assert mod.split(".")[0] not in BLOCKED, mod
    sys.meta_path.insert(0, _NotInstalled())
    """
) % (EXTRA_MODULES,)


def _run(body: str) -> subprocess.CompletedProcess:
    code = FAST_EXIT + _BLOCKER + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_blocker_really_blocks_an_extra():
    """The harness itself: importing an extra's module in the blocked interpreter fails."""
    res = _run("import lightning\n")
    assert res.returncode != 0 and "blocked: not part of the core install" in res.stderr


@pytest.mark.slow
def test_core_imports_and_builds_every_encoding_and_model_without_extras():
    res = _run(
        """
        import sys, timm, torch
        import vispe
        from vispe.encodings import EncodingContext, PositionGrid, create_encoding, get_encoding_class
        from vispe.models.video_llm import VideoLLM
        from vispe.positions import SCHEMES, Text, Visual, build_positions

        torch.manual_seed(0)
        built = {"encodings": 0, "image": 0, "video": 0, "llm": 0}
        for name in vispe.list_encodings():
            cls = get_encoding_class(name)
            ndim = 2 if 2 in cls.grid_ndims else cls.grid_ndims[-1]
            grid = (4, 4) if ndim == 2 else (2, 4, 4) if ndim == 3 else (16,)
            ctx = EncodingContext(dim=64, num_heads=4, depth=2, grid_size=grid, patch_size=(4,) * ndim if ndim > 1 else (4, 4))
            create_encoding(name, ctx)
            built["encodings"] += 1
            if ndim == 2:
                m = timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding=name, img_size=16, depth=2,
                                      num_classes=3).eval()
                with torch.no_grad():
                    out = m(torch.randn(2, 3, 16, 16))
                assert out.shape == (2, 3) and torch.isfinite(out).all(), name
                built["image"] += 1
            if 3 in cls.grid_ndims:
                m = timm.create_model("vispe_video_vit_nano_patch8_64", pos_encoding=name, depth=1, num_classes=3).eval()
                with torch.no_grad():
                    out = m(torch.randn(1, 3, m.num_frames, 64, 64))
                assert out.shape == (1, 3) and torch.isfinite(out).all(), name
                built["video"] += 1
        for scheme in SCHEMES:
            llm = VideoLLM(vocab_size=32, dim=32, depth=1, num_heads=4, pos_scheme=scheme).eval()
            assert llm is not None
            built["llm"] += 1
        for mod in sys.modules:
            assert mod.split(".")[0] not in ("lightning", "torchmetrics", "jsonargparse", "matplotlib"), mod
        print("BUILT", built)
        """
    )
    assert res.returncode == 0, res.stderr[-4000:]
    counts = eval(res.stdout.split("BUILT", 1)[1].strip())
    assert counts["encodings"] >= 30 and counts["image"] >= 20 and counts["video"] >= 8 and counts["llm"] >= 5, counts


@pytest.mark.slow
def test_cli_without_the_train_extra_names_the_extra():
    """`vispe fit` on a core install: one sentence naming the extra to install, no traceback."""
    res = _run(
        """
        from vispe.cli import main
        raise SystemExit(main(["fit", "--help"]))
        """
    )
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert "pip install 'vispe[train]'" in res.stderr and "Traceback" not in res.stderr, res.stderr[-2000:]


@pytest.mark.parametrize("extra", ["train", "video", "hf", "docs"])
def test_pyproject_core_and_extras(extra):
    """The core needs torch and timm only; each extra exists and `dev` pulls every extra (the README's install)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = sorted(dep.split(">")[0].split("=")[0].split("[")[0].strip() for dep in meta["dependencies"])
    assert core == ["timm", "torch"]
    extras = meta["optional-dependencies"]
    assert extras[extra]
    assert any(extra in dep for dep in extras["dev"] if dep.startswith("vispe["))
