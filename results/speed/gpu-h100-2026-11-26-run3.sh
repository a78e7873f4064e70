#!/usr/bin/env bash
# Third H100 run (one short device call): the fixes from run 2 (comrope_ap compiled on CUDA, lff in pure bf16),
# GPU rows for the new encodings (pope, golden_rope, nd_rope), and `vispe fit` under Lightning's FSDPStrategy and
# ModelParallelStrategy on one GPU. Usage: bash results/speed/gpu-h100-2026-11-26-run3.sh OUT_DIR
set -u
out=${1:?output folder}
mkdir -p "$out"
run() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" > "$out/$name.log" 2>&1; echo "$name rc=$?"; tail -n 25 "$out/$name.log"; }
run compiled_fixes 110 python3 -m vispe.cli bench speed --device cuda --models vit_s16 --encodings comrope_ap \
  --timm-refs ape --modes compile --precisions amp_bf16 --bench train,memory --iters 3 --out-dir "$out" --tag compiled-fixes
run eager_new 60 python3 -m vispe.cli bench speed --device cuda --models vit_s16 --encodings rope_axial,pope,golden_rope,nd_rope,lff \
  --timm-refs ape --modes eager --precisions amp_bf16,bf16 --iters 5 --out-dir "$out" --tag eager-new
for strategy in fsdp ModelParallelStrategy; do
  run "fit_$strategy" 45 python3 -m vispe.cli fit --recipe smoke --trainer.accelerator cuda --trainer.devices 1 \
    --trainer.strategy "$strategy" --trainer.max_epochs 1 --trainer.enable_progress_bar false
done
