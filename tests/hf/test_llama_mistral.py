"""Llama and Mistral checkpoints against transformers' own models, on tiny random configs built here: from_pretrained
(logits, loss, every gradient; both backends), save_pretrained read back by transformers, sharded files and dtypes,
greedy and ragged-batch generation, Mistral's sliding window, the config-mapping errors.

Needs the optional extra (``pip install 'tritonlm[hf]'``); skipped with that reason when it is absent. The
config-mapping errors need no extra and always run.
"""

import copy

import pytest
import torch

from tritonlm import ModelConfig, TransformerLM
from tritonlm.hf import model_config_from_hf

from helpers import (
    DEVICE,
    LLAMA3_SCALING,
    LLAMA_SIZES,
    hf_grads,
    hf_round_trip,
    tiny_llama,
    transformers_or_skip,
)

# ----------------------------------------------------------------------------------------------------
# from_pretrained / save_pretrained
# ----------------------------------------------------------------------------------------------------
#: YaRN on a Llama (rope_scaling "yarn", with its attention factor), bent at the positions the test reaches
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize("tie,scaling", [(False, None), (True, LLAMA3_SCALING), (False, YARN)],
                         ids=["untied", "tied-llama3", "yarn"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_from_pretrained_matches_transformers(tmp_path, tie, scaling, backend):
    from tritonlm import hf

    theirs = tiny_llama(tie, scaling)
    theirs.save_pretrained(tmp_path)
    ours = hf.from_pretrained(tmp_path, backend=backend, device=DEVICE, dtype=torch.float32)
    assert ours.config.tie_embeddings == tie and ours.config.num_kv_heads == 2 and ours.config.norm_eps == 1e-6
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    # logits, and the loss HF computes from labels (it shifts them: position t predicts ids[t + 1])
    expected = theirs(ids, labels=ids)
    torch.testing.assert_close(ours(ids), expected.logits, atol=2e-5, rtol=1e-4)
    loss = ours.loss(ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(loss, expected.loss, atol=2e-5, rtol=1e-5)
    # gradients of every weight, ours mapped back to HF names (q/k rows un-permuted)
    expected.loss.backward()
    loss.backward()
    ours_grads = hf_grads(ours)
    for name, p in theirs.named_parameters():
        if name == "lm_head.weight" and tie:
            continue  # the same tensor as the embedding (its gradient holds both uses)
        torch.testing.assert_close(ours_grads[name], p.grad, atol=2e-5, rtol=1e-4, msg=name)


def test_llama3_scaling_changes_long_positions(tmp_path):
    """The scaled frequencies matter at these positions (else the test above would not check them)."""
    from tritonlm import hf

    tiny_llama(scaling=LLAMA3_SCALING).save_pretrained(tmp_path)
    scaled = hf.from_pretrained(tmp_path, backend="reference", dtype=torch.float32)
    plain = TransformerLM.from_config(scaled.config.replace(rope_scaling=None))
    plain.load_state_dict(scaled.state_dict())
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(2))
    assert (scaled(ids) - plain(ids)).abs().max() > 1e-3


def test_save_pretrained_round_trip(tmp_path):
    transformers_or_skip()

    cfg = ModelConfig(vocab_size=300, context_length=48, d_model=64, num_layers=2, num_heads=4, d_ff=96,
                      rope_theta=500.0, num_kv_heads=1, norm_eps=1e-6, tie_embeddings=True, rope_scaling=LLAMA3_SCALING)
    torch.manual_seed(3)
    ours = TransformerLM.from_config(cfg, device=DEVICE)
    with torch.no_grad():  # non-trivial norm weights, so a swapped norm would show
        for name, p in ours.named_parameters():
            if name.endswith(("ln1.weight", "ln2.weight", "ln_final.weight")):
                p.uniform_(0.5, 1.5)
    hf_round_trip(ours, tmp_path, "LlamaForCausalLM", seq=30)


def test_sharded_checkpoint_and_dtype(tmp_path):
    from tritonlm import hf

    theirs = tiny_llama(dtype=torch.bfloat16)
    theirs.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ours = hf.from_pretrained(tmp_path, backend="reference", device=DEVICE)  # dtype from the checkpoint
    assert ours.lm_head.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 300, (1, 12)).to(DEVICE)
    torch.testing.assert_close(ours(ids).float(), theirs(ids).logits.float(), atol=0.05, rtol=0.05)


def test_greedy_generation_equals_transformers(tmp_path):
    from tritonlm import hf

    theirs = tiny_llama(seed=5)
    theirs.save_pretrained(tmp_path)
    ours = hf.from_pretrained(tmp_path, backend="reference", device=DEVICE, dtype=torch.float32)
    prompt = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    expected = theirs.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    got = ours.generate(prompt, max_new_tokens=12, temperature=0)
    assert got.tolist() == expected.tolist()


def test_ragged_batch_generation_equals_transformers_per_prompt(tmp_path):
    """A Llama checkpoint generating a list of prompts of different lengths (paged KV cache, batched steps) gives
    every prompt exactly the greedy tokens transformers gives it alone."""
    from tritonlm import hf

    theirs = tiny_llama(seed=7)
    theirs.save_pretrained(tmp_path)
    ours = hf.from_pretrained(tmp_path, backend="reference", device=DEVICE, dtype=torch.float32)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 300, (n,), generator=gen).to(DEVICE) for n in (6, 1, 19)]
    outs = ours.generate(prompts, max_new_tokens=9, temperature=0)
    for p, out in zip(prompts, outs):
        expected = theirs.generate(p[None], max_new_tokens=9, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out.tolist() == expected[0].tolist()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_mistral_sliding_window(tmp_path, backend):
    """The window is a window (issue 31): the context is max_position_embeddings, and past the window the logits and
    greedy generation (KV cache, true positions) equal transformers'; saved back as mistral with its window, which
    transformers then runs windowed; apply_kernels runs the window itself."""
    transformers = transformers_or_skip()
    from tritonlm import hf

    torch.manual_seed(7)
    cfg = transformers.MistralConfig(**LLAMA_SIZES, sliding_window=8)
    theirs = transformers.MistralForCausalLM(cfg).to(DEVICE).eval()
    theirs.save_pretrained(tmp_path / "theirs")
    ours = hf.from_pretrained(tmp_path / "theirs", backend=backend, device=DEVICE, dtype=torch.float32)
    assert (ours.context_length, ours.config.sliding_window) == (64, 8)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        hf.from_pretrained(tmp_path / "theirs", backend="reference", context_length=65)
    long_ids = torch.randint(0, 300, (2, 19), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    expected = theirs(long_ids).logits
    torch.testing.assert_close(ours(long_ids), expected, atol=2e-5, rtol=1e-4)
    prompt = torch.randint(0, 300, (1, 11), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    want = theirs.generate(prompt, max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours.generate(prompt, max_new_tokens=20, temperature=0).tolist() == want.tolist()
    if backend == "reference":
        back = hf_round_trip(ours, tmp_path / "ours", "MistralForCausalLM", seq=30)
        assert back.config.sliding_window == 8
        patched = hf.apply_kernels(copy.deepcopy(theirs))
        torch.testing.assert_close(patched(long_ids).logits, expected, atol=2e-5, rtol=1e-4)


def _error(cfg_changes: dict, drop=()):
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **LLAMA_SIZES, **cfg_changes}
    for key in drop:
        cfg.pop(key)
    with pytest.raises(ValueError) as info:
        model_config_from_hf(cfg)
    return str(info.value)


def test_config_mapping_errors_name_the_field():
    assert "attention_bias" in _error({"attention_bias": True})
    assert "mlp_bias" in _error({"mlp_bias": True})
    assert "yarn" in _error({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert "model_type" in _error({"model_type": "gpt2"})
    assert "architectures" in _error({"architectures": ["LlamaForSequenceClassification"]})
    assert "hidden_act" in _error({"hidden_act": "gelu"})
    assert "head dim" in _error({"head_dim": 15})  # RoPE pairs need an even head dim
    assert model_config_from_hf({"model_type": "llama", **LLAMA_SIZES, "head_dim": 32}).d_head == 32  # explicit: kept
    # a key no family reads is refused by name (a missing key takes transformers' class default: tests/hf)
    assert "made_up_scaling" in _error({"made_up_scaling": 2.0})
    assert "original_max_position_embeddings" in _error({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    # both rope config styles read the same
    v5 = model_config_from_hf({"model_type": "llama", **{k: v for k, v in LLAMA_SIZES.items() if k != "rope_theta"},
                               "rope_parameters": {"rope_type": "llama3", "rope_theta": 500.0, **LLAMA3_SCALING}})
    v4 = model_config_from_hf({"model_type": "llama", **LLAMA_SIZES, "rope_scaling": LLAMA3_SCALING})
    assert v5 == v4 and v4.rope_theta == 500.0 and v4.rope_scaling["factor"] == 8.0


def test_checkpoint_with_biases_is_refused(tmp_path):
    from tritonlm import hf

    theirs = tiny_llama(attention_bias=True)
    theirs.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="attention_bias"):
        hf.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf.from_pretrained(tmp_path / "nowhere")


# ----------------------------------------------------------------------------------------------------
# loading options
# ----------------------------------------------------------------------------------------------------
def test_from_pretrained_dtype_forms_and_swish(tmp_path):
    """dtype as transformers takes it ("auto" = the checkpoint's, names, torch dtypes); hidden_act "swish" is
    SiLU (compared with transformers' own model)."""
    from tritonlm import hf

    theirs = tiny_llama(dtype=torch.bfloat16, seed=40, hidden_act="swish")
    theirs.save_pretrained(tmp_path)
    for dtype, expected in [("auto", torch.bfloat16), ("bfloat16", torch.bfloat16), ("torch.float16", torch.float16),
                            (torch.float32, torch.float32), (None, torch.bfloat16)]:
        model = hf.from_pretrained(tmp_path, backend="reference", device=DEVICE, dtype=dtype)
        assert model.lm_head.weight.dtype == expected, dtype
    for bad in ("int8", "fp32", torch.int64):
        with pytest.raises(ValueError, match="dtype"):
            hf.from_pretrained(tmp_path, dtype=bad)
    ours = hf.from_pretrained(tmp_path, backend="reference", device=DEVICE, dtype="float32")
    ids = torch.randint(0, 300, (1, 9)).to(DEVICE)
    torch.testing.assert_close(ours(ids), theirs.float()(ids).logits, atol=2e-5, rtol=1e-4)
