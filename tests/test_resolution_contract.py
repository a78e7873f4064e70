"""The resolution contract of every registered encoding: the declared default is what a fresh encoding uses, every
declared policy is accepted and every other refused with the choices named, the alias ``interpolate`` is its precise
name (bit for bit), policies are dispatched in the helpers only, and the docs' contract table is the registry's."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from timm.layers import resample_abs_pos_embed

import vispe
from vispe.encodings import (
    EncodingContext,
    PositionGrid,
    create_encoding,
    get_encoding_class,
    get_extrapolation,
    set_extrapolation,
)
from vispe.encodings.base import PositionalEncoding
from vispe.encodings.resolution import INTERPOLATE, POLICIES, RESAMPLE_KERNELS, ResolutionContract, resample_table
from vispe.encodings.spec import contract_table

ROOT = Path(__file__).resolve().parents[1]
ALL = vispe.list_encodings()
WITH_POLICIES = [n for n in ALL if get_encoding_class(n).resolution.policies]
WITH_ALIAS = [n for n in WITH_POLICIES if get_encoding_class(n).resolution.interpolates_by]


def _ctx(name: str) -> EncodingContext:
    ndims = get_encoding_class(name).grid_ndims
    grid = (4, 4) if 2 in ndims else ((2, 4, 4) if 3 in ndims else (8,))
    return EncodingContext(dim=64, num_heads=4, depth=2, grid_size=grid, patch_size=(4, 4))


def _larger(grid: tuple[int, ...]) -> PositionGrid:
    return PositionGrid(tuple(g + 2 + i for i, g in enumerate(grid)), num_prefix_tokens=1)  # larger, not square


def _build(name: str, **options) -> PositionalEncoding:
    torch.manual_seed(0)
    return create_encoding(name, _ctx(name), **options).eval()


def _outputs(enc: PositionalEncoding, grid: PositionGrid) -> tuple[torch.Tensor, torch.Tensor]:
    """What the encoding does to a token sequence and to attention on ``grid`` (every kind through its hooks)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, grid.seq_len, 64, generator=g)
    q, k, v = (torch.randn(2, 4, grid.seq_len, 16, generator=g) for _ in range(3))
    with torch.no_grad():
        state = enc.prepare(grid, None)
        return enc.embed_tokens(x, grid, state), enc.attend(q, k, v, layer=0, state=state)


def _takes_option(name: str) -> bool:
    return "extrapolation" in inspect.signature(get_encoding_class(name).__init__).parameters


@pytest.mark.parametrize("name", ALL)
def test_declared_default_is_what_a_fresh_encoding_uses(name):
    cls = get_encoding_class(name)
    contract = cls.resolution
    enc = _build(name)
    assert cls.extrapolation_policies == contract.names
    assert enc.resolution_policy == contract.default
    assert get_extrapolation(enc) == (contract.name_of(contract.default) if contract.policies else None)
    if contract.policies:
        assert _takes_option(name), f"{name} declares policies but has no extrapolation option"
        # the default lives in the contract only: the constructor's default means "the declared one"
        assert inspect.signature(cls.__init__).parameters["extrapolation"].default is None


@pytest.mark.parametrize("name", WITH_POLICIES)
def test_declared_policies_accepted_and_others_refused_with_the_choices(name):
    contract = get_encoding_class(name).resolution
    for value in contract.accepted:
        built = _build(name, extrapolation=value)
        assert built.resolution_policy == contract.resolve(value)
        switched = set_extrapolation(_build(name), value)
        assert get_extrapolation(switched) == contract.name_of(value) and switched.extrapolation == value
    for value in [p for p in POLICIES if p not in contract.policies] + ["sideways"]:
        if value == INTERPOLATE or value in contract.accepted:
            continue
        with pytest.raises(ValueError) as built_error:
            _build(name, extrapolation=value)
        with pytest.raises(ValueError) as set_error:
            set_extrapolation(_build(name), value)
        for message in (str(built_error.value), str(set_error.value)):
            assert name in message and f"extrapolation={value!r}" in message, message
            assert all(repr(n) in message for n in contract.accepted), message


@pytest.mark.parametrize("name", [n for n in ALL if n not in WITH_POLICIES])
def test_encodings_without_policies_refuse_every_one(name):
    enc = _build(name)
    for value in list(POLICIES) + [INTERPOLATE]:
        with pytest.raises(ValueError, match=rf"extrapolation={value!r}.*has no extrapolation option"):
            set_extrapolation(enc, value)


@pytest.mark.parametrize("name", WITH_ALIAS)
def test_interpolate_is_bit_identical_to_its_precise_name(name):
    contract = get_encoding_class(name).resolution
    grid = _larger(_ctx(name).grid_size)
    alias = _outputs(_build(name, extrapolation=INTERPOLATE), grid)
    precise = _outputs(_build(name, extrapolation=contract.interpolates_by), grid)
    extend = _outputs(_build(name, extrapolation="extend"), grid)
    for a, p in zip(alias, precise):
        assert torch.equal(a, p)
    # on the larger grid the alias does something other than extend (it is not a no-op name)
    assert not all(torch.equal(a, e) for a, e in zip(alias, extend))
    # switching a built encoding to the alias gives the same as building with it
    switched = set_extrapolation(_build(name), INTERPOLATE)
    assert all(torch.equal(a, s) for a, s in zip(alias, _outputs(switched, grid)))


def test_no_encoding_compares_its_policy_itself():
    """Policies are carried out by the helpers (vispe.encodings.coordinates / resolution); encodings pass their
    resolution_policy to them and never compare policy names."""
    compare = re.compile(r"(extrapolation|resolution_policy)\s*(==|!=|\bin\b|\bnot in\b)|[\"'](interpolate|rescale|resample|ntk|yarn)[\"']\s*(==|!=)")
    classes = {k for name in ALL for k in get_encoding_class(name).__mro__
               if k is not PositionalEncoding and isinstance(k, type) and issubclass(k, PositionalEncoding)}
    for klass in classes:
        assert not compare.search(inspect.getsource(klass)), f"{klass.__name__} compares its extrapolation policy itself"


def test_contract_declarations_are_checked():
    with pytest.raises(ValueError, match=r"unknown policies \['sideways'\]"):
        ResolutionContract(("extend", "sideways"), "extend")
    with pytest.raises(ValueError, match="both 'rescale' and 'resample'"):
        ResolutionContract(("extend", "rescale", "resample"), "extend")
    with pytest.raises(ValueError, match=r"default='ntk' must be one of \['extend', 'rescale'\]"):
        ResolutionContract(("extend", "rescale"), "ntk")
    with pytest.raises(TypeError, match="declare the policies as resolution = ResolutionContract"):
        type("Old", (PositionalEncoding,), {"extrapolation_policies": ("extend", "interpolate")})


def test_resample_table_is_timms_resampler_in_2d_and_trilinear_in_3d():
    torch.manual_seed(0)
    table = torch.randn(4 * 5, 8)
    for kernel, (mode, antialias) in RESAMPLE_KERNELS.items():
        if mode == "trilinear":
            continue
        for new in ((2, 3), (7, 9)):
            ref = resample_abs_pos_embed(table[None], list(new), [4, 5], num_prefix_tokens=0, interpolation=mode, antialias=antialias)[0]
            assert torch.equal(resample_table(table, (4, 5), new, kernel), ref)
    # antialiasing matters when the table shrinks: the kernel parameter reaches the resampler
    assert not torch.equal(resample_table(table, (4, 5), (2, 3), "bicubic"), resample_table(table, (4, 5), (2, 3)))
    vol = torch.randn(2 * 3 * 4, 8)
    ref = F.interpolate(vol.T.reshape(1, 8, 2, 3, 4), size=(3, 5, 6), mode="trilinear", align_corners=False).reshape(8, -1).T
    assert torch.equal(resample_table(vol, (2, 3, 4), (3, 5, 6), "trilinear"), ref)
    with pytest.raises(ValueError, match=r"kernel='lanczos' is not valid; choose one of \['bicubic_antialias'"):
        resample_table(table, (4, 5), (6, 6), "lanczos")
    with pytest.raises(ValueError, match="kernel='trilinear' resamples 3-axis grids"):
        resample_table(table, (4, 5), (6, 6), "trilinear")


def test_docs_contract_table_is_the_registrys():
    page = (ROOT / "docs" / "resolution-options.md").read_text()
    table = contract_table()
    assert table in page, "docs/resolution-options.md: regenerate the contract table with vispe.encodings.spec.contract_table()"
