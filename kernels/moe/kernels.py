"""Mixture-of-experts grouped GEMMs (Triton ``@jit`` code only; launched from :mod:`.launch`).

Rows are the ``T·K`` (token, slot) pairs sorted by expert (:mod:`.routing`). A row-tile program owns up to
``BLOCK_M`` consecutive sorted rows of one expert, read from the tile map (``TILE_EXPERT``, ``TILE_START``,
``TILE_END``); a program past the last tile (the grid is a bound, not a count) returns at once. A row's pair index
``p = t·K + k`` names its token ``t = p // K`` and its routing weight ``w[p]``. Token rows are gathered by pointer
(never copied into a ``[T·K, H]`` matrix), and a pair's result lands on its own row of a ``[T·K, H]`` buffer that
the launcher sums over K (deterministic).

Weight layouts are transformers 5's stacked ones: ``gate_up [E, 2I, H]`` (gate rows, then up rows) and
``down [E, H, I]``; every kernel reads them through strides, as stored.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: sqrt(2 / pi), for the tanh approximation of GELU
_SQRT_2_OVER_PI = 0.7978845608028654


@triton.jit
def _activation(gate, ACTIVATION: tl.constexpr):
    """``(act(gate), act'(gate))`` in fp32: SiLU ``g·σ(g)`` or tanh-approximate GELU."""
    if ACTIVATION == "silu":
        sig = tl.sigmoid(gate)
        act = gate * sig
        return act, sig * (1.0 + gate * (1.0 - sig))
    else:
        inner = _SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        th = 2.0 * tl.sigmoid(2.0 * inner) - 1.0  # tanh(inner), from the sigmoid (no tanh in every libdevice)
        d_inner = _SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * gate * gate)
        return 0.5 * gate * (1.0 + th), 0.5 * (1.0 + th) + 0.5 * gate * (1.0 - th * th) * d_inner


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
def _up_kernel(X, W, PRE, PAIR, TILE_EXPERT, TILE_START, TILE_END,
               stride_xt, stride_we, stride_wr, stride_wc, stride_pr,
               n_experts, top_k, d_model, d_ff,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``PRE[r] = [x_t @ gate[e]ᵀ, x_t @ up[e]ᵀ]`` for one row tile x ``BLOCK_N`` columns of each half."""
    expert, rows, row_mask, pairs, tokens, cols, col_mask, w_expert = _row_tile(
        TILE_EXPERT, TILE_START, TILE_END, PAIR, W, stride_we, top_k, d_ff, BLOCK_M, BLOCK_N)
    if expert >= n_experts:
        return
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, d_model, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < d_model
        # ---- load: the tile's token rows (gathered by token id) and both weight halves, transposed by pointer
        x = tl.load(X + tokens[:, None] * stride_xt + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w_mask = k_mask[:, None] & col_mask[None, :]
        w_gate = tl.load(w_expert + cols[None, :] * stride_wr + ks[:, None] * stride_wc, mask=w_mask, other=0.0)
        w_up = tl.load(w_expert + (cols + d_ff)[None, :] * stride_wr + ks[:, None] * stride_wc, mask=w_mask,
                       other=0.0)
        # ---- compute
        acc_gate = tl.dot(x, w_gate, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(x, w_up, acc_up, input_precision=DOT_PRECISION)
    # ---- store both pre-activations, in sorted row order (what the down projection and the backward read)
    out = PRE + rows[:, None] * stride_pr + cols[None, :]
    mask = row_mask[:, None] & col_mask[None, :]
    tl.store(out, acc_gate.to(PRE.dtype.element_ty), mask=mask)
    tl.store(out + d_ff, acc_up.to(PRE.dtype.element_ty), mask=mask)


@triton.jit
def _down_kernel(PRE, W, WEIGHTS, Y, PAIR, TILE_EXPERT, TILE_START, TILE_END,
                 stride_pr, stride_we, stride_wr, stride_wc, stride_yp,
                 n_experts, top_k, d_model, d_ff, ACTIVATION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``Y[p] = w[p] · (act(gate) * up) @ down[e]ᵀ`` for one row tile x ``BLOCK_N`` model columns; ``act(gate) *
    up`` is formed on load from the saved pre-activations (never stored)."""
    expert, rows, row_mask, pairs, tokens, cols, col_mask, w_expert = _row_tile(
        TILE_EXPERT, TILE_START, TILE_END, PAIR, W, stride_we, top_k, d_model, BLOCK_M, BLOCK_N)
    if expert >= n_experts:
        return
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, d_ff, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < d_ff
        a_mask = row_mask[:, None] & k_mask[None, :]
        pre = PRE + rows[:, None] * stride_pr + ks[None, :]
        gate = tl.load(pre, mask=a_mask, other=0.0).to(tl.float32)
        up = tl.load(pre + d_ff, mask=a_mask, other=0.0).to(tl.float32)
        act, _ = _activation(gate, ACTIVATION)
        w_down = tl.load(w_expert + cols[None, :] * stride_wr + ks[:, None] * stride_wc,
                         mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        # (the product rounds to the weights' dtype before the matmul, as an eager bf16 FFN does)
        acc = tl.dot((act * up).to(w_down.dtype), w_down, acc, input_precision=DOT_PRECISION)
    weight = tl.load(WEIGHTS + pairs, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(Y + pairs[:, None] * stride_yp + cols[None, :], (acc * weight[:, None]).to(Y.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _down_bwd_kernel(DOUT, W, PRE, WEIGHTS, DPRE, DW_PART, PAIR, TILE_EXPERT, TILE_START, TILE_END,
                     stride_dt, stride_we, stride_wr, stride_wc, stride_pr, stride_dpr, n_pairs,
                     n_experts, top_k, d_model, d_ff, ACTIVATION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """For one row tile x ``BLOCK_N`` FFN columns: ``g = dout_t @ down[e]``; the routing weight's gradient share
    ``Σ_cols g · h`` (one partial per column tile, summed by the launcher); ``dPRE = w·g`` through the gate."""
    expert, rows, row_mask, pairs, tokens, cols, col_mask, w_expert = _row_tile(
        TILE_EXPERT, TILE_START, TILE_END, PAIR, W, stride_we, top_k, d_ff, BLOCK_M, BLOCK_N)
    if expert >= n_experts:
        return
    pid_n = tl.program_id(1)
    g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, d_model, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < d_model
        dout = tl.load(DOUT + tokens[:, None] * stride_dt + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                       other=0.0)
        w_down = tl.load(w_expert + ks[:, None] * stride_wr + cols[None, :] * stride_wc,
                         mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        g = tl.dot(dout.to(w_down.dtype), w_down, g, input_precision=DOT_PRECISION)
    # ---- epilogue: the gate's derivative, from the saved pre-activations
    mask = row_mask[:, None] & col_mask[None, :]
    pre = PRE + rows[:, None] * stride_pr + cols[None, :]
    gate = tl.load(pre, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(pre + d_ff, mask=mask, other=0.0).to(tl.float32)
    act, d_act = _activation(gate, ACTIVATION)
    h = (act * up).to(PRE.dtype.element_ty).to(tl.float32)  # the h the forward multiplied (rounded alike)
    tl.store(DW_PART + pid_n * n_pairs + pairs, tl.sum(g * h, axis=1), mask=row_mask)
    gw = g * tl.load(WEIGHTS + pairs, mask=row_mask, other=0.0).to(tl.float32)[:, None]
    d_pre = DPRE + rows[:, None] * stride_dpr + cols[None, :]
    tl.store(d_pre, (gw * up * d_act).to(DPRE.dtype.element_ty), mask=mask)
    tl.store(d_pre + d_ff, (gw * act).to(DPRE.dtype.element_ty), mask=mask)


@triton.jit
def _dx_kernel(DPRE, W, DXP, PAIR, TILE_EXPERT, TILE_START, TILE_END,
               stride_dpr, stride_we, stride_wr, stride_wc, stride_xp,
               n_experts, top_k, d_model, d_ff2,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``DXP[p] = dPRE[r] @ gate_up[e]`` (``[2I] x [2I, H]``) for one row tile x ``BLOCK_N`` model columns, on the
    pair's own row (the launcher sums a token's K rows)."""
    expert, rows, row_mask, pairs, tokens, cols, col_mask, w_expert = _row_tile(
        TILE_EXPERT, TILE_START, TILE_END, PAIR, W, stride_we, top_k, d_model, BLOCK_M, BLOCK_N)
    if expert >= n_experts:
        return
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, d_ff2, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < d_ff2
        d_pre = tl.load(DPRE + rows[:, None] * stride_dpr + ks[None, :], mask=row_mask[:, None] & k_mask[None, :],
                        other=0.0)
        w = tl.load(w_expert + ks[:, None] * stride_wr + cols[None, :] * stride_wc,
                    mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(d_pre, w, acc, input_precision=DOT_PRECISION)
    tl.store(DXP + pairs[:, None] * stride_xp + cols[None, :], acc.to(DXP.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _weight_grad_kernel(A, B, WEIGHTS, DW, PAIR, EXPERT_START,
                        stride_a, stride_b, stride_de, stride_dr, stride_dc, top_k, n_rows_out, n_cols_out, d_ff,
                        DOWN: tl.constexpr, ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``DW[e][m, n] = Σ_r A_r[m] · B_r[n]`` over expert e's sorted rows, one program per (M tile, N tile, e).

    ``DOWN=False`` (``d gate_up``): ``A_r = dPRE[r]`` (``2I`` wide), ``B_r = x_t``. ``DOWN=True`` (``d down``):
    ``A_r = w[p] · dout_t`` (``H`` wide), ``B_r = act(gate) * up`` formed from ``PRE[r]``. Each element of a
    weight gradient is summed by one program, in row order: deterministic, no atomics."""
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
        if DOWN:
            # A: dout rows of the tokens, times their routing weights; B: h = act(gate) * up
            a = tl.load(A + tokens[:, None] * stride_a + offs_m[None, :], mask=r_mask[:, None] & m_mask[None, :],
                        other=0.0).to(tl.float32)
            a = a * tl.load(WEIGHTS + pairs, mask=r_mask, other=0.0).to(tl.float32)[:, None]
            b_mask = r_mask[:, None] & n_mask[None, :]
            pre = B + rows[:, None] * stride_b + offs_n[None, :]
            gate = tl.load(pre, mask=b_mask, other=0.0).to(tl.float32)
            act, _ = _activation(gate, ACTIVATION)
            b = act * tl.load(pre + d_ff, mask=b_mask, other=0.0).to(tl.float32)
            b = b.to(B.dtype.element_ty)
            a = a.to(B.dtype.element_ty)
        else:
            # A: dPRE rows; B: the tokens' input rows
            a = tl.load(A + rows[:, None] * stride_a + offs_m[None, :], mask=r_mask[:, None] & m_mask[None, :],
                        other=0.0)
            b = tl.load(B + tokens[:, None] * stride_b + offs_n[None, :], mask=r_mask[:, None] & n_mask[None, :],
                        other=0.0)
        acc = tl.dot(tl.trans(a), b, acc, input_precision=DOT_PRECISION)
    out = DW + expert.to(tl.int64) * stride_de + offs_m[:, None] * stride_dr + offs_n[None, :] * stride_dc
    tl.store(out, acc.to(DW.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
