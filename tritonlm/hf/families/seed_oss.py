"""Seed-OSS: Llama's layout with q/k/v biases (``attention_bias``) and an output-projection bias
(``attention_out_bias``) as separate flags, optional MLP biases. Its published configs train with dropout 0.1
(``attention_dropout``, ``residual_dropout``): evaluation and generation are exact, training with a nonzero dropout is
a one-line error until the kernels have dropout (``ModelConfig.dropout``)."""

from ..family import Family, Kernels, read_decoder, read_dropout, register, write_decoder

DEFAULTS = {"vocab_size": 155136, "hidden_size": 4096, "intermediate_size": 27648, "num_hidden_layers": 64,
            "num_attention_heads": 80, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
            "max_position_embeddings": 524288, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "rope_theta": 10000.0, "attention_bias": True, "attention_out_bias": False, "attention_dropout": 0.1,
            "residual_dropout": 0.1, "mlp_bias": False}


def to_config(r) -> dict:
    return dict(read_decoder(r), qkv_bias=bool(r.get("attention_bias")), attn_out_bias=bool(r.get("attention_out_bias")),
                mlp_bias=bool(r.get("mlp_bias")), dropout=read_dropout(r, "attention_dropout", "residual_dropout"))


def to_hf(cfg) -> dict:
    return dict(write_decoder(cfg), attention_bias=cfg.qkv_bias, attention_out_bias=cfg.attn_out_bias,
                mlp_bias=cfg.mlp_bias, attention_dropout=cfg.dropout, residual_dropout=cfg.dropout)


register(Family(
    model_type="seed_oss", architecture="SeedOssForCausalLM", config_class="SeedOssConfig", defaults=DEFAULTS,
    to_config=to_config, to_hf=to_hf,
    kernels=Kernels(norms={"SeedOssRMSNorm": "cast"}, mlps={"SeedOssMLP": "swiglu"}, attention=("SeedOssAttention",)),
    notes="separate q/k/v and output biases; dropout 0.1 configs: eval / generation exact, training refused"))
