"""Attention whose values have a head size of their own (MLA: DeepSeek-V3's queries and keys are 192 wide = 128 +
64 rotary, its values 128): every entry point (FlashAttention, flash_attn_func, flash_attn_varlen_func,
flash_attn_with_kvcache on dense and paged caches, split-KV decoding), forward and both backwards, against an fp64
recomputation written out here; the output has V's head size and nothing is padded in memory."""

import math

import pytest
import torch

from tritonlm.kernels import (
    FlashAttention,
    FlashAttentionTorch,
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)
from tritonlm.kernels.attention.launch import MLA_BWD_CONFIGS, MLA_FWD_CONFIGS, config_key, parse_key

from helpers import assert_attention_close, flash_visibility


def _reference(q, k, v, causal=True, window=(-1, -1), softcap=0.0, scale=None):
    """fp64 ``[batch, seq, heads, d]`` attention, V of its own width; a row that sees no key gives 0."""
    q, k, v = (t.double() for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * (scale or 1 / math.sqrt(q.shape[-1]))
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    visible = flash_visibility(q.shape[1], k.shape[1], causal, window)
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def _inputs(dtype, n_q, n_k, h_q, h_kv, d_qk, d_v, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, n_q, h_q, d_qk, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(2, n_k, h_kv, d_qk, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(2, n_k, h_kv, d_v, generator=gen).to(dtype).requires_grad_()
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n_q, n_k, causal, window, heads, dims, softcap, deterministic", [
    (37, 37, True, (-1, -1), (4, 2), (24, 16), 0.0, True),    # MLA-like: d_qk = 16 + 8 rotary, d_v 16
    (19, 45, False, (6, 3), (2, 2), (40, 24), 0.0, False),    # both unpadded, a window, the atomic-dQ backward
    (33, 33, True, (9, -1), (4, 1), (16, 48), 5.0, True),     # V wider than Q/K, MQA, softcap
    (45, 20, True, (-1, -1), (2, 2), (48, 32), 0.0, True)])   # more queries than keys: rows that see no key
def test_flash_attn_func_value_head_size_vs_fp64(dtype, n_q, n_k, causal, window, heads, dims, softcap,
                                                 deterministic):
    q, k, v = _inputs(dtype, n_q, n_k, *heads, *dims)
    out = flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap, deterministic=deterministic)
    assert out.shape == (*q.shape[:-1], v.shape[-1])
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = _reference(*leaves, causal, window, softcap)
    assert_attention_close(out, ref, grads, torch.autograd.grad(ref, leaves, do.double()), dtype)


def test_leading_dims_non_contiguous_and_the_torch_twin():
    """FlashAttention over ``[..., heads, seq, d]`` with two leading dims and strided views, and the tiled PyTorch
    twin, both against fp64."""
    torch.manual_seed(2)
    q = torch.randn(2, 3, 21, 4, 24).transpose(-2, -3).requires_grad_()  # [2, 3, 4 heads, 21, 24], a view
    k = torch.randn(2, 3, 2, 21, 24, requires_grad=True)
    v = torch.randn(2, 3, 2, 21, 32)[..., ::2].requires_grad_()  # V 16 wide, last dim strided
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    flat = [t.reshape(6, *t.shape[2:]).transpose(1, 2) for t in leaves]
    ref = _reference(*flat).transpose(1, 2).reshape(2, 3, 4, 21, 16)
    want = torch.autograd.grad(ref.square().sum(), leaves)
    for attend in (lambda: FlashAttention.apply(q, k, v, True), lambda: FlashAttentionTorch.apply(q, k, v, True)):
        out = attend()
        assert out.shape == (2, 3, 4, 21, 16)
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
        for got, exp in zip(torch.autograd.grad(out.square().sum(), (q, k, v)), want):
            torch.testing.assert_close(got.double(), exp, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_each_document_alone(dtype):
    """Packed documents with V narrower than Q/K: each document's output and gradients as if it were alone."""
    lens = [7, 1, 30, 12]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = _inputs(dtype, sum(lens), sum(lens), 4, 2, 24, 16)
    q, k, v = (t.detach()[0].requires_grad_() for t in (q, k, v))  # [total, heads, d]
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    assert out.shape == (sum(lens), 4, 16)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = torch.cat([_reference(*(t[a:b][None] for t in leaves))[0] for a, b in zip(cu[:-1], cu[1:])])
    assert_attention_close(out, ref, grads, torch.autograd.grad(ref, leaves, do.double()), dtype)


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_appends_and_split_kv_decoding(paged):
    """flash_attn_with_kvcache with a V cache of its own width: new k / v written in place, one query against a
    long cache (split-KV programs and the combine), GQA; against fp64 over each sequence's keys."""
    torch.manual_seed(3)
    batch, kv_heads, heads, d_qk, d_v, capacity = 2, 2, 8, 24, 16, 2560
    lengths = torch.tensor([2400, 700], dtype=torch.int32)
    q = torch.randn(batch, 1, heads, d_qk)
    k_new, v_new = torch.randn(batch, 1, kv_heads, d_qk), torch.randn(batch, 1, kv_heads, d_v)
    keys, values = torch.randn(batch, capacity, kv_heads, d_qk), torch.randn(batch, capacity, kv_heads, d_v)
    if paged:
        page = 256
        blocks = capacity // page
        perm = torch.randperm(batch * blocks)
        table = perm.view(batch, blocks).to(torch.int32)
        k_cache = torch.empty(batch * blocks, page, kv_heads, d_qk)
        v_cache = torch.empty(batch * blocks, page, kv_heads, d_v)
        k_cache[table.long().flatten()] = keys.view(batch * blocks, page, kv_heads, d_qk)
        v_cache[table.long().flatten()] = values.view(batch * blocks, page, kv_heads, d_v)
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, block_table=table,
                                      causal=True)
    else:
        k_cache, v_cache = keys.clone(), values.clone()
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths, causal=True)
    assert out.shape == (batch, 1, heads, d_v)
    for i, n in enumerate(lengths.tolist()):
        k_seq = torch.cat([keys[i, :n], k_new[i]])[None]
        v_seq = torch.cat([values[i, :n], v_new[i]])[None]
        torch.testing.assert_close(out[i:i + 1].double(), _reference(q[i:i + 1], k_seq, v_seq), atol=1e-5,
                                   rtol=1e-5)


def test_deepseek_shapes_key_their_own_tiles_and_bad_inputs_are_refused():
    """d_qk 192 / d_v 128 is a key of its own (tile tables keyed by both head sizes); q/k head sizes that differ
    and V wider than 256 are one-line errors."""
    key = config_key(192, torch.bfloat16, ("gqa",), d_v=128)
    assert key == "bf16-d256v128-gqa" and parse_key(key) == (256, ("gqa",), 128)
    assert config_key(128, torch.bfloat16, d_v=128) == "bf16-d128"  # same widths: the plain key
    assert (256, 128) in MLA_FWD_CONFIGS and (256, 128) in MLA_BWD_CONFIGS
    q = torch.randn(1, 5, 2, 24)
    with pytest.raises(ValueError, match="head dims differ"):
        flash_attn_func(q, torch.randn(1, 5, 2, 16), torch.randn(1, 5, 2, 16))
    with pytest.raises(ValueError, match="up to 256"):
        flash_attn_func(q, q, torch.randn(1, 5, 2, 264))
    with pytest.raises(ValueError, match="same heads"):
        flash_attn_func(q, q, torch.randn(1, 5, 1, 16))
