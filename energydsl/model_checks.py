"""`energy check` of a `model`: what the composed language model must hold beyond its energies' checks.

  causality   the logits at position t do not move when the tokens after t change. Each energy's causality is
              proven on the reference interpreter; this proves the composition as it runs: the generated modules,
              embeddings, norms, streams and across-layer momentum that wire them.
  params      every parameter gets a nonzero gradient from the loss within the first steps of plain gradient
              descent. One that gets none never trains (a masked self-token bias, factors that all start at 0).
  dims        every header dim is read (by a clause, another dim's default, a stage or a block): `layers = 8`
              without `repeat layers` builds one layer; a warning, as a dim may be kept for later on purpose.

Both run on the torch backend in float64, at the model's dims: a model's defaults are small enough to check.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .check_results import CheckResult, _non_finite, _one_thread
from .errors import first_few
from .number_text import plain_number

if TYPE_CHECKING:
    from .composition import ModelPlan

# A leak makes a difference of the logits' own size; float64 arithmetic on the same inputs makes none, or one
# near 1e-16 relative where a kernel's blocking follows the sequence length.
LEAK_TOL = 1e-10
PARAM_STEPS = 3  # a zero factor's partner gets its gradient from the second step on
MAX_CHECK_TOKENS = 12


def check_model(model: torch.nn.Module, seed: int = 0) -> list[CheckResult]:
    """The model checks of a freshly built `LanguageModel` (it is moved to float64 and its weights are changed)."""
    with _one_thread():
        model = model.double().eval()
        generator = torch.Generator().manual_seed(seed)
        vocab, T = model.plan.dims["vocab"], min(model.block_size, MAX_CHECK_TOKENS)
        idx = torch.randint(int(vocab), (2, T), generator=generator)
        rows = [_causality(model, idx, generator), _params(model, idx, generator)]
        return rows + [row for row in (_across_layers(model.plan),) if row is not None]


def _across_layers(plan: ModelPlan) -> CheckResult | None:
    """The `across` row: β of the momentum across layers outside [0, 1). The energy's own momentum check fails
    β ≥ 1 (its steps grow without bound); across a finite stack of layers the first layer's force is only
    weighted β^(L-1) in the last, so it is a warning, naming that weight. A learned β starts there."""
    if plan.across is None:
        return None
    kind, hyper = plan.across
    beta, learned = hyper["beta"]
    start = " starts at" if learned else " ="
    if beta >= 1:
        exponent = (plan.layers - 1) * math.log10(beta)  # β^(L-1) in logs: a float power overflows past 1e308
        weight = f"{10 ** exponent:.3g}" if exponent < 15 else "more than 1e15"
        layers = "the 1 layer" if plan.layers == 1 else f"the {plan.layers} layers"
        return CheckResult("across", "warn", f"`across layers {kind}`: β{start} {plain_number(beta)} ≥ 1, so the "
                           f"momentum never decays: over {layers} the first layer's update enters the last one's "
                           f"step with weight {weight}; β is usually in [0, 1)")
    if beta < 0:
        return CheckResult("across", "warn", f"`across layers {kind}`: β{start} {plain_number(beta)} < 0, so each "
                           "layer reverses part of the last (negative momentum); β is usually in [0, 1)")
    return CheckResult("across", "ok", f"`across layers {kind}`: β{start} {plain_number(beta)}, in [0, 1)")


def dims_row(model: str, unread: list[str]) -> CheckResult:
    """The `dims` row: a warning naming the header dims that nothing of `model` reads (they change nothing)."""
    if not unread:
        return CheckResult("dims", "ok", "every header dim is read by a clause, a stage or another dim")
    names = first_few([f"`{n}`" for n in unread])
    hint = " (no `repeat layers`)" if "layers" in unread else ""
    one = len(unread) == 1
    return CheckResult("dims", "warn", f"{names} {'is' if one else 'are'} read by nothing in model `{model}`{hint}: "
                       f"no clause, stage or other dim uses {'it' if one else 'them'}, so setting "
                       f"{'it' if one else 'them'} changes nothing")


def _causality(model: torch.nn.Module, idx: torch.Tensor, generator: torch.Generator) -> CheckResult:
    vocab, T = int(model.plan.dims["vocab"]), idx.shape[1]
    if vocab < 2 or T < 2:
        return CheckResult("causality", "skip", f"nothing to move: vocab {vocab}, context {model.block_size}")
    not_finite = ("the logits are {} {}: the model's output is not finite, so whether it sees the future cannot be "
                  "told (the layers' `own token` rows, or `energy check` of the model's energies, may say why)")
    with torch.no_grad():
        base = model(idx)
        if (bad := _non_finite(base)) is not None:
            return CheckResult("causality", "fail", not_finite.format(bad, "on random tokens"))
        scale = float(base.abs().max()) or 1.0
        worst, first = 0.0, None  # the largest leak, and the first position whose future leaks
        for cut in range(1, T):
            moved = idx.clone()  # every later token replaced by another one
            shift = torch.randint(1, vocab, moved[:, cut:].shape, generator=generator)
            moved[:, cut:] = (moved[:, cut:] + shift) % vocab
            out = model(moved)
            if (bad := _non_finite(out)) is not None:
                return CheckResult("causality", "fail", not_finite.format(bad, f"once the tokens from {cut} on "
                                                                               "changed"))
            leak = float((out[:, :cut] - base[:, :cut]).abs().max()) / scale
            if not leak <= LEAK_TOL and first is None:  # NaN leaks too
                first = cut
            if math.isnan(leak) or leak > worst:  # a NaN stays the worst
                worst = leak
    if first is not None:
        return CheckResult("causality", "fail", f"the logits before position {first} moved when the tokens from "
                           f"{first} on changed (by up to {worst:.1e} of their size): the model sees the future",
                           worst)
    return CheckResult("causality", "ok", f"the logits at position t ignore the tokens after t ({T} positions, "
                       f"leak {worst:.1e})", worst)


def _params(model: torch.nn.Module, idx: torch.Tensor, generator: torch.Generator) -> CheckResult:
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not named:
        return CheckResult("params", "skip", "the model has no trained parameters")
    targets = torch.randint(int(model.plan.dims["vocab"]), idx.shape, generator=generator)
    moved: set[str] = set()
    for _ in range(PARAM_STEPS):
        logits = model(idx)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        with torch.no_grad():
            for (name, p), g in zip(named, grads, strict=True):
                if g is not None and bool(g.ne(0).any()):
                    moved.add(name)
                    p.sub_(0.1 * g / (g.norm() + 1e-12))  # a step of fixed size: small and large gradients alike
    idle = [name for name, _ in named if name not in moved]
    if idle:
        shown = first_few([f"`{name}`" for name in idle])
        them = "them" if len(idle) > 1 else "it"
        why = idle_reason(idle, model.plan.layers) or (f"the `params` check of the energy that declares {them} says "
                                                       "why, where the energy alone shows it")
        return CheckResult("params", "warn", f"{shown} got no gradient from the loss in {PARAM_STEPS} steps of "
                           f"gradient descent from initialisation, so training never moves {them} ({why})")
    return CheckResult("params", "ok", f"every parameter ({len(named)}) gets a gradient from the loss within "
                       f"{PARAM_STEPS} steps from initialisation")


def idle_reason(idle: list[str], layers: int) -> str | None:
    """Why parameters of the model itself get no gradient, which no energy's check can say (None: not known)."""
    if idle == ["across_beta"] and layers == 1:
        return ("`across_beta` scales the velocity that the layers before carry across, and with one layer there is "
                "none: declare it without `learn`, or stack more layers")
    return None
