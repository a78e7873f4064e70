"""What the attention-side encodings keep for backward: nothing of per-layer activation size
beyond what the no-PE model keeps (rotated q/k and iRPE's (B, H, L, L) term are rebuilt in backward),
and the rebuilt values give exactly the gradients of the stored ones."""
from __future__ import annotations

import contextlib

import pytest
import timm
import torch

import vispe  # noqa: F401
import vispe.encodings.rotary as rotary_mod

MODEL = "vispe_vit_tiny_patch4_32"
DEPTH, BATCH = 3, 4


def _kept_by_forward(model: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes allocated during a training forward and still alive after it (the output is kept):
    what autograd holds for the backward."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    model(x).sum().backward()  # warm caches (tables, bucket maps) outside the measurement
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = model(x)
    live: dict[int, int] = {}
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        ev = stack.pop()
        if ev.tag == _EventType.Allocation:
            events.append((ev.start_time_ns, ev.extra_fields.ptr, ev.extra_fields.alloc_size))
        stack.extend(ev.children)
    for _, ptr, nbytes in sorted(events):
        if nbytes > 0:
            live[ptr] = nbytes
        else:
            live.pop(ptr, None)
    del out
    return sum(live.values())


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(MODEL, pos_encoding=name, depth=DEPTH)


@pytest.mark.parametrize("name", ["rope_axial", "rope_mixed", "comrope_ap", "comrope_ld", "irpe", "rope_dinov3", "alibi_2d", "fire",
                                  "liere"])
@pytest.mark.slow
def test_forward_keeps_no_per_layer_copies(name):
    """Per extra sample, the forward keeps what the no-PE model keeps: position-only tables
    (independent of the batch) are allowed, activation-sized copies per layer are not."""
    small, large = (torch.randn(b, 3, 32, 32) for b in (BATCH, 2 * BATCH))
    none, model = _model("none"), _model(name)
    growth = (_kept_by_forward(model, large) - _kept_by_forward(model, small)) - (
        _kept_by_forward(none, large) - _kept_by_forward(none, small)
    )
    heads, length = model.blocks[0].attn.num_heads, model.patch_embed.num_patches + model.num_prefix_tokens
    one_qk = 2 * BATCH * model.embed_dim * length * 4  # rotated q and k of ONE layer for BATCH samples, float32
    one_logits = BATCH * heads * length * length * 4  # iRPE's logit term of ONE layer for BATCH samples
    # storing them would add DEPTH x one_qk (rotary) or DEPTH x one_logits (+ the bucket projections, iRPE)
    assert growth < min(one_qk, one_logits), (name, growth, one_qk, one_logits)


@pytest.mark.parametrize("name", ["rope_axial", "rope_mixed", "comrope_ld", "comrope_ap", "liere", "rope_dinov3"])
def test_rebuilt_rotations_give_the_stored_gradients(name, monkeypatch):
    x = torch.randn(2, 3, 32, 32)

    def grads() -> dict[str, torch.Tensor]:
        model = _model(name)
        model(x).square().sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    rebuilt = grads()
    off = lambda *a, **k: contextlib.nullcontext()  # noqa: E731
    # every rotary encoding (ComRoPE included) rotates through RotaryEncoding's one application path
    monkeypatch.setattr(rotary_mod, "save_as_recomputed", off)
    stored = grads()
    assert rebuilt.keys() == stored.keys()
    for n in stored:
        assert torch.equal(rebuilt[n], stored[n]), n


def test_rebuilt_tensors_support_double_backward():
    """With ``create_graph=True`` the rebuilt tensors carry a graph, so second-order gradients are right
    (the rebuild runs under the backward's grad mode). (SDPA's CPU flash kernel has no double backward
    itself, so a plain product stands in for attention here.)"""
    from vispe.encodings.base import save_as_recomputed

    x0 = torch.randn(5, dtype=torch.float64, requires_grad=True)
    x = x0.sin()
    with save_as_recomputed((x,), lambda: (x0.sin(),)):
        y = (x * x * x).sum()  # saves x (rebuilt in backward)
    (g,) = torch.autograd.grad(y, x0, create_graph=True)  # 3 sin^2 cos
    (h,) = torch.autograd.grad(g.sum(), x0)
    s, c = x0.detach().sin(), x0.detach().cos()
    assert torch.allclose(g.detach(), 3 * s**2 * c)
    assert torch.allclose(h, 6 * s * c**2 - 3 * s**3)
