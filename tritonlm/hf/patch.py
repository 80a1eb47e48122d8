"""``apply_kernels``: run a Hugging Face model instance of any family in :data:`tritonlm.hf.SUPPORTED_MODELS` through
tritonlm's kernels, in place. What to patch comes from the family's record (:class:`tritonlm.hf.family.Kernels`:
its norm, MLP, expert and attention classes by name); this module names no family.

What each switch replaces (every patch is an instance-level ``forward``, so parameters, ``state_dict``, the class
and ``save_pretrained`` are untouched, and :func:`remove_kernels` undoes it):

* ``rms_norm``: the family's RMSNorm classes -> :func:`tritonlm.kernels.rms_norm` with the family's casting:
  ``weight * (x * rstd).to(x.dtype)`` (Llama's), ``(weight * x * rstd).to(x.dtype)`` (fp32 product: OLMo) or
  ``x * rstd * (1 + weight)`` in fp32 (Gemma's offset).
* ``rope``: each attention layer's ``apply_rotary_pos_emb`` -> the RoPE kernel in the family's layout (half-split
  ``rotate_half``, or interleaved pairs) on the cos/sin HF computed (its rotary module, scaling included, stays in
  charge of the angles); a partial rotary dim turns the first features only.
* ``swiglu``: the family's MLPs -> ``down_proj(swiglu_gate(gate_proj(x), up_proj(x)))`` (GeGLU for Gemma; one fused
  ``gate_up_proj`` split into strided halves for Phi-3 / GLM-4).
* ``moe``: each stacked ``*Experts`` module (transformers 5's ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``)
  -> :func:`tritonlm.kernels.moe_experts` (grouped GEMMs, dropless); the router stays transformers' own, and a
  ``"tritonlm"`` experts implementation is registered in ``ExpertsInterface`` for models that select it by name.
* ``attention``: the model's attention implementation -> ``"tritonlm"``, registered in transformers'
  ``AttentionInterface``: flash attention with GQA (K/V never repeated), sliding windows, softcaps, and padding
  masks as packed variable-length sequences.
* ``linear_attention``: the Gated DeltaNet layers (Qwen3.5, Qwen3-Next) -> their delta rule and short convolution
  through :func:`tritonlm.kernels.chunk_gated_delta_rule` (one token against a cache: the recurrent kernel) and
  ``causal_conv1d_fn`` / ``causal_conv1d_update``, routed inside the patched layers only; ``cu_seq_lens_q`` packing
  keeps documents apart in both (transformers' torch fallback refuses packed sequences). Their gated RMSNorm is a ``rms_norm``
  target ("gated").
* ``loss``: ``forward(..., labels=...)`` -> the fused linear cross-entropy on the final hidden states, with the
  family's logit transform (Gemma's final softcap, Granite's ``logits_scaling``); the ``[batch, seq, vocab]``
  logits are never formed in training (``logits`` is then ``None``; in eval mode they are computed as well). MoE
  models keep ``output_router_logits`` and the load-balancing term as transformers computes them.
"""

from __future__ import annotations

import threading
from types import MethodType

import torch
import torch.nn.functional as F

from .family import families, family

#: transformers' activation names -> the MoE kernel's
_MOE_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
ATTENTION_NAME = "tritonlm"

_state = threading.local()  # depth of patched attention forwards on this thread (routes apply_rotary_pos_emb)
_ORIGINAL_ROTARY: dict = {}  # modeling module -> its own apply_rotary_pos_emb


def _kernels():
    from .. import kernels

    return kernels


# ----------------------------------------------------------------------------------------------------
# replacement forwards
# ----------------------------------------------------------------------------------------------------
def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Llama's RMSNorm: ``weight * x̂.to(x.dtype)`` (x̂ rounded before the weight)."""
    return _kernels().rms_norm(hidden_states, self.weight, self.variance_epsilon, cast_xhat=True)


def _fp32_weight_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """OLMo's RMSNorm: ``(w · x̂).to(x.dtype)`` with x̂ in fp32 (no rounding before the weight)."""
    return _kernels().rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _offset_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm: ``(x̂ · (1 + w)).to(x.dtype)``, everything in fp32 (no rounding before the weight)."""
    return _kernels().rms_norm(hidden_states, self.weight, self.eps, weight_offset=1.0)


def _gated_rms_norm_forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Qwen3.5's gated RMSNorm: ``(w · x̂.to(x.dtype)) · silu(gate)`` (``kernels.rms_norm_gated``)."""
    return _kernels().rms_norm_gated(hidden_states, gate, self.weight, self.variance_epsilon)


_NORM_FORWARDS = {"cast": _rms_norm_forward, "fp32_weight": _fp32_weight_rms_norm_forward,
                  "offset": _offset_rms_norm_forward, "gated": _gated_rms_norm_forward}


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    # the projections' outputs feed only the gate: its backward may overwrite them
    return self.down_proj(_kernels().swiglu_gate(self.gate_proj(x), self.up_proj(x), inplace_backward=True))


def _fused_gate_up_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """One ``gate_up_proj`` whose first half of the features is the gate (Phi-3, GLM-4; strided views)."""
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(_kernels().swiglu_gate(gate, up))


def _geglu_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(_kernels().geglu_gate(self.gate_proj(x), self.up_proj(x), approximate="tanh",
                                                inplace_backward=True))


_MLP_FORWARDS = {"swiglu": lambda: _mlp_forward, "geglu": lambda: _geglu_mlp_forward,
                 "gate_up": lambda: _fused_gate_up_mlp_forward}


def _experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers 5's stacked experts (``gate_up_proj [E, 2I, H]``, gate rows first; ``down_proj [E, H, I]``) as
    the fused grouped GEMMs; the routing weights keep the router's dtype."""
    activation = _MOE_ACTIVATIONS[self.config.hidden_act]
    return _kernels().moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                                  activation=activation)


def _transposed_experts_forward(self, hidden_states: torch.Tensor, router_indices: torch.Tensor,
                             routing_weights: torch.Tensor) -> torch.Tensor:
    """gpt-oss's experts (``gate_up_proj [E, H, 2I]`` with interleaved gate / up columns, ``down_proj [E, I, H]``,
    both biased, the clamped SwiGLU) as the fused grouped GEMMs, reading the parameters in place through their
    transposed views (no copy of the weights)."""
    return _kernels().moe_experts(hidden_states, router_indices, routing_weights, self.gate_up_proj.transpose(1, 2),
                                  self.down_proj.transpose(1, 2), activation="swiglu_clamped",
                                  gate_up_bias=self.gate_up_proj_bias, down_bias=self.down_proj_bias,
                                  alpha=self.alpha, limit=self.limit, gate_up_layout="interleaved")


def _stacked_experts(module) -> bool:
    """An experts module in the layout :func:`_experts_forward` reads (what ``@use_experts_implementation`` marks
    as concatenated gate/up, untransposed, without biases)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (hasattr(module, "config") and isinstance(gate_up, torch.nn.Parameter)
            and isinstance(down, torch.nn.Parameter) and gate_up.dim() == 3
            and down.dim() == 3 and getattr(module, "is_concatenated", True) and not getattr(module, "is_transposed",
                                                                                              False)
            and not getattr(module, "has_bias", False) and getattr(module, "has_gate", True))


def _rope_kernel(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str,
                 pairs: bool = False):
    """HF's ``apply_rotary_pos_emb(q, k, cos, sin)`` on ``q[b, heads, s, d]``, ``k[b, kv_heads, s, d]`` with
    ``cos, sin[b or 1, s, rotary]`` (both halves equal, as HF builds them, for either layout; ``pairs``: ``[b or 1,
    s, rotary / 2]``, one value per pair, as gpt-oss builds them): the per-token tables become a ``[b·s, rotary/2]``
    table indexed by each token's row, and the kernel turns pairs in ``layout`` ("half": ``rotate_half``;
    "interleaved": ``(x[2i], x[2i+1])``)."""
    rotary = cos.shape[-1] * (2 if pairs else 1)
    if rotary < q.shape[-1]:  # partial rotary (Phi-3, GLM-4): the first features turn, the rest pass through
        q_rot, k_rot = _rope_kernel(q[..., :rotary], k[..., :rotary], cos, sin, layout, pairs)
        return torch.cat((q_rot, q[..., rotary:]), dim=-1), torch.cat((k_rot, k[..., rotary:]), dim=-1)
    # HF computes cos/sin once per forward and hands the same tensors to every layer: convert them once too
    cached = getattr(_state, "rope_tables", None)
    if cached is None or cached[0] is not cos or cached[1] is not sin:
        seq, d = cos.shape[-2], rotary
        width = d // 2 if pairs else d
        cos_rows = cos.reshape(-1, seq, width)
        table_batch = cos_rows.shape[0]
        cos_table = cos_rows[..., : d // 2].reshape(-1, d // 2).float().contiguous()
        sin_table = sin.reshape(-1, seq, width)[..., : d // 2].reshape(-1, d // 2).float().contiguous()
        rows = torch.arange(table_batch * seq, device=q.device).view(table_batch, 1, seq)
        cached = _state.rope_tables = (cos, sin, cos_table, sin_table, rows)
    cos_table, sin_table, rows = cached[2:]
    # one launch for q and k, also when k has fewer heads (GQA)
    return _kernels().apply_rope(q, k, rows, cos=cos_table, sin=sin_table, check_positions=False, layout=layout)


def _rotary_dispatch(module_name: str, layout: str, pairs: bool):
    original = _ORIGINAL_ROTARY[module_name]

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        # only inside a patched attention forward, and only for HF's default [b, heads, s, d] layout
        unsqueeze_dim = args[0] if args else kwargs.get("unsqueeze_dim", 1)
        if getattr(_state, "depth", 0) and unsqueeze_dim == 1 and q.dim() == 4:
            return _rope_kernel(q, k, cos, sin, layout, pairs)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.tritonlm_dispatch = True
    return apply_rotary_pos_emb


def _inside(counter: str):
    """A patched forward that runs the class's own with ``_state.<counter>`` raised, so the module-level functions it
    calls (RoPE, the delta rule, the conv) take the kernels while it runs and transformers' code everywhere else."""
    def forward(self, *args, **kwargs):
        setattr(_state, counter, getattr(_state, counter, 0) + 1)
        try:
            return type(self).forward(self, *args, **kwargs)
        finally:
            setattr(_state, counter, getattr(_state, counter) - 1)

    return forward


_attention_forward = _inside("depth")  # (apply_rotary_pos_emb routes inside these)


def tritonlm_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                       sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """transformers attention function (``AttentionInterface``): ``query[b, heads, s_q, d]``, ``key, value[b,
    kv_heads, s_k, d]`` -> ``([b, s_q, heads, d], None)``. Causal, bottom-right aligned (decoding against a cache
    works as is). Which keys a query sees comes from, in this order:

    * flash-attention kwargs ``cu_seq_lens_q/k`` (+ ``max_length_q/k``), as ``DataCollatorWithFlattening(
      return_flash_attn_kwargs=True)`` passes them: packed sequences over the flattened ``b·s`` tokens (they take
      precedence over the documents found in ``position_ids``; with a padding mask they are an error);
    * ``attention_mask`` as :func:`_tritonlm_mask` built it: None (causal), an int ``[b, s_k]`` segment map
      (padding and/or packed documents), or a 4-D mask it could not express, which runs HF's own sdpa attention;
    * ``sliding_window`` (Mistral) on top of either.

    ``s_aux`` (gpt-oss's attention sinks, one logit per query head) goes to the kernel's ``sinks``.
    """
    from ..kernels import flash_attn_func, flash_attn_varlen_func

    if dropout:
        raise NotImplementedError(f"tritonlm attention: attention dropout ({dropout}) is not supported")
    if kwargs.get("output_attentions"):
        raise NotImplementedError("tritonlm attention: output_attentions=True is not supported (P is never formed)")
    if getattr(module, "is_causal", True) is False:
        raise NotImplementedError("tritonlm attention: only causal attention is supported")
    if attention_mask is not None and attention_mask.dim() == 4:
        # a mask the varlen kernel cannot express (a custom 4-D mask, overlays, static-cache slicing): HF's sdpa
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if softcap or s_aux is not None:
            # (sdpa has neither a softcap nor sinks: the modeling module's own eager attention, as transformers runs it)
            return _eager_attention(module, query, key, value, attention_mask, dropout, scaling, sliding_window,
                                    softcap, **kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, **kwargs)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [b, s, heads, d] views
    batch, n_q, heads, d = q.shape
    d_v = v.shape[-1]  # (MLA: the values' own head size; the output has it)
    n_k = k.shape[1]
    window = (sliding_window - 1, 0) if sliding_window and n_k > sliding_window else (-1, -1)
    opts = dict(softmax_scale=scaling, causal=True, window_size=window, softcap=softcap or 0.0, sinks=s_aux)
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if attention_mask is not None and not getattr(attention_mask, "tritonlm_documents", False):
            raise ValueError("tritonlm attention: got both cu_seq_lens_q/k and a padding attention_mask; "
                             "pass one of them")
        if cu_q is None or cu_k is None or kwargs.get("max_length_q") is None or kwargs.get("max_length_k") is None:
            raise ValueError("tritonlm attention: packed flash-attention kwargs need cu_seq_lens_q, cu_seq_lens_k, "
                             "max_length_q and max_length_k together")
        out = flash_attn_varlen_func(
            q.reshape(batch * n_q, heads, d), k.reshape(batch * n_k, -1, d), v.reshape(batch * n_k, -1, d_v),
            cu_q.to(torch.int32), cu_k.to(torch.int32), kwargs["max_length_q"], kwargs["max_length_k"], **opts)
        return out.view(batch, n_q, heads, d_v), None
    if attention_mask is None:
        return flash_attn_func(q, k, v, **opts), None
    if attention_mask.dim() != 2 or attention_mask.dtype != torch.int32 or attention_mask.shape[1] != n_k:
        raise ValueError("tritonlm attention: expected the [batch, keys] int32 segment map of the 'tritonlm' mask "
                         f"function, got {attention_mask.dtype} {tuple(attention_mask.shape)} (a model that builds "
                         "its own masks needs attn_implementation='sdpa')")
    q_index, k_index, cu_q, cu_k, max_q, max_k = _packing(attention_mask, n_q)
    packed = flash_attn_varlen_func(
        q.reshape(batch * n_q, heads, d)[q_index], k.reshape(batch * n_k, -1, d)[k_index],
        v.reshape(batch * n_k, -1, d_v)[k_index], cu_q, cu_k, max_q, max_k, **opts)
    out = q.new_zeros(batch * n_q, heads, d_v).index_copy(0, q_index, packed)  # padded queries: zeros
    return out.view(batch, n_q, heads, d_v), None


def _eager_attention(module, query, key, value, mask, dropout, scaling, sliding_window, softcap, **kwargs):
    """The modeling module's ``eager_attention_forward`` (Gemma 2's softcapped attention) with the boolean 4-D mask
    turned into the additive one eager attention adds to its scores."""
    import importlib

    eager = getattr(importlib.import_module(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise NotImplementedError(f"tritonlm attention: softcap or sinks with a custom mask need "
                                  f"{type(module).__module__}.eager_attention_forward")
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min)
    extra = {"softcap": softcap} if softcap else {}  # (gpt-oss's eager attention reads its sinks itself)
    return eager(module, query, key, value, mask, dropout=dropout, scaling=scaling, sliding_window=sliding_window,
                 **extra, **kwargs)


def _packing(segments: torch.Tensor, n_q: int):
    """A ``[b, n_k]`` segment map (-1 = padding; queries are the last ``n_q`` key positions) -> the packed
    sequences the varlen kernel runs: every (row, segment) is one causal sequence of its valid tokens, in order.
    Returns the query and key token indices, int32 cu_seqlens of queries and keys, and the max lengths. Every layer
    gets the same mask object in a forward, so the result (its host syncs included) is computed once per forward.

    Bottom-right alignment inside each sequence is exact: the valid keys after a valid query all lie in the query
    span, so they are the valid queries after it."""
    cached = getattr(_state, "packing", None)
    if cached is not None and cached[0] is segments and cached[1] == n_q:
        return cached[2]
    batch, n_k = segments.shape
    rows = torch.arange(batch, device=segments.device)[:, None]
    group = rows * (n_k + 1) + segments.long()  # one id per (row, segment), increasing in token order
    key_valid = segments >= 0
    query_valid = key_valid[:, -n_q:]
    key_group = group[key_valid]
    query_group = group[:, -n_q:][query_valid]
    groups, k_lens = torch.unique_consecutive(key_group, return_counts=True)
    q_lens = torch.bincount(torch.searchsorted(groups, query_group), minlength=groups.numel())
    result = (query_valid.reshape(-1).nonzero().squeeze(-1), key_valid.reshape(-1).nonzero().squeeze(-1),
              F.pad(q_lens.cumsum(0), (1, 0)).to(torch.int32), F.pad(k_lens.cumsum(0), (1, 0)).to(torch.int32),
              int(q_lens.max()) if q_lens.numel() else 0, int(k_lens.max()) if k_lens.numel() else 0)
    _state.packing = (segments, n_q, result)
    return result


#: queries x keys x batch evaluated per step when a packed mask is checked (bounds its memory to ~16 MB of bools)
MASK_CHECK_ELEMENTS = 1 << 24


def _documents_of(call: dict, window) -> torch.Tensor | None:
    """The ``[b, n]`` int32 document ids of transformers' mask without a cache (``call``: the mask interface's
    arguments), when that mask is exactly causal attention within contiguous documents (and ``window``); else None.

    A new document starts where a query cannot see the key just before it (one evaluation of the mask function per
    token); the whole mask is then compared, a block of queries at a time, with the one those ids describe."""
    from transformers.masking_utils import sdpa_mask

    batch, n = call["batch_size"], call["q_length"]
    device = call.get("device", "cpu")
    rows = torch.arange(batch, device=device)[:, None, None, None]
    later = torch.arange(1, n, device=device)[None, None, :, None]
    sees_previous = call["mask_function"](rows, torch.zeros((), dtype=torch.long, device=device), later, later - 1)
    starts = ~sees_previous.expand(batch, 1, n - 1, 1).reshape(batch, n - 1)
    doc = F.pad(starts.long().cumsum(-1), (1, 0))
    keys = torch.arange(n, device=device)
    step = max(1, MASK_CHECK_ELEMENTS // max(1, batch * n))
    for start in range(0, n, step):
        stop = min(n, start + step)
        block = sdpa_mask(**{**call, "q_length": stop - start, "q_offset": start, "allow_is_causal_skip": False})
        queries = keys[start:stop, None]
        expected = (doc[:, start:stop, None] == doc[:, None, :]) & (queries >= keys[None, :])
        if window:
            expected &= queries - keys[None, :] < window
        if block is None or not torch.equal(block[:, 0], expected):
            return None
    return doc.to(torch.int32)


def _tritonlm_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
                   local_size=None, allow_is_causal_skip=True, **kwargs):
    """transformers mask function for ``"tritonlm"`` (``AttentionMaskInterface``). It returns what
    :func:`tritonlm_attention` can run exactly, else the mask HF's sdpa path would use:

    * None: plain causal (sliding) attention, queries the last keys, nothing padded;
    * an int32 ``[b, kv_length]`` segment map: -1 for padding keys, else the key's document (packed sequences
      from ``position_ids`` restarting, found by evaluating transformers' own mask function and checking, a block
      of queries at a time, that the whole mask is causal attention within contiguous documents);
    * a 4-D boolean mask from ``sdpa_mask`` for anything else (custom overlays, static caches, padding in the
      middle of a sliding window): :func:`tritonlm_attention` then runs HF's sdpa attention with it.
    """
    from transformers.masking_utils import sdpa_mask

    call = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                local_size=local_size, **kwargs)
    padding = None if attention_mask is None else attention_mask[:, -kv_length:].bool()
    aligned = (isinstance(q_offset, int) and isinstance(kv_offset, int)
               and kv_offset + kv_length == q_offset + q_length)  # queries are the last keys (bottom-right)
    if allow_is_causal_skip and aligned and (padding is None or padding.shape[1] == kv_length):
        # transformers overlays nothing here (it clears allow_is_causal_skip when it does): causal, maybe padded
        if padding is None or bool(padding.all()):
            return None
        if local_size is not None:
            # a window counts key positions: valid tokens must form one run per row for the packed sequence to
            # keep their distances (left or right padding); padding between them goes to sdpa
            runs = (padding.long().diff(dim=-1) > 0).sum(-1) + padding[:, 0].long()
            if bool((runs > 1).any()):
                return sdpa_mask(**{**call, "allow_is_causal_skip": False})
        return torch.where(padding, 0, -1).to(torch.int32)
    if padding is None and q_offset == 0 and kv_offset == 0 and q_length == kv_length:
        # an overlay without a cache: packed documents (position_ids restarting) are the case to run natively
        segments = _documents_of(call, local_size)
        if segments is None:
            return sdpa_mask(**{**call, "allow_is_causal_skip": False})
        segments.tritonlm_documents = True  # documents only, no padding: flash kwargs may describe the same
        return segments
    return sdpa_mask(**call)


def _causal_lm_forward(self, input_ids=None, attention_mask=None, *args, labels=None, shift_labels=None,
                       logits_to_keep=0, **kwargs):
    original = type(self).forward
    if labels is None and shift_labels is None:
        return original(self, input_ids, attention_mask, *args, logits_to_keep=logits_to_keep, **kwargs)
    if args:
        raise TypeError("with apply_kernels(loss=True), pass arguments after attention_mask by keyword")
    num_items = kwargs.pop("num_items_in_batch", None)
    return_dict = kwargs.pop("return_dict", None)
    # a vision-language class (Qwen3.5-MoE's) keeps the language model's settings in its text config
    text_config = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
    moe = hasattr(text_config, "router_aux_loss_coef")
    if moe:  # as the MoE causal-LM forwards do: the flag, else the config's
        router = kwargs.pop("output_router_logits", None)
        kwargs["output_router_logits"] = text_config.output_router_logits if router is None else router
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    hidden = outputs[0]
    if shift_labels is None:
        # HF's causal-LM loss: position t predicts labels[t + 1]; the last position has no target
        shift_labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
    # the family's logit transform (Gemma 2 / 3's final softcap, Granite's divisor): through the fused loss too
    logit_transform = family(self.config.model_type).kernels.logits(self.config)
    cap, divisor = logit_transform.get("softcap"), logit_transform.get("divisor")
    if divisor is not None and divisor != 1.0:
        hidden = hidden / divisor  # (logits / s = (hidden / s) W^T)
    loss = _kernels().linear_cross_entropy(hidden, self.lm_head.weight, shift_labels.to(hidden.device),
                                           ignore_index=-100, reduction="sum" if num_items else "mean", softcap=cap)
    if num_items:
        loss = loss / num_items
    logits = None
    if not self.training:
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, keep, :])
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    output_class = MoeCausalLMOutputWithPast if moe else CausalLMOutputWithPast
    fields = output_class.__dataclass_fields__
    cache_field = "cache" if "cache" in fields else "past_key_values"
    extra = {}
    if moe and kwargs["output_router_logits"]:
        # the modeling module's own load-balancing loss, on the router logits of this forward
        import importlib

        balance = importlib.import_module(type(self).__module__).load_balancing_loss_func
        experts = getattr(text_config, "num_experts", None) or text_config.num_local_experts
        aux = balance(outputs.router_logits, experts, text_config.num_experts_per_tok, attention_mask)
        loss = loss + text_config.router_aux_loss_coef * aux.to(loss.device)
        extra = dict(aux_loss=aux, router_logits=outputs.router_logits)
    result = output_class(loss=loss, logits=logits, hidden_states=getattr(outputs, "hidden_states", None),
                          attentions=getattr(outputs, "attentions", None),
                          **{cache_field: getattr(outputs, cache_field, None)}, **extra)
    return result.to_tuple() if return_dict is False else result


# ----------------------------------------------------------------------------------------------------
# patching
# ----------------------------------------------------------------------------------------------------
def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, tritonlm_attention)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # transformers without mask interfaces build masks from the 2-D input itself
        return
    AttentionMaskInterface.register(ATTENTION_NAME, _tritonlm_mask)


def _set_attention(model, name: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name


def _rotary_module(module):
    """The modeling module whose ``apply_rotary_pos_emb`` an attention layer calls (checked before patching)."""
    import importlib

    name = type(module).__module__
    modeling = importlib.import_module(name)
    if getattr(modeling, "apply_rotary_pos_emb", None) is None:
        raise NotImplementedError(f"rope=True: {name} has no apply_rotary_pos_emb to route")
    return name, modeling


def _install_rotary_dispatch(name: str, modeling, layout: str, pairs: bool) -> None:
    """Route the modeling module's ``apply_rotary_pos_emb`` through :func:`_rotary_dispatch` (once; it calls the
    original outside patched attention layers, so unpatched models in the process are unaffected)."""
    current = modeling.apply_rotary_pos_emb
    if not getattr(current, "tritonlm_dispatch", False):
        _ORIGINAL_ROTARY[name] = current
        modeling.apply_rotary_pos_emb = _rotary_dispatch(name, layout, pairs)


# ---- Gated DeltaNet layers: their modeling module's delta-rule and conv functions, routed inside patched layers
_DELTA_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                    "causal_conv1d_update")
_ORIGINAL_DELTA: dict = {}  # (modeling module, function name) -> transformers' own function


_linear_attention_forward = _inside("linear")  # (the delta rule and conv functions route inside these)


def _delta_rule(recurrent: bool):
    def call(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        # (transformers passes its flash-attention kwargs along; only cu_seqlens means something here)
        entry = (_kernels().fused_recurrent_gated_delta_rule if recurrent else _kernels().chunk_gated_delta_rule)
        return entry(query, key, value, g, beta, initial_state=initial_state, output_final_state=output_final_state,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)

    return call


def _conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
    """transformers' ``causal_conv1d_fn`` call: packed sequences (``cu_seq_lens_q``, batch 1) become ``seq_idx``."""
    cu = kwargs.get("cu_seq_lens_q")
    seq_idx = None
    if cu is not None:
        starts = torch.zeros(hidden_states.shape[-1], dtype=torch.int32, device=hidden_states.device)
        starts[cu[1:-1].long()] = 1
        seq_idx = starts.cumsum(0, dtype=torch.int32)[None].expand(hidden_states.shape[0], -1)
    return _kernels().causal_conv1d_fn(hidden_states, weight, bias, activation, seq_idx=seq_idx)


def _conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None):
    return _kernels().causal_conv1d_update(hidden_states, conv_state, weight, bias, activation)


_DELTA_KERNELS = {"torch_chunk_gated_delta_rule": _delta_rule(False),
                  "torch_recurrent_gated_delta_rule": _delta_rule(True),
                  "causal_conv1d_fn": _conv1d_fn, "causal_conv1d_update": _conv1d_update}


def _linear_attention_module(module):
    """The modeling module of a Gated DeltaNet layer (checked before patching: it must hold the four functions)."""
    import importlib

    modeling = importlib.import_module(type(module).__module__)
    missing = [f for f in _DELTA_FUNCTIONS if getattr(modeling, f, None) is None]
    if missing:
        raise NotImplementedError(f"linear_attention=True: {modeling.__name__} has no {missing[0]} to route")
    return modeling


def _install_delta_dispatch(modeling) -> None:
    """Route the modeling module's delta-rule and conv functions to the kernels inside patched Gated DeltaNet layers
    (once; outside them the originals run, so unpatched models in the process are unaffected)."""
    for name in _DELTA_FUNCTIONS:
        current = getattr(modeling, name)
        if getattr(current, "tritonlm_dispatch", False):
            continue
        _ORIGINAL_DELTA[(modeling.__name__, name)] = current

        def dispatch(*args, _name=name, _original=current, **kwargs):
            if getattr(_state, "linear", 0) > 0:
                return _DELTA_KERNELS[_name](*args, **kwargs)
            return _original(*args, **kwargs)

        dispatch.tritonlm_dispatch = True
        setattr(modeling, name, dispatch)


def _patch(module, forward, tag: str) -> None:
    module.forward = MethodType(forward, module)
    module._tritonlm_patch = tag


def _register_experts() -> None:
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError:  # transformers 4.x: per-expert modules, no interface (and nothing this patch reads)
        return
    ExpertsInterface.register(ATTENTION_NAME, _experts_forward)


def apply_kernels(model, rms_norm: bool = True, rope: bool = True, swiglu: bool = True, attention: bool = True,
                  loss: bool = True, moe: bool = True, linear_attention: bool = True):
    """Patch a Hugging Face model instance of a family in :data:`tritonlm.hf.SUPPORTED_MODELS` (``*ForCausalLM`` or
    the bare ``*Model``) in place with tritonlm's kernels and return it. See the module docstring for what each
    switch replaces; :func:`remove_kernels` restores the model. The kernels need CUDA tensors (or
    ``TRITON_INTERPRET=1``).

    Atomic: every check runs before anything is patched, so an error leaves the model as it was. Idempotent:
    applying again patches the same forwards again, and :func:`remove_kernels` still restores the attention
    implementation the model had before the first call."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    known = families()
    if model_type not in known:
        raise ValueError(f"apply_kernels supports {', '.join(known)} models, got model_type={model_type!r}")
    record = known[model_type]
    targets = record.kernels
    if targets is None:
        raise ValueError(f"apply_kernels has no kernel targets for model_type {record.model_type!r}")
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if swiglu and targets.mlps and act not in ("silu", "swish", "gelu_pytorch_tanh"):
        raise ValueError(f"swiglu=True needs hidden_act 'silu' (SwiGLU) or 'gelu_pytorch_tanh' (GeGLU), got {act!r}")
    if loss and not hasattr(model, "lm_head"):
        raise ValueError("loss=True needs a *ForCausalLM model (with lm_head); pass loss=False for a bare model")
    # stage 1: find every module to patch and check it (nothing is changed yet)
    plan, rotary, delta_modules = [], {}, {}
    for module in model.modules():
        name = type(module).__name__
        if rms_norm and name in targets.norms:
            plan.append((module, _NORM_FORWARDS[targets.norms[name]], "rms_norm"))
        elif swiglu and name in targets.mlps:
            plan.append((module, _MLP_FORWARDS[targets.mlps[name]](), "swiglu"))
        elif moe and name in targets.experts and targets.experts[name] == "transposed_interleaved":
            plan.append((module, _transposed_experts_forward, "moe"))
        elif moe and name in targets.experts:
            if not _stacked_experts(module):
                raise NotImplementedError(f"moe=True: {name} does not hold its experts stacked (gate_up_proj [E, 2I, "
                                          "H], down_proj [E, H, I]: transformers >= 5); pass moe=False")
            if getattr(module.config, "hidden_act", None) not in _MOE_ACTIVATIONS:
                raise ValueError(f"moe=True: hidden_act {module.config.hidden_act!r} is not one of "
                                 f"{sorted(_MOE_ACTIVATIONS)}")
            plan.append((module, _experts_forward, "moe"))
        elif rope and name in targets.attention:
            modeling_name, modeling = _rotary_module(module)
            rotary[modeling_name] = modeling
            plan.append((module, _attention_forward, "rope"))
        elif linear_attention and name in targets.linear_attention:
            delta_modules[type(module).__module__] = _linear_attention_module(module)
            plan.append((module, _linear_attention_forward, "linear_attention"))
    if attention:
        _register_attention()
    if moe:
        _register_experts()
    # stage 2: patch
    for modeling_name, modeling in rotary.items():
        _install_rotary_dispatch(modeling_name, modeling, targets.rope_layout, targets.rope_tables == "pairs")
    for modeling in delta_modules.values():
        _install_delta_dispatch(modeling)
    for module, forward, tag in plan:
        _patch(module, forward, tag)
    if attention:
        if getattr(model, "_tritonlm_previous_attention", None) is None:
            model._tritonlm_previous_attention = config._attn_implementation
        _set_attention(model, ATTENTION_NAME)
    if loss:
        _patch(model, _causal_lm_forward, "loss")
    return model


def remove_kernels(model):
    """Undo :func:`apply_kernels` on ``model`` (every patched forward and the attention implementation)."""
    for module in model.modules():
        if getattr(module, "_tritonlm_patch", None):
            del module.forward, module._tritonlm_patch
    previous = getattr(model, "_tritonlm_previous_attention", None)
    if previous is not None:
        _set_attention(model, previous)
        del model._tritonlm_previous_attention
    return model
