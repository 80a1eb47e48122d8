"""Gated DeltaNet hybrids built here (Qwen3.5's shape: linear-attention layers among gated full-attention ones): the
reference Gated DeltaNet layer against a recomputation written out here from its definition (fp64), the reference and
fused backends against each other (logits, loss, every gradient; fp32 / fp16 / bf16), packed documents against each
document alone, generation with recurrent caches (cached == uncached == ragged batch), accounting against the
model's own parameter count, and bad options refused."""

import pytest
import torch

from tritonlm import ModelConfig, TransformerLM, accounting
from tritonlm.modules import reference


def _config(**overrides):
    return ModelConfig(**{**dict(
        vocab_size=61, context_length=64, d_model=32, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, d_ff=48,
        linear_layers=(0, 1, 3), linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=12, linear_conv_kernel=4, attn_output_gate=True, norm_offset=True, qk_norm="head",
        partial_rotary=0.5, norm_eps=1e-6), **overrides})


def _model(cfg, backend="reference", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = TransformerLM(cfg, backend=backend, dtype=dtype)
    with torch.no_grad():  # the (1 + w) norms away from 0, the gated norm away from 1
        for name, p in model.named_parameters():
            if name.endswith("attn.norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("norm.weight") or ".ln" in name or name.startswith("ln"):
                p.uniform_(-0.3, 0.3)
    return model


def _layer_fp64(layer: reference.GatedDeltaNet, x: torch.Tensor) -> torch.Tensor:
    """The layer from its definition, one token and one head at a time, in fp64."""
    p = {n: t.detach().double() for n, t in layer.named_parameters()}
    x = x.double()
    batch, seq, _ = x.shape
    taps, heads, v_heads = layer.conv_kernel, layer.num_k_heads, layer.num_v_heads
    d_k, d_v = layer.head_k_dim, layer.head_v_dim
    mixed = x @ p["in_proj_qkv.weight"].T                                   # [batch, seq, channels]
    conv = torch.zeros_like(mixed)
    for t in range(seq):
        for j in range(taps):
            s = t - (taps - 1) + j
            if s >= 0:
                conv[:, t] += p["conv1d_weight"][:, 0, j] * mixed[:, s]
    conv = conv * torch.sigmoid(conv)
    q = conv[..., :heads * d_k].reshape(batch, seq, heads, d_k)
    k = conv[..., heads * d_k:2 * heads * d_k].reshape(batch, seq, heads, d_k)
    v = conv[..., 2 * heads * d_k:].reshape(batch, seq, v_heads, d_v)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    beta = torch.sigmoid(x @ p["in_proj_b.weight"].T)
    g = -torch.exp(p["A_log"]) * torch.log1p(torch.exp(x @ p["in_proj_a.weight"].T + p["dt_bias"]))
    z = (x @ p["in_proj_z.weight"].T).reshape(batch, seq, v_heads, d_v)
    out = torch.zeros(batch, seq, v_heads, d_v, dtype=torch.float64)
    for b in range(batch):
        for h in range(v_heads):
            state = torch.zeros(d_k, d_v, dtype=torch.float64)
            kh = h // (v_heads // heads)
            for t in range(seq):
                state = state * torch.exp(g[b, t, h])
                state = state + beta[b, t, h] * torch.outer(k[b, t, kh], v[b, t, h] - state.T @ k[b, t, kh])
                o = state.T @ q[b, t, kh] * d_k ** -0.5
                o = o / torch.sqrt((o * o).mean() + layer.norm.eps) * p["norm.weight"]
                out[b, t, h] = o * z[b, t, h] * torch.sigmoid(z[b, t, h])
    return out.reshape(batch, seq, v_heads * d_v) @ p["out_proj.weight"].T


def test_reference_layer_is_its_definition():
    torch.manual_seed(1)
    layer = reference.GatedDeltaNet(24, 2, 4, 8, 6, conv_kernel=3, norm_eps=1e-6, device="cpu", dtype=torch.float64)
    with torch.no_grad():
        layer.norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 11, 24, dtype=torch.float64)
    torch.testing.assert_close(layer(x), _layer_fp64(layer, x), atol=1e-10, rtol=1e-9)


def test_fused_equals_reference_fp32():
    """Logits, loss and every gradient of the fused model against the reference one (same weights), fp32."""
    cfg = _config()
    ref, fused = _model(cfg, "reference"), _model(cfg, "triton")
    fused.load_state_dict(ref.state_dict())
    assert list(ref.state_dict()) == list(fused.state_dict())
    ids = torch.randint(0, 61, (2, 37), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(fused(ids), ref(ids), atol=5e-5, rtol=1e-4)
    for model in (ref, fused):
        model.loss(ids, ids.roll(-1, dims=1)).backward()
    for (name, a), b in zip(ref.named_parameters(), fused.parameters()):
        size = a.grad.abs().max().clamp_min(1e-3)
        torch.testing.assert_close(b.grad / size, a.grad / size, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_16_bit_backends_no_further_from_fp64_than_the_reference(dtype):
    """In 16 bits each backend's loss and gradients against the same weights run in fp64: the fused model is no
    further off than the reference model in that dtype (twice its error, plus 1%)."""
    cfg = _config()
    ref, fused, exact = _model(cfg, "reference", dtype), _model(cfg, "triton", dtype), _model(cfg, "reference",
                                                                                          torch.float64)
    fused.load_state_dict(ref.state_dict())
    exact.load_state_dict({k: v.double() for k, v in ref.state_dict().items()})
    ids = torch.randint(0, 61, (2, 37), generator=torch.Generator().manual_seed(2))
    losses = [m.loss(ids, ids.roll(-1, dims=1)) for m in (ref, fused, exact)]
    for loss in losses:
        loss.backward()
    loss_ref, loss_fused, loss_exact = (loss.double() for loss in losses)
    assert abs(loss_fused - loss_exact) <= 2 * abs(loss_ref - loss_exact) + 1e-2
    for (name, a), b, e in zip(ref.named_parameters(), fused.parameters(), exact.parameters()):
        scale = e.grad.norm()
        err_ref = (a.grad.double() - e.grad).norm() / scale
        assert (b.grad.double() - e.grad).norm() / scale <= 2 * err_ref + 0.01, name


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_packed_documents_equal_each_document_alone(backend):
    model = _model(_config(), backend)
    ids = torch.randint(0, 61, (2, 30), generator=torch.Generator().manual_seed(3))
    documents = torch.tensor([[0] * 9 + [1] * 21, [0] * 30])
    packed = model(ids, document_ids=documents)
    torch.testing.assert_close(packed[0, :9], model(ids[:1, :9])[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(packed[0, 9:], model(ids[:1, 9:])[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(packed[1], model(ids[1:])[0], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_recurrent_caches_generate_what_the_uncached_model_does(backend):
    """A recurrent cache per linear layer (fixed size) beside the KV caches: greedy decoding with caches equals
    decoding by rerunning the whole sequence, alone and in a ragged batch (paged KV + per-sequence states)."""
    model = _model(_config(), backend).eval()
    prompts = [torch.randint(0, 61, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 5, 13)]
    ragged = model.generate(prompts, 7, temperature=0)
    for prompt, batched in zip(prompts, ragged):
        cached = model.generate(prompt, 7, temperature=0)
        assert cached.tolist() == model.generate(prompt, 7, temperature=0, use_cache=False).tolist()
        assert batched.tolist() == cached.tolist()
    caches = model.new_kv_caches()
    assert [type(c).__name__ for c in caches] == ["RecurrentCache", "RecurrentCache", "KVCache", "RecurrentCache"]


def test_accounting_counts_the_models_parameters():
    for cfg in (_config(), _config(num_experts=4, moe_d_ff=16, shared_expert_d_ff=24, experts_per_token=2)):
        model = TransformerLM(cfg)
        assert accounting.param_count(cfg) == sum(p.numel() for p in model.parameters())
    cfg = _config()
    flops = accounting.forward_flops(cfg, 32)
    # the linear layers' FLOPs from the model's own tensors: one multiply-add per weight (projections, conv taps) per
    # token, and 6·d_k·d_v per token and value head for the delta rule (Sᵀk, the rank-1 update, Sᵀq)
    layers = [m for m in TransformerLM(cfg).modules() if isinstance(m, reference.GatedDeltaNet)]
    weights = sum(p.numel() for m in layers for n, p in m.named_parameters()
                  if n.endswith("weight") and not n.startswith("norm"))
    assert flops["linear_attention"] == 32 * (2 * weights + len(layers) * 6 * 4 * 8 * 12)
    # the attention layer's cache grows with the length; the linear layers' states do not
    grows = accounting.kv_cache_bytes(cfg, 64) - accounting.kv_cache_bytes(cfg, 32)
    assert grows == 32 * 2 * 2 * 16 * 2  # one attention layer: keys and values, 2 heads x 16, bf16


@pytest.mark.parametrize("change, message", [
    (dict(linear_layers=(4,)), "linear_layers must be layer indices"),
    (dict(linear_num_value_heads=3), "multiple of linear_num_key_heads"),
    (dict(linear_key_head_dim=512), "head sizes up to 256"),
    (dict(norm_position="post"), "norm_position='pre'"),
    (dict(attn_output_gate=1), "attn_output_gate must be a bool"),
])
def test_bad_options_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        _config(**change)
