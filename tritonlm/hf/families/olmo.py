"""OLMo 2 and OLMo 3: each branch's output normed before its residual add (no input norms: our ``norm_position=
"output"``, their ``post_attention_layernorm`` / ``post_feedforward_layernorm``), q/k RMSNorms over the whole
projections, an RMSNorm that multiplies the fp32 x̂ by its weight before casting; OLMo 3 adds sliding-window layers
(``layer_types``) with a RoPE per layer type (scaling on the full layers only)."""

from ..family import (
    Family,
    Kernels,
    Weights,
    derived_head_dim,
    read_decoder,
    read_dropout,
    read_layer_types,
    read_rope_by_layer_type,
    register,
    windows,
    write_decoder,
)

OLMO2 = {"vocab_size": 50304, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": derived_head_dim, "hidden_act": "silu",
         "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "rope_theta": 10000.0,
         "attention_bias": False, "attention_dropout": 0.0}
OLMO3 = {**OLMO2, "rope_theta": 500000.0, "sliding_window": 4096}
OUTPUT_NORMS = {"ln1.weight": "post_attention_layernorm.weight", "ln2.weight": "post_feedforward_layernorm.weight"}


def _olmo2(r, rope: tuple | None = None) -> dict:
    fields = read_decoder(r, rope=rope)
    r.require("attention_bias", (False,), "TransformerLM's OLMo layout has no projection biases")
    return dict(fields, norm_position="output", qk_norm="projection", dropout=read_dropout(r, "attention_dropout"))


def _olmo2_hf(cfg) -> dict:
    return dict(write_decoder(cfg), attention_bias=False, attention_dropout=cfg.dropout)


def _olmo3(r) -> dict:
    rope = read_rope_by_layer_type(r)
    (theta, scaling), (local_theta, local_scaling) = rope["full_attention"], rope["sliding_attention"]
    if local_scaling is not None:
        raise ValueError(f"rope_parameters.sliding_attention={local_scaling!r} is not supported (default RoPE only "
                         "on the sliding layers)")
    fields = _olmo2(r, rope=(theta, scaling))
    types = read_layer_types(r, lambda i: "sliding_attention" if (i + 1) % 4 else "full_attention")
    fields.update(windows(types, r.get("sliding_window")))
    # the sliding layers' own RoPE only where it differs from the full layers' (another base, or no scaling)
    own = fields["sliding_window"] is not None and (local_theta != theta or scaling is not None)
    return dict(fields, local_rope_theta=local_theta if own else None)


def _olmo3_hf(cfg) -> dict:
    out = _olmo2_hf(cfg)
    del out["rope_theta"], out["rope_scaling"]
    full = {"rope_type": "default", "rope_theta": cfg.rope_theta, **(cfg.rope_scaling or {})}
    return dict(out, sliding_window=cfg.sliding_window or 4096,
                layer_types=["sliding_attention" if cfg.layer_window(i) else "full_attention"
                             for i in range(cfg.num_layers)],
                rope_parameters={"full_attention": full, "sliding_attention": {
                    "rope_type": "default", "rope_theta": cfg.local_rope_theta or cfg.rope_theta}})


def _kernels(prefix: str) -> Kernels:
    return Kernels(norms={f"{prefix}RMSNorm": "fp32_weight"}, mlps={f"{prefix}MLP": "swiglu"},
                   attention=(f"{prefix}Attention",))


register(Family(
    model_type="olmo2", architecture="Olmo2ForCausalLM", config_class="Olmo2Config", defaults=OLMO2,
    to_config=_olmo2, to_hf=_olmo2_hf, weights=Weights(names=OUTPUT_NORMS), kernels=_kernels("Olmo2"),
    notes="output norms, q/k norms over the projections"))
register(Family(
    model_type="olmo3", architecture="Olmo3ForCausalLM", config_class="Olmo3Config", defaults=OLMO3,
    to_config=_olmo3, to_hf=_olmo3_hf, weights=Weights(names=OUTPUT_NORMS), kernels=_kernels("Olmo3"),
    notes="+ sliding layers, RoPE per layer type (scaling on full layers)"))
