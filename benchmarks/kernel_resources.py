"""Registers, spills and shared memory of the attention, linear and pointwise kernels' autotune configs on an H100,
no GPU needed.

The autotuner times every config (`energydsl.kernels.attention_configs.AUTOTUNE_CONFIGS`, `energydsl.kernels.linear`'s
`_CONFIGS`) on the GPU and keeps the fastest, so a config list is only as good as its best member. A config that
needs more than 255 registers per thread spills to local memory, which is slow; if every config of a kernel variant
spills, no amount of tuning helps. Triton compiles for sm_90 without a GPU (ptxas ships with it), and ptxas reports
what it allocated: this script compiles each (kernel, variant, config) and prints registers, spill stores and shared
memory, and which variants have a spill-free config. It also prints the SASS instructions per iteration of each loop
(nvdisasm ships with Triton too): the elementwise work per block that a register count misses; and, in brackets, the
stores to shared memory per iteration where there are any (a register tile staged there on every block).

Variants: the narrow kernels at head dims 64 and 128, plain (causal, no bias) and with CEM's score terms (ALiBi +
self bias, their gradients), and the weighted second moment; the wide (feature-tiled) kernels with CEM's terms,
first and second order; the linear-attention kernels at head dims 64 (plain) and 128 (with a decay gate; the chunk-
state kernel in its forward direction), whose tiles are fixed (`_tile_sizes`); the pointwise kernels with the
sigmoid weight and a row bias at head dim 64, and with ALiBi slopes (their gradient too) at 128. bf16 inputs.
The numbers come from this machine's Triton and ptxas; a GPU machine with another Triton may allocate a little
differently.

    python benchmarks/kernel_resources.py                # the table (3-5 min on 2 cores)
    python benchmarks/kernel_resources.py --check        # exit 1 if a kernel variant has no spill-free config
    python benchmarks/kernel_resources.py --json out.json --jobs 4
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from energydsl.codegen.triton_source import FAMILIES

# each family's kernels by role, in launch order (AUTOTUNE_CONFIGS's too)
ROLES = {"attention": ("fwd", "dkdv", "dq"), "attention_wide": ("fwd", "dkdv", "dq"),
         "linear": ("state", "fwd", "dqk", "dv"), "pointwise": ("fwd", "dkdv", "dq"),
         "pointwise_wide": ("fwd", "dkdv", "dq")}
# the pointwise kernels' weight and its derivative, by name in energydsl/kernels/pointwise_kernels.py (resolved
# in the worker, after TRITON_INTERPRET is cleared: importing the kernels here could decorate them interpreted)
_SIGMOID = dict(WEIGHT="_sigmoid", WEIGHT_GRAD="_sigmoid_grad")
_CEM = dict(HAS_ALIBI=True, HAS_SELF=True, NEED_ALIBI=True, NEED_SELF=True)


class Variant(NamedTuple):
    name: str
    family: str  # a key of triton_source.FAMILIES
    flags: dict[str, Any]  # constexprs besides the tiles; absent switches are off
    dims: tuple[int, int] = (0, 0)  # linear: (Dk, Dv), which set its fixed tiles


VARIANTS = [
    Variant("d64 plain", "attention", dict(BLOCK_DK=64, BLOCK_DV=64)),
    Variant("d128 plain", "attention", dict(BLOCK_DK=128, BLOCK_DV=128)),
    Variant("d64 alibi+self", "attention", dict(BLOCK_DK=64, BLOCK_DV=64, **_CEM)),
    Variant("d128 alibi+self", "attention", dict(BLOCK_DK=128, BLOCK_DV=128, **_CEM)),
    Variant("d64 second", "attention", dict(BLOCK_DK=64, BLOCK_DV=64, SECOND=True)),
    Variant("wide alibi+self", "attention_wide", dict(_CEM)),
    Variant("wide second", "attention_wide", dict(SECOND=True, HAS_SELF=True, NEED_SELF=True)),
    Variant("linear d64", "linear", {}, (64, 64)),
    Variant("linear d128 gated", "linear", dict(HAS_DECAY=True), (128, 128)),
    Variant("pointwise d64 sigmoid", "pointwise", dict(BK=64, BV=64, HAS_RB=True, **_SIGMOID)),
    Variant("pointwise d128 sigmoid+alibi", "pointwise",
            dict(BK=128, BV=128, HAS_RB=True, HAS_ALIBI=True, NEED_ALIBI=True, **_SIGMOID)),
    Variant("pointwise wide sigmoid+alibi", "pointwise_wide",
            dict(HAS_RB=True, HAS_ALIBI=True, NEED_ALIBI=True, **_SIGMOID)),
]
_SWITCHES = ("STRICT", "HAS_ALIBI", "HAS_SELF", "HAS_KB", "SECOND", "NEED_KB", "NEED_SELF", "NEED_ALIBI",
             "HAS_DECAY", "REVERSE", "HAS_RB")
_FP32_ARGS = {"LSE_IN", "LSE", "DELTA", "ALIBI", "SELF_B", "KEY_B", "DKB", "DDIAG", "DDIST", "DQ_ACC", "DU_ACC",
              "g_ptr", "r_ptr", "RB", "KB", "SELF", "DRB"}
_WIDE_GRADS = {"DQ", "DK", "DV", "DU"}  # the wide backward writes fp32 gradients (FEATURE_LOOP adds into them)
_FP32_OUT = {"_pointwise_fwd_wide_kernel": {"O"}}  # so does the wide pointwise forward
_SCALAR_ARGS = {"scale": "fp32", "T": "i32", "H": "i32", "D_QK": "i32", "D_V": "i32", "T_TUNE": "i32"}
_MULTIPLES_OF_16 = {"T", "D_QK", "D_V", "T_TUNE"}
_LINEAR_DIMS = ("K", "V")  # the linear kernels' head dims (the attention kernels' K and V are tensors)
# strides that are 1 at the benchmark shapes, which the JIT specialises to the constant: the time stride of the
# contiguous per-token log decays of the linear kernels
_UNIT_STRIDES = {"stride_gt": 1}
_LABEL = re.compile(r"\s*(\.L_x_\d+):")
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
_BRANCH = re.compile(r"\bBRA\b.*?(\.L_x_\d+)")
_PTXAS = re.compile(r"(\d+) bytes spill stores.*?Used (\d+) registers", re.S)


class Job(NamedTuple):
    role: str
    variant: int  # index into VARIANTS
    tiles: dict[str, int]  # BLOCK_M, BLOCK_N (and BLOCK_D); linear: C, BK, BV
    num_warps: int
    num_stages: int


def jobs() -> list[Job]:
    """Every config of every kernel, for every variant."""
    os.environ.pop("TRITON_INTERPRET", None)  # the real configs (the interpreter build has none)
    from energydsl.kernels import linear, pointwise
    from energydsl.kernels.attention_configs import AUTOTUNE_CONFIGS

    out = []
    for v, variant in enumerate(VARIANTS):
        if variant.family == "linear":
            sizes = linear._tile_sizes(*variant.dims)
            tiles = dict(zip(("C", "BK", "BV"), sizes, strict=True))
            per_role = [[(tiles, c) for c in linear._CONFIGS]] * len(ROLES["linear"])
        elif variant.family.startswith("pointwise"):
            per_role = [[(dict(c.kwargs), c) for c in configs]
                        for configs in pointwise._CONFIGS[variant.family == "pointwise_wide"]]
        else:
            per_role = [[(dict(c.kwargs), c) for c in configs]
                        for configs in AUTOTUNE_CONFIGS[variant.family == "attention_wide"]]
        for role, configs in zip(ROLES[variant.family], per_role, strict=True):
            out += [Job(role, v, tiles, c.num_warps, c.num_stages) for tiles, c in configs]
    return out


def compile_for_sm90(
    kernel: Any, flags: dict[str, Any], dtype: str, num_warps: int, num_stages: int, scale_type: str = "fp32",
    dims: tuple[str, ...] = (),
) -> Any:
    """Compile a kernel template (attention, narrow or wide, or linear) for sm_90 without a GPU: `flags` holds its
    constexprs (extra keys are ignored), `dtype` ("bf16" or "fp32") its q/k/v/o tensors; the statistics are fp32.
    `dims` names integer head-dim arguments besides D_QK and D_V (the linear kernels' K and V).

    Specialised as the JIT specialises a launch at the benchmark shapes: every tensor 16-byte aligned and T,
    the head dims and the kernels' strides (`stride_*`) multiples of 16, but for the log decays' time stride,
    which is 1. Without those hints the loads do not vectorise (one 2-byte load per element) and the counts
    describe a kernel no benchmark runs.
    `scale_type`: "fp64" is how torch.compile (Inductor) types the Python float `scale` when it launches a
    triton_op's kernel.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # a constexpr left out takes its default, as at a launch (else it would be typed a pointer, hence true)
    consts = {p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}
    consts |= {k: v for k, v in flags.items() if k in kernel.arg_names}
    consts |= {k: v for k, v in _UNIT_STRIDES.items() if k in kernel.arg_names}
    strides = [a for a in kernel.arg_names if a.startswith("stride_") and a not in consts]  # the row layouts
    scalars = _SCALAR_ARGS | dict.fromkeys((*dims, *strides), "i32")
    fp32 = _FP32_ARGS | (_WIDE_GRADS if "_wide_" in kernel.__name__ else set()) | _FP32_OUT.get(kernel.__name__, set())
    sig = {a: scalars.get(a, "*fp32" if a in fp32 else "*" + dtype) for a in kernel.arg_names}
    if "scale" in sig:
        sig["scale"] = scale_type
    sig |= {c: "constexpr" for c in consts}
    multiples_of_16 = [a for a in kernel.arg_names
                       if sig[a].startswith("*") or a in _MULTIPLES_OF_16 or a in dims or a in strides]
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in multiples_of_16}
    return triton.compile(ASTSource(kernel, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def loops(cubin: bytes) -> list[list[str]]:
    """The SASS opcodes of each loop of a kernel (nvdisasm; a loop is a backward branch), in code order.

    For the narrow kernels their lengths are the per-block costs of the unmasked blocks, then of the
    diagonal's: what the tile's non-matmul work costs, which a GPU timing would show and a register count does
    not. A shared-memory store (STS, STSM) inside a loop stages a register tile through shared memory on every
    block, e.g. a transposed score tile fed to a matmul (loads from global memory land there without one).
    """
    import subprocess
    import tempfile

    import triton

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([triton.knobs.nvidia.nvdisasm.path, "-c", f.name], capture_output=True,
                              text=True, check=True).stdout
    labels: dict[str, int] = {}
    opcodes: list[str] = []
    found = []
    for line in sass.splitlines():
        if label := _LABEL.match(line):
            labels[label.group(1)] = len(opcodes)
        elif instruction := _INSTRUCTION.search(line):
            opcodes.append(instruction.group(1))
            branch = _BRANCH.search(line)
            start = labels.get(branch.group(1), len(opcodes)) if branch else len(opcodes)
            if start < len(opcodes) - 1:  # a one-instruction self-branch is the exit trap, not a loop
                found.append(opcodes[start:])
    return found


def compile_job(job: Job) -> dict[str, Any]:
    """Compile one config for sm_90 and read registers and spills from ptxas' log (run in a worker)."""
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"  # a cached cubin would print no ptxas log
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    import importlib

    variant = VARIANTS[job.variant]
    family = FAMILIES[variant.family]
    module = importlib.import_module(f"energydsl.kernels.{family.templates[-1]}")  # the kernels' own module
    kernel = getattr(module, family.kernels[ROLES[variant.family].index(job.role)])
    flags = {s: False for s in _SWITCHES} | dict(DOT_PREC="tf32") | variant.flags | job.tiles
    weights = importlib.import_module("energydsl.kernels.pointwise_kernels")  # the functions, by name
    flags |= {k: getattr(weights, flags[k]) for k in ("WEIGHT", "WEIGHT_GRAD") if k in flags}
    row = dict(role=job.role, variant=variant.name, tiles=job.tiles, num_warps=job.num_warps,
               num_stages=job.num_stages)
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            dims = _LINEAR_DIMS if variant.family == "linear" else ()
            compiled = compile_for_sm90(kernel, flags, "bf16", job.num_warps, job.num_stages, dims=dims)
    except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
        return row | dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")
    found = _PTXAS.search(log.getvalue())
    if found is None:
        return row | dict(error="no ptxas log (this Triton ignores TRITON_DUMP_PTXAS_LOG)")
    spill, regs = map(int, found.groups())
    bodies = loops(compiled.asm["cubin"])
    return row | dict(registers=regs, spill_bytes=spill, shared_kib=compiled.metadata.shared / 1024,
                      loop_instructions=[len(b) for b in bodies],
                      loop_shared_stores=[sum(op.startswith("STS") for op in b) for b in bodies],
                      loop_reductions=[b.count("REDG") for b in bodies],
                      loop_atomics=[b.count("ATOMG") for b in bodies])


def _tiles(row: dict[str, Any]) -> str:
    t = row["tiles"]
    if "C" in t:  # linear: chunk length, Dk- and Dv-blocks
        text = f"C{t['C']} {t['BK']}x{t['BV']}"
    else:
        text = f"{t['BLOCK_M']}x{t['BLOCK_N']}" + (f" d{t['BLOCK_D']}" if "BLOCK_D" in t else "")
        text += " loop" if t.get("FEATURE_LOOP") else ""
        text += " +dq" if t.get("DQ_ATOMIC") else ""
    return f"{text} w{row['num_warps']} s{row['num_stages']}"


def without_fit(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(kernel, variant) pairs none of whose configs compiles without spilling; each backward mode counts as a
    variant of its own: the wide backward's (a program per feature tile, or FEATURE_LOOP), and the narrow
    dK/dV kernel's (alone, or adding dQ: DQ_ATOMIC)."""
    fits: dict[tuple[str, str], bool] = {}
    for r in rows:
        mode = " loop" if r["tiles"].get("FEATURE_LOOP") else " +dq" if r["tiles"].get("DQ_ATOMIC") else ""
        key = (r["role"], r["variant"] + mode)
        fits[key] = fits.get(key, False) or r.get("spill_bytes") == 0
    return [k for k, ok in fits.items() if not ok]


def print_table(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="fused kernels on sm_90, bf16: ptxas' allocation per autotune config",
                  title_justify="left")
    for h in ("kernel", "variant", "config", "registers", "spill bytes", "shared KiB", "loop instructions"):
        table.add_column(h, justify="left" if h in ("kernel", "variant", "config") else "right")
    for r in rows:
        if "error" in r:
            table.add_row(r["role"], r["variant"], _tiles(r), "-", r["error"], "-", "-")
        else:
            spill = str(r["spill_bytes"])
            loops_text = " / ".join(map(str, r["loop_instructions"]))
            if any(r["loop_shared_stores"]):
                loops_text += " (STS " + " / ".join(map(str, r["loop_shared_stores"])) + ")"
            table.add_row(r["role"], r["variant"], _tiles(r), str(r["registers"]),
                          f"[red]{spill}[/red]" if r["spill_bytes"] else spill, f"{r['shared_kib']:.0f}", loops_text)
    Console(width=120).print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a kernel variant has no spill-free config")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--jobs", type=int, default=2, help="compiler processes (default 2)")
    parser.add_argument("--variants", metavar="NAMES",
                        help=f"comma-separated subset of: {', '.join(v.name for v in VARIANTS)}")
    args = parser.parse_args(argv)
    names = [v.name for v in VARIANTS]
    wanted = [w.strip() for w in args.variants.split(",")] if args.variants else names
    unknown = [w for w in wanted if w not in names]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(names)}")
    todo = [j for j in jobs() if VARIANTS[j.variant].name in wanted]
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        rows = list(pool.map(compile_job, todo))
    print_table(rows)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        import triton

        payload = dict(target="cuda sm_90", triton=triton.__version__, rows=rows)
        Path(args.json).write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {args.json}")
    missing = without_fit(rows)
    for role, variant in missing:
        print(f"no spill-free config: {role} {variant}")
    if not missing:
        print(f"every kernel variant has a spill-free config ({len(rows)} compilations)")
    return 1 if args.check and missing else 0


if __name__ == "__main__":
    sys.exit(main())
