"""PESI metrics (LOOPE, Chowdhury et al. 2025) and the cosine-similarity map of a positional encoding.

All metrics start from cosine-similarity maps: for every cell ``c`` of an ``H x W`` grid, the
cosine similarity between the encoding of ``c`` and the encoding of every other cell ``p``
(``c`` itself is left out). ``r = round(|p - c|)`` (Euclidean, in cells) bins the map by radius.

* ``M_U`` (undirected monotonicity) = mean over cells of ``1 - rho``, ``rho`` the Spearman
  correlation between the radius ``r`` and the mean similarity at that radius. 2 is ideal
  (similarity falls monotonically with distance), 1 = no relation, 0 = rises with distance.
* ``M_D`` (directed monotonicity): the same inside each of ``num_directions`` angular sectors
  (60 sectors of 6 degrees in the paper) around ``c``; averaged over the sectors of a cell, then
  over cells. Sectors with fewer than two distinct radii, or a constant profile, are skipped.
* ``A_SU`` (undirected asymmetry): the coefficient of variation (std / mean, signed, population
  std) of the similarities at each radius, averaged over radii (with >= 2 cells) and cells.
  0 = perfectly radially symmetric. A negative value means the mean similarity is negative.

What can be materialised (``materialize_pe``):

* token encodings (``learned``, ``sincos2d``, ``lff``, ``loope``, ...): the vectors added to
  the patch tokens, read through the encoding's own ``embed_tokens`` on a zero sequence. LOOPE's
  encoding depends on the image: pass ``image`` (default: a black image, i.e. the Gilbert order
  plus the context net's offset for an empty picture).
* rotary encodings (``rope_axial``, ``rope_mixed``, ComRoPE, M-RoPE family, ...): a fixed probe
  vector (all ones) rotated at every position, over all heads and layers. The cosine similarity
  of two rotated probes is the attention logit between a query and a key that both equal the
  probe, normalised: the relative kernel the rotation imposes. ``similarity_maps`` measures it
  through the encoding's own ``attend`` hook (any rotary encoding, ComRoPE included);
  ``materialize_pe`` returns the equivalent ``(cos, sin)`` vectors for encodings with ``angles()``.
* not materialisable (``ValueError``): ``none`` (no vector at all), attention-bias encodings
  (``irpe``: a pairwise, query-dependent logit term, not a vector per position) and conditional
  encodings (``cpe``: a convolution of the tokens, so it depends on the content and the layer).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn as nn

from vispe.encodings.base import AttentionBiasEncoding, PositionalEncoding, TokenEncoding
from vispe.encodings.rotary import RotaryEncoding
from vispe.encodings.grid import PositionGrid

__all__ = [
    "materialize_pe",
    "similarity_maps",
    "rotary_kernel_maps",
    "cosine_similarity_maps",
    "pesi_metrics",
    "pesi_from_similarity",
    "plot_similarity_maps",
]


def _encoding_of(obj: nn.Module) -> PositionalEncoding:
    if isinstance(obj, PositionalEncoding):
        return obj
    enc = getattr(obj, "pos_encoding", None)
    if isinstance(enc, PositionalEncoding):
        return enc
    raise TypeError(f"expected a vispe PositionalEncoding or a model with a .pos_encoding, got {type(obj).__name__}")


@torch.no_grad()
def materialize_pe(
    model_or_encoding: nn.Module,
    grid_size: Sequence[int] | None = None,
    *,
    dim: int | None = None,
    num_prefix_tokens: int | None = None,
    image: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The encoding as one vector per cell: float32 ``(H, W, D')``.

    Args:
        model_or_encoding: a vispe model (``.pos_encoding``, ``.embed_dim``, ``.patch_embed``) or an encoding.
        grid_size: ``(H, W)``; default: the model's patch grid (required for a bare encoding).
        dim: token width (token encodings given bare; default: the model's ``embed_dim``).
        num_prefix_tokens: prefix tokens of the sequence (default: the model's, else 0).
        image: ``(1, C, H_px, W_px)`` for image-conditioned encodings (LOOPE); default a black image
            of the model's input size.
    """
    enc = _encoding_of(model_or_encoding)
    model = model_or_encoding if enc is not model_or_encoding else None
    if grid_size is None:
        if model is None or not hasattr(model, "patch_embed"):
            raise ValueError("grid_size is required when materialising a bare encoding (e.g. grid_size=(14, 14))")
        grid_size = tuple(model.patch_embed.grid_size)
    grid_size = tuple(int(g) for g in grid_size)
    if len(grid_size) != 2 or min(grid_size) < 1:
        raise ValueError(f"PESI works on 2D grids; got grid_size={grid_size}")
    if num_prefix_tokens is None:
        num_prefix_tokens = int(getattr(model, "num_prefix_tokens", 0)) if model is not None else 0
    grid = PositionGrid(grid_size, num_prefix_tokens)
    if device is None:
        p = next(iter(enc.parameters()), None)
        device = p.device if p is not None else torch.device("cpu")
    device = torch.device(device)
    name = enc.registry_name or type(enc).__name__
    h, w = grid_size

    if isinstance(enc, TokenEncoding):
        if dim is None:
            if model is None or not hasattr(model, "embed_dim"):
                raise ValueError(f"dim is required to materialise the token encoding {name!r} given bare")
            dim = int(model.embed_dim)
        if image is None and model is not None and hasattr(model, "patch_embed"):
            ph, pw = model.patch_embed.patch_size
            image = torch.zeros(1, model.patch_embed.proj.in_channels, h * ph, w * pw, device=device)
        x = torch.zeros(1, num_prefix_tokens + h * w, dim, device=device)
        state = enc.prepare(grid, device)
        out = enc.embed_tokens(x, grid, state, image=image)
        return out[0, num_prefix_tokens:].float().reshape(h, w, -1)

    if isinstance(enc, RotaryEncoding):
        if not enc.pairwise_phases:
            raise ValueError(
                f"rotary encoding {name!r} rotates by blocks, not per-pair phases (e.g. ComRoPE's matrix rotations): use "
                f"similarity_maps(), which measures the rotation kernel through the encoding's attend() hook"
            )
        ang = enc.angles(grid, device).float()  # (..., N, P) over patch tokens
        ang = ang.reshape(-1, *ang.shape[-2:]).permute(1, 0, 2).reshape(h * w, -1)
        # the all-ones probe rotated by a is (cos a - sin a, sin a + cos a): the same cosine similarities
        # (mean over pairs of cos(a_i - a_j)) as the features (cos a, sin a) used here
        vec = torch.cat([torch.cos(ang), torch.sin(ang)], dim=-1)
        return vec.reshape(h, w, -1)

    if isinstance(enc, AttentionBiasEncoding):
        why = "it is a pairwise (and possibly query-dependent) attention-logit term, not a vector per position"
    elif enc.uses_attention() or type(enc).after_block is not PositionalEncoding.after_block:
        why = "it is computed from the tokens themselves (e.g. a convolution), so it depends on the content and the layer"
    else:
        why = "it adds no position information at all"
    raise ValueError(
        f"encoding {name!r} cannot be materialised as a PE tensor for PESI: {why}. "
        f"Materialisable kinds: 'token' (learned, sincos2d, lff, loope, ...) and 'rotary' (rope_axial, rope_mixed, comrope_*, ...)"
    )


@torch.no_grad()
def rotary_kernel_maps(
    model_or_encoding: nn.Module,
    grid_size: Sequence[int] | None = None,
    *,
    num_heads: int | None = None,
    head_dim: int | None = None,
    depth: int | None = None,
    num_prefix_tokens: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Cosine similarity ``(H, W, H, W)`` of a q/k-rotating encoding, read through its ``attend`` hook.

    A unit probe ``u`` (all ones / sqrt(dh)) is the query and key of every token, with scale 1 and
    the identity as values, so ``attend`` returns ``softmax_j(<R_i u, R_j u>)``. Rotations keep norms,
    so ``<R_i u, R_i u> = 1`` and ``<R_i u, R_j u> = log A_ij - log A_ii + 1``: the cosine similarity of
    the rotated probes, averaged over heads and layers. Works for any rotary encoding (RoPE, ComRoPE,
    M-RoPE, ...) without reading its internals.
    """
    enc = _encoding_of(model_or_encoding)
    model = model_or_encoding if enc is not model_or_encoding else None
    blocks = getattr(model, "blocks", None)
    attn = blocks[0].attn if blocks is not None and len(blocks) else None
    num_heads = num_heads or (attn.num_heads if attn is not None else getattr(enc, "num_heads", None))
    head_dim = head_dim or (attn.head_dim if attn is not None else getattr(enc, "head_dim", None))
    depth = depth or (len(blocks) if blocks is not None else getattr(enc, "depth", 1))
    if not num_heads or not head_dim:
        raise ValueError("num_heads and head_dim are required for a bare rotary encoding without those attributes")
    if grid_size is None:
        if model is None or not hasattr(model, "patch_embed"):
            raise ValueError("grid_size is required for a bare encoding (e.g. grid_size=(14, 14))")
        grid_size = tuple(model.patch_embed.grid_size)
    h, w = (int(g) for g in grid_size)
    if num_prefix_tokens is None:
        num_prefix_tokens = int(getattr(model, "num_prefix_tokens", 0)) if model is not None else 0
    grid = PositionGrid((h, w), num_prefix_tokens)
    if device is None:
        p = next(iter(enc.parameters()), None)
        device = p.device if p is not None else torch.device("cpu")
    length = num_prefix_tokens + h * w
    probe = torch.full((1, num_heads, length, head_dim), 1.0 / math.sqrt(head_dim), device=device)
    values = torch.eye(length, device=device).expand(1, num_heads, length, length)
    state = enc.prepare(grid, device)
    total = torch.zeros(h * w, h * w, dtype=torch.float64, device=device)
    for layer in range(int(depth)):
        attn_probs = enc.attend(probe, probe, values, layer=layer, state=state, scale=1.0)  # (1, H, L, L)
        logp = attn_probs[0].double().clamp_min(1e-300).log()[:, num_prefix_tokens:, num_prefix_tokens:]
        # renormalising over the patch tokens only shifts each row by a constant, which the diagonal removes
        sim = logp - torch.diagonal(logp, dim1=-2, dim2=-1)[..., :, None] + 1.0
        total += sim.mean(0)
    return (total / int(depth)).float().reshape(h, w, h, w).cpu()


def similarity_maps(model_or_encoding: nn.Module, **kwargs: Any) -> torch.Tensor:
    """Cosine-similarity maps ``(H, W, H, W)`` of any materialisable encoding (token or rotary)."""
    enc = _encoding_of(model_or_encoding)
    if isinstance(enc, RotaryEncoding):
        keys = ("grid_size", "num_heads", "head_dim", "depth", "num_prefix_tokens", "device")
        return rotary_kernel_maps(model_or_encoding, **{k: v for k, v in kwargs.items() if k in keys})
    return cosine_similarity_maps(materialize_pe(model_or_encoding, **kwargs))


def cosine_similarity_maps(pe: torch.Tensor) -> torch.Tensor:
    """``(H, W, D)`` -> ``(H, W, H, W)``: cosine similarity between every pair of cells."""
    if pe.ndim != 3:
        raise ValueError(f"expected a PE tensor (H, W, D), got shape {tuple(pe.shape)}")
    h, w, d = pe.shape
    flat = torch.nn.functional.normalize(pe.reshape(h * w, d).double(), dim=-1)
    return (flat @ flat.T).reshape(h, w, h, w).float()


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks with ties given their average rank (as Spearman's rho needs)."""
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.arange(len(x), dtype=np.float64)
    _, inv, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inv, weights=ranks)
    return (sums / counts)[inv]


def _spearman(x: np.ndarray, y: np.ndarray) -> float | None:
    if len(x) < 2:
        return None
    rx, ry = _ranks(x), _ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = math.sqrt(float((rx * rx).sum() * (ry * ry).sum()))
    if den == 0.0:
        return None
    return float((rx * ry).sum() / den)


def _profile_rho(radius: np.ndarray, sim: np.ndarray) -> float | None:
    """Spearman rho between the distinct radii and the mean similarity at each."""
    radii, inv = np.unique(radius, return_inverse=True)
    if len(radii) < 2:
        return None
    means = np.bincount(inv, weights=sim) / np.bincount(inv)
    return _spearman(radii.astype(np.float64), means)


def pesi_from_similarity(sim: torch.Tensor | np.ndarray, num_directions: int = 60) -> dict[str, float]:
    """PESI metrics from similarity maps ``(H, W, H, W)`` (``sim[y, x, y', x']``)."""
    s = np.asarray(sim.detach().cpu() if isinstance(sim, torch.Tensor) else sim, dtype=np.float64)
    if s.ndim != 4 or s.shape[:2] != s.shape[2:]:
        raise ValueError(f"expected similarity maps (H, W, H, W), got shape {s.shape}")
    if int(num_directions) < 1:
        raise ValueError(f"num_directions must be >= 1, got {num_directions!r}")
    h, w = s.shape[:2]
    ys, xs = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    ys, xs = ys.ravel(), xs.ravel()
    flat = s.reshape(h * w, h * w)
    m_u, m_d, a_su = [], [], []
    sector = 2 * math.pi / num_directions
    for c in range(h * w):
        others = np.arange(h * w) != c
        dy, dx = ys[others] - ys[c], xs[others] - xs[c]
        radius = np.rint(np.hypot(dy, dx)).astype(np.int64)
        values = flat[c, others]
        rho = _profile_rho(radius, values)
        if rho is not None:
            m_u.append(1.0 - rho)
        theta = np.mod(np.arctan2(dy, dx), 2 * math.pi)
        bucket = np.minimum((theta / sector).astype(np.int64), num_directions - 1)
        per_dir = []
        for b in np.unique(bucket):
            sel = bucket == b
            rho_b = _profile_rho(radius[sel], values[sel])
            if rho_b is not None:
                per_dir.append(1.0 - rho_b)
        if per_dir:
            m_d.append(float(np.mean(per_dir)))
        cvs = []
        for r in np.unique(radius):
            ring = values[radius == r]
            if len(ring) < 2:
                continue
            mean = ring.mean()
            cvs.append(ring.std() / mean if mean != 0 else (0.0 if ring.std() == 0 else math.copysign(math.inf, 1.0)))
        if cvs:
            a_su.append(float(np.mean(cvs)))
    nan = float("nan")
    return {
        "M_U": float(np.mean(m_u)) if m_u else nan,
        "M_D": float(np.mean(m_d)) if m_d else nan,
        "A_SU": float(np.mean(a_su)) if a_su else nan,
    }


def pesi_metrics(pe_or_model: torch.Tensor | nn.Module, num_directions: int = 60, **materialize_kwargs: Any) -> dict[str, float]:
    """``{'M_U', 'M_D', 'A_SU'}`` of a PE tensor ``(H, W, D)``, an encoding or a vispe model."""
    if isinstance(pe_or_model, torch.Tensor):
        return pesi_from_similarity(cosine_similarity_maps(pe_or_model), num_directions)
    return pesi_from_similarity(similarity_maps(pe_or_model, **materialize_kwargs), num_directions)


def plot_similarity_maps(
    pe_or_model: torch.Tensor | nn.Module,
    path: str | Path,
    cells: Sequence[tuple[int, int]] | None = None,
    title: str | None = None,
    **materialize_kwargs: Any,
) -> Path:
    """The classic picture: for each cell ``(row, col)``, its cosine similarity to every cell.

    ``cells=None`` draws every cell of grids up to 16 x 16 (one small panel each, laid out like
    the grid) and a 4 x 4 subsample of larger grids.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if isinstance(pe_or_model, torch.Tensor):
        sim = cosine_similarity_maps(pe_or_model).numpy()
    else:
        sim = similarity_maps(pe_or_model, **materialize_kwargs).numpy()
    h, w = sim.shape[:2]
    if cells is None:
        rows = list(range(h)) if h <= 16 else np.linspace(0, h - 1, 4).round().astype(int).tolist()
        cols = list(range(w)) if w <= 16 else np.linspace(0, w - 1, 4).round().astype(int).tolist()
        layout = [[(r, c) for c in cols] for r in rows]
    else:
        cells = [(int(r), int(c)) for r, c in cells]
        for r, c in cells:
            if not (0 <= r < h and 0 <= c < w):
                raise ValueError(f"cell {(r, c)} is outside the {h}x{w} grid")
        layout = [cells]
    nr, nc = len(layout), max(len(row) for row in layout)
    fig, axes = plt.subplots(nr, nc, figsize=(0.75 * nc + 1.2, 0.75 * nr + 0.6), squeeze=False)
    im = None
    for i, row in enumerate(layout):
        for j in range(nc):
            ax = axes[i][j]
            ax.set_xticks([])
            ax.set_yticks([])
            if j < len(row):
                r, c = row[j]
                im = ax.imshow(sim[r, c], vmin=-1, vmax=1, cmap="viridis")
            else:
                ax.axis("off")
    if im is not None:
        fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.6, label="cosine similarity")
    if title:
        fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
