"""SeqPE -- sequential position encoding (Li et al., 2025, "SeqPE: Transformer with Sequential Position Encoding").

Each lattice position is written as a symbolic sequence: every axis index in base ``base`` (10), left-padded
with the digit 0 to ``num_digits`` digits, the axes one after another (``(7, 12)`` -> ``0 7 1 2``). A small
causal transformer reads the sequence -- digit embedding + digit-slot embedding + axis embedding, a learned
summary token appended last -- and a linear map of the summary token's output is the position's embedding,
added to the patch tokens. Nothing is tied to a grid size: any position whose indices fit in ``num_digits``
digits has an embedding, and two positions with the same digit sequence get the same one.

Two regularisers, exposed through the generic :meth:`PositionalEncoding.auxiliary_loss` hook (the tasks add
``aux_loss_weight x`` it to their loss):

* **contrastive distance alignment** -- for a random pivot position and ``num_negatives`` candidates, the
  candidate nearest to the pivot (Euclidean distance of the indices) must win a softmax over the dot
  products of the embeddings (cross-entropy);
* **out-of-distribution distillation** -- a window of the training grid's shape moved to a random place
  outside the training grid (in the released code: at least one grid length away along some axis) must have
  the same per-head similarity structure as the training grid itself: symmetric KL between the row-softmaxed
  Gram matrices of ``num_distill`` positions of the window and the same positions of the training grid
  (teacher detached).

Defaults follow the released image code (ghrua/seqpe, MIT; ``image_seqpe/models/sequential_pe.py``,
``pe_sampler.py``, ``pe_criterion.py``, ``main.py``, ``runs/ours_vit.sh``): base 10; positions per axis
``max_position = 100`` (``--pe_max_position 10000`` flattened, square-rooted for 2D data) hence 2 digits per
axis; a 2-layer causal encoder of width 384 with ``width // 64`` heads, GELU (tanh: GPT-2's ``gelu_new``, evaluated
as released, as is the attention's softmax), residual dropout 0.1,
attention dropout 0; LayerNorm eps 1e-5; padding digits not masked; the summary token last; a final LayerNorm
on the summary token (``--seqpe_last_layernorm`` in the image recipe); a learned
(trunc-normal 0.02) vector for the cls token; both losses weighted 0.1 with 32 pivots x 64 negatives and 32
windows x 64 positions; 10 % of training forwards shift the lattice to a random window (``random_shift``).
Where vispe differs, and why, is listed in ``docs/encodings-2d.md`` (SeqPE).
"""
from __future__ import annotations

import logging
import math
from functools import partial
from typing import Any, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import trunc_normal_
from timm.models.vision_transformer import Block

from .._checks import Bool, Choice, Int, Real
from .base import TokenEncoding, register_encoding
from .grid import PositionGrid
from .resolution import ResolutionContract, resamples_table, table_under_policy

__all__ = ["SeqPE", "SeqPE3d", "SeqPEEncoder", "position_digits"]

_logger = logging.getLogger("vispe")


def position_digits(positions: torch.Tensor, base: int, num_digits: int) -> torch.Tensor:
    """Integer positions ``(P, A)`` -> digit sequences ``(P, A * num_digits)`` (most significant digit first,
    left-padded with 0, axes one after another). Raises when a position needs more than ``num_digits`` digits."""
    pos = positions.long()
    # a value check reads the tensor (a graph break under torch.compile): lattices are checked by shape instead
    if not torch.compiler.is_compiling() and pos.numel() and (pos.min() < 0 or pos.max() >= base**num_digits):
        raise ValueError(
            f"SeqPE position {int(pos.max()) if pos.max() >= 0 else int(pos.min())} does not fit in {num_digits} base-{base} "
            f"digits (0 .. {base**num_digits - 1}); raise max_position"
        )
    powers = base ** torch.arange(num_digits - 1, -1, -1, device=pos.device)  # (K,)
    digits = (pos[..., None] // powers) % base  # (P, A, K)
    return digits.flatten(-2)


class GeluNew(nn.Module):
    """GPT-2's ``gelu_new``, ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``, evaluated in the released order:
    ``nn.GELU(approximate='tanh')`` is the same function with other float32 rounding."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class SeqPEEncoder(nn.Module):
    """The sequential encoder: digit sequences ``(P, A*K)`` -> embeddings ``(P, out_dim)``.

    ``final_norm`` is a LayerNorm on the summary token before ``out_proj`` (``final_layer_norm=True``) or an
    ``nn.Identity``. A state dict without ``final_norm.*`` (saved before the option existed, or with it off)
    switches it off while loading, so such a checkpoint computes what it computed when it was saved.
    """

    # 2: layer_norm_eps / final_layer_norm exist; a version-1 state dict was saved with eps 1e-6 and no final norm
    _version = 2

    def __init__(self, num_axes: int, num_digits: int, base: int, width: int, depth: int, num_heads: int,
                 out_dim: int, resid_drop: float, attn_drop: float, layer_norm_eps: float = 1e-5,
                 final_layer_norm: bool = True) -> None:
        super().__init__()
        self.num_axes, self.num_digits = num_axes, num_digits
        self.digit_embed = nn.Embedding(base, width)
        self.slot_embed = nn.Embedding(num_axes * num_digits, width)  # which digit of the sequence
        self.axis_embed = nn.Parameter(torch.zeros(num_axes, 1, width)) if num_axes > 1 else None
        self.summary_token = nn.Parameter(torch.zeros(1, 1, width))
        norm = partial(nn.LayerNorm, eps=layer_norm_eps)
        self.blocks = nn.ModuleList(
            Block(width, num_heads, mlp_ratio=4.0, qkv_bias=True, proj_drop=resid_drop, attn_drop=attn_drop,
                  act_layer=GeluNew, norm_layer=norm)
            for _ in range(depth)
        )
        for blk in self.blocks:
            # the released attention's explicit softmax(q k^T / sqrt(d)) v (timm's unfused path; SDPA's fused kernel
            # rounds otherwise): with GeluNew the float32 outputs equal the released ones, not just to rounding;
            # the sequences are a few digits long, so the unfused path costs nothing
            blk.attn.fused_attn = False
        self.final_norm = norm(width) if final_layer_norm else nn.Identity()
        self.out_proj = nn.Linear(width, out_dim)
        self.reset_parameters()

    @property
    def final_layer_norm(self) -> bool:
        return isinstance(self.final_norm, nn.LayerNorm)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
                              *args: Any, **kwargs: Any) -> None:
        # an encoder state dict without the final norm: switch it off (a LayerNorm with weight 1 and bias 0 is
        # no identity, so filling it in would change what the checkpoint computes); children load after this
        if self.final_layer_norm and f"{prefix}out_proj.weight" in state_dict and f"{prefix}final_norm.weight" not in state_dict:
            self.final_norm = nn.Identity()
            _logger.warning("SeqPE: the checkpoint has no final LayerNorm (%sfinal_norm.*): loaded with final_layer_norm=False",
                            prefix)
        if local_metadata.get("version", self._version) < 2:
            # saved by vispe before the option existed: its blocks ran with timm's LayerNorm eps, 1e-6
            norms = [m for m in self.modules() if isinstance(m, nn.LayerNorm) and m.eps != 1e-6]
            for m in norms:
                m.eps = 1e-6
            if norms:
                _logger.warning("SeqPE: %s was saved by vispe before layer_norm_eps existed: loaded with eps 1e-6, as saved",
                                prefix.rstrip(".") or "the encoder")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args, **kwargs)

    def reset_parameters(self) -> None:
        """The released init: truncated normal (0.02) for every weight and the learned tokens, zero biases."""
        self.apply(self._init)
        if self.axis_embed is not None:
            trunc_normal_(self.axis_embed, std=0.02)
        trunc_normal_(self.summary_token, std=0.02)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            trunc_normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    def forward(self, digits: torch.Tensor) -> torch.Tensor:
        n = digits.shape[1]
        x = self.digit_embed(digits) + self.slot_embed.weight[:n]
        if self.axis_embed is not None:
            x = x + self.axis_embed.expand(-1, self.num_digits, -1).flatten(0, 1)
        x = torch.cat([x, self.summary_token.expand(x.shape[0], -1, -1)], dim=1)
        for blk in self.blocks:
            x = blk(x, is_causal=True)  # causal: the summary token, last, reads the whole sequence
        return self.out_proj(self.final_norm(x[:, -1]))  # the norm is per token: only the summary token's is used


@register_encoding("seqpe", benchmark=False, groups=("scaling",))
class SeqPE(TokenEncoding):
    """SeqPE on 2D grids (see the module docstring); :class:`SeqPE3d` is the same on ``(t, h, w)``.

    Args:
        max_position: positions per axis the digit sequences cover (``0 .. max_position - 1``; sets the number
            of digits) and the range the regularisers sample from. Released: 100.
        base: digit base (10).
        encoder_dim: encoder width; default ``min(384, dim)`` (released 384 for ViT-S/B).
        encoder_depth: encoder blocks (2). encoder_heads: default ``max(1, encoder_dim // 64)``.
        resid_drop, attn_drop: encoder dropouts (0.1, 0.0).
        contrastive_weight, distill_weight: the two regularisers' weights inside :meth:`auxiliary_loss` (0.1 each).
        num_pivots, num_negatives: contrastive batch (32 x 64). num_windows, num_distill: distillation batch (32 x 64).
        distill_heads: heads the distillation splits the embedding into (default ``encoder_heads``).
        random_shift: probability that a training forward moves the lattice to a random window of the position
            range (0.1).
        extrapolation: ``'extend'`` (default: the encoder at the new grid's positions) or ``'resample'`` (alias
            ``'interpolate'``: the training grid's table resampled with ``interpolation``).
        layer_norm_eps: the encoder's LayerNorm epsilon (released 1e-5).
        final_layer_norm: a LayerNorm on the summary token before the output map (released image recipe: on).
        interpolation: the resampling kernel of ``'resample'``: ``'bicubic'`` (default, the released
            evaluation), ``'bilinear'`` or ``'nearest'`` in 2D; ``'trilinear'`` (default) or ``'nearest'`` in 3D.
        antialias: torch's antialiased 2D resampling (False, as released; True is timm's ``resample_abs_pos_embed``
            default, which ``learned`` uses: its kernel differs from plain bicubic also when enlarging).
    """

    grid_ndims = (2,)
    num_axes = 2
    #: the kernels ``interpolation`` takes (the first is the default)
    interpolation_modes = ("bicubic", "bilinear", "nearest")
    prefix_policy = "prefix tokens get their own learned vectors (trunc-normal 0.02), as released"

    resolution = ResolutionContract(("extend", "resample"), default="extend")

    #: option rules, checked before __init__ (vispe._checks; see PositionalEncoding.option_checks)
    option_checks = {
        "max_position": Int(2),
        "base": Int(2),
        "encoder_dim": Int(1, optional=True),
        "encoder_depth": Int(1),
        "encoder_heads": Int(1, optional=True),
        "resid_drop": Real(0, 1, high_open=True),
        "attn_drop": Real(0, 1, high_open=True),
        "contrastive_weight": Real(0, 1e3),
        "distill_weight": Real(0, 1e3),
        "num_pivots": Int(1),
        "num_negatives": Int(1),
        "num_windows": Int(1),
        "num_distill": Int(1),
        "distill_heads": Int(1, optional=True),
        "random_shift": Real(0, 1e3),
        "layer_norm_eps": Real(0, 1, low_open=True),
        "final_layer_norm": Bool(),
        "interpolation": Choice(interpolation_modes, optional=True),
        "antialias": Bool(),
    }

    def __init__(
        self,
        dim: int,
        grid_size: Sequence[int],
        num_prefix_tokens: int = 1,
        max_position: int = 100,
        base: int = 10,
        encoder_dim: int | None = None,
        encoder_depth: int = 2,
        encoder_heads: int | None = None,
        resid_drop: float = 0.1,
        attn_drop: float = 0.0,
        contrastive_weight: float = 0.1,
        distill_weight: float = 0.1,
        num_pivots: int = 32,
        num_negatives: int = 64,
        num_windows: int = 32,
        num_distill: int = 64,
        distill_heads: int | None = None,
        random_shift: float = 0.1,
        extrapolation: str | None = None,
        layer_norm_eps: float = 1e-5,
        final_layer_norm: bool = True,
        interpolation: str | None = None,
        antialias: bool = False,
    ) -> None:
        super().__init__()
        if antialias and self.num_axes != 2:
            raise ValueError(f"{self.registry_name}: antialias=True is 2D only (torch antialiases bilinear / bicubic "
                             f"resampling of images), got it with {self.num_axes} axes")
        if not (isinstance(base, int) and base >= 2):
            raise ValueError(f"seqpe: base must be an integer >= 2, got {base!r}")
        self.grid_size = tuple(int(g) for g in grid_size)
        if not (isinstance(max_position, int) and max_position >= 2 * max(self.grid_size)):
            raise ValueError(f"seqpe: max_position must be an integer >= twice the training grid's longest side "
                             f"({2 * max(self.grid_size)}: room for out-of-distribution windows), got {max_position!r}")
        for name, v in (("contrastive_weight", contrastive_weight), ("distill_weight", distill_weight)):
            if not v >= 0:
                raise ValueError(f"seqpe: {name} must be >= 0, got {v!r}")
        for name, v in (("num_pivots", num_pivots), ("num_negatives", num_negatives), ("num_windows", num_windows),
                        ("num_distill", num_distill), ("encoder_depth", encoder_depth)):
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"seqpe: {name} must be an integer >= 1, got {v!r}")
        if not 0.0 <= random_shift <= 1.0:
            raise ValueError(f"seqpe: random_shift is a probability in [0, 1], got {random_shift!r}")
        width = int(encoder_dim) if encoder_dim is not None else min(384, dim)
        heads = int(encoder_heads) if encoder_heads is not None else max(1, width // 64)
        if width % heads:
            raise ValueError(f"seqpe: encoder_heads={heads} does not divide encoder_dim={width}")
        self.distill_heads = int(distill_heads) if distill_heads is not None else heads
        if dim % self.distill_heads:
            raise ValueError(f"seqpe: distill_heads={self.distill_heads} does not divide the embedding dim {dim}")
        self.dim = dim
        self.base = base
        self.max_position = max_position
        self.num_digits = len(_to_base(max_position - 1, base))
        self.extrapolation = extrapolation
        self.interpolation = interpolation if interpolation is not None else self.interpolation_modes[0]
        self.antialias = bool(antialias)
        # the resample policy's kernel (vispe.encodings.resolution.RESAMPLE_KERNELS)
        self.resample_kernel = f"{self.interpolation}_antialias" if self.antialias else self.interpolation
        self.contrastive_weight, self.distill_weight = float(contrastive_weight), float(distill_weight)
        self.num_pivots, self.num_negatives = num_pivots, num_negatives
        self.num_windows, self.num_distill = num_windows, num_distill
        self.random_shift = float(random_shift)
        self.encoder = SeqPEEncoder(self.num_axes, self.num_digits, base, width, encoder_depth, heads, dim, resid_drop,
                                    attn_drop, layer_norm_eps=float(layer_norm_eps), final_layer_norm=final_layer_norm)
        self.prefix_embed = nn.Parameter(torch.zeros(1, num_prefix_tokens, dim)) if num_prefix_tokens else None
        if self.prefix_embed is not None:
            trunc_normal_(self.prefix_embed, std=0.02)

    # -- embeddings ----------------------------------------------------------------------------
    def embed_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Embeddings ``(P, dim)`` of integer positions ``(P, num_axes)``."""
        device = self.encoder.out_proj.weight.device
        return self.encoder(position_digits(positions.to(device), self.base, self.num_digits))

    def _lattice(self, shape: Sequence[int], device: torch.device, offset: torch.Tensor | None = None) -> torch.Tensor:
        if max(shape) > self.base**self.num_digits:
            raise ValueError(f"SeqPE grid {tuple(shape)} has positions past {self.base**self.num_digits - 1}, the largest "
                             f"{self.num_digits} base-{self.base} digits hold; raise max_position")
        idx = PositionGrid(tuple(shape)).indices(device).long()
        return idx if offset is None else idx + offset

    def table_for(self, grid: PositionGrid, device: torch.device) -> torch.Tensor:
        """The lattice embeddings ``(1, N, dim)`` of ``grid`` (cached while no gradient must reach the encoder)."""

        def build() -> torch.Tensor:
            return table_under_policy(self.resolution_policy, grid.shape, self.grid_size,
                                      lambda shape: self.embed_positions(self._lattice(shape, device)), self.resample_kernel)[None]

        return self.cached(("table", grid.shape, str(device)), build, uses_parameters=True)

    def embed_tokens(self, x, grid, state=None, image=None):
        self.check_grid(grid)
        if self.training and self.random_shift > 0 and torch.compiler.is_compiling():
            return self.add_to_tokens(x, self._shifted_table_traceable(grid, x.device), grid, self.prefix_embed)
        if self.training and self.random_shift > 0 and torch.rand(()) < self.random_shift:
            room = torch.tensor([self.max_position - s for s in grid.shape])
            if bool((room > 0).all()):
                offset = (torch.rand(len(grid.shape)) * (room + 1)).long().clamp_max(room).to(x.device)
                pe = self.embed_positions(self._lattice(grid.shape, x.device, offset))[None]
                return self.add_to_tokens(x, pe, grid, self.prefix_embed)
        return self.add_to_tokens(x, self.table_for(grid, x.device), grid, self.prefix_embed)

    def _shifted_table_traceable(self, grid: PositionGrid, device: torch.device) -> torch.Tensor:
        """The random shift without a data-dependent branch (for ``torch.compile(fullgraph=True)``): the offset is
        drawn every step and zeroed when the coin says no shift, which is the unshifted lattice. Eager keeps the
        branch (and so its random stream); a grid whose table is resampled (``resample``) is not shifted."""
        room = [self.max_position - s for s in grid.shape]
        if min(room) <= 0 or resamples_table(self.resolution_policy, grid.shape, self.grid_size):
            return self.table_for(grid, device)
        room_t = torch.tensor(room, device=device)
        coin = (torch.rand((), device=device) < self.random_shift).long()
        offset = (torch.rand(len(room), device=device) * (room_t + 1)).long().clamp_max(room_t) * coin
        return self.embed_positions(self._lattice(grid.shape, device, offset))[None]

    # -- regularisers ----------------------------------------------------------------------------
    def contrastive_loss(self) -> torch.Tensor:
        """Cross-entropy of picking, among ``num_negatives`` random candidates, the one nearest to a random pivot
        by embedding dot product (released ``SeqPeContrastiveCriterion`` with its random and local samplers)."""
        device = self.encoder.out_proj.weight.device
        b, k, a, m = self.num_pivots, self.num_negatives, self.num_axes, self.max_position
        pivots = torch.randint(0, m, (b, a))
        cands = torch.randint(0, m, (b, k, a))
        # released: part of the batches draws its candidates from one small window (close positions to tell apart)
        side = min(m, max(14, math.isqrt(5 * k)))
        local = torch.rand(b) < 0.2
        if local.any():
            start = torch.randint(0, m - side + 1, (int(local.sum()), 1, a))
            cands[local] = start + torch.randint(0, side, (int(local.sum()), k, a))
        same = (cands == pivots[:, None]).all(-1)  # a candidate equal to the pivot: move it one step
        cands[same] = (cands[same] + 1) % m
        dist = (cands - pivots[:, None]).float().square().sum(-1)  # (b, k)
        labels = dist.argmin(-1)
        emb = self.embed_positions(torch.cat([pivots, cands.flatten(0, 1)]).to(device))
        piv, cand = emb[:b], emb[b:].reshape(b, k, -1)
        logits = torch.einsum("bd,bkd->bk", piv.float(), cand.float())
        return F.cross_entropy(logits, labels.to(device))

    def distill_loss(self) -> torch.Tensor:
        """Symmetric KL between per-head, row-softmaxed Gram matrices of ``num_distill`` positions of an
        out-of-distribution window and of the training grid (teacher detached; released ``SeqPeTransferCriterion``
        with beta = 1, multi-head)."""
        device = self.encoder.out_proj.weight.device
        g = self.grid_size
        n = math.prod(g)
        w, t, h = self.num_windows, min(self.num_distill, n), self.distill_heads
        # window starts: inside [0, M - g) per axis, at least one full grid length away along some axis
        room = torch.tensor([self.max_position - s for s in g])
        starts = (torch.rand(w, len(g)) * room).long()
        inside = (starts < torch.tensor(g)).all(-1)
        while bool(inside.any()):  # redraw the ones overlapping the training grid on every axis
            starts[inside] = (torch.rand(int(inside.sum()), len(g)) * room).long()
            inside = (starts < torch.tensor(g)).all(-1)
        picks = torch.stack([torch.randperm(n)[:t] for _ in range(w)])  # (w, t) lattice rows
        lattice = self._lattice(g, torch.device("cpu"))  # (n, A)
        ood = lattice[picks] + starts[:, None]  # (w, t, A)
        student = self.embed_positions(ood.flatten(0, 1).to(device)).float().reshape(w, t, h, -1).transpose(1, 2)
        with torch.no_grad():
            teacher_all = self.embed_positions(lattice.to(device)).float()  # (n, D)
        teacher = teacher_all[picks.to(device)].reshape(w, t, h, -1).transpose(1, 2)
        log_s = F.log_softmax(student @ student.transpose(-1, -2), dim=-1)
        log_t = F.log_softmax(teacher @ teacher.transpose(-1, -2), dim=-1)
        # KL(teacher || student) + KL(student || teacher), each averaged over all entries as the released
        # F.kl_div(..., log_target=True) with its default 'mean' reduction; the teacher side carries no gradient
        return (log_t.exp() * (log_t - log_s)).mean() + (log_s.exp() * (log_s - log_t)).mean()

    def auxiliary_loss(self) -> torch.Tensor | None:
        """``contrastive_weight x contrastive + distill_weight x distillation`` (``None`` when both weights are 0)."""
        terms = []
        if self.contrastive_weight > 0:
            terms.append(self.contrastive_weight * self.contrastive_loss())
        if self.distill_weight > 0:
            terms.append(self.distill_weight * self.distill_loss())
        return sum(terms) if terms else None

    # -- lifecycle -------------------------------------------------------------------------------
    def no_weight_decay(self) -> set[str]:
        # released runs/ours_vit.sh: PE_WEIGHT_DECAY=0 for the whole position network and the cls vector
        return {name for name, _ in self.named_parameters()}

    def extra_repr(self) -> str:
        return (f"max_position={self.max_position}, base={self.base}, num_digits={self.num_digits}, "
                f"extrapolation={self.extrapolation!r}, interpolation={self.interpolation!r}, antialias={self.antialias}, "
                f"final_layer_norm={self.encoder.final_layer_norm}, random_shift={self.random_shift}")


def _to_base(value: int, base: int) -> list[int]:
    digits = []
    while True:
        value, r = divmod(value, base)
        digits.append(r)
        if value == 0:
            return digits[::-1]


@register_encoding("seqpe_3d", benchmark=False)
class SeqPE3d(SeqPE):
    """SeqPE on video grids ``(t, h, w)``: three digit groups per position (an extension; the released code has 1D
    and 2D positions)."""

    grid_ndims = (3,)
    num_axes = 3
    interpolation_modes = ("trilinear", "nearest")
    option_checks = {"interpolation": Choice(interpolation_modes, optional=True)}
