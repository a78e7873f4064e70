"""The attention-bias encodings' blocked path traced by ``torch.compile`` equals the eager dense oracle (outputs
and the gradients of q, k, v and the encoding's parameters): the eager-only fast paths (one-pass block pair ids,
iRPE's flat gather of ``Z`` and its per-block gradient rule, the logits written into a per-sample term's block)
step aside inside a compiled graph. ``aot_eager`` traces forward and backward (as inductor would) without
generating code, so the check stays quick."""
from __future__ import annotations

import pytest
import torch

from vispe.encodings import EncodingContext, PositionGrid, create_encoding

CASES = [("irpe", {}), ("irpe", {"mode": "bias", "sides": "qk", "method": "cross"}), ("fire", {}), ("alibi_2d", {})]


@pytest.mark.parametrize("name, options", CASES, ids=[f"{n}{o or ''}" for n, o in CASES])
def test_compiled_blocked_path_equals_the_eager_dense_oracle(name, options):
    torch._dynamo.reset()
    grid = PositionGrid((3, 4), 1)
    enc = create_encoding(name, EncodingContext(dim=16, num_heads=2, depth=2, grid_size=(3, 4), num_prefix_tokens=1),
                          **options).train()
    torch.manual_seed(3)
    with torch.no_grad():
        for p in enc.parameters():  # zero-initialised tables would hide a wrong gather
            p.add_(torch.randn_like(p) * 0.3)
    g = torch.Generator().manual_seed(2)
    q, k, v, w = (torch.randn(2, 2, grid.seq_len, 8, generator=g) for _ in range(4))

    def attend(q, k, v):
        return enc.attend(q, k, v, layer=1, state=enc.prepare(grid))

    results = []
    for backend, run in (("dense", attend), ("blocked", torch.compile(attend, backend="aot_eager", fullgraph=True))):
        enc.set_attention_backend(backend, block_rows=5 if backend == "blocked" else None)
        enc.zero_grad(set_to_none=True)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = run(*leaves)
        (out * w).sum().backward()
        results.append((out.detach(), [t.grad for t in leaves] + [p.grad for p in enc.parameters()]))
    (out_d, grads_d), (out_c, grads_c) = results
    torch.testing.assert_close(out_c, out_d, atol=1e-5, rtol=1e-5)
    assert len(grads_c) == len(grads_d)
    for a, b in zip(grads_c, grads_d):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    if name != "alibi_2d":
        assert any(p.grad.abs().sum() > 0 for p in enc.parameters())
