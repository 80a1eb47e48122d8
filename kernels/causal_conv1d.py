"""Depthwise causal conv1d (the short convolution of Gated DeltaNet layers: Qwen3.5, Qwen3-Next), with the
causal-conv1d package's calls as transformers makes them::

    out[b, d, t] = act(bias[d] + Σ_k weight[d, k] · x[b, d, t - (W - 1) + k])      (x before t = 0 is zero)

``x [batch, D, T]`` with any strides (transformers passes the ``[batch, T, D]`` projection transposed),
``weight [D, W]``, ``bias [D]`` or None, ``activation`` None or ``"silu"``; ``seq_idx [batch, T]`` (int32) marks
packed documents: a tap from another document reads zero. Accumulation in fp32, the output in x's dtype.

Forward: one program per (time block, channel block, batch row), the ``W`` taps as shifted loads of the same rows.
Backward, two kernels: the first forms ``dz = dy · act'(z)`` (recomputing z) into an fp32 buffer; the second takes
``dx[s] = Σ_k weight[k] · dz[s + W - 1 - k]`` and this program's partial sums of ``dweight`` and ``dbias``, which one
``sum`` reduces in a fixed order (deterministic, no atomics). :func:`causal_conv1d_update` is the decoding step:
the state ``[batch, D, S]`` (``S >= W - 1``) and the new tokens convolved, the state's last ``S`` positions written
back in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, check_float, first_order_backward, use_custom_op
from ._ranges import kernel_range

BLOCK_T = 64
BLOCK_C = 32  # channels per program


# ----------------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _tap(X, SEQ, b, chans, times, c_mask, t_mask, k, stride_xb, stride_xc, stride_xt, stride_sb, n_taps,
         HAS_SEQ: tl.constexpr):
    """``x[b, chans, times - (W - 1) + k]`` as fp32 ``[BLOCK_C, BLOCK_T]``, zero before the sequence (or, with
    ``HAS_SEQ``, before the query time's document)."""
    src = times - (n_taps - 1) + k
    valid = t_mask & (src >= 0)
    if HAS_SEQ:
        here = tl.load(SEQ + b * stride_sb + times, mask=t_mask, other=-1)
        there = tl.load(SEQ + b * stride_sb + src, mask=valid, other=-2)
        valid = valid & (here == there)
    ptrs = X + b * stride_xb + chans[:, None].to(tl.int64) * stride_xc + src[None, :].to(tl.int64) * stride_xt
    return tl.load(ptrs, mask=c_mask[:, None] & valid[None, :], other=0.0).to(tl.float32)


@triton.jit
def _weight_taps(W, chans, c_mask, N_TAPS: tl.constexpr, TAPS_P2: tl.constexpr):
    """The program's ``[BLOCK_C, TAPS_P2]`` weight tile (fp32), each channel's taps one contiguous row: loaded once as
    vectors (a tap at a time would be one 16-bit load per channel and tap: SASS report)."""
    taps = tl.arange(0, TAPS_P2)
    return tl.load(W + chans[:, None] * N_TAPS + taps[None, :], mask=c_mask[:, None] & (taps[None, :] < N_TAPS),
                   other=0.0).to(tl.float32)


@triton.jit
def _column(tile, k, TAPS_P2: tl.constexpr):
    """Column ``k`` of a ``[rows, TAPS_P2]`` register tile."""
    return tl.sum(tl.where(tl.arange(0, TAPS_P2)[None, :] == k, tile, 0.0), axis=1)


@triton.jit
def _preactivation(X, W, BIAS, SEQ, b, chans, times, c_mask, t_mask, stride_xb, stride_xc, stride_xt, stride_sb,
                   N_TAPS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ: tl.constexpr, BLOCK_C: tl.constexpr,
                   BLOCK_T: tl.constexpr, TAPS_P2: tl.constexpr):
    z = tl.zeros([BLOCK_C, BLOCK_T], dtype=tl.float32)
    if HAS_BIAS:
        z += tl.load(BIAS + chans, mask=c_mask, other=0.0).to(tl.float32)[:, None]
    weights = _weight_taps(W, chans, c_mask, N_TAPS, TAPS_P2)
    for k in tl.static_range(N_TAPS):
        z += _column(weights, k, TAPS_P2)[:, None] * _tap(X, SEQ, b, chans, times, c_mask, t_mask, k, stride_xb, stride_xc, stride_xt,
                               stride_sb, N_TAPS, HAS_SEQ)
    return z


@triton.jit
def _program_block(n_chans, n_times, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr):
    """``(times, chans, b, t_mask, c_mask)`` of a program: grid axis 0 is the time block, 1 the channel block, 2 the
    batch row."""
    times = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    chans = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    return times, chans, tl.program_id(2).to(tl.int64), times < n_times, chans < n_chans


@triton.jit
def _conv_fwd_kernel(X, W, BIAS, SEQ, OUT, stride_xb, stride_xc, stride_xt, stride_ob, stride_oc, stride_ot,
                     stride_sb, n_chans, n_times, N_TAPS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     HAS_SEQ: tl.constexpr, SILU: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
                     TAPS_P2: tl.constexpr):
    times, chans, b, t_mask, c_mask = _program_block(n_chans, n_times, BLOCK_C, BLOCK_T)
    z = _preactivation(X, W, BIAS, SEQ, b, chans, times, c_mask, t_mask, stride_xb, stride_xc, stride_xt, stride_sb,
                       N_TAPS, HAS_BIAS, HAS_SEQ, BLOCK_C, BLOCK_T, TAPS_P2)
    if SILU:
        z = z / (1.0 + tl.exp(-z))
    out = OUT + b * stride_ob + chans[:, None].to(tl.int64) * stride_oc + times[None, :].to(tl.int64) * stride_ot
    tl.store(out, z.to(OUT.dtype.element_ty), mask=c_mask[:, None] & t_mask[None, :])


@triton.jit
def _conv_dz_kernel(DY, X, W, BIAS, SEQ, DZ, stride_dyb, stride_dyc, stride_dyt, stride_xb, stride_xc, stride_xt,
                    stride_sb, n_chans, n_times, N_TAPS: tl.constexpr, HAS_BIAS: tl.constexpr,
                    HAS_SEQ: tl.constexpr, SILU: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
                    TAPS_P2: tl.constexpr):
    """``dz = dy · act'(z)`` into a contiguous fp32 ``[batch, D, T]`` buffer (z recomputed)."""
    times, chans, b, t_mask, c_mask = _program_block(n_chans, n_times, BLOCK_C, BLOCK_T)
    mask = c_mask[:, None] & t_mask[None, :]
    dy = tl.load(DY + b * stride_dyb + chans[:, None].to(tl.int64) * stride_dyc
                 + times[None, :].to(tl.int64) * stride_dyt, mask=mask, other=0.0).to(tl.float32)
    if SILU:
        z = _preactivation(X, W, BIAS, SEQ, b, chans, times, c_mask, t_mask, stride_xb, stride_xc, stride_xt,
                           stride_sb, N_TAPS, HAS_BIAS, HAS_SEQ, BLOCK_C, BLOCK_T, TAPS_P2)
        sig = 1.0 / (1.0 + tl.exp(-z))
        dy = dy * sig * (1.0 + z * (1.0 - sig))
    tl.store(DZ + (b * n_chans + chans[:, None].to(tl.int64)) * n_times + times[None, :], dy, mask=mask)


@triton.jit
def _conv_dx_kernel(DZ, X, W, SEQ, DX, DW_PART, DB_PART, stride_xb, stride_xc, stride_xt, stride_dxb, stride_dxc,
                    stride_dxt, stride_sb, n_chans, n_times, N_TAPS: tl.constexpr, HAS_SEQ: tl.constexpr,
                    BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, TAPS_P2: tl.constexpr):
    """``dx[s] = Σ_k w[k] · dz[s + W - 1 - k]`` (where the tap is visible from that output) and this program's
    partial ``dweight [D, W]`` / ``dbias [D]`` sums over its time block."""
    pid_t = tl.program_id(0)
    times, chans, b, t_mask, c_mask = _program_block(n_chans, n_times, BLOCK_C, BLOCK_T)
    dz_rows = DZ + (b * n_chans + chans[:, None].to(tl.int64)) * n_times
    dx = tl.zeros([BLOCK_C, BLOCK_T], dtype=tl.float32)
    dz_t = tl.load(dz_rows + times[None, :], mask=c_mask[:, None] & t_mask[None, :], other=0.0)
    part = (b * tl.num_programs(0) + pid_t) * n_chans + chans
    weights = _weight_taps(W, chans, c_mask, N_TAPS, TAPS_P2)
    if HAS_SEQ:
        here = tl.load(SEQ + b * stride_sb + times, mask=t_mask, other=-1)
    for k in tl.static_range(N_TAPS):
        # the output at s + (W - 1 - k) read this position through tap k
        out_t = times + (N_TAPS - 1 - k)
        valid = t_mask & (out_t < n_times)
        if HAS_SEQ:
            valid = valid & (tl.load(SEQ + b * stride_sb + out_t, mask=valid, other=-2) == here)
        dz = tl.load(dz_rows + out_t[None, :], mask=c_mask[:, None] & valid[None, :], other=0.0)
        dx += _column(weights, k, TAPS_P2)[:, None] * dz
        # dweight[k]: Σ_t dz[t] · x[t - (W - 1) + k] over this block's output times t
        x_k = _tap(X, SEQ, b, chans, times, c_mask, t_mask, k, stride_xb, stride_xc, stride_xt, stride_sb, N_TAPS,
                   HAS_SEQ)
        tl.store(DW_PART + part * N_TAPS + k, tl.sum(dz_t * x_k, axis=1), mask=c_mask)
    tl.store(DB_PART + part, tl.sum(dz_t, axis=1), mask=c_mask)
    tl.store(DX + b * stride_dxb + chans[:, None].to(tl.int64) * stride_dxc + times[None, :].to(tl.int64) * stride_dxt,
             dx.to(DX.dtype.element_ty), mask=c_mask[:, None] & t_mask[None, :])


# ----------------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------------
def _grid(x: torch.Tensor):
    batch, chans, times = x.shape
    return (triton.cdiv(times, BLOCK_T), triton.cdiv(chans, BLOCK_C), batch)


def causal_conv1d_forward(x, weight, bias, seq_idx, silu: bool):
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel():
        _conv_fwd_kernel[_grid(x)](
            x, weight, bias if bias is not None else weight, seq_idx if seq_idx is not None else weight,
            out, *x.stride(), *out.stride(), seq_idx.stride(0) if seq_idx is not None else 0, x.shape[1], x.shape[2],
            N_TAPS=weight.shape[1], HAS_BIAS=bias is not None, HAS_SEQ=seq_idx is not None, SILU=silu,
            BLOCK_C=BLOCK_C, BLOCK_T=BLOCK_T, TAPS_P2=triton.next_power_of_2(weight.shape[1]))
    return out


def causal_conv1d_backward(dy, x, weight, bias, seq_idx, silu: bool):
    """Returns ``(dx, dweight, dbias or None)``."""
    batch, chans, times = x.shape
    grid = _grid(x)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dz = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    parts = batch * grid[0]
    # each (time block, batch row, channel) partial is written by exactly one program (none: zeros to sum)
    alloc = torch.empty if x.numel() else torch.zeros
    dw_part = alloc(max(parts, 1), chans, weight.shape[1], dtype=torch.float32, device=x.device)
    db_part = alloc(max(parts, 1), chans, dtype=torch.float32, device=x.device)
    seq = seq_idx if seq_idx is not None else weight
    stride_s = seq_idx.stride(0) if seq_idx is not None else 0
    if x.numel():
        common = dict(N_TAPS=weight.shape[1], HAS_SEQ=seq_idx is not None, BLOCK_C=BLOCK_C, BLOCK_T=BLOCK_T,
                      TAPS_P2=triton.next_power_of_2(weight.shape[1]))
        _conv_dz_kernel[grid](dy, x, weight, bias if bias is not None else weight, seq, dz, *dy.stride(), *x.stride(),
                              stride_s, chans, times, HAS_BIAS=bias is not None, SILU=silu, **common)
        _conv_dx_kernel[grid](dz, x, weight, seq, dx, dw_part, db_part, *x.stride(), *dx.stride(), stride_s, chans,
                              times, **common)
    dweight = dw_part.sum(0).to(weight.dtype)
    dbias = db_part.sum(0).to(bias.dtype) if bias is not None else None
    return dx, dweight, dbias


# ----------------------------------------------------------------------------------------------------
# custom ops (opaque to torch.compile) and the autograd Function
# ----------------------------------------------------------------------------------------------------
@torch.library.custom_op("tritonlm::causal_conv1d_fwd", mutates_args=())
def _conv_fwd_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, seq_idx: torch.Tensor | None,
                 silu: bool) -> torch.Tensor:
    return causal_conv1d_forward(x, weight, bias, seq_idx, silu)


@_conv_fwd_op.register_fake
def _(x, weight, bias, seq_idx, silu):
    return x.new_empty(x.shape)


@torch.library.custom_op("tritonlm::causal_conv1d_bwd", mutates_args=())
def _conv_bwd_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 seq_idx: torch.Tensor | None, silu: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, db = causal_conv1d_backward(dy, x, weight, bias, seq_idx, silu)
    # (a custom op returns tensors: no bias, an empty gradient)
    return dx, dw, db if db is not None else weight.new_empty(0)


@_conv_bwd_op.register_fake
def _(dy, x, weight, bias, seq_idx, silu):
    return x.new_empty(x.shape), torch.empty_like(weight), (torch.empty_like(bias) if bias is not None
                                                            else weight.new_empty(0))


class CausalConv1dFunction(torch.autograd.Function):
    """``(x, weight, bias, seq_idx, silu) -> out``; saves x, the weight, the bias and seq_idx (z is recomputed)."""

    @staticmethod
    def forward(ctx, x, weight, bias=None, seq_idx=None, silu=False):
        fwd = _conv_fwd_op if use_custom_op(x) else causal_conv1d_forward
        with kernel_range("tritonlm::causal_conv1d_fwd"):
            out = fwd(x, weight, bias, seq_idx, bool(silu))
        ctx.save_for_backward(x, weight, *(() if bias is None else (bias,)))
        ctx.seq_idx, ctx.silu, ctx.has_bias = seq_idx, bool(silu), bias is not None
        return out

    @staticmethod
    @first_order_backward
    def backward(ctx, dy):
        x, weight, *rest = ctx.saved_tensors
        bias = rest[0] if ctx.has_bias else None
        bwd = _conv_bwd_op if use_custom_op(x) else causal_conv1d_backward
        with kernel_range("tritonlm::causal_conv1d_bwd"):
            dx, dw, db = bwd(dy, x, weight, bias, ctx.seq_idx, ctx.silu)
        return dx, dw, db if ctx.has_bias else None, None, None


def _check(op: str, x, weight, bias, activation):
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"{op}: x must be [batch, D, T] and weight [D, W], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if bias is not None and bias.shape != (x.shape[1],):
        raise ValueError(f"{op}: bias must be [{x.shape[1]}], got {tuple(bias.shape)}")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"{op}: activation must be None or 'silu', got {activation!r}")
    tensors = [t for t in (x, weight, bias) if t is not None]
    check_float(op, *tensors)
    check_device(op, *tensors)


def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     activation: str | None = None, seq_idx: torch.Tensor | None = None, **unsupported) -> torch.Tensor:
    """Depthwise causal conv1d (module docstring): ``x [batch, D, T]``, ``weight [D, W]`` -> ``[batch, D, T]`` in x's
    dtype, differentiable in x, weight and bias. ``seq_idx [batch, T]`` (int32) keeps packed documents apart. Other
    causal-conv1d keyword arguments (``initial_states``, ``return_final_states``, ...) are one-line errors."""
    if unsupported:
        raise TypeError(f"causal_conv1d_fn: {', '.join(sorted(unsupported))} not supported")
    _check("causal_conv1d_fn", x, weight, bias, activation)
    if seq_idx is not None:
        if seq_idx.dtype != torch.int32 or seq_idx.shape != (x.shape[0], x.shape[2]) or seq_idx.device != x.device:
            raise TypeError(f"causal_conv1d_fn: seq_idx must be int32 [{x.shape[0]}, {x.shape[2]}] on {x.device}, "
                            f"got {seq_idx.dtype} {tuple(seq_idx.shape)}")
        seq_idx = seq_idx.contiguous()
    return CausalConv1dFunction.apply(x, weight, bias, seq_idx, activation is not None)


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, activation: str | None = None) -> torch.Tensor:
    """One decoding step: ``x [batch, D, T]`` new tokens after ``conv_state [batch, D, S]`` (``S >= W - 1``, the
    last inputs), convolved as :func:`causal_conv1d_fn` over the state and the new tokens; the state's last ``S``
    positions are written back into ``conv_state`` in place. Returns ``[batch, D, T]`` in x's dtype."""
    _check("causal_conv1d_update", x, weight, bias, activation)
    if conv_state.dim() != 3 or conv_state.shape[:2] != x.shape[:2] or conv_state.shape[2] < weight.shape[1] - 1:
        raise ValueError(f"causal_conv1d_update: conv_state must be [{x.shape[0]}, {x.shape[1]}, >= "
                         f"{weight.shape[1] - 1}], got {tuple(conv_state.shape)}")
    check_device("causal_conv1d_update", x, conv_state)
    joined = torch.cat([conv_state.to(x.dtype), x], dim=-1)
    conv_state.copy_(joined[..., -conv_state.shape[-1]:])
    out = CausalConv1dFunction.apply(joined, weight, bias, None, activation is not None)
    return out[..., -x.shape[-1]:]
