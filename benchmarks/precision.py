"""Precision of the softmax-family kernels as the scores grow: float32 kernels and the float32 torch reference,
each against the float64 reference, and their ratio.

Large scores make the softmax nearly one-hot, where the kernels' recomputed weights exp(s - lse) carry the
rounding of the stored float32 lse (docs/models.md, "Precision where the scores are large"). For each
magnitude (the factor on 1/sqrt(d)) it prints max |s| and, per output and gradient, the relative error of
the norm, ||x - ref64|| / ||ref64||, for the kernel and for the torch reference run in float32. For first-order
attention it also prints the error of the named peer, torch's `scaled_dot_product_attention` in float32 (causal;
its backend on this device: the CPU's flash kernel, or on a GPU whichever SDPA picks for float32), whose
backward uses FlashAttention's delta_i = dO_i · o_i as ours does: where the softmax saturates, both lose the
digits the T x T reference keeps.

Runs on a GPU, or on the CPU under the interpreter:

    TRITON_INTERPRET=1 python benchmarks/precision.py                       # second moment, magnitudes 1..300
    TRITON_INTERPRET=1 python benchmarks/precision.py --op attention --magnitudes 10,100
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from energydsl.kernels.attention import energy_attention, energy_attention_with_lse, weighted_second_moment
from energydsl.kernels.attention_ref import energy_attention_ref, weighted_second_moment_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _second_kernel(q, k, v, u, scale):
    _, lse = energy_attention_with_lse(q, k, v, scale=scale)
    return weighted_second_moment(q, k, v, lse, u, scale=scale)


OPS = {  # name: (kernel, reference); both take (q, k, v, u, scale)
    "second": (_second_kernel, lambda q, k, v, u, scale: weighted_second_moment_ref(q, k, v, None, u, scale=scale)),
    "attention": (lambda q, k, v, u, scale: energy_attention(q, k, v, scale=scale),
                  lambda q, k, v, u, scale: energy_attention_ref(q, k, v, scale=scale)),
}
PEERS = {"attention": lambda q, k, v, u, scale: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)}


def errors(op: str, magnitude: float, B: int, H: int, T: int, d: int, seed: int) -> tuple[float, dict]:
    """max |s| and {name: (kernel error, torch float32 error, peer error or None)} for the output and q, k, v,
    u's gradients."""
    g = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(B, H, T, d, generator=g, dtype=torch.float64) for _ in range(4)]
    cotangent = torch.randn(B, H, T, d, generator=g, dtype=torch.float64)
    scale = magnitude / d**0.5
    kernel, reference = OPS[op]

    def run(fn, dtype):
        leaves = [x.to(DEVICE, dtype).requires_grad_() for x in inputs]
        out = fn(*leaves, scale)
        grads = torch.autograd.grad(out, leaves, cotangent.to(out), allow_unused=True)
        return [out.detach().double().cpu()] + [
            torch.zeros(x.shape, dtype=torch.float64) if gr is None else gr.double().cpu()
            for x, gr in zip(leaves, grads, strict=True)
        ]

    want = run(reference, torch.float64)
    got = run(kernel, torch.float32)
    torch32 = run(reference, torch.float32)
    peer = run(PEERS[op], torch.float32) if op in PEERS else [None] * len(want)
    names = ["out", "dq", "dk", "dv", "du"][: 5 if op == "second" else 4]
    rel = lambda x, r: ((x - r).norm() / r.norm()).item()  # noqa: E731
    table = {n: (rel(a, r), rel(b, r), None if c is None else rel(c, r))
             for n, a, b, c, r in zip(names, got, torch32, peer, want, strict=False)}
    q, k = inputs[0], inputs[1]
    return (scale * q @ k.transpose(-1, -2)).abs().max().item(), table


def _ratio(a: float, b: float) -> str:
    """a / b as `1.5x`; past 1000 as `3.9e+57x` (a vanishing gradient's noise against a reference that is 0)."""
    r = a / b if b else float("inf") if a else float("nan")
    return f"{r:.1f}x" if r < 1000 else f"{r:.1e}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=sorted(OPS), default="second")
    parser.add_argument("--magnitudes", default="1,10,30,300", help="factors on 1/sqrt(d), comma-separated")
    parser.add_argument("--shape", default="1,2,40,16", help="B,H,T,d")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        print("no GPU: precision skipped (TRITON_INTERPRET=1 interprets the kernels on the CPU)")
        return
    B, H, T, d = (int(x) for x in args.shape.split(","))
    peer = ", [SDPA's / torch float32 = ratio]" if args.op in PEERS else ""
    print(f"{args.op}: relative error of the norm against float64 (kernel / torch float32 = ratio{peer}), "
          f"B={B} H={H} T={T} d={d}, {DEVICE}{' (interpreted)' if DEVICE == 'cpu' else ''}")
    for magnitude in (float(m) for m in args.magnitudes.split(",")):
        smax, table = errors(args.op, magnitude, B, H, T, d, args.seed)
        cells = "  ".join(f"{n} {a:.1e}/{b:.1e}={_ratio(a, b)}" + ("" if c is None else f" [{_ratio(c, b)}]")
                          for n, (a, b, c) in table.items())
        print(f"max|s| {smax:8.1f}  {cells}")


if __name__ == "__main__":
    main()
