"""Attention sinks (gpt-oss): one learned logit per query head joins every row's softmax without a value,
``p_j = exp(s_j) / (exp(sink) + Σ_k exp(s_k))``, through every attention entry point (dense, GQA, windows, softcap,
varlen, dense and paged KV caches, split-KV decoding and its packed-GQA tile), forward and backward (the sinks'
gradient included), against an fp64 recomputation written out here as transformers' eager gpt-oss attention does it
(the sink as a last score column, softmax, the column dropped); the readable functional attention against the same."""

import math

import pytest
import torch

from tritonlm.kernels import FlashAttention, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from tritonlm.modules import functional

from helpers import ATTENTION_TOL, ON_CUDA, assert_attention_close, flash_visibility


def _reference(q, k, v, sinks, causal=True, window=(-1, -1), softcap=0.0):
    """fp64 ``[batch, seq, heads, d]`` attention with a sink column per head; a row that sees no key gives 0."""
    q, k, v, sinks = (t.double() for t in (q, k, v, sinks))
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~flash_visibility(q.shape[1], k.shape[1], causal, window), float("-inf"))
    column = sinks.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    p = torch.softmax(torch.cat([s, column], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def _inputs(dtype, n_q, n_k, h_q, h_kv, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = (2 * torch.randn(2, n_q, h_q, d, generator=gen)).to(dtype).requires_grad_()
    k, v = (torch.randn(2, n_k, h_kv, d, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    # sinks on the scale of the scores: some rows mostly on the sink, some barely
    sinks = (torch.randn(h_q, generator=gen) * 2).requires_grad_()
    return q, k, v, sinks


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n_q, n_k, causal, window, heads, softcap, deterministic", [
    (37, 37, True, (-1, -1), (4, 2), 0.0, True), (19, 45, False, (6, 3), (2, 2), 0.0, False),
    (33, 33, True, (9, -1), (4, 1), 5.0, True), (45, 20, True, (-1, -1), (2, 2), 0.0, False)])
def test_flash_attn_func_sinks_vs_fp64(dtype, n_q, n_k, causal, window, heads, softcap, deterministic):
    """Odd lengths, GQA / MQA, windows (some rows see no key: their output is 0, their mass all on the sink), the
    softcap, both backward variants; the sinks' gradient against fp64."""
    q, k, v, sinks = _inputs(dtype, n_q, n_k, *heads)
    out = flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap, deterministic=deterministic,
                          sinks=sinks)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sinks), do)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    ref = _reference(*leaves, causal, window, softcap)
    assert_attention_close(out, ref, grads, torch.autograd.grad(ref, leaves, do.double()), dtype)
    # the sinks changed the result
    plain = flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap)
    assert (out.double() - plain.double()).abs().max() > 2 * ATTENTION_TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n_q, n_k, causal, heads", [(37, 37, True, (4, 2)), (45, 20, True, (2, 2)),
                                                     (19, 45, False, (2, 1))])
def test_tma_forward_sinks_vs_fp64(dtype, n_q, n_k, causal, heads, monkeypatch):
    """The Hopper TMA forward (sm_90's d 128 default; here through a tuned entry, the interpreter emulating its
    descriptor loads) folds the sink in as the cp.async kernel does: rows that see no key (45 queries on 20 keys)
    put their whole mass on it; GQA / MQA; the backward and the sinks' gradient follow from its lse."""
    from tritonlm.kernels import tuned
    from tritonlm.kernels.attention import launch

    if ON_CUDA and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA descriptor loads need sm_90+")
    q, k, v, sinks = _inputs(dtype, n_q, n_k, *heads)
    launched, kernel = [], launch._fwd_kernel_tma
    monkeypatch.setattr(kernel, "run", lambda *a, _run=kernel.run, **kw: launched.append(1) or _run(*a, **kw))
    with tuned.override("attention_fwd", TMA=1):
        out = flash_attn_func(q, k, v, causal=causal, sinks=sinks)
    assert launched
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sinks), do)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    ref = _reference(*leaves, causal)
    assert_attention_close(out, ref, grads, torch.autograd.grad(ref, leaves, do.double()), dtype)


def test_sinks_gradient_is_deterministic_and_leading_dims_any():
    """The sinks' gradient is the same bits run to run (a per-head sum in a fixed order); FlashAttention takes
    ``[..., heads, seq, d]`` with several leading dims and non-contiguous views."""
    torch.manual_seed(1)
    base = torch.randn(2, 3, 21, 4, 8)
    q = base.transpose(-2, -3).requires_grad_()  # [2, 3, heads 4, seq 21, d 8], a view
    k, v = torch.randn(2, 3, 2, 21, 8, requires_grad=True), torch.randn(2, 3, 2, 21, 8, requires_grad=True)
    sinks = torch.randn(4, requires_grad=True)
    runs = []
    for _ in range(2):
        out = FlashAttention.apply(q, k, v, True, None, None, None, None, 0, 0, True, 0.0, sinks)
        runs.append(torch.autograd.grad(out.square().sum(), (q, sinks)))
    assert torch.equal(runs[0][1], runs[1][1])
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    flat = [t.reshape(6, *t.shape[2:]).transpose(1, 2) for t in leaves[:3]]
    ref = _reference(*flat, leaves[3]).transpose(1, 2).reshape(q.shape)
    want = torch.autograd.grad(ref.square().sum(), (leaves[0], leaves[3]))
    for got, exp in zip(runs[0], want):
        torch.testing.assert_close(got.double(), exp, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_sinks_vs_each_sequence_alone(dtype):
    """Packed sequences (one of length 1, one empty) with sinks: each sequence equals its own fp64 attention,
    gradients included."""
    lengths = [7, 1, 0, 13]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = sum(lengths)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(total, 4, 16, generator=gen).to(dtype).requires_grad_()
    k, v = (torch.randn(total, 2, 16, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    sinks = torch.randn(4, generator=gen).requires_grad_()
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True, sinks=sinks)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sinks), do)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    parts = [_reference(leaves[0][a:b][None], leaves[1][a:b][None], leaves[2][a:b][None], leaves[3])[0]
             for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()) if b > a]
    ref = torch.cat(parts)
    assert_attention_close(out, ref, grads, torch.autograd.grad(ref, leaves, do.double()), dtype)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("n_q, heads", [(1, (8, 2)), (3, (4, 4)), (1, (4, 1))])
def test_kvcache_decoding_with_sinks(paged, n_q, heads):
    """Decoding against a long cache (split-KV: the sink folded once, in the combine; few queries of a GQA group in
    one tile) and a paged one: each sequence equals fp64 attention over its own keys."""
    h_q, h_kv = heads
    gen = torch.Generator().manual_seed(3)
    lengths = [2500, 700]
    capacity = 2560
    q = torch.randn(2, n_q, h_q, 16, generator=gen)
    k_all, v_all = (torch.randn(2, capacity, h_kv, 16, generator=gen) for _ in range(2))
    sinks = torch.randn(h_q, generator=gen)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    if paged:
        page = 64
        blocks = capacity // page
        order = torch.randperm(2 * blocks, generator=gen)
        table = order.view(2, blocks).to(torch.int32)
        k_pool, v_pool = torch.empty(2 * blocks, page, h_kv, 16), torch.empty(2 * blocks, page, h_kv, 16)
        for b in range(2):
            for j in range(blocks):
                k_pool[table[b, j]] = k_all[b, j * page:(j + 1) * page]
                v_pool[table[b, j]] = v_all[b, j * page:(j + 1) * page]
        out = flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=seqlens, block_table=table, causal=True,
                                      sinks=sinks)
    else:
        out = flash_attn_with_kvcache(q, k_all, v_all, cache_seqlens=seqlens, causal=True, sinks=sinks)
    for b, n in enumerate(lengths):
        ref = _reference(q[b:b + 1], k_all[b:b + 1, :n], v_all[b:b + 1, :n], sinks)
        torch.testing.assert_close(out[b:b + 1].double(), ref, atol=1e-4, rtol=1e-4)
    # the logsumexp includes the sink
    _, lse = flash_attn_with_kvcache(q, k_all, v_all, cache_seqlens=seqlens, causal=True, sinks=sinks,
                                     return_softmax_lse=True)
    _, plain = flash_attn_with_kvcache(q, k_all, v_all, cache_seqlens=seqlens, causal=True, return_softmax_lse=True)
    torch.testing.assert_close(lse, torch.logaddexp(plain, sinks.view(1, -1, 1)), atol=1e-5, rtol=1e-5)


def test_functional_attention_with_sinks_is_the_eager_formula():
    """The readable spec (``functional.scaled_dot_product_attention(..., sinks=)``) against the fp64 formula."""
    q, k, v, sinks = _inputs(torch.float64, 9, 9, 3, 3)
    mask = torch.ones(9, 9, dtype=torch.bool).tril()
    got = functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask,
                                                  sinks=sinks[:, None]).transpose(1, 2)
    torch.testing.assert_close(got, _reference(q, k, v, sinks), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("bad, message", [
    (torch.zeros(3), r"sinks must be a floating-point \[heads\] tensor \(4 query heads\)"),
    (torch.zeros(4, dtype=torch.int64), "floating-point"), (torch.zeros(4, 1), "floating-point"),
])
def test_bad_sinks_are_one_line_errors(bad, message):
    q, k, v = torch.randn(1, 5, 4, 8), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8)
    with pytest.raises(ValueError, match=message):
        flash_attn_func(q, k, v, causal=True, sinks=bad)
    with pytest.raises(ValueError, match=message):
        flash_attn_with_kvcache(q, k, v, cache_seqlens=5, causal=True, sinks=bad)
