"""The Triton kernels of the pointwise-weight family: templates, launched by `pointwise.py`.

A context sum whose weight is an element-wise function of the score, with no normalisation over the context
(sigmoid attention, squared-ReLU attention, an RBF kernel written as exp of an expanded square):

    s_ij = scale * q_i . k_j  +  row_bias[b, h, i]  +  key_bias[b, h, j]  -  slope_h |i - j|  +  [i == j] self_h
    o_i  = sum_j w(s_ij) v_j        over j <= i (causal) or j < i (strict; row 0 is empty and yields 0)

The weight w and its derivative w' are `@triton.jit` functions of one fp32 tile: the code generator derives
them from the energy (energydsl/codegen/pointwise_weights.py) and bakes them in as `WEIGHT` and `WEIGHT_GRAD`;
a direct caller passes them at launch. Nothing T x T is stored; with no softmax there is no running maximum and
no row statistic, so the backward needs only the inputs and dO:

    dv_j = sum_i w_ij dO_i        dS_ij = (dO_i . v_j) w'(s_ij)
    dq_i = scale sum_j dS_ij k_j  dk_j = scale sum_i dS_ij q_i
    d row_bias_i = sum_j dS_ij    d key_bias_j = sum_i dS_ij
    d slope_h = -sum_ij dS_ij |i - j|    d self_h = sum_i dS_ii

computed by two kernels that recompute the scores: one over key blocks (dK, dV, d key_bias, and the per-key
column sums of the slope's and self bias's gradients, reduced per head in torch) and one over query blocks (dQ,
d row_bias), so every gradient has one owner and no atomics are needed. NEED_ALIBI / NEED_SELF: whether those
two gradients are wanted (fixed ALiBi slopes are not learned).

Every (B, H, T, D) tensor is read and written through its batch, head and row strides (any layout with adjacent
features, as `launch.kernel_layout` gives them; gradients dense, `launch.empty_grad`); the biases are contiguous
fp32, (B, H, T) per token and (H,) per head.
"""

import triton
import triton.language as tl


@triton.jit
def _pointwise_scores(q, k, rb_ptr, kb_ptr, slope, self_b, offs_m, offs_n, T, scale, KEYS_FIRST: tl.constexpr,
                      MASKED: tl.constexpr, HAS_RB: tl.constexpr, HAS_KB: tl.constexpr, HAS_ALIBI: tl.constexpr,
                      HAS_SELF: tl.constexpr, DOT_PREC: tl.constexpr):
    """(s, i, j): the fp32 score tile and the positions of its rows and columns. KEYS_FIRST: the tile is (keys,
    queries), from q and k tiles loaded as (keys, D) and (queries, D) by the dK/dV kernel. MASKED=False: a block
    wholly off the diagonal (every key before every query), which holds no i = j: no self term."""
    if KEYS_FIRST:
        s = tl.dot(k, tl.trans(q), input_precision=DOT_PREC)
        i = offs_m[None, :]
        j = offs_n[:, None]
    else:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        i = offs_m[:, None]
        j = offs_n[None, :]
    s = _score_terms(s * scale, i, j, rb_ptr, kb_ptr, slope, self_b, T, MASKED, HAS_RB, HAS_KB, HAS_ALIBI, HAS_SELF)
    return s, i, j


@triton.jit
def _score_terms(s, i, j, rb_ptr, kb_ptr, slope, self_b, T, MASKED: tl.constexpr, HAS_RB: tl.constexpr,
                 HAS_KB: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SELF: tl.constexpr):
    """The scaled dot tile s plus the score's other terms, at query positions i and key positions j (broadcast
    against each other as s's rows and columns)."""
    if HAS_RB:
        s += tl.load(rb_ptr + i, mask=i < T, other=0.0)
    if HAS_KB:
        s += tl.load(kb_ptr + j, mask=j < T, other=0.0)
    if HAS_ALIBI:
        s -= slope * tl.abs(i - j).to(tl.float32)
    if HAS_SELF and MASKED:
        s += tl.where(i == j, self_b, 0.0)
    return s


@triton.jit
def _rows(base, offs, stride, offs_d, D, T):
    """The tile of rows `offs` (a row `stride` apart) and features `offs_d` at `base`; 0 past T and past D."""
    return tl.load(base + offs[:, None] * stride + offs_d[None, :], mask=(offs[:, None] < T) & (offs_d[None, :] < D),
                   other=0.0)


@triton.jit
def _head(Q, K, V, OUT, RB, KB, ALIBI, SELF, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
          stride_outb, stride_outh, T, H, HAS_ALIBI: tl.constexpr, HAS_SELF: tl.constexpr):
    """Every kernel's setup for its (batch, head) `program_id(1)`: (b, h, rows, Qh, Kh, Vh, OUTh, rb_ptr, kb_ptr,
    slope, self_b). b and h (int64) place the kernel's other tensors, the gradients with strides of their own; `rows` is
    the (batch, head)'s offset into the (B, H, T) biases and bias gradients; Qh ... OUTh the (batch, head)'s
    q, k, v and OUT (the output, or its gradient); rb_ptr and kb_ptr its row and key biases; slope and self_b
    its ALiBi slope and self bias, fp32, 0 for a term the scores do not have."""
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    rows = bh * T
    slope = 0.0
    self_b = 0.0
    if HAS_ALIBI:
        slope = tl.load(ALIBI + h).to(tl.float32)
    if HAS_SELF:
        self_b = tl.load(SELF + h).to(tl.float32)
    return (b, h, rows, Q + b * stride_qb + h * stride_qh, K + b * stride_kb + h * stride_kh,
            V + b * stride_vb + h * stride_vh, OUT + b * stride_outb + h * stride_outh, RB + rows, KB + rows, slope,
            self_b)


@triton.jit
def _in_context(x, i, j, T, MASKED: tl.constexpr, STRICT: tl.constexpr):
    """x where (i, j) is a pair of the context (j <= i, or j < i, and i < T), 0 elsewhere, whatever x is there
    (w(s) need not vanish outside); x itself in a block with no pair outside (MASKED=False)."""
    if MASKED:
        if STRICT:
            x = tl.where((j < i) & (i < T), x, 0.0)
        else:
            x = tl.where((j <= i) & (i < T), x, 0.0)
    return x


@triton.jit
def _pointwise_blocks(start, T, MODE: tl.constexpr, KEYS_FIRST: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """[lo, hi) of the blocks a program visits in loop MODE (0: unmasked; 1, 2: masked). Over keys, for the query
    block at `start`: the blocks wholly before it (every key before every query), then the diagonal's (no key
    after its last query). Over queries (KEYS_FIRST), for the key block at `start`: the whole query blocks
    wholly after it, then those the diagonal crosses, then a last, partial one past them (its rows past T are
    masked: with dO = 0 there they would add w'(s) * 0, which is NaN where w' overflows)."""
    if KEYS_FIRST:
        first = (start // BLOCK_M) * BLOCK_M
        past = tl.minimum((start + BLOCK_N + BLOCK_M - 1) // BLOCK_M * BLOCK_M, T)
        whole = tl.maximum(past, (T // BLOCK_M) * BLOCK_M)
        if MODE == 0:
            lo = past
            hi = whole
        elif MODE == 1:
            lo = first
            hi = past
        else:
            lo = whole
            hi = T
    else:
        diagonal = (start // BLOCK_N) * BLOCK_N
        if MODE == 0:
            lo = 0
            hi = diagonal
        elif MODE == 1:
            lo = diagonal
            hi = tl.minimum(T, start + BLOCK_M)
        else:
            lo = 0
            hi = 0
    return lo, hi


@triton.jit
def _pointwise_fwd_kernel(
    Q, K, V, RB, KB, ALIBI, SELF, O,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_ob, stride_oh, stride_ot,
    T, H, D_QK, D_V, scale,
    T_TUNE,  # the autotuner's key only (`attention_configs.tune_bucket(T)`); the kernel does not read it
    WEIGHT: tl.constexpr, STRICT: tl.constexpr, HAS_RB: tl.constexpr, HAS_KB: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_SELF: tl.constexpr, DOT_PREC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """o_i = sum_j w(s_ij) v_j for one block of queries of one (batch, head)."""
    start_m = tl.program_id(0) * BLOCK_M
    scale = tl.cast(scale, tl.float32)  # torch.compile (Inductor) passes a Python float as fp64
    b, h, rows, Qh, Kh, Vh, Oh, rb_ptr, kb_ptr, slope, self_b = _head(
        Q, K, V, O, RB, KB, ALIBI, SELF, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
        stride_ob, stride_oh, T, H, HAS_ALIBI, HAS_SELF)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, BK)
    offs_dv = tl.arange(0, BV)
    q = _rows(Qh, offs_m, stride_qt, offs_dk, D_QK, T)
    acc = tl.zeros((BLOCK_M, BV), dtype=tl.float32)
    for mode in tl.static_range(2):  # key blocks before this query block, unmasked; then the diagonal's
        lo, hi = _pointwise_blocks(start_m, T, mode, False, BLOCK_M, BLOCK_N)
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = _rows(Kh, offs_n, stride_kt, offs_dk, D_QK, T)
            v = _rows(Vh, offs_n, stride_vt, offs_dv, D_V, T)
            s, i, j = _pointwise_scores(q, k, rb_ptr, kb_ptr, slope, self_b, offs_m, offs_n, T, scale, False,
                                        mode > 0, HAS_RB, HAS_KB, HAS_ALIBI, HAS_SELF, DOT_PREC)
            w = _in_context(WEIGHT(s), i, j, T, mode > 0, STRICT)
            acc += tl.dot(w.to(v.dtype), v, input_precision=DOT_PREC)
    tl.store(Oh + offs_m[:, None] * stride_ot + offs_dv[None, :], acc.to(O.dtype.element_ty),
             mask=(offs_m[:, None] < T) & (offs_dv[None, :] < D_V))


@triton.jit
def _pointwise_bwd_dkdv_kernel(
    Q, K, V, RB, KB, ALIBI, SELF, DO, DK, DV, DKB, DDIST, DDIAG,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot,
    stride_dqb, stride_dqh, stride_dqt, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt,
    T, H, D_QK, D_V, scale,
    T_TUNE,  # the autotuner's key only (`attention_configs.tune_bucket(T)`); the kernel does not read it
    WEIGHT: tl.constexpr, WEIGHT_GRAD: tl.constexpr, STRICT: tl.constexpr, HAS_RB: tl.constexpr,
    HAS_KB: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SELF: tl.constexpr, NEED_ALIBI: tl.constexpr,
    NEED_SELF: tl.constexpr, DOT_PREC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dK, dV, d key_bias and the slope's and self bias's per-key column sums (DDIST, DDIAG) for one block of
    keys: loops over the query blocks that see it. DK and DV have strides of their own."""
    start_n = tl.program_id(0) * BLOCK_N
    scale = tl.cast(scale, tl.float32)  # torch.compile (Inductor) passes a Python float as fp64
    b, h, rows, Qh, Kh, Vh, DOh, rb_ptr, kb_ptr, slope, self_b = _head(
        Q, K, V, DO, RB, KB, ALIBI, SELF, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
        stride_dob, stride_doh, T, H, HAS_ALIBI, HAS_SELF)
    DKh = DK + b * stride_dkb + h * stride_dkh
    DVh = DV + b * stride_dvb + h * stride_dvh
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, BK)
    offs_dv = tl.arange(0, BV)
    key_ok = offs_n < T
    k = _rows(Kh, offs_n, stride_kt, offs_dk, D_QK, T)
    v = _rows(Vh, offs_n, stride_vt, offs_dv, D_V, T)
    dk = tl.zeros((BLOCK_N, BK), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BV), dtype=tl.float32)
    dkb = tl.zeros((BLOCK_N,), dtype=tl.float32)
    ddist = tl.zeros((BLOCK_N,), dtype=tl.float32)  # sum_i dS_ij |i - j|, per key
    ddiag = tl.zeros((BLOCK_N,), dtype=tl.float32)  # dS_jj
    for mode in tl.static_range(3):  # whole query blocks after this key block, unmasked; the diagonal's; the last
        lo, hi = _pointwise_blocks(start_n, T, mode, True, BLOCK_M, BLOCK_N)
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            q = _rows(Qh, offs_m, stride_qt, offs_dk, D_QK, T)
            do = _rows(DOh, offs_m, stride_dot, offs_dv, D_V, T).to(v.dtype)
            s, i, j = _pointwise_scores(q, k, rb_ptr, kb_ptr, slope, self_b, offs_m, offs_n, T, scale, True,
                                        mode > 0, HAS_RB, HAS_KB, HAS_ALIBI, HAS_SELF, DOT_PREC)  # (keys, queries)
            w = _in_context(WEIGHT(s), i, j, T, mode > 0, STRICT)
            dv += tl.dot(w.to(v.dtype), do, input_precision=DOT_PREC)
            dw = tl.dot(v, tl.trans(do), input_precision=DOT_PREC)  # (dO_i . v_j), keys first
            ds = _in_context(dw * WEIGHT_GRAD(s), i, j, T, mode > 0, STRICT)
            dk += tl.dot(ds.to(q.dtype), q, input_precision=DOT_PREC)
            if HAS_KB:
                dkb += tl.sum(ds, axis=1)
            if NEED_ALIBI:
                ddist += tl.sum(ds * tl.abs(i - j).to(tl.float32), axis=1)
            if NEED_SELF and mode > 0:
                ddiag += tl.sum(tl.where(i == j, ds, 0.0), axis=1)
    tl.store(DKh + offs_n[:, None] * stride_dkt + offs_dk[None, :], (dk * scale).to(DK.dtype.element_ty),
             mask=key_ok[:, None] & (offs_dk[None, :] < D_QK))
    tl.store(DVh + offs_n[:, None] * stride_dvt + offs_dv[None, :], dv.to(DV.dtype.element_ty),
             mask=key_ok[:, None] & (offs_dv[None, :] < D_V))
    if HAS_KB:
        tl.store(DKB + rows + offs_n, dkb, mask=key_ok)
    if NEED_ALIBI:
        tl.store(DDIST + rows + offs_n, ddist, mask=key_ok)
    if NEED_SELF:
        tl.store(DDIAG + rows + offs_n, ddiag, mask=key_ok)


@triton.jit
def _pointwise_bwd_dq_kernel(
    Q, K, V, RB, KB, ALIBI, SELF, DO, DQ, DRB,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot,
    stride_dqb, stride_dqh, stride_dqt, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt,
    T, H, D_QK, D_V, scale,
    T_TUNE,  # the autotuner's key only (`attention_configs.tune_bucket(T)`); the kernel does not read it
    WEIGHT_GRAD: tl.constexpr, STRICT: tl.constexpr, HAS_RB: tl.constexpr, HAS_KB: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_SELF: tl.constexpr, DOT_PREC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dQ and d row_bias for one block of queries: a loop over the key blocks it sees. DQ has strides of its own."""
    start_m = tl.program_id(0) * BLOCK_M
    scale = tl.cast(scale, tl.float32)  # torch.compile (Inductor) passes a Python float as fp64
    b, h, rows, Qh, Kh, Vh, DOh, rb_ptr, kb_ptr, slope, self_b = _head(
        Q, K, V, DO, RB, KB, ALIBI, SELF, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
        stride_dob, stride_doh, T, H, HAS_ALIBI, HAS_SELF)
    DQh = DQ + b * stride_dqb + h * stride_dqh
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dk = tl.arange(0, BK)
    offs_dv = tl.arange(0, BV)
    row_ok = offs_m < T
    q = _rows(Qh, offs_m, stride_qt, offs_dk, D_QK, T)
    do = _rows(DOh, offs_m, stride_dot, offs_dv, D_V, T).to(V.dtype.element_ty)
    dq = tl.zeros((BLOCK_M, BK), dtype=tl.float32)
    drb = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for mode in tl.static_range(2):  # key blocks before this query block, unmasked; then the diagonal's
        lo, hi = _pointwise_blocks(start_m, T, mode, False, BLOCK_M, BLOCK_N)
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = _rows(Kh, offs_n, stride_kt, offs_dk, D_QK, T)
            v = _rows(Vh, offs_n, stride_vt, offs_dv, D_V, T)
            s, i, j = _pointwise_scores(q, k, rb_ptr, kb_ptr, slope, self_b, offs_m, offs_n, T, scale, False,
                                        mode > 0, HAS_RB, HAS_KB, HAS_ALIBI, HAS_SELF, DOT_PREC)
            dw = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
            ds = _in_context(dw * WEIGHT_GRAD(s), i, j, T, mode > 0, STRICT)
            dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)
            if HAS_RB:
                drb += tl.sum(ds, axis=1)
    tl.store(DQh + offs_m[:, None] * stride_dqt + offs_dk[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dk[None, :] < D_QK))
    if HAS_RB:
        tl.store(DRB + rows + offs_m, drb, mask=row_ok)


# The weight of sigmoid attention (Ramapuram et al., 2024), for the op set `pointwise.SIGMOID` that a caller
# (tests, benchmarks, a hand-written layer) can use without generating a module; generated modules print their
# own weights from their energies.


@triton.jit
def _sigmoid(x):
    return tl.sigmoid(x)


@triton.jit
def _sigmoid_grad(x):
    s = tl.sigmoid(x)
    return s * (1.0 - s)
