"""A toy search space for the engine's tests and benchmark: no DSL, no torch.

"Training" is a deterministic noisy quadratic reported over a few steps with a short sleep, and the
space has every case the engine must handle: a hole value that is invalid (`bogus`), one that raises
in evaluate (`diverge`), and two choices that derive the same equations (`attn`, `attn_alias`).
Referenced as `energydsl.search.toy:make_space` (or the registered name `toy`); every option is a
string because options arrive as `--set key=value`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import optuna

MIXERS = ("ssm", "attn", "attn_alias", "bogus", "diverge")  # the default choices
KNOWN = (*MIXERS, "crash")  # crash: the worker process dies in evaluate (only ask for it with workers > 1)
_CANON = {"attn_alias": "attn"}
_OFFSET = {"ssm": 0.3, "attn": 0.1, "diverge": 0.0, "bogus": 0.0, "crash": 0.0}


@dataclass
class ToyCandidate:
    params: dict[str, Any]

    @property
    def mixer(self) -> str:
        return _CANON.get(self.params["mixer"], self.params["mixer"])

    def invalid_reason(self) -> str | None:
        if self.params["mixer"] == "bogus":
            return "mixer 'bogus': no such operator"
        return None

    def equation_hash(self) -> str:
        key = json.dumps([self.mixer, self.params["depth"], round(float(self.params["lr"]), 12)])
        return hashlib.sha256(key.encode()).hexdigest()[:16]

    def source(self) -> str:
        p = self.params
        return f"layer toy {{\n  mixer = {p['mixer']}\n  depth = {p['depth']}\n  lr = {p['lr']:.6g}\n}}\n"

    def equations_mathml(self) -> str:
        return ('<math xmlns="http://www.w3.org/1998/Math/MathML" display="block"><msub><mi>h</mi>'
                f"<mi>t</mi></msub><mo>=</mo><msup><mi>{self.mixer}</mi><mn>{self.params['depth']}</mn>"
                "</msup><mo>(</mo><msub><mi>h</mi><mrow><mi>t</mi><mo>-</mo><mn>1</mn></mrow></msub>"
                "<mo>)</mo></math>")


@dataclass
class ToySpace:
    mixers: tuple[str, ...] = MIXERS
    depth: int | None = None  # fixed when set, else a hole 1..4
    lr: float | None = None  # fixed when set, else a log-uniform hole
    steps: int = 4
    sleep: float = 0.02
    calls: str | None = None  # append one line per evaluate call here (counts calls across processes)
    name: str = "toy"
    objectives: list[tuple[str, str]] = field(default_factory=lambda: [("val_loss", "minimize")])
    budget: dict[str, Any] = field(default_factory=dict)

    def fingerprint(self) -> dict[str, str]:
        """What results depend on besides the hole values (a rerun with other values is refused)."""
        return {"steps": str(self.steps)}

    def distributions(self) -> dict[str, tuple[optuna.distributions.BaseDistribution, None]]:
        """The holes `suggest` samples (those not fixed by an option), for `--holes` and a rerun's check."""
        out: dict[str, tuple[optuna.distributions.BaseDistribution, None]] = {
            "mixer": (optuna.distributions.CategoricalDistribution(list(self.mixers)), None)}
        if self.depth is None:
            out["depth"] = (optuna.distributions.IntDistribution(1, 4), None)
        if self.lr is None:
            out["lr"] = (optuna.distributions.FloatDistribution(1e-4, 1e-1, log=True), None)
        return out

    def suggest(self, trial: optuna.Trial) -> ToyCandidate:
        mixer = trial.suggest_categorical("mixer", list(self.mixers))
        depth = self.depth if self.depth is not None else trial.suggest_int("depth", 1, 4)
        lr = self.lr if self.lr is not None else trial.suggest_float("lr", 1e-4, 1e-1, log=True)
        return ToyCandidate({"mixer": mixer, "depth": depth, "lr": lr})

    def evaluate(self, candidate: ToyCandidate, report: Any, device: str) -> dict[str, float]:
        if self.calls:
            with open(self.calls, "a") as f:  # one short O_APPEND write: safe across processes
                f.write(f"{os.getpid()} {candidate.equation_hash()} {candidate.params['mixer']}\n")
        p = candidate.params
        noise = int(candidate.equation_hash()[:8], 16) / 16**8
        base = 0.5 * (math.log10(p["lr"]) + 2) ** 2 + 0.1 * (p["depth"] - 3) ** 2 + _OFFSET[candidate.mixer]
        base += 0.05 * noise
        val = math.inf
        for step in range(1, self.steps + 1):
            time.sleep(self.sleep)
            if candidate.mixer == "diverge" and step == 2:
                raise FloatingPointError("loss diverged to nan at step 2")
            if candidate.mixer == "crash" and step == 2:
                os._exit(137)  # as if the OOM killer took the worker
            val = base + 1.0 / step
            if report(step, val) and step < self.steps:  # a trial that ran all its steps completed
                raise optuna.TrialPruned(f"pruned at step {step} (val_loss {val:.4f})")
        size = p["depth"] * (1000.0 if candidate.mixer == "attn" else 600.0)
        return {"val_loss": val, "params": size, "base": base}


def make_space(mixers: str = ",".join(MIXERS), depth: str = "", lr: str = "", steps: str = "4",
               sleep: str = "0.02", calls: str = "", objectives: str = "val_loss", trials: str = "8",
               name: str = "toy") -> ToySpace:
    """Build the toy space from string options (objectives: comma list of val_loss, params)."""
    choices = tuple(m.strip() for m in mixers.split(",") if m.strip())
    unknown = [m for m in choices if m not in KNOWN]
    if unknown:
        raise ValueError(f"unknown toy mixers {unknown}; known: {KNOWN}")
    objs = [(o.strip(), "minimize") for o in objectives.split(",") if o.strip()]
    return ToySpace(mixers=choices, depth=int(depth) if depth else None, lr=float(lr) if lr else None,
                    steps=int(steps), sleep=float(sleep), calls=calls or None, name=name, objectives=objs,
                    budget={"trials": int(trials), "steps": int(steps)})
