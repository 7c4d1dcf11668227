"""How a `search` declaration's clauses rewrite the declarations they name: each override is a placement (a
span of a file and the text that replaces it, with the holes in that text), checked as the language would
check it before any trial (a dim given twice, an unknown optimizer or keyword in a clause choice).

    model M(d = ...), energy E(heads = ...)   header_override: new defaults for header dims
    across layers X                           across_override: the model's `across layers` clause
    optimizer E: X, precondition E: X         optimizer_override: E's optimizer clause, its modifiers kept
"""

from __future__ import annotations

from collections.abc import Callable

import lark

from energydsl.clause_calls import ACROSS_LAYERS, OPTIMIZER, PRECONDITIONER, CallKind
from energydsl.errors import Span, SpecError
from energydsl.search.holes import (
    DEFAULT_OPTIMIZER,
    _Collector,
    _File,
    _Filler,
    _Hole,
    _kids,
    _Placement,
    _pos,
    _render,
    _value,
)


def header_override(sf: _File, ref: lark.Tree, kind: str, decls: dict[str, tuple[_File, lark.Tree]],
                    col: _Collector) -> list[_Placement]:
    """`model M(d = ...)` / `energy E(heads = ...)`: new defaults for the declaration's header dims."""
    target = str(ref.children[0])
    what = "model" if kind == "model_decl" else "energy"
    if target not in decls or decls[target][1].data != kind:
        raise SpecError(f"no {what} named `{target}`", sf.span(ref))
    tf, decl = decls[target]
    header = next((c for c in _kids(decl)[1:] if c.data == "header"), None)
    items = _kids(header) if header is not None else []
    names = [str(i.children[0]) for i in items]
    out = []
    given: set[str] = set()  # by position (the parser refuses a name given twice, or a position after a name)
    for i, arg in enumerate(_kids(ref)[1:]):
        if arg.data == "named_arg":
            dim, node = str(arg.children[0]), arg.children[1]
            if dim in given:
                raise SpecError(f"`{dim}` is given twice in `{target}(...)`: by position and by name",
                                sf.span(arg), f"{what} `{target}`'s dims in order: {', '.join(names)}")
        else:
            if i >= len(items):
                raise SpecError(f"{what} `{target}` has {len(items)} dims ({', '.join(names)})", sf.span(arg))
            dim, node = names[i], arg.children[0]
            given.add(dim)
        if dim not in names:
            raise SpecError(f"`{dim}` is not a dim of {what} `{target}`", sf.span(arg),
                            f"its dims: {', '.join(names) or 'none'}")
        item = items[names.index(dim)]
        s, e = _pos(item.children[1])
        v = _value(col, node, f"{target}.{dim}")
        out.append(_Placement(tf, s, e, v.holes, v.text, "search"))
    return out

def across_override(clause: lark.Tree, model: tuple[_File, lark.Tree], col: _Collector) -> _Placement:
    tf, decl = model
    name = str(decl.children[0])
    node = clause.children[0]
    _check_calls(col.file, node, ACROSS_LAYERS)
    if node.data == "opt_hole":
        hole = col.clause_hole(node, f"{name}.across", None, None)
        holes = [hole]

        def value(fl: _Filler) -> str:
            return fl.value(hole)
    else:
        v = _value(col, node, f"{name}.across")
        holes = v.holes
        fixed_none = str(node.children[0]) == "none"

        def value(fl: _Filler) -> str:
            return "" if fixed_none else v.text(fl)
    existing = next((c for c in _kids(decl)[1:] if c.data == "across"), None)
    if existing is not None:
        s, e = _pos(existing)
        return _Placement(tf, s, e, holes, lambda fl: (lambda t: f"across layers {t}" if t else "")(value(fl)),
                          "search")
    at = _pos(decl)[1] - 1  # before the closing brace
    return _Placement(tf, at, at, holes, lambda fl: (lambda t: f"  across layers {t}\n" if t else "")(value(fl)),
                      "search")

def optimizer_override(energy: tuple[_File, lark.Tree], opt: tuple[lark.Tree, Span] | None,
                       pre: tuple[lark.Tree, Span] | None, col: _Collector) -> _Placement:
    """Rebuild energy E's optimizer clause from the search's optimizer and/or preconditioner choice, the
    clause's other parts (and their holes) kept."""
    tf, decl = energy
    name = str(decl.children[0])
    tc = _Collector(tf)
    clause = next((c for c in _kids(decl)[1:] if c.data == "optimizer_clause"), None)
    holes: list[_Hole] = []
    parts: list[Callable[[_Filler], str]] = []  # modifiers other than precondition

    def node_value(collector: _Collector, node: lark.Tree, hole_name: str, none_text: str | None,
                   kind: CallKind = OPTIMIZER) -> tuple[list[_Hole], Callable[[_Filler], str]]:
        _check_calls(collector.file, node, kind)
        if node.data == "opt_hole":
            h = collector.clause_hole(node, hole_name, None, none_text)
            return [h], lambda fl: fl.value(h)
        s, e = _pos(node)
        hs = collector.call_holes(node, hole_name)
        is_none = str(node.children[0]) == "none"
        f = collector.file
        return hs, lambda fl: (none_text or "") if is_none else _render(f, s, e, hs, fl)

    call: Callable[[_Filler], str] = lambda fl: DEFAULT_OPTIMIZER
    precond: Callable[[_Filler], str] = lambda fl: ""
    if clause is not None:
        first, *mods = _kids(clause)
        hs, call = node_value(tc, first, f"{name}.optimizer", DEFAULT_OPTIMIZER)
        holes += hs
        for m in mods:
            if m.data == "precondition":
                hs, precond = node_value(tc, m.children[0], f"{name}.precondition", None, PRECONDITIONER)
            else:
                s, e = _pos(m)
                hs = tc.holes(m, f"{name}.{m.data}")
                parts.append(lambda fl, s=s, e=e, hs=hs: _render(tf, s, e, hs, fl))
            holes += hs
    if opt is not None:
        holes = [h for h in holes if not h.name.startswith(f"{name}.optimizer")]
        hs, call = node_value(col, opt[0], f"{name}.optimizer", DEFAULT_OPTIMIZER)
        holes += hs
    if pre is not None:
        holes = [h for h in holes if not h.name.startswith(f"{name}.precondition")]
        hs, precond = node_value(col, pre[0], f"{name}.precondition", None, PRECONDITIONER)
        holes += hs

    def render(fl: _Filler) -> str:
        text = "optimizer " + call(fl) + "".join(" " + p(fl) for p in parts)
        p = precond(fl)
        return text + (f", precondition {p}" if p else "")

    if clause is not None:
        s, e = _pos(clause)
        return _Placement(tf, s, e, holes, render, "search")
    at = _pos(decl)[1] - 1
    return _Placement(tf, at, at, holes, lambda fl: f"  {render(fl)}\n", "search")


def step_claims_dropped(energy: tuple[_File, lark.Tree]) -> list[_Placement]:
    """Deletions of the `expect update` and `expect direction` clauses of an energy whose optimizer or
    preconditioner the search replaces: they state what the declared one does, so every candidate with another
    would be refuted (invalid). `expect gradient` does not depend on the optimizer and stays."""
    tf, decl = energy
    out = []
    for clause in _kids(decl)[1:]:
        if clause.data == "expect_clause" and str(clause.children[0]) in ("update", "direction"):
            s, e = _pos(clause)
            out.append(_Placement(tf, s, e, [], lambda _fl: "", "delete"))
    return out


def _check_calls(file: _File, node: lark.Tree, kind: CallKind) -> None:
    """A clause's call, or each option of its `choice{...}`, as the language checks it (a known name, keywords
    it takes): a misspelt option is refused at load, not found trial by trial as pruned candidates."""
    for call in _kids(node) if node.data == "opt_hole" else [node]:
        name = str(call.children[0])
        if name != "none":  # no clause (the language's default optimizer)
            kind.check(name, file.span(call.children[0]),
                       [(str(kw.children[0]), file.span(kw)) for kw in _kids(call)[1:]])
