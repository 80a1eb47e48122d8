"""Gated DeltaNet, chunked forward + backward, one comparison per shape in one process: transformers' torch fallback
(``torch_chunk_gated_delta_rule``, when transformers is installed), flash-linear-attention's Triton kernel (when
``fla`` is installed, GPU) and ``kernels.chunk_gated_delta_rule``; Qwen3.5's layer (H 16, HV 32, K = V = 128, bf16,
T 4K and 16K) on GPUs, a tiny one on CPU. Then the decoding step (``fused_recurrent``), its bandwidth on the state.
Targets (GPU, DESIGN §Performance): ahead of flash-linear-attention, >= 10x the torch fallback."""

import pytest
import torch
import torch.nn.functional as TF

from tritonlm.kernels import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

from benchutil import DEVICE, MACHINE, ON_GPU, gated_delta_baselines, run

DTYPE = torch.bfloat16 if ON_GPU else torch.float32
# (seq, H, HV, d)
SHAPES = [(4096, 16, 32, 128), (16384, 16, 32, 128)] if ON_GPU else [(70, 2, 4, 16)]


def _inputs(seq, heads, v_heads, d, gen):
    q = torch.randn(1, seq, heads, d, device=DEVICE, dtype=DTYPE, generator=gen, requires_grad=True)
    k = torch.randn(1, seq, heads, d, device=DEVICE, dtype=DTYPE, generator=gen, requires_grad=True)
    v = torch.randn(1, seq, v_heads, d, device=DEVICE, dtype=DTYPE, generator=gen, requires_grad=True)
    g = TF.logsigmoid(torch.randn(1, seq, v_heads, device=DEVICE, generator=gen) + 3).requires_grad_()
    beta = torch.rand(1, seq, v_heads, device=DEVICE, dtype=DTYPE, generator=gen).requires_grad_()
    return q, k, v, g, beta


@pytest.mark.parametrize("impl", ["transformers-torch", "flash-linear-attention", "tritonlm"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-H{}-HV{}-d{}".format(*s))
def test_chunk_gated_delta_rule_fwd_bwd(benchmark, shape, impl):
    fn = {**gated_delta_baselines(), "tritonlm": chunk_gated_delta_rule}.get(impl)
    if fn is None:
        pytest.skip(f"{impl}: not available here (transformers, or flash-linear-attention on a GPU)")
    inputs = _inputs(*shape, torch.Generator(device=DEVICE).manual_seed(0))

    def step():
        fn(*inputs, use_qk_l2norm_in_kernel=True)[0].sum().backward()

    run(benchmark, step)
    benchmark.group = "gated delta fwd+bwd T{} H{} HV{} d{}".format(*shape)
    benchmark.extra_info.update(device=MACHINE.get()["device"])


@pytest.mark.parametrize("batch", [1, 64] if ON_GPU else [2])
def test_recurrent_decode_step(benchmark, batch):
    """One token per sequence against an fp32 state ``[batch, 32, 128, 128]``: the state is read and written once."""
    heads, v_heads, d = (16, 32, 128) if ON_GPU else (2, 4, 16)
    q = torch.randn(batch, 1, heads, d, device=DEVICE, dtype=DTYPE)
    v = torch.randn(batch, 1, v_heads, d, device=DEVICE, dtype=DTYPE)
    g, beta = -torch.rand(batch, 1, v_heads, device=DEVICE), torch.rand(batch, 1, v_heads, device=DEVICE)
    state = torch.randn(batch, v_heads, d, d, device=DEVICE)
    mean = run(benchmark, lambda: fused_recurrent_gated_delta_rule(q, q, v, g, beta, initial_state=state,
                                                                   output_final_state=True))
    benchmark.group = "gated delta decode step"
    benchmark.extra_info.update(device=MACHINE.get()["device"], state_GBps=2 * state.numel() * 4 / mean / 1e9)
