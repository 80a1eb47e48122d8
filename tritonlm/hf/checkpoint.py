"""Hugging Face checkpoints <-> :class:`~tritonlm.modules.TransformerLM`: Llama, Mistral, Mixtral, Gemma 1/2/3, Qwen2, Qwen3,
Qwen2-MoE and Qwen3-MoE (:data:`FAMILIES`).

Two differences between the layouts, everything else is a rename:

* RoPE pairs. HF rotates ``(x[i], x[i + d/2])`` (``rotate_half``); this library rotates ``(x[2i], x[2i+1])``.
  Permuting the rows of each head of ``q_proj`` and ``k_proj`` by ``[0, d/2, 1, d/2+1, ...]`` turns one into
  the other: ``q·k`` is unchanged because q and k are permuted alike, and ``v`` is untouched.
* Tied embeddings. HF omits ``lm_head.weight`` from the file when ``tie_word_embeddings`` is set.
* Qwen's extras are model options: q/k/v biases (Qwen2: ``qkv_bias``; their rows permuted like the weights'),
  per-head q/k RMSNorms (Qwen3: ``qk_norm="head"``, weights permuted alike), an explicit ``head_dim``, dense
  layers among the MoE ones (``mlp_only_layers`` / ``decoder_sparse_step`` -> ``moe_layers``) and Qwen2-MoE's gated
  shared expert (``shared_expert_d_ff``).
* Gemma 2 / 3's sandwich norms: their ``post_attention_layernorm`` norms the attention output (our
  ``attn_post_norm``), ``pre_feedforward_layernorm`` is our ``ln2`` and ``post_feedforward_layernorm`` our
  ``ffn_post_norm``; windows, softcaps, the query scale and Gemma 3's local RoPE base are model options.
* Phi-3's fused projections: ``qkv_proj`` (q, k, v rows in that order) and ``gate_up_proj`` (gate rows, then up)
  are split on load and fused again on save; with ``partial_rotary_factor`` only each head's first rotary rows meet
  RoPE, so only they are permuted.
* MoE experts. Files hold them per expert (``block_sparse_moe.experts.{j}.w1/w2/w3``, what the Hub has and
  transformers 4.x writes) or stacked (transformers 5's ``mlp.experts.gate_up_proj`` / ``down_proj``); both load
  into the stacked layout the model keeps, and checkpoints are written per expert, which both versions read.

The config mapping (:func:`model_config_from_hf`) reads plain JSON, so ``tritonlm accounting --hf`` works without
``transformers``; reading and writing weights needs ``safetensors`` (``pip install tritonlm[hf]``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from ..config import ModelConfig

logger = logging.getLogger("tritonlm")

#: model_type -> its causal-LM class (what config.json's "architectures" names)
FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
            "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
            "olmo2": "Olmo2ForCausalLM", "phi3": "Phi3ForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM"}
ARCHITECTURES = tuple(FAMILIES.values())
MODEL_TYPES = tuple(FAMILIES)
_QWEN = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
_GEMMA = ("gemma", "gemma2", "gemma3_text")
#: Gemma 2 / 3's sandwich norms: ours -> HF (their post_attention_layernorm is the attention output's norm, and the
#: FFN's input norm is pre_feedforward_layernorm)
SANDWICH_KEYS = {"attn_post_norm.weight": "post_attention_layernorm.weight",
                 "ln2.weight": "pre_feedforward_layernorm.weight",
                 "ffn_post_norm.weight": "post_feedforward_layernorm.weight"}
#: OLMo 2's output norms (no input norms): ours -> HF
OUTPUT_NORM_KEYS = {"ln1.weight": "post_attention_layernorm.weight", "ln2.weight": "post_feedforward_layernorm.weight"}

#: ours (inside ``layers.{i}.``) -> HF (inside ``model.layers.{i}.``)
LAYER_KEYS = {
    "ln1.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.output_proj.weight": "self_attn.o_proj.weight",
    "ln2.weight": "post_attention_layernorm.weight",
    "ffn.w1.weight": "mlp.gate_proj.weight",
    "ffn.w2.weight": "mlp.down_proj.weight",
    "ffn.w3.weight": "mlp.up_proj.weight",
}
TOP_KEYS = {
    "token_embeddings.weight": "model.embed_tokens.weight",
    "ln_final.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
#: config.json fields copied through a load/save round trip untouched (token ids, generation defaults)
PASSTHROUGH_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "initializer_range")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _require(module: str):
    try:
        return __import__(module)
    except ImportError:
        raise ImportError(f"this needs the optional dependency {module!r}: pip install 'tritonlm[hf]'") from None


def read_hf_config(path) -> dict:
    """``config.json`` of a local HF model directory (or the file itself) as a dict."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no config.json in {path} (expected a local Hugging Face model directory)")
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None


def _rope_fields(cfg: dict) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling or None)`` from either config style: transformers 5's ``rope_parameters`` or
    4.x's ``rope_theta`` + ``rope_scaling``."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = cfg.get("rope_theta", 10000.0)
        scaling = {k: v for k, v in (cfg.get("rope_scaling") or {}).items() if k != "rope_theta"}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return float(theta), (None if kind == "default" else dict(scaling, rope_type=kind))


def model_config_from_hf(cfg: dict, context_length: int | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of an HF config dict of one of :data:`MODEL_TYPES`.

    ``context_length`` defaults to ``max_position_embeddings`` (a Mistral sliding window shorter than that caps
    it: within the window, windowed attention is plain causal attention). Anything the model cannot represent
    is a ``ValueError`` naming the field.
    """
    model_type = cfg.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(MODEL_TYPES)})")
    archs = cfg.get("architectures") or []
    unsupported = [a for a in archs if a not in ARCHITECTURES]
    if unsupported:
        raise ValueError(f"architectures {unsupported} not supported (supported: {', '.join(ARCHITECTURES)})")
    gemma = model_type in _GEMMA
    act = cfg.get("hidden_activation") or cfg.get("hidden_act", "gelu_pytorch_tanh" if gemma else "silu")
    if gemma and act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_act {act!r} is not supported for {model_type}: its GeGLU FFN uses "
                         "gelu_pytorch_tanh")
    if not gemma and act not in ("silu", "swish"):  # transformers maps "swish" to SiLU as well
        raise ValueError(f"hidden_act {act!r} is not supported: the SwiGLU FFN uses silu")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=true is not supported (a causal LM)")
    for field in ("attention_bias", "mlp_bias"):
        if cfg.get(field):
            raise ValueError(f"{field}=true is not supported: TransformerLM has no output-projection or MLP biases")
    for field in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"):
        if field not in cfg:
            raise ValueError(f"config.json lacks {field}")
    d_model, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim")
    theta, scaling = _rope_fields(cfg)
    max_positions = cfg.get("max_position_embeddings", 2048)
    qwen = model_type in _QWEN
    if qwen and (cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or [])):
        raise ValueError("use_sliding_window=true is not supported for Qwen models (per-layer windows)")
    # (Gemma 2 / 3 window their own layers, see _gemma_fields; a Mistral window caps the context)
    window = (None if qwen or model_type in (*_GEMMA, "phi3")
              else cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None)
    limit = min(max_positions, window) if window else max_positions
    if window and window < max_positions and (context_length is None or context_length > window):
        logger.info("sliding_window=%d < max_position_embeddings=%d: context capped at the window, where "
                    "windowed attention is plain causal attention", window, max_positions)
    if context_length is None:
        context_length = limit
    elif context_length > limit:
        raise ValueError(f"context_length {context_length} exceeds what the checkpoint supports ({limit}"
                         f"{', its sliding_window' if limit == window else ''})")
    kv_heads = cfg.get("num_key_value_heads") or heads
    fields = dict(
        vocab_size=cfg["vocab_size"], context_length=int(context_length), d_model=d_model,
        num_layers=cfg["num_hidden_layers"], num_heads=heads, d_ff=cfg["intermediate_size"], rope_theta=theta,
        num_kv_heads=None if kv_heads == heads else kv_heads, norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), rope_scaling=scaling,
        head_dim=None if head_dim is None or head_dim * heads == d_model else int(head_dim),
        qkv_bias=bool(cfg.get("qkv_bias", True)) if model_type in ("qwen2", "qwen2_moe") else False,
        qk_norm=("head" if model_type in ("qwen3", "qwen3_moe", "gemma3_text")
                 else "projection" if model_type == "olmo2" else None), **_moe_fields(cfg),
        # OLMo 2: each branch's output normed before its residual add, q/k norms over whole projections
        **(dict(norm_position="output") if model_type == "olmo2" else {}),
        **(_phi3_fields(cfg) if model_type == "phi3" else {}),
        # Gemma: GeGLU, RMSNorm x̂·(1 + w), embeddings times sqrt(hidden_size)
        **(dict(ffn="geglu", norm_offset=True, embedding_scale=float(d_model) ** 0.5) if gemma else {}),
    )
    fields.update(_gemma_fields(cfg, theta, scaling))  # (Gemma 3 replaces the RoPE fields)
    return ModelConfig(**fields)


def _phi3_fields(cfg: dict) -> dict:
    """Phi-3: RoPE on the ``partial_rotary_factor`` of each head (transformers 5 keeps it in ``rope_parameters``), a
    sliding window on every layer; dropout (training-time noise the model does not have) must be off."""
    for field in ("resid_pdrop", "embd_pdrop", "attention_dropout"):
        if cfg.get(field):
            raise ValueError(f"{field}={cfg[field]} is not supported: TransformerLM has no dropout")
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    factor = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    window = cfg.get("sliding_window")
    return dict(partial_rotary=None if factor == 1.0 else factor, sliding_window=int(window) if window else None)


def _gemma_fields(cfg: dict, theta: float, scaling: dict | None) -> dict:
    """Gemma 2 / 3: sandwich norms, the softmax scale ``query_pre_attn_scalar ** -0.5``, the logit softcaps (Gemma 3's
    attention applies none), sliding windows on the layers ``layer_types`` names (older configs: every other layer /
    five in six), and Gemma 3's own RoPE base (and no scaling) on the sliding layers."""
    kind = cfg.get("model_type")
    if kind not in ("gemma2", "gemma3_text"):
        return {}
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        period = 2 if kind == "gemma2" else int(cfg.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types {types} is not one 'sliding_attention' / 'full_attention' per layer")
    window = cfg.get("sliding_window")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if sliding and not window:
        raise ValueError("layer_types names sliding layers but sliding_window is not set")
    out = dict(post_norms=True, query_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
               final_softcap=cfg.get("final_logit_softcapping"),
               attn_softcap=cfg.get("attn_logit_softcapping") if kind == "gemma2" else None,
               sliding_window=int(window) if sliding else None,
               sliding_layers=None if not sliding or len(sliding) == layers else sliding)
    if kind == "gemma3_text":
        params = cfg.get("rope_parameters")
        if isinstance(params, dict) and "full_attention" in params:  # transformers 5: one dict per layer type
            full, local = params["full_attention"], params.get("sliding_attention") or {}
            theta = float(full.get("rope_theta", 1_000_000.0))
            kind_full = full.get("rope_type", "default")
            scaling = None if kind_full == "default" else {k: v for k, v in full.items() if k != "rope_theta"}
            local_theta = float(local.get("rope_theta", 10_000.0))
            if local.get("rope_type", "default") != "default":
                raise ValueError(f"rope_parameters.sliding_attention {local} is not supported (default RoPE only)")
        else:
            local_theta = float(cfg.get("rope_local_base_freq", 10_000.0))
        out.update(rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta if sliding else None)
    return out


def _moe_fields(cfg: dict) -> dict:
    """The mixture-of-experts fields: Mixtral (every layer routes to ``num_experts_per_tok`` of ``num_local_experts``
    experts, renormalised), Qwen2/3-MoE (``moe_intermediate_size`` experts, ``norm_topk_prob``, dense layers from
    ``mlp_only_layers`` / ``decoder_sparse_step``, Qwen2-MoE's shared expert); nothing for dense model types."""
    kind = cfg.get("model_type")
    if kind not in ("mixtral", "qwen2_moe", "qwen3_moe"):
        return {}
    if cfg.get("router_jitter_noise"):
        raise ValueError(f"router_jitter_noise={cfg['router_jitter_noise']} is not supported (training-time noise "
                         "on the router input)")
    coef = float(cfg.get("router_aux_loss_coef", 0.001))
    if kind == "mixtral":
        return dict(num_experts=int(cfg.get("num_local_experts", cfg.get("num_experts", 8))),
                    experts_per_token=int(cfg.get("num_experts_per_tok", 2)), moe_d_ff=int(cfg["intermediate_size"]),
                    norm_topk_prob=True, router_aux_loss_coef=coef)
    layers, step = cfg["num_hidden_layers"], int(cfg.get("decoder_sparse_step", 1))
    dense = set(cfg.get("mlp_only_layers") or [])
    moe_layers = tuple(i for i in range(layers) if i not in dense and step > 0 and (i + 1) % step == 0)
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if kind == "qwen2_moe" else 0
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))  # (transformers 5 saves the attribute_map name)
    if experts is None:
        raise ValueError(f"config.json of a {kind} model lacks num_experts")
    return dict(num_experts=int(experts), experts_per_token=int(cfg["num_experts_per_tok"]),
                moe_d_ff=int(cfg["moe_intermediate_size"]), norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                router_aux_loss_coef=coef, shared_expert_d_ff=shared or None,
                moe_layers=None if len(moe_layers) == layers else moe_layers)


def hf_model_type(cfg: ModelConfig) -> str:
    """The HF family that represents a model: Qwen3 (q/k norms), Qwen2 (q/k/v biases; MoE: Qwen2-MoE, which also
    holds a shared expert), Mixtral (MoE on every layer, renormalised top-k), else Llama; a ``ValueError`` naming
    what no family holds."""
    if (cfg.norm, cfg.position) != ("rmsnorm", "rope") or cfg.norm_position == "post":
        raise ValueError("only the Llama layout (pre-norm RMSNorm, RoPE) and OLMo 2's output norms have an HF "
                         f"equivalent; this model has norm={cfg.norm!r}, position={cfg.position!r}, "
                         f"norm_position={cfg.norm_position!r}")
    if cfg.partial_rotary is not None or (cfg.sliding_window is not None and not cfg.post_norms):
        # Phi-3: partial RoPE and / or one window on every layer, otherwise Llama
        plain = (cfg.ffn == "swiglu" and not cfg.num_experts and not cfg.qkv_bias and not cfg.qk_norm
                 and not cfg.norm_offset and cfg.embedding_scale is None and cfg.sliding_layers is None
                 and cfg.attn_softcap is None and cfg.final_softcap is None and cfg.query_scale is None
                 and cfg.local_rope_theta is None and cfg.norm_position == "pre")
        if not plain:
            raise ValueError("partial_rotary or a window on every layer maps to Phi-3, which is otherwise Llama; this "
                             "model has other options as well")
        return "phi3"
    if cfg.norm_position == "output" or cfg.qk_norm == "projection":
        plain = (cfg.ffn == "swiglu" and not cfg.num_experts and not cfg.qkv_bias and not cfg.norm_offset
                 and cfg.embedding_scale is None and not cfg.post_norms and cfg.sliding_window is None
                 and cfg.attn_softcap is None and cfg.final_softcap is None and cfg.query_scale is None)
        if cfg.norm_position != "output" or cfg.qk_norm != "projection" or not plain:
            raise ValueError("output norms and q/k norms over whole projections map to OLMo 2, which has both and "
                             f"nothing else beyond Llama; this model has norm_position={cfg.norm_position!r}, "
                             f"qk_norm={cfg.qk_norm!r}")
        return "olmo2"
    moe = bool(cfg.num_experts)
    gemma = (cfg.ffn == "geglu", cfg.norm_offset, cfg.embedding_scale is not None)
    gemma2 = {"post_norms": cfg.post_norms, "attn_softcap": cfg.attn_softcap, "final_softcap": cfg.final_softcap,
              "query_scale": cfg.query_scale, "sliding_window": cfg.sliding_window,
              "local_rope_theta": cfg.local_rope_theta}
    if any(gemma):
        if not all(gemma) or abs(cfg.embedding_scale - cfg.d_model ** 0.5) > 1e-6 * cfg.d_model ** 0.5 or moe \
                or cfg.qkv_bias:
            raise ValueError("GeGLU, RMSNorm (1 + w) and an embedding scale map to Gemma, which has all three (the "
                             "scale sqrt(d_model)) and no experts or biases; this model has ffn="
                             f"{cfg.ffn!r}, norm_offset={cfg.norm_offset!r}, embedding_scale={cfg.embedding_scale!r}")
        if not cfg.post_norms:
            if any(v not in (None, False) for v in gemma2.values()) or cfg.qk_norm:
                raise ValueError("Gemma (1) has no sandwich norms, softcaps, query scale, sliding windows or q/k norms: "
                                 "set post_norms=True for Gemma 2 / 3")
            return "gemma"
        if cfg.qk_norm:  # Gemma 3: q/k norms, no attention softcap
            if cfg.attn_softcap is not None:
                raise ValueError("Gemma 3 (q/k norms) applies no attention softcap; attn_softcap has no HF family")
            return "gemma3_text"
        if cfg.local_rope_theta is not None:
            raise ValueError("local_rope_theta without q/k norms has no HF family (Gemma 3 has both)")
        return "gemma2"
    if any(v not in (None, False) for v in gemma2.values()):
        raise ValueError(f"{', '.join(k for k, v in gemma2.items() if v not in (None, False))} map only to Gemma 2 / 3 "
                         "(with GeGLU, RMSNorm (1 + w) and the embedding scale)")
    if cfg.ffn != "swiglu":
        raise ValueError(f"ffn={cfg.ffn!r} has no HF equivalent here (SwiGLU, or Gemma's GeGLU)")
    if cfg.qk_norm:
        if cfg.qkv_bias or cfg.shared_expert_d_ff:
            raise ValueError("q/k norms with q/k/v biases or a shared expert have no HF family (Qwen3 has neither)")
        return "qwen3_moe" if moe else "qwen3"
    if cfg.qkv_bias or cfg.shared_expert_d_ff:
        if moe and not cfg.shared_expert_d_ff:
            raise ValueError("an MoE model with q/k/v biases maps to Qwen2-MoE, which needs a shared expert "
                             "(shared_expert_d_ff)")
        if not moe and not cfg.qkv_bias:
            raise ValueError("shared_expert_d_ff needs num_experts")
        return "qwen2_moe" if moe else "qwen2"
    if moe:
        if cfg.moe_layers is not None or not cfg.norm_topk_prob:
            raise ValueError("only Mixtral's MoE layout (every layer MoE, no shared expert, renormalised top-k) has "
                             f"an HF equivalent without q/k norms or biases; this model has moe_layers="
                             f"{cfg.moe_layers!r}, norm_topk_prob={cfg.norm_topk_prob!r}")
        return "mixtral"
    return "llama"


def hf_config_from_model(cfg: ModelConfig, dtype: torch.dtype, extra: dict | None = None) -> dict:
    """The HF config dict of a model (its family from :func:`hf_model_type`), in transformers 4.x keys (5.x reads
    them too)."""
    kind = hf_model_type(cfg)
    out = {k: v for k, v in (extra or {}).items() if k in PASSTHROUGH_FIELDS}
    out.update({
        "architectures": [FAMILIES[kind]], "model_type": kind,
        "hidden_act": "gelu_pytorch_tanh" if kind in _GEMMA else "silu",
        "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads, "num_hidden_layers": cfg.num_layers, "head_dim": cfg.d_head,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.context_length, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "torch_dtype": str(dtype).removeprefix("torch."),
    })
    if kind in _QWEN:
        out["use_sliding_window"] = False
    if kind == "phi3":
        out.update({"sliding_window": cfg.sliding_window, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                    "partial_rotary_factor": cfg.partial_rotary or 1.0, "original_max_position_embeddings":
                    cfg.context_length})
    if kind in ("gemma2", "gemma3_text"):
        scalar = cfg.query_scale ** -2 if cfg.query_scale else cfg.d_head
        out.update({"hidden_activation": "gelu_pytorch_tanh", "sliding_window": cfg.sliding_window,
                    "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-6 * scalar else scalar,
                    "layer_types": ["sliding_attention" if cfg.layer_window(i) else "full_attention"
                                    for i in range(cfg.num_layers)],
                    "final_logit_softcapping": cfg.final_softcap,
                    "attn_logit_softcapping": cfg.attn_softcap})
        if kind == "gemma3_text":
            out["rope_local_base_freq"] = cfg.local_rope_theta or cfg.rope_theta
    if kind == "qwen2_moe":
        out["qkv_bias"] = cfg.qkv_bias
    if kind == "mixtral":
        out.update({"intermediate_size": cfg.expert_d_ff, "num_local_experts": cfg.num_experts,
                    "num_experts_per_tok": cfg.experts_per_token, "router_aux_loss_coef": cfg.router_aux_loss_coef,
                    "router_jitter_noise": 0.0, "output_router_logits": False, "sliding_window": None})
    elif kind in ("qwen2_moe", "qwen3_moe"):
        out.update({"num_experts": cfg.num_experts, "num_experts_per_tok": cfg.experts_per_token,
                    "moe_intermediate_size": cfg.expert_d_ff, "norm_topk_prob": cfg.norm_topk_prob,
                    "router_aux_loss_coef": cfg.router_aux_loss_coef, "output_router_logits": False,
                    "decoder_sparse_step": 1,
                    "mlp_only_layers": [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)]})
        if kind == "qwen2_moe":
            out["shared_expert_intermediate_size"] = cfg.shared_expert_d_ff
    return out


# ----------------------------------------------------------------------------------------------------
# weights
# ----------------------------------------------------------------------------------------------------
def half_to_interleaved(d_head: int) -> torch.Tensor:
    """Row order that turns one head's half-split RoPE rows into interleaved pairs: ``[0, d/2, 1, d/2+1, ...]``."""
    half = torch.arange(d_head // 2)
    return torch.stack((half, half + d_head // 2), dim=-1).reshape(-1)


def rope_row_order(cfg: ModelConfig) -> torch.Tensor:
    """One head's row order from HF's half-split RoPE to interleaved pairs: the first ``rotary_dim`` rows paired up
    (all of them without a partial rotary dim), the rest in place."""
    rotary = cfg.rotary_dim
    return torch.cat((half_to_interleaved(rotary), torch.arange(rotary, cfg.d_head)))


def _permute_heads(weight: torch.Tensor, n_heads: int, order: torch.Tensor) -> torch.Tensor:
    """Reorder the rows of every head of a ``[n_heads * d_head, d_model]`` projection."""
    d_head = weight.shape[0] // n_heads
    return weight.reshape(n_heads, d_head, -1)[:, order].reshape(weight.shape)


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index.name} lists shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path} (pytorch_model.bin checkpoints are not read: "
                                "convert them with transformers' save_pretrained(safe_serialization=True))")
    return files


def read_hf_state(path) -> dict[str, torch.Tensor]:
    """Every tensor of a (possibly sharded) safetensors checkpoint directory, HF names."""
    _require("safetensors")
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(Path(path)):
        state.update(load_file(str(file)))
    return state


def _layer_keys(cfg: ModelConfig, i: int) -> dict[str, str]:
    """Ours -> HF names inside layer ``i`` besides an MoE layer's router and experts: attention (+ Qwen2's q/k/v
    biases, Qwen3's q/k norms), the norms, a dense FFN or Qwen2-MoE's shared expert and its gate."""
    keys = {k: v for k, v in LAYER_KEYS.items() if not (cfg.is_moe_layer(i) and k.startswith("ffn."))}
    if cfg.post_norms:
        keys.update(SANDWICH_KEYS)
    if cfg.norm_position == "output":
        keys.update(OUTPUT_NORM_KEYS)
    if cfg.qkv_bias:
        keys.update({f"attn.{p}_proj.bias": f"self_attn.{p}_proj.bias" for p in ("q", "k", "v")})
    if cfg.qk_norm:
        keys.update({f"attn.{p}_norm.weight": f"self_attn.{p}_norm.weight" for p in ("q", "k")})
    if cfg.is_moe_layer(i) and cfg.shared_expert_d_ff:
        keys.update({"ffn.shared_expert.w1.weight": "mlp.shared_expert.gate_proj.weight",
                     "ffn.shared_expert.w2.weight": "mlp.shared_expert.down_proj.weight",
                     "ffn.shared_expert.w3.weight": "mlp.shared_expert.up_proj.weight",
                     "ffn.shared_expert_gate.weight": "mlp.shared_expert_gate.weight"})
    return keys


def _rope_rows(ours: str, tensor: torch.Tensor, cfg: ModelConfig, order: torch.Tensor) -> torch.Tensor:
    """The rows that meet RoPE (q and k projections and biases, each head's q/k norm weights) in ``order``; other
    tensors as they are."""
    if ".attn.q_proj." in ours:
        return _permute_heads(tensor, cfg.num_heads, order)
    if ".attn.k_proj." in ours:
        return _permute_heads(tensor, cfg.kv_heads, order)
    if ours.endswith(("attn.q_norm.weight", "attn.k_norm.weight")):
        # a per-head norm's weight [d_head], or a whole projection's [heads * d_head] (OLMo 2): each head's rows
        return tensor.reshape(-1, len(order))[:, order].reshape(tensor.shape)
    return tensor


def state_from_hf(hf_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF tensors -> this library's ``state_dict`` (q/k rows permuted to interleaved RoPE pairs)."""
    hf_state = {k: v for k, v in hf_state.items() if not k.endswith("rotary_emb.inv_freq")}  # old files carry it
    order = rope_row_order(cfg)
    hf_state = _split_fused(hf_state, cfg)
    state, used = {}, set()
    names = dict(TOP_KEYS)
    for i in range(cfg.num_layers):
        names.update({f"layers.{i}.{ours}": f"model.layers.{i}.{theirs}" for ours, theirs in _layer_keys(cfg, i).items()})
        if cfg.is_moe_layer(i):
            state.update(_experts_from_hf(hf_state, f"model.layers.{i}", cfg, used, f"layers.{i}.ffn"))
    if cfg.tie_embeddings and "lm_head.weight" not in hf_state:
        names["lm_head.weight"] = "model.embed_tokens.weight"
    for ours, theirs in names.items():
        if theirs not in hf_state:
            raise ValueError(f"checkpoint lacks {theirs}")
        state[ours] = _rope_rows(ours, hf_state[theirs], cfg, order)
        used.add(theirs)
    extra = sorted(set(hf_state) - used)
    if extra:
        biases = [k for k in extra if k.endswith(".bias")]
        what = f"biases ({biases[0]}, ...): TransformerLM has none" if biases else f"tensors it cannot place: {extra[:3]}"
        raise ValueError(f"checkpoint has {len(extra)} unexpected {what}")
    return state


def _experts_from_hf(hf_state: dict, layer: str, cfg: ModelConfig, used: set, ours: str) -> dict:
    """One MoE layer's router and experts, from per-expert tensors (``block_sparse_moe.experts.{j}.w1/w3/w2`` or
    ``mlp.experts.{j}.gate_proj/up_proj/down_proj``) or stacked ones (``mlp.experts.gate_up_proj`` /
    ``down_proj``), into the stacked ``[E, 2I, H]`` / ``[E, H, I]`` layout."""
    block = next((f"{layer}.{name}" for name in ("block_sparse_moe", "mlp") if f"{layer}.{name}.gate.weight" in hf_state),
                 None)
    if block is None:
        raise ValueError(f"checkpoint lacks {layer}.block_sparse_moe.gate.weight (or {layer}.mlp.gate.weight)")

    def take(key):
        if key not in hf_state:
            raise ValueError(f"checkpoint lacks {key}")
        used.add(key)
        return hf_state[key]

    out = {f"{ours}.router.weight": take(f"{block}.gate.weight")}
    if f"{block}.experts.gate_up_proj" in hf_state:
        out[f"{ours}.experts.gate_up_proj"] = take(f"{block}.experts.gate_up_proj")
        out[f"{ours}.experts.down_proj"] = take(f"{block}.experts.down_proj")
        return out
    names = ("w1", "w3", "w2") if f"{block}.experts.0.w1.weight" in hf_state else ("gate_proj", "up_proj", "down_proj")
    experts = [[take(f"{block}.experts.{j}.{n}.weight") for n in names] for j in range(cfg.num_experts)]
    out[f"{ours}.experts.gate_up_proj"] = torch.stack([torch.cat([gate, up]) for gate, up, _ in experts])
    out[f"{ours}.experts.down_proj"] = torch.stack([down for _, _, down in experts])
    return out


def state_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """This library's ``state_dict`` -> HF tensors (the inverse of :func:`state_from_hf`; tied heads omitted)."""
    inverse = torch.argsort(rope_row_order(cfg))
    out = {}
    for ours, theirs in TOP_KEYS.items():
        if ours == "lm_head.weight" and cfg.tie_embeddings:
            continue
        out[theirs] = state[ours]
    mixtral = cfg.num_experts and hf_model_type(cfg) == "mixtral"
    for i in range(cfg.num_layers):
        if cfg.is_moe_layer(i):  # per-expert names (the Hub and transformers 4.x; 5.x converts them on load)
            block = f"model.layers.{i}.{'block_sparse_moe' if mixtral else 'mlp'}"
            gate_name, up_name, down_name = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
            out[f"{block}.gate.weight"] = state[f"layers.{i}.ffn.router.weight"]
            gate_up, down = state[f"layers.{i}.ffn.experts.gate_up_proj"], state[f"layers.{i}.ffn.experts.down_proj"]
            d_ff = cfg.expert_d_ff
            for j in range(cfg.num_experts):
                out[f"{block}.experts.{j}.{gate_name}.weight"] = gate_up[j, :d_ff]
                out[f"{block}.experts.{j}.{up_name}.weight"] = gate_up[j, d_ff:]
                out[f"{block}.experts.{j}.{down_name}.weight"] = down[j]
        for ours, theirs in _layer_keys(cfg, i).items():
            out[f"model.layers.{i}.{theirs}"] = _rope_rows(f"layers.{i}.{ours}", state[f"layers.{i}.{ours}"], cfg,
                                                           inverse)
    if hf_model_type(cfg) == "phi3":
        out = _fuse_projections(out, cfg)
    return {k: v.detach().contiguous() for k, v in out.items()}


def _split_fused(hf_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` weights as the separate projections (views, no copies)."""
    if not any(k.endswith(("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight")) for k in hf_state):
        return hf_state
    q_rows, kv_rows = cfg.num_heads * cfg.d_head, cfg.kv_heads * cfg.d_head
    out = {}
    for name, tensor in hf_state.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            stem = name[: -len("qkv_proj.weight")]
            if tensor.shape[0] != q_rows + 2 * kv_rows:
                raise ValueError(f"{name} has {tensor.shape[0]} rows, not q + k + v = {q_rows + 2 * kv_rows}")
            q, k, v = tensor.split((q_rows, kv_rows, kv_rows))
            out.update({f"{stem}q_proj.weight": q, f"{stem}k_proj.weight": k, f"{stem}v_proj.weight": v})
        elif name.endswith("mlp.gate_up_proj.weight"):
            stem = name[: -len("gate_up_proj.weight")]
            gate, up = tensor.chunk(2)
            out.update({f"{stem}gate_proj.weight": gate, f"{stem}up_proj.weight": up})
        else:
            out[name] = tensor
    return out


def _fuse_projections(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of :func:`_split_fused`: Phi-3 files hold ``qkv_proj`` and ``gate_up_proj``."""
    out = dict(state)
    for i in range(cfg.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        out[f"{attn}qkv_proj.weight"] = torch.cat([out.pop(f"{attn}{p}_proj.weight") for p in ("q", "k", "v")])
        out[f"{mlp}gate_up_proj.weight"] = torch.cat([out.pop(f"{mlp}{p}_proj.weight") for p in ("gate", "up")])
    return out


# ----------------------------------------------------------------------------------------------------
# public entry points
# ----------------------------------------------------------------------------------------------------
def _checkpoint_dtype(cfg: dict, hf_state: dict[str, torch.Tensor]) -> torch.dtype:
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    if isinstance(name, str) and name in _DTYPES:
        return _DTYPES[name]
    floats = [t.dtype for t in hf_state.values() if t.is_floating_point()]
    return floats[0] if floats else torch.float32


def _requested_dtype(dtype) -> torch.dtype | None:
    """``dtype`` as transformers' ``from_pretrained`` takes it: None or "auto" (-> None: the checkpoint's), a torch
    dtype, or its name ("bfloat16", "torch.float16")."""
    if dtype is None or (isinstance(dtype, str) and dtype == "auto"):
        return None
    if isinstance(dtype, torch.dtype):
        chosen = dtype
    elif isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        chosen = _DTYPES[dtype.removeprefix("torch.")]
    else:
        raise ValueError(f"dtype {dtype!r}: expected 'auto', a torch dtype or one of {sorted(_DTYPES)}")
    if not chosen.is_floating_point:
        raise ValueError(f"dtype {dtype!r} is not a floating-point dtype")
    return chosen


def from_pretrained(path, backend: str = "auto", device=None, dtype=None, *, context_length: int | None = None):
    """A :class:`~tritonlm.modules.TransformerLM` holding a local HF checkpoint of one of :data:`FAMILIES`.

    ``path``: a directory with ``config.json`` and ``*.safetensors`` (sharded with ``model.safetensors.index.json``
    too). ``dtype``: None or "auto" = the checkpoint's (``torch_dtype``/``dtype`` in config.json), else a torch
    dtype or its name ("bfloat16"), as transformers takes it; ``context_length`` defaults to
    ``max_position_embeddings``. The returned model keeps the HF config dict as ``model.hf_config`` (token ids
    for generation, and :func:`save_pretrained` writes them back).
    """
    from ..modules import TransformerLM

    path = Path(path)
    hf_cfg = read_hf_config(path)
    cfg = model_config_from_hf(hf_cfg, context_length)
    dtype = _requested_dtype(dtype)  # checked before the weights are read
    hf_state = read_hf_state(path)
    state = state_from_hf(hf_state, cfg)
    dtype = dtype or _checkpoint_dtype(hf_cfg, hf_state)
    model = TransformerLM.from_config(cfg, device=device, dtype=dtype, backend=backend)
    model.load_state_dict(state)
    model.hf_config = hf_cfg
    return model


def save_pretrained(model, directory, *, dtype: torch.dtype | None = None) -> Path:
    """Write ``model`` as an HF directory of its family (:func:`hf_model_type`: ``config.json`` + ``model.safetensors``) that
    ``transformers.AutoModelForCausalLM.from_pretrained`` loads. ``dtype`` converts the weights (default: as they
    are). Returns the directory."""
    _require("safetensors")
    from safetensors.torch import save_file

    directory = Path(directory)
    cfg = model.config
    state = state_to_hf(model.state_dict(), cfg)
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    weights_dtype = next(iter(state.values())).dtype
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.cpu() for k, v in state.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    hf_cfg = hf_config_from_model(cfg, weights_dtype, getattr(model, "hf_config", None))
    (directory / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n", encoding="utf-8")
    return directory
