"""Training data: the embedded default corpus, preparing a run's tokens (a tokenizer trained or loaded, the text
tokenised once into a cached ``.npy`` memmap, or a pre-tokenised file), and batches of token windows from a flat
token array (a numpy array or ``np.memmap``)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ._base import TrainError
from .checkpoint import write_text_atomic
from .tokenizer import (
    SPECIAL_TOKENS,
    SPECIAL_TOKENS_FILE,
    Tokenizer,
    encode_file,
    find_tokenizer_files,
    first_invalid_utf8,
    load_tokenizer,
    tokenizer_dir,
    train_bpe,
)


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


def default_corpus_text() -> str:
    """The embedded default corpus: Python's own ``pydoc_data.topics`` texts, in key order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def fingerprint(path: Path) -> str:
    st = path.stat()
    return hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]


def prepare_data(cfg, out: Path, vocab_size: int, say=print):
    """A run's tokens: ``(tokens memmap, tokenizer or None, tokenizer directory or None)``. ``cfg`` is the run's
    ``TrainConfig`` (read: ``data``, ``tokenizer``, ``errors``, ``resume``, ``progress``)."""

    data_dir = out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    if cfg.data is None:
        path = data_dir / "default_corpus.txt"
        if not path.exists():
            write_text_atomic(path, default_corpus_text())
        say(f"data: no --data given, using the embedded default corpus (Python's pydoc_data.topics, "
            f"{path.stat().st_size / 1e6:.2f} MB) -> {path}")
    else:
        path = Path(cfg.data)
        if not path.is_file():
            raise TrainError(f"data file not found: {path}")
        if path.stat().st_size == 0:
            raise TrainError(f"data file is empty: {path}")
        if path.suffix not in (".npy", ".bin") and cfg.errors == "strict":
            bad = first_invalid_utf8(path)
            if bad is not None:
                raise TrainError(f"{path}: not valid UTF-8 at byte {bad:,}; pass --errors replace to read such "
                                 "bytes as U+FFFD")

    if path.suffix in (".npy", ".bin"):
        if path.suffix == ".npy":
            tokens = np.load(path, mmap_mode="r")
        else:
            # raw .bin files carry no dtype: uint16 holds ids of vocabularies up to 65,536, larger ones need uint32
            width = np.uint16 if vocab_size <= 1 << 16 else np.uint32
            if path.stat().st_size % np.dtype(width).itemsize:
                raise TrainError(f"{path}: {path.stat().st_size} bytes is not a whole number of "
                                 f"{np.dtype(width).name} token ids (vocab {vocab_size})")
            tokens = np.memmap(path, dtype=width, mode="r")
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise TrainError(f"{path} must be a flat integer token array")
        tok_dir = tokenizer_dir(cfg.tokenizer) if cfg.tokenizer else None
        tokenizer = load_tokenizer(tok_dir) if tok_dir else None
        say(f"data: {len(tokens):,} pre-tokenised tokens from {path}")
        return tokens, tokenizer, tok_dir

    if cfg.tokenizer:
        tok_dir = tokenizer_dir(cfg.tokenizer)
        tokenizer = load_tokenizer(tok_dir)
        say(f"tokenizer: loaded from {tok_dir} ({tokenizer.vocab_size} ids)")
    else:
        tok_dir = out / "tokenizer"
        stamp = tok_dir / "source.json"
        source = {"data": fingerprint(path), "vocab_size": vocab_size}
        if stamp.exists() and json.loads(stamp.read_text()) == source:
            tokenizer = load_tokenizer(tok_dir)
            say(f"tokenizer: reusing {tok_dir} (trained on this data, vocab {vocab_size})")
        else:
            if cfg.resume and tok_dir.exists():
                raise TrainError(f"--resume: the tokenizer in {tok_dir} was trained on other data or another vocab "
                                 "size; pass the first run's --data and sizes (it is never retrained in place)")
            t0 = time.perf_counter()
            vocab, merges = train_bpe(path, vocab_size, SPECIAL_TOKENS, progress=cfg.progress)
            tokenizer = Tokenizer(vocab, merges, SPECIAL_TOKENS)
            # written beside the old files and renamed over them: a crash never leaves half a tokenizer
            tok_dir.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".tokenizer.", dir=tok_dir))
            try:
                tokenizer.save(staging / "vocab.json", staging / "merges.txt")
                (staging / SPECIAL_TOKENS_FILE).write_text(json.dumps(SPECIAL_TOKENS), encoding="utf-8")
                for name in ("vocab.json", "merges.txt", SPECIAL_TOKENS_FILE):
                    os.replace(staging / name, tok_dir / name)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
            write_text_atomic(stamp, json.dumps(source))
            say(f"tokenizer: trained byte-level BPE, vocab {vocab_size}, in {time.perf_counter() - t0:.1f}s "
                f"-> {tok_dir}")
    # the cache is keyed by the text file and by the tokenizer's own files, so either changing re-encodes
    tok_hash = hashlib.sha1(b"".join(p.read_bytes() for p in find_tokenizer_files(tok_dir))).hexdigest()[:8]
    cache = data_dir / f"tokens-{fingerprint(path)}-{tok_hash}.npy"
    if not cache.exists():
        info = encode_file(tokenizer, path, cache, progress=cfg.progress)
        say(f"data: tokenised {info['bytes'] / 1e6:.2f} MB into {info['tokens']:,} tokens "
            f"({info['bytes'] / max(1, info['tokens']):.2f} bytes/token, {info['bytes'] / 1e6 / info['seconds']:.1f} MB/s) -> {cache}")
    tokens = np.load(cache, mmap_mode="r")
    return tokens, tokenizer, tok_dir


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy (nats) of the empirical token distribution: the loss of the best context-free model."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, len(tokens), 1 << 22):  # 4M tokens at a time: no 8-byte copy of the whole file
        counts += np.bincount(np.asarray(tokens[start:start + (1 << 22)]), minlength=vocab_size)[:vocab_size]
    counts = counts.astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
