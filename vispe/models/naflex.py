"""Mixed-resolution batches (NaFlex-style): one padded batch whose images have different patch grids.

The input follows timm's NaFlexViT convention: ``patches`` ``(B, N, P*P*C)`` (each patch flattened as
``(ph, pw, C)``, timm's default ``patchify_channels_last``), ``patch_coord`` ``(B, N, 2)`` integer ``(y, x)``
lattice coordinates and ``patch_valid`` ``(B, N)`` booleans (``False``: padding). Valid patches of a sample
come first, in row-major order of its own ``(h, w)`` lattice, as timm's NaFlex collator lays them out.

Patches go straight into a linear patch projection, as in timm's NaFlexViT: the host's ``Conv2d`` weight read
as a ``Linear`` over ``(ph, pw, C)`` patches (the same maths; the parameter and its checkpoint key stay the
conv's). A list of images is patchified here first; the data module only batches.

How every encoding works per sample, without the model looking at which encoding it holds: samples are
grouped by grid, and each group runs the host's one embedding step (:func:`vispe.models.layers.embed_grid`:
prefix tokens, ``prepare`` on the group's grid, ``embed_tokens``, dropouts) exactly as a plain batch of that
grid would, then the one block runner with ``attend`` on the group's q/k/v cut to its length and
``after_block`` on the group's lattice. Everything that acts token by token (patch projection, norms, MLPs,
qkv) runs once on the whole padded batch. Padding tokens never reach a valid
token: the grouped attention only sees a group's own tokens, and where the encoding's attention is plain
SDPA the whole batch runs in one call with a key-padding mask.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..encodings.base import PositionalEncoding
from ..encodings.grid import PositionGrid
from .layers import embed_grid, run_blocks

__all__ = [
    "NaFlexGroup",
    "GroupedEncoding",
    "patchify_images",
    "unpatchify",
    "grids_from_patch_coord",
    "parse_naflex_input",
    "masked_global_pool",
    "patch_projection",
    "embed_naflex",
    "forward_naflex_blocks",
    "naflex_pool",
]


def patchify_images(images: Sequence[torch.Tensor], patch_size: int | tuple[int, int]) -> dict[str, torch.Tensor]:
    """Images ``(C, H_i, W_i)`` of different sizes (each a multiple of the patch) -> the padded NaFlex batch
    ``{'patches': (B, N, P*P*C), 'patch_coord': (B, N, 2), 'patch_valid': (B, N)}``, ``N`` the largest grid."""
    ph, pw = (patch_size, patch_size) if isinstance(patch_size, int) else tuple(patch_size)
    if len(images) == 0:
        raise ValueError("patchify_images: got an empty list of images")
    flat, coords = [], []
    for i, img in enumerate(images):
        if not isinstance(img, torch.Tensor) or img.ndim != 3:
            raise ValueError(f"patchify_images: image {i} must be a (C, H, W) tensor, got "
                             f"{type(img).__name__} {tuple(getattr(img, 'shape', ()))}")
        c, h, w = img.shape
        if h % ph or w % pw:
            raise ValueError(f"patchify_images: image {i} is {h}x{w}, not a multiple of the patch size {ph}x{pw}")
        gh, gw = h // ph, w // pw
        p = img.reshape(c, gh, ph, gw, pw).permute(1, 3, 2, 4, 0).reshape(gh * gw, ph * pw * c)
        flat.append(p)
        yy, xx = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
        coords.append(torch.stack([yy.reshape(-1), xx.reshape(-1)], dim=-1).to(img.device))
    n = max(p.shape[0] for p in flat)
    dims = {p.shape[1] for p in flat}
    if len(dims) != 1:
        raise ValueError(f"patchify_images: images have different channel counts (patch lengths {sorted(dims)})")
    patches = torch.stack([F.pad(p, (0, 0, 0, n - p.shape[0])) for p in flat])
    patch_coord = torch.stack([F.pad(c, (0, 0, 0, n - c.shape[0])) for c in coords])
    patch_valid = torch.stack([torch.arange(n, device=p.device) < p.shape[0] for p in flat])
    return {"patches": patches, "patch_coord": patch_coord, "patch_valid": patch_valid}


def unpatchify(patches: torch.Tensor, grid: tuple[int, int], patch_size: tuple[int, int], in_chans: int) -> torch.Tensor:
    """``(B, h*w, P*P*C)`` row-major ``(ph, pw, C)`` patches -> images ``(B, C, h*ph, w*pw)`` (exact inverse of
    :func:`patchify_images` for one grid)."""
    b = patches.shape[0]
    (gh, gw), (ph, pw) = grid, patch_size
    x = patches.reshape(b, gh, gw, ph, pw, in_chans)
    return x.permute(0, 5, 1, 3, 2, 4).reshape(b, in_chans, gh * ph, gw * pw)


def grids_from_patch_coord(patch_coord: torch.Tensor, patch_valid: torch.Tensor) -> list[tuple[int, int]]:
    """Each sample's ``(h, w)`` lattice from NaFlex coordinates, checking the layout this module relies on:
    the first ``h * w`` patches valid, in row-major order, the rest padding."""
    if patch_coord.ndim != 3 or patch_coord.shape[-1] != 2:
        raise ValueError(f"patch_coord must be (B, N, 2) integer (y, x) coordinates, got {tuple(patch_coord.shape)}")
    if tuple(patch_valid.shape) != tuple(patch_coord.shape[:2]):
        raise ValueError(f"patch_valid has shape {tuple(patch_valid.shape)}; expected (B, N) = {tuple(patch_coord.shape[:2])}")
    coord = patch_coord.long().cpu()
    valid = patch_valid.bool().cpu()
    grids = []
    for b in range(coord.shape[0]):
        n_valid = int(valid[b].sum())
        if n_valid == 0:
            raise ValueError(f"sample {b} of the NaFlex batch has no valid patch")
        if not bool(valid[b, :n_valid].all()):
            raise ValueError(f"sample {b}: valid patches must come first (padding at the end), as timm's NaFlex collator lays them out")
        h, w = (int(v) + 1 for v in coord[b, :n_valid].amax(0))
        idx = torch.arange(n_valid)
        if h * w != n_valid or not torch.equal(coord[b, :n_valid], torch.stack([idx // w, idx % w], -1)):
            raise ValueError(f"sample {b}: its {n_valid} valid patches are not the row-major lattice of a {h}x{w} grid "
                             f"(patch_coord must list (y, x) = (i // w, i % w) for patch i)")
        grids.append((h, w))
    return grids


def parse_naflex_input(
    x: Any, patch_coord: Optional[torch.Tensor], patch_valid: Optional[torch.Tensor]
) -> Optional[tuple[Any, Optional[torch.Tensor], Optional[torch.Tensor]]]:
    """``None`` for a plain ``(B, C, H, W)`` tensor; otherwise ``(patches or list of images, patch_coord,
    patch_valid)`` from a NaFlex dict, a padded patch tensor with coordinates, or a list of images."""
    if isinstance(x, Mapping):
        if "patches" not in x:
            raise ValueError(f"a NaFlex input dict needs 'patches', 'patch_coord' and 'patch_valid'; got keys {sorted(x)}")
        return x["patches"], x.get("patch_coord", patch_coord), x.get("patch_valid", patch_valid)
    if isinstance(x, (list, tuple)):
        return list(x), None, None
    # real tensors only: a symbolic tracer (FX) passes placeholders for every argument of forward
    if isinstance(patch_coord, torch.Tensor) or isinstance(patch_valid, torch.Tensor):
        return x, patch_coord, patch_valid
    return None


@dataclass
class NaFlexGroup:
    """The samples of a mixed batch that share one grid: their rows in the batch, the grid, its sequence
    length (prefix + kept lattice tokens) and the encoding's state for it."""

    index: torch.Tensor
    grid: PositionGrid
    seq_len: int
    state: Any


def _scatter_rows(out: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, dim: int) -> torch.Tensor:
    """``out`` with batch rows ``index`` replaced by ``rows`` (zero-padded along ``dim`` to ``out``'s length);
    out of place, so autograd follows it."""
    pad = out.shape[dim] - rows.shape[dim]
    if pad:
        spec = [0, 0] * (rows.ndim - 1 - dim) + [0, pad]
        rows = F.pad(rows, spec)
    return out.index_copy(0, index, rows.to(out.dtype))


class GroupedEncoding:
    """Stands in for the encoding in :func:`vispe.models.layers.run_blocks` on a mixed batch: every hook the
    blocks call (``fold_qk_basis``, ``attend``, ``after_block``) runs the real encoding once per group of
    samples sharing a grid, each with that grid's state, and puts the rows back in their batch places."""

    def __init__(self, encoding: PositionalEncoding, groups: Sequence[NaFlexGroup], seq_len: int) -> None:
        self.encoding = encoding
        self.groups = list(groups)
        self.seq_len = seq_len
        lengths = torch.zeros(sum(len(g.index) for g in self.groups), dtype=torch.long)
        for g in self.groups:
            lengths[g.index.cpu()] = g.seq_len
        self.lengths = lengths
        cls = type(encoding)
        # capability checks (never the encoding's name): hooks left at the base class's behaviour
        self.plain_attention = cls.attend is PositionalEncoding.attend
        self.acts_after_blocks = cls.after_block is not PositionalEncoding.after_block

    def token_valid(self, device: torch.device) -> torch.Tensor:
        """``(B, L)`` bool: which rows of the padded sequence are real tokens (prefix tokens included)."""
        return torch.arange(self.seq_len, device=device)[None, :] < self.lengths.to(device)[:, None]

    def fold_qk_basis(self, state: Any, layer: int = 0) -> tuple[Optional[torch.Tensor], Any]:
        folded = [self.encoding.fold_qk_basis(g.state, layer) for g in self.groups]
        basis = folded[0][0]
        # one projection serves the whole batch, so every group's basis must be the same matrix
        if basis is None or any(b is None or not torch.equal(b, basis) for b, _ in folded[1:]):
            return None, state
        return basis, [s for _, s in folded]

    def attend(self, q, k, v, *, layer=0, state=None, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        if attn_mask is not None or is_causal:
            raise ValueError("a mixed-resolution (NaFlex) batch builds its own key-padding mask; attn_mask / is_causal cannot be given")
        states = state if isinstance(state, list) else [g.state for g in self.groups]
        if self.plain_attention:  # one SDPA over the padded batch, padded keys masked out
            keep = self.token_valid(q.device)[:, None, None, :]
            return self.encoding.attend(q, k, v, layer=layer, state=states[0], attn_mask=keep, dropout_p=dropout_p, scale=scale)
        out = q.new_zeros(*q.shape[:-1], v.shape[-1])
        for g, s in zip(self.groups, states):
            n = g.seq_len
            qg, kg, vg = (t.index_select(0, g.index)[:, :, :n] for t in (q, k, v))
            og = self.encoding.attend(qg, kg, vg, layer=layer, state=s, dropout_p=dropout_p, scale=scale)
            out = _scatter_rows(out, g.index, og, dim=2)
        return out

    # the q/k/v views and the grouped attend above (the base class's hook, which needs nothing else of this class)
    attend_qkv = PositionalEncoding.attend_qkv

    def after_block(self, index: int, x: torch.Tensor, grid: Any, state: Any = None) -> torch.Tensor:
        if not self.acts_after_blocks:
            return x
        for g in self.groups:
            xg = x.index_select(0, g.index)[:, : g.seq_len]
            x = _scatter_rows(x, g.index, self.encoding.after_block(index, xg, g.grid, g.state), dim=1)
        return x


def masked_global_pool(x: torch.Tensor, patch_valid: torch.Tensor, pool_type: str, num_prefix_tokens: int,
                       include_prefix: bool = False) -> torch.Tensor:
    """timm's ``global_pool_nlc`` over the valid tokens only (``patch_valid`` ``(B, L - num_prefix_tokens)`` as
    timm's NaFlexViT: the lattice rows; prefix tokens are always valid)."""
    if not pool_type:
        return x
    if pool_type == "token":
        return x[:, 0]
    if pool_type not in ("avg", "max", "avgmax"):
        raise ValueError(f"global_pool={pool_type!r} has no masked form; mixed-resolution batches take 'token', 'avg', 'max', 'avgmax' or ''")
    token_valid = patch_valid.bool()
    if include_prefix:
        token_valid = torch.cat([token_valid.new_ones(x.shape[0], num_prefix_tokens), token_valid], dim=1)
    else:
        x = x[:, num_prefix_tokens:]
    w = token_valid.to(x.dtype).unsqueeze(-1)
    avg = (x * w).sum(1) / w.sum(1).clamp(min=1)
    if pool_type == "avg":
        return avg
    mx = x.masked_fill(~token_valid.unsqueeze(-1), torch.finfo(x.dtype).min).amax(1)
    return mx if pool_type == "max" else 0.5 * (avg + mx)


def patch_projection(proj: nn.Conv2d, patches: torch.Tensor) -> torch.Tensor:
    """A patch embedding's ``Conv2d`` (kernel = stride = patch) applied to flattened ``(ph, pw, C)`` patches
    ``(..., P*P*C)`` as the ``Linear`` it is: the weight ``(D, C, ph, pw)`` read as ``(D, ph*pw*C)`` (timm's
    NaFlexViT holds this linear layer; its checkpoint filter reshapes conv weights the same way)."""
    weight = proj.weight.permute(0, 2, 3, 1).flatten(1)
    return F.linear(patches, weight, proj.bias)


def _check_patch_input(patches: Any, patch_coord: Optional[torch.Tensor], patch_valid: Optional[torch.Tensor],
                       patch: tuple[int, int], in_chans: int, weight_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
    """A list of ``(C, H, W)`` images (patchified here) or padded patches with coordinates -> ``(patches,
    patch_coord, patch_valid, grids)``, every malformed input named before any compute."""
    if isinstance(patches, list):
        if not patches:
            raise ValueError("a mixed-resolution batch given as a list of images must not be empty")
        for i, img in enumerate(patches):
            if not isinstance(img, torch.Tensor) or img.ndim != 3:
                raise ValueError(f"image {i} of the list must be a (C, H, W) tensor, got "
                                 f"{type(img).__name__} {tuple(getattr(img, 'shape', ()))}")
            if img.shape[0] != in_chans:
                raise ValueError(f"image {i} of the list has shape {tuple(img.shape)}; expected (C={in_chans}, H, W)")
            if img.shape[-2] % patch[0] or img.shape[-1] % patch[1]:
                raise ValueError(f"image {i} of the list is {img.shape[-2]}x{img.shape[-1]}, not a multiple of the patch size "
                                 f"{patch[0]}x{patch[1]}; resize it to a multiple")
        grids = [(int(img.shape[-2]) // patch[0], int(img.shape[-1]) // patch[1]) for img in patches]
        batch = patchify_images(patches, patch)
        patches, patch_coord, patch_valid = batch["patches"], batch["patch_coord"], batch["patch_valid"]
    else:
        if patch_coord is None or patch_valid is None:
            raise ValueError("a padded patch batch needs both patch_coord (B, N, 2) and patch_valid (B, N)")
        if not isinstance(patches, torch.Tensor) or patches.ndim != 3 or patches.shape[-1] != patch[0] * patch[1] * in_chans:
            raise ValueError(f"patches must be (B, N, P*P*C) = (B, N, {patch[0] * patch[1] * in_chans}) flattened (ph, pw, C) "
                             f"patches, got {tuple(getattr(patches, 'shape', ()))}")
        grids = grids_from_patch_coord(patch_coord, patch_valid)
    if not patches.is_floating_point():
        raise TypeError(f"mixed-resolution input has dtype {patches.dtype}; expected a floating-point tensor (e.g. x.float() / 255, then normalise)")
    if patches.dtype != weight_dtype and not torch.is_autocast_enabled(patches.device.type):
        raise TypeError(f"mixed-resolution input has dtype {patches.dtype}, the model's weights {weight_dtype}; "
                        f"convert with .to({weight_dtype}) or run under torch.autocast")
    return patches, patch_coord, patch_valid, grids


def embed_naflex(host: nn.Module, patches: Any, patch_coord: Optional[torch.Tensor] = None,
                 patch_valid: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, "GroupedEncoding"]:
    """A host's embedding of a mixed-resolution batch: the linear patch projection once over the padded batch, then
    per group of samples sharing a grid the host's one embedding step (:func:`~vispe.models.layers.embed_grid`) on
    that grid. Returns the padded tokens ``(B, S + N, D)`` and the per-group binding the blocks run the encoding
    through. ``host``: a timm-style ViT (``patch_embed`` with a conv ``proj``, ``num_prefix_tokens`` and the
    attributes ``embed_grid`` reads)."""
    pe_ = host.patch_embed
    patch = tuple(int(p) for p in pe_.patch_size)
    in_chans = pe_.proj.in_channels
    patches, patch_coord, patch_valid, grids = _check_patch_input(patches, patch_coord, patch_valid, patch, in_chans,
                                                                  pe_.proj.weight.dtype)
    tokens_all = pe_.norm(patch_projection(pe_.proj, patches))  # (B, N, D), token by token: padding rows are dropped below
    by_grid: dict[tuple[int, int], list[int]] = {}
    for b, g in enumerate(grids):
        by_grid.setdefault(g, []).append(b)
    reads_image = host.pos_encoding.reads_image
    groups, tokens = [], []
    for (h, w), rows in by_grid.items():
        index = torch.tensor(rows, device=patches.device)
        x = tokens_all.index_select(0, index)[:, : h * w]
        # an image-conditioned encoding (LOOPE's offset) reads the pixels: rebuilt from the patches for it only
        image = unpatchify(patches.index_select(0, index)[:, : h * w], (h, w), patch, in_chans) if reads_image else None
        x, grid, state = embed_grid(host, x, PositionGrid((h, w), host.num_prefix_tokens), image)
        groups.append(NaFlexGroup(index, grid, x.shape[1], state))
        tokens.append(x)
    seq_len = max(t.shape[1] for t in tokens)
    out = tokens[0].new_zeros(len(grids), seq_len, tokens[0].shape[-1])
    for g, t in zip(groups, tokens):
        out = out.index_copy(0, g.index, F.pad(t, (0, 0, 0, seq_len - t.shape[1])))
    return out, GroupedEncoding(host.pos_encoding, groups, seq_len)


def forward_naflex_blocks(blocks: nn.Module, x: torch.Tensor, grouped: "GroupedEncoding", grad_checkpointing: bool = False) -> torch.Tensor:
    """The one block runner over a mixed batch, the encoding bound per group (:class:`GroupedEncoding`)."""
    for _, x in run_blocks(blocks, grouped, x, None, None, False, grad_checkpointing, None, None):  # type: ignore[arg-type]
        pass
    return x


def naflex_pool(host: nn.Module, x: torch.Tensor, patch_valid: torch.Tensor, pool_type: Optional[str] = None) -> torch.Tensor:
    """A timm ViT host's pooling over a mixed batch: attention pooling (``map``) with a key-padding mask, else
    :func:`masked_global_pool`; prefix tokens count when the host pools them (``pool_include_prefix``)."""
    npt = host.num_prefix_tokens
    if host.attn_pool is not None:
        keys = patch_valid.bool()
        if host.pool_include_prefix:
            keys = torch.cat([keys.new_ones(x.shape[0], npt), keys], dim=1)
        else:
            x = x[:, npt:]
        return host.attn_pool(x, attn_mask=keys[:, None, None, :])
    return masked_global_pool(x, patch_valid, host.global_pool if pool_type is None else pool_type, npt, host.pool_include_prefix)
