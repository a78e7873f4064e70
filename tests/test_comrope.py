"""ComRoPE: commutation, shift invariance (and its failure without commutation), blockwise = dense,
zero generators = no PE, grids, dtypes, parameter counts, bad input, peak memory (opt-in)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import timm
import torch

import vispe  # noqa: F401  (registers the models)
from vispe.encodings import EncodingContext, PositionGrid, create_encoding
from vispe.encodings.comrope import (
    SPECTRAL_MIN_GAP,
    ComRopeSpectralState,
    ComRopeState,
    apply_block_rotation,
    block_rotations,
    comrope_coordinates,
    line_jitter,
    rotate_pair,
    rotate_pair_gathered,
    rotation_from_generators,
    spectral_decomposition,
)

MODEL = "vispe_vit_tiny_patch4_32"


def _enc(name: str, ndim: int = 2, heads: int = 2, head_dim: int = 16, depth: int = 2, **kw):
    ctx = EncodingContext(dim=heads * head_dim, num_heads=heads, depth=depth, grid_size=(4,) * ndim)
    return create_encoding(name, ctx, **kw)


def _logits(rot: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return apply_block_rotation(q, rot) @ apply_block_rotation(k, rot).transpose(-1, -2)


@pytest.mark.parametrize("name,ndim", [("comrope_ap", 2), ("comrope_ld", 2), ("comrope_ld_3d", 3)])
def test_generators_commute(name, ndim):
    enc = _enc(name, ndim, block_size=4)
    gens = enc.axis_generators()  # (N, depth, H, m, b, b)
    assert gens.shape[0] == ndim
    assert torch.allclose(gens, -gens.transpose(-1, -2))  # skew-symmetric
    assert gens.abs().sum() > 0
    for i in range(ndim):
        for j in range(ndim):
            assert torch.allclose(gens[i] @ gens[j], gens[j] @ gens[i], atol=1e-5)


@pytest.mark.parametrize("name,ndim", [("comrope_ap", 2), ("comrope_ld", 2), ("comrope_ld_3d", 3)])
def test_own_rotations_equal_exp_of_generator_sum(name, ndim):
    """The fast path (scalar x skew block) equals exp(sum_i x_i A_i) from the per-axis generators."""
    enc = _enc(name, ndim, block_size=4)
    grid = PositionGrid((3,) * ndim if ndim == 3 else (3, 5), 1)
    fast = enc.rotations(grid, None)  # (depth, H, L, m, b, b), lattice products
    coords = comrope_coordinates(grid, None)
    slow = rotation_from_generators(coords, enc.axis_generators())  # one matrix_exp per token
    assert torch.allclose(fast, slow, atol=1e-5)
    assert torch.allclose(enc.reference_rotations(grid), slow, atol=1e-5)
    assert torch.equal(coords[0], torch.full((ndim,), 0.5))  # cls at the centre


@pytest.mark.parametrize("name", ["comrope_ap", "comrope_ld"])
def test_perturbed_rotations_equal_reference(name):
    enc = _enc(name, block_size=4, sigma=1.0).train()
    grid = PositionGrid((5, 6), 1)
    torch.manual_seed(3)
    fast = enc.rotations(grid, None)
    torch.manual_seed(3)
    jitter = line_jitter(grid, 1.0)
    assert all((j.abs() <= 0.5 / n).all() and j.abs().max() > 0 for j, n in zip(jitter, grid.shape))
    assert torch.allclose(fast, enc.reference_rotations(grid, jitter=jitter), atol=1e-5)


@pytest.mark.parametrize("name,ndim", [("comrope_ap", 2), ("comrope_ld", 2), ("comrope_ld_3d", 3)])
def test_logits_invariant_to_global_shift(name, ndim):
    torch.manual_seed(0)
    enc = _enc(name, ndim, block_size=4)
    grid = PositionGrid((3, 4) if ndim == 2 else (2, 3, 3), 1)
    coords = comrope_coordinates(grid, None)
    shift = torch.tensor([0.37, -1.3, 0.8][:ndim])
    gens = enc.axis_generators()
    q = torch.randn(2, enc.num_heads, coords.shape[0], enc.head_dim)
    k = torch.randn_like(q)
    base = _logits(rotation_from_generators(coords, gens)[0], q, k)
    moved = _logits(rotation_from_generators(coords + shift, gens)[0], q, k)
    assert (base - moved).abs().max() < 1e-3 * base.abs().max()
    # the rotation itself changes (so the check is not vacuous)
    assert not torch.allclose(rotation_from_generators(coords, gens), rotation_from_generators(coords + shift, gens), atol=1e-3)


def test_non_commuting_generators_fail_shift_invariance():
    """LieRE-style free per-axis blocks do not commute, and the relative property breaks."""
    torch.manual_seed(0)
    heads, m, b = 2, 4, 4
    raw = torch.randn(2, heads, m, b, b)
    gens = raw - raw.transpose(-1, -2)
    assert not torch.allclose(gens[0] @ gens[1], gens[1] @ gens[0], atol=1e-3)
    grid = PositionGrid((3, 4), 1)
    coords = comrope_coordinates(grid, None)
    q = torch.randn(2, heads, coords.shape[0], m * b)
    k = torch.randn_like(q)
    base = _logits(rotation_from_generators(coords, gens), q, k)
    moved = _logits(rotation_from_generators(coords + torch.tensor([0.37, -1.3]), gens), q, k)
    assert (base - moved).abs().max() > 1e-2 * base.abs().max()


def test_blockwise_equals_dense_block_diagonal():
    torch.manual_seed(0)
    h, length, m, b = 3, 5, 4, 4
    raw = torch.randn(h, length, m, b, b)
    rot = torch.linalg.matrix_exp(raw - raw.transpose(-1, -2))
    x = torch.randn(2, h, length, m * b)
    out = apply_block_rotation(x, rot)
    dense = torch.stack([torch.stack([torch.block_diag(*rot[hh, n]) for n in range(length)]) for hh in range(h)])
    ref = torch.einsum("hnij,bhnj->bhni", dense, x)
    assert torch.allclose(out, ref, atol=1e-5)
    assert torch.allclose(out.norm(dim=-1), x.norm(dim=-1), atol=1e-4)  # orthogonal


@pytest.mark.parametrize("name,shape", [("comrope_ap", (3, 5)), ("comrope_ld", (3, 5)), ("comrope_ld_3d", (2, 3, 2))])
def test_gathered_rotation_matches_dense_values_and_gradients(name, shape):
    """The compact path used in attention (factor line tables + custom backward) equals rotating by the
    naive per-token rotations (one ``matrix_exp`` per token and block) with autograd's own ops, in
    values and in gradients (q, k, generators). LD has one factor per axis (2 and 3 here)."""
    torch.manual_seed(0)
    enc = _enc(name, len(shape), block_size=4, rotation="blocks")
    grid = PositionGrid(shape, 1)
    state = enc.prepare(grid, None)
    assert len(state.tables[1]) == (1 if name == "comrope_ap" else len(shape))
    q = torch.randn(2, 2, grid.seq_len, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn_like(q, requires_grad=True)
    w = torch.randn_like(q)
    fast = rotate_pair_gathered(q, k, state.tables[1], state.flat_index)
    naive = enc.reference_rotations(grid)[1]  # (H, L, m, b, b), matrix_exp per token
    ref = tuple(torch.einsum("hnjab,zhnjb->zhnja", naive.double(), x.reshape(2, 2, grid.seq_len, 4, 4)).reshape(x.shape)
                for x in (q, k))
    for a, b in zip(fast, ref):
        assert torch.allclose(a.double(), b, atol=1e-5)
    params = [q, k, enc.base] + ([enc.scalars] if hasattr(enc, "scalars") else [])
    g_fast = torch.autograd.grad(sum((o * w).sum() for o in fast), params)
    # vs autograd through the lattice tables (dense per-token rotations, autograd's own matmuls) ...
    g_lattice = torch.autograd.grad(sum((o * w).sum() for o in rotate_pair(q, k, enc.rotations(grid, None)[1])), params)
    # ... and vs autograd through the naive per-token matrix_exp (float32: relative tolerance)
    g_naive = torch.autograd.grad(sum((o * w).sum() for o in rotate_pair(q, k, enc.reference_rotations(grid)[1])), params)
    for a, b, c in zip(g_fast, g_lattice, g_naive):
        assert torch.allclose(a.double(), b.double(), atol=1e-4) and a.abs().sum() > 0
        assert torch.allclose(a.double(), c.double(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name,shape", [("comrope_ap", (6, 5)), ("comrope_ld", (6, 5)), ("comrope_ld_3d", (2, 3, 4))])
def test_state_tables_scale_with_lines_not_tokens(name, shape):
    """What a forward keeps per layer is O(grid lines x blocks x b^2), not O(tokens x blocks x b^2):
    LD stores one factor table per axis and forms the per-token products inside attention."""
    enc = _enc(name, len(shape), block_size=4, rotation="blocks")
    grid = PositionGrid(shape, 1)
    state = enc.prepare(grid, None)
    per_layer = sum(t.numel() for t in state.tables[0])
    lines = max(shape) + 1 if name == "comrope_ap" else sum(n + 1 for n in shape)
    assert per_layer <= enc.num_heads * enc.num_blocks * lines * enc.block_size**2
    assert per_layer < enc.num_heads * enc.num_blocks * grid.seq_len * enc.block_size**2


def test_block_rotations_float32_under_autocast():
    coef = torch.rand(5, 2)
    raw = torch.randn(2, 4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = block_rotations(coef, raw - raw.transpose(-1, -2))
    assert r.dtype == torch.float32
    eye = torch.eye(4).expand_as(r)
    assert torch.allclose(r @ r.transpose(-1, -2), eye, atol=1e-5)


@pytest.mark.parametrize("name", ["comrope_ap", "comrope_ld"])
def test_zero_generators_equal_no_pe(name):
    torch.manual_seed(0)
    pe = timm.create_model(MODEL, pos_encoding={"name": name, "zero_init": True}, depth=2).eval()
    nope = timm.create_model(MODEL, pos_encoding="none", depth=2).eval()
    missing, unexpected = nope.load_state_dict(pe.state_dict(), strict=False)
    assert not missing and all(u.startswith("pos_encoding.") for u in unexpected)
    x = torch.randn(2, 3, 32, 40)
    with torch.no_grad():
        assert torch.allclose(pe(x), nope(x), atol=1e-5)
        # and a non-zero init really changes the output
        pe2 = timm.create_model(MODEL, pos_encoding=name, depth=2).eval()
        pe2.load_state_dict({k: v for k, v in pe.state_dict().items() if not k.startswith("pos_encoding.")}, strict=False)
        assert not torch.allclose(pe2(x), nope(x), atol=1e-3)


@pytest.mark.parametrize("name", ["comrope_ap", "comrope_ld"])
def test_forward_backward_grids_and_bf16(name):
    model = timm.create_model(MODEL, pos_encoding={"name": name, "sigma": 1.0}, depth=1)
    for hw in [(32, 32), (48, 48), (32, 56)]:
        model.zero_grad()
        model(torch.randn(2, 3, *hw)).sum().backward()
        assert model.pos_encoding.base.grad.abs().sum() > 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(torch.randn(2, 3, 40, 32))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_3d_variant_runs_on_video_grid():
    torch.manual_seed(0)
    enc = _enc("comrope_ld_3d", 3, heads=2, head_dim=16)
    grid = PositionGrid((2, 3, 4), 1)
    state = enc.prepare(grid, None)
    q = torch.randn(1, 2, grid.seq_len, 16, requires_grad=True)
    out = enc.attend(q, q, q, layer=1, state=state)
    out.sum().backward()
    assert out.shape == q.shape and enc.base.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="3"):
        enc.prepare(PositionGrid((4, 4), 1), None)


def test_perturbation_only_in_training_and_cache_in_eval():
    enc = _enc("comrope_ld", sigma=1.0)
    grid = PositionGrid((4, 4), 1)
    enc.train()
    a, b = enc.prepare(grid, None).for_layer(0), enc.prepare(grid, None).for_layer(0)
    assert not torch.allclose(a, b)
    enc.eval()
    with torch.no_grad():
        s1, s2 = enc.prepare(grid, None), enc.prepare(grid, None)
    assert s1 is s2
    # (the cached state is the spectral one, rotations() the lattice products: equal up to float32 rounding)
    assert torch.allclose(torch.stack([s1.for_layer(i) for i in range(enc.depth)]), enc.rotations(grid, None).detach(), atol=1e-5)


@pytest.mark.parametrize(
    "name,kw,expected",
    [
        ("comrope_ap", {}, 73_728),
        ("comrope_ld", {}, 76_032),
        ("comrope_ld", {"shared_scalars": True}, 73_920),
    ],
)
def test_param_count_vit_b(name, kw, expected):
    with torch.device("meta"):
        model = timm.create_model("vispe_vit_base_patch16_224", pos_encoding={"name": name, **kw})
    assert sum(p.numel() for p in model.pos_encoding.parameters()) == expected


def test_bad_input():
    with pytest.raises(ValueError, match="block_size=6 does not divide head_dim=16"):
        _enc("comrope_ap", block_size=6)
    with pytest.raises(ValueError, match="multiple of 2"):
        _enc("comrope_ap", head_dim=24, block_size=8)  # 3 blocks over 2 axes
    with pytest.raises(ValueError, match="block_size"):
        _enc("comrope_ld", block_size=1)
    with pytest.raises(ValueError, match="sigma"):
        _enc("comrope_ld", sigma=-1.0)
    with pytest.raises(TypeError, match="valid options"):
        _enc("comrope_ld", blocksize=8)


# ---------------------------------------------------------------------------------------------
# Peak memory, ViT-S/16 at 224, batch 8, forward + backward (opt-in: VISPE_MEMORY_TEST=1).
# Each model runs in its own subprocess (glibc told to mmap buffers >= 128 KiB so freed ones leave RSS);
# the figure is the peak RSS increase over the RSS just
# before the forward (ru_maxrss after the step minus the RSS before it).
# ---------------------------------------------------------------------------------------------
_MEM_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys, torch, timm, vispe
    torch.manual_seed(0)
    torch.set_num_threads(1)
    name = sys.argv[1]
    model = timm.create_model('vispe_vit_small_patch16_224', pos_encoding=name)
    x = torch.randn(8, 3, 224, 224)
    def rss_kib():
        with open('/proc/self/status') as f:
            for line in f:
                if line.startswith('VmRSS:'):
                    return int(line.split()[1])
    before = rss_kib()
    model(x).sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({'name': name, 'before_mib': before / 1024, 'peak_mib': peak / 1024, 'delta_mib': (peak - before) / 1024}))
    """
)


def measure_peak_memory(names: tuple[str, ...] = ("rope_axial", "comrope_ap", "comrope_ld")) -> dict[str, dict]:
    out = {}
    for name in names:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
        res = subprocess.run([sys.executable, "-c", _MEM_SCRIPT, name], capture_output=True, text=True, check=True, env=env)
        out[name] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.skipif(os.environ.get("VISPE_MEMORY_TEST") != "1", reason="slow; set VISPE_MEMORY_TEST=1")
def test_peak_memory_vs_rope_axial():
    res = measure_peak_memory()
    base = res["rope_axial"]["delta_mib"]
    for name in ("comrope_ap", "comrope_ld"):
        ratio = res[name]["delta_mib"] / base
        print(f"{name}: {res[name]['delta_mib']:.0f} MiB vs rope_axial {base:.0f} MiB -> {ratio:.3f}x")
        assert ratio <= 1.10


if __name__ == "__main__":  # python tests/test_comrope.py  -> prints the memory figures
    for name, r in measure_peak_memory().items():
        print(name, json.dumps(r))


# -- the spectral path: basis change + per-pair phases ----------------------------------------


def test_spectral_decomposition_is_the_real_normal_form():
    """``S = Q J Q^T`` with ``Q`` orthogonal and ``J`` 2x2 blocks ``[[0, -w], [w, 0]]``, so that
    ``exp(c S) = Q rot(c w) Q^T`` -- checked against ``matrix_exp`` at several ``c``."""
    torch.manual_seed(0)
    raw = torch.randn(3, 2, 8, 8)
    skew = raw - raw.transpose(-1, -2)
    basis, omega, evals = spectral_decomposition(skew)
    eye = torch.eye(8)
    assert torch.allclose(basis.transpose(-1, -2) @ basis, eye.expand_as(basis), atol=1e-5)
    assert (omega >= 0).all() and torch.allclose(evals[..., 4:].float(), omega) and torch.allclose(evals[..., :4].float(), -omega.flip(-1))
    j = torch.zeros_like(skew)
    i = torch.arange(4)
    j[..., 2 * i + 1, 2 * i] = omega
    j[..., 2 * i, 2 * i + 1] = -omega
    assert torch.allclose(basis @ j @ basis.transpose(-1, -2), skew, atol=1e-4)
    for c in (0.3, -1.7, 4.0):
        rot = torch.linalg.matrix_exp(c * j)
        assert torch.allclose(basis @ rot @ basis.transpose(-1, -2), torch.linalg.matrix_exp(c * skew), atol=1e-4)


def _attention_like_loss(decompose, raw: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A loss that, like attention logits, does not depend on how each pair's two basis columns are rotated within
    their plane: ``sum (rot(c w) Q^T q) . (Q^T k)`` over a few tokens, plus a term in ``w`` alone."""
    skew = raw - raw.transpose(-1, -2)
    basis, omega, _ = decompose(skew)
    basis, omega = basis.double(), omega.double()
    n, b = omega.shape[-1], skew.shape[-1]
    q, k = torch.randn(2, 5, b, generator=gen, dtype=torch.float64)
    c = torch.randn(5, 1, generator=gen, dtype=torch.float64)
    qb = torch.einsum("td,...de->...te", q, basis).unflatten(-1, (n, 2))
    kb = torch.einsum("td,...de->...te", k, basis).unflatten(-1, (n, 2))
    cos, sin = (c * omega[..., None, :]).cos(), (c * omega[..., None, :]).sin()
    rotated = torch.stack([qb[..., 0] * cos - qb[..., 1] * sin, qb[..., 0] * sin + qb[..., 1] * cos], -1)
    return (rotated * kb).sum() + 0.3 * omega.square().sum()


def _decomposition_through_complex_eigh(skew: torch.Tensor):
    """The normal form with ``eigh``'s own (complex) backward: the oracle of the real-arithmetic gradient."""
    b = skew.shape[-1]
    s64 = skew.double()
    evals, evecs = torch.linalg.eigh(torch.complex(torch.zeros_like(s64), s64))
    top = evecs[..., b // 2:]
    return torch.stack([top.real, top.imag], dim=-1).flatten(-2) * math.sqrt(2.0), evals[..., b // 2:], evals


@pytest.mark.parametrize("shape", [(3, 8, 8), (2, 4, 6, 6), (5, 2, 2)])
def test_spectral_decomposition_gradient_equals_eigh_and_finite_differences(shape):
    """The normal form's gradient, written in real arithmetic (a compiled graph fuses it; eigh's complex backward
    is ~30 separately dispatched complex ops), equals the gradient through ``eigh``'s own backward and passes
    ``gradcheck`` (finite differences of the forward) for a loss that, like attention, ignores the basis columns'
    rotation within each pair's plane."""
    from vispe.encodings.comrope.spectral import _NormalForm  # spectral_decomposition's float64 core

    gen = torch.Generator().manual_seed(0)
    raw = torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)

    def loss(decompose, r):
        return _attention_like_loss(decompose, r, torch.Generator().manual_seed(1))

    want, = torch.autograd.grad(loss(_decomposition_through_complex_eigh, raw), raw)
    got, = torch.autograd.grad(loss(_NormalForm.apply, raw), raw)
    assert want.abs().max() > 1.0  # a real gradient, not a vanishing one
    torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-9)
    assert torch.autograd.gradcheck(lambda r: loss(_NormalForm.apply, r), (raw,), eps=1e-6, atol=1e-6)
    # the float32 outputs the encodings use: the same gradient, rounded
    got32, = torch.autograd.grad(loss(spectral_decomposition, raw), raw)
    torch.testing.assert_close(got32, want, atol=1e-4 * want.abs().max().item(), rtol=1e-4)


#: training-time coordinate moves: the spectral path's per-token phases and the line tables must move alike
_MOVES = {"coord_shift": 1.0, "coord_jitter": 1.3, "coord_rescale": 1.2, "random_positions": 2.0}


@pytest.mark.parametrize("name,shape,options", [("comrope_ap", (3, 5), {}), ("comrope_ld", (4, 3), {}),
                                                ("comrope_ld", (4, 3), {"sigma": 1.0}), ("comrope_ap", (4, 3), _MOVES),
                                                ("comrope_ld_3d", (2, 3, 2), {}), ("comrope_ld_3d", (3, 2, 2), _MOVES)])
def test_spectral_path_equals_block_rotations_in_values_and_gradients(name, shape, options):
    """``rotation='auto'`` (spectral: rotated q/k in the generators' eigenbasis) gives the attention output, and the
    gradients of q, k, v and every parameter, of the per-token block rotations (``'blocks'``), also with the lines
    moved at training time."""
    grid = PositionGrid(shape, 1)
    results = []
    for rotation in ("auto", "blocks"):
        torch.manual_seed(0)
        enc = _enc(name, len(shape), heads=2, head_dim=16, block_size=4, rotation=rotation, **options).train()
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(2, 2, grid.seq_len, 16, generator=g, requires_grad=True) for _ in range(3))
        torch.manual_seed(5)  # the same line moves for both paths
        state = enc.prepare(grid, None)
        assert isinstance(state, ComRopeSpectralState if rotation == "auto" else ComRopeState)
        out = sum(enc.attend(q, k, v, layer=layer, state=state) for layer in range(enc.depth))
        w = torch.randn(out.shape, generator=g)
        grads = torch.autograd.grad((out * w).sum(), [q, k, v, *enc.parameters()])
        results.append((out, grads))
    (out_s, g_s), (out_b, g_b) = results
    assert torch.allclose(out_s, out_b, atol=1e-5)
    for a, b in zip(g_s, g_b):
        assert b.abs().sum() > 0 and torch.allclose(a, b, rtol=1e-4, atol=1e-4 * b.abs().max())


@pytest.mark.parametrize("name,ndim", [("comrope_ap", 2), ("comrope_ld", 2), ("comrope_ld_3d", 3)])
def test_spectral_state_rotations_equal_matrix_exp_per_token(name, ndim):
    """The spectral state's rotations ``Q rot(phase) Q^T`` are each token's ``matrix_exp`` (prefix tokens included)."""
    torch.manual_seed(0)
    enc = _enc(name, ndim, block_size=4)
    grid = PositionGrid((3, 4) if ndim == 2 else (2, 3, 2), 2)
    state = enc.prepare(grid, None)
    assert isinstance(state, ComRopeSpectralState)
    ref = enc.reference_rotations(grid)
    for layer in range(enc.depth):
        assert torch.allclose(state.for_layer(layer), ref[layer], atol=1e-5)


def test_auto_falls_back_to_block_rotations_where_the_spectral_path_does_not_apply():
    """Zero generators (``zero_init``: every eigenvalue 0), an odd block size (a zero eigenvalue always)
    and near-equal eigenvalues (the spectral gradient divides by their gaps) use the block products."""
    grid = PositionGrid((3, 3), 1)
    assert isinstance(_enc("comrope_ld", zero_init=True).prepare(grid, None), ComRopeState)
    odd = _enc("comrope_ap", heads=2, head_dim=12, block_size=3)
    assert isinstance(odd.prepare(grid, None), ComRopeState)
    enc = _enc("comrope_ap", block_size=4)
    assert isinstance(enc.prepare(grid, None), ComRopeSpectralState)
    with torch.no_grad():  # make one block's generator have a double eigenvalue pair (+-w twice)
        enc.base.zero_()
        enc.base[0, 0, 0, 0, 1] = enc.base[0, 0, 0, 2, 3] = 0.7
        enc.base[..., 1:, 0, 1] = 0.3 + torch.rand(enc.base[..., 1:, 0, 1].shape)
    _, _, evals = spectral_decomposition(enc.skew_blocks())
    assert evals.diff(dim=-1).min() <= SPECTRAL_MIN_GAP
    assert isinstance(enc.prepare(grid, None), ComRopeState)
    with pytest.raises(ValueError, match="rotation='dense' is not valid; choose one of"):
        _enc("comrope_ld", rotation="dense")


def _compiled_train_step_matches_eager(model: torch.nn.Module, x: torch.Tensor) -> None:
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    want = model(x).square().mean()
    want.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    got = compiled(x).square().mean()
    got.backward()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], atol=1e-5, rtol=1e-5, msg=lambda m, n=n: f"gradient of {n}: {m}")


@pytest.mark.slow
def test_compiled_paths_follow_the_generators():
    """Under torch.compile the eigenvalue gap cannot choose the path (a data-dependent branch): random generators
    compile the spectral path (equal to eager's, which takes it too), zero_init compiles the line tables (equal to
    eager's line tables), and generators that become degenerate stop the compiled step with a clear error instead
    of giving the spectral path's unreliable gradient."""
    x = torch.randn(2, 3, 32, 32)
    for zero_init in (False, True):
        torch.manual_seed(0)
        model = timm.create_model(MODEL, pos_encoding={"name": "comrope_ld", "zero_init": zero_init}, embed_dim=48, depth=1,
                                  num_heads=3, num_classes=5).train()
        _compiled_train_step_matches_eager(model, x)
    torch.manual_seed(0)
    model = timm.create_model(MODEL, pos_encoding="comrope_ap", embed_dim=48, depth=1, num_heads=3, num_classes=5).train()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled(x).sum().backward()
    with torch.no_grad():
        model.pos_encoding.base.zero_()  # every eigenvalue 0
    with pytest.raises(RuntimeError, match="closer than SPECTRAL_MIN_GAP.*rotation='blocks'"):
        compiled(x).sum().backward()


@pytest.mark.parametrize("name", ["comrope_ap", "comrope_ld"])
def test_spectral_path_under_patch_dropout_equals_full_rows(name):
    """keep_tokens narrows the phase table; kept tokens see the logits they have in the full sequence."""
    torch.manual_seed(0)
    enc = _enc(name, block_size=4).eval()
    grid = PositionGrid((3, 4), 1)
    full = enc.prepare(grid, None)
    keep = torch.tensor([[0, 2, 5, 11], [1, 3, 4, 7]])
    kept_grid = grid.with_keep(keep)
    narrow = enc.keep_tokens(full, kept_grid)
    rows = kept_grid.sequence_index()
    q = torch.randn(2, 2, grid.seq_len, 16)
    k = torch.randn_like(q)
    qf, kf = enc.rotate_qk(q, k, full, 1)
    take = lambda x: torch.stack([x[b][:, rows[b]] for b in range(2)])  # noqa: E731
    qn, kn = enc.rotate_qk(take(q), take(k), narrow, 1)
    assert torch.allclose(qn @ kn.transpose(-1, -2), take(qf) @ take(kf).transpose(-1, -2), atol=1e-5)


# -- the spectral basis folded into the qkv projection ----------------------------------------------------------
def _fold_calls(monkeypatch) -> list[int]:
    """Each call of the fold records how many layers it folded (1: one layer's projection; L: a stack of L)."""
    import vispe.models.layers as layers

    calls: list[int] = []
    real = layers._fold_layers

    def counting(weight, *args):
        calls.append(1 if weight.ndim == 2 else weight.shape[0])
        return real(weight, *args)

    counting.real = real  # type: ignore[attr-defined]
    monkeypatch.setattr(layers, "_fold_layers", counting)
    return calls


@pytest.mark.parametrize("name", ["comrope_ap", "comrope_ld"])
def test_folded_basis_equals_the_per_token_basis_change_in_logits_and_gradients(name, monkeypatch):
    """A host with plain qkv projections folds the spectral basis into its q/k weights: eager, layer by layer (the
    folded weight rebuilt in the backward, not stored); compiled, all layers in one product; a layer whose ``qkv`` a
    hook watches takes the per-token path. The logits and every parameter's gradient equal the per-token path's,
    which every layer runs when hooks watch all of them."""
    calls = _fold_calls(monkeypatch)
    torch.manual_seed(0)
    model = timm.create_model(MODEL, pos_encoding=name, depth=3, qkv_bias=True).train()
    x, y = torch.randn(3, 3, 32, 32), torch.tensor([0, 1, 2])

    def run(net=model):
        model.zero_grad()
        out = net(x)
        torch.nn.functional.cross_entropy(out, y).backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    folded, g_folded = run()
    assert calls == [1] * 6  # one fold per layer in the forward, rebuilt once in the backward
    hook = model.blocks[1].attn.qkv.register_forward_hook(lambda m, i, o: None)
    mixed, g_mixed = run()
    hook.remove()
    assert calls[6:] == [1] * 4  # layers 0 and 2
    del calls[:]
    stacked, g_stacked = run(torch.compile(model, backend="eager", fullgraph=True))
    assert calls == [3]  # traced once: the stack of three layers, forward and backward
    # a block watched by a hook (FSDP2 gathers a block's parameters in one): compiled, every layer folds on its own
    # (the per-layer fold runs inside an autograd.Function, where a compiled graph cannot count calls: the real fold)
    import vispe.models.layers as layers

    torch._dynamo.reset()
    stacked_folds = []
    real_stack = layers.fold_qk_bases_of_blocks
    with monkeypatch.context() as patch:
        patch.setattr(layers, "_fold_layers", layers._fold_layers.real)
        patch.setattr(layers, "fold_qk_bases_of_blocks", lambda *a: stacked_folds.append(real_stack(*a)) or stacked_folds[-1])
        hook = model.blocks[2].register_forward_pre_hook(lambda m, a: None)
        hooked, g_hooked = run(torch.compile(model, backend="eager", fullgraph=True))
        hook.remove()
    assert stacked_folds == [None] and calls == [3]
    seen: list[torch.dtype] = []
    hooks = [blk.attn.qkv.register_forward_hook(lambda m, i, o: seen.append(o.dtype)) for blk in model.blocks]
    per_token, g_per_token = run()
    assert calls == [3] and len(seen) == 3  # watched: the module is called, nothing folded
    for h in hooks:
        h.remove()
    for out, grads in ((folded, g_folded), (mixed, g_mixed), (stacked, g_stacked), (hooked, g_hooked)):
        assert torch.allclose(out, per_token, atol=1e-5, rtol=1e-5)
        assert grads.keys() == g_per_token.keys()
        for n in grads:
            scale = g_per_token[n].abs().max().clamp_min(1e-12)
            assert ((grads[n] - g_per_token[n]).abs().max() / scale) < 1e-4, n
    # bf16 autocast through the folded projections: finite, and close to float32
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    torch.nn.functional.cross_entropy(out.float(), y).backward()
    assert calls[1:] == [1] * 6 and out.dtype == torch.bfloat16
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert (out.float() - per_token).abs().max() < 0.05


@pytest.mark.parametrize("with_bias", [True, False])
def test_a_basis_folded_as_its_diagonal_blocks_equals_the_dense_fold(with_bias):
    """The spectral basis is block-diagonal; folding it as its blocks ``(H, m, b, b)`` gives the projection and every
    gradient (input, weight, bias, basis) of folding the dense ``(H, dh, dh)`` matrix, and of no fold at all
    (float32 maths inside the fold: float32 tolerances)."""
    from vispe.models.layers import _FoldedProjection

    torch.manual_seed(0)
    heads, m, b, dim = 3, 4, 2, 10
    dh = m * b
    x = torch.randn(2, 5, dim, dtype=torch.float32, requires_grad=True)
    weight = torch.randn(3 * heads * dh, dim, dtype=torch.float32, requires_grad=True)
    bias = torch.randn(3 * heads * dh, dtype=torch.float32, requires_grad=True) if with_bias else None
    blocks = torch.randn(heads, m, b, b, dtype=torch.float32, requires_grad=True)
    dense = torch.block_diag(*blocks.detach().reshape(-1, b, b)).reshape(heads, m * b, heads * m * b)
    dense = torch.stack([dense[h, :, h * dh:(h + 1) * dh] for h in range(heads)]).requires_grad_()
    grad_out = torch.randn(2, 5, 3 * heads * dh, dtype=torch.float32)
    inputs = [t for t in (x, weight, bias) if t is not None]
    tol = {"rtol": 1e-5, "atol": 1e-5}

    def run(basis):
        out = _FoldedProjection.apply(x, weight, bias, basis)
        grads = torch.autograd.grad(out, [*inputs, basis], grad_out)
        return out, grads

    out_b, g_b = run(blocks)
    out_d, g_d = run(dense)
    # the reference without any fold: q and k heads multiplied after a plain projection
    plain = torch.nn.functional.linear(x, weight, bias).unflatten(-1, (3, heads, dh))
    ref = torch.cat([torch.einsum("blshd,hde->blshe", plain[:, :, :2], dense), plain[:, :, 2:]], dim=2).flatten(2)
    torch.testing.assert_close(out_b, ref, **tol)
    torch.testing.assert_close(out_d, ref, **tol)
    for a, c in zip(g_b[:-1], g_d[:-1]):
        torch.testing.assert_close(a, c, **tol)
    # the blocks' gradient is the dense gradient's diagonal blocks
    diag = torch.stack([g_d[-1][h].reshape(m, b, m, b).diagonal(dim1=0, dim2=2).permute(2, 0, 1) for h in range(heads)])
    torch.testing.assert_close(g_b[-1], diag, **tol)


def test_no_fold_for_q_k_norms_or_other_encodings(monkeypatch):
    calls = _fold_calls(monkeypatch)
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    model = timm.create_model(MODEL, pos_encoding="comrope_ld", depth=2, qk_norm=True)
    model(x)  # q/k are normalised between projection and rotation: the basis is applied per token
    timm.create_model(MODEL, pos_encoding="rope_mixed", depth=2)(x)  # nothing to fold
    assert calls == []
    enc = _enc("comrope_ld", rotation="blocks")
    state = enc.prepare(PositionGrid((3, 3)))
    assert enc.fold_qk_basis(state, 0) == (None, state)  # block products: no shared basis


@pytest.mark.parametrize("time_scale,frame_denominator", [(None, 7), ("spatial", 7), ("frames", 4)])
def test_3d_frame_coordinates_of_a_4_frame_7x7_clip(time_scale, frame_denominator):
    """Released ComRoPE (Longin-Yu/ComRoPE model.py, get_positions, num_axes == 3) places frame t at
    (t + 0.5) / n_spatial; vispe's earlier (t + 0.5) / T is time_scale='frames'. Every path -- lattice line
    tables, spectral state, per-token matrix_exp -- uses the same coordinates."""
    torch.manual_seed(0)
    kw = {} if time_scale is None else {"time_scale": time_scale}
    enc = _enc("comrope_ld_3d", 3, block_size=4, **kw)
    grid = PositionGrid((4, 7, 7), 1)
    t, r, c = torch.meshgrid(torch.arange(4.0), torch.arange(7.0), torch.arange(7.0), indexing="ij")
    expected = torch.stack([(t + 0.5) / frame_denominator, (r + 0.5) / 7, (c + 0.5) / 7], -1).reshape(-1, 3)
    expected = torch.cat([torch.full((1, 3), 0.5), expected])  # cls at the centre, as released (cls_position)
    frames = sorted({round(v, 6) for v in expected[1:, 0].tolist()})
    assert frames == [round((i + 0.5) / frame_denominator, 6) for i in range(4)]  # main before issue 27: /4 by default
    slow = rotation_from_generators(expected, enc.axis_generators())
    assert torch.allclose(enc.rotations(grid, None), slow, atol=2e-5)  # lattice line tables
    assert torch.allclose(enc.reference_rotations(grid), slow, atol=2e-5)
    state = enc.prepare(grid, None)
    assert isinstance(state, ComRopeSpectralState)
    for layer in range(enc.depth):
        assert torch.allclose(state.for_layer(layer), slow[layer], atol=2e-5)


def test_3d_time_scale_bad_input():
    with pytest.raises(ValueError, match="time_scale"):
        _enc("comrope_ld_3d", 3, time_scale="seconds")
