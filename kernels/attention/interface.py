"""flash-attn 2's call signatures on top of :class:`~tritonlm.kernels.FlashAttention`.

``flash_attn_func`` takes ``[batch, seq, heads, d]`` tensors, ``flash_attn_varlen_func`` packed
``[total_tokens, heads, d]`` sequences with int32 cumulative lengths ``cu_seqlens`` (``batch + 1`` entries,
starting at 0). Both follow flash-attn's semantics: k and v may have fewer heads than q (GQA / MQA), causal
masks align to the bottom-right corner (query ``i`` of ``n_q`` sees key ``j`` of ``n_k`` when
``j <= i + n_k - n_q``), ``window_size=(left, right)`` keeps keys ``j`` in ``[i + n_k - n_q - left,
i + n_k - n_q + right]`` with -1 meaning unbounded, and the default scale is ``1 / sqrt(d)``. They are
differentiable (the Triton backward); ``deterministic`` keeps flash-attn's meaning: False (its default) runs the
backward that adds dQ with fp32 atomics inside the dK/dV kernel (fewer matmuls, summation order varies by run),
True the two-kernel backward whose every gradient is bitwise reproducible. ``flash_attn_varlen_func`` launches
without a host sync, trusting ``max_seqlen_q/k`` as flash-attn does; ``cu_seqlens`` values are checked only
where reading them is free (CPU tensors); with ``block_table`` it reads keys from a paged pool (prefill; forward
only). ``softcap > 0`` caps the scaled scores at ``softcap · tanh(s / softcap)`` before the softmax (forward and
backward). What is not built — dropout, ALiBi, returning attention probabilities — is a one-line error naming the
argument, never silently ignored. The kernels never visit a key tile outside a query's
sequence or window.
"""

from __future__ import annotations

import torch

from .launch import FlashAttention


def _unsupported(op: str, dropout_p, softcap, alibi_slopes, return_attn_probs, block_table=None) -> None:
    if dropout_p:
        raise NotImplementedError(f"{op}: dropout_p={dropout_p} is not supported (attention dropout is not built)")
    if not isinstance(softcap, (int, float)) or softcap < 0 or softcap != softcap or softcap == float("inf"):
        raise ValueError(f"{op}: softcap must be a finite number >= 0 (0: no cap), got {softcap!r}")
    if alibi_slopes is not None:
        raise NotImplementedError(f"{op}: alibi_slopes is not supported")
    if return_attn_probs:
        raise NotImplementedError(f"{op}: return_attn_probs=True is not supported (the kernel never forms P)")
    if block_table is not None:
        raise NotImplementedError(f"{op}: block_table (paged KV cache) is not supported")


def _check_window(op: str, window_size) -> tuple[int, int]:
    try:
        left, right = (int(w) for w in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"{op}: window_size must be (left, right) ints, got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"{op}: window_size entries must be >= -1 (-1 = unbounded), got {window_size!r}")
    return left, right


def _check_heads(op: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if k.shape[-2] != v.shape[-2]:
        # (v's head dim may differ from q/k's: MLA; the output has v's)
        raise ValueError(f"{op}: k {tuple(k.shape)} and v {tuple(v.shape)} must have the same heads")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{op}: head dims differ: q {q.shape[-1]}, k {k.shape[-1]}")
    if k.shape[-2] == 0 or q.shape[-2] % k.shape[-2]:
        raise ValueError(f"{op}: q has {q.shape[-2]} heads, not a multiple of k/v's {k.shape[-2]}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{op}: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, sinks=None):
    """Attention over ``q[batch, seq_q, heads, d]``, ``k, v[batch, seq_k, kv_heads, d]`` -> ``[batch, seq_q,
    heads, d]`` with flash-attn 2's signature and semantics (module docstring). ``sinks[heads]`` (after flash-attn's
    arguments): gpt-oss's attention sinks, one logit per query head in every row's softmax that carries no value
    (differentiable)."""
    op = "flash_attn_func"
    _unsupported(op, dropout_p, softcap, alibi_slopes, return_attn_probs)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{op}: {name} must be [batch, seq, heads, d], got {tuple(t.shape)}")
    if not (q.shape[0] == k.shape[0] == v.shape[0]) or k.shape[1] != v.shape[1]:
        raise ValueError(f"{op}: batch / key lengths differ: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    _check_heads(op, q, k, v)
    window = _check_window(op, window_size)
    # [batch, seq, heads, d] -> [batch, heads, seq, d] views: the kernel takes any strides, nothing is copied
    out = FlashAttention.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bool(causal), softmax_scale,
                               window, None, None, 0, 0, bool(deterministic), float(softcap), sinks)
    return out.transpose(1, 2)


def _check_cu_seqlens(op: str, name: str, cu: torch.Tensor, total: int | None, max_seqlen, device) -> int:
    """Shape, dtype and device of ``cu`` (no host sync); its values too where they live on the CPU (``total``: the
    row count they must end at, None for a paged pool's key counts). Returns the number of sequences."""
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
        raise TypeError(f"{op}: {name} must be a 1-D int32 tensor of cumulative lengths, got "
                        f"{getattr(cu, 'dtype', type(cu).__name__)} {tuple(getattr(cu, 'shape', ()))}")
    if cu.device != device:
        raise ValueError(f"{op}: {name} is on {cu.device} but the inputs are on {device}")
    if isinstance(max_seqlen, torch.Tensor) or int(max_seqlen) < 0:
        raise TypeError(f"{op}: max_seqlen for {name} must be a non-negative Python int, got {max_seqlen!r}")
    if _values_readable(cu):
        values = cu.tolist()
        if values[0] != 0:
            raise ValueError(f"{op}: {name} must start at 0, got {values[0]}")
        lengths = [b - a for a, b in zip(values, values[1:])]
        if any(n < 0 for n in lengths):
            raise ValueError(f"{op}: {name} must be non-decreasing, got {values}")
        if total is not None and values[-1] != total:
            raise ValueError(f"{op}: {name} ends at {values[-1]} but there are {total} tokens")
        if lengths and max(lengths) > int(max_seqlen):
            raise ValueError(f"{op}: a sequence has {max(lengths)} tokens, more than max_seqlen={max_seqlen}")
    return cu.numel() - 1


def _paged_varlen(op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                  window_size, block_table, softcap, sinks=None):
    """``flash_attn_varlen_func`` over a paged pool (its docstring): the forward kernel reads key tiles through the
    block table."""
    import math

    from .launch import check_sinks, flash_attention_forward

    if q.dim() != 3 or k.dim() != 4 or k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"{op}: with block_table, q must be [total_q, heads, d] and k, v a pool [num_blocks, "
                         f"page_size, kv_heads, d]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    _check_heads(op, q, k[0], v[0])
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise NotImplementedError(f"{op}: block_table (paged KV) is forward only; run it under torch.no_grad()")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.device != q.device:
        raise TypeError(f"{op}: block_table must be an int32 [batch, max_blocks] tensor on {q.device}, got "
                        f"{block_table.dtype} {tuple(block_table.shape)} on {block_table.device}")
    page_size = k.shape[1]
    if page_size % 16:
        raise ValueError(f"{op}: the pool's block size ({page_size}) must be a multiple of 16")
    capacity = block_table.shape[1] * page_size
    window = _check_window(op, window_size)
    n_q = _check_cu_seqlens(op, "cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, q.device)
    n_k = _check_cu_seqlens(op, "cu_seqlens_k", cu_seqlens_k, None, max_seqlen_k, q.device)
    if not n_q == n_k == block_table.shape[0]:
        raise ValueError(f"{op}: cu_seqlens_q ({n_q} sequences), cu_seqlens_k ({n_k}) and block_table "
                         f"({block_table.shape[0]} rows) disagree")
    if int(max_seqlen_k) > capacity:
        raise ValueError(f"{op}: max_seqlen_k={max_seqlen_k} exceeds the block table's {capacity} positions")
    kv_heads, d = k.shape[2], k.shape[3]
    if sinks is not None:
        check_sinks(op, sinks, q.shape[1], q.device)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)
    out, _ = flash_attention_forward(q, k.view(-1, kv_heads, d), v.view(-1, kv_heads, v.shape[3]), bool(causal), scale,
                                     window,
                                     cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                     block_table=block_table, page_size=page_size, softcap=float(softcap), sinks=sinks)
    return out


def _values_readable(t: torch.Tensor) -> bool:
    """Reading a tensor's values costs no device sync: it is on the CPU."""
    return t.device.type == "cpu"


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, sinks=None):
    """Attention within each packed sequence: ``q[total_q, heads, d]``, ``k, v[total_k, kv_heads, d]``, sequence
    ``i`` owning query rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` and the matching key rows; returns
    ``[total_q, heads, d]``. flash-attn 2's signature and semantics (module docstring).

    Paged prefill: with ``block_table [batch, max_blocks]`` (int32), ``k, v`` are a pool ``[num_blocks, page_size,
    kv_heads, d]`` and ``cu_seqlens_k`` the sequences' cumulative key counts; position ``p`` of sequence ``i`` is row
    ``p % page_size`` of block ``block_table[i, p // page_size]``. Forward only (an inference path, as in
    flash-attn). ``sinks[heads]``: attention sinks, as in :func:`flash_attn_func`."""
    op = "flash_attn_varlen_func"
    _unsupported(op, dropout_p, softcap, alibi_slopes, return_attn_probs)
    if block_table is not None:
        return _paged_varlen(op, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                             causal, window_size, block_table, softcap, sinks)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{op}: {name} must be [total_tokens, heads, d], got {tuple(t.shape)}")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"{op}: k has {k.shape[0]} tokens but v has {v.shape[0]}")
    _check_heads(op, q, k, v)
    window = _check_window(op, window_size)
    n_q = _check_cu_seqlens(op, "cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, q.device)
    n_k = _check_cu_seqlens(op, "cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, q.device)
    if n_q != n_k:
        raise ValueError(f"{op}: cu_seqlens_q describes {n_q} sequences but cu_seqlens_k {n_k}")
    return FlashAttention.apply(q, k, v, bool(causal), softmax_scale, window, cu_seqlens_q, cu_seqlens_k,
                                int(max_seqlen_q), int(max_seqlen_k), bool(deterministic), float(softcap), sinks)
