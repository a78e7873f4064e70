#!/usr/bin/env bash
# Fourth device call (one H100, 16 host cores): the Fashion-MNIST resolution rows of the new encodings (the `cpu`
# grid's fashion_mnist part, 3 seeds, trained with trainer.accelerator=gpu, nine runs side by side), then the compiled
# ViT-S/16 rows the earlier GPU runs left out (loope, rope_dinov3, liere).
# Usage: bash results/speed/gpu-h100-2026-11-26-run4.sh OUT_DIR   (Fashion-MNIST under $VISPE_DATA_ROOT)
set -u
out=${1:?output folder}
mkdir -p "$out"
run() { local name=$1 limit=$2; shift 2; echo "== $name"; local t0=$SECONDS; timeout "$limit" "$@" > "$out/$name.log" 2>&1; echo "$name rc=$? $((SECONDS - t0)) s"; grep -v USDT "$out/$name.log" | tail -n 30; }
run fmnist_new 230 python3 -m vispe.cli resolution-benchmark --grid cpu --parts fashion_mnist --encodings pope,golden_rope,nd_rope \
  --jobs 9 --threads 1 --set trainer.accelerator=gpu --out "$out/resbench"
run compiled_rest 150 python3 -m vispe.cli bench speed --device cuda --models vit_s16 --encodings "loope,rope_dinov3,liere[block_size=8]" \
  --timm-refs ape --modes compile --precisions amp_bf16 --bench train,memory --iters 5 --min-run-s 0.15 --out-dir "$out" --tag compiled-rest
