"""The Python API: `energydsl.load(path_or_text)` and the objects it returns.

    spec = energydsl.load("examples/intrinsic-optimizers/mha.energy")
    layer = spec.energy("MHA", d=16, heads=2)      # sizes as keyword arguments
    print(layer.equations("text"))
    results = layer.check()
"""

from __future__ import annotations

import dataclasses
import hashlib
import html
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import ir, syntax
from .calculus import substitute_var
from .checks import CheckResult, run_checks
from .cli_sizing import allocation_named
from .errors import HoleError, Span, SpecError, UserError
from .ir import Expr, Var
from .number_text import is_count, number_shown, plain_number
from .optimizers import Assign, UpdateProgram, build_program, unhoist
from .printing import NAME, STYLES, fold, mathml_block, name_repeats, show, shown_function
from .semantics import EnergyIR, lower_energy


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
        out.append(("gradient", gradient, prog.gradient))
        named.append((prog.gradient, gradient))
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
            tex = f"{_lhs(lhs, 'latex')} = {show(e, 'latex', rel)}"
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
            rel = "j < i" if spec.indices[spec.context.index].strict else "j ≤ i"
            ctx = f"  ·  context {spec.context.name}_{spec.context.index}, {rel}"
        dims = ", ".join(f"{k}={plain_number(v)}" for k, v in spec.dim_values.items())
        return f"{spec.name}  ·  state {spec.state.name} ∈ ℝ^[{shape}]{ctx}  ·  {dims}"

    def _repr_latex_(self) -> str:
        rel = self.relations()
        body = " \\\\ ".join(f"\\text{{{label}}}: & {_lhs(lhs, 'latex')} = {show(e, 'latex', rel)}"
                             for label, lhs, e in self.equation_list())
        return f"$$\\begin{{aligned}}{body}\\end{{aligned}}$$"

    def module(self, backend: str = "torch", *, device: Any = None, dtype: Any = None):
        """This energy's layer, an nn.Module (as `load(path).module(name, **dims)` builds it), moved to `device`
        and `dtype` when given (as torch's layers take them)."""
        from .codegen import check_backend, module_class

        check_backend(backend)
        with allocation_named(f"the layer of `{self.name}`"):
            return _placed(module_class(self, backend)(), device, dtype)

    def check(self) -> list[CheckResult]:
        if self._checks is None:
            self._checks = run_checks(self.program)
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
                text = repr([(a.target.name, v.key) for a, v in zip(prog.assigns, values)])
            else:  # written out, the text would take minutes (a Taylor-2 Newton direction through a norm)
                text = repr([(a.target.name, ir.fingerprint(v)) for a, v in zip(prog.assigns, values)])
            text += repr((prog.steps, sorted(self.relations().items()), params,
                          sorted((str(k), str(v)) for k, v in prog.hyper_values.items())))
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


class Spec:
    """A parsed `.energy` file (with its imports): declarations by name."""

    def __init__(self, module: syntax.Module):
        self.syntax = module
        self.path = module.path

    @property
    def names(self) -> list[str]:
        return self.syntax.names()

    @property
    def block_names(self) -> list[str]:
        return [n for n in self.syntax.names() if n in self.syntax.blocks]

    @property
    def energy_names(self) -> list[str]:
        return [n for n in self.syntax.names() if n in self.syntax.energies]

    def energy(self, name: str | None = None, **dims: float) -> Derived:
        """One energy's derivation at these dims (an imported energy may be named; left out, the file's one).

        A block of one summed stage (`block B = Attention + FF`) may be named too: its energies are summed
        under the first one's optimizer, as a model's layer runs them."""
        _check_name(name)
        if name in self.syntax.blocks:
            from .composition import expand_block

            stages = expand_block(self.syntax, name, dims)  # resolved, not derived: a pipeline is refused first
            if len(stages) != 1:
                raise SpecError(f"block `{name}` is a pipeline of {len(stages)} stages, not one energy", None,
                                f"use .block(\"{name}\") for each stage's derivation")
            return derive(stages[0].decl, stages[0].dims)
        decl = self.syntax.energies[self._pick(name, self.energy_names, ("energy", "energies"), self.syntax.energies)]
        spec = lower_energy(decl, dims)
        return Derived(spec, build_program(spec))

    def derivations(self, name: str | None = None, **dims: float) -> list[Derived]:
        """What `energy derive` and `energy compile` show: the named energy, each stage of the named block, each
        distinct stage of the named model's layer (at the model's dims), or every energy of the file."""
        _check_name(name)
        if name is None:
            return self.derive(**dims)
        if name in self.syntax.models:
            return self.stages(name, **dims)
        return self.block(name, **dims) if name in self.syntax.blocks else [self.energy(name, **dims)]

    def stages(self, name: str | None = None, **dims: float) -> list[Derived]:
        """Each distinct stage of a model's layer, derived at the dims the model passes it: the layers
        `energy train` builds, imported energies included. A stage that repeats (same energies, same dims) is
        derived once."""
        from .composition import check_stage_state

        seen: dict[tuple[str, tuple[tuple[str, float], ...]], Derived] = {}
        plan = self.plan(name, **dims)
        for stage in plan.stages:
            key = (stage.label, tuple(sorted(stage.dims.items())))
            if key not in seen:
                seen[key] = derive_stage(stage, plan.name)
                check_stage_state(plan, stage, seen[key].spec)  # it fits the stream, as training needs
        return list(seen.values())

    def block(self, name: str, **dims: float) -> list[Derived]:
        """Each stage of a block, derived: its energies summed under the first one's optimizer. `dims` go to
        every energy that declares them, as a block's named arguments do in a model."""
        from .composition import expand_block

        _check_name(name)
        self._pick(name, [], ("block", "blocks"), self.syntax.blocks)
        return [derive(stage.decl, stage.dims) for stage in expand_block(self.syntax, name, dims)]

    def derive(self, **dims: float) -> list[Derived]:
        """Every energy declared in the file itself (not its imports)."""
        self._refuse_unknown_dims(dims)
        return [self.energy(n, **_dims_for(self.syntax.energies[n], dims)) for n in self.energy_names]

    def _refuse_unknown_dims(self, dims: dict[str, float]) -> None:
        """Refuse a dim no energy of the file declares."""
        known = {n for e in self.energy_names for n, _ in self.syntax.energies[e].header}
        unknown = sorted(set(dims) - known)
        if unknown:
            raise SpecError(f"`{unknown[0]}` is not a dim of any energy in {self.path} (dims: "
                            f"{', '.join(sorted(known)) or 'none'})", None)

    def check(self, **dims: float) -> dict[str, list[CheckResult]]:
        """The checks of every energy, block, model and search declared in the file itself, by name (a pipeline
        block's stages as `B stage 2 (MLP)`). A dim goes to each energy and model that declares it (`energy check
        --set`)."""
        energy_dims, model_dims = self._split_dims(dims)
        if self.energy_names:
            self._refuse_unknown_dims(energy_dims)
        results = {n: self._unless_template(lambda n=n: self.energy(
            n, **_dims_for(self.syntax.energies[n], energy_dims)).check()) for n in self.energy_names}
        for name in self.block_names:
            results |= self._unless_template(lambda name=name: self._check_block(name, energy_dims, model_dims),
                                             label=name)
        models = {name: self._unless_template(lambda name=name: self.check_model(name, **model_dims[name]))
                  for name in self.model_names}
        return results | models | {name: self.check_search(name) for name in self.search_names}

    def _check_block(self, name: str, energy_dims: dict[str, float],
                     model_dims: dict[str, dict[str, float]]) -> dict[str, list[CheckResult]]:
        """Each stage of a block, as a model's layer runs it (a sum: one energy), by label."""
        from .composition import block_arguments, expand_block, models_running, plan_model

        try:
            stages, where = expand_block(self.syntax, name, energy_dims), ""
        except SpecError:  # it reads a model's dims (`MLP(d, hidden = 8)`), or the arguments the model's layer
            users = models_running(self.syntax, name)  # gives it (`Pair(h = 4)`): checked as one model runs it
            if not users:
                raise
            model = plan_model(self.syntax, users[0], model_dims.get(users[0], {}))
            outer = model.dims | block_arguments(self.syntax, users[0], name, model.dims)
            stages = expand_block(self.syntax, name, energy_dims, outer=outer)
            where = f" at model {users[0]}'s dims"
        return {(name if len(stages) == 1 else f"{name} stage {n + 1} ({stage.label})") + where:
                derive(stage.decl, stage.dims).check() for n, stage in enumerate(stages)}

    def _unless_template(self, check: Callable[[], Any], label: str | None = None) -> Any:
        """`check()`, unless what it checks holds a search hole of this file's `search`: a template that only its
        candidates fill, checked each before it trains (its checks as a `holes` row, under `label` for a block).
        Without a search in the file a hole is an error, as everywhere."""
        try:
            return check()
        except HoleError:
            if not self.search_names:
                raise
            row = [CheckResult("holes", "skip", f"a template of this file's search ({', '.join(self.search_names)}): "
                               "`energy search` checks each candidate before it trains it")]
            return row if label is None else {label: row}

    @property
    def search_names(self) -> list[str]:
        return [n for n in self.syntax.names() if n in self.syntax.searches]

    def check_search(self, name: str) -> list[CheckResult]:
        """A `search` declaration loads as `energy search` loads it: the model and energies it names, its holes
        and settings, its data against the model, and the text no hole changes (a located `SpecError` if not).
        The candidates' own checks are left to the search, which runs them on each before it trains."""
        space = load_search(self.path, search=name)
        holes = space.holes()
        return [CheckResult("space", "ok", f"model {space.model_name}, {len(holes)} hole"
                            f"{'' if len(holes) == 1 else 's'} ({', '.join(h.name for h in holes) or 'none'}); "
                            "the names, settings and data load as `energy search` loads them")]

    def check_model(self, name: str | None = None, **dims: float) -> list[CheckResult]:
        """A model's own checks (`energydsl.model_checks`): causality of the composed model and parameters that
        never get a gradient, in float64 on the torch backend; and header dims that nothing reads."""
        from .cli_sizing import sized_model
        from .composition import unread_dims
        from .instance import MAX_INSTANCE_BYTES
        from .model_checks import check_model, dims_row

        sized, layers = sized_model(self, name, "torch", dims)  # on the meta device: sized before it is built
        needed = sized.num_params(layers=layers) * 8  # float64
        if needed > MAX_INSTANCE_BYTES:  # `layer = MLP(d, hidden = 1e8)`: minutes of float64, then the checks
            biggest, p = max(sized.named_parameters(), key=lambda item: item[1].numel())
            raise SpecError(f"model `{sized.plan.name}` is too large to check at its dims: its weights take "
                            f"{needed / 2**30:,.3g} GiB in float64 (`{biggest}` [{', '.join(map(str, p.shape))}] "
                            f"alone has {p.numel():,} entries), more than {MAX_INSTANCE_BYTES / 2**30:g} GiB",
                            sized.plan.span, "check it at smaller dims (--set): the checks prove the composition "
                            "and the derivations, which do not depend on the sizes")
        if layers > MAX_CHECK_LAYERS:  # `repeat layers shared` at 1e9: small weights, days of forward
            raise SpecError(f"model `{sized.plan.name}` is too deep to check at its dims: {layers:,} "
                            f"layers, more than {MAX_CHECK_LAYERS:,} (the checks run it forward and backward in "
                            "float64, about a millisecond a layer)", sized.plan.span,
                            "check it at fewer layers (--set layers=2): every layer is the same composition")
        model = self.model(name, **dims)
        return [*check_model(model), dims_row(model.plan.name, unread_dims(self.syntax, model.plan.name))]

    def _split_dims(self, dims: dict[str, float]) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        """`--set` dims for the file's energies, and for each of its models; one neither declares is refused."""
        energy_known = {n for e in self.energy_names for n, _ in self.syntax.energies[e].header}
        model_known = {m: {n for n, _ in self.syntax.models[m].header} for m in self.model_names}
        known = energy_known.union(*model_known.values())
        unknown = sorted(set(dims) - known)
        if unknown:
            raise SpecError(f"`{unknown[0]}` is not a dim of any energy or model in {self.path} (dims: "
                            f"{', '.join(sorted(known)) or 'none'})", None)
        return ({k: v for k, v in dims.items() if k in energy_known},
                {m: {k: v for k, v in dims.items() if k in names} for m, names in model_known.items()})

    @property
    def model_names(self) -> list[str]:
        return [n for n in self.syntax.names() if n in self.syntax.models]

    def model(self, name: str | None = None, backend: str = "torch", *, device: Any = None, dtype: Any = None,
              **dims: float):
        """The language model a `model` declaration describes (`energydsl.runtime.model.LanguageModel`), moved to
        `device` and `dtype` when given."""
        from .codegen import check_backend

        check_backend(backend)
        plan = self.plan(name, **dims)
        with allocation_named(f"model `{plan.name}`"):
            model = model_of_plan(plan, backend)
        model.run_metadata = self._run_metadata(model, backend)
        return _placed(model, device, dtype)

    def _run_metadata(self, model: Any, backend: str) -> dict[str, Any]:
        """What a training run records to rebuild `model` (`energy sample`, `load_trained`): the spec's text
        as trained and where its imports resolve, the model's name and dims, and the backend it runs on."""
        from .codegen import runnable_backend
        from .number_text import plain_value

        source = Path(self.syntax.base) / (Path(self.path).name if Path(self.path).is_file() else "<string>")
        return {"spec_path": str(source.resolve()), "spec_source": self.syntax.text, "model": model.plan.name,
                "dims": {k: plain_value(v) for k, v in model.plan.dims.items()}, "context": model.block_size,
                "equation_hash": model.equation_hash(), "backend": runnable_backend(backend)}

    def module(self, name: str | None = None, backend: str = "torch", *, device: Any = None, dtype: Any = None,
               **dims: float):
        """An nn.Module for an energy (its update) or a model (a language model), moved to `device` and `dtype`
        when given; `name` may be left out when the file declares exactly one energy or model."""
        from .codegen import check_backend

        _check_name(name)
        check_backend(backend)
        if name is None:
            names = self.energy_names + self.model_names
            name = self._pick(None, names, ("energy or model", "energies or models"), {}, "module")
        if name in self.syntax.models:
            return self.model(name, backend, device=device, dtype=dtype, **dims)
        return self.energy(name, **dims).module(backend, device=device, dtype=dtype)

    def plan(self, name: str | None = None, **dims: float):
        from .composition import plan_model

        _check_name(name)
        name = self._pick(name, self.model_names, ("model", "models"), self.syntax.models)
        return plan_model(self.syntax, name, dims)

    def _pick(self, name: str | None, names: list[str], what: tuple[str, str], every: dict[str, Any],
              method: str | None = None) -> str:
        """`name`, which may be any of `every` (imported declarations too); left out, the one of `names`
        (this file's own). `what`: the kind, singular and plural, for messages; `method`: the Python call that
        takes the name (default: the kind's own, `.energy(...)`)."""
        one, many = what
        if name is None:
            if not names:
                imported = [n for n in every if n not in self.syntax.order]  # the imports' own
                raise SpecError(f"{self.path} declares no {one}", None, f"it imports {', '.join(imported)}: "
                                f"`--name {imported[0]}` (in Python, .{method or one}(\"{imported[0]}\")) takes one"
                                if imported else None)
            if len(names) != 1:
                raise SpecError(f"{self.path} declares {len(names)} {many} ({', '.join(names)}); name one", None,
                                f"`--name {names[0]}` on the command line; in Python, .{method or one}(\"{names[0]}\")")
            return names[0]
        if name not in every:
            kinds = {"model": self.syntax.models, "block": self.syntax.blocks, "energy": self.syntax.energies}
            other = next((k for k, decls in kinds.items() if name in decls), None)
            hint = {"model": f"`{name}` is a model: `energy info`, `graph`, `train`, `derive` and `compile` take "
                             "it; in Python, .model(...), .plan(...) or .stages(...)",
                    "block": f"`{name}` is a block: .energy(\"{name}\") or .block(...) derives it, a model's "
                             "`layer = ...` uses it",
                    "energy": f"`{name}` is an energy: `energy derive`, `check` and `compile` take it; in Python, "
                              ".energy(...) or .module(...)"}.get(other or "")
            raise SpecError(f"no {one} named `{name}` in {self.path} (it has: "
                            f"{', '.join(every) or 'none'})", None, hint)
        return name


def _placed(module: Any, device: Any, dtype: Any) -> Any:
    """`module` on `device` (a name, as `--device` takes it, or a torch.device) in `dtype` (a floating torch.dtype
    or its name), as torch's layers take them; a device this machine lacks is refused, naming it."""
    import torch

    from .training.config import device_of

    if device is not None:
        device = device_of(str(device) if isinstance(device, torch.device) else device)
    given = dtype
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None) if dtype.isidentifier() else None
    if given is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise UserError(f"dtype must be a floating torch dtype (torch.float32, \"float64\", ...), got {given!r}")
    return module if device is None and dtype is None else module.to(device=device, dtype=dtype)


def _check_name(name: object) -> None:
    """`spec.energy(["MHA"])` failed as `unhashable type: 'list'`."""
    if name is not None and not isinstance(name, str):
        raise TypeError(f"a declaration's name is a string (or None: the file's one), not {type(name).__name__}")


# ----------------------------------------------------------------------------- shared derivations

MAX_CHECK_LAYERS = 10_000  # `energy check` of a model deeper than this is refused (10,000 layers: about 9 s)
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


def _dims_for(decl: syntax.EnergyDecl, dims: dict[str, float]) -> dict[str, float]:
    """`--set` applies to every energy that has that dim."""
    names = {n for n, _ in decl.header}
    return {k: v for k, v in dims.items() if k in names}


def load(source: str | Path, *, base: str | Path | None = None) -> Spec:
    """Parse a `.energy` file (a path) or spec text (whose imports resolve against `base`, default the working
    directory)."""
    if base is not None and not isinstance(base, str | os.PathLike):
        raise TypeError(f"base is the folder a spec text's imports resolve against (a path), not {type(base).__name__}")
    return Spec(syntax.parse_module(source, base=None if base is None else Path(base)))


def load_search(path: str | Path, **sets: object):
    """The search space of a `.energy` file's `search` declaration (`energydsl.search.dsl.load_search`)."""
    from .search.dsl import load_search as _load_search

    return _load_search(path, **sets)


def model_of_plan(plan: Any, backend: str = "torch"):
    """The `LanguageModel` of a composition plan (`Spec.plan`). Every layer's weights have the first layer's
    shapes, so a plan with `layers=1` sizes a model of any depth (`LanguageModel.info(layers=...)`)."""
    from .codegen import module_class
    from .kernels import use_triton
    from .runtime.model import LanguageModel, StageInfo

    classes, infos = [], []
    for stage in plan.stages:
        derived = derive_stage(stage, plan.name)
        classes.append(module_class(derived, backend))
        infos.append(StageInfo(stage.label, derived, derived.flops_per_token(plan.context)))
    fused = backend == "triton" and use_triton()  # as module_class: no kernels here means plain torch
    return LanguageModel(plan, classes, infos, fused_momentum=fused)
