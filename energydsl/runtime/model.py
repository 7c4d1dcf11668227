"""The language model a `model` declaration describes, built from generated energy modules.

    x = wte[idx] (+ wpe[pos])
    for each layer, for each stage:             (one set of weights per layer, or one shared set)
        s = norm(x)                             (with `norm ... before each stage`; else s = x)
        f = stage(s) - s                        the stage's displacement: its derived update
        x = x + f                               or, across layers momentum: m = β m + f; x = x + η m
                                                (nag: the stage runs at the look-ahead x + β m)
    logits = head(final_norm(x))                (tied: wte as the output matrix)

Kept as small as nanoGPT's model.py: everything model-specific lives in the generated stage modules.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from ..api import Derived
    from ..composition import ModelPlan


def make_norm(kind: str, d: int) -> nn.Module:
    """A norm with a learnable gain and no bias (eps 1e-5)."""
    if kind == "layernorm":
        return nn.LayerNorm(d, eps=1e-5, bias=False)
    return nn.RMSNorm(d, eps=1e-5)


@dataclass
class StageInfo:
    label: str
    derived: Derived
    flops_per_token: float


class LanguageModel(nn.Module):
    """A causal language model: idx (B, T) -> logits (B, T, vocab)."""

    def __init__(self, plan: ModelPlan, stage_classes: list[type[nn.Module]], stages: list[StageInfo]):
        super().__init__()
        self.plan = plan
        self.stage_info = stages
        self.vocab_size, self.block_size, self.d = plan.vocab, plan.context, plan.d
        self.wte = nn.Embedding(plan.vocab, plan.d)
        self.wpe = nn.Embedding(plan.context, plan.d) if plan.embed_positions else None
        n_sets = 1 if plan.shared else plan.layers
        self.layers = nn.ModuleList(nn.ModuleList(cls() for cls in stage_classes) for _ in range(n_sets))
        n_norms = len(stage_classes) if plan.norm and plan.norm[1] == "stage" else 1
        self.norms = nn.ModuleList(
            nn.ModuleList(make_norm(plan.norm[0], plan.d) for _ in range(n_norms)) for _ in range(n_sets)
        ) if plan.norm else None
        self.final_norm = make_norm(plan.final_norm, plan.d) if plan.final_norm else None
        self.lm_head = None if plan.head_tied else nn.Linear(plan.d, plan.vocab, bias=False)
        self.across = plan.across[0] if plan.across else None
        if plan.across:
            for name, (value, learn) in plan.across[1].items():
                t = torch.tensor(float(value))
                if learn:
                    self.register_parameter(f"across_{name}", nn.Parameter(t))
                else:
                    self.register_buffer(f"across_{name}", t)
        nn.init.normal_(self.wte.weight, 0.0, 0.02)
        if self.wpe is not None:
            nn.init.normal_(self.wpe.weight, 0.0, 0.02)
        if self.lm_head is not None:
            nn.init.normal_(self.lm_head.weight, 0.0, 0.02)

    def forward(self, idx: Tensor) -> Tensor:
        B, T = idx.shape
        if T > self.block_size:
            raise ValueError(f"sequence of length {T} is longer than the model's context {self.block_size}")
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=idx.device))
        m = torch.zeros_like(x) if self.across else None
        per_layer = self.plan.norm is not None and self.plan.norm[1] == "layer"
        for layer in range(self.plan.layers):
            stages = self.layers[0 if self.plan.shared else layer]
            norms = self.norms[0 if self.plan.shared else layer] if self.norms is not None else None
            if per_layer:  # the layer's stages run on the normed stream; the layer's displacement is added
                s0 = norms[0](x)
                s = s0
                for stage in stages:
                    s = stage(s)
                x, m = self._step(x, s - s0, m)
                continue
            for n, stage in enumerate(stages):
                at = x + self.across_beta * m if self.across == "nag" else x
                if norms is None and self.across is None:
                    x = stage(x)
                    continue
                s = norms[n](at) if norms is not None else at
                x, m = self._step(x, stage(s, delta=True), m)
        if self.final_norm is not None:
            x = self.final_norm(x)
        weight = self.wte.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, weight)

    def _step(self, x: Tensor, f: Tensor, m: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """Apply a stage's displacement f: plainly (residual), or through the momentum buffer across layers."""
        if self.across is None:
            return x + f, m
        m = self.across_beta * m + f
        return x + self.across_eta * m, m

    # ------------------------------------------------------------------ sizes and costs

    def num_params(self, non_embedding: bool = False) -> int:
        """Parameters counted once (a tied head is the embedding); non-embedding leaves out wte, wpe, lm_head."""
        skip = {"wte.weight", "wpe.weight", "lm_head.weight"} if non_embedding else set()
        return sum(p.numel() for n, p in self.named_parameters() if n not in skip)

    def flops_per_token(self) -> float:
        """Forward matmul FLOPs per token: the stages (attention at full context), times the layers, plus the head."""
        stages = sum(s.flops_per_token for s in self.stage_info)
        return self.plan.layers * stages + 2 * self.d * self.vocab_size

    def activation_floats_per_token(self) -> int:
        """A rough activation-memory estimate: the stream and one displacement per stage, per layer."""
        return (2 * len(self.stage_info) * self.plan.layers + 2) * self.d + self.vocab_size

    def info(self) -> dict:
        return {
            "model": self.plan.name,
            "dims": {k: (int(v) if float(v).is_integer() else v) for k, v in self.plan.dims.items()},
            "params": self.num_params(),
            "params_non_embedding": self.num_params(non_embedding=True),
            "flops_per_token": int(round(self.flops_per_token())),
            "activation_bytes_per_token": 4 * self.activation_floats_per_token(),
            "layers": self.plan.layers,
            "shared": self.plan.shared,
            "stages": [s.label for s in self.stage_info],
        }

    def equation_hash(self) -> str:
        text = repr((self.plan.name, sorted(self.plan.dims.items()), self.plan.layers, self.plan.shared,
                     self.plan.across, self.plan.norm, self.plan.final_norm, self.plan.head_tied,
                     self.plan.embed_positions, [s.derived.equation_hash() for s in self.stage_info]))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def derived(self) -> list[Derived]:
        return [s.derived for s in self.stage_info]

    def example_input(self, batch: int = 2, seq: int | None = None) -> Tensor:
        return torch.randint(0, self.vocab_size, (batch, seq or min(self.block_size, 16)))
