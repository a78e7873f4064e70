"""Golden-gate RoPE: N-D RoPE whose frequency directions are spread uniformly by the golden ratio (Jerry Xiong,
"On N-dimensional Rotary Positional Embeddings", 2025; lucidrains' vit-pytorch ``vit_nd_rotary.py``,
``GoldenGateRoPENd``).

Every pair ``f`` of head ``h`` turns by ``omega_f * (u_hf . p)``: ``p`` the token's lattice index (any number of
axes), ``u_hf`` a unit direction and ``omega_f`` a magnitude from a log-spaced ladder
``min_freq * (max_freq / min_freq)^(j / (F - 1))`` after ``round(zero_freq_fraction * P)`` zero frequencies. The
``H * P`` directions are points of the ``n``-dimensional golden-ratio (Kronecker, Roberts' R_n) low-discrepancy
sequence, mapped through the inverse normal CDF and normalised: Gaussian vectors made quasi-random, so their
directions cover the sphere uniformly with no two pairs alike. Angles are linear in the position, so attention
depends on offsets only (relative). No parameters; ``half`` channel pairs ``(i, i + P)`` as released.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .._checks import Int, Real
from .base import register_encoding
from .grid import PositionGrid
from .rope_vit import _LatticeRotary
from .resolution import ResolutionContract

__all__ = ["GoldenRope", "generalized_golden_ratio", "golden_directions", "log_frequency_ladder"]


def generalized_golden_ratio(n: int) -> float:
    """The positive root of ``x^(n+1) = x + 1`` (``n = 1``: the golden ratio; the base of Roberts' R_n sequence)."""
    x = 2.0
    for _ in range(64):  # a contraction: converges to double precision long before
        x = (1.0 + x) ** (1.0 / (n + 1.0))
    return x


def golden_directions(count: int, ndim: int) -> torch.Tensor:
    """``count`` unit vectors ``(count, ndim)`` float32 spread uniformly over the sphere: point ``i`` (1-based) of the
    R_n sequence ``frac(i * g^-k)``, ``k = 1..n``, through the inverse normal CDF, normalised (float64 inside)."""
    g = generalized_golden_ratio(ndim)
    alpha = g ** -torch.arange(1, ndim + 1, dtype=torch.float64, device="cpu")
    i = torch.arange(1, count + 1, dtype=torch.float64, device="cpu")[:, None]
    gauss = torch.erfinv(2.0 * torch.remainder(i * alpha, 1.0) - 1.0)
    return torch.nn.functional.normalize(gauss, dim=-1).float()


def log_frequency_ladder(pairs: int, min_freq: float, max_freq: float, zero_fraction: float) -> torch.Tensor:
    """``(pairs,)`` float32: ``round(zero_fraction * pairs)`` zeros, then ``min_freq`` to ``max_freq`` log-spaced."""
    zeros = round(zero_fraction * pairs)
    ladder = min_freq * (max_freq / min_freq) ** torch.linspace(0.0, 1.0, pairs - zeros, device="cpu")
    return torch.cat([torch.zeros(zeros, device="cpu"), ladder])


@register_encoding("golden_rope")
class GoldenRope(_LatticeRotary):
    """Golden-gate RoPE on lattices of any number of axes (the model's ``grid_size``: images, videos).

    Args:
        min_freq, max_freq: the ends of the log-spaced magnitude ladder (1 and 10000, as released; radians per
            lattice step).
        zero_freq_fraction: the share of pairs left unrotated (0, as released).
        extrapolation: ``'extend'`` (the released behaviour: a larger grid has new integer indices, the same
            relative phases) or ``'interpolate'`` (indices rescaled into the training grid's range).
    """

    grid_ndims = (2, 3)
    layer_schedules = ("nope_layers", "rotary_fraction")  # no rotary base: min_freq / max_freq set the ladder
    layout = "half"
    resolution = ResolutionContract(("extend", "rescale"), default="extend")
    option_checks = {"min_freq": Real(0, low_open=True), "max_freq": Real(0, low_open=True),
                     "zero_freq_fraction": Real(0, 1), "num_heads": Int(1)}

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        grid_size: Sequence[int] = (14, 14),
        min_freq: float = 1.0,
        max_freq: float = 10000.0,
        zero_freq_fraction: float = 0.0,
        extrapolation: str | None = None,
    ) -> None:
        name = self.registry_name
        super().__init__(name, head_dim, grid_size, extrapolation, None)
        if max_freq < min_freq:
            raise ValueError(f"{name}: max_freq={max_freq!r} is below min_freq={min_freq!r}; the ladder runs from min_freq up to max_freq")
        pairs = head_dim // 2
        self.num_heads, self.min_freq, self.max_freq, self.zero_freq_fraction = num_heads, float(min_freq), float(max_freq), float(zero_freq_fraction)
        omega = log_frequency_ladder(pairs, self.min_freq, self.max_freq, self.zero_freq_fraction)
        directions = golden_directions(num_heads * pairs, len(self.grid_size)).reshape(num_heads, pairs, -1)
        # (H, P, ndim): the wave vector of every pair (derived from the options: not a buffer, nothing to save or load;
        # built on the CPU and moved with the angles, which are cached per grid and device)
        self.freqs = directions * omega[:, None]

    def angles(self, grid: PositionGrid, device) -> torch.Tensor:
        idx = self.lattice_indices(grid, device)  # (N, ndim)
        return torch.einsum("nd,hpd->hnp", idx, self.freqs.to(device=idx.device, dtype=torch.float32))  # (H, N, P)
