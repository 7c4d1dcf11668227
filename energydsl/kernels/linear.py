"""Chunkwise Triton kernels for linear and gated (decayed) linear attention.

A sum-of-squares energy F = -(T/2) sum_j gamma_ij (z . W h_j)^2 has the update
    o_i = scale * sum_{j <= i} gamma_ij (q_i . k_j) v_j        (j < i when `strict`)
with gamma_ij = exp(sum_{s=j+1}^{i} g_s), g = log_decay <= 0 (per token (B,H,T), or per head (H,):
gamma_ij = a_h^(i-j), RetNet style). Equivalently S_i = a_i S_{i-1} + k_i v_i^T, o_i = q_i S_i.

Chunkwise-parallel form (chunk size C, chunk n holds positions nC .. nC+C-1, b_t = sum_{s=nC}^{t} g_s the
log decay accumulated inside the chunk, b_last the chunk's total, S_{n-1} the state after chunks 0..n-1):
    o_i   = scale * [ exp(b_i) q_i S_{n-1}  +  sum_{j in chunk, j<=i} exp(b_i - b_j) (q_i . k_j) v_j ]
    S_n   = exp(b_last) S_{n-1} + sum_{j in chunk} exp(b_last - b_j) k_j v_j^T
Every exponent is <= 0 once the causal mask is applied first, so nothing overflows.

The work is split as in flash-linear-attention's "chunk" kernels, so that all but a light pass run in
parallel over chunks (B * H alone is too few programs to fill a GPU at long T):
1. `_state_kernel` walks the chunks in order and stores the state every chunk reads, S_{n-1} (B*H, NT, Dk, Dv):
   one k^T v product per chunk, parallel over (Dk-block, Dv-block, batch * head);
2. `_fwd_kernel` computes each chunk's outputs from its state, parallel over (Dv-block, chunk, batch * head).
Backward (dO unscaled; every gradient is linear in dO, so `scale` is applied once at the end), with
M_ij = mask * exp(b_i - b_j) the intra-chunk decay mask and D_n the reverse state, the sum over positions i
after chunk n of exp(log decay from chunk n's end to i) q_i dO_i^T:
    D_{n-1} = exp(b_last) D_n + sum_{i in chunk n} exp(b_i) q_i dO_i^T           -- `_state_kernel`, reversed
    dq = (M o (dO V^T)) K + exp(b) * (dO S_{n-1}^T)                              -- `_bwd_dqk_kernel`
    dk = (M o (dO V^T))^T Q + exp(b_last - b) * (V D_n^T)                        -- `_bwd_dqk_kernel`
    dv = (M o (Q K^T))^T dO + exp(b_last - b) * (K D_n)                          -- `_bwd_dv_kernel`
    d log_decay_s = sum_{t >= s} (q_t . dq_t - k_t . dk_t)
The last identity: g_s enters every pair (i >= s > j), and sum_j P_ij = q_i . dq_i, sum_i P_ij = k_j . dk_j
for P_ij = M_ij (q_i . k_j)(dO_i . v_j). `_bwd_dqk_kernel` writes the row terms q_t . dq_t - k_t . dk_t per
Dk-block; their sum and the reverse cumulative sum over time are done in torch. The two row terms cancel where
the decay is strong, so the decay's gradient loses digits there: the gated-linear-attention example with
a = 0.01 at T = 200, interpreted, is off by 1.8e-3 relative against the float32 torch backend's 3.3e-4 (at
a = 0.9 the two agree). The states are recomputed in the backward, not kept from the forward: O(T Dk Dv / C)
memory each, alive only inside one call.

Products are taken in the inputs' dtype (bf16 on tensor cores) with fp32 accumulation; states are stored in
the inputs' dtype, as flash-linear-attention does. The ops are registered and launched as every family's
(`launch.py`: triton_ops on CUDA, custom_ops under the interpreter). Tensors that no kernel can take (CPU
without the interpreter) go to the torch backend's chunked op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import kernels_take, op_set
from .launch import (
    INTERPRET,
    autocast_inputs,
    cdiv,
    dot_precision,
    empty_grad,
    empty_in_order,
    kernel_layout,
    kernel_layouts,
    launch_options,
    maybe_autotune,
    next_power_of_2,
    no_autocast,
    refuse_unbaked,
    register_op,
    wrap_triton,
)

__all__ = [
    "GENERIC",
    "INTERPRET",
    "LinearAttentionOps",
    "linear_attention",
    "linear_attention_ops",
]


def _tile_sizes(K: int, V: int) -> tuple[int, int, int]:
    """(C, BK, BV): chunk length and the Dk- and Dv-blocks (powers of two >= 16, tl.dot's minimum).

    Fixed, not autotuned: C sets the states' shape and BK, BV the grids, which are allocated and sized before
    launch. On GPU C = 64 and 64-wide blocks, flash-linear-attention's chunk sizes. Under the interpreter
    everything is 16, so that small test shapes already span several chunks and several Dk- and Dv-blocks.
    """
    if INTERPRET:
        return 16, 16, 16
    return 64, min(64, max(16, next_power_of_2(K))), min(64, max(16, next_power_of_2(V)))


# Compiled for sm_90 with ptxas (no GPU at hand; `benchmarks/kernel_resources.py --variants "linear d64,linear
# d128 gated"`): in bf16 no config spills (4 warps: 80-225 registers, 8 warps: 46-126); 2 warps spilled in the
# output and gradient kernels. With exact fp32 ("ieee", FMA) products the dq/dk kernel spills 4 bytes at 8 warps.
_CONFIGS = [triton.Config({}, num_warps=w, num_stages=s) for w in (4, 8) for s in (1, 2, 3)]
_KEY = ["K", "V", "HAS_DECAY", "STRICT", "REVERSE", "C", "BK", "BV"]


# ----------------------------------------------------------------------------------------------------------
# Kernels. q, k, v, o and their gradients are (B, H, T, D), read and written through their batch, head and row
# strides with the features adjacent (any layout `launch.kernel_layout` passes); gradients through strides of
# their own (`launch.empty_grad`). Log decays (B, H, T) are read through their strides too (a per-head
# decay is one (H,) tensor expanded, stride 0 over batch and time). States are contiguous (B*H, NT, Dk, Dv);
# accumulation in fp32. Loads and the decay mask are written out in each kernel rather than in @triton.jit
# helpers: the interpreter re-patches triton.language on every device-function call, which tripled the test
# time.
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _state_kernel(
    x_ptr, y_ptr, g_ptr, h_ptr,
    stride_xb, stride_xh, stride_xt,  # batch, head and row strides of x; the feature stride is 1
    stride_yb, stride_yh, stride_yt,  # of y
    stride_gb, stride_gh, stride_gt,  # of the log decays (B, H, T); 0 along what a per-head decay repeats
    T, H, K, V,
    HAS_DECAY: tl.constexpr, REVERSE: tl.constexpr, DOT_PREC: tl.constexpr,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """h[n] = the state chunk n reads, one (Dk-block, Dv-block) tile of it per program.

    Forward (x, y = k, v; first chunk first): S_{n-1}, with S_n = exp(b_last) S_{n-1} + (exp(b_last - b) k)^T v.
    Reverse (x, y = q, dO; last chunk first): D_n, with D_{n-1} = exp(b_last) D_n + (exp(b) q)^T dO.
    """
    i_k = tl.program_id(0)
    i_v = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    n_chunks = tl.cdiv(T, C)
    offs_c = tl.arange(0, C)
    offs_k = i_k * BK + tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_kv = (offs_k < K)[:, None] & (offs_v < V)[None, :]
    # int32 offsets inside one chunk, added to a scalar pointer per chunk: a 64-bit pointer per tile element,
    # held across the loop, spilled registers at 4 warps
    x_tile = offs_c[:, None] * stride_xt + offs_k[None, :]
    y_tile = offs_c[:, None] * stride_yt + offs_v[None, :]
    x_seq = x_ptr + i_b * stride_xb + i_h * stride_xh
    y_seq = y_ptr + i_b * stride_yb + i_h * stride_yh
    g_seq = g_ptr + i_b * stride_gb + i_h * stride_gh
    h_tile = offs_k[:, None] * V + offs_v[None, :]
    state = tl.zeros([BK, BV], dtype=tl.float32)
    for n in range(0, n_chunks):
        if REVERSE:
            i_c = n_chunks - 1 - n
        else:
            i_c = n
        tl.store(h_ptr + (i_bh * n_chunks + i_c) * K * V + h_tile, state.to(h_ptr.dtype.element_ty), mask=mask_kv)
        row0 = i_c * C
        mask_t = row0 + offs_c < T  # the last chunk is padded with zeros
        x = tl.load(x_seq + row0 * stride_xt + x_tile, mask=mask_t[:, None] & (offs_k < K)[None, :], other=0.0)
        y = tl.load(y_seq + row0 * stride_yt + y_tile, mask=mask_t[:, None] & (offs_v < V)[None, :], other=0.0)
        if HAS_DECAY:
            g = tl.load(g_seq + (row0 + offs_c) * stride_gt, mask=mask_t, other=0.0).to(tl.float32)
            b = tl.cumsum(g, axis=0)  # log decay from the chunk start through t
            b_last = tl.sum(g, axis=0)  # the whole chunk's
            if REVERSE:
                w = tl.exp(b)  # q_i reads what lies before it, from the chunk start on
            else:
                w = tl.exp(b_last - b)  # k_j is read from the chunk's end on
            x_w = (x * w[:, None]).to(x.dtype)
            state = state * tl.exp(b_last) + tl.dot(tl.trans(x_w), y, input_precision=DOT_PREC)
        else:
            state += tl.dot(tl.trans(x), y, input_precision=DOT_PREC)


@triton.jit
def _fwd_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, h_ptr, o_ptr,
    stride_qb, stride_qh, stride_qt,  # batch, head and row strides of q; the feature stride is 1
    stride_kb, stride_kh, stride_kt,  # of k
    stride_vb, stride_vh, stride_vt,  # of v
    stride_ob, stride_oh, stride_ot,  # of o
    stride_gb, stride_gh, stride_gt,  # of the log decays
    T, H, K, V, scale,
    HAS_DECAY: tl.constexpr, STRICT: tl.constexpr, DOT_PREC: tl.constexpr,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """One chunk's outputs, one Dv-block of them: o = scale * [exp(b) * (Q S_{n-1}) + (M o (Q K^T)) V]."""
    scale = tl.cast(scale, tl.float32)  # torch.compile (Inductor) passes a Python float as fp64
    i_v = tl.program_id(0)
    i_c = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    n_chunks = tl.cdiv(T, C)
    offs_c = tl.arange(0, C)
    offs_t = i_c * C + offs_c
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_t = offs_t < T
    mask_v = offs_v < V
    p_q = q_ptr + i_b * stride_qb + i_h * stride_qh + offs_t[:, None] * stride_qt
    p_k = k_ptr + i_b * stride_kb + i_h * stride_kh + offs_t[:, None] * stride_kt
    p_h = h_ptr + (i_bh * n_chunks + i_c) * K * V + offs_v[None, :]

    o = tl.zeros([C, BV], dtype=tl.float32)
    A = tl.zeros([C, C], dtype=tl.float32)  # A_ij = q_i . k_j, summed over Dk-blocks
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        mask_k = offs_k < K
        mask_tk = mask_t[:, None] & mask_k[None, :]
        q = tl.load(p_q + offs_k[None, :], mask=mask_tk, other=0.0)
        k = tl.load(p_k + offs_k[None, :], mask=mask_tk, other=0.0)
        h = tl.load(p_h + offs_k[:, None] * V, mask=mask_k[:, None] & mask_v[None, :], other=0.0)
        o += tl.dot(q, h, input_precision=DOT_PREC)
        A += tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    # which (i, j) inside a chunk interact: j <= i, or j < i for the strict (exclusive) form
    if STRICT:
        causal = offs_c[:, None] > offs_c[None, :]
    else:
        causal = offs_c[:, None] >= offs_c[None, :]
    if HAS_DECAY:
        p_g = g_ptr + i_b * stride_gb + i_h * stride_gh + offs_t * stride_gt
        g = tl.load(p_g, mask=mask_t, other=0.0).to(tl.float32)
        b = tl.cumsum(g, axis=0)
        o = o * tl.exp(b)[:, None]  # earlier chunks reach position i through the state, decayed by exp(b_i)
        # M_ij = exp(b_i - b_j) on causal pairs; masked before exp, where j > i could overflow
        A = A * tl.exp(tl.where(causal, b[:, None] - b[None, :], float("-inf")))
    else:
        A = tl.where(causal, A, 0.0)
    v = tl.load(v_ptr + i_b * stride_vb + i_h * stride_vh + offs_t[:, None] * stride_vt + offs_v[None, :],
                mask=mask_t[:, None] & mask_v[None, :], other=0.0)  # fmt: skip
    o += tl.dot(A.to(v.dtype), v, input_precision=DOT_PREC)
    tl.store(o_ptr + i_b * stride_ob + i_h * stride_oh + offs_t[:, None] * stride_ot + offs_v[None, :],
             (o * scale).to(o_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_v[None, :])  # fmt: skip


@triton.jit
def _bwd_dqk_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, h_ptr, dh_ptr, do_ptr, dq_ptr, dk_ptr, r_ptr,
    stride_qb, stride_qh, stride_qt,  # batch, head and row strides of q; the feature stride is 1
    stride_kb, stride_kh, stride_kt,  # of k
    stride_vb, stride_vh, stride_vt,  # of v
    stride_dob, stride_doh, stride_dot,  # of dO
    stride_gb, stride_gh, stride_gt,  # of the log decays
    stride_dqb, stride_dqh, stride_dqt,  # of dq (`launch.empty_grad`), apart from q's
    stride_dkb, stride_dkh, stride_dkt,  # of dk
    stride_dvb, stride_dvh, stride_dvt,  # of dv
    T, H, K, V, scale,
    HAS_DECAY: tl.constexpr, STRICT: tl.constexpr, DOT_PREC: tl.constexpr,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """One chunk's dq and dk, one Dk-block of them; with a decay also r_t = q_t . dq_t - k_t . dk_t over this
    Dk-block (r_ptr: (NK, B*H, T) fp32), from which torch forms d log_decay."""
    scale = tl.cast(scale, tl.float32)  # torch.compile (Inductor) passes a Python float as fp64
    i_k = tl.program_id(0)
    i_c = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    n_bh = tl.num_programs(2)
    n_chunks = tl.cdiv(T, C)
    offs_c = tl.arange(0, C)
    offs_t = i_c * C + offs_c
    offs_k = i_k * BK + tl.arange(0, BK)
    mask_t = offs_t < T
    mask_k = offs_k < K
    mask_tk = mask_t[:, None] & mask_k[None, :]
    p_v = v_ptr + i_b * stride_vb + i_h * stride_vh + offs_t[:, None] * stride_vt
    p_do = do_ptr + i_b * stride_dob + i_h * stride_doh + offs_t[:, None] * stride_dot
    p_h = h_ptr + (i_bh * n_chunks + i_c) * K * V + offs_k[None, :] * V  # read transposed: (BV, BK) tiles
    p_dh = dh_ptr + (i_bh * n_chunks + i_c) * K * V + offs_k[None, :] * V

    dP = tl.zeros([C, C], dtype=tl.float32)  # dP_ij = dO_i . v_j, summed over Dv-blocks
    dq = tl.zeros([C, BK], dtype=tl.float32)  # dO S_{n-1}^T
    dk = tl.zeros([C, BK], dtype=tl.float32)  # V D_n^T
    for v0 in range(0, V, BV):
        offs_v = v0 + tl.arange(0, BV)
        mask_v = offs_v < V
        mask_tv = mask_t[:, None] & mask_v[None, :]
        v = tl.load(p_v + offs_v[None, :], mask=mask_tv, other=0.0)
        do = tl.load(p_do + offs_v[None, :], mask=mask_tv, other=0.0)
        mask_vk = mask_v[:, None] & mask_k[None, :]
        h_t = tl.load(p_h + offs_v[:, None], mask=mask_vk, other=0.0)
        dh_t = tl.load(p_dh + offs_v[:, None], mask=mask_vk, other=0.0)
        dP += tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        dq += tl.dot(do, h_t, input_precision=DOT_PREC)
        dk += tl.dot(v, dh_t, input_precision=DOT_PREC)
    if STRICT:
        causal = offs_c[:, None] > offs_c[None, :]
    else:
        causal = offs_c[:, None] >= offs_c[None, :]
    if HAS_DECAY:
        p_g = g_ptr + i_b * stride_gb + i_h * stride_gh + offs_t * stride_gt
        g = tl.load(p_g, mask=mask_t, other=0.0).to(tl.float32)
        b = tl.cumsum(g, axis=0)
        b_last = tl.sum(g, axis=0)
        dq = dq * tl.exp(b)[:, None]
        dk = dk * tl.exp(b_last - b)[:, None]  # later chunks saw k_j through the state, decayed by this
        dP = dP * tl.exp(tl.where(causal, b[:, None] - b[None, :], float("-inf")))
    else:
        dP = tl.where(causal, dP, 0.0)
    q = tl.load(q_ptr + i_b * stride_qb + i_h * stride_qh + offs_t[:, None] * stride_qt + offs_k[None, :],
                mask=mask_tk, other=0.0)  # fmt: skip
    k = tl.load(k_ptr + i_b * stride_kb + i_h * stride_kh + offs_t[:, None] * stride_kt + offs_k[None, :],
                mask=mask_tk, other=0.0)  # fmt: skip
    dq = (dq + tl.dot(dP.to(k.dtype), k, input_precision=DOT_PREC)) * scale
    dk = (dk + tl.dot(tl.trans(dP).to(q.dtype), q, input_precision=DOT_PREC)) * scale
    tl.store(dq_ptr + i_b * stride_dqb + i_h * stride_dqh + offs_t[:, None] * stride_dqt + offs_k[None, :],
             dq.to(dq_ptr.dtype.element_ty), mask=mask_tk)  # fmt: skip
    tl.store(dk_ptr + i_b * stride_dkb + i_h * stride_dkh + offs_t[:, None] * stride_dkt + offs_k[None, :],
             dk.to(dk_ptr.dtype.element_ty), mask=mask_tk)  # fmt: skip
    if HAS_DECAY:
        r = tl.sum(q.to(tl.float32) * dq - k.to(tl.float32) * dk, axis=1)
        tl.store(r_ptr + (i_k * n_bh + i_bh) * T + offs_t, r, mask=mask_t)


@triton.jit
def _bwd_dv_kernel(
    q_ptr, k_ptr, g_ptr, dh_ptr, do_ptr, dv_ptr,
    stride_qb, stride_qh, stride_qt,  # batch, head and row strides of q; the feature stride is 1
    stride_kb, stride_kh, stride_kt,  # of k
    stride_vb, stride_vh, stride_vt,  # of v
    stride_dob, stride_doh, stride_dot,  # of dO
    stride_gb, stride_gh, stride_gt,  # of the log decays
    stride_dqb, stride_dqh, stride_dqt,  # of dq (`launch.empty_grad`), apart from q's
    stride_dkb, stride_dkh, stride_dkt,  # of dk
    stride_dvb, stride_dvh, stride_dvt,  # of dv
    T, H, K, V, scale,
    HAS_DECAY: tl.constexpr, STRICT: tl.constexpr, DOT_PREC: tl.constexpr,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """One chunk's dv, one Dv-block of it: dv = scale * [(M o (Q K^T))^T dO + exp(b_last - b) * (K D_n)]."""
    scale = tl.cast(scale, tl.float32)  # torch.compile (Inductor) passes a Python float as fp64
    i_v = tl.program_id(0)
    i_c = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    i_b = i_bh // H
    i_h = i_bh % H
    n_chunks = tl.cdiv(T, C)
    offs_c = tl.arange(0, C)
    offs_t = i_c * C + offs_c
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_t = offs_t < T
    mask_v = offs_v < V
    mask_tv = mask_t[:, None] & mask_v[None, :]
    p_q = q_ptr + i_b * stride_qb + i_h * stride_qh + offs_t[:, None] * stride_qt
    p_k = k_ptr + i_b * stride_kb + i_h * stride_kh + offs_t[:, None] * stride_kt
    p_dh = dh_ptr + (i_bh * n_chunks + i_c) * K * V + offs_v[None, :]

    dv = tl.zeros([C, BV], dtype=tl.float32)  # K D_n
    At = tl.zeros([C, C], dtype=tl.float32)  # At_ji = k_j . q_i, summed over Dk-blocks
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        mask_k = offs_k < K
        mask_tk = mask_t[:, None] & mask_k[None, :]
        q = tl.load(p_q + offs_k[None, :], mask=mask_tk, other=0.0)
        k = tl.load(p_k + offs_k[None, :], mask=mask_tk, other=0.0)
        dh = tl.load(p_dh + offs_k[:, None] * V, mask=mask_k[:, None] & mask_v[None, :], other=0.0)
        dv += tl.dot(k, dh, input_precision=DOT_PREC)
        At += tl.dot(k, tl.trans(q), input_precision=DOT_PREC)
    # transposed mask: row j, column i, i >= j (i > j when strict)
    if STRICT:
        causal_t = offs_c[:, None] < offs_c[None, :]
    else:
        causal_t = offs_c[:, None] <= offs_c[None, :]
    if HAS_DECAY:
        p_g = g_ptr + i_b * stride_gb + i_h * stride_gh + offs_t * stride_gt
        g = tl.load(p_g, mask=mask_t, other=0.0).to(tl.float32)
        b = tl.cumsum(g, axis=0)
        b_last = tl.sum(g, axis=0)
        dv = dv * tl.exp(b_last - b)[:, None]
        At = At * tl.exp(tl.where(causal_t, b[None, :] - b[:, None], float("-inf")))
    else:
        At = tl.where(causal_t, At, 0.0)
    do = tl.load(do_ptr + i_b * stride_dob + i_h * stride_doh + offs_t[:, None] * stride_dot + offs_v[None, :],
                 mask=mask_tv, other=0.0)  # fmt: skip
    dv = (dv + tl.dot(At.to(do.dtype), do, input_precision=DOT_PREC)) * scale
    tl.store(dv_ptr + i_b * stride_dvb + i_h * stride_dvh + offs_t[:, None] * stride_dvt + offs_v[None, :],
             dv.to(dv_ptr.dtype.element_ty), mask=mask_tv)  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# The ops: one set per kernel template set, registered under its own name
# ----------------------------------------------------------------------------------------------------------


class LinearAttentionOps:
    """The four chunkwise kernels, launched by torch ops registered under one name.

    `GENERIC` below runs the templates themselves (HAS_DECAY and STRICT chosen at launch). The triton code
    generator writes copies with the energy's decay and mask baked in (energydsl/codegen/triton_source.py)
    and builds a set over them with `linear_attention_ops`; `baked` records those values, and a call that
    needs others is refused.
    """

    def __init__(
        self, name: str, state: Any, fwd: Any, dqk: Any, dv: Any, baked: dict[str, Any] | None = None
    ):
        self.name = name
        self.baked = dict(baked or {})
        self._state, self._fwd, self._dqk, self._dv = (
            maybe_autotune(_CONFIGS, [k for k in _KEY if k in kernel.arg_names])(kernel)
            for kernel in (state, fwd, dqk, dv)
        )
        self._bwd_op = register_op(f"{name}_bwd", self._bwd_impl(), _linear_attention_bwd_fake)
        self._fwd_op = register_op(
            f"{name}_fwd",
            self._fwd_impl(),
            _linear_attention_fwd_fake,
            backward=self._backward_op,
            setup_context=_setup_context,
        )

    def _meta(self, kernel: Any, dtype: torch.dtype, **flags: Any) -> dict[str, Any]:
        """`kernel`'s compile-time arguments: `flags` it takes and has not baked in, the dot precision, the
        launch options under the interpreter (autotuned on CUDA)."""
        flags = {k: v for k, v in flags.items() if k in kernel.arg_names and k not in self.baked}
        return flags | dict(DOT_PREC=dot_precision(dtype)) | launch_options(num_warps=4)

    def _states(
        self, x: Tensor, y: Tensor, g: Tensor, strides: tuple[int, ...], tiles: tuple[int, int, int],
        has_decay: bool, reverse: bool,
    ) -> Tensor:
        """The state every chunk reads, (B*H, NT, Dk, Dv) in x's dtype: S_{n-1} from (k, v) forward, D_n from
        (q, dO) reversed. `strides`: the batch, head and row strides of x, y and g, and `tiles` the caller's
        `_tile_sizes`, as the caller has them."""
        B, H, T, K = x.shape
        V = y.shape[-1]
        C, BK, BV = tiles
        h = torch.empty((B * H, cdiv(T, C), K, V), dtype=x.dtype, device=x.device)
        meta = self._meta(self._state, x.dtype, HAS_DECAY=has_decay, REVERSE=reverse, C=C, BK=BK, BV=BV)
        grid = (cdiv(K, BK), cdiv(V, BV), B * H)
        wrap_triton(self._state)[grid](x, y, g, h, *strides, T, H, K, V, **meta)
        return h

    # -- launchers (these bodies are the ops: traceable by torch.compile, kernels behind `wrap_triton`) -----

    def _fwd_impl(self) -> Callable[..., Tensor]:
        def linear_attention_fwd(
            q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor | None, scale: float, strict: bool
        ) -> Tensor:
            """o = scale * sum_{j<=i} gamma_ij (q_i . k_j) v_j; log_decay, if given, is per token (B, H, T)."""
            q, k, v = kernel_layouts(q, k, v)  # any strides from a direct caller; none copied when laid out
            B, H, T, K = q.shape
            log_decay = _decay_layout(log_decay, T)
            V = v.shape[-1]
            C, BK, BV = _tile_sizes(K, V)
            has_decay = log_decay is not None
            g = log_decay if has_decay else q  # dummy pointer when HAS_DECAY is off
            sq, sk, sv, sg = _strides(q, k, v, log_decay)
            h = self._states(k, v, g, (*sk, *sv, *sg), (C, BK, BV), has_decay, reverse=False)
            o = empty_in_order(q, V, v.dtype)  # token-major for token-major queries
            meta = self._meta(self._fwd, q.dtype, HAS_DECAY=has_decay, STRICT=strict, C=C, BK=BK, BV=BV)
            grid = (cdiv(V, BV), cdiv(T, C), B * H)
            strides = (*sq, *sk, *sv, *o.stride()[:3], *sg)
            wrap_triton(self._fwd)[grid](q, k, v, g, h, o, *strides, T, H, K, V, scale, **meta)
            return o

        return linear_attention_fwd

    def _bwd_impl(self) -> Callable[..., tuple[Tensor, Tensor, Tensor, Tensor]]:
        def linear_attention_bwd(
            do: Tensor,
            q: Tensor,
            k: Tensor,
            v: Tensor,
            log_decay: Tensor | None,
            scale: float,
            strict: bool,
            need_dg: bool,
        ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
            """(dq, dk, dv, d log_decay); the last is empty when there is no decay or it is not needed."""
            q, k, v = kernel_layouts(q, k, v)
            do = kernel_layout(do.to(v.dtype))  # the kernels multiply dO with tiles in v's dtype
            B, H, T, K = q.shape
            log_decay = _decay_layout(log_decay, T)
            V = v.shape[-1]
            C, BK, BV = _tile_sizes(K, V)
            has_decay = log_decay is not None
            g = log_decay if has_decay else q
            sq, sk, sv, sg = _strides(q, k, v, log_decay)
            sdo = do.stride()[:3]
            h = self._states(k, v, g, (*sk, *sv, *sg), (C, BK, BV), has_decay, reverse=False)
            dh = self._states(q, do, g, (*sq, *sdo, *sg), (C, BK, BV), has_decay, reverse=True)
            NK, NT = cdiv(K, BK), cdiv(T, C)
            dq, dk, dv = empty_grad(q), empty_grad(k), empty_grad(v)
            # the row terms of d log_decay, one slab per Dk-block (summed below, no atomics)
            r = torch.empty((NK, B, H, T) if has_decay else (0,), dtype=torch.float32, device=q.device)
            flags = dict(HAS_DECAY=has_decay, STRICT=strict, C=C, BK=BK, BV=BV)
            sizes = (*sq, *sk, *sv, *sdo, *sg, *dq.stride()[:3], *dk.stride()[:3], *dv.stride()[:3], T, H, K, V, scale)
            wrap_triton(self._dqk)[(NK, NT, B * H)](
                q, k, v, g, h, dh, do, dq, dk, r, *sizes, **self._meta(self._dqk, q.dtype, **flags)
            )
            wrap_triton(self._dv)[(cdiv(V, BV), NT, B * H)](
                q, k, g, dh, do, dv, *sizes, **self._meta(self._dv, q.dtype, **flags)
            )
            if has_decay and need_dg:
                # d g_s = sum_{t >= s} r_t: a reverse cumulative sum over time. g_0 decays nothing (gamma_ij
                # sums g from j+1 on), so d g_0 is exactly 0 rather than a full sum's rounding.
                r = r.sum(0)
                dg = torch.nn.functional.pad(r[..., 1:].flip(-1).cumsum(-1).flip(-1), (1, 0)).to(log_decay.dtype)
            else:
                dg = q.new_empty((0,))
            return dq, dk, dv, dg

        return linear_attention_bwd

    def _backward_op(self, ctx: Any, do: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, log_decay = ctx.saved_tensors
        need_dg = log_decay is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dg = self._bwd_op(do, q, k, v, log_decay, ctx.scale, ctx.strict, need_dg)
        return dq, dk, dv, (dg if need_dg else None), None, None

    # -- public API ----------------------------------------------------------------------------------------

    def linear_attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        scale: float = 1.0,
        log_decay: Tensor | None = None,
        strict: bool = False,
    ) -> Tensor:
        """(Gated) linear attention o_i = scale * sum_{j<=i} gamma_ij (q_i . k_j) v_j (j < i if `strict`).

        q, k: (B, H, T, Dk); v: (B, H, T, Dv), may be `k` itself. log_decay: None (gamma = 1), (B, H, T)
        per-token log decays (gamma_ij = exp(sum_{s=j+1}^{i} log_decay_s)), or (H,) per-head
        (gamma_ij = a_h^(i-j)); it must be <= 0 for the chunked form to be overflow-free. Differentiable in
        q, k, v and log_decay.
        """
        q, k, v = autocast_inputs(q, k, v)
        if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
            raise ValueError(
                f"expected q, k (B,H,T,Dk) and v (B,H,T,Dv); got {tuple(q.shape)}, {tuple(k.shape)}, "
                f"{tuple(v.shape)}"
            )
        if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
            raise ValueError("q, k and v must share dtype and device")
        call = dict(HAS_DECAY=log_decay is not None, STRICT=strict)
        refuse_unbaked(self.name, self.baked, call)
        if INTERPRET and q.dtype == torch.bfloat16:  # the interpreter's tl.dot misreads bf16 (triton#11584)
            with no_autocast(q):
                return self.linear_attention(q.float(), k.float(), v.float(), scale=scale, log_decay=log_decay,
                                             strict=strict).to(v.dtype)
        B, H, T, _ = q.shape
        if log_decay is not None:
            if log_decay.shape == (H,):
                # per head: every step decays by a_h; the expand's backward sums d log_decay over (b, t)
                log_decay = log_decay.view(1, H, 1).expand(B, H, T)
            elif log_decay.shape != (B, H, T):
                raise ValueError(
                    f"log_decay must be (B,H,T)={(B, H, T)} or (H,)={(H,)}; got {tuple(log_decay.shape)}"
                )
            log_decay = log_decay.to(q.device)
        if not kernels_take(q):  # no kernel can take these tensors: the torch backend's chunked op
            from ..runtime.ops import linear_attention as chunked

            return chunked(q, k, v, scale=scale, log_decay=log_decay, strict=strict)
        if T == 0:
            return v.new_empty(v.shape)
        # in place where the features are adjacent (heads split off a projection need no copy); the op lays out its
        # inputs itself too, for direct callers, but laid out here they are what autograd saves for the backward
        q, k, v = kernel_layouts(q, k, v)
        return self._fwd_op(q, k, v, log_decay, float(scale), bool(strict))


def _strides(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor | None) -> tuple[tuple[int, ...], ...]:
    """The batch, head and row strides of q, k, v and the log decays, each taken once per call. The log decays
    are read in place: a per-head decay expanded over (B, H, T) repeats with stride 0."""
    return q.stride()[:3], k.stride()[:3], v.stride()[:3], (0, 0, 0) if log_decay is None else log_decay.stride()


def _decay_layout(log_decay: Tensor | None, T: int) -> Tensor | None:
    """The log decays as the kernels read them: in place through any strides (a per-head decay expanded over
    (B, H, T) repeats with stride 0), copied only where time offsets would pass the kernels' 32 bits."""
    if log_decay is not None and log_decay.stride(-1) * T >= 2**31:
        return log_decay.contiguous()
    return log_decay


# Shape-only twins of the op bodies (torch.compile traces the interpreter's custom_ops through them): laid out
# as the bodies lay out, so that outputs and gradients have the strides the bodies give them.


def _linear_attention_fwd_fake(
    q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor | None, scale: float, strict: bool
) -> Tensor:
    return empty_in_order(kernel_layout(q), v.shape[-1], v.dtype)


def _linear_attention_bwd_fake(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor | None,
    scale: float,
    strict: bool,
    need_dg: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dg = log_decay.new_empty(log_decay.shape) if (log_decay is not None and need_dg) else q.new_empty((0,))
    q, k, v = kernel_layouts(q, k, v)
    return empty_grad(q), empty_grad(k), empty_grad(v), dg


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    q, k, v, log_decay, scale, strict = inputs
    ctx.save_for_backward(q, k, v, log_decay)
    ctx.scale = scale
    ctx.strict = strict


# ----------------------------------------------------------------------------------------------------------
# The generic set and specialised ones
# ----------------------------------------------------------------------------------------------------------

def linear_attention_ops(
    name: str, state: Any, fwd: Any, dqk: Any, dv: Any, baked: dict[str, Any]
) -> LinearAttentionOps:
    """The op set over specialised kernels, registered once per process under `energydsl::{name}_*`."""
    return op_set(name, lambda: LinearAttentionOps(name, state, fwd, dqk, dv, baked))


GENERIC = LinearAttentionOps("linear_attention", _state_kernel, _fwd_kernel, _bwd_dqk_kernel, _bwd_dv_kernel)
linear_attention = GENERIC.linear_attention
