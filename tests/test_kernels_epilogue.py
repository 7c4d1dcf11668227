"""Fused elementwise epilogues (gated activation, momentum, Nesterov look-ahead) against plain torch.

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1 set before triton is first
imported); float32 kernels are compared with float64 references by max|kernel - ref| / max|ref|.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import compile_for_gpu

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
pytest.importorskip("triton")

from energydsl.kernels import epilogue as E  # noqa: E402
from energydsl.kernels.epilogue import gated_activation, momentum_update, nesterov_lookahead  # noqa: E402
from energydsl.kernels.epilogue_ref import (  # noqa: E402
    ACTIVATIONS,
    gated_activation_ref,
    momentum_update_ref,
    nesterov_lookahead_ref,
)

if not (torch.cuda.is_available() or E.INTERPRET):
    pytest.skip("energydsl.kernels was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4
# odd sizes: several programs (the interpreter's blocks are 256 elements) and a masked tail
SHAPES = [(1,), (3, 333), (2, 5, 7, 11)]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    err = (got.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    return err / scale if scale > 0 else err


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(device=DEVICE, dtype=dtype).requires_grad_()


def as_float64(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().double().requires_grad_(t.requires_grad) for t in tensors]


def grads(
    outputs: tuple[torch.Tensor, ...], inputs: list[torch.Tensor], upstream: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, ...]:
    upstream = tuple(u.to(o.dtype) for u, o in zip(upstream, outputs, strict=True))
    return torch.autograd.grad(outputs, inputs, upstream)


# ---------------------------------------------------------------------------------------------------------
# gated_activation
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gated_activation(activation: str, shape: tuple[int, ...]) -> None:
    gate = randn(*shape, seed=1, scale=3.0)  # wide enough to reach both tails of sigmoid / tanh / gelu
    value = randn(*shape, seed=2)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    y = gated_activation(gate, value, activation)
    g = grads((y,), [gate, value], (dy,))
    gate64, value64 = as_float64(gate, value)
    y_ref = gated_activation_ref(gate64, value64, activation)
    g_ref = grads((y_ref,), [gate64, value64], (dy,))
    assert y.dtype == torch.float32 and y.shape == shape
    assert rel_err(y, y_ref) < TOL
    for a, b in zip(g, g_ref, strict=True):
        assert rel_err(a, b) < TOL


@pytest.mark.parametrize("activation", ["silu", "tanh"])
def test_an_activation_alone(activation: str) -> None:
    """value None: sigma(gate) in one pass, its gradient dy * sigma'(gate); the op returns no value gradient."""
    gate = randn(3, 333, seed=6, scale=3.0)  # several programs and a masked tail under the interpreter
    dy = torch.randn(3, 333, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    y = gated_activation(gate, None, activation)
    (g,) = grads((y,), [gate], (dy,))
    (gate64,) = as_float64(gate)
    y_ref = gated_activation_ref(gate64, None, activation)
    (g_ref,) = grads((y_ref,), [gate64], (dy,))
    assert y.dtype == torch.float32 and rel_err(y, y_ref) < TOL and rel_err(g, g_ref) < TOL


def test_gated_activation_non_contiguous() -> None:
    gate = randn(40, 30, seed=4).t()
    value = randn(30, 40, seed=5)
    y = gated_activation(gate, value, "silu")
    torch.testing.assert_close(y, gated_activation_ref(gate, value, "silu"), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------
# momentum_update and nesterov_lookahead
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_momentum_update(shape: tuple[int, ...]) -> None:
    x, m, f = (randn(*shape, seed=s) for s in (1, 2, 3))
    beta = torch.tensor(0.9, device=DEVICE, requires_grad=True)
    eta = torch.tensor(-0.3, device=DEVICE, requires_grad=True)
    gen = torch.Generator().manual_seed(4)
    up = (torch.randn(shape, generator=gen).to(DEVICE), torch.randn(shape, generator=gen).to(DEVICE))
    out = momentum_update(x, m, f, beta, eta)
    g = grads(out, [x, m, f, beta, eta], up)
    ins64 = as_float64(x, m, f, beta, eta)
    out_ref = momentum_update_ref(*ins64)
    g_ref = grads(out_ref, ins64, up)
    for a, b in zip(out, out_ref, strict=True):
        assert a.dtype == torch.float32 and rel_err(a, b) < TOL
    for a, b in zip(g, g_ref, strict=True):
        assert a.shape == b.shape and rel_err(a, b) < TOL


def test_momentum_update_only_position_used() -> None:
    """m_new unused downstream: its (absent) gradient counts as zero; float step sizes are constants."""
    x, m, f = (randn(300, seed=s) for s in (5, 6, 7))
    x_new, _ = momentum_update(x, m, f, 0.5, 0.1)
    dx, dm, df = torch.autograd.grad(x_new.square().sum(), [x, m, f])
    x64, m64, f64 = as_float64(x, m, f)
    x_ref, _ = momentum_update_ref(x64, m64, f64, torch.tensor(0.5), torch.tensor(0.1))
    for a, b in zip((dx, dm, df), torch.autograd.grad(x_ref.square().sum(), [x64, m64, f64]), strict=True):
        assert rel_err(a, b) < TOL


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_nesterov_lookahead(shape: tuple[int, ...]) -> None:
    x, m = randn(*shape, seed=8), randn(*shape, seed=9)
    beta = torch.tensor([0.7], device=DEVICE, requires_grad=True)  # one element, shape (1,): kept
    up = torch.randn(shape, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    y = nesterov_lookahead(x, m, beta)
    g = grads((y,), [x, m, beta], (up,))
    x64, m64, beta64 = as_float64(x, m, beta)
    y_ref = nesterov_lookahead_ref(x64, m64, beta64)
    g_ref = grads((y_ref,), [x64, m64, beta64], (up,))
    assert rel_err(y, y_ref) < TOL
    for a, b in zip(g, g_ref, strict=True):
        assert a.shape == b.shape and rel_err(a, b) < TOL


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_nesterov_ops_at_minus_a_learned_beta(shape: tuple[int, ...]) -> None:
    """A set built by `nesterov_ops` (as a generated file builds its copy), called as nag's look-ahead is:
    c = -beta, a tensor expression of a learned beta, so d beta = -sum g m flows through c."""
    from energydsl.kernels import epilogue_kernels as K

    ops = E.nesterov_ops("nesterov_learned_c", K._nesterov_fwd_kernel, K._nesterov_bwd_kernel, {})
    x, m = randn(*shape, seed=15), randn(*shape, seed=16)
    beta = torch.tensor(0.9, device=DEVICE, requires_grad=True)
    up = torch.randn(shape, generator=torch.Generator().manual_seed(17)).to(DEVICE)
    y = ops.nesterov_lookahead(x, m, -1.0 * beta)
    g = grads((y,), [x, m, beta], (up,))
    x64, m64, beta64 = as_float64(x, m, beta)
    y_ref = nesterov_lookahead_ref(x64, m64, -1.0 * beta64)
    g_ref = grads((y_ref,), [x64, m64, beta64], (up,))
    assert y.dtype == torch.float32 and rel_err(y, y_ref) < TOL
    for a, b in zip(g, g_ref, strict=True):
        assert a.shape == b.shape and rel_err(a, b) < TOL


def test_nesterov_falls_back_to_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors no kernel can take (CPU without the interpreter) get the reference, gradients included."""
    if torch.cuda.is_available():
        pytest.skip("the fallback is for CPU tensors without the interpreter")
    monkeypatch.delenv("TRITON_INTERPRET")  # the kernels were built interpreted; no tensor goes to them now
    monkeypatch.setattr(E.GENERIC_NESTEROV, "_fwd_op", lambda *a: pytest.fail("a kernel was launched"))
    x, m = randn(3, 5, seed=18), randn(3, 5, seed=19)
    c = torch.tensor(-0.5, requires_grad=True)
    y = nesterov_lookahead(x, m, c)
    torch.testing.assert_close(y, x + c * m)
    assert torch.autograd.grad(y.sum(), c)[0].item() == pytest.approx(m.sum().item(), rel=1e-5)


# ---------------------------------------------------------------------------------------------------------
# Op plumbing: the autograd.Function path, torch.compile, errors
# ---------------------------------------------------------------------------------------------------------


def _all_ops(x: torch.Tensor, m: torch.Tensor, f: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    look = nesterov_lookahead(x, m, beta)
    force = gated_activation(look, f, "gelu") + gated_activation(f, None, "tanh")
    x_new, m_new = momentum_update(x, m, force, beta, 0.25)
    return (x_new * m_new).sum()


def _all_inputs() -> list[torch.Tensor]:
    return [randn(7, 45, seed=s) for s in (11, 12, 13)] + [
        torch.tensor(0.8, device=DEVICE, requires_grad=True)
    ]


def test_torch_compile() -> None:
    inputs = _all_inputs()
    backend = "aot_eager" if E.INTERPRET else "inductor"
    compiled = torch.compile(_all_ops, backend=backend, fullgraph=True)
    out_c = compiled(*inputs)
    g_c = torch.autograd.grad(out_c, inputs)
    out_e = _all_ops(*inputs)
    g_e = torch.autograd.grad(out_e, inputs)
    assert rel_err(out_c, out_e) < TOL
    for a, b in zip(g_c, g_e, strict=True):
        assert rel_err(a, b) < TOL


@pytest.mark.parametrize("with_value", [True, False])
def test_direct_gated_op_calls_pass_opcheck(with_value: bool) -> None:
    """The registered ops (schema, fake, autograd) with a value and with none (the backward returns a list:
    an op returns no optional tensor)."""
    gate, value = randn(4, 300, seed=21), randn(4, 300, seed=22)
    value = value if with_value else None
    ops = torch.ops.energydsl
    torch.library.opcheck(ops.gated_activation_fwd.default, (gate, value, "gelu"))
    plain = [t if t is None else t.detach() for t in (gate, value)]  # the backward op is not differentiable
    torch.library.opcheck(ops.gated_activation_bwd.default, (torch.randn_like(gate), *plain, "gelu"))


def test_op_sets_are_registered_once_per_name() -> None:
    """A generated module imported twice builds its op sets twice: the first registration is kept, as
    torch.library refuses a name it already holds."""
    from energydsl.kernels import epilogue_kernels as K

    gated = E.gated_activation_ops("gated_twice", K._gated_fwd_kernel, K._gated_bwd_kernel, {})
    assert E.gated_activation_ops("gated_twice", K._gated_fwd_kernel, K._gated_bwd_kernel, {}) is gated
    momentum = E.momentum_ops("momentum_twice", K._momentum_fwd_kernel, K._momentum_bwd_kernel, {})
    assert E.momentum_ops("momentum_twice", K._momentum_fwd_kernel, K._momentum_bwd_kernel, {}) is momentum
    nesterov = E.nesterov_ops("nesterov_twice", K._nesterov_fwd_kernel, K._nesterov_bwd_kernel, {})
    assert E.nesterov_ops("nesterov_twice", K._nesterov_fwd_kernel, K._nesterov_bwd_kernel, {}) is nesterov
    x = randn(5, seed=14)
    torch.testing.assert_close(gated.gated_activation(x, x, "relu"), gated_activation_ref(x, x, "relu"))


def test_errors() -> None:
    a, b = torch.zeros(3), torch.zeros(4)
    with pytest.raises(ValueError, match="unknown activation"):
        gated_activation(a, a, "swish")
    with pytest.raises(ValueError, match="one shape"):
        gated_activation(a, b, "silu")
    with pytest.raises(ValueError, match="one shape"):
        momentum_update(a, a, b, 0.9, 0.1)
    with pytest.raises(ValueError, match="scalar"):
        nesterov_lookahead(a, a, torch.ones(2))


# ---------------------------------------------------------------------------------------------------------
# GPU (compiled Triton): float32 and bfloat16, large tensors
# ---------------------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_value", [True, False], ids=["value", "alone"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gpu_gated_activation(activation: str, dtype: torch.dtype, with_value: bool) -> None:
    shape = (4, 2048, 1000)  # 8.2M elements, not a multiple of any block
    gate, value = randn(*shape, seed=1, dtype=dtype, scale=3.0), randn(*shape, seed=2, dtype=dtype)
    inputs = [gate, value] if with_value else [gate]
    dy = torch.randn(shape, device=DEVICE, dtype=dtype)
    y = gated_activation(gate, value if with_value else None, activation)
    g = grads((y,), inputs, (dy,))
    refs = as_float64(*inputs)
    y_ref = gated_activation_ref(refs[0], refs[1] if with_value else None, activation)
    g_ref = grads((y_ref,), refs, (dy.double(),))
    tol = TOL if dtype == torch.float32 else 1e-2  # bf16: one rounding of each output
    assert y.dtype == dtype and rel_err(y, y_ref) < tol
    for a, b in zip(g, g_ref, strict=True):
        assert a.dtype == dtype and rel_err(a, b) < tol


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_momentum_and_nesterov(dtype: torch.dtype) -> None:
    shape = (8, 2048, 513)
    x, m, f = (randn(*shape, seed=s, dtype=dtype) for s in (1, 2, 3))
    beta = torch.tensor(0.9, device=DEVICE, requires_grad=True)
    eta = torch.tensor(0.2, device=DEVICE, requires_grad=True)
    up = (torch.randn(shape, device=DEVICE, dtype=dtype), torch.randn(shape, device=DEVICE, dtype=dtype))
    out = momentum_update(nesterov_lookahead(x, m, beta), m, f, beta, eta)
    g = grads(out, [x, m, f, beta, eta], up)
    ins64 = as_float64(x, m, f, beta, eta)
    out_ref = momentum_update_ref(nesterov_lookahead_ref(ins64[0], ins64[1], ins64[3]), *ins64[1:])
    g_ref = grads(out_ref, ins64, tuple(u.double() for u in up))
    # bf16: outputs rounded once per op; the scalar gradients are fp32 sums over 8M terms
    tol = TOL if dtype == torch.float32 else 2e-2
    for a, b in zip(out, out_ref, strict=True):
        assert a.dtype == dtype and rel_err(a, b) < tol
    for a, b in zip(g, g_ref, strict=True):
        assert rel_err(a, b) < tol


# ---------------------------------------------------------------------------------------------------------
# Without a GPU: the compiled (non-interpreted) kernels at least compile for sm_90 (ptxas ships with triton)
# ---------------------------------------------------------------------------------------------------------

_COMPILE_SCRIPT = """
import itertools
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from energydsl.kernels import epilogue as E
from energydsl.kernels import epilogue_kernels as K

assert not E.INTERPRET


def build(kernel, ptrs, consts, dt):
    sig = {p: "*fp32" if p.startswith(("beta", "eta", "c_", "pbeta", "peta", "pc_")) else "*" + dt for p in ptrs}
    sig |= {"N": "i32"} | {c: "constexpr" for c in consts}
    src = ASTSource(kernel, sig, constexprs=consts)  # the templates: plain @triton.jit functions
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})


for dt in ("fp32", "bf16"):
    for act, has_value in itertools.product(E.ACTIVATIONS, (True, False)):
        consts = dict(ACT=act, HAS_VALUE=has_value, BLOCK=2048)
        build(K._gated_fwd_kernel, ["gate_ptr", "value_ptr", "out_ptr"], consts, dt)
        ptrs = ["gate_ptr", "value_ptr", "dout_ptr", "dgate_ptr", "dvalue_ptr"]
        build(K._gated_bwd_kernel, ptrs, consts, dt)
    ptrs = ["x_ptr", "m_ptr", "f_ptr", "beta_ptr", "eta_ptr", "x_out_ptr", "m_out_ptr"]
    build(K._momentum_fwd_kernel, ptrs, dict(BLOCK=2048), dt)
    ptrs = ["gx_ptr", "gm_ptr", "m_ptr", "f_ptr", "beta_ptr", "eta_ptr", "dm_ptr", "df_ptr"]
    ptrs += ["pbeta_ptr", "peta_ptr"]
    build(K._momentum_bwd_kernel, ptrs, dict(BLOCK=4096), dt)
    build(K._nesterov_fwd_kernel, ["x_ptr", "m_ptr", "c_ptr", "out_ptr"], dict(BLOCK=2048), dt)
    build(K._nesterov_bwd_kernel, ["g_ptr", "m_ptr", "c_ptr", "dm_ptr", "pc_ptr"], dict(BLOCK=4096), dt)
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_gpu() -> None:
    """Catches errors of the GPU code path on a CPU-only machine."""
    compile_for_gpu(_COMPILE_SCRIPT)
