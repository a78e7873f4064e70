"""The Triton kernels of :mod:`vispe.encodings.triton_bias`, in a module of its own: it imports Triton (imported only
when a kernel runs) and keeps its annotations as objects, which Triton reads to find the
compile-time constants (a module with postponed annotations would give it strings).

Every kernel adds the lattice term ``table[b, h, i, bucket(i, j)]`` to the logits of a tile, with
``bucket(i, j) = lut[codes[i] - codes[j] + center]`` (``fill`` for a pair with a prefix token, whose code is negative;
no ``lut``: the offset id itself). q, k, v and their gradients are addressed by (batch, head, token) strides with
contiguous channels; the table by (batch, head, row) strides (0 where it is shared) with contiguous columns. Products of
float32 tiles take ``DOT_PRECISION`` (``'ieee'``, or ``'tf32'`` where PyTorch allows TF32 matmuls); 16-bit tiles
multiply exactly with float32 sums either way.
"""
import triton
import triton.language as tl


@triton.jit
def term_tile(table, codes_q, codes_k, lut, t_b, t_h, t_l, cq_b, ck_b, b, h, rows, cols, tokens, center, fill,
               HAS_LUT: tl.constexpr):
    """The term of one (query rows x key columns) tile in float32, and each pair's bucket (its table column)."""
    row_ok = rows < tokens
    col_ok = cols < tokens
    cq = tl.load(codes_q + b * cq_b + rows, mask=row_ok, other=-1)
    ck = tl.load(codes_k + b * ck_b + cols, mask=col_ok, other=-1)
    pair = cq[:, None] - ck[None, :] + center
    pair = tl.where((cq[:, None] >= 0) & (ck[None, :] >= 0), pair, fill)
    both = row_ok[:, None] & col_ok[None, :]
    if HAS_LUT:
        bucket = tl.load(lut + pair, mask=both, other=0)
    else:
        bucket = pair
    term = tl.load(table + b * t_b + h * t_h + rows[:, None] * t_l + bucket, mask=both, other=0.0)
    return term.to(tl.float32), bucket


@triton.jit
def program_block(heads, tokens, BLOCK: tl.constexpr):
    """This program's (sample x head) index, sample, head, block of ``BLOCK`` tokens (grid axis 0) and which of them
    exist."""
    bh = tl.program_id(1)
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    return bh, bh // heads, bh % heads, idx, idx < tokens


@triton.jit
def load_rows(ptr, b, h, idx, s_b, s_h, s_n, d, mask):
    """The ``(len(idx), len(d))`` tile of a ``(B, H, L, dh)`` tensor at tokens ``idx`` of sample ``b``, head ``h``."""
    return tl.load(ptr + b * s_b + h * s_h + idx[:, None] * s_n + d[None, :], mask=mask, other=0.0)


@triton.jit
def backward_tile(qt, kt, vt, dot_, m, dl, term, both, scale, DOT_PRECISION: tl.constexpr):
    """A tile's probabilities ``P``, rebuilt from the rows' log-sum-exp ``m``, and ``dS = P (dP - delta)``."""
    s = tl.dot(qt, tl.trans(kt), input_precision=DOT_PRECISION) * scale + term
    p = tl.where(both, tl.exp(s - m[:, None]), 0.0)
    dp = tl.dot(dot_, tl.trans(vt), input_precision=DOT_PRECISION)
    return p, p * (dp - dl[:, None])


@triton.jit
def term_attention_forward_kernel(
    q, k, v, out, lse, table, codes_q, codes_k, lut,
    q_b, q_h, q_n, k_b, k_h, k_n, v_b, v_h, v_n, o_b, o_h, o_n,
    t_b, t_h, t_l, cq_b, ck_b,
    heads, tokens, head_dim, center, fill, scale,
    HAS_LUT: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One (sample, head, block of query rows): softmax(q k^T s + term) v with a running maximum and sum (nothing of
    size rows x keys leaves the chip), and each row's log-sum-exp for the backward."""
    scale = tl.cast(scale, tl.float32)  # a compiled graph passes Python floats as float64
    bh, b, h, rows, row_ok = program_block(heads, tokens, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    qt = load_rows(q, b, h, rows, q_b, q_h, q_n, d, row_ok[:, None] & d_ok[None, :])
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.full((BLOCK_M,), 0.0, tl.float32)
    acc = tl.full((BLOCK_M, BLOCK_D), 0.0, tl.float32)
    for start in range(0, tokens, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < tokens
        kv_mask = col_ok[:, None] & d_ok[None, :]
        kt = load_rows(k, b, h, cols, k_b, k_h, k_n, d, kv_mask)
        vt = load_rows(v, b, h, cols, v_b, v_h, v_n, d, kv_mask)
        term, _ = term_tile(table, codes_q, codes_k, lut, t_b, t_h, t_l, cq_b, ck_b, b, h, rows, cols, tokens, center,
                             fill, HAS_LUT)
        s = tl.dot(qt, tl.trans(kt), input_precision=DOT_PRECISION) * scale + term
        s = tl.where(col_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=DOT_PRECISION)
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(out + b * o_b + h * o_h + rows[:, None] * o_n + d[None, :], acc.to(out.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse + bh * tokens + rows, m_i + tl.log(l_i), mask=row_ok)


@triton.jit
def term_attention_dkdv_kernel(
    q, k, v, dout, lse, delta, dk, dv, table, codes_q, codes_k, lut,
    q_b, q_h, q_n, k_b, k_h, k_n, v_b, v_h, v_n, do_b, do_h, do_n, dk_b, dk_h, dk_n, dv_b, dv_h, dv_n,
    t_b, t_h, t_l, cq_b, ck_b,
    heads, tokens, head_dim, center, fill, scale,
    HAS_LUT: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One (sample, head, block of keys): dV = P^T dO and dK = s dS^T q over every query block, P rebuilt from the
    log-sum-exp and dS = P (dP - delta), delta = rowsum(dO * O)."""
    scale = tl.cast(scale, tl.float32)  # a compiled graph passes Python floats as float64
    bh, b, h, cols, col_ok = program_block(heads, tokens, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    kv_mask = col_ok[:, None] & d_ok[None, :]
    kt = load_rows(k, b, h, cols, k_b, k_h, k_n, d, kv_mask)
    vt = load_rows(v, b, h, cols, v_b, v_h, v_n, d, kv_mask)
    dk_acc = tl.full((BLOCK_N, BLOCK_D), 0.0, tl.float32)
    dv_acc = tl.full((BLOCK_N, BLOCK_D), 0.0, tl.float32)
    for start in range(0, tokens, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < tokens
        q_mask = row_ok[:, None] & d_ok[None, :]
        qt = load_rows(q, b, h, rows, q_b, q_h, q_n, d, q_mask)
        dot_ = load_rows(dout, b, h, rows, do_b, do_h, do_n, d, q_mask)
        m = tl.load(lse + bh * tokens + rows, mask=row_ok, other=0.0)
        dl = tl.load(delta + bh * tokens + rows, mask=row_ok, other=0.0)
        term, _ = term_tile(table, codes_q, codes_k, lut, t_b, t_h, t_l, cq_b, ck_b, b, h, rows, cols, tokens, center,
                             fill, HAS_LUT)
        p, ds = backward_tile(qt, kt, vt, dot_, m, dl, term, row_ok[:, None] & col_ok[None, :], scale, DOT_PRECISION)
        dv_acc += tl.dot(tl.trans(p.to(dot_.dtype)), dot_)
        dk_acc += tl.dot(tl.trans(ds.to(qt.dtype)), qt)
    tl.store(dk + b * dk_b + h * dk_h + cols[:, None] * dk_n + d[None, :], (dk_acc * scale).to(dk.dtype.element_ty), mask=kv_mask)
    tl.store(dv + b * dv_b + h * dv_h + cols[:, None] * dv_n + d[None, :], dv_acc.to(dv.dtype.element_ty), mask=kv_mask)


@triton.jit
def term_attention_dq_kernel(
    q, k, v, dout, lse, delta, dq, dterm, table, codes_q, codes_k, lut,
    q_b, q_h, q_n, k_b, k_h, k_n, v_b, v_h, v_n, do_b, do_h, do_n, dq_b, dq_h, dq_n,
    t_b, t_h, t_l, cq_b, ck_b,
    heads, tokens, head_dim, columns, center, fill, scale,
    HAS_LUT: tl.constexpr, DOT_PRECISION: tl.constexpr, TERM_GRAD: tl.constexpr, PAIR_BATCH: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One (sample, head, block of query rows): dQ = s dS k over every key block, and the term's gradient as
    ``TERM_GRAD`` says. 1 and 2: per query row, ``dterm[b, h, i, c]`` = the sum of dS over the row's pairs whose
    bucket is ``c`` (the block owns its rows), by a one-hot sum over the tile's keys (1) or by atomic adds (2). 3: dS
    per pair, ``dterm[b', h, i, j]``, summed over the batch by atomic adds (``PAIR_BATCH`` false: ``b' = 0``; the
    caller turns pairs into table columns) or stored per sample. 4: dS per pair stored query-major,
    ``dterm[i, b * heads + h, j]`` with rows of ``columns`` (>= tokens, at most the key tiles' reach) entries, the
    padding zero, for the caller's batched product with the buckets."""
    scale = tl.cast(scale, tl.float32)  # a compiled graph passes Python floats as float64
    bh, b, h, rows, row_ok = program_block(heads, tokens, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q_mask = row_ok[:, None] & d_ok[None, :]
    qt = load_rows(q, b, h, rows, q_b, q_h, q_n, d, q_mask)
    dot_ = load_rows(dout, b, h, rows, do_b, do_h, do_n, d, q_mask)
    m = tl.load(lse + bh * tokens + rows, mask=row_ok, other=0.0)
    dl = tl.load(delta + bh * tokens + rows, mask=row_ok, other=0.0)
    dq_acc = tl.full((BLOCK_M, BLOCK_D), 0.0, tl.float32)
    c = tl.arange(0, BLOCK_C)
    dterm_acc = tl.full((BLOCK_M, BLOCK_C), 0.0, tl.float32)
    term_rows = dterm + (bh * tokens + rows[:, None]) * columns
    if PAIR_BATCH:
        pair_rows = dterm + (bh * tokens + rows[:, None]) * tokens
    else:
        pair_rows = dterm + (h * tokens + rows[:, None]) * tokens
    by_row = dterm + (rows[:, None] * tl.num_programs(1) + bh) * columns  # mode 4: row-major (query, sample x head, key)
    for start in range(0, tokens, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < tokens
        both = row_ok[:, None] & col_ok[None, :]
        kv_mask = col_ok[:, None] & d_ok[None, :]
        kt = load_rows(k, b, h, cols, k_b, k_h, k_n, d, kv_mask)
        vt = load_rows(v, b, h, cols, v_b, v_h, v_n, d, kv_mask)
        term, bucket = term_tile(table, codes_q, codes_k, lut, t_b, t_h, t_l, cq_b, ck_b, b, h, rows, cols, tokens,
                                 center, fill, HAS_LUT)
        _, ds = backward_tile(qt, kt, vt, dot_, m, dl, term, both, scale, DOT_PRECISION)
        dq_acc += tl.dot(ds.to(kt.dtype), kt, input_precision=DOT_PRECISION)
        if TERM_GRAD == 1:
            hit = bucket[:, :, None] == c[None, None, :]
            dterm_acc += tl.sum(tl.where(hit, ds[:, :, None], 0.0), 1)
        if TERM_GRAD == 2:
            tl.atomic_add(term_rows + bucket, ds, mask=both, sem="relaxed")
        if TERM_GRAD == 3:
            if PAIR_BATCH:
                tl.store(pair_rows + cols[None, :], ds, mask=both)
            else:
                tl.atomic_add(pair_rows + cols[None, :], ds, mask=both, sem="relaxed")
        if TERM_GRAD == 4:  # the row's padding too (its dS is 0): the caller's product reads whole rows
            tl.store(by_row + cols[None, :], ds.to(dterm.dtype.element_ty), mask=row_ok[:, None] & (cols[None, :] < columns))
    tl.store(dq + b * dq_b + h * dq_h + rows[:, None] * dq_n + d[None, :], (dq_acc * scale).to(dq.dtype.element_ty), mask=q_mask)
    if TERM_GRAD == 1:
        tl.store(term_rows + c[None, :], dterm_acc, mask=row_ok[:, None] & (c[None, :] < columns))


@triton.jit
def term_attention_delta_kernel(
    out, dout, delta, o_b, o_h, o_n, do_b, do_h, do_n, heads, tokens, head_dim,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One (sample, head, block of rows): ``delta = rowsum(dO * O)`` in float32, which both backward kernels read (one
    pass over O and dO, where PyTorch ops would write float32 copies of both first)."""
    bh, b, h, rows, row_ok = program_block(heads, tokens, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (d[None, :] < head_dim)
    o = tl.load(out + b * o_b + h * o_h + rows[:, None] * o_n + d[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(dout + b * do_b + h * do_h + rows[:, None] * do_n + d[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(delta + bh * tokens + rows, tl.sum(o * g, 1), mask=row_ok)
