"""Granite (3.x dense): Llama's layout with four scalars: ``embedding_multiplier`` (embeddings times it),
``residual_multiplier`` (each branch's output times it before its residual add), ``attention_multiplier`` (the
softmax scale itself, not 1/sqrt(d)) and ``logits_scaling`` (the logits divided by it, in the fused loss too)."""

from ..family import Family, Kernels, derived_head_dim, read_decoder, read_dropout, register, write_decoder

DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": derived_head_dim, "hidden_act": "silu",
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000.0,
            "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "embedding_multiplier": 1.0,
            "logits_scaling": 1.0, "residual_multiplier": 1.0, "attention_multiplier": 1.0}


def _scale(value) -> float | None:
    return None if float(value) == 1.0 else float(value)


def to_config(r) -> dict:
    fields = read_decoder(r)
    bias = bool(r.get("attention_bias"))
    d_head = fields["head_dim"] or fields["d_model"] // fields["num_heads"]
    scale = float(r.get("attention_multiplier"))
    return dict(fields, qkv_bias=bias, attn_out_bias=bias, mlp_bias=bool(r.get("mlp_bias")),
                embedding_scale=_scale(r.get("embedding_multiplier")),
                residual_scale=_scale(r.get("residual_multiplier")),
                query_scale=None if scale == d_head ** -0.5 else scale, logits_divisor=_scale(r.get("logits_scaling")),
                dropout=read_dropout(r, "attention_dropout"))


def to_hf(cfg) -> dict:
    if cfg.qkv_bias != cfg.attn_out_bias:
        raise ValueError("model_type 'granite' has one attention_bias for q/k/v and the output projection: "
                         f"qkv_bias={cfg.qkv_bias} and attn_out_bias={cfg.attn_out_bias} differ")
    return dict(write_decoder(cfg), attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias, attention_dropout=cfg.dropout,
                embedding_multiplier=cfg.embedding_scale or 1.0, residual_multiplier=cfg.residual_scale or 1.0,
                attention_multiplier=cfg.query_scale if cfg.query_scale is not None else cfg.d_head ** -0.5,
                logits_scaling=cfg.logits_divisor or 1.0)


register(Family(
    model_type="granite", architecture="GraniteForCausalLM", config_class="GraniteConfig", defaults=DEFAULTS,
    to_config=to_config, to_hf=to_hf,
    kernels=Kernels(norms={"GraniteRMSNorm": "cast"}, mlps={"GraniteMLP": "swiglu"}, attention=("GraniteAttention",),
                    logits=lambda config: {"divisor": getattr(config, "logits_scaling", 1.0)}),
    notes="embedding / residual / attention multipliers, `logits_scaling`"))
