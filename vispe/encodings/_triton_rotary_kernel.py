"""The Triton kernel of :mod:`vispe.encodings.triton_rotary`, in a module of its own: it imports Triton (imported only
when the kernel runs) and keeps its annotations as objects, which Triton reads to find the compile-time constants (a
module with postponed annotations would give it strings)."""
import triton
import triton.language as tl


@triton.jit
def rotate_qkv_kernel(
    q_in, k_in, v_in, q_out, k_out, v_out, table,
    qi_b, qi_h, qi_n, ki_b, ki_h, ki_n, vi_b, vi_h, vi_n,
    qo_b, qo_h, qo_n, ko_b, ko_h, ko_n, vo_b, vo_h, vo_n, o_slot,
    t_b, t_h, t_n,
    heads, tokens, pairs,
    SIGN: tl.constexpr, INTERLEAVED: tl.constexpr, STACKED_OUT: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """One (sample, head, block of tokens): q and k rotated by ``SIGN`` times the table's angles, v copied. Every
    tensor is addressed by its (batch, head, token) strides; channels and the table's ``(pair, cos|sin)`` are
    contiguous. ``INTERLEAVED``: pair ``i`` is channels ``(2i, 2i+1)``, else ``(i, i + pairs)``. ``STACKED_OUT``: the
    three outputs are slots of one tensor, ``q_out`` at slot 0, ``o_slot`` apart, with ``q_out``'s strides (``k_out``
    and ``v_out`` are not written: one written tensor, which a compiled graph keeps as it is)."""
    bh = tl.program_id(0)
    b = bh // heads
    h = bh % heads
    n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N))[:, None]
    # tiles are 2D with contiguous channels (so loads and stores vectorise); pairs are split out in registers
    d = tl.arange(0, 2 * BLOCK_P)[None, :]
    p = tl.arange(0, BLOCK_P)[None, :]
    rows = n < tokens
    full = rows & (d < 2 * pairs)
    half = rows & (p < pairs)
    tab = tl.load(table + b * t_b + h * t_h + n * t_n + d, mask=full, other=0.0)
    cos, sin = tl.split(tl.reshape(tab, (BLOCK_N, BLOCK_P, 2)))
    sin = sin * SIGN
    q_dst = q_out + b * qo_b + h * qo_h + n * qo_n
    if STACKED_OUT:
        k_dst, v_dst = q_dst + o_slot, q_dst + 2 * o_slot
    else:
        k_dst, v_dst = k_out + b * ko_b + h * ko_h + n * ko_n, v_out + b * vo_b + h * vo_h + n * vo_n
    for which in tl.static_range(2):  # q, then k: unrolled at compile time
        if which == 0:
            src, dst = q_in + b * qi_b + h * qi_h + n * qi_n, q_dst
        else:
            src, dst = k_in + b * ki_b + h * ki_h + n * ki_n, k_dst
        if INTERLEAVED:
            x = tl.load(src + d, mask=full, other=0.0).to(tl.float32)
            xa, xb = tl.split(tl.reshape(x, (BLOCK_N, BLOCK_P, 2)))
            y = tl.reshape(tl.join(xa * cos - xb * sin, xa * sin + xb * cos), (BLOCK_N, 2 * BLOCK_P))
            tl.store(dst + d, y.to(dst.dtype.element_ty), mask=full)
        else:
            xa = tl.load(src + p, mask=half, other=0.0).to(tl.float32)
            xb = tl.load(src + pairs + p, mask=half, other=0.0).to(tl.float32)
            tl.store(dst + p, (xa * cos - xb * sin).to(dst.dtype.element_ty), mask=half)
            tl.store(dst + pairs + p, (xa * sin + xb * cos).to(dst.dtype.element_ty), mask=half)
    v = tl.load(v_in + b * vi_b + h * vi_h + n * vi_n + d, mask=full, other=0.0)
    tl.store(v_dst + d, v, mask=full)
