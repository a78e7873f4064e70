"""Compile a 2-layer iRPE ViT-S/16 with attention_backend='triton' on CUDA (inductor, bf16 autocast, batch 8) and run
one train step; on failure print the whole error, including what inductor's compile subprocess reported.

Usage: ``PYTHONPATH=. python results/speed/gpu-irpe-triton-compile-check-2026-11-28.py``."""
import traceback

import timm
import torch

import vispe  # noqa: F401

torch._inductor.config.compile_threads = 1  # errors raised in this process, with their cause
for name in ("irpe", "fire"):
    model = timm.create_model("vispe_vit_small_patch16_224", pos_encoding=f"{name}[attention_backend=triton]", depth=2,
                              num_classes=10).cuda()
    x = torch.randn(8, 3, 224, 224, device="cuda")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = torch.compile(model)(x)
        out.float().sum().backward()
        torch.cuda.synchronize()
        print(name, "compiled train step ok")
    except Exception:  # noqa: BLE001
        text = traceback.format_exc()
        print(name, "FAILED\n", text[-6000:])
