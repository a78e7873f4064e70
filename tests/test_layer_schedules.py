"""Layer schedules of the rotary family (``nope_layers``, ``rotary_fraction``, ``layer_theta``): one implementation in
:mod:`vispe.encodings.rotary`, checked on every rotary encoding of the registry and in the host models."""
from __future__ import annotations

import itertools

import pytest
import torch

from vispe.encodings import EncodingContext, PositionGrid, create_encoding, get_encoding_class, list_encodings
from vispe.encodings.base import sdpa
from vispe.encodings.rotary import LAYER_SCHEDULE_OPTIONS
from vispe.encodings.spec import format_spec, parse_pos_encoding
from vispe.models import VispeVisionTransformer
from vispe.models.video_llm import VideoLLM
from vispe.models.video_vit import VispeVideoViT

from vispe.encodings.rotary import RotaryEncoding


def _rotary(**filters):
    """The registered rotary encodings themselves (a composition with a rotary part, e.g. a vision tower, is listed
    as rotary too, but takes no schedule options)."""
    return [n for n in list_encodings(kind="rotary", **filters) if issubclass(get_encoding_class(n), RotaryEncoding)]


ROTARY = _rotary()
DEPTH, HEADS, HEAD_DIM = 3, 2, 32


def _grid_size(name: str) -> tuple[int, ...]:
    name = parse_pos_encoding(name)[0]
    return (3, 4) if 2 in get_encoding_class(name).grid_ndims else (2, 3, 3)


def _build(name: str, seed: int = 0, head_dim: int = HEAD_DIM, **options):
    torch.manual_seed(seed)
    ctx = EncodingContext(dim=head_dim * HEADS, num_heads=HEADS, depth=DEPTH, grid_size=_grid_size(name), num_prefix_tokens=1)
    return create_encoding(name, ctx, **options).eval()


def _qkv(name: str, width: int = HEAD_DIM, seed: int = 1):
    n = 1 + int(torch.tensor(_grid_size(name)).prod())
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, HEADS, n, width, generator=g) for _ in range(3)]


def _grid(name: str) -> PositionGrid:
    return PositionGrid(_grid_size(name), 1)


def _supports(option: str) -> list[str]:
    return [n for n in ROTARY if option in get_encoding_class(n).layer_schedules]


def test_every_rotary_encoding_declares_and_takes_the_schedule_options():
    assert ROTARY, "no rotary encodings registered"
    for name in ROTARY:
        cls = get_encoding_class(name)
        assert set(cls.layer_schedules) <= set(LAYER_SCHEDULE_OPTIONS)
        rules = cls.option_rules()
        assert set(LAYER_SCHEDULE_OPTIONS) <= set(rules), name


@pytest.mark.parametrize("name", ROTARY)
def test_defaults_are_bit_identical(name):
    q, k, v = _qkv(name)
    plain, explicit = _build(name), _build(name, nope_layers=None, rotary_fraction=1.0, layer_theta=None)
    for layer in range(DEPTH):
        a = plain.attend(q, k, v, layer=layer, state=plain.prepare(_grid(name)))
        b = explicit.attend(q, k, v, layer=layer, state=explicit.prepare(_grid(name)))
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", _supports("nope_layers"))
def test_nope_layers_give_the_no_position_attention(name):
    q, k, v = _qkv(name)
    plain, enc = _build(name), _build(name, nope_layers=(1,))
    sp, s = plain.prepare(_grid(name)), enc.prepare(_grid(name))
    # the NoPE layer: exactly attention without a position (the `none` encoding's attention)
    none = create_encoding("none")
    assert torch.equal(enc.attend(q, k, v, layer=1, state=s), none.attend(q, k, v, layer=1, state=none.prepare(_grid(name))))
    qr, kr = enc.rotate_qk(q, k, s, 1)
    assert torch.equal(qr, q) and torch.equal(kr, k)
    # the other layers: unchanged, and really rotated
    for layer in (0, 2):
        assert torch.equal(enc.attend(q, k, v, layer=layer, state=s), plain.attend(q, k, v, layer=layer, state=sp))
    q0, k0 = enc.rotate_qk(q, k, s, 0)
    if not torch.equal(q0, q):  # zero-initialised learned rotations start at the identity
        assert not torch.allclose(q0 @ k0.transpose(-1, -2), q @ k.transpose(-1, -2))


def _relative_spread(name: str, q: torch.Tensor, k: torch.Tensor) -> float:
    """Largest spread of ``q_i . k_j`` over lattice pairs at the same grid offset (one q and one k vector everywhere)."""
    logits = (q @ k.transpose(-1, -2))[0, 0, 1:, 1:].detach().double()
    coords = list(itertools.product(*(range(n) for n in _grid_size(name))))
    groups: dict[tuple[int, ...], list[float]] = {}
    for i, a in enumerate(coords):
        for j, b in enumerate(coords):
            groups.setdefault(tuple(x - y for x, y in zip(a, b)), []).append(float(logits[i, j]))
    return max(max(g) - min(g) for g in groups.values())


@pytest.mark.parametrize("name", _supports("rotary_fraction"))
def test_rotary_fraction_rotates_the_first_channels_only(name):
    r = HEAD_DIM // 2
    enc = _build(name, rotary_fraction=0.5)
    s = enc.prepare(_grid(name))
    q, k, _ = _qkv(name)
    qr, kr = enc.rotate_qk(q, k, s, 0)
    # the other channels pass through: their share of every logit is q.k unrotated, whatever the positions
    assert torch.equal(qr[..., r:], q[..., r:]) and torch.equal(kr[..., r:], k[..., r:])
    # the rotated channels are those of the same encoding built for a head r wide (transformers' convention:
    # the frequencies are laid out over the rotated width)
    narrow = _build(name, head_dim=r)
    qn, kn = narrow.rotate_qk(q[..., :r], k[..., :r], narrow.prepare(_grid(name)), 0)
    assert torch.equal(qr[..., :r], qn) and torch.equal(kr[..., :r], kn)
    assert not torch.equal(qr[..., :r], q[..., :r]) or not any(True for _ in enc.parameters())
    # the rotated part keeps the encoding's relative property: one q and one k vector at every token give logits
    # that depend on the grid offset only (LieRE's and Spherical RoPE's non-commuting rotations are not relative: skipped)
    if name.startswith("liere") or name == "spherical_rope":
        return
    one_q, one_k = q[:, :, :1].expand_as(q).contiguous(), k[:, :, :1].expand_as(k).contiguous()
    qr, kr = enc.rotate_qk(one_q, one_k, s, 0)
    rotated = _relative_spread(name, qr[..., :r], kr[..., :r])
    scale = float((qr[..., :r] @ kr[..., :r].transpose(-1, -2)).detach().abs().max())
    assert rotated <= 1e-4 * max(scale, 1.0), (name, rotated)


@pytest.mark.parametrize("name", _supports("layer_theta"))
def test_layer_theta_equals_an_encoding_built_with_that_base(name):
    opt = get_encoding_class(name).layer_theta_option
    thetas = (50.0, 5000.0, 50.0)
    enc = _build(name, layer_theta=thetas)
    s = enc.prepare(_grid(name))
    q, k, v = _qkv(name)
    outs = []
    for layer, theta in enumerate(thetas):
        ref = _build(name, **{opt: theta})
        out = enc.attend(q, k, v, layer=layer, state=s)
        assert torch.equal(out, ref.attend(q, k, v, layer=layer, state=ref.prepare(_grid(name))))
        outs.append(out)
    assert not torch.equal(outs[0], outs[1])  # the bases really differ per layer
    # patch dropout narrows every base's state
    keep = torch.tensor([[0, 2, 5], [1, 3, 4]])
    grid = PositionGrid(_grid_size(name), 1, keep=keep)
    kept = enc.keep_tokens(s, grid)
    q3, k3, v3 = (t[:, :, :4] for t in (q, k, v))
    ref = _build(name, **{opt: 5000.0})
    want = ref.attend(q3, k3, v3, layer=1, state=ref.keep_tokens(ref.prepare(_grid(name)), grid))
    assert torch.equal(enc.attend(q3, k3, v3, layer=1, state=kept), want)


@pytest.mark.parametrize("spec, match", [
    ("rope_axial[nope_layers=(3,)]", r"nope_layers=\(3,\).*depth=3: layer indices 0\.\.2"),
    ("rope_axial[nope_layers=(-4,)]", r"nope_layers=\(-4,\) is not valid.*-3\.\.-1 from the last"),
    ("rope_axial[nope_layers=(1, 1)]", r"nope_layers=\(1, 1\) is not valid.*distinct"),
    ("rope_axial[nope_layers=1.5]", r"nope_layers=1\.5 is not valid"),
    ("rope_axial[layer_theta=(1.0, 2.0, 3.0),coord_shift=0.5]", r"layer_theta=.*coordinate options"),
    ("rope_axial[rotary_fraction=0]", r"rotary_fraction=0 is not valid.*> 0 and <= 1"),
    ("rope_axial[rotary_fraction=1.5]", r"rotary_fraction=1\.5 is not valid"),
    ("rope_axial[rotary_fraction=0.3]", r"rotary_fraction=0\.3.*9 channels.*even"),
    ("rope_axial[rotary_fraction=0.3125]", r"rotated width is 10 of head_dim=32.*divisible by 4"),
    ("rope_axial[layer_theta=(100.0, 10.0)]", r"layer_theta=.*3 values \(depth=3\)"),
    ("rope_axial[layer_theta=(100.0, 0.0, 1.0)]", r"layer_theta=.*is not valid"),
    ("rope_mixed[layer_theta=(1.0, 2.0, 3.0)]", r"rope_mixed: layer_theta=.*supports the layer schedules \['nope_layers', 'rotary_fraction'\]"),
    ("liere[layer_theta=(1.0, 2.0, 3.0)]", r"liere: layer_theta=.*supports the layer schedules"),
])
def test_bad_schedules_are_refused_at_construction(spec, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _build(spec)


def test_negative_nope_layers_count_from_the_last():
    assert _build("rope_axial", nope_layers=(-1,)).layer_schedule.nope_layers == {DEPTH - 1}
    with pytest.raises(ValueError, match="needs the model's depth"):
        create_encoding("rope_axial", head_dim=HEAD_DIM, nope_layers=(-1,))
    # without a model the indices are taken as given
    assert create_encoding("rope_axial", head_dim=HEAD_DIM, nope_layers=(5,)).layer_schedule.nope_layers == {5}


def test_spec_strings_keep_tuple_values():
    name, options = parse_pos_encoding("rope_axial[nope_layers=(1, 2),rotary_fraction=0.5]")
    assert (name, options) == ("rope_axial", {"nope_layers": (1, 2), "rotary_fraction": 0.5})
    assert parse_pos_encoding(format_spec(name, options)) == (name, options)


def _copy_into(dst: torch.nn.Module, src: torch.nn.Module) -> None:
    """The model weights of ``src`` (the encodings' own parameters stay: their shapes follow the rotated width)."""
    weights = {k: v for k, v in src.state_dict().items() if not k.startswith("pos_encoding.")}
    missing, unexpected = dst.load_state_dict(weights, strict=False)
    assert not [m for m in missing if not m.startswith("pos_encoding.")] and not unexpected


@pytest.mark.parametrize("name", _rotary(grid_ndim=2))
def test_image_vit_nope_in_every_layer_is_the_no_position_model(name):
    kw = dict(img_size=32, patch_size=8, embed_dim=64, depth=DEPTH, num_heads=HEADS, num_classes=5)
    nope = VispeVisionTransformer(pos_encoding=f"{name}[nope_layers={tuple(range(DEPTH))!r}]", **kw).eval()
    none = VispeVisionTransformer(pos_encoding="none", **kw).eval()
    _copy_into(none, nope)
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(nope(x), none(x))
    fraction = ",rotary_fraction=0.5" if "rotary_fraction" in get_encoding_class(name).layer_schedules else ""
    partial = VispeVisionTransformer(pos_encoding=f"{name}[nope_layers=(2,){fraction}]", **kw).eval()
    _copy_into(partial, nope)
    if any(p.abs().sum() > 0 for p in partial.pos_encoding.parameters()) or not any(True for _ in partial.pos_encoding.parameters()):
        assert not torch.allclose(partial(x), none(x))  # layers 0 and 1 rotate
    with pytest.raises(ValueError, match="depth=3"):
        VispeVisionTransformer(pos_encoding=f"{name}[nope_layers=(3,)]", **kw)


def test_image_vit_layer_theta_per_block():
    kw = dict(img_size=32, patch_size=8, embed_dim=64, depth=DEPTH, num_heads=HEADS, num_classes=5)
    torch.manual_seed(0)
    model = VispeVisionTransformer(pos_encoding="rope_axial[layer_theta=(10.0,100.0,10.0)]", **kw).eval()
    x = torch.randn(2, 3, 32, 32)
    same = VispeVisionTransformer(pos_encoding="rope_axial[layer_theta=(10.0,10.0,10.0)]", **kw).eval()
    plain = VispeVisionTransformer(pos_encoding="rope_axial[theta=10.0]", **kw).eval()
    _copy_into(same, model)
    _copy_into(plain, model)
    assert torch.equal(same(x), plain(x))  # one base everywhere: the encoding built with that base
    assert not torch.allclose(model(x), plain(x))  # block 1 rotates with base 100


@pytest.mark.parametrize("name", _rotary(grid_ndim=3))
def test_video_vit_nope_in_every_layer_is_the_no_position_model(name):
    kw = dict(img_size=16, patch_size=8, num_frames=4, tubelet_size=2, embed_dim=64, depth=DEPTH, num_heads=HEADS, num_classes=3)
    nope = VispeVideoViT(pos_encoding=f"{name}[nope_layers={tuple(range(DEPTH))!r}]", **kw).eval()
    none = VispeVideoViT(pos_encoding="none", **kw).eval()
    _copy_into(none, nope)
    x = torch.randn(2, 3, 4, 16, 16)
    assert torch.equal(nope(x), none(x))
    fraction = "rotary_fraction=0.75," if "rotary_fraction" in get_encoding_class(name).layer_schedules else ""
    partial = VispeVideoViT(pos_encoding=f"{name}[{fraction}nope_layers=(0,)]", **kw).eval()
    _copy_into(partial, nope)
    if any(p.abs().sum() > 0 for p in partial.pos_encoding.parameters()) or not any(True for _ in partial.pos_encoding.parameters()):
        assert not torch.allclose(partial(x), none(x))  # layers 1 and 2 rotate


@pytest.mark.parametrize("name", ["mrope", "mrope_interleave", "mhrope", "vrope", "videorope", "hope", "v2pe", "rope_1d", "qwen3vl"])
def test_multimodal_tables_follow_the_schedule(name):
    """The video-LLM's path (positions -> table -> rotate_qk): per layer, the encoding built with that layer's base."""
    from vispe.positions import Text, Visual, build_positions

    pos, _ = build_positions(name, [Text(3), Visual(2, 2, 3), Text(2)])
    enc = _build(name, layer_theta=(100.0, 10000.0, 100.0), nope_layers=(2,), rotary_fraction=0.5)
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, HEADS, pos.shape[-1], HEAD_DIM, generator=g) for _ in range(2))
    table = enc.table_from_positions(pos)
    for layer, theta in enumerate((100.0, 10000.0)):
        ref = _build(name, theta=theta, rotary_fraction=0.5)
        want = ref.rotate_qk(q, k, ref.table_from_positions(pos), layer)
        got = enc.rotate_qk(q, k, table, layer)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    q2, k2 = enc.rotate_qk(q, k, table, 2)  # the NoPE layer
    assert q2 is q and k2 is k


def test_video_llm_partial_rotary_and_per_layer_schedules():
    kw = dict(vocab_size=32, dim=64, depth=2, num_heads=2)
    ids = torch.randint(0, 32, (2, 7))
    torch.manual_seed(0)
    partial = VideoLLM(pos_scheme="mrope[rotary_fraction=0.5]", **kw).eval()
    assert partial.pos_encoding.layer_schedule.rotary_dim == 16
    logits = partial(input_ids=ids).logits
    assert torch.isfinite(logits).all()
    # the decoder attends through the encoding with its layer index: NoPE in every layer makes the logits independent
    # of the position ids; NoPE in one layer leaves the other rotating
    L = ids.shape[1]
    positions = torch.arange(L).expand(3, 2, L)
    scrambled = torch.stack([torch.randperm(L) for _ in range(3)])[:, None].expand(3, 2, L)
    for nope, depends in (((0, 1), False), ((1,), True)):
        torch.manual_seed(0)
        model = VideoLLM(pos_scheme=f"mrope[nope_layers={nope!r}]", **kw).eval()
        a, b = model(input_ids=ids, position_ids=positions).logits, model(input_ids=ids, position_ids=scrambled).logits
        assert torch.allclose(a, b, atol=1e-5) is not depends, nope


@pytest.mark.parametrize("spec", ["rope_axial[nope_layers=(1,),rotary_fraction=0.5,layer_theta=(10.0,100.0,10.0)]",
                                  "comrope_ap[nope_layers=(0,),rotary_fraction=0.5]"])
@pytest.mark.slow
def test_schedules_compile_whole(spec):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    kw = dict(img_size=32, patch_size=8, embed_dim=64, depth=DEPTH, num_heads=HEADS, num_classes=5)
    model = VispeVisionTransformer(pos_encoding=spec, **kw).train()
    x = torch.randn(2, 3, 32, 32)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    out = compiled(x)
    out.square().mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    ref = model(x)
    ref.square().mean().backward()
    assert counter.frame_count == 1
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4)
    for n, p in model.named_parameters():
        if n in grads:
            assert torch.allclose(grads[n], p.grad, atol=1e-5, rtol=1e-4), n
    torch._dynamo.reset()
