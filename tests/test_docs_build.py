"""The documentation site builds with `mkdocs build --strict` (broken links and missing pages fail it).

mkdocs comes with the `docs` extra (part of `dev`, which the README's install and CI use); without it the test
skips, except under CI, where a missing mkdocs is a failure.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path):
    if shutil.which("mkdocs") is None and not os.environ.get("CI"):
        pytest.skip("mkdocs not installed (pip install -e '.[docs]')")
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                          "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert res.returncode == 0, res.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").is_file()
    built = {p.relative_to(tmp_path / "site").parts[0] for p in (tmp_path / "site").iterdir()}
    for page in (ROOT / "docs").glob("*.md"):
        name = "index.html" if page.stem == "index" else page.stem
        assert name in built, f"docs/{page.name} is not in the built site"
