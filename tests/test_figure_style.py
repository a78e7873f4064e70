"""One plotting style for every resolution figure: the same line per policy in the sweep's and the benchmark's plots,
user-facing titles, accuracy axes that never go below 0 %."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from vispe.benchmarks import grid  # noqa: E402
from vispe.benchmarks import resolution_benchmark as rb  # noqa: E402
from vispe.benchmarks import resolution_sweep as rs  # noqa: E402


def _capture(monkeypatch) -> list:
    figs = []
    monkeypatch.setattr(plt.Figure, "savefig", lambda self, *a, **k: figs.append(self))
    return figs


def _styles(fig) -> dict[str, str]:
    return {line.get_label(): line.get_linestyle() for ax in fig.axes for line in ax.get_lines()
            if not line.get_label().startswith("_") and "training" not in line.get_label()}


def test_sweep_and_benchmark_draw_each_policy_alike(monkeypatch, tmp_path):
    figs = _capture(monkeypatch)
    evals = [{"sweep": "size", "shape": f"{s}x{s}", "height": s, "width": s, "aspect": 1.0, "top1": t} for s, t in ((16, 5.0), (32, 9.0))]
    report = {"results": [{"label": f"rope_axial ({p})", "source": "a", "extrapolation": p, "resize": "resize", "train_shape": "32x32",
                           "evaluations": evals} for p in ("extend", "interpolate")]}
    rs.plot(report, tmp_path / "sweep.png")
    rows = [{"part": "fashion_mnist_mixed", "encoding": "rope_axial", "extrapolation": p, "mean": {"16": 5.0, "32": 9.0},
             "spread": {"16": 8.0, "32": 1.0}, "train_size": 32} for p in ("extend", "interpolate")]
    rb.plot(rows, tmp_path / "bench.png")
    sweep, bench = (_styles(f) for f in figs)
    assert sweep == bench == {"rope_axial (extend)": "--", "rope_axial (interpolate)": "-"}
    ax = figs[1].axes[0]
    assert ax.get_title() == "Fashion-MNIST, mixed-grid training" and ax.get_ylim()[0] >= 0  # band 5 ± 8 drawn, no tick < 0
    assert "band: spread over seeds" in figs[1].legends[0].get_title().get_text()


def test_part_titles():
    assert grid.part_title("fashion_mnist") == "Fashion-MNIST"
    assert grid.part_title("cifar10") == "CIFAR-10"
    assert grid.part_title("fashion_mnist_4x") == "Fashion-MNIST, up to 4x the training size"
