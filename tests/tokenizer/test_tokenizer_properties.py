"""Property tests (hypothesis): round trips and streaming equivalence on arbitrary text and chunkings."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tritonlm.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("stream_cut_every_chunk")


ALPHABET = st.sampled_from(list("ab c\n\t  'sll日本🙂é<|>endoftx0123.,!") + ["<|endoftext|>", "we'll", "\r\n"])
TEXT = st.lists(ALPHABET, max_size=60).map("".join)


@pytest.fixture(scope="module")
def byte_tokenizer():
    vocab = {i: bytes([i]) for i in range(256)}
    merges = [(b"l", b"l"), (b" ", b"a"), (b"e", b"n"), (b"'", b"ll"), (b"en", b"d")]
    for left, right in merges:
        vocab[len(vocab)] = left + right
    return Tokenizer(vocab, merges, ["<|endoftext|>", "<|endoftext|><|endoftext|>"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT)
def test_round_trip(byte_tokenizer, text):
    assert byte_tokenizer.decode(byte_tokenizer.encode(text)) == text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT, cuts=st.lists(st.integers(min_value=0, max_value=80), max_size=12))
def test_streaming_equals_encode_for_any_chunking(byte_tokenizer, text, cuts):
    points = sorted({c for c in cuts if c < len(text)})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    assert list(byte_tokenizer.encode_iterable(chunks)) == byte_tokenizer.encode(text)


@settings(max_examples=25, deadline=None)
@given(text=st.lists(ALPHABET, min_size=1, max_size=200).map("".join), extra=st.integers(min_value=1, max_value=40))
def test_trainer_matches_naive_on_random_text(tmp_path_factory, text, extra):
    from test_tokenizer import naive_train_bpe

    from tritonlm.tokenizer import train_bpe

    path = tmp_path_factory.mktemp("bpe") / "t.txt"
    path.write_text(text, encoding="utf-8")
    vocab_size = 257 + extra
    _, merges = train_bpe(path, vocab_size, ["<|endoftext|>"], num_workers=1)
    assert merges == naive_train_bpe(text, vocab_size, ["<|endoftext|>"])


ASCII_TEXT = st.lists(st.sampled_from([chr(c) for c in range(128)] + ["'s", "'ll", "'ve", "  ", " \n", "\x1c "]),
                      max_size=80).map("".join)


@settings(max_examples=500, deadline=None)
@given(text=ASCII_TEXT, cut=st.integers(0, 200))
def test_ascii_pretokenizer_equals_gpt2_pattern(text, cut):
    # ASCII text is split with a stdlib-re pattern for speed; it must equal GPT-2's Unicode pattern (run by the
    # regex module) on every ASCII character, \x1c-\x1f included, also with an end position (streaming)
    import regex

    from tritonlm.tokenizer import GPT2_PATTERN, _pretokens

    gpt2 = regex.compile(GPT2_PATTERN)
    assert text.isascii()
    assert _pretokens(text) == gpt2.findall(text)
    end = min(cut, len(text))
    assert _pretokens(text, 0, end) == gpt2.findall(text, 0, end)


MIXED_TEXT = st.lists(st.sampled_from(list("ab1 \n\n\t'sé日²Ⅻ\x1c\x85\u3000.") + ["\n", "a\nb", "2\n3", "é\nx", ".\n!", "  \n",
                                      "'ll"]),
                      max_size=80).map("".join)


@settings(max_examples=500, deadline=None)
@given(text=MIXED_TEXT, block=st.integers(1, 12), cut=st.integers(0, 200))
def test_blockwise_pretokenizer_equals_gpt2_pattern(text, block, cut):
    # non-ASCII text is pre-tokenised in blocks cut at lone newlines between non-space chars (ASCII blocks take the
    # fast pattern); tiny blocks put a cut at every such newline, and the result must not change
    import regex

    import tritonlm.tokenizer as T

    gpt2 = regex.compile(T.GPT2_PATTERN)
    end = min(cut, len(text))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(T, "PRETOKEN_BLOCK_CHARS", block)
        assert T._pretokens(text) == gpt2.findall(text)
        assert T._pretokens(text, 0, end) == gpt2.findall(text, 0, end)
