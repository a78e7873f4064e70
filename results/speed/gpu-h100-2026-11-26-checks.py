"""GPU checks after the first H100 run: LieRE's chunked eigh backward, FlexAttention kernel options for iRPE,
and the dense (SDPA attn_mask) path for biases under torch.compile."""
import json
import os
import sys
import time

import timm
import torch

import vispe  # noqa: F401  (registers the vispe_* models)
import torch.nn.functional as F
from vispe.encodings import attention as att
import torch._dynamo.config as dc
dc.recompile_limit = 256
out = {}
dev = "cuda"
x = torch.randn(128, 3, 224, 224, device=dev); y = torch.randint(0, 1000, (128,), device=dev)

def step_time(model, n=5):
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    def st():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x).float(), y)
        loss.backward(); opt.step()
    st(); st(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n): st()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3

def run(name, fn, deadline):
    if time.perf_counter() > deadline:
        out[name] = "not run (time)"; return
    t0 = time.perf_counter()
    try:
        out[name] = round(fn(), 2)
    except Exception as e:
        out[name] = f"FAILED {type(e).__name__}: {str(e)[:300]}"
    print(name, out[name], f"({time.perf_counter() - t0:.0f} s)", flush=True)
    json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "gpucheck.json"), "w"), indent=1)

T0 = time.perf_counter(); D = T0 + float(sys.argv[1]) if len(sys.argv) > 1 else 1e9
mk = lambda pe: timm.create_model("vispe_vit_small_patch16_224", pos_encoding=pe).to(dev)
run("ape_eager_ms", lambda: step_time(timm.create_model("vit_small_patch16_224").to(dev)), D)
run("liere8_eager_ms", lambda: step_time(mk("liere[block_size=8]")), D)
for tag, opts in [("default", {}), ("stages1", {"num_stages": 1}),
                  ("tiles32", {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_M1": 32, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 32})]:
    def f(opts=opts):
        att.FLEX_KERNEL_OPTIONS.clear(); att.FLEX_KERNEL_OPTIONS.update(opts)
        return step_time(mk("irpe"))
    run(f"irpe_eager_flex_{tag}_ms", f, D)
att.FLEX_KERNEL_OPTIONS.clear()
run("ape_compiled_ms", lambda: step_time(torch.compile(timm.create_model("vit_small_patch16_224").to(dev))), D)
run("alibi_compiled_dense_ms", lambda: step_time(torch.compile(mk("alibi_2d[attention_backend=dense]"))), D)
run("irpe_compiled_dense_ms", lambda: step_time(torch.compile(mk("irpe[attention_backend=dense]"))), D)
run("alibi_eager_dense_ms", lambda: step_time(mk("alibi_2d[attention_backend=dense]")), D)
print(json.dumps(out, indent=1))
