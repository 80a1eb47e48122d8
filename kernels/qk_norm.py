"""q/k RMSNorm of an attention layer in one launch: ``y_q = rmsnorm(q) · w_q`` and ``y_k = rmsnorm(k) · w_k``.

Qwen3 and Gemma 3 normalise each head's q and k over ``head_dim`` (``q[..., head_dim]``), OLMo 2 the whole q and k
projections (``q[..., heads · head_dim]``); the q and k rows may differ in count and width. Two ``rms_norm`` calls
cost two forward launches and four backward ones (two row kernels, two weight reductions); here the programs of
one launch take the q rows first and then the k rows, and the backward is one row kernel (both inputs, both
weight-gradient partials) plus one reduction per weight. Same maths and casting as :mod:`.rmsnorm` (fp32, the
weight multiply in fp32, ``W_OFFSET`` for Gemma's ``1 + w``); rows are held in registers, so widths up to
``MAX_QK_COLS`` (wider rows are two :func:`~.rmsnorm.rms_norm` calls).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common
from ._common import as_rows, first_order_backward, next_pow2, use_custom_op
from ._ranges import kernel_range
from .rmsnorm import _column_sum_config, _column_sum_kernel, _offset, _row_block_bwd, rms_norm

#: widest row (q or k) kept whole in registers by both kernels (the backward holds x, dy and products)
MAX_QK_COLS = 8192
TILE_ELEMENTS = 4096  # rows per program: BLOCK_M x BLOCK_N ~ this


# ----------------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _qk_norm_fwd_kernel(
    Q, K, WQ, WK, YQ, YK, RSTD,
    stride_q_row, stride_k_row, n_q_rows, n_k_rows, n_q_cols, n_k_cols, q_programs, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, W_OFFSET: tl.constexpr,
):
    # ---- which rows: programs [0, q_programs) take BLOCK_M rows of q each, the rest BLOCK_M rows of k;
    # RSTD holds q's rows then k's
    pid = tl.program_id(0)
    if pid < q_programs:
        X, W, Y, stride_row, n_rows, n_cols, first = Q, WQ, YQ, stride_q_row, n_q_rows, n_q_cols, pid * BLOCK_M
        rstd_rows = RSTD
    else:
        X, W, Y, stride_row, n_rows, n_cols = K, WK, YK, stride_k_row, n_k_rows, n_k_cols
        first = (pid - q_programs) * BLOCK_M
        rstd_rows = RSTD + n_q_rows
    rows = first + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols[None, :] < n_cols)
    rows64 = rows[:, None].to(tl.int64)
    # ---- load
    x = tl.load(X + rows64 * stride_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # (the weight read as a whole [BLOCK_M, BLOCK_N] tile, every row the same: it then has x's layout, each thread
    # reading its own columns in 128-bit loads from L1; a 1-D weight at head_dim 128 is one element per thread, a
    # 16-bit load and a layout conversion through shared memory -- SASS report)
    w = _offset(tl.load(W + (cols[None, :] + 0 * rows[:, None]), mask=mask, other=0.0).to(tl.float32), W_OFFSET)
    # ---- compute
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    y = x * rstd[:, None] * w
    # ---- store (outputs contiguous: row stride n_cols)
    tl.store(Y + rows64 * n_cols + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(rstd_rows + rows, rstd, mask=row_mask)


@triton.jit
def _qk_rows_bwd(DY, X, W, RSTD, DX, dw_row, stride_dy_row, stride_x_row, n_rows, n_cols, pid, n_programs,
                 blocks, cols, W_OFFSET: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One input's share of a program: its row blocks ``pid, pid + P, ...`` (dx) and its weight-gradient
    partial row (``sum over rows of dy · x̂``, fp32)."""
    col_mask = cols < n_cols
    # (the weight as a whole tile in x's layout, as in the forward)
    w_tile = cols[None, :] + 0 * tl.arange(0, BLOCK_M)[:, None]
    w = _offset(tl.load(W + w_tile, mask=(w_tile < n_cols), other=0.0).to(tl.float32), W_OFFSET)
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for i in range(0, blocks):
        rows = (pid + i * n_programs) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows[:, None].to(tl.int64)
        # ---- load and dx (rmsnorm's row-block backward)
        x, dy, rstd, dx = _row_block_bwd(X, DY, RSTD, w, rows, rows64, row_mask, mask, cols, stride_x_row,
                                         stride_dy_row, n_cols)
        dw_acc += tl.sum(dy * x * rstd[:, None], axis=0)
        # ---- store
        tl.store(DX + rows64 * n_cols + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(dw_row + cols, dw_acc, mask=col_mask)


@triton.jit
def _qk_norm_bwd_kernel(
    DYQ, DYK, Q, K, WQ, WK, RSTD, DQ, DK, DWQ_PARTIAL, DWK_PARTIAL,
    stride_dyq_row, stride_dyk_row, stride_q_row, stride_k_row, n_q_rows, n_k_rows, n_q_cols, n_k_cols,
    q_blocks_per_program, k_blocks_per_program,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, W_OFFSET: tl.constexpr,
):
    # grid-stride: program p takes q row blocks p, p + P, ..., then k row blocks p, p + P, ..., and owns row p of
    # both weight-gradient partial buffers (summed in a fixed order afterwards: deterministic)
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    _qk_rows_bwd(DYQ, Q, WQ, RSTD, DQ, DWQ_PARTIAL + pid.to(tl.int64) * n_q_cols, stride_dyq_row, stride_q_row,
                 n_q_rows, n_q_cols, pid, n_programs, q_blocks_per_program, cols, W_OFFSET, BLOCK_M, BLOCK_N)
    _qk_rows_bwd(DYK, K, WK, RSTD + n_q_rows, DK, DWK_PARTIAL + pid.to(tl.int64) * n_k_cols, stride_dyk_row,
                 stride_k_row, n_k_rows, n_k_cols, pid, n_programs, k_blocks_per_program, cols, W_OFFSET, BLOCK_M,
                 BLOCK_N)


# ----------------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------------
def _launch_config(n_cols: int) -> dict:
    """One tile shape for both inputs: the wider row's power of two, ~4K elements per program, a warp per 512."""
    block_n = next_pow2(n_cols)
    block_m = max(1, min(16, TILE_ELEMENTS // block_n))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=max(4, min(16, block_m * block_n // 512)))


def qk_norm_forward(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                    weight_offset: float = 0.0):
    """Returns ``(y_q, y_k, rstd)``: outputs like q and k (contiguous), rstd fp32 ``[q rows + k rows]``."""
    q_rows, k_rows = as_rows(q), as_rows(k)
    y_q = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    y_k = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    rstd = torch.empty(q_rows.shape[0] + k_rows.shape[0], dtype=torch.float32, device=q.device)
    cfg = _launch_config(max(q_rows.shape[1], k_rows.shape[1]))
    q_programs = triton.cdiv(q_rows.shape[0], cfg["BLOCK_M"])
    grid = (q_programs + triton.cdiv(k_rows.shape[0], cfg["BLOCK_M"]),)
    if grid[0]:
        _qk_norm_fwd_kernel[grid](q_rows, k_rows, q_weight, k_weight, y_q, y_k, rstd, q_rows.stride(0),
                                  k_rows.stride(0), q_rows.shape[0], k_rows.shape[0], q_rows.shape[1],
                                  k_rows.shape[1], q_programs, float(eps), W_OFFSET=float(weight_offset), **cfg)
    return y_q, y_k, rstd


def qk_norm_backward(dy_q, dy_k, q, k, q_weight, k_weight, rstd, weight_offset: float = 0.0):
    """Returns ``(dq, dk, dq_weight, dk_weight)``."""
    q_rows, k_rows, dyq_rows, dyk_rows = (as_rows(t) for t in (q, k, dy_q, dy_k))
    (n_q, q_cols), (n_k, k_cols) = q_rows.shape, k_rows.shape
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    cfg = _launch_config(max(q_cols, k_cols))
    q_blocks, k_blocks = triton.cdiv(n_q, cfg["BLOCK_M"]), triton.cdiv(n_k, cfg["BLOCK_M"])
    n_programs = _common.num_persistent_programs(q, max(q_blocks, k_blocks, 1))
    dwq_partial = torch.empty(n_programs, q_cols, dtype=torch.float32, device=q.device)
    dwk_partial = torch.empty(n_programs, k_cols, dtype=torch.float32, device=q.device)
    _qk_norm_bwd_kernel[(n_programs,)](
        dyq_rows, dyk_rows, q_rows, k_rows, q_weight, k_weight, rstd, dq, dk, dwq_partial, dwk_partial,
        dyq_rows.stride(0), dyk_rows.stride(0), q_rows.stride(0), k_rows.stride(0), n_q, n_k, q_cols, k_cols,
        triton.cdiv(q_blocks, n_programs), triton.cdiv(k_blocks, n_programs), W_OFFSET=float(weight_offset), **cfg)
    grads = []
    for partial, weight in ((dwq_partial, q_weight), (dwk_partial, k_weight)):
        out = torch.empty(weight.shape[0], dtype=weight.dtype, device=weight.device)
        sum_cfg = _column_sum_config(weight.shape[0])
        _column_sum_kernel[(triton.cdiv(weight.shape[0], sum_cfg["BLOCK_N"]),)](partial, out, n_programs,
                                                                                weight.shape[0], **sum_cfg)
        grads.append(out)
    return dq, dk, grads[0], grads[1]


# ----------------------------------------------------------------------------------------------------
# custom ops (opaque to torch.compile) and the autograd Function
# ----------------------------------------------------------------------------------------------------
@torch.library.custom_op("tritonlm::qk_norm_fwd", mutates_args=())
def _qk_norm_fwd_op(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                    weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return qk_norm_forward(q, k, q_weight, k_weight, eps, weight_offset)


@_qk_norm_fwd_op.register_fake
def _(q, k, q_weight, k_weight, eps, weight_offset=0.0):
    rows = q.numel() // max(1, q.shape[-1]) + k.numel() // max(1, k.shape[-1])
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format), q.new_empty(rows, dtype=torch.float32))


@torch.library.custom_op("tritonlm::qk_norm_bwd", mutates_args=())
def _qk_norm_bwd_op(dy_q: torch.Tensor, dy_k: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                    k_weight: torch.Tensor, rstd: torch.Tensor, weight_offset: float = 0.0
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return qk_norm_backward(dy_q, dy_k, q, k, q_weight, k_weight, rstd, weight_offset)


@_qk_norm_bwd_op.register_fake
def _(dy_q, dy_k, q, k, q_weight, k_weight, rstd, weight_offset=0.0):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format), torch.empty_like(q_weight),
            torch.empty_like(k_weight))


class QKNormFunction(torch.autograd.Function):
    """``(q, k, q_weight, k_weight, eps, weight_offset) -> (y_q, y_k)``; saves q, k, both weights and the fp32
    ``rstd`` of every row."""

    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, eps=1e-6, weight_offset=0.0):
        fwd = _qk_norm_fwd_op if use_custom_op(q) else qk_norm_forward
        with kernel_range("tritonlm::qk_norm_fwd"):
            y_q, y_k, rstd = fwd(q, k, q_weight, k_weight, eps, weight_offset)
        ctx.save_for_backward(q, k, q_weight, k_weight, rstd)
        ctx.weight_offset = weight_offset
        return y_q, y_k

    @staticmethod
    @first_order_backward
    def backward(ctx, dy_q, dy_k):
        q, k, q_weight, k_weight, rstd = ctx.saved_tensors
        bwd = _qk_norm_bwd_op if use_custom_op(q) else qk_norm_backward
        with kernel_range("tritonlm::qk_norm_bwd"):
            dq, dk, dwq, dwk = bwd(dy_q, dy_k, q, k, q_weight, k_weight, rstd, ctx.weight_offset)
        return dq, dk, dwq, dwk, None, None


def qk_rms_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                eps: float = 1e-6, *, weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``q[..., n_q]`` with ``q_weight[n_q]`` and of ``k[..., n_k]`` with ``k_weight[n_k]`` in one launch
    (module docstring); returns ``(q_normed, k_normed)`` in the inputs' dtype. ``weight_offset`` as in
    :func:`~.rmsnorm.rms_norm` (Gemma 3's ``1 + w``). Rows wider than ``MAX_QK_COLS`` run as two ``rms_norm``
    calls."""
    for name, x, w in (("q", q, q_weight), ("k", k, k_weight)):
        if w.dim() != 1 or x.dim() == 0 or x.shape[-1] != w.shape[0]:
            raise ValueError(f"qk_rms_norm: {name} must be [..., {w.shape[0] if w.dim() == 1 else 'n'}] with a 1-D "
                             f"weight, got {tuple(x.shape)} and {tuple(w.shape)}")
    _common.check_float("qk_rms_norm", q, k, q_weight, k_weight)
    if not (q.dtype == k.dtype == q_weight.dtype == k_weight.dtype):
        raise TypeError(f"qk_rms_norm: q, k and the weights must share a dtype, got {q.dtype}, {k.dtype}, "
                        f"{q_weight.dtype}, {k_weight.dtype}")
    _common.check_device("qk_rms_norm", q, k, q_weight, k_weight)
    if max(q.shape[-1], k.shape[-1]) > MAX_QK_COLS:
        return (rms_norm(q, q_weight, eps, weight_offset=weight_offset),
                rms_norm(k, k_weight, eps, weight_offset=weight_offset))
    return QKNormFunction.apply(q, k, q_weight, k_weight, float(eps), float(weight_offset))
