"""gpt-oss (``GptOssForCausalLM``, gpt-oss-20b / 120b): attention sinks (a learned logit per query head in every
row's softmax, carrying no value: ``self_attn.sinks``), q/k/v/o biases, sliding-window layers alternating with full
ones (``layer_types``), YaRN RoPE in half-split layout whose cos / sin hold one value per pair, and a mixture of
experts on every layer: a biased router whose top-k logits' softmax are the weights, and experts with biases and
the clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``) stored as ``gate_up_proj [E, H, 2I]`` with interleaved
gate / up columns and ``down_proj [E, I, H]`` (transposed into the model's stacked layout on load, back on save;
``apply_kernels`` reads them in place). The published checkpoints are MXFP4-quantised (``quantization_config``):
a one-line error naming the quantisation, never wrong weights (dequantise to bf16 first)."""

from ..family import (
    Family,
    Kernels,
    Weights,
    read_decoder,
    read_dropout,
    read_layer_types,
    read_router_aux_loss,
    register,
    windows,
    write_decoder,
    write_router_aux_loss,
)

DEFAULTS = {"vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
            "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "hidden_act": "silu",
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "rope_theta": 150000.0, "sliding_window": 128, "attention_dropout": 0.0, "num_local_experts": 128,
            "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "router_aux_loss_coef": 0.001,
            "attention_bias": True,
            # (the config class's default RoPE: YaRN, 32x over 4096 positions)
            "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False, "original_max_position_embeddings": 4096}}


#: keys of the published gpt-oss files from OpenAI's own reference code, which transformers never reads
HARMLESS = {
    "experts_per_token": "the reference code's name for num_experts_per_tok (also in the file, which transformers "
                         "reads)",
    "initial_context_length": "the reference code's YaRN base length; transformers reads rope_scaling's "
                              "original_max_position_embeddings",
}


def to_config(r) -> dict:
    r.ignore("hidden_act")  # (its experts' gated unit is the clamped SwiGLU whatever hidden_act says)
    fields = read_decoder(r, act_key=None)
    r.require("attention_bias", (True,), "gpt-oss's q/k/v/o projections are biased")
    types = read_layer_types(r, lambda i: "sliding_attention" if (i + 1) % 2 else "full_attention")
    experts = r.get("num_experts") if "num_experts" in r else r.get("num_local_experts")
    return dict(fields, **windows(types, r.get("sliding_window")), qkv_bias=True, attn_out_bias=True,
                attention_sinks=True, num_experts=int(experts), experts_per_token=int(r.get("num_experts_per_tok")),
                moe_d_ff=int(fields["d_ff"]), router_bias=True, router_softmax_after_topk=True, expert_bias=True,
                expert_activation="swiglu_clamped", swiglu_alpha=float(r.get("swiglu_alpha")),
                swiglu_limit=float(r.get("swiglu_limit")), **read_router_aux_loss(r),
                dropout=read_dropout(r, "attention_dropout"))


def to_hf(cfg) -> dict:
    return dict(write_decoder(cfg), intermediate_size=cfg.expert_d_ff, attention_bias=True,
                sliding_window=cfg.sliding_window or 128,
                layer_types=["sliding_attention" if cfg.layer_window(i) else "full_attention"
                             for i in range(cfg.num_layers)],
                num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit, **write_router_aux_loss(cfg),
                attention_dropout=cfg.dropout)


register(Family(
    model_type="gpt_oss", architecture="GptOssForCausalLM", config_class="GptOssConfig", defaults=DEFAULTS,
    to_config=to_config, to_hf=to_hf, harmless=HARMLESS,
    weights=Weights(expert_format="transposed_interleaved"),
    kernels=Kernels(norms={"GptOssRMSNorm": "fp32_weight"}, mlps={}, attention=("GptOssAttention",),
                    experts={"GptOssExperts": "transposed_interleaved"}, rope_tables="pairs"),
    tokenizer="byte-level BPE (o200k_harmony)",
    notes="attention sinks, YaRN, biased router + clamped-SwiGLU biased experts; MXFP4 files refused"))
