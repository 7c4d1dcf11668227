"""The softmax family's torch ops over its Triton kernels (`attention_kernels.py`): launch, autograd, dispatch.

    energy_attention        o_i = sum_j p_ij v_j                        (first-order update)
    weighted_second_moment  r_i = sum_j p_ij (v_j . u_i) v_j            (second-order / covariance variants)

with p_ij the softmax of the scores documented in `attention_kernels.py`. `GENERIC` runs the kernel
templates with every flag chosen at launch; the triton code generator writes specialised copies into each
generated module (energydsl/codegen/triton_source.py) and builds an op set over them with `attention_ops`.
Feature widths above 256 (CEM's exact diagonal term) run the tiled templates of `attention_wide_kernels.py`
(`GENERIC_WIDE`, `attention_wide_ops`); the module-level functions choose by width.
Ops are registered and launched as every family's (`launch.py`): triton_ops on CUDA, where BLOCK_M /
BLOCK_N / num_warps / num_stages (and the wide kernels' feature tile BLOCK_D and backward mode FEATURE_LOOP)
are autotuned per head-dim pair, variant and sequence-length bucket, over the config lists of
`attention_configs.py`, and the narrow backward's mode, split (dK/dV and dQ
kernels) or fused (dQ added by atomics in the dK/dV kernel), is timed per shape (`AttentionOps._fuse_dq`),
both kept on disk for later processes (`tuning.py`);
custom_ops under the interpreter, with blocks fixed at 16 x 16, the wide kernels' feature tile at 16 and their
backward tiled over features (`INTERPRET_*` below).
The ops' fake-tensor twins, autograd contexts and bias-gradient reductions are in `attention_autograd.py`.
"""

from collections.abc import Callable
from typing import Any

import torch
import triton
from torch import Tensor

from . import MAX_HEAD_DIM, kernels_take, op_set, tuning
from .attention_autograd import (
    attention_setup,
    bias_grads,
    fake_attention_fwd,
    fake_bwd,
    fake_second_fwd,
    second_setup,
)
from .attention_configs import AUTOTUNE_CONFIGS, TUNE_KEYS, BackwardChoice, tune_bucket
from .attention_kernels import _bwd_delta_kernel, _bwd_dkdv_kernel, _bwd_dq_kernel, _fwd_kernel
from .attention_ref import energy_attention_lse_ref, weighted_second_moment_ref
from .attention_wide_kernels import _bwd_dkdv_wide_kernel, _bwd_dq_wide_kernel, _fwd_wide_kernel
from .launch import (
    INTERPRET,
    autocast_inputs,
    cdiv,
    dot_precision,
    empty_grad,
    empty_in_order,
    grad_strides,
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
    "GENERIC_WIDE",
    "INTERPRET",
    "MAX_HEAD_DIM",
    "AttentionOps",
    "attention_ops",
    "attention_wide_ops",
    "energy_attention",
    "energy_attention_with_lse",
    "weighted_second_moment",
]

# ----------------------------------------------------------------------------------------------------------
# Launch configuration: autotuned on GPU (`attention_configs.py`), fixed small tiles under the interpreter
# ----------------------------------------------------------------------------------------------------------

_INTERPRET_BLOCKS = {"BLOCK_M": 16, "BLOCK_N": 16}
# the backward's row term (`_bwd_delta_kernel`): rows per program and the feature tile it sums over; a
# memory-bound pass, not tuned
_DELTA_ROWS, _DELTA_FEATURES = 64, 128
# the wide kernels' feature tile under the interpreter: small, so that tests at small widths cover several
# tiles and a masked tail
INTERPRET_FEATURE_TILE = 16
# the wide backward's mode under the interpreter (the tests run both): one program per feature tile, or one
# looping over the tiles (FEATURE_LOOP; on a GPU the autotuner chooses)
INTERPRET_FEATURE_LOOP = False
# the narrow backward under the interpreter (the tests run both): dK/dV and dQ kernels, or the dK/dV kernel
# adding dQ by atomics (DQ_ATOMIC; on a GPU `_fuse_dq` times both per shape)
INTERPRET_DQ_ATOMIC = False


def _tuned(kernel: Any, configs: list[triton.Config], wide: bool) -> Any:
    # a specialised kernel (see `attention_ops`) may have SECOND baked in: tune on what is left
    return maybe_autotune(configs, [k for k in TUNE_KEYS[wide] if k in kernel.arg_names])(kernel)


def _blocks() -> dict[str, int]:
    """Tile sizes to pass explicitly: none when the autotuner chooses them."""
    return launch_options(**_INTERPRET_BLOCKS)


def _pad(d: int) -> int:
    """Head dims are padded to a power of two >= 16 (tl.dot's minimum); the padding is masked out."""
    return max(16, next_power_of_2(d))


def _flags(
    q: Tensor, strict: bool, alibi: Tensor | None, self_b: Tensor | None, key_b: Tensor | None
) -> dict:
    return dict(
        STRICT=strict,
        HAS_ALIBI=alibi is not None,
        HAS_SELF=self_b is not None,
        HAS_KB=key_b is not None,
        DOT_PREC=dot_precision(q.dtype),
    )


def _strides(q: Tensor, k: Tensor, v: Tensor, u: Tensor | None, last: Tensor) -> tuple[int, ...]:
    """The kernels' stride arguments: the batch, head and row strides of q, k, v, u (q's stand in without a
    second moment) and `last`, the output in the forward and its gradient in the backward."""
    return (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *(q if u is None else u).stride()[:3],
            *last.stride()[:3])


def _unbaked(meta: dict, baked: dict[str, Any]) -> dict:
    """The constexpr arguments a kernel still takes: those baked into its source are dropped (`_check`
    has refused any call whose flags differ from them)."""
    return {k: v for k, v in meta.items() if k not in baked}


# ----------------------------------------------------------------------------------------------------------
# The ops: one set per kernel triple, registered under its own name
# ----------------------------------------------------------------------------------------------------------


class AttentionOps:
    """The three kernels of the softmax family, launched by torch ops registered under one name.

    `GENERIC` below holds the templates themselves (every flag decided at launch). The triton code generator
    writes specialised copies of the templates into each generated module, with the flags its energy fixes
    (mask, which biases, first or second order) baked in and dead branches removed, and builds an
    `AttentionOps` over them with `attention_ops`; `baked` records those flags so a call the copy was not made
    for fails loudly instead of computing something else. `wide` sets hold the feature-tiled kernels of
    `attention_wide_kernels.py` (any width; a third grid axis over feature tiles).
    """

    def __init__(self, name: str, fwd: Any, dkdv: Any, dq: Any, baked: dict[str, Any] | None = None,
                 wide: bool = False):
        self.name = name
        self.baked = dict(baked or {})
        self.wide = wide
        fwd_configs, dkdv_configs, dq_configs = AUTOTUNE_CONFIGS[wide]
        fused_configs = [c for c in dkdv_configs if c.kwargs.get("DQ_ATOMIC")]
        self._fwd = _tuned(fwd, fwd_configs, wide)
        self._dkdv = _tuned(dkdv, [c for c in dkdv_configs if c not in fused_configs], wide)
        self._dkdv_fused = _tuned(dkdv, fused_configs, wide) if fused_configs else None  # narrow sets only
        self._dq = _tuned(dq, dq_configs, wide)
        # the narrow backward's choice per shape (`_fuse_dq`), with the times it was made on
        self.backward_choices: dict[tuple, BackwardChoice] = {}
        self._kernels_id: str | None = None  # their part of a choice's disk record, computed on first use
        self._attention_fwd_op = register_op(f"{name}_fwd", self._op_attention_fwd(), fake_attention_fwd,
                                             backward=self._attention_backward, setup_context=attention_setup)
        self._second_fwd_op = register_op(f"{name}_second_fwd", self._op_second_fwd(), fake_second_fwd,
                                          backward=self._second_backward, setup_context=second_setup)
        self._bwd_op = register_op(f"{name}_bwd", self._op_bwd(), fake_bwd)

    # -- launches (only torch ops and wrap_triton launches, as triton_op requires) -------------------------

    def _widths(self, d_qk: int, d_v: int) -> dict[str, int]:
        """The feature tile sizes passed at launch: whole padded widths (narrow), or the wide kernels' tile
        under the interpreter (on a GPU the autotuner chooses BLOCK_D with the row tiles)."""
        if not self.wide:
            return dict(BLOCK_DK=_pad(d_qk), BLOCK_DV=_pad(d_v))
        return launch_options(BLOCK_D=INTERPRET_FEATURE_TILE)

    def _grid(self, T: int, BH: int, block: str, width: int) -> Callable[[dict], tuple[int, int, int]]:
        """Programs over (row blocks, batch*head, feature tiles of `width`): one feature tile unless wide, or
        a wide backward config that loops over them (FEATURE_LOOP)."""
        if not self.wide:
            return lambda meta: (cdiv(T, meta[block]), BH, 1)
        return lambda meta: (cdiv(T, meta[block]), BH,
                             1 if meta.get("FEATURE_LOOP") else cdiv(width, meta["BLOCK_D"]))

    def _fuse_dq(self, key: tuple, q: Tensor, split: Callable[[], Any], fused: Callable[[], Any]) -> bool:
        """Whether this backward runs fused (the dK/dV kernel adds dQ by atomics) rather than split (dK/dV
        and dQ kernels): the faster of the two for this shape, timed once per `key` on its first eager call
        and kept on disk for later processes on the same kind of device (`tuning.py`).

        Split where the fused mode cannot run or must not: wide kernels; deterministic algorithms requested
        (atomics add in no fixed order, so dQ may differ in its last bits from run to run); a traced call
        (torch.compile, a CUDA graph capture) for a shape neither this process nor the disk has timed, as
        there is nothing to time there.
        """
        if self._dkdv_fused is None or torch.are_deterministic_algorithms_enabled():
            return False
        if INTERPRET:
            return INTERPRET_DQ_ATOMIC
        if key not in self.backward_choices:
            record = self._choice_record(key, q)
            stored = BackwardChoice.read(tuning.load(record))
            if stored is not None:
                self.backward_choices[key] = stored
            else:
                traced = torch.compiler.is_compiling() or type(q) not in (Tensor, torch.nn.Parameter)
                if traced or (q.is_cuda and torch.cuda.is_current_stream_capturing()):
                    return False
                self.backward_choices[key] = BackwardChoice.time(split, fused)
                tuning.store(record, self.backward_choices[key]._asdict())
        return self.backward_choices[key].fused

    def _choice_record(self, key: tuple, q: Tensor) -> str:
        """The disk record of a backward choice: the shape key with the device's name for the device, the
        versions and the kernels' source and configs (a changed kernel is timed afresh)."""
        if self._kernels_id is None:
            kernels = (self._dkdv, self._dkdv_fused, self._dq)
            self._kernels_id = tuning.digest(*((t.fn.cache_key, [str(c) for c in t.configs]) for t in kernels))
        device = torch.cuda.get_device_name(q.device) if q.is_cuda else q.device.type
        shape = tuple(device if isinstance(part, torch.device) else part for part in key)
        return tuning.digest(self._kernels_id, torch.__version__, triton.__version__, shape)

    def _loop(self) -> dict[str, bool]:
        """The wide backward's FEATURE_LOOP to pass at launch: none on a GPU (a tuned meta-parameter)."""
        return launch_options(FEATURE_LOOP=INTERPRET_FEATURE_LOOP) if self.wide else {}

    def _launch_fwd(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        u: Tensor | None,
        lse_in: Tensor | None,
        out: Tensor,
        row_out: Tensor,
        scale: float,
        strict: bool,
        alibi: Tensor | None,
        self_b: Tensor | None,
        key_b: Tensor | None,
    ) -> None:
        B, H, T, Dqk = q.shape
        Dv = v.shape[-1]
        second = u is not None
        dummy = q  # stands in for absent optional tensors; never dereferenced (its flag is off)
        meta = dict(SECOND=second, **_flags(q, strict, alibi, self_b, key_b), **self._widths(Dqk, Dv))
        wrap_triton(self._fwd)[self._grid(T, B * H, "BLOCK_M", Dv)](
            q,
            k,
            v,
            u if second else dummy,
            lse_in if second else dummy,
            out,
            row_out,
            dummy if alibi is None else alibi,
            dummy if self_b is None else self_b,
            dummy if key_b is None else key_b,
            *_strides(q, k, v, u, out),
            scale,
            T,
            H,
            Dqk,
            Dv,
            tune_bucket(T),
            **_unbaked(meta, self.baked),
            **_blocks(),
        )

    def _op_attention_fwd(self) -> Callable[..., tuple[Tensor, Tensor]]:
        def energy_attention_fwd(
            q: Tensor,
            k: Tensor,
            v: Tensor,
            scale: float,
            strict: bool,
            alibi_slopes: Tensor | None,
            self_bias: Tensor | None,
            key_bias: Tensor | None,
        ) -> tuple[Tensor, Tensor]:
            q, k, v = kernel_layouts(q, k, v)  # any strides from a direct caller; none copied when laid out
            alibi_slopes, self_bias, key_bias = _contiguous(alibi_slopes, self_bias, key_bias)
            B, H, T, _ = q.shape
            o = empty_in_order(q, v.shape[-1], v.dtype)
            lse = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
            self._launch_fwd(q, k, v, None, None, o, lse, scale, strict, alibi_slopes, self_bias, key_bias)
            return o, lse

        return energy_attention_fwd

    def _op_second_fwd(self) -> Callable[..., tuple[Tensor, Tensor]]:
        def weighted_second_moment_fwd(
            q: Tensor,
            k: Tensor,
            v: Tensor,
            lse: Tensor,
            u: Tensor,
            scale: float,
            strict: bool,
            alibi_slopes: Tensor | None,
            self_bias: Tensor | None,
            key_bias: Tensor | None,
        ) -> tuple[Tensor, Tensor]:
            q, k, v = kernel_layouts(q, k, v)
            u = kernel_layout(u)
            lse, alibi_slopes, self_bias, key_bias = _contiguous(lse, alibi_slopes, self_bias, key_bias)
            r = empty_in_order(u, u.shape[-1], v.dtype)
            rowsum = torch.empty_like(lse)  # sum_j exp(s_ij - lse_i): 1 but for lse's rounding (`_fwd_kernel`)
            self._launch_fwd(q, k, v, u, lse, r, rowsum, scale, strict, alibi_slopes, self_bias, key_bias)
            return r, rowsum

        return weighted_second_moment_fwd

    def _op_bwd(self) -> Callable[..., tuple[Tensor, ...]]:
        def softmax_family_bwd(
            do: Tensor,
            q: Tensor,
            k: Tensor,
            v: Tensor,
            u: Tensor | None,
            lse: Tensor,
            out: Tensor,
            dlse: Tensor | None,
            scale: float,
            strict: bool,
            alibi_slopes: Tensor | None,
            self_bias: Tensor | None,
            key_bias: Tensor | None,
            need_alibi: bool,
            need_self: bool,
            need_key_bias: bool,
        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
            """(dq, dk, dv, du, d_key_bias, dS diagonal, sum_i dS_ij |i-j|); unrequested outputs are empty.

            `do` is the gradient of `out`, the forward's output (o, or the second moment's r), and `dlse` that
            of the first-order forward's lse (None: none). The last two outputs are per (b, h, j) partial
            sums, reduced to per-head gradients by the caller.
            """
            q, k, v = kernel_layouts(q, k, v)
            out, u = kernel_layout(out), None if u is None else kernel_layout(u)
            do = kernel_layout(do.to(out.dtype))  # the kernels multiply dO with tiles in the output's dtype
            lse, dlse, alibi_slopes, self_bias, key_bias = _contiguous(lse, dlse, alibi_slopes, self_bias, key_bias)
            B, H, T, Dqk = q.shape
            Dv = v.shape[-1]
            second = u is not None
            # the wide kernels write fp32 (a FEATURE_LOOP config adds into them), cast below
            out_dtype = torch.float32 if self.wide else None
            dk, dv = empty_grad(k, out_dtype), empty_grad(v, out_dtype)

            def cols(need: bool) -> Tensor:
                return torch.empty((B, H, T), dtype=torch.float32, device=q.device) if need else q.new_empty(0)

            dkb, ddiag, ddist = cols(need_key_bias), cols(need_self), cols(need_alibi)
            dummy = q
            flags = dict(SECOND=second, **_flags(q, strict, alibi_slopes, self_bias, key_bias),
                         **self._widths(Dqk, Dv))
            needs = dict(NEED_KB=need_key_bias, NEED_SELF=need_self, NEED_ALIBI=need_alibi)
            delta = torch.empty((B, H, T), dtype=torch.float32, device=q.device)
            head = (q, k, v, u if second else dummy, do, lse, delta)
            biases = (dummy if alibi_slopes is None else alibi_slopes, dummy if self_bias is None else self_bias,
                      dummy if key_bias is None else key_bias)
            bucket = tune_bucket(T)
            sizes = (*_strides(q, k, v, u, do), *grad_strides(q, k, v, q if u is None else u), scale, T, H, Dqk,
                     Dv, bucket)
            # the row term delta_i = sum_j p_ij dP_ij, which every dS_ij subtracts
            if second:  # a pass over the keys: dr_i . r_i (exact arithmetic's value) loses the digits dS needs
                wrap_triton(self._dq)[self._grid(T, B * H, "BLOCK_M", 1)](  # where u is large (_bwd_dq_kernel)
                    *head, dummy, dummy, *biases, *sizes,
                    **_unbaked(flags, self.baked), **_blocks(), **self._loop(), DELTA_PASS=True,
                )
            else:  # FlashAttention-2's preprocessing: dO_i . o_i; a gradient on lse_i adds p_ij dlse_i to dS_ij
                wrap_triton(_bwd_delta_kernel)[(cdiv(T, _DELTA_ROWS), B * H)](
                    out, do, q if dlse is None else dlse, delta, *out.stride()[:3], *do.stride()[:3], T, H, Dv,
                    HAS_DLSE=dlse is not None,
                    BLOCK_M=_DELTA_ROWS, BLOCK_D=min(_pad(Dv), _DELTA_FEATURES),
                )

            def dkdv_kernel(kernel: Any, *dq_sums: Tensor, **mode: bool) -> None:
                """dK, dV and the bias columns; narrow kernels also take the fp32 dQ (and dU) sums of DQ_ATOMIC"""
                wrap_triton(kernel)[self._grid(T, B * H, "BLOCK_N", max(Dqk, Dv))](
                    *head, dk, dv, *dq_sums, *biases, dkb if need_key_bias else dummy,
                    ddiag if need_self else dummy, ddist if need_alibi else dummy, *sizes,
                    **_unbaked({**flags, **needs}, self.baked), **_blocks(), **self._loop(), **mode,
                )

            def split() -> tuple[Tensor, Tensor]:
                dq = empty_grad(q, out_dtype)
                du = empty_grad(u, out_dtype) if second else q.new_empty(0)
                dkdv_kernel(self._dkdv, *(() if self.wide else (dummy, dummy)))
                # wide kernels: a program per feature tile of dQ (and dU for the second moment)
                dq_tiles = max(Dqk, Dv) if second else Dqk
                wrap_triton(self._dq)[self._grid(T, B * H, "BLOCK_M", dq_tiles)](
                    *head, dq, du if second else dummy, *biases, *sizes,
                    **_unbaked(flags, self.baked), **_blocks(), **self._loop(),
                )
                return dq, du

            def fused() -> tuple[Tensor, Tensor]:
                dq = empty_grad(q, torch.float32).zero_()
                du = empty_grad(u, torch.float32).zero_() if second else q.new_empty(0)
                dkdv_kernel(self._dkdv_fused, dq, du if second else dummy, **launch_options(DQ_ATOMIC=True))
                return dq.to(q.dtype), du.to(u.dtype) if second else du

            key = (bucket, Dqk, Dv, q.dtype, q.device, tuple(flags.items()), tuple(needs.items()))
            dq, du = fused() if self._fuse_dq(key, q, split, fused) else split()
            if self.wide:
                dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
                du = du.to(u.dtype) if second else du
            return dq, dk, dv, du, dkb, ddiag, ddist

        return softmax_family_bwd

    # -- autograd ------------------------------------------------------------------------------------------

    def _attention_backward(self, ctx: Any, do: Tensor, dlse: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, o, lse, alibi, self_b, key_b = ctx.saved_tensors
        need = (ctx.needs_input_grad[5], ctx.needs_input_grad[6], ctx.needs_input_grad[7])
        # gradients are not materialised (`attention_setup`): an unused output's is None, not zeros
        do = torch.zeros_like(o) if do is None else do
        dlse = None if dlse is None else dlse.float()
        dq, dk, dv, _, dkb, ddiag, ddist = self._bwd_op(
            do, q, k, v, None, lse, o, dlse, ctx.scale, ctx.strict, alibi, self_b, key_b, *need
        )
        return (dq, dk, dv, None, None, *bias_grads(dkb, ddiag, ddist, alibi, self_b, key_b, need))

    def _second_backward(self, ctx: Any, dr: Tensor | None, _drowsum: None) -> tuple[Tensor | None, ...]:
        q, k, v, lse, u, r, rowsum, alibi, self_b, key_b = ctx.saved_tensors
        need = (ctx.needs_input_grad[7], ctx.needs_input_grad[8], ctx.needs_input_grad[9])
        # the kernels recompute p = exp(s - lse), which the forward divided by its row sum: every term of the
        # backward is linear in p_ij dr_i, so dividing dr_i by the row sum divides each p_ij there
        dr = torch.zeros_like(r) if dr is None else dr / torch.where(rowsum == 0, 1.0, rowsum)[..., None]
        dq, dk, dv, du, dkb, ddiag, ddist = self._bwd_op(
            dr, q, k, v, u, lse, r, None, ctx.scale, ctx.strict, alibi, self_b, key_b, *need
        )
        # lse is a cache of the softmax normaliser, not an independent input: its dependence on q, k and the
        # biases is already in dS above, so it receives no gradient of its own.
        return (dq, dk, dv, None, du, None, None, *bias_grads(dkb, ddiag, ddist, alibi, self_b, key_b, need))

    # -- public API ----------------------------------------------------------------------------------------

    def _check(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        strict: bool,
        second: bool,
        alibi_slopes: Tensor | None,
        self_bias: Tensor | None,
        key_bias: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
        """Validate shapes early (a kernel would silently read out of bounds); q, k and v in a layout the kernels
        take (`kernel_layout`: a permuted view needs no copy), the biases contiguous. The ops lay out their
        inputs themselves too, for direct callers; laid out here, they are what autograd saves."""
        if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
            raise ValueError(
                f"expected q, k (B, H, T, Dk) and v (B, H, T, Dv); got {q.shape}, {k.shape}, {v.shape}"
            )
        if not (q.dtype == k.dtype == v.dtype):
            raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
        if not self.wide and max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
            raise ValueError(
                f"{self.name} takes head dims up to {MAX_HEAD_DIM} (wider ones take the wide kernels); "
                f"got {q.shape[-1]}, {v.shape[-1]}"
            )
        B, H, T, _ = q.shape
        for name, t, shape in (("alibi_slopes", alibi_slopes, (H,)), ("self_bias", self_bias, (H,))):
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}; got {tuple(t.shape)}")
        if key_bias is not None and tuple(key_bias.shape) != (B, H, T):
            raise ValueError(f"key_bias must have shape {(B, H, T)}; got {tuple(key_bias.shape)}")
        call = dict(SECOND=second, STRICT=strict, HAS_ALIBI=alibi_slopes is not None,
                    HAS_SELF=self_bias is not None, HAS_KB=key_bias is not None)
        refuse_unbaked(self.name, self.baked, call)
        return (*kernel_layouts(q, k, v), *_contiguous(alibi_slopes, self_bias, key_bias))

    def energy_attention_with_lse(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        scale: float,
        strict: bool = False,
        alibi_slopes: Tensor | None = None,
        self_bias: Tensor | None = None,
        key_bias: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(o, lse): the attention output and the per-row log-sum-exp (B, H, T) in float32; both differentiable.

        lse is what `weighted_second_moment` needs to recompute the same softmax without a second online pass.
        Rows with no admissible key (strict row 0) have o = 0 and lse = 0.
        """
        q, k, v = autocast_inputs(q, k, v)
        if INTERPRET and q.dtype == torch.bfloat16:  # the interpreter's tl.dot misreads bf16 (triton#11584)
            with no_autocast(q):
                o, lse = self.energy_attention_with_lse(
                    q.float(), k.float(), v.float(), scale=scale, strict=strict, alibi_slopes=alibi_slopes,
                    self_bias=self_bias, key_bias=key_bias,
                )
            return o.to(v.dtype), lse
        q, k, v, alibi_slopes, self_bias, key_bias = self._check(
            q, k, v, strict, False, alibi_slopes, self_bias, key_bias
        )
        if not kernels_take(q):  # e.g. a module moved to the CPU without the interpreter, or float64
            return energy_attention_lse_ref(
                q, k, v, scale=scale, strict=strict, alibi_slopes=alibi_slopes, self_bias=self_bias,
                key_bias=key_bias,
            )
        return self._attention_fwd_op(q, k, v, float(scale), bool(strict), alibi_slopes, self_bias, key_bias)

    def energy_attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        scale: float,
        strict: bool = False,
        alibi_slopes: Tensor | None = None,
        self_bias: Tensor | None = None,
        key_bias: Tensor | None = None,
    ) -> Tensor:
        """o_i = sum_j softmax_j(s_ij) v_j with the scores of the module docstring; (B, H, T, Dv) in v's dtype.

        q, k: (B, H, T, Dk); v: (B, H, T, Dv) (may be k itself); alibi_slopes, self_bias: (H,);
        key_bias: (B, H, T).
        Differentiable in every tensor argument.
        """
        o, _ = self.energy_attention_with_lse(
            q, k, v, scale=scale, strict=strict, alibi_slopes=alibi_slopes, self_bias=self_bias,
            key_bias=key_bias,
        )
        return o

    def weighted_second_moment(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        lse: Tensor | None,
        u: Tensor,
        *,
        scale: float,
        strict: bool = False,
        alibi_slopes: Tensor | None = None,
        self_bias: Tensor | None = None,
        key_bias: Tensor | None = None,
    ) -> Tensor:
        """r_i = sum_j p_ij (v_j . u_i) v_j, the softmax-weighted value covariance applied to u_i; (B, H, T, Dv).

        `lse` must be the log-sum-exp of these very scores (from `energy_attention_with_lse`), or None to have
        it recomputed. It is treated as a cache: gradients for q, k and the biases include the full softmax
        Jacobian (as if p were recomputed from scratch) and lse itself receives none, so passing a
        differentiable lse does not count anything twice.
        """
        q, k, v, u = autocast_inputs(q, k, v, u)
        if INTERPRET and q.dtype == torch.bfloat16:  # as in energy_attention_with_lse
            with no_autocast(q):
                return self.weighted_second_moment(
                    q.float(), k.float(), v.float(), lse, u.float(), scale=scale, strict=strict,
                    alibi_slopes=alibi_slopes, self_bias=self_bias, key_bias=key_bias,
                ).to(v.dtype)
        q, k, v, alibi_slopes, self_bias, key_bias = self._check(
            q, k, v, strict, True, alibi_slopes, self_bias, key_bias
        )
        if u.shape != v.shape or u.dtype != v.dtype:
            raise ValueError(f"u must match v's shape and dtype; got {tuple(u.shape)} {u.dtype}")
        if not kernels_take(q):
            return weighted_second_moment_ref(
                q, k, v, lse, u, scale=scale, strict=strict, alibi_slopes=alibi_slopes, self_bias=self_bias,
                key_bias=key_bias,
            )
        if lse is None:
            if self.baked.get("SECOND") is not None:  # a specialised copy cannot run the first pass too
                raise ValueError(f"{self.name} needs the lse of the first-order attention")
            with torch.no_grad():
                _, lse = self._attention_fwd_op(
                    q, k, v, float(scale), bool(strict), alibi_slopes, self_bias, key_bias
                )
        elif tuple(lse.shape) != tuple(q.shape[:3]):
            raise ValueError(f"lse must have shape {tuple(q.shape[:3])}; got {tuple(lse.shape)}")
        lse = lse.detach().float().contiguous()  # saved for the backward as the kernels read it
        r, _ = self._second_fwd_op(
            q, k, v, lse, kernel_layout(u), float(scale), bool(strict), alibi_slopes, self_bias, key_bias
        )
        return r


def _contiguous(*tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """Each tensor contiguous (the biases and row statistics are read as flat arrays), None kept."""
    return tuple(None if t is None else t.contiguous() for t in tensors)


# ----------------------------------------------------------------------------------------------------------
# The generic set (the templates, every flag chosen at launch) and specialised ones
# ----------------------------------------------------------------------------------------------------------

def attention_ops(name: str, fwd: Any, dkdv: Any, dq: Any, baked: dict[str, Any], wide: bool = False
                  ) -> AttentionOps:
    """The op set over a specialised kernel triple, registered once per process (`op_set`)."""
    return op_set(name, lambda: AttentionOps(name, fwd, dkdv, dq, baked, wide))


def attention_wide_ops(name: str, fwd: Any, dkdv: Any, dq: Any, baked: dict[str, Any]) -> AttentionOps:
    """`attention_ops` over a specialised copy of the feature-tiled (wide) kernels."""
    return attention_ops(name, fwd, dkdv, dq, baked, wide=True)


GENERIC = AttentionOps("energy_attention", _fwd_kernel, _bwd_dkdv_kernel, _bwd_dq_kernel)
GENERIC_WIDE = AttentionOps("energy_attention_wide", _fwd_wide_kernel, _bwd_dkdv_wide_kernel,
                            _bwd_dq_wide_kernel, wide=True)


def _generic(q: Tensor, v: Tensor) -> AttentionOps:
    return GENERIC_WIDE if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM else GENERIC


def energy_attention_with_lse(q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> tuple[Tensor, Tensor]:
    """`AttentionOps.energy_attention_with_lse` on the set that takes these widths."""
    return _generic(q, v).energy_attention_with_lse(q, k, v, **kw)


def energy_attention(q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> Tensor:
    """`AttentionOps.energy_attention` on the set that takes these widths."""
    return _generic(q, v).energy_attention(q, k, v, **kw)


def weighted_second_moment(q: Tensor, k: Tensor, v: Tensor, lse: Tensor | None, u: Tensor, **kw: Any) -> Tensor:
    """`AttentionOps.weighted_second_moment` on the set that takes these widths."""
    return _generic(q, v).weighted_second_moment(q, k, v, lse, u, **kw)
