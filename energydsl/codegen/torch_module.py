"""An energy's update program as the source of a standalone `nn.Module` (`energy compile --backend torch`).

The module's forward is the derived closed-form update unrolled over the optimizer's steps; it
contains no autograd call, so training needs first-order autograd only and `torch.compile` works on
it. Parameters are registered raw, with their initialisers; constraints are applied in forward
(softplus for `positive`, a scaled sigmoid for `in (lo, hi)`, L Lᵀ + εI for `psd`).
"""

from __future__ import annotations

import ast
import keyword
import re
import textwrap
from typing import Any, NamedTuple

import sympy as sp
import torch

from .. import ir
from ..errors import SpecError
from ..instance import unconstrain
from ..number_text import plain_number
from ..optimizers import UpdateProgram
from ..semantics import ParamSpec
from .hoist import hoist_invariants, line_names
from .projections import fuse_biases, fuse_projections
from .scalar_src import FloatOverflow, is_number, sympy_src
from .second_order import collect_expanded_sums
from .simplify import simplify
from .torch_expr import Emitter, coefficient
from .triton_source import KernelRequest, kernel_imports, kernel_source
from .weight_products import weights_first

RESERVED = {"B", "T", "pos", "mask", "mask_strict", "count", "count_strict", "dev", "dt", "self", "torch", "F",
            "math", "nn", "x", "context", "input", "step", "delta", "kernels", "check_inputs", "random_inputs",
            "triton", "tl",
            "causal_masks", "alibi_slopes", "attention_ops", "linear_attention_ops", "gated_activation_ops",
            "momentum_ops", "nesterov_ops", "pointwise_ops"}  # the last: the generated file's imports
OPS = ("softmax_attention", "linear_attention", "masked_reduce", "masked_softmax", "prefix_reduce", "inverse",
       "projections", "prod_of_others", "rope")
RESERVED |= set(OPS)  # imported by name: a parameter called `inverse` must not shadow the function


def class_name(name: str) -> str:
    """The generated class of an energy: its name capitalised, with `_` after a Python keyword (`none` would be
    `class None`) and after `F`, which every generated file imports as torch.nn.functional."""
    out = re.sub(r"\W", "_", name)
    out = out[0].upper() + out[1:] if out else "Energy"
    return f"{out}_" if keyword.iskeyword(out) or out == "F" else out


def _local(name: str) -> str:
    """A Python local for a spec name, clear of the names generated code uses itself."""
    return f"{name}_" if name in RESERVED or re.fullmatch(r"t\d+|c\d+|\w+_[0-9a-f]{8}", name) else name


class ModuleWriter:
    """Writes one module's source: header, __init__ (parameters), reset_parameters, forward."""

    def __init__(self, prog: UpdateProgram, equation_hash: str, backend: str = "torch", lowering: bool = True,
                 context_len: int = 1, equations: str | None = None, cls: str | None = None):
        self.prog = prog
        self.cls = cls or class_name(prog.spec.name)  # another where one file holds the energy at several dims
        self.context_len = context_len  # T for FLOP counts
        self.flops_per_token = 0.0
        self.backend = backend
        self.spec = prog.spec
        self.hash = equation_hash
        self.lowering = lowering
        self.equations = equations  # `energy derive`'s text, for the docstring
        spec = self.spec
        self.dims = {spec.dim_symbols[k]: sp.Float(v) for k, v in spec.dim_values.items()}

    def size(self, e: sp.Expr) -> int:
        return int(round(float(sp.sympify(e).subs(self.dims))))

    def _sizes(self, var: Any) -> tuple[int, ...] | None:
        """A variable's shape at these dims (per token for the state, context and input); None for none."""
        return None if var is None else tuple(self.size(s) for s in var.shape)

    def number(self, e) -> float:
        return float(sp.sympify(e).subs(self.dims))

    # ------------------------------------------------------------------ parameters

    def _param_lines(self) -> tuple[list[str], list[str]]:
        """(__init__ lines, reset_parameters lines)."""
        init, reset = [], []
        for p in self.prog.params.values():
            shape = self._sizes(p)
            py_shape = "(" + "".join(f"{n}, " for n in shape).rstrip(" ") + ")"
            if p.learn:
                init.append(f"self.{p.name} = nn.Parameter(torch.empty({py_shape}))")
            else:
                init.append(f"self.register_buffer({p.name!r}, torch.empty({py_shape}))")
            reset.append(self._init_line(p, shape))
        return init, reset

    def _init_line(self, p: ParamSpec, shape: tuple[int, ...]) -> str:
        kind, args = p.init or ("normal", [0.0, 0.02])
        target = f"self.{p.name}"
        if kind == "normal":
            return f"{target}.normal_({self.number(args[0])!r}, {self.number(args[1])!r})"
        if kind == "uniform":
            return f"{target}.uniform_({self.number(args[0])!r}, {self.number(args[1])!r})"
        if kind == "zeros":
            return f"{target}.zero_()"
        if kind == "ones":
            return f"{target}.fill_({self._raw(p, 1.0)!r})"
        if kind == "eye":
            return f"{target}.copy_(torch.eye({shape[-1]}).expand({shape}))"
        if kind == "orthogonal":  # a stack of matrices ([heads, n, m]): each one orthogonal
            if len(shape) > 2:
                return f"for w in {target}.view(-1, {shape[-2]}, {shape[-1]}): nn.init.orthogonal_(w)"
            return f"nn.init.orthogonal_({target}.view(-1, {shape[-1]}))"
        if kind == "alibi_slopes":
            return f"{target}.copy_(alibi_slopes({shape[0]}))"
        if kind == "value":
            return f"{target}.fill_({self._raw(p, self.number(args[0]))!r})"
        raise NotImplementedError(f"initialiser {kind}")

    def _raw(self, p: ParamSpec, value: float) -> float:
        """The raw parameter value whose constrained value is `value`."""
        if p.constraint is None or p.constraint[0] == "psd":
            return value
        return float(unconstrain(p, torch.tensor(value, dtype=torch.float64, device="cpu")))  # not the ambient device

    def _constrained(self, p: ParamSpec) -> str:
        raw = f"self.{p.name}"
        if p.constraint is None:
            return raw
        kind = p.constraint[0]
        if kind == "interval":
            lo, hi = self.number(p.constraint[1]), self.number(p.constraint[2])
            return f"{lo!r} + {hi - lo!r} * torch.sigmoid({raw})"
        if kind == "positive":
            return f"F.softplus({raw})"
        if kind == "psd":
            n = self.size(p.shape[-1])
            return f"{raw} @ {raw}.transpose(-1, -2) + 1e-6 * torch.eye({n}, dtype=dt, device=dev)"
        raise NotImplementedError(kind)

    def _scalars(self) -> dict[sp.Symbol, str]:
        """SymPy symbols -> source: dims and fixed hyper-parameters as numbers, learned ones as locals."""
        spec = self.spec
        out: dict[sp.Symbol, str] = {sym: repr(float(v)) for sym, v in self.dims.items()}
        for name, expr in spec.derived_dims.items():
            out[sp.Symbol(name, positive=True)] = repr(float(sp.sympify(expr).subs(self.dims)))
        for name, sym in spec.scalar_params.items():
            out[sym] = _local(name)
        for name, h in spec.optimizer.hyper.items():
            if h.learn:
                out[h.symbol] = _local(f"opt_{name}")
            else:
                out[h.symbol] = sympy_src(sp.sympify(h.value).subs(self.dims), {})
        return out

    # ------------------------------------------------------------------ forward

    def _token_names(self) -> dict[str, str]:
        spec = self.spec
        names = {p: _local(p) for p in self.prog.params}
        names[spec.state.name] = _local(spec.state.name)
        for m in self.prog.aux:
            names[m.name] = _local(m.name)
        if spec.input is not None:
            names[spec.input.name] = _local(spec.input.name)
        if spec.context is not None:
            ctx = spec.context.name
            names[f"ctx:{ctx}"] = _local(ctx) if spec.input is None or spec.input.name != ctx else f"{ctx}_ctx"
        return names

    def forward_lines(self) -> tuple[list[str], set[str]]:
        """The forward's lines and the ops it calls; a number of the update beyond a float's range is a SpecError
        at the optimizer (its η times the energy's constants, say), not an `inf` in the generated file."""
        try:
            return self._forward_lines()
        except FloatOverflow as e:
            spec = self.spec
            raise SpecError(f"the derived update of `{spec.name}` holds the number {e}, too large for a float "
                            "(at most about 1.8e308)", spec.optimizer.span or spec.energy_span or spec.span,
                            "the energy's constants times the optimizer's step size overflow: scale one down "
                            "(`energy derive` shows the update)") from None

    def _forward_lines(self) -> tuple[list[str], set[str]]:
        spec, prog = self.spec, self.prog
        sizes = {k: self.size(info.size) for k, info in spec.indices.items() if info.size is not None}
        names = self._token_names()
        em = Emitter(spec.indices, self._scalars(), sizes, names, lowering=self.lowering, backend=self.backend)
        em.context_len = self.context_len
        em.user_names = spec.user_names
        if self.backend == "triton" and spec.optimizer.kind == "nag" and prog.aux:
            em.lookahead = (spec.state, prog.aux[0])  # x + c m, where the force is evaluated: one kernel
        steps_body: list[str] = []
        delta_code = None
        fused = momentum_step(prog) if self.backend == "triton" else None
        context = frozenset(k for k, info in spec.indices.items() if info.context is not None)
        numbers = {sym: float(src) for sym, src in em.scalars.items() if is_number(src)}  # the fixed hyper-parameters

        def ordered(value: ir.Expr) -> ir.Expr:
            """(U Vᵀ W) a for U (Vᵀ (W a)) when lowering, terms that cancel through the attention's sums gone;
            the generic form keeps the derivation's order."""
            return weights_first(collect_expanded_sums(em, value), self.size, context) if self.lowering else value

        for a in prog.assigns:
            value = ordered(simplify(a.value, numbers))
            if fused is not None and a.target == fused.velocity:
                force = em.emit(ordered(fused.force))
                if not force.scalar and force.axes == ("@b", "@i"):
                    x_, m_ = names[spec.state.name], names[a.target.name]
                    beta, eta = em.scalar(fused.beta), em.scalar(fused.eta)
                    ops = em.kernel_set(KernelRequest.momentum())  # kernels written into the file
                    em.lines.append(f"{x_}, {m_} = {ops}.momentum_update({x_}, {m_}, {force.code}, {beta}, {eta})"
                                    "  # m = beta m + f, x = x + eta m: one fused pass")
                    em.forget()
                    break  # the state's assignment, the second and last, is done too
            terms = value.terms if isinstance(value, ir.Add) else ()
            rest = [t for t in terms if t != a.target]
            if a.target == spec.state and len(rest) == len(terms) - 1 >= 1:  # x + Δ, Δ one term or several
                step = em.emit(ir.add(*rest))  # Δ itself: with delta=True, not (x + Δ) − x, which rounds Δ away
                if not step.scalar and step.axes == ("@b", "@i"):
                    delta_code = step.code
            if delta_code is not None and len(rest) > 1:  # x + Δ from the Δ just summed, not its terms again
                v = em.tmp(f"{em.emit(a.target).code} + {delta_code}", step.axes, step.rank)
            else:
                v = em.emit(value)
            target = names[a.target.name]
            shape = self._sizes(a.target)
            if v.scalar or v.axes != ("@b", "@i"):
                code = em.align(v, ("@b", "@i"), len(shape)) if not v.scalar else v.code
                em.lines.append(f"{target} = ({code}).expand(B, T, {', '.join(map(str, shape))})".replace(", )", ")"))
            else:
                em.lines.append(f"{target} = {v.code}")
            em.forget()
        steps_body = em.body
        lines: list[str] = []
        x = names[spec.state.name]
        if spec.context is not None:
            lines.append(f"{names['ctx:' + spec.context.name]} = x if context is None else context")
        if spec.input is not None:
            lines.append(f"{names[spec.input.name]} = x if input is None else input")
        text = "\n".join(em.prologue + steps_body)
        if re.search(r"\bpos\b", text):
            lines.append("pos = torch.arange(T, device=dev, dtype=dt)")
        masks = [m for m in ("mask", "mask_strict") if re.search(rf"\b{m}\b", text)]  # the ones the forward reads
        if masks:
            which = "" if len(masks) == 2 else "[0]" if masks == ["mask"] else "[1]"
            lines.append(f"{', '.join(masks)} = causal_masks(T, dev){which}")
            em.used_ops.add("causal_masks")
        if re.search(r"\bcount\b", text):
            lines.append("count = torch.arange(1, T + 1, device=dev, dtype=dt)")
        if re.search(r"\bcount_strict\b", text):
            lines.append("count_strict = torch.arange(0, T, device=dev, dtype=dt)")
        lines += [f"{_local(p.name)} = {self._constrained(p)}" for p in prog.params.values()]
        start = [f"{x} = x"] + [f"{names[m.name]} = torch.zeros_like(x)  # optimizer state, zero at the start"
                                for m in prog.aux]
        # the projections of one input become one GEMM: the context, the input and the state before the first
        # step may all be x. Both backends: the kernels read the wide product's column views in place.
        keys = (spec.context and f"ctx:{spec.context.name}", spec.input and spec.input.name)
        roots = {names[key]: "x" for key in keys if key is not None}
        taken = set(re.findall(r"\w+", "\n".join(lines + em.prologue + steps_body)))
        vectors = {_local(p.name) for p in prog.params.values() if len(p.shape) == 1}  # biases F.linear can take

        plain = prog.steps == 1 and not prog.aux and len(steps_body) >= 2 and delta_code is not None
        hoisted: list[str] = []
        if prog.steps == 1:
            # the displacement returns right after the last line its names need (the two lines after it were
            # assumed: a step that simplified to `z = z` returned a name assigned after the return)
            needs = set(re.findall(r"\b[A-Za-z_]\w*\b", delta_code or ""))
            cut = max((n + 1 for n, line in enumerate(steps_body)
                       if line_names(ast.parse(line.strip()).body)[1] & needs), default=0)
            head, tail = (steps_body[:cut], steps_body[cut:]) if plain else (steps_body, [])
            lines += fuse_biases(fuse_projections(em.prologue + start + head, {**roots, x: "x"}, taken), vectors)
            if plain:  # one plain step x + Δ: the displacement is available before the final add
                lines += ["if delta:", f"    return {delta_code}"]
            lines += tail
        else:  # what every step would compute alike: once, before the loop
            hoisted, steps_body = hoist_invariants(steps_body, {x, *(names[m.name] for m in prog.aux)})
            if em.prologue or hoisted:
                lines.append("# computed once, outside the optimizer's steps (state-independent)")
                lines += fuse_biases(fuse_projections(em.prologue + hoisted, roots, taken), vectors)
            lines += start
            lines.append(f"for _step in range({prog.steps}):")
            lines += ["    " + ln for ln in fuse_biases(fuse_projections(steps_body, {}, taken), vectors)]
        if "projections(" in "\n".join(lines):
            em.used_ops.add("projections")
        # a plain step returned its displacement above: no `delta` is left to ask about here
        lines.append(f"return {x}" if plain else f"return {x} - x if delta else {x}")
        lines = _user_named(lines, em.named)
        used = "\n".join(ln.split("  # ", 1)[0] for ln in lines)  # the code, not its comments
        preamble = ["check_inputs(self, x, context, input, delta)  # shapes, length, dtype: a clear ValueError"]
        for names_, values in ((("B", "T"), ("x.shape[0]", "x.shape[1]")), (("dev", "dt"), ("x.device", "x.dtype"))):
            kept = [(n, v) for n, v in zip(names_, values, strict=True) if re.search(rf"\b{n}\b", used)]
            if kept:
                preamble.append(f"{', '.join(n for n, _ in kept)} = {', '.join(v for _, v in kept)}")
        lines = preamble + lines
        once = sum(em.line_flops.get(line, 0.0) for line in hoisted)  # moved out of the steps: counted once
        self.flops_per_token = em.flops["prologue"] + once + prog.steps * (em.flops["body"] - once)
        self.kernel_requests = em.kernel_requests
        quadratic = sorted(em.used_ops & {"masked_softmax", "masked_reduce", "prod_of_others"})
        self.quadratic = quadratic  # honest about memory: these hold (B, T, T, ...) tensors
        if self.backend == "triton" and quadratic:
            em.misses.append(f"a context sum no kernel takes is computed with T x T tensors ({', '.join(quadratic)})")
        self.misses = list(dict.fromkeys(em.misses))
        return lines, em.used_ops

    # ------------------------------------------------------------------ the file

    def parts(self) -> tuple[list[str], list[str], list[KernelRequest], list[str]]:
        """(docstring, imports, kernels, class lines): `file_source` joins them for one or more modules."""
        spec, prog, cls = self.spec, self.prog, self.cls
        init, reset = self._param_lines()
        fwd, used = self.forward_lines()
        dims = ", ".join(f"{k}={plain_number(v)}" for k, v in spec.dim_values.items())
        state_shape = self._sizes(spec.state)
        if self.equations is None:  # a program without its Derived (module_source): derive's printer
            from ..derived import Derived  # here, not at the top: derived.py uses codegen

            self.equations = Derived(spec, prog).equations("text")
        equations = self.equations.split("\n", 1)[1]  # below the header, which the first doc line replaces
        code = "\n".join(fwd)  # an op whose call a later rewrite removed (attention turned p @ v) is not imported
        ops = sorted(op for op in used & (set(OPS) | {"causal_masks"}) if re.search(rf"\b{op}\(", code))
        imports = ["import torch", "import torch.nn.functional as F", "from torch import nn",
                   "from energydsl.runtime.inputs import check_inputs, random_inputs"]
        if ops:
            imports.insert(3, f"from energydsl.runtime.ops import {', '.join(ops)}")
        # the fused Triton kernels, written below specialised for this energy, and their op-set constructors
        imports += kernel_imports(self.kernel_requests)
        if any((p.init or ("",))[0] == "alibi_slopes" for p in prog.params.values()):
            imports.insert(3, "from energydsl.runtime.init import alibi_slopes")
        if "integral_quadrature" in "\n".join(fwd):
            imports.insert(3, "from energydsl.runtime.init import integral_quadrature")
        named = "" if cls == class_name(spec.name) else f", class {cls}"  # one energy at several dims in one file
        doc = [f"energy {spec.name} ({dims}){named} from {spec.span.file}, backend {self.backend}. Its derivation, as",
               "`energy derive` prints it (the untied update, when there is one, is what `forward` runs):",
               "",
               textwrap.indent(equations, "    ")]
        out = [f"class {cls}(nn.Module):",
               f'    """{spec.name}: x (batch, seq, {", ".join(map(str, state_shape))}) -> the updated states."""',
               "",
               f"    state_shape = {state_shape!r}",
               f"    context_shape = {self._sizes(spec.context)!r}  # None: no `context` clause",
               f"    input_shape = {self._sizes(spec.input)!r}  # None: no `input` clause",
               f"    steps = {prog.steps}",
               f"    equation_hash = {self.hash!r}",
               "",
               "    def __init__(self) -> None:",
               "        super().__init__()",
               *[f"        {ln}" for ln in init],
               "        self.reset_parameters()",
               "",
               "    def reset_parameters(self) -> None:",
               *(["        with torch.no_grad():", *[f"            {ln}" for ln in reset]] if reset
                 else ['        """Nothing to initialise: this energy has no parameters."""']),
               "",
               f"    def extra_repr(self) -> str:  # print(module): {cls}({dims}, backend={self.backend})",
               f"        return {f'{dims}, backend={self.backend}'!r}",
               "",
               "    def example_input(self, batch: int = 2, seq: int = 16) -> torch.Tensor:",
               '        """Random states x (batch, seq, *state_shape) on the parameters\' device, in their dtype."""',
               '        return random_inputs(self, batch, seq)["x"]',
               "",
               "    def example_inputs(self, batch: int = 2, seq: int = 16) -> dict[str, torch.Tensor]:",
               '        """x, and a context or input that cannot default to x: `module(**module.example_inputs())`."""',
               "        return random_inputs(self, batch, seq)",
               "",
               "    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None,",
               "                input: torch.Tensor | None = None, delta: bool = False) -> torch.Tensor:",
               '        """The updated states; with delta=True their displacement (update minus x).',
               "",
               "        context defaults to x (the frozen tokens), input to x (each token's own input).",
               '        """',
               *[f"        {ln}" for ln in fwd]]
        return doc, imports, self.kernel_requests, out


def _user_named(lines: list[str], named: dict[str, set[str]]) -> list[str]:
    """The forward with a temporary (`t7`, `c0`) renamed to the spec's name of its value (a `let`, the `via`
    variable), where that value was printed once and the name is free: used nowhere else in the forward, and
    not one the forward's preamble or the file gives a meaning (`RESERVED`). An attribute (`self.t1`, a
    parameter called `t1`) is not the temporary."""
    text = "\n".join(lines)
    words = set(re.findall(r"\w+", text)) | RESERVED
    for name, codes in sorted(named.items()):
        if len(codes) != 1 or name in words:
            continue
        (code,) = codes
        if not re.fullmatch(r"[ct]\d+", code) or len(re.findall(rf"^\s*{code} = ", text, re.M)) != 1:
            continue
        text = re.sub(rf"(?<![.\w]){code}\b", name, text)
        words.add(name)
    return text.split("\n")


def file_source(writers: list[ModuleWriter]) -> str:
    """One Python file with the modules of several energies: docstring, imports, kernels, the classes."""
    docs, imports, requests, classes = [], [], [], []
    for w in writers:
        doc, imp, req, cls = w.parts()
        docs += (["", ""] if docs else []) + doc
        imports += imp
        requests += req
        classes += (["", ""] if classes else []) + cls
    body = [*kernel_source(requests), *classes]
    docs = [line.replace("\\", "\\\\").replace('"""', '\\"\\"\\"') for line in docs]  # a path `a\Nb`, `q"""x`
    return "\n".join(['"""Generated by energydsl: regenerate it with `energy compile`, edit the .energy spec.',
                      "", *docs, '"""', "", "from __future__ import annotations", "",
                      *_merged_imports(imports, "\n".join(body)), *([""] if body[0].startswith("#") else ["", ""]),
                      *body, ""])


def _merged_imports(lines: list[str], body: str) -> list[str]:
    """The modules' imports once each, as isort orders them: `from M import ...` lines of one M merged (two
    energies in one file each importing from the runtime's ops), torch and triton before energydsl's own, and
    the `F` alias kept only where the code uses it (a lint-clean file)."""
    plain: set[str] = set()
    names: dict[str, set[str]] = {}
    for line in lines:
        if line.startswith("from "):
            module, imported = line[5:].split(" import ", 1)
            names.setdefault(module, set()).update(imported.split(", "))
        elif line != "import torch.nn.functional as F" or re.search(r"\bF\.", body):
            plain.add(line)

    def section(first_party: bool) -> list[str]:
        mine = [ln for ln in plain if ln.split()[1].startswith("energydsl") == first_party]
        froms = [m for m in names if m.startswith("energydsl") == first_party]
        return sorted(mine, key=lambda ln: ln.split()[1]) + [
            f"from {m} import {', '.join(sorted(names[m]))}" for m in sorted(froms)]

    ours = section(True)
    return section(False) + ([""] + ours if ours else [])


class MomentumStep(NamedTuple):
    """m = beta m + force, then x = x + eta m: one step of momentum or Nesterov (whose force is at x + beta m)."""

    velocity: ir.Var
    beta: sp.Expr
    force: ir.Expr
    eta: sp.Expr


def momentum_step(prog: UpdateProgram) -> MomentumStep | None:
    """The program's step as a MomentumStep (for the fused epilogue), or None when it has another form."""
    state = prog.spec.state
    if len(prog.aux) != 1 or len(prog.assigns) != 2:
        return None
    m = prog.aux[0]
    first, second = (simplify(a.value) for a in prog.assigns)
    if prog.assigns[0].target != m or prog.assigns[1].target != state:
        return None
    if not (isinstance(second, ir.Add) and len(second.terms) == 2 and second.terms[0] == state):
        return None
    eta = coefficient(second.terms[1], m)
    if eta is None or not isinstance(first, ir.Add):
        return None
    betas = [(t, c) for t in first.terms if (c := coefficient(t, m)) is not None]
    if len(betas) != 1:
        return None
    force = ir.add(*(t for t in first.terms if t is not betas[0][0]))
    return MomentumStep(m, betas[0][1], force, eta)


def module_source(prog: UpdateProgram, equation_hash: str, backend: str = "torch", lowering: bool = True) -> str:
    return file_source([ModuleWriter(prog, equation_hash, backend, lowering)])


def flops_per_token(prog: UpdateProgram, context_len: int) -> float:
    """Matmul FLOPs per token of one forward of the stage (attention at full context `context_len`)."""
    writer = ModuleWriter(prog, "", context_len=context_len)
    writer.forward_lines()
    return writer.flops_per_token
