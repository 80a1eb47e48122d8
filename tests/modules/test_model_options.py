"""The model options real checkpoints need (tied embeddings, norm epsilon, RoPE scaling) and the KV cache that grows
with use, on TransformerLM itself.
"""

import pytest
import torch

from tritonlm import ModelConfig, TransformerLM

from helpers import (
    DEVICE,
    LLAMA3_SCALING,
)


# ----------------------------------------------------------------------------------------------------
# the model options real checkpoints need
# ----------------------------------------------------------------------------------------------------
def test_model_options_defaults_and_tying():
    cfg = ModelConfig(vocab_size=50, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=64)
    assert (cfg.norm_eps, cfg.tie_embeddings, cfg.rope_scaling) == (1e-5, False, None)
    cs336 = TransformerLM.from_config(cfg)
    tied = TransformerLM.from_config(cfg.replace(tie_embeddings=True, norm_eps=1e-6))
    assert tied.lm_head.weight is tied.token_embeddings.weight
    assert all(m.eps == 1e-6 for m in tied.modules() if hasattr(m, "eps"))
    # one RoPE module (its tables) shared by every layer
    assert tied.layers[0].attn.rope is tied.layers[1].attn.rope
    # a CS336 (untied) state_dict loads: both keys present, the head's matrix is the one that stays
    tied.load_state_dict(cs336.state_dict())
    assert torch.equal(tied.token_embeddings.weight, cs336.lm_head.weight)
    from tritonlm.accounting import param_count

    assert param_count(cfg.replace(tie_embeddings=True)) == sum(p.numel() for p in tied.parameters())
    assert param_count(cfg) == sum(p.numel() for p in cs336.parameters())
    with pytest.raises(ValueError, match="dynamic"):
        cfg.replace(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="norm_eps"):
        cfg.replace(norm_eps=0.0)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_tied_model_trains_both_uses(backend):
    """The shared matrix gets the gradient of both uses: equal to an untied model's two gradients summed."""
    cfg = ModelConfig(vocab_size=50, context_length=16, d_model=32, num_layers=1, num_heads=4, d_ff=64,
                      tie_embeddings=True, rope_scaling=LLAMA3_SCALING)
    tied = TransformerLM.from_config(cfg, backend=backend, device=DEVICE)
    untied = TransformerLM.from_config(cfg.replace(tie_embeddings=False), backend=backend, device=DEVICE)
    untied.load_state_dict(tied.state_dict())
    ids = torch.randint(0, 50, (2, 9)).to(DEVICE)
    tied.loss(ids[:, :-1], ids[:, 1:]).backward()
    untied.loss(ids[:, :-1], ids[:, 1:]).backward()
    torch.testing.assert_close(tied.lm_head.weight.grad,
                               untied.lm_head.weight.grad + untied.token_embeddings.weight.grad, atol=1e-6, rtol=1e-5)


def test_kv_cache_grows_with_use():
    """A model with a 131072-position context allocates for prompt + new tokens, not its whole context; a cache
    that outgrows its first allocation keeps every cached position."""
    from tritonlm.modules.reference import KVCache

    model = TransformerLM(vocab_size=50, context_length=131072, d_model=32, num_layers=2, num_heads=2, d_ff=64,
                          rope_theta=10000.0).to(DEVICE)
    made = []
    real = model.new_kv_caches
    model.new_kv_caches = lambda *a, **k: made.append(real(*a, **k)) or made[-1]
    out = model.generate(torch.tensor([1, 2, 3]).to(DEVICE), max_new_tokens=2, temperature=0)
    assert out.shape == (5,)
    assert made and all(c.capacity <= 5 for c in made[0])
    cache, keys = KVCache(64, reserve=2), []
    for n in (1, 2, 4, 1):
        k = torch.randn(1, 2, n, 4)
        keys.append(k)
        got_k, got_v = cache.update(k, k + 1)
    assert cache.capacity < 64
    torch.testing.assert_close(got_k, torch.cat(keys, dim=-2))
    torch.testing.assert_close(got_v, torch.cat(keys, dim=-2) + 1)
