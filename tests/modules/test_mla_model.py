"""DeepSeek-V3-style models built here: the sigmoid group-limited router against a loop written from its definition
(and transformers' DeepseekV3TopkRouter / Glm4MoeTopkRouter when installed), multi-head latent attention against an
fp64 recomputation written out here, the reference and fused backends against each other (logits, loss, every
gradient, fp32 / fp16 / bf16), KV-cached, paged and packed runs against plain ones, accounting against the model's own
parameters, and bad options refused."""

import math

import pytest
import torch

from tritonlm import ModelConfig, TransformerLM, accounting
from tritonlm.modules import functional as F
from tritonlm.modules import fused, reference

from helpers import DTYPE_TOLERANCES


def _config(**overrides):
    return ModelConfig(**{**dict(
        vocab_size=61, context_length=48, d_model=32, num_layers=3, num_heads=4, d_ff=48, attention="mla",
        head_dim=12, q_lora_rank=20, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=10,
        num_experts=8, experts_per_token=3, moe_d_ff=16, moe_layers=(1, 2), router_scoring="sigmoid",
        router_choice_bias=True, router_groups=4, router_topk_groups=2, routed_scaling_factor=2.5,
        shared_expert_d_ff=32, shared_expert_gate=False, router_aux_loss_coef=0.0), **overrides})


def _model(cfg, backend="reference", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = TransformerLM(cfg, backend=backend, dtype=dtype)
    with torch.no_grad():  # norms, the correction bias and the router away from their neutral starts
        for name, t in model.state_dict().items():
            if name.endswith("choice_bias"):
                t.normal_(0, 0.2)
            elif name.endswith("norm.weight") or name.startswith("ln") or ".ln" in name:
                t.uniform_(0.5, 1.5)
            elif name.endswith("router.weight"):
                t.normal_(0, 0.5)
    return model


def _router_by_definition(x, weight, bias, top_k, n_group, topk_group, scale, norm):
    """DeepSeek-V3's routing one token at a time in fp64: sigmoid scores, groups ranked by their two best biased
    scores, the best biased experts of the kept groups, weights from the unbiased scores."""
    scores = torch.sigmoid(x.double() @ weight.double().t())
    out_w, out_i = [], []
    per = weight.shape[0] // n_group
    for row in scores:
        biased = row + bias.double()
        ranked = sorted(range(n_group), key=lambda g: -float(biased[g * per:(g + 1) * per].topk(2).values.sum()))
        allowed = [e for g in ranked[:topk_group] for e in range(g * per, (g + 1) * per)]
        chosen = sorted(allowed, key=lambda e: -float(biased[e]))[:top_k]
        w = row[chosen]
        if norm:
            w = w / (w.sum() + 1e-20)
        out_w.append(w * scale)
        out_i.append(chosen)
    return torch.stack(out_w), torch.tensor(out_i)


@pytest.mark.parametrize("norm", [True, False])
def test_sigmoid_router_against_its_definition(norm):
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(2, 7, 16, generator=gen), torch.randn(12, 16, generator=gen) * 0.5
    bias = torch.randn(12, generator=gen) * 0.3
    logits, weights, index = F.moe_router(x, weight, 3, norm, scoring="sigmoid", choice_bias=bias, n_group=4,
                                          topk_group=2, routed_scaling_factor=2.5)
    expected_w, expected_i = _router_by_definition(x.reshape(-1, 16), weight, bias, 3, 4, 2, 2.5, norm)
    torch.testing.assert_close(logits.double(), x.reshape(-1, 16).double() @ weight.double().t(), atol=1e-5,
                               rtol=1e-5)
    order, expected_order = index.sort(-1), expected_i.sort(-1)
    assert torch.equal(order.values, expected_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices).double(),
                               expected_w.gather(1, expected_order.indices), atol=1e-6, rtol=1e-6)
    # the bias moves the choice only: with a huge bias on expert 5 every token picks it, at its unbiased score
    big = torch.zeros(12)
    big[5] = 100.0
    _, w, i = F.moe_router(x, weight, 3, False, scoring="sigmoid", choice_bias=big, n_group=4, topk_group=2)
    picked = (i == 5).nonzero()
    assert picked.shape[0] == 14
    torch.testing.assert_close(w[picked[:, 0], picked[:, 1]], torch.sigmoid(x.reshape(-1, 16) @ weight[5]))


@pytest.mark.parametrize("router", ["DeepseekV3TopkRouter", "Glm4MoeTopkRouter"])
def test_sigmoid_router_matches_transformers(router):
    transformers = pytest.importorskip("transformers", reason="the optional extra: pip install 'tritonlm[hf]'")
    module = {"DeepseekV3TopkRouter": transformers.models.deepseek_v3.modeling_deepseek_v3,
              "Glm4MoeTopkRouter": transformers.models.glm4_moe.modeling_glm4_moe}[router]
    config = (transformers.DeepseekV3Config if router.startswith("Deepseek") else transformers.Glm4MoeConfig)(
        hidden_size=16, n_routed_experts=12, num_experts_per_tok=3, n_group=3, topk_group=2, routed_scaling_factor=1.7)
    theirs = getattr(module, router)(config)
    torch.manual_seed(1)
    with torch.no_grad():
        theirs.weight.normal_(0, 0.5)
        theirs.e_score_correction_bias.normal_(0, 0.2)
    x = torch.randn(5, 3, 16)
    logits, weights, index = theirs(x)
    ours = F.moe_router(x, theirs.weight, 3, True, scoring="sigmoid", choice_bias=theirs.e_score_correction_bias,
                        n_group=3, topk_group=2, routed_scaling_factor=1.7)
    torch.testing.assert_close(ours[0], logits)
    a, b = index.sort(-1), ours[2].sort(-1)
    assert torch.equal(a.values, b.values)
    torch.testing.assert_close(ours[1].gather(1, b.indices), weights.gather(1, a.indices))


def _mla_by_hand(attn: reference.MultiHeadLatentAttention, x: torch.Tensor) -> torch.Tensor:
    """DeepseekV3Attention's maths in fp64, written out from its description (no module code reused): the low-rank
    query, the latent and its shared rotary key, RoPE on interleaved pairs of the last features, causal softmax."""
    p = {k: v.double() for k, v in attn.state_dict().items()}
    x = x.double()
    seq, h, nope, rope, dv = x.shape[-2], attn.num_heads, attn.nope, attn.rope_dim, attn.v_dim

    def rms(t, w, eps):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps) * w

    q = rms(x @ p["q_a_proj.weight"].t(), p["q_a_norm.weight"], attn.q_a_norm.eps) @ p["q_b_proj.weight"].t()
    q = q.view(*x.shape[:-1], h, nope + rope).transpose(-3, -2)
    a = x @ p["kv_a_proj.weight"].t()
    latent, k_rot = a[..., :attn.kv_lora_rank], a[..., attn.kv_lora_rank:]
    kv = (rms(latent, p["kv_a_norm.weight"], attn.kv_a_norm.eps) @ p["kv_b_proj.weight"].t())
    kv = kv.view(*x.shape[:-1], h, nope + dv).transpose(-3, -2)
    pos = torch.arange(seq, dtype=torch.float64)
    inv = attn.rope.theta ** (-torch.arange(0, rope, 2, dtype=torch.float64) / rope)
    cos, sin = torch.cos(pos[:, None] * inv), torch.sin(pos[:, None] * inv)

    def turn(t):  # pairs (t[2i], t[2i+1]) by angle pos * inv[i]
        even, odd = t[..., 0::2], t[..., 1::2]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)

    q = torch.cat((q[..., :nope], turn(q[..., nope:])), dim=-1)
    k = torch.cat((kv[..., :nope], turn(k_rot).unsqueeze(-3).expand(*kv.shape[:-1], rope)), dim=-1)
    v = kv[..., nope:]
    s = q @ k.transpose(-1, -2) / math.sqrt(nope + rope)
    s = s.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    out = (torch.softmax(s, -1) @ v).transpose(-3, -2).reshape(*x.shape[:-1], h * dv)
    return out @ p["output_proj.weight"].t()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_latent_attention_against_fp64_by_hand(backend):
    model = _model(_config(), backend)
    attn = model.layers[0].attn
    x = torch.randn(2, 3, 13, 32)  # two leading dims
    torch.testing.assert_close(attn(x).double(), _mla_by_hand(attn, x), atol=2e-5, rtol=1e-4)
    kind = fused.MultiHeadLatentAttention if backend == "triton" else reference.MultiHeadLatentAttention
    assert type(attn) is kind and attn.output_proj.weight.shape == (32, 4 * 10)


@pytest.mark.parametrize("dtype, tol", DTYPE_TOLERANCES)
def test_fused_matches_reference(dtype, tol):
    """Same state_dict keys; logits, loss and every gradient of the MLA + sigmoid-routed MoE model agree between the
    backends (dense first layer, MoE layers with ungated shared experts, the choice bias a buffer)."""
    cfg = _config()
    ref = _model(cfg, dtype=dtype)
    fz = TransformerLM(cfg, backend="triton", dtype=dtype)
    assert list(ref.state_dict()) == list(fz.state_dict())
    keys = ref.state_dict()
    assert "layers.1.ffn.choice_bias" in keys and "layers.1.ffn.shared_expert_gate.weight" not in keys
    assert "layers.0.ffn.w1.weight" in keys and "layers.0.attn.kv_b_proj.weight" in keys
    assert not any(n.endswith("choice_bias") for n, _ in ref.named_parameters())  # (a buffer, not trained)
    if dtype != torch.float32:
        # 16-bit rounding differs between the backends' hidden states, and a token whose experts' scores nearly tie
        # may choose differently (a jump, not an error): correction biases 1.5 apart fix every token's choice here
        # (the choice itself is checked in fp32 and by the router tests); the weights still follow the inputs
        for layer in ref.layers[1:]:
            layer.ffn.choice_bias.copy_(torch.randperm(8, generator=torch.Generator().manual_seed(0)) * 1.5)
    fz.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 61, (2, 17), generator=torch.Generator().manual_seed(2))
    results = []
    for model in (ref, fz):
        model.train()
        loss = model.loss(ids[:, :-1], ids[:, 1:])
        loss.backward()
        with torch.no_grad():
            logits = model(ids)
        results.append((loss, logits))
    scale = 8 if dtype != torch.float32 else 4
    torch.testing.assert_close(results[1][0].float(), results[0][0].float(), atol=tol["atol"] * scale,
                               rtol=tol["rtol"] * scale)
    if dtype == torch.float32:  # (16-bit rounding may flip a near-tie expert choice for a token: logits jump there)
        torch.testing.assert_close(results[1][1], results[0][1], atol=1e-4, rtol=1e-4)
    for (name, a), b in zip(ref.named_parameters(), fz.parameters()):
        size = a.grad.float().abs().max().clamp_min(1e-3)
        torch.testing.assert_close(b.grad.float() / size, a.grad.float() / size, atol=tol["atol"] * 5,
                                   rtol=tol["rtol"] * 5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_cached_paged_and_packed_runs_equal_plain_ones(backend):
    """Greedy decoding with the (latent) KV cache equals decoding without it; a ragged batch through the paged cache
    gives each prompt the same tokens; packed documents give each document's logits as if alone. With no q
    bottleneck."""
    model = _model(_config(q_lora_rank=None, num_layers=2, moe_layers=(1,)), backend).eval()
    prompts = [torch.randint(0, 61, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 3)]
    ragged = model.generate(prompts, 8, temperature=0)
    for p, batched in zip(prompts, ragged):
        cached = model.generate(p, 8, temperature=0)
        assert torch.equal(cached, model.generate(p, 8, temperature=0, use_cache=False))
        assert torch.equal(batched, cached)
    # the caches hold the normed latent and the rotated shared key (16 + 4 numbers a token), not every head's K / V
    cache = model.last_generation_cache
    assert cache["pool_bytes"] == 2 * cache["pool_blocks"] * cache["page_size"] * (16 + 4) * 4
    caches = model.new_kv_caches(reserve=8)
    with torch.no_grad():
        model(prompts[0][None], kv_caches=caches)
    assert caches[0].k.shape[-3:] == (1, 8, 16) and caches[0].v.shape[-3:] == (1, 8, 4)
    ids = torch.randint(0, 61, (1, 15), generator=torch.Generator().manual_seed(4))
    docs = torch.tensor([[0] * 6 + [1] * 9])
    with torch.no_grad():
        packed = model(ids, document_ids=docs)
        alone = torch.cat([model(ids[:, :6]), model(ids[:, 6:])], dim=1)
    torch.testing.assert_close(packed, alone, atol=2e-5, rtol=1e-4)


def test_accounting_counts_the_model():
    """Parameters equal the model's own count (with and without the q bottleneck and biases); the KV cache holds
    compressed latent and the shared rotary key per token and layer; attention FLOPs use the value heads' width for
    P·V."""
    for cfg in (_config(), _config(q_lora_rank=None), _config(qkv_bias=True, attn_out_bias=True)):
        assert accounting.param_count(cfg) == sum(p.numel() for p in TransformerLM(cfg).parameters())
    cfg = _config()
    assert accounting.kv_cache_bytes(cfg, 100, dtype="bf16") == 3 * 100 * (16 + 4) * 2
    assert accounting.forward_flops(cfg, 16)["attention_matmuls"] == 3 * 2 * 16 * 16 * 4 * (12 + 10)


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="head_dim must be qk_nope_head_dim"):
        _config(head_dim=16)
    with pytest.raises(ValueError, match="num_kv_heads"):
        _config(num_kv_heads=2)
    with pytest.raises(ValueError, match="need router_scoring='sigmoid'"):
        _config(router_scoring="softmax")
    with pytest.raises(ValueError, match="router_groups"):
        _config(router_groups=3)
    with pytest.raises(ValueError, match="attention must be"):
        _config(attention="latent")
    with pytest.raises(ValueError, match="scoring must be"):
        F.moe_router(torch.randn(2, 8), torch.randn(4, 8), 2, scoring="tanh")
    with pytest.raises(ValueError, match="top_k=3 exceeds"):
        F.moe_router(torch.randn(2, 8), torch.randn(4, 8), 3, scoring="sigmoid", n_group=4, topk_group=2)
