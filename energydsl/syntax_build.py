"""Building the syntax tree: lark's parse tree of `grammars/energy.lark` to the nodes of `syntax_tree.py`.

One transformer callback per grammar rule, each attaching the source span. `syntax.parse_text` runs it once the
text has parsed; kept apart from the reading, limits and imports there, and from the node types.
"""

from __future__ import annotations

import math
import re
import sys
from typing import Any

from lark import Transformer, v_args

from .errors import Span, SpecError
from .python_names import API_ARGUMENTS
from .syntax_tree import (
    BinOp,
    BlockDecl,
    Call,
    Clause,
    EnergyDecl,
    Hole,
    Index,
    Integral,
    KwArg,
    ModelDecl,
    Name,
    Neg,
    Num,
    OptCall,
    OptHole,
    Reduce,
    SearchDecl,
    StageRef,
    Transpose,
)


def _binary(op: str):
    """A transformer callback building `BinOp(op)`."""

    @v_args(meta=True)
    def build(self, meta, children):
        return BinOp(self._span(meta), op, children[0], children[1])

    return build


class _ToAst(Transformer):
    """Bottom-up conversion of lark trees into the nodes of `syntax_tree.py`."""

    def __init__(self, file: str, text: str):
        super().__init__()
        self.file = file
        self.text = text

    def _span(self, meta_or_tok: Any) -> Span:
        line = getattr(meta_or_tok, "line", None)
        col = getattr(meta_or_tok, "column", None)
        end_col = getattr(meta_or_tok, "end_column", None)
        end_line = getattr(meta_or_tok, "end_line", None)
        if end_line != line:
            end_col = None
        return Span(self.file, line or 1, col or 1, self.text, end_col)

    # expressions ---------------------------------------------------------
    def _float(self, tok: Any) -> float:
        """A NUMBER token's value; one too large for a float (`1e999`) is an error at the literal."""
        value = float(tok)
        if not math.isfinite(value):
            shown = tok if len(tok) <= 40 else f"{tok[:12]}…{tok[-12:]} ({len(tok)} characters)"
            raise SpecError(f"number too large: {shown}", self._span(tok),
                            f"numbers must be below {sys.float_info.max:.4g}")
        return value

    @v_args(meta=True)
    def number(self, meta, children):
        return Num(self._span(meta), self._float(children[0]))

    @v_args(meta=True)
    def name(self, meta, children):
        return Name(self._span(meta), str(children[0]))

    add, sub, mul, div, matmul, dot, pow = (_binary(o) for o in ["+", "-", "*", "/", "@", ".", "^"])

    @v_args(meta=True)
    def neg(self, meta, children):
        return Neg(self._span(meta), children[0])

    @v_args(meta=True)
    def transpose(self, meta, children):
        return Transpose(self._span(meta), children[0])

    @v_args(meta=True)
    def index(self, meta, children):
        return Index(self._span(meta), children[0], tuple(children[1]))

    def names(self, children):
        return [str(c) for c in children]

    @v_args(meta=True)
    def reduce(self, meta, children):
        return Reduce(self._span(meta), str(children[0]), tuple(children[1]), children[2])

    @v_args(meta=True)
    def call(self, meta, children):
        args = tuple(c for c in children[1:] if c is not None)
        return Call(self._span(meta), str(children[0]), args)

    @v_args(meta=True)
    def integral(self, meta, children):
        return Integral(self._span(meta), str(children[0]), children[1])

    @v_args(meta=True)
    def choice_hole(self, meta, children):
        return Hole(self._span(meta), "choice", tuple(children))

    @v_args(meta=True)
    def int_hole(self, meta, children):
        return Hole(self._span(meta), "int", (), children[0], children[1])

    @v_args(meta=True)
    def float_hole(self, meta, children):
        return Hole(self._span(meta), "float", (), children[0], children[1], children[2] is not None)

    def bound(self, children):
        sign, number = children
        return -self._float(number) if sign is not None else self._float(number)

    # energy clauses ------------------------------------------------------
    @v_args(meta=True)
    def header_item(self, meta, children):
        return (str(children[0]), children[1], self._span(children[0]))

    def header(self, children):
        items = [c for c in children if c is not None]
        _refuse_repeats([(name, span) for name, _, span in items], "in the header")
        for name, _, span in items:
            if name in API_ARGUMENTS:
                raise SpecError(f"`{name}` is an argument of the Python API's calls beside the dims "
                                f"(`.module(name, backend, device=..., dtype=..., **dims)`), so a dim cannot take it",
                                span, f"rename it (`n_{name}`, say)")
        return [(name, value) for name, value, _ in items]

    def dims(self, children):
        return list(children)

    @v_args(meta=True)
    def dim_clause(self, meta, c):
        return Clause("dim", self._span(meta), str(c[0]), c[1])

    @v_args(meta=True)
    def state_clause(self, meta, c):
        extra = {}
        if c[2] is not None:
            extra = {"via": str(c[3]), "via_expr": c[4]}
        return Clause("state", self._span(meta), str(c[0]), c[1], extra)

    @v_args(meta=True)
    def input_clause(self, meta, c):
        return Clause("input", self._span(meta), str(c[0]), c[1])

    @v_args(meta=True)
    def context_clause(self, meta, c):
        return Clause(
            "context", self._span(meta), str(c[0]), c[2],
            {"index": str(c[1]), "lhs": str(c[3]), "relation": str(c[4]), "rhs": str(c[5]),
             "index_span": self._span(c[1])},
        )

    @v_args(meta=True)
    def param_clause(self, meta, c):
        options = [o for o in c[2:] if o is not None]
        return Clause("param", self._span(meta), str(c[0]), c[1] or [], {"options": options})

    @v_args(meta=True)
    def init_call(self, meta, c):
        return ("init", str(c[0]), [a for a in c[1:] if a is not None], self._span(meta))

    @v_args(meta=True)
    def init_value(self, meta, c):
        return ("value", c[0], self._span(meta))

    @v_args(meta=True)
    def constraint_interval(self, meta, c):
        return ("interval", c[0], c[1], self._span(meta))

    def flag(self, c):
        return ("flag", str(c[0]), self._span(c[0]))

    @v_args(meta=True)
    def let_clause(self, meta, c):
        return Clause("let", self._span(meta), str(c[0]), c[2], {"indices": c[1] or []})

    @v_args(meta=True)
    def local_clause(self, meta, c):
        return Clause("local", self._span(meta), str(c[0]), c[2], {"indices": c[1] or []})

    @v_args(meta=True)
    def global_clause(self, meta, c):
        return Clause("global", self._span(meta), str(c[0]), c[1])

    @v_args(meta=True)
    def kwarg(self, meta, c):
        return KwArg(str(c[0]), c[1], str(c[2]) if c[2] is not None else None, self._span(meta))

    @v_args(meta=True)
    def opt_call(self, meta, c):
        kwargs = [k for k in c[1:] if k is not None]
        _refuse_repeats([(k.name, k.span) for k in kwargs], f"in `{c[0]}(...)`")
        return OptCall(str(c[0]), kwargs, self._span(meta), has_parens=len(c) > 1)

    @v_args(meta=True)
    def opt_hole(self, meta, c):
        return OptHole(list(c), self._span(meta))

    @v_args(meta=True)
    def steps(self, meta, c):
        return ("steps", c[0], self._span(meta))

    @v_args(meta=True)
    def per_head(self, meta, c):
        return ("per_head", True, self._span(meta))

    @v_args(meta=True)
    def wrt(self, meta, c):
        return ("wrt", str(c[0]), self._span(meta))

    @v_args(meta=True)
    def precondition(self, meta, c):
        return ("precondition", c[0], self._span(meta))

    @v_args(meta=True)
    def optimizer_clause(self, meta, c):
        mods: dict[str, Any] = {}
        spans: dict[str, Span] = {}  # each modifier's own span, for errors about it (`wrt h`)
        for kind, value, span in c[1:]:
            if kind in mods:
                raise SpecError(f"`{kind.replace('_', ' ')}` given twice in one optimizer clause", span)
            mods[kind] = value
            spans[kind] = span
        mods["spans"] = spans
        return Clause("optimizer", self._span(meta), "", c[0], mods)

    @v_args(meta=True)
    def untie_rule(self, meta, c):
        return (c[0], c[1], self._span(meta))

    @v_args(meta=True)
    def untie_clause(self, meta, c):
        return Clause("untie", self._span(meta), "", [r for r in c[1:]], {"value_only": True})

    @v_args(meta=True)
    def expect_clause(self, meta, c):
        return Clause("expect", self._span(meta), str(c[0]), c[1])

    @v_args(meta=True)
    def energy_decl(self, meta, c):
        header = c[1] or []
        clauses = list(c[2:])
        src = self.text[meta.start_pos : meta.end_pos] if hasattr(meta, "start_pos") else ""
        return EnergyDecl(str(c[0]), header, clauses, self._span(c[0]), src)

    # composition ---------------------------------------------------------
    @v_args(meta=True)
    def named_arg(self, meta, c):
        return (str(c[0]), c[1], self._span(c[0]))

    def arg(self, c):
        return (None, c[0], c[0].span)

    @v_args(meta=True)
    def stage_ref(self, meta, c):
        args = [a for a in c[1:] if a is not None]
        _refuse_repeats([(key, span) for key, _, span in args if key is not None], f"in `{c[0]}(...)`")
        for (key, _, _), (later, _, span) in zip(args, args[1:]):
            if key is not None and later is None:
                raise SpecError(f"a dim of `{c[0]}` given by position after one given by name", span,
                                "give dims by position first, then by name (as Python's arguments)")
        return StageRef(str(c[0]), [(key, value) for key, value, _ in args], self._span(meta))

    def summed(self, c):
        return list(c)

    def pipeline(self, c):
        return list(c)

    @v_args(meta=True)
    def block_decl(self, meta, c):
        return BlockDecl(str(c[0]), c[1], self._span(c[0]))

    @v_args(meta=True)
    def stream(self, meta, c):
        return Clause("stream", self._span(meta), "", c[0])

    def rank_option(self, c):
        return c[0]

    @v_args(meta=True)
    def embed(self, meta, c):
        return Clause("embed", self._span(meta), "", c[0], {"rank": c[1]})

    @v_args(meta=True)
    def layer(self, meta, c):
        return Clause("layer", self._span(meta), "", c[0])

    @v_args(meta=True)
    def repeat(self, meta, c):
        return Clause("repeat", self._span(meta), "", c[0], {"shared": c[1] is not None})

    @v_args(meta=True)
    def across(self, meta, c):
        return Clause("across", self._span(meta), "", c[0])

    def norm_where(self, c):
        return "stage"

    @v_args(meta=True)
    def norm(self, meta, c):
        where = "layer" if re.search(r"each\s+layer", self.text[meta.start_pos : meta.end_pos]) else "stage"
        return Clause("norm", self._span(meta), str(c[0]), where)

    @v_args(meta=True)
    def final_norm(self, meta, c):
        return Clause("final_norm", self._span(meta), str(c[0]))

    @v_args(meta=True)
    def head(self, meta, c):
        return Clause("head", self._span(meta), "", str(c[0]), {"rank": c[1]})

    @v_args(meta=True)
    def model_decl(self, meta, c):
        return ModelDecl(str(c[0]), c[1] or [], list(c[2:]), self._span(c[0]))

    # search --------------------------------------------------------------
    @v_args(meta=True)
    def search_model(self, meta, c):
        return Clause("model", self._span(meta), "", c[0])

    @v_args(meta=True)
    def search_energy(self, meta, c):
        return Clause("energy", self._span(meta), "", c[0])

    @v_args(meta=True)
    def search_optimizer(self, meta, c):
        return Clause("optimizer", self._span(meta), str(c[0]), c[1])

    @v_args(meta=True)
    def search_precondition(self, meta, c):
        return Clause("precondition", self._span(meta), str(c[0]), c[1])

    @v_args(meta=True)
    def search_data(self, meta, c):
        return Clause("data", self._span(meta), str(c[0]), c[1])

    @v_args(meta=True)
    def search_train(self, meta, c):
        return Clause("train", self._span(meta), "", list(c))

    def objective(self, c):
        return (str(c[0]), str(c[1]))

    @v_args(meta=True)
    def objectives(self, meta, c):
        return Clause("objective", self._span(meta), "", list(c))

    @v_args(meta=True)
    def trials(self, meta, c):
        return Clause("trials", self._span(meta), "", c[0])

    @v_args(meta=True)
    def search_decl(self, meta, c):
        return SearchDecl(str(c[0]), list(c[1:]), self._span(c[0]))

    @v_args(meta=True)
    def import_decl(self, meta, c):
        return ("import", str(c[0])[1:-1], self._span(meta))

    def start(self, c):
        return list(c)


def _refuse_repeats(named: list[tuple[str, Span]], where: str) -> None:
    """A name given twice in one list (a header's dims, a call's keywords) is an error at the second, not the
    last value silently winning."""
    first: dict[str, Span] = {}
    for name, span in named:
        if name in first:
            raise SpecError(f"`{name}` is given twice {where} (first at {first[name]})", span)
        first[name] = span
