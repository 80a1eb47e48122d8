"""RMSNorm: ``y = x * rstd * weight`` with ``rstd = 1 / sqrt(mean(x²) + eps)``, fp32 math.

Forward reads x and the weight once and writes y in x's dtype, saving only the per-row ``rstd`` (fp32).
Backward, with ``xhat = x * rstd`` and ``g = dy * weight``::

    dx      = rstd * (g - xhat * mean(g * xhat))      (per row)
    dweight = sum over rows of dy * xhat

With ``cast_xhat`` (Hugging Face Llama's casting: ``weight * (x * rstd).to(x.dtype)``) the normalised row
is rounded to x's dtype before the weight multiply, and ``dweight`` sums ``dy`` times that rounded value.

``dweight`` is summed per program into a ``[programs, n_cols]`` fp32 buffer, then reduced by a second
small kernel spread over ~16 column blocks (:func:`_column_sum_config`): deterministic, no float atomics.

Launch rule (:func:`_launch_config`): a row of up to ``MAX_FUSED_COLS`` elements (the forward: up to
``MAX_FUSED_COLS_FWD``) is held in registers (``ROW_IN_REGISTERS``) and small rows are packed several per program
so a tile holds ~4K elements; longer rows are walked in ``CHUNK_COLS``-wide chunks, twice (statistics, then
output), the second pass served from L2. ``num_warps`` grows with the tile, one warp per 512 elements (16 values per thread per operand).
The backward's grid-stride loop over row blocks is software-pipelined for 16-bit rows (``ROW_STAGES``, see
:data:`BWD_ROW_STAGES`): with ~110 registers a thread only 2 CTAs fit on an SM, too few to hide a row's load
latency, so the next block's x and dy are fetched by async copies while this block is computed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _registry, tuned
from ._common import (
    as_rows,
    check_device,
    check_float,
    first_order_backward,
    next_pow2,
    num_persistent_programs,
    use_custom_op,
)
from ._ranges import kernel_range

MAX_FUSED_COLS = 8192   # widest row kept whole in registers (fp32: 8192 / (32 × 16 warps) = 16 per thread)
# The forward holds only x (and w) per row: 16384 columns are 32 fp32 values per thread at 16 warps, spill-free
# (62-64 registers in the SASS report), so rows up to this width are read once. The backward holds x, dy and their
# products: at 16384 its 128-register cap (16 warps) spills 72-192 bytes, so it keeps the 8192 limit and walks
# wider rows twice (the second pass served from L2).
MAX_FUSED_COLS_FWD = 16384
CHUNK_COLS = 4096       # chunk width when a row is longer than that
TILE_ELEMENTS = 4096    # rows packed per program for short rows: BLOCK_M × BLOCK_N ≈ this
#: backward row blocks in flight per program (16-bit inputs; software pipelining of the x / dy loads). SASS report,
#: sm_90 bf16: async copies (LDGSTS) replace the direct row loads at 99 -> 111 registers (768 wide), 108 -> 113
#: (4096), 108 -> 118 (8192), resident CTAs unchanged. fp32 stays at 1: its 768-wide rows went 80 -> 103 registers,
#: 3 -> 2 CTAs per SM. A tuned table may set ROW_STAGES per shape.
BWD_ROW_STAGES = 2
#: Backward programs per SM, each writing one fp32 dweight partial row that the column sum reads back: 2 · 4 B ·
#: programs · n_cols of traffic on top of the 6 B per element (bf16 dy, x, dx). At 4096 x 4096 bf16, 4 per SM
#: (528 rows on an H100) cost 7.0 B per element; 1 per SM (132 rows, Liger-Kernel's count) 6.26. A program then
#: walks 31 row blocks, its ROW_STAGES pipeline keeping loads in flight; a tuned table may set 2 or 4 (the sweep's
#: candidates).
BWD_PROGRAMS_PER_SM = 1


# ----------------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _load_input(X, RES, H, x_rows, res_rows, h_rows, cols, mask, STORE_H: tl.constexpr,
                HAS_RESIDUAL: tl.constexpr):
    """The normalised input for these columns, fp32: ``x``, or ``h = x + residual`` rounded to h's dtype
    (exactly the tensor the unfused ``x + residual`` would give), stored to H when ``STORE_H``."""
    x = tl.load(x_rows + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_rows + cols, mask=mask, other=0.0)
        h = (x.to(tl.float32) + r.to(tl.float32)).to(H.dtype.element_ty)
        if STORE_H:
            tl.store(h_rows + cols, h, mask=mask)
        return h.to(tl.float32)
    return x.to(tl.float32)


@triton.jit
def _normalised(x, rstd, Y, CAST_XHAT: tl.constexpr):
    """``x * rstd`` (fp32); with ``CAST_XHAT`` rounded through the output dtype first, as HF Llama's RMSNorm does
    (``weight * xhat.to(input_dtype)``)."""
    xhat = x * rstd[:, None]
    if CAST_XHAT:
        xhat = xhat.to(Y.dtype.element_ty).to(tl.float32)
    return xhat


@triton.jit
def _rms_norm_fwd_kernel(
    X, RES, H, W, Y, RSTD,
    stride_x_row, stride_res_row, stride_y_row, n_rows, n_cols, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROW_IN_REGISTERS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    CAST_XHAT: tl.constexpr, W_OFFSET: tl.constexpr,
):
    # W_OFFSET (Gemma: 1.0): the row scales by W_OFFSET + weight; a constexpr, so 0 adds no instruction
    # ---- which rows: BLOCK_M consecutive rows per program (Y and H are contiguous: row stride stride_y_row)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    cols = tl.arange(0, BLOCK_N)
    x_rows = X + rows[:, None].to(tl.int64) * stride_x_row
    res_rows = RES + rows[:, None].to(tl.int64) * stride_res_row
    y_rows = Y + rows[:, None].to(tl.int64) * stride_y_row
    h_rows = H + rows[:, None].to(tl.int64) * stride_y_row

    if ROW_IN_REGISTERS:
        # ---- load: the whole row stays in registers (h = x + residual is formed and stored here)
        mask = row_mask[:, None] & (cols[None, :] < n_cols)
        x = _load_input(X, RES, H, x_rows, res_rows, h_rows, cols[None, :], mask, True, HAS_RESIDUAL)
        w = _offset(tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32), W_OFFSET)
        # ---- compute
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        y = _normalised(x, rstd, Y, CAST_XHAT) * w[None, :]
        # ---- store
        tl.store(y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        # ---- pass 1: sum of squares chunk by chunk (h stored on the way)
        sum_sq = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            mask = row_mask[:, None] & (start + cols[None, :] < n_cols)
            x = _load_input(X, RES, H, x_rows, res_rows, h_rows, start + cols[None, :], mask, True, HAS_RESIDUAL)
            sum_sq += x * x
        rstd = 1.0 / tl.sqrt(tl.sum(sum_sq, axis=1) / n_cols + eps)
        # ---- pass 2: normalise and store (h recomputed from x and residual, not reread: no barrier needed)
        for start in range(0, n_cols, BLOCK_N):
            col_mask = start + cols < n_cols
            mask = row_mask[:, None] & col_mask[None, :]
            x = _load_input(X, RES, H, x_rows, res_rows, h_rows, start + cols[None, :], mask, False, HAS_RESIDUAL)
            w = _offset(tl.load(W + start + cols, mask=col_mask, other=0.0).to(tl.float32), W_OFFSET)
            y = _normalised(x, rstd, Y, CAST_XHAT) * w[None, :]
            tl.store(y_rows + start + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)

    tl.store(RSTD + rows, rstd, mask=row_mask)


@triton.jit
def _offset(w, W_OFFSET: tl.constexpr):
    """``W_OFFSET + w`` (Gemma's ``1 + w``); nothing at all for the usual 0."""
    if W_OFFSET != 0.0:
        w = w + W_OFFSET
    return w


@triton.jit
def _load_bwd_chunk(X, DY, W, rows64, row_mask, start, cols, n_cols, stride_x_row, stride_dy_row,
                    W_OFFSET: tl.constexpr):
    """x, dy (fp32, ``[BLOCK_M, BLOCK_N]``) and w (``[BLOCK_N]``) for the columns ``start + cols``, with masks."""
    col_mask = start + cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    x = tl.load(X + rows64 * stride_x_row + start + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows64 * stride_dy_row + start + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = _offset(tl.load(W + start + cols, mask=col_mask, other=0.0).to(tl.float32), W_OFFSET)
    return x, dy, w, mask, col_mask


@triton.jit
def _row_block_bwd(X, DY, RSTD, w, rows, rows64, row_mask, mask, cols, stride_x_row, stride_dy_row, n_cols):
    """Load one block of whole rows (x, dy fp32; their rstd) and return them with ``dx = rstd (g - x̂ mean(g x̂))``,
    ``g = dy w`` (``w`` broadcastable to the block). Shared with :mod:`.qk_norm`."""
    # ---- load
    x = tl.load(X + rows64 * stride_x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows64 * stride_dy_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
    # ---- compute
    xhat = x * rstd[:, None]
    g = dy * w
    mean_gx = tl.sum(g * xhat, axis=1) / n_cols
    return x, dy, rstd, (g - xhat * mean_gx[:, None]) * rstd[:, None]


@triton.jit
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DW_PARTIAL, DH,
    stride_dy_row, stride_x_row, stride_dx_row, stride_dh_row, n_rows, n_cols, blocks_per_program,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROW_IN_REGISTERS: tl.constexpr, HAS_DH: tl.constexpr,
    CAST_XHAT: tl.constexpr, W_OFFSET: tl.constexpr, ROW_STAGES: tl.constexpr,
):
    # HAS_DH (add_rms_norm): X holds h = x + residual, and dL/dh from h's other uses is added to dx
    # Grid-stride loop: program p handles row blocks p, p + P, p + 2P, ... and owns row p of DW_PARTIAL.
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    dw_row = DW_PARTIAL + pid.to(tl.int64) * n_cols

    if ROW_IN_REGISTERS:
        col_mask = cols < n_cols
        w = _offset(tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32), W_OFFSET)
        dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        # ROW_STAGES > 1: the pipeliner issues the next row block's x and dy loads (async copies into shared memory)
        # while this one is computed -- latency hiding that 2 resident CTAs per SM cannot give by themselves
        for i in tl.range(0, blocks_per_program, num_stages=ROW_STAGES):
            rows = (pid + i * n_programs) * BLOCK_M + tl.arange(0, BLOCK_M)
            row_mask = rows < n_rows
            mask = row_mask[:, None] & col_mask[None, :]
            rows64 = rows[:, None].to(tl.int64)
            x, dy, rstd, dx = _row_block_bwd(X, DY, RSTD, w[None, :], rows, rows64, row_mask, mask, cols,
                                             stride_x_row, stride_dy_row, n_cols)
            if HAS_DH:
                dx += tl.load(DH + rows64 * stride_dh_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dw_acc += tl.sum(dy * _normalised(x, rstd, DX, CAST_XHAT), axis=0)
            # ---- store
            tl.store(DX + rows64 * stride_dx_row + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        tl.store(dw_row + cols, dw_acc, mask=col_mask)
    else:
        # Long rows: chunked twice per row block; this program's DW_PARTIAL row (zeroed by the launcher)
        # accumulates in memory because a whole row of partial sums does not fit in registers.
        for i in range(0, blocks_per_program):
            rows = (pid + i * n_programs) * BLOCK_M + tl.arange(0, BLOCK_M)
            row_mask = rows < n_rows
            rows64 = rows[:, None].to(tl.int64)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            # ---- pass 1: mean(g * xhat)
            gx_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK_N):
                x, dy, w, mask, col_mask = _load_bwd_chunk(X, DY, W, rows64, row_mask, start, cols, n_cols,
                                                           stride_x_row, stride_dy_row, W_OFFSET)
                gx_acc += dy * w[None, :] * x
            mean_gx = tl.sum(gx_acc, axis=1) * rstd / n_cols
            # ---- pass 2: dx, and dweight into this program's partial row
            for start in range(0, n_cols, BLOCK_N):
                x, dy, w, mask, col_mask = _load_bwd_chunk(X, DY, W, rows64, row_mask, start, cols, n_cols,
                                                           stride_x_row, stride_dy_row, W_OFFSET)
                xhat = x * rstd[:, None]
                dx = (dy * w[None, :] - xhat * mean_gx[:, None]) * rstd[:, None]
                if HAS_DH:
                    dx += tl.load(DH + rows64 * stride_dh_row + start + cols[None, :], mask=mask,
                                  other=0.0).to(tl.float32)
                tl.store(DX + rows64 * stride_dx_row + start + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
                dw = tl.load(dw_row + start + cols, mask=col_mask, other=0.0)
                tl.store(dw_row + start + cols, dw + tl.sum(dy * _normalised(x, rstd, DX, CAST_XHAT), axis=0),
                         mask=col_mask)


@triton.jit
def _column_sum_kernel(PARTIAL, OUT, n_partials, n_cols, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """OUT[c] = sum_p PARTIAL[p, c], in a fixed order (deterministic)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for start in range(0, n_partials, BLOCK_P):
        parts = start + tl.arange(0, BLOCK_P)
        mask = (parts[:, None] < n_partials) & col_mask[None, :]
        acc += tl.load(PARTIAL + parts[:, None].to(tl.int64) * n_cols + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=col_mask)


# ----------------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------------
def _launch_config(n_cols: int, dtype: torch.dtype | None = None, device: torch.device | None = None,
                   forward: bool = False) -> dict:
    """Block sizes and warps for a row length (see the module docstring for the rule); rows held in registers may
    take rows-per-program and warps from a tuned table (``kernels/tuned``) for this GPU."""
    limit = MAX_FUSED_COLS_FWD if forward else MAX_FUSED_COLS
    if n_cols <= limit:
        block_n = next_pow2(n_cols)
        block_m = max(1, min(16, TILE_ELEMENTS // block_n))
    else:
        block_n, block_m = CHUNK_COLS, 1
    # one warp per 512 elements of the tile, 4 to 16: 16 values per thread per operand keeps the
    # backward (x, dy and their fp32 products live at once) far from the register limit
    num_warps = max(4, min(16, block_m * block_n // 512))
    cfg = dict(BLOCK_M=block_m, BLOCK_N=block_n, ROW_IN_REGISTERS=n_cols <= limit, num_warps=num_warps,
               ROW_STAGES=BWD_ROW_STAGES if dtype in (torch.float16, torch.bfloat16) else 1,
               PROGRAMS_PER_SM=BWD_PROGRAMS_PER_SM if n_cols <= limit else 4)
    if cfg["ROW_IN_REGISTERS"] and device is not None:
        cfg = tuned.choose("rms_norm", f"{tuned.dtype_name(dtype)}-n{block_n}", device, cfg)
    if forward:  # (the backward's row pipeline depth and programs; the forward has no row loop)
        cfg = {k: v for k, v in cfg.items() if k not in ("ROW_STAGES", "PROGRAMS_PER_SM")}
    return cfg


#: The rows-in-registers launch a tuned table may replace, and the sweep's alternatives to the shipped one.
TUNABLE = _registry.Tunable(
    "rms_norm", ("BLOCK_M", "num_warps", "ROW_STAGES", "PROGRAMS_PER_SM"),
    (dict(BLOCK_M=1, num_warps=4), dict(BLOCK_M=1, num_warps=8), dict(BLOCK_M=2, num_warps=8),
     dict(BLOCK_M=4, num_warps=8), dict(BLOCK_M=4, num_warps=16),
     # the backward's row pipeline: off, and one block deeper; more backward programs (more dweight partial rows)
     dict(ROW_STAGES=1), dict(ROW_STAGES=3), dict(PROGRAMS_PER_SM=2), dict(PROGRAMS_PER_SM=4)),
    lambda key, device, dtype: {k: v for k, v in _launch_config(int(key.split("-n")[1]), dtype).items()
                                if k in ("BLOCK_M", "num_warps", "ROW_STAGES", "PROGRAMS_PER_SM")})


def _column_sum_config(n_cols: int) -> dict:
    """The dweight reduction over the backward's per-program partial rows: at least ~16 column blocks so the sum
    runs on many SMs (one CTA summing a whole d_model row of partials is latency-bound), each reading
    ``BLOCK_P x BLOCK_N`` (~2K elements) per step."""
    block_n = max(32, min(256, next_pow2(triton.cdiv(n_cols, 16))))
    return dict(BLOCK_N=block_n, BLOCK_P=max(4, 2048 // block_n), num_warps=4)


def _autocast_on(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4 takes no device argument (and means CUDA)
        return torch.is_autocast_enabled()


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 1:
        raise ValueError(f"rms_norm: weight must be 1-D [d_model], got {tuple(weight.shape)}")
    if x.dim() == 0 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm: x must be [..., {weight.shape[0]}], got {tuple(x.shape)}")
    check_float("rms_norm", x, weight)
    if x.dtype != weight.dtype and not (weight.dtype == torch.float32 and _autocast_on(x.device.type)):
        raise TypeError(f"rms_norm: x is {x.dtype} but weight is {weight.dtype}; cast one of them "
                        "(an fp32 weight with low-precision x is accepted under autocast)")
    check_device("rms_norm", x, weight)


def _launch_forward(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                    cast_xhat: bool = False, weight_offset: float = 0.0):
    """``(y, h, rstd)``; ``h = x + residual`` (contiguous, x's dtype) only when a residual is given."""
    x_rows = as_rows(x)
    n_rows, n_cols = x_rows.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous: row stride n_cols
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    res_rows = as_rows(residual) if residual is not None else x_rows
    h = torch.empty_like(y) if residual is not None else None
    if n_rows:
        cfg = _launch_config(n_cols, x.dtype, x.device, forward=True)
        grid = (triton.cdiv(n_rows, cfg["BLOCK_M"]),)
        _rms_norm_fwd_kernel[grid](x_rows, res_rows, h if h is not None else y, weight, y, rstd,
                                   x_rows.stride(0), res_rows.stride(0), n_cols, n_rows, n_cols, float(eps),
                                   HAS_RESIDUAL=residual is not None, CAST_XHAT=cast_xhat,
                                   W_OFFSET=float(weight_offset), **cfg)
    return y, h, rstd


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, cast_xhat: bool = False,
                     weight_offset: float = 0.0):
    """Returns ``(y, rstd)``: y like x, rstd fp32 ``[rows]``."""
    y, _, rstd = _launch_forward(x, None, weight, eps, cast_xhat, weight_offset)
    return y, rstd


def add_rms_norm_forward(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                         weight_offset: float = 0.0):
    """Returns ``(y, h, rstd)`` with ``h = x + residual`` and ``y = rmsnorm(h)``, both like x."""
    return _launch_forward(x, residual, weight, eps, weight_offset=weight_offset)


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                      dh: torch.Tensor | None = None, cast_xhat: bool = False, weight_offset: float = 0.0):
    """Returns ``(dx, dweight)``. With ``dh`` (add_rms_norm: x is the saved h), ``dx = dL/dh`` includes it."""
    x_rows, dy_rows = as_rows(x), as_rows(dy)
    dh_rows = as_rows(dh) if dh is not None else dy_rows
    n_rows, n_cols = x_rows.shape
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous: row stride n_cols
    cfg = _launch_config(n_cols, x.dtype, x.device)
    n_blocks = triton.cdiv(n_rows, cfg["BLOCK_M"])
    n_programs = num_persistent_programs(x, n_blocks, per_sm=cfg.pop("PROGRAMS_PER_SM"))
    # every program writes its whole partial row when rows fit in registers; the chunked path
    # accumulates into it, so only that path needs it zeroed (saves a memset launch otherwise)
    alloc = torch.empty if cfg["ROW_IN_REGISTERS"] and n_rows else torch.zeros
    dw_partial = alloc((n_programs, n_cols), dtype=torch.float32, device=x.device)
    if n_rows:
        _rms_norm_bwd_kernel[(n_programs,)](
            dy_rows, x_rows, weight, rstd, dx, dw_partial, dh_rows, dy_rows.stride(0), x_rows.stride(0), n_cols,
            dh_rows.stride(0), n_rows, n_cols, triton.cdiv(n_blocks, n_programs), HAS_DH=dh is not None,
            CAST_XHAT=cast_xhat, W_OFFSET=float(weight_offset), **cfg)
    dweight = torch.empty(n_cols, dtype=weight.dtype, device=weight.device)
    sum_cfg = _column_sum_config(n_cols)
    _column_sum_kernel[(triton.cdiv(n_cols, sum_cfg["BLOCK_N"]),)](dw_partial, dweight, n_programs, n_cols, **sum_cfg)
    return dx, dweight


# ----------------------------------------------------------------------------------------------------
# torch.library custom ops: opaque to torch.compile, so a fused model traces with fullgraph=True
# ----------------------------------------------------------------------------------------------------
@torch.library.custom_op("tritonlm::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd_op(x: torch.Tensor, weight: torch.Tensor, eps: float, cast_xhat: bool = False,
                     weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_forward(x, weight, eps, cast_xhat, weight_offset)


@_rms_norm_fwd_op.register_fake
def _(x, weight, eps, cast_xhat=False, weight_offset=0.0):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("tritonlm::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                     cast_xhat: bool = False, weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_backward(dy, x, weight, rstd, cast_xhat=cast_xhat, weight_offset=weight_offset)


@_rms_norm_bwd_op.register_fake
def _(dy, x, weight, rstd, cast_xhat=False, weight_offset=0.0):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


class RMSNormFunction(torch.autograd.Function):
    """Autograd wrapper: saves x, the weight and ``rstd`` only. Under torch.compile it calls the
    custom ops above; in eager mode the launchers directly (no dispatcher overhead)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, cast_xhat: bool = False,
                weight_offset: float = 0.0):
        fwd = _rms_norm_fwd_op if use_custom_op(x) else rms_norm_forward
        with kernel_range("tritonlm::rms_norm_fwd"):
            y, rstd = fwd(x, weight, eps, cast_xhat, weight_offset)
        ctx.save_for_backward(x, weight, rstd)
        ctx.cast_xhat, ctx.weight_offset = cast_xhat, weight_offset
        return y

    @staticmethod
    @first_order_backward
    def backward(ctx, dy: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        bwd = _rms_norm_bwd_op if use_custom_op(x) else rms_norm_backward
        with kernel_range("tritonlm::rms_norm_bwd"):
            dx, dweight = bwd(dy, x, weight, rstd, cast_xhat=ctx.cast_xhat, weight_offset=ctx.weight_offset)
        return dx, dweight, None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, *, cast_xhat: bool = False,
             weight_offset: float = 0.0) -> torch.Tensor:
    """Fused RMSNorm of ``x[..., d_model]`` with ``weight[d_model]``; returns x's dtype.

    ``cast_xhat=True`` follows Hugging Face Llama's casting: ``weight * (x * rstd).to(x.dtype)`` (the normalised
    row is rounded to x's dtype before the weight multiply; the same as the default in fp32). ``weight_offset``
    scales by ``weight_offset + weight`` in fp32 (Gemma's ``x̂ · (1 + w)``: 1.0)."""
    _check(x, weight)
    return RMSNormFunction.apply(x, weight, eps, cast_xhat, float(weight_offset))


# ----------------------------------------------------------------------------------------------------
# fused residual add + RMSNorm: the pre-norm seam ``h = x + residual; y = rmsnorm(h)`` in one pass
# ----------------------------------------------------------------------------------------------------
@torch.library.custom_op("tritonlm::add_rms_norm_fwd", mutates_args=())
def _add_rms_norm_fwd_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                         weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return add_rms_norm_forward(x, residual, weight, eps, weight_offset)


@_add_rms_norm_fwd_op.register_fake
def _(x, residual, weight, eps, weight_offset=0.0):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    return y, torch.empty_like(y), x.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("tritonlm::add_rms_norm_bwd", mutates_args=())
def _add_rms_norm_bwd_op(dy: torch.Tensor, dh: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                         rstd: torch.Tensor, weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    return rms_norm_backward(dy, h, weight, rstd, dh, weight_offset=weight_offset)


@_add_rms_norm_bwd_op.register_fake
def _(dy, dh, h, weight, rstd, weight_offset=0.0):
    return torch.empty_like(h, memory_format=torch.contiguous_format), torch.empty_like(weight)


class AddRMSNormFunction(torch.autograd.Function):
    """``(x, residual, weight, eps) -> (y, h)``. Saves only h, the weight and ``rstd``; the backward takes
    ``dy`` and ``dh`` (either may be absent) and returns the same ``dL/dh`` for x and residual."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5,
                weight_offset: float = 0.0):
        fwd = _add_rms_norm_fwd_op if use_custom_op(x) else add_rms_norm_forward
        with kernel_range("tritonlm::add_rms_norm_fwd"):
            y, h, rstd = fwd(x, residual, weight, eps, weight_offset)
        ctx.save_for_backward(h, weight, rstd)
        ctx.weight_offset = weight_offset
        ctx.set_materialize_grads(False)
        return y, h

    @staticmethod
    @first_order_backward
    def backward(ctx, dy: torch.Tensor | None, dh: torch.Tensor | None):
        h, weight, rstd = ctx.saved_tensors
        if dy is None:  # y unused: only h's own gradient flows, to both inputs
            dh = torch.zeros_like(h) if dh is None else dh
            return dh, dh, torch.zeros_like(weight), None, None
        with kernel_range("tritonlm::add_rms_norm_bwd"):
            if use_custom_op(h):
                dx, dweight = _add_rms_norm_bwd_op(dy, dh if dh is not None else torch.zeros_like(h), h, weight,
                                                   rstd, ctx.weight_offset)
            else:
                dx, dweight = rms_norm_backward(dy, h, weight, rstd, dh, weight_offset=ctx.weight_offset)
        return dx, dx, dweight, None, None


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, *,
                 weight_offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused ``h = x + residual``, ``y = rmsnorm(h) * weight``; returns ``(y, h)``, both ``[..., d_model]``
    in x's dtype (h rounded to it exactly as ``x + residual`` would be; the norm in fp32). ``weight_offset`` as in
    :func:`rms_norm`."""
    _check(x, weight)
    if residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: residual {tuple(residual.shape)} and x {tuple(x.shape)} differ")
    if residual.dtype != x.dtype:
        raise TypeError(f"add_rms_norm: residual is {residual.dtype} but x is {x.dtype}")
    check_device("add_rms_norm", x, residual, weight)
    return AddRMSNormFunction.apply(x, residual, weight, eps, float(weight_offset))
