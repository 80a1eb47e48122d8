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
from .modules.parts import flop_categories

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


def _layer_parts(cfg: ModelConfig):
    """Each layer's ``(mixer, mlp)`` part specs (:mod:`tritonlm.modules.parts`): the accounting asks them."""
    return [(cfg.layer_mixer(i), cfg.layer_mlp(i)) for i in range(cfg.num_layers)]


def param_count(cfg: ModelConfig, active: bool = False) -> int:
    """Trainable parameters: embeddings + layers (mixer, MLP, two norms, sandwich norms) + final norm + LM head.
    ``active``: the parameters one token's forward uses (differs from the total in mixture-of-experts models
    only)."""
    norms = (2 + 2 * cfg.post_norms) * _norm_params(cfg)  # (sandwich norms: Gemma 2 / 3, GLM-4)
    layers = sum(mixer.param_count() + mlp.param_count(active) + norms for mixer, mlp in _layer_parts(cfg))
    final_norm = _norm_params(cfg) if cfg.norm_position == "pre" else 0
    lm_head = 0 if cfg.tie_embeddings else cfg.d_model * cfg.vocab_size  # tied: the embedding matrix is the head
    return cfg.vocab_size * cfg.d_model + layers + final_norm + lm_head


def forward_flops(cfg: ModelConfig, seq_len: int, batch_size: int = 1) -> dict:
    """Matmul FLOPs of one forward pass over ``batch_size`` sequences of ``seq_len`` tokens, by category: what each
    layer's parts count (:meth:`~tritonlm.modules.parts.Part.forward_flops`), then ``lm_head`` and ``total``.

    The categories: ``attention_projections`` (Q, K, V, output; the output gate; MLA's latent projections),
    ``attention_matmuls`` (QKᵀ and PV), ``linear_attention`` (a hybrid's Gated DeltaNet layers: their projections,
    the conv taps, and the delta rule at its recurrent count, ``6·d_k·d_v`` per token and value head: ``Sᵀk``, the
    rank-1 update and ``Sᵀq``), ``ffn`` (an MoE layer's router and the experts a token is routed to: active FLOPs).
    Every category a part kind counts is present, 0 where the model has no such part.
    """
    if seq_len <= 0 or batch_size <= 0:
        raise ValueError("seq_len and batch_size must be positive")
    out = dict.fromkeys(flop_categories(), 0)
    for parts in _layer_parts(cfg):
        for part in parts:
            for category, flops in part.forward_flops(batch_size, seq_len).items():
                out[category] += flops
    out["lm_head"] = 2 * batch_size * seq_len * cfg.d_model * cfg.vocab_size
    out["total"] = sum(out.values())
    return out


def training_flops(cfg: ModelConfig, seq_len: int, batch_size: int = 1, steps: int = 1) -> int:
    """FLOPs of ``steps`` training steps: forward + backward ≈ 3 × forward (backward = 2 × forward)."""
    return 3 * forward_flops(cfg, seq_len, batch_size)["total"] * steps


def kv_cache_bytes(cfg: ModelConfig, seq_len: int, batch_size: int = 1, dtype: str = "bf16") -> int:
    """Bytes of full decoding caches, what each layer's mixer keeps (:meth:`~tritonlm.modules.parts.Part.cache_bytes`):
    an attention layer's keys and values, ``kv_heads × d_head`` per token each (MLA: the compressed latent and the
    shared rotary key, ``kv_lora_rank + qk_rope_head_dim`` per token); a Gated DeltaNet layer's fixed-size recurrent
    state (fp32) and conv inputs per sequence."""
    if dtype not in _BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; one of {sorted(_BYTES)}")
    return sum(mixer.cache_bytes(batch_size, seq_len, _BYTES[dtype]) for mixer, _ in _layer_parts(cfg))


def activation_elements(cfg: ModelConfig, seq_len: int, batch_size: int = 1) -> dict:
    """Elements saved for backward by the *reference* model, by the CS336 counting convention.

    Per layer: the two norm inputs, then each part's: an attention mixer's Q/K/V, scores and their softmax
    (heads × seq²), the attention output and output projection (a Gated DeltaNet mixer's projections, conv, delta rule
    and gated norm outputs); the FFN's two up-projections, their activation and product, and the down projection
    (an MoE's router logits and each routed pair's); then the final norm, the logits and the cross-entropy's softmax.
    This is an estimate; ``tritonlm accounting --activations`` also *measures* saved tensors.
    """
    b, s, d = batch_size, seq_len, cfg.d_model
    # the two norm inputs, then what each part saves (:meth:`~tritonlm.modules.parts.Part.saved_elements`)
    layers = [2 * b * s * d + mixer.saved_elements(b, s) + mlp.saved_elements(b, s) for mixer, mlp in _layer_parts(cfg)]
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
