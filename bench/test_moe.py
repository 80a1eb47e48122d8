"""Mixture-of-experts expert FFNs, forward + backward, one comparison per shape in one process: the eager
per-expert loop (transformers' eager experts code), ``torch._grouped_mm`` where present (GPU), and
Liger-Kernel's fused MoE where installed (GPU), and ``kernels.moe_experts``. ``extra_info`` carries the active TFLOP/s. Targets (GPU): >= 2x the eager loop and
>= 1.1x ``_grouped_mm`` at Mixtral-8x7B's layer shape, bf16."""

import pytest
import torch

from tritonlm.kernels import moe_experts
from tritonlm.modules.functional import moe_router

from benchutil import DEVICE, MACHINE, ON_GPU, moe_baselines, run

DTYPE = torch.bfloat16 if ON_GPU else torch.float32
# (tokens, H, I, experts, top-k): Mixtral-8x7B's layer and a Qwen3-MoE-like one (GPU); a tiny one on CPU
SHAPES = [(8192, 4096, 14336, 8, 2), (8192, 2048, 768, 128, 8)] if ON_GPU else [(48, 32, 40, 5, 2)]


def _implementation(impl: str):
    fn = {**moe_baselines(DEVICE), "tritonlm": moe_experts}.get(impl)
    if fn is None:
        pytest.skip(f"{impl}: not available here (CUDA only: a torch with _grouped_mm, Liger-Kernel with fused MoE)")
    return fn


def _stacked_inputs(tokens, d_model, d_ff, experts, gen):
    """Hidden states, stacked experts (``[E, 2I, H]``, ``[E, H, I]``) and the output gradient."""
    hidden = torch.randn(tokens, d_model, device=DEVICE, dtype=DTYPE, generator=gen, requires_grad=True)
    gate_up = (torch.randn(experts, 2 * d_ff, d_model, device=DEVICE, dtype=DTYPE, generator=gen)
               / d_model**0.5).requires_grad_()
    down = (torch.randn(experts, d_model, d_ff, device=DEVICE, dtype=DTYPE, generator=gen) / d_ff**0.5).requires_grad_()
    return hidden, gate_up, down, torch.ones(tokens, d_model, device=DEVICE, dtype=DTYPE)


@pytest.mark.parametrize("impl", ["eager-loop", "torch._grouped_mm", "liger-kernel", "tritonlm"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-H{}-I{}-E{}-K{}".format(*s))
def test_moe_experts_fwd_bwd(benchmark, shape, impl):
    fn = _implementation(impl)
    tokens, d_model, d_ff, experts, top_k = shape
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    hidden, gate_up, down, grad = _stacked_inputs(tokens, d_model, d_ff, experts, gen)
    weights, index = torch.softmax(torch.randn(tokens, experts, device=DEVICE, generator=gen), -1).topk(top_k, -1)
    weights = weights.to(DTYPE).requires_grad_()

    def step():
        fn(hidden, index, weights, gate_up, down).backward(grad)

    mean = run(benchmark, step)
    benchmark.group = f"moe experts fwd+bwd T{tokens} H{d_model} I{d_ff} E{experts} K{top_k}"
    benchmark.extra_info.update(device=MACHINE.get()["device"],
                                active_TFLOPs=3 * 2 * tokens * top_k * 3 * d_model * d_ff / mean / 1e12)


#: gpt-oss-20b's layer (T 8192, H 2880, I 2880, 32 experts, top-4) on GPUs; a tiny one on CPU
GPT_OSS = (8192, 2880, 2880, 32, 4) if ON_GPU else (40, 24, 20, 6, 2)


@pytest.mark.parametrize("impl", ["eager-loop", "torch._grouped_mm", "tritonlm"])
def test_gpt_oss_experts_fwd_bwd(benchmark, impl):
    """gpt-oss's experts: biases, the clamped SwiGLU, gate / up interleaved in ``[E, H, 2I]`` read in place."""
    fn = _implementation(impl)
    tokens, d_model, d_ff, experts, top_k = GPT_OSS
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    hidden = torch.randn(tokens, d_model, device=DEVICE, dtype=DTYPE, generator=gen, requires_grad=True)
    logits, index = torch.randn(tokens, experts, device=DEVICE, generator=gen).topk(top_k, -1)
    weights = torch.softmax(logits, -1).to(DTYPE).requires_grad_()
    held = (torch.randn(experts, d_model, 2 * d_ff, device=DEVICE, dtype=DTYPE, generator=gen)
            / d_model**0.5).requires_grad_()
    down = (torch.randn(experts, d_model, d_ff, device=DEVICE, dtype=DTYPE, generator=gen) / d_ff**0.5).requires_grad_()
    biases = [torch.zeros(experts, n, device=DEVICE, dtype=DTYPE, requires_grad=True) for n in (2 * d_ff, d_model)]
    opts = dict(activation="swiglu_clamped", gate_up_bias=biases[0], down_bias=biases[1], gate_up_layout="interleaved")
    grad = torch.ones(tokens, d_model, device=DEVICE, dtype=DTYPE)

    def step():
        fn(hidden, index, weights, held.transpose(1, 2), down, **opts).backward(grad)

    mean = run(benchmark, step)
    benchmark.group = f"gpt-oss experts fwd+bwd T{tokens} H{d_model} I{d_ff} E{experts} K{top_k}"
    benchmark.extra_info.update(device=MACHINE.get()["device"],
                                active_TFLOPs=3 * 2 * tokens * top_k * 3 * d_model * d_ff / mean / 1e12)


#: GLM-4.5-Air's MoE layer (T 8192, H 4096, I 1408, 128 experts, top-8) on GPUs; a tiny one on CPU
SIGMOID_ROUTED = (8192, 4096, 1408, 128, 8) if ON_GPU else (40, 24, 12, 8, 3)


@pytest.mark.parametrize("impl", ["eager-loop", "torch._grouped_mm", "tritonlm"])
def test_sigmoid_routed_moe_layer_fwd_bwd(benchmark, impl):
    """DeepSeek-V3 / GLM-4.5's routed layer, router included: sigmoid scores with a correction bias, 8 groups of
    which 4 compete, weights x 2.5, then the experts (the shared experts are a dense SwiGLU, timed elsewhere)."""
    fn = _implementation(impl)
    tokens, d_model, d_ff, experts, top_k = SIGMOID_ROUTED
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    hidden, gate_up, down, grad = _stacked_inputs(tokens, d_model, d_ff, experts, gen)
    router = (torch.randn(experts, d_model, device=DEVICE, generator=gen) * 0.02).requires_grad_()
    bias = torch.randn(experts, device=DEVICE, generator=gen) * 0.01

    def step():
        _, weights, index = moe_router(hidden, router, top_k, scoring="sigmoid", choice_bias=bias, n_group=8 if
                                       experts % 8 == 0 else 1, topk_group=4 if experts % 8 == 0 else 1,
                                       routed_scaling_factor=2.5)
        fn(hidden, index, weights, gate_up, down).backward(grad)

    mean = run(benchmark, step)
    benchmark.group = f"sigmoid-routed MoE layer fwd+bwd T{tokens} H{d_model} I{d_ff} E{experts} K{top_k}"
    benchmark.extra_info.update(device=MACHINE.get()["device"],
                                active_TFLOPs=3 * 2 * tokens * top_k * 3 * d_model * d_ff / mean / 1e12)
