"""Functional reference ops, written out so that every step is visible (the numerical spec).

All of them accept any number of leading dims.
"""

from __future__ import annotations

import math

import torch
from einops import einsum


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax along ``dim``; the max is subtracted first so ``exp`` never overflows."""
    shifted = x - x.amax(dim=dim, keepdim=True)
    exp = torch.exp(shifted)
    return exp / exp.sum(dim=dim, keepdim=True)


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU (swish): ``x * sigmoid(x)``."""
    return x * torch.sigmoid(x)


def causal_mask(n_queries: int, n_keys: int, device=None) -> torch.Tensor:
    """Boolean ``[n_queries, n_keys]`` mask, True = attend, aligned to the bottom-right.

    Query ``i`` sees key ``j`` when ``j <= i + n_keys - n_queries``: with ``n_queries == n_keys`` that is
    the usual lower triangle; with fewer queries (decoding against a KV cache) the queries are the
    *last* positions of the sequence.
    """
    q = torch.arange(n_queries, device=device)[:, None]
    k = torch.arange(n_keys, device=device)[None, :]
    return k <= q + (n_keys - n_queries)


def scaled_dot_product_attention(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor,
                                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(Q Kᵀ / sqrt(d_k)) V``.

    Args:
        Q: ``[..., queries, d_k]``; K: ``[..., keys, d_k]``; V: ``[..., keys, d_v]``.
        mask: optional boolean ``[..., queries, keys]`` (broadcastable), True = attend. A query row with
            no key to attend to yields zeros.
    Returns:
        ``[..., queries, d_v]``.
    """
    if Q.shape[-1] != K.shape[-1]:
        raise ValueError(f"Q and K head dims differ: {Q.shape[-1]} vs {K.shape[-1]}")
    if K.shape[-2] != V.shape[-2]:
        raise ValueError(f"K and V key counts differ: {K.shape[-2]} vs {V.shape[-2]}")
    scores = einsum(Q, K, "... queries d_k, ... keys d_k -> ... queries keys") / math.sqrt(Q.shape[-1])
    if mask is not None:
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be boolean (True = attend), got {mask.dtype}")
        # a finite fill keeps fully-masked rows NaN-free (uniform softmax), and they are zeroed below
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = softmax(scores, dim=-1)
    if mask is not None:
        probs = probs.masked_fill(~mask, 0.0)
    return einsum(probs, V, "... queries keys, ... keys d_v -> ... queries d_v")


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
                  label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None,
                  reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``logits[..., vocab]`` against integer ``targets[...]``, in fp32.

    Per non-ignored target ``t``, with ``z`` the logits (``softcap · tanh(logits / softcap)`` when a softcap is
    given) and ``lse = log Σ_j exp(z_j)`` (max-shifted, so nothing overflows; the softmax is never formed)::

        loss = (1 - label_smoothing) · (lse - z_t) + label_smoothing · mean_j (lse - z_j) + z_loss · lse²

    The first two terms are ``F.cross_entropy``'s label smoothing; the last is PaLM's z-loss. Targets equal
    to ``ignore_index`` contribute nothing. ``reduction``: "mean" over the non-ignored targets (0, not NaN,
    when there are none), "sum", or "none" (``[...]``, 0 at ignored targets).
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree: "
                         "expected logits[..., vocab] and targets[...]")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise TypeError(f"targets must be integer class ids, got {targets.dtype}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    vocab = logits.shape[-1]
    keep = targets != ignore_index
    if bool(((targets[keep] < 0) | (targets[keep] >= vocab)).any()):
        raise ValueError(f"targets must be in [0, {vocab}) or equal ignore_index ({ignore_index})")
    z = logits.float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    max_z = z.amax(dim=-1, keepdim=True)
    lse = max_z.squeeze(-1) + torch.log(torch.exp(z - max_z).sum(dim=-1))
    safe_targets = torch.where(keep, targets, 0).long()
    target_z = z.gather(-1, safe_targets.unsqueeze(-1)).squeeze(-1)
    per_token = (1.0 - label_smoothing) * (lse - target_z) + label_smoothing * (lse - z.mean(dim=-1))
    per_token = torch.where(keep, per_token + z_loss * lse * lse, 0.0)
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / keep.sum().clamp(min=1)
