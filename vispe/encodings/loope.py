"""LOOPE -- learnable patch order for a 1D sinusoidal encoding (Chowdhury, Rahman, Taki, 2025).

Each patch gets a scalar position ``X = X_G + X_C``: ``X_G`` is the step at which a Gilbert
(generalised Hilbert) curve over the ``h x w`` grid visits the patch (:mod:`vispe.encodings.gilbert`),
counted from 1 as the released code does, and ``X_C in (-1, 1)`` is a bounded, image-conditioned offset from a small
context CNN, so neighbouring patches can move closer, further apart or swap while the curve keeps
locality. The encoding is the standard transformer sinusoid of ``X``
(``PE[2i] = sin(X w_i)``, ``PE[2i+1] = cos(X w_i)``, ``w_i = 10000^(-2i/D)``), added to the patch
tokens; prefix tokens get their own learned vectors (zeros init, as in the released ``ArtPE``), or, in
the fixed-order baseline, the sinusoid of position 0 (released ``get_hilbert_pos_embed``). It is per
image: computed in ``embed_tokens`` from the ``image=`` the host model passes.

Released-code conventions (AbtahiMajeed144/LOOPE, ``models/positional_encodings/hilbert.py`` and
``art_pe.py``) are the defaults; each vispe deviation is an option:

* ``curve_start=1``: ``gilbert_2d`` writes ``arr[y, x] = idx + 1`` (hilbert.py, the loop at the end of
  ``gilbert_2d``), so the first patch sits at position 1 and position 0 is left to the cls token.
  ``curve_start=0`` counts from 0 (vispe before issue 27; the paper's text).
* ``channel_order='image_yx'``: the CNN's input is ``cat([image, cord])`` with ``cord`` a ``meshgrid(...,
  indexing='ij')`` stack, i.e. channels (R, G, B, y, x) (art_pe.py, ``__init__``'s ``cord`` buffer and
  ``forward``'s ``torch.cat``). ``'xy_image'`` is vispe's earlier (x, y, R, G, B), kept so checkpoints
  trained with it still load.
* ``orientation='released'``: the curve's major axis is always the width (hilbert.py: ``generate(0, 0,
  width, 0, 0, height)`` without a branch on the shape). ``'adaptive'`` is vispe's curve for rectangles,
  which picks the axis so that every step is a unit step (:mod:`vispe.encodings.gilbert`).
* ``fixed_prefix='sinusoid'`` (``offset=False`` only): hilbert.py's ``get_hilbert_pos_embed`` prepends
  position 0 for the cls token and the whole table is frozen. ``'learned'`` gives prefix tokens learned
  zero-init vectors as in the offset model (vispe before issue 27).

:func:`vispe.models.checkpoint.load_released_loope` loads a released ``ArtPE`` state dict.

Context CNN (supplement Table 1 / released code): input = image + two coordinate maps
(``linspace(-1, 1)`` over pixels, code), Conv ``P x P`` stride ``P`` to 32 channels (one cell per
patch), four 5x5 convs to 16, 8, 4, 1 channels, GELU after every conv (code; the paper leaves the
activation open), BatchNorm(1), a head, then ``2 sigmoid(z) - 1`` (code; the same as
``tanh(z / 2)``; the paper writes ``tanh``).

Size-agnostic design (beyond the paper). The paper's head is a ``Linear(N, N)`` over the flattened
map, tied to the training grid, and the curve index range grows with ``N``. vispe's default
``head='local'`` replaces it by a 1x1 conv over ``[u, mean(u)]`` (each patch's CNN output plus the
image-wide mean, 3 parameters), so the offset keeps a global context term but works at every grid;
``order_scale='normalized'`` (default) maps ``X_G`` affinely so a new grid's positions span the training
range ``[s, s + N_train - 1]`` (``s = curve_start``) (identical to the paper at the training grid; the sinusoid is
continuous, so fractional positions are fine) and ``X_C`` stays in training-step units.
``head='linear'`` (paper/code, no bias like the code; ``linear_bias=True`` for the paper) and
``order_scale='index'`` reproduce the paper exactly; with ``head='linear'`` a different grid raises
a clear error. ``offset=False`` is the fixed-order "Hilbert" variant (``X_C = 0``, no CNN).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._checks import Choice, Ints, Real, check_choice
from .base import TokenEncoding, register_encoding
from .gilbert import GILBERT_ORIENTATIONS, gilbert_order
from .grid import PositionGrid

__all__ = ["LOOPE", "FiniteBatchNorm2d", "LoopeContext", "sinusoid_1d"]

LOOPE_HEADS = ("local", "linear")
LOOPE_ORDER_SCALES = ("normalized", "index")
#: first conv's input channels: released (R, G, B, y, x) or vispe's earlier (x, y, R, G, B)
LOOPE_CHANNEL_ORDERS = ("image_yx", "xy_image")
#: what prefix tokens get in the fixed-order variant: released sinusoid of position 0, or learned vectors
LOOPE_FIXED_PREFIXES = ("sinusoid", "learned")


def sinusoid_1d(pos: torch.Tensor, dim: int, temperature: float = 10000.0) -> torch.Tensor:
    """Interleaved sinusoid of continuous positions ``(..., N)`` -> ``(..., N, dim)`` in float32."""
    omega = temperature ** (-torch.arange(0, dim, 2, device=pos.device, dtype=torch.float32) / dim)  # (dim/2,)
    ang = pos.float()[..., None] * omega
    return torch.stack([ang.sin(), ang.cos()], dim=-1).flatten(-2)


class FiniteBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` (same parameters, buffers and state-dict keys) whose training statistics come only
    from the samples whose features are all finite.

    LOOPE normalises its context map over the batch: with a plain BatchNorm one NaN/inf pixel in one sample
    enters the batch mean (every sample's positions turn NaN) and the running statistics (every later
    evaluation batch turns NaN). Here a non-finite sample is left out of the batch statistics and of the
    running-statistics update; its own output stays non-finite, as its input is; a batch with no finite
    sample updates nothing. On an all-finite batch it is BatchNorm2d (to float rounding). Evaluation is
    plain BatchNorm2d with the running statistics.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        ok = torch.isfinite(x).flatten(1).all(1)[:, None, None, None]  # (B, 1, 1, 1): samples that count
        weight = ok.to(x.dtype).expand_as(x)
        clean = torch.where(ok, x, torch.zeros((), dtype=x.dtype, device=x.device))
        count = weight.sum(dim=(0, 2, 3))  # (C,) finite values per channel
        denom = count.clamp(min=1)
        mean = clean.sum(dim=(0, 2, 3)) / denom
        var = ((clean - mean[:, None, None]) * weight).square().sum(dim=(0, 2, 3)) / denom  # biased, as BatchNorm
        out = (x - mean[:, None, None]) * torch.rsqrt(var + self.eps)[:, None, None]
        if self.affine:
            out = out * self.weight[:, None, None] + self.bias[:, None, None]
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                seen = count > 0  # no update (not even num_batches_tracked) from a batch without a finite sample
                self.num_batches_tracked.add_(seen.any().long())
                f = self.momentum if self.momentum is not None else 1.0 / self.num_batches_tracked.clamp(min=1).double()
                unbiased = var * count / (count - 1).clamp(min=1)
                self.running_mean.copy_(torch.where(seen, (1 - f) * self.running_mean + f * mean, self.running_mean))
                self.running_var.copy_(torch.where(seen, (1 - f) * self.running_var + f * unbiased, self.running_var))
        return out


class LoopeContext(nn.Module):
    """The context CNN: image + coordinate maps -> per-patch offset in (-1, 1), ``(B, h*w)``."""

    def __init__(
        self, in_chans: int, patch_size: Sequence[int], head: str, num_patches: int, linear_bias: bool,
        channel_order: str = "image_yx",
    ) -> None:
        super().__init__()
        self.channel_order = channel_order
        ph, pw = patch_size
        self.patch_size = (ph, pw)
        widths = (32, 16, 8, 4, 1)
        layers: list[nn.Module] = [nn.Conv2d(in_chans + 2, widths[0], (ph, pw), stride=(ph, pw)), nn.GELU()]
        for cin, cout in zip(widths[:-1], widths[1:]):
            layers += [nn.Conv2d(cin, cout, 5, stride=1, padding=2), nn.GELU()]
        self.cnn = nn.Sequential(*layers)
        self.norm = FiniteBatchNorm2d(1)  # one bad sample neither spoils the batch nor the running statistics
        self.head_kind = head
        self.num_patches = num_patches
        if head == "linear":
            self.head = nn.Linear(num_patches, num_patches, bias=linear_bias)
        else:
            self.head = nn.Conv2d(2, 1, 1)  # [u, mean(u)] -> z, per patch

    def forward(self, image: torch.Tensor, grid_hw: tuple[int, int]) -> torch.Tensor:
        bsz, _, height, width = image.shape
        h, w = grid_hw
        ph, pw = self.patch_size
        pad_h, pad_w = h * ph - height, w * pw - width
        if pad_h < 0 or pad_w < 0:
            image = image[..., : h * ph, : w * pw]
        elif pad_h or pad_w:
            image = F.pad(image, (0, pad_w, 0, pad_h))  # same bottom/right padding as timm's dynamic_img_pad
        height, width = image.shape[-2:]
        ys = torch.linspace(-1, 1, height, device=image.device, dtype=image.dtype)
        xs = torch.linspace(-1, 1, width, device=image.device, dtype=image.dtype)
        cy, cx = torch.meshgrid(ys, xs, indexing="ij")
        if self.channel_order == "image_yx":  # released art_pe.py: cat([x, cord]), cord = (y, x)
            inp = torch.cat([image, torch.stack([cy, cx])[None].expand(bsz, -1, -1, -1)], dim=1)
        else:
            inp = torch.cat([torch.stack([cx, cy])[None].expand(bsz, -1, -1, -1), image], dim=1)
        u = self.norm(self.cnn(inp))  # (B, 1, h, w)
        if self.head_kind == "linear":
            if h * w != self.num_patches:
                raise ValueError(
                    f"loope head='linear' is the paper's Linear(N, N) built for {self.num_patches} patches; this input has "
                    f"{h}x{w}={h * w}. Use head='local' (size-agnostic) to change resolution."
                )
            z = self.head(u.flatten(1))
        else:
            z = self.head(torch.cat([u, u.mean(dim=(2, 3), keepdim=True).expand_as(u)], dim=1)).flatten(1)
        return 2 * torch.sigmoid(z) - 1


@register_encoding("loope")
class LOOPE(TokenEncoding):
    """Gilbert-order sinusoid + bounded image-conditioned offset (see the module docstring).

    Args:
        offset: learn the image-conditioned offset ``X_C`` (default True); False = fixed Gilbert order.
        head: ``'local'`` (size-agnostic, default) or ``'linear'`` (paper's ``N x N`` head, fixed grid).
        order_scale: ``'normalized'`` (default) or ``'index'`` (raw curve steps, paper).
        linear_bias: bias on the ``'linear'`` head (paper: yes; released code: no; default False).
        temperature: sinusoid base, default 10000.
        curve_start: position of the curve's first patch, 1 (released code, default) or 0.
        orientation: ``'released'`` (default) or ``'adaptive'`` curve on rectangles (module docstring).
        channel_order: offset CNN input, ``'image_yx'`` (released, default) or ``'xy_image'``.
        fixed_prefix: prefix tokens with ``offset=False``: ``'sinusoid'`` of position 0 (released, default)
            or ``'learned'`` vectors.
    """

    grid_ndims = (2,)
    prefix_policy = (
        "prefix tokens get their own learned vectors (zeros init); with offset=False the sinusoid of position 0 "
        "(fixed_prefix='sinusoid', released) or learned vectors"
    )

    #: option rules, checked before __init__ (vispe._checks; see PositionalEncoding.option_checks)
    option_checks = {
        "patch_size": Ints(1, length=2),
        "head": Choice(LOOPE_HEADS),
        "order_scale": Choice(LOOPE_ORDER_SCALES),
        "temperature": Real(1),  # the sinusoid base; below 1 the ladder grows (and overflows near 0)
        "curve_start": Choice((0, 1)),
        "orientation": Choice(GILBERT_ORIENTATIONS),
        "channel_order": Choice(LOOPE_CHANNEL_ORDERS),
        "fixed_prefix": Choice(LOOPE_FIXED_PREFIXES),
    }

    def __init__(
        self,
        dim: int,
        grid_size: Sequence[int],
        patch_size: Sequence[int] = (16, 16),
        in_chans: int = 3,
        num_prefix_tokens: int = 1,
        offset: bool = True,
        head: str = "local",
        order_scale: str = "normalized",
        linear_bias: bool = False,
        temperature: float = 10000.0,
        curve_start: int = 1,
        orientation: str = "released",
        channel_order: str = "image_yx",
        fixed_prefix: str = "sinusoid",
    ) -> None:
        super().__init__()
        check_choice("curve_start", curve_start, (0, 1))
        check_choice("orientation", orientation, GILBERT_ORIENTATIONS)
        check_choice("channel_order", channel_order, LOOPE_CHANNEL_ORDERS)
        check_choice("fixed_prefix", fixed_prefix, LOOPE_FIXED_PREFIXES)
        if dim % 2:
            raise ValueError(f"loope's sinusoid needs an even embedding dim, got dim={dim}")
        if head not in LOOPE_HEADS:
            raise ValueError(f"unknown loope head {head!r}; choose one of {list(LOOPE_HEADS)}")
        if order_scale not in LOOPE_ORDER_SCALES:
            raise ValueError(f"unknown loope order_scale {order_scale!r}; choose one of {list(LOOPE_ORDER_SCALES)}")
        self.dim = dim
        self.grid_size = tuple(int(g) for g in grid_size)
        self.order_scale = order_scale
        self.temperature = temperature
        self.curve_start = int(curve_start)
        self.orientation = orientation
        self.context = (
            LoopeContext(in_chans, tuple(patch_size), head, math.prod(self.grid_size), linear_bias, channel_order)
            if offset else None
        )
        self.reads_image = self.context is not None  # the offset's CNN sees the image
        self.num_prefix_tokens = num_prefix_tokens
        learned_prefix = num_prefix_tokens and (offset or fixed_prefix == "learned")
        self.prefix_embed = nn.Parameter(torch.zeros(1, num_prefix_tokens, dim)) if learned_prefix else None

    def curve_positions(self, grid: PositionGrid, device: torch.device | None) -> torch.Tensor:
        """``X_G`` for the lattice tokens in row-major order, float32 ``(N,)`` (scaled per ``order_scale``)."""
        return self.cached(("curve", grid.shape, str(device)), lambda: self._curve_positions(grid, device))

    def _curve_positions(self, grid: PositionGrid, device: torch.device | None) -> torch.Tensor:
        pos = gilbert_order(*grid.shape, device=device, orientation=self.orientation).float()
        n, n_train = grid.num_patches, math.prod(self.grid_size)
        if self.order_scale == "normalized" and n != n_train and n > 1:
            pos = pos * ((n_train - 1) / (n - 1))
        return pos + self.curve_start

    def positions(self, grid: PositionGrid, image: torch.Tensor | None, device: torch.device | None) -> torch.Tensor:
        """``X = X_G + X_C``: ``(B, N)`` with an image, ``(1, N)`` for the fixed-order variant."""
        pos = self.curve_positions(grid, device)[None]
        if self.context is None:
            return pos
        if image is None:
            raise ValueError("loope with offset=True needs the input image: the host model must call embed_tokens(..., image=x)")
        return pos + self.context(image, grid.shape).float()

    def embed_tokens(self, x, grid, state=None, image=None):
        self.check_grid(grid)
        with torch.autocast(device_type=x.device.type, enabled=False):
            pos = self.positions(grid, image, x.device)
            pe = sinusoid_1d(pos, self.dim, self.temperature)  # (B or 1, N, D), float32
        prefix = self.prefix_embed
        if prefix is None and self.num_prefix_tokens and grid.num_prefix_tokens:
            # fixed-order baseline as released: prefix tokens at position 0 of the same sinusoid
            prefix = sinusoid_1d(pe.new_zeros(1, grid.num_prefix_tokens), self.dim, self.temperature)
        return self.add_to_tokens(x, pe, grid, prefix)

    def set_grid_size(self, grid_size: Sequence[int]) -> None:
        new = tuple(int(g) for g in grid_size)
        if self.context is not None and self.context.head_kind == "linear" and math.prod(new) != self.context.num_patches:
            raise ValueError(f"loope head='linear' is tied to {self.context.num_patches} patches; cannot move to grid {new}")
        super().set_grid_size(new)

    def no_weight_decay(self) -> set[str]:
        return {"prefix_embed"} if self.prefix_embed is not None else set()
