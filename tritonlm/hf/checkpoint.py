"""Hugging Face Llama/Mistral/Mixtral checkpoints <-> :class:`~tritonlm.modules.TransformerLM`.

Two differences between the layouts, everything else is a rename:

* RoPE pairs. HF rotates ``(x[i], x[i + d/2])`` (``rotate_half``); this library rotates ``(x[2i], x[2i+1])``.
  Permuting the rows of each head of ``q_proj`` and ``k_proj`` by ``[0, d/2, 1, d/2+1, ...]`` turns one into
  the other: ``q·k`` is unchanged because q and k are permuted alike, and ``v`` is untouched.
* Tied embeddings. HF omits ``lm_head.weight`` from the file when ``tie_word_embeddings`` is set.
* Mixtral's experts. Files hold them per expert (``block_sparse_moe.experts.{j}.w1/w2/w3``, what the Hub has and
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

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM")
MODEL_TYPES = ("llama", "mistral", "mixtral")

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
    """The :class:`ModelConfig` of an HF ``LlamaForCausalLM``/``MistralForCausalLM`` config dict.

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
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers maps "swish" to SiLU as well
        raise ValueError(f"hidden_act {act!r} is not supported: the SwiGLU FFN uses silu")
    for field in ("attention_bias", "mlp_bias"):
        if cfg.get(field):
            raise ValueError(f"{field}=true is not supported: TransformerLM has no biases")
    for field in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"):
        if field not in cfg:
            raise ValueError(f"config.json lacks {field}")
    d_model, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim * heads != d_model:
        raise ValueError(f"head_dim={head_dim} is not hidden_size / num_attention_heads = {d_model / heads:g}: "
                         "TransformerLM needs d_model = heads x head_dim")
    theta, scaling = _rope_fields(cfg)
    max_positions = cfg.get("max_position_embeddings", 2048)
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
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
    return ModelConfig(
        vocab_size=cfg["vocab_size"], context_length=int(context_length), d_model=d_model,
        num_layers=cfg["num_hidden_layers"], num_heads=heads, d_ff=cfg["intermediate_size"], rope_theta=theta,
        num_kv_heads=None if kv_heads == heads else kv_heads, norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), rope_scaling=scaling, **_moe_fields(cfg))


def _moe_fields(cfg: dict) -> dict:
    """The mixture-of-experts fields of a Mixtral config (every layer routes to ``num_experts_per_tok`` of
    ``num_local_experts`` experts, probabilities renormalised); nothing for dense model types."""
    if cfg.get("model_type") != "mixtral":
        return {}
    if cfg.get("router_jitter_noise"):
        raise ValueError(f"router_jitter_noise={cfg['router_jitter_noise']} is not supported (training-time noise "
                         "on the router input)")
    return dict(num_experts=int(cfg.get("num_local_experts", cfg.get("num_experts", 8))),
                experts_per_token=int(cfg.get("num_experts_per_tok", 2)), moe_d_ff=int(cfg["intermediate_size"]),
                norm_topk_prob=True, router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)))


def hf_config_from_model(cfg: ModelConfig, dtype: torch.dtype, extra: dict | None = None) -> dict:
    """An HF ``LlamaForCausalLM`` config dict for a model, in transformers 4.x keys (5.x reads them too)."""
    if (cfg.norm, cfg.ffn, cfg.position, cfg.norm_position) != ("rmsnorm", "swiglu", "rope", "pre"):
        raise ValueError("only the Llama layout (pre-norm RMSNorm, SwiGLU, RoPE) has an HF Llama equivalent; "
                         f"this model has norm={cfg.norm!r}, ffn={cfg.ffn!r}, position={cfg.position!r}, "
                         f"norm_position={cfg.norm_position!r}")
    out = {k: v for k, v in (extra or {}).items() if k in PASSTHROUGH_FIELDS}
    if cfg.num_experts:
        if cfg.moe_layers is not None or cfg.shared_expert_d_ff or not cfg.norm_topk_prob:
            raise ValueError("only Mixtral's MoE layout (every layer MoE, no shared expert, renormalised top-k) has "
                             f"an HF equivalent here; this model has moe_layers={cfg.moe_layers!r}, "
                             f"shared_expert_d_ff={cfg.shared_expert_d_ff!r}, norm_topk_prob={cfg.norm_topk_prob!r}")
        out.update({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                    "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.experts_per_token,
                    "router_aux_loss_coef": cfg.router_aux_loss_coef, "router_jitter_noise": 0.0,
                    "output_router_logits": False, "sliding_window": None})
    out.update({
        "architectures": out.get("architectures", ["LlamaForCausalLM"]), "model_type": out.get("model_type", "llama"),
        "hidden_act": "silu",
        "hidden_size": cfg.d_model, "intermediate_size": cfg.expert_d_ff if cfg.num_experts else cfg.d_ff,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads, "num_hidden_layers": cfg.num_layers, "head_dim": cfg.d_head,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.context_length, "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling, "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "torch_dtype": str(dtype).removeprefix("torch."),
    })
    return out


# ----------------------------------------------------------------------------------------------------
# weights
# ----------------------------------------------------------------------------------------------------
def half_to_interleaved(d_head: int) -> torch.Tensor:
    """Row order that turns one head's half-split RoPE rows into interleaved pairs: ``[0, d/2, 1, d/2+1, ...]``."""
    half = torch.arange(d_head // 2)
    return torch.stack((half, half + d_head // 2), dim=-1).reshape(-1)


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


def state_from_hf(hf_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF tensors -> this library's ``state_dict`` (q/k rows permuted to interleaved RoPE pairs)."""
    hf_state = {k: v for k, v in hf_state.items() if not k.endswith("rotary_emb.inv_freq")}  # old files carry it
    order = half_to_interleaved(cfg.d_head)
    state, used = {}, set()
    names = dict(TOP_KEYS)
    for i in range(cfg.num_layers):
        moe = cfg.is_moe_layer(i)
        names.update({f"layers.{i}.{ours}": f"model.layers.{i}.{theirs}" for ours, theirs in LAYER_KEYS.items()
                      if not (moe and ours.startswith("ffn."))})
        if moe:
            state.update(_experts_from_hf(hf_state, f"model.layers.{i}", cfg, used, f"layers.{i}.ffn"))
    if cfg.tie_embeddings and "lm_head.weight" not in hf_state:
        names["lm_head.weight"] = "model.embed_tokens.weight"
    for ours, theirs in names.items():
        if theirs not in hf_state:
            raise ValueError(f"checkpoint lacks {theirs}")
        tensor = hf_state[theirs]
        if ours.endswith("attn.q_proj.weight"):
            tensor = _permute_heads(tensor, cfg.num_heads, order)
        elif ours.endswith("attn.k_proj.weight"):
            tensor = _permute_heads(tensor, cfg.kv_heads, order)
        state[ours] = tensor
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
    inverse = torch.argsort(half_to_interleaved(cfg.d_head))
    out = {}
    for ours, theirs in TOP_KEYS.items():
        if ours == "lm_head.weight" and cfg.tie_embeddings:
            continue
        out[theirs] = state[ours]
    for i in range(cfg.num_layers):
        if cfg.is_moe_layer(i):  # Mixtral's per-expert names (transformers 4.x and the Hub; 5.x converts them)
            block, d_ff = f"model.layers.{i}.block_sparse_moe", cfg.expert_d_ff
            out[f"{block}.gate.weight"] = state[f"layers.{i}.ffn.router.weight"]
            gate_up, down = state[f"layers.{i}.ffn.experts.gate_up_proj"], state[f"layers.{i}.ffn.experts.down_proj"]
            for j in range(cfg.num_experts):
                out[f"{block}.experts.{j}.w1.weight"] = gate_up[j, :d_ff]
                out[f"{block}.experts.{j}.w3.weight"] = gate_up[j, d_ff:]
                out[f"{block}.experts.{j}.w2.weight"] = down[j]
        for ours, theirs in LAYER_KEYS.items():
            if cfg.is_moe_layer(i) and ours.startswith("ffn."):
                continue
            tensor = state[f"layers.{i}.{ours}"]
            if ours == "attn.q_proj.weight":
                tensor = _permute_heads(tensor, cfg.num_heads, inverse)
            elif ours == "attn.k_proj.weight":
                tensor = _permute_heads(tensor, cfg.kv_heads, inverse)
            out[f"model.layers.{i}.{theirs}"] = tensor
    return {k: v.detach().contiguous() for k, v in out.items()}


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
    """A :class:`~tritonlm.modules.TransformerLM` holding a local HF ``LlamaForCausalLM``/``MistralForCausalLM``.

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
    """Write ``model`` as an HF ``LlamaForCausalLM`` directory (``config.json`` + ``model.safetensors``) that
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
