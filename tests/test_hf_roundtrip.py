"""A switched model saved with save_pretrained never loads as the unswitched one: every family x scheme x loading path
(the family's class, AutoModelForImageTextToText, the pipeline's loader, each with and without trust_remote_code; in
this process with vispe imported, in a fresh process that has not imported vispe, and in one where vispe is not
installed) gives the switched model or a refusal. Tiny random configs, offline (HF_HUB_OFFLINE=1)."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import test_hf_families as fam  # noqa: E402
import test_hf_integration as q2  # noqa: E402
from child_python import FAST_EXIT  # noqa: E402

from vispe.integrations import hf as vhf
from vispe.integrations.hf_hub import MODELING_FILE, TEXT_CONFIG_KEY

# every family, every switched scheme at least once; the own scheme with an option that changes it (Qwen2.5-VL's
# exact time rule) is switched too; the own scheme with defaults saves as the family's own model
SAVES = [("qwen2_vl", "hope", {}), ("qwen2_vl", "rope_1d", {}), ("qwen2_5_vl", "vrope", {}), ("qwen2_5_vl", "mrope", {"time_rule": "exact"}),
         ("qwen3_vl", "mrope", {}), ("qwen3_vl_moe", "mhrope", {}), ("qwen3_5", "videorope", {}), ("qwen3_5_moe", "v2pe", {}),
         ("glm4v", "mrope_interleave", {}), ("glm4v_moe", "qwen3vl", {}), ("qwen3_vl", "qwen3vl", {})]
PATHS = ("class", "auto", "auto+trust_remote_code", "pipeline", "pipeline+trust_remote_code")
ROOT = Path(__file__).resolve().parents[1]


def _model_and_inputs(name):
    if name in q2.MODELS:
        model = q2._model(name)
        kw, types, _ = q2._batch(name)
        if name == "qwen2_5_vl":  # 25 fps, 32 patches: transformers' float32 time product and the exact rule differ at patch 25
            kw["second_per_grid_ts"] = torch.tensor([0.08, 0.08])
            kw["video_grid_thw"] = torch.tensor([[32, 8, 8], [32, 8, 8]])
            n = 32 * 16
            rows = [[5, 6, q2.VS] + [q2.IMG] * 4 + [q2.VE, 7, 8, 9, q2.VS] + [q2.VID] * n + [q2.VE, 10, 11], [12, q2.VS] + [q2.VID] * n + [q2.VE, 13]]
            kw["input_ids"], kw["attention_mask"] = q2._left_padded(rows)
            kw["pixel_values_videos"] = torch.randn(2 * 32 * 64, 3 * q2.TPATCH * q2.PATCH**2, generator=torch.Generator().manual_seed(1))
            types = (kw["input_ids"] == q2.IMG).long() + 2 * (kw["input_ids"] == q2.VID).long()
    else:
        model = fam._model(name)
        kw, types, _ = fam._batch(name)
    return model, q2._forward_kwargs(model, kw, types)


def _logits(model, inputs):
    with torch.no_grad():
        out = model(**inputs)
    return out.logits


# the child processes' script: load each folder by each path and say which model came back
LOADER = textwrap.dedent('''
    import json, sys, torch, transformers

    def load(path, how):
        trc = {"trust_remote_code": True} if how.endswith("+trust_remote_code") else {}
        kind = how.split("+")[0]
        config = json.load(open(f"{path}/config.json"))
        if kind == "class":
            cls = getattr(transformers, config["architectures"][0].removeprefix("Vispe"))
            return cls.from_pretrained(path, **trc) if trc else cls.from_pretrained(path)
        if kind == "auto":
            return transformers.AutoModelForImageTextToText.from_pretrained(path, **trc)
        from transformers.pipelines.base import load_model  # what pipeline("image-text-to-text", model=path) runs
        task = "image-text-to-text"
        cfg = transformers.AutoConfig.from_pretrained(path, _from_pipeline=task, **trc)
        return load_model(path, config=cfg, model_classes=(transformers.AutoModelForImageTextToText,), task=task, **trc)

    def outcome(path, how):
        refs = torch.load(f"{path}.refs.pt")
        try:
            model = load(path, how).eval()
        except Exception as e:
            return "refused", f"{type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
        with torch.no_grad():
            got = model(**refs["inputs"]).logits
        if torch.equal(got, refs["switched"]):
            return "switched", type(model).__name__
        if torch.equal(got, refs["plain"]):
            return "unswitched", type(model).__name__
        return "other", type(model).__name__
''')
CHILD = LOADER + textwrap.dedent('''
    if sys.argv[1] == "imported":
        import vispe.integrations.hf  # noqa: F401
    if sys.argv[1] == "not-installed":  # vispe cannot be imported at all
        class _NoVispe:
            def find_spec(self, name, path=None, target=None):
                if name == "vispe" or name.startswith("vispe."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        sys.meta_path.insert(0, _NoVispe())
    assert sys.argv[1] == "imported" or "vispe" not in sys.modules
    table = {}
    # the paths without trust_remote_code first, every folder: none of them may import vispe; then the trusted ones
    # (the saved modeling file imports vispe), in a process that has still not imported it
    for trusted in (False, True):
        for path in sys.argv[4:]:
            for how in sys.argv[3].split(","):
                if how.endswith("+trust_remote_code") == trusted:
                    table[f"{path}|{how}"] = outcome(path, how)
        if not trusted and sys.argv[1] != "imported":
            assert "vispe" not in sys.modules  # no path without trust_remote_code imported it
    json.dump(table, open(sys.argv[2], "w"))
''')


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("saves")
    out = {}
    for name, scheme, options in SAVES:
        if not hasattr(transformers, {f.name: f for f in vhf.MODEL_FAMILIES}[name].classes[0]):
            continue  # a family newer than the installed transformers (Qwen3.5 before 5.2)
        model, inputs = _model_and_inputs(name)
        plain = _logits(model, inputs)
        vhf.apply_position_scheme(model, scheme, **options)
        switched = _logits(model, inputs)
        own = scheme == vhf.model_family(model).native_scheme and not options
        assert torch.equal(switched, plain) == own  # the table can tell the two models apart (or they are one model)
        path = root / f"{name}-{scheme}{'-' + '-'.join(options) if options else ''}"
        model.save_pretrained(path)
        torch.save({"inputs": inputs, "switched": switched, "plain": plain}, f"{path}.refs.pt")
        out[str(path)] = (name, scheme, own)
    return out


def _child(mode, hows, paths, tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / f"modules-{mode}"),
               PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = tmp_path / f"table-{mode}-{len(hows)}.json"  # one file per child
    proc = subprocess.run([sys.executable, "-c", FAST_EXIT + CHILD, mode, str(out), ",".join(hows), *paths], capture_output=True, text=True, env=env,
                          stdin=subprocess.DEVNULL, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0 and out.exists(), proc.stderr[-3000:]
    return {tuple(k.split("|")): tuple(v) for k, v in json.loads(out.read_text()).items()}


def test_switched_save_is_transformers_custom_code(saved):
    for path, (name, scheme, own) in saved.items():
        config = json.loads((Path(path) / "config.json").read_text())
        files = set(os.listdir(path))
        assert config["vispe_position_scheme"]["scheme"] == scheme
        assert "model.safetensors" in files
        if own:  # the model's own scheme with defaults is the family's own model
            assert config["model_type"] == name and MODELING_FILE not in files and "auto_map" not in config
            continue
        assert MODELING_FILE in files and config["model_type"] == f"vispe_{name}"
        assert config["architectures"][0].startswith("Vispe") and set(config["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForImageTextToText"}
        assert isinstance(config["text_config"], str) and isinstance(config[TEXT_CONFIG_KEY], dict)


@pytest.mark.slow  # fresh interpreters (3 subprocesses)
def test_roundtrip_table_has_no_unswitched_cell(saved, tmp_path):
    paths = list(saved)
    table = {}
    # fresh processes (their own HF_MODULES_CACHE); trust_remote_code imports vispe, so where vispe is not imported
    # the child runs those paths last, after checking that no other path imported it
    for mode, label in (("imported", "vispe imported"), ("installed", "vispe not imported"), ("not-installed", "vispe not installed")):
        for (path, how), cell in _child(mode, PATHS, paths, tmp_path).items():
            table[(path, how, label)] = cell
    assert len(table) == len(paths) * len(PATHS) * 3  # every folder by every path in every kind of process
    rows = []
    for (path, how, where), (result, detail) in sorted(table.items()):
        name, scheme, own = saved[path]
        rows.append(f"{name:13s} {scheme + (' (own)' if own else ''):18s} {how:27s} {where:20s} {result:10s} {detail}")
        if own:
            assert result in ("switched", "unswitched"), rows[-1]  # one model: both names fit
            continue
        assert result in ("switched", "refused"), rows[-1]
        if where == "vispe imported":
            assert result == "switched", rows[-1]  # every path restores the scheme
        elif where == "vispe not imported":
            assert result == ("switched" if "trust_remote_code" in how else "refused"), rows[-1]
            if result == "refused" and how != "class":
                assert "contains custom code which must be executed" in detail, rows[-1]  # transformers' own error
            if result == "refused" and how == "class":
                assert "vispe position scheme" in detail or "text_config" in detail, rows[-1]
        else:
            assert result == "refused", rows[-1]
    print("\n".join(rows))


def test_unrestorable_record_is_refused_by_name(saved, tmp_path):
    """A record vispe cannot apply (an edited config.json) fails the plain class load, naming the record."""
    path = next(p for p, (n, s, own) in saved.items() if n == "qwen2_vl" and s == "hope")
    config = json.loads((Path(path) / "config.json").read_text())
    config["vispe_position_scheme"] = {"scheme": "hope", "options": {"gamma": -1.0}}
    edited = tmp_path / "edited"
    edited.mkdir()
    for f in os.listdir(path):
        if f != "config.json":
            (edited / f).write_bytes((Path(path) / f).read_bytes())
    (edited / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"vispe_position_scheme=.*'hope'.*gamma"):
        transformers.Qwen2VLForConditionalGeneration.from_pretrained(edited)


@pytest.mark.skipif(not hasattr(__import__("transformers.utils.hub").utils.hub, "hf_api"), reason="transformers 5.x's push_to_hub internals")
def test_push_to_hub_uploads_the_switched_layout(tmp_path, monkeypatch):
    """push_to_hub saves through save_pretrained: the uploaded folder is the switched layout (the upload is
    replaced by a copy; nothing leaves the machine); save_pretrained(push_to_hub=True) is refused."""
    import shutil
    import types

    import transformers.utils.hub as hub

    model = q2._model("qwen2_vl")
    vhf.apply_position_scheme(model, "videorope")
    uploaded = tmp_path / "hub"
    monkeypatch.setattr(hub, "hf_api", lambda: types.SimpleNamespace(create_repo=lambda repo_id, **kw: types.SimpleNamespace(repo_id=repo_id)))
    monkeypatch.setattr(hub, "create_and_tag_model_card", lambda *a, **kw: types.SimpleNamespace(save=lambda path: None))
    monkeypatch.setattr(type(model), "_upload_modified_files", lambda self, d, *a, **kw: shutil.copytree(d, uploaded), raising=False)
    model.push_to_hub("someone/switched-qwen2-vl")
    config = json.loads((uploaded / "config.json").read_text())
    assert (uploaded / MODELING_FILE).exists() and config["model_type"] == "vispe_qwen2_vl"
    loaded = transformers.AutoModelForImageTextToText.from_pretrained(uploaded)
    assert vhf.scheme_of(loaded) == "videorope"
    with pytest.raises(ValueError, match="push_to_hub"):
        model.save_pretrained(tmp_path / "direct", push_to_hub=True)
