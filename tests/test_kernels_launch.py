"""How every fused op is registered and called (`energydsl/kernels/launch.py`), on an op small enough to read.

Without CUDA the ops are registered as the interpreter registers them (TRITON_INTERPRET=1 set before triton is
first imported): torch.library custom_ops, wrapped by the same autograd wiring as on a GPU.
"""

import os

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


def test_layouts_the_kernels_take_in_place() -> None:
    """Head-major and token-major (B, H, T, D) tensors go to the kernels as they are; any other layout is
    copied. Outputs follow the query's layout; gradients, allocated by `torch.empty_like`, their input's."""
    head = torch.randn(2, 3, 5, 4)
    token = torch.randn(2, 5, 3, 4).transpose(1, 2)
    sliced = torch.randn(2, 3, 5, 8)[..., :4]
    expanded = torch.randn(2, 1, 5, 4).expand(2, 3, 5, 4)
    assert launch.kernel_layout(head) is head and launch.kernel_layout(token) is token
    for other in (sliced, expanded, head.transpose(2, 3)):
        copied = launch.kernel_layout(other)
        assert copied.is_contiguous() and torch.equal(copied, other)
    # token-major rows span T * H * D elements: up to 2^31 the kernels' 32-bit row offsets hold, past it a copy
    fits, huge = (torch.empty(1, T, 128, 128, device="meta").transpose(1, 2) for T in (2**17 - 1, 2**17))
    assert launch.kernel_layout(fits) is fits and launch.kernel_layout(huge).is_contiguous()
    assert launch.empty_in_order(token, 6, torch.float16).stride() == (90, 6, 18, 1)
    assert launch.empty_in_order(head, 6, torch.float16).stride() == (90, 30, 6, 1)
    assert torch.empty_like(token, dtype=torch.float32).stride() == token.stride()  # what the backward relies on
    # tied values stay one tensor (one copy at most); untied ones are laid out each on its own
    q, k, v = launch.kernel_layouts(token, sliced, sliced)
    assert q is token and v is k and k.is_contiguous() and torch.equal(k, sliced)
    q, k, v = launch.kernel_layouts(head, token, sliced)
    assert q is head and k is token and v is not k and v.is_contiguous()
