"""Generated GPT (examples/models/gpt.energy) against a hand-written nanoGPT model.py, same run, same sizes.

Prints forward+backward time per training step for both and the ratio generated / hand-written
(target: at most 1.10). Default: nanoGPT's Shakespeare-char size on the CPU. With --compile both models run
under torch.compile (Inductor), as `energy train --compile` runs the generated one, and the eager steps of
both are timed in the same run too, so the table also gives each model's compiled / eager ratio.

    python benchmarks/model_vs_reference.py [--batch 8] [--context 256] [--d 384] [--layers 6] [--heads 6]
    python benchmarks/model_vs_reference.py --compile --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.reference_gpt import GPT  # noqa: E402
from energydsl import load  # noqa: E402


def step_time(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> float:
    t0 = time.perf_counter()
    logits = model(idx)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--d", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=65)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--compile", action="store_true", help="also time both under torch.compile")
    args = ap.parse_args()
    try:
        torch.empty(0, device=args.device)
    except (RuntimeError, AssertionError) as e:  # no such device here (a CPU build asked for cuda)
        print(f"error: --device {args.device} is not available here: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    torch.manual_seed(0)
    dims = dict(vocab=args.vocab, context=args.context, d=args.d, layers=args.layers, heads=args.heads)
    generated = load(Path(__file__).resolve().parents[1] / "examples/models/gpt.energy").model(**dims).to(args.device)
    reference = GPT(args.vocab, args.context, args.d, args.layers, args.heads).to(args.device)
    n_gen, n_ref = generated.num_params(), sum(p.numel() for p in reference.parameters())
    idx = torch.randint(0, args.vocab, (args.batch, args.context), device=args.device)
    targets = torch.randint(0, args.vocab, (args.batch, args.context), device=args.device)
    runs = {"generated": generated, "hand-written": reference}
    if args.compile:  # the compiled modules share the eager ones' parameters
        runs |= {"generated, compiled": torch.compile(generated), "hand-written, compiled": torch.compile(reference)}
    for m in runs.values():  # warm up (and compile)
        for _ in range(2):
            step_time(m, idx, targets)
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(args.repeats):  # interleaved, so machine noise hits all alike
        for k, m in runs.items():
            times[k].append(step_time(m, idx, targets))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"device {args.device} · torch {torch.__version__} · threads {torch.get_num_threads()} · "
          f"batch {args.batch} x context {args.context} · d {args.d} · layers {args.layers} · heads {args.heads}")
    print(f"params: generated {n_gen:,} · hand-written {n_ref:,}")
    for k, v in med.items():
        print(f"{k:>22}: {v * 1000:8.1f} ms / step (median of {args.repeats}, forward + backward)")
    print(f"ratio generated / hand-written: {med['generated'] / med['hand-written']:.3f} (target ≤ 1.10)")
    if args.compile:
        print(f"ratio generated / hand-written, both compiled: "
              f"{med['generated, compiled'] / med['hand-written, compiled']:.3f} (target ≤ 1.10)")
        for k in ("generated", "hand-written"):
            print(f"{k} compiled / eager: {med[k + ', compiled'] / med[k]:.3f}")


if __name__ == "__main__":
    main()
