"""``flash_attn_with_kvcache`` against an fp64 recomputation: dense and paged caches, ragged ``cache_seqlens``,
in-place appends (cache contents checked), RoPE in both layouts, GQA, windows, ``cache_batch_idx``, forced and
chosen key splits, the logsumexp; and its one-line errors, raised before any write."""

import math

import pytest
import torch

from tritonlm.kernels import flash_attn_with_kvcache

from helpers import DTYPE_TOLERANCES


def _rotate(x, cos, sin, positions, interleaved):
    """RoPE written out: x [batch, seq, heads, d] at positions [batch, seq]."""
    c, s = cos[positions][:, :, None, :].double(), sin[positions][:, :, None, :].double()
    x = x.double()
    if interleaved:
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * c - b * s, a * s + b * c), dim=-1)


def _reference(q, keys, values, n_keys, causal, window, scale):
    """fp64 attention of q [batch, seq_q, heads, d] against each sequence's first n_keys[b] keys [batch][n, kv, d];
    bottom-right causal and window masks; rows with no visible key give 0 and lse -inf."""
    batch, seq_q, heads, d = q.shape
    out = torch.zeros(batch, seq_q, heads, d, dtype=torch.float64)
    lse = torch.full((batch, heads, seq_q), float("-inf"), dtype=torch.float64)
    for b in range(batch):
        n = int(n_keys[b])
        k, v = keys[b][:n].double(), values[b][:n].double()
        group = heads // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[b].double(), k) * scale
        i = torch.arange(seq_q)[:, None] + (n - seq_q)
        j = torch.arange(n)[None, :]
        visible = torch.ones(seq_q, n, dtype=torch.bool)
        if causal:
            visible &= j <= i
        left, right = window
        if left >= 0:
            visible &= j >= i - left
        if right >= 0:
            visible &= j <= i + right
        s = s.masked_fill(~visible, float("-inf"))
        row_lse = torch.logsumexp(s, dim=-1)
        p = torch.where(visible, torch.exp(s - row_lse.nan_to_num(neginf=0)[..., None]), 0.0)
        out[b] = torch.einsum("hqk,khd->qhd", p, v)
        lse[b] = row_lse
    return out, lse


def _setup(batch=3, seq_q=3, new=3, heads=4, kv_heads=2, d=16, capacity=80, lengths=(37, 0, 64), paged=None,
           dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_q, heads, d, generator=gen).to(dtype)
    k = torch.randn(batch, new, kv_heads, d, generator=gen).to(dtype) if new else None
    v = torch.randn(batch, new, kv_heads, d, generator=gen).to(dtype) if new else None
    lengths = torch.tensor(lengths, dtype=torch.int32)
    if paged is None:
        k_cache = torch.randn(batch, capacity, kv_heads, d, generator=gen).to(dtype)
        v_cache = torch.randn(batch, capacity, kv_heads, d, generator=gen).to(dtype)
        table = None
    else:  # a shuffled pool: sequence b's blocks are scattered
        blocks = capacity // paged
        pool = batch * blocks + 2
        k_cache = torch.randn(pool, paged, kv_heads, d, generator=gen).to(dtype)
        v_cache = torch.randn(pool, paged, kv_heads, d, generator=gen).to(dtype)
        table = torch.randperm(pool, generator=gen)[:batch * blocks].view(batch, blocks).to(torch.int32)
    return q, k, v, k_cache, v_cache, lengths, table


def _sequence_keys(cache, b, table, batch_idx):
    """The cache rows of sequence b in position order ([positions, kv, d])."""
    if table is None:
        return cache[b if batch_idx is None else int(batch_idx[b])]
    return cache[table[b].long()].flatten(0, 1)


@pytest.mark.parametrize("dtype, tol", DTYPE_TOLERANCES)
@pytest.mark.parametrize("paged", [None, 16], ids=["dense", "paged"])
@pytest.mark.parametrize("rotary", [None, "interleaved", "half"])
def test_append_rotate_attend_vs_fp64(paged, rotary, dtype, tol):
    q, k, v, k_cache, v_cache, lengths, table = _setup(paged=paged, dtype=dtype)
    before = k_cache.clone()
    cos = sin = None
    if rotary:
        angles = torch.arange(128)[:, None] * 10000.0 ** (-torch.arange(8) / 8)
        cos, sin = torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                       cache_seqlens=lengths, block_table=table, causal=True,
                                       rotary_interleaved=rotary != "half", return_softmax_lse=True)
    positions = lengths[:, None].long() + torch.arange(3)
    k_new = _rotate(k, cos, sin, positions, rotary != "half").to(dtype) if rotary else k
    q_ref = _rotate(q, cos, sin, positions, rotary != "half").to(dtype) if rotary else q
    for b in range(3):
        keys = _sequence_keys(k_cache, b, table, None)
        n = int(lengths[b])
        # appended in place at cache_seqlens[b] + j (rotated); the positions before untouched
        torch.testing.assert_close(keys[n:n + 3], k_new[b], atol=tol["atol"] * 4, rtol=tol["rtol"] * 4)
        torch.testing.assert_close(keys[:n], _sequence_keys(before, b, table, None)[:n], atol=0, rtol=0)
    keys = [_sequence_keys(k_cache, b, table, None) for b in range(3)]
    values = [_sequence_keys(v_cache, b, table, None) for b in range(3)]
    expected, expected_lse = _reference(q_ref, keys, values, lengths + 3, True, (-1, -1), 1 / math.sqrt(16))
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, atol=tol["atol"] * 8, rtol=tol["rtol"] * 8)
    torch.testing.assert_close(lse.double(), expected_lse, atol=tol["atol"] * 8, rtol=tol["rtol"] * 8)


@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("paged", [None, 32], ids=["dense", "paged"])
def test_decoding_ragged_caches_with_splits_gqa_and_windows(num_splits, paged, monkeypatch):
    """One query per sequence against ragged caches, GQA 8 on 2, a left window, and cache_batch_idx (dense):
    num_splits 0 takes the split-KV path by the launcher's own rule (its cache-length threshold lowered here, as
    the real one is 2048 keys), 3 forces three splits, 1 none."""
    from tritonlm.kernels.attention import decode

    monkeypatch.setattr(decode, "DECODE_MIN_KEYS", 64)
    chosen = []
    real = decode._decode_splits
    monkeypatch.setattr(decode, "_decode_splits", lambda *a: chosen.append(real(*a)) or chosen[-1])
    q, _, _, k_cache, v_cache, _, table = _setup(batch=3, seq_q=1, new=0, heads=8, kv_heads=2, capacity=320,
                                                 paged=paged, seed=1)
    lengths = torch.tensor([300, 170, 222], dtype=torch.int32)
    batch_idx = None if paged else torch.tensor([2, 0, 1], dtype=torch.int32)
    for window in ((-1, -1), (100, 0)):
        out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, cache_batch_idx=batch_idx,
                                      block_table=table, causal=True, window_size=window, num_splits=num_splits)
        keys = [_sequence_keys(k_cache, b, table, batch_idx) for b in range(3)]
        values = [_sequence_keys(v_cache, b, table, batch_idx) for b in range(3)]
        expected, _ = _reference(q, keys, values, lengths, True, window, 1 / math.sqrt(16))
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    assert (chosen and chosen[-1] > 1) if num_splits == 0 else not chosen


def test_empty_caches_and_int_lengths():
    """cache_seqlens as an int; a sequence with nothing cached and nothing new gives zeros (no visible key)."""
    q, k, v, k_cache, v_cache, _, _ = _setup(lengths=(5, 5, 5))
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=5, causal=False)
    keys = [k_cache[b] for b in range(3)]
    values = [v_cache[b] for b in range(3)]
    expected, _ = _reference(q, keys, values, torch.tensor([8, 8, 8]), False, (-1, -1), 1 / math.sqrt(16))
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    q1, _, _, k_cache, v_cache, _, _ = _setup(new=0, lengths=(0, 0, 0))
    assert flash_attn_with_kvcache(q1, k_cache, v_cache, cache_seqlens=0).abs().max() == 0


def test_errors_come_before_any_write():
    q, k, v, k_cache, v_cache, lengths, table = _setup(paged=16, lengths=(37, 0, 78))
    before = k_cache.clone()
    with pytest.raises(ValueError, match="needs 81 positions but the block table holds 80"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, block_table=table)
    assert torch.equal(k_cache, before)
    with pytest.raises(ValueError, match="softcap"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table, softcap=-1.0)
    with pytest.raises(TypeError, match="cache_seqlens"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths.long(), block_table=table)
    with pytest.raises(TypeError, match="block_table"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table.long())
    with pytest.raises(ValueError, match="give both k and v"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, None, cache_seqlens=lengths, block_table=table)


@pytest.mark.parametrize("dtype, tol", DTYPE_TOLERANCES)
def test_paged_prefill_through_varlen(dtype, tol):
    """``flash_attn_varlen_func(..., block_table=...)``: packed queries against each sequence's keys in a shuffled
    pool (prefill: as many queries as keys, and a sequence with fewer queries than keys), causal, GQA."""
    from tritonlm.kernels import flash_attn_varlen_func

    q_lens, k_lens = [37, 5, 20], [37, 5, 60]
    _, _, _, k_pool, v_pool, _, table = _setup(batch=3, heads=4, kv_heads=2, capacity=64, paged=16, dtype=dtype,
                                               seed=4)
    q = torch.randn(sum(q_lens), 4, 16, generator=torch.Generator().manual_seed(5)).to(dtype)
    cu_q = torch.tensor([0, 37, 42, 62], dtype=torch.int32)
    cu_k = torch.tensor([0, 37, 42, 102], dtype=torch.int32)
    with torch.no_grad():
        out = flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, 37, 60, causal=True, block_table=table)
    for b in range(3):
        queries = q[int(cu_q[b]):int(cu_q[b + 1])][None]
        keys = [_sequence_keys(k_pool, b, table, None)]
        values = [_sequence_keys(v_pool, b, table, None)]
        expected, _ = _reference(queries, keys, values, [k_lens[b]], True, (-1, -1), 1 / math.sqrt(16))
        torch.testing.assert_close(out[int(cu_q[b]):int(cu_q[b + 1])].double(), expected[0], atol=tol["atol"] * 8,
                                   rtol=tol["rtol"] * 8)
    with pytest.raises(NotImplementedError, match="forward only"):
        flash_attn_varlen_func(q.requires_grad_(), k_pool, v_pool, cu_q, cu_k, 37, 60, block_table=table)
    with pytest.raises(ValueError, match="exceeds the block table"):
        with torch.no_grad():
            flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, 37, 65, block_table=table)


@pytest.mark.parametrize("seq_q, new, num_splits", [(3, 3, 1), (1, 0, 3), (1, 1, 0)])
def test_cache_leftpad_masks_the_padding(seq_q, new, num_splits, monkeypatch):
    """Left-padded dense caches (``cache_leftpad``): sequence b attends to cache positions [leftpad[b], its end)
    only; causal and window bounds count from its last position as without padding; appends land at
    cache_seqlens[b]. The reference attends to the unpadded keys alone; NaN padding would poison any read."""
    from tritonlm.kernels.attention import decode

    monkeypatch.setattr(decode, "DECODE_MIN_KEYS", 32)
    q, k, v, k_cache, v_cache, _, _ = _setup(seq_q=seq_q, new=new, heads=4, kv_heads=2, capacity=96, seed=4)
    lengths = torch.tensor([70, 9, 40], dtype=torch.int32)
    leftpad = torch.tensor([20, 0, 40], dtype=torch.int32)  # (a sequence entirely padding: only its new keys)
    for b in range(3):
        k_cache[b, :int(leftpad[b])] = float("nan")
        v_cache[b, :int(leftpad[b])] = float("nan")
    for window in ((-1, -1), (6, 0)):
        kc, vc = k_cache.clone(), v_cache.clone()
        out = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lengths, cache_leftpad=leftpad, causal=True,
                                      window_size=window, num_splits=num_splits)
        keys = [kc[b, int(leftpad[b]):] for b in range(3)]
        values = [vc[b, int(leftpad[b]):] for b in range(3)]
        expected, _ = _reference(q, keys, values, lengths + new - leftpad, True, window, 1 / math.sqrt(16))
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
        if new:
            for b in range(3):
                n = int(lengths[b])
                torch.testing.assert_close(kc[b, n:n + new], k[b], atol=0, rtol=0)


def test_partial_rotary_dim():
    """``rotary_dim`` < d (Phi-3's partial rotary): the first rotary_dim dims of q and the new k turn, the rest
    pass through unchanged."""
    q, k, v, k_cache, v_cache, lengths, _ = _setup(seed=5)
    angles = torch.arange(80)[:, None] * 10000.0 ** (-torch.arange(4) / 4)  # rotary_dim 8 of d 16
    cos, sin = torch.cos(angles), torch.sin(angles)
    for interleaved in (True, False):
        kc, vc = k_cache.clone(), v_cache.clone()
        out = flash_attn_with_kvcache(q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lengths,
                                      causal=True, rotary_interleaved=interleaved)
        positions = lengths[:, None].long() + torch.arange(3)
        k_new = torch.cat((_rotate(k[..., :8], cos, sin, positions, interleaved), k[..., 8:].double()), -1)
        q_ref = torch.cat((_rotate(q[..., :8], cos, sin, positions, interleaved), q[..., 8:].double()), -1)
        for b in range(3):
            n = int(lengths[b])
            torch.testing.assert_close(kc[b, n:n + 3].double(), k_new[b], atol=1e-5, rtol=1e-5)
        expected, _ = _reference(q_ref, list(kc), list(vc), lengths + 3, True, (-1, -1), 1 / math.sqrt(16))
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def test_leftpad_and_rotary_errors():
    q, k, v, k_cache, v_cache, lengths, table = _setup(paged=16)
    with pytest.raises(NotImplementedError, match="cache_leftpad with a paged cache"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table,
                                cache_leftpad=torch.zeros(3, dtype=torch.int32))
    q, k, v, k_cache, v_cache, lengths, _ = _setup()
    with pytest.raises(ValueError, match="cache_leftpad must be in"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                cache_leftpad=torch.tensor([0, 1, 0], dtype=torch.int32))  # 1 > cache_seqlens 0
    with pytest.raises(TypeError, match="cache_leftpad"):
        flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, cache_leftpad=torch.zeros(3))
    short = torch.ones(40, 8)  # fewer rotary positions than the cache's 80
    with pytest.raises(ValueError, match="seqlen_ro"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=short, rotary_sin=short, cache_seqlens=lengths)
    wide = torch.ones(80, 9)  # rotary_dim 18 > d 16
    with pytest.raises(ValueError, match="rotary_dim"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=wide, rotary_sin=wide, cache_seqlens=lengths)


@pytest.mark.parametrize("heads, kv_heads, seq_q, num_splits", [(8, 2, 1, 1), (8, 2, 1, 3), (16, 2, 6, 1),
                                                                (16, 2, 6, 2), (12, 4, 2, 0), (8, 1, 1, 0)])
def test_gqa_heads_packed_into_one_program(heads, kv_heads, seq_q, num_splits, monkeypatch):
    """Few queries with GQA: each (sequence, kv head) is one program whose query tile holds the whole group
    (group x seq_q rows: 4, 48 -- more than the interpreter's 32-row tile -- and 6), split or not, windows too;
    the forward grid's second axis is batch x kv heads, and the result equals the fp64 reference."""
    from tritonlm.kernels.attention import forward

    grids = []
    real = forward._fwd_kernel

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return real[grid]

    monkeypatch.setattr("tritonlm.kernels.attention.launch._fwd_kernel", Recorder())
    monkeypatch.setattr("tritonlm.kernels.attention.decode._fwd_kernel", Recorder())
    q, k, v, k_cache, v_cache, lengths, table = _setup(batch=3, seq_q=seq_q, new=seq_q, heads=heads,
                                                       kv_heads=kv_heads, capacity=96, paged=16, seed=6)
    for window in ((-1, -1), (9, 0)):
        kc, vc = k_cache.clone(), v_cache.clone()
        out = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lengths, block_table=table, causal=True,
                                      window_size=window, num_splits=num_splits)
        keys = [_sequence_keys(kc, b, table, None) for b in range(3)]
        values = [_sequence_keys(vc, b, table, None) for b in range(3)]
        expected, _ = _reference(q, keys, values, lengths + seq_q, True, window, 1 / math.sqrt(16))
        torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)
    assert grids and all(g[1] == 3 * kv_heads for g in grids)
