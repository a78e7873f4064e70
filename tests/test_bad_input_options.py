"""Bad encoding options are refused at construction, naming the option (issue 32, categories ``options`` and ``faults``).

The option walk reads ``vispe.list_encodings()`` at collection time, so an encoding registered later is walked
too: every constructor option must have a rule (declared in ``option_checks`` or implied by a ``float`` / ``int``
/ ``bool`` / ``str`` annotation), and every bad value of each kind that the rule refuses (negative, zero, NaN,
inf, wrong type, None) must raise at construction -- through the class, through ``create_encoding`` and (for a
sample) through a model's ``pos_encoding`` -- with a message that names the option and the value. The positive
side: every encoding builds with its defaults and with the edge values its rules allow, and its hooks then give
finite outputs on finite inputs.
"""
from __future__ import annotations

import inspect

import pytest
import timm
import torch
import torch.nn as nn

import vispe
from vispe._checks import Bool, Choice, Int, OptionCheck, Real, Seq, Str
from vispe.encodings import EncodingContext, create_encoding, get_encoding_class
from vispe.encodings.base import CONTEXT_OPTION_CHECKS
from vispe.encodings.grid import PositionGrid
from vispe.encodings.loope import FiniteBatchNorm2d

from bad_input import expect_clear_error

NAN, INF = float("nan"), float("inf")


def _ctx(name: str) -> EncodingContext:
    ndims = get_encoding_class(name).grid_ndims
    grid = (4, 4) if 2 in ndims else ((2, 4, 4) if 3 in ndims else (8,))
    return EncodingContext(dim=64, num_heads=4, depth=2, grid_size=grid, patch_size=(4, 4))


def _own_options(cls: type) -> list[inspect.Parameter]:
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _class_args(name: str) -> dict:
    """The context fields the class takes (what create_encoding would pass)."""
    cls = get_encoding_class(name)
    accepted = {p.name for p in _own_options(cls)}
    return {k: v for k, v in _ctx(name).as_kwargs().items() if k in accepted}


def _bad_values(rule: OptionCheck, default: object) -> list[tuple[str, object]]:
    """Candidate bad values by kind; the walk keeps those the rule refuses."""
    if isinstance(rule, Seq) or (isinstance(default, (tuple, list)) and not isinstance(rule, (Real, Int))):
        base = list(default) if isinstance(default, (tuple, list)) and default else [1]
        out = [("wrongtype", "4x4"), ("none", None)]
        for kind, v in (("negative", -1), ("zero", 0), ("nan", NAN), ("inf", INF)):
            out.append((kind, tuple([v] + base[1:])))
        return out
    if isinstance(rule, (Bool, Str, Choice)):
        return [("wrongtype", "no" if isinstance(rule, Bool) else 1), ("wrongtype_int", 1 if isinstance(rule, Bool) else 2.5),
                ("none", None), ("unknown", "not-a-choice")]
    return [("negative", -1), ("zero", 0), ("nan", NAN), ("inf", INF), ("wrongtype", "1"), ("none", None),
            ("fraction", 0.5), ("negative_inf", -INF), ("bool", True)]


def _walk_cases():
    cases = []
    for name in vispe.list_encodings():
        cls = get_encoding_class(name)
        rules = cls.option_rules()
        args = _class_args(name)
        for p in _own_options(cls):
            rule = rules.get(p.name)
            if rule is None:
                continue  # reported by test_every_option_has_a_rule
            default = args.get(p.name, p.default if p.default is not inspect.Parameter.empty else None)
            for kind, value in _bad_values(rule, default):
                if not rule.is_valid(value):
                    cases.append(pytest.param(name, p.name, value, id=f"options-walk-{name}-{p.name}-{kind}"))
    return cases


@pytest.mark.parametrize("name", [pytest.param(n, id=f"options-rule-{n}") for n in vispe.list_encodings()])
def test_options_every_option_has_a_rule(name):
    cls = get_encoding_class(name)
    rules = cls.option_rules()
    missing = [p.name for p in _own_options(cls) if p.name not in rules]
    assert not missing, (
        f"{name}: options {missing} have no rule; declare them in {cls.__name__}.option_checks (vispe._checks) "
        f"(Real, Int, Bool, Choice, Seq, ..., or Satisfies(predicate, description)) or annotate them float/int/bool/str"
    )


@pytest.mark.parametrize("name,option,value", _walk_cases())
def test_options_walk_refused_at_construction(name, option, value):
    cls = get_encoding_class(name)
    args = {**_class_args(name), option: value}
    needles = [option, repr(value)]
    expect_clear_error(lambda: cls(**args), needles, (TypeError, ValueError))  # the class itself
    if option not in CONTEXT_OPTION_CHECKS:
        expect_clear_error(lambda: create_encoding(name, _ctx(name), **{option: value}), needles, (TypeError, ValueError))


# ---------------------------------------------------------------------------------------------
# positive side: defaults and edge values build, and give finite outputs on finite inputs
# ---------------------------------------------------------------------------------------------
def _run_hooks(enc: nn.Module, ctx: EncodingContext) -> list[torch.Tensor]:
    torch.manual_seed(0)
    grid = PositionGrid(tuple(ctx.grid_size), ctx.num_prefix_tokens)
    L = ctx.num_prefix_tokens + grid.num_patches
    img = torch.randn(2, ctx.in_chans, *(g * p for g, p in zip(ctx.grid_size[-2:], ctx.patch_size)))
    state = enc.prepare(grid, None)
    x = enc.embed_tokens(torch.randn(2, L, ctx.dim), grid, state, img)
    x = enc.after_block(0, x, grid, state)
    q, k, v = (torch.randn(2, ctx.num_heads, L, ctx.head_dim) for _ in range(3))
    return [x, enc.attend(q, k, v, layer=0, state=state)]


def _edge_values(rule: OptionCheck) -> list[object]:
    """Valid values at the edge of a rule (a closed bound itself, just inside an open one)."""
    if isinstance(rule, Real) and rule.low is not None:
        edges = [rule.low + (1e-3 if rule.low_open else 0.0)]
        if rule.high is not None:
            edges.append(rule.high * (1 - 1e-3) if rule.high_open else rule.high)
        else:
            edges.append(1e30)  # no upper bound: a huge finite value must still give a finite model
        return edges
    if isinstance(rule, Int) and rule.low is not None and not rule.odd and not rule.multiple_of:
        return [max(rule.low, 0)]
    if isinstance(rule, Bool):
        return [True, False]
    if isinstance(rule, Choice):
        return list(rule.choices)
    return []


def _edge_cases():
    cases = []
    for name in vispe.list_encodings():
        cls = get_encoding_class(name)
        for option, rule in cls.option_rules().items():
            if option in CONTEXT_OPTION_CHECKS:
                continue
            for value in _edge_values(rule):
                cases.append(pytest.param(name, option, value, id=f"{name}-{option}={value!r}"))
    return cases


@pytest.mark.parametrize("name", vispe.list_encodings())
def test_every_encoding_builds_with_defaults_and_gives_finite_outputs(name):
    enc = create_encoding(name, _ctx(name))
    for out in _run_hooks(enc, _ctx(name)):
        assert torch.isfinite(out).all(), name


# edge values that are valid for the option's rule but need a partner option (documented here, not hidden)
_EDGE_NEEDS = {
    ("rope_dinov3", "min_period"): {"max_period": 1e30},
    ("rope_dinov3", "max_period"): {"min_period": 1e-3},
    ("rope_dinov3_3d", "min_period"): {"max_period": 1e30},
    ("rope_dinov3_3d", "max_period"): {"min_period": 1e-3},
}


@pytest.mark.parametrize("name,option,value", _edge_cases())
def test_valid_edge_values_build_and_stay_finite(name, option, value):
    extra = dict(_EDGE_NEEDS.get((name, option)) or {})
    ctx = _ctx(name)
    try:
        enc = create_encoding(name, ctx, **{option: value}, **extra)
    except ValueError as e:
        # a value the option's own rule allows may still clash with the model (e.g. a block size that does not
        # divide head_dim, a mode/sides combination): that must be an early error naming the option
        assert option in str(e), f"{name}: {option}={value!r} refused without naming it: {e}"
        return
    for out in _run_hooks(enc, ctx):
        assert torch.isfinite(out).all(), f"{name} with {option}={value!r} gives non-finite outputs"


# ---------------------------------------------------------------------------------------------
# the battery: the issue's cases and their neighbours, one id each (category "options")
# ---------------------------------------------------------------------------------------------
_CTX2 = EncodingContext(64, 4, 2, (4, 4), patch_size=(4, 4))
_CTX3 = EncodingContext(64, 4, 2, (2, 4, 4), patch_size=(4, 4))

OPTION_CASES = [
    # (id, encoding, context, options, needles)
    ("rope_axial-theta-zero", "rope_axial", _CTX2, {"theta": 0}, ["theta", "0"]),
    ("rope_axial-theta-negative", "rope_axial", _CTX2, {"theta": -100.0}, ["theta", "-100.0"]),
    ("rope_axial-theta-nan", "rope_axial", _CTX2, {"theta": NAN}, ["theta", "nan"]),
    ("rope_axial-theta-inf", "rope_axial", _CTX2, {"theta": INF}, ["theta", "inf"]),
    ("rope_axial-theta-string", "rope_axial", _CTX2, {"theta": "100"}, ["theta", "'100'"]),
    ("rope_mixed-theta-string", "rope_mixed", _CTX2, {"theta": "100"}, ["theta", "'100'"]),
    ("rope_mixed-theta-zero", "rope_mixed", _CTX2, {"theta": 0.0}, ["theta", "0.0"]),
    ("rope_mixed-theta-nan", "rope_mixed", _CTX2, {"theta": NAN}, ["theta", "nan"]),
    ("rope_mixed-temporal_theta-negative", "rope_mixed_3d", _CTX3, {"temporal_theta": -1.0}, ["temporal_theta", "-1.0"]),
    ("rope_axial_3d-coord_jitter-below-one", "rope_axial_3d", _CTX3, {"coord_jitter": 0.5}, ["coord_jitter", "0.5"]),
    ("rope_axial-random_positions-nan", "rope_axial", _CTX2, {"random_positions": NAN}, ["random_positions", "nan"]),
    ("rope_axial-extrapolation-unknown", "rope_axial", _CTX2, {"extrapolation": "sideways"}, ["extrapolation", "sideways", "ntk"]),
    ("rope_axial-chunk_axes-repeated", "rope_axial", _CTX2, {"chunk_axes": (0, 0)}, ["chunk_axes", "(0, 0)"]),
    ("rope_dinov3-base-nan", "rope_dinov3", _CTX2, {"base": NAN}, ["base", "nan"]),
    ("rope_dinov3-jitter_coords-string", "rope_dinov3", _CTX2, {"jitter_coords": "2"}, ["jitter_coords", "'2'"]),
    ("lff-gamma-nan", "lff", _CTX2, {"gamma": NAN}, ["gamma", "nan"]),
    ("lff-gamma-inf", "lff", _CTX2, {"gamma": INF}, ["gamma", "inf"]),
    ("lff-hidden_dim-zero", "lff", _CTX2, {"hidden_dim": 0}, ["hidden_dim", "0"]),
    ("lff-fourier_dim-zero", "lff", _CTX2, {"fourier_dim": 0}, ["fourier_dim", "0"]),
    ("lff-fourier_dim-odd", "lff", _CTX2, {"fourier_dim": 33}, ["fourier_dim", "33"]),
    ("lff-groups-float", "lff", _CTX2, {"groups": 2.0}, ["groups", "2.0"]),
    ("irpe-init_std-negative", "irpe", _CTX2, {"init_std": -0.02}, ["init_std", "-0.02"]),
    ("irpe-shared_head-string", "irpe", _CTX2, {"shared_head": "no"}, ["shared_head", "'no'"]),
    ("irpe-shared_head-int", "irpe", _CTX2, {"shared_head": 0}, ["shared_head", "0"]),
    ("irpe-ratio-nan", "irpe", _CTX2, {"ratio": NAN}, ["ratio", "nan"]),
    ("irpe-layers-negative", "irpe", _CTX2, {"layers": (-1,)}, ["layers", "(-1,)"]),
    ("irpe-sides-int", "irpe", _CTX2, {"sides": 3}, ["sides", "3"]),
    ("fire-mlp_width-zero", "fire", _CTX2, {"mlp_width": 0}, ["mlp_width", "0"]),
    ("fire-init_c-nan", "fire", _CTX2, {"init_c": NAN}, ["init_c", "nan"]),
    ("fire-share_layers-string", "fire", _CTX2, {"share_layers": "yes"}, ["share_layers", "'yes'"]),
    ("alibi_2d-distance-unknown", "alibi_2d", _CTX2, {"distance": "cosine"}, ["distance", "cosine", "euclidean"]),
    ("cpe-kernel_size-even", "cpe", _CTX2, {"kernel_size": 4}, ["kernel_size", "4"]),
    ("cpe-kernel_size-zero", "cpe", _CTX2, {"kernel_size": 0}, ["kernel_size", "0"]),
    ("learned-init_std-negative", "learned", _CTX2, {"init_std": -1.0}, ["init_std", "-1.0"]),
    ("learned-interpolation-unknown", "learned", _CTX2, {"interpolation": "cubic"}, ["interpolation", "cubic", "bicubic"]),
    ("sincos2d-temperature-zero", "sincos2d", _CTX2, {"temperature": 0}, ["temperature", "0"]),
    ("sincos3d-temperature-nan", "sincos3d", _CTX3, {"temperature": NAN}, ["temperature", "nan"]),
    ("loope-temperature-negative", "loope", _CTX2, {"temperature": -10.0}, ["temperature", "-10.0"]),
    ("loope-offset-string", "loope", _CTX2, {"offset": "false"}, ["offset", "'false'"]),
    ("comrope_ap-sigma-negative", "comrope_ap", _CTX2, {"sigma": -0.1}, ["sigma", "-0.1"]),
    ("comrope_ap-block_size-one", "comrope_ap", _CTX2, {"block_size": 1}, ["block_size", "1"]),
    ("comrope_ld-init_std-inf", "comrope_ld", _CTX2, {"init_std": INF}, ["init_std", "inf"]),
    ("liere-init_range-nan", "liere", _CTX2, {"init_range": NAN}, ["init_range", "nan"]),
    ("liere-block_size-zero", "liere", _CTX2, {"block_size": 0}, ["block_size", "0"]),
    ("liere-per_head-string", "liere", _CTX2, {"per_head": "True"}, ["per_head", "'True'"]),
    ("hope-theta-negative", "hope", _CTX3, {"theta": -1.0}, ["theta", "-1.0"]),
    ("hope-temporal_pairs-negative", "hope", _CTX3, {"temporal_pairs": -2}, ["temporal_pairs", "-2"]),
    ("mrope-mrope_section-negative", "mrope", _CTX3, {"mrope_section": [-1, 5, 4]}, ["mrope_section", "-1"]),
    ("mrope-layout-unknown", "mrope", _CTX3, {"layout": "rotated"}, ["layout", "rotated", "half"]),
    ("v2pe-theta-nan", "v2pe", _CTX3, {"theta": NAN}, ["theta", "nan"]),
]


@pytest.mark.parametrize("name,ctx,opts,needles", [pytest.param(*c[1:], id=f"options-{c[0]}") for c in OPTION_CASES])
def test_options_battery(name, ctx, opts, needles):
    expect_clear_error(lambda: create_encoding(name, ctx, **opts), needles, (TypeError, ValueError))
    spec = {"name": name, **opts}  # the same options through the spec mapping a model takes
    expect_clear_error(lambda: create_encoding(spec, ctx), needles, (TypeError, ValueError))


CONTEXT_CASES = [
    ("num_heads-zero", dict(dim=64, num_heads=0, depth=2, grid_size=(4, 4)), ["num_heads", "0"]),
    ("num_heads-negative", dict(dim=64, num_heads=-4, depth=2, grid_size=(4, 4)), ["num_heads", "-4"]),
    ("dim-zero", dict(dim=0, num_heads=4, depth=2, grid_size=(4, 4)), ["dim", "0"]),
    ("dim-not-divisible", dict(dim=66, num_heads=4, depth=2, grid_size=(4, 4)), ["dim=66", "num_heads=4"]),
    ("depth-negative", dict(dim=64, num_heads=4, depth=-1, grid_size=(4, 4)), ["depth", "-1"]),
    ("depth-float", dict(dim=64, num_heads=4, depth=2.0, grid_size=(4, 4)), ["depth", "2.0"]),
    ("grid_size-zero", dict(dim=64, num_heads=4, depth=2, grid_size=(0, 4)), ["grid_size", "(0, 4)"]),
    ("grid_size-empty", dict(dim=64, num_heads=4, depth=2, grid_size=()), ["grid_size", "()"]),
    ("num_prefix_tokens-negative", dict(dim=64, num_heads=4, depth=2, grid_size=(4, 4), num_prefix_tokens=-1), ["num_prefix_tokens", "-1"]),
    ("patch_size-zero", dict(dim=64, num_heads=4, depth=2, grid_size=(4, 4), patch_size=(0, 4)), ["patch_size", "(0, 4)"]),
]


@pytest.mark.parametrize("kwargs,needles", [pytest.param(c[1], c[2], id=f"options-context-{c[0]}") for c in CONTEXT_CASES])
def test_options_context_fields(kwargs, needles):
    expect_clear_error(lambda: EncodingContext(**kwargs), needles, (TypeError, ValueError))


MODEL_CASES = [
    ("rope_axial-theta-nan", {"name": "rope_axial", "theta": NAN}, {}, ["theta", "nan"]),
    ("rope_mixed-theta-spec-string", "rope_mixed[theta=-1]", {}, ["theta", "-1"]),
    ("lff-hidden_dim-zero", {"name": "lff", "hidden_dim": 0}, {}, ["hidden_dim", "0"]),
    ("irpe-shared_head-string", {"name": "irpe", "shared_head": "no"}, {}, ["shared_head", "'no'"]),
    ("num_heads-zero", "rope_axial", {"num_heads": 0}, ["num_heads", "0"]),
]


@pytest.mark.parametrize("spec,model_kw,needles", [pytest.param(*c[1:], id=f"options-model-{c[0]}") for c in MODEL_CASES])
def test_options_through_a_model(spec, model_kw, needles):
    expect_clear_error(
        lambda: timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding=spec, depth=1, **model_kw), needles,
        (TypeError, ValueError),
    )


# ---------------------------------------------------------------------------------------------
# faults: one bad sample does not poison LOOPE's BatchNorm (category "faults")
# ---------------------------------------------------------------------------------------------
def _loope_pair():
    torch.manual_seed(0)
    enc = create_encoding("loope", EncodingContext(32, 2, 1, (4, 4), patch_size=(4, 4)))
    return enc, PositionGrid((4, 4), 1)


def test_faults_loope_nan_pixel_leaves_other_samples_and_running_stats_clean():
    enc, grid = _loope_pair()
    twin = create_encoding("loope", EncodingContext(32, 2, 1, (4, 4), patch_size=(4, 4)))
    twin.load_state_dict(enc.state_dict())
    enc.train(), twin.train()
    img = torch.randn(4, 3, 16, 16)
    bad = img.clone()
    bad[2, 1, 5, 7] = NAN  # one pixel of one sample
    x = torch.zeros(4, 17, 32)
    out = enc.embed_tokens(x, grid, None, bad)
    keep = [0, 1, 3]
    ref = twin.embed_tokens(x[keep], grid, None, img[keep])  # the batch without the bad sample
    assert torch.isfinite(out[keep]).all() and not torch.isfinite(out[2]).all()
    torch.testing.assert_close(out[keep], ref, rtol=1e-5, atol=1e-5)
    bn, bn_ref = enc.context.norm, twin.context.norm
    assert torch.isfinite(bn.running_mean).all() and torch.isfinite(bn.running_var).all()
    torch.testing.assert_close(bn.running_mean, bn_ref.running_mean)
    torch.testing.assert_close(bn.running_var, bn_ref.running_var)
    enc.eval()
    assert torch.isfinite(enc.embed_tokens(x, grid, None, img)).all()  # later clean evaluation batches
    ev = enc.embed_tokens(x, grid, None, bad)  # in evaluation a bad sample touches only itself
    assert torch.isfinite(ev[keep]).all() and not torch.isfinite(ev[2]).all()


@pytest.mark.xfail(strict=True, reason="the context CNN's weight gradients sum input x grad over the batch: the bad sample's NaN "
                   "pixels times its zero gradient are NaN (0 * NaN) even when the loss leaves it out; only the forward "
                   "pass and the BatchNorm state are protected")
def test_faults_loope_nan_sample_gives_finite_gradients_to_a_loss_that_skips_it():
    enc, grid = _loope_pair()
    enc.train()
    img = torch.randn(3, 3, 16, 16)
    img[1, 0, 0, 0] = NAN
    out = enc.embed_tokens(torch.zeros(3, 17, 32), grid, None, img)
    out[[0, 2]].square().sum().backward()  # e.g. a loss that masks the non-finite sample
    grads = [p.grad for p in enc.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_faults_loope_all_bad_batch_updates_nothing():
    enc, grid = _loope_pair()
    enc.train()
    bn = enc.context.norm
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    enc.embed_tokens(torch.zeros(2, 17, 32), grid, None, torch.full((2, 3, 16, 16), INF))
    for k, v in bn.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("momentum", [0.1, None])
def test_finite_batchnorm_is_batchnorm_on_clean_batches(momentum):
    torch.manual_seed(0)
    ours, ref = FiniteBatchNorm2d(3, momentum=momentum), nn.BatchNorm2d(3, momentum=momentum)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 2), ref.bias.uniform_(-1, 1)
    ours.load_state_dict(ref.state_dict())
    for _ in range(3):
        x = torch.randn(5, 3, 4, 6) * 3 + 1
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = ours(xa), ref(xb)
        torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-5)
        ya.square().sum().backward(), yb.square().sum().backward()
        torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-4, atol=1e-4)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[k], v, rtol=1e-5, atol=1e-6)
    ours.eval(), ref.eval()
    x = torch.randn(2, 3, 4, 6)
    torch.testing.assert_close(ours(x), ref(x))
