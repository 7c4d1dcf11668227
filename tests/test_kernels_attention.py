"""The fused softmax-family Triton ops against their explicit T x T PyTorch references.

Without CUDA the kernels run under the Triton interpreter (enabled below, before triton is imported), in
float32 with exact fp32 dot products, and are compared with the reference run in float64 through autograd:
forward, every input gradient and every bias gradient, with a relative error max|x - ref| / max|ref| < 1e-4
(or, for an ill-conditioned quantity, at most twice the error of the float32 PyTorch reference). The grid is
kept small because the interpreter executes every program in Python. With CUDA the same tests run compiled,
and the `gpu`-marked tests add long sequences in float32 and bfloat16.
"""

import itertools
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import compile_for_gpu, lay

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

pytest.importorskip("triton")

from energydsl.kernels import attention as kernels  # noqa: E402
from energydsl.kernels import attention_ref as ref  # noqa: E402
from energydsl.kernels import use_triton  # noqa: E402

if not (CUDA or kernels.INTERPRET):
    pytest.skip(
        "energydsl.kernels.attention was imported before TRITON_INTERPRET=1 was set", allow_module_level=True
    )

DEVICE = "cuda" if CUDA else "cpu"
TOL = 1e-4  # relative, float32 kernel vs float64 reference

KERNEL = {
    "attention": kernels.energy_attention,
    "with_lse": kernels.energy_attention_with_lse,
    "second": kernels.weighted_second_moment,
}
WIDE = {  # the feature-tiled kernels (any width; the module-level functions take them above 256)
    "attention": kernels.GENERIC_WIDE.energy_attention,
    "with_lse": kernels.GENERIC_WIDE.energy_attention_with_lse,
    "second": kernels.GENERIC_WIDE.weighted_second_moment,
}
REFERENCE = {
    "attention": ref.energy_attention_ref,
    "with_lse": ref.energy_attention_lse_ref,
    "second": ref.weighted_second_moment_ref,
}


@dataclass(frozen=True)
class Case:
    T: int
    H: int
    Dk: int
    Dv: int
    strict: bool
    biases: str = "none"  # none | alibi | self | key | all
    tied: bool = False  # v is k
    B: int = 2
    key_shift: float = 0.0  # added to every key bias: softmax-invariant, but exp of it overflows float32 past ~88
    layout: str = "head"  # of q, k, v, u: head (contiguous), token, sliced or packed (`lay`)
    score_scale: float = 1.0  # times the usual 1/sqrt(Dk): large scores, a nearly one-hot softmax
    q_scale: float = 1.0  # of the queries
    u_along_q: float = 0.0  # nonzero: the second moment's u is q times it (a Newton step's direction at a large
    #                          state), so that u_i . v_j follows the score

    def has(self, bias: str) -> bool:
        return self.biases in (bias, "all")


def rel_err(x: torch.Tensor, reference: torch.Tensor) -> float:
    """max |x - ref| / max |ref|; plain max |x - ref| when the reference is identically 0."""
    reference = reference.double()
    err = (x.double() - reference).abs().max().item()
    scale = reference.abs().max().item()
    return err / scale if scale > 0 else err


def make_leaves(case: Case, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Leaf tensors (requires_grad) on DEVICE; generated in float64 so both sides see the same numbers."""
    g = torch.Generator().manual_seed(seed)
    B, H, T = case.B, case.H, case.T

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    leaves = {"q": randn(B, H, T, case.Dk) * case.q_scale, "k": randn(B, H, T, case.Dk), "u": randn(B, H, T, case.Dv)}
    if case.u_along_q:
        leaves["u"] = leaves["q"] * case.u_along_q
    if not case.tied:
        leaves["v"] = randn(B, H, T, case.Dv)
    if case.has("alibi"):
        leaves["alibi_slopes"] = torch.rand(H, generator=g, dtype=torch.float64) * 0.5
    if case.has("self"):
        leaves["self_bias"] = randn(H)
    if case.has("key"):
        leaves["key_bias"] = randn(B, H, T) * 0.5 + case.key_shift
    return {n: t.to(device=DEVICE, dtype=dtype).requires_grad_() for n, t in leaves.items()}


def run(
    impl: dict,
    case: Case,
    leaves: dict[str, torch.Tensor],
    kind: str,
    cot_dtype: torch.dtype = torch.float32,
    seed: int = 1,
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Outputs of one op family and the gradients of a random linear functional of them w.r.t. every leaf.

    kind: "attention" (o), "with_lse" (o, lse, r = second moment fed the differentiable lse),
    "second" (r with lse=None, i.e. recomputed inside).
    """
    q, k, u = (lay(leaves[n], case.layout) for n in ("q", "k", "u"))
    v = k if case.tied else lay(leaves["v"], case.layout)
    kw = dict(
        scale=case.score_scale * case.Dk**-0.5,
        strict=case.strict,
        alibi_slopes=leaves.get("alibi_slopes"),
        self_bias=leaves.get("self_bias"),
        key_bias=leaves.get("key_bias"),
    )
    if kind == "attention":
        outs = [impl["attention"](q, k, v, **kw)]
    elif kind == "with_lse":
        o, lse = impl["with_lse"](q, k, v, **kw)
        outs = [o, lse, impl["second"](q, k, v, lse, u, **kw)]
    else:
        outs = [impl["second"](q, k, v, None, u, **kw)]
    g = torch.Generator().manual_seed(seed)
    cots = [torch.randn(out.shape, generator=g, dtype=torch.float64).to(cot_dtype).to(out) for out in outs]
    loss = sum((out * cot).sum() for out, cot in zip(outs, cots, strict=True))
    names = [n for n in leaves if kind != "attention" or n != "u"]
    grads = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
    return outs, {
        n: torch.zeros_like(leaves[n]) if gr is None else gr for n, gr in zip(names, grads, strict=True)
    }


def lse_floor(case: Case, leaves: dict[str, torch.Tensor]) -> float:
    """The error a recomputed softmax cannot go under in float32: p = exp(s - lse) carries the rounding of
    s and lse, about max|s| 2^-24, as a factor per row (FlashAttention's own floor). Below it, a kernel
    matches a float32 reference only where its products round exactly as the forward's: numpy's BLAS on
    Intel gives q k^T and (k q^T)^T bit for bit, on AMD (OpenBLAS's Zen kernels) it does not."""
    q, k = leaves["q"].detach().double(), leaves["k"].detach().double()
    s = (q @ k.transpose(-1, -2)).abs().amax() * case.score_scale * case.Dk**-0.5
    if case.has("key"):
        s = s + leaves["key_bias"].detach().double().abs().amax()
    return 2.0 * float(s) * 2.0**-24


def check(
    case: Case, kind: str, dtype: torch.dtype = torch.float32, tol: float = TOL, factor: float = 2.0,
    impl: dict | None = None, floor: bool = False,
) -> None:
    """Kernel in `dtype` vs the float64 reference: every output and gradient finite and within
    max(tol, factor * error of the PyTorch reference run in `dtype`) relative error.

    The adaptive part matters only for ill-conditioned quantities: e.g. d self_bias = sum_i dS_ii can be a
    1e-4 remainder of O(1) terms, which no float32 implementation gets to 1e-4 relative accuracy. `floor`
    adds `lse_floor` for large scores.
    """
    leaves = make_leaves(case, dtype)  # all three runs see the same (rounded) inputs and cotangents
    tol = max(tol, lse_floor(case, leaves)) if floor else tol

    def fresh(dt: torch.dtype) -> dict[str, torch.Tensor]:
        return {n: t.detach().to(dt).requires_grad_() for n, t in leaves.items()}

    outs, grads = run(impl or KERNEL, case, fresh(dtype), kind, cot_dtype=dtype)
    lp_outs, lp_grads = run(REFERENCE, case, fresh(dtype), kind, cot_dtype=dtype)
    ref_outs, ref_grads = run(REFERENCE, case, fresh(torch.float64), kind, cot_dtype=dtype)
    pairs = [
        (f"output {i}", x, lp, r) for i, (x, lp, r) in enumerate(zip(outs, lp_outs, ref_outs, strict=True))
    ]
    pairs += [(f"d{n}", grads[n], lp_grads[n], ref_grads[n]) for n in grads]
    for name, x, lp, r in pairs:
        assert torch.isfinite(x).all(), f"{name} not finite"
        bound = max(tol, factor * rel_err(lp, r))
        assert rel_err(x, r) <= bound, f"{name}: rel err {rel_err(x, r):.2e} > {bound:.2e}"


# (H, Dk, Dv) paired with the bias variants, so that every head count / head dim appears with several biases
SHAPES = {
    "none": (1, 16, 16),
    "alibi": (3, 32, 24),
    "self": (3, 16, 24),
    "key": (1, 32, 16),
    "all": (3, 32, 24),
}


@pytest.mark.parametrize("biases", list(SHAPES))
@pytest.mark.parametrize("strict", [False, True], ids=["causal", "strict"])
@pytest.mark.parametrize("T", [1, 7, 33])
def test_attention_matches_reference(T: int, strict: bool, biases: str) -> None:
    H, Dk, Dv = SHAPES[biases]
    check(Case(T=T, H=H, Dk=Dk, Dv=Dv, strict=strict, biases=biases), "attention")


@pytest.mark.parametrize("strict", [False, True], ids=["causal", "strict"])
@pytest.mark.parametrize("T", [7, 33])
def test_attention_tied_values(T: int, strict: bool) -> None:
    """v is k: the kernel returns dk and dv separately and autograd must add them into the one tensor."""
    check(Case(T=T, H=2, Dk=32, Dv=32, strict=strict, biases="all", tied=True, B=1), "attention")


@pytest.mark.parametrize("biases", ["none", "all"])
@pytest.mark.parametrize("strict", [False, True], ids=["causal", "strict"])
@pytest.mark.parametrize("T", [1, 7, 33])
def test_lse_and_second_moment_match_reference(T: int, strict: bool, biases: str) -> None:
    """o, lse and r fed with the differentiable lse: gradients through lse must not be counted twice."""
    H, Dk, Dv = (2, 16, 24) if biases == "all" else (1, 32, 16)
    check(Case(T=T, H=H, Dk=Dk, Dv=Dv, strict=strict, biases=biases), "with_lse")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("strict", [False, True], ids=["causal", "strict"])
def test_second_moment_recomputes_lse(strict: bool, tied: bool) -> None:
    check(Case(T=33, H=1, Dk=16, Dv=16, strict=strict, biases="all", tied=tied, B=1), "second")


# the backward modes a layout must hold in: narrow split or fused (dQ by atomics), wide tiled or looping
MODES = {"narrow-split": (False, False), "narrow-fused": (False, True), "wide-tiled": (True, False),
         "wide-loop": (True, True)}


def _layout_case(layout: str, mode: str, kind: str) -> object:
    """CI: every kind token-major in the base modes, and `with_lse` (o, lse and the second moment fed that
    lse: both ops, every operand) in every mode and, in the base modes, every layout. The rest is `slow`."""
    base_mode = not mode.endswith(("fused", "loop"))
    in_ci = (base_mode or layout == "token") if kind == "with_lse" else (base_mode and layout == "token")
    return pytest.param(layout, mode, kind, marks=() if in_ci else pytest.mark.slow)


@pytest.mark.parametrize("layout, mode, kind", [_layout_case(layout, mode, kind)
                                                for layout in ("token", "sliced", "packed") for mode in MODES
                                                for kind in ("attention", "with_lse", "second")])
def test_layouts_match_reference(monkeypatch, layout: str, mode: str, kind: str) -> None:
    """q, k, v and u token-major, sliced or packed (read in place through their strides; gradients through
    strides of their own): every output and gradient, in each backward mode of the narrow and the wide
    kernels."""
    wide, other_mode = MODES[mode]
    if CUDA and other_mode:
        pytest.skip("on a GPU the backward's mode is timed or tuned")
    monkeypatch.setattr(kernels, "INTERPRET_FEATURE_LOOP" if wide else "INTERPRET_DQ_ATOMIC", other_mode)
    case = Case(T=21, H=3, Dk=40 if wide else 16, Dv=24, strict=False, biases="all", B=2, layout=layout)
    check(case, kind, impl=WIDE if wide else None)


@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
def test_token_major_heads_stay_token_major(wide: bool) -> None:
    """Heads split off (B, T, H * D) projections reach the kernels without a copy and come back the same way:
    o and r are written token-major, so that merging their heads is a view of the kernels' own output, and
    the gradients of q, k, v and u arrive with those tensors' strides (no copy in the views' backward)."""
    ops = kernels.GENERIC_WIDE if wide else kernels.GENERIC
    B, T, H, Dk, Dv = 2, 19, 3, (40 if wide else 16), 24
    g = torch.Generator().manual_seed(0)
    flat = {n: torch.randn(B, T, H * d, generator=g).to(DEVICE).requires_grad_()
            for n, d in (("q", Dk), ("k", Dk), ("v", Dv), ("u", Dv))}
    heads = {n: t.unflatten(-1, (H, -1)).transpose(1, 2) for n, t in flat.items()}  # (B, H, T, D) views
    grad_strides = {}
    for name, t in heads.items():
        t.register_hook(lambda grad, name=name: grad_strides.__setitem__(name, grad.stride()))
    o, lse = ops.energy_attention_with_lse(heads["q"], heads["k"], heads["v"], scale=0.25)
    r = ops.weighted_second_moment(heads["q"], heads["k"], heads["v"], lse, heads["u"], scale=0.25)
    for out in (o, r):
        merged = out.transpose(1, 2).flatten(-2)
        assert out.stride() == heads["v"].stride() and merged.data_ptr() == out.data_ptr()
        assert merged._base is not None  # a view, not a copy
    (o.transpose(1, 2).flatten(-2).sum() + r.transpose(1, 2).flatten(-2).square().sum()).backward()
    assert grad_strides == {n: t.stride() for n, t in heads.items()}, grad_strides


@pytest.mark.skipif(CUDA, reason="on CUDA the autotuner picks the tiles")
@pytest.mark.parametrize("blocks", [(16, 32), (32, 16)], ids=lambda b: f"M{b[0]}-N{b[1]}")
def test_unequal_query_and_key_tiles(blocks: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU configs use BLOCK_M != BLOCK_N; the causal loop bounds must hold for those too."""
    monkeypatch.setattr(kernels, "_INTERPRET_BLOCKS", {"BLOCK_M": blocks[0], "BLOCK_N": blocks[1]})
    for strict in (False, True):
        check(Case(T=45, H=1, Dk=16, Dv=24, strict=strict, biases="all", B=1), "with_lse")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T, D", [(1, 16), (70, 24), (130, 300), (5, 129)],
                         ids=["T1-d16", "T70-d24", "T130-d300", "T5-d129"])
def test_backward_row_term_matches_torch(T: int, D: int, dtype: torch.dtype) -> None:
    """`_bwd_delta_kernel`, delta_i = dO_i . o_i - dlse_i in fp32, against the torch form it replaces: rows in
    several blocks with a padded tail, one feature tile and several (300 = 2 x 128 + a masked 44; 129, whose last
    tile holds one feature: a loop bound of D - 1 survived the others), with and
    without an lse gradient; o and dO each head-major (B, H, T, D) or token-major ((B, T, H, D) in memory), read
    through their strides."""
    gen = torch.Generator(device=DEVICE).manual_seed(T + D)
    dlse = torch.randn(2, 3, T, generator=gen, device=DEVICE)

    def rows(token_major: bool) -> torch.Tensor:
        shape = (2, T, 3, D) if token_major else (2, 3, T, D)
        t = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
        return t.transpose(1, 2) if token_major else t

    for grad_lse, o_token, do_token in itertools.product((None, dlse), (False, True), (False, True)):
        o, do = rows(o_token), rows(do_token)
        delta = torch.full((2, 3, T), float("nan"), device=DEVICE)
        kernels._bwd_delta_kernel[(-(-T // kernels._DELTA_ROWS), 6)](
            o, do, o if grad_lse is None else grad_lse, delta, *o.stride()[:3], *do.stride()[:3], T, 3, D,
            HAS_DLSE=grad_lse is not None,
            BLOCK_M=kernels._DELTA_ROWS, BLOCK_D=min(kernels._pad(D), kernels._DELTA_FEATURES),
        )
        want = (o.double() * do.double()).sum(-1) - (0 if grad_lse is None else grad_lse.double())
        torch.testing.assert_close(delta.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
def test_padded_rows_stay_inert_under_large_scores(wide: bool) -> None:
    """The backward visits the query blocks wholly after a key block without a mask; the last of them is padded
    past T, and its padded rows (q = dO = 0) must contribute nothing even where exp of their unmasked scores
    overflows: a key bias of 100 makes exp(s) inf there, and inf * 0 would poison dK through the padded rows."""
    case = Case(T=45, H=1, Dk=16, Dv=24, strict=False, biases="key", B=1, key_shift=100.0)
    check(case, "with_lse", impl=WIDE if wide else None)


@pytest.mark.parametrize("kind", ["with_lse", "second"])
@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
def test_second_moment_keeps_its_digits_under_large_scores(wide: bool, kind: str) -> None:
    """Scores up to ~150: the second moment's p = exp(s - lse) carries lse's rounding as a factor per row
    (~|lse| 2^-24), so its weights do not sum to 1. The forward divides r by that sum and the backward dr;
    without the first, the backward's delta = dr . r disagreed with the weights it sums (dq, dk ~10x further
    from float64 than the float32 reference); without the second, du and dv ~5x."""
    case = Case(T=40, H=2, Dk=16, Dv=16, strict=False, B=1, score_scale=10.0)
    check(case, kind, tol=1e-6, factor=3.0, impl=WIDE if wide else None, floor=True)


@pytest.mark.parametrize("strict", [False, True], ids=["causal", "strict"])
@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
def test_second_moment_keeps_its_digits_where_u_follows_large_queries(wide: bool, strict: bool) -> None:
    """Queries of 1000 and u along them, as in a Newton step from a large state (u the gradient, q the
    state's projection): delta = dr . r, its value in exact arithmetic, carried r's rounding into every dS_ij,
    and dq, dk came out 1e16 off (a taylor-3 Newton energy's gradients 8e-2). The backward now sums
    delta_i = sum_j p_ij dP_ij over the weights it recomputes, so that dS sums to 0 over j."""
    case = Case(T=17, H=1, Dk=16, Dv=16, strict=strict, biases="key", B=1, q_scale=2000.0, u_along_q=1000.0)
    check(case, "second", tol=1e-6, factor=10.0, impl=WIDE if wide else None, floor=True)


@pytest.mark.slow
@pytest.mark.skipif(CUDA, reason="on CUDA the autotuner picks the tiles")
@pytest.mark.parametrize(
    "blocks, case",
    [
        ((64, 64), Case(T=130, H=2, Dk=128, Dv=128, strict=False, biases="all", B=1)),
        ((128, 64), Case(T=200, H=1, Dk=64, Dv=80, strict=True, biases="all")),
        ((64, 32), Case(T=97, H=2, Dk=48, Dv=16, strict=True, biases="all", B=1)),
        ((16, 32), Case(T=70, H=1, Dk=128, Dv=128, strict=False, biases="all", B=1, tied=True)),
    ],
    ids=["M64-N64-d128", "M128-N64-d64x80", "M64-N32-d48x16", "M16-N32-d128-tied"],
)
def test_gpu_sized_tiles_interpreted(
    blocks: tuple[int, int], case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The autotuner's tile shapes, head dims up to 128 (non powers of two too), interpreted (~70 s)."""
    monkeypatch.setattr(kernels, "_INTERPRET_BLOCKS", {"BLOCK_M": blocks[0], "BLOCK_N": blocks[1]})
    for kind in ("attention", "with_lse", "second"):
        check(case, kind)


# (Dk, Dv) for the wide kernels, whose feature tile is 16 under the interpreter: several key tiles with a
# masked tail and fewer value tiles, the reverse, and one width (tied values)
WIDE_WIDTHS = {"dk40-dv24": (40, 24, False), "dk16-dv36": (16, 36, False), "tied-d40": (40, 40, True)}


@pytest.mark.parametrize("loop", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["tiled", "loop"])
@pytest.mark.parametrize("kind", ["attention", "with_lse", "second"])
@pytest.mark.parametrize("widths, strict", [  # CI: the strict mask at the first widths alone
    pytest.param(w, strict, marks=pytest.mark.slow if strict and w != "dk40-dv24" else (),
                 id=f"{'strict' if strict else 'causal'}-{w}")
    for strict in (False, True) for w in WIDE_WIDTHS])
def test_wide_kernels_match_reference(monkeypatch, strict: bool, widths: str, kind: str, loop: bool) -> None:
    """The feature-tiled kernels: every output and gradient, every bias, two heads, several row blocks (on a
    GPU the tile is 64 wide: GPU_CASES has the wide widths). The backward both ways: a program per feature
    tile, and one per row block adding to every tile (FEATURE_LOOP; on a GPU the autotuner picks)."""
    if loop and CUDA:
        pytest.skip("on a GPU the autotuner owns FEATURE_LOOP")
    monkeypatch.setattr(kernels, "INTERPRET_FEATURE_LOOP", loop)
    dk, dv, tied = WIDE_WIDTHS[widths]
    check(Case(T=21, H=2, Dk=dk, Dv=dv, strict=strict, biases="all", tied=tied, B=1), kind, impl=WIDE)


def test_wide_widths_take_the_wide_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above 256 features the module-level functions run GENERIC_WIDE (the narrow set refuses such widths)."""
    if not CUDA:  # few, wide tiles: the interpreter runs every program in Python
        monkeypatch.setattr(kernels, "INTERPRET_FEATURE_TILE", 128)
    case = Case(T=5, H=1, Dk=300, Dv=24, strict=False, biases="key", B=1)
    leaves = make_leaves(case, torch.float32)
    with pytest.raises(ValueError, match="wide kernels"):
        kernels.GENERIC.energy_attention(leaves["q"], leaves["k"], leaves["v"], scale=0.1)
    calls = []
    monkeypatch.setattr(kernels.GENERIC_WIDE, "_launch_fwd",
                        lambda *a, _f=kernels.GENERIC_WIDE._launch_fwd: calls.append(1) or _f(*a))
    check(case, "with_lse")
    assert calls, "the wide kernels were not launched"


@pytest.mark.skipif(CUDA, reason="on a GPU the autotuner owns the tiles")
@pytest.mark.parametrize("tiles", [(32, 128), (128, 32)], ids=["keys-4x-queries", "queries-4x-keys"])
@pytest.mark.parametrize("kind", ["with_lse", "second"])
def test_unequal_row_tiles(monkeypatch, tiles: tuple[int, int], kind: str) -> None:
    """The autotuner may pick 128-key dK/dV and 128-query dQ programs (the Hopper backward tiles): the causal
    diagonal then spans four blocks of the other axis. Every kernel, forward and backward, at both shapes."""
    monkeypatch.setattr(kernels, "_INTERPRET_BLOCKS", dict(BLOCK_M=tiles[0], BLOCK_N=tiles[1]))
    check(Case(T=300, H=1, Dk=16, Dv=16, strict=False, biases="all", B=1), kind)


@pytest.mark.skipif(CUDA, reason="on a GPU the autotuner owns the tiles")
@pytest.mark.parametrize("kind", ["with_lse", "second"])
@pytest.mark.parametrize("loop", [False, True], ids=["tiled", "loop"])
def test_wide_kernels_with_a_256_feature_tile(monkeypatch, kind: str, loop: bool) -> None:
    """The wide backward's widest autotune tile (256 features, 32 x 32 rows): a 300-wide score is one full tile
    and a masked tail, values fit in the first tile and the other programs' value tiles are empty."""
    monkeypatch.setattr(kernels, "_INTERPRET_BLOCKS", dict(BLOCK_M=32, BLOCK_N=32))
    monkeypatch.setattr(kernels, "INTERPRET_FEATURE_TILE", 256)
    monkeypatch.setattr(kernels, "INTERPRET_FEATURE_LOOP", loop)
    check(Case(T=70, H=1, Dk=300, Dv=24, strict=False, biases="all", B=1), kind, impl=WIDE)


@pytest.mark.parametrize("width", [832, 300, 64, 24])
def test_the_grid_follows_each_configs_feature_tile(width: int) -> None:
    """On a GPU the autotuner picks the wide kernels' BLOCK_D with the row tiles: for every config the grid
    must give each feature tile exactly one program (too few leaves features unwritten, too many is waste)."""
    for block, configs in zip(("BLOCK_M", "BLOCK_N", "BLOCK_M"), kernels.AUTOTUNE_CONFIGS[True]):
        for cfg in configs:
            rows, _, tiles = kernels.GENERIC_WIDE._grid(100, 6, block, width)(cfg.kwargs)
            tile = cfg.kwargs["BLOCK_D"]
            if cfg.kwargs.get("FEATURE_LOOP"):  # one program loops over every tile
                assert tiles == 1, cfg
            else:
                assert (tiles - 1) * tile < width <= tiles * tile, cfg
            assert (rows - 1) * cfg.kwargs[block] < 100 <= rows * cfg.kwargs[block], cfg
    for configs in kernels.AUTOTUNE_CONFIGS[False]:  # the narrow kernels hold whole widths: one tile
        assert all("BLOCK_D" not in cfg.kwargs and kernels.GENERIC._grid(100, 6, "BLOCK_M", width)(cfg.kwargs)[2] == 1
                   for cfg in configs)


def test_every_launch_passes_the_sequence_length_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the autotuner keys on T's power-of-two bucket (`T_TUNE`), so that long sequences are not run
    with the tiles tuned at the first, short one, and generation (T + 1 at each step) does not retune. Every
    launch, forward, dK/dV and dQ, narrow and wide, must pass that bucket."""
    assert [kernels.tune_bucket(t) for t in (1, 1000, 1024, 1025, 5000, 16384)] == [1024, 1024, 1024, 2048,
                                                                                      8192, 16384]
    assert all("T_TUNE" in keys for keys in kernels.TUNE_KEYS.values())
    launched = record_launches(monkeypatch)
    for ops, (d_qk, d_v) in ((kernels.GENERIC, (16, 16)), (kernels.GENERIC_WIDE, (40, 24))):
        q, k = (torch.randn(1, 2, 21, d_qk, device=DEVICE, requires_grad=True) for _ in range(2))
        v = torch.randn(1, 2, 21, d_v, device=DEVICE, requires_grad=True)
        ops.energy_attention(q, k, v, scale=0.3).sum().backward()
    tuned = [(name, T, bucket) for name, T, bucket in launched if name != "_bwd_delta_kernel"]  # untuned
    assert len({name for name, _, _ in tuned}) == 6 and len(tuned) == len(launched) - 2, launched
    assert all(T == 21 and bucket == 1024 for _, T, bucket in tuned), launched


def record_launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int | None]]:
    """(kernel name, T, T_TUNE or None for an untuned kernel) of every kernel launch from here on, in order;
    the dQ kernel's pass for the second moment's row term is `_bwd_dq_kernel (delta pass)`."""
    launched = []
    wrap = kernels.wrap_triton

    def spy(kernel):  # wrap_triton(kernel)[grid](*args)
        class Launcher:
            def __getitem__(self, grid):
                def launch(*args, **kw):
                    names = list(kernel.arg_names)
                    bucket = args[names.index("T_TUNE")] if "T_TUNE" in names else None
                    name = kernel.__name__ + (" (delta pass)" if kw.get("DELTA_PASS") else "")
                    launched.append((name, args[names.index("T")], bucket))
                    return wrap(kernel)[grid](*args, **kw)
                return launch
        return Launcher()

    monkeypatch.setattr(kernels, "wrap_triton", spy)
    return launched


# the fused backward (the dK/dV kernel adds dQ, and the second moment's dU, by atomics): the cases where its
# additions could go wrong: several key blocks adding into one dQ row, the strict empty row, padded query rows,
# tied values, a query block spanning several key blocks and the reverse
FUSED_CASES = {
    "causal-all": (Case(T=33, H=3, Dk=32, Dv=24, strict=False, biases="all"), None),
    "strict-all": (Case(T=33, H=2, Dk=16, Dv=24, strict=True, biases="all"), None),
    "strict-T1": (Case(T=1, H=1, Dk=16, Dv=16, strict=True), None),
    "tied-alibi": (Case(T=20, H=2, Dk=32, Dv=32, strict=False, biases="alibi", tied=True, B=1), None),
    "keys-4x-queries": (Case(T=90, H=1, Dk=16, Dv=16, strict=False, biases="key", B=1), (16, 64)),
    "queries-4x-keys": (Case(T=90, H=1, Dk=16, Dv=16, strict=True, biases="self", B=1), (64, 16)),
}


@pytest.mark.skipif(CUDA, reason="on a GPU `_fuse_dq` times both backwards; test_gpu_narrow_backward_in_each_mode")
@pytest.mark.parametrize("kind", ["attention", "with_lse", "second"])
@pytest.mark.parametrize("name", list(FUSED_CASES))
def test_fused_backward_matches_reference(monkeypatch, name: str, kind: str) -> None:
    """The narrow backward with dQ (and dU) added by the dK/dV kernel's atomics: every output and gradient.
    No dQ kernel runs, but for the second moment's row term (its delta pass)."""
    case, tiles = FUSED_CASES[name]
    monkeypatch.setattr(kernels, "INTERPRET_DQ_ATOMIC", True)
    if tiles:
        monkeypatch.setattr(kernels, "_INTERPRET_BLOCKS", dict(BLOCK_M=tiles[0], BLOCK_N=tiles[1]))
    launched = record_launches(monkeypatch)
    check(case, kind)
    kernel_names = {kernel for kernel, _, _ in launched}
    assert "_bwd_dkdv_kernel" in kernel_names and "_bwd_dq_kernel" not in kernel_names, kernel_names
    row_term = "_bwd_dq_kernel (delta pass)" if kind != "attention" else "_bwd_delta_kernel"
    assert row_term in kernel_names, kernel_names


def _timed_backwards(monkeypatch: pytest.MonkeyPatch) -> tuple:
    """An op set whose `_fuse_dq` runs as on a GPU (the interpreter's switch off), with do_bench replaced (it
    needs one): (ops, the times do_bench reports, the backwards run, split, fused)."""
    import triton.testing

    ops = kernels.AttentionOps.__new__(kernels.AttentionOps)  # no op registration: _fuse_dq reads these
    ops._dkdv_fused, ops.backward_choices, ops._kernels_id = object(), {}, "kernels"
    monkeypatch.setattr(kernels, "INTERPRET", False)
    times = {"split": 2.0, "fused": 1.5}
    runs: list[str] = []
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: times[fn()])
    split, fused = (lambda: runs.append("split") or "split"), (lambda: runs.append("fused") or "fused")
    return ops, times, runs, split, fused


def test_backward_mode_is_the_faster_timed_once_per_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """`_fuse_dq` as on a GPU (the interpreter's switch off; do_bench replaced, as it needs one): the first call
    of a shape runs and times both backwards and records the faster; later calls reuse it; a traced call for an
    untimed shape, or deterministic algorithms, run split without timing."""
    monkeypatch.setenv("ENERGYDSL_TUNING_CACHE", "off")  # this process's memory only (the disk: below)
    ops, times, runs, split, fused = _timed_backwards(monkeypatch)
    q = torch.zeros(1)
    assert ops._fuse_dq("a", q, split, fused) is True
    assert ops.backward_choices["a"] == kernels.BackwardChoice(True, 2.0, 1.5) and runs.count("fused") == 2
    runs.clear()
    times["fused"] = 3.0  # a later call reuses the choice, without timing
    assert ops._fuse_dq("a", q, split, fused) is True and not runs
    assert ops._fuse_dq("b", q, split, fused) is False and ops.backward_choices["b"].fused is False
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    runs.clear()
    assert ops._fuse_dq("c", q, split, fused) is False and not runs and "c" not in ops.backward_choices
    assert ops._fuse_dq("a", q, split, fused) is True  # a timed shape keeps its choice when traced
    torch.use_deterministic_algorithms(True)
    try:
        assert ops._fuse_dq("a", q, split, fused) is False
    finally:
        torch.use_deterministic_algorithms(False)


def test_backward_mode_is_kept_on_disk_for_later_processes(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A choice timed in one process is read by the next (an op set with empty memory) without timing, also
    when that one is traced; a file that is not a choice is timed over; `off` writes nothing."""
    monkeypatch.setenv("ENERGYDSL_TUNING_CACHE", str(tmp_path))
    ops, times, runs, split, fused = _timed_backwards(monkeypatch)
    q = torch.zeros(1)
    assert ops._fuse_dq(("a", q.device), q, split, fused) is True and runs
    (record,) = tmp_path.glob("*.json")
    later, times, runs, split, fused = _timed_backwards(monkeypatch)
    times["fused"] = 3.0  # were it timed again, split would win
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert later._fuse_dq(("a", q.device), q, split, fused) is True and not runs
    assert later.backward_choices[("a", q.device)] == kernels.BackwardChoice(True, 2.0, 1.5)
    other, times, runs, split, fused = _timed_backwards(monkeypatch)
    other._kernels_id = "changed kernels"  # another kernel source: its own record, so timed afresh
    assert other._fuse_dq(("a", q.device), q, split, fused) is False and not runs  # traced, nothing on disk
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    record.write_text('{"format": 1, "fused": "yes", "split_ms": 2.0, "fused_ms": 1.5}')
    again, times, runs, split, fused = _timed_backwards(monkeypatch)
    times["fused"] = 3.0
    assert again._fuse_dq(("a", q.device), q, split, fused) is False and runs  # unreadable: timed again
    assert json.loads(record.read_text())["fused"] is False
    monkeypatch.chdir(tmp_path)
    for off in ("off", ""):  # an empty setting is off too, not the working directory
        monkeypatch.setenv("ENERGYDSL_TUNING_CACHE", off)
        last, *_, split, fused = _timed_backwards(monkeypatch)
        assert last._fuse_dq(("b", q.device), q, split, fused) is True and len(list(tmp_path.glob("*"))) == 1


def test_autotuners_keep_their_choices_on_disk(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """On a GPU every family's autotuner is built with Triton's disk cache of its choices, unless
    ENERGYDSL_TUNING_CACHE is off (read when the kernels are wrapped)."""
    import triton

    from energydsl.kernels import launch

    built = []

    def autotune(configs: list, key: list, cache_results: bool = False) -> Callable:  # records its call
        built.append(cache_results)
        return lambda kernel: kernel

    monkeypatch.setattr(launch, "INTERPRET", False)
    monkeypatch.setattr(triton, "autotune", autotune)
    for setting in ("off", str(tmp_path)):
        monkeypatch.setenv("ENERGYDSL_TUNING_CACHE", setting)
        launch.maybe_autotune([], ["T_TUNE"])(object())
    assert built == [False, True]


@pytest.mark.skipif(CUDA, reason="on CUDA the autotuner picks the tiles")
@pytest.mark.parametrize(
    "blocks, case",
    [
        ((32, 128), Case(T=300, H=2, Dk=64, Dv=64, strict=False, biases="all", B=1)),
        ((64, 128), Case(T=200, H=1, Dk=128, Dv=96, strict=True, biases="all", B=1, tied=False)),
    ],
    ids=["M32-N128-d64", "M64-N128-d128x96"],
)
def test_fused_backward_at_gpu_sized_tiles(blocks: tuple[int, int], case: Case, monkeypatch) -> None:
    """The fused backward's autotune tiles (128 keys per program), head dims 64 and 128, interpreted."""
    monkeypatch.setattr(kernels, "INTERPRET_DQ_ATOMIC", True)
    monkeypatch.setattr(kernels, "_INTERPRET_BLOCKS", {"BLOCK_M": blocks[0], "BLOCK_N": blocks[1]})
    for kind in ("with_lse", "second"):
        check(case, kind)


@pytest.mark.skipif(CUDA, reason="the interpreter's switch; on a GPU the same rule holds before any timing")
def test_deterministic_algorithms_keep_the_dq_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Atomics add in no fixed order, so with torch.use_deterministic_algorithms(True) the backward runs the
    dQ kernel even where the fused mode would be chosen."""
    monkeypatch.setattr(kernels, "INTERPRET_DQ_ATOMIC", True)
    launched = record_launches(monkeypatch)
    q = torch.randn(1, 2, 9, 16, requires_grad=True)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        kernels.energy_attention(q, q, q, scale=0.25).sum().backward()
    finally:
        torch.use_deterministic_algorithms(previous)
    assert "_bwd_dq_kernel" in {name for name, _, _ in launched}, launched


def test_strict_first_row_is_zero_and_lse_finite() -> None:
    leaves = make_leaves(Case(T=5, H=2, Dk=16, Dv=16, strict=True, biases="all"), torch.float32)
    o, lse = kernels.energy_attention_with_lse(
        leaves["q"], leaves["k"], leaves["v"], scale=0.25, strict=True, key_bias=leaves["key_bias"]
    )
    assert torch.all(o[:, :, 0] == 0) and torch.all(lse[:, :, 0] == 0)
    assert torch.isfinite(lse).all()


@pytest.mark.parametrize("kind", ["with_lse", "second"])
def test_bfloat16_and_float64_inputs_give_the_reference(kind: str) -> None:
    """bfloat16: the interpreter's tl.dot misreads bf16 (triton#11584), so it runs on float32 copies there; on
    a GPU the kernel takes bf16. float64: no kernel takes it (the kernels accumulate in float32, and the
    attention kernels do not compile for it), so the op is the exact reference, gradients included."""
    case = Case(T=9, H=2, Dk=16, Dv=16, strict=False, biases="all", B=1)
    leaves = make_leaves(case, torch.float64)
    args = [leaves[n] for n in ("q", "k", "v")]
    kw = dict(scale=0.25, alibi_slopes=leaves["alibi_slopes"], self_bias=leaves["self_bias"],
              key_bias=leaves["key_bias"])
    extra = [None, leaves["u"]] if kind == "second" else []
    want = REFERENCE[kind](*args, *extra, **kw)
    want = want[0] if kind == "with_lse" else want
    half = [a.detach().bfloat16() for a in args + extra[1:]]
    got = KERNEL[kind](*half[:3], *([None, half[3]] if kind == "second" else []), **kw)
    got = got[0] if kind == "with_lse" else got
    assert got.dtype == torch.bfloat16 and rel_err(got, want) < 3e-2, rel_err(got, want)  # bf16: 8 bits of mantissa
    got64 = KERNEL[kind](*args, *extra, **kw)
    got64 = got64[0] if kind == "with_lse" else got64
    assert got64.dtype == torch.float64 and rel_err(got64, want) < 1e-13
    grads = torch.autograd.grad(got64.sum(), args)
    for g, r in zip(grads, torch.autograd.grad(want.sum(), args)):
        assert rel_err(g, r) < 1e-12


@pytest.mark.parametrize("ops", [kernels.GENERIC, kernels.GENERIC_WIDE], ids=["narrow", "wide"])
def test_opcheck(ops: kernels.AttentionOps) -> None:
    """Schema, fake (shape) functions, autograd registration and AOT dispatch of both forward ops."""
    leaves = make_leaves(Case(T=7, H=2, Dk=24, Dv=16, strict=True, biases="all", B=1), torch.float32)
    q, k, v, u = leaves["q"], leaves["k"], leaves["v"], leaves["u"]
    biases = (leaves["alibi_slopes"], leaves["self_bias"], leaves["key_bias"])
    namespace = torch.ops.energydsl
    torch.library.opcheck(getattr(namespace, f"{ops.name}_fwd").default, (q, k, v, 0.25, True, *biases))
    _, lse = ops.energy_attention_with_lse(q, k, v, scale=0.25, strict=True)
    torch.library.opcheck(
        getattr(namespace, f"{ops.name}_second_fwd").default,
        (q, k, v, lse.detach(), u, 0.25, True, None, biases[1], None),
    )


def sliced(t: torch.Tensor) -> torch.Tensor:
    """t's values as the first columns of a tensor twice as wide: a layout the kernels read in place."""
    return torch.cat([t.detach(), torch.zeros_like(t)], dim=-1)[..., : t.shape[-1]]


def strided(t: torch.Tensor) -> torch.Tensor:
    """t's values in a layout the kernels do not read in place: a (B, H, T, D) tensor with its features T apart
    (a transposed (..., D, T) tensor), any other with every other element of a wider one."""
    t = t.detach()
    if t.dim() == 4:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    return torch.stack([t, torch.zeros_like(t)], dim=-1)[..., 0]


@pytest.mark.parametrize("ops", [kernels.GENERIC, kernels.GENERIC_WIDE], ids=["narrow", "wide"])
def test_direct_op_calls_take_any_layout(ops: kernels.AttentionOps) -> None:
    """The three ops called directly (the public functions lay out their inputs first, a direct caller need
    not), every tensor in a layout the kernels cannot read in place, give what laid-out inputs give, as does
    the backward given dO in another dtype; and opcheck's fake tensors get the strides the op bodies give."""
    leaves = make_leaves(Case(T=7, H=2, Dk=24, Dv=16, strict=True, biases="all", B=1), torch.float32)
    q, k, v, u, alibi, self_b, key_b = (leaves[n].detach().contiguous() for n in (
        "q", "k", "v", "u", "alibi_slopes", "self_bias", "key_bias"))
    gen = torch.Generator().manual_seed(3)
    do, dr = (torch.randn(v.shape, generator=gen).to(v) for _ in range(2))
    dlse = torch.randn(q.shape[:3], generator=gen).to(q)
    namespace = torch.ops.energydsl
    fwd, second, bwd = (getattr(namespace, f"{ops.name}_{op}").default for op in ("fwd", "second_fwd", "bwd"))
    biases = (alibi, self_b, key_b)
    o, lse = fwd(q, k, v, 0.25, True, *biases)
    r, _ = second(q, k, v, lse, u, 0.25, True, *biases)  # and the row sums of its weights
    calls = [  # (op, its arguments laid out)
        (fwd, (q, k, v, 0.25, True, *biases)),
        (second, (q, k, v, lse, u, 0.25, True, *biases)),
        (bwd, (do, q, k, v, None, lse, o, dlse, 0.25, True, *biases, True, True, True)),
        (bwd, (dr, q, k, v, u, lse, r, None, 0.25, True, *biases, True, True, True)),
    ]
    for op, args in calls:
        odd = tuple(strided(a) if isinstance(a, torch.Tensor) else a for a in args)
        got, want = op(*odd), op(*args)
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and (b.numel() == 0 or rel_err(a, b) < 1e-6), op
        torch.library.opcheck(op, odd)
        # column views of a wider tensor (as a fused projection's heads): read in place, gradients dense
        torch.library.opcheck(op, tuple(sliced(a) if isinstance(a, torch.Tensor) and a.dim() == 4 else a
                                        for a in args))
    for grad, args in ((do, calls[2][1]), (dr, calls[3][1])):  # the backward given dO in another dtype: cast
        for a, b in zip(bwd(grad.double(), *args[1:]), bwd(*args), strict=True):
            assert a.dtype == b.dtype and (b.numel() == 0 or rel_err(a, b) < 1e-6)


@pytest.mark.parametrize("used", ["o", "lse"])
def test_an_unused_output_gets_no_gradient_of_zeros(used: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loss through o alone passes the backward no dlse (autograd fills no (B, H, T) of zeros, the row term
    reads none); through lse alone, the backward makes the zero dO itself. Both give the reference's gradients."""
    leaves = make_leaves(Case(T=11, H=2, Dk=16, Dv=16, strict=False, biases="key", B=1), torch.float32)
    args = [leaves[n] for n in ("q", "k", "v", "key_bias")]
    seen = []
    real = kernels.GENERIC._bwd_op
    monkeypatch.setattr(kernels.GENERIC, "_bwd_op", lambda *a: seen.append(a[7]) or real(*a))  # a[7]: dlse

    def loss(with_lse: Callable) -> torch.Tensor:
        o, lse = with_lse(*args[:3], scale=0.25, key_bias=args[3])
        return o.sin().sum() if used == "o" else lse.sin().sum()

    got = torch.autograd.grad(loss(kernels.energy_attention_with_lse), args)
    assert len(seen) == 1 and (seen[0] is None) == (used == "o")
    want = torch.autograd.grad(loss(ref.energy_attention_lse_ref), args, allow_unused=True)  # lse has no v
    for g, w, leaf in zip(got, want, args, strict=True):
        assert rel_err(g, torch.zeros_like(leaf) if w is None else w) < TOL


@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
def test_torch_compile_matches_eager(wide: bool) -> None:
    """A small model using both ops compiles without graph breaks and gives the eager values and gradients.

    Under the interpreter the ops are opaque custom_ops and aot_eager exercises their fake functions and
    autograd; on CUDA the triton_ops are traced into inductor. `wide`: the feature-tiled kernels (a third
    grid axis), at widths of two tiles under the interpreter.
    """
    ops = kernels.GENERIC_WIDE if wide else kernels.GENERIC
    dk = 24 if wide else 16
    leaves = make_leaves(Case(T=20, H=2, Dk=dk, Dv=dk, strict=False, biases="key", B=1), torch.float32)
    args = [leaves[n] for n in ("q", "k", "v", "u", "key_bias")]

    def model(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, u: torch.Tensor, kb: torch.Tensor):
        o, lse = ops.energy_attention_with_lse(q, k, v, scale=0.25, key_bias=kb)
        r = ops.weighted_second_moment(q, k, v, lse, u, scale=0.25, key_bias=kb)
        return (o.sin() + r).square().sum()

    compiled = torch.compile(model, fullgraph=True, backend="inductor" if CUDA else "aot_eager")
    loss_c = compiled(*args)
    grads_c = torch.autograd.grad(loss_c, args)
    loss_e = model(*args)
    grads_e = torch.autograd.grad(loss_e, args)
    assert rel_err(loss_c, loss_e) < 1e-4
    for gc, ge in zip(grads_c, grads_e, strict=True):
        assert rel_err(gc, ge) < 1e-4


def test_input_validation() -> None:
    q = torch.zeros(1, 2, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="expected q, k"):
        kernels.energy_attention(q, q, q[:, :, :3], scale=1.0)
    with pytest.raises(ValueError, match="alibi_slopes"):
        kernels.energy_attention(q, q, q, scale=1.0, alibi_slopes=torch.zeros(3, device=DEVICE))
    with pytest.raises(ValueError, match="key_bias"):
        kernels.energy_attention(q, q, q, scale=1.0, key_bias=torch.zeros(1, 2, 5, device=DEVICE))


def test_dispatcher() -> None:
    assert use_triton() and use_triton(DEVICE)


def test_kernels_take_what_use_triton_allows_in_their_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kernels_take` orders its test for speed; it must still mean a kernel dtype on a device `use_triton` allows."""
    from energydsl.kernels import kernels_take

    for flag in ("1", "0"):
        monkeypatch.setenv("TRITON_INTERPRET", flag)
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            t = torch.zeros(1, dtype=dtype, device=DEVICE)
            assert kernels_take(t) == (dtype != torch.float64 and use_triton(t.device)), (flag, dtype)
        assert kernels_take(torch.zeros(1)) == (flag == "1")  # a CPU tensor: only under the interpreter


def test_package_imports_and_falls_back_without_triton() -> None:
    """energydsl.kernels imports, and its dispatching functions use the reference, when triton is absent."""
    code = textwrap.dedent(
        """
        import sys
        sys.modules["triton"] = None  # makes `import triton` fail, as if it were not installed
        import torch
        import energydsl.kernels as K
        assert not K.triton_available() and not K.use_triton()
        q = torch.randn(1, 2, 5, 16)
        o, lse = K.energy_attention_with_lse(q, q, q, scale=0.25, strict=True)
        r = K.weighted_second_moment(q, q, q, lse, q, scale=0.25, strict=True)
        assert o.shape == r.shape == q.shape and torch.isfinite(r).all()
        assert "energydsl.kernels.attention" not in sys.modules
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_calls_on_the_cpu_without_the_interpreter_say_once_that_they_run_the_references() -> None:
    """A generated triton file used on the CPU ran the T x T references without a word (`.module()` says so
    itself, as it falls back to the torch backend before any call)."""
    code = textwrap.dedent(
        """
        import torch
        import energydsl.kernels as K
        q = torch.randn(1, 2, 5, 16)
        for _ in range(2):
            K.energy_attention(q, q, q, scale=0.25)
        K.energy_attention(q.double(), q.double(), q.double(), scale=0.25)  # float64: the references by design
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("energydsl: the inputs are on cpu, not CUDA, and TRITON_INTERPRET is off: the "
                             "fused kernels run as their plain PyTorch references (T x T memory)") == 1
    assert proc.stderr.count("energydsl:") == 1, proc.stderr


# ----------------------------------------------------------------------------------------------------------
# GPU: long sequences, float32 and bfloat16, autotuned tiles
# ----------------------------------------------------------------------------------------------------------

requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


GPU_CASES = [
    Case(T=1024, H=4, Dk=64, Dv=64, strict=False, biases="all"),
    Case(T=1000, H=2, Dk=128, Dv=96, strict=True, biases="all"),
    Case(T=257, H=3, Dk=16, Dv=24, strict=True, biases="key", tied=False),
    Case(T=512, H=2, Dk=64, Dv=64, strict=False, biases="alibi", tied=True),
    # wider than 256: the feature-tiled kernels (CEM's exact diagonal term at d = 768, 12 heads; a tied one)
    Case(T=1000, H=2, Dk=832, Dv=64, strict=False, biases="all"),
    Case(T=300, H=2, Dk=300, Dv=300, strict=True, biases="all", tied=True),
    # heads of one wide q | k | v product, read in place (the generated layers' fused projections)
    Case(T=1000, H=4, Dk=64, Dv=64, strict=False, biases="all", layout="packed"),
    Case(T=700, H=2, Dk=300, Dv=64, strict=True, biases="all", layout="packed"),
]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("kind", ["attention", "with_lse"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"T{c.T}-H{c.H}-d{c.Dk}x{c.Dv}-{c.biases}-{c.layout}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_long_sequences(dtype: torch.dtype, case: Case, kind: str) -> None:
    # bf16: within 3x the error of PyTorch's own bf16 computation (FlashAttention's criterion), or 2e-2
    check(
        case,
        kind,
        dtype,
        tol=TOL if dtype == torch.float32 else 2e-2,
        factor=2.0 if dtype == torch.float32 else 3.0,
    )


@pytest.mark.gpu
@requires_cuda
def test_gpu_eager_calls_launch_without_the_tracing_hop(monkeypatch) -> None:
    """An eager call runs the op's body directly (`launch.runs_body_directly`); its launches must go straight
    to the kernels, as inside the triton_op, not through wrap_triton's tracing HOP (about 1 ms per launch)."""
    from torch._higher_order_ops import triton_kernel_wrap

    def refuse(*args, **kwargs):
        raise AssertionError("an eager launch went through the tracing HOP")

    monkeypatch.setattr(triton_kernel_wrap.tracing_triton_hopifier_singleton, "call_triton_kernel", refuse)
    monkeypatch.setattr(triton_kernel_wrap.tracing_triton_hopifier_singleton, "call_run", refuse)
    q, k, v = (torch.randn(2, 2, 300, 64, device="cuda", requires_grad=True) for _ in range(3))
    o = kernels.energy_attention(q, k, v, scale=0.125)
    o.sum().backward()
    want = ref.energy_attention_ref(q.detach(), k.detach(), v.detach(), scale=0.125)
    assert torch.allclose(o, want, atol=1e-2, rtol=1e-2) and q.grad is not None


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("loop", [False, True], ids=["tiled", "loop"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_wide_backward_in_each_mode(monkeypatch, dtype: torch.dtype, loop: bool) -> None:
    """The autotuner picks the wide backward's mode per shape, so the tests above may never run the other:
    here each mode alone (an op set over only its configs), CEM's 832-wide scores, first and second order."""
    from energydsl.kernels import attention_wide_kernels as W
    from energydsl.kernels import op_set

    fwd, dkdv, dq = kernels.AUTOTUNE_CONFIGS[True]
    only = [[c for c in configs if bool(c.kwargs.get("FEATURE_LOOP")) == loop] for configs in (dkdv, dq)]
    monkeypatch.setitem(kernels.AUTOTUNE_CONFIGS, True, (fwd, *only))
    name = f"test_wide_{'loop' if loop else 'tiled'}_only"
    ops = op_set(name, lambda: kernels.AttentionOps(name, W._fwd_wide_kernel, W._bwd_dkdv_wide_kernel,
                                                    W._bwd_dq_wide_kernel, wide=True))
    impl = {"with_lse": ops.energy_attention_with_lse, "second": ops.weighted_second_moment}
    case = Case(T=700, H=2, Dk=832, Dv=64, strict=False, biases="all")
    for kind in ("with_lse", "second"):
        check(case, kind, dtype, impl=impl, tol=TOL if dtype == torch.float32 else 2e-2,
              factor=2.0 if dtype == torch.float32 else 3.0)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("fused", [False, True], ids=["split", "fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_narrow_backward_in_each_mode(monkeypatch, dtype: torch.dtype, fused: bool) -> None:
    """`_fuse_dq` times the split and fused backwards per shape and keeps one, so the tests above may never
    run the other: here each alone, first and second order, over the narrow GPU cases."""
    monkeypatch.setattr(kernels.AttentionOps, "_fuse_dq", lambda self, key, q, split, run_fused: fused)
    for case in GPU_CASES[:4]:
        for kind in ("with_lse", "second"):
            check(case, kind, dtype, tol=TOL if dtype == torch.float32 else 2e-2,
                  factor=2.0 if dtype == torch.float32 else 3.0)


@pytest.mark.gpu
@requires_cuda
def test_gpu_backward_mode_is_timed_once_per_shape(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The first eager backward of a shape times both modes and records the choice; later ones reuse it, and
    so does a later process, from disk."""
    import triton.testing

    monkeypatch.setenv("ENERGYDSL_TUNING_CACHE", str(tmp_path))
    ops = kernels.GENERIC
    monkeypatch.setattr(ops, "backward_choices", {})
    q = torch.randn(2, 4, 3000, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for _ in range(2):
        ops.energy_attention(q, q, q, scale=0.125).sum().backward()
    (choice,) = ops.backward_choices.values()
    assert choice.split_ms > 0 and choice.fused_ms > 0
    assert choice.fused == (choice.fused_ms < choice.split_ms)
    # a later process (empty memory) reads the choice from disk instead of timing
    monkeypatch.setattr(ops, "backward_choices", {})
    monkeypatch.setattr(triton.testing, "do_bench", lambda *a, **kw: pytest.fail("timed again"))
    ops.energy_attention(q, q, q, scale=0.125).sum().backward()
    assert list(ops.backward_choices.values()) == [choice]


@pytest.mark.gpu
@requires_cuda
def test_gpu_tf32_dots() -> None:
    case = Case(T=1024, H=2, Dk=64, Dv=64, strict=False, biases="all")
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        check(case, "with_lse", torch.float32, tol=1e-2, factor=3.0)
    finally:
        torch.set_float32_matmul_precision(previous)


# ---------------------------------------------------------------------------------------------------------
# Without a GPU: the compiled (non-interpreted) kernels at least compile for sm_90 (ptxas ships with triton)
# ---------------------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
_COMPILE_SCRIPT = f"""
import itertools, sys
sys.path.insert(0, {str(ROOT / "benchmarks")!r})
from kernel_resources import compile_for_sm90
from energydsl.kernels import attention_kernels as N, attention_wide_kernels as W

NARROW, WIDE = dict(BLOCK_DK=128, BLOCK_DV=64), dict(BLOCK_D=64)
# each kernel with its tile flags; the backward modes (fused dQ, the wide FEATURE_LOOP) as kernels of their own
kernels = [(N._fwd_kernel, NARROW), (N._bwd_dkdv_kernel, NARROW), (N._bwd_dq_kernel, NARROW),
           (N._bwd_dkdv_kernel, dict(NARROW, DQ_ATOMIC=True)),
           (W._fwd_wide_kernel, WIDE), (W._bwd_dkdv_wide_kernel, WIDE), (W._bwd_dq_wide_kernel, WIDE),
           (W._bwd_dkdv_wide_kernel, dict(WIDE, FEATURE_LOOP=True)),
           (W._bwd_dq_wide_kernel, dict(WIDE, FEATURE_LOOP=True)),
           (N._bwd_delta_kernel, dict(HAS_DLSE=True, BLOCK_D=128))]  # the backward's row term, shared
for (kernel, tiles), (dt, prec), second, strict in itertools.product(
    kernels, [("bf16", "tf32"), ("fp32", "ieee")], [False, True], [False, True]
):
    flags = dict(STRICT=strict, HAS_ALIBI=True, HAS_SELF=True, HAS_KB=True, SECOND=second, DOT_PREC=prec,
                 NEED_KB=True, NEED_SELF=True, NEED_ALIBI=True, BLOCK_M=64, BLOCK_N=64) | tiles
    compile_for_sm90(kernel, flags, dt, num_warps=4, num_stages=2, dims=("D",))  # D: the row term's width
# the second moment's row term: the dQ kernels' delta pass
for (kernel, tiles), (dt, prec), strict in itertools.product(
    [(N._bwd_dq_kernel, NARROW), (W._bwd_dq_wide_kernel, WIDE)], [("bf16", "tf32"), ("fp32", "ieee")], [False, True]
):
    flags = dict(STRICT=strict, HAS_ALIBI=True, HAS_SELF=True, HAS_KB=True, SECOND=True, DOT_PREC=prec,
                 BLOCK_M=64, BLOCK_N=64, DELTA_PASS=True) | tiles
    compile_for_sm90(kernel, flags, dt, num_warps=4, num_stages=2)
print("compiled")
"""


_FP64_SCALE_SCRIPT = f"""
import sys
sys.path.insert(0, {str(ROOT / "benchmarks")!r})
from kernel_resources import compile_for_sm90
from energydsl.kernels import attention_kernels as N, attention_wide_kernels as W

for kernel, wide in [(N._fwd_kernel, False), (N._bwd_dkdv_kernel, False), (N._bwd_dq_kernel, False),
                     (W._fwd_wide_kernel, True), (W._bwd_dkdv_wide_kernel, True), (W._bwd_dq_wide_kernel, True)]:
    flags = dict(STRICT=False, HAS_ALIBI=True, HAS_SELF=True, HAS_KB=True, SECOND=False, DOT_PREC="tf32",
                 NEED_KB=True, NEED_SELF=True, NEED_ALIBI=True, BLOCK_M=64, BLOCK_N=64)
    flags |= dict(BLOCK_D=64) if wide else dict(BLOCK_DK=64, BLOCK_DV=64)
    ttir = compile_for_sm90(kernel, flags, "bf16", num_warps=4, num_stages=2, scale_type="fp64").asm["ttir"]
    f64 = [ln.strip() for ln in ttir.splitlines() if "f64" in ln and "tt.func" not in ln and "truncf" not in ln]
    assert not f64, (kernel.__name__, f64[:3])
print("compiled")
"""


def test_kernels_take_an_fp64_scale_in_fp32() -> None:
    """Under torch.compile, Inductor launches the kernels with `scale` typed fp64 (a Python float): each
    kernel must truncate it once, not compute its scores in fp64 (or fail to build a dot, as on an H100)."""
    compile_for_gpu(_FP64_SCALE_SCRIPT)


@pytest.mark.slow
def test_kernels_compile_for_gpu() -> None:
    """The narrow and wide templates, every variant's code path, compile for sm_90 on a CPU-only machine
    (layouts, dot shapes, loop-carried types: what the interpreter does not check)."""
    compile_for_gpu(_COMPILE_SCRIPT)
