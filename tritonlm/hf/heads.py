"""Post-training heads on a transformers causal LM: per-token log-probabilities (and entropy) of its tokens from its
hidden states and LM head, the ``[batch, seq, vocab]`` logits never formed (:func:`tritonlm.kernels.linear_log_probs`).
"""

from __future__ import annotations

import torch

from ..kernels import linear_log_probs
from .family import family


def log_probs_from_model(model, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
                         attention_mask: torch.Tensor | None = None, temperature: float = 1.0,
                         return_entropy: bool = False, ignore_index: int = -100, **model_kwargs):
    """``log p(labels[:, t + 1] | input_ids[:, :t + 1])`` for every position ``t < seq - 1`` of a transformers causal
    LM (any family of ``tritonlm.hf.SUPPORTED_MODELS``; its final softcap or logit divisor applied as its forward
    applies it), at ``temperature``: fp32 ``[batch, seq - 1]`` (0 where the label is ``ignore_index``), and the
    entropy beside it with ``return_entropy``; differentiable in the model's parameters. ``labels`` default to
    ``input_ids`` (TRL's ``per_token_logps`` of a prompt and completion). Runs the model's base (``model.model``)
    for the hidden states, then the fused head on ``model.lm_head``; extra keyword arguments go to the base."""
    base = getattr(model, "model", None)
    if base is None or not hasattr(model, "lm_head"):
        raise ValueError(f"log_probs_from_model: expected a transformers causal LM with .model and .lm_head, got "
                         f"{type(model).__name__}")
    if input_ids.dim() != 2 or input_ids.shape[1] < 2:
        raise ValueError(f"log_probs_from_model: input_ids must be [batch, seq] with seq >= 2, got "
                         f"{tuple(input_ids.shape)}")
    labels = input_ids if labels is None else labels
    if labels.shape != input_ids.shape:
        raise ValueError(f"log_probs_from_model: labels {tuple(labels.shape)} must be input_ids' shape "
                         f"{tuple(input_ids.shape)}")
    hidden = base(input_ids=input_ids, attention_mask=attention_mask, **model_kwargs)[0][:, :-1]
    transform = family(model.config.model_type).kernels.logits(model.config)
    divisor = transform.get("divisor")
    if divisor is not None and divisor != 1.0:
        hidden = hidden / divisor  # (logits / s = (hidden / s) W^T)
    return linear_log_probs(hidden, model.lm_head.weight, labels[:, 1:].to(hidden.device),
                            bias=getattr(model.lm_head, "bias", None), temperature=temperature,
                            ignore_index=ignore_index, return_entropy=return_entropy, softcap=transform.get("softcap"))
