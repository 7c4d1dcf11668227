"""`energy check`: prove each derived update against autograd and SymPy, in float64.

Checks, per energy:
  gradient    the derived ∇F equals torch.autograd's gradient of F (several seeds)
  sympy       `sympy.diff` of an explicit small instance agrees with the derived gradient
  hessian     (newton, taylor >= 1) derived Hessian-vector products equal autograd's double backward
  update      the whole update program equals the optimizer replayed on autograd (gradient, Hessian, per head)
  causality   the update of token i ignores context tokens outside its relation
  own token   the energy and the update are finite where the state is its own context token, input, or both
  descent     a small step along the update lowers F; concave energies and steps that overshoot are reported
  definite    preconditioners claimed positive-definite are; dplr may be indefinite
  tying       the untied update equals the tied one with the new params at the (scaled) tied values
  params      every learned param gets a gradient through the update (one that gets none never trains)
  expect      the `expect` clause holds, or a counterexample is printed

descent and definite, the optimizer's properties, are in `optimizer_checks.py`; what a check reports and how
errors are measured, in `check_results.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

import sympy as sp
import torch

from . import ir, sympy_instance
from .calculus import directional
from .check_results import SEEDS, TOL, CheckResult, _abs, _non_finite, _one_thread, _Worst, token_errors
from .instance import Instance, eval_tokens, evaluate_on, random_instance, run_program
from .optimizer_checks import check_definite, check_descent, check_head_maps
from .optimizers import UpdateProgram
from .replay import (
    autograd_gradient,
    autograd_hvp,
    energy_of_state,
    point_value,
    replayed_direction,
    scalar_value,
)

__all__ = ["CheckResult", "as_json", "check_definite", "check_descent", "run_checks"]


def check_gradient(prog: UpdateProgram) -> CheckResult:
    worst = _Worst("the derived ∇F", "autograd's ∇F")
    for seed in SEEDS:
        inst = random_instance(prog, seed=seed)
        at = point_value(prog, inst, inst.x)
        g_auto = autograd_gradient(prog, inst, at)
        g_derived = eval_tokens(prog.spec, prog.gradient, inst, {prog.point.name: at})
        worst.add(g_derived, g_auto, seed)
    return worst.result("gradient", TOL, f"derived ∇F = autograd, {len(SEEDS)} seeds "
                        f"(rel. error {worst.error:.1e})")


# the sympy row builds every parameter and token as SymPy numbers, about 0.2 ms each on the CPU box (MHA at d = 64:
# 16,640 numbers, 3.5 s; d = 128: 66,048, 13 s; d = 256: 49 s): past this many it is skipped, saying why
SYMPY_MAX_NUMBERS = 20_000


def check_sympy(prog: UpdateProgram) -> CheckResult:
    if any(isinstance(n, ir.StopGrad) for n in ir.nodes(prog.spec.energy)):
        return CheckResult("sympy", "skip", "stopgrad has no counterpart in sympy.diff; autograd check only")
    seq = 3
    numbers = sympy_instance.instance_size(prog, seq)
    if numbers > SYMPY_MAX_NUMBERS:
        return CheckResult("sympy", "skip", f"skipped at these dims: the explicit instance would hold {numbers:,} "
                           f"numbers, over {SYMPY_MAX_NUMBERS:,} (about 0.2 ms of sympy.diff each); the autograd "
                           "checks ran at them. For this row, check at smaller dims: the derivation is the same")
    try:
        grads, info = sympy_instance.gradient_at(prog, seed=7, seq=seq)
    except sympy_instance.NotReal as e:
        return CheckResult("sympy", "fail", f"not real: {e}")
    except RecursionError:  # SymPy recurses per level of nesting: tanh(tanh(...)) 140 deep (the parser takes 200)
        return CheckResult("sympy", "skip", "skipped: the energy nests too deeply for sympy.diff (Python's recursion "
                           "limit); the autograd checks ran")
    spec = prog.spec
    dt = torch.float64
    tensors: dict[str, torch.Tensor] = {}
    for name, v in info["values"].items():
        if name.endswith("@ctx"):
            ctx_shape = tuple(spec.size(s) for s in spec.context.shape)
            tensors[name] = torch.stack([_to_tensor(tok).reshape(ctx_shape) for tok in v]).unsqueeze(0)
        elif name != prog.point.name:
            declared = prog.params.get(name)
            t = _to_tensor(v)
            tensors[name] = t.reshape(tuple(spec.size(s) for s in declared.shape)) if declared else t
    scal = {s: float(v) for s, v in info["scalars"].items()}
    shape = tuple(spec.size(s) for s in prog.point.shape)
    x = torch.zeros((1, seq) + shape, dtype=dt)
    flat = torch.tensor([float(v) for v in info["point"].values()], dtype=dt)
    x[0, info["position"]] = flat.reshape(shape)
    ctx = tensors.pop(spec.context.name + "@ctx") if spec.context is not None else None
    inp = None
    if spec.input is not None:
        in_shape = tuple(spec.size(s) for s in spec.input.shape)  # its own shape, not the state's
        inp = ctx if (spec.context is not None and spec.input.name == spec.context.name) else \
            tensors.pop(spec.input.name).reshape((1, 1) + in_shape).expand(1, seq, *in_shape)
    inst = Instance(tensors, scal, x, ctx, inp, seq)
    derived = eval_tokens(spec, prog.gradient, inst, {prog.point.name: x})[0, info["position"]].reshape(-1)
    worst = _Worst("the derived ∇F", "sympy.diff's ∇F")
    worst.add(derived, torch.tensor(grads, dtype=dt))
    return worst.result("sympy", 1e-8, f"sympy.diff of an explicit instance agrees (rel. error {worst.error:.1e})")


def _to_tensor(v) -> torch.Tensor:
    if isinstance(v, list):
        return torch.stack([_to_tensor(a) for a in v])
    import sympy as sp

    if isinstance(v, sp.Matrix):
        t = torch.tensor([[float(a) for a in row] for row in v.tolist()], dtype=torch.float64)
        return t[:, 0] if v.shape[1] == 1 else t
    return torch.tensor(float(v), dtype=torch.float64)


def check_hessian(prog: UpdateProgram) -> CheckResult | None:
    opt = prog.spec.optimizer
    if opt.kind != "newton" or int(opt.hyper["taylor"].value) == 0:  # taylor 0 is gd: no Hessian in the update
        return None
    worst = _Worst("the derived Hessian-vector product", "autograd's double backward")
    for seed in SEEDS:
        inst = random_instance(prog, seed=seed)
        at = point_value(prog, inst, inst.x)
        g = torch.Generator().manual_seed(seed + 100)
        v = torch.randn(at.shape, generator=g, dtype=at.dtype)
        vname = "hvp_direction"
        vvar = ir.Var(vname, "input", prog.point.shape)
        hv_expr = directional(prog.gradient, prog.point, vvar)
        inst.params[vname] = v
        hv = evaluate_on(prog.spec, hv_expr, inst, {prog.point.name: at, vname: v}).tensor.expand_as(at)
        worst.add(hv, autograd_hvp(prog, inst, at)[1](v), seed)
    return worst.result("hessian", TOL, f"Hessian-vector products = autograd double backward "
                        f"(rel. error {worst.error:.1e})")


def check_update(prog: UpdateProgram) -> CheckResult:
    """Run the optimizer on directions from autograd alone and compare with the derived program."""
    spec = prog.spec
    opt = spec.optimizer
    worst = _Worst("the derived update", "the optimizer replayed on autograd")
    for seed in SEEDS:
        inst = random_instance(prog, seed=seed)
        eta = float(scalar_value(inst, opt.hyper["eta"].symbol))
        beta = float(scalar_value(inst, opt.hyper["beta"].symbol)) if "beta" in opt.hyper else 0.0
        x = inst.x
        m = torch.zeros_like(x)
        for _ in range(opt.steps):
            if opt.kind in ("gd", "newton"):
                x = x - eta * replayed_direction(prog, inst, x)
            else:
                at = x - beta * m if opt.kind == "nag" else x
                m = beta * m + replayed_direction(prog, inst, at)
                x = x - eta * m
        worst.add(run_program(prog, inst, tied=True), x, seed)
    what = opt.kind + (" per head" if opt.per_head else "") + \
        (f", precondition {opt.precondition}" if opt.precondition else "")
    return worst.result("update", TOL, f"{what} × {opt.steps} step(s) replayed on autograd = derived program "
                        f"(rel. error {worst.error:.1e})")


def check_own_token(prog: UpdateProgram) -> CheckResult | None:
    """A model's layer starts from the state at its own token's stream, which the context and the input hold
    too. An energy with a kink where the state meets a context token or its input (`norm(z - h[j])`,
    `norm(z - h)`, not squared) is NaN there, and random points never meet it: evaluate there."""
    spec = prog.spec
    inst = random_instance(prog, seed=0)
    starts: list[tuple[str, torch.Tensor, Instance]] = []
    shape = tuple(spec.state.shape)
    own_context = spec.context is not None and shape == tuple(spec.context.shape)
    own_input = spec.input is not None and shape == tuple(spec.input.shape) and inst.input is not inst.context
    if own_context:
        starts.append(("its own context token", inst.context, inst))
    if own_input:
        starts.append(("its own input", inst.input, inst))
    if own_context and own_input:  # a model's first layer: state, input and context are all the token's stream
        same = Instance(inst.params, inst.scalars, inst.x, inst.context, inst.context, inst.seq_len)
        starts.append(("its own input and context token at once", inst.context, same))
    if not starts:
        return None
    first_step = "(as at a model layer's first step)"
    for what, x, at in starts:
        where = f"where the state is {what} {first_step}"
        bad = _non_finite(eval_tokens(spec, energy_of_state(prog), at, {spec.state.name: x}))
        if bad is not None:
            return CheckResult("own token", "fail", f"the energy is {bad} {where}")
        for label, tied in [("update", True)] + ([("untied update", False)] if spec.untie_rules else []):
            bad = _non_finite(run_program(prog, at, x0=x, tied=tied))
            if bad is not None:
                return CheckResult("own token", "fail", f"the {label} is {bad} {where}: the energy is not "
                                   "differentiable there, or its derivation is not finite there (a norm of a "
                                   "difference: `norm(z - h)` has no gradient at 0, and `huber(norm(z - h), 1)`, "
                                   "smooth there, is derived through it, 0/0; write such energies in "
                                   "`(z - h) . (z - h)`)")
    places = " and ".join(what for what, _, _ in starts[:2])
    return CheckResult("own token", "ok", f"energy and update finite where the state is {places} {first_step}")


def check_causality(prog: UpdateProgram) -> CheckResult | None:
    spec = prog.spec
    if spec.context is None:
        return None
    info = spec.indices[spec.context.index]
    inst = random_instance(prog, seed=3, seq=6)
    base = run_program(prog, inst, tied=True)
    worst = _Worst("the update with later context tokens moved", "the update")
    noise = torch.Generator().manual_seed(33)
    for cut in range(1, inst.seq_len):
        # random moves: a uniform shift is what a norm of the context (layernorm(h[j])) removes, hiding a leak.
        # Only the context moves, also where the input shares its name: token i's own input is not its context
        moved = Instance(inst.params, inst.scalars, inst.x, inst.context.clone(), inst.input, inst.seq_len)
        later = moved.context[:, cut:]
        later += torch.randn(later.shape, generator=noise, dtype=later.dtype)
        out = run_program(prog, moved, tied=True)
        # tokens i < cut may not see context tokens j >= cut (j <= i); with j < i, neither may i = cut
        upto = cut + 1 if info.strict else cut
        worst.add(out[:, :upto], base[:, :upto], metric=_abs)
    rel = "j < i" if info.strict else "j <= i"
    leak = "" if worst.error == 0.0 else f" (leak {worst.error:.1e})"
    return worst.result("causality", 0.0, f"token i ignores context outside {rel}{leak}")


def check_tying(prog: UpdateProgram) -> CheckResult | None:
    """Untie: the layer's update (the untied one the module runs, with its constant factors absorbed) equals
    the tied one when each new param takes the tied value it replaced, times the factor it absorbed."""
    spec = prog.spec
    if not spec.untie_rules:
        return None
    worst = _Worst("the untied update", "the tied update")
    for seed in SEEDS:
        inst = random_instance(prog, seed=seed)
        tensors = {spec.state.name: inst.x}
        for pattern, repl in spec.untie_rules:
            base = repl
            idx = []
            while isinstance(base, ir.Index):
                idx.insert(0, base.index)
                base = base.base
            val = evaluate_on(spec, pattern, inst, tensors)
            t = val.tensor[0, 0]
            order = [val.idx.index(i) for i in idx if i in val.idx]
            t = t.permute(*order, *range(len(val.idx), t.dim()))
            for axis, i in enumerate(idx):  # an index the rule adds (`W2 -> Wv[k]`): the tied value in each
                if i not in val.idx:
                    t = t.unsqueeze(axis)
            t = t.expand(inst.params[base.name].shape).contiguous()
            scale = evaluate_on(spec, ir.scalar(prog.untie_scales.get(base.name, 1)), inst, tensors).tensor
            inst.params[base.name] = t * scale.reshape(())
        worst.add(run_program(prog, inst), run_program(prog, inst, tied=True), seed)
    return worst.result("tying", TOL, f"the untied update equals the tied one with the new params at the tied "
                        f"values ({prog.untie_hits} replacements, rel. error {worst.error:.1e})")


def check_params(prog: UpdateProgram) -> CheckResult | None:
    """Each learned param reaches the update the module runs. One that does not gets no gradient and never trains:
    a self-token bias under `where j < i` (the context never holds the token itself), a term the update does not
    depend on (a param added to F alone), a param seen only through `step`. Random values of every learned param,
    as `random_instance` draws them, keep one zero param from hiding another's gradient (a product `A @ B`)."""
    learned = [name for name, p in prog.params.items() if p.learn]
    if not learned:
        return None
    reached: set[str] = set()
    for seed in SEEDS[:2]:
        inst = random_instance(prog, seed=seed)
        leaves = {name: _learned_leaf(prog, inst, name) for name in learned}
        out = run_program(prog, inst)
        if not out.requires_grad:
            break
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
        grads = torch.autograd.grad((out * weights).sum(), list(leaves.values()), allow_unused=True)
        reached |= {name for name, g in zip(leaves, grads) if g is not None and bool(g.abs().sum() > 0)}
    idle = [name for name in learned if name not in reached]
    if idle:
        names, one = ", ".join(f"`{name}`" for name in idle), len(idle) == 1
        it = "it" if one else "them"
        return CheckResult("params", "warn", f"{names} get{'s' if one else ''} no gradient through the update on 2 "
                           f"random instances, so training never moves {it}: masked out (a self-token term under "
                           f"`where j < i`), outside the update, or seen only through `step`? Declare {it} `fixed`, "
                           f"or remove {it}")
    return CheckResult("params", "ok", f"every learned param ({len(learned)}) gets a gradient through the update")


def _learned_leaf(prog: UpdateProgram, inst: Instance, name: str) -> torch.Tensor:
    """Make a param's value in `inst` a leaf that records gradients (where `_place` put it: tensors by name,
    scalars by symbol, a learned optimizer hyper-parameter under its hyper's symbol too)."""
    if name in inst.params:
        inst.params[name] = leaf = inst.params[name].detach().clone().requires_grad_()
        return leaf
    spec = prog.spec
    symbols = [spec.scalar_params.get(name) or sp.Symbol(name, real=True)]
    if name.startswith("opt_"):
        symbols.append(spec.optimizer.hyper[name[4:]].symbol)
    leaf = torch.as_tensor(inst.scalars[symbols[0]], dtype=torch.float64).detach().clone().requires_grad_()
    for symbol in symbols:
        inst.scalars[symbol] = leaf
    return leaf


def check_expect(prog: UpdateProgram) -> list[CheckResult]:
    spec = prog.spec
    out = []
    for what, (expr, span) in spec.expects.items():
        want = prog.point.shape if what == "gradient" else spec.state.shape  # its shape is the semantics' to check
        worst, where = _Worst(f"the derived {what}", f"the expected {what}"), None
        for seed in SEEDS + (5, 6):
            inst = random_instance(prog, seed=seed)
            if what == "update":
                derived = run_program(prog, inst, tied=True)
            elif what == "direction":
                derived = eval_tokens(spec, prog.tied_direction, inst, {spec.state.name: inst.x})
            else:
                derived = eval_tokens(spec, prog.gradient, inst, {prog.point.name: point_value(prog, inst, inst.x)})
            at = {spec.state.name: inst.x}
            if spec.via is not None:
                at[spec.via[0].name] = point_value(prog, inst, inst.x) if prog.point is not spec.state else \
                    eval_tokens(spec, spec.via[1], inst, {spec.state.name: inst.x})
            expected = eval_tokens(spec, expr, inst, at)
            expected = expected.reshape(*expected.shape, *(1,) * (derived.dim() - expected.dim())).expand_as(derived)
            if worst.add(derived, expected, seed) and worst.not_finite is None:  # the token of the worst error
                b, t = divmod(int(token_errors(derived, expected).argmax()), derived.shape[1])
                where = (seed, t, derived[b, t].reshape(-1), expected[b, t].reshape(-1))
        if worst.not_finite is not None:
            out.append(CheckResult("expect", "fail", f"`expect {what}` at {span}: not finite: {worst.not_finite}",
                                   None))
        elif worst.passed(1e-8):
            out.append(CheckResult("expect", "ok", f"`expect {what}` holds on {len(SEEDS) + 2} random instances "
                                   f"(rel. error {worst.error:.1e})", worst.error))
        else:
            seed, t, got, exp = where
            each = (f"; the expectation is a scalar, which stands for every entry of the {what} "
                    f"{ir.fmt_shape(want)}" if not expr.shape and want else "")
            at = f"seed {seed}, token {t}: {_counterexample(got, exp)}"
            if worst.near_zero(1e-8):
                out.append(CheckResult("expect", "warn", f"`expect {what}` at {span} holds against the instance's "
                                       f"largest value, but {worst.near_zero_note()} ({at})", worst.error))
            else:
                out.append(CheckResult("expect", "fail", f"`expect {what}` is refuted at {span}: {at} (rel. error "
                                       f"{worst.error:.1e}){each}", worst.error))
    return out


def _counterexample(got: torch.Tensor, expected: torch.Tensor, shown: int = 4) -> str:
    """`derived [..] vs expected [..]` around the entry that differs most, with the digits that tell them apart
    (a relative error of 1e-8 is invisible at 6)."""
    worst = int((got - expected).abs().argmax())
    lo = max(0, min(worst - 1, got.numel() - shown))
    a, b = got[lo:lo + shown].tolist(), expected[lo:lo + shown].tolist()
    for digits in range(6, 18):
        fa, fb = ([f"{v:.{digits}g}" for v in xs] for xs in (a, b))
        if fa != fb:
            break
    entries = f"entries {lo}..{lo + len(a) - 1} of {got.numel()}: " if got.numel() > shown else ""
    return f"{entries}derived [{', '.join(fa)}] vs expected [{', '.join(fb)}]"


def check_compiled(prog: UpdateProgram, build: Callable[[], torch.nn.Module]) -> CheckResult:
    """The layer `energy compile` writes (the torch backend, its fused forms) against the derived program, on the
    checks' instance in float64: the rows above prove the program, and this one carries the proof to the module
    that trains (whose code generation the examples' tests alone had covered)."""
    module = build()
    inst = random_instance(prog, seed=0)
    with torch.no_grad():
        for name, p in module.named_parameters():  # the raw values the instance's constrained ones come from
            if name not in inst.raw:
                return CheckResult("compiled", "skip", f"the module's parameter `{name}` is not one of the program's")
            p.copy_(inst.raw[name].reshape(p.shape))
        given = {"context": inst.context} if inst.context is not None else {}
        if inst.input is not None:  # one stream when input and context share a name: the module takes it twice
            given["input"] = inst.input
        got = module(inst.x, **given)
    want = run_program(prog, inst)
    if not torch.equal(got.isfinite(), want.isfinite()):
        return CheckResult("compiled", "fail", "the module is not finite where the derived program is, or the other "
                           "way round (please report this with the spec)")
    ok = got.isfinite()
    error = float((got[ok] - want[ok]).abs().max() / want[ok].abs().max().clamp_min(1e-300)) if ok.any() else 0.0
    status = "ok" if error <= TOL else "fail"
    detail = f"the generated module (torch backend) = the derived program (rel. error {error:.1e})"
    return CheckResult("compiled", status, detail if status == "ok" else f"{detail}: please report this with the "
                       "spec; `energydsl.codegen.module_class(derived, lowering=False)` builds the unfused form",
                       error)


def run_checks(prog: UpdateProgram, build: Callable[[], torch.nn.Module] | None = None) -> list[CheckResult]:
    """Every row of `energy check` for one energy; `build` makes its layer in float64 (the `compiled` row)."""
    compiled = (("compiled", lambda prog: check_compiled(prog, build)),) if build is not None else ()
    with _one_thread():
        results = [check_gradient(prog)]
        for row, fn in (("sympy", check_sympy), ("hessian", check_hessian), ("update", check_update), *compiled,
                        ("causality", check_causality), ("own token", check_own_token), ("descent", check_descent),
                        ("definite", check_definite), ("head map", check_head_maps), ("tying", check_tying),
                        ("params", check_params)):
            try:
                r = fn(prog)
            except Exception as e:  # noqa: BLE001 -- a check that cannot run is reported, not crashed on
                r = CheckResult(row, "fail", f"could not run: {type(e).__name__}: {e}")
            if r is not None:
                results.append(_located(r, prog))
        results.extend(check_expect(prog))
    return results


def _located(r: CheckResult, prog: UpdateProgram) -> CheckResult:
    """A descent or definite failure names the `optimizer` clause it blames, as a refuted `expect` names its own."""
    span = prog.spec.optimizer.span
    if r.status != "fail" or r.name not in ("descent", "definite") or span is None:
        return r
    return CheckResult(r.name, r.status, f"{r.detail} (`optimizer` at {span})", r.max_error)


def as_json(results: list[CheckResult]) -> list[dict]:
    return [asdict(r) for r in results]
