"""Registered presets (a registered name = a record of a class plus default options, timm's way): a preset builds
exactly what its class builds with those defaults, is listed for its grids, and keeps the option checks."""
from __future__ import annotations

import pytest
import torch

import vispe
from vispe.encodings import EncodingContext, PositionGrid, create_encoding
from vispe.encodings.base import PositionalEncoding, get_record, register_preset
from vispe.encodings.rope_vit import RopeAxial

PRESETS = {  # name: (grids it is listed for, the defaults it sets)
    "rope_axial_3d": ((3,), {"grid_size": (8, 14, 14)}),
    "rope_mixed_3d": ((3,), {"grid_size": (8, 14, 14)}),
    "rope_dinov3_3d": ((3,), {"grid_size": (8, 14, 14)}),
    "alibi_2d": ((2,), {"grid_size": (14, 14)}),
    "alibi_3d": ((3,), {"grid_size": (8, 14, 14)}),
    "fire": ((2,), {"grid_size": (14, 14)}),
    "fire_3d": ((3,), {"grid_size": (8, 14, 14)}),
    "liere": ((2,), {}),
    "liere_3d": ((3,), {}),
    "comrope_ap": ((2,), {}),
    "comrope_ld": ((2,), {}),
}


def _context(ndim: int) -> EncodingContext:
    return EncodingContext(dim=32, num_heads=2, depth=2, grid_size=(2, 3, 3) if ndim == 3 else (3, 3), patch_size=(4, 4))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_is_its_class_with_defaults(name):
    ndims, defaults = PRESETS[name]
    record = get_record(name)
    cls = record.cls
    assert name in vispe.list_encodings(grid_ndim=ndims[0]) and cls.grid_ndims == ndims == record.grid_ndim
    assert cls.registry_name == name and dict(record.defaults) == defaults
    # a preset has no constructor of its own (no rewritten signature): the class it presets builds it
    assert "__init__" not in cls.__dict__
    preset_of = cls.__mro__[1]
    # same options, same rules (declared once on the class), same weights and outputs as the class itself
    assert cls.option_rules().keys() == preset_of.option_rules().keys()
    ctx = _context(ndims[0])
    accepted = set(cls.option_rules()) | set(ctx.as_kwargs())
    args = {k: v for k, v in ctx.as_kwargs().items() if k in accepted and k in preset_of.option_rules()}
    torch.manual_seed(0)
    preset = create_encoding(name, ctx)
    # the class itself, listed for the preset's grids (a subclass that changes nothing else), given the defaults
    base = type("Plain", (preset_of,), {"grid_ndims": ndims, "registry_name": name})
    torch.manual_seed(0)
    plain = base(**{**defaults, **args})
    assert isinstance(preset, preset_of) and type(preset) is cls
    for (k1, v1), (k2, v2) in zip(preset.state_dict().items(), plain.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)
    grid = PositionGrid(tuple(ctx.grid_size), 1)
    q = torch.randn(2, 2, grid.seq_len, 16)
    with torch.no_grad():
        a = preset.attend(q, q, q, layer=1, state=preset.prepare(grid))
        b = plain.attend(q, q, q, layer=1, state=plain.prepare(grid))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_preset_keeps_option_checks_and_names_itself():
    with pytest.raises(ValueError, match=r"rope_axial_3d.*theta=0"):
        vispe.create_encoding("rope_axial_3d", head_dim=16, theta=0)
    with pytest.raises(ValueError, match=r"alibi_3d.*distance='chebyshev'"):
        vispe.create_encoding("alibi_3d", num_heads=2, distance="chebyshev")


def test_register_preset_refuses_options_the_class_lacks():
    with pytest.raises(TypeError, match=r"RopeAxial has no option\(s\) \['gird_size'\]"):
        @register_preset("rope_typo", gird_size=(3, 3))
        class RopeTypo(RopeAxial):
            grid_ndims = (3,)
    with pytest.raises(TypeError, match="defines __init__; a preset only changes defaults"):
        @register_preset("rope_own_init", grid_size=(3, 3))
        class RopeOwnInit(RopeAxial):
            def __init__(self, head_dim: int) -> None:
                super().__init__(head_dim)
    assert "rope_typo" not in vispe.list_encodings() and "rope_own_init" not in vispe.list_encodings()
    assert issubclass(vispe.get_encoding_class("rope_axial_3d"), PositionalEncoding)


def test_preset_defaults_sit_under_the_context_and_the_callers_options():
    # alibi_2d's record default grid_size=(14, 14) is what a bare build gets; a host's grid or an option wins
    assert vispe.create_encoding("alibi_2d", num_heads=2).grid_size == (14, 14)
    assert vispe.create_encoding("alibi_2d", num_heads=2, grid_size=(5, 6)).grid_size == (5, 6)
    assert create_encoding("alibi_2d", _context(2)).grid_size == (3, 3)
