"""Golden-gate N-D RoPE: the released wave vectors and rotation, directions spread uniformly over the sphere,
offset-only logits on 2D and 3D grids, the frequency ladder, ViT / video ViT training steps, bf16, patch dropout,
bad options."""
from __future__ import annotations

import math

import pytest
import timm
import torch
from rotary_checks import check_vit_trains, shifted_block_logits

import vispe  # noqa: F401  (registers the models)
from vispe.encodings import EncodingContext, PositionGrid, create_encoding
from vispe.encodings.golden_rope import generalized_golden_ratio, golden_directions, log_frequency_ladder
from vispe.models.video_vit import VispeVideoViT


def _golden(grid=(3, 4), heads=2, head_dim=8, prefix=0, spec="golden_rope", **kw):
    ctx = EncodingContext(dim=heads * head_dim, num_heads=heads, depth=1, grid_size=tuple(grid), num_prefix_tokens=prefix)
    return create_encoding(spec, ctx, **kw)


# golden values: lucidrains/vit-pytorch at commit 69d24fe9e3024c0d4b02761123b8583a24ebed1e,
# vit_pytorch/vit_nd_rotary.py, GoldenGateRoPENd(dim_pos, heads=2, dim_head=8).freqs (H, P, dim_pos), run with this
# repository's torch
_RELEASED_FREQS_2D = [[[0.968979001045227, 0.2471429854631424], [0.48693010210990906, -21.53884506225586],
                       [-348.9027099609375, 306.1212463378906], [-9621.3271484375, -2725.814208984375]],
                      [[0.5892423391342163, 0.807956337928772], [7.28519344329834, -20.275230407714844],
                       [-112.38955688476562, 450.346435546875], [-9965.04296875, 835.4156494140625]]]
_RELEASED_FREQS_3D = [[[0.8928682208061218, 0.4334051012992859, 0.12225543707609177],
                       [5.473481178283691, -6.2887678146362305, -19.865835189819336],
                       [-21.935361862182617, -456.90789794921875, 78.7231216430664],
                       [-5204.98583984375, 4210.02197265625, -7428.5830078125]],
                      [[-0.8625499606132507, -0.24530154466629028, 0.44253215193748474],
                       [12.149297714233398, -17.163217544555664, -4.688023090362549],
                       [221.79246520996094, 183.17559814453125, 364.2775573730469],
                       [3012.7822265625, -7548.0078125, -5826.724609375]]]
# the same with rope_min_freq=0.5, rope_max_freq=4, rope_p_zero_freqs=0.25, and forward(q, pos) on a (2, 3) grid,
# q = sin(arange(96)).reshape(1, 2, 6, 8), every 7th value of the output
_RELEASED_ZERO_FRAC = [[[0.0, 0.0], [0.011300644837319851, -0.49987226724624634], [-1.0630478858947754, 0.932699978351593],
                        [-3.8485307693481445, -1.0903257131576538]],
                       [[0.0, 0.0], [0.16907434165477753, -0.4705463647842407], [-0.34243208169937134, 1.3721297979354858],
                        [-3.9860172271728516, 0.3341662585735321]]]
_RELEASED_ROTATED = [0.0, 0.6569865942001343, 0.15309783816337585, 1.2610821723937988, 0.2709057927131653,
                     -1.0353281497955322, -1.2853779792785645, -0.9537526369094849, -0.5215510129928589,
                     0.36693665385246277, -0.7238759398460388, 0.8713876008987427, 0.7331902980804443,
                     -0.2240445762872696]


def _close(got, want, rel=2e-5):
    # 2e-5: the released code stops the fixed-point iteration for the generalised golden ratio after 10 steps (for
    # n = 2 3.7e-8 from the root vispe converges to), which moves the directions by up to ~6e-6 relative
    want = torch.tensor(want)
    return ((got - want).abs() <= rel * want.abs().clamp_min(1.0)).all()


def test_wave_vectors_and_rotation_equal_the_released_golden_gate_rope():
    assert _close(_golden((2, 3)).freqs, _RELEASED_FREQS_2D)
    assert _close(_golden((2, 2, 3)).freqs, _RELEASED_FREQS_3D)
    enc = _golden((2, 3), min_freq=0.5, max_freq=4.0, zero_freq_fraction=0.25)
    assert _close(enc.freqs, _RELEASED_ZERO_FRAC)
    q = torch.arange(96, dtype=torch.float32).reshape(1, 2, 6, 8).sin()
    out = enc.rotate(q, enc.prepare(PositionGrid((2, 3), 0)))
    assert (out.flatten()[::7] - torch.tensor(_RELEASED_ROTATED)).abs().max() < 1e-5


def test_generalized_golden_ratio_and_ladder():
    assert abs(generalized_golden_ratio(1) - (1 + math.sqrt(5)) / 2) < 1e-12
    for n in (2, 3, 5):
        g = generalized_golden_ratio(n)
        assert abs(g ** (n + 1) - g - 1) < 1e-12
    lad = log_frequency_ladder(8, 0.5, 64.0, 0.25)
    assert torch.equal(lad[:2], torch.zeros(2))
    assert torch.allclose(lad[2:].log().diff(), torch.full((5,), math.log(128) / 5), atol=1e-5)
    assert abs(lad[2].item() - 0.5) < 1e-6 and abs(lad[-1].item() - 64.0) < 1e-4


@pytest.mark.parametrize("ndim", [2, 3])
def test_directions_are_unit_and_spread_uniformly(ndim):
    """The golden sequence covers the sphere evenly: the mean direction and the second moment are those of the uniform
    distribution (0 and I/n) far more closely than i.i.d. random directions of the same count manage."""
    n = 192
    dirs = golden_directions(n, ndim).double()
    assert torch.allclose(dirs.norm(dim=-1), torch.ones(n, dtype=torch.float64), atol=1e-6)
    mean_err = dirs.mean(0).norm().item()
    moment_err = (dirs.T @ dirs / n - torch.eye(ndim, dtype=torch.float64) / ndim).abs().max().item()
    torch.manual_seed(0)
    rnd = torch.nn.functional.normalize(torch.randn(200, n, ndim, dtype=torch.float64), dim=-1)
    rnd_mean = rnd.mean(1).norm(dim=-1).median().item()
    rnd_moment = (rnd.transpose(-1, -2) @ rnd / n - torch.eye(ndim, dtype=torch.float64) / ndim).abs().amax((-1, -2)).median().item()
    assert mean_err < 0.5 * rnd_mean and moment_err < 0.5 * rnd_moment
    if ndim == 2:  # in the plane: the widest empty arc is narrower than random directions typically leave

        def widest_gap(d):
            ang = torch.sort(torch.atan2(d[..., 1], d[..., 0]), dim=-1).values
            return torch.cat([ang.diff(dim=-1), ang[..., :1] + 2 * math.pi - ang[..., -1:]], dim=-1).amax(-1)

        assert widest_gap(dirs) < widest_gap(rnd).median()


@pytest.mark.parametrize("grid,shift", [((3, 4), (2, 1)), ((2, 3, 3), (1, 2, 1))])
def test_logits_depend_on_offsets_only(grid, shift):
    torch.manual_seed(0)
    enc = _golden(grid, min_freq=0.1, max_freq=3.0)
    a, b, crossed = shifted_block_logits(enc, grid, shift, head_dim=8)
    assert (a - b).abs().max() < 1e-5 * a.abs().max()
    assert (a - crossed).abs().max() > 1e-2  # positions do matter: keys moved against the queries change the logits


def test_every_pair_mixes_every_axis_and_prefix_tokens_are_not_rotated():
    enc = _golden((4, 4), heads=2, head_dim=16, prefix=1)
    assert (enc.freqs.abs() > 0).all()  # no axis-aligned pair: each pair turns with every axis
    grid = PositionGrid((4, 4), 1)
    q = torch.randn(1, 2, 17, 16)
    out = enc.rotate(q, enc.prepare(grid))
    assert torch.equal(out[..., 0, :], q[..., 0, :])


def _vit(**kw):
    return timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding=kw.pop("pos_encoding", "golden_rope"), depth=2,
                             embed_dim=64, num_heads=4, num_classes=5, **kw)


def test_vit_trains_at_three_grids_with_patch_dropout_and_bf16():
    torch.manual_seed(0)
    check_vit_trains(_vit, _vit(pos_encoding="golden_rope[max_freq=100]"))


@pytest.mark.parametrize("frames,size", [(4, 32), (2, 48)])
def test_video_vit_trains(frames, size):
    torch.manual_seed(0)
    model = VispeVideoViT(pos_encoding="golden_rope", embed_dim=48, depth=2, num_heads=2, img_size=32, num_frames=4,
                          tubelet_size=2, patch_size=8, num_classes=5)
    assert model.pos_encoding.freqs.shape == (2, 12, 3)
    out = model(torch.randn(1, 3, frames, size, size))
    assert out.shape == (1, 5) and torch.isfinite(out).all()
    out.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("options,needle", [
    ({"min_freq": 0.0}, "min_freq=0.0"),
    ({"max_freq": -1.0}, "max_freq=-1.0"),
    ({"min_freq": 5.0, "max_freq": 2.0}, "max_freq=2.0 is below min_freq=5.0"),
    ({"zero_freq_fraction": 1.5}, "zero_freq_fraction=1.5"),
    ({"extrapolation": "ntk"}, "'ntk'"),
])
def test_bad_options_are_refused_at_construction(options, needle):
    with pytest.raises(ValueError, match=needle):
        _golden((3, 4), **options)
