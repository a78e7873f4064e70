"""ComRoPE's spectral path: every ComRoPE rotation is a fixed basis change plus per-pair phases.

Each skew-symmetric block generator has a real normal form ``S = Q J Q^T`` (:func:`spectral_decomposition`), so a
token's block rotation is ``Q rot(c w) Q^T``: one dense basis change per head shared by every token, then RoPE's
elementwise phases (:func:`rotate_pair_spectral`, an autograd Function that recomputes ``q @ Q`` in its backward).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..base import autocast_off_in_backward
from ..rotary import RotaryState

__all__ = ["SPECTRAL_MIN_GAP", "spectral_decomposition", "rotate_pair_spectral", "ComRopeSpectralState"]

#: Smallest gap between the eigenvalues of ``i S`` (and so the smallest ``2 omega``) for the spectral
#: path: its gradient divides by these gaps (float32 noise / gap stays below ~1e-4 relative).
SPECTRAL_MIN_GAP = 1e-5


def spectral_decomposition(skew: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Real normal form ``S = Q J Q^T`` of skew-symmetric blocks ``skew`` ``(..., b, b)``, ``b`` even.

    ``J`` is block-diagonal with 2x2 blocks ``[[0, -w_k], [w_k, 0]]``, so ``exp(c S) = Q rot(c w) Q^T``.
    Computed from the Hermitian ``i S`` in float64 (``eigh``; its eigenvalues are ``+-w_k``): for the
    eigenvector ``u_k`` of ``+w_k`` the columns ``2k, 2k+1`` of ``Q`` are ``sqrt(2) Re u_k`` and
    ``sqrt(2) Im u_k``. Differentiable, in real arithmetic (:class:`_NormalForm`); the loss must not depend on
    the rotation of ``Q``'s columns within each pair's plane (the eigenvectors' phases), which holds for attention
    logits: both q and k are expressed in the same basis.

    Returns:
        ``(Q (..., b, b) float32, w (..., b/2) float32 >= 0, eigenvalues (..., b) float64 ascending)``.
    """
    with torch.autocast(device_type=skew.device.type, enabled=False):
        basis, omega, evals = _NormalForm.apply(skew.double())
        return basis.float(), omega.float(), evals


class _NormalForm(torch.autograd.Function):
    """``S -> (Q, w, eigenvalues)`` of :func:`spectral_decomposition`, float64, with its gradient in real arithmetic.

    The complex ``eigh``'s own backward runs as some thirty ATen operations on complex tensors, which a compiled graph
    dispatches one by one (each a launch on a GPU); this one is three matrix products and elementwise work that
    inductor fuses. With ``Omega = Q^T dQ`` (skew) and ``M = Q^T dS Q``, ``S Q = Q J`` gives
    ``M = Omega J - J Omega + dJ``: a diagonal 2x2 block of ``M`` is ``dJ_k`` (``dw_k = M_kk[1, 0]``), an
    off-diagonal block is ``M_kl = Omega_kl J_l - J_k Omega_kl``. A 2x2 matrix is a part that commutes with
    ``E = [[0, -1], [1, 0]]`` plus a part that anticommutes; the first is scaled by ``w_l - w_k``, the second by
    ``w_l + w_k`` (both times ``E``), so ``Omega_kl`` is ``M_kl`` with each part divided by its scale (times
    ``-E``). The backward is the adjoint: ``G_kl = C(A_kl E) / (w_l - w_k) + N(A_kl E) / (w_l + w_k)`` with
    ``A = Q^T dL/dQ``, ``C`` and ``N`` the commuting and anticommuting parts, ``G_kk = dL/dw_k`` at ``[1, 0]``,
    and ``dL/dS`` the skew part of ``Q G Q^T``. The diagonal blocks of ``Omega`` (the columns' rotation within
    their plane) get no gradient, as ``eigh``'s backward gives the eigenvectors' phases none.
    """

    @staticmethod
    def forward(ctx, s64: torch.Tensor):  # type: ignore[override]
        b = s64.shape[-1]
        # i S built as complex(0, S): a Python complex scalar (1j * S) has no CUDA inductor lowering
        evals, evecs = torch.linalg.eigh(torch.complex(torch.zeros_like(s64), s64))
        top = evecs[..., b // 2 :]
        basis = torch.stack([top.real, top.imag], dim=-1).flatten(-2) * math.sqrt(2.0)
        omega = evals[..., b // 2 :]
        ctx.save_for_backward(basis, omega)
        ctx.mark_non_differentiable(evals)
        return basis, omega, evals

    @staticmethod
    @autocast_off_in_backward
    def backward(ctx, grad_basis: torch.Tensor | None, grad_omega: torch.Tensor | None, _grad_evals):  # type: ignore[override]
        q, w = ctx.saved_tensors
        n = w.shape[-1]
        g = torch.zeros_like(q)
        if grad_basis is not None:
            a = (q.transpose(-1, -2) @ grad_basis.to(q.dtype)).unflatten(-1, (n, 2)).unflatten(-3, (n, 2))  # [.., k, i, l, j]
            a00, a01, a10, a11 = a[..., 0, :, 0], a[..., 0, :, 1], a[..., 1, :, 0], a[..., 1, :, 1]  # (..., k, l)
            # Z = A_kl E = [[a01, -a00], [a11, -a10]]; its commuting part p I + c E, anticommuting part r R + t R E
            p, c = (a01 - a10) / 2, (a11 + a00) / 2
            r, t = (a01 + a10) / 2, (a11 - a00) / 2
            wk, wl = w[..., :, None], w[..., None, :]
            off = ~torch.eye(n, dtype=torch.bool, device=q.device)
            # the eigenvalue gap is checked by the caller (SPECTRAL_MIN_GAP); the diagonal is masked out here
            inv_d = torch.where(off, 1.0 / torch.where(off, wl - wk, 1.0), 0.0)
            inv_s = torch.where(off, 1.0 / (wl + wk).clamp_min(torch.finfo(w.dtype).tiny), 0.0)
            pc, cc, rr, tt = p * inv_d, c * inv_d, r * inv_s, t * inv_s
            # G_kl = [[pc + rr, -cc + tt], [cc + tt, pc - rr]]
            g = torch.stack([torch.stack([pc + rr, tt - cc], -1), torch.stack([cc + tt, pc - rr], -1)], -3)  # (.., k, i, l, j)
            g = g.flatten(-2).flatten(-3, -2)
        if grad_omega is not None:
            idx = torch.arange(n, device=q.device)
            g[..., 2 * idx + 1, 2 * idx] += grad_omega.to(q.dtype)  # g is this backward's own tensor
        full = q @ g @ q.transpose(-1, -2)
        return (full - full.transpose(-1, -2)) / 2


class _SpectralRotation(torch.autograd.Function):
    """``q, k -> phase(q @ W), phase(k @ W)``: a block-diagonal orthogonal basis change ``W`` ``(H, dh, dh)``
    shared by every token, then per-pair phases from a rotary table (``view_as_real`` form ``(..., L, P, 2)``).

    Every product runs per head over all ``B * L`` tokens at once (``(H, B*L, dh) @ (H, dh, dh)``; q and k are
    token-major views of the qkv projection, so ``(H, B*L, dh)`` is a view too). Saves only q, k (which
    attention keeps alive through ``v`` anyway), ``W`` and the table; ``q @ W`` is recomputed in the backward
    instead of being stored per layer.
    """

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, basis: torch.Tensor, table_ri: torch.Tensor):  # type: ignore[override]
        ctx.save_for_backward(q, k, basis, table_ri)
        bsz, heads, length, dh = q.shape
        table = _heads_first(torch.view_as_complex(table_ri))  # (H, B or 1, L, P)
        # written token-major (memory (B, L, 2, H, dh), like timm's qkv): SDPA then returns its output
        # token-major and the head merge before the output projection stays a view, not a kept copy
        res = torch.empty(bsz, length, 2, heads, dh, dtype=torch.float32, device=q.device)
        outs = (res[:, :, 0].transpose(1, 2), res[:, :, 1].transpose(1, 2))
        for x, out in zip((q, k), outs):
            y = _by_head(x, basis)  # (H, B, L, dh)
            out_h = out.transpose(0, 1)
            if torch.compiler.is_compiling():
                out_h.copy_(torch.view_as_real(_complex_pairs(y) * table).flatten(-2))
            else:
                torch.mul(_complex_pairs(y), table, out=_complex_pairs(out_h))
        return outs

    @staticmethod
    @autocast_off_in_backward
    def backward(ctx, grad_q: torch.Tensor, grad_k: torch.Tensor):  # type: ignore[override]
        q, k, basis, table_ri = ctx.saved_tensors
        table_c = torch.view_as_complex(table_ri)
        table = _heads_first(table_c)
        need_x = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        g_basis = torch.zeros_like(basis) if ctx.needs_input_grad[2] else None
        g_table = torch.zeros_like(table) if ctx.needs_input_grad[3] else None
        grads = []
        for x, g in ((q, grad_q), (k, grad_k)):
            g_c = _complex_pairs(g.float().transpose(0, 1))  # (H, B, L, P)
            g_y = torch.view_as_real(g_c * table.conj()).flatten(-2).contiguous()  # rotate back by -phase
            flat_g = g_y.flatten(1, 2)  # (H, B*L, dh)
            if need_x:
                grads.append(torch.bmm(flat_g, basis.transpose(-1, -2)).view_as(g_y).transpose(0, 1))
            else:
                grads.append(None)
            if g_basis is not None:
                g_basis += torch.bmm(_tokens_by_head(x).transpose(-1, -2), flat_g)
            if g_table is not None:
                y = _by_head(x, basis)
                g_table += (g_c * _complex_pairs(y).conj()).sum_to_size(table.shape)
        if g_table is not None:
            g_table = torch.view_as_real(_heads_first(g_table, back=table_c.ndim)).contiguous()
        return grads[0], grads[1], g_basis, g_table


def _heads_first(table: torch.Tensor, back: int | None = None) -> torch.Tensor:
    """A rotary table ``(H, L, P)`` / ``(B, H, L, P)`` as ``(H, 1|B, L, P)`` (``back``: the inverse, to that rank)."""
    if back is None:
        return table.unsqueeze(1) if table.ndim == 3 else table.transpose(0, 1)
    return table.squeeze(1) if back == 3 else table.transpose(0, 1)


def _tokens_by_head(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, L, dh)`` -> ``(H, B*L, dh)`` (a view for token-major q/k)."""
    return x.transpose(0, 1).reshape(x.shape[1], -1, x.shape[-1])


def _by_head(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``x @ basis`` per head for all tokens of the batch: ``(B, H, L, dh)``, ``(H, dh, dh)`` -> ``(H, B, L, dh)``."""
    return torch.bmm(_tokens_by_head(x), basis).view(x.shape[1], x.shape[0], x.shape[2], x.shape[3])


def _complex_pairs(x: torch.Tensor) -> torch.Tensor:
    """Interleaved channel pairs ``(..., 2P)`` as a complex view ``(..., P)``."""
    return torch.view_as_complex(x.unflatten(-1, (-1, 2)))


def rotate_pair_spectral(
    q: torch.Tensor, k: torch.Tensor, basis: torch.Tensor, table: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q, k`` ``(B, H, L, dh)`` as ComRoPE does, in the generators' eigenbasis: ``basis`` ``(H, dh, dh)``
    (block-diagonal, orthogonal; ``x @ basis`` takes each block to its normal-form coordinates) and the
    complex phase ``table`` ``(..., L, dh/2)`` (interleaved pairs). The logits ``q' k'^T`` equal those of the
    block rotations ``Q rot Q^T`` (the trailing ``Q`` cancels between q and k); float32 maths, q's dtype out."""
    with torch.autocast(device_type=q.device.type, enabled=False):
        q2, k2 = _SpectralRotation.apply(q.float(), k.float(), basis.float(), torch.view_as_real(table))
    return q2.to(q.dtype), k2.to(k.dtype)


@dataclass
class ComRopeSpectralState:
    """Per-forward ComRoPE state on the spectral path: per layer the diagonal blocks ``(depth, H, m, b, b)`` of the
    block-diagonal basis change, and the per-pair phases as a per-layer :class:`~vispe.encodings.rotary.RotaryState`
    (``(depth, H, L, P)``)."""

    blocks: torch.Tensor
    rotary: RotaryState
    #: the host folded the basis into its q/k projection (:meth:`ComRopeBase.fold_qk_basis`): only the phases remain
    basis_folded: bool = False
    #: the dense bases of every layer, built on the first unfolded call and kept with the state (an eval-cached state
    #: builds them once, not per forward); shared by the copies ``replace`` makes, whose blocks are the same
    _dense: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_blocks(self) -> int:
        return self.blocks.shape[-3]

    def basis(self, layer: int) -> torch.Tensor:
        """The dense block-diagonal basis ``(H, dh, dh)`` of one layer (the unfolded path's per-token product)."""
        if "all" not in self._dense:
            m = self.blocks.shape[-3]
            eye = torch.eye(m, device=self.blocks.device, dtype=self.blocks.dtype)
            # (depth, H, m, b, b) -> block-diagonal (depth, H, dh, dh)
            self._dense["all"] = (self.blocks.unsqueeze(-2) * eye[:, None, :, None]).flatten(-4, -3).flatten(-2)
        return self._dense["all"][layer]

    def for_layer(self, layer: int) -> torch.Tensor:
        """Dense per-token block rotations ``(H, L, m, b, b)`` of one layer, ``Q rot(phase) Q^T`` (analysis, tests)."""
        q_mat = self.blocks[layer]  # (H, m, b, b): x @ Q_j = (Q_j^T x)^T
        m, b = q_mat.shape[-3], q_mat.shape[-1]
        phase = self.rotary.for_layer(layer)  # (H, L, P) complex
        c, s = phase.real.unflatten(-1, (m, b // 2)), phase.imag.unflatten(-1, (m, b // 2))  # (H, L, m, b/2)
        rot = torch.zeros(*c.shape[:-1], b, b, dtype=c.dtype, device=c.device)
        idx = torch.arange(b // 2, device=c.device)
        rot[..., 2 * idx, 2 * idx] = c
        rot[..., 2 * idx + 1, 2 * idx + 1] = c
        rot[..., 2 * idx + 1, 2 * idx] = s
        rot[..., 2 * idx, 2 * idx + 1] = -s
        return q_mat[:, None] @ rot @ q_mat[:, None].transpose(-1, -2)
