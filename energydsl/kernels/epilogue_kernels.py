"""The Triton kernels of the element-wise epilogues (`epilogue.py` launches them): templates.

* `_gated_fwd_kernel` / `_gated_bwd_kernel`: out = value * sigma(gate); d value = dout * sigma(gate),
  d gate = dout * value * sigma'(gate), with sigma and sigma' from `_act_and_grad`. HAS_VALUE=False: no
  value, out = sigma(gate) (a function of one tensor, such as NRGPT's gelu(x) gelu'(x), in one pass).
* `_momentum_fwd_kernel` / `_momentum_bwd_kernel`: m_new = beta m + f, x_new = x + eta m_new, and its
  gradients (those of beta and eta as per-program partial sums, reduced in torch: no atomics).
* `_nesterov_fwd_kernel` / `_nesterov_bwd_kernel`: the look-ahead x + c m (c = -beta for nag) and its
  gradients (that of c as per-program partial sums, likewise).

The triton code generator copies these kernels into generated modules (energydsl/codegen/triton_source.py,
families "gated", "momentum" and "nesterov"), the gated ones with the energy's own activation: there
`_act_and_grad` is replaced by sigma and sigma' printed from the energy (energydsl/codegen/gated_epilogue.py),
any element-wise function of the gate, not only the named activations the if/elif chain here computes for
direct callers (`ACT` is a `tl.constexpr`, so the chain folds to one formula). Hence the kernels here carry
only `@triton.jit`: autotuning is added where an op set is built.

Every kernel: a 1-D grid of BLOCK-element programs over contiguous tensors, fp32 arithmetic, outputs cast
to their tensor's dtype, the last program masked; beta, eta and c are read from device memory (no host sync).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _act_and_grad(x, ACT: tl.constexpr):
    """(sigma(x), sigma'(x)); the derivative is dead code (and removed) where only sigma is used."""
    if ACT == "silu":
        s = tl.sigmoid(x)
        y = x * s
        dy = s * (1.0 + x * (1.0 - s))
    elif ACT == "gelu":
        # erf form: x Phi(x), Phi the normal cdf; sigma' = Phi(x) + x phi(x), phi the normal density
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        y = x * cdf
        dy = cdf + x * tl.exp(-0.5 * x * x) * 0.3989422804014327
    elif ACT == "sigmoid":
        y = tl.sigmoid(x)
        dy = y * (1.0 - y)
    elif ACT == "relu":
        y = tl.maximum(x, 0.0)
        dy = tl.where(x > 0.0, 1.0, 0.0)
    elif ACT == "tanh":
        # tanh = 2 sigmoid(2x) - 1 (no tanh in tl.math); saturates correctly at +-1
        y = 2.0 * tl.sigmoid(2.0 * x) - 1.0
        dy = 1.0 - y * y
    else:  # identity
        y = x
        dy = tl.full(x.shape, 1.0, tl.float32)
    return y, dy


@triton.jit
def _gated_fwd_kernel(
    gate_ptr, value_ptr, out_ptr, N, ACT: tl.constexpr, HAS_VALUE: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y, _ = _act_and_grad(x, ACT)
    if HAS_VALUE:
        y = y * tl.load(value_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_bwd_kernel(
    gate_ptr, value_ptr, dout_ptr, dgate_ptr, dvalue_ptr, N, ACT: tl.constexpr, HAS_VALUE: tl.constexpr,
    BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dout = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y, dy = _act_and_grad(x, ACT)
    if HAS_VALUE:
        v = tl.load(value_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dvalue_ptr + offs, (dout * y).to(dvalue_ptr.dtype.element_ty), mask=mask)
        dy = dy * v
    tl.store(dgate_ptr + offs, (dout * dy).to(dgate_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _momentum_fwd_kernel(
    x_ptr, m_ptr, f_ptr, beta_ptr, eta_ptr, x_out_ptr, m_out_ptr, N, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    beta = tl.load(beta_ptr).to(tl.float32)
    eta = tl.load(eta_ptr).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    f = tl.load(f_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m_new = beta * m + f
    tl.store(m_out_ptr + offs, m_new.to(m_out_ptr.dtype.element_ty), mask=mask)
    tl.store(x_out_ptr + offs, (x + eta * m_new).to(x_out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _momentum_bwd_kernel(
    gx_ptr,
    gm_ptr,
    m_ptr,
    f_ptr,
    beta_ptr,
    eta_ptr,
    dm_ptr,
    df_ptr,
    pbeta_ptr,
    peta_ptr,
    N,
    BLOCK: tl.constexpr,
):
    """gx, gm: gradients of x_new, m_new. m_new feeds x_new, so its total gradient is gm + eta gx; then
    dm = beta (gm + eta gx), df = gm + eta gx, d beta = sum (gm + eta gx) m, d eta = sum gx m_new."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    beta = tl.load(beta_ptr).to(tl.float32)
    eta = tl.load(eta_ptr).to(tl.float32)
    gx = tl.load(gx_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    gm = tl.load(gm_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    f = tl.load(f_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g_mnew = gm + eta * gx
    tl.store(df_ptr + offs, g_mnew.to(df_ptr.dtype.element_ty), mask=mask)
    tl.store(dm_ptr + offs, (beta * g_mnew).to(dm_ptr.dtype.element_ty), mask=mask)
    tl.store(pbeta_ptr + pid, tl.sum(g_mnew * m, axis=0))
    tl.store(peta_ptr + pid, tl.sum(gx * (beta * m + f), axis=0))  # m_new recomputed, not saved


@triton.jit
def _nesterov_fwd_kernel(x_ptr, m_ptr, c_ptr, out_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    c = tl.load(c_ptr).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x + c * m).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _nesterov_bwd_kernel(g_ptr, m_ptr, c_ptr, dm_ptr, pc_ptr, N, BLOCK: tl.constexpr):
    """dm = c g, d c = sum g m (dx = g needs no kernel)."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    c = tl.load(c_ptr).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dm_ptr + offs, (c * g).to(dm_ptr.dtype.element_ty), mask=mask)
    tl.store(pc_ptr + pid, tl.sum(g * m, axis=0))
