"""The gated delta rule's forward kernels: the chunk's WY transform, the state pass, the output, and the token-by-token
recurrence (the package docstring has the maths).

Every tensor is addressed on the packed token axis: ``q, k [tokens, H, K]``, ``v [tokens, HV, V]``, ``g, beta
[tokens, HV]`` (contiguous), intermediates ``w [tokens, HV, K]``, ``u, v_new [tokens, HV, V]``, ``gcum [tokens, HV]``
(fp32), the chunk-start states ``h [chunks, HV, K, V]`` (fp32). Chunk ``c`` covers tokens ``CHUNK_START[c] ..
CHUNK_END[c]`` (never across a document); a document's chunks are numbered ``CHUNK_OFFSET[n] ..`` in order.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _value_head(n_heads, n_v_heads):
    """``(hv, head)``: grid axis 1 is the value head; GVA: value head ``hv`` reads query/key head ``hv // group``."""
    hv = tl.program_id(1)
    return hv, hv // (n_v_heads // n_heads)


@triton.jit
def _offset(x, OFFS_64: tl.constexpr):
    """Token indices in 64-bit only where ``tokens · heads · head size`` could pass 2³¹ (``OFFS_64``): 32-bit row
    offsets keep the [chunk, head size] address tiles at one register per element (SASS report)."""
    if OFFS_64:
        return x.to(tl.int64)
    return x.to(tl.int32)


@triton.jit
def _rows(CHUNK_START, CHUNK_END, c, BLOCK_C: tl.constexpr, OFFS_64: tl.constexpr):
    """``(rows, row_mask, n_rows)`` of chunk ``c`` (``n_rows <= 0``: a spare program of a varlen grid)."""
    start = tl.load(CHUNK_START + c)
    n_rows = tl.load(CHUNK_END + c) - start
    rows = _offset(start, OFFS_64) + tl.arange(0, BLOCK_C)
    return rows, tl.arange(0, BLOCK_C) < n_rows, n_rows


@triton.jit
def _load_block(X, rows, row_mask, head, n_heads, dim, col0, BLOCK_D: tl.constexpr):
    """Columns ``col0 .. col0 + BLOCK_D`` of ``X[rows, head, :dim]`` (fp32, zero outside)."""
    cols = col0 + tl.arange(0, BLOCK_D)
    ptrs = X + (rows[:, None] * n_heads + head) * dim + cols[None, :]
    return tl.load(ptrs, mask=row_mask[:, None] & (cols[None, :] < dim), other=0.0).to(tl.float32)


@triton.jit
def _store_block(X, value, rows, row_mask, head, n_heads, dim, col0, BLOCK_D: tl.constexpr):
    cols = col0 + tl.arange(0, BLOCK_D)
    ptrs = X + (rows[:, None] * n_heads + head) * dim + cols[None, :]
    tl.store(ptrs, value.to(X.dtype.element_ty), mask=row_mask[:, None] & (cols[None, :] < dim))


@triton.jit
def _load_heads(X, rows, row_mask, head, n_heads, dim, BLOCK_D: tl.constexpr):
    """``X[rows, head, :dim]`` of a ``[tokens, n_heads, dim]`` tensor as fp32 ``[BLOCK_C, BLOCK_D]`` (zero outside)."""
    return _load_block(X, rows, row_mask, head, n_heads, dim, 0, BLOCK_D)


@triton.jit
def _store_heads(X, value, rows, row_mask, head, n_heads, dim, BLOCK_D: tl.constexpr):
    _store_block(X, value, rows, row_mask, head, n_heads, dim, 0, BLOCK_D)


@triton.jit
def _state_ptrs(S, index, hv, n_v_heads, d_k, d_v, col0, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """Pointers and mask of the ``[BLOCK_K, BLOCK_V]`` block at column ``col0`` of state ``S[index, hv]``
    (``[*, HV, K, V]``, contiguous)."""
    ks = tl.arange(0, BLOCK_K)
    vs = col0 + tl.arange(0, BLOCK_V)
    base = (index.to(tl.int64) * n_v_heads + hv) * d_k * d_v
    return S + base + ks[:, None] * d_v + vs[None, :], (ks[:, None] < d_k) & (vs[None, :] < d_v)


@triton.jit
def _chunk_decays(G, rows, row_mask, hv, n_v_heads, BLOCK_C: tl.constexpr):
    """``(gcum, strict, causal)``: the within-chunk cumulative log decay ``Γ`` (rows past the chunk's end repeat
    its last value) and the pairwise decays ``exp(Γ_i − Γ_j)`` below (``strict``, ``i > j``) and on or below
    (``causal``, ``i >= j``) the diagonal, zero above: the exponent is masked before ``exp`` so it is never positive."""
    g = tl.load(G + rows * n_v_heads + hv, mask=row_mask, other=0.0).to(tl.float32)
    gcum = tl.cumsum(g, axis=0)
    i = tl.arange(0, BLOCK_C)[:, None]
    j = tl.arange(0, BLOCK_C)[None, :]
    diff = tl.where(i >= j, gcum[:, None] - gcum[None, :], 0.0)
    causal = tl.where(i >= j, tl.exp(diff), 0.0)
    strict = tl.where(i > j, causal, 0.0)
    return gcum, strict, causal


@triton.jit
def _unit_lower_inverse(a, BLOCK_C: tl.constexpr):
    """``(I + a)⁻¹`` of a strictly lower-triangular ``[BLOCK_C, BLOCK_C]`` tile, by forward substitution: row ``r`` of
    the inverse is ``e_r − Σ_{j<r} a[r, j] · row_j`` (rows above ``r`` are final when row ``r`` is formed)."""
    i = tl.arange(0, BLOCK_C)[:, None]
    inverse = tl.where(i == tl.arange(0, BLOCK_C)[None, :], 1.0, 0.0)
    for r in range(1, BLOCK_C):
        a_row = tl.sum(tl.where(i == r, a, 0.0), axis=0)  # a[r, :] (zero from column r on)
        row = tl.sum(a_row[:, None] * inverse, axis=0)  # Σ_j a[r, j] · inverse[j, :]
        inverse = tl.where(i == r, inverse - row[None, :], inverse)
    return inverse


# ----------------------------------------------------------------------------------------------------
# 1. per chunk: Γ, the WY transform T = (I + A)⁻¹, w = T (β k e^Γ), u = T (β v)
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _wy_kernel(K, V, G, BETA, CHUNK_START, CHUNK_END, W, U, GCUM, T_OUT, n_heads, n_v_heads, d_k, d_v,
               STORE_T: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
               OFFS_64: tl.constexpr,
               BLOCK_V: tl.constexpr):
    c = tl.program_id(0)
    hv, head = _value_head(n_heads, n_v_heads)
    rows, row_mask, n_rows = _rows(CHUNK_START, CHUNK_END, c, BLOCK_C, OFFS_64)
    if n_rows <= 0:
        return
    # load
    k = _load_heads(K, rows, row_mask, head, n_heads, d_k, BLOCK_K)
    beta = tl.load(BETA + rows * n_v_heads + hv, mask=row_mask, other=0.0).to(tl.float32)
    gcum, strict, _ = _chunk_decays(G, rows, row_mask, hv, n_v_heads, BLOCK_C)
    # A[i, j] = β_i (k_i · k_j) exp(Γ_i − Γ_j) for i > j
    a = beta[:, None] * tl.dot(k, tl.trans(k), input_precision=DOT_PRECISION) * strict
    t = _unit_lower_inverse(a, BLOCK_C)
    # w and u
    kb = k * (beta * tl.exp(gcum))[:, None]
    _store_heads(W, tl.dot(t, kb, input_precision=DOT_PRECISION), rows, row_mask, hv, n_v_heads, d_k, BLOCK_K)
    for v0 in range(0, d_v, BLOCK_V):
        vb = _load_block(V, rows, row_mask, hv, n_v_heads, d_v, v0, BLOCK_V) * beta[:, None]
        _store_block(U, tl.dot(t, vb, input_precision=DOT_PRECISION), rows, row_mask, hv, n_v_heads, d_v, v0,
                     BLOCK_V)
    tl.store(GCUM + rows * n_v_heads + hv, gcum, mask=row_mask)
    if STORE_T:
        i = tl.arange(0, BLOCK_C)
        tl.store(T_OUT + ((c.to(tl.int64) * n_v_heads + hv) * BLOCK_C + i[:, None]) * BLOCK_C + i[None, :], t)


# ----------------------------------------------------------------------------------------------------
# 2. per document: the state pass over its chunks (v_new = u − w S; S ← e^{Γ_C} S + (k e^{Γ_C − Γ})ᵀ v_new)
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _state_kernel(K, W, U, GCUM, CU_SEQLENS, CHUNK_OFFSET, S0, H, V_NEW, S_FINAL, n_heads, n_v_heads, d_k, d_v,
                  HAS_S0: tl.constexpr, STORE_FINAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, OFFS_64: tl.constexpr, BLOCK_V: tl.constexpr):
    doc = tl.program_id(0)
    hv, head = _value_head(n_heads, n_v_heads)
    v0 = tl.program_id(2) * BLOCK_V  # this program's state columns
    bos = _offset(tl.load(CU_SEQLENS + doc), OFFS_64)
    eos = _offset(tl.load(CU_SEQLENS + doc + 1), OFFS_64)
    first_chunk = tl.load(CHUNK_OFFSET + doc)
    s_ptrs, s_mask = _state_ptrs(S0, doc, hv, n_v_heads, d_k, d_v, v0, BLOCK_K, BLOCK_V)
    if HAS_S0:
        state = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)
    else:
        state = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    for i in range(0, tl.cdiv(eos - bos, BLOCK_C)):
        rows = bos + i * BLOCK_C + tl.arange(0, BLOCK_C)
        row_mask = rows < eos
        h_ptrs, h_mask = _state_ptrs(H, first_chunk + i, hv, n_v_heads, d_k, d_v, v0, BLOCK_K, BLOCK_V)
        tl.store(h_ptrs, state, mask=h_mask)  # the state the chunk starts from (the output and backward read it)
        w = _load_heads(W, rows, row_mask, hv, n_v_heads, d_k, BLOCK_K)
        v_new = _load_block(U, rows, row_mask, hv, n_v_heads, d_v, v0, BLOCK_V) - tl.dot(
            w, state, input_precision=DOT_PRECISION)
        _store_block(V_NEW, v_new, rows, row_mask, hv, n_v_heads, d_v, v0, BLOCK_V)
        g_last = tl.load(GCUM + (tl.minimum(bos + (i + 1) * BLOCK_C, eos) - 1) * n_v_heads + hv)
        gcum = tl.load(GCUM + rows * n_v_heads + hv, mask=row_mask, other=g_last)
        k = _load_heads(K, rows, row_mask, head, n_heads, d_k, BLOCK_K) * tl.exp(g_last - gcum)[:, None]
        state = state * tl.exp(g_last) + tl.dot(tl.trans(k), v_new, input_precision=DOT_PRECISION)
    if STORE_FINAL:
        f_ptrs, f_mask = _state_ptrs(S_FINAL, doc, hv, n_v_heads, d_k, d_v, v0, BLOCK_K, BLOCK_V)
        tl.store(f_ptrs, state, mask=f_mask)


# ----------------------------------------------------------------------------------------------------
# 3. per chunk: o = scale (q e^Γ) S + (scale q kᵀ ⊙ exp(Γ_i − Γ_j), i >= j) v_new
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _output_kernel(Q, K, G, H, V_NEW, O, CHUNK_START, CHUNK_END, scale, n_heads, n_v_heads, d_k, d_v,
                   DOT_PRECISION: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr, OFFS_64: tl.constexpr,
                   BLOCK_V: tl.constexpr):
    c = tl.program_id(0)
    hv, head = _value_head(n_heads, n_v_heads)
    v0 = tl.program_id(2) * BLOCK_V
    rows, row_mask, n_rows = _rows(CHUNK_START, CHUNK_END, c, BLOCK_C, OFFS_64)
    if n_rows <= 0:
        return
    q = _load_heads(Q, rows, row_mask, head, n_heads, d_k, BLOCK_K)
    k = _load_heads(K, rows, row_mask, head, n_heads, d_k, BLOCK_K)
    gcum, _, causal = _chunk_decays(G, rows, row_mask, hv, n_v_heads, BLOCK_C)
    h_ptrs, h_mask = _state_ptrs(H, c, hv, n_v_heads, d_k, d_v, v0, BLOCK_K, BLOCK_V)
    state = tl.load(h_ptrs, mask=h_mask, other=0.0)
    v_new = _load_block(V_NEW, rows, row_mask, hv, n_v_heads, d_v, v0, BLOCK_V)
    p = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * causal
    o = tl.dot(q * tl.exp(gcum)[:, None], state, input_precision=DOT_PRECISION)
    o += tl.dot(p, v_new, input_precision=DOT_PRECISION)
    _store_block(O, o * scale, rows, row_mask, hv, n_v_heads, d_v, v0, BLOCK_V)


# ----------------------------------------------------------------------------------------------------
# the recurrence, one token at a time (decoding; the readable second path)
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _recurrent_kernel(Q, K, V, G, BETA, CU_SEQLENS, S0, O, S_FINAL, scale, n_heads, n_v_heads, d_k, d_v,
                      HAS_S0: tl.constexpr, STORE_FINAL: tl.constexpr, L2NORM: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, OFFS_64: tl.constexpr):
    """One program per (document, value head, block of state columns): the state block stays in registers, read
    once and written once whatever the number of tokens."""
    doc = tl.program_id(0)
    hv, head = _value_head(n_heads, n_v_heads)
    v0 = tl.program_id(2) * BLOCK_V
    bos = _offset(tl.load(CU_SEQLENS + doc), OFFS_64)
    eos = _offset(tl.load(CU_SEQLENS + doc + 1), OFFS_64)
    ks = tl.arange(0, BLOCK_K)
    vs = v0 + tl.arange(0, BLOCK_V)
    k_mask = ks < d_k
    v_mask = vs < d_v
    s_ptrs, s_mask = _state_ptrs(S0, doc, hv, n_v_heads, d_k, d_v, v0, BLOCK_K, BLOCK_V)
    if HAS_S0:
        state = tl.load(s_ptrs, mask=s_mask, other=0.0).to(tl.float32)
    else:
        state = tl.zeros([BLOCK_K, BLOCK_V], dtype=tl.float32)
    for t in range(bos, eos):
        q = tl.load(Q + (t * n_heads + head) * d_k + ks, mask=k_mask, other=0.0).to(tl.float32)
        k = tl.load(K + (t * n_heads + head) * d_k + ks, mask=k_mask, other=0.0).to(tl.float32)
        v = tl.load(V + (t * n_v_heads + hv) * d_v + vs, mask=v_mask, other=0.0).to(tl.float32)
        g = tl.load(G + t * n_v_heads + hv).to(tl.float32)
        beta = tl.load(BETA + t * n_v_heads + hv).to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        state = state * tl.exp(g)
        predicted = tl.sum(state * k[:, None], axis=0)  # Sᵀ k
        state += k[:, None] * (beta * (v - predicted))[None, :]
        o = tl.sum(state * q[:, None], axis=0) * scale
        tl.store(O + (t * n_v_heads + hv) * d_v + vs, o.to(O.dtype.element_ty), mask=v_mask)
    if STORE_FINAL:
        f_ptrs, f_mask = _state_ptrs(S_FINAL, doc, hv, n_v_heads, d_k, d_v, v0, BLOCK_K, BLOCK_V)
        tl.store(f_ptrs, state, mask=f_mask)
