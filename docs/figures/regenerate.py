"""Redraw the resolution figures of this folder from the JSON results in results/ (no training, no evaluation):
``python docs/figures/regenerate.py`` from the repository root. Every figure uses the one plotting style of
:mod:`vispe.benchmarks.grid` (line style = extrapolation policy, legend below the panels with what lines and bands
mean, accuracy axes within 0-100 %)."""
from __future__ import annotations

import json
from pathlib import Path

from vispe.benchmarks import resolution_benchmark as rb
from vispe.benchmarks import resolution_sweep as rs

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"
FIGURES = ROOT / "docs" / "figures"


def _json(name: str) -> dict:
    return json.loads((RESULTS / f"resolution-benchmark-{name}.json").read_text())


def _early_sweep_report() -> dict:
    """``cifar10_resolution.json`` holds square sizes only (``accuracy``), from before shapes and aspect ratios: give
    its rows the sweep's current fields so :func:`vispe.benchmarks.resolution_sweep.plot` draws them."""
    report = json.loads((RESULTS / "cifar10_resolution.json").read_text())
    results = []
    for r in report["results"]:
        size = int(r["train_size"])
        evaluations = [{"sweep": "size", "shape": f"{int(s)}x{int(s)}", "height": int(s), "width": int(s), "aspect": 1.0,
                        "top1": v["top1"]} for s, v in sorted(r["accuracy"].items(), key=lambda kv: int(kv[0]))]
        results.append({**r, "source": r["encoding"], "resize": "resize", "train_shape": f"{size}x{size}",
                        "evaluations": evaluations})
    return {**report, "results": results}


def _fourx_report() -> dict:
    """``resolution-benchmark-fmnist-4x.json`` holds one evaluation list per run (1x-4x the training size, seed 0):
    give its rows the sweep's fields so the same plot draws them (a policy of ``extend``/``interpolate`` goes into
    the label, as the sweep labels its rows)."""
    data = _json("fmnist-4x")
    results = []
    for r in data["rows"]:
        own = r["extrapolation"] not in ("extend", "interpolate")
        evaluations = []
        for e in r["evaluations"]:
            h, w = (int(v) for v in e["shape"].split("x"))
            evaluations.append({"sweep": "size", "shape": e["shape"], "height": h, "width": w, "aspect": w / h, "top1": e["top1"]})
        results.append({"label": r["encoding"] if own else f"{r['encoding']} ({r['extrapolation']})", "source": r["encoding"],
                        "encoding": r["encoding"], "extrapolation": None if own else r["extrapolation"], "resize": "resize",
                        "train_shape": r["train_shape"], "evaluations": evaluations})
    return {"meta": data["meta"], "results": results}


def main() -> None:
    rb.plot(_json("fmnist")["rows"], FIGURES / "resolution_fmnist.png")
    rb.plot(_json("cifar10")["rows"], FIGURES / "resolution_cifar10.png")
    rb.plot_techniques(_json("fmnist-techniques")["rows"], FIGURES / "resolution_techniques.png")
    rb.plot_aspect(_json("fmnist-aspect")["rows"], FIGURES / "resolution_fmnist_aspect.png")
    headline, mixed = _json("fmnist-aspect-headline"), _json("fmnist-mixed")
    rb.plot(mixed["rows"], FIGURES / "resolution_fmnist_mixed.png")
    rb.plot_aspect(headline["aspect_rows"] + mixed["aspect_rows"], FIGURES / "resolution_fmnist_aspect_mixed.png")
    rs.plot(_early_sweep_report(), FIGURES / "cifar10_resolution.png", title="CIFAR-10: top-1 accuracy vs input size")
    rs.plot(_fourx_report(), FIGURES / "resolution_fmnist_4x.png",
            title="Fashion-MNIST: top-1 accuracy from 1x to 4x the training size (seed 0)")


if __name__ == "__main__":
    main()
