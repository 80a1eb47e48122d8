"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet hybrids: linear-attention layers among gated full-attention
ones, partial RoPE, (1 + w) norms; MoE with a gated shared expert) against transformers' own models on tiny random
checkpoints made here: from_pretrained (logits, loss, every gradient; both backends), save_pretrained read back by
transformers, greedy and ragged-batch generation (recurrent caches beside the paged KV cache), apply_kernels
(a left-padded batch against the unpatched model; a packed batch against each document alone), bf16, the
vision-language directory the Hub publishes (its language model), multi-token-prediction tensors skipped, and
options the model cannot represent refused.

Needs the optional extra (``pip install 'tritonlm[hf]'``); skipped with that reason when it is absent.
"""

import copy
import json
import logging

import pytest
import torch

from helpers import (
    DEVICE,
    assert_bf16_no_further_than_transformers,
    assert_matches_transformers,
    hf_ids,
    hf_round_trip,
    save_hf_models,
    transformers_or_skip,
)

BASE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=100, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5})
MOE = dict(moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=6, num_experts_per_tok=2)
CONFIGS = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(BASE, **MOE, mlp_only_layers=[1])),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", BASE),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                         dict({k: v for k, v in BASE.items() if k != "intermediate_size"}, **MOE)),
}
KINDS = list(CONFIGS)


def _model(kind, seed=0, dtype=torch.float32, **overrides):
    transformers = transformers_or_skip()
    config_class, model_class, sizes = CONFIGS[kind]
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**{**sizes, **overrides}))
    with torch.no_grad():  # the (1 + w) norms and the gated norm away from their neutral starts; routers with margins
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("norm.weight"):
                p.uniform_(-0.3, 0.3)
            elif name.endswith("gate.weight") or ".experts." in name:
                p.normal_(0, 0.5)
    return model.to(device=DEVICE, dtype=dtype).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_hf_models(tmp_path_factory, KINDS, _model)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("kind", KINDS)
def test_from_pretrained_matches_transformers(saved, kind, backend):
    from tritonlm import hf

    path, theirs = saved[kind]
    ours = hf.from_pretrained(path, backend=backend, device=DEVICE, dtype=torch.float32)
    cfg = ours.config
    assert (cfg.linear_layers, cfg.attn_output_gate, cfg.norm_offset, cfg.qk_norm, cfg.partial_rotary) == \
        ((0, 2, 3), True, True, "head", 0.5)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim, cfg.linear_conv_kernel) == (2, 4, 8, 12, 4)
    if kind != "qwen3_5_text":
        assert (cfg.num_experts, cfg.shared_expert_d_ff, cfg.shared_expert_gate) == (6, 24, True)
        assert cfg.moe_layers == ((0, 2, 3) if kind == "qwen3_next" else None)
    assert_matches_transformers(ours, theirs, hf_ids(), at_least=30, aux_loss=False)  # (no load-balancing term by default)


@pytest.mark.parametrize("kind", KINDS)
def test_save_pretrained_round_trip(saved, kind, tmp_path):
    """Read back by transformers as the same model (logits), Qwen3-Next's interleaved projections interleaved again."""
    from safetensors.torch import load_file

    from tritonlm import hf

    path, _ = saved[kind]
    ours = hf.from_pretrained(path, backend="reference", dtype=torch.float32, device=DEVICE)
    theirs = hf_round_trip(ours, tmp_path / "ours", CONFIGS[kind][1])
    assert theirs.config.model_type == kind and theirs.config.layer_types == BASE["layer_types"]
    original, written = load_file(str(path / "model.safetensors")), load_file(str(tmp_path / "ours" / "model.safetensors"))
    for name in original:  # every tensor under its own name, bit for bit
        assert torch.equal(original[name], written[name]), name


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_and_ragged_generation_equal_transformers(saved, kind):
    """Recurrent caches (conv + delta-rule state) beside the KV caches: greedy tokens equal transformers' own
    generate, alone and in a ragged batch, on both backends."""
    from tritonlm import hf

    path, theirs = saved[kind]
    prompts = [torch.randint(3, 100, (n,), generator=torch.Generator().manual_seed(n)).to(DEVICE) for n in (9, 4)]
    expected = [theirs.generate(p[None], max_new_tokens=8, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0].tolist() for p in prompts]
    for backend in ("reference", "triton"):
        ours = hf.from_pretrained(path, backend=backend, device=DEVICE, dtype=torch.float32)
        ragged = ours.generate(prompts, max_new_tokens=8, temperature=0)
        for p, batched, want in zip(prompts, ragged, expected):
            assert ours.generate(p, max_new_tokens=8, temperature=0).tolist() == want
            assert batched.tolist() == want


def _run(model, batch):
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        logits = model.eval()(**{k: v for k, v in batch.items() if k != "labels"}).logits
    model.train()
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return logits, loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", KINDS)
def test_apply_kernels_padded_batch(kind):
    """Every norm (the gated one too), MLP, expert, the attention, the Gated DeltaNet layers (delta rule and conv) and
    the loss patched: a left-padded batch gives the unpatched model's logits, loss and gradients."""
    from tritonlm import hf

    base = _model(kind, seed=5)
    patched = hf.apply_kernels(copy.deepcopy(base))
    tags = {getattr(m, "_tritonlm_patch", None) for m in patched.modules()}
    assert {"rms_norm", "swiglu", "linear_attention", "rope", "loss"} <= tags
    ids = hf_ids(2, 15, seed=6)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    batch = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    (logits, loss, grads), (logits_ref, loss_ref, grads_ref) = _run(patched, batch), _run(base, batch)
    keep = mask.bool()
    torch.testing.assert_close(logits[keep], logits_ref[keep], atol=3e-5, rtol=1e-4)
    torch.testing.assert_close(loss, loss_ref, atol=3e-5, rtol=1e-4)
    assert set(grads) == set(grads_ref)
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], atol=3e-5, rtol=2e-4, msg=name)
    hf.remove_kernels(patched)
    assert not any(getattr(m, "_tritonlm_patch", None) for m in patched.modules())


def test_apply_kernels_packed_documents_equal_each_alone():
    """Packed documents with flash-attention kwargs (``cu_seq_lens_q``, as ``DataCollatorWithFlattening`` passes them):
    the patched model keeps them apart in the attention, the conv and the delta rule, so each document's logits
    equal the unpatched model's on that document alone (transformers itself needs flash-linear-attention for this)."""
    from tritonlm import hf

    base = _model("qwen3_5_text", seed=7)
    patched = hf.apply_kernels(copy.deepcopy(base))
    ids = hf_ids(1, 16, seed=8)
    cu = torch.tensor([0, 6, 16], dtype=torch.int32, device=DEVICE)
    positions = torch.cat([torch.arange(6), torch.arange(10)])[None].to(DEVICE)
    with torch.no_grad():
        packed = patched(input_ids=ids, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=10,
                         max_length_k=10).logits
        for a, b in ((0, 6), (6, 16)):
            alone = base(input_ids=ids[:, a:b]).logits
            torch.testing.assert_close(packed[:, a:b], alone, atol=3e-5, rtol=1e-4)
        # (unpatched, transformers refuses packed sequences without flash-linear-attention)
        with pytest.raises(ValueError, match="packed sequences"):
            base(input_ids=ids, position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=10,
                 max_length_k=10)


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_text"])
def test_bf16_no_further_from_fp32_than_transformers(saved, kind):
    """Loaded in bf16: our loss and gradients against the fp32 checkpoint are no further off than transformers' own
    bf16 model's; the same for the patched bf16 model."""
    from tritonlm import hf

    path, _ = saved[kind]
    theirs32 = _model(kind).train()
    theirs16 = _model(kind, dtype=torch.bfloat16).train()
    ours = hf.from_pretrained(path, backend="triton", device=DEVICE, dtype=torch.bfloat16).train()
    patched = hf.apply_kernels(_model(kind, dtype=torch.bfloat16)).train()
    ids = hf_ids(2, 11, seed=5)
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    assert_bf16_no_further_than_transformers(theirs32, theirs16, patched, ours, ids, targets, aux_loss=False)


def test_vision_language_directory_loads_its_language_model(tmp_path, caplog):
    """What the Hub publishes: ``Qwen3_5ForConditionalGeneration`` (``qwen3_5``, a ``text_config``, the language model
    under ``model.language_model.``): its language model loads (the vision tower left out, said in the log) with
    transformers' text logits, multi-token-prediction tensors skipped, and it saves as ``qwen3_5_text``; apply_kernels
    patches the vision-language model itself."""
    transformers = transformers_or_skip()
    from safetensors.torch import load_file, save_file

    from tritonlm import hf

    text = {k: v for k, v in BASE.items() if k not in ("pad_token_id", "bos_token_id", "eos_token_id")}
    config = transformers.Qwen3_5Config(text_config=text, vision_config=dict(depth=1, hidden_size=16, num_heads=2,
                                                                             intermediate_size=24, out_hidden_size=32))
    torch.manual_seed(3)
    theirs = transformers.Qwen3_5ForConditionalGeneration(config).to(DEVICE).eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if name.endswith("norm.weight") and "language_model" in name:
                p.uniform_(-0.3, 0.3) if "linear_attn" not in name else p.uniform_(0.5, 1.5)
    theirs.save_pretrained(tmp_path / "vl")
    state = load_file(str(tmp_path / "vl" / "model.safetensors"))
    assert any(k.startswith("model.visual.") for k in state)
    state["mtp.fc.weight"] = torch.zeros(32, 64)
    save_file(state, str(tmp_path / "vl" / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="tritonlm"):
        ours = hf.from_pretrained(tmp_path / "vl", backend="triton", device=DEVICE, dtype=torch.float32)
    assert "vision tower" in caplog.text and "kept aside" in caplog.text
    assert "mtp.fc.weight" in ours.hf_wrapper["tensors"]  # (with the vision tower: written back by a save)
    assert ours.config.model_type == "qwen3_5_text"
    ids = hf_ids()
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(input_ids=ids).logits, atol=2e-5, rtol=1e-4)
    # apply_kernels on the vision-language model itself (text inputs): its language model patched, same logits / loss
    patched = hf.apply_kernels(copy.deepcopy(theirs))
    assert "linear_attention" in {getattr(m, "_tritonlm_patch", None) for m in patched.modules()}
    with torch.no_grad():
        expected, got = theirs(input_ids=ids, labels=ids), patched(input_ids=ids, labels=ids)
    torch.testing.assert_close(got.logits, expected.logits, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got.loss, expected.loss, atol=2e-5, rtol=1e-5)
    # saved, it is the same vision-language directory again (issue 43): transformers' VL class, vision tower unchanged
    hf.save_pretrained(ours, tmp_path / "again")
    written = json.loads((tmp_path / "again" / "config.json").read_text())
    published = json.loads((tmp_path / "vl" / "config.json").read_text())
    assert written["model_type"] == "qwen3_5" and written["vision_config"] == published["vision_config"]
    again = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path / "again").to(DEVICE).eval()
    originals = theirs.state_dict()
    assert all(torch.equal(t, originals[name]) for name, t in again.state_dict().items() if ".visual." in name)
    assert "mtp.fc.weight" in load_file(str(tmp_path / "again" / "model.safetensors"))
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, theirs(input_ids=ids).logits, atol=2e-5, rtol=1e-4)
    # text_only: the language model alone, as its text family
    hf.save_pretrained(ours, tmp_path / "text", text_only=True)
    assert json.loads((tmp_path / "text" / "config.json").read_text())["model_type"] == "qwen3_5_text"
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "text").to(DEVICE).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, theirs(input_ids=ids).logits, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind, key, value, named", [
    ("qwen3_5_text", "layer_types", ["linear_attention", "sliding_attention", "full_attention", "full_attention"],
     "layer_types"),
    ("qwen3_5_text", "attention_bias", True, "attention_bias"),
    ("qwen3_next", "shared_expert_intermediate_size", 0, "shared_expert_intermediate_size"),
    ("qwen3_5_moe_text", "hidden_act", "gelu", "hidden_act"),
    ("qwen3_5_text", "linear_num_value_heads", 3, "linear_num_value_heads"),
])
def test_options_the_model_cannot_represent_are_refused(kind, key, value, named):
    transformers_or_skip()
    from tritonlm import hf

    config = {"model_type": kind, "architectures": [CONFIGS[kind][1]], **CONFIGS[kind][2], key: value}
    with pytest.raises(ValueError, match=named):
        hf.model_config_from_hf(config)


def test_accounting_reads_the_directory(saved, capsys):
    """``tritonlm accounting --hf``: the parameter count equals transformers' model's own, the Gated DeltaNet layers
    are named, and their FLOPs have a row of their own."""
    from tritonlm.cli import main

    path, theirs = saved["qwen3_next"]
    assert main(["accounting", "--hf", str(path), "--seq-len", "32"]) == 0
    out = capsys.readouterr().out
    assert f"parameters: {sum(p.numel() for p in theirs.parameters()):,} " in out
    assert "Gated DeltaNet layers [0, 2, 3] (q/k heads 2 x 8, value heads 4 x 12, conv 4)" in out
    assert "linear_attention" in out
