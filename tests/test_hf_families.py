"""vispe position schemes in Hugging Face Qwen3-VL, Qwen3.5 and GLM-4V (dense and MoE), and the scheme's life
through save_pretrained / from_pretrained and the meta device (tiny random configs, nothing downloaded)."""
import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from packaging.version import Version

from vispe.encodings import EncodingContext, create_encoding
from vispe.integrations import hf as vhf
from vispe.positions import POSITION_SCHEMES, SCHEMES, Text, Visual, build_positions_batch

from test_hf_integration import _forward_kwargs, _left_padded  # noqa: E402  (one copy of the HF test helpers)
from test_hf_integration import _generate_vs_reforward as _shared_generate_vs_reforward  # noqa: E402

# the per-family matrix (every scheme x every supported Qwen/GLM family); the integration contract itself is
# tests/test_hf_integration.py, in the fast tier
pytestmark = pytest.mark.slow

V5 = Version(transformers.__version__).major >= 5
IMG, VID, VS, VE = 120, 121, 122, 123  # Qwen: image / video / vision start / vision end
GIS, GIE, GVS, GVE = 124, 125, 126, 127  # GLM: image start / end, video start / end (frames are image tokens)
SPECIAL = [IMG, VID, VS, VE, GIS, GIE, GVS, GVE, 2]
PATCH, MERGE, TPATCH = 4, 2, 2
IMAGE, VIDEO = (1, 4, 4), (3, 4, 4)  # ViT grids: one 2x2-token image, a 3-patch video of 2x2-token frames


def _rope(theta, section, interleaved=False, partial=None):
    """The text config's rotary keys in the installed version's spelling."""
    if V5:
        params = {"rope_type": "default", "rope_theta": theta, "mrope_section": section}
        if interleaved:
            params["mrope_interleaved"] = True
        if partial:
            params["partial_rotary_factor"] = partial
        return {"rope_parameters": params}
    out = {"rope_theta": theta, "rope_scaling": {"rope_type": "default", "mrope_section": section, **({"mrope_interleaved": True} if interleaved else {})}}
    if partial:
        out["partial_rotary_factor"] = partial
    return out


TEXT = {"vocab_size": 128, "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 2, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 0, "num_attention_heads": 4, "num_key_value_heads": 2}
QWEN_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 128, "patch_size": PATCH,
               "spatial_merge_size": MERGE, "temporal_patch_size": TPATCH, "num_position_embeddings": 16}
QWEN_TOKENS = {"image_token_id": IMG, "video_token_id": VID, "vision_start_token_id": VS, "vision_end_token_id": VE}
GLM_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 128, "patch_size": PATCH,
              "image_size": 16, "spatial_merge_size": MERGE, "temporal_patch_size": TPATCH}
GLM_TOKENS = {"image_token_id": IMG, "video_token_id": VID, "image_start_token_id": GIS, "image_end_token_id": GIE,
              "video_start_token_id": GVS, "video_end_token_id": GVE}
MOE_QWEN = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}


def _classes(prefix):
    gen, bare = getattr(transformers, f"{prefix}ForConditionalGeneration", None), getattr(transformers, f"{prefix}Model", None)
    if gen is None:
        pytest.skip(f"transformers {transformers.__version__} has no {prefix} (see vispe.integrations.hf.MODEL_FAMILIES)")
    return getattr(transformers, f"{prefix}Config"), gen, bare


def _qwen3_vl(prefix, moe):
    text = dict(TEXT, head_dim=32, **_rope(5e6, [6, 5, 5], interleaved=True), **(dict(MOE_QWEN, decoder_sparse_step=1) if moe else {}))
    return _classes(prefix), dict(text_config=text, vision_config=dict(QWEN_VISION, deepstack_visual_indexes=[0]), **QWEN_TOKENS)


def _qwen3_5(prefix, moe):
    # one Gated-DeltaNet layer and one attention layer; a quarter of each 64-channel head rotates
    text = dict(TEXT, head_dim=64, layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16, linear_value_head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, **_rope(1e7, [3, 3, 2], interleaved=True, partial=0.25),
                **(dict(MOE_QWEN, shared_expert_intermediate_size=64) if moe else {}))
    return _classes(prefix), dict(text_config=text, vision_config=dict(QWEN_VISION), **QWEN_TOKENS)


def _glm4v(prefix, moe):
    # half of each 32-channel head rotates, in GLM's interleaved pairs
    text = dict(TEXT, **_rope(10000.0, [2, 3, 3], partial=0.5),
                **({"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "n_shared_experts": 1,
                    "first_k_dense_replace": 1, "head_dim": 32} if moe else {}))
    return _classes(prefix), dict(text_config=text, vision_config=dict(GLM_VISION), **GLM_TOKENS)


FAMILIES = {
    "qwen3_vl": (_qwen3_vl, "Qwen3VL", False),
    "qwen3_vl_moe": (_qwen3_vl, "Qwen3VLMoe", True),
    "qwen3_5": (_qwen3_5, "Qwen3_5", False),
    "qwen3_5_moe": (_qwen3_5, "Qwen3_5Moe", True),
    "glm4v": (_glm4v, "Glm4v", False),
    "glm4v_moe": (_glm4v, "Glm4vMoe", True),
}


def _model(name, bare=False):
    build, prefix, moe = FAMILIES[name]
    (cfg_cls, gen, bare_cls), kw = build(prefix, moe)
    torch.manual_seed(0)
    return (bare_cls if bare else gen)(cfg_cls(**kw)).eval()


def _is_glm(name):
    return name.startswith("glm")


def _visual_tokens(grid):
    t, h, w = grid
    return t * h * w // MERGE**2


def _image(name):
    n = _visual_tokens(IMAGE)
    return ([GIS] + [IMG] * n + [GIE]) if _is_glm(name) else ([VS] + [IMG] * n + [VS + 1])


def _video(name):
    """The model's token layout of a video: per temporal patch two timestamp tokens and the patch's block."""
    t, h, w = VIDEO
    per = _visual_tokens((1, h, w))
    out = [GVS] if _is_glm(name) else []
    for i in range(t):
        ts = [40 + i, 50]
        out += (ts + [GIS] + [IMG] * per + [GIE]) if _is_glm(name) else (ts + [VS] + [VID] * per + [VE])
    return out + ([GVE] if _is_glm(name) else [])


def _types(name, ids):
    """mm_token_type_ids as the processors write them (GLM: image tokens between video markers are video)."""
    if not _is_glm(name):
        return (ids == IMG).long() + 2 * (ids == VID).long()
    inside = (torch.cumsum((ids == GVS).long(), -1) - torch.cumsum((ids == GVE).long(), -1)) > 0
    return (ids == IMG).long() * (1 + inside.long())


def _segments(tokens, types):
    """The vispe segments of one row: text runs and one (1, H, W) block per image / video patch."""
    segs, i = [], 0
    while i < len(tokens):
        j = i
        while j < len(tokens) and types[j] == types[i]:
            j += 1
        if types[i] == 0:
            segs.append(Text(j - i))
        else:
            grid = IMAGE if types[i] == 1 else (1,) + VIDEO[1:]
            segs += [Visual(*grid)] * ((j - i) // _visual_tokens(grid))
        i = j
    return segs


def _batch(name, with_image=None, with_video=True):
    """Left-padded batch: [text, image, text, video, text] and a shorter [text, video, text]; prompts end in text.

    GLM-4V's forward cannot take images and videos together (its frames are image tokens too), so its
    default batch has videos only; ``with_video=False`` gives images only.
    """
    with_image = not _is_glm(name) if with_image is None else with_image
    first = [5, 6] + (_image(name) + [7, 8, 9] if with_image else []) + (_video(name) if with_video else _image(name)) + [10, 11]
    rows = [first, [12] + (_video(name) if with_video else _image(name)) + [13, 14, 15]]
    ids, mask = _left_padded(rows)
    types = _types(name, ids)
    segs = [_segments(ids[b, mask[b].bool()].tolist(), types[b, mask[b].bool()].tolist()) for b in range(2)]
    g = torch.Generator().manual_seed(1)
    feat = 3 * TPATCH * PATCH * PATCH
    kw = {"input_ids": ids, "attention_mask": mask}
    n_img = int((types == 1).sum()) // _visual_tokens(IMAGE)
    if n_img:
        grids = torch.tensor([IMAGE] * n_img)
        kw.update(pixel_values=torch.randn(int(grids.prod(-1).sum()), feat, generator=g), image_grid_thw=grids)
    if with_video:
        grids = torch.tensor([VIDEO, VIDEO])
        kw.update(pixel_values_videos=torch.randn(int(grids.prod(-1).sum()), feat, generator=g), video_grid_thw=grids)
    return kw, types, segs


def _inner(model):
    return vhf._inner_model(model)


def _rope_index(model, kw, types):
    """Call the model's get_rope_index with the arguments its version takes."""
    inner = _inner(model)
    params = inspect.signature(inner.get_rope_index).parameters
    args = {k: kw[k] for k in ("image_grid_thw", "video_grid_thw", "attention_mask") if k in kw}
    if "mm_token_type_ids" in params:
        args["mm_token_type_ids"] = types
    return inner.get_rope_index(kw["input_ids"], **args)


def _logits(model, kw, types):
    with torch.no_grad():
        out = model(**_forward_kwargs(model, kw, types))
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


NAMES = list(FAMILIES)
OPTIONS = {"hope": {"gamma": 0.75}, "v2pe": {"delta": 0.25}}


@pytest.mark.parametrize("bare", [False, True], ids=["for_generation", "bare_model"])
@pytest.mark.parametrize("name", NAMES)
def test_native_scheme_is_a_noop(name, bare):
    """The scheme the model ships with (Qwen3-VL / 3.5: interleaved timestamped layout; GLM-4V: M-RoPE) changes nothing."""
    model = _model(name, bare)
    family = vhf.model_family(model)
    assert family.name == name
    batches = [_batch(name)] + ([_batch(name, with_image=True, with_video=False)] if _is_glm(name) else [])
    refs = []
    for kw, types, _ in batches:
        refs.append((*_rope_index(model, kw, types), _logits(model, kw, types)))
    vhf.apply_position_scheme(model, family.native_scheme)
    for (kw, types, _), (ref_pos, ref_delta, ref) in zip(batches, refs):
        pos, delta = _rope_index(model, kw, types)
        assert torch.equal(pos, ref_pos.to(pos.dtype))
        assert torch.equal(delta.reshape(-1), ref_delta.reshape(-1).to(delta.dtype))
        assert torch.equal(_logits(model, kw, types), ref)  # bit-identical: same ids, same float32 cos / sin


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("scheme", POSITION_SCHEMES)
def test_scheme_positions_are_vispes_builders(name, scheme):
    """Every scheme: the ids on the real tokens are vispe's builder on the model's own segments (each video
    patch a (1, H, W) block between its timestamp text); defaults are the registry's (HoPE 0.75, V2PE 0.25)."""
    model = _model(name)
    kw, types, segs = _batch(name)
    vhf.apply_position_scheme(model, scheme)
    rows, _ = _rope_index(model, kw, types)
    coords = vhf.position_coordinates(rows, scheme)
    ref = build_positions_batch(scheme, segs, padding_side="left", spatial_merge_size=MERGE, **SCHEMES[scheme].eval_options)
    real = ref.attention_mask
    assert torch.equal(real, kw["attention_mask"].bool())
    assert torch.equal(coords[:, real], ref.pos.to(coords.dtype)[:, real])


def _generate_vs_reforward(model, kw, types, n_new=4):
    return _shared_generate_vs_reforward(model, kw, types, n_new, suppress=SPECIAL)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("scheme", POSITION_SCHEMES)
def test_generate_with_cache_equals_full_reforward(name, scheme):
    model = _model(name)
    kw, types, _ = _batch(name)
    vhf.apply_position_scheme(model, scheme, **OPTIONS.get(scheme, {}))
    assert _generate_vs_reforward(model, kw, types) <= 1e-4


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("scheme", POSITION_SCHEMES)
def test_text_only_is_1d_rope(name, scheme):
    model = _model(name)
    reference = copy.deepcopy(model)
    ref_rotary = _inner(reference).language_model.rotary_emb
    pairs = ref_rotary.inv_freq.shape[0]  # pairs of the rotated part (partial rotary: fewer than head_dim / 2)
    if scheme == "hope":  # HoPE's slowest pairs are NoPE (zero frequency) on text too
        ref_rotary.inv_freq[-(pairs // 4):] = 0.0
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [3, 4, 5, 6, 7, 8, 9]])
    kw = {"input_ids": ids, "attention_mask": (torch.arange(7) >= torch.tensor([[2], [0]])).long()}
    with torch.no_grad():
        ref = reference(**kw).logits
        ref_gen = reference.generate(**kw, max_new_tokens=3, do_sample=False, pad_token_id=0)
    vhf.apply_position_scheme(model, scheme)
    with torch.no_grad():
        got = model(**kw).logits
        gen = model.generate(**kw, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert (got - ref)[kw["attention_mask"].bool()].abs().max().item() <= 1e-5
    assert torch.equal(gen, ref_gen)


@pytest.mark.parametrize("scheme", POSITION_SCHEMES)
def test_save_and_load_restore_the_scheme(scheme, tmp_path):
    """save_pretrained records the scheme; vispe's loader and the class's own from_pretrained (guarded once
    vispe.integrations.hf is imported) restore it (same logits); removing it gives the model's own scheme back."""
    name = "qwen3_5"  # partial rotary, hybrid layers, 2 KV heads: the hardest family to restore
    model = _model(name)
    kw, types, _ = _batch(name)
    plain = _logits(model, kw, types)
    vhf.apply_position_scheme(model, scheme, **OPTIONS.get(scheme, {}))
    patched = _logits(model, kw, types)
    model.save_pretrained(tmp_path)
    loaded = vhf.from_pretrained(type(model), tmp_path)
    assert vhf.scheme_of(loaded) == vhf.recorded_scheme(loaded) == scheme
    assert loaded.config.vispe_position_scheme == model.config.vispe_position_scheme
    assert torch.equal(_logits(loaded.eval(), kw, types), patched)
    bare = type(model).from_pretrained(tmp_path).eval()  # the family's own class
    assert isinstance(bare, type(model)) and vhf.scheme_of(bare) == vhf.recorded_scheme(bare) == scheme
    assert torch.equal(_logits(bare, kw, types), patched)
    vhf.remove_position_scheme(bare)
    assert vhf.scheme_of(bare) is None and torch.equal(_logits(bare, kw, types), plain)


def test_unserialisable_options_must_be_passed_again(tmp_path):
    model = _model("qwen3_vl")
    vhf.apply_position_scheme(model, "qwen3vl", timestamp_tokens=lambda s: 5, fps=1.0)
    assert model.config.vispe_position_scheme == {"scheme": "qwen3vl", "options": {"fps": 1.0}, "unrecorded_options": ["timestamp_tokens"]}
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="timestamp_tokens"):
        vhf.from_pretrained(type(model), tmp_path)
    loaded = vhf.from_pretrained(type(model), tmp_path, scheme_options={"timestamp_tokens": lambda s: 5})
    assert vhf.scheme_of(loaded) == "qwen3vl"
    vhf.remove_position_scheme(loaded)
    assert vhf.recorded_scheme(loaded) is None  # removal forgets the record


def test_meta_device_model_gets_a_clear_error_and_is_patched_once_materialised():
    reference = _model("glm4v")
    kw, types, _ = _batch("glm4v")
    vhf.apply_position_scheme(reference, "mhrope")
    expected = _logits(reference, kw, types)
    build, prefix, moe = FAMILIES["glm4v"]
    (cfg_cls, gen, _), ckw = build(prefix, moe)
    with torch.device("meta"):
        model = gen(cfg_cls(**ckw)).eval()
    with pytest.raises(RuntimeError, match="materialised"):
        vhf.apply_position_scheme(model, "mhrope")
    assert vhf.scheme_of(model) is None
    model.to_empty(device="cpu")
    model.load_state_dict(reference.state_dict())
    with torch.no_grad():  # non-persistent buffers (rotary inv_freq) are not in the state_dict: from_pretrained rebuilds them
        for n, b in reference.named_buffers():
            model.get_buffer(n).copy_(b)
    vhf.apply_position_scheme(model, "mhrope")
    assert torch.equal(_logits(model, kw, types), expected)


@pytest.mark.parametrize("num_kv", [1, 2, 3, 4, 5, 8])
def test_mhrope_default_section_is_valid_for_any_kv_head_count(num_kv):
    enc = create_encoding("mhrope", EncodingContext(dim=16 * num_kv, num_heads=num_kv, depth=1, grid_size=(1, 1, 1), num_prefix_tokens=0))
    sec = enc.mrope_section
    assert sum(sec) == num_kv and min(sec) >= 0
    assert sec[0] >= 1  # time (and text order) always has a head
    if num_kv >= 3:
        assert min(sec) >= 1


def test_family_version_bounds_are_explicit(monkeypatch):
    fam = {f.name: f for f in vhf.MODEL_FAMILIES}
    assert fam["qwen3_5"].min_version == (5, 2) and fam["qwen3_vl"].min_version == (4, 57) and fam["glm4v"].min_version == (4, 57)
    monkeypatch.setattr("transformers.__version__", "5.1.0")
    with pytest.raises(ImportError, match=r"qwen3_5 needs transformers>=5\.2"):
        vhf.check_transformers_version(fam["qwen3_5"])
    assert vhf.check_transformers_version(fam["qwen3_vl"]) == "5.1.0"


def test_mrope_after_visual_rules():
    """build_positions('mrope', after_visual=...): the paper's next text at the block's max + 1, transformers 5.x's
    at start + max(H, W); decoding continues above every position used under both."""
    from vispe.positions import build_positions

    segs = [Text(2), Visual(5, 2, 3), Text(2)]  # t extent 5 > max(H, W) = 3
    paper, d_paper = build_positions("mrope", segs)
    spatial, d_spatial = build_positions("mrope", segs, after_visual="spatial")
    assert torch.equal(paper[:, :-2], spatial[:, :-2])  # the video itself is placed alike
    assert paper[:, -2].tolist() == [int(paper[:, :-2].max()) + 1] * 3 == [2 + 4 + 1] * 3
    assert spatial[:, -2].tolist() == [2 + 3] * 3
    L = paper.shape[1]
    assert int(d_paper) + L == int(paper.max()) + 1 and int(d_spatial) + L == int(spatial.max()) + 1
    with pytest.raises(ValueError, match=r"after_visual='paper' is not valid; choose one of \['max', 'spatial'\]"):
        build_positions("mrope", segs, after_visual="paper")
