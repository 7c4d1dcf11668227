"""The reference interpreter: evaluates IR expressions on torch tensors.

This is the ground truth every other backend is tested against, and what `energy check` uses with
autograd. It favours clarity over speed: context reductions materialise the (i, j) grid.

Layout of a value: a tensor with axes (batch, position i, *free indices in sorted order, *shape),
where batch and position may have size 1 when a value does not depend on them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy as sp
import torch

from .functions import REGISTRY, sympy_to_torch
from .ir_nodes import (
    Add,
    Count,
    Decay,
    Diag,
    Dot,
    Expr,
    Func,
    Identity,
    Index,
    IndexInfo,
    Inverse,
    Let,
    MatMul,
    Mul,
    Ones,
    Outer,
    Pos,
    Pow,
    ProdOthers,
    Reduce,
    Rope,
    Scalar,
    Softmax,
    StopGrad,
    SumAll,
    Transpose,
    Var,
)


@dataclass
class Value:
    tensor: torch.Tensor
    idx: tuple[str, ...]  # free indices, sorted, occupying axes 2 .. 2+len(idx)


@dataclass
class Env:
    """Everything an expression may refer to, for one batch of sequences."""

    tensors: dict[str, torch.Tensor]  # per-token tensors are (B, T, *shape); params are their own shape
    indices: dict[str, IndexInfo]
    scalars: dict[sp.Symbol, float | torch.Tensor]  # dims and scalar parameters by symbol
    seq_len: int
    cache: dict = field(default_factory=dict)
    # `stopgrad` means a zero derivative in the derivation: evaluating an energy for autograd to differentiate
    # (the checks' ground truth) detaches it. A derived update program has had its derivation; there it is
    # the identity, so that training gradients flow through it as they do in the generated modules.
    detach_stopgrad: bool = True


def _align(v: Value, idx: tuple[str, ...]) -> torch.Tensor:
    """Insert singleton axes so `v` is laid out over the (sorted) index tuple `idx`."""
    t = v.tensor
    for pos, name in enumerate(idx):
        if name not in v.idx:
            t = t.unsqueeze(2 + pos)
    return t


def merge_values(*vals: Value) -> tuple[tuple[str, ...], list[torch.Tensor]]:
    idx = tuple(sorted(set().union(*(v.idx for v in vals))))
    out = [_align(v, idx) for v in vals]
    return idx, out


def _shape_rank(e: Expr) -> int:
    return len(e.shape)


def _pad_rank(t: torch.Tensor, have: int, want: int) -> torch.Tensor:
    """Scalars broadcast against tensors: add trailing singleton shape axes."""
    for _ in range(want - have):
        t = t.unsqueeze(-1)
    return t


def context_mask(env: Env, index: str, device, dtype=torch.bool) -> torch.Tensor:
    info = env.indices[index]
    t = env.seq_len
    i = torch.arange(t, device=device).unsqueeze(1)
    j = torch.arange(t, device=device).unsqueeze(0)
    return (j < i) if info.strict else (j <= i)


def evaluate(e: Expr, env: Env) -> Value:
    key = id(e)
    hit = env.cache.get(key)
    if hit is not None and hit[0] is e:
        return hit[1]
    out = _eval(e, env)
    env.cache[key] = (e, out)
    return out


def _eval(e: Expr, env: Env) -> Value:
    ref = next(iter(env.tensors.values()))
    dtype, device = ref.dtype, ref.device
    match e:
        case Scalar():
            v = sympy_to_torch(e.value, env.scalars)
            return Value(torch.as_tensor(v, dtype=dtype, device=device).reshape(1, 1), ())
        case Var():
            t = env.tensors[e.name]
            if e.role == "context":
                # tokens (B, T, *shape) seen as context: (B, 1, T_j, *shape)
                return Value(t.unsqueeze(1), (e.index,))
            if e.role in ("param",):
                return Value(t.reshape((1, 1) + tuple(t.shape)), ())
            return Value(t, ())
        case Index():
            base = evaluate(e.base, env)
            nb = len(base.idx)
            t = base.tensor.movedim(2 + nb, 2)  # the indexed axis, now first of the index axes
            idx = (e.index,) + base.idx
            order = sorted(range(len(idx)), key=lambda p: idx[p])
            t = t.permute(0, 1, *(2 + p for p in order), *range(2 + len(idx), t.dim()))
            return Value(t, tuple(idx[p] for p in order))
        case Pos():
            t = torch.arange(env.seq_len, dtype=dtype, device=device)
            if e.index is None:
                return Value(t.reshape(1, -1), ())
            if env.indices[e.index].context is None:
                return Value(t.reshape(1, 1, -1), (e.index,))
            # a context position past the mask reads as the last kept one (i, or i - 1 when strict): the mask
            # drops those pairs, and their values must stay finite wherever the kept ones are, or a 0 weight
            # times an infinite derivative (1/(i - j) at j = i) is NaN in the gradient
            last = t.reshape(-1, 1) - (1 if env.indices[e.index].strict else 0)
            return Value(torch.minimum(t.reshape(1, -1), last).unsqueeze(0), (e.index,))
        case Ones():
            shape = tuple(int(sympy_to_torch(s, env.scalars)) for s in e.shape)
            return Value(torch.ones((1, 1) + shape, dtype=dtype, device=device), ())
        case Identity():
            n = int(sympy_to_torch(e.size, env.scalars))
            return Value(torch.eye(n, dtype=dtype, device=device).reshape(1, 1, n, n), ())
        case Count():
            info = env.indices[e.index]
            if info.size is not None:
                n = float(sympy_to_torch(info.size, env.scalars))
                return Value(torch.full((1, 1), n, dtype=dtype, device=device), ())
            c = context_mask(env, e.index, device).sum(-1).to(dtype)
            if e.at_least_one:
                c = c.clamp(min=1)
            return Value(c.reshape(1, -1), ())
        case Add() | Mul():
            parts = e.terms if isinstance(e, Add) else e.factors
            vals = [evaluate(p, env) for p in parts]
            idx, ts = merge_values(*vals)
            rank = _shape_rank(e)
            ts = [_pad_rank(t, _shape_rank(p), rank) for t, p in zip(ts, parts)]
            out = ts[0]
            for t in ts[1:]:
                out = out + t if isinstance(e, Add) else out * t
            return Value(out, idx)
        case Pow():
            b = evaluate(e.base, env)
            ex = sympy_to_torch(e.exponent, env.scalars)
            return Value(b.tensor ** ex, b.idx)
        case MatMul():
            a, b = evaluate(e.a, env), evaluate(e.b, env)
            idx, (ta, tb) = merge_values(a, b)
            if len(e.b.shape) == 1:
                out = (ta @ tb.unsqueeze(-1)).squeeze(-1)
            elif len(e.a.shape) == 1:
                out = (ta.unsqueeze(-2) @ tb).squeeze(-2)
            else:
                out = ta @ tb
            return Value(out, idx)
        case Dot():
            a, b = evaluate(e.a, env), evaluate(e.b, env)
            idx, (ta, tb) = merge_values(a, b)
            n = len(e.a.shape)
            return Value((ta * tb).sum(dim=tuple(range(-n, 0))), idx)
        case Outer():
            a, b = evaluate(e.a, env), evaluate(e.b, env)
            idx, (ta, tb) = merge_values(a, b)
            return Value(ta.unsqueeze(-1) * tb.unsqueeze(-2), idx)
        case Transpose():
            a = evaluate(e.a, env)
            return Value(a.tensor.transpose(-1, -2), a.idx)
        case Func():
            a = evaluate(e.arg, env)
            return Value(REGISTRY[e.name](a.tensor), a.idx)
        case SumAll():
            a = evaluate(e.a, env)
            n = len(e.a.shape)
            return Value(a.tensor.sum(dim=tuple(range(-n, 0))), a.idx)
        case StopGrad():
            a = evaluate(e.a, env)
            return Value(a.tensor.detach(), a.idx) if env.detach_stopgrad else a
        case Let():
            return evaluate(e.body, env)
        case Diag():
            a = evaluate(e.a, env)
            return Value(torch.diag_embed(a.tensor), a.idx)
        case Inverse():
            a = evaluate(e.a, env)
            return Value(torch.linalg.inv(a.tensor), a.idx)
        case Reduce() | Softmax() | ProdOthers():
            return _reduce(e, env)
        case Decay():
            return _decay(e, env)
        case Rope():
            return _rope(e, env)
    raise NotImplementedError(type(e).__name__)


def _reduce(e: Reduce | Softmax | ProdOthers, env: Env) -> Value:
    body = evaluate(e.body, env)
    if e.index not in body.idx:  # broadcast over the index (e.g. Σ_k of something per-k-free)
        body = Value(body.tensor.unsqueeze(2 + sum(1 for n in body.idx if n < e.index)),
                     tuple(sorted(body.idx + (e.index,))))
        size = _index_size(e.index, env)
        t = body.tensor
        body = Value(t.expand(*[size if a == 2 + body.idx.index(e.index) else -1 for a in range(t.dim())]),
                     body.idx)
    axis = 2 + body.idx.index(e.index)
    t = body.tensor
    info = env.indices[e.index]
    mask = None
    if info.context is not None:
        m = context_mask(env, e.index, t.device)  # (T_i, T_j)
        shape = [1] * t.dim()
        shape[1], shape[axis] = m.shape[0], m.shape[1]
        mask = m.reshape(shape)
        if t.shape[1] == 1:
            t = t.expand(*[m.shape[0] if a == 1 else -1 for a in range(t.dim())])
    rest = tuple(n for n in body.idx if n != e.index)
    if isinstance(e, ProdOthers):
        return Value(_prod_of_others(t, axis, mask), body.idx)
    if isinstance(e, Softmax):
        if mask is None:
            return Value(torch.softmax(t, dim=axis), body.idx)
        # an empty context has no weights: its scores are taken as 0, not -inf, so that no derivative of any
        # order meets softmax's 0/0 (nan_to_num mended the value and the gradient, not the double backward)
        s = t.masked_fill(~mask, float("-inf")).masked_fill(~mask.any(axis, keepdim=True), 0.0)
        return Value(torch.softmax(s, dim=axis) * mask, body.idx)
    if e.op == "sum":
        out = (t if mask is None else t * mask.to(t.dtype)).sum(axis)
    elif e.op == "mean":
        tm = t if mask is None else t * mask.to(t.dtype)
        cnt = t.shape[axis] if mask is None else mask.to(t.dtype).sum(axis).clamp(min=1)
        out = tm.sum(axis) / cnt
    elif e.op == "logsumexp":
        s = t if mask is None else t.masked_fill(~mask, float("-inf"))
        out = torch.logsumexp(s, dim=axis)
        if mask is not None:  # an empty context contributes nothing (lse := 0), keeps gradients finite
            out = torch.where(torch.isinf(out) & (out < 0), torch.zeros_like(out), out)
    elif e.op == "prod":
        tm = t if mask is None else torch.where(mask, t, torch.ones_like(t))
        out = tm.prod(axis)
    elif e.op == "max":
        s = t if mask is None else t.masked_fill(~mask, float("-inf"))
        out = s.amax(axis)
        if mask is not None:  # an empty context contributes nothing (max := 0), as for logsumexp
            out = torch.where(mask.any(axis), out, torch.zeros_like(out))
    else:
        raise NotImplementedError(e.op)
    return Value(out, rest)


def _prod_of_others(t: torch.Tensor, axis: int, mask: torch.Tensor | None) -> torch.Tensor:
    """Entry k: the product of the entries m ≠ k along `axis` that `mask` keeps (0 where it drops k), formed as
    a (k, m) table with ones on its diagonal: plain, and independent of the generated code's cumulative products."""
    if mask is not None:
        t = torch.where(mask, t, torch.ones_like(t))
    n = t.shape[axis]
    diagonal = torch.eye(n, dtype=torch.bool, device=t.device).reshape(
        [1] * axis + [n, n] + [1] * (t.dim() - axis - 1))
    out = torch.where(diagonal, torch.ones_like(t.unsqueeze(axis)), t.unsqueeze(axis)).prod(axis + 1)
    return out if mask is None else out * mask.to(out.dtype)


def _decay(e: Decay, env: Env) -> Value:
    """γ_ij = ∏ r_s over the context tokens s after j (j < s ≤ i, or s < i under `j < i`) as a product over an
    (i, j, s) table, 1 past the last: plain, and independent of the generated code's cumulative sums of log r."""
    r = evaluate(e.body, env)  # (B, 1, ..., T_j at `axis`, ...): the rate of each context token
    axis = 2 + r.idx.index(e.index)
    rates = r.tensor.movedim(axis, -1).unsqueeze(axis)  # (B, 1, ..., 1 (j), ..., T_s)
    n = env.seq_len
    pos = torch.arange(n, device=rates.device)
    i, j, s = pos.reshape(n, 1, 1), pos.reshape(1, n, 1), pos.reshape(1, 1, n)
    last = i - 1 if env.indices[e.index].strict else i
    between = ((j < s) & (s <= last)).reshape([1, n] + [1] * (axis - 2) + [n] + [1] * (rates.dim() - axis - 2) + [n])
    rates = rates.expand(*[n if a == 1 else -1 for a in range(rates.dim())])
    return Value(torch.where(between, rates, torch.ones_like(rates)).prod(-1), r.idx)


def _rope(e: Rope, env: Env) -> Value:
    """The rotation as a (D, D) matrix per position, built from its definition (feature m and m + D/2 turned by
    p θ_m): independent of the generated code's rotate-half arithmetic."""
    a = evaluate(e.a, env)
    n, width = env.seq_len, a.tensor.shape[-1]
    half = width // 2
    theta = float(e.base) ** (-2.0 * torch.arange(half, dtype=torch.float64) / width)
    angle = e.sign * torch.arange(n, dtype=torch.float64)[:, None] * theta  # (T, D/2)
    rotation = torch.zeros(n, width, width, dtype=torch.float64)
    m = torch.arange(half)
    rotation[:, m, m] = rotation[:, m + half, m + half] = angle.cos()
    rotation[:, m, m + half], rotation[:, m + half, m] = -angle.sin(), angle.sin()
    rotation = rotation.to(a.tensor)
    idx = tuple(sorted(set(a.idx) | e.pos.free))
    t = _align(a, idx)
    if e.pos.index is None:  # the token's own position: along axis 1
        shape = [1, n] + [1] * len(idx) + [width, width]
    else:  # a context token's: along its index's axis
        shape = [1, 1] + [n if name == e.pos.index else 1 for name in idx] + [width, width]
    return Value((rotation.reshape(shape) @ t.unsqueeze(-1)).squeeze(-1), idx)


def _index_size(name: str, env: Env) -> int:
    info = env.indices[name]
    if info.context is not None:
        return env.seq_len
    return int(sympy_to_torch(info.size, env.scalars))
