"""Speed and memory of the fused Triton kernels against plain PyTorch and the strongest named peer, same run.

    python benchmarks/kernels.py                                  # every family, several shapes (CUDA GPU)
    python benchmarks/kernels.py --quick --families attention     # one small shape per family
    python benchmarks/kernels.py --targets                        # the shapes issue 4's targets name
    python benchmarks/kernels.py --json runs/kernels.json         # also write the raw numbers
    TRITON_INTERPRET=1 python benchmarks/kernels.py --interpret-smoke   # CPU: every case checked, no timing

Families, and what each kernel is compared with (the peer; ratios are kernel / peer):

* attention (`energydsl.kernels.attention`), q, k, v (B, H, T, d):
  - causal: `torch.nn.functional.scaled_dot_product_attention(is_causal=True)` pinned to the flash backend
    (16-bit) or the memory-efficient one (fp32, which flash does not take);
  - alibi+key (ALiBi slopes and a per-key bias, causal): FlexAttention compiled with the same `score_mod`
    (the peer), and SDPA with a materialised additive mask (memory-efficient backend);
  - second-moment (`weighted_second_moment`, lse cached by an untimed first pass): no library has this op,
    so ratios are against the plain PyTorch reference.
* attention-wide (`attention.GENERIC_WIDE`, the feature-tiled kernels), q, k (B, H, T, Dk), v (B, H, T, Dv):
  CEM's attention with its exact diagonal term (examples/models/cem.energy at d = 768, 12 heads: scores over
  d/heads + d = 832 concatenated features, values 64 wide), ALiBi and a self bias, causal. No fused library
  op takes 832-wide scores with these biases: the peer is SDPA with the materialised additive (B, H, T, T)
  mask (memory-efficient backend), which is also what the torch backend runs.
* linear (`energydsl.kernels.linear`), plain and gated (per-token log decay): flash-linear-attention's
  `chunk_simple_gla` when `fla` is importable; otherwise ("fla not installed") a chunked PyTorch
  implementation in kernel_cases.py (C = 64, no T x T matrix; checked against the reference by
  --interpret-smoke).
* pointwise (`energydsl.kernels.pointwise`, sigmoid attention with a row bias -log T, causal, without and with
  ALiBi slopes): no library op
  here, so the peer is `torch.compile` of the T x T reference (what the torch backend runs); plain causal
  softmax attention of the same shape (SDPA) runs beside it, for issue 4's "at most 1.3x plain attention".
* epilogue (`energydsl.kernels.epilogue`): gated_activation (silu, gelu), momentum_update,
  nesterov_lookahead, against `torch.compile` of the reference (Inductor's fused elementwise kernels).

Every case also runs the plain PyTorch reference (`*_ref`, T x T for attention-like ops), which may run out of
memory at long T: that is reported as OOM, not as an error of the benchmark.

Times: median (and 20/80 % quantiles in the JSON) of `triton.testing.do_bench`, L2 flushed before each run.
"fwd" runs under no_grad; "fwd+bwd" is the forward plus the backward to every input that requires grad
(q, k, v[, u]; x, m, f, beta, eta; the attention biases and log decays are constants). Peak memory is
torch.cuda.max_memory_allocated during one call minus what was allocated before it: inputs excluded,
outputs, saved activations and gradients included. "rel err" is max|out - base| / max|base| for the forward
output against the torch reference in the same dtype (a sanity check that every implementation computes the
same function; accuracy is what pytest tests). fp32 runs use torch's float32 matmul precision as set (the
default, "highest", keeps TF32 off for the kernels, cuBLAS and SDPA alike).

Nothing GPU-only is imported at module import: torch, triton and the kernels are imported by `main`, after
TRITON_INTERPRET is settled.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kernel_cases import FAMILIES, FULL, QUICK, SMOKE, TARGETS, Case, Impl, build_cases, generator, torch_dtype

if TYPE_CHECKING:
    import torch
    from torch import Tensor

ROOT = Path(__file__).resolve().parent.parent
NO_CUDA = (
    "no CUDA device: GPU benchmarks skipped (the kernels are tested on the CPU under TRITON_INTERPRET=1 by "
    "pytest; `--interpret-smoke` checks this script's cases there)"
)
DEVICE = "cuda"  # where the benchmark runs (a module constant so that a dry run can point it elsewhere)
SMOKE_TOL = 1e-4  # relative, float32 (interpreted kernel, peers) against the float64 reference


# ----------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------


def as_tuple(out: Any) -> tuple[Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def detach_leaves(x: dict[str, Any]) -> dict[str, Any]:
    """Prepared inputs as fresh leaves (a layout change in `prepare` is not part of what is timed)."""
    import torch

    return {k: v.detach().requires_grad_() if torch.is_tensor(v) and v.requires_grad else v for k, v in x.items()}


def _cast(x: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """New leaves with every floating tensor cast to `dtype` (same values when widening)."""
    import torch

    out = {}
    for k, v in x.items():
        if torch.is_tensor(v) and v.is_floating_point():
            out[k] = v.detach().to(dtype).requires_grad_(v.requires_grad)
        else:
            out[k] = v
    return out


def grad_leaves(x: dict[str, Any]) -> dict[str, Tensor]:
    import torch

    return {k: v for k, v in x.items() if torch.is_tensor(v) and v.requires_grad}


def fwd_bwd_step(forward: Callable[[], Any], grads: Sequence[Tensor], leaves: list[Tensor]) -> Callable[[], None]:
    """One forward + backward with `grads` on the outputs, the leaves' gradients dropped after (each step
    starts as the first did)."""
    import torch

    def step() -> None:
        torch.autograd.backward(as_tuple(forward()), grads)
        for t in leaves:
            t.grad = None

    return step


def rel_err(got: Tensor, ref: Tensor) -> float:
    """max|got - ref| / max|ref| (the absolute error when ref vanishes), in float64."""
    err = (got.detach().double() - ref.detach().double()).abs().max().item()
    scale = ref.detach().double().abs().max().item()
    return err / scale if scale > 0 else err


def _short(e: BaseException) -> str:
    import torch

    if isinstance(e, torch.cuda.OutOfMemoryError):
        return "OOM"
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg[:100]}"


def _git(*args: str) -> str | None:
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}  # read-only: no opportunistic index refresh
    try:
        p = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, env=env)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def commit() -> str | None:
    """ENERGYDSL_COMMIT where set (a copy sent to a GPU machine: its .git, if any, may be another checkout's),
    else HEAD."""
    return os.environ.get("ENERGYDSL_COMMIT") or _git("rev-parse", "HEAD")


def _meta(cuda: bool) -> dict[str, Any]:
    import torch

    meta: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": commit(),
        "git_dirty": None
        if os.environ.get("ENERGYDSL_COMMIT")
        else bool(_git("status", "--porcelain", "--untracked-files=no")),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "argv": sys.argv[1:],
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    if cuda:
        meta["device"] = torch.cuda.get_device_name()
        meta["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        meta["cuda"] = torch.version.cuda
    else:
        meta["device"] = f"cpu ({platform.processor() or platform.machine()})"
    return meta


def _write_json(path: str, payload: dict[str, Any], quiet: bool = False) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    if not quiet:
        print(f"wrote {p}")


def _print_table(title: str, headers: list[str], rows: list[list[str]]) -> None:
    try:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
        print(f"\n{title}")
        print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
        return
    table = Table(title=escape(title), title_justify="left")
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i == 0 or h in ("note", "status", "case", "impl") else "right")
    for r in rows:
        table.add_row(*(escape(c) for c in r))  # "[flash]" is text, not rich markup
    Console(width=max(160, len(title) + 4)).print(table)


def _fmt(v: float | None, spec: str, suffix: str = "") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:{spec}}{suffix}"


# ----------------------------------------------------------------------------------------------------------
# --interpret-smoke: every case once, tiny shapes, float32 against the float64 reference; no timing
# ----------------------------------------------------------------------------------------------------------


def _smoke_case(case: Case) -> list[dict[str, Any]]:
    import torch

    base = case.make_inputs(torch.float32, "cpu")
    ref = next(i for i in case.impls if i.role == "reference")
    x64 = _cast(base, torch.float64)
    out64 = as_tuple(ref.fn(ref.prepare(x64) if ref.prepare else x64))
    gen = torch.Generator().manual_seed(1)
    grads64 = tuple(torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in out64)
    torch.autograd.backward(out64, grads64)
    truth = {k: v.grad for k, v in grad_leaves(x64).items()}

    rows = []
    for impl in case.impls:
        row: dict[str, Any] = {"family": case.family, "case": case.label, "impl": impl.name, "role": impl.role}
        rows.append(row)
        if impl.gpu_only:
            row["status"] = "not run (CUDA only)"
            continue
        x = _cast(base, torch.float32)
        if not impl.cpu_backward:  # eager flex refuses inputs that require grad on the CPU
            x = {k: v.detach() if torch.is_tensor(v) else v for k, v in x.items()}
        try:
            out = as_tuple(impl.fn(impl.prepare(x) if impl.prepare else x))
            row["fwd_err"] = max(rel_err(o, t) for o, t in zip(out, out64, strict=True))
            if not impl.cpu_backward:
                row["note"] = "forward only (no backward on the CPU)"
                continue
            torch.autograd.backward(out, tuple(g.float() for g in grads64))
            errs = []
            for k, t in truth.items():
                g = grad_leaves(x)[k].grad
                if g is None:
                    raise RuntimeError(f"no gradient reached {k!r}")
                errs.append(rel_err(g, t))
            row["grad_err"] = max(errs) if errs else 0.0
        except Exception as e:  # reported as a failed check
            row["status"] = f"FAIL {type(e).__name__}: {str(e).strip()[:100]}"
    # the tolerance: 1e-4, or a few times what float32 PyTorch itself gets on an ill-conditioned quantity
    ref32 = next(r for r in rows if r["role"] == "reference")
    for r in rows:
        if "status" in r:
            continue
        tol_f = max(SMOKE_TOL, 4 * ref32.get("fwd_err", 0.0))
        tol_g = max(SMOKE_TOL, 4 * ref32.get("grad_err", 0.0))
        r["tol"] = max(tol_f, tol_g)
        ok = r["fwd_err"] <= tol_f and r.get("grad_err", 0.0) <= tol_g
        r["status"] = ("ok" if ok else "FAIL (error above tolerance)") + (f": {r['note']}" if "note" in r else "")
    return rows


def interpret_smoke(families: list[str], json_path: str | None) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        if "triton" in sys.modules:
            print("--interpret-smoke: triton was imported before TRITON_INTERPRET=1 could be set", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"  # before the first import of triton
        print("TRITON_INTERPRET=1 set by --interpret-smoke (before triton is imported)")
    if importlib.util.find_spec("triton") is None:
        print("triton not installed: nothing to interpret; skipped")
        return 0
    import warnings

    import torch

    # expected here: eager flex is the point (it checks the score_mod's math without a compiler)
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")

    from energydsl.kernels import attention, epilogue, linear, pointwise

    if not (attention.INTERPRET and linear.INTERPRET and epilogue.INTERPRET and pointwise.INTERPRET):
        print("--interpret-smoke: the kernels are not running under the interpreter", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    print(
        "interpret smoke: each case once at a tiny shape on the CPU, float32 (Triton interpreter for the kernels) "
        "against the float64 torch reference; rel err = max|x - ref| / max|ref| over outputs (fwd) and input "
        "gradients (grad). No timings: the interpreter says nothing about speed."
    )
    all_rows: list[dict[str, Any]] = []
    notes: list[str] = []  # peers left out entirely (e.g. fla, CUDA only), not rows
    for fam in families:
        cases, note = build_cases(fam, SMOKE[fam], cuda=False)
        notes += [note] if note else []
        rows = [r for c in cases for r in _smoke_case(c)]
        all_rows += rows
        table = [
            [
                r["case"],
                r["impl"],
                r["role"],
                _fmt(r.get("fwd_err"), ".1e"),
                _fmt(r.get("grad_err"), ".1e"),
                _fmt(r.get("tol"), ".0e"),
                r["status"],
            ]
            for r in rows
        ]
        title = f"{fam} (interpreted)" + (f" - {note}" if note else "")
        _print_table(title, ["case", "impl", "role", "fwd rel err", "grad rel err", "tol", "status"], table)
    failed = [r for r in all_rows if r["status"].startswith("FAIL")]
    checked = [r for r in all_rows if r["status"].startswith("ok")]
    not_run = len(all_rows) - len(failed) - len(checked)
    print(
        f"interpret smoke: {len(checked)} implementation checks ok, {len(failed)} failed, "
        f"{not_run} not run on the CPU (CUDA only)" + "".join(f"; {n}" for n in notes)
    )
    if json_path:
        _write_json(json_path, {"meta": _meta(cuda=False), "mode": "interpret-smoke", "results": all_rows})
    return 1 if failed else 0


# ----------------------------------------------------------------------------------------------------------
# GPU benchmark
# ----------------------------------------------------------------------------------------------------------


def _time_ms(fn: Callable[[], Any], grad_to_none: list[Tensor] | None, warmup: int, rep: int) -> list[float]:
    """[median, p20, p80] in ms (do_bench runs fn once, then `warmup` ms of runs, then `rep` ms timed)."""
    from triton.testing import do_bench

    q = do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, quantiles=[0.5, 0.2, 0.8])
    return [float(v) for v in (q if isinstance(q, (list, tuple)) else [q])]


def _peak_mib(fn: Callable[[], Any], leaves: list[Tensor]) -> float:
    import torch

    for t in leaves:
        t.grad = None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    for t in leaves:
        t.grad = None
    return peak / 2**20


def _free() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def _measure(impl: Impl, x: dict[str, Any], grads: tuple[Tensor, ...], row: dict[str, Any], args: Any) -> None:
    import torch

    leaves = list(grad_leaves(x).values())

    def fwd() -> None:
        with torch.no_grad():
            impl.fn(x)

    def fwd_bwd() -> None:
        torch.autograd.backward(as_tuple(impl.fn(x)), grads)

    for key, fn, g2n in (("fwd", fwd, None), ("fwdbwd", fwd_bwd, leaves)):
        try:
            row[f"{key}_ms"] = _time_ms(fn, g2n, args.warmup, args.rep)
            row[f"peak_{key}_mib"] = _peak_mib(fn, leaves)
        except Exception as e:  # OOM and unsupported configurations are results too
            row[f"{key}_error"] = _short(e)
            _free()
        for t in leaves:
            t.grad = None


def _bench_case(case: Case, args: Any) -> tuple[list[dict[str, Any]], str]:
    import torch

    if case.uses_compile:
        torch._dynamo.reset()  # fresh compile caches: no recompile limit reached across shapes
    dtype = torch_dtype(case.dtype)
    base = case.make_inputs(dtype, DEVICE)
    rows: dict[str, dict[str, Any]] = {}
    prepared: dict[str, dict[str, Any]] = {}
    outs: dict[str, tuple[Tensor, ...]] = {}
    for impl in case.impls:
        row = rows[impl.name] = {
            "family": case.family,
            "case": case.variant,
            "dims": case.dims,
            "dtype": case.dtype,
            "impl": impl.name,
            "role": impl.role,
        }
        try:
            x = detach_leaves(impl.prepare(base) if impl.prepare else base)
            with torch.no_grad():
                outs[impl.name] = as_tuple(impl.fn(x))
            torch.cuda.synchronize()
            prepared[impl.name] = x
        except Exception as e:
            row["error"] = _short(e)
            _free()
    # forward agreement with the torch reference (else the first peer that ran)
    base_name = next((i.name for i in case.impls if i.role == "reference" and i.name in outs), None)
    base_name = base_name or next((i.name for i in case.impls if i.role == "peer" and i.name in outs), None)
    if base_name is not None:
        for name, out in outs.items():
            rows[name]["rel_err"] = max(rel_err(o, b) for o, b in zip(out, outs[base_name], strict=True))
        rows[base_name]["err_base"] = True
    shapes_from = outs.get(case.impls[0].name) or (outs[base_name] if base_name else None)
    gen = generator(DEVICE)
    grads = tuple(torch.randn(o.shape, generator=gen, device=DEVICE).to(o.dtype) for o in shapes_from or ())
    outs.clear()
    _free()
    if shapes_from is not None:
        for impl in case.impls:
            if impl.name in prepared:
                _measure(impl, prepared[impl.name], grads, rows[impl.name], args)
    prepared.clear()
    del base, grads
    _free()

    # the peer: the first named peer that ran both passes; without one, the torch reference
    ordered = [rows[i.name] for i in case.impls]
    ran = [r for r in ordered if "fwd_ms" in r and "fwdbwd_ms" in r]
    peer = next((r for r in ran if r["role"] == "peer"), None)
    peer_name = peer["impl"] if peer else None
    if peer is None:
        peer = next((r for r in ran if r["role"] == "reference"), None)
        has_peers = any(i.role == "peer" for i in case.impls)
        peer_name = f"{'no peer ran' if has_peers else 'no library op'}: vs torch ref" if peer else None
    for r in ordered:
        r["peer"] = peer_name
        if peer is None:
            continue
        for key in ("fwd_ms", "fwdbwd_ms"):
            if key in r and key in peer:
                r[f"{key[:-3]}_ratio"] = r[key][0] / peer[key][0]
        for key in ("peak_fwd_mib", "peak_fwdbwd_mib"):
            if key in r and key in peer and peer[key] > 0:
                r[f"{key[:-4]}_ratio"] = r[key] / peer[key]
    return ordered, peer_name or "none ran"


def _print_case(case: Case, rows: list[dict[str, Any]], peer: str) -> None:
    def ms(r: dict[str, Any], key: str) -> str:
        return _fmt(r[key][0], ".3f") if key in r else "-"

    table = []
    for r in rows:
        note = r.get("error") or "; ".join(
            f"{k.split('_')[0]}: {r[k]}" for k in ("fwd_error", "fwdbwd_error") if k in r
        )
        table.append(
            [
                r["impl"],
                ms(r, "fwd_ms"),
                _fmt(r.get("fwd_ratio"), ".2f", "x"),
                ms(r, "fwdbwd_ms"),
                _fmt(r.get("fwdbwd_ratio"), ".2f", "x"),
                _fmt(r.get("peak_fwd_mib"), ",.0f"),
                _fmt(r.get("peak_fwdbwd_mib"), ",.0f"),
                _fmt(r.get("peak_fwdbwd_ratio"), ".2f", "x"),
                "(base)" if r.get("err_base") else _fmt(r.get("rel_err"), ".1e"),
                note,
            ]
        )
    headers = [
        "impl",
        "fwd ms",
        "fwd/peer",
        "fwd+bwd ms",
        "f+b/peer",
        "peak fwd MiB",
        "peak f+b MiB",
        "mem/peer",
        "rel err",
        "note",
    ]
    _print_table(f"{case.family}: {case.label} - peer: {peer}", headers, table)


def _backward_choices() -> dict[tuple, Any]:
    """The narrow softmax backward's mode per shape so far, fused or split, with the times it was chosen on."""
    from energydsl.kernels.attention import GENERIC

    return dict(GENERIC.backward_choices)


def benchmark(families: list[str], args: Any) -> int:
    import triton

    meta = _meta(cuda=True)
    print(
        f"{meta['device']} (sm {meta['capability']}, CUDA {meta['cuda']}), torch {meta['torch']}, "
        f"triton {triton.__version__}, commit {(meta['git_commit'] or '?')[:12]}"
        f"{' (dirty)' if meta['git_dirty'] else ''}, fp32 matmul precision {meta['float32_matmul_precision']}"
    )
    print(
        "times: median ms of triton.testing.do_bench; ratios = this / peer (below 1: faster or smaller); "
        "peak = max_memory_allocated above the inputs; rel err = forward vs the torch reference, same dtype"
    )
    results: list[dict[str, Any]] = []
    summary: list[list[str]] = []
    notes: dict[str, str] = {}
    mode = "quick" if args.quick else "targets" if args.targets else "full"
    shapes = {"quick": QUICK, "targets": TARGETS, "full": FULL}[mode]
    meta["do_bench"] = {"warmup_ms": args.warmup, "rep_ms": args.rep, "quantiles": [0.5, 0.2, 0.8]}
    for fam in families:
        cases, note = build_cases(fam, shapes[fam], cuda=True)
        if note:
            notes[fam] = note
            if fam == "linear" and note.startswith("fla not"):
                print(f"{note}: linear attention is compared against kernel_cases.py's chunked PyTorch form")
            else:
                print(f"{fam}: peer {note}")
        for case in cases:
            before = _backward_choices()
            rows, peer = _bench_case(case, args)
            _print_case(case, rows, peer)
            results += rows
            kern = next((r for r in rows if r["role"] == "kernel"), {})
            chosen = [c for key, c in _backward_choices().items() if key not in before]
            if chosen and kern:  # the shape's first backward timed its two modes (`AttentionOps._fuse_dq`)
                kern["backward"] = [c._asdict() for c in chosen]
                print("  backward: " + "; ".join(
                    f"{'fused' if c.fused else 'split'} (split {c.split_ms:.3f} ms, fused {c.fused_ms:.3f} ms)"
                    for c in chosen))
            ref = next((r for r in rows if r["role"] == "reference"), {})
            ref_ratio = (
                kern["fwdbwd_ms"][0] / ref["fwdbwd_ms"][0] if "fwdbwd_ms" in kern and "fwdbwd_ms" in ref else None
            )
            summary.append(
                [
                    f"{case.family}: {case.label}",
                    peer,
                    _fmt(kern.get("fwd_ratio"), ".2f", "x"),
                    _fmt(kern.get("fwdbwd_ratio"), ".2f", "x"),
                    _fmt(kern.get("peak_fwdbwd_ratio"), ".2f", "x"),
                    _fmt(ref_ratio, ".2f", "x"),
                ]
            )
            if args.json:  # after every case: a run cut short keeps what it measured
                _write_json(args.json, {"meta": {**meta, "notes": notes}, "mode": mode, "results": results}, quiet=True)
    _print_table(
        "summary: triton kernel / peer (below 1: the kernel is faster / smaller)",
        ["case", "peer", "fwd", "fwd+bwd", "peak mem f+b", "fwd+bwd vs torch ref"],
        summary,
    )
    if args.json:
        _write_json(args.json, {"meta": {**meta, "notes": notes}, "mode": mode, "results": results})
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    grid = ap.add_mutually_exclusive_group()
    grid.add_argument("--quick", action="store_true", help="one small shape per family")
    grid.add_argument("--targets", action="store_true", help="only the shapes issue 4's targets name (T = 2k, 8k)")
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated subset of {FAMILIES}")
    ap.add_argument("--json", metavar="PATH", help="write the raw numbers (and device, versions, commit, date)")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warmup, ms (default 25)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench timed repetitions, ms (default 100)")
    ap.add_argument(
        "--interpret-smoke",
        action="store_true",
        help="CPU check under TRITON_INTERPRET=1: each case once at a tiny shape against the reference, no timing",
    )
    args = ap.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or not families:
        ap.error(f"--families: unknown {unknown}; choose from {','.join(FAMILIES)}")

    if args.interpret_smoke:
        return interpret_smoke(families, args.json)

    import torch

    if not torch.cuda.is_available():
        print(NO_CUDA)
        if args.json:
            _write_json(args.json, {"meta": _meta(cuda=False), "skipped": NO_CUDA, "results": []})
        return 0
    if importlib.util.find_spec("triton") is None:
        print("triton not installed: GPU benchmarks skipped")
        return 0
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("TRITON_INTERPRET=1 is set: the timings would measure the interpreter; unset it", file=sys.stderr)
        return 2
    return benchmark(families, args)


if __name__ == "__main__":
    sys.exit(main())
