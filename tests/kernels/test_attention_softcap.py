"""Attention logit softcap (Gemma 2; flash-attn 2's ``softcap``): the scaled scores ``s`` become
``softcap · tanh(s / softcap)`` before the softmax, forward and backward, through every entry point, against an
fp64 recomputation written out here (scores, cap, mask, softmax; GQA by repeating kv heads)."""

import math

import pytest
import torch

from tritonlm.kernels import flash_attention, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from tritonlm.modules import functional

from helpers import ATTENTION_TOL, assert_attention_close, flash_visibility


def _reference(q, k, v, causal, window, softcap, scale=None):
    """fp64 ``[batch, seq, heads, d]`` attention with a capped score; a query that sees no key outputs 0."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    n_q, n_k = q.shape[1], k.shape[1]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    visible = flash_visibility(n_q, n_k, causal, window)
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n_q, n_k, causal, window, heads, deterministic", [
    (37, 37, True, (-1, -1), (4, 2), True), (19, 45, False, (6, 3), (2, 2), True),
    (33, 33, True, (9, -1), (4, 1), False), (45, 20, True, (-1, -1), (2, 2), False)])
def test_flash_attn_func_softcap_vs_fp64(dtype, n_q, n_k, causal, window, heads, deterministic):
    """Scores large enough that the cap bends them (|s| up to ~10 against a cap of 5); odd lengths, GQA/MQA,
    windows, both backward variants."""
    h_q, h_kv = heads
    torch.manual_seed(0)
    q = (3 * torch.randn(2, n_q, h_q, 24)).to(dtype).requires_grad_()
    k = torch.randn(2, n_k, h_kv, 24, dtype=dtype, requires_grad=True)
    v = torch.randn(2, n_k, h_kv, 24, dtype=dtype, requires_grad=True)
    out = flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=5.0, deterministic=deterministic)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _reference(q64, k64, v64, causal, window, 5.0)
    assert_attention_close(out, ref, grads, torch.autograd.grad(ref, (q64, k64, v64), do.double()), dtype)
    # the cap changed the result: the uncapped attention is far from it
    assert (out.double() - _reference(q64, k64, v64, causal, window, 0.0)).abs().max() > 10 * ATTENTION_TOL[dtype]


def test_flash_attention_softcap_leading_dims_noncontiguous_and_scale():
    """[batch, heads, seq, d] views that are not contiguous (a transposed projection), several leading dims, an
    explicit softmax scale; the einsum reference (``functional.scaled_dot_product_attention``) agrees."""
    torch.manual_seed(1)
    base = torch.randn(3, 2, 21, 3, 16, dtype=torch.float32)  # [a, b, seq, heads, d] -> [a, b, heads, seq, d]
    q = (4 * base).transpose(2, 3).requires_grad_()
    k = torch.randn_like(base).transpose(2, 3).requires_grad_()
    v = torch.randn_like(base).transpose(2, 3).requires_grad_()
    assert not q.is_contiguous()
    out = flash_attention(q, k, v, True, 0.3, softcap=2.5)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    mask = functional.causal_mask(21, 21)
    ref = functional.scaled_dot_product_attention(q64, k64, v64, mask, scale=0.3, softcap=2.5)
    assert_attention_close(out, ref, grads, torch.autograd.grad(ref, (q64, k64, v64), do.double()), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_attn_varlen_func_softcap(dtype):
    lengths = [7, 1, 30, 0, 18]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    torch.manual_seed(2)
    q = (3 * torch.randn(sum(lengths), 4, 16)).to(dtype).requires_grad_()
    k = torch.randn(sum(lengths), 2, 16, dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lengths), 2, 16, dtype=dtype, requires_grad=True)
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True, softcap=4.0,
                                 window_size=(5, 0))
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    pieces = [_reference(q64[None, a:b], k64[None, a:b], v64[None, a:b], True, (5, 0), 4.0)[0]
              for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()) if b > a]
    ref = torch.cat(pieces)
    assert_attention_close(out, ref, grads, torch.autograd.grad(ref, (q64, k64, v64), do.double()), dtype)


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_decoding_softcap(paged):
    """One new token against ragged caches (the split-KV decoding path: long enough to split) with a cap."""
    torch.manual_seed(3)
    lengths = [2500, 300]
    batch, h_q, h_kv, d, capacity = 2, 4, 2, 16, 2560
    q = 3 * torch.randn(batch, 1, h_q, d)
    keys = torch.randn(batch, capacity, h_kv, d)
    values = torch.randn(batch, capacity, h_kv, d)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    if paged:
        page = 256
        blocks = capacity // page
        table = torch.randperm(batch * blocks, dtype=torch.int32).view(batch, blocks)
        k_cache = torch.empty(batch * blocks, page, h_kv, d)
        v_cache = torch.empty_like(k_cache)
        for b in range(batch):
            k_cache[table[b].long()] = keys[b].view(blocks, page, h_kv, d)
            v_cache[table[b].long()] = values[b].view(blocks, page, h_kv, d)
        out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, block_table=table, causal=True,
                                      softcap=6.0)
    else:
        out = flash_attn_with_kvcache(q, keys, values, cache_seqlens=seqlens, causal=True, softcap=6.0)
    for b, n in enumerate(lengths):
        ref = _reference(q[b:b + 1], keys[b:b + 1, :n], values[b:b + 1, :n], True, (-1, -1), 6.0)
        torch.testing.assert_close(out[b:b + 1].double(), ref, atol=ATTENTION_TOL[torch.float32], rtol=ATTENTION_TOL[torch.float32])


@pytest.mark.parametrize("softcap", [-1.0, float("nan"), float("inf")])
def test_bad_softcap_is_an_error(softcap):
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="softcap"):
        flash_attn_func(q, q, q, softcap=softcap)
    with pytest.raises(ValueError, match="softcap"):
        flash_attention(q, q, q, softcap=softcap)
