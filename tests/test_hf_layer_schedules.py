"""Per-layer rotary schemes of transformers' newer families, read into vispe's layer schedule
(:func:`vispe.integrations.hf.text_rotary_schedule`) and checked against the installed transformers as the oracle:
tiny random-init models built from their configs (nothing downloaded), the ``position_embeddings`` each layer's
attention receives captured, and each layer's q / k turned by the model's own ``apply_rotary_pos_emb`` compared with
vispe's ``rotate_qk`` for that layer (NoPE layers, rotated channels, base per layer).

Families (transformers 5.24): Muse Glimmer (``layer_rope_theta``: NoPE every fourth layer counted from the last),
NeoMME (per-layer-type base and ``partial_rotary_factor``: 25 % in global layers), Step3p7 (per-layer ``rope_theta``
and ``partial_rotary_factors``), HY-V4-VL (interleaved M-RoPE sections on the MLA rope slice); and Qwen3.5 (5.2), an
integrated family whose linear-attention layers take no position. A family the installed transformers lacks is
skipped, naming it.
"""
from __future__ import annotations

import importlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from vispe.integrations import hf as vhf

L, B = 12, 2
#: token positions with a far one: a wrong base or frequency layout moves these by O(1)
POSITIONS = torch.tensor([[0, 1, 2, 3, 5, 8, 13, 21, 34, 40, 41, 47], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]])


def _family(name: str, since: str = "5.24"):
    """The installed ``modeling_<name>`` and ``configuration_<name>`` modules, or a skip naming the family."""
    try:
        return (importlib.import_module(f"transformers.models.{name}.modeling_{name}"),
                importlib.import_module(f"transformers.models.{name}.configuration_{name}"))
    except ImportError:
        pytest.skip(f"transformers {transformers.__version__} has no {name} (added in {since})")


def _attention_inputs(model, layers, **forward_kwargs) -> list:
    """The ``position_embeddings`` (``(cos, sin)`` or ``None``) each layer's attention receives in one forward (``None``
    for a layer without softmax attention)."""
    seen: dict[int, object] = {i: None for i, layer in enumerate(layers) if not hasattr(layer, "self_attn")}  # linear attention
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda m, args, kwargs, i=i: seen.__setitem__(i, kwargs.get("position_embeddings")), with_kwargs=True)
        for i, layer in enumerate(layers) if hasattr(layer, "self_attn")]
    try:
        with torch.no_grad():
            model(**forward_kwargs)
    finally:
        for h in hooks:
            h.remove()
    assert sorted(seen) == list(range(len(layers)))
    return [seen[i] for i in range(len(layers))]


def _check_layers(modeling, schedule, received, positions, heads: int) -> list[int]:
    """Each layer: the model's rotation of random q / k with what its attention received equals vispe's for that
    layer; returns the rotated channel count per layer (0: NoPE)."""
    vispe = vhf.ScheduledTextRotary(schedule, num_heads=1)
    g = torch.Generator().manual_seed(0)
    widths = []
    for layer, pe in enumerate(received):
        q, k = (torch.randn(B, heads, positions.shape[-1], schedule.head_dim, generator=g) for _ in range(2))
        want = (q, k) if pe is None else modeling.apply_rotary_pos_emb(q, k, *pe)
        got = vispe.rotate_qk(q, k, positions, layer)
        for w, v in zip(want, got):
            assert (w - v).abs().max() <= 1e-6, f"layer {layer}: vispe's rotation differs from the model's"
        widths.append(0 if pe is None else pe[0].shape[-1])
        # the channels vispe leaves alone are exactly those the model leaves alone
        moved = (got[0] != q).flatten(0, -2).any(0)
        assert moved.tolist() == [c < widths[-1] for c in range(schedule.head_dim)], f"layer {layer}: rotated channels differ"
    return widths


def test_muse_glimmer_nope_every_fourth_layer_from_the_last():
    modeling, configuration = _family("muse_glimmer")
    cfg = configuration.MuseGlimmerTextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, bos_token_id=1,
                                              eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    schedule = vhf.text_rotary_schedule(cfg)
    assert schedule.nope_layers == {1, 5} and set(schedule.layer_theta) == {5000.0} and set(schedule.rotary_fraction) == {1.0}
    torch.manual_seed(0)
    model = modeling.MuseGlimmerTextModel(cfg).eval()
    ids = torch.randint(3, 64, (B, L))
    received = _attention_inputs(model, model.layers, input_ids=ids, position_ids=POSITIONS)
    assert _check_layers(modeling, schedule, received, POSITIONS, heads=2) == [16, 0, 16, 16, 16, 0]


def test_muse_glimmer_explicit_layer_rope_theta():
    """A config's own ``layer_rope_theta``: its zeros are the NoPE layers; the installed rotary turns every other layer
    with the global base, so vispe's schedule does too."""
    modeling, configuration = _family("muse_glimmer")
    cfg = configuration.MuseGlimmerTextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, bos_token_id=1,
                                              eos_token_id=2, layer_rope_theta=[0, 10000.0, 0, 10000.0])
    schedule = vhf.text_rotary_schedule(cfg)
    assert schedule.nope_layers == {0, 2}
    torch.manual_seed(0)
    model = modeling.MuseGlimmerTextModel(cfg).eval()
    received = _attention_inputs(model, model.layers, input_ids=torch.randint(3, 64, (B, L)), position_ids=POSITIONS)
    assert _check_layers(modeling, schedule, received, POSITIONS, heads=2) == [0, 16, 0, 16]


def test_neomme_quarter_rotary_in_global_layers():
    modeling, configuration = _family("neomme")
    cfg = configuration.NeoMMEConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=7, num_attention_heads=2,
                                     num_key_value_heads=1, head_dim=16, embedding_rank=8, embedding_dim=8, patch_size=2)
    schedule = vhf.text_rotary_schedule(cfg)
    full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
    assert full == [5, 6]
    assert [schedule.rotary_fraction[i] for i in range(7)] == [1.0] * 5 + [0.25] * 2
    assert [schedule.layer_theta[i] for i in range(7)] == [1e4] * 5 + [1e6] * 2
    # two vispe encodings: full width at base 1e4 in the sliding layers, 4 of 16 channels at 1e6 in the global ones
    groups = vhf.text_rotary_schedule(cfg).encoding_options()
    assert [g[0] for g in groups] == [(0, 1, 2, 3, 4), (5, 6)]
    assert groups[1][1]["rotary_fraction"] == 0.25 and groups[1][1]["theta"] == 1e6
    torch.manual_seed(0)
    model = modeling.NeoMMEModel(cfg).eval()
    received = _attention_inputs(model, model.layers, input_ids=torch.randint(7, 64, (B, L)), position_ids=POSITIONS)
    assert _check_layers(modeling, schedule, received, POSITIONS, heads=2) == [16] * 5 + [4] * 2


@pytest.mark.parametrize("factors", [[1.0, 0.5, 1.0, 0.5], [1.0] * 4])
def test_step3p7_per_layer_theta_and_partial_rotary(factors):
    """Both bases on one width is one vispe encoding with ``layer_theta``; two widths, two encodings."""
    modeling, configuration = _family("step3p7")
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    cfg = configuration.Step3p7TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                                          num_key_value_heads=1, head_dim=16, layer_types=types, mlp_layer_types=["dense"] * 4,
                                          rope_theta=[1e4, 5e5, 1e4, 5e5], partial_rotary_factors=factors, sliding_window=4)
    schedule = vhf.text_rotary_schedule(cfg)
    assert schedule.layer_theta == (1e4, 5e5, 1e4, 5e5) and schedule.rotary_fraction == tuple(factors) and not schedule.nope_layers
    groups = schedule.encoding_options()
    assert len(groups) == len(set(factors))
    if len(groups) == 1:
        assert groups[0][1]["layer_theta"] == [1e4, 5e5, 1e4, 5e5]
    torch.manual_seed(0)
    model = modeling.Step3p7TextModel(cfg).eval()
    received = _attention_inputs(model, model.layers, input_ids=torch.randint(3, 64, (B, L)), position_ids=POSITIONS, use_cache=False)
    assert _check_layers(modeling, schedule, received, POSITIONS, heads=2) == [int(16 * f) for f in factors]


def test_hy_v4_vl_interleaved_mrope_on_the_rope_slice():
    modeling, configuration = _family("hy_v4_vl")
    cfg = configuration.HYV4VLTextConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, qk_nope_head_dim=8,
                                         qk_rope_head_dim=16, v_head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                                             "mrope_section": [4, 2, 2]})
    schedule = vhf.text_rotary_schedule(cfg)
    assert schedule.head_dim == 16 and schedule.mrope_section == (4, 2, 2) and schedule.mrope_interleaved and not schedule.nope_layers
    rotary = modeling.HYV4VLRotaryEmbedding(cfg)
    # t, h, w rows that differ: a wrong section or interleaving turns some pair by the wrong coordinate
    pos = torch.stack([POSITIONS, POSITIONS.flip(-1) % 7, (3 * POSITIONS) % 5])
    cos, sin = rotary(torch.zeros(1), pos)
    received = [(cos, sin)] * schedule.depth  # one table for every layer, applied to the rope slice of q and k
    assert _check_layers(modeling, schedule, received, pos, heads=2) == [16, 16]
    assert vhf.ScheduledTextRotary(schedule).scheme == "qwen3vl"


def test_qwen3_5_linear_attention_layers_get_no_position():
    """An integrated family: Qwen3.5's Gated DeltaNet layers take no position (NoPE in the schedule), its attention
    layers turn the first 25 % of the head with interleaved M-RoPE sections."""
    modeling, configuration = _family("qwen3_5", since="5.2")
    cfg = configuration.Qwen3_5TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                                          num_key_value_heads=1, head_dim=32, linear_key_head_dim=8, linear_value_head_dim=8,
                                          linear_num_key_heads=2, linear_num_value_heads=2,
                                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                                           "mrope_interleaved": True, "partial_rotary_factor": 0.25})
    schedule = vhf.text_rotary_schedule(cfg)
    assert schedule.nope_layers == {0, 1, 2} and schedule.rotary_fraction == (0.25,) * 4 and schedule.mrope_interleaved
    torch.manual_seed(0)
    model = modeling.Qwen3_5TextModel(cfg).eval()
    pos = torch.stack([POSITIONS, POSITIONS.flip(-1) % 7, (3 * POSITIONS) % 5])  # t, h, w rows that differ
    received = _attention_inputs(model, model.layers, input_ids=torch.randint(3, 64, (B, L)), position_ids=pos, use_cache=False)
    assert _check_layers(modeling, schedule, received, pos, heads=2) == [0, 0, 0, 8]


def test_schedule_rejects_a_ladder_it_cannot_reproduce():
    _, configuration = _family("step3p7")
    cfg = configuration.Step3p7TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                          num_key_value_heads=1, head_dim=16, mlp_layer_types=["dense"] * 2)
    cfg.rope_parameters["full_attention"]["rope_type"] = "linear"
    with pytest.raises(ValueError, match=r"rope_parameters\['full_attention'\]\['rope_type'\]='linear'.*'default' only"):
        vhf.text_rotary_schedule(cfg)


def test_schedule_rejects_a_layer_rope_theta_of_another_depth():
    _, configuration = _family("muse_glimmer")
    cfg = configuration.MuseGlimmerTextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                              num_attention_heads=2, num_key_value_heads=1, head_dim=16, bos_token_id=1,
                                              eos_token_id=2)
    cfg.layer_rope_theta = [0, 1e4, 1e4]
    with pytest.raises(ValueError, match="layer_rope_theta has 3 entries for 4 layers"):
        vhf.text_rotary_schedule(cfg)


def test_rotate_qk_names_a_layer_outside_the_model():
    schedule = vhf.TextRotarySchedule("x", 8, (1e4, 1e4), (1.0, 1.0))
    q = torch.zeros(1, 1, 3, 8)
    with pytest.raises(ValueError, match="layer=2 is outside the model's 2 layers"):
        vhf.ScheduledTextRotary(schedule).rotate_qk(q, q, torch.arange(3)[None], 2)
