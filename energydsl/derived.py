"""A derived energy: its IR and update program, printed and checked; and `derive`, which builds one per
declaration and dims, shared in this process.

    layer = energydsl.load("examples/intrinsic-optimizers/mha.energy").energy("MHA", d=16)   # a Derived
    print(layer.equations("latex"))
"""

from __future__ import annotations

import dataclasses
import hashlib
import html
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import ir, syntax
from .calculus import substitute_var
from .checks import CheckResult, run_checks
from .errors import Span, SpecError, UserError
from .ir import Expr, Var
from .number_text import is_count, number_shown, plain_number
from .optimizers import Assign, UpdateProgram, build_program, unhoist
from .printing import NAME, STYLES, fold, mathml_block, name_repeats, show, shown_function, tex_greek
from .semantics import EnergyIR, lower_energy
from .sizing import allocation_named


@dataclass
class Derived:
    """One energy with its derivation: the IR, the update program, and how to print and check them."""

    spec: EnergyIR
    program: UpdateProgram
    _checks: list[CheckResult] | None = field(default=None, repr=False, compare=False)
    # results that depend on the derivation only, kept because `derive` shares one Derived between users
    _hash: str | None = field(default=None, repr=False, compare=False)
    _formatted: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    _rows: list[tuple[str, object, object]] | None = field(default=None, repr=False, compare=False)
    _flops: dict[int, float] = field(default_factory=dict, repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.spec.name

    def __repr__(self) -> str:  # the dataclass's own printed the whole IR: 15,000 characters for MHA
        dims = ", ".join(f"{k}={plain_number(v)}" for k, v in self.spec.dim_values.items())
        return f"<Derived {self.name}({dims}), {self.program.steps} × {self.spec.optimizer.kind}, " \
               f"equations {self.equation_hash()}>"

    def relations(self) -> dict[str, str]:
        ctx = self.spec.context
        if ctx is None:
            return {}
        return {ctx.index: "<i" if self.spec.indices[ctx.index].strict else "<=i"}

    def equation_list(self) -> list[tuple[str, object, object]]:
        """(label, left-hand side, expression) for energy, gradient, update, untied form, where and hoisted
        values: the same for every format, so built once."""
        if self._rows is None:
            self._rows = self._equation_rows()
        return self._rows

    def _equation_rows(self) -> list[tuple[str, object, object]]:
        spec, prog = self.spec, self.program
        point = prog.point.name
        out: list[tuple[str, str, object]] = [("energy", f"{spec.energy_name}", spec.energy)]
        named: list[tuple[object, object]] = []  # right-hand sides later rows show by their names

        def folded(e: object) -> object:
            for body, name in named:
                e = fold(e, body, name)
            return e

        if spec.via is not None:
            out.append(("norm", spec.via[0].name, spec.via[1]))
            named.append((spec.via[1], spec.via[0]))
        gradient = f"∇_{point} {spec.energy_name}"
        out.append(("gradient", gradient, folded(prog.gradient)))  # the norm as `u`, as the direction has it
        named.append((out[-1][2], gradient))
        # the labels P and D, unless the spec has a name of its own such (a param `D`): then Π and Δ
        taken = {x.name for x in ir.nodes(spec.energy) if isinstance(x, Var)} | {str(n) for n in spec.dims()} \
            | set(prog.params) | {v.name for v in (spec.state, spec.context, spec.input) if v is not None} \
            | {spec.energy_name}  # `global D = ...`: `D = ∇_z D` read as a definition of itself
        label = {k: next(c for c in candidates if c not in taken) for k, candidates in
                 (("P", ("P", "Π", "P_precondition")), ("D", ("D", "Δ", "D_direction")))}
        if prog.preconditioner is not None:
            out.append(("preconditioner", label["P"], prog.preconditioner))
        direction = folded(unhoist(prog.tied_direction if spec.untie_rules else prog.direction))
        out.append(("direction", label["D"], direction))
        if spec.optimizer.kind == "nag":  # its step takes D at the look-ahead point: `m⁺ = β m + D(z − β m)`
            named.append(_look_ahead(spec, prog, label["D"]))
        named.append((direction, label["D"]))
        out += [("update", *row) for row in _updates(prog.tied_assigns, folded)]
        if spec.untie_rules:
            out += [("untied update", *row) for row in _updates(prog.assigns, folded)]
        out += self._where(out)
        for h in prog.hoisted:
            out.append(("computed once", h.name, h.body))
        return out

    def _where(self, rows: list[tuple[str, str, object]]) -> list[tuple[str, object, object]]:
        """Rows after the energy written with names for what they repeat, and the names' definitions
        (`where p_k,j = softmax_j(...)`), in place: for reading only."""
        exprs = [e for _, _, e in rows[1:]]
        taken = {x.name for e in [self.spec.energy, *exprs] for x in ir.nodes(e) if isinstance(x, Var)}
        taken |= {str(name) for name in [*self.spec.dims(), *self.program.hyper_values, *self.program.params]}
        taken.add(self.spec.energy_name)  # `global t = ...`: `where t = ...` would redefine the energy
        context = {i for i, info in self.spec.indices.items() if info.context is not None}
        exprs, lets = name_repeats(exprs, sorted(self.spec.indices, key=lambda i: i in context), context, taken)
        rows[1:] = [(label, lhs, e) for (label, lhs, _), e in zip(rows[1:], exprs)]
        return [("where", name, body) for name, body in lets]

    def tying(self) -> list[str]:
        """Parameters the derived update uses both in its scores and on its value path."""
        from .calculus import untie as untie_fn
        from .ir import Index, Transpose, nodes

        on_path: dict[str, set[str]] = {}  # a param's name: its forms on the value path (`W1_k`, `W1_kᵀ`)
        marker = []
        direction = self.program.tied_direction or self.program.direction
        for node in nodes(unhoist(direction)):
            if isinstance(node, (Index, Var, Transpose)):
                marker.append(node)
        params = {n for n in self.program.params}
        for cand in set(marker):
            base = cand
            while isinstance(base, (Index, Transpose)):
                base = base.a if isinstance(base, Transpose) else base.base
            if isinstance(base, Var) and base.name in params:
                _, hits = untie_fn(unhoist(direction), [(cand, Var("__probe", "param", cand.shape))])
                if hits[0]:  # replacements made: a list of one count, truthy even at [0]
                    on_path.setdefault(base.name, set()).add(show(cand))
        inside: dict[str, str] = {}  # a param's name: where it shapes the weights (scores first, else a function)
        from .ir import Func, Mul, Softmax

        for node in nodes(unhoist(direction)):
            if isinstance(node, Mul) and any(f.shape != () for f in node.factors):
                # a scalar weight of a tensor (linear attention's ⟨W1_k z, W2_k h_j⟩ W2_k h_j) is a score
                shaping = [(f, "the scores") for f in node.factors if f.shape == ()]
            elif isinstance(node, (Softmax, Func)):
                shaping = [(node, "the scores" if isinstance(node, Softmax) else f"{shown_function(node.name)}(…)")]
            else:
                continue
            for part, where in shaping:
                for inner in nodes(part):
                    if isinstance(inner, Var) and inner.name in params and inside.get(inner.name) != "the scores":
                        inside[inner.name] = where
        return [f"{name} is used in {inside[name]} and, as {' / '.join(sorted(forms))}, on the value path "
                "(the energy ties them; `untie` frees the value path)"
                for name, forms in sorted(on_path.items()) if name in inside]

    def equations(self, fmt: str = "text") -> str:
        """What `energy derive` prints, in `fmt`: text, latex, markdown or mathml (computed once per format)."""
        if fmt not in ("text", "latex", "markdown", "mathml"):
            raise SpecError(f"unknown format `{fmt}`", None, "use text, latex, markdown or mathml")
        if fmt not in self._formatted:
            self._formatted[fmt] = self._equations(fmt)
        return self._formatted[fmt]

    def _equations(self, fmt: str) -> str:
        rel = self.relations()
        rows = self.equation_list()
        header = self._header()
        tying = self.tying()
        if fmt == "text":
            lines = [header]
            for label, lhs, e in rows:
                lines.append(f"{label:>16}  {_lhs(lhs, 'text')} = {show(e, 'text', rel)}")
            for t in tying:
                lines.append(f"{'tying':>16}  {t}")
            lines.append(f"{'steps':>16}  {self._steps()}")
            return "\n".join(lines)
        if fmt == "mathml":
            parts = [f"<p>{html.escape(header)}</p>"]
            for label, lhs, e in rows:
                parts.append(f"<p>{html.escape(label)}</p>" + mathml_block(
                    f"<mrow>{_lhs(lhs, 'mathml')}<mo>=</mo>{show(e, 'mathml', rel)}</mrow>"))
            parts += [f"<p>tying: {html.escape(t)}</p>" for t in tying]
            parts.append(f"<p>steps: {html.escape(self._steps())}</p>")
            return "\n".join(parts)
        lines = [f"### {header}\n" if fmt == "markdown" else f"% {header}"]  # latex: which energy, as a comment
        for label, lhs, e in rows:
            tex = tex_greek(f"{_lhs(lhs, 'latex')} = {show(e, 'latex', rel)}")
            lines.append(f"- **{label}**: $${tex}$$" if fmt == "markdown" else f"% {label}\n{tex}")
        for t in tying:
            lines.append(f"- **tying**: {t}" if fmt == "markdown" else f"% tying: {t}")
        lines.append(f"- **steps**: {self._steps()}" if fmt == "markdown" else f"% steps: {self._steps()}")
        return "\n".join(lines)

    def _steps(self) -> str:
        """`2 × momentum (β = 9/10, learned as opt_beta; η = 1/2, learned as opt_eta)`: the optimizer's
        values, which the equations show only as symbols."""
        optimizer = self.spec.optimizer
        # a default is a float (`momentum()`'s 0.9: its equation hash, which checkpoints hold, stays as it was);
        # shown as a written value is, 9/10
        values = [f"{show(Var(str(h.symbol), 'leaf', ()))} = {number_shown(h.value)}"
                  + (f", learned as opt_{name}" if h.learn else "")
                  for name, h in sorted(optimizer.hyper.items(), key=lambda kv: str(kv[1].symbol))]
        steps = f"{optimizer.steps} × {optimizer.kind}" + (f" ({'; '.join(values)})" if values else "")
        if optimizer.precondition is None:
            return steps
        # covariance's τ is P_tau, learned unless `fixed`; a rank is a shape
        options = [f"{'τ' if name == 'tau' else name} = {number_shown(value)}"
                   + (", learned as P_tau" if learn and name == "tau" else "")
                   for name, (value, learn) in sorted(optimizer.precondition_options.items())]
        return f"{steps}, precondition {optimizer.precondition}" + (f"({'; '.join(options)})" if options else "")

    def _header(self) -> str:
        spec = self.spec
        shape = ", ".join(str(s) for s in spec.state.shape)
        ctx = ""
        if spec.context is not None:
            index = spec.context.index
            rel = f"{index} < i" if spec.indices[index].strict else f"{index} ≤ i"
            ctx = f"  ·  context {spec.context.name}_{spec.context.index}, {rel}"
        dims = ", ".join(f"{k}={plain_number(v)}" for k, v in spec.dim_values.items())
        return f"{spec.name}  ·  state {spec.state.name} ∈ ℝ^[{shape}]{ctx}  ·  {dims}"

    def _repr_latex_(self) -> str:
        rel = self.relations()
        body = tex_greek(" \\\\ ".join(f"\\text{{{label}}}: & {_lhs(lhs, 'latex')} = {show(e, 'latex', rel)}"
                                       for label, lhs, e in self.equation_list()))
        return f"$$\\begin{{aligned}}{body}\\end{{aligned}}$$"

    def module(self, backend: str = "torch", *, device: Any = None, dtype: Any = None):
        """This energy's layer, an nn.Module (as `load(path).module(name, **dims)` builds it), moved to `device`
        and `dtype` when given (as torch's layers take them)."""
        from .codegen import check_backend, module_class

        check_backend(backend)
        with allocation_named(f"the layer of `{self.name}`"):
            return placed(module_class(self, backend)(), device, dtype)

    def check(self) -> list[CheckResult]:
        """`energy check`'s rows for this energy, run once (float64, against autograd): `CheckResult`s."""
        if self._checks is None:
            self._checks = run_checks(self.program, build=lambda: self.module(dtype="float64"))
        return self._checks

    def equation_hash(self) -> str:
        """A hash of everything the generated layer depends on: identical layers share it.

        The update's equations, and what they do not show: the number of steps, the context's mask
        (j < i or j <= i), the parameters (shapes, initialisers, constraints, learned or fixed), the
        optimizer's hyper-parameters and the dims."""
        if self._hash is None:
            prog = self.program
            params = [(p.name, tuple(map(str, p.shape)), repr(p.init), repr(p.constraint), p.learn)
                      for p in prog.params.values()]
            values = [unhoist(a.value) for a in prog.assigns]
            if ir.tree_size(values) <= ir.TEXT_NODES:  # the text every checkpoint and search result holds
                text = ir.key_text([(a.target.name, v.key) for a, v in zip(prog.assigns, values)])
            else:  # written out, the text would take minutes (a Taylor-2 Newton direction through a norm)
                text = repr([(a.target.name, ir.fingerprint(v)) for a, v in zip(prog.assigns, values)])
            text += repr((prog.steps, sorted(self.relations().items()), params,
                          sorted((str(k), str(v) if isinstance(v, str) else ir.key_text(v))
                                 for k, v in prog.hyper_values.items())))
            text += repr(sorted(self.spec.dims().items()))
            self._hash = hashlib.sha256(text.encode()).hexdigest()[:16]
        return self._hash

    def flops_per_token(self, context: int) -> float:
        """Matmul FLOPs per token of one forward of the stage at full context (see `codegen`)."""
        if not is_count(context):
            raise ValueError(f"context must be a whole number of tokens, at least 1, not {context!r}")
        if context not in self._flops:
            from .codegen.torch_module import flops_per_token

            self._flops[context] = flops_per_token(self.program, context)
        return self._flops[context]


def _lhs(lhs: str | Expr, fmt: str) -> str:
    """An equation's left-hand side: a name with its indices (`p_k,j`), a gradient (`∇_z F`) or a label."""
    if isinstance(lhs, Expr):
        return show(lhs, fmt)
    if fmt == "text":
        return lhs
    return STYLES[fmt].name_(lhs, [])  # as the printer writes the name where a later equation uses it


def _look_ahead(spec: EnergyIR, prog: UpdateProgram, name: str) -> tuple[Expr, Expr]:
    """NAG's direction at its look-ahead point, as the optimizer builds it, and the call `D(z − β m_z)` that
    shows for it."""
    x, m = spec.state, prog.aux[0]
    point = ir.add(x, ir.neg(ir.mul(ir.Scalar(spec.optimizer.hyper["beta"].symbol), m)))
    body = substitute_var(unhoist(prog.tied_direction or prog.direction), x.name, x.role, point)
    return body, ir.Func(name, point)


def _updates(assigns: list[Assign], folded: Callable[[Expr], Expr]) -> list[tuple[str, Expr]]:
    """The update rows `m_z⁺ = β m_z + D`, `z⁺ = z − η m_z⁺`: an assignment reads the values the ones before it
    wrote, which carry the ⁺ mark."""
    rows: list[tuple[str, Expr]] = []
    written: dict[Expr, Expr] = {}
    for a in assigns:
        value = ir.substitute(folded(unhoist(a.value)), written) if written else folded(unhoist(a.value))
        rows.append((f"{a.target.name}⁺", value))
        written[a.target] = Var(f"{a.target.name}⁺", NAME, a.target.shape)
    return rows

def placed(module: Any, device: Any, dtype: Any) -> Any:
    """`module` on `device` (a name, as `--device` takes it, or a torch.device) in `dtype` (a floating torch.dtype
    or its name), as torch's layers take them; a device this machine lacks is refused, naming it."""
    import torch

    from .training.config import device_of

    if device is not None:
        device = device_of(str(device) if isinstance(device, torch.device) else device)
    given = dtype
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None) if dtype.isidentifier() else None
    if given is not None and dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        raise UserError(f"dtype must be a floating torch dtype a layer computes in (float32, float64, bfloat16, "
                        f"float16), got {given!r}", hint="float8 types hold weights for scaled matmuls; torch "
                        "computes no normalisation or initialiser in them" if "float8" in str(given) else None)
    return module if device is None and dtype is None else module.to(device=device, dtype=dtype)


# ----------------------------------------------------------------------------- shared derivations

DERIVE_MEMO_SIZE = 256  # derivations kept per process (a search builds a few per trial, mostly the same)
_DERIVED: OrderedDict[tuple[Any, ...], Derived] = OrderedDict()
_DERIVED_LOCK = threading.Lock()  # Ray may run trials in threads of one process


def declaration_key(decl: syntax.EnergyDecl) -> tuple[Any, ...]:
    """Everything `lower_energy(decl, dims)` depends on besides the dims: the declaration's text and the
    position of every node in it. Declarations with equal keys lower to equal IRs down to the spans
    (file:line:col) that error messages and `expect` counterexamples cite, so they can share one."""
    spans: list[tuple[str, int, int, int | None]] = []

    def walk(x: Any) -> None:
        if isinstance(x, Span):
            spans.append((x.file, x.line, x.column, x.end_column))
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for f in dataclasses.fields(x):
                walk(getattr(x, f.name))
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)

    walk(decl)
    # a declaration built in code (no text) is told apart by its whole tree
    return (decl.name, decl.source_text or repr(decl), tuple(spans))


def derive(decl: syntax.EnergyDecl, dims: dict[str, float] | None = None) -> Derived:
    """`lower_energy` + `build_program`, memoised in this process by `declaration_key` and the dims.

    A search builds every candidate from fresh text, but most candidates repeat an energy another one
    had, at the same place: they share its Derived (and what it caches: checks, hash, printed
    equations). Only successes are kept; a failing declaration raises afresh, with its own spans. The
    shared IR's `Span.source` is the first user's whole text, which agrees with this one's on every line
    of the declaration (the key fixes their text and positions). Nothing downstream changes a Derived
    beyond its caches of what it derives."""
    dims = dict(dims or {})
    key = (declaration_key(decl), tuple(sorted((k, float(v)) for k, v in dims.items())))
    with _DERIVED_LOCK:
        hit = _DERIVED.get(key)
        if hit is not None:
            _DERIVED.move_to_end(key)
            return hit
    spec = lower_energy(decl, dims)
    derived = Derived(spec, build_program(spec))
    with _DERIVED_LOCK:
        derived = _DERIVED.setdefault(key, derived)  # a racing thread's result wins: one object per key
        while len(_DERIVED) > DERIVE_MEMO_SIZE:
            _DERIVED.popitem(last=False)
    return derived


def derive_stage(stage: Any, model: str) -> Derived:
    """`derive` of a model's stage (`composition.StagePlan`), its errors naming the stage (`stage_named`)."""
    from .composition import stage_named

    with stage_named(stage, model):
        return derive(stage.decl, stage.dims)
