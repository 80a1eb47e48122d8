"""DeepSeek-V3 (MLA, YaRN with mscale, sigmoid group-limited routing with a correction bias, shared experts, dense
first layers) and GLM-4.5 (GQA with partial half-split RoPE, q/k/v biases, q/k norms, the same router) against
transformers' own ``DeepseekV3ForCausalLM`` / ``Glm4MoeForCausalLM`` on tiny random checkpoints made here:
from_pretrained (logits, loss, every gradient; both backends), save_pretrained read back by transformers,
apply_kernels (padded and packed batches, fp32 and bf16), greedy and ragged-batch generation, bf16 loading,
multi-token-prediction layers skipped, FP8 files and unsupported options refused.

Needs the optional extra (``pip install 'tritonlm[hf]'``); skipped with that reason when it is absent.
"""

import copy
import json

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

ROUTING = dict(moe_intermediate_size=16, n_shared_experts=2, n_routed_experts=8, n_group=4, topk_group=2,
               num_experts_per_tok=3, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True)
BASE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, vocab_size=100,
            max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, **ROUTING)
CONFIGS = {
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(BASE, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
                         rope_parameters={"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                          "original_max_position_embeddings": 16, "rope_theta": 1000.0})),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM",
                 dict(BASE, num_key_value_heads=2, head_dim=16, use_qk_norm=True, attention_bias=True,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5})),
}
KINDS = list(CONFIGS)


def _model(kind, seed=0, dtype=torch.float32, **overrides):
    transformers = transformers_or_skip()
    config_class, model_class, sizes = CONFIGS[kind]
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**{**sizes, **overrides}))
    with torch.no_grad():  # norms, biases, the correction bias and the router away from their neutral starts;
        # routers whose choices have margins bf16 rounding does not flip
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.3)
            elif name.endswith("gate.weight") or ".experts." in name:
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randperm(b.numel(), generator=torch.Generator().manual_seed(seed)) * 0.1)
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
    assert (cfg.router_scoring, cfg.router_choice_bias, cfg.router_groups, cfg.router_topk_groups,
            cfg.routed_scaling_factor, cfg.shared_expert_d_ff, cfg.shared_expert_gate, cfg.moe_layers) == \
        ("sigmoid", True, 4, 2, 2.5, 32, False, (1,))
    if kind == "deepseek_v3":
        assert (cfg.attention, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.d_head, cfg.v_dim) == ("mla", 24, 16, 16, 12)
        assert cfg.query_scale == pytest.approx(16 ** -0.5 * (0.1 * __import__("math").log(4.0) + 1) ** 2)
    else:
        assert (cfg.qk_norm, cfg.qkv_bias, cfg.partial_rotary, cfg.kv_heads) == ("head", True, 0.5, 2)
    assert_matches_transformers(ours, theirs, hf_ids(), at_least=20)  # (no load-balancing term: transformers adds none)


@pytest.mark.parametrize("kind", KINDS)
def test_save_pretrained_round_trip(saved, kind, tmp_path):
    """Read back by transformers as the same model (logits), the correction bias and the family's keys kept."""
    from tritonlm import hf

    path, _ = saved[kind]
    ours = hf.from_pretrained(path, backend="reference", dtype=torch.float32, device=DEVICE)
    theirs = hf_round_trip(ours, tmp_path / "ours", CONFIGS[kind][1])
    assert theirs.config.model_type == kind and theirs.config.first_k_dense_replace == 1
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written["n_shared_experts"] == 2 and written["n_group"] == 4
    torch.testing.assert_close(theirs.model.layers[1].mlp.gate.e_score_correction_bias.to(DEVICE),
                               ours.layers[1].ffn.choice_bias)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_and_ragged_generation_equal_transformers(saved, kind):
    from tritonlm import hf

    path, theirs = saved[kind]
    prompts = [torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(n)).to(DEVICE) for n in (9, 4)]
    for backend in ("reference", "triton"):
        ours = hf.from_pretrained(path, backend=backend, device=DEVICE, dtype=torch.float32)
        ragged = ours.generate(prompts, max_new_tokens=8, temperature=0)
        for p, batched in zip(prompts, ragged):
            expected = theirs.generate(p[None], max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
            assert ours.generate(p, max_new_tokens=8, temperature=0).tolist() == expected[0].tolist()
            assert batched.tolist() == expected[0].tolist()


@pytest.mark.parametrize("kind", KINDS)
def test_apply_kernels_padded_and_packed_batches(kind):
    """Every norm, MLP (shared experts too), the grouped experts, the attention (MLA's narrower value heads) and the
    loss patched: a left-padded batch and a packed one give the unpatched model's logits, loss and gradients."""
    from tritonlm import hf

    base = _model(kind, seed=5)
    patched = hf.apply_kernels(copy.deepcopy(base))
    tags = {getattr(m, "_tritonlm_patch", None) for m in patched.modules()}
    assert {"rms_norm", "swiglu", "moe", "loss"} <= tags
    ids = hf_ids(2, 15, seed=6)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    positions = torch.cat([torch.arange(6), torch.arange(9)])[None].to(DEVICE)
    batches = [dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)),
               dict(input_ids=ids[:1], position_ids=positions, labels=ids[:1].clone().index_fill(1,
                                                                                        torch.tensor([6]), -100))]
    for batch in batches:
        results = []
        for model in (patched, base):
            model.zero_grad(set_to_none=True)
            with torch.no_grad():
                logits = model.eval()(**{k: v for k, v in batch.items() if k != "labels"}).logits
            model.train()
            loss = model(**batch, use_cache=False).loss
            loss.backward()
            results.append((logits, loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
        (logits, loss, grads), (logits_ref, loss_ref, grads_ref) = results
        keep = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
        torch.testing.assert_close(logits[keep], logits_ref[keep], atol=3e-5, rtol=1e-4)
        torch.testing.assert_close(loss, loss_ref, atol=3e-5, rtol=1e-4)
        assert set(grads) == set(grads_ref)
        for name in grads_ref:
            torch.testing.assert_close(grads[name], grads_ref[name], atol=3e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_no_further_from_fp32_than_transformers(saved, kind):
    """Loaded in bf16: our loss and gradients against the fp32 checkpoint are no further off than transformers' own
    bf16 model's; the same for the patched bf16 model against the unpatched one."""
    from tritonlm import hf

    path, _ = saved[kind]
    theirs32 = _model(kind).train()
    theirs16 = _model(kind, dtype=torch.bfloat16).train()
    ours = hf.from_pretrained(path, backend="reference", device=DEVICE, dtype=torch.bfloat16).train()
    patched = hf.apply_kernels(_model(kind, dtype=torch.bfloat16)).train()
    ids = hf_ids(2, 11, seed=5)
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    assert_bf16_no_further_than_transformers(theirs32, theirs16, patched, ours, ids, targets)


def test_mtp_layers_are_skipped_and_fp8_files_refused(saved, tmp_path, caplog):
    """DeepSeek's files carry multi-token-prediction layers past num_hidden_layers (transformers skips them, and so do
    we, saying so); its published FP8 weights are refused in one line naming the quantisation."""
    import logging

    from safetensors.torch import load_file, save_file

    from tritonlm import hf

    path, theirs = saved["deepseek_v3"]
    mtp = tmp_path / "mtp"
    mtp.mkdir()
    state = load_file(str(path / "model.safetensors"))
    state.update({k.replace("model.layers.1.", "model.layers.2."): v.clone() for k, v in state.items()
                  if k.startswith("model.layers.1.")})
    state["model.layers.2.eh_proj.weight"] = torch.zeros(32, 64)
    save_file(state, str(mtp / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (mtp / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.INFO, logger="tritonlm"):
        ours = hf.from_pretrained(mtp, backend="reference", dtype=torch.float32, device=DEVICE)
    assert "multi-token-prediction layers [2]" in caplog.text
    ids = hf_ids()
    torch.testing.assert_close(ours(ids), theirs(ids).logits, atol=2e-5, rtol=1e-4)
    fp8 = dict(config, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]})
    (mtp / "config.json").write_text(json.dumps(fp8))
    with pytest.raises(ValueError, match="quant_method='fp8'"):
        hf.from_pretrained(mtp, backend="reference")


@pytest.mark.parametrize("kind, key, value, named", [
    ("deepseek_v3", "rope_interleave", False, "rope_interleave"),
    ("deepseek_v3", "n_shared_experts", 0, "n_shared_experts"),
    ("deepseek_v3", "hidden_act", "gelu", "hidden_act"),
    ("glm4_moe", "n_group", 3, "router_groups"),
    ("glm4_moe", "rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4}, "longrope"),
])
def test_options_the_model_cannot_represent_are_refused(kind, key, value, named):
    transformers_or_skip()
    from tritonlm import hf

    config = {"model_type": kind, "architectures": [CONFIGS[kind][1]], **CONFIGS[kind][2], key: value}
    with pytest.raises(ValueError, match=named):
        hf.model_config_from_hf(config)


@pytest.mark.parametrize("kind", KINDS)
def test_accounting_reads_the_directory(saved, kind, capsys):
    """``tritonlm accounting --hf``: the parameter count equals transformers' model's own (the correction bias is a
    buffer, as there), and an MLA model says so."""
    from tritonlm.cli import main

    path, theirs = saved[kind]
    assert main(["accounting", "--hf", str(path), "--seq-len", "32"]) == 0
    out = capsys.readouterr().out
    assert f"parameters: {sum(p.numel() for p in theirs.parameters()):,} " in out
    assert ("MLA (latent 16 + rotary key 8, query/key heads 16, value heads 12)" in out) == (kind == "deepseek_v3")
