"""Rotary position embedding on interleaved pairs (or Hugging Face's half-split pairs), q and k in one launch.

Pair ``i`` of a head vector, ``(x[2i], x[2i+1])``, at position ``m`` is rotated by ``m * theta**(-2i/d)``::

    out[2i]   = x[2i] cos - x[2i+1] sin
    out[2i+1] = x[2i] sin + x[2i+1] cos

The angles' cos/sin come from fp64-computed tables stored as fp32 ``[max_seq_len, d/2]`` (the module's
non-persistent buffers, or :func:`rope_tables`), and the kernel is compiled without floating-point contraction
(``enable_fp_fusion=False``): each product is rounded before the add, as the reference's separate eager multiply
and subtract round it, where Triton would otherwise fuse ``x·cos - y·sin`` into one FMA (one rounding fewer, a
different last bit). So it matches the reference bit for bit in fp32 at any position, on a GPU too (the SASS
report's rope rows hold no FFMA); the tables are shared by every head and stay in L2. Backward is the inverse
rotation (``sin -> -sin``), the same kernel with ``INVERSE``.

Inputs are ``[..., seq, d]`` with any leading dims, viewed as ``[batch, heads, seq, d]`` with separate
batch and head strides, so the ``[batch, heads, seq, d]`` view of a ``[batch, seq, heads*d]`` projection is
read in place. Each program loads a ``[BLOCK_S, d]`` tile as contiguous rows (vectorised loads) and
splits even/odd lanes in registers. The half-split layout (``HALF_SPLIT``, pairs ``(x[i], x[i + d/2])`` as in
Hugging Face's ``rotate_half``) loads the two halves as two contiguous tiles instead.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import _registry, tuned
from ._common import (
    ASSUMED_SM_COUNT,
    as_4d,
    check_device,
    check_float,
    first_order_backward,
    grid_axis1_launches,
    next_pow2,
    sm_count,
    use_custom_op,
)
from ._ranges import kernel_range

#: BLOCK_S × BLOCK_D per program (16-bit; fp32 half). 2K elements: SASS report, sm_90 bf16 q+k at d 128, 40
#: registers and 12 CTAs per SM (the 4K tile took 80 and 6; Liger-Kernel 0.8.5's RoPE 56 and 9), 128-bit loads kept.
TILE_ELEMENTS = 2048


@triton.jit
def _rope_kernel(
    Q, K, Q_OUT, K_OUT, COS, SIN, POS,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_qob, stride_qoh, stride_qos, stride_kob, stride_koh, stride_kos,
    stride_pb, stride_ph, stride_ps,
    n_heads, n_heads_k, heads_per_program, bh_start, seq_len, d_head,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_K: tl.constexpr,
    INVERSE: tl.constexpr, HALF_SPLIT: tl.constexpr,
):
    # grid: (seq blocks, batch x head groups from bh_start). A program rotates heads_per_program consecutive heads
    # of q and the same heads of k (which may have fewer: GQA) at one block of positions, so the positions and their
    # cos/sin are loaded once for all of them (more than one head needs positions shared by heads). The head loop
    # is a runtime loop rotating one head per step: unrolled, or with q and k in one step, the scheduler keeps
    # several heads' tiles live (96-208 registers and spills for fp32 on sm_80, measured; one head: ~50-90).
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1) + bh_start
    groups = tl.cdiv(n_heads, heads_per_program)
    # 64-bit offsets: one [heads, seq, d] batch may hold more than 2**31 elements
    b = (pid_bh // groups).to(tl.int64)
    h0 = (pid_bh % groups).to(tl.int64) * heads_per_program
    s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    s_mask = s < seq_len
    rows = s[:, None].to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = s_mask[:, None] & (cols[None, :] < d_head)

    # ---- positions -> cos/sin of each (position, pair): the table row of a position is contiguous,
    # so load [BLOCK_S, BLOCK_D/2] (vectorised); the interleaved layout repeats each value on its pair's two lanes
    pos = tl.load(POS + b * stride_pb + h0 * stride_ph + s.to(tl.int64) * stride_ps, mask=s_mask, other=0)
    half = d_head // 2
    pairs = tl.arange(0, BLOCK_D // 2)
    table = pos[:, None].to(tl.int64) * half + pairs[None, :]
    table_mask = s_mask[:, None] & (pairs[None, :] < half)
    # (tables may come in a 16-bit dtype, as HF's per-token cos/sin do: the math is fp32 either way)
    cos_half = tl.load(COS + table, mask=table_mask, other=1.0).to(tl.float32)
    sin_half = tl.load(SIN + table, mask=table_mask, other=0.0).to(tl.float32)
    if INVERSE:
        sin_half = -sin_half

    # ---- this program's heads of q, then the same heads of k: one runtime loop whose body rotates one head, so
    # only one head's tile is live at a time (registers as for a single head)
    n_rot = heads_per_program * 2 if HAS_K else heads_per_program
    for j in range(0, n_rot):
        is_k = j >= heads_per_program
        h = h0 + j % heads_per_program
        if h < tl.where(is_k, n_heads_k, n_heads):
            if is_k:
                src = K + b * stride_kb + h * stride_kh
                dst = K_OUT + b * stride_kob + h * stride_koh
                src_s, dst_s = stride_ks, stride_kos
            else:
                src = Q + b * stride_qb + h * stride_qh
                dst = Q_OUT + b * stride_qob + h * stride_qoh
                src_s, dst_s = stride_qs, stride_qos
            _rotate_rows(src, dst, src_s, dst_s, rows, cols, pairs, mask, table_mask, half, cos_half, sin_half,
                         BLOCK_S, BLOCK_D, HALF_SPLIT)


@triton.jit
def _rotate_rows(src, dst, src_s, dst_s, rows, cols, pairs, mask, table_mask, half, cos_half, sin_half,
                 BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HALF_SPLIT: tl.constexpr):
    """Rotate one head's ``[BLOCK_S, d]`` rows from ``src`` into ``dst`` (load -> rotate in fp32 -> store)."""
    if HALF_SPLIT:
        # ---- half-split layout (Hugging Face's rotate_half): pair i is (x[i], x[i + d/2]); each half is a
        # contiguous [BLOCK_S, BLOCK_D/2] load, so no lane shuffles are needed
        first = src + rows * src_s + pairs[None, :]
        x1 = tl.load(first, mask=table_mask, other=0.0).to(tl.float32)
        x2 = tl.load(first + half, mask=table_mask, other=0.0).to(tl.float32)
        out1 = x1 * cos_half - x2 * sin_half
        out2 = x2 * cos_half + x1 * sin_half
        out_first = dst + rows * dst_s + pairs[None, :]
        tl.store(out_first, out1.to(dst.dtype.element_ty), mask=table_mask)
        tl.store(out_first + half, out2.to(dst.dtype.element_ty), mask=table_mask)
    else:
        # ---- interleaved layout: repeat each pair's cos/sin on its two lanes
        cos = tl.reshape(tl.join(cos_half, cos_half), (BLOCK_S, BLOCK_D))
        sin = tl.reshape(tl.join(sin_half, sin_half), (BLOCK_S, BLOCK_D))
        # each lane's partner is the other lane of its pair: x[c ^ 1]; even lanes subtract x_odd*sin,
        # odd lanes add x_even*sin, so sign = -1 on even lanes, +1 on odd lanes
        sign = tl.where(cols % 2 == 0, -1.0, 1.0)
        x = tl.load(src + rows * src_s + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        # swap the two lanes of every pair in registers: [S, D] -> [S, D/2, 2] -> flip -> [S, D]
        even, odd = tl.split(tl.reshape(x, (BLOCK_S, BLOCK_D // 2, 2)))
        partner = tl.reshape(tl.join(odd, even), (BLOCK_S, BLOCK_D))
        out = x * cos + sign[None, :] * partner * sin
        tl.store(dst + rows * dst_s + cols[None, :], out.to(dst.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=16)
def _cached_tables(theta: float, d_head: int, n_positions: int, device: torch.device):
    inv_freq = theta ** (-torch.arange(0, d_head, 2, dtype=torch.float64, device=device) / d_head)
    angles = torch.arange(n_positions, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    return torch.cos(angles).float().contiguous(), torch.sin(angles).float().contiguous()


def rope_tables(theta: float, d_head: int, n_positions: int, device=None):
    """fp32 ``(cos, sin)`` tables ``[n_positions, d_head/2]`` computed in fp64 (cached per arguments)."""
    return _cached_tables(float(theta), int(d_head), int(n_positions), torch.device(device or "cpu"))


#: Programs to keep in flight before several heads share one (so their cos/sin load is shared): ~4 per SM. A tuned
#: table may set HEADS up to 64 (every head of a Llama-sized layer: one cos/sin load per position).
MIN_PROGRAMS_PER_SM = 4
MAX_HEADS_PER_PROGRAM = 8


def _launch_config(d_head: int, dtype: torch.dtype | None = None, device: torch.device | None = None) -> dict:
    """A ~4K-element tile of whole head rows; rows per program, heads per program and warps may come from a tuned
    table (``HEADS`` is then settled by :func:`_heads_per_program`)."""
    block_d = max(2, next_pow2(d_head))
    # fp32 tiles hold twice the bytes per element in registers: half the rows (SASS report: 1K-element fp32 tiles
    # stay near the 16-bit kernels' register count)
    tile = TILE_ELEMENTS // 2 if dtype == torch.float32 else TILE_ELEMENTS
    block_s = max(1, min(64, tile // block_d))
    cfg = dict(BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4 if block_s * block_d <= 4096 else 8)
    if device is None:
        return cfg
    return tuned.choose("rope", f"{tuned.dtype_name(dtype)}-d{block_d}", device, cfg)


#: The launch a tuned table may replace, with the sweep's alternatives (``HEADS`` 32: every q head of a 32-head layer).
TUNABLE = _registry.Tunable(
    "rope", ("BLOCK_S", "HEADS", "num_warps"),
    (dict(HEADS=1), dict(HEADS=4), dict(HEADS=8), dict(HEADS=32), dict(BLOCK_S=16, HEADS=8, num_warps=4),
     dict(BLOCK_S=64, HEADS=2, num_warps=8)),
    lambda key, device, dtype: {k: v for k, v in _launch_config(int(key.split("-d")[1]), dtype).items()
                                if k in ("BLOCK_S", "num_warps")})


def _heads_per_program(device: torch.device, programs_one_head: int, n_heads: int) -> int:
    """The most heads (a power of two, at most 8) a program can take while the grid keeps about four programs per
    SM: memory-bound, the kernel needs them in flight more than it needs fewer table loads."""
    sms = sm_count(device.index or 0) if device.type == "cuda" else ASSUMED_SM_COUNT
    heads = 1
    while (heads < min(MAX_HEADS_PER_PROGRAM, n_heads)
           and programs_one_head // (2 * heads) >= MIN_PROGRAMS_PER_SM * sms):
        heads *= 2
    return heads


def rope_forward(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                 positions: torch.Tensor, inverse: bool = False, half_split: bool = False):
    """Rotate ``q`` (and ``k``) at ``positions`` (broadcastable to ``q.shape[:-1]``); ``half_split`` pairs
    ``(x[i], x[i + d/2])`` instead of ``(x[2i], x[2i+1])``. ``k`` may have fewer heads than q (dim -3, GQA) when
    the positions are the same for every head; one launch either way."""
    tensors = [q] if k is None else [q, k]
    views = [as_4d(t) for t in tensors]
    outs, out_views = [], []
    for t in tensors:
        out = torch.empty_like(t)  # keeps a permuted [batch, heads, seq, d] layout when t has one
        view = as_4d(out)
        if view.data_ptr() != out.data_ptr():  # that layout has no 4-D view: fall back to contiguous
            out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            view = as_4d(out)
        outs.append(out)
        out_views.append(view)
    b, h, s, d = views[0].shape
    h_k = views[-1].shape[1]
    pos = torch.broadcast_to(positions, q.shape[:-1])
    pos = as_4d(pos.unsqueeze(-1))[..., 0]  # [batch, heads, seq] with 0 strides where broadcast
    if h_k != h and pos.stride(1) != 0:
        raise ValueError("rope_forward: k with fewer heads than q needs positions shared by all heads")
    if q.numel():
        cfg = dict(_launch_config(d, q.dtype, q.device))
        heads = cfg.pop("HEADS", None)
        if pos.stride(1) != 0:  # per-head positions: each head has its own cos/sin rows
            heads = 1
        elif heads is None:
            heads = _heads_per_program(q.device, triton.cdiv(s, cfg["BLOCK_S"]) * b * h, h)
        qv, kv = views[0], views[-1]
        qo, ko = out_views[0], out_views[-1]
        for bh_start, n_bh in grid_axis1_launches(b * triton.cdiv(h, heads)):
            _rope_kernel[(triton.cdiv(s, cfg["BLOCK_S"]), n_bh)](
                qv, kv, qo, ko, cos, sin, pos,
                qv.stride(0), qv.stride(1), qv.stride(2), kv.stride(0), kv.stride(1), kv.stride(2),
                qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
                pos.stride(0), pos.stride(1), pos.stride(2),
                h, h_k, heads, bh_start, s, d, HAS_K=k is not None, INVERSE=inverse, HALF_SPLIT=half_split,
                enable_fp_fusion=False, **cfg)
    return outs[0], (outs[1] if k is not None else None)


@torch.library.custom_op("tritonlm::rope", mutates_args=())
def _rope_op(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
             positions: torch.Tensor, inverse: bool, half_split: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    q_out, k_out = rope_forward(q, k, cos, sin, positions, inverse, half_split)
    return q_out, (k_out if k_out is not None else q.new_empty(0))


@_rope_op.register_fake
def _(q, k, cos, sin, positions, inverse, half_split=False):
    return torch.empty_like(q), (torch.empty_like(k) if k is not None else q.new_empty(0))


class RoPEFunction(torch.autograd.Function):
    """Rotates q and k together; backward rotates the gradients back (nothing but positions saved)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, positions, half_split=False):
        ctx.save_for_backward(cos, sin, positions)
        ctx.has_k, ctx.half_split = k is not None, half_split
        ctx.q_shape, ctx.k_shape = q.shape, (k.shape if k is not None else None)
        with kernel_range("tritonlm::rope_fwd"):
            if use_custom_op(q):
                q_out, k_out = _rope_op(q, k, cos, sin, positions, False, half_split)
                return q_out, (k_out if k is not None else None)
            return rope_forward(q, k, cos, sin, positions, half_split=half_split)

    @staticmethod
    @first_order_backward
    def backward(ctx, dq_out, dk_out):
        cos, sin, positions = ctx.saved_tensors
        if ctx.has_k:  # (k may have fewer heads than q: GQA)
            if dk_out is None:
                dk_out = dq_out.new_zeros(ctx.k_shape)
            if dq_out is None:
                dq_out = dk_out.new_zeros(ctx.q_shape)
        half = ctx.half_split
        rotate = (lambda a, b: _rope_op(a, b, cos, sin, positions, True, half)) if use_custom_op(dq_out) \
            else (lambda a, b: rope_forward(a, b, cos, sin, positions, inverse=True, half_split=half))
        with kernel_range("tritonlm::rope_bwd"):
            dq, dk = rotate(dq_out, dk_out if ctx.has_k else None)
        return dq, (dk if ctx.has_k else None), None, None, None, None


def apply_rope(q: torch.Tensor, k: torch.Tensor | None = None, token_positions: torch.Tensor | None = None,
               theta: float = 10000.0, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
               check_positions: bool = True, layout: str = "interleaved"):
    """Rotate ``q[..., seq, d]`` and optionally ``k`` (same shape) in one launch.

    ``layout``: ``"interleaved"`` rotates pairs ``(x[2i], x[2i+1])`` (this library's and CS336's RoPE);
    ``"half"`` rotates ``(x[i], x[i + d/2])``, Hugging Face's ``rotate_half`` layout, with the same tables.

    ``token_positions`` broadcasts against ``q.shape[:-1]`` (e.g. ``[seq]``, or ``[batch, 1, seq]`` for
    ``[batch, heads, seq, d]``); default ``0..seq-1``. ``cos``/``sin`` tables ``[max_pos, d/2]`` (fp32) may
    be given (the module passes its buffers); otherwise they are built for ``theta`` and cached.
    Returns ``q_rot`` or ``(q_rot, k_rot)``.
    """
    d = q.shape[-1]
    if layout not in ("interleaved", "half"):
        raise ValueError(f"apply_rope: layout must be 'interleaved' or 'half', got {layout!r}")
    if d % 2:
        raise ValueError(f"apply_rope: head dim must be even, got {d}")
    gqa = (k is not None and k.dim() == q.dim() >= 3 and k.shape[:-3] == q.shape[:-3]
           and k.shape[-2:] == q.shape[-2:] and k.shape[-3] <= q.shape[-3])
    if k is not None and k.shape != q.shape and not gqa:
        raise ValueError(f"apply_rope: q {tuple(q.shape)} and k {tuple(k.shape)} must have one shape (or k fewer "
                         "heads on dim -3)")
    if k is not None and k.dtype != q.dtype:
        raise TypeError(f"apply_rope: q is {q.dtype} but k is {k.dtype}")
    check_float("apply_rope", q)
    seq = q.shape[-2] if q.dim() >= 2 else 0
    if q.dim() < 2:
        raise ValueError(f"apply_rope: expected [..., seq, d], got {tuple(q.shape)}")
    if token_positions is None:
        token_positions = torch.arange(seq, device=q.device)
        check_positions = False
    if token_positions.shape[-1] != seq:
        raise ValueError(f"apply_rope: token_positions {tuple(token_positions.shape)} must end in seq={seq}")
    if token_positions.is_floating_point():
        raise TypeError("apply_rope: token_positions must be integers")
    if cos is None or sin is None:
        n = max(seq, int(token_positions.max()) + 1 if token_positions.numel() else 1)
        cos, sin = rope_tables(theta, d, triton.next_power_of_2(n), q.device)
        check_positions = False
    if cos.shape[-1] * 2 != d:
        raise ValueError(f"apply_rope: cos/sin tables are for d={cos.shape[-1] * 2}, q has d={d}")
    check_device("apply_rope", *([q, cos, sin, token_positions] + ([k] if k is not None else [])))
    if (check_positions and token_positions.numel() and token_positions.device.type != "meta"
            and not torch.compiler.is_compiling()):
        lo, hi = int(token_positions.min()), int(token_positions.max())
        if lo < 0 or hi >= cos.shape[0]:
            raise ValueError(f"token position out of range [0, {cos.shape[0]}): saw {lo if lo < 0 else hi}")
    q_out, k_out = RoPEFunction.apply(q, k, cos, sin, token_positions, layout == "half")
    return q_out if k is None else (q_out, k_out)
