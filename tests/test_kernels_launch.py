"""How every fused op is registered and called (`energydsl/kernels/launch.py`), on an op small enough to read.

Without CUDA the ops are registered as the interpreter registers them (TRITON_INTERPRET=1 set before triton is
first imported): torch.library custom_ops, wrapped by the same autograd wiring as on a GPU.
"""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
triton = pytest.importorskip("triton")

from energydsl.kernels import launch  # noqa: E402

if not (torch.cuda.is_available() or launch.INTERPRET):
    pytest.skip("energydsl.kernels was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

SETUPS: list[float] = []  # one entry per forward that saved something for a backward


def _scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


def _scale_fake(x: torch.Tensor, factor: float) -> torch.Tensor:
    return torch.empty_like(x)


def _setup(ctx, inputs, output) -> None:
    SETUPS.append(inputs[1])
    ctx.factor = inputs[1]


def _backward(ctx, grad: torch.Tensor):
    return grad * ctx.factor, None


SCALE = launch.register_op("test_launch_scale", _scale, _scale_fake, backward=_backward, setup_context=_setup)


def test_autograd_is_wired_around_the_op_not_through_it() -> None:
    """The call differentiates through a torch.autograd.Function around the op (the op's own registered
    autograd costs more host time per call); the op stays differentiable for direct callers; without grad
    mode the call is the op alone and saves nothing."""
    x = torch.randn(5, requires_grad=True)
    y = SCALE(x, 3.0)
    assert type(y.grad_fn).__name__ == "test_launch_scale_functionBackward"
    (gx,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(gx, torch.full_like(x, 3.0))

    direct = torch.ops.energydsl.test_launch_scale(x, 2.0)
    assert "GeneratedBackwardFor" in type(direct.grad_fn).__name__
    (gx,) = torch.autograd.grad(direct.sum(), x)
    assert torch.equal(gx, torch.full_like(x, 2.0))

    SETUPS.clear()
    with torch.no_grad():
        y = SCALE(x, 4.0)
    assert y.grad_fn is None and SETUPS == [] and torch.equal(y, x.detach() * 4.0)


def test_the_wired_op_compiles_without_graph_breaks() -> None:
    x = torch.randn(6, requires_grad=True)

    def loss(x: torch.Tensor) -> torch.Tensor:
        return SCALE(x.sin(), 1.5).square().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    want, got = loss(x), compiled(x)
    assert torch.allclose(got, want)
    assert torch.allclose(torch.autograd.grad(got, x)[0], torch.autograd.grad(want, x)[0])


def test_host_integer_helpers_are_tritons_arithmetic() -> None:
    """`launch.cdiv` / `launch.next_power_of_2` replace triton's (constexpr_functions since Triton 3.5, slow on
    the host) in every launch; they must agree with them wherever the ops use them (lengths, widths)."""
    for n in [*range(1, 2100), 4095, 4096, 4097, 65_535, 65_536, 1_000_003, 2**31 - 1, 2**31]:
        assert launch.next_power_of_2(n) == triton.next_power_of_2(n), n
        for d in (1, 16, 64, 128, 256):
            assert launch.cdiv(n, d) == triton.cdiv(n, d), (n, d)


def _mix(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + 2 * y


def _mix_setup(ctx, inputs, output) -> None:
    pass


MIX = launch.register_op("test_launch_mix", _mix, lambda x, y: torch.empty_like(x),
                         backward=lambda ctx, grad: (grad, 2 * grad), setup_context=_mix_setup)


def test_one_tensor_given_twice_compiles() -> None:
    """Tied values pass one tensor as k and v; Dynamo refuses an autograd.Function given one tensor twice, so
    a compiled call passes the repeat as a view of it (no copy), and both gradients reach it."""
    x = torch.randn(4, requires_grad=True)

    def loss(x: torch.Tensor) -> torch.Tensor:
        return MIX(x, x).sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    got = compiled(x)
    assert torch.allclose(got, 3 * x.sum())
    assert torch.equal(torch.autograd.grad(got, x)[0], torch.full_like(x, 3.0))


CALLS: list[str] = []  # one entry per run of a probe's body: "op" (through the dispatcher) or "body"


def _dispatched() -> str:
    """"op" when the caller's stack passes through torch's operator call (`torch/_ops.py`), else "body"."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(os.path.join("torch", "_ops.py")):
            return "op"
        frame = frame.f_back
    return "body"


def _probe_bwd(grad: torch.Tensor, factor: float) -> torch.Tensor:
    CALLS.append(_dispatched())
    return grad * factor


def _probe_fwd(x: torch.Tensor, factor: float) -> torch.Tensor:
    CALLS.append(_dispatched())
    if CALLS[-1] == "body":  # launches go straight to the kernels, as inside a triton_op's own kernel
        assert not torch._library.triton.is_wrap_triton_enabled()
    return x * factor


def _probe_setup(ctx, inputs, output) -> None:
    ctx.factor = inputs[1]


PROBE_BWD = launch.register_op("test_launch_probe_bwd", _probe_bwd, lambda g, factor: torch.empty_like(g))
PROBE = launch.register_op("test_launch_probe", _probe_fwd, lambda x, factor: torch.empty_like(x),
                           backward=lambda ctx, grad: (PROBE_BWD(grad, ctx.factor), None),
                           setup_context=_probe_setup)


def test_plain_eager_calls_run_the_bodies_without_the_dispatcher() -> None:
    """In plain eager execution an op's call runs its body directly, forward (with and without grad) and the
    backward's op too: the dispatcher's round trip is host time a short sequence waits for on a GPU."""
    x = torch.randn(5, requires_grad=True)
    CALLS.clear()
    with torch.no_grad():
        assert torch.equal(PROBE(x, 2.0), x.detach() * 2)
    y = PROBE(x, 3.0)
    (gx,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(gx, torch.full_like(x, 3.0))
    assert CALLS == ["body", "body", "body"]


class _Seen(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_what_must_see_the_op_gets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile, dispatch and function modes, the profiler, functorch, TorchScript tracing, fake and meta
    tensors, and a graph through an op with no autograd of its own all get the op, not its body."""
    x = torch.randn(5)
    CALLS.clear()
    seen = _Seen()
    with seen:
        PROBE(x, 2.0)
    assert CALLS == ["op"] and "energydsl.test_launch_probe.default" in seen.ops

    CALLS.clear()
    with torch.device("cpu"):  # a function mode
        PROBE(x, 2.0)
    assert CALLS == ["op"]

    CALLS.clear()
    with torch.profiler.profile() as profile:
        PROBE(x, 2.0)
    assert CALLS == ["op"] and any(e.name == "energydsl::test_launch_probe" for e in profile.events())

    CALLS.clear()
    rows = torch.randn(3, 5)
    with torch.no_grad():  # vmap runs the op once per row (its batching fallback), on unwrapped tensors
        assert torch.equal(torch.func.vmap(lambda t: PROBE(t, 2.0))(rows), rows * 2)
    assert CALLS == ["op"] * 3

    CALLS.clear()
    with torch.no_grad(), pytest.warns(Warning):  # TorchScript tracing is deprecated; it records the op
        traced = torch.jit.trace(lambda t: PROBE(t, 2.0), (x,), check_trace=False)
    assert "energydsl::test_launch_probe" in str(traced.graph) and CALLS == ["op"]

    CALLS.clear()
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
    assert type(PROBE(fake, 2.0)) is type(fake) and CALLS == []  # the fake function answered, outside the mode
    assert PROBE(x.to("meta"), 2.0).is_meta and CALLS == []

    CALLS.clear()
    with pytest.raises(RuntimeError, match="(?i)autograd"):
        PROBE_BWD(torch.randn(5, requires_grad=True), 2.0).sum().backward()
    assert CALLS == ["op"]

    CALLS.clear()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    PROBE(x, 2.0)
    assert CALLS == ["op"]


def test_layouts_the_kernels_take_in_place() -> None:
    """Every (B, H, T, D) layout with adjacent features goes to the kernels as it is: head-major, token-major,
    column views of a wider tensor (q, k, v of one wide projection), heads broadcast by a stride 0; anything
    else is copied. Outputs and gradients are dense, laid out as `empty_in_order` lays out: head-major for a
    contiguous input, token-major for any other."""
    head = torch.randn(2, 3, 5, 4)
    token = torch.randn(2, 5, 3, 4).transpose(1, 2)
    sliced = torch.randn(2, 3, 5, 8)[..., :4]
    packed = torch.randn(2, 5, 3 * 12)[..., 12:24].unflatten(-1, (3, 4)).transpose(1, 2)  # k of q | k | v
    expanded = torch.randn(2, 1, 5, 4).expand(2, 3, 5, 4)
    for t in (head, token, sliced, packed, expanded):
        assert launch.kernel_layout(t) is t
    odd = head.transpose(2, 3).contiguous().transpose(2, 3)  # features T apart
    copied = launch.kernel_layout(odd)
    assert copied.is_contiguous() and torch.equal(copied, odd)
    # rows are addressed by 32-bit offsets: T row strides up to 2^31 hold, past it a copy; batch and head
    # offsets are 64-bit
    fits, huge = (torch.empty(1, T, 128, 128, device="meta").transpose(1, 2) for T in (2**17 - 1, 2**17))
    assert launch.kernel_layout(fits) is fits and launch.kernel_layout(huge).is_contiguous()
    wide_rows = torch.empty(1, 2**16, 3 * 128 * 128, device="meta")[..., : 128 * 128].unflatten(-1, (128, 128))
    assert launch.kernel_layout(wide_rows.transpose(1, 2)).is_contiguous()  # 2^16 rows 3 * 2^14 apart
    # outputs and gradients are token-major only where their own rows fit (a wider value than the query's)
    assert launch.in_order_strides(fits, 128)[2] == 128 * 128
    assert launch.in_order_strides(fits, 129) == (128 * (2**17 - 1) * 129, (2**17 - 1) * 129, 129, 1)
    assert launch.empty_in_order(token, 6, torch.float16).stride() == (90, 6, 18, 1)
    assert launch.empty_in_order(head, 6, torch.float16).stride() == (90, 30, 6, 1)
    for t in (token, sliced, packed, expanded):
        grad = launch.empty_grad(t, torch.float32)
        assert grad.dtype == torch.float32 and grad.shape == t.shape and grad.stride() == (60, 4, 12, 1)
    assert launch.empty_grad(head).stride() == head.stride()
    assert launch.grad_strides(head, packed) == (60, 20, 4, 60, 4, 12)
    # tied values stay one tensor (one copy at most); untied ones are laid out each on its own
    q, k, v = launch.kernel_layouts(token, odd, odd)
    assert q is token and v is k and k.is_contiguous() and torch.equal(k, odd)
    q, k, v = launch.kernel_layouts(head, token, odd)
    assert q is head and k is token and v is not k and v.is_contiguous()


def _families() -> dict:
    """Each kernel family's op as a function of (q, k, v), and its (Dk, Dv): narrow and wide tiles."""
    from energydsl.kernels import attention, linear, pointwise

    return {
        "softmax": (lambda q, k, v: attention.GENERIC.energy_attention(q, k, v, scale=0.3), 16, 8),
        "softmax-wide": (lambda q, k, v: attention.GENERIC_WIDE.energy_attention(q, k, v, scale=0.3), 40, 24),
        "linear": (lambda q, k, v: linear.GENERIC.linear_attention(q, k, v, scale=0.3), 16, 8),
        "sigmoid": (lambda q, k, v: pointwise.SIGMOID.pointwise_attention(q, k, v, scale=0.3), 16, 8),
        "sigmoid-wide": (lambda q, k, v: pointwise.SIGMOID_WIDE.pointwise_attention(q, k, v, scale=0.3), 40, 24),
    }


@pytest.mark.parametrize("family", ["softmax", "softmax-wide", "linear", "sigmoid", "sigmoid-wide"])
def test_heads_of_one_wide_projection_need_no_copy(family: str) -> None:
    """q, k and v split off one (B, T, H (2 Dk + Dv)) product, as a fused projection gives them: column views
    the kernels read through their strides, their gradients written densely through strides of their own (so
    the split's backward concatenates them); no sequence-long copy forward or backward, and the output and
    the product's gradient are those of contiguous heads."""
    from torch.profiler import profile

    op, Dk, Dv = _families()[family]
    B, T, H = 2, 13, 3
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(B, T, H * (2 * Dk + Dv), generator=gen).requires_grad_()
    do = torch.randn(B, H, T, Dv, generator=gen)

    def heads(product: torch.Tensor) -> list[torch.Tensor]:
        return [t.unflatten(-1, (H, -1)).transpose(1, 2) for t in product.split([H * Dk, H * Dk, H * Dv], -1)]

    with profile(record_shapes=True) as prof:
        out = op(*heads(wide))
        out.backward(do)
    copies = [(e.name, e.input_shapes[0]) for e in prof.events()
              if e.name in ("aten::clone", "aten::copy_") and e.input_shapes and T in e.input_shapes[0]]
    assert not copies, copies
    dense = wide.detach().clone().requires_grad_()
    expected = op(*(t.contiguous() for t in heads(dense)))
    expected.backward(do)
    for got, want in ((out, expected), (wide.grad, dense.grad)):
        assert (got - want).norm() <= 1e-6 * want.norm()


def test_autocast_inputs_casts_as_autocast_does_and_keeps_ties() -> None:
    """In autocast's dtype under autocast (float32 and half alike), float64 and integers left as autocast leaves
    them, tied tensors (v is k) one cast; outside autocast the very tensors given."""
    from energydsl.kernels.launch import autocast_inputs

    q, k = torch.randn(2, 3), torch.randn(2, 3)
    wide, ints = torch.randn(2, dtype=torch.float64), torch.arange(3)
    assert all(a is b for a, b in zip(autocast_inputs(q, k, k, None), (q, k, k, None)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cq, ck, cv, none, cw, ci = autocast_inputs(q, k, k, None, wide, ints)
        assert (cq.dtype, ck.dtype) == (torch.bfloat16, torch.bfloat16) and cv is ck and none is None
        assert cw is wide and ci is ints
        assert autocast_inputs(q.half())[0].dtype == torch.bfloat16


def _tied_twice(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    a, b, c = launch._distinct((q, k, k))
    return a + b * c


def _cast_tied(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a, b, c = launch.autocast_inputs(q, k, k)
    return a.float() + b.float() * c.float()


@pytest.mark.parametrize("fn", [_tied_twice, _cast_tied], ids=["distinct", "autocast"])
def test_tied_inputs_are_told_apart_without_guarding_on_identity(fn) -> None:
    """The checks for a repeated tensor (v is k) compile once for every call: `id()` of a tensor made Dynamo
    guard on each input's identity, so new tensors compiled the frame again on every call (before torch 2.13
    it broke the graph there too; on an H200 a compiled MHA took 716 ms per step)."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            q, k = torch.randn(4), torch.randn(4)
            torch.testing.assert_close(compiled(q, k), fn(q, k))
