"""GLM-4 (``Glm4ForCausalLM``, GLM-4-0414): RoPE on interleaved pairs of each head's first ``partial_rotary_factor``
features (this library's own layout: no row permutation, and ``apply_kernels`` runs the kernel interleaved), q/k/v
biases (``attention_bias``, on by default), one fused ``gate_up_proj``, and sandwich norms: ``post_self_attn_layernorm``
on the attention output, ``post_attention_layernorm`` the MLP's input norm, ``post_mlp_layernorm`` on its output."""

from ..family import Family, Fused, Kernels, Weights, read_decoder, read_dropout, register, write_decoder

DEFAULTS = {"vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 13696, "num_hidden_layers": 40,
            "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "hidden_act": "silu",
            "max_position_embeddings": 131072, "rms_norm_eps": 1.5625e-07, "tie_word_embeddings": False,
            "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "attention_bias": True, "attention_dropout": 0.0}
SANDWICH = {"attn_post_norm.weight": "post_self_attn_layernorm.weight", "ffn_post_norm.weight": "post_mlp_layernorm.weight"}
GATE_UP = Fused("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                lambda cfg: (cfg.d_ff, cfg.d_ff))


def to_config(r) -> dict:
    return dict(read_decoder(r, partial_rotary=True), qkv_bias=bool(r.get("attention_bias")), post_norms=True,
                dropout=read_dropout(r, "attention_dropout"))


def to_hf(cfg) -> dict:
    return dict(write_decoder(cfg), attention_bias=cfg.qkv_bias, partial_rotary_factor=cfg.partial_rotary or 1.0,
                attention_dropout=cfg.dropout)


register(Family(
    model_type="glm4", architecture="Glm4ForCausalLM", config_class="Glm4Config", defaults=DEFAULTS,
    to_config=to_config, to_hf=to_hf,
    weights=Weights(names=SANDWICH, rope_layout="interleaved", fused=(GATE_UP,)),
    kernels=Kernels(norms={"Glm4RMSNorm": "cast"}, mlps={"Glm4MLP": "gate_up"}, attention=("Glm4Attention",),
                    rope_layout="interleaved"),
    notes="interleaved partial RoPE, q/k/v biases, fused gate_up, sandwich norms"))
