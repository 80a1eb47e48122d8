"""Mistral and Mixtral: Llama's layout with a sliding window on every layer (``sliding_window``; null: none), and
Mixtral's experts on every layer (``block_sparse_moe``: a router and ``num_local_experts`` SwiGLU experts, top
``num_experts_per_tok`` renormalised)."""

from ..family import (
    Family,
    Kernels,
    Weights,
    derived_head_dim,
    read_decoder,
    read_dropout,
    read_router_aux_loss,
    register,
    write_decoder,
    write_router_aux_loss,
)

MISTRAL = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": derived_head_dim, "hidden_act": "silu",
           "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
           "rope_theta": 10000.0, "sliding_window": 4096, "attention_dropout": 0.0}
MIXTRAL = {**MISTRAL, "sliding_window": None, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_local_experts": 8,
           "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0}


def _mistral(r) -> dict:
    window = r.get("sliding_window")
    return dict(read_decoder(r), sliding_window=int(window) if window else None,
                dropout=read_dropout(r, "attention_dropout"))


def _mistral_hf(cfg) -> dict:
    return dict(write_decoder(cfg), sliding_window=cfg.sliding_window, attention_dropout=cfg.dropout)


def _mixtral(r) -> dict:
    fields = _mistral(r)
    r.require("router_jitter_noise", lambda v: not v, "training-time noise on the router input")
    # (transformers 5 maps num_experts onto num_local_experts; configs may hold either name)
    experts = r.get("num_experts") if "num_experts" in r else r.get("num_local_experts")
    return dict(fields, num_experts=int(experts), experts_per_token=int(r.get("num_experts_per_tok")),
                moe_d_ff=int(r.get("intermediate_size")), norm_topk_prob=True, **read_router_aux_loss(r))


def _mixtral_hf(cfg) -> dict:
    return dict(_mistral_hf(cfg), intermediate_size=cfg.expert_d_ff, num_local_experts=cfg.num_experts,
                num_experts_per_tok=cfg.experts_per_token, **write_router_aux_loss(cfg), router_jitter_noise=0.0)


register(Family(
    model_type="mistral", architecture="MistralForCausalLM", config_class="MistralConfig", defaults=MISTRAL,
    to_config=_mistral, to_hf=_mistral_hf,
    kernels=Kernels(norms={"MistralRMSNorm": "cast"}, mlps={"MistralMLP": "swiglu"}, attention=("MistralAttention",)),
    tokenizer="SentencePiece BPE", notes="sliding window on every layer"))
register(Family(
    model_type="mixtral", architecture="MixtralForCausalLM", config_class="MixtralConfig", defaults=MIXTRAL,
    to_config=_mixtral, to_hf=_mixtral_hf,
    weights=Weights(expert_block="block_sparse_moe", expert_names=("w1", "w3", "w2")),
    kernels=Kernels(norms={"MixtralRMSNorm": "cast"}, mlps={}, attention=("MixtralAttention",),
                    experts={"MixtralExperts": "stacked"}),
    tokenizer="SentencePiece BPE", notes="experts per expert or stacked; `router_jitter_noise` refused"))
