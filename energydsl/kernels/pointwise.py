"""The pointwise-weight family's torch ops over its Triton kernels (`pointwise_kernels.py`): launch, autograd.

    o_i = sum_j w(scale q_i . k_j + row_bias_i + key_bias_j - slope_h |i - j| + [i = j] self_h) v_j
                                                                        over j <= i (j < i if strict)

with w an element-wise weight (sigmoid, a power of relu, exp, ...) and no normalisation over j. The weight and
its derivative are `@triton.jit` functions of one tile: a generated module bakes the ones derived from its
energy into its copies of the templates (energydsl/codegen/triton_source.py) and builds its set with
`pointwise_ops`, passing the weight as torch source for the reference path; a direct caller builds a
`PointwiseOps` over the templates with its own functions, which are then passed at launch, as `SIGMOID`
(sigmoid attention, `sigmoid_attention`) does.

Widths above 256 run the feature-tiled templates of `pointwise_wide_kernels.py` (`wide=True`: `SIGMOID_WIDE`,
`pointwise_wide_ops`); `energydsl.kernels.sigmoid_attention` chooses by width.

Ops are registered and launched as every family's (`launch.py`): triton_ops on CUDA with BLOCK_M / BLOCK_N /
num_warps / num_stages (and the wide kernels' feature tile BLOCK_D) autotuned per head-dim pair, flags and
power-of-two bucket of T (as attention's); custom_ops under the interpreter with 16 x 16 tiles (and 16-wide
feature tiles). Tensors no kernel can take (float64, a CPU without TRITON_INTERPRET=1) run
`pointwise_attention_ref`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from . import MAX_HEAD_DIM, kernels_take, op_set
from .attention_configs import AUTOTUNE_CONFIGS, _configs, tune_bucket
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
from .pointwise_kernels import (
    _pointwise_bwd_dkdv_kernel,
    _pointwise_bwd_dq_kernel,
    _pointwise_fwd_kernel,
    _sigmoid,
    _sigmoid_grad,
)
from .pointwise_ref import pointwise_attention_ref
from .pointwise_wide_kernels import (
    _pointwise_bwd_dkdv_wide_kernel,
    _pointwise_bwd_dq_wide_kernel,
    _pointwise_fwd_wide_kernel,
)

__all__ = ["INTERPRET", "SIGMOID", "SIGMOID_WIDE", "PointwiseOps", "pointwise_ops", "pointwise_wide_ops",
           "sigmoid_attention"]

# The kernels hold the same tiles as the softmax family's split backward (the dK/dV kernel keys x queries), so
# they are tuned over its lists, which `benchmarks/kernel_resources.py` checks fit in registers for these kernels
# too (variants "pointwise ..."); the fused dK/dV configs (DQ_ATOMIC) have no counterpart here.
# The wide ones take the softmax family's wide lists (grid-tiled configs and, for the backward, FEATURE_LOOP
# ones), and the forward gets loop configs of its own (the softmax forward's online softmax has no such mode).
_WIDE_FWD_LOOP_CONFIGS = _configs([(64, 64, 64, 8, 2), (32, 64, 64, 4, 2), (64, 32, 64, 4, 2), (128, 64, 64, 8, 2)],
                                  FEATURE_LOOP=True)
_CONFIGS = {False: tuple([c for c in configs if "DQ_ATOMIC" not in c.kwargs] for configs in AUTOTUNE_CONFIGS[False]),
            True: (AUTOTUNE_CONFIGS[True][0] + _WIDE_FWD_LOOP_CONFIGS, *AUTOTUNE_CONFIGS[True][1:])}
_KEY = ["BK", "BV", "STRICT", "HAS_RB", "HAS_KB", "HAS_ALIBI", "HAS_SELF", "T_TUNE"]
_WIDE_KEY = ["D_QK", "D_V", *_KEY[2:]]  # the wide kernels tune per width (no padded BK / BV)
_INTERPRET_BLOCK = 16  # small, so the interpreter's tests cover several blocks and a ragged last one
# the wide kernels' mode under the interpreter (the tests run both): a program per feature tile, or one per
# row block looping over the tiles (FEATURE_LOOP; on a GPU the autotuner chooses, per kernel)
INTERPRET_FEATURE_LOOP = False


class PointwiseOps:
    """The forward kernel and the two backward kernels, as torch ops registered under one name.

    `baked`: the flags a generated copy fixes (a call that needs others is refused). `weight` and
    `weight_grad`: `@triton.jit` functions passed at launch, for templates that still take them (None where
    a generated copy has them baked in). `reference`: the weight in torch, for the float64 path. `wide`: the
    kernels are the feature-tiled ones (any width; a third grid axis over feature tiles).
    """

    def __init__(self, name: str, fwd: Any, dkdv: Any, dq: Any, baked: dict[str, Any] | None = None, *,
                 reference: Callable[[Tensor], Tensor], weight: Any = None, weight_grad: Any = None,
                 wide: bool = False) -> None:
        self.name = name
        self.baked = dict(baked or {})
        self.reference = reference
        self.wide = wide
        self._functions = {"WEIGHT": weight, "WEIGHT_GRAD": weight_grad}
        key = _WIDE_KEY if wide else _KEY
        self._fwd, self._dkdv, self._dq = (maybe_autotune(configs, [k for k in key if k in kernel.arg_names])(kernel)
                                           for kernel, configs in zip((fwd, dkdv, dq), _CONFIGS[wide], strict=True))
        self._bwd_op = register_op(f"{name}_bwd", self._bwd_impl(), _bwd_fake)
        self._fwd_op = register_op(f"{name}_fwd", self._fwd_impl(), _fwd_fake, backward=self._backward,
                                   setup_context=_setup_context)

    def _meta(self, kernel: Any, dtype: torch.dtype, K: int, V: int, **flags: Any) -> dict[str, Any]:
        """`kernel`'s compile-time arguments: the flags and weight functions it still takes, the padded widths,
        the dot precision, and fixed tiles under the interpreter (autotuned on CUDA)."""
        taken = {k: v for k, v in (flags | self._functions).items() if k in kernel.arg_names and k not in self.baked}
        if self.wide:  # the feature tile (and the backward's mode) are tuned with the row tiles
            loop = {"FEATURE_LOOP": INTERPRET_FEATURE_LOOP} if "FEATURE_LOOP" in kernel.arg_names else {}
            tiles = launch_options(BLOCK_M=_INTERPRET_BLOCK, BLOCK_N=_INTERPRET_BLOCK, BLOCK_D=_INTERPRET_BLOCK,
                                   num_warps=4, **loop)
            return taken | dict(DOT_PREC=dot_precision(dtype)) | tiles
        tiles = launch_options(BLOCK_M=_INTERPRET_BLOCK, BLOCK_N=_INTERPRET_BLOCK, num_warps=4)
        return taken | dict(DOT_PREC=dot_precision(dtype), BK=_width(K), BV=_width(V)) | tiles

    def _grid(self, T: int, rows: str, BH: int, width: int) -> Callable[[dict[str, Any]], tuple[int, ...]]:
        """Programs over (blocks of `rows` ("BLOCK_M" or "BLOCK_N"), batch * head, feature tiles of `width`; one
        for a backward config that loops over them)."""
        if not self.wide:
            return lambda m: (cdiv(T, m[rows]), BH)
        return lambda m: (cdiv(T, m[rows]), BH, 1 if m.get("FEATURE_LOOP") else cdiv(width, m["BLOCK_D"]))

    # -- launchers (these bodies are the ops: traceable by torch.compile, kernels behind `wrap_triton`) -----

    def _fwd_impl(self) -> Callable[..., Tensor]:
        def pointwise_fwd(q: Tensor, k: Tensor, v: Tensor, row_bias: Tensor | None, key_bias: Tensor | None,
                          alibi: Tensor | None, self_b: Tensor | None, scale: float, strict: bool) -> Tensor:
            """o_i = sum_j w(s_ij) v_j."""
            q, k, v = kernel_layouts(q, k, v)
            B, H, T, K = q.shape
            V = v.shape[-1]
            # the wide kernel writes fp32 (a FEATURE_LOOP config adds into it), cast below
            o = empty_in_order(q, V, torch.float32 if self.wide else v.dtype)
            meta = self._meta(self._fwd, q.dtype, K, V, **_flags(strict, row_bias, key_bias, alibi, self_b))
            wrap_triton(self._fwd)[self._grid(T, "BLOCK_M", B * H, V)](
                q, k, v, *(_bias(b, q) for b in (row_bias, key_bias, alibi, self_b)), o, *q.stride()[:3],
                *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], T, H, K, V, scale, tune_bucket(T), **meta)
            return o.to(v.dtype)

        return pointwise_fwd

    def _bwd_impl(self) -> Callable[..., tuple[Tensor, ...]]:
        def pointwise_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, row_bias: Tensor | None,
                          key_bias: Tensor | None, alibi: Tensor | None, self_b: Tensor | None, scale: float,
                          strict: bool, need_alibi: bool, need_self: bool
                          ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
            """(dq, dk, dv, d row_bias, d key_bias, and the per-key column sums of d slope and d self); each of the
            last four empty where there is no such bias or its gradient is not needed."""
            q, k, v = kernel_layouts(q, k, v)
            do = kernel_layout(do.to(v.dtype))  # (the wide kernels' dO . v_j tiles need one dtype)
            B, H, T, K = q.shape
            V = v.shape[-1]
            biases = [_bias(b, q) for b in (row_bias, key_bias, alibi, self_b)]
            # the wide kernels write fp32 (a FEATURE_LOOP config adds into them), cast below
            grad_dtype = torch.float32 if self.wide else None
            dq, dk, dv = (empty_grad(t, grad_dtype) for t in (q, k, v))
            drb, dkb, ddist, ddiag = (torch.empty((B, H, T) if wanted else (0,), dtype=torch.float32,
                                                  device=q.device)
                                      for wanted in (row_bias is not None, key_bias is not None, need_alibi,
                                                     need_self))
            flags = _flags(strict, row_bias, key_bias, alibi, self_b)
            strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3],
                       *dq.stride()[:3], *dk.stride()[:3], *dv.stride()[:3], T, H, K, V, scale, tune_bucket(T))
            wrap_triton(self._dkdv)[self._grid(T, "BLOCK_N", B * H, max(K, V))](
                q, k, v, *biases, do, dk, dv, dkb, ddist, ddiag, *strides,
                **self._meta(self._dkdv, q.dtype, K, V, NEED_ALIBI=need_alibi, NEED_SELF=need_self, **flags))
            wrap_triton(self._dq)[self._grid(T, "BLOCK_M", B * H, K)](
                q, k, v, *biases, do, dq, drb, *strides, **self._meta(self._dq, q.dtype, K, V, **flags))
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), drb, dkb, ddist, ddiag

        return pointwise_bwd

    def _backward(self, ctx: Any, do: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, *biases = ctx.saved_tensors  # row_bias, key_bias, alibi slopes, self bias
        need = [b is not None and ctx.needs_input_grad[3 + n] for n, b in enumerate(biases)]
        dq, dk, dv, drb, dkb, ddist, ddiag = self._bwd_op(do, q, k, v, *biases, ctx.scale, ctx.strict, need[2],
                                                          need[3])
        # the slope's and the self bias's gradients: per-key column sums, reduced per head here
        grads = (drb, dkb, -ddist.sum(dim=(0, 2)) if need[2] else None, ddiag.sum(dim=(0, 2)) if need[3] else None)
        bias_grads = [g.to(b.dtype) if wanted else None for g, b, wanted in zip(grads, biases, need, strict=True)]
        return dq, dk, dv, *bias_grads, None, None

    # -- public API ----------------------------------------------------------------------------------------

    def pointwise_attention(self, q: Tensor, k: Tensor, v: Tensor, *, scale: float = 1.0, strict: bool = False,
                            row_bias: Tensor | None = None, key_bias: Tensor | None = None,
                            alibi_slopes: Tensor | None = None, self_bias: Tensor | None = None) -> Tensor:
        """o_i = sum_j w(scale q_i . k_j + row_bias_i + key_bias_j - slope_h |i - j| + [i = j] self_h) v_j over
        the causal (or strict) context.

        q, k: (B, H, T, Dk); v: (B, H, T, Dv), may be `k`; row_bias, key_bias: (B, H, T); alibi_slopes,
        self_bias: (H,). Differentiable in all of them.
        """
        q, k, v = autocast_inputs(q, k, v)
        if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
            raise ValueError(f"expected q, k (B,H,T,Dk) and v (B,H,T,Dv); got {tuple(q.shape)}, "
                             f"{tuple(k.shape)}, {tuple(v.shape)}")
        for name, b, shape in (("row_bias", row_bias, q.shape[:3]), ("key_bias", key_bias, q.shape[:3]),
                               ("alibi_slopes", alibi_slopes, q.shape[1:2]), ("self_bias", self_bias, q.shape[1:2])):
            if b is not None and b.shape != shape:
                raise ValueError(f"{name} must be {tuple(shape)}; got {tuple(b.shape)}")
        call = _flags(strict, row_bias, key_bias, alibi_slopes, self_bias)
        refuse_unbaked(self.name, self.baked, call)
        if INTERPRET and q.dtype == torch.bfloat16:  # the interpreter's tl.dot misreads bf16 (triton#11584)
            with no_autocast(q):
                return self.pointwise_attention(q.float(), k.float(), v.float(), scale=scale, strict=strict,
                                                row_bias=row_bias, key_bias=key_bias, alibi_slopes=alibi_slopes,
                                                self_bias=self_bias).to(v.dtype)
        if not self.wide and max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
            raise ValueError(f"{self.name} takes head dims up to {MAX_HEAD_DIM} (wider ones take the wide kernels, "
                             f"`pointwise_wide_ops`); got {q.shape[-1]}, {v.shape[-1]}")
        if not kernels_take(q):
            return pointwise_attention_ref(q, k, v, self.reference, scale=scale, strict=strict, row_bias=row_bias,
                                           key_bias=key_bias, alibi_slopes=alibi_slopes, self_bias=self_bias)
        if q.shape[2] == 0:
            return v.new_empty(v.shape)
        q, k, v = kernel_layouts(q, k, v)
        return self._fwd_op(q, k, v, row_bias, key_bias, alibi_slopes, self_bias, float(scale), bool(strict))


def _flags(strict: bool, row_bias: Tensor | None, key_bias: Tensor | None, alibi: Tensor | None,
           self_b: Tensor | None) -> dict[str, bool]:
    """The kernels' mask and score-term switches for a call."""
    return dict(STRICT=strict, HAS_RB=row_bias is not None, HAS_KB=key_bias is not None,
                HAS_ALIBI=alibi is not None, HAS_SELF=self_b is not None)


def _width(n: int) -> int:
    """A feature tile: the width padded to a power of two, at least 16 (tl.dot's smallest)."""
    return max(16, next_power_of_2(n))


def _bias(b: Tensor | None, like: Tensor) -> Tensor:
    """A bias as the kernels read it (contiguous fp32); a dummy pointer where there is none."""
    return like if b is None else b.to(torch.float32).contiguous()


def _fwd_fake(q: Tensor, k: Tensor, v: Tensor, *_: Any) -> Tensor:
    return empty_in_order(kernel_layout(q), v.shape[-1], v.dtype)


def _bwd_fake(do: Tensor, q: Tensor, k: Tensor, v: Tensor, row_bias: Tensor | None, key_bias: Tensor | None,
              alibi: Tensor | None, self_b: Tensor | None, scale: float, strict: bool, need_alibi: bool,
              need_self: bool) -> tuple[Tensor, ...]:
    q, k, v = kernel_layouts(q, k, v)
    B, H, T, _ = q.shape
    drb, dkb, ddist, ddiag = (q.new_empty((B, H, T) if wanted else (0,), dtype=torch.float32)
                              for wanted in (row_bias is not None, key_bias is not None, need_alibi, need_self))
    return empty_grad(q), empty_grad(k), empty_grad(v), drb, dkb, ddist, ddiag


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    *tensors, scale, strict = inputs
    ctx.save_for_backward(*tensors)
    ctx.scale, ctx.strict = scale, strict


def pointwise_ops(name: str, fwd: Any, dkdv: Any, dq: Any, baked: dict[str, Any], *,
                  reference: Callable[[Tensor], Tensor]) -> PointwiseOps:
    """The op set over a generated module's specialised kernels (weights baked in), registered once per process
    under `energydsl::{name}_*`."""
    return op_set(name, lambda: PointwiseOps(name, fwd, dkdv, dq, baked, reference=reference))


def pointwise_wide_ops(name: str, fwd: Any, dkdv: Any, dq: Any, baked: dict[str, Any], *,
                       reference: Callable[[Tensor], Tensor]) -> PointwiseOps:
    """`pointwise_ops` over a specialised copy of the feature-tiled (wide) kernels."""
    return op_set(name, lambda: PointwiseOps(name, fwd, dkdv, dq, baked, reference=reference, wide=True))


SIGMOID = PointwiseOps("sigmoid_attention", _pointwise_fwd_kernel, _pointwise_bwd_dkdv_kernel,
                       _pointwise_bwd_dq_kernel, reference=torch.sigmoid, weight=_sigmoid, weight_grad=_sigmoid_grad)
SIGMOID_WIDE = PointwiseOps("sigmoid_attention_wide", _pointwise_fwd_wide_kernel, _pointwise_bwd_dkdv_wide_kernel,
                            _pointwise_bwd_dq_wide_kernel, reference=torch.sigmoid, weight=_sigmoid,
                            weight_grad=_sigmoid_grad, wide=True)


def sigmoid_attention(q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> Tensor:
    """Sigmoid attention (`PointwiseOps.pointwise_attention`) on the kernels its widths need."""
    wide = max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM
    return (SIGMOID_WIDE if wide else SIGMOID).pointwise_attention(q, k, v, **kw)
