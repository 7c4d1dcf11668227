"""How every fused kernel is registered and launched, decided once at import (shared by all op families).

* CUDA: each op is a `torch.library.triton_op`, so `torch.compile` sees the Triton kernels and can schedule
  around them; launch configurations are autotuned (`maybe_autotune`).
* TRITON_INTERPRET=1 (CPU tests): triton_op would launch the interpreted kernel on fake tensors while
  `torch.compile` traces, which fails, so the same functions are registered as opaque
  `torch.library.custom_op`s with explicit fake (shape) functions; eager and compiled calls both work. Tiles
  are fixed and passed at launch (`launch_options`).

Both APIs are in every torch the project supports (>= 2.6). Gradients: a `torch.autograd.Function` around
each op (and `register_autograd` on the op itself, for direct callers): see `register_op`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import triton
from torch import Tensor
from torch.library import wrap_triton  # the launch wrapper triton_op discovers kernels by (name kept)

try:
    from torch._library.triton import set_wrap_triton_enabled
except ImportError:  # an older torch: its triton_op's kernel hands launches to the tracing HOP as well
    def set_wrap_triton_enabled(enabled: bool) -> AbstractContextManager[None]:
        return nullcontext()

from .tuning import autotune_options

__all__ = [
    "INTERPRET",
    "cdiv",
    "dot_precision",
    "empty_in_order",
    "kernel_layout",
    "kernel_layouts",
    "launch_options",
    "launching_directly",
    "maybe_autotune",
    "next_power_of_2",
    "register_op",
    "runs_body_directly",
    "wrap_triton",
]


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    from . import interpret_requested

    return interpret_requested()


# `triton.jit` picks interpreter or compiler when a kernel is decorated, i.e. when a kernel module is imported
INTERPRET: bool = _interpreting()


def register_op(
    name: str,
    impl: Callable[..., Any],
    fake: Callable[..., Any],
    *,
    backward: Callable[..., Any] | None = None,
    setup_context: Callable[..., Any] | None = None,
) -> Callable[..., Any]:
    """`impl` as torch.ops.energydsl.<name> (a triton_op on CUDA, a custom_op with `fake` under the
    interpreter), returned as the function the op sets call.

    With a `backward`, that function is a `torch.autograd.Function` around the op, whose forward calls the op
    with grad mode off, and the op itself is differentiable too (`register_autograd`, the same two functions),
    for callers of torch.ops.energydsl.* and `torch.library.opcheck`. Why both: autograd registered on a
    custom op runs its forward through the op's generated Function with grad on, which fills in the schema's
    defaults and redispatches on every call; wired outside, a fwd+bwd of one attention op spends about a
    quarter less host time (`docs/models.md`, "Host time per call"). Without grad mode the call is the op
    alone. Dynamo traces the Function and the op inside it, so compiled callers see the same kernels. Under
    torch.func's transforms a second Function of the kind they take runs instead (its own setup_context, a
    generated vmap rule; the op's vmap rule runs it per batch entry), whose backward refuses a second transform:
    the backward kernels have no autograd (elsewhere a second backward reaches the backward op, which says so).

    "The op" is its body, `impl`, called directly wherever nothing could tell the difference
    (`runs_body_directly`): the dispatcher's round trip through a custom op costs more host time than the
    body's own launch arithmetic. Whatever must see the op (torch.compile, fake tensors, dispatch and function
    modes, functorch transforms, the profiler, a graph that would need the op's missing autograd) gets it.
    """
    qualname = f"energydsl::{name}"
    if INTERPRET:
        op = torch.library.custom_op(qualname, impl, mutates_args=())
        op.register_fake(fake)
    else:
        op = torch.library.triton_op(qualname, impl, mutates_args=())
    op.register_vmap(_one_by_one(op))
    differentiable = backward is not None

    def run(*args: Any) -> Any:
        if runs_body_directly(args, differentiable):
            with launching_directly():  # as the triton_op's own kernel runs the body
                return impl(*args)
        return op(*args)

    if backward is None:
        return run
    op.register_autograd(backward, setup_context=setup_context)

    def forward(ctx: Any, *args: Any) -> Any:
        output = run(*args)
        setup_context(ctx, args, output)
        return output

    def differentiate(ctx: Any, *grads: Any) -> Any:  # a plain function: Dynamo misbinds a bound method here
        return backward(ctx, *grads)  # (a second backward: the backward op raises, it has no autograd)

    function = type(f"{name}_function", (torch.autograd.Function,),
                    {"forward": staticmethod(forward), "backward": staticmethod(differentiate)})

    def forward_alone(*args: Any) -> Any:
        return run(*args)

    def first_order_only(ctx: Any, *grads: Any) -> Any:
        """The backward under torch.func: refused where a second transform differentiates it (grad of grad,
        hessian), whose derivative of the backward op would otherwise be taken as 0, silently."""
        from torch._C._functorch import TransformType
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

        if sum(i.key() in (TransformType.Grad, TransformType.Jvp) for i in retrieve_all_functorch_interpreters()) > 1:
            raise RuntimeError("a second derivative through energydsl's fused Triton kernels (torch.func's grad of "
                               "grad, hessian): they have first derivatives only; take it on the torch backend's "
                               "module (backend=\"torch\"), under SDPBackend.MATH for attention")
        with torch.no_grad():  # first order: the backward op alone (its autograd would refuse the transform)
            return backward(ctx, *grads)

    def save(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        setup_context(ctx, inputs, output)

    # torch.func's transforms (grad, vmap, vjp, per-sample gradients) refuse a Function whose forward takes ctx;
    # they take this one, forward and setup_context apart, with a generated vmap rule. Only they get it: its
    # apply binds the arguments by signature, about 30 us more per fwd+bwd on the CPU box
    transformable = type(f"{name}_transformable", (torch.autograd.Function,),
                         {"forward": staticmethod(forward_alone), "setup_context": staticmethod(save),
                          "backward": staticmethod(first_order_only), "generate_vmap_rule": True})

    def call(*args: Any) -> Any:
        if torch._C._get_tracing_state():  # TorchScript records the op, with or without grad (its trace check
            return op(*args)  # traces again under no_grad: a Function there would make the graphs differ)
        if not torch.is_grad_enabled():
            return run(*args)  # no graph: the op (or its body) alone, with nothing saved
        if torch._C._are_functorch_transforms_active():
            return transformable.apply(*args)
        if torch.compiler.is_compiling():
            args = _distinct(args)
        return function.apply(*args)

    return call


def _one_by_one(op: Callable[..., Any]) -> Callable[..., Any]:
    """A vmap rule for `op`: the op once per batch entry, the outputs stacked. torch's own fallback does the
    same for an op that returns tensors, but none returns a list (the backward ops do); a kernel batched over
    vmap's dimension is not worth its code for `torch.func`'s uses (per-sample gradients, ensembles)."""
    def rule(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        outputs = [op(*(a if d is None else a.select(d, b) for a, d in zip(args, in_dims, strict=True)))
                   for b in range(info.batch_size)]
        if isinstance(outputs[0], Tensor):
            return torch.stack(outputs), 0
        stacked = [torch.stack(parts) for parts in zip(*outputs, strict=True)]
        return type(outputs[0])(stacked), type(outputs[0])(0 for _ in stacked)

    return rule


def launching_directly() -> AbstractContextManager[None]:
    """Inside it `wrap_triton(kernel)[grid](...)` launches the kernel itself. Outside a triton_op's kernel,
    wrap_triton hands every launch to the tracing machinery (`triton_kernel_wrapper_mutation`), which then
    launches: a body run in place of the op must switch that off as the triton_op does. The interpreter's
    kernels launch directly either way."""
    return set_wrap_triton_enabled(False)


def runs_body_directly(args: tuple[Any, ...], differentiable: bool) -> bool:
    """Whether an op's call may run its body in place of the op: in plain eager execution on plain tensors,
    where the body does what the dispatcher would have it do, about 10 µs sooner per call on the CPU box.

    Not while torch.compile traces (it must see the op, not the kernels' launches), under a dispatch or
    function mode (FakeTensorMode, FlopCounterMode, export's tracers, `with torch.device(...)`), a functorch
    transform, TorchScript tracing or the profiler (its trace names the op); not for tensor subclasses or meta
    tensors (the op's fake function answers those), nor for an op without autograd given a tensor that needs
    a gradient under grad mode (the op raises there; the body would return a result with no gradient).
    """
    if (torch.compiler.is_compiling() or torch.autograd.profiler._is_profiler_enabled
            or torch._C._len_torch_dispatch_stack() or torch._C._len_torch_function_stack()
            or torch._C._functorch.peek_interpreter_stack() is not None or torch._C._get_tracing_state()):
        return False
    graph = not differentiable and torch.is_grad_enabled()
    for arg in args:
        if isinstance(arg, Tensor) and (type(arg) not in _PLAIN_TENSORS or arg.is_meta
                                        or (graph and arg.requires_grad)):
            return False
    return True


_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)


def _distinct(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """args with each repeated tensor (tied values: v is k) replaced by a view of it, which costs no copy:
    Dynamo refuses to trace an autograd.Function given one tensor as two inputs. Compared with `is`, not by
    `id()`: Dynamo before torch 2.13 breaks the graph at `id()` of a tensor, and the frames it then compiles
    guard on each input's identity, so every call with new tensors compiled them again (seen on an H200)."""
    return tuple(
        arg.view_as(arg) if isinstance(arg, Tensor) and any(arg is earlier for earlier in args[:i]) else arg
        for i, arg in enumerate(args)
    )


def refuse_unbaked(name: str, baked: dict[str, Any], call: dict[str, Any]) -> None:
    """Raise if a specialised op set is called with a switch its source fixes otherwise: a copy baked for a causal
    mask (or SiLU, or no value) must not silently run a strict call (or GELU, or a product)."""
    wrong = [f"{k}={v!r}" for k, v in call.items() if k in baked and baked[k] != v]
    if wrong:
        raise ValueError(f"{name} was specialised for {baked}; this call needs {', '.join(wrong)}")


def maybe_autotune(configs: list[triton.Config], key: list[str]) -> Callable[[Any], Any]:
    """`triton.autotune` on CUDA, its choices kept on disk (`tuning.py`); identity under the interpreter (the
    caller then passes fixed tiles)."""

    def wrap(kernel: Any) -> Any:
        return kernel if INTERPRET else triton.autotune(configs=configs, key=key, **autotune_options())(kernel)

    return wrap


def launch_options(**fixed: Any) -> dict[str, Any]:
    """Meta-parameters to pass at launch: none when autotuned (the tuner owns them), `fixed` otherwise."""
    return fixed if INTERPRET else {}


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's `input_precision`: exact fp32 products ("ieee") under the interpreter and where PyTorch's own
    float32 matmuls are exact (`torch.get_float32_matmul_precision() == "highest"`, the default); "tf32"
    otherwise. 16-bit inputs ignore it."""
    if INTERPRET or (dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest"):
        return "ieee"
    return "tf32"


# Host-side integer helpers. Since Triton 3.5 `triton.cdiv` and `triton.next_power_of_2` are constexpr_functions,
# which cost about 2.6 us a call on the host (measured on the project's CPU box, Triton 3.9), and a fwd+bwd
# of one attention op computes nine of them; these are the same arithmetic as plain Python (SymInts included).


def cdiv(n: int, d: int) -> int:
    """ceil(n / d) for positive d, as `triton.cdiv`."""
    return (n + d - 1) // d


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), as `triton.next_power_of_2`."""
    n -= 1
    for shift in (1, 2, 4, 8, 16, 32):
        n |= n >> shift
    return n + 1


# Layouts. The kernels address each (B, H, T, D) tensor through its batch, head and row strides, with the
# features adjacent, so they read any such layout without a copy: head-major (contiguous); token-major, a
# (B, H, T, D) view of a contiguous (B, T, H, D) tensor, which is how heads split off a (B, T, H * D)
# projection arrive; and the column views of one wide projection (q, k and v as slices of a (B, T, 3 H D)
# product, whose rows are 3 H D apart). Outputs and gradients are written through strides of their own, in
# `empty_in_order`'s layout: token-major for token-major queries, so that merging heads back is a view too,
# and dense where an input is a column view, so that no gradient carries the wide product's gaps.


def autocast_inputs(*tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """Under autocast, the float32 and half inputs in autocast's dtype, as torch's own attention and matmuls
    take them there (float64 is left, as autocast leaves it); unchanged outside autocast. A generated layer's
    q, k and v can come from ops autocast treats differently (a projection in bfloat16, a norm or a
    concatenation in float32), and the kernels take one dtype. Tied inputs (v is k) stay tied."""
    kind = next(t for t in tensors if t is not None).device.type
    if not autocast_on(kind):
        return tensors
    dtype = torch.get_autocast_dtype(kind)
    out: list[Tensor | None] = []
    for i, t in enumerate(tensors):  # `is`, not `id()`: as in `_distinct`
        tied = next((j for j in range(i) if t is not None and tensors[j] is t), None)
        if tied is not None:
            out.append(out[tied])
        elif t is not None and t.is_floating_point() and t.dtype != torch.float64:
            out.append(t.to(dtype))
        else:
            out.append(t)
    return tuple(out)


def autocast_on(kind: str) -> bool:
    """Is autocast on for this device type? False for one autocast does not know (`meta`: asking raised)."""
    return torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)


def no_autocast(like: Tensor) -> AbstractContextManager[None]:
    """Autocast off on `like`'s device: for an op that calls itself again on inputs it has cast (the
    interpreter's float32 stand-in for bfloat16), which `autocast_inputs` would otherwise cast back."""
    if not torch.amp.is_autocast_available(like.device.type):
        return nullcontext()
    return torch.autocast(like.device.type, enabled=False)


def kernel_layout(t: Tensor) -> Tensor:
    """t itself if its features are adjacent (any batch, head and row strides), else a contiguous copy. Also a
    copy where rows would overflow the kernels' 32-bit row offsets (T row strides past 2^31); batch and head
    offsets are 64-bit."""
    if t.is_contiguous():
        return t
    T = t.shape[2]
    if t.stride(-1) == 1 and T * t.stride(2) < 2**31:
        return t
    return t.contiguous()


def kernel_layouts(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k and v through `kernel_layout`, tied values (v is k) laid out once and kept tied."""
    k, v = (kernel_layout(k),) * 2 if v is k else (kernel_layout(k), kernel_layout(v))
    return kernel_layout(q), k, v


def in_order_strides(like: Tensor, width: int) -> tuple[int, int, int, int]:
    """The strides of a dense (B, H, T, width) tensor laid out as `like` (as `kernel_layout` returns it) is:
    head-major if `like` is contiguous, else token-major; head-major also where token-major rows would overflow
    the kernels' 32-bit row offsets (T * H * width past 2^31; head-major rows are width apart)."""
    B, H, T, _ = like.shape
    if like.is_contiguous() or T * H * width >= 2**31:
        return (H * T * width, T * width, width, 1)
    return (T * H * width, width, H * width, 1)


def empty_in_order(like: Tensor, width: int, dtype: torch.dtype) -> Tensor:
    """An uninitialised (B, H, T, width) tensor with `in_order_strides(like, width)`."""
    B, H, T, _ = like.shape
    if like.is_contiguous():  # the host's fast path
        return torch.empty((B, H, T, width), dtype=dtype, device=like.device)
    return torch.empty_strided((B, H, T, width), in_order_strides(like, width), dtype=dtype, device=like.device)


def grad_layout(t: Tensor) -> tuple[int, ...]:
    """The strides of t's gradient as the kernels write it: t's own where t is contiguous, else dense
    (`in_order_strides`), so that no gradient carries a wide product's gaps."""
    return t.stride() if t.is_contiguous() else in_order_strides(t, t.shape[-1])


def empty_grad(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """An uninitialised gradient for the kernel input t, with `grad_layout(t)`."""
    if t.is_contiguous():  # the host's fast path (`empty_like` keeps t's strides): a microsecond less per tensor
        return torch.empty_like(t, dtype=dtype)
    return torch.empty_strided(t.shape, grad_layout(t), dtype=t.dtype if dtype is None else dtype, device=t.device)


def grad_strides(*inputs: Tensor) -> tuple[int, ...]:
    """The batch, head and row strides of each input's gradient (`grad_layout`), for a backward that fixes its
    kernels' arguments before it allocates every gradient (the softmax family's dQ, per backward mode)."""
    return tuple(s for t in inputs for s in grad_layout(t)[:3])
