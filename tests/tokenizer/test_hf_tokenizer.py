"""``Tokenizer.from_hf`` against the ``tokenizers`` library on the same tokenizer.json files, built here:
a Llama-3-style and a Qwen-2-style tokenizer trained by ``tokenizers`` itself, and GPT-2's from the shared data."""

import json

import pytest

from tritonlm.tokenizer import LLAMA3_PATTERN, QWEN2_PATTERN, Tokenizer

from helpers import SHARED_DATA

tokenizers = pytest.importorskip("tokenizers", reason="the tokenizers library (installed with tritonlm[hf]) is absent")

TRICKY = [
    "Hello world, the QUICK brown fox jumps over 1234567 lazy dogs. I'M sure THEY'LL say it's fine",
    "  leading spaces\r\n\r\n\ttabs\t\t and trailing   ",
    "café naïve cafe\u0301 (a combining accent: NFC joins it) Ångström",
    "数字123和中文混合，标点！ العربية",
    "emoji 😀👍🏽 flags 🇫🇷🇩🇪 and ÷× symbols",
    "no-break\u00a0space, ideographic\u3000space, line\u2028separator",
    "<|eot_id|>specials<|begin_of_text|><|eot_id|> and a partial <|eot",
    "x" * 300 + " " + "ab" * 200,
    "",
    "\n",
    "a",
]
SPECIALS = ["<|begin_of_text|>", "<|eot_id|>"]


def _train_hf(tmp_path, pattern: str, nfc: bool, ignore_merges: bool, name: str):
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIALS, show_progress=False,
                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TRICKY * 20 + ["the theory of everything, there and then, 2024-11-30"] * 50, trainer)
    path = tmp_path / f"{name}.json"
    tok.save(str(path))
    return tok, path


@pytest.fixture(scope="module", params=["llama3", "qwen2"])
def trained(request, tmp_path_factory):
    pattern, nfc, ignore = {"llama3": (LLAMA3_PATTERN, False, True), "qwen2": (QWEN2_PATTERN, True, False)}[request.param]
    return _train_hf(tmp_path_factory.mktemp("tok"), pattern, nfc, ignore, request.param)


def test_from_hf_encodes_exactly_like_tokenizers(trained):
    theirs, path = trained
    ours = Tokenizer.from_hf(path)
    for text in TRICKY + ["".join(TRICKY)]:
        expected = theirs.encode(text, add_special_tokens=False).ids
        assert ours.encode(text) == expected, text
        assert ours.decode(expected) == theirs.decode(expected, skip_special_tokens=False)


def test_from_hf_streaming_equals_whole(trained):
    """encode_iterable cuts its buffer every ~8K characters: long input, odd chunk sizes."""
    theirs, path = trained
    ours = Tokenizer.from_hf(path)
    text = "".join(TRICKY) * 40
    chunks = [text[i:i + 997] for i in range(0, len(text), 997)]
    assert list(ours.encode_iterable(chunks)) == theirs.encode(text, add_special_tokens=False).ids


def test_from_hf_encode_file_cuts_safely(trained, tmp_path):
    import numpy as np

    from tritonlm.tokenizer import encode_file

    theirs, path = trained
    text = ("line one!\nline two\n\n" + "".join(TRICKY)) * 30
    src = tmp_path / "text.txt"
    src.write_text(text, encoding="utf-8")
    info = encode_file(Tokenizer.from_hf(path), src, tmp_path / "ids.npy", num_workers=2, chunk_bytes=1500)
    assert np.load(info["path"]).tolist() == theirs.encode(text, add_special_tokens=False).ids


@pytest.mark.skipif(not (SHARED_DATA / "gpt2_vocab.json").exists(), reason="needs ../shared/data (GPT-2 files)")
def test_from_hf_gpt2(tmp_path):
    from tokenizers import decoders, models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.BPE.from_file(str(SHARED_DATA / "gpt2_vocab.json"),
                                                    str(SHARED_DATA / "gpt2_merges.txt")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    ours = Tokenizer.from_hf(tmp_path)  # a directory holding tokenizer.json
    for text in TRICKY + ["<|endoftext|>" + "".join(TRICKY)]:
        assert ours.encode(text) == tok.encode(text, add_special_tokens=False).ids, text


def _spec(tmp_path, **changes):
    spec = {"model": {"type": "BPE", "vocab": {chr(c): i for i, c in enumerate(range(33, 127))}, "merges": []},
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}, "normalizer": None,
            "added_tokens": []}
    for key, value in changes.items():
        if key.startswith("model_"):
            spec["model"][key[len("model_"):]] = value
        else:
            spec[key] = value
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec), encoding="utf-8")
    return path


@pytest.mark.parametrize("changes,message", [
    ({"model_type": "Unigram"}, "model.type 'Unigram'"),
    ({"model_byte_fallback": True}, "ByteLevel is not supported for a SentencePiece BPE"),
    ({"pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "sometimes"}}, "prepend_scheme"),
    ({"pre_tokenizer": {"type": "Metaspace", "replacement": "▁"}, "decoder": {"type": "CTC"}}, "decoder step CTC"),
    ({"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True}}, "add_prefix_space"),
    ({"normalizer": {"type": "Lowercase"}}, "Lowercase"),
    ({"added_tokens": [{"id": 999, "content": "<mask>", "lstrip": True}]}, "lstrip"),
])
def test_from_hf_rejects_what_it_cannot_encode(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        Tokenizer.from_hf(_spec(tmp_path, **changes))


def test_hf_tokenizer_cannot_be_saved_as_gpt2_files(trained, tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_hf(trained[1]).save(tmp_path / "vocab.json", tmp_path / "merges.txt")


def test_from_hf_ignore_merges(trained, tmp_path):
    """Llama 3's ``ignore_merges``: a pre-token that is itself in the vocab is one token even when no chain of
    merges builds it (here a word added to the vocab without merges)."""
    theirs, path = trained
    spec = json.loads(path.read_text(encoding="utf-8"))
    spec["model"]["vocab"]["Ġzzqx"] = max(spec["model"]["vocab"].values()) + 1 + len(SPECIALS)
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(spec), encoding="utf-8")
    theirs = tokenizers.Tokenizer.from_file(str(edited))
    text = "a zzqx and zzqx"
    expected = theirs.encode(text, add_special_tokens=False).ids
    assert Tokenizer.from_hf(edited).encode(text) == expected
    whole_word = spec["model"]["vocab"]["Ġzzqx"] in expected
    assert whole_word == spec["model"]["ignore_merges"]  # one token exactly when merges are ignored


def test_from_hf_added_tokens_keep_their_own_ids(trained, tmp_path):
    """``add_tokens``: an added token whose bytes are also a vocab entry (" the"), one that is a prefix of another
    added token ("wor" / "world!"), and a special one: each is matched first, longest first, with its own id."""
    theirs, path = trained
    tok = tokenizers.Tokenizer.from_file(str(path))
    vocab = tok.get_vocab()
    assert "Ġthe" in vocab  # the bytes of " the" are a vocab entry already
    tok.add_tokens([" the", "wor", "world!"])
    tok.add_special_tokens(["<|pad|>"])
    assert tok.token_to_id(" the") != vocab["Ġthe"]
    edited = tmp_path / "added.json"
    tok.save(str(edited))
    ours = Tokenizer.from_hf(edited)
    texts = ["hello the world", " the theory", "world! wor world", "<|pad|> the<|eot_id|>world!",
             "nothing added here", "the the  the", "wor"]
    for text in texts + ["".join(TRICKY)]:
        expected = tok.encode(text, add_special_tokens=False).ids
        assert ours.encode(text) == expected, text
        assert ours.decode(expected) == tok.decode(expected, skip_special_tokens=False)
    assert tok.token_to_id(" the") in ours.encode("hello the world")


@pytest.mark.parametrize("post", ["template", "sequence", "bytelevel", "none"])
def test_encode_with_special_tokens_as_transformers(trained, tmp_path, post):
    """``encode(text, add_special_tokens=True)`` equals ``AutoTokenizer(dir)(text).input_ids``: the
    post-processor (Llama 3's BOS template, alone or in a Sequence after ByteLevel) decides what is added."""
    transformers = pytest.importorskip("transformers", reason="the optional extra tritonlm[hf] is not installed")
    from tokenizers import processors

    _, path = trained
    tok = tokenizers.Tokenizer.from_file(str(path))
    bos = tok.token_to_id("<|begin_of_text|>")
    template = processors.TemplateProcessing(single="<|begin_of_text|> $A <|eot_id|>",
                                             special_tokens=[("<|begin_of_text|>", bos),
                                                             ("<|eot_id|>", tok.token_to_id("<|eot_id|>"))])
    tok.post_processor = {"template": template, "none": None, "bytelevel": processors.ByteLevel(trim_offsets=False),
                          "sequence": processors.Sequence([processors.ByteLevel(trim_offsets=False), template])}[post]
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "add_bos_token": True}))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = Tokenizer.from_hf(tmp_path)
    for text in ["Hello world", TRICKY[2], "<|eot_id|> x"]:
        assert ours.encode(text, add_special_tokens=True) == theirs(text).input_ids, text
    assert (ours.encode("hi", add_special_tokens=True)[0] == bos) == (post in ("template", "sequence"))


def test_normalized_added_tokens_match_after_nfc(trained, tmp_path):
    """An added token the file marks ``normalized`` is matched in the NFC-normalized text (issue 31): a decomposed
    ``cafe\\u0301`` is the added ``café`` under Qwen 2's NFC normalizer, as the tokenizers library finds it; a
    special (unnormalized) token still matches the raw text. Streaming gives the same ids."""
    theirs, path = trained
    tok = tokenizers.Tokenizer.from_file(str(path))
    tok.add_tokens([tokenizers.AddedToken("café", normalized=True)])
    edited = tmp_path / "nfc_added.json"
    tok.save(str(edited))
    ours = Tokenizer.from_hf(edited)
    for text in ["un cafe\u0301 noir", "café", "cafe\u0301<|eot_id|>cafe\u0301s", "cafe and café"]:
        expected = tok.encode(text, add_special_tokens=False).ids
        assert ours.encode(text) == expected, text
        assert list(ours.encode_iterable([text[:5], text[5:]])) == expected, text
    if ours.normalization:  # (Qwen 2's file: NFC joins the accent, so the added token is found)
        assert tok.token_to_id("café") in ours.encode("un cafe\u0301 noir")
