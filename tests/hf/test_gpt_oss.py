"""gpt-oss against transformers' own ``GptOssForCausalLM`` on a tiny random checkpoint made here: attention sinks,
q/k/v/o biases, sliding and full layers, YaRN RoPE, the biased router (softmax over the chosen logits) and biased
experts with the clamped SwiGLU. from_pretrained (logits, the loss with the load-balancing term, every gradient,
sinks and biases included; both backends), save_pretrained read back by transformers, apply_kernels (padded and
packed batches, fp32 and bf16), greedy and ragged-batch generation, bf16 loading, and MXFP4 files refused.

Needs the optional extra (``pip install 'tritonlm[hf]'``); skipped with that reason when it is absent.
"""

import copy
import json

import pytest
import torch

from helpers import DEVICE, hf_grads, hf_round_trip, transformers_or_skip

SIZES = dict(hidden_size=32, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             num_hidden_layers=2, vocab_size=100, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
             max_position_embeddings=64, swiglu_limit=1.0, router_aux_loss_coef=0.02, output_router_logits=True, pad_token_id=0,
             rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "truncate": False, "original_max_position_embeddings": 16, "rope_theta": 1000.0})


def _model(seed=0, dtype=torch.float32):
    transformers = transformers_or_skip()
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**SIZES))
    with torch.no_grad():  # biases and sinks start at 0: make them matter; experts large enough to reach the clamp;
        # a router whose choices have margins bf16 rounding does not flip
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0, 0.5)
            elif ".experts." in name or name.endswith("router.weight"):
                p.normal_(0, 0.3)
    return model.to(device=DEVICE, dtype=dtype).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt-oss")
    model = _model()
    model.save_pretrained(path)
    return path, model


def _ids(batch=2, seq=13, seed=1):
    return torch.randint(0, 100, (batch, seq), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_from_pretrained_matches_transformers(saved, backend):
    from tritonlm import hf

    path, theirs = saved
    ours = hf.from_pretrained(path, backend=backend, device=DEVICE, dtype=torch.float32)
    cfg = ours.config
    assert (cfg.attention_sinks, cfg.router_bias, cfg.expert_bias, cfg.expert_activation, cfg.swiglu_limit,
            cfg.sliding_layers, cfg.rope_scaling["rope_type"]) == (True, True, True, "swiglu_clamped", 1.0, (0,), "yarn")
    ids = _ids()
    theirs.zero_grad()
    expected = theirs(ids, labels=ids, output_router_logits=True)
    torch.testing.assert_close(ours(ids), expected.logits, atol=2e-5, rtol=1e-4)
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    ours.train()
    loss = ours.loss(ids, targets)  # + coef x load-balancing loss, as transformers adds it
    torch.testing.assert_close(loss, expected.loss, atol=2e-5, rtol=1e-5)
    expected.loss.backward()
    loss.backward()
    grads = hf_grads(ours)
    for name, p in theirs.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=2e-5, rtol=1e-4, msg=name)
    assert grads["model.layers.0.self_attn.sinks"].abs().max() > 0


def test_save_pretrained_round_trip(saved, tmp_path):
    from tritonlm import hf

    path, _ = saved
    ours = hf.from_pretrained(path, backend="reference", device=DEVICE, dtype=torch.float32)
    back = hf_round_trip(ours, tmp_path, "GptOssForCausalLM", seq=15)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "gpt_oss" and back.config.rope_parameters["rope_type"] == "yarn"


def _loss_and_grads(model, **batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def test_apply_kernels_matches_unpatched(saved):
    """Norms, RoPE (one value per pair in gpt-oss's tables), attention with its sinks, the experts read in place,
    the loss: logits on a left-padded batch, the loss with the load-balancing term and every gradient equal the
    unpatched model's (fp32); a packed batch (position_ids restarting) runs as varlen sequences, equal too."""
    from tritonlm import hf

    _, base = saved
    base = copy.deepcopy(base)
    patched = hf.apply_kernels(copy.deepcopy(base))
    tags = {getattr(m, "_tritonlm_patch", None) for m in patched.modules()}
    assert {"rms_norm", "rope", "moe", "loss"} <= tags and patched.config._attn_implementation == "tritonlm"
    ids = _ids(seed=3)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        got, want = patched(ids, attention_mask=mask).logits, base(ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=3e-5, rtol=1e-4)
    batch = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100), output_router_logits=True)
    results = [_loss_and_grads(m.train(), **batch) for m in (patched, base)]
    torch.testing.assert_close(results[0][0], results[1][0], atol=3e-5, rtol=1e-4)
    for name, g in results[1][1].items():
        torch.testing.assert_close(results[0][1][name], g, atol=3e-5, rtol=1e-4, msg=name)
    # packed documents
    packed = _ids(batch=1, seq=15, seed=4)
    positions = torch.cat([torch.arange(6), torch.arange(9)])[None].to(DEVICE)
    labels = packed.clone()
    labels[0, 6] = -100
    results = [_loss_and_grads(m.train(), input_ids=packed, position_ids=positions, labels=labels)
               for m in (patched, base)]
    torch.testing.assert_close(results[0][0], results[1][0], atol=3e-5, rtol=1e-4)
    for name, g in results[1][1].items():
        torch.testing.assert_close(results[0][1][name], g, atol=3e-5, rtol=1e-4, msg=name)


def _bf16_no_further(losses, grads32, grads_ref, grads):
    """The loss and the whole gradient (one norm over every parameter) no further from fp32 than transformers'
    bf16 (2x its error plus a small floor), and each parameter's gradient within 3x plus 0.03: bf16 noise in a
    40-parameter MoE model (a router choice a rounding flips, a sum over few tokens) moves single parameters by
    more than the whole."""
    (loss32, loss_ref, loss) = losses
    assert abs(loss - loss32) <= 2 * abs(loss_ref - loss32) + 1e-2
    whole = [torch.stack([(g[n] - g32).norm() for n, g32 in grads32.items()]).norm() for g in (grads, grads_ref)]
    total = torch.stack([g.norm() for g in grads32.values()]).norm()
    assert whole[0] <= 2 * whole[1] + 0.01 * total, whole
    for name, g32 in grads32.items():
        scale = torch.maximum(g32.norm(), 1e-3 * total)
        err, err_ref = ((g[name] - g32).norm() / scale for g in (grads, grads_ref))
        assert err <= 3 * err_ref + 0.03, (name, err, err_ref)


def test_bf16_no_further_from_fp32_than_transformers(saved):
    """bf16: our from_pretrained model, and transformers' model patched by apply_kernels, are each no further from
    the fp32 model (loss, every gradient) than transformers' own bf16 model."""
    from tritonlm import hf

    path, theirs32 = saved
    ids = _ids(seed=5)
    exact = copy.deepcopy(theirs32).train()
    theirs16 = copy.deepcopy(theirs32).to(torch.bfloat16).train()
    patched = hf.apply_kernels(copy.deepcopy(theirs16))
    results = [_loss_and_grads(m, input_ids=ids, labels=ids) for m in (exact, theirs16, patched)]
    (l32, g32), (l16, g16), (lp, gp) = results
    _bf16_no_further((l32, l16.float(), lp.float()), g32, g16, gp)
    ours = hf.from_pretrained(path, backend="reference", device=DEVICE, dtype=torch.bfloat16).train()
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    loss = ours.loss(ids, targets)  # (training, output_router_logits true: + the load-balancing term, as theirs)
    loss.backward()
    ours_grads = {n: g.float() for n, g in hf_grads(ours).items()}
    _bf16_no_further((l32, l16.float(), loss.detach().float()), g32, g16, ours_grads)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_greedy_and_ragged_generation_equal_transformers(saved, backend):
    """Past the sliding window (KV cache, windowed layer, sinks in the decode kernel's path): greedy tokens equal
    transformers'; a ragged batch through the paged cache gives each prompt the same."""
    from tritonlm import hf

    path, theirs = saved
    ours = hf.from_pretrained(path, backend=backend, device=DEVICE, dtype=torch.float32)
    prompts = [torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(n)).to(DEVICE) for n in (9, 2)]
    ragged = ours.generate(prompts, max_new_tokens=10, temperature=0)
    for p, batched in zip(prompts, ragged):
        expected = theirs.generate(p[None], max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert ours.generate(p, max_new_tokens=10, temperature=0).tolist() == expected[0].tolist()
        assert batched.tolist() == expected[0].tolist()


def test_mxfp4_checkpoints_are_refused_before_any_weight_is_read(tmp_path):
    """The published gpt-oss files hold MXFP4 experts: a one-line error naming the quantisation, never wrong
    weights (no safetensors file needed: the config is read first)."""
    from tritonlm import hf

    config = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], **SIZES,
              "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method='mxfp4'") as info:
        hf.from_pretrained(tmp_path)
    assert "\n" not in str(info.value)
