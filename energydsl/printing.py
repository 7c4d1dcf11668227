"""Printers: IR expressions as text, LaTeX, Markdown and MathML.

One small visitor walks the tree; a `Style` says how each construct looks in one format. Scalar
coefficients are SymPy expressions and go through SymPy's own printers.
"""

from __future__ import annotations

import functools
import html
import re
import unicodedata

import sympy as sp

from . import ir
from .functions import REGISTRY
from .number_text import round_digits

UPDATED = "⁺"  # the mark of a value after this step's assignment: `m_z⁺`
GREEK = {"eta": "η", "beta": "β", "tau": "τ", "lambda": "λ", "gamma": "γ", "alpha": "α", "sigma": "σ"}


@functools.lru_cache(maxsize=4)
def _antiderivatives(size: int) -> dict[str, str]:
    """{f': f} over the function registry; `size` keys the cache, since derivatives are registered as first met."""
    return {f.derivative: f.name for f in list(REGISTRY.values()) if f.derivative and f.derivative != f.name}


def shown_function(name: str) -> str:
    """How the text printer writes a registry function: a derivative as f' (`sqrt'`, `silu''`, not the registry's
    `dsqrt`, `dsilu'`), an antiderivative as ∫f (`int_silu` -> `∫silu`); others by name."""
    if name.startswith("int_"):
        return "∫" + name.removeprefix("int_")
    of = _antiderivatives(len(REGISTRY))
    primes = ""
    # only the registry's own spellings of a derivative, `d` + f or f + `'` (cos, sin's derivative, stays cos)
    while (base := of.get(name)) is not None and name in (f"d{base}", f"{base}'"):
        name, primes = base, primes + "'"  # f'' is the derivative of f': back to the function the spec wrote
    return name + primes


def readable(v: sp.Expr) -> sp.Expr:
    """A spec's decimal as written: a fraction whose denominator is over a million prints as a decimal (1/3 and
    1/1000000 stay), and a Float (a long literal, `0.8224670334241132`) with every digit it holds, not SymPy's 15."""
    def decimal(r: sp.Rational | sp.Float) -> sp.Float:
        shortest = repr(float(r))  # Python's shortest round-trip digits, as many as SymPy then prints
        digits = len(re.sub(r"\D", "", shortest.split("e")[0]).lstrip("0")) or 1
        return sp.Float(float(r) if isinstance(r, sp.Float) else r, digits)

    v = sp.sympify(v)
    big = {r: decimal(r) for r in v.atoms(sp.Rational) if r.q > 10**6}
    big |= {f: decimal(f) for f in v.atoms(sp.Float) if f.is_finite}
    big |= {n: sp.Float(n, max(digits, 2)) for n in v.atoms(sp.Integer)
            if (digits := round_digits(int(n))) is not None}  # `1e300`: 1.0e+300, not 301 digits
    v = v.xreplace(big) if big else v
    # softplus of a scalar is SymPy's log(exp(x) + 1): named as the preconditioner tables (and a tensor's) write it
    return v.replace(lambda e: isinstance(e, sp.log) and _softplus_arg(e.args[0]) is not None,
                     lambda e: _SOFTPLUS(_softplus_arg(e.args[0])))


_SOFTPLUS = sp.Function("softplus")


def _softplus_arg(e: sp.Expr) -> sp.Expr | None:
    """x where `e` is exp(x) + 1, else None."""
    if isinstance(e, sp.Add) and len(e.args) == 2 and sp.S.One in e.args:
        other = e.args[0] if e.args[1] == sp.S.One else e.args[1]
        return other.args[0] if isinstance(other, sp.exp) else None
    return None


class Style:
    name = "text"

    def scalar(self, v: sp.Expr) -> str:
        text = sp.sstr(readable(v)).replace("**", "^")  # powers as the language writes them
        return re.sub(r"\b(" + "|".join(GREEK) + r")\b", lambda m: GREEK[m[0]], text)  # not "beta" -> "bη"

    def name_(self, n: str, sub: list[str]) -> str:
        """A name with its index subscripts; `z⁺` (a value an earlier assignment updated) keeps its mark."""
        return self.updated(self.plain_name(n[:-1], sub)) if n.endswith(UPDATED) else self.plain_name(n, sub)

    def plain_name(self, n: str, sub: list[str]) -> str:
        n = GREEK.get(n, n)
        return n + ("_" + ",".join(sub) if sub else "")

    def updated(self, s: str) -> str:
        return s + UPDATED

    def entry(self, body: str, sub: list[str]) -> str:
        """An entry of a value that is not a name, `body` already printed in parentheses: (W x)_k."""
        return body + "_" + ",".join(sub)

    def pos(self, idx: str | None) -> str:
        return idx or "i"

    def sum_(self, idx: str, rel: str, body: str) -> str:
        return f"Σ_{{{idx}{rel}}} {body}"

    def op(self, name: str, idx: str, rel: str, body: str) -> str:
        return f"{name}_{{{idx}{rel}}}({body})"

    def softmax(self, idx: str, rel: str, body: str) -> str:
        return f"softmax_{idx}({body})"

    def paren(self, s: str) -> str:
        return f"({s})"

    def join_mul(self, parts: list[str]) -> str:
        return " ".join(parts)

    def hadamard(self, parts: list[str]) -> str:
        """An element-wise product of tensors: never juxtaposed, which reads as a matrix product."""
        return " ⊙ ".join(parts)

    def matmul(self, a: str, b: str) -> str:
        return f"{a} {b}"

    def dot(self, a: str, b: str) -> str:
        return f"⟨{a}, {b}⟩"

    def outer(self, a: str, b: str) -> str:
        return f"{a} {b}ᵀ"

    def transpose(self, a: str) -> str:
        return f"{a}ᵀ"

    def func(self, name: str, a: str) -> str:
        return f"{shown_function(name)}({a})"

    def position(self, back: bool, pos: str, base: str) -> str:
        """rope's subscript: the position (`-i` for the rotation back) and a base other than RoFormer's."""
        return f"{'-' if back else ''}{pos}{f', {base}' if base else ''}"

    def power(self, a: str, e: str) -> str:
        # a symbolic exponent in parentheses: `x^p - 1` would read as (x^p) - 1, and `x^T` as a transpose
        return f"{a}^{e}" if re.fullmatch(r"-?[0-9.]+", e) else f"{a}^({e})"

    def inverse(self, a: str) -> str:
        return f"({a})⁻¹"

    def reciprocal(self, a: str) -> str:
        """Each entry's reciprocal (Hadamard inverse): `⁻¹` alone reads as a matrix inverse."""
        return f"({a})^∘-1"

    def add(self, terms: list[str]) -> str:
        out = terms[0]
        for t in terms[1:]:
            out += f" − {t[1:].lstrip()}" if t.startswith("-") else f" + {t}"
        return out

    def neg(self, s: str) -> str:
        return "-" + s

    def ones(self, tensor: bool) -> str:
        return "𝟙" if tensor else "1"  # a tensor of ones is not the number 1: Hᵀ 𝟙 sums H's rows

    def eye(self) -> str:
        return "I"

    def count(self, idx: str, at_least_one: bool = False) -> str:
        return f"max(|{idx}|, 1)" if at_least_one else f"|{idx}|"

    def diag(self, a: str) -> str:
        return f"diag({a})"

    def stopgrad(self, a: str) -> str:
        return f"sg({a})"

    def sumall(self, a: str) -> str:
        return f"Σ({a})"

    def assign(self, lhs: str, rhs: str) -> str:
        return f"{lhs} ← {rhs}"


class LatexStyle(Style):
    name = "latex"

    def scalar(self, v: sp.Expr) -> str:
        """A number or a scalar expression of dims and scalar params, whose names read as every other name does
        (SymPy writes `heads` as h·e·a·d·s, `s_ff` as s with subscript ff and `eta2` as η₂)."""
        v = readable(v)
        names = {s: self.plain_name(s.name, []) for s in v.free_symbols if isinstance(s, sp.Symbol) and len(s.name) > 1}
        return sp.latex(v, symbol_names=names)

    def plain_name(self, n: str, sub: list[str]) -> str:
        if n.startswith("∇_"):  # a gradient folded into a later equation: ∇_u E
            point, energy = n[2:].split(" ", 1)
            return f"\\nabla_{{{self.name_(point, [])}}} {self.name_(energy, [])}"
        base = "\\" + n if n in GREEK else None  # the names the text printer writes as Greek letters
        if base is None:  # `W1_{k}`, not `W_{1,k}`, which reads as an entry of W
            base = n if len(n) == 1 else "\\mathrm{" + n.replace("_", "\\_") + "}"
        return base + ("_{" + ",".join(sub) + "}" if sub else "")

    def updated(self, s):
        return f"{{{s}}}^{{+}}"

    def entry(self, body: str, sub: list[str]) -> str:
        return "{" + body + "}_{" + ",".join(sub) + "}"

    @staticmethod
    def _rel(rel: str) -> str:
        return rel.replace("<=", " \\le ").replace("<", " < ") if "<=" in rel else rel.replace("<", " < ")

    def sum_(self, idx, rel, body):
        return f"\\sum_{{{idx}{self._rel(rel)}}} {body}"

    def op(self, name, idx, rel, body):  # `prod_others`: its `_` would start a subscript
        name = name.replace("_", "\\_")
        return f"\\operatorname{{{name}}}_{{{idx}{self._rel(rel)}}}\\left({body}\\right)"

    def softmax(self, idx, rel, body):
        return f"\\operatorname{{softmax}}_{{{idx}}}\\left({body}\\right)"

    def paren(self, s):
        return f"\\left({s}\\right)"

    def hadamard(self, parts):
        return " \\odot ".join(parts)

    def ones(self, tensor):
        return "\\mathbf{1}" if tensor else "1"

    def dot(self, a, b):
        return f"\\langle {a}, {b} \\rangle"

    def outer(self, a, b):
        return f"{a} {b}^{{\\top}}"

    def transpose(self, a):
        return f"{a}^{{\\top}}"

    def func(self, name, a):
        fn = REGISTRY.get(name)
        head = fn.latex if fn is not None and fn.latex else f"\\operatorname{{{name}}}"
        return f"{head}\\left({a}\\right)"

    def power(self, a, e):
        return f"{{{a}}}^{{{e}}}"

    def inverse(self, a):
        return f"\\left({a}\\right)^{{-1}}"

    def reciprocal(self, a):
        return f"\\left({a}\\right)^{{\\circ -1}}"

    def neg(self, s):
        return "-" + s

    def add(self, terms):
        out = terms[0]
        for t in terms[1:]:
            out += f" - {t[1:]}" if t.startswith("-") else f" + {t}"
        return out

    def count(self, idx, at_least_one=False):
        return f"\\max(|{idx}|, 1)" if at_least_one else f"|{idx}|"

    def diag(self, a):
        return f"\\operatorname{{diag}}\\left({a}\\right)"

    def stopgrad(self, a):
        return f"\\operatorname{{sg}}\\left({a}\\right)"

    def sumall(self, a):
        return f"{{\\textstyle\\sum}}\\left({a}\\right)"

    def assign(self, lhs, rhs):
        return f"{lhs} \\leftarrow {rhs}"


_TEX_CAPITALS = {"GAMMA", "DELTA", "THETA", "LAMDA", "XI", "PI", "SIGMA", "UPSILON", "PHI", "PSI", "OMEGA"}
_LATIN_LOOKALIKES = {"ALPHA": "A", "BETA": "B", "EPSILON": "E", "ZETA": "Z", "ETA": "H", "IOTA": "I", "KAPPA": "K",
                     "MU": "M", "NU": "N", "OMICRON": "O", "RHO": "P", "TAU": "T", "CHI": "X"}


def _tex_letter(letter: re.Match) -> str:
    name = unicodedata.name(letter[0], "").removeprefix("GREEK ")
    small, word = name.startswith("SMALL LETTER "), name.split(" LETTER ")[-1]
    word = {"LAMDA": "LAMBDA", "FINAL SIGMA": "VARSIGMA"}.get(word, word) if small else word
    if small:
        return "o" if word == "OMICRON" else "{\\" + word.lower() + "}"
    if word in _TEX_CAPITALS:
        return "{\\" + ("Lambda" if word == "LAMDA" else word.capitalize()) + "}"
    return "\\mathrm{" + _LATIN_LOOKALIKES.get(word, letter[0]) + "}"


def tex_greek(tex: str) -> str:
    """A Greek letter a spec names a dim, param or index with (`τ`, `Λ`) as its LaTeX command (`{\\tau}`,
    `{\\Lambda}`): pdflatex stops at a raw `τ` in math mode."""
    return re.sub("[\u0391-\u03a9\u03b1-\u03c9]", _tex_letter, tex)


_XML_UNDEFINED_ENTITY = re.compile(r"&(?!(?:amp|lt|gt|quot|apos);)([A-Za-z][A-Za-z0-9]*;)")


def _code_points(entity: re.Match) -> str:
    """An HTML entity as numeric character references (XML defines only five named ones)."""
    text = html.entities.html5.get(entity.group(1))
    return "".join(f"&#x{ord(c):X};" for c in text) if text else entity.group(0)


class MathMLStyle(Style):
    """Presentation MathML: renders in any modern browser with no network."""

    name = "mathml"

    def scalar(self, v):
        # SymPy writes HTML entities (&InvisibleTimes;, &ExponentialE; of exp(x), &ImaginaryI;) that XML does not
        # define: their code points parse
        # a name whole, as the other formats write it: `s_ff`, not s with subscript ff, and `eta2`, not η₂
        return _XML_UNDEFINED_ENTITY.sub(_code_points, sp.mathml(readable(v), printer="presentation",
                                                                 disable_split_super_sub=True))

    def plain_name(self, n, sub):
        if n.startswith("∇_"):  # a gradient folded into a later equation: ∇_u E
            point, energy = n[2:].split(" ", 1)
            return f"<mrow><msub><mi>∇</mi>{self.name_(point, [])}</msub>{self.name_(energy, [])}</mrow>"
        base = f"<mi>{html.escape(GREEK.get(n, n))}</mi>"
        return f"<msub>{base}<mrow><mi>{','.join(sub)}</mi></mrow></msub>" if sub else base

    def entry(self, body, sub):
        return f"<msub><mrow>{body}</mrow><mrow><mi>{','.join(sub)}</mi></mrow></msub>"

    def pos(self, idx):
        return f"<mi>{idx or 'i'}</mi>"

    def _range(self, idx, rel):
        """`j ≤ i` / `j < i` under a reduction over the context, the bare index otherwise (or rope's position,
        markup already: `position`)."""
        if idx.startswith("<mrow>"):
            return idx
        if not rel:
            return f"<mi>{idx}</mi>"
        op = "≤" if rel.startswith("<=") else "&lt;"
        return f"<mrow><mi>{idx}</mi><mo>{op}</mo><mi>{html.escape(rel.lstrip('<='))}</mi></mrow>"

    def sum_(self, idx, rel, body):
        return f"<mrow><munder><mo>∑</mo>{self._range(idx, rel)}</munder>{body}</mrow>"

    def op(self, name, idx, rel, body):
        return f"<mrow><msub><mi>{name}</mi>{self._range(idx, rel)}</msub><mo>(</mo>{body}<mo>)</mo></mrow>"

    def softmax(self, idx, rel, body):
        return self.op("softmax", idx, rel, body)

    def paren(self, s):
        return f"<mrow><mo>(</mo>{s}<mo>)</mo></mrow>"

    def join_mul(self, parts):
        return "<mrow>" + "<mo>&#x2062;</mo>".join(parts) + "</mrow>"

    def matmul(self, a, b):
        return f"<mrow>{a}<mo>&#x2062;</mo>{b}</mrow>"

    def hadamard(self, parts):
        return "<mrow>" + "<mo>⊙</mo>".join(parts) + "</mrow>"

    def updated(self, s):
        return f"<msup><mrow>{s}</mrow><mo>+</mo></msup>"

    def dot(self, a, b):
        return f"<mrow><mo>⟨</mo>{a}<mo>,</mo>{b}<mo>⟩</mo></mrow>"

    def outer(self, a, b):
        return f"<mrow>{a}<msup>{b}<mi>⊤</mi></msup></mrow>"

    def transpose(self, a):
        return f"<msup>{a}<mi>⊤</mi></msup>"

    def position(self, back, pos, base):
        return f"<mrow>{'<mo>-</mo>' if back else ''}{pos}{f'<mo>,</mo>{base}' if base else ''}</mrow>"

    def func(self, name, a):  # as the text printer names it: `∫silu`, `gelu'`, not the registry's int_silu, dgelu
        return f"<mrow><mi>{html.escape(shown_function(name))}</mi><mo>(</mo>{a}<mo>)</mo></mrow>"

    def power(self, a, e):
        return f"<msup>{a}{e}</msup>"

    def inverse(self, a):
        return f"<msup>{self.paren(a)}<mn>-1</mn></msup>"

    def reciprocal(self, a):
        return f"<msup>{self.paren(a)}<mrow><mo>∘</mo><mn>-1</mn></mrow></msup>"

    NEG = "<mrow><mo>−</mo>"  # how `neg` opens; `add` writes such a term as a subtraction

    def add(self, terms):
        out = terms[0]
        for t in terms[1:]:
            if t.startswith(self.NEG):
                out += f"<mo>−</mo>{t[len(self.NEG):-len('</mrow>')]}"
            else:
                out += f"<mo>+</mo>{t}"
        return f"<mrow>{out}</mrow>"

    def neg(self, s):
        return f"{self.NEG}{s}</mrow>"  # a minus sign outside <mo> is no operator to a MathML renderer

    def ones(self, tensor):
        return '<mn mathvariant="bold">1</mn>' if tensor else "<mn>1</mn>"

    def eye(self):
        return "<mi>I</mi>"

    def count(self, idx, at_least_one=False):
        n = f"<mrow><mo>|</mo><mi>{idx}</mi><mo>|</mo></mrow>"
        return f"<mrow><mi>max</mi><mo>(</mo>{n}<mo>,</mo><mn>1</mn><mo>)</mo></mrow>" if at_least_one else n

    def diag(self, a):
        return self.func("diag", a)

    def stopgrad(self, a):
        return self.func("sg", a)

    def sumall(self, a):
        return f"<mrow><mo>∑</mo>{a}</mrow>"

    def assign(self, lhs, rhs):
        return f"<mrow>{lhs}<mo>←</mo>{rhs}</mrow>"


class RegistryStyle(Style):
    """Text with the functions' registry names (`dgelu`, not `gelu'`): a label the generated code names a fused
    activation by, as a single function's own name is."""

    def func(self, name: str, a: str) -> str:
        return f"{name}({a})"


STYLES = {"text": Style(), "latex": LatexStyle(), "mathml": MathMLStyle(), "markdown": LatexStyle(),
          "registry": RegistryStyle()}


NAME = "name"  # the role of a variable that stands for an earlier equation's right-hand side


def _flat_parts(e: ir.Add | ir.Mul) -> list[ir.Expr]:
    """A sum's terms (a product's factors), through sums (products) nested in it: a gradient built as
    `a + (z − h)` reads as the flat `a + z − h` a later equation holds."""
    return [p for c in e.children for p in (_flat_parts(c) if type(c) is type(e) else [c])]


def fold(e: ir.Expr, body: ir.Expr, name: str | ir.Expr) -> ir.Expr:
    """`e` with every occurrence of `body` replaced by a variable called `name` (or by the expression `name`: a
    norm's own variable, which the gradient is written in, or NAG's call `D(z − β m_z)`), for reading only.

    An earlier equation's right-hand side shows as its left-hand side in later ones (`x⁺ = x − η D`,
    not D written out again). A sum (product) folds where its terms (factors) are among a larger one's."""
    if isinstance(body, ir.Index) or (not body.children and getattr(body, "role", "") != NAME):
        return e  # `∇ = z`: renaming every z would mislead (a name for a name, `D = ∇_z F`, folds)
    named = ir.Var(name, NAME, body.shape) if isinstance(name, str) else name
    negated = ir.neg(body)  # the constructors pull signs out: P (−g) is built as −(P g)
    parts = _flat_parts(body) if isinstance(body, (ir.Add, ir.Mul)) else None
    memo: dict[int, ir.Expr] = {}

    def visit(x: ir.Expr) -> ir.Expr:
        hit = memo.get(id(x))
        if hit is not None:
            return hit
        if x == body:
            hit = named
        elif x == negated:
            hit = ir.neg(named)
        elif not x.children:
            hit = x
        else:
            kids = [visit(c) for c in x.children]
            if parts is not None and type(x) is type(body):
                rest = list(kids)
                if all(p in rest and not rest.remove(p) for p in parts):  # a sum keeps the first term's place
                    at = kids.index(parts[0]) if isinstance(x, ir.Add) else len(rest)
                    kids = [*rest[:at], named, *rest[at:]]
            hit = x if all(k is c for k, c in zip(kids, x.children)) and len(kids) == len(x.children) \
                else ir.rebuild(x, kids)
        memo[id(x)] = hit
        return hit

    return visit(e)


WHERE_MIN_CHARS = 16  # a repeat written out in fewer characters reads better as it is (`abs(i − j)`, `W1_k z`)
# A repeat of more nodes written out than this is sized as this many characters a node, not printed: its text,
# a tree over a DAG, can be exponentially long (a Newton step through layernorm, taylor 3: 24 GB). Every example's
# repeats are far smaller, so they are sized by their text as before.
WHERE_PRINT_NODES = 4_000
WHERE_CHARS_PER_NODE = 4


def name_repeats(exprs: list[ir.Expr], index_order: list[str], context: set[str], taken: set[str],
                 min_chars: int = WHERE_MIN_CHARS) -> tuple[list[ir.Expr], list[tuple[ir.Expr, ir.Expr]]]:
    """Name the sub-expressions `exprs` repeat, for reading only: returns `exprs` with each written by its
    name, and the definitions (`name`, body), each after the ones it uses.

    The largest repeat is named first and the rest recounted, so a part that occurs only inside a named
    one stays written out in that one's definition. A name carries its free indices as subscripts
    (`p_k,j = softmax_j(...)`): softmax weights are `p`, sums over a `context` index `m`, anything else
    `t`, numbered when there are several and never one of `taken`. Sizes are as printed (in text), up to
    `WHERE_PRINT_NODES` nodes."""
    def indexed(name: str, body: ir.Expr) -> ir.Expr:
        """A name standing for `body`, with `body`'s free indices (a sum over j of it still depends on j)."""
        free = sorted(body.free, key=lambda i: (index_order.index(i) if i in index_order else len(index_order), i))
        out: ir.Expr = ir.Var(name, NAME, (sp.Integer(1),) * len(free) + body.shape)
        for i in free:
            out = ir.Index(out, i)
        return out

    lets: list[tuple[ir.Expr, ir.Expr]] = []  # (body, placeholder), largest first
    exprs = list(exprs)
    printed: dict[ir.Expr, int] = {}  # a sub-expression's printed length, kept across the rounds

    def size(x: ir.Expr) -> int:
        if x not in printed:
            nodes = x.tree_size
            printed[x] = len(show(x)) if nodes <= WHERE_PRINT_NODES else WHERE_CHARS_PER_NODE * nodes
        return printed[x]

    while True:
        counts = ir.occurrences([*exprs, *(body for body, _ in lets)])
        repeats = [(size(x), x) for x, n in counts.items()
                   if n > 1 and x.children and not _is_name(x) and not isinstance(x, ir.Scalar)]
        repeats = [(size, x) for size, x in repeats if size >= min_chars]
        if not repeats:
            break
        body = max(repeats, key=lambda r: r[0])[1]
        placeholder = indexed(f"__where{len(lets)}", body)
        exprs = [ir.substitute(e, {body: placeholder}) for e in exprs]
        lets = [(ir.substitute(b, {body: placeholder}), v) for b, v in lets] + [(body, placeholder)]
    lets.reverse()  # the smaller ones first: a definition uses only names defined above it

    def kind(body: ir.Expr) -> str:
        if isinstance(body, ir.Softmax):
            return "p"
        return "m" if isinstance(body, ir.Reduce) and body.op == "sum" and body.index in context else "t"

    kinds = [kind(body) for body, _ in lets]
    numbered: dict[str, int] = {}
    names: dict[ir.Expr, ir.Expr] = {}
    for (body, placeholder), k in zip(lets, kinds):
        several = kinds.count(k) > 1 or k in taken
        n = numbered.get(k, 0) + 1
        while several and f"{k}{n}" in taken:
            n += 1
        numbered[k] = n
        names[placeholder] = indexed(f"{k}{n}" if several else k, body)
    return ([ir.substitute(e, names) for e in exprs],
            [(names[placeholder], ir.substitute(body, names)) for body, placeholder in lets])


def _is_name(x: ir.Expr) -> bool:
    """A name `fold` or `name_repeats` wrote (its index subscripts included)."""
    while isinstance(x, ir.Index):
        x = x.base
    return isinstance(x, ir.Var) and x.role == NAME


def by_name(v: sp.Expr) -> sp.Expr:
    """`v` with symbols of one name made one: a dim that sets the optimizer's η (`gd(eta = eta)`) is the same
    number as η, so `η η` reads η². (Semantics refuses a dim under η's name that is another number.)"""
    return v.xreplace({s: sp.Symbol(s.name) for s in v.free_symbols if s.is_Symbol})


def _counts_cancelled(factors: list[ir.Expr], rel: dict[str, str]) -> list[ir.Expr]:
    """A mean's divisor max(|k|, 1) is |k| where k's range is never empty (heads, `j <= i`), as `count` prints
    it; there it cancels the count of a sum it multiplies: `3 |k| (|k|)^-1 z` reads `3 z`."""
    def plain(u: ir.Expr) -> ir.Expr:
        if isinstance(u, ir.Pow) and isinstance(u.base, ir.Count):
            return ir.Pow(plain(u.base), u.exponent)
        if isinstance(u, ir.Count) and u.at_least_one and rel.get(u.index) != "<i":
            return ir.Count(u.index)
        return u

    out = ir.cancel_reciprocals([plain(u) for u in factors])
    return factors if len(out) == len(factors) else out


def _applied(value: sp.Expr) -> bool:
    """A scalar printed as one function application, `softplus(P_s)`: no parentheses needed around it."""
    return isinstance(value, sp.Function) and not isinstance(value, sp.Piecewise)


def show(e: ir.Expr, style: Style | str = "text", relations: dict[str, str] | None = None) -> str:
    """Print an IR expression. `relations` maps context indices to their relation text (e.g. '<=i')."""
    st = STYLES[style] if isinstance(style, str) else style
    rel = relations or {}

    def atomic(x: ir.Expr, postfix: bool = False) -> bool:
        if postfix and isinstance(x, ir.Var) and x.name.startswith("∇_"):  # two symbols: `(∇_Z F)ᵀ`, not `∇_Z Fᵀ`
            return False
        return isinstance(x, (ir.Var, ir.Index, ir.Pos, ir.Softmax, ir.ProdOthers, ir.Decay, ir.Rope, ir.Func, ir.Let,
                              ir.Transpose, ir.Dot, ir.Ones, ir.Identity)) or (
            isinstance(x, ir.Scalar) and (x.value.is_Atom or _applied(x.value)))

    def wrap(x: ir.Expr, postfix: bool = False) -> str:
        """`x` in parentheses unless it reads as one symbol; `postfix`: before a transpose or a power."""
        s = p(x)
        return s if atomic(x, postfix) else st.paren(s)

    memo: dict[int, tuple[ir.Expr, str]] = {}  # x kept alive with its text: `printed` makes temporary nodes

    def p(x: ir.Expr) -> str:
        """Each shared sub-expression printed once (`printed`: the IR is a DAG)."""
        hit = memo.get(id(x))
        if hit is None:
            hit = memo[id(x)] = (x, printed(x))
        return hit[1]

    def printed(x: ir.Expr) -> str:
        match x:
            case ir.Scalar():
                return st.scalar(by_name(x.value))
            case ir.Var():
                return st.name_(x.name, [x.index] if x.index else [])
            case ir.Index():
                subs: list[str] = []
                base = x
                while isinstance(base, ir.Index):
                    subs.insert(0, base.index)
                    base = base.base
                if isinstance(base, ir.Var):  # a context token keeps its own index first: h_{j,k}
                    return st.name_(base.name, [base.index, *subs] if base.index else subs)
                return st.entry(st.paren(p(base)), subs)  # (W x)_k, not W x_k
            case ir.Let():
                return p(x.body)
            case ir.Pos():
                return st.pos(x.index)
            case ir.Ones():
                return st.ones(bool(x.shape))
            case ir.Identity():
                return st.eye()
            case ir.Count():
                # a mean's divisor differs from the count only where the context can be empty
                return st.count(x.index, x.at_least_one and rel.get(x.index) == "<i")
            case ir.Add():
                return st.add([p(t) for t in x.terms])
            case ir.Mul():
                factors = _counts_cancelled(list(x.factors), rel)
                if len(factors) < 2:
                    return p(factors[0]) if factors else st.scalar(sp.Integer(1))
                sign = ""
                if isinstance(factors[0], ir.Scalar) and factors[0].value.could_extract_minus_sign():
                    sign = "-"
                    factors[0] = ir.Scalar(-factors[0].value)
                    if factors[0].value == 1:
                        factors = factors[1:]
                parts = [wrap(f) for f in factors if not f.shape]
                tensors = [wrap(f) for f in factors if f.shape]
                if len(tensors) > 1:
                    tensors = [st.hadamard(tensors)]
                parts += tensors
                out = st.join_mul(parts) if len(parts) > 1 else parts[0]
                return st.neg(out) if sign else out
            case ir.Pow():
                if x.exponent == -1:
                    return (st.reciprocal(p(x.base)) if x.base.shape
                            else st.power(wrap(x.base, postfix=True), st.scalar(sp.Integer(-1))))
                return st.power(wrap(x.base, postfix=True), st.scalar(by_name(x.exponent)))
            case ir.MatMul():
                return st.matmul(wrap(x.a), wrap(x.b))
            case ir.Dot():
                return st.dot(p(x.a), p(x.b))
            case ir.Outer():
                return st.outer(wrap(x.a), wrap(x.b, postfix=True))
            case ir.Transpose():
                return st.transpose(wrap(x.a, postfix=True))
            case ir.Func():
                return st.func(x.name, p(x.arg))
            case ir.SumAll():
                return st.sumall(p(x.a))
            case ir.Reduce():
                if x.op == "sum":
                    return st.sum_(x.index, rel.get(x.index, ""), wrap(x.body))
                return st.op(x.op, x.index, rel.get(x.index, ""), p(x.body))
            case ir.Softmax():
                return st.softmax(x.index, rel.get(x.index, ""), p(x.body))
            case ir.ProdOthers():  # prod's gradient: the product over the index's other values
                return st.op("prod_others", x.index, rel.get(x.index, ""), p(x.body))
            case ir.Rope():  # the rotation by a position, or back (the gradient's transpose)
                base = "" if x.base == 10000 else st.scalar(x.base)  # RoFormer's base is not printed
                return st.op("rope", st.position(x.sign < 0, p(x.pos), base), "", p(x.a))
            case ir.Decay():  # the product of the rate over the tokens after j up to i
                return st.op("decay", x.index, "", p(x.body))
            case ir.StopGrad():
                return st.stopgrad(p(x.a))
            case ir.Diag():
                return st.diag(p(x.a))
            case ir.Inverse():
                return st.inverse(p(x.a))
        return type(x).__name__

    return p(e)


def mathml_block(body: str) -> str:
    return f'<math xmlns="http://www.w3.org/1998/Math/MathML" display="block">{body}</math>'
