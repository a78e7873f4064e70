"""RoPE-Axial and RoPE-Mixed (Heo et al., ECCV 2024, "Rotary Position Embedding for Vision Transformer")
over lattices of any number of axes: images ``(h, w)`` and videos ``(t, h, w)`` are the same classes.

Both rotate adjacent channel pairs ``(2k, 2k+1)`` of each head (``P = head_dim / 2`` pairs) by angles
built from integer lattice indices; prefix tokens (cls, registers) are not rotated. The number of axes
is the length of the training ``grid_size``. The pairs are cut into one chunk per axis, in the order
``chunk_axes`` (grid axis of each chunk): on 2D grids Heo et al.'s and timm's order, column (``x``)
first, then row (``y``); on other grids the axes in grid order (``t, h, w``). timm's Eva models
``vit_*_patch16_rope_224`` / ``..._rope_mixed_224`` implement the same 2D maths and serve as the test
oracle. The registered ``rope_axial_3d`` / ``rope_mixed_3d`` are these classes with video defaults.
"""
from __future__ import annotations

from typing import ClassVar, Sequence

import torch
import torch.nn as nn
from timm.layers.pos_embed_sincos import init_random_2d_freqs

from .._checks import Choice, Int, Ints, Real, check_choice
from .base import register_encoding, register_preset
from .coordinates import CoordinateAugmentation, policy_indices, random_lattice_indices, scale_frequencies
from .grid import PositionGrid
from .resolution import ResolutionContract
from .rotary import RotaryEncoding

__all__ = ["RopeAxial", "RopeMixed", "RopeAxial3d", "RopeMixed3d", "grid_thw", "default_chunk_axes", "lattice_coordinates",
           "GRID_TYPES", "NORMALIZE_COORDS_MODES", "COORD_AUG_STYLES"]

#: Coordinates the rotations are built from (timm's ``grid_type``): ``index`` (integer lattice indices),
#: ``pixel`` (each axis evenly spaced in ``[-1, 1]``, ends included), ``centered`` (patch centres divided by the
#: ``normalize_coords`` denominator, mapped to ``[-1, 1]``: DINOv3's).
GRID_TYPES = ("index", "pixel", "centered")
#: The denominator of ``centered`` coordinates: each axis its own size, or the image plane's smaller / larger side.
NORMALIZE_COORDS_MODES = ("separate", "min", "max")
#: How training-time coordinate augmentation moves the coordinates: ``centre`` (scale about the training grid's
#: centre, then shift; vispe's draws) or ``timm`` (timm 1.0.31's / DINOv3's: shift, per-axis jitter, shared rescale
#: about the coordinate origin, drawn in that order in the chunk order of the axes, so a seed gives timm's draws).
COORD_AUG_STYLES = ("centre", "timm")


def lattice_coordinates(grid: PositionGrid, grid_type: str = "index", normalize_coords: str = "separate",
                        device=None) -> torch.Tensor:
    """``(N, ndim)`` float32 coordinates of ``grid``'s lattice in row-major token order (see :data:`GRID_TYPES`).

    The same float32 operations as timm's ``_build_grid``; ``normalize_coords='min'`` / ``'max'`` share the image
    plane's (last two axes') denominator, and a time axis keeps its own length (equal to timm's rule in 2D)."""
    if grid_type == "index":
        return grid.indices(device)
    shape = grid.shape
    if grid_type == "pixel":
        axes = [torch.linspace(-1.0, 1.0, steps=n, device=device, dtype=torch.float32) for n in shape]
    else:
        denom = [float(n) for n in shape]
        if normalize_coords != "separate":
            plane = shape[-2:]
            d = float(min(plane) if normalize_coords == "min" else max(plane))
            denom[-len(plane):] = [d] * len(plane)
        axes = [torch.arange(0.5, n, device=device, dtype=torch.float32) / d for n, d in zip(shape, denom)]
    mesh = torch.meshgrid(*axes, indexing="ij")
    coords = torch.stack([m.reshape(-1) for m in mesh], dim=-1)
    return 2.0 * coords - 1.0 if grid_type == "centered" else coords


def grid_thw(grid: PositionGrid, device, train_grid: Sequence[int] | None = None) -> torch.Tensor:
    """Integer ``(t, h, w)`` indices ``(N, 3)`` float32; with ``train_grid`` rescaled into its index range (the
    ``rescale`` policy: :func:`vispe.encodings.coordinates.policy_indices`)."""
    return grid.indices(device, rescale_to=train_grid)


def default_chunk_axes(ndim: int) -> tuple[int, ...]:
    """Grid axis of each pair chunk: ``(1, 0)`` (x then y, Heo et al. / timm) in 2D, grid order otherwise."""
    return (1, 0) if ndim == 2 else tuple(range(ndim))


def _training_grid(grid_size: Sequence[int]) -> tuple[int, ...]:
    gs = tuple(int(g) for g in grid_size)
    if not gs or min(gs) < 1:
        raise ValueError(f"grid_size must be a non-empty tuple of positive sizes, got {grid_size!r}")
    return gs


def _check_chunk_axes(name: str, chunk_axes: Sequence[int] | None, ndim: int) -> tuple[int, ...]:
    if chunk_axes is None:
        return default_chunk_axes(ndim)
    axes = tuple(chunk_axes)
    if sorted(axes) != list(range(ndim)):
        raise ValueError(f"{name}: chunk_axes must be a permutation of the grid's axes {tuple(range(ndim))}, got {chunk_axes!r}")
    return axes


class _LatticeRotary(CoordinateAugmentation, RotaryEncoding):
    """What RoPE-Axial and RoPE-Mixed share: the training grid, the extrapolation policy, the chunk order, the
    training-time coordinate augmentation (:mod:`vispe.encodings.coordinates`).

    Resolution policies on a grid other than the training one, per axis with scale ``s = size / train``:
    ``extend`` (the paper's, default: the new integer indices), ``rescale`` (alias ``interpolate``: indices times
    ``1/s``, i.e. every frequency divided by ``s``), and on a larger axis (``s > 1``; otherwise they are ``extend``)
    two per-frequency rescalings from LLM context extension, ``ntk`` and ``yarn``
    (:func:`vispe.encodings.coordinates.scale_frequencies`; the ramp's bounds are :attr:`yarn_alpha` /
    :attr:`yarn_beta` turns across the training grid).
    """

    resolution = ResolutionContract(("extend", "rescale", "ntk", "yarn"), default="extend")
    yarn_alpha: ClassVar[float] = 1.0
    yarn_beta: ClassVar[float] = 32.0

    #: option rules, checked before __init__ (vispe._checks; see PositionalEncoding.option_checks); the
    #: extrapolation and coordinate options' rules come from extrapolation_policies / coordinate_options
    option_checks = {
        "head_dim": Int(2, multiple_of=2),
        "theta": Real(1),  # the base of the ladder theta^(-2i/d); below 1 the ladder grows (and overflows near 0)
        "sections": Ints(0, optional=True),
        "chunk_axes": Ints(0, optional=True),  # a permutation of the grid axes: checked with the grid below
        "grid_type": Choice(GRID_TYPES),
        "normalize_coords": Choice(NORMALIZE_COORDS_MODES),
        "coord_aug_style": Choice(COORD_AUG_STYLES),
    }

    def __init__(
        self,
        name: str,
        head_dim: int,
        grid_size: Sequence[int],
        extrapolation: str | None,
        chunk_axes: Sequence[int] | None,
        coord_shift: float = 0.0,
        coord_jitter: float = 1.0,
        coord_rescale: float = 1.0,
        random_positions: float = 1.0,
        grid_type: str = "index",
        normalize_coords: str = "separate",
        coord_aug_style: str = "centre",
    ) -> None:
        super().__init__()
        self.extrapolation = extrapolation
        self.set_coordinate_augmentation(coord_shift, coord_jitter, coord_rescale, random_positions)
        if head_dim % 2:
            raise ValueError(f"{name} rotates channel pairs and needs an even head_dim, got head_dim={head_dim}")
        check_choice(f"{name}: grid_type", grid_type, GRID_TYPES)
        check_choice(f"{name}: normalize_coords", normalize_coords, NORMALIZE_COORDS_MODES)
        check_choice(f"{name}: coord_aug_style", coord_aug_style, COORD_AUG_STYLES)
        if grid_type != "index" and not self.resolution.keeps_positions(extrapolation, name):
            raise ValueError(f"{name}: grid_type={grid_type!r} maps every grid into the same [-1, 1] box, so extrapolation="
                             f"{extrapolation!r} has nothing to rescale; use extrapolation='extend' or grid_type='index'")
        if grid_type != "index" and random_positions != 1.0:
            raise ValueError(f"{name}: random_positions={random_positions!r} draws integer lattice indices and needs "
                             f"grid_type='index', got grid_type={grid_type!r}")
        self.head_dim = head_dim
        self.grid_size = _training_grid(grid_size)
        self.chunk_axes = _check_chunk_axes(name, chunk_axes, len(self.grid_size))
        self.grid_type, self.normalize_coords, self.coord_aug_style = grid_type, normalize_coords, coord_aug_style

    def cacheable(self) -> bool:
        # augmented coordinates are drawn anew every forward
        return not self.augments_coordinates and super().cacheable()

    def augment_coordinates(self, idx: torch.Tensor) -> torch.Tensor:
        """DINOv3-style coordinate augmentation, one draw per forward (shared by the batch): about the grid
        centre, scale every axis by one factor log-uniform in ``[1/coord_rescale, coord_rescale]`` and each
        axis by its own in ``[1/coord_jitter, coord_jitter]``, then shift each axis by a uniform
        ``[-coord_shift, coord_shift]`` patches. Angles stay linear in the coordinates, so attention still
        depends only on offsets (rescaled ones). ``coord_aug_style='timm'``: timm's moves and draws instead
        (:data:`COORD_AUG_STYLES`), the axes taken in chunk order (2D: x, y, as timm's ``'xy'`` grids)."""
        if self.coord_aug_style == "timm":
            order = list(self.chunk_axes)
            out = torch.empty_like(idx)
            out[:, order] = self.augment_dinov3(idx[:, order])
            return out
        centre = [(g - 1) / 2 for g in self.grid_size] if self.grid_type == "index" else [0.0] * len(self.grid_size)
        return self.augment_about(idx, idx.new_tensor(centre))

    def check_grid(self, grid: PositionGrid) -> None:
        # any number of axes: the training grid fixes it (``grid_ndims`` only says which hosts a name is listed for)
        if grid.ndim != len(self.grid_size):
            raise ValueError(
                f"{self.registry_name!r} takes {len(self.grid_size)}-axis grids (it was built for grid_size={self.grid_size}), "
                f"got the {grid.ndim}-axis grid {grid.shape}; build it with a {grid.ndim}-axis grid_size or pick a variant "
                "for this grid (see vispe.list_encodings())"
            )

    def lattice_indices(self, grid: PositionGrid, device) -> torch.Tensor:
        """``(N, ndim)`` float32 indices under the resolution policy (rescaled into the training grid's range under
        ``rescale``), augmented while training."""
        self.check_grid(grid)
        if self.training and self.random_positions > 1:
            # RPE-2D: ordered random indices from a grid random_positions x the training one (train only)
            idx = random_lattice_indices(grid.shape, self.random_position_pools(grid.shape, self.grid_size), device)
        elif self.grid_type != "index":
            idx = lattice_coordinates(grid, self.grid_type, self.normalize_coords, device)
        else:
            idx = policy_indices(grid, self.resolution_policy, self.grid_size, device)
        return self.augment_coordinates(idx) if self.augments_coordinates else idx

    def scaled_frequencies(self, freqs: torch.Tensor, axis: int, grid: PositionGrid) -> torch.Tensor:
        """``freqs`` (``(..., P_axis)``, the frequencies multiplying grid axis ``axis``) under the ``ntk`` /
        ``yarn`` policies on ``grid`` (:func:`~vispe.encodings.coordinates.scale_frequencies`)."""
        return scale_frequencies(freqs, self.resolution_policy, grid.shape[axis] / self.grid_size[axis], self.grid_size[axis],
                                 self.yarn_alpha, self.yarn_beta)


@register_encoding("rope_axial")
class RopeAxial(_LatticeRotary):
    """RoPE-Axial: the pairs are cut into one chunk per axis (``sections`` pairs each, in grid-axis order);
    pair ``k`` of an axis's chunk rotates by ``t_axis * theta^(-k / n_axis)`` (``n_axis`` = the chunk's
    size). No parameters.

    2D defaults are the paper's: two equal chunks, ``theta = 100``, so ``theta_k = 100^(-4k/dh)``.
    Default ``sections`` on ``A`` axes: ``P // A`` pairs per axis, the remainder to the first axis
    (``t`` in video). ``extrapolation='extend'`` (paper, default) uses the new grid's integer indices;
    ``'rescale'`` (alias ``'interpolate'``) rescales them into the training grid's range; ``'ntk'`` / ``'yarn'``
    rescale the frequencies of a grown axis (see :class:`_LatticeRotary`). ``grid_type`` / ``normalize_coords`` pick
    timm's coordinates (:data:`GRID_TYPES`; ``pixel`` and ``centered`` take ``extrapolation='extend'``),
    ``coord_aug_style`` how the coordinate options move them (:data:`COORD_AUG_STYLES`). The same three options apply
    to ``rope_mixed``.
    """

    grid_ndims = (2,)

    def __init__(
        self,
        head_dim: int,
        grid_size: Sequence[int] = (14, 14),
        theta: float = 100.0,
        extrapolation: str | None = None,
        sections: Sequence[int] | None = None,
        chunk_axes: Sequence[int] | None = None,
        coord_shift: float = 0.0,
        coord_jitter: float = 1.0,
        coord_rescale: float = 1.0,
        random_positions: float = 1.0,
        grid_type: str = "index",
        normalize_coords: str = "separate",
        coord_aug_style: str = "centre",
    ) -> None:
        name = self.registry_name
        super().__init__(name, head_dim, grid_size, extrapolation, chunk_axes, coord_shift, coord_jitter, coord_rescale,
                         random_positions, grid_type, normalize_coords, coord_aug_style)
        ndim, P = len(self.grid_size), head_dim // 2
        if sections is None:
            if ndim == 2 and head_dim % 4:
                raise ValueError(
                    f"{name} splits each head into 2 axes x pairs and needs head_dim divisible by 4; got head_dim={head_dim} "
                    "(embed_dim / num_heads). Choose num_heads so that embed_dim/num_heads is a multiple of 4."
                )
            if P < ndim:
                raise ValueError(f"{name} needs at least one pair per axis: head_dim >= {2 * ndim} for {ndim} axes, got head_dim={head_dim}")
            per_axis = P // ndim
            sections = (P - (ndim - 1) * per_axis,) + (per_axis,) * (ndim - 1)
        sec = tuple(sections)
        if len(sec) != ndim or any(not isinstance(s, int) or s < 0 for s in sec) or sum(sec) != P:
            raise ValueError(
                f"{name}: sections must be {ndim} non-negative pair counts (one per grid axis) summing to P = head_dim/2 = {P}, got {sections!r}"
            )
        self.sections = sec
        self.theta = float(theta)

    def bands(self, n: int, device) -> torch.Tensor:
        """``theta^(-k/n)`` for ``k < n``, computed as timm's ``freq_bands`` does (``1 / theta^(k/n)``)."""
        exp = torch.arange(0, n, 1, dtype=torch.int64, device=device).to(torch.float32) / max(n, 1)
        return 1.0 / (self.theta**exp)

    def angles(self, grid, device):
        idx = self.lattice_indices(grid, device)
        chunks = [idx[:, a, None] * self.scaled_frequencies(self.bands(self.sections[a], device), a, grid) for a in self.chunk_axes]
        return torch.cat(chunks, dim=-1)  # (N, P)


@register_encoding("rope_mixed", groups=("scaling",))
class RopeMixed(_LatticeRotary):
    """RoPE-Mixed: learned per-layer, per-head frequencies, one per axis for every pair; angle
    ``sum_a f_a t_a``. ``freqs`` has shape ``(ndim, depth, H, P)``, row ``a`` multiplying grid axis
    ``chunk_axes[a]`` (2D: ``(f_x, f_y)``, timm's layout; video: ``(f_t, f_y, f_x)``).

    The last two axes (the image plane) start from timm's / naver's init: magnitudes ``theta^(-4j/dh)``,
    ``theta = 10``, with a random direction per head. Earlier axes (time) start from a ladder
    ``temporal_theta^(-j/P)`` over all pairs (``temporal_init='ladder'``, EVA02-AT-style joint
    space-time RoPE at init) or from zero (``'zero'``: an image model at init). ``freqs`` is excluded
    from weight decay.
    """

    grid_ndims = (2,)
    per_layer = True
    layer_schedules = ("nope_layers", "rotary_fraction")  # learned frequencies: theta only initialises them

    #: option rules, checked before __init__ (vispe._checks; see PositionalEncoding.option_checks)
    option_checks = {"temporal_theta": Real(1), "temporal_init": Choice(("ladder", "zero"))}

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        depth: int,
        grid_size: Sequence[int] = (14, 14),
        theta: float = 10.0,
        extrapolation: str | None = None,
        temporal_theta: float = 100.0,
        temporal_init: str = "ladder",
        chunk_axes: Sequence[int] | None = None,
        coord_shift: float = 0.0,
        coord_jitter: float = 1.0,
        coord_rescale: float = 1.0,
        random_positions: float = 1.0,
        grid_type: str = "index",
        normalize_coords: str = "separate",
        coord_aug_style: str = "centre",
    ) -> None:
        name = self.registry_name
        super().__init__(name, head_dim, grid_size, extrapolation, chunk_axes, coord_shift, coord_jitter, coord_rescale,
                         random_positions, grid_type, normalize_coords, coord_aug_style)
        if head_dim % 4:
            raise ValueError(
                f"{name} needs head_dim divisible by 4 (RoPE-Mixed init); got head_dim={head_dim} (embed_dim / num_heads). "
                "Choose num_heads so that embed_dim/num_heads is a multiple of 4."
            )
        check_choice("temporal_init", temporal_init, ("ladder", "zero"))
        self._init = dict(head_dim=head_dim, num_heads=num_heads, depth=depth, theta=theta, temporal_theta=temporal_theta,
                          temporal_init=temporal_init)
        self.freqs = nn.Parameter(torch.empty(len(self.chunk_axes), depth, num_heads, head_dim // 2))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The paper's init: random rotated 2D frequencies for (x, y), a frequency ladder (or zeros) for time."""
        c = self._init
        ndim, P = len(self.grid_size), c["head_dim"] // 2
        fxy = init_random_2d_freqs(c["head_dim"], c["depth"], c["num_heads"], temperature=c["theta"], rotate=True)  # (2, depth, H, P)
        if c["temporal_init"] == "ladder":
            ft = (c["temporal_theta"] ** (-torch.arange(P, dtype=torch.float32) / P)).expand(c["depth"], c["num_heads"], P)
        else:
            ft = torch.zeros(c["depth"], c["num_heads"], P)
        by_axis = {ndim - 1: fxy[0], ndim - 2: fxy[1]}
        with torch.no_grad():
            init = torch.stack([by_axis[a] if a in by_axis else ft.clone() for a in self.chunk_axes])
            self.freqs.copy_(init.to(self.freqs.device))

    def angles(self, grid, device):
        idx = self.lattice_indices(grid, device)
        f = self.freqs.float()
        # (depth, H, N, P): per axis an outer product by broadcasting, summed in chunk order (float32 under autocast)
        terms = (idx[:, a, None] * self.scaled_frequencies(f[i], a, grid)[..., None, :] for i, a in enumerate(self.chunk_axes))
        out = next(terms)
        for t in terms:
            out = out + t
        return out

    def no_weight_decay(self) -> set[str]:
        return {"freqs"}

    def load_timm_rope_freqs(self, freqs: torch.Tensor) -> dict[str, torch.Tensor]:
        # timm's Eva RoPE-Mixed stores the same (2, depth, heads, dh/4) frequencies in the same pair order
        if len(self.grid_size) != 2 or self.chunk_axes != (1, 0):
            raise ValueError(f"timm RoPE-Mixed frequencies are 2D (x, y); this {self.registry_name!r} has chunk_axes={self.chunk_axes}")
        return {"freqs": freqs}


# -- video presets: the same classes with (t, h, w) defaults (a registered name = class + default options) --------

@register_preset("rope_axial_3d", grid_size=(8, 14, 14))
class RopeAxial3d(RopeAxial):
    """:class:`RopeAxial` on ``(t, h, w)`` video lattices: chunks ``[t | h | w]``, default ``sections``
    ``(P - 2*(P//3), P//3, P//3)``. With ``sections=(0, P/2, P/2)`` a single frame gets 2D rope_axial's
    ladders (chunks in ``(h, w)`` order instead of ``(x, y)``)."""

    grid_ndims = (3,)


@register_preset("rope_mixed_3d", grid_size=(8, 14, 14))
class RopeMixed3d(RopeMixed):
    """:class:`RopeMixed` on ``(t, h, w)`` video lattices: ``freqs`` ``(3, depth, H, P)`` = ``(f_t, f_y, f_x)``."""

    grid_ndims = (3,)
