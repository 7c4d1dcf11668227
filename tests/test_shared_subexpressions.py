"""Derived updates are DAGs: passes over them visit each shared node once.

A Newton direction's Hessian-vector products reuse the gradient, so its tree, written out, is exponentially
larger than its distinct nodes (tests/data/newton-through-a-norm.energy: millions of nodes). Derive, print,
hash and compile each walked it as a tree: over 5 minutes to derive, 9 to print, 9 to compile. Each test
below is guarded by an alarm, so that a pass gone exponential again fails instead of hanging the suite.
"""

import os
from collections import Counter
from pathlib import Path

import sympy as sp
import torch
from conftest import within as guard

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton

import energydsl  # noqa: E402
from energydsl import ir  # noqa: E402
from energydsl.codegen import energy_source, module_class  # noqa: E402
from energydsl.codegen.gated_epilogue import _elementwise_over  # noqa: E402
from energydsl.codegen.simplify import simplify  # noqa: E402
from energydsl.instance import instance_from_params, run_program  # noqa: E402
from energydsl.optimizers import _hoist  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEPTH = 48  # 2^48 nodes written out: a tree walk never finishes


def within(seconds: int):
    return guard(seconds, "a pass walks the DAG as a tree")


def _deep(x: ir.Expr, depth: int) -> ir.Expr:
    """e_{n+1} = tanh(e_n) ⊙ e_n: each level reads the one below twice."""
    e = x
    for _ in range(depth):
        e = ir.mul(ir.func("tanh", e), e)
    return e


X = ir.Var("x", "state", (sp.Integer(4),))
Y = ir.Var("y", "state", (sp.Integer(4),))


def test_counts_and_nodes_agree_with_the_tree_walk():
    e = _deep(X, 4)
    assert ir.occurrences([e, e]) == Counter(ir.walk(e)) + Counter(ir.walk(e))
    assert list(ir.occurrences([e])) == list(dict.fromkeys(ir.walk(e)))  # in the order walk meets them
    assert list(ir.nodes(e)) == list(dict.fromkeys(ir.walk(e)))


def test_a_deep_dag_is_hashed_counted_fingerprinted_and_substituted_once_per_node():
    with within(20):
        e = _deep(X, DEPTH)
        assert hash(e) == hash(_deep(X, DEPTH))  # (== of two such DAGs built apart compares their keys, trees)
        assert ir.occurrences([e])[X] == 2**DEPTH and ir.tree_size([e]) > 2**DEPTH
        assert ir.fingerprint(e) == ir.fingerprint(_deep(X, DEPTH)) != ir.fingerprint(_deep(X, DEPTH - 1))
        assert ir.fingerprint(e) != ir.fingerprint(_deep(Y, DEPTH))
        swapped = ir.substitute(e, {X: Y})
        assert ir.fingerprint(swapped) == ir.fingerprint(_deep(Y, DEPTH)) and X not in set(ir.nodes(swapped))


def test_substitute_keeps_the_subtrees_it_does_not_change():
    """A subtree the mapping does not reach is returned as the same object, with its cached hash, size and the
    equalities already proven. Rebuilding it made every round of `name_repeats` compare fresh copies node by
    node (`_same_dag`): `energy derive` of a taylor-3 Newton step through a layernorm spent 6 of its 8 s there."""
    untouched = ir.func("tanh", _deep(X, 6))
    e = ir.add(ir.mul(untouched, ir.func("tanh", Y)), Y)
    out = ir.substitute(e, {Y: X})
    assert out is not e and any(node is untouched for node in ir.nodes(out))
    assert ir.substitute(e, {ir.Var("w", "state", (sp.Integer(4),)): X}) is e


def test_codegen_and_hoisting_passes_visit_a_deep_dag_once_per_node():
    with within(20):
        e = _deep(X, DEPTH)
        assert ir.fingerprint(simplify(e)) == ir.fingerprint(e)
        assert _elementwise_over(e, X)
        assert not _elementwise_over(ir.func("sqrt", ir.dot(e, e)), X)  # a dot over its entries is not
        w = ir.Var("W", "param", (sp.Integer(4), sp.Integer(4)))
        weights = ir.matmul(w, _deep(ir.Var("c", "param", (sp.Integer(4),)), DEPTH))
        hoisted: list[ir.Let] = []
        out = _hoist(ir.mul(weights, e), hoisted, set())  # the parameters' part is named, once
        assert len(hoisted) == 1 and ir.fingerprint(hoisted[0].body) == ir.fingerprint(weights)
        assert hoisted[0] in set(ir.nodes(out))


def test_a_taylor_two_newton_step_through_a_norm_derives_prints_hashes_and_compiles():
    spec = energydsl.load(ROOT / "tests/data/newton-through-a-norm.energy")
    with within(120):
        derived = spec.energy()
        text = derived.equations()
    assert "direction" in text and "where" in text  # its repeats are named, so it prints in a page
    assert len(text) < 20_000
    with within(60):
        digest = derived.equation_hash()
    assert digest == energydsl.load(ROOT / "tests/data/newton-through-a-norm.energy").energy().equation_hash()
    with within(120):
        source = energy_source(derived, "triton")
    assert "@triton.jit" in source  # the gated epilogue (GELU′) is fused


def test_the_generated_newton_step_through_a_norm_computes_the_derived_update():
    """float64 against the interpreter: the displacement and the gradients of x and every parameter."""
    derived = energydsl.load(ROOT / "tests/data/newton-through-a-norm.energy").energy()
    torch.manual_seed(0)
    for backend in ("torch", "triton"):
        module = module_class(derived, backend)().double()
        with torch.no_grad():
            for p in module.parameters():
                p.add_(0.3 * torch.randn_like(p))
        x = module.example_input(2, 5).double().requires_grad_()
        params = list(module.parameters())
        raw = dict(module.named_parameters()) | dict(module.named_buffers())
        got = module(x, delta=True)
        want = run_program(derived.program, instance_from_params(derived.program, raw, x)) - x
        w = torch.randn_like(got)
        grads = torch.autograd.grad((got * w).sum(), [x, *params])
        ref = torch.autograd.grad((want * w).sum(), [x, *params])
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
        for name, a, b in zip(["x", *(n for n, _ in module.named_parameters())], grads, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=lambda m, n=f"{backend} {name}": f"{n}: {m}")
        assert want.abs().max() > 1e-3


def test_printing_each_node_once_keeps_the_temporary_nodes_it_prints_apart():
    """`show` memoises per node; the sign it takes out of a coefficient makes a temporary node, which must
    not share a memo entry with a later temporary at the same address (the Energy Transformer's `− 1/2 ⟨…⟩`
    printed as `− sqrt(d)/sqrt(heads) ⟨…⟩` while the memo was keyed by address alone)."""
    from energydsl.printing import show

    terms = [ir.mul(ir.Scalar(sp.Rational(-k, 97)), ir.Var(f"v{k}", "state", (sp.Integer(4),))) for k in range(1, 60)]
    text = show(ir.add(*terms))
    for k in range(1, 60):
        assert f"({sp.Rational(k, 97)}) v{k}" in text or f"{sp.Rational(k, 97)} v{k}" in text, (k, text[:300])


NEWTON_TAYLOR_3_THROUGH_LAYERNORM = """energy O(d = 4) {
  state z[d] via u = layernorm(z)
  param W[d, d] ~ normal(0, 0.5)
  global F = norm(W @ u)
  optimizer newton(taylor = 3)
}
"""


def test_naming_the_repeats_of_a_taylor_three_step_does_not_write_them_out(tmp_path):
    """`where` sized each repeat by printing it, a tree over the DAG: 24 GB, then the kernel killed the process
    (found by generating energies). Under a 3 GiB address-space limit, derive and compile finish."""
    import resource
    import subprocess
    import sys

    spec = tmp_path / "o.energy"
    spec.write_text(NEWTON_TAYLOR_3_THROUGH_LAYERNORM)

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    env = dict(os.environ, PYTHONPATH=str(ROOT), ENERGYDSL_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    for args in (["derive", str(spec)], ["compile", str(spec), "-o", str(tmp_path / "o.py")]):
        r = subprocess.run([sys.executable, "-m", "energydsl", *args], capture_output=True, text=True, env=env,
                           timeout=300, preexec_fn=limit)
        assert r.returncode == 0, r.stderr[-1000:]
    assert "where" in r.stderr + (tmp_path / "o.py").read_text()


def test_a_taylor_two_step_through_a_norm_with_an_l2_score_compiles_in_seconds():
    """Ordering each dot's operands printed both keys at every comparison: 35 s for the torch source and 43 s
    more for the triton one, 4.5 million SymPy prints (found by generating energies); now a few seconds."""
    spec = energydsl.load("""energy S(d = 4) {
  state z[d] via u = layernorm(z)
  context c[j, d] where j <= i
  param K[d, d] ~ normal(0, 0.5)
  global F = -logsumexp[j](-((u - (K @ c[j])) . (u - (K @ c[j]))) / 2)
  optimizer newton(taylor = 2)
}
""")
    with within(30):
        derived = spec.energy()
        sources = [energy_source(derived, backend) for backend in ("torch", "triton")]
    assert all("def forward" in s for s in sources)


def test_untie_visits_each_shared_node_once_and_counts_every_path():
    """`energy derive` spent 48 of its 60 s in untie's walk over a Taylor-3 Newton direction (api.tying probes
    each parameter), a tree walk of the DAG (found by generating energies). The count of replacements, which
    `check` prints, is still one per path."""
    from energydsl.calculus import untie

    w, a = ir.Var("W", "param", (sp.Integer(4), sp.Integer(4))), ir.Var("A", "param", (sp.Integer(4), sp.Integer(4)))
    e: ir.Expr = ir.matmul(w, ir.Var("z", "state", (sp.Integer(4),)))
    for _ in range(DEPTH):  # e + A e: two paths to the level below
        e = ir.add(e, ir.matmul(a, e))
    new = ir.Var("Wv", "param", w.shape)
    with within(20):
        out, hits = untie(e, [(w, new)])
    assert hits == [2**DEPTH]  # one rule
    assert not any(n == w for n in ir.nodes(out)) and any(n == new for n in ir.nodes(out))
