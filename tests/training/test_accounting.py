"""Accounting against the seeds' worked GPT-2 XL example and against counted parameters."""

import pytest
import torch

from tritonlm import ModelConfig, TransformerLM, accounting


def test_gpt2_xl_parameters_and_memory():
    cfg = ModelConfig.preset("gpt2-xl")
    assert accounting.param_count(cfg) == 1_640_452_800
    assert accounting.memory_bytes(cfg, 1024)["params"] == pytest.approx(6.56e9, rel=1e-3)


def test_gpt2_xl_forward_flops_breakdown():
    f = accounting.forward_flops(ModelConfig.preset("gpt2-xl"), 1024)
    assert f["total"] == pytest.approx(3.52e12, rel=2e-3)
    share = {k: v / f["total"] for k, v in f.items()}
    assert share["ffn"] == pytest.approx(0.575, abs=6e-4)
    assert share["attention_projections"] == pytest.approx(0.286, abs=6e-4)
    assert share["attention_matmuls"] == pytest.approx(0.092, abs=6e-4)
    assert share["lm_head"] == pytest.approx(0.047, abs=6e-4)


def test_gpt2_xl_long_context_scaling():
    cfg = ModelConfig.preset("gpt2-xl")
    short, long = accounting.forward_flops(cfg, 1024), accounting.forward_flops(cfg, 16384)
    assert long["total"] / short["total"] == pytest.approx(38, abs=0.1)
    assert long["attention_matmuls"] / long["total"] == pytest.approx(0.617, abs=6e-4)


def test_flops_formula_against_explicit_matmul_shapes():
    cfg = ModelConfig(vocab_size=100, context_length=32, d_model=24, num_layers=3, num_heads=4, d_ff=40)
    b, s, d = 2, 7, 24
    f = accounting.forward_flops(cfg, s, b)
    mm = lambda m, k, n: 2 * m * k * n  # noqa: E731
    assert f["attention_projections"] == 3 * 4 * mm(b * s, d, d)
    assert f["attention_matmuls"] == 3 * 2 * mm(b * s, d, s)  # QKᵀ and PV over all heads
    assert f["ffn"] == 3 * 3 * mm(b * s, d, 40)
    assert f["lm_head"] == mm(b * s, d, 100)
    assert accounting.training_flops(cfg, s, b) == 3 * f["total"]


@pytest.mark.parametrize("name", ["tiny", "gpt2-small", "small"])
def test_param_count_matches_model(name):
    cfg = ModelConfig.preset(name)
    if name != "tiny":
        cfg = cfg.replace(num_layers=1)  # same per-layer formula, less to allocate
    model = TransformerLM(**cfg.model_kwargs(), device="meta")
    assert accounting.param_count(cfg) == sum(p.numel() for p in model.parameters())


def test_presets_table():
    expected = {"gpt2-small": (12, 768, 12, 2048), "gpt2-medium": (24, 1024, 16, 2752),
                "gpt2-large": (36, 1280, 20, 3392), "gpt2-xl": (48, 1600, 25, 4288),
                "small": (12, 768, 12, 3072), "medium": (24, 1024, 16, 4096), "large": (36, 1280, 20, 5120),
                "xl": (32, 2560, 32, 10240), "10B": (50, 4608, 36, 12288)}
    for name, (layers, d, heads, d_ff) in expected.items():
        c = ModelConfig.preset(name)
        assert (c.num_layers, c.d_model, c.num_heads, c.d_ff) == (layers, d, heads, d_ff)
        assert c.vocab_size == (50257 if name.startswith("gpt2") else 10000)
    with pytest.raises(ValueError, match="unknown preset"):
        ModelConfig.preset("huge")


def test_memory_and_mfu():
    cfg = ModelConfig.preset("small")
    mem = accounting.memory_bytes(cfg, 512, 4, param_dtype="fp32")
    n = accounting.param_count(cfg)
    assert mem["grads"] == 4 * n and mem["adamw_state"] == 8 * n
    assert mem["total"] == sum(v for k, v in mem.items() if k != "total")
    # MFU from first principles: 6 N D for the matmul parameters plus the attention matmuls, over time x peak
    tokens = 512 * 4
    matmul_params = n - cfg.vocab_size * cfg.d_model - 2 * cfg.num_layers * cfg.d_model - cfg.d_model  # no embedding, norms
    attention = 3 * 2 * 2 * cfg.num_layers * 4 * 512 * 512 * cfg.d_model
    by_hand = 6 * matmul_params * tokens + attention
    assert accounting.training_flops(cfg, 512, 4) == by_hand
    assert accounting.mfu(cfg, 512, 4, step_time_s=2.0, peak=1e15) == pytest.approx(by_hand / 2.0 / 1e15)
    # NVIDIA's published dense bf16 figures, and device names as torch reports them
    assert accounting.peak_flops("NVIDIA H100 80GB HBM3") == pytest.approx(989.4e12, rel=1e-3)
    assert accounting.peak_flops("NVIDIA A100-SXM4-80GB") == pytest.approx(312e12, rel=1e-3)
    assert accounting.peak_flops("Intel CPU") is None


def test_activation_estimate_scales_quadratically_in_attention():
    cfg = ModelConfig.preset("tiny")
    a1 = accounting.activation_elements(cfg, 64)["per_layer"]
    a2 = accounting.activation_elements(cfg, 128)["per_layer"]
    assert 2 < a2 / a1 < 4



def test_gqa_param_count_flops_and_kv_cache_match_the_built_model():
    from tritonlm import TransformerLM

    cfg = ModelConfig.preset("tiny", num_heads=4, num_kv_heads=1)
    model = TransformerLM(**cfg.model_kwargs(), device="meta")
    assert accounting.param_count(cfg) == sum(p.numel() for p in model.parameters())
    mha = cfg.replace(num_kv_heads=None)
    d, d_kv, tokens = cfg.d_model, cfg.d_head, 64
    # K and V projections shrink from d x d to d x d_head each: 2 matrices x 2 FLOPs x tokens x d x (d - d_kv)
    saved = accounting.forward_flops(mha, tokens)["attention_projections"] - \
        accounting.forward_flops(cfg, tokens)["attention_projections"]
    assert saved == cfg.num_layers * 2 * 2 * tokens * d * (d - d_kv)
    caches = model.new_kv_caches()
    ids = torch.zeros(3, 10, dtype=torch.long, device="meta")
    model(ids, kv_caches=caches)
    cached = sum(c.k.numel() * c.k.element_size() * 2 for c in caches) * cfg.context_length // caches[0].max_len
    assert accounting.kv_cache_bytes(cfg, cfg.context_length, 3, "fp32") == cached
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelConfig.preset("tiny", num_kv_heads=3)
