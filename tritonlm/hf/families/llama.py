"""Llama (``LlamaForCausalLM``): the layout every other family is written against, and the family a model built
from scratch is saved as."""

from ..family import Family, Kernels, derived_head_dim, read_decoder, read_dropout, register, write_decoder

DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": derived_head_dim, "hidden_act": "silu",
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "rope_theta": 10000.0, "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False}


def to_config(r) -> dict:
    fields = read_decoder(r)
    r.require("attention_bias", (False,), "TransformerLM's Llama layout has no projection biases")
    r.require("mlp_bias", (False,), "TransformerLM's Llama layout has no MLP biases")
    return dict(fields, dropout=read_dropout(r, "attention_dropout"))


def to_hf(cfg) -> dict:
    return dict(write_decoder(cfg), attention_bias=False, mlp_bias=False, attention_dropout=cfg.dropout)


register(Family(
    model_type="llama", architecture="LlamaForCausalLM", config_class="LlamaConfig", defaults=DEFAULTS,
    to_config=to_config, to_hf=to_hf, default=True,
    kernels=Kernels(norms={"LlamaRMSNorm": "cast"}, mlps={"LlamaMLP": "swiglu"}, attention=("LlamaAttention",)),
    tokenizer="byte-level BPE (Llama 3); SentencePiece BPE (Llama 2)",
    notes="GQA, tied embeddings, Llama 3 / linear `rope_scaling`"))
