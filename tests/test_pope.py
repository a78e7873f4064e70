"""PoPE (arXiv 2509.10534) on image and video lattices: the released AxialPoPE's logits, offset-only phases, the
what/where split (with zero bias every content peaks at offset 0), the clamped key bias, prefix tokens, the d^-1/2
scale, ViT / video ViT training steps, bf16, patch dropout, bad options."""
from __future__ import annotations

import math

import pytest
import timm
import torch
from rotary_checks import shifted_block_logits

import vispe  # noqa: F401  (registers the models)
from vispe.encodings import EncodingContext, PositionGrid, create_encoding
from vispe.models.video_vit import VispeVideoViT


def _pope(grid=(3, 4), heads=2, head_dim=8, depth=1, prefix=0, **kw):
    ctx = EncodingContext(dim=heads * head_dim, num_heads=heads, depth=depth, grid_size=tuple(grid), num_prefix_tokens=prefix)
    return create_encoding("pope", ctx, **kw)


def _logits(enc, q, k, grid, layer=0):
    qr, kr = enc.rotate_qk(q, k, enc.prepare(grid), layer)
    return qr @ kr.transpose(-1, -2)


# golden values: lucidrains/PoPE-pytorch at commit ee11cab0dda8361b02fec56975e84e419ea6a631, AxialPoPE with the
# inputs below (bias linspace(-7, 1) so the clamp to [-2 pi, 0] acts), logits = rotated q @ rotated k^T, run with
# this repository's torch
_RELEASED_2D = [0.9930351376533508, 0.5659012198448181, 1.8241316080093384, 1.9012269973754883, 0.029445389285683632,
                0.2521713674068451, -0.6738805174827576, -0.1214643120765686, 0.5615526437759399, 0.011669626459479332,
                -0.5149222612380981, -0.7281232476234436, 1.4882243871688843, 1.6295634508132935, 3.2464442253112793,
                2.65653657913208, 1.4228121042251587, 2.599069833755493, 0.7128961086273193, 0.6503940224647522,
                1.585424780845642, 1.3152052164077759, 0.6104964017868042, 1.4017380475997925]
_RELEASED_3D = [6.8733320236206055, 8.033535957336426, 4.582693099975586, 4.750450134277344, 6.013338088989258,
                7.42042350769043, 6.660621643066406, 6.789968013763428, 4.907334327697754]


def test_logits_equal_the_released_axial_pope_2d_and_3d():
    """AxialPoPE(dim=8, heads=2, axial_dims=(4, 4)) on (2, 3) and AxialPoPE(dim=12, heads=1, axial_dims=(4, 4, 4)) on
    (2, 2, 3): the released positions are (x, y[, t]), vispe's default chunk order."""
    enc = _pope((2, 3), heads=2, head_dim=8)
    with torch.no_grad():
        enc.bias.copy_(torch.linspace(-7, 1, 16).reshape(1, 2, 8))
    q = torch.arange(96, dtype=torch.float32).reshape(1, 2, 6, 8).sin()
    k = torch.arange(96, dtype=torch.float32).reshape(1, 2, 6, 8).cos()
    got = _logits(enc, q, k, PositionGrid((2, 3), 0))[0, :, :2].flatten()
    assert (got - torch.tensor(_RELEASED_2D)).abs().max() < 2e-6

    enc = _pope((2, 2, 3), heads=1, head_dim=12)
    assert enc.sections == (4, 4, 4) and enc.chunk_axes == (2, 1, 0)
    q = torch.arange(144, dtype=torch.float32).reshape(1, 1, 12, 12).sin()
    k = torch.arange(144, dtype=torch.float32).reshape(1, 1, 12, 12).cos()
    got = _logits(enc, q, k, PositionGrid((2, 2, 3), 0))[0, 0, ::5, ::4].flatten()
    assert (got - torch.tensor(_RELEASED_3D)).abs().max() < 5e-6


@pytest.mark.parametrize("grid,shift", [((3, 4), (2, 1)), ((2, 3, 3), (1, 2, 0))])
def test_logits_depend_on_offsets_only(grid, shift):
    torch.manual_seed(0)
    enc = _pope(grid, bias_init="uniform")
    a, b, crossed = shifted_block_logits(enc, grid, shift, head_dim=8)
    assert (a - b).abs().max() < 2e-5 * a.abs().max()
    assert (a - crossed).abs().max() > 1e-2  # positions do matter: keys moved against the queries change the logits


def test_zero_bias_logit_peaks_at_zero_offset_for_any_content():
    """Content sits in the magnitudes only (the paper's what/where split): with delta = 0 a query's logit against the
    same key content is largest where the key sits on the query's own position -- RoPE cannot promise this."""
    torch.manual_seed(0)
    enc = _pope((5, 5))
    grid = PositionGrid((5, 5), 0)
    q = torch.randn(1, 2, 1, 8).expand(1, 2, 25, 8) * 3
    k = torch.randn(1, 2, 1, 8).expand(1, 2, 25, 8) * 3
    logits = _logits(enc, q, k, grid)  # (1, 2, 25, 25): the same content everywhere
    diag = torch.diagonal(logits, dim1=-2, dim2=-1)
    assert torch.allclose(diag, (torch.nn.functional.softplus(q) * torch.nn.functional.softplus(k)).sum(-1), atol=1e-5)
    assert (logits <= diag[..., :, None] + 1e-5).all()
    off = logits.masked_fill(torch.eye(25, dtype=torch.bool), -1e9).amax(-1)
    assert (off < diag).all()  # strictly: no other offset reaches it (margins are small where content sits on slow channels)


def test_key_bias_is_clamped_and_learned():
    torch.manual_seed(0)
    enc = _pope(bias_init="uniform", depth=2)
    assert enc.bias.shape == (2, 2, 8) and enc.bias.min() >= -2 * math.pi and enc.bias.max() <= 0
    grid = PositionGrid((3, 4), 0)
    q, k = torch.randn(2, 1, 2, 12, 8).unbind(0)
    with torch.no_grad():
        enc.bias.fill_(3.0)  # clamped to 0
    at_zero = _logits(enc, q, k, grid)
    with torch.no_grad():
        enc.bias.zero_()
    assert torch.equal(at_zero, _logits(enc, q, k, grid))
    with torch.no_grad():
        enc.bias.fill_(-1.0)
    _logits(enc, q, k, grid).sum().backward()
    assert enc.bias.grad is not None and enc.bias.grad[0].abs().sum() > 0 and enc.bias.grad[1].abs().sum() == 0
    assert enc.no_weight_decay() == {"bias"}
    # at the released zero init the bias learns (torch.clamp, as released, gives it no gradient at 0)
    enc = _pope()
    _logits(enc, q, k, grid).square().sum().backward()
    assert enc.bias.grad.abs().sum() > 0


def test_prefix_tokens_get_phase_zero_and_attention_uses_the_head_scale():
    torch.manual_seed(0)
    enc = _pope((3, 4), prefix=1)
    grid = PositionGrid((3, 4), 1)
    state = enc.prepare(grid)
    q, k, v = torch.randn(3, 2, 2, 13, 8).unbind(0)
    qr, kr = enc.rotate_qk(q, k, state)
    assert qr.shape == (2, 2, 13, 16)
    mag = torch.nn.functional.softplus(q[..., 0, :])
    assert torch.allclose(qr[..., 0, 0::2], mag) and torch.equal(qr[..., 0, 1::2], torch.zeros_like(mag))
    out = enc.attend(q, k, v, state=state)
    ref = torch.softmax(qr @ kr.transpose(-1, -2) / math.sqrt(8), -1) @ v
    assert out.shape == v.shape and (out - ref).abs().max() < 1e-5


def test_odd_head_dim_and_own_sections():
    enc = _pope((3, 4), heads=1, head_dim=7, sections=(3, 4))
    q, k = torch.randn(2, 1, 1, 12, 7).unbind(0)
    assert _logits(enc, q, k, PositionGrid((3, 4), 0)).shape == (1, 1, 12, 12)


def _vit(**kw):
    return timm.create_model("vispe_vit_tiny_patch4_32", pos_encoding=kw.pop("pos_encoding", "pope"), depth=2, embed_dim=64,
                             num_heads=4, num_classes=5, **kw)


def test_vit_trains_at_three_grids_and_with_patch_dropout():
    torch.manual_seed(0)
    model = _vit()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for size in [(32, 32), (48, 48), (24, 40)]:
        model.zero_grad()
        out = model(torch.randn(2, 3, *size))
        assert out.shape == (2, 5) and torch.isfinite(out).all()
        torch.nn.functional.cross_entropy(out, torch.tensor([1, 2])).backward()
        g = model.pos_encoding.bias.grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
        opt.step()
    model = _vit(patch_drop_rate=0.5).train()
    model(torch.randn(2, 3, 32, 32)).logsumexp(-1).sum().backward()
    assert model.pos_encoding.bias.grad.abs().sum() > 0


@pytest.mark.parametrize("frames,size", [(4, 32), (2, 48)])
def test_video_vit_trains(frames, size):
    torch.manual_seed(0)
    model = VispeVideoViT(pos_encoding="pope", embed_dim=48, depth=2, num_heads=2, img_size=32, num_frames=4, tubelet_size=2,
                          patch_size=8, num_classes=5)
    assert model.pos_encoding.grid_size == (2, 4, 4) and model.pos_encoding.sections == (8, 8, 8)
    out = model(torch.randn(1, 3, frames, size, size))
    assert out.shape == (1, 5) and torch.isfinite(out).all()
    out.sum().backward()
    assert model.pos_encoding.bias.grad.abs().sum() > 0


def test_bf16_autocast_step():
    torch.manual_seed(0)
    model, x, y = _vit(), torch.randn(2, 3, 32, 48), torch.tensor([1, 3])
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(model(x), y).item()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    loss.backward()
    assert torch.isfinite(loss) and abs(loss.item() - ref) <= 0.05 * max(1.0, ref)
    model = model.to(torch.bfloat16)  # a bf16 model: the bias is bf16, the phases stay float32
    out = model(x.bfloat16())
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all() and torch.isfinite(model.pos_encoding.bias.grad).all()
    state = model.pos_encoding.prepare(PositionGrid((8, 12), 1))
    assert state.table.dtype == torch.complex64  # float32 angles in a bf16 model


@pytest.mark.parametrize("options,needle", [
    ({"sections": (3, 3)}, "summing to head_dim=8"),
    ({"sections": (8,)}, "summing to head_dim=8"),
    ({"bias_init": "normal"}, "'normal'"),
    ({"theta": 0.5}, "theta=0.5"),
    ({"extrapolation": "stretch"}, "'stretch'"),
])
def test_bad_options_are_refused_at_construction(options, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        _pope((3, 4), **options)


def test_attention_runs_on_the_fused_kernel_and_equals_the_materialised_softmax():
    """q/k are 2d wide and v d wide after the map: PoPE's attention still runs on SDPA's flash kernel (the math fallback,
    which keeps (L, L) probabilities, is switched off here) and equals softmax(q k^T d^-1/2) v with its gradients."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    enc = _pope((4, 5), heads=2, head_dim=8, prefix=1)
    with torch.no_grad():
        enc.bias.uniform_(-2 * math.pi, 0.0)
    grid = PositionGrid((4, 5), 1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 21, 8, generator=g, requires_grad=True) for _ in range(3))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = enc.attend(q, k, v, layer=0, state=enc.prepare(grid))
    assert out.shape == v.shape
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, enc.bias))
    qr, kr = enc.rotate_qk(q, k, enc.prepare(grid), 0)
    want = torch.softmax(qr @ kr.transpose(-1, -2) / math.sqrt(8), dim=-1) @ v
    torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-5)
    for got, ref in zip(grads, torch.autograd.grad(want.square().sum(), (q, k, v, enc.bias))):
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
