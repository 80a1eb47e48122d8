"""BPE training (:func:`train_bpe`): the file is cut into chunks at special tokens (or, without any, at newlines
where cutting cannot change the pre-tokenisation), chunks are pre-tokenised by worker processes with GPT-2's regex
into ``{pre-token: count}``, and merges are found incrementally: a pair -> count table, a pair -> words index and a
max-heap with lazy invalidation, so each merge touches only the words that contain the merged pair. Ties go to the
lexicographically greater pair (as bytes). The result is exactly the naive algorithm's (recount every pair, every
merge)."""

from __future__ import annotations

import heapq
from pathlib import Path

from .pretokenize import count_pretokens_file

Vocab = dict[int, bytes]
Merges = list[tuple[bytes, bytes]]


def _descending_key(token: bytes) -> tuple[int, ...]:
    """A key whose ascending order is the *descending* byte order of tokens: each byte inverted, and a
    terminator larger than any inverted byte so that a prefix sorts after its extensions."""
    return tuple(255 - x for x in token) + (256,)


def train_bpe(input_path, vocab_size: int, special_tokens: list[str] | None = None, *,
              num_workers: int | None = None, progress: bool | None = None,
              chunk_bytes: int | None = None) -> tuple[Vocab, Merges]:
    """Train a byte-level BPE tokenizer on a text file.

    Returns ``(vocab, merges)``: ids 0-255 are the bytes, then ``special_tokens`` in order, then one id
    per merge in creation order. Options: ``num_workers`` pre-tokenisation processes (default: cores),
    ``progress`` bar (default: when stderr is a terminal), ``chunk_bytes`` per pre-tokenisation task
    (default: about two per worker, 256 KB to 4 MB).
    """
    from tqdm.auto import tqdm

    special_tokens = list(special_tokens or [])
    path = Path(input_path)
    if not path.is_file():
        raise FileNotFoundError(f"train_bpe: no such file: {path}")
    n_base = 256 + len(special_tokens)
    if vocab_size < n_base:
        raise ValueError(f"vocab_size {vocab_size} is smaller than 256 bytes + {len(special_tokens)} special tokens")
    if progress is None:
        import sys

        progress = sys.stderr.isatty()

    vocab: Vocab = {i: bytes([i]) for i in range(256)}
    for i, tok in enumerate(special_tokens):
        vocab[256 + i] = tok.encode("utf-8")
    counts = count_pretokens_file(path, special_tokens, num_workers, chunk_bytes, progress)

    # words as lists of token ids, with their frequencies
    words = [list(w) for w in counts]
    freqs = list(counts.values())
    pair_counts: dict[tuple[int, int], int] = {}
    pair_words: dict[tuple[int, int], set[int]] = {}
    for idx, (w, f) in enumerate(zip(words, freqs)):
        for pair in zip(w, w[1:]):
            pair_counts[pair] = pair_counts.get(pair, 0) + f
            pair_words.setdefault(pair, set()).add(idx)
    # max-heap on (count, pair bytes) via heapq's min-heap: negated count, descending byte keys
    keys = {i: _descending_key(t) for i, t in vocab.items()}
    heap = [(-c, keys[a], keys[b], a, b) for (a, b), c in pair_counts.items()]
    heapq.heapify(heap)

    merges: Merges = []
    n_merges = vocab_size - n_base
    bar = tqdm(total=n_merges, desc="merges", unit="merge", disable=not progress)
    while len(merges) < n_merges and heap:
        neg, _, _, a, b = heapq.heappop(heap)
        pair = (a, b)
        if pair_counts.get(pair, 0) != -neg or -neg <= 0:
            continue  # stale entry: the count changed after it was pushed
        new_id = len(vocab)
        vocab[new_id] = vocab[a] + vocab[b]
        keys[new_id] = _descending_key(vocab[new_id])
        merges.append((vocab[a], vocab[b]))
        bar.update()
        delta: dict[tuple[int, int], int] = {}  # net count change per pair over all affected words
        for idx in pair_words.pop(pair, ()):
            w = words[idx]
            # merge every non-overlapping occurrence, left to right
            merged, i, n, hit = [], 0, len(w), False
            while i < n:
                if i + 1 < n and w[i] == a and w[i + 1] == b:
                    merged.append(new_id)
                    i += 2
                    hit = True
                else:
                    merged.append(w[i])
                    i += 1
            if not hit:
                continue  # index entry left over from an earlier merge of this word
            f = freqs[idx]
            for p in zip(w, w[1:]):
                delta[p] = delta.get(p, 0) - f
            for p in zip(merged, merged[1:]):
                delta[p] = delta.get(p, 0) + f
                if p[0] == new_id or p[1] == new_id:
                    pair_words.setdefault(p, set()).add(idx)
            words[idx] = merged
        for p, d in delta.items():
            if d == 0:
                continue
            c = pair_counts.get(p, 0) + d
            if c > 0:
                pair_counts[p] = c
                heapq.heappush(heap, (-c, keys[p[0]], keys[p[1]], p[0], p[1]))
            else:
                pair_counts.pop(p, None)
    bar.close()
    return vocab, merges

