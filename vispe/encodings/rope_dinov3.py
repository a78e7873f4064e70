"""DINOv3's RoPE (Siméoni et al., "DINOv3", arXiv 2508.10104, 2025) on images and, as a vispe extension, videos.

DINOv3 uses an axial RoPE without parameters whose positions are not integer patch indices but patch
centres normalised into the box ``[-1, 1]``:

* coordinates: along an axis of ``s`` patches, ``c_i = 2 * (i + 0.5) / d - 1`` with the denominator ``d``
  set by ``normalize_coords``: ``'separate'`` (default; ``d = s``, each axis spans ``[-1, 1]``), ``'min'``
  (``d = min(h, w)``: the short side spans ``[-1, 1]``, the long one more) or ``'max'``
  (``d = max(h, w)``: the long side spans ``[-1, 1]``). Any grid maps into the same box, so there is
  no extrapolation policy to choose: a larger image is a denser sampling of the same box.
* periods: the ``P = head_dim / 2`` rotation pairs are cut into one chunk per axis (``h`` then ``w``:
  grid order, not rope_axial's ``x`` first); pair ``k`` of a chunk of ``n`` pairs rotates by
  ``2 * pi * c / period_k`` with ``period_k = base^(k / n)`` (``base = 100`` by default, as DINOv3's
  released models) or, given ``min_period`` and ``max_period``, ``period_k = min_period *
  (max_period / min_period)^(k / (n - 1))`` (a geometric ladder from ``min_period`` to ``max_period``).
  With ``base``, this is RoPE-Axial's ``base^(-k/n)`` frequency ladder applied to the coordinates
  ``2 * pi * c``, hence the subclass of :class:`~vispe.encodings.rope_vit.RopeAxial`.
* training-time augmentation (off in eval and by default; DINOv3's released models trained with
  ``rescale_coords=2``, the paper's "RoPE-box jittering"), one draw per forward shared by the batch,
  in DINOv3's order: add a shift uniform in ``[-shift_coords, shift_coords]`` per axis, then multiply
  each axis by its own factor log-uniform in ``[1/jitter_coords, jitter_coords]``, then every axis by
  one factor log-uniform in ``[1/rescale_coords, rescale_coords]``. Units are the normalised ones (the
  box is 2 wide), not patches as in rope_axial's ``coord_shift``. The draws use the same calls in the
  same order as DINOv3 and timm, so a seeded run draws the same numbers (an option at its identity
  value, 0 or 1, draws nothing here, where DINOv3 draws and discards).
* layout: DINOv3 and timm (``rotate_half=True``) pair channel ``i`` with ``i + P``: vispe's ``'half'``
  layout, rotated through the shared :func:`~vispe.encodings.rotary.apply_rotary`.
* prefix tokens (cls, registers) are not rotated, as in DINOv3 and timm's Eva.
* precision: coordinates, periods and angles are float32 (autocast off), as timm; DINOv3's ``dtype`` option
  (its released weights keep the periods in bfloat16) is not offered.

timm's ``RotaryEmbeddingDinoV3`` (applied as timm's Eva applies it) is the test oracle. Notes and measured
oracle differences: ``docs/design/rope-dinov3.md``.

``rope_dinov3_3d`` (video ``(t, h, w)``; timm and DINOv3 have no video version) is the same class on three
axes: chunks ``[t | h | w]``, default ``sections`` ``(P - 2*(P//3), P//3, P//3)`` as rope_axial_3d. The
time axis is normalised like a ``'separate'`` axis in every mode: tubelet centres by the clip length,
into ``[-1, 1]``; ``'min'`` / ``'max'`` act on the image plane ``(h, w)`` only. Why: frames and patches
are different units, so a min or max over ``(t, h, w)`` would tie the spatial scale to the clip length
(a short clip under ``'min'`` would stretch the image plane far outside ``[-1, 1]``); this way a clip's
frames all see the 2D encoding's spatial coordinates, and a single frame (``t = 0``) with
``sections=(0, P/2, P/2)`` is exactly ``rope_dinov3``. Augmentation draws a shift and a jitter for each
of the three axes and one rescale factor.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from .._checks import Choice, Ints, Real, check_choice
from .base import register_encoding, register_preset
from .coordinates import COORDINATE_OPTION_DEFAULTS as DEFAULT_OFF, DINOV3_COORDINATE_ALIASES
from .grid import PositionGrid
from .resolution import ResolutionContract
from .rope_vit import NORMALIZE_COORDS_MODES, RopeAxial, lattice_coordinates

__all__ = ["RopeDinoV3", "RopeDinoV3_3d", "NORMALIZE_COORDS_MODES", "dinov3_periods"]

DEFAULT_BASE = 100.0


def dinov3_periods(
    num_pairs: int,
    base: float | None = DEFAULT_BASE,
    min_period: float | None = None,
    max_period: float | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """float32 periods ``(num_pairs,)`` of one axis: ``base^(k/n)``, or geometric from ``min_period`` to
    ``max_period`` when both are given (then ``base`` is ignored)."""
    if min_period is not None and max_period is not None:
        # one pair: linspace(0, 1, 1) = [0], i.e. the single period is min_period
        exponents = torch.linspace(0.0, 1.0, num_pairs, dtype=torch.float32, device=device)
        return min_period * ((max_period / min_period) ** exponents)
    exponents = torch.arange(num_pairs, dtype=torch.float32, device=device) / max(num_pairs, 1)
    return base**exponents


def _check_positive(name: str, value: float) -> float:
    v = float(value)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return v


@register_encoding("rope_dinov3", paper="2508.10104")
class RopeDinoV3(RopeAxial):
    """DINOv3's RoPE: axial, no parameters, patch centres normalised into ``[-1, 1]`` (see the module doc).

    Args:
        head_dim: per-head width (from the model); ``head_dim / 2`` rotation pairs.
        grid_size: training lattice (from the model); fixes the number of axes.
        base: period base, default 100 (DINOv3's); not together with ``min_period`` / ``max_period``.
        min_period, max_period: a period range instead of ``base`` (both or neither).
        normalize_coords: ``'separate'`` (default), ``'min'`` or ``'max'``: the denominator of the coordinates.
        shift_coords: training only, largest random shift per axis (normalised units); ``None``/0: off.
        jitter_coords: training only, per-axis scale factor bound ``J >= 1`` (log-uniform in ``[1/J, J]``); ``None``/1: off.
        rescale_coords: training only, shared scale factor bound ``R >= 1``; ``None``/1: off. DINOv3 trained with 2.
        sections: pairs per axis, in grid order; default equal (2D: ``head_dim`` must be divisible by 4).
    """

    grid_ndims = (2,)
    layout = "half"
    #: every grid maps into the same [-1, 1] box: nothing to choose on a new grid
    resolution = ResolutionContract()
    #: DINOv3's names of the shared coordinate options (vispe.encodings.coordinates)
    coordinate_options = tuple(DINOV3_COORDINATE_ALIASES)

    #: option rules, checked before __init__ (vispe._checks; see PositionalEncoding.option_checks)
    option_checks = {
        "base": Real(1, optional=True),
        "min_period": Real(1e-6, optional=True),  # periods near 0 overflow the frequencies 2*pi/period
        "max_period": Real(1e-6, optional=True),
        "normalize_coords": Choice(NORMALIZE_COORDS_MODES),
        "sections": Ints(0, optional=True),
    }

    layer_theta_option = "base"  # DINOv3's name for the rotary base

    def __init__(
        self,
        head_dim: int,
        grid_size: Sequence[int] = (14, 14),
        base: float | None = None,
        min_period: float | None = None,
        max_period: float | None = None,
        normalize_coords: str = "separate",
        shift_coords: float | None = None,
        jitter_coords: float | None = None,
        rescale_coords: float | None = None,
        sections: Sequence[int] | None = None,
    ) -> None:
        name = self.registry_name
        check_choice("normalize_coords", normalize_coords, NORMALIZE_COORDS_MODES)
        if (min_period is None) != (max_period is None):
            raise ValueError(f"{name}: give both min_period and max_period (or neither), got min_period={min_period!r}, "
                             f"max_period={max_period!r}")
        if min_period is not None:
            if base is not None:
                raise ValueError(f"{name}: give either base={base!r} or min_period/max_period, not both")
            min_period, max_period = _check_positive("min_period", min_period), _check_positive("max_period", max_period)
            if min_period > max_period:
                raise ValueError(f"{name}: min_period={min_period!r} must be <= max_period={max_period!r}")
        else:
            base = _check_positive("base", DEFAULT_BASE if base is None else base)
        # DINOv3's names for the shared coordinate options (None: off), checked by their declared rules
        shift, jitter, rescale = (DEFAULT_OFF[k] if v is None else float(v) for k, v in
                                  (("coord_shift", shift_coords), ("coord_jitter", jitter_coords), ("coord_rescale", rescale_coords)))
        ndim = len(tuple(grid_size))
        # the base class's coord_* switches hold DINOv3's values (normalised units) and decide when tables
        # are drawn per forward (cacheable); augment_coordinates below gives them DINOv3's meaning
        super().__init__(head_dim, grid_size, theta=base if base is not None else DEFAULT_BASE, extrapolation=None,
                         sections=sections, chunk_axes=tuple(range(ndim)), coord_shift=shift, coord_jitter=jitter,
                         coord_rescale=rescale)
        self.base = base
        self.min_period = min_period
        self.max_period = max_period
        self.normalize_coords = normalize_coords

    # -- coordinates ---------------------------------------------------------------------------
    def normalized_coordinates(self, grid: PositionGrid, device: torch.device | str | None = None) -> torch.Tensor:
        """Patch centres in the ``[-1, 1]`` box, float32 ``(N, ndim)`` in row-major token order (no augmentation)."""
        self.check_grid(grid)
        # the image plane (last two axes) shares the 'min' / 'max' denominator; time (video) keeps its own length
        return lattice_coordinates(grid, "centered", self.normalize_coords, device)

    def augment_coordinates(self, coords: torch.Tensor) -> torch.Tensor:
        """DINOv3's training-time augmentation (one draw per forward): shift, then per-axis jitter, then a
        shared rescale, drawn on ``coords``' device in that order (:meth:`CoordinateAugmentation.augment_dinov3`)."""
        return self.augment_dinov3(coords)

    def coordinates(self, grid: PositionGrid, device: torch.device | str | None = None) -> torch.Tensor:
        """The coordinates this forward rotates by: normalised, and augmented while training with augmentation on."""
        coords = self.normalized_coordinates(grid, device)
        return self.augment_coordinates(coords) if self.augments_coordinates else coords

    # -- angles ---------------------------------------------------------------------------------
    def periods(self, axis: int, device: torch.device | str | None = None) -> torch.Tensor:
        """float32 periods ``(sections[axis],)`` of grid axis ``axis``."""
        return dinov3_periods(self.sections[axis], self.base, self.min_period, self.max_period, device)

    def angles(self, grid: PositionGrid, device: torch.device | None) -> torch.Tensor:
        coords = self.coordinates(grid, device)
        # 2*pi*c / period, in this order (as DINOv3 and timm) so the float32 angles agree bit for bit
        chunks = [2 * math.pi * coords[:, a, None] / self.periods(a, device) for a in self.chunk_axes]
        return torch.cat(chunks, dim=-1)  # (N, P): [h | w] (video: [t | h | w])


@register_preset("rope_dinov3_3d", grid_size=(8, 14, 14))
class RopeDinoV3_3d(RopeDinoV3):
    """:class:`RopeDinoV3` on ``(t, h, w)`` video lattices: chunks ``[t | h | w]``, default ``sections``
    ``(P - 2*(P//3), P//3, P//3)``; time normalised by the clip length in every ``normalize_coords`` mode
    (``'min'`` / ``'max'`` act on ``(h, w)``). With ``sections=(0, P/2, P/2)`` a single frame is ``rope_dinov3``."""

    grid_ndims = (3,)
