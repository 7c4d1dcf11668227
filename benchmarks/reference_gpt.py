"""A hand-written nanoGPT `model.py`: the speed and quality peer for models generated from specs.

GPT-2 style: learned positions, pre-norm blocks, LayerNorm without bias, causal self-attention via
`F.scaled_dot_product_attention` (flash kernels on GPU), GELU MLP with a 4x hidden layer, no
biases anywhere and the output head tied to the token embedding. nanoGPT's shakespeare_char model
is `GPT(vocab=65, context=256, d=384, layers=6, heads=6)` (10.7M parameters).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        if d % heads:
            raise ValueError(f"d={d} is not divisible by heads={heads}")
        self.heads = heads
        self.c_attn = nn.Linear(d, 3 * d, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, d)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, d: int, dropout: float):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d, bias=False)
        self.c_proj = nn.Linear(4 * d, d, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d, bias=False)
        self.attn = CausalSelfAttention(d, heads, dropout)
        self.ln_2 = nn.LayerNorm(d, bias=False)
        self.mlp = MLP(d, dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """`GPT(vocab, context, d, layers, heads)`; `forward(idx[B, T]) -> logits[B, T, vocab]`, T <= context."""

    def __init__(self, vocab: int, context: int, d: int, layers: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.vocab, self.context = vocab, context
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(context, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d, bias=False)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # scaled init of the residual projections (GPT-2)
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; by nanoGPT's convention without the position embedding."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.size(1)
        if t > self.context:
            raise ValueError(f"sequence of length {t} exceeds the context {self.context}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))
