"""Gemma, Gemma 2 and Gemma 3 (text): GeGLU FFNs (tanh GELU), RMSNorms scaling by ``1 + w``, embeddings times
``sqrt(hidden_size)``, tied heads by default; Gemma 2 / 3 add sandwich norms (their ``post_attention_layernorm``
norms the attention output, ``pre_feedforward_layernorm`` is the FFN's input norm), the softmax scale
``query_pre_attn_scalar ** -0.5``, logit softcaps (Gemma 3's attention applies none) and sliding windows on the
layers ``layer_types`` names; Gemma 3 adds per-head q/k norms and its own RoPE base on the sliding layers (transformers
5's per-layer-type ``rope_parameters`` or 4.x's ``rope_local_base_freq``)."""

from ..family import (
    Family,
    Kernels,
    Weights,
    read_decoder,
    read_dropout,
    read_layer_types,
    read_rope_by_layer_type,
    register,
    windows,
    write_decoder,
)

GEMMA = {"vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
         "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
         "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "rope_theta": 10000.0,
         "attention_bias": False, "attention_dropout": 0.0, "use_bidirectional_attention": None}
GEMMA2 = {**GEMMA, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
          "num_key_value_heads": 4, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
          "sliding_window": 4096, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0}
GEMMA3 = {**GEMMA2, "vocab_size": 262208, "max_position_embeddings": 131072, "final_logit_softcapping": None,
          "attn_logit_softcapping": None, "use_bidirectional_attention": False, "rope_theta": 1_000_000.0,
          "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6}
#: Gemma 2 / 3's sandwich norms: ours -> HF
SANDWICH = {"attn_post_norm.weight": "post_attention_layernorm.weight", "ln2.weight": "pre_feedforward_layernorm.weight",
            "ffn_post_norm.weight": "post_feedforward_layernorm.weight"}
#: keys transformers writes that change nothing here: the activation key the other Gemmas read, the cache kind
#: generation picks, the derived window pattern
IGNORED = ("hidden_activation", "hidden_act", "cache_implementation", "_sliding_window_pattern", "sliding_window_size")


def _gemma(r, act_key: str = "hidden_act", rope: tuple | None = None) -> dict:
    # (transformers reads Gemma 1's legacy "gelu" as the tanh approximation)
    fields = read_decoder(r, act_key=act_key, acts=("gelu_pytorch_tanh", "gelu") if act_key == "hidden_act"
                          else ("gelu_pytorch_tanh",), rope=rope)
    r.require("attention_bias", (False,), "TransformerLM's Gemma layout has no projection biases")
    r.require("use_bidirectional_attention", lambda v: not v, "a causal LM")
    return dict(fields, ffn="geglu", norm_offset=True, embedding_scale=float(fields["d_model"]) ** 0.5,
                dropout=read_dropout(r, "attention_dropout"))


def _gemma_hf(cfg, act_key: str = "hidden_act") -> dict:
    return dict(write_decoder(cfg, "gelu_pytorch_tanh", act_key), attention_bias=False, attention_dropout=cfg.dropout)


def _sandwich(r, fields: dict, pattern: int) -> dict:
    """Gemma 2 / 3's fields beyond Gemma's: the query scale, the final softcap, the windowed layers."""
    types = read_layer_types(r, lambda i: "sliding_attention" if (i + 1) % pattern else "full_attention")
    scalar = r.get("query_pre_attn_scalar")
    cap = r.get("final_logit_softcapping")
    return dict(fields, post_norms=True, query_scale=float(scalar) ** -0.5, final_softcap=cap or None,
                **windows(types, r.get("sliding_window")))


def _sandwich_hf(cfg) -> dict:
    scalar = cfg.query_scale ** -2 if cfg.query_scale else cfg.d_head
    return dict(_gemma_hf(cfg, "hidden_activation"),
                # (a window size transformers accepts even when no layer slides: null fails its validation)
                sliding_window=cfg.sliding_window or 4096,
                query_pre_attn_scalar=round(scalar) if abs(scalar - round(scalar)) < 1e-6 * scalar else scalar,
                layer_types=["sliding_attention" if cfg.layer_window(i) else "full_attention"
                             for i in range(cfg.num_layers)],
                final_logit_softcapping=cfg.final_softcap)


def _gemma2(r) -> dict:
    fields = _sandwich(r, _gemma(r, "hidden_activation"), pattern=2)
    cap = r.get("attn_logit_softcapping")
    return dict(fields, attn_softcap=cap or None)


def _gemma3(r) -> dict:
    r.ignore("attn_logit_softcapping")  # (Gemma 3's attention does not apply it)
    rope = read_rope_by_layer_type(r, "rope_local_base_freq")
    local_theta, local_scaling = rope["sliding_attention"]
    if local_scaling is not None:
        raise ValueError(f"rope_parameters.sliding_attention={local_scaling!r} is not supported (default RoPE only "
                         "on the sliding layers)")
    fields = _sandwich(r, _gemma(r, "hidden_activation", rope=rope["full_attention"]),
                       pattern=int(r.get("sliding_window_pattern")))
    return dict(fields, qk_norm="head", local_rope_theta=local_theta if fields["sliding_window"] else None)


def _gemma3_hf(cfg) -> dict:
    return dict(_sandwich_hf(cfg), rope_local_base_freq=cfg.local_rope_theta or cfg.rope_theta)


def _kernels(prefix: str) -> Kernels:
    return Kernels(norms={f"{prefix}RMSNorm": "offset"}, mlps={f"{prefix}MLP": "geglu"}, attention=(f"{prefix}Attention",),
                   logits=lambda config: {"softcap": getattr(config, "final_logit_softcapping", None)})


register(Family(
    model_type="gemma", architecture="GemmaForCausalLM", config_class="GemmaConfig", defaults=GEMMA,
    to_config=_gemma, to_hf=_gemma_hf, ignored=IGNORED, kernels=_kernels("Gemma"), tokenizer="SentencePiece BPE",
    notes="GeGLU, (1 + w) norms, scaled embeddings"))
register(Family(
    model_type="gemma2", architecture="Gemma2ForCausalLM", config_class="Gemma2Config", defaults=GEMMA2,
    to_config=_gemma2, to_hf=lambda cfg: dict(_sandwich_hf(cfg), attn_logit_softcapping=cfg.attn_softcap),
    ignored=IGNORED, weights=Weights(names=SANDWICH), kernels=_kernels("Gemma2"), tokenizer="SentencePiece BPE",
    notes="sandwich norms, softcaps, sliding layers"))
register(Family(
    model_type="gemma3_text", architecture="Gemma3ForCausalLM", config_class="Gemma3TextConfig", defaults=GEMMA3,
    to_config=_gemma3, to_hf=_gemma3_hf, ignored=IGNORED, weights=Weights(names=SANDWICH),
    kernels=_kernels("Gemma3"), tokenizer="SentencePiece BPE",
    notes="+ q/k norms, local RoPE base on sliding layers"))
