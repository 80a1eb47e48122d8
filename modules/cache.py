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
        # (values may have a head size of their own: MLA)
        new_k, new_v = k.new_empty((*k.shape[:-2], size, k.shape[-1])), v.new_empty((*v.shape[:-2], size, v.shape[-1]))
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


class RecurrentCache:
    """A Gated DeltaNet layer's state for incremental decoding (what the layer receives as its ``kv_cache``): the
    short convolution's last ``W - 1`` inputs ``conv_state [batch, channels, W - 1]`` and the delta rule's
    ``state [batch, HV, d_k, d_v]`` (fp32). Fixed size whatever the length; ``length`` counts the positions seen."""

    def __init__(self):
        self.length = 0
        self.conv_state: torch.Tensor | None = None
        self.state: torch.Tensor | None = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv_state, self.state) if t is not None)


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


class PagedKVCache:
    """Keys and values of many sequences in fixed-size blocks of one pool per layer (a paged KV cache, as servers
    keep them): ``pool[layer]`` is ``[num_blocks, page_size, kv_heads, d_k]`` (flash-attn's paged layout), and
    sequence ``s`` owns the blocks its table lists, position ``p`` in block ``table[p // page_size]`` at row
    ``p % page_size``. Memory follows the tokens actually cached: a sequence holds ``ceil(length / page_size)``
    blocks, never ``max_seq_len``; the pool grows (doubling) only when no block is free, and :meth:`free`
    returns a finished sequence's blocks for the next one.

    One step of a batch: :meth:`prepare` (the sequences that take part, and how many new positions each adds:
    blocks allocated, their block table and cached lengths as device tensors), one forward through every layer
    (:meth:`layer` gives each attention layer its view; it writes the new keys at the sequences' next positions and
    attends), then :meth:`commit` advances the lengths.
    """

    def __init__(self, num_layers: int, max_len: int, page_size: int = 16, initial_blocks: int = 8):
        if page_size <= 0 or page_size % 16:
            raise ValueError(f"page_size must be a positive multiple of 16 (the attention kernel's tile), got "
                             f"{page_size}")
        self.num_layers, self.max_len, self.page_size = num_layers, max_len, page_size
        self.initial_blocks = max(1, initial_blocks)
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.free_blocks: list[int] = []
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}
        self.active: list[int] = []
        self.new = 0
        self.block_table: torch.Tensor | None = None
        self.cache_seqlens: torch.Tensor | None = None
        self.reserved = 0  # blocks handed out so far (the pools are grown to this on their next write)
        self.peak_blocks = 0  # most blocks held by sequences at once
        # Gated DeltaNet layers: {layer: {sequence: (conv_state, state)}}, fixed size per sequence (no blocks)
        self.recurrent: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    # ---- bookkeeping (host side)
    @property
    def num_blocks(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[0]

    @property
    def blocks_in_use(self) -> int:
        return sum(len(t) for t in self.tables.values())

    def nbytes(self) -> int:
        """Bytes of the pools (keys and values of every layer) and of the recurrent layers' states."""
        states = [t for layer in self.recurrent.values() for pair in layer.values() for t in pair]
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v, *states) if t is not None)

    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} is already in the cache")
        self.tables[seq_id], self.lengths[seq_id] = [], 0

    def free(self, seq_id: int) -> None:
        """Drop a finished sequence: its blocks go back to the free list."""
        self.free_blocks.extend(reversed(self.tables.pop(seq_id)))
        del self.lengths[seq_id]
        for layer in self.recurrent.values():
            layer.pop(seq_id, None)

    def _take_block(self) -> int:
        if not self.free_blocks:  # double the pool (the tensors grow on their next write)
            start = self.reserved
            self.reserved += max(self.initial_blocks, self.reserved)
            self.free_blocks.extend(reversed(range(start, self.reserved)))
        return self.free_blocks.pop()

    def prepare(self, seq_ids: list[int], new: int, device: torch.device) -> None:
        """Get ``seq_ids`` (in batch order) ready to add ``new`` positions each: blocks for them, and the block table
        ``[batch, max_blocks]`` and ``cache_seqlens [batch]`` (int32, on ``device``) the attention reads."""
        for s in seq_ids:
            needed = self.lengths[s] + new
            if needed > self.max_len:
                raise ValueError(f"sequence {s}: {needed} positions exceed the cache's max_len {self.max_len}")
            while len(self.tables[s]) * self.page_size < needed:
                self.tables[s].append(self._take_block())
        self.peak_blocks = max(self.peak_blocks, self.blocks_in_use)
        width = max(1, max(len(self.tables[s]) for s in seq_ids))
        rows = [self.tables[s] + [0] * (width - len(self.tables[s])) for s in seq_ids]  # (padding never read)
        self.block_table = torch.tensor(rows, dtype=torch.int32, device=device)
        self.cache_seqlens = torch.tensor([self.lengths[s] for s in seq_ids], dtype=torch.int32, device=device)
        self.active, self.new = list(seq_ids), new

    def commit(self) -> None:
        """The step's forward has written its positions: advance the lengths."""
        for s in self.active:
            self.lengths[s] += self.new

    @property
    def length(self) -> int:
        """The longest sequence of the step after its new positions (what the model checks against its context)."""
        return max((self.lengths[s] for s in self.active), default=0)

    def positions(self, seq: int) -> torch.Tensor:
        """RoPE positions ``[batch, seq]`` of the step's new tokens: each sequence continues from its own length."""
        return self.cache_seqlens[:, None].long() + torch.arange(seq, device=self.cache_seqlens.device)

    def layer(self, index: int) -> PagedLayerCache:
        return PagedLayerCache(self, index)

    # ---- recurrent layers (Gated DeltaNet): one fixed-size state per sequence
    def recurrent_states(self, index: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer ``index``'s ``(conv_state, state)`` for the step's sequences, stacked in batch order (None when
        every one of them is new; a new one among others starts from zeros)."""
        held = self.recurrent.get(index, {})
        pairs = [held.get(s) for s in self.active]
        if all(p is None for p in pairs):
            return None, None
        like = next(p for p in pairs if p is not None)
        pairs = [p if p is not None else (torch.zeros_like(like[0]), torch.zeros_like(like[1])) for p in pairs]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    def store_recurrent(self, index: int, conv_state: torch.Tensor, state: torch.Tensor) -> None:
        """Keep each of the step's sequences' new ``(conv_state, state)`` (batch order)."""
        held = self.recurrent.setdefault(index, {})
        for row, s in enumerate(self.active):
            held[s] = (conv_state[row], state[row])

    # ---- storage (device side)
    def pools(self, index: int, like: torch.Tensor, like_v: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s key and value pools, allocated (or grown, keeping their contents) to the blocks the
        bookkeeping has handed out; ``like`` (new keys ``[batch, kv_heads, seq, d_k]``) gives dtype and shape, and
        ``like_v`` the values' head size where it differs (MLA)."""
        blocks = max(self.reserved, 1)
        k = self.k[index]
        if k is None or k.shape[0] < blocks:
            d_v = like.shape[-1] if like_v is None else like_v.shape[-1]
            new_k = like.new_zeros((blocks, self.page_size, like.shape[-3], like.shape[-1]))
            new_v = like.new_zeros((blocks, self.page_size, like.shape[-3], d_v))
            if k is not None:
                new_k[:k.shape[0]] = k
                new_v[:k.shape[0]] = self.v[index]
            self.k[index], self.v[index] = new_k, new_v
        return self.k[index], self.v[index]

    def write(self, index: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's new keys / values ``[batch, kv_heads, new, d_k]`` at each sequence's next positions."""
        k_pool, v_pool = self.pools(index, k, v)
        pos = self.positions(k.shape[-2])                                   # [batch, new]
        blocks = self.block_table.long().gather(1, pos // self.page_size)
        rows = pos % self.page_size
        k_pool[blocks, rows] = k.transpose(-3, -2).to(k_pool.dtype)
        v_pool[blocks, rows] = v.transpose(-3, -2).to(v_pool.dtype)

    def gather(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every key / value of the step's sequences, padded: ``[batch, kv_heads, max_keys, d_k]`` and the
        number of keys of each ``[batch]`` (after this step's positions) -- the reference path's view."""
        total = self.cache_seqlens.long() + self.new
        n = int(total.max()) if total.numel() else 0
        pos = torch.arange(n, device=total.device).expand(total.shape[0], n)
        blocks = self.block_table.long().gather(1, (pos // self.page_size).clamp(max=self.block_table.shape[1] - 1))
        keys = self.k[index][blocks, pos % self.page_size].transpose(-3, -2)
        values = self.v[index][blocks, pos % self.page_size].transpose(-3, -2)
        return keys, values, total


class PagedLayerCache:
    """One attention layer's view of a :class:`PagedKVCache` (what the layer receives as its ``kv_cache``)."""

    def __init__(self, cache: PagedKVCache, index: int):
        self.cache, self.index = cache, index

    @property
    def length(self) -> int:
        return self.cache.length

    def positions(self, seq: int) -> torch.Tensor:
        return self.cache.positions(seq)
