"""What torch needs around the softmax family's kernels besides the launches (`attention.py`).

Shape-only twins of the op bodies, for torch.compile's fake-tensor tracing of the opaque custom_ops; the
autograd contexts of the two forward ops; and the per-head reductions of the bias gradients the backward
kernel leaves as per-row column sums.
"""

from typing import Any

import torch
from torch import Tensor

from .launch import empty_grad, empty_in_order, kernel_layout, kernel_layouts


# Shape-only twins of the operator bodies, for torch.compile's fake-tensor tracing of the opaque custom_ops: laid
# out as the bodies lay out, so that outputs and gradients have the strides the bodies give them.
def fake_attention_fwd(q: Tensor, k: Tensor, v: Tensor, *_: Any) -> tuple[Tensor, Tensor]:
    B, H, T, _d = q.shape
    return empty_in_order(kernel_layout(q), v.shape[-1], v.dtype), q.new_empty((B, H, T), dtype=torch.float32)


def fake_second_fwd(q: Tensor, k: Tensor, v: Tensor, lse: Tensor, u: Tensor, *_: Any) -> tuple[Tensor, Tensor]:
    u = kernel_layout(u)
    return empty_in_order(u, u.shape[-1], v.dtype), torch.empty_like(lse)


def fake_bwd(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, u: Tensor | None, *rest: Any
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    B, H, T, _d = q.shape
    need_alibi, need_self, need_kb = rest[-3:]

    def cols(need: bool) -> Tensor:
        return q.new_empty((B, H, T), dtype=torch.float32) if need else q.new_empty(0)

    q, k, v = kernel_layouts(q, k, v)
    du = empty_grad(kernel_layout(u)) if u is not None else q.new_empty(0)
    return (
        empty_grad(q),
        empty_grad(k),
        empty_grad(v),
        du,
        cols(need_kb),
        cols(need_self),
        cols(need_alibi),
    )


def bias_grads(
    dkb: Tensor,
    ddiag: Tensor,
    ddist: Tensor,
    alibi: Tensor | None,
    self_b: Tensor | None,
    key_b: Tensor | None,
    need: tuple[bool, bool, bool],
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Per-head reductions of the kernel's column sums: d slope_h = -sum dS_ij |i-j|, d self_h = sum dS_ii."""
    need_alibi, need_self, need_kb = need
    d_alibi = (-ddist.sum(dim=(0, 2))).to(alibi.dtype) if need_alibi else None
    d_self = ddiag.sum(dim=(0, 2)).to(self_b.dtype) if need_self else None
    d_kb = dkb.to(key_b.dtype) if need_kb else None
    return d_alibi, d_self, d_kb


def attention_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, scale, strict, alibi, self_b, key_b = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, alibi, self_b, key_b)
    ctx.scale, ctx.strict = scale, strict
    # most callers use o alone: lse's gradient then stays None, and the backward's row term reads no (B, H, T)
    # of zeros that autograd would have filled for it
    ctx.set_materialize_grads(False)


def second_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    q, k, v, lse, u, scale, strict, alibi, self_b, key_b = inputs
    r, rowsum = output
    ctx.save_for_backward(q, k, v, lse, u, r, rowsum, alibi, self_b, key_b)
    ctx.scale, ctx.strict = scale, strict
    ctx.mark_non_differentiable(rowsum)  # the row sums serve the backward only
    ctx.set_materialize_grads(False)
