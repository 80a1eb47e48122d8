"""ERNIE 4.5 (dense, ``Ernie4_5ForCausalLM``): RoPE on interleaved pairs over the whole head, computed in fp32 (this
library's own layout: nothing to permute), and ``use_bias`` putting biases on q/k/v/o and on gate/up/down."""

from ..family import Family, Kernels, Weights, read_decoder, register, write_decoder

DEFAULTS = {"vocab_size": 103424, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 18,
            "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128, "hidden_act": "silu",
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
            "rope_theta": 500000.0, "use_bias": False}


def to_config(r) -> dict:
    bias = bool(r.get("use_bias"))
    return dict(read_decoder(r), qkv_bias=bias, attn_out_bias=bias, mlp_bias=bias)


def to_hf(cfg) -> dict:
    if not cfg.qkv_bias == cfg.attn_out_bias == cfg.mlp_bias:
        raise ValueError("model_type 'ernie4_5' has one use_bias for every projection: qkv_bias="
                         f"{cfg.qkv_bias}, attn_out_bias={cfg.attn_out_bias}, mlp_bias={cfg.mlp_bias} differ")
    return dict(write_decoder(cfg), use_bias=cfg.qkv_bias)


register(Family(
    model_type="ernie4_5", architecture="Ernie4_5ForCausalLM", config_class="Ernie4_5Config", defaults=DEFAULTS,
    to_config=to_config, to_hf=to_hf, weights=Weights(rope_layout="interleaved"),
    kernels=Kernels(norms={"Ernie4_5RMSNorm": "cast"}, mlps={"Ernie4_5MLP": "swiglu"}, attention=("Ernie4_5Attention",),
                    rope_layout="interleaved"),
    tokenizer="SentencePiece BPE (where the repository ships a tokenizer.json)",
    notes="interleaved RoPE, `use_bias` on every projection"))
