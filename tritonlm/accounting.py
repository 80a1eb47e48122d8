"""Parameter, FLOP and memory accounting for :class:`~tritonlm.config.ModelConfig` models.

FLOPs count matrix multiplies only, 2·m·n·k each (the seeds' convention): elementwise work (norms,
softmax, activations) is a rounding error next to them. The attention matmuls (QKᵀ and PV) are counted
over the full seq×seq square, as the seeds do, even though a causal kernel skips half of it; MFU figures
therefore follow the same formula the literature uses.

Mixture-of-experts layers have *total* parameters (every expert) and *active* ones (what one token computes: the
router, ``experts_per_token`` experts, the shared expert); FLOPs, and so MFU, count the active work.
"""

from __future__ import annotations

from .config import ModelConfig

#: Dense bf16 tensor-core peaks (FLOP/s) used for MFU; keyed by a substring of the device name.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 70e12,
    "4090": 165e12,
}

_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}


def _norm_params(cfg: ModelConfig) -> int:
    """Parameters of one normalisation layer."""
    return {"rmsnorm": cfg.d_model, "layernorm": 2 * cfg.d_model, "batchnorm": 2 * cfg.d_model,
            "none": 0}[cfg.norm]


def _ffn_matrices(cfg: ModelConfig) -> int:
    return 3 if cfg.ffn in ("swiglu", "geglu") else 2


def _ffn_params(cfg: ModelConfig, layer: int, active: bool = False) -> int:
    """Parameters of layer ``layer``'s FFN; ``active``: those one token uses (an MoE layer's routed experts)."""
    d = cfg.d_model
    if not cfg.is_moe_layer(layer):  # (+ ERNIE 4.5's biases: d_ff on the gate and up rows, d_model on down)
        return _ffn_matrices(cfg) * d * cfg.d_ff + (2 * cfg.d_ff + d) * cfg.mlp_bias
    experts = cfg.experts_per_token if active else cfg.num_experts
    # + its sigmoid gate (Qwen2-MoE; DeepSeek-V3's shared experts have none)
    shared = 3 * d * cfg.shared_expert_d_ff + d * cfg.shared_expert_gate if cfg.shared_expert_d_ff else 0
    biases = (2 * cfg.expert_d_ff + d) * cfg.expert_bias  # (gpt-oss: gate_up and down biases per expert)
    # router (+ its bias), experts, shared expert
    return cfg.num_experts * (d + cfg.router_bias) + experts * (3 * d * cfg.expert_d_ff + biases) + shared


def _mla_matrices(cfg: ModelConfig) -> int:
    """Weight-matrix entries of one MLA layer (:class:`~tritonlm.modules.reference.MultiHeadLatentAttention`): the
    query path (one projection, or the low-rank pair), the latent + shared rotary key, the expansion into each head's
    nope keys and values, the output projection -- one multiply-add per token each."""
    d, h, d_qk = cfg.d_model, cfg.num_heads, cfg.d_head
    query = d * h * d_qk if cfg.q_lora_rank is None else (d + h * d_qk) * cfg.q_lora_rank
    latent = d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    expand = cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return query + latent + expand + h * cfg.v_head_dim * d


def _mla_vectors(cfg: ModelConfig) -> int:
    """An MLA layer's norm weights (the latents') and the a-projections' biases (``attention_bias``)."""
    lora = cfg.q_lora_rank or 0
    return lora + cfg.kv_lora_rank + (lora + cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cfg.qkv_bias


def _linear_sizes(cfg: ModelConfig) -> tuple[int, int, int]:
    """A Gated DeltaNet layer's ``(q/k/v conv channels, value features, value heads)``."""
    value = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    return 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + value, value, cfg.linear_num_value_heads


def _linear_params(cfg: ModelConfig) -> int:
    """A Gated DeltaNet layer's token mixer: the q/k/v, z, beta and decay projections, the conv taps, ``dt_bias`` and
    ``A_log``, the gated norm's weight and the output projection."""
    channels, value, heads = _linear_sizes(cfg)
    return (cfg.d_model * (channels + value + 2 * heads) + channels * cfg.linear_conv_kernel + 2 * heads
            + cfg.linear_value_head_dim + value * cfg.d_model)


def param_count(cfg: ModelConfig, active: bool = False) -> int:
    """Trainable parameters: embeddings + layers (attention, FFN, two norms) + final norm + LM head. ``active``:
    the parameters one token's forward uses (differs from the total in mixture-of-experts models only)."""
    d, d_q, d_kv = cfg.d_model, cfg.num_heads * cfg.d_head, cfg.kv_heads * cfg.d_head
    # q and output projections d x (heads x d_head); k and v d x (kv heads x d_head) (smaller under GQA); Qwen2's
    # q/k/v biases, an output bias; q/k norm weights per head (Qwen3) or over the projections (OLMo 2); sandwich
    # norms (Gemma 2 / 3, GLM-4)
    qk_norms = {None: 0, "head": 2 * cfg.d_head, "projection": d_q + d_kv}[cfg.qk_norm]
    attention_and_norms = (2 * d * d_q + 2 * d * d_kv + (2 + 2 * cfg.post_norms) * _norm_params(cfg)
                           + (d_q + 2 * d_kv) * cfg.qkv_bias + d * cfg.attn_out_bias + qk_norms
                           + cfg.num_heads * cfg.attention_sinks + d * d_q * cfg.attn_output_gate)
    if cfg.attention == "mla":
        attention_and_norms = (_mla_matrices(cfg) + _mla_vectors(cfg) + (2 + 2 * cfg.post_norms) * _norm_params(cfg)
                               + d * cfg.attn_out_bias)
    # (a hybrid's Gated DeltaNet layers replace the attention, keeping the two norms)
    linear_and_norms = _linear_params(cfg) + 2 * _norm_params(cfg)
    layers = sum((linear_and_norms if cfg.is_linear_layer(i) else attention_and_norms) + _ffn_params(cfg, i, active)
                 for i in range(cfg.num_layers))
    final_norm = _norm_params(cfg) if cfg.norm_position == "pre" else 0
    lm_head = 0 if cfg.tie_embeddings else d * cfg.vocab_size  # tied: the embedding matrix is the head
    return cfg.vocab_size * d + layers + final_norm + lm_head


def forward_flops(cfg: ModelConfig, seq_len: int, batch_size: int = 1) -> dict:
    """Matmul FLOPs of one forward pass over ``batch_size`` sequences of ``seq_len`` tokens.

    Returns a dict with ``attention_projections`` (Q, K, V, output; the output gate), ``attention_matmuls`` (QKᵀ and
    PV), ``linear_attention`` (a hybrid's Gated DeltaNet layers: their projections, the conv taps, and the delta rule
    at its recurrent count, ``6·d_k·d_v`` per token and value head: ``Sᵀk``, the rank-1 update and ``Sᵀq``), ``ffn``
    (an MoE layer's router and the experts a token is routed to: active FLOPs), ``lm_head`` and ``total``.
    """
    if seq_len <= 0 or batch_size <= 0:
        raise ValueError("seq_len and batch_size must be positive")
    tokens = batch_size * seq_len
    d, n_linear = cfg.d_model, len(cfg.linear_layers or ())
    layers = cfg.num_layers - n_linear  # (attention layers)
    d_q, d_kv = cfg.num_heads * cfg.d_head, cfg.kv_heads * cfg.d_head
    projections = layers * 2 * tokens * d * (2 * d_q + 2 * d_kv + d_q * cfg.attn_output_gate)
    pv = d_q  # (MLA: P·V over the values' own width)
    if cfg.attention == "mla":  # (every projection weight is one multiply-add per token)
        projections = layers * 2 * tokens * _mla_matrices(cfg)
        pv = cfg.num_heads * cfg.v_dim
    out = {
        "attention_projections": projections,
        # QKᵀ: [seq, d_head] x [d_head, seq] per head, then P·V: [seq, seq] x [seq, d_v] per head
        "attention_matmuls": layers * 2 * batch_size * seq_len * seq_len * (d_q + pv),
        "linear_attention": n_linear * tokens * (2 * (_linear_params(cfg) - 2 * cfg.linear_num_value_heads
                                                      - cfg.linear_value_head_dim)
                                                 + 6 * cfg.linear_num_value_heads * cfg.linear_key_head_dim
                                                 * cfg.linear_value_head_dim),
        "ffn": sum(2 * tokens * _ffn_params(cfg, i, active=True) for i in range(cfg.num_layers)),
        "lm_head": 2 * tokens * d * cfg.vocab_size,
    }
    out["total"] = sum(out.values())
    return out


def training_flops(cfg: ModelConfig, seq_len: int, batch_size: int = 1, steps: int = 1) -> int:
    """FLOPs of ``steps`` training steps: forward + backward ≈ 3 × forward (backward = 2 × forward)."""
    return 3 * forward_flops(cfg, seq_len, batch_size)["total"] * steps


def kv_cache_bytes(cfg: ModelConfig, seq_len: int, batch_size: int = 1, dtype: str = "bf16") -> int:
    """Bytes of a full KV cache: keys and values of every attention layer, ``kv_heads × d_head`` per token each (MLA:
    the compressed latent and the shared rotary key, ``kv_lora_rank + qk_rope_head_dim`` per token, what the model
    caches); a hybrid's Gated DeltaNet layers add their fixed-size recurrent state per sequence."""
    if dtype not in _BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; one of {sorted(_BYTES)}")
    per_token = (cfg.kv_lora_rank + cfg.qk_rope_head_dim if cfg.attention == "mla"
                 else 2 * cfg.kv_heads * cfg.d_head)
    n_linear = len(cfg.linear_layers or ())
    # a Gated DeltaNet layer's cache is fixed-size per sequence: its fp32 state and the conv's last W - 1 inputs
    channels, _, heads = _linear_sizes(cfg)
    recurrent = (heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
                 + channels * (cfg.linear_conv_kernel - 1) * _BYTES[dtype])
    return ((cfg.num_layers - n_linear) * batch_size * seq_len * per_token * _BYTES[dtype]
            + n_linear * batch_size * recurrent)


def activation_elements(cfg: ModelConfig, seq_len: int, batch_size: int = 1) -> dict:
    """Elements saved for backward by the *reference* model, by the CS336 counting convention.

    Per layer: the two norm inputs, Q/K/V, the attention scores and their softmax (heads × seq²),
    the attention output and output projection, the FFN's two up-projections, their activation and
    product, and the down projection; then the final norm, the logits and the cross-entropy's softmax.
    This is an estimate; ``tritonlm accounting --activations`` also *measures* saved tensors.
    """
    b, s, d, h = batch_size, seq_len, cfg.d_model, cfg.num_heads
    d_kv = cfg.kv_heads * cfg.d_head  # K and V are this wide (d_model unless GQA)
    dense_ffn = (4 if cfg.ffn in ("swiglu", "geglu") else 2) * b * s * cfg.d_ff
    # an MoE layer: its router logits, each routed pair's two projections, activation and product
    moe_ffn = b * s * cfg.num_experts + 4 * b * s * cfg.experts_per_token * cfg.expert_d_ff + (
        4 * b * s * cfg.shared_expert_d_ff if cfg.shared_expert_d_ff else 0)
    attention = b * s * d * (2 + 1 + 1 + 1 + 1) + 2 * b * s * d_kv + 2 * b * h * s * s
    layers = [attention + (moe_ffn if cfg.is_moe_layer(i) else dense_ffn) for i in range(cfg.num_layers)]
    return {
        "per_layer": layers[0],
        "layers": sum(layers),
        "head": b * s * d + 2 * b * s * cfg.vocab_size,
        "total": sum(layers) + b * s * d + 2 * b * s * cfg.vocab_size,
    }


def memory_bytes(cfg: ModelConfig, seq_len: int, batch_size: int = 1, param_dtype: str = "fp32",
                 activation_dtype: str | None = None) -> dict:
    """Training memory in bytes: parameters, gradients, AdamW state (two fp32 moments), activations."""
    if param_dtype not in _BYTES:
        raise ValueError(f"unknown dtype {param_dtype!r}; one of {sorted(_BYTES)}")
    act_dtype = activation_dtype or param_dtype
    if act_dtype not in _BYTES:
        raise ValueError(f"unknown dtype {act_dtype!r}; one of {sorted(_BYTES)}")
    n = param_count(cfg)
    out = {
        "params": n * _BYTES[param_dtype],
        "grads": n * _BYTES[param_dtype],
        "adamw_state": 2 * n * 4,
        "activations": activation_elements(cfg, seq_len, batch_size)["total"] * _BYTES[act_dtype],
    }
    out["total"] = sum(out.values())
    return out


def peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s for a GPU name such as ``"NVIDIA H100 80GB HBM3"``; ``None`` if unknown."""
    for key, value in PEAK_BF16_FLOPS.items():
        if key.lower() in device_name.lower():
            return value
    return None


def mfu(cfg: ModelConfig, seq_len: int, batch_size: int, step_time_s: float, peak: float,
        training: bool = True) -> float:
    """Model FLOP utilisation: accounting FLOPs of one step ÷ step time ÷ peak FLOP/s."""
    if step_time_s <= 0 or peak <= 0:
        raise ValueError("step_time_s and peak must be positive")
    flops = training_flops(cfg, seq_len, batch_size) if training else forward_flops(
        cfg, seq_len, batch_size)["total"]
    return flops / step_time_s / peak
