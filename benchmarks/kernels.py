"""Speed and memory of the fused Triton kernels against plain PyTorch and the strongest named peer, same run.

    python benchmarks/kernels.py                                  # every family, several shapes (CUDA GPU)
    python benchmarks/kernels.py --quick --families attention     # one small shape per family
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
  implementation in this file (C = 64, no T x T matrix; checked against the reference by --interpret-smoke).
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
import inspect
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import Tensor

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ("attention", "attention-wide", "linear", "epilogue")
NO_CUDA = (
    "no CUDA device: GPU benchmarks skipped (the kernels are tested on the CPU under TRITON_INTERPRET=1 by "
    "pytest; `--interpret-smoke` checks this script's cases there)"
)
DEVICE = "cuda"  # where the benchmark runs (a module constant so that a dry run can point it elsewhere)
SMOKE_TOL = 1e-4  # relative, float32 (interpreted kernel, peers) against the float64 reference

# (B, H, T, d, dtype) for attention and linear; ((dims...), dtype) for the elementwise epilogues
ATTENTION_SHAPES = [
    (8, 16, 1024, 64, "bf16"),
    (8, 16, 4096, 64, "bf16"),
    (8, 8, 2048, 128, "bf16"),
    (8, 8, 4096, 128, "bf16"),
    (8, 16, 1024, 64, "fp32"),
    (8, 8, 2048, 128, "fp32"),
]
LINEAR_SHAPES = [
    (8, 16, 1024, 64, "bf16"),
    (8, 16, 4096, 64, "bf16"),
    (8, 8, 4096, 128, "bf16"),
    (8, 16, 2048, 64, "fp32"),
]
# (B, H, T, Dk, Dv, dtype)
WIDE_SHAPES = [(4, 12, 2048, 832, 64, "bf16"), (4, 12, 4096, 832, 64, "bf16")]
EPILOGUE_SHAPES = [((8, 2048, 4096), "bf16"), ((8, 4096, 4096), "bf16"), ((8, 2048, 4096), "fp32")]
QUICK = {
    "attention": [(8, 8, 1024, 64, "bf16")],
    "attention-wide": [(2, 12, 1024, 832, 64, "bf16")],
    "linear": [(8, 8, 1024, 64, "bf16")],
    "epilogue": [((8, 1024, 4096), "bf16")],
}
FULL = {"attention": ATTENTION_SHAPES, "attention-wide": WIDE_SHAPES, "linear": LINEAR_SHAPES,
        "epilogue": EPILOGUE_SHAPES}
# tiny shapes for the interpreter: T not a multiple of the 16-wide tiles, n not one of the 256-element blocks
SMOKE = {
    "attention": [(1, 2, 40, 16, "fp32")],
    "attention-wide": [(1, 2, 21, 40, 24, "fp32")],  # several 16-wide feature tiles under the interpreter
    "linear": [(1, 2, 40, 16, "fp32")],
    "epilogue": [((3, 333), "fp32")],
}


# ----------------------------------------------------------------------------------------------------------
# Cases: inputs and the implementations compared on them
# ----------------------------------------------------------------------------------------------------------


@dataclass
class Impl:
    name: str
    role: str  # "kernel" | "reference" | "peer"
    fn: Callable[[dict[str, Any]], Any]  # inputs -> output tensor (or tuple), in the kernel's layout
    prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # untimed: layout change, cached lse
    gpu_only: bool = False  # torch.compile'd or a CUDA-only library: not run by --interpret-smoke
    cpu_backward: bool = True  # False: --interpret-smoke checks the forward only (eager flex: no CPU backward)


@dataclass
class Case:
    family: str
    variant: str
    dims: dict[str, Any]
    dtype: str
    make_inputs: Callable[[Any, str], dict[str, Any]]  # (torch dtype, device) -> inputs; leaves require grad
    impls: list[Impl]
    uses_compile: bool = False

    @property
    def label(self) -> str:
        dims = " ".join(f"{k}={v}" for k, v in self.dims.items())
        return f"{self.variant} {dims} {self.dtype}"


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}[name]


def _generator(device: str) -> torch.Generator:
    import torch

    return torch.Generator(device=device).manual_seed(0)


def _randn(shape: Sequence[int], gen: torch.Generator, dtype: torch.dtype, device: str) -> Tensor:
    import torch

    return torch.randn(*shape, generator=gen, device=device).to(dtype).requires_grad_()


_BIASES = ("alibi_slopes", "self_bias", "key_bias")


def _biases(x: dict[str, Any]) -> dict[str, Any]:
    return {k: x[k] for k in _BIASES if k in x}


def _dense_mask(x: dict[str, Any]) -> Tensor:
    """The additive (B, H, T, T) mask a user would build for these scores: the biases in x, -inf above the
    diagonal."""
    import torch

    q = x["q"]
    i = torch.arange(q.shape[2], device=q.device)
    bias = torch.zeros((), device=q.device)
    if "alibi_slopes" in x:
        bias = bias - x["alibi_slopes"].float()[None, :, None, None] * (i[:, None] - i[None, :]).abs().float()
    if "self_bias" in x:
        bias = bias + x["self_bias"].float()[None, :, None, None] * (i[:, None] == i[None, :]).float()
    if "key_bias" in x:
        bias = bias + x["key_bias"].float()[:, :, None, :]
    return bias.masked_fill(i[None, :] > i[:, None], float("-inf")).to(q.dtype)


def _sdpa(backend: str, with_mask: bool) -> Callable[[dict[str, Any]], Tensor]:
    """scaled_dot_product_attention pinned to `backend` on a GPU: causal flag, or the dense bias mask."""

    def fn(x: dict[str, Any]) -> Tensor:
        import torch.nn.functional as F

        q, k, v = x["q"], x["k"], x["v"]
        kw: dict[str, Any] = {"attn_mask": _dense_mask(x)} if with_mask else {"is_causal": True}
        if not q.is_cuda:  # --interpret-smoke: checks the call, whichever CPU backend runs it
            return F.scaled_dot_product_attention(q, k, v, scale=x["scale"], **kw)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(getattr(SDPBackend, backend)):
            return F.scaled_dot_product_attention(q, k, v, scale=x["scale"], **kw)

    return fn


def _attention_cases(shapes: list[tuple], *, cuda: bool) -> list[Case]:
    import torch

    from energydsl.kernels import attention as K
    from energydsl.kernels.attention_ref import energy_attention_ref, weighted_second_moment_ref

    def kernel(x: dict[str, Any]) -> Tensor:
        return K.energy_attention(x["q"], x["k"], x["v"], scale=x["scale"], **_biases(x))

    def reference(x: dict[str, Any]) -> Tensor:
        return energy_attention_ref(x["q"], x["k"], x["v"], scale=x["scale"], **_biases(x))

    def flex() -> Impl:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def run(q: Tensor, k: Tensor, v: Tensor, slopes: Tensor, kb: Tensor, block_mask: Any, scale: float) -> Tensor:
            def score_mod(score: Tensor, b: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
                return score - slopes[h] * (qi - ki).abs() + kb[b, h, ki]

            return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)

        runner = torch.compile(run, dynamic=False) if cuda else run  # eager flex: slow, but checks the math

        def prepare(x: dict[str, Any]) -> dict[str, Any]:
            T = x["q"].shape[2]
            # causal structure only (like SDPA's is_causal flag); built once per case, outside the timing
            bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, T, T, device=x["q"].device)
            return {**x, "block_mask": bm}

        def fn(x: dict[str, Any]) -> Tensor:
            return runner(x["q"], x["k"], x["v"], x["alibi_slopes"], x["key_bias"], x["block_mask"], x["scale"])

        name = "flex_attention (compiled)" if cuda else "flex_attention (eager)"
        return Impl(name, "peer", fn, prepare=prepare, cpu_backward=cuda)

    def second_prepare(x: dict[str, Any]) -> dict[str, Any]:
        with torch.no_grad():  # the forward pass of the first-order update already has lse
            _, lse = K.energy_attention_with_lse(x["q"], x["k"], x["v"], scale=x["scale"])
        return {**x, "lse": lse}

    def second_kernel(x: dict[str, Any]) -> Tensor:
        return K.weighted_second_moment(x["q"], x["k"], x["v"], x["lse"], x["u"], scale=x["scale"])

    def second_reference(x: dict[str, Any]) -> Tensor:
        return weighted_second_moment_ref(x["q"], x["k"], x["v"], None, x["u"], scale=x["scale"])

    def inputs(variant: str, B: int, H: int, T: int, D: int) -> Callable[[Any, str], dict[str, Any]]:
        def make(dtype: torch.dtype, device: str) -> dict[str, Any]:
            gen = _generator(device)
            x: dict[str, Any] = {k: _randn((B, H, T, D), gen, dtype, device) for k in ("q", "k", "v")}
            x["scale"] = D**-0.5
            if variant == "alibi+key":  # biases stay fp32 (constants here)
                x["alibi_slopes"] = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], device=device)
                x["key_bias"] = -0.5 * torch.rand(B, H, T, generator=gen, device=device)
            if variant == "second-moment":
                x["u"] = _randn((B, H, T, D), gen, dtype, device)
            return x

        return make

    cases = []
    for B, H, T, D, dt in shapes:
        dims = {"B": B, "H": H, "T": T, "d": D}
        flash_ok = dt in ("bf16", "fp16")
        causal_peer = Impl(
            "sdpa[flash]" if flash_ok else "sdpa[mem-efficient]",
            "peer",
            _sdpa("FLASH_ATTENTION" if flash_ok else "EFFICIENT_ATTENTION", with_mask=False),
        )
        cases.append(
            Case(
                "attention",
                "causal",
                dims,
                dt,
                inputs("causal", B, H, T, D),
                [Impl("triton", "kernel", kernel), Impl("torch ref", "reference", reference), causal_peer],
            )
        )
        cases.append(
            Case(
                "attention",
                "alibi+key",
                dims,
                dt,
                inputs("alibi+key", B, H, T, D),
                [
                    Impl("triton", "kernel", kernel),
                    Impl("torch ref", "reference", reference),
                    flex(),
                    Impl("sdpa+mask[mem-efficient]", "peer", _sdpa("EFFICIENT_ATTENTION", with_mask=True)),
                ],
                uses_compile=True,
            )
        )
        cases.append(
            Case(
                "attention",
                "second-moment",
                dims,
                dt,
                inputs("second-moment", B, H, T, D),
                [
                    Impl("triton", "kernel", second_kernel, prepare=second_prepare),
                    Impl("torch ref", "reference", second_reference),
                ],
            )
        )
    return cases


def _wide_attention_cases(shapes: list[tuple], *, cuda: bool) -> list[Case]:
    """CEM's attention with the exact diagonal term: wide scores, narrow values, ALiBi and a self bias."""
    import torch

    from energydsl.kernels import attention as K
    from energydsl.kernels.attention_ref import energy_attention_ref

    def kernel(x: dict[str, Any]) -> Tensor:  # the wide kernels at any width (the smoke shape is narrow)
        return K.GENERIC_WIDE.energy_attention(x["q"], x["k"], x["v"], scale=x["scale"], **_biases(x))

    def reference(x: dict[str, Any]) -> Tensor:
        return energy_attention_ref(x["q"], x["k"], x["v"], scale=x["scale"], **_biases(x))

    def inputs(B: int, H: int, T: int, Dk: int, Dv: int) -> Callable[[Any, str], dict[str, Any]]:
        def make(dtype: torch.dtype, device: str) -> dict[str, Any]:
            gen = _generator(device)
            x: dict[str, Any] = {n: _randn((B, H, T, d), gen, dtype, device) for n, d in (("q", Dk), ("k", Dk),
                                                                                       ("v", Dv))}
            x["scale"] = Dk**-0.5
            x["alibi_slopes"] = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], device=device)
            x["self_bias"] = torch.full((H,), 0.5, device=device)
            return x

        return make

    return [
        Case(
            "attention-wide",
            "cem-diagonal",
            {"B": B, "H": H, "T": T, "dk": Dk, "dv": Dv},
            dt,
            inputs(B, H, T, Dk, Dv),
            [
                Impl("triton (wide)", "kernel", kernel),
                Impl("torch ref", "reference", reference),
                Impl("sdpa+mask[mem-efficient]", "peer", _sdpa("EFFICIENT_ATTENTION", with_mask=True)),
            ],
        )
        for B, H, T, Dk, Dv, dt in shapes
    ]


def linear_attention_chunked_torch(q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> Tensor:
    """The torch backend's chunked (gated) linear attention (`energydsl.runtime.ops.linear_attention`)."""
    from energydsl.runtime.ops import linear_attention

    return linear_attention(q, k, v, **kw)


def _fla_peer() -> tuple[Impl | None, str]:
    """flash-linear-attention's chunk_simple_gla as an Impl, or None and why not."""
    if importlib.util.find_spec("fla") is None:
        return None, "fla not installed"
    try:
        import fla
        from fla.ops.simple_gla import chunk_simple_gla
    except Exception as e:  # any import failure just means: no fla peer
        return None, f"fla not importable ({type(e).__name__}: {str(e)[:80]})"
    params = inspect.signature(chunk_simple_gla).parameters
    # old fla: (B, H, T, d) only; head_first flag: pass False; newer (no flag): (B, T, H, d)
    time_major = "head_first" in params or "cu_seqlens" in params
    extra = {"head_first": False} if "head_first" in params else {}

    def prepare(x: dict[str, Any]) -> dict[str, Any]:
        if not time_major:
            return dict(x)
        y = {**x, **{k: x[k].transpose(1, 2).contiguous() for k in ("q", "k", "v")}}
        if x.get("log_decay") is not None:
            y["log_decay"] = x["log_decay"].transpose(1, 2).contiguous()
        return y

    def fn(x: dict[str, Any]) -> Tensor:
        o, _ = chunk_simple_gla(x["q"], x["k"], x["v"], g=x.get("log_decay"), scale=x["scale"], **extra)
        return o.transpose(1, 2) if time_major else o  # a view: no copy

    version = getattr(fla, "__version__", "?")
    return Impl(f"fla chunk_simple_gla {version}", "peer", fn, prepare=prepare, gpu_only=True), f"fla {version}"


def _linear_cases(shapes: list[tuple], *, cuda: bool) -> tuple[list[Case], str]:
    import torch

    from energydsl.kernels.linear import linear_attention
    from energydsl.kernels.linear_ref import linear_attention_parallel_ref

    def call(f: Callable[..., Tensor]) -> Callable[[dict[str, Any]], Tensor]:
        return lambda x: f(x["q"], x["k"], x["v"], scale=x["scale"], log_decay=x.get("log_decay"))

    if cuda:
        fla_impl, fla_note = _fla_peer()
    else:
        fla_impl, fla_note = None, "fla (CUDA only): not run by --interpret-smoke"

    def inputs(gated: bool, B: int, H: int, T: int, D: int) -> Callable[[Any, str], dict[str, Any]]:
        def make(dtype: torch.dtype, device: str) -> dict[str, Any]:
            gen = _generator(device)
            x: dict[str, Any] = {k: _randn((B, H, T, D), gen, dtype, device) for k in ("q", "k", "v")}
            x["scale"] = D**-0.5
            if gated:  # per-step decays in (e^-0.3, 1], fp32 like the kernel tests
                x["log_decay"] = -0.3 * torch.rand(B, H, T, generator=gen, device=device)
            return x

        return make

    # the smoke's T = 40 must span several chunks for the cross-chunk state to be checked
    chunk = 64 if cuda else 16

    def chunked(q: Tensor, k: Tensor, v: Tensor, **kw: Any) -> Tensor:
        return linear_attention_chunked_torch(q, k, v, chunk=chunk, **kw)

    cases = []
    for B, H, T, D, dt in shapes:
        for gated in (False, True):
            impls = [
                Impl("triton", "kernel", call(linear_attention)),
                Impl("torch ref (T x T)", "reference", call(linear_attention_parallel_ref)),
            ]
            if fla_impl is not None:
                impls.append(fla_impl)
            impls.append(Impl(f"torch chunked (C={chunk})", "peer", call(chunked)))
            variant = "gated" if gated else "plain"
            cases.append(
                Case("linear", variant, {"B": B, "H": H, "T": T, "d": D}, dt, inputs(gated, B, H, T, D), impls)
            )
    return cases, fla_note


def _epilogue_cases(shapes: list[tuple], *, cuda: bool) -> list[Case]:
    import torch

    from energydsl.kernels import epilogue as E
    from energydsl.kernels.epilogue_ref import gated_activation_ref, momentum_update_ref, nesterov_lookahead_ref

    def gated(act: str) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
        def ref(g: Tensor, v: Tensor) -> Tensor:
            return gated_activation_ref(g, v, act)

        compiled = torch.compile(ref, dynamic=False)
        return (
            lambda x: E.gated_activation(x["gate"], x["value"], act),
            lambda x: ref(x["gate"], x["value"]),
            lambda x: compiled(x["gate"], x["value"]),
        )

    def momentum() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
        compiled = torch.compile(momentum_update_ref, dynamic=False)
        return (
            lambda x: E.momentum_update(x["x"], x["m"], x["f"], x["beta"], x["eta"]),
            lambda x: momentum_update_ref(x["x"], x["m"], x["f"], x["beta"], x["eta"]),
            lambda x: compiled(x["x"], x["m"], x["f"], x["beta"], x["eta"]),
        )

    def nesterov() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
        compiled = torch.compile(nesterov_lookahead_ref, dynamic=False)
        return (
            lambda x: E.nesterov_lookahead(x["x"], x["m"], x["beta"]),
            lambda x: nesterov_lookahead_ref(x["x"], x["m"], x["beta"]),
            lambda x: compiled(x["x"], x["m"], x["beta"]),
        )

    def inputs(names: tuple[str, ...], scalars: tuple[str, ...], shape: tuple[int, ...]) -> Callable[..., Any]:
        def make(dtype: torch.dtype, device: str) -> dict[str, Any]:
            gen = _generator(device)
            x: dict[str, Any] = {n: _randn(shape, gen, dtype, device) for n in names}
            for n, val in zip(scalars, (0.9, 0.1)):  # learned step sizes: fp32 scalars with gradients
                x[n] = torch.tensor(val, device=device).requires_grad_()
            return x

        return make

    cases = []
    for shape, dt in shapes:
        variants = [
            ("gated silu", gated("silu"), inputs(("gate", "value"), (), shape)),
            ("gated gelu", gated("gelu"), inputs(("gate", "value"), (), shape)),
            ("momentum", momentum(), inputs(("x", "m", "f"), ("beta", "eta"), shape)),
            ("nesterov", nesterov(), inputs(("x", "m"), ("beta",), shape)),
        ]
        for variant, (kern, ref, comp), make in variants:
            impls = [
                Impl("triton", "kernel", kern),
                Impl("torch eager ref", "reference", ref),
                Impl("torch.compile(ref)", "peer", comp, gpu_only=True),
            ]
            dims = {"shape": "x".join(map(str, shape))}
            cases.append(Case("epilogue", variant, dims, dt, make, impls, uses_compile=True))
    return cases


def build_cases(family: str, shapes: list[tuple], *, cuda: bool) -> tuple[list[Case], str]:
    if family == "attention":
        return _attention_cases(shapes, cuda=cuda), ""
    if family == "attention-wide":
        return _wide_attention_cases(shapes, cuda=cuda), ""
    if family == "linear":
        return _linear_cases(shapes, cuda=cuda)
    return _epilogue_cases(shapes, cuda=cuda), ""


# ----------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------


def _as_tuple(out: Any) -> tuple[Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _detach_leaves(x: dict[str, Any]) -> dict[str, Any]:
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


def _leaves(x: dict[str, Any]) -> dict[str, Tensor]:
    import torch

    return {k: v for k, v in x.items() if torch.is_tensor(v) and v.requires_grad}


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


def _meta(cuda: bool) -> dict[str, Any]:
    import torch

    meta: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
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


def _write_json(path: str, payload: dict[str, Any]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=1, default=str) + "\n")
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
    out64 = _as_tuple(ref.fn(ref.prepare(x64) if ref.prepare else x64))
    gen = torch.Generator().manual_seed(1)
    grads64 = tuple(torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in out64)
    torch.autograd.backward(out64, grads64)
    truth = {k: v.grad for k, v in _leaves(x64).items()}

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
            out = _as_tuple(impl.fn(impl.prepare(x) if impl.prepare else x))
            row["fwd_err"] = max(rel_err(o, t) for o, t in zip(out, out64, strict=True))
            if not impl.cpu_backward:
                row["note"] = "forward only (no backward on the CPU)"
                continue
            torch.autograd.backward(out, tuple(g.float() for g in grads64))
            errs = []
            for k, t in truth.items():
                g = _leaves(x)[k].grad
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

    from energydsl.kernels import attention, epilogue, linear

    if not (attention._INTERPRET and linear.INTERPRET and epilogue.INTERPRET):
        print("--interpret-smoke: the kernels are not running under the interpreter", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    print(
        "interpret smoke: each case once at a tiny shape on the CPU, float32 (Triton interpreter for the kernels) "
        "against the float64 torch reference; rel err = max|x - ref| / max|ref| over outputs (fwd) and input "
        "gradients (grad). No timings: the interpreter says nothing about speed."
    )
    all_rows: list[dict[str, Any]] = []
    for fam in families:
        cases, note = build_cases(fam, SMOKE[fam], cuda=False)
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
        f"{not_run} not run on the CPU (CUDA only)"
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

    leaves = list(_leaves(x).values())

    def fwd() -> None:
        with torch.no_grad():
            impl.fn(x)

    def fwd_bwd() -> None:
        torch.autograd.backward(_as_tuple(impl.fn(x)), grads)

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
    dtype = _torch_dtype(case.dtype)
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
            x = _detach_leaves(impl.prepare(base) if impl.prepare else base)
            with torch.no_grad():
                outs[impl.name] = _as_tuple(impl.fn(x))
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
    gen = _generator(DEVICE)
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
    shapes = QUICK if args.quick else FULL
    for fam in families:
        cases, note = build_cases(fam, shapes[fam], cuda=True)
        if note:
            notes[fam] = note
            if fam == "linear" and note.startswith("fla not"):
                print(f"{note}: linear attention is compared against the chunked PyTorch implementation in this file")
            else:
                print(f"{fam}: peer {note}")
        for case in cases:
            rows, peer = _bench_case(case, args)
            _print_case(case, rows, peer)
            results += rows
            kern = next((r for r in rows if r["role"] == "kernel"), {})
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
    _print_table(
        "summary: triton kernel / peer (below 1: the kernel is faster / smaller)",
        ["case", "peer", "fwd", "fwd+bwd", "peak mem f+b", "fwd+bwd vs torch ref"],
        summary,
    )
    if args.json:
        meta["notes"] = notes
        meta["do_bench"] = {"warmup_ms": args.warmup, "rep_ms": args.rep, "quantiles": [0.5, 0.2, 0.8]}
        _write_json(args.json, {"meta": meta, "mode": "quick" if args.quick else "full", "results": results})
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one small shape per family")
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
