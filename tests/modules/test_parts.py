"""The layer parts (``tritonlm.modules.parts``) against the modules they build: their accounting against the built
module's own parameters and cache tensors, their Hugging Face names against its ``state_dict``, the MoE experts'
layout transforms against the layouts' definitions."""

from types import SimpleNamespace

import pytest
import torch

from tritonlm.modules import ModelConfig, TransformerLM
from tritonlm.modules.cache import KVCache, RecurrentCache
from tritonlm.modules.model import components
from tritonlm.modules.parts import (
    MIXERS,
    MLPS,
    AttentionSpec,
    DenseMLPSpec,
    GatedDeltaNetSpec,
    LatentAttentionSpec,
    MoESpec,
    flop_categories,
)

MIXER_SPECS = [
    AttentionSpec(48, 6, 32, 10000.0),
    AttentionSpec(48, 6, 32, 10000.0, num_kv_heads=2, head_dim=10, qkv_bias=True, qk_norm="head", out_bias=True),
    AttentionSpec(48, 4, 32, 10000.0, num_kv_heads=2, qk_norm="projection", rotary_dim=6, window=5),
    AttentionSpec(48, 4, 32, None, sinks=True, output_gate=True, softcap=20.0),
    LatentAttentionSpec(48, 4, 32, 10000.0, q_lora_rank=None, kv_lora_rank=12, qk_nope_head_dim=6,
                        qk_rope_head_dim=4, v_head_dim=10),
    LatentAttentionSpec(48, 4, 32, 10000.0, q_lora_rank=20, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4,
                        v_head_dim=10, qkv_bias=True, out_bias=True),
    GatedDeltaNetSpec(48, 2, 4, 8, 6, conv_kernel=3),
]
MLP_SPECS = [
    DenseMLPSpec(48, 40),
    DenseMLPSpec(48, 40, "geglu", bias=True),
    DenseMLPSpec(48, 40, "relu"),
    MoESpec(48, 16, 5, 2),
    MoESpec(48, 16, 4, 2, shared_d_ff=24, router_bias=True, expert_bias=True, activation="swiglu_clamped"),
    MoESpec(48, 16, 6, 2, shared_d_ff=24, shared_gate=False, scoring="sigmoid", choice_bias=True, n_group=3,
            topk_group=2, routed_scaling_factor=2.5),
]
REFERENCE = components("reference")


def _ids(specs):
    return [f"{s.kind}-{i}" for i, s in enumerate(specs)]


@pytest.mark.parametrize("spec", MIXER_SPECS + MLP_SPECS, ids=_ids(MIXER_SPECS + MLP_SPECS))
def test_param_count_is_the_built_modules(spec):
    module = spec.build(REFERENCE)
    assert spec.param_count() == sum(p.numel() for p in module.parameters())


def test_active_params_of_an_moe_count_the_routed_experts_only():
    spec = MLP_SPECS[4]
    experts = spec.build(REFERENCE).experts
    per_expert = sum(p.numel() for p in experts.parameters()) // spec.num_experts
    assert spec.param_count() - spec.param_count(active=True) == (spec.num_experts - spec.top_k) * per_expert


@pytest.mark.parametrize("spec", MIXER_SPECS + MLP_SPECS, ids=_ids(MIXER_SPECS + MLP_SPECS))
def test_flop_categories_are_declared(spec):
    flops = spec.forward_flops(2, 8)
    assert set(flops) == set(spec.flop_categories) and set(flops) <= set(flop_categories())
    assert all(isinstance(v, int) and v > 0 for v in flops.values())
    # matmul FLOPs grow linearly in the batch
    assert spec.forward_flops(4, 8) == {k: 2 * v for k, v in flops.items()}


def test_every_kind_is_registered_once():
    assert set(MIXERS) == {"attention", "latent_attention", "gated_deltanet"} and set(MLPS) == {"dense", "moe"}
    assert flop_categories() == ("attention_projections", "attention_matmuls", "linear_attention", "ffn")


@pytest.mark.parametrize("spec", MIXER_SPECS, ids=_ids(MIXER_SPECS))
def test_cache_bytes_are_what_a_prefill_stores(spec):
    """After a prefill of ``seq`` tokens into a cache reserved for them, the cache holds ``cache_bytes``."""
    torch.manual_seed(0)
    module, batch, seq = spec.build(REFERENCE), 3, 7
    cache = spec.new_cache(32, reserve=seq)
    assert isinstance(cache, RecurrentCache if spec.kind == "gated_deltanet" else KVCache)
    with torch.no_grad():
        module(torch.randn(batch, seq, spec.d_model), torch.arange(seq), cache)
    tensors = (cache.conv_state, cache.state) if isinstance(cache, RecurrentCache) else (cache.k, cache.v)
    assert sum(t.numel() * t.element_size() for t in tensors) == spec.cache_bytes(batch, seq, 4)


def test_mlps_keep_no_cache():
    assert all(spec.new_cache(32) is None for spec in MLP_SPECS)


def _weights(expert_format="stacked", block="mlp", names=("gate_proj", "up_proj", "down_proj")):
    return SimpleNamespace(expert_format=expert_format, expert_block=block, expert_names=names)


@pytest.mark.parametrize("spec", MIXER_SPECS + [s for s in MLP_SPECS if s.kind != "dense" or s.gated],
                         ids=_ids(MIXER_SPECS + [s for s in MLP_SPECS if s.kind != "dense" or s.gated]))
def test_hf_names_and_transforms_cover_the_state_dict_once(spec):
    """Every ``state_dict`` tensor is named one to one or written by the part's transform, never both, and the
    transform reads back what it wrote."""
    state = spec.build(REFERENCE).state_dict()
    named = set(spec.hf_names())
    weights = _weights("transposed_interleaved" if getattr(spec, "expert_bias", False) else "stacked")
    hf_state = spec.state_to_hf({f"ffn.{k}": v for k, v in state.items()}, "model.layers.0", "ffn", weights)
    used: set = set()
    back = spec.state_from_hf(hf_state, "model.layers.0", "ffn", weights, used)
    assert used == set(hf_state)
    transformed = {k.removeprefix("ffn.") for k in back}
    assert named.isdisjoint(transformed) and named | transformed == set(state)
    assert len(set(spec.hf_names().values())) == len(named)  # (no two of ours onto one of theirs)
    for key, tensor in back.items():
        assert torch.equal(tensor, state[key.removeprefix("ffn.")])


def test_ungated_ffn_has_no_hf_layout():
    with pytest.raises(ValueError, match="no Hugging Face layout"):
        DenseMLPSpec(48, 40, "relu").hf_names()


def test_moe_reads_each_expert_layout_by_its_definition():
    spec = MoESpec(8, 3, 4, 2)
    torch.manual_seed(0)
    E, I, H = spec.num_experts, spec.d_ff, spec.d_model
    gate, up, down = torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I)
    # per expert (the Hub's files), under a family's block and projection names
    per_expert = {"model.layers.2.block_sparse_moe.gate.weight": torch.randn(E, H)}
    for j in range(E):
        per_expert.update({f"model.layers.2.block_sparse_moe.experts.{j}.w1.weight": gate[j],
                           f"model.layers.2.block_sparse_moe.experts.{j}.w3.weight": up[j],
                           f"model.layers.2.block_sparse_moe.experts.{j}.w2.weight": down[j]})
    weights = _weights(block="block_sparse_moe", names=("w1", "w3", "w2"))
    ours = spec.state_from_hf(per_expert, "model.layers.2", "ffn", weights, set())
    assert torch.equal(ours["ffn.experts.gate_up_proj"], torch.cat([gate, up], dim=1))
    assert torch.equal(ours["ffn.experts.down_proj"], down)
    assert spec.state_to_hf(ours, "model.layers.2", "ffn", weights).keys() == per_expert.keys()
    # gpt-oss: gate_up_proj [E, H, 2I] with gate and up columns alternating, down_proj [E, I, H]
    interleaved = torch.stack([gate.transpose(1, 2), up.transpose(1, 2)], dim=-1).flatten(-2)
    bias = torch.randn(E, I, 2)
    gpt_oss = {"model.layers.0.mlp.router.weight": torch.randn(E, H), "model.layers.0.mlp.router.bias": torch.randn(E),
               "model.layers.0.mlp.experts.gate_up_proj": interleaved,
               "model.layers.0.mlp.experts.gate_up_proj_bias": bias.flatten(1),
               "model.layers.0.mlp.experts.down_proj": down.transpose(1, 2),
               "model.layers.0.mlp.experts.down_proj_bias": torch.randn(E, H)}
    weights = _weights("transposed_interleaved")
    spec = MoESpec(8, 3, 4, 2, router_bias=True, expert_bias=True, activation="swiglu_clamped")
    ours = spec.state_from_hf(gpt_oss, "model.layers.0", "ffn", weights, set())
    assert torch.equal(ours["ffn.experts.gate_up_proj"], torch.cat([gate, up], dim=1))
    assert torch.equal(ours["ffn.experts.gate_up_bias"], torch.cat([bias[..., 0], bias[..., 1]], dim=1))
    assert torch.equal(ours["ffn.experts.down_proj"], down)
    again = spec.state_to_hf(ours, "model.layers.0", "ffn", weights)
    assert again.keys() == gpt_oss.keys() and all(torch.equal(again[k], gpt_oss[k]) for k in gpt_oss)


def test_moe_biases_need_the_layout_that_holds_them():
    state = {f"ffn.{k}": v for k, v in MLP_SPECS[4].build(REFERENCE).state_dict().items()}
    with pytest.raises(ValueError, match="has no router or expert biases"):
        MLP_SPECS[4].state_to_hf(state, "model.layers.0", "ffn", _weights())
    with pytest.raises(ValueError, match="needs router_bias and expert_bias"):
        MLP_SPECS[3].state_from_hf({}, "model.layers.0", "ffn", _weights("transposed_interleaved"), set())


def test_moe_missing_router_is_a_one_line_error():
    with pytest.raises(ValueError, match="checkpoint lacks model.layers.1.mlp.gate.weight"):
        MoESpec(8, 3, 4, 2).state_from_hf({}, "model.layers.1", "ffn", _weights(), set())


def test_dense_mlp_spec_validates():
    with pytest.raises(ValueError, match="activation must be one of"):
        DenseMLPSpec(48, 40, "gelu")
    with pytest.raises(ValueError, match="needs a gated FFN"):
        DenseMLPSpec(48, 40, "relu", bias=True)


def test_config_translates_each_layer_into_its_parts():
    """A hybrid with NoPE, window and MoE layers: each layer's specs carry that layer's choices, and the model built
    from the config holds the modules the specs build (same parameter shapes)."""
    cfg = ModelConfig(64, 32, 48, 4, 4, 40, linear_layers=(0, 2), linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=8, linear_value_head_dim=6, num_experts=4, experts_per_token=2,
                      moe_layers=(1, 2), sliding_window=6, sliding_layers=(3,), nope_layers=(1,))
    kinds = [(cfg.layer_mixer(i).kind, cfg.layer_mlp(i).kind) for i in range(4)]
    assert kinds == [("gated_deltanet", "dense"), ("attention", "moe"), ("gated_deltanet", "moe"),
                     ("attention", "dense")]
    assert cfg.layer_mixer(1).theta is None and cfg.layer_mixer(1).window is None
    assert cfg.layer_mixer(3).theta == cfg.rope_theta and cfg.layer_mixer(3).window == 6
    model = TransformerLM(cfg)
    for i, layer in enumerate(model.layers):
        for part, module in ((cfg.layer_mixer(i), layer.attn), (cfg.layer_mlp(i), layer.ffn)):
            built = part.build(REFERENCE)
            assert {k: v.shape for k, v in built.state_dict().items()} == \
                {k: v.shape for k, v in module.state_dict().items()}
