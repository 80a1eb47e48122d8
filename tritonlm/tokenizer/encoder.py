"""The encoder (:class:`Tokenizer`): special tokens are split out first (longest first when they overlap), each
pre-token is merged by rank (the lowest-rank adjacent pair first, as GPT-2 does) and cached. ``encode_iterable``
streams with bounded memory and yields exactly what ``encode`` would."""

from __future__ import annotations

import heapq
import json
import unicodedata
import warnings
from collections.abc import Iterable, Iterator
from itertools import chain, repeat
from pathlib import Path

import regex

from .gpt2_format import _from_unicode, _to_unicode
from .hf_json import _hf_normalization, _hf_pattern, _hf_template, _sentencepiece_style
from .pretokenize import GPT2_PATTERN, _pretokens, _special_splitter
from .training import Merges, Vocab

#: A pair's merge packed in one int, ``rank << 32 | merged id``, so that ``min`` compares plain ints (faster
#: than tuples); a pair with no merge sorts after every real one.
_ID_BITS = 32
_ID_MASK = (1 << _ID_BITS) - 1
_NO_MERGE = 1 << 62


#: Pre-tokens longer than this many bytes take the heap merge (:meth:`Tokenizer._bpe_long`); shorter ones the
#: list scan, whose constant factor wins at the lengths real words have.
LONG_PIECE_BYTES = 64



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



class Tokenizer:
    """Byte-level BPE encoder/decoder over a ``vocab`` (id -> bytes) and ranked ``merges``.

    Defaults are GPT-2's. Tokenizers of other byte-level BPE families (:meth:`from_hf`) set ``pattern`` (the
    pre-tokenisation regex), ``normalization`` (``"NFC"`` or None) and ``ignore_merges`` (a pre-token that is
    itself in the vocab is one token, as Llama 3's tokenizer does).
    """

    def __init__(self, vocab: Vocab, merges: Merges, special_tokens: list[str] | None = None, *,
                 pattern: str | None = None, normalization: str | None = None, ignore_merges: bool = False,
                 special_token_ids: dict[str, int] | None = None, normalized_tokens: Iterable[str] = ()):
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
        # added tokens a tokenizer.json marks normalized: matched in the normalized text by their normalized content,
        # as the tokenizers library does (without a normalizer that is the raw text: one splitter does both)
        normalized = set(normalized_tokens) & set(self.special_tokens) if normalization else set()
        self._normalized_ids = {unicodedata.normalize(normalization, t): self._special_ids[t] for t in normalized}
        self._splitter = _special_splitter([t for t in self.special_tokens if t not in normalized])
        self._normalized_splitter = _special_splitter(self._normalized_ids)
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
        and the added tokens (matched before the pre-tokenizer, longest first, each with its own id even where its
        bytes are also a vocab entry; those the file marks ``normalized`` in the normalized text, as the tokenizers
        library does) come from the file; ``encode`` equals the ``tokenizers`` library's ``encode(text,
        add_special_tokens=False)`` (no BOS is prepended; ``encode(text, add_special_tokens=True)`` puts the
        post-processor's ids around it, as transformers' tokenizer does: :attr:`template`).

        A SentencePiece-style BPE (byte fallback, ``▁`` for spaces: Llama 2, Mistral 7B, Gemma, Phi-3) comes back
        as a :class:`~tritonlm.tokenizer.sentencepiece_bpe.SentencePieceBPE` with the same interface. Other tokenizer types
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
        specials, own_ids, normalized = [], {}, []
        for added in spec.get("added_tokens", []):
            flags = [f for f in ("lstrip", "rstrip", "single_word") if added.get(f)]
            if flags:
                raise ValueError(f"{file}: added token {added['content']!r} sets {', '.join(flags)}: not supported")
            vocab[int(added["id"])] = added["content"].encode("utf-8")
            specials.append(added["content"])
            own_ids[added["content"]] = int(added["id"])
            if added.get("normalized", not added.get("special", False)):  # (tokenizers' default)
                normalized.append(added["content"])
        tok = cls(vocab, merges, specials, pattern=pattern, normalization=normalization,
                  ignore_merges=bool(model.get("ignore_merges", False)), special_token_ids=own_ids,
                  normalized_tokens=normalized)
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
        pos = 0
        if self._normalized_splitter is not None:  # the normalized added tokens, in the normalized text
            for m in self._normalized_splitter.finditer(text):
                out.extend(chain.from_iterable(map(cache.__getitem__, self._split(text[pos:m.start()]))))
                out.append(self._normalized_ids[m.group()])
                pos = m.end()
        # the lookups run in C (map over the cache's __getitem__); only unseen pre-tokens reach Python
        out.extend(chain.from_iterable(map(cache.__getitem__, self._split(text[pos:] if pos else text))))

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
        if self._normalized_splitter is not None:
            # (added tokens matched after normalisation: the text is encoded whole, as encode would)
            yield from self.encode("".join(iterable))
            return
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


