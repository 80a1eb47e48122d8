"""The fused backend as a whole: same numbers as the reference model, conversion, compile, memory."""

import copy
import io
import logging
import os
import subprocess
import sys

import pytest
import torch

import tritonlm
from tritonlm import ModelConfig, TransformerLM
from tritonlm.modules import fused, reference

from helpers import DTYPE_TOLERANCES, FP32_ATTENTION_TOL, cpu_only

CFG = ModelConfig.preset("tiny", vocab_size=97, context_length=48, num_layers=2)


def _pair(dtype=torch.float32):
    ref = TransformerLM(**CFG.model_kwargs(), dtype=dtype)
    fz = TransformerLM(**CFG.model_kwargs(), dtype=dtype, backend="triton")
    fz.load_state_dict(ref.state_dict())
    return ref, fz


def test_fused_lm_logits_and_gradients_match_reference_fp32():
    ref, fz = _pair()
    ids = torch.randint(0, 97, (2, 37))
    targets = torch.randint(0, 97, (2, 37))
    losses = []
    for model in (ref, fz):
        logits = model(ids)
        loss = tritonlm.modules.functional.cross_entropy(logits, targets)
        loss.backward()
        losses.append((logits, loss))
    tol = FP32_ATTENTION_TOL
    torch.testing.assert_close(losses[1][0], losses[0][0], atol=tol, rtol=tol)
    torch.testing.assert_close(losses[1][1], losses[0][1], atol=tol / 10, rtol=tol / 10)
    for (name, p1), p2 in zip(ref.named_parameters(), fz.parameters()):
        torch.testing.assert_close(p2.grad, p1.grad, atol=tol / 10, rtol=tol, msg=name)


@pytest.mark.parametrize("options", [dict(), dict(label_smoothing=0.1, z_loss=1e-3), dict(ignore_index=5)])
def test_model_loss_fused_never_forms_logits_and_matches_reference(options, monkeypatch):
    """TransformerLM.loss: the fused model (linear_cross_entropy, add_rms_norm chain) against the reference
    model (logits + functional.cross_entropy) in value and every gradient, and against F.cross_entropy."""
    import torch.nn.functional as TF

    ref, fz = _pair()
    ids = torch.randint(0, 97, (2, 37))
    targets = torch.randint(0, 97, (2, 37))
    targets[0, :6] = options.get("ignore_index", -100)
    losses = []
    for model in (ref, fz):
        loss = model.loss(ids, targets, **options)
        loss.backward()
        losses.append(loss)
    tol = FP32_ATTENTION_TOL
    torch.testing.assert_close(losses[1], losses[0], atol=tol / 10, rtol=tol / 10)
    for (name, p1), p2 in zip(ref.named_parameters(), fz.parameters()):
        torch.testing.assert_close(p2.grad, p1.grad, atol=tol / 10, rtol=tol, msg=name)
    if not options.get("z_loss"):
        with torch.no_grad():
            want = TF.cross_entropy(ref(ids).reshape(-1, 97), targets.reshape(-1),
                                    ignore_index=options.get("ignore_index", -100),
                                    label_smoothing=options.get("label_smoothing", 0.0))
        torch.testing.assert_close(losses[0].detach(), want, atol=1e-5, rtol=1e-5)
    # the fused loss never asks the LM head module for logits
    monkeypatch.setattr(fz.lm_head, "forward", lambda x: pytest.fail("fused loss formed the logits"))
    fz.loss(ids, targets, **options)


def test_fused_block_uses_add_rms_norm_for_the_pre_norm_seams(monkeypatch):
    """Every residual add of a pre-norm fused model meets its norm in add_rms_norm: per block ln2, plus every
    ln1 after the first block and the final norm."""
    from tritonlm import kernels

    calls = []
    original = kernels.add_rms_norm
    monkeypatch.setattr(kernels, "add_rms_norm", lambda *a, **k: calls.append(1) or original(*a, **k))
    _, fz = _pair()
    fz(torch.randint(0, 97, (1, 9)))
    n = len(fz.layers)
    assert len(calls) == n + (n - 1) + 1


def test_fused_lm_bf16_close_to_fp32_reference():
    ref, _ = _pair()
    fz = TransformerLM(**CFG.model_kwargs(), dtype=torch.bfloat16, backend="triton")
    fz.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 97, (1, 29))
    want, got = ref(ids), fz(ids)
    assert got.dtype == torch.bfloat16
    # bf16 weights and activations through 2 layers: a few bf16 ulps of the logits' scale, elementwise
    torch.testing.assert_close(got.float(), want, atol=0.05 * want.abs().max().item(), rtol=0.05)
    low = TransformerLM(**CFG.model_kwargs(), dtype=torch.bfloat16)  # the reference in bf16 lands as close
    low.load_state_dict(ref.state_dict())
    err_fused, err_ref = (got.float() - want).abs().mean(), (low(ids).float() - want).abs().mean()
    assert err_fused < 2 * err_ref + 1e-3


def test_fused_namespace_and_classes():
    fz = fused.TransformerLM(**CFG.model_kwargs())
    assert fz.backend == "triton"
    assert isinstance(fz.layers[0].attn, fused.MultiHeadSelfAttention)
    assert isinstance(fz.layers[0].ln1, fused.RMSNorm) and isinstance(fz.layers[0].ffn, fused.SwiGLU)
    assert issubclass(fused.TransformerBlock, reference.TransformerBlock)


def test_fuse_unfuse_in_place_keeps_weights_and_checkpoints_interchange():
    ref, _ = _pair()
    ids = torch.randint(0, 97, (2, 20))
    want = ref(ids)
    model = copy.deepcopy(ref)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    assert tritonlm.fuse(model) is model
    assert isinstance(model.layers[1].ln2, fused.RMSNorm)
    torch.testing.assert_close(model(ids), want, atol=FP32_ATTENTION_TOL, rtol=FP32_ATTENTION_TOL)
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k])
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    back = TransformerLM(**CFG.model_kwargs())
    back.load_state_dict(torch.load(buf))
    torch.testing.assert_close(back(ids), want)
    tritonlm.unfuse(model)
    assert type(model.layers[0].ln1) is reference.RMSNorm and model.backend == "reference"


def test_fused_kv_cache_decode_matches_reference_full_forward():
    ref, fz = _pair()
    ids = torch.randint(0, 97, (2, 18))
    full = ref(ids)  # the reference model without a cache: an independent computation
    caches = fz.new_kv_caches()
    parts = [fz(ids[:, :11], kv_caches=caches)] + [fz(ids[:, t:t + 1], kv_caches=caches) for t in range(11, 18)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=FP32_ATTENTION_TOL, rtol=FP32_ATTENTION_TOL)


def test_auto_backend_on_cpu_says_reference(caplog):
    with caplog.at_level(logging.INFO, logger="tritonlm"):
        model = TransformerLM(**CFG.model_kwargs(), backend="auto")
    if torch.cuda.is_available():
        pytest.skip("auto picks triton on a CUDA machine")
    assert model.backend == "reference"
    assert "chose 'reference'" in caplog.text
    with pytest.raises(ValueError, match="backend"):
        TransformerLM(**CFG.model_kwargs(), backend="cuda")


@cpu_only
def test_cpu_tensors_without_interpreter_raise_clear_error():
    code = ("import torch, tritonlm; from tritonlm.kernels import rms_norm\n"
            "try:\n rms_norm(torch.randn(2, 4), torch.ones(4))\n"
            "except RuntimeError as e:\n print('ERR', e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "ERR" in out.stdout and "TRITON_INTERPRET=1" in out.stdout, out.stderr[-2000:]


def test_torch_compile_fullgraph_traces_fused_model():
    torch._dynamo.reset()
    _, fz = _pair()
    ids = torch.randint(0, 97, (2, 21))
    ref = TransformerLM(**CFG.model_kwargs())
    ref.load_state_dict(fz.state_dict())
    want = ref(ids)  # the reference model: not the code under test
    compiled = torch.compile(fz, fullgraph=True, backend="aot_eager")
    out = compiled(ids)
    torch.testing.assert_close(out, want, atol=FP32_ATTENTION_TOL, rtol=FP32_ATTENTION_TOL)
    out.float().pow(2).mean().backward()
    assert all(p.grad is not None for p in fz.parameters())
    # the fused loss (linear_cross_entropy and its custom ops) traces too: the reference model's value and gradients
    targets = torch.randint(0, 97, (2, 21))
    eager_loss = ref.loss(ids, targets, z_loss=1e-3)
    eager_loss.backward()
    want = [p.grad.clone() for p in ref.parameters()]
    fz.zero_grad()
    compiled_loss = compiled(ids, targets=targets, z_loss=1e-3)
    compiled_loss.backward()
    torch.testing.assert_close(compiled_loss, eager_loss, atol=FP32_ATTENTION_TOL / 10, rtol=FP32_ATTENTION_TOL / 10)
    for p, g in zip(fz.parameters(), want):
        torch.testing.assert_close(p.grad, g, atol=FP32_ATTENTION_TOL / 10, rtol=FP32_ATTENTION_TOL)


def _saved_bytes(module, x):
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return total


def test_fused_block_saves_less_activation_memory():
    kw = dict(d_model=64, num_heads=4, d_ff=160, max_seq_len=256, theta=10000.0)
    ref_block = reference.TransformerBlock(**kw)
    fused_block = fused.TransformerBlock(**kw)
    fused_block.load_state_dict(ref_block.state_dict())
    x = torch.randn(1, 256, 64, requires_grad=True)
    ref_bytes, fused_bytes = _saved_bytes(ref_block, x), _saved_bytes(fused_block, x)
    assert fused_bytes < ref_bytes
    # the reference keeps heads x seq² scores (and their softmax); fused attention keeps O(seq)
    assert ref_bytes - fused_bytes > 4 * 256 * 256 * 4


@pytest.mark.parametrize("preset", ["small", "gpt2-small"])
def test_activation_memory_target_at_seq_4096(preset):
    # §Performance: fused saves ≤ 1/8 of the reference per layer at seq 4096 (meta device: shapes only)
    from tritonlm.memory import block_activation_bytes

    r = block_activation_bytes(ModelConfig.preset(preset), 4096)
    assert r["fused"] <= r["reference"] / 8, r


def test_saved_bytes_counting_matches_hand_count_for_meta_fused_attention():
    # FlashAttention saves q, k, v, O ([1, 2, 64, 16] fp32 each) and L ([1, 2, 64] fp32): by storage
    from tritonlm.kernels import FlashAttention
    from tritonlm.memory import saved_activation_bytes

    class Attn(torch.nn.Module):
        def forward(self, q, k, v):
            return FlashAttention.apply(q, k, v, True)

    q, k, v = (torch.empty(1, 2, 64, 16, device="meta", requires_grad=True) for _ in range(3))
    assert saved_activation_bytes(Attn(), q, k, v) == 4 * (4 * 2 * 64 * 16 + 2 * 64)


def test_gqa_model_fused_matches_reference_and_decodes_alike():
    """num_kv_heads < num_heads: the reference repeats K/V explicitly, the fused model never does; loss,
    every gradient and greedy generation (KV cache of kv heads only) agree."""
    cfg = CFG.replace(num_heads=4, num_kv_heads=2)
    ref = TransformerLM(**cfg.model_kwargs())
    fz = TransformerLM(**cfg.model_kwargs(), backend="triton")
    fz.load_state_dict(ref.state_dict())
    assert ref.layers[0].attn.k_proj.weight.shape == (2 * cfg.d_head, cfg.d_model)
    ids, targets = torch.randint(0, 97, (2, 23)), torch.randint(0, 97, (2, 23))
    losses = []
    for model in (ref, fz):
        loss = model.loss(ids, targets)
        loss.backward()
        losses.append(loss)
    tol = FP32_ATTENTION_TOL
    torch.testing.assert_close(losses[1], losses[0], atol=tol / 10, rtol=tol / 10)
    for (name, p1), p2 in zip(ref.named_parameters(), fz.parameters()):
        torch.testing.assert_close(p2.grad, p1.grad, atol=tol / 10, rtol=tol, msg=name)
    caches = fz.new_kv_caches()
    fz(ids[:, :7], kv_caches=caches)
    assert caches[0].k.shape[-3] == 2  # kv heads, not query heads
    assert torch.equal(fz.generate(ids[:, :5], 12, temperature=0), ref.generate(ids[:, :5], 12, temperature=0))


def test_gqa_reference_equals_mha_with_repeated_kv_heads():
    """The readable GQA spec: an MHA model whose K/V projections repeat each kv head's rows for its group
    computes the same logits."""
    gqa_cfg = CFG.replace(num_heads=4, num_kv_heads=2)
    gqa = TransformerLM(**gqa_cfg.model_kwargs())
    mha = TransformerLM(**CFG.replace(num_heads=4).model_kwargs())
    state = dict(gqa.state_dict())
    d_head = gqa_cfg.d_head
    for key in list(state):
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            heads = state[key].unflatten(0, (2, d_head))               # [kv_heads, d_head, d_model]
            state[key] = heads.repeat_interleave(2, dim=0).flatten(0, 1)  # each kv head for its 2 query heads
    mha.load_state_dict(state)
    ids = torch.randint(0, 97, (2, 17))
    torch.testing.assert_close(gqa(ids), mha(ids), atol=1e-5, rtol=1e-5)


def test_packed_documents_fused_varlen_matches_reference_mask_and_separate_runs():
    """document_ids: the reference builds a block-diagonal causal mask, the fused model runs varlen attention;
    both equal running each document on its own (positions restart at 0), in loss and gradients."""
    cfg = CFG.replace(num_heads=4, num_kv_heads=2)
    ref = TransformerLM(**cfg.model_kwargs())
    fz = TransformerLM(**cfg.model_kwargs(), backend="triton")
    fz.load_state_dict(ref.state_dict())
    ids, targets = torch.randint(0, 97, (2, 21)), torch.randint(0, 97, (2, 21))
    docs = torch.tensor([[0] * 5 + [1] + [2] * 15, [7] * 21])
    with torch.no_grad():
        whole = ref(ids, document_ids=docs)
        for s, e in ((0, 5), (5, 6), (6, 21)):
            torch.testing.assert_close(whole[0, s:e], ref(ids[:1, s:e])[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(whole[1], ref(ids[1:])[0], atol=1e-5, rtol=1e-5)
    losses = []
    for model in (ref, fz):
        loss = model.loss(ids, targets, document_ids=docs)
        loss.backward()
        losses.append(loss)
    tol = FP32_ATTENTION_TOL
    torch.testing.assert_close(losses[1], losses[0], atol=tol / 10, rtol=tol / 10)
    for (name, p1), p2 in zip(ref.named_parameters(), fz.parameters()):
        torch.testing.assert_close(p2.grad, p1.grad, atol=tol / 10, rtol=tol, msg=name)
    with pytest.raises(ValueError, match="non-decreasing"):
        ref(ids, document_ids=docs.flip(-1))
    with pytest.raises(ValueError, match="must match"):
        ref(ids, document_ids=docs[:, :5])


@cpu_only
def test_torch_compile_inductor_fused_loss_matches_reference():
    """The default inductor backend (C++ codegen on CPU around the opaque Triton custom ops), fullgraph:
    the fused model's loss and gradients equal the reference model's."""
    torch._dynamo.reset()
    cfg = CFG.replace(num_layers=1, num_kv_heads=2)
    ref = TransformerLM(**cfg.model_kwargs())
    fz = TransformerLM(**cfg.model_kwargs(), backend="triton")
    fz.load_state_dict(ref.state_dict())
    ids, targets = torch.randint(0, 97, (2, 21)), torch.randint(0, 97, (2, 21))
    want = ref.loss(ids, targets)
    want.backward()
    got = torch.compile(fz, fullgraph=True)(ids, targets=targets)
    got.backward()
    tol = FP32_ATTENTION_TOL
    torch.testing.assert_close(got, want, atol=tol / 10, rtol=tol / 10)
    for (name, p1), p2 in zip(ref.named_parameters(), fz.parameters()):
        torch.testing.assert_close(p2.grad, p1.grad, atol=tol / 10, rtol=tol, msg=name)


@pytest.mark.parametrize("dtype, tol", DTYPE_TOLERANCES)
def test_qwen_attention_options_fused_match_reference(dtype, tol):
    """q/k/v biases, per-head q/k norms and a head_dim other than d_model / num_heads: the fused model (RMSNorm
    kernel on each head, RoPE, flash attention at d 16) against the reference one, same state_dict; accounting
    counts exactly the model's parameters."""
    from tritonlm import accounting

    cfg = ModelConfig(vocab_size=70, context_length=24, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      d_ff=48, head_dim=16, qkv_bias=True, qk_norm="head", norm_eps=1e-6)
    torch.manual_seed(0)
    ref = TransformerLM(cfg, dtype=dtype)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(".bias") or "_norm." in name:
                p.uniform_(0.5, 1.5)
    fz = TransformerLM(cfg, dtype=dtype, backend="triton")
    assert list(ref.state_dict()) == list(fz.state_dict())
    assert ref.layers[0].attn.q_proj.weight.shape == (64, 32) and ref.layers[0].attn.output_proj.weight.shape == (32, 64)
    assert accounting.param_count(cfg) == sum(p.numel() for p in ref.parameters())
    fz.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 70, (2, 11))
    losses = [m.loss(ids[:, :-1], ids[:, 1:]) for m in (ref, fz)]
    for loss in losses:
        loss.backward()
    scale = 4 if dtype == torch.float32 else 8
    torch.testing.assert_close(losses[1].float(), losses[0].float(), atol=tol["atol"] * scale, rtol=tol["rtol"] * scale)
    for (name, a), b in zip(ref.named_parameters(), fz.parameters()):
        size = a.grad.float().abs().max().clamp_min(1e-3)
        torch.testing.assert_close(b.grad.float() / size, a.grad.float() / size, atol=tol["atol"] * 5,
                                   rtol=tol["rtol"] * 5, msg=lambda m, n=name: f"{n}: {m}")
