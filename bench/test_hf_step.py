"""A Hugging Face Llama training step (forward with labels, backward, AdamW): unpatched vs
``tritonlm.hf.apply_kernels`` vs Liger's instance patch (when importable). GPU: a Llama-3.2-1B-like shape with
random weights in bf16; CPU smoke: a tiny config through the interpreter. Peak memory in extra_info."""

import pytest
import torch

from benchutil import DEVICE, ON_GPU, peak_bytes, run

transformers = pytest.importorskip("transformers", reason="the optional extra tritonlm[hf] is not installed")

if ON_GPU:
    SIZES = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                 num_hidden_layers=16, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
    BATCH, SEQ, DTYPE = 4, 2048, torch.bfloat16
else:
    SIZES = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                 num_hidden_layers=1, vocab_size=300, max_position_embeddings=64)
    BATCH, SEQ, DTYPE = 2, 16, torch.float32


def _patched(impl: str, model):
    if impl == "tritonlm":
        from tritonlm.hf import apply_kernels

        return apply_kernels(model)
    if impl == "liger-kernel":
        liger = pytest.importorskip("liger_kernel.transformers", reason="liger-kernel is not installed")
        liger._apply_liger_kernel_to_instance(model=model)
    return model


@pytest.mark.parametrize("impl", ["unpatched", "tritonlm", "liger-kernel"])
def test_hf_llama_train_step(benchmark, impl):
    benchmark.group = f"HF Llama step {SIZES['num_hidden_layers']}L d{SIZES['hidden_size']} {BATCH}x{SEQ}"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SIZES, tie_word_embeddings=True)
    model = _patched(impl, transformers.LlamaForCausalLM(config).to(device=DEVICE, dtype=DTYPE).train())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, SIZES["vocab_size"], (BATCH, SEQ), device=DEVICE)

    def step():
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    mean = run(benchmark, step)
    benchmark.extra_info.update(tokens_per_s=BATCH * SEQ / mean, peak_bytes=peak_bytes(step))
