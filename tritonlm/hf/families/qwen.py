"""Qwen2, Qwen3 and their MoE models: Llama's layout with q/k/v biases (Qwen2, Qwen2-MoE), per-head q/k RMSNorms
and an explicit ``head_dim`` (Qwen3), routed experts with dense layers among them (``mlp_only_layers`` /
``decoder_sparse_step``) and Qwen2-MoE's sigmoid-gated shared expert. Their sliding-window option (layers at or past
``max_window_layers`` windowed) is refused."""

from ..family import (
    Family,
    Kernels,
    derived_head_dim,
    read_decoder,
    read_dropout,
    read_router_aux_loss,
    register,
    write_decoder,
    write_router_aux_loss,
)

QWEN2 = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": derived_head_dim, "hidden_act": "silu",
         "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000.0,
         "use_sliding_window": False, "attention_dropout": 0.0}
QWEN3 = {**QWEN2, "head_dim": 128, "attention_bias": False}
_MOE = {"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": False, "router_aux_loss_coef": 0.001}
QWEN2_MOE = {**QWEN2, **_MOE, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
             "num_attention_heads": 16, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
             "num_experts_per_tok": 4, "num_experts": 60, "qkv_bias": True}
QWEN3_MOE = {**QWEN3, **_MOE, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
             "num_key_value_heads": 4, "head_dim": derived_head_dim, "moe_intermediate_size": 768,
             "num_experts_per_tok": 8, "num_local_experts": 128}
#: what the window keys mean only with use_sliding_window (refused): ignored otherwise
_WINDOW_KEYS = ("sliding_window", "max_window_layers")


def _dense(r, *, qkv_bias: bool, qk_norm: bool) -> dict:
    fields = read_decoder(r)
    r.require("use_sliding_window", (False,), "Qwen's per-layer windows (from max_window_layers on)")
    types = r.get("layer_types", None) or []
    if "sliding_attention" in types:
        raise ValueError(f"layer_types={types!r} is not supported: Qwen's sliding layers")
    if "attention_bias" in r.family.defaults:
        r.require("attention_bias", (False,), "Qwen3 has no projection biases")
    return dict(fields, qkv_bias=qkv_bias, qk_norm="head" if qk_norm else None,
                dropout=read_dropout(r, "attention_dropout"))


def _moe(r, fields: dict, experts_key: str, shared: bool) -> dict:
    layers, step = fields["num_layers"], int(r.get("decoder_sparse_step"))
    dense = set(r.get("mlp_only_layers") or [])
    moe_layers = tuple(i for i in range(layers) if i not in dense and step > 0 and (i + 1) % step == 0)
    # (transformers 5 saves Qwen3-MoE's attribute-map name num_local_experts; older files num_experts)
    experts = r.get("num_experts") if "num_experts" in r else r.get(experts_key)
    shared_d_ff = int(r.get("shared_expert_intermediate_size") or 0) if shared else 0
    return dict(fields, num_experts=int(experts), experts_per_token=int(r.get("num_experts_per_tok")),
                moe_d_ff=int(r.get("moe_intermediate_size")), norm_topk_prob=bool(r.get("norm_topk_prob")),
                **read_router_aux_loss(r), shared_expert_d_ff=shared_d_ff or None,
                moe_layers=None if len(moe_layers) == layers else moe_layers)


def _dense_hf(cfg) -> dict:
    return dict(write_decoder(cfg), use_sliding_window=False, attention_dropout=cfg.dropout)


def _moe_hf(cfg, experts_key: str) -> dict:
    return dict(_dense_hf(cfg), **{experts_key: cfg.num_experts}, num_experts_per_tok=cfg.experts_per_token,
                moe_intermediate_size=cfg.expert_d_ff, norm_topk_prob=cfg.norm_topk_prob,
                **write_router_aux_loss(cfg), decoder_sparse_step=1,
                mlp_only_layers=[i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)])


def _kernels(prefix: str, moe: bool) -> Kernels:
    return Kernels(norms={f"{prefix}RMSNorm": "cast"}, mlps={f"{prefix}MLP": "swiglu"},
                   attention=(f"{prefix}Attention",), experts={f"{prefix}Experts": "stacked"} if moe else {})


register(Family(
    model_type="qwen2", architecture="Qwen2ForCausalLM", config_class="Qwen2Config", defaults=QWEN2,
    to_config=lambda r: _dense(r, qkv_bias=True, qk_norm=False), to_hf=_dense_hf, ignored=_WINDOW_KEYS,
    kernels=_kernels("Qwen2", False), notes="q/k/v biases"))
register(Family(
    model_type="qwen3", architecture="Qwen3ForCausalLM", config_class="Qwen3Config", defaults=QWEN3,
    to_config=lambda r: _dense(r, qkv_bias=False, qk_norm=True), to_hf=lambda cfg: dict(_dense_hf(cfg),
                                                                                          attention_bias=False),
    ignored=_WINDOW_KEYS, kernels=_kernels("Qwen3", False), notes="per-head q/k norms, explicit `head_dim`"))


def _qwen2_moe(r) -> dict:
    return _moe(r, _dense(r, qkv_bias=bool(r.get("qkv_bias")), qk_norm=False), "num_experts", shared=True)


def _qwen2_moe_hf(cfg) -> dict:
    if not cfg.shared_expert_d_ff:
        raise ValueError("model_type 'qwen2_moe' needs a shared expert (ModelConfig.shared_expert_d_ff): its MoE layers "
                         "always run one")
    return dict(_moe_hf(cfg, "num_experts"), qkv_bias=cfg.qkv_bias, shared_expert_intermediate_size=cfg.shared_expert_d_ff)


register(Family(
    model_type="qwen2_moe", architecture="Qwen2MoeForCausalLM", config_class="Qwen2MoeConfig", defaults=QWEN2_MOE,
    to_config=_qwen2_moe, ignored=_WINDOW_KEYS, kernels=_kernels("Qwen2Moe", True),
    to_hf=_qwen2_moe_hf,
    notes="dense layers among MoE ones, gated shared expert"))
register(Family(
    model_type="qwen3_moe", architecture="Qwen3MoeForCausalLM", config_class="Qwen3MoeConfig", defaults=QWEN3_MOE,
    to_config=lambda r: _moe(r, _dense(r, qkv_bias=False, qk_norm=True), "num_local_experts", shared=False),
    to_hf=lambda cfg: dict(_moe_hf(cfg, "num_local_experts"), attention_bias=False),
    ignored=_WINDOW_KEYS, kernels=_kernels("Qwen3Moe", True),
    notes="dense layers among MoE ones"))
