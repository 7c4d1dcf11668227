"""Generated layers on the fused kernels (`--backend triton`) against torch.compile and plain attention.

Issue 4's third target: the variants no library has (momentum, Nesterov, second-order, CEM with ALiBi and
its diagonal term, preconditioners, T = 2 steps) must run at least 2x faster than `torch.compile` of the
torch backend, and take at most 1.3x the time of plain softmax attention of the same shape (a standard
causal multi-head layer: q, k, v, o projections around `scaled_dot_product_attention`). A multi-head gated
linear attention is timed beside them: the linear family's layer, whose kernels' own peer is fla
(`kernels.py`). Each example is
generated at d = heads x head_dim, the same weights go into every implementation, and the displacement
(update minus x) is timed forward and forward+backward in bfloat16 with `triton.testing.do_bench`.

Two triton rows: the generated module as it runs eagerly ("triton": every torch op around the kernels is a
launch from Python, which bounds short sequences) and under `torch.compile` ("triton+compile": Inductor
fuses that glue and launches the kernels as triton_ops). The ratios are given for both.

    python benchmarks/modules.py                     # CUDA GPU: the ratio table
    python benchmarks/modules.py --seq 2048,8192 --json runs/modules.json
    TRITON_INTERPRET=1 python benchmarks/modules.py --interpret-smoke   # CPU: every case runs once

Without a CUDA device (and without --interpret-smoke) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# (label, energy file from the repository root, energy): every one is lowered to the kernels by the triton backend
CASES = [
    ("MHA (seed 004, GD)", "examples/intrinsic-optimizers/mha.energy", "MHA"),
    ("MomenMHA", "examples/intrinsic-optimizers/momen-mha.energy", "MomenMHA"),
    ("NagMHA", "examples/intrinsic-optimizers/nag-mha.energy", "NagMHA"),
    ("LightMHA2nd1st", "examples/intrinsic-optimizers/light-mha2nd1st.energy", "LightMHA2nd1st"),
    ("CEM ALiBi + self bias", "examples/cem/alibi.energy", "CEMAlibiAttention"),
    ("CEM diagonal, exact", "examples/cem/kq-diagonal-exact.energy", "CEMKQDiagonalExact"),
    ("CEM DPLR", "examples/cem/dplr.energy", "CEMAttentionDPLR"),
    ("CEM T = 2", "examples/cem/steps2.energy", "CEMAttentionSteps2"),
    ("Multi-head gated linear", "examples/intrinsic-optimizers/multi-head-linear-attention.energy",
     "MultiHeadLinearAttention"),
    ("GLA, data-dependent gates", "examples/models/gla.energy", "GatedRetention"),  # decay(r) per head
    # no seed paper's: sigmoid weights, no normalisation (the pointwise kernels)
    ("Sigmoid attention", "tests/data/weighted-context-sums.energy", "SigmoidAttention"),
]


def plain_attention(d: int, heads: int) -> Any:
    """The peer: a standard causal multi-head attention layer, no biases."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class PlainAttention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(d, 3 * d, bias=False)
            self.o = nn.Linear(d, d, bias=False)

        def forward(self, x: torch.Tensor, delta: bool = True) -> torch.Tensor:
            B, T, _ = x.shape
            q, k, v = self.qkv(x).view(B, T, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o(y.transpose(1, 2).reshape(B, T, d))

    return PlainAttention()


def build(path: str, energy: str, d: int, heads: int) -> tuple[Any, Any]:
    """(triton-backend module, torch-backend module) with the same weights."""
    from energydsl import load
    from energydsl.codegen import module_class

    derived = load(ROOT / path).energy(energy, d=d, heads=heads)
    tri, ref = module_class(derived, "triton")(), module_class(derived, "torch")()
    tri.load_state_dict(ref.state_dict())
    return tri, ref


def _rel(a: Any, b: Any) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def interpret_smoke() -> int:
    """Every case once at a tiny shape under the Triton interpreter: the kernel path against the torch one."""
    import torch

    if os.environ.get("TRITON_INTERPRET") != "1":
        print("--interpret-smoke needs TRITON_INTERPRET=1 in the environment (set before triton is imported)")
        return 2
    failed = 0
    for label, path, energy in CASES:
        tri, ref = build(path, energy, d=16, heads=2)
        x = torch.randn(2, 13, 16, requires_grad=True)
        outs, grads = [], []
        for m in (tri, ref):
            y = m(x, delta=True)
            outs.append(y)
            grads.append(torch.autograd.grad(y.square().sum(), x)[0])
        err = max(_rel(outs[0], outs[1]), _rel(grads[0], grads[1]))
        ok = err < 1e-4
        failed += not ok
        print(f"{label:24s} max rel err {err:.1e}  {'ok' if ok else 'FAIL'}")
    print(f"interpret smoke: {len(CASES) - failed} ok, {failed} failed")
    return 1 if failed else 0


def _bench(fn: Callable[[], Any], leaves: list[Any], warmup: int, rep: int) -> tuple[float, float]:
    """(median ms, peak MiB above what was allocated before)."""
    import torch
    from triton.testing import do_bench

    ms = float(do_bench(fn, warmup=warmup, rep=rep, grad_to_none=leaves))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return ms, (torch.cuda.max_memory_allocated() - before) / 2**20


def run_case(label: str, path: str, energy: str, batch: int, seqs: list[int], heads: int, head_dim: int,
             args: argparse.Namespace) -> list[dict[str, Any]]:
    """One example at every sequence length (one torch.compile per example: the lengths reuse it)."""
    import torch

    d = heads * head_dim
    dtype = torch.bfloat16
    tri, ref = build(path, energy, d, heads)
    tri, ref = tri.cuda().to(dtype), ref.cuda().to(dtype)
    torch._dynamo.reset()
    impls = {
        "triton": tri,
        "triton_compiled": torch.compile(tri),
        "compiled": torch.compile(ref),
        "plain": plain_attention(d, heads).cuda().to(dtype),
    }
    rows = []
    for seq in seqs:
        x = torch.randn(batch, seq, d, device="cuda", dtype=dtype, requires_grad=True)
        g = torch.randn_like(x)
        row: dict[str, Any] = {"case": label, "B": batch, "T": seq, "H": heads, "Dh": head_dim}
        for name, m in impls.items():
            params = [p for p in m.parameters() if p.requires_grad]

            def fwd(m: Any = m, x: Any = x) -> None:
                with torch.no_grad():
                    m(x, delta=True)

            def fwd_bwd(m: Any = m, x: Any = x, g: Any = g) -> None:
                torch.autograd.backward(m(x, delta=True), g)

            try:
                row[f"{name}_fwd_ms"], _ = _bench(fwd, [], args.warmup, args.rep)
                row[f"{name}_fwdbwd_ms"], row[f"{name}_peak_mib"] = _bench(
                    fwd_bwd, [x, *params], args.warmup, args.rep
                )
            except Exception as e:  # an OOM or a compile failure is a result too
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                torch.cuda.empty_cache()
        for mine in ("triton", "triton_compiled"):
            for peer in ("compiled", "plain"):
                for key in ("fwd", "fwdbwd"):
                    a, b = row.get(f"{mine}_{key}_ms"), row.get(f"{peer}_{key}_ms")
                    row[f"{mine}_{key}_vs_{peer}"] = a / b if a and b else None
        print(json.dumps(row), flush=True)  # a run cut short keeps what it measured
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def benchmark(args: argparse.Namespace) -> int:
    import torch
    from kernels import commit  # benchmarks/kernels.py, beside this script
    from rich.console import Console
    from rich.table import Table

    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "argv": sys.argv[1:], "commit": commit()}
    rows: list[dict[str, Any]] = []
    for label, path, energy in CASES:
        rows += run_case(label, path, energy, args.batch, args.seq, args.heads, args.head_dim, args)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    table = Table(title=f"generated modules on {torch.cuda.get_device_name()}, bf16, B={args.batch}, "
                        f"H={args.heads}, Dh={args.head_dim}: fwd+bwd ms, ratios below 1 = faster")
    cols = ("case", "T", "triton", "triton+compile", "compiled", "plain", "triton / compiled",
            "triton / plain", "t+c / compiled", "t+c / plain", "peak MiB")
    for col in cols:
        table.add_column(col)

    def f(v: Any, spec: str = ".2f") -> str:
        return "-" if v is None else format(v, spec)

    for r in rows:
        table.add_row(
            r["case"], str(r["T"]),
            *(f(r.get(f"{n}_fwdbwd_ms")) for n in ("triton", "triton_compiled", "compiled", "plain")),
            *(f(r.get(f"{m}_fwdbwd_vs_{p}")) for m in ("triton", "triton_compiled") for p in ("compiled", "plain")),
            f(r.get("triton_peak_mib"), ".0f"),
        )
    Console(width=200).print(table)
    print("targets: vs compiled <= 0.5 (2x faster), vs plain <= 1.3; peak MiB linear in T")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interpret-smoke", action="store_true", help="CPU: run every case once, interpreted")
    ap.add_argument("--seq", type=lambda s: [int(v) for v in s.split(",")], default=[2048, 4096, 8192])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warm-up window, ms")
    ap.add_argument("--rep", type=int, default=100, help="do_bench timing window, ms")
    ap.add_argument("--json", help="write the raw numbers and the device here")
    args = ap.parse_args(argv)
    if args.interpret_smoke:
        return interpret_smoke()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: GPU benchmarks skipped (CPU check: TRITON_INTERPRET=1 ... --interpret-smoke)")
        return 0
    return benchmark(args)


if __name__ == "__main__":
    sys.exit(main())
