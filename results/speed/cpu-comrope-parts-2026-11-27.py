"""What each part of compiled ComRoPE costs: one process, models interleaved round by round.

ComRoPE's spectral path is RoPE's per-pair phases, plus the generators' ``eigh`` (the basis and the frequencies) and
the fold of the basis into the q/k rows of each ``qkv`` weight. The variants below take those parts away one at a time
(analysis only: with an identity basis they are no longer ComRoPE), next to RoPE-Mixed and timm's APE ViT:

* ``comrope_ap``: the encoding as shipped;
* ``no eigh``: identity basis, frequencies read from the generators' entries (the fold still runs, on the identity);
* ``no eigh, no fold``: identity basis and no fold: RoPE's phases from learned frequencies only;
* ``eigh, no fold``: the ``eigh`` runs (its frequencies rotate), its basis is not folded.

Usage: ``python results/speed/cpu-comrope-parts-2026-11-27.py ROUNDS OUT.json`` (ViT-S/16 at 224 px, depth 4,
batch 2, one thread, ``torch.compile``; a train step as ``vispe bench speed`` times it, process CPU time).
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import timm
import torch
import torch.nn.functional as F
from timm.optim import create_optimizer_v2

import vispe  # noqa: F401  (registers the vispe_* models)
from vispe.encodings.comrope.encodings import ComRopeAP
from vispe.encodings.comrope.spectral import ComRopeSpectralState, spectral_decomposition
from vispe.encodings.rotary import RotaryState, rotary_table


def _state(enc: ComRopeAP, grid, device, fold: bool, eigh: bool) -> ComRopeSpectralState:
    dev = device if device is not None else enc.base.device
    skew = enc.skew_blocks()
    b = skew.shape[-1]
    if eigh:
        blocks, omega, _ = spectral_decomposition(skew)
    else:
        omega = skew[..., 0, 1 : b // 2 + 1].abs() + 0.1
        blocks = torch.eye(b, device=skew.device).expand_as(skew) + 0 * skew
    coef = enc.coefficients(enc.coordinates(grid, dev, enc.line_offsets(grid, dev)))
    angles = (coef[..., None] * omega[:, :, None]).flatten(-2)
    return ComRopeSpectralState(blocks, RotaryState(rotary_table(angles), per_layer=True), basis_folded=not fold)


class NoEigh(ComRopeAP):
    def spectral_state(self, grid, device):
        return _state(self, grid, device, fold=True, eigh=False)


class NoEighNoFold(ComRopeAP):
    def spectral_state(self, grid, device):
        return _state(self, grid, device, fold=False, eigh=False)


class EighNoFold(ComRopeAP):
    def spectral_state(self, grid, device):
        return _state(self, grid, device, fold=False, eigh=True)


def _vispe(encoding: str, cls: type | None = None) -> torch.nn.Module:
    model = timm.create_model("vispe_vit_small_patch16_224", pretrained=False, pos_encoding={"name": encoding}, depth=4)
    for module in model.modules():
        if cls is not None and isinstance(module, ComRopeAP):
            module.__class__ = cls
    return model


VARIANTS = {
    "timm:ape": lambda: timm.create_model("vit_small_patch16_224", pretrained=False, depth=4),
    "rope_mixed": lambda: _vispe("rope_mixed"),
    "comrope_ap": lambda: _vispe("comrope_ap"),
    "comrope_ap, no eigh": lambda: _vispe("comrope_ap", NoEigh),
    "comrope_ap, no eigh, no fold": lambda: _vispe("comrope_ap", NoEighNoFold),
    "comrope_ap, eigh, no fold": lambda: _vispe("comrope_ap", EighNoFold),
}


def main(rounds: int, out_path: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x, y = torch.randn(2, 3, 224, 224), torch.randint(0, 1000, (2,))
    runs = {}
    for name, build in VARIANTS.items():
        torch.manual_seed(0)
        model = build()
        runs[name] = (torch.compile(model), create_optimizer_v2(model, opt="sgd", lr=1e-4))

    def step(name: str) -> None:
        runner, opt = runs[name]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(runner(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for name in runs:  # compile and warm up
        for _ in range(3):
            step(name)
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    t0 = time.perf_counter()
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:  # the order rotates every round
            c0 = time.process_time()
            step(name)
            step(name)
            times[name].append((time.process_time() - c0) / 2 * 1e3)
    rows = []
    for name in names:
        ratios = sorted(a / b for a, b in zip(times[name], times["timm:ape"]))
        q = len(ratios) // 4
        rows.append({"model": name, "train_ms": statistics.median(times[name]), "x": statistics.median(ratios),
                     "x_iqr": [ratios[q], ratios[-q - 1]]})
        print(f"{name:30s} {rows[-1]['train_ms']:7.1f} ms  x {rows[-1]['x']:.3f} "
              f"(IQR {ratios[q]:.3f}-{ratios[-q - 1]:.3f})")
    with open(out_path, "w") as f:
        json.dump({"rounds": rounds, "wall_s": time.perf_counter() - t0, "torch": torch.__version__,
                   "timm": timm.__version__, "rows": rows, "times_ms": times}, f, indent=1)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
