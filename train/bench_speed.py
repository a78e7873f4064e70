"""Speed and memory of every vispe encoding vs timm's ViTs: a thin wrapper of ``vispe bench speed``.

    python train/bench_speed.py --models vit_s16 --iters 10
"""
import sys

from vispe.benchmarks.speed import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
