"""The pointwise-weight family's Triton kernels for feature widths that do not fit one tile (templates, as in
`pointwise_kernels.py`, whose score terms, weight functions and block ranges they share).

`pointwise_kernels.py` holds whole (BLOCK, D) tiles of q, k, v and dO, which stops at D = 256. Here, as in the
softmax family's wide kernels (`attention_wide_kernels.py`), every feature axis is cut into tiles of BLOCK_D:

* a dot-product tile (the scores q_i . k_j, and dO_i . v_j in the backward) is summed over feature tiles as they
  are loaded (`_tile_dots`), so nothing D wide is held;
* each program owns one feature tile of its outputs (a third grid axis: the value tile of o; the key and value
  tiles of dK and dV, a program writing both where both widths reach its tile; the key tile of dQ) and
  recomputes the scores it needs. The gradients of the biases are per-row sums of dS, written by the programs
  of the first tile;
* or, with FEATURE_LOOP (an autotune choice, as in the softmax family's backward; here the forward has it too),
  one program per row block computes each score tile once and adds its products to every feature tile of fp32
  outputs in memory (`_add_products`): a read and a write of each output tile per block instead of a score pass
  per tile. (No normalisation over j, so the forward's sums need no rescaling.)

Nothing T x T or T x D beyond the inputs and outputs is stored: memory stays linear in T.
"""

import triton
import triton.language as tl

from .attention_wide_kernels import _add_products, _tile_dots, _zero_rows
from .pointwise_kernels import _head, _in_context, _pointwise_blocks, _score_terms


@triton.jit
def _wide_scores(Qh, Kh, offs_m, offs_n, stride_qt, stride_kt, row_ok, key_ok, D_QK, rb_ptr, kb_ptr, slope, self_b,
                 T, scale, KEYS_FIRST: tl.constexpr, MASKED: tl.constexpr, HAS_RB: tl.constexpr,
                 HAS_KB: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SELF: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PREC: tl.constexpr):
    """(s, i, j) as `_pointwise_scores` gives them, the dot product summed over feature tiles: (queries, keys), or
    (keys, queries) with KEYS_FIRST."""
    if KEYS_FIRST:
        s = _tile_dots(Kh, Qh, offs_n, offs_m, stride_kt, stride_qt, key_ok, row_ok, D_QK, BLOCK_N, BLOCK_M, BLOCK_D,
                       DOT_PREC)
        i = offs_m[None, :]
        j = offs_n[:, None]
    else:
        s = _tile_dots(Qh, Kh, offs_m, offs_n, stride_qt, stride_kt, row_ok, key_ok, D_QK, BLOCK_M, BLOCK_N, BLOCK_D,
                       DOT_PREC)
        i = offs_m[:, None]
        j = offs_n[None, :]
    s = _score_terms(s * scale, i, j, rb_ptr, kb_ptr, slope, self_b, T, MASKED, HAS_RB, HAS_KB, HAS_ALIBI, HAS_SELF)
    return s, i, j


@triton.jit
def _pointwise_fwd_wide_kernel(
    Q, K, V, RB, KB, ALIBI, SELF, O,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_ob, stride_oh, stride_ot,
    T, H, D_QK, D_V, scale,
    T_TUNE,  # the autotuner's key only (`attention_configs.tune_bucket(T)`); the kernel does not read it
    WEIGHT: tl.constexpr, STRICT: tl.constexpr, HAS_RB: tl.constexpr, HAS_KB: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_SELF: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FEATURE_LOOP: tl.constexpr = False,
):
    """One feature tile of o_i = sum_j w(s_ij) v_j for one block of queries of one (batch, head); with
    FEATURE_LOOP one program per query block adds to every feature tile of O (fp32, zeroed first)."""
    start_m = tl.program_id(0) * BLOCK_M
    scale = tl.cast(scale, tl.float32)  # torch.compile (Inductor) passes a Python float as fp64
    b, h, rows, Qh, Kh, Vh, Oh, rb_ptr, kb_ptr, slope, self_b = _head(
        Q, K, V, O, RB, KB, ALIBI, SELF, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
        stride_ob, stride_oh, T, H, HAS_ALIBI, HAS_SELF)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = offs_m < T
    if FEATURE_LOOP:
        _zero_rows(Oh, offs_m, stride_ot, row_ok, D_V, BLOCK_D)
        tl.debug_barrier()  # every thread's zeros are written before any thread adds to them
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for mode in tl.static_range(2):  # key blocks before this query block, unmasked; then the diagonal's
        lo, hi = _pointwise_blocks(start_m, T, mode, False, BLOCK_M, BLOCK_N)
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            key_ok = offs_n < T
            s, i, j = _wide_scores(Qh, Kh, offs_m, offs_n, stride_qt, stride_kt, row_ok, key_ok, D_QK, rb_ptr, kb_ptr,
                                   slope, self_b, T, scale, False, mode > 0, HAS_RB, HAS_KB, HAS_ALIBI, HAS_SELF,
                                   BLOCK_M, BLOCK_N, BLOCK_D, DOT_PREC)
            w = _in_context(WEIGHT(s), i, j, T, mode > 0, STRICT)
            if FEATURE_LOOP:
                _add_products(Oh, offs_m, stride_ot, row_ok, w, Vh, offs_n, stride_vt, key_ok, D_V, BLOCK_D, DOT_PREC)
                tl.debug_barrier()  # this block's sums are written before the next block reads them
            else:
                v = tl.load(Vh + offs_n[:, None] * stride_vt + offs_d[None, :],
                            mask=key_ok[:, None] & (offs_d[None, :] < D_V), other=0.0)
                acc += tl.dot(w.to(v.dtype), v, input_precision=DOT_PREC)
    if not FEATURE_LOOP:
        tl.store(Oh + offs_m[:, None] * stride_ot + offs_d[None, :], acc.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_d[None, :] < D_V))


@triton.jit
def _pointwise_bwd_dkdv_wide_kernel(
    Q, K, V, RB, KB, ALIBI, SELF, DO, DK, DV, DKB, DDIST, DDIAG,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot,
    stride_dqb, stride_dqh, stride_dqt, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt,
    T, H, D_QK, D_V, scale,
    T_TUNE,  # the autotuner's key only (`attention_configs.tune_bucket(T)`); the kernel does not read it
    WEIGHT: tl.constexpr, WEIGHT_GRAD: tl.constexpr, STRICT: tl.constexpr, HAS_RB: tl.constexpr,
    HAS_KB: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SELF: tl.constexpr, NEED_ALIBI: tl.constexpr,
    NEED_SELF: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, FEATURE_LOOP: tl.constexpr = False,
):
    """One feature tile of dK and of dV (where D_QK and D_V reach it) for one block of keys, and, in the first
    tile's programs, d key_bias and the slope's and self bias's per-key column sums (DDIST, DDIAG): loops over
    the query blocks that see the keys. DK and DV have strides of their own.

    FEATURE_LOOP: one program per key block (the grid's third axis is 1) adds each block's products to every
    feature tile of DK and DV, fp32, zeroed first."""
    start_n = tl.program_id(0) * BLOCK_N
    scale = tl.cast(scale, tl.float32)  # torch.compile (Inductor) passes a Python float as fp64
    tile = tl.program_id(2)
    b, h, rows, Qh, Kh, Vh, DOh, rb_ptr, kb_ptr, slope, self_b = _head(
        Q, K, V, DO, RB, KB, ALIBI, SELF, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
        stride_dob, stride_doh, T, H, HAS_ALIBI, HAS_SELF)
    DKh = DK + b * stride_dkb + h * stride_dkh
    DVh = DV + b * stride_dvb + h * stride_dvh
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tile * BLOCK_D + tl.arange(0, BLOCK_D)
    key_ok = offs_n < T
    if FEATURE_LOOP:
        _zero_rows(DKh, offs_n, stride_dkt, key_ok, D_QK, BLOCK_D)
        _zero_rows(DVh, offs_n, stride_dvt, key_ok, D_V, BLOCK_D)
        tl.debug_barrier()  # every thread's zeros are written before any thread adds to them
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dkb = tl.zeros((BLOCK_N,), dtype=tl.float32)
    ddist = tl.zeros((BLOCK_N,), dtype=tl.float32)  # sum_i dS_ij |i - j|, per key
    ddiag = tl.zeros((BLOCK_N,), dtype=tl.float32)  # dS_jj
    for mode in tl.static_range(3):  # whole query blocks after this key block, unmasked; the diagonal's; the last
        lo, hi = _pointwise_blocks(start_n, T, mode, True, BLOCK_M, BLOCK_N)
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_ok = offs_m < T
            s, i, j = _wide_scores(Qh, Kh, offs_m, offs_n, stride_qt, stride_kt, row_ok, key_ok, D_QK, rb_ptr, kb_ptr,
                                   slope, self_b, T, scale, True, mode > 0, HAS_RB, HAS_KB, HAS_ALIBI, HAS_SELF,
                                   BLOCK_M, BLOCK_N, BLOCK_D, DOT_PREC)  # (keys, queries)
            dw = _tile_dots(Vh, DOh, offs_n, offs_m, stride_vt, stride_dot, key_ok, row_ok, D_V, BLOCK_N, BLOCK_M,
                            BLOCK_D, DOT_PREC)  # (dO_i . v_j), keys first
            ds = _in_context(dw * WEIGHT_GRAD(s), i, j, T, mode > 0, STRICT)
            if FEATURE_LOOP:
                w = _in_context(WEIGHT(s), i, j, T, mode > 0, STRICT)
                _add_products(DKh, offs_n, stride_dkt, key_ok, ds * scale, Qh, offs_m, stride_qt, row_ok, D_QK,
                              BLOCK_D, DOT_PREC)
                _add_products(DVh, offs_n, stride_dvt, key_ok, w, DOh, offs_m, stride_dot, row_ok, D_V, BLOCK_D,
                              DOT_PREC)
                tl.debug_barrier()  # this block's sums are written before the next block reads them
            else:
                if tile * BLOCK_D < D_V:
                    w = _in_context(WEIGHT(s), i, j, T, mode > 0, STRICT)
                    do = tl.load(DOh + offs_m[:, None] * stride_dot + offs_d[None, :],
                                 mask=row_ok[:, None] & (offs_d[None, :] < D_V), other=0.0)
                    dv += tl.dot(w.to(do.dtype), do, input_precision=DOT_PREC)
                if tile * BLOCK_D < D_QK:
                    q = tl.load(Qh + offs_m[:, None] * stride_qt + offs_d[None, :],
                                mask=row_ok[:, None] & (offs_d[None, :] < D_QK), other=0.0)
                    dk += tl.dot(ds.to(q.dtype), q, input_precision=DOT_PREC)
            if tile == 0:
                if HAS_KB:
                    dkb += tl.sum(ds, axis=1)
                if NEED_ALIBI:
                    ddist += tl.sum(ds * tl.abs(i - j).to(tl.float32), axis=1)
                if NEED_SELF and mode > 0:
                    ddiag += tl.sum(tl.where(i == j, ds, 0.0), axis=1)
    if not FEATURE_LOOP:
        tl.store(DKh + offs_n[:, None] * stride_dkt + offs_d[None, :], (dk * scale).to(DK.dtype.element_ty),
                 mask=key_ok[:, None] & (offs_d[None, :] < D_QK))
        tl.store(DVh + offs_n[:, None] * stride_dvt + offs_d[None, :], dv.to(DV.dtype.element_ty),
                 mask=key_ok[:, None] & (offs_d[None, :] < D_V))
    if tile == 0:
        if HAS_KB:
            tl.store(DKB + rows + offs_n, dkb, mask=key_ok)
        if NEED_ALIBI:
            tl.store(DDIST + rows + offs_n, ddist, mask=key_ok)
        if NEED_SELF:
            tl.store(DDIAG + rows + offs_n, ddiag, mask=key_ok)


@triton.jit
def _pointwise_bwd_dq_wide_kernel(
    Q, K, V, RB, KB, ALIBI, SELF, DO, DQ, DRB,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_dob, stride_doh, stride_dot,
    stride_dqb, stride_dqh, stride_dqt, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt,
    T, H, D_QK, D_V, scale,
    T_TUNE,  # the autotuner's key only (`attention_configs.tune_bucket(T)`); the kernel does not read it
    WEIGHT_GRAD: tl.constexpr, STRICT: tl.constexpr, HAS_RB: tl.constexpr, HAS_KB: tl.constexpr,
    HAS_ALIBI: tl.constexpr, HAS_SELF: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FEATURE_LOOP: tl.constexpr = False,
):
    """One feature tile of dQ for one block of queries, and d row_bias in the first tile's programs: a loop over
    the key blocks the queries see. DQ has strides of its own. FEATURE_LOOP: one program per query block adds to
    every feature tile of DQ (fp32, zeroed first)."""
    start_m = tl.program_id(0) * BLOCK_M
    scale = tl.cast(scale, tl.float32)  # torch.compile (Inductor) passes a Python float as fp64
    tile = tl.program_id(2)
    b, h, rows, Qh, Kh, Vh, DOh, rb_ptr, kb_ptr, slope, self_b = _head(
        Q, K, V, DO, RB, KB, ALIBI, SELF, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh,
        stride_dob, stride_doh, T, H, HAS_ALIBI, HAS_SELF)
    DQh = DQ + b * stride_dqb + h * stride_dqh
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tile * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = offs_m < T
    if FEATURE_LOOP:
        _zero_rows(DQh, offs_m, stride_dqt, row_ok, D_QK, BLOCK_D)
        tl.debug_barrier()  # every thread's zeros are written before any thread adds to them
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    drb = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for mode in tl.static_range(2):  # key blocks before this query block, unmasked; then the diagonal's
        lo, hi = _pointwise_blocks(start_m, T, mode, False, BLOCK_M, BLOCK_N)
        for start_n in range(lo, hi, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            key_ok = offs_n < T
            s, i, j = _wide_scores(Qh, Kh, offs_m, offs_n, stride_qt, stride_kt, row_ok, key_ok, D_QK, rb_ptr, kb_ptr,
                                   slope, self_b, T, scale, False, mode > 0, HAS_RB, HAS_KB, HAS_ALIBI, HAS_SELF,
                                   BLOCK_M, BLOCK_N, BLOCK_D, DOT_PREC)
            dw = _tile_dots(DOh, Vh, offs_m, offs_n, stride_dot, stride_vt, row_ok, key_ok, D_V, BLOCK_M, BLOCK_N,
                            BLOCK_D, DOT_PREC)
            ds = _in_context(dw * WEIGHT_GRAD(s), i, j, T, mode > 0, STRICT)
            if FEATURE_LOOP:
                _add_products(DQh, offs_m, stride_dqt, row_ok, ds * scale, Kh, offs_n, stride_kt, key_ok, D_QK,
                              BLOCK_D, DOT_PREC)
                tl.debug_barrier()  # this block's sums are written before the next block reads them
            else:
                k = tl.load(Kh + offs_n[:, None] * stride_kt + offs_d[None, :],
                            mask=key_ok[:, None] & (offs_d[None, :] < D_QK), other=0.0)
                dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PREC)
            if HAS_RB and tile == 0:
                drb += tl.sum(ds, axis=1)
    if not FEATURE_LOOP:
        tl.store(DQh + offs_m[:, None] * stride_dqt + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_d[None, :] < D_QK))
    if HAS_RB and tile == 0:
        tl.store(DRB + rows + offs_m, drb, mask=row_ok)
