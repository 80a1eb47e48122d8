"""Flash-decoding: few queries against a long KV cache, the keys split over programs.

The forward kernel runs with ``SPLIT_KV`` (each program one slice of the keys, fp32 partial ``O_s`` and ``L_s``
per split), then ``_split_combine_kernel`` merges the splits of one (batch, head) by their logsumexps:
``L = log Σ_s exp(L_s)``, ``O = Σ_s exp(L_s - L) O_s``. Splits are chosen so about two programs run on every SM.
Paged-KV decoding lands here too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._common import ASSUMED_SM_COUNT, MAX_GRID_AXIS1, next_pow2, on_gpu, sm_count
from .forward import _fwd_kernel
from .layout import _block_d, _strides3

#: Flash-decoding: at most this many queries per (batch, head), at least this many keys, before the keys are
#: split across programs whose partial results a second kernel combines by their logsumexps.
DECODE_MAX_QUERIES = 16
DECODE_MIN_KEYS = 2048
#: (BLOCK_M, BLOCK_N, num_warps, num_stages) of a split: 16-query tiles (the smallest tl.dot), and the
#: interpreter's smaller key tiles.
DECODE_CONFIG = (16, 64, 4, 3)
DECODE_INTERPRETER_CONFIG = (16, 32, 4, 1)


def _decode_splits(n_bh: int, n_q: int, n_k: int, block_n: int, device: torch.device) -> int:
    """Key splits per (batch, head): 1 (no split) unless few queries meet a long cache; then enough programs
    to put about two on every SM, never more than there are key tiles."""
    if n_q > DECODE_MAX_QUERIES or n_k < DECODE_MIN_KEYS or n_bh > MAX_GRID_AXIS1:
        return 1
    if not on_gpu(device):  # interpreter: no parallelism to win, but the path runs (a split per 2 key tiles)
        return max(1, min(8, triton.cdiv(n_k, 2 * block_n)))
    sms = sm_count(device.index or 0) if device.type == "cuda" else ASSUMED_SM_COUNT
    return max(1, min(triton.cdiv(2 * sms, n_bh), triton.cdiv(n_k, block_n)))


def split_kv_forward(args, o4, lse, lse_strides, splits, h, group, n_q, n_k, d, qk_scale, win_left,
                     win_right, common, device, tail=(0, 0, 1.0), max_block_n=None, config=None, sinks=None):
    """Run the split forward and the combine for a dense batch. ``args(o, lse, o_strides, lse_strides)`` gives the
    forward kernel's leading arguments, ``tail`` its block-table stride, page size and softcap (:func:`.tiles._scores`,
    like ``qk_scale``); ``common`` its shared constexprs; ``max_block_n`` caps the key tile (a paged cache's block
    size); ``config`` the split kernel's ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` (the launcher's tuned
    ``-decode`` key; :data:`DECODE_CONFIG` when not given); ``sinks``: fp32 ``[heads]`` sink logits, folded in by
    the combine. ``h``: the query heads, or with ``common["PACK_GQA"]`` the kv heads (a program's tile then holds
    the ``group x n_q`` queries of one kv head's group). ``d`` is the query / key head dim; the values' (and the
    output's) is ``o4``'s last (MLA: its own)."""
    b_h = o4.shape[0] * h
    d_v = o4.shape[-1]
    block_m, block_n, warps, stages = config or (DECODE_CONFIG if on_gpu(device) else DECODE_INTERPRETER_CONFIG)
    pack = common["PACK_GQA"]
    # the one query tile holds every query (of the group, packed): at least those rows, and tl.dot's 16
    block_m = max(block_m, 16, next_pow2(group * n_q if pack else n_q))
    block_n = min(block_n, max_block_n or block_n)
    # every split but the last covers a whole number of key tiles
    split_size = triton.cdiv(triton.cdiv(n_k, splits), block_n) * block_n
    splits = triton.cdiv(n_k, split_size)
    o_part = torch.empty(splits, b_h, block_m, _block_d(d_v), dtype=torch.float32, device=device)
    lse_part = torch.empty(splits, b_h, block_m, dtype=torch.float32, device=device)
    _fwd_kernel[(splits, b_h)](
        *args(o_part, lse_part, (0, 0, 0), (0, 0)), h, group, 0, n_q, n_k, d, d_v, qk_scale,
        # (64-bit row offsets: memory-bound, and the 32-bit form spilled 8 B on sm_90 at 128 registers)
        win_left, win_right, split_size, *tail, SPLIT_KV=True, BLOCK_M=block_m, BLOCK_N=block_n,
        **{**common, "OFFS_64": True},
        num_warps=warps, num_stages=stages)
    _split_combine_kernel[(b_h,)](o_part, lse_part, o4, lse, sinks if sinks is not None else lse, *_strides3(o4),
                                  *lse_strides, h, group, splits, b_h, n_q, d_v, BLOCK_M=block_m, BLOCK_D=_block_d(d_v),
                                  PACK_GQA=pack, HAS_SINKS=sinks is not None, num_warps=4)


@triton.jit
def _split_combine_kernel(O_PART, LSE_PART, O, LSE, SINKS, stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
                          n_heads, group, n_splits, n_bh, n_q, d_head, BLOCK_M: tl.constexpr,
                          BLOCK_D: tl.constexpr, PACK_GQA: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Flash-decoding combine for one (batch, head) -- with ``PACK_GQA`` one (batch, kv head), its partial rows
    the group's heads x queries as the forward packed them: ``L = log Σ_s exp(L_s)``, ``O = Σ_s exp(L_s - L) O_s``
    over the key splits (a split that saw no key has L_s = -inf and weight 0). ``HAS_SINKS``: the head's sink
    logit joins the sum once, here (the splits leave it out), as a split with ``L_s = sink`` and ``O_s = 0``."""
    pid_bh = tl.program_id(0)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    tile_rows = tl.arange(0, BLOCK_M)
    if PACK_GQA:  # row r: query r % n_q of the group's head r // n_q
        h = h * group + tile_rows // n_q
        offs_m = tile_rows % n_q
        row_valid = tile_rows < group * n_q
    else:
        offs_m = tile_rows
        row_valid = offs_m < n_q
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for split in range(0, n_splits):
        part = (split * n_bh + pid_bh).to(tl.int64) * BLOCK_M
        lse_s = tl.load(LSE_PART + part + tile_rows)
        o_s = tl.load(O_PART + (part + tile_rows)[:, None] * BLOCK_D + offs_d[None, :])
        m_new = tl.maximum(m, lse_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        w = tl.exp(lse_s - m_safe)
        s = s * alpha + w
        acc = acc * alpha[:, None] + o_s * w[:, None]
        m = m_new
    if HAS_SINKS:
        if PACK_GQA:
            sink = tl.load(SINKS + h, mask=row_valid, other=0.0).to(tl.float32)
        else:
            sink = tl.load(SINKS + h).to(tl.float32)
        m_new = tl.maximum(m, sink)
        alpha = tl.exp(m - m_new)
        s = s * alpha + tl.exp(sink - m_new)
        acc = acc * alpha[:, None]
        m = m_new
    empty = s == 0.0
    s_safe = tl.where(empty, 1.0, s)
    lse = tl.where(empty, float("-inf"), m + tl.log(s_safe))
    mask = row_valid[:, None] & (offs_d[None, :] < d_head)
    o_rows = O + b * stride_ob + h * stride_oh + offs_m.to(tl.int64) * stride_om
    tl.store(o_rows[:, None] + offs_d[None, :], (acc / s_safe[:, None]).to(O.dtype.element_ty), mask=mask)
    tl.store(LSE + b * stride_lb + h * stride_lh + offs_m, lse, mask=row_valid)

