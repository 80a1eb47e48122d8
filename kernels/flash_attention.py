"""Causal flash attention (FlashAttention-2) in Triton: forward, and a backward that recomputes P.

Forward, per program: one ``BLOCK_M`` tile of queries against ``BLOCK_N`` tiles of keys/values, an
online softmax with running max ``m`` and sum ``l`` in fp32 (base-2 exponentials with ``log2(e)`` folded
into the scale), and the logsumexp ``L = m + log(l)`` saved instead of P. Backward:

1. ``_bwd_preprocess``: ``D = rowsum(dO * O)`` per query;
2. ``_bwd_dkdv_kernel``: one key tile per program, looping over the query tiles that see it:
   ``P = exp(S - L)``, ``dV += Pᵀ dO``, ``dP = dO Vᵀ``, ``dS = P * (dP - D)``, ``dK += dSᵀ Q``;
3. ``_bwd_dq_kernel``: one query tile per program, looping over key tiles: ``dQ += dS K``.

Every gradient element is written by exactly one program: deterministic, no atomics.

Causality is aligned to the bottom-right: query ``i`` sees key ``j`` when ``j <= i + n_k - n_q`` (the
usual ``j <= i`` for ``n_q == n_k``; for a few queries against a long KV cache, the queries are the last
positions). Key tiles no query of a tile can see are never visited; tiles every query sees fully run
without index comparisons; only the diagonal tiles build a mask. A query with no visible key outputs zeros.

Inputs are ``[..., seq, d]`` viewed as ``[batch, heads, seq, d]`` with separate batch/head strides, so the
head-split view of a ``[batch, seq, heads*d]`` projection needs no copy. Head dims are padded to the next
power of two (≥ 16) with masked loads.

Tile sizes and warps (:func:`_fwd_config`, :func:`_bwd_config`) are a table by head dim and dtype,
chosen so the sm_90/sm_80 builds use tensor cores without spilling (``tritonlm kernels --report``
prints the evidence); causal query tiles are scheduled longest-first (the last query tiles see the most
keys) so the tail of the grid is short tiles. A tuned table measured on a GPU (``kernels/tuned``) may replace
them per GPU, dtype and head dim.

Variants, chosen explicitly: ``deterministic=False`` adds dQ with fp32 atomics inside the dK/dV kernel (no dQ
kernel: 5 matmuls per tile pair instead of 7); ``_fwd_kernel_tma`` and ``_bwd_*_kernel_tma``, the dense forward and
backward with Hopper TMA descriptor loads, run only when a tuned table (or the suite's sweep) asks for them
(``"TMA": 1``).
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from . import tuned
from ._common import (
    ASSUMED_SM_COUNT,
    MAX_GRID_AXIS1,
    as_4d,
    check_device,
    check_float,
    first_order_backward,
    gpu_capability,
    grid_axis1_launches,
    next_pow2,
    on_gpu,
    sm_count,
    use_custom_op,
)
from ._ranges import kernel_range

LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------------
# tile bookkeeping shared by the forward and the dQ kernel (both walk key tiles for one query tile)
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _sequence(pid_bh, n_heads, CU_Q, CU_K, n_q, n_k, VARLEN: tl.constexpr):
    """``(b, h, q_start, n_q, k_start, n_k)`` of a (batch, head) pair. Packed sequences (``VARLEN``) read their
    token ranges from the cumulative lengths; dense batches start at row 0 with the given lengths."""
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    if VARLEN:
        q_start = tl.load(CU_Q + b).to(tl.int64)
        k_start = tl.load(CU_K + b).to(tl.int64)
        n_q = (tl.load(CU_Q + b + 1) - q_start).to(tl.int32)
        n_k = (tl.load(CU_K + b + 1) - k_start).to(tl.int32)
    else:
        q_start = b * 0
        k_start = b * 0
    return b, h, q_start, n_q, k_start, n_k


@triton.jit
def _query_tile_start(pid_m, n_q, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """First query of this program's tile. Causal grids take the last query tiles first: they see the most keys,
    so short tiles fill the tail of the schedule. Past a (packed) sequence's end the tile is empty."""
    if CAUSAL:
        return (tl.cdiv(n_q, BLOCK_M) - 1 - pid_m) * BLOCK_M
    return pid_m * BLOCK_M


@triton.jit
def _key_ranges(start_m, n_q, n_k, win_left, win_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(key_lo, full_lo, full_hi, key_hi)`` for the query tile at ``start_m``. Query ``i`` sees key ``j`` when
    ``i + shift - win_left <= j <= i + shift + win_right`` (``shift = n_k - n_q``: bottom-right alignment;
    causal is ``win_right = 0``). Tiles in ``[full_lo, full_hi)`` are whole and seen by every query of the tile
    (no mask); ``[key_lo, full_lo)`` and ``[full_hi, key_hi)`` need one; nothing outside is visited."""
    shift = n_k - n_q
    key_lo = tl.maximum(start_m + shift - win_left, 0) // BLOCK_N * BLOCK_N
    key_hi = tl.minimum(start_m + BLOCK_M + shift + win_right, n_k)
    full_lo = tl.cdiv(tl.maximum(start_m + BLOCK_M - 1 + shift - win_left, 0), BLOCK_N) * BLOCK_N
    full_hi = tl.minimum(start_m + shift + win_right + 1, n_k) // BLOCK_N * BLOCK_N
    # an empty tile (before / past the sequence) or a window that misses every key: no key tile at all
    empty = (start_m < 0) | (start_m >= n_q) | (key_hi <= key_lo)
    key_hi = tl.where(empty, key_lo, key_hi)
    full_lo = tl.minimum(tl.maximum(full_lo, key_lo), key_hi)
    full_hi = tl.maximum(tl.minimum(full_hi, key_hi), full_lo)
    return key_lo, full_lo, full_hi, key_hi


@triton.jit
def _query_ranges(start_n, n_q, n_k, win_left, win_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(q_lo, full_lo, full_hi, q_hi)``: the query tiles that see the key tile at ``start_n`` (the transpose
    of :func:`_key_ranges`; rows in ``[full_lo, full_hi)`` see the whole key tile)."""
    shift = n_k - n_q
    q_lo = tl.maximum(start_n - shift - win_right, 0) // BLOCK_M * BLOCK_M
    q_hi = tl.minimum(start_n + BLOCK_N - shift + win_left, n_q)
    full_lo = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - shift - win_right, 0), BLOCK_M) * BLOCK_M
    full_hi = tl.minimum(start_n - shift + win_left + 1, n_q) // BLOCK_M * BLOCK_M
    empty = (start_n >= n_k) | (q_hi <= q_lo)
    q_hi = tl.where(empty, q_lo, q_hi)
    full_lo = tl.minimum(tl.maximum(full_lo, q_lo), q_hi)
    full_hi = tl.maximum(tl.minimum(full_hi, q_hi), full_lo)
    return q_lo, full_lo, full_hi, q_hi


@triton.jit
def _visible(queries, keys, n_k, shift, win_left, win_right, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """``[queries, keys]`` mask (keys past ``n_k`` are never visible). Without a window (``WINDOW`` constexpr
    False) only the causal diagonal is compared: fewer registers in the common case."""
    visible = keys[None, :] < n_k
    if WINDOW:
        rel = keys[None, :] - queries[:, None] - shift
        visible = visible & (rel <= win_right) & (rel >= -win_left)
    elif CAUSAL:
        visible = visible & (keys[None, :] <= queries[:, None] + shift)
    return visible


# ----------------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _load_kv(k_tile, v_tile, keys, n_k, d_mask, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """K and V tiles; edge tiles masked to zero. A whole tile with the head dim filling BLOCK_D loads unmasked."""
    if MASKED:
        kv_mask = (keys[:, None] < n_k) & d_mask[None, :]
        return tl.load(k_tile, mask=kv_mask, other=0.0), tl.load(v_tile, mask=kv_mask, other=0.0)
    if EVEN_D:
        return tl.load(k_tile), tl.load(v_tile)
    return tl.load(k_tile, mask=d_mask[None, :], other=0.0), tl.load(v_tile, mask=d_mask[None, :], other=0.0)


@triton.jit
def _fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, d_mask,
               key_start, key_end, n_k, shift, win_left, win_right, qk_scale,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr,
               EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold key tiles ``[key_start, key_end)`` into the running (acc, m_i, l_i)."""
    # the tile's first row advances by BLOCK_N rows per step (64-bit, one row of pointers); rows within a tile are
    # loop-invariant 32-bit offsets: no 64-bit multiply per row and no 2-D pointer tensor held across steps
    # Row offsets are recomputed per tile rather than carried as pointers advanced by BLOCK_N rows: measured in
    # the SASS report, advancing them cost registers (sm_90, bf16: d 128 197 -> 245, split-KV decode 140 -> 224)
    # and spilled on sm_80 at d 128; the recomputation is a few integer ops the pipeliner hides.
    for start_n in range(key_start, key_end, BLOCK_N):
        keys = start_n + offs_n
        k, v = _load_kv(k_ptrs + keys[:, None].to(tl.int64) * stride_kn, v_ptrs + keys[:, None].to(tl.int64) * stride_vn,
                        keys, n_k, d_mask, MASKED, EVEN_D)
        # ---- scores in log2 units (the scale multiplies the fp32 scores: folding it into Q once measured worse in
        # the SASS report, sm_90 d 128: 197 -> 235 registers, as Q then feeds the wgmma from registers)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if MASKED:
            s = tl.where(_visible(offs_m, keys, n_k, shift, win_left, win_right, CAUSAL, WINDOW), s, float("-inf"))
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION=DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION: tl.constexpr):
    """Fold one tile of scores ``s`` (log2 units) and its values into the running (acc, m_i, l_i); a row that has
    seen no key keeps m = -inf, so 0 is subtracted instead."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
    n_heads, group, bh_start, n_q, n_k, d_head, qk_scale, win_left, win_right, split_size,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr, SPLIT_KV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # EVEN_D: the head dim fills BLOCK_D, so whole K/V tiles load without a mask
    # SPLIT_KV (decoding): grid axis 0 is the key split, not the query tile; the one query tile holds every query
    # and the program writes an unnormalised partial result (acc / l, and its lse) for the combine kernel
    pid_bh = tl.program_id(1) + bh_start
    b, h, q_start, n_q, k_start, n_k = _sequence(pid_bh, n_heads, CU_Q, CU_K, n_q, n_k, VARLEN)
    if SPLIT_KV:
        start_m = 0
    else:
        start_m = _query_tile_start(tl.program_id(0), n_q, CAUSAL, BLOCK_M)
    h_kv = h // group  # GQA: consecutive query heads share one key/value head
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < d_head
    if EVEN_D:  # the head dim fills the tile: an all-true constant, so every mask below is rows only
        d_mask = tl.full([BLOCK_D], 1, tl.int1)
    row_valid = (offs_m >= 0) & (offs_m < n_q)
    q_mask = row_valid[:, None] & d_mask[None, :]
    rows = (q_start + offs_m).to(tl.int64)

    # ---- load the query tile once
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None] * stride_qm + offs_d[None, :], mask=q_mask,
                other=0.0)
    k_ptrs = K + b * stride_kb + h_kv * stride_kh + k_start * stride_kn + offs_d[None, :]
    v_ptrs = V + b * stride_vb + h_kv * stride_vh + k_start * stride_vn + offs_d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # ---- key ranges: masked head, unmasked middle, masked tail (window / diagonal / ragged edge)
    shift = n_k - n_q
    key_lo, full_lo, full_hi, key_hi = _key_ranges(start_m, n_q, n_k, win_left, win_right, BLOCK_M, BLOCK_N)
    if SPLIT_KV:
        # this program's share of the keys: [split, split + split_size), split_size a multiple of BLOCK_N
        split_lo = tl.program_id(0) * split_size
        split_hi = split_lo + split_size
        key_hi = tl.maximum(tl.minimum(key_hi, split_hi), split_lo)
        key_lo = tl.minimum(tl.maximum(key_lo, split_lo), key_hi)
        full_lo = tl.minimum(tl.maximum(full_lo, key_lo), key_hi)
        full_hi = tl.maximum(tl.minimum(full_hi, key_hi), full_lo)
    if WINDOW or SPLIT_KV:  # (without a left bound, or a split start, the masked head range is empty)
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, d_mask,
                                   key_lo, full_lo, n_k, shift, win_left, win_right, qk_scale,
                                   MASKED=True, CAUSAL=CAUSAL, WINDOW=WINDOW, BLOCK_N=BLOCK_N, EVEN_D=EVEN_D, DOT_PRECISION=DOT_PRECISION)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, d_mask,
                               full_lo, full_hi, n_k, shift, win_left, win_right, qk_scale,
                               MASKED=False, CAUSAL=CAUSAL, WINDOW=WINDOW, BLOCK_N=BLOCK_N, EVEN_D=EVEN_D, DOT_PRECISION=DOT_PRECISION)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, d_mask,
                               full_hi, key_hi, n_k, shift, win_left, win_right, qk_scale,
                               MASKED=True, CAUSAL=CAUSAL, WINDOW=WINDOW, BLOCK_N=BLOCK_N, EVEN_D=EVEN_D, DOT_PRECISION=DOT_PRECISION)

    # ---- epilogue: normalise; rows without a visible key give 0 and L = -inf
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    if SPLIT_KV:
        # partials: O[split, b*h, row, d] fp32 and LSE[split, b*h, row], combined by _split_combine_kernel
        part = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)).to(tl.int64) * BLOCK_M
        tl.store(O + (part + tl.arange(0, BLOCK_M))[:, None] * BLOCK_D + offs_d[None, :], out)
        tl.store(LSE + part + tl.arange(0, BLOCK_M), lse)
    else:
        o_ptrs = O + b * stride_ob + h * stride_oh + rows[:, None] * stride_om + offs_d[None, :]
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=q_mask)
        tl.store(LSE + b * stride_lb + h * stride_lh + q_start + offs_m, lse, mask=row_valid)


@triton.jit
def _desc(T, n_batch, n_heads, n_rows, d_head, stride_b, stride_h, stride_r, ROWS: tl.constexpr,
          BLOCK_D: tl.constexpr):
    """A TMA descriptor over a ``[batch, heads, rows, d]`` tensor (strides in elements, unit last stride) whose box is
    one ``[ROWS, BLOCK_D]`` tile of one (batch, head); boxes past the tensor's edges read as zeros, stores clip."""
    return tl.make_tensor_descriptor(T, [n_batch, n_heads, n_rows, d_head], [stride_b, stride_h, stride_r, 1],
                                     [1, 1, ROWS, BLOCK_D])


@triton.jit
def _box(desc, b, h, row, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """The ``[ROWS, BLOCK_D]`` tile of (batch ``b``, head ``h``) starting at ``row``."""
    return tl.reshape(desc.load([b, h, row, 0]), (ROWS, BLOCK_D))


@triton.jit
def _dense_query_program(n_heads, group, n_q, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """``(b, h, h_kv, start_m)`` of a program over (query tile, batch x head) of a dense batch."""
    pid_bh = tl.program_id(1)
    h = pid_bh % n_heads
    return pid_bh // n_heads, h, h // group, _query_tile_start(tl.program_id(0), n_q, CAUSAL, BLOCK_M)


@triton.jit
def _fwd_kernel_tma(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
    n_batch, n_heads, n_kv_heads, group, n_q, n_k, d_head, qk_scale,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The dense forward (no window, no packing) with Hopper tensor-memory-accelerator loads: each tile is one
    ``[1, 1, rows, BLOCK_D]`` box of a 4-D ``[batch, heads, seq, d]`` descriptor. The TMA unit zero-fills rows
    and columns outside the tensor, so no load needs a mask; only the causal diagonal masks scores."""
    b, h, h_kv, start_m = _dense_query_program(n_heads, group, n_q, CAUSAL, BLOCK_M)
    # ---- descriptors over the whole tensors (shape, strides in elements, box shape)
    q_desc = _desc(Q, n_batch, n_heads, n_q, d_head, stride_qb, stride_qh, stride_qm, BLOCK_M, BLOCK_D)
    k_desc = _desc(K, n_batch, n_kv_heads, n_k, d_head, stride_kb, stride_kh, stride_kn, BLOCK_N, BLOCK_D)
    v_desc = _desc(V, n_batch, n_kv_heads, n_k, d_head, stride_vb, stride_vh, stride_vn, BLOCK_N, BLOCK_D)
    o_desc = _desc(O, n_batch, n_heads, n_q, d_head, stride_ob, stride_oh, stride_om, BLOCK_M, BLOCK_D)
    q = _box(q_desc, b, h, start_m, BLOCK_M, BLOCK_D)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    shift = n_k - n_q
    unbounded = 1 << 30
    key_lo, full_lo, full_hi, key_hi = _key_ranges(start_m, n_q, n_k, unbounded, 0 if CAUSAL else unbounded,
                                                   BLOCK_M, BLOCK_N)
    # ---- key tiles: the unmasked middle, then the masked diagonal / ragged tail (no left bound: no masked head)
    for start_n in range(full_lo, key_hi, BLOCK_N):
        k = _box(k_desc, b, h_kv, start_n, BLOCK_N, BLOCK_D)
        v = _box(v_desc, b, h_kv, start_n, BLOCK_N, BLOCK_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if start_n >= full_hi:
            keys = start_n + offs_n
            s = tl.where(_visible(offs_m, keys, n_k, shift, 0, 0, CAUSAL, False), s, float("-inf"))
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v, DOT_PRECISION=DOT_PRECISION)
    # ---- epilogue: rows without a visible key give 0 and L = -inf; the store clips rows past n_q
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_desc.store([b, h, start_m, 0], tl.reshape(out.to(O.dtype.element_ty), (1, 1, BLOCK_M, BLOCK_D)))
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    tl.store(LSE + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + offs_m, lse,
             mask=(offs_m >= 0) & (offs_m < n_q))


@triton.jit
def _split_combine_kernel(O_PART, LSE_PART, O, LSE, stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
                          n_heads, n_splits, n_bh, n_q, d_head, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """Flash-decoding combine for one (batch, head): ``L = log Σ_s exp(L_s)``, ``O = Σ_s exp(L_s - L) O_s``
    over the key splits (a split that saw no key has L_s = -inf and weight 0)."""
    pid_bh = tl.program_id(0)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for split in range(0, n_splits):
        part = (split * n_bh + pid_bh).to(tl.int64) * BLOCK_M
        lse_s = tl.load(LSE_PART + part + offs_m)
        o_s = tl.load(O_PART + (part + offs_m)[:, None] * BLOCK_D + offs_d[None, :])
        m_new = tl.maximum(m, lse_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        w = tl.exp(lse_s - m_safe)
        s = s * alpha + w
        acc = acc * alpha[:, None] + o_s * w[:, None]
        m = m_new
    empty = s == 0.0
    s_safe = tl.where(empty, 1.0, s)
    lse = tl.where(empty, float("-inf"), m + tl.log(s_safe))
    mask = (offs_m[:, None] < n_q) & (offs_d[None, :] < d_head)
    tl.store(O + b * stride_ob + h * stride_oh + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :],
             (acc / s_safe[:, None]).to(O.dtype.element_ty), mask=mask)
    tl.store(LSE + b * stride_lb + h * stride_lh + offs_m, lse, mask=offs_m < n_q)


# ----------------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _bwd_preprocess(O, DO, DELTA, CU_Q, CU_K, stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom,
                    stride_lb, stride_lh, n_heads, bh_start, n_q, d_head,
                    VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """DELTA[b, h, i] = sum_d O[i, d] * dO[i, d] (laid out like the logsumexp)."""
    pid_bh = tl.program_id(1) + bh_start
    b, h, q_start, n_q, _, _ = _sequence(pid_bh, n_heads, CU_Q, CU_K, n_q, n_q, VARLEN)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < n_q) & (offs_d[None, :] < d_head)
    rows = (q_start + offs_m)[:, None].to(tl.int64)
    o = tl.load(O + b * stride_ob + h * stride_oh + rows * stride_om + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows * stride_dom + offs_d[None, :], mask=mask,
                 other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + b * stride_lb + h * stride_lh + q_start + offs_m, delta, mask=offs_m < n_q)


@triton.jit
def _load_lse_log2(LSE_ROW, offs_m, n_q):
    """L in log2 units for rows offs_m; padding rows and rows with no visible key get +inf so that
    exp2(s - L) = 0 for them."""
    lse = tl.load(LSE_ROW + offs_m, mask=(offs_m >= 0) & (offs_m < n_q), other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    return lse * 1.4426950408889634


@triton.jit
def _bwd_dkdv_tile(dk, dv, k, v, q_ptrs, do_ptrs, stride_qm, stride_dom, LSE_ROW, DELTA_ROW, offs_n, d_mask,
                   start_m, n_q, n_k, shift, win_left, win_right, qk_scale, dq_ptrs, stride_dqm,
                   MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
                   ATOMIC_DQ: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold the query tile at ``start_m`` into this key tile's dK, dV (and, with ``ATOMIC_DQ``, add its share of
    dQ = dS K into the fp32 dQ buffer with atomics: no separate dQ kernel, 5 matmuls per tile pair, not 7)."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row_mask = (offs_m[:, None] < n_q) & d_mask[None, :]
    # ---- load a query tile, its dO, L and D (padding rows load as zero / +inf)
    q = tl.load(q_ptrs + offs_m[:, None].to(tl.int64) * stride_qm, mask=row_mask, other=0.0)
    do = tl.load(do_ptrs + offs_m[:, None].to(tl.int64) * stride_dom, mask=row_mask, other=0.0)
    lse = _load_lse_log2(LSE_ROW, offs_m, n_q)
    delta = tl.load(DELTA_ROW + offs_m, mask=offs_m < n_q, other=0.0)
    # ---- recompute Pᵀ = exp(Sᵀ - L): [BLOCK_N keys, BLOCK_M queries]
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale
    p_t = tl.math.exp2(s_t - lse[None, :])
    if MASKED:
        p_t = tl.where(tl.trans(_visible(offs_m, offs_n, n_k, shift, win_left, win_right, CAUSAL, WINDOW)), p_t, 0.0)
    # ---- dV += Pᵀ dO ; dPᵀ = V dOᵀ ; dSᵀ = Pᵀ (dPᵀ - D) ; dK += dSᵀ Q
    dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    if ATOMIC_DQ:
        # unscaled dS K: the launcher applies the softmax scale once when it converts the buffer
        dq = tl.dot(tl.trans(ds_t).to(k.dtype), k, input_precision=DOT_PRECISION)
        tl.atomic_add(dq_ptrs + offs_m[:, None].to(tl.int64) * stride_dqm, dq, mask=row_mask)
    return dk, dv


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, stride_qm, stride_dom, LSE_ROW, DELTA_ROW,
                    offs_n, d_mask, q_start, q_end, n_q, n_k, shift, win_left, win_right, qk_scale, dq_ptrs,
                    stride_dqm, MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                    BLOCK_M: tl.constexpr, ATOMIC_DQ: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold query tiles ``[q_start, q_end)`` of one query head into dK, dV."""
    for start_m in range(q_start, q_end, BLOCK_M):
        dk, dv = _bwd_dkdv_tile(dk, dv, k, v, q_ptrs, do_ptrs, stride_qm, stride_dom, LSE_ROW, DELTA_ROW, offs_n,
                                d_mask, start_m, n_q, n_k, shift, win_left, win_right, qk_scale, dq_ptrs, stride_dqm,
                                MASKED=MASKED, CAUSAL=CAUSAL, WINDOW=WINDOW, BLOCK_M=BLOCK_M, ATOMIC_DQ=ATOMIC_DQ, DOT_PRECISION=DOT_PRECISION)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, stride_lb, stride_lh,
    stride_dqb, stride_dqh, stride_dqm,
    n_kv_heads, group, bh_start, n_q, n_k, d_head, qk_scale, sm_scale, win_left, win_right,
    GQA: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ATOMIC_DQ: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # ATOMIC_DQ: DQ is an fp32 [b, h, n_q, d] buffer that every key tile adds its dS K share into
    # grid axis 1 walks (batch, kv head) pairs; the group's query heads are summed in a fixed order below
    b, h_kv, q_start, n_q, k_start, n_k = _sequence(tl.program_id(1) + bh_start, n_kv_heads, CU_Q, CU_K, n_q, n_k,
                                                    VARLEN)
    start_n = tl.program_id(0) * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < d_head
    if EVEN_D:  # the head dim fills the tile: an all-true constant, so every mask below is rows only
        d_mask = tl.full([BLOCK_D], 1, tl.int1)
    kv_mask = (offs_n[:, None] < n_k) & d_mask[None, :]
    rows_n = (k_start + offs_n)[:, None].to(tl.int64)

    # ---- this program's key/value tile stays in registers
    k = tl.load(K + b * stride_kb + h_kv * stride_kh + rows_n * stride_kn + offs_d[None, :], mask=kv_mask,
                other=0.0)
    v = tl.load(V + b * stride_vb + h_kv * stride_vh + rows_n * stride_vn + offs_d[None, :], mask=kv_mask,
                other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    shift = n_k - n_q
    q_lo, full_lo, full_hi, q_hi = _query_ranges(start_n, n_q, n_k, win_left, win_right, BLOCK_M, BLOCK_N)
    if not WINDOW:
        # no right bound below n_q: the tail is only the ragged last query tile, whose padding rows add nothing
        # (L = +inf there), so the unmasked loop takes it
        full_hi = tl.maximum(q_hi, full_lo)
    if GQA:
        # ---- the group's query heads, one flattened loop over (head, query tile) in a fixed order
        # (deterministic; nesting the pipelined tile loops inside a runtime head loop spills registers)
        tiles = tl.cdiv(q_hi - q_lo, BLOCK_M)
        for it in range(0, group * tiles):
            h = h_kv * group + it // tiles
            start_m = q_lo + (it % tiles) * BLOCK_M
            row_lse = b * stride_lb + h * stride_lh + q_start
            q_ptrs = Q + b * stride_qb + h * stride_qh + q_start * stride_qm + offs_d[None, :]
            do_ptrs = DO + b * stride_dob + h * stride_doh + q_start * stride_dom + offs_d[None, :]
            dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + q_start * stride_dqm + offs_d[None, :]
            dk, dv = _bwd_dkdv_tile(dk, dv, k, v, q_ptrs, do_ptrs, stride_qm, stride_dom, LSE + row_lse,
                                    DELTA + row_lse, offs_n, d_mask, start_m, n_q, n_k, shift, win_left, win_right,
                                    qk_scale, dq_ptrs, stride_dqm, MASKED=True, CAUSAL=CAUSAL, WINDOW=WINDOW,
                                    BLOCK_M=BLOCK_M, ATOMIC_DQ=ATOMIC_DQ, DOT_PRECISION=DOT_PRECISION)
    else:
        # ---- one query head: masked head range, unmasked middle, masked tail
        h = h_kv
        q_ptrs = Q + b * stride_qb + h * stride_qh + q_start * stride_qm + offs_d[None, :]
        do_ptrs = DO + b * stride_dob + h * stride_doh + q_start * stride_dom + offs_d[None, :]
        LSE_ROW = LSE + b * stride_lb + h * stride_lh + q_start  # this query head's row of L (and of D below)
        DELTA_ROW = DELTA + b * stride_lb + h * stride_lh + q_start
        dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + q_start * stride_dqm + offs_d[None, :]
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, stride_qm, stride_dom, LSE_ROW, DELTA_ROW,
                                 offs_n, d_mask, q_lo, full_lo, n_q, n_k, shift, win_left, win_right,
                                 qk_scale, dq_ptrs, stride_dqm, MASKED=True, CAUSAL=CAUSAL, WINDOW=WINDOW,
                                 BLOCK_M=BLOCK_M, ATOMIC_DQ=ATOMIC_DQ, DOT_PRECISION=DOT_PRECISION)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, stride_qm, stride_dom, LSE_ROW, DELTA_ROW,
                                 offs_n, d_mask, full_lo, full_hi, n_q, n_k, shift, win_left, win_right,
                                 qk_scale, dq_ptrs, stride_dqm, MASKED=False, CAUSAL=CAUSAL, WINDOW=WINDOW,
                                 BLOCK_M=BLOCK_M, ATOMIC_DQ=ATOMIC_DQ, DOT_PRECISION=DOT_PRECISION)
        if WINDOW:
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, stride_qm, stride_dom, LSE_ROW, DELTA_ROW,
                                     offs_n, d_mask, full_hi, q_hi, n_q, n_k, shift, win_left, win_right,
                                     qk_scale, dq_ptrs, stride_dqm, MASKED=True, CAUSAL=CAUSAL, WINDOW=WINDOW,
                                     BLOCK_M=BLOCK_M, ATOMIC_DQ=ATOMIC_DQ, DOT_PRECISION=DOT_PRECISION)

    # ---- store; S was scaled by sm_scale, so dK picks it up once here
    dk = dk * sm_scale
    tl.store(DK + b * stride_dkb + h_kv * stride_dkh + rows_n * stride_dkn + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b * stride_dvb + h_kv * stride_dvh + rows_n * stride_dvn + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, d_mask,
                  k_start, k_end, n_k, shift, win_left, win_right, qk_scale,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr,
                  EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold key tiles ``[k_start, k_end)`` into dQ; padding keys load as zero and add nothing."""
    for start_n in range(k_start, k_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        # ---- load a key/value tile (padding keys load as zero and contribute nothing to dQ)
        k, v = _load_kv(k_ptrs + offs_n[:, None].to(tl.int64) * stride_kn,
                        v_ptrs + offs_n[:, None].to(tl.int64) * stride_vn, offs_n, n_k, d_mask, MASKED, EVEN_D)
        # ---- P = exp(S - L), dP = dO Vᵀ, dS = P (dP - D), dQ += dS K
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        p = tl.math.exp2(s - lse[:, None])
        if MASKED:
            p = tl.where(_visible(offs_m, offs_n, n_k, shift, win_left, win_right, CAUSAL, WINDOW), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm, stride_lb, stride_lh,
    n_heads, group, bh_start, n_q, n_k, d_head, qk_scale, sm_scale, win_left, win_right,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b, h, q_start, n_q, k_start, n_k = _sequence(tl.program_id(1) + bh_start, n_heads, CU_Q, CU_K, n_q, n_k, VARLEN)
    start_m = _query_tile_start(tl.program_id(0), n_q, CAUSAL, BLOCK_M)
    h_kv = h // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < d_head
    if EVEN_D:  # the head dim fills the tile: an all-true constant, so every mask below is rows only
        d_mask = tl.full([BLOCK_D], 1, tl.int1)
    row_valid = (offs_m >= 0) & (offs_m < n_q)
    q_mask = row_valid[:, None] & d_mask[None, :]
    rows_m = (q_start + offs_m)[:, None].to(tl.int64)

    # ---- this program's query tile, dO, L and D stay in registers
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows_m * stride_qm + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows_m * stride_dom + offs_d[None, :], mask=q_mask,
                 other=0.0)
    row_lse = b * stride_lb + h * stride_lh + q_start
    lse = _load_lse_log2(LSE + row_lse, offs_m, n_q)
    delta = tl.load(DELTA + row_lse + offs_m, mask=row_valid, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_ptrs = K + b * stride_kb + h_kv * stride_kh + k_start * stride_kn + offs_d[None, :]
    v_ptrs = V + b * stride_vb + h_kv * stride_vh + k_start * stride_vn + offs_d[None, :]

    shift = n_k - n_q
    key_lo, full_lo, full_hi, key_hi = _key_ranges(start_m, n_q, n_k, win_left, win_right, BLOCK_M, BLOCK_N)
    if WINDOW:
        dq = _bwd_dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, d_mask,
                           key_lo, full_lo, n_k, shift, win_left, win_right, qk_scale, MASKED=True, CAUSAL=CAUSAL,
                           WINDOW=WINDOW, BLOCK_N=BLOCK_N, EVEN_D=EVEN_D, DOT_PRECISION=DOT_PRECISION)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, d_mask,
                       full_lo, full_hi, n_k, shift, win_left, win_right, qk_scale, MASKED=False, CAUSAL=CAUSAL,
                       WINDOW=WINDOW, BLOCK_N=BLOCK_N, EVEN_D=EVEN_D, DOT_PRECISION=DOT_PRECISION)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, d_mask,
                       full_hi, key_hi, n_k, shift, win_left, win_right, qk_scale, MASKED=True, CAUSAL=CAUSAL,
                       WINDOW=WINDOW, BLOCK_N=BLOCK_N, EVEN_D=EVEN_D, DOT_PRECISION=DOT_PRECISION)

    dq = dq * sm_scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + rows_m * stride_dqm + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=q_mask)


@triton.jit
def _bwd_dkdv_kernel_tma(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, stride_lb, stride_lh,
    n_batch, n_heads, n_kv_heads, group, n_q, n_k, d_head, qk_scale, sm_scale,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The dense dK/dV kernel with Hopper TMA descriptor loads (see :func:`_bwd_dkdv_kernel` for the math): one key
    tile per program, its group's query heads and tiles in one flattened loop. Rows past a tensor's end load as
    zeros (their L is +inf, so they add nothing) and stores clip them; only the causal diagonal masks P."""
    pid_bh = tl.program_id(1)
    b = pid_bh // n_kv_heads
    h_kv = pid_bh % n_kv_heads
    start_n = tl.program_id(0) * BLOCK_N
    q_desc = _desc(Q, n_batch, n_heads, n_q, d_head, stride_qb, stride_qh, stride_qm, BLOCK_M, BLOCK_D)
    do_desc = _desc(DO, n_batch, n_heads, n_q, d_head, stride_dob, stride_doh, stride_dom, BLOCK_M, BLOCK_D)
    k_desc = _desc(K, n_batch, n_kv_heads, n_k, d_head, stride_kb, stride_kh, stride_kn, BLOCK_N, BLOCK_D)
    v_desc = _desc(V, n_batch, n_kv_heads, n_k, d_head, stride_vb, stride_vh, stride_vn, BLOCK_N, BLOCK_D)
    dk_desc = _desc(DK, n_batch, n_kv_heads, n_k, d_head, stride_dkb, stride_dkh, stride_dkn, BLOCK_N, BLOCK_D)
    dv_desc = _desc(DV, n_batch, n_kv_heads, n_k, d_head, stride_dvb, stride_dvh, stride_dvn, BLOCK_N, BLOCK_D)
    k = _box(k_desc, b, h_kv, start_n, BLOCK_N, BLOCK_D)
    v = _box(v_desc, b, h_kv, start_n, BLOCK_N, BLOCK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    shift = n_k - n_q
    unbounded = 1 << 30
    q_lo, full_lo, full_hi, q_hi = _query_ranges(start_n, n_q, n_k, unbounded, 0 if CAUSAL else unbounded,
                                                 BLOCK_M, BLOCK_N)
    tiles = tl.cdiv(q_hi - q_lo, BLOCK_M)
    for it in range(0, group * tiles):
        h = h_kv * group + it // tiles
        start_m = q_lo + (it % tiles) * BLOCK_M
        offs_m = start_m + tl.arange(0, BLOCK_M)
        # ---- load a query tile, its dO, L and D
        q = _box(q_desc, b, h, start_m, BLOCK_M, BLOCK_D)
        do = _box(do_desc, b, h, start_m, BLOCK_M, BLOCK_D)
        row = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh
        lse = _load_lse_log2(LSE + row, offs_m, n_q)
        delta = tl.load(DELTA + row + offs_m, mask=offs_m < n_q, other=0.0)
        # ---- Pᵀ, then dV += Pᵀ dO ; dPᵀ = V dOᵀ ; dSᵀ = Pᵀ (dPᵀ - D) ; dK += dSᵀ Q
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale - lse[None, :])
        if start_m < full_lo:  # the causal diagonal (non-causal: never)
            p_t = tl.where(tl.trans(_visible(offs_m, offs_n, n_k, shift, 0, 0, CAUSAL, False)), p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        ds_t = p_t * (tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION) - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    dk_desc.store([b, h_kv, start_n, 0], tl.reshape((dk * sm_scale).to(DK.dtype.element_ty), (1, 1, BLOCK_N, BLOCK_D)))
    dv_desc.store([b, h_kv, start_n, 0], tl.reshape(dv.to(DV.dtype.element_ty), (1, 1, BLOCK_N, BLOCK_D)))


@triton.jit
def _bwd_dq_kernel_tma(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm, stride_lb, stride_lh,
    n_batch, n_heads, n_kv_heads, group, n_q, n_k, d_head, qk_scale, sm_scale,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The dense dQ kernel with TMA descriptor loads (see :func:`_bwd_dq_kernel`): key tiles past the tensor load
    as zeros and add nothing to dQ; the causal diagonal and the ragged last key tile are masked."""
    b, h, h_kv, start_m = _dense_query_program(n_heads, group, n_q, CAUSAL, BLOCK_M)
    q_desc = _desc(Q, n_batch, n_heads, n_q, d_head, stride_qb, stride_qh, stride_qm, BLOCK_M, BLOCK_D)
    do_desc = _desc(DO, n_batch, n_heads, n_q, d_head, stride_dob, stride_doh, stride_dom, BLOCK_M, BLOCK_D)
    dq_desc = _desc(DQ, n_batch, n_heads, n_q, d_head, stride_dqb, stride_dqh, stride_dqm, BLOCK_M, BLOCK_D)
    k_desc = _desc(K, n_batch, n_kv_heads, n_k, d_head, stride_kb, stride_kh, stride_kn, BLOCK_N, BLOCK_D)
    v_desc = _desc(V, n_batch, n_kv_heads, n_k, d_head, stride_vb, stride_vh, stride_vn, BLOCK_N, BLOCK_D)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _box(q_desc, b, h, start_m, BLOCK_M, BLOCK_D)
    do = _box(do_desc, b, h, start_m, BLOCK_M, BLOCK_D)
    row = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh
    lse = _load_lse_log2(LSE + row, offs_m, n_q)
    delta = tl.load(DELTA + row + offs_m, mask=(offs_m >= 0) & (offs_m < n_q), other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    shift = n_k - n_q
    unbounded = 1 << 30
    key_lo, full_lo, full_hi, key_hi = _key_ranges(start_m, n_q, n_k, unbounded, 0 if CAUSAL else unbounded,
                                                   BLOCK_M, BLOCK_N)
    for start_n in range(full_lo, key_hi, BLOCK_N):  # (no left bound: nothing before full_lo)
        k = _box(k_desc, b, h_kv, start_n, BLOCK_N, BLOCK_D)
        v = _box(v_desc, b, h_kv, start_n, BLOCK_N, BLOCK_D)
        p = tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale - lse[:, None])
        if start_n >= full_hi:
            keys = start_n + tl.arange(0, BLOCK_N)
            p = tl.where(_visible(offs_m, keys, n_k, shift, 0, 0, CAUSAL, False), p, 0.0)
        ds = p * (tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    dq_desc.store([b, h, start_m, 0], tl.reshape((dq * sm_scale).to(DQ.dtype.element_ty), (1, 1, BLOCK_M, BLOCK_D)))


# ----------------------------------------------------------------------------------------------------
# launch configuration
# ----------------------------------------------------------------------------------------------------
#: (BLOCK_M, BLOCK_N, num_warps, num_stages) for the forward, by padded head dim, 16-bit inputs.
#: 128-query tiles keep the 4-warp (d ≤ 64) / 8-warp (d = 128) warpgroups busy with wgmma on sm_90 and
#: fit sm_80's registers; d = 256 halves the tiles to stay spill-free. fp32 inputs halve BLOCK_N.
FWD_CONFIGS = {16: (128, 64, 4, 3), 32: (128, 64, 4, 3), 64: (128, 64, 4, 3), 128: (128, 64, 8, 3),
               256: (64, 32, 8, 2)}
#: fp32 under torch's "highest" matmul precision (IEEE dots, FMA units): measured spill-free at d <= 64 with
#: 64x16 tiles (sm_90 222 registers, sm_80 128). At d 128 every tile tried spills on sm_90 (16x32: 184 B, the
#: least; 32x32: 408 B; 64x32: 7 KB) and none on sm_80 -- "high" (TF32) is the fast fp32 setting there.
IEEE_FWD_CONFIGS = {16: (64, 16, 4, 2), 32: (64, 16, 4, 2), 64: (64, 16, 4, 2), 128: (16, 32, 4, 2)}
#: (BLOCK_M, BLOCK_N, num_warps, num_stages) for both backward kernels: the dK/dV kernel holds
#: K, V, dK, dV for BLOCK_N keys, the dQ kernel Q, dO, dQ for BLOCK_M queries.
#: Evidence (profiles/sass/REPORT.md, bf16, seq 4096): d 64 -> fwd 231 regs sm_90 (HGMMA) / 255 sm_80 (HMMA),
#: dK/dV 233 / 255, dQ 150 / 255, no spills; d 128 with 8 warps -> fwd 188 / 214, dK/dV 249 / 255, dQ 180 /
#: 177, no spills. d 256: 64-row wgmma tiles spill heavily in the backward (hundreds of LDL/STL), so it keeps
#: 32-row tiles, spill-free, on mma (HMMA) even on sm_90.
BWD_CONFIGS = {16: (64, 64, 4, 2), 32: (64, 64, 4, 2), 64: (64, 64, 4, 2), 128: (64, 64, 8, 2),
               256: (32, 32, 8, 1)}
#: Ampere (sm_80) overrides: at d 64 the 64x64 backward tiles need all 255 registers and spill a little
#: there (16-40 bytes of stack); 32-query tiles are spill-free (sm_90 keeps 64 rows for wgmma).
BWD_CONFIGS_SM80 = {64: (32, 64, 4, 2)}
#: The interpreter runs whole tiles as numpy ops: larger tiles are fewer, faster steps.
INTERPRETER_CONFIG = (32, 32, 4, 1)


def _block_d(d: int) -> int:
    return max(16, next_pow2(d))


_CONFIG_FIELDS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")


def _tuned(kernel: str, d: int, dtype: torch.dtype, device: torch.device, shipped: tuple) -> tuple[int, int, int, int]:
    """The shipped ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``, unless a tuned table (``kernels/tuned``, from a
    GPU run of the suite's sweep) or a sweep override has an entry for this GPU, dtype and head dim."""
    cfg = tuned.choose(kernel, f"{tuned.dtype_name(dtype)}-d{_block_d(d)}", device, dict(zip(_CONFIG_FIELDS, shipped)))
    return tuple(cfg[f] for f in _CONFIG_FIELDS)


def _tma_selected(d: int, dtype: torch.dtype, device: torch.device, kernel: str = "attention_fwd") -> bool:
    """Whether a tuned table (or the sweep) asks for the TMA variant of ``kernel`` here; never by default. Hopper
    (sm_90+) or the interpreter (which emulates descriptors) only."""
    chosen = tuned.choose(kernel, f"{tuned.dtype_name(dtype)}-d{_block_d(d)}", device, {"TMA": 0})["TMA"]
    # cuda: the device's capability; meta (the SASS report): the assumed target; cpu: the interpreter
    hopper = device.type == "cpu" or gpu_capability(device) >= 90
    return bool(chosen) and hopper


def _tma_ready(*views: torch.Tensor) -> bool:
    """TMA descriptors need 16-byte aligned base addresses and strides (the last stride 1)."""
    return all(t.data_ptr() % 16 == 0 and t.stride(-1) == 1
               and all((st * t.element_size()) % 16 == 0 for st in t.stride()[:-1]) for t in views)


_TMA_ALLOCATOR_SET = False


def _tma_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    # the kernel runs on the current CUDA device (CPU under the interpreter, which emulates descriptors)
    on_cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    return torch.empty(size, dtype=torch.int8, device="cuda" if on_cuda else "cpu")


def _set_tma_allocator(device: torch.device) -> None:
    """Descriptors made inside a kernel need a little global scratch memory, allocated through Triton's hook:
    registered once per process, not on every launch."""
    global _TMA_ALLOCATOR_SET
    if not _TMA_ALLOCATOR_SET:
        triton.set_allocator(_tma_scratch)
        _TMA_ALLOCATOR_SET = True


def _fwd_config(d: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    if not on_gpu(device):
        return _tuned("attention_fwd", d, dtype, device, INTERPRETER_CONFIG)
    block_m, block_n, warps, stages = FWD_CONFIGS[_block_d(d)]
    if dtype == torch.float32:
        if _dot_precision(dtype)["DOT_PRECISION"] == "ieee":
            # IEEE fp32 dots run on FMA units, not tensor cores: smaller tiles (SASS report rows)
            return _tuned("attention_fwd", d, dtype, device, IEEE_FWD_CONFIGS.get(_block_d(d), (16, 32, 4, 2)))
        block_n = max(16, block_n // 2)
    return _tuned("attention_fwd", d, dtype, device, (block_m, block_n, warps, stages))


def _bwd_config(d: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    if not on_gpu(device):
        return _tuned("attention_bwd", d, dtype, device, INTERPRETER_CONFIG)
    table = BWD_CONFIGS_SM80 if gpu_capability(device) < 90 else {}
    block_m, block_n, warps, stages = table.get(_block_d(d), BWD_CONFIGS[_block_d(d)])
    if dtype == torch.float32:
        block_m, block_n = max(16, block_m // 2), max(16, block_n // 2)
    return _tuned("attention_bwd", d, dtype, device, (block_m, block_n, warps, stages))


def _strides3(t: torch.Tensor, packed: bool = False):
    # packed sequences: program axis "b" indexes cu_seqlens, never memory, so its stride is 0
    return (0 if packed else t.stride(0)), t.stride(1), t.stride(2)


def _empty_4d_like(t: torch.Tensor, packed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """An output shaped and laid out like ``t`` (a head-split view stays head-split), plus its 4-D view."""
    out = torch.empty_like(t)
    view = _as_4d(out, packed)
    if view.data_ptr() != out.data_ptr():
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        view = _as_4d(out, packed)
    return out, view


def _as_4d(t: torch.Tensor, packed: bool) -> torch.Tensor:
    """``[batch, heads, seq, d]`` view: :func:`as_4d` for batches, ``[1, heads, total, d]`` for packed
    ``[total, heads, d]`` sequences (no copy unless the last dim is strided)."""
    if not packed:
        return as_4d(t)
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.transpose(0, 1).unsqueeze(0)


def _window(is_causal: bool, window: tuple[int, int], n_q: int, n_k: int) -> tuple[int, int]:
    """Kernel window bounds: -1 (unbounded) becomes a bound no query tile reaches (2**30: past any sequence plus
    any tile, still far from int32 overflow in the range arithmetic); causal caps the right side at 0."""
    unbounded = 1 << 30
    left, right = (unbounded if w < 0 else int(w) for w in window)
    return left, (min(right, 0) if is_causal else right)


def _dot_precision(dtype: torch.dtype) -> dict:
    """The ``DOT_PRECISION`` constexpr every ``tl.dot`` takes as ``input_precision`` (the compile option
    ``default_dot_input_precision`` does not reach ``tl.dot``: measured, fp32 dots compiled with it "ieee" were
    still TF32 on sm_80/sm_90). For fp32 inputs PyTorch's fp32 matmul precision decides, as for its own matmuls
    ("highest", the default: IEEE fp32; "high"/"medium": TF32 tensor cores); 16-bit dots ignore it."""
    if dtype != torch.float32:
        return {"DOT_PRECISION": "tf32"}
    return {"DOT_PRECISION": "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"}


def _has_window(is_causal: bool, window) -> bool:
    """Whether a window bounds more than causality does (then the kernels compare both window edges)."""
    left, right = window
    return left >= 0 or (right >= 0 and not is_causal)


#: Flash-decoding: at most this many queries per (batch, head), at least this many keys, before the keys are
#: split across programs whose partial results a second kernel combines by their logsumexps.
DECODE_MAX_QUERIES = 16
DECODE_MIN_KEYS = 2048
#: (BLOCK_M, BLOCK_N, num_warps, num_stages) of a split: 16-query tiles (the smallest tl.dot), and the
#: interpreter's smaller key tiles.
DECODE_CONFIG = (16, 64, 4, 3)
DECODE_INTERPRETER_CONFIG = (16, 32, 4, 1)


def _decode_splits(n_bh: int, n_q: int, n_k: int, block_n: int, device: torch.device) -> int:
    """Key splits per (batch, head): 1 (no split) unless few queries meet a long cache; then enough programs
    to put about two on every SM, never more than there are key tiles."""
    if n_q > DECODE_MAX_QUERIES or n_k < DECODE_MIN_KEYS or n_bh > MAX_GRID_AXIS1:
        return 1
    if not on_gpu(device):  # interpreter: no parallelism to win, but the path runs (a split per 2 key tiles)
        return max(1, min(8, triton.cdiv(n_k, 2 * block_n)))
    sms = sm_count(device.index or 0) if device.type == "cuda" else ASSUMED_SM_COUNT
    return max(1, min(triton.cdiv(2 * sms, n_bh), triton.cdiv(n_k, block_n)))


def flash_attention_forward(q, k, v, is_causal: bool, softmax_scale: float, window=(-1, -1),
                            cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: int = 0, max_seqlen_k: int = 0):
    """Returns ``(o, lse)``: ``o`` like ``q``; ``lse`` fp32 ``q.shape[:-1]`` for batches, ``[heads, total_q]``
    for packed sequences (``cu_seqlens_*`` given, ``q[total_q, heads, d]``)."""
    packed = cu_seqlens_q is not None
    q4, k4, v4 = (_as_4d(t, packed) for t in (q, k, v))
    b, h, n_q, d = q4.shape
    n_k, group = k4.shape[2], h // k4.shape[1]
    o, o4 = _empty_4d_like(q, packed)
    if packed:
        b, n_q, n_k = cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k
        lse = torch.empty(h, q.shape[0], dtype=torch.float32, device=q.device)
        lse_strides = (0, lse.stride(0))
    else:
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        lse_strides = (h * n_q, n_q)
    if q.numel() == 0 or b == 0:
        return o, lse
    if n_k == 0 or k.numel() == 0:
        o.zero_()
        lse.fill_(float("-inf"))
        return o, lse
    win_left, win_right = _window(is_causal, window, n_q, n_k)
    cu_q = cu_seqlens_q if packed else lse  # (unused pointer for batches)
    cu_k = cu_seqlens_k if packed else lse
    common = dict(CAUSAL=is_causal, WINDOW=_has_window(is_causal, window), VARLEN=packed, BLOCK_D=_block_d(d),
                  EVEN_D=d == _block_d(d), **_dot_precision(q.dtype))
    args = lambda o_arg, lse_arg, o_strides, l_strides: (  # noqa: E731
        q4, k4, v4, o_arg, lse_arg, cu_q, cu_k, *_strides3(q4, packed), *_strides3(k4, packed),
        *_strides3(v4, packed), *o_strides, *l_strides)
    splits = 1 if packed else _decode_splits(b * h, n_q, n_k, DECODE_CONFIG[1], q.device)
    if splits > 1:
        # ---- flash-decoding: keys split over programs, partials combined by their logsumexps
        block_m, block_n, warps, stages = DECODE_CONFIG if on_gpu(q.device) else DECODE_INTERPRETER_CONFIG
        split_size = triton.cdiv(triton.cdiv(n_k, splits), block_n) * block_n
        splits = triton.cdiv(n_k, split_size)
        o_part = torch.empty(splits, b * h, block_m, _block_d(d), dtype=torch.float32, device=q.device)
        lse_part = torch.empty(splits, b * h, block_m, dtype=torch.float32, device=q.device)
        _fwd_kernel[(splits, b * h)](
            *args(o_part, lse_part, (0, 0, 0), (0, 0)), h, group, 0, n_q, n_k, d, softmax_scale * LOG2E,
            win_left, win_right, split_size, SPLIT_KV=True, BLOCK_M=block_m, BLOCK_N=block_n, **common,
            num_warps=warps, num_stages=stages)
        _split_combine_kernel[(b * h,)](o_part, lse_part, o4, lse, *_strides3(o4), *lse_strides, h, splits, b * h,
                                        n_q, d, BLOCK_M=block_m, BLOCK_D=_block_d(d), num_warps=4)
        return o, lse
    block_m, block_n, warps, stages = _fwd_config(d, q.dtype, q.device)
    if (not packed and not common["WINDOW"] and _tma_selected(d, q.dtype, q.device) and b * h <= MAX_GRID_AXIS1
            and _tma_ready(q4, k4, v4, o4)):
        # ---- Hopper TMA variant (chosen only by a tuned table / the sweep): dense attention, descriptor loads;
        # descriptors index whole tensors, so it runs as one launch (more batch x heads keep the default kernel)
        _set_tma_allocator(q.device)
        _fwd_kernel_tma[(triton.cdiv(n_q, block_m), b * h)](
            q4, k4, v4, o4, lse, *_strides3(q4), *_strides3(k4), *_strides3(v4), *_strides3(o4), *lse_strides,
            b, h, k4.shape[1], group, n_q, n_k, d, softmax_scale * LOG2E, CAUSAL=is_causal, BLOCK_M=block_m,
            BLOCK_N=block_n, BLOCK_D=_block_d(d), num_warps=warps, num_stages=stages, **_dot_precision(q.dtype))
        return o, lse
    if (packed or common["WINDOW"]) and on_gpu(q.device) and gpu_capability(q.device) < 90 and d > 64:
        # sm_80 at d 128: the packed / windowed forward's extra range bookkeeping spills with 64-key tiles
        # (40 / 16 bytes in the SASS report); 32-key tiles are spill-free
        block_n = min(block_n, 32)
    if n_q < block_m:  # few queries (decoding against a short cache): a smaller query tile wastes less
        block_m = max(16, next_pow2(n_q))
    for bh_start, n_bh in grid_axis1_launches(b * h):
        _fwd_kernel[(triton.cdiv(n_q, block_m), n_bh)](
            *args(o4, lse, _strides3(o4, packed), lse_strides), h, group, bh_start, n_q, n_k, d,
            softmax_scale * LOG2E, win_left, win_right, 0, SPLIT_KV=False, BLOCK_M=block_m, BLOCK_N=block_n,
            **common, num_warps=warps, num_stages=stages)
    return o, lse


def flash_attention_backward(do, q, k, v, o, lse, is_causal: bool, softmax_scale: float, window=(-1, -1),
                             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: int = 0, max_seqlen_k: int = 0,
                             deterministic: bool = True):
    """Returns ``(dq, dk, dv)`` laid out like q, k, v. ``deterministic=False`` accumulates dQ with fp32 atomics
    inside the dK/dV kernel instead of running the dQ kernel (fewer matmuls; summation order varies by run)."""
    packed = cu_seqlens_q is not None
    q4, k4, v4, o4, do4 = (_as_4d(t, packed) for t in (q, k, v, o, do))
    b, h, n_q, d = q4.shape
    n_k, h_kv = k4.shape[2], k4.shape[1]
    group = h // h_kv
    dq, dq4 = _empty_4d_like(q, packed)
    dk, dk4 = _empty_4d_like(k, packed)
    dv, dv4 = _empty_4d_like(v, packed)
    if packed:
        b, n_q, n_k = cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k
        lse_strides = (0, lse.stride(0))
    else:
        lse_strides = (h * n_q, n_q)
    if q.numel() == 0 or k.numel() == 0 or b == 0 or n_k == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    if packed:
        dk.zero_()  # keys of empty or unseen packed sequences get no program that writes them
        dv.zero_()
    win_left, win_right = _window(is_causal, window, n_q, n_k)
    cu_q = cu_seqlens_q if packed else lse
    cu_k = cu_seqlens_k if packed else lse
    block_d = _block_d(d)
    delta = torch.empty_like(lse)
    pre_m = 64
    block_m, block_n, warps, stages = _bwd_config(d, q.dtype, q.device)
    tiles = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, VARLEN=packed, CAUSAL=is_causal,
                 WINDOW=_has_window(is_causal, window), num_warps=warps, num_stages=stages,
                 **_dot_precision(q.dtype))
    qk_scale = softmax_scale * LOG2E
    q_s, k_s, v_s, do_s = (_strides3(t, packed) for t in (q4, k4, v4, do4))
    for bh_start, n_bh in grid_axis1_launches(b * h):
        _bwd_preprocess[(triton.cdiv(n_q, pre_m), n_bh)](
            o4, do4, delta, cu_q, cu_k, *_strides3(o4, packed), *do_s, *lse_strides, h, bh_start, n_q, d,
            VARLEN=packed, BLOCK_M=pre_m, BLOCK_D=block_d)
    if (deterministic and not packed and not tiles["WINDOW"] and _tma_selected(d, q.dtype, q.device, "attention_bwd")
            and b * max(h, h_kv) <= MAX_GRID_AXIS1 and _tma_ready(q4, k4, v4, do4, dq4, dk4, dv4)):
        # ---- Hopper TMA variant (chosen only by a tuned table / the sweep): descriptor loads, same math
        _set_tma_allocator(q.device)
        shapes = (b, h, h_kv, group, n_q, n_k, d, qk_scale, softmax_scale)
        opts = dict(CAUSAL=is_causal, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=warps,
                    num_stages=stages, **_dot_precision(q.dtype))
        _bwd_dkdv_kernel_tma[(triton.cdiv(n_k, block_n), b * h_kv)](
            q4, k4, v4, do4, lse, delta, dk4, dv4, *q_s, *k_s, *v_s, *do_s, *_strides3(dk4), *_strides3(dv4),
            *lse_strides, *shapes, **opts)
        _bwd_dq_kernel_tma[(triton.cdiv(n_q, block_m), b * h)](
            q4, k4, v4, do4, lse, delta, dq4, *q_s, *k_s, *v_s, *do_s, *_strides3(dq4), *lse_strides, *shapes, **opts)
        return dq, dk, dv
    if not deterministic and block_d >= 128 and on_gpu(q.device):
        # the atomic variant holds a dQ tile besides dK/dV: 64-query tiles spill at d 128 (80 B on sm_90)
        block_m = min(block_m, 32)
        tiles["BLOCK_M"] = block_m
    # dK/dV: one program per (key tile, batch, kv head), summing its group of query heads (needs every D above);
    # non-deterministic variant: an fp32 dQ buffer laid out [b, h, rows, d] like q4 that the dK/dV kernel adds into
    dq_acc = torch.zeros(q4.shape, dtype=torch.float32, device=q.device) if not deterministic else dq4
    for bh_start, n_bh in grid_axis1_launches(b * h_kv):
        _bwd_dkdv_kernel[(triton.cdiv(n_k, block_n), n_bh)](
            q4, k4, v4, do4, lse, delta, dk4, dv4, dq_acc, cu_q, cu_k, *q_s, *k_s, *v_s, *do_s,
            *_strides3(dk4, packed), *_strides3(dv4, packed), *lse_strides, *_strides3(dq_acc, packed),
            h_kv, group, bh_start, n_q, n_k, d, qk_scale, softmax_scale, win_left, win_right, GQA=group > 1,
            ATOMIC_DQ=not deterministic, EVEN_D=d == block_d, **tiles)
    if not deterministic:
        dq4.copy_(dq_acc.mul_(softmax_scale))
        return dq, dk, dv
    for bh_start, n_bh in grid_axis1_launches(b * h):
        _bwd_dq_kernel[(triton.cdiv(n_q, block_m), n_bh)](
            q4, k4, v4, do4, lse, delta, dq4, cu_q, cu_k, *q_s, *k_s, *v_s, *do_s, *_strides3(dq4, packed),
            *lse_strides, h, group, bh_start, n_q, n_k, d, qk_scale, softmax_scale, win_left, win_right,
            EVEN_D=d == block_d, **tiles)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------
# custom ops (opaque to torch.compile) and the autograd Function
# ----------------------------------------------------------------------------------------------------
@torch.library.custom_op("tritonlm::flash_attention_fwd", mutates_args=())
def _fa_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, softmax_scale: float,
               window_left: int, window_right: int, cu_seqlens_q: torch.Tensor | None,
               cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int, max_seqlen_k: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_attention_forward(q, k, v, is_causal, softmax_scale, (window_left, window_right), cu_seqlens_q,
                                   cu_seqlens_k, max_seqlen_q, max_seqlen_k)


@_fa_fwd_op.register_fake
def _(q, k, v, is_causal, softmax_scale, window_left, window_right, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
      max_seqlen_k):
    packed = cu_seqlens_q is not None
    lse_shape = (q.shape[1], q.shape[0]) if packed else q.shape[:-1]
    return torch.empty_like(q), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("tritonlm::flash_attention_bwd", mutates_args=())
def _fa_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
               lse: torch.Tensor, is_causal: bool, softmax_scale: float, window_left: int, window_right: int,
               cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int,
               max_seqlen_k: int, deterministic: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return flash_attention_backward(do, q, k, v, o, lse, is_causal, softmax_scale, (window_left, window_right),
                                    cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, deterministic)


@_fa_bwd_op.register_fake
def _(do, q, k, v, o, lse, is_causal, softmax_scale, window_left, window_right, cu_seqlens_q, cu_seqlens_k,
      max_seqlen_q, max_seqlen_k, deterministic=True):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def check_attention_inputs(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Shared by both Functions: matching leading dims, head dims, dtypes and devices."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_floating_point():
            raise TypeError(f"{op}: {name} must be floating point, got {t.dtype}")
        if t.dim() < 2:
            raise ValueError(f"{op}: {name} must be [..., seq, d], got {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{op}: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{op}: q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    if q.shape[-1] != k.shape[-1] or k.shape[-1] != v.shape[-1]:
        raise ValueError(f"{op}: head dims differ: q {q.shape[-1]}, k {k.shape[-1]}, v {v.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"{op}: k has {k.shape[-2]} keys but v has {v.shape[-2]}")
    if k.shape[:-2] != v.shape[:-2]:
        raise ValueError(f"{op}: k and v leading dims differ: {tuple(k.shape[:-2])} vs {tuple(v.shape[:-2])}")
    if q.shape[:-2] != k.shape[:-2]:
        # GQA / MQA: only the head dim (-3) may differ, and q's heads must be a multiple of k's
        gqa = (q.dim() >= 3 and q.dim() == k.dim() and q.shape[:-3] == k.shape[:-3] and k.shape[-3] > 0
               and q.shape[-3] % k.shape[-3] == 0)
        if not gqa:
            raise ValueError(f"{op}: leading dims differ: q {tuple(q.shape[:-2])}, k {tuple(k.shape[:-2])}, "
                             f"v {tuple(v.shape[:-2])} (only the heads dim -3 may differ, q heads a multiple of "
                             "k/v heads)")


class FlashAttention(torch.autograd.Function):
    """Triton FlashAttention-2: ``FlashAttention.apply(q, k, v, is_causal=False, softmax_scale=None)``.

    ``q[..., n_q, d]``, ``k, v[..., n_k, d]``; k and v may have fewer heads (dim -3) than q (GQA / MQA: q heads
    a multiple of kv heads, each kv head serving consecutive query heads, never repeated in memory). Saves q, k,
    v, O and the logsumexp ``L`` (fp32, ``q.shape[:-1]``) and recomputes P from L in backward.

    Internal extras (used by :func:`flash_attn_func` / :func:`flash_attn_varlen_func`): ``window=(left, right)``
    (-1 = unbounded, flash-attn's convention) and packed sequences (``cu_seqlens_q/k`` with ``q[total, heads, d]``).
    ``deterministic=False`` (the last argument) selects the backward that adds dQ with atomics inside the dK/dV
    kernel (fewer matmuls, run-to-run summation order varies); the default keeps every gradient deterministic.
    """

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, softmax_scale=None, window=None, cu_seqlens_q=None,
                cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, deterministic=True):
        if cu_seqlens_q is None:
            check_attention_inputs("FlashAttention", q, k, v)
        check_float("FlashAttention", q)
        check_device("FlashAttention", q, k, v)
        d = q.shape[-1]
        if d > 256:
            raise ValueError(f"FlashAttention: head dim {d} > 256 is not supported")
        scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)
        window = (-1, -1) if window is None else (int(window[0]), int(window[1]))
        extra = (window[0], window[1], cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))
        with kernel_range("tritonlm::flash_attention_fwd"):
            if use_custom_op(q):
                o, lse = _fa_fwd_op(q, k, v, bool(is_causal), scale, *extra)
            else:
                o, lse = flash_attention_forward(q, k, v, bool(is_causal), scale, window, *extra[2:])
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal, ctx.scale, ctx.extra, ctx.deterministic = bool(is_causal), scale, extra, bool(deterministic)
        return o

    @staticmethod
    @first_order_backward
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        extra = ctx.extra
        with kernel_range("tritonlm::flash_attention_bwd"):
            if use_custom_op(q):
                dq, dk, dv = _fa_bwd_op(do, q, k, v, o, lse, ctx.is_causal, ctx.scale, *extra, ctx.deterministic)
            else:
                dq, dk, dv = flash_attention_backward(do, q, k, v, o, lse, ctx.is_causal, ctx.scale, extra[:2],
                                                      *extra[2:], deterministic=ctx.deterministic)
        return dq, dk, dv, None, None, None, None, None, None, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                    softmax_scale: float | None = None, *, deterministic: bool = True) -> torch.Tensor:
    """Functional entry point: ``softmax(q kᵀ · scale [+ causal mask]) v`` via :class:`FlashAttention`.
    ``deterministic=False``: the atomic-dQ backward (see :class:`FlashAttention`)."""
    return FlashAttention.apply(q, k, v, is_causal, softmax_scale, None, None, None, 0, 0, deterministic)
