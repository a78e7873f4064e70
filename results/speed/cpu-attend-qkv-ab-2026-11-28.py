"""In-process A/B of the attention's hand-over: ``PEAttention.forward`` splitting q/k/v itself and calling
``encoding_attend`` (as at 0bb02fb, written out below as ``old_forward``) against the current forward, which hands
the projection's output to ``encoding_attend_qkv``. Eager ViT-S/16 at 224 px (197 tokens), depth 4, batch 2, SGD, one
thread; each round times 3 steps of each variant per model, in alternating order; the ratio new / old per round.

Usage: ``PYTHONPATH=. python results/speed/cpu-attend-qkv-ab-2026-11-28.py OUT.json learned,rope_axial 21``."""
import json
import statistics
import sys
import time

import timm
import torch

from vispe.models import layers as L

torch.set_num_threads(1)
new_forward = L.PEAttention.forward

def old_forward(self, x, attn_mask=None, is_causal=False, pe=None):
    B, N, _ = x.shape
    gate = self.gate(x).sigmoid() if self.gate is not None else None
    if pe is None:
        qkv = self.qkv(x)
    elif pe.folded_qkv is not None:
        qkv = torch.nn.functional.linear(x, *pe.folded_qkv)
    else:
        qkv, pe = L.encoding_project_qkv(pe, self.qkv, x, self.folds_qk_basis)
    qkv = qkv.reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    q, k = self.q_norm(q), self.k_norm(k)
    dropout_p = self.attn_drop.p if self.training else 0.0
    x = L.sdpa(q, k, v, attn_mask, dropout_p, is_causal) if pe is None else L.encoding_attend(pe, q, k, v, attn_mask, dropout_p, is_causal)
    x = x.transpose(1, 2).reshape(B, N, self.attn_dim)
    x = self.norm(x)
    if gate is not None:
        x = x * gate
    return self.proj_drop(self.proj(x))

names = sys.argv[2].split(",")
rounds = int(sys.argv[3])
models = {}
for n in names:
    torch.manual_seed(0)
    models[n] = timm.create_model("vispe_vit_small_patch16_224", pos_encoding=n, depth=4, num_classes=10)
x = torch.randn(2, 3, 224, 224); y = torch.randint(0, 10, (2,))
opt = {n: torch.optim.SGD(m.parameters(), lr=1e-3) for n, m in models.items()}

def step(n):
    m = models[n]
    loss = torch.nn.functional.cross_entropy(m(x), y)
    opt[n].zero_grad(set_to_none=True); loss.backward(); opt[n].step()

def timed(n, fwd, reps=3):
    L.PEAttention.forward = fwd
    t0 = time.perf_counter()
    for _ in range(reps):
        step(n)
    return (time.perf_counter() - t0) / reps

for n in names:
    for f in (old_forward, new_forward):
        timed(n, f, 1)
ratios = {n: [] for n in names}
for r in range(rounds):
    for n in names:
        order = (old_forward, new_forward) if r % 2 == 0 else (new_forward, old_forward)
        t = {f: timed(n, f) for f in order}
        ratios[n].append(t[new_forward] / t[old_forward])
out = {}
for n in names:
    q = statistics.quantiles(ratios[n], n=4)
    out[n] = {"new_over_old_median": statistics.median(ratios[n]), "iqr": [q[0], q[2]], "rounds": rounds}
    print(f"{n:12s} new/old {statistics.median(ratios[n]):.3f} (IQR {q[0]:.3f}-{q[2]:.3f})")
with open(sys.argv[1], "w") as f:
    json.dump(out, f, indent=1)
