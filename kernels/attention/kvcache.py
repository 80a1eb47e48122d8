"""``flash_attn_with_kvcache``: attention of new queries against a KV cache, flash-attn 2's signature and semantics.

The cache is dense (``[batch_cache, seqlen_cache, kv_heads, d]``, row ``cache_batch_idx[b]`` for batch ``b``) or
paged (``[num_blocks, page_size, kv_heads, d]`` with ``block_table [batch, max_blocks]`` int32: position ``p`` of
sequence ``b`` lives in block ``block_table[b, p // page_size]`` at row ``p % page_size``). ``cache_seqlens`` says
how many positions each sequence holds. New keys / values ``k, v [batch, seqlen_new, kv_heads, d]`` are written into
the cache in place at positions ``cache_seqlens[b] + j`` (after RoPE when ``rotary_cos/sin`` are given) and attended
in the same call; sequence ``b`` then has ``cache_seqlens[b] + seqlen_new`` keys, and causal masks align the queries
to its last positions (bottom-right). ``cache_leftpad [batch]`` (int32, dense caches) says where each sequence's
keys start: positions before it are padding, never attended (RoPE positions stay cache positions, as in
flash-attn). ``rotary_cos/sin [seqlen_ro, rotary_dim / 2]`` rotate the first ``rotary_dim`` dims of q and the new
k (``rotary_dim`` even, at most ``d``); the rest pass through. Every step runs on the device without a host sync; the forward kernel reads
each sequence's key count, cache row and block table itself (split over programs for few queries and long caches,
the flash-decoding path).

Not built, each a one-line error: ``alibi_slopes``, and ``cache_leftpad`` with a paged cache (flash-attn refuses
that combination too).
"""

from __future__ import annotations

import math

import torch

from .._common import check_device, check_float
from .interface import _check_window, _unsupported
from .launch import check_sinks, flash_attention_forward


def _as_lengths(cache_seqlens, batch: int, device) -> torch.Tensor:
    """``cache_seqlens`` as an int32 ``[batch]`` tensor on ``device`` (an int applies to every sequence)."""
    if cache_seqlens is None:
        raise ValueError("flash_attn_with_kvcache: cache_seqlens is required (how many positions each cache holds)")
    if isinstance(cache_seqlens, int):
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype != torch.int32 \
            or cache_seqlens.shape != (batch,):
        raise TypeError(f"flash_attn_with_kvcache: cache_seqlens must be an int or an int32 [{batch}] tensor, got "
                        f"{getattr(cache_seqlens, 'dtype', type(cache_seqlens).__name__)} "
                        f"{tuple(getattr(cache_seqlens, 'shape', ()))}")
    if cache_seqlens.device != device:
        raise ValueError(f"flash_attn_with_kvcache: cache_seqlens is on {cache_seqlens.device}, q on {device}")
    return cache_seqlens


def _check_fits(lengths: torch.Tensor, capacity: int, what: str) -> None:
    """Every sequence's keys (cached + new) fit in ``capacity`` positions: checked now where the lengths are on the
    CPU, by a device-side assert on a GPU (no host sync)."""
    if lengths.device.type == "cpu":
        if lengths.numel() and int(lengths.min()) < 0:
            raise ValueError(f"flash_attn_with_kvcache: cache_seqlens must be >= 0, got {lengths.tolist()}")
        worst = int(lengths.max()) if lengths.numel() else 0
        if worst > capacity:
            raise ValueError(f"flash_attn_with_kvcache: a sequence needs {worst} positions but {what} holds "
                             f"{capacity}")
    else:
        torch._assert_async(((lengths >= 0) & (lengths <= capacity)).all(),
                            f"flash_attn_with_kvcache: a sequence needs more positions than {what} holds")


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            sinks=None):
    """``q [batch, seqlen_q, heads, d]`` against the cache (plus ``k, v`` appended in place) -> ``out [batch,
    seqlen_q, heads, d]`` (and the fp32 logsumexp ``[batch, heads, seqlen_q]`` with ``return_softmax_lse``).
    ``sinks[heads]``: attention sinks (gpt-oss), applied once per row (split-KV: in the combine; the logsumexp
    includes them). See the module docstring; not differentiable (an inference entry point, as in flash-attn)."""
    op = "flash_attn_with_kvcache"
    _unsupported(op, 0.0, softcap, alibi_slopes, False)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{op}: {name} must be a 4-D tensor, got {tuple(getattr(t, 'shape', ()))}")
    check_float(op, q, k_cache, v_cache)
    check_device(op, q, k_cache, v_cache)
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"{op}: q, k_cache, v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if k_cache.shape[:-1] != v_cache.shape[:-1]:
        # (v_cache's head dim may differ from k_cache's: MLA; the output has v's)
        raise ValueError(f"{op}: k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    batch, seqlen_q, heads, d = q.shape
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != d or heads % kv_heads:
        raise ValueError(f"{op}: k_cache {tuple(k_cache.shape)} must have head dim {d} and a number of heads that "
                         f"divides q's {heads}")
    window = _check_window(op, window_size)
    lengths = _as_lengths(cache_seqlens, batch, q.device)
    if num_splits < 0 or not isinstance(num_splits, int):
        raise ValueError(f"{op}: num_splits must be an int >= 0 (0: chosen here), got {num_splits!r}")

    # ---- where each sequence's positions live: a cache row (dense) or its block table (paged)
    paged = block_table is not None
    if paged:
        if cache_batch_idx is not None:
            raise ValueError(f"{op}: cache_batch_idx applies to dense caches; a paged cache uses block_table")
        if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != batch:
            raise TypeError(f"{op}: block_table must be int32 [{batch}, max_blocks], got {block_table.dtype} "
                            f"{tuple(block_table.shape)}")
        if block_table.device != q.device:
            raise ValueError(f"{op}: block_table is on {block_table.device}, q on {q.device}")
        page_size = k_cache.shape[1]
        if page_size % 16:
            raise ValueError(f"{op}: the paged cache's block size ({page_size}) must be a multiple of 16")
        capacity = block_table.shape[1] * page_size
        kv_batch = None
    else:
        page_size, capacity = 0, k_cache.shape[1]
        if cache_batch_idx is None:
            if k_cache.shape[0] < batch:
                raise ValueError(f"{op}: k_cache holds {k_cache.shape[0]} sequences, q {batch} (give cache_batch_idx)")
            kv_batch = torch.arange(batch, dtype=torch.int32, device=q.device)
        else:
            if cache_batch_idx.dtype != torch.int32 or cache_batch_idx.shape != (batch,):
                raise TypeError(f"{op}: cache_batch_idx must be int32 [{batch}], got {cache_batch_idx.dtype} "
                                f"{tuple(cache_batch_idx.shape)}")
            kv_batch = cache_batch_idx
    if cache_leftpad is not None:
        if paged:
            raise NotImplementedError(f"{op}: cache_leftpad with a paged cache (block_table) is not supported")
        if not isinstance(cache_leftpad, torch.Tensor) or cache_leftpad.dtype != torch.int32 \
                or cache_leftpad.shape != (batch,) or cache_leftpad.device != q.device:
            raise TypeError(f"{op}: cache_leftpad must be an int32 [{batch}] tensor on {q.device}, got "
                            f"{getattr(cache_leftpad, 'dtype', type(cache_leftpad).__name__)} "
                            f"{tuple(getattr(cache_leftpad, 'shape', ()))}")
        _check_leftpad(cache_leftpad, lengths)

    # ---- new keys and values: RoPE at their positions, then written into the cache in place
    new = 0
    if (k is None) != (v is None):
        raise ValueError(f"{op}: give both k and v, or neither")
    if k is not None:
        d_v = v_cache.shape[3]
        if (k.dim() != 4 or v.dim() != 4 or k.shape[0] != batch or k.shape[2:] != (kv_heads, d)
                or v.shape != (*k.shape[:3], d_v)):
            raise ValueError(f"{op}: k and v must be [{batch}, seqlen_new, {kv_heads}, {d}] and [..., {d_v}], got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        if k.dtype != q.dtype:
            raise TypeError(f"{op}: k is {k.dtype} but q is {q.dtype}")
        new = k.shape[1]
    total = lengths + new  # keys of each sequence after this call
    _check_fits(total, capacity, "the block table" if paged else "k_cache")
    positions = lengths[:, None].long() + torch.arange(max(new, seqlen_q), device=q.device)  # [batch, positions]
    if rotary_cos is not None:
        if rotary_sin is None or rotary_cos.dim() != 2 or rotary_cos.shape[0] < capacity:
            raise ValueError(f"{op}: rotary_cos/sin must be [seqlen_ro, rotary_dim / 2] with seqlen_ro >= the cache's "
                             f"{capacity} positions, got {tuple(rotary_cos.shape)}")
        q, k = _rotate(op, q, k, rotary_cos, rotary_sin, positions, causal or window != (-1, -1), seqlen_q, new,
                       rotary_interleaved)
    if new:
        pos = positions[:, :new]
        if paged:
            rows = block_table.long().gather(1, pos // page_size)
            k_cache[rows, pos % page_size] = k
            v_cache[rows, pos % page_size] = v
        else:
            rows = kv_batch.long()[:, None].expand(batch, new)
            k_cache[rows, pos] = k
            v_cache[rows, pos] = v

    # ---- attention against each sequence's keys, in place in the cache ([.., seq, heads, d] -> [.., heads, seq, d])
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)
    if sinks is not None:
        check_sinks(op, sinks, heads, q.device)
    if paged:  # the pool as one long sequence of rows: block b, row r is row b * page_size + r
        k4 = k_cache.view(1, -1, kv_heads, d).transpose(1, 2)
        v4 = v_cache.view(1, -1, kv_heads, v_cache.shape[3]).transpose(1, 2)
    else:
        k4, v4 = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    out, lse = flash_attention_forward(q.transpose(1, 2), k4, v4, bool(causal), scale, window, seqused_k=total,
                                       kv_batch=kv_batch, block_table=block_table, page_size=page_size,
                                       max_seqlen_k=capacity, num_splits=num_splits, softcap=float(softcap),
                                       leftpad=cache_leftpad, sinks=sinks)
    out = out.transpose(1, 2)
    return (out, lse) if return_softmax_lse else out


def _check_leftpad(leftpad: torch.Tensor, lengths: torch.Tensor) -> None:
    """``0 <= cache_leftpad <= cache_seqlens``: checked where both are on the CPU, by a device assert elsewhere."""
    if leftpad.device.type == "cpu" and lengths.device.type == "cpu":
        if bool(((leftpad < 0) | (leftpad > lengths)).any()):
            raise ValueError(f"flash_attn_with_kvcache: cache_leftpad must be in [0, cache_seqlens]; got "
                             f"{leftpad.tolist()} for cache_seqlens {lengths.tolist()}")
    else:
        torch._assert_async(((leftpad >= 0) & (leftpad <= lengths)).all(),
                            "flash_attn_with_kvcache: cache_leftpad must be in [0, cache_seqlens]")


def _rotate(op, q, k, cos, sin, positions, causal_or_local, seqlen_q, new, interleaved):
    """RoPE on q and the new k with the RoPE kernel: k at its cache positions; q at the same positions when causal
    or windowed (its rows are the sequence's last), else every query at the first new position (flash-attn's
    rule). With ``rotary_dim < d`` only the first ``rotary_dim`` dims turn."""
    from ..rope import apply_rope

    if cos.dim() != 2 or sin.shape != cos.shape:
        raise ValueError(f"{op}: rotary_cos and rotary_sin must be [seqlen_ro, rotary_dim / 2], got "
                         f"{tuple(cos.shape)} and {tuple(getattr(sin, 'shape', ()))}")
    rotary_dim = 2 * cos.shape[1]
    if not 0 < rotary_dim <= q.shape[-1]:
        raise ValueError(f"{op}: rotary_dim {rotary_dim} (2 x rotary_cos.shape[1]) must be in [2, {q.shape[-1]}]")
    layout = "interleaved" if interleaved else "half"

    def turn(x, pos):  # x [batch, seq, heads, d] at pos [batch, seq]
        part = x[..., :rotary_dim].transpose(1, 2)
        turned = apply_rope(part, None, pos[:, None, :], cos=cos, sin=sin, check_positions=False,
                            layout=layout).transpose(1, 2)
        return turned if rotary_dim == x.shape[-1] else torch.cat((turned, x[..., rotary_dim:]), dim=-1)

    q_pos = positions[:, :seqlen_q] if causal_or_local else positions[:, :1].expand(-1, seqlen_q)
    q = turn(q, q_pos)
    if k is not None and new:
        k = turn(k, positions[:, :new])
    return q, k
