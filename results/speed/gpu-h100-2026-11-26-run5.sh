#!/usr/bin/env bash
# Fifth device call (one H100, 16 host cores): the Fashion-MNIST resolution rows of the 2026 encodings (the `cpu`
# grid's fashion_mnist part, 3 seeds each, trained with trainer.accelerator=gpu). One pipeline per encoding, the four
# side by side: train its 3 seeds (--jobs 3, --train-only), then sweep them on the host CPU (--sweep-only, 4 threads).
# Usage: bash results/speed/gpu-h100-2026-11-26-run5.sh OUT_DIR DEADLINE_S   (Fashion-MNIST under $VISPE_DATA_ROOT)
set -u
out=${1:?output folder}
deadline=${2:-380}
mkdir -p "$out"
t_start=$SECONDS
pipeline() {
  local enc=$1 dir=outputs/resbench-gpu/$1
  local common=(python3 -m vispe.cli resolution-benchmark --grid cpu --parts fashion_mnist --encodings "$enc" --out "$dir")
  timeout 280 "${common[@]}" --jobs 3 --threads 1 --set trainer.accelerator=gpu --train-only > "$out/train-$enc.log" 2>&1
  echo "$enc train rc=$? at $((SECONDS - t_start)) s"
  timeout $((deadline - (SECONDS - t_start))) "${common[@]}" --threads 4 --sweep-only > "$out/sweep-$enc.log" 2>&1
  echo "$enc sweep rc=$? at $((SECONDS - t_start)) s"
}
for enc in pope golden_rope nd_rope spherical_rope; do pipeline "$enc" & done
wait
for enc in pope golden_rope nd_rope spherical_rope; do grep -v USDT "$out/sweep-$enc.log" | grep -A12 "^### fashion_mnist" ; done
tar -cf "$out/resbench-gpu.tar" --exclude='epoch*.ckpt' -C outputs resbench-gpu
