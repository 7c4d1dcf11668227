"""Where one forward + backward spends its time: a torch.profiler trace of each implementation of a case.

The first H100 run (benchmarks/RESULTS.md) left a question that timings alone cannot answer: every kernel
family's backward has a fixed cost of several tenths of a millisecond at short T (the softmax family's
fwd+bwd takes at least 1.1 ms at T = 1k, where its forward takes 0.11 ms and SDPA's fwd+bwd 0.35). This
script profiles `--steps` fwd+bwd calls of each implementation (the Triton kernel and its named peers, as in
`kernels.py`; the T x T references are left out) after a few untimed ones (compilation, autotuning), and
prints per step:

* wall: elapsed time with the GPU synchronised, what `kernels.py` measures;
* device: the summed time of the GPU kernels (what the GPU was busy with);
* host: the CPU time of the step's Python call (dispatch, autograd, launches), which overlaps the GPU.

wall well above device means the GPU waits for the host (launch overhead or a hidden synchronisation); wall
near device with a large device time points at the kernels themselves. The tables below list the ops and
kernels by self device time and by self CPU time, and `--trace DIR` writes Chrome traces (Perfetto,
chrome://tracing) for the timeline. `--families layers` profiles the generated layers of `modules.py` (the
module on the kernels, run eagerly, and the torch backend's module) at T = 2k, where the first H100 run's
MHA forward took 0.82 ms around an attention kernel of about 0.11 ms.

    python benchmarks/profile_kernels.py                                   # attention, T = 1k and 8k
    python benchmarks/profile_kernels.py --families linear,epilogue,attention-wide --trace runs/traces
    python benchmarks/profile_kernels.py --families layers          # the generated layers at T = 2k
    TRITON_INTERPRET=1 python benchmarks/profile_kernels.py --device cpu   # tiny shapes: the script's own check
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from kernel_cases import FAMILIES, SMOKE, Case, Impl, build_cases, generator, torch_dtype
from kernels import as_tuple, detach_leaves, fwd_bwd_step, grad_leaves

# a short and a long sequence per family, bf16 at the benchmark's batch and heads
PROFILE_SHAPES = {
    "attention": [(4, 16, 1024, 64, "bf16"), (4, 16, 8192, 64, "bf16")],
    "attention-wide": [(4, 12, 2048, 832, 64, "bf16")],
    "linear": [(4, 16, 2048, 64, "bf16"), (4, 16, 8192, 64, "bf16")],
    "epilogue": [((8, 2048, 4096), "bf16")],
}
# the generated layers (`modules.py`'s cases), --families layers: (B, T, heads, head dim, dtype); at T = 2k the
# first H100 run's MHA forward took 0.82 ms where its attention kernel takes about 0.11
LAYER_SHAPES = {"cuda": (4, 2048, 8, 64, "bf16"), "cpu": (1, 13, 2, 8, "fp32")}
LAYERS = "layers"
WARMUP_STEPS = 3


def layer_cases(device: str) -> list[Case]:
    """Each generated layer on the kernels (`--backend triton`, run eagerly) and the torch backend's module of
    the same spec, as cases of one input x."""
    import torch
    from modules import CASES, build

    B, T, heads, head_dim, dtype_name = LAYER_SHAPES[device]
    d = heads * head_dim

    def inputs(dtype: Any, on: str) -> dict[str, Any]:  # Case.make_inputs: (torch dtype, device)
        return {"x": torch.randn(B, T, d, generator=generator(on), device=on, dtype=dtype, requires_grad=True)}

    cases = []
    for label, path, energy in CASES:
        layers = [m.to(device=device, dtype=torch_dtype(dtype_name)) for m in build(path, energy, d, heads)]
        impls = [Impl(name, role, lambda x, m=m: m(x["x"], delta=True))
                 for name, role, m in zip(("triton backend", "torch backend"), ("kernel", "peer"), layers)]
        cases.append(Case(LAYERS, label, dict(B=B, T=T, H=heads, Dh=head_dim), dtype_name, inputs, impls))
    return cases


def _device_us(event: Any) -> float:
    """An averaged event's self time on the GPU (the attribute was renamed in torch 2.4)."""
    return float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)))


def profile_impl(case: Case, impl: Any, base: dict[str, Any], device: str, steps: int,
                 trace_dir: Path | None) -> dict[str, Any]:
    """Profile `steps` fwd+bwd calls of one implementation; print its op tables; return the per-step times."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = device == "cuda"
    x = detach_leaves(impl.prepare(base) if impl.prepare else base)
    leaves = list(grad_leaves(x).values())
    gen = generator(device)
    grads = tuple(torch.randn(o.shape, generator=gen, device=device).to(o.dtype) for o in as_tuple(impl.fn(x)))

    step = fwd_bwd_step(lambda: impl.fn(x), grads, leaves)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for _ in range(WARMUP_STEPS):
        step()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            with record_function("fwd+bwd step"):
                step()
        sync()
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
    events = prof.key_averages()
    host = next((e for e in events if e.key == "fwd+bwd step"), None)
    row = dict(family=case.family, case=case.label, impl=impl.name, role=impl.role, wall_ms=wall_ms,
               device_ms=sum(_device_us(e) for e in events) / 1e3 / steps,
               host_ms=(host.cpu_time_total / 1e3 / steps) if host else float("nan"))
    print(f"\n=== {case.label} :: {impl.name} ({impl.role}) — per step: wall {row['wall_ms']:.3f} ms, "
          f"device {row['device_ms']:.3f} ms, host {row['host_ms']:.3f} ms")
    if cuda:
        print(events.table(sort_by="self_cuda_time_total", row_limit=12))
    print(events.table(sort_by="self_cpu_time_total", row_limit=12))
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        name = re.sub(r"[^\w.+-]+", "_", f"{case.label} {impl.name}").strip("_")
        prof.export_chrome_trace(str(trace_dir / f"{name}.json"))
    return row


def run(families: list[str], device: str, steps: int, trace_dir: Path | None) -> list[dict[str, Any]]:
    """Profile the kernel and the peers of every case of `families`; print a summary table."""
    import torch

    cuda = device == "cuda"
    rows = []
    for family in families:
        if family == LAYERS:
            cases, note = layer_cases(device), ""
        else:
            cases, note = build_cases(family, (PROFILE_SHAPES if cuda else SMOKE)[family], cuda=cuda)
        if note:
            print(f"{family}: {note}")
        for case in cases:
            base = case.make_inputs(torch_dtype(case.dtype), device)
            for impl in case.impls:
                if impl.role == "reference" or (not cuda and (impl.gpu_only or not impl.cpu_backward)):
                    continue
                try:
                    rows.append(profile_impl(case, impl, base, device, steps, trace_dir))
                except Exception as e:  # an out-of-memory or unsupported peer is a result, not a crash
                    print(f"\n=== {case.label} :: {impl.name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                    if cuda:
                        torch.cuda.empty_cache()
    print("\nper fwd+bwd step (ms): wall (synchronised) / device (GPU kernels) / host (CPU, overlaps the GPU)")
    for r in rows:
        print(f"  {r['case']:<48} {r['impl']:<28} {r['wall_ms']:9.3f} {r['device_ms']:9.3f} {r['host_ms']:9.3f}")
    print(f"profiled {len(rows)} implementations")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="attention",
                    help=f"comma-separated subset of {(*FAMILIES, LAYERS)} ({LAYERS}: the generated layers)")
    ap.add_argument("--steps", type=int, default=10, help="profiled fwd+bwd calls per implementation")
    ap.add_argument("--trace", metavar="DIR", help="write a Chrome trace per implementation into DIR")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: tiny shapes under TRITON_INTERPRET=1, to check this script without a GPU")
    args = ap.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in families if f not in (*FAMILIES, LAYERS)]
    if unknown or not families:
        ap.error(f"--families: unknown {unknown}; choose from {','.join((*FAMILIES, LAYERS))}")
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if args.device == "cpu" and not interpreting:
        ap.error("--device cpu profiles the interpreted kernels: set TRITON_INTERPRET=1")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: nothing to profile (`TRITON_INTERPRET=1 python benchmarks/profile_kernels.py "
                  "--device cpu` runs this script's own check on the interpreted kernels)")
            return 0
        if interpreting:
            print("TRITON_INTERPRET=1 is set: the profile would show the interpreter; unset it", file=sys.stderr)
            return 2
    run(families, args.device, args.steps, Path(args.trace) if args.trace else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
