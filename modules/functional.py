"""Functional reference ops, written out so that every step is visible (the numerical spec).

All of them accept any number of leading dims.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as TF
from einops import einsum, rearrange


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax along ``dim``; the max is subtracted first so ``exp`` never overflows. 16-bit inputs are computed in
    fp32 and the result rounded once to their dtype (as ``torch.softmax`` does): a sum of many bf16 terms would
    otherwise lose the small ones."""
    work = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    shifted = work - work.amax(dim=dim, keepdim=True)
    exp = torch.exp(shifted)
    return (exp / exp.sum(dim=dim, keepdim=True)).to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU (swish): ``x * sigmoid(x)``."""
    return x * torch.sigmoid(x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """``log(1 + e^x)``, and ``x`` itself past 20 where the two agree in fp32 (PyTorch's and transformers' form)."""
    return TF.softplus(x)


def causal_mask(n_queries: int, n_keys: int, device=None, window: int | None = None) -> torch.Tensor:
    """Boolean ``[n_queries, n_keys]`` mask, True = attend, aligned to the bottom-right.

    Query ``i`` sees key ``j`` when ``j <= i + n_keys - n_queries``: with ``n_queries == n_keys`` that is
    the usual lower triangle; with fewer queries (decoding against a KV cache) the queries are the
    *last* positions of the sequence. A sliding ``window`` also drops keys more than ``window - 1`` positions
    back (the query sees its ``window`` most recent positions, its own included).
    """
    q = torch.arange(n_queries, device=device)[:, None] + (n_keys - n_queries)
    k = torch.arange(n_keys, device=device)[None, :]
    visible = k <= q
    return visible if window is None else visible & (k > q - window)


def scaled_dot_product_attention(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor,
                                 mask: torch.Tensor | None = None, *, scale: float | None = None,
                                 softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(Q Kᵀ · scale) V``, ``scale`` defaulting to ``1 / sqrt(d_k)``.

    Args:
        Q: ``[..., queries, d_k]``; K: ``[..., keys, d_k]``; V: ``[..., keys, d_v]``.
        mask: optional boolean ``[..., queries, keys]`` (broadcastable), True = attend. A query row with
            no key to attend to yields zeros.
        softcap: when > 0, the scaled scores ``s`` become ``softcap · tanh(s / softcap)`` before the softmax
            (Gemma 2's attention logit cap; flash-attn's ``softcap``).
        sinks: optional logits broadcastable to ``[..., queries]`` (gpt-oss's attention sinks: ``[heads, 1]`` for
            ``[..., heads, queries, d]``): each row's softmax gains one more logit that no value carries,
            ``p_j = exp(s_j) / (exp(sink) + Σ_k exp(s_k))``.
    Returns:
        ``[..., queries, d_v]``.
    """
    if Q.shape[-1] != K.shape[-1]:
        raise ValueError(f"Q and K head dims differ: {Q.shape[-1]} vs {K.shape[-1]}")
    if K.shape[-2] != V.shape[-2]:
        raise ValueError(f"K and V key counts differ: {K.shape[-2]} vs {V.shape[-2]}")
    scores = einsum(Q, K, "... queries d_k, ... keys d_k -> ... queries keys")
    scores = scores / math.sqrt(Q.shape[-1]) if scale is None else scores * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be boolean (True = attend), got {mask.dtype}")
        # a finite fill keeps fully-masked rows NaN-free (uniform softmax), and they are zeroed below
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    if sinks is not None:  # the sink's column joins the softmax, then is dropped: it carries no value
        column = sinks.to(scores.dtype).unsqueeze(-1).expand(*scores.shape[:-1], 1)
        probs = softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    else:
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


def _clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gated unit: ``(clamp(up, ±limit) + 1) · g·σ(alpha·g)`` with ``g = min(gate, limit)``."""
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(alpha * gate))


def moe_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up_proj: torch.Tensor, down_proj: torch.Tensor, *, activation: str = "silu",
                gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                alpha: float = 1.702, limit: float = 7.0, gate_up_layout: str = "stacked") -> torch.Tensor:
    """The routed experts' FFNs, one expert at a time (the readable spec of ``kernels.moe_experts``).

    For every expert ``e`` and the (token, slot) pairs routed to it: ``[g, u] = x gate_up_proj[e]ᵀ (+ gate_up_bias[e])``
    (``[2I, H]``: gate rows first, or with ``gate_up_layout="interleaved"`` alternating gate / up rows), ``h =
    act(g) * u`` (or gpt-oss's ``"swiglu_clamped"``), ``y = h down_proj[e]ᵀ (+ down_bias[e])``, added to each token's
    output with the pair's routing weight. ``hidden [..., H]``, ``top_k_index / top_k_weights [..., K]``.
    """
    acts = {"silu": lambda g, u: silu(g) * u,
            "gelu_tanh": lambda g, u: torch.nn.functional.gelu(g, approximate="tanh") * u,
            "swiglu_clamped": lambda g, u: _clamped_swiglu(g, u, alpha, limit)}
    if activation not in acts:
        raise ValueError(f"activation must be one of {tuple(acts)}, got {activation!r}")
    if gate_up_layout not in ("stacked", "interleaved"):
        raise ValueError(f"gate_up_layout must be 'stacked' or 'interleaved', got {gate_up_layout!r}")
    d_ff = gate_up_proj.shape[1] // 2
    x = hidden.reshape(-1, hidden.shape[-1])
    index = top_k_index.reshape(x.shape[0], -1)
    weights = top_k_weights.reshape(x.shape[0], -1)
    out = torch.zeros_like(x)
    for e in range(gate_up_proj.shape[0]):
        token, slot = (index == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        gate_up = einsum(x[token], gate_up_proj[e], "pairs d_model, d_ff2 d_model -> pairs d_ff2")
        if gate_up_bias is not None:
            gate_up = gate_up + gate_up_bias[e]
        if gate_up_layout == "interleaved":
            gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
        else:
            gate, up = gate_up[:, :d_ff], gate_up[:, d_ff:]
        y = einsum(acts[activation](gate, up), down_proj[e], "pairs d_ff, d_model d_ff -> pairs d_model")
        if down_bias is not None:
            y = y + down_bias[e]
        # (the routing weight multiplies in the promoted dtype, as transformers' eager experts do; then x's dtype)
        out = out.index_add(0, token, (y * weights[token, slot, None]).to(out.dtype))
    return out.reshape(hidden.shape)


def moe_router(hidden: torch.Tensor, weight: torch.Tensor, top_k: int, norm_topk_prob: bool = True, *,
               scoring: str = "softmax", logit_bias: torch.Tensor | None = None,
               choice_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
               routed_scaling_factor: float = 1.0, softmax_after_topk: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing of ``hidden [..., H]`` by a router ``weight [E, H]``.

    Returns ``(router_logits [T, E]``, ``top_k_weights [T, K]``, ``top_k_index [T, K])`` for the ``T`` tokens of the
    flattened leading dims; ``router_logits`` are the raw logits, before softmax or sigmoid.

    ``scoring="softmax"`` (Mixtral / Qwen3-MoE): logits in hidden's dtype, their softmax taken in fp32, the ``top_k``
    largest probabilities kept and, with ``norm_topk_prob``, renormalised to sum to 1 per token. ``logit_bias [E]``:
    the router's linear bias (gpt-oss), added to the logits (it moves both the choice and the weights).
    ``softmax_after_topk`` (gpt-oss): the ``top_k`` largest logits are chosen and their softmax, in the logits'
    dtype, is the weights.

    ``scoring="sigmoid"`` (DeepSeek-V3, GLM-4.5): logits in fp32, scores ``sigmoid(logits)``. ``choice_bias [E]``
    (DeepSeek-V3's ``e_score_correction_bias``) is added to the scores only to choose experts. The experts are
    split into ``n_group`` contiguous groups; each group is ranked by the sum of its two best biased scores, the
    ``topk_group`` best groups stay, and the ``top_k`` best biased scores among their experts are chosen. The
    weights are the chosen experts' unbiased scores, renormalised with ``norm_topk_prob`` (a 1e-20 floor in the
    sum), then times ``routed_scaling_factor``.
    """
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"moe_router: scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    if scoring == "sigmoid":
        return _sigmoid_router(flat, weight, top_k, norm_topk_prob, choice_bias, n_group, topk_group,
                               routed_scaling_factor)
    if choice_bias is not None or n_group != 1 or routed_scaling_factor != 1.0:
        raise ValueError("moe_router: choice_bias, n_group > 1 and routed_scaling_factor belong to scoring='sigmoid'")
    logits = einsum(flat, weight, "tokens d_model, experts d_model -> tokens experts")
    if logit_bias is not None:
        logits = logits + logit_bias
    if softmax_after_topk:
        top_logits, top_k_index = torch.topk(logits, top_k, dim=-1)
        return logits, softmax(top_logits, dim=-1), top_k_index
    probs = softmax(logits.float(), dim=-1)
    top_k_weights, top_k_index = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top_k_weights = top_k_weights / top_k_weights.sum(dim=-1, keepdim=True)
    return logits, top_k_weights, top_k_index


def _sigmoid_router(flat, weight, top_k, norm_topk_prob, choice_bias, n_group, topk_group, routed_scaling_factor):
    """:func:`moe_router`'s ``scoring="sigmoid"`` (its docstring), written out step by step."""
    n_experts = weight.shape[0]
    if n_group < 1 or n_experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"moe_router: {n_experts} experts cannot form n_group={n_group} groups with "
                         f"topk_group={topk_group} kept")
    if top_k > topk_group * (n_experts // n_group):
        raise ValueError(f"moe_router: top_k={top_k} exceeds the {topk_group * (n_experts // n_group)} experts of "
                         f"the {topk_group} kept groups")
    logits = einsum(flat.float(), weight.float(), "tokens d_model, experts d_model -> tokens experts")
    scores = torch.sigmoid(logits)
    biased = scores if choice_bias is None else scores + choice_bias.float()
    # ---- groups: each ranked by the sum of its two best biased scores (one expert per group: that score)
    grouped = rearrange(biased, "tokens (groups experts) -> tokens groups experts", groups=n_group)
    group_scores = torch.topk(grouped, min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    kept_groups = torch.topk(group_scores, topk_group, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    candidates = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(1)
    # ---- experts: the best biased scores among the kept groups; weights from the unbiased scores
    top_k_index = torch.topk(candidates, top_k, dim=-1).indices
    top_k_weights = scores.gather(1, top_k_index)
    if norm_topk_prob:
        top_k_weights = top_k_weights / (top_k_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, top_k_weights * routed_scaling_factor, top_k_index


def load_balancing_loss(router_logits, num_experts: int, top_k: int,
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Switch Transformer's auxiliary loss over every MoE layer's ``router_logits [T, E]`` (a list or tuple):
    ``E · Σ_e f_e · P_e`` with ``f_e`` the fraction of (token, slot) assignments to expert e and ``P_e`` its mean
    router probability, both averaged over the layers' tokens together (transformers' ``load_balancing_loss_func``).
    ``attention_mask [batch, seq]`` (1 = real token) leaves padding out of both averages."""
    if not isinstance(router_logits, (list, tuple)) or not router_logits:
        raise ValueError("router_logits must be a non-empty list or tuple of [tokens, experts] tensors")
    device = router_logits[0].device
    assigned = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits in router_logits:
        probs = softmax(logits.float().to(device), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        keep = (torch.ones(probs.shape[0], device=device) if attention_mask is None
                else attention_mask.reshape(-1).to(device=device, dtype=torch.float32))
        assigned = assigned.scatter_add(0, chosen.reshape(-1), keep.repeat_interleave(top_k))
        prob_sum = prob_sum + (probs * keep[:, None]).sum(dim=0)
        rows = rows + keep.sum()
    return num_experts * torch.sum((assigned / rows) * (prob_sum / rows))


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  activation: str | None = None) -> torch.Tensor:
    """Depthwise causal conv1d, the readable spec of ``kernels.causal_conv1d_fn``: ``x [batch, D, T]``, ``weight
    [D, W]`` -> ``[batch, D, T]``; output ``t`` sees inputs ``t - W + 1 .. t`` (zero before the sequence), then the
    bias and, with ``activation="silu"``, SiLU. Computed in fp32 (fp64 for fp64 inputs), returned in x's dtype."""
    n_taps = weight.shape[-1]
    work = torch.promote_types(x.dtype, torch.float32)  # (fp64 inputs stay fp64)
    padded = TF.pad(x.to(work), (n_taps - 1, 0))  # W - 1 zeros before the first input
    out = TF.conv1d(padded, weight.to(work).unsqueeze(1), None if bias is None else bias.to(work), groups=x.shape[1])
    return (silu(out) if activation is not None else out).to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(Σ x² + eps)`` over the last axis (flash-linear-attention's and transformers' ``l2norm``)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     scale: float | None = None, initial_state: torch.Tensor | None = None,
                     output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                     cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule token by token, the readable spec of ``kernels.chunk_gated_delta_rule`` and
    ``kernels.fused_recurrent_gated_delta_rule``. ``q, k [batch, seq, heads, d_k]``, ``v [batch, seq, v_heads, d_v]``
    (value head ``j`` reads query/key head ``j // (v_heads / heads)``), ``g, beta [batch, seq, v_heads]``. Per value
    head, with the state ``S [d_k, d_v]``::

        S = S · exp(g_t);   S = S + k_t ⊗ beta_t (v_t − Sᵀ k_t);   o_t = scale · Sᵀ q_t

    ``cu_seqlens [docs + 1]`` (batch 1) restarts the state at each document. Computed in fp32; returns ``(o [batch,
    seq, v_heads, d_v]`` in v's dtype, the final state ``[docs or batch, v_heads, d_k, d_v]`` fp32 or None). fp64
    inputs are computed in fp64 (the tests' recomputation)."""
    out_dtype = v.dtype
    work = torch.float64 if v.dtype == torch.float64 else torch.float32
    n_heads, n_v_heads, d_k = k.shape[2], v.shape[2], k.shape[3]
    q, k, v, g, beta = (t.to(work) for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * (d_k ** -0.5 if scale is None else scale)
    group = n_v_heads // n_heads
    q, k = (t.repeat_interleave(group, dim=2) for t in (q, k))
    if cu_seqlens is None:
        docs = [(b, 0, q.shape[1]) for b in range(q.shape[0])]
    else:
        bounds = cu_seqlens.tolist()
        docs = [(0, start, end) for start, end in zip(bounds[:-1], bounds[1:])]
    out = torch.zeros_like(v)
    finals = []
    for n, (b, start, end) in enumerate(docs):
        state = (torch.zeros(n_v_heads, d_k, v.shape[3], device=v.device, dtype=work) if initial_state is None
                 else initial_state[n].to(work))
        for t in range(start, end):
            state = state * g[b, t].exp()[:, None, None]
            predicted = einsum(state, k[b, t], "heads d_k d_v, heads d_k -> heads d_v")
            state = state + einsum(k[b, t], beta[b, t, :, None] * (v[b, t] - predicted),
                                   "heads d_k, heads d_v -> heads d_k d_v")
            out[b, t] = einsum(state, q[b, t], "heads d_k d_v, heads d_k -> heads d_v")
        finals.append(state)
    return out.to(out_dtype), (torch.stack(finals) if output_final_state else None)


def log_probs(logits: torch.Tensor, targets: torch.Tensor | None = None, *, temperature: float = 1.0,
              ignore_index: int = -100, softcap: float | None = None):
    """``(log p_t, H)`` per position of ``softmax(cap(logits) / temperature)``, in fp32: the chosen token's
    log-probability (0 at ``ignore_index``; None without targets) and the entropy ``-Σ p log p`` (the readable twin of
    :func:`tritonlm.kernels.linear_log_probs`, :func:`~tritonlm.kernels.selective_log_softmax`,
    :func:`~tritonlm.kernels.entropy_from_logits`)."""
    z = logits.float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    log_p = torch.log_softmax(z / temperature, dim=-1)
    entropy = -einsum(log_p.exp(), log_p, "... vocab, ... vocab -> ...")
    if targets is None:
        return None, entropy
    keep = targets != ignore_index
    chosen = log_p.gather(-1, torch.where(keep, targets, 0).long().unsqueeze(-1)).squeeze(-1)
    return torch.where(keep, chosen, 0.0), torch.where(keep, entropy, 0.0)


def divergence(student_logp: torch.Tensor, teacher_logp: torch.Tensor, beta: float = 0.5) -> torch.Tensor:
    """Per position, the generalised JSD of the teacher ``P`` and the student ``Q`` given as log-probabilities
    (``beta`` 0: ``KL(P || Q)``, 1: ``KL(Q || P)``; else ``β KL(P || M) + (1 - β) KL(Q || M)``, ``M = β P + (1 - β)
    Q``), in fp32: the readable twin of :func:`tritonlm.kernels.jsd`."""
    x, y = student_logp.float(), teacher_logp.float()
    p, q = y.exp(), x.exp()
    if beta == 0:
        return (p * (y - x)).sum(-1)
    if beta == 1:
        return (q * (x - y)).sum(-1)
    log_m = torch.logaddexp(y + math.log(beta), x + math.log(1 - beta))
    return (beta * p * (y - log_m) + (1 - beta) * q * (x - log_m)).sum(-1)
