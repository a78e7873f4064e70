"""The ComRoPE encodings: :class:`ComRopeBase` (generators, coordinates, state, the q/k rotation) and the registered
AP / LD variants (``comrope_ap``, ``comrope_ld``, ``comrope_ld_3d``)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from ..._checks import Bool, Choice, Int, Real, check_choice
from ..base import register_encoding
from ..coordinates import CoordinateAugmentation
from ..grid import PositionGrid
from ..rotary import RotaryEncoding, RotaryState, apply_rotary, rotary_table
from .kernels import _skew, block_rotations, rotate_pair_gathered, rotate_pair_selected
from .line_tables import ComRopeState, _token_line_index, comrope_coordinates, lattice_line_rotations, line_offsets
from .spectral import SPECTRAL_MIN_GAP, ComRopeSpectralState, rotate_pair_spectral, spectral_decomposition

__all__ = ["ROTATION_METHODS", "COMROPE_TIME_SCALES", "ComRopeBase", "ComRopeAPBase", "ComRopeLDBase", "ComRopeAP",
           "ComRopeLD", "ComRopeLD3d"]

#: How ComRoPE rotates q and k: ``'auto'`` takes the spectral path whenever the generators allow it
#: (even block size, eigenvalues apart), else the block products; ``'blocks'`` always multiplies by the
#: per-token ``b x b`` block rotations.
ROTATION_METHODS = ("auto", "blocks")


#: Raised inside a compiled graph when the generators' eigenvalues come closer than :data:`SPECTRAL_MIN_GAP`.
SPECTRAL_GAP_ERROR = (
    f"ComRoPE: two eigenvalues of a generator block are closer than SPECTRAL_MIN_GAP={SPECTRAL_MIN_GAP}, so the "
    "compiled spectral path's gradient is not reliable; run this model eager (it switches to the line tables by "
    "itself) or build the encoding with rotation='blocks' or zero_init=True (compiled on the line tables)"
)


class ComRopeBase(CoordinateAugmentation, RotaryEncoding):
    """Shared machinery of the ComRoPE variants; subclasses define :meth:`coefficients`.

    A rotary encoding whose per-token rotations are commuting ``b x b`` block rotations rather than
    per-pair phases: it keeps the rotary family's attention path and overrides :meth:`rotate_qk`.
    """

    pairwise_phases = False
    layer_schedules = ("nope_layers", "rotary_fraction")  # learned generators: no rotary base to set per layer
    prefix_policy = "prefix tokens (cls, registers) sit at the grid centre (0.5, ...) and are rotated like patches"
    grid_ndims = (2,)

    @property
    def num_axes(self) -> int:
        """Grid axes the generators span: those of the grids the variant takes (its ``grid_ndims``)."""
        return self.grid_ndims[0]

    #: option rules, checked before __init__ (vispe._checks; see PositionalEncoding.option_checks)
    option_checks = {
        "block_size": Int(2),
        "init_std": Real(0, 1e3),  # larger generators no longer give finite rotations
        "zero_init": Bool(),
        "sigma": Real(0, 1e3),
        "rotation": Choice(ROTATION_METHODS),
    }  # the coordinate options' rules: vispe.encodings.coordinates (coordinate_options)

    def __init__(
        self,
        head_dim: int,
        num_heads: int,
        depth: int,
        block_size: int = 8,
        init_std: float = 1.0,
        zero_init: bool = False,
        sigma: float = 0.0,
        rotation: str = "auto",
        coord_shift: float = 0.0,
        coord_jitter: float = 1.0,
        coord_rescale: float = 1.0,
        random_positions: float = 1.0,
    ) -> None:
        super().__init__()
        check_choice("rotation", rotation, ROTATION_METHODS)
        self.set_coordinate_augmentation(coord_shift, coord_jitter, coord_rescale, random_positions)
        if not isinstance(block_size, int) or block_size < 2:
            raise ValueError(f"block_size must be an integer >= 2, got {block_size!r}")
        if head_dim % block_size:
            raise ValueError(
                f"{self.registry_name or type(self).__name__}: block_size={block_size} does not divide head_dim={head_dim}; "
                f"choose a block size among the divisors of {head_dim} (default 8)"
            )
        if sigma < 0:
            raise ValueError(f"sigma (position perturbation) must be >= 0, got {sigma}")
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.depth = depth
        self.block_size = block_size
        self.num_blocks = head_dim // block_size
        self.sigma = float(sigma)
        self.rotation = rotation
        self.init_std = init_std
        self.zero_init = zero_init
        b, m = block_size, self.num_blocks
        # raw (unconstrained) matrices P; the generator block is P - P^T
        self.base = nn.Parameter(torch.empty(depth, num_heads, m, b, b))

    def reset_parameters(self) -> None:
        if self.zero_init:
            nn.init.zeros_(self.base)
        else:
            nn.init.normal_(self.base, std=self.init_std)

    # -- to implement ----------------------------------------------------------------------
    def coefficients(self, coords: torch.Tensor) -> torch.Tensor:
        """Per-token block scalars ``(depth, H or 1, L, m)`` from coordinates ``(L, N)``."""
        raise NotImplementedError

    def axis_generators(self) -> torch.Tensor:
        """The per-axis generators ``A_i`` in block form ``(N, depth, H, m, b, b)`` (for analysis/tests)."""
        raise NotImplementedError

    # -- shared ------------------------------------------------------------------------------
    def skew_blocks(self) -> torch.Tensor:
        return _skew(self.base.float())

    def axis_line_generators(self) -> list[torch.Tensor]:
        """Per axis, the block generators that multiply that axis' coordinate (see subclasses)."""
        raise NotImplementedError

    def combine(self, tables: list[torch.Tensor], lines: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Per-axis line tables + each token's line per axis -> factor tables ``[(depth, H, m, K_a, b, b)]``
        and rows ``index (A, L, m)`` (see :class:`ComRopeState`)."""
        raise NotImplementedError

    def line_tables(self, grid: PositionGrid, device: torch.device | None) -> tuple[list[torch.Tensor], torch.Tensor]:
        """``(tables [(depth, H, m, K_a, b, b)], index (A, L, m))``: factor line tables and each
        (token, block)'s row in each; a block rotation is the product of its factors.
        ``R(x) = prod_a exp(x_a G_a)`` (the generators commute), each axis from
        :func:`lattice_line_rotations`."""
        dev = device if device is not None else self.base.device
        jitter = self.line_offsets(grid, dev)
        scales = self.axis_scales(grid)
        with torch.autocast(device_type=torch.device(dev).type, enabled=False):
            gens = self.axis_line_generators()
            if torch.is_grad_enabled() and any(g.requires_grad for g in gens):
                # the doubling products' saved operands would sit in memory through the whole
                # backward (~10-20 MiB for ViT-S); recomputing them at its end costs a few ms
                tables = [
                    checkpoint(lattice_line_rotations, gen, grid.shape[a], None if jitter is None else jitter[a],
                               scales[a], use_reentrant=False)
                    for a, gen in enumerate(gens)
                ]
            else:
                tables = [lattice_line_rotations(gen, grid.shape[a], None if jitter is None else jitter[a], scales[a])
                          for a, gen in enumerate(gens)]
            # per axis: (depth, H, m_a, n_a + 1, b, b), the last row is the centre (prefix tokens)
            return self.combine(tables, _token_line_index(grid, dev))

    def rotations(self, grid: PositionGrid, device: torch.device | None) -> torch.Tensor:
        """Dense block rotations for every layer and token: ``(depth, H, L, m, b, b)``, float32.

        Equals :meth:`reference_rotations` (one ``matrix_exp`` per token) up to float32 rounding.
        """
        state = ComRopeState.build(*self.line_tables(grid, device))
        return torch.stack([state.for_layer(i) for i in range(self.depth)])

    def axis_scales(self, grid: PositionGrid) -> tuple[float, ...]:
        """Per axis, the factor on the lattice coordinates ``(i + 0.5) / size``; default 1 (each axis in (0, 1))."""
        return (1.0,) * grid.ndim

    def coordinates(self, grid: PositionGrid, device: torch.device | str | None,
                    jitter: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """Each token's coordinates ``(S + N, ndim)``: :func:`comrope_coordinates` times :meth:`axis_scales`
        on the lattice rows (prefix tokens stay at the centre ``0.5``)."""
        coords = comrope_coordinates(grid, device, jitter)
        scales = self.axis_scales(grid)
        if any(f != 1.0 for f in scales):
            factor = torch.tensor(scales, device=coords.device, dtype=coords.dtype)
            s = grid.num_prefix_tokens
            coords = torch.cat([coords[:s], coords[s:] * factor], dim=0)
        return coords

    def reference_rotations(self, grid: PositionGrid, device: torch.device | None = None,
                            jitter: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """Direct ``matrix_exp`` of every token's block generator (slow; for tests and analysis)."""
        coords = self.coordinates(grid, device if device is not None else self.base.device, jitter)
        with torch.autocast(device_type=coords.device.type, enabled=False):
            return block_rotations(self.coefficients(coords), self.skew_blocks())

    @property
    def augments_coordinates(self) -> bool:
        """A training-time move of the coordinates is on (and the module is in training mode): the shared
        coordinate options or the paper's per-line ``sigma``."""
        # the base's getter called directly, not ``super().augments_coordinates``: dynamo in torch 2.11 cannot branch
        # on a property read through super() and breaks the graph there (tests/test_compile.py under torch 2.11)
        return CoordinateAugmentation.augments_coordinates.fget(self) or (self.training and self.sigma > 0)

    def line_offsets(self, grid: PositionGrid, device: torch.device | str | None) -> list[torch.Tensor] | None:
        """This forward's per-line coordinate offsets (:func:`line_offsets`), or ``None`` when nothing moves."""
        if not self.augments_coordinates:
            return None
        return line_offsets(grid, device, self.sigma, self.coord_shift, self.coord_jitter, self.coord_rescale,
                            self.random_positions)

    def cacheable(self) -> bool:
        if self.augments_coordinates:  # drawn anew every forward
            return False
        return not (torch.is_grad_enabled() and any(p.requires_grad for p in self.parameters()))

    def spectral_state(self, grid: PositionGrid, device: torch.device | None) -> ComRopeSpectralState | None:
        """The rotations in the generators' eigenbasis, or ``None`` where that path does not apply
        (``rotation='blocks'``, an odd block size, or eigenvalues closer than :data:`SPECTRAL_MIN_GAP`,
        e.g. ``zero_init``'s zero generators). Under ``torch.compile`` the gap cannot pick the path (a
        data-dependent branch): ``zero_init`` compiles the line tables, the rest the spectral path with the
        gap asserted in the graph (:data:`SPECTRAL_GAP_ERROR`).

        Each block generator is ``c S_j`` (AP: ``c`` the block's axis coordinate; LD: ``c = sum_i theta_ij x_i``)
        with one skew-symmetric ``S_j = Q_j J_j Q_j^T`` per (layer, head, block), so the token's block
        rotation is ``Q_j rot(c w_j) Q_j^T``: a basis change shared by all tokens and a per-pair phase. The
        outer ``Q_j`` cancels in ``q'^T k'``, so attention sees exactly ComRoPE's logits from one dense
        ``(dh x dh)`` product per head and RoPE's elementwise rotation, instead of per-token ``b x b`` products.
        """
        if self.rotation != "auto" or self.block_size % 2:
            return None
        compiling = torch.compiler.is_compiling()
        if compiling and self.zero_init:
            # compiled: the eigenvalue-gap test below is a data-dependent branch a graph cannot take. Zero-initialised
            # generators start degenerate (eager takes the line tables until they move), so their compiled graph
            # keeps the line-table path (exact for any generators, slower); the others keep the spectral path and
            # check the gap inside the graph (below)
            return None
        dev = device if device is not None else self.base.device
        with torch.autocast(device_type=torch.device(dev).type, enabled=False):
            blocks, omega, evals = spectral_decomposition(self.skew_blocks())  # (depth, H, m, b, b), (depth, H, m, b/2)
            gap_ok = evals.detach().diff(dim=-1).min() > SPECTRAL_MIN_GAP
            if compiling:
                # random generators are never this close; should training bring two eigenvalues together, the
                # spectral gradient would be wrong, so the compiled step stops instead of going on silently
                torch._assert_async(gap_ok, SPECTRAL_GAP_ERROR)
            elif not bool(gap_ok):
                return None
            coef = self.coefficients(self.coordinates(grid, dev, self.line_offsets(grid, dev)))  # (depth, H or 1, L, m)
            angles = (coef[..., None] * omega[:, :, None]).flatten(-2)  # (depth, H, L, m * b/2)
            return ComRopeSpectralState(blocks, RotaryState(rotary_table(angles), per_layer=True))

    def build_state(self, grid: PositionGrid, device: torch.device | None) -> ComRopeState | ComRopeSpectralState:  # type: ignore[override]
        state = self.spectral_state(grid, device)
        return state if state is not None else ComRopeState.build(*self.line_tables(grid, device))

    def prepare(self, grid: PositionGrid, device: torch.device | None = None) -> ComRopeState | ComRopeSpectralState:
        self.check_grid(grid)
        self.check_backend_device(device)
        key = ("comrope", grid.shape, grid.num_prefix_tokens, str(device))
        return self.cached(key, lambda: self.build_state(grid, device), uses_parameters=True)

    def keep_tokens(self, state: ComRopeState | ComRopeSpectralState, grid: PositionGrid) -> ComRopeState | ComRopeSpectralState:
        if isinstance(state, ComRopeSpectralState):
            return replace(state, rotary=state.rotary.select(grid.sequence_index()))
        return replace(state, token_index=grid.sequence_index())

    def fold_qk_basis(self, state: ComRopeState | ComRopeSpectralState,
                      layer: int = 0) -> tuple[torch.Tensor | None, ComRopeState | ComRopeSpectralState]:
        # spectral path: the basis change is linear and shared by every token, so a host may fold it into the
        # q/k projection weights; what is left is RoPE's per-pair phases
        if isinstance(state, ComRopeSpectralState) and not state.basis_folded:
            # as its diagonal blocks: the fold then costs m times fewer multiply-adds than with the dense matrix
            return state.blocks[layer], replace(state, basis_folded=True)
        return None, state

    def fused_phase_table(self, state: Any, layer: int) -> torch.Tensor | None:
        # once the host folded the basis into its projection, what is left is RoPE's per-pair phases
        sched = self.layer_schedule
        if (not isinstance(state, ComRopeSpectralState) or not state.basis_folded or layer in sched.nope_layers
                or sched.rotary_dim is not None):
            return None
        return state.rotary.real_layers[layer if state.rotary.per_layer else 0]

    def rotate_qk(self, q: torch.Tensor, k: torch.Tensor, state: ComRopeState | ComRopeSpectralState,
                  layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(state, ComRopeSpectralState):
            table = state.rotary.for_layer(layer)
            if table.shape[-2] != q.shape[-2]:
                raise ValueError(
                    f"ComRoPE rotations cover {table.shape[-2]} tokens but attention got {q.shape[-2]} "
                    f"(patch dropout must narrow the state through keep_tokens)"
                )
            if state.basis_folded:  # q and k arrive in the eigenbasis: the phases alone
                phases = state.rotary.rotation_table(layer)
                return apply_rotary(q, phases), apply_rotary(k, phases)
            return rotate_pair_spectral(q, k, state.basis(layer), table)
        n_tok = state.flat_index.shape[-1] // state.num_blocks if state.token_index is None else state.token_index.shape[1]
        if n_tok != q.shape[-2]:
            raise ValueError(
                f"ComRoPE rotations cover {n_tok} tokens but attention got {q.shape[-2]} "
                f"(patch dropout must narrow the state through keep_tokens)"
            )
        if state.token_index is not None:
            # patch dropout: each sample keeps other tokens, so the batch-shared gathered kernel does not
            # apply; rotate by the dense per-token rotations, selected per sample (plain autograd)
            return rotate_pair_selected(q, k, state.for_layer(layer), state.token_index)
        return rotate_pair_gathered(q, k, state.tables[layer], state.flat_index)

    def no_weight_decay(self) -> set[str]:
        return set()  # the released code decays the generators with everything else

    def extra_repr(self) -> str:
        aug = self.coordinate_repr()
        return (f"block_size={self.block_size}, num_blocks={self.num_blocks}, sigma={self.sigma}, zero_init={self.zero_init}, "
                f"rotation={self.rotation!r}{aug}")


class ComRopeAPBase(ComRopeBase):
    """Axis partition: block ``j`` rotates with the coordinate of axis ``j mod N``."""

    def __init__(self, head_dim: int, num_heads: int, depth: int, block_size: int = 8, init_std: float = 1.0,
                 zero_init: bool = False, sigma: float = 0.0, rotation: str = "auto", coord_shift: float = 0.0,
                 coord_jitter: float = 1.0, coord_rescale: float = 1.0, random_positions: float = 1.0) -> None:
        super().__init__(head_dim, num_heads, depth, block_size, init_std, zero_init, sigma, rotation, coord_shift, coord_jitter,
                         coord_rescale, random_positions)
        if self.num_blocks % self.num_axes:
            raise ValueError(
                f"{self.registry_name or type(self).__name__}: head_dim/block_size = {self.num_blocks} blocks cannot be split "
                f"evenly over {self.num_axes} axes; choose block_size so that head_dim/block_size is a multiple of {self.num_axes}"
            )
        self.reset_parameters()

    def axis_of_block(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Block ``j`` -> its axis ``j mod N``. Derived, never a buffer: a buffer would come back uninitialised after a
        meta-device build and ``to_empty`` (a state dict does not hold non-persistent buffers)."""
        return torch.arange(self.num_blocks, device=device) % self.num_axes

    def coefficients(self, coords: torch.Tensor) -> torch.Tensor:
        c = coords.float()[:, self.axis_of_block(coords.device)]  # (L, m)
        return c.expand(self.depth, 1, *c.shape)

    def axis_line_generators(self) -> list[torch.Tensor]:
        s = self.skew_blocks()  # block j = k * N + a belongs to axis a
        return [s[:, :, a :: self.num_axes] for a in range(self.num_axes)]

    def combine(self, tables, lines):
        # each block has one axis: pad the axes' line tables to one length and interleave the blocks back
        k = max(t.shape[-3] for t in tables)
        padded = [torch.cat([t, t[..., -1:, :, :].expand(*t.shape[:-3], k - t.shape[-3], *t.shape[-2:])], dim=-3)
                  if t.shape[-3] < k else t for t in tables]
        table = torch.stack(padded, dim=-4).flatten(-5, -4)  # (depth, H, m/N, N, K, b, b) -> (depth, H, m, K, b, b)
        index = torch.stack(lines, dim=-1).repeat(1, self.num_blocks // self.num_axes)  # block j -> axis j mod N
        return [table], index[None]

    def axis_generators(self) -> torch.Tensor:
        s = self.skew_blocks()  # (depth, H, m, b, b)
        onehot = (self.axis_of_block(s.device)[None, :] == torch.arange(self.num_axes, device=s.device)[:, None]).float()
        return onehot[:, None, None, :, None, None] * s[None]


class ComRopeLDBase(ComRopeBase):
    """Linearly dependent: block ``j`` of axis ``i`` is ``theta_ij (P_j - P_j^T)``."""

    def __init__(self, head_dim: int, num_heads: int, depth: int, block_size: int = 8, init_std: float = 1.0,
                 zero_init: bool = False, sigma: float = 0.0, shared_scalars: bool = False, rotation: str = "auto",
                 coord_shift: float = 0.0, coord_jitter: float = 1.0, coord_rescale: float = 1.0,
                 random_positions: float = 1.0) -> None:
        super().__init__(head_dim, num_heads, depth, block_size, init_std, zero_init, sigma, rotation, coord_shift, coord_jitter,
                         coord_rescale, random_positions)
        self.shared_scalars = shared_scalars
        heads = 1 if shared_scalars else num_heads
        self.scalars = nn.Parameter(torch.empty(depth, heads, self.num_axes, self.num_blocks))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "scalars"):
            nn.init.normal_(self.scalars, std=1.0)

    def coefficients(self, coords: torch.Tensor) -> torch.Tensor:
        # (L, N) x (depth, H', N, m) -> (depth, H', L, m)
        return torch.einsum("ln,dhnm->dhlm", coords.float(), self.scalars.float())

    def axis_line_generators(self) -> list[torch.Tensor]:
        s = self.skew_blocks()  # (depth, H, m, b, b)
        th = self.scalars.float()  # (depth, H', N, m)
        return [th[:, :, a, :, None, None] * s for a in range(self.num_axes)]

    def combine(self, tables, lines):
        # one factor per axis: the per-token product of the axes' factors is formed inside attention
        # (and recomputed in its backward), never stored for all lattice combinations and layers
        index = torch.stack([idx[:, None].expand(-1, self.num_blocks) for idx in lines])
        return list(tables), index

    def axis_generators(self) -> torch.Tensor:
        s = self.skew_blocks()  # (depth, H, m, b, b)
        th = self.scalars.float().expand(self.depth, self.num_heads, self.num_axes, self.num_blocks)
        return th.permute(2, 0, 1, 3)[..., None, None] * s[None]


@register_encoding("comrope_ap")
class ComRopeAP(ComRopeAPBase):
    """ComRoPE-AP on 2D grids (block ``j`` -> row axis if ``j`` is even, column axis if odd)."""

    grid_ndims = (2,)


@register_encoding("comrope_ld", groups=("scaling",))
class ComRopeLD(ComRopeLDBase):
    """ComRoPE-LD on 2D grids."""

    grid_ndims = (2,)


#: ComRoPE-3D time coordinate: released ``(t + 0.5) / n_spatial`` or vispe's ``(t + 0.5) / T``
COMROPE_TIME_SCALES: tuple[str, ...] = ("spatial", "frames")


@register_encoding("comrope_ld_3d")
class ComRopeLD3d(ComRopeLDBase):
    """ComRoPE-LD on video grids ``(t, h, w)``.

    Height and width are normalised to (0, 1) (``(i + 0.5) / size``). Time follows the released code by
    default, ``time_scale='spatial'``: frame ``t`` at ``(t + 0.5) / n_spatial`` (Longin-Yu/ComRoPE,
    ``model.py``, ``CustomVITConfig.get_positions``, the ``num_axes == 3`` branch: the ``(frame, row, col)``
    indices are all divided by ``num_patches_on_single_axis``), so one frame step is one spatial patch step
    and more frames reach further, like RoPE's time axis; ``n_spatial`` is the larger of ``h`` and ``w`` on
    non-square grids (the released code has square images only). ``time_scale='frames'``
    (vispe before issue 27): ``(t + 0.5) / T``, every clip's time spans (0, 1) whatever its length --
    frame-count changes then compress or stretch time instead of extending it. Prefix tokens sit at 0.5 on
    every axis, as released (``cls_position``).
    """

    option_checks = {"time_scale": Choice(COMROPE_TIME_SCALES)}

    grid_ndims = (3,)

    def __init__(self, head_dim: int, num_heads: int, depth: int, block_size: int = 8, init_std: float = 1.0,
                 zero_init: bool = False, sigma: float = 0.0, shared_scalars: bool = False, rotation: str = "auto",
                 coord_shift: float = 0.0, coord_jitter: float = 1.0, coord_rescale: float = 1.0,
                 random_positions: float = 1.0, time_scale: str = "spatial") -> None:
        check_choice("time_scale", time_scale, COMROPE_TIME_SCALES)
        super().__init__(head_dim, num_heads, depth, block_size, init_std, zero_init, sigma, shared_scalars, rotation,
                         coord_shift, coord_jitter, coord_rescale, random_positions)
        self.time_scale = time_scale

    def axis_scales(self, grid: PositionGrid) -> tuple[float, ...]:
        if self.time_scale == "frames":
            return (1.0,) * grid.ndim
        t, h, w = grid.shape
        return (t / max(h, w), 1.0, 1.0)
