"""Tile bookkeeping shared by the attention kernels (Triton ``@jit`` helpers only).

Which sequence a program works on (dense batch or packed documents), where its query tile starts (causal tiles
longest-first), which key tiles a query tile must visit and which query tiles see a key tile (causal and window
bounds), the visibility mask of a boundary tile, and the TMA descriptor helpers of the Hopper variants.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: log2(e): the kernels exponentiate in base 2 with this folded into the softmax scale.
LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------------
# tile bookkeeping shared by the forward and the dQ kernel (both walk key tiles for one query tile)
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _sequence(pid_bh, n_heads, CU_Q, CU_K, n_q, n_k, VARLEN: tl.constexpr):
    """``(b, h, q_start, n_q, k_start, n_k)`` of a (batch, head) pair. Packed sequences (``VARLEN``) read their
    token ranges from the cumulative lengths; dense batches start at row 0 with the given lengths."""
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    if VARLEN:
        q_start = tl.load(CU_Q + b).to(tl.int64)
        k_start = tl.load(CU_K + b).to(tl.int64)
        n_q = (tl.load(CU_Q + b + 1) - q_start).to(tl.int32)
        n_k = (tl.load(CU_K + b + 1) - k_start).to(tl.int32)
    else:
        q_start = b * 0
        k_start = b * 0
    return b, h, q_start, n_q, k_start, n_k


@triton.jit
def _query_tile_start(pid_m, n_q, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """First query of this program's tile. Causal grids take the last query tiles first: they see the most keys,
    so short tiles fill the tail of the schedule. Past a (packed) sequence's end the tile is empty."""
    if CAUSAL:
        return (tl.cdiv(n_q, BLOCK_M) - 1 - pid_m) * BLOCK_M
    return pid_m * BLOCK_M


@triton.jit
def _key_ranges(start_m, n_q, n_k, win_left, win_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(key_lo, full_lo, full_hi, key_hi)`` for the query tile at ``start_m``. Query ``i`` sees key ``j`` when
    ``i + shift - win_left <= j <= i + shift + win_right`` (``shift = n_k - n_q``: bottom-right alignment;
    causal is ``win_right = 0``). Tiles in ``[full_lo, full_hi)`` are whole and seen by every query of the tile
    (no mask); ``[key_lo, full_lo)`` and ``[full_hi, key_hi)`` need one; nothing outside is visited."""
    shift = n_k - n_q
    key_lo = tl.maximum(start_m + shift - win_left, 0) // BLOCK_N * BLOCK_N
    key_hi = tl.minimum(start_m + BLOCK_M + shift + win_right, n_k)
    full_lo = tl.cdiv(tl.maximum(start_m + BLOCK_M - 1 + shift - win_left, 0), BLOCK_N) * BLOCK_N
    full_hi = tl.minimum(start_m + shift + win_right + 1, n_k) // BLOCK_N * BLOCK_N
    # an empty tile (before / past the sequence) or a window that misses every key: no key tile at all
    empty = (start_m < 0) | (start_m >= n_q) | (key_hi <= key_lo)
    key_hi = tl.where(empty, key_lo, key_hi)
    full_lo = tl.minimum(tl.maximum(full_lo, key_lo), key_hi)
    full_hi = tl.maximum(tl.minimum(full_hi, key_hi), full_lo)
    return key_lo, full_lo, full_hi, key_hi


@triton.jit
def _query_ranges(start_n, n_q, n_k, win_left, win_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(q_lo, full_lo, full_hi, q_hi)``: the query tiles that see the key tile at ``start_n`` (the transpose
    of :func:`_key_ranges`; rows in ``[full_lo, full_hi)`` see the whole key tile)."""
    shift = n_k - n_q
    q_lo = tl.maximum(start_n - shift - win_right, 0) // BLOCK_M * BLOCK_M
    q_hi = tl.minimum(start_n + BLOCK_N - shift + win_left, n_q)
    full_lo = tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - shift - win_right, 0), BLOCK_M) * BLOCK_M
    full_hi = tl.minimum(start_n - shift + win_left + 1, n_q) // BLOCK_M * BLOCK_M
    empty = (start_n >= n_k) | (q_hi <= q_lo)
    q_hi = tl.where(empty, q_lo, q_hi)
    full_lo = tl.minimum(tl.maximum(full_lo, q_lo), q_hi)
    full_hi = tl.maximum(tl.minimum(full_hi, q_hi), full_lo)
    return q_lo, full_lo, full_hi, q_hi


@triton.jit
def _visible(queries, keys, n_k, shift, win_left, win_right, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """``[queries, keys]`` mask (keys past ``n_k`` are never visible). Without a window (``WINDOW`` constexpr
    False) only the causal diagonal is compared: fewer registers in the common case."""
    visible = keys[None, :] < n_k
    if WINDOW:
        rel = keys[None, :] - queries[:, None] - shift
        visible = visible & (rel <= win_right) & (rel >= -win_left)
    elif CAUSAL:
        visible = visible & (keys[None, :] <= queries[:, None] + shift)
    return visible


@triton.jit
def _scores(qk, qk_scale, softcap, SOFTCAP: tl.constexpr):
    """Scores in log2 units from the raw products ``qk = q·kᵀ``, and the tanh the softcap backward needs.

    Without ``SOFTCAP``: ``qk · qk_scale`` (``qk_scale = softmax_scale · log2(e)``), tanh unused (returned as
    ``qk``). With it (flash-attn's logit softcap ``c · tanh(s / c)`` of the scaled scores ``s``): ``qk_scale =
    softmax_scale / c`` and ``softcap = c · log2(e)``, so the scores are ``softcap · t`` with ``t = tanh(qk ·
    qk_scale)``; ``d(c · tanh(s / c)) / ds = 1 - t²``. tanh(y) = 1 - 2 / (exp(2y) + 1) saturates at ±1."""
    x = qk * qk_scale
    if SOFTCAP:
        t = 1.0 - 2.0 / (tl.math.exp2(x * 2.8853900817779268) + 1.0)  # exp(2y) = exp2(2 log2(e) y)
        return t * softcap, t
    return x, x


# ----------------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------------
@triton.jit
def _load_kv(k_tile, v_tile, keys, n_k, d_mask, dv_mask, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
             EVEN_DV: tl.constexpr):
    """K and V tiles; edge tiles masked to zero. A whole tile whose head dim fills its block loads unmasked. V may
    have a head dim of its own (MLA: ``dv_mask`` / ``EVEN_DV``; the same as K's otherwise, so the same code)."""
    if MASKED:
        rows = keys[:, None] < n_k
        return (tl.load(k_tile, mask=rows & d_mask[None, :], other=0.0),
                tl.load(v_tile, mask=rows & dv_mask[None, :], other=0.0))
    if EVEN_D:
        k = tl.load(k_tile)
    else:
        k = tl.load(k_tile, mask=d_mask[None, :], other=0.0)
    if EVEN_DV:
        v = tl.load(v_tile)
    else:
        v = tl.load(v_tile, mask=dv_mask[None, :], other=0.0)
    return k, v


@triton.jit
def _box(desc, b, h, row, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """The ``[ROWS, BLOCK_D]`` tile of (batch ``b``, head ``h``) starting at ``row``, from a host-made descriptor
    over a ``[batch, heads, rows, d]`` tensor whose box is ``[1, 1, ROWS, BLOCK_D]`` (:func:`.launch._descriptor`);
    boxes past the tensor's edges read as zeros, stores clip."""
    return tl.reshape(desc.load([b, h, row, 0]), (ROWS, BLOCK_D))


@triton.jit
def _dense_query_program(n_heads, group, n_q, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """``(b, h, h_kv, start_m)`` of a program over (query tile, batch x head) of a dense batch."""
    pid_bh = tl.program_id(1)
    h = pid_bh % n_heads
    return pid_bh // n_heads, h, h // group, _query_tile_start(tl.program_id(0), n_q, CAUSAL, BLOCK_M)

