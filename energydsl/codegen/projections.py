"""One GEMM for the projections of one input: `F.linear(h, Wv)` and `F.linear(h, Wk)` become one product.

The lowering writes each projection as its own `F.linear`, as the derivation names them: a softmax attention
layer projects its queries, keys and values in three matrix products, six more in the backward, where
nanoGPT's `c_attn` does one and two. This pass merges the projections of one block of straight-line code whose
inputs may be the same tensor into one call of `runtime.ops.projections`, which concatenates the weights of
each distinct input and runs one `F.linear` per input. The parameters stay what they are (names, shapes, state
dicts): only the products are grouped.

Whether two inputs are the same tensor is often known only at run time: the context `h` is the state `x` when
`forward` is given no context, and the state `z` is `x` before the first step. The caller names such
candidates (`roots`, name -> the tensor it may be); the op groups by identity, so a layer given a separate
context still runs one product per distinct input. Like `hoist.py`, the pass works on the generated lines:
each is a pure assignment, so the lines may be reordered along their dependencies.
"""

from __future__ import annotations

import ast
import heapq
from dataclasses import dataclass

from .hoist import line_names

__all__ = ["fuse_biases", "fuse_projections"]

COMMENT = "  # one GEMM per distinct input: the weights concatenated"


@dataclass
class _Projection:
    """One `target = F.linear(operand, weight)<suffix>` line."""

    index: int
    target: str
    operand: str
    weight: str
    suffix: ast.expr | None  # the line's value with the product replaced by a placeholder Name, or None


def _linear(node: ast.expr) -> ast.Call | None:
    """`F.linear(name, w)`, the base of a method chain (`F.linear(h, w).unflatten(-1, (2, -1))`), or None."""
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if isinstance(node.func.value, ast.Name) and node.func.value.id == "F" and node.func.attr == "linear":
            ok = len(node.args) == 2 and not node.keywords and isinstance(node.args[0], ast.Name)
            return node if ok else None
        node = node.func.value
    return None


def _assignment(body: list[ast.stmt]) -> ast.Assign | None:
    """The line's one statement when it is `name = value`, else None."""
    if len(body) != 1 or not isinstance(body[0], ast.Assign) or len(body[0].targets) != 1:
        return None
    return body[0] if isinstance(body[0].targets[0], ast.Name) else None


def _projection(index: int, line: str) -> _Projection | None:
    stmt = _assignment(ast.parse(line.strip()).body)
    if stmt is None or (call := _linear(stmt.value)) is None:
        return None
    suffix = None
    if call is not stmt.value:  # a method chain on the product: keep it, applied to the op's output
        parent = next(n for n in ast.walk(stmt.value) if isinstance(n, ast.Attribute) and n.value is call)
        parent.value = ast.Name("__product__", ast.Load())
        suffix = stmt.value
    return _Projection(index, stmt.targets[0].id, call.args[0].id, ast.unparse(call.args[1]), suffix)


def fuse_projections(lines: list[str], roots: dict[str, str], taken: set[str]) -> list[str]:
    """The block `lines` (one pure assignment each, in order) with the projections of each root merged.

    `roots` maps a name to the tensor it may be at run time (`{"h": "x", "z": "x"}`); other operands are their
    own root. `taken` holds the names the surrounding code uses, so the temporaries this pass adds (`p0`, ...)
    shadow nothing; they are added to it. A projection joins its root's group only when it does not read an
    earlier member's result, directly or through other lines: the group's one call comes before its readers.
    """
    before: list[set[int]] = []  # the lines each line must follow: it reads their value, or overwrites a name
    writer: dict[str, int] = {}  # they use
    readers: dict[str, list[int]] = {}
    for i, line in enumerate(lines):
        reads, writes = line_names(ast.parse(line.strip()).body)
        before.append({writer[n] for n in reads if n in writer})
        for n in writes:
            before[i] |= {j for j in [*readers.pop(n, []), writer.get(n, i)] if j != i}
            writer[n] = i
        for n in reads:
            readers.setdefault(n, []).append(i)
    ancestors: list[set[int]] = []  # every line a line depends on, directly or through others
    for deps in before:
        ancestors.append(deps.union(*(ancestors[j] for j in deps)))
    groups: dict[str, list[_Projection]] = {}
    for i, line in enumerate(lines):
        if (p := _projection(i, line)) is not None:
            group = groups.setdefault(roots.get(p.operand, p.operand), [])
            if not any(q.index in ancestors[i] for q in group):
                group.append(p)
    fused = {i: g for g in groups.values() if len(g) > 1 for i in (p.index for p in g)}
    if not fused:
        return lines
    node = [fused[i][0].index if i in fused else i for i in range(len(lines))]  # a group: its first line
    waits = {n: set() for n in node}  # the dependencies with each group contracted onto one node
    for i, deps in enumerate(before):
        waits[node[i]] |= {node[j] for j in deps} - {node[i]}
    ready = [n for n, w in waits.items() if not w]
    heapq.heapify(ready)
    order = []  # a topological order, each line as early as its original place allows
    while ready:
        order.append(n := heapq.heappop(ready))
        for m, w in waits.items():
            if n in w:
                w.discard(n)
                if not w:
                    heapq.heappush(ready, m)
    out, fresh = [], (f"p{n}" for n in range(10_000) if f"p{n}" not in taken)
    for i in order:
        if i not in fused:
            out.append(lines[i])
            continue
        targets, after = [], []
        for p in fused[i]:
            if p.suffix is None:
                targets.append(p.target)
            else:
                name = next(fresh)
                taken.add(name)
                targets.append(name)
                chain = ast.unparse(p.suffix).replace("__product__", name)
                after.append(f"{p.target} = {chain}")
        pairs = ", ".join(f"{p.operand}, {p.weight}" for p in fused[i])
        out.append(f"{', '.join(targets)} = projections({pairs}){COMMENT}")
        out += after
    return out


def fuse_biases(lines: list[str], vectors: set[str]) -> list[str]:
    """`t = F.linear(v, W)` then `u = t + b[None, None]` (b one of `vectors`, the names of 1-d parameters; t read
    nowhere else) as `u = F.linear(v, W, b)`: the bias added in the GEMM (addmm) instead of an element-wise pass
    over the product (NRGPT's feed-forward layers). Projections merged into one call keep their additions."""
    parsed = [ast.parse(line.strip()).body for line in lines]
    reads = [line_names(body)[0] for body in parsed]
    out: list[str | None] = list(lines)
    for i, body in enumerate(parsed):
        product = _plain_linear(body)
        if product is None:
            continue
        target, operand, weight = product
        users = [j for j in range(i + 1, len(lines)) if target in reads[j]]
        added = _bias_added(parsed[users[0]], target) if len(users) == 1 else None
        if added is None or added[1] not in vectors:
            continue
        indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
        out[i] = f"{indent}{added[0]} = F.linear({operand}, {weight}, {added[1]})"
        out[users[0]] = None
    return [line for line in out if line is not None]


def _plain_linear(body: list[ast.stmt]) -> tuple[str, str, str] | None:
    """(t, v, W) for a line `t = F.linear(v, W)` and nothing more, else None."""
    stmt = _assignment(body)
    if stmt is None or _linear(stmt.value) is not stmt.value:
        return None
    return stmt.targets[0].id, stmt.value.args[0].id, ast.unparse(stmt.value.args[1])


def _bias_added(body: list[ast.stmt], product: str) -> tuple[str, str] | None:
    """(u, b) for a line `u = product + b[None, None]` (either order, b a name), else None."""
    stmt = _assignment(body)
    value = stmt.value if stmt is not None else None
    if not (isinstance(value, ast.BinOp) and isinstance(value.op, ast.Add)):
        return None
    for this, other in ((value.left, value.right), (value.right, value.left)):
        if isinstance(this, ast.Name) and this.id == product and ast.unparse(other).endswith("[None, None]") \
                and isinstance(other, ast.Subscript) and isinstance(other.value, ast.Name):
            return stmt.targets[0].id, other.value.id
    return None
