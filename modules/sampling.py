"""Sampling: temperature, top-k and nucleus (top-p) filtering over next-token logits."""

from __future__ import annotations

import torch


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token id per row of ``logits[batch, vocab]`` -> ``[batch]`` (long).

    ``temperature == 0`` takes the argmax. ``top_k`` keeps the k largest logits; ``top_p`` keeps the
    smallest prefix of tokens, by descending probability, whose mass reaches ``top_p`` (the top token is
    always kept).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k <= 0:
        raise ValueError(f"top_k must be positive, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # mass strictly before each token: a token is dropped once the tokens ahead of it reach top_p
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def constrain_logits(logits: torch.Tensor, sequences, new_tokens: list[int], *,
                     repetition_penalty: float | None = None, no_repeat_ngram_size: int | None = None,
                     min_new_tokens: int = 0, eos_ids=()) -> torch.Tensor:
    """The logits processors of transformers' ``generate`` that a generation_config.json may set, applied to the
    next-token ``logits[rows, vocab]`` of rows whose tokens so far (prompt and continuation) are ``sequences`` (a
    ``[rows, seq]`` tensor, or one 1-D tensor per row) and which have generated ``new_tokens[row]`` tokens:

    * ``repetition_penalty`` p (CTRL's): the logit z of every token already in the row becomes z / p if z > 0,
      else z · p;
    * ``no_repeat_ngram_size`` n: a token that would complete an n-gram the row already holds is banned;
    * ``min_new_tokens`` m: while a row has fewer than m new tokens, its end-of-sequence ids are banned.

    Banned tokens get -inf. Returns fp32 logits (a new tensor; ``logits`` is left as it is)."""
    logits = logits.float().clone()
    rows = [sequences[i] for i in range(logits.shape[0])]
    if repetition_penalty is not None and repetition_penalty != 1.0:
        for i, seq in enumerate(rows):
            seen = torch.unique(torch.as_tensor(seq, device=logits.device).long())
            z = logits[i, seen]
            logits[i, seen] = torch.where(z > 0, z / repetition_penalty, z * repetition_penalty)
    if no_repeat_ngram_size:
        n = no_repeat_ngram_size
        for i, seq in enumerate(rows):
            tokens = torch.as_tensor(seq).tolist()
            if len(tokens) + 1 < n:
                continue
            prefix = tuple(tokens[len(tokens) - n + 1:]) if n > 1 else ()
            # every n-gram of the row whose first n - 1 tokens are the row's last n - 1: its last token is banned
            banned = {tokens[j + n - 1] for j in range(len(tokens) - n + 1) if tuple(tokens[j:j + n - 1]) == prefix}
            if banned:
                logits[i, sorted(banned)] = float("-inf")
    if min_new_tokens and len(eos_ids):
        eos = torch.as_tensor(list(eos_ids), device=logits.device).long()
        for i, made in enumerate(new_tokens):
            if made < min_new_tokens:
                logits[i, eos] = float("-inf")
    return logits
