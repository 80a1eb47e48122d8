"""Byte-level BPE: a fast trainer and a GPT-2-compatible encoder.

Training (:func:`train_bpe`): the file is cut into chunks at special tokens (or, without any, at
newlines where cutting cannot change the pre-tokenisation), chunks are pre-tokenised by worker
processes with GPT-2's regex into ``{pre-token: count}``, and merges are found incrementally: a pair ->
count table, a pair -> words index and a max-heap with lazy invalidation, so each merge touches only
the words that contain the merged pair. Ties go to the lexicographically greater pair (as bytes). The
result is exactly the naive algorithm's (recount every pair, every merge).

Encoding (:class:`Tokenizer`): special tokens are split out first (longest first when they overlap),
each pre-token is merged by rank (the lowest-rank adjacent pair first, as GPT-2 does) and cached.
``encode_iterable`` streams with bounded memory and yields exactly what ``encode`` would.
"""

from __future__ import annotations

import heapq
import json
import os
import re
import unicodedata
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator
from itertools import chain, repeat
from pathlib import Path

import regex

from ._base import TrainError

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


#: A pair's merge packed in one int, ``rank << 32 | merged id``, so that ``min`` compares plain ints (faster
#: than tuples); a pair with no merge sorts after every real one.
_ID_BITS = 32
_ID_MASK = (1 << _ID_BITS) - 1
_NO_MERGE = 1 << 62

Vocab = dict[int, bytes]
Merges = list[tuple[bytes, bytes]]


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


# ----------------------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------------
# GPT-2 file format
# ----------------------------------------------------------------------------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (printable bytes map to themselves)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_TO_CHAR = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def _to_unicode(token: bytes) -> str:
    return "".join(_BYTE_TO_CHAR[b] for b in token)


def _from_unicode(text: str) -> bytes:
    try:
        return bytes(_CHAR_TO_BYTE[c] for c in text)
    except KeyError:
        return text.encode("utf-8")  # e.g. a special token written literally


# ----------------------------------------------------------------------------------------------------
# encoder
# ----------------------------------------------------------------------------------------------------
#: Pre-tokens longer than this many bytes take the heap merge (:meth:`Tokenizer._bpe_long`); shorter ones the
#: list scan, whose constant factor wins at the lengths real words have.
LONG_PIECE_BYTES = 64


def _hf_pattern(file: Path, pre: dict | None) -> str:
    """The pre-tokenisation regex of a tokenizer.json ``pre_tokenizer``: GPT-2's ``ByteLevel`` (its own regex), or a
    ``Sequence`` of one isolating ``Split`` regex and a regex-free ``ByteLevel`` (Llama 3, Qwen 2)."""
    def bad(why: str):
        return ValueError(f"{file}: pre_tokenizer {why}: only byte-level pre-tokenisers are supported")

    if not pre:
        raise bad("is missing")
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
    byte_level = [p for p in steps if p.get("type") == "ByteLevel"]
    splits = [p for p in steps if p.get("type") == "Split"]
    others = [p.get("type") for p in steps if p.get("type") not in ("ByteLevel", "Split")]
    if others or len(byte_level) != 1 or len(splits) > 1:
        raise bad(f"steps {[p.get('type') for p in steps]}")
    if byte_level[0].get("add_prefix_space"):
        raise bad("ByteLevel.add_prefix_space=true")
    if not splits:
        if not byte_level[0].get("use_regex", True):
            raise bad("ByteLevel without a regex")
        return GPT2_PATTERN
    split = splits[0]
    if byte_level[0].get("use_regex", True):
        raise bad("has both a Split and ByteLevel's own regex")
    regex_text = (split.get("pattern") or {}).get("Regex")
    if regex_text is None or split.get("behavior") != "Isolated" or split.get("invert"):
        raise bad(f"Split {split.get('pattern')} / behavior {split.get('behavior')!r} (needs an isolating Regex)")
    return regex_text


def _hf_normalization(file: Path, norm: dict | None) -> str | None:
    steps = (norm.get("normalizers") if norm.get("type") == "Sequence" else [norm]) if norm else []
    kinds = [n.get("type") for n in steps]
    if not kinds:
        return None
    if kinds == ["NFC"]:
        return "NFC"
    raise ValueError(f"{file}: normalizer {kinds} is not supported (only NFC)")


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


def _fix_surrogates(text: str) -> str:
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


class _PieceCache(dict):
    """pre-token -> token ids; a miss runs BPE. Bounded: when full it starts over (frequent pre-tokens come
    straight back), so memory stays capped whatever the input."""

    def __init__(self, bpe, max_entries: int):
        super().__init__()
        self._bpe = bpe
        self.max_entries = max_entries

    def __missing__(self, piece: str) -> tuple[int, ...]:
        ids = self._bpe(piece)
        if len(self) >= self.max_entries:
            self.clear()
        self[piece] = ids
        return ids


#: Pre-token cache sizes: ``encode`` keeps up to 200K entries (tens of MB at most); a streaming
#: ``encode_iterable`` call keeps its own 2K-entry cache (a few hundred KB), so its memory stays bounded.
ENCODE_CACHE_ENTRIES = 200_000
STREAM_CACHE_ENTRIES = 2_048
#: ``encode_iterable`` gathers this many characters before cutting off what is final.
STREAM_BUFFER_CHARS = 1 << 13


def _hf_template(file: Path, post) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ids a tokenizer.json's post-processor puts before and after a single text: TemplateProcessing's
    ``single`` (Llama 3's ``<|begin_of_text|> $A``), Roberta/Bert's cls ... sep, nothing for ByteLevel; a Sequence
    combines its steps. Other post-processors are a ``ValueError`` naming the type."""
    if not post:
        return (), ()
    kind = post.get("type")
    if kind == "Sequence":
        before, after = [], []
        for step in post.get("processors", []):
            b, a = _hf_template(file, step)
            before, after = before + list(b), list(a) + after
        return tuple(before), tuple(after)
    if kind == "ByteLevel":
        return (), ()
    if kind in ("RobertaProcessing", "BertProcessing"):
        return (int(post["cls"][1]),), (int(post["sep"][1]),)
    if kind == "TemplateProcessing":
        specials = post.get("special_tokens", {})
        before, after, seen_text = [], [], False
        for piece in post.get("single", []):
            if "Sequence" in piece:
                seen_text = True
                continue
            name = piece.get("SpecialToken", {}).get("id")
            if name not in specials:
                raise ValueError(f"{file}: post_processor template names an unknown special token {name!r}")
            (after if seen_text else before).extend(int(i) for i in specials[name]["ids"])
        return tuple(before), tuple(after)
    raise ValueError(f"{file}: post_processor type {kind!r} is not supported")


def _sentencepiece_style(spec: dict) -> bool:
    """A tokenizer.json of SentencePiece-style BPE (Llama 2, Mistral 7B, Gemma, Phi-3): byte fallback, a Metaspace
    pre-tokenizer, or spaces replaced by ``▁`` in the normalizer."""
    if (spec.get("model") or {}).get("byte_fallback"):
        return True
    pre = spec.get("pre_tokenizer") or {}
    norm = spec.get("normalizer") or {}
    steps = (pre.get("pretokenizers") or []) + [pre] + (norm.get("normalizers") or []) + [norm]
    return any(s.get("type") in ("Metaspace", "Prepend") or (s.get("type") == "Replace" and s.get("content") == "\u2581")
               for s in steps if s)


class Tokenizer:
    """Byte-level BPE encoder/decoder over a ``vocab`` (id -> bytes) and ranked ``merges``.

    Defaults are GPT-2's. Tokenizers of other byte-level BPE families (:meth:`from_hf`) set ``pattern`` (the
    pre-tokenisation regex), ``normalization`` (``"NFC"`` or None) and ``ignore_merges`` (a pre-token that is
    itself in the vocab is one token, as Llama 3's tokenizer does).
    """

    def __init__(self, vocab: Vocab, merges: Merges, special_tokens: list[str] | None = None, *,
                 pattern: str | None = None, normalization: str | None = None, ignore_merges: bool = False,
                 special_token_ids: dict[str, int] | None = None):
        if normalization not in (None, "NFC"):
            raise ValueError(f"normalization must be None or 'NFC', got {normalization!r}")
        self.pattern = pattern or GPT2_PATTERN
        # GPT-2's pattern keeps its ASCII fast path; others run as given
        self._pattern = None if self.pattern == GPT2_PATTERN else regex.compile(self.pattern)
        self.normalization, self.ignore_merges = normalization, ignore_merges
        self.vocab: Vocab = dict(vocab)
        self.merges: Merges = list(merges)
        given = list(special_tokens or [])
        if any(not isinstance(t, str) or not t for t in given):
            raise ValueError(f"special tokens must be non-empty strings, got {given!r}")
        self.special_tokens = list(dict.fromkeys(given))
        if len(self.special_tokens) != len(given):
            dupes = sorted({t for t in given if given.count(t) > 1})
            warnings.warn(f"duplicate special tokens removed: {dupes}", stacklevel=2)
        self._id_of: dict[bytes, int] = {}
        for i, tok in self.vocab.items():
            self._id_of.setdefault(tok, i)
        for tok in self.special_tokens:
            raw = tok.encode("utf-8")
            if raw not in self._id_of:
                new_id = max(self.vocab, default=-1) + 1
                self.vocab[new_id] = raw
                self._id_of[raw] = new_id
        missing = [b for b in range(256) if bytes([b]) not in self._id_of]
        if missing:
            raise ValueError(f"vocab lacks single-byte tokens (e.g. {bytes([missing[0]])!r}): not byte-level")
        self._byte_ids = [self._id_of[bytes([b])] for b in range(256)]
        # (left id, right id) -> rank << 32 | merged id
        self._ranks: dict[tuple[int, int], int] = {}
        for rank, (left, right) in enumerate(self.merges):
            try:
                key = (self._id_of[left], self._id_of[right])
                merged = self._id_of[left + right]
            except KeyError as e:
                raise ValueError(f"merge {rank} {left!r} + {right!r} uses a token missing from the vocab") from e
            self._ranks.setdefault(key, rank << _ID_BITS | merged)
        # a special (added) token keeps its own id even when the same bytes are also a vocab entry (HF's
        # add_tokens([" world"]) gives a new id; BPE merges keep using the vocab's)
        own_ids = dict(special_token_ids or {})
        for tok, i in own_ids.items():
            if tok not in self.special_tokens or self.vocab.get(i) != tok.encode("utf-8"):
                raise ValueError(f"special_token_ids: {tok!r} -> {i} is not a special token with that vocab entry")
        self._special_ids = {t: own_ids.get(t, self._id_of[t.encode("utf-8")]) for t in self.special_tokens}
        self._splitter = _special_splitter(self.special_tokens)
        self._cache = _PieceCache(self._bpe, ENCODE_CACHE_ENTRIES)
        #: ids put before and after a text by ``encode(..., add_special_tokens=True)`` (a tokenizer.json's
        #: post-processor, e.g. Llama 3's BOS); none for tokenizers trained here
        self.template: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())

    # -- construction from / to files ------------------------------------------------------------
    @classmethod
    def from_files(cls, vocab_path, merges_path, special_tokens: list[str] | None = None) -> Tokenizer:
        """Load GPT-2's ``vocab.json`` (token string -> id) and ``merges.txt`` (one ``a b`` per line)."""
        with open(vocab_path, encoding="utf-8") as f:
            raw_vocab = json.load(f)
        # special tokens are stored as their own text (save() writes them so), not byte-mapped: a special token
        # with characters in U+00A1-U+00FF would otherwise come back as different bytes and a new id
        specials = set(special_tokens or [])
        vocab = {int(i): (tok.encode("utf-8") if tok in specials else _from_unicode(tok)) for tok, i in raw_vocab.items()}
        merges: Merges = []
        with open(merges_path, encoding="utf-8") as f:
            for line in f:
                line = line.rstrip("\n")
                if not line or line.startswith("#version"):
                    continue
                parts = line.split(" ")
                if len(parts) != 2:
                    raise ValueError(f"bad merges line: {line!r}")
                merges.append((_from_unicode(parts[0]), _from_unicode(parts[1])))
        return cls(vocab, merges, special_tokens)

    @classmethod
    def from_hf(cls, path) -> Tokenizer:
        """A Hugging Face ``tokenizer.json`` (a file, or a directory holding one) of a byte-level BPE tokenizer:
        GPT-2, Llama 3, Qwen 2 and their kin. The pre-tokenisation regex, NFC normalisation, ``ignore_merges``
        and the added tokens (all treated as special tokens: matched first, longest first, each with its own id
        even where its bytes are also a vocab entry) come from the file; ``encode`` equals the ``tokenizers``
        library's ``encode(text, add_special_tokens=False)`` (no BOS is prepended; :meth:`hf_special_ids` tells
        what transformers' tokenizer adds around a prompt).

        A SentencePiece-style BPE (byte fallback, ``▁`` for spaces: Llama 2, Mistral 7B, Gemma, Phi-3) comes back
        as a :class:`~tritonlm.sentencepiece_bpe.SentencePieceBPE` with the same interface. Other tokenizer types
        (Unigram, WordPiece) and pipeline steps neither encoder implements are a ``ValueError`` naming the field.
        """
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        try:
            spec = json.loads(file.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{file}: not a JSON tokenizer file ({type(e).__name__})") from None
        model = spec.get("model") or {}
        kind = model.get("type")
        if kind != "BPE":
            raise ValueError(f"{file}: model.type {kind!r} is not a BPE model (Unigram, WordPiece and WordLevel "
                             "tokenizers are not supported)")
        if _sentencepiece_style(spec):
            from .sentencepiece_bpe import SentencePieceBPE

            tok = SentencePieceBPE.from_spec(file, spec)
            tok.template = _hf_template(file, spec.get("post_processor"))
            return tok
        for field in ("continuing_subword_prefix", "end_of_word_suffix", "dropout"):
            if model.get(field):
                raise ValueError(f"{file}: model.{field}={model[field]!r} is not supported")
        pattern = _hf_pattern(file, spec.get("pre_tokenizer"))
        normalization = _hf_normalization(file, spec.get("normalizer"))
        vocab = {int(i): _from_unicode(tok) for tok, i in model.get("vocab", {}).items()}
        merges: Merges = []
        for merge in model.get("merges", []):
            parts = merge.split(" ") if isinstance(merge, str) else list(merge)
            if len(parts) != 2:
                raise ValueError(f"{file}: bad merge {merge!r}")
            merges.append((_from_unicode(parts[0]), _from_unicode(parts[1])))
        specials, own_ids = [], {}
        for added in spec.get("added_tokens", []):
            flags = [f for f in ("lstrip", "rstrip", "single_word") if added.get(f)]
            if flags:
                raise ValueError(f"{file}: added token {added['content']!r} sets {', '.join(flags)}: not supported")
            vocab[int(added["id"])] = added["content"].encode("utf-8")
            specials.append(added["content"])
            own_ids[added["content"]] = int(added["id"])
        tok = cls(vocab, merges, specials, pattern=pattern, normalization=normalization,
                  ignore_merges=bool(model.get("ignore_merges", False)), special_token_ids=own_ids)
        tok.template = _hf_template(file, spec.get("post_processor"))
        return tok

    def save(self, vocab_path, merges_path) -> None:
        """Write GPT-2's format: ``vocab.json`` and ``merges.txt`` (byte <-> unicode mapped)."""
        if (self.pattern, self.normalization, self.ignore_merges) != (GPT2_PATTERN, None, False):
            raise ValueError("this tokenizer's pre-tokenisation (pattern / normalization / ignore_merges) has no "
                             "place in vocab.json + merges.txt: keep the tokenizer.json it was read from")
        special = {t.encode("utf-8") for t in self.special_tokens}
        out = {(tok.decode("utf-8") if tok in special else _to_unicode(tok)): i for i, tok in self.vocab.items()}
        with open(vocab_path, "w", encoding="utf-8") as f:
            json.dump(out, f, ensure_ascii=False)
        with open(merges_path, "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n")
            for left, right in self.merges:
                f.write(f"{_to_unicode(left)} {_to_unicode(right)}\n")

    # -- encoding ----------------------------------------------------------------------------------
    def _bpe(self, piece: str) -> tuple[int, ...]:
        """Merge one pre-token by rank: repeatedly the lowest-rank adjacent pair, leftmost first.

        Merging occurrences one at a time (leftmost first) equals GPT-2's "all occurrences of the best pair
        per pass": pairs created by a merge always rank after it, so the next-best pair is the same pair
        until its occurrences are used up. Only the two neighbouring pair ranks change per merge.
        """
        raw = piece.encode("utf-8")
        if self.ignore_merges and raw in self._id_of:
            return (self._id_of[raw],)
        ids = list(map(self._byte_ids.__getitem__, raw))
        if len(ids) < 2:
            return tuple(ids)
        if len(ids) > LONG_PIECE_BYTES:
            return self._bpe_long(ids)
        ranks, none = self._ranks, _NO_MERGE
        pair_ranks = list(map(ranks.get, zip(ids, ids[1:]), repeat(none)))
        while pair_ranks:
            best = min(pair_ranks)
            if best is none:
                break
            i = pair_ranks.index(best)
            ids[i] = best & _ID_MASK
            del ids[i + 1]
            del pair_ranks[i]
            if i < len(pair_ranks):
                pair_ranks[i] = ranks.get((ids[i], ids[i + 1]), none)
            if i > 0:
                pair_ranks[i - 1] = ranks.get((ids[i - 1], ids[i]), none)
        return tuple(ids)

    def _bpe_long(self, ids: list[int]) -> tuple[int, ...]:
        """The same merges in O(n log n) for long pre-tokens (minified code, base64, 80K 'x's): a heap of
        (rank, position) pairs over a linked list of symbols. Entries made stale by a neighbouring merge are
        recognised on pop (the pair at that position no longer has that rank) and skipped."""
        ranks, n = self._ranks, len(ids)
        nxt = list(range(1, n)) + [-1]
        prv = list(range(-1, n - 1))
        heap = [(r, i) for i, r in enumerate(map(ranks.get, zip(ids, ids[1:]))) if r is not None]
        heapq.heapify(heap)
        while heap:
            r, i = heapq.heappop(heap)
            j = nxt[i]
            if j < 0 or ranks.get((ids[i], ids[j])) != r:
                continue  # stale: i was merged away, or its right neighbour changed
            # ---- merge symbol j into i and unlink j
            ids[i] = r & _ID_MASK
            ids[j] = -1
            k = nxt[j]
            nxt[i] = k
            if k >= 0:
                prv[k] = i
                r_right = ranks.get((ids[i], ids[k]))
                if r_right is not None:
                    heapq.heappush(heap, (r_right, i))
            h = prv[i]
            if h >= 0:
                r_left = ranks.get((ids[h], ids[i]))
                if r_left is not None:
                    heapq.heappush(heap, (r_left, h))
        return tuple(t for t in ids if t >= 0)

    def _split(self, text: str, start: int = 0, end: int | None = None) -> list[str]:
        """Pre-tokens of ``text[start:end]`` (the pattern sees ``end`` as the end of the string)."""
        if self._pattern is None:
            return _pretokens(text, start, end)
        return self._pattern.findall(text, start, len(text) if end is None else end)

    def _encode_ordinary(self, text: str, out: list[int], cache: _PieceCache) -> None:
        if self.normalization:
            text = unicodedata.normalize(self.normalization, text)
        # the lookups run in C (map over the cache's __getitem__); only unseen pre-tokens reach Python
        out.extend(chain.from_iterable(map(cache.__getitem__, self._split(text))))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` (special tokens become their single ids). ``add_special_tokens=True`` also puts
        the :attr:`template` ids around them (a Hugging Face tokenizer.json's post-processor: its BOS), as
        transformers' ``tokenizer(text).input_ids`` does."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        try:
            ids = self._encode_with(text, self._cache)
        except UnicodeEncodeError:
            # surrogates (not encodable as UTF-8), as tiktoken handles them: a valid pair becomes its character,
            # a lone one U+FFFD
            ids = self._encode_with(_fix_surrogates(text), self._cache)
        if add_special_tokens:
            before, after = self.template
            ids = [*before, *ids, *after]
        return ids

    def _encode_with(self, text: str, cache: _PieceCache) -> list[int]:
        out: list[int] = []
        if self._splitter is None:
            self._encode_ordinary(text, out, cache)
            return out
        pos = 0
        for m in self._splitter.finditer(text):
            self._encode_ordinary(text[pos:m.start()], out, cache)
            out.append(self._special_ids[m.group()])
            pos = m.end()
        self._encode_ordinary(text[pos:], out, cache)
        return out

    def _safe_cut(self, buf: str) -> tuple[int, list[str]]:
        """How much of ``buf`` can be encoded now, whatever text follows it: ``(seg_start, pieces)`` where
        ``buf[:seg_start]`` ends with a special token (or is empty) and ``pieces`` are the final
        pre-tokens after it. The pieces are returned rather than re-split, because a prefix split on its
        own would let its last pre-token see the end of the string (``"\n\nOnce"`` is ``\n``, ``\n``,
        ``Once``, but ``"\n\n"`` alone is one pre-token).

        Held back: a tail that may still grow into a special token, and the last two pre-tokens of the
        text after the last special token. The last one may grow or split; the one before it may merge
        with it (``we'l`` + ``l`` must become `` we``, ``'ll``). Earlier pre-tokens are final: every
        alternative of the pattern is decided within the next two characters (contractions are at most
        three long, greedy runs stop at a character that is present, the whitespace lookahead sees one).
        """
        # 1. the earliest position from which the tail could still grow into a special token
        limit = len(buf)
        longest = max((len(t) for t in self.special_tokens), default=0)
        for p in range(max(0, len(buf) - longest + 1), len(buf)):
            tail = buf[p:]
            if any(len(t) > len(tail) and t.startswith(tail) for t in self.special_tokens):
                limit = p
                break
        # 2. special tokens matched in the whole buffer (as encode would); one that runs past the limit is
        #    itself undecided, so the limit moves to its start
        seg_start = 0
        if self._splitter is not None:
            for m in self._splitter.finditer(buf):
                if m.start() >= limit:
                    break
                if m.end() > limit:
                    limit = m.start()
                    break
                seg_start = m.end()
        pieces = self._split(buf, seg_start, limit)
        return seg_start, pieces[:-2]

    def encode_iterable(self, iterable: Iterable[str]) -> Iterator[int]:
        """Stream token ids for an iterable of strings (e.g. an open text file); identical to ``encode``
        on the concatenation, with memory bounded by the longest pre-token and a small private pre-token
        cache, not by the input."""
        cache = _PieceCache(self._bpe, STREAM_CACHE_ENTRIES)
        buf = ""
        for chunk in iterable:
            if not isinstance(chunk, str):
                raise TypeError(f"encode_iterable expects strings, got {type(chunk).__name__}")
            buf += chunk
            if self.normalization:  # the held-back tail is renormalised with what follows it
                buf = unicodedata.normalize(self.normalization, buf)
            if len(buf) < STREAM_BUFFER_CHARS:
                continue  # cutting costs a regex pass over the buffer: do it per ~8K characters
            seg_start, pieces = self._safe_cut(buf)
            if seg_start:
                yield from self._encode_with(buf[:seg_start], cache)
            cut = seg_start
            for piece in pieces:
                yield from cache[piece]
                cut += len(piece)
            buf = buf[cut:]
        if buf:
            yield from self._encode_with(buf, cache)

    # -- decoding ----------------------------------------------------------------------------------
    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; invalid UTF-8 sequences become U+FFFD."""
        try:
            raw = b"".join(self.vocab[int(i)] for i in ids)
        except KeyError as e:
            raise ValueError(f"unknown token id {e.args[0]} (vocab has {len(self.vocab)} tokens)") from None
        return raw.decode("utf-8", errors="replace")

    def __len__(self) -> int:
        return len(self.vocab)

    @property
    def vocab_size(self) -> int:
        return max(self.vocab) + 1

    def compression_ratio(self, text: str) -> float:
        """UTF-8 bytes per token."""
        n = len(self.encode(text))
        return len(text.encode("utf-8")) / max(1, n)


# ----------------------------------------------------------------------------------------------------
# files -> token arrays
# ----------------------------------------------------------------------------------------------------
_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(tok: Tokenizer) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tok


def _encode_chunk(args):
    path, start, end, dtype = args
    import numpy as np

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

    import numpy as np
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


# ----------------------------------------------------------------------------------------------------
# tokenizer directories: which files define one, and loading it
# ----------------------------------------------------------------------------------------------------
#: The special tokens ``tritonlm train`` trains a tokenizer with (documents end with it).
SPECIAL_TOKENS = ["<|endoftext|>"]


def find_tokenizer_files(location) -> tuple[Path, ...]:
    """The files that define a tokenizer directory: a Hugging Face ``tokenizer.json``, else ``vocab.json`` and
    ``merges.txt`` (or GPT-2's ``*vocab.json``/``*merges.txt``)."""
    loc = Path(location)
    if loc.is_file() and loc.name == HF_TOKENIZER_FILE:  # a tokenizer.json named directly
        return (loc,)
    if not loc.is_dir():
        raise TrainError(f"tokenizer not found: {loc} (a directory, or its tokenizer.json)")
    if (loc / HF_TOKENIZER_FILE).is_file():
        return (loc / HF_TOKENIZER_FILE,)
    vocab = sorted(loc.glob("*vocab.json"))
    merges = sorted(loc.glob("*merges.txt"))
    if len(vocab) != 1 or len(merges) != 1:
        raise TrainError(f"{loc} must hold a tokenizer.json, or exactly one *vocab.json and one *merges.txt")
    return vocab[0], merges[0]


def tokenizer_dir(location) -> Path:
    """The tokenizer directory of ``--tokenizer``: the directory itself, or the one holding a tokenizer.json
    named directly (so checkpoints and resumes record a directory)."""
    loc = Path(location)
    find_tokenizer_files(loc)  # a one-line error now when there is no tokenizer there
    return loc.parent if loc.is_file() else loc


SPECIAL_TOKENS_FILE = "special_tokens.json"
HF_TOKENIZER_FILE = "tokenizer.json"


def read_special_tokens(location) -> list[str]:
    """The special tokens a tokenizer directory was trained with (``special_tokens.json``, written beside
    vocab.json by ``tritonlm train`` / ``tritonlm tokenize``); ``<|endoftext|>`` for directories without one
    (GPT-2's own files)."""
    path = Path(location) / SPECIAL_TOKENS_FILE
    if not path.exists():
        return list(SPECIAL_TOKENS)
    try:
        tokens = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise TrainError(f"{path}: not a JSON list of special tokens ({type(e).__name__})") from None
    if not isinstance(tokens, list) or not all(isinstance(t, str) and t for t in tokens):
        raise TrainError(f"{path}: must be a JSON list of non-empty strings")
    return tokens


def load_tokenizer(location) -> Tokenizer:
    """The tokenizer of a directory (or a tokenizer.json named directly): a Hugging Face tokenizer.json, or
    vocab.json + merges.txt with the directory's special tokens."""
    files = find_tokenizer_files(location)
    if files[0].name == HF_TOKENIZER_FILE:
        try:
            return Tokenizer.from_hf(files[0])
        except ValueError as e:
            raise TrainError(str(e)) from None
    vocab, merges = files
    specials = read_special_tokens(location)
    try:
        return Tokenizer.from_files(vocab, merges, specials)
    except (ValueError, KeyError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
        raise TrainError(f"tokenizer {vocab} / {merges} is not a GPT-2 vocab.json + merges.txt pair: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
