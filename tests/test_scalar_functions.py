"""The printers of scalar functions for fused kernels (`energydsl/codegen/scalar_functions.py`): every
element-wise function of the registry, the derivatives SymPy derives and the closed-form antiderivatives, printed
as Triton G, G' and (G, G') and as torch G, against torch autograd of the registry's own function in float64.

Without CUDA the printed functions run under the Triton interpreter (TRITON_INTERPRET=1 is set before triton is
first imported), in float32.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path

import pytest
import sympy as sp
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
pytest.importorskip("triton")

from energydsl import ir  # noqa: E402
from energydsl.codegen.scalar_functions import TRITON_FUNCTIONS, VAR, scalar_function  # noqa: E402
from energydsl.functions import REGISTRY, antiderivative, derivative  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# the registry's own functions, the derivatives SymPy derives for those with no stable one listed (GELU'', SiLU'',
# 1/(2 sqrt x)), and antiderivatives with a closed form (∫GELU, ∫sigmoid, ∫tanh)
BASE = sorted(n for n in REGISTRY if not n.startswith("int_") and "'" not in n)
DERIVED = sorted({derivative(n) for n in BASE} - set(BASE))
INTEGRALS = [antiderivative(n) for n in ("gelu", "sigmoid", "tanh", "exp")]
POSITIVE = {"log", "sqrt", "inv", "dsqrt", "dinv"}  # functions of x > 0 only
TOLERANCE: dict[str, float] = {}  # per function, where 1e-5 is too tight

_APPLY = '''
import triton
import triton.language as tl


@triton.jit
def value(x):
{value}


@triton.jit
def grad(x):
{grad}


@triton.jit
def pair(x):
{pair}


@triton.jit
def apply(X, Y, DY, PY, PDY, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N, other=1.0)
    tl.store(Y + offs, value(x), mask=offs < N)
    tl.store(DY + offs, grad(x), mask=offs < N)
    y, dy = pair(x)
    tl.store(PY + offs, y, mask=offs < N)
    tl.store(PDY + offs, dy, mask=offs < N)
'''


class _Emitter:
    """What the printers read of an emitter: the scalars' sources (a dimension `d` here)."""

    scalars = {sp.Symbol("d"): "4"}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30)).item()


def _load(tmp_path: Path, name: str, printed) -> object:
    path = tmp_path / f"printed_{name.replace(chr(39), '_')}.py"
    path.write_text(_APPLY.format(**{k: _indent(getattr(printed, k)) for k in ("value", "grad", "pair")}))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _indent(body: str) -> str:
    return "\n".join("    " + line for line in body.splitlines())


@pytest.mark.parametrize("name", BASE + DERIVED + INTEGRALS)
def test_each_function_prints_to_triton_with_its_derivative(name: str, tmp_path: Path) -> None:
    """G = (2/d) f(1.5 s) with d = 4 (so products, numbers and a dimension print too): the Triton G, G' and
    (G, G') match torch's f and its autograd derivative in float64, on points away from the kinks (and inside
    the domain of log, sqrt and 1/x); the torch G matches in float64 to rounding."""
    two_over_d = ir.Scalar(2 / sp.Symbol("d"))
    g = ir.mul(two_over_d, ir.func(name, ir.mul(ir.scalar(1.5), VAR)))
    printed = scalar_function(_Emitter(), g)  # type: ignore[arg-type]
    assert printed is not None
    module = _load(tmp_path, name, printed)
    x = torch.linspace(0.13, 2.9, 16, dtype=torch.float64)
    x = torch.cat([x, -x]) if name not in POSITIVE else torch.cat([x, x + 3])
    outs = [torch.empty(32, device=DEVICE) for _ in range(4)]
    module.apply[(1,)](x.float().to(DEVICE), *outs, 32, BLOCK=32)
    xr = x.clone().requires_grad_()
    want = 0.5 * REGISTRY[name](1.5 * xr)
    # step, one and zero are constant where they are differentiable: torch builds no graph for them
    want_grad = torch.autograd.grad(want.sum(), xr)[0] if want.requires_grad else torch.zeros_like(x)
    y, dy, pair_y, pair_dy = (o.cpu() for o in outs)
    assert rel_err(y, want) < TOLERANCE.get(name, 1e-5)
    assert rel_err(dy, want_grad) < TOLERANCE.get(name, 1e-5)
    assert torch.equal(pair_y, y) and torch.equal(pair_dy, dy)  # the pair is the two, locals shared
    reference = eval(f"lambda x: {printed.torch}", {"torch": torch, "F": torch.nn.functional})
    assert rel_err(reference(x), want) < 1e-12


def test_functions_with_a_stable_form_print_it_and_the_others_their_formula() -> None:
    """softplus takes the overflow-free form of `TRITON_FUNCTIONS`; ∫GELU, listed nowhere, prints from SymPy's
    closed form, its numbers folded into one (√2 · x / 2 as 0.7071… x, not 1.414… · 0.5 · x)."""
    assert "tl.exp(-tl.abs(x))" in scalar_function(_Emitter(), ir.func("softplus", VAR)).value  # type: ignore
    name = antiderivative("gelu")
    assert name not in TRITON_FUNCTIONS
    printed = scalar_function(_Emitter(), ir.func(name, VAR))  # type: ignore[arg-type]
    assert printed is not None and "tl.math.erf(" in printed.value
    assert "0.7071067811865476 * x" in printed.value and "1.4142135623730951" not in printed.value


def test_a_softplus_weight_does_not_overflow_where_the_naive_form_does(tmp_path: Path) -> None:
    """softplus(100) in float32: log(1 + e^100) is inf; the printed form gives 100."""
    printed = scalar_function(_Emitter(), ir.func("softplus", VAR))  # type: ignore[arg-type]
    module = _load(tmp_path, "softplus_large", printed)
    x = torch.tensor([100.0, -100.0, 0.0], device=DEVICE)
    outs = [torch.empty(3, device=DEVICE) for _ in range(4)]
    module.apply[(1,)](x, *outs, 3, BLOCK=4)
    torch.testing.assert_close(outs[0].cpu(), torch.tensor([100.0, 0.0, 0.6931472]))
    torch.testing.assert_close(outs[1].cpu(), torch.tensor([1.0, 0.0, 0.5]))


@pytest.mark.parametrize("name", ["sigmoid", "tanh"])
def test_antiderivatives_stay_finite_where_sympys_closed_forms_overflow(name: str, tmp_path: Path) -> None:
    """SymPy's ∫tanh = x - log(1 + tanh x) is inf in float32 once tanh x rounds to -1 (x < -9), and ∫sigmoid =
    log(1 + e^x) - log 2 once e^x overflows (x > 88). The registry's stable forms (log cosh x, softplus x - log 2),
    in torch and printed in Triton, stay finite and within float32 rounding of the float64 value."""
    iname = antiderivative(name)
    x = torch.tensor([-100.0, -30.0, -12.0, -1e-3, 0.0, 0.5, 12.0, 30.0, 100.0], dtype=torch.float64)
    exact = {"tanh": lambda t: torch.log(torch.cosh(t)), "sigmoid": lambda t: torch.logaddexp(t, 0 * t) - math.log(2)}
    want = exact[name](x)  # float64: cosh(100) and e^100 are finite there
    got = REGISTRY[iname](x.float())
    assert torch.isfinite(got).all() and rel_err(got.double(), want) < 1e-6
    printed = scalar_function(_Emitter(), ir.func(iname, VAR))  # type: ignore[arg-type]
    assert printed is not None
    module = _load(tmp_path, f"{iname}_tails", printed)
    outs = [torch.empty(9, device=DEVICE) for _ in range(4)]
    module.apply[(1,)](x.float().to(DEVICE), *outs, 9, BLOCK=16)
    assert torch.isfinite(outs[0]).all() and rel_err(outs[0].cpu().double(), want) < 1e-6
    assert rel_err(outs[1].cpu().double(), REGISTRY[name](x)) < 1e-6  # G' = the function itself


@pytest.mark.parametrize("name", ["dsigmoid", "dtanh", "dsilu", "dgelu"])
def test_second_derivatives_stay_finite_where_sympys_forms_overflow(name: str, tmp_path: Path) -> None:
    """The registry lists stable second derivatives (SymPy's SiLU'' is a rational function of e^x, inf / inf in
    float32 past x = 88): G = f', printed with G' = f'', finite and exact at |x| = 30 and 100."""
    printed = scalar_function(_Emitter(), ir.func(name, VAR))  # type: ignore[arg-type]
    assert printed is not None
    module = _load(tmp_path, f"{name}_tails", printed)
    x = torch.tensor([-100.0, -30.0, 30.0, 100.0], dtype=torch.float64)
    outs = [torch.empty(4, device=DEVICE) for _ in range(4)]
    module.apply[(1,)](x.float().to(DEVICE), *outs, 4, BLOCK=4)
    want = REGISTRY[derivative(name)](x)
    assert torch.isfinite(outs[1]).all() and (outs[1].cpu().double() - want).abs().max() < 1e-6


def test_a_constant_prints_as_a_tile() -> None:
    """G' of 3 s is the number 3: returned as a tile of x's shape (a kernel stores it)."""
    printed = scalar_function(_Emitter(), ir.mul(ir.scalar(3), VAR))  # type: ignore[arg-type]
    assert printed is not None and printed.grad == "return 0.0 * x + 3.0"


def test_what_the_printers_do_not_take_is_refused() -> None:
    """A learned scalar inside G, a formula SymPy left as an integral (∫SiLU) or in cases (∫ReLU): None (the
    torch path runs instead)."""
    learned = ir.func("sigmoid", ir.mul(ir.Scalar(sp.Symbol("b")), VAR))
    assert scalar_function(_Emitter(), learned) is None  # type: ignore[arg-type]
    for name in ("silu", "relu"):
        assert scalar_function(_Emitter(), ir.func(antiderivative(name), VAR)) is None  # type: ignore[arg-type]
