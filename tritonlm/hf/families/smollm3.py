"""SmolLM3: Llama's layout with NoPE layers (``no_rope_layers[i] == 0``: layer i applies no RoPE; by default every
``no_rope_layer_interval``-th layer) and optional sliding windows (``use_sliding_window`` on the layers
``layer_types`` names sliding, by default the NoPE ones)."""

from ..family import (
    Family,
    Kernels,
    derived_head_dim,
    read_decoder,
    read_dropout,
    read_layer_types,
    register,
    windows,
    write_decoder,
)


def _no_rope_default(r) -> list[int]:
    interval = int(r.get("no_rope_layer_interval"))
    return [int((i + 1) % interval != 0) for i in range(r.get("num_hidden_layers"))]


DEFAULTS = {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
            "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": derived_head_dim, "hidden_act": "silu",
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
            "rope_theta": 2_000_000.0, "use_sliding_window": False, "sliding_window": None,
            "no_rope_layers": _no_rope_default, "no_rope_layer_interval": 4, "attention_bias": False,
            "attention_dropout": 0.0, "mlp_bias": False}


def to_config(r) -> dict:
    fields = read_decoder(r)
    r.ignore("no_rope_layer_interval")  # (it only makes the default no_rope_layers)
    uses_rope = r.value_or_default("no_rope_layers")
    if len(uses_rope) != fields["num_layers"] or set(uses_rope) - {0, 1}:
        raise ValueError(f"no_rope_layers={uses_rope!r} is not supported: one 0 (NoPE) or 1 (RoPE) per layer")
    nope = tuple(i for i, rope in enumerate(uses_rope) if not rope)
    window = r.get("sliding_window")
    sliding = bool(r.get("use_sliding_window"))
    types = read_layer_types(r, lambda i: "sliding_attention" if sliding and window is not None and not uses_rope[i]
                             else "full_attention")
    if not sliding and "sliding_attention" in types:
        raise ValueError(f"layer_types={types!r} is not supported with use_sliding_window=false (the layers' masks "
                         "would slide, their attention would not)")
    bias = bool(r.get("attention_bias"))
    return dict(fields, nope_layers=nope or None, qkv_bias=bias, attn_out_bias=bias, mlp_bias=bool(r.get("mlp_bias")),
                dropout=read_dropout(r, "attention_dropout"), **windows(types if sliding else [], window))


def to_hf(cfg) -> dict:
    if cfg.qkv_bias != cfg.attn_out_bias:
        raise ValueError("model_type 'smollm3' has one attention_bias for q/k/v and the output projection: "
                         f"qkv_bias={cfg.qkv_bias} and attn_out_bias={cfg.attn_out_bias} differ")
    return dict(write_decoder(cfg), no_rope_layers=[int(cfg.layer_has_rope(i)) for i in range(cfg.num_layers)],
                use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
                layer_types=["sliding_attention" if cfg.layer_window(i) else "full_attention"
                             for i in range(cfg.num_layers)],
                attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias, attention_dropout=cfg.dropout)


#: keys of the published SmolLM3 files that transformers' SmolLM3 never reads
HARMLESS = {"max_window_layers": "Qwen2's windowed-layers bound, carried in the files; SmolLM3 windows the layers "
                                 "layer_types / use_sliding_window name"}

register(Family(
    model_type="smollm3", architecture="SmolLM3ForCausalLM", config_class="SmolLM3Config", defaults=DEFAULTS,
    to_config=to_config, to_hf=to_hf, harmless=HARMLESS,
    kernels=Kernels(norms={"SmolLM3RMSNorm": "cast"}, mlps={"SmolLM3MLP": "swiglu"}, attention=("SmolLM3Attention",)),
    notes="NoPE layers (`no_rope_layers`), optional sliding layers"))
