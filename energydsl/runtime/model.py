"""The language model a `model` declaration describes, built from generated energy modules.

    x = wte[idx] (+ wpe[pos])                   x: (B, T, *stream), the stream [d] or a matrix [dk, dv]
                                                (`embed ... rank R`: x = Σ_h w_h ⊗ W_h[idx], RMT eq. 18–19)
    for each layer, for each stage:             (one set of weights per layer, or one shared set)
        s = norm(x)                             (with `norm ... before each stage`; else s = x), over the
                                                whole stream of a token, with a gain of the stream's shape
                                                (`before each layer`: one norm, then the layer's stages in
                                                turn, and their summed displacement is the layer's f)
        f = stage(s) - s                        the stage's displacement: its derived update (a stage whose
                                                state has another shape of the same size sees s reshaped)
        x = x + f                               or, across layers momentum: m = β m + f; x = x + η m
                                                (nag: the stage runs at the look-ahead x + β m)
    logits = head(final_norm(x))                (tied: wte as the output matrix; `rank R`:
                                                Σ_h W_h (xᵀ r_h), RMT eq. 26–27)

Kept as small as nanoGPT's model.py: everything model-specific lives in the generated stage modules.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import kernels
from ..composition import check_stage_state
from ..number_text import is_count, plain_value

if TYPE_CHECKING:
    from ..composition import ModelPlan
    from ..derived import Derived


EMBEDDINGS = ("wte", "wpe", "lm_head")  # modules left out of params_non_embedding


def make_norm(kind: str, shape: tuple[int, ...]) -> nn.Module:
    """A norm over a token's whole stream (a vector or a matrix), a learnable gain of that shape, no bias
    (eps 1e-5)."""
    if kind == "layernorm":
        return LayerNorm(shape, eps=1e-5, bias=False)
    return nn.RMSNorm(shape, eps=1e-5)


class _ContiguousGrad(torch.autograd.Function):
    """The identity, whose backward passes on a contiguous gradient."""

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


class LayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` (same parameters) that hands its backward a contiguous gradient.

    Under `torch.compile` the backward graph's layouts come from fake tensors. On the CPU
    `native_layer_norm_backward` returns a contiguous gradient whatever the layout of the gradient it is given,
    while its fake function keeps that layout; a `view` planned on the fake layout then fails on the real
    tensor (RMT's factorised head reads the final norm's output as `keys @ z`, whose traced gradient is a
    transposed view). With a contiguous gradient coming in, both agree; the copy is one the CPU kernel made
    anyway. Only while compiling: eagerly the layouts are real, and an autograd.Function call per norm and step
    costs host time (about as much as the norm itself at a tiny width on the CPU)."""

    def forward(self, x: Tensor) -> Tensor:
        y = super().forward(x)
        return _ContiguousGrad.apply(y) if torch.compiler.is_compiling() else y


class FactorisedTable(nn.Module):
    """RMT's rank-R tables over a matrix stream [dk, dv]: a row is R data vectors W_h[s] ∈ R^dv, each
    tied to a key w_h ∈ R^dk.

    write(idx) = Σ_h w_h ⊗ W_h[idx] (the embedding, eq. 18–19); read(z) = Σ_h W_h (zᵀ w_h), the logits
    of every row (the unembedding, eq. 26–27; read with the embedding's own keys it is ⟨z, write(s)⟩_F,
    the tied head). Keys start at std 1/√fan_in (variance-preserving, the paper's Table 1), tables at 0.02.
    """

    def __init__(self, rows: int, rank: int, dk: int, dv: int, key_std: float):
        super().__init__()
        self.rank, self.dk, self.dv = rank, dk, dv
        self.weight = nn.Parameter(torch.empty(rows, rank * dv))  # [W_1[s] … W_R[s]] per row s
        self.keys = nn.Parameter(torch.empty(rank, dk))
        nn.init.normal_(self.weight, 0.0, 0.02)
        nn.init.normal_(self.keys, 0.0, key_std)

    def write(self, idx: Tensor) -> Tensor:
        """(...) -> (..., dk, dv)."""
        return self.keys.t() @ F.embedding(idx, self.weight).unflatten(-1, (self.rank, self.dv))

    def read(self, z: Tensor) -> Tensor:
        """(..., dk, dv) -> (..., rows)."""
        return F.linear((self.keys @ z).flatten(-2), self.weight)


def state_shape(derived: Derived) -> tuple[int, ...]:
    """The shape of a stage's state (per token) at its dims."""
    return tuple(derived.spec.size(s) for s in derived.spec.state.shape)


@dataclass
class StageInfo:
    label: str
    derived: Derived
    flops_per_token: float


class LanguageModel(nn.Module):
    """A causal language model: idx (B, T) -> logits (B, T, vocab)."""

    def __init__(self, plan: ModelPlan, stage_classes: list[type[nn.Module]], stages: list[StageInfo],
                 fused_momentum: bool = False):
        super().__init__()
        self.plan = plan
        self.fused_momentum = fused_momentum  # triton backend: the step across layers is one kernel pass
        self.stage_info = stages
        self.vocab_size, self.block_size, self.d = plan.vocab, plan.context, plan.d
        self.stream = plan.stream
        self.stage_shapes = [state_shape(s.derived) for s in stages]
        for info, stage in zip(stages, plan.stages):
            check_stage_state(plan, stage, info.derived.spec)
        self.wte: nn.Module
        self.wpe: nn.Module | None = None
        if plan.embed_rank:
            R, (dk, dv) = plan.embed_rank, plan.stream
            self.wte = FactorisedTable(plan.vocab, R, dk, dv, key_std=R**-0.5)
            if plan.embed_positions:
                self.wpe = FactorisedTable(plan.context, R, dk, dv, key_std=R**-0.5)
        else:
            self.wte = nn.Embedding(plan.vocab, plan.d)
            self.wpe = nn.Embedding(plan.context, plan.d) if plan.embed_positions else None
        n_sets = 1 if plan.shared else plan.layers
        self.layers = nn.ModuleList(nn.ModuleList(cls() for cls in stage_classes) for _ in range(n_sets))
        n_norms = len(stage_classes) if plan.norm and plan.norm[1] == "stage" else 1
        self.norms = nn.ModuleList(
            nn.ModuleList(make_norm(plan.norm[0], plan.stream) for _ in range(n_norms)) for _ in range(n_sets)
        ) if plan.norm else None
        self.final_norm = make_norm(plan.final_norm, plan.stream) if plan.final_norm else None
        self.lm_head: nn.Module | None = None
        if not plan.head_tied and plan.head_rank:
            dk, dv = plan.stream
            self.lm_head = FactorisedTable(plan.vocab, plan.head_rank, dk, dv, key_std=dk**-0.5)
        elif not plan.head_tied:
            self.lm_head = nn.Linear(plan.d, plan.vocab, bias=False)
        self.across = plan.across[0] if plan.across else None
        if plan.across:
            for name, (value, learn) in plan.across[1].items():
                if learn:
                    self.register_parameter(f"across_{name}", nn.Parameter(torch.tensor(float(value))))
                else:  # a number of the spec, exact in a float64 model (built in float32 and moved, 0.8 was
                    # 0.800000011920929); beside float32 values it multiplies as a float32 (a 0-dim tensor)
                    self.register_buffer(f"across_{name}", torch.tensor(float(value), dtype=torch.float64))
        for table in (self.wte, self.wpe, self.lm_head):
            if table is not None and not isinstance(table, FactorisedTable):
                nn.init.normal_(table.weight, 0.0, 0.02)

    def extra_repr(self) -> str:
        """`print(model)`'s first line: how many layers run, as `layers` lists one set of weights when shared."""
        n = self.plan.layers
        weights = ", one set of weights shared" if self.plan.shared and n > 1 else ""
        return f"{self.plan.name}: {n} layer{'s' * (n != 1)}{weights}, context {self.block_size}"

    def forward(self, idx: Tensor) -> Tensor:
        """Logits (batch, seq, vocab) for token ids idx (batch, seq), 1 <= seq <= the context."""
        if not isinstance(idx, Tensor) or idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32):
            got = f"shape {tuple(idx.shape)}, {idx.dtype}" if isinstance(idx, Tensor) else type(idx).__name__
            raise ValueError(f"idx must be token ids (batch, seq), int64 or int32 (what an embedding reads), got {got}")
        B, T = idx.shape
        if T > self.block_size:
            raise ValueError(f"sequence of length {T} is longer than the model's context {self.block_size}")
        if T < 1:
            raise ValueError(f"idx has no tokens (shape {tuple(idx.shape)}); a sequence needs at least one")
        if B < 1:
            raise ValueError(f"idx has no sequences (shape {tuple(idx.shape)}); a batch needs at least one")
        if idx.device.type == "cpu" and not torch.compiler.is_compiling():  # on a GPU this would sync every step
            low, high = int(idx.min()), int(idx.max())
            if low < 0 or high >= self.vocab_size:
                raise ValueError(f"token ids must be in [0, {self.vocab_size}); got ids from {low} to {high}")
        x = self._embed(self.wte, idx)
        if self.wpe is not None:
            x = x + self._embed(self.wpe, torch.arange(T, device=idx.device))
        m = torch.zeros_like(x) if self.across else None
        per_layer = self.plan.norm is not None and self.plan.norm[1] == "layer"
        for layer in range(self.plan.layers):
            stages = self.layers[0 if self.plan.shared else layer]
            norms = self.norms[0 if self.plan.shared else layer] if self.norms is not None else None
            if per_layer:  # the layer's stages run on the normed stream; the layer's displacement is added
                s0 = norms[0](self._lookahead(x, m) if self.across == "nag" else x)
                s = s0
                for n, stage in enumerate(stages):
                    s = self._run(n, stage, s)
                x, m = self._step(x, s - s0, m)
                continue
            for n, stage in enumerate(stages):
                at = self._lookahead(x, m) if self.across == "nag" else x
                if norms is None and self.across is None:
                    x = self._run(n, stage, x)
                    continue
                s = norms[n](at) if norms is not None else at
                x, m = self._step(x, self._run(n, stage, s, delta=True), m)
        if self.final_norm is not None:
            x = self.final_norm(x)
        head = self.wte if self.lm_head is None else self.lm_head
        if isinstance(head, FactorisedTable):
            return head.read(x)
        return F.linear(x.flatten(2), head.weight)

    def _embed(self, table: nn.Module, idx: Tensor) -> Tensor:
        """Rows of an embedding table as streams: (...) -> (..., *stream)."""
        if isinstance(table, FactorisedTable):
            return table.write(idx)
        return table(idx).unflatten(-1, self.stream)

    def _run(self, n: int, stage: nn.Module, s: Tensor, delta: bool = False) -> Tensor:
        """Stage n on the stream s (B, T, *stream), reshaped to the stage's state shape and back."""
        shape = self.stage_shapes[n]
        if shape == self.stream:
            return stage(s, delta=delta)
        return stage(s.reshape(*s.shape[:2], *shape), delta=delta).reshape(s.shape)

    def _lookahead(self, x: Tensor, m: Tensor) -> Tensor:
        """nag across layers: where the next stage runs, x + beta m (one kernel pass on the triton backend)."""
        if self.fused_momentum:
            return kernels.nesterov_lookahead(x, m, self.across_beta)
        return x + self.across_beta * m

    def _step(self, x: Tensor, f: Tensor, m: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """Apply a stage's displacement f: plainly (residual), or through the momentum buffer across layers."""
        if self.across is None:
            return x + f, m
        if self.fused_momentum:
            return kernels.momentum_update(x, m, f, self.across_beta, self.across_eta)
        m = self.across_beta * m + f
        return x + self.across_eta * m, m

    # ------------------------------------------------------------------ sizes and costs

    def _layers(self, layers: int | None) -> int:
        """`layers` as given (a positive whole number), or the model's own: 0 or -3 counted negative parameters."""
        if layers is None:
            return self.plan.layers
        if not is_count(layers):
            raise ValueError(f"layers must be a whole number of at least 1 (or None: the model's own), not {layers!r}")
        return int(layers)

    def num_params(self, non_embedding: bool = False, layers: int | None = None) -> int:
        """Parameters counted once (a tied head is the embedding); non-embedding leaves out wte, wpe, lm_head
        (with their keys, when factorised).

        `layers`: the count of this model with that many layers instead of its own, without building them: every
        layer's weights (stages and norms) have the first layer's shapes (`energy info` of a deep model)."""
        count = self._layers(layers)
        total = sum(p.numel() for n, p in self.named_parameters()
                    if not (non_embedding and n.split(".")[0] in EMBEDDINGS))
        if layers is None or self.plan.shared:
            return total
        first = [self.layers[0]] + ([self.norms[0]] if self.norms is not None else [])
        return total + sum(p.numel() for m in first for p in m.parameters()) * (count - len(self.layers))

    def flops_per_token(self, layers: int | None = None) -> float:
        """Forward matmul FLOPs per token: the stages (attention at full context), times the layers (`layers`,
        default the model's), plus the head; a factorised embedding adds its rank-R writes and a factorised
        head its reads (table lookups are free)."""
        return float(self._exact_flops(layers))

    def _exact_flops(self, layers: int | None) -> Fraction:
        """`flops_per_token` without rounding: at 10^18 layers a float lost the head's FLOPs."""
        stages = sum(Fraction(s.flops_per_token) for s in self.stage_info)
        plan = self.plan
        embed = 2 * (plan.embed_rank or 0) * self.d * (2 if plan.embed_positions else 1)  # Σ_h w_h ⊗ W_h[s]
        if plan.head_rank:  # R reads zᵀr_h, then the [vocab, R·dv] table
            head = 2 * plan.head_rank * (self.d + plan.stream[1] * self.vocab_size)
        else:
            head = 2 * self.d * self.vocab_size
        return self._layers(layers) * stages + Fraction(embed) + Fraction(head)

    def activation_floats_per_token(self, layers: int | None = None) -> int:
        """A rough activation-memory estimate: per stage of each layer the stream and its displacement, plus the
        embedded and final streams and the logits."""
        return (2 * len(self.stage_info) * self._layers(layers) + 2) * self.d + self.vocab_size

    def info(self, layers: int | None = None) -> dict:
        """Sizes and costs; `layers`: of this model with that many layers instead of its own (see num_params)."""
        return {
            "model": self.plan.name,
            "dims": {k: plain_value(v) for k, v in self.plan.dims.items()},
            "params": self.num_params(layers=layers),
            "params_non_embedding": self.num_params(non_embedding=True, layers=layers),
            "flops_per_token": round(self._exact_flops(layers)),
            "activation_bytes_per_token": 4 * self.activation_floats_per_token(layers),
            "layers": self._layers(layers),
            "shared": self.plan.shared,
            "stages": [s.label for s in self.stage_info],
        }

    def equation_hash(self) -> str:
        plan = self.plan
        matrix = (plan.stream, plan.embed_rank, plan.head_rank) if len(plan.stream) > 1 else ()  # vector: as before
        text = repr((plan.name, sorted(plan.dims.items()), plan.layers, plan.shared,
                     plan.across, plan.norm, plan.final_norm, plan.head_tied,
                     plan.embed_positions, [s.derived.equation_hash() for s in self.stage_info]) + matrix)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def derived(self) -> list[Derived]:
        return [s.derived for s in self.stage_info]

    def example_input(self, batch: int = 2, seq: int | None = None) -> Tensor:
        """Random token ids of shape (batch, seq), seq at most the context (default: up to 16)."""
        seq = min(self.block_size, 16) if seq is None else seq
        for name, value, most in (("batch", batch, None), ("seq", seq, self.block_size)):
            if not is_count(value) or (most is not None and value > most):
                within = f" and at most the context, {most}" if most is not None else ""
                raise ValueError(f"example_input: {name} must be a whole number of at least 1{within}, not {value!r}")
        weight = next(self.parameters(), None)  # on the model's device, as a layer's example_input is
        return torch.randint(0, self.vocab_size, (batch, seq), device=None if weight is None else weight.device)

    def example_inputs(self, batch: int = 2, seq: int | None = None) -> dict[str, Tensor]:
        """`example_input` by the forward's argument name, as a layer's `example_inputs`: `model(**inputs)`."""
        return {"idx": self.example_input(batch, seq)}
