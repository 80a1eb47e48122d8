"""Every family beyond Llama / Mistral / Mixtral against transformers' own model, on tiny random configs: Gemma 1/2/3,
OLMo 2/3, Phi-3, Qwen2/3 and their MoE models, and the six dense families of the record redesign (SmolLM3, GLM-4,
Granite, ERNIE 4.5, Seed-OSS, OLMo 3). from_pretrained (logits, the loss with the load-balancing term for MoE, every
gradient; both backends), the save/load round trip read back by transformers, apply_kernels (padded and packed
batches, launch counts, bf16), greedy and ragged-batch generation, bf16 loading and ``accounting --hf``.

Needs the optional extra (``pip install 'tritonlm[hf]'``); skipped with that reason when it is absent.
"""

import pytest
import torch

from tritonlm import ModelConfig, TransformerLM

from helpers import DEVICE, hf_grads, hf_round_trip, transformers_or_skip

BASE = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
            vocab_size=120, max_position_embeddings=64, rms_norm_eps=1e-6)
#: the MoE families' load-balancing term, on (published configs ship output_router_logits false: both then add none)
MOE_AUX = dict(router_aux_loss_coef=0.02, output_router_logits=True)
FAMILIES = {
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16)),
    # sandwich norms, softcaps that bend (scores ~ +-5, logits ~ +-3), a query scale other than 1/sqrt(head_dim),
    # a 5-position window on layer 0 (the default alternation: sliding, full)
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=16, sliding_window=5, query_pre_attn_scalar=12, attn_logit_softcapping=3.0,
                    final_logit_softcapping=2.0)),
    # + q/k norms (1 + w), local layers with their own RoPE base, linear RoPE scaling on the global layer
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                    dict(head_dim=16, sliding_window=5, query_pre_attn_scalar=20, final_logit_softcapping=4.0,
                         layer_types=["sliding_attention", "full_attention"],
                         rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
                                          "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})),
    # output norms (no input norms), q/k norms over the whole projections
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    # fused qkv / gate_up projections, RoPE on half of each head's features, a window on every layer
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(sliding_window=7, pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                     "partial_rotary_factor": 0.5})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),  # heads x head_dim (64) != hidden (32)
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                       shared_expert_intermediate_size=40, norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=16, num_experts=5, num_experts_per_tok=2, moe_intermediate_size=24,
                       norm_topk_prob=False, mlp_only_layers=[0])),
}
#: the six dense families of issue 32, each a family file of its own; with the fields each maps to
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
NEW_FAMILIES = {
    # a NoPE layer (layer 1) that is also the sliding one, q/k/v/o and MLP biases
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM",
                dict(IDS, no_rope_layers=[1, 0], use_sliding_window=True, sliding_window=5,
                     layer_types=["full_attention", "sliding_attention"], attention_bias=True, mlp_bias=True),
                dict(nope_layers=(1,), sliding_window=5, sliding_layers=(1,), qkv_bias=True, attn_out_bias=True,
                     mlp_bias=True)),
    # output norms, a sliding layer, linear RoPE scaling on the full layer only
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM",
              dict(IDS, sliding_window=5, layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}),
              dict(norm_position="output", qk_norm="projection", sliding_window=5, sliding_layers=(0,),
                   local_rope_theta=500.0)),
    # interleaved RoPE on half of each head, q/k/v biases, fused gate_up, sandwich norms
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(IDS, head_dim=16),
             dict(partial_rotary=0.5, qkv_bias=True, post_norms=True, head_dim=16)),
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(IDS, embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.2,
                     logits_scaling=2.5),
                dict(embedding_scale=3.0, residual_scale=0.4, query_scale=0.2, logits_divisor=2.5)),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(IDS, head_dim=8, use_bias=True),
                 dict(qkv_bias=True, attn_out_bias=True, mlp_bias=True, tie_embeddings=True)),
    # its published dropout is left at 0 here so the training-mode comparisons run (dropout: test_family_records)
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM",
                 dict(IDS, head_dim=8, attention_out_bias=True, attention_dropout=0.0, residual_dropout=0.0),
                 dict(qkv_bias=True, attn_out_bias=True)),
}
FAMILIES.update({kind: spec[:3] for kind, spec in NEW_FAMILIES.items()})


def _model(kind, seed=0):
    transformers = transformers_or_skip()
    config_class, model_class, extra = FAMILIES[kind]
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_class)(**BASE, **(MOE_AUX if kind.endswith("moe") else {}), **extra)
    model = getattr(transformers, model_class)(cfg)
    with torch.no_grad():  # biases and norm weights start at 0 / 1: make them matter
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.3)
            elif name.endswith(("q_norm.weight", "k_norm.weight", "layernorm.weight")) and kind == "olmo2":
                p.uniform_(0.5, 1.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")) and not kind.startswith("gemma"):
                p.uniform_(0.5, 1.5)
            elif kind.startswith("gemma") and name.endswith(("norm.weight", "layernorm.weight")):
                # Gemma's (1 + w) norms start at w = 0
                p.uniform_(-0.5, 0.5)
            elif kind in NEW_FAMILIES and name.endswith("norm.weight"):  # (a swapped norm would show)
                p.uniform_(0.5, 1.5)
    return model.to(DEVICE).eval()


#: the families whose fused run exercises a kernel path the others do not (softcap + windows, local RoPE bases and
#: offset q/k norms, projection q/k norms, partial RoPE + fused projections, experts with a shared expert); the
#: reference backend runs every family (the fused Llama / Mistral / Mixtral runs are in test_llama_mistral.py / test_mixtral.py)
FUSED_KINDS = ("gemma2", "gemma3_text", "olmo2", "phi3", "qwen2_moe", *NEW_FAMILIES)
#: the families whose bf16, generation and command-line checks run here (the others': test_llama_mistral.py, test_apply_kernels.py, test_mixtral.py)
CHECKED_KINDS = ["gemma2", "gemma3_text", "olmo2", "phi3", *NEW_FAMILIES]


def _check_old_family_fields(kind, cfg):
    """The fields the first twelve families' tiny configs map to."""
    assert cfg.qkv_bias == kind.startswith("qwen2")
    assert (cfg.qk_norm == "head") == kind.startswith(("qwen3", "gemma3"))
    assert cfg.d_head == (8 if kind.startswith(("qwen2", "olmo2", "phi3")) else 16)
    assert (cfg.partial_rotary == 0.5) == (kind == "phi3")
    assert (cfg.ffn == "geglu") == cfg.norm_offset == (cfg.embedding_scale is not None) == kind.startswith("gemma")
    assert cfg.post_norms == (cfg.sliding_window == 5) == kind.startswith(("gemma2", "gemma3"))
    assert (cfg.norm_position == "output") == (cfg.qk_norm == "projection") == (kind == "olmo2")


@pytest.mark.parametrize("kind, backend", [(k, "reference") for k in FAMILIES] + [(k, "triton") for k in FUSED_KINDS])
def test_from_pretrained_matches_transformers(kind, backend, tmp_path):
    from tritonlm import hf

    theirs = _model(kind)
    theirs.save_pretrained(tmp_path)
    ours = hf.from_pretrained(tmp_path, backend=backend, device=DEVICE, dtype=torch.float32)
    cfg = ours.config
    if kind in NEW_FAMILIES:
        assert {k: getattr(cfg, k) for k in NEW_FAMILIES[kind][3]} == NEW_FAMILIES[kind][3]
    else:
        _check_old_family_fields(kind, cfg)
    ids = torch.randint(0, 120, (2, 21), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    moe = kind.endswith("moe")
    expected = theirs(ids, labels=ids, **({"output_router_logits": True} if moe else {}))
    torch.testing.assert_close(ours(ids), expected.logits, atol=2e-5, rtol=1e-4)
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)  # transformers' shifted labels
    ours.train()
    loss = ours.loss(ids, targets)  # MoE: + coef x load-balancing loss, as transformers adds it
    torch.testing.assert_close(loss, expected.loss, atol=2e-5, rtol=1e-5)
    expected.loss.backward()
    loss.backward()
    grads = hf_grads(ours)
    for name, p in theirs.named_parameters():
        if p.grad is None:
            continue
        torch.testing.assert_close(grads[name], p.grad, atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_save_pretrained_round_trip(kind, tmp_path):
    transformers_or_skip()
    from tritonlm import hf

    hf_dir = tmp_path / "theirs"
    _model(kind, seed=2).save_pretrained(hf_dir)
    ours = hf.from_pretrained(hf_dir, backend="reference", dtype=torch.float32, device=DEVICE)
    theirs = hf_round_trip(ours, tmp_path / "ours", FAMILIES[kind][1])
    assert theirs.config.model_type == kind


def test_qwen_options_without_a_family_are_refused(tmp_path):
    transformers_or_skip()
    from tritonlm import hf

    cfg = ModelConfig(vocab_size=50, context_length=16, d_model=32, num_layers=1, num_heads=4, d_ff=48,
                      qk_norm="head", qkv_bias=True)
    with pytest.raises(ValueError, match="cannot hold"):
        hf.save_pretrained(TransformerLM(cfg), tmp_path)
    with pytest.raises(ValueError, match="use_sliding_window"):
        hf.model_config_from_hf({"model_type": "qwen2", **BASE, "use_sliding_window": True})


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_apply_kernels_matches_unpatched(kind, monkeypatch):
    """Every norm (q/k norms too), RoPE, gate, experts, attention and the loss patched: logits on a left-padded
    batch, the loss (MoE: with output_router_logits) and every gradient equal the unpatched model's (fp32). The
    patched training forward launches each kernel once per patched module: every RMSNorm, RoPE and attention once
    per layer, the gate once per dense MLP (and shared expert), the grouped experts once per MoE layer, the loss."""
    import copy
    from collections import Counter

    from tritonlm import hf
    from tritonlm.kernels import cross_entropy_loss, rmsnorm, rope, swiglu
    from tritonlm.kernels.attention import forward as attention_forward
    from tritonlm.kernels.moe import kernels as moe_kernels

    from helpers import record_launches

    launched = record_launches(monkeypatch, rmsnorm._rms_norm_fwd_kernel, rope._rope_kernel, swiglu._swiglu_fwd_kernel,
                               attention_forward._fwd_kernel, cross_entropy_loss._cross_entropy_kernel,
                               moe_kernels._up_kernel)

    base = _model(kind, seed=5)
    patched = hf.apply_kernels(copy.deepcopy(base))
    tags = {getattr(m, "_tritonlm_patch", None) for m in patched.modules()}
    assert {"rms_norm", "rope", "loss"} <= tags and ("moe" in tags) == kind.endswith("moe")
    assert all(m._tritonlm_patch == "rms_norm" for m in patched.modules() if type(m).__name__.endswith("RMSNorm"))
    ids = torch.randint(0, 120, (2, 15), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    if kind == "gemma2":
        # Gemma 2 runs HF's eager attention (sdpa has no softcap), whose fully masked pad rows average every value
        # (sdpa's and flash-attention's give 0, as the kernel does): the one loss term that reads a pad row's
        # output -- the last pad predicting the first real token -- differs by construction, so it is left out
        labels[0, 3] = -100
    batch = dict(input_ids=ids, attention_mask=mask, labels=labels)
    if kind.endswith("moe"):
        batch["output_router_logits"] = True
    with torch.no_grad():
        got, expected = patched(ids, attention_mask=mask).logits, base(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], atol=3e-5, rtol=1e-4)
    results = []
    for model in (patched, base):
        model.train()
        launched.clear()
        loss = model(**batch, use_cache=False).loss
        counts = Counter(launched)  # (the forward's launches: RoPE's backward reuses its forward kernel)
        loss.backward()
        results.append((loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, counts))
    (loss, grads, counts), (loss_ref, grads_ref, counts_ref) = results
    patches = Counter(getattr(m, "_tritonlm_patch", None) for m in patched.modules())
    layers = patched.config.num_hidden_layers
    assert counts["_rms_norm_fwd_kernel"] == patches["rms_norm"] > layers
    rope_layers = sum(getattr(patched.config, "no_rope_layers", None) or [1] * layers)  # (SmolLM3's NoPE layers)
    assert counts["_rope_kernel"] == rope_layers and counts["_fwd_kernel"] == patches["rope"] == layers
    assert counts["_swiglu_fwd_kernel"] == patches["swiglu"]
    assert counts["_up_kernel"] == patches["moe"] == (1 if kind.endswith("moe") else 0)  # (one MoE layer of two)
    assert counts["_cross_entropy_kernel"] >= 1 and patches["loss"] == 1 and not counts_ref  # (unpatched: none)
    torch.testing.assert_close(loss, loss_ref, atol=3e-5, rtol=1e-4)
    assert set(grads) == set(grads_ref)
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], atol=3e-5, rtol=1e-4, msg=name)


def test_readme_supported_models_table_matches_the_code():
    """README's "Supported models" table is the registry's own (tritonlm.hf.readme_table), row for row."""
    from pathlib import Path

    from tritonlm.hf import SUPPORTED_MODELS, readme_table

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme.split("### Supported models", 1)[1].split("\n\n", 2)[1]
    assert section.strip() == readme_table()
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in section.splitlines()[2:]]
    assert [row[0] for row in rows] == list(SUPPORTED_MODELS)


@pytest.mark.parametrize("kind", CHECKED_KINDS)
def test_new_families_greedy_generation_equals_transformers(kind, tmp_path):
    """Decoding past the windows (KV cache, windowed layers, per-layer RoPE bases, softcaps, partial rotary, output
    norms): the same greedy tokens as transformers; a ragged batch through the paged cache gives each prompt the
    same."""
    from tritonlm import hf

    theirs = _model(kind, seed=7)
    theirs.save_pretrained(tmp_path)
    ours = hf.from_pretrained(tmp_path, backend="reference", device=DEVICE, dtype=torch.float32)
    prompts = [torch.randint(0, 120, (n,), generator=torch.Generator().manual_seed(n)).to(DEVICE) for n in (9, 3)]
    ragged = ours.generate(prompts, max_new_tokens=10, temperature=0)
    for p, batched in zip(prompts, ragged):
        expected = theirs.generate(p[None], max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert ours.generate(p, max_new_tokens=10, temperature=0).tolist() == expected[0].tolist()
        assert batched.tolist() == expected[0].tolist()


def test_phi3_options_without_an_equivalent_are_refused():
    transformers_or_skip()
    from tritonlm import hf

    base = {"model_type": "phi3", **{k: v for k, v in BASE.items() if k != "router_aux_loss_coef"}}
    with pytest.raises(ValueError, match="'longrope' is not supported"):
        hf.model_config_from_hf({**base, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 4,
                                                          "long_factor": [1.0] * 4}})
    with pytest.raises(ValueError, match="resid_pdrop"):
        hf.model_config_from_hf({**base, "resid_pdrop": 0.1})
    with pytest.raises(ValueError, match="model_type 'phimoe' is not supported"):
        hf.model_config_from_hf({**base, "model_type": "phimoe"})


def _gradient_scales(grads32: dict) -> dict:
    """What each fp32 gradient's bf16 error is measured against: its own norm, but not below 1e-3 of the whole
    gradient's (a parameter whose gradient is a thousandth of the rest is below bf16's resolution: a NoPE layer's
    near-uniform attention, a key bias the softmax cancels, compare rounding noise with rounding noise)."""
    total = torch.stack([g.float().norm() for g in grads32.values()]).norm()
    return {name: torch.maximum(g.float().norm(), 1e-3 * total) for name, g in grads32.items()}


@pytest.mark.parametrize("kind", CHECKED_KINDS)
def test_apply_kernels_bf16_no_further_from_fp32_than_unpatched(kind):
    """bf16: the patched model's logits, loss and gradients against the fp32 model are no further off than the
    unpatched bf16 model's (each side against its fp32 twin)."""
    import copy

    from tritonlm import hf

    exact = _model(kind, seed=4).train()
    base = copy.deepcopy(exact).to(torch.bfloat16)
    patched = hf.apply_kernels(copy.deepcopy(base))
    ids = torch.randint(0, 120, (2, 13), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    results = []
    for model in (exact, base, patched):
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids, use_cache=False)
        out.loss.backward()
        with torch.no_grad():
            logits = model.eval()(ids).logits.float()
        model.train()
        results.append((out.loss.detach().float(), logits,
                        {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}))
    (loss32, logits32, grads32), (loss_ref, logits_ref, grads_ref), (loss, logits, grads) = results
    assert abs(loss - loss32) <= 2 * abs(loss_ref - loss32) + 1e-2
    assert (logits - logits32).norm() <= 2 * (logits_ref - logits32).norm() + 1e-2 * logits32.norm()
    scale = _gradient_scales(grads32)
    for name, g32 in grads32.items():
        err, err_ref = ((g[name] - g32).norm() / scale[name] for g in (grads, grads_ref))
        assert err <= 2 * err_ref + 0.02, (name, err, err_ref)


@pytest.mark.parametrize("kind", FUSED_KINDS)
def test_apply_kernels_packed_documents(kind):
    """Packed batches (``position_ids`` restarting per document, as ``DataCollatorWithFlattening`` makes them): the
    patched model runs them as varlen sequences; logits, loss and gradients equal the unpatched model's (fp32)."""
    import copy

    from tritonlm import hf

    base = _model(kind, seed=6)
    patched = hf.apply_kernels(copy.deepcopy(base))
    ids = torch.randint(0, 120, (1, 17), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    positions = torch.cat([torch.arange(6), torch.arange(4), torch.arange(7)])[None].to(DEVICE)
    labels = ids.clone()
    labels[0, [6, 10]] = -100  # (a document's first token is not predicted from the previous document)
    extra = {"output_router_logits": True} if kind.endswith("moe") else {}
    results = []
    for model in (patched, base):
        with torch.no_grad():
            logits = model.eval()(ids, position_ids=positions).logits
        model.train()
        loss = model(ids, position_ids=positions, labels=labels, use_cache=False, **extra).loss
        loss.backward()
        results.append((logits, loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (logits, loss, grads), (logits_ref, loss_ref, grads_ref) = results
    torch.testing.assert_close(logits, logits_ref, atol=3e-5, rtol=1e-4)
    torch.testing.assert_close(loss, loss_ref, atol=3e-5, rtol=1e-4)
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], atol=3e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("kind", CHECKED_KINDS)
def test_new_families_in_bf16_and_from_the_command_line(kind, tmp_path, capsys):
    """bf16: our from_pretrained model's loss and gradients against the fp32 checkpoint are no further off than
    transformers' own bf16 model's; ``tritonlm accounting --hf`` reads the directory."""
    from tritonlm import hf
    from tritonlm.cli import main

    theirs32 = _model(kind, seed=9).train()
    theirs32.save_pretrained(tmp_path / "hf")
    theirs16 = _model(kind, seed=9).to(torch.bfloat16).train()
    ours = hf.from_pretrained(tmp_path / "hf", backend="reference", device=DEVICE, dtype=torch.bfloat16).train()
    ids = torch.randint(0, 120, (2, 13), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    loss32, loss16 = theirs32(ids, labels=ids).loss, theirs16(ids, labels=ids).loss
    loss = ours.loss(ids, targets)
    for model_loss in (loss32, loss16, loss):
        model_loss.backward()
    assert abs(loss.float() - loss32) <= 2 * abs(loss16.float() - loss32) + 1e-2
    grads = hf_grads(ours)
    scale = _gradient_scales({name: p.grad for name, p in theirs32.named_parameters()})
    for name, p in theirs32.named_parameters():
        g16 = dict(theirs16.named_parameters())[name].grad.float()
        err, err_ref = ((g.float() - p.grad).norm() / scale[name] for g in (grads[name], g16))
        assert err <= 2 * err_ref + 0.02, (name, err, err_ref)
    assert main(["accounting", "--hf", str(tmp_path / "hf"), "--seq-len", "32"]) == 0
    assert "parameters" in capsys.readouterr().out.lower()


@pytest.mark.parametrize("kind", ["gemma2", "gemma3_text"])
def test_gemma_without_sliding_layers_round_trips(kind, tmp_path):
    """Issue 31: a Gemma 2 / 3 whose layers are all full attention saves a window size transformers accepts (it
    refuses a null sliding_window) and comes back as the same model."""
    transformers = transformers_or_skip()
    from tritonlm import hf

    config_class, model_class, extra = FAMILIES[kind]
    torch.manual_seed(3)
    theirs = getattr(transformers, model_class)(getattr(transformers, config_class)(
        **{k: v for k, v in BASE.items() if k != "router_aux_loss_coef"},
        **{**extra, "layer_types": ["full_attention"] * 2})).eval()
    theirs.save_pretrained(tmp_path / "theirs")
    ours = hf.from_pretrained(tmp_path / "theirs", backend="reference", dtype=torch.float32, device=DEVICE)
    assert ours.config.sliding_window is None and ours.config.model_type == kind
    back = hf_round_trip(ours, tmp_path / "ours", model_class)
    assert set(back.config.layer_types) == {"full_attention"}
