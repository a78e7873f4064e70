"""The resolution-options contract: encodings declare their extrapolation policies and coordinate options, and
``set_extrapolation`` switches a built (loaded) model's policy without rebuilding it."""
from __future__ import annotations

import pytest
import timm
import torch

import vispe
from vispe.encodings import extrapolation_policies, get_extrapolation, set_extrapolation
from vispe.encodings.coordinates import COORDINATE_OPTION_CHECKS, DINOV3_COORDINATE_ALIASES

TINY = dict(depth=2, num_classes=3)
TWO_D = [n for n in vispe.list_encodings(grid_ndim=2) if vispe.get_encoding_class(n).extrapolation_policies]
# a composed encoding: the policy reaches its rotary part
COMPOSED = ["learned+rope_axial"]


def _model(spec):
    return timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding=spec, **TINY).eval()


def test_every_2d_encoding_with_an_extrapolation_option_declares_it():
    assert {"rope_axial", "rope_mixed", "sincos2d", "alibi_2d", "seqpe"} <= set(TWO_D)
    for name in TWO_D:
        cls = vispe.get_encoding_class(name)
        assert "extrapolation" in cls.option_rules()  # the option's rule comes from the declared policies
        assert cls.option_rules()["extrapolation"].choices == cls.extrapolation_policies
    assert extrapolation_policies("rope_axial") == ("extend", "interpolate", "ntk", "yarn")
    assert extrapolation_policies("learned") == () and extrapolation_policies("rope_dinov3") == ()


@pytest.mark.parametrize("name", TWO_D + COMPOSED)
def test_set_extrapolation_equals_building_with_the_policy(name):
    torch.manual_seed(0)
    built = _model(name)
    default = get_extrapolation(built)
    assert extrapolation_policies(built) == extrapolation_policies(name)
    x_train, x_big = torch.randn(2, 3, 32, 32), torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        before = built(x_big)  # fills the per-grid caches under the default policy
    changed = False
    for policy in extrapolation_policies(name):
        spec = (f"learned+rope_axial[extrapolation={policy!r}]" if name in COMPOSED
                else {"name": name, "extrapolation": policy})
        fresh = _model(spec)
        fresh.load_state_dict(built.state_dict())
        assert set_extrapolation(built, policy) is built and get_extrapolation(built) == policy
        with torch.no_grad():
            torch.testing.assert_close(built(x_big), fresh(x_big), rtol=0, atol=0)
            torch.testing.assert_close(built(x_train), fresh(x_train), rtol=0, atol=0)
            changed |= policy != default and not torch.allclose(built(x_big), before)
    assert changed, f"{name}: no policy changed the logits off the training grid (the switch did nothing)"
    set_extrapolation(built, default)
    with torch.no_grad():
        torch.testing.assert_close(built(x_big), before, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["rope_axial", "sincos2d", "learned+rope_axial"])
def test_unknown_policy_refused_by_name(name):
    model = _model(name)
    with pytest.raises(ValueError, match=r"extrapolation='sideways' is not valid.*\['extend', 'interpolate'"):
        set_extrapolation(model, "sideways")
    enc = model.pos_encoding
    holder = enc.parts[1] if name in COMPOSED else enc
    with pytest.raises(ValueError, match=r"extrapolation='sideways' is not valid; choose one of"):
        holder.extrapolation = "sideways"
    assert get_extrapolation(model) == "extend"


@pytest.mark.parametrize("name", ["learned", "cpe", "rope_dinov3", "comrope_ld"])
def test_encodings_without_a_policy_refuse_one(name):
    model = _model(name)
    assert extrapolation_policies(model) == () and get_extrapolation(model) is None
    with pytest.raises(ValueError, match=rf"extrapolation='extend'.*{name} has no extrapolation option"):
        set_extrapolation(model, "extend")


def test_ntk_is_refused_where_only_extend_and_interpolate_exist():
    with pytest.raises(ValueError, match=r"extrapolation='ntk' is not valid.*\['extend', 'interpolate'\]"):
        set_extrapolation(_model("alibi_2d"), "ntk")
    with pytest.raises(ValueError, match="extrapolation='ntk' is not valid"):
        vispe.create_encoding("sincos2d", dim=32, extrapolation="ntk")


def test_coordinate_options_declared_once():
    for name in vispe.list_encodings():
        cls = vispe.get_encoding_class(name)
        rules = cls.option_rules()
        for opt in cls.coordinate_options:
            rule = rules[opt]
            canonical = COORDINATE_OPTION_CHECKS[DINOV3_COORDINATE_ALIASES.get(opt, opt)]
            assert (rule.low, rule.high) == (canonical.low, canonical.high), (name, opt)
    assert vispe.get_encoding_class("rope_axial").coordinate_options == tuple(COORDINATE_OPTION_CHECKS)
    assert vispe.get_encoding_class("sincos2d").coordinate_options == ("random_positions",)
    assert vispe.get_encoding_class("rope_dinov3").coordinate_options == tuple(DINOV3_COORDINATE_ALIASES)
    assert vispe.get_encoding_class("comrope_ld").coordinate_options == tuple(COORDINATE_OPTION_CHECKS)
