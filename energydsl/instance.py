"""Concrete instances of an energy: parameter values, inputs, and running the update program.

`energy check` and the tests draw random instances here (float64, small dims) and run both the
derived program and autograd on them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import sympy as sp
import torch

from .calculus import substitute_var
from .errors import SpecError
from .evaluate import Env, Value, evaluate
from .ir_nodes import Expr, IndexInfo, Var
from .optimizers import UpdateProgram
from .semantics import EnergyIR, ParamSpec


@dataclass
class Instance:
    """Parameter values (constrained, as the energy sees them) and token tensors for one check."""

    params: dict[str, torch.Tensor]  # non-scalar params, by name
    scalars: dict[sp.Symbol, torch.Tensor | float]  # dims, scalar params, hyper-parameters
    x: torch.Tensor  # (B, T, *state)
    context: torch.Tensor | None  # (B, T, *context)
    input: torch.Tensor | None
    seq_len: int
    raw: dict[str, torch.Tensor] = field(default_factory=dict)  # what a generated module holds (`random_instance`)


def alibi_slopes(n: int) -> torch.Tensor:
    """ALiBi's geometric slopes 2^(-8k/n), k = 1..n (Press et al.)."""
    return torch.tensor([2 ** (-8 * (k + 1) / n) for k in range(n)], dtype=torch.float64)


def init_param(p: ParamSpec, sizes: list[int], generator: torch.Generator | None, dtype=torch.float64,
               check_scale: float | None = None) -> torch.Tensor:
    """A parameter's initial value (or, for a learned one, a random value of moderate size when `check_scale` is
    set: it moves away from its initialiser as it trains; a `fixed` one keeps what its initialiser draws, as in
    the module, so `zeros() fixed` is checked at zero and `uniform(0.5, 0.9) fixed` inside its range)."""
    shape = tuple(sizes)
    init = p.init or ("normal", [0.0, 0.02])
    kind, args = init
    if check_scale is not None and p.learn and kind in ("normal", "zeros", "orthogonal", "uniform"):
        return torch.randn(shape, generator=generator, dtype=dtype) * check_scale
    if kind == "normal":
        return torch.randn(shape, generator=generator, dtype=dtype) * args[1] + args[0]
    if kind == "uniform":
        return torch.rand(shape, generator=generator, dtype=dtype) * (args[1] - args[0]) + args[0]
    if kind == "zeros":
        return torch.zeros(shape, dtype=dtype)
    if kind == "ones":
        return torch.ones(shape, dtype=dtype)
    if kind == "eye":
        eye = torch.eye(shape[-1], dtype=dtype)
        return eye.expand(shape).clone()
    if kind == "orthogonal":
        w = torch.empty(shape, dtype=dtype)
        for matrix in w.view(-1, *shape[-2:]) if len(shape) > 1 else [w.view(1, -1)]:  # a stack: each orthogonal
            torch.nn.init.orthogonal_(matrix)
        return w
    if kind == "alibi_slopes":
        return alibi_slopes(shape[0]).to(dtype)
    if kind == "value":
        return torch.full(shape, float(args[0]), dtype=dtype)
    raise ValueError(kind)


def constrain(p: ParamSpec, raw: torch.Tensor) -> torch.Tensor:
    """The value the energy sees from a raw (unconstrained) parameter."""
    if p.constraint is None:
        return raw
    if p.constraint[0] == "interval":
        lo, hi = p.constraint[1], p.constraint[2]
        return lo + (hi - lo) * torch.sigmoid(raw)
    if p.constraint[0] == "positive":
        return torch.nn.functional.softplus(raw)
    if p.constraint[0] == "psd":
        return raw @ raw.transpose(-1, -2) + 1e-6 * torch.eye(raw.shape[-1], dtype=raw.dtype)
    raise ValueError(p.constraint)


def unconstrain(p: ParamSpec, value: torch.Tensor) -> torch.Tensor:
    """The raw parameter whose constrained value is `value` (for initial values of constrained params)."""
    if p.constraint is None or p.constraint[0] == "psd":
        return value
    if p.constraint[0] == "interval":
        lo, hi = p.constraint[1], p.constraint[2]
        y = ((value - lo) / (hi - lo)).clamp(1e-6, 1 - 1e-6)
        return torch.log(y) - torch.log1p(-y)
    if p.constraint[0] == "positive":
        return value + torch.log(-torch.expm1(-value))
    raise ValueError(p.constraint)


# Initialisers that give the value the energy sees; a generated module stores `unconstrain` of it
# (codegen's `_raw`). Every other initialiser draws the raw parameter, which `constrain` maps.
CONSTRAINED_INITS = ("ones", "value")


def raw_param(p: ParamSpec, value: torch.Tensor) -> torch.Tensor:
    """The raw parameter a generated module holds for `init_param`'s value (see CONSTRAINED_INITS)."""
    kind = (p.init or ("normal", []))[0]
    return unconstrain(p, value) if kind in CONSTRAINED_INITS else value


def random_instance(prog: UpdateProgram, *, batch: int = 2, seq: int = 5, seed: int = 0,
                    scale: float = 0.5, dtype=torch.float64) -> Instance:
    """A random instance whose params go through `constrain` as in a generated module.

    Drawn values are raw parameters, so `positive`, `in (lo, hi)` and `psd` hold exactly as in the
    module (softplus, scaled sigmoid, L Lᵀ + εI): a check never evaluates log(g) at a g < 0 that no
    module can produce.
    """
    spec = prog.spec
    _check_instance_size(prog, batch, seq, dtype)
    g = torch.Generator().manual_seed(seed)
    scalars = _base_scalars(prog)
    params: dict[str, torch.Tensor] = {}
    raws: dict[str, torch.Tensor] = {}
    for name, p in prog.params.items():
        sizes = [spec.size(s) for s in p.shape]
        raw = raw_param(p, init_param(p, sizes, g, dtype, check_scale=scale))
        if p.init and p.init[0] in ("normal", "zeros", "uniform") and p.origin == "precondition":
            raw = torch.randn(tuple(sizes), generator=g, dtype=dtype) * scale
        if _set_value(p) and (p.learn and p.origin != "optimizer" or p.origin == "precondition"):
            # a learned param set to a value (`= 2`, `~ ones()`) moves in training: a check that held only at
            # its initial value would prove nothing, so move it (in raw space, where constraints still hold)
            raw = raw + 0.3 * (1 + raw.abs()) * torch.randn(tuple(sizes), generator=g, dtype=dtype)
        _place(prog, name, constrain(p, raw), params, scalars)
        raws[name] = raw
    shape = lambda s: tuple(spec.size(e) for e in s)  # noqa: E731
    x = torch.randn((batch, seq) + shape(spec.state.shape), generator=g, dtype=dtype) * scale
    ctx = None
    if spec.context is not None:
        ctx = torch.randn((batch, seq) + shape(spec.context.shape), generator=g, dtype=dtype) * scale
    inp = None
    if spec.input is not None and _shares_name(spec):
        inp = ctx  # one stream: each token's own input is its context token (the module's default)
    elif spec.input is not None:
        inp = torch.randn((batch, seq) + shape(spec.input.shape), generator=g, dtype=dtype) * scale
    return Instance(params, scalars, x, ctx, inp, seq, raws)


# The most memory one random instance may take: the checks run the update, autograd and second derivatives on
# it, several times its size. Checks are meant for small dims (the derivation is the same at every size).
MAX_INSTANCE_BYTES = 2**32


def _check_instance_size(prog: UpdateProgram, batch: int, seq: int, dtype: torch.dtype) -> None:
    """Refuse, before drawing it, an instance too large to hold (`energy check --set d=1e9`): a user error at the
    energy, not an allocation failure deep in torch."""
    spec = prog.spec
    tensors = {name: tuple(spec.size(s) for s in p.shape) for name, p in prog.params.items()}
    for var in (spec.state, spec.context, spec.input):
        if var is not None:
            tensors[var.name] = (batch, seq) + tuple(spec.size(s) for s in var.shape)
    entries = {name: math.prod(shape) for name, shape in tensors.items()}
    needed = sum(entries.values()) * dtype.itemsize
    if needed > MAX_INSTANCE_BYTES:
        name = max(entries, key=entries.__getitem__)
        dims = ", ".join(f"{k}={v:g}" for k, v in spec.dim_values.items())
        raise SpecError(f"a random instance of `{spec.name}` at {dims} is too large to check: its tensors take "
                        f"{needed / 2**30:,.3g} GiB in {str(dtype).removeprefix('torch.')} (`{name}` "
                        f"[{', '.join(map(str, tensors[name]))}] alone has {entries[name]:,} entries), more than "
                        f"{MAX_INSTANCE_BYTES / 2**30:g} GiB", spec.span,
                        "check it at smaller dims: the derivation is symbolic and the same at every size "
                        "(`energy info` gives a model's sizes at any dims)")


def _base_scalars(prog: UpdateProgram) -> dict[sp.Symbol, torch.Tensor | float]:
    """Dims and fixed hyper-parameters by symbol."""
    spec = prog.spec
    scalars: dict[sp.Symbol, torch.Tensor | float] = {sym: spec.dim_values[n] for n, sym in spec.dim_symbols.items()}
    scalars.update({sym: float(value) for sym, value in prog.hyper_values.items()})
    return scalars


def _set_value(p: ParamSpec) -> bool:
    """Is `p` initialised to a set value rather than drawn (`init_param` with `check_scale` draws the rest)?"""
    return bool(p.init) and p.init[0] in ("value", "ones", "eye", "alibi_slopes")


def _place(prog: UpdateProgram, name: str, value: torch.Tensor, params: dict[str, torch.Tensor],
           scalars: dict[sp.Symbol, torch.Tensor | float]) -> None:
    """A parameter's value where expressions look it up: tensors by name, scalars (and learned
    optimizer hyper-parameters `opt_*`) by symbol."""
    spec = prog.spec
    if prog.params[name].shape:
        params[name] = value
        return
    scalars[spec.scalar_params.get(name) or sp.Symbol(name, real=True)] = value.reshape(())
    if name.startswith("opt_"):
        scalars[spec.optimizer.hyper[name[4:]].symbol] = value.reshape(())


def _shares_name(spec: EnergyIR) -> bool:
    return spec.input is not None and spec.context is not None and spec.input.name == spec.context.name


def _input_alias(spec: EnergyIR, inst: Instance) -> str | None:
    """The name the input is bound to when it shares its name with a context that is another tensor.

    The evaluator looks tensors up by name, so a bare `h` (the input) and `h[j]` (the context) would
    both read one tensor. When the two are the same stream (the default) that is right; otherwise
    the input's occurrences are renamed (`bind_input`) to this name, which no user name can take.
    """
    if not _shares_name(spec) or inst.input is None or inst.input is inst.context:
        return None
    return f"{spec.input.name}@input"


def bind_input(spec: EnergyIR, inst: Instance, *exprs: Expr) -> list[Expr]:
    """`exprs` with a bare shared-name input reading the instance's input, not token i of the context.

    docs/language.md: with `input h[d]` and `context h[j, d]`, a bare `h` is the token's own input, as
    in the generated module's `input` argument. Sub-expressions shared within and between `exprs`
    stay shared: hoisted values are cached by node identity, once per run.
    """
    alias = _input_alias(spec, inst)
    if alias is None:
        return list(exprs)
    bound, memo = Var(alias, "input", spec.input.var_shape), {}
    return [substitute_var(e, spec.input.name, "input", bound, memo) for e in exprs]


def make_env(spec: EnergyIR, inst: Instance, tensors: dict[str, torch.Tensor]) -> Env:
    """Bindings for evaluating expressions on `inst`; pass them through `bind_input` first (see there)."""
    all_t = dict(inst.params)
    if spec.context is not None:
        all_t[spec.context.name] = inst.context
    if spec.input is not None and not _shares_name(spec):
        all_t[spec.input.name] = inst.input
    alias = _input_alias(spec, inst)
    if alias is not None:
        all_t[alias] = inst.input
    all_t.update(tensors)
    indices: dict[str, IndexInfo] = dict(spec.indices)
    return Env(all_t, indices, dict(inst.scalars), inst.seq_len)


def evaluate_on(spec: EnergyIR, e: Expr, inst: Instance, tensors: dict[str, torch.Tensor]) -> Value:
    """Evaluate `e` on an instance (with `tensors` bound on top), the input bound as documented."""
    return evaluate(bind_input(spec, inst, e)[0], make_env(spec, inst, tensors))


def eval_tokens(spec: EnergyIR, e: Expr, inst: Instance, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Evaluate a per-token expression to (B, T, *shape)."""
    v = evaluate_on(spec, e, inst, tensors)
    if v.idx:
        raise ValueError(f"free indices {v.idx} left in a per-token value")
    b, t = inst.x.shape[:2]
    return v.tensor.expand(b, t, *v.tensor.shape[2:])


def run_program(prog: UpdateProgram, inst: Instance, x0: torch.Tensor | None = None,
                steps: int | None = None, tied: bool = False) -> torch.Tensor:
    """Run the update program from x0 (default: the instance's state) for its steps.

    `tied=True` runs the energy's own update (before `untie`), which is what the checks prove.
    """
    spec = prog.spec
    x = inst.x if x0 is None else x0
    tensors = {spec.state.name: x}
    for m in prog.aux:
        tensors[m.name] = torch.zeros_like(x)
    env = make_env(spec, inst, tensors)
    env.detach_stopgrad = False  # the update is derived: training gradients flow through stopgrad (`Env`)
    assigns = prog.tied_assigns if tied else prog.assigns
    values = list(zip([a.target.name for a in assigns], bind_input(spec, inst, *(a.value for a in assigns))))
    for _ in range(steps or prog.steps):
        new = {}
        for target, value in values:
            env.tensors.update(new)
            _clear_step_cache(env)
            v = evaluate(value, env)
            b, t = x.shape[:2]
            new[target] = v.tensor.expand(b, t, *v.tensor.shape[2:])
            env.tensors[target] = new[target]
        env.tensors.update(new)
    return env.tensors[spec.state.name]


def _clear_step_cache(env: Env) -> None:
    """Keep cached hoisted values (computed once); drop everything that depends on the state."""
    from .ir_nodes import Let

    env.cache = {k: v for k, v in env.cache.items() if isinstance(v[0], Let)}


def instance_from_params(prog: UpdateProgram, raw: dict[str, torch.Tensor], x: torch.Tensor,
                         context: torch.Tensor | None = None, input: torch.Tensor | None = None) -> Instance:
    """The instance a generated module sees: its raw parameters (constrained here) and token tensors.

    This is how generated code is tested against the reference interpreter (`run_program`).
    """
    spec = prog.spec
    scalars = _base_scalars(prog)
    params: dict[str, torch.Tensor] = {}
    for name, p in prog.params.items():
        _place(prog, name, constrain(p, raw[name]), params, scalars)
    ctx = (x if context is None else context) if spec.context is not None else None
    inp = (x if input is None else input) if spec.input is not None else None
    return Instance(params, scalars, x, ctx, inp, x.shape[1])
