"""IR expressions to PyTorch source: the printer behind `energy compile --backend torch`.

Each IR node becomes one line `tN = ...` in the generated forward. A value's layout is fixed at
code-generation time: named leading axes (batch `@b`, query position `@i`, then the IR's free
indices in sorted order, a context index standing for the key position) followed by its shape
axes. Values that do not depend on the batch or the position simply lack those axes, so parameters
stay parameters and einsum lines up everything else by axis letter.

Recognised forms are lowered to better primitives than the generic masked T x T reduction:

* a softmax-weighted sum over the causal context, `sum[j](softmax[j](c q.k_j + bias) * v_j)`,
  becomes `softmax_attention` (scaled_dot_product_attention underneath), or the fused Triton kernel
  under the triton backend (`lowering.py`);
* a product-weighted sum `sum[j](gamma_ij (q.k_j) v_j)` with gamma = 1, a decay a^(i-j) or a gate `decay(r)`
  becomes `linear_attention`, chunked, O(T d^2) instead of O(T^2) (`linear_sums.py`, `gates.py`);
* a second-order sum `sum[j](p_ij (u.x_j) y_j)` (covariance preconditioners, Newton with a Taylor
  inverse; centred or l2-score forms are multiplied out first) becomes a weighted second moment from
  the T x T weights, or the fused Triton kernel sharing the attention's log-sum-exp (`second_order.py`);
* any other causal sum of a value without the query position is a prefix sum (cumsum).
"""

from __future__ import annotations

import string
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import sympy as sp

from .. import ir
from ..functions import REGISTRY, X
from ..ir import Expr, IndexInfo
from .norms import affine_norm, emit_norm, norm_factors, norm_form
from .scalar_src import function_src, is_number, sympy_src
from .triton_source import KernelRequest

BATCH, POS = "@b", "@i"
TOKEN_ROLES = ("state", "leaf", "input", "aux")


@dataclass(frozen=True)
class Val:
    """A generated value: its code (a name or a Python expression) and its layout."""

    code: str
    axes: tuple[str, ...] = ()  # named leading axes, canonical order
    rank: int = 0  # trailing shape axes
    scalar: bool = False  # a Python number or 0-d tensor expression


def canonical(axes: set[str] | frozenset[str]) -> tuple[str, ...]:
    head = [a for a in (BATCH, POS) if a in axes]
    return tuple(head + sorted(a for a in axes if a not in (BATCH, POS)))


# ----------------------------------------------------------------------------- layout of an IR expression


def token_axes(e: Expr, indices: dict[str, IndexInfo]) -> frozenset[str]:
    """The named axes a value of `e` has: its free indices plus batch / query position if it depends on them."""
    out: set[str] = set(e.free)
    for node in ir.nodes(e):
        match node:
            case ir.Var(role=role) if role in TOKEN_ROLES:
                out |= {BATCH, POS}
            case ir.Var(role="context"):
                out.add(BATCH)
            case ir.Pos(index=None):
                out.add(POS)
            case ir.Count(index=k) if indices[k].context is not None:
                out.add(POS)
            case ir.Reduce(index=k) | ir.Softmax(index=k) | ir.ProdOthers(index=k) if indices[k].context is not None:
                out.add(POS)
            case ir.Decay():
                out.add(POS)
    return frozenset(out)


def coefficient(e: Expr, var: ir.Var) -> sp.Expr | None:
    """c for e = c * var (or var itself), else None."""
    if e == var:
        return sp.Integer(1)
    if isinstance(e, ir.Mul) and len(e.factors) == 2 and isinstance(e.factors[0], ir.Scalar) \
            and e.factors[1] == var:
        return e.factors[0].value
    return None


def _broadcast_factors(e: ir.Mul) -> list[Expr]:
    """e's factors, a factor `v ⊗ 1` taken as `v` broadcast over the last axis (`v[..., None]`, as the emitter
    aligns a lower-rank factor) where another factor has the product's full shape: CEM DPLR's
    `diag(softplus(P_d)) W_Qᵀ` scales the rows of W_Qᵀ without a tensor of ones and an outer product."""
    def ones_outer(f: Expr) -> bool:
        return isinstance(f, ir.Outer) and isinstance(f.b, ir.Ones)

    if not any(not ones_outer(f) and ir.same_shape(f.shape, e.shape) for f in e.factors):
        return list(e.factors)
    return [f.a if ones_outer(f) else f for f in e.factors]


# ----------------------------------------------------------------------------- the emitter


class Emitter:
    """Prints IR expressions as a list of assignments; hoisted values go to a separate prologue."""

    def __init__(self, indices: dict[str, IndexInfo], scalars: dict[sp.Symbol, str], sizes: dict[str, int],
                 token_names: dict[str, str], lowering: bool = True, backend: str = "torch"):
        self.indices = indices
        self.backend = backend  # "triton": lowered sums call the fused kernels (energydsl.kernels)
        self.scalars = scalars  # symbol -> source (number or tensor name)
        self.sizes = sizes  # index name -> size (range indices)
        self.token_names = token_names  # IR var name -> local variable in forward
        self.lowering = lowering
        self.prologue: list[str] = []  # computed once, before the optimizer's steps
        self.body: list[str] = []
        self.lines = self.body
        self.count = 0
        self.memo: dict[Expr, Val] = {}
        self.prologue_memo: dict[Expr, Val] = {}  # the prologue's values, which no step changes
        self.scalar_names: dict[str, str] = {}  # a computed scalar's source -> its prologue local
        self.lets: dict[str, Val] = {}
        # (B, H, T, D) layouts for attention ops, by (value, heads, position): those of the current step
        # (forgotten with the memo) and those of values the steps do not change (emitted in the prologue)
        self.layouts: dict[tuple, str] = {}
        self.invariant_layouts: dict[tuple, str] = {}
        self.context_names = {name for var, name in token_names.items() if var.startswith("ctx:")}
        self.log_rate_prefixes: dict[ir.Decay, Val] = {}  # G of each decay(r), in the prologue (`gates.py`)
        self.used_ops: set[str] = set()
        self.kernel_requests: list[KernelRequest] = []  # triton: kernels to write into the generated file
        self.misses: list[str] = []  # triton: why a form that nearly took a kernel did not (`energy compile` says)
        # triton, nag: (state, velocity), whose look-ahead state + c * velocity is the fused Nesterov op
        self.lookahead: tuple[ir.Var, ir.Var] | None = None
        self.letters = self._letters()
        self.user_names: dict[Expr, str] = {}  # the spec's names of values (`EnergyIR.user_names`)
        self.named: dict[str, set[str]] = {}  # user name -> the locals its value was printed as
        self.flops = {"prologue": 0.0, "body": 0.0}  # matmul FLOPs per token (context at full length)
        # a step body line -> the FLOPs of the op whose value it writes: what moves with it when hoisted
        self.line_flops: dict[str, float] = {}
        self._pending = 0.0  # FLOPs the value being emitted counted so far, in the step body
        self.context_len = 1  # T for FLOP counts (the model's context)

    # -- bookkeeping

    def kernel_set(self, request: KernelRequest) -> str:
        """The name of the op set over `request`'s specialised kernels, written into the file with the class."""
        if request not in self.kernel_requests:
            self.kernel_requests.append(request)
        return request.name

    def _letters(self) -> dict[str, str]:
        """Einsum letters for named axes (lower case); shape axes use upper case."""
        out = {BATCH: "b", POS: "t"}
        free = [c for c in string.ascii_lowercase if c not in "bt"]
        for name in sorted(self.indices):
            letter = name if len(name) == 1 and name in free else free[0]
            free.remove(letter)
            out[name] = letter
        return out

    def tmp(self, code: str, axes: tuple[str, ...], rank: int, comment: str = "") -> Val:
        name = f"t{self.count}"
        self.count += 1
        self.lines.append(f"{name} = {code}" + (f"  # {comment}" if comment else ""))
        return Val(name, axes, rank)

    def scalar(self, value: sp.Expr) -> str:
        """A scalar's source: a number or a learned scalar's name inline; a computed one (`-1.0 * opt_eta`) a
        prologue line of its own, computed once before the optimizer's steps rather than at every use (each is
        a tensor op, forward and backward)."""
        code = sympy_src(value, self.scalars)
        if code.isidentifier() or is_number(code):
            return code
        if code not in self.scalar_names:
            saved, self.lines = self.lines, self.prologue
            self.scalar_names[code] = self.tmp(code, (), 0).code
            self.lines = saved
        return self.scalar_names[code]

    @contextmanager
    def in_prologue(self) -> Iterator[None]:
        """Emit into the prologue, with its memo: values that the optimizer's steps do not change."""
        saved = self.lines, self.memo
        self.lines, self.memo = self.prologue, self.prologue_memo
        try:
            yield
        finally:
            self.lines, self.memo = saved

    def forget(self) -> None:
        """Drop memoised values (after the state changes); hoisted values stay."""
        self.memo = {}
        self.layouts = dict(self.invariant_layouts)

    def shape_size(self, s: sp.Expr) -> int:
        return int(round(float(sympy_src(s, self.scalars))))

    def size(self, index: str) -> str:
        info = self.indices[index]
        return "T" if info.context is not None else str(self.sizes[index])

    # -- layout helpers

    def align(self, v: Val, axes: tuple[str, ...], rank: int) -> str:
        """Code for `v` broadcast against the layout (axes, rank): insert singleton axes where it lacks one."""
        if v.scalar:
            return v.code
        assert set(v.axes) <= set(axes), (v.axes, axes)
        idx = [":" if a in v.axes else "None" for a in axes] + [":"] * v.rank + ["None"] * (rank - v.rank)
        while idx and idx[-1] == ":":
            idx.pop()
        return f"{v.code}[{', '.join(idx)}]" if idx else v.code

    def expand(self, v: Val, axes: tuple[str, ...]) -> Val:
        """`v` with every axis in `axes` present (a broadcast view), shape axes unchanged."""
        if v.axes == axes:
            return v
        code = self.align(v, axes, v.rank)
        sizes = [self._axis_size(a) if a not in v.axes else "-1" for a in axes] + ["-1"] * v.rank
        return self.tmp(f"{code}.expand({', '.join(sizes)})", axes, v.rank)

    def _axis_size(self, a: str) -> str:
        if a == BATCH:
            return "B"
        if a == POS:
            return "T"
        return self.size(a)

    def count_flops(self, flops: float, axes: set[str] | None = None) -> None:
        """Add an op's FLOPs per token; one over weights alone (`axes` without a batch, position or context
        axis: DPLR's P_V^T V^T) runs once per call, whatever the number of tokens, and is left out."""
        if axes is not None and not any(a in (BATCH, POS) or a not in self.indices or self.indices[a].context
                                        is not None for a in axes):
            return
        self.flops["prologue" if self.lines is self.prologue else "body"] += flops
        if self.lines is self.body:
            self._pending += flops

    def _axes_flops(self, axes: set[str]) -> float:
        """How many times per token an op over these axes runs: a context index counts the context length
        only next to the query position (pairs i, j); alone it is the token axis of a per-token value."""
        n = 1.0
        for a in axes - {BATCH, POS}:
            if self.indices[a].context is None:
                n *= self.sizes[a]
            elif POS in axes:
                n *= self.context_len
        return n

    def einsum(self, operands: list[tuple[Val, str]], out_axes: tuple[str, ...], out_shape: str,
               comment: str = "", shape_sizes: dict[str, int] | None = None) -> Val:
        """einsum over named axes (letters fixed per axis) and shape letters given per operand."""
        if shape_sizes is not None:  # 2 x the product of every distinct axis size, per token
            named = set().union(*(v.axes for v, _ in operands))
            n = self._axes_flops(named)
            for size in shape_sizes.values():
                n *= size
            self.count_flops(2 * n, named)
        specs, codes = [], []
        for v, shape_letters in operands:
            specs.append("".join(self.letters[a] for a in v.axes) + shape_letters)
            codes.append(v.code)
        out = "".join(self.letters[a] for a in out_axes) + out_shape
        return self.tmp(f"torch.einsum('{','.join(specs)}->{out}', {', '.join(codes)})", out_axes,
                        len(out_shape), comment)

    # -- the visitor

    def emit(self, e: Expr) -> Val:
        if isinstance(e, ir.Let):
            return self.emit_let(e)
        hit = self.memo.get(e)
        if hit is not None:
            return hit
        saved, self._pending = self._pending, 0.0
        try:
            out = self._emit(e)
        finally:
            counted, self._pending = self._pending, saved
        if counted and self.body:  # the op's own FLOPs go with the last line it wrote, the one reading the rest
            self.line_flops[self.body[-1]] = self.line_flops.get(self.body[-1], 0.0) + counted
        self.memo[e] = out
        if e in self.user_names and not out.scalar:
            self.named.setdefault(self.user_names[e], set()).add(out.code)
        return out

    def emit_let(self, e: ir.Let) -> Val:
        """A hoisted value: printed once into the prologue, with its name."""
        if e.name in self.lets:
            return self.lets[e.name]
        saved, saved_memo = self.lines, self.memo
        self.lines, self.memo = self.prologue, self.prologue_memo  # shared by every let: computed once
        v = self.emit(e.body)
        temp = v.code
        if not v.scalar:
            last = self.lines[-1] if self.lines else ""
            named = Val(e.name, v.axes, v.rank)
            named_before = any(w.code == v.code for w in self.lets.values())  # another let's name: keep it
            if last.startswith(f"{v.code} = ") and not named_before:  # name the value itself, not a copy
                self.lines[-1] = f"{e.name} = " + last[len(v.code) + 3:]
                self.memo.update({k: named for k, hit in self.memo.items()  # (the memo holds the lowering's
                                  if isinstance(hit, Val) and hit.code == v.code})  # step cache too, a dict)
            else:
                self.lines.append(f"{e.name} = {v.code}")
            v = named
        self.lines, self.memo = saved, saved_memo
        self.lets[e.name] = v
        if e.body in self.user_names and not v.scalar:  # the value now goes by the let's name, not the temp's
            codes = self.named.setdefault(self.user_names[e.body], set())
            codes.discard(temp)
            codes.add(v.code)
        return v

    def _emit(self, e: Expr) -> Val:
        match e:
            case ir.Scalar():
                return Val(self.scalar(e.value), scalar=True)
            case ir.Var(role="param"):
                return Val(self.token_names.get(e.name, e.name), (), len(e.shape))
            case ir.Var(role="context"):
                return Val(self.token_names[f"ctx:{e.name}"], (BATCH, e.index), len(e.shape))
            case ir.Var():
                return Val(self.token_names[e.name], (BATCH, POS), len(e.shape))
            case ir.Index():
                base = self.emit(e.base)
                axes = canonical(set(base.axes) | {e.index})
                src, dst = len(base.axes), axes.index(e.index)
                code = base.code if src == dst else f"{base.code}.movedim({src}, {dst})"
                if code == base.code:
                    return Val(code, axes, base.rank - 1)
                return self.tmp(code, axes, base.rank - 1)
            case ir.Pos(index=None):
                return Val("pos", (POS,), 0)
            case ir.Pos(index=k) if self.indices[k].context is not None:
                # j past the mask reads as the last kept position (i, or i - 1 when strict), as the interpreter's:
                # a term of (i - j) is then finite on masked pairs wherever it is on kept ones, and a masked
                # pair's 0 weight times its derivative is 0, where 1/(i - j) at j = i made it 0 * inf = NaN
                last = "pos[:, None] - 1.0" if self.indices[k].strict else "pos[:, None]"
                return self.tmp(f"torch.minimum(pos[None, :], {last})", (POS, k), 0,
                                "context positions, masked ones at the last kept")
            case ir.Pos(index=k):
                return Val("pos", (k,), 0)
            case ir.Ones():
                return self.tmp(f"torch.ones({self._shape(e.shape)}, dtype=dt, device=dev)", (), len(e.shape))
            case ir.Identity():
                return self.tmp(f"torch.eye({self._dim(e.size)}, dtype=dt, device=dev)", (), 2)
            case ir.Count(index=k):
                info = self.indices[k]
                if info.context is None:
                    return Val(repr(float(self.sizes[k])), scalar=True)
                if info.strict:  # count is 0 at the first token
                    return Val("count_strict.clamp(min=1)" if e.at_least_one else "count_strict", (POS,), 0)
                return Val("count", (POS,), 0)
            case ir.Add() | ir.Mul():
                return self._elementwise(e)
            case ir.Pow():
                b = self.emit(e.base)
                ex = sympy_src(e.exponent, self.scalars)
                if b.scalar:
                    return Val(f"({b.code} ** {ex})", scalar=True)
                return self.tmp(f"{b.code} ** {ex}", b.axes, b.rank)
            case ir.MatMul() | ir.Dot() | ir.Outer():
                return self._contract(e, drop=frozenset())
            case ir.Transpose():
                a = self.emit(e.a)
                return self.tmp(f"{a.code}.transpose(-1, -2)", a.axes, a.rank)
            case ir.Func(name="log") if isinstance(ir.bare(e.arg), ir.Decay):
                from .gates import gate_log_weights

                return gate_log_weights(self, ir.bare(e.arg))
            case ir.Func():
                a = self.emit(e.arg)
                if a.scalar:  # of a number: folded here, in float64 (torch.as_tensor of it was float32)
                    arg = a.code if is_number(a.code) else f"torch.as_tensor({a.code})"
                    return Val(sympy_src(REGISTRY[e.name].formula.subs(X, sp.Symbol("_a")), {sp.Symbol("_a"): arg}),
                               scalar=True)
                return self.tmp(function_src(e.name, a.code), a.axes, a.rank, e.name)
            case ir.SumAll():
                a = self.emit(e.a)
                dims = ", ".join(str(-n - 1) for n in range(a.rank))
                return self.tmp(f"{a.code}.sum(dim=({dims},))", a.axes, 0)
            case ir.StopGrad():  # zero derivative for the derivation only: training gradients still flow
                return self.emit(e.a)
            case ir.Diag():
                a = self.emit(e.a)
                return self.tmp(f"torch.diag_embed({a.code})", a.axes, a.rank + 1)
            case ir.Inverse():
                a = self.emit(e.a)
                self.used_ops.add("inverse")
                return self.tmp(f"inverse({a.code})", a.axes, a.rank)
            case ir.Reduce() | ir.Softmax() | ir.ProdOthers():
                return self._reduce(e)
            case ir.Rope():  # the position along the query's axis or the context token's, never both
                a = self.emit(e.a)
                axis = POS if e.pos.index is None else e.pos.index
                a = self.expand(a, canonical(set(a.axes) | {axis}))
                self.used_ops.add("rope")
                return self.tmp(f"rope({a.code}, dim={a.axes.index(axis)}, base={float(e.base)!r}, sign={e.sign})",
                                a.axes, a.rank,
                                f"rotary position embedding by {'-' if e.sign < 0 else ''}{axis.lstrip('@')}")
            case ir.Decay():
                from .gates import gate_weights

                return gate_weights(self, e)
        raise NotImplementedError(f"no torch code for {type(e).__name__}")

    def _dim(self, s: sp.Expr) -> str:
        return sympy_src(s, self.scalars).replace(".0", "") if not sp.sympify(s).is_Number else str(int(s))

    def _shape(self, shape: tuple) -> str:
        return "(" + ", ".join(self._dim(s) for s in shape) + ",)"

    def _elementwise(self, e: ir.Add | ir.Mul) -> Val:
        if isinstance(e, ir.Add):  # a term whose coefficient is 0 at these hyper-parameters adds nothing
            kept = [t for t in e.terms if not self._zero_coefficient(t)]
            if kept and len(kept) < len(e.terms):
                return self.emit(kept[0]) if len(kept) == 1 else self._elementwise(ir.Add(tuple(kept)))
        if isinstance(e, ir.Add) and (affine := affine_norm(e)) is not None:
            norm, taken, rest = affine
            if not rest:
                return emit_norm(self, norm)
            e = ir.Add((ir.Add(taken), *rest))  # the norm one term of e
        if isinstance(e, ir.Mul):
            if (norm := norm_form(e)) is not None:
                return emit_norm(self, norm)
            if (split := norm_factors(e)) is not None:
                e = ir.Mul((split[0], *split[1]))  # the norm one factor, the same value as the norm alone
        if self.backend == "triton":
            if isinstance(e, ir.Mul):
                from .gated_epilogue import fused_gate  # value * G(pre): generated gated kernels

                fused = fused_gate(self, e)
            else:
                fused = self._nesterov_lookahead(e)
            if fused is not None:
                return fused
        if isinstance(e, ir.Add) and (difference := self._difference(e)) is not None:
            return difference
        parts = e.terms if isinstance(e, ir.Add) else _broadcast_factors(e)
        op = " + " if isinstance(e, ir.Add) else " * "
        vals = [self.emit(p) for p in parts]
        unit = "0.0" if isinstance(e, ir.Add) else "1.0"
        vals = [v for v in vals if v.code != unit] or vals[:1]
        if len(vals) == 1:
            return vals[0]
        if all(v.scalar for v in vals):
            return Val("(" + op.join(v.code for v in vals) + ")", scalar=True)
        axes = canonical(set().union(*(v.axes for v in vals)))
        rank = len(e.shape)
        code = op.join(self.align(v, axes, rank) for v in vals)
        return self.tmp(code, axes, rank)

    def _zero_coefficient(self, t: Expr) -> bool:
        """Whether `t` is c · (...) with c a number that is 0 at this module's fixed values: Newton's truncated
        series at eta = 1/2 has (1 - 2 eta) terms, which SymPy keeps (eta is a symbol) and the code multiplied
        by 0.0 at every step."""
        def zero(f: Expr) -> bool:
            if not isinstance(f, ir.Scalar) or f.value.is_number:  # a number: SymPy has dropped a zero already
                return False
            try:
                return sympy_src(f.value, self.scalars) in ("0.0", "-0.0")
            except KeyError:  # a symbol with no value here: not a number
                return False

        return isinstance(t, ir.Mul) and any(zero(f) for f in t.factors)

    def _difference(self, e: ir.Add) -> Val | None:
        """`a + (-1) b` as `a - b`, as SymPy's printers write it: the negation `-1.0 * b` was an element-wise op
        of its own, forward and backward. None when no term is negated (or one already computed is at hand),
        or every term is."""
        def negated(t: Expr) -> bool:
            return (isinstance(t, ir.Mul) and isinstance(t.factors[0], ir.Scalar) and t.factors[0].value == -1
                    and t not in self.memo)

        minus = [t for t in e.terms if negated(t)]
        plus = [t for t in e.terms if not negated(t)]
        if not minus or not plus:
            return None
        vals = [self.emit(t) for t in plus] + [self.emit(ir.mul(*t.factors[1:])) for t in minus]
        if all(v.scalar for v in vals):
            return None
        axes = canonical(set().union(*(v.axes for v in vals)))
        code = [self.align(v, axes, len(e.shape)) for v in vals]
        return self.tmp(" + ".join(code[:len(plus)]) + "".join(f" - {c}" for c in code[len(plus):]), axes,
                        len(e.shape))

    def _nesterov_lookahead(self, e: ir.Add) -> Val | None:
        """state + c * velocity (nag's look-ahead point, c a scalar such as -beta) with both full token
        tensors: one fused pass instead of a scale and an add, its kernels written into the generated file.
        Memoised like any value, so it runs once per step however often the force reads it."""
        if self.lookahead is None or len(e.terms) != 2:
            return None
        state, velocity = self.lookahead
        for x, cm in (e.terms, e.terms[::-1]):
            c = coefficient(cm, velocity)
            if x != state or c is None:
                continue
            xv, mv = self.emit(x), self.emit(velocity)
            if xv.axes == mv.axes == (BATCH, POS) and xv.rank == mv.rank:
                ops = self.kernel_set(KernelRequest.nesterov())  # kernels written into the file
                cv = self.scalar(c)
                return self.tmp(f"{ops}.nesterov_lookahead({xv.code}, {mv.code}, {cv})", xv.axes, xv.rank,
                                f"{xv.code} + {cv} * {mv.code}, fused")
        return None

    # -- contractions

    def _contract(self, e: ir.MatMul | ir.Dot | ir.Outer, drop: frozenset[str]) -> Val:
        """MatMul / Dot / Outer as one einsum; indices in `drop` are summed over in the same call."""
        a, b = self.emit(e.a), self.emit(e.b)
        if a.scalar or b.scalar:  # a product with a number
            s, t = (a, b) if a.scalar else (b, a)
            return self.tmp(f"{s.code} * {t.code}", t.axes, t.rank)
        ra, rb = len(e.a.shape), len(e.b.shape)
        if isinstance(e, ir.MatMul):
            if ra == 2 and rb == 1:
                sa, sb, so = "MN", "N", "M"
            elif ra == 1 and rb == 2:
                sa, sb, so = "N", "NP", "P"
            else:
                sa, sb, so = "MN", "NP", "MP"
        elif isinstance(e, ir.Dot):
            sa = sb = "MNPQ"[:ra]
            so = ""
        else:
            sa, sb, so = "M", "N", "MN"
        axes = canonical((set(a.axes) | set(b.axes)) - drop)
        sizes = dict(zip(sa, map(self.shape_size, e.a.shape), strict=True))
        sizes.update(zip(sb, map(self.shape_size, e.b.shape), strict=True))
        if isinstance(e, ir.MatMul) and (sa, sb) == ("MN", "N"):
            out = self._linear(a, b, axes, drop)
            if out is not None:
                n = self._axes_flops(set(a.axes) | set(b.axes)) * sizes["M"] * sizes["N"]
                self.count_flops(2 * n, set(a.axes) | set(b.axes))
                return out
        return self.einsum([(a, sa), (b, sb)], axes, so, shape_sizes=sizes)

    def _linear(self, w: Val, v: Val, axes: tuple[str, ...], drop: frozenset[str]) -> Val | None:
        """A weight (per head or not) times token vectors as one F.linear (one GEMM), when the layouts allow."""
        if set(w.axes) & {BATCH, POS} or any(self.indices[a].context is not None for a in w.axes):
            return None
        if not drop and not set(w.axes) & set(v.axes) and axes == v.axes + w.axes:
            if not w.axes:
                return self.tmp(f"F.linear({v.code}, {w.code})", axes, 1)
            heads = ", ".join(self.size(h) for h in w.axes)
            flat = f"{w.code}.reshape(-1, {w.code}.shape[-1])"
            return self.tmp(f"F.linear({v.code}, {flat}).unflatten(-1, ({heads}, -1))", axes, 1)
        if len(w.axes) == 1 and drop == set(w.axes) and v.axes and v.axes[-1] == w.axes[0] and axes == v.axes[:-1]:
            # the weight's own line: a steps loop computes it once (`hoist.py`)
            weight = self.tmp(f"{w.code}.movedim(0, 1).flatten(1)", (), 2, f"the {w.axes[0]} weights side by side")
            return self.tmp(f"F.linear({v.code}.flatten(-2), {weight.code})", axes, 1,
                            f"sum over {w.axes[0]} in one matmul")
        return None

    # -- reductions

    def _reduce(self, e: ir.Reduce | ir.Softmax | ir.ProdOthers) -> Val:
        info = self.indices[e.index]
        if info.context is not None:
            return self._context_reduce(e, info)
        if isinstance(e, ir.Reduce) and e.op == "sum" and isinstance(e.body, (ir.MatMul, ir.Dot, ir.Outer)) \
                and e.index in token_axes(e.body, self.indices):
            return self._contract(e.body, drop=frozenset([e.index]))
        body = self.emit(e.body)
        size = self.sizes[e.index]
        if e.index not in body.axes:  # the body does not vary with the index
            if isinstance(e, ir.Softmax):
                return self.tmp(f"torch.full_like({body.code}, {1 / size!r})", body.axes, body.rank)
            if isinstance(e, ir.ProdOthers):
                code = f"{body.code} ** {size - 1}"
                return Val(f"({code})", scalar=True) if body.scalar else self.tmp(code, body.axes, body.rank)
            code = {"sum": f"{size} * {body.code}", "mean": body.code, "max": body.code,
                    "logsumexp": f"{body.code} + {float(sp.log(size))!r}", "prod": f"{body.code} ** {size}"}[e.op]
            return Val(f"({code})", scalar=True) if body.scalar else self.tmp(code, body.axes, body.rank)
        axis = body.axes.index(e.index)
        rest = tuple(a for a in body.axes if a != e.index)
        if isinstance(e, ir.Softmax):
            return self.tmp(f"torch.softmax({body.code}, dim={axis})", body.axes, body.rank)
        if isinstance(e, ir.ProdOthers):
            self.used_ops.add("prod_of_others")
            return self.tmp(f"prod_of_others({body.code}, dim={axis})", body.axes, body.rank)
        code = {"sum": f"{body.code}.sum({axis})", "mean": f"{body.code}.mean({axis})",
                "logsumexp": f"torch.logsumexp({body.code}, dim={axis})", "prod": f"{body.code}.prod({axis})",
                "max": f"{body.code}.amax({axis})"}[e.op]
        return self.tmp(code, rest, body.rank)

    def _context_reduce(self, e: ir.Reduce | ir.Softmax | ir.ProdOthers, info: IndexInfo) -> Val:
        if self.lowering and isinstance(e, ir.Reduce) and e.op == "sum":
            from .lowering import lower_context_sum
            from .outer_sums import query_factored_sum
            from .weighted_sums import weighted_context_sum

            out = lower_context_sum(self, e, info) or weighted_context_sum(self, e, info.strict)
            if out is not None:
                return out
            factored = query_factored_sum(e, self.side(e.index))
            if factored is not None:  # the delta rule's Σ_j (Zᵀ k_j − v_j) k_jᵀ: prefix sums, not T x T pairs
                return self.emit(factored)
        body = self.emit(e.body)
        j = e.index
        strict = info.strict
        if j not in body.axes:  # a value constant over the context: reduce = count it in
            n = "count_strict" if strict else "count"
            axes = canonical(set(body.axes) | {POS})
            bcode = self.align(body, axes, body.rank)
            ccode = self.align(Val(n, (POS,), 0), axes, body.rank)
            if isinstance(e, ir.Softmax | ir.ProdOthers):
                raise NotImplementedError(f"{type(e).__name__.lower()} of a value that does not vary over the context")
            code = {"sum": f"{bcode} * {ccode}", "mean": f"{bcode} * ({ccode} > 0)", "max": f"{bcode} * ({ccode} > 0)",
                    "logsumexp": f"({bcode} + torch.log({ccode}.clamp(min=1))) * ({ccode} > 0)",
                    "prod": f"{bcode} ** {ccode}"}[e.op]  # an empty context: 0 (prod: 1), as `masked_reduce`
            return self.tmp(code, axes, body.rank)
        if POS not in body.axes and isinstance(e, ir.Reduce) and e.op in ("sum", "mean", "logsumexp"):
            return self._prefix(e, body, strict)
        axes = canonical(set(body.axes) | {POS})
        full = self.expand(body, axes) if POS not in body.axes else body
        mask = self.align(Val("mask_strict" if strict else "mask", (POS, j), 0), axes, body.rank)
        axis = axes.index(j)
        rest = tuple(a for a in axes if a != j)
        if isinstance(e, ir.Softmax):
            self.used_ops.add("masked_softmax")
            return self.tmp(f"masked_softmax({full.code}, {mask}, dim={axis})", axes, body.rank)
        if isinstance(e, ir.ProdOthers):
            self.used_ops.add("prod_of_others")
            return self.tmp(f"prod_of_others({full.code}, dim={axis}, mask={mask})", axes, body.rank)
        if e.op == "sum" and isinstance(e.body, ir.Mul) and not body.scalar:  # Σ_j a_ij b_j: a contraction
            n = self._axes_flops(set(axes))
            for size in e.body.shape:
                n *= self.shape_size(size)
            self.count_flops(2 * n, set(axes))
        self.used_ops.add("masked_reduce")
        return self.tmp(f"masked_reduce({full.code}, {mask}, dim={axis}, op={e.op!r})", rest, body.rank,
                        f"{e.op} over the causal context")

    def side(self, j: str) -> Callable[[Expr], str | None]:
        """Which token a value depends on: "query" (not j), "key" (j, not the query's position) or None (both)."""
        def side(t: Expr) -> str | None:
            axes = token_axes(t, self.indices)
            return "query" if j not in axes else "key" if POS not in axes else None

        return side

    def _prefix(self, e: ir.Reduce, body: Val, strict: bool) -> Val:
        """Σ_{j ≤ i} v_j of a value without the query position: a prefix sum along j, which becomes i."""
        axis = body.axes.index(e.index)
        axes = tuple(POS if a == e.index else a for a in body.axes)
        out_axes = canonical(set(axes))
        self.used_ops.add("prefix_reduce")
        code = f"prefix_reduce({body.code}, dim={axis}, op={e.op!r}, strict={strict})"
        if axes != out_axes:
            code += f".movedim({axis}, {out_axes.index(POS)})"
        return self.tmp(code, out_axes, body.rank, f"{e.op} over {e.index} {'<' if strict else '<='} i as a prefix")
