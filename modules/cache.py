"""Per-forward state that is not a parameter: the KV cache of incremental decoding and the packed-document map.

Both are shared by the reference and fused components (and by the one model assembly), so they live below both.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of past positions for incremental decoding, one per attention layer.

    Storage ``[batch.., heads, capacity, d_k]`` grows with use (doubling, never past ``max_len``), so a model with a
    131072-position context that generates a few tokens holds a few positions, not its whole context;
    :meth:`update` appends and returns views of everything cached so far (a strided slice, no copy). ``reserve``
    sizes the first allocation when the caller knows how many positions it will need (prompt + new tokens).
    """

    def __init__(self, max_len: int, reserve: int | None = None):
        self.max_len = max_len
        self.reserve = max_len if reserve is None else max(1, min(int(reserve), max_len))
        self.length = 0
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def capacity(self) -> int:
        return 0 if self.k is None else self.k.shape[-2]

    def _grow(self, k: torch.Tensor, v: torch.Tensor, needed: int) -> None:
        size = min(self.max_len, max(needed, self.reserve if self.k is None else 2 * self.capacity))
        shape = (*k.shape[:-2], size, k.shape[-1])
        new_k, new_v = k.new_empty(shape), v.new_empty(shape)
        if self.k is not None:
            new_k[..., :self.length, :] = self.k[..., :self.length, :]
            new_v[..., :self.length, :] = self.v[..., :self.length, :]
        self.k, self.v = new_k, new_v

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n_new = k.shape[-2]
        if self.length + n_new > self.max_len:
            raise ValueError(f"KV cache holds at most {self.max_len} positions; "
                             f"{self.length} cached + {n_new} new exceeds it")
        if self.length + n_new > self.capacity:
            self._grow(k, v, self.length + n_new)
        self.k[..., self.length:self.length + n_new, :] = k
        self.v[..., self.length:self.length + n_new, :] = v
        self.length += n_new
        return self.k[..., :self.length, :], self.v[..., :self.length, :]


class Documents:
    """Packed documents of a ``[batch, seq]`` batch: ``ids[batch, seq]``, non-decreasing along seq. A token attends
    only to earlier tokens of its own document, and RoPE positions restart at 0 per document.

    Derived once per forward and shared by every layer: ``positions`` (``[batch, seq]``, position within the
    document), the block-diagonal causal ``mask()`` (the reference path), and for the fused path the
    documents as packed sequences of the flattened batch: int32 ``cu_seqlens`` and ``max_len``.
    """

    def __init__(self, ids: torch.Tensor):
        if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"document_ids must be integer [batch, seq], got {ids.dtype} {tuple(ids.shape)}")
        if ids.shape[-1] > 1 and bool((ids[:, 1:] < ids[:, :-1]).any()):
            raise ValueError("document_ids must be non-decreasing along the sequence")
        self.ids = ids
        batch, seq = ids.shape
        index = torch.arange(seq, device=ids.device).expand(batch, seq)
        starts = torch.ones_like(ids, dtype=torch.bool)
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
        # position = index - index of the document's first token (a running max of the start indices)
        first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
        self.positions = index - first
        flat_starts = starts.reshape(-1).nonzero().squeeze(-1)
        bounds = torch.cat([flat_starts, flat_starts.new_tensor([batch * seq])])
        self.cu_seqlens = bounds.to(torch.int32)
        self.max_len = int((bounds[1:] - bounds[:-1]).max()) if batch * seq else 0

    def mask(self) -> torch.Tensor:
        """``[batch, 1, seq, seq]`` boolean: same document and not in the future (True = attend)."""
        same = self.ids[:, :, None] == self.ids[:, None, :]
        seq = self.ids.shape[-1]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=self.ids.device).tril()
        return (same & causal)[:, None]
