"""The pointwise-weight kernels (`o_i = Σ_j w(s_ij) v_j`) against their T x T reference (the printers of w:
tests/test_scalar_functions.py).

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1 is set before triton is first
imported), in float32 with ieee dot products, compared against the float64 reference with the relative error
max|kernel - ref| / max|ref|. The weight functions are `@triton.jit` functions passed at launch here; generated
modules bake the ones printed from their energy (tests/test_triton_backend.py runs those end to end).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import compile_for_gpu

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from energydsl.kernels import pointwise_kernels as PK  # noqa: E402
from energydsl.kernels import pointwise_wide_kernels as PWK  # noqa: E402
from energydsl.kernels.launch import INTERPRET  # noqa: E402
from energydsl.kernels.pointwise import SIGMOID, SIGMOID_WIDE, PointwiseOps  # noqa: E402
from energydsl.kernels.pointwise_ref import pointwise_attention_ref  # noqa: E402

if not (torch.cuda.is_available() or INTERPRET):
    pytest.skip("energydsl.kernels was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4


@triton.jit
def _relu_squared(x):
    r = tl.maximum(x, 0.0)
    return r * r


@triton.jit
def _drelu_squared(x):
    return 2.0 * tl.maximum(x, 0.0)


RELU2 = PointwiseOps("pointwise_test_relu2", PK._pointwise_fwd_kernel, PK._pointwise_bwd_dkdv_kernel,
                     PK._pointwise_bwd_dq_kernel, reference=lambda x: torch.relu(x) ** 2, weight=_relu_squared,
                     weight_grad=_drelu_squared)
WEIGHTS = {"sigmoid": SIGMOID, "relu2": RELU2}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    err = (got.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    return err / scale if scale > 0 else err


def make_inputs(B: int, H: int, T: int, Dk: int, Dv: int, row: bool, key: bool, *, tied: bool = False,
                seed: int = 0, alibi: bool = False, self_bias: bool = False) -> list[torch.Tensor | None]:
    """[q, k, v, row_bias, key_bias, alibi_slopes, self_bias] in float64 (v is k when tied; a bias None where
    absent)."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(DEVICE)

    q, k = draw(B, H, T, Dk), draw(B, H, T, Dk)
    v = k if tied else draw(B, H, T, Dv)
    slopes = 0.1 + torch.rand(H, generator=gen, dtype=torch.float64).to(DEVICE) if alibi else None
    return [q, k, v, draw(B, H, T) if row else None, draw(B, H, T) if key else None, slopes,
            draw(H) if self_bias else None]


def run(ops: PointwiseOps | None, inputs: list, dtype: torch.dtype, seed: int = 1, **kw: object
        ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """The output and the gradients of <dO, o> for every input (the reference when `ops` is None)."""
    leaves = []
    for t in inputs:
        leaves.append(None if t is None else t.detach().to(dtype).requires_grad_())
    leaves += [None] * (7 - len(leaves))
    if inputs[2] is inputs[1]:  # tied: one leaf
        leaves[2] = leaves[1]
    q, k, v, rb, kb, slopes, self_b = leaves
    biases = dict(row_bias=rb, key_bias=kb, alibi_slopes=slopes, self_bias=self_b)
    if ops is None:
        out = pointwise_attention_ref(q, k, v, kw.pop("reference"), **biases, **kw)
    else:
        out = ops.pointwise_attention(q, k, v, **biases, **kw)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out)
    wrt = [t for n, t in enumerate(leaves) if t is not None and not (n == 2 and v is k)]
    grads = torch.autograd.grad(out, wrt, do)
    return out, list(grads)


def check(ops: PointwiseOps, inputs: list, **kw: object) -> None:
    out, grads = run(ops, inputs, torch.float32, **kw)
    ref, ref_grads = run(None, inputs, torch.float64, reference=ops.reference, **kw)
    assert rel_err(out, ref) < TOL
    for got, want in zip(grads, ref_grads, strict=True):
        assert rel_err(got, want) < TOL


@pytest.mark.parametrize("weight", ["sigmoid", "relu2"])
@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("T,H,Dk,Dv", [(1, 1, 8, 8), (13, 3, 8, 12), (37, 2, 16, 5)])
def test_kernel_matches_reference(weight: str, strict: bool, T: int, H: int, Dk: int, Dv: int) -> None:
    """Forward and every gradient, every bias included (slopes and self bias learned), at odd lengths (a ragged
    last tile)."""
    inputs = make_inputs(2, H, T, Dk, Dv, row=True, key=True, alibi=True, self_bias=True)
    check(WEIGHTS[weight], inputs, scale=0.7, strict=strict)


RELU2_WIDE = PointwiseOps("pointwise_test_relu2_wide", PWK._pointwise_fwd_wide_kernel,
                          PWK._pointwise_bwd_dkdv_wide_kernel, PWK._pointwise_bwd_dq_wide_kernel,
                          reference=lambda x: torch.relu(x) ** 2, weight=_relu_squared, weight_grad=_drelu_squared,
                          wide=True)
WIDE_WEIGHTS = {"sigmoid": SIGMOID_WIDE, "relu2": RELU2_WIDE}


@pytest.mark.parametrize("loop", [False, True])
@pytest.mark.parametrize("weight", ["sigmoid", "relu2"])
@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("T,H,Dk,Dv", [(1, 1, 8, 8), (13, 2, 40, 24), (21, 1, 17, 50)])
def test_wide_kernels_match_reference(weight: str, strict: bool, T: int, H: int, Dk: int, Dv: int, loop: bool,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The feature-tiled kernels (16-wide feature tiles under the interpreter, so several tiles and a ragged last
    one; more key tiles than value tiles and fewer): forward and every gradient, every bias included, with a
    backward program per feature tile and with one looping over the tiles (FEATURE_LOOP)."""
    from energydsl.kernels import pointwise

    monkeypatch.setattr(pointwise, "INTERPRET_FEATURE_LOOP", loop)
    inputs = make_inputs(2, H, T, Dk, Dv, row=True, key=True, alibi=True, self_bias=True, seed=5)
    check(WIDE_WEIGHTS[weight], inputs, scale=0.3, strict=strict)


def test_widths_choose_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """`sigmoid_attention` takes the wide kernels above 256 features, not the T x T reference; a narrow set
    refuses such widths rather than build T x T weights."""
    from energydsl.kernels import pointwise

    q, k, v = (t.float().requires_grad_() for t in make_inputs(1, 1, 20, 264, 8, row=False, key=False, seed=6)[:3])
    ref = pointwise_attention_ref(q.double(), k.double(), v.double(), torch.sigmoid, scale=0.05)
    monkeypatch.setattr(pointwise, "pointwise_attention_ref", None)  # any call to it would fail
    out = pointwise.sigmoid_attention(q, k, v, scale=0.05)
    out.sum().backward()
    assert rel_err(out, ref) < TOL and q.grad is not None
    with pytest.raises(ValueError, match="wider ones take the wide kernels"):
        SIGMOID.pointwise_attention(q, k, v)


@pytest.mark.parametrize("bias", [None, "row", "key", "alibi", "self_bias"])
def test_each_bias_alone(bias: str | None) -> None:
    flags = {name: name == bias for name in ("row", "key", "alibi", "self_bias")}
    check(SIGMOID, make_inputs(1, 2, 21, 8, 8, seed=3, **flags), scale=0.5)


def test_fixed_slopes_take_the_backward_without_their_column_sums() -> None:
    """ALiBi's slopes are usually fixed: the backward then runs with NEED_ALIBI off, and q's gradient is
    still the reference's."""
    q, k, v, _, _, slopes, _ = (t if t is None else t.float() for t in make_inputs(1, 2, 9, 4, 4, row=False,
                                                                                  key=False, alibi=True, seed=12))
    q.requires_grad_()
    out = SIGMOID.pointwise_attention(q, k, v, alibi_slopes=slopes)
    (g,) = torch.autograd.grad(out.sum(), q)
    ref = pointwise_attention_ref(q.double(), k.double(), v.double(), torch.sigmoid, alibi_slopes=slopes.double())
    (g_ref,) = torch.autograd.grad(ref.sum(), q)
    assert rel_err(g, g_ref) < TOL


def test_tied_value_is_key() -> None:
    check(SIGMOID, make_inputs(2, 2, 19, 8, 8, row=True, key=False, tied=True, seed=4), scale=0.3, strict=True)


def test_token_major_heads_are_read_in_place() -> None:
    """Heads split off a (B, T, H*D) projection (a permuted view) give what contiguous heads give."""
    q, k, v, rb, kb, _, _ = make_inputs(2, 3, 17, 8, 8, row=True, key=True, seed=5)
    token_major = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    assert not token_major[0].is_contiguous()
    a, _ = run(SIGMOID, [*token_major, rb, kb], torch.float32, scale=0.5)
    b, _ = run(SIGMOID, [q, k, v, rb, kb], torch.float32, scale=0.5)
    assert rel_err(a, b) < 1e-6


def test_the_package_function_dispatches() -> None:
    """`energydsl.kernels.sigmoid_attention`: the kernels for float32, the exact reference for float64."""
    from energydsl.kernels import sigmoid_attention

    q, k, v, rb, kb, _, _ = make_inputs(1, 2, 11, 8, 8, row=True, key=True, seed=10)
    exact = pointwise_attention_ref(q, k, v, torch.sigmoid, scale=0.4, row_bias=rb, key_bias=kb)
    assert torch.equal(sigmoid_attention(q, k, v, scale=0.4, row_bias=rb, key_bias=kb), exact)
    fast = sigmoid_attention(q.float(), k.float(), v.float(), scale=0.4, row_bias=rb.float(), key_bias=kb.float())
    assert fast.dtype == torch.float32 and rel_err(fast, exact) < TOL


def test_bfloat16_gives_the_reference() -> None:
    """bf16 inputs give a bf16 output within bf16 rounding of the reference (under the interpreter, whose tl.dot
    misreads bf16, triton#11584, on float32 copies), gradients included."""
    inputs = make_inputs(1, 2, 33, 16, 16, row=True, key=False, alibi=True, seed=13)
    out, grads = run(SIGMOID, inputs, torch.bfloat16, scale=0.25)
    ref, ref_grads = run(None, inputs, torch.float64, reference=torch.sigmoid, scale=0.25)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 3e-2
    for got, want in zip(grads, ref_grads, strict=True):
        assert rel_err(got, want) < 5e-2


def test_float64_runs_the_reference_exactly() -> None:
    q, k, v, rb, _, _, _ = make_inputs(1, 2, 9, 4, 4, row=True, key=False, seed=6)
    got = SIGMOID.pointwise_attention(q, k, v, scale=0.5, row_bias=rb)
    assert torch.equal(got, pointwise_attention_ref(q, k, v, torch.sigmoid, scale=0.5, row_bias=rb))


def test_weights_outside_the_context_are_zero() -> None:
    """w(s) = exp(s) is not 0 anywhere; a query sees only its context (the first row: itself, or nothing)."""
    exp_ops = EXP
    q, k, v, *_ = make_inputs(1, 1, 5, 4, 4, row=False, key=False, seed=7)
    strict = exp_ops.pointwise_attention(q.float(), k.float(), v.float(), scale=0.1, strict=True)
    assert torch.equal(strict[0, 0, 0], torch.zeros(4, device=DEVICE))
    causal = exp_ops.pointwise_attention(q.float(), k.float(), v.float(), scale=0.1)
    first = torch.exp(0.1 * q[0, 0, 0] @ k[0, 0, 0]) * v[0, 0, 0]
    assert rel_err(causal[0, 0, 0], first) < 1e-5


@triton.jit
def _exp(x):
    return tl.exp(x)


EXP = PointwiseOps("pointwise_test_exp", PK._pointwise_fwd_kernel, PK._pointwise_bwd_dkdv_kernel,
                   PK._pointwise_bwd_dq_kernel, reference=torch.exp, weight=_exp, weight_grad=_exp)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy, on rows that are discarded
def test_rows_past_the_end_add_nothing_where_the_weight_overflows() -> None:
    """Scores that are 0 on every pair of the context but 100 on the padding rows of the last, partial query
    block (q = 0 there, the key bias 100): exp overflows there, and dO = 0 times w' = inf would be NaN. The
    backward masks that block's rows; the blocks off the diagonal (all rows inside) run unmasked."""
    B, H, T, D = 1, 1, 37, 16  # under the interpreter: 16-row blocks, the last one partial
    q = torch.zeros(B, H, T, D, device=DEVICE)
    q[..., 0] = -100.0
    k = torch.zeros(B, H, T, D, device=DEVICE)
    k[..., 0] = 1.0
    v = torch.randn(B, H, T, D, device=DEVICE)
    kb = torch.full((B, H, T), 100.0, device=DEVICE)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, kb)]
    out = EXP.pointwise_attention(leaves[0], leaves[1], leaves[2], key_bias=leaves[3])
    grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    want = pointwise_attention_ref(*(t.double() for t in (q, k, v)), torch.exp, key_bias=kb.double())
    assert rel_err(out, want) < TOL
    assert all(torch.isfinite(g).all() for g in grads)


def test_direct_op_calls_pass_opcheck() -> None:
    q, k, v, rb, kb, slopes, self_b = (t.float() for t in make_inputs(1, 2, 9, 4, 4, row=True, key=True,
                                                                      alibi=True, self_bias=True, seed=8))
    ops = torch.ops.energydsl
    torch.library.opcheck(ops.sigmoid_attention_fwd.default, (q, k, v, rb, kb, slopes, self_b, 0.5, False))
    do = torch.randn_like(v)
    torch.library.opcheck(ops.sigmoid_attention_bwd.default,
                          (do, q, k, v, rb, None, slopes, self_b, 0.5, True, True, False))
    q, k, v = (torch.cat([t, t], dim=-1)[..., : t.shape[-1]] for t in (q, k, v))  # read in place; dense gradients
    torch.library.opcheck(ops.sigmoid_attention_bwd.default,
                          (do, q, k, v, rb, None, slopes, self_b, 0.5, True, True, False))


def test_torch_compile() -> None:
    """Graph capture with fake tensors and the registered autograd, biases included (aot_eager keeps CPU runs
    short), against eager."""
    inputs = [t.float().requires_grad_() for t in make_inputs(1, 2, 19, 8, 8, row=True, key=True, seed=11)[:5]]

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rb: torch.Tensor, kb: torch.Tensor) -> torch.Tensor:
        return torch.tanh(SIGMOID.pointwise_attention(q, k, v, scale=0.5, row_bias=rb, key_bias=kb))

    compiled = torch.compile(f, backend="aot_eager" if INTERPRET else "inductor", fullgraph=True)
    do = torch.randn(1, 2, 19, 8, device=DEVICE)
    o_c = compiled(*inputs)
    g_c = torch.autograd.grad(o_c, inputs, do)
    o_e = f(*inputs)
    g_e = torch.autograd.grad(o_e, inputs, do)
    assert rel_err(o_c, o_e) < TOL
    for a, b in zip(g_c, g_e, strict=True):
        assert rel_err(a, b) < TOL


@pytest.mark.parametrize("kwargs,match", [
    (dict(k_shape=(1, 2, 9, 5)), "expected q, k"),
    (dict(row_bias=(1, 2, 8)), "row_bias must be"),
    (dict(alibi_slopes=(1, 2)), "alibi_slopes must be"),
])
def test_shape_errors(kwargs: dict, match: str) -> None:
    q = torch.randn(1, 2, 9, 4)
    k = torch.randn(kwargs.pop("k_shape", (1, 2, 9, 4)))
    with pytest.raises(ValueError, match=match):
        SIGMOID.pointwise_attention(q, k, q, **{name: torch.randn(shape) for name, shape in kwargs.items()})


def test_a_specialised_set_refuses_other_flags() -> None:
    ops = PointwiseOps("pointwise_test_baked", PK._pointwise_fwd_kernel, PK._pointwise_bwd_dkdv_kernel,
                       PK._pointwise_bwd_dq_kernel, {"STRICT": True, "HAS_RB": False, "HAS_KB": False},
                       reference=torch.sigmoid, weight=PK._sigmoid, weight_grad=PK._sigmoid_grad)
    q = torch.randn(1, 1, 4, 4)
    with pytest.raises(ValueError, match="STRICT=False"):
        ops.pointwise_attention(q, q, q, strict=False)


# ---------------------------------------------------------------------------------------------------------
# Without a GPU: the kernels compile for sm_90 (ptxas ships with triton)
# ---------------------------------------------------------------------------------------------------------

_COMPILE_SCRIPT = """
import itertools
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from energydsl.kernels import pointwise_kernels as PK
from energydsl.kernels import pointwise_wide_kernels as PWK

@triton.jit
def weight(x):
    return tl.sigmoid(x)

ptrs = {
    "_pointwise_fwd_kernel": ["Q", "K", "V", "RB", "KB", "ALIBI", "SELF", "O"],
    "_pointwise_bwd_dkdv_kernel": ["Q", "K", "V", "RB", "KB", "ALIBI", "SELF", "DO", "DK", "DV", "DKB", "DDIST",
                                   "DDIAG"],
    "_pointwise_bwd_dq_kernel": ["Q", "K", "V", "RB", "KB", "ALIBI", "SELF", "DO", "DQ", "DRB"],
}
ptrs |= {name.replace("_kernel", "_wide_kernel"): args for name, args in ptrs.items()}
for name, (dt, prec), (BK, BV), (strict, bias), loop in itertools.product(
    ptrs, [("bf16", "tf32"), ("fp32", "ieee")], [(64, 64), (128, 32)], [(True, True), (False, False)], [False, True]
):
    kernel = getattr(PWK if "wide" in name else PK, name)
    if loop and "FEATURE_LOOP" not in kernel.arg_names:
        continue
    # the wide kernels write fp32 outputs and gradients (their FEATURE_LOOP mode adds into them)
    grads = ("O", "DQ", "DK", "DV") if "wide" in name else ()
    sig = {p: "*" + dt if p in ("Q", "K", "V", "O", "DO", "DQ", "DK", "DV") and p not in grads else "*fp32"
           for p in ptrs[name]}
    sig |= {a: "i32" for a in kernel.arg_names if a.startswith("stride_")}
    sig |= {"T": "i32", "H": "i32", "D_QK": "i32", "D_V": "i32", "scale": "fp64", "T_TUNE": "i32"}
    consts = dict(WEIGHT=weight, WEIGHT_GRAD=weight, STRICT=strict, HAS_RB=bias, HAS_KB=bias, HAS_ALIBI=bias,
                  HAS_SELF=bias, NEED_ALIBI=bias, NEED_SELF=bias, DOT_PREC=prec, BK=BK, BV=BV, BLOCK_M=64,
                  BLOCK_N=64, BLOCK_D=BK, FEATURE_LOOP=loop)
    consts = {c: v for c, v in consts.items() if c in kernel.arg_names}
    sig |= {c: "constexpr" for c in consts}
    triton.compile(ASTSource(kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 4, "num_stages": 2})
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_gpu(tmp_path: Path) -> None:
    """Catches errors of the GPU code path (dot shapes, dtypes, the weight functions as constexprs, an fp64
    scale as Inductor passes it) on a CPU-only machine. (A file: Triton reads a @jit function's source.)"""
    script = tmp_path / "compile_pointwise.py"
    script.write_text(_COMPILE_SCRIPT)
    compile_for_gpu(f"import runpy; runpy.run_path({str(script)!r})")


# ---------------------------------------------------------------------------------------------------------
# On a GPU (`-m gpu`): float32 and bfloat16 at longer lengths
# ---------------------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-3), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("T,D", [(1000, 64), (2048, 128), (1000, 320)])  # 320: the feature-tiled kernels
def test_gpu_long(dtype: torch.dtype, tol: float, T: int, D: int) -> None:
    inputs = make_inputs(2, 4, T, D, D, row=True, key=True, alibi=True, seed=9)
    inputs = [None if t is None else t * 0.3 for t in inputs]
    out, grads = run(SIGMOID_WIDE if D > 256 else SIGMOID, inputs, dtype, scale=D ** -0.5)
    ref, ref_grads = run(None, inputs, torch.float64, reference=torch.sigmoid, scale=D ** -0.5)
    assert rel_err(out, ref) < tol
    for got, want in zip(grads, ref_grads, strict=True):
        assert rel_err(got, want) < tol
