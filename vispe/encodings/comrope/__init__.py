"""ComRoPE (Yu et al., CVPR 2025): rotary encoding with trainable, pairwise-commuting angle matrices.

Each token at coordinate ``x`` rotates q and k by ``R(x) = exp(sum_i x_i A_i)`` with commuting,
block-diagonal skew-symmetric generators: AP (axis partition) and LD (linearly dependent) variants,
2D and 3D. A member of the rotary family (:class:`~vispe.encodings.rotary.RotaryEncoding`) that rotates
by blocks through :meth:`ComRopeBase.rotate_qk`. How the rotations are built, applied and recomputed,
coordinates, and choices against the released code: ``docs/design/comrope.md``.

One module per job: :mod:`.kernels` (block rotations and their autograd Functions), :mod:`.spectral` (the
eigenbasis path), :mod:`.line_tables` (per-axis lattice line rotations and their training-time moves),
:mod:`.encodings` (the registered encodings). Every public name is importable from ``vispe.encodings.comrope``.
"""
from __future__ import annotations

from .encodings import (
    COMROPE_TIME_SCALES,
    ROTATION_METHODS,
    ComRopeAP,
    ComRopeAPBase,
    ComRopeBase,
    ComRopeLD,
    ComRopeLD3d,
    ComRopeLDBase,
)
from .kernels import (
    apply_block_rotation,
    block_matmul,
    block_rotations,
    rotate_pair,
    rotate_pair_gathered,
    rotate_pair_selected,
    rotation_from_generators,
)
from .line_tables import ComRopeState, comrope_coordinates, lattice_line_rotations, line_jitter, line_offsets
from .spectral import SPECTRAL_MIN_GAP, ComRopeSpectralState, rotate_pair_spectral, spectral_decomposition

__all__ = [
    "ComRopeBase",
    "ComRopeAPBase",
    "ComRopeLDBase",
    "ComRopeAP",
    "ComRopeLD",
    "ComRopeLD3d",
    "ComRopeState",
    "ComRopeSpectralState",
    "ROTATION_METHODS",
    "COMROPE_TIME_SCALES",
    "SPECTRAL_MIN_GAP",
    "spectral_decomposition",
    "rotate_pair_spectral",
    "block_rotations",
    "block_matmul",
    "apply_block_rotation",
    "rotate_pair",
    "rotate_pair_gathered",
    "rotate_pair_selected",
    "rotation_from_generators",
    "lattice_line_rotations",
    "line_offsets",
    "line_jitter",
    "comrope_coordinates",
]
