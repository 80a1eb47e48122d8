"""DeepSeek-V3 (``DeepseekV3ForCausalLM``: DeepSeek-V3 / R1, Kimi-K2, Moonlight) and GLM-4.5 (``Glm4MoeForCausalLM``):
sigmoid-scored routing with a choice bias (``e_score_correction_bias``, a buffer used to pick experts, not to weight
them), experts in ``n_group`` groups of which ``topk_group`` compete, weights renormalised then times
``routed_scaling_factor``; ``n_shared_experts`` shared SwiGLU experts added without a gate; the first
``first_k_dense_replace`` layers dense. No load-balancing term (transformers adds none).

DeepSeek-V3 attends with MLA (``ModelConfig.attention="mla"``: ``q_lora_rank``, ``kv_lora_rank``,
``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``; the low-rank norms at DeepSeek's fixed 1e-6), RoPE on
interleaved pairs (``rope_interleave``; the half-split form is refused), YaRN with the ``mscale_all_dim`` softmax
scale. GLM-4.5 attends with GQA: RoPE on each head's first half of features in half-split layout, q/k/v biases
(``attention_bias``), optional per-head q/k norms (``use_qk_norm``).

Published DeepSeek-V3 weights are FP8 block-quantised (``quantization_config``): a one-line error naming it, never
wrong weights. Multi-token-prediction layers past ``num_hidden_layers`` (``num_nextn_predict_layers``) are not part
of the causal LM: transformers skips their tensors on load, and so does tritonlm (said in the log).
"""

from ...modules.reference import yarn_mscale
from ..family import (
    Family,
    Kernels,
    Weights,
    derived_head_dim,
    read_decoder,
    read_dropout,
    register,
    write_decoder,
)

DEEPSEEK_V3 = {"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
               "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": None,
               "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
               "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
               "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
               "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
               "tie_word_embeddings": False, "rope_theta": 10000.0, "rope_interleave": True, "attention_bias": False,
               "attention_dropout": 0.0, "head_dim": lambda r: r.get("qk_rope_head_dim")}  # (the class derives it)
GLM4_MOE = {"vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944, "num_hidden_layers": 46,
            "num_attention_heads": 96, "num_key_value_heads": 8, "hidden_act": "silu",
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "attention_bias": False, "attention_dropout": 0.0,
            "moe_intermediate_size": 1408, "num_experts_per_tok": 8, "n_shared_experts": 1, "n_routed_experts": 128,
            "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
            "norm_topk_prob": True, "use_qk_norm": False,
            "head_dim": derived_head_dim}
#: the multi-token-prediction depth: its layers sit past num_hidden_layers and are not part of the causal LM
_MTP_KEYS = ("num_nextn_predict_layers", "num_mtp_layers", "output_router_logits")
#: keys of the files DeepSeek's own remote code (configuration_deepseek.py) reads and transformers' DeepseekV3 never
#: does (DeepSeek-V3 / R1, Moonlight, GLM-4.5 files carry them)
_REMOTE = "DeepSeek's remote code"
HARMLESS = {
    "ep_size": f"the expert-parallel degree of {_REMOTE} (a deployment setting, not the model)",
    "moe_layer_freq": f"{_REMOTE}'s MoE-every-k-layers; transformers makes every layer past first_k_dense_replace MoE",
    "scoring_func": f"{_REMOTE}'s router score name; transformers' router always scores with the sigmoid",
    "topk_method": f"{_REMOTE}'s expert-choice name ('noaux_tc': group-limited, with the correction bias); "
                   "transformers always chooses that way",
    "aux_loss_alpha": f"{_REMOTE}'s training-time balance loss weight; transformers adds no auxiliary loss",
    "seq_aux": f"{_REMOTE}'s per-sequence balance loss switch; transformers adds no auxiliary loss",
}
SHARED = {"ffn.shared_expert.w1.weight": "mlp.shared_experts.gate_proj.weight",
          "ffn.shared_expert.w2.weight": "mlp.shared_experts.down_proj.weight",
          "ffn.shared_expert.w3.weight": "mlp.shared_experts.up_proj.weight"}


def _routing(r, fields: dict) -> dict:
    """The sigmoid router, the shared experts and the dense first layers (both families read them alike)."""
    layers, dense = fields["num_layers"], int(r.get("first_k_dense_replace"))
    r.require("n_shared_experts", lambda v: isinstance(v, int) and v >= 1, "the MoE layers run >= 1 shared expert")
    experts = r.get("num_local_experts") if "num_local_experts" in r else r.get("n_routed_experts")
    groups, kept = r.get("n_group") or 1, r.get("topk_group") or 1
    moe_d_ff = int(r.get("moe_intermediate_size"))
    return dict(num_experts=int(experts), experts_per_token=int(r.get("num_experts_per_tok")), moe_d_ff=moe_d_ff,
                norm_topk_prob=bool(r.get("norm_topk_prob")), router_aux_loss_coef=0.0,
                shared_expert_d_ff=moe_d_ff * int(r.get("n_shared_experts")), shared_expert_gate=False,
                router_scoring="sigmoid", router_choice_bias=True, router_groups=int(groups),
                router_topk_groups=int(kept), routed_scaling_factor=float(r.get("routed_scaling_factor")),
                moe_layers=None if dense == 0 else tuple(range(dense, layers)))


def _routing_hf(cfg) -> dict:
    if cfg.router_scoring != "sigmoid" or not cfg.router_choice_bias or cfg.shared_expert_gate \
            or not cfg.shared_expert_d_ff or cfg.shared_expert_d_ff % cfg.expert_d_ff:
        raise ValueError(f"model_type {cfg.model_type!r} needs the sigmoid router with a choice bias and ungated "
                         "shared experts a whole number of experts wide (ModelConfig.router_scoring, "
                         "router_choice_bias, shared_expert_gate, shared_expert_d_ff)")
    dense = [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)]
    if dense != list(range(len(dense))):
        raise ValueError(f"model_type {cfg.model_type!r} has its dense layers first (first_k_dense_replace), got "
                         f"dense layers {dense}")
    return dict(n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                moe_intermediate_size=cfg.expert_d_ff, n_shared_experts=cfg.shared_expert_d_ff // cfg.expert_d_ff,
                norm_topk_prob=cfg.norm_topk_prob, n_group=cfg.router_groups, topk_group=cfg.router_topk_groups,
                routed_scaling_factor=cfg.routed_scaling_factor, first_k_dense_replace=len(dense))


def _yarn_scale(qk_head_dim: int, scaling: dict | None) -> float | None:
    """DeepSeek's softmax scale: ``qk_head_dim^-0.5``, times ``mscale(factor, mscale_all_dim)²`` under a RoPE
    scaling with ``mscale_all_dim`` (None: the plain ``1 / sqrt(head dim)``)."""
    if not scaling or not scaling.get("mscale_all_dim"):
        return None
    m = yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
    return qk_head_dim ** -0.5 * m * m


def _deepseek(r) -> dict:
    r.require("rope_interleave", (True, None), "DeepSeek's RoPE on interleaved pairs (the half-split form is not "
                                               "implemented)")
    r.ignore("head_dim", "qk_head_dim", *_MTP_KEYS)  # (derived: qk_rope_head_dim, qk_nope + qk_rope)
    fields = read_decoder(r)
    fields.pop("num_kv_heads")  # (MLA expands the latent into every query head: num_key_value_heads is unused)
    nope, rope, v = (int(r.get(k)) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    q_lora = r.get("q_lora_rank")
    bias = bool(r.get("attention_bias"))
    return dict(fields, **_routing(r, fields), attention="mla", head_dim=nope + rope, qk_nope_head_dim=nope,
                qk_rope_head_dim=rope, v_head_dim=v, q_lora_rank=None if q_lora is None else int(q_lora),
                kv_lora_rank=int(r.get("kv_lora_rank")), qkv_bias=bias, attn_out_bias=bias,
                query_scale=_yarn_scale(nope + rope, fields["rope_scaling"]),
                dropout=read_dropout(r, "attention_dropout"))


def _deepseek_hf(cfg) -> dict:
    if cfg.attention != "mla":
        raise ValueError("model_type 'deepseek_v3' attends with MLA (ModelConfig.attention='mla')")
    out = dict(write_decoder(cfg), **_routing_hf(cfg), q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
               qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
               v_head_dim=cfg.v_head_dim, rope_interleave=True, attention_bias=cfg.qkv_bias,
               attention_dropout=cfg.dropout, num_key_value_heads=cfg.num_heads)
    out.pop("head_dim")  # (transformers derives it: qk_rope_head_dim)
    return out


def _glm4_moe(r) -> dict:
    r.ignore(*_MTP_KEYS)
    fields = read_decoder(r, partial_rotary=True)
    return dict(fields, **_routing(r, fields), qkv_bias=bool(r.get("attention_bias")),
                qk_norm="head" if r.get("use_qk_norm") else None, dropout=read_dropout(r, "attention_dropout"))


def _glm4_moe_hf(cfg) -> dict:
    return dict(write_decoder(cfg), **_routing_hf(cfg), attention_bias=cfg.qkv_bias, use_qk_norm=cfg.qk_norm == "head",
                partial_rotary_factor=cfg.partial_rotary or 1.0, attention_dropout=cfg.dropout)


register(Family(
    model_type="deepseek_v3", architecture="DeepseekV3ForCausalLM", config_class="DeepseekV3Config",
    defaults=DEEPSEEK_V3, to_config=_deepseek, to_hf=_deepseek_hf,
    weights=Weights(names=SHARED, rope_layout="interleaved", mtp_layers=True), harmless=HARMLESS,
    kernels=Kernels(norms={"DeepseekV3RMSNorm": "cast"}, mlps={"DeepseekV3MLP": "swiglu"},
                    attention=("DeepseekV3Attention",), experts={"DeepseekV3Experts": "stacked"},
                    rope_layout="interleaved"),
    notes="MLA (d_qk 192 / d_v 128 attention), sigmoid group-limited router with correction bias, shared experts, "
          "YaRN mscale; FP8 files refused"))
register(Family(
    model_type="glm4_moe", architecture="Glm4MoeForCausalLM", config_class="Glm4MoeConfig", defaults=GLM4_MOE,
    to_config=_glm4_moe, to_hf=_glm4_moe_hf, weights=Weights(names=SHARED, mtp_layers=True), harmless=HARMLESS,
    kernels=Kernels(norms={"Glm4MoeRMSNorm": "cast"}, mlps={"Glm4MoeMLP": "swiglu"}, attention=("Glm4MoeAttention",),
                    experts={"Glm4MoeExperts": "stacked"}),
    notes="sigmoid group-limited router with correction bias, shared experts, dense first layers, partial RoPE, "
          "q/k/v biases, optional q/k norms"))
