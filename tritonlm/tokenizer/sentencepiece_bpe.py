"""SentencePiece-style BPE from a Hugging Face ``tokenizer.json`` (Llama 2, Mistral 7B, Gemma, Phi-3).

Unlike byte-level BPE, the symbols are Unicode characters: spaces become ``▁`` (U+2581), a ``▁`` is put before the
text (SentencePiece's ``add_dummy_prefix``), and a character that is not in the vocabulary is spelled as its UTF-8
bytes with the ``<0xNN>`` tokens (``byte_fallback``; without it, the unknown token). The pipeline steps read from
the file, each checked against the ``tokenizers`` library in tests:

- normalizer: ``Prepend("▁")`` then ``Replace(" ", "▁")`` (Llama 2's legacy form), or ``Replace`` alone, or none;
- pre_tokenizer: none, or ``Metaspace`` (``▁`` for spaces, ``prepend_scheme`` always / first / never, ``split``:
  a word starts at each ``▁``);
- model: BPE merges by rank over the characters of each word (lowest rank first, leftmost first), ``byte_fallback``,
  ``unk_token`` with ``fuse_unk``;
- added tokens, as ``tokenizers`` matches them: those with ``normalized: false`` in the raw text first (longest
  first), each its own id; the text between them is normalized, and those with ``normalized: true`` are matched in
  that normalized text, by their own normalized content (with Llama 2's ``Prepend`` normalizer, ``</s>`` is found
  as ``▁</s>``: ``"a</s>b"`` spells it out); the rest is pre-tokenized and encoded;
- decoder: ``Replace("▁", " ")``, ``ByteFallback`` (a run of ``<0xNN>`` tokens becomes its bytes, or one U+FFFD per
  byte when they are not valid UTF-8), ``Fuse``, ``Strip`` (leading / trailing spaces), or ``Metaspace``.

Unigram and WordPiece models, and steps not listed, are a ``ValueError`` naming them.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

from .pretokenize import _special_splitter

SPACE = "\u2581"  # ▁


def _steps(spec: dict | None, key: str) -> list[dict]:
    if not spec:
        return []
    return list(spec.get(key) or []) if spec.get("type") == "Sequence" else [spec]


class SentencePieceBPE:
    """Encoder/decoder of a SentencePiece-style BPE ``tokenizer.json`` (module docstring). Same interface as
    :class:`tritonlm.tokenizer.Tokenizer` where the rest of the library uses one: ``encode``, ``decode``,
    ``encode_iterable``, ``vocab`` (id -> bytes of the piece), ``vocab_size``, ``special_tokens``, ``template``."""

    #: pre-tokenisation regex (none: the byte-level encoder's chunking by newlines does not apply)
    pattern = None

    def __init__(self, pieces: dict[str, int], merges: list[tuple[str, str]], *, byte_fallback: bool,
                 unk_token: str | None, fuse_unk: bool, prepend: str, split_words: bool, added: dict[str, int],
                 decoder: list[dict], normalized_added: frozenset = frozenset(), normalizer_replace: bool = False):
        self.pieces = dict(pieces)
        self.byte_fallback, self.fuse_unk = byte_fallback, fuse_unk
        self.unk_id = self.pieces.get(unk_token) if unk_token else None
        if unk_token and self.unk_id is None:
            raise ValueError(f"unk_token {unk_token!r} is not in the vocab")
        # where a ▁ goes before a stretch of text: "normalizer" (Prepend: before every non-empty stretch), or
        # Metaspace's "always" / "first" (only the stretch at the start of the text) / "never", added only
        # where the stretch does not start with ▁ already
        self.prepend, self.split_words = prepend, split_words
        self.normalizer_replace = normalizer_replace  # (the normalizer's Replace; else Metaspace replaces)
        self._piece_of = {i: p for p, i in self.pieces.items()}
        for content, i in added.items():
            self._piece_of[i] = content
        self._byte_ids = [self.pieces.get(f"<0x{b:02X}>") for b in range(256)]
        if byte_fallback and None in self._byte_ids:
            raise ValueError("byte_fallback is set but the vocab lacks some <0xNN> byte tokens")
        self._ranks: dict[tuple[int, int], tuple[int, int]] = {}
        for rank, (left, right) in enumerate(merges):
            try:
                key, merged = (self.pieces[left], self.pieces[right]), self.pieces[left + right]
            except KeyError as e:
                raise ValueError(f"merge {rank} {left!r} + {right!r} uses a piece missing from the vocab") from e
            self._ranks.setdefault(key, (rank, merged))
        self.special_tokens = list(added)
        self._special_ids = dict(added)
        # added tokens matched in the raw text, and those matched in the normalized text by their normalized content
        raw = [t for t in added if t not in normalized_added]
        self._normalized_ids = {self._normalize(t): added[t] for t in added if t in normalized_added}
        self._splitter = _special_splitter(raw)
        self._normalized_splitter = _special_splitter(self._normalized_ids)
        self.decoder = decoder
        self.template: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        # bytes of each id's text (what generation's "can this id be decoded" check and vocab sizes read)
        self.vocab = {i: p.replace(SPACE, " ").encode("utf-8") for i, p in self._piece_of.items()}

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def from_spec(cls, file: Path, spec: dict) -> SentencePieceBPE:
        """Build from a parsed tokenizer.json (``file`` names it in errors)."""
        model = spec.get("model") or {}
        for field in ("continuing_subword_prefix", "end_of_word_suffix", "dropout"):
            if model.get(field):
                raise ValueError(f"{file}: model.{field}={model[field]!r} is not supported")
        if model.get("ignore_merges"):
            raise ValueError(f"{file}: model.ignore_merges with a SentencePiece-style BPE is not supported")
        # ---- normalizer: [Prepend(▁)] then Replace(" " -> ▁)
        prepend, replace, normalizer_replace = "never", False, False
        for step in _steps(spec.get("normalizer"), "normalizers"):
            kind = step.get("type")
            if kind == "Prepend" and step.get("prepend") == SPACE and not replace:
                prepend = "normalizer"
            elif kind == "Replace" and (step.get("pattern") or {}).get("String") == " " and step.get("content") == SPACE:
                replace = normalizer_replace = True
            else:
                raise ValueError(f"{file}: normalizer step {kind} {step} is not supported for a SentencePiece BPE")
        # ---- pre_tokenizer: none or Metaspace
        split_words = False
        for step in _steps(spec.get("pre_tokenizer"), "pretokenizers"):
            if step.get("type") != "Metaspace" or step.get("replacement", SPACE) != SPACE:
                raise ValueError(f"{file}: pre_tokenizer step {step.get('type')} is not supported for a "
                                 "SentencePiece BPE (only Metaspace)")
            replace = True
            scheme = step.get("prepend_scheme") or ("always" if step.get("add_prefix_space", True) else "never")
            if scheme not in ("always", "first", "never"):
                raise ValueError(f"{file}: Metaspace prepend_scheme {scheme!r} is not supported")
            if prepend == "normalizer":
                raise ValueError(f"{file}: both a Prepend normalizer and a Metaspace pre_tokenizer")
            prepend = scheme
            split_words = bool(step.get("split", True))
        if not replace:
            raise ValueError(f"{file}: a SentencePiece BPE needs spaces replaced by {SPACE} (Replace or Metaspace)")
        decoder = _steps(spec.get("decoder"), "decoders")
        for step in decoder:
            if step.get("type") not in ("Replace", "ByteFallback", "Fuse", "Strip", "Metaspace"):
                raise ValueError(f"{file}: decoder step {step.get('type')} is not supported")
        added, normalized = {}, set()
        for token in spec.get("added_tokens", []):
            flags = [f for f in ("lstrip", "rstrip", "single_word") if token.get(f)]
            if flags:
                raise ValueError(f"{file}: added token {token['content']!r} sets {', '.join(flags)}: not supported")
            added[token["content"]] = int(token["id"])
            if token.get("normalized", not token.get("special", False)):  # (tokenizers' default)
                normalized.add(token["content"])
        merges = []
        for merge in model.get("merges", []):
            parts = merge.split(" ") if isinstance(merge, str) else list(merge)
            if len(parts) != 2:
                raise ValueError(f"{file}: bad merge {merge!r}")
            merges.append((parts[0], parts[1]))
        return cls(model.get("vocab", {}), merges, byte_fallback=bool(model.get("byte_fallback")),
                   unk_token=model.get("unk_token"), fuse_unk=bool(model.get("fuse_unk")), prepend=prepend,
                   split_words=split_words, added=added, decoder=decoder, normalized_added=frozenset(normalized),
                   normalizer_replace=normalizer_replace)

    # -- encoding ------------------------------------------------------------------------------------
    def _symbols(self, word: str) -> list[int]:
        """The word's characters as ids before any merge: a piece, its UTF-8 bytes (byte fallback) or unk."""
        ids: list[int] = []
        for char in word:
            i = self.pieces.get(char)
            if i is not None:
                ids.append(i)
            elif self.byte_fallback:
                ids.extend(self._byte_ids[b] for b in char.encode("utf-8"))
            elif self.unk_id is None:
                raise ValueError(f"character {char!r} is not in the vocab and there is no unk_token")
            elif not (self.fuse_unk and ids and ids[-1] == self.unk_id):
                ids.append(self.unk_id)
        return ids

    def _bpe(self, word: str) -> list[int]:
        """Merge the word's symbols by rank, lowest first, leftmost on ties (a heap over a linked list)."""
        ids = self._symbols(word)
        ranks, n = self._ranks, len(ids)
        nxt, prv = list(range(1, n)) + [-1], list(range(-1, n - 1))
        heap = [(ranks[p][0], i) for i, p in enumerate(zip(ids, ids[1:])) if p in ranks]
        heapq.heapify(heap)
        while heap:
            rank, i = heapq.heappop(heap)
            j = nxt[i]
            if ids[i] < 0 or j < 0 or ranks.get((ids[i], ids[j]), (None,))[0] != rank:
                continue  # stale: i was merged away or its right neighbour changed
            ids[i], ids[j] = ranks[(ids[i], ids[j])][1], -1
            k = nxt[j]
            nxt[i] = k
            if k >= 0:
                prv[k] = i
                if (ids[i], ids[k]) in ranks:
                    heapq.heappush(heap, (ranks[(ids[i], ids[k])][0], i))
            h = prv[i]
            if h >= 0 and (ids[h], ids[i]) in ranks:
                heapq.heappush(heap, (ranks[(ids[h], ids[i])][0], h))
        return [t for t in ids if t >= 0]

    def _normalize(self, text: str) -> str:
        """The normalizer steps (Prepend ``▁`` to a non-empty text, Replace spaces), as ``tokenizers`` runs them on
        each stretch between raw-matched added tokens (and on a normalized added token's own content)."""
        if not text:
            return text
        if self.prepend == "normalizer":
            text = SPACE + text
        return text.replace(" ", SPACE) if self.normalizer_replace else text

    def _encode_segment(self, text: str, first: bool, out: list[int]) -> None:
        """Normalize one stretch of text between raw-matched added tokens, split it at the normalized added tokens
        it holds, and pre-tokenize and encode the rest (``first``: the stretch starts the text)."""
        text = self._normalize(text)
        pos = 0
        if self._normalized_splitter is not None:
            for m in self._normalized_splitter.finditer(text):
                self._encode_piece(text[pos:m.start()], first and pos == 0, out)
                out.append(self._normalized_ids[m.group()])
                pos = m.end()
        self._encode_piece(text[pos:], first and pos == 0, out)

    def _encode_piece(self, text: str, first: bool, out: list[int]) -> None:
        """The pre-tokenizer (Metaspace: spaces to ``▁``, the prefix ``▁`` by its scheme, words split at ``▁``) and
        the model on a normalized piece (``first``: it starts the text)."""
        if not text:
            return
        text = text.replace(" ", SPACE)
        if (self.prepend == "always" or (self.prepend == "first" and first)) and not text.startswith(SPACE):
            text = SPACE + text
        if self.split_words:  # each word starts at a ▁ (MergedWithNext)
            words = [w for w in re.split(f"(?={SPACE})", text) if w]
        else:
            words = [text]
        for word in words:
            out.extend(self._bpe(word))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` (added tokens become their ids); ``add_special_tokens`` puts the
        post-processor's ids around them (Llama 2's ``<s>``), as transformers' ``tokenizer(text)`` does."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        out: list[int] = []
        pos = 0
        if self._splitter is not None:
            for m in self._splitter.finditer(text):
                self._encode_segment(text[pos:m.start()], pos == 0, out)
                out.append(self._special_ids[m.group()])
                pos = m.end()
        self._encode_segment(text[pos:], pos == 0, out)
        if add_special_tokens:
            before, after = self.template
            out = [*before, *out, *after]
        return out

    def encode_iterable(self, iterable: Iterable[str]) -> Iterator[int]:
        """``encode`` of the concatenation (BPE merges may run across lines, so the text is encoded whole)."""
        yield from self.encode("".join(iterable))

    # -- decoding ------------------------------------------------------------------------------------
    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` through the file's decoder steps."""
        try:
            tokens = [self._piece_of[int(i)] for i in ids]
        except KeyError as e:
            raise ValueError(f"unknown token id {e.args[0]} (vocab has {len(self._piece_of)} tokens)") from None
        for step in self.decoder:
            tokens = _DECODERS[step["type"]](tokens, step)
        return "".join(tokens)

    def continuation(self, prompt_ids: list[int], new_ids: list[int]) -> str:
        """Text that ``new_ids`` add after ``prompt_ids`` (decoding them alone would strip the space a ``▁``
        starting the continuation stands for)."""
        return self.decode([*prompt_ids, *new_ids])[len(self.decode(prompt_ids)):]

    def __len__(self) -> int:
        return len(self._piece_of)

    @property
    def vocab_size(self) -> int:
        return max(self._piece_of) + 1


def _decode_replace(tokens: list[str], step: dict) -> list[str]:
    pattern = (step.get("pattern") or {}).get("String")
    if pattern is None:
        raise ValueError(f"decoder Replace {step} is not supported (only a String pattern)")
    return [t.replace(pattern, step.get("content", "")) for t in tokens]


def _decode_byte_fallback(tokens: list[str], step: dict) -> list[str]:
    out, pending = [], bytearray()
    for t in tokens:
        if len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
            try:
                pending.append(int(t[3:5], 16))
                continue
            except ValueError:
                pass
        if pending:
            out.append(_bytes_text(pending))
            pending = bytearray()
        out.append(t)
    if pending:
        out.append(_bytes_text(pending))
    return out


def _bytes_text(raw: bytearray) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "\ufffd" * len(raw)


def _decode_strip(tokens: list[str], step: dict) -> list[str]:
    content, start, stop = step.get("content", " "), int(step.get("start", 0)), int(step.get("stop", 0))
    out = []
    for t in tokens:
        a = 0
        while a < min(start, len(t)) and t[a] == content:
            a += 1
        b = len(t)
        while len(t) - b < stop and b > a and t[b - 1] == content:
            b -= 1
        out.append(t[a:b])
    return out


def _decode_metaspace(tokens: list[str], step: dict) -> list[str]:
    scheme = step.get("prepend_scheme") or ("always" if step.get("add_prefix_space", True) else "never")
    out = []
    for i, t in enumerate(tokens):
        t = t.replace(step.get("replacement", SPACE), " ")
        if i == 0 and scheme != "never" and t.startswith(" "):
            t = t[1:]
        out.append(t)
    return out


_DECODERS = {"Replace": _decode_replace, "ByteFallback": _decode_byte_fallback,
             "Fuse": lambda tokens, step: ["".join(tokens)], "Strip": _decode_strip, "Metaspace": _decode_metaspace}
