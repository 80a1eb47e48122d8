"""Files to token arrays (:func:`encode_file`, worker processes over chunks cut where the encoding cannot change),
and the UTF-8 check that names the first bad byte of a file."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .encoder import Tokenizer
from .pretokenize import NEWLINE_CUT_PATTERNS, _auto_chunk_bytes, _chunk_boundaries, _pool, _read_chunk


def first_invalid_utf8(path, chunk_bytes: int = 1 << 22) -> int | None:
    """Byte offset of the first invalid UTF-8 sequence in a file (streamed), or None when it all decodes."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    offset = 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(chunk_bytes)
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                # e.start counts into what the decoder held (earlier partial bytes + this chunk)
                return max(0, offset - (len(e.object) - len(chunk)) + e.start)
            if not chunk:
                return None
            offset += len(chunk)




_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(tok: Tokenizer) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tok


def _encode_chunk(args):
    path, start, end, dtype = args

    return np.asarray(_WORKER_TOKENIZER.encode(_read_chunk(path, start, end)), dtype=dtype), end - start


def encode_file(tokenizer: Tokenizer, input_path, output_path, num_workers: int | None = None,
                chunk_bytes: int | None = None, progress: bool = False) -> dict:
    """Encode a text file into a flat ``.npy`` token array (uint16 when the vocab fits, else uint32).

    The file is cut at special tokens / safe newlines (the result equals ``encode`` of the whole text),
    chunks are encoded by ``num_workers`` processes in order and streamed to disk, so memory stays
    bounded by the chunk size. Returns ``{"tokens", "bytes", "seconds", "dtype", "path"}``.
    """
    import tempfile
    import time

    from tqdm.auto import tqdm

    input_path, output_path = Path(input_path), Path(output_path)
    if not input_path.is_file():
        raise FileNotFoundError(f"no such file: {input_path}")
    size = input_path.stat().st_size
    num_workers = num_workers or os.cpu_count() or 1
    chunk_bytes = chunk_bytes or _auto_chunk_bytes(size, num_workers)
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    bounds = _chunk_boundaries(input_path, tokenizer.special_tokens, chunk_bytes,
                               newlines=tokenizer.pattern in NEWLINE_CUT_PATTERNS)
    jobs = [(str(input_path), a, b, dtype) for a, b in zip(bounds, bounds[1:])]
    t0 = time.perf_counter()
    n_tokens = 0
    output_path.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=size, desc="encode", unit="B", unit_scale=True, disable=not progress)
    with tempfile.TemporaryFile(dir=output_path.parent) as raw:
        if num_workers <= 1 or len(jobs) <= 1:
            _init_worker(tokenizer)
            results = map(_encode_chunk, jobs)
            pool = None
        else:
            pool = _pool(num_workers, initializer=_init_worker, initargs=(tokenizer,))
            results = pool.imap(_encode_chunk, jobs)
        try:
            for arr, n_bytes in results:
                raw.write(arr.tobytes())
                n_tokens += len(arr)
                bar.update(n_bytes)
        finally:
            if pool is not None:
                pool.close()
                pool.join()
        bar.close()
        raw.seek(0)
        tmp_out = output_path.with_name(output_path.name + ".tmp")
        with open(tmp_out, "wb") as out:
            header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
                      "shape": (n_tokens,)}
            np.lib.format.write_array_header_1_0(out, header)
            while block := raw.read(1 << 24):
                out.write(block)
        os.replace(tmp_out, output_path)
    seconds = time.perf_counter() - t0
    return {"tokens": n_tokens, "bytes": size, "seconds": seconds, "dtype": np.dtype(dtype).name,
            "path": str(output_path)}


