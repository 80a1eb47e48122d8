"""Issue 43's edges of real checkpoints, each against transformers' own models on tiny random configs: the
load-balancing term only where transformers adds it (``output_router_logits``), in from_pretrained, apply_kernels on
the Hub's Qwen3.5-MoE vision-language class and ``tritonlm train --init-from``; ``output_router_logits`` and the
token ids kept by a save; a vision-language directory whose ``tie_word_embeddings`` / ``quantization_config`` sit at
the top level; generation_config.json's logits processors (repetition penalty, no-repeat n-grams, min_new_tokens)
decoded as transformers decodes them; generation past the context refused alike on both paths; MLA's determined
head_dim.

Needs the optional extra (``pip install 'tritonlm[hf]'``); skipped with that reason when it is absent.
"""

import json

import pytest
import torch

from tritonlm import ModelConfig

from helpers import DEVICE, hf_grads, hf_ids, tiny_llama, transformers_or_skip

TEXT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=100, max_position_embeddings=64, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"],
            moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=6, num_experts_per_tok=2,
            router_aux_loss_coef=0.05, rope_parameters={"rope_type": "default", "rope_theta": 1000.0,
                                                        "partial_rotary_factor": 0.5})
GPT_OSS = dict(hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=8, vocab_size=100, max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
               sliding_window=6, router_aux_loss_coef=0.9)  # (gpt-oss-20b's published coefficient)


def _randomised(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.3, 0.3) if "linear_attn" not in name else p.uniform_(0.5, 1.5)
            elif name.endswith(("gate.weight", "router.weight")) or ".experts." in name:
                p.normal_(0, 0.5)
    return model.to(DEVICE)


def _targets(ids):
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)


@pytest.mark.parametrize("kind, output_router_logits", [("qwen3_5_moe_text", False), ("qwen3_5_moe_text", True),
                                                        ("gpt_oss", False)])
def test_training_loss_and_grads_follow_output_router_logits(kind, output_router_logits, tmp_path):
    """transformers adds coef x load-balancing loss only when output_router_logits is true (published configs: false);
    tritonlm's training loss and every gradient follow it, and the save writes the flag back as it was."""
    transformers = transformers_or_skip()
    from tritonlm import hf

    torch.manual_seed(0)
    if kind == "gpt_oss":
        config = transformers.GptOssConfig(**GPT_OSS, output_router_logits=output_router_logits)
        theirs = _randomised(transformers.GptOssForCausalLM(config)).train()
    else:
        config = transformers.Qwen3_5MoeTextConfig(**TEXT, output_router_logits=output_router_logits)
        theirs = _randomised(transformers.Qwen3_5MoeForCausalLM(config)).train()
    theirs.save_pretrained(tmp_path / "theirs")
    ours = hf.from_pretrained(tmp_path / "theirs", backend="reference", device=DEVICE, dtype=torch.float32).train()
    assert ours.config.router_aux_loss is output_router_logits
    ids = hf_ids(vocab=100)
    expected = theirs(ids, labels=ids)
    assert (expected.aux_loss is not None) is output_router_logits
    loss = ours.loss(ids, _targets(ids))
    torch.testing.assert_close(loss, expected.loss, atol=2e-5, rtol=1e-5)
    expected.loss.backward()
    loss.backward()
    grads = hf_grads(ours)
    for name, p in theirs.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, atol=2e-5, rtol=1e-4, msg=name)
    hf.save_pretrained(ours, tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written["output_router_logits"] is output_router_logits
    assert written["router_aux_loss_coef"] == config.router_aux_loss_coef
    # an explicit request still adds the term, whatever the config says
    with_aux = ours.loss(ids, _targets(ids), aux_loss=True)
    assert with_aux > ours.loss(ids, _targets(ids), aux_loss=False)


@pytest.fixture(scope="module")
def qwen3_5_moe_vl(tmp_path_factory):
    """A tiny Qwen3_5MoeForConditionalGeneration (the Hub's class) saved by transformers."""
    transformers = transformers_or_skip()
    torch.manual_seed(1)
    config = transformers.Qwen3_5MoeConfig(text_config=TEXT, vision_config=dict(depth=1, hidden_size=16, num_heads=2,
                                                                                intermediate_size=24,
                                                                                out_hidden_size=32))
    model = _randomised(transformers.Qwen3_5MoeForConditionalGeneration(config)).eval()
    path = tmp_path_factory.mktemp("qwen3_5_moe_vl")
    model.save_pretrained(path)
    return path, model


@pytest.mark.parametrize("where", ["text_config", "per call"])
def test_apply_kernels_on_the_vl_class_adds_the_aux_loss_it_asks_for(qwen3_5_moe_vl, where):
    transformers = transformers_or_skip()
    from tritonlm import hf

    path, _ = qwen3_5_moe_vl
    base = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(path).to(DEVICE).train()
    if where == "text_config":
        base.config.text_config.output_router_logits = True
    patched = hf.apply_kernels(transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(path).to(DEVICE))
    if where == "text_config":
        patched.config.text_config.output_router_logits = True
    patched.train()
    ids = hf_ids(vocab=100)
    call = {} if where == "text_config" else {"output_router_logits": True}
    want, got = base(input_ids=ids, labels=ids, **call), patched(input_ids=ids, labels=ids, **call)
    assert got.aux_loss is not None
    torch.testing.assert_close(got.aux_loss, want.aux_loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.loss, want.loss, atol=3e-5, rtol=1e-5)


def test_vl_directory_with_top_level_tie_and_quantization(qwen3_5_moe_vl, tmp_path):
    """transformers 5 writes tie_word_embeddings only at the top level of a VL config (its text_config says false):
    the VL class ties by it, and so does tritonlm; a top-level quantization_config is refused by name."""
    transformers = transformers_or_skip()
    from tritonlm import hf

    torch.manual_seed(2)
    config = transformers.Qwen3_5Config(tie_word_embeddings=True,
                                        text_config={k: v for k, v in TEXT.items() if "expert" not in k
                                                     and k != "moe_intermediate_size" and k != "router_aux_loss_coef"},
                                        vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=24,
                                                           out_hidden_size=32))
    theirs = _randomised(transformers.Qwen3_5ForConditionalGeneration(config)).eval()
    theirs.save_pretrained(tmp_path / "tied")
    written = json.loads((tmp_path / "tied" / "config.json").read_text())
    assert written["tie_word_embeddings"] is True and written["text_config"].get("tie_word_embeddings") is not True
    ours = hf.from_pretrained(tmp_path / "tied", backend="reference", device=DEVICE, dtype=torch.float32)
    assert ours.config.tie_embeddings
    ids = hf_ids(vocab=100)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(input_ids=ids).logits, atol=2e-5, rtol=1e-4)
    quantised = dict(written, quantization_config={"quant_method": "modelopt", "quant_algo": "NVFP4"})
    (tmp_path / "tied" / "config.json").write_text(json.dumps(quantised))
    with pytest.raises(ValueError, match=r"^quantization_config \(quant_method='modelopt'\) is not supported"):
        hf.from_pretrained(tmp_path / "tied", backend="reference")


def test_save_keeps_the_token_ids_and_unread_keys(tmp_path):
    transformers_or_skip()
    from tritonlm import hf

    theirs = tiny_llama(bos_token_id=1, eos_token_id=[2, 3], pad_token_id=0)
    theirs.save_pretrained(tmp_path / "theirs")
    published = json.loads((tmp_path / "theirs" / "config.json").read_text())
    published["transformers.js_config"] = {"dtype": "q4"}  # (what onnx-community repositories carry)
    (tmp_path / "theirs" / "config.json").write_text(json.dumps(published))
    ours = hf.from_pretrained(tmp_path / "theirs", backend="reference")
    hf.save_pretrained(ours, tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"], written["pad_token_id"]) == (1, [2, 3], 0)
    assert written["transformers.js_config"] == {"dtype": "q4"}


# ----------------------------------------------------------------------------------------------------
# generation
# ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    transformers_or_skip()
    from tritonlm import hf

    theirs = tiny_llama(seed=3)
    path = tmp_path_factory.mktemp("llama_gen")
    theirs.save_pretrained(path)
    return path, theirs, hf.from_pretrained(path, backend="reference", device=DEVICE, dtype=torch.float32)


PROCESSORS = [dict(repetition_penalty=1.8), dict(repetition_penalty=3.0), dict(no_repeat_ngram_size=2),
              dict(no_repeat_ngram_size=1), dict(repetition_penalty=1.3, no_repeat_ngram_size=3)]


@pytest.mark.parametrize("options", PROCESSORS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_greedy_with_logits_processors_equals_transformers(llama_pair, options):
    _, theirs, ours = llama_pair
    prompt = torch.tensor([[5, 9, 5, 9, 17, 5]], device=DEVICE)
    want = theirs.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0,
                           **options)[0].tolist()
    plain = theirs.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)[0]
    assert want != plain.tolist()  # (the processor changes what greedy decoding gives)
    assert ours.generate(prompt[0], 24, temperature=0, **options).tolist() == want
    # the ragged (paged-cache) path, beside a second prompt
    got = ours.generate([prompt[0], torch.tensor([7, 8, 9], device=DEVICE)], 24, temperature=0, **options)
    assert got[0].tolist() == want


def test_min_new_tokens_holds_back_the_end_of_sequence(llama_pair):
    _, theirs, ours = llama_pair
    prompt = torch.tensor([[4, 8, 15, 16]], device=DEVICE)
    first = int(theirs.generate(prompt, max_new_tokens=1, do_sample=False, pad_token_id=0)[0, -1])
    # the greedy first token as the end of sequence: without min_new_tokens, nothing is generated
    assert ours.generate(prompt[0], 20, temperature=0, eos_id=first).tolist() == prompt[0].tolist() + [first]
    want = theirs.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=first, pad_token_id=0,
                           min_new_tokens=7)[0].tolist()
    got = ours.generate(prompt[0], 20, temperature=0, eos_id=first, min_new_tokens=7).tolist()
    assert got == want and first not in got[4:11]


def _command_dir(theirs, directory):
    """``theirs`` saved with a tokenizer.json, as ``tritonlm generate --checkpoint`` takes it; its tokenizer."""
    theirs.save_pretrained(directory)
    return _byte_tokenizer(directory)


def test_generate_command_applies_generation_config_processors(llama_pair, tmp_path, capsys):
    from tritonlm.cli import main

    _, theirs, _ = llama_pair
    directory = tmp_path / "model"
    tokenizer = _command_dir(theirs, directory)
    (directory / "generation_config.json").write_text(json.dumps(
        {"do_sample": False, "repetition_penalty": 1.5, "no_repeat_ngram_size": 2, "max_new_tokens": 12}))
    assert main(["generate", "--checkpoint", str(directory), "--prompt", "abab", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert "repetition penalty 1.5, no repeat ngram size 2" in err and "greedy" in err
    ids = tokenizer.encode("abab", add_special_tokens=True)
    want = theirs.generate(torch.tensor([ids], device=DEVICE), max_new_tokens=12, do_sample=False, pad_token_id=0,
                           eos_token_id=None, repetition_penalty=1.5, no_repeat_ngram_size=2)[0, len(ids):].tolist()
    assert out.rstrip("\n") == "abab" + tokenizer.decode(want)
    (directory / "generation_config.json").write_text(json.dumps({"do_sample": False, "num_beams": 4}))
    assert main(["generate", "--checkpoint", str(directory), "--prompt", "ab", "--device", "cpu"]) == 2
    assert "num_beams=4 is not supported" in capsys.readouterr().err


def _byte_tokenizer(directory):
    """A byte-level BPE tokenizer.json (the tokenizers library's, ids inside the tiny model's 300) in ``directory``."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from tritonlm.tokenizer import Tokenizer

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = " ".join(f"{a}{b}{c}" for a in "abcdefgh" for b in "ijklmnop" for c in "qrstuvwx")
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                        show_progress=False))
    tok.save(str(directory / "tokenizer.json"))
    return Tokenizer.from_hf(directory / "tokenizer.json")


def test_generate_command_caps_the_default_length_at_the_context(llama_pair, tmp_path, capsys):
    from tritonlm.cli import main

    _, theirs, _ = llama_pair
    directory = tmp_path / "model"
    tokenizer = _command_dir(theirs, directory)
    assert len(tokenizer.vocab) == 300
    prompt = len(tokenizer.encode("abc", add_special_tokens=True))
    assert main(["generate", "--checkpoint", str(directory), "--prompt", "abc", "--device", "cpu",
                 "--temperature", "0"]) == 0
    err = capsys.readouterr().err
    assert f"max_new_tokens 200 capped to {64 - prompt}" in err  # (context 64 - the prompt's tokens)
    assert main(["generate", "--checkpoint", str(directory), "--prompt", "abc", "--device", "cpu",
                 "--max-new-tokens", str(65 - prompt)]) == 2
    assert "exceed the model's context_length 64" in capsys.readouterr().err


def test_mla_head_dim_is_derived():
    cfg = ModelConfig(vocab_size=50, context_length=16, d_model=32, num_layers=1, num_heads=4, d_ff=48,
                      attention="mla", kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    assert cfg.head_dim == 12 and cfg.d_head == 12
    with pytest.raises(ValueError, match="head_dim must be qk_nope_head_dim \\+ qk_rope_head_dim"):
        ModelConfig(vocab_size=50, context_length=16, d_model=32, num_layers=1, num_heads=4, d_ff=48,
                    attention="mla", kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, head_dim=16)
