"""Generation: sampling (:func:`sample_next`, temperature, top-k, nucleus; it lives with the model in
``tritonlm.modules.sampling``, re-exported here, its public home), text and ids after a prompt, and loading a
model with its tokenizer from a training run's checkpoint or a local Hugging Face directory."""

from __future__ import annotations

from pathlib import Path

import torch

from ._base import TrainError, resolve_device, runnable_backend
from .checkpoint import CHECKPOINT_NAME, read_checkpoint
from .modules import ModelConfig, TransformerLM
from .modules.sampling import sample_next
from .tokenizer import load_tokenizer

__all__ = ["sample_next", "generate_text", "generate_ids", "generate_batch_ids", "continuation_text", "vocab_mismatch",
           "is_hf_model_dir", "load_for_generation", "end_ids", "generation_settings", "encoded_length", "CONSTRAINTS"]


def generate_text(model, tokenizer, prompt: str, max_new_tokens: int, temperature: float = 1.0,
                  top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                  **constraints) -> str:
    """Continue ``prompt``; stops at ``<|endoftext|>``. Returns the new text only."""
    return continuation_text(tokenizer, prompt, generate_ids(model, tokenizer, prompt, max_new_tokens, temperature,
                                                             top_k, top_p, seed, **constraints))


def continuation_text(tokenizer, prompt: str, new_ids: list[int]) -> str:
    """The text ``new_ids`` add after ``prompt``. A SentencePiece tokenizer decodes them after the prompt's ids (alone,
    the space their leading ``▁`` stands for would be stripped as the start of a text); byte-level BPE decodes
    them as they are."""
    if hasattr(tokenizer, "continuation"):
        return tokenizer.continuation(tokenizer.encode(prompt, add_special_tokens=True), new_ids)
    return tokenizer.decode(new_ids)


def generate_ids(model, tokenizer, prompt: str, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 **constraints) -> list[int]:
    """The new token ids after ``prompt`` (up to, not including, ``<|endoftext|>``). The prompt is encoded as
    transformers would (a tokenizer.json's post-processor adds its BOS), and only ids the tokenizer can decode
    are sampled (see :func:`vocab_mismatch`). ``constraints``: ``repetition_penalty``, ``no_repeat_ngram_size``,
    ``min_new_tokens`` (``TransformerLM.generate``)."""
    return generate_batch_ids(model, tokenizer, [prompt], max_new_tokens, temperature, top_k, top_p, seed,
                              batched=False, **constraints)[0]


def encoded_length(tokenizer, prompt: str) -> int:
    """How many tokens ``prompt`` is as generation encodes it."""
    return len(tokenizer.encode(prompt, add_special_tokens=True))


def generate_batch_ids(model, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float = 1.0,
                       top_k: int | None = None, top_p: float | None = None, seed: int | None = None, *,
                       batched: bool = True, page_size: int = 16, **constraints) -> list[list[int]]:
    """:func:`generate_ids` for several prompts at once: with ``batched`` they decode together through a paged KV
    cache (``TransformerLM.generate`` on a list of prompts of different lengths), each stopping on its own."""
    encoded = []
    for i, prompt in enumerate(prompts):
        ids = tokenizer.encode(prompt, add_special_tokens=True)
        where = "the prompt" if len(prompts) == 1 else f"prompt {i + 1}"
        if not ids:
            raise TrainError(f"{where} encodes to no tokens")
        if max(ids) >= model.vocab_size:
            raise TrainError(f"{where} encodes to id {max(ids)}, outside the model's vocabulary of "
                             f"{model.vocab_size}")
        encoded.append(ids)
    device = next(model.parameters()).device
    gen = None
    if seed is not None:
        gen = torch.Generator(device=device).manual_seed(seed)
    eos = end_ids(model, tokenizer)
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    allowed = torch.zeros(model.vocab_size, dtype=torch.bool)
    allowed[[i for i in tokenizer.vocab if 0 <= i < model.vocab_size]] = True
    options = dict(temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos, generator=gen,
                   allowed=None if bool(allowed.all()) else allowed, **constraints)
    if batched:
        outs = model.generate([torch.tensor(ids, device=device) for ids in encoded], max_new_tokens,
                              page_size=page_size, **options)
    else:
        outs = [model.generate(torch.tensor(ids, device=device), max_new_tokens, **options) for ids in encoded]
    results = []
    for ids, out in zip(encoded, outs):
        new = out[len(ids):].tolist()
        stops = [i for i, t in enumerate(new) if t in eos_ids]
        results.append(new[:stops[0]] if stops else new)
    return results


def end_ids(model, tokenizer) -> list[int] | int | None:
    """The id(s) that end a continuation, as transformers' ``generate`` takes them: a Hugging Face model's
    ``generation_config.json`` list (Llama 3 Instruct's ``<|eot_id|>``, Gemma 3's ``<end_of_turn>``), else its
    config.json's ``eos_token_id``; a run of tritonlm's own ends documents with ``<|endoftext|>``."""
    for source in (getattr(model, "generation_config", None), getattr(model, "hf_config", None)):
        eos = (source or {}).get("eos_token_id")
        if eos is not None:
            return eos
    return tokenizer._special_ids.get("<|endoftext|>")


#: the sampling defaults of transformers' GenerationConfig where a generation_config.json leaves them out
HF_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}
#: tritonlm generate's own defaults (a run of tritonlm's, or an HF directory without generation_config.json)
DEFAULTS = {"max_new_tokens": 200, "temperature": 0.8, "top_k": None, "top_p": None}
#: the logits processors a generation_config.json may set that generation applies as transformers does (greedy or
#: sampled alike), with the values that leave decoding as it is
CONSTRAINTS = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_new_tokens": 0}
#: generation_config.json keys that change what transformers' generate decodes and generation does not implement,
#: with their neutral values: any other value is a one-line error naming the key
UNSUPPORTED = {"num_beams": 1, "min_length": 0, "num_beam_groups": 1, "penalty_alpha": None, "typical_p": 1.0, "epsilon_cutoff": 0.0,
               "eta_cutoff": 0.0, "min_p": None, "top_h": None, "bad_words_ids": None, "force_words_ids": None,
               "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
               "forced_eos_token_id": None, "sequence_bias": None, "exponential_decay_length_penalty": None,
               "guidance_scale": None, "renormalize_logits": False, "encoder_repetition_penalty": 1.0,
               "encoder_no_repeat_ngram_size": 0, "no_repeat_ngram_size_per_batch": None, "watermarking_config": None,
               "dola_layers": None, "assistant_model": None, "prompt_lookup_num_tokens": None}


def generation_settings(model, **given) -> tuple[dict, str]:
    """``(settings, source)``: ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p`` from ``given`` (the values a
    user passed; None: not passed), else the model's ``generation_config.json`` (``do_sample`` false: greedy;
    true: its temperature / top-k / top-p, transformers' defaults where it has none; its ``max_new_tokens``),
    else :data:`DEFAULTS`. ``source`` says which in one phrase. The logits processors of :data:`CONSTRAINTS`
    (``repetition_penalty``, ``no_repeat_ngram_size``, ``min_new_tokens``) come from generation_config.json as
    well; a key of :data:`UNSUPPORTED` set to anything but its neutral value is a one-line ``ValueError`` naming
    it."""
    config = getattr(model, "generation_config", None)
    if config is None:
        base, source = {**DEFAULTS, **CONSTRAINTS}, "defaults"
    else:
        base, source = {**DEFAULTS, **CONSTRAINTS}, "generation_config.json"
        for key, neutral in UNSUPPORTED.items():
            if config.get(key) not in (neutral, None, [], {}):
                raise ValueError(f"generation_config.json {key}={config[key]!r} is not supported: tritonlm generate "
                                 "does not decode that way (pass --temperature / --top-k / --top-p, or remove it)")
        for key in CONSTRAINTS:
            if config.get(key) is not None:
                base[key] = config[key]

        if config.get("max_new_tokens") is not None:
            base["max_new_tokens"] = int(config["max_new_tokens"])
        if config.get("do_sample"):
            base.update({k: config.get(k, v) for k, v in HF_SAMPLING_DEFAULTS.items()})
            if base["top_k"] == 0:  # (transformers: 0 turns top-k off)
                base["top_k"] = None
        else:
            base.update(temperature=0.0, top_k=None, top_p=None)  # greedy, as transformers decodes it
    passed = {k: v for k, v in given.items() if v is not None}
    if passed and config is not None:
        flags = ", ".join("--" + k.replace("_", "-") for k in passed)
        source += f" ({flags} given)"
    return {**base, **passed}, source


def vocab_mismatch(model, tokenizer) -> str | None:
    """One line naming how the model's vocabulary and the tokenizer's ids differ, or None when they match.
    Generation never samples an id the tokenizer cannot decode (a vocabulary padded to a multiple of 64/128 is
    common in Hugging Face checkpoints)."""
    ids = set(tokenizer.vocab)
    beyond = sum(1 for i in ids if i >= model.vocab_size)
    holes = model.vocab_size - sum(1 for i in ids if i < model.vocab_size)
    if not beyond and not holes:
        return None
    parts = []
    if holes:
        parts.append(f"{holes} of the model's {model.vocab_size} ids are not in the tokenizer and are never sampled")
    if beyond:
        parts.append(f"{beyond} tokenizer ids are beyond the model's vocabulary")
    return "vocab: " + "; ".join(parts)


def is_hf_model_dir(path) -> bool:
    """A local Hugging Face model directory: config.json and safetensors weights, no tritonlm checkpoint."""
    path = Path(path)
    return (path.is_dir() and (path / "config.json").is_file() and not (path / CHECKPOINT_NAME).exists()
            and any(path.glob("*.safetensors")))


def _load_hf_for_generation(path: Path, device, backend):
    from .hf.checkpoint import from_pretrained

    tokenizer = load_tokenizer(path)  # before the weights: a missing tokenizer.json is found at once
    dev = resolve_device(device)
    backend = runnable_backend(backend, dev)
    try:
        # CPU matmuls are fastest in fp32; on GPUs keep the checkpoint's dtype
        model = from_pretrained(path, backend=backend, device=dev, dtype=torch.float32 if dev.type == "cpu" else None)
    except (ValueError, FileNotFoundError, ImportError) as e:
        raise TrainError(f"{path}: {e}") from None
    model.eval()
    return model, tokenizer


def load_for_generation(checkpoint_dir, device="auto", backend="auto"):
    """``(model, tokenizer)`` from a training output directory (or a checkpoint file inside one), or from a local
    Hugging Face directory of a family in tritonlm.hf.SUPPORTED_MODELS (config.json, safetensors, tokenizer.json)."""
    path = Path(checkpoint_dir)
    if is_hf_model_dir(path):
        return _load_hf_for_generation(path, device, backend)
    ckpt = path / CHECKPOINT_NAME if path.is_dir() else path
    if not ckpt.exists():
        raise TrainError(f"no checkpoint at {ckpt}")
    dev = resolve_device(device)
    backend = runnable_backend(backend, dev)
    try:
        payload = read_checkpoint(ckpt, map_location=dev)
    except Exception as e:  # unpickling errors, truncated zip files, wrong formats: one line, the file named
        raise TrainError(f"{ckpt}: not a readable checkpoint ({type(e).__name__})") from None
    if not isinstance(payload, dict) or "model_config" not in payload or "model" not in payload:
        raise TrainError(f"{ckpt}: has no model_config; generate needs a checkpoint written by `tritonlm train` "
                         "(save_checkpoint() alone stores weights without the model's sizes)")
    mcfg = ModelConfig.from_dict(payload["model_config"])
    model = TransformerLM.from_config(mcfg, device=dev, backend=backend)
    model.load_state_dict(payload["model"])
    model.eval()
    tok_dir = payload.get("tokenizer")
    local = ckpt.parent / "tokenizer"
    if local.is_dir():
        tok_dir = local
    if not tok_dir or not Path(tok_dir).is_dir():
        raise TrainError(f"the checkpoint names no tokenizer directory that exists ({tok_dir})")
    if (Path(tok_dir) / "config.json").is_file():  # fine-tuned with --init-from: the HF directory's token ids
        from .hf.checkpoint import read_generation_config, read_hf_config

        model.hf_config = read_hf_config(tok_dir)
        model.generation_config = read_generation_config(tok_dir)
    return model, load_tokenizer(tok_dir)
