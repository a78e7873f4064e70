"""The conformance suite: what every registered encoding must do, parametrised over the registry's records (in the
manner of timm's tests/test_models.py), so an encoding registered later is checked with no list to edit.

For every record: it builds from its name with its defaults; a host model trains with it at the training grid, a
larger one and a non-square one, with finite gradients that reach every encoding parameter; state first built under
inference mode serves a later training step; a step under bf16 autocast stays close to float32 (backward inside or
outside autocast); a step with timm's patch dropout trains (or the host refuses it, naming the encoding); a
state_dict round trip rebuilds the same model; a bad option is refused at construction, naming the option.
Per-encoding files keep only what is particular to an encoding (its formula, non-default options, checkpoints).
"""
from __future__ import annotations

import math

import pytest
import torch
from encoding_hosts import MULTIMODAL, check_grads, host_model, is_image, step_loss, three_grids

from vispe._checks import Bool, Choice, Int, Real
from vispe.encodings import EncodingContext, create_encoding, encoding_records, get_record

NAMES = [r.name for r in encoding_records()]


def _context(name: str) -> EncodingContext:
    ndims = get_record(name).grid_ndim
    grid = (4, 4) if 2 in ndims else ((2, 4, 4) if 3 in ndims else (8,))
    return EncodingContext(dim=64, num_heads=4, depth=2, grid_size=grid, patch_size=(4, 4))


@pytest.mark.parametrize("name", NAMES)
def test_builds_from_its_name_with_defaults(name):
    record = get_record(name)
    enc = create_encoding(name, _context(name))
    assert type(enc) is record.cls and enc.registry_name == name
    for option, value in record.defaults.items():  # a preset's defaults reach the built module unless the host sets them
        if option not in _context(name).as_kwargs():
            assert getattr(enc, option) == value
    assert all(torch.isfinite(p).all() for p in enc.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_trains_at_train_larger_and_nonsquare_grids(name):
    torch.manual_seed(0)
    model = host_model(name)
    for shape in three_grids(name):
        model.zero_grad()
        out = model(torch.randn(*shape))
        assert out.shape == (shape[0], 5) and torch.isfinite(out).all()
        out.square().mean().backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)
        check_grads(model, f"at input {shape}")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(*three_grids(name)[2]))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


@pytest.mark.parametrize("name", NAMES)
def test_validate_under_inference_mode_then_train(name):
    """State first built under inference_mode / no_grad (validation) must serve a later training step, at the training
    grid (cached tables reused) and at another one (resampled / rebuilt tables)."""
    torch.manual_seed(0)
    model = host_model(name)
    for shape in three_grids(name)[:2]:
        x = torch.randn(*shape)
        model.eval()
        with torch.inference_mode():
            model(x)
        with torch.no_grad():
            model(x)
        model.train()
        model.zero_grad()
        model(x).logsumexp(-1).sum().backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("backward_inside", [False, True], ids=["backward_outside", "backward_inside"])
@pytest.mark.parametrize("name", NAMES)
def test_trains_a_step_under_bf16_autocast(name, backward_inside):
    model, loss_fn = step_loss(name)
    model.train()
    with torch.no_grad():
        ref = loss_fn().item()  # float32 reference on the same weights and inputs
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn()
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    assert torch.isfinite(loss)
    # bf16 matmuls change the loss a little, not its size: a wrong-dtype path would not stay this close
    assert abs(loss.item() - ref) <= 0.05 * max(1.0, abs(ref)), (loss.item(), ref)
    check_grads(model, "under autocast")


@pytest.mark.parametrize("name", NAMES)
def test_trains_with_patch_dropout(name):
    torch.manual_seed(0)
    if not get_record(name).cls.supports_token_dropout:
        with pytest.raises(ValueError, match=f"{name}.*patch_drop_rate=0"):
            host_model(name, patch_drop_rate=0.5)
        return
    model = host_model(name, patch_drop_rate=0.5).train()
    shape = three_grids(name)[0]
    out = model(torch.randn(*shape))
    assert out.shape == (shape[0], 5) and torch.isfinite(out).all()
    out.logsumexp(-1).sum().backward()
    check_grads(model, "with patch dropout")
    model.eval()  # no dropout in eval
    assert model(torch.randn(*shape)).shape == (shape[0], 5)


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_round_trip(name):
    torch.manual_seed(0)
    model = host_model(name).eval()
    torch.manual_seed(1)
    other = host_model(name).eval()
    other.load_state_dict(model.state_dict(), strict=True)
    x = torch.randn(*three_grids(name)[2])
    with torch.no_grad():
        torch.testing.assert_close(other(x), model(x), rtol=0, atol=0)
    assert model.state_dict().keys() == other.state_dict().keys()


def _bad_value(rule):
    if isinstance(rule, Bool):
        return "no"
    if isinstance(rule, Choice):
        return "not-a-choice"
    if isinstance(rule, (Real, Int)):
        return math.nan
    return None


@pytest.mark.parametrize("name", NAMES)
def test_bad_options_are_refused_naming_the_option(name):
    ctx = _context(name)
    with pytest.raises(TypeError, match=rf"encoding '{name}' got unknown option\(s\) \['not_an_option'\]; valid options: "):
        create_encoding(name, ctx, not_an_option=1)
    own = {k: r for k, r in get_record(name).cls.option_rules().items() if k not in ctx.as_kwargs()}
    checked = [(k, _bad_value(r)) for k, r in sorted(own.items()) if _bad_value(r) is not None]
    for option, value in checked[:2]:  # the exhaustive walk is tests/test_bad_input_options.py
        with pytest.raises((TypeError, ValueError), match=rf"{option}"):
            create_encoding(name, ctx, **{option: value})


def test_every_record_is_hosted():
    """Each record runs in a host above: the image ViT (2D grids), the video ViT (3D only) or the video-LLM (schemes)."""
    assert all(is_image(n) or 3 in get_record(n).grid_ndim for n in NAMES)


@pytest.mark.parametrize("name", [n for n in NAMES if n not in MULTIMODAL])
def test_trains_a_step_in_pure_bf16(name):
    """A model cast whole to bfloat16 (``model.to(torch.bfloat16)``, the GPU speed plan's ``bf16``) runs forward and
    backward: an encoding that computes a table in float32 must hand the blocks tensors in the weights' dtype (a float32
    table into a bf16 Linear fails)."""
    torch.manual_seed(0)
    model = host_model(name).to(torch.bfloat16)
    x = torch.randn(*three_grids(name)[0]).to(torch.bfloat16)
    logits = model(x)
    assert logits.dtype == torch.bfloat16
    torch.nn.functional.cross_entropy(logits.float(), torch.zeros(len(x), dtype=torch.long)).backward()
    for n, p in model.named_parameters():
        if p.grad is not None:
            assert torch.isfinite(p.grad.float()).all(), f"non-finite gradient in {n}"
