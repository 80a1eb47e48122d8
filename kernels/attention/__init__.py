"""Causal flash attention (FlashAttention-2) in Triton: forward, and a backward that recomputes P.

Forward, per program: one ``BLOCK_M`` tile of queries against ``BLOCK_N`` tiles of keys/values, an
online softmax with running max ``m`` and sum ``l`` in fp32 (base-2 exponentials with ``log2(e)`` folded
into the scale), and the logsumexp ``L = m + log(l)`` saved instead of P. Backward:

1. ``_bwd_preprocess``: ``D = rowsum(dO * O)`` per query;
2. ``_bwd_dkdv_kernel``: one key tile per program, looping over the query tiles that see it:
   ``P = exp(S - L)``, ``dV += Pᵀ dO``, ``dP = dO Vᵀ``, ``dS = P * (dP - D)``, ``dK += dSᵀ Q``;
3. ``_bwd_dq_kernel``: one query tile per program, looping over key tiles: ``dQ += dS K``.

Every gradient element is written by exactly one program: deterministic, no atomics.

Causality is aligned to the bottom-right: query ``i`` sees key ``j`` when ``j <= i + n_k - n_q`` (the
usual ``j <= i`` for ``n_q == n_k``; for a few queries against a long KV cache, the queries are the last
positions). Key tiles no query of a tile can see are never visited; tiles every query sees fully run
without index comparisons; only the diagonal tiles build a mask. A query with no visible key outputs zeros.

Inputs are ``[..., seq, d]`` viewed as ``[batch, heads, seq, d]`` with separate batch/head strides, so the
head-split view of a ``[batch, seq, heads*d]`` projection needs no copy. Head dims are padded to the next
power of two (≥ 16) with masked loads.

Tile sizes and warps (:func:`_fwd_config`, :func:`_bwd_config`) are a table by head dim and dtype,
chosen so the sm_90/sm_80 builds use tensor cores without spilling (``tritonlm kernels --report``
prints the evidence); causal query tiles are scheduled longest-first (the last query tiles see the most
keys) so the tail of the grid is short tiles. A tuned table measured on a GPU (``kernels/tuned``) may replace
them per GPU, dtype, head dim and kernel variant (``bf16-d128-gqa``: :func:`.launch.config_key`).

Variants: ``deterministic=False`` adds dQ with fp32 atomics inside the dK/dV kernel (no dQ kernel: 5 matmuls per
tile pair instead of 7); ``_fwd_kernel_tma``, the dense forward (GQA, sinks) with Hopper TMA loads through host-made
descriptors, is sm_90's default for fp16 / bf16 at d 128 (a tuned ``"TMA": 0`` turns it off); the backward's
``_bwd_*_kernel_tma`` run only when a tuned table (or the suite's sweep) asks for them (``"TMA": 1``).


Files, by phase (as flash-attention's own ``flash_attn/cute/``): :mod:`.tiles` (shared ``@jit`` tile
bookkeeping), :mod:`.forward` and :mod:`.backward` (the kernels), :mod:`.decode` (split-KV decoding and its
combine), :mod:`.layout` (host-side views), :mod:`.launch` (tile tables, launchers, custom ops, the autograd
Function), :mod:`.interface` (flash-attn's signatures), :mod:`.torch_twin` (the same algorithm in PyTorch).
"""

from .interface import flash_attn_func, flash_attn_varlen_func
from .kvcache import flash_attn_with_kvcache
from .launch import (
    FlashAttention,
    check_attention_inputs,
    flash_attention,
    flash_attention_backward,
    flash_attention_forward,
)
from .torch_twin import FlashAttentionTorch

__all__ = ["FlashAttention", "FlashAttentionTorch", "flash_attention", "flash_attn_func", "flash_attn_varlen_func",
           "flash_attn_with_kvcache",
           "flash_attention_forward", "flash_attention_backward", "check_attention_inputs"]
