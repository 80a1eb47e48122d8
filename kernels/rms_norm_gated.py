"""Gated RMSNorm (Qwen3.5 / Qwen3-Next's norm before the gate of a linear-attention layer), forward and backward in one
kernel each: ``y = (w · x̂) · silu(g)`` with ``x̂ = x / sqrt(mean(x²) + eps)`` per row.

Casting as transformers' ``Qwen3NextRMSNormGated``: ``x̂`` in fp32, rounded to x's dtype; ``w · x̂`` in the promoted
dtype of the weight and x (rounded to it when both are 16-bit); then times ``silu(g)`` taken in fp32, and the
product rounded to x's dtype. The backward treats the roundings as identities (as autograd does through casts) and
computes in fp32::

    dz = dy · silu(g)            (z = w · x̂)
    dg = dy · z · σ(g)(1 + g(1 - σ(g)))
    dw = Σ_rows dz · x̂,          dx = rstd · (dz·w - x̂ · mean(dz·w · x̂))

Rows (``[..., n]``, any leading dims; ``g`` the same shape) are held in registers, ``BLOCK_M`` rows per program
(~4K elements a tile), up to ``MAX_COLS`` wide. The weight gradient is one fp32 partial row per program, summed by
the RMSNorm column-sum kernel: deterministic, no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import as_rows, check_device, check_float, first_order_backward, next_pow2, use_custom_op
from ._ranges import kernel_range
from .rmsnorm import _column_sum_config, _column_sum_kernel

#: widest row kept whole in registers (Qwen3.5 normalises each value head: 128 features)
MAX_COLS = 8192
TILE_ELEMENTS = 4096


# ----------------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _silu_terms(g):
    """``(silu(g), d silu / dg)`` in fp32."""
    sig = 1.0 / (1.0 + tl.exp(-g))
    return g * sig, sig * (1.0 + g * (1.0 - sig))


@triton.jit
def _gated_fwd_kernel(X, G, W, Y, RSTD, stride_x, stride_g, stride_y, n_rows, n_cols, eps,
                      ROUND_WX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # ---- load BLOCK_M rows of x and g, the weight once
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols[None, :] < n_cols)
    rows64 = rows[:, None].to(tl.int64)
    x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
    g = tl.load(G + rows64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # (the weight read as a [BLOCK_M, BLOCK_N] tile, every row the same, so it has x's layout: 128-bit loads from L1
    # instead of a 16-bit load and a layout conversion, as in qk_norm)
    w = tl.load(W + (cols[None, :] + 0 * rows[:, None]), mask=mask, other=0.0).to(tl.float32)
    # ---- norm (x̂ rounded to x's dtype), weight (rounded where both are 16-bit), gate in fp32, round once
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / n_cols + eps)
    z = (xf * rstd[:, None]).to(x.dtype).to(tl.float32) * w
    if ROUND_WX:
        z = z.to(x.dtype).to(tl.float32)
    silu_g, _ = _silu_terms(g)
    tl.store(Y + rows64 * stride_y + cols[None, :], (z * silu_g).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _gated_bwd_kernel(DY, X, G, W, RSTD, DX, DG, DW_PARTIAL, stride_dy, stride_x, stride_g, stride_dx, stride_dg,
                      n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # ---- load the rows, their rstd and the weight
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows[:, None].to(tl.int64)
    dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + rows64 * stride_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + (cols[None, :] + 0 * rows[:, None]), mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    # ---- the gate's gradient, then the norm's (module docstring)
    xhat = x * rstd[:, None]
    silu_g, dsilu = _silu_terms(g)
    dg = dy * (xhat * w) * dsilu
    dz = dy * silu_g
    dxhat = dz * w
    dx = rstd[:, None] * (dxhat - xhat * (tl.sum(dxhat * xhat, axis=1) / n_cols)[:, None])
    tl.store(DX + rows64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    tl.store(DG + rows64 * stride_dg + cols[None, :], dg.to(DG.dtype.element_ty), mask=mask)
    # ---- this program's share of the weight gradient (padding rows load as zero)
    tl.store(DW_PARTIAL + pid.to(tl.int64) * n_cols + cols, tl.sum(dz * xhat, axis=0), mask=col_mask)


# ----------------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------------
def _launch_config(n_cols: int) -> dict:
    """Whole rows in registers, ~4K elements a tile, one warp per 512 of them (4 to 16)."""
    block_n = next_pow2(n_cols)
    block_m = max(1, min(16, TILE_ELEMENTS // block_n))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=max(4, min(16, block_m * block_n // 512)))


def rms_norm_gated_forward(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float):
    """Returns ``(y, rstd)``: ``y`` like x (contiguous), ``rstd`` fp32 per row."""
    x_rows, g_rows = as_rows(x), as_rows(gate)
    n_rows, n_cols = x_rows.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows:
        cfg = _launch_config(n_cols)
        round_wx = torch.promote_types(weight.dtype, x.dtype) != torch.float32
        _gated_fwd_kernel[(triton.cdiv(n_rows, cfg["BLOCK_M"]),)](
            x_rows, g_rows, weight, y, rstd, x_rows.stride(0), g_rows.stride(0), n_cols, n_rows, n_cols, float(eps),
            ROUND_WX=round_wx, **cfg)
    return y, rstd


def rms_norm_gated_backward(dy: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                            rstd: torch.Tensor):
    """Returns ``(dx, dgate, dweight)`` laid out like x, gate (contiguous) and the weight."""
    dy_rows, x_rows, g_rows = as_rows(dy), as_rows(x), as_rows(gate)
    n_rows, n_cols = x_rows.shape
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dg = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    cfg = _launch_config(n_cols)
    programs = triton.cdiv(n_rows, cfg["BLOCK_M"])
    # every program writes its whole partial row (no rows: one zero row for the column sum)
    partial = (torch.empty if n_rows else torch.zeros)((max(programs, 1), n_cols), dtype=torch.float32,
                                                        device=x.device)
    if n_rows:
        _gated_bwd_kernel[(programs,)](
            dy_rows, x_rows, g_rows, weight, rstd, dx, dg, partial, dy_rows.stride(0), x_rows.stride(0),
            g_rows.stride(0), n_cols, n_cols, n_rows, n_cols, **cfg)
    dweight = torch.empty(n_cols, dtype=weight.dtype, device=weight.device)
    sum_cfg = _column_sum_config(n_cols)
    _column_sum_kernel[(triton.cdiv(n_cols, sum_cfg["BLOCK_N"]),)](partial, dweight, partial.shape[0], n_cols,
                                                                    **sum_cfg)
    return dx, dg, dweight


# ----------------------------------------------------------------------------------------------------
# custom ops (opaque to torch.compile) and the autograd Function
# ----------------------------------------------------------------------------------------------------
@torch.library.custom_op("tritonlm::rms_norm_gated_fwd", mutates_args=())
def _gated_fwd_op(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_gated_forward(x, gate, weight, eps)


@_gated_fwd_op.register_fake
def _(x, gate, weight, eps):
    rows = x.numel() // max(1, x.shape[-1])
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("tritonlm::rms_norm_gated_bwd", mutates_args=())
def _gated_bwd_op(dy: torch.Tensor, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                  rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return rms_norm_gated_backward(dy, x, gate, weight, rstd)


@_gated_bwd_op.register_fake
def _(dy, x, gate, weight, rstd):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            torch.empty_like(gate, memory_format=torch.contiguous_format), torch.empty_like(weight))


class RMSNormGatedFunction(torch.autograd.Function):
    """``(x, gate, weight, eps) -> y``; saves x, the gate, the weight and the fp32 ``rstd`` of every row."""

    @staticmethod
    def forward(ctx, x, gate, weight, eps=1e-6):
        fwd = _gated_fwd_op if use_custom_op(x) else rms_norm_gated_forward
        with kernel_range("tritonlm::rms_norm_gated_fwd"):
            y, rstd = fwd(x, gate, weight, eps)
        ctx.save_for_backward(x, gate, weight, rstd)
        return y

    @staticmethod
    @first_order_backward
    def backward(ctx, dy):
        x, gate, weight, rstd = ctx.saved_tensors
        bwd = _gated_bwd_op if use_custom_op(x) else rms_norm_gated_backward
        with kernel_range("tritonlm::rms_norm_gated_bwd"):
            dx, dg, dw = bwd(dy, x, gate, weight, rstd)
        return dx, dg, dw, None


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``rmsnorm(x) · weight · silu(gate)`` over the last dim (module docstring): ``x, gate [..., n]``, ``weight
    [n]`` -> ``[..., n]`` in x's dtype. Differentiable in all three."""
    if weight.dim() != 1 or x.dim() == 0 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm_gated: x must be [..., {weight.shape[0] if weight.dim() == 1 else 'n'}] with a "
                         f"1-D weight, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if gate.shape != x.shape:
        raise ValueError(f"rms_norm_gated: gate {tuple(gate.shape)} must have x's shape {tuple(x.shape)}")
    check_float("rms_norm_gated", x, gate, weight)
    check_device("rms_norm_gated", x, gate, weight)
    if x.shape[-1] > MAX_COLS:
        raise ValueError(f"rms_norm_gated: rows of {x.shape[-1]} features are wider than the kernel's {MAX_COLS}")
    if not eps > 0:
        raise ValueError(f"rms_norm_gated: eps must be > 0, got {eps}")
    return RMSNormGatedFunction.apply(x, gate, weight, float(eps))
