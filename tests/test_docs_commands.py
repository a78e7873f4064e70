"""Every shell command and Python snippet of the docs runs, in a smoke form, and prints what its comments say.

Each fenced ``bash`` / ``python`` block of a covered file follows a marker comment (invisible on the site)::

    <!-- ci: run -->                                   run as written
    <!-- ci: smoke | replace A => B | add ARGS | skip TEXT | covered TEXT => FILE[::TEST] | setup COMMAND -->

* ``replace A => B``: text replaced in the block before it runs (tiny sizes, a few images, a folder of the test's);
* ``add ARGS``: appended to every ``vispe fit|validate|test|predict`` / ``train/fit.py`` command (a few steps);
* ``skip TEXT``: commands containing TEXT do not run; the block must say ``not run in CI`` where a reader sees it;
* ``covered TEXT => FILE[::TEST]``: commands containing TEXT run elsewhere in CI (that file, or that test in it);
  a Python snippet containing TEXT is covered as a whole;
* ``setup COMMAND``: a ``vispe`` / ``python -c`` command run before the block (what the docs assume exists: a
  checkpoint, a weights file, a manifest).

``cmd1 & cmd2 &`` and ``wait`` run the commands one after the other.

Commands run in one scratch folder per file, in document order (a later block may read what an earlier one wrote),
with tiny fixtures: ``data/cifar10-jpeg`` zips, ``data/fashion-mnist`` IDX files, an image folder ``my_images/``, a
1,000-class timm state dict and ``vispe/recipes/*.yaml``.
``vispe`` commands run in this process (no interpreter start per command) and must exit 0.

Python snippets run statement by statement; a trailing comment checks the statement:
``# prints: TEXT`` (a printed line starts with TEXT), ``# -> VALUE`` (the comment starts with the value's repr),
``# SomeError: TEXT`` (the statement raises it with that message); ``...`` in TEXT matches anything.
"""
from __future__ import annotations

import ast
import contextlib
import glob
import io
import os
import re
import shlex
import shutil
import sys
import tokenize
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

#: files whose every bash/python block carries a marker and runs here
COVERED = ["README.md", "configs/README.md", "docs/training.md", "docs/mixed-resolution.md",
           "docs/resolution-options.md", "docs/composed-encodings.md", "docs/encodings-2d.md", "docs/speed-gpu.md",
           "docs/resolution.md", "docs/hf-integration.md", "docs/three-cell.md", "docs/video-retrieval.md",
           "docs/video-models.md", "docs/speed.md", "docs/resolution-benchmark.md", "docs/results.md",
           "docs/runner.md", "docs/files-and-inputs.md", "docs/scaling-out.md", "docs/catalogue-2026.md",
           "docs/index.md", "docs/library.md", "docs/option-checks.md", "docs/three-cell-results.md", "docs/conformance.md"]
#: files whose blocks are not marked yet (each listed so a new file cannot slip through unseen)
NOT_YET_COVERED: list[str] = []

BLOCK = re.compile(r"(?:^<!-- ci: (?P<marker>.*?) -->\n)?^```(?P<lang>bash|python)\n(?P<body>.*?)^```", re.M | re.S)
FIT_COMMANDS = ("fit", "validate", "test", "predict")
CIFAR_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


def _blocks(rel: str) -> list[dict]:
    text = (ROOT / rel).read_text()
    return [{"file": rel, "line": text[:m.start("lang")].count("\n") + 1, "lang": m["lang"], "marker": m["marker"],
             "body": m["body"]} for m in BLOCK.finditer(text)]


def _directives(marker: str) -> tuple[str, list[tuple[str, str]]]:
    parts = [p.strip() for p in marker.split(" | ")]
    out = []
    for p in parts[1:]:
        word, _, rest = p.partition(" ")
        assert word in ("replace", "add", "skip", "covered", "setup"), f"unknown marker directive {p!r}"
        out.append((word, rest))
    return parts[0], out


def _commands(body: str) -> list[str]:
    """Shell lines of a block: continuation lines joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", body)
    out = []
    for line in joined.splitlines():
        if not line.strip() or line.strip().startswith("#"):
            continue
        line = re.sub(r"^\s*wait\s*(;|$)", "", line)  # background jobs run in turn here: nothing to wait for
        out += [part.strip() for part in re.split(r"\s&(?:\s+|$)", line) if part.strip()]
    return out


def _wild(text: str) -> re.Pattern:
    return re.compile(".*".join(re.escape(part) for part in text.strip().split("...")), re.S)


# -- fixtures of the scratch folder --------------------------------------------------------------------------------
def _scratch(tmp: Path) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "test"):  # data/cifar10-jpeg: 10 classes x 4 images per split
        d = tmp / "data" / "cifar10-jpeg"
        d.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(d / f"cifar10_{split}_jpeg.zip", "w") as z:
            for c in CIFAR_CLASSES:
                for i in range(4):
                    buf = io.BytesIO()
                    Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(buf, format="JPEG")
                    z.writestr(f"{split}/{c}/{i:04d}.jpg", buf.getvalue())
    for c in CIFAR_CLASSES:  # my_images/<class>/: 2 images per class
        (tmp / "my_images" / c).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(rng.integers(0, 255, (48, 40, 3), dtype=np.uint8)).save(tmp / "my_images" / c / f"{i}.png")
    d = tmp / "data" / "fashion-mnist"  # data/fashion-mnist: IDX files, 10 classes x 4 images per split
    d.mkdir(parents=True)
    for split in ("train", "t10k"):
        labels = np.repeat(np.arange(10, dtype=np.uint8), 4)
        images = rng.integers(0, 255, (len(labels), 28, 28), dtype=np.uint8)
        (d / f"{split}-images-idx3-ubyte").write_bytes(bytes([0, 0, 8, 3]) + np.array(images.shape, ">i4").tobytes() + images.tobytes())
        (d / f"{split}-labels-idx1-ubyte").write_bytes(bytes([0, 0, 8, 1]) + np.array([len(labels)], ">i4").tobytes() + labels.tobytes())
    # a class-name file for a 1,000-class head whose names include the folders'
    names = [f"imagenet_class_{i}" for i in range(1000 - len(CIFAR_CLASSES))] + list(CIFAR_CLASSES)
    (tmp / "imagenet_classes.txt").write_text("\n".join(names) + "\n")
    shutil.copytree(ROOT / "configs", tmp / "configs")
    shutil.copytree(ROOT / "train", tmp / "train")
    (tmp / "vispe" / "recipes").mkdir(parents=True)  # `-c vispe/recipes/<name>.yaml` as in a checkout (YAML only)
    for recipe in (ROOT / "vispe" / "recipes").glob("*.yaml"):
        shutil.copy(recipe, tmp / "vispe" / "recipes")
    return tmp


def _timm_weights(tmp: Path, model: str) -> None:
    import timm

    torch.manual_seed(0)
    torch.save(timm.create_model(model).state_dict(), tmp / "vit_s16.pth")  # saved the usual way: 1,000 classes


# -- running -------------------------------------------------------------------------------------------------------
def _run_shell(cmd: str, env: dict[str, str], where: str) -> int:
    """Run one command; returns the number of printed-output checks made (a ``# prints:`` comment)."""
    from vispe.cli import main as vispe_main

    tokens = shlex.split(cmd, comments=True)
    if tokens[0] == "export":
        key, _, value = tokens[1].partition("=")
        env[key] = value
        os.environ[key] = value
        return 0
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", tokens[0]):  # VAR=value command
        key, _, value = tokens.pop(0).partition("=")
        os.environ[key] = value
    expanded: list[str] = []
    for t in tokens:
        expanded += sorted(glob.glob(t)) or [t] if "*" in t else [t]
    if expanded[0] == "vispe":
        args = expanded[1:]
    elif expanded[:2] == ["python", "train/fit.py"]:
        args = expanded[2:] if expanded[2:3] and expanded[2] in FIT_COMMANDS else ["fit", *expanded[2:]]
    elif expanded[0] == "python" and expanded[1:2] and expanded[1].startswith("examples/"):  # a script of the checkout
        import runpy

        argv, sys.argv = sys.argv, expanded[1:]
        try:
            runpy.run_path(str(ROOT / expanded[1]), run_name="__main__")
        except SystemExit as done:
            assert not done.code, f"{where}: {cmd!r} exited {done.code}"
        finally:
            sys.argv = argv
        return 0
    elif expanded[:2] == ["python", "-c"]:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(compile(expanded[2], where, "exec"), {"__name__": "__main__"})
        comment = cmd.split("#", 1)[1].strip() if "#" in cmd.split(expanded[2])[-1] else ""
        if comment.startswith("prints:"):
            assert any(_wild(comment[len("prints:"):]).match(line) for line in buf.getvalue().splitlines()), \
                f"{where}: {cmd!r} printed {buf.getvalue()!r}, the docs say {comment!r}"
            return 1
        return 0
    else:
        raise AssertionError(f"{where}: {cmd!r} has no smoke form: mark it 'skip' (and say 'not run in CI') or 'covered'")
    rc = vispe_main(args)
    assert rc == 0, f"{where}: {cmd!r} exited {rc}"
    return 0


def _run_python(body: str, where: str) -> int:
    """Run a snippet statement by statement, checking each trailing ``# prints:`` / ``# ->`` / ``# XError:`` comment;
    returns the number of checked statements."""
    lines = body.splitlines()
    namespace: dict = {"__name__": "__main__"}
    checked = 0
    for node in ast.parse(body).body:
        src = "\n".join(lines[node.lineno - 1:node.end_lineno])
        last_row = node.end_lineno - node.lineno + 1  # the statement's trailing comment is on its last line
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(src + "\n").readline)
                  if t.type == tokenize.COMMENT and t.start[0] == last_row]
        comment = tokens[-1].string.lstrip("#").strip() if tokens else ""
        err = re.match(r"(\w+(?:Error|Exception)): (.*)", comment)
        buf = io.StringIO()
        if err:
            with pytest.raises(BaseException) as info:
                exec(compile(src, where, "exec"), namespace)
            assert type(info.value).__name__ == err[1] and _wild(err[2]).match(str(info.value)), \
                f"{where}: {src!r} raised {type(info.value).__name__}: {info.value}; the docs say {comment!r}"
            checked += 1
            continue
        with contextlib.redirect_stdout(buf):
            if comment.startswith("-> ") and isinstance(node, ast.Expr):
                value = eval(compile(ast.Expression(node.value), where, "eval"), namespace)
                assert comment[3:].startswith(repr(value)), f"{where}: {src!r} gives {value!r}; the docs say {comment!r}"
                checked += 1
            else:
                exec(compile(src, where, "exec"), namespace)
        if comment.startswith("prints:"):
            assert any(_wild(comment[len("prints:"):]).match(line) for line in buf.getvalue().splitlines()), \
                f"{where}: {src!r} printed {buf.getvalue()!r}; the docs say {comment!r}"
            checked += 1
    return checked


def _covered_elsewhere(target: str, where: str) -> None:
    path, _, test = target.partition("::")
    assert (ROOT / path).is_file(), f"{where}: 'covered' names {path}, which does not exist"
    if test:
        assert f"def {test}(" in (ROOT / path).read_text(), f"{where}: 'covered' names {target}, which does not exist"


# -- tests ---------------------------------------------------------------------------------------------------------
def test_every_docs_file_is_covered_or_listed():
    docs = {str(p.relative_to(ROOT)) for p in [ROOT / "README.md", ROOT / "configs" / "README.md", *(ROOT / "docs").glob("*.md")]}
    assert docs == set(COVERED) | set(NOT_YET_COVERED), sorted(docs ^ (set(COVERED) | set(NOT_YET_COVERED)))
    for rel in COVERED:
        for b in _blocks(rel):
            assert b["marker"], f"{rel}:{b['line']}: a {b['lang']} block without a '<!-- ci: ... -->' marker"


@pytest.mark.slow  # end to end: every command of a page (trainings, benchmarks, CLI runs)
@pytest.mark.parametrize("rel", COVERED)
def test_docs_commands_run(rel, tmp_path, monkeypatch, capsys):
    """Each covered file's commands and snippets, in their smoke form, in document order."""
    monkeypatch.chdir(_scratch(tmp_path))
    monkeypatch.setenv("VISPE_DATA_ROOT", str(tmp_path / "data"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # --threads must not change the test process
    env: dict[str, str] = {}
    counts = {"run": 0, "smoke": 0, "skipped": 0, "covered": 0, "checks": 0}
    for b in _blocks(rel):
        where = f"{rel}:{b['line']}"
        mode, directives = _directives(b["marker"])
        assert mode in ("run", "smoke"), f"{where}: marker mode {mode!r} is not 'run' or 'smoke'"
        body = b["body"]
        for word, rest in directives:
            if word == "replace":
                old, new = (s.strip() for s in rest.split(" => "))
                assert old in body, f"{where}: 'replace {old}' matches nothing in the block"
                body = body.replace(old, new)
        for word, rest in directives:
            if word == "setup":
                _run_shell(rest, env, f"{where} (setup)")
        if b["lang"] == "python":
            whole = [target for word, rest in directives if word == "covered" for text, target in [rest.split(" => ")]
                     if text.strip() in body]
            if whole:
                _covered_elsewhere(whole[0].strip(), where)
                counts["covered"] += 1
                continue
            if "vit_s16.pth" in body:
                _timm_weights(tmp_path, "vit_small_patch16_224")
            with torch.set_grad_enabled(True):  # a snippet's torch.set_grad_enabled(False) ends with it
                counts["checks"] += _run_python(body, where)
            counts[mode] += 1
            continue
        skips = [rest for word, rest in directives if word == "skip"]
        covered = [tuple(s.strip() for s in rest.split(" => ")) for word, rest in directives if word == "covered"]
        if skips:
            assert "not run in CI" in b["body"], f"{where}: skipped commands must say 'not run in CI' in the block"
        adds = [rest for word, rest in directives if word == "add"]
        for cmd in _commands(body):
            if any(s in cmd for s in skips):
                counts["skipped"] += 1
                continue
            hit = [target for text, target in covered if text in cmd]
            if hit:
                _covered_elsewhere(hit[0], where)
                counts["covered"] += 1
                continue
            if "vit_s16.pth" in cmd and not (tmp_path / "vit_s16.pth").exists():
                _timm_weights(tmp_path, "vit_small_patch16_224")
            words = cmd.split()
            if adds and ((words[0] == "vispe" and words[1] in FIT_COMMANDS) or "train/fit.py" in words[:2]):
                cmd = f"{cmd.split(' #')[0]} {' '.join(adds)}"
            counts["checks"] += _run_shell(cmd, env, where)
            counts[mode] += 1
    capsys.readouterr()
    print(f"{rel}: {counts}")


def test_snippet_checks_catch_comments_that_do_not_match():
    assert _run_python('print("149 kept, 3 new")  # prints: 149 kept, ... new\n1 + 1  # -> 2\n'
                       'int("x")  # ValueError: invalid literal ...\n', "ok") == 3
    for wrong in ('print("151 kept")  # prints: 149 kept\n', '1 + 1  # -> 3\n', 'int("1")  # ValueError: invalid\n',
                  'int("x")  # TypeError: invalid\n'):
        with pytest.raises((AssertionError, pytest.fail.Exception)):
            _run_python(wrong, "wrong")


def test_docs_name_only_files_that_exist():
    """Relative links and `configs/...` / `vispe/recipes/...` paths in the docs point at files of the repository."""
    missing = []
    for rel in [*COVERED, *NOT_YET_COVERED]:
        text = (ROOT / rel).read_text()
        base = (ROOT / rel).parent
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" not in target and not target.startswith("mailto:") and not (base / target).exists():
                missing.append(f"{rel}: link {target}")
        for path in re.findall(r"`((?:configs|vispe/recipes)/[\w./-]+\.ya?ml)`", text):
            if not (ROOT / path).exists():
                missing.append(f"{rel}: {path}")
        for path in re.findall(r"-c (configs/[\w./-]+\.ya?ml)", text):
            if not (ROOT / path).exists():
                missing.append(f"{rel}: {path}")
    assert not missing, missing
