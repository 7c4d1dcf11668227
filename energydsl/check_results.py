"""What a check reports (`CheckResult`) and how it measures: the worst error over several comparisons, in
which a NaN fails instead of vanishing, and torch on one thread while the tiny float64 checks run. Shared by
`checks.py` (each energy's update), `optimizer_checks.py` (descent, definiteness) and `model_checks.py`."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

TOL = 1e-9
SEEDS = (0, 1, 2)


@dataclass
class CheckResult:
    name: str
    status: str  # ok | fail | warn | skip
    detail: str
    max_error: float | None = None

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "warn", "skip")


def token_errors(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Each token's relative error, a (B, T, ...) tensor's entry [b, t] against its own size: (B, T). A token both
    sides make exactly 0 agrees."""
    diff, size = (a - b).abs(), torch.maximum(a.abs(), b.abs())
    if a.dim() > 2:
        diff, size = diff.flatten(2).amax(-1), size.flatten(2).amax(-1)
    return torch.where(diff == 0, 0.0, diff / size)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The worst relative error, each token against its own size (`token_errors`): measured against the
    instance's largest value, one token of exp(100 h·z) ≈ 1e43 hid tokens where a claim was wholly wrong (an
    `expect gradient` missing a `+ z` held "to 1e-10")."""
    if not a.numel():
        return 0.0
    return float(token_errors(a, b).max()) if a.dim() >= 2 else _rel_to_largest(a, b)


def _rel_to_largest(a: torch.Tensor, b: torch.Tensor) -> float:
    """The worst difference against the largest value of the whole instance: what rounding reaches, however
    small a token's values are."""
    return float((a - b).abs().max() / (b.abs().max() + 1e-12)) if a.numel() else 0.0


def _abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def _non_finite(t: torch.Tensor) -> str | None:
    """Where `t` (laid out (B, T, ...) for per-token values) first holds NaN or ±inf, or None."""
    bad = ~torch.isfinite(t)
    if not bool(bad.any()):
        return None
    flat = int(bad.reshape(-1).nonzero()[0, 0])
    kind = "NaN" if bool(t.reshape(-1)[flat].isnan()) else "infinite"
    if t.dim() < 2:
        return kind
    b, tok = divmod(flat // max(1, t[0, 0].numel()), t.shape[1])
    return f"{kind} at token {tok} (batch {b})"


@dataclass
class _Worst:
    """The worst error over several comparisons, in which a non-finite value fails instead of vanishing.

    A running `max(worst, err)` drops NaN (`max(0.0, nan)` is 0.0), which reported a NaN gradient or
    update as a perfect match. Every comparison goes through `add` instead, which keeps the first
    non-finite value and says on which side (derived or reference) it was.
    """

    derived: str  # the derived side in messages, e.g. "the derived ∇F"
    reference: str  # the side it is checked against, e.g. "autograd's ∇F"
    error: float = 0.0
    not_finite: str | None = None  # e.g. "the derived ∇F is NaN at token 2 (batch 0), seed 1"
    to_largest: float = 0.0  # the worst relative error against the instance's largest value (`_rel_to_largest`)

    def add(self, derived: torch.Tensor, reference: torch.Tensor, seed: int | None = None,
            metric=_rel) -> bool:
        """Record one comparison; True when it is the worst so far (worth a counterexample)."""
        if self.not_finite is not None:
            return False
        for side, t in ((self.derived, derived), (self.reference, reference)):
            where = _non_finite(t)
            if where is not None:
                self.not_finite = f"{side} is {where}" + ("" if seed is None else f", seed {seed}")
                return True
        err = metric(derived, reference)
        if not math.isfinite(err):  # finite sides whose difference overflows
            err = math.inf
        if metric is _rel:
            self.to_largest = max(self.to_largest, _rel_to_largest(derived, reference))
        if err > self.error:
            self.error = err
            return True
        return False

    def passed(self, tol: float) -> bool:
        """Every value finite and the worst error below `tol` (`tol = 0` demands exact equality)."""
        if self.not_finite is not None:
            return False
        return self.error == 0.0 if tol == 0.0 else self.error < tol

    def near_zero(self, tol: float) -> bool:
        """Failed token by token, but held against the instance's largest value: a claim wrong only where the
        values are small, or rounding where a value is about 0 (`h − (−h) − 2h` against `(z+h) − (z−h) − 2h`); the
        values cannot tell them apart, so it warns."""
        return self.not_finite is None and tol > 0 and not self.passed(tol) and self.to_largest < tol

    def near_zero_note(self) -> str:
        return (f"one token differs by {self.error:.1e} of its own size, though only {self.to_largest:.1e} of the "
                "instance's largest value: a claim wrong where the values are small, or rounding where a value is "
                "about 0")

    def result(self, name: str, tol: float, detail: str) -> CheckResult:
        """ok/fail with `detail`, or a failure naming the quantity that was not finite."""
        if self.not_finite is not None:
            return CheckResult(name, "fail", f"not finite: {self.not_finite}", None)
        if self.passed(tol):
            return CheckResult(name, "ok", detail, self.error)
        if self.near_zero(tol):
            return CheckResult(name, "warn", f"{detail}: {self.near_zero_note()}", self.error)
        # `detail` states the claim; a failed row must not read as if it held
        above = f", above the tolerance {tol:.0e}" if tol > 0 else ""
        return CheckResult(name, "fail", f"does not hold: {detail}{above}", self.error)


@contextmanager
def _one_thread() -> Iterator[None]:
    """Run torch on one intra-op thread, restoring the caller's setting afterwards.

    The checks evaluate tiny float64 tensors (a few hundred elements). Some kernels (softmax over a
    non-last axis and its backward) fork a parallel region even at that size, and on a busy machine
    each fork/join waits for a descheduled worker: milliseconds per call, seconds per check run.
    Those kernels split independent rows, and sums this small are never split, so one thread gives
    bitwise the same results (every example's checks report identical errors) without the waits.
    """
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
