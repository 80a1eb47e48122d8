"""Batches of token windows from a flat token array (a numpy array or ``np.memmap``)."""

from __future__ import annotations

import numpy as np
import torch


def get_batch(dataset, batch_size: int, context_length: int, device="cpu",
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows ``x[batch, context]`` and next-token targets ``y`` (x shifted by one), int64 on
    ``device``. ``dataset`` is a 1-D integer array or memmap; only the sampled windows are read."""
    starts = sample_starts(len(dataset), batch_size, context_length, generator)
    return batch_at(dataset, starts, context_length, device)


def sample_starts(n_tokens: int, batch_size: int, context_length: int,
                  generator: torch.Generator | None = None) -> np.ndarray:
    """Window start offsets, uniform over every window that has a next-token target."""
    if batch_size <= 0 or context_length <= 0:
        raise ValueError("batch_size and context_length must be positive")
    if n_tokens <= context_length:
        raise ValueError(f"dataset has {n_tokens} tokens; a window of context {context_length} needs more "
                         f"than that (context + 1 for the target)")
    return torch.randint(0, n_tokens - context_length, (batch_size,), generator=generator).numpy()


def batch_at(dataset, starts, context_length: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The windows starting at ``starts`` and their targets."""
    if getattr(dataset, "ndim", 1) != 1:
        raise ValueError("dataset must be a 1-D token array")
    if np.issubdtype(np.asarray(dataset[:0]).dtype, np.floating):
        raise TypeError("dataset must hold integer token ids")
    idx = np.asarray(starts)[:, None] + np.arange(context_length + 1)[None, :]
    windows = torch.from_numpy(np.asarray(dataset[idx.ravel()], dtype=np.int64).reshape(idx.shape))
    device = torch.device(device)
    if device.type == "cuda":
        windows = windows.pin_memory().to(device, non_blocking=True)
    else:
        windows = windows.to(device)
    return windows[:, :-1], windows[:, 1:]


def document_ids(token_ids: torch.Tensor, end_of_text_id: int) -> torch.Tensor:
    """``[batch, seq]`` document index of every token of packed documents: an end-of-text token closes its
    document and the next token starts a new one (so the ids are non-decreasing along seq). Feed it to
    ``TransformerLM(..., document_ids=...)``: attention stays within a document, positions restart at 0."""
    if token_ids.dtype.is_floating_point:
        raise TypeError(f"token_ids must be integer, got {token_ids.dtype}")
    ends = (token_ids == end_of_text_id).long()
    return ends.cumsum(dim=-1) - ends
