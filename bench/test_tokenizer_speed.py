"""BPE training time vs HuggingFace `tokenizers` (ByteLevel BPE, same vocab size), and encode throughput
vs tiktoken's GPT-2 encoding built from the same files, single process and parallel. CPU benchmarks:
these figures are real on any machine. Needs ../shared/data (skips without it)."""

import os
from pathlib import Path

import pytest

from tritonlm.tokenizer import GPT2_PATTERN, Tokenizer, encode_file, train_bpe

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
pytestmark = pytest.mark.skipif(not DATA.is_dir(), reason="../shared/data is not present")


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory):
    """≥ 5 MB: the data files concatenated (repeated as needed)."""
    parts = [(DATA / n).read_bytes() for n in ("tinyshakespeare.txt", "tinystories_sample.txt")]
    blob = b"\n".join(parts)
    path = tmp_path_factory.mktemp("corpus") / "big.txt"
    path.write_bytes(blob * (5_000_000 // len(blob) + 1))
    return path


def _hf_train(path, vocab_size):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(path)], trainer)


@pytest.mark.parametrize("impl", ["tritonlm", "hf-tokenizers"])
@pytest.mark.parametrize("corpus", ["tinyshakespeare", "5MB"])
def test_bpe_training(benchmark, impl, corpus, big_corpus):
    pytest.importorskip("tokenizers") if impl == "hf-tokenizers" else None
    benchmark.group = f"bpe train vocab 10000 {corpus}"
    path = DATA / "tinyshakespeare.txt" if corpus == "tinyshakespeare" else big_corpus
    fn = (lambda: train_bpe(path, 10000, ["<|endoftext|>"], progress=False)) if impl == "tritonlm" else (
        lambda: _hf_train(path, 10000))
    benchmark.pedantic(fn, rounds=1, iterations=1, warmup_rounds=0)
    benchmark.extra_info["MB"] = round(path.stat().st_size / 1e6, 2)


@pytest.fixture(scope="module")
def gpt2():
    return Tokenizer.from_files(DATA / "gpt2_vocab.json", DATA / "gpt2_merges.txt", ["<|endoftext|>"])


@pytest.mark.parametrize("impl", ["tritonlm", "tiktoken"])
@pytest.mark.parametrize("corpus", ["tinyshakespeare", "5MB"])
def test_encode_throughput(benchmark, impl, corpus, gpt2, big_corpus):
    benchmark.group = f"encode GPT-2 single process {corpus}"
    path = DATA / "tinyshakespeare.txt" if corpus == "tinyshakespeare" else big_corpus
    text = path.read_text(encoding="utf-8")
    if impl == "tiktoken":
        tiktoken = pytest.importorskip("tiktoken")
        ranks = {t: i for i, t in gpt2.vocab.items() if t != b"<|endoftext|>"}
        enc = tiktoken.Encoding("gpt2-offline", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                special_tokens={"<|endoftext|>": 50256})
        fn = lambda: enc.encode_ordinary(text)  # noqa: E731
    else:
        def fn():  # the pre-token cache starts empty every round: cold-start throughput
            gpt2._cache.clear()
            gpt2.encode(text)
    benchmark.pedantic(fn, rounds=3, iterations=1, warmup_rounds=0)
    benchmark.extra_info["MB/s"] = round(len(text.encode()) / benchmark.stats.stats.mean / 1e6, 2)


@pytest.mark.parametrize("workers", [1, os.cpu_count() or 1])
def test_parallel_file_encoding(benchmark, workers, gpt2, big_corpus, tmp_path):
    benchmark.group = "encode_file GPT-2 5MB"
    benchmark.pedantic(lambda: encode_file(gpt2, big_corpus, tmp_path / "out.npy", num_workers=workers),
                       rounds=1, iterations=1, warmup_rounds=0)
    benchmark.extra_info["MB/s"] = round(big_corpus.stat().st_size / benchmark.stats.stats.mean / 1e6, 2)
    benchmark.extra_info["workers"] = workers
