"""Composition: `block` and `model` declarations resolved into a plan and a networkx graph.

A model is a stack of layers; a layer is a pipeline of stages (`A -> B`); a stage is one energy, or
the sum of several (`A + B`: one optimizer step on F_A + F_B). The plan fixes every size; the runtime
(`energydsl.runtime.model`) builds the nn.Module from it, and `energy graph` prints the graph.

Stage arguments are matched to the energy's header dims, positionally or by name; a header dim the
stage does not set takes the model's dim of the same name, if there is one, else its own default.
The residual stream is a vector [d] unless the model declares `stream [dk, dv]` (RMT's matrix per token);
`embed ... rank R` and `head untied rank R` factorise the tables over a matrix stream (RMT eq. 18–19, 26–27).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import numbers
import operator
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import syntax as ast
from .clause_calls import ACROSS_LAYERS
from .errors import HoleError, Span, SpecError, UnknownName, UserError
from .number_text import is_count, plain_number

if TYPE_CHECKING:
    import networkx as nx

NORMS = ("layernorm", "rmsnorm")
# The largest size (an axis, a dim used as one, a number of layers) and the most entries of one tensor: a float64
# tensor's size in bytes must fit the platform's 64-bit index type (torch's int64), so it has fewer than 2**60
# entries. Checked where sizes are resolved, so that torch never sees a size it cannot hold (no C++ trace).
MAX_SIZE = 2**60 - 1
SIZE_LIMIT_HINT = ("a size, and the number of entries of any tensor it shapes, is at most 2**60 - 1 (about 1.2e18): "
                   "a tensor's size in bytes must fit the platform's 64-bit index type")
# `ModelPlan.graph` (and `energy graph`) draws up to this many layers one by one; a deeper stack, whose layers are
# identical, is drawn once as `layer × N` (a million layers drawn one by one took 75 s and 5 GiB, for a picture no
# one could read). Every model under examples/ (the RMT paper's 24 layers included) stays drawn in full.
GRAPH_LAYERS = 32


@dataclass
class StagePlan:
    """One stage: the energies it sums, with their dims, and the declaration the runtime derives."""

    label: str  # e.g. "MHA" or "NRGPTAttention+NRGPTFF"
    energies: list[tuple[str, dict[str, float]]]
    decl: ast.EnergyDecl = field(repr=False)  # the energy itself, or the merged sum (its syntax tree: long)
    dims: dict[str, float]  # the dims passed to the (merged) declaration
    span: Span | None = field(default=None, repr=False)


@dataclass
class ModelPlan:
    name: str
    dims: dict[str, float]
    vocab: int
    context: int
    d: int
    embed_positions: bool
    stages: list[StagePlan]  # one layer
    layers: int
    shared: bool
    across: tuple[str, dict[str, tuple[float, bool]]] | None  # (momentum|nag, {beta: (value, learn), eta: ...})
    norm: tuple[str, str] | None  # (layernorm|rmsnorm, stage|layer)
    final_norm: str | None
    head_tied: bool
    span: Span | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    stream: tuple[int, ...] = ()  # the stream's shape per token: (d,), or (dk, dv) for a matrix stream
    embed_rank: int | None = None  # `embed ... rank R`: Σ_h w_h ⊗ W_h[s] (keys [R, dk], tables [·, R, dv])
    head_rank: int | None = None  # the head's read rank: `head untied rank R`, or the embedding's when tied

    def __post_init__(self) -> None:
        if not self.stream:
            self.stream = (self.d,)

    def graph(self, unroll: int | None = GRAPH_LAYERS) -> nx.DiGraph:
        """tokens → embed → (norm →) stage → ... per layer → (final norm →) head → logits.

        A stack of more than `unroll` layers (None: no limit) is drawn as one layer, its nodes named `L*.…` and
        marked `repeat=N` (N layers), as is the graph itself (`g.graph["repeat"]`; 1 when every layer is drawn)."""
        import networkx as nx  # only here: importing it costs a search worker ~0.1 s

        if unroll is not None and not is_count(unroll):
            raise ValueError(f"unroll must be a whole number of layers, at least 1 (or None: all), not {unroll!r}")
        collapsed = unroll is not None and self.layers > unroll
        g = nx.DiGraph(name=self.name, repeat=self.layers if collapsed else 1)
        g.add_node("tokens", kind="input")
        g.add_node("embed", kind="embed", label=self.embed_label())
        g.add_edge("tokens", "embed")
        prev = "embed"
        labels = [stage.label for stage in self.stages]
        for layer in ["*"] if collapsed else range(self.layers):
            repeat = {"repeat": self.layers} if collapsed else {}
            for s, stage in enumerate(self.stages):
                # a stage its layer runs twice (`MLP -> MLP`) is a node per position, as the norms are
                node = f"L{layer}.{stage.label}" if labels.count(stage.label) == 1 else f"L{layer}.{s}.{stage.label}"
                weights = "shared" if self.shared else "per layer" if collapsed else f"layer {layer}"
                if self.norm and (self.norm[1] == "stage" or s == 0):
                    norm = f"L{layer}.{s}:{self.norm[0]}"  # `:`, never in a stage's name (an energy `layernorm`)
                    g.add_node(norm, kind="norm", label=self.norm[0], **repeat)
                    g.add_edge(prev, norm)
                    prev = norm
                energies = ", ".join(n for n, _ in stage.energies)
                g.add_node(node, kind="stage", label=stage.label, weights=weights, energies=energies, **repeat)
                g.add_edge(prev, node, across=self.across[0] if self.across else "residual")
                prev = node
        if self.final_norm:
            g.add_node("final_norm", kind="norm", label=self.final_norm)
            g.add_edge(prev, "final_norm")
            prev = "final_norm"
        g.add_node("head", kind="head", label=self.head_label())
        g.add_edge(prev, "head")
        g.add_node("logits", kind="output")
        g.add_edge("head", "logits")
        return g

    def embed_label(self) -> str:
        rank = f" rank {self.embed_rank}" if self.embed_rank else ""
        return "embed tokens" + (", positions" if self.embed_positions else "") + rank

    def head_label(self) -> str:
        rank = f" rank {self.head_rank}" if self.head_rank else ""
        return ("head tied" if self.head_tied else "head untied") + rank


_ARITHMETIC = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv, "^": operator.pow}


def evaluate_number(node: ast.Node, env: dict[str, float], what: str) -> float:
    """A size expression over known numbers (model dims): + - * / ^, sqrt, log, exp, min, max."""
    match node:
        case ast.Num(value=v):
            return float(v)
        case ast.Name(name=n):
            if n not in env:
                raise UnknownName(f"unknown name `{n}` in {what}", node.span,
                                  f"known here: {', '.join(sorted(env)) or 'nothing'}", n)
            return env[n]
        case ast.Neg(operand=a):
            return -evaluate_number(a, env, what)
        case ast.BinOp(op=op, left=a, right=b) if op in "+-*/^":
            x, y = evaluate_number(a, env, what), evaluate_number(b, env, what)
            if op == "/" and y == 0:
                raise SpecError(f"division by zero in {what}", node.span)
            try:  # only the operator asked for: x ** y of every sum overflows at ordinary widths
                value = _ARITHMETIC[op](x, y)
            except (OverflowError, ZeroDivisionError):
                raise SpecError(f"{what} overflows", node.span) from None
            if isinstance(value, complex):
                raise SpecError(f"{what} is not a real number", node.span)
            return float(value)
        case ast.Call(func=f, args=args) if f in ("sqrt", "log", "exp", "min", "max"):
            vals = [evaluate_number(a, env, what) for a in args]
            fn = {"sqrt": math.sqrt, "log": math.log, "exp": math.exp, "min": min, "max": max}[f]
            try:
                return float(fn(*vals))
            except (ValueError, OverflowError, TypeError):
                raise SpecError(f"{f}({', '.join(f'{v:g}' for v in vals)}) in {what} has no real value",
                                node.span) from None
        case ast.Hole():
            raise HoleError(f"a search hole in {what}: holes belong in a `search` space", node.span,
                            "run it with `energy search`, or write a number")
    raise SpecError(f"{what} must be a number built from dims", node.span)


def _dim_place(decl: ast.ModelDecl, key: str, overrides: dict[str, Any]) -> tuple[str, Span | None]:
    """How a message names header dim `key`, and where it points: at its default, unless a caller set it (then
    at the declaration, saying so)."""
    node = dict(decl.header).get(key)
    if key in overrides or node is None or node.span is None:
        return f"`{key}` (as set for model `{decl.name}`)" if key in overrides else f"`{key}`", decl.span
    set_here = sorted(_names_in(node) & set(overrides))  # a default computed from dims a caller set
    if set_here:
        given = ", ".join(f"{n}={overrides[n]:g}" for n in set_here)
        return f"`{key}` (from {given} as set for model `{decl.name}`)", node.span
    return f"`{key}`", node.span


def _whole(v: float, what: str, span: Span | None, low: int = 1) -> int:
    if not math.isfinite(v) or abs(v - round(v)) > 1e-9 or round(v) < low:
        raise SpecError(f"{what} must be a whole number ≥ {low}, got {plain_number(v)}", span)  # 128.000001, not 128
    if round(v) > MAX_SIZE:
        raise SpecError(f"{what} must be a whole number from {low} to 2**60 - 1, got {plain_number(v)}", span,
                        SIZE_LIMIT_HINT)
    return int(round(v))


def _check_entries(shape: tuple[int, ...], what: str, span: Span | None) -> None:
    """A tensor of the model (a table, the stream of a token) no larger than MAX_SIZE entries."""
    if math.prod(shape) > MAX_SIZE:
        raise SpecError(f"{what} [{', '.join(map(str, shape))}] has {math.prod(shape):.3g} entries, more than "
                        "2**60 - 1", span, SIZE_LIMIT_HINT)


def _stage_dims(decl: ast.EnergyDecl, ref: ast.StageRef, env: dict[str, float]) -> dict[str, float]:
    names = [n for n, _ in decl.header]
    dims: dict[str, float] = {n: env[n] for n in names if n in env}
    positional = [a for k, a in ref.args if k is None]
    if len(positional) > len(names):
        raise SpecError(f"`{ref.name}` takes at most {len(names)} dims ({', '.join(names)}), got {len(positional)}",
                        ref.span)
    for name, node in zip(names, positional):
        dims[name] = evaluate_number(node, env, f"the dim `{name}` of `{ref.name}`")
    for key, node in ref.args:
        if key is None:
            continue
        if key not in names:
            raise SpecError(f"`{ref.name}` has no dim `{key}`", node.span, f"its dims: {', '.join(names) or 'none'}")
        if key in names[:len(positional)]:
            raise SpecError(f"`{key}` is given twice in `{ref.name}(...)`: by position and by name", node.span,
                            f"`{ref.name}`'s dims in order: {', '.join(names)}")
        dims[key] = evaluate_number(node, env, f"the dim `{key}` of `{ref.name}`")
    return dims


Part = tuple[ast.EnergyDecl, dict[str, float], ast.StageRef]  # an energy of a stage, its dims, where it is named


def _expand(module: ast.Module, pipeline: list[list[ast.StageRef]], env: dict[str, float],
            seen: tuple[str, ...] = ()) -> list[tuple[list[Part], str | None]]:
    """A pipeline with blocks inlined: a list of stages, each the parts to sum and, for a sum that is a whole
    block (`block NRGPTBlock = A + B`), the block's name, which names the summed energy (else `A_B`)."""
    out: list[tuple[list[Part], str | None]] = []
    for summed in pipeline:
        parts: list[Part] = []
        for ref in summed:
            if ref.name in module.energies:
                decl = module.energies[ref.name]
                parts.append((decl, _stage_dims(decl, ref, env), ref))
            elif ref.name in module.blocks:
                if ref.name in seen:
                    cycle = " -> ".join(f"`{b}`" for b in (*seen[seen.index(ref.name):], ref.name))
                    what = "refers to itself" if seen[-1] == ref.name else f"is part of a cycle of blocks: {cycle}"
                    raise SpecError(f"block `{ref.name}` {what}", ref.span)
                if any(k is None for k, _ in ref.args):
                    raise SpecError(f"arguments of block `{ref.name}` must be named (they go to every energy with "
                                    "that dim)", ref.span)
                _check_block_args(module, ref.name, [(key, getattr(node, "span", None) or ref.span)
                                                     for key, node in ref.args])
                inner_env = dict(env)
                for key, node in ref.args:
                    inner_env[key] = evaluate_number(node, env, f"`{key}` of block `{ref.name}`")
                try:
                    inner = _expand(module, module.blocks[ref.name].pipeline, inner_env, seen + (ref.name,))
                except UserError as e:  # located in the block's declaration, often in an imported file
                    if ref.span is not None:
                        note = f"block `{ref.name}` is run at {ref.span}"
                        e.hint = f"{e.hint}; {note}" if e.hint else note
                    raise
                if len(summed) > 1:
                    if len(inner) != 1:
                        raise SpecError(f"block `{ref.name}` is a pipeline; only single stages can be summed",
                                        ref.span)
                    parts += inner[0][0]
                else:
                    out += _named(inner, ref.name)
                    parts = []
                    continue
            elif ref.name in module.models:
                raise SpecError(f"`{ref.name}` is a model; a layer's stages are energies or blocks", ref.span,
                                "declare its layer as a block (`block B = ...`) and use `B` in both models")
            else:
                known = sorted(module.energies) + sorted(module.blocks)
                close = difflib.get_close_matches(ref.name, known, n=1)
                raise SpecError(f"no energy or block named `{ref.name}`", ref.span,
                                f"did you mean `{close[0]}`?" if close else f"declared: {', '.join(known) or 'none'}")
        if parts:
            out.append((parts, None))
    return out


def _named(stages: list[tuple[list[Part], str | None]], block: str) -> list[tuple[list[Part], str | None]]:
    """A block's stages: one sum of energies, not named by an inner block already, takes the block's name."""
    if len(stages) == 1 and len(stages[0][0]) > 1 and stages[0][1] is None:
        return [(stages[0][0], block)]
    return stages


def _block_takes(module: ast.Module, name: str, seen: frozenset[str] = frozenset(), free: bool = False) -> set[str]:
    """The names a block's argument can set: a dim of an energy in it, or a name its stages' arguments read (in
    it or in a block within it). `free`: only the dims a use in the block does not set itself (`MLP(hidden = 8)`
    sets `hidden`, so an argument `hidden` of the block never reaches it)."""
    takes = _names_in(module.blocks[name].pipeline)
    for ref in (r for summed in module.blocks[name].pipeline for r in summed):
        named = {k for k, _ in ref.args if k is not None} if free else set()
        if ref.name in module.energies:
            header = [n for n, _ in module.energies[ref.name].header]
            positional = sum(k is None for k, _ in ref.args) if free else 0
            takes |= set(header[positional:]) - named
        elif ref.name in module.blocks and ref.name not in seen:
            takes |= _block_takes(module, ref.name, seen | {name}, free) - named
    return takes


def _check_block_args(module: ast.Module, name: str, args: list[tuple[str, Span | None]]) -> None:
    """A block's argument that nothing in it reads (`Pair(haeds = 4)`) had been dropped without a word, and so
    was one that every use in the block sets itself (`block Pair = MHA(heads = 2) -> MLP` run as `Pair(heads =
    4)`: heads stayed 2)."""
    takes = _block_takes(module, name)
    free = _block_takes(module, name, free=True)
    for key, span in args:
        if key not in takes:
            close = difflib.get_close_matches(key, sorted(takes), n=1)
            raise SpecError(f"`{key}` is not a dim of any energy in block `{name}`", span,
                            f"did you mean `{close[0]}`?" if close else f"its energies' dims: "
                            f"{', '.join(sorted(takes)) or 'none'}")
        if key not in free:
            raise SpecError(f"`{key}` never reaches block `{name}`'s energies: each use of one that has that dim "
                            "in the block gives it its own value", span,
                            f"drop the argument, or have the block pass it on (`{key} = {key}` there)")


def expand_block(module: ast.Module, name: str, dims: dict[str, float],
                 outer: dict[str, float] | None = None) -> list[StagePlan]:
    """A block outside any model: its stages, with `dims` as the block's named arguments; `outer`, a model's dims,
    gives the names the block reads from the model that runs it (`block Inner = MLP(d, hidden = 8)`)."""
    env = {k: dim_override(k, v, f"block `{name}`", None) for k, v in dims.items()}
    _check_block_args(module, name, [(key, module.blocks[name].span) for key in env])
    stages = _named(_expand(module, module.blocks[name].pipeline, (outer or {}) | env), name)
    return [_stage(*stage) for stage in stages]


def block_arguments(module: ast.Module, model: str, block: str, dims: dict[str, float]) -> dict[str, float] | None:
    """The arguments `model`'s layer gives `block` where it names it itself (`layer = Pair(h = 4)`), at the model's
    `dims`; None where only another block runs it (with arguments of its own: `blocks_running`)."""
    layer = next((c.value for c in module.models[model].clauses if c.kind == "layer"), [])
    ref = next((r for summed in layer for r in summed if r.name == block), None)
    if ref is None:
        return None
    return {key: evaluate_number(node, dims, f"`{key}` of block `{block}`") for key, node in ref.args if key}


def blocks_running(module: ast.Module, block: str) -> list[str]:
    """The blocks whose own pipeline names `block`."""
    return [name for name, decl in module.blocks.items()
            if any(r.name == block for summed in decl.pipeline for r in summed)]


def given_by_running_blocks(module: ast.Module, block: str, name: str) -> str | None:
    """A hint for an unknown `name` in a block derived alone, where another block gives it (`Twice = Outer(hh = 3)
    -> …`): that block, and the `--set` that stands in for it. None where no block gives the block that name."""
    givers = [b for b in blocks_running(module, block)
              if any(r.name == block and name in dict(r.args) for summed in module.blocks[b].pipeline for r in summed)]
    if not givers:
        return None
    return (f"block `{givers[0]}` gives `{block}` its `{name}`: derive `{givers[0]}` (`--name {givers[0]}`),"
            f" or give it here (`--set {name}=N`)")


def models_running(module: ast.Module, block: str) -> list[str]:
    """The models whose layer runs `block`, itself or within another block."""
    def reaches(pipeline: list[list[ast.StageRef]], seen: frozenset[str]) -> bool:
        for ref in (r for summed in pipeline for r in summed):
            if ref.name == block or (ref.name in module.blocks and ref.name not in seen
                                     and reaches(module.blocks[ref.name].pipeline, seen | {ref.name})):
                return True
        return False

    return [m for m, decl in module.models.items()
            if reaches(next((c.value for c in decl.clauses if c.kind == "layer"), []), frozenset())]


def _stage(parts: list[Part], block: str | None = None) -> StagePlan:
    if len(parts) == 1:
        decl, dims, ref = parts[0]
        return StagePlan(decl.name, [(decl.name, dims)], decl, dims, ref.span)
    from .merge import merge_energies

    decl, dims = merge_energies([(d, dims) for d, dims, _ in parts], [ref.span for _, _, ref in parts])
    if block is not None:
        decl = dataclasses.replace(decl, name=block)
    return StagePlan("+".join(d.name for d, _, _ in parts), [(d.name, dm) for d, dm, _ in parts], decl, dims,
                     parts[0][2].span)


@contextlib.contextmanager
def stage_named(stage: StagePlan, model: str) -> Iterator[None]:
    """An error in a stage's energy (the heads do not divide d, say) points into the energy's declaration,
    often in an imported file: its hint also names the stage that built it there, and where."""
    try:
        yield
    except UserError as e:
        if stage.span is not None:
            note = f"model `{model}` builds `{stage.label}` at {stage.span}"
            e.hint = f"{e.hint}; {note}" if e.hint else note
        raise


def dim_override(key: str, value: object, owner: str, span: Span | None) -> float:
    """A dim set from Python or `--set`: a real, finite number (not a bool, a string or None)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SpecError(f"dim `{key}` of {owner} must be a number, got {value!r}", span)
    try:
        value = float(value)
    except OverflowError:  # an int past a float's range (10**400): math.isfinite raised it
        raise SpecError(f"dim `{key}` of {owner} must be a finite number, got an integer of {len(str(value))} "
                        "digits", span) from None
    if not math.isfinite(value):
        raise SpecError(f"dim `{key}` of {owner} must be a finite number, got {value}", span)
    return value


def plan_model(module: ast.Module, name: str, overrides: dict[str, float]) -> ModelPlan:
    """Resolve a `model` declaration with its dims (defaults, then overrides)."""
    decl = module.models[name]
    header = [key for key, _ in decl.header]
    for key in overrides:
        if key not in header:
            raise SpecError(f"`{key}` is not a dim of model `{name}`", decl.span,
                            f"its dims: {', '.join(header) or 'none'}")
    env: dict[str, float] = {}
    for key, node in decl.header:  # in order, a set dim replacing its default: `dff = 4 * dv` follows --set dv
        env[key] = (dim_override(key, overrides[key], f"model `{name}`", decl.span) if key in overrides
                    else evaluate_number(node, env, f"the default of `{key}`"))
    by_kind: dict[str, list[ast.Clause]] = {}
    for c in decl.clauses:
        by_kind.setdefault(c.kind, []).append(c)
    for kind, cs in by_kind.items():
        if len(cs) > 1:
            raise SpecError(f"a model has one `{kind.replace('_', ' ')}` clause", cs[1].span)
    one = {k: v[0] for k, v in by_kind.items()}
    for need in ("vocab", "context") if "stream" in one else ("vocab", "context", "d"):
        if need not in env:
            raise SpecError(f"model `{name}` needs a `{need}` dim in its header", decl.span)
    if "layer" not in one:
        raise SpecError(f"model `{name}` has no `layer = ...`", decl.span)
    stages = [_stage(*stage) for stage in _expand(module, one["layer"].value, env)]
    stream = _stream(one.get("stream"), env, *_dim_place(decl, "d", overrides))
    positions = False
    embed_rank = head_rank = None
    if "embed" in one:
        for n, what in enumerate(one["embed"].value):
            if what not in ("tokens", "positions"):
                raise SpecError(f"cannot embed `{what}`", one["embed"].span, "use `embed tokens` or "
                                "`embed tokens, positions`")
            if what in one["embed"].value[:n]:
                raise SpecError(f"`{what}` is given twice in `embed`", one["embed"].span)
        positions = "positions" in one["embed"].value
        embed_rank = _rank(one["embed"], env, stream)
    layers, shared = 1, False
    if "repeat" in one:
        c = one["repeat"]
        what = f"`repeat {c.value.name}`" if isinstance(c.value, ast.Name) else "`repeat`"  # the dim a caller set
        layers = _whole(evaluate_number(c.value, env, what), what, c.span)
        shared = bool(c.extra.get("shared"))
    across = None
    if "across" in one:
        across = _across(one["across"], env)
    norm = None
    if "norm" in one:
        c = one["norm"]
        if c.name not in NORMS:
            raise SpecError(f"unknown norm `{c.name}`", c.span, f"use {' or '.join(NORMS)}")
        norm = (c.name, c.value)
    final = None
    if "final_norm" in one:
        c = one["final_norm"]
        if c.name not in NORMS:
            raise SpecError(f"unknown norm `{c.name}`", c.span, f"use {' or '.join(NORMS)}")
        final = c.name
    tied = one["head"].value == "tied" if "head" in one else True
    if "head" in one:
        head_rank = _rank(one["head"], env, stream)
        if tied and head_rank is not None:
            raise SpecError("a tied head reads with the embedding's own keys and tables",
                            one["head"].extra["rank"].span,
                            "write `head tied` (rank as the embedding's) or `head untied rank R`")
    if tied:
        head_rank = embed_rank
    vocab = _whole(env["vocab"], *_dim_place(decl, "vocab", overrides))
    context = _whole(env["context"], *_dim_place(decl, "context", overrides))
    _check_entries(stream, "the stream of a token", decl.span)
    tables = [("the token embedding", vocab, embed_rank)]
    if positions:
        tables.append(("the position embedding", context, embed_rank))
    if not tied:
        tables.append(("the head", vocab, head_rank))
    for what, rows, rank in tables:  # [rows, d], or [rows, R, dv] factorised
        _check_entries((rows, rank, stream[-1]) if rank else (rows, math.prod(stream)), what, decl.span)
    return ModelPlan(name, env, vocab, context, math.prod(stream), positions, stages, layers, shared, across, norm,
                     final, tied, decl.span, stream=stream, embed_rank=embed_rank, head_rank=head_rank)


def unread_dims(module: ast.Module, name: str) -> list[str]:
    """The header dims of model `name` that nothing reads: no clause, no read dim's default, no stage's energy
    (which takes a model dim of its own dim's name) and no block. `layers = 8` without `repeat layers` built one
    layer, and said nothing; a dim read only by an unread dim's default (`a = 2, b = 4 * a`) is unread too."""
    decl = module.models[name]
    clauses = {c.kind for c in decl.clauses}
    layer = next((c.value for c in decl.clauses if c.kind == "layer"), [])
    others = [c for c in decl.clauses if c.kind != "layer"]
    read = {"vocab", "context"} | (set() if "stream" in clauses else {"d"}) | _names_in(others)
    # each stage reference, with the names an enclosing block's arguments set in its place (shadowed)
    refs: list[tuple[ast.StageRef, frozenset[str]]] = [(ref, frozenset()) for summed in layer for ref in summed]
    seen: set[tuple[str, frozenset[str]]] = set()
    while refs:
        ref, shadowed = refs.pop()
        read |= _names_in([node for _, node in ref.args]) - shadowed  # its arguments' expressions
        if (ref.name, shadowed) in seen:
            continue
        seen.add((ref.name, shadowed))
        if ref.name in module.energies:  # a header dim it is not given takes the model's of that name
            names = [n for n, _ in module.energies[ref.name].header]
            given = set(names[:sum(key is None for key, _ in ref.args)]) | {k for k, _ in ref.args if k}
            read |= set(names) - given - shadowed
        elif ref.name in module.blocks:
            inner = shadowed | {k for k, _ in ref.args if k}
            refs += [(r, inner) for summed in module.blocks[ref.name].pipeline for r in summed]
    defaults = dict(decl.header)
    pending = [k for k in read if k in defaults]
    while pending:  # what a read dim's default reads is read
        for name_read in _names_in(defaults[pending.pop()]) - read:
            read.add(name_read)
            pending.append(name_read)
    return [k for k, _ in decl.header if k not in read]


def _names_in(tree: object) -> set[str]:
    """Every name a piece of syntax reads (`Name` nodes, in stage arguments, clause values, expressions)."""
    if isinstance(tree, ast.Name):
        return {tree.name}
    if isinstance(tree, list | tuple):
        return set().union(*map(_names_in, tree)) if tree else set()
    if isinstance(tree, dict):
        return _names_in(list(tree.values()))
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return _names_in([getattr(tree, f.name) for f in dataclasses.fields(tree) if f.name != "span"])
    return set()


def _stream(c: ast.Clause | None, env: dict[str, float], what: str, span: Span | None) -> tuple[int, ...]:
    """The stream's shape per token: `stream [dk, dv]`, else the vector [d] (`what` and `span`: d's)."""
    if c is None:
        return (_whole(env["d"], what, span),)
    return tuple(_whole(evaluate_number(n, env, "the stream's shape"), "a stream axis", n.span or c.span)
                 for n in c.value)


def _rank(c: ast.Clause, env: dict[str, float], stream: tuple[int, ...]) -> int | None:
    """`rank R` on `embed` or `head`: R rank-1 writes (reads) over a matrix stream [dk, dv]."""
    node = c.extra.get("rank")
    if node is None:
        return None
    if len(stream) != 2:
        raise SpecError(f"`{c.kind} ... rank` factorises over a matrix stream, but the stream is "
                        f"[{', '.join(map(str, stream))}]", node.span or c.span,
                        "declare a matrix stream, `stream [dk, dv]`, or leave `rank` out" if len(stream) > 2
                        else "declare the stream's shape: `stream [dk, dv]`")
    return _whole(evaluate_number(node, env, "the rank"), "the rank", node.span or c.span)


def _across(c: ast.Clause, env: dict[str, float]) -> tuple[str, dict[str, tuple[float, bool]]] | None:
    call = c.value
    if isinstance(call, ast.OptHole):
        raise SpecError("`choice{...}` across layers belongs in a `search`", call.span)
    if call.name == "none":
        return None
    ACROSS_LAYERS.check(call.name, call.span, [(kw.name, kw.span) for kw in call.kwargs])
    hyper = {k: (float(v), False) for k, v in ACROSS_LAYERS.takes[call.name].items()}
    for kw in call.kwargs:
        hyper[kw.name] = (evaluate_number(kw.value, env, f"`{kw.name}`"), kw.flag == "learn")  # model dims too
    return call.name, hyper


def check_stage_state(plan: ModelPlan, stage: StagePlan, spec: Any) -> None:
    """A stage's state (its shape at its dims, `spec` its lowered energy) must hold one token's stream: as many
    entries as the stream. Its context and input, which a model does not pass, default to that state: each must
    have the state's shape."""
    shape = tuple(spec.size(s) for s in spec.state.shape)
    if math.prod(shape) != plan.d:
        raise SpecError(f"stage `{stage.label}` has the state [{', '.join(map(str, shape))}] "
                        f"({math.prod(shape)} entries) but the model's stream is "
                        f"[{', '.join(map(str, plan.stream))}] ({plan.d})", stage.span,
                        "a stage's state is the stream of a token: give it the stream's shape or size")
    for what, var in (("context", spec.context), ("input", spec.input)):
        other = None if var is None else tuple(spec.size(s) for s in var.shape)
        if other is not None and other != shape:
            raise SpecError(f"stage `{stage.label}` has the {what} `{var.name}` [{', '.join(map(str, other))}] per "
                            f"token but the state [{', '.join(map(str, shape))}]: in a model a stage's {what} is "
                            "the stream's tokens, shaped as its state", stage.span,
                            f"give `{var.name}` the state's shape, or use the energy as a layer of its own "
                            f"(`.module(...)`, which takes {what}= of any shape)")


def describe(plan: ModelPlan) -> str:
    """A readable text rendering of the model graph (what `energy graph` prints)."""
    shape = f"stream [{', '.join(map(str, plan.stream))}]" if len(plan.stream) > 1 else f"d {plan.d}"
    lines = [f"model {plan.name}: vocab {plan.vocab}, context {plan.context}, {shape}"]
    lines.append(f"  {plan.embed_label()}")
    stages = " -> ".join(s.label for s in plan.stages)
    rep = f"{plan.layers}×{' (shared weights)' if plan.shared else ''}"
    norm = f", {plan.norm[0]} before each {plan.norm[1]}" if plan.norm else ""
    lines.append(f"  {rep} [ {stages} ]{norm}")
    if plan.across:
        kind, hyper = plan.across
        args = ", ".join(f"{k} = {v:g}{' learn' if learn else ''}" for k, (v, learn) in hyper.items())
        lines.append(f"  across layers {kind}({args})")
    if plan.final_norm:
        lines.append(f"  final {plan.final_norm}")
    lines.append(f"  {plan.head_label()}")
    for s in plan.stages:
        for n, dims in s.energies:
            lines.append(f"  stage {n}: " + ", ".join(f"{k}={v:g}" for k, v in dims.items()))
    return "\n".join(lines)
