"""Pre-tokenisation: GPT-2's pattern (and Llama 3's / Qwen 2's), a fast ASCII path in blocks, special tokens split
out first, and the chunking that lets worker processes count a file's pre-tokens in parallel."""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import regex

#: GPT-2's pre-tokenisation pattern.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
#: Llama 3's and Qwen 2's patterns (as their tokenizer.json files give them): numbers in runs of at most three
#: digits (Qwen 2: one), one leading non-letter joined to a word, newlines grouped with preceding whitespace.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
#: Patterns under which a newline between two printable ASCII characters is a safe place to cut a file (see
#: ``_SAFE_NEWLINE_BYTES``): no alternative runs across such a newline into the next line. Other patterns are
#: cut at special tokens only.
NEWLINE_CUT_PATTERNS = (GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN)
_PRETOKEN = regex.compile(GPT2_PATTERN)
#: The same pattern for ASCII-only text, for the stdlib's ``re``, which runs it faster than ``regex`` runs
#: GPT-2's: on ASCII, ``\p{L}`` is ``[A-Za-z]``, ``\p{N}`` is ``[0-9]`` and ``\s`` (Unicode White_Space) is
#: ``[\t\n\v\f\r ]`` -- not ``re``'s own ``\s``, which also takes ``\x1c``-``\x1f``.
_WS = r"\t\n\v\f\r "
_PRETOKEN_ASCII = re.compile(
    rf"'(?:[sdmt]|ll|ve|re)| ?[A-Za-z]+| ?[0-9]+| ?[^{_WS}A-Za-z0-9]+|[{_WS}]+(?![^{_WS}])|[{_WS}]+")


#: Text with some non-ASCII characters is pre-tokenised in blocks of about this many characters, cut where no
#: pre-token can change, so that its ASCII blocks still take the fast pattern.
PRETOKEN_BLOCK_CHARS = 1 << 14


def _pretokens(text: str, start: int = 0, end: int | None = None) -> list[str]:
    """GPT-2's pre-tokens of ``text[start:end]``; as with ``findall``'s ``endpos``, the pattern sees ``end`` as
    the end of the string."""
    end = len(text) if end is None else end
    if text.isascii():  # O(1) in CPython
        return _PRETOKEN_ASCII.findall(text, start, end)
    pieces: list[str] = []
    while start < end:
        cut = _block_cut(text, start + PRETOKEN_BLOCK_CHARS, end)
        pattern = _PRETOKEN_ASCII if text[start:cut].isascii() else _PRETOKEN
        pieces += pattern.findall(text, start, cut)
        start = cut
    return pieces


def _block_cut(text: str, pos: int, end: int) -> int:
    r"""The first position from ``pos`` on where ``text[:end]`` can be split without changing its pre-tokens
    (else ``end``): just after a newline whose two neighbours are surely not whitespace (letters, digits,
    visible ASCII). That newline is a pre-token of its own either way (``\s+(?!\S)`` fails before the next
    character, ``\s+`` takes it; at the end of the first part the former takes it), no other pre-token
    touches the cut, and the pattern has no lookbehind."""
    if pos >= end:
        return end
    i = text.find("\n", pos, end - 1)
    while i != -1:
        if _solid(text[i - 1]) and _solid(text[i + 1]):
            return i + 1
        i = text.find("\n", i + 1, end - 1)
    return end


def _solid(char: str) -> bool:
    """Not whitespace under any definition (Unicode White_Space, ``str.isspace``)."""
    return char.isalnum() or "!" <= char <= "~"




# ----------------------------------------------------------------------------------------------------
# pre-tokenisation
# ----------------------------------------------------------------------------------------------------
def _special_splitter(special_tokens: Iterable[str]):
    """A regex that finds special tokens, longest first so that overlapping ones resolve to the longest."""
    tokens = sorted(set(special_tokens), key=len, reverse=True)
    if not tokens:
        return None
    return regex.compile("|".join(regex.escape(t) for t in tokens))


def _count_pretokens(text: str, special_tokens: list[str]) -> Counter:
    """``{pre-token bytes: count}`` of ``text`` with special tokens removed (never merged across)."""
    counts: Counter = Counter()
    splitter = _special_splitter(special_tokens)
    pieces = splitter.split(text) if splitter else [text]
    for piece in pieces:
        # count the strings (in C), then encode each distinct one once
        for pretoken, n in Counter(_pretokens(piece)).items():
            counts[pretoken.encode("utf-8")] += n
    return counts


#: A newline between two printable ASCII (non-space) bytes: cutting the text right after it cannot change
#: how the regex splits either side (no whitespace run or optional leading space crosses it). ASCII only,
#: because a byte >= 0x80 may belong to a multi-byte whitespace character such as U+00A0.
_SAFE_NEWLINE_BYTES = regex.compile(rb"(?<=[\x21-\x7e])\n(?=[\x21-\x7e])")


def _next_cut(f, pos: int, size: int, specials: list[bytes], window: int = 1 << 16, newlines: bool = True) -> int:
    """The first safe cut at or after byte ``pos``: the start of a special token, or where the text has
    none nearby, just after a safe newline (when ``newlines``); ``size`` if neither occurs before the end."""
    longest = max((len(s) for s in specials), default=0)
    while pos < size:
        f.seek(pos)
        buf = f.read(window + longest)
        hits = [i for i in (buf.find(s) for s in specials) if 0 <= i < window]
        if hits:
            return pos + min(hits)
        m = _SAFE_NEWLINE_BYTES.search(buf, 1, min(len(buf), window + 1)) if newlines else None
        if m:
            return pos + m.end()
        pos += window
    return size


def _chunk_boundaries(path: Path, special_tokens: list[str], target_bytes: int, newlines: bool = True) -> list[int]:
    """Byte offsets cutting the file into chunks of about ``target_bytes`` at safe places
    (:func:`_next_cut`; newlines only when ``newlines``). Reads the file in windows only."""
    size = path.stat().st_size
    specials = [t.encode("utf-8") for t in special_tokens]
    bounds = [0]
    with open(path, "rb") as f:
        while bounds[-1] + target_bytes < size:
            cut = _next_cut(f, bounds[-1] + target_bytes, size, specials, newlines=newlines)
            if cut >= size:
                break
            bounds.append(cut)
    bounds.append(size)
    return bounds


def _read_chunk(path, start: int, end: int) -> str:
    """Bytes ``[start, end)`` of a file as text (chunk bounds sit on safe cuts; bad bytes become U+FFFD: the
    command line checks UTF-8 up front unless asked to replace)."""
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(end - start).decode("utf-8", errors="replace")


def _count_chunk(args) -> Counter:
    path, start, end, special_tokens = args
    return _count_pretokens(_read_chunk(path, start, end), special_tokens)


def _pool(num_workers: int, initializer=None, initargs=()):
    """A worker pool (fork where the platform has it: workers inherit the tokenizer without pickling it)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    return ctx.Pool(num_workers, initializer=initializer, initargs=initargs)


def _auto_chunk_bytes(size: int, num_workers: int) -> int:
    """About two chunks per worker, between 256 KB and 4 MB (memory per worker stays bounded)."""
    return max(256 << 10, min(4 << 20, size // max(1, 2 * num_workers)))


def count_pretokens_file(path, special_tokens: list[str], num_workers: int | None = None,
                         chunk_bytes: int | None = None, progress: bool = False) -> Counter:
    """Pre-token counts of a whole file, chunk by chunk in ``num_workers`` processes."""
    from tqdm.auto import tqdm

    path = Path(path)
    if chunk_bytes is None:
        chunk_bytes = _auto_chunk_bytes(path.stat().st_size, num_workers or os.cpu_count() or 1)
    bounds = _chunk_boundaries(path, special_tokens, chunk_bytes)
    jobs = [(str(path), a, b, special_tokens) for a, b in zip(bounds, bounds[1:])]
    num_workers = num_workers or min(len(jobs), os.cpu_count() or 1)
    counts: Counter = Counter()
    bar = tqdm(total=len(jobs), desc="pre-tokenise", unit="chunk", disable=not progress)
    if num_workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            counts.update(_count_chunk(job))
            bar.update()
    else:
        with _pool(num_workers) as pool:
            for part in pool.imap_unordered(_count_chunk, jobs):
                counts.update(part)
                bar.update()
    bar.close()
    return counts


