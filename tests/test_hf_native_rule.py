"""The model's own scheme follows the installed transformers' position-id code exactly (Qwen2.5-VL's absolute time:
its float product ``tokens_per_second * second_per_grid_ts``, truncated), over frame rates, frame counts, grids,
images + videos and padding; vispe's exact-arithmetic rule is the ``time_rule='exact'`` option. Configs that
transformers accepts (sections that do not fill the head, scaled ropes) are accepted, and the buffers vispe adds are
rebuilt by ``init_weights``. Tiny random configs, nothing downloaded."""
import copy
import inspect
from fractions import Fraction

import pytest
import torch

transformers = pytest.importorskip("transformers")

from vispe.integrations import hf as vhf
from vispe.positions import Text, Visual, absolute_time_ids, build_positions

from packaging.version import Version

from test_hf_integration import IMG, MERGE, VE, VID, VS, _left_padded, _qwen2_5_vl, _qwen2_vl  # noqa: E402

V5 = Version(transformers.__version__).major >= 5
# frame rates as a video processor samples them (second_per_grid_ts = temporal_patch_size / fps, a float32 tensor)
FPS = (1, 2, 3, 4, 5, 6, 7.5, 8, 10, 12, 12.5, 15, 23.976, 24, 25, 29.97, 30, 48, 50, 59.94, 60)
FRAMES = (8, 16, 48, 100, 250, 384)  # sampled frames: T = frames / 2 temporal patches
GRIDS = ((8, 8), (16, 16))  # ViT grids: 4x4 and 8x8 LLM tokens per temporal patch
TOKENS_PER_SECOND = (2, 4, 25)


def _patched(tps):
    torch.manual_seed(0)
    model = _qwen2_5_vl()
    model.config.vision_config.tokens_per_second = tps
    return model


def _video_batch(fps_a, fps_b, frames, grid):
    """Left-padded [text, image, text, video(fps_a), text] and [text, video(fps_b), text]."""
    img, vid = (1, 4, 4), (frames // 2, *grid)
    n_img, n_vid = 4, vid[0] * vid[1] * vid[2] // MERGE**2
    rows = [[5, VS] + [IMG] * n_img + [VE, 6, VS] + [VID] * n_vid + [VE, 7], [8, 9, VS] + [VID] * n_vid + [VE, 10, 11, 12, 13]]
    ids, mask = _left_padded(rows)
    spg = torch.tensor([2 / fps_a, 2 / fps_b])  # float32, as the processor builds it
    types = (ids == IMG).long() + 2 * (ids == VID).long()
    return dict(input_ids=ids, mm_token_type_ids=types, attention_mask=mask, image_grid_thw=torch.tensor([img]),
                video_grid_thw=torch.tensor([vid, vid]), second_per_grid_ts=spg)


def _installed(model, kw):
    inner = vhf._inner_model(model)
    params = inspect.signature(type(inner).get_rope_index).parameters
    return type(inner).get_rope_index(inner, **{k: v for k, v in kw.items() if k in params})


def _vispe(model, kw):
    params = inspect.signature(type(vhf._inner_model(model)).get_rope_index).parameters
    return vhf._inner_model(model).get_rope_index(**{k: v for k, v in kw.items() if k in params})


def test_own_scheme_equals_installed_rope_index_over_frame_rates():
    """0 mismatching ids for the model's own scheme; the exact rule differs only where transformers' float product
    truncates below an integer (counted, and each such id is the exact product's floor)."""
    batches = mismatches = exact_diff_batches = 0
    for tps in TOKENS_PER_SECOND:
        own, exact = _patched(tps), _patched(tps)
        vhf.apply_position_scheme(own, "mrope")
        vhf.apply_position_scheme(exact, "mrope", time_rule="exact")
        pairs = list(zip(FPS, FPS[1:] + FPS[:1]))
        for frames in FRAMES:
            for grid in GRIDS:
                for fps_a, fps_b in pairs:
                    kw = _video_batch(fps_a, fps_b, frames, grid)
                    ref_pos, ref_delta = _installed(own, kw)
                    pos, delta = _vispe(own, kw)
                    real = kw["attention_mask"].bool()
                    mismatches += int((pos[:, real] != ref_pos[:, real]).sum()) + int((delta.reshape(-1) != ref_delta.reshape(-1)).sum())
                    epos, _ = _vispe(exact, kw)
                    exact_diff_batches += bool((epos[:, real] != ref_pos[:, real]).any())
                    batches += 1
    assert batches == len(TOKENS_PER_SECOND) * len(FRAMES) * len(GRIDS) * len(FPS) == 756
    assert mismatches == 0
    assert exact_diff_batches > 0  # the documented difference of the exact rule exists in this scan (e.g. 25 fps)


@pytest.mark.parametrize("fps,tps", [(25, 2), (25, 4), (29.97, 2), (30, 4), (7.5, 25), (60, 25)])
def test_time_rules_on_one_video(fps, tps):
    """'float32' is transformers' truncated float32 product; 'exact' floors the rational product t * (2/fps) * tps."""
    T = 192
    spg32 = float(torch.tensor(2 / fps))  # the float32 value the processor's tensor holds
    f32 = absolute_time_ids(T, spg32, tps, rule="float32")
    ref = (torch.arange(T) * (tps * torch.tensor(spg32))).long()
    assert torch.equal(f32.long(), ref)
    ex = absolute_time_ids(T, Fraction(2) / Fraction(str(fps)), tps)
    assert torch.equal(ex.long(), torch.tensor([t * 2 * tps * Fraction(str(fps)).denominator // Fraction(str(fps)).numerator for t in range(T)]))
    assert ((ex - f32).abs() <= 1).all()  # the rules differ by at most one step of rounding


def test_time_rule_option_is_checked():
    with pytest.raises(ValueError, match="time_rule.*'sometimes'"):
        build_positions("mrope", [Visual(2, 1, 1)], fps=2.0, time_rule="sometimes")
    with pytest.raises(ValueError, match="time_floor=False"):
        build_positions("mrope", [Visual(2, 1, 1)], fps=2.0, time_floor=False, time_rule="float32")
    pos, _ = build_positions("mrope", [Text(1), Visual(4, 1, 1)], fps=25.0, tokens_per_second=2, time_rule="float32")
    assert pos.dtype == torch.int64


def _rope_dict(text_config):
    """The text config's rotary dict in the installed version's spelling (5.x rope_parameters, 4.x rope_scaling)."""
    params = getattr(text_config, "rope_parameters", None)
    return params if params is not None else text_config.rope_scaling


def _model_with_rope(build, rope_parameters):
    model = build()
    cfg = copy.deepcopy(model.config)  # the tests' config dicts are shared: change a copy
    _rope_dict(cfg.text_config).update(rope_parameters, **({} if V5 else {"type": rope_parameters["rope_type"]}))
    torch.manual_seed(0)
    return type(model)(cfg).eval()


def _text_logits(model):
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}],
                         ids=["linear", "dynamic", "yarn"])
def test_scaled_ropes_keep_their_scaling_or_are_refused_by_name(rope):
    model = _model_with_rope(_qwen2_vl, rope)
    ref = _text_logits(model)
    own = vhf.apply_position_scheme(copy.deepcopy(model), "mrope")  # the model's own scheme keeps every rope_type
    assert torch.equal(_text_logits(own), ref)
    if rope["rope_type"] == "dynamic":
        with pytest.raises(ValueError, match="rope_type='dynamic'.*'hope'"):
            vhf.apply_position_scheme(copy.deepcopy(model), "hope")
        return
    # a static scaling travels into a switched scheme: text-only input is 1D RoPE on the model's scaled ladder
    own_rotary = vhf._inner_model(model).language_model.rotary_emb
    for scheme in ("mrope_interleave", "mhrope"):  # a shared table and MHRoPE's per-head hooks
        switched = vhf.apply_position_scheme(copy.deepcopy(model), scheme)
        rotary = vhf._inner_model(switched).language_model.rotary_emb
        assert torch.equal(rotary.inv_freq, own_rotary.inv_freq) and rotary.attention_scaling == own_rotary.attention_scaling
        assert (_text_logits(switched) - ref).abs().max() <= 1e-5, scheme


def test_sections_that_do_not_fill_the_head_are_accepted_for_the_own_scheme():
    """Qwen3-VL's interleaved layout only slices mrope_section (transformers' tests use [16, 8, 8] on 1-pair heads)."""
    from test_hf_families import _model as family_model  # noqa: E402

    model = family_model("qwen3_vl")
    cfg = copy.deepcopy(model.config)  # the tests' config dicts are shared: change a copy
    _rope_dict(cfg.text_config)["mrope_section"] = [16, 8, 8]
    torch.manual_seed(0)
    model = type(model)(cfg).eval()
    ref = _text_logits(model)
    vhf.apply_position_scheme(model, "qwen3vl")
    assert vhf.scheme_of(model) == "qwen3vl" and torch.equal(_text_logits(model), ref)


@pytest.mark.skipif(not V5, reason="transformers 4.x's init_weights does not rebuild buffers")
@pytest.mark.parametrize("scheme", ["mrope", "hope", "mhrope"])
def test_init_weights_rebuilds_vispes_rotary_buffers(scheme):
    """As transformers' test_init_weights_can_init_buffers: a model built on the meta device, moved with to_empty
    (buffers hold garbage) and switched, gets every rotary buffer back from init_weights."""
    cfg = _qwen2_vl().config
    with torch.device("meta"):
        model = transformers.Qwen2VLForConditionalGeneration(copy.deepcopy(cfg))
    model.to_empty(device="cpu")
    vhf.apply_position_scheme(model, scheme, **({"mrope_section": [2, 3, 3]} if scheme == "mrope" else {}))
    model.init_weights()
    fresh = transformers.Qwen2VLForConditionalGeneration(copy.deepcopy(cfg))
    want = vhf._inner_model(fresh).language_model.rotary_emb.inv_freq
    rotary = vhf._inner_model(model).language_model.rotary_emb
    assert isinstance(rotary, vhf.VispeRotaryEmbedding)
    assert torch.equal(rotary.inv_freq, want) and torch.equal(rotary.original_inv_freq, want)
