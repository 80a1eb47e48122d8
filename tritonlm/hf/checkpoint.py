"""Hugging Face checkpoints <-> :class:`~tritonlm.modules.TransformerLM`, for every family of the registry
(:mod:`tritonlm.hf.families`; this module names none of them).

A family's record says what differs from a rename:

* RoPE pairs. HF's ``rotate_half`` families rotate ``(x[i], x[i + d/2])``; this library rotates ``(x[2i], x[2i+1])``.
  Permuting the rows of each head of ``q_proj`` and ``k_proj`` (their biases and per-head norms alike) by ``[0, d/2,
  1, d/2+1, ...]`` turns one into the other: ``q·k`` is unchanged because q and k are permuted alike, and ``v`` is
  untouched. With a partial rotary dim only each head's first rotary rows are permuted. Families in interleaved
  layout (``Weights.rope_layout``) need nothing.
* Fused tensors (``Weights.fused``: one ``qkv_proj`` or ``gate_up_proj``) are split on load and fused on save.
* Tied embeddings: HF omits ``lm_head.weight`` from the file when ``tie_word_embeddings`` is set. A file that holds a
  head of its own beside the flag loads as transformers loads it: both matrices kept, untied.
* Each layer's tensors are named by its parts (:mod:`tritonlm.modules.parts`: the mixer's and the MLP's
  ``hf_names``), and a part whose layout differs transforms its own (``state_from_hf`` / ``state_to_hf``): MoE
  experts, for one, are held per expert in files (``{block}.experts.{j}.{gate, up, down}.weight``, what the Hub has
  and transformers 4.x writes) or stacked (transformers 5's ``mlp.experts.gate_up_proj`` / ``down_proj``); both
  load into the stacked layout the model keeps, and checkpoints are written per expert, which both versions read.

The config mapping (:func:`model_config_from_hf`) reads plain JSON, so ``tritonlm accounting --hf`` works without
``transformers``; reading and writing weights needs ``safetensors`` (``pip install tritonlm[hf]``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch

from ..config import ModelConfig
from .family import COMMON_KEYS, IDENTITY_KEYS, ConfigReader, Family, canonical_scaling, families, family

logger = logging.getLogger("tritonlm")

#: config.json fields copied through a load/save round trip untouched (token ids, generation defaults); besides
#: these, every key the family accepted without reading it (:data:`~tritonlm.hf.family.COMMON_KEYS` but the
#: file's identity, the family's ``harmless`` and ``ignored`` keys) is written back as it was
PASSTHROUGH_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "initializer_range")
#: the keys of a vision-language config.json that name its language model's tokens (kept through a save)
_WRAPPER_TOKEN_KEYS = ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")

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


def read_generation_config(path) -> dict | None:
    """``generation_config.json`` of a local HF model directory as a dict (the end-of-sequence ids and sampling
    defaults transformers' ``generate`` uses), or None when the directory has none."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return None
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None


def family_of(cfg: dict) -> Family:
    """The registered family of an HF config dict (its ``model_type``; ``architectures`` must name its class)."""
    record = family(cfg.get("model_type") or "")
    archs = cfg.get("architectures") or []
    other = [a for a in archs if a != record.architecture]
    if other:
        raise ValueError(f"architectures={other} is not supported for model_type {record.model_type!r} "
                         f"(the causal LM {record.architecture})")
    return record


def text_config_of(cfg: dict) -> tuple[dict, bool]:
    """``(config, wrapped)``: a vision-language directory's ``text_config`` as the text family's config dict (its
    ``model_type`` and causal-LM architecture; the wrapper's ``tie_word_embeddings`` and token ids where the text
    config lacks them) and True; any other config as it is and False."""
    record = family(cfg.get("model_type") or "")
    if record.text_of is None:
        return cfg, False
    archs = [a for a in cfg.get("architectures") or [] if a != record.architecture]
    if archs:
        raise ValueError(f"architectures={archs} is not supported for model_type {record.model_type!r} "
                         f"({record.architecture})")
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"model_type {record.model_type!r}: config.json lacks its text_config")
    text_family = family(record.text_of)
    out = {k: v for k, v in text.items() if k != "model_type"}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "dtype", "torch_dtype"):
        if key in cfg and out.get(key) is None:
            out[key] = cfg[key]
    if "tie_word_embeddings" in cfg:  # (the vision-language class ties by its own flag, whatever text_config says:
        out["tie_word_embeddings"] = cfg["tie_word_embeddings"]  # transformers 5 writes it only at the top level)
    out.update(model_type=text_family.model_type, architectures=[text_family.architecture])
    return out, True


_LANGUAGE_MODEL = "model.language_model."


def _language_model_state(hf_state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(language model, the rest)``: a vision-language checkpoint's language model in the text family's names
    (``model.language_model.X`` -> ``model.X``, ``lm_head.weight``), and every other tensor (the vision tower, the
    multi-token-prediction head) as it is in the file, kept aside for :func:`save_pretrained` (said in the log)."""
    language = {("model." + k[len(_LANGUAGE_MODEL):]) if k.startswith(_LANGUAGE_MODEL) else k: v
                for k, v in hf_state.items() if k.startswith(_LANGUAGE_MODEL) or k == "lm_head.weight"}
    rest = {k: v for k, v in hf_state.items() if not k.startswith(_LANGUAGE_MODEL) and k != "lm_head.weight"}
    if rest:
        logger.info("loading the language model; %d other tensors (%s, ...: the vision tower) are kept aside "
                    "unchanged for save_pretrained", len(rest), next(iter(rest)))
    return language, rest


def _refuse_quantized(cfg: dict) -> None:
    """A quantised checkpoint (``quantization_config`` at the top level, or in a vision-language ``text_config``)
    is a one-line error naming its method: tritonlm reads unquantised weights only."""
    for where in (cfg, cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}):
        quant = where.get("quantization_config")
        if quant:
            method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
            raise ValueError(f"quantization_config (quant_method={method!r}) is not supported: tritonlm loads "
                             "unquantised weights (dequantise the checkpoint first)")


def model_config_from_hf(cfg: dict, context_length: int | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of an HF config dict of a registered family.

    ``context_length`` defaults to ``max_position_embeddings`` (smaller is allowed, larger is an error). Every key is
    accounted for by the family (see :mod:`tritonlm.hf.family`): anything the model cannot represent is a
    ``ValueError`` naming the key and value, before any weight is read.
    """
    _refuse_quantized(cfg)
    cfg, _ = text_config_of(cfg)
    record = family_of(cfg)
    reader = ConfigReader(cfg, record)
    if "pruned_heads" in cfg:  # (transformers 4.x writes an empty dict)
        reader.require("pruned_heads", lambda v: not v, "heads pruned from the attention")
    fields = record.to_config(reader)
    reader.finish()
    limit = int(fields.pop("context_length"))
    if context_length is None:
        context_length = limit
    elif context_length > limit:
        raise ValueError(f"context_length {context_length} exceeds what the checkpoint supports "
                         f"(max_position_embeddings={limit})")
    return ModelConfig(**fields, context_length=int(context_length), model_type=record.model_type)


def _differences(a: ModelConfig, b: ModelConfig) -> list[str]:
    """Fields where two configs describe different models: RoPE scaling dicts compared in one form, the experts'
    width as it applies (``moe_d_ff`` None means ``d_ff``), the dense ``d_ff`` only where a layer is dense."""
    def effective(cfg: ModelConfig, name: str):
        if name == "rope_scaling":
            return canonical_scaling(cfg.rope_scaling)
        if name == "moe_d_ff" and cfg.num_experts:
            return cfg.expert_d_ff
        if name == "d_ff" and all(cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
            return None
        return getattr(cfg, name)

    return [f.name for f in dataclasses.fields(ModelConfig) if effective(a, f.name) != effective(b, f.name)]


def hf_config_from_model(cfg: ModelConfig, dtype: torch.dtype, extra: dict | None = None) -> dict:
    """The HF config dict of a model, in its family's keys (``cfg.model_type``; None: the default family). The
    family must hold the model exactly: the dict is read back and compared field by field, and any field it would
    lose is a one-line error naming it."""
    record = family(cfg.model_type)
    extra = extra or {}
    accepted = COMMON_KEYS | set(record.harmless) | set(record.ignored) | set(PASSTHROUGH_FIELDS)
    out = {k: v for k, v in extra.items() if k in accepted and k not in IDENTITY_KEYS}
    out.update(record.to_hf(cfg))
    # the checkpoint's own positions where the model was only loaded for a shorter context
    if isinstance(extra.get("max_position_embeddings"), int) and extra["max_position_embeddings"] > cfg.context_length:
        out["max_position_embeddings"] = extra["max_position_embeddings"]
    out.update({"architectures": [record.architecture], "model_type": record.model_type,
                "torch_dtype": str(dtype).removeprefix("torch.")})
    back = model_config_from_hf(out)
    expected = cfg.replace(context_length=back.context_length, model_type=record.model_type)
    lost = _differences(expected, back)
    if lost:
        shown = ", ".join(f"{name}={getattr(cfg, name)!r}" for name in lost)
        raise ValueError(f"model_type {record.model_type!r} cannot hold this model's {shown} (set ModelConfig."
                         f"model_type to a family that has {'them' if len(lost) > 1 else 'it'}: "
                         f"tritonlm.hf.SUPPORTED_MODELS)")
    return out


# ----------------------------------------------------------------------------------------------------
# weights
# ----------------------------------------------------------------------------------------------------
def half_to_interleaved(d_head: int) -> torch.Tensor:
    """Row order that turns one head's half-split RoPE rows into interleaved pairs: ``[0, d/2, 1, d/2+1, ...]``."""
    half = torch.arange(d_head // 2)
    return torch.stack((half, half + d_head // 2), dim=-1).reshape(-1)


def rope_row_order(cfg: ModelConfig) -> torch.Tensor:
    """One head's row order from the family's RoPE layout to interleaved pairs: in half-split layout the first
    ``rotary_dim`` rows paired up (all of them without a partial rotary dim), the rest in place; in interleaved
    layout (or without RoPE) every row in place."""
    if family(cfg.model_type).weights.rope_layout == "interleaved" or cfg.position != "rope":
        return torch.arange(cfg.d_head)
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


#: ours -> HF names of the top-level tensors
TOP_KEYS = {"token_embeddings.weight": "model.embed_tokens.weight", "ln_final.weight": "model.norm.weight",
            "lm_head.weight": "lm_head.weight"}


def layer_names(cfg: ModelConfig, i: int) -> dict[str, str]:
    """Ours -> HF names inside layer ``i`` of the tensors that map one to one: the two norms, then what the layer's
    parts name (:meth:`~tritonlm.modules.parts.Part.hf_names`: the mixer's under ``attn.``, the MLP's under
    ``ffn.``), then the family's own spellings (``Weights.names``). A tensor with no generic name (sandwich norms)
    must be named by the family."""
    keys = {"ln1.weight": "input_layernorm.weight", "ln2.weight": "post_attention_layernorm.weight"}
    keys.update({f"attn.{ours}": theirs for ours, theirs in cfg.layer_mixer(i).hf_names().items()})
    keys.update({f"ffn.{ours}": theirs for ours, theirs in cfg.layer_mlp(i).hf_names().items()})
    if cfg.post_norms:
        keys.update({"attn_post_norm.weight": None, "ffn_post_norm.weight": None})
    record = family(cfg.model_type)
    keys.update({ours: theirs for ours, theirs in record.weights.names.items() if ours in keys})
    unnamed = [ours for ours, theirs in keys.items() if theirs is None]
    if unnamed:
        raise ValueError(f"model_type {record.model_type!r} has no tensor for {unnamed[0]}")
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


def _split_fused(hf_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The family's fused tensors as their parts (views, no copies)."""
    fused = family(cfg.model_type).weights.fused
    if not fused:
        return hf_state
    out = dict(hf_state)
    for i in range(cfg.num_layers):
        for spec in fused:
            name = f"model.layers.{i}.{spec.name}"
            if name not in out:
                continue
            tensor = out.pop(name)
            if spec.order is not None:  # (rows interleaved per head in the file: gathered into the parts' order)
                tensor = tensor[spec.order(cfg)]
            sizes = spec.sizes(cfg)
            if tensor.shape[0] != sum(sizes):
                raise ValueError(f"{name} has {tensor.shape[0]} rows, not {' + '.join(map(str, sizes))}")
            out.update({f"model.layers.{i}.{part}": t for part, t in zip(spec.parts, tensor.split(sizes))})
    return out


def _fuse(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of :func:`_split_fused`."""
    out = dict(state)
    for i in range(cfg.num_layers):
        for spec in family(cfg.model_type).weights.fused:
            parts = [f"model.layers.{i}.{part}" for part in spec.parts]
            if all(p in out for p in parts):
                fused = torch.cat([out.pop(p) for p in parts])
                if spec.order is not None:
                    fused = fused[torch.argsort(spec.order(cfg))]
                out[f"model.layers.{i}.{spec.name}"] = fused
    return out


def state_from_hf(hf_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF tensors -> this library's ``state_dict`` (q/k rows permuted to interleaved RoPE pairs where the family's
    layout is half-split)."""
    hf_state = {k: v for k, v in hf_state.items() if not k.endswith("rotary_emb.inv_freq")}  # old files carry it
    weights = family(cfg.model_type).weights
    if weights.mtp_layers:
        hf_state = _without_mtp_layers(hf_state, cfg)
    skipped = sorted(k for k in hf_state if k.startswith(weights.skipped_prefixes)) if weights.skipped_prefixes else []
    if skipped:
        logger.info("skipping %d tensors under %s (not part of the causal LM)", len(skipped),
                    ", ".join(sorted({p for p in weights.skipped_prefixes if any(k.startswith(p) for k in skipped)})))
        hf_state = {k: v for k, v in hf_state.items() if not k.startswith(weights.skipped_prefixes)}
    order = rope_row_order(cfg)
    hf_state = _split_fused(hf_state, cfg)
    state, used = {}, set()
    names = dict(TOP_KEYS)
    for i in range(cfg.num_layers):
        names.update({f"layers.{i}.{ours}": f"model.layers.{i}.{theirs}" for ours, theirs in layer_names(cfg, i).items()})
        for part, ours in ((cfg.layer_mixer(i), "attn"), (cfg.layer_mlp(i), "ffn")):  # (an MoE's stacked experts)
            state.update(part.state_from_hf(hf_state, f"model.layers.{i}", f"layers.{i}.{ours}", weights, used))
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
        what = f"biases ({biases[0]}, ...): the config declares none" if biases else f"tensors it cannot place: {extra[:3]}"
        raise ValueError(f"checkpoint has {len(extra)} unexpected {what}")
    return state


def _without_mtp_layers(hf_state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The tensors of the causal LM: multi-token-prediction layers (``model.layers.{i}.*`` with ``i`` past the last
    layer) left out, as transformers leaves them out, and said in the log."""
    def layer(key: str) -> int:
        parts = key.split(".")
        return int(parts[2]) if key.startswith("model.layers.") and parts[2].isdigit() else -1

    extra = {k for k in hf_state if layer(k) >= cfg.num_layers}
    if extra:
        logger.info("skipping %d tensors of multi-token-prediction layers %s (not part of the causal LM)", len(extra),
                    sorted({layer(k) for k in extra}))
    return {k: v for k, v in hf_state.items() if k not in extra}


def state_to_hf(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """This library's ``state_dict`` -> HF tensors (the inverse of :func:`state_from_hf`; tied heads omitted)."""
    inverse = torch.argsort(rope_row_order(cfg))
    weights = family(cfg.model_type).weights
    out = {}
    for ours, theirs in TOP_KEYS.items():
        if ours == "lm_head.weight" and cfg.tie_embeddings:
            continue
        out[theirs] = state[ours]
    for i in range(cfg.num_layers):
        for part, ours in ((cfg.layer_mixer(i), "attn"), (cfg.layer_mlp(i), "ffn")):
            out.update(part.state_to_hf(state, f"model.layers.{i}", f"layers.{i}.{ours}", weights))
        for ours, theirs in layer_names(cfg, i).items():
            out[f"model.layers.{i}.{theirs}"] = _rope_rows(f"layers.{i}.{ours}", state[f"layers.{i}.{ours}"], cfg,
                                                           inverse)
    return {k: v.detach().contiguous() for k, v in _fuse(out, cfg).items()}


def load_hf_weights(path, cfg: ModelConfig, language_model: bool = False, aside: dict | None = None
                    ) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(cfg, state, hf_state)``: a directory's tensors in this library's names for ``cfg`` (``language_model``: a
    vision-language directory's, :func:`text_config_of`, whose other tensors go into ``aside`` under their file
    names when it is given). A file that holds its own ``lm_head.weight`` beside ``tie_word_embeddings: true`` loads
    as transformers loads it, both matrices kept (``cfg`` comes back untied, said in the log)."""
    hf_state = read_hf_state(path)
    if language_model:
        hf_state, rest = _language_model_state(hf_state)
        if aside is not None:
            aside.update(rest)
    head, embedding = hf_state.get("lm_head.weight"), hf_state.get("model.embed_tokens.weight")
    if cfg.tie_embeddings and head is not None and embedding is not None and not torch.equal(head, embedding):
        logger.info("%s: tie_word_embeddings is set but the file holds an lm_head.weight of its own: both kept "
                    "(untied), as transformers loads it", path)
        cfg = cfg.replace(tie_embeddings=False)
    return cfg, state_from_hf(hf_state, cfg), hf_state


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
    """A :class:`~tritonlm.modules.TransformerLM` holding a local HF checkpoint of a registered family
    (``tritonlm.hf.SUPPORTED_MODELS``).

    ``path``: a directory with ``config.json`` and ``*.safetensors`` (sharded with ``model.safetensors.index.json``
    too). ``dtype``: None or "auto" = the checkpoint's (``torch_dtype``/``dtype`` in config.json), else a torch
    dtype or its name ("bfloat16"), as transformers takes it; ``context_length`` defaults to
    ``max_position_embeddings``. The model comes back in eval mode, as transformers returns it. Its config keeps the
    family (``model_type``), and the model keeps the HF config dict as ``model.hf_config`` (token ids, which
    :func:`save_pretrained` writes back) and ``generation_config.json`` as ``model.generation_config`` (None
    without one: the end-of-sequence ids and sampling defaults ``tritonlm generate`` uses).

    A vision-language directory (``qwen3_5`` / ``qwen3_5_moe``, what the Hub publishes) loads its language model;
    its config.json and every other tensor (the vision tower) are kept as ``model.hf_wrapper`` (the tensors on the
    CPU, as the file holds them), so :func:`save_pretrained` writes the same vision-language directory back.
    """
    from ..modules import TransformerLM

    path = Path(path)
    raw = read_hf_config(path)
    hf_cfg, wrapped = text_config_of(raw)  # (a vision-language directory: its language model)
    cfg = model_config_from_hf(raw, context_length)
    dtype = _requested_dtype(dtype)  # checked before the weights are read
    aside: dict[str, torch.Tensor] = {}
    cfg, state, hf_state = load_hf_weights(path, cfg, language_model=wrapped, aside=aside)
    dtype = dtype or _checkpoint_dtype(hf_cfg, hf_state)
    model = TransformerLM.from_config(cfg, device=device, dtype=dtype, backend=backend)
    model.load_state_dict(state)
    model.hf_config = hf_cfg
    model.hf_wrapper = {"config": raw, "tensors": aside} if wrapped else None
    model.generation_config = read_generation_config(path)
    return model.eval()  # (as transformers returns it: call .train() to fine-tune)


def _vision_language_files(wrapper: dict, cfg: ModelConfig, text_cfg: dict, state: dict[str, torch.Tensor],
                           dtype: torch.dtype | None) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(config, tensors)`` of the vision-language directory a model was loaded from: its config.json with the
    language model's ``text_config`` written from the model (every key of the file's own text_config the family
    accepted without reading kept), and its tensors: the language model under ``model.language_model.`` and the
    vision tower as it was loaded (converted only when ``dtype`` is given)."""
    original = wrapper["config"]
    config = json.loads(json.dumps(original))  # (a deep copy: nested dicts are the loaded model's)
    text = {k: v for k, v in (original.get("text_config") or {}).items()}
    text.update({k: v for k, v in text_cfg.items() if k not in ("architectures", "torch_dtype")})
    text["model_type"] = cfg.model_type
    config["text_config"] = text
    if "tie_word_embeddings" in config or cfg.tie_embeddings:  # (the VL class ties by this flag)
        config["tie_word_embeddings"] = cfg.tie_embeddings
    dtype_name = text_cfg["torch_dtype"]
    for where in (config, text):  # (the weights' dtype, under whichever name each level already used)
        for key in ("dtype", "torch_dtype"):
            if key in where:
                where[key] = dtype_name
    if "dtype" not in config and "torch_dtype" not in config:
        config["torch_dtype"] = dtype_name
    tensors = {(_LANGUAGE_MODEL + k[len("model."):]) if k.startswith("model.") else k: v for k, v in state.items()}
    for name, t in wrapper["tensors"].items():
        tensors[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return config, tensors


def save_pretrained(model, directory, *, dtype: torch.dtype | None = None, text_only: bool = False) -> Path:
    """Write ``model`` as an HF directory of its family (``model.config.model_type``: the family it was loaded as;
    None, a model built here: the default family, Llama) that ``transformers.AutoModelForCausalLM.from_pretrained``
    loads: ``config.json`` + ``model.safetensors``. A model the family cannot hold exactly is a one-line error
    before anything is written; a ``generation_config.json`` the model was loaded with is written back beside it.
    The config.json keys the family accepted without reading them (token ids, keys transformers never reads) are
    written back as they were. ``dtype`` converts the weights (default: as they are). Returns the directory.

    A model loaded from a vision-language directory (``model.hf_wrapper``) is written as that directory again:
    its config.json with the language model's text_config from the model, the language model's tensors under
    ``model.language_model.``, and the vision tower unchanged, so transformers loads it as the same vision-language
    model. ``text_only=True`` writes the language model alone, as its text family."""
    _require("safetensors")
    from safetensors.torch import save_file

    directory = Path(directory)
    cfg = model.config
    state = state_to_hf(model.state_dict(), cfg)
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    weights_dtype = next(iter(state.values())).dtype
    hf_cfg = hf_config_from_model(cfg, weights_dtype, getattr(model, "hf_config", None))
    wrapper = getattr(model, "hf_wrapper", None)
    if wrapper and not text_only:
        hf_cfg, state = _vision_language_files(wrapper, cfg, hf_cfg, state, dtype)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.cpu() for k, v in state.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n", encoding="utf-8")
    generation = getattr(model, "generation_config", None)
    if generation:  # (what from_pretrained read: the end ids and sampling defaults go back with the model)
        (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    return directory


def supported_models() -> dict[str, dict]:
    """model_type -> what works with it (README's "Supported models" table is generated from this)."""
    return {kind: {"architecture": f.architecture, "from_pretrained": True, "apply_kernels": f.kernels is not None,
                   "tokenizer": f.tokenizer, "notes": f.notes} for kind, f in families().items()}


def readme_table() -> str:
    """README's "Supported models" table (Markdown), from the registry."""
    yes = {True: "yes", False: "no"}
    rows = ["| model_type | architecture | from_pretrained / save_pretrained | apply_kernels | tokenizer.json | notes |",
            "|---|---|---|---|---|---|"]
    for kind, v in supported_models().items():
        rows.append(f"| {kind} | {v['architecture']} | {yes[v['from_pretrained']]} | {yes[v['apply_kernels']]} | "
                    f"{v['tokenizer']} | {v['notes']} |")
    return "\n".join(rows)
