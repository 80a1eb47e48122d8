"""The gated delta rule's backward kernels (the package docstring derives each gradient). The forward's ``w``, ``u``,
``Γ``, ``T`` and chunk-start states ``h`` are recomputed by the forward kernels first (nothing but the inputs is
saved), in chunks of 32 (the launcher's ``CHUNK_BWD``); then:

1. :func:`_state_bwd_kernel`, per document and block of state columns, walks its chunks backwards carrying
   ``dS`` (the loss's gradient with respect to the state at the chunk's end): stores it per chunk (``dh``), forms
   ``dv_new`` and ``Σ S ⊙ dS`` (the chunk-end decay's gradient) and steps ``dS`` to the chunk's start; after the
   first chunk ``dS`` is the initial state's gradient.
2. :func:`_dqk_kernel`, per chunk and value head: ``dq`` and the parts of ``dk`` and ``dΓ`` through the output
   and the chunk-end state (per value head; GVA sums ``dq`` and ``dk`` over the group afterwards), and ``dv_new
   (β v)ᵀ``, the first part of ``dT``;
3. :func:`_dv_kernel`, per chunk and value head: ``dv`` through ``u = T (β v)``, ``dw = −dv_new Sᵀ`` and the first
   part of ``dβ``;
4. :func:`_wy_bwd_kernel`, per chunk and value head: through ``w`` and ``T = (I + A)⁻¹``: the rest of ``dk``, ``dβ``
   and ``dΓ``, then ``dg`` (the reverse running sum of ``dΓ``).

Four kernels rather than one so that none holds more than a few ``[chunk, K]`` fp32 tiles: each is spill-free on
sm_90 (SASS report). Every gradient element is written by exactly one program: deterministic, no atomics.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .forward import (
    _chunk_decays,
    _load_block,
    _load_heads,
    _offset,
    _rows,
    _state_ptrs,
    _store_block,
    _store_heads,
    _value_head,
)


@triton.jit
def _state_bwd_kernel(Q, K, W, GCUM, DO, CU_SEQLENS, CHUNK_OFFSET, DS_FINAL, H, DH, DV_NEW, STATE_DOT, DS0, scale,
                      n_chunk_slots, n_heads, n_v_heads, d_k, d_v, HAS_DS_FINAL: tl.constexpr,
                      STORE_DS0: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_C: tl.constexpr,
                      BLOCK_K: tl.constexpr, OFFS_64: tl.constexpr, BLOCK_V: tl.constexpr):
    doc = tl.program_id(0)
    hv, head = _value_head(n_heads, n_v_heads)
    v0 = tl.program_id(2) * BLOCK_V
    bos = _offset(tl.load(CU_SEQLENS + doc), OFFS_64)
    eos = _offset(tl.load(CU_SEQLENS + doc + 1), OFFS_64)
    first_chunk = tl.load(CHUNK_OFFSET + doc)
    n_chunks = tl.cdiv(eos - bos, BLOCK_C)
    if HAS_DS_FINAL:
        f_ptrs, f_mask = _state_ptrs(DS_FINAL, doc, hv, n_v_heads, d_k, d_v, v0, BLOCK_K, BLOCK_V)
        d_state = tl.load(f_ptrs, mask=f_mask, other=0.0).to(tl.float32)
    else:
        d_state = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    for back in range(0, n_chunks):
        i = n_chunks - 1 - back
        rows = bos + i * BLOCK_C + tl.arange(0, BLOCK_C)
        row_mask = rows < eos
        h_ptrs, h_mask = _state_ptrs(DH, first_chunk + i, hv, n_v_heads, d_k, d_v, v0, BLOCK_K, BLOCK_V)
        tl.store(h_ptrs, d_state, mask=h_mask)
        # Σ S ⊙ dS_end over this program's columns (the chunk-end decay's gradient; summed over programs after)
        s_ptrs, _ = _state_ptrs(H, first_chunk + i, hv, n_v_heads, d_k, d_v, v0, BLOCK_K, BLOCK_V)
        tl.store(STATE_DOT + (tl.program_id(2).to(tl.int64) * n_chunk_slots + first_chunk + i) * n_v_heads + hv,
                 tl.sum(tl.sum(tl.load(s_ptrs, mask=h_mask, other=0.0) * d_state, axis=1), axis=0))
        g_last = tl.load(GCUM + (tl.minimum(bos + (i + 1) * BLOCK_C, eos) - 1) * n_v_heads + hv)
        # rows past the end repeat the last Γ (as the WY kernel's running sum does): no positive exponent below
        gcum = tl.load(GCUM + rows * n_v_heads + hv, mask=row_mask, other=g_last)
        below = tl.arange(0, BLOCK_C)[:, None] >= tl.arange(0, BLOCK_C)[None, :]
        causal = tl.where(below, tl.exp(tl.where(below, gcum[:, None] - gcum[None, :], 0.0)), 0.0)
        d_o = _load_block(DO, rows, row_mask, hv, n_v_heads, d_v, v0, BLOCK_V)
        # q's two terms first (q is dead after them): P = scale q kᵀ ⊙ exp(Γ_i − Γ_j) (i >= j), and the output's
        # read of the chunk-start state, scale (q e^Γ)ᵀ dO
        q = _load_heads(Q, rows, row_mask, head, n_heads, d_k, BLOCK_K)
        k = _load_heads(K, rows, row_mask, head, n_heads, d_k, BLOCK_K)
        p = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * causal * scale
        q_read = tl.dot(tl.trans(q * (tl.exp(gcum) * scale)[:, None]), d_o, input_precision=DOT_PRECISION)
        # dv_new = Pᵀ dO + (k e^{Γ_C − Γ}) dS_end
        dv_new = tl.dot(tl.trans(p), d_o, input_precision=DOT_PRECISION)
        dv_new += tl.dot(k * tl.exp(g_last - gcum)[:, None], d_state, input_precision=DOT_PRECISION)
        _store_block(DV_NEW, dv_new, rows, row_mask, hv, n_v_heads, d_v, v0, BLOCK_V)
        # dS_start = e^{Γ_C} dS_end + scale (q e^Γ)ᵀ dO − wᵀ dv_new
        w = _load_heads(W, rows, row_mask, hv, n_v_heads, d_k, BLOCK_K)
        d_state = d_state * tl.exp(g_last) + q_read - tl.dot(tl.trans(w), dv_new, input_precision=DOT_PRECISION)
    if STORE_DS0:
        s_ptrs, s_mask = _state_ptrs(DS0, doc, hv, n_v_heads, d_k, d_v, v0, BLOCK_K, BLOCK_V)
        tl.store(s_ptrs, d_state, mask=s_mask)


@triton.jit
def _square_ptrs(c, hv, n_v_heads, BLOCK_C: tl.constexpr):
    """Offsets of chunk ``c``'s ``[BLOCK_C, BLOCK_C]`` tile of value head ``hv`` in a ``[chunks, HV, C, C]`` buffer
    (``T``, ``dT``)."""
    i = tl.arange(0, BLOCK_C)[:, None]
    j = tl.arange(0, BLOCK_C)[None, :]
    return ((c.to(tl.int64) * n_v_heads + hv) * BLOCK_C + i) * BLOCK_C + j


@triton.jit
def _chunk_bwd_prologue(G, BETA, CHUNK_START, CHUNK_END, n_heads, BLOCK_C: tl.constexpr, OFFS_64: tl.constexpr):
    """``(c, hv, head, n_v_heads, rows, row_mask, n_rows, beta, gcum, strict, causal, g_last)`` of this program's
    chunk (grid: chunks x value heads)."""
    c = tl.program_id(0)
    n_v_heads = tl.num_programs(1)
    hv, head = _value_head(n_heads, n_v_heads)
    rows, row_mask, n_rows = _rows(CHUNK_START, CHUNK_END, c, BLOCK_C, OFFS_64)
    beta = tl.load(BETA + rows * n_v_heads + hv, mask=row_mask, other=0.0).to(tl.float32)
    gcum, strict, causal = _chunk_decays(G, rows, row_mask, hv, n_v_heads, BLOCK_C)
    g_last = tl.sum(tl.where(tl.arange(0, BLOCK_C) == n_rows - 1, gcum, 0.0), axis=0)
    return c, hv, head, n_v_heads, rows, row_mask, n_rows, beta, gcum, strict, causal, g_last


@triton.jit
def _dqk_kernel(Q, K, V, G, BETA, H, DH, V_NEW, DV_NEW, DO, STATE_DOT, CHUNK_START, CHUNK_END, DQ, DK, DGAM, DT, scale,
                n_heads, d_k, d_v, DOT_PRECISION: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
                OFFS_64: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Per chunk and value head, the gradients through the output and the chunk-end state: ``dq`` (final), the
    first part of ``dk`` and of ``dΓ``; and ``dv_new (β v)ᵀ``, the first part of ``dT`` (:func:`_wy_bwd_kernel`)."""
    c, hv, head, n_v_heads, rows, row_mask, n_rows, beta, gcum, strict, causal, g_last = _chunk_bwd_prologue(
        G, BETA, CHUNK_START, CHUNK_END, n_heads, BLOCK_C, OFFS_64)
    if n_rows <= 0:
        return
    # the value-width products, a block of state columns at a time
    dq_state = tl.zeros([BLOCK_C, BLOCK_K], dtype=tl.float32)  # dO Sᵀ
    dk_end = tl.zeros([BLOCK_C, BLOCK_K], dtype=tl.float32)  # v_new dS_endᵀ
    dp = tl.zeros([BLOCK_C, BLOCK_C], dtype=tl.float32)  # dO v_newᵀ
    dt = tl.zeros([BLOCK_C, BLOCK_C], dtype=tl.float32)  # dv_new (β v)ᵀ
    for v0 in tl.static_range(0, BLOCK_DV, BLOCK_V):  # unrolled: a runtime loop here compiled to 32 registers + stack
        h_ptrs, h_mask = _state_ptrs(H, c, hv, n_v_heads, d_k, d_v, v0, BLOCK_K, BLOCK_V)
        state = tl.load(h_ptrs, mask=h_mask, other=0.0)
        dh_ptrs, _ = _state_ptrs(DH, c, hv, n_v_heads, d_k, d_v, v0, BLOCK_K, BLOCK_V)
        d_state = tl.load(dh_ptrs, mask=h_mask, other=0.0)
        d_o = _load_block(DO, rows, row_mask, hv, n_v_heads, d_v, v0, BLOCK_V)
        v_new = _load_block(V_NEW, rows, row_mask, hv, n_v_heads, d_v, v0, BLOCK_V)
        dq_state += tl.dot(d_o, tl.trans(state), input_precision=DOT_PRECISION)
        dk_end += tl.dot(v_new, tl.trans(d_state), input_precision=DOT_PRECISION)
        dp += tl.dot(d_o, tl.trans(v_new), input_precision=DOT_PRECISION)
        v = _load_block(V, rows, row_mask, hv, n_v_heads, d_v, v0, BLOCK_V) * beta[:, None]
        dt += tl.dot(_load_block(DV_NEW, rows, row_mask, hv, n_v_heads, d_v, v0, BLOCK_V), tl.trans(v),
                     input_precision=DOT_PRECISION)
    tl.store(DT + _square_ptrs(c, hv, n_v_heads, BLOCK_C), dt)
    # o's read of the chunk-start state: o += scale (q e^Γ) S
    q = _load_heads(Q, rows, row_mask, head, n_heads, d_k, BLOCK_K)
    dq = dq_state * (tl.exp(gcum) * scale)[:, None]
    dgam = tl.sum(dq * q, axis=1)
    # o's within-chunk part: o += (scale q kᵀ ⊙ exp(Γ_i − Γ_j), i >= j) v_new
    k = _load_heads(K, rows, row_mask, head, n_heads, d_k, BLOCK_K)
    ds = dp * causal * scale  # the gradient of q_i · k_j
    through = ds * tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    dgam += tl.sum(through, axis=1) - tl.sum(through, axis=0)
    dq += tl.dot(ds, k, input_precision=DOT_PRECISION)
    _store_heads(DQ, dq, rows, row_mask, hv, n_v_heads, d_k, BLOCK_K)
    dk = tl.dot(tl.trans(ds), q, input_precision=DOT_PRECISION)
    # the chunk-end state: S_end = e^{Γ_C} S + (k e^{Γ_C − Γ})ᵀ v_new
    to_end = tl.exp(g_last - gcum)
    dk += dk_end * to_end[:, None]
    carried = tl.sum(dk_end * k, axis=1) * to_end
    dgam -= carried
    d_last = tl.sum(carried, axis=0) + tl.exp(g_last) * tl.load(STATE_DOT + c.to(tl.int64) * n_v_heads + hv)
    dgam += tl.where(tl.arange(0, BLOCK_C) == n_rows - 1, d_last, 0.0)
    _store_heads(DK, dk, rows, row_mask, hv, n_v_heads, d_k, BLOCK_K)
    tl.store(DGAM + rows * n_v_heads + hv, dgam, mask=row_mask)


@triton.jit
def _dv_kernel(V, G, BETA, T_IN, H, DV_NEW, CHUNK_START, CHUNK_END, DV, DW, DBETA, d_k, d_v,
               DOT_PRECISION: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, OFFS_64: tl.constexpr,
               BLOCK_V: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Per chunk and value head, through ``v_new = u − w S`` and ``u = T (β v)`` (``du = dv_new``): ``dv``, ``dw =
    −dv_new Sᵀ`` and the first part of ``dβ``."""
    c, hv, head, n_v_heads, rows, row_mask, n_rows, beta, gcum, strict, causal, g_last = _chunk_bwd_prologue(
        G, BETA, CHUNK_START, CHUNK_END, 1, BLOCK_C, OFFS_64)
    if n_rows <= 0:
        return
    t_ptrs = _square_ptrs(c, hv, n_v_heads, BLOCK_C)
    t = tl.load(T_IN + t_ptrs)
    dw = tl.zeros([BLOCK_C, BLOCK_K], dtype=tl.float32)
    dbeta = tl.zeros([BLOCK_C], dtype=tl.float32)
    for v0 in range(0, BLOCK_DV, BLOCK_V):  # (a runtime loop: unrolled, this one spilled)
        dv_new = _load_block(DV_NEW, rows, row_mask, hv, n_v_heads, d_v, v0, BLOCK_V)
        h_ptrs, h_mask = _state_ptrs(H, c, hv, n_v_heads, d_k, d_v, v0, BLOCK_K, BLOCK_V)
        dw -= tl.dot(dv_new, tl.trans(tl.load(h_ptrs, mask=h_mask, other=0.0)), input_precision=DOT_PRECISION)
        v = _load_block(V, rows, row_mask, hv, n_v_heads, d_v, v0, BLOCK_V)
        # u = T (β v): d(β v) = Tᵀ du
        dvb = tl.dot(tl.trans(t), dv_new, input_precision=DOT_PRECISION)
        _store_block(DV, dvb * beta[:, None], rows, row_mask, hv, n_v_heads, d_v, v0, BLOCK_V)
        dbeta += tl.sum(dvb * v, axis=1)
    _store_heads(DW, dw, rows, row_mask, hv, n_v_heads, d_k, BLOCK_K)
    tl.store(DBETA + rows * n_v_heads + hv, dbeta, mask=row_mask)


@triton.jit
def _wy_bwd_kernel(K, G, BETA, T_IN, DW, DT, CHUNK_START, CHUNK_END, DK, DGAM, DG, DBETA, n_heads, d_k,
                   DOT_PRECISION: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, OFFS_64: tl.constexpr):
    """Per chunk and value head, through ``w = T (β k e^Γ)`` and the WY transform ``T = (I + A)⁻¹``: the rest of
    ``dk`` (added to :func:`_dqk_kernel`'s part), ``dβ`` and ``dΓ``, then ``dg``."""
    c, hv, head, n_v_heads, rows, row_mask, n_rows, beta, gcum, strict, causal, g_last = _chunk_bwd_prologue(
        G, BETA, CHUNK_START, CHUNK_END, n_heads, BLOCK_C, OFFS_64)
    if n_rows <= 0:
        return
    t_ptrs = _square_ptrs(c, hv, n_v_heads, BLOCK_C)
    t = tl.load(T_IN + t_ptrs)
    dt = tl.load(DT + t_ptrs)
    dw = _load_heads(DW, rows, row_mask, hv, n_v_heads, d_k, BLOCK_K)
    dbeta = tl.load(DBETA + rows * n_v_heads + hv, mask=row_mask, other=0.0)
    k = _load_heads(K, rows, row_mask, head, n_heads, d_k, BLOCK_K)
    k_rate = beta * tl.exp(gcum)
    dkb = tl.dot(tl.trans(t), dw, input_precision=DOT_PRECISION)
    dt += tl.dot(dw, tl.trans(k * k_rate[:, None]), input_precision=DOT_PRECISION)
    dk = dkb * k_rate[:, None]
    dkb_k = tl.sum(dkb * k, axis=1)
    dbeta += dkb_k * tl.exp(gcum)
    dgam = tl.load(DGAM + rows * n_v_heads + hv, mask=row_mask, other=0.0) + dkb_k * k_rate
    # T = (I + A)⁻¹: dA = −Tᵀ dT Tᵀ below the diagonal; A = β_i (k_i · k_j) exp(Γ_i − Γ_j), i > j
    da = -tl.dot(tl.trans(t), tl.dot(dt, tl.trans(t), input_precision=DOT_PRECISION),
                 input_precision=DOT_PRECISION)
    below = tl.arange(0, BLOCK_C)[:, None] > tl.arange(0, BLOCK_C)[None, :]
    dkk = tl.where(below, da, 0.0) * strict  # (⊙ the decay) the gradient of β_i (k_i · k_j)
    kk = tl.dot(k, tl.trans(k), input_precision=DOT_PRECISION)
    dbeta += tl.sum(dkk * kk, axis=1)
    dkk = dkk * beta[:, None]  # the gradient of k_i · k_j
    through = dkk * kk
    dgam += tl.sum(through, axis=1) - tl.sum(through, axis=0)
    # k_i and k_j both get it: one product with the symmetrised tile
    dk += tl.dot(dkk + tl.trans(dkk), k, input_precision=DOT_PRECISION)
    dk += _load_heads(DK, rows, row_mask, hv, n_v_heads, d_k, BLOCK_K)  # _dqk_kernel's part
    _store_heads(DK, dk, rows, row_mask, hv, n_v_heads, d_k, BLOCK_K)
    # Γ is the running sum of g inside the chunk: dg_t = Σ_{i >= t} dΓ_i
    tl.store(DG + rows * n_v_heads + hv, tl.cumsum(dgam, axis=0, reverse=True), mask=row_mask)
    tl.store(DBETA + rows * n_v_heads + hv, dbeta, mask=row_mask)
