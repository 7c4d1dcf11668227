"""Fused element-wise Triton epilogues for element-wise energies and optimizer state: ops over the kernels
of `epilogue_kernels.py`.

The big GEMMs of a derived update stay in torch/cuBLAS; what follows them is memory-bound elementwise work
that eager PyTorch would spread over several kernels (and several reads of the same tensors). Each op here
reads its inputs once and writes its outputs once, forward and backward:

* `gated_activation(gate_pre, value, act)` = value * sigma(gate_pre): the update V^T((W h) o sigma(V u)) of
  CEM's gated MLP energy E = -(W h) . phi(V u), phi = integral of sigma, and of NRGPT's feed-forward energies.
  Backward: d value = dy * sigma(x), d gate = dy * value * sigma'(x), one kernel. With value None: sigma(x).
* `momentum_update(x, m, f, beta, eta)`: m_new = beta m + f, x_new = x + eta m_new (heavy ball on the residual
  stream); `nesterov_lookahead(x, m, c)` = x + c m, the point where nag evaluates its force (c = -beta).
  beta, eta and c are scalar tensors that may be learned: their gradients are per-program partial sums
  reduced in torch (deterministic, no atomics), and they are read from device memory (no host sync).

As for attention (`attention.py`), each of the three is an op set over a kernel pair (`_KernelPairOps`:
`GatedActivationOps`, `MomentumOps`, `NesterovOps`). `GENERIC_GATED`, `GENERIC_MOMENTUM` and
`GENERIC_NESTEROV` run the templates themselves (the activation chosen at launch); the triton code generator
writes copies of the templates into each generated module, the activation baked in, and builds sets over
them with `gated_activation_ops`, `momentum_ops` and `nesterov_ops`.

Ops are registered as `torch.ops.energydsl.*` as every family's (`launch.py`: triton_ops on CUDA, opaque
custom_ops under the interpreter).
Tensors that no kernel can take (`kernels_take`: CPU without TRITON_INTERPRET=1, float64) use the references
in `epilogue_ref`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
import triton
from torch import Tensor

from energydsl.kernels import kernels_take, op_set
from energydsl.kernels.epilogue_kernels import (
    _gated_bwd_kernel,
    _gated_fwd_kernel,
    _momentum_bwd_kernel,
    _momentum_fwd_kernel,
    _nesterov_bwd_kernel,
    _nesterov_fwd_kernel,
)
from energydsl.kernels.epilogue_ref import (
    ACTIVATIONS,
    gated_activation_ref,
    momentum_update_ref,
    nesterov_lookahead_ref,
)
from energydsl.kernels.launch import (
    INTERPRET,
    cdiv,
    launch_options,
    maybe_autotune,
    refuse_unbaked,
    register_op,
    wrap_triton,
)

__all__ = [
    "ACTIVATIONS",
    "GENERIC_GATED",
    "GENERIC_MOMENTUM",
    "GENERIC_NESTEROV",
    "INTERPRET",
    "GatedActivationOps",
    "MomentumOps",
    "NesterovOps",
    "gated_activation",
    "gated_activation_ops",
    "momentum_ops",
    "momentum_update",
    "nesterov_lookahead",
    "nesterov_ops",
]

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
    return lambda meta: (cdiv(n, meta["BLOCK"]),)


def _tuned(kernel: Any, configs: list[triton.Config]) -> Any:
    """Autotuned on GPU, per activation where the kernel still takes one (a generated copy has it baked in)."""
    return maybe_autotune(configs, key=[k for k in ("ACT", "HAS_VALUE") if k in kernel.arg_names])(kernel)


def _scalar(s: Tensor | float, like: Tensor, name: str) -> Tensor:
    """A one-element tensor on `like`'s device (a float becomes fp32, or fp64 beside fp64 values: fp32 would
    round a fixed eta = 0.1 by 1.5e-8 there); `.to` keeps it differentiable."""
    dtype = torch.float64 if like.dtype == torch.float64 else torch.float32
    t = s if isinstance(s, Tensor) else torch.tensor(float(s), dtype=dtype)
    if t.numel() != 1:
        raise ValueError(f"{name} must be a scalar (one element); got shape {tuple(t.shape)}")
    return t.to(like.device)


def _same_shape(**tensors: Tensor) -> None:
    if torch._C._get_tracing_state():  # TorchScript tracing: sizes are traced values, checked when run untraced
        return
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"expected tensors of one shape; got {shapes}")
    if len({t.device for t in tensors.values()}) != 1:
        raise ValueError("expected tensors on one device")


# ----------------------------------------------------------------------------------------------------------
# What every set shares: one kernel pair, registered under its own name
# ----------------------------------------------------------------------------------------------------------


class _KernelPairOps:
    """One forward / backward kernel pair as the torch ops `energydsl::{name}_fwd` / `{name}_bwd`.

    The element-wise sets differ only in what a subclass defines: the launchers `_fwd_impl()` / `_bwd_impl()`
    (op bodies: only torch ops and `wrap_triton` launches, as triton_op requires), the fakes `_fwd_fake` /
    `_bwd_fake`, `_setup` and `_backward`; tuning and registration are written once, here. `baked` holds
    what a generated copy's source fixes (e.g. {"ACT": "silu"}); empty for the generic sets.
    """

    _bwd_configs: ClassVar[list[triton.Config]] = _EW_CONFIGS  # _RED_CONFIGS where the backward reduces

    def __init__(self, name: str, fwd: Any, bwd: Any, baked: dict[str, Any] | None = None) -> None:
        self.name = name
        self.baked = dict(baked or {})
        self._fwd, self._bwd = _tuned(fwd, _EW_CONFIGS), _tuned(bwd, self._bwd_configs)
        self._bwd_op = register_op(f"{name}_bwd", self._bwd_impl(), self._bwd_fake)
        self._fwd_op = register_op(
            f"{name}_fwd", self._fwd_impl(), self._fwd_fake, backward=self._backward, setup_context=self._setup
        )


def _partials(n: int, like: Tensor) -> Tensor:
    """A scalar's gradient over n elements, as fp32 partial sums: one per _RED_BLOCK-element program."""
    return torch.empty(cdiv(n, _RED_BLOCK), dtype=torch.float32, device=like.device)


def _reduced(partials: Tensor, scalar: Tensor) -> Tensor:
    """A scalar's gradient from the per-program partial sums: reduced in torch (deterministic, no atomics)."""
    return partials.sum().reshape(scalar.shape).to(scalar.dtype)


# ----------------------------------------------------------------------------------------------------------
# Gated activation
# ----------------------------------------------------------------------------------------------------------


class GatedActivationOps(_KernelPairOps):
    """value * sigma(gate_pre) (or sigma(gate_pre) alone) on one forward / backward kernel pair, as torch ops
    registered under one name.

    `baked` holds what the kernels' source fixes: {"ACT": "silu", "HAS_VALUE": True} for a generated module's
    copy, whose `_act_and_grad` computes that activation only. A call with another activation, or with a
    value where none was baked, is refused rather than silently computing the baked one. A generated copy's
    activation may be any function printed from the energy (`ACT` then names it); `reference` is that
    function in torch, for the tensors no kernel takes (float64).
    """

    def __init__(self, name: str, fwd: Any, bwd: Any, baked: dict[str, Any] | None = None,
                 reference: Callable[[Tensor], Tensor] | None = None) -> None:
        super().__init__(name, fwd, bwd, baked)
        self.reference = reference

    def _meta(self, activation: str, has_value: bool) -> dict[str, Any]:
        """Launch meta-parameters: what is not baked in, the block under the interpreter."""
        taken = {k: v for k, v in dict(ACT=activation, HAS_VALUE=has_value).items() if k not in self.baked}
        return taken | launch_options(BLOCK=_INTERPRET_BLOCK)

    def _fwd_impl(self) -> Callable[[Tensor, Tensor | None, str], Tensor]:
        def gated_activation_fwd(gate_pre: Tensor, value: Tensor | None, activation: str) -> Tensor:
            gate_pre = gate_pre.contiguous()
            value = None if value is None else value.contiguous()
            out = torch.empty(gate_pre.shape, dtype=_out_dtype(gate_pre, value), device=gate_pre.device)
            n = out.numel()
            wrap_triton(self._fwd)[_ew_grid(n)](
                gate_pre, gate_pre if value is None else value, out, n, **self._meta(activation, value is not None)
            )
            return out

        return gated_activation_fwd

    def _bwd_impl(self) -> Callable[[Tensor, Tensor, Tensor | None, str], list[Tensor]]:
        def gated_activation_bwd(dout: Tensor, gate_pre: Tensor, value: Tensor | None, activation: str) -> list[Tensor]:
            """[d gate, d value], or [d gate] with no value (an op returns no optional tensor)."""
            dout, gate_pre = dout.contiguous(), gate_pre.contiguous()
            value = None if value is None else value.contiguous()
            dgate = torch.empty_like(gate_pre)
            dvalue = None if value is None else torch.empty_like(value)
            n = dout.numel()
            wrap_triton(self._bwd)[_ew_grid(n)](
                gate_pre, gate_pre if value is None else value, dout, dgate, dgate if dvalue is None else dvalue,
                n, **self._meta(activation, value is not None)
            )
            return [dgate] if dvalue is None else [dgate, dvalue]

        return gated_activation_bwd

    @staticmethod
    def _fwd_fake(gate_pre: Tensor, value: Tensor | None, activation: str) -> Tensor:
        return gate_pre.new_empty(gate_pre.shape, dtype=_out_dtype(gate_pre, value))

    @staticmethod
    def _bwd_fake(dout: Tensor, gate_pre: Tensor, value: Tensor | None, activation: str) -> list[Tensor]:
        return [t.new_empty(t.shape) for t in (gate_pre, value) if t is not None]

    @staticmethod
    def _setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        gate_pre, value, activation = inputs
        ctx.save_for_backward(gate_pre, value)
        ctx.activation = activation

    def _backward(self, ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        gate_pre, value = ctx.saved_tensors
        dgate, *dvalue = self._bwd_op(dout, gate_pre, value, ctx.activation)
        return dgate, (dvalue or [None])[0], None

    def gated_activation(self, gate_pre: Tensor, value: Tensor | None, activation: str = "silu") -> Tensor:
        """value * sigma(gate_pre), sigma in `ACTIVATIONS` (gelu: the exact erf form), or the function this copy
        was generated for; sigma(gate_pre) alone with value None. Backward fused too.

        Same shapes required (no broadcasting: the op is a pure epilogue to the surrounding GEMMs); the result
        has the promoted dtype, arithmetic is fp32.
        """
        if self.reference is None and activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; expected one of {ACTIVATIONS}")
        refuse_unbaked(self.name, self.baked, dict(ACT=activation, HAS_VALUE=value is not None))
        if value is not None:
            _same_shape(gate_pre=gate_pre, value=value)
        if not kernels_take(gate_pre):
            if self.reference is None:
                return gated_activation_ref(gate_pre, value, activation)
            y = self.reference(gate_pre)
            return y if value is None else value * y
        return self._fwd_op(gate_pre, value, activation)


def _out_dtype(gate_pre: Tensor, value: Tensor | None) -> torch.dtype:
    return gate_pre.dtype if value is None else torch.promote_types(gate_pre.dtype, value.dtype)


# ----------------------------------------------------------------------------------------------------------
# Momentum
# ----------------------------------------------------------------------------------------------------------


class MomentumOps(_KernelPairOps):
    """The heavy-ball step on one forward / backward kernel pair, as torch ops registered under one name.

    The kernels have no switch an energy fixes, so `baked` is empty; it is kept so that every family's sets
    are built alike (see `momentum_ops`).
    """

    _bwd_configs = _RED_CONFIGS

    def _fwd_impl(self) -> Callable[..., tuple[Tensor, Tensor]]:
        def momentum_update_fwd(x: Tensor, m: Tensor, f: Tensor, beta: Tensor, eta: Tensor) -> tuple[Tensor, Tensor]:
            x, m, f = x.contiguous(), m.contiguous(), f.contiguous()
            x_new, m_new = torch.empty_like(x), torch.empty_like(m)
            n = x.numel()
            wrap_triton(self._fwd)[_ew_grid(n)](
                x, m, f, beta, eta, x_new, m_new, n, **launch_options(BLOCK=_INTERPRET_BLOCK)
            )
            return x_new, m_new

        return momentum_update_fwd

    def _bwd_impl(self) -> Callable[..., tuple[Tensor, Tensor, Tensor, Tensor]]:
        def momentum_update_bwd(
            gx: Tensor, gm: Tensor, m: Tensor, f: Tensor, beta: Tensor, eta: Tensor
        ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
            """(dm, df, d beta, d eta); dx is gx itself."""
            gx, gm, m, f = gx.contiguous(), gm.contiguous(), m.contiguous(), f.contiguous()
            n = m.numel()
            dm, df = torch.empty_like(m), torch.empty_like(f)
            pbeta, peta = _partials(n, m), _partials(n, m)
            grid = (pbeta.numel(),)
            wrap_triton(self._bwd)[grid](gx, gm, m, f, beta, eta, dm, df, pbeta, peta, n, BLOCK=_RED_BLOCK)
            return dm, df, _reduced(pbeta, beta), _reduced(peta, eta)

        return momentum_update_bwd

    @staticmethod
    def _fwd_fake(x: Tensor, m: Tensor, f: Tensor, beta: Tensor, eta: Tensor) -> tuple[Tensor, Tensor]:
        return x.new_empty(x.shape), m.new_empty(m.shape)

    @staticmethod
    def _bwd_fake(
        gx: Tensor, gm: Tensor, m: Tensor, f: Tensor, beta: Tensor, eta: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return m.new_empty(m.shape), f.new_empty(f.shape), beta.new_empty(beta.shape), eta.new_empty(eta.shape)

    @staticmethod
    def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        x, m, f, beta, eta = inputs
        ctx.save_for_backward(m, f, beta, eta)

    def _backward(self, ctx: Any, gx: Tensor | None, gm: Tensor | None) -> tuple[Tensor | None, ...]:
        m, f, beta, eta = ctx.saved_tensors
        gx = torch.zeros_like(m) if gx is None else gx
        gm = torch.zeros_like(m) if gm is None else gm
        dm, df, dbeta, deta = self._bwd_op(gx, gm, m, f, beta, eta)
        return gx, dm, df, dbeta, deta

    def momentum_update(
        self, x: Tensor, m: Tensor, f: Tensor, beta: Tensor | float, eta: Tensor | float
    ) -> tuple[Tensor, Tensor]:
        """Heavy-ball residual update (x_new, m_new) = (x + eta m_new, beta m + f), one pass over x, m, f.

        beta, eta: one-element tensors (differentiable, e.g. learned step sizes) or floats.
        """
        _same_shape(x=x, m=m, f=f)
        beta, eta = _scalar(beta, x, "beta"), _scalar(eta, x, "eta")
        if not kernels_take(x):
            return momentum_update_ref(x, m, f, beta.reshape(()), eta.reshape(()))
        return self._fwd_op(x, m, f, beta, eta)


# ----------------------------------------------------------------------------------------------------------
# Nesterov look-ahead
# ----------------------------------------------------------------------------------------------------------


class NesterovOps(_KernelPairOps):
    """The look-ahead point x + c m on one forward / backward kernel pair, as torch ops registered under one
    name (nag evaluates its force there; c is -beta, possibly learned). Nothing to bake, as for momentum."""

    _bwd_configs = _RED_CONFIGS

    def _fwd_impl(self) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
        def nesterov_lookahead_fwd(x: Tensor, m: Tensor, c: Tensor) -> Tensor:
            x, m = x.contiguous(), m.contiguous()
            out = torch.empty_like(x)
            n = x.numel()
            wrap_triton(self._fwd)[_ew_grid(n)](x, m, c, out, n, **launch_options(BLOCK=_INTERPRET_BLOCK))
            return out

        return nesterov_lookahead_fwd

    def _bwd_impl(self) -> Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]:
        def nesterov_lookahead_bwd(g: Tensor, m: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
            """(dm, dc); dx is g itself."""
            g, m = g.contiguous(), m.contiguous()
            n = m.numel()
            dm = torch.empty_like(m)
            pc = _partials(n, m)
            wrap_triton(self._bwd)[(pc.numel(),)](g, m, c, dm, pc, n, BLOCK=_RED_BLOCK)
            return dm, _reduced(pc, c)

        return nesterov_lookahead_bwd

    @staticmethod
    def _fwd_fake(x: Tensor, m: Tensor, c: Tensor) -> Tensor:
        return x.new_empty(x.shape)

    @staticmethod
    def _bwd_fake(g: Tensor, m: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
        return m.new_empty(m.shape), c.new_empty(c.shape)

    @staticmethod
    def _setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        x, m, c = inputs
        ctx.save_for_backward(m, c)

    def _backward(self, ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        m, c = ctx.saved_tensors
        dm, dc = self._bwd_op(g, m, c)
        return g, dm, dc

    def nesterov_lookahead(self, x: Tensor, m: Tensor, c: Tensor | float) -> Tensor:
        """The look-ahead point x + c m (where nag evaluates the next force), one pass over x and m.

        c: a one-element tensor (differentiable, e.g. -beta with beta learned) or a float.
        """
        _same_shape(x=x, m=m)
        c = _scalar(c, x, "c")
        if not kernels_take(x):
            return nesterov_lookahead_ref(x, m, c.reshape(()))
        return self._fwd_op(x, m, c)


# ----------------------------------------------------------------------------------------------------------
# The generic sets (the templates, the activation chosen at launch) and specialised ones
# ----------------------------------------------------------------------------------------------------------

def gated_activation_ops(name: str, fwd: Any, bwd: Any, baked: dict[str, Any], *,
                         reference: Callable[[Tensor], Tensor] | None = None) -> GatedActivationOps:
    """The op set over a specialised kernel pair, registered once per process (`op_set`); `reference`: the
    activation in torch, where the copy's is printed from the energy."""
    return op_set(name, lambda: GatedActivationOps(name, fwd, bwd, baked, reference))


def momentum_ops(name: str, fwd: Any, bwd: Any, baked: dict[str, Any]) -> MomentumOps:
    """The op set over a kernel pair copied into a generated module, registered once per process under
    `energydsl::{name}_*`."""
    return op_set(name, lambda: MomentumOps(name, fwd, bwd, baked))


def nesterov_ops(name: str, fwd: Any, bwd: Any, baked: dict[str, Any]) -> NesterovOps:
    """The look-ahead's op set over a kernel pair copied into a generated module, registered once per
    process under `energydsl::{name}_*`."""
    return op_set(name, lambda: NesterovOps(name, fwd, bwd, baked))


GENERIC_GATED = GatedActivationOps("gated_activation", _gated_fwd_kernel, _gated_bwd_kernel)
GENERIC_MOMENTUM = MomentumOps("momentum_update", _momentum_fwd_kernel, _momentum_bwd_kernel)
GENERIC_NESTEROV = NesterovOps("nesterov_lookahead", _nesterov_fwd_kernel, _nesterov_bwd_kernel)
gated_activation = GENERIC_GATED.gated_activation
momentum_update = GENERIC_MOMENTUM.momentum_update
nesterov_lookahead = GENERIC_NESTEROV.nesterov_lookahead
