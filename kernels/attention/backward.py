"""Attention backward kernels (Triton ``@jit`` code only; launched from :mod:`.launch`).

1. ``_bwd_preprocess``: ``D = rowsum(dO * O)`` per query;
2. ``_bwd_dkdv_kernel``: one key tile per program (a GQA kv head sums its whole group of query heads), looping
   over the query tiles that see it: ``P = exp(S - L)``, ``dV += Pᵀ dO``, ``dP = dO Vᵀ``, ``dS = P * (dP - D)``,
   ``dK += dSᵀ Q``; with ``ATOMIC_DQ`` it also adds ``dS K`` into an fp32 dQ buffer (no dQ kernel);
3. ``_bwd_dq_kernel``: one query tile per program, looping over key tiles: ``dQ += dS K``.

Without ``ATOMIC_DQ`` every gradient element is written by exactly one program: deterministic, no atomics. The
``_tma`` kernels are the dense variants with Hopper TMA descriptor loads.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import (
    _box,
    _dense_query_program,
    _key_ranges,
    _load_kv,
    _query_ranges,
    _query_tile_start,
    _scores,
    _sequence,
    _visible,
)


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
def _bwd_dkdv_tile(dk, dv, k, v, q_ptrs, do_ptrs, stride_qm, stride_dom, LSE_ROW, DELTA_ROW, offs_n, d_mask, dv_mask,
                   start_m, n_q, n_k, shift, win_left, win_right, qk_scale, dq_ptrs, stride_dqm, softcap, mask_tile,
                   MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr,
                   ATOMIC_DQ: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """Fold the query tile at ``start_m`` into this key tile's dK, dV (and, with ``ATOMIC_DQ``, add its share of
    dQ = dS K into the fp32 dQ buffer with atomics: no separate dQ kernel, 5 matmuls per tile pair, not 7).
    ``MASKED`` compiles the visibility mask in; ``mask_tile`` (runtime) applies it, so a loop over tiles of
    which only some are on the diagonal (GQA's flattened loop) skips the comparisons on the others."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    row_mask = (offs_m[:, None] < n_q) & d_mask[None, :]
    # ---- load a query tile, its dO (V's head dim), L and D (padding rows load as zero / +inf)
    q = tl.load(q_ptrs + offs_m[:, None].to(tl.int64) * stride_qm, mask=row_mask, other=0.0)
    do = tl.load(do_ptrs + offs_m[:, None].to(tl.int64) * stride_dom, mask=(offs_m[:, None] < n_q) & dv_mask[None, :],
                 other=0.0)
    lse = _load_lse_log2(LSE_ROW, offs_m, n_q)
    delta = tl.load(DELTA_ROW + offs_m, mask=offs_m < n_q, other=0.0)
    # ---- recompute Pᵀ = exp(Sᵀ - L): [BLOCK_N keys, BLOCK_M queries]
    s_t, tanh_t = _scores(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION), qk_scale, softcap, SOFTCAP)
    p_t = tl.math.exp2(s_t - lse[None, :])
    if MASKED:
        if mask_tile:
            p_t = tl.where(tl.trans(_visible(offs_m, offs_n, n_k, shift, win_left, win_right, CAUSAL, WINDOW)),
                           p_t, 0.0)
    # ---- dV += Pᵀ dO ; dPᵀ = V dOᵀ ; dSᵀ = Pᵀ (dPᵀ - D) ; dK += dSᵀ Q
    p_lo = p_t.to(do.dtype)
    if SOFTCAP:
        # through the cap, d(c tanh(s / c)) / ds = 1 - tanh², folded into P at once so the tanh tile dies here
        # (kept until dS it spilled 72 B on sm_90 at d 128: SASS report)
        p_t = p_t * (1.0 - tanh_t * tanh_t)
    dv += tl.dot(p_lo, do, input_precision=DOT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    if ATOMIC_DQ:
        # unscaled dS K: the launcher applies the softmax scale once when it converts the buffer
        dq = tl.dot(tl.trans(ds_t).to(k.dtype), k, input_precision=DOT_PRECISION)
        # relaxed: nothing reads the buffer until the kernel ends, so no ordering is needed (the default acq_rel
        # compiles to ATOMG plus a MEMBAR.GPU per atomic on sm_90; relaxed to fire-and-forget REDG: SASS report)
        tl.atomic_add(dq_ptrs + offs_m[:, None].to(tl.int64) * stride_dqm, dq, mask=row_mask, sem="relaxed")
    return dk, dv


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, stride_qm, stride_dom, LSE_ROW, DELTA_ROW,
                    offs_n, d_mask, dv_mask, q_start, q_end, n_q, n_k, shift, win_left, win_right, qk_scale, dq_ptrs,
                    stride_dqm, softcap, MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                    BLOCK_M: tl.constexpr, ATOMIC_DQ: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    SOFTCAP: tl.constexpr):
    """Fold query tiles ``[q_start, q_end)`` of one query head into dK, dV."""
    for start_m in range(q_start, q_end, BLOCK_M):
        dk, dv = _bwd_dkdv_tile(dk, dv, k, v, q_ptrs, do_ptrs, stride_qm, stride_dom, LSE_ROW, DELTA_ROW, offs_n,
                                d_mask, dv_mask, start_m, n_q, n_k, shift, win_left, win_right, qk_scale, dq_ptrs, stride_dqm,
                                softcap, True, MASKED=MASKED, CAUSAL=CAUSAL, WINDOW=WINDOW, BLOCK_M=BLOCK_M,
                                ATOMIC_DQ=ATOMIC_DQ, DOT_PRECISION=DOT_PRECISION, SOFTCAP=SOFTCAP)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, stride_lb, stride_lh,
    stride_dqb, stride_dqh, stride_dqm,
    n_kv_heads, group, bh_start, n_q, n_k, d_head, d_v, qk_scale, sm_scale, win_left, win_right, softcap,
    GQA: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ATOMIC_DQ: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_DV: tl.constexpr,
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
    # V, dO, dV: their own head dim (MLA), the same as K's otherwise
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < d_v
    if EVEN_DV:
        dv_mask = tl.full([BLOCK_DV], 1, tl.int1)
    v_mask = (offs_n[:, None] < n_k) & dv_mask[None, :]
    rows_n = (k_start + offs_n)[:, None].to(tl.int64)

    # ---- this program's key/value tile stays in registers
    k = tl.load(K + b * stride_kb + h_kv * stride_kh + rows_n * stride_kn + offs_d[None, :], mask=kv_mask,
                other=0.0)
    v = tl.load(V + b * stride_vb + h_kv * stride_vh + rows_n * stride_vn + offs_dv[None, :], mask=v_mask,
                other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

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
            do_ptrs = DO + b * stride_dob + h * stride_doh + q_start * stride_dom + offs_dv[None, :]
            dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + q_start * stride_dqm + offs_d[None, :]
            # only the tiles on the diagonal (or a window's edges) compare indices
            on_edge = (start_m < full_lo) | (start_m >= full_hi)
            dk, dv = _bwd_dkdv_tile(dk, dv, k, v, q_ptrs, do_ptrs, stride_qm, stride_dom, LSE + row_lse,
                                    DELTA + row_lse, offs_n, d_mask, dv_mask, start_m, n_q, n_k, shift, win_left, win_right,
                                    qk_scale, dq_ptrs, stride_dqm, softcap, on_edge, MASKED=True, CAUSAL=CAUSAL, WINDOW=WINDOW,
                                    BLOCK_M=BLOCK_M, ATOMIC_DQ=ATOMIC_DQ, DOT_PRECISION=DOT_PRECISION, SOFTCAP=SOFTCAP)
    else:
        # ---- one query head: masked head range, unmasked middle, masked tail
        h = h_kv
        q_ptrs = Q + b * stride_qb + h * stride_qh + q_start * stride_qm + offs_d[None, :]
        do_ptrs = DO + b * stride_dob + h * stride_doh + q_start * stride_dom + offs_dv[None, :]
        LSE_ROW = LSE + b * stride_lb + h * stride_lh + q_start  # this query head's row of L (and of D below)
        DELTA_ROW = DELTA + b * stride_lb + h * stride_lh + q_start
        dq_ptrs = DQ + b * stride_dqb + h * stride_dqh + q_start * stride_dqm + offs_d[None, :]
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, stride_qm, stride_dom, LSE_ROW, DELTA_ROW,
                                 offs_n, d_mask, dv_mask, q_lo, full_lo, n_q, n_k, shift, win_left, win_right,
                                 qk_scale, dq_ptrs, stride_dqm, softcap, MASKED=True, CAUSAL=CAUSAL,
                                 WINDOW=WINDOW, BLOCK_M=BLOCK_M, ATOMIC_DQ=ATOMIC_DQ, DOT_PRECISION=DOT_PRECISION,
                                 SOFTCAP=SOFTCAP)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, stride_qm, stride_dom, LSE_ROW, DELTA_ROW,
                                 offs_n, d_mask, dv_mask, full_lo, full_hi, n_q, n_k, shift, win_left, win_right,
                                 qk_scale, dq_ptrs, stride_dqm, softcap, MASKED=False, CAUSAL=CAUSAL,
                                 WINDOW=WINDOW, BLOCK_M=BLOCK_M, ATOMIC_DQ=ATOMIC_DQ, DOT_PRECISION=DOT_PRECISION,
                                 SOFTCAP=SOFTCAP)
        if WINDOW:
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_ptrs, do_ptrs, stride_qm, stride_dom, LSE_ROW, DELTA_ROW,
                                     offs_n, d_mask, dv_mask, full_hi, q_hi, n_q, n_k, shift, win_left, win_right,
                                     qk_scale, dq_ptrs, stride_dqm, softcap, MASKED=True, CAUSAL=CAUSAL,
                                     WINDOW=WINDOW, BLOCK_M=BLOCK_M, ATOMIC_DQ=ATOMIC_DQ, DOT_PRECISION=DOT_PRECISION,
                                     SOFTCAP=SOFTCAP)

    # ---- store; S was scaled by sm_scale, so dK picks it up once here
    dk = dk * sm_scale
    tl.store(DK + b * stride_dkb + h_kv * stride_dkh + rows_n * stride_dkn + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + b * stride_dvb + h_kv * stride_dvh + rows_n * stride_dvn + offs_dv[None, :],
             dv.to(DV.dtype.element_ty), mask=v_mask)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, d_mask, dv_mask,
                  k_start, k_end, n_k, shift, win_left, win_right, qk_scale, softcap,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr,
                  EVEN_D: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr, EVEN_DV: tl.constexpr):
    """Fold key tiles ``[k_start, k_end)`` into dQ; padding keys load as zero and add nothing."""
    for start_n in range(k_start, k_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        # ---- load a key/value tile (padding keys load as zero and contribute nothing to dQ)
        k, v = _load_kv(k_ptrs + offs_n[:, None].to(tl.int64) * stride_kn,
                        v_ptrs + offs_n[:, None].to(tl.int64) * stride_vn, offs_n, n_k, d_mask, dv_mask, MASKED,
                        EVEN_D, EVEN_DV)
        # ---- P = exp(S - L), dP = dO Vᵀ, dS = P (dP - D), dQ += dS K
        s, tanh_s = _scores(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), qk_scale, softcap, SOFTCAP)
        p = tl.math.exp2(s - lse[:, None])
        if MASKED:
            p = tl.where(_visible(offs_m, offs_n, n_k, shift, win_left, win_right, CAUSAL, WINDOW), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:  # through the cap: d(c tanh(s / c)) / ds = 1 - tanh²
            ds = ds * (1.0 - tanh_s * tanh_s)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm, stride_lb, stride_lh,
    n_heads, group, bh_start, n_q, n_k, d_head, d_v, qk_scale, sm_scale, win_left, win_right, softcap,
    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_DV: tl.constexpr, EVEN_DV: tl.constexpr,
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
    offs_dv = tl.arange(0, BLOCK_DV)  # dO and V: their own head dim (MLA)
    dv_mask = offs_dv < d_v
    if EVEN_DV:
        dv_mask = tl.full([BLOCK_DV], 1, tl.int1)
    rows_m = (q_start + offs_m)[:, None].to(tl.int64)

    # ---- this program's query tile, dO, L and D stay in registers
    q = tl.load(Q + b * stride_qb + h * stride_qh + rows_m * stride_qm + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows_m * stride_dom + offs_dv[None, :],
                 mask=row_valid[:, None] & dv_mask[None, :], other=0.0)
    row_lse = b * stride_lb + h * stride_lh + q_start
    lse = _load_lse_log2(LSE + row_lse, offs_m, n_q)
    delta = tl.load(DELTA + row_lse + offs_m, mask=row_valid, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_ptrs = K + b * stride_kb + h_kv * stride_kh + k_start * stride_kn + offs_d[None, :]
    v_ptrs = V + b * stride_vb + h_kv * stride_vh + k_start * stride_vn + offs_dv[None, :]

    shift = n_k - n_q
    key_lo, full_lo, full_hi, key_hi = _key_ranges(start_m, n_q, n_k, win_left, win_right, BLOCK_M, BLOCK_N)
    if WINDOW:
        dq = _bwd_dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, d_mask, dv_mask,
                           key_lo, full_lo, n_k, shift, win_left, win_right, qk_scale, softcap, MASKED=True,
                           CAUSAL=CAUSAL, WINDOW=WINDOW, BLOCK_N=BLOCK_N, EVEN_D=EVEN_D,
                           DOT_PRECISION=DOT_PRECISION, SOFTCAP=SOFTCAP, EVEN_DV=EVEN_DV)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, d_mask, dv_mask,
                       full_lo, full_hi, n_k, shift, win_left, win_right, qk_scale, softcap, MASKED=False,
                       CAUSAL=CAUSAL, WINDOW=WINDOW, BLOCK_N=BLOCK_N, EVEN_D=EVEN_D, DOT_PRECISION=DOT_PRECISION,
                       SOFTCAP=SOFTCAP, EVEN_DV=EVEN_DV)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, k_ptrs, v_ptrs, stride_kn, stride_vn, offs_m, d_mask, dv_mask,
                       full_hi, key_hi, n_k, shift, win_left, win_right, qk_scale, softcap, MASKED=True,
                       CAUSAL=CAUSAL, WINDOW=WINDOW, BLOCK_N=BLOCK_N, EVEN_D=EVEN_D, DOT_PRECISION=DOT_PRECISION,
                       SOFTCAP=SOFTCAP, EVEN_DV=EVEN_DV)

    dq = dq * sm_scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + rows_m * stride_dqm + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=q_mask)


@triton.jit
def _bwd_dkdv_kernel_tma(
    Q_DESC, K_DESC, V_DESC, DO_DESC, LSE, DELTA, DK_DESC, DV_DESC, stride_lb, stride_lh,
    n_kv_heads, group, n_q, n_k, qk_scale, sm_scale,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The dense dK/dV kernel with Hopper TMA loads through host-made descriptors (see :func:`_bwd_dkdv_kernel` for
    the math): one key tile per program, its group's query heads and tiles in one flattened loop. Rows past a
    tensor's end load as zeros (their L is +inf, so they add nothing) and stores clip them; only the causal diagonal
    masks P."""
    pid_bh = tl.program_id(1)
    b = pid_bh // n_kv_heads
    h_kv = pid_bh % n_kv_heads
    start_n = tl.program_id(0) * BLOCK_N
    k = _box(K_DESC, b, h_kv, start_n, BLOCK_N, BLOCK_D)
    v = _box(V_DESC, b, h_kv, start_n, BLOCK_N, BLOCK_D)
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
        q = _box(Q_DESC, b, h, start_m, BLOCK_M, BLOCK_D)
        do = _box(DO_DESC, b, h, start_m, BLOCK_M, BLOCK_D)
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
    DK_DESC.store([b, h_kv, start_n, 0], tl.reshape((dk * sm_scale).to(DK_DESC.dtype), (1, 1, BLOCK_N, BLOCK_D)))
    DV_DESC.store([b, h_kv, start_n, 0], tl.reshape(dv.to(DV_DESC.dtype), (1, 1, BLOCK_N, BLOCK_D)))


@triton.jit
def _bwd_dq_kernel_tma(
    Q_DESC, K_DESC, V_DESC, DO_DESC, LSE, DELTA, DQ_DESC, stride_lb, stride_lh, n_heads, group, n_q, n_k,
    qk_scale, sm_scale,
    CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The dense dQ kernel with TMA loads through host-made descriptors (see :func:`_bwd_dq_kernel`): key tiles past
    the tensor load as zeros and add nothing to dQ; the causal diagonal and the ragged last key tile are masked."""
    b, h, h_kv, start_m = _dense_query_program(n_heads, group, n_q, CAUSAL, BLOCK_M)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = _box(Q_DESC, b, h, start_m, BLOCK_M, BLOCK_D)
    do = _box(DO_DESC, b, h, start_m, BLOCK_M, BLOCK_D)
    row = b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh
    lse = _load_lse_log2(LSE + row, offs_m, n_q)
    delta = tl.load(DELTA + row + offs_m, mask=(offs_m >= 0) & (offs_m < n_q), other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    shift = n_k - n_q
    unbounded = 1 << 30
    key_lo, full_lo, full_hi, key_hi = _key_ranges(start_m, n_q, n_k, unbounded, 0 if CAUSAL else unbounded,
                                                   BLOCK_M, BLOCK_N)
    for start_n in range(full_lo, key_hi, BLOCK_N):  # (no left bound: nothing before full_lo)
        k = _box(K_DESC, b, h_kv, start_n, BLOCK_N, BLOCK_D)
        v = _box(V_DESC, b, h_kv, start_n, BLOCK_N, BLOCK_D)
        p = tl.math.exp2(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale - lse[:, None])
        if start_n >= full_hi:
            keys = start_n + tl.arange(0, BLOCK_N)
            p = tl.where(_visible(offs_m, keys, n_k, shift, 0, 0, CAUSAL, False), p, 0.0)
        ds = p * (tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION) - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    DQ_DESC.store([b, h, start_m, 0], tl.reshape((dq * sm_scale).to(DQ_DESC.dtype), (1, 1, BLOCK_M, BLOCK_D)))


# ----------------------------------------------------------------------------------------------------
# launch configuration
# ----------------------------------------------------------------------------------------------------
#: (BLOCK_M, BLOCK_N, num_warps, num_stages) for the forward, by padded head dim, 16-bit inputs.
