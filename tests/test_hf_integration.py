"""vispe position schemes inside Hugging Face Qwen2-VL / Qwen2.5-VL (tiny random configs, nothing downloaded)."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from packaging.version import Version

from vispe.integrations import hf as vhf
from vispe.positions import POSITION_SCHEMES, Text, Visual, build_positions, build_positions_batch

IMG, VID, VS, VE = 120, 121, 122, 123
SPECIAL = [IMG, VID, VS, VE, 2]  # no multimodal tokens, no EOS in the generated text
PATCH, MERGE, TPATCH = 4, 2, 2
SCHEME_OPTIONS = {"hope": {"gamma": 0.75}, "v2pe": {"delta": 0.25}}

TEXT = {"vocab_size": 128, "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
            "num_key_value_heads": 4, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}, "rope_theta": 10000.0,
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
TOKENS = {"image_token_id": IMG, "video_token_id": VID, "vision_start_token_id": VS, "vision_end_token_id": VE}


def _qwen2_vl():
    cfg = transformers.Qwen2VLConfig(
        text_config=dict(TEXT), **TOKENS,
        vision_config={"depth": 1, "embed_dim": 32, "hidden_size": 128, "num_heads": 2, "patch_size": PATCH, "spatial_merge_size": MERGE, "temporal_patch_size": TPATCH},
    )
    return transformers.Qwen2VLForConditionalGeneration(cfg)


def _qwen2_5_vl():
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(TEXT), **TOKENS,
        vision_config={"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 128, "patch_size": PATCH,
                           "spatial_merge_size": MERGE, "temporal_patch_size": TPATCH, "window_size": 16, "fullatt_block_indexes": [0], "tokens_per_second": 2},
    )
    return transformers.Qwen2_5_VLForConditionalGeneration(cfg)


# per model: the video's ViT grid (Qwen2.5: time 0, 2 on a 4x4 LLM grid keeps every version's next-text rule equal)
MODELS = {"qwen2_vl": (_qwen2_vl, (2, 4, 4)), "qwen2_5_vl": (_qwen2_5_vl, (2, 8, 8))}


def _model(name):
    torch.manual_seed(0)
    return MODELS[name][0]().eval()


def _visual_tokens(grid):
    t, h, w = grid
    return t * h * w // MERGE**2


def _batch(name, with_video=True):
    """Left-padded batch: [text, image, text, video, text] and a shorter [text, video, text], prompts end in text."""
    img = (1, 4, 4)
    vid = MODELS[name][1]
    rows = [
        [5, 6, VS] + [IMG] * _visual_tokens(img) + [VE, 7, 8, 9, VS] + [VID] * _visual_tokens(vid) + [VE, 10, 11],
        [12, VS] + [VID] * _visual_tokens(vid) + [VE, 13, 14, 15],
    ]
    segs = [
        [Text(3), Visual(*img), Text(5), Visual(*vid), Text(3)],
        [Text(2), Visual(*vid), Text(4)],
    ]
    ids, mask = _left_padded(rows)
    grids_img = torch.tensor([img])
    grids_vid = torch.tensor([vid, vid])
    g = torch.Generator().manual_seed(1)
    feat = 3 * TPATCH * PATCH * PATCH
    kw = {
        "input_ids": ids, "attention_mask": mask,
        "pixel_values": torch.randn(int(grids_img.prod(-1).sum()), feat, generator=g), "image_grid_thw": grids_img,
        "pixel_values_videos": torch.randn(int(grids_vid.prod(-1).sum()), feat, generator=g), "video_grid_thw": grids_vid,
    }
    if name == "qwen2_5_vl":
        kw["second_per_grid_ts"] = torch.tensor([1.0, 1.0])
    types = (ids == IMG).long() + 2 * (ids == VID).long()
    return kw, types, segs


def _rope_index(model, kw, types):
    """Call the model's get_rope_index with the arguments its version takes."""
    import inspect

    inner = vhf._inner_model(model)
    params = inspect.signature(inner.get_rope_index).parameters
    args = {k: kw[k] for k in ("image_grid_thw", "video_grid_thw", "attention_mask", "second_per_grid_ts") if k in kw and (k in params or "kwargs" in params)}
    if "mm_token_type_ids" in params:
        args["mm_token_type_ids"] = types
    return inner.get_rope_index(kw["input_ids"], **args)


def _left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows -> left-padded ``(ids, attention_mask)`` of shape ``(B, longest)``. Shared with test_hf_families.py."""
    L = max(map(len, rows))
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros(len(rows), L, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, L - len(r):] = torch.tensor(r)
        mask[b, L - len(r):] = 1
    return ids, mask


def _forward_kwargs(model, kw, types):
    import inspect

    out = dict(kw)
    if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
        out["mm_token_type_ids"] = types
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_mrope_equals_the_models_own_rope_index_and_logits(name):
    model = _model(name)
    kw, types, _ = _batch(name)
    ref_pos, ref_delta = _rope_index(model, kw, types)
    with torch.no_grad():
        ref_logits = model(**_forward_kwargs(model, kw, types)).logits
    vhf.apply_position_scheme(model, "mrope")
    pos, delta = _rope_index(model, kw, types)
    assert torch.equal(pos, ref_pos.to(pos.dtype)), (pos, ref_pos)
    assert torch.equal(delta.reshape(-1), ref_delta.reshape(-1).to(delta.dtype))
    with torch.no_grad():
        logits = model(**_forward_kwargs(model, kw, types)).logits
    assert torch.equal(logits, ref_logits)  # bit-identical: same ids, same float32 cos / sin


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("scheme", [s for s in POSITION_SCHEMES if s != "mrope"])
def test_scheme_positions_are_vispes_builders(name, scheme):
    model = _model(name)
    kw, types, segs = _batch(name)
    opts = SCHEME_OPTIONS.get(scheme, {})
    vhf.apply_position_scheme(model, scheme, **opts)
    rows, delta = _rope_index(model, kw, types)
    coords = vhf.position_coordinates(rows, scheme)
    ref = build_positions_batch(scheme, segs, padding_side="left", spatial_merge_size=MERGE, **opts)
    real = ref.attention_mask
    assert torch.equal(real, kw["attention_mask"].bool())
    assert torch.equal(coords[:, real], ref.pos.to(coords.dtype)[:, real])
    # the next text token continues where the builder puts it, under the version's delta convention
    L = kw["input_ids"].shape[1]
    lengths = real.sum(-1)
    next_free = delta.reshape(-1).double() + (L if model._vispe_position_patch.padded_deltas else lengths)
    assert torch.allclose(next_free, ref.rope_delta.double() + L)


def _generate_vs_reforward(model, kw, types, n_new=4, suppress=None):
    """Max |cached generate() logits - one full re-forward's| over ``n_new`` greedy tokens (``suppress``: the special
    ids generation must not emit; this file's by default). Shared with test_hf_families.py."""
    fkw = _forward_kwargs(model, kw, types)
    with torch.no_grad():
        out = model.generate(**fkw, max_new_tokens=n_new, do_sample=False, suppress_tokens=SPECIAL if suppress is None else suppress,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    seq = out.sequences
    L = kw["input_ids"].shape[1]
    assert seq.shape[1] == L + n_new
    full = dict(fkw, input_ids=seq, attention_mask=torch.cat([kw["attention_mask"], torch.ones(2, n_new, dtype=torch.long)], 1))
    if "mm_token_type_ids" in fkw:
        full["mm_token_type_ids"] = torch.cat([types, torch.zeros(2, n_new, dtype=types.dtype)], 1)
    vhf._inner_model(model).rope_deltas = None
    with torch.no_grad():
        ref = model(**full).logits[:, L - 1: L + n_new - 1]
    cached = torch.stack(out.logits, dim=1)
    return (cached - ref).abs().max().item()


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("scheme", POSITION_SCHEMES)
def test_generate_with_cache_equals_full_reforward(name, scheme):
    model = _model(name)
    kw, types, _ = _batch(name)
    vhf.apply_position_scheme(model, scheme, **SCHEME_OPTIONS.get(scheme, {}))
    assert _generate_vs_reforward(model, kw, types) <= 1e-4


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("scheme", POSITION_SCHEMES)
def test_manual_cached_decode_uses_rope_deltas(name, scheme):
    """forward(past_key_values=...) without position_ids: the model's own rope_deltas path (one unpadded sample)."""
    import inspect

    model = _model(name)
    kw, types, _ = _batch(name)
    row = kw["attention_mask"][0].bool()
    one = dict(kw, input_ids=kw["input_ids"][:1, row], video_grid_thw=kw["video_grid_thw"][:1],
               pixel_values_videos=kw["pixel_values_videos"][: int(kw["video_grid_thw"][0].prod())])
    one.pop("attention_mask")
    if "second_per_grid_ts" in one:
        one["second_per_grid_ts"] = one["second_per_grid_ts"][:1]
    one_types = types[:1, row]
    fkw = _forward_kwargs(model, one, one_types)
    takes_cache_position = "cache_position" in inspect.signature(model.forward).parameters

    def decode():
        ids = one["input_ids"]
        with torch.no_grad():
            out = model(**fkw, use_cache=True)
            cache, steps = out.past_key_values, []
            nxt = out.logits[:, -1:].argmax(-1)
            for _ in range(3):
                extra = {"cache_position": torch.tensor([ids.shape[1]])} if takes_cache_position else {}
                out = model(input_ids=nxt, past_key_values=cache, use_cache=True, **extra)
                cache = out.past_key_values
                steps.append(out.logits[:, -1])
                ids = torch.cat([ids, nxt], 1)
                nxt = out.logits[:, -1:].argmax(-1)
        model.model.rope_deltas = None
        return torch.stack(steps, 1), ids

    unpatched, _ = decode()
    vhf.apply_position_scheme(model, scheme, **SCHEME_OPTIONS.get(scheme, {}))
    steps, ids = decode()
    if model._vispe_position_patch.clamped_deltas:
        # transformers 5.2's Qwen2-VL floors rope_deltas at 0, which misplaces its own decoded tokens;
        # the native scheme reproduces the installed model, floor included (other schemes keep the true deltas)
        assert (steps - unpatched).abs().max().item() <= 1e-6
        return
    full = dict(fkw, input_ids=ids)
    if "mm_token_type_ids" in fkw:
        full["mm_token_type_ids"] = torch.cat([one_types, torch.zeros(1, 3, dtype=one_types.dtype)], 1)
    with torch.no_grad():
        ref = model(**full).logits[:, -3:]  # the three fed tokens
    assert (steps - ref).abs().max().item() <= 1e-4


def _text_batch():
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 8, 9]])
    mask = (torch.arange(7) >= torch.tensor([[2], [0]])).long()
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("scheme", POSITION_SCHEMES)
def test_text_only_is_1d_rope(name, scheme):
    model = _model(name)
    reference = copy.deepcopy(model)
    if scheme == "hope":  # HoPE's slowest pairs are NoPE (zero frequency) on text too
        head_dim = model.config.text_config.hidden_size // model.config.text_config.num_attention_heads
        reference.model.language_model.rotary_emb.inv_freq[-(head_dim // 2 // 4):] = 0.0  # vispe's default P/4
    kw = _text_batch()
    with torch.no_grad():
        ref = reference(**kw).logits
        ref_gen = reference.generate(**kw, max_new_tokens=3, do_sample=False, pad_token_id=0)
    vhf.apply_position_scheme(model, scheme, **SCHEME_OPTIONS.get(scheme, {}))
    with torch.no_grad():
        got = model(**kw).logits
        gen = model.generate(**kw, max_new_tokens=3, do_sample=False, pad_token_id=0)
    mask = kw["attention_mask"].bool()
    assert (got - ref)[mask].abs().max().item() <= 1e-5
    assert torch.equal(gen, ref_gen)


def test_patch_is_per_instance_switchable_and_removable():
    model = _model("qwen2_vl")
    other = _model("qwen2_vl")
    keys = set(model.state_dict())
    kw, types, _ = _batch("qwen2_vl")
    with torch.no_grad():
        ref = model(**_forward_kwargs(model, kw, types)).logits
    vhf.apply_position_scheme(model, "vrope")
    assert set(model.state_dict()) == keys
    with torch.no_grad():
        vr = model(**_forward_kwargs(model, kw, types)).logits
        assert (vr - ref).abs().max() > 1e-4  # the scheme changes the model
    vhf.apply_position_scheme(model, "mhrope")  # switching removes the previous patch
    assert sum(len(m._forward_hooks) for m in model.modules()) == 2 * model.config.text_config.num_hidden_layers
    vhf.remove_position_scheme(model)
    assert sum(len(m._forward_hooks) for m in model.modules()) == 0
    assert "get_rope_index" not in vars(model.model)
    assert not hasattr(other, "_vispe_position_patch")
    with torch.no_grad():
        assert torch.equal(model(**_forward_kwargs(model, kw, types)).logits, ref)


def test_bad_input_fails_early_with_choices():
    model = _model("qwen2_vl")
    with pytest.raises(ValueError, match="rope_1d"):
        vhf.apply_position_scheme(model, "rope2d")
    with pytest.raises(TypeError, match="gamma"):
        vhf.apply_position_scheme(model, "hope", gama=0.5)
    with pytest.raises(ValueError, match="mrope_section"):
        vhf.apply_position_scheme(model, "mrope", mrope_section=[1, 1, 1])
    with pytest.raises(TypeError, match="Qwen2VLForConditionalGeneration"):
        vhf.apply_position_scheme(torch.nn.Linear(2, 2), "mrope")
    assert not hasattr(model, "_vispe_position_patch")


def test_unsupported_transformers_version_names_the_range(monkeypatch):
    monkeypatch.setattr("transformers.__version__", "4.40.0")
    with pytest.raises(ImportError, match=r"transformers>=4\.57,<6"):
        vhf.check_transformers_version()
    monkeypatch.setattr("transformers.__version__", "6.0.0.dev0")
    with pytest.raises(ImportError, match="supported range"):
        vhf.check_transformers_version()


def _long_video_batch(name):
    """[text, video, text] with a video whose temporal extent (8 patches; Qwen2.5-VL: 0, 2, .., 14 at 1 s per
    patch) exceeds its 2x2 LLM grid: transformers 5.x and the paper place the following text differently."""
    vid = (8, 4, 4)
    n = _visual_tokens(vid)
    ids = torch.tensor([[5, 6, VS] + [VID] * n + [VE, 7, 8]])
    g = torch.Generator().manual_seed(2)
    kw = {"input_ids": ids, "video_grid_thw": torch.tensor([vid]),
          "pixel_values_videos": torch.randn(8 * 16, 3 * TPATCH * PATCH * PATCH, generator=g)}
    if name == "qwen2_5_vl":
        kw["second_per_grid_ts"] = torch.tensor([1.0])
    return kw, 2 * (ids == VID).long(), [Text(3), Visual(*vid, 1.0 if name == "qwen2_5_vl" else None), Text(3)]


@pytest.mark.parametrize("name", list(MODELS))
def test_mrope_long_video_equals_the_installed_model_and_the_paper_rule_is_an_option(name):
    model = _model(name)
    kw, types, segs = _long_video_batch(name)
    ref_pos, ref_delta = _rope_index(model, kw, types)
    with torch.no_grad():
        ref = model(**_forward_kwargs(model, kw, types)).logits
    vhf.apply_position_scheme(model, "mrope")
    detected = model._vispe_position_patch.position_options["after_visual"]  # the installed model's rule
    pos, delta = _rope_index(model, kw, types)
    assert torch.equal(pos, ref_pos.to(pos.dtype)) and torch.equal(delta.reshape(-1), ref_delta.reshape(-1).to(delta.dtype))
    with torch.no_grad():
        assert torch.equal(model(**_forward_kwargs(model, kw, types)).logits, ref)
    # the paper's rule (text after a block at its largest coordinate + 1) on request
    vhf.apply_position_scheme(model, "mrope", after_visual="max")
    pos, _ = _rope_index(model, kw, types)
    tps = {"tokens_per_second": 2} if name == "qwen2_5_vl" else {}
    paper, _ = build_positions("mrope", segs, spatial_merge_size=MERGE, after_visual="max", **tps)
    assert torch.equal(pos[:, 0], paper.to(pos.dtype))
    hf_rule = int(ref_pos[0, 0, -3])  # the first text token after the video in the unpatched model
    paper_rule = int(paper[:, :-3].max()) + 1
    assert paper_rule > 3 + 2  # the case where the rules differ: start 3 + max(H, W) = 5 on transformers 5.x
    assert hf_rule == (3 + 2 if detected == "spatial" else paper_rule)
    if Version(transformers.__version__) >= Version("5.23"):
        assert detected == "spatial"


def test_bare_model_and_registry_defaults():
    """The bare Qwen2VLModel is accepted; HoPE / V2PE through the integration default to the registry's 0.75 / 0.25."""
    torch.manual_seed(0)
    cfg = _qwen2_vl().config
    bare = transformers.Qwen2VLModel(cfg).eval()
    kw, types, segs = _batch("qwen2_vl")
    for scheme, opts in (("hope", {"gamma": 0.75}), ("v2pe", {"delta": 0.25})):
        vhf.apply_position_scheme(bare, scheme)
        assert bare.config.vispe_position_scheme == {"scheme": scheme, "options": opts}
        rows, _ = _rope_index(bare, kw, types)
        ref = build_positions_batch(scheme, segs, padding_side="left", spatial_merge_size=MERGE, **opts)
        coords = vhf.position_coordinates(rows, scheme)
        assert torch.equal(coords[:, ref.attention_mask], ref.pos.to(coords.dtype)[:, ref.attention_mask])
