"""Mixture-of-experts models: the router and load-balancing loss against transformers' and an independent count,
reference vs fused MoE layers, the model options, training, accounting and KV-cached generation."""

import pytest
import torch

from tritonlm import ModelConfig, TransformerLM, accounting
from tritonlm.modules import functional as F
from tritonlm.modules import fused, reference

from helpers import DTYPE_TOLERANCES


@pytest.fixture(scope="module")
def moe_config():
    return ModelConfig.preset("tiny-moe", vocab_size=61, context_length=24, num_layers=2, d_model=32, num_heads=2,
                              d_ff=48, moe_d_ff=24, num_experts=5, experts_per_token=2)


def test_router_matches_mixtral_and_qwen3_semantics():
    """fp32 softmax over experts, the top-k probabilities, renormalised or not; logits in the input's dtype."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 4, 16, generator=gen, dtype=torch.bfloat16)
    weight = torch.randn(6, 16, generator=gen, dtype=torch.bfloat16)
    logits, weights, index = F.moe_router(hidden, weight, 2)
    expected_logits = hidden.reshape(-1, 16).float() @ weight.float().t()
    assert logits.dtype == torch.bfloat16 and logits.shape == (12, 6)
    torch.testing.assert_close(logits.float(), expected_logits, atol=0.1, rtol=0.02)
    probs = torch.softmax(logits.float(), -1)
    top, idx = probs.topk(2, -1)
    assert torch.equal(index, idx) and weights.dtype == torch.float32
    torch.testing.assert_close(weights, top / top.sum(-1, keepdim=True))
    torch.testing.assert_close(F.moe_router(hidden, weight, 2, norm_topk_prob=False)[1], top)


def _independent_balance_loss(logits_per_layer, experts, top_k, mask=None):
    """Switch Transformer eq. 4-6 counted with Python loops: f_e = assignments / rows, P_e = mean probability."""
    counts, probs_sum, rows = [0.0] * experts, [0.0] * experts, 0.0
    for logits in logits_per_layer:
        probs = torch.softmax(logits.double(), -1)
        for t in range(probs.shape[0]):
            keep = 1.0 if mask is None else float(mask.reshape(-1)[t])
            rows += keep
            for e in probs[t].topk(top_k).indices.tolist():
                counts[e] += keep
            for e in range(experts):
                probs_sum[e] += keep * float(probs[t, e])
    return experts * sum(counts[e] / rows * probs_sum[e] / rows for e in range(experts))


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_against_a_count_and_transformers(masked):
    gen = torch.Generator().manual_seed(1)
    layers = [torch.randn(10, 5, generator=gen) for _ in range(3)]
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]) if masked else None
    ours = F.load_balancing_loss(layers, 5, 2, mask)
    assert abs(float(ours) - _independent_balance_loss(layers, 5, 2, mask)) < 1e-5
    transformers = pytest.importorskip("transformers", reason="the hf extra compares with transformers itself")
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    assert transformers is not None
    theirs = load_balancing_loss_func(tuple(layers), 5, 2, mask)
    torch.testing.assert_close(ours, theirs.float())


def test_moe_config_validation():
    base = ModelConfig.preset("tiny")
    with pytest.raises(ValueError, match="experts_per_token"):
        base.replace(num_experts=2, experts_per_token=3)
    with pytest.raises(ValueError, match="SwiGLU experts"):
        base.replace(num_experts=4, ffn="relu")
    with pytest.raises(ValueError, match="moe_layers"):
        base.replace(num_experts=4, moe_layers=(0, 9))
    with pytest.raises(ValueError, match="num_experts"):
        base.replace(num_experts=-1)
    cfg = base.replace(num_experts=4, moe_layers=[1, 3])
    assert cfg.moe_layers == (1, 3) and ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True]


@pytest.mark.parametrize("dtype, tol", DTYPE_TOLERANCES)
def test_fused_moe_model_matches_reference(moe_config, dtype, tol):
    """Same state_dict keys; loss (with the aux loss), logits and every gradient agree between the per-expert loop
    and the grouped GEMMs; a shared expert and dense layers mixed in."""
    cfg = moe_config.replace(shared_expert_d_ff=16, moe_layers=(1,))
    torch.manual_seed(0)
    ref = TransformerLM(cfg, dtype=dtype)
    fz = TransformerLM(cfg, dtype=dtype, backend="triton")
    assert list(ref.state_dict()) == list(fz.state_dict())
    assert "layers.1.ffn.experts.gate_up_proj" in ref.state_dict() and "layers.0.ffn.w1.weight" in ref.state_dict()
    assert "layers.1.ffn.shared_expert_gate.weight" in ref.state_dict()
    fz.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 61, (2, 13))
    losses = []
    for model in (ref, fz):
        model.train()
        loss = model.loss(ids[:, :-1], ids[:, 1:])
        loss.backward()
        losses.append(loss)
    scale = 8 if dtype != torch.float32 else 4
    torch.testing.assert_close(losses[1].float(), losses[0].float(), atol=tol["atol"] * scale, rtol=tol["rtol"] * scale)
    for (name, a), b in zip(ref.named_parameters(), fz.parameters()):
        size = a.grad.float().abs().max().clamp_min(1e-3)
        # (measured worst: fp32 9e-7, fp16 2e-3, bf16 4e-2 of the largest element: both sides round in the dtype)
        torch.testing.assert_close(b.grad.float() / size, a.grad.float() / size, atol=tol["atol"] * 5,
                                   rtol=tol["rtol"] * 5, msg=lambda m, n=name: f"{n}: {m}")


def test_aux_loss_joins_training_loss_only(moe_config):
    torch.manual_seed(0)
    model = TransformerLM(moe_config.replace(router_aux_loss_coef=0.5))
    ids = torch.randint(0, 61, (2, 9))
    model.train()
    with_aux = model.loss(ids[:, :-1], ids[:, 1:])
    aux = model.router_aux_loss()
    plain = model.loss(ids[:, :-1], ids[:, 1:], aux_loss=False)
    torch.testing.assert_close(with_aux, plain + 0.5 * aux)
    model.eval()
    torch.testing.assert_close(model.loss(ids[:, :-1], ids[:, 1:]), plain)
    load = model.expert_load()
    assert load.shape == (5,) and abs(float(load.sum()) - 1) < 1e-9
    # the load counts every layer's routed pairs: 2 layers x 16 tokens x 2 slots
    assert sum(int(layer.ffn.expert_tokens.sum()) for layer in model.layers) == 2 * 16 * 2


def test_kv_cached_generation_of_a_moe_model(moe_config):
    torch.manual_seed(0)
    model = TransformerLM(moe_config, backend="triton")
    prompt = torch.randint(0, 61, (2, 5))
    cached = model.generate(prompt, 6, temperature=0)
    uncached = model.generate(prompt, 6, temperature=0, use_cache=False)
    assert torch.equal(cached, uncached)


def test_fuse_converts_moe_layers(moe_config):
    model = TransformerLM(moe_config)
    import tritonlm

    tritonlm.fuse(model)
    assert type(model.layers[0].ffn) is fused.MoEFFN and type(model.layers[0].ffn.experts) is fused.MoEExperts
    tritonlm.unfuse(model)
    assert type(model.layers[0].ffn.experts) is reference.MoEExperts


def test_accounting_counts_total_and_active(moe_config):
    """Total parameters hold every expert; active ones a token's K experts; both equal the model's own count /
    a count of the parameters a token touches; FLOPs follow the active count."""
    cfg = moe_config.replace(shared_expert_d_ff=16)
    model = TransformerLM(cfg)
    assert accounting.param_count(cfg) == sum(p.numel() for p in model.parameters())
    expert = 3 * cfg.d_model * cfg.expert_d_ff
    assert accounting.param_count(cfg) - accounting.param_count(cfg, active=True) == \
        cfg.num_layers * (cfg.num_experts - cfg.experts_per_token) * expert
    dense = cfg.replace(num_experts=0)
    f_moe, f_dense = accounting.forward_flops(cfg, 16)["ffn"], accounting.forward_flops(dense, 16)["ffn"]
    per_token_layer = 2 * (cfg.num_experts * cfg.d_model + cfg.experts_per_token * expert
                           + 3 * cfg.d_model * 16 + cfg.d_model)
    assert f_moe == cfg.num_layers * 16 * per_token_layer
    assert f_dense == cfg.num_layers * 16 * 2 * 3 * cfg.d_model * cfg.d_ff
