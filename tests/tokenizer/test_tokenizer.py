"""Byte-level BPE: trainer exactness against a naive trainer, GPT-2/tiktoken equivalence, streaming."""

import json
import random
from collections import Counter

import numpy as np
import pytest
import regex

from tritonlm.tokenizer import GPT2_PATTERN, Tokenizer, encode_file, train_bpe

pytestmark = pytest.mark.usefixtures("stream_cut_every_chunk")


SEED_TEXT = "low low low low low lower lower widest widest widest newest newest newest newest newest newest"


def naive_train_bpe(text: str, vocab_size: int, special_tokens: list[str]):
    """The textbook algorithm: recount every pair of every word at every merge."""
    pieces = regex.split("|".join(regex.escape(t) for t in special_tokens), text) if special_tokens else [text]
    words = Counter()
    for piece in pieces:
        for m in regex.finditer(GPT2_PATTERN, piece):
            words[tuple(bytes([b]) for b in m.group().encode("utf-8"))] += 1
    merges = []
    while 256 + len(special_tokens) + len(merges) < vocab_size:
        pairs = Counter()
        for w, f in words.items():
            for p in zip(w, w[1:]):
                pairs[p] += f
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(best)
        new_words = Counter()
        for w, f in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] += f
        words = new_words
    return merges


def test_seed_example_first_merges(tmp_path):
    path = tmp_path / "seed.txt"
    path.write_text(SEED_TEXT)
    vocab, merges = train_bpe(path, 256 + 1 + 6, ["<|endoftext|>"])
    assert merges[:2] == [(b"s", b"t"), (b"e", b"st")]
    assert vocab[256] == b"<|endoftext|>" and vocab[257] == b"st" and vocab[258] == b"est"
    assert all(vocab[i] == bytes([i]) for i in range(256))


def test_matches_naive_trainer_including_ties(tmp_path):
    rng = random.Random(0)
    words = ["a", "ab", "ba", "aaa", "abab", " the", "ünï", "日本", "🙂", "x1", "  ", "\n"]
    text = "".join(rng.choice(words) + rng.choice([" ", "", "\n"]) for _ in range(3000))
    text = text.replace("ab\n", "ab<|endoftext|>")
    path = tmp_path / "mixed.txt"
    path.write_text(text, encoding="utf-8")
    want = naive_train_bpe(text, 340, ["<|endoftext|>"])
    for workers, chunk in ((1, None), (2, 2000)):
        vocab, merges = train_bpe(path, 340, ["<|endoftext|>"], num_workers=workers, chunk_bytes=chunk)
        assert merges == want
        assert len(vocab) == 256 + 1 + len(want)
        assert not any(b"<|" in m[0] + m[1] and b"endoftext" in m[0] + m[1] for m in merges)


def test_matches_naive_on_shared_corpus(shared_data):
    text = (shared_data / "tinystories_sample.txt").read_text(encoding="utf-8")
    vocab, merges = train_bpe(shared_data / "tinystories_sample.txt", 400, ["<|endoftext|>"])
    assert merges == naive_train_bpe(text, 400, ["<|endoftext|>"])


def test_train_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError):
        train_bpe(tmp_path / "missing.txt", 300, [])
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(tmp_path / "x.txt", 200, [])


@pytest.fixture(scope="module")
def gpt2(request):
    from helpers import SHARED_DATA

    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not present")
    return Tokenizer.from_files(SHARED_DATA / "gpt2_vocab.json", SHARED_DATA / "gpt2_merges.txt",
                                ["<|endoftext|>"])


@pytest.fixture(scope="module")
def tiktoken_gpt2(gpt2):  # (gpt2: skips without ../shared/data)
    """tiktoken's GPT-2 encoding built offline with tiktoken's own GPT-2 pre-tokenisation pattern (r50k), not
    this project's. Its ranks are vocab.json's ids (tiktoken's file loader rejects this copy of the files on a
    consistency assert), so the only shared step is GPT-2's byte <-> unicode mapping of the vocab keys."""
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken_ext.openai_public import r50k_pat_str

    ranks = {tok: i for i, tok in gpt2.vocab.items() if tok != b"<|endoftext|>"}
    return tiktoken.Encoding("gpt2-offline", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256})


TEXTS = ["", "Hello, world!", "héllo 你好世界 🙂🙂🙂 Größe über  \n\n  x\t\t", "   leading and trailing   ",
         "we'll they've I'M can't 1234567 3.14", "<|endoftext|>", "a<|endoftext|>b<|endoftext|><|endoftext|>",
         "\r\n\r\n\u00a0\u2028 mixed\u3000whitespace", "ﬁne ligature and emoji 👩‍👩‍👧"]


@pytest.mark.parametrize("text", TEXTS)
def test_gpt2_files_equal_tiktoken(gpt2, tiktoken_gpt2, text):
    ids = gpt2.encode(text)
    assert ids == tiktoken_gpt2.encode(text, allowed_special="all")
    assert gpt2.decode(ids) == text


def test_gpt2_equal_tiktoken_on_corpus(gpt2, tiktoken_gpt2, shared_data):
    text = (shared_data / "tinyshakespeare.txt").read_text(encoding="utf-8")[:200_000]
    assert gpt2.encode(text) == tiktoken_gpt2.encode(text)


def test_overlapping_special_tokens_longest_first():
    vocab = {i: bytes([i]) for i in range(256)}
    tok = Tokenizer(vocab, [], ["<|a|>", "<|a|><|a|>"])
    ids = tok.encode("x<|a|><|a|>y<|a|>")
    assert ids == [ord("x"), 257, ord("y"), 256]
    assert tok.decode(ids) == "x<|a|><|a|>y<|a|>"


def test_streaming_equals_encode(gpt2, shared_data):
    text = (shared_data / "tinystories_sample.txt").read_text(encoding="utf-8") + TEXTS[2] + " <|endoft"
    want = gpt2.encode(text)
    rng = random.Random(1)
    for size in (1, 2, 3, 7, 100):
        assert list(gpt2.encode_iterable(text[i:i + size] for i in range(0, len(text), size))) == want
    for _ in range(10):
        cuts = sorted(rng.sample(range(1, len(text)), 40))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert list(gpt2.encode_iterable(chunks)) == want


def test_streaming_memory_is_bounded(gpt2, shared_data):
    import tracemalloc

    line = (shared_data / "tinyshakespeare.txt").read_text(encoding="utf-8")[:5000]

    def repeated():
        for _ in range(400):  # 2 MB of text, never held at once
            yield line

    def distinct_words():
        # ~0.3 MB of ~45K distinct words: a pre-token cache that kept them all would need ~10 MB
        import random

        rng = random.Random(0)
        for _ in range(300):
            yield " ".join("".join(rng.choice("abcdefghijklmnop") for _ in range(6)) for _ in range(150)) + "\n"

    for stream in (repeated, distinct_words):
        tracemalloc.start()
        count = sum(1 for _ in gpt2.encode_iterable(stream()))
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert count > 0 and peak < 1_000_000, (stream.__name__, peak)


def test_round_trip_save_and_reload(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text(SEED_TEXT + " ünïcödé 日本語 <|endoftext|> more", encoding="utf-8")
    vocab, merges = train_bpe(path, 300, ["<|endoftext|>"])
    tok = Tokenizer(vocab, merges, ["<|endoftext|>"])
    tok.save(tmp_path / "vocab.json", tmp_path / "merges.txt")
    again = Tokenizer.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt", ["<|endoftext|>"])
    assert again.vocab == tok.vocab and again.merges == tok.merges
    text = "lowest newer <|endoftext|> 日本"
    assert again.encode(text) == tok.encode(text)
    assert json.loads((tmp_path / "vocab.json").read_text(encoding="utf-8"))["<|endoftext|>"] == 256


def test_decode_errors_and_replacement():
    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [])
    assert tok.decode([0xE6, 0x97]) == "\ufffd"  # truncated UTF-8 sequence
    with pytest.raises(ValueError, match="unknown token id 999"):
        tok.decode([999])
    with pytest.raises(TypeError):
        tok.encode(b"bytes")


def test_encode_file_matches_encode(tmp_path):
    text = ("First line\nSecond line<|endoftext|>Third\n\n  indented\nend" * 300)
    src = tmp_path / "in.txt"
    src.write_text(text, encoding="utf-8")
    vocab, merges = train_bpe(src, 330, ["<|endoftext|>"])  # no ../shared needed: a tokenizer of this text
    tok = Tokenizer(vocab, merges, ["<|endoftext|>"])
    for workers in (1, 2):
        info = encode_file(tok, src, tmp_path / "out.npy", num_workers=workers, chunk_bytes=1000)
        arr = np.load(tmp_path / "out.npy", mmap_mode="r")
        assert arr.dtype == np.uint16 and info["tokens"] == len(arr)
        assert arr.tolist() == tok.encode(text)


def test_streaming_with_default_buffering_equals_encode(gpt2, shared_data):
    import tritonlm.tokenizer.encoder as T  # (the module whose constant encode_iterable reads)

    text = (shared_data / "tinyshakespeare.txt").read_text(encoding="utf-8")[:60_000] + "<|endoftext|> end"
    saved, T.STREAM_BUFFER_CHARS = T.STREAM_BUFFER_CHARS, 8192
    try:
        lines = text.splitlines(keepends=True)
        assert list(gpt2.encode_iterable(lines)) == gpt2.encode(text)
    finally:
        T.STREAM_BUFFER_CHARS = saved


# ----------------------------------------------------------------------------------------------------
# worst cases: very long pre-tokens, surrogates, special tokens that round-trip
# ----------------------------------------------------------------------------------------------------
def _naive_bpe(tok, piece: str) -> list[int]:
    """Textbook BPE on one pre-token: repeatedly merge the lowest-rank adjacent pair (leftmost), from scratch."""
    parts = [bytes([b]) for b in piece.encode("utf-8")]
    rank = {pair: r for r, pair in enumerate(tok.merges)}
    while True:
        pairs = [(rank[(a, b)], i) for i, (a, b) in enumerate(zip(parts, parts[1:])) if (a, b) in rank]
        if not pairs:
            break
        _, i = min(pairs)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return [tok._id_of[p] for p in parts]


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "t.txt"
    path.write_text("the quick brown fox jumps over the lazy dog xxxx yyyy aaaa abab " * 60
                     + "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo0NTY3ODkrLw== " * 30)
    vocab, merges = train_bpe(path, 420, ["<|endoftext|>"])
    return Tokenizer(vocab, merges, ["<|endoftext|>"])


def test_long_pieces_heap_merge_equals_textbook_bpe(small_tokenizer):
    """Pre-tokens over LONG_PIECE_BYTES take the heap merge; it must equal the from-scratch algorithm."""
    from tritonlm import tokenizer as T

    rng = random.Random(0)
    alphabet = "xyabQUJDREVG0123=+/ "
    for n in (T.LONG_PIECE_BYTES + 1, 100, 333, 1000):
        piece = "".join(rng.choice(alphabet.strip()) for _ in range(n))
        assert list(small_tokenizer._bpe(piece)) == _naive_bpe(small_tokenizer, piece)
    assert list(small_tokenizer._bpe("x" * 5000)) == _naive_bpe(small_tokenizer, "x" * 5000)


def test_very_long_pretokens_match_tiktoken(gpt2, tiktoken_gpt2):
    """80K 'x' (one pre-token) and base64 / minified lines: equal to tiktoken (quadratic merging took 36 s)."""
    import base64

    rng = random.Random(1)
    blob = base64.b64encode(bytes(rng.randrange(256) for _ in range(30_000))).decode()
    minified = "var a=function(b){return b*2};" * 500
    for text in ("x" * 80_000, blob, minified):
        assert gpt2.encode(text) == tiktoken_gpt2.encode(text)


def test_surrogates_handled_like_tiktoken(gpt2, tiktoken_gpt2):
    for text in ("a\ud800b", "\ud83d\ude00 ok", "end \udfff"):
        assert gpt2.encode(text) == tiktoken_gpt2.encode(text)
    assert gpt2.encode("\ud83d\ude00") == gpt2.encode("😀")  # a valid pair is its character


def test_special_tokens_with_latin1_characters_survive_save_and_reload(small_tokenizer, tmp_path):
    specials = ["<|endoftext|>", "<|café|>", "«sep»"]
    tok = Tokenizer(small_tokenizer.vocab, small_tokenizer.merges, specials)
    tok.save(tmp_path / "vocab.json", tmp_path / "merges.txt")
    again = Tokenizer.from_files(tmp_path / "vocab.json", tmp_path / "merges.txt", specials)
    assert again._special_ids == tok._special_ids and len(again) == len(tok)
    text = "the fox<|café|>«sep» lazy dog<|endoftext|>"
    assert again.encode(text) == tok.encode(text) and again.decode(again.encode(text)) == text


def test_empty_and_duplicate_special_tokens(small_tokenizer):
    with pytest.raises(ValueError, match="non-empty"):
        Tokenizer(small_tokenizer.vocab, small_tokenizer.merges, ["<|endoftext|>", ""])
    with pytest.warns(UserWarning, match="duplicate special tokens removed"):
        tok = Tokenizer(small_tokenizer.vocab, small_tokenizer.merges, ["<|a|>", "<|a|>"])
    assert tok.special_tokens == ["<|a|>"]
