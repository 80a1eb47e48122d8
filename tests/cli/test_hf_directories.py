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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    path = tmp_path_factory.mktemp("hf-llama")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=290, special_tokens=["<|end_of_text|>",
                                                                                       "<|begin_of_text|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    # Llama 3's post-processor: BOS before every text (transformers' tokenizer(text) adds it)
    tok.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False), processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast", '
                                                '"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}')
    eos = tok.token_to_id("<|end_of_text|>")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                                   num_hidden_layers=2, vocab_size=300, max_position_embeddings=256,
                                   tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return path, model, tok


def test_generate_from_hf_dir_equals_transformers(hf_dir, capsys):
    """The prompt encoded as transformers' AutoTokenizer does (BOS from the post-processor), and the model's
    vocabulary (300) padded past the tokenizer's 290 ids: those are never sampled (HF's suppress_tokens), and the
    mismatch is named in one line up front."""
    import transformers

    path, model, tok = hf_dir
    prompt = "The cat"
    assert main(["generate", "--checkpoint", str(path), "--prompt", prompt, "--max-new-tokens", "10",
                 "--temperature", "0", "--device", "cpu", "--backend", "reference"]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "10 of the model's 300 ids are not in the tokenizer" in captured.err
    ids = transformers.AutoTokenizer.from_pretrained(path)(prompt, return_tensors="pt").input_ids
    assert ids[0, 0] == tok.token_to_id("<|begin_of_text|>")
    out = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0,
                         suppress_tokens=list(range(tok.get_vocab_size(), 300)))[0, ids.shape[1]:].tolist()
    eos = model.config.eos_token_id
    new = out[:out.index(eos)] if eos in out else out
    assert printed.rstrip("\n") == prompt + tok.decode(new, skip_special_tokens=False)


def test_generate_prompt_file_batches_equal_transformers_per_prompt(hf_dir, tmp_path, capsys):
    """``generate --prompt-file``: prompts of different lengths decode together (paged KV cache); each printed
    continuation is transformers' greedy output for that prompt alone, in file order, then one tokens/s line."""
    import transformers

    path, model, tok = hf_dir
    prompts = ["The cat", "A bird sang in the tree, and", "dog"]
    file = tmp_path / "prompts.txt"
    file.write_text(prompts[0] + "\n\n" + prompts[1] + "\n" + prompts[2] + "\n")  # (a blank line is skipped)
    assert main(["generate", "--checkpoint", str(path), "--prompt-file", str(file), "--max-new-tokens", "8",
                 "--temperature", "0", "--device", "cpu", "--backend", "reference"]) == 0
    captured = capsys.readouterr()
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    expected = []
    for i, prompt in enumerate(prompts, 1):
        ids = hf_tok(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0,
                             suppress_tokens=list(range(tok.get_vocab_size(), 300)))[0, ids.shape[1]:].tolist()
        eos = model.config.eos_token_id
        new = out[:out.index(eos)] if eos in out else out
        expected += [f"=== {i}/3 ===", prompt + tok.decode(new, skip_special_tokens=False)]
    assert captured.out.rstrip("\n") == "\n".join(expected)
    assert re.search(r"\[3 prompts, \d+ tokens in [\d.]+s, [\d.]+ tokens/s, backend reference, paged KV cache: "
                     r"\d+ blocks of 16 positions", captured.err)


def test_generate_prompt_file_errors(hf_dir, tmp_path, capsys):
    path, _, _ = hf_dir
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    for file, message in ((empty, "no prompts"), (tmp_path / "missing.txt", "missing.txt")):
        assert main(["generate", "--checkpoint", str(path), "--prompt-file", str(file), "--device", "cpu"]) != 0
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --prompt and --prompt-file are exclusive
        main(["generate", "--checkpoint", str(path), "--prompt", "x", "--prompt-file", str(empty)])


def test_train_init_from_hf_dir(hf_dir, tmp_path, capsys):
    """Fine-tuning starts from the checkpoint's weights (a vanishing learning rate keeps them), uses its
    tokenizer.json, and the run directory then generates."""
    from tritonlm.generate import load_for_generation
    from tritonlm.hf import from_pretrained

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
    # the checkpoint's own tokenizer
    assert tokenizer.encode(TEXT[:200]) == tok.encode(TEXT[:200], add_special_tokens=False).ids
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


def test_generate_never_samples_undecodable_ids(hf_dir, monkeypatch):
    """Sampling (not only greedy) from a model whose padded ids are the most likely: the text is never lost to
    an unknown id."""
    from tritonlm.generate import generate_ids, load_for_generation

    path, _, tok = hf_dir
    model, tokenizer = load_for_generation(path, "cpu", "reference")
    with torch.no_grad():
        model.lm_head.weight[tok.get_vocab_size():] = model.lm_head.weight[:tok.get_vocab_size()].abs().max() * 50
    new = generate_ids(model, tokenizer, "The dog", 8, temperature=1.0, seed=0)
    assert len(new) == 8 and max(new) < tok.get_vocab_size()
    tokenizer.decode(new)


def test_tokenizer_json_path_and_missing_tokenizer(hf_dir, tmp_path, capsys):
    """--tokenizer takes the tokenizer.json path itself; an HF directory without tokenizer.json is refused
    before its weights are read."""
    import shutil

    from tritonlm.hf import checkpoint

    path, _, tok = hf_dir
    data = tmp_path / "text.txt"
    data.write_text(TEXT, encoding="utf-8")
    assert main(["train", "--tokenizer", str(path / "tokenizer.json"), "--data", str(data), "--preset", "tiny",
                 "--context-length", "16", "--max-steps", "1", "--batch-size", "2", "--eval-every", "0",
                 "--eval-batches", "1", "--sample-tokens", "2", "--out", str(tmp_path / "run"), "--device", "cpu",
                 "--no-progress"]) == 0
    assert "tokenizer: loaded from" in capsys.readouterr().out
    bare = tmp_path / "bare"
    shutil.copytree(path, bare)
    (bare / "tokenizer.json").unlink()
    read = []
    real = checkpoint.read_hf_state
    checkpoint.read_hf_state = lambda p: read.append(p) or real(p)
    try:
        assert main(["generate", "--checkpoint", str(bare), "--prompt", "x", "--device", "cpu"]) == 2
    finally:
        checkpoint.read_hf_state = real
    assert "tokenizer" in capsys.readouterr().err and not read


@pytest.fixture(scope="module")
def mixtral_dir(hf_dir, tmp_path_factory):
    """A tiny random Mixtral beside the Llama fixture's tokenizer.json."""
    import shutil

    import transformers

    llama_path, _, tok = hf_dir
    path = tmp_path_factory.mktemp("hf-mixtral")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_path / name, path / name)
    torch.manual_seed(1)
    cfg = transformers.MixtralConfig(hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
                                     num_hidden_layers=2, vocab_size=300, max_position_embeddings=256,
                                     num_local_experts=4, num_experts_per_tok=2, bos_token_id=None,
                                     eos_token_id=tok.token_to_id("<|end_of_text|>"))
    model = transformers.MixtralForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return path, model


def test_mixtral_accounting_training_and_generation(mixtral_dir, tmp_path, capsys):
    """``accounting --hf`` counts transformers' parameters and the active ones; ``train --init-from`` fine-tunes the
    MoE checkpoint (weights kept by a vanishing learning rate, the log shows the router's loss and load) and its run
    directory generates what transformers generates greedily."""
    import json

    import transformers

    from tritonlm.generate import generate_ids, load_for_generation

    path, model = mixtral_dir
    assert main(["accounting", "--hf", str(path), "--seq-len", "64"]) == 0
    printed = capsys.readouterr().out
    n = int(re.search(r"parameters: ([\d,]+)", printed).group(1).replace(",", ""))
    assert n == sum(p.numel() for p in model.parameters())
    active = int(re.search(r"active parameters per token: ([\d,]+)", printed).group(1).replace(",", ""))
    assert n - active == 2 * 2 * 3 * 32 * 40  # 2 layers x (4 - 2) experts x three 32 x 40 matrices
    data = tmp_path / "text.txt"
    data.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "run"
    assert main(["train", "--init-from", str(path), "--data", str(data), "--context-length", "32", "--max-steps",
                 "2", "--batch-size", "2", "--lr", "1e-9", "--eval-every", "0", "--eval-batches", "1", "--log-every",
                 "1", "--sample-tokens", "0", "--out", str(out), "--device", "cpu", "--no-progress"]) == 0
    # the checkpoint's output_router_logits (false, as published configs ship it): no load-balancing term, as
    # transformers trains it; the log says so, and --router-aux-loss on adds it
    assert "no load-balancing loss (the checkpoint's output_router_logits is false" in capsys.readouterr().out
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert all("aux_loss" in e and "expert_load_max" in e for e in log if "loss" in e)
    assert main(["train", "--init-from", str(path), "--data", str(data), "--context-length", "32", "--max-steps",
                 "1", "--batch-size", "2", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0",
                 "--out", str(tmp_path / "run-aux"), "--device", "cpu", "--no-progress", "--router-aux-loss",
                 "on"]) == 0
    assert "load-balancing loss x 0.001 in the training loss (--router-aux-loss on)" in capsys.readouterr().out
    ours, tokenizer = load_for_generation(out, "cpu", "reference")
    assert ours.config.num_experts == 4
    ids = transformers.AutoTokenizer.from_pretrained(path)("The cat", return_tensors="pt").input_ids
    expected = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0,
                              suppress_tokens=list(range(tokenizer.vocab_size, 300)))[0, ids.shape[1]:].tolist()
    eos = model.config.eos_token_id
    expected = expected[:expected.index(eos)] if eos in expected else expected
    assert generate_ids(ours, tokenizer, "The cat", 6, temperature=0) == expected


def test_generate_reads_generation_config_json(hf_dir, tmp_path, capsys):
    """Issue 31: ``generation_config.json``'s end ids (a list: an instruct model's end-of-turn beside its eos) and
    its defaults (greedy without do_sample, max_new_tokens) are what ``tritonlm generate`` uses when no flag says
    otherwise, as transformers' generate uses them; the command says which it used."""
    import json
    import shutil

    import transformers

    path, model, tok = hf_dir
    copy = tmp_path / "instruct"
    shutil.copytree(path, copy)
    model = transformers.AutoModelForCausalLM.from_pretrained(copy).eval()
    with torch.no_grad():  # (larger weights than the init's: greedy decoding that does not repeat one id)
        torch.manual_seed(3)
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    model.save_pretrained(copy)
    ids = transformers.AutoTokenizer.from_pretrained(path)("The cat", return_tensors="pt").input_ids
    suppress = list(range(tok.get_vocab_size(), 300))
    greedy = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None,
                            suppress_tokens=suppress)[0, ids.shape[1]:].tolist()
    # an id only generation_config.json names as an end: the first id, from the third on, not seen before
    cut = next(j for j in range(2, len(greedy)) if greedy[j] not in greedy[:j])
    stop = greedy[cut]
    assert stop != model.config.eos_token_id and cut >= 2
    (copy / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [model.config.eos_token_id, stop], "do_sample": False, "max_new_tokens": 12,
         "pad_token_id": 0}))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(copy).eval()
    expected = theirs.generate(ids, suppress_tokens=suppress)[0, ids.shape[1]:].tolist()
    assert expected == greedy[:cut + 1]  # transformers itself stops at the generation config's end id
    assert main(["generate", "--checkpoint", str(copy), "--prompt", "The cat", "--device", "cpu",
                 "--backend", "reference"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == ("The cat" + tok.decode(greedy[:cut])).strip()
    assert "up to 12 new tokens, greedy" in captured.err and "generation_config.json" in captured.err
    from tritonlm.generate import generate_ids, load_for_generation

    ours, tokenizer = load_for_generation(copy, "cpu", "reference")
    assert generate_ids(ours, tokenizer, "The cat", 12, temperature=0) == greedy[:cut]
