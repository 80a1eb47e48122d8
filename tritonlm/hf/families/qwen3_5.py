"""Qwen3-Next and Qwen3.5, the Gated DeltaNet hybrids: ``layer_types`` mixes ``linear_attention`` layers (Gated
DeltaNet: ``ModelConfig.linear_layers`` and the ``linear_*`` sizes) with ``full_attention`` ones (GQA with per-head q/k
norms, RoPE on each head's first ``partial_rotary_factor`` of features, and an output gate: ``q_proj`` holds each
head's query and gate rows interleaved, split into ``q_proj`` / ``gate_proj`` on load); every RMSNorm scales by
``(1 + w)`` (``norm_offset``) except the linear layers' gated norm.

Qwen3-Next keeps a linear layer's q/k/v/z projection and its beta/a projection fused and interleaved per key head
(``in_proj_qkvz``, ``in_proj_ba``): gathered into Qwen3.5's separate ``in_proj_qkv`` / ``in_proj_z`` /
``in_proj_b`` / ``in_proj_a`` on load, interleaved again on save. Its MoE layers (every ``decoder_sparse_step``-th
layer not in ``mlp_only_layers``) and Qwen3.5-MoE's (all of them, top-k always renormalised) run a sigmoid-gated
shared expert beside the routed ones. Multi-token-prediction tensors (``mtp.*``) are not part of the causal LM:
skipped with a log line, as transformers skips them.

The Hub publishes Qwen3.5 as vision-language directories (``qwen3_5`` / ``qwen3_5_moe``): their language model
(``text_config``, ``model.language_model.*``) loads as ``qwen3_5_text`` / ``qwen3_5_moe_text``, the vision tower left
out (one log line), and saves as the text family. Text positions only: the multimodal RoPE sections
(``mrope_section``) equal plain RoPE when every position id is the token's index.
"""

from __future__ import annotations

import torch

from ..family import (
    Family,
    Fused,
    Kernels,
    Weights,
    read_decoder,
    read_dropout,
    read_router_aux_loss,
    register,
    write_decoder,
    write_router_aux_loss,
)
from .qwen import _moe as _qwen_moe

_COMMON = {"hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
           "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "attention_bias": False, "attention_dropout": 0.0,
           "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
           "linear_num_key_heads": 16, "linear_num_value_heads": 32, "layer_types": None}
QWEN3_NEXT = {**_COMMON, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
              "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "decoder_sparse_step": 1,
              "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "num_experts_per_tok": 10,
              "num_experts": 512, "norm_topk_prob": True, "router_aux_loss_coef": 0.001, "mlp_only_layers": None}
QWEN3_5_TEXT = {**_COMMON, "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288,
                "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4}
QWEN3_5_MOE_TEXT = {**_COMMON, "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
                    "num_attention_heads": 16, "num_key_value_heads": 2, "moe_intermediate_size": 512,
                    "shared_expert_intermediate_size": 512, "num_experts_per_tok": 8, "num_experts": 256,
                    "router_aux_loss_coef": 0.001}
#: full_attention_interval only makes the default layer_types (read there when layer_types is absent)
_IGNORED = ("full_attention_interval",)
#: keys the Hub's Qwen3.5 / Qwen3.6 config.json files carry (the text_config of the VL release) that transformers'
#: Qwen3.5 modeling never reads
_MTP = "the multi-token-prediction head speculative decoders use (its mtp.* tensors are not part of the causal LM)"
QWEN3_5_HARMLESS = {
    "attn_output_gate": "the attention always gates its output (q_proj holds the gate rows); the flag is never read",
    "mamba_ssm_dtype": "the recurrent-state dtype of serving engines' caches; transformers (and tritonlm: fp32) keep "
                       "their own",
    "mlp_only_layers": "Qwen3-Next's dense-layer list, carried over in the files; every Qwen3.5 layer has the same MLP",
    "mtp_num_hidden_layers": f"the depth of {_MTP}",
    "mtp_use_dedicated_embeddings": f"an option of {_MTP}",
}
QWEN3_NEXT_HARMLESS = {
    "use_sliding_window": "Qwen3-Next's attention has no sliding window; the flag (from Qwen2's config) is never read",
}


def _layer_types(r) -> list[str]:
    """``layer_types``, or transformers' default: every ``full_attention_interval``-th layer (4) full attention."""
    layers = r.get("num_hidden_layers")
    types = r.get("layer_types")
    if types is None:
        interval = int(r.get("full_attention_interval", 4))
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"linear_attention", "full_attention"}:
        raise ValueError(f"layer_types={types!r} is not supported: one 'linear_attention' or 'full_attention' per "
                         "layer")
    return list(types)


def _hybrid(r, d_ff_key: str = "intermediate_size") -> dict:
    fields = read_decoder(r, partial_rotary=True, d_ff_key=d_ff_key)
    r.require("attention_bias", (False,), "Qwen3.5 / Qwen3-Next attention has no projection biases")
    types = _layer_types(r)
    linear = tuple(i for i, t in enumerate(types) if t == "linear_attention")
    return dict(fields, qk_norm="head", norm_offset=True, attn_output_gate=True, linear_layers=linear or None,
                linear_num_key_heads=int(r.get("linear_num_key_heads")),
                linear_num_value_heads=int(r.get("linear_num_value_heads")),
                linear_key_head_dim=int(r.get("linear_key_head_dim")),
                linear_value_head_dim=int(r.get("linear_value_head_dim")),
                linear_conv_kernel=int(r.get("linear_conv_kernel_dim")), dropout=read_dropout(r, "attention_dropout"))


def _hybrid_hf(cfg) -> dict:
    if not (cfg.norm_offset and cfg.attn_output_gate and cfg.qk_norm == "head"):
        raise ValueError("Qwen3.5 / Qwen3-Next models need norm_offset, attn_output_gate and per-head q/k norms")
    linear = set(cfg.linear_layers or ())
    return dict(write_decoder(cfg), attention_bias=False, attention_dropout=cfg.dropout,
                partial_rotary_factor=cfg.partial_rotary or 1.0,
                layer_types=["linear_attention" if i in linear else "full_attention" for i in range(cfg.num_layers)],
                linear_num_key_heads=cfg.linear_num_key_heads, linear_num_value_heads=cfg.linear_num_value_heads,
                linear_key_head_dim=cfg.linear_key_head_dim, linear_value_head_dim=cfg.linear_value_head_dim,
                linear_conv_kernel_dim=cfg.linear_conv_kernel)


def _qwen3_next(r) -> dict:
    fields = _qwen_moe(r, _hybrid(r), "num_experts", shared=True)
    if not fields.get("shared_expert_d_ff"):
        raise ValueError("shared_expert_intermediate_size=0 is not supported: Qwen3-Next's MoE layers always run "
                         "a shared expert")
    return fields


def _qwen3_next_hf(cfg) -> dict:
    return dict(_hybrid_hf(cfg), num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                moe_intermediate_size=cfg.expert_d_ff, norm_topk_prob=cfg.norm_topk_prob,
                **write_router_aux_loss(cfg), decoder_sparse_step=1,
                shared_expert_intermediate_size=cfg.shared_expert_d_ff,
                mlp_only_layers=[i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)])


def _qwen3_5_moe(r) -> dict:
    fields = _hybrid(r, d_ff_key="moe_intermediate_size")
    shared = int(r.get("shared_expert_intermediate_size") or 0)
    if not shared:
        raise ValueError("shared_expert_intermediate_size=0 is not supported: Qwen3.5-MoE layers always run a "
                         "shared expert")
    return dict(fields, num_experts=int(r.get("num_experts")), experts_per_token=int(r.get("num_experts_per_tok")),
                moe_d_ff=int(r.get("moe_intermediate_size")), norm_topk_prob=True, shared_expert_d_ff=shared,
                **read_router_aux_loss(r))


def _qwen3_5_moe_hf(cfg) -> dict:
    if not cfg.norm_topk_prob or cfg.moe_layers is not None or not cfg.shared_expert_d_ff:
        raise ValueError("model_type 'qwen3_5_moe_text' needs every layer MoE with renormalised top-k weights and a "
                         "shared expert")
    out = _hybrid_hf(cfg)
    del out["intermediate_size"]
    return dict(out, num_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                moe_intermediate_size=cfg.expert_d_ff, shared_expert_intermediate_size=cfg.shared_expert_d_ff,
                **write_router_aux_loss(cfg))


# ---- weights: the gate rows of q_proj, and Qwen3-Next's per-key-head interleaving
def _query_gate_order(cfg) -> torch.Tensor:
    """q_proj's rows ``[head, (query d | gate d)]`` -> all heads' query rows, then all heads' gate rows."""
    d = cfg.d_head
    return torch.arange(cfg.num_heads * 2 * d).view(cfg.num_heads, 2, d).transpose(0, 1).reshape(-1)


def _qkvz_order(cfg) -> torch.Tensor:
    """in_proj_qkvz's rows ``[key head, (q d_k | k d_k | v G·d_v | z G·d_v)]`` -> q, k, v, z of every head in turn."""
    heads, d_k = cfg.linear_num_key_heads, cfg.linear_key_head_dim
    width = cfg.linear_num_value_heads // heads * cfg.linear_value_head_dim
    rows = torch.arange(heads * (2 * d_k + 2 * width)).view(heads, -1)
    bounds = (0, d_k, 2 * d_k, 2 * d_k + width, 2 * d_k + 2 * width)
    return torch.cat([rows[:, a:b].reshape(-1) for a, b in zip(bounds[:-1], bounds[1:])])


def _ba_order(cfg) -> torch.Tensor:
    """in_proj_ba's rows ``[key head, (b G | a G)]`` -> every b row, then every a row."""
    heads, group = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads
    return torch.arange(heads * 2 * group).view(heads, 2, group).transpose(0, 1).reshape(-1)


_GATE = Fused("self_attn.q_proj.weight", ("self_attn.q_proj.weight", "self_attn.gate_proj.weight"),
              lambda cfg: (cfg.num_heads * cfg.d_head,) * 2, order=_query_gate_order)
_QKVZ = Fused("linear_attn.in_proj_qkvz.weight", ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight"),
              lambda cfg: (2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim
                           + cfg.linear_num_value_heads * cfg.linear_value_head_dim,
                           cfg.linear_num_value_heads * cfg.linear_value_head_dim), order=_qkvz_order)
_BA = Fused("linear_attn.in_proj_ba.weight", ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight"),
            lambda cfg: (cfg.linear_num_value_heads,) * 2, order=_ba_order)


def _kernels(prefix: str, moe: bool) -> Kernels:
    return Kernels(norms={f"{prefix}RMSNorm": "offset", f"{prefix}RMSNormGated": "gated"},
                   mlps={f"{prefix}MLP": "swiglu"}, attention=(f"{prefix}Attention",),
                   experts={f"{prefix}Experts": "stacked"} if moe else {},
                   linear_attention=(f"{prefix}GatedDeltaNet",))


_NOTES = "Gated DeltaNet hybrid (linear + full attention layers), gated attention output, partial RoPE, (1 + w) norms"
register(Family(
    model_type="qwen3_next", architecture="Qwen3NextForCausalLM", config_class="Qwen3NextConfig",
    defaults=QWEN3_NEXT, to_config=_qwen3_next, to_hf=_qwen3_next_hf, kernels=_kernels("Qwen3Next", True),
    weights=Weights(fused=(_GATE, _QKVZ, _BA), skipped_prefixes=("mtp.",)), ignored=_IGNORED,
    harmless=QWEN3_NEXT_HARMLESS,
    notes=f"{_NOTES}, MoE with a gated shared expert"))
QWEN3_5_KERNELS = _kernels("Qwen3_5", False)
QWEN3_5_MOE_KERNELS = _kernels("Qwen3_5Moe", True)
register(Family(
    model_type="qwen3_5_text", architecture="Qwen3_5ForCausalLM", config_class="Qwen3_5TextConfig",
    defaults=QWEN3_5_TEXT, to_config=_hybrid, to_hf=lambda cfg: _hybrid_hf(cfg), kernels=QWEN3_5_KERNELS,
    weights=Weights(fused=(_GATE,), skipped_prefixes=("mtp.",)), ignored=_IGNORED, harmless=QWEN3_5_HARMLESS,
    notes=_NOTES))
register(Family(
    model_type="qwen3_5_moe_text", architecture="Qwen3_5MoeForCausalLM", config_class="Qwen3_5MoeTextConfig",
    defaults=QWEN3_5_MOE_TEXT, to_config=_qwen3_5_moe, to_hf=_qwen3_5_moe_hf, kernels=QWEN3_5_MOE_KERNELS,
    weights=Weights(fused=(_GATE,), skipped_prefixes=("mtp.",)),
    ignored=(*_IGNORED, "intermediate_size"),  # (its class reads none: every layer is MoE)
    harmless=QWEN3_5_HARMLESS,
    notes=f"{_NOTES}, MoE with a gated shared expert"))


def _wrapper_only(r) -> dict:
    raise ValueError(f"model_type {r.family.model_type!r} is read through its text_config (tritonlm.hf.checkpoint."
                     "text_config_of)")


register(Family(
    model_type="qwen3_5", architecture="Qwen3_5ForConditionalGeneration", config_class="Qwen3_5Config", defaults={},
    to_config=_wrapper_only, to_hf=_wrapper_only, kernels=QWEN3_5_KERNELS, text_of="qwen3_5_text",
    notes="vision-language directory: its language model loads as qwen3_5_text (vision tower left out)"))
register(Family(
    model_type="qwen3_5_moe", architecture="Qwen3_5MoeForConditionalGeneration", config_class="Qwen3_5MoeConfig",
    defaults={}, to_config=_wrapper_only, to_hf=_wrapper_only, kernels=QWEN3_5_MOE_KERNELS,
    text_of="qwen3_5_moe_text",
    notes="vision-language directory: its language model loads as qwen3_5_moe_text (vision tower left out)"))
