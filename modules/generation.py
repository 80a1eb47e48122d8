"""Generation: the sampling loop over a :class:`~tritonlm.modules.model.TransformerLM`, dense (one batch, one cache
per layer) or ragged (prompts of different lengths sharing one paged KV cache).

The model's :meth:`~tritonlm.modules.model.TransformerLM.generate` is this module's :func:`generate`; the loop only
calls the model's ``forward`` and ``new_kv_caches``, so it never names a layer part.
"""

from __future__ import annotations

import torch

from .cache import PagedKVCache
from .sampling import constrain_logits, sample_next


@torch.no_grad()
def generate(model, prompt_ids, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, eos_id: int | list[int] | None = None,
             generator: torch.Generator | None = None,
             use_cache: bool = True, allowed: torch.Tensor | None = None, page_size: int = 16, *,
             repetition_penalty: float | None = None, no_repeat_ngram_size: int | None = None,
             min_new_tokens: int = 0):
    """Sample up to ``max_new_tokens`` after ``prompt_ids`` (``[seq]`` or ``[batch, seq]``; or a list of prompts
    of different lengths, see below).

    ``temperature=0`` is greedy; ``top_k`` keeps the k most likely tokens; ``top_p`` the smallest set
    whose probability reaches p. Stops early when every row has produced ``eos_id`` (one id, or a list of
    ids any of which ends a row, as Hugging Face configs give them; a finished row repeats it). Returns the
    prompt followed by the new tokens, same rank as the prompt. With ``use_cache`` each new token costs
    one incremental forward against a KV cache, sized for prompt + ``max_new_tokens`` (never the whole
    context up front). Prompt + ``max_new_tokens`` must fit ``context_length`` (a one-line error otherwise: the
    positions past it are ones the model never saw). ``allowed`` (bool ``[vocab]``): only ids marked True are
    ever sampled, e.g. the ones a tokenizer can decode when the model's vocabulary is padded past it (as Hugging
    Face checkpoints often are). ``repetition_penalty``, ``no_repeat_ngram_size`` and ``min_new_tokens`` (which
    bans ``eos_id`` until that many tokens are new) are transformers' logits processors of the same names
    (:func:`~tritonlm.modules.sampling.constrain_logits`), applied before the temperature.

    Ragged batches: ``prompt_ids`` a list of 1-D prompts (lists or tensors) of any lengths returns a list of
    1-D tensors, each prompt followed by its own continuation. Their keys and values live in one paged KV cache
    (:class:`~tritonlm.modules.cache.PagedKVCache`, ``page_size`` positions per block): each prompt is prefilled on
    its own, then every unfinished sequence advances one token per batched step, each attending only to its own
    positions. A sequence stops on its own (``eos_id`` or ``max_new_tokens``) and frees its blocks at once.
    Greedy decoding gives each prompt exactly the tokens it gets alone.
    """
    if repetition_penalty is not None and not repetition_penalty > 0:
        raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
    if no_repeat_ngram_size is not None and (isinstance(no_repeat_ngram_size, bool) or no_repeat_ngram_size < 0):
        raise ValueError(f"no_repeat_ngram_size must be >= 0, got {no_repeat_ngram_size}")
    if min_new_tokens < 0:
        raise ValueError(f"min_new_tokens must be >= 0, got {min_new_tokens}")
    eos_list = [] if eos_id is None else [int(e) for e in torch.as_tensor(eos_id).reshape(-1).tolist()]
    constraints = dict(repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
                       min_new_tokens=min_new_tokens, eos_ids=eos_list)
    constrained = bool(repetition_penalty not in (None, 1.0) or no_repeat_ngram_size or min_new_tokens)
    if isinstance(prompt_ids, (list, tuple)) and prompt_ids and not isinstance(prompt_ids[0], int):
        return _generate_ragged(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, eos_id, generator,
                                     allowed, page_size, constraints if constrained else None)
    ids = torch.as_tensor(prompt_ids, device=model.lm_head.weight.device)
    squeeze = ids.dim() == 1
    if squeeze:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[-1] == 0:
        raise ValueError(f"prompt_ids must be a non-empty [seq] or [batch, seq], got {tuple(ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError("max_new_tokens must be >= 0")
    if ids.shape[-1] + max_new_tokens > model.context_length:
        raise ValueError(f"the prompt's {ids.shape[-1]} tokens + max_new_tokens {max_new_tokens} exceed "
                         f"context_length {model.context_length}")
    if allowed is not None:
        allowed = torch.as_tensor(allowed, dtype=torch.bool, device=ids.device)
        if allowed.shape != (model.vocab_size,) or not bool(allowed.any()):
            raise ValueError(f"allowed must be a bool [{model.vocab_size}] mask with at least one True, got "
                             f"{tuple(allowed.shape)}")
    was_training = model.training
    model.eval()
    try:
        done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        eos = None if eos_id is None else torch.as_tensor(eos_id, device=ids.device).reshape(-1)
        caches, pending = None, ids
        for step in range(max_new_tokens):
            if not use_cache:
                logits = model(ids)[:, -1]
            else:
                if caches is None:
                    caches = model.new_kv_caches(reserve=ids.shape[-1] + max_new_tokens)
                logits = model(pending, kv_caches=caches)[:, -1]
            if allowed is not None:
                logits = logits.masked_fill(~allowed, float("-inf"))
            if constrained:
                logits = constrain_logits(logits, ids, [step] * ids.shape[0], **constraints)
            nxt = sample_next(logits, temperature, top_k, top_p, generator)
            if eos is not None:
                nxt = torch.where(done, eos[0], nxt)
                done |= torch.isin(nxt, eos)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
            pending = nxt[:, None]
            if eos is not None and bool(done.all()):
                break
    finally:
        model.train(was_training)
    return ids[0] if squeeze else ids


def _generate_ragged(model, prompts, max_new_tokens: int, temperature: float, top_k, top_p, eos_id, generator,
                     allowed, page_size: int, constraints: dict | None = None) -> list[torch.Tensor]:
    """:func:`generate` for a list of prompts of different lengths, through a paged KV cache (its docstring)."""
    device = model.lm_head.weight.device
    prompts = [torch.as_tensor(p, device=device).long() for p in prompts]
    for i, p in enumerate(prompts):
        if p.dim() != 1 or p.numel() == 0:
            raise ValueError(f"prompt {i} must be a non-empty 1-D sequence of ids, got shape {tuple(p.shape)}")
        if p.numel() + max_new_tokens > model.context_length:
            raise ValueError(f"prompt {i}'s {p.numel()} tokens + max_new_tokens {max_new_tokens} exceed "
                             f"context_length {model.context_length}")
    if max_new_tokens < 0:
        raise ValueError("max_new_tokens must be >= 0")
    if allowed is not None:
        allowed = torch.as_tensor(allowed, dtype=torch.bool, device=device)
        if allowed.shape != (model.vocab_size,) or not bool(allowed.any()):
            raise ValueError(f"allowed must be a bool [{model.vocab_size}] mask with at least one True")
    eos = set() if eos_id is None else {int(e) for e in torch.as_tensor(eos_id).reshape(-1).tolist()}
    outputs = [p.tolist() for p in prompts]
    if max_new_tokens == 0:
        return [torch.tensor(o, device=device) for o in outputs]
    cache = PagedKVCache(len(model.layers), model.context_length, page_size)
    layers = [cache.layer(i) for i in range(len(model.layers))]

    def step(seq_ids: list[int], tokens: torch.Tensor) -> list[int]:
        cache.prepare(seq_ids, tokens.shape[-1], device)
        logits = model(tokens, kv_caches=layers)[:, -1]
        cache.commit()
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        if constraints is not None:  # (each row's tokens so far: its prompt and what it generated)
            logits = constrain_logits(logits, [outputs[i] for i in seq_ids],
                                      [len(outputs[i]) - len(prompts[i]) for i in seq_ids], **constraints)
        return sample_next(logits, temperature, top_k, top_p, generator).tolist()

    was_training = model.training
    model.eval()
    try:
        active = []
        for i, p in enumerate(prompts):  # prefill: one prompt at a time, its last logits give its first token
            cache.add_sequence(i)
            outputs[i].append(step([i], p[None])[0])
            active.append(i)
        generated = dict.fromkeys(active, 1)
        while True:
            for i in list(active):  # sequences that are done leave the batch and free their blocks
                if generated[i] >= max_new_tokens or outputs[i][-1] in eos:
                    active.remove(i)
                    cache.free(i)
            if not active:
                break
            last = torch.tensor([[outputs[i][-1]] for i in active], device=device)
            for i, token in zip(active, step(active, last)):
                outputs[i].append(token)
                generated[i] += 1
    finally:
        model.train(was_training)
    # what the cache held (the cache itself is dropped here: its pools are freed with it)
    model.last_generation_cache = dict(page_size=page_size, pool_blocks=cache.reserved,
                                      peak_blocks_in_use=cache.peak_blocks, pool_bytes=cache.nbytes())
    return [torch.tensor(o, device=device) for o in outputs]
