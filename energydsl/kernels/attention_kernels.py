"""The Triton kernels of the softmax family (FlashAttention-2 style): templates, launched by `attention.py`.

One generic forward kernel and one generic pair of backward kernels, specialised by `tl.constexpr` flags,
cover every attention-like update the compiler derives from an energy:

    s_ij = scale * q_i . k_j  -  slope_h |i - j|  +  [i == j] self_bias_h  +  key_bias[b, h, j]
    p_ij = softmax_j(s_ij) over j <= i (causal) or j < i (strict; row 0 is empty and yields 0)

    energy_attention        o_i = sum_j p_ij v_j                        (first-order update)
    weighted_second_moment  r_i = sum_j p_ij (v_j . u_i) v_j            (second-order / covariance variants)

Nothing T x T is ever stored: the forward keeps a running max and sum (online softmax) and saves only o and
the per-row log-sum-exp; the backward recomputes p_ij = exp(s_ij - lse_i) block by block. Both backward
passes share one formula, dS_ij = p_ij (dP_ij - delta_i), with

    attention:      dP_ij = dO_i . v_j                 delta_i = dO_i . o_i - dlse_i
    second moment:  dP_ij = (u_i . v_j)(dr_i . v_j)    delta_i = dr_i . r_i  (summed over j: see below)

(delta_i = sum_j p_ij dP_ij in both cases, which is why the first-order backward only needs the outputs.)
`_bwd_delta_kernel` computes the first-order delta in one pass before the backward proper; it has no flags to
bake, so every op set launches this one and generated files do not copy it. The second moment's delta is
summed as sum_j p_ij dP_ij instead, by the dQ kernel's DELTA_PASS over the keys: dr_i . r_i carries the
rounding of r's features, which cancel where u is large, and dS_ij, a small difference, inherits it.
The backward runs split (a dK/dV kernel over key blocks and a dQ kernel over query blocks, each recomputing p
and dP) or fused (the dK/dV kernel with DQ_ATOMIC adds dQ too, by atomics); `attention.py` times both.

Two FlashAttention-2 economies on the elementwise work around the dots, which is what bounds these kernels
besides the dots themselves: every loop over blocks runs twice, first over the blocks wholly on one side of
the diagonal, where every (query, key) pair is admissible and none is on the diagonal, so `_scores` skips the
mask (MASKED=False), then over the blocks the diagonal crosses; and scores are kept in log2 units (each score
term times log2 e), so that softmax weights are one exp2 each. lse is stored in natural units.
`benchmarks/kernel_resources.py` counts the instructions per block of each loop on sm_90.

Every (B, H, T, D) tensor is read and written through its batch, head and row strides (`stride_*`), the
features adjacent: heads split off a (B, T, H * D) projection (or off one wide q | k | v product) arrive as
views and are read in place, and the output of such queries is written token-major (`launch.kernel_layout`,
`empty_in_order`). Gradients are dense, with strides of their own (`launch.empty_grad`).

These are templates: `attention.GENERIC` launches them with every flag chosen at launch, and the triton
code generator (energydsl/codegen/triton_source.py) reads this file's text and writes copies into each
generated module with the flags its energy fixes baked in and dead branches removed.
"""

import triton
import triton.language as tl

# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _scores(
    qk,
    offs_m,
    offs_n,
    T,
    scale,
    slope,
    self_b,
    kb,
    STRICT: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_SELF: tl.constexpr,
    HAS_KB: tl.constexpr,
    MASKED: tl.constexpr,
    KEYS_FIRST: tl.constexpr = False,
):
    """Score tile s_ij (BLOCK_M, BLOCK_N) in fp32 from the dot products qk = q_i . k_j, in the unit of the
    terms passed (the kernels pass scale, slope, self_b and kb times log2(e), so that p = exp2(s - m)).

    KEYS_FIRST: the tile is transposed, (BLOCK_N, BLOCK_M) from qk = k_j . q_i, as the dK/dV kernels hold it.
    MASKED: -inf where key j is not admissible for query i. A key block wholly before the query block (every
    j < every i) needs no mask and holds no diagonal: the kernels visit those blocks with MASKED=False, which
    skips the comparisons and selects that dominate the tile's non-matmul work.
    """
    s = qk * scale
    if KEYS_FIRST:
        i = offs_m[None, :]
        j = offs_n[:, None]
    else:
        i = offs_m[:, None]
        j = offs_n[None, :]
    if HAS_ALIBI:  # linear distance penalty, one slope per head
        s -= slope * tl.abs(i - j).to(tl.float32)
    if HAS_KB:  # per-key additive bias, e.g. -||k_j||^2 / (2T) turning dot products into l2 distances
        if KEYS_FIRST:
            s += kb[:, None]
        else:
            s += kb[None, :]
    if MASKED:
        if HAS_SELF:  # self-affinity on the diagonal only
            s += tl.where(i == j, self_b, 0.0)
        if STRICT:
            valid = j < i
        else:
            valid = j <= i
        valid = valid & (i < T) & (j < T)
        s = tl.where(valid, s, float("-inf"))
    return s


@triton.jit
def _key_blocks(start_m, T, MASKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[lo, hi) of the key blocks the query block at start_m visits. Causality: no key after its last query.
    MASKED=False: the blocks wholly before it (every pair admissible, none on the diagonal: no mask);
    MASKED=True: the rest, which the diagonal crosses."""
    diagonal = (start_m // BLOCK_N) * BLOCK_N
    if MASKED:
        lo = diagonal
        hi = tl.minimum(T, start_m + BLOCK_M)
    else:
        lo = 0
        hi = diagonal
    return lo, hi


@triton.jit
def _query_blocks(start_n, T, MASKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[lo, hi) of the query blocks that see the key block at start_n (none before the block holding it).
    MASKED=False: the blocks wholly after it (no mask); MASKED=True: those the diagonal crosses."""
    first = (start_n // BLOCK_M) * BLOCK_M
    past = tl.minimum((start_n + BLOCK_N + BLOCK_M - 1) // BLOCK_M * BLOCK_M, T)
    if MASKED:
        lo = first
        hi = past
    else:
        lo = past
        hi = T
    return lo, hi


@triton.jit
def _fwd_kernel(
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
    stride_qb,  # batch, head and row strides of q; the feature stride is 1
    stride_qh,
    stride_qt,
    stride_kb,  # of k
    stride_kh,
    stride_kt,
    stride_vb,  # of v
    stride_vh,
    stride_vt,
    stride_ub,  # of u; unused unless SECOND
    stride_uh,
    stride_ut,
    stride_ob,  # of the output (o or r)
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
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One (query block, batch*head) program.

    SECOND=False: online softmax over key blocks; writes o = acc / l and lse = m + log(l).
    SECOND=True: p is known from LSE_IN, so no running max: r = sum_j (p_ij (u_i . v_j)) v_j / l_i with
    l_i = sum_j p_ij, written to LSE. The division makes r exact where lse's rounding scales a row's weights
    (~|lse| 2^-24, large where the scores are); the backward divides its recomputed p by l_i too (through
    dr), or its delta = dr . r would not match the weights it sums and dq and dk would lose digits.
    """
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    Qh = Q + b * stride_qb + h * stride_qh  # this (batch, head)'s rows, in any layout
    Kh = K + b * stride_kb + h * stride_kh
    Vh = V + b * stride_vb + h * stride_vh
    Uh = U + b * stride_ub + h * stride_uh
    Oh = O + b * stride_ob + h * stride_oh
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < T
    # padded head dims load as 0, which leaves every dot product unchanged
    q = tl.load(
        Qh + offs_m[:, None] * stride_qt + offs_dk[None, :],
        mask=row_ok[:, None] & (offs_dk[None, :] < D_QK),
        other=0.0,
    )
    # scores in log2 units: every score term times log2(e), so that exp(x) is exp2 of it (no extra multiply)
    scale = tl.cast(scale, tl.float32)  # torch.compile (Inductor) passes a Python float as fp64
    qk_scale = scale * 1.4426950408889634
    slope = 0.0
    self_b = 0.0
    if HAS_ALIBI:
        slope = tl.load(ALIBI + h).to(tl.float32) * 1.4426950408889634
    if HAS_SELF:
        self_b = tl.load(SELF_B + h).to(tl.float32) * 1.4426950408889634
    if SECOND:
        u = tl.load(
            Uh + offs_m[:, None] * stride_ut + offs_dv[None, :],
            mask=row_ok[:, None] & (offs_dv[None, :] < D_V),
            other=0.0,
        )
        # padded rows get lse = inf, hence p = 0, also where their scores are not masked
        lse = tl.load(LSE_IN + bh * T + offs_m, mask=row_ok, other=float("inf")) * 1.4426950408889634

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for masked in tl.static_range(2):  # key blocks before this query block, unmasked; then the diagonal's
        lo, hi = _key_blocks(start_m, T, masked, BLOCK_M, BLOCK_N)
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            col_ok = offs_n < T
            k = tl.load(
                Kh + offs_n[:, None] * stride_kt + offs_dk[None, :],
                mask=col_ok[:, None] & (offs_dk[None, :] < D_QK),
                other=0.0,
            )
            v = tl.load(
                Vh + offs_n[:, None] * stride_vt + offs_dv[None, :],
                mask=col_ok[:, None] & (offs_dv[None, :] < D_V),
                other=0.0,
            )
            kb = 0.0
            if HAS_KB:
                kb = tl.load(KEY_B + bh * T + offs_n, mask=col_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
            s = _scores(qk, offs_m, offs_n, T, qk_scale, slope, self_b, kb,
                        STRICT, HAS_ALIBI, HAS_SELF, HAS_KB, masked)
            if SECOND:
                # softmax weights up to a factor per row, the rounding of lse (about |lse| 2^-24: large
                # where the scores are); their sum l_i divides it out at the end. Masked entries: exp2(-inf) = 0
                p = tl.exp2(s - lse[:, None])
                l_i += tl.sum(p, 1)
                w = tl.dot(u, tl.trans(v), input_precision=DOT_PREC)  # w_ij = u_i . v_j
                acc += tl.dot((p * w).to(v.dtype), v, input_precision=DOT_PREC)
            else:
                m_new = tl.maximum(m_i, tl.max(s, 1))
                # a row that has seen no admissible key yet has m = -inf; shift by 0 there so that
                # exp2(-inf - (-inf)) never produces NaN (its p and alpha are then exactly 0)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_safe)  # rescales what was accumulated under the old max
                p = tl.exp2(s - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
                m_i = m_new

    if SECOND:
        # the row sums go out too (LSE is their buffer here): the backward divides the weights it recomputes
        # by them; 0 for a row with no admissible key, whose r stays 0
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(LSE + bh * T + offs_m, l_i, mask=row_ok)
    else:
        # rows with no admissible key (strict row 0): o = 0, lse = 0 (finite by convention); lse is stored in
        # natural units, (m + log2 l) ln 2
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        out = acc / l_safe[:, None]
        lse_out = (m_i + tl.log2(l_safe)) * 0.6931471805599453
        tl.store(LSE + bh * T + offs_m, tl.where(empty, 0.0, lse_out), mask=row_ok)
    tl.store(
        Oh + offs_m[:, None] * stride_ot + offs_dv[None, :],
        out.to(O.dtype.element_ty),
        mask=row_ok[:, None] & (offs_dv[None, :] < D_V),
    )


@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    U,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    DQ_ACC,
    DU_ACC,
    ALIBI,
    SELF_B,
    KEY_B,
    DKB,
    DDIAG,
    DDIST,
    stride_qb,  # batch, head and row strides of q; the feature stride is 1
    stride_qh,
    stride_qt,
    stride_kb,  # of k
    stride_kh,
    stride_kt,
    stride_vb,  # of v
    stride_vh,
    stride_vt,
    stride_ub,  # of u; unused unless SECOND
    stride_uh,
    stride_ut,
    stride_dob,  # of the output's gradient dO (or dr)
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
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DQ_ATOMIC: tl.constexpr = False,
):
    """One (key block, batch*head) program: loops over the query blocks that can see these keys.

    dK_j = scale sum_i dS_ij q_i and dV_j (see module docstring) are owned by this program, and so are the
    column reductions of dS that give the bias gradients, so these outputs are written once (no atomics).
    DQ_ATOMIC (the fused backward): the program also adds each block's part of dQ_i = scale sum_j dS_ij k_j
    (and of the second moment's dU_i) into the fp32 sums DQ_ACC (DU_ACC) with atomics, as FlashAttention-2
    does, so that no dQ kernel recomputes p and dP; the sums start at zero and many programs add to each row.
    """
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    Qh = Q + b * stride_qb + h * stride_qh  # this (batch, head)'s rows, in any layout
    Kh = K + b * stride_kb + h * stride_kh
    Vh = V + b * stride_vb + h * stride_vh
    Uh = U + b * stride_ub + h * stride_uh
    DOh = DO + b * stride_dob + h * stride_doh
    DKh = DK + b * stride_dkb + h * stride_dkh
    DVh = DV + b * stride_dvb + h * stride_dvh
    DQh = DQ_ACC + b * stride_dqb + h * stride_dqh
    DUh = DU_ACC + b * stride_dub + h * stride_duh
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = offs_n < T
    k = tl.load(
        Kh + offs_n[:, None] * stride_kt + offs_dk[None, :],
        mask=col_ok[:, None] & (offs_dk[None, :] < D_QK),
        other=0.0,
    )
    v = tl.load(
        Vh + offs_n[:, None] * stride_vt + offs_dv[None, :],
        mask=col_ok[:, None] & (offs_dv[None, :] < D_V),
        other=0.0,
    )
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

    dk = tl.zeros([BLOCK_N, BLOCK_DK], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    if SECOND:
        # the (dr_i . v_j) u_i part of dV_j: both products summed into dv made Triton move dv between two
        # matmul layouts through shared memory on every block (sm_90)
        dv_u = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    dkb = tl.zeros([BLOCK_N], tl.float32)  # sum_i dS_ij
    ddiag = tl.zeros([BLOCK_N], tl.float32)  # dS_jj
    ddist = tl.zeros([BLOCK_N], tl.float32)  # sum_i dS_ij |i - j|
    for masked in tl.static_range(2):  # query blocks after this key block, unmasked; then the diagonal's
        lo, hi = _query_blocks(start_n, T, masked, BLOCK_M, BLOCK_N)
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_ok = offs_m < T
            q = tl.load(
                Qh + offs_m[:, None] * stride_qt + offs_dk[None, :],
                mask=row_ok[:, None] & (offs_dk[None, :] < D_QK),
                other=0.0,
            )
            do = tl.load(
                DOh + offs_m[:, None] * stride_dot + offs_dv[None, :],
                mask=row_ok[:, None] & (offs_dv[None, :] < D_V),
                other=0.0,
            )
            # padded rows: lse = inf gives p = 0 where the scores are not masked
            lse = tl.load(LSE + bh * T + offs_m, mask=row_ok, other=float("inf")) * 1.4426950408889634
            delta = tl.load(DELTA + bh * T + offs_m, mask=row_ok, other=0.0)
            # the tiles are held keys x queries (transposed), so that p and dS enter dV and dK as they are:
            # a transposed register tile would be stored to and reloaded from shared memory on every block
            qk = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)
            s = _scores(qk, offs_m, offs_n, T, qk_scale, slope, self_b, kb,
                        STRICT, HAS_ALIBI, HAS_SELF, HAS_KB, masked, KEYS_FIRST=True)
            p = tl.exp2(s - lse[None, :])  # recomputed softmax p_ij at [j, i], 0 outside the mask
            if SECOND:
                u = tl.load(
                    Uh + offs_m[:, None] * stride_ut + offs_dv[None, :],
                    mask=row_ok[:, None] & (offs_dv[None, :] < D_V),
                    other=0.0,
                )
                w = tl.dot(v, tl.trans(u), input_precision=DOT_PREC)  # u_i . v_j
                g = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)  # dr_i . v_j
                dp = w * g
                # v_j enters r_i twice, (u_i . v_j) v_j: dV_j = sum_i p_ij [(u_i . v_j) dr_i + (dr_i . v_j) u_i]
                dv += tl.dot((p * w).to(do.dtype), do, input_precision=DOT_PREC)
                dv_u += tl.dot((p * g).to(u.dtype), u, input_precision=DOT_PREC)
            else:
                dp = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)  # dO_i . v_j
                dv += tl.dot(p.to(do.dtype), do, input_precision=DOT_PREC)
            ds = p * (dp - delta[None, :])  # softmax Jacobian applied to dP
            dk += tl.dot(ds.to(q.dtype), q, input_precision=DOT_PREC)
            if DQ_ATOMIC:  # unused results and relaxed order: vector reductions (RED) on sm_90, no fences
                dq = tl.dot(tl.trans(ds.to(k.dtype)), k, input_precision=DOT_PREC) * scale
                tl.atomic_add(
                    DQh + offs_m[:, None] * stride_dqt + offs_dk[None, :],
                    dq,
                    mask=row_ok[:, None] & (offs_dk[None, :] < D_QK),
                    sem="relaxed",
                )
                if SECOND:  # dU_i = sum_j p_ij (dr_i . v_j) v_j
                    du = tl.dot(tl.trans((p * g).to(v.dtype)), v, input_precision=DOT_PREC)
                    tl.atomic_add(
                        DUh + offs_m[:, None] * stride_dut + offs_dv[None, :],
                        du,
                        mask=row_ok[:, None] & (offs_dv[None, :] < D_V),
                        sem="relaxed",
                    )
            if NEED_KB:
                dkb += tl.sum(ds, 1)
            if NEED_SELF:
                if masked:  # the diagonal lies in the masked blocks only
                    ddiag += tl.sum(tl.where(offs_n[:, None] == offs_m[None, :], ds, 0.0), 1)
            if NEED_ALIBI:
                ddist += tl.sum(ds * tl.abs(offs_n[:, None] - offs_m[None, :]).to(tl.float32), 1)

    dk = dk * scale
    if SECOND:
        dv += dv_u
    tl.store(
        DKh + offs_n[:, None] * stride_dkt + offs_dk[None, :],
        dk.to(DK.dtype.element_ty),
        mask=col_ok[:, None] & (offs_dk[None, :] < D_QK),
    )
    tl.store(
        DVh + offs_n[:, None] * stride_dvt + offs_dv[None, :],
        dv.to(DV.dtype.element_ty),
        mask=col_ok[:, None] & (offs_dv[None, :] < D_V),
    )
    if NEED_KB:
        tl.store(DKB + bh * T + offs_n, dkb, mask=col_ok)
    if NEED_SELF:
        tl.store(DDIAG + bh * T + offs_n, ddiag, mask=col_ok)
    if NEED_ALIBI:
        tl.store(DDIST + bh * T + offs_n, ddist, mask=col_ok)


@triton.jit
def _bwd_dq_kernel(
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
    stride_qb,  # batch, head and row strides of q; the feature stride is 1
    stride_qh,
    stride_qt,
    stride_kb,  # of k
    stride_kh,
    stride_kt,
    stride_vb,  # of v
    stride_vh,
    stride_vt,
    stride_ub,  # of u; unused unless SECOND
    stride_uh,
    stride_ut,
    stride_dob,  # of the output's gradient dO (or dr)
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
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DELTA_PASS: tl.constexpr = False,
):
    """One (query block, batch*head) program: dQ_i = scale sum_j dS_ij k_j.

    SECOND=True also gives dU_i = sum_j p_ij (dr_i . v_j) v_j. DELTA_PASS=True (with SECOND) computes the
    second moment's delta instead, written to DELTA: sum_j p_ij dP_ij / sum_j p_ij over the weights this very
    backward recomputes, so that dS_ij sums to 0 over j. dr_i . r_i, its value in exact arithmetic, loses the
    digits dS needs where u is large: r's features cancel, and their rounding is far larger than dS.
    With SECOND, the scores and products are taken keys x queries and transposed, as the dK/dV kernel takes
    them: dS sums to 0 only if delta and dS see the same dP bit for bit, and q k^T need not round as
    (k q^T)^T does (numpy's BLAS under the interpreter on AMD: dk came out 1e16 off).
    """
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    Qh = Q + b * stride_qb + h * stride_qh  # this (batch, head)'s rows, in any layout
    Kh = K + b * stride_kb + h * stride_kh
    Vh = V + b * stride_vb + h * stride_vh
    Uh = U + b * stride_ub + h * stride_uh
    DOh = DO + b * stride_dob + h * stride_doh
    DQh = DQ + b * stride_dqb + h * stride_dqh
    DUh = DU + b * stride_dub + h * stride_duh
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, BLOCK_DK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < T
    q = tl.load(
        Qh + offs_m[:, None] * stride_qt + offs_dk[None, :],
        mask=row_ok[:, None] & (offs_dk[None, :] < D_QK),
        other=0.0,
    )
    do = tl.load(
        DOh + offs_m[:, None] * stride_dot + offs_dv[None, :],
        mask=row_ok[:, None] & (offs_dv[None, :] < D_V),
        other=0.0,
    )
    # log2 units, as in _fwd_kernel; padded rows get lse = inf, hence p = 0
    lse = tl.load(LSE + bh * T + offs_m, mask=row_ok, other=float("inf")) * 1.4426950408889634
    if DELTA_PASS:
        delta = tl.zeros([BLOCK_M], tl.float32)  # sum_j p_ij dP_ij
        weights = tl.zeros([BLOCK_M], tl.float32)  # sum_j p_ij
    else:
        delta = tl.load(DELTA + bh * T + offs_m, mask=row_ok, other=0.0)
    scale = tl.cast(scale, tl.float32)  # torch.compile (Inductor) passes a Python float as fp64
    qk_scale = scale * 1.4426950408889634
    slope = 0.0
    self_b = 0.0
    if HAS_ALIBI:
        slope = tl.load(ALIBI + h).to(tl.float32) * 1.4426950408889634
    if HAS_SELF:
        self_b = tl.load(SELF_B + h).to(tl.float32) * 1.4426950408889634
    if SECOND:
        u = tl.load(
            Uh + offs_m[:, None] * stride_ut + offs_dv[None, :],
            mask=row_ok[:, None] & (offs_dv[None, :] < D_V),
            other=0.0,
        )
        du = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    dq = tl.zeros([BLOCK_M, BLOCK_DK], tl.float32)
    for masked in tl.static_range(2):  # key blocks before this query block, unmasked; then the diagonal's
        lo, hi = _key_blocks(start_m, T, masked, BLOCK_M, BLOCK_N)
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            col_ok = offs_n < T
            k = tl.load(
                Kh + offs_n[:, None] * stride_kt + offs_dk[None, :],
                mask=col_ok[:, None] & (offs_dk[None, :] < D_QK),
                other=0.0,
            )
            v = tl.load(
                Vh + offs_n[:, None] * stride_vt + offs_dv[None, :],
                mask=col_ok[:, None] & (offs_dv[None, :] < D_V),
                other=0.0,
            )
            kb = 0.0
            if HAS_KB:
                kb = tl.load(KEY_B + bh * T + offs_n, mask=col_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            if SECOND:  # products taken keys x queries, as the dK/dV kernel takes them (see the docstring)
                qk = tl.trans(tl.dot(k, tl.trans(q), input_precision=DOT_PREC))
            else:
                qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
            s = _scores(qk, offs_m, offs_n, T, qk_scale, slope, self_b, kb,
                        STRICT, HAS_ALIBI, HAS_SELF, HAS_KB, masked)
            p = tl.exp2(s - lse[:, None])
            if SECOND:
                w = tl.trans(tl.dot(v, tl.trans(u), input_precision=DOT_PREC))
                g = tl.trans(tl.dot(v, tl.trans(do), input_precision=DOT_PREC))
                dp = w * g
                if DELTA_PASS:
                    delta += tl.sum(p * dp, 1)
                    weights += tl.sum(p, 1)
                else:
                    du += tl.dot((p * g).to(v.dtype), v, input_precision=DOT_PREC)
            else:
                dp = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
            if not DELTA_PASS:
                ds = p * (dp - delta[:, None])
                dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)

    if DELTA_PASS:
        tl.store(DELTA + bh * T + offs_m, delta / tl.where(weights == 0.0, 1.0, weights), mask=row_ok)
    else:
        dq = dq * scale
        tl.store(
            DQh + offs_m[:, None] * stride_dqt + offs_dk[None, :],
            dq.to(DQ.dtype.element_ty),
            mask=row_ok[:, None] & (offs_dk[None, :] < D_QK),
        )
        if SECOND:
            tl.store(
                DUh + offs_m[:, None] * stride_dut + offs_dv[None, :],
                du.to(DU.dtype.element_ty),
                mask=row_ok[:, None] & (offs_dv[None, :] < D_V),
            )


@triton.jit
def _bwd_delta_kernel(
    O,
    DO,
    DLSE,
    DELTA,
    stride_ob,  # batch, head and row strides of the output
    stride_oh,
    stride_ot,
    stride_dob,  # and of its gradient
    stride_doh,
    stride_dot,
    T,
    H,
    D,
    HAS_DLSE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One (row block, batch*head) program: delta_i = dO_i . O_i - dlse_i in fp32 (the backward's row term).

    FlashAttention-2's preprocessing: one pass over the output and its gradient in their own dtype, where
    torch ops would write fp32 copies of both, their product, and then the sum. Any feature width: the rows
    are summed over feature tiles of BLOCK_D. Shared by every op set (it has no flags to bake), not copied.
    """
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    Oh = O + b * stride_ob + h * stride_oh
    DOh = DO + b * stride_dob + h * stride_doh
    row_ok = offs_m < T
    delta = tl.zeros([BLOCK_M], tl.float32)
    for start_d in range(0, D, BLOCK_D):
        offs_d = start_d + tl.arange(0, BLOCK_D)
        ok = row_ok[:, None] & (offs_d[None, :] < D)
        o = tl.load(Oh + offs_m[:, None] * stride_ot + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
        do = tl.load(DOh + offs_m[:, None] * stride_dot + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
        delta += tl.sum(o * do, axis=1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + bh * T + offs_m, mask=row_ok, other=0.0)
    tl.store(DELTA + bh * T + offs_m, delta, mask=row_ok)
