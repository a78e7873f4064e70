"""Coordinate policies of lattice encodings: how positions meet a grid other than the training one, and how they move
while training.

Resolution policies on coordinates (declared in each encoding's
:class:`~vispe.encodings.resolution.ResolutionContract`): ``rescale`` scales positions per axis by ``train / size``
(:func:`policy_axis_scale`, :func:`policy_indices`); ``ntk`` / ``yarn`` rescale a rotary encoding's frequencies on a
grown axis (:func:`scale_frequencies`); ``extend`` leaves everything as it is.

Training-time coordinate augmentation: one declaration of the options, one set of draws.

Lattice encodings that evaluate a function of the token coordinates (``rope_axial`` / ``rope_mixed`` and their 3D
presets, ``rope_dinov3``, ``comrope_*``, ``sincos2d``) may move those coordinates while training, one draw per
forward shared by the batch (off in eval and by default):

* ``random_positions = r`` (RPE-2D): each axis's ``n`` positions are an ordered random subset of a lattice ``r``
  times larger (:func:`random_axis_indices`);
* ``coord_rescale`` / ``coord_jitter``: every axis scaled by one factor log-uniform in ``[1/coord_rescale,
  coord_rescale]`` times its own in ``[1/coord_jitter, coord_jitter]`` (about a centre the encoding chooses);
* ``coord_shift``: each axis shifted by a uniform ``[-coord_shift, coord_shift]`` (:func:`random_scale_shift`).

DINOv3's ``rope_dinov3`` takes the same three moves under its own names (:data:`DINOV3_COORDINATE_ALIASES`),
in its own units (the normalised ``[-1, 1]`` box) and its own order and calls (shift, then jitter, then rescale:
:meth:`CoordinateAugmentation.augment_dinov3`), so a seeded run draws what DINOv3 and timm draw.

An encoding lists the options it takes in ``coordinate_options`` (a class attribute of
:class:`~vispe.encodings.base.PositionalEncoding`); their rules are :data:`COORDINATE_OPTION_CHECKS`, checked before
construction like every option. :class:`CoordinateAugmentation` holds the values and makes the draws.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import torch

from .._checks import OptionCheck, Real

if TYPE_CHECKING:
    from .grid import PositionGrid

__all__ = [
    "COORDINATE_OPTION_CHECKS",
    "COORDINATE_OPTION_DEFAULTS",
    "DINOV3_COORDINATE_ALIASES",
    "CoordinateAugmentation",
    "coordinate_option_rules",
    "policy_axis_scale",
    "policy_indices",
    "random_axis_indices",
    "random_lattice_indices",
    "random_scale_shift",
    "scale_frequencies",
]

#: The rule of each coordinate option (bounded where float32 positions and the random-position pool stay sane).
COORDINATE_OPTION_CHECKS: dict[str, OptionCheck] = {
    "coord_shift": Real(0, 1e3),
    "coord_jitter": Real(1, 1e3),
    "coord_rescale": Real(1, 1e3),
    "random_positions": Real(1, 1e3),
}
#: The identity value of each option (augmentation off).
COORDINATE_OPTION_DEFAULTS: dict[str, float] = {"coord_shift": 0.0, "coord_jitter": 1.0, "coord_rescale": 1.0, "random_positions": 1.0}
#: DINOv3's option names -> vispe's (``None`` there means off).
DINOV3_COORDINATE_ALIASES: dict[str, str] = {"shift_coords": "coord_shift", "jitter_coords": "coord_jitter",
                                             "rescale_coords": "coord_rescale"}


# ---------------------------------------------------------------------------------------------
# resolution policies on coordinates
# ---------------------------------------------------------------------------------------------
def policy_axis_scale(policy: str | None, shape: Sequence[int], train: Sequence[int]) -> tuple[float, ...] | None:
    """Per axis, the factor ``train / size`` that ``rescale`` multiplies positions (and offsets) by on grid ``shape``;
    ``None`` under the other policies or on the training grid (positions as they are)."""
    if policy != "rescale" or tuple(shape) == tuple(train):
        return None
    if len(train) != len(shape):
        raise ValueError(f"rescale: the training grid {tuple(train)} has {len(train)} axes but the grid {tuple(shape)} has {len(shape)}")
    return tuple(t / s for t, s in zip(train, shape))


def policy_indices(grid: PositionGrid, policy: str | None, train: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """The ``(N, ndim)`` float32 lattice indices of ``grid`` under ``policy``: scaled onto ``train``'s index range under
    ``rescale`` (:func:`policy_axis_scale`), the grid's own otherwise."""
    return grid.indices(device, rescale_to=train if policy_axis_scale(policy, grid.shape, train) is not None else None)


def scale_frequencies(freqs: torch.Tensor, policy: str | None, growth: float, train_len: int,
                      yarn_alpha: float = 1.0, yarn_beta: float = 32.0) -> torch.Tensor:
    """The rotary frequencies ``freqs`` (``(..., P)``, those multiplying one grid axis) under ``ntk`` / ``yarn`` on an
    axis grown ``growth = size / train_len`` times; unchanged under the other policies and where the axis did not grow.

    ``ntk`` multiplies each frequency by ``growth^-e``, ``e`` its place between the highest (0) and lowest (1)
    frequency on a log scale (on a ``theta^(-k/n)`` ladder exactly NTK-aware scaling, base
    ``theta * growth^(n/(n-1))``); ``yarn`` keeps the frequencies that turn more than ``yarn_beta`` times across the
    training axis, interpolates those under ``yarn_alpha`` turns, and blends linearly in between (YaRN's ramp,
    without its attention temperature)."""
    if policy not in ("ntk", "yarn") or growth <= 1.0 or freqs.shape[-1] == 0:
        return freqs
    mag = freqs.abs()
    if policy == "ntk":
        tiny = torch.finfo(torch.float32).tiny
        log_mag = mag.clamp_min(tiny).log()
        hi = log_mag.amax(-1, keepdim=True)
        span = hi - log_mag.amin(-1, keepdim=True)
        # e = 0 at the highest frequency, 1 at the lowest; a single (or flat) set is left as it is
        e = torch.where(span > 0, (hi - log_mag) / span.clamp_min(tiny), torch.zeros_like(log_mag))
        return freqs * torch.exp(-e * math.log(growth))
    turns = mag * train_len / (2 * math.pi)
    keep = ((turns - yarn_alpha) / (yarn_beta - yarn_alpha)).clamp(0.0, 1.0)
    return freqs * (keep + (1.0 - keep) / growth)


def coordinate_option_rules(names: Sequence[str]) -> dict[str, OptionCheck]:
    """The rules of the coordinate options ``names`` (vispe's or DINOv3's names; DINOv3's also take ``None``)."""
    rules: dict[str, OptionCheck] = {}
    for name in names:
        if name in COORDINATE_OPTION_CHECKS:
            rules[name] = COORDINATE_OPTION_CHECKS[name]
        elif name in DINOV3_COORDINATE_ALIASES:
            rule = COORDINATE_OPTION_CHECKS[DINOV3_COORDINATE_ALIASES[name]]
            rules[name] = Real(rule.low, rule.high, optional=True)  # type: ignore[attr-defined]
        else:
            raise ValueError(f"unknown coordinate option {name!r}; choose from "
                             f"{list(COORDINATE_OPTION_CHECKS) + list(DINOV3_COORDINATE_ALIASES)}")
    return rules


def random_axis_indices(shape: Sequence[int], pool: Sequence[int], device: torch.device | str | None = None) -> list[torch.Tensor]:
    """Per axis, ``shape[a]`` distinct integers drawn from ``range(pool[a])`` and sorted (float32 on ``device``)."""
    if len(pool) != len(shape) or any(int(m) < int(n) for n, m in zip(shape, pool)):
        raise ValueError(f"random_lattice_indices: pool {tuple(pool)} must have one size >= the grid's per axis {tuple(shape)}")
    return [torch.randperm(int(m))[: int(n)].sort().values.to(device=device, dtype=torch.float32) for n, m in zip(shape, pool)]


def random_lattice_indices(
    shape: Sequence[int], pool: Sequence[int], device: torch.device | str | None = None
) -> torch.Tensor:
    """Randomized positions (RPE-2D style): per axis, ``shape[a]`` distinct integers drawn from ``range(pool[a])``
    and sorted, so the tokens keep their order along every axis while their indices span a larger grid. Returns
    ``(N, ndim)`` float32 in the row-major order of :meth:`PositionGrid.indices` (equal to it when ``pool == shape``).
    """
    mesh = torch.meshgrid(*random_axis_indices(shape, pool, device), indexing="ij")
    return torch.stack([m.reshape(-1) for m in mesh], dim=-1)


def random_scale_shift(
    ndim: int, coord_shift: float = 0.0, coord_jitter: float = 1.0, coord_rescale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One draw of DINOv3-style coordinate augmentation for ``ndim`` axes (CPU float32, shared by the batch):
    per-axis scale = one factor log-uniform in ``[1/coord_rescale, coord_rescale]`` times the axis's own in
    ``[1/coord_jitter, coord_jitter]``, and per-axis shift uniform in ``[-coord_shift, coord_shift]`` (the caller's
    units). Bounds of 1 (0 for the shift) give the identity; the draws are made either way."""

    def log_uniform(bound: float, n: int) -> torch.Tensor:
        return torch.exp((torch.rand(n) * 2 - 1) * math.log(bound))

    scale = log_uniform(coord_rescale, 1) * log_uniform(coord_jitter, ndim)
    shift = (torch.rand(ndim) * 2 - 1) * coord_shift
    return scale, shift


class CoordinateAugmentation:
    """Mixin of the lattice encodings that take coordinate options: the values (identity by default), whether a
    forward draws, and the draws. Each encoding applies the drawn numbers in its own coordinate frame."""

    coord_shift: float = 0.0
    coord_jitter: float = 1.0
    coord_rescale: float = 1.0
    random_positions: float = 1.0
    #: the options this encoding takes (see :attr:`vispe.encodings.base.PositionalEncoding.coordinate_options`)
    coordinate_options: ClassVar[tuple[str, ...]] = tuple(COORDINATE_OPTION_CHECKS)

    def set_coordinate_augmentation(
        self,
        coord_shift: float = 0.0,
        coord_jitter: float = 1.0,
        coord_rescale: float = 1.0,
        random_positions: float = 1.0,
    ) -> None:
        """Check (:data:`COORDINATE_OPTION_CHECKS`, the error naming the option and value) and keep the values."""
        owner = getattr(self, "registry_name", "") or type(self).__name__
        values = {"coord_shift": coord_shift, "coord_jitter": coord_jitter, "coord_rescale": coord_rescale,
                  "random_positions": random_positions}
        for name, value in values.items():
            COORDINATE_OPTION_CHECKS[name].check(f"{owner}: {name}", value)
        for name, value in values.items():
            setattr(self, name, float(value))

    @property
    def moves_coordinates(self) -> bool:
        """A scale or shift is drawn per training forward (``coord_shift`` / ``coord_jitter`` / ``coord_rescale`` on)."""
        return self.coord_shift > 0 or self.coord_jitter > 1 or self.coord_rescale > 1

    @property
    def augments_coordinates(self) -> bool:
        """Training-time coordinate augmentation is on (and the module is in training mode)."""
        return bool(self.training) and (self.moves_coordinates or self.random_positions > 1)  # type: ignore[attr-defined]

    def random_position_pools(self, shape: Sequence[int], reference: Sequence[int]) -> list[int]:
        """Per axis, how many positions ``random_positions`` draws from: ``ceil(r * reference)``, at least the grid's."""
        return [max(int(n), math.ceil(self.random_positions * g)) for n, g in zip(shape, reference)]

    def draw_scale_shift(self, ndim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This forward's per-axis scale and shift (:func:`random_scale_shift`; CPU float32)."""
        return random_scale_shift(ndim, self.coord_shift, self.coord_jitter, self.coord_rescale)

    def augment_about(self, coords: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
        """``coords`` ``(N, ndim)`` scaled about ``centre`` and shifted (one :meth:`draw_scale_shift`)."""
        scale, shift = self.draw_scale_shift(coords.shape[-1])
        return (coords - centre) * scale.to(coords.device) + centre + shift.to(coords.device)

    def augment_dinov3(self, coords: torch.Tensor) -> torch.Tensor:
        """DINOv3's order and calls on ``coords`` ``(N, ndim)``: add a shift per axis, multiply by a jitter per axis,
        then by one rescale, each drawn on ``coords``' device and only when on (DINOv3 draws and discards)."""
        num_axes = coords.shape[-1]
        like = dict(device=coords.device, dtype=coords.dtype)
        if self.coord_shift > 0:
            coords = coords + torch.empty(num_axes, **like).uniform_(-self.coord_shift, self.coord_shift)
        if self.coord_jitter > 1:
            bound = math.log(self.coord_jitter)
            coords = coords * torch.empty(num_axes, **like).uniform_(-bound, bound).exp()
        if self.coord_rescale > 1:
            bound = math.log(self.coord_rescale)
            coords = coords * torch.empty(1, **like).uniform_(-bound, bound).exp()
        return coords

    def coordinate_repr(self) -> str:
        """``", coord_shift=1.0, ..."`` for the options not at their identity value (for ``extra_repr``)."""
        return "".join(f", {k}={getattr(self, k)}" for k, off in COORDINATE_OPTION_DEFAULTS.items() if getattr(self, k) != off)
