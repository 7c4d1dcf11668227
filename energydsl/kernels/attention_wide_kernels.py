"""The softmax family's Triton kernels for feature widths that do not fit one tile (templates, as in
`attention_kernels.py`, whose score function `_scores` and formulas they share).

`attention_kernels.py` keeps a whole (BLOCK_M, D) query tile and (BLOCK_M, D) accumulators in registers,
which stops at D = 256. CEM's exact diagonal term is wider: its score (W_Q u)·(W_K h_j) + h_j·(dg ∘ u) is one
dot product of concatenated features, head width plus model width (832 at d = 768, 12 heads). Here every
feature axis is cut into tiles of BLOCK_D:

* a score tile is the sum over feature tiles, `_tile_dots(Q, K, ...)`, loaded as it is summed, so nothing
  D wide is held;
* each program owns one feature tile of its output (a third grid axis: the value tile of o or r, the key
  tile of dQ, the key and value tiles of dK / dV) and recomputes the scores it needs;
* or, in the backward with FEATURE_LOOP (an autotune choice), one program per row block computes each score
  tile once and adds its products to every feature tile of the fp32 gradients in memory (`_add_products`).

The recomputation costs FLOPs (the scores are computed once per output tile), the loop memory traffic (each
gradient tile read and written once per block), neither costs memory: nothing T x T or T x D beyond the
inputs and outputs is stored, so peak memory stays linear in T, which the torch fallback (an additive T x T
mask whenever there is a bias or a strict mask) is not.
"""

import triton
import triton.language as tl

from .attention_kernels import _key_blocks, _query_blocks, _scores


@triton.jit
def _tile_dots(
    A,
    B,
    rows_a,
    rows_b,
    stride_a,
    stride_b,
    ok_a,
    ok_b,
    D,
    BLOCK_A: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """(BLOCK_A, BLOCK_B) fp32 tile of A[rows_a] . B[rows_b], summed over feature tiles of BLOCK_D.

    A and B point at one (batch, head)'s (T, D) rows, `stride_a` and `stride_b` apart (features adjacent);
    masked rows and features load as 0.
    """
    acc = tl.zeros([BLOCK_A, BLOCK_B], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        a = tl.load(A + rows_a[:, None] * stride_a + offs_d[None, :], mask=ok_a[:, None] & d_ok[None, :], other=0.0)
        b = tl.load(B + rows_b[:, None] * stride_b + offs_d[None, :], mask=ok_b[:, None] & d_ok[None, :], other=0.0)
        acc += tl.dot(a, tl.trans(b), input_precision=DOT_PREC)
    return acc


@triton.jit
def _zero_rows(OUT, rows, stride, ok, D, BLOCK_D: tl.constexpr):
    """OUT[rows, :D] = 0 (OUT: one (batch, head)'s fp32 rows, `stride` apart)."""
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        tl.store(OUT + rows[:, None] * stride + offs_d[None, :], tl.zeros([rows.shape[0], BLOCK_D], tl.float32),
                 mask=ok[:, None] & (offs_d < D)[None, :])


@triton.jit
def _add_products(OUT, rows_out, stride_out, ok_out, A, B, rows_b, stride_b, ok_b, D, BLOCK_D: tl.constexpr,
                  DOT_PREC: tl.constexpr):
    """OUT[rows_out, :D] += A @ B[rows_b, :D] in fp32, one feature tile at a time (read, add, write back).

    The FEATURE_LOOP backward's accumulation: A (a dS or p tile) is computed once and applied to every
    feature tile, where the grid-tiled kernels recompute it per tile.
    """
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        b = tl.load(B + rows_b[:, None] * stride_b + offs_d[None, :], mask=ok_b[:, None] & d_ok[None, :], other=0.0)
        out = OUT + rows_out[:, None] * stride_out + offs_d[None, :]
        out_ok = ok_out[:, None] & d_ok[None, :]
        acc = tl.load(out, mask=out_ok, other=0.0)
        acc += tl.dot(A.to(b.dtype), b, input_precision=DOT_PREC)
        tl.store(out, acc, mask=out_ok)


@triton.jit
def _fwd_wide_kernel(
    Q,
    K,
    V,
    U,
    LSE_IN,
    O,
    LSE,
    ALIBI,
    SELF_B,
    KEY_B,
    stride_qb,  # batch, head and row strides of q, k, v, u and the output (the backward: the output's gradient),
    stride_qh,  # as in `_fwd_kernel`
    stride_qt,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_ub,
    stride_uh,
    stride_ut,
    stride_ob,
    stride_oh,
    stride_ot,
    scale,
    T,
    H,
    D_QK,
    D_V,
    T_TUNE,  # the autotuner's key only (`attention.tune_bucket(T)`); the kernel does not read it
    STRICT: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_SELF: tl.constexpr,
    HAS_KB: tl.constexpr,
    SECOND: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One (query block, batch*head, value tile) program: `_fwd_kernel` for the value tile `program_id(2)`.

    Every value tile runs the same online softmax; the first one writes lse.
    """
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    tile = tl.program_id(2)
    b = bh // H
    h = bh % H
    Qh, Kh = Q + b * stride_qb + h * stride_qh, K + b * stride_kb + h * stride_kh
    Vh, Uh = V + b * stride_vb + h * stride_vh, U + b * stride_ub + h * stride_uh
    Oh = O + b * stride_ob + h * stride_oh
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dv = tile * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = offs_m < T
    dv_ok = offs_dv < D_V
    scale = tl.cast(scale, tl.float32)  # torch.compile (Inductor) passes a Python float as fp64
    qk_scale = scale * 1.4426950408889634  # log2 units, as in _fwd_kernel
    slope = 0.0
    self_b = 0.0
    if HAS_ALIBI:
        slope = tl.load(ALIBI + h).to(tl.float32) * 1.4426950408889634
    if HAS_SELF:
        self_b = tl.load(SELF_B + h).to(tl.float32) * 1.4426950408889634
    if SECOND:
        lse = tl.load(LSE_IN + bh * T + offs_m, mask=row_ok, other=float("inf")) * 1.4426950408889634

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for masked in tl.static_range(2):  # key blocks before this query block, unmasked; then the diagonal's
        lo, hi = _key_blocks(start_m, T, masked, BLOCK_M, BLOCK_N)
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            col_ok = offs_n < T
            v = tl.load(Vh + offs_n[:, None] * stride_vt + offs_dv[None, :], mask=col_ok[:, None] & dv_ok[None, :],
                        other=0.0)
            kb = 0.0
            if HAS_KB:
                kb = tl.load(KEY_B + bh * T + offs_n, mask=col_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            qk = _tile_dots(Qh, Kh, offs_m, offs_n, stride_qt, stride_kt,
                            row_ok, col_ok, D_QK, BLOCK_M, BLOCK_N, BLOCK_D, DOT_PREC)
            s = _scores(qk, offs_m, offs_n, T, qk_scale, slope, self_b, kb,
                        STRICT, HAS_ALIBI, HAS_SELF, HAS_KB, masked)
            if SECOND:
                p = tl.exp2(s - lse[:, None])
                l_i += tl.sum(p, 1)  # see _fwd_kernel
                w = _tile_dots(Uh, Vh, offs_m, offs_n, stride_ut, stride_vt,
                               row_ok, col_ok, D_V, BLOCK_M, BLOCK_N, BLOCK_D, DOT_PREC)
                acc += tl.dot((p * w).to(v.dtype), v, input_precision=DOT_PREC)
            else:
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # see _fwd_kernel
                alpha = tl.exp2(m_i - m_safe)
                p = tl.exp2(s - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
                m_i = m_new

    if SECOND:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # and l_i to LSE: see _fwd_kernel
        if tile == 0:
            tl.store(LSE + bh * T + offs_m, l_i, mask=row_ok)
    else:
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        out = acc / l_safe[:, None]
        if tile == 0:
            lse_out = (m_i + tl.log2(l_safe)) * 0.6931471805599453
            tl.store(LSE + bh * T + offs_m, tl.where(empty, 0.0, lse_out), mask=row_ok)
    tl.store(
        Oh + offs_m[:, None] * stride_ot + offs_dv[None, :],
        out.to(O.dtype.element_ty),
        mask=row_ok[:, None] & dv_ok[None, :],
    )


@triton.jit
def _bwd_dkdv_wide_kernel(
    Q,
    K,
    V,
    U,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    ALIBI,
    SELF_B,
    KEY_B,
    DKB,
    DDIAG,
    DDIST,
    stride_qb,  # batch, head and row strides of q, k, v, u and the output (the backward: the output's gradient),
    stride_qh,  # as in `_fwd_kernel`
    stride_qt,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_ub,
    stride_uh,
    stride_ut,
    stride_dob,
    stride_doh,
    stride_dot,
    stride_dqb,  # of the gradients dq, dk, dv, du (`launch.empty_grad`: dense, head-major for a contiguous
    stride_dqh,  # input, else token-major), apart from the inputs' (a wide product's column views need no copy)
    stride_dqt,
    stride_dkb,
    stride_dkh,
    stride_dkt,
    stride_dvb,
    stride_dvh,
    stride_dvt,
    stride_dub,
    stride_duh,
    stride_dut,
    scale,
    T,
    H,
    D_QK,
    D_V,
    T_TUNE,  # the autotuner's key only (`attention.tune_bucket(T)`); the kernel does not read it
    STRICT: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_SELF: tl.constexpr,
    HAS_KB: tl.constexpr,
    SECOND: tl.constexpr,
    NEED_KB: tl.constexpr,
    NEED_SELF: tl.constexpr,
    NEED_ALIBI: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FEATURE_LOOP: tl.constexpr = False,
):
    """One (key block, batch*head, feature tile) program: `_bwd_dkdv_kernel` for key tile and value tile
    `program_id(2)` (a tile past D_QK or D_V computes nothing there: its loads and stores are masked).

    FEATURE_LOOP: one program per key block instead (the grid's third axis is 1), which computes each score
    tile once and adds its products to every feature tile of DK and DV, fp32 buffers read and written back
    (`_add_products`); the grid-tiled programs recompute the scores once per feature tile instead. Which
    costs less (FLOPs against memory traffic) is the autotuner's to find.
    The first tile writes the bias column sums.
    """
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1).to(tl.int64)
    tile = tl.program_id(2)
    b = bh // H
    h = bh % H
    Qh, Kh = Q + b * stride_qb + h * stride_qh, K + b * stride_kb + h * stride_kh
    Vh, Uh = V + b * stride_vb + h * stride_vh, U + b * stride_ub + h * stride_uh
    DOh = DO + b * stride_dob + h * stride_doh
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tile * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = offs_n < T
    dk_ok = offs_d < D_QK
    dv_ok = offs_d < D_V
    scale = tl.cast(scale, tl.float32)  # torch.compile (Inductor) passes a Python float as fp64
    qk_scale = scale * 1.4426950408889634  # log2 units, as in _fwd_kernel
    slope = 0.0
    self_b = 0.0
    kb = 0.0
    if HAS_ALIBI:
        slope = tl.load(ALIBI + h).to(tl.float32) * 1.4426950408889634
    if HAS_SELF:
        self_b = tl.load(SELF_B + h).to(tl.float32) * 1.4426950408889634
    if HAS_KB:
        kb = tl.load(KEY_B + bh * T + offs_n, mask=col_ok, other=0.0).to(tl.float32) * 1.4426950408889634

    DKh, DVh = DK + b * stride_dkb + h * stride_dkh, DV + b * stride_dvb + h * stride_dvh
    if FEATURE_LOOP:
        _zero_rows(DKh, offs_n, stride_dkt, col_ok, D_QK, BLOCK_D)
        _zero_rows(DVh, offs_n, stride_dvt, col_ok, D_V, BLOCK_D)
        tl.debug_barrier()  # every thread's zeros are written before any thread adds to them
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    if SECOND:
        dv_u = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)  # as in _bwd_dkdv_kernel
    dkb = tl.zeros([BLOCK_N], tl.float32)
    ddiag = tl.zeros([BLOCK_N], tl.float32)
    ddist = tl.zeros([BLOCK_N], tl.float32)
    for masked in tl.static_range(2):  # query blocks after this key block, unmasked; then the diagonal's
        lo, hi = _query_blocks(start_n, T, masked, BLOCK_M, BLOCK_N)
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_ok = offs_m < T
            lse = tl.load(LSE + bh * T + offs_m, mask=row_ok, other=float("inf")) * 1.4426950408889634
            delta = tl.load(DELTA + bh * T + offs_m, mask=row_ok, other=0.0)
            # keys x queries, as in _bwd_dkdv_kernel: p and dS enter dV and dK untransposed
            qk = _tile_dots(Kh, Qh, offs_n, offs_m, stride_kt, stride_qt,
                            col_ok, row_ok, D_QK, BLOCK_N, BLOCK_M, BLOCK_D, DOT_PREC)
            s = _scores(qk, offs_m, offs_n, T, qk_scale, slope, self_b, kb,
                        STRICT, HAS_ALIBI, HAS_SELF, HAS_KB, masked, KEYS_FIRST=True)
            p = tl.exp2(s - lse[None, :])
            g = _tile_dots(Vh, DOh, offs_n, offs_m, stride_vt, stride_dot,
                           col_ok, row_ok, D_V, BLOCK_N, BLOCK_M, BLOCK_D, DOT_PREC)
            if SECOND:
                w = _tile_dots(Vh, Uh, offs_n, offs_m, stride_vt, stride_ut,
                               col_ok, row_ok, D_V, BLOCK_N, BLOCK_M, BLOCK_D, DOT_PREC)
                dp = w * g
                pv = p * w  # dV_j's weights on dr_i, and p * g those on u_i (see _bwd_dkdv_kernel)
            else:
                dp = g
                pv = p
            ds = p * (dp - delta[None, :])
            if FEATURE_LOOP:
                _add_products(DKh, offs_n, stride_dkt, col_ok, ds * scale, Qh, offs_m, stride_qt,
                              row_ok, D_QK, BLOCK_D, DOT_PREC)
                _add_products(DVh, offs_n, stride_dvt, col_ok, pv, DOh, offs_m, stride_dot,
                              row_ok, D_V, BLOCK_D, DOT_PREC)
                if SECOND:
                    tl.debug_barrier()  # DV's first sums are written before it is read again
                    _add_products(DVh, offs_n, stride_dvt, col_ok, p * g, Uh, offs_m, stride_ut,
                                  row_ok, D_V, BLOCK_D, DOT_PREC)
                tl.debug_barrier()  # this block's sums are written before the next block reads them
            else:
                q = tl.load(Qh + offs_m[:, None] * stride_qt + offs_d[None, :],
                            mask=row_ok[:, None] & dk_ok[None, :], other=0.0)
                do = tl.load(DOh + offs_m[:, None] * stride_dot + offs_d[None, :],
                             mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
                dv += tl.dot(pv.to(do.dtype), do, input_precision=DOT_PREC)
                if SECOND:
                    u = tl.load(Uh + offs_m[:, None] * stride_ut + offs_d[None, :],
                                mask=row_ok[:, None] & dv_ok[None, :], other=0.0)
                    dv_u += tl.dot((p * g).to(u.dtype), u, input_precision=DOT_PREC)
                dk += tl.dot(ds.to(q.dtype), q, input_precision=DOT_PREC)
            if NEED_KB:
                dkb += tl.sum(ds, 1)
            if NEED_SELF:
                if masked:
                    ddiag += tl.sum(tl.where(offs_n[:, None] == offs_m[None, :], ds, 0.0), 1)
            if NEED_ALIBI:
                ddist += tl.sum(ds * tl.abs(offs_n[:, None] - offs_m[None, :]).to(tl.float32), 1)

    if not FEATURE_LOOP:
        if SECOND:
            dv += dv_u
        tl.store(DKh + offs_n[:, None] * stride_dkt + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty),
                 mask=col_ok[:, None] & dk_ok[None, :])
        tl.store(DVh + offs_n[:, None] * stride_dvt + offs_d[None, :], dv.to(DV.dtype.element_ty),
                 mask=col_ok[:, None] & dv_ok[None, :])
    if tile == 0:
        if NEED_KB:
            tl.store(DKB + bh * T + offs_n, dkb, mask=col_ok)
        if NEED_SELF:
            tl.store(DDIAG + bh * T + offs_n, ddiag, mask=col_ok)
        if NEED_ALIBI:
            tl.store(DDIST + bh * T + offs_n, ddist, mask=col_ok)


@triton.jit
def _bwd_dq_wide_kernel(
    Q,
    K,
    V,
    U,
    DO,
    LSE,
    DELTA,
    DQ,
    DU,
    ALIBI,
    SELF_B,
    KEY_B,
    stride_qb,  # batch, head and row strides of q, k, v, u and the output (the backward: the output's gradient),
    stride_qh,  # as in `_fwd_kernel`
    stride_qt,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_ub,
    stride_uh,
    stride_ut,
    stride_dob,
    stride_doh,
    stride_dot,
    stride_dqb,  # of the gradients dq, dk, dv, du (`launch.empty_grad`: dense, head-major for a contiguous
    stride_dqh,  # input, else token-major), apart from the inputs' (a wide product's column views need no copy)
    stride_dqt,
    stride_dkb,
    stride_dkh,
    stride_dkt,
    stride_dvb,
    stride_dvh,
    stride_dvt,
    stride_dub,
    stride_duh,
    stride_dut,
    scale,
    T,
    H,
    D_QK,
    D_V,
    T_TUNE,  # the autotuner's key only (`attention.tune_bucket(T)`); the kernel does not read it
    STRICT: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_SELF: tl.constexpr,
    HAS_KB: tl.constexpr,
    SECOND: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FEATURE_LOOP: tl.constexpr = False,
    DELTA_PASS: tl.constexpr = False,
):
    """One (query block, batch*head, feature tile) program: `_bwd_dq_kernel` for query tile (and, SECOND,
    dU's value tile) `program_id(2)`; with FEATURE_LOOP one program per query block, adding to every tile
    of the fp32 DQ (and DU), as in `_bwd_dkdv_wide_kernel`. DELTA_PASS (one feature tile, SECOND): the second
    moment's delta, written to DELTA, as in `_bwd_dq_kernel`."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    tile = tl.program_id(2)
    b = bh // H
    h = bh % H
    Qh, Kh = Q + b * stride_qb + h * stride_qh, K + b * stride_kb + h * stride_kh
    Vh, Uh = V + b * stride_vb + h * stride_vh, U + b * stride_ub + h * stride_uh
    DOh = DO + b * stride_dob + h * stride_doh
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tile * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = offs_m < T
    dk_ok = offs_d < D_QK
    dv_ok = offs_d < D_V
    lse = tl.load(LSE + bh * T + offs_m, mask=row_ok, other=float("inf")) * 1.4426950408889634
    if DELTA_PASS:
        delta = tl.zeros([BLOCK_M], tl.float32)  # sum_j p_ij dP_ij
        weights = tl.zeros([BLOCK_M], tl.float32)  # sum_j p_ij
    else:
        delta = tl.load(DELTA + bh * T + offs_m, mask=row_ok, other=0.0)
    scale = tl.cast(scale, tl.float32)  # torch.compile (Inductor) passes a Python float as fp64
    qk_scale = scale * 1.4426950408889634  # log2 units, as in _fwd_kernel
    slope = 0.0
    self_b = 0.0
    if HAS_ALIBI:
        slope = tl.load(ALIBI + h).to(tl.float32) * 1.4426950408889634
    if HAS_SELF:
        self_b = tl.load(SELF_B + h).to(tl.float32) * 1.4426950408889634
    DQh, DUh = DQ + b * stride_dqb + h * stride_dqh, DU + b * stride_dub + h * stride_duh
    if FEATURE_LOOP and not DELTA_PASS:
        _zero_rows(DQh, offs_m, stride_dqt, row_ok, D_QK, BLOCK_D)
        if SECOND:
            _zero_rows(DUh, offs_m, stride_dut, row_ok, D_V, BLOCK_D)
        tl.debug_barrier()
    if SECOND:
        du = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for masked in tl.static_range(2):  # key blocks before this query block, unmasked; then the diagonal's
        lo, hi = _key_blocks(start_m, T, masked, BLOCK_M, BLOCK_N)
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            col_ok = offs_n < T
            kb = 0.0
            if HAS_KB:
                kb = tl.load(KEY_B + bh * T + offs_n, mask=col_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            if SECOND:  # keys x queries, as _bwd_dkdv_wide_kernel takes them (see _bwd_dq_kernel)
                qk = tl.trans(_tile_dots(Kh, Qh, offs_n, offs_m, stride_kt, stride_qt,
                                         col_ok, row_ok, D_QK, BLOCK_N, BLOCK_M, BLOCK_D, DOT_PREC))
                g = tl.trans(_tile_dots(Vh, DOh, offs_n, offs_m, stride_vt, stride_dot,
                                        col_ok, row_ok, D_V, BLOCK_N, BLOCK_M, BLOCK_D, DOT_PREC))
            else:
                qk = _tile_dots(Qh, Kh, offs_m, offs_n, stride_qt, stride_kt,
                                row_ok, col_ok, D_QK, BLOCK_M, BLOCK_N, BLOCK_D, DOT_PREC)
                g = _tile_dots(DOh, Vh, offs_m, offs_n, stride_dot, stride_vt,
                               row_ok, col_ok, D_V, BLOCK_M, BLOCK_N, BLOCK_D, DOT_PREC)
            s = _scores(qk, offs_m, offs_n, T, qk_scale, slope, self_b, kb,
                        STRICT, HAS_ALIBI, HAS_SELF, HAS_KB, masked)
            p = tl.exp2(s - lse[:, None])
            if SECOND:
                w = tl.trans(_tile_dots(Vh, Uh, offs_n, offs_m, stride_vt, stride_ut,
                                        col_ok, row_ok, D_V, BLOCK_N, BLOCK_M, BLOCK_D, DOT_PREC))
                dp = w * g
            else:
                dp = g
            if DELTA_PASS:
                delta += tl.sum(p * dp, 1)
                weights += tl.sum(p, 1)
            elif FEATURE_LOOP:
                ds = p * (dp - delta[:, None])
                _add_products(DQh, offs_m, stride_dqt, row_ok, ds * scale, Kh, offs_n, stride_kt,
                              col_ok, D_QK, BLOCK_D, DOT_PREC)
                if SECOND:
                    _add_products(DUh, offs_m, stride_dut, row_ok, p * g, Vh, offs_n, stride_vt,
                                  col_ok, D_V, BLOCK_D, DOT_PREC)
                tl.debug_barrier()  # as in _bwd_dkdv_wide_kernel
            else:
                ds = p * (dp - delta[:, None])
                k = tl.load(Kh + offs_n[:, None] * stride_kt + offs_d[None, :],
                            mask=col_ok[:, None] & dk_ok[None, :], other=0.0)
                dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)
                if SECOND:
                    v = tl.load(Vh + offs_n[:, None] * stride_vt + offs_d[None, :],
                                mask=col_ok[:, None] & dv_ok[None, :], other=0.0)
                    du += tl.dot((p * g).to(v.dtype), v, input_precision=DOT_PREC)

    if DELTA_PASS:
        tl.store(DELTA + bh * T + offs_m, delta / tl.where(weights == 0.0, 1.0, weights), mask=row_ok)
    elif not FEATURE_LOOP:
        tl.store(DQh + offs_m[:, None] * stride_dqt + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
                 mask=row_ok[:, None] & dk_ok[None, :])
        if SECOND:
            tl.store(DUh + offs_m[:, None] * stride_dut + offs_d[None, :], du.to(DU.dtype.element_ty),
                     mask=row_ok[:, None] & dv_ok[None, :])
