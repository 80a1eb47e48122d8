"""The command line with Hugging Face directories: ``generate --checkpoint HF_DIR``, ``train --init-from HF_DIR``,
``accounting --hf HF_DIR`` (tiny random Llama + a tokenizer.json trained here by the tokenizers library)."""

import re

import pytest
import torch

from tritonlm.cli import main

TEXT = ("The cat sat on the mat. The dog sat on the log. A bird sang in the tree, and the cat looked up.\n" * 60)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    pytest.importorskip("safetensors", reason="the optional extra tritonlm[hf] (safetensors) is not installed")
    transformers = pytest.importorskip("transformers", reason="the optional extra tritonlm[hf] is not installed")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = tmp_path_factory.mktemp("hf-llama")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=290, special_tokens=["<|end_of_text|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    tok.save(str(path / "tokenizer.json"))
    eos = tok.token_to_id("<|end_of_text|>")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=2, vocab_size=300, max_position_embeddings=256,
                                   tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return path, model, tok


def test_generate_from_hf_dir_equals_transformers(hf_dir, capsys):
    path, model, tok = hf_dir
    prompt = "The cat"
    assert main(["generate", "--checkpoint", str(path), "--prompt", prompt, "--max-new-tokens", "10",
                 "--temperature", "0", "--device", "cpu", "--backend", "reference"]) == 0
    printed = capsys.readouterr().out
    ids = torch.tensor([tok.encode(prompt).ids])
    out = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()
    eos = model.config.eos_token_id
    new = out[:out.index(eos)] if eos in out else out
    assert printed.rstrip("\n") == prompt + tok.decode(new, skip_special_tokens=False)


def test_train_init_from_hf_dir(hf_dir, tmp_path, capsys):
    """Fine-tuning starts from the checkpoint's weights (a vanishing learning rate keeps them), uses its
    tokenizer.json, and the run directory then generates."""
    from tritonlm.hf import from_pretrained
    from tritonlm.train import load_for_generation

    path, _, tok = hf_dir
    data = tmp_path / "text.txt"
    data.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "run"
    assert main(["train", "--init-from", str(path), "--data", str(data), "--context-length", "32", "--max-steps",
                 "2", "--batch-size", "2", "--lr", "1e-9", "--eval-every", "0", "--eval-batches", "1",
                 "--sample-tokens", "4", "--out", str(out), "--device", "cpu", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert f"initialised from {path}" in printed
    model, tokenizer = load_for_generation(out, "cpu", "reference")
    assert tokenizer.encode(TEXT[:200]) == tok.encode(TEXT[:200]).ids  # the checkpoint's own tokenizer
    assert model.context_length == 32 and model.config.tie_embeddings
    original = from_pretrained(path, backend="reference", dtype=torch.float32, context_length=32)
    for (name, a), b in zip(model.state_dict().items(), original.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)
    assert main(["generate", "--checkpoint", str(out), "--prompt", "The dog", "--max-new-tokens", "3",
                 "--device", "cpu"]) == 0
    # sizes come from the checkpoint
    capsys.readouterr()
    assert main(["train", "--init-from", str(path), "--data", str(data), "--d-model", "32", "--out",
                 str(tmp_path / "other"), "--device", "cpu"]) == 2
    assert "drop --d-model" in capsys.readouterr().err


def test_accounting_hf(hf_dir, capsys):
    path, model, _ = hf_dir
    assert main(["accounting", "--hf", str(path), "--seq-len", "64"]) == 0
    printed = capsys.readouterr().out
    assert "tied embeddings" in printed
    n = int(re.search(r"parameters: ([\d,]+)", printed).group(1).replace(",", ""))
    assert n == sum(p.numel() for p in model.parameters())  # transformers' own count (tied head counted once)
    assert main(["accounting", "--hf", str(path / "missing")]) == 2
