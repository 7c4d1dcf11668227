"""Chunkwise Triton kernels for linear and gated (decayed) linear attention.

A sum-of-squares energy F = -(T/2) sum_j gamma_ij (z . W h_j)^2 has the update
    o_i = scale * sum_{j <= i} gamma_ij (q_i . k_j) v_j        (j < i when `strict`)
with gamma_ij = exp(sum_{s=j+1}^{i} g_s), g = log_decay <= 0 (per token (B,H,T), or per head (H,):
gamma_ij = a_h^(i-j), RetNet style). Equivalently S_i = a_i S_{i-1} + k_i v_i^T, o_i = q_i S_i.

Chunkwise-parallel form (chunk size C, chunk n holds positions nC .. nC+C-1, b_t = sum_{s=nC}^{t} g_s the
log decay accumulated inside the chunk, b_last the chunk's total):
    o_i   = scale * [ exp(b_i) q_i S_{n-1}  +  sum_{j in chunk, j<=i} exp(b_i - b_j) (q_i . k_j) v_j ]
    S_n   = exp(b_last) S_{n-1} + sum_{j in chunk} exp(b_last - b_j) k_j v_j^T
Every exponent is <= 0 once the causal mask is applied first, so nothing overflows. The state S (Dk x Dv) is
carried in registers across chunks: O(T C d + T d^2) work, no T x T matrix. One program owns one
(batch, head, Dv-block); the Dk dimension is kept whole so q_i . k_j is complete inside a program. (This is
flash-linear-attention's "fused chunk" scheme: parallel over B * H * Dv-blocks, sequential over chunks. Its
"chunk" scheme, which stores every chunk's state to parallelize over chunks too, would suit small B * H.)

Backward (dO already multiplied by scale), with M_ij = mask * exp(b_i - b_j) the intra-chunk decay mask:
    dq = (M o (dO V^T)) K + exp(b) * (dO S_{n-1}^T)                     -- forward sweep, S recomputed
    dk = (M o (dO V^T))^T Q + exp(b_last - b) * (V D_n^T)                -- reverse sweep
    dv = (M o (Q K^T))^T dO + exp(b_last - b) * (K D_n)
    D_{n-1} = exp(b_last) D_n + sum_{i in chunk} exp(b_i) q_i dO_i^T     (D = state of the reverse sweep)
    d log_decay_s = sum_{t >= s} (q_t . dq_t - k_t . dk_t)
The last identity: g_s enters every pair (i >= s > j), and sum_j P_ij = q_i . dq_i, sum_i P_ij = k_j . dk_j
for P_ij = M_ij (q_i . k_j)(dO_i . v_j). dq and dk are summed over Dv-blocks in torch (deterministic).

The ops are registered and launched as every family's (`launch.py`: triton_ops on CUDA, custom_ops under the
interpreter). Tensors that no kernel can take (CPU without the interpreter) go to the torch backend's
chunked op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import kernels_take, op_set
from .launch import INTERPRET, dot_precision, launch_options, maybe_autotune, register_op, wrap_triton

__all__ = [
    "GENERIC",
    "INTERPRET",
    "LinearAttentionOps",
    "linear_attention",
    "linear_attention_ops",
]


def _tile_sizes(K: int, V: int) -> tuple[int, int, int]:
    """(C, BK, BV): chunk length, padded Dk (a power of two >= 16, kept whole) and the Dv-block.

    Fixed, not autotuned: autotuning C would make the rounding depend on the run, and BV sets how many dq/dk
    partial sums are allocated before launch. C = 16 everywhere. Under the interpreter BV = 16, so that tests
    already cover several Dv-blocks. On GPU BV = 64 (32 for Dk > 64): compiled for sm_90 with ptxas (no GPU
    at hand), C = 32/64 or wider BV spilled registers; these sizes do not spill with tf32 products (16-bit
    inputs, or fp32 where torch allows TF32) at 8 warps, while exact fp32 ("ieee", FMA) products still spill up to
    ~2 KB in the dk/dv kernel.
    """
    BK = max(16, triton.next_power_of_2(K))
    cap = 16 if INTERPRET else (64 if BK <= 64 else 32)
    return 16, BK, min(max(16, triton.next_power_of_2(V)), cap)


_CONFIGS = [
    triton.Config({}, num_warps=4, num_stages=1),
    triton.Config({}, num_warps=4, num_stages=2),
    triton.Config({}, num_warps=8, num_stages=1),
    triton.Config({}, num_warps=8, num_stages=2),
]
_KEY = ["K", "V", "HAS_DECAY", "STRICT", "C", "BK", "BV"]


# ----------------------------------------------------------------------------------------------------------
# Kernels. Grid: (cdiv(Dv, BV), B * H); tensors are contiguous (B*H, T, D); all arithmetic in fp32.
# Loads and the decay mask are written out in each kernel rather than in @triton.jit helpers: the
# interpreter re-patches triton.language on every device-function call, which tripled the test time.
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _fwd_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, o_ptr,
    T, K, V, scale,
    HAS_DECAY: tl.constexpr, STRICT: tl.constexpr, DOT_PREC: tl.constexpr,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    scale = tl.cast(scale, tl.float32)  # torch.compile (Inductor) passes a Python float as fp64
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    # tiles of chunk 0 of this (batch, head); chunk i_c lies i_c * C rows further
    p_q = q_ptr + i_bh * T * K + offs_c[:, None] * K + offs_k[None, :]
    p_k = k_ptr + i_bh * T * K + offs_c[:, None] * K + offs_k[None, :]
    p_v = v_ptr + i_bh * T * V + offs_c[:, None] * V + offs_v[None, :]
    p_o = o_ptr + i_bh * T * V + offs_c[:, None] * V + offs_v[None, :]
    p_g = g_ptr + i_bh * T + offs_c
    # which (i, j) inside a chunk interact: j <= i, or j < i for the strict (exclusive) form
    if STRICT:
        causal = offs_c[:, None] > offs_c[None, :]
    else:
        causal = offs_c[:, None] >= offs_c[None, :]

    S = tl.zeros([BK, BV], dtype=tl.float32)  # sum over earlier chunks of gamma(j -> chunk end) k_j v_j^T
    for i_c in range(0, tl.cdiv(T, C)):
        row0 = i_c * C
        mask_t = row0 + offs_c < T  # the last chunk is padded with zeros
        mask_tk = mask_t[:, None] & mask_k[None, :]
        mask_tv = mask_t[:, None] & mask_v[None, :]
        q = tl.load(p_q + row0 * K, mask=mask_tk, other=0.0).to(tl.float32)
        k = tl.load(p_k + row0 * K, mask=mask_tk, other=0.0).to(tl.float32)
        v = tl.load(p_v + row0 * V, mask=mask_tv, other=0.0).to(tl.float32)
        A = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # (C, C): A_ij = q_i . k_j
        if HAS_DECAY:
            g = tl.load(p_g + row0, mask=mask_t, other=0.0).to(tl.float32)
            b = tl.cumsum(g, axis=0)  # log decay from the chunk start through t
            b_last = tl.sum(g, axis=0)  # the whole chunk's
            # M_ij = exp(b_i - b_j) on causal pairs; masked before exp, where j > i could overflow
            M = tl.exp(tl.where(causal, b[:, None] - b[None, :], float("-inf")))
            o = tl.dot(A * M, v, input_precision=DOT_PREC)
            # earlier chunks reach position i through the state, decayed by exp(b_i)
            o += tl.dot(q * tl.exp(b)[:, None], S, input_precision=DOT_PREC)
            # S_n = exp(b_last) S_{n-1} + sum_j exp(b_last - b_j) k_j v_j^T
            k_w = k * tl.exp(b_last - b)[:, None]
            S = S * tl.exp(b_last) + tl.dot(tl.trans(k_w), v, input_precision=DOT_PREC)
        else:
            o = tl.dot(tl.where(causal, A, 0.0), v, input_precision=DOT_PREC)
            o += tl.dot(q, S, input_precision=DOT_PREC)
            S += tl.dot(tl.trans(k), v, input_precision=DOT_PREC)
        tl.store(p_o + row0 * V, (o * scale).to(o_ptr.dtype.element_ty), mask=mask_tv)


@triton.jit
def _bwd_dq_kernel(
    k_ptr, v_ptr, g_ptr, do_ptr, dq_ptr,
    T, K, V, scale,
    HAS_DECAY: tl.constexpr, STRICT: tl.constexpr, DOT_PREC: tl.constexpr,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Forward sweep: dq_i = sum_j M_ij (dO_i . v_j) k_j + exp(b_i) S_{n-1} dO_i, over this program's
    Dv-block only: dq_ptr is the (NV, B*H, T, K) fp32 buffer of partial sums."""
    scale = tl.cast(scale, tl.float32)  # torch.compile (Inductor) passes a Python float as fp64
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    n_bh = tl.num_programs(1)
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    p_k = k_ptr + i_bh * T * K + offs_c[:, None] * K + offs_k[None, :]
    p_v = v_ptr + i_bh * T * V + offs_c[:, None] * V + offs_v[None, :]
    p_do = do_ptr + i_bh * T * V + offs_c[:, None] * V + offs_v[None, :]
    p_dq = dq_ptr + (i_v * n_bh + i_bh) * T * K + offs_c[:, None] * K + offs_k[None, :]
    p_g = g_ptr + i_bh * T + offs_c
    if STRICT:
        causal = offs_c[:, None] > offs_c[None, :]
    else:
        causal = offs_c[:, None] >= offs_c[None, :]

    S = tl.zeros([BK, BV], dtype=tl.float32)  # the forward state, recomputed
    for i_c in range(0, tl.cdiv(T, C)):
        row0 = i_c * C
        mask_t = row0 + offs_c < T
        mask_tk = mask_t[:, None] & mask_k[None, :]
        mask_tv = mask_t[:, None] & mask_v[None, :]
        k = tl.load(p_k + row0 * K, mask=mask_tk, other=0.0).to(tl.float32)
        v = tl.load(p_v + row0 * V, mask=mask_tv, other=0.0).to(tl.float32)
        do = tl.load(p_do + row0 * V, mask=mask_tv, other=0.0).to(tl.float32) * scale
        dP = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)  # (C, C): dP_ij = dO_i . v_j
        if HAS_DECAY:
            g = tl.load(p_g + row0, mask=mask_t, other=0.0).to(tl.float32)
            b = tl.cumsum(g, axis=0)
            b_last = tl.sum(g, axis=0)
            M = tl.exp(tl.where(causal, b[:, None] - b[None, :], float("-inf")))
            dq = tl.dot(dP * M, k, input_precision=DOT_PREC)
            dq += tl.dot(do, tl.trans(S), input_precision=DOT_PREC) * tl.exp(b)[:, None]
            k_w = k * tl.exp(b_last - b)[:, None]
            S = S * tl.exp(b_last) + tl.dot(tl.trans(k_w), v, input_precision=DOT_PREC)
        else:
            dq = tl.dot(tl.where(causal, dP, 0.0), k, input_precision=DOT_PREC)
            dq += tl.dot(do, tl.trans(S), input_precision=DOT_PREC)
            S += tl.dot(tl.trans(k), v, input_precision=DOT_PREC)
        tl.store(p_dq + row0 * K, dq, mask=mask_tk)


@triton.jit
def _bwd_dkv_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, do_ptr, dk_ptr, dv_ptr,
    T, K, V, scale,
    HAS_DECAY: tl.constexpr, STRICT: tl.constexpr, DOT_PREC: tl.constexpr,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Reverse sweep with D_n = sum_{i after chunk n} exp(log decay from chunk n's end to i) q_i dO_i^T.
    dk is a partial sum over this Dv-block ((NV, B*H, T, K) fp32 buffer); dv is complete (Dk is whole)."""
    scale = tl.cast(scale, tl.float32)  # torch.compile (Inductor) passes a Python float as fp64
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    n_bh = tl.num_programs(1)
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    p_q = q_ptr + i_bh * T * K + offs_c[:, None] * K + offs_k[None, :]
    p_k = k_ptr + i_bh * T * K + offs_c[:, None] * K + offs_k[None, :]
    p_v = v_ptr + i_bh * T * V + offs_c[:, None] * V + offs_v[None, :]
    p_do = do_ptr + i_bh * T * V + offs_c[:, None] * V + offs_v[None, :]
    p_dk = dk_ptr + (i_v * n_bh + i_bh) * T * K + offs_c[:, None] * K + offs_k[None, :]
    p_dv = dv_ptr + i_bh * T * V + offs_c[:, None] * V + offs_v[None, :]
    p_g = g_ptr + i_bh * T + offs_c
    if STRICT:
        causal = offs_c[:, None] > offs_c[None, :]
    else:
        causal = offs_c[:, None] >= offs_c[None, :]

    D = tl.zeros([BK, BV], dtype=tl.float32)
    n_chunks = tl.cdiv(T, C)
    for n in range(0, n_chunks):
        row0 = (n_chunks - 1 - n) * C  # last chunk first
        mask_t = row0 + offs_c < T
        mask_tk = mask_t[:, None] & mask_k[None, :]
        mask_tv = mask_t[:, None] & mask_v[None, :]
        q = tl.load(p_q + row0 * K, mask=mask_tk, other=0.0).to(tl.float32)
        k = tl.load(p_k + row0 * K, mask=mask_tk, other=0.0).to(tl.float32)
        v = tl.load(p_v + row0 * V, mask=mask_tv, other=0.0).to(tl.float32)
        do = tl.load(p_do + row0 * V, mask=mask_tv, other=0.0).to(tl.float32) * scale
        A = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)  # A_ij = q_i . k_j
        dP = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)  # dP_ij = dO_i . v_j
        if HAS_DECAY:
            g = tl.load(p_g + row0, mask=mask_t, other=0.0).to(tl.float32)
            b = tl.cumsum(g, axis=0)
            b_last = tl.sum(g, axis=0)
            M = tl.exp(tl.where(causal, b[:, None] - b[None, :], float("-inf")))
            A = A * M
            dP = dP * M
            # later chunks saw k_j, v_j through the state, decayed by exp(b_last - b_j)
            w_out = tl.exp(b_last - b)[:, None]
            dk = tl.dot(tl.trans(dP), q, input_precision=DOT_PREC)
            dk += tl.dot(v, tl.trans(D), input_precision=DOT_PREC) * w_out
            dv = tl.dot(tl.trans(A), do, input_precision=DOT_PREC)
            dv += tl.dot(k, D, input_precision=DOT_PREC) * w_out
            # D_{n-1} = exp(b_last) D_n + sum_i exp(b_i) q_i dO_i^T
            q_w = q * tl.exp(b)[:, None]
            D = D * tl.exp(b_last) + tl.dot(tl.trans(q_w), do, input_precision=DOT_PREC)
        else:
            A = tl.where(causal, A, 0.0)
            dP = tl.where(causal, dP, 0.0)
            dk = tl.dot(tl.trans(dP), q, input_precision=DOT_PREC)
            dk += tl.dot(v, tl.trans(D), input_precision=DOT_PREC)
            dv = tl.dot(tl.trans(A), do, input_precision=DOT_PREC)
            dv += tl.dot(k, D, input_precision=DOT_PREC)
            D += tl.dot(tl.trans(q), do, input_precision=DOT_PREC)
        tl.store(p_dk + row0 * K, dk, mask=mask_tk)
        tl.store(p_dv + row0 * V, dv, mask=mask_tv)


# ----------------------------------------------------------------------------------------------------------
# The ops: one set per kernel triple, registered under its own name
# ----------------------------------------------------------------------------------------------------------


def _launch_meta(
    K: int, V: int, BH: int, has_decay: bool, strict: bool, dtype: torch.dtype
) -> tuple[dict[str, Any], tuple[int, int]]:
    """Compile-time parameters shared by the three kernels, and their grid (Dv-blocks, batch * heads)."""
    C, BK, BV = _tile_sizes(K, V)
    meta = dict(HAS_DECAY=has_decay, STRICT=strict, DOT_PREC=dot_precision(dtype), C=C, BK=BK, BV=BV)
    return meta | launch_options(num_warps=4), (triton.cdiv(V, BV), BH)


class LinearAttentionOps:
    """The three chunkwise kernels, launched by torch ops registered under one name.

    `GENERIC` below runs the templates themselves (HAS_DECAY and STRICT chosen at launch). The triton code
    generator writes copies with the energy's decay and mask baked in (energydsl/codegen/triton_source.py)
    and builds a set over them with `linear_attention_ops`; `baked` records those values, and a call that
    needs others is refused.
    """

    def __init__(self, name: str, fwd: Any, dq: Any, dkv: Any, baked: dict[str, Any] | None = None):
        self.name = name
        self.baked = dict(baked or {})
        self._fwd, self._dq, self._dkv = (
            maybe_autotune(_CONFIGS, [k for k in _KEY if k in kernel.arg_names])(kernel) for kernel in (fwd, dq, dkv)
        )
        self._bwd_op = register_op(f"{name}_bwd", self._bwd_impl(), _linear_attention_bwd_fake)
        self._fwd_op = register_op(
            f"{name}_fwd",
            self._fwd_impl(),
            _linear_attention_fwd_fake,
            backward=self._backward_op,
            setup_context=_setup_context,
        )

    def _meta(self, K: int, V: int, BH: int, has_decay: bool, strict: bool, dtype: torch.dtype) -> tuple:
        meta, grid = _launch_meta(K, V, BH, has_decay, strict, dtype)
        return {k: v for k, v in meta.items() if k not in self.baked}, grid

    # -- launchers (these bodies are the ops: traceable by torch.compile, kernels behind `wrap_triton`) -----

    def _fwd_impl(self) -> Callable[..., Tensor]:
        def linear_attention_fwd(
            q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor | None, scale: float, strict: bool
        ) -> Tensor:
            """o = scale * sum_{j<=i} gamma_ij (q_i . k_j) v_j; log_decay, if given, is per token (B, H, T)."""
            B, H, T, K = q.shape
            V = v.shape[-1]
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            g = log_decay.contiguous() if log_decay is not None else q  # dummy pointer when HAS_DECAY is off
            o = torch.empty((B, H, T, V), dtype=v.dtype, device=v.device)
            meta, grid = self._meta(K, V, B * H, log_decay is not None, strict, q.dtype)
            wrap_triton(self._fwd)[grid](q, k, v, g, o, T, K, V, scale, **meta)
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
            B, H, T, K = q.shape
            V = v.shape[-1]
            q, k, v, do = q.contiguous(), k.contiguous(), v.contiguous(), do.contiguous()
            g = log_decay.contiguous() if log_decay is not None else q
            meta, grid = self._meta(K, V, B * H, log_decay is not None, strict, q.dtype)
            NV = grid[0]
            # dq and dk are reduced over Dv-blocks: one fp32 slab per block, summed below (no atomics)
            dq_part = torch.empty((NV, B, H, T, K), dtype=torch.float32, device=q.device)
            dk_part = torch.empty((NV, B, H, T, K), dtype=torch.float32, device=q.device)
            dv = torch.empty((B, H, T, V), dtype=torch.float32, device=q.device)
            wrap_triton(self._dq)[grid](k, v, g, do, dq_part, T, K, V, scale, **meta)
            wrap_triton(self._dkv)[grid](q, k, v, g, do, dk_part, dv, T, K, V, scale, **meta)
            dq = dq_part.sum(0)
            dk = dk_part.sum(0)
            if log_decay is not None and need_dg:
                # d g_s = sum_{t >= s} (q_t . dq_t - k_t . dk_t): a reverse cumulative sum over time. g_0 decays
                # nothing (gamma_ij sums g from j+1 on), so d g_0 is exactly 0 rather than a full sum's rounding.
                r = (q.float() * dq).sum(-1) - (k.float() * dk).sum(-1)
                dg = torch.nn.functional.pad(r[..., 1:].flip(-1).cumsum(-1).flip(-1), (1, 0)).to(log_decay.dtype)
            else:
                dg = q.new_empty((0,))
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg

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
        if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
            raise ValueError(
                f"expected q, k (B,H,T,Dk) and v (B,H,T,Dv); got {tuple(q.shape)}, {tuple(k.shape)}, "
                f"{tuple(v.shape)}"
            )
        if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
            raise ValueError("q, k and v must share dtype and device")
        call = dict(HAS_DECAY=log_decay is not None, STRICT=strict)
        wrong = [f"{k}={v}" for k, v in call.items() if k in self.baked and self.baked[k] != v]
        if wrong:
            raise ValueError(f"{self.name} was specialised for {self.baked}; this call needs {', '.join(wrong)}")
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
        return self._fwd_op(q, k, v, log_decay, float(scale), bool(strict))


def _linear_attention_fwd_fake(
    q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor | None, scale: float, strict: bool
) -> Tensor:
    return v.new_empty((*q.shape[:3], v.shape[-1]))


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
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dg


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    q, k, v, log_decay, scale, strict = inputs
    ctx.save_for_backward(q, k, v, log_decay)
    ctx.scale = scale
    ctx.strict = strict


# ----------------------------------------------------------------------------------------------------------
# The generic set and specialised ones
# ----------------------------------------------------------------------------------------------------------

def linear_attention_ops(name: str, fwd: Any, dq: Any, dkv: Any, baked: dict[str, Any]) -> LinearAttentionOps:
    """The op set over a specialised kernel triple, registered once per process under `energydsl::{name}_*`."""
    return op_set(name, lambda: LinearAttentionOps(name, fwd, dq, dkv, baked))


GENERIC = LinearAttentionOps("linear_attention", _fwd_kernel, _bwd_dq_kernel, _bwd_dkv_kernel)
linear_attention = GENERIC.linear_attention
