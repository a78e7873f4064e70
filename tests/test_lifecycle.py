"""The per-forward lifecycle every encoding shares: one cache owned by the base class."""
from __future__ import annotations

import inspect

import pytest
import timm
import torch

import vispe
from vispe.encodings import get_encoding_class
from vispe.encodings.base import PositionalEncoding

ENC_2D = [n for n in vispe.list_encodings() if 2 in get_encoding_class(n).grid_ndims]


def _tiny(name: str):
    return timm.create_model(
        "vispe_vit_tiny_patch16_224", pos_encoding=name, img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3,
        num_classes=3,
    )


def test_cached_state_follows_parameter_updates_and_moves():
    torch.manual_seed(0)
    model = _tiny("rope_mixed").eval()
    enc = model.pos_encoding
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        a = model(x)
        n = len(enc._state_cache)
        assert torch.equal(model(x), a) and len(enc._state_cache) == n  # reused
        enc.freqs.mul_(1.5)  # an optimizer step would do the same: new parameter version
        b = model(x)
    fresh = _tiny("rope_mixed").eval()
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(b, fresh(x))  # rebuilt, not the stale table
    assert not torch.allclose(a, b)
    model.to(torch.float64)
    assert len(enc._state_cache) == 0  # moving the module drops every entry


def test_gradient_reaches_parameters_through_state():
    """While a gradient must reach the parameters the state is rebuilt, never served from the cache."""
    torch.manual_seed(0)
    model = _tiny("rope_mixed").train()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        model(x)  # fills the cache
    model(x).sum().backward()
    assert model.pos_encoding.freqs.grad is not None and model.pos_encoding.freqs.grad.abs().sum() > 0


def test_no_encoding_keeps_its_own_cache():
    """Caching lives in PositionalEncoding.cached only: no encoding module defines cache storage of its own."""
    for name in vispe.list_encodings():
        cls = get_encoding_class(name)
        for klass in cls.__mro__:
            if klass is PositionalEncoding or not issubclass(klass, PositionalEncoding):
                continue
            src = inspect.getsource(klass)
            assert "OrderedDict" not in src and "_cache[" not in src, f"{klass.__name__} keeps a cache of its own"


def test_every_multimodal_scheme_has_one_record():
    """Each multimodal rotary encoding has exactly one scheme record, and the record is what the encoding,
    the position builder and the video-LLM read."""
    from vispe.encodings import EncodingContext
    from vispe.encodings.multimodal_rope import MultimodalRotary
    from vispe.models.video_llm import VideoLLM
    from vispe.positions import SCHEMES, Text, Visual, build_positions

    multimodal = [n for n in vispe.list_encodings() if issubclass(get_encoding_class(n), MultimodalRotary)]
    assert sorted(multimodal) == sorted(SCHEMES)
    for name, rec in SCHEMES.items():
        pos, _ = build_positions(name, [Text(2), Visual(2, 2, 2), Text(1)])
        assert pos.shape == (rec.num_coords, 11)
        enc = vispe.create_encoding(name, EncodingContext(dim=48, num_heads=3, depth=1, grid_size=(1, 1, 1)))
        assert enc.num_coords == rec.num_coords
        llm = VideoLLM(vocab_size=16, pos_scheme=name, dim=48, depth=1, num_heads=3)
        assert llm.num_coords == rec.num_coords
        # schemes that draw a scale per visual block do so only in training
        assert ("training" in llm._pos_kwargs(True)) == rec.train_draws


def test_one_spec_grammar():
    """The string, mapping and pair forms name the same encoding with the same options, everywhere."""
    from vispe.benchmarks.speed import parse_encoding_specs
    from vispe.encodings import EncodingContext, parse_pos_encoding
    from vispe.encodings.spec import format_spec

    forms = ["irpe[mode='bias',sides=qk]", {"name": "irpe", "mode": "bias", "sides": "qk"}, ("irpe", {"mode": "bias", "sides": "qk"})]
    assert all(parse_pos_encoding(f) == ("irpe", {"mode": "bias", "sides": "qk"}) for f in forms)
    assert parse_pos_encoding(format_spec("rope_mixed", {"theta": 10.0})) == ("rope_mixed", {"theta": 10.0})
    assert parse_encoding_specs("learned, irpe[mode=bias,sides=qk]")[1] == ("irpe[mode=bias,sides=qk]", "irpe", {"mode": "bias", "sides": "qk"})
    ctx = EncodingContext(dim=48, num_heads=3, depth=2, grid_size=(4, 4))
    enc = vispe.create_encoding("irpe[mode=bias]", ctx)
    assert enc.mode == "bias"
    model = timm.create_model("vispe_vit_tiny_patch16_224", pos_encoding="irpe[mode=bias]", img_size=32, patch_size=8)
    assert model.pos_encoding.mode == "bias"
    with pytest.raises(ValueError, match="key=value"):
        parse_pos_encoding("irpe[bias]")
    with pytest.raises(ValueError, match="unknown positional encoding 'nope'"):
        vispe.create_encoding("nope[x=1]", ctx)


def test_every_encoding_uses_a_contract():
    """Every attention-side encoding is one of the contract classes: rotary (ComRoPE included, through
    rotate_qk) or attention bias (iRPE), and kind is the contract's, not set by hand."""
    from vispe.encodings import AttentionBiasEncoding, EncodingContext, RotaryEncoding, TokenEncoding

    for name in ("comrope_ap", "comrope_ld", "comrope_ld_3d", "liere", "liere_3d"):
        cls = get_encoding_class(name)
        assert issubclass(cls, RotaryEncoding) and not cls.pairwise_phases and cls.kind == "rotary"
        assert "attend" not in vars(cls) and not any("attend" in vars(k) for k in cls.__mro__[1:] if k is not RotaryEncoding
                                                      and issubclass(k, RotaryEncoding))
    assert issubclass(get_encoding_class("irpe"), AttentionBiasEncoding) and get_encoding_class("irpe").kind == "bias"
    for name in vispe.list_encodings():
        cls = get_encoding_class(name)
        contracts = [c for c in (TokenEncoding, AttentionBiasEncoding, RotaryEncoding) if issubclass(cls, c)]
        if cls.kind in ("token", "bias", "rotary"):
            assert len(contracts) == 1 and contracts[0].kind == cls.kind, name
    # iRPE's bias() is the term its attention adds: attention with it as a float mask gives the same output
    torch.manual_seed(0)
    enc = vispe.create_encoding("irpe[init_std=0.5]", EncodingContext(dim=32, num_heads=2, depth=1, grid_size=(3, 3)))
    from vispe.encodings import PositionGrid, sdpa

    state = enc.prepare(PositionGrid((3, 3), 1))
    q, k, v = (torch.randn(2, 2, 10, 16) for _ in range(3))
    ref = sdpa(q, k, v, enc.bias(q, k, layer=0, state=state))
    torch.testing.assert_close(enc.attend(q, k, v, layer=0, state=state), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["learned", "rope_axial", "irpe", "cpe"])
def test_prepare_runs_once_first_and_its_state_reaches_every_hook(name, monkeypatch):
    torch.manual_seed(0)
    model = _tiny(name).train()
    enc = model.pos_encoding
    calls: list[tuple[str, int]] = []
    prepare, embed_tokens, after_block, attend = enc.prepare, enc.embed_tokens, enc.after_block, enc.attend

    def spy_prepare(grid, device=None):
        state = prepare(grid, device)
        calls.append(("prepare", id(state)))
        return state

    def spy_embed(x, grid, state=None, image=None):
        calls.append(("embed_tokens", id(state)))
        return embed_tokens(x, grid, state, image=image)

    def spy_after(index, x, grid, state=None):
        calls.append(("after_block", id(state)))
        return after_block(index, x, grid, state)

    def spy_attend(q, k, v, **kw):
        calls.append(("attend", id(kw.get("state"))))
        return attend(q, k, v, **kw)

    monkeypatch.setattr(enc, "prepare", spy_prepare)
    monkeypatch.setattr(enc, "embed_tokens", spy_embed)
    monkeypatch.setattr(enc, "after_block", spy_after)
    monkeypatch.setattr(enc, "attend", spy_attend)
    model(torch.randn(2, 3, 32, 32))
    assert calls[0][0] == "prepare" and [c for c, _ in calls].count("prepare") == 1
    assert calls[1][0] == "embed_tokens"
    assert {sid for _, sid in calls} == {calls[0][1]}  # one state object, handed to every hook
    assert [c for c, _ in calls].count("attend") == 2 and [c for c, _ in calls].count("after_block") == 2


def test_grid_indices_any_number_of_axes_and_interpolate_rescale():
    from vispe.encodings import PositionGrid

    g = PositionGrid((2, 3, 4, 5))  # four axes: nothing is specific to 2 or 3
    idx = g.indices()
    assert idx.shape == (120, 4) and idx.max(0).values.tolist() == [1, 2, 3, 4]
    assert idx[1].tolist() == [0, 0, 0, 1]  # row-major: last axis fastest
    r = PositionGrid((8, 12)).indices(rescale_to=(4, 6))
    torch.testing.assert_close(r, PositionGrid((8, 12)).indices() * torch.tensor([0.5, 0.5]))
    assert torch.equal(PositionGrid((4, 6)).indices(rescale_to=(4, 6)), PositionGrid((4, 6)).indices())
    with pytest.raises(ValueError, match="axes"):
        PositionGrid((4, 6)).indices(rescale_to=(2, 3, 4))


def test_rope_family_is_one_class_for_any_number_of_axes():
    """RoPE-Axial / RoPE-Mixed take the number of axes from the training grid; the ``_3d`` names are the same
    classes with video defaults, so a 3D encoding built either way is the same function."""
    from vispe.encodings import EncodingContext, PositionGrid, create_encoding
    from vispe.encodings.rope_vit import RopeAxial, RopeMixed

    assert issubclass(get_encoding_class("rope_axial_3d"), RopeAxial) and issubclass(get_encoding_class("rope_mixed_3d"), RopeMixed)
    grid = PositionGrid((3, 4, 5), 1)
    a3 = create_encoding("rope_axial_3d", EncodingContext(64, 2, 2, grid.shape)).angles(grid, None)
    assert torch.equal(a3, RopeAxial(head_dim=32, grid_size=grid.shape).angles(grid, None))
    torch.manual_seed(0)
    m3 = create_encoding("rope_mixed_3d", EncodingContext(64, 2, 2, grid.shape))
    torch.manual_seed(0)
    mn = RopeMixed(head_dim=32, num_heads=2, depth=2, grid_size=grid.shape)
    assert torch.equal(m3.freqs, mn.freqs) and torch.equal(m3.angles(grid, None), mn.angles(grid, None))

    # four axes: every axis gets a chunk, and each angle is linear in the indices (the relative property)
    g4 = PositionGrid((2, 3, 2, 3))
    for enc in (RopeAxial(head_dim=16, grid_size=g4.shape), RopeMixed(head_dim=16, num_heads=2, depth=1, grid_size=g4.shape)):
        ang = enc.angles(g4, None).reshape(-1, g4.num_patches, 8)[0].reshape(*g4.shape, 8)
        for axis in range(4):
            step = ang.diff(dim=axis)  # one index step along `axis`: the same angle increment at every token
            torch.testing.assert_close(step, step.narrow(axis, 0, 1).expand_as(step), atol=1e-5, rtol=0)
            assert step.abs().sum() > 0  # ... and every axis moves some pair
    assert RopeAxial(head_dim=16, grid_size=g4.shape).sections == (2, 2, 2, 2)
    assert RopeMixed(head_dim=16, num_heads=2, depth=3, grid_size=g4.shape).freqs.shape == (4, 3, 2, 8)

    with pytest.raises(ValueError, match="takes 2-axis grids"):
        RopeAxial(head_dim=16, grid_size=(4, 4)).angles(PositionGrid((2, 4, 4)), None)
    with pytest.raises(ValueError, match="chunk_axes must be a permutation"):
        RopeAxial(head_dim=16, grid_size=(4, 4), chunk_axes=(0, 0))
    with pytest.raises(ValueError, match="summing to P"):
        RopeAxial(head_dim=16, grid_size=(2, 4, 4), sections=(1, 1, 1))
