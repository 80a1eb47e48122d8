"""Model configuration: the :class:`TransformerLM` constructor arguments as one dataclass (the model builds itself
from it: ``TransformerLM(config)``), plus presets. Re-exported as :mod:`tritonlm.config`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .parts import AttentionSpec, DenseMLPSpec, GatedDeltaNetSpec, LatentAttentionSpec, MoESpec, Part

NORMS = ("rmsnorm", "layernorm", "batchnorm", "none")
FFNS = ("swiglu", "geglu", "relu", "silu")
POSITIONS = ("rope", "sinusoidal", "none")
#: "pre": norm each branch's input (Llama); "post": norm after each residual add (the original Transformer);
#: "output": norm each branch's output before its residual add, no input norms (OLMo 2)
NORM_POSITIONS = ("pre", "post", "output")


#: RoPE scaling types :func:`check_rope_scaling` accepts, with their required fields.
ROPE_SCALING_FIELDS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "linear": ("factor",),
    # YaRN (gpt-oss, DeepSeek-V3): beta_fast / beta_slow / truncate / attention_factor / mscale(_all_dim) optional
    "yarn": ("factor", "original_max_position_embeddings"),
}


def check_rope_scaling(scaling) -> dict:
    """Validate a RoPE scaling dict (Hugging Face's ``rope_scaling`` format: ``rope_type`` or ``type`` names it)
    and return it; ``{"rope_type": "default"}`` means no scaling. Other types are a one-line error."""
    if not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling must be a dict like {{'rope_type': 'llama3', ...}}, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "default":
        return scaling
    if kind not in ROPE_SCALING_FIELDS:
        raise ValueError(f"rope_scaling type {kind!r} is not supported (supported: 'default', "
                         f"{', '.join(repr(k) for k in ROPE_SCALING_FIELDS)})")
    missing = [f for f in ROPE_SCALING_FIELDS[kind] if f not in scaling]
    if missing:
        raise ValueError(f"rope_scaling {kind!r} lacks {', '.join(missing)}")
    if kind == "linear" and not (isinstance(scaling["factor"], (int, float)) and scaling["factor"] > 0):
        raise ValueError(f"rope_scaling 'linear' needs factor > 0, got {scaling!r}")
    if kind == "yarn" and not (isinstance(scaling["factor"], (int, float)) and scaling["factor"] > 0
                               and scaling["original_max_position_embeddings"] > 0):
        raise ValueError(f"rope_scaling 'yarn' needs factor > 0 and original_max_position_embeddings > 0, got "
                         f"{scaling!r}")
    if kind == "llama3":
        if not scaling["factor"] > 0 or not scaling["high_freq_factor"] > scaling["low_freq_factor"] > 0:
            raise ValueError("rope_scaling 'llama3' needs factor > 0 and high_freq_factor > low_freq_factor > 0, "
                             f"got {scaling!r}")
    return scaling


def default_d_ff(d_model: int) -> int:
    """SwiGLU hidden size: 8/3 * d_model rounded to the nearest multiple of 64 (at least 64)."""
    return max(64, int(round(8 * d_model / 3 / 64)) * 64)


@dataclass(frozen=True)
class ModelConfig:
    """Everything needed to build a :class:`tritonlm.modules.TransformerLM` (backend aside).

    ``norm``/``ffn``/``position``/``norm_position`` are the ablation options; defaults are the
    CS336 model (pre-norm, RMSNorm, SwiGLU, RoPE).
    """

    vocab_size: int
    context_length: int
    d_model: int
    num_layers: int
    num_heads: int
    d_ff: int
    rope_theta: float = 10000.0
    norm: str = "rmsnorm"
    ffn: str = "swiglu"
    position: str = "rope"
    norm_position: str = "pre"
    num_kv_heads: int | None = None  # grouped-query attention: key/value heads (None: = num_heads)
    norm_eps: float = 1e-5  # epsilon of every norm (Llama checkpoints use 1e-5 or 1e-6)
    tie_embeddings: bool = False  # the LM head shares the token embedding matrix
    rope_scaling: dict | None = None  # RoPE frequency scaling, e.g. Llama 3's {"rope_type": "llama3", ...}
    # mixture of experts (num_experts = 0: dense FFNs); each MoE layer routes a token to experts_per_token of
    # num_experts SwiGLU experts of width moe_d_ff (None: d_ff)
    num_experts: int = 0
    experts_per_token: int = 2
    moe_d_ff: int | None = None
    norm_topk_prob: bool = True  # renormalise the chosen experts' probabilities to sum to 1 (Mixtral, Qwen3-MoE)
    router_aux_loss_coef: float = 0.001  # weight of the load-balancing loss in training (transformers' default)
    # whether training adds it: a Hugging Face checkpoint's output_router_logits (published configs ship false, and
    # transformers then adds no term); a model built here adds it
    router_aux_loss: bool = True
    shared_expert_d_ff: int | None = None  # a sigmoid-gated shared SwiGLU expert every token runs (Qwen2-MoE)
    moe_layers: tuple | None = None  # indices of the MoE layers (None: every layer)
    # attention options of the model families people fine-tune
    head_dim: int | None = None  # per-head width (None: d_model / num_heads; Qwen3 sets it explicitly)
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2)
    qk_norm: str | None = None  # "head": RMSNorm of each head's q and k before RoPE (Qwen3); "projection": of the
    # whole q and k projections (OLMo 2)
    norm_offset: bool = False  # RMSNorm scales by (1 + weight), weights starting at 0 (Gemma)
    embedding_scale: float | None = None  # token embeddings times this (Gemma: sqrt(d_model), in the model's dtype)
    # Gemma 2 / 3
    post_norms: bool = False  # RMSNorms on the attention and FFN outputs before their residual adds (sandwich)
    attn_softcap: float | None = None  # attention scores become attn_softcap * tanh(s / attn_softcap) (Gemma 2: 50)
    final_softcap: float | None = None  # logits become final_softcap * tanh(z / final_softcap) (Gemma 2: 30)
    query_scale: float | None = None  # softmax scale (None: 1 / sqrt(head dim); Gemma: query_pre_attn_scalar ** -0.5)
    sliding_window: int | None = None  # a query sees this many most recent positions (its own included)
    sliding_layers: tuple | None = None  # the layers with the window (None: every layer, when sliding_window is set)
    local_rope_theta: float | None = None  # RoPE base of the sliding layers, which take no rope_scaling (Gemma 3)
    partial_rotary: float | None = None  # RoPE on this fraction of each head's features, the first ones (Phi-3)
    nope_layers: tuple | None = None  # layers whose attention applies no RoPE at all (SmolLM3's NoPE layers)
    attn_out_bias: bool = False  # a bias on the attention output projection (ERNIE 4.5, Seed-OSS)
    mlp_bias: bool = False  # biases on the dense FFN's three projections (ERNIE 4.5)
    residual_scale: float | None = None  # each branch's output times this before its residual add (Granite)
    logits_divisor: float | None = None  # the logits are divided by this, in the loss too (Granite's logits_scaling)
    # gpt-oss: attention sinks (a learned logit per query head in every row's softmax, carrying no value), the
    # router's linear bias and softmax over the chosen logits, expert biases and the clamped SwiGLU
    attention_sinks: bool = False
    router_bias: bool = False
    router_softmax_after_topk: bool = False
    expert_bias: bool = False
    expert_activation: str = "silu"  # "silu" (SwiGLU experts) or "swiglu_clamped" (gpt-oss, with alpha and limit)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # DeepSeek-V3 / GLM-4.5 routing: sigmoid scores, a choice bias (e_score_correction_bias, a buffer) added to pick
    # experts only, experts in groups of which the best router_topk_groups compete, weights times a scaling factor;
    # their shared experts are added without a gate
    router_scoring: str = "softmax"
    router_choice_bias: bool = False
    router_groups: int = 1
    router_topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_gate: bool = True  # Qwen2-MoE's sigmoid gate on the shared expert (False: added as it is)
    # MLA (DeepSeek-V2/V3 multi-head latent attention): queries through an optional low-rank bottleneck
    # (q_lora_rank), keys and values from one compressed latent of kv_lora_rank plus a rotary key shared by all heads;
    # query/key heads qk_nope_head_dim + qk_rope_head_dim wide (RoPE on the last qk_rope_head_dim), value heads
    # v_head_dim; the bottlenecks' RMSNorms use latent_norm_eps (DeepSeek's fixed 1e-6)
    attention: str = "mha"
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    latent_norm_eps: float = 1e-6
    # Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next): the layers in linear_layers replace attention with Gated DeltaNet
    # linear attention: linear_num_key_heads query/key heads of linear_key_head_dim, linear_num_value_heads value
    # heads (a multiple) of linear_value_head_dim, a depthwise causal conv of linear_conv_kernel taps (SiLU) over
    # q/k/v, the delta rule with a learned decay, a gated RMSNorm before the output projection
    linear_layers: tuple | None = None
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel: int = 4
    attn_output_gate: bool = False  # attention output times sigmoid(a per-feature gate projection of x) (Qwen3.5)
    # the dropout probability the checkpoint was trained with (Seed-OSS: 0.1). The kernels have no dropout: eval
    # and generation are exact, a forward in training mode with dropout > 0 is an error (replace it with 0.0 to
    # fine-tune without dropout)
    dropout: float = 0.0
    # the Hugging Face model_type this model was loaded as (tritonlm.hf): save_pretrained writes that family
    # (None: a model built here, saved as the registry's default family, Llama)
    model_type: str | None = None

    def __post_init__(self):
        if self.attention == "mla" and self.head_dim is None:  # determined: every query / key head is nope + rope wide
            object.__setattr__(self, "head_dim", self.qk_nope_head_dim + self.qk_rope_head_dim)
        for name in ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.head_dim is not None and (isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int)
                                          or self.head_dim <= 0):
            raise ValueError(f"ModelConfig.head_dim must be a positive int or None, got {self.head_dim!r}")
        if self.head_dim is None and self.d_model % self.num_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads}) "
                             "(or set head_dim)")
        if not isinstance(self.qkv_bias, bool):
            raise ValueError(f"ModelConfig.qkv_bias must be a bool, got {self.qkv_bias!r}")
        if not isinstance(self.norm_offset, bool):
            raise ValueError(f"ModelConfig.norm_offset must be a bool, got {self.norm_offset!r}")
        if self.norm_offset and self.norm != "rmsnorm":
            raise ValueError(f"ModelConfig.norm_offset needs norm='rmsnorm', got {self.norm!r}")
        if self.embedding_scale is not None and (isinstance(self.embedding_scale, bool)
                                                 or not isinstance(self.embedding_scale, (int, float))
                                                 or not self.embedding_scale > 0):
            raise ValueError(f"ModelConfig.embedding_scale must be a positive number or None, got "
                             f"{self.embedding_scale!r}")
        if self.qk_norm not in (None, "head", "projection"):
            raise ValueError(f"ModelConfig.qk_norm must be None, 'head' or 'projection', got {self.qk_norm!r}")
        if self.num_kv_heads is not None and (not isinstance(self.num_kv_heads, int) or self.num_kv_heads <= 0
                                              or self.num_heads % self.num_kv_heads):
            raise ValueError(f"ModelConfig.num_kv_heads must be a positive divisor of num_heads ({self.num_heads}), "
                             f"got {self.num_kv_heads!r}")
        if self.position == "rope" and self.d_head % 2:
            raise ValueError(f"RoPE needs an even head dim, got {self.d_head} (head_dim, or d_model / num_heads)")
        if isinstance(self.norm_eps, bool) or not isinstance(self.norm_eps, (int, float)) or not self.norm_eps > 0:
            raise ValueError(f"ModelConfig.norm_eps must be a positive number, got {self.norm_eps!r}")
        if not isinstance(self.router_aux_loss, bool):
            raise ValueError(f"ModelConfig.router_aux_loss must be a bool, got {self.router_aux_loss!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"ModelConfig.tie_embeddings must be a bool, got {self.tie_embeddings!r}")
        if self.rope_scaling is not None:
            if self.position != "rope":
                raise ValueError(f"ModelConfig.rope_scaling needs position='rope', got position={self.position!r}")
            check_rope_scaling(self.rope_scaling)
        self._check_moe()
        self._check_mla()
        self._check_gemma2()
        self._check_granite()
        self._check_linear()
        for name, allowed in (("norm", NORMS), ("ffn", FFNS), ("position", POSITIONS),
                              ("norm_position", NORM_POSITIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"ModelConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")

    def _check_moe(self) -> None:
        def positive_int(name, value, allow_none=False):
            if not (allow_none and value is None) and (isinstance(value, bool) or not isinstance(value, int)
                                                       or value <= 0):
                raise ValueError(f"ModelConfig.{name} must be a positive int{' or None' if allow_none else ''}, "
                                 f"got {value!r}")

        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(f"ModelConfig.num_experts must be an int >= 0 (0: dense), got {self.num_experts!r}")
        if self.moe_layers is not None:  # JSON gives lists back: one hashable, ordered form
            object.__setattr__(self, "moe_layers", tuple(self.moe_layers))
        if not self.num_experts:
            return
        positive_int("experts_per_token", self.experts_per_token)
        positive_int("moe_d_ff", self.moe_d_ff, allow_none=True)
        positive_int("shared_expert_d_ff", self.shared_expert_d_ff, allow_none=True)
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"ModelConfig.experts_per_token ({self.experts_per_token}) exceeds num_experts "
                             f"({self.num_experts})")
        if self.ffn != "swiglu":
            raise ValueError(f"mixture-of-experts layers use SwiGLU experts; ffn={self.ffn!r} cannot be combined "
                             "with num_experts")
        if isinstance(self.router_aux_loss_coef, bool) or not isinstance(self.router_aux_loss_coef, (int, float)) \
                or self.router_aux_loss_coef < 0:
            raise ValueError(f"ModelConfig.router_aux_loss_coef must be a number >= 0, got {self.router_aux_loss_coef!r}")
        if self.moe_layers is not None and not all(isinstance(i, int) and 0 <= i < self.num_layers
                                                   for i in self.moe_layers):
            raise ValueError(f"ModelConfig.moe_layers must be layer indices in [0, {self.num_layers}), got "
                             f"{self.moe_layers!r}")

    def _check_mla(self) -> None:
        if self.router_scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"ModelConfig.router_scoring must be 'softmax' or 'sigmoid', got {self.router_scoring!r}")
        for name in ("router_choice_bias", "shared_expert_gate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name} must be a bool, got {getattr(self, name)!r}")
        groups, kept = self.router_groups, self.router_topk_groups
        if not (isinstance(groups, int) and isinstance(kept, int) and 1 <= kept <= groups) or \
                (self.num_experts and self.num_experts % groups):
            raise ValueError(f"ModelConfig.router_groups={groups!r} / router_topk_groups={kept!r}: the experts "
                             f"({self.num_experts}) must split into router_groups groups, 1 <= topk_groups <= groups")
        if self.router_scoring == "softmax" and (self.router_choice_bias or groups != 1
                                                 or self.routed_scaling_factor != 1.0):
            raise ValueError("ModelConfig.router_choice_bias, router_groups and routed_scaling_factor need "
                             "router_scoring='sigmoid'")
        if isinstance(self.routed_scaling_factor, bool) or not isinstance(self.routed_scaling_factor, (int, float)) \
                or not self.routed_scaling_factor > 0:
            raise ValueError(f"ModelConfig.routed_scaling_factor must be a positive number, got "
                             f"{self.routed_scaling_factor!r}")
        if self.attention not in ("mha", "mla"):
            raise ValueError(f"ModelConfig.attention must be 'mha' or 'mla', got {self.attention!r}")
        if self.attention != "mla":
            return
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.q_lora_rank is not None and (isinstance(self.q_lora_rank, bool) or not isinstance(self.q_lora_rank, int)
                                             or self.q_lora_rank <= 0):
            raise ValueError(f"ModelConfig.q_lora_rank must be a positive int or None, got {self.q_lora_rank!r}")
        if self.position != "rope" or self.qk_rope_head_dim % 2:
            raise ValueError(f"attention='mla' needs position='rope' and an even qk_rope_head_dim, got "
                             f"{self.position!r} / {self.qk_rope_head_dim}")
        if self.head_dim != self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise ValueError(f"attention='mla': head_dim must be qk_nope_head_dim + qk_rope_head_dim "
                             f"({self.qk_nope_head_dim + self.qk_rope_head_dim}), got {self.head_dim!r}")
        unsupported = [n for n in ("qk_norm", "attention_sinks", "partial_rotary", "attn_softcap",
                                   "sliding_window", "nope_layers") if getattr(self, n)]
        if unsupported or self.kv_heads != self.num_heads:
            raise ValueError(f"attention='mla' cannot be combined with {unsupported[0] if unsupported else 'num_kv_heads'}"
                             " (DeepSeek's latent attention has none)")
        if isinstance(self.latent_norm_eps, bool) or not isinstance(self.latent_norm_eps, (int, float)) \
                or not self.latent_norm_eps > 0:
            raise ValueError(f"ModelConfig.latent_norm_eps must be a positive number, got {self.latent_norm_eps!r}")

    def _check_gemma2(self) -> None:
        if not isinstance(self.post_norms, bool):
            raise ValueError(f"ModelConfig.post_norms must be a bool, got {self.post_norms!r}")
        if self.post_norms and (self.norm != "rmsnorm" or self.norm_position != "pre"):
            raise ValueError("ModelConfig.post_norms needs norm='rmsnorm' and norm_position='pre'")
        for name in ("attn_softcap", "final_softcap", "query_scale", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 < value < float("inf")):
                raise ValueError(f"ModelConfig.{name} must be a positive number or None, got {value!r}")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool)
                                                or not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise ValueError(f"ModelConfig.sliding_window must be a positive int or None, got {self.sliding_window!r}")
        if self.sliding_layers is not None:
            object.__setattr__(self, "sliding_layers", tuple(self.sliding_layers))  # (JSON gives lists back)
            if self.sliding_window is None:
                raise ValueError("ModelConfig.sliding_layers needs sliding_window")
            if not all(isinstance(i, int) and 0 <= i < self.num_layers for i in self.sliding_layers):
                raise ValueError(f"ModelConfig.sliding_layers must be layer indices in [0, {self.num_layers}), got "
                                 f"{self.sliding_layers!r}")
        if self.partial_rotary is not None:
            if isinstance(self.partial_rotary, bool) or not isinstance(self.partial_rotary, (int, float)) \
                    or not 0 < self.partial_rotary <= 1 or self.position != "rope":
                raise ValueError(f"ModelConfig.partial_rotary must be in (0, 1] with position='rope', got "
                                 f"{self.partial_rotary!r}")
            if self.rotary_dim % 2 or self.rotary_dim == 0:
                raise ValueError(f"ModelConfig.partial_rotary {self.partial_rotary} of head dim {self.d_head} gives "
                                 f"{self.rotary_dim} rotated features: it must be a positive even number")
        if self.local_rope_theta is not None and (self.position != "rope" or self.sliding_window is None):
            raise ValueError("ModelConfig.local_rope_theta needs position='rope' and sliding_window")

    def _check_granite(self) -> None:
        for name in ("attn_out_bias", "mlp_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.mlp_bias and self.ffn not in ("swiglu", "geglu"):
            raise ValueError(f"ModelConfig.mlp_bias needs a gated FFN (swiglu or geglu), got ffn={self.ffn!r}")
        for name in ("residual_scale", "logits_divisor"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 < value < float("inf")):
                raise ValueError(f"ModelConfig.{name} must be a positive number or None, got {value!r}")
        if self.residual_scale is not None and self.norm_position != "pre":
            raise ValueError("ModelConfig.residual_scale needs norm_position='pre'")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"ModelConfig.dropout must be a probability in [0, 1), got {self.dropout!r}")
        if self.nope_layers is not None:
            object.__setattr__(self, "nope_layers", tuple(self.nope_layers))  # (JSON gives lists back)
            if self.position != "rope" or not all(isinstance(i, int) and 0 <= i < self.num_layers
                                                  for i in self.nope_layers):
                raise ValueError(f"ModelConfig.nope_layers must be layer indices in [0, {self.num_layers}) with "
                                 f"position='rope', got {self.nope_layers!r}")
        for name in ("attention_sinks", "router_bias", "router_softmax_after_topk", "expert_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.expert_activation not in ("silu", "swiglu_clamped"):
            raise ValueError(f"ModelConfig.expert_activation must be 'silu' or 'swiglu_clamped', got "
                             f"{self.expert_activation!r}")
        for name in ("swiglu_alpha", "swiglu_limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"ModelConfig.{name} must be a positive number, got {value!r}")
        if self.model_type is not None and not isinstance(self.model_type, str):
            raise ValueError(f"ModelConfig.model_type must be a string or None, got {self.model_type!r}")

    def _check_linear(self) -> None:
        if not isinstance(self.attn_output_gate, bool):
            raise ValueError(f"ModelConfig.attn_output_gate must be a bool, got {self.attn_output_gate!r}")
        if self.attn_output_gate and self.attention != "mha":
            raise ValueError("ModelConfig.attn_output_gate needs attention='mha'")
        if self.linear_layers is None:
            return
        object.__setattr__(self, "linear_layers", tuple(self.linear_layers))  # (JSON gives lists back)
        if not all(isinstance(i, int) and 0 <= i < self.num_layers for i in self.linear_layers):
            raise ValueError(f"ModelConfig.linear_layers must be layer indices in [0, {self.num_layers}), got "
                             f"{self.linear_layers!r}")
        for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"ModelConfig.linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple "
                             f"of linear_num_key_heads ({self.linear_num_key_heads})")
        if max(self.linear_key_head_dim, self.linear_value_head_dim) > 256:
            raise ValueError("ModelConfig.linear_key_head_dim / linear_value_head_dim: the Gated DeltaNet kernels "
                             "take head sizes up to 256")
        if self.norm_position != "pre":
            raise ValueError("ModelConfig.linear_layers needs norm_position='pre'")

    def is_linear_layer(self, index: int) -> bool:
        """Whether layer ``index`` is a Gated DeltaNet (linear attention) layer rather than attention."""
        return self.linear_layers is not None and index in self.linear_layers

    def layer_has_rope(self, index: int) -> bool:
        """Whether layer ``index``'s attention rotates its queries and keys (RoPE, not one of ``nope_layers``)."""
        return self.position == "rope" and (self.nope_layers is None or index not in self.nope_layers)

    def layer_window(self, index: int) -> int | None:
        """Layer ``index``'s sliding window (None: causal attention over the whole context)."""
        if self.sliding_window is None or (self.sliding_layers is not None and index not in self.sliding_layers):
            return None
        return self.sliding_window

    def layer_rope(self, index: int) -> tuple[float, dict | None]:
        """Layer ``index``'s RoPE ``(theta, scaling)``: a sliding layer's own base when ``local_rope_theta`` is set
        (without scaling, as Gemma 3's local layers), else the model's."""
        if self.local_rope_theta is not None and self.layer_window(index) is not None:
            return self.local_rope_theta, None
        return self.rope_theta, self.rope_scaling

    def layer_mixer(self, index: int) -> Part:
        """Layer ``index``'s token mixer as a part spec (:mod:`tritonlm.modules.parts`): Gated DeltaNet in a
        hybrid's ``linear_layers``, else latent attention (``attention='mla'``) or attention, with this layer's RoPE
        base (none in a NoPE layer) and window."""
        if self.is_linear_layer(index):
            return GatedDeltaNetSpec(self.d_model, self.linear_num_key_heads, self.linear_num_value_heads,
                                     self.linear_key_head_dim, self.linear_value_head_dim, self.linear_conv_kernel,
                                     self.norm_eps)
        theta, rope_scaling = self.layer_rope(index)
        rotary = self.layer_has_rope(index)
        if self.attention == "mla":
            return LatentAttentionSpec(
                self.d_model, self.num_heads, self.context_length, theta if rotary else None,
                q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim, rope_scaling=rope_scaling,
                latent_norm_eps=self.latent_norm_eps, softmax_scale=self.query_scale, qkv_bias=self.qkv_bias,
                out_bias=self.attn_out_bias)
        return AttentionSpec(self.d_model, self.num_heads, self.context_length, theta if rotary else None,
                             num_kv_heads=self.num_kv_heads, rope_scaling=rope_scaling, head_dim=self.head_dim,
                             qkv_bias=self.qkv_bias, qk_norm=self.qk_norm, norm_eps=self.norm_eps,
                             norm_offset=self.norm_offset, softmax_scale=self.query_scale, softcap=self.attn_softcap,
                             window=self.layer_window(index), rotary_dim=self.rotary_dim if rotary else None,
                             out_bias=self.attn_out_bias, sinks=self.attention_sinks,
                             output_gate=self.attn_output_gate)

    def layer_mlp(self, index: int) -> Part:
        """Layer ``index``'s MLP as a part spec: a mixture of experts in an MoE layer, else the dense ``ffn``."""
        if not self.is_moe_layer(index):
            return DenseMLPSpec(self.d_model, self.d_ff, self.ffn, self.mlp_bias)
        return MoESpec(self.d_model, self.expert_d_ff, self.num_experts, self.experts_per_token, self.norm_topk_prob,
                       self.shared_expert_d_ff, router_bias=self.router_bias,
                       softmax_after_topk=self.router_softmax_after_topk, expert_bias=self.expert_bias,
                       activation=self.expert_activation, alpha=self.swiglu_alpha, limit=self.swiglu_limit,
                       scoring=self.router_scoring, choice_bias=self.router_choice_bias, n_group=self.router_groups,
                       topk_group=self.router_topk_groups, routed_scaling_factor=self.routed_scaling_factor,
                       shared_gate=self.shared_expert_gate)

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` routes its tokens to experts."""
        return self.num_experts > 0 and (self.moe_layers is None or index in self.moe_layers)

    @property
    def expert_d_ff(self) -> int:
        """Each expert's hidden width."""
        return self.moe_d_ff or self.d_ff

    @property
    def d_head(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    @property
    def rotary_dim(self) -> int:
        """The features of each head RoPE turns (all, or the ``partial_rotary`` fraction, as HF rounds it down; MLA:
        the last ``qk_rope_head_dim``)."""
        if self.attention == "mla":
            return self.qk_rope_head_dim
        return self.d_head if self.partial_rotary is None else int(self.d_head * self.partial_rotary)

    @property
    def v_dim(self) -> int:
        """Each value head's width (the query/key head's, except with MLA)."""
        return self.v_head_dim if self.attention == "mla" else self.d_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``num_kv_heads``, or ``num_heads`` (multi-head attention) when unset."""
        return self.num_kv_heads or self.num_heads

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def model_kwargs(self) -> dict:
        """Keyword arguments for ``TransformerLM(**cfg.model_kwargs())``."""
        return self.to_dict()

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def preset(cls, name: str, **overrides) -> ModelConfig:
        """A named size (see :data:`PRESETS`); keyword overrides replace single fields."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


def _gpt2(layers: int, d_model: int, heads: int) -> dict:
    return dict(vocab_size=50257, context_length=1024, d_model=d_model, num_layers=layers,
                num_heads=heads, d_ff=default_d_ff(d_model), rope_theta=10000.0)


def _bench(d_model: int, d_ff: int, layers: int, heads: int) -> dict:
    return dict(vocab_size=10000, context_length=512, d_model=d_model, num_layers=layers,
                num_heads=heads, d_ff=d_ff, rope_theta=10000.0)


#: Preset sizes. ``gpt2-*``: GPT-2 shapes with a SwiGLU FFN (the seeds' accounting example);
#: ``small``..``10B``: the CS336 systems-assignment benchmarking sizes; ``tiny``: trains on a CPU.
PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=1024, context_length=128, d_model=128, num_layers=4, num_heads=4,
                 d_ff=default_d_ff(128), rope_theta=10000.0),
    # tiny with every FFN a mixture of 8 experts, 2 per token, each half the dense FFN's width: about the dense
    # model's active FLOPs per token with 4x its FFN parameters
    "tiny-moe": dict(vocab_size=1024, context_length=128, d_model=128, num_layers=4, num_heads=4,
                     d_ff=default_d_ff(128), rope_theta=10000.0, num_experts=8, experts_per_token=2,
                     moe_d_ff=default_d_ff(128) // 2),
    "gpt2-small": _gpt2(12, 768, 12),
    "gpt2-medium": _gpt2(24, 1024, 16),
    "gpt2-large": _gpt2(36, 1280, 20),
    "gpt2-xl": _gpt2(48, 1600, 25),
    "small": _bench(768, 3072, 12, 12),
    "medium": _bench(1024, 4096, 24, 16),
    "large": _bench(1280, 5120, 36, 20),
    "xl": _bench(2560, 10240, 32, 32),
    "10B": _bench(4608, 12288, 50, 36),
}
