"""A Hugging Face model family as one record (:class:`Family`), the registry of them, and the building blocks
family modules read and write configs with.

Each module of :mod:`tritonlm.hf.families` ends in ``register(Family(...))``: the architecture class, the config
mapping both ways, the weight names and transforms, the ``apply_kernels`` targets, the tokenizer kind and the
README row. The generic code (:mod:`~tritonlm.hf.checkpoint`, :mod:`~tritonlm.hf.patch`) reads these records and
names no family.

Every key of an HF config is accounted for by its family while it is read (:class:`ConfigReader`): read (a missing
key takes the default of transformers' own config class, the family's ``defaults`` table), known not to change the
maths (:data:`COMMON_KEYS`, the family's ``ignored``), or required at a value. Any other key, or a read key at a
value the model cannot represent, is a one-line ``ValueError`` naming it, before any weight is read.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config import ModelConfig

#: Keys any transformers config may hold that never change a causal LM's maths: bookkeeping, token ids (kept
#: through a round trip), the output switches, task heads' labels, and the generation defaults transformers 4.x
#: configs still carried (generation_config.json holds them now).
COMMON_KEYS = frozenset({
    "_name_or_path", "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "initializer_range",
    "output_attentions", "output_hidden_states", "return_dict", "use_return_dict", "torchscript", "id2label",
    "label2id", "num_labels", "problem_type", "is_encoder_decoder", "is_decoder", "add_cross_attention",
    "cross_attention_hidden_size", "tie_encoder_decoder", "chunk_size_feed_forward", "tokenizer_class", "prefix",
    "task_specific_params", "finetuning_task", "_attn_implementation", "_attn_implementation_autoset",
    "attn_implementation", "_experts_implementation", "auto_map", "custom_pipelines", "tf_legacy_loss",
    "use_bfloat16", "output_scores", "return_dict_in_generate", "max_length", "min_length", "do_sample",
    "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p",
    "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "num_return_sequences", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "pretraining_tp",
    # export settings of transformers.js (the ONNX runtime in the browser) that Hub repositories carry beside the
    # PyTorch weights; no transformers modeling code reads them
    "transformers.js_config",
})

#: The bookkeeping keys of :data:`COMMON_KEYS` that name the file rather than the model: never copied through a save
#: (the saved directory gets its own), and ``auto_map`` points at remote-code files it does not hold.
IDENTITY_KEYS = frozenset({"_name_or_path", "architectures", "model_type", "transformers_version", "dtype",
                           "torch_dtype", "auto_map", "_attn_implementation", "_attn_implementation_autoset",
                           "attn_implementation", "_experts_implementation"})

_MISSING = object()


class ConfigReader:
    """An HF config dict as one family reads it. :meth:`get` returns a key's value, or transformers' class default
    when the key is absent (a callable default is computed from this reader: derived defaults such as ``head_dim``);
    :meth:`require` checks a value; :meth:`finish` refuses every key nothing accounted for."""

    def __init__(self, raw: Mapping[str, Any], family: Family):
        self.raw, self.family, self.seen = raw, family, set()

    def __contains__(self, key: str) -> bool:
        return key in self.raw

    def get(self, key: str, default=_MISSING):
        """``key``'s value (None included: transformers reads an explicit null as such), else ``default``, else the
        family's class default; a key with neither is a one-line error."""
        self.seen.add(key)
        if key in self.raw:
            return self.raw[key]
        if default is _MISSING:
            if key not in self.family.defaults:
                raise ValueError(f"config.json lacks {key} (transformers' {self.family.config_class} has no default "
                                 "for it either)")
            default = self.family.defaults[key]
        return default(self) if callable(default) else default

    def value_or_default(self, key: str):
        """``key``'s value, or the class default when it is absent or null (keys whose null means "derive it")."""
        value = self.get(key)
        if value is None and key in self.family.defaults:
            default = self.family.defaults[key]
            value = default(self) if callable(default) else default
        return value

    def require(self, key: str, allowed, why: str):
        """``key``'s value (:meth:`get`), which must be one of ``allowed`` (a tuple of values, or a predicate);
        else ``"{key}={value} is not supported: {why}"``."""
        value = self.get(key)
        ok = allowed(value) if callable(allowed) else value in allowed
        if not ok:
            raise ValueError(f"{key}={value!r} is not supported: {why}")
        return value

    def ignore(self, *keys: str) -> None:
        """Mark ``keys`` as read without using them (their values do not change the model's maths)."""
        self.seen.update(keys)

    def finish(self) -> None:
        """Refuse every key neither read, ignored, harmless nor common (one line naming them)."""
        unknown = sorted(set(self.raw) - self.seen - COMMON_KEYS - set(self.family.ignored)
                         - set(self.family.harmless))
        if unknown:
            shown = ", ".join(f"{k}={self.raw[k]!r}" for k in unknown[:4])
            raise ValueError(f"config.json key{'s' if len(unknown) > 1 else ''} {shown}{', ...' if len(unknown) > 4 else ''} "
                             f"unknown to tritonlm's {self.family.model_type} family: it cannot tell what "
                             f"{'they change' if len(unknown) > 1 else 'it changes'}")


@dataclass(frozen=True)
class Fused:
    """One tensor HF holds fused (inside a layer, e.g. ``self_attn.qkv_proj.weight``) that the model keeps as
    ``parts`` (split along rows on load by ``sizes(cfg)``, concatenated again on save). ``order(cfg)``, when given,
    first gathers the rows into the parts' order (HF interleaves them per head: Qwen3.5's query and gate, Qwen3-Next's
    q/k/v/z per key head); the save puts them back."""
    name: str
    parts: tuple[str, ...]
    sizes: Callable[[ModelConfig], tuple[int, ...]]
    order: Callable[[ModelConfig], Any] | None = None


@dataclass(frozen=True)
class Weights:
    """How a family's tensors are named and laid out.

    ``names``: ours -> theirs inside a layer (``layers.{i}.`` / ``model.layers.{i}.``), over the generic names
    (:func:`tritonlm.hf.checkpoint.layer_names`: Llama's, and for the norms no Llama has, no generic name at all).
    ``rope_layout``: "half" (HF's ``rotate_half``: q/k rows are permuted to this library's interleaved pairs) or
    "interleaved" (the model's own layout: nothing to permute). ``fused``: tensors split on load and fused on
    save. ``expert_block`` / ``expert_names``: where an MoE layer's router and per-expert tensors live in a file
    (``{block}.gate.weight``, ``{block}.experts.{j}.{gate, up, down}.weight``). ``expert_format``: "stacked"
    (per-expert tensors, or transformers 5's stacked ``gate_up_proj [E, 2I, H]``) or "transposed_interleaved"
    (gpt-oss: ``router.weight`` /
    ``router.bias``, ``experts.gate_up_proj [E, H, 2I]`` with gate and up columns interleaved and its bias,
    ``experts.down_proj [E, I, H]`` and its bias: transposed on load into the model's stacked layout and back on
    save). ``mtp_layers``: the file may hold multi-token-prediction layers past ``num_hidden_layers``
    (DeepSeek-V3, GLM-4.5), which are not part of the causal LM and are skipped on load, as transformers skips
    them; ``skipped_prefixes``: top-level tensors that are not part of it either (Qwen3-Next's ``mtp.``), skipped
    with a log line."""
    names: Mapping[str, str] = field(default_factory=dict)
    rope_layout: str = "half"
    fused: tuple[Fused, ...] = ()
    expert_block: str = "mlp"
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    expert_format: str = "stacked"
    mtp_layers: bool = False
    skipped_prefixes: tuple[str, ...] = ()


def no_logit_transform(config) -> dict:
    return {}


@dataclass(frozen=True)
class Kernels:
    """What ``apply_kernels`` patches in a family's transformers modules, by class name.

    ``norms``: RMSNorm class -> "cast" (``w · x̂.to(dtype)``, Llama's casting), "fp32_weight" (``(w · x̂).to(dtype)``
    with x̂ in fp32: OLMo 2) or "offset" (``x̂ · (1 + w)`` in fp32: Gemma). ``mlps``: MLP class -> "swiglu" / "geglu"
    (separate gate_proj / up_proj) or "gate_up" (one ``gate_up_proj``, gate features first, SiLU). ``attention``:
    the attention classes whose RoPE runs through the kernel, in ``rope_layout`` ("half" or "interleaved").
    ``rope_tables``: "full" (the cos / sin HF hands ``apply_rotary_pos_emb`` hold both halves) or "pairs" (one value
    per rotated pair: gpt-oss). ``experts``: expert class -> "stacked" (transformers 5's ``gate_up_proj [E, 2I, H]``)
    or "transposed_interleaved" (gpt-oss: ``[E, H, 2I]`` interleaved, biases, the clamped SwiGLU).
    ``linear_attention``: the Gated DeltaNet classes whose delta rule and short convolution run through the kernels
    (norms may name their gated RMSNorm "gated").
    ``logits(config)``: what the fused loss applies to the logits (``{"softcap": c}``, ``{"divisor": s}``)."""
    norms: Mapping[str, str]
    mlps: Mapping[str, str]
    attention: tuple[str, ...]
    experts: Mapping[str, str] = field(default_factory=dict)
    linear_attention: tuple[str, ...] = ()
    rope_layout: str = "half"
    rope_tables: str = "full"
    logits: Callable[[Any], dict] = no_logit_transform


@dataclass(frozen=True)
class Family:
    """One ``model_type``: see the module docstring.

    ``to_config(reader) -> dict`` gives the :class:`ModelConfig` fields (``context_length`` is
    ``max_position_embeddings``; ``model_type`` is added); ``to_hf(cfg) -> dict`` the config keys of this family
    (the generic code adds ``architectures``, ``model_type``, the dtype and the token ids). ``defaults`` are
    transformers' ``config_class`` defaults of the keys ``to_config`` reads (tested against the class itself).
    ``notes`` is the README row's last column; ``default`` marks the family a model built here is saved as.
    ``text_of``: a vision-language directory (``config.json`` with a ``text_config``, the language model's tensors
    under ``model.language_model.``) whose language model loads as that text family; the vision tower is kept aside
    unchanged and the model saves as the same vision-language directory.

    ``harmless``: keys published config.json files carry that transformers' modeling code for this family never
    reads (its config class may not even define them), each with the reason it changes nothing: accepted on load
    and written back unchanged on save. A test checks each against the modeling module's source. ``ignored``: keys
    the family reads elsewhere or that cannot matter here (documented where they are listed)."""
    model_type: str
    architecture: str
    config_class: str
    defaults: Mapping[str, Any]
    to_config: Callable[[ConfigReader], dict]
    to_hf: Callable[[ModelConfig], dict]
    kernels: Kernels
    weights: Weights = Weights()
    tokenizer: str = "byte-level BPE"
    notes: str = ""
    ignored: tuple[str, ...] = ()
    harmless: Mapping[str, str] = field(default_factory=dict)
    default: bool = False
    text_of: str | None = None


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add ``family`` (each model_type once)."""
    if family.model_type in _FAMILIES and _FAMILIES[family.model_type] is not family:
        raise ValueError(f"model_type {family.model_type!r} is registered twice")
    _FAMILIES[family.model_type] = family
    return family


def families() -> dict[str, Family]:
    """Every registered family by model_type (importing every module of :mod:`tritonlm.hf.families`)."""
    package = importlib.import_module(f"{__package__}.families")
    for info in pkgutil.iter_modules(package.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{package.__name__}.{info.name}")
    return dict(sorted(_FAMILIES.items()))


def family(model_type: str | None) -> Family:
    """The family of ``model_type`` (None: the default family, the one a model built here is saved as)."""
    known = families()
    if model_type is None:
        return next(f for f in known.values() if f.default)
    if model_type not in known:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: {', '.join(known)})")
    return known[model_type]


def supported_phrase() -> str:
    """The families in one phrase, for help texts: "Hugging Face model (model_type ernie4_5, gemma, ...)"."""
    return f"Hugging Face model (model_type {', '.join(families())})"


# ----------------------------------------------------------------------------------------------------
# building blocks the family modules share
# ----------------------------------------------------------------------------------------------------
def canonical_scaling(scaling: Mapping | None) -> dict | None:
    """A RoPE scaling dict in one form: None for default RoPE, else ``rope_type`` naming it (HF's older ``type``
    key folded in) and no ``rope_theta``."""
    if not scaling:
        return None
    scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    scaling.pop("type", None)
    return None if kind == "default" else {"rope_type": kind, **scaling}


def read_rope(r: ConfigReader) -> tuple[float, dict | None, float]:
    """``(rope_theta, rope_scaling or None, partial_rotary_factor)`` from either config style: transformers 5's
    ``rope_parameters`` or 4.x's ``rope_theta`` + ``rope_scaling`` (+ ``partial_rotary_factor``)."""
    params = r.get("rope_parameters", None)
    partial_default = r.family.defaults.get("partial_rotary_factor", 1.0)
    if isinstance(params, dict):
        theta = params.get("rope_theta", r.get("rope_theta"))
        partial = params.get("partial_rotary_factor", r.get("partial_rotary_factor", partial_default))
        scaling = params
        r.ignore("rope_scaling")
    else:
        theta, scaling = r.get("rope_theta"), r.get("rope_scaling", None)
        if scaling is None:  # (absent or null: the class's own scaling where it has one, gpt-oss's YaRN)
            scaling = r.family.defaults.get("rope_scaling")
        partial = r.get("partial_rotary_factor", partial_default)
    return float(theta), canonical_scaling(scaling), float(partial)


def read_rope_by_layer_type(r: ConfigReader, local_theta_key: str | None = None) -> dict:
    """``{"full_attention": (theta, scaling), "sliding_attention": (theta, scaling)}`` for families with a RoPE per
    layer type: transformers 5's per-type ``rope_parameters``, or 4.x's ``rope_theta`` + ``rope_scaling`` (scaling
    on the full layers only) with the sliding layers' base under ``local_theta_key`` (else ``rope_theta``)."""
    params = r.get("rope_parameters", None)
    local_key = local_theta_key or "rope_theta"
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        r.ignore("rope_theta", "rope_scaling", local_key)
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        return {"full_attention": (float(full.get("rope_theta", r.get("rope_theta"))), canonical_scaling(full)),
                "sliding_attention": (float(local.get("rope_theta", r.get(local_key))), canonical_scaling(local))}
    if isinstance(params, dict):  # one dict: the full layers' (transformers 5 with a single rope_parameters)
        r.ignore("rope_scaling")
        theta, scaling = float(params.get("rope_theta", r.get("rope_theta"))), canonical_scaling(params)
    else:
        theta, scaling = float(r.get("rope_theta")), canonical_scaling(r.get("rope_scaling", None))
    local_theta = float(r.get(local_theta_key)) if local_theta_key else theta
    return {"full_attention": (theta, scaling), "sliding_attention": (local_theta, None)}


def read_layer_types(r: ConfigReader, default: Callable[[int], str]) -> list[str]:
    """``layer_types`` (one "sliding_attention" / "full_attention" per layer), else ``default(i)`` per layer."""
    layers = r.get("num_hidden_layers")
    types = r.get("layer_types", None)
    if types is None:
        types = [default(i) for i in range(layers)]
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types={types!r} is not supported: one 'sliding_attention' or 'full_attention' per layer")
    return list(types)


def windows(types: list[str], window) -> dict:
    """The window fields of the layers ``types`` names sliding (a window on each of them)."""
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if not sliding:
        return dict(sliding_window=None, sliding_layers=None)
    if not window:
        raise ValueError(f"sliding_window={window!r} is not supported with sliding layers in layer_types: a window "
                         "needs a size")
    return dict(sliding_window=int(window), sliding_layers=None if len(sliding) == len(types) else sliding)


def read_dropout(r: ConfigReader, *keys: str) -> float:
    """The dropout probability of ``keys`` (all equal: the model records one). Nonzero dropout changes training
    only: the model loads, evaluates and generates exactly, and refuses to train (``ModelConfig.dropout``)."""
    values = {key: float(r.get(key) or 0.0) for key in keys}
    distinct = set(values.values())
    if len(distinct) > 1:
        shown = ", ".join(f"{k}={v}" for k, v in values.items())
        raise ValueError(f"{shown} is not supported: tritonlm records one dropout probability")
    return distinct.pop() if distinct else 0.0


def read_decoder(r: ConfigReader, *, act_key: str | None = "hidden_act", acts=("silu", "swish"),
                 partial_rotary: bool = False, rope: tuple | None = None, d_ff_key: str = "intermediate_size") -> dict:
    """The fields every decoder family reads the same way: sizes, heads (GQA, an explicit ``head_dim``), the norm
    epsilon, tying, RoPE (base, scaling, and the partial rotary factor where ``partial_rotary``; ``rope``: the
    ``(theta, scaling)`` a family read itself), the positions (``context_length`` = ``max_position_embeddings``),
    the activation (one of ``acts``) and the FFN width (``d_ff_key``: a family with only MoE layers names its
    experts' width)."""
    if act_key is not None:  # (None: a family whose FFN ignores the activation key)
        r.require(act_key, acts, f"this family's FFN uses {acts[0]}")
    d_model, heads = r.get("hidden_size"), r.get("num_attention_heads")
    kv_heads = r.get("num_key_value_heads") or heads
    head_dim = r.value_or_default("head_dim")
    theta, scaling, partial = read_rope(r) if rope is None else (*rope, 1.0)
    if not partial_rotary and partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported for this family (RoPE on whole heads)")
    return dict(
        vocab_size=r.get("vocab_size"), context_length=r.get("max_position_embeddings"), d_model=d_model,
        num_layers=r.get("num_hidden_layers"), num_heads=heads, d_ff=r.get(d_ff_key), rope_theta=theta,
        num_kv_heads=None if kv_heads == heads else kv_heads, norm_eps=float(r.get("rms_norm_eps")),
        tie_embeddings=bool(r.get("tie_word_embeddings")), rope_scaling=scaling,
        head_dim=None if head_dim is None or head_dim * heads == d_model else int(head_dim),
        partial_rotary=None if partial == 1.0 else partial)


def write_decoder(cfg: ModelConfig, act: str = "silu", act_key: str = "hidden_act") -> dict:
    """The keys :func:`read_decoder` reads, in transformers 4.x form (5.x reads it too)."""
    return {act_key: act, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads,
            "num_hidden_layers": cfg.num_layers, "head_dim": cfg.d_head, "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.context_length, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
            "rope_scaling": cfg.rope_scaling, "tie_word_embeddings": cfg.tie_embeddings}


def derived_head_dim(r: ConfigReader) -> int:
    """transformers' default ``head_dim``: ``hidden_size // num_attention_heads``."""
    return r.get("hidden_size") // r.get("num_attention_heads")


def read_router_aux_loss(r: ConfigReader) -> dict:
    """The load-balancing term as transformers' MoE causal LMs apply it: ``router_aux_loss_coef`` times the loss,
    added only when ``output_router_logits`` is true (its config classes default it to false, and published configs
    ship it false): ``ModelConfig.router_aux_loss``."""
    return dict(router_aux_loss_coef=float(r.get("router_aux_loss_coef")),
                router_aux_loss=bool(r.get("output_router_logits", False)))


def write_router_aux_loss(cfg: ModelConfig) -> dict:
    """The keys :func:`read_router_aux_loss` reads."""
    return dict(router_aux_loss_coef=cfg.router_aux_loss_coef, output_router_logits=cfg.router_aux_loss)
