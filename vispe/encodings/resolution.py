"""The resolution contract: what an encoding does on a grid other than its training grid, declared as data.

Each encoding class states its :class:`ResolutionContract` (class attribute ``resolution``): the policies it offers
and the one a freshly built encoding uses. The policies, by what they do:

* ``extend`` -- the new grid's own positions (the formula, or the encoder, evaluated at the new integer indices);
* ``rescale`` -- coordinate rescaling: positions scaled per axis by ``train / size`` so the new grid spans the
  training grid's index range (rotary, ALiBi and 3D sin-cos encodings; :mod:`vispe.encodings.coordinates`);
* ``resample`` -- table resampling: the training grid's table computed once and resampled to the new grid
  (:func:`resample_table`; ``sincos2d``, ``seqpe``);
* ``ntk`` / ``yarn`` -- per-frequency rescalings of the rotary lattice encodings on a grown axis
  (:func:`vispe.encodings.coordinates.scale_frequencies`).

``interpolate`` is an alias: it names the one of ``rescale`` / ``resample`` the encoding has. The names tools list,
set and record (:attr:`ResolutionContract.names`, the encodings' ``extrapolation_policies``, the resolution sweep's
rows) keep ``interpolate`` for it, so results recorded under that name stay comparable.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .._checks import Choice, check_choice, did_you_mean

__all__ = [
    "INTERPOLATE",
    "POLICIES",
    "RESAMPLE_KERNELS",
    "ResolutionContract",
    "resample_table",
    "resamples_table",
    "table_under_policy",
]

#: Every policy an encoding may declare, with what it does.
POLICIES: dict[str, str] = {
    "extend": "the new grid's own positions",
    "rescale": "positions rescaled onto the training grid's range",
    "resample": "the training grid's table resampled to the new grid",
    "ntk": "NTK-aware frequency rescaling on a grown axis",
    "yarn": "YaRN's per-frequency ramp on a grown axis",
}
#: The alias of ``rescale`` / ``resample`` (whichever the encoding has).
INTERPOLATE = "interpolate"
_INTERPOLATING = ("rescale", "resample")


@dataclass(frozen=True)
class ResolutionContract:
    """An encoding's policies on a grid other than its training grid (``()``: one built-in behaviour) and its default.

    ``policies`` are names of :data:`POLICIES`, at most one of ``rescale`` / ``resample`` (the one
    :data:`INTERPOLATE` names); ``default`` is one of them (``None`` exactly when there are none).
    """

    policies: tuple[str, ...] = ()
    default: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "policies", tuple(self.policies))
        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown:
            raise ValueError(f"ResolutionContract: unknown policies {unknown}; choose from {list(POLICIES)}")
        if len(set(self.policies)) != len(self.policies) or sum(p in _INTERPOLATING for p in self.policies) > 1:
            raise ValueError(f"ResolutionContract: policies {list(self.policies)} repeat a name or declare both "
                             f"'rescale' and 'resample' ({INTERPOLATE!r} must name one)")
        if (self.default is None) != (not self.policies) or (self.default is not None and self.default not in self.policies):
            raise ValueError(f"ResolutionContract: default={self.default!r} must be one of {list(self.policies)} "
                             "(None exactly when there are no policies)")

    @property
    def interpolates_by(self) -> str | None:
        """What :data:`INTERPOLATE` means for this encoding: ``'rescale'``, ``'resample'`` or ``None`` (no alias)."""
        return next((p for p in self.policies if p in _INTERPOLATING), None)

    @property
    def names(self) -> tuple[str, ...]:
        """The policy names tools list, set and record: :attr:`policies` with :data:`INTERPOLATE` in place of
        ``rescale`` / ``resample``."""
        return tuple(INTERPOLATE if p == self.interpolates_by else p for p in self.policies)

    @property
    def accepted(self) -> tuple[str, ...]:
        """Every value the ``extrapolation`` option takes: :attr:`names` and the precise name the alias stands for."""
        return self.names + ((self.interpolates_by,) if self.interpolates_by else ())

    def name_of(self, value: str | None) -> str | None:
        """The listed name (:attr:`names`) of an accepted value (``None``: the default's)."""
        policy = self.resolve(value)
        return INTERPOLATE if policy is not None and policy == self.interpolates_by else policy

    def resolve(self, value: str | None, owner: str = "encoding") -> str | None:
        """The policy ``value`` names (``None``: the default), or ``ValueError`` naming ``owner``, the value and the
        valid choices."""
        if value is None:
            return self.default
        if not self.policies:
            raise ValueError(f"{owner} has no extrapolation option (it meets every grid one way), got extrapolation={value!r}")
        if isinstance(value, str) and value in self.accepted:
            return self.interpolates_by if value == INTERPOLATE else value
        raise ValueError(f"{owner}: {self.refusal(value)}")

    def keeps_positions(self, value: str | None, owner: str = "encoding") -> bool:
        """Whether the policy ``value`` names (``None``: the default) evaluates the new grid's own positions
        (``extend``, or no policy at all): an option that fixes the coordinates' range takes only such a policy."""
        return self.resolve(value, owner) in (None, "extend")

    def refusal(self, value: Any) -> str:
        """``"extrapolation='x' is not valid; choose one of [...]"``, naming the alias's precise name."""
        alias = f" (or {self.interpolates_by!r}, what {INTERPOLATE!r} does here)" if self.interpolates_by else ""
        return (f"extrapolation={value!r} is not valid; choose one of {list(self.names)}{alias}"
                f"{did_you_mean(value, self.accepted)}")

    def option_check(self) -> PolicyChoice:
        """The rule of the ``extrapolation`` constructor option (``None``: the default)."""
        return PolicyChoice(self)

    @classmethod
    def common(cls, contracts: Sequence[ResolutionContract]) -> ResolutionContract:
        """The contract of an encoding made of parts: the policies every part with policies offers, and their default
        when they share one (else ``extend``). ``interpolate`` stays when every such part has it, each part keeping its
        own meaning (the first part's precise name stands for it here)."""
        holders = [c for c in contracts if c.policies]
        if len(holders) <= 1:
            return holders[0] if holders else cls()
        names = [n for n in holders[0].names if all(n in c.names for c in holders[1:])]
        policies = tuple(holders[0].interpolates_by if n == INTERPOLATE else n for n in names)
        defaults = {c.name_of(c.default) for c in holders}
        return cls(policies, holders[0].default if len(defaults) == 1 and holders[0].default in policies else "extend")


class PolicyChoice(Choice):
    """The ``extrapolation`` option's rule: one of the contract's :attr:`~ResolutionContract.names` (its
    ``choices``), the alias's precise name, or ``None`` (the contract's default)."""

    def __init__(self, contract: ResolutionContract) -> None:
        super().__init__(contract.names, optional=True)
        self.contract = contract

    def describe(self) -> str:
        return f"one of {list(self.contract.accepted)}"

    def _valid(self, value: Any) -> str | None:
        return None if isinstance(value, str) and value in self.contract.accepted else "value"

    def check(self, name: str, value: Any) -> None:
        if value is None:
            return
        if self._valid(value) is not None:
            raise ValueError(self.contract.refusal(value).replace("extrapolation=", f"{name}=", 1))


# ---------------------------------------------------------------------------------------------
# table resampling: the one function
# ---------------------------------------------------------------------------------------------
#: Resampling kernels of :func:`resample_table`: name -> (``F.interpolate`` mode, antialias).
RESAMPLE_KERNELS: dict[str, tuple[str, bool]] = {
    "bicubic_antialias": ("bicubic", True),  # timm's resample_abs_pos_embed default (learned APE, sincos2d, seqpe)
    "bicubic": ("bicubic", False),
    "bilinear": ("bilinear", False),
    "bilinear_antialias": ("bilinear", True),
    "nearest": ("nearest", False),  # 2D or 3D tables
    "trilinear": ("trilinear", False),  # (t, h, w) tables
}


def resample_table(table: torch.Tensor, old: Sequence[int], new: Sequence[int], kernel: str = "bicubic_antialias") -> torch.Tensor:
    """A lattice table ``(N_old, D)`` (rows in the row-major order of the grid ``old``) resampled to the grid ``new``:
    ``(N_new, D)`` in the table's dtype (float32 math, ``align_corners=False``). 2D tables go through timm's
    ``resample_abs_pos_embed`` (timm is the reference); ``kernel`` is one of :data:`RESAMPLE_KERNELS`."""
    check_choice("kernel", kernel, RESAMPLE_KERNELS)
    mode, antialias = RESAMPLE_KERNELS[kernel]
    old, new = [int(s) for s in old], [int(s) for s in new]
    if len(old) != len(new) or mode in ("bicubic", "bilinear") and len(old) != 2 or mode == "trilinear" and len(old) != 3:
        raise ValueError(f"resample_table: kernel={kernel!r} resamples {'3' if mode == 'trilinear' else '2'}-axis grids, "
                         f"got {tuple(old)} -> {tuple(new)}")
    if len(old) == 2:
        # imported here: encodings.base imports this module, and importing timm first registers vispe's models
        from timm.layers import resample_abs_pos_embed

        return resample_abs_pos_embed(table[None], new_size=new, old_size=old, num_prefix_tokens=0, interpolation=mode,
                                      antialias=antialias)[0]
    if old == new:
        return table
    dim = table.shape[-1]
    vol = table.float().T.reshape(1, dim, *old)
    corners = {} if mode == "nearest" else {"align_corners": False}  # nearest takes no align_corners
    return F.interpolate(vol, size=new, mode=mode, **corners).reshape(dim, -1).T.to(table.dtype)


def resamples_table(policy: str | None, shape: Sequence[int], train: Sequence[int]) -> bool:
    """Whether ``policy`` builds the table of grid ``shape`` by resampling the training grid's (``resample``, off it)."""
    return policy == "resample" and tuple(shape) != tuple(train)


def table_under_policy(policy: str | None, shape: Sequence[int], train: Sequence[int],
                       build: Callable[[tuple[int, ...]], torch.Tensor], kernel: str = "bicubic_antialias") -> torch.Tensor:
    """The ``(N, D)`` table of grid ``shape`` under ``policy``: ``build(shape)``, or under ``resample`` the training
    grid's ``build(train)`` resampled (:func:`resample_table` with ``kernel``)."""
    if resamples_table(policy, shape, train):
        return resample_table(build(tuple(train)), train, shape, kernel)
    return build(tuple(shape))
