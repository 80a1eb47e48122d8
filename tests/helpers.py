"""Shared test helpers: devices, tolerances (each dtype with its own), fp64 references, launch counting.

Tests import from here (``from helpers import ...``); ``conftest.py`` holds only pytest's configuration and
fixtures (and sets ``TRITON_INTERPRET`` before Triton is imported).
"""

import contextlib
import os
from pathlib import Path

import pytest
import torch

DEVICE = os.environ.get("TRITONLM_TEST_DEVICE", "cpu")
ON_CUDA = DEVICE.startswith("cuda")
REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

#: fp32 tolerance for results that go through attention's tl.dot: IEEE fp32 dots under torch's default "highest"
#: precision, in the interpreter and on GPUs alike.
FP32_ATTENTION_TOL = 1e-4
#: the tolerance of fp32 attention under "high" (TF32 tensor cores, 10-bit mantissa operands), checked on CPU
#: under ``emulated_tf32_dots``
GPU_FP32_ATTENTION_TOL = 5e-3
cpu_only = pytest.mark.skipif(ON_CUDA, reason="checks CPU/interpreter behaviour")


def tolerance(dtype: torch.dtype, scale: float = 1.0) -> dict:
    """Usual comparison tolerances of a low-precision result against an fp32/fp64 reference (times ``scale`` for
    results that went through more rounding steps)."""
    base = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float64: 1e-10}[dtype]
    return dict(atol=base * scale, rtol=base * scale)


#: ``@pytest.mark.parametrize("dtype, tol", DTYPE_TOLERANCES)``: each kernel dtype with its tolerance.
DTYPE_TOLERANCES = [pytest.param(dtype, tolerance(dtype), id=str(dtype).replace("torch.", ""))
                    for dtype in (torch.float32, torch.float16, torch.bfloat16)]


def flash_visibility(n_q: int, n_k: int, causal: bool, window=(-1, -1)) -> torch.Tensor:
    """flash-attn's ``[n_q, n_k]`` visibility: key j for query i when j - i - (n_k - n_q) is in [-left, right]
    (-1 = no bound; bottom-right alignment); causal caps right at 0."""
    rel = torch.arange(n_k)[None, :] - torch.arange(n_q)[:, None] - (n_k - n_q)
    left, right = window
    visible = torch.ones(n_q, n_k, dtype=torch.bool)
    if causal:
        visible &= rel <= 0
    if right >= 0:
        visible &= rel <= right
    if left >= 0:
        visible &= rel >= -left
    return visible


#: attention outputs against fp64 (gradients: 4x): per dtype
ATTENTION_TOL = {torch.float32: FP32_ATTENTION_TOL, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def assert_attention_close(out, ref, grads, ref_grads, dtype):
    """An attention output and its gradients against their fp64 references (gradients at 4x the output's
    tolerance: two more matmuls and a softmax derivative deep)."""
    tol = ATTENTION_TOL[dtype]
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, atol=4 * tol, rtol=4 * tol)


def fp64(*tensors: torch.Tensor):
    """Detached fp64 copies that require grad: the inputs of a reference recomputation."""
    out = tuple(t.detach().double().requires_grad_(t.requires_grad) for t in tensors)
    return out[0] if len(out) == 1 else out


def record_launches(monkeypatch, *kernels, record=lambda name, kwargs: name) -> list:
    """Patch each Triton kernel's ``run`` to append ``record(name, launch kwargs)`` to the returned list before
    launching it (the kernels still run)."""
    launched = []
    for kernel in kernels:
        name = getattr(kernel, "__name__", None) or kernel.fn.__name__
        monkeypatch.setattr(kernel, "run", lambda *a, _n=name, _r=kernel.run, **k: launched.append(
            record(_n, k)) or _r(*a, **k))
    return launched


@contextlib.contextmanager
def emulated_tf32_dots():
    """Inside the block, the interpreter's ``tl.dot`` drops the low 13 mantissa bits of fp32 operands, the
    worst case of what TF32 tensor cores do with them, so GPU tolerances can be checked on a CPU."""
    import numpy as np
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    original = builder.create_dot

    def truncate(h):
        if h.dtype.scalar != interp.tl.float32:
            return h
        bits = np.ascontiguousarray(h.data, dtype=np.float32).view(np.uint32) & np.uint32(0xFFFFE000)
        return interp.TensorHandle(bits.view(np.float32), interp.tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, truncate(a), truncate(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
    try:
        yield
    finally:
        builder.create_dot = original


def hf_round_trip(ours, path, architecture: str, seq: int = 20):
    """``hf.save_pretrained(ours)`` then transformers' ``AutoModelForCausalLM`` loads it as ``architecture`` with
    the same logits, and ``hf.from_pretrained`` gives back the same config and tensors. Returns transformers' model."""
    import transformers

    from tritonlm import hf

    hf.save_pretrained(ours, path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path).to(DEVICE).eval()
    assert type(theirs).__name__ == architecture
    ids = torch.randint(0, ours.vocab_size, (2, seq), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    torch.testing.assert_close(theirs(ids).logits, ours(ids), atol=2e-5, rtol=1e-4)
    back = hf.from_pretrained(path, backend="reference", device=DEVICE)
    # the family it was saved as (a model built here: the default family, Llama) is the one it loads back as
    assert back.config.model_type == (ours.config.model_type or "llama") == theirs.config.model_type
    assert back.config == ours.config.replace(model_type=back.config.model_type)
    for (name, a), b in zip(ours.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), name
    return theirs


# ----------------------------------------------------------------------------------------------------
# Hugging Face tests
# ----------------------------------------------------------------------------------------------------
def transformers_or_skip():
    """``transformers``, or the test skipped with the reason (the optional extra tritonlm[hf] is absent)."""
    pytest.importorskip("safetensors", reason="the optional extra tritonlm[hf] (safetensors) is not installed")
    return pytest.importorskip("transformers", reason="the optional extra tritonlm[hf] (transformers) is not installed")


#: a tiny Llama's sizes (GQA, two layers) and Llama 3's RoPE scaling at positions the tests reach
LLAMA_SIZES = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                   num_hidden_layers=2, vocab_size=300, max_position_embeddings=64, rope_theta=500.0, rms_norm_eps=1e-6)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16}


def tiny_llama(tie=False, scaling=None, dtype=torch.float32, seed=0, **overrides):
    """transformers' own ``LlamaForCausalLM`` of :data:`LLAMA_SIZES` (random weights from ``seed``), in eval mode."""
    transformers = transformers_or_skip()
    torch.manual_seed(seed)
    # (a copy: transformers adds rope_theta to the dict it is given)
    cfg = transformers.LlamaConfig(**{**LLAMA_SIZES, **overrides}, rope_scaling=dict(scaling) if scaling else None,
                                   tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(cfg).to(dtype=dtype, device=DEVICE).eval()


def hf_grads(model) -> dict:
    """A TransformerLM's gradients under transformers 5's in-memory names: q/k rows back in the family's layout, MoE
    routers and experts as its modules hold them (``mlp.gate``, stacked ``mlp.experts.gate_up_proj`` / ``down_proj``)."""
    from tritonlm.hf.checkpoint import state_to_hf
    from tritonlm.hf.family import family

    cfg = model.config
    # (buffers saved with the model, DeepSeek-V3's correction bias, have no gradient: zeros in their place)
    state = {n: torch.zeros_like(t) for n, t in model.state_dict().items()}
    state.update({n: p.grad for n, p in model.named_parameters(remove_duplicate=False)})
    grads = state_to_hf(state, cfg)
    weights = family(cfg.model_type).weights
    for i in range(cfg.num_layers):
        if not cfg.is_moe_layer(i) or weights.expert_format != "stacked":
            continue  # (gpt-oss's files hold its experts as its modules do)
        block = f"model.layers.{i}.{weights.expert_block}.experts"
        experts = [[grads.pop(f"{block}.{j}.{n}.weight") for n in weights.expert_names]
                   for j in range(cfg.num_experts)]
        stacked = f"model.layers.{i}.mlp.experts"  # (transformers 5's module names, whatever the file's)
        grads[f"{stacked}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u, _ in experts])
        grads[f"{stacked}.down_proj"] = torch.stack([d for _, _, d in experts])
        if weights.expert_block != "mlp":
            grads[f"model.layers.{i}.mlp.gate.weight"] = grads.pop(f"model.layers.{i}.{weights.expert_block}.gate.weight")
    return grads



def save_hf_models(tmp_path_factory, kinds, make) -> dict:
    """``{kind: (directory, model)}``: ``make(kind)`` (a transformers model) saved once per module's tests."""
    out = {}
    for kind in kinds:
        path = tmp_path_factory.mktemp(kind)
        model = make(kind)
        model.save_pretrained(path)
        out[kind] = (path, model)
    return out


def hf_ids(batch: int = 2, seq: int = 13, seed: int = 1, vocab: int = 100) -> torch.Tensor:
    """Token ids in ``[3, vocab)`` (no pad id 0: transformers' embedding zeroes the pad row's gradient, tritonlm's
    trains it -- see the README)."""
    return torch.randint(3, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def assert_matches_transformers(ours, theirs, ids, atol: float = 2e-5, rtol: float = 1e-4, at_least: int = 20,
                                **loss_options) -> None:
    """``ours`` (a TransformerLM) against transformers' model of the same checkpoint on ``ids``: logits, the shifted
    next-token loss (``loss_options`` to ``ours.loss``) and every gradient."""
    expected = theirs(ids, labels=ids)
    torch.testing.assert_close(ours(ids), expected.logits, atol=atol, rtol=rtol)
    targets = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    ours.train()
    loss = ours.loss(ids, targets, **loss_options)
    torch.testing.assert_close(loss, expected.loss, atol=atol, rtol=1e-5)
    expected.loss.backward()
    loss.backward()
    assert_hf_grads_match(ours, theirs, atol=atol * 1.5, rtol=rtol * 2, at_least=at_least)


def assert_hf_grads_match(ours, theirs, atol: float = 2e-5, rtol: float = 1e-4, at_least: int = 20) -> None:
    """Every gradient of transformers' model equals ours (under its names, :func:`hf_grads`); then clears theirs."""
    grads = hf_grads(ours)
    checked = 0
    for name, p in theirs.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, atol=atol, rtol=rtol, msg=name)
            checked += 1
    assert checked == len([p for p in theirs.parameters() if p.grad is not None]) > at_least
    theirs.zero_grad(set_to_none=True)


def assert_bf16_no_further_than_transformers(theirs32, theirs16, patched, ours, ids, targets, **loss_options) -> None:
    """bf16 models against the fp32 transformers model: our loss and gradients (``ours``, a TransformerLM; ``patched``,
    transformers' bf16 model under apply_kernels) no further off than transformers' own bf16 model (twice its error,
    plus 1e-2 on the loss and 2% on each gradient's norm)."""
    losses = [m(ids, labels=ids).loss for m in (theirs32, theirs16, patched)] + [ours.loss(ids, targets,
                                                                                          **loss_options)]
    for loss in losses:
        loss.backward()
    loss32, loss16, loss_patched, loss_ours = (loss.detach().float() for loss in losses)
    assert abs(loss_ours - loss32) <= 2 * abs(loss16 - loss32) + 1e-2
    assert abs(loss_patched - loss32) <= 2 * abs(loss16 - loss32) + 1e-2
    grads = hf_grads(ours)
    total = torch.stack([p.grad.norm() for p in theirs32.parameters() if p.grad is not None]).norm()
    named16, named_patched = dict(theirs16.named_parameters()), dict(patched.named_parameters())
    for name, p in theirs32.named_parameters():
        if p.grad is None:
            continue
        scale = torch.maximum(p.grad.norm(), 1e-3 * total)
        err_ref = (named16[name].grad.float() - p.grad).norm() / scale
        for g in (grads[name], named_patched[name].grad):
            assert (g.float() - p.grad).norm() / scale <= 2 * err_ref + 0.02, name
