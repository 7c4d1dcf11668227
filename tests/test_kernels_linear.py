"""(Gated) linear attention: the two plain references agree, then the chunked Triton kernels match them.

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1 is set before triton is first
imported), in float32 with ieee dot products, compared against float64 references with the relative error
max|kernel - ref| / max|ref|. GPU tests (float32 and bfloat16, T up to 2048) run with `-m gpu`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
from conftest import compile_for_gpu, lay

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
pytest.importorskip("triton")

from energydsl.kernels import linear as L  # noqa: E402
from energydsl.kernels.linear import linear_attention  # noqa: E402
from energydsl.kernels.linear_ref import (  # noqa: E402
    linear_attention_parallel_ref,
    linear_attention_recurrent_ref,
)

if not (torch.cuda.is_available() or L.INTERPRET):
    pytest.skip(
        "energydsl.kernels.linear was imported before TRITON_INTERPRET=1 was set", allow_module_level=True
    )

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4
REFS = (linear_attention_parallel_ref, linear_attention_recurrent_ref)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max-abs error over max-abs reference (0 when both vanish)."""
    err = (got.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    return err / scale if scale > 0 else err


def make_inputs(
    B: int,
    H: int,
    T: int,
    Dk: int,
    Dv: int,
    decay: str | None,
    *,
    tied: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str = DEVICE,
    strength: float = 0.5,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """[q, k, v, log_decay-or-None] as leaves requiring grad (v is k when tied), and an upstream gradient."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype).requires_grad_()

    q, k = randn(B, H, T, Dk), randn(B, H, T, Dk)
    v = k if tied else randn(B, H, T, Dv)
    if decay == "token":  # log a in [-strength, 0): per-step decays in (e^-strength, 1]
        g = -strength * torch.rand(B, H, T, generator=gen)
    elif decay == "head":
        g = -strength * torch.rand(H, generator=gen)
    else:
        g = None
    if g is not None:  # log decays stay fp32 for 16-bit q, k, v
        g = g.to(
            device=device, dtype=torch.float64 if dtype == torch.float64 else torch.float32
        ).requires_grad_()
    do = torch.randn(B, H, T, (Dk if tied else Dv), generator=gen).to(device=device, dtype=dtype)
    return [q, k, v, g], do


def leaves(inputs: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """Distinct tensors to differentiate (v is skipped when it is k)."""
    out: list[torch.Tensor] = []
    for t in inputs:
        if t is not None and all(t is not s for s in out):
            out.append(t)
    return out


def run(
    fn: Callable[..., torch.Tensor], inputs: list, do: torch.Tensor, **kw: object
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    q, k, v, g = inputs
    o = fn(q, k, v, log_decay=g, **kw)
    # strict at T = 1 reads nothing: the references then do not use k, v at all (zero gradients)
    return o, torch.autograd.grad(
        o, leaves(inputs), do.to(o.dtype), allow_unused=True, materialize_grads=True
    )


def as_float64(inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Detached float64 copies requiring grad, keeping v tied to k where it was."""
    q, k, v, g = inputs
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    v64 = k64 if v is k else v.detach().double().requires_grad_()
    g64 = None if g is None else g.detach().double().requires_grad_()
    return [q64, k64, v64, g64]


def check_against_refs(inputs: list, do: torch.Tensor, tol: float = TOL, **kw) -> None:
    o, grads = run(linear_attention, inputs, do, **kw)
    ref_inputs = as_float64(inputs)
    names = ["dq", "dk", "dv", "dlog_decay"]
    names = [n for n, t in zip(names, inputs) if t is not None and not (n == "dv" and inputs[2] is inputs[1])]
    for ref in REFS:
        o_ref, g_ref = run(ref, ref_inputs, do.double(), **kw)
        assert rel_err(o, o_ref) < tol, (ref.__name__, "o", rel_err(o, o_ref))
        for name, a, b in zip(names, grads, g_ref, strict=True):
            assert a.shape == b.shape and a.dtype == inputs[names.index(name)].dtype
            assert rel_err(a, b) < tol, (ref.__name__, name, rel_err(a, b))


# ---------------------------------------------------------------------------------------------------------
# The references agree with each other (float64)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strict", [False, True], ids=["causal", "strict"])
@pytest.mark.parametrize("decay", [None, "token", "head"])
@pytest.mark.parametrize("T", [1, 5, 37])
def test_references_agree(T: int, decay: str | None, strict: bool) -> None:
    inputs, do = make_inputs(2, 2, T, 16, 24, decay, dtype=torch.float64, device="cpu")
    o_par, g_par = run(linear_attention_parallel_ref, inputs, do, scale=0.7, strict=strict)
    o_rec, g_rec = run(linear_attention_recurrent_ref, inputs, do, scale=0.7, strict=strict)
    assert rel_err(o_par, o_rec) < 1e-12
    for a, b in zip(g_par, g_rec, strict=True):
        assert rel_err(a, b) < 1e-12


def test_reference_definitions() -> None:
    """Spot values from the definition: strict at i=0 is 0; per-head decay = constant per-token decay."""
    inputs, do = make_inputs(1, 2, 6, 16, 16, "head", dtype=torch.float64, device="cpu")
    q, k, v, g = inputs
    o = linear_attention_parallel_ref(q, k, v, log_decay=g, strict=True)
    assert torch.all(o[:, :, 0] == 0)
    g_tok = g.detach().view(1, 2, 1).expand(1, 2, 6)
    o_tok = linear_attention_parallel_ref(q, k, v, log_decay=g_tok, strict=True)
    torch.testing.assert_close(o, o_tok, rtol=1e-12, atol=1e-12)
    # o_2 = a^2 (q_2.k_0) v_0 + a (q_2.k_1) v_1 for the strict form
    a = g.detach().exp()[None, :, None]
    want = a**2 * (q[:, :, 2] * k[:, :, 0]).sum(-1, keepdim=True) * v[:, :, 0]
    want = want + a * (q[:, :, 2] * k[:, :, 1]).sum(-1, keepdim=True) * v[:, :, 1]
    torch.testing.assert_close(o[:, :, 2], want, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------
# Kernel against the references (float32, interpreter on CPU)
# ---------------------------------------------------------------------------------------------------------


# (H, Dk, Dv): a pairwise cover of {1, 2} x {16, 32} x {16, 24} (every pair of values meets), crossed with the
# full T x decay x mask grid: half the cases of the full product, for the interpreter's sake
HEAD_SHAPES = [(1, 16, 16), (1, 32, 24), (2, 16, 24), (2, 32, 16)]


@pytest.mark.parametrize("strict", [False, True], ids=["causal", "strict"])
@pytest.mark.parametrize("decay", [None, "token", "head"])
@pytest.mark.parametrize(("H", "Dk", "Dv"), HEAD_SHAPES, ids=lambda x: str(x))
@pytest.mark.parametrize("T", [1, 5, 37])
def test_kernel_matches_references(T: int, H: int, Dk: int, Dv: int, decay: str | None, strict: bool) -> None:
    B = 3 - H  # B*H = 2 programs per Dv-block: batches and heads are both exercised
    inputs, do = make_inputs(B, H, T, Dk, Dv, decay, seed=T + 7 * H + Dk + Dv)
    check_against_refs(inputs, do, scale=Dk**-0.5, strict=strict)


@pytest.mark.parametrize("strict", [False, True], ids=["causal", "strict"])
@pytest.mark.parametrize("decay", [None, "token", "head"])
@pytest.mark.parametrize("T", [1, 5, 37])
def test_tied_value_is_key(T: int, decay: str | None, strict: bool) -> None:
    """v = k (the same tensor): its gradient is the sum of the key and value roles."""
    inputs, do = make_inputs(1, 2, T, 16, 16, decay, tied=True, seed=T)
    assert inputs[2] is inputs[1]
    check_against_refs(inputs, do, scale=0.25, strict=strict)


@pytest.mark.parametrize(("Dk", "Dv"), [(128, 80), (24, 128)])
def test_wide_and_ragged_heads(Dk: int, Dv: int) -> None:
    """Head dims up to 128, non-powers of two (padded), several Dv-blocks (dq/dk partial sums)."""
    inputs, do = make_inputs(1, 1, 21, Dk, Dv, "token", seed=Dk)
    check_against_refs(inputs, do, scale=Dk**-0.5)


def test_strong_decay_stays_finite() -> None:
    """Per-step decays down to e^-12: every exponent in the chunked form is <= 0, so nothing overflows."""
    inputs, do = make_inputs(1, 2, 37, 16, 16, "token", seed=3, strength=12.0)
    o, grads = run(linear_attention, inputs, do)
    assert torch.isfinite(o).all() and all(torch.isfinite(g).all() for g in grads)
    check_against_refs(inputs, do)


@pytest.mark.parametrize("decay", [None, "token"])
def test_bfloat16_gives_the_references(decay: str | None) -> None:
    """bf16 inputs give bf16 outputs and gradients within bf16 rounding of the references (under the
    interpreter, whose tl.dot misreads bf16, triton#11584, on float32 copies: it returned values ~1e8 off)."""
    inputs, do = make_inputs(1, 2, 33, 16, 16, decay, seed=14, dtype=torch.bfloat16)
    check_against_refs(inputs, do, tol=3e-2, scale=0.25)


def test_partial_requires_grad() -> None:
    """Only q is trained; the decay is a constant: no d log_decay is computed or returned."""
    inputs, do = make_inputs(1, 1, 20, 16, 16, "token", seed=5)
    q, k, v, g = inputs
    k, v, g = k.detach(), v.detach(), g.detach()
    (dq,) = torch.autograd.grad(linear_attention(q, k, v, log_decay=g), [q], do)
    q64 = q.detach().double().requires_grad_()
    o_ref = linear_attention_parallel_ref(q64, k.double(), v.double(), log_decay=g.double())
    (dq_ref,) = torch.autograd.grad(o_ref, [q64], do.double())
    assert rel_err(dq, dq_ref) < TOL


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("layout, decay", [  # CI: every decay token-major; the other layouts with a head decay
    pytest.param(layout, decay, marks=pytest.mark.slow if layout != "token" and decay != "head" else ())
    for layout in ("token", "sliced", "packed") for decay in (None, "token", "head")])
def test_layouts_match_references(layout: str, decay: str | None, tied: bool) -> None:
    """q, k, v and dO token-major, sliced or packed (`conftest.lay`), every output and gradient: three heads,
    two batches, ragged Dk- and Dv-blocks and three chunks, so that a batch, head or row stride taken for another
    would show."""
    inputs, do = make_inputs(2, 3, 37, 20, 24, decay, tied=tied, seed=11)
    q, k, v, g = inputs
    laid_k = lay(k, layout)
    inputs = [lay(q, layout), laid_k, laid_k if tied else lay(v, layout), g]
    check_against_refs(inputs, lay(do, layout), scale=0.3)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_token_major_heads_stay_token_major(tied: bool) -> None:
    """Heads split off (B, T, H * D) projections reach the kernels without a copy and come back the same way:
    o is written token-major, so that merging its heads is a view of the kernels' own output, and the
    gradients of q, k and v arrive with those tensors' strides (no copy in the views' backward)."""
    B, T, H, Dk, Dv = 2, 19, 3, 16, 24
    gen = torch.Generator().manual_seed(0)
    widths = {"q": Dk, "k": Dk} | ({} if tied else {"v": Dv})
    flat = {n: torch.randn(B, T, H * d, generator=gen).to(DEVICE).requires_grad_() for n, d in widths.items()}
    heads = {n: t.unflatten(-1, (H, -1)).transpose(1, 2) for n, t in flat.items()}  # (B, H, T, D) views
    grad_strides = {}
    for name, t in heads.items():
        t.register_hook(lambda grad, name=name: grad_strides.__setitem__(name, grad.stride()))
    log_decay = -0.5 * torch.rand(H, generator=gen).to(DEVICE)
    o = linear_attention(heads["q"], heads["k"], heads["k" if tied else "v"], scale=0.25, log_decay=log_decay)
    merged = o.transpose(1, 2).flatten(-2)
    assert o.stride() == heads["k" if tied else "v"].stride() and merged.data_ptr() == o.data_ptr()
    assert merged._base is not None  # a view, not a copy
    merged.square().sum().backward()
    assert grad_strides == {n: t.stride() for n, t in heads.items()}, grad_strides


def feature_strided(t: torch.Tensor) -> torch.Tensor:
    """t's values in a layout no kernel reads in place: features T apart (a transposed (..., D, T) tensor)."""
    return t.detach().transpose(-1, -2).contiguous().transpose(-1, -2)


@pytest.mark.parametrize("decay", [None, "token"])
def test_direct_op_calls_take_any_layout(decay: str | None) -> None:
    """torch.ops.energydsl.linear_attention_{fwd,bwd} called directly (`linear_attention` lays out its inputs
    first, a direct caller need not) with features not adjacent and every other log decay of a longer tensor
    give what the laid-out call gives, as does a dO in another dtype; and opcheck's fake tensors get the strides
    the op bodies give."""
    (q, k, v, g), do = make_inputs(2, 2, 21, 16, 8, decay, seed=5)
    if g is not None:
        g = torch.stack([g.detach(), torch.zeros_like(g)], dim=-1).flatten(-2)[..., ::2]  # time stride 2
    laid = [t.detach().contiguous() for t in (q, k, v)]
    odd = [feature_strided(t) for t in (q, k, v)]
    ops = torch.ops.energydsl
    want = ops.linear_attention_fwd(*laid, g, 0.5, False)
    assert rel_err(ops.linear_attention_fwd(*odd, g, 0.5, False), want) < 1e-6
    need_dg = g is not None
    want = ops.linear_attention_bwd(do, *laid, g, 0.5, False, need_dg)
    got = ops.linear_attention_bwd(feature_strided(do), *odd, g, 0.5, False, need_dg)
    cast = ops.linear_attention_bwd(do.double(), *laid, g, 0.5, False, need_dg)  # dO in another dtype: cast
    for a, b, c in zip(got, want, cast, strict=True):
        assert a.shape == b.shape and (a.numel() == 0 or rel_err(a, b) < 1e-6)
        assert c.dtype == b.dtype and (c.numel() == 0 or rel_err(c, b) < 1e-6)
    torch.library.opcheck(ops.linear_attention_fwd.default, (*odd, g, 0.5, False))
    torch.library.opcheck(ops.linear_attention_bwd.default, (feature_strided(do), *odd, g, 0.5, False, need_dg))
    columns = [torch.cat([t.detach(), t.detach()], dim=-1)[..., : t.shape[-1]] for t in (q, k, v)]  # in place
    torch.library.opcheck(ops.linear_attention_bwd.default, (do, *columns, g, 0.5, False, need_dg))


def test_registered_ops() -> None:
    assert hasattr(torch.ops.energydsl, "linear_attention_fwd")
    assert hasattr(torch.ops.energydsl, "linear_attention_bwd")


def test_torch_compile() -> None:
    """Graph capture with fake tensors and the registered autograd (aot_eager keeps CPU runs short)."""
    inputs, do = make_inputs(1, 2, 19, 16, 16, "head", seed=2)

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return torch.tanh(linear_attention(q, k, v, log_decay=g, scale=0.5))

    backend = "aot_eager" if L.INTERPRET else "inductor"
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    o_c = compiled(*inputs)
    g_c = torch.autograd.grad(o_c, leaves(inputs), do)
    o_e = f(*inputs)
    g_e = torch.autograd.grad(o_e, leaves(inputs), do)
    assert rel_err(o_c, o_e) < TOL
    for a, b in zip(g_c, g_e, strict=True):
        assert rel_err(a, b) < TOL


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(q=(1, 2, 5, 16), k=(1, 2, 5, 8), v=(1, 2, 5, 16)), "expected q, k"),
        (dict(q=(1, 2, 5, 16), k=(1, 2, 5, 16), v=(1, 2, 4, 16)), "expected q, k"),
        (dict(q=(1, 2, 5, 16), k=(1, 2, 5, 16), v=(1, 2, 5, 16), g=(3,)), "log_decay must be"),
    ],
)
def test_shape_errors(kwargs: dict, match: str) -> None:
    q, k, v = (torch.zeros(kwargs[n]) for n in ("q", "k", "v"))
    g = torch.zeros(kwargs["g"]) if "g" in kwargs else None
    with pytest.raises(ValueError, match=match):
        linear_attention(q, k, v, log_decay=g)


# ---------------------------------------------------------------------------------------------------------
# GPU (compiled Triton): float32 and bfloat16, long sequences
# ---------------------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("strict", [False, True], ids=["causal", "strict"])
@pytest.mark.parametrize("decay", [None, "token", "head"])
@pytest.mark.parametrize(("T", "Dk", "Dv"), [(64, 64, 64), (777, 128, 96), (2048, 64, 128)])
def test_gpu_long(T: int, Dk: int, Dv: int, decay: str | None, strict: bool, dtype: torch.dtype) -> None:
    inputs, do = make_inputs(2, 4, T, Dk, Dv, decay, dtype=dtype, seed=T, strength=0.1)
    # inputs are rounded to dtype first, so the float64 reference sees exactly the kernel's operands; bf16
    # error then comes from tf32 products and bf16 outputs
    tol = TOL if dtype == torch.float32 else 2e-2
    o, grads = run(linear_attention, inputs, do, scale=Dk**-0.5, strict=strict)
    o_ref, g_ref = run(
        linear_attention_parallel_ref, as_float64(inputs), do.double(), scale=Dk**-0.5, strict=strict
    )
    assert o.dtype == dtype and rel_err(o, o_ref) < tol
    for a, b in zip(grads, g_ref, strict=True):
        assert rel_err(a, b) < tol


@pytest.mark.gpu
@gpu
def test_gpu_tied_and_compiled() -> None:
    inputs, do = make_inputs(1, 8, 1000, 64, 64, "token", tied=True, seed=1, strength=0.05)
    check_against_refs(inputs, do, scale=0.125)
    # compiled: the triton_op traced into inductor
    f = torch.compile(lambda q, k, v, g: linear_attention(q, k, v, log_decay=g), fullgraph=True)
    o_c, g_c = run(lambda q, k, v, log_decay: f(q, k, v, log_decay), inputs, do)
    o_e, g_e = run(linear_attention, inputs, do)
    assert rel_err(o_c, o_e) < TOL
    for a, b in zip(g_c, g_e, strict=True):
        assert rel_err(a, b) < TOL


# ---------------------------------------------------------------------------------------------------------
# Without a GPU: the compiled (non-interpreted) kernels at least compile for sm_90 (ptxas ships with triton)
# ---------------------------------------------------------------------------------------------------------

# each kernel's pointer arguments, and the fp32 ones among them (the rest take the inputs' dtype)
_KERNEL_POINTERS = """
ptrs = {
    "_state_kernel": ["x_ptr", "y_ptr", "g_ptr", "h_ptr"],
    "_fwd_kernel": ["q_ptr", "k_ptr", "v_ptr", "g_ptr", "h_ptr", "o_ptr"],
    "_bwd_dqk_kernel": ["q_ptr", "k_ptr", "v_ptr", "g_ptr", "h_ptr", "dh_ptr", "do_ptr", "dq_ptr", "dk_ptr", "r_ptr"],
    "_bwd_dv_kernel": ["q_ptr", "k_ptr", "g_ptr", "dh_ptr", "do_ptr", "dv_ptr"],
}
fp32_ptrs = {"g_ptr", "r_ptr"}
"""

_COMPILE_SCRIPT = """
import itertools
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from energydsl.kernels import linear as L

assert not L.INTERPRET
""" + _KERNEL_POINTERS + """
for name, (dt, prec), (K, V), (decay, strict) in itertools.product(
    ptrs, [("bf16", "tf32"), ("fp32", "ieee")], [(64, 64), (128, 80)], [(True, True), (False, False)]
):
    kernel = getattr(L, name)  # the templates: plain @triton.jit functions
    C, BK, BV = L._tile_sizes(K, V)
    sig = {p: "*fp32" if p in fp32_ptrs else "*" + dt for p in ptrs[name]}
    consts = dict(HAS_DECAY=decay, STRICT=strict, REVERSE=strict, DOT_PREC=prec, C=C, BK=BK, BV=BV)
    consts = {c: v for c, v in consts.items() if c in kernel.arg_names}
    sig |= {s: t for s, t in {"T": "i32", "H": "i32", "K": "i32", "V": "i32", "scale": "fp32"}.items()
            if s in kernel.arg_names}
    sig |= {a: "i32" for a in kernel.arg_names if a.startswith("stride_")}  # batch, head and row strides
    sig |= {c: "constexpr" for c in consts}
    src = ASTSource(kernel, sig, constexprs=consts)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})
print("compiled")
"""


def test_references_take_fp32_decays_with_bf16_inputs() -> None:
    """The kernels take fp32 log decays beside 16-bit q, k, v; so do the references (the benchmark's peer)."""
    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.bfloat16) for _ in range(3))
    g = -0.3 * torch.rand(1, 2, 9)
    exact = linear_attention_parallel_ref(q.double(), k.double(), v.double(), log_decay=g.double())
    for ref in REFS:
        out = ref(q, k, v, log_decay=g)
        assert out.dtype == torch.bfloat16
        assert rel_err(out, exact) < 3e-2


_FP64_SCALE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from energydsl.kernels import linear as L
""" + _KERNEL_POINTERS + """
for name in ["_fwd_kernel", "_bwd_dqk_kernel", "_bwd_dv_kernel"]:  # the kernels taking `scale`
    consts = dict(HAS_DECAY=True, STRICT=False, DOT_PREC="ieee", C=64, BK=64, BV=64)
    sig = {p: "*fp32" for p in ptrs[name]} | {"T": "i32", "H": "i32", "K": "i32", "V": "i32", "scale": "fp64"}
    sig |= {a: "i32" for a in getattr(L, name).arg_names if a.startswith("stride_")}
    sig |= {c: "constexpr" for c in consts}
    src = ASTSource(getattr(L, name), sig, constexprs=consts)
    ttir = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ttir"]
    f64 = [ln.strip() for ln in ttir.splitlines() if "f64" in ln and "tt.func" not in ln and "truncf" not in ln]
    assert not f64, (name, f64[:3])
print("compiled")
"""


@pytest.mark.slow  # ~45 s interpreted; the attention kernels' twin of it runs in CI
def test_kernels_take_an_fp64_scale_in_fp32() -> None:
    """Under torch.compile, Inductor launches the kernels with `scale` typed fp64 (a Python float). On an
    H100 the backward then failed to build: `dO * scale` was fp64 and `tl.dot` refuses fp64 with fp32."""
    compile_for_gpu(_FP64_SCALE_SCRIPT)


@pytest.mark.slow
def test_kernels_compile_for_gpu() -> None:
    """Catches errors of the GPU code path (layouts, dot shapes, loop-carried types) on a CPU-only machine."""
    compile_for_gpu(_COMPILE_SCRIPT)
