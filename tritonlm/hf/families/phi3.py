"""Phi-3: fused ``qkv_proj`` (q, k, v rows in that order) and ``gate_up_proj`` (gate rows, then up), split on load
and fused again on save; RoPE on each head's first ``partial_rotary_factor`` features (transformers 5 keeps it in
``rope_parameters``); a sliding window on every layer. ``longrope`` scaling is refused."""

from ..family import (
    Family,
    Fused,
    Kernels,
    Weights,
    derived_head_dim,
    read_decoder,
    read_dropout,
    register,
    write_decoder,
)

DEFAULTS = {"vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": derived_head_dim, "hidden_act": "silu",
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "rope_theta": 10000.0,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0, "sliding_window": None}
#: in the file, inside each layer: one q/k/v projection and one gate/up projection
FUSED = (Fused("self_attn.qkv_proj.weight", ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                             "self_attn.v_proj.weight"),
               lambda cfg: (cfg.num_heads * cfg.d_head, cfg.kv_heads * cfg.d_head, cfg.kv_heads * cfg.d_head)),
         Fused("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
               lambda cfg: (cfg.d_ff, cfg.d_ff)))


#: keys of the Phi-3 / Phi-4 files that their remote code (configuration_phi3.py) defines and transformers' Phi-3
#: modeling never reads; a file whose weights hold such biases fails on the unexpected bias tensors, by name
_REMOTE = "Phi-4's remote-code option"
HARMLESS = {
    "attention_bias": "transformers' Phi-3 attention has no biases and never reads the flag",
    "mlp_bias": "transformers' Phi-3 MLP has no biases and never reads the flag",
    "lm_head_bias": "transformers' Phi-3 LM head has no bias and never reads the flag",
    "full_attn_mod": f"{_REMOTE} for mixing full-attention layers among windowed ones; not read",
    "interpolate_factor": f"{_REMOTE} for position interpolation; not read (RoPE scaling is rope_scaling's)",
}


def to_config(r) -> dict:
    window = r.get("sliding_window")
    return dict(read_decoder(r, partial_rotary=True), sliding_window=int(window) if window else None,
                dropout=read_dropout(r, "resid_pdrop", "embd_pdrop", "attention_dropout"))


def to_hf(cfg) -> dict:
    return dict(write_decoder(cfg), sliding_window=cfg.sliding_window, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
                attention_dropout=cfg.dropout, partial_rotary_factor=cfg.partial_rotary or 1.0,
                original_max_position_embeddings=cfg.context_length)


register(Family(
    model_type="phi3", architecture="Phi3ForCausalLM", config_class="Phi3Config", defaults=DEFAULTS,
    to_config=to_config, to_hf=to_hf, ignored=("original_max_position_embeddings",),  # (read by longrope only)
    weights=Weights(fused=FUSED), harmless=HARMLESS,
    kernels=Kernels(norms={"Phi3RMSNorm": "cast"}, mlps={"Phi3MLP": "gate_up"}, attention=("Phi3Attention",)),
    tokenizer="SentencePiece BPE", notes="fused qkv / gate_up, partial rotary, window on every layer"))
