"""Fused elementwise Triton epilogues for element-wise energies and optimizer state.

The big GEMMs of a derived update stay in torch/cuBLAS; what follows them is memory-bound elementwise work
that eager PyTorch would spread over several kernels (and several reads of the same tensors). Each op here
reads its inputs once and writes its outputs once, forward and backward:

* `gated_activation(gate_pre, value, act)` = value * sigma(gate_pre): the update V^T((W h) o sigma(V u)) of
  CEM's gated MLP energy E = -(W h) . phi(V u), phi = integral of sigma, and of NRGPT's feed-forward energies.
  Backward: d value = dy * sigma(x), d gate = dy * value * sigma'(x), one kernel.
* `momentum_update(x, m, f, beta, eta)`: m_new = beta m + f, x_new = x + eta m_new (heavy ball on the residual
  stream); `nesterov_lookahead(x, m, beta)` = x + beta m. beta and eta are scalar tensors that may be learned:
  their gradients are per-program partial sums reduced in torch (deterministic, no atomics), and they are read
  from device memory (no host sync).

Ops are registered as `torch.ops.energydsl.*` exactly as in `energydsl.kernels.linear` (see `OPS_BACKEND`
there: triton_op on GPU, opaque custom_op under the interpreter, plain autograd.Function on old torch).
Tensors that no kernel can take (CPU without TRITON_INTERPRET=1) use the references in `epilogue_ref`.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from energydsl.kernels import linear as _linear
from energydsl.kernels.epilogue_ref import (
    ACTIVATIONS,
    gated_activation_ref,
    momentum_update_ref,
    nesterov_lookahead_ref,
)
from energydsl.kernels.linear import INTERPRET, launch_options, maybe_autotune, register_op, wrap_triton

__all__ = ["ACTIVATIONS", "OPS_BACKEND", "gated_activation", "momentum_update", "nesterov_lookahead"]

OPS_BACKEND: str = _linear.OPS_BACKEND

# Elementwise kernels tune BLOCK; the ones that also reduce (scalar gradients) keep BLOCK fixed, since it sets
# the number of partial sums allocated before launch.
_EW_CONFIGS = [
    triton.Config({"BLOCK": 1024}, num_warps=4),
    triton.Config({"BLOCK": 2048}, num_warps=8),
    triton.Config({"BLOCK": 4096}, num_warps=8),
]
_RED_CONFIGS = [triton.Config({}, num_warps=4), triton.Config({}, num_warps=8)]
_RED_BLOCK = 256 if INTERPRET else 4096
# interpreter blocks: small, so tests of a few hundred elements cover several programs and a masked tail
_INTERPRET_BLOCK = 256


def _ew_grid(n: int) -> Any:
    return lambda meta: (triton.cdiv(n, meta["BLOCK"]),)


# ----------------------------------------------------------------------------------------------------------
# Activations: sigma and sigma' in fp32, selected at compile time
# ----------------------------------------------------------------------------------------------------------


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


@maybe_autotune(_EW_CONFIGS, key=["ACT"])
@triton.jit
def _gated_fwd_kernel(gate_ptr, value_ptr, out_ptr, N, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(value_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y, _ = _act_and_grad(x, ACT)
    tl.store(out_ptr + offs, (v * y).to(out_ptr.dtype.element_ty), mask=mask)


@maybe_autotune(_EW_CONFIGS, key=["ACT"])
@triton.jit
def _gated_bwd_kernel(
    gate_ptr, value_ptr, dout_ptr, dgate_ptr, dvalue_ptr, N, ACT: tl.constexpr, BLOCK: tl.constexpr
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(gate_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(value_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dout = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y, dy = _act_and_grad(x, ACT)
    tl.store(dvalue_ptr + offs, (dout * y).to(dvalue_ptr.dtype.element_ty), mask=mask)
    tl.store(dgate_ptr + offs, (dout * v * dy).to(dgate_ptr.dtype.element_ty), mask=mask)


@maybe_autotune(_EW_CONFIGS, key=[])
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


@maybe_autotune(_RED_CONFIGS, key=[])
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


@maybe_autotune(_EW_CONFIGS, key=[])
@triton.jit
def _nesterov_fwd_kernel(x_ptr, m_ptr, beta_ptr, out_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    beta = tl.load(beta_ptr).to(tl.float32)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x + beta * m).to(out_ptr.dtype.element_ty), mask=mask)


@maybe_autotune(_RED_CONFIGS, key=[])
@triton.jit
def _nesterov_bwd_kernel(g_ptr, m_ptr, beta_ptr, dm_ptr, pbeta_ptr, N, BLOCK: tl.constexpr):
    """dm = beta g, d beta = sum g m (dx = g needs no kernel)."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    beta = tl.load(beta_ptr).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dm_ptr + offs, (beta * g).to(dm_ptr.dtype.element_ty), mask=mask)
    tl.store(pbeta_ptr + pid, tl.sum(g * m, axis=0))


# ----------------------------------------------------------------------------------------------------------
# Launchers (op bodies) and their fake (shape-only) versions
# ----------------------------------------------------------------------------------------------------------


def _gated_fwd(gate_pre: Tensor, value: Tensor, activation: str) -> Tensor:
    gate_pre, value = gate_pre.contiguous(), value.contiguous()
    out = torch.empty(
        value.shape, dtype=torch.promote_types(gate_pre.dtype, value.dtype), device=value.device
    )
    n = out.numel()
    wrap_triton(_gated_fwd_kernel)[_ew_grid(n)](
        gate_pre, value, out, n, ACT=activation, **launch_options(BLOCK=_INTERPRET_BLOCK)
    )
    return out


def _gated_fwd_fake(gate_pre: Tensor, value: Tensor, activation: str) -> Tensor:
    return value.new_empty(value.shape, dtype=torch.promote_types(gate_pre.dtype, value.dtype))


def _gated_bwd(dout: Tensor, gate_pre: Tensor, value: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    dout, gate_pre, value = dout.contiguous(), gate_pre.contiguous(), value.contiguous()
    dgate = torch.empty_like(gate_pre)
    dvalue = torch.empty_like(value)
    n = dout.numel()
    wrap_triton(_gated_bwd_kernel)[_ew_grid(n)](
        gate_pre, value, dout, dgate, dvalue, n, ACT=activation, **launch_options(BLOCK=_INTERPRET_BLOCK)
    )
    return dgate, dvalue


def _gated_bwd_fake(dout: Tensor, gate_pre: Tensor, value: Tensor, activation: str) -> tuple[Tensor, Tensor]:
    return gate_pre.new_empty(gate_pre.shape), value.new_empty(value.shape)


def _gated_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    gate_pre, value, activation = inputs
    ctx.save_for_backward(gate_pre, value)
    ctx.activation = activation


def _gated_backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
    gate_pre, value = ctx.saved_tensors
    bwd = _gated_bwd if OPS_BACKEND == "function" else torch.ops.energydsl.gated_activation_bwd
    dgate, dvalue = bwd(dout, gate_pre, value, ctx.activation)
    return dgate, dvalue, None


def _momentum_fwd(x: Tensor, m: Tensor, f: Tensor, beta: Tensor, eta: Tensor) -> tuple[Tensor, Tensor]:
    x, m, f = x.contiguous(), m.contiguous(), f.contiguous()
    x_new, m_new = torch.empty_like(x), torch.empty_like(m)
    n = x.numel()
    wrap_triton(_momentum_fwd_kernel)[_ew_grid(n)](
        x, m, f, beta, eta, x_new, m_new, n, **launch_options(BLOCK=_INTERPRET_BLOCK)
    )
    return x_new, m_new


def _momentum_fwd_fake(x: Tensor, m: Tensor, f: Tensor, beta: Tensor, eta: Tensor) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), m.new_empty(m.shape)


def _momentum_bwd(
    gx: Tensor, gm: Tensor, m: Tensor, f: Tensor, beta: Tensor, eta: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dm, df, d beta, d eta); dx is gx itself."""
    gx, gm, m, f = gx.contiguous(), gm.contiguous(), m.contiguous(), f.contiguous()
    n = m.numel()
    n_prog = triton.cdiv(n, _RED_BLOCK)
    dm, df = torch.empty_like(m), torch.empty_like(f)
    pbeta = torch.empty(n_prog, dtype=torch.float32, device=m.device)
    peta = torch.empty(n_prog, dtype=torch.float32, device=m.device)
    wrap_triton(_momentum_bwd_kernel)[(n_prog,)](
        gx, gm, m, f, beta, eta, dm, df, pbeta, peta, n, BLOCK=_RED_BLOCK
    )
    dbeta = pbeta.sum().reshape(beta.shape).to(beta.dtype)
    deta = peta.sum().reshape(eta.shape).to(eta.dtype)
    return dm, df, dbeta, deta


def _momentum_bwd_fake(
    gx: Tensor, gm: Tensor, m: Tensor, f: Tensor, beta: Tensor, eta: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return m.new_empty(m.shape), f.new_empty(f.shape), beta.new_empty(beta.shape), eta.new_empty(eta.shape)


def _momentum_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    x, m, f, beta, eta = inputs
    ctx.save_for_backward(m, f, beta, eta)


def _momentum_backward(ctx: Any, gx: Tensor | None, gm: Tensor | None) -> tuple[Tensor | None, ...]:
    m, f, beta, eta = ctx.saved_tensors
    gx = torch.zeros_like(m) if gx is None else gx
    gm = torch.zeros_like(m) if gm is None else gm
    bwd = _momentum_bwd if OPS_BACKEND == "function" else torch.ops.energydsl.momentum_update_bwd
    dm, df, dbeta, deta = bwd(gx, gm, m, f, beta, eta)
    return gx, dm, df, dbeta, deta


def _nesterov_fwd(x: Tensor, m: Tensor, beta: Tensor) -> Tensor:
    x, m = x.contiguous(), m.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    wrap_triton(_nesterov_fwd_kernel)[_ew_grid(n)](
        x, m, beta, out, n, **launch_options(BLOCK=_INTERPRET_BLOCK)
    )
    return out


def _nesterov_fwd_fake(x: Tensor, m: Tensor, beta: Tensor) -> Tensor:
    return x.new_empty(x.shape)


def _nesterov_bwd(g: Tensor, m: Tensor, beta: Tensor) -> tuple[Tensor, Tensor]:
    """(dm, d beta); dx is g itself."""
    g, m = g.contiguous(), m.contiguous()
    n = m.numel()
    n_prog = triton.cdiv(n, _RED_BLOCK)
    dm = torch.empty_like(m)
    pbeta = torch.empty(n_prog, dtype=torch.float32, device=m.device)
    wrap_triton(_nesterov_bwd_kernel)[(n_prog,)](g, m, beta, dm, pbeta, n, BLOCK=_RED_BLOCK)
    return dm, pbeta.sum().reshape(beta.shape).to(beta.dtype)


def _nesterov_bwd_fake(g: Tensor, m: Tensor, beta: Tensor) -> tuple[Tensor, Tensor]:
    return m.new_empty(m.shape), beta.new_empty(beta.shape)


def _nesterov_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    x, m, beta = inputs
    ctx.save_for_backward(m, beta)


def _nesterov_backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
    m, beta = ctx.saved_tensors
    bwd = _nesterov_bwd if OPS_BACKEND == "function" else torch.ops.energydsl.nesterov_lookahead_bwd
    dm, dbeta = bwd(g, m, beta)
    return g, dm, dbeta


register_op("gated_activation_bwd", _gated_bwd, _gated_bwd_fake)
register_op(
    "gated_activation", _gated_fwd, _gated_fwd_fake, backward=_gated_backward, setup_context=_gated_setup
)
register_op("momentum_update_bwd", _momentum_bwd, _momentum_bwd_fake)
register_op(
    "momentum_update",
    _momentum_fwd,
    _momentum_fwd_fake,
    backward=_momentum_backward,
    setup_context=_momentum_setup,
)
register_op("nesterov_lookahead_bwd", _nesterov_bwd, _nesterov_bwd_fake)
register_op(
    "nesterov_lookahead",
    _nesterov_fwd,
    _nesterov_fwd_fake,
    backward=_nesterov_backward,
    setup_context=_nesterov_setup,
)


class _GatedActivationFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate_pre: Tensor, value: Tensor, activation: str) -> Tensor:
        out = _gated_fwd(gate_pre, value, activation)
        _gated_setup(ctx, (gate_pre, value, activation), out)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        return _gated_backward(ctx, dout)


class _MomentumUpdateFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: Tensor, m: Tensor, f: Tensor, beta: Tensor, eta: Tensor
    ) -> tuple[Tensor, Tensor]:
        out = _momentum_fwd(x, m, f, beta, eta)
        _momentum_setup(ctx, (x, m, f, beta, eta), out)
        return out

    @staticmethod
    def backward(ctx: Any, gx: Tensor | None, gm: Tensor | None) -> tuple[Tensor | None, ...]:
        return _momentum_backward(ctx, gx, gm)


class _NesterovLookaheadFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, m: Tensor, beta: Tensor) -> Tensor:
        out = _nesterov_fwd(x, m, beta)
        _nesterov_setup(ctx, (x, m, beta), out)
        return out

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        return _nesterov_backward(ctx, g)


# ----------------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------------


def _on_kernel_device(t: Tensor) -> bool:
    return INTERPRET or t.is_cuda


def _scalar(s: Tensor | float, like: Tensor, name: str) -> Tensor:
    """A one-element tensor on `like`'s device (a float becomes fp32); `.to` keeps it differentiable."""
    t = s if isinstance(s, Tensor) else torch.tensor(float(s), dtype=torch.float32)
    if t.numel() != 1:
        raise ValueError(f"{name} must be a scalar (one element); got shape {tuple(t.shape)}")
    return t.to(like.device)


def _same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"expected tensors of one shape; got {shapes}")
    if len({t.device for t in tensors.values()}) != 1:
        raise ValueError("expected tensors on one device")


def gated_activation(gate_pre: Tensor, value: Tensor, activation: str = "silu") -> Tensor:
    """value * sigma(gate_pre), sigma in `ACTIVATIONS` (gelu: the exact erf form); backward fused too.

    Same shapes required (no broadcasting: the op is a pure epilogue to the surrounding GEMMs); the result has
    the promoted dtype, arithmetic is fp32.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")
    _same_shape(gate_pre=gate_pre, value=value)
    if not _on_kernel_device(value):
        return gated_activation_ref(gate_pre, value, activation)
    if OPS_BACKEND == "function":
        return _GatedActivationFunction.apply(gate_pre, value, activation)
    return torch.ops.energydsl.gated_activation(gate_pre, value, activation)


def momentum_update(
    x: Tensor, m: Tensor, f: Tensor, beta: Tensor | float, eta: Tensor | float
) -> tuple[Tensor, Tensor]:
    """Heavy-ball residual update (x_new, m_new) = (x + eta m_new, beta m + f), one pass over x, m, f.

    beta, eta: one-element tensors (differentiable, e.g. learned step sizes) or floats.
    """
    _same_shape(x=x, m=m, f=f)
    beta, eta = _scalar(beta, x, "beta"), _scalar(eta, x, "eta")
    if not _on_kernel_device(x):
        return momentum_update_ref(x, m, f, beta.reshape(()), eta.reshape(()))
    if OPS_BACKEND == "function":
        return _MomentumUpdateFunction.apply(x, m, f, beta, eta)
    return torch.ops.energydsl.momentum_update(x, m, f, beta, eta)


def nesterov_lookahead(x: Tensor, m: Tensor, beta: Tensor | float) -> Tensor:
    """The Nesterov look-ahead point x + beta m (where the next force is evaluated)."""
    _same_shape(x=x, m=m)
    beta = _scalar(beta, x, "beta")
    if not _on_kernel_device(x):
        return nesterov_lookahead_ref(x, m, beta.reshape(()))
    if OPS_BACKEND == "function":
        return _NesterovLookaheadFunction.apply(x, m, beta)
    return torch.ops.energydsl.nesterov_lookahead(x, m, beta)
