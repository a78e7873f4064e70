"""``vispe hf-figures OUT.json``: figures of the HF integration's checks, per model family (the tests assert the
bounds; this prints the values).

    vispe hf-figures results/hf-figures-5.23.0.json          # in a source checkout, with vispe[hf] installed

Reuses the tiny models and batches of ``tests/test_hf_families.py`` and ``tests/test_hf_integration.py`` (so it needs
the checkout's ``tests/`` folder: ``--tests-dir``, default ``./tests``). For each family: the native scheme's ids /
rope_deltas equality and max |dlogit| against the unpatched model; per scheme, cached generate() vs a full re-forward,
text-only vs the unpatched model (1D RoPE), save -> vispe load; and the long-video mrope case of Qwen2-VL / Qwen2.5-VL.
"""
from __future__ import annotations

import copy
import importlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    from vispe.benchmarks.grid import benchmark_parser

    p = benchmark_parser("vispe hf-figures", __doc__.splitlines()[0], "plain")
    p.add_argument("out", help="JSON file to write")
    p.add_argument("--tests-dir", default="tests", help="the source checkout's tests/ folder (its tiny models and batches)")
    args = p.parse_args(argv)
    tests = Path(args.tests_dir)
    if not (tests / "test_hf_families.py").is_file() or not (tests / "test_hf_integration.py").is_file():
        raise FileNotFoundError(f"--tests-dir {str(tests)!r} has no test_hf_families.py / test_hf_integration.py; "
                                f"run from a vispe source checkout or pass its tests/ folder")
    sys.path.insert(0, str(tests.resolve()))
    out = figures(importlib.import_module("test_hf_families"), importlib.import_module("test_hf_integration"))
    Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


def figures(F: Any, Q: Any) -> dict[str, Any]:
    """The figures, from the test modules ``F`` (families) and ``Q`` (Qwen2-VL integration)."""
    import torch
    import transformers

    from vispe.integrations import hf as vhf
    from vispe.positions import POSITION_SCHEMES

    out = {"transformers": transformers.__version__, "families": {}}
    for name in F.NAMES:
        try:
            model = F._model(name)
        except BaseException as e:  # noqa: BLE001 - pytest.skip for a family the installed version lacks
            out["families"][name] = f"skipped: {e}"
            continue
        fam = vhf.model_family(model)
        row = {}
        kw, types, _ = F._batch(name)
        ref_pos, ref_delta = F._rope_index(model, kw, types)
        ref = F._logits(model, kw, types)
        vhf.apply_position_scheme(model, fam.native_scheme)
        pos, delta = F._rope_index(model, kw, types)
        row["native"] = {"scheme": fam.native_scheme, "ids_equal": bool(torch.equal(pos, ref_pos.to(pos.dtype))),
                         "deltas_equal": bool(torch.equal(delta.reshape(-1), ref_delta.reshape(-1).to(delta.dtype))),
                         "max_abs_dlogit": (F._logits(model, kw, types) - ref).abs().max().item()}
        gen, txt, sl = {}, {}, {}
        for scheme in POSITION_SCHEMES:
            m = F._model(name)
            vhf.apply_position_scheme(m, scheme, **F.OPTIONS.get(scheme, {}))
            gen[scheme] = F._generate_vs_reforward(m, kw, types)
            patched = F._logits(m, kw, types)
            with tempfile.TemporaryDirectory() as d:
                m.save_pretrained(d)
                loaded = vhf.from_pretrained(type(m), d).eval()
                sl[scheme] = (F._logits(loaded, kw, types) - patched).abs().max().item()
            # text-only vs the unpatched model (HoPE: with its zero-frequency pairs)
            m2 = F._model(name)
            reference = copy.deepcopy(m2)
            rr = F._inner(reference).language_model.rotary_emb
            if scheme == "hope":
                rr.inv_freq[-(rr.inv_freq.shape[0] // 4):] = 0.0
            ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 8, 9]])
            tk = {"input_ids": ids, "attention_mask": (torch.arange(7) >= torch.tensor([[2], [0]])).long()}
            with torch.no_grad():
                r = reference(**tk).logits
                vhf.apply_position_scheme(m2, scheme)
                g = m2(**tk).logits
            txt[scheme] = (g - r)[tk["attention_mask"].bool()].abs().max().item()
        row["generate_vs_reforward_max"] = max(gen.values()); row["generate_vs_reforward"] = gen
        row["text_only_vs_1d_max"] = max(txt.values())
        row["save_load_max"] = max(sl.values())
        out["families"][name] = row
        print(name, json.dumps({k: v for k, v in row.items() if k != "generate_vs_reforward"}), flush=True)
    for name in Q.MODELS:
        model = Q._model(name)
        kw, types, _ = Q._long_video_batch(name)
        ref_pos, ref_delta = Q._rope_index(model, kw, types)
        with torch.no_grad():
            ref = model(**Q._forward_kwargs(model, kw, types)).logits
        vhf.apply_position_scheme(model, "mrope")
        rule = model._vispe_position_patch.position_options["after_visual"]
        pos, delta = Q._rope_index(model, kw, types)
        with torch.no_grad():
            d = (model(**Q._forward_kwargs(model, kw, types)).logits - ref).abs().max().item()
        vhf.apply_position_scheme(model, "mrope", after_visual="max")
        with torch.no_grad():
            dp = (model(**Q._forward_kwargs(model, kw, types)).logits - ref).abs().max().item()
        r = {"detected_rule": rule, "ids_equal": bool(torch.equal(pos, ref_pos.to(pos.dtype))), "deltas_equal": bool(torch.equal(delta.reshape(-1), ref_delta.reshape(-1).to(delta.dtype))),
             "max_abs_dlogit": d, "paper_rule_max_abs_dlogit_vs_hf": dp}
        out[f"long_video_mrope_{name}"] = r
        print("long video", name, json.dumps(r), flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
