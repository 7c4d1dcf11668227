"""The torch backend's chunked linear attention against the explicit T x T form, every decay form."""

import pytest
import torch
from conftest import largest_tensor_made

from energydsl.kernels.linear_ref import linear_attention_parallel_ref
from energydsl.runtime.ops import linear_attention, softmax_attention


@pytest.mark.parametrize("decay", [None, "scalar", "head", "token"])
@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("T", [1, 13, 40])
def test_chunked_linear_attention_matches_parallel_form(decay: str | None, strict: bool, T: int) -> None:
    g = torch.Generator().manual_seed(T)
    B, H, Dk, Dv = 2, 3, 5, 4
    q, k = (torch.randn(B, H, T, Dk, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(B, H, T, Dv, generator=g, dtype=torch.float64, requires_grad=True)
    shape = {None: None, "scalar": (), "head": (H,), "token": (B, H, T)}[decay]
    ld = None if shape is None else (-torch.rand(shape, generator=g, dtype=torch.float64)).requires_grad_()
    full = None if ld is None else ld.reshape(1, -1, 1).expand(B, H, T) if ld.dim() < 3 else ld
    got = linear_attention(q, k, v, scale=0.7, log_decay=ld, strict=strict, chunk=8)  # T = 40: 5 chunks
    want = linear_attention_parallel_ref(q, k, v, scale=0.7, log_decay=full, strict=strict)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    leaves = [t for t in (q, k, v, ld) if t is not None]
    w = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad((got * w).sum(), leaves), torch.autograd.grad((want * w).sum(), leaves)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_kernel_dispatch_without_triton_uses_the_chunked_torch_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no kernel can run, `kernels.linear_attention` is the torch backend's chunked op, not the T x T one."""
    from energydsl import kernels, runtime

    monkeypatch.setattr(kernels, "kernels_take", lambda t: False)
    seen = []
    real = runtime.ops.linear_attention
    monkeypatch.setattr(runtime.ops, "linear_attention", lambda *a, **k: seen.append(1) or real(*a, **k))
    q, k, v = (torch.randn(1, 2, 9, 4) for _ in range(3))  # float32: a dtype the kernels take
    got = kernels.linear_attention(q, k, v, strict=True)
    assert seen == [1]
    torch.testing.assert_close(got, linear_attention_parallel_ref(q, k, v, strict=True))


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("biased", [False, True])
def test_softmax_attention_takes_a_negative_scale(strict: bool, biased: bool) -> None:
    """`-logsumexp(-c s)` scores (seed 004's energies, CEM's with a sign) reach the op with scale < 0; torch
    2.13's CPU scaled_dot_product_attention returns NaN on every masked row for one (found by fuzzing: the
    whole layer's output was NaN but its last token)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(6, 6, generator=g, dtype=torch.float64) if biased else None
    got = softmax_attention(q, k, v, scale=-0.3, bias=bias, strict=strict)
    allowed = torch.ones(6, 6, dtype=torch.bool).tril(-1 if strict else 0)
    scores = (-0.3 * q @ k.transpose(-1, -2) + (0 if bias is None else bias)).masked_fill(~allowed, float("-inf"))
    want = torch.nan_to_num(torch.softmax(scores, -1)) @ v  # the strict first row: no context, zero
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)



@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("key_biased", [False, True])
@pytest.mark.parametrize("scale", [0.7, -0.3, 0.0, "learned"])
@pytest.mark.parametrize("T", [1, 2, 9])
def test_softmax_attention_key_bias_and_strict_context_stay_fused(strict: bool, key_biased: bool,
                                                                   scale: float | str, T: int,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A per-key bias (one more feature) and a strict context (the causal one shifted by a token) run SDPA with
    its causal flag and no (T, T) mask, values and gradients equal to the explicit masked softmax's."""
    import torch.nn.functional as F

    masks = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **kw: masks.append(kw.get("attn_mask")) or sdpa(*a, **kw))
    g = torch.Generator().manual_seed(T)
    q, k = (torch.randn(2, 3, T, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 3, T, 5, generator=g, dtype=torch.float64, requires_grad=True)
    kb = torch.randn(2, 3, T, generator=g, dtype=torch.float64, requires_grad=True) if key_biased else None
    c = torch.tensor(0.4, dtype=torch.float64, requires_grad=True) if scale == "learned" else scale
    got = softmax_attention(q, k, v, scale=c, key_bias=kb, strict=strict)
    if scale != 0.0:  # a zero scale takes the mask path (torch 2.13's CPU flash kernel gives NaN for it)
        assert masks in ([], [None]), masks
    allowed = torch.ones(T, T, dtype=torch.bool).tril(-1 if strict else 0)
    scores = c * q @ k.transpose(-1, -2) + (0 if kb is None else kb[..., None, :])
    scores = scores.masked_fill(~allowed, float("-inf"))
    want = torch.nan_to_num(torch.softmax(scores, -1)) @ v
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    leaves = [t for t in (q, k, v, kb, c) if isinstance(t, torch.Tensor)]
    w = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad((got * w).sum(), leaves, materialize_grads=True),
                    torch.autograd.grad((want * w).sum(), leaves, materialize_grads=True), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_softmax_attention_hands_sdpa_a_mask_of_the_query_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bias of another dtype (float32 under bf16 autocast, say) reaches SDPA cast to the query's dtype, as the
    op always passed it (the refactor that split the mask path had dropped the cast; not a GPU-verified need)."""
    import torch.nn.functional as F

    dtypes = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **kw: dtypes.append(kw["attn_mask"].dtype) or sdpa(*a, **kw))
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    softmax_attention(q, k, v, scale=0.5, bias=torch.randn(1, 2, 5, 5, dtype=torch.float64), strict=True)
    assert dtypes == [torch.float32]


@pytest.mark.parametrize("strict", [False, True])
def test_softmax_attention_with_strided_features_stays_fused(strict: bool) -> None:
    """q, k, v whose features are not adjacent in memory (RMT's heads come out of an einsum with a stride of 2
    between features) still take a fused SDPA kernel: no tensor grows as T x T, forward or backward. The math
    fallback that SDPA takes for such views built the (B, H, T, T) weights."""
    T = 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, T, 4, 2, generator=g)[..., 0].requires_grad_() for _ in range(3))
    assert q.stride(-1) == 2
    largest = largest_tensor_made(lambda: softmax_attention(q, k, v, scale=0.5, strict=strict).sum().backward())
    assert largest < 2 * 2 * T * T // 4, largest  # a few (B, H, T, D) tensors, not B H T T
    allowed = torch.ones(T, T, dtype=torch.bool).tril(-1 if strict else 0)
    scores = (0.5 * q @ k.transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
    want = torch.nan_to_num(torch.softmax(scores, -1)) @ v
    torch.testing.assert_close(softmax_attention(q, k, v, scale=0.5, strict=strict), want, rtol=1e-5, atol=1e-6)
