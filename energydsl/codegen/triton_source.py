"""Triton kernels written into a generated module: the family templates specialised for one energy.

The fused kernels of `energydsl.kernels` are templates with `tl.constexpr` switches (causal or strict mask,
ALiBi slope, self-token bias, per-key bias, first- or second-order pass, decay gate, whether the gated
epilogue has a value). What an energy fixes is known when its update is lowered, so the triton backend writes
a copy of each template into the generated file with those switches replaced by their values and the branches
they turn off removed, and the functions printed from the energy (a pointwise weight, a gated activation)
baked in: the kernels a reader finds in `energy compile --backend triton -o out.py` compute this energy's
scores and nothing else.

    request = KernelRequest.attention(strict=True, alibi=True, self_bias=False, key_bias=False)
    kernel_source([request])      # the @triton.jit kernels and the op set the generated forward calls

The specialisation is a small pass over the templates' Python AST, read from the kernel modules' source
files (so generating needs no triton; comments do not survive it, the templates in energydsl/kernels/
keep them). Runtime switches (dtype-dependent dot precision, which bias
gradients are needed, tile sizes) stay `tl.constexpr` parameters.
"""

from __future__ import annotations

import ast
import copy
import functools
import hashlib
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["FAMILIES", "KernelRequest", "kernel_imports", "kernel_source", "specialise"]


@dataclass(frozen=True)
class KernelRequest:
    """One specialisation of a kernel family: the family and its baked constexpr values."""

    family: str
    baked: tuple[tuple[str, Any], ...]
    # @triton.jit functions generated for this request, the statements of a function of `x`, by the constexpr
    # parameter they are baked into (the pointwise family's weight and its derivative) or by the helper template
    # they replace (the gated epilogue's `_act_and_grad`)
    functions: tuple[tuple[str, str], ...] = ()
    reference: str = ""  # a torch expression in `x` the op set computes the float64 path with

    @staticmethod
    def attention(strict: bool, alibi: bool, self_bias: bool, key_bias: bool, second: bool = False,
                  wide: bool = False) -> KernelRequest:
        """The softmax family with these score terms: the first-order pass (energy_attention), or with
        `second` the weighted second moment over a given lse; `wide`: the feature-tiled kernels (widths
        above 256)."""
        baked = dict(STRICT=strict, HAS_ALIBI=alibi, HAS_SELF=self_bias, HAS_KB=key_bias, SECOND=second)
        # a term that is absent has no gradient either; the dQ kernel's delta pass is the second moment's only
        baked.update({need: False for has, need in _NEEDS.items() if not baked[has]})
        if not second:
            baked["DELTA_PASS"] = False
        return KernelRequest("attention_wide" if wide else "attention", tuple(baked.items()))

    @staticmethod
    def linear(strict: bool, decay: bool) -> KernelRequest:
        """Chunkwise linear attention, with or without a decay gate."""
        return KernelRequest("linear", (("HAS_DECAY", decay), ("STRICT", strict)))

    @staticmethod
    def pointwise(strict: bool, row_bias: bool, key_bias: bool, alibi: bool, self_bias: bool, weight: str,
                  weight_grad: str, reference: str, wide: bool = False) -> KernelRequest:
        """Context sums of w(s_ij) v_j with these score terms: `weight` and `weight_grad` the bodies of w and w'
        (statements in `x`, printed from the energy: `pointwise_weights.py`), `reference` w in torch; `wide`:
        the feature-tiled kernels (widths above 256)."""
        baked = dict(STRICT=strict, HAS_RB=row_bias, HAS_KB=key_bias, HAS_ALIBI=alibi, HAS_SELF=self_bias)
        baked.update({need: False for has, need in _NEEDS.items() if has in baked and not baked[has]})
        return KernelRequest("pointwise_wide" if wide else "pointwise", tuple(baked.items()),
                             (("WEIGHT", weight), ("WEIGHT_GRAD", weight_grad)), reference)

    @staticmethod
    def gated(label: str, act_and_grad: str, reference: str, value: bool) -> KernelRequest:
        """The gated epilogue value * G(pre) (G(pre) alone without a `value`): `act_and_grad` the body returning
        (G(x), G'(x)) printed from the energy (`gated_epilogue.py`), in place of the templates' activation
        table; `label` names G at the call, `reference` is G in torch."""
        return KernelRequest("gated", (("ACT", label), ("HAS_VALUE", value)), (("_act_and_grad", act_and_grad),),
                             reference)

    @staticmethod
    def momentum() -> KernelRequest:
        """The fused momentum step m = beta m + f, x = x + eta m (nothing to bake: beta and eta are tensors)."""
        return KernelRequest("momentum", ())

    @staticmethod
    def nesterov() -> KernelRequest:
        """The fused look-ahead x + c m where nag evaluates its force (nothing to bake: c is a tensor)."""
        return KernelRequest("nesterov", ())

    @property
    def name(self) -> str:
        """The op set's identifier in the generated file (and its torch.library prefix)."""
        return f"{self.family}_{self.tag}"

    @property
    def tag(self) -> str:
        """Short and stable: the family, its baked values and the templates' own source."""
        generated = (self.functions, self.reference) if self.functions else ()  # (other families' tags unchanged)
        text = repr((self.family, self.baked, *generated, _templates_hash(self.family)))
        return hashlib.sha256(text.encode()).hexdigest()[:8]


_NEEDS = {"HAS_ALIBI": "NEED_ALIBI", "HAS_SELF": "NEED_SELF", "HAS_KB": "NEED_KB"}


@dataclass(frozen=True)
class Family:
    """Where a family's templates live and what the generated file calls (modules of energydsl/kernels/)."""

    templates: tuple[str, ...]  # the modules whose text holds the @triton.jit templates
    ops: str  # the module exporting the op-set constructor
    builder: str  # that constructor, taking the kernels in `kernels` order
    helpers: tuple[str, ...]  # @triton.jit functions the kernels call
    kernels: tuple[str, ...]  # the launched kernels


FAMILIES = {
    "attention": Family(("attention_kernels",), "attention", "attention_ops",
                        ("_scores", "_key_blocks", "_query_blocks"),
                        ("_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel")),
    # feature widths above 256 (CEM's exact diagonal term): the same scores, every feature axis tiled
    "attention_wide": Family(("attention_kernels", "attention_wide_kernels"), "attention", "attention_wide_ops",
                             ("_scores", "_key_blocks", "_query_blocks", "_tile_dots", "_zero_rows",
                              "_add_products"),
                             ("_fwd_wide_kernel", "_bwd_dkdv_wide_kernel", "_bwd_dq_wide_kernel")),
    # element-wise weights of the score, no normalisation (sigmoid attention); the weight functions generated
    "pointwise": Family(("pointwise_kernels",), "pointwise", "pointwise_ops",
                        ("_pointwise_scores", "_score_terms", "_rows", "_head", "_in_context",
                         "_pointwise_blocks"),
                        ("_pointwise_fwd_kernel", "_pointwise_bwd_dkdv_kernel", "_pointwise_bwd_dq_kernel")),
    # widths above 256: the same scores, every feature axis tiled
    "pointwise_wide": Family(("attention_wide_kernels", "pointwise_kernels", "pointwise_wide_kernels"), "pointwise",
                             "pointwise_wide_ops", ("_tile_dots", "_zero_rows", "_add_products", "_score_terms",
                                                    "_wide_scores", "_head", "_in_context", "_pointwise_blocks"),
                             ("_pointwise_fwd_wide_kernel", "_pointwise_bwd_dkdv_wide_kernel",
                              "_pointwise_bwd_dq_wide_kernel")),
    "linear": Family(("linear",), "linear", "linear_attention_ops", (),
                     ("_state_kernel", "_fwd_kernel", "_bwd_dqk_kernel", "_bwd_dv_kernel")),
    # the element-wise epilogues: value * G(pre) with G printed from the energy; the heavy-ball step and
    # nag's look-ahead as they are
    "gated": Family(("epilogue_kernels",), "epilogue", "gated_activation_ops", ("_act_and_grad",),
                    ("_gated_fwd_kernel", "_gated_bwd_kernel")),
    "momentum": Family(("epilogue_kernels",), "epilogue", "momentum_ops", (),
                       ("_momentum_fwd_kernel", "_momentum_bwd_kernel")),
    "nesterov": Family(("epilogue_kernels",), "epilogue", "nesterov_ops", (),
                       ("_nesterov_fwd_kernel", "_nesterov_bwd_kernel")),
}


@functools.cache
def _definitions(module: str) -> dict[str, ast.FunctionDef]:
    """The top-level functions of energydsl/kernels/<module>.py, read as text: generating a file for the
    triton backend needs no triton (and no GPU) on this machine."""
    tree = ast.parse((Path(__file__).resolve().parent.parent / "kernels" / f"{module}.py").read_text())
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}


def _templates(family: str) -> dict[str, ast.FunctionDef]:
    fam = FAMILIES[family]
    defs = {name: d for module in fam.templates for name, d in _definitions(module).items()}
    return {name: defs[name] for name in (*fam.helpers, *fam.kernels)}


@functools.cache
def _templates_hash(family: str) -> str:
    src = "".join(ast.unparse(t) for t in _templates(family).values())
    return hashlib.sha256(src.encode()).hexdigest()[:12]


def kernel_imports(requests: list[KernelRequest]) -> list[str]:
    """The import lines the kernels section needs."""
    if not requests:
        return []
    families = [FAMILIES[f] for f in dict.fromkeys(r.family for r in requests)]
    return ["import triton", "import triton.language as tl",
            *(f"from energydsl.kernels.{fam.ops} import {fam.builder}" for fam in families)]


def kernel_source(requests: list[KernelRequest]) -> list[str]:
    """The lines of the kernels section: for each request its specialised templates and its op set."""
    lines: list[str] = []
    for req in dict.fromkeys(requests):  # each specialisation once, in first-use order
        fam = FAMILIES[req.family]
        templates = _templates(req.family)
        names = {name: f"{name}_{req.tag}" for name in templates}
        baked = dict(req.baked)
        flags = ", ".join(f"{k}={v}" for k, v in req.baked  # not those the others imply
                          if not k.startswith("NEED_") and k != "DELTA_PASS")
        where = ", ".join(f"energydsl/kernels/{m}.py" for m in fam.templates)
        header = f"{req.family} kernels" + (f" for {flags}" if flags else "")
        lines += [f"# --- {header}:", f"#     {where}" + (", specialised" if flags else ""), ""]
        constants: dict[str, Any] = dict(baked)
        replaced = {param: body for param, body in req.functions if param in templates}
        for param, body in req.functions:  # generated functions first, baked in as the name they are defined by
            if param not in replaced:
                name = f"_{param.lower()}_{req.tag}"
                lines += _jit_function(name, body)
                constants[param] = ast.Name(name, ast.Load())
        for template, t in templates.items():
            if template in replaced:  # a helper the energy's own function stands in for (its baked arguments gone)
                lines += _jit_function(names[template], replaced[template],
                                       [a.arg for a in t.args.args if a.arg not in constants])
            else:
                lines += [specialise(t, constants, names, templates), "", ""]
        kernels = ", ".join(names[k] for k in fam.kernels)
        reference = f", reference=lambda x: {req.reference}" if req.reference else ""
        lines += [wrap_long_lines(f"{req.name} = {fam.builder}({req.name!r}, {kernels}, {baked!r}{reference})"),
                  "", ""]
    return lines


def _jit_function(name: str, body: str, params: list[str] | None = None) -> list[str]:
    """The lines of a generated `@triton.jit` function (of `x` unless `params` say otherwise)."""
    return ["@triton.jit", f"def {name}({', '.join(params or ['x'])}):", textwrap.indent(body, "    "), "", ""]


def specialise(fn: ast.FunctionDef | Callable[..., Any], constants: dict[str, Any], names: dict[str, str],
               siblings: dict[str, ast.FunctionDef] | None = None) -> str:
    """`fn`'s source with the parameters in `constants` replaced by their values and dead branches removed.

    `names` renames `fn` and the `siblings` it calls (templates specialised alongside it); the arguments a
    sibling no longer takes are dropped where it is called. `fn` is a parsed definition or a plain function.
    """
    if not isinstance(fn, ast.FunctionDef):
        fn = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
        assert isinstance(fn, ast.FunctionDef)
    func = copy.deepcopy(fn)  # the parsed templates are cached: never edit them in place
    func.args.args = [a for a in func.args.args if a.arg not in constants]
    func.name = names.get(func.name, func.name)
    callees = {names[n]: [a.arg for a in d.args.args] for n, d in (siblings or {}).items() if n in names}
    _Specialiser(constants, names, callees).visit(func)
    _drop_dead_stores(func)
    for node in ast.walk(func):  # a block whose every statement was a removed branch
        if getattr(node, "body", None) == []:
            node.body = [ast.Pass()]
    ast.fix_missing_locations(func)
    return wrap_long_lines(ast.unparse(func))


def _drop_dead_stores(func: ast.FunctionDef) -> None:
    """Remove `name = ...` and `name += ...` where nothing reads `name` any more (only the removed branches
    did: `h = bh % H` without a position bias, a bias gradient's accumulator without that bias), until none
    is left, since one removal can orphan another. A kernel's right-hand sides are loads, arithmetic and
    `tl.zeros`: no side effects are lost."""
    removed = True
    while removed:
        read = {n.id for n in ast.walk(func) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        removed = False
        for node in ast.walk(func):
            for field in ("body", "orelse"):
                stmts = getattr(node, field, None)
                if isinstance(stmts, list) and any(_dead(st, read) for st in stmts):
                    setattr(node, field, [st for st in stmts if not _dead(st, read)])
                    removed = True


def _dead(stmt: ast.stmt, read: set[str]) -> bool:
    """An assignment (or augmented one) to names none of which is in `read`."""
    if isinstance(stmt, ast.AugAssign):
        return isinstance(stmt.target, ast.Name) and stmt.target.id not in read
    if not isinstance(stmt, ast.Assign):
        return False
    names = [t for target in stmt.targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
    return all(isinstance(t, ast.Name) and t.id not in read for t in names)


WIDTH = 110  # generated kernels: a statement longer than this is written one argument per line


def wrap_long_lines(source: str) -> str:
    """`ast.unparse` writes every statement on one line; a long `def` header or call statement is split here,
    one parameter or argument per line (a long argument that is itself a call or a dict, likewise). Lines of
    multi-line strings (docstrings) stay, and so does the code: if the result does not parse to the same tree,
    `source` is returned unchanged."""
    tree = ast.parse(source)
    in_string = {n for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
                 and (node.end_lineno or node.lineno) > node.lineno
                 for n in range(node.lineno, (node.end_lineno or node.lineno) + 1)}
    out = []
    for number, line in enumerate(source.splitlines(), start=1):
        body = line.lstrip()
        indent = line[: len(line) - len(body)]
        long = len(line) > WIDTH and number not in in_string
        out.append((_wrapped(body, indent) if long else None) or line)
    result = "\n".join(out)
    return result if ast.dump(ast.parse(result)) == ast.dump(tree) else source


def _wrapped(statement: str, indent: str) -> str | None:
    """`statement` (one line, no indent) as a multi-line call or header, or None if it is neither."""
    is_def = statement.startswith("def ") and statement.endswith(":")
    try:
        tree = ast.parse(statement + " pass" if is_def else statement).body
    except SyntaxError:  # a compound statement's header
        return None
    if len(tree) != 1:
        return None
    node = tree[0]
    if isinstance(node, ast.FunctionDef):
        args = node.args.args
        defaults = [None] * (len(args) - len(node.args.defaults)) + list(node.args.defaults)
        params = [ast.unparse(a) + ("" if d is None else (" = " if a.annotation else "=") + ast.unparse(d))
                  for a, d in zip(args, defaults, strict=True)]
        return f"{indent}def {node.name}(" + _items(params, indent) + "):"
    match node:
        case ast.Assign(targets=[target], value=ast.Call() as call):
            prefix = f"{ast.unparse(target)} = "
        case ast.AugAssign(target=target, op=op, value=ast.Call() as call):
            prefix = f"{ast.unparse(target)} {_AUG[type(op)]}= "
        case ast.Expr(value=ast.Call() as call) | ast.Return(value=ast.Call() as call):
            prefix = "return " if isinstance(node, ast.Return) else ""
        case _:
            return None
    return indent + prefix + _split(call, indent)


def _split(node: ast.expr, indent: str) -> str:
    """A call or dict with one item per line, nested ones split the same way where still too long."""
    inner = indent + "    "

    def item(value: ast.expr, prefix: str = "") -> str:
        text = prefix + ast.unparse(value)
        if len(inner + text) > WIDTH and isinstance(value, (ast.Call, ast.Dict)):
            return prefix + _split(value, inner)
        return text

    if isinstance(node, ast.Dict):
        pairs = [item(v, f"{ast.unparse(k)}: ") for k, v in zip(node.keys, node.values, strict=True) if k]
        return "{" + _items(pairs, indent) + "}"
    assert isinstance(node, ast.Call)
    args = [item(a) for a in node.args] + [item(k.value, f"{k.arg}=") for k in node.keywords]
    return f"{ast.unparse(node.func)}(" + _items(args, indent) + ")"


def _items(items: list[str], indent: str) -> str:
    return "\n" + "".join(f"{indent}    {x},\n" for x in items) + indent


_AUG = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


class _NotConstant(Exception):
    pass


def _value(node: ast.expr) -> Any:
    """The value of an expression built from constants with not / and / or / == / !=, else _NotConstant."""
    match node:
        case ast.Constant(value=v):
            return v
        case ast.UnaryOp(op=ast.Not(), operand=x):
            return not _value(x)
        case ast.BoolOp(op=ast.And(), values=xs):
            return all(_value(x) for x in xs)
        case ast.BoolOp(op=ast.Or(), values=xs):
            return any(_value(x) for x in xs)
        case ast.Compare(left=a, ops=[ast.Eq()], comparators=[b]):
            return _value(a) == _value(b)
        case ast.Compare(left=a, ops=[ast.NotEq()], comparators=[b]):
            return _value(a) != _value(b)
    raise _NotConstant


class _Specialiser(ast.NodeTransformer):
    def __init__(self, constants: dict[str, Any], names: dict[str, str], callees: dict[str, list[str]]):
        self.constants, self.names, self.callees = constants, names, callees

    def visit_Name(self, node: ast.Name) -> ast.expr:
        if isinstance(node.ctx, ast.Load) and node.id in self.constants:
            value = self.constants[node.id]
            new = copy.copy(value) if isinstance(value, ast.expr) else ast.Constant(value)  # a name: a function
            return ast.copy_location(new, node)
        return node

    def visit_If(self, node: ast.If) -> Any:
        self.generic_visit(node)
        try:
            taken = node.body if _value(node.test) else node.orelse
        except _NotConstant:
            return node
        return taken or None  # a list splices the branch in; None removes the statement

    def visit_BoolOp(self, node: ast.BoolOp) -> ast.expr:
        """`True and x` is x, `False and x` is False (dually for or), so half-known tests still simplify."""
        self.generic_visit(node)
        absorbing = isinstance(node.op, ast.Or)  # the value that decides the whole expression
        kept = []
        for x in node.values:
            try:
                if bool(_value(x)) == absorbing:
                    return ast.Constant(absorbing)
            except _NotConstant:
                kept.append(x)
        if not kept:
            return ast.Constant(not absorbing)
        return kept[0] if len(kept) == 1 else ast.BoolOp(op=node.op, values=kept)

    def visit_IfExp(self, node: ast.IfExp) -> ast.expr:
        self.generic_visit(node)
        try:
            return node.body if _value(node.test) else node.orelse
        except _NotConstant:
            return node

    def visit_Call(self, node: ast.Call) -> ast.Call:
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id in self.names:
            node.func.id = self.names[node.func.id]
            params = self.callees[node.func.id]
            node.args = [a for p, a in zip(params, node.args, strict=False) if p not in self.constants]
            node.keywords = [k for k in node.keywords if k.arg not in self.constants]
        return node
