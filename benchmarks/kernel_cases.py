"""The cases `kernels.py` measures: each family's shapes, its inputs and the implementations compared on them.

A case makes its inputs (leaves that require grad) for a dtype and device, and lists its implementations: the
Triton kernel, the plain PyTorch reference (T x T for attention-like ops) and the named peers; `kernels.py`'s
docstring says which peer each family is measured against. torch and the kernels are imported inside the
builders, once `kernels.py` has settled TRITON_INTERPRET.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import Tensor

FAMILIES = ("attention", "attention-wide", "linear", "pointwise", "epilogue")

# (B, H, T, d, dtype) for attention and linear; ((dims...), dtype) for the elementwise epilogues
# B and H fixed while T doubles from 1k to 16k: time should grow ~T^2 (attention) or ~T (linear), and peak
# memory ~T (issue 4's targets). The T x T references run out of memory at the long end: reported as OOM.
ATTENTION_SHAPES = [
    *((4, 16, t, 64, "bf16") for t in (1024, 2048, 4096, 8192, 16384)),
    (4, 8, 2048, 128, "bf16"),
    (4, 8, 8192, 128, "bf16"),
    (4, 16, 1024, 64, "fp32"),
    (4, 8, 2048, 128, "fp32"),
]
LINEAR_SHAPES = [
    *((4, 16, t, 64, "bf16") for t in (2048, 8192, 16384)),
    (4, 8, 8192, 128, "bf16"),
    (4, 16, 2048, 64, "fp32"),
]
POINTWISE_SHAPES = [
    *((4, 16, t, 64, "bf16") for t in (1024, 2048, 4096, 8192, 16384)),
    (4, 8, 2048, 128, "bf16"),
    (4, 16, 2048, 64, "fp32"),
    # heads wider than 256: the feature-tiled kernels (SDPA's flash backend stops at 256: mem-efficient there)
    (4, 4, 2048, 320, "bf16"),
    (4, 4, 4096, 320, "bf16"),
]
# (B, H, T, Dk, Dv, dtype)
WIDE_SHAPES = [(4, 12, 2048, 832, 64, "bf16"), (4, 12, 4096, 832, 64, "bf16"), (2, 12, 8192, 832, 64, "bf16")]
EPILOGUE_SHAPES = [((8, 2048, 4096), "bf16"), ((8, 4096, 4096), "bf16"), ((8, 2048, 4096), "fp32")]
QUICK = {
    "attention": [(8, 8, 1024, 64, "bf16")],
    "attention-wide": [(2, 12, 1024, 832, 64, "bf16")],
    "linear": [(8, 8, 1024, 64, "bf16")],
    "pointwise": [(8, 8, 1024, 64, "bf16")],
    "epilogue": [((8, 1024, 4096), "bf16")],
}
# the shapes issue 4's targets name, for a short GPU lease: softmax fwd+bwd at T = 2k and 8k, linear at 8k,
# the variants at 2k (pointwise also at 8k), each head dim the grid has
TARGETS = {
    "attention": [(4, 16, 2048, 64, "bf16"), (4, 16, 8192, 64, "bf16"), (4, 8, 8192, 128, "bf16")],
    "attention-wide": [(4, 12, 2048, 832, 64, "bf16")],
    "linear": [(4, 16, 8192, 64, "bf16"), (4, 8, 8192, 128, "bf16")],
    "pointwise": [(4, 16, 2048, 64, "bf16"), (4, 16, 8192, 64, "bf16")],
    "epilogue": [((8, 2048, 4096), "bf16")],
}
FULL = {"attention": ATTENTION_SHAPES, "attention-wide": WIDE_SHAPES, "linear": LINEAR_SHAPES,
        "pointwise": POINTWISE_SHAPES, "epilogue": EPILOGUE_SHAPES}
# tiny shapes for the interpreter: T not a multiple of the 16-wide tiles, n not one of the 256-element blocks
SMOKE = {
    "attention": [(1, 2, 40, 16, "fp32")],
    "attention-wide": [(1, 2, 21, 40, 24, "fp32")],  # several 16-wide feature tiles under the interpreter
    "linear": [(1, 2, 40, 16, "fp32")],
    "pointwise": [(1, 2, 40, 16, "fp32")],
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


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}[name]


def generator(device: str) -> torch.Generator:
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
            gen = generator(device)
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
            gen = generator(device)
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
            gen = generator(device)
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


def _pointwise_cases(shapes: list[tuple], *, cuda: bool) -> list[Case]:
    """Sigmoid attention (`pointwise.SIGMOID`) with the row bias b = -log T of Ramapuram et al. (2024), without and
    with ALiBi slopes (their recommended form). No
    library op in this environment computes it: the peer is `torch.compile` of the T x T reference (what the
    torch backend's einsum does), and plain causal softmax attention of the same shape (SDPA) runs beside it
    for issue 4's "at most 1.3x plain attention"."""
    import math

    import torch

    from energydsl.kernels.pointwise import sigmoid_attention
    from energydsl.kernels.pointwise_ref import pointwise_attention_ref

    def biases(x: dict[str, Any]) -> dict[str, Any]:
        return {k: x[k] for k in ("row_bias", "alibi_slopes") if k in x}

    def kernel(x: dict[str, Any]) -> Tensor:
        return sigmoid_attention(x["q"], x["k"], x["v"], scale=x["scale"], **biases(x))

    def reference(x: dict[str, Any]) -> Tensor:
        return pointwise_attention_ref(x["q"], x["k"], x["v"], torch.sigmoid, scale=x["scale"], **biases(x))

    compiled = torch.compile(reference, dynamic=False) if cuda else reference

    def inputs(alibi: bool, B: int, H: int, T: int, D: int) -> Callable[[Any, str], dict[str, Any]]:
        def make(dtype: torch.dtype, device: str) -> dict[str, Any]:
            gen = generator(device)
            x: dict[str, Any] = {k: _randn((B, H, T, D), gen, dtype, device) for k in ("q", "k", "v")}
            x["scale"] = D**-0.5
            x["row_bias"] = torch.full((B, H, T), -math.log(T), device=device)  # constants, fp32
            if alibi:
                x["alibi_slopes"] = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], device=device)
            return x

        return make

    cases = []
    for B, H, T, D, dt in shapes:
        flash_ok = dt in ("bf16", "fp16") and D <= 256
        # another function (softmax weights): its time is the point, its rel err is not
        plain = Impl(f"sdpa[{'flash' if flash_ok else 'mem-efficient'}] (softmax: time only)", "peer",
                     _sdpa("FLASH_ATTENTION" if flash_ok else "EFFICIENT_ATTENTION", with_mask=False), gpu_only=True)
        impls = [
            Impl("triton", "kernel", kernel),
            Impl("torch ref (T x T)", "reference", reference),
            Impl("torch.compile(ref)", "peer", compiled, gpu_only=True),
            plain,
        ]
        for alibi in (False, True):
            cases.append(Case("pointwise", "sigmoid+alibi" if alibi else "sigmoid", {"B": B, "H": H, "T": T, "d": D},
                              dt, inputs(alibi, B, H, T, D), impls, uses_compile=True))
    return cases


def _epilogue_cases(shapes: list[tuple], *, cuda: bool) -> list[Case]:
    import torch

    from energydsl.kernels import epilogue as E
    from energydsl.kernels.epilogue_ref import gated_activation_ref, momentum_update_ref, nesterov_lookahead_ref

    def gated(act: str) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
        """value * act(gate), or act(gate) alone where the inputs have no value."""
        def ref(g: Tensor, v: Tensor | None) -> Tensor:
            return gated_activation_ref(g, v, act)

        compiled = torch.compile(ref, dynamic=False)
        return (
            lambda x: E.gated_activation(x["gate"], x.get("value"), act),
            lambda x: ref(x["gate"], x.get("value")),
            lambda x: compiled(x["gate"], x.get("value")),
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
            gen = generator(device)
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
            ("gelu alone", gated("gelu"), inputs(("gate",), (), shape)),  # a gate with no value (HAS_VALUE off)
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
    if family == "pointwise":
        return _pointwise_cases(shapes, cuda=cuda), ""
    return _epilogue_cases(shapes, cuda=cuda), ""
