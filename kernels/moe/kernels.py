"""Mixture-of-experts grouped GEMMs (Triton ``@jit`` code only; launched from :mod:`.launch`).

Rows are the ``T·K`` (token, slot) pairs sorted by expert (:mod:`.routing`). A row-tile program owns up to
``BLOCK_M`` consecutive sorted rows of one expert, read from the tile map (``TILE_EXPERT``, ``TILE_START``,
``TILE_END``); a program past the last tile (the grid is a bound, not a count) returns at once. A row's pair index
``p = t·K + k`` names its token ``t = p // K`` and its routing weight ``w[p]``. Token rows are gathered by pointer
(never copied into a ``[T·K, H]`` matrix), and a pair's result lands on its own row of a ``[T·K, H]`` buffer that
the launcher sums over K (deterministic).

Weight layouts are transformers 5's stacked ones: ``gate_up [E, 2I, H]`` (gate rows, then up rows) and
``down [E, H, I]``; every kernel reads them through strides, as stored. ``INTERLEAVED``: gate and up rows alternate
(feature ``c``'s gate is row ``2c``, its up row ``2c + 1``: gpt-oss's ``[E, H, 2I]`` parameter, transposed by
strides, read in place). The pre-activation buffer is always stacked (``[gate | up]`` per row); :func:`_gu_row`
maps its columns to weight rows. Optional biases (``HAS_BIAS``: gpt-oss): ``gate_up_bias [E, 2I]`` (laid out like
the weight's rows) is added to the pre-activations, ``down_bias [E, H]`` inside each expert, before the routing
weight.

``PRE`` rows are ``3I`` wide: the gate and up pre-activations, then the gated unit ``h`` of the rounded pair, formed
once by the up projection's epilogue. The down projection and the ``d down`` weight gradient read ``h`` as a GEMM
operand (recomputing it for every output tile cost ~350 instructions per K iteration around 2 HGMMAs); the price is
``T·K·I`` more saved elements (a Mixtral-8x7B layer at 8K tokens, bf16: 448 MiB beside the 896 MiB of gate / up).
"""

from __future__ import annotations

import triton
import triton.language as tl

#: sqrt(2 / pi), for the tanh approximation of GELU
_SQRT_2_OVER_PI = 0.7978845608028654


@triton.jit
def _glu(gate, up, alpha, limit, ACTIVATION: tl.constexpr):
    """``(h, dh/dgate, dh/dup)`` of the gated unit in fp32: ``act(gate) * up`` with SiLU ``g·σ(g)`` or the
    tanh-approximate GELU, or gpt-oss's clamped SwiGLU ``(u' + 1) · g'·σ(alpha·g')`` with ``g' = min(g, limit)``,
    ``u' = clamp(u, -limit, limit)`` (the clamps pass gradient inside their bounds, bounds included, as
    ``torch.clamp``)."""
    if ACTIVATION == "silu":
        sig = tl.sigmoid(gate)
        act = gate * sig
        return act * up, up * (sig * (1.0 + gate * (1.0 - sig))), act
    elif ACTIVATION == "gelu_tanh":
        inner = _SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        th = 2.0 * tl.sigmoid(2.0 * inner) - 1.0  # tanh(inner), from the sigmoid (no tanh in every libdevice)
        d_inner = _SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * gate * gate)
        act = 0.5 * gate * (1.0 + th)
        return act * up, up * (0.5 * (1.0 + th) + 0.5 * gate * (1.0 - th * th) * d_inner), act
    else:  # "swiglu_clamped"
        g = tl.minimum(gate, limit)
        u = tl.minimum(tl.maximum(up, -limit), limit)
        sig = tl.sigmoid(alpha * g)
        glu = g * sig
        d_glu = sig * (1.0 + alpha * g * (1.0 - sig))
        dh_dgate = tl.where(gate <= limit, (u + 1.0) * d_glu, 0.0)
        dh_dup = tl.where((up >= -limit) & (up <= limit), glu, 0.0)
        return (u + 1.0) * glu, dh_dgate, dh_dup


@triton.jit
def _gu_row(cols, d_ff, INTERLEAVED: tl.constexpr):
    """The gate_up weight row (and bias entry) of stacked pre-activation column ``cols`` (``[0, 2I)``: gate
    features then up features): itself, or with ``INTERLEAVED`` row ``2c`` for gate feature ``c`` and ``2c + 1``
    for up feature ``c``."""
    if INTERLEAVED:
        return tl.where(cols < d_ff, 2 * cols, 2 * (cols - d_ff) + 1)
    return cols


@triton.jit
def _row_tile(TILE_EXPERT, TILE_START, TILE_END, PAIR, W, stride_we, top_k, n_cols, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """This program's tile: ``(expert, sorted rows, row mask, pair ids, token ids, columns, column mask, the
    expert's weight matrix)``; expert is the number of experts (out of range) for a program past the last tile."""
    pid_m = tl.program_id(0)
    expert = tl.load(TILE_EXPERT + pid_m)
    start = tl.load(TILE_START + pid_m)
    end = tl.load(TILE_END + pid_m)
    rows = start + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    pairs = tl.load(PAIR + rows, mask=row_mask, other=0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return (expert, rows.to(tl.int64), row_mask, pairs.to(tl.int64), (pairs // top_k).to(tl.int64), cols,
            cols < n_cols, W + expert.to(tl.int64) * stride_we)


@triton.jit
def _up_kernel(X, W, BIAS, PRE, PAIR, TILE_EXPERT, TILE_START, TILE_END,
               stride_xt, stride_we, stride_wr, stride_wc, stride_be, stride_pr,
               n_experts, top_k, d_model, d_ff, alpha, limit, ACTIVATION: tl.constexpr,
               INTERLEAVED: tl.constexpr, HAS_BIAS: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``PRE[r] = [x_t @ gate[e]ᵀ, x_t @ up[e]ᵀ, h]`` (+ the gate_up bias) for one row tile x ``BLOCK_N`` columns of
    each third: ``h`` the gated unit (:func:`_glu`) of the two rounded pre-activations, formed here once in the
    epilogue, so the down projection and its weight gradient read it as a plain GEMM operand instead of recomputing
    it for every output tile."""
    expert, rows, row_mask, pairs, tokens, cols, col_mask, w_expert = _row_tile(
        TILE_EXPERT, TILE_START, TILE_END, PAIR, W, stride_we, top_k, d_ff, BLOCK_M, BLOCK_N)
    if expert >= n_experts:
        return
    # the weight rows this tile reads: stacked, BLOCK_N gate rows and BLOCK_N up rows d_ff apart (two dots);
    # interleaved, one contiguous slice of 2·BLOCK_N rows holding both (one dot into a [BLOCK_M, 2·BLOCK_N]
    # accumulator, gate / up columns alternating, split after the loop): vector loads either way
    if INTERLEAVED:
        w_rows = 2 * tl.program_id(1) * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        w_rows_mask = w_rows < 2 * d_ff
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
    else:
        acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, d_model, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < d_model
        # ---- load: the tile's token rows (gathered by token id) and the weight rows, transposed by pointer
        x = tl.load(X + tokens[:, None] * stride_xt + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        if INTERLEAVED:
            w = tl.load(w_expert + w_rows[None, :] * stride_wr + ks[:, None] * stride_wc,
                        mask=k_mask[:, None] & w_rows_mask[None, :], other=0.0)
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        else:
            w_mask = k_mask[:, None] & col_mask[None, :]
            w_gate = tl.load(w_expert + cols[None, :] * stride_wr + ks[:, None] * stride_wc, mask=w_mask, other=0.0)
            w_up = tl.load(w_expert + (cols + d_ff)[None, :] * stride_wr + ks[:, None] * stride_wc, mask=w_mask,
                           other=0.0)
            acc_gate = tl.dot(x, w_gate, acc_gate, input_precision=DOT_PRECISION)
            acc_up = tl.dot(x, w_up, acc_up, input_precision=DOT_PRECISION)
    # ---- the bias (rounded to the inputs' dtype first, as an eager ``x @ W + b`` adds two such tensors)
    if INTERLEAVED:
        if HAS_BIAS:
            b_expert = BIAS + expert.to(tl.int64) * stride_be
            acc = acc.to(PRE.dtype.element_ty).to(tl.float32) + tl.load(
                b_expert + w_rows, mask=w_rows_mask, other=0.0).to(tl.float32)[None, :]
        # (column 2c is feature c's gate, 2c + 1 its up: pairs along a new last axis, split into the halves)
        acc_gate, acc_up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
    elif HAS_BIAS:
        b_expert = BIAS + expert.to(tl.int64) * stride_be
        acc_gate = acc_gate.to(PRE.dtype.element_ty).to(tl.float32) + tl.load(
            b_expert + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        acc_up = acc_up.to(PRE.dtype.element_ty).to(tl.float32) + tl.load(
            b_expert + cols + d_ff, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    # ---- store both pre-activations and the gated unit of the rounded ones, in sorted row order (what the down
    # projection and the backward read)
    out = PRE + rows[:, None] * stride_pr + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    gate_r = acc_gate.to(PRE.dtype.element_ty)
    up_r = acc_up.to(PRE.dtype.element_ty)
    h, _, _ = _glu(gate_r.to(tl.float32), up_r.to(tl.float32), alpha, limit, ACTIVATION)
    tl.store(out, gate_r, mask=mask)
    tl.store(out + d_ff, up_r, mask=mask)
    tl.store(out + 2 * d_ff, h.to(PRE.dtype.element_ty), mask=mask)


@triton.jit
def _down_kernel(PRE, W, BIAS, WEIGHTS, Y, PAIR, TILE_EXPERT, TILE_START, TILE_END,
                 stride_pr, stride_we, stride_wr, stride_wc, stride_be, stride_yp,
                 n_experts, top_k, d_model, d_ff, HAS_BIAS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``Y[p] = w[p] · (h @ down[e]ᵀ [+ down_bias[e]])`` with ``h`` the gated unit the up projection stored (the
    last third of ``PRE``'s row), for one row tile x ``BLOCK_N`` model columns: a plain grouped GEMM."""
    expert, rows, row_mask, pairs, tokens, cols, col_mask, w_expert = _row_tile(
        TILE_EXPERT, TILE_START, TILE_END, PAIR, W, stride_we, top_k, d_model, BLOCK_M, BLOCK_N)
    if expert >= n_experts:
        return
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, d_ff, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < d_ff
        h = tl.load(PRE + rows[:, None] * stride_pr + 2 * d_ff + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_down = tl.load(w_expert + cols[None, :] * stride_wr + ks[:, None] * stride_wc,
                         mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        # (h was rounded to the weights' dtype when stored, as an eager bf16 FFN rounds it before the matmul)
        acc = tl.dot(h, w_down, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:  # inside the expert, before its routing weight (rounded like an eager ``h @ W + b``)
        acc = acc.to(Y.dtype.element_ty).to(tl.float32) + tl.load(
            BIAS + expert.to(tl.int64) * stride_be + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    weight = tl.load(WEIGHTS + pairs, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(Y + pairs[:, None] * stride_yp + cols[None, :], (acc * weight[:, None]).to(Y.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _down_bwd_kernel(DOUT, W, BIAS, PRE, WEIGHTS, DPRE, DW_PART, PAIR, TILE_EXPERT, TILE_START, TILE_END,
                     stride_dt, stride_we, stride_wr, stride_wc, stride_be, stride_pr, stride_dpr, n_pairs,
                     n_experts, top_k, d_model, d_ff, alpha, limit, ACTIVATION: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """For one row tile x ``BLOCK_N`` FFN columns: ``g = dout_t @ down[e]``; the routing weight's gradient share
    ``Σ_cols g · h`` (one partial per column tile, summed by the launcher; the first column tile also adds
    ``dout_t · down_bias[e]``); ``dPRE = w·g`` through the gated unit."""
    expert, rows, row_mask, pairs, tokens, cols, col_mask, w_expert = _row_tile(
        TILE_EXPERT, TILE_START, TILE_END, PAIR, W, stride_we, top_k, d_ff, BLOCK_M, BLOCK_N)
    if expert >= n_experts:
        return
    pid_n = tl.program_id(1)
    g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    bias_dot = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, d_model, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < d_model
        dout = tl.load(DOUT + tokens[:, None] * stride_dt + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                       other=0.0)
        w_down = tl.load(w_expert + ks[:, None] * stride_wr + cols[None, :] * stride_wc,
                         mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        g = tl.dot(dout.to(w_down.dtype), w_down, g, input_precision=DOT_PRECISION)
        if HAS_BIAS:  # (every column tile loads dout anyway; only the first one's sum is kept)
            bias = tl.load(BIAS + expert.to(tl.int64) * stride_be + ks, mask=k_mask, other=0.0).to(tl.float32)
            bias_dot += tl.sum(dout.to(tl.float32) * bias[None, :], axis=1)
    # ---- epilogue: the gated unit's derivatives, from the saved pre-activations
    mask = row_mask[:, None] & col_mask[None, :]
    pre = PRE + rows[:, None] * stride_pr + cols[None, :]
    gate = tl.load(pre, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(pre + d_ff, mask=mask, other=0.0).to(tl.float32)
    h, dh_dgate, dh_dup = _glu(gate, up, alpha, limit, ACTIVATION)
    h = h.to(PRE.dtype.element_ty).to(tl.float32)  # the h the forward multiplied (rounded alike)
    share = tl.sum(g * h, axis=1)
    if HAS_BIAS:
        share += tl.where(pid_n == 0, bias_dot, 0.0)
    tl.store(DW_PART + pid_n * n_pairs + pairs, share, mask=row_mask)
    gw = g * tl.load(WEIGHTS + pairs, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    d_pre = DPRE + rows[:, None] * stride_dpr + cols[None, :]
    tl.store(d_pre, (gw * dh_dgate).to(DPRE.dtype.element_ty), mask=mask)
    tl.store(d_pre + d_ff, (gw * dh_dup).to(DPRE.dtype.element_ty), mask=mask)


@triton.jit
def _dx_kernel(DPRE, W, DXP, PAIR, TILE_EXPERT, TILE_START, TILE_END,
               stride_dpr, stride_we, stride_wr, stride_wc, stride_xp,
               n_experts, top_k, d_model, d_ff2, INTERLEAVED: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``DXP[p] = dPRE[r] @ gate_up[e]`` (``[2I] x [2I, H]``, each stacked column against its weight row) for one
    row tile x ``BLOCK_N`` model columns, on the pair's own row (the launcher sums a token's K rows)."""
    expert, rows, row_mask, pairs, tokens, cols, col_mask, w_expert = _row_tile(
        TILE_EXPERT, TILE_START, TILE_END, PAIR, W, stride_we, top_k, d_model, BLOCK_M, BLOCK_N)
    if expert >= n_experts:
        return
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if INTERLEAVED:
        # the weight's rows alternate gate / up: step over BLOCK_K contiguous rows (BLOCK_K / 2 features), and
        # interleave the matching gate and up columns of dPRE in registers to line up with them
        d_ff = d_ff2 // 2
        for f0 in range(0, d_ff, BLOCK_K // 2):
            fs = f0 + tl.arange(0, BLOCK_K // 2)
            f_mask = row_mask[:, None] & (fs < d_ff)[None, :]
            d_pre_row = DPRE + rows[:, None] * stride_dpr + fs[None, :]
            d_gate = tl.load(d_pre_row, mask=f_mask, other=0.0)
            d_up = tl.load(d_pre_row + d_ff, mask=f_mask, other=0.0)
            d_pre = tl.reshape(tl.join(d_gate, d_up), [BLOCK_M, BLOCK_K])
            w_rows = 2 * f0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_expert + w_rows[:, None] * stride_wr + cols[None, :] * stride_wc,
                        mask=(w_rows < d_ff2)[:, None] & col_mask[None, :], other=0.0)
            acc = tl.dot(d_pre, w, acc, input_precision=DOT_PRECISION)
    else:
        for k0 in range(0, d_ff2, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < d_ff2
            d_pre = tl.load(DPRE + rows[:, None] * stride_dpr + ks[None, :],
                            mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_expert + ks[:, None] * stride_wr + cols[None, :] * stride_wc,
                        mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            acc = tl.dot(d_pre, w, acc, input_precision=DOT_PRECISION)
    tl.store(DXP + pairs[:, None] * stride_xp + cols[None, :], acc.to(DXP.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _weight_grad_kernel(A, B, WEIGHTS, DW, PAIR, EXPERT_START,
                        stride_a, stride_b, stride_de, stride_dr, stride_dc, top_k, n_rows_out, n_cols_out, d_ff,
                        alpha, limit, DOWN: tl.constexpr, ACTIVATION: tl.constexpr, INTERLEAVED: tl.constexpr,
                        ONES_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``DW[e][m, n] = Σ_r A_r[m] · B_r[n]`` over expert e's sorted rows, one program per (M tile, N tile, e).

    ``DOWN=False`` (``d gate_up``): ``A_r = dPRE[r]`` (``2I`` wide, stacked; with ``INTERLEAVED`` the output rows
    are the weight's interleaved ones), ``B_r = x_t``. ``DOWN=True`` (``d down``): ``A_r = w[p] · dout_t`` (``H``
    wide, formed once per sorted row by :func:`_scale_rows_kernel`, so no gradient tile gathers and scales it
    again), ``B_r = h`` (the gated unit the up projection stored in ``PRE[r]``). ``ONES_B`` (a bias gradient, ``n_cols_out`` 1): ``B_r = 1``,
    so ``DW[e][m, 0] = Σ_r A_r[m]``. Each element of a weight gradient is summed by one program, in row order:
    deterministic, no atomics."""
    pid_m, pid_n, expert = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(EXPERT_START + expert)
    end = tl.load(EXPERT_START + expert + 1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < n_rows_out
    n_mask = offs_n < n_cols_out
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        r_mask = rows < end
        pairs = tl.load(PAIR + rows, mask=r_mask, other=0).to(tl.int64)
        tokens = pairs // top_k
        rows = rows.to(tl.int64)
        b_mask = r_mask[:, None] & n_mask[None, :]
        if DOWN:
            # A: the sorted rows' w[p] · dout_t (:func:`_scale_rows_kernel`); B: h, the gated unit
            a = tl.load(A + rows[:, None] * stride_a + offs_m[None, :], mask=r_mask[:, None] & m_mask[None, :],
                        other=0.0)
            if ONES_B:
                b = tl.where(b_mask, 1.0, 0.0)
            else:  # (h, stored by the up projection: the last third of PRE's row)
                b = tl.load(B + rows[:, None] * stride_b + 2 * d_ff + offs_n[None, :], mask=b_mask, other=0.0)
            b = b.to(DW.dtype.element_ty)
        else:
            # A: dPRE rows; B: the tokens' input rows
            a = tl.load(A + rows[:, None] * stride_a + offs_m[None, :], mask=r_mask[:, None] & m_mask[None, :],
                        other=0.0)
            if ONES_B:
                b = tl.where(b_mask, 1.0, 0.0).to(a.dtype)
            else:
                b = tl.load(B + tokens[:, None] * stride_b + offs_n[None, :], mask=b_mask, other=0.0)
        acc = tl.dot(tl.trans(a), b, acc, input_precision=DOT_PRECISION)
    out_rows = offs_m if DOWN else _gu_row(offs_m, n_rows_out // 2, INTERLEAVED)
    out = DW + expert.to(tl.int64) * stride_de + out_rows[:, None] * stride_dr + offs_n[None, :] * stride_dc
    tl.store(out, acc.to(DW.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _scale_rows_kernel(DOUT, WEIGHTS, PAIR, OUT, stride_dt, stride_o, n_pairs, top_k, d_model,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """``OUT[r] = w[p] · dout_t`` for sorted row ``r`` (pair ``p = PAIR[r]``, token ``t = p // K``), in fp32 then
    rounded to ``OUT``'s dtype: the ``d down`` weight gradient's left operand, gathered and scaled once."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    r_mask = rows < n_pairs
    pairs = tl.load(PAIR + rows, mask=r_mask, other=0).to(tl.int64)
    tokens = pairs // top_k
    mask = r_mask[:, None] & (cols < d_model)[None, :]
    dout = tl.load(DOUT + tokens[:, None] * stride_dt + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(WEIGHTS + pairs, mask=r_mask, other=0.0).to(tl.float32)
    tl.store(OUT + rows.to(tl.int64)[:, None] * stride_o + cols[None, :], (dout * weight[:, None])
             .to(OUT.dtype.element_ty), mask=mask)
