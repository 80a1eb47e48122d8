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
keys) so the tail of the grid is short tiles.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..profiling import kernel_range
from ._common import (
    as_4d,
    check_device,
    check_float,
    gpu_capability,
    grid_axis1_launches,
    next_pow2,
    on_gpu,
    use_custom_op,
)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# ----------------------------------------------------------------------------------------------------
# tile bookkeeping shared by the forward and the dQ kernel (both walk key tiles for one query tile)
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _query_tile(n_q, n_heads, bh_start, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """``(start_m, b, h, pid_bh)`` of this program. Causal grids take the last query tiles first: they see
    the most keys, so the short tiles fill the tail of the schedule. Grid axis 1 walks (batch, head) pairs
    from ``bh_start`` (CUDA caps that axis at 65535 programs: more pairs take several launches)."""
    if CAUSAL:
        tile_m = tl.cdiv(n_q, BLOCK_M) - 1 - tl.program_id(0)
    else:
        tile_m = tl.program_id(0)
    pid_bh = tl.program_id(1) + bh_start
    return tile_m * BLOCK_M, (pid_bh // n_heads).to(tl.int64), (pid_bh % n_heads).to(tl.int64), pid_bh


@triton.jit
def _key_ranges(start_m, n_q, n_k, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(full_end, key_end)``: key tiles in ``[0, full_end)`` are whole and visible to every query of the
    tile (no mask); ``[full_end, key_end)`` are the diagonal / ragged tiles that need one."""
    if CAUSAL:
        shift = n_k - n_q
        # every query of the tile sees keys j <= start_m + shift; some query sees j <= start_m + BLOCK_M - 1 + shift
        full_end = tl.minimum(tl.maximum(start_m + shift + 1, 0), n_k) // BLOCK_N * BLOCK_N
        key_end = tl.minimum(tl.maximum(start_m + BLOCK_M + shift, 0), n_k)
    else:
        full_end = n_k // BLOCK_N * BLOCK_N
        key_end = n_k
    return full_end, key_end


# ----------------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n, d_mask,
               key_start, key_end, n_k, causal_shift, qk_scale,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Fold key tiles ``[key_start, key_end)`` into the running (acc, m_i, l_i)."""
    for start_n in range(key_start, key_end, BLOCK_N):
        keys = start_n + offs_n
        # ---- load K and V tiles (edge tiles masked to zero)
        if MASKED:
            kv_mask = (keys[:, None] < n_k) & d_mask[None, :]
        else:
            kv_mask = d_mask[None, :]
        k = tl.load(k_ptrs + keys[:, None].to(tl.int64) * stride_kn, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs + keys[:, None].to(tl.int64) * stride_vn, mask=kv_mask, other=0.0)
        # ---- scores in log2 units
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            visible = keys[None, :] < n_k
            if CAUSAL:
                visible = visible & (keys[None, :] <= offs_m[:, None] + causal_shift)
            s = tl.where(visible, s, float("-inf"))
        # ---- online softmax update; a row that has seen no key keeps m = -inf, so subtract 0 instead
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
    n_heads, group, bh_start, n_q, n_k, d_head, qk_scale,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    start_m, b, h, pid_bh = _query_tile(n_q, n_heads, bh_start, CAUSAL, BLOCK_M)
    h_kv = h // group  # GQA: consecutive query heads share one key/value head
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < d_head
    q_mask = (offs_m[:, None] < n_q) & d_mask[None, :]

    # ---- load the query tile once
    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    k_ptrs = K + b * stride_kb + h_kv * stride_kh + offs_d[None, :]
    v_ptrs = V + b * stride_vb + h_kv * stride_vh + offs_d[None, :]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # ---- key ranges: [0, full_end) unmasked, [full_end, key_end) masked (diagonal / ragged edge)
    causal_shift = n_k - n_q
    full_end, key_end = _key_ranges(start_m, n_q, n_k, CAUSAL, BLOCK_M, BLOCK_N)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n,
                               d_mask, 0, full_end, n_k, causal_shift, qk_scale,
                               MASKED=False, CAUSAL=CAUSAL, BLOCK_N=BLOCK_N)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, offs_n,
                               d_mask, full_end, key_end, n_k, causal_shift, qk_scale,
                               MASKED=True, CAUSAL=CAUSAL, BLOCK_N=BLOCK_N)

    # ---- epilogue: normalise; rows without a visible key give 0 and L = -inf
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    o_ptrs = O + b * stride_ob + h * stride_oh + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=q_mask)
    tl.store(LSE + pid_bh.to(tl.int64) * n_q + offs_m, lse, mask=offs_m < n_q)


# ----------------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _bwd_preprocess(O, DO, DELTA, stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom,
                    n_heads, bh_start, n_q, d_head, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """DELTA[bh, i] = sum_d O[i, d] * dO[i, d]."""
    pid_bh = tl.program_id(1) + bh_start
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < n_q) & (offs_d[None, :] < d_head)
    rows = offs_m[:, None].to(tl.int64)
    o = tl.load(O + b * stride_ob + h * stride_oh + rows * stride_om + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows * stride_dom + offs_d[None, :], mask=mask,
                 other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + pid_bh.to(tl.int64) * n_q + offs_m, delta, mask=offs_m < n_q)


@triton.jit
def _load_lse_log2(LSE_ROW, offs_m, n_q):
    """L in log2 units for rows offs_m; padding rows and rows with no visible key get +inf so that
    exp2(s - L) = 0 for them."""
    lse = tl.load(LSE_ROW + offs_m, mask=offs_m < n_q, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    return lse * 1.4426950408889634


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, stride_qm, stride_dom, LSE_ROW, DELTA_ROW,
                    offs_n, offs_d, d_mask, q_start, q_end, n_q, causal_shift, qk_scale,
                    MASKED: tl.constexpr, BLOCK_M: tl.constexpr):
    for start_m in range(q_start, q_end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_mask = (offs_m[:, None] < n_q) & d_mask[None, :]
        # ---- load a query tile, its dO, L and D (padding rows load as zero / +inf)
        q = tl.load(q_ptrs + offs_m[:, None].to(tl.int64) * stride_qm, mask=row_mask, other=0.0)
        do = tl.load(do_ptrs + offs_m[:, None].to(tl.int64) * stride_dom, mask=row_mask, other=0.0)
        lse = _load_lse_log2(LSE_ROW, offs_m, n_q)
        delta = tl.load(DELTA_ROW + offs_m, mask=offs_m < n_q, other=0.0)
        # ---- recompute Pᵀ = exp(Sᵀ - L): [BLOCK_N keys, BLOCK_M queries]
        s_t = tl.dot(k, tl.trans(q)) * qk_scale
        p_t = tl.math.exp2(s_t - lse[None, :])
        if MASKED:
            p_t = tl.where(offs_n[:, None] <= offs_m[None, :] + causal_shift, p_t, 0.0)
        # ---- dV += Pᵀ dO ; dPᵀ = V dOᵀ ; dSᵀ = Pᵀ (dPᵀ - D) ; dK += dSᵀ Q
        dv += tl.dot(p_t.to(do.dtype), do)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    n_kv_heads, group, bh_start, n_q, n_k, d_head, qk_scale, sm_scale,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # grid axis 1 walks (batch, kv head) pairs; the group's query heads are summed in a fixed order below
    pid_bkv = tl.program_id(1) + bh_start
    b = (pid_bkv // n_kv_heads).to(tl.int64)
    h_kv = (pid_bkv % n_kv_heads).to(tl.int64)
    start_n = tl.program_id(0) * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < d_head
    kv_mask = (offs_n[:, None] < n_k) & d_mask[None, :]
    rows_n = offs_n[:, None].to(tl.int64)

    # ---- this program's key/value tile stays in registers
    k = tl.load(K + b * stride_kb + h_kv * stride_kh + rows_n * stride_kn + offs_d[None, :], mask=kv_mask,
                other=0.0)
    v = tl.load(V + b * stride_vb + h_kv * stride_vh + rows_n * stride_vn + offs_d[None, :], mask=kv_mask,
                other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    causal_shift = n_k - n_q
    if CAUSAL:
        # query i sees key j when i >= j - shift: the first query seeing this tile is start_n - shift;
        # from start_n + BLOCK_N - 1 - shift on, queries see the whole tile (no mask needed)
        q_lo = tl.maximum(start_n - causal_shift, 0) // BLOCK_M * BLOCK_M
        q_full = tl.minimum(tl.maximum(start_n + BLOCK_N - 1 - causal_shift, 0), n_q)
        q_full = tl.minimum(tl.cdiv(q_full, BLOCK_M) * BLOCK_M, tl.cdiv(n_q, BLOCK_M) * BLOCK_M)
        q_lo = tl.minimum(q_lo, q_full)
    else:
        q_lo = 0
        q_full = 0
    # ---- every query head of this kv head's group adds into the same dK, dV (sequential: deterministic)
    for g in range(0, group):
        h = h_kv * group + g
        q_ptrs = Q + b * stride_qb + h * stride_qh + offs_d[None, :]
        do_ptrs = DO + b * stride_dob + h * stride_doh + offs_d[None, :]
        row_bh = (b * n_kv_heads * group + h) * n_q  # this query head's row of L and D
        if CAUSAL:
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, stride_qm, stride_dom, LSE + row_bh,
                                     DELTA + row_bh, offs_n, offs_d, d_mask, q_lo, q_full, n_q, causal_shift,
                                     qk_scale, MASKED=True, BLOCK_M=BLOCK_M)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, stride_qm, stride_dom, LSE + row_bh, DELTA + row_bh,
                                 offs_n, offs_d, d_mask, q_full, n_q, n_q, causal_shift, qk_scale,
                                 MASKED=False, BLOCK_M=BLOCK_M)

    # ---- store; S was scaled by sm_scale, so dK picks it up once here
    dk = dk * sm_scale
    tl.store(DK + b * stride_dkb + h_kv * stride_dkh + rows_n * stride_dkn + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b * stride_dvb + h_kv * stride_dvh + rows_n * stride_dvn + offs_d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, d_mask,
                  k_start, k_end, n_k, causal_shift, qk_scale,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Fold key tiles ``[k_start, k_end)`` into dQ; padding keys load as zero and add nothing."""
    for start_n in range(k_start, k_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_mask = (offs_n[:, None] < n_k) & d_mask[None, :]
        # ---- load a key/value tile (padding keys load as zero and contribute nothing to dQ)
        k = tl.load(k_ptrs + offs_n[:, None].to(tl.int64) * stride_kn, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs + offs_n[:, None].to(tl.int64) * stride_vn, mask=kv_mask, other=0.0)
        # ---- P = exp(S - L), dP = dO Vᵀ, dS = P (dP - D), dQ += dS K
        s = tl.dot(q, tl.trans(k)) * qk_scale
        p = tl.math.exp2(s - lse[:, None])
        if MASKED and CAUSAL:
            p = tl.where(offs_n[None, :] <= offs_m[:, None] + causal_shift, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    n_heads, group, bh_start, n_q, n_k, d_head, qk_scale, sm_scale,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    start_m, b, h, pid_bh = _query_tile(n_q, n_heads, bh_start, CAUSAL, BLOCK_M)
    h_kv = h // group
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < d_head
    q_mask = (offs_m[:, None] < n_q) & d_mask[None, :]
    rows_m = offs_m[:, None].to(tl.int64)

    # ---- this program's query tile, dO, L and D stay in registers
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows_m * stride_qm + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows_m * stride_dom + offs_d[None, :], mask=q_mask,
                 other=0.0)
    lse = _load_lse_log2(LSE + pid_bh.to(tl.int64) * n_q, offs_m, n_q)
    delta = tl.load(DELTA + pid_bh.to(tl.int64) * n_q + offs_m, mask=offs_m < n_q, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_ptrs = K + b * stride_kb + h_kv * stride_kh + offs_d[None, :]
    v_ptrs = V + b * stride_vb + h_kv * stride_vh + offs_d[None, :]

    causal_shift = n_k - n_q
    full_end, key_end = _key_ranges(start_m, n_q, n_k, CAUSAL, BLOCK_M, BLOCK_N)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, d_mask,
                       0, full_end, n_k, causal_shift, qk_scale, MASKED=False, CAUSAL=CAUSAL, BLOCK_N=BLOCK_N)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, d_mask,
                       full_end, key_end, n_k, causal_shift, qk_scale, MASKED=True, CAUSAL=CAUSAL, BLOCK_N=BLOCK_N)

    dq = dq * sm_scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + rows_m * stride_dqm + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=q_mask)


# ----------------------------------------------------------------------------------------------------
# launch configuration
# ----------------------------------------------------------------------------------------------------
#: (BLOCK_M, BLOCK_N, num_warps, num_stages) for the forward, by padded head dim, 16-bit inputs.
#: 128-query tiles keep the 4-warp (d ≤ 64) / 8-warp (d = 128) warpgroups busy with wgmma on sm_90 and
#: fit sm_80's registers; d = 256 halves the tiles to stay spill-free. fp32 inputs halve BLOCK_N.
FWD_CONFIGS = {16: (128, 64, 4, 3), 32: (128, 64, 4, 3), 64: (128, 64, 4, 3), 128: (128, 64, 8, 3),
               256: (64, 32, 8, 2)}
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


def _fwd_config(d: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    if not on_gpu(device):
        return INTERPRETER_CONFIG
    block_m, block_n, warps, stages = FWD_CONFIGS[_block_d(d)]
    if dtype == torch.float32:
        block_n = max(16, block_n // 2)
    return block_m, block_n, warps, stages


def _bwd_config(d: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int, int, int]:
    if not on_gpu(device):
        return INTERPRETER_CONFIG
    table = BWD_CONFIGS_SM80 if gpu_capability(device) < 90 else {}
    block_m, block_n, warps, stages = table.get(_block_d(d), BWD_CONFIGS[_block_d(d)])
    if dtype == torch.float32:
        block_m, block_n = max(16, block_m // 2), max(16, block_n // 2)
    return block_m, block_n, warps, stages


def _strides3(t: torch.Tensor):
    return t.stride(0), t.stride(1), t.stride(2)


def _empty_4d_like(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An output shaped and laid out like ``t`` (a head-split view stays head-split), plus its 4-D view."""
    out = torch.empty_like(t)
    view = as_4d(out)
    if view.data_ptr() != out.data_ptr():
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        view = as_4d(out)
    return out, view


def flash_attention_forward(q, k, v, is_causal: bool, softmax_scale: float):
    """Returns ``(o, lse)`` with ``o`` like ``q`` and ``lse`` fp32 ``q.shape[:-1]``."""
    q4, k4, v4 = as_4d(q), as_4d(k), as_4d(v)
    b, h, n_q, d = q4.shape
    n_k, group = k4.shape[2], h // k4.shape[1]
    o, o4 = _empty_4d_like(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    if q.numel() == 0:
        return o, lse
    if n_k == 0:
        o.zero_()
        lse.fill_(float("-inf"))
        return o, lse
    block_m, block_n, warps, stages = _fwd_config(d, q.dtype, q.device)
    for bh_start, n_bh in grid_axis1_launches(b * h):
        _fwd_kernel[(triton.cdiv(n_q, block_m), n_bh)](
            q4, k4, v4, o4, lse, *_strides3(q4), *_strides3(k4), *_strides3(v4), *_strides3(o4),
            h, group, bh_start, n_q, n_k, d, softmax_scale * LOG2E,
            CAUSAL=is_causal, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_block_d(d),
            num_warps=warps, num_stages=stages)
    return o, lse


def flash_attention_backward(do, q, k, v, o, lse, is_causal: bool, softmax_scale: float):
    """Returns ``(dq, dk, dv)`` laid out like q, k, v."""
    q4, k4, v4, o4, do4 = as_4d(q), as_4d(k), as_4d(v), as_4d(o), as_4d(do)
    b, h, n_q, d = q4.shape
    n_k, h_kv = k4.shape[2], k4.shape[1]
    group = h // h_kv
    dq, dq4 = _empty_4d_like(q)
    dk, dk4 = _empty_4d_like(k)
    dv, dv4 = _empty_4d_like(v)
    if q.numel() == 0 or n_k == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    block_d = _block_d(d)
    delta = torch.empty((b * h, n_q), dtype=torch.float32, device=q.device)
    pre_m = 64
    block_m, block_n, warps, stages = _bwd_config(d, q.dtype, q.device)
    common = dict(CAUSAL=is_causal, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
                  num_warps=warps, num_stages=stages)
    qk_scale = softmax_scale * LOG2E
    for bh_start, n_bh in grid_axis1_launches(b * h):
        _bwd_preprocess[(triton.cdiv(n_q, pre_m), n_bh)](
            o4, do4, delta, *_strides3(o4), *_strides3(do4), h, bh_start, n_q, d, BLOCK_M=pre_m, BLOCK_D=block_d)
    # dK/dV: one program per (key tile, batch, kv head), summing its group of query heads (needs every D above)
    for bh_start, n_bh in grid_axis1_launches(b * h_kv):
        _bwd_dkdv_kernel[(triton.cdiv(n_k, block_n), n_bh)](
            q4, k4, v4, do4, lse, delta, dk4, dv4,
            *_strides3(q4), *_strides3(k4), *_strides3(v4), *_strides3(do4), *_strides3(dk4), *_strides3(dv4),
            h_kv, group, bh_start, n_q, n_k, d, qk_scale, softmax_scale, **common)
    for bh_start, n_bh in grid_axis1_launches(b * h):
        _bwd_dq_kernel[(triton.cdiv(n_q, block_m), n_bh)](
            q4, k4, v4, do4, lse, delta, dq4,
            *_strides3(q4), *_strides3(k4), *_strides3(v4), *_strides3(do4), *_strides3(dq4),
            h, group, bh_start, n_q, n_k, d, qk_scale, softmax_scale, **common)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------
# custom ops (opaque to torch.compile) and the autograd Function
# ----------------------------------------------------------------------------------------------------
@torch.library.custom_op("tritonlm::flash_attention_fwd", mutates_args=())
def _fa_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
               softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_attention_forward(q, k, v, is_causal, softmax_scale)


@_fa_fwd_op.register_fake
def _(q, k, v, is_causal, softmax_scale):
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("tritonlm::flash_attention_bwd", mutates_args=())
def _fa_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
               lse: torch.Tensor, is_causal: bool, softmax_scale: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return flash_attention_backward(do, q, k, v, o, lse, is_causal, softmax_scale)


@_fa_bwd_op.register_fake
def _(do, q, k, v, o, lse, is_causal, softmax_scale):
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

    ``q[..., n_q, d]``, ``k, v[..., n_k, d]``; saves q, k, v, O and the logsumexp ``L`` (fp32,
    ``q.shape[:-1]``) and recomputes P from L in backward.
    """

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, softmax_scale=None):
        check_attention_inputs("FlashAttention", q, k, v)
        check_float("FlashAttention", q)
        check_device("FlashAttention", q, k, v)
        d = q.shape[-1]
        if d > 256:
            raise ValueError(f"FlashAttention: head dim {d} > 256 is not supported")
        scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)
        fwd = _fa_fwd_op if use_custom_op(q) else flash_attention_forward
        with kernel_range("tritonlm::flash_attention_fwd"):
            o, lse = fwd(q, k, v, bool(is_causal), scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal, ctx.scale = bool(is_causal), scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        bwd = _fa_bwd_op if use_custom_op(q) else flash_attention_backward
        with kernel_range("tritonlm::flash_attention_bwd"):
            dq, dk, dv = bwd(do, q, k, v, o, lse, ctx.is_causal, ctx.scale)
        return dq, dk, dv, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                    softmax_scale: float | None = None) -> torch.Tensor:
    """Functional entry point: ``softmax(q kᵀ · scale [+ causal mask]) v`` via :class:`FlashAttention`."""
    return FlashAttention.apply(q, k, v, is_causal, softmax_scale)
